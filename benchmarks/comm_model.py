"""Communication cost model: exposed communication per training step at N GPUs, passes on vs off.

No GPUs needed. For a config and a parallel layout at world size N, one process under the fake
process group (rank 0 of N) compiles forward and backward with a backend that runs Inductor's
own graph pipeline (decompositions, joint-graph passes, partitioner, post-grad passes) up to the
point where it would generate code, and keeps the post-grad graph twice: before our passes (the
graph compiled with the passes off) and after them. The compiled functions never run: they
return empty tensors of the right shapes, so a 1.7B-parameter model costs only its tracing.

The graphs are the GPU's: experts run on ``torch._grouped_mm`` as they do on CUDA in bf16 (its CPU
stand-in indexes weights per row, which changes what backward saves and so what it re-gathers),
and attention counts the FLOPs of the fused kernel. Each graph is then costed node by node:

* a collective moves its bytes over its process group: ``latency + bytes * (n-1)/n / busbw``
  (twice that for an all-reduce), where the bus bandwidth grows with the message size toward the
  NVLink peak for groups inside one node of ``--gpus-per-node`` ranks, and toward the inter-node
  bandwidth for groups that span nodes (:class:`Links`, whose defaults cite published
  nccl-tests runs; ``--bandwidth-sweep`` takes a measured sweep instead);
* a matmul, grouped matmul or attention node costs its FLOPs at a compute rate; other nodes cost
  nothing. Two rates are reported: the measured dense matmul ceiling
  (``benchmarks/results/moe_kernels_h200.json``), which leaves out all non-matmul time and so
  overstates what communication cannot hide, and the model FLOP/s that compiled SimpleFSDP reached
  on one GPU (``benchmarks/results/step_time_moe_h200.json``), which spreads the measured step
  time over the matmuls;

and simulated in graph order with one compute stream and one stream per process group: a
collective starts once the compute stream has reached it and its group's previous collective has
finished; a wait stalls the compute stream until its collective is done. Exposed communication is
the total stall; the all-to-all hidden is the share of all-to-all time that never stalls compute.
Routing is assumed balanced: every expert-parallel split (an unbacked size in the graph) is the
rank's routed rows of one token chunk over ``ep``. Each rank trains on ``--seqs-per-rank``
sequences. Each layout is costed in three schedules (:data:`SCHEDULES`): no passes, the default
passes with one token chunk per MoE layer, and with two.

What it leaves out: collectives of different groups share no bandwidth (each gets its link's
full rate even when they run at once), routing is balanced, a host sync (the split sizes' ``tolist``)
costs nothing, and non-matmul kernels cost nothing at the ``matmul`` rate.

    python benchmarks/comm_model.py --worlds 8,64 --seqs-per-rank 1,4,8 [--out benchmarks/results/comm_model.json] [--results-md]
    python benchmarks/comm_model.py --report benchmarks/results/comm_model.json   # RESULTS.md section
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time
from unittest import mock

import sympy
import torch
import torch.distributed as dist
from torch._guards import detect_fake_mode
from torch._inductor.compile_fx import _recursive_post_grad_passes, compile_fx
from torch._inductor.virtualized import V
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

import simplefsdp.moe.grouped_mm
import simplefsdp.models.moe
from simplefsdp.train.config import load, validate
from simplefsdp.train.metrics import flops_per_token
from simplefsdp.models.llama import cross_entropy_loss
from simplefsdp.passes import SimpleFSDPPasses
from simplefsdp.passes.ops import COLLECTIVES, MATMULS
from simplefsdp.passes.fx_utils import collective_group, op_name, pinned_call, waited_collective
from simplefsdp.train.cli import build

from report import command_line, environment, output_arguments, publish, table
from step_time import CONFIGS as STEP_TIME_CONFIGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "benchmarks", "results", "moe_kernels_h200.json")
STEP_TIME = os.path.join(ROOT, "benchmarks", "results", "step_time_moe_h200.json")
ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}


@dataclasses.dataclass
class Layout:
    """A parallel layout: dp_shard takes the ranks that dp_replicate, tp and ep leave."""

    dp_replicate: int = 1
    tp: int = 1
    ep: int = 1
    hsdp_shard: int = 0  # HSDP: this many ranks per shard group, dp_replicate the rest

    def degrees(self, world: int) -> dict[str, int]:
        replicate = world // self.hsdp_shard if self.hsdp_shard else self.dp_replicate
        return dict(dp_replicate=replicate, dp_shard=world // (replicate * self.tp), tp=self.tp, ep=self.ep)

    def fits(self, world: int) -> bool:
        """Whether the layout can use ``world`` ranks (HSDP: two replicas at least; ep must divide
        the ranks experts spread over)."""
        if self.hsdp_shard:
            return world % self.hsdp_shard == 0 and world >= 2 * self.hsdp_shard
        if world % (self.dp_replicate * self.tp):
            return False
        return self.degrees(world)["dp_shard"] * self.tp % self.ep == 0  # ep splits dp_shard x tp

    def overrides(self, world: int) -> list[tuple[str, str]]:
        """Config overrides (``--section.key value`` pairs) for this layout at ``world`` ranks."""
        d = self.degrees(world)
        out = [(f"parallel.{key}", str(value)) for key, value in d.items()]
        return out + ([("parallel.mode", "hybrid_shard")] if self.hsdp_shard else [])

    def name(self, world: int) -> str:
        d = self.degrees(world)
        head = f"HSDP {d['dp_replicate']}x{d['dp_shard']}" if self.hsdp_shard else f"FSDP{d['dp_shard']}"
        experts = f" (experts FSDP{d['dp_shard'] * self.tp // self.ep}×EP{self.ep})" if self.ep > 1 else ""
        return head + (f"×TP{self.tp}" if self.tp > 1 else "") + experts


LAYOUTS = {"fsdp": Layout(), "fsdp_ep2": Layout(ep=2), "fsdp_ep8": Layout(ep=8), "fsdp_tp2_ep2": Layout(tp=2, ep=2),
           "hsdp_4": Layout(hsdp_shard=4)}


@dataclasses.dataclass
class Node:
    """What the simulation needs of one graph node."""

    name: str
    kind: str  # collective | wait | compute
    op: str
    group: str | None = None
    nbytes: int = 0
    flops: int = 0
    waits_for: str | None = None


def _concrete(value, unbacked: dict) -> int:
    """An int from a size that may hold unbacked symbols (replaced by their balanced values)."""
    if isinstance(value, torch.SymInt):
        expr = sympy.sympify(value.node.expr).xreplace(unbacked)
        if expr.free_symbols:
            raise ValueError(f"size {value.node.expr} depends on symbols the model does not know: {expr.free_symbols}")
        return int(expr)
    return int(value)


def _shape(val, unbacked: dict) -> list[int]:
    return [_concrete(s, unbacked) for s in val.shape]


def _nbytes(val, unbacked: dict) -> int:
    if isinstance(val, (list, tuple)):  # a coalesced collective's outputs
        return sum(_nbytes(v, unbacked) for v in val)
    numel = 1
    for s in _shape(val, unbacked):
        numel *= s
    return numel * val.dtype.itemsize


def _flops(name: str, node: torch.fx.Node, unbacked: dict) -> int:
    vals = [a.meta["val"] for a in node.args if isinstance(a, torch.fx.Node)]
    if name in MATMULS:  # [.., m, k] @ [.., k, n] and the grouped forms: 2 * numel(a) * n
        a, b = vals[-2:] if name in ("addmm", "baddbmm") else vals[:2]
        numel = 1
        for s in _shape(a, unbacked):
            numel *= s
        return 2 * numel * _shape(b, unbacked)[-1]
    if name in ATTENTION:
        q, k, v = (_shape(x, unbacked) for x in vals[:3])
        return sdpa_flop_count(q, k, v)
    if name.endswith("_backward") and name.removesuffix("_backward") in ATTENTION:
        grad_out, q, k, v = (_shape(x, unbacked) for x in vals[:4])
        return sdpa_backward_flop_count(grad_out, q, k, v)
    return 0


def snapshot(graph: torch.fx.Graph, unbacked: dict) -> list[Node]:
    """The graph's collectives, waits and FLOP-costing nodes, in order."""
    out = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        call = pinned_call(node)
        name = op_name(call)
        if name in COLLECTIVES:
            collective = COLLECTIVES[name]
            side = call if collective.bytes_side == "out" else call.args[0]
            val = [n.meta["val"] for n in side] if isinstance(side, (list, tuple)) else side.meta["val"]
            out.append(Node(node.name, "collective", collective.kind, collective_group(call), _nbytes(val, unbacked)))
        elif name == "wait_tensor":
            out.append(Node(node.name, "wait", name, waits_for=waited_collective(node, call).name))
        elif flops := _flops(name or "", call, unbacked):
            out.append(Node(node.name, "compute", name, flops=flops))
    return out


