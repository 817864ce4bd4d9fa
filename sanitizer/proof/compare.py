"""Stock vs fixed: the measures, their statistics and the verdict.

Measures (each a count k of n units per side):

| name | unit | k counts |
|---|---|---|
| `steps` | decode step | steps with a finding of any per-event rule on any rank |
| `steps_realised` | decode step | steps with a finding of a rule that flags more than a hazard's cause (every rule but free-in-flight and transient-in-window: findings.LATENT_ONLY) |
| `requests` | request (outcomes files on both sides) | requests with a finding on their rank in their steps |
| `corrupted` | request (outcomes files on both sides) | requests whose output differed from the reference |

The verdict: the fix is *confirmed* (exit 0) when both
1. the fixed side is clean: no finding at or above `fail_on` (transient-in-window and findings
   outside any step included), no corrupted request, and a complete capture (no dropped events,
   hook errors, skipped lines or cut-short traces, which would make "zero" meaningless); and
2. the difference is significant: Fisher's exact test, one-sided (stock rate higher), on the
   primary measure gives p < alpha.
Otherwise exit 1. The statistics for every measure are reported either way.

Runs without decode steps. The step measures (and `requests`, whose findings are placed by step)
count nothing when a side's traces carry no `step` event (a small program that never called
`sanitizer.step(n)`): 0 of 0 steps, no rate, no test. Then the verdict is judged on *findings*
(`basis` "findings"): confirmed when the fixed side is clean (as above) and the stock side has at
least one finding at or above `fail_on` (of a realised rule for `steps_realised`): the fix removes what the
stock run showed. That compares one run of each; it is not a statistical test and bounds no rate,
and the verdict text says so, and how to mark steps. The same holds when only one side marks
steps (their per-step rates cannot be compared), which the verdict names. `corrupted` does not
depend on steps and keeps its test.
"""
from __future__ import annotations

from dataclasses import dataclass

from sanitizer.proof.run import RunEvidence
from sanitizer.proof.stats import FisherResult, Rate, fisher
from sanitizer.rules.findings import ERROR, RULES

# The measures whose units are decode steps or whose counts are placed by step: meaningless on a
# side whose traces mark no step.
STEP_MEASURES = frozenset({"steps", "steps_realised", "requests"})

STEP_HOWTO = ("mark decode steps with `sanitizer.step(n)` (`with sanitizer.step(n): ...`), "
              "i.e. the trace's `step` event, for per-step rates and Fisher's test")

MEASURES: dict[str, str] = {
    "steps": "decode steps with any finding",
    "steps_realised": "decode steps with a realised hazard (not only its latent cause)",
    "requests": "requests with a finding in their steps",
    "corrupted": "corrupted requests (output check)",
}


@dataclass
class Measure:
    name: str
    description: str
    stock: Rate
    fixed: Rate
    test: FisherResult


def _wanted(severity: str) -> tuple[str, ...]:
    return (ERROR,) if severity == ERROR else (ERROR, "warning")


def _rules_at_or_above(side: RunEvidence, severity: str) -> str:
    """"rule count, ..." of the side's findings at or above `severity`."""
    return ", ".join(f"{r} {c}" for r, c in sorted(side.by_rule.items())
                     if RULES.get(r, (ERROR,))[0] in _wanted(severity))


def _rate(side: RunEvidence, name: str) -> Rate | None:
    if name == "steps":
        return Rate(len(side.affected_steps()), len(side.steps))
    if name == "steps_realised":
        return Rate(len(side.affected_steps(realised_only=True)), len(side.steps))
    if side.requests is None:
        return None
    if name == "requests":
        return Rate(sum(r.affected for r in side.requests), len(side.requests))
    return Rate(len(side.corrupted), len(side.requests))


