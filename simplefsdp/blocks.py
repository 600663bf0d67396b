"""A model's transformer blocks: what activation checkpointing, the FSDP2 baseline's units and
per-block compilation act on.

The blocks are the entries of the model's block list: ``model.layers`` (this project's models),
``model.model.layers`` (Hugging Face's ``*ForCausalLM``), or otherwise the first ``nn.ModuleList``
(in ``named_modules`` order) whose entries all share one class. A dotted path names the list
explicitly instead. The Inductor passes find the same blocks by module path: the path up to the
first list index (:func:`simplefsdp.passes.fx_utils.block_of`).
"""

from __future__ import annotations

import torch.nn as nn


def block_list(model: nn.Module, path: str | None = None) -> nn.ModuleList:
    """``model``'s list of blocks (see the module docstring); ValueError if it has none."""
    if path is not None:
        blocks = model.get_submodule(path) if path else model
        if not isinstance(blocks, nn.ModuleList):
            raise ValueError(f"blocks path {path!r} names a {type(blocks).__name__}, not an nn.ModuleList")
        return blocks
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and len({type(m) for m in module}) == 1:
            return module
    raise ValueError(f"{type(model).__name__} has no nn.ModuleList of blocks (entries of one class); name one by its path")
