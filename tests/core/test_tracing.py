"""``simplefsdp.trace``: a folder that is a file is refused; a block that compiles nothing says so."""

from __future__ import annotations

import pytest
import torch

import simplefsdp


def test_trace_into_a_file_is_refused(tmp_path):
    path = tmp_path / "trace.log"
    path.write_text("")
    with pytest.raises(ValueError, match=r"trace: '.*trace.log' is a file; give a folder for the trace logs"):
        simplefsdp.trace(path)


def test_a_block_that_compiles_nothing_says_so(tmp_path):
    with pytest.warns(UserWarning, match=r"nothing was compiled inside the block, so no trace was written"):
        with simplefsdp.trace(tmp_path / "empty") as t:
            torch.ones(2) + 1
    assert t.logs() == [] and t.report is None


def test_a_block_that_compiles_writes_a_log(tmp_path):
    torch._dynamo.reset()
    with simplefsdp.trace(tmp_path / "one", render=False) as t:
        torch.compile(lambda x: x * 2)(torch.ones(2))
    assert len(t.logs()) == 1