@dataclass
class Comparison:
    stock: RunEvidence
    fixed: RunEvidence
    primary: str = "steps"
    alpha: float = 0.05
    fail_on: str = "warning"

    def __post_init__(self):
        if self.primary not in MEASURES:
            raise ValueError(f"unknown measure {self.primary!r}")
        if not 0 < self.alpha < 1:
            raise ValueError("alpha must be between 0 and 1")
        self._steps_marked = {"stock": len(self.stock.steps), "fixed": len(self.fixed.steps)}
        self.measures: list[Measure] = []
        for name, desc in MEASURES.items():
            s, f = _rate(self.stock, name), _rate(self.fixed, name)
            if s is not None and f is not None:
                self.measures.append(Measure(name, desc, s, f, fisher(s, f)))

    @property
    def confidence(self) -> float:
        return 1 - self.alpha

    def measure(self, name: str) -> Measure | None:
        return next((m for m in self.measures if m.name == name), None)

    # --- the two conditions -------------------------------------------------------------
    def fixed_problems(self) -> list[str]:
        """Why the fixed side is not clean; empty when it is."""
        f = self.fixed
        out = []
        n = f.findings_at_or_above(self.fail_on)
        if n:
            out.append(f"{n} finding(s) at or above {self.fail_on} ({_rules_at_or_above(f, self.fail_on)})")
        if f.corrupted:
            out.append(f"{len(f.corrupted)} corrupted request(s)")
        out.extend(f.capture_incomplete)
        return out

    @property
    def fixed_clean(self) -> bool:
        return not self.fixed_problems()

    @property
    def primary_measure(self) -> Measure | None:
        return self.measure(self.primary)

    # --- what the verdict rests on ------------------------------------------------------
    @property
    def steps_marked(self) -> dict[str, int]:
        """Decode steps per side (0: the side's traces carry no `step` event)."""
        return dict(self._steps_marked)

    @property
    def basis(self) -> str:
        """"statistics": Fisher's test on the primary measure; "findings": the primary measure
        counts decode steps (or places findings by step) and a side marks none, so the verdict
        compares the findings themselves."""
        if (self.primary in STEP_MEASURES and self.primary_measure is not None
                and not all(self.steps_marked.values())):
            return "findings"
        return "statistics"

    @property
    def stock_severity(self) -> str:
        """What the stock side must show for the fix to have something to remove (findings basis)."""
        return ERROR if self.primary == "steps_realised" else self.fail_on

    @property
    def stock_findings(self) -> int:
        return self.stock.findings_at_or_above(self.stock_severity, realised_only=self.primary == "steps_realised")

    def steps_note(self) -> str | None:
        """Why per-step statistics are missing and how to get them; None when both sides mark decode steps."""
        gap = self._steps_gap()
        return None if gap is None else f"{gap}; {STEP_HOWTO}"

    def _steps_gap(self) -> str | None:
        marked = self.steps_marked
        if all(marked.values()):
            return None
        if not any(marked.values()):
            return ("no decode steps were marked on either side (no `step` event in the traces), "
                    "so per-step statistics are not available")
        has, lacks = ("stock", "fixed") if marked["stock"] else ("fixed", "stock")
        return (f"the {has} run marks {marked[has]} decode step(s), the {lacks} run none (no `step` event "
                f"in its traces): per-step rates cannot be compared between them (was the {lacks} run "
                "made without `sanitizer.step(n)`?)")

    @property
    def significant(self) -> bool:
        """The primary measure's difference is significant (always False on the findings basis:
        there is no test then)."""
        if self.basis == "findings":
            return False
        m = self.primary_measure
        return bool(m and m.test.p_one_sided is not None and m.test.p_one_sided < self.alpha)

    @property
    def confirmed(self) -> bool:
        if self.basis == "findings":
            return self.fixed_clean and self.stock_findings > 0
        return self.fixed_clean and self.significant

    def exit_code(self) -> int:
        return 0 if self.confirmed else 1

    # --- sensitivity: was every corruption announced by a finding? ------------------------
    @staticmethod
    def precedence(side: RunEvidence) -> dict | None:
        if side.requests is None:
            return None
        bad = side.corrupted
        missed = [r for r in bad if r.preceded_at is None]
        return {
            "corrupted": len(bad),
            "preceded": len(bad) - len(missed),
            "preceded_on_any_rank": sum(r.preceded_any_rank_at is not None for r in bad),
            "not_preceded": [r.outcome.request for r in missed],
            "every_corrupted_preceded": not missed,
            "max_lag_steps": max((r.outcome.step - r.preceded_at for r in bad if r.preceded_at is not None), default=None),
        }

    def _verdict_on_findings(self) -> str:
        sev = self.stock_severity
        n = self.stock_findings
        stock = (f"stock {n} finding(s) at or above {sev} ({_rules_at_or_above(self.stock, sev)})" if n else
                 f"the stock side has no finding at or above {sev}: nothing for the fix to remove")
        basis = (f"judged on findings, not statistics: {self._steps_gap()}; comparing one run of each shows "
                 f"whether the fix removes these findings in these runs, it bounds no rate; {STEP_HOWTO}")
        if self.confirmed:
            parts = [f"FIX CONFIRMED on findings: {stock}, fixed none (clean, complete capture)", basis]
        else:
            parts = ["FIX NOT CONFIRMED"]
            problems = self.fixed_problems()
            if problems:
                parts.append("fixed side not clean: " + "; ".join(problems))
            parts.append(stock)  # (a stock side with findings and a clean fixed side is confirmed)
            parts.append(basis)
        text = parts[0] + ("; " if self.confirmed else ": ") + "; ".join(parts[1:])
        prec = self.precedence(self.stock)
        if prec and prec["corrupted"]:
            text += f"; stock: {prec['corrupted']} corrupted request(s)"
        return text

    def verdict_text(self) -> str:
        if self.basis == "findings":
            return self._verdict_on_findings()
        m = self.primary_measure
        parts = []
        if m is None:
            parts.append(f"primary measure {self.primary!r} unavailable (needs outcomes.jsonl on both sides)")
        if self.confirmed:
            ub = m.fixed.upper_bound(self.confidence)
            # The rule of three is the 95 % bound; at other levels only the exact bound is quoted.
            r3 = m.fixed.rule_of_three() if abs(self.confidence - 0.95) < 1e-9 else None
            bound = (f"rate < {_pct(r3)} by the rule of three; exact one-sided 95% bound {_pct(ub)}"
                     if r3 is not None else f"exact one-sided {self.confidence:.0%} bound {_pct(ub)}")
            head = (f"FIX CONFIRMED: fixed side clean, 0 of {m.fixed.n} {m.description} ({bound}); "
                    f"stock {m.stock.k} of {m.stock.n}; Fisher one-sided {_p_clause(m.test.p_one_sided)}")
            parts.insert(0, head)
        else:
            parts.insert(0, "FIX NOT CONFIRMED")
            problems = self.fixed_problems()
            if problems:
                parts.append("fixed side not clean: " + "; ".join(problems))
            if m is not None and not self.significant:
                parts.append(f"difference in {m.description} not significant at alpha {self.alpha:g}: "
                             f"stock {m.stock.k} of {m.stock.n}, fixed {m.fixed.k} of {m.fixed.n}, "
                             f"Fisher one-sided {_p_clause(m.test.p_one_sided)}")
        note = self.steps_note()
        if note:  # e.g. --primary corrupted on runs without steps: its test stands, the step measures do not
            parts.append(note)
        prec = self.precedence(self.stock)
        if prec and prec["corrupted"]:
            parts.append(f"stock: {prec['preceded']} of {prec['corrupted']} corrupted requests preceded by a finding "
                         f"on their rank" + ("" if prec["every_corrupted_preceded"] else
                                             f" (not: {', '.join(map(str, prec['not_preceded'][:10]))})"))
        return parts[0] + (": " + "; ".join(parts[1:]) if len(parts) > 1 and not self.confirmed else
                           "".join(f"; {p}" for p in parts[1:]))


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.4%}" if v < 0.001 else f"{v:.2%}"


def _p_clause(v: float | None) -> str:
    text = _p(v)
    return f"p {text}" if text.startswith("<") else f"p = {text}"


def _p(v: float | None) -> str:
    if v is None:
        return "-"
    return "< 1e-300" if v == 0 else f"{v:.3g}"  # 0.0 is an underflow, not a probability
