"""`hazsan verify`'s output: the text report (verdict last), JSON, the HTML page with the accept
length over time, and the live progress line."""
from __future__ import annotations

import base64
import html
import io
import sys

import orjson

from sanitizer.verify.load import APIS
from sanitizer.verify.session import Result, Session
from sanitizer.verify.verdict import SOURCE_NAMES, SOURCES

MATPLOTLIB_MISSING = "matplotlib is not installed, so this page has no plot (`pip install matplotlib`)"
SOURCE_COLORS = {"log": "#2e86c1", "metrics": "#8e44ad", "request": "#16a085"}


def _f(x, fmt=".2f") -> str:
    return "-" if x is None else format(x, fmt)


def load_line(r: Result) -> str:
    o = r.options
    what = {"file": f"prompts from {o.prompts}", "code": "code/tool-call prompts"}[r.prompt_class]
    return (f"load: {r.concurrency} concurrent {APIS[r.api]} requests for at most {o.duration:g} s ({what}, "
            f"greedy, max {o.max_tokens} tokens); under load = >= {r.criterion.min_running} running")


def sources_line(r: Result) -> str:
    seen = r.sources()
    parts = [f"per request: {'yes' if seen['request'] else 'no' + (' (replies carry no spec_accept_length)' if r.api == 'generate' else ' (the OpenAI APIs carry none)')}",
             f"/metrics: {'yes' if seen['metrics'] else 'no'} ({r.metrics_status})",
             f"log: {'yes' if seen['log'] else 'no'} ({r.log_status}" +
             (f", rotated {r.log_rotations}x" if r.log_rotations else "") + ")"]
    return "acceptance seen: " + "; ".join(parts)


def render_text(r: Result) -> str:
    f = r.facts
    v = r.verdict
    lines = [f"hazsan verify {r.options.url}",
             f"server: {f.engine}{' ' + f.version if f.version else ''}, model {f.model or '?'}, "
             f"TP {f.tp_size or '?'}, max running requests {f.max_running or '?'}",
             f"depth: {f.depth_text()}",
             load_line(r), sources_line(r)]
    for p in r.phases:
        d = p.to_dict()
        lines.append(f"  {p.name:8} {d['requests']} requests ({d['failed']} failed) in {d['seconds']:.0f} s: "
                     f"{d['requests_per_s']:.2f} requests/s, {d['tokens_per_s']:.0f} tokens/s, running held "
                     f"{_f(d['running_held_median'], 'd') if d['running_held_median'] is not None else '-'} (median)")
    if r.criterion.baseline is not None:
        lines.append(f"baseline (one request at a time): accept len {r.criterion.baseline:.2f} ({r.baseline_source}); "
                     f"limit min({r.criterion.threshold:.2f}, {r.criterion.collapse:g} x baseline) = {r.criterion.limit:.2f}")
    elif r.options.baseline_requests:
        lines.append("baseline (one request at a time): no acceptance seen; the limit is the threshold "
                     f"{r.criterion.threshold:.2f}")
    for src in SOURCES:
        row = v.by_source.get(src)
        if row:
            lines.append(f"  {SOURCE_NAMES[src]:45} {row['under_load']:5} under load of {row['samples']:5}, "
                         f"flagged {row['flagged']}, accept len min {_f(row['min'])} median {_f(row['median'])}")
    prose = [s.accept_len for s in r.samples if s.phase == "prose"]
    if prose:
        prose.sort()
        lines.append(f"prose (content, not judged): accept len median {prose[len(prose) // 2]:.2f} over {len(prose)} "
                     f"samples, against {_f(_load_median(r))} on the code load")
    load_med = _load_median(r)
    if f.max_accept and load_med is not None:
        lines.append(f"window: at most {f.max_accept} tokens a step; this load achieves {load_med:.2f} "
                     f"({100 * load_med / f.max_accept:.0f}% of it) under load")
    for s in v.flagged[:10]:
        lines.append(f"  flagged: t={s.t:.1f}s {s.source} accept len {s.accept_len:.2f} running {s.running}"
                     + (f" at {s.where}" if s.where else ""))
    if len(v.flagged) > 10:
        lines.append(f"  ... and {len(v.flagged) - 10} more flagged")
    for note in filter(None, (r.early_stop, r.stopped)):
        lines.append(f"note: {note}")
    lines.append(f"{v.headline}: {v.text}")
    return "\n".join(lines) + "\n"


