"""Training step time: SimpleFSDP against FSDP2 on the same model, data and seed.

For each model config (``configs/gpu_dense.toml``, ``configs/gpu_moe.toml``: bf16 parameters,
fp32 gradient reduction) and each activation-checkpointing setting, it trains

* SimpleFSDP compiled with our passes, and without them,
* SimpleFSDP eager,
* FSDP2 eager, and FSDP2 with every block compiled on its own (``Module.compile``, as torchtitan
  does),

through the training entry point's own ``build`` and ``train_step`` (AdamW, gradient clipping).
Warm-up steps (the first compiles) are excluded; the median of the timed steps, measured with
CUDA events, gives tokens/s. The timed steps run back to back, as the CLI runs them on a GPU (the
host reads a step's loss later, and copies each batch from pinned memory): each is timed from the
end of the one before. With ``--sync-each-step`` each waits for its kernels before the next
begins, as a loop that reads the loss at once does. It reports the ratio to FSDP2 eager, peak
allocated and reserved memory, MFU (:func:`simplefsdp.train.metrics.flops_per_token` over the bf16 peak), the warm-up's extra
time (compile time, with Inductor's caches off so every compile is cold) and whether the losses of
the runs with and without passes are equal bit for bit. With ``--profile`` the compiled SimpleFSDP
and eager FSDP2 runs are profiled for a few more steps and their GPU time split into communication
(NCCL kernels), copies and compute, with the communication time during which no other kernel ran
(exposed), and by category (matmul, grouped matmul, attention, routing and permutation, copies,
optimizer, elementwise and norm: ``kernel_category``, from kernel names). The same profile gives
the GPU's idle time inside a step (``idle_gaps``: no kernel running, as between a host sync and the
next launch), with the largest gaps named by the kernels around them. ``--host-syncs`` runs one more
step under torch's CUDA sync debug mode and lists where the host waited for the GPU (``host_syncs``).

Run plainly it uses one GPU (or the CPU). There every process group has one rank: collectives are
local copies, so it measures what the compiler does to compute, memory and launch overhead, not
communication (``benchmarks/comm_model.py`` models that). Under ``torchrun`` it uses every rank,
each training on its data-parallel slice of the global batch (``benchmarks/multi_gpu.py`` does
that per parallel layout); rank 0 reports, memory is the largest peak over ranks.

    python benchmarks/step_time.py --models moe --out benchmarks/results/step_time_moe_h200.json --profile
    python benchmarks/step_time.py --report benchmarks/results/step_time_*.json   # RESULTS.md section
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import statistics
import time
import traceback

import torch
import torch.distributed as dist

from simplefsdp.grad_squares import tracked_grad_squares
from simplefsdp.train.config import load, validate
from simplefsdp.train.data import rank_slice, to_device, token_stream
from simplefsdp.train.metrics import flops_per_token, peak_flops
from simplefsdp.train.cli import build, loss_function, train_step

from report import command_line, environment, table, write_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"dense": "configs/gpu_dense.toml", "moe": "configs/gpu_moe.toml", "hf_moe": "configs/gpu_hf_moe.toml"}
# name -> (training.baseline, training.compile, training.passes[, training.blocks_once])
MODES = {
    "SimpleFSDP compiled": ("simplefsdp", True, True),
    "SimpleFSDP blocks compiled once": ("simplefsdp", True, True, True),
    "SimpleFSDP compiled (no passes)": ("simplefsdp", True, False),
    "SimpleFSDP eager": ("simplefsdp", False, True),
    "FSDP2 eager": ("fsdp2", False, True),
    "FSDP2 compiled per block": ("fsdp2", True, True),
}
REFERENCE = "FSDP2 eager"
PROFILED = ("SimpleFSDP compiled", "FSDP2 eager", "FSDP2 compiled per block")
TOP_KERNELS = 12  # the kernels with the most GPU time, kept per profiled run
TOP_PER_CATEGORY = 6  # and each category's kernels with the most GPU time
TOP_GAPS = 12  # and the idle gaps with the most time, by the kernels around them
SHOWN_GAPS = 5  # of which the report shows this many per run
GAP_NAME = 80  # characters of a kernel's name in a gap's name
STEP_ANNOTATION = "profiled step"  # the host range of each profiled step
# kernel-name fragments (lower case) by category, first match wins; the rest is elementwise and norm
# work (Inductor's fused pointwise and reduction kernels, torch's elementwise kernels)
KERNEL_CATEGORIES = (
    ("communication", ("nccl",)),
    ("optimizer and clipping", ("adam", "multi_tensor_apply", "lpnorm", "foreach")),
    # CUTLASS grouped GEMM (GroupProblemShape, its prepare_grouped_gemm_data), Inductor's grouped-mm
    # template; not Inductor's pointwise kernels named after the _grouped_mm they feed (weight casts)
    ("grouped matmul", ("grouped_gemm", "groupproblemshape", "ptrarray", "triton_tem_fused__grouped_mm")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("matmul", ("gemm", "nvjet", "xmma", "cutlass", "triton_tem", "wgmma", "matmul")),
    ("routing and permutation", ("sort", "radix", "scan", "topk", "gather", "scatter", "index", "histc", "cumsum",
                                 "permute_rows", "bincount")),
    ("copies", ("memcpy", "memset", "copy_kernel", "catarraybatched")),  # not Inductor's "_to_copy" (a cast)
)
OTHER_CATEGORY = "elementwise and norm"


def kernel_category(name: str) -> str:
    lower = name.lower()
    return next((category for category, fragments in KERNEL_CATEGORIES if any(f in lower for f in fragments)),
                OTHER_CATEGORY)


class StepTimer:
    """Times one step, and its phases between :meth:`mark` calls: CUDA events on a GPU, the wall
    clock elsewhere. With ``wait`` the step's end waits for its kernels (``wall`` then holds them);
    otherwise :meth:`finish` does, once later steps are queued. Timed ``after`` the step before
    it, a step runs from that step's end to its own, any idle time between them included."""

    def __init__(self, device: torch.device, wait: bool = True, after: StepTimer | None = None):
        self.cuda, self.wait, self.after = device.type == "cuda", wait, after
        self.marks: list[tuple[str, object]] = []
        self.seconds = None

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self, phase: str) -> None:
        self.marks.append((phase, self._now()))

    def __enter__(self):
        self.wall = time.perf_counter()
        self.start = self._now()
        return self

    def __exit__(self, *exc):
        self.end = self._now()
        if self.wait:
            self.finish()
        self.wall = time.perf_counter() - self.wall

    def finish(self) -> None:
        """Wait for the step's end, then set ``seconds`` and ``phases``."""
        if self.seconds is not None:
            return
        if self.cuda:
            self.end.synchronize()
        elapsed = (lambda a, b: a.elapsed_time(b) / 1e3) if self.cuda else (lambda a, b: b - a)
        start = self.start if self.after is None else self.after.end
        self.seconds = elapsed(start, self.end)
        self.phases, previous = {}, start
        for phase, event in self.marks:
            self.phases[phase] = elapsed(previous, event)
            previous = event


