"""The FSDP2 baseline: the same model under ``torch.distributed.fsdp.fully_shard``.

Used by the parity tests and the benchmarks to compare SimpleFSDP with FSDP2 on the same model,
data and mesh. Each transformer block and the root are ``fully_shard`` units. With ``ep > 1`` the
routed experts keep only their ep rank's slice of the expert dim, use the same
:class:`~simplefsdp.moe.token_dispatch.TokenDispatcher` dispatch, and are a ``fully_shard`` unit of
their own on the edp mesh (a separate unit works on torch 2.11, which lacks per-parameter meshes).
Their gradients are summed and divided by the whole dp degree, like SimpleFSDP's experts.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from simplefsdp.moe.token_dispatch import TokenDispatcher, is_routed_experts
from simplefsdp.mesh_layout import DP_REPLICATE, resolve_layout
from simplefsdp.sharding import local_experts


def _keep_local_experts(module: nn.Module, ep_mesh) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        module._parameters[name] = nn.Parameter(local_experts(param, ep_mesh), requires_grad=param.requires_grad)
    module.expert_parallel = TokenDispatcher(ep_mesh, module.num_experts)


def fsdp2(
    model: nn.Module,
    mesh,
    *,
    ep: int = 1,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Apply FSDP2 to ``model`` (blocks in ``model.layers``, then the root); returns ``model``."""
    layout = resolve_layout(mesh, None, ep)
    kwargs = dict(mp_policy=mp_policy or MixedPrecisionPolicy(), reshard_after_forward=reshard_after_forward)
    experts = layout.experts
    if experts is not None:
        if experts.edp > 1:
            names = (DP_REPLICATE, "edp") if experts.replicate_mesh is not None else ("edp",)
        elif experts.replicate_mesh is None:
            raise ValueError("the FSDP2 baseline needs edp > 1 or a dp_replicate dim for the experts")
        else:
            # FSDP2 applies gradient_divide_factor twice when its shard group has one rank (once
            # in place of the reduce-scatter, once after it), so with edp == 1 the experts are
            # sharded over dp_replicate instead: the same sum over the same ranks
            names = (DP_REPLICATE,)
        expert_mesh = experts.mesh[names] if len(names) > 1 else experts.mesh[names[0]]
        for module in model.modules():
            if not is_routed_experts(module):
                continue
            _keep_local_experts(module, experts.ep_mesh)
            dim = experts.fsdp_dim(module.num_experts)
            fully_shard(module, mesh=expert_mesh, shard_placement_fn=lambda p, d=dim: Shard(d), **kwargs)
            module.set_gradient_divide_factor(float(layout.dp_degree))
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)
    for block in model.layers:
        fully_shard(block, mesh=layout.dp_mesh, **kwargs)
    fully_shard(model, mesh=layout.dp_mesh, **kwargs)
    return model