class Capture:
    """A torch.compile backend: Inductor's pipeline up to code generation, graphs kept, no run.

    ``graphs`` collects ``(forward|backward, {"off": nodes, "on": nodes})`` in compile order.
    """

    def __init__(self, passes: SimpleFSDPPasses, unbacked_value: int):
        self.passes, self.unbacked_value = passes, unbacked_value
        self.graphs: list[tuple[str, dict[str, list[Node]]]] = []

    def __call__(self, gm, example_inputs):
        return compile_fx(gm, example_inputs, inner_compile=self._inner)

    def _unbacked(self, graph: torch.fx.Graph) -> dict:
        # the only data-dependent sizes are the expert-parallel splits read with tolist()
        symbols = {}
        for node in graph.nodes:
            val = node.meta.get("val")
            if isinstance(val, torch.SymInt):
                symbols.update({s: sympy.Integer(self.unbacked_value) for s in sympy.sympify(val.node.expr).free_symbols})
        return symbols

    def _inner(self, gm, example_inputs, **kwargs):
        kept, unbacked = {}, self._unbacked(gm.graph)  # the passes add no data-dependent sizes

        def post_pass(graph):
            kept["off"] = snapshot(graph, unbacked)
            self.passes(graph)
            kept["on"] = snapshot(graph, unbacked)

        fake_mode = detect_fake_mode(example_inputs) or FakeTensorMode()
        with torch._inductor.config.patch(post_grad_custom_post_pass=post_pass), V.set_fake_mode(fake_mode):
            _recursive_post_grad_passes(gm, is_inference=False)
        self.graphs.append(("backward" if kwargs.get("is_backward") else "forward", kept))
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]

        def dry_run(args):
            args.clear()
            return [_empty_like(o.meta["val"], unbacked) if isinstance(o, torch.fx.Node) else o for o in outputs]

        dry_run._boxed_call = True
        return dry_run