def _union(intervals) -> list[list[float]]:
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def exposed_time(comm, compute) -> float:
    """How long communication kernels run while no other kernel does, from (start, end) pairs."""
    busy, total, first = _union(compute), 0.0, 0
    for start, end in _union(comm):
        total += end - start
        while first < len(busy) and busy[first][1] <= start:
            first += 1
        k = first
        while k < len(busy) and busy[k][0] < end:
            total -= min(end, busy[k][1]) - max(start, busy[k][0])
            k += 1
    return total


def idle_gaps(kernels, step_starts) -> tuple[float, dict[str, float]]:
    """The time no kernel runs inside the steps, from kernels' ``(start, end, name)`` and the host
    times at which each step began, and that time by gap, named ``"before -> after"`` after the
    kernels around it (summed over gaps of the same name). A gap that holds a step's start counts
    from that start ("step start -> first kernel"): before it the host was between steps, which the
    step timer does not count."""
    total, by_name = 0.0, collections.Counter()
    starts = sorted(step_starts)
    if not starts:
        return total, dict(by_name)
    busy_until, before = starts[0], "step start"
    for start, end, name in sorted(k for k in kernels if k[1] > starts[0]):
        begins = [s for s in starts if busy_until <= s < start]
        if begins:  # a step began in this gap: only its part after that start is the step's
            busy_until, before = begins[-1], "step start"
        if start > busy_until:
            total += start - busy_until
            by_name[f"{before[:GAP_NAME]} -> {name[:GAP_NAME]}"] += start - busy_until
        if end > busy_until:
            busy_until, before = end, name
    return total, dict(by_name.most_common())