def _load_median(r: Result) -> float | None:
    crit = r.criterion
    for src in SOURCES:
        xs = sorted(s.accept_len for s in r.samples if s.source == src and crit.under_load(s))
        if xs:
            return xs[len(xs) // 2]
    return None


def to_dict(r: Result) -> dict:
    f = r.facts
    return {
        "url": r.options.url, "server": f.to_dict(), "api": r.api, "endpoint": APIS[r.api],
        "prompts": r.options.prompts or "code", "concurrency": r.concurrency,
        "threshold": r.criterion.threshold, "min_running": r.criterion.min_running,
        "collapse": r.criterion.collapse, "baseline": r.criterion.baseline, "baseline_source": r.baseline_source,
        "limit": r.criterion.limit, "sources": r.sources(), "metrics_status": r.metrics_status,
        "log": r.options.log, "log_status": r.log_status, "log_rotations": r.log_rotations,
        "log_unparsed": r.log_unparsed, "phases": [p.to_dict() for p in r.phases],
        "window_achieved": _load_median(r), "stopped": r.stopped, "early_stop": r.early_stop,
        "max_running_seen": r.max_running_seen, "elapsed_s": round(r.elapsed, 2),
        **r.verdict.to_dict(),
        "flagged_samples": [s.to_dict() for s in r.verdict.flagged],
        "samples": [s.to_dict() for s in r.samples],
        "requests": [q.to_dict() for q in r.records[:10_000]],
    }


def render_json(r: Result) -> str:
    return orjson.dumps(to_dict(r), option=orjson.OPT_INDENT_2).decode() + "\n"


def plot_png(r: Result) -> bytes | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4.5), dpi=100)
    ax = fig.add_subplot()
    crit = r.criterion
    for src in SOURCES:
        pts = [s for s in r.samples if s.source == src]
        if pts:
            ax.plot([s.t for s in pts], [s.accept_len for s in pts], ".", color=SOURCE_COLORS[src],
                    label=SOURCE_NAMES[src], alpha=0.7)
    bad = r.verdict.flagged
    if bad:
        ax.plot([s.t for s in bad], [s.accept_len for s in bad], "x", color="#c0392b", markersize=9,
                label=f"flagged ({len(bad)})")
    ax.axhline(crit.limit, color="#c0392b", linestyle="--", label=f"limit {crit.limit:.2f}")
    if crit.baseline is not None:
        ax.axhline(crit.baseline, color="#7f8c8d", linestyle=":", label=f"baseline {crit.baseline:.2f}")
    if r.facts.max_accept:
        ax.axhline(r.facts.max_accept, color="#27ae60", linestyle="-.", label=f"window {r.facts.max_accept}")
    for p in r.phases:
        ax.axvspan(p.started, p.ended, alpha=0.06, color={"baseline": "#7f8c8d", "prose": "#f39c12"}.get(p.name, "#2e86c1"))
        ax.text(p.started, 0.02, p.name, transform=ax.get_xaxis_transform(), fontsize=8, color="#555")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("accept length (tokens per verify step)")
    ax.set_ylim(bottom=0)
    running = [(s.t, s.running) for s in r.samples if s.running is not None and s.source != "request"]
    if running:
        ax2 = ax.twinx()
        ax2.plot([t for t, _ in running], [n for _, n in running], "-", color="#bbbbbb", linewidth=0.8)
        ax2.set_ylabel("running requests (grey)")
        ax2.set_ylim(bottom=0)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=4, fontsize=8)  # below: never over the points
    ax.set_title(f"hazsan verify: {r.verdict.headline.lower()}")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def render_html(r: Result) -> tuple[str, bool]:
    e = html.escape
    png = plot_png(r)
    v = r.verdict
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>hazsan verify</title>",
             "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; img-src data:; style-src 'unsafe-inline'\">",
             "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}.bad{color:#c0392b;font-weight:bold}"
             ".ok{color:#1e8449;font-weight:bold}pre{background:#f6f6f6;padding:1em;white-space:pre-wrap}</style></head><body>",
             f"<h1>hazsan verify {e(r.options.url)}</h1>",
             f"<p class='{'bad' if v.code == 1 else 'ok' if v.code == 0 else ''}'>{e(v.headline)}: {e(v.text)}</p>",
             "<h2>Accept length over time</h2>"]
    if png is not None:
        parts.append(f"<img alt='accept length over time' src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
    else:
        parts.append(f"<p class='bad'>{e(MATPLOTLIB_MISSING)}</p>")
    parts.append("<h2>Report</h2><pre>" + e(render_text(r)) + "</pre></body></html>\n")
    return "".join(parts), png is not None


class Progress:
    """The live line on standard error: in place on a terminal, a line every few seconds otherwise."""

    def __init__(self, stream=None, every: float = 5.0):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = 1.0 if self.tty else every
        self._next = 0.0
        self._phase = None

    def __call__(self, session: Session, phase: str) -> None:
        now = session.clock()
        if now < self._next and phase == self._phase:
            return
        self._next, self._phase = now + self.every, phase
        with session._lock:
            samples = list(session.samples)
            done = len(session.records)
            failed = sum(1 for r in session.records if not r.ok)
        last = samples[-1].accept_len if samples else None
        crit = session.criterion
        under = [s.accept_len for s in samples if crit is not None and crit.under_load(s)]
        intervals = {src: sum(1 for s in samples if s.source == src and s.phase == phase) for src in SOURCES}
        load = session.load
        line = (f"[{now:5.0f}s] {phase}: {load.inflight if load else 0} running, {done} done ({failed} failed); "
                f"intervals " + " ".join(f"{k} {n}" for k, n in intervals.items() if n) +
                f"; accept len last {_f(last)} min under load {_f(min(under) if under else None)}; "
                f"flagged {session.flagged_count()}")
        if self.tty:
            self.stream.write("\r" + line[:160].ljust(160))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
