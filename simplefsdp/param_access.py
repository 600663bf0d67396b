"""What ``module.weight`` is on a wrapped model: the shard outside forward, the gathered tensor inside.

As with FSDP2, a wrapped module's parameter reads as the sharded DTensor ``nn.Parameter`` outside
a forward: no collective, so in-place initialization (``nn.init.*_``, ``model.apply``,
``init_weights()``), ``requires_grad_`` and reads on one rank only act on the shard. Inside a
forward of the model it reads as the gathered tensor that compute needs.

Each wrapped module's class is swapped for a generated subclass with one property per parameter
name; the property asks the model's :class:`ForwardState` whether a forward is running. Forward
hooks on the root and on every parameter-owning module keep that count, so a block re-run by
eager activation checkpointing during backward, or called on its own, gathers too. Checkpointing
may stop such a re-run early by raising out of it; what it opened is closed when the backward
ends (an autograd engine callback, as FSDP2's post-backward uses).

Eagerly, a forward gathers each parameter once, however often it is read (tied weights, a loop
over experts), and frees it when the module that read it returns: ranks that read a weight a
different number of times still issue the same collectives. Under ``torch.compile`` a read
traces the gather where it happens: the traced code is a forward, and a counter or a cache
changed inside a checkpointed region's trace is a side effect Dynamo refuses. Tied parameters are
the exception: the root's pre-forward hook, outside every checkpointed region, gathers each once
and their reads return it. Another parameter read twice in one compiled forward (a loop over its
module) is gathered twice. Inside a block compiled once (:mod:`simplefsdp.block_regions`) reads
return what the block gathered before entering its region.

:func:`gathered` gives full parameters outside forward (export, evaluation): it gathers every
parameter once, in the same order on every rank, on entry, and frees them on exit. With
``writeback=True`` (FSDP1's ``summon_full_params(writeback=True)``) in-place edits of the full
tensors are copied into each rank's shard on exit: run the model's own initialization on full
tensors, with the same seed on every rank, and the shards hold what initializing before wrapping
gives, on any device.

One subclass is generated per (original class, parameter names) and reused by every instance, so
all layers of a model share one class and torch.compile compiles a block once.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.tensor import DTensor

from simplefsdp.generated_classes import generated_class
from simplefsdp.param_gather import ParamGather

WRAPPED_ATTR = "_simplefsdp"
STATE_ATTR = "_simplefsdp_forward_state"
REGION_SLOTS_ATTR = "_simplefsdp_region_slots"  # parameter name -> slot in its block's region
_SWAPPED_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


@dataclass
class ForwardState:
    """One wrapped model's eager forwards in progress and what each has gathered.

    ``frames`` holds per forward (innermost last) the keys of the gathered tensors it keeps in
    ``gathered``; they are freed when it returns, as FSDP2 reshards a unit after its forward. A
    tied parameter belongs to the outermost forward (FSDP2 keeps tied weights in the root unit),
    so it is gathered once per forward.
    """

    frames: list[list[int]] = field(default_factory=list)
    gathered: dict[int, torch.Tensor] = field(default_factory=dict)
    # compiled forwards: tied parameters (key -> first owner, name), gathered once by the root
    tied: dict[int, tuple[nn.Module, str]] = field(default_factory=dict)
    compiled_tied: dict[int, torch.Tensor] = field(default_factory=dict)
    # compiled: the gathered parameters of the block whose region is being traced, by slot
    # (simplefsdp.block_regions)
    region: list | None = None
    # the model's simplefsdp.grad_squares.GradSquares while its gradients' squares are tracked
    grad_squares: object | None = None
    root_depths: list[int] = field(default_factory=list)  # len(frames) when each root forward began
    backward_depth: int | None = None  # len(frames) when a backward first re-ran a forward

    def enter(self) -> None:
        if self.backward_depth is None and torch._C._current_graph_task_id() != -1:
            # a forward re-run by activation checkpointing inside backward: checkpointing stops a
            # recompute early by raising out of it, so its frames may never close; close them
            # when the backward ends
            self.backward_depth = len(self.frames)
            Variable._execution_engine.queue_callback(self._end_of_backward)
        self.frames.append([])

    def _end_of_backward(self) -> None:
        depth, self.backward_depth = self.backward_depth, None
        while len(self.frames) > depth:
            self.exit()

    def exit(self) -> None:
        for key in self.frames.pop():
            del self.gathered[key]

    def enter_root(self) -> None:
        self.root_depths.append(len(self.frames))
        self.enter()

    def exit_root(self) -> None:
        """Close the root's frame and any an inner forward left open by raising."""
        depth = self.root_depths.pop()
        while len(self.frames) > depth:
            self.exit()

    def gather_tied(self) -> None:
        """In a compiled root forward: gather each tied parameter once, before any module reads it."""
        self.compiled_tied = {
            key: getattr(owner, WRAPPED_ATTR).gathers[name](owner._parameters[name], self.sink(key))
            for key, (owner, name) in self.tied.items()
        }

    def sink(self, key: int) -> torch.Tensor | None:
        """Where the gradient of parameter ``key`` adds its squares, if they are tracked."""
        return None if self.grad_squares is None else self.grad_squares.sink_of.get(key)

    def read(self, param: torch.Tensor, key: int, tied: bool, gather) -> torch.Tensor:
        """The shard outside a forward; inside, the tensor ``gather`` makes, once per forward."""
        if not self.frames:
            return param
        if key not in self.gathered:
            self.gathered[key] = gather(param)
            self.frames[0 if tied else -1].append(key)
        return self.gathered[key]


