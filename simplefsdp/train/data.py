"""Training data: global batches of token sequences, a pure function of (seed, step).

Every rank builds the same global batch for a step and trains on its data-parallel slice of it, so
the global batch does not depend on the parallel layout (runs of different layouts compare step by
step), and a resumed run needs no data-loader state: batch ``s`` is rebuilt from ``s``.

* :class:`SyntheticTokens`: arithmetic sequences ``start, start + d, start + 2d, ... (mod vocab)``
  with random ``start`` and ``d`` in {1, 2, 3}. Only the first two tokens are uncertain, so a model
  that learns the rule reaches a loss far below uniform (``log(vocab)``).
* :class:`FileTokens`: windows at random offsets of a token file: ``.txt`` (UTF-8 bytes as tokens,
  needs ``vocab_size >= 256``), ``.bin`` (little-endian uint16, as nanoGPT writes) or ``.pt`` (a
  1-D integer tensor).

:func:`to_device` moves a rank's slice to its device without the host waiting: a GPU copy from
pageable memory returns only once the kernels queued before it (the last step's) have run.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

Batch = tuple[torch.Tensor, torch.Tensor]  # tokens, labels: [global_batch, seq_len] int64


def _generator(seed: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


class SyntheticTokens:
    def __init__(self, vocab_size: int, global_batch: int, seq_len: int, seed: int = 1234):
        self.vocab_size, self.global_batch, self.seq_len, self.seed = vocab_size, global_batch, seq_len, seed

    def batch(self, step: int) -> Batch:
        g = _generator(self.seed, step)
        start = torch.randint(0, self.vocab_size, (self.global_batch, 1), generator=g)
        stride = torch.randint(1, 4, (self.global_batch, 1), generator=g)
        seq = (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def read_tokens(path: str) -> torch.Tensor:
    """The token ids in ``path`` (.txt, .bin or .pt) as a 1-D int64 tensor."""
    ext = os.path.splitext(path)[1]
    if ext == ".txt":
        with open(path, "rb") as f:
            return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    if ext == ".bin":
        with open(path, "rb") as f:
            data = bytearray(f.read())
        if len(data) % 2:
            raise ValueError(f"{path}: a .bin token file holds uint16 tokens, but it has an odd byte count")
        return torch.frombuffer(data, dtype=torch.int16).long() & 0xFFFF
    if ext == ".pt":
        tokens = torch.load(path, weights_only=True)
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or tokens.is_floating_point():
            raise ValueError(f"{path}: a .pt token file must hold a 1-D integer tensor")
        return tokens.long()
    raise ValueError(f"{path}: token files are .txt, .bin or .pt")


class FileTokens:
    def __init__(self, path: str, vocab_size: int, global_batch: int, seq_len: int, seed: int = 1234):
        self.tokens = read_tokens(path)
        if self.tokens.numel() < seq_len + 1:
            raise ValueError(f"training.dataset: {path} has {self.tokens.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}")
        top = int(self.tokens.max())
        if top >= vocab_size or int(self.tokens.min()) < 0:
            raise ValueError(f"training.dataset: {path} has token id {top}, outside model.vocab_size {vocab_size}")
        self.global_batch, self.seq_len, self.seed = global_batch, seq_len, seed

    def batch(self, step: int) -> Batch:
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (self.global_batch,), generator=_generator(self.seed, step))
        seq = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def token_stream(dataset: str, vocab_size: int, global_batch: int, seq_len: int, seed: int):
    """``dataset`` is "synthetic" or a token file's path."""
    if dataset == "synthetic":
        return SyntheticTokens(vocab_size, global_batch, seq_len, seed)
    return FileTokens(dataset, vocab_size, global_batch, seq_len, seed)


def data_parallel_rank(tp: int) -> tuple[int, int]:
    """This rank's (data-parallel rank, data-parallel size): tp is the inner-most mesh dim, so the
    ranks of one tp group share one slice of the batch."""
    return dist.get_rank() // tp, dist.get_world_size() // tp


def rank_slice(batch: Batch, dp_rank: int, dp_size: int) -> Batch:
    """Data-parallel rank ``dp_rank``'s rows of a global batch."""
    rows = batch[0].shape[0] // dp_size
    return tuple(t[dp_rank * rows : (dp_rank + 1) * rows] for t in batch)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` on ``device``; to a GPU from pinned memory, queued behind the kernels before it."""
    if device.type != "cuda":
        return tuple(x.to(device) for x in batch)
    return tuple(x.pin_memory().to(device, non_blocking=True) for x in batch)
