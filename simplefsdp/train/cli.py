"""Training entry point: ``simplefsdp-train`` (also ``python -m simplefsdp.train``).

    simplefsdp-train --config configs/debug_moe.toml --training.steps 30 --parallel.ep 2

Trains the configured model (:mod:`simplefsdp.train.config`) with SimpleFSDP, or for comparison with
FSDP2 (``--baseline fsdp2``) or, for an HF model, transformers' own expert parallelism
(``--baseline hf``, :mod:`simplefsdp.baselines.hf_ep`), and logs every step (:mod:`simplefsdp.train.metrics`) to stdout and
``<out_dir>/metrics.jsonl``. Under ``torchrun`` it uses the launcher's ranks (nccl on GPUs, gloo on
CPUs); started plainly it spawns the configured number of CPU ranks itself (gloo), so one command
runs on a laptop. Checkpoints (:mod:`simplefsdp.train.checkpoint`) are saved every
``checkpoint.interval`` steps and at the end; ``--resume`` continues from the last one, in any
parallel layout. ``--trace-dir DIR`` records the compile for tlparse (:mod:`simplefsdp.tracing`).

Config errors are caught before any rank starts and reported as one line naming the key.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from simplefsdp.blocks import block_list
from simplefsdp.grad_squares import track_grad_squares, tracked_grad_squares
from simplefsdp.train.checkpoint import CheckpointError, Checkpointer, check_folder
from simplefsdp.train.config import (BASELINES, ConfigError, JobConfig, compiled_fingerprint, load, model_fingerprint,
                                     tracks_grad_squares, validate)
from simplefsdp.train.data import data_parallel_rank, rank_slice, to_device, token_stream
from simplefsdp.train.optimizer import clipped_step, make_optimizer
from simplefsdp.train.metrics import MetricsLog, StepMetrics, StepReadout, flops_per_token, peak_flops, peak_memory_gib
from simplefsdp.models.llama import cross_entropy_loss
from simplefsdp.tracing import trace

PROG = "simplefsdp-train"


def kernel_options(cfg: JobConfig, device_type: str) -> dict:
    """Inductor options for the job's compiled kernels: on CPU ranks, unless ``training.cpu_simd``,
    scalar C++ kernels (a SIMD width of 1 matches no vector ISA, so Inductor picks none). gcc
    compiles them in less time, and a step runs at about the same speed or a little slower: the
    README's debug MoE job on 2 cores reached its first step in 51-54 s instead of 78 s (with
    the probe :func:`configure_rank_process` skips; RESULTS.md, "The README's main job: scalar CPU kernels").
    Set per compile, not in Inductor's global config. GPU jobs: none."""
    return {"cpp.simdlen": 1} if device_type == "cpu" and not cfg.training.cpu_simd else {}


def loss_function(cfg: JobConfig, device_type: str):
    """The loss a training step computes: compiled when the model is compiled on a GPU (as
    torchtitan compiles its loss), eager otherwise.

    Eager fp32 cross entropy over gpu_moe's logits ([16384, 32000] bf16) took 8.8 ms a step,
    forward and backward, and compiled 1.5 ms, with the same loss (one H100; RESULTS.md). On CPU
    ranks compiling it would only add seconds to the first step. With ``training.precompile`` it is
    saved and loaded as the model is (:mod:`simplefsdp.precompile`).
    """
    if cfg.training.compile and device_type == "cuda":
        if cfg.training.precompile:
            from simplefsdp.precompile import precompile

            return precompile(cross_entropy_loss)
        return torch.compile(cross_entropy_loss)
    return cross_entropy_loss


