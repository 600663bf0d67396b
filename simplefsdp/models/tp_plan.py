"""Tensor-parallel plan for the Llama-style blocks (attention and MLP), Megatron style.

q/k/v and the MLP's w1/w3 are column-parallel, attention's wo and the MLP's w2 row-parallel, so
each block needs one all-reduce after attention and one after the MLP. Embeddings, norms and the
output projection stay replicated over ``tp``. Apply it before ``simple_fsdp``.
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def apply_tensor_parallel(model: nn.Module, tp_mesh, src_data_rank: int | None = 0) -> nn.Module:
    """Shard every block's attention and dense MLP over ``tp_mesh`` (in place; returns ``model``).

    ``src_data_rank``: as in ``parallelize_module``, the tp rank whose weights are scattered;
    None when every rank already holds the same weights (each cuts its own slice, no collective).
    """
    for block in model.layers:
        attn = block.attention
        for heads in (attn.n_heads, attn.n_kv_heads):
            if heads % tp_mesh.size():
                raise ValueError(f"tp degree {tp_mesh.size()} does not divide the {heads} attention heads")
        parallelize_module(
            attn, tp_mesh,
            {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()},
            src_data_rank=src_data_rank,
        )
        if all(hasattr(block.feed_forward, w) for w in ("w1", "w2", "w3")) and not hasattr(block.feed_forward, "router"):
            parallelize_module(
                block.feed_forward, tp_mesh,
                {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()},
                src_data_rank=src_data_rank,
            )
    return model
