"""The sum-of-squares kernel that reads only when a device flag says so
(:mod:`simplefsdp.train.square_sum`): compiled for Hopper without a GPU, and run on one where there
is. Its values under Triton's interpreter, and the norm that uses it, are checked in
``tests/core/test_grad_squares.py::test_on_a_kernel_device_the_norm_decides_without_the_host``."""

from __future__ import annotations

import math

import pytest
import torch


def test_kernel_compiles_for_hopper():
    """Without a GPU: Triton compiles the kernel for sm_90 (an H100/H200) in every dtype it takes,
    and the compiled kernel branches on the flag (a skipped program loads no gradient)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from simplefsdp.train.square_sum import _KERNEL_DTYPES, BLOCK, CHUNK_BLOCKS, _square_sum_kernel

    signature = {"table_ptr": "*i64", "chunk_tensor_ptr": "*i32", "chunk_start_ptr": "*i64", "skip_ptr": "*i32",
                 "out_ptr": "*fp32", "n_tensors": "i32", "DTYPE": "constexpr", "BLOCK": "constexpr",
                 "CHUNK_BLOCKS": "constexpr"}
    for dtype in _KERNEL_DTYPES.values():
        constexprs = {"DTYPE": dtype, "BLOCK": BLOCK, "CHUNK_BLOCKS": CHUNK_BLOCKS}
        source = ASTSource(fn=_square_sum_kernel, signature=signature, constexprs=constexprs)
        ttgir = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ttgir"]
        assert "scf.if" in ttgir, dtype


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_gpu_the_kernel_sums_or_skips():
    """On CUDA: fp32, bf16 and a tensor the kernel does not take, within 1e-6 of the float64 sum;
    skipped, tensors of NaN give 0."""
    from simplefsdp.train.square_sum import square_sum_unless

    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(s, generator=gen, device="cuda") for s in ((4096, 1000), (7,), (3, 100003))]
    tensors += [torch.randn(70001, generator=gen, device="cuda").bfloat16(),
                torch.randn(60, 40, generator=gen, device="cuda").t()]
    expected = sum(t.double().pow(2).sum() for t in tensors).item()
    summed = square_sum_unless(tensors, torch.tensor(False, device="cuda")).item()
    assert abs(summed - expected) <= 1e-6 * expected, (summed, expected)
    poisoned = [torch.full_like(t, math.nan) for t in tensors]
    assert square_sum_unless(poisoned, torch.tensor(True, device="cuda")).item() == 0.0
