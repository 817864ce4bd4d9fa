"""Text, Markdown and JSON renderings of a `Comparison`."""
from __future__ import annotations

import orjson

from sanitizer.proof.compare import MEASURES, Comparison, Measure, _p, _pct
from sanitizer.proof.run import AGGREGATED_RULES, RunEvidence
from sanitizer.rules.findings import RULES


def _side_dict(c: Comparison, side: RunEvidence) -> dict:
    a = side.analysis
    steps = side.steps
    frees, nbytes, sites = side.transient_occurrences()
    out = {
        "directory": str(side.directory),
        "files": [str(p) for p in side.files],
        "ranks": a.summary.get("ranks"),
        "events": a.summary.get("events"),
        "steps": len(steps),
        "steps_by_rank": {str(r): len(s) for r, s in sorted(side.steps_by_rank.items())},
        "findings": a.summary.get("findings", len(a.findings)),
        "by_rule": {rule: {"findings": n, "steps": sum(1 for counts in side.index.by_step.values() if counts.get(rule))}
                    for rule, n in sorted(side.by_rule.items())},
        "outside_steps": dict(side.index.outside),
        "transient_in_window": {"frees": frees, "bytes": nbytes, "sites": sites},
        "per_step": {str(s): dict(sorted(r.items())) for s, r in sorted(side.index.by_step.items())},
        "capture_incomplete": side.capture_incomplete,
        "warnings": list(a.warnings),
    }
    if side.requests is not None:
        out["outcomes_file"] = str(side.outcomes_file)
        out["requests"] = {
            "total": len(side.requests),
            "corrupted": len(side.corrupted),
            "with_findings": sum(r.affected for r in side.requests),
            **{k: v for k, v in (c.precedence(side) or {}).items() if k != "corrupted"},
        }
        out["per_request"] = [r.to_dict() for r in side.requests if r.affected or r.outcome.corrupted]
    return out


def _measure_dict(c: Comparison, m: Measure) -> dict:
    ci = m.stock.interval(c.confidence)
    return {
        "name": m.name,
        "description": m.description,
        "stock": {"k": m.stock.k, "n": m.stock.n, "rate": m.stock.value,
                  "ci_low": ci and ci[0], "ci_high": ci and ci[1]},
        "fixed": {"k": m.fixed.k, "n": m.fixed.n, "rate": m.fixed.value,
                  "upper_bound": m.fixed.upper_bound(c.confidence), "rule_of_three": m.fixed.rule_of_three()},
        "fisher": {"odds_ratio": m.test.odds_ratio, "p_one_sided": m.test.p_one_sided,
                   "p_two_sided": m.test.p_two_sided},
    }


def to_dict(c: Comparison) -> dict:
    return {
        "verdict": {"confirmed": c.confirmed, "exit": c.exit_code(), "basis": c.basis, "fixed_clean": c.fixed_clean,
                    "fixed_problems": c.fixed_problems(),
                    # null on the findings basis: there is no test to be significant
                    "significant": c.significant if c.basis == "statistics" else None,
                    "stock_findings": c.stock_findings, "stock_severity": c.stock_severity,
                    "steps_marked": c.steps_marked, "steps_note": c.steps_note(), "primary": c.primary,
                    "alpha": c.alpha, "confidence": c.confidence, "fail_on": c.fail_on, "text": c.verdict_text()},
        "measures": [_measure_dict(c, m) for m in c.measures],
        "stock": _side_dict(c, c.stock),
        "fixed": _side_dict(c, c.fixed),
    }


