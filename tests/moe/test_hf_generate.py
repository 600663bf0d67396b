"""``generate()`` on a wrapped Hugging Face model whose ranks finish at different steps.

Every forward gathers parameters on every rank, so a rank whose sequences have ended must keep
stepping until every rank's have: transformers does so with ``synced_gpus``, which a wrapped
model's ``generate`` defaults to (:mod:`simplefsdp.hf_generate`). On 2 gloo ranks at FSDP2 x EP2
(one-token decode steps through the expert all-to-alls), rank 0 asks for 2 new tokens and rank 1
for 6; each rank's greedy output equals one process generating from the same weights. Dynamo
still compiles the wrapped model as a plain module (transformers' own FSDP mark would make it
refuse).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from simplefsdp.models.hf import hf_causal_lm, hf_config
from tests import training as T
from tests.moe.hf_families import FAMILIES

PROMPTS = torch.arange(2 * 2 * 5).reshape(2, 2, 5) % 90 + 3  # per rank: 2 prompts of 5 tokens, no eos
NEW_TOKENS = (2, 6)  # per rank: the rank that asks for fewer finishes first


def _model():
    torch.manual_seed(0)
    return hf_causal_lm(hf_config("qwen3_moe", **FAMILIES["qwen3_moe"]))


def _generate(model, rank: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(PROMPTS[rank], max_new_tokens=NEW_TOKENS[rank], do_sample=False, eos_token_id=None)


def _body():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from simplefsdp import simple_fsdp

    model = simple_fsdp(_model(), init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",)), ep=2)
    out = [None] * 2
    dist.all_gather_object(out, _generate(model, dist.get_rank()))
    return out


@pytest.mark.ranks
def test_generate_keeps_ranks_that_finish_early_in_step():
    outputs = T.launch_once(_body, 2)
    model = _model()
    for rank in range(2):
        assert outputs[rank].shape == (2, 5 + NEW_TOKENS[rank])
        assert torch.equal(outputs[rank], _generate(model, rank))


def test_a_wrapped_model_still_compiles_as_a_plain_module(fake_world):
    """The generate default is a class swap, not transformers' FSDP mark (``_is_fsdp_managed_module``),
    which Dynamo reads as FSDP1 and refuses to compile without ``use_orig_params``."""
    from torch.distributed.device_mesh import init_device_mesh

    from simplefsdp import simple_fsdp

    model = simple_fsdp(_model(), init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)))
    assert not getattr(model, "_is_fsdp_managed_module", False)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"  # what save_pretrained writes as the architecture
    torch._dynamo.reset()
    torch.compile(model, backend="eager", fullgraph=True)(PROMPTS[0])
