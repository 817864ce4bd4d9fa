"""Text, JSON and SARIF renderings of `sanitizer.rules.driver.Analysis`.

The text report reads like a sanitizer report: grouped by rule and call site, most severe first,
with both stacks (the block's and the colliding op's), then totals.
"""
from __future__ import annotations

import json
import re

import orjson

from sanitizer.rules.findings import RULES, SEVERITY_ORDER, Finding


#: The reader's warning for a file that ends early: "FILE:LINE: trace truncated (WHY)".
_TRUNCATED = re.compile(r"(?s)(?P<file>.+?):(?P<line>\d+): trace truncated \((?P<why>.*)\)$")
#: The driver's per-file warnings of events lost (sanitizer/rules/driver.py).
_DROPPED = re.compile(r"(?s)(?P<file>.+?): capture dropped \d+ event\(s\)")
_HOOK_ERRORS = re.compile(r"(?s)(?P<file>.+?): \d+ capture hook error\(s\) were caught")
#: The driver's per-file coverage warnings (rules/driver.py coverage_warnings: the header's `coverage`).
_COVERAGE = re.compile(r"(?s)(?P<file>.+?): coverage: (?P<gap>.*)$")
#: Files named in an `incomplete` reason; the warnings (and json's `incomplete_files`) list every one.
NAMED_FILES = 20


def truncated_files(summary: dict) -> list[dict]:
    """The trace files that end early (a killed process, one killed before its first flush, a
    disk that stayed full), once each, in report order: {"file", "line", "why"}."""
    out: dict[str, dict] = {}
    for w in summary.get("warnings", []):
        m = _TRUNCATED.match(w) if isinstance(w, str) else None
        if m is not None and m["file"] not in out:
            out[m["file"]] = {"file": m["file"], "line": int(m["line"]), "why": m["why"]}
    return list(out.values())


def incomplete(summary: dict) -> list[str]:
    """Why the traces do not hold every event of the run (empty: they do). A report with any of
    these is never a plain "no hazards": what was lost may have held one. Truncated traces are
    named (the first NAMED_FILES of them)."""
    out = []
    if summary.get("dropped_events"):
        out.append(f"{summary['dropped_events']} event(s) dropped by capture")
    if summary.get("hook_errors"):
        out.append(f"{summary['hook_errors']} capture hook failure(s)")
    truncated = [t["file"] for t in truncated_files(summary)]
    if truncated:
        names = ", ".join(truncated[:NAMED_FILES])
        more = f" and {len(truncated) - NAMED_FILES} more" if len(truncated) > NAMED_FILES else ""
        out.append(f"{len(truncated)} trace(s) truncated: {names}{more}")
    if summary.get("skipped_lines"):
        out.append(f"{summary['skipped_lines']} malformed line(s) skipped")
    return out


def coverage_gaps(summary: dict) -> list[str]:
    """The collective paths some trace says capture could not record (each once, whatever the
    number of ranks): the verdict does not cover hazards on their buffers."""
    out: list[str] = []
    for w in summary.get("warnings", []):
        m = _COVERAGE.match(w) if isinstance(w, str) else None
        if m is not None and m["gap"] not in out:
            out.append(m["gap"])
    return out


def verdict_blockers(summary: dict) -> list[str]:
    """The reasons of `incomplete` that leave no clean verdict: events that may have held a
    hazard are missing. A trace cut after its last step's end (a server killed in its shutdown)
    holds every step's events (progress.STEPS_COMPLETE): it is named, but does not block; nor do
    malformed lines that --lenient skipped."""
    from sanitizer.trace.progress import STEPS_COMPLETE

    out = []

    def files(pattern: re.Pattern) -> str:      # the files the per-file warnings name (driver.py)
        named = [m["file"] for w in summary.get("warnings", []) if isinstance(w, str) and (m := pattern.match(w))]
        return f" in {', '.join(named[:NAMED_FILES])}{' ...' if len(named) > NAMED_FILES else ''}" if named else ""

    if summary.get("dropped_events"):
        out.append(f"{summary['dropped_events']} event(s) dropped by capture{files(_DROPPED)}")
    if summary.get("hook_errors"):
        out.append(f"{summary['hook_errors']} capture hook failure(s){files(_HOOK_ERRORS)}")
    cut = [t["file"] for t in truncated_files(summary) if STEPS_COMPLETE not in t["why"]]
    if cut:
        names = ", ".join(cut[:NAMED_FILES])
        more = f" and {len(cut) - NAMED_FILES} more" if len(cut) > NAMED_FILES else ""
        out.append(f"{len(cut)} trace(s) truncated: {names}{more}")
    return out        # malformed lines skipped: --lenient asked for that, and says how many


