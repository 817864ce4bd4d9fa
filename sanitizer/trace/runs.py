"""Which trace files belong to one run, so that a verdict never mixes two (docs/cli.md, "Runs").

Capture gives every run an id (capture/config.py: `run_id`): the first captured process of a run
makes one, `hazsan run` and the pytest plugin set it, and every process started from there inherits
it. Each trace header carries it (`run`) with the process's start (`started`, ns since the epoch).

The files of one directory form one run per id. Two ids are one run when their processes ran at the
same time as different ranks: ranks started by hand (two shells, a script with `&`) make an id
each. Files without an id (hand-written traces, captures of hazsan before 0.2) are one run of
their own; a file whose header cannot be read joins the run chosen, so that its error is reported.

What is judged (`choose`):
  * one run: its files;
  * files or folders named together that one run wrote (a pytest session's test folders named by a
    glob): judged together, as asked;
  * files named one by one that hold several runs: an error naming them (never a mixed verdict);
  * one directory holding several runs (the same HAZSAN_DIR used twice): the newest, and a note
    naming the others and how to pick one (`--run`);
  * several directories each holding runs (the pytest plugin's session folder, a folder of run
    folders): `SeveralRuns`, which `hazsan check` judges run by run and the other commands report.
A directory that holds no trace file is searched below (two levels), for run folders.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from sanitizer.trace.reader import TraceError, open_trace
from sanitizer.trace.schema import NON_TRACE_FILES, is_trace_name

#: How deep a directory without trace files is searched for run folders (the plugin's session
#: folder holds them at <dir>/tests/<test>/).
SEARCH_DEPTH = 2


@dataclass
class Run:
    """The trace files of one run in one directory."""

    id: str | None
    directory: Path
    files: list[Path] = field(default_factory=list)
    ranks: set = field(default_factory=set)
    started: int = 0        # ns since the epoch: the earliest process start (else file time)
    ended: int = 0          # ns: the latest file modification

    def overlaps(self, other: "Run") -> bool:
        return self.started <= other.ended and other.started <= self.ended

    def label(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started / 1e9)) if self.started else "?"
        ranks = sorted(r for r in self.ranks if isinstance(r, int) and r >= 0)
        what = f"rank(s) {','.join(map(str, ranks))}" if ranks else "no rank"
        return (f"run {self.id or '(no run id)'} in {self.directory}: {len(self.files)} file(s), "
                f"{what}, started {when}")


class SeveralRuns(TraceError):
    """The paths hold runs in several directories: each is judged on its own."""

    def __init__(self, path, runs: list[Run]):
        self.runs = runs
        listing = "; ".join(r.label() for r in runs[:10]) + (f"; and {len(runs) - 10} more" if len(runs) > 10 else "")
        super().__init__(path, None, f"holds {len(runs)} runs in separate folders ({listing}): "
                                     "name one folder, or `hazsan check` judges each on its own")


def _trace_files(d: Path) -> list[Path]:
    try:
        return sorted(q for q in d.iterdir()
                      if q.is_file() and is_trace_name(q.name) and q.name not in NON_TRACE_FILES)
    except OSError as exc:
        raise TraceError(d, None, f"cannot list: {exc.strerror or exc}") from exc


def _run_folders(d: Path, depth: int) -> list[tuple[Path, list[Path]]]:
    """Folders under `d` (down to `depth` levels) that hold trace files, with those files."""
    out = []
    try:
        subs = sorted(q for q in d.iterdir() if q.is_dir() and not q.name.startswith("."))
    except OSError:
        return out
    for q in subs:
        files = _trace_files(q)
        if files:
            out.append((q, files))
        elif depth > 1:
            out.extend(_run_folders(q, depth - 1))
    return out


def _groups(paths) -> tuple[list[tuple[Path, list[Path]]], bool, bool]:
    """(directory, files) groups the paths name, whether any path is a file named directly, and
    whether any folder was found by searching below a path (not named)."""
    groups: dict[Path, list[Path]] = {}
    named = found_below = False
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files = _trace_files(p)
            if files:
                groups.setdefault(p, []).extend(files)
                continue
            below = _run_folders(p, SEARCH_DEPTH)
            if not below:
                raise TraceError(p, None, "directory holds no *.jsonl, *.hzs or .gz trace files "
                                          "(nor do its subfolders)")
            found_below = True
            for d, files in below:
                groups.setdefault(d, []).extend(files)
        elif p.exists():
            named = True
            groups.setdefault(p.parent, []).append(p)
        else:
            raise TraceError(p, None, "no such file or directory")
    return list(groups.items()), named, found_below


def _split(directory: Path, files: list[Path]) -> list[Run]:
    """One directory's files as runs: by id, ids merged whose processes overlapped as distinct ranks."""
    by_id: dict[str | None, Run] = {}
    unreadable: list[Path] = []
    for f in files:
        try:
            tf = open_trace(f)
        except TraceError:
            unreadable.append(f)
            continue
        tf.close()
        h = tf.header if isinstance(tf.header, dict) else {}
        rid = h.get("run") if isinstance(h.get("run"), str) else None
        run = by_id.setdefault(rid, Run(rid, directory))
        run.files.append(f)
        run.ranks.add(h.get("rank"))
        try:
            mtime = f.stat().st_mtime_ns
        except OSError:
            mtime = 0
        started = h.get("started") if isinstance(h.get("started"), int) else mtime
        run.started = min(run.started, started) if run.started else started
        run.ended = max(run.ended, mtime, started)
    runs = sorted(by_id.values(), key=lambda r: r.started)
    merged: list[Run] = []
    for r in runs:
        into = next((m for m in merged if m.id is not None and r.id is not None and m.overlaps(r)
                     and not _shared_ranks(m, r)), None)
        if into is None:
            merged.append(r)
            continue
        into.files += r.files
        into.ranks |= r.ranks
        into.ended = max(into.ended, r.ended)
        into.id = f"{into.id}+{r.id}"
    if unreadable:         # judged with whichever run is chosen: their errors must be reported
        for r in merged:
            r.files += unreadable
        if not merged:
            merged.append(Run(None, directory, list(unreadable)))
    for r in merged:
        r.files.sort()
    return merged


