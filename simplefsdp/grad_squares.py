"""Squared gradient norms computed in backward, where each gradient is made.

Clipping by the global norm reads every gradient once for the norm and once more in the optimizer
step. :func:`track_grad_squares` makes each SimpleFSDP parameter's gather pass its local shard
through an identity (``param_gather._GradSquares``) whose backward also gives a small "sink"
tensor, as its gradient, the shard gradient's sum of squares (in float32) and a 1. Every parameter
on one (mesh, placements) shares a sink, and autograd adds the sink's gradients up like any other,
so after backward each sink's ``.grad`` is ``[sum of squares of the group's local gradients,
gradients counted]``. Under ``torch.compile`` the sum is one more reduction in the backward graph:
Inductor fuses it into the kernel that makes the gradient where that is a pointwise kernel (at one
rank, the cast of the bf16 weight gradient to fp32), so no gradient is read again; where the
gradient is a reduce-scatter's output itself it is a kernel of its own, the read moved from
before the optimizer step into the backward.

The identity sits right after the shard is taken (``ParamGather.gather_local``), so its backward
sees the final local gradient: reduced, divided, in the parameter's dtype. It changes no gradient.

:meth:`GradSquares.take` gives each group's sum with a flag, true where the group counted exactly
one gradient for each of its parameters that has one. Two backwards before a step (gradient
accumulation) or a parameter gathered twice in one forward (a module called twice under
``torch.compile``) sum the squares of partial gradients, which is not the square of their sum: such
a group's count does not match, and its norm must be read from the gradients instead
(:func:`simplefsdp.train.grad_norm.grad_norm`). The flag stays on the device: the norm decides
there (:mod:`simplefsdp.train.square_sum`), so the host does not wait for the backward to end.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from simplefsdp.param_access import STATE_ATTR, WRAPPED_ATTR, is_wrapped


def group_key(param: torch.Tensor):
    """The (mesh, placements) a parameter's gradient is grouped by; None for a plain tensor."""
    return (param.device_mesh, tuple(param.placements)) if isinstance(param, DTensor) else None


class Taken(NamedTuple):
    """A group's squares after backward: ``sum``, the local sum of squared gradients (float32
    scalar), and ``counted_right``, a boolean scalar, true where the backward counted exactly one
    gradient per parameter with a gradient, so that ``sum`` is the sum of their squares. Both on
    the group's device."""

    sum: torch.Tensor
    counted_right: torch.Tensor


class GradSquares:
    """A model's sinks (:func:`track_grad_squares`): ``sinks`` by group key, ``sink_of`` by
    parameter key (``WrappedParams.keys``)."""

    def __init__(self, state, sinks: dict, sink_of: dict[int, torch.Tensor]):
        self.state = state
        self.sinks = sinks
        self.sink_of = sink_of

    def take(self, params) -> dict:
        """Per group key, the backward's :class:`Taken` squares of ``params``' gradients; the sinks
        are cleared for the next backward. Nothing is copied to the host: whether a group's count
        is right stays on the device, for the caller to decide there (module docstring)."""
        with_grad: dict = {}
        for p in params:
            if p.grad is not None:
                with_grad[group_key(p)] = with_grad.get(group_key(p), 0) + 1
        taken = {}
        for key, sink in self.sinks.items():
            if sink.grad is not None:
                taken[key] = Taken(sink.grad[0], sink.grad[1] == with_grad.get(key, 0))
                sink.grad = None
        return taken

    def stop(self) -> None:
        """Stop computing squares in backward (a compiled model traces its gathers again, without)."""
        if self.state.grad_squares is self:
            self.state.grad_squares = None


def _wrapped_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if is_wrapped(m)]


def tracked_grad_squares(model: nn.Module) -> GradSquares | None:
    """``model``'s :class:`GradSquares` while :func:`track_grad_squares` is on, else None (also for
    a model not wrapped by ``simple_fsdp``)."""
    modules = _wrapped_modules(model)
    return getattr(modules[0], STATE_ATTR).grad_squares if modules else None


def track_grad_squares(model: nn.Module) -> GradSquares:
    """Compute each gradient's sum of squares in backward from now on (module docstring).

    ``model`` must be wrapped by ``simple_fsdp`` and not tracked already (ValueError before
    anything changes). Call it before the model's first compiled forward: a compiled model traces
    again when tracking starts or stops.
    """
    modules = _wrapped_modules(model)
    if not modules:
        raise ValueError("track_grad_squares needs a model wrapped by simple_fsdp (call simple_fsdp first)")
    state = getattr(modules[0], STATE_ATTR)
    if state.grad_squares is not None:
        raise ValueError("track_grad_squares: the model's gradient squares are tracked already")
    sinks: dict = {}
    sink_of: dict[int, torch.Tensor] = {}
    for module in modules:
        wrapped = getattr(module, WRAPPED_ATTR)
        for name in wrapped.gathers:
            param = module._parameters[name]
            if not param.requires_grad:
                continue
            key = group_key(param)
            if key not in sinks:
                device = param.to_local().device if isinstance(param, DTensor) else param.device
                sinks[key] = torch.zeros(2, device=device, requires_grad=True)
            sink_of[wrapped.keys[name]] = sinks[key]
    state.grad_squares = GradSquares(state, sinks, sink_of)
    return state.grad_squares