def _dumps(doc) -> str:
    """JSON text of a report. Sums read from a trace (drop counts over many lines, step numbers)
    can pass 64 bits, which orjson refuses: then the standard library writes them."""
    try:
        return orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:
        return json.dumps(doc, indent=2, default=str)


def render_json(analysis) -> str:
    lost = incomplete(analysis.summary)
    doc = {
        "findings": [f.to_dict() for f in analysis.findings],
        "summary": {**analysis.summary, "errors": [str(e) for e in analysis.errors],
                    "complete": not lost and not analysis.errors, "incomplete": lost,
                    "verdict_blockers": verdict_blockers(analysis.summary),
                    "coverage_gaps": coverage_gaps(analysis.summary),
                    "incomplete_files": truncated_files(analysis.summary)},
    }
    return _dumps(doc)


def _hex(v) -> str:
    return hex(v) if isinstance(v, int) else str(v)


def _range(lo, hi) -> str:
    return f"[{_hex(lo)}, {_hex(hi)}) ({hi - lo} bytes)"


def _stack_lines(stack, site, indent="    ") -> list[str]:
    frames = stack or ([site] if site else [])
    if not frames:
        return [f"{indent}(no call site recorded: capture with HAZSAN_STACKS=site or full)"]
    return [f"{indent}#{i} {frame}" for i, frame in enumerate(frames)]


def _describe_block(b: dict | None) -> str:
    if not b:
        return "no live block known at that range"
    where = f"pool {b.get('pool')!r}"
    if b.get("window") is not None:
        where += f", window {b['window']!r} offset {_hex(b['window_offset'])}"
    op = f" by {b['op']}" if b.get("op") else ""
    return (f"block {b.get('id')!r} {_range(b['addr'], b['addr'] + b['size'])} on stream "
            f"{b.get('stream')!r}, {where}, allocated at line {b.get('line')}{op}")


def _describe_op(o: dict | None) -> str:
    if not o:
        return ""
    if o.get("kind") == "coll":
        what = f"collective {o.get('op')} cid {o.get('cid')!r} (comm {o.get('comm')!r}, seq {o.get('seq')})"
    else:
        what = f"launch {o.get('op') or ''}".rstrip()
    if o.get("replay_of_line"):
        what += f" replayed from line {o['replay_of_line']}"
    rank = f" on rank {o['rank']}" if "rank" in o else ""
    return f"{what} on stream {o.get('stream')!r}{rank}, enqueued at line {o.get('line')}"


def finding_text(f: Finding) -> list[str]:
    where = f"rank {f.rank}, step {f.step}, {f.file}:{f.line}"
    out = [f"  {where}"]
    if f.rule == "transient-in-window":
        out.append(f"  {f.count} block(s), {f.bytes} bytes in total, freed without ever being a collective buffer ({f.detail})")
        out.append(f"  first: {_describe_block(f.block)}")
        out.extend(_stack_lines((f.block or {}).get("stack"), f.site))
        return out
    if f.rule == "asymmetric-offset":
        out.append(f"  {f.detail}")
        out.append(f"  this rank: {_describe_op(f.block)}")
        out.extend(_stack_lines((f.block or {}).get("stack"), (f.block or {}).get("site")))
        out.append(f"  reference: {_describe_op(f.op)}")
        out.extend(_stack_lines((f.op or {}).get("stack"), (f.op or {}).get("site")))
        return out
    # As ASan: what went wrong first (the access, the allocation over the buffer, the free), then
    # the op it races with and where that was enqueued, then where the memory was allocated.
    if f.rule == "unordered-access":
        out.append(f"  {f.detail}")
        out.append("  Access at:")
        out.extend(_stack_lines(None, f.site))
    else:
        verb = {"reuse-in-flight": "Allocation of", "free-in-flight": f"Free (line {f.line}) of",
                "graph-buffer-released": "Release of"}.get(f.rule, "")
        out.append(f"  {verb} {_describe_block(f.block)}")
        if f.detail:
            out.append(f"  ({f.detail})")
    if f.overlap:
        out.append(f"  overlapping range {_range(*f.overlap)}")
    out.append(f"  collides with {_describe_op(f.op)}")
    if f.note:
        out.append(f"  Note: {f.note}")
    out.append("  Op enqueued at:")
    out.extend(_stack_lines((f.op or {}).get("stack"), (f.op or {}).get("site")))
    if f.rule == "unordered-access":
        out.append(f"  Memory: {_describe_block(f.block)}")
    out.append("  Memory allocated at:")
    out.extend(_stack_lines((f.block or {}).get("stack"), (f.block or {}).get("site")))
    return out