def _empty_like(val, unbacked: dict):
    if isinstance(val, torch.Tensor):
        shape = _shape(val, unbacked)
        return torch.empty(shape, dtype=val.dtype, device=val.device)
    if isinstance(val, torch.SymInt):
        return _concrete(val, unbacked)
    return val


# Default collective costs: NVLink 4 / NVSwitch (H100 and H200 share them), nccl-tests bus bandwidth.
# - 370 GB/s: what NCCL reaches over NVLink on 8 H100s for all-gather and reduce-scatter at large
#   sizes, "256M is too small to reach peak" (S. Jeaugey, NVIDIA/nccl-tests#212, 2024-05-06);
# - 335 GB/s: alltoall_perf on 4 H100s at 500 MB, busbw 335-338 GB/s (NVIDIA/nccl#2169);
# - 48 GB/s between nodes: one 400 Gb/s NDR NIC per GPU reaches 46-48 GB/s (NVIDIA/nccl-tests#290);
# - 12 us: the small-message time of an 8-GPU NVLink-4 all-reduce (H20, deepseek-ai/DeepEP#303).
# Below the peak, bus bandwidth grows with message size: busbw(S) = peak * S / (S + HALF_MB), the
# saturating shape of those sweeps; HALF_MB = 4 puts 1 MB at 20% of the peak, 16 MB at 80% and
# 256 MB at 98%. A measured sweep (benchmarks/multi_gpu.py's, --bandwidth-sweep) replaces all of it.
NVLINK_GBPS, ALL_TO_ALL_GBPS, INTER_NODE_GBPS, LATENCY_US, HALF_MB = 370.0, 335.0, 48.0, 12.0, 4.0


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear in log(x) through sorted ``(x, y)`` points, constant beyond the ends."""
    import math

    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)
    return points[-1][1]


@dataclasses.dataclass
class Links:
    """Collective cost: ``latency + factor * bytes * (n-1)/n / busbw(kind, bytes)``.

    ``busbw`` saturates with message size toward the peak of the link (``intra_gbps`` for
    gathers and reductions inside a node of ``gpus_per_node`` ranks, ``all_to_all_gbps`` for
    all-to-alls there, ``inter_gbps`` across nodes), half of it at ``half_mb``; ``half_mb = 0``
    is a flat bandwidth. ``sweep`` (kind -> measured ``(bytes, busbw GB/s)`` points in a node)
    replaces the formula, latency included, for the kinds it covers. An all-reduce moves twice.
    """

    intra_gbps: float = NVLINK_GBPS
    inter_gbps: float = INTER_NODE_GBPS
    latency_us: float = LATENCY_US
    gpus_per_node: int = 8
    all_to_all_gbps: float | None = ALL_TO_ALL_GBPS  # None: intra_gbps
    half_mb: float = HALF_MB
    sweep: dict[str, list[tuple[float, float]]] | None = None

    def bus_gbps(self, kind: str, nbytes: int, inside: bool) -> float:
        if inside and self.sweep and kind in self.sweep:
            return _interpolate(self.sweep[kind], nbytes)
        peak = self.inter_gbps if not inside else (self.all_to_all_gbps or self.intra_gbps) if kind == "all_to_all" else self.intra_gbps
        return peak * nbytes / (nbytes + self.half_mb * 1e6) if self.half_mb else peak

    def seconds(self, kind: str, nbytes: int, ranks: list[int]) -> float:
        n = len(ranks)
        if n == 1 or nbytes == 0:
            return 0.0
        inside = len({r // self.gpus_per_node for r in ranks}) == 1
        factor = 2 if kind == "all_reduce" else 1
        latency = 0.0 if inside and self.sweep and kind in self.sweep else self.latency_us * 1e-6
        return latency + factor * nbytes * (n - 1) / n / (1e9 * self.bus_gbps(kind, nbytes, inside))


def sweep_from_results(path: str) -> dict[str, list[tuple[float, float]]]:
    """Measured ``(bytes, busbw)`` points per kind from ``benchmarks/multi_gpu.py``'s results file."""
    out: dict[str, list[tuple[float, float]]] = {}
    for row in json.load(open(path))["sweep"]:
        out.setdefault(row["op"], []).append((row["mb"] * 1e6, row["bus_gbps"]))
    return {kind: sorted(points) for kind, points in out.items()}


