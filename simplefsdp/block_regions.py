"""Compile each distinct block once: the block's math in a nested compile region, its FSDP
collectives in the model's graph.

A whole-model ``torch.compile`` lowers every block of the model again, so its compile time grows
with depth. :func:`compile_blocks_once` makes each block's compiled forward do two things:

1. read every parameter of the block, in module order, in the block's own frame: each read is
   SimpleFSDP's gather (all-gather, casts), traced into the model's graph as before;
2. call the block's own forward inside ``torch.compiler.nested_compile_region``, with the
   gathered tensors as explicit arguments. While it is traced, the block's parameters read as
   those arguments (``ForwardState.region``, by each parameter's slot in the block).

Blocks whose regions trace to the same graph (the same class, shapes and dtypes) share one
``invoke_subgraph`` body: AOTAutograd and Inductor compile it once, and the model's graph calls
it per block. Dynamo still traces every block (the slot assignment is a side effect, which keeps
torch 2.13 from reusing a region's trace; it then deduplicates the traced graphs, as 2.11 always
does). Every all-gather and reduce-scatter stays in the outer graph, so SimpleFSDP's bucketing and
prefetch see and reorder them across blocks; Inductor's post-grad passes run on each region body
first, then on the outer graph. With ``reshard_after_forward`` the region's backward reads its
parameters from the outer graph, which gathers them again (:mod:`simplefsdp.passes.region_saves`):
AOTAutograd partitions a region by itself, and its forward body returns the gathered parameters
its backward body needs, which would otherwise keep them from forward to backward.

While torch compiles (Dynamo's compile callbacks, from the first ``compile_blocks_once`` in the
process on), Dynamo's ``inline_single_use_invoke_subgraph`` (torch 2.13) is off and put back when
the compile ends: a block whose region is called once (the one dense block of a MoE model) would
otherwise be inlined into the model's graph, and under activation checkpointing its gathers,
outside the block's checkpoint, then feed it across a checkpoint boundary, where the partitioner
saves them for backward whatever their own policy (resharding dropped for that block).

Routed experts under expert parallelism (``ep > 1``) stay out of regions: their token
all-to-alls take data-dependent split sizes, and torch (2.13) loses those unbacked sizes when a
region body is reused ("NameError: name 'u127' is not defined" in the generated outer graph).
Putting only the expert math in a region does not help yet: its rows arrive in a data-dependent
number, a different unbacked size per chunk and block, and torch compiles one body per size
(2.11) or fails to guard on ``Eq(u1, u0)`` (2.13; the xfail test
``test_torch_shares_a_region_body_across_data_dependent_row_counts``). So a block holding such
experts is not one region: each of its largest submodules that holds none (attention, router,
shared experts) is a region of its own, shared across blocks as whole blocks are, and the routed
experts (their gathers, all-to-alls, permutation and grouped matmuls), the glue in the forwards
above them (the block's residual adds, the MoE layer's weighting) and the norms are traced into
the outer graph, as a whole-model compile traces them. A norm (a submodule whose parameters are
all vectors) stays there because a region boundary would change its bits: Inductor fuses its
backward's reduction with the residual add that feeds it, and a norm cut off into a region of its
own reduced in another kernel (gradients 1e-9 apart on CPU, 2 ranks, FSDP2 x EP2).

What it needs, and refuses otherwise (a ValueError before anything changes):

* No tensor parallelism: inside a region the gathered parameters are plain tensors, and a TP
  block's activations are DTensors (the compile failed with "got mixed torch.Tensor and DTensor").
* ``torch.compile(model, options=compile_options(blocks_once=True))``: Inductor's buffer reuse off
  and the joint-graph pass above (checked when the graph is lowered:
  :mod:`simplefsdp.passes.block_region_check`).

Eagerly nothing changes: the block's forward runs as it is.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from simplefsdp.blocks import block_list
from simplefsdp.compile_cache import CompileSetting, on_each_compile
from simplefsdp.mesh_layout import TP
from simplefsdp.moe.token_dispatch import TokenDispatcher
from simplefsdp.param_access import REGION_SLOTS_ATTR, STATE_ATTR, WRAPPED_ATTR, is_wrapped
from simplefsdp.wrap import is_simple_fsdp

_READS_ATTR = "_simplefsdp_region_reads"  # the block's (module, parameter name) pairs, in slot order
_REGION_CLASSES: dict[type, type] = {}


def _block_math(block: nn.Module, params: list[torch.Tensor], *args, **kwargs):
    """The block's own forward, reading its parameters from ``params`` (the region's body)."""
    state = getattr(block, STATE_ATTR)
    state.region = params
    try:
        return block._simplefsdp_block_forward(*args, **kwargs)
    finally:
        state.region = None


_region = torch.compiler.nested_compile_region(_block_math) if hasattr(torch.compiler, "nested_compile_region") else None


# torch 2.13 inlines a region called once (module docstring)
_KEEP_SINGLE_USE_REGIONS = CompileSetting("torch._dynamo.config", "inline_single_use_invoke_subgraph", False)


def _region_forward(self, *args, **kwargs):
    if not torch.compiler.is_compiling():
        return self._simplefsdp_block_forward(*args, **kwargs)
    params = [getattr(module, name) for module, name in getattr(self, _READS_ATTR)]  # gathers
    return _region(self, params, *args, **kwargs)


def _region_class(cls: type) -> type:
    """One generated subclass per block class (all blocks share it, so they share guards)."""
    if cls not in _REGION_CLASSES:
        _REGION_CLASSES[cls] = type(
            f"CompiledOnce{cls.__name__}", (cls,), {"forward": _region_forward, "_simplefsdp_block_forward": cls.forward}
        )
    return _REGION_CLASSES[cls]


def _holds_routed_experts(module: nn.Module) -> bool:
    return any(isinstance(getattr(m, "expert_parallel", None), TokenDispatcher) for m in module.modules())


def _region_units(name: str, block: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules of ``block`` that become regions, by path: the block itself, or, where it
    holds routed experts under expert parallelism, its largest submodules that hold none (module
    docstring). The routed experts, the norms, and what the modules above them compute in their
    own forwards, stay in the outer graph."""
    if not _holds_routed_experts(block):
        return [(name, block)]
    units = []
    for child_name, child in block.named_children():
        if all(p.dim() <= 1 for p in child.parameters()):
            continue  # a norm: inline, fused with the residual add around it (module docstring)
        units.extend(_region_units(f"{name}.{child_name}", child))
    return units


