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


CAUSAL_SDPA = "simplefsdp_causal_sdpa"


def _causal_sdpa_mask(*, attention_mask=None, mask_function=None, q_length: int, kv_length: int, q_offset=0,
                      kv_offset=0, local_size=None, allow_is_causal_skip: bool = True, **kwargs):
    """HF's ``sdpa`` mask, but no mask at all for plain causal attention without padding.

    HF's own ``sdpa`` leaves such a mask to SDPA's ``is_causal`` only outside tracing: under
    torch.compile of the whole model it materializes the mask, and SDPA then cannot use its
    flash kernels (on the H200, a 2.2B Qwen3-MoE's attention took 29 ms a step instead of 10).
    Sliding-window, chunked and padded masks are made as HF makes them. So is the mask of a model
    without a KV cache (``use_cache=False``, as activation checkpointing sets it): HF then checks
    ``position_ids`` for packed sequences, which it cannot do under tracing, so the mask it asks
    for is causal and packed, not plain causal.
    """
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    if (allow_is_causal_skip and attention_mask is None and mask_function is causal_mask_function
            and local_size is None and q_offset == 0 and kv_offset == 0 and q_length == kv_length):
        return None
    return sdpa_mask(attention_mask=attention_mask, mask_function=mask_function, q_length=q_length,
                     kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset, local_size=local_size,
                     allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def _register_causal_sdpa() -> None:
    """Add :data:`CAUSAL_SDPA` to transformers' attention and mask registries (adds a name, changes no other)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    AttentionInterface.register(CAUSAL_SDPA, ALL_ATTENTION_FUNCTIONS["sdpa"])
    AttentionMaskInterface.register(CAUSAL_SDPA, _causal_sdpa_mask)


def hf_causal_lm(config, *, experts_implementation: str | None = None, attn_implementation: str | None = None) -> nn.Module:
    """``AutoModelForCausalLM`` from ``config`` with random weights (the global torch seed).

    ``attn_implementation``: transformers' own names, or :data:`CAUSAL_SDPA` (HF's SDPA attention
    with causal masks left to SDPA's ``is_causal`` under torch.compile too, see
    :func:`_causal_sdpa_mask`); None: transformers' default.
    """
    from transformers import AutoModelForCausalLM

    kwargs = hf_model_kwargs(experts_implementation=experts_implementation, attn_implementation=attn_implementation)
    return AutoModelForCausalLM.from_config(config, **kwargs)


def hf_model_kwargs(*, experts_implementation: str | None, attn_implementation: str | None) -> dict:
    """transformers' keyword arguments for these implementations (None: its default), with
    :data:`CAUSAL_SDPA` registered when asked for."""
    if attn_implementation == CAUSAL_SDPA:
        _register_causal_sdpa()
    kwargs = {"experts_implementation": experts_implementation, "attn_implementation": attn_implementation}
    return {k: v for k, v in kwargs.items() if v is not None}


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