def gpu_time_split(prof) -> dict[str, float]:
    """Seconds of GPU kernel time in a profile: NCCL communication, copies/memsets, the rest, and
    the communication time during which no other kernel ran (exposed), and the idle time inside
    the steps (``idle_gaps``)."""
    split = {"comm": 0.0, "copy": 0.0, "compute": 0.0}
    spans = {"comm": [], "other": []}
    named_spans, step_starts = [], []
    kernels: dict[str, float] = {}
    category_of: dict[str, str] = {}  # kernel name (first 160 characters) -> its full name's category
    categories = dict.fromkeys([c for c, _ in KERNEL_CATEGORIES] + [OTHER_CATEGORY], 0.0)
    for event in prof.events():
        if event.name == STEP_ANNOTATION and event.device_type == torch.autograd.DeviceType.CPU:
            step_starts.append(event.time_range.start)
        # kernels only: record_function ranges show up on the device timeline too
        if event.device_type != torch.autograd.DeviceType.CUDA or getattr(event, "is_user_annotation", False):
            continue
        name = event.name.lower()
        kind = "comm" if "nccl" in name else "copy" if name.startswith(("memcpy", "memset")) else "compute"
        split[kind] += event.device_time / 1e6  # microseconds
        short = event.name[:160]
        kernels[short] = kernels.get(short, 0.0) + event.device_time / 1e6
        category_of[short] = kernel_category(event.name)
        categories[category_of[short]] += event.device_time / 1e6
        spans["comm" if kind == "comm" else "other"].append((event.time_range.start, event.time_range.end))
        named_spans.append((event.time_range.start, event.time_range.end, event.name))
    split["exposed_comm"] = exposed_time(spans["comm"], spans["other"]) / 1e6
    idle, gaps = idle_gaps(named_spans, step_starts)
    split["idle"] = idle / 1e6
    split["gaps"] = {name: us / 1e6 for name, us in list(gaps.items())[:TOP_GAPS]}
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])
    split["kernels"] = dict(ranked[:TOP_KERNELS])
    split["categories"] = categories
    split["category_kernels"] = {c: {} for c in categories}
    for name, seconds in ranked:
        top = split["category_kernels"][category_of[name]]
        if len(top) < TOP_PER_CATEGORY:
            top[name] = seconds
    return split


def profile_steps(step, steps: int) -> dict:
    """Profile ``steps`` calls of ``step()``: wall seconds per step and the GPU time split."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        begin = time.perf_counter()
        for _ in range(steps):
            with torch.profiler.record_function(STEP_ANNOTATION):
                step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - begin) / steps
    split = gpu_time_split(prof)
    kernels = {name: seconds / steps for name, seconds in split.pop("kernels").items()}
    categories = {name: seconds / steps for name, seconds in split.pop("categories").items()}
    by_category = {c: {name: seconds / steps for name, seconds in top.items()}
                   for c, top in split.pop("category_kernels").items()}
    gaps = {name: seconds / steps for name, seconds in split.pop("gaps").items()}
    split = {k: v / steps for k, v in split.items()}
    return dict(step_s=wall, **{f"{k}_s": v for k, v in split.items()}, comm_fraction=split["comm"] / wall,
                exposed_fraction=split["exposed_comm"] / wall, top_kernels_s=kernels, categories_s=categories,
                top_kernels_by_category_s=by_category, idle_gaps_s=gaps)


TORCH_DIR = os.path.dirname(torch.__file__)
PEAK_ALLOCATION_SITES = 12  # the allocation sites with the most bytes live at the peak, kept per run
PEAK_LAST_BLOCKS = 6  # and the blocks allocated last before it


def _allocation_site(frames: list[dict]) -> str:
    """Where a block was allocated: the innermost frame outside torch's own Python (Inductor's
    generated code and FSDP2 count as outside), as ``file:line: source``."""
    import linecache

    for f in frames:
        name = f["filename"]
        if not name.startswith(TORCH_DIR) or "/distributed/fsdp/" in name:
            return f"{os.path.basename(name)}:{f['line']}: {linecache.getline(name, f['line']).strip()[:120]}"
    return "(torch internals)"


def live_at_peak(events: list[dict]) -> tuple[int, list[tuple[int, str, int]]]:
    """From the CUDA allocator's alloc and free events: the peak of the bytes allocated since the
    first event, and the blocks allocated since then that are live at it, as (bytes, allocation
    site, index of the alloc event). A block allocated before the first event and freed after
    counts down."""
    live, total, peak, at_peak = {}, 0, 0, {}
    for i, e in enumerate(events):
        if e["action"] == "alloc":
            live[e["addr"]] = (i, e)
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
            total -= e["size"]
    return peak, [(e["size"], _allocation_site(e.get("frames", [])), i) for i, e in at_peak.values()]


def memory_at_peak(step) -> dict:
    """One call of ``step()`` with the CUDA allocator's history on: the bytes allocated before it,
    its peak above them, and what is live at that peak (:func:`live_at_peak`, :func:`peak_summary`)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        events = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, blocks = live_at_peak(events)
    return dict(before_gib=before / 2**30, step_peak_gib=peak / 2**30, events=len(events), **peak_summary(blocks))


