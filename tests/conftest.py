"""Shared fixtures: a fake 8-rank process group for single-process graph and error tests (graph
modules run as rank 0 and as the last rank), and an
``expecttest`` case for inline expected graphs (``EXPECTTEST_ACCEPT=1`` rewrites them).

The suite runs on two pytest-xdist workers (``pytest.ini``). Tests marked ``ranks`` launch gloo
ranks in processes of their own; they form one xdist group, so one worker runs them one launch at
a time (a launch already uses every core, and ``launch_once`` results are shared within a worker),
while the other worker runs the single-process tests. A test that launches ranks without the mark
fails, naming itself (the launcher is wrapped here).

Inductor compiles the suite's C++ kernels without SIMD (``TORCHINDUCTOR_VEC_ISA_OK=0``, set before
torch is imported, so spawned ranks and CLI subprocesses inherit it): gcc then takes about half as
long, and nothing the tests check (graphs, collectives, parity with eager or between two compiled
runs) depends on the kernels' instruction set. Users and the benchmarks keep Inductor's default."""

from __future__ import annotations

import os

os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import functools  # noqa: E402

import expecttest  # noqa: E402
import pytest  # noqa: E402
import torch.distributed as dist  # noqa: E402

import simplefsdp.train.launch as launch  # noqa: E402

_running: dict = {}  # the test item being run


def _launches_need_the_ranks_mark(run_ranks):
    @functools.wraps(run_ranks)
    def checked(*args, **kwargs):
        item = _running.get("item")
        if item is not None and item.get_closest_marker("ranks") is None:
            raise AssertionError(f"{item.nodeid} launches ranks: mark it @pytest.mark.ranks (conftest.py says why)")
        return run_ranks(*args, **kwargs)

    return checked


launch.run_ranks = _launches_need_the_ranks_mark(launch.run_ranks)  # before any test module imports it


def pytest_runtest_setup(item):
    _running["item"] = item  # set before the item's fixtures, module-scoped ones included


def pytest_runtest_teardown(item):
    _running.pop("item", None)


def run_under_triton_interpreter(script: str) -> str:
    """``script``'s stdout, run by a new Python at the repository's root under Triton's
    interpreter (``TRITON_INTERPRET=1``: Triton kernels run on CPU tensors, with numpy; set before
    triton is imported, hence the process of its own). Skips without triton or numpy; fails with
    the script's stderr."""
    import subprocess
    import sys

    pytest.importorskip("triton")
    pytest.importorskip("numpy")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, TRITON_INTERPRET="1"),
                          capture_output=True, text=True, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def fake_world_at(rank: int):
    """World size 8 in this process, as ``rank``: collectives trace and run, but move no data."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=8)
    yield 8
    dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _forget_meshes_of_earlier_worlds():
    """Clear DTensor's sharding-propagation cache before each test: it keys on DeviceMesh
    equality (ranks and dim names), so an op could get output specs holding the mesh of an earlier
    world (a fake world, or the cost model's), whose process groups are gone ("Could not resolve
    the process group registered under the name 15")."""
    from torch.distributed.tensor import DTensor

    cached = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
    if hasattr(cached, "cache_clear"):
        cached.cache_clear()
    yield


@pytest.fixture(scope="module")
def fake_world():
    yield from fake_world_at(0)


# graph modules override ``fake_world`` with this, so each graph also compiles on the last rank,
# where uneven shards are padded
FAKE_RANKS = dict(scope="module", params=[0, 7], ids=["rank0", "rank7"])


@pytest.hookimpl(tryfirst=True)  # before the ``-m`` selection
def pytest_collection_modifyitems(items):
    """Tests marked ``slow_on_last_rank`` run as rank 0 by default and as rank 7 with ``-m slow``;
    tests marked ``ranks`` join one xdist group."""
    for item in items:
        if item.get_closest_marker("ranks"):
            item.add_marker(pytest.mark.xdist_group("ranks"))
        callspec = getattr(item, "callspec", None)
        if item.get_closest_marker("slow_on_last_rank") and callspec and callspec.params.get("fake_world") == 7:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def tc(fake_world):
    """An expecttest case for ``assertExpectedInline``, with the fake world set up."""
    case = expecttest.TestCase()
    case.maxDiff = None
    return case
