"""What SimpleFSDP sets while torch compiles, so that a second process hits the compile caches.

Dynamo's compile-start and compile-end callbacks (which also bracket a backward compiled lazily)
bracket two settings; both are undone when the compile ends, and what was there before is put
back.

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
"""

from __future__ import annotations

import copyreg
import pickle

import torch
from torch.distributed.device_mesh import DeviceMesh

_NOTHING = object()
_before = [_NOTHING]  # the dispatch-table entry our reducer stands in for, while a compile runs
_ALLOW_FUNCTIONS = "autograd_cache_allow_custom_autograd_functions"
_allow_before = [_NOTHING]  # the setting before the compile started


def _reduce_mesh(mesh: DeviceMesh):
    reduced = mesh.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    state = reduced[2]
    if isinstance(state, dict) and "_hash" in state:
        state = {k: v for k, v in state.items() if k != "_hash"}
    return (*reduced[:2], state, *reduced[3:])


def _on_compile_start(_args) -> None:
    current = copyreg.dispatch_table.get(DeviceMesh, _NOTHING)
    if current is not _reduce_mesh:
        _before[0] = current
        copyreg.dispatch_table[DeviceMesh] = _reduce_mesh
    config = torch._functorch.config
    if hasattr(config, _ALLOW_FUNCTIONS) and _allow_before[0] is _NOTHING:
        _allow_before[0] = getattr(config, _ALLOW_FUNCTIONS)
        setattr(config, _ALLOW_FUNCTIONS, True)


def _on_compile_end(_args) -> None:
    before, _before[0] = _before[0], _NOTHING
    if copyreg.dispatch_table.get(DeviceMesh) is _reduce_mesh:
        if before is _NOTHING:
            del copyreg.dispatch_table[DeviceMesh]
        else:
            copyreg.dispatch_table[DeviceMesh] = before
    allow_before, _allow_before[0] = _allow_before[0], _NOTHING
    if allow_before is not _NOTHING:
        setattr(torch._functorch.config, _ALLOW_FUNCTIONS, allow_before)


def install() -> None:
    """Register the callbacks (idempotent; ``torch._dynamo.reset()`` clears them, so
    ``simple_fsdp`` calls this each time)."""
    callbacks = getattr(torch._dynamo.callback, "callback_handler", None)
    if callbacks is None:
        return
    if _on_compile_start not in callbacks.start_callbacks:
        callbacks.register_start_callback(_on_compile_start)
        callbacks.register_end_callback(_on_compile_end)
