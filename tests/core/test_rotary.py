"""Rotary tables: buffers computed once, never recomputed in the compiled graph."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

from simplefsdp import simple_fsdp
from simplefsdp.models.llama import Transformer, TransformerConfig, rotary_tables
from simplefsdp.train.config import JobConfig

CFG = TransformerConfig(n_layers=2, max_seq_len=16)


def test_compiled_forward_reads_the_tables_and_computes_no_cos_or_sin():
    """Computed in forward, the tables were part of the graph, and Inductor recomputed cos and sin
    in every layer's rotary kernels; as buffers they are graph inputs."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    model = Transformer(CFG)
    torch.compile(model, backend=backend, fullgraph=True)(torch.randint(0, 256, (2, 8)))
    calls = [n.target for gm in graphs for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert not {"cos", "sin", torch.cos, torch.sin} & set(calls)


def test_meta_built_model_gets_its_tables_when_wrapped(fake_world):
    with torch.device("meta"):
        model = Transformer(CFG)
    model = simple_fsdp(model, init_device_mesh("cpu", (8,), mesh_dim_names=("dp_shard",)))
    cos, sin = rotary_tables(16, CFG.head_dim, CFG.rope_theta)
    assert torch.equal(model.rotary.cos, cos) and torch.equal(model.rotary.sin, sin)
    assert "rotary.cos" not in model.state_dict()  # not saved: checkpoints do not depend on max_seq_len


def test_sequence_longer_than_the_tables_is_refused():
    with pytest.raises(ValueError, match="sequence length 17 exceeds the model's max_seq_len 16"):
        Transformer(CFG)(torch.randint(0, 256, (1, 17)))


def test_training_config_sizes_the_tables_by_seq_len():
    cfg = JobConfig()
    cfg.model = {"kind": "dense"}
    cfg.training.seq_len = 96
    assert cfg.model_config().max_seq_len == 96
    cfg.model["max_seq_len"] = 128
    assert cfg.model_config().max_seq_len == 128
