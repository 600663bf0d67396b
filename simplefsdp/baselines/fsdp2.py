"""The FSDP2 baseline: the same model under ``torch.distributed.fsdp.fully_shard``.

Used by the parity tests and the benchmarks to compare SimpleFSDP with FSDP2 on the same model,
data and mesh. Each transformer block and the root are ``fully_shard`` units. With ``ep > 1`` the
routed experts keep only their ep rank's slice of the expert dim and use the same
:class:`~simplefsdp.moe.token_dispatch.TokenDispatcher` dispatch; they are FSDP-sharded on the
edp mesh in one of two forms:

* ``experts_in_blocks=True`` (the default where torch has ``ShardPlacementResult``, 2.13): one
  ``fully_shard`` per block, whose ``shard_placement_fn`` puts the experts' parameters on the edp
  mesh and every other parameter on the dense mesh, as upstream FSDP2 now shards MoE models. A
  block is then one unit, which is what lets FSDP2 compile MoE blocks one by one;
* ``experts_in_blocks=False`` (torch 2.11): the experts are a ``fully_shard`` unit of their own.

Either way the experts' gradients are summed and divided by the whole dp degree, like
SimpleFSDP's experts (a block unit divides its dense gradients by that same degree).

FSDP2 sees each ep rank's experts as a whole tensor of ``num_experts / ep`` experts, so its state
dict would give every ep rank the same key with other experts under it, and a DCP checkpoint would
keep one ep rank's. :func:`global_expert_state` re-labels those entries (parameters and optimizer
state) as shards of the whole expert tensor on the ``[dp_replicate,] edp, ep`` mesh, sharing
their storage: saved so, a checkpoint holds every expert and loads into any layout, as
SimpleFSDP's do.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from simplefsdp.blocks import block_list
from simplefsdp.moe.routed_experts import is_routed_experts, set_dispatcher
from simplefsdp.moe.token_dispatch import DEFAULT_EP_CHUNKS, TokenDispatcher, token_group
from simplefsdp.mesh_layout import DP_REPLICATE, resolve_layout
from simplefsdp.sharding import local_experts

try:  # torch >= 2.13: a parameter of a unit may live on a mesh of its own
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
except ImportError:
    ShardPlacementResult = None


_EXPERTS_MESH_ATTR = "_fsdp2_experts_mesh"  # routed experts: the [dp_replicate,] edp, ep mesh


def _keep_local_experts(module: nn.Module, experts, chunks: int, group) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        module._parameters[name] = nn.Parameter(local_experts(param, experts.ep_mesh), requires_grad=param.requires_grad)
    set_dispatcher(module, TokenDispatcher(experts.ep_mesh, module.num_experts, chunks=chunks, group=group))
    setattr(module, _EXPERTS_MESH_ATTR, experts.mesh)


def _whole_experts(local: DTensor, mesh) -> DTensor:
    """``local`` (this ep rank's experts, FSDP-sharded) as a shard of all experts on ``mesh``
    (its mesh's dims, then ep): FSDP's placements, with Shard(0) over ep applied first (a strided
    shard where FSDP also cuts dim 0, as FSDP2 does under tensor parallelism)."""
    ep = mesh["ep"].size()
    names = (*local.device_mesh.mesh_dim_names, "ep")
    placements = tuple(
        _StridedShard(0, split_factor=ep) if isinstance(p, Shard) and p.dim == 0 else p for p in local.placements
    )
    shape = (local.shape[0] * ep, *local.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local.to_local(), mesh[names], (*placements, Shard(0)), run_check=False, shape=shape, stride=stride)


def global_expert_state(model: nn.Module, state: dict) -> dict:
    """A flat model or optimizer state dict of ``model`` (``get_state_dict`` with
    ``flatten_optimizer_state_dict``) with every routed-expert entry as a shard of all experts
    (module docstring); other entries as they are. The entries share storage with ``state``'s,
    so DCP can load into them."""
    experts = {
        f"{name}.{pname}": getattr(module, _EXPERTS_MESH_ATTR)
        for name, module in model.named_modules()
        if hasattr(module, _EXPERTS_MESH_ATTR)
        for pname, _ in module.named_parameters(recurse=False)
    }
    if not experts:
        return state

    def owner(key: str):
        fqn = key.removeprefix("state.").rsplit(".", 1)[0] if key.startswith("state.") else key
        return experts.get(fqn)

    return {
        k: _whole_experts(v, owner(k)) if isinstance(v, DTensor) and owner(k) is not None else v
        for k, v in state.items()
    }


def _expert_mesh(experts):
    """The mesh FSDP2 shards routed experts over: edp, with dp_replicate in front for HSDP."""
    if experts.edp > 1:
        names = (DP_REPLICATE, "edp") if experts.replicate_mesh is not None else ("edp",)
    elif experts.replicate_mesh is None:
        raise ValueError("the FSDP2 baseline needs edp > 1 or a dp_replicate dim for the experts")
    else:
        # FSDP2 applies gradient_divide_factor twice when its shard group has one rank (once
        # in place of the reduce-scatter, once after it), so with edp == 1 the experts are
        # sharded over dp_replicate instead: the same sum over the same ranks
        names = (DP_REPLICATE,)
    return experts.mesh[names] if len(names) > 1 else experts.mesh[names[0]]


def _sum_then_divide(unit, dp_degree: int) -> None:
    unit.set_gradient_divide_factor(float(dp_degree))
    if hasattr(unit, "set_force_sum_reduction_for_comms"):
        unit.set_force_sum_reduction_for_comms(True)


def fsdp2(
    model: nn.Module,
    mesh,
    *,
    ep: int = 1,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
    experts_in_blocks: bool | None = None,
    ep_chunks: int | None = None,
) -> nn.Module:
    """Apply FSDP2 to ``model`` (each block of :func:`simplefsdp.blocks.block_list`, then the
    root); returns ``model``.

    ``ep_chunks``: token chunks per MoE layer, as for ``simple_fsdp`` (default 2 with ``ep > 1``).

    ``experts_in_blocks``: shard routed experts inside their block's unit (needs torch's
    ``ShardPlacementResult``) or as units of their own; None: in blocks where torch can.
    """
    if experts_in_blocks is None:
        experts_in_blocks = ShardPlacementResult is not None
    if experts_in_blocks and ShardPlacementResult is None:
        raise ValueError("experts_in_blocks=True needs torch's FSDP2 ShardPlacementResult (torch >= 2.13)")
    layout = resolve_layout(mesh, None, ep)
    kwargs = dict(mp_policy=mp_policy or MixedPrecisionPolicy(), reshard_after_forward=reshard_after_forward)
    experts = layout.experts
    placements = {}  # routed-expert parameter -> its Shard placement on the expert mesh (in-block form)
    if experts is not None:
        expert_mesh = _expert_mesh(experts)
        tokens = token_group(experts.ep_mesh, layout.ep_rank_groups())
        for module in model.modules():
            if not is_routed_experts(module):
                continue
            _keep_local_experts(module, experts, ep_chunks or DEFAULT_EP_CHUNKS, tokens)
            placement = Shard(experts.fsdp_dim(module.num_experts))
            if experts_in_blocks:
                placements.update({p: placement for p in module.parameters()})
            else:
                fully_shard(module, mesh=expert_mesh, shard_placement_fn=lambda p, s=placement: s, **kwargs)
                _sum_then_divide(module, layout.dp_degree)
    if placements:
        info = (
            HSDPMeshInfo(expert_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
            if expert_mesh.ndim == 2
            else FSDPMeshInfo(expert_mesh, shard_mesh_dim=0)
        )
        place = lambda p: ShardPlacementResult(placements[p], info) if p in placements else None
    for block in block_list(model):
        if placements and any(p in placements for p in block.parameters()):
            fully_shard(block, mesh=layout.dp_mesh, shard_placement_fn=place, **kwargs)
            _sum_then_divide(block, layout.dp_degree)
        else:
            fully_shard(block, mesh=layout.dp_mesh, **kwargs)
    fully_shard(model, mesh=layout.dp_mesh, **kwargs)
    return model