def _unit_reads(name: str, unit: nn.Module, owner: dict) -> list[tuple[nn.Module, str]]:
    """The unit's wrapped parameters as (module, name), in module order; ValueError for a module
    shared with another unit."""
    reads = []
    for path, module in unit.named_modules():
        if not is_wrapped(module):
            continue
        if owner.setdefault(module, name) != name:
            where = f"{name}.{path}" if path else name
            raise ValueError(
                f"compile_blocks_once: module {where!r} belongs to regions {owner[module]!r} and "
                f"{name!r}; a region's parameters must be its own"
            )
        reads.extend((module, pname) for pname in getattr(module, WRAPPED_ATTR).gathers)
    return reads


def _mesh_dims(param: torch.Tensor) -> tuple[str, ...]:
    mesh = getattr(param, "device_mesh", None)  # a DTensor's
    return (mesh.mesh_dim_names or ()) if mesh is not None else ()


def compile_blocks_once(model: nn.Module, blocks: str | None = None) -> nn.Module:
    """Make ``torch.compile(model)`` compile each distinct block of ``model`` once (in place;
    returns ``model``). ``model`` must be wrapped by ``simple_fsdp``; ``blocks`` names the block
    list's path when the default (:func:`simplefsdp.blocks.block_list`) does not find it. Raises
    ValueError, before changing anything, for a model it cannot apply to (module docstring)."""
    if _region is None:
        raise ValueError("compile_blocks_once needs torch.compiler.nested_compile_region (torch >= 2.11)")
    if not is_simple_fsdp(model):
        raise ValueError("compile_blocks_once needs a model wrapped by simple_fsdp (call simple_fsdp first)")
    tp = next((name for name, p in model.named_parameters() if TP in _mesh_dims(p)), None)
    if tp is not None:
        raise ValueError(
            f"compile_blocks_once: parameter {tp!r} is tensor-parallel (mesh dim {TP!r}); blocks compiled once "
            "do not take tensor parallelism (a region's plain-tensor parameters would meet DTensor activations); "
            "compile the whole model"
        )
    layers = block_list(model, blocks)
    prefix = blocks if blocks is not None else next(n for n, m in model.named_modules() if m is layers)
    owner: dict[nn.Module, str] = {}
    plans = []
    for i, block in enumerate(layers):
        name = f"{prefix}.{i}" if prefix else str(i)
        if any(hasattr(m, _READS_ATTR) for m in block.modules()):
            raise ValueError(f"compile_blocks_once: block {name!r} already compiles once")
        units = [(unit, _unit_reads(path, unit, owner)) for path, unit in _region_units(name, block)]
        units = [(unit, reads) for unit, reads in units if reads]  # a unit with no parameter stays inline
        if not units:
            raise ValueError(f"compile_blocks_once: block {name!r} has no parameters wrapped by simple_fsdp")
        plans.extend(units)
    on_each_compile(_KEEP_SINGLE_USE_REGIONS.start, _KEEP_SINGLE_USE_REGIONS.end)
    for unit, reads in plans:  # apply, once every block has passed
        for slot, (module, pname) in enumerate(reads):
            module.__dict__.setdefault(REGION_SLOTS_ATTR, {})[pname] = slot
        setattr(unit, _READS_ATTR, reads)
        setattr(unit, STATE_ATTR, getattr(reads[0][0], STATE_ATTR))
        unit.__class__ = _region_class(type(unit))
    return model
