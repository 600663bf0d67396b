"""Hugging Face checkpoint directories (``save_pretrained``'s safetensors) in and out of a wrapped model.

:func:`load_hf_weights` fills a ``simple_fsdp``-wrapped transformers model from a local
``save_pretrained`` directory. Every rank reads only the bytes of its own shards: safetensors
slices are read lazily from the files, one box per parameter (:meth:`_Sharding.box`, the same
chunk arithmetic that cut the shards). Checkpoint keys become model keys through transformers'
own conversion mapping for the model (``get_model_conversion_mapping``: renamings such as
Mixtral's ``block_sparse_moe`` -> ``mlp``, and converters such as the per-expert
``experts.N.gate_proj.weight`` / ``up_proj`` stacked and concatenated into ``experts.gate_up_proj``).
Stacking (``MergeModulelist``) and concatenation (``Concatenate``) are read slice by slice: a rank
reads only its experts, and of them only its rows. Any other converter reads its sources whole,
one key at a time, and runs transformers' converter on them.

Before any tensor is read or written, every rank checks the same things from the file headers
alone, so every rank raises the same ``ValueError`` and no parameter is half loaded: the files
exist, no model key is missing, no checkpoint key is left over, and every shape matches (the
converters are run on meta tensors to get their output shapes). Tied parameters need one of
their names in the checkpoint.

:func:`save_hf_weights` writes the model back as a directory ``from_pretrained`` reads: the
model's config, and one safetensors file per rank that owns keys, with the index naming each
key's file. Each decoder block (and each other key) is owned by one rank, balanced by bytes;
every parameter is gathered whole in turn (a collective on every rank that holds the model: the
ranks of its meshes, a sub-mesh's alone) and kept by its owner only, which then reverts transformers' conversion (``revert_weight_conversion``) on what it
owns and writes its file. Values are saved in the stored dtype.

transformers and safetensors are imported only when these functions are called.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor, Replicate, Shard

from simplefsdp.param_access import WRAPPED_ATTR, is_wrapped

_SINGLE_FILE, _INDEX_FILE = "model.safetensors", "model.safetensors.index.json"


@dataclass(frozen=True)
class _Target:
    """One model key: the tensor to fill, where this rank's part lies in it, and how to read it."""

    name: str
    tensor: torch.Tensor  # the parameter's local shard, or the buffer
    shape: torch.Size  # the full tensor's
    box: tuple[slice, ...]  # this rank's part of the full tensor
    sources: list[str]  # checkpoint keys, in transformers' order (natural key order)
    converter: object | None  # a transformers WeightConverter, or None for a plain (renamed) key


@dataclass(frozen=True)
class LoadedWeights:
    """What :func:`load_hf_weights` loaded on this rank."""

    keys: int  # model keys filled
    elements_read: int  # checkpoint elements read from disk by this rank


# ------------------------------------------------------------------------------------------------
# the model side: each key's tensor, full shape and this rank's box


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile`` wrapped, or ``model`` itself: keys are the model's own, never
    ``_orig_mod.``-prefixed (``from_pretrained`` would find none of them)."""
    return model._orig_mod if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model


@dataclass(frozen=True)
class _Entry:
    """One model key on this rank."""

    module: nn.Module
    name: str  # in module._parameters or module._buffers
    tensor: torch.Tensor  # what a load fills: the parameter's local shard, or the buffer
    shape: torch.Size  # the full tensor's
    box: tuple[slice, ...]  # this rank's part of the full tensor


@torch.no_grad()  # to_local() is then the shard itself, not an autograd view
def _model_entries(model: nn.Module) -> dict[str, _Entry]:
    """The model's keys as in its ``state_dict`` (activation-checkpoint wrappers left out).

    Parameters of wrapped modules are their local shards, with the box their sharding stored;
    other parameters and persistent buffers are whole.
    """
    entries = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{module_name}.".replace(_CHECKPOINT_PREFIX, "") if module_name else ""
        wrapped = getattr(module, WRAPPED_ATTR, None) if is_wrapped(module) else None
        for name, param in module._parameters.items():
            if param is None:
                continue
            if wrapped is not None and name in wrapped.shardings:
                box = wrapped.shardings[name].box(param.shape)
            elif isinstance(param, DTensor):  # another wrapper's (FSDP2's) shard
                box = _dtensor_box(prefix + name, param)
            else:
                box = _whole(param.shape)
            local = param.to_local() if isinstance(param, DTensor) else param
            entries[prefix + name] = _Entry(module, name, local, param.shape, box)
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                entries[prefix + name] = _Entry(module, name, buf, buf.shape, _whole(buf.shape))
    return entries


def _whole(shape) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def _dtensor_box(name: str, param: DTensor) -> tuple[slice, ...]:
    """Where a DTensor's local shard lies in the full tensor (even or torch.chunk-uneven Shard and Replicate only)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(type(p) not in (Shard, Replicate) for p in param.placements):
        raise ValueError(f"{name}: placements {param.placements} are not a box of the full tensor; load before sharding it so")
    local_shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, local_shape))


