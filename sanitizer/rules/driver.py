"""`analyze`: everything around the algorithm (docs/cli.md, "hazsan check").

Finds the rank files, opens them, takes the engine sanitizer.rules.select picks (compiled or
interpreted, the same source), reads the ranks round-robin a batch at a time, decodes each batch into typed events
(sanitizer.trace.events), feeds them to each rank's engine, and builds the summary. The algorithm
itself is sanitizer.rules.engine's.

The summary's `engine` says which one ran.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass, field

from sanitizer.limits import Limits
from sanitizer.order import ranks as ranks_mod
from sanitizer.rules.findings import ERROR, Finding, FindingSink
# engine choice, re-exported: callers and tests name it here
from sanitizer.rules.select import CHOICES, ENV, REQUIRE_ENV, compiled_available, load_engine  # noqa: F401
from sanitizer.trace import runs
from sanitizer.trace.events import CollDone
from sanitizer.trace.reader import TraceError, TraceFile, TypedEvents, open_trace

BATCH = 4096  # lines read from one rank before moving to the next
# Lines decoded and applied at a time. The decoded events of a chunk are freed together; a small
# chunk keeps that memory inside the allocator's pools (4096 at a time cost a third more time,
# measured on the 1M-event decode trace).
CHUNK = 512


# ----------------------------------------------------------------------------- the run


@dataclass
class Analysis:
    """What `analyze` returns: the findings and a summary (docs/cli.md, "hazsan check": the json format)."""

    findings: list[Finding]
    summary: dict
    errors: list[TraceError] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: the trace files judged (of one run: sanitizer.trace.runs), in the order read
    files: list[str] = field(default_factory=list)

    def exit_code(self, fail_on: str = "error", allow_incomplete: bool = False) -> int:
        """2 unusable input; 1 a finding at or above `fail_on`; 2 no finding but a capture that
        lost events (report.render.verdict_blockers: what was lost may have held one), unless
        `allow_incomplete`; else 0."""
        if self.errors:
            return 2
        threshold = {"error": ("error",), "warning": ("error", "warning")}[fail_on]
        if any(f.severity in threshold for f in self.findings):
            return 1
        if not allow_incomplete and self.blockers():
            return 2
        return 0

    def blockers(self) -> list[str]:
        """Why no clean verdict can be given (empty: it can): see report.render.verdict_blockers."""
        from sanitizer.report.render import verdict_blockers

        return verdict_blockers(self.summary)


def new_analyzer(eng, file: str, rank: int, sink, matcher, peer_completion: str, limits: Limits):
    """`eng`'s RankAnalyzer for one rank file, holding at most what `limits` allows."""
    return eng.RankAnalyzer(file, rank, sink, matcher, peer_completion, max_streams=limits.max_streams,
                            max_events=limits.max_events, max_comms=limits.max_comms)


class RankReader:
    """One rank's file: batches of typed events (either format) applied to its engine."""

    def __init__(self, trace: TraceFile, analyzer, extra_done: dict | None = None):
        self.trace = trace
        self.analyzer = analyzer
        # the sends the ranks' messages order complete (sanitizer.order.ranks): (line, cids), the
        # last line first; a plain coll_done of each is fed right after that line
        self.extra = sorted(extra_done.items(), reverse=True) if extra_done else None
        self.injected = 0
        self.source = TypedEvents(trace, CHUNK, on_classes=self._dispatch)
        self.decoder = self.source       # .warnings(file)
        if trace.format == "binary" and trace.values is None:
            from sanitizer.trace.binary import TO_JSON_CLASS

            self._dispatch(TO_JSON_CLASS)

    def _dispatch(self, classes: dict) -> None:
        """The binary format's records are classes of their own (same fields; version 2 makes
        them per file): the engine's dispatch table gets them beside the JSON Lines ones."""
        handlers = self.analyzer.handlers
        for cls, json_cls in classes.items():
            if json_cls in handlers:
                handlers[cls] = handlers[json_cls]

    def forget(self, engine) -> None:
        """The analysis is over: the record classes made for this file leave the engine's tables."""
        for cls in self.source.forget():
            engine.KIND_CODES.pop(cls, None)
            self.analyzer.handlers.pop(cls, None)

    def _feed_with_extra(self, first: int, items: list, problems: list) -> None:
        """feed_batch, with a plain coll_done of each send in `extra` right after its line (typed
        events, as either format decodes them; not counted as events of the file)."""
        feed, extra = self.analyzer.feed_batch, self.extra
        while extra and extra[-1][0] < first + len(items):
            line, cids = extra.pop()
            cut = max(0, line - first + 1)
            if cut:
                feed(first, items[:cut], problems)
                items, first = items[cut:], first + cut
            feed(line, [CollDone(cid=cid) for cid in cids], problems)
            self.injected += len(cids)
        if items:
            feed(first, items, problems)

    def step(self, problems: list) -> None:
        """Decode and apply about BATCH events; StopIteration at the end of the file."""
        nxt, feed = self.source.next, self.analyzer.feed_batch
        if self.extra:
            feed = self._feed_with_extra
        first, items = nxt(problems)
        feed(first, items, problems)
        done = len(items)
        while done < BATCH:
            try:
                first, items = nxt(problems)
            except StopIteration:
                return
            feed(first, items, problems)
            done += len(items)


