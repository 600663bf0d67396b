"""What SimpleFSDP sets while torch compiles, so that a second process hits the compile caches.

Dynamo's compile-start and compile-end callbacks (which also bracket a backward compiled lazily)
bracket these settings; each is undone when the compile ends, and what was there before is put
back. :func:`on_each_compile` and :class:`CompileSetting` are that mechanism, which
:mod:`simplefsdp.block_regions` uses for a setting of its own; :func:`compile_callbacks` runs
those callbacks around a compile Dynamo does not bracket (:mod:`simplefsdp.precompile`).

* **DeviceMesh in cache keys.** A compiled DTensor graph takes its DeviceMesh as an input (on
  torch 2.13 an opaque object), and AOTAutograd's and Inductor's cache keys pickle it with the
  pickler's copy of ``copyreg.dispatch_table``. The mesh's pickled state holds ``_hash``, the
  mesh's cached Python ``hash()``: it hashes the dim names, strings whose hash differs in every
  process (``PYTHONHASHSEED``), and the creating thread's id. So a second process, or another
  rank's process, computed another key for the same graph and never hit the cache. A reducer for
  DeviceMesh in ``copyreg.dispatch_table`` pickles the mesh as torch would, without ``_hash``:
  everything else (ranks, layout, dim names, process group names, this rank's coordinates) stays
  in the key, so ranks of different groups still get keys of their own. The mesh recomputes
  ``_hash`` on first use, so a mesh pickled then loads as before.
* **Graphs with an autograd.Function.** Routed experts divide their reduced gradient in an
  ``autograd.Function`` (``param_gather._DivideGrad``), which Dynamo traces into the
  ``autograd_function_apply`` higher-order op, forward and backward as graphs of their own that
  are part of the cache key. AOTAutograd bypasses its cache for such graphs unless
  ``torch._functorch.config.autograd_cache_allow_custom_autograd_functions`` is on (off by default
  while torch tests it more widely; pytorch/pytorch#149751 found the op pure in its inputs). It is
  on while torch compiles, for every autograd.Function in the compiled graph (a user's too);
  torch versions without the setting are left as they are.
* **DTensor calls as Dynamo traces them on torch 2.11.** Dynamo 2.11 puts ``DTensor.from_local``,
  ``redistribute`` and ``to_local`` (which every gather calls) into its graph as closures made on
  the fly, their mesh and placements captured in the closure, not in the graph
  (pytorch/pytorch#152829). AOTAutograd cannot key a closure, so it bypassed its cache for every
  graph with a gather (pytorch/pytorch#167349). While such a torch compiles, a pre-grad pass
  (which runs before AOTAutograd computes its key) rewrites each of those three closures into
  :func:`dtensor_call`, whose first argument is a key naming the closure and every value it
  captured (mesh ranks, dim names and process groups; placements by their repr; dtypes). The key
  is in the graph's code, so it is in the cache key, and two graphs that differ only in what a
  closure captured get different keys; ``dtensor_call`` looks the closure up by it in this
  process and calls it, so tracing runs exactly what it ran before. A closure holding anything
  the key cannot name stays as it was (and the graph is not cached, as before). torch 2.13's
  Dynamo traces these calls without closures, so there nothing is set.
"""

from __future__ import annotations

import contextlib
import copyreg
import importlib
import pickle
from typing import Any, Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

_NOTHING = object()
_before = [_NOTHING]  # the dispatch-table entry our reducer stands in for, while a compile runs


class CompileSetting:
    """``<config>.<name> = value`` while torch compiles (:meth:`start` and :meth:`end` are Dynamo's
    compile callbacks; ``config`` names a torch config module, imported when a compile starts);
    the value before is put back when the compile ends. A torch whose config lacks the setting is
    left as it is."""

    def __init__(self, config: str, name: str, value: Any):
        self.config, self.name, self.value = config, name, value
        self.before = _NOTHING

    def start(self, _args=None) -> None:
        config = importlib.import_module(self.config)
        if hasattr(config, self.name) and self.before is _NOTHING:
            self.before = getattr(config, self.name)
            setattr(config, self.name, self.value)

    def end(self, _args=None) -> None:
        before, self.before = self.before, _NOTHING
        if before is not _NOTHING:
            setattr(importlib.import_module(self.config), self.name, before)


_ALLOW_FUNCTIONS = CompileSetting("torch._functorch.config", "autograd_cache_allow_custom_autograd_functions", True)


def _reduce_mesh(mesh: DeviceMesh):
    reduced = mesh.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    state = reduced[2]
    if isinstance(state, dict) and "_hash" in state:
        state = {k: v for k, v in state.items() if k != "_hash"}
    return (*reduced[:2], state, *reduced[3:])


# Dynamo's on-the-fly DTensor closures (torch 2.11) that call a DTensor function or method with
# the values they captured: DTensor.from_local, DTensor.redistribute, DTensor.to_local
_DYNAMO_DTENSOR_CLOSURES = frozenset({
    "TorchInGraphFunctionVariable._get_handlers.<locals>.handle_from_local.<locals>.fn_with_prim_types",
    "TensorVariable.method_redistribute.<locals>.redistribute_fn_with_prim_types",
    "TensorVariable.method_to_local.<locals>.to_local_fn_with_prim_types",
})
_PLACEMENTS = (Shard, _StridedShard, Replicate, Partial)
_closures: dict[str, Callable] = {}  # dtensor_call's key -> a closure Dynamo made, in this process
_DTENSOR_CALL = f"{__name__}.dtensor_call"
# inductor's pre_grad_custom_pass and unsafe_marked_cacheable_functions before the compile started
_inductor_before = [_NOTHING]


