"""Markdown rendering of an Analysis: for CI step summaries ($GITHUB_STEP_SUMMARY) and PR comments.

A verdict line, a table of findings by rule, then one collapsed section per rule and call site
holding the text report of its first finding (both stacks). Everything taken from a trace goes
into table cells escaped, or into code blocks fenced longer than any backtick run inside them.
"""
from __future__ import annotations

import html
import re

from sanitizer.report.render import finding_text, incomplete, truncated_files, verdict_blockers, who
from sanitizer.rules.findings import RULES, SEVERITY_ORDER, Finding

_CELL = re.compile(r"([\\`*_{}\[\]<>()#+!|~])")


def cell(text) -> str:
    """Text safe inside a table cell: markdown specials escaped, no line breaks."""
    return _CELL.sub(r"\\\1", str(text)).replace("\r", " ").replace("\n", " ")


def code_block(lines: list[str]) -> str:
    body = "\n".join(lines)
    longest = max((len(m) for m in re.findall(r"`+", body)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{body}\n{fence}"


def render_markdown(analysis) -> str:
    s = analysis.summary
    counts = s.get("by_rule", {})
    errors = sum(n for r, n in counts.items() if RULES[r][0] == "error")
    out: list[str] = ["## hazsan check", ""]
    if analysis.errors:
        malformed = s.get("malformed", 0)
        out.append(f"**Unusable input** ({malformed} malformed line(s)); the first errors:" if malformed
                   else "**Unusable input**:")
        out.append("")
        out.append(code_block([str(e) for e in analysis.errors[:10]]))
    elif counts:
        mark = ":x:" if errors else ":warning:"
        out.append(f"{mark} **{s['findings']} finding(s)** in {s['events']:,} events, {who(s)}")
    elif verdict_blockers(s):
        out.append(f":x: **No verdict**: no hazard found in {s['events']:,} events, {who(s)}, "
                   "but the capture is **INCOMPLETE**: hazards may be missing")
    elif incomplete(s):
        out.append(f":warning: **No hazards found** in {s['events']:,} events, {who(s)}, "
                   "but the capture is **INCOMPLETE**: hazards may be missing")
    else:
        out.append(f":white_check_mark: **No hazards** in {s['events']:,} events, {who(s)}")
    out.append("")
    lost = incomplete(s)
    if lost:
        if counts:
            out.append("**INCOMPLETE capture**: more hazards may be missing.")
            out.append("")
        out += [f"- {cell(why.split(':', 1)[0] if 'truncated' in why else why)}" for why in lost]
        out += [f"- INCOMPLETE: {cell(t['file'])}: {cell(t['why'])}" for t in truncated_files(s)]
        out.append("")
    if counts:
        out += ["| rule | severity | findings | meaning |", "|---|---|---:|---|"]
        for rule in RULES:
            if rule in counts:
                sev, meaning = RULES[rule]
                out.append(f"| `{rule}` | {sev} | {counts[rule]} | {cell(meaning)} |")
        out.append("")
    groups: dict[tuple, list[Finding]] = {}
    for f in analysis.findings:
        groups.setdefault(f.group_key(), []).append(f)
    order = sorted(groups, key=lambda k: (SEVERITY_ORDER[RULES[k[0]][0]], list(RULES).index(k[0]), str(k[1]), str(k[2])))
    if order:
        out += ["### By rule and call site", ""]
    for key in order:
        fs = groups[key]
        rule, site, _ = key
        ranks = sorted({f.rank for f in fs})
        steps = sorted({f.step for f in fs if f.step is not None})
        where = f"ranks {', '.join(map(str, ranks))}" + (f", steps {steps[0]}-{steps[-1]}" if steps else "")
        # inside HTML, markdown escapes are not undone: HTML escaping instead
        out.append(f"<details><summary><b>{html.escape(rule)}</b> at <code>{html.escape(str(site or '(unknown site)'))}</code>: "
                   f"{len(fs)} listed ({html.escape(where)})</summary>")
        out.append("")
        out.append(code_block(finding_text(fs[0])))
        out.append("")
        out.append("</details>")
        out.append("")
    warnings = s.get("warnings", [])
    if warnings:
        out += ["### Warnings", ""]
        out += [f"- {cell(w)}" for w in warnings[:50]]
        if len(warnings) > 50:
            out.append(f"- ... and {len(warnings) - 50} more")
        out.append("")
    return "\n".join(out).rstrip() + "\n"
