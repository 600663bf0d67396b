"""Which modules are routed experts, and how one gets its token dispatcher.

Two contracts are recognised:

* this project's (:class:`simplefsdp.models.moe.GroupedExperts`): a module with ``num_experts``
  and an ``expert_parallel`` slot, which its forward hands its sorted rows to;
* Hugging Face transformers 5.x's (:mod:`simplefsdp.moe.hf_experts`): the dispatcher is set and
  the module's class is swapped for one whose forward routes through it.

Either way the module's parameters stack the experts in dim 0.
"""

from __future__ import annotations

import torch.nn as nn

from simplefsdp.moe.hf_experts import is_hf_experts, make_expert_parallel
from simplefsdp.moe.token_dispatch import TokenDispatcher


def is_routed_experts(module: nn.Module) -> bool:
    return (hasattr(module, "num_experts") and hasattr(module, "expert_parallel")) or is_hf_experts(module)


def unrecognised_experts(model: nn.Module) -> list[str]:
    """``"path (Class)"`` of modules whose class name ends in ``Experts`` but that neither contract
    covers (transformers' Llama4, DBRX, JetMoE, Switch Transformers, ... experts)."""
    return [
        f"{name} ({type(m).__name__})"
        for name, m in model.named_modules()
        if type(m).__name__.endswith("Experts") and not is_routed_experts(m)
    ]


def set_dispatcher(module: nn.Module, dispatcher: TokenDispatcher | None) -> None:
    """Make ``module`` (routed experts) exchange its tokens through ``dispatcher``; None (ep 1):
    keep them on this rank (Hugging Face experts then run HF's ``grouped_mm`` without its sort)."""
    if is_hf_experts(module):
        make_expert_parallel(module, dispatcher)
    else:
        module.expert_parallel = dispatcher