def simulate(graphs: list[list[Node]], group_ranks: dict[str, list[int]], links: Links, flops_per_s: float) -> dict:
    """Step time, compute, communication and exposed communication (seconds) of graphs run in
    order; ``a2a_s`` and ``a2a_exposed_s`` are the all-to-alls' share of the last two."""
    now = compute = comm = exposed = a2a = a2a_exposed = 0.0
    free, done, kind = {}, {}, {}
    for nodes in graphs:
        for node in nodes:
            if node.kind == "compute":
                cost = node.flops / flops_per_s
                now += cost
                compute += cost
            elif node.kind == "collective":
                cost = links.seconds(node.op, node.nbytes, group_ranks[node.group])
                start = max(now, free.get(node.group, 0.0))
                free[node.group] = done[node.name] = start + cost
                kind[node.name] = node.op
                comm += cost
                a2a += cost if node.op == "all_to_all" else 0.0
            elif node.waits_for in done:
                stall = max(0.0, done[node.waits_for] - now)
                exposed += stall
                a2a_exposed += stall if kind[node.waits_for] == "all_to_all" else 0.0
                now += stall
    return dict(step_s=now, compute_s=compute, comm_s=comm, exposed_s=exposed, a2a_s=a2a, a2a_exposed_s=a2a_exposed)


def _group_ranks(nodes: list[Node]) -> dict[str, list[int]]:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return {n.group: dist.get_process_group_ranks(_resolve_process_group(n.group)) for n in nodes if n.group}


@contextlib.contextmanager
def grouped_mm_kernels():
    """Trace experts through ``torch._grouped_mm`` on the CPU too (bf16), as they run on a GPU."""
    native = lambda x, w: x.dtype == w.dtype == torch.bfloat16
    with mock.patch.object(simplefsdp.moe.grouped_mm, "native_available", native), \
            mock.patch.object(simplefsdp.models.moe, "native_available", native):
        yield


