"""The Hugging Face baseline: transformers' own distributed path for an HF MoE model.

``from_pretrained(directory, distributed_config=DistributedConfig(tp_size=world,
enable_expert_parallel=True))``. In transformers 5.17 expert parallelism is a tensor-parallel plan
over all ranks (the model's ``base_model_ep_plan``): every rank runs the whole batch, the router's
outputs are cut to the rank's experts (the others get a sentinel id and weight zero), each rank
holds its experts as ``Shard(0)`` DTensors, and the experts' outputs are all-reduced. There is no
all-to-all and no data parallelism, and it does not compose with FSDP (``DistributedConfig``
applies one of tp, fsdp and pp). Every other parameter is replicated and sees the same batch on
every rank, so its gradient needs no reduction. At one rank it is the plain model.

Only HF's ``grouped_mm`` experts train correctly under it (transformers 5.17, 2 gloo ranks against
one process): with ``batched_mm`` the first step's gradients are off by up to 2.5e-4 (the forward
is right), and ``eager`` fails on the sentinel expert ids ("Class values must be smaller than
num_classes").

It loads through ``from_pretrained``, so it needs a ``save_pretrained`` directory (and the
``accelerate`` package, which transformers asks for with a ``tp_plan``).
"""

from __future__ import annotations

import torch.nn as nn

from simplefsdp.models.hf import hf_model_kwargs


def hf_expert_parallel(directory: str, world: int, *, experts_implementation: str | None = None,
                       attn_implementation: str | None = None) -> nn.Module:
    """The model in ``directory`` under transformers' expert parallelism over ``world`` ranks."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    distributed = DistributedConfig(tp_size=world, enable_expert_parallel=True) if world > 1 else None
    return AutoModelForCausalLM.from_pretrained(
        directory, distributed_config=distributed,
        **hf_model_kwargs(experts_implementation=experts_implementation, attn_implementation=attn_implementation),
    )
