"""One side of the comparison: a run directory's traces analysed, indexed by rank and step, and
its request outcomes matched against the findings.

Units. A *decode step* is a step number `n` seen in a `step` event on any rank (ranks of one run
step together, so step n on rank 0 and on rank 1 is one unit). A step is *affected* when any rank
has a finding in it. `transient-in-window` is reported by the engine once per call site (count and
bytes, step of the first occurrence), so it enters totals and the clean/not-clean judgement but
not the per-step or per-request counts; every other rule is one finding per event and is placed
at the step of that event. Findings before the first `step` event are "outside any step".
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from sanitizer.proof.outcomes import OUTCOME_NAMES, Outcome, find_outcomes, read_outcomes
from sanitizer.rules.findings import ERROR, LATENT_ONLY, RULES, Finding

AGGREGATED_RULES = frozenset({"transient-in-window"})  # one finding per site, not per event


class RunError(Exception):
    """A run directory that cannot be used (missing, no traces). Names the path."""


def trace_files(run_dir: Path) -> list[Path]:
    """The rank traces of a run directory: every *.jsonl, *.hzs (or either .gz) except the outcomes file."""
    from sanitizer.trace.schema import is_trace_name

    if not run_dir.is_dir():
        raise RunError(f"{run_dir}: not a directory (give one run's trace directory)")
    files = sorted(p for p in run_dir.iterdir() if p.is_file() and p.name not in OUTCOME_NAMES
                   and is_trace_name(p.name))
    if not files:
        raise RunError(f"{run_dir}: no *.jsonl, *.hzs or .gz trace files")
    return files


def step_census(paths) -> dict[int, set[int]]:
    """rank -> the step numbers its trace announces. Unusable files are left to the engine to report."""
    from sanitizer.trace.reader import TraceError, open_trace

    steps: dict[int, set[int]] = {}
    for p in paths:
        try:
            tf = open_trace(p)
        except TraceError:
            continue
        mine = steps.setdefault(tf.rank, set())
        for _, ev in tf.events():
            if type(ev) is dict and ev.get("ev") == "step" and type(ev.get("n")) is int:
                mine.add(ev["n"])
    return steps


class FindingIndex:
    """Findings by rank and step, for "is there one in steps lo..hi" and "one at or before s"."""

    def __init__(self, findings: list[Finding]):
        self.by_step: dict[int, Counter] = {}  # global step -> rule -> count
        self._by_rank: dict[int, dict[int, Counter]] = {}
        self.outside: Counter = Counter()  # step None
        self.aggregated: list[Finding] = []
        for f in findings:
            if f.rule in AGGREGATED_RULES:
                self.aggregated.append(f)
            elif f.step is None:
                self.outside[f.rule] += 1
            else:
                self.by_step.setdefault(f.step, Counter())[f.rule] += 1
                self._by_rank.setdefault(f.rank, {}).setdefault(f.step, Counter())[f.rule] += 1
        self._sorted = {r: sorted(s) for r, s in self._by_rank.items()}
        self._all = sorted(self.by_step)

    def _steps(self, rank: int | None) -> list[int]:
        return self._all if rank is None else self._sorted.get(rank, [])

    def in_range(self, rank: int | None, lo: int, hi: int) -> Counter:
        """Rule counts on `rank` (None: every rank) in steps lo..hi inclusive."""
        steps = self._steps(rank)
        out: Counter = Counter()
        for s in steps[bisect_left(steps, lo):bisect_right(steps, hi)]:
            out.update(self.by_step[s] if rank is None else self._by_rank[rank][s])
        return out

    def latest_at_or_before(self, rank: int | None, step: int) -> int | None:
        steps = self._steps(rank)
        i = bisect_right(steps, step)
        return steps[i - 1] if i else None


@dataclass
class RequestResult:
    outcome: Outcome
    findings: Counter  # rule -> count within the request's steps on its rank
    preceded_at: int | None  # latest step <= outcome.step with a finding on its rank
    preceded_any_rank_at: int | None

    @property
    def affected(self) -> bool:
        return bool(self.findings)

    def to_dict(self) -> dict:
        o = self.outcome
        return {"request": o.request, "rank": o.rank, "step": o.step, "first_step": o.first_step,
                "corrupted": o.corrupted, "findings": dict(sorted(self.findings.items())),
                "preceded_by_finding": self.preceded_at is not None, "finding_step": self.preceded_at,
                "preceded_on_any_rank": self.preceded_any_rank_at is not None, **({"extra": o.extra} if o.extra else {})}


@dataclass
class RunEvidence:
    """Everything `compare` needs about one run."""

    label: str
    directory: Path
    files: list[Path]
    analysis: object  # sanitizer.rules.driver.Analysis
    steps_by_rank: dict[int, set[int]]
    outcomes_file: Path | None
    requests: list[RequestResult] | None
    index: FindingIndex = field(repr=False, default=None)

    # --- units -------------------------------------------------------------------------
    @property
    def steps(self) -> set[int]:
        out: set[int] = set()
        for s in self.steps_by_rank.values():
            out |= s
        # A finding in a step the census missed (a step event dropped) still names a step.
        return out | set(self.index.by_step)

    def affected_steps(self, severities=(ERROR, "warning"), realised_only: bool = False) -> set[int]:
        """Steps with a finding of those severities; `realised_only`: of a rule that flags more than
        a hazard's cause (findings.LATENT_ONLY left out: `steps_realised`)."""
        return {s for s, rules in self.index.by_step.items()
                if any(RULES[r][0] in severities and not (realised_only and r in LATENT_ONLY) for r in rules)}

    # --- totals ------------------------------------------------------------------------
    @property
    def by_rule(self) -> dict[str, int]:
        """Findings per rule as the engine counted them (transient-in-window: per site)."""
        return dict(self.analysis.summary.get("by_rule", {}))

    def transient_occurrences(self) -> tuple[int, int, int]:
        """(frees, bytes, call sites) of transient-in-window."""
        fs = self.index.aggregated
        return sum(f.count for f in fs), sum(f.bytes for f in fs), len(fs)

    def findings_at_or_above(self, severity: str, realised_only: bool = False) -> int:
        wanted = (ERROR,) if severity == ERROR else (ERROR, "warning")
        return sum(n for r, n in self.by_rule.items() if RULES.get(r, ("error",))[0] in wanted
                   and not (realised_only and r in LATENT_ONLY))

    @property
    def capture_incomplete(self) -> list[str]:
        s = self.analysis.summary
        out = []
        if s.get("dropped_events"):
            out.append(f"capture dropped {s['dropped_events']} event(s)")
        if s.get("hook_errors"):
            out.append(f"{s['hook_errors']} capture hook error(s)")
        if s.get("skipped_lines"):
            out.append(f"{s['skipped_lines']} malformed line(s) skipped (--lenient)")
        if any("trace truncated" in w for w in self.analysis.warnings):
            out.append("a trace was cut short")
        return out

    @property
    def corrupted(self) -> list[RequestResult]:
        return [r for r in self.requests or () if r.outcome.corrupted]


def load_run(label: str, run_dir, *, peer_completion: str = "local", lenient: bool = False) -> RunEvidence:
    """Analyse a run directory. Raises RunError / OutcomeError on unusable input; trace errors are
    left in `analysis.errors` (the caller reports them and exits 2)."""
    from sanitizer.rules.driver import analyze

    run_dir = Path(run_dir)
    files = trace_files(run_dir)
    # max_per_group=0: every finding is kept, the per-step counts must be exact.
    analysis = analyze(files, peer_completion=peer_completion, lenient=lenient, max_per_group=0)
    index = FindingIndex(analysis.findings)
    outcomes_file = find_outcomes(run_dir)
    requests = None
    if outcomes_file is not None:
        requests = [RequestResult(o, index.in_range(o.rank, *o.steps), index.latest_at_or_before(o.rank, o.step),
                                  index.latest_at_or_before(None, o.step))
                    for o in read_outcomes(outcomes_file)]
    return RunEvidence(label, run_dir, files, analysis, step_census(files), outcomes_file, requests, index)
