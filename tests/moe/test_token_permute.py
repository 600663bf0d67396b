"""Token permutation with aligned group padding: the Triton kernel, its torch path and autograd.

The Triton kernel runs on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, set
before triton is imported, hence the subprocess); both paths must give the same bits.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from simplefsdp.moe.grouped_mm import grouped_mm
from simplefsdp.moe.token_permute import aligned_groups, permute_rows
from simplefsdp.moe.token_slots import rows_or_zeros

COUNTS = [3, 0, 5, 17, 1]  # an empty group, groups shorter and longer than the alignment


def _grouped_linear(w):
    def fn(x, counts):
        return grouped_mm(x, w, torch.cumsum(counts, 0).to(torch.int32))

    return fn


def _case(seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(COUNTS, dtype=torch.int32)
    x = torch.randn(int(counts.sum()), 8, generator=g, requires_grad=True)
    w = torch.randn(len(COUNTS), 8, 4, generator=g, requires_grad=True)
    return x, w, counts


def test_aligned_groups_pad_each_group_and_leave_results_unchanged():
    x, w, counts = _case()
    seen = {}

    def spy(rows, padded_counts):
        seen["rows"], seen["counts"] = rows.detach(), padded_counts
        return _grouped_linear(w)(rows, padded_counts)

    out = aligned_groups(spy, x, counts, alignment=4)
    assert seen["counts"].tolist() == [4, 0, 8, 20, 4]
    assert seen["rows"].shape[0] == x.shape[0] + len(COUNTS) * 3  # static bound
    starts = [0, 4, 4, 12, 32]
    for g, (start, n) in enumerate(zip(starts, COUNTS)):
        src = sum(COUNTS[:g])
        assert torch.equal(seen["rows"][start : start + n], x[src : src + n].detach())
        pad = seen["counts"][g].item() - n
        assert torch.count_nonzero(seen["rows"][start + n : start + n + pad]) == 0
    assert torch.count_nonzero(seen["rows"][36:]) == 0

    ref = _grouped_linear(w)(x, counts)
    assert torch.equal(out, ref)
    grads = torch.autograd.grad(out.square().sum(), (x, w))
    ref_grads = torch.autograd.grad(ref.square().sum(), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_permute_rows_compiles_with_its_gradient():
    x, _, _ = _case()
    index = torch.tensor([2, -1, 0, 1, -1])
    inverse = torch.tensor([2, 3, 0] + [-1] * (x.shape[0] - 3))
    x3 = x[:3].detach().requires_grad_()
    out = torch.compile(permute_rows, fullgraph=True)(x3, index, inverse[:3])
    assert torch.equal(out, torch.stack([x3[2], torch.zeros(8), x3[0], x3[1], torch.zeros(8)]))
    (grad,) = torch.autograd.grad((out * torch.arange(5.0).view(5, 1)).sum(), x3)
    assert torch.equal(grad, torch.tensor([2.0, 3.0, 0.0]).view(3, 1).expand(3, 8))


_KERNEL_CHECK = """
import torch
from simplefsdp.moe import token_permute as tp
from simplefsdp.moe.token_slots import rows_or_zeros
assert tp._triton_usable(torch.empty(1))
g = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(37, 1500, generator=g).to(dtype)  # more columns than one block
    index = torch.randperm(50, generator=g) - 13
    index[index >= 37] = -1
    assert torch.equal(tp._permute_rows(x, index, index), rows_or_zeros(x, index, padded=True)), dtype
print("kernel ok")
"""


def test_triton_kernel_matches_torch_path():
    pytest.importorskip("triton")
    pytest.importorskip("numpy")  # Triton's interpreter computes with numpy
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", _KERNEL_CHECK], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernel ok" in done.stdout


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_gpu_kernel_and_padding_leave_grouped_mm_bits_unchanged():
    """On CUDA in bf16: the Triton path is taken, equals the torch path, and padding the groups
    for ``torch._grouped_mm`` changes no bit of its output or gradients."""
    from simplefsdp.moe import token_permute as tp

    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([100, 0, 37, 300, 75, 1, 250, 61], dtype=torch.int32, device="cuda")
    x = torch.randn(int(counts.sum()), 512, generator=g, device="cuda").bfloat16().requires_grad_()
    w = torch.randn(8, 512, 256, generator=g, device="cuda").bfloat16().requires_grad_()
    index = torch.randperm(x.shape[0] + 40, generator=g, device="cuda") - 40
    assert tp._triton_usable(x)
    assert torch.equal(tp._permute_rows(x, index, index), rows_or_zeros(x, index, padded=True))
    out = aligned_groups(_grouped_linear(w), x, counts)
    ref = _grouped_linear(w)(x, counts)
    assert torch.equal(out, ref)
    grads = torch.autograd.grad(out.float().square().sum(), (x, w))
    ref_grads = torch.autograd.grad(ref.float().square().sum(), (x, w))
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