def render_json(c: Comparison) -> str:
    # orjson writes inf (an odds ratio with a zero cell) as null.
    return orjson.dumps(to_dict(c), option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode() + "\n"


# ------------------------------------------------------------------------------ tables

def _rule_rows(c: Comparison) -> list[list]:
    rules = sorted(set(c.stock.by_rule) | set(c.fixed.by_rule), key=lambda r: (list(RULES).index(r) if r in RULES else 99, r))
    rows = []
    for rule in rules:
        row = [rule, RULES.get(rule, ("?",))[0]]
        for side in (c.stock, c.fixed):
            n = side.by_rule.get(rule, 0)
            if rule in AGGREGATED_RULES:
                frees, nbytes, sites = side.transient_occurrences()
                row += [f"{sites} site(s): {frees} frees, {_bytes(nbytes)}" if sites else "0", "(per site)"]
            else:
                row += [n, sum(1 for counts in side.index.by_step.values() if counts.get(rule))]
        rows.append(row)
    return rows


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _measure_rows(c: Comparison) -> list[list]:
    rows = []
    for m in c.measures:
        ci = m.stock.interval(c.confidence)
        rows.append([
            m.description + (" (primary)" if m.name == c.primary else ""),
            f"{m.stock.k}/{m.stock.n}",
            "-" if m.stock.value is None else f"{_pct(m.stock.value)} [{_pct(ci[0])}, {_pct(ci[1])}]",
            f"{m.fixed.k}/{m.fixed.n}",
            _pct(m.fixed.upper_bound(c.confidence)),
            _pct(m.fixed.rule_of_three()),
            _p(m.test.p_one_sided),
            _p(m.test.p_two_sided),
        ])
    return rows


def _measure_headers(c: Comparison) -> list[str]:
    conf = f"{c.confidence:.0%}"
    return ["measure", "stock k/n", f"stock rate [{conf} CI]", "fixed k/n", f"fixed upper {conf} (exact)",
            "rule of three (95%)", "Fisher p (one-sided)", "p (two-sided)"]


def _step_rows(c: Comparison, max_rows: int) -> tuple[list[str], list[list], int]:
    rules = [r for r in RULES if r not in AGGREGATED_RULES
             and any(counts.get(r) for side in (c.stock, c.fixed) for counts in side.index.by_step.values())]
    steps = sorted(set(c.stock.index.by_step) | set(c.fixed.index.by_step))
    shown = steps[:max_rows] if max_rows else steps
    rows = [[s] + [f"{c.stock.index.by_step.get(s, {}).get(r, 0)} / {c.fixed.index.by_step.get(s, {}).get(r, 0)}"
                   for r in rules] for s in shown]
    return ["step"] + [f"{r} (stock / fixed)" for r in rules], rows, len(steps)


def _request_summary_rows(c: Comparison) -> list[list]:
    rows = []
    for label, side in (("stock", c.stock), ("fixed", c.fixed)):
        if side.requests is None:
            rows.append([label, "no outcomes file", "", "", "", ""])
            continue
        p = c.precedence(side)
        rows.append([label, len(side.requests), len(side.corrupted), sum(r.affected for r in side.requests),
                     f"{p['preceded']}/{p['corrupted']} (any rank: {p['preceded_on_any_rank']})",
                     ", ".join(map(str, p["not_preceded"][:10])) + (" ..." if len(p["not_preceded"]) > 10 else "")
                     or "-"])
    return rows


def _request_rows(c: Comparison, max_rows: int) -> tuple[list[list], int]:
    rows = []
    for label, side in (("stock", c.stock), ("fixed", c.fixed)):
        for r in side.requests or ():
            if r.affected or r.outcome.corrupted:
                o = r.outcome
                steps = str(o.step) if o.first_step is None else f"{o.first_step}-{o.step}"
                rows.append([label, o.request, "all" if o.rank is None else o.rank, steps,
                             "yes" if o.corrupted else "no",
                             ", ".join(f"{k} {v}" for k, v in sorted(r.findings.items())) or "-",
                             "-" if r.preceded_at is None else r.preceded_at])
    return (rows[:max_rows] if max_rows else rows), len(rows)


_REQUEST_SUMMARY_HEADERS = ["side", "requests", "corrupted", "with findings", "corrupted preceded by a finding",
                            "not preceded"]
_REQUEST_HEADERS = ["side", "request", "rank", "step(s)", "corrupted", "findings in its steps", "last finding at step"]


def _side_line(label: str, side: RunEvidence) -> str:
    s = side.analysis.summary
    req = "" if side.requests is None else f", {len(side.requests)} requests"
    return f"{label}: {side.directory} ({s.get('ranks')} rank(s), {s.get('events')} events, {len(side.steps)} decode steps{req})"


def _document(c: Comparison, fmt: str, max_rows: int) -> list[tuple[str, str]]:
    """(heading, body) sections; `fmt` is a tabulate table format."""
    from tabulate import tabulate

    def table(headers, rows):
        return tabulate(rows, headers=headers, tablefmt=fmt, disable_numparse=True)

    sections = [("Runs", "\n".join([_side_line("stock", c.stock), _side_line("fixed", c.fixed)]))]
    sections.append(("Findings per rule", table(
        ["rule", "severity", "stock findings", "stock steps", "fixed findings", "fixed steps"], _rule_rows(c))
        if (c.stock.by_rule or c.fixed.by_rule) else "no findings on either side"))
    stats = table(_measure_headers(c), _measure_rows(c))
    note = c.steps_note()
    if note:
        basis = ("the verdict is judged on findings" if c.basis == "findings" else
                 f"the verdict rests on {MEASURES[c.primary]}, which needs no steps")
        stats = f"Note: {note}; {basis}.\n\n{stats}"
    sections.append((f"Statistics (confidence {c.confidence:.0%}, alpha {c.alpha:g}, primary: {c.primary})", stats))
    headers, rows, total = _step_rows(c, max_rows)
    no_rows = ("no decode steps marked on either side" if not any(c.steps_marked.values())
               else "no finding inside a decode step")
    sections.append((f"Findings per decode step ({len(rows)} of {total} steps with findings shown)",
                     table(headers, rows) if rows else no_rows))
    if c.stock.requests is not None or c.fixed.requests is not None:
        sections.append(("Requests", table(_REQUEST_SUMMARY_HEADERS, _request_summary_rows(c))))
        rows, total = _request_rows(c, max_rows)
        if rows:
            sections.append((f"Corrupted or affected requests ({len(rows)} of {total} shown)",
                             table(_REQUEST_HEADERS, rows)))
    warnings = [f"{label}: {w}" for label, side in (("stock", c.stock), ("fixed", c.fixed))
                for w in side.analysis.warnings]
    if warnings:
        sections.append(("Warnings", "\n".join(warnings)))
    sections.append(("Verdict", c.verdict_text()))
    return sections


def render_text(c: Comparison, max_rows: int = 40) -> str:
    out = ["hazsan compare"]
    for heading, body in _document(c, "simple", max_rows):
        out += ["", f"{heading}:", body]
    return "\n".join(out) + "\n"


def render_markdown(c: Comparison, max_rows: int = 40) -> str:
    out = ["# hazsan compare: stock vs fixed"]
    for heading, body in _document(c, "github", max_rows):
        if heading in ("Runs", "Warnings"):
            body = "\n".join(f"- {line}" for line in body.splitlines())
        if heading == "Verdict":
            body = f"**{body}**"
        out += ["", f"## {heading}", "", body]
    return "\n".join(out) + "\n"
