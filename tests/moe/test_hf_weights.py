"""Hugging Face ``save_pretrained`` directories into and out of wrapped models
(:mod:`simplefsdp.models.hf_weights`).

On 4 gloo ranks at FSDP4 x EP2, each family's tiny model (``tests.moe.hf_families``, 8 experts,
a vocabulary of 97 that 4 ranks split unevenly) is built with other random values, wrapped, and
loaded from a directory HF's own ``save_pretrained`` wrote: every tensor then equals the saved
model's, bit for bit, and each rank has read exactly as many elements as its shards hold. Saved
back, the directory has the keys HF's own save wrote, and ``from_pretrained`` reads the same values.

The families cover the key forms: per-expert ``gate_proj`` / ``up_proj`` stacked and concatenated
(Qwen3-MoE), renamed first (Mixtral's ``block_sparse_moe.experts.N.w1``), with persistent buffers
and a dense first layer (DeepSeek-V3), and experts stored fused with biases (gpt-oss). An FSDP2
model (another wrapper's DTensors) loads too.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

pytest.importorskip("transformers")

from simplefsdp import simple_fsdp
from simplefsdp.baselines.fsdp2 import fsdp2
from simplefsdp.models.hf import hf_causal_lm, hf_config
from simplefsdp.models.hf_weights import load_hf_weights, save_hf_weights
from tests import training as T
from tests.moe.hf_families import FAMILIES

# family/how: built on the meta device (simple_fsdp allocates, initializes with HF's own
# _init_weights and shards one module at a time), wrapped by FSDP2 instead, with tied
# embeddings (HF saves one of the two names), or compiled before it loads and saves (the
# README's order: the keys must not gain torch.compile's "_orig_mod." prefix)
LOADED = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "qwen3_moe/meta", "qwen3_moe/fsdp2", "qwen3_moe/tied",
          "qwen3_moe/compiled")
TOKENS = torch.arange(2 * 16).reshape(2, 16) % 97


def _model(family: str, seed: int, device: str = "cpu", **fields):
    family, _, how = family.partition("/")
    fields = dict(fields, tie_word_embeddings=True) if how == "tied" else fields
    torch.manual_seed(seed)
    with torch.device(device):
        return hf_causal_lm(hf_config(family, **{**FAMILIES[family], **fields}))


def _local_elements(model) -> int:
    """Elements this rank holds: parameter shards and persistent buffers."""
    params = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    buffers = sum(b.numel() for n, b in model.named_buffers() if n in model.state_dict())
    return params + buffers


def _body(root: str):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    out = {}
    for run in LOADED:
        how = run.partition("/")[2]
        model = _model(run, seed=1, device="meta" if how == "meta" else "cpu")  # other values than the saved model's
        model = fsdp2(model, mesh) if how == "fsdp2" else simple_fsdp(model, mesh, ep=2)
        if how == "compiled":
            model = torch.compile(model)  # never run: saving needs no compiled forward
        loaded = load_hf_weights(model, os.path.join(root, _saved_as(run)))
        reads = [None] * dist.get_world_size()
        dist.all_gather_object(reads, (loaded.elements_read, _local_elements(model)))
        state = T.full_state(model)
        with torch.no_grad():
            # every rank the same tokens: non-persistent buffers count too
            logits = getattr(model, "_orig_mod", model)(TOKENS).logits
        save_hf_weights(model, os.path.join(root, "resaved", run.replace("/", "-")))
        out[run] = reads, state, logits
    return out


def _saved_as(run: str) -> str:
    """The directory of the model ``run`` loads: its family's, or its own for a tied model."""
    return run.replace("/", "-") if run.endswith("/tied") else run.partition("/")[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_weights")
    for run in LOADED:
        if not (root / _saved_as(run)).exists():
            _model(run if run.endswith("/tied") else run.partition("/")[0], seed=0).save_pretrained(root / _saved_as(run))
    return root


def _checkpoint_keys(directory) -> set[str]:
    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(directory / "model.safetensors", "pt") as f:
        return set(f.keys())


@pytest.mark.ranks
@pytest.mark.parametrize("run", LOADED)
def test_load_reads_each_ranks_slices_and_save_round_trips(run, saved):
    from transformers import AutoModelForCausalLM

    reads, state, logits = T.launch_once(_body, 4, str(saved))[run]
    model = _model(run, seed=0)
    reference = model.state_dict()
    assert state.keys() == reference.keys()
    assert all(torch.equal(state[k], reference[k]) for k in reference), [k for k in reference if not torch.equal(state[k], reference[k])]
    print(f"{run}: elements read by rank (shard elements): {reads}, checkpoint {sum(v.numel() for v in reference.values())}")
    assert all(read == local for read, local in reads)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(TOKENS).logits, rtol=0, atol=1e-5)

    resaved = saved / "resaved" / run.replace("/", "-")
    assert _checkpoint_keys(resaved) == _checkpoint_keys(saved / _saved_as(run))
    back = AutoModelForCausalLM.from_pretrained(resaved).state_dict()
    assert all(torch.equal(back[k], reference[k]) for k in reference)


