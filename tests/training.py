"""The model, data and optimizer settings shared by the parity tests.

The single-process reference trains on the whole global batch; a data-parallel run trains each
rank on its slice and reports the global loss (the average of equal-sized rank slices).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from simplefsdp.train.launch import run_ranks
from simplefsdp.models.llama import Transformer, TransformerConfig
from simplefsdp.train.data import SyntheticTokens, data_parallel_rank
from simplefsdp.train.cli import train_steps

# vocab 97 and ffn 90 do not divide by 4 ranks: every parity run also covers uneven shards
CFG = TransformerConfig(vocab_size=97, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=90)
GLOBAL_BATCH, SEQ_LEN, STEPS, LR, SEED = 8, 16, 10, 1e-2, 0


def build_model(cfg: TransformerConfig = CFG) -> Transformer:
    """``cfg``'s model from the torch seed :data:`SEED`: this project's Transformer or MoE
    transformer, or for a transformers config (it has a ``model_type``) its causal LM with HF's
    ``batched_mm`` experts (its ``grouped_mm`` does not compile in fp32 on the CPU)."""
    torch.manual_seed(SEED)
    if hasattr(cfg, "model_type"):
        from simplefsdp.models.hf import hf_causal_lm

        return hf_causal_lm(cfg, experts_implementation="batched_mm")
    if hasattr(cfg, "num_experts"):
        from simplefsdp.models.moe import moe_transformer

        return moe_transformer(cfg)
    return Transformer(cfg)


def wrapped_run(cfg, shape, names, ep: int = 1, *, ac=None, compile_options=None, compiled=False, ep_chunks=None,
                blocks_once=False, reshard_after_forward=True):
    """This rank's (model, what to call for forward, dp rank, dp size): ``cfg``'s model built as
    :func:`build_model` does, tensor-parallel over a ``tp`` dim, checkpointed with ``ac``, wrapped
    on a fresh mesh of ``shape`` / ``names`` (MoE layers in ``ep_chunks`` token chunks), with
    each block compiled once if ``blocks_once``, and compiled (fullgraph) when ``compiled`` or
    given ``compile_options``."""
    from simplefsdp import compile_blocks_once, simple_fsdp
    from simplefsdp import compile_options as make_options
    from simplefsdp.activation_checkpoint import apply_activation_checkpointing
    from simplefsdp.models.tp_plan import apply_tensor_parallel

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = build_model(cfg)
    tp = mesh["tp"].size() if "tp" in names else 1
    if tp > 1:
        model = apply_tensor_parallel(model, mesh["tp"])
    if ac is not None:
        model = apply_activation_checkpointing(model, ac)
    model = simple_fsdp(model, mesh, ep=ep, ep_chunks=ep_chunks, reshard_after_forward=reshard_after_forward)
    if blocks_once:
        compile_blocks_once(model)
        compile_options = {**make_options(blocks_once=True), **(compile_options or {})}
    compiled = compiled or compile_options is not None
    runner = torch.compile(model, fullgraph=True, options=compile_options) if compiled else model
    return (model, runner, *data_parallel_rank(tp))


def batches(cfg: TransformerConfig = CFG):
    stream = SyntheticTokens(cfg.vocab_size, GLOBAL_BATCH, SEQ_LEN)
    return [stream.batch(step) for step in range(STEPS)]


def train(model, data, *, dp_rank: int = 0, dp_size: int = 1) -> list[float]:
    return train_steps(model, data, lr=LR, dp_rank=dp_rank, dp_size=dp_size)


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter as a full plain tensor (gathers DTensors), keyed by state_dict name."""
    return {
        k.removeprefix("_orig_mod."): (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def report(name, losses, ref_losses, state, ref_state) -> tuple[float, float]:
    """Print and return the largest loss and parameter differences of a run against a reference."""
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    param_diff = max_abs_diff(state, ref_state)
    print(f"{name}: max |loss diff| {loss_diff:.3g}, max |param diff| {param_diff:.3g}")
    return loss_diff, param_diff


_launches: dict = {}


def launch_once(fn, world: int, *args):
    """Rank 0's result of ``fn(*args)`` on ``world`` ranks, run once per test session.

    A failed launch is remembered too: every test that reads it fails with the same error.
    """
    key = (fn.__module__, fn.__name__, world, args)
    if key not in _launches:
        try:
            _launches[key] = run_ranks(fn, world, *args)[0]
        except Exception as e:
            _launches[key] = e
    if isinstance(_launches[key], Exception):
        raise _launches[key]
    return _launches[key]


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)
