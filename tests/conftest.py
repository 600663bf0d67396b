"""Shared fixtures: a fake 8-rank process group for single-process graph and error tests, and an
``expecttest`` case for inline expected graphs (``EXPECTTEST_ACCEPT=1`` rewrites them)."""

from __future__ import annotations

import expecttest
import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def fake_world():
    """World size 8 in this process: collectives trace and run, but move no data."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    yield 8
    dist.destroy_process_group()


@pytest.fixture
def tc(fake_world):
    """An expecttest case for ``assertExpectedInline``, with the fake world set up."""
    case = expecttest.TestCase()
    case.maxDiff = None
    return case
