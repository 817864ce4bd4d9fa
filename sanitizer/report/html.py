"""`hazsan report`: one self-contained HTML file that opens offline.

At a glance, per rank: a timeline of each symmetric window (window offset against program order)
with in-flight collective buffers as bars, blocks placed in the window (transients in orange), and
the findings' collisions as red marks; findings per decode step; then the findings grouped by rule
and call site, with both stacks. Plots are matplotlib SVG, inlined (text drawn as paths, so no
font or trace string reaches the markup); every string taken from a trace that reaches the HTML
goes through html.escape. A Content-Security-Policy forbids scripts and every network fetch.

SVG groups carry ids the headless-browser test looks for: `hazsan-coll-bars`, `hazsan-blocks`,
`hazsan-transients`, `hazsan-collisions`, and `hazsan-steps-<rule>-<i>` for each bar of the steps chart.
"""
from __future__ import annotations

import html
import io

from sanitizer.report.render import finding_text, incomplete, who
from sanitizer.report.timeline import read_timelines
from sanitizer.rules.findings import RULES, SEVERITY_ORDER

COLL_COLOR = "#1f5fbf"
BLOCK_COLOR = "#9a9a9a"
TRANSIENT_COLOR = "#f08c00"
COLLISION_COLOR = "#e00000"
RULE_COLORS = {"reuse-in-flight": "#e00000", "unordered-access": "#a61e4d", "graph-buffer-released": "#5f3dc4",
               "asymmetric-offset": "#1864ab", "free-in-flight": "#f08c00", "transient-in-window": "#e8b100"}

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1200px;color:#1b1b1b}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}
figure{margin:12px 0}figcaption{color:#555;font-size:13px}
pre{background:#f6f6f6;padding:8px;overflow-x:auto;font-size:12px}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}
.error{color:#c00}.warning{color:#a60}.ok{color:#080}
.legend span{display:inline-block;margin-right:14px}.sw{display:inline-block;width:12px;height:12px;vertical-align:middle;margin-right:4px}
details{margin:6px 0}summary{cursor:pointer}
"""


def _svg(fig) -> str:
    import matplotlib.pyplot as plt
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def _collision_points(findings, timeline, window):
    """(line, offset, rule) of each finding whose range or block lies in this window of this rank."""
    pts = []
    for f in findings:
        if f.rank != timeline.rank or f.file != timeline.file:
            continue
        lo = None
        if f.overlap:
            lo = f.overlap[0]
        elif f.block and isinstance(f.block.get("addr"), int):
            lo = f.block["addr"]
        elif f.rule == "asymmetric-offset" and f.block:
            for b in f.block.get("window_bufs") or ():
                if b.get("window") == window.ordinal:
                    pts.append((f.line, b["offset"], f.rule))
            continue
        if lo is not None and window.holds(lo):
            pts.append((f.line, lo - window.addr, f.rule))
    return pts


def window_figure(timeline, window, findings) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection

    fig, ax = plt.subplots(figsize=(11, 3.6))
    mib = 1 << 20

    def rects(items, get):
        polys = []
        for it in items:
            x0, x1, off, size = get(it)
            x1 = max(x1, x0 + 1)
            y0, y1 = off / mib, (off + max(size, 1)) / mib
            polys.append([(x0, y0), (x1, y0), (x1, y1), (x0, y1)])
        return polys

    ymax = 0.0
    blocks = [b for b in window.blocks if not b[6]]
    transients = [b for b in window.blocks if b[6]]
    for items, color, gid, alpha in ((blocks, BLOCK_COLOR, "hazsan-blocks", 0.35),
                                     (transients, TRANSIENT_COLOR, "hazsan-transients", 0.8),
                                     (window.colls, COLL_COLOR, "hazsan-coll-bars", 0.6)):
        if not items:
            continue
        polys = rects(items, lambda b: (b[0], b[1], b[2], b[3]))
        coll = PolyCollection(polys, facecolors=color, edgecolors=color, linewidths=0.4, alpha=alpha)
        coll.set_gid(gid)
        ax.add_collection(coll)
        ymax = max(ymax, max(p[2][1] for p in polys))
    pts = _collision_points(findings, timeline, window)
    if pts:
        sc = ax.scatter([p[0] for p in pts], [p[1] / mib for p in pts], marker="X", s=70,
                        color=COLLISION_COLOR, zorder=5, edgecolors="white", linewidths=0.6, clip_on=False)
        sc.set_gid("hazsan-collisions")
        ymax = max(ymax, max(p[1] / mib for p in pts))
    for line, _n in timeline.steps[:400]:
        ax.axvline(line, color="#cccccc", linewidth=0.5, zorder=0)
    ax.set_xlim(1, max(timeline.last_line, 2))
    ax.set_ylim(0, max(ymax * 1.08, 1 / 64))
    ax.set_xlabel("program order (trace line)")
    ax.set_ylabel("window offset (MiB)")
    ax.grid(axis="y", color="#eeeeee")
    return _svg(fig)


def steps_figure(findings) -> str | None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_step: dict = {}
    for f in findings:
        if f.rule == "transient-in-window" and f.by_step:
            for s, n in f.by_step.items():
                if s is not None:
                    by_step.setdefault(int(s), {}).setdefault(f.rule, 0)
                    by_step[int(s)][f.rule] += n
        elif f.step is not None:
            by_step.setdefault(f.step, {}).setdefault(f.rule, 0)
            by_step[f.step][f.rule] += 1
    if not by_step:
        return None
    steps = sorted(by_step)
    fig, ax = plt.subplots(figsize=(11, 2.8))
    bottom = [0] * len(steps)
    for rule in RULES:
        heights = [by_step[s].get(rule, 0) for s in steps]
        if not any(heights):
            continue
        bars = ax.bar(steps, heights, bottom=bottom, color=RULE_COLORS[rule], label=rule, width=0.8)
        for i, patch in enumerate(bars):
            if heights[i]:
                patch.set_gid(f"hazsan-steps-{rule}-{i}")
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xlabel("decode step")
    ax.set_ylabel("findings")
    ax.legend(fontsize=8, loc="upper right")
    return _svg(fig)


def _legend() -> str:
    items = [(COLL_COLOR, "collective buffer in flight (enqueue to observed completion)"),
             (BLOCK_COLOR, "block in the window (alloc to free)"),
             (TRANSIENT_COLOR, "transient: never a collective buffer"),
             (COLLISION_COLOR, "finding (collision, early free, unordered access)")]
    return '<p class="legend">' + "".join(
        f'<span><i class="sw" style="background:{c}"></i>{html.escape(t)}</span>' for c, t in items) + "</p>"


def render_html(analysis, paths, *, max_items: int = 5000, title: str = "hazsan report",
                peer_completion: str = "local") -> str:
    """`peer_completion`: the mode `analysis` ran under; the bars end where it says (timeline.py)."""
    e = html.escape
    s = analysis.summary
    timelines = read_timelines(paths, max_items, peer_completion=peer_completion)
    out = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
           "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">",
           f"<title>{e(title)}</title><style>{_CSS}</style></head><body>", f"<h1>{e(title)}</h1>"]
    counts = s.get("by_rule", {})
    if analysis.errors:
        out.append(f'<p class="error"><b>Unusable input</b>: {s.get("malformed", len(analysis.errors))} malformed line(s).</p>')
        out.append("<pre>" + e("\n".join(str(x) for x in analysis.errors[:20])) + "</pre>")
    if counts:
        errs = sum(n for r, n in counts.items() if RULES[r][0] == "error")
        cls = "error" if errs else "warning"
        out.append(f'<p class="{cls}"><b>{s["findings"]} finding(s)</b> in {s["events"]:,} events, {e(who(s))}</p>')
        out.append("<table><tr><th>rule</th><th>severity</th><th>findings</th><th>meaning</th></tr>")
        for rule in RULES:
            if rule in counts:
                sev, meaning = RULES[rule]
                out.append(f'<tr><td>{e(rule)}</td><td class="{sev}">{sev}</td><td>{counts[rule]}</td><td>{e(meaning)}</td></tr>')
        out.append("</table>")
    lost = incomplete(s)
    if lost:       # never shown as clean: what was lost may have held a hazard
        verdict = "More hazards may be missing" if counts else "No verdict"
        out.append(f'<p class="warning"><b>INCOMPLETE capture</b>: {e(verdict)} ({e("; ".join(lost))})</p>')
    elif not counts and not analysis.errors:
        out.append(f'<p class="ok"><b>No hazards</b> in {s["events"]:,} events, {e(who(s))}</p>')

    out.append("<h2>Symmetric windows, per rank</h2>")
    out.append(_legend())
    n_windows = 0
    for tl in timelines:
        for w in tl.windows:
            n_windows += 1
            shown = (f"{len(w.colls):,} of {w.coll_count:,} collective buffers, "
                     f"{len(w.blocks):,} of {w.block_count:,} blocks")
            out.append(f'<figure class="window" data-rank="{tl.rank}" data-bars="{len(w.colls)}" '
                       f'data-blocks="{len(w.blocks)}">')
            out.append(window_figure(tl, w, analysis.findings))
            out.append(f"<figcaption>rank {tl.rank} ({e(tl.file)}), window {w.ordinal} of communicator "
                       f"{e(repr(w.comm))}, {w.size / (1 << 20):,.1f} MiB; {shown}; grey lines: decode steps"
                       "</figcaption></figure>")
    if not n_windows:
        out.append("<p>No symmetric window in these traces.</p>")

    out.append("<h2>Findings per decode step</h2>")
    svg = steps_figure(analysis.findings)
    out.append(f"<figure class=\"steps\">{svg}</figure>" if svg else "<p>No finding carries a decode step.</p>")

    out.append("<h2>Findings by rule and call site</h2>")
    groups: dict = {}
    for f in analysis.findings:
        groups.setdefault(f.group_key(), []).append(f)
    order = sorted(groups, key=lambda k: (SEVERITY_ORDER[RULES[k[0]][0]], list(RULES).index(k[0]), str(k[1]), str(k[2])))
    if not order:
        out.append("<p>None.</p>")
    for key in order:
        fs = groups[key]
        rule, site, _ = key
        sev = RULES[rule][0]
        where = ", ".join(f"rank {f.rank} step {f.step} line {f.line}" for f in fs[:8]) + (" ..." if len(fs) > 8 else "")
        out.append(f'<details open><summary><b class="{sev}">{e(rule)}</b> at <code>{e(str(site or "(unknown site)"))}</code>: '
                   f"{len(fs)} listed</summary>")
        out.append("<pre>" + e("\n".join(finding_text(fs[0]))) + "</pre>")
        if len(fs) > 1:
            out.append(f"<p>also: {e(where)}</p>")
        out.append("</details>")
    warnings = s.get("warnings", [])
    if warnings:
        out.append("<h2>Warnings</h2><ul>" + "".join(f"<li>{e(w)}</li>" for w in warnings[:100]) + "</ul>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"
