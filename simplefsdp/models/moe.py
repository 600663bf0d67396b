"""A DeepSeek-V3-style mixture-of-experts transformer.

The first ``n_dense_layers`` blocks use a dense SwiGLU MLP; the rest use :class:`MoE`:

* :class:`Router`: sigmoid (or softmax) scores per expert; the top-k experts of a token are
  chosen on ``score + expert_bias`` (the load-balancing bias is used for selection only) and the
  chosen scores, normalized, weight the expert outputs.
* :class:`GroupedExperts`: the routed experts, stored stacked (``w1, w3: [E, dim, hidden]``,
  ``w2: [E, hidden, dim]``) and computed with one grouped matmul per projection over tokens
  sorted by expert (each expert's rows padded to an aligned count where ``torch._grouped_mm``
  runs, :mod:`simplefsdp.moe.token_permute`: at ep 1 as the rows are gathered, under ep after
  they arrive). With expert parallelism they exchange tokens with
  all-to-all (:mod:`simplefsdp.moe.token_dispatch`), in token chunks: the layer splits its
  tokens into the dispatcher's ``chunks`` and sorts each chunk by expert, so one chunk's experts
  can run while another chunk's tokens travel. Each token's result does not depend on the
  chunking; the expert weights' gradients are summed per chunk, then over chunks.
* shared experts: the same SwiGLU as dense matmuls, on every token, replicated across
  expert-parallel ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from simplefsdp.moe.token_dispatch import TokenDispatcher, by_expert
from simplefsdp.moe.grouped_mm import grouped_mm, native_available, native_rows
from simplefsdp.models.llama import FeedForward, Transformer, TransformerConfig
from simplefsdp.moe.token_permute import ALIGNMENT, aligned_groups


@dataclass(frozen=True)
class MoEConfig(TransformerConfig):
    n_dense_layers: int = 1
    num_experts: int = 8
    top_k: int = 2
    expert_dim: int = 32
    num_shared_experts: int = 1
    score_func: str = "sigmoid"
    route_scale: float = 1.0


def _init_stacked(*weights: torch.Tensor) -> None:
    for w in weights:  # [..., fan_in, fan_out]
        nn.init.trunc_normal_(w, std=w.shape[-2] ** -0.5)


def grouped_swiglu(x, w1, w2, w3, counts: torch.Tensor) -> torch.Tensor:
    """SwiGLU of each group of rows with its own weights; ``counts[g]`` rows are group g."""
    offs = torch.cumsum(counts, 0).to(torch.int32)  # Inductor widens an int32 cumsum to int64
    return grouped_mm(F.silu(grouped_mm(x, w1, offs)) * grouped_mm(x, w3, offs), w2, offs)


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, score_func: str, route_scale: float):
        super().__init__()
        if score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"score_func must be 'sigmoid' or 'softmax'; got {score_func!r}")
        self.num_experts, self.top_k = num_experts, top_k
        self.score_func, self.route_scale = score_func, route_scale
        self.gate = nn.Linear(dim, num_experts, bias=False)
        # load-balancing bias: shifts which experts are chosen, never the weights
        self.register_buffer("expert_bias", torch.zeros(num_experts), persistent=True)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.expert_bias)

    def forward(self, x: torch.Tensor):
        """x: [tokens, dim] -> (weights [tokens, k], experts [tokens, k])."""
        scores = self.gate(x).float()
        scores = scores.sigmoid() if self.score_func == "sigmoid" else scores.softmax(-1)
        experts = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if self.score_func == "sigmoid":
            weights = weights / weights.sum(-1, keepdim=True)
        return weights * self.route_scale, experts


class GroupedExperts(nn.Module):
    """Routed SwiGLU experts over chunks of rows, each sorted by expert (``counts[c][e]`` rows
    of chunk c go to expert e).

    ``simple_fsdp(..., ep=E)`` shards the expert dim over the ``ep`` ranks and sets
    ``expert_parallel``, which moves each token to the rank holding its expert and back and says
    how many chunks the layer's tokens come in (``chunks``).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.expert_parallel: TokenDispatcher | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_stacked(self.w1, self.w3, self.w2)

    @property
    def chunks(self) -> int:
        return 1 if self.expert_parallel is None else self.expert_parallel.chunks

    def row_alignment(self, x: torch.Tensor) -> int:
        """What the rows that ``forward`` gets must have each expert's count padded to: at ep 1,
        where ``torch._grouped_mm`` runs, its kernels' alignment (``by_expert`` pads the rows as
        it gathers them); under ep, 1 (rows travel unpadded, and each rank pads what it receives)."""
        return ALIGNMENT if self.expert_parallel is None and native_rows(x) else 1

    def forward(self, xs: list[torch.Tensor], counts: list[torch.Tensor]) -> list[torch.Tensor]:
        w1, w2, w3 = self.w1, self.w2, self.w3  # each read gathers: once for every chunk
        swiglu = lambda rows, group_counts: grouped_swiglu(rows, w1, w2, w3, group_counts)
        if self.expert_parallel is None:  # padded already where it pays (row_alignment)
            return [swiglu(x, c) for x, c in zip(xs, counts)]

        def local_experts(rows: torch.Tensor, group_counts: torch.Tensor) -> torch.Tensor:
            if native_available(rows, w1):  # grouped_mm kernels want groups on aligned rows
                return aligned_groups(swiglu, rows, group_counts)
            return swiglu(rows, group_counts)

        return self.expert_parallel(local_experts, xs, counts)


