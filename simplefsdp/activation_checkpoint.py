"""Activation checkpointing per transformer block: ``full`` or ``selective``.

``full`` recomputes a block's forward in backward; ``selective`` keeps the outputs of matmuls,
grouped matmuls and attention and recomputes the cheap elementwise work. Either way,
communication is never replayed: the expert all-to-alls and their waits are saved, so the
token counts (and with them the all-to-all split sizes) that backward sees are the ones forward
used, and the re-gathering of parameters stays with SimpleFSDP's own policy.

Random ops (those tagged ``nondeterministic_seeded``: dropout, and attention, whose kernels take
a dropout probability) are saved too, in both modes, so backward sees exactly forward's values
without replaying RNG state. Under torch.compile this is also what makes checkpointed DTensor
blocks compile on torch 2.13: there the partitioner's RNG replay of a recomputed random op puts
its saved RNG state after the DeviceMesh objects that DTensor code saves for backward, and the
mesh lands among the saved tensors (an AssertionError at the first step).
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from simplefsdp.blocks import block_list

# attention is saved in both modes as a random op (see _is_random)
_COMPUTE_TO_SAVE = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}
if hasattr(torch.ops.aten, "_grouped_mm"):
    _COMPUTE_TO_SAVE.add(torch.ops.aten._grouped_mm.default)
_COMM_TO_SAVE = {torch.ops._c10d_functional.all_to_all_single.default}

MODES = ("full", "selective")


def _is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _policy(save: frozenset, ctx, func, *args, **kwargs) -> CheckpointPolicy:
    if func in save or _is_random(func):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _saved(mode: str) -> frozenset:
    return frozenset(_COMM_TO_SAVE | (_COMPUTE_TO_SAVE if mode == "selective" else set()))


def _context_fn(mode: str):
    return create_selective_checkpoint_contexts(functools.partial(_policy, _saved(mode)))


def apply_activation_checkpointing(model: nn.Module, mode: str = "full", *, blocks: str | None = None) -> nn.Module:
    """Wrap every block of ``model`` (:func:`simplefsdp.blocks.block_list`: ``model.layers``, an
    HF model's decoder layers, or the list at the path ``blocks``) in a checkpoint (in place;
    returns ``model``). An HF model's ``config.use_cache`` is set to False, as HF's own
    ``gradient_checkpointing_enable`` does."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {MODES}; got {mode!r}")
    layers = block_list(model, blocks)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        # a Hugging Face model would append the recomputed keys and values to its KV cache again
        # (the re-run then differs from forward); HF's own gradient checkpointing turns it off too
        config.use_cache = False
    context_fn = functools.partial(_context_fn, mode)
    # a stable hash lets AOTAutograd cache graphs with these regions (see param_gather.py)
    context_fn.cache_hash = f"simplefsdp.activation_checkpoint: saves {sorted(map(str, _saved(mode)))} and random ops"
    for i, block in enumerate(layers):
        layers[i] = checkpoint_wrapper(block, context_fn=context_fn, preserve_rng_state=False)
    return model
