"""The local CPU launcher: a crash on one rank is reported as that rank's, not as its peer's
lost connection."""

from __future__ import annotations

import os
import tempfile

import pytest

from simplefsdp.train.launch import run_ranks

pytestmark = pytest.mark.ranks  # every test here launches ranks


def _rank1_crashes():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(7)  # like a crash in native code: no Python traceback
    dist.all_reduce(torch.ones(1))


def test_crashed_rank_is_named(monkeypatch):
    made, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kwargs: made.append(mkdtemp(**kwargs)) or made[-1])
    with pytest.raises(RuntimeError) as error:
        run_ranks(_rank1_crashes, 2, timeout=120)
    # whether the parent sees rank 1 exit first, or rank 0 lose its connection first, the report
    # leads with the crashed rank
    assert str(error.value).startswith("rank 1 died with exit code 7")
    # the folder of the ranks' stderr logs is gone once the launch ends (its end is in the error)
    assert len(made) == 1 and not os.path.exists(made[0])


def _rank0_aborts():
    import torch
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os.write(2, b"native message before the abort\n")
        os.abort()
    dist.all_reduce(torch.ones(1))


def test_native_abort_shows_the_ranks_stderr():
    with pytest.raises(RuntimeError) as error:
        run_ranks(_rank0_aborts, 2, timeout=120)
    message = str(error.value)
    assert "native message before the abort" in message
    assert "Fatal Python error: Aborted" in message  # faulthandler's Python stack