def train_step(runner, optimizer, batch, *, params, dp_size: int, max_norm: float = 0.0, mark=None,
               loss_fn=cross_entropy_loss, squares=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One AdamW step on this rank's slice ``batch``; the global mean loss and the gradient norm,
    as scalar tensors on the device. Nothing here waits for the step's kernels at its end: the
    caller reads the values (``.item()``) when it needs them, so a loop that reads them late
    queues the next step's kernels while this one's run (on one H100, gpu_moe's compiled forward
    took about 5 ms of host time to start its first kernel, with the GPU idle, when every step
    ended with a read).

    ``mark(phase)``, if given, is called as each phase ends: ``"forward+backward"``, ``"clip"``,
    ``"optimizer"`` (the benchmarks time the phases with it). ``loss_fn(logits, labels)``: the
    loss (:func:`loss_function`). ``squares``: the model's gradient squares from backward
    (:func:`simplefsdp.grad_squares.tracked_grad_squares`).
    """
    mark = mark or (lambda phase: None)
    tokens, labels = batch
    out = runner(tokens)
    loss = loss_fn(getattr(out, "logits", out), labels)  # an HF model returns a ModelOutput
    # the logits ([tokens, vocab], 1 GB in bf16 for gpu_dense) live on only where the loss saved
    # them for its backward, which runs first: the blocks' backward runs without them
    del out
    loss.backward()
    mark("forward+backward")
    norm = clipped_step(optimizer, params, max_norm, mark, squares)
    optimizer.zero_grad()
    mark("optimizer")
    reported = loss.detach().clone()
    if dp_size > 1:
        dist.all_reduce(reported, op=dist.ReduceOp.AVG)
    return reported, norm


def train_steps(model, data, *, lr: float, dp_rank: int = 0, dp_size: int = 1, on_step=None) -> list[float]:
    """AdamW over the global batches ``data``, each rank on its slice; the global losses.

    ``on_step(step, loss)`` is called after each step (step counts from 0).
    """
    optimizer = make_optimizer(model, lr)
    params = list(model.parameters())
    losses = []
    for step, batch in enumerate(data):
        losses.append(train_step(model, optimizer, rank_slice(batch, dp_rank, dp_size), params=params, dp_size=dp_size)[0])
        if on_step is not None:
            on_step(step, losses[-1].item())
    return [loss.item() for loss in losses]


def _mesh(cfg: JobConfig, world: int, device_type: str):
    """The mesh over all ranks: dims dp_replicate, dp_shard, tp, leaving out those of size 1 that
    the layout does not need."""
    from torch.distributed.device_mesh import init_device_mesh

    d, p = cfg.degrees(world), cfg.parallel
    # FSDP2 replicates as HSDP with a dp_shard dim of 1
    keep_shard = d["dp_replicate"] == 1 or p.ep > 1 or p.mode == "hybrid_shard" or cfg.training.baseline == "fsdp2"
    dims = [(name, size) for name, size in d.items() if size > 1 or (name == "dp_shard" and keep_shard)]
    return init_device_mesh(device_type, tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))


def _mp_policy(cfg: JobConfig):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    param, reduce = dtype[cfg.training.param_dtype], dtype[cfg.training.reduce_dtype]
    return MixedPrecisionPolicy(param_dtype=None if param == torch.float32 else param, reduce_dtype=reduce)


def build(cfg: JobConfig, world: int, device_type: str):
    """(model, what to call for forward, optimizer) for this rank."""
    from simplefsdp import compile_blocks_once, compile_options, simple_fsdp
    from simplefsdp.activation_checkpoint import apply_activation_checkpointing
    from simplefsdp.models.hf_weights import load_hf_weights
    from simplefsdp.models.llama import Transformer
    from simplefsdp.models.moe import moe_transformer
    from simplefsdp.models.tp_plan import apply_tensor_parallel

    p, t = cfg.parallel, cfg.training
    torch.manual_seed(t.seed)
    weights = cfg.model.get("weights")
    if t.baseline == "hf":
        from simplefsdp.baselines.hf_ep import hf_expert_parallel

        model = hf_expert_parallel(weights, world, experts_implementation=cfg.model.get("experts_implementation"),
                                   attn_implementation=cfg.model.get("attn_implementation"))
        if p.activation_checkpoint != "none":
            model = apply_activation_checkpointing(model, p.activation_checkpoint)
        return model, model, make_optimizer(model, t.lr)
    mesh = _mesh(cfg, world, device_type)
    model_cfg = cfg.model_config()
    if cfg.model["kind"] == "hf":
        from simplefsdp.models.hf import hf_causal_lm

        # with weights, SimpleFSDP's model starts on the meta device: each rank allocates its shards
        # and reads only their slices; FSDP2's is built whole and loaded before it is sharded
        with torch.device("meta" if weights and t.baseline != "fsdp2" else "cpu"):
            model = hf_causal_lm(model_cfg, experts_implementation=cfg.model.get("experts_implementation"),
                                 attn_implementation=cfg.model.get("attn_implementation"))
    else:
        model = moe_transformer(model_cfg) if cfg.model["kind"] == "moe" else Transformer(model_cfg)
    if p.tp > 1:
        model = apply_tensor_parallel(model, mesh["tp"])
    if p.activation_checkpoint != "none":
        model = apply_activation_checkpointing(model, p.activation_checkpoint)
    if t.baseline == "fsdp2":
        from simplefsdp.baselines.fsdp2 import fsdp2

        if weights:
            load_hf_weights(model, weights)
        model = fsdp2(model, mesh, ep=p.ep, ep_chunks=p.ep_chunks or None, mp_policy=_mp_policy(cfg),
                      reshard_after_forward=p.reshard_after_forward)
        runner = model
        if t.compile:  # per block, as torchtitan compiles FSDP2 models
            for block in block_list(model):
                block.compile(options=kernel_options(cfg, device_type) or None)
    else:
        mode = None if p.mode == "auto" else p.mode
        model = simple_fsdp(model, mesh, mode=mode, ep=p.ep, ep_chunks=p.ep_chunks or None, mp_policy=_mp_policy(cfg),
                            reshard_after_forward=p.reshard_after_forward)
        if weights:
            load_hf_weights(model, weights)
        if tracks_grad_squares(cfg):
            track_grad_squares(model)
        runner = model
        if t.compile:
            passes = {} if t.passes else dict(bucketing="none", a2a_overlap=False, prefetch=0)
            if t.blocks_once:
                compile_blocks_once(model)
            options = compile_options(**passes, blocks_once=t.blocks_once) if passes or t.blocks_once else {}
            options = {**options, **kernel_options(cfg, device_type)} or None
            if t.precompile:
                from simplefsdp.precompile import precompile

                runner = precompile(model, options=options, key=compiled_fingerprint(cfg))
            else:
                runner = torch.compile(model, fullgraph=True, options=options)
    return model, runner, make_optimizer(model, t.lr)


def _count_params(model) -> int:
    from torch.distributed.tensor import DTensor

    return sum(p.numel() if not isinstance(p, DTensor) else p.shape.numel() for p in model.parameters())


def run(cfg: JobConfig, start_step: int) -> list[float]:
    """The training job on this rank (the process group is up); the losses of the steps it ran."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = dist.get_backend() == "nccl"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    t, tp = cfg.training, cfg.parallel.tp
    model, runner, optimizer = build(cfg, world, device.type)
    adapt = None
    if cfg.training.baseline == "fsdp2":
        from simplefsdp.baselines.fsdp2 import global_expert_state as adapt
    checkpointer = Checkpointer(cfg.checkpoint_folder, model_fingerprint(cfg), model, optimizer, adapt)
    if start_step:
        checkpointer.load(start_step)
    # the hf baseline runs the whole batch on every rank
    dp_rank, dp_size = (0, 1) if t.baseline == "hf" else data_parallel_rank(tp)
    model_cfg = cfg.model_config()
    stream = token_stream(t.dataset, model_cfg.vocab_size, t.global_batch, t.seq_len, t.seed)
    log = MetricsLog(cfg.out_dir, t.steps, enabled=rank == 0, tensorboard=cfg.metrics.tensorboard, resume_step=start_step)
    tokens_per_step = t.global_batch * t.seq_len
    peak = peak_flops(device, cfg.metrics.peak_tflops)
    fpt = flops_per_token(model_cfg, t.seq_len)
    if rank == 0:
        what = {"simplefsdp": "SimpleFSDP", "fsdp2": "FSDP2", "hf": "transformers' expert parallelism"}[t.baseline]
        how = "compiled" + (" with passes" if t.passes and t.baseline == "simplefsdp" else "") if t.compile else "eager"
        degrees = [f"{name} {size}" for name, size in cfg.degrees(world).items() if size > 1 and t.baseline != "hf"]
        degrees += [f"ep {cfg.parallel.ep}"] if cfg.parallel.ep > 1 else []
        print(f"{PROG}: {cfg.name}: {cfg.model['kind']} model, {_count_params(model) / 1e6:.2f}M parameters; "
              f"{what} {how} on {world} {device.type} ranks ({' x '.join(degrees) or 'one rank'}); "
              f"{'resuming after step ' + str(start_step) if start_step else 'from scratch'}; out {cfg.out_dir}", flush=True)
        if t.compile:
            print(f"{PROG}: the first step compiles the model (a minute or more; minutes on a few CPU cores)", flush=True)

    params, loss_fn = list(model.parameters()), loss_function(cfg, device.type)
    squares = tracked_grad_squares(model)
    losses = []
    interval = cfg.checkpoint.interval
    read_until = time.perf_counter()

    def log_step(step: int, readout: StepReadout) -> None:
        nonlocal read_until
        loss, norm = readout.read()
        now = time.perf_counter()
        seconds, read_until = now - read_until, now
        tps = tokens_per_step / seconds
        log.log(StepMetrics(step, loss, norm, tps, 1e3 * seconds, peak_memory_gib(device),
                            tps * fpt / (world * peak) if peak else None))
        losses.append(loss)

    queued, lag = collections.deque(), steps_read_late(device)
    for step in range(start_step + 1, t.steps + 1):
        batch = to_device(rank_slice(stream.batch(step - 1), dp_rank, dp_size), device)
        loss, norm = train_step(runner, optimizer, batch, params=params, dp_size=dp_size, max_norm=t.max_norm,
                                loss_fn=loss_fn, squares=squares)
        queued.append((step, StepReadout(loss, norm)))
        while len(queued) > lag:
            log_step(*queued.popleft())
        if step == t.steps or (interval and step % interval == 0):
            while queued:  # every step is read before the save, and the clock restarts after it:
                log_step(*queued.popleft())  # the save is no step's time
            checkpointer.save(step)
            read_until = time.perf_counter()
    log.close()
    return losses


def steps_read_late(device: torch.device) -> int:
    """How many steps the training loop queues before it reads the oldest one: 1 on a GPU, so the
    GPU runs the next step while the host waits for this one's loss; 0 on the CPU, where a step has
    run when ``train_step`` returns (a late read would only shift the steps' times by one)."""
    return 1 if device.type == "cuda" else 0


def configure_rank_process(cfg: JobConfig) -> None:
    """Settings for a process that runs one rank of the job (the process group is up).

    A CPU job's compiles are all scalar (:func:`kernel_options`), and so are the loads of its
    precompiled model: Inductor's probe of the vector ISAs (a gcc build of a test program per
    ISA, about 9 s on a cold cache, and a process per ISA loading it, 1.5 s on a warm one) has
    nothing to decide, so it is skipped for the job's processes."""
    if dist.get_backend() == "gloo" and not cfg.training.cpu_simd:
        torch._inductor.config.cpp.vec_isa_ok = False


def _rank_main(cfg: JobConfig, start_step: int, trace_dir: str | None) -> list[float]:
    configure_rank_process(cfg)
    if trace_dir is None:
        return run(cfg, start_step)
    with trace(trace_dir) as tr:
        losses = run(cfg, start_step)
    if dist.get_rank() == 0:
        print(f"tlparse report: {tr.report}" if tr.report else "tlparse not installed: raw logs only", flush=True)
    return losses


def _split_overrides(rest: list[str]) -> list[tuple[str, str]]:
    """``--section.key value`` / ``--section.key=value`` pairs from the leftover arguments."""
    out, i = [], 0
    while i < len(rest):
        arg = rest[i]
        if not arg.startswith("--") or "." not in arg.split("=")[0]:
            raise ConfigError(f"{arg}: unrecognized argument (overrides look like --training.steps 10)")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(rest):
                raise ConfigError(f"{arg[2:]}: missing value")
            key, value = arg[2:], rest[i + 1]
            i += 2
        out.append((key, value))
    return out


def parse_args(argv=None) -> tuple[JobConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0],
                                epilog="Any config key can be overridden: --section.key value (see configs/*.toml).")
    p.add_argument("--config", help="TOML config file (configs/*.toml); default: the debug dense model")
    p.add_argument("--ranks", type=int, help="CPU ranks to spawn when not under torchrun "
                   "(default: dp_replicate x dp_shard x tp)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint (checkpoint.resume)")
    p.add_argument("--baseline", choices=BASELINES, help="training.baseline")
    p.add_argument("--trace-dir", help="dump the compile trace here and render it with tlparse")
    args, rest = p.parse_known_args(argv)
    overrides = _split_overrides(rest)
    if args.resume:
        overrides.append(("checkpoint.resume", "true"))
    if args.baseline:
        overrides.append(("training.baseline", args.baseline))
    return load(args.config, overrides), args


