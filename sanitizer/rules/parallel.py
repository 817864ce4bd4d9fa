"""`hazsan check --jobs N`: rank files analysed in parallel processes, then joined.

Every rule but one is per rank, so each rank file is analysed on its own, by the driver's
`analyze` (the same entry point `hazsan check` uses), in a pool of N processes. The one cross-rank
rule, asymmetric-offset (docs/ordering-and-rules.md), needs only each collective's window
signature (comm, seq -> the (window ordinal, offset, size) of its buffers in its communicator's
windows): each worker passes the driver a matcher (its `matcher=` seam) that records those as its
rank's engine submits them, and the parent feeds them, rank by rank, to the engine's own
`CollectiveMatcher`, so the finding is made by the same code as in a serial run.

The join gives what the serial run gives: the same findings and counts, the same per-file
warnings, errors and summary. Two differences, both where the serial run is bounded in memory:
when a rule and call site has more than --max-per-group findings, which of them are listed may
differ (the counts do not); and every collective is matched against every rank, however far the
ranks drift apart (the serial matcher keeps at most 1,000,000 settled references; a rank later
than that counts as unmatched). When the lowest rank first uses a communicator after the others
have compared collectives on it, the serial run reports the finding against the lowest rank
already there, --jobs against the lowest rank (docs/ordering-and-rules.md).
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed

from sanitizer.limits import Limits
from sanitizer.order import ranks as ranks_mod
from sanitizer.rules import driver, select
from sanitizer.rules.driver import Analysis
from sanitizer.rules.findings import Finding, FindingSink
from sanitizer.trace import runs
from sanitizer.trace.reader import TraceError

# Warnings the driver computes over all files at once: recomputed after the join.
_AGGREGATE_WARNINGS = ("--lenient: skipped ", " more malformed line(s) not listed",
                       " repeated finding(s) counted but not listed",
                       " collective(s) were not seen on every rank",
                       "running the interpreted engine: ")


class _OpView:
    """A collective as OpRecord.of reads it, rebuilt in the parent from plain data."""

    __slots__ = ("kind", "name", "stream", "line", "step", "site", "stack", "cid", "comm", "seq",
                 "captured")

    def __init__(self, kind, name, stream, line, step, site, stack, cid, comm, seq, captured_line):
        self.kind, self.name, self.stream, self.line, self.step = kind, name, stream, line, step
        self.site, self.stack, self.cid, self.comm, self.seq = site, stack, cid, comm, seq
        self.captured = None if captured_line is None else _Line(captured_line)


class _Line:
    __slots__ = ("line",)

    def __init__(self, line):
        self.line = line


class _RankView:
    """The analyzer as the matcher sees it: rank, file, and the step at submission time."""

    __slots__ = ("rank", "file", "step")

    def __init__(self, rank, file):
        self.rank, self.file, self.step = rank, file, None


class SignatureRecorder:
    """The matcher a worker gives the driver: keeps every submitted collective as plain data.

    The data travels to the parent pickled, and the parent unpickles it alone, serially: equal
    values (a communicator, a signature, an op name, a call site: the same for most collectives of
    a rank) are kept as one object, which pickle writes once and then references. On the decode
    trace that makes a 1M-event rank's collectives 1.5 MB instead of 5.2, pickled in a quarter and
    unpickled in half the time."""

    def __init__(self, sink=None, enabled: bool = True, ranks=None):
        # (comm, seq, sig, step at submission, (kind, name, stream, line, step, site, stack, cid,
        # captured line)): _OpView's arguments but comm and seq, which are the collective's own
        self.colls: list[tuple] = []
        self.unmatched = 0
        self.same: dict = {}

    def submit(self, analyzer, comm, seq, op, sig) -> None:
        captured = op.captured
        one = self.same.setdefault
        site = op.site
        self.colls.append((one(comm, comm), seq, one(sig, sig), analyzer.step,
                           (op.kind, one(op.name, op.name), one(op.stream, op.stream), op.line, op.step,
                            site if site is None else one(site, site), op.stack, op.cid,
                            None if captured is None else captured.line)))

    def end_round(self) -> None:
        pass

    def rank_finished(self, rank) -> None:
        pass

    def finish(self) -> None:
        pass


def analyze_one(path: str, peer_completion: str, lenient: bool, max_per_group: int, max_errors: int,
                engine: str | None, limits: Limits, suppress=None, extra_done: dict | None = None):
    """Worker: one rank file, within `limits` (the parent's, passed as a value: spawned workers
    and Dask's share no module state with it). Returns plain data (TraceError does not survive
    pickling). `extra_done`: the driver's (a rank analysed again, its sends ordered complete by the
    ranks' messages: `order_across_ranks`)."""
    recorder = SignatureRecorder()
    a = driver.analyze([path], peer_completion=peer_completion, lenient=lenient,
                       max_per_group=max_per_group, max_errors=max_errors, engine=engine,
                       matcher=lambda sink, enabled, ranks=None: recorder, limits=limits, suppress=suppress,
                       extra_done=extra_done)
    errors = [(e.path, e.line, e.message) if isinstance(e, TraceError) else (path, None, str(e))
              for e in a.errors]
    steps = a.summary.get("steps_by_rank", {})
    rank = next(iter(steps), None)
    return path, rank, a.findings, a.summary, errors, a.warnings, recorder.colls


