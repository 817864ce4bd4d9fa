"""Start a world of rank processes on this machine, each with the testbed's shared windows.

    def worker(rank, files, n):
        comm = SymmetricCommunicator(files, rank)
        ...
        return something_picklable

    results = spawn(worker, world_size=2, args=(1024,))     # [result of rank 0, result of rank 1]

Processes are started with the "spawn" method (what SGLang and torch.multiprocessing use), with
RANK, WORLD_SIZE and LOCAL_RANK set, so hazsan capture (HAZSAN=1) names each trace after its rank.
A rank that raises makes spawn raise too, with that rank's traceback; the shared files are removed
at the end whatever happens.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback

from .shm import WindowFiles


class RankFailed(RuntimeError):
    """One or more rank processes failed; the message carries their tracebacks."""


def _entry(fn, rank, files, args, kwargs, results):
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(files.world_size)
    try:
        value = fn(rank, files, *args, **kwargs)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise SystemExit(1)


def spawn(fn, world_size: int, *, args=(), kwargs=None, window_bytes: int = 64 << 20,
          timeout: float = 600.0, directory: str | None = None) -> list:
    """Run fn(rank, files, *args, **kwargs) in world_size processes; return their results by rank."""
    files = WindowFiles.create(world_size, window_bytes, directory)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(fn, r, files, tuple(args), dict(kwargs or {}), results),
                         name=f"hazsan-rank{r}") for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        got: dict[int, tuple] = {}
        failed = []
        import queue as _queue
        import time
        deadline = time.monotonic() + timeout
        while len(got) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailed(f"ranks {sorted(set(range(world_size)) - set(got))} did not finish within {timeout:.0f} s")
            try:
                rank, ok, value = results.get(timeout=min(left, 1.0))
            except _queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode not in (None, 0)]
                if dead:
                    # give a dying rank's traceback a moment to arrive, then report what we have
                    try:
                        rank, ok, value = results.get(timeout=2.0)
                    except _queue.Empty:
                        raise RankFailed(f"ranks {dead} exited with codes "
                                         f"{[procs[r].exitcode for r in dead]} without a result") from None
                else:
                    continue
            got[rank] = (ok, value)
            if not ok:
                failed.append(rank)
                break
        if failed:
            msgs = "\n".join(f"--- rank {r} ---\n{got[r][1]}" for r in failed)
            raise RankFailed(f"rank(s) {failed} failed:\n{msgs}")
        for p in procs:
            p.join(timeout=30)
        return [got[r][1] for r in range(world_size)]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        files.unlink()
