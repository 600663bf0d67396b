"""``torch.save(model)`` of a wrapped model, and ``torch.load`` of it in the same ranks.

Wrapping leaves nothing that pickle cannot store: the root's hooks are methods of a module-level
class, generated classes pickle as the call that makes them (:mod:`simplefsdp.generated_classes`)
and the token dispatcher keeps its process group by name. On 2 gloo ranks a dense model and a MoE
model at FSDP2 x EP2 are saved and loaded; the loaded copy's forward equals the original's, bit
for bit, and so do its shards. (A Hugging Face MoE model with ep pickles too, checked at fake
world 8, where no data moves.)
"""

from __future__ import annotations

import io

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import simple_fsdp
from tests import training as T
from tests.moe.test_moe import MOE


def _round_trip(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _body():
    out = {}
    tokens = T.batches()[0][0][:2]
    for name, cfg, ep in (("dense", T.CFG, 1), ("moe_ep2", MOE, 2)):
        model = simple_fsdp(T.build_model(cfg), init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",)), ep=ep)
        copy = _round_trip(model)
        with torch.no_grad():
            same_output = torch.equal(copy(tokens), model(tokens))
        same_shards = all(
            torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), copy.parameters(), strict=True)
        )
        out[name] = same_output, same_shards, type(copy.layers[1].attention.wq) is type(model.layers[1].attention.wq)
    return out


@pytest.mark.ranks
def test_a_wrapped_model_saved_and_loaded_computes_the_same():
    assert T.launch_once(_body, 2) == {"dense": (True, True, True), "moe_ep2": (True, True, True)}


def test_a_wrapped_hugging_face_moe_model_pickles(fake_world):
    import pytest

    pytest.importorskip("transformers")
    from tests.moe.test_hf_weights import _model

    model = simple_fsdp(_model("qwen3_moe", seed=0), init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)), ep=2)
    experts = _round_trip(model).model.layers[0].mlp.experts
    assert type(experts) is type(model.model.layers[0].mlp.experts)
    assert experts.expert_parallel.group is model.model.layers[0].mlp.experts.expert_parallel.group