def _world_size(cfg: JobConfig, ranks: int | None) -> int:
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    if ranks is not None:
        if ranks < 1:
            raise ConfigError(f"--ranks: must be >= 1, got {ranks}")
        return ranks
    p = cfg.parallel
    if p.dp_shard == -1:
        raise ConfigError("parallel.dp_shard: -1 takes the ranks left over; set it, or pass --ranks, when not under torchrun")
    return p.dp_replicate * p.dp_shard * p.tp


def prepare(argv=None) -> tuple[JobConfig, int, int, argparse.Namespace]:
    """The checked config, world size and step to resume from; raises ConfigError/CheckpointError."""
    cfg, args = parse_args(argv)
    world = _world_size(cfg, args.ranks)
    validate(cfg, world)
    t = cfg.training
    try:
        token_stream(t.dataset, cfg.model_config().vocab_size, t.global_batch, t.seq_len, t.seed)
    except ValueError as e:
        raise ConfigError(str(e) if str(e).startswith("training.dataset") else f"training.dataset: {e}") from None
    start = check_folder(cfg.checkpoint_folder, model_fingerprint(cfg), cfg.checkpoint.resume)
    return cfg, world, start, args


def main(argv=None) -> None:
    try:
        cfg, world, start, args = prepare(argv)
    except (ConfigError, CheckpointError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if int(os.environ.get("RANK", "0")) == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(cfg.as_dict(), f, indent=2)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        try:
            _rank_main(cfg, start, args.trace_dir)
        finally:
            dist.destroy_process_group()
        return
    from simplefsdp.train.launch import run_ranks

    run_ranks(_rank_main, world, cfg, start, args.trace_dir, timeout=24 * 3600)

