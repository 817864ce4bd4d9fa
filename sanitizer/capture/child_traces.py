"""Before a program SIGKILLs its own children: wait until their traces say they lost nothing.

SGLang's `Engine.shutdown()` ends its scheduler processes with SIGKILL (srt/utils/common.py
`kill_process_tree`), typically a few milliseconds after the last request was answered. A process
killed that way runs no code, so its trace is complete only if its header already says `quiet`
(every event recorded is in the file: sanitizer/trace/progress.py). A scheduler is made quiet
`HAZSAN_IDLE_SECONDS` (0.05 s) after its last step (writer.py, `_settle`), later than an
immediate shutdown. So the shutdown hook (sglang_hooks.on_engine) first waits, at most
`WAIT_SECONDS`, until every live child process with a trace in capture's folder is quiet, then
lets the program kill them as it always does. The program's own work is not changed, only its
shutdown delayed by that wait (about 0.05 to 0.08 s when the children are idle; a child still
inside a step when the shutdown came is waited for at most WAIT_SECONDS, then reported by `hazsan
check` as killed during that step, as before).
"""
from __future__ import annotations

import os
import time

#: The longest a shutdown is delayed for its children's traces.
WAIT_SECONDS = 1.0
POLL_SECONDS = 0.005


def _live_descendants() -> set:
    import psutil

    out = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                out.add(child.pid)
        except psutil.Error:
            pass
    return out


def not_quiet(directory: str, pids: set) -> list:
    """The trace files in `directory` of processes in `pids` whose header does not say quiet."""
    from sanitizer.trace.reader import read_header

    pending = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return pending
    for entry in entries:
        if not entry.name.endswith((".hzs", ".jsonl")):
            continue
        header = read_header(entry.path)
        if not header or header.get("pid") not in pids:
            continue
        progress = header.get("progress")
        if not (isinstance(progress, dict) and progress.get("quiet") is True):
            pending.append(entry.name)
    return pending


def wait_until_quiet(directory: str, timeout: float = WAIT_SECONDS) -> tuple[list, float]:
    """Wait until every live child process's trace in `directory` is quiet, at most `timeout`
    seconds. Returns (the files still not quiet, seconds waited)."""
    start = time.monotonic()
    pids = _live_descendants()
    if not pids:
        return [], 0.0
    while True:
        pending = not_quiet(directory, pids)
        waited = time.monotonic() - start
        if not pending or waited >= timeout:
            return pending, waited
        time.sleep(POLL_SECONDS)
