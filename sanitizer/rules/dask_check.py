"""`hazsan check --scheduler ADDRESS`: each rank file analysed on a Dask distributed worker that
can read it, the collective signatures joined here (docs/cli.md, "--scheduler").

The rank files stay where capture wrote them, on the machines of the ranks: the paths given are
paths as the workers see them. Every worker lists the trace files it can read under those paths
(a directory is expanded on the worker, as `hazsan check` would); each file goes to one worker
that sees it (the one with the fewest bytes assigned so far). The worker runs the same per-file
analysis as `--jobs` (sanitizer.rules.parallel.analyze_one: the driver's `analyze` on that file,
the collectives' window signatures recorded), and only its results travel back: findings, the
summary, errors, warnings and the signatures. They are joined here by `--jobs`'s own join, so the
report is the one a serial run gives (the same two bounds as `--jobs`, docs/cli.md).

Two workers on one machine (or on a shared filesystem) see the same file under the same path: a
file is told apart by its path, its size and a digest of its first bytes, and analysed once. The
same path holding different files on two machines (`/data/traces/rank0.hzs` on each) is two files.

Dask is an optional dependency: `pip install hazsan[dask]`.
"""
from __future__ import annotations

import gc
import hashlib
import os
import uuid

from sanitizer.limits import Limits
from sanitizer.rules import driver, parallel, select
from sanitizer.rules.driver import Analysis
from sanitizer.rules.findings import FindingSink
from sanitizer.trace import reader
from sanitizer.trace.reader import TraceError

#: Seconds to wait for the scheduler (`--scheduler-timeout`).
DEFAULT_TIMEOUT = 10.0
_DIGEST_BYTES = 4096


class SchedulerError(Exception):
    """The scheduler cannot be used: not reachable, no workers, Dask missing."""


def _visible_files(paths: list[str]) -> dict:
    """On a worker: the trace files it can read under `paths`, each with (argument index, size,
    digest of its first bytes), and what it could not find. Runs where the files are."""
    import socket

    found, missing = [], []
    for i, p in enumerate(paths):
        try:
            files = reader.expand_paths([p])
        except TraceError as exc:
            missing.append((i, exc.message))
            continue
        for f in files:
            try:
                size = os.path.getsize(f)
                with open(f, "rb") as fh:
                    digest = hashlib.blake2b(fh.read(_DIGEST_BYTES), digest_size=16).hexdigest()
            except OSError as exc:
                missing.append((i, f"{f}: {exc.strerror or exc}"))
                continue
            found.append((i, str(f), size, digest))
    import sanitizer

    return {"files": found, "missing": missing, "host": socket.gethostname(),
            "version": getattr(sanitizer, "__version__", None)}


def _connect(address: str, timeout: float):
    try:
        from distributed import Client
    except ImportError as exc:
        raise SchedulerError("--scheduler needs Dask distributed: pip install 'hazsan[dask]' "
                             f"({exc})") from None
    try:
        return Client(address, timeout=timeout, set_as_default=False)
    except (OSError, TimeoutError, ValueError, TypeError) as exc:
        raise SchedulerError(f"cannot reach the Dask scheduler at {address!r} within {timeout:g} s: "
                             f"{type(exc).__name__}: {exc}") from None


def plan(listing: dict, paths: list[str]) -> tuple[list[tuple[str, str]], list[TraceError]]:
    """(worker address, file path) per distinct file, in the order a serial run reads them (the
    arguments in order, each directory's files sorted), and errors for arguments no worker could
    read. `listing`: worker address -> _visible_files' answer."""
    seen: dict = {}             # (path, size, digest) -> (argument index, path, [workers])
    missing: dict = {}          # argument index -> messages
    for worker, info in sorted(listing.items()):
        for i, path, size, digest in info["files"]:
            entry = seen.setdefault((path, size, digest), (i, path, []))
            entry[2].append(worker)
        for i, message in info["missing"]:
            missing.setdefault(i, []).append(message)
    found_args = {i for i, _, _ in seen.values()}
    errors = []
    for i, messages in sorted(missing.items()):
        if i not in found_args:
            errors.append(TraceError(paths[i], None, f"no Dask worker can read it ({messages[0]})"))
    load = {w: 0 for w in listing}
    out = []
    for (path, size, digest), (i, _, workers) in sorted(seen.items(), key=lambda kv: (kv[1][0], kv[0][0], kv[0][1:])):
        worker = min(workers, key=lambda w: (load[w], w))
        load[worker] += size
        out.append((worker, path))
    return out, errors


def analyze_on_cluster(paths, *, scheduler: str, peer_completion: str = "local", lenient: bool = False,
                       max_per_group: int = 100, max_errors: int = 50, engine: str | None = None,
                       timeout: float = DEFAULT_TIMEOUT, limits: Limits | None = None) -> Analysis:
    """The driver's `analyze`, each rank file analysed on a Dask worker that can read it, joined
    here. Raises SchedulerError when the scheduler cannot be used."""
    paths = [str(p) for p in paths]
    if peer_completion not in ("local", "successor"):
        raise ValueError("peer_completion must be 'local' or 'successor'")
    try:
        eng, engine_kind, fallback = select.load_engine(engine)
    except (ValueError, RuntimeError) as exc:     # as a serial run reports it
        err = TraceError(select.ENV, None, str(exc))
        return Analysis([], driver._summary(0, 0, FindingSink(), [str(exc)], 0, 0, 0, None), [err], [])
    client = _connect(scheduler, timeout)
    try:
        workers = list(client.scheduler_info().get("workers", {}))
        if not workers:
            try:
                client.wait_for_workers(1, timeout=timeout)
            except (OSError, TimeoutError) as exc:
                raise SchedulerError(f"the Dask scheduler at {scheduler!r} has no workers "
                                     f"({type(exc).__name__}: {exc})") from None
        listing = client.run(_visible_files, paths)
        tasks, errors = plan(listing, paths)
        if errors or not tasks:      # as a serial run: a path that cannot be read ends the check
            exc = errors[0] if errors else TraceError(scheduler, None, "no trace files on any worker")
            return Analysis([], driver._summary(0, 0, FindingSink(), [str(exc)], 0, 0, 0, engine_kind), [exc], [])
        limits = limits or Limits()
        run_id = uuid.uuid4().hex
        futures = [client.submit(parallel.analyze_one, path, peer_completion, lenient, max_per_group, max_errors,
                                 engine_kind, limits, workers=[worker], allow_other_workers=False, pure=False,
                                 key=f"hazsan-check-{run_id}-{n}")
                   for n, (worker, path) in enumerate(tasks)]
        parts = client.gather(futures)      # in task order: the order a serial run reads the files
        where = {path: worker for worker, path in tasks}
        count = iter(range(len(tasks), 1 << 62))

        def on_worker(fn, path, *args):     # where the file is
            return client.submit(fn, path, *args, workers=[where[path]], allow_other_workers=False,
                                 pure=False, key=f"hazsan-check-{run_id}-{next(count)}")

        def run_map(fn, calls):
            return client.gather([on_worker(fn, *args) for args in calls])

        def rerun(path, extra):
            return on_worker(parallel.analyze_one, path, peer_completion, lenient, max_per_group, max_errors,
                             engine_kind, limits, None, extra)

        parts = parallel.across_ranks(parts, run_map, rerun, limits)
    finally:
        client.close()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        joined = parallel.join(parts, max_per_group=max_per_group, max_errors=max_errors,
                               engine=eng, engine_kind=engine_kind, fallback=fallback)
    finally:
        if was_enabled:
            gc.enable()
    return joined
