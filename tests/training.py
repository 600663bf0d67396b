"""Shared training loops for the parity tests: the same model, data and optimizer everywhere.

The single-process reference trains on the whole global batch; a data-parallel run trains each
rank on its slice of it and reports the global loss (the average of the rank losses, which equals
the reference's mean when slices are equal).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from simplefsdp.models.llama import Transformer, TransformerConfig, cross_entropy_loss

# vocab 97 and ffn 90 do not divide by 4 ranks: every parity run also covers uneven shards
CFG = TransformerConfig(vocab_size=97, dim=48, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=90)
GLOBAL_BATCH, SEQ_LEN, STEPS, LR, SEED = 8, 16, 10, 1e-2, 0


def build_model(cfg: TransformerConfig = CFG, device="cpu") -> Transformer:
    torch.manual_seed(SEED)
    with torch.device(device):
        return Transformer(cfg)


def batches(cfg: TransformerConfig = CFG, steps: int = STEPS):
    """Deterministic (tokens, labels) global batches of a repeating pattern with noise."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(steps):
        start = torch.randint(0, cfg.vocab_size, (GLOBAL_BATCH, 1), generator=g)
        seq = (start + 3 * torch.arange(SEQ_LEN + 1)) % cfg.vocab_size
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def train(model, data, *, dp_rank: int = 0, dp_size: int = 1, steps: int = STEPS) -> list[float]:
    """AdamW for ``steps`` steps on rank ``dp_rank``'s slice of each global batch; global losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    rows = GLOBAL_BATCH // dp_size
    losses = []
    for tokens, labels in data[:steps]:
        sl = slice(dp_rank * rows, (dp_rank + 1) * rows)
        loss = cross_entropy_loss(model(tokens[sl]), labels[sl])
        loss.backward()
        opt.step()
        opt.zero_grad()
        reported = loss.detach().clone()
        if dist.is_initialized() and dp_size > 1:
            dist.all_reduce(reported, op=dist.ReduceOp.AVG)
        losses.append(reported.item())
    return losses


def full_state(model) -> dict[str, torch.Tensor]:
    """Every parameter as a full plain tensor (gathers DTensors), keyed by state_dict name."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)