def _tied_aliases(entries: dict[str, _Entry]) -> dict[str, list[str]]:
    """Model key -> every key of the same tensor (tied parameters share one)."""
    by_tensor: dict[int, list[str]] = {}
    for name, entry in entries.items():
        tensor = entry.module._parameters.get(entry.name, entry.tensor)  # the parameter, not a view of it
        by_tensor.setdefault(id(tensor), []).append(name)
    return {name: names for names in by_tensor.values() for name in names}


# ------------------------------------------------------------------------------------------------
# the checkpoint side: files, headers, and transformers' key conversion


def _checkpoint_files(directory: str) -> dict[str, str]:
    """Checkpoint key -> the safetensors file holding it."""
    index, single = os.path.join(directory, _INDEX_FILE), os.path.join(directory, _SINGLE_FILE)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {key: os.path.join(directory, file) for key, file in weight_map.items()}
    if os.path.exists(single):
        from safetensors import safe_open

        with safe_open(single, "pt") as f:
            return {key: single for key in f.keys()}
    raise ValueError(f"{directory}: no {_SINGLE_FILE} or {_INDEX_FILE} (a save_pretrained directory in safetensors)")


class _Headers:
    """Open safetensors files (by path) and the meta tensors their headers describe."""

    def __init__(self, files: dict[str, str]):
        from safetensors import safe_open

        self.files = files
        self.handles = {path: safe_open(path, "pt") for path in sorted(set(files.values()))}
        self.elements_read = 0

    def meta(self, key: str) -> torch.Tensor:
        part = self.handles[self.files[key]].get_slice(key)
        return torch.empty(part.get_shape(), dtype=_DTYPES[part.get_dtype()], device="meta")

    def read(self, key: str, box=None) -> torch.Tensor:
        part = self.handles[self.files[key]].get_slice(key)
        tensor = part[box] if box is not None else part[:]
        self.elements_read += tensor.numel()
        return tensor


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _split_conversions(model):
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(model)
    return ([t for t in mapping if isinstance(t, WeightRenaming)],
            [t for t in mapping if isinstance(t, WeightConverter)])


def _group_by_target(model, checkpoint_keys, model_keys) -> dict[str, tuple[list[tuple[str, str]], object | None]]:
    """Model key -> ([(source pattern, checkpoint key)], a fresh converter or None), as transformers groups them."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters = _split_conversions(model)
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    groups: dict[str, tuple[list[tuple[str, str]], object | None]] = {}
    for key in sorted(checkpoint_keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, model_keys)
        if target not in model_keys and key in model_keys:  # as transformers: a key already in model form
            target, pattern = key, None
        sources, converter = groups.setdefault(
            target, ([], copy.deepcopy(by_pattern[pattern]) if pattern is not None else None)
        )
        sources.append((pattern, key))
    return groups


def _convert(converter, target: str, sources, tensors: dict[str, torch.Tensor], model) -> torch.Tensor:
    """transformers' converter applied to whole source tensors: the ``target`` tensor."""
    converter = copy.deepcopy(converter)
    for pattern, key in sources:
        converter.add_tensor(target, key, pattern, tensors[key])
    out = converter.convert(target, model=model, config=model.config)
    if target not in out:
        raise ValueError(f"{target}: transformers' converter {converter} gave {sorted(out)}, not this key")
    value = out[target]
    return value[0] if isinstance(value, list) else value


# ------------------------------------------------------------------------------------------------
# reading one target's box


