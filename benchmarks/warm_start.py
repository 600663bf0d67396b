"""Warm start: how long a fresh process takes to its first training step, with an empty compile
cache (cold) and with the cache a cold run left behind (warm).

For each model config, two child processes in turn build the model through the training entry
point (``build``: SimpleFSDP compiled with our passes) and run one ``train_step``, both with the
same fresh ``TORCHINDUCTOR_CACHE_DIR``. Reported per run: the first step's seconds (tracing and
compiling included), the child's whole wall time (imports and model build too), and torch's
compile-cache counters (AOTAutograd and FX-graph hits, misses and bypasses), so that a warm run
that recompiled shows as a miss, not just as a slow number. With ``--set training.precompile=true``
the compiled model is saved per rank (:mod:`simplefsdp.precompile`) in the cache dir the two
children share; the "graph" column says whether a child traced it, compiled and saved it, or
loaded it.

With ``--ranks N`` each child is N gloo ranks on CPU (``torch.distributed.run``): the first step
is the slowest rank's, the counters are summed over ranks. Without it, one process on one device
(world 1: no collective runs).

    python benchmarks/warm_start.py --models moe --out benchmarks/results/warm_start_h200.json
    python benchmarks/warm_start.py --models configs/debug_dense.toml --set parallel.dp_shard=1   # CPU
    python benchmarks/warm_start.py --models configs/debug_moe.toml,configs/debug_dense.toml --ranks 4   # CPU
    python benchmarks/warm_start.py --models configs/debug_moe.toml --ranks 4 --set training.precompile=true
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTERS = ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass", "fxgraph_cache_hit",
            "fxgraph_cache_miss", "fxgraph_cache_bypass")


PROFILED_FUNCTIONS = 25  # with --profile: the functions with the most cumulative time in the first step


def _profiled(call):
    """Run ``call()`` under cProfile; the functions with the most cumulative seconds in it, as
    ``[seconds, "file:line(function)"]``."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.runcall(call)
    stats = pstats.Stats(profiler).stats  # (file, line, function) -> (calls, ..., total, cumulative, callers)
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][3])[:PROFILED_FUNCTIONS]
    return [[round(v[3], 3), f"{os.path.basename(f)}:{line}({fn})"] for (f, line, fn), v in ranked]


def child(config: str, overrides: list[str], profile: bool = False) -> dict:
    """Build and run one step here; the first step's seconds and the cache counters (with
    ``profile``, also where the first step spent its host time)."""
    import torch
    from torch._dynamo.utils import counters

    import torch.distributed as dist

    from simplefsdp.train.cli import build, loss_function, train_step
    from simplefsdp.train.config import load, validate
    from simplefsdp.train.data import data_parallel_rank, rank_slice, token_stream
    from step_time import start_ranks

    device = start_ranks()
    world = dist.get_world_size()
    cfg = load(config, [kv.split("=", 1) for kv in overrides] + [("training.compile", "true")])
    validate(cfg, world)
    model, runner, optimizer = build(cfg, world, device.type)
    t = cfg.training
    dp_rank, dp_size = data_parallel_rank(cfg.parallel.tp)
    batch = token_stream(t.dataset, cfg.model_config().vocab_size, t.global_batch, t.seq_len, t.seed).batch(0)
    batch = tuple(x.to(device) for x in rank_slice(batch, dp_rank, dp_size))

    def first_step():
        train_step(runner, optimizer, batch, params=list(model.parameters()), dp_size=dp_size, max_norm=t.max_norm,
                   loss_fn=loss_function(cfg, device.type))
        if device.type == "cuda":
            torch.cuda.synchronize()

    start = time.perf_counter()
    where = _profiled(first_step) if profile else first_step()
    seconds = time.perf_counter() - start
    seen = {**counters["aot_autograd"], **counters["inductor"]}
    mine = {"first_step_s": seconds, **{name: seen.get(name, 0) for name in COUNTERS},
            "graph": getattr(runner, "origin", None) or "traced"}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    result = {k: max(r[k] for r in ranks) if k == "first_step_s" else ",".join(sorted({r[k] for r in ranks}))
              if k == "graph" else sum(r[k] for r in ranks) for k in mine}
    return {**result, "profile_rank0": where} if profile else result


def run_twice(config: str, overrides: list[str], ranks: int = 1, profile: bool = False) -> list[dict]:
    """A cold and a warm child (a process, or ``ranks`` CPU ranks) on one fresh cache dir; with
    ``profile`` the warm child profiles its first step."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="warm-start-cache-"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.path.join(ROOT, "benchmarks"), env.get("PYTHONPATH")) if p)
    rows = []
    for run in ("cold", "warm"):
        begin = time.perf_counter()
        launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", "29518"]
        flags = ["--profile"] if profile and run == "warm" else []
        out = subprocess.run([sys.executable, *launcher, __file__, "--child", config, *flags,
                              *sum((["--set", kv] for kv in overrides), [])],
                             env=env, capture_output=True, text=True, check=False)
        if out.returncode:
            raise RuntimeError(f"{run} run of {config} failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"config": config, "ranks": ranks, "run": run, "wall_s": time.perf_counter() - begin, **result})
    return rows


def table(rows: list[dict]) -> str:
    head = ("| config | ranks | run | graph | first step s | process wall s | AOTAutograd hit / miss / bypass "
            "| FX graph hit / miss |")
    lines = [head, "|" + "---|" * 8]
    for r in rows:
        lines.append(f"| {os.path.basename(r['config'])} | {r.get('ranks', 1)} | {r['run']} | {r.get('graph', 'traced')} | {r['first_step_s']:.1f} | {r['wall_s']:.1f} | "
                     f"{r['autograd_cache_hit']} / {r['autograd_cache_miss']} / {r['autograd_cache_bypass']} | "
                     f"{r['fxgraph_cache_hit']} / {r['fxgraph_cache_miss']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="moe", help="comma-separated: step_time's names (dense, moe, hf_moe) or config paths")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    p.add_argument("--ranks", type=int, default=1, help="CPU gloo ranks per child (torch.distributed.run); 1: one process")
    p.add_argument("--profile", action="store_true",
                   help="profile the warm child's first step (cProfile, rank 0): the functions with the most time")
    p.add_argument("--out", help="results JSON")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        result = child(args.child, args.set, args.profile)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result))
        return
    from step_time import CONFIGS

    rows = []
    for name in args.models.split(","):
        rows += run_twice(os.path.join(ROOT, CONFIGS[name]) if name in CONFIGS else os.path.abspath(name), args.set,
                          args.ranks, args.profile)
    text = table(rows)
    for r in rows:
        if "profile_rank0" in r:
            text += f"\n\nWarm first step of {os.path.basename(r['config'])}, rank 0, cumulative seconds (cProfile):\n"
            text += "\n".join(f"{seconds:8.3f}  {where}" for seconds, where in r["profile_rank0"])
    print(text)
    if args.out:
        from report import command_line, environment

        device = "CPU"
        try:
            import torch

            device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
        except ImportError:
            pass
        with open(args.out, "w") as f:
            json.dump({"environment": environment(device), "command": command_line(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