def who(summary: dict) -> str:
    """The processes judged: '2 rank(s)', '2 rank(s) and 1 process without a rank' (a launcher),
    '1 process' (a program that is not distributed)."""
    ranks, unranked = summary.get("ranks", 0), summary.get("unranked", 0)
    if not ranks:
        return f"{unranked} process(es)" if unranked != 1 else "1 process"
    extra = f" and {unranked} process(es) without a rank" if unranked else ""
    return f"{ranks} rank(s){extra}"


def summary_line(analysis, fail_on: str = "error") -> str:
    """One line, the verdict, as ASan's SUMMARY: the first finding's rule and site and how many
    there are, what was suppressed, or why there is no verdict."""
    s = analysis.summary
    suppressed = s.get("suppressed", 0)
    extra = f"; {suppressed} suppressed" if suppressed else ""
    if analysis.errors:
        return f"SUMMARY: hazsan: unusable input: {analysis.errors[0]}{extra}"
    if analysis.findings:       # the one the report leads with: most severe, in the rules' order
        order = list(RULES)
        first = min(analysis.findings, key=lambda f: (SEVERITY_ORDER[f.severity], order.index(f.rule),
                                                      f.rank, f.file, f.line))
        sites = {f.group_key() for f in analysis.findings}
        more = f" and {len(sites) - 1} more site(s)" if len(sites) > 1 else ""
        return (f"SUMMARY: hazsan: {first.rule} at {first.headline_site() or '(unknown site)'}{more}; "
                f"{s.get('findings', len(analysis.findings))} finding(s){extra}")
    blockers = verdict_blockers(s)
    if blockers:
        return f"SUMMARY: hazsan: no verdict: the capture is INCOMPLETE ({', '.join(blockers)}){extra}"
    return f"SUMMARY: hazsan: no hazards in {s.get('events', 0)} events, {who(s)}{extra}"


_COLOURS = {"error": "\033[1;31m", "warning": "\033[1;33m", "ok": "\033[1;32m", "dim": "\033[2m"}
_RESET = "\033[0m"


