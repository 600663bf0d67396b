"""What ``conftest.py`` sets for the whole suite, checked from inside a test."""

from __future__ import annotations

import os


def test_cpp_kernels_compile_without_simd_here_and_in_spawned_processes():
    """Half the gcc time of every compile in the suite; ranks and CLI subprocesses read the variable."""
    from torch._inductor import config

    assert os.environ["TORCHINDUCTOR_VEC_ISA_OK"] == "0"
    assert config.cpp.vec_isa_ok is False
