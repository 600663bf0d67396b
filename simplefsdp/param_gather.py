"""The parametrization behind every SimpleFSDP parameter: gather the shard for compute.

A wrapped module stores each parameter as a sharded DTensor ``nn.Parameter`` and reads it through
a :class:`ParamGather`. Reading takes the local shard and, one data-parallel mesh dim at a time,
wraps it as a DTensor on that dim's 1-D mesh and redistributes it to ``Replicate`` (an all-gather
for ``Shard``, nothing for ``Replicate``), handing on a local tensor whose gradient is declared
``Partial``. Autograd turns each declaration back into the placement: a reduce-scatter over
``dp_shard``, then an all-reduce over ``dp_replicate``. Mixed precision rides on the same calls
(``forward_dtype`` / ``backward_dtype``). Under tensor parallelism the result is handed to
compute as a DTensor on the ``tp`` mesh; routed experts gather over ``edp`` only.

With ``reshard_after_forward`` the gathered tensor must not live from forward to backward, nor,
where nothing is gathered (one rank, or replicate), the copy cast to ``param_dtype``: FSDP2 frees
its unsharded parameters after forward at any world size, and Inductor's partitioner would
otherwise save every cast weight for backward (at world 1, about 0.3 GiB per gpu_moe layer):

* under ``torch.compile`` the gather runs inside a selective-checkpoint region whose policy marks
  every op ``MUST_RECOMPUTE``, so the partitioner re-gathers in the backward graph;
* in eager mode :mod:`simplefsdp.eager_reshard` swaps saved views of the gathered tensor for a
  recipe that re-gathers when backward unpacks them.
"""

from __future__ import annotations

import functools
import logging
import weakref
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from simplefsdp import eager_reshard