def peak_summary(blocks: list[tuple[int, str, int]]) -> dict:
    """What :func:`live_at_peak`'s blocks show: the allocation sites with the most bytes, the
    blocks by size (MiB: count), and the last blocks allocated before the peak (where it is)."""
    sites: dict[str, list[int]] = {}
    for size, site, _ in blocks:
        sites.setdefault(site, [0, 0])[0] += size
        sites[site][1] += 1
    sizes = collections.Counter(f"{size / 2**20:.3f}" for size, _, _ in blocks)
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:PEAK_ALLOCATION_SITES]
    last = sorted(blocks, key=lambda b: b[2])[-PEAK_LAST_BLOCKS:]
    return dict(sites={site: dict(gib=b / 2**30, blocks=n) for site, (b, n) in ranked},
                blocks_by_mib=dict(sorted(sizes.items(), key=lambda kv: -float(kv[0]))),
                last_allocated=[dict(mib=size / 2**20, site=site, event=i) for size, site, i in last])


SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's sync debug mode warns with this


def host_syncs(step) -> dict[str, int]:
    """One call of ``step()`` under torch's CUDA sync debug mode, warning: every place where the
    host waited for the GPU (a value read back, a copy to pageable memory, ...) as ``file:line:
    source`` (generated code included), with how often it waited there. The mode is set back to
    what it was, also when the step fails."""
    import linecache
    import warnings

    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    torch.cuda.synchronize()
    sites = collections.Counter(
        f"{os.path.basename(w.filename)}:{w.lineno}: {linecache.getline(w.filename, w.lineno).strip()[:120]}"
        for w in caught if SYNC_WARNING in str(w.message))
    return dict(sites.most_common())