def model_layout(config: str, layout: Layout, world: int, seqs_per_rank: int, passes: SimpleFSDPPasses, ep_chunks: int = 1):
    """Compile one step of ``config`` at ``world`` ranks in ``layout`` (MoE layers in
    ``ep_chunks`` token chunks where ``ep > 1``); the captured graphs."""
    d = layout.degrees(world)
    chunks = ep_chunks if layout.ep > 1 else 1
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        dp = d["dp_replicate"] * d["dp_shard"]
        cfg = load(os.path.join(ROOT, config), layout.overrides(world) + [
            ("training.compile", "false"), ("training.global_batch", str(dp * seqs_per_rank)),
            ("parallel.ep_chunks", str(chunks))])
        validate(cfg, world)
        model, _, _ = build(cfg, world, "cpu")
        m, t = cfg.model_config(), cfg.training
        routed_rows = seqs_per_rank * t.seq_len * getattr(m, "top_k", 1) // d["tp"]
        capture = Capture(passes, routed_rows // (d["ep"] * chunks))  # each chunk's split per ep rank
        step = torch.compile(lambda x, y: cross_entropy_loss(model(x), y), backend=capture, fullgraph=True)
        tokens = torch.zeros(seqs_per_rank, t.seq_len, dtype=torch.long)
        with grouped_mm_kernels():
            step(tokens, tokens).backward()
        graphs = capture.graphs
        ranks = _group_ranks([n for _, g in graphs for n in g["off"] + g["on"]])
        return graphs, ranks
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def _summary(nodes: list[Node]) -> dict[str, list]:
    """Per collective kind: [count, GB]."""
    out = {}
    for n in nodes:
        if n.kind == "collective":
            count, gb = out.get(n.op, [0, 0.0])
            out[n.op] = [count + 1, gb + n.nbytes / 1e9]
    return out


def achieved_tflops(path: str = STEP_TIME) -> float | None:
    """Model FLOP/s of compiled SimpleFSDP on one GPU (``benchmarks/step_time.py``'s MoE run)."""
    if not os.path.exists(path):
        return None
    for r in json.load(open(path))["rows"]:
        if (r["model"], r["ac"], r["mode"]) == ("moe", "none", "SimpleFSDP compiled"):
            cfg = load(os.path.join(ROOT, STEP_TIME_CONFIGS["moe"]))
            return r["tokens_per_s"] * flops_per_token(cfg.model_config(), cfg.training.seq_len) / 1e12
    return None


SCHEDULES = {  # name -> (token chunks per MoE layer, passes on)
    "off": (1, False),  # no passes: every collective waited on where traced
    "passes": (1, True),  # the default passes with one chunk: all-to-alls overlap shared experts only
    "chunked": (2, True),  # the default passes with two chunks: routed experts under the other chunk's all-to-alls
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/gpu_moe.toml")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, from {list(LAYOUTS)}")
    p.add_argument("--worlds", default="8,64")
    p.add_argument("--seqs-per-rank", default="1,4,8", help="comma-separated: sequences each rank trains on")
    p.add_argument("--intra-gbps", type=float, default=Links.intra_gbps)
    p.add_argument("--all-to-all-gbps", type=float, default=Links.all_to_all_gbps)
    p.add_argument("--inter-gbps", type=float, default=Links.inter_gbps)
    p.add_argument("--latency-us", type=float, default=Links.latency_us)
    p.add_argument("--half-mb", type=float, default=Links.half_mb, help="message size at half the peak bus bandwidth; 0: flat")
    p.add_argument("--gpus-per-node", type=int, default=Links.gpus_per_node)
    p.add_argument("--bandwidth-sweep", help="a benchmarks/multi_gpu.py results file: its NCCL sweep replaces the formula")
    p.add_argument("--matmul-tflops", type=float, help="default: the measured dense ceiling in " + KERNELS)
    p.add_argument("--achieved-tflops", type=float,
                   help="a second compute rate: default, the model FLOP/s measured in " + STEP_TIME)
    output_arguments(p)
    args = p.parse_args()
    if args.report:
        return publish("comm_model", "Communication cost model", markdown, json.load(open(args.report)), args)
    sweep = sweep_from_results(args.bandwidth_sweep) if args.bandwidth_sweep else None
    links = Links(args.intra_gbps, args.inter_gbps, args.latency_us, args.gpus_per_node, args.all_to_all_gbps, args.half_mb, sweep)
    rates = {"matmul": args.matmul_tflops or json.load(open(KERNELS))["rows"][0]["tflops"]}
    if achieved := args.achieved_tflops or achieved_tflops():
        rates["achieved"] = achieved
    rows = []
    for seqs in map(int, args.seqs_per_rank.split(",")):
        for world in map(int, args.worlds.split(",")):
            for key in args.layouts.split(","):
                layout = LAYOUTS[key]
                if not layout.fits(world):
                    print(f"{key}: does not fit {world} ranks, skipped", flush=True)
                    continue
                captured = {}
                for schedule, (chunks, on) in SCHEDULES.items():
                    if chunks > 1 and layout.ep == 1:
                        continue
                    begin = time.perf_counter()
                    if chunks not in captured:
                        captured[chunks] = model_layout(args.config, layout, world, seqs, SimpleFSDPPasses(), chunks)
                    graphs, ranks = captured[chunks]
                    nodes = [g["on" if on else "off"] for _, g in graphs]
                    sims = {name: simulate(nodes, ranks, links, tflops * 1e12) for name, tflops in rates.items()}
                    rows.append(dict(world=world, seqs_per_rank=seqs, layout=layout.name(world), schedule=schedule,
                                     simulated=sims, collectives=_summary([n for g in nodes for n in g])))
                    print(rows[-1], f"({time.perf_counter() - begin:.0f} s)", flush=True)
    result = dict(environment=environment("CPU, fake process group"), command=command_line(), config=args.config,
                  links={k: v for k, v in dataclasses.asdict(links).items() if k != "sweep"},
                  bandwidth_sweep=args.bandwidth_sweep, rates_tflops=rates, rows=rows)
    publish("comm_model", "Communication cost model", markdown, result, args)


def markdown(result: dict) -> str:
    links, rates = result["links"], result["rates_tflops"]
    rate_text = {"matmul": f"the dense matmul ceiling, {rates['matmul']:.0f} TFLOP/s",
                 "achieved": f"the model FLOP/s compiled SimpleFSDP reached on one GPU, {rates.get('achieved', 0):.0f} TFLOP/s"}
    if result.get("bandwidth_sweep"):
        bandwidth = f"the NCCL sweep in `{result['bandwidth_sweep']}`"
    elif links.get("half_mb"):
        bandwidth = (f"bus bandwidth saturating with message size toward {links['intra_gbps']:.0f} GB/s "
                     f"(all-to-all {links['all_to_all_gbps'] or links['intra_gbps']:.0f}), half of it at "
                     f"{links['half_mb']:g} MB, plus {links['latency_us']:g} µs per collective")
    else:  # results of the flat-bandwidth model (before message sizes)
        bandwidth = f"{links['intra_gbps']:.0f} GB/s at any size, plus {links['latency_us']:g} µs per collective"
    head = (f"**{result['environment']}**: `{result['command']}`; `{result['config']}`; {bandwidth} in a node of "
            f"{links['gpus_per_node']}, {links['inter_gbps']:.0f} GB/s between nodes. Compute at "
            + " and at ".join(f"{rate_text[name]} ({name})" for name in rates) + ". Schedules: `off` (no passes), "
            "`passes` (default passes, one token chunk: all-to-alls under shared experts), `chunked` (default "
            "passes, two token chunks).\n\n")
    rows = []
    for r in result["rows"]:  # older results: passes off / on, one seqs_per_rank for the file, no a2a split
        schedule = r.get("schedule") or {"on": "passes"}.get(r["passes"], r["passes"])
        row = [r["world"], r.get("seqs_per_rank", result.get("seqs_per_rank")), r["layout"], schedule,
               ", ".join(f"{k} {n} ({gb:.2f} GB)" for k, (n, gb) in sorted(r["collectives"].items()))]
        for name in rates:
            sim = r["simulated"][name]
            hidden = 1 - sim["a2a_exposed_s"] / sim["a2a_s"] if sim.get("a2a_s") else None
            row += [f"{1e3 * sim['step_s']:.1f}", f"{1e3 * sim['exposed_s']:.1f} ({100 * sim['exposed_s'] / sim['step_s']:.0f}%)",
                    None if hidden is None else f"{100 * hidden:.0f}% of {1e3 * sim['a2a_s']:.1f}"]
        rows.append(row)
    headers = ["GPUs", "seqs/rank", "layout", "schedule", "collectives per rank per step (bytes)"]
    for name in rates:
        headers += [f"{name}: step ms", f"{name}: exposed comm ms (% of step)", f"{name}: all-to-all hidden (of ms)"]
    return head + table(headers, rows)


if __name__ == "__main__":
    main()