def _sliced_plan(target: _Target) -> int | None:
    """For one source pattern's experts stacked, the concatenation dim 0; for several patterns'
    stacks concatenated (gate and up), that dim. None when the converter is anything else (its
    sources are then read whole)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops, patterns = target.converter.operations, {p for p, _ in target.sources}
    if not ops or not isinstance(ops[0], MergeModulelist) or ops[0].dim != 0:
        return None
    if len(ops) == 1 and len(patterns) == 1:
        return 0
    if len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim >= 1:
        return ops[1].dim
    return None


def _read_stacked(headers: _Headers, target: _Target, cat_dim: int) -> torch.Tensor:
    """This rank's box of ``stack(experts)`` (of ``cat([stack(experts) per pattern], cat_dim)``), read slice by slice."""
    present = {p for p, _ in target.sources}
    patterns = [p for p in target.converter.source_patterns if p in present]  # the order they are concatenated in
    by_pattern = {p: [k for q, k in target.sources if q == p] for p in patterns}
    # every expert of a pattern has one shape (the shape check ran the stacking on meta tensors)
    sizes = {p: headers.meta(by_pattern[p][0]).shape[cat_dim - 1] for p in patterns} if cat_dim else {}
    experts, *rest = target.box
    rows = []
    for e in range(experts.start, experts.stop):
        pieces, offset = [], 0
        for p in patterns:
            key = by_pattern[p][e]
            if not cat_dim:
                pieces.append(headers.read(key, tuple(rest)))
                continue
            size = sizes[p]
            want = rest[cat_dim - 1]
            lo, hi = max(want.start, offset), min(want.stop, offset + size)
            if lo < hi:
                box = list(rest)
                box[cat_dim - 1] = slice(lo - offset, hi - offset)
                pieces.append(headers.read(key, tuple(box)))
            offset += size
        rows.append(pieces[0] if not cat_dim else torch.cat(pieces, dim=cat_dim - 1))
    if not rows:
        return torch.empty([0] + [s.stop - s.start for s in rest], dtype=headers.meta(target.sources[0][1]).dtype)
    return torch.stack(rows)


def _read(headers: _Headers, target: _Target, model) -> torch.Tensor:
    if target.converter is None:
        return headers.read(target.sources[0][1], target.box)
    cat_dim = _sliced_plan(target)
    if cat_dim is not None:
        return _read_stacked(headers, target, cat_dim)
    whole = {key: headers.read(key) for _, key in target.sources}
    return _convert(target.converter, target.name, target.sources, whole, model)[target.box]


# ------------------------------------------------------------------------------------------------
# load


def _plan_load(model: nn.Module, directory: str) -> tuple[_Headers, list[_Target]]:
    """Every check, from headers only (no tensor read, no collective): the targets to fill."""
    entries = _model_entries(model)
    headers = _Headers(_checkpoint_files(directory))
    groups = _group_by_target(model, headers.files, entries)
    unexpected = sorted(k for target, (sources, _) in groups.items() if target not in entries for _, k in sources)
    if unexpected:
        raise ValueError(
            f"{directory}: {len(unexpected)} checkpoint keys match no key of the model "
            f"({type(model).__name__}): {', '.join(unexpected[:5])}{' ...' if len(unexpected) > 5 else ''}"
        )
    aliases = _tied_aliases(entries)
    missing = sorted(k for k in entries if not any(a in groups for a in aliases[k]))
    if missing:
        raise ValueError(
            f"{directory}: {len(missing)} model keys are not in the checkpoint: "
            f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}"
        )
    targets = []
    for name, (sources, converter) in sorted(groups.items()):
        entry = entries[name]
        if converter is None:
            if len(sources) != 1:
                raise ValueError(f"{directory}: {name}: {len(sources)} checkpoint keys map to it: {[k for _, k in sources]}")
            got = headers.meta(sources[0][1]).shape
        else:
            got = _convert(converter, name, sources, {k: headers.meta(k) for _, k in sources}, model).shape
        if got != entry.shape:
            raise ValueError(f"{directory}: {name}: the checkpoint's is {tuple(got)}, the model's {tuple(entry.shape)} (from {sources[0][1]})")
        targets.append(_Target(name, entry.tensor, entry.shape, entry.box, sources, converter))
    return headers, targets


def check_hf_weights(model: nn.Module, directory: str) -> None:
    """The checks :func:`load_hf_weights` makes first (headers only; ``model`` may be on the meta device)."""
    _plan_load(_uncompiled(model), directory)


@torch.no_grad()
def load_hf_weights(model: nn.Module, directory: str) -> LoadedWeights:
    """Fill ``model`` (wrapped by ``simple_fsdp``, or not; compiled, or not) from the ``save_pretrained`` directory ``directory``.

    Every rank calls it; no collective runs. Each rank reads the slices its shards hold and
    copies them in, cast to each tensor's dtype. Raises ``ValueError`` before changing anything
    when keys are missing or left over, or a shape differs.
    """
    model = _uncompiled(model)
    headers, targets = _plan_load(model, directory)
    for target in targets:
        target.tensor.copy_(_read(headers, target, model))
    return LoadedWeights(keys=len(targets), elements_read=headers.elements_read)