def run_one(model_name: str, mode: str, ac: str, *, warmup: int, steps: int, device: torch.device,
            profile: int, memory: bool = False, overrides: list[tuple[str, str]] = (),
            sync_each_step: bool = False, syncs: bool = False) -> dict:
    """Train ``warmup + steps`` steps of one model in one mode on every rank; rank 0's figures.

    Each warm-up step waits for its kernels (their wall time gives the compile time). The timed
    steps run back to back, as a training loop that reads each step's loss later does
    (:func:`simplefsdp.train.cli.train_step`); with ``sync_each_step`` each waits for its kernels
    before the next starts, as a loop that reads the loss at once does."""
    baseline, compiled, passes, *blocks_once = MODES[mode]
    overrides = [*overrides, ("parallel.activation_checkpoint", ac), ("training.baseline", baseline),
                 ("training.compile", str(compiled)), ("training.passes", str(passes)),
                 ("training.blocks_once", str(bool(blocks_once)))]
    cfg = load(os.path.join(ROOT, CONFIGS[model_name]), overrides)
    rank, world = dist.get_rank(), dist.get_world_size()
    validate(cfg, world)
    t = cfg.training
    model, runner, optimizer = build(cfg, world, device.type)
    dp_rank, dp_size = rank // cfg.parallel.tp, world // cfg.parallel.tp  # tp is the inner-most mesh dim
    stream = token_stream(t.dataset, cfg.model_config().vocab_size, t.global_batch, t.seq_len, t.seed)
    params, loss_fn = list(model.parameters()), loss_function(cfg, device.type)
    squares = tracked_grad_squares(model)
    losses, timers = [], []

    def step(i: int) -> None:
        batch = to_device(rank_slice(stream.batch(i), dp_rank, dp_size), device)
        back_to_back = not sync_each_step and i >= warmup
        with StepTimer(device, wait=not back_to_back, after=timers[-1] if back_to_back and timers else None) as timer:
            loss, _ = train_step(runner, optimizer, batch, params=params, dp_size=dp_size, max_norm=t.max_norm,
                                 mark=timer.mark, loss_fn=loss_fn, squares=squares)
        losses.append(loss)
        timers.append(timer)

    for i in range(warmup + steps):
        step(i)
    for timer in timers:
        timer.finish()
    median = statistics.median(tm.seconds for tm in timers[warmup:])
    phases = {phase: 1e3 * statistics.median(tm.phases[phase] for tm in timers[warmup:]) for phase in timers[-1].phases}
    tokens_per_s = t.global_batch * t.seq_len / median
    peak = peak_flops(device)
    row = dict(
        model=model_name, ac=ac, mode=mode, world=world, tokens_per_step=t.global_batch * t.seq_len,
        tokens_per_s=tokens_per_s, step_ms=1e3 * median, phase_ms=phases,
        mfu=tokens_per_s * flops_per_token(cfg.model_config(), t.seq_len) / (world * peak) if peak else None,
        compile_s=sum(tm.wall for tm in timers[:warmup]) - warmup * median if compiled else None,
        first_step_s=timers[0].wall, losses=[loss.item() for loss in losses], sync_each_step=sync_each_step,
    )
    if device.type == "cuda":  # the largest over ranks
        peaks = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()], device=device)
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        row.update(peak_allocated_gib=peaks[0].item() / 2**30, peak_reserved_gib=peaks[1].item() / 2**30)
        if profile and mode in PROFILED:
            row["profile"] = profile_steps(lambda: step(len(losses)), profile)
        if memory:
            row["memory_at_peak"] = memory_at_peak(lambda: step(len(losses)))
        if syncs:
            row["host_syncs"] = host_syncs(lambda: step(len(losses)))
    return row


