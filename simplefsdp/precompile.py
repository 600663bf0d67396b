"""Warm starts without Dynamo: the compiled model saved per rank and loaded by the next process.

With every compile cache warm, a new process still runs Dynamo over the whole model, every block
and every gather, before it loads the compiled graphs (most of a warm first step: RESULTS.md,
"Warm start"). Torch's AOT precompile (``torch.compile(...).forward.aot_compile``, experimental
in torch 2.11 and 2.13) traces once, compiles forward and backward, and serialises the result
with Dynamo's guards and the bytecode that calls it; ``torch.compiler.load_compiled_function``
gives it back in another process without tracing. :func:`precompile` wraps that:

* **One file per rank and setting** under ``directory`` (by default ``simplefsdp_precompiled`` in
  Inductor's cache dir, ``TORCHINDUCTOR_CACHE_DIR``, beside the kernels it needs): its name hashes what the compiled code
  depends on and guards do not check: torch and Python versions, this package's sources (the
  passes run inside Inductor, where Dynamo's source checks do not see them), rank and world size,
  every parameter's and buffer's name, shape, dtype, placements and mesh, the call's argument
  shapes and dtypes and the model's training mode, the ``options`` (a pass by its ``uuid()``), Inductor's and Dynamo's portable
  settings, and the caller's ``key``. Another setting gets a file of its own.
* **Loaded only when it still holds.** Dynamo records the source lines of every function it
  traced; a file whose recorded lines changed since (the user's model code, say) is compiled
  again and replaced, as is one torch cannot load (another torch or GPU). Each call checks the
  saved guards (input shapes and dtypes, ``module.training`` and the other attributes the trace
  read); a call that fails them runs through an ordinary ``torch.compile`` of the model instead,
  with a warning, as a recompile would. So does a model torch cannot save (nested compile
  regions, :mod:`simplefsdp.block_regions`: "DICT_VERSION guard cannot be serialized").
* **SimpleFSDP's compile settings apply.** Dynamo's compile callbacks, which
  :mod:`simplefsdp.compile_cache`, :mod:`simplefsdp.block_regions` and the passes use to set
  torch while it compiles, bracket a normal compile but not an AOT one; :func:`precompile` runs
  them around it.
* **Kernels.** The file holds Inductor's generated code, not its compiled kernels: a process on
  a fresh ``TORCHINDUCTOR_CACHE_DIR`` (and Triton cache) compiles those again on load. Same
  machine, same cache: nothing is compiled, because the load runs under the compile's
  ``options`` (the kernels' cache keys hold them: scalar C++ kernels are another build).

The numerics are those of ``torch.compile(model, fullgraph=True, options=options)``: the same
graphs, passes and kernels (``tests/core/test_precompile.py`` compares gradients bitwise).
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import logging
import os
import sys
import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from simplefsdp.compile_cache import compile_callbacks

log = logging.getLogger(__name__)
_PACKAGE_DIRS = tuple(os.path.dirname(importlib.import_module(name).__file__)
                      for name in ("simplefsdp", "simplefsdp.passes"))


def _sources_hash() -> str:
    digest = hashlib.sha256()
    for folder in _PACKAGE_DIRS:
        for root, _dirs, files in sorted(os.walk(folder)):
            for name in sorted(f for f in files if f.endswith(".py")):
                with open(os.path.join(root, name), "rb") as f:
                    digest.update(name.encode() + f.read())
    return digest.hexdigest()


def _tensor_key(t: Any) -> str:
    if isinstance(t, DTensor):
        mesh = t.device_mesh
        return f"DTensor{tuple(t.shape)} {t.dtype} {t.placements} {mesh.mesh.tolist()} {mesh.mesh_dim_names}"
    if isinstance(t, torch.Tensor):
        return f"Tensor{tuple(t.shape)} {t.dtype} {t.device.type} {t.stride()}"
    return repr(t)


def _canonical(value: Any) -> str:
    """``repr`` with sets and dicts in sorted order, so that every process writes the same."""
    uuid = getattr(value, "uuid", None)  # an Inductor pass names its code and configuration so
    if callable(uuid):
        return repr(uuid())
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(map(_canonical, value))) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(sorted(f"{_canonical(k)}: {_canonical(v)}" for k, v in value.items())) + "}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__}({', '.join(map(_canonical, value))})"
    return repr(value)


def _target_key(target: nn.Module | Callable, options: dict | None, key: str) -> str:
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    parts = [torch.__version__, sys.version, _sources_hash(), f"rank {rank} of {world}", key,
             _canonical(options or {}), _canonical(torch._inductor.config.save_config_portable()),
             _canonical(torch._dynamo.config.save_config_portable())]
    if not isinstance(target, nn.Module):
        return "\n".join([*parts, f"{target.__module__}.{target.__qualname__}"])
    parts += [f"{type(m).__module__}.{type(m).__qualname__} {name}" for name, m in target.named_modules()]
    parts += [f"{name}: {_tensor_key(t)}" for name, t in (*target.named_parameters(), *target.named_buffers())]
    return "\n".join(parts)


def _sources_unchanged(fn) -> bool:
    """Whether every source line range Dynamo traced into ``fn`` reads as it did then."""
    for source in fn.source_info().inlined_sources:
        try:
            lines = inspect.getsourcelines(importlib.import_module(source.module))[0]
        except (ImportError, OSError, TypeError):
            return False
        text = "".join(lines[source.firstlineno - 1:source.lastlineno - 1])
        if hashlib.sha256(text.encode()).hexdigest() != source.checksum:
            log.info("precompile: %s changed since it was traced", source.module)
            return False
    return True


class Precompiled:
    """``target`` (a module, or a function such as a loss) compiled ahead of its first call and
    saved (module docstring); call it as ``target``. ``origin`` says where the latest call's
    compiled function came from: ``"loaded"`` (a file in ``directory``), ``"compiled"`` (compiled
    now and saved) or ``"torch.compile"`` (the saved guards did not hold; an ordinary compile ran
    the call)."""

    def __init__(self, target: nn.Module | Callable, directory: str | None = None, *, options: dict | None = None,
                 key: str = ""):
        if torch._inductor.config.force_disable_caches:
            raise ValueError("precompile needs Inductor's caches; unset TORCHINDUCTOR_FORCE_DISABLE_CACHES "
                             "(torch._inductor.config.force_disable_caches)")
        with torch._dynamo.config.patch(enable_aot_compile=True):  # torch 2.11 attaches aot_compile only so
            self.compiled = torch.compile(target, fullgraph=True, options=options)
        self.target, self.options, self.key = target, options, key
        if directory is None:
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            directory = os.path.join(cache_dir(), "simplefsdp_precompiled")
        self.directory = directory
        self.origin = None
        # a module's compiled function takes the module first (it compiled the module's __call__)
        self._self = (target,) if isinstance(target, nn.Module) else ()
        self._target_key = None
        self._functions: dict[str, tuple[Callable, str]] = {}  # path -> (function, its origin)
        self._warned = False

    def path(self, *args: Any, **kwargs: Any) -> str:
        """The file this call's compiled function is saved in."""
        if self._target_key is None:
            self._target_key = _target_key(self.target, self.options, self.key)
        mode = f"training={self.target.training} " if self._self else ""
        call = mode + repr([_tensor_key(a) for a in args]) + repr(sorted((k, _tensor_key(v)) for k, v in kwargs.items()))
        digest = hashlib.sha256((self._target_key + "\n" + call).encode()).hexdigest()[:32]
        return os.path.join(self.directory, f"{digest}.pt")

    def _load(self, path: str):
        try:
            # loading builds the generated code's kernels, or finds them in the cache, by keys
            # that hold Inductor's settings: those of the compile (``cpp.simdlen`` for CPU jobs'
            # scalar kernels), or it builds other kernels than the ones the compile built
            with open(path, "rb") as f, torch._inductor.config.patch(self.options or {}):
                fn = torch.compiler.load_compiled_function(f)
        except Exception as e:  # noqa: BLE001 - another torch, another GPU, a truncated file: compile again
            log.warning("precompile: cannot load %s (%s: %s); compiling again", path, type(e).__name__, e)
            return None
        return fn if _sources_unchanged(fn) else None

    def _function(self, args, kwargs) -> tuple[Callable, str]:
        path = self.path(*args, **kwargs)
        if path not in self._functions:
            fn, origin = (self._load(path) if os.path.exists(path) else None), "loaded"
            if fn is None:
                fn, origin = self._compile_and_save(path, args, kwargs), "compiled"
            if fn is not None:
                fn.disable_guard_check()  # __call__ checks them, once
            self._functions[path] = fn, origin
        return self._functions[path]

    def _compile_and_save(self, path: str, args, kwargs):
        compiled = self.compiled.forward if self._self else self.compiled
        try:
            with compile_callbacks("precompile"):
                fn = compiled.aot_compile((args, kwargs))
            os.makedirs(self.directory, exist_ok=True)
            fn.save_compiled_function(path)
        except Exception as e:  # noqa: BLE001 - torch cannot save it: compile as torch.compile does
            warnings.warn(f"precompile: torch cannot save this compiled function ({type(e).__name__}: {e}); "
                          "compiling it with torch.compile instead, which the next process traces again", stacklevel=4)
            return None
        return fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn, self.origin = self._function(args, kwargs)
        if fn is None:
            self.origin = "torch.compile"
            return self.compiled(*args, **kwargs)
        if fn.guard_check(*self._self, *args, **kwargs):
            return fn(*self._self, *args, **kwargs)
        if not self._warned:
            self._warned = True
            warnings.warn("precompile: the saved compiled function's guards do not hold for this call (an "
                          "attribute it read changed, or a hook was added); running it through torch.compile "
                          "instead, which compiles it again", stacklevel=2)
        self.origin = "torch.compile"
        return self.compiled(*args, **kwargs)


def precompile(target: nn.Module | Callable, directory: str | None = None, *, options: dict | None = None,
               key: str = "") -> Precompiled:
    """``torch.compile(target, fullgraph=True, options=options)`` whose compiled forward and
    backward are saved under ``directory`` (default: in Inductor's cache dir) by the first process
    and loaded, without tracing, by the next (module docstring). ``key``: anything else the
    compiled code depends on that the file name should hold (a config's fingerprint)."""
    return Precompiled(target, directory, options=options, key=key)