def _recompute_everything(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def _recompute_context():
    return create_selective_checkpoint_contexts(_recompute_everything)


# AOTAutograd caches a graph with a selective-checkpoint region only when the region's context_fn
# names a stable hash (torch 2.13; older torch ignores it): without one, every compile is cold
_recompute_context.cache_hash = "simplefsdp.param_gather: MUST_RECOMPUTE every op"


class _QuietContextFnNotice(logging.Filter):
    """Drop torch's notice that a ``context_fn`` reached a compiled checkpoint (one per rank).

    It asks the user to check the region for in-place ops; every compiled gather with
    ``reshard_after_forward`` passes one, and those regions hold only the gather and its casts.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


_QUIET_CONTEXT_FN_NOTICE = _QuietContextFnNotice()


def quiet_context_fn_notice() -> None:
    """Drop that notice from torch's logger from now on (process-wide; once is enough). Called by
    ``simple_fsdp`` when it reshards after forward: importing simplefsdp changes no logger."""
    logging.getLogger("torch._higher_order_ops.wrap").addFilter(_QUIET_CONTEXT_FN_NOTICE)


@dataclass(frozen=True)
class ParamGather:
    """How one sharded parameter becomes the tensor that compute reads.

    ``steps`` are (1-D mesh, placement on it) pairs, replicate dims first: forward walks them in
    order (all-gathering where the placement is ``Shard``), backward in reverse (reduce-scatter,
    then all-reduce of the reduced shard). Every step casts the gradient to the reduce dtype
    before its collective. The cast to ``param_dtype`` sits right before the all-gather; when
    gradients are reduced in ``param_dtype`` anyway it moves to the first step, so that the
    all-reduce after the reduce-scatter also runs in ``param_dtype``, as in FSDP2.
    """

    steps: tuple[tuple[DeviceMesh, Placement], ...]
    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    reshard_after_forward: bool
    # (tensor dim, degree) that mesh dims outside ``steps`` keep split (experts over ep)
    kept_split: tuple[tuple[int, int], ...] = ()
    # how gradients are reduced: "avg" over the steps' ranks, or "sum" and then divided by
    # ``grad_divisor`` (experts: their gradient already sums the tokens of every ep rank, so
    # they divide by the whole dp degree, as FSDP2's gradient_divide_factor does)
    reduce_op: str = "avg"
    grad_divisor: float = 1.0
    # tensor parallel: the gathered tensor is handed on as a DTensor on this (mesh, placements)
    tp: tuple[DeviceMesh, tuple[Placement, ...]] | None = None

    @property
    def gathers(self) -> bool:
        """Whether reading the parameter runs a collective in forward."""
        return any(isinstance(p, Shard) for _, p in self.steps)

    def gather(self, param: DTensor, sink: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor compute reads: gathered over dp, a DTensor on the tp mesh under TP."""
        return self._for_compute(self.gather_local(param, sink), param)

    def _for_compute(self, local: torch.Tensor, param: DTensor) -> torch.Tensor:
        if self.tp is None:
            return local
        tp_mesh, tp_placements = self.tp
        stride = torch.empty(param.shape, device="meta").stride()
        return DTensor.from_local(local, tp_mesh, tp_placements, run_check=False, shape=param.shape, stride=stride)

    def gather_local(self, param: DTensor, sink: torch.Tensor | None = None) -> torch.Tensor:
        """All-gather ``param`` over the dp dims; its gradient is reduced back onto the shard (and
        its squares added to ``sink``, :mod:`simplefsdp.grad_squares`)."""
        reduce_dtype = self.reduce_dtype or self.param_dtype
        cast_early = reduce_dtype == self.param_dtype
        local = param.to_local()
        if sink is not None:
            local = _GradSquares.apply(local, sink)
        if self.grad_divisor != 1.0:
            local = _DivideGrad.apply(local, self.grad_divisor)
        last = len(self.steps) - 1
        for i, (mesh, placement) in enumerate(self.steps):
            shape, stride = self._gathered_shape_and_stride(local, placement, param)
            local = (
                DTensor.from_local(local, mesh, (placement,), run_check=False, shape=shape, stride=stride)
                .redistribute(
                    placements=(Replicate(),),
                    forward_dtype=self.param_dtype if (cast_early or i == last) else None,
                    backward_dtype=reduce_dtype,
                )
                .to_local(grad_placements=(Partial(self.reduce_op),))
            )
        if not self.steps and self.param_dtype is not None:  # one rank: nothing to gather
            local = local.to(self.param_dtype)
        return local

    def _gathered_shape_and_stride(self, local, placement, param):
        """The shape of ``local`` once gathered over one step's mesh (exact for uneven shards)."""
        if not isinstance(placement, Shard):
            return local.shape, local.stride()
        shape = list(local.shape)
        shape[placement.dim] = param.shape[placement.dim] // dict(self.kept_split).get(placement.dim, 1)
        return torch.Size(shape), torch.empty(shape, device="meta").stride()

    def __call__(self, param: DTensor, sink: torch.Tensor | None = None) -> torch.Tensor:
        casts = self.param_dtype is not None and param.dtype != self.param_dtype
        if not (self.reshard_after_forward and (self.gathers or casts) and torch.is_grad_enabled()):
            return self.gather(param, sink)
        if torch.compiler.is_compiling():
            return checkpoint(
                self.gather, param, sink, use_reentrant=False, context_fn=_recompute_context
            )
        gather = self.gather_local if sink is None else functools.partial(self.gather_local, sink=sink)
        return self._for_compute(eager_reshard.gather_for_recompute(gather, param), param)


class _DivideGrad(torch.autograd.Function):
    """Identity forward; divides the (already reduced) gradient in backward."""

    @staticmethod
    def forward(ctx, x, divisor):
        ctx.divisor = divisor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.divisor, None


class _GradSquares(torch.autograd.Function):
    """Identity forward; backward passes the gradient on and gives ``sink`` [sum of its squares, 1]
    (:mod:`simplefsdp.grad_squares`)."""

    @staticmethod
    def forward(ctx, x, sink):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        squares = grad.float().pow(2).sum()
        return grad, torch.stack([squares, torch.ones_like(squares)])


# weak values: an entry lives as long as a wrapped module uses its gather, so the cache keeps no
# mesh (nor its process groups) alive after the model is gone
_GATHERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _group_identity(value):
    """``value`` with each DeviceMesh replaced by the mesh, the names of its process groups and
    this rank's coordinate in it.

    DeviceMesh equality compares ranks and dim names only, so a mesh rebuilt over new process
    groups equals the old one, and so does the same mesh seen from another rank (a later world in
    one process, where group names restart): the cache must not hand it the old groups, nor the
    old rank's shard shapes.
    """
    if isinstance(value, DeviceMesh):
        groups = tuple(value.get_group(d).group_name for d in range(value.ndim))
        return (value, groups, tuple(value.get_coordinate() or ()))
    if isinstance(value, tuple):
        return tuple(_group_identity(v) for v in value)
    return value


def param_gather(*args, **kwargs) -> ParamGather:
    """One shared :class:`ParamGather` per configuration and process groups, so torch.compile sees few objects."""
    key = _group_identity((args, tuple(sorted(kwargs.items()))))
    gather = _GATHERS.get(key)
    if gather is None:
        gather = _GATHERS[key] = ParamGather(*args, **kwargs)
    return gather