def fresh_device_state(device: torch.device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def add_comparisons(rows: list[dict], deterministic: bool) -> None:
    """Ratio of tokens/s to FSDP2 eager, and (deterministic runs only) bitwise loss equality of
    passes on vs off."""
    key = lambda r, mode: (r.get("layout"), r["model"], r["ac"], mode)
    by_key = {key(r, r["mode"]): r for r in rows}
    for r in rows:
        ref = by_key.get(key(r, REFERENCE))
        ok = ref is not None and "error" not in ref and "error" not in r
        r["ratio"] = r["tokens_per_s"] / ref["tokens_per_s"] if ok else None
        r["memory_ratio"] = r["peak_allocated_gib"] / ref["peak_allocated_gib"] if ok and "peak_allocated_gib" in r else None
        if r["mode"] == "SimpleFSDP compiled" and deterministic:
            off = by_key.get(key(r, "SimpleFSDP compiled (no passes)"))
            r["losses_equal_no_passes"] = off["losses"] == r["losses"] if off and "error" not in off and "error" not in r else None


def markdown(results: list[dict]) -> str:
    """Step-time and profile tables for RESULTS.md (or stdout) from one or more result files."""
    out = []
    for res in results:
        rows = res["rows"]
        tokens = sorted({r["tokens_per_step"] for r in rows if "tokens_per_step" in r})
        out.append(f"**{res['environment']}**: `{res['command']}`; {res['warmup']} warm-up steps, median of "
                   f"{res['steps']} timed steps; {'/'.join(map(str, tokens))} tokens per step"
                   f"{'; deterministic kernels' if res.get('deterministic') else ''}.\n")
        out.append(table(
            ["model", "AC", "run", "tokens/s", "× FSDP2 eager", "step ms", "peak alloc GiB", "× FSDP2 mem",
             "peak reserved GiB", "MFU %", "compile s", "losses = no passes"],
            [[r["model"], r["ac"], r["mode"], r.get("tokens_per_s"), _num(r.get("ratio"), 2), r.get("step_ms"),
              r.get("peak_allocated_gib"), _num(r.get("memory_ratio"), 2), r.get("peak_reserved_gib"),
              _num(100 * r["mfu"], 1) if r.get("mfu") else None, r.get("compile_s"),
              {True: "bitwise", False: "differ", None: None}[r.get("losses_equal_no_passes")]]
             if "error" not in r else [r["model"], r["ac"], r["mode"], "failed: " + r["error"]] + [None] * 8
             for r in rows]))
        split = [r for r in rows if r.get("phase_ms")]
        if split:
            out.append("\nStep split (median ms of each phase; the optimizer phase includes zero_grad):\n")
            phases = list(split[0]["phase_ms"])
            out.append(table(["model", "AC", "run", *phases], [[r["model"], r["ac"], r["mode"], *r["phase_ms"].values()] for r in split]))
        profiled = [r for r in rows if "profile" in r]
        if profiled:
            out.append("\nGPU time per step from the torch profiler (NCCL kernels = communication):\n")
            out.append(table(
                ["model", "AC", "run", "step ms", "NCCL ms", "copy/memset ms", "other kernels ms", "NCCL % of step",
                 "exposed NCCL % of step", "GPU idle ms"],
                [[r["model"], r["ac"], r["mode"], 1e3 * p["step_s"], _num(1e3 * p["comm_s"], 2), _num(1e3 * p["copy_s"], 2),
                  1e3 * p["compute_s"], _num(100 * p["comm_fraction"], 2), _num(100 * p["exposed_fraction"], 2) if "exposed_fraction" in p else None,
                  _num(1e3 * p["idle_s"], 2) if "idle_s" in p else None]
                 for r in profiled for p in [r["profile"]]]))
            by_category = [r for r in profiled if "categories_s" in r["profile"]]
            if by_category:
                names = list(by_category[0]["profile"]["categories_s"])
                out.append("\nGPU kernel time per step by category, ms (`kernel_category` in step_time.py):\n")
                out.append(table(["model", "AC", "run", *names, "sum"],
                                 [[r["model"], r["ac"], r["mode"], *(_num(1e3 * c[n], 2) for n in names),
                                   _num(1e3 * sum(c.values()), 1)]
                                  for r in by_category for c in [r["profile"]["categories_s"]]]))
            gapped = [r for r in profiled if r["profile"].get("idle_gaps_s")]
            if gapped:
                out.append(f"\nThe largest GPU idle gaps inside a step, by the kernels around them (`idle_gaps`), "
                           f"ms per step, {SHOWN_GAPS} per run:\n")
                out.append(table(["model", "AC", "run", "gap", "ms"],
                                 [[r["model"], r["ac"], r["mode"], f"`{name}`", _num(1e3 * seconds, 2)]
                                  for r in gapped for name, seconds in list(r["profile"]["idle_gaps_s"].items())[:SHOWN_GAPS]]))
        waiting = [r for r in rows if "host_syncs" in r]
        if waiting:
            out.append("\nWhere the host waits for the GPU in one step (`host_syncs`, torch's CUDA sync debug mode):\n")
            out.append(table(["model", "AC", "run", "site", "waits"],
                             [[r["model"], r["ac"], r["mode"], f"`{site}`", n] for r in waiting
                              for site, n in (r["host_syncs"].items() or [("none", 0)])]))
        for r in rows:
            if "memory_at_peak" in r:
                m = r["memory_at_peak"]
                out.append(f"\nLive at the peak of one step, {r['model']} {r['mode']}: {m['before_gib']:.3f} GiB "
                           f"allocated before the step, {m['step_peak_gib']:.3f} GiB more at its peak, reached at "
                           f"`{m['last_allocated'][-1]['site']}`; by allocation site:\n")
                out.append(table(["site", "GiB", "blocks"], [[f"`{s}`", _num(v["gib"], 3), v["blocks"]]
                                                             for s, v in m["sites"].items()]))
        out.append("")
    return "\n".join(out)


def _num(value, digits: int):
    return None if value is None else f"{value:.{digits}f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="dense,moe", help=f"comma-separated, from {sorted(CONFIGS)}")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated run names")
    p.add_argument("--ac", default="none,full", help="activation checkpointing settings to run")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for every run, e.g. model.n_layers=2 (repeatable)")
    p.add_argument("--profile", type=int, nargs="?", const=3, default=0, help="profile this many extra steps")
    p.add_argument("--memory", action="store_true",
                   help="one more step with the allocator's history: what is live at its peak, by allocation site")
    p.add_argument("--host-syncs", action="store_true",
                   help="one more step under torch's CUDA sync debug mode: where the host waits for the GPU")
    p.add_argument("--sync-each-step", action="store_true",
                   help="each timed step waits for its kernels before the next starts (by default they run back to back)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic kernels (torch.use_deterministic_algorithms), for the bitwise loss column")
    p.add_argument("--out", help="results JSON")
    p.add_argument("--report", nargs="+", metavar="JSON", help="write the RESULTS.md section from result files")
    args = p.parse_args()
    if args.report:
        results = [json.load(open(path)) for path in args.report]
        for res in results:
            add_comparisons(res["rows"], res.get("deterministic", False))
        text = markdown(results)
        write_section("step_time", "## Step time on one GPU\n\n" + text)
        print(text)
        return

    device = start_ranks()
    torch._inductor.config.force_disable_caches = True  # every compile cold, so compile times compare
    if args.deterministic:  # scatter-add kernels (MoE, embedding backward) use atomics otherwise
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
        torch.use_deterministic_algorithms(True)
    result = new_result(args, deterministic=args.deterministic)
    for model_name in args.models.split(","):
        for ac in args.ac.split(","):
            for mode in args.modes.split(","):
                measure(result, args.out, model_name, mode, ac, warmup=args.warmup, steps=args.steps, device=device,
                        profile=args.profile, memory=args.memory, overrides=[kv.split("=", 1) for kv in args.set],
                        sync_each_step=args.sync_each_step, syncs=args.host_syncs)
    if dist.get_rank() == 0:
        print("\n" + markdown([result]))
    dist.destroy_process_group()