def _pool_context():
    # fork: the workers start without importing anything again (the parent holds no threads)
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def progress_bar(total_bytes: int, enabled: bool | None):
    """A tqdm bar on stderr when it is a terminal (and tqdm is installed), else None."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    try:
        width = os.get_terminal_size(sys.stderr.fileno()).columns
    except (OSError, ValueError):
        width = 0
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="hazsan check", file=sys.stderr,
                leave=False, ncols=width or 80, mininterval=0.5)


def analyze_parallel(paths, *, jobs: int, peer_completion: str = "local", lenient: bool = False,
                     max_per_group: int = 100, max_errors: int = 50, progress: bool | None = None,
                     engine: str | None = None, limits: Limits | None = None, run: str | None = None,
                     suppress=None) -> Analysis:
    """The driver's `analyze`, with rank files analysed in `jobs` processes and joined. The files
    are those of one run (sanitizer.trace.runs; runs.SeveralRuns is raised as by `analyze`)."""
    limits = limits or Limits()
    notes: list[str] = []
    try:
        chosen, notes = runs.choose(paths, run)
        files = [str(p) for p in chosen]
    except runs.SeveralRuns:
        raise
    except TraceError:
        files = []
    try:
        eng, engine_kind, fallback = select.load_engine(engine)
    except (ValueError, RuntimeError):
        eng = None                     # the serial run reports it, as an error
    if jobs <= 1 or len(files) <= 1 or eng is None or peer_completion not in ("local", "successor"):
        return driver.analyze(paths, peer_completion=peer_completion, lenient=lenient,
                              max_per_group=max_per_group, max_errors=max_errors, engine=engine, limits=limits,
                              run=run, suppress=suppress)
    sizes = {}
    for f in files:
        try:
            sizes[f] = os.path.getsize(f)
        except OSError:
            sizes[f] = 0
    bar = progress_bar(sum(sizes.values()), progress)
    results = {}
    # the results are many small objects without cycles (as in analyze): no cyclic GC passes
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        with ProcessPoolExecutor(max_workers=min(jobs, len(files)), mp_context=_pool_context()) as pool:
            futures = [pool.submit(analyze_one, f, peer_completion, lenient, max_per_group, max_errors,
                                   engine_kind, limits, suppress)
                       for f in files]
            for fut in as_completed(futures):
                res = fut.result()
                results[res[0]] = res
                if bar is not None:
                    bar.update(sizes.get(res[0], 0))
            parts = [results[f] for f in files]

            def run_map(fn, calls):
                return [f.result() for f in [pool.submit(fn, *args) for args in calls]]

            def rerun(path, extra):
                return pool.submit(analyze_one, path, peer_completion, lenient, max_per_group, max_errors,
                                   engine_kind, limits, suppress, extra)

            parts = across_ranks(parts, run_map, rerun, limits)
        joined = join(parts, max_per_group=max_per_group, max_errors=max_errors,
                      engine=eng, engine_kind=engine_kind, fallback=fallback, suppress=suppress)
        joined.warnings[:0] = notes
        joined.files = files
        return joined
    finally:
        if bar is not None:
            bar.close()
        if was_enabled:
            gc.enable()


def across_ranks(parts: list, run_map, rerun, limits: Limits | None = None) -> list:
    """The per-file results with the ranks' messages' order (driver.order_across_ranks;
    docs/ordering-and-rules.md, "Ordering across ranks"): a rank whose sends in flight they order
    complete is analysed again (`rerun(path, extra_done)`: a future of analyze_one's result) and its
    result replaces the first one, but for its collectives' signatures (asymmetric-offset is the
    first analysis's); then findings still on a send to a rank of the check get the note.
    `run_map(fn, [args, ...])`: the light scans, in the same pool. Nothing is read, and the parts
    are returned as they are, where no finding is about such a send."""
    files: dict = {}
    for path, rank, *_ in parts:
        if rank is None:
            continue
        if rank in files:
            files = {}                      # a rank twice: which file is the peer is unknown
            break
        files[rank] = path
    if len(files) < 2 or len(files) != len(parts):
        for p in parts:
            p[3].pop("_p2p_ops", None)
        return parts
    p2p_ops = [item for p in parts for item in p[3].pop("_p2p_ops", ())]
    redo = driver.order_across_ranks(p2p_ops, files, run_map, limits)
    if redo:
        futures = {path: rerun(path, extra) for path, extra in redo.items()}
        parts = [(*futures[p[0]].result()[:6], p[6]) if p[0] in futures else p for p in parts]
        for p in parts:
            p[3].pop("_p2p_ops", None)
    ranks_mod.annotate([f for p in parts for f in p[2]], files)
    return parts


def _finding_order(f: Finding):
    return (0 if f.severity == "error" else 1, f.rule, f.rank, f.file, f.line)


def join(parts, *, max_per_group: int, max_errors: int, engine, engine_kind: str,
         fallback: str | None, suppress=None) -> Analysis:
    """One Analysis from per-file results (in file order), as the driver's analyze would give.
    `engine`: the engine module whose CollectiveMatcher makes the cross-rank findings."""
    warnings: list[str] = [f"running the interpreted engine: {fallback}"] if fallback else []
    ranks_seen: dict = {}
    for path, rank, *_ in parts:
        if rank is None:
            continue
        if rank in ranks_seen:
            warnings.append(f"{path}: rank {rank} also in {ranks_seen[rank]}; asymmetric-offset is checked per distinct rank")
        ranks_seen.setdefault(rank, path)
    opened = [p for p in parts if p[1] is not None]   # files whose header could be read

    # asymmetric-offset: a collective seen on every rank of its communicator with one signature
    # gives nothing; every other one goes to the engine's own matcher, which makes the findings.
    cross = FindingSink(max_per_group=0, suppress=suppress)
    matcher = engine.CollectiveMatcher(cross, enabled=len(ranks_seen) > 1 and len(ranks_seen) == len(opened))
    unmatched = 0
    if matcher.enabled:
        members: dict = {}
        sigs: dict = {}          # (comm, seq) -> [signature, ranks seen, all equal so far]
        for path, rank, *_rest, colls in opened:
            for comm, seq, sig, *_ in colls:
                members.setdefault(comm, set()).add(rank)
                entry = sigs.get((comm, seq))
                if entry is None:
                    sigs[(comm, seq)] = [sig, 1, True]
                else:
                    entry[1] += 1
                    if entry[2] and sig != entry[0]:
                        entry[2] = False
        suspects = set()
        for key, (_, seen, equal) in sigs.items():
            if seen < len(members[key[0]]):
                unmatched += 1
            if not equal:
                suspects.add(key)
        if suspects:
            for path, rank, *_rest, colls in opened:
                an = _RankView(rank, path)
                for comm, seq, sig, step, op in colls:
                    if (comm, seq) in suspects:
                        an.step = step
                        kind, name, stream, line, op_step, site, stack, cid, captured_line = op
                        matcher.submit(an, comm, seq, _OpView(kind, name, stream, line, op_step, site, stack,
                                                              cid, comm, seq, captured_line), sig)
            matcher.finish()

    by_rule: dict[str, int] = {}
    every: list[Finding] = []
    events = skipped = drops = hook_errors = malformed = available = 0
    steps_by_rank: dict = {}
    suppressed: dict = dict(cross.suppressed)
    errors: list[TraceError] = []
    for path, rank, findings, summary, errs, warns, _ in parts:
        for rule, n in summary.get("suppressed_by_rule", {}).items():
            suppressed[rule] = suppressed.get(rule, 0) + n
        every.extend(findings)
        for rule, n in summary.get("by_rule", {}).items():
            by_rule[rule] = by_rule.get(rule, 0) + n
        events += summary.get("events", 0)
        skipped += summary.get("skipped_lines", 0)
        drops += summary.get("dropped_events", 0)
        hook_errors += summary.get("hook_errors", 0)
        malformed += summary.get("malformed", 0)
        # errors the serial run could have listed: every malformed line, or the file's open error
        available += summary.get("malformed", 0) if rank is not None else len(errs)
        steps_by_rank.update(summary.get("steps_by_rank", {}))
        warnings.extend(w for w in warns if not any(tag in w for tag in _AGGREGATE_WARNINGS))
        for epath, line, message in errs:
            errors.append(TraceError(epath, line, message))
    for rule, n in cross.by_rule.items():
        by_rule[rule] = by_rule.get(rule, 0) + n
    every.extend(cross.findings)

    # at most max_per_group listed per rule and call site, in report order
    every.sort(key=_finding_order)
    listed: list[Finding] = []
    per_group: dict = {}
    for f in every:
        key = f.group_key()
        n = per_group[key] = per_group.get(key, 0) + 1
        if not max_per_group or n <= max_per_group:
            listed.append(f)
    total = sum(by_rule.values())
    omitted = total - len(listed)
    listed_errors = errors[:max_errors]

    if unmatched:
        warnings.append(f"{unmatched} collective(s) were not seen on every rank of their communicator")
    if skipped:
        warnings.append(f"--lenient: skipped {skipped} malformed line(s)")
    if available > len(listed_errors):
        warnings.append(f"{available - len(listed_errors)} more malformed line(s) not listed")
    if omitted:
        warnings.append(f"{omitted} repeated finding(s) counted but not listed (max {max_per_group} per rule and call site)")
    summary = {
        "events": events,
        "ranks": sum(1 for p in opened if p[1] >= 0),
        "unranked": sum(1 for p in opened if p[1] < 0),
        "engine": engine_kind,
        "by_rule": dict(sorted(by_rule.items())),
        "findings": total,
        "listed": len(listed),
        "skipped_lines": skipped,
        "dropped_events": drops,
        "hook_errors": hook_errors,
        "warnings": warnings,
        "malformed": malformed,
        "steps_by_rank": steps_by_rank,
        "suppressed": sum(suppressed.values()),
        "suppressed_by_rule": dict(sorted(suppressed.items())),
    }
    return Analysis(listed, summary, listed_errors, warnings)