def dtensor_call(key: str, *args: Any, **kwargs: Any) -> Any:
    """Call the Dynamo DTensor closure that ``key`` names (see the module docstring)."""
    return _closures[key](*args, **kwargs)


class _Unnamed(Exception):
    """A captured value the key cannot name."""


def _stable_name(value: Any) -> str:
    """A string for ``value`` that is the same in every process, or :class:`_Unnamed`."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__}({', '.join(map(_stable_name, value))})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_stable_name(v)}" for k, v in sorted(value.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(value, DeviceMesh):
        groups = [value.get_group(i).group_name for i in range(value.ndim)]
        return f"DeviceMesh({value.device_type!r}, {value.mesh.tolist()}, {value.mesh_dim_names!r}, {groups!r})"
    if type(value) in _PLACEMENTS:  # exact types: their repr shows all their state
        return repr(value)
    function = getattr(value, "value", None)  # the VariableTracker of the function from_local calls
    if type(value).__module__.startswith("torch._dynamo.variables") and callable(function):
        return f"{type(value).__name__}({function.__module__}.{function.__qualname__})"
    raise _Unnamed(type(value).__qualname__)


def _closure_key(closure: Callable) -> str:
    captured = zip(closure.__code__.co_freevars, (cell.cell_contents for cell in closure.__closure__ or ()))
    return f"{closure.__qualname__}: " + "; ".join(f"{name}={_stable_name(value)}" for name, value in captured)


def name_dtensor_closures(graph: torch.fx.Graph) -> None:
    """Rewrite Dynamo's DTensor closures in ``graph`` into :func:`dtensor_call` with a key."""
    for node in graph.nodes:
        if node.op != "call_function" or getattr(node.target, "__qualname__", None) not in _DYNAMO_DTENSOR_CLOSURES:
            continue
        try:
            key = _closure_key(node.target)
        except _Unnamed:
            continue
        _closures[key] = node.target
        node.target = dtensor_call
        node.args = (key, *node.args)


def _dynamo_makes_dtensor_closures() -> bool:
    from torch._dynamo.variables.tensor import TensorVariable

    return hasattr(TensorVariable, "method_to_local")


def _pre_grad_pass(user_pass: Callable | None) -> Callable:
    if user_pass is None:
        return name_dtensor_closures

    def both(graph: torch.fx.Graph) -> None:
        name_dtensor_closures(graph)
        user_pass(graph)

    return both


def _on_compile_start(_args) -> None:
    current = copyreg.dispatch_table.get(DeviceMesh, _NOTHING)
    if current is not _reduce_mesh:
        _before[0] = current
        copyreg.dispatch_table[DeviceMesh] = _reduce_mesh
    _ALLOW_FUNCTIONS.start()
    if _dynamo_makes_dtensor_closures() and _inductor_before[0] is _NOTHING:
        inductor = torch._inductor.config
        _inductor_before[0] = (inductor.pre_grad_custom_pass, inductor.unsafe_marked_cacheable_functions)
        inductor.pre_grad_custom_pass = _pre_grad_pass(inductor.pre_grad_custom_pass)
        # a new dict, so the one saved above is what the end of the compile puts back unchanged
        inductor.unsafe_marked_cacheable_functions = {**inductor.unsafe_marked_cacheable_functions,
                                                      _DTENSOR_CALL: "the key argument names the call"}


def _on_compile_end(_args) -> None:
    before, _before[0] = _before[0], _NOTHING
    if copyreg.dispatch_table.get(DeviceMesh) is _reduce_mesh:
        if before is _NOTHING:
            del copyreg.dispatch_table[DeviceMesh]
        else:
            copyreg.dispatch_table[DeviceMesh] = before
    _ALLOW_FUNCTIONS.end()
    inductor_before, _inductor_before[0] = _inductor_before[0], _NOTHING
    if inductor_before is not _NOTHING:
        inductor = torch._inductor.config
        inductor.pre_grad_custom_pass, inductor.unsafe_marked_cacheable_functions = inductor_before


def on_each_compile(start: Callable, end: Callable) -> None:
    """Have Dynamo call ``start`` when a compile starts and ``end`` when it ends (idempotent;
    ``torch._dynamo.reset()`` clears them, so callers register again each time)."""
    callbacks = getattr(torch._dynamo.callback, "callback_handler", None)
    if callbacks is not None and start not in callbacks.start_callbacks:
        callbacks.register_start_callback(start)
        callbacks.register_end_callback(end)


@contextlib.contextmanager
def compile_callbacks(name: str):
    """Run Dynamo's compile-start callbacks on entry and its compile-end callbacks on exit, as
    Dynamo does around each compile, for a compile it does not bracket itself (an AOT precompile,
    :mod:`simplefsdp.precompile`); inside a compile already bracketed, nothing more runs."""
    from torch._dynamo.callback import CallbackTrigger, callback_handler

    with callback_handler.install_callbacks(CallbackTrigger.DYNAMO, name):
        yield


def install() -> None:
    """Register the callbacks (``simple_fsdp`` calls this each time)."""
    on_each_compile(_on_compile_start, _on_compile_end)