def start_ranks() -> torch.device:
    """Join torchrun's ranks (nccl on GPUs, gloo otherwise), or start a group of one; this rank's device."""
    cuda = torch.cuda.is_available()
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", WORLD_SIZE="1").items():
        os.environ.setdefault(key, value)
    dist.init_process_group("nccl" if cuda else "gloo")
    if not cuda:
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def new_result(args, **fields) -> dict:
    cuda = torch.cuda.is_available()
    device = f"{dist.get_world_size()} x {torch.cuda.get_device_name()}" if cuda else "CPU"
    return dict(environment=environment(device), command=command_line(), warmup=args.warmup, steps=args.steps,
                **fields, rows=[])


def measure(result: dict, out: str | None, model_name: str, mode: str, ac: str, tags: dict | None = None,
            **kwargs) -> dict:
    """:func:`run_one` into ``result["rows"]`` (a failure as an error row), with ``tags`` added to
    the row; rank 0 prints the row and saves ``result`` to ``out`` after every run, so a run cut
    short keeps what it measured."""
    fresh_device_state(kwargs["device"])
    try:
        row = run_one(model_name, mode, ac, **kwargs)
    except Exception as e:  # one failed run (a compile error, OOM) must not lose the others
        traceback.print_exc()
        row = dict(model=model_name, ac=ac, mode=mode, error=f"{type(e).__name__}: {str(e)[:200]}")
    row.update(tags or {})
    result["rows"].append(row)
    add_comparisons(result["rows"], result.get("deterministic", False))
    if dist.get_rank() == 0:
        print({k: v for k, v in row.items() if k != "losses"}, flush=True)
        if out:
            with open(out, "w") as f:
                json.dump(result, f, indent=1)
    return row


if __name__ == "__main__":
    main()