def _shared_ranks(a: Run, b: Run) -> bool:
    ra = {r for r in a.ranks if isinstance(r, int) and r >= 0}
    rb = {r for r in b.ranks if isinstance(r, int) and r >= 0}
    return bool(ra & rb)


def find_runs(paths) -> tuple[list[Run], bool, bool]:
    """Every run the paths hold, whether files were named one by one, and whether folders were
    found below a path. Raises TraceError for a path that does not exist or holds no trace."""
    groups, named, found_below = _groups(paths)
    runs: list[Run] = []
    for directory, files in groups:
        runs.extend(_split(directory, files))
    return runs, named, found_below


def choose(paths, run: str | None = None) -> tuple[list[Path], list[str]]:
    """The files to judge together, and notes on what was left out (module doc). Raises TraceError
    (files of several runs named together, an unknown `run`) or SeveralRuns."""
    runs, named, found_below = find_runs(paths)
    where = Path(paths[0]) if len(paths) == 1 else Path(os.path.commonpath([os.path.abspath(p) for p in paths]))
    if run is not None:
        picked = [r for r in runs if r.id is not None and (r.id == run or run in r.id.split("+"))]
        if not picked:
            known = ", ".join(str(r.id) for r in runs)
            raise TraceError(where, None, f"no run {run!r} here (runs: {known})")
        runs = picked
    if len(runs) == 1:
        return runs[0].files, []
    ids = {r.id for r in runs}
    if len(ids) == 1 and None not in ids and not found_below:
        # folders or files named together that one run wrote (a session's test folders, named by
        # a glob): judged together, as asked
        return sorted(f for r in runs for f in r.files), []
    if named:
        listing = "; ".join(f"{r.label()}: {', '.join(f.name for f in r.files[:4])}"
                            + (" ..." if len(r.files) > 4 else "") for r in runs)
        raise TraceError(where, None, f"these files come from {len(runs)} different runs, which are never "
                                      f"judged together ({listing}); name the files of one run, or pass --run ID")
    if len({r.directory for r in runs}) > 1:
        raise SeveralRuns(where, runs)
    newest = max(runs, key=lambda r: r.started)
    others = [r for r in runs if r is not newest]
    note = (f"{newest.directory} holds {len(runs)} runs; judged the newest, {newest.label()}; "
            f"left out: {'; '.join(r.label() for r in others)} (--run ID picks one)")
    return newest.files, [note]