@dataclass(frozen=True)
class WrappedParams:
    """What a wrapped module needs to read its parameters, per name: the gather, how the
    parameter is sharded (``.part(full)``: this rank's part of a full tensor), a key shared by
    tied parameters, and whether the parameter is tied. (The model's :class:`ForwardState` is the
    one its forward hooks count in, under ``STATE_ATTR``.)"""

    gathers: dict[str, ParamGather]
    shardings: dict[str, object]
    keys: dict[str, int]
    tied: dict[str, bool]


def _gathered_property(name: str) -> property:
    def read(module: nn.Module) -> torch.Tensor:
        wrapped = getattr(module, WRAPPED_ATTR)
        param = module._parameters[name]
        state = getattr(module, STATE_ATTR)
        if torch.compiler.is_compiling():
            if state.region is not None:  # inside a block's compiled region: gathered outside it
                return state.region[getattr(module, REGION_SLOTS_ATTR)[name]]
            cached = state.compiled_tied.get(wrapped.keys[name]) if wrapped.tied[name] else None
            return wrapped.gathers[name](param, state.sink(wrapped.keys[name])) if cached is None else cached
        key = wrapped.keys[name]
        return state.read(param, key, wrapped.tied[name], functools.partial(wrapped.gathers[name], sink=state.sink(key)))

    return property(read)


def swapped_class(original: type, names: tuple[str, ...]) -> type:
    """The subclass of ``original`` whose parameters ``names`` read through the wrapping (one per
    key; it pickles as this call, :mod:`simplefsdp.generated_classes`)."""
    key = (original, names)
    if key not in _SWAPPED_CLASSES:
        props = {name: _gathered_property(name) for name in names}
        _SWAPPED_CLASSES[key] = generated_class((swapped_class, key), f"SimpleFSDP{original.__name__}", original, props)
    return _SWAPPED_CLASSES[key]


def attach(module: nn.Module, wrapped: WrappedParams, state: ForwardState) -> None:
    """Make ``module``'s parameters read through ``wrapped`` (class swap) and count its forwards in ``state``."""
    cls = swapped_class(type(module), tuple(wrapped.gathers))
    setattr(module, WRAPPED_ATTR, wrapped)
    module.__class__ = cls
    count_forwards(module, state)


def count_forwards(module: nn.Module, state: ForwardState, *, root: bool = False) -> None:
    """Enter ``state`` for each eager forward of ``module``.

    The hooks are the same two functions on every module (they find the state on the module), so
    torch.compile sees identical hooks on every block and compiles a block once. Only the root's
    exit hook runs when forward raises (an always-called hook on every module would make each
    block's guards differ); it closes what inner forwards left open, so a failed forward leaves
    nothing gathered.
    """
    setattr(module, STATE_ATTR, state)
    module.register_forward_pre_hook(_enter_root_forward if root else _enter_forward)
    module.register_forward_hook(_exit_root_forward if root else _exit_forward, always_call=root)


def _enter_forward(module, args) -> None:
    if not torch.compiler.is_compiling():
        getattr(module, STATE_ATTR).enter()


def _exit_forward(module, args, output) -> None:
    if not torch.compiler.is_compiling():
        getattr(module, STATE_ATTR).exit()


def _enter_root_forward(module, args) -> None:
    state = getattr(module, STATE_ATTR)
    if torch.compiler.is_compiling():
        state.gather_tied()  # in the root's frame, outside any checkpointed region
    else:
        state.enter_root()


def _exit_root_forward(module, args, output) -> None:
    state = getattr(module, STATE_ATTR)
    if torch.compiler.is_compiling():
        state.compiled_tied = {}
    else:
        state.exit_root()


def is_wrapped(module: nn.Module) -> bool:
    return hasattr(module, WRAPPED_ATTR)


@contextlib.contextmanager
def gathered(model: nn.Module, *, writeback: bool = False):
    """Full parameters outside forward: ``with gathered(model): model.weight`` is the gathered tensor.

    Every rank must enter it (it gathers each parameter once, in ``model.modules()`` order). The
    gathered tensors are freed on exit. Without ``writeback`` they are what compute reads in a
    forward: in ``param_dtype``, routed experts of this ep rank only, tensor-parallel parameters
    as DTensors on the tp mesh.

    ``writeback=True`` gives each parameter whole (all experts, no tp split) in its stored dtype,
    without autograd, and, when the block exits without an error, copies each rank's part of every
    tensor back into its shard: run the model's own initialization inside it, with the same seed
    on every rank, and the shards hold what initializing before wrapping gives.
    """
    if not isinstance(writeback, bool):
        raise ValueError(f"writeback must be True or False; got {writeback!r}")
    modules = [m for m in model.modules() if is_wrapped(m)]
    if not modules:
        raise ValueError("gathered() needs a model wrapped by simple_fsdp")
    state = getattr(modules[0], STATE_ATTR)
    if state.frames:
        raise ValueError("gathered() is for use outside forward; inside it, parameters are already gathered")
    state.enter()
    try:
        full = {}  # parameter -> (its sharding, the full tensor)
        for module in modules:
            wrapped = getattr(module, WRAPPED_ATTR)
            for name, gather in wrapped.gathers.items():
                param = module._parameters[name]
                sharding = wrapped.shardings[name]
                if writeback:
                    gather = functools.partial(_full_tensor, sharding)
                full[param] = sharding, state.read(param, wrapped.keys[name], wrapped.tied[name], gather)
        yield model
        if writeback:
            _write_back(full)
    finally:
        state.exit()


@torch.no_grad()
def _full_tensor(sharding, param: DTensor) -> torch.Tensor:
    return sharding.full(param.to_local(), param.shape)


@torch.no_grad()
def _write_back(full) -> None:
    """Copy this rank's part of each full tensor into its shard."""
    for param, (sharding, tensor) in full.items():
        param.to_local().copy_(sharding.part(tensor))