def _shards(model) -> dict[str, torch.Tensor]:
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(moe_intermediate_size=24), r"model\.layers\.0\.mlp\.experts\.down_proj: the checkpoint's is \(8, 32, 16\), the model's \(8, 32, 24\)"),
        (dict(num_hidden_layers=3), r"11 model keys are not in the checkpoint: model\.layers\.2\."),
        (dict(num_hidden_layers=1), r"checkpoint keys match no key of the model \(Qwen3MoeForCausalLM\): model\.layers\.1\."),
    ],
    ids=["shape", "missing", "unexpected"],
)
def test_a_checkpoint_that_does_not_fit_is_named_and_nothing_is_loaded(fields, message, saved, fake_world):
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    model = simple_fsdp(_model("qwen3_moe", seed=1, **fields), mesh, ep=2)
    before = _shards(model)
    with pytest.raises(ValueError, match=message):
        load_hf_weights(model, saved / "qwen3_moe")
    after = _shards(model)
    assert all(torch.equal(after[n], before[n]) for n in before)


def test_a_directory_without_safetensors_is_named(tmp_path, fake_world):
    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",))
    model = simple_fsdp(_model("qwen3_moe", seed=1), mesh, ep=2)
    with pytest.raises(ValueError, match="no model.safetensors or model.safetensors.index.json"):
        load_hf_weights(model, tmp_path)


def test_sliced_reads_equal_transformers_conversion_for_any_box(tmp_path):
    """A rank's box of stacked (and concatenated) experts, read slice by slice, equals that box of
    what transformers' own converter makes of the whole tensors, whatever the box, and in the
    converter's concatenation order, here up before gate, not the keys' sorted order."""
    from safetensors.torch import save_file
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    from simplefsdp.models.hf_weights import _convert, _Headers, _read, _Target

    torch.manual_seed(0)
    experts, rows, cols = 4, 3, 5
    tensors = {f"mlp.experts.{e}.{name}_proj.weight": torch.randn(rows, cols) for e in range(experts) for name in ("gate", "up")}
    save_file(tensors, tmp_path / "model.safetensors")
    headers = _Headers({key: str(tmp_path / "model.safetensors") for key in tensors})
    converter = WeightConverter(["mlp.experts.*.up_proj.weight", "mlp.experts.*.gate_proj.weight"], "mlp.experts.gate_up_proj",
                                operations=[MergeModulelist(dim=0), Concatenate(dim=1)])
    # as _group_by_target gives them: in the keys' sorted order (gate before up)
    sources = [(next(p for p in converter.source_patterns if key.split(".")[3] in p), key) for key in sorted(tensors)]
    model = type("Model", (), {"config": None})()
    whole = _convert(converter, "mlp.experts.gate_up_proj", sources, tensors, model)
    assert torch.equal(whole[0, :rows], tensors["mlp.experts.0.up_proj.weight"])
    for box in [(slice(0, 4), slice(0, 6), slice(0, 5)), (slice(1, 3), slice(2, 5), slice(0, 5)),
                (slice(3, 4), slice(4, 6), slice(1, 4)), (slice(2, 2), slice(0, 6), slice(0, 5))]:
        target = _Target("mlp.experts.gate_up_proj", None, whole.shape, box, sources, converter)
        assert torch.equal(_read(headers, target, model), whole[box]), box


def _sub_mesh_body(directory: str):
    """Ranks 0 and 1 hold and save a model on their own mesh; ranks 2 and 3 do other work."""
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh("cpu", [0, 1], mesh_dim_names=("dp_shard",))  # every rank builds it (its groups)
    if dist.get_rank() < 2:
        save_hf_weights(simple_fsdp(_model("qwen3_moe", seed=0), mesh), directory)
    dist.barrier()  # ranks 2 and 3 reach this without saving
    return dist.get_rank()


@pytest.mark.ranks
def test_a_model_on_a_sub_mesh_is_saved_by_its_own_ranks(tmp_path):
    from transformers import AutoModelForCausalLM

    assert T.launch_once(_sub_mesh_body, 4, str(tmp_path)) == 0
    reference = _model("qwen3_moe", seed=0).state_dict()
    back = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert back.keys() == reference.keys() and all(torch.equal(back[k], reference[k]) for k in reference)
    assert len(list(tmp_path.glob("model-*.safetensors"))) == 2  # each of the 2 ranks wrote its share
