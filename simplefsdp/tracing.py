"""``simplefsdp.trace(dir)``: dump torch.compile's structured trace and render it with tlparse.

Equivalent to running with ``TORCH_TRACE=dir``, but scoped and in-process::

    with simplefsdp.trace("trace"):
        torch.compile(model)(tokens).sum().backward()
    # trace/dedicated_log_torch_trace_rank_0_*.log, rendered into trace/tlparse/index.html

Each rank writes its own log. Inductor's caches are off inside the block: on a cache hit the
post-grad passes do not run, and the trace would miss their plans (``simplefsdp_fsdp_buckets``,
``simplefsdp_a2a_overlap``). On leaving the block, rank 0 (or the only process) renders its log
with ``tlparse`` if that is installed; the path of the report is returned by :meth:`Trace.report`.
A block that compiled nothing writes no log, and says so with a warning.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import warnings

import torch
import torch.distributed as dist
from torch._logging import _internal as torch_logging


class trace:  # noqa: N801 (used like a function: ``with simplefsdp.trace(dir):``)
    """Context manager: structured trace of every compile inside it into ``dir``."""

    def __init__(self, dir: str | os.PathLike, render: bool = True):
        self.dir = os.fspath(dir)
        if os.path.exists(self.dir) and not os.path.isdir(self.dir):
            raise ValueError(f"trace: {self.dir!r} is a file; give a folder for the trace logs")
        self.render = render
        self.report: str | None = None  # index.html of the tlparse report, once rendered

    def __enter__(self) -> "trace":
        os.makedirs(self.dir, exist_ok=True)
        self._before = set(self.logs())
        self._handler = torch_logging.LazyTraceHandler(self.dir)
        self._handler.setFormatter(torch_logging.TorchLogsFormatter(trace=True))
        self._level = torch_logging.trace_log.level
        torch_logging.trace_log.setLevel(logging.DEBUG)
        torch_logging.trace_log.addHandler(self._handler)
        self._caches = torch._inductor.config.patch(force_disable_caches=True)
        self._caches.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._caches.__exit__(*exc)
        torch_logging.trace_log.removeHandler(self._handler)
        torch_logging.trace_log.setLevel(self._level)
        self._handler.close()
        new = [log for log in self.logs() if log not in self._before]
        if not new and exc[0] is None:
            warnings.warn(
                f"simplefsdp.trace({self.dir!r}): nothing was compiled inside the block, so no trace was "
                "written (a compiled model reuses its graphs: first call it inside the block, or "
                "torch._dynamo.reset() before)",
                stacklevel=2,
            )
        rank0 = not dist.is_initialized() or dist.get_rank() == 0
        written = [log for log in new if not dist.is_initialized() or "rank_0_" in log]
        if self.render and rank0 and written and exc[0] is None:
            self.report = render(written[-1], os.path.join(self.dir, "tlparse"))

    def logs(self) -> list[str]:
        """The raw trace logs in ``dir``, one per rank and run."""
        return sorted(glob.glob(os.path.join(self.dir, "*.log")))


def render(log: str, out: str) -> str | None:
    """Render one trace log with tlparse into ``out``; its index.html, or None without tlparse."""
    tlparse = shutil.which("tlparse")
    if tlparse is None:
        return None
    subprocess.run([tlparse, log, "-o", out, "--overwrite", "--no-browser"], check=True, capture_output=True)
    return os.path.join(out, "index.html")