def analyze(paths, *, peer_completion: str = "local", lenient: bool = False,
            max_per_group: int = 100, max_errors: int = 50, engine: str | None = None,
            matcher=None, live=(), limits: Limits | None = None, run: str | None = None,
            suppress=None, progress: bool | None = False, extra_done: dict | None = None,
            across_ranks: bool = True) -> Analysis:
    """Analyse rank trace files (or directories of them) together.

    Malformed lines are collected as `errors` (exit 2) unless `lenient`, which skips and counts
    them. Problems that make a file unusable (missing, bad header) are errors in both modes.
    `engine`: 'compiled', 'interpreted' or 'auto' (default: $HAZSAN_ENGINE, else auto).

    `matcher`: the seam for an analysis split across processes (sanitizer.rules.parallel). A
    callable ``matcher(sink, enabled=..., ranks=...)`` returning the object every rank's engine hands each
    collective's window signature to: ``submit(analyzer, comm, seq, op, sig)`` (analyzer with
    .rank/.step/.file, op the engine's Op), ``end_round()`` after each round-robin round, ``rank_finished(rank)`` when a rank's file ends,
    ``finish()`` at the end, and an ``unmatched`` count. Default: the engine's CollectiveMatcher,
    which makes the asymmetric-offset findings.

    `live`: paths of files still being written (the pytest plugin's own file, a process still
    running): read up to their last flush, their missing end record is not a truncated trace.

    `limits`: what reading each file, and each rank in the engine, may cost (default: Limits()).

    `run`: the run to judge where the paths hold several (sanitizer.trace.runs: files of two runs
    are never judged together; of one folder's runs the newest is, and a warning says so). Paths
    holding runs in several folders raise runs.SeveralRuns: `analyze_runs` judges each.

    `suppress`: callable(finding) -> bool (allowlist.Suppressions): what it accepts is counted in the
    summary's `suppressed`, never listed or counted as a finding.

    `progress`: a bar of the bytes read on stderr (None: when stderr is a terminal; `hazsan check`).

    `across_ranks`: where a finding is about a send still in flight to another rank of the check,
    order it by the ranks' messages (sanitizer.order.ranks; docs/ordering-and-rules.md, "Ordering
    across ranks"): the ranks whose sends the messages order complete are analysed again. Off where
    a `matcher` is given (the analysis split across processes does it after the join).

    `extra_done`: {line: [cid, ...]}, for one file: a plain `coll_done` of each cid is fed right
    after that line (what `across_ranks` learnt; not counted as events).
    """
    # Millions of short-lived decoded events, no reference cycles among them: the cyclic
    # collector's passes over them cost time and find nothing.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _analyze(paths, peer_completion, lenient, max_per_group, max_errors, engine, matcher, live,
                        limits or Limits(), run, suppress, progress, extra_done,
                        across_ranks and matcher is None and not extra_done)
    finally:
        if was_enabled:
            gc.enable()