# ------------------------------------------------------------------------------------------------
# save


def _owners(model: nn.Module, entries, world: int) -> dict[str, int]:
    """Model key -> the rank that writes it: decoder blocks whole (a converter may join keys of one
    block), every other key alone; largest first, each to the rank with the fewest bytes so far."""
    from simplefsdp.blocks import block_list

    try:
        listed = set(block_list(model))
    except ValueError:  # no block list: every key on its own
        listed = set()
    blocks = [name for name, module in model.named_modules() if module in listed]
    groups: dict[str, list[str]] = {}
    for key in entries:
        block = next((b for b in blocks if key.startswith(b + ".")), key)
        groups.setdefault(block, []).append(key)

    def nbytes(key):
        return entries[key].shape.numel() * entries[key].tensor.element_size()

    load, owner = [0] * world, {}
    for group in sorted(groups, key=lambda g: (-sum(nbytes(k) for k in groups[g]), g)):
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] += sum(nbytes(k) for k in groups[group])
        owner.update({k: rank for k in groups[group]})
    return owner


@torch.no_grad()
def _full(entry: _Entry) -> torch.Tensor:
    """The whole tensor of a model key (gathers a sharded parameter: every rank calls it)."""
    module, name = entry.module, entry.name
    if name not in module._parameters:
        return module._buffers[name].detach()
    param = module._parameters[name]
    wrapped = getattr(module, WRAPPED_ATTR, None) if is_wrapped(module) else None
    if wrapped is not None and name in wrapped.shardings:
        return wrapped.shardings[name].full(param.to_local(), param.shape)
    return param.full_tensor() if isinstance(param, DTensor) else param.detach()


def save_hf_weights(model: nn.Module, directory: str) -> None:
    """Write ``model`` (compiled, or not) as a ``save_pretrained`` directory (safetensors) that
    ``from_pretrained`` reads.

    Every rank that holds the model calls it (each parameter is all-gathered in turn); a model on
    a sub-mesh is saved by that sub-mesh's ranks alone. Keys of tied parameters that transformers
    drops when it saves are dropped too.
    """
    from safetensors.torch import save_file
    from transformers.core_model_loading import revert_weight_conversion

    model = _uncompiled(model)
    ranks, group = _saving_ranks(model)
    rank, world = ranks.index(dist.get_rank()) if ranks else 0, max(len(ranks), 1)
    entries = _model_entries(model)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    entries = {k: v for k, v in entries.items() if k not in tied}
    owner = _owners(model, entries, world)
    writers = sorted(set(owner.values()))
    mine = {}
    for key, entry in entries.items():  # the same order on every rank
        full = _full(entry)
        if owner[key] == rank:
            mine[key] = full.cpu()
    os.makedirs(directory, exist_ok=True)
    out, names = {}, {}
    if mine:
        out = {k: v.contiguous().clone() for k, v in revert_weight_conversion(model, mine).items()}
        file = f"model-{writers.index(rank) + 1:05d}-of-{len(writers):05d}.safetensors"
        save_file(out, os.path.join(directory, file), metadata={"format": "pt"})
        names = dict.fromkeys(out, file)
    sizes = sum(v.numel() * v.element_size() for v in out.values())
    gathered = [(names, sizes)]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, (names, sizes), group=group)
    if rank == 0:
        weight_map = {k: f for names, _ in gathered for k, f in names.items()}
        index = {"metadata": {"total_size": sum(s for _, s in gathered)}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(directory, _INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2)
        model.config.save_pretrained(directory)
    if world > 1:
        dist.barrier(group=group)
        if group is not None:
            dist.destroy_process_group(group)


def _saving_ranks(model: nn.Module) -> tuple[list[int], dist.ProcessGroup | None]:
    """The ranks that hold ``model`` (every rank of its parameters' meshes; every rank of the world
    for a model without DTensors), and a process group over them (None: the world's).

    A model on a sub-mesh is saved by its own ranks only; the group is created by them alone
    (``use_local_synchronization``), so the other ranks need not call in.
    """
    if not dist.is_initialized():
        return [], None
    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor)}
    ranks = sorted({r for mesh in meshes for r in mesh.mesh.flatten().tolist()}) or list(range(dist.get_world_size()))
    if dist.get_rank() not in ranks:
        raise ValueError(f"rank {dist.get_rank()} holds no part of the model (its meshes span ranks {ranks}); only those ranks save it")
    if len(ranks) == dist.get_world_size() or len(ranks) == 1:
        return ranks, None
    return ranks, dist.new_group(ranks, use_local_synchronization=True)
