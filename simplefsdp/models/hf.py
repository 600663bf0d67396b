"""Hugging Face transformers causal LMs as training models, built from a config without the hub.

:func:`hf_causal_lm` builds ``AutoModelForCausalLM.from_config`` from a transformers
``model_type`` and config fields (or a local ``config.json``), optionally with an
``experts_implementation``. The model is unmodified: ``simple_fsdp`` wraps it as it is, finding
its routed experts by transformers' experts contract (:mod:`simplefsdp.moe.hf_experts`). The
training step reads ``.logits`` from its output.

transformers is imported only here, when an HF model is asked for.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def hf_config(model_type: str | None = None, config_path: str | None = None, **fields):
    """A transformers config from ``model_type`` and ``fields``, or from a local ``config.json`` (fields override)."""
    from transformers import AutoConfig

    if (model_type is None) == (config_path is None):
        raise ValueError("give exactly one of model_type and config_path")
    if config_path is not None:
        config = AutoConfig.from_pretrained(config_path)
        for key, value in fields.items():
            setattr(config, key, value)
        return config
    return AutoConfig.for_model(model_type, **fields)


def hf_causal_lm(config, *, experts_implementation: str | None = None) -> nn.Module:
    """``AutoModelForCausalLM`` from ``config`` with random weights (the global torch seed)."""
    from transformers import AutoModelForCausalLM

    kwargs = {} if experts_implementation is None else {"experts_implementation": experts_implementation}
    return AutoModelForCausalLM.from_config(config, **kwargs)


def hf_flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token of ``config``'s model, counted as for this project's models
    (:func:`simplefsdp.train.metrics.flops_per_token`): 6 per active matmul weight (every weight
    of two or more dims outside embeddings; of the routed experts, ``num_experts_per_tok`` of
    them), plus 12 * layers * hidden * seq_len for attention. Counted on a meta-device model."""
    from simplefsdp.moe.hf_experts import is_hf_experts

    with torch.device("meta"):
        model = hf_causal_lm(config)
    weights = 0.0
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            continue
        share = config.num_experts_per_tok / module.num_experts if is_hf_experts(module) else 1.0
        weights += share * sum(p.numel() for p in module.parameters(recurse=False) if p.ndim >= 2)
    return 6 * weights + 12 * config.num_hidden_layers * config.hidden_size * seq_len
