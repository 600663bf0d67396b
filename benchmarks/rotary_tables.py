"""Rotary embeddings: tables computed inside the compiled graph against tables read from buffers.

Before the model kept its rotary tables as buffers (:class:`simplefsdp.models.llama.RotaryTables`),
it computed them in forward, inside the compiled graph, and Inductor recomputed the cos and sin in
every kernel that applies them. This times ``apply_rotary`` on q and k of one attention layer of a
config's model (batch, seq_len, heads, head_dim as the config gives them), forward and backward,
compiled, both ways, with CUDA events (median of ``--steps`` after ``--warmup``), and reports the
difference per step (times the config's layers).

    python benchmarks/rotary_tables.py --config configs/gpu_moe.toml --out benchmarks/results/rotary_tables_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from report import environment, output_arguments, publish, table  # noqa: E402

from simplefsdp.models.llama import RotaryTables, apply_rotary, rotary_tables  # noqa: E402
from simplefsdp.train.config import load  # noqa: E402


def _in_graph(q, k, rotary):
    """The tables computed where they are used, as forward did before the buffers."""
    cos, sin = rotary_tables(q.shape[1], rotary.head_dim, rotary.theta, q.device)
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _from_buffers(q, k, rotary):
    cos, sin = rotary(q.shape[1])
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _time(fn, inputs, warmup: int, steps: int) -> float:
    times = []
    for i in range(warmup + steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        q, k = fn(*inputs)
        (q.float().sum() + k.float().sum()).backward()
        end.record()
        end.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def markdown(result: dict) -> str:
    rows = result["rows"]
    return f"**{result['environment']}**: `{result['command']}`.\n\n" + table(
        ["tables", "ms per layer (fwd+bwd)", f"ms per step ({result['n_layers']} layers)"],
        [[r["tables"], r["ms"], r["ms"] * result["n_layers"]] for r in rows],
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "configs/gpu_moe.toml"))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    output_arguments(p)
    args = p.parse_args()
    if args.report:
        result = json.load(open(args.report))
    else:
        cfg = load(args.config, [])
        m, t = cfg.model_config(), cfg.training
        device = torch.device("cuda")
        rotary = RotaryTables(m).to(device)
        shape = lambda heads: (t.global_batch, t.seq_len, heads, m.head_dim)
        inputs = [torch.randn(shape(h), device=device, dtype=torch.bfloat16, requires_grad=True) for h in (m.n_heads, m.n_kv_heads)]
        rows = []
        for name, fn in (("computed in the graph", _in_graph), ("buffers", _from_buffers)):
            torch._dynamo.reset()
            compiled = torch.compile(lambda q, k, fn=fn: fn(q, k, rotary))
            rows.append(dict(tables=name, ms=_time(compiled, inputs, args.warmup, args.steps)))
        result = dict(environment=environment(torch.cuda.get_device_name()), command="python " + " ".join(sys.argv),
                      n_layers=m.n_layers, rows=rows)
    publish("rotary_tables", "Rotary tables", markdown, result, args)


if __name__ == "__main__":
    main()
