"""Eager-mode ``reshard_after_forward``: do not keep gathered parameters alive until backward.

Autograd saves the gathered weight (or a view of it, such as ``weight.t()``, or under tensor
parallelism a DTensor around it) for backward. While a
wrapped model runs forward, :func:`resharding_saved_tensors` packs every saved tensor that shares
storage with a gathered parameter as a small recipe (the shard, the gather and the view's
geometry); backward unpacks the recipe by gathering again, once per parameter and forward: the
first unpack gathers, and the full tensor is kept until the last saved view of it is unpacked, as
FSDP2 keeps a module unsharded through its backward. Gathered tensors are tracked by weak
reference, so a freed buffer whose address is reused is never mistaken for a parameter.

torch.compile does not use this path: there the gather sits in a selective-checkpoint region (see
:mod:`simplefsdp.param_gather`) and the partitioner places the re-gather in the backward graph.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor

_state = threading.local()


class _WaitForCollective(torch.autograd.Function):
    """Finish an async collective and hand on a plain tensor (identity for autograd)."""

    @staticmethod
    def forward(ctx, x):
        return x.wait() if isinstance(x, AsyncCollectiveTensor) else x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Source:
    """One gathered parameter of a forward, as backward sees it: gathered again at the first
    unpack of any tensor saved from it, and kept until the last of those is unpacked. So backward
    gathers each parameter once however many slices of it were saved (a loop over experts saves
    one per expert that received rows: a number that differs between ranks)."""

    def __init__(self, gather: Callable[[torch.Tensor], torch.Tensor], param: torch.Tensor):
        self.gather, self.param = gather, param
        self.packed = 0  # saved tensors of this forward not yet unpacked
        self.full: torch.Tensor | None = None

    def unpack(self) -> torch.Tensor:
        if self.full is None:
            with torch.no_grad():
                self.full = _WaitForCollective.apply(self.gather(self.param))
        full = self.full
        self.packed -= 1
        if self.packed <= 0:
            self.full = None
        return full


@dataclass
class _Regather:
    source: _Source
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    dtensor_spec: tuple | None  # (mesh, placements, shape, stride) of a saved tensor-parallel view


def _local(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor holding ``t``'s data (a DTensor's local tensor), or None for other subclasses."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    return t if type(t) is torch.Tensor else None


def gather_for_recompute(
    gather: Callable[[torch.Tensor], torch.Tensor], param: torch.Tensor
) -> torch.Tensor:
    """Gather ``param`` and, inside :func:`resharding_saved_tensors`, mark the result re-gatherable."""
    out = _WaitForCollective.apply(gather(param))
    registry = getattr(_state, "gathered", None)
    if registry is not None:
        registry[out.untyped_storage().data_ptr()] = (weakref.ref(out), _Source(gather, param))
    return out


def _pack(t: torch.Tensor):
    local = _local(t)
    entry = None if local is None else _state.gathered.get(local.untyped_storage().data_ptr())
    if entry is None:
        return t
    ref, source = entry
    gathered = ref()
    if gathered is None or gathered.dtype != local.dtype:
        return t
    spec = (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None
    source.packed += 1
    return _Regather(source, local.size(), local.stride(), local.storage_offset(), spec)


def _unpack(packed):
    if not isinstance(packed, _Regather):
        return packed
    full = packed.source.unpack()
    local = full.as_strided(packed.size, packed.stride, packed.offset)
    if packed.dtensor_spec is None:
        return local
    mesh, placements, shape, stride = packed.dtensor_spec
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


@contextlib.contextmanager
def resharding_saved_tensors():
    """Save re-gather recipes instead of gathered parameters for the duration of a forward."""
    if getattr(_state, "gathered", None) is not None:  # nested forward: the outer one packs
        yield
        return
    _state.gathered = {}
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _state.gathered = None