def render_text(analysis, color: bool = False) -> str:
    def paint(text: str, what: str) -> str:
        return f"{_COLOURS[what]}{text}{_RESET}" if color else text

    lines: list[str] = []
    for e in analysis.errors:
        lines.append(paint(f"hazsan: error: {e}", "error"))
    groups: dict[tuple, list[Finding]] = {}
    for f in analysis.findings:
        groups.setdefault(f.group_key(), []).append(f)
    order = sorted(groups, key=lambda k: (SEVERITY_ORDER[RULES[k[0]][0]], list(RULES).index(k[0]), str(k[1]), str(k[2])))
    counts = analysis.summary.get("by_rule", {})
    for key in order:
        fs = groups[key]
        rule, site, _ = key
        sev = RULES[rule][0]
        lines.append("=" * 78)
        lines.append(paint(f"hazsan {sev.upper()}: {rule}  at {site or '(unknown site)'}  [{len(fs)} listed]", sev))
        lines.append(f"  {RULES[rule][1]}")
        lines.extend(finding_text(fs[0]))
        if len(fs) > 1:
            more = ", ".join(f"rank {f.rank} step {f.step} line {f.line}" for f in fs[1:6])
            lines.append(f"  ... and {len(fs) - 1} more like this: {more}{' ...' if len(fs) > 6 else ''}")
    s = analysis.summary
    if analysis.errors and not s.get("events"):
        # nothing could be judged: no count of events, no "no hazards", only why (exit 2)
        malformed = s.get("malformed", 0)
        lines.append(f"hazsan: {malformed} malformed line(s): the input is unusable (exit 2); --lenient skips them"
                     if malformed else "hazsan: the input is unusable (exit 2): see the error above")
        lines.append(summary_line(analysis))
        return "\n".join(lines) + "\n"
    lines.append("=" * 78)
    for w in s.get("warnings", []):
        lines.append(f"hazsan: warning: {w}")
    lost = incomplete(s)
    blockers = verdict_blockers(s)
    if counts:
        total = ", ".join(f"{rule}: {counts[rule]}" for rule in RULES if rule in counts)
        lines.append(f"hazsan: {s['findings']} finding(s) in {s['events']} events, {who(s)}: {total}")
        if lost:
            lines.append(paint(f"hazsan: INCOMPLETE capture ({', '.join(lost)}): more hazards may be missing", "warning"))
    elif blockers:
        lines.append(paint(f"hazsan: no verdict: no hazard found in {s['events']} events, {who(s)}, but the "
                           f"capture is INCOMPLETE ({', '.join(lost)}): hazards may be missing (exit 2; "
                           "--allow-incomplete accepts it)", "warning"))
    elif lost:
        lines.append(f"hazsan: no hazards found in {s['events']} events, {who(s)}, but the capture "
                     f"is INCOMPLETE ({', '.join(lost)}): hazards may be missing")
    else:
        lines.append(paint(f"hazsan: no hazards found in {s['events']} events, {who(s)}", "ok"))
    gaps = coverage_gaps(s)
    if gaps:      # the verdict above holds for what was recorded; say at once what it leaves out
        lines.append(paint(f"hazsan: NOT CHECKED: {len(gaps)} collective path(s) capture could not record "
                           "(coverage warnings above): hazards on their buffers are not in this verdict",
                           "warning"))
    for t in truncated_files(s):
        lines.append(f"hazsan: INCOMPLETE: {t['file']}: {t['why']}")
    if analysis.errors:
        malformed = s.get("malformed", 0)
        if malformed:
            lines.append(f"hazsan: {malformed} malformed line(s): the input is unusable (exit 2); --lenient skips them")
        else:  # a file that cannot be read at all (no header, a limit reached): no line to skip
            lines.append("hazsan: the input is unusable (exit 2): see the error above")
    lines.append(summary_line(analysis))
    return "\n".join(lines) + "\n"


def render_sarif(analysis) -> str:
    """SARIF 2.1.0, so CI systems can annotate the call sites."""
    results = []
    for f in analysis.findings:
        site = f.headline_site()
        loc = {"physicalLocation": {"artifactLocation": {"uri": f.file}, "region": {"startLine": f.line}}}
        locations = [loc]
        if site and ":" in site:
            path, _, rest = site.partition(":")
            line_s = rest.split(":", 1)[0]
            if line_s.isdigit():
                locations.insert(0, {"physicalLocation": {"artifactLocation": {"uri": path},
                                                          "region": {"startLine": int(line_s)}}})
        results.append({
            "ruleId": f.rule,
            "level": "error" if f.severity == "error" else "warning",
            "message": {"text": f"{f.rule} on rank {f.rank}, step {f.step}: " + (f.detail or RULES[f.rule][1])},
            "locations": locations,
            "properties": f.to_dict(),
        })
    doc = {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [{
            "tool": {"driver": {"name": "hazsan", "rules": [
                {"id": r, "shortDescription": {"text": d}, "defaultConfiguration": {"level": sev}}
                for r, (sev, d) in RULES.items()]}},
            "results": results,
            "invocations": [{
                "executionSuccessful": not analysis.errors,
                "toolExecutionNotifications": [
                    {"level": "warning", "message": {"text": f"incomplete capture: {why}"}}
                    for why in incomplete(analysis.summary)]
                + [{"level": "note", "message": {"text": w}} for w in analysis.summary.get("warnings", [])],
            }],
        }],
    }
    return _dumps(doc)