def _analyze(paths, peer_completion, lenient, max_per_group, max_errors, engine, make_matcher, live,
             limits: Limits, run: str | None, suppress=None, progress: bool | None = False,
             extra_done: dict | None = None, across: bool = False) -> Analysis:
    if peer_completion not in ("local", "successor"):
        raise ValueError("peer_completion must be 'local' or 'successor'")
    sink = RankSink(max_per_group=max_per_group, suppress=suppress)
    try:
        eng, engine_kind, fallback = load_engine(engine)
    except (ValueError, RuntimeError) as exc:
        return Analysis([], _summary(0, 0, sink, [], 0, 0, 0, None), [TraceError(ENV, None, str(exc))], [])
    errors: list[TraceError] = []
    # auto, and the compiled engine is missing: say so once (it runs at about half the speed)
    warnings: list[str] = [f"running the interpreted engine: {fallback}"] if fallback else []
    skipped = 0
    try:
        files, notes = runs.choose(paths, run)
    except runs.SeveralRuns:
        raise
    except TraceError as exc:
        return Analysis([], _summary(0, 0, sink, [], 0, 0, 0, engine_kind), [exc], [])
    warnings.extend(notes)
    traces: list[TraceFile] = []
    live = {os.path.realpath(p) for p in live}
    for p in files:
        try:
            t = open_trace(p, limits)
        except TraceError as exc:
            errors.append(exc)
            continue
        t.live = bool(live) and os.path.realpath(p) in live
        traces.append(t)
    ranks_seen: dict[int, str] = {}
    for t in traces:
        if t.rank in ranks_seen:
            warnings.append(f"{t.path}: rank {t.rank} also in {ranks_seen[t.rank]}; asymmetric-offset is checked per distinct rank")
        ranks_seen.setdefault(t.rank, str(t.path))
    matcher = (make_matcher or eng.CollectiveMatcher)(
        sink, enabled=len(ranks_seen) > 1 and len(ranks_seen) == len(traces), ranks=ranks_seen)
    readers = [RankReader(t, new_analyzer(eng, str(t.path), t.rank, sink, matcher, peer_completion, limits),
                          extra_done)
               for t in traces]
    error_total = 0
    # Round-robin over ranks, a batch at a time, so collectives meet while still fresh.
    bar = _read_progress(traces, progress)
    rounds = 0
    active = list(readers)
    while active:
        rounds += 1
        if bar is not None and rounds % 16 == 0:
            bar.update(sum(t.consumed() for t in traces) - bar.n)
        still = []
        for r in active:
            problems: list = []
            try:
                r.step(problems)
            except StopIteration:
                matcher.rank_finished(r.analyzer.rank)
                continue
            except TraceError as exc:
                errors.append(exc)
                matcher.rank_finished(r.analyzer.rank)
                continue
            finally:
                for line, problem in problems:
                    if lenient:
                        skipped += 1
                        continue
                    error_total += 1
                    if len(errors) < max_errors:
                        errors.append(TraceError(r.analyzer.file, line, problem))
            still.append(r)
        active = still
        matcher.end_round()
    if bar is not None:
        bar.close()
    matcher.finish()
    events = drops = hook_errors = 0
    for r in readers:
        a = r.analyzer
        a.finish()
        r.trace.steps_contradict(a.steps_seen)
        events += a.events - r.injected
        drops += a.counted_drops
        hook_errors += a.hook_errors
        warnings.extend(r.trace.warnings)
        warnings.extend(r.decoder.warnings(a.file))
        r.forget(eng)
        if a.unrecorded_waits:
            warnings.append(f"{a.file}: {a.unrecorded_waits} wait/sync on an event never recorded (no-op)")
        if a.counted_drops:
            warnings.append(f"{a.file}: capture dropped {a.counted_drops} event(s): findings may be missing")
        if a.hook_errors:
            warnings.append(f"{a.file}: {a.hook_errors} capture hook error(s) were caught during the run")
        warnings.extend(coverage_warnings(a.file, r.trace.header))
        if a.capturing:
            warnings.append(f"{a.file}: graph capture never ended: {[g.id for g in a.capturing]}")
    if matcher.unmatched:
        warnings.append(f"{matcher.unmatched} collective(s) were not seen on every rank of their communicator")
    if skipped:
        warnings.append(f"--lenient: skipped {skipped} malformed line(s)")
    if error_total > len(errors):
        warnings.append(f"{error_total - len(errors)} more malformed line(s) not listed")
    if across and len(ranks_seen) > 1 and len(ranks_seen) == len(traces):
        rank_files = dict(ranks_seen)   # (not `files`: the list the Analysis returns)
        redo = order_across_ranks(list(sink.p2p_ops.items()), rank_files, _serial_map, limits)
        for file, extra in redo.items():
            again = analyze([file], peer_completion=peer_completion, lenient=lenient, max_per_group=max_per_group,
                            max_errors=0, engine=engine, live=live, limits=limits, suppress=suppress,
                            extra_done=extra)
            sink.replace_file(file, again.sink)
        ranks_mod.annotate(sink.findings, rank_files)
    if sink.omitted:
        warnings.append(f"{sink.omitted} repeated finding(s) counted but not listed (max {sink.max_per_group} per rule and call site)")
    findings = sorted(sink.findings, key=_finding_order)
    summary = _summary(events, len(readers), sink, warnings, skipped, drops, hook_errors, engine_kind,
                       unranked=sum(1 for r in readers if r.analyzer.rank < 0))
    summary["malformed"] = error_total
    summary["steps_by_rank"] = {r.analyzer.rank: sorted(r.analyzer.steps_seen) for r in readers}
    if not across and make_matcher is not None and sink.p2p_ops:
        summary["_p2p_ops"] = list(sink.p2p_ops.items())   # for the parent's order_across_ranks
    out = Analysis(findings, summary, errors, warnings, [str(f) for f in files])
    out.sink = sink
    return out


