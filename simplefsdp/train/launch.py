"""Run a function on N local CPU ranks (gloo) in spawned processes; never hang.

Used by the training entry point when no launcher (torchrun) started it, and by the tests.

``run_ranks(fn, world_size, *args)`` starts one process per rank, initializes a gloo process
group, calls ``fn(*args)`` and returns the per-rank results in rank order. The first rank that
raises fails the test with that rank's traceback; the other ranks are killed at once (they would
wait forever in a collective). A run past ``timeout`` seconds is killed and fails.

Each rank's stderr (fd 2, so also native-code messages such as an abort's) goes to a log file that
the parent copies to its own stderr as it grows, each line prefixed with ``[rank N]``; a rank that
dies shows the end of its log in the error, and ``faulthandler`` adds its Python stacks. The logs'
temporary folder is removed when the launch ends.

The ranks share the launching process's Inductor cache dir (``TORCHINDUCTOR_CACHE_DIR``, which
importing ``torch._inductor.config``, as ``simplefsdp`` does, sets to torch's per-user dir when
unset), so a second run of a command finds what the first compiled; the passes' cache key names
each rank's process groups, so ranks of different sub-mesh groups never load each other's
artifacts. They use one thread each, since the CI machine has two cores.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import shutil
import socket
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, run_dir, results, fn, args):
    log = open(_log_path(run_dir, rank), "ab", buffering=0)
    os.dup2(log.fileno(), 2)
    faulthandler.enable(all_threads=True)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        TORCHINDUCTOR_COMPILE_THREADS="1",
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            # plain pickle: torch tensors sent through shared memory die with their process
            results.put((rank, "ok", pickle.dumps(fn(*args))))
        finally:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def _log_path(run_dir: str, rank: int) -> str:
    return os.path.join(run_dir, f"rank{rank}.stderr")


class _RankLogs:
    """The ranks' stderr logs: copied to our stderr as they grow, and their ends for errors."""

    def __init__(self, run_dir: str, world_size: int):
        self.paths = [_log_path(run_dir, r) for r in range(world_size)]
        self.copied = [0] * world_size

    def copy_new_lines(self, final: bool = False) -> None:
        for rank, path in enumerate(self.paths):
            if not os.path.exists(path):
                continue
            with open(path, "rb") as f:
                f.seek(self.copied[rank])
                data = f.read()
            end = len(data) if final else data.rfind(b"\n") + 1
            self.copied[rank] += end
            for line in data[:end].decode(errors="replace").splitlines():
                sys.stderr.write(f"[rank {rank}] {line}\n")
        sys.stderr.flush()

    def tail(self, rank: int, lines: int = 30) -> str:
        if not os.path.exists(self.paths[rank]):
            return ""
        with open(self.paths[rank], "rb") as f:
            text = f.read().decode(errors="replace").rstrip()
        return f"\nlast lines of rank {rank}'s stderr:\n" + "\n".join(text.splitlines()[-lines:]) if text else ""


def _root_cause(rank: int, error: str, results, procs, logs: _RankLogs, grace: float = 5.0) -> str:
    """The error to report when ``rank`` failed with ``error``.

    A rank that only lost its connection (gloo: "Connection reset/closed by peer") failed because
    another rank went first: give that one a moment to report its own traceback, or to show up
    dead with an exit code (a crash in native code leaves no traceback), and report it too.
    """
    if "by peer" not in error:
        return f"rank {rank} failed:\n{error}"
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            other, status, value = results.get(timeout=0.5)
        except queue.Empty:
            continue
        if status == "error" and "by peer" not in value:
            return f"rank {other} failed:\n{value}\n(rank {rank} then lost its connection)"
    dead = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode not in (None, 0)}
    if not dead:
        return f"rank {rank} failed:\n{error}\n(no rank has exited abnormally yet)"
    died = "\n".join(f"rank {r} died with exit code {code}{logs.tail(r)}" for r, code in dead.items())
    return f"{died}\n(rank {rank} then lost its connection:\n{error})"


def run_ranks(fn, world_size: int, *args, timeout: float = 600.0) -> list:
    """``fn(*args)`` on ``world_size`` gloo ranks; the list of their return values, by rank.

    ``fn`` must be importable by name (a module-level function), since ranks are spawned.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    run_dir = tempfile.mkdtemp(prefix="simplefsdp-ranks-")
    logs = _RankLogs(run_dir, world_size)
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, run_dir, results, fn, args))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                logs.copy_new_lines()
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(outputs))
                    raise TimeoutError(f"ranks {missing} did not finish within {timeout:.0f}s")
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outputs]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}{logs.tail(dead[0])}")
                continue
            if status == "error":
                raise RuntimeError(_root_cause(rank, value, results, procs, logs))
            outputs[rank] = pickle.loads(value)
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=5 if len(outputs) == world_size else 0)
            if p.is_alive():
                p.kill()
            p.join()
        logs.copy_new_lines(final=True)
        shutil.rmtree(run_dir, ignore_errors=True)  # every line is on our stderr, and in any error
    return [outputs[r] for r in range(world_size)]