class SharedExperts(nn.Module):
    """The always-on experts fused into one SwiGLU on every token, as dense matmuls.

    The weights are stored as the routed experts' are (``w1, w3: [dim, hidden]``, ``w2: [hidden,
    dim]``), without their group dim: FSDP shards dim 0, and a group dim of size 1 would be
    padded to the shard degree, gathering and reducing that many times the bytes. Dense matmuls
    run them faster than a one-group grouped matmul does (``benchmarks/moe_kernels.py``).
    """

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(dim, hidden))
        self.w3 = nn.Parameter(torch.empty(dim, hidden))
        self.w2 = nn.Parameter(torch.empty(hidden, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _init_stacked(self.w1, self.w3, self.w2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (F.silu(x @ self.w1) * (x @ self.w3)) @ self.w2


class MoE(nn.Module):
    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = Router(cfg.dim, cfg.num_experts, cfg.top_k, cfg.score_func, cfg.route_scale)
        self.experts = GroupedExperts(cfg.dim, cfg.expert_dim, cfg.num_experts)
        self.shared_experts = (
            SharedExperts(cfg.dim, cfg.expert_dim * cfg.num_shared_experts) if cfg.num_shared_experts else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.router(x)
        routed = by_expert(self.experts, x, experts, self.experts.num_experts, self.experts.chunks,
                           self.experts.row_alignment(x))
        out = (routed.view(-1, self.top_k, shape[-1]) * weights.unsqueeze(-1).to(x.dtype)).sum(1).view(shape)
        if self.shared_experts is not None:
            # added in the input's shape: Inductor fuses a 2-D add into the shared experts' last
            # matmul (an addmm on CPU), which then waits for the combined rows, so the all-to-all
            # overlap could no longer run that matmul under the combine
            out = out + self.shared_experts(x).view(shape)
        return out


def _moe_or_dense_mlp(cfg: MoEConfig, layer_id: int) -> nn.Module:
    return FeedForward(cfg.dim, cfg.ffn_dim) if layer_id < cfg.n_dense_layers else MoE(cfg)


def moe_transformer(cfg: MoEConfig) -> Transformer:
    """Dense blocks first, then MoE blocks."""
    return Transformer(cfg, _moe_or_dense_mlp)


# Named sizes: ``debug`` fits 4 CPU ranks; ``gpu`` (about 1.6B parameters) one H200 in bf16
MOE_CONFIGS = {
    "debug": MoEConfig(vocab_size=256, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=160,
                       n_dense_layers=1, num_experts=8, top_k=2, expert_dim=32),
    "gpu": MoEConfig(vocab_size=32000, dim=2048, n_layers=10, n_heads=16, n_kv_heads=16, ffn_dim=5632,
                     n_dense_layers=1, num_experts=16, top_k=2, expert_dim=1408),
}