class RankSink(FindingSink):
    """The serial run's FindingSink, which also counts per file: a rank analysed again with what
    the ranks' messages ordered (order_across_ranks) replaces its findings and counts."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.per_file: dict = {}      # file -> {("rule", rule) | ("group", key) | ("suppressed", rule): n}
        self.p2p_ops: dict = {}       # (rank, cid) -> OpRecord: the point-to-point ops of findings

    def add(self, finding: Finding) -> None:
        counts = self.per_file.get(finding.file)
        if counts is None:
            counts = self.per_file[finding.file] = {}
        if self.suppress is not None and self.suppress(finding):
            key = ("suppressed", finding.rule)
        else:
            key = ("rule", finding.rule)
            gkey = ("group", finding.group_key())
            counts[gkey] = counts.get(gkey, 0) + 1
            op = finding.op
            if op is not None and op.kind == "coll" and isinstance(op.comm, str) and ":p2p:" in op.comm:
                # a point-to-point op, listed or not: order_across_ranks asks about every one
                self.p2p_ops.setdefault((finding.rank, op.cid), op)
        counts[key] = counts.get(key, 0) + 1
        FindingSink.add(self, finding)

    def replace_file(self, file: str, other: "RankSink") -> None:
        """`file`'s findings and counts are `other`'s (its analysis alone). Counts stay exact; where a
        rule and call site has more than max_per_group findings, those of other files that were
        counted but not listed stay unlisted."""
        old = self.per_file.pop(file, {})
        self.findings = [f for f in self.findings if f.file != file]
        for (what, key), n in old.items():
            table = {"rule": self.by_rule, "group": self.group_counts, "suppressed": self.suppressed}[what]
            table[key] -= n
            if not table[key]:
                del table[key]
        listed: dict = {}
        for f in self.findings:
            k = f.group_key()
            listed[k] = listed.get(k, 0) + 1
        new = other.per_file.get(file, {})
        self.per_file[file] = dict(new)
        for (what, key), n in new.items():
            table = {"rule": self.by_rule, "group": self.group_counts, "suppressed": self.suppressed}[what]
            table[key] = table.get(key, 0) + n
        for f in other.findings:
            k = f.group_key()
            n = listed.get(k, 0)
            if not self.max_per_group or n < self.max_per_group:
                self.findings.append(f)
                listed[k] = n + 1
        self.omitted = sum(self.by_rule.values()) - len(self.findings)


def _serial_map(fn, calls):
    return [fn(*args) for args in calls]


def order_across_ranks(p2p_ops, files: dict, run_map, limits: Limits | None = None) -> dict:
    """{file: {line: [cid, ...]}}: the sends in flight that findings are about and that the ranks'
    messages order complete (sanitizer.order.ranks), for the files to analyse again. `p2p_ops`:
    ((rank, cid), OpRecord) of every finding's point-to-point op, listed or not (RankSink.p2p_ops);
    `files`: rank -> file, every rank once; `run_map(fn, [args, ...])`: fn(*args) for each, in a
    pool or not, the results in order. Empty, reading nothing, where no finding is about a send to
    a rank of the check."""
    wanted = ranks_mod.candidates(p2p_ops, files)
    if not wanted:
        return {}
    rank_of = {file: rank for rank, file in files.items()}
    needed: dict = {}
    for file, cids in wanted.items():
        needed.setdefault(rank_of[file], set()).update(cids)
        for peer in cids.values():
            needed.setdefault(peer, set())
    order = sorted(needed)
    got = run_map(ranks_mod.scan, [(files[r], sorted(needed[r], key=repr), limits) for r in order])
    return ranks_mod.settle(dict(zip(order, got)), wanted, rank_of)


def _read_progress(traces, enabled: bool | None):
    """A progress bar of the bytes the files hold, or None (not asked, not a terminal, no tqdm)."""
    if enabled is False:
        return None
    from sanitizer.rules.parallel import progress_bar

    total = 0
    for t in traces:
        try:
            total += os.path.getsize(t.path)
        except OSError:
            pass
    return progress_bar(total, enabled)


def coverage_warnings(file: str, header: dict) -> list[str]:
    """The header's `coverage` (capture/collective_state.py: CoverageGaps) as warnings: collectives
    the process could issue, or did issue, that capture could not record. Hazards on their
    buffers are not checked; saying so is the point (never silence)."""
    cov = header.get("coverage") if isinstance(header, dict) else None
    if not isinstance(cov, dict):
        return []
    out = []
    for gap in cov.get("unseen") or []:
        out.append(f"{file}: coverage: {gap}")
    unrecorded = cov.get("unrecorded")
    if isinstance(unrecorded, dict) and unrecorded:
        calls = ", ".join(f"{name} x{n}" for name, n in unrecorded.items())
        out.append(f"{file}: coverage: {sum(v for v in unrecorded.values() if isinstance(v, int))} "
                   f"collective call(s) capture could not record ({calls}): hazards on their "
                   "buffers are not checked")
    return out


def _finding_order(f: Finding):
    return (0 if f.severity == ERROR else 1, f.rule, f.rank, f.file, f.line)


def _summary(events, files, sink, warnings, skipped, drops, hook_errors, engine_kind, unranked: int = 0) -> dict:
    """`ranks`: the files of ranks; `unranked`: those of processes without one (a launcher such as
    mp.spawn's parent or torchrun, a program that is not distributed: header rank -PID)."""
    return {
        "events": events,
        "ranks": files - unranked,
        "unranked": unranked,
        "engine": engine_kind,
        "by_rule": dict(sorted(sink.by_rule.items())),
        "findings": sum(sink.by_rule.values()),
        "listed": len(sink.findings),
        "skipped_lines": skipped,
        "dropped_events": drops,
        "hook_errors": hook_errors,
        "warnings": warnings,
        "malformed": 0,
        "steps_by_rank": {},
        "suppressed": sum(sink.suppressed.values()),
        "suppressed_by_rule": dict(sorted(sink.suppressed.items())),
    }


def analyze_runs(paths, analyze_fn=None, **kwargs) -> Analysis:
    """`analyze_fn(paths, **kwargs)` (default `analyze`); where the paths hold runs in several
    folders (runs.SeveralRuns: the pytest plugin's session folder), each run judged on its own and
    the verdicts joined: findings of every run, summed counts, and `runs` in the summary."""
    analyze_fn = analyze_fn or analyze
    try:
        return analyze_fn(paths, **kwargs)
    except runs.SeveralRuns as exc:
        several = exc.runs
    kwargs.pop("run", None)
    parts = [analyze_fn([str(f) for f in r.files], **kwargs) for r in several]
    return join_runs(parts, [r.label() for r in several])


def join_runs(parts: list[Analysis], labels: list[str]) -> Analysis:
    """Analyses of separate runs as one report (never one verdict over their events together)."""
    findings = sorted((f for a in parts for f in a.findings), key=_finding_order)
    summary: dict = {"runs": labels, "engine": parts[0].summary.get("engine") if parts else None}
    for key in ("events", "ranks", "unranked", "findings", "listed", "skipped_lines", "dropped_events",
                "hook_errors", "malformed", "suppressed"):
        summary[key] = sum(a.summary.get(key, 0) or 0 for a in parts)
    by_rule: dict[str, int] = {}
    for a in parts:
        for rule, n in a.summary.get("by_rule", {}).items():
            by_rule[rule] = by_rule.get(rule, 0) + n
    summary["by_rule"] = dict(sorted(by_rule.items()))
    warnings = [f"judged {len(parts)} runs, each on its own: " + "; ".join(labels)]
    warnings += [w for a in parts for w in a.warnings]
    summary["warnings"] = warnings
    summary["steps_by_rank"] = {}
    for a in parts:
        for rank, steps in a.summary.get("steps_by_rank", {}).items():
            summary["steps_by_rank"].setdefault(rank, []).extend(steps)
    return Analysis(findings, summary, [e for a in parts for e in a.errors], warnings,
                    [f for a in parts for f in a.files])
