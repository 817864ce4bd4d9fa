"""Text, JSON and HTML renderings of a `ScanResult`."""
from __future__ import annotations

import base64
import html
import io
import math

import orjson

from sanitizer.logscan.scan import KNOWN_LINES, ScanResult
from sanitizer.logscan.vllm import MEAN_LEN

BAR_WIDTH = 50
_NICE_WIDTHS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)


# ------------------------------------------------------------------------------ histogram

def histogram(values, threshold: float, max_bins: int = 16) -> list[tuple[float, float, int]]:
    """Equal-width bins (lo, hi] on a round width, with `threshold` as a bin edge.

    Right-closed, because an interval is flagged at accept len <= threshold: every bar is then
    wholly flagged (hi <= threshold) or wholly not. Returns (lo, hi, count) from the lowest to
    the highest occupied bin, empty bins in between included.
    """
    values = [v for v in values if math.isfinite(v)]  # the parser keeps none that are not
    if not values:
        return []
    lo_v, hi_v = min(values), max(values)
    span = max(hi_v - lo_v, 1e-9)
    width = next((w for w in _NICE_WIDTHS if span / w <= max_bins), _NICE_WIDTHS[-1])
    while span / width > max_bins:
        width *= 2
    # The threshold is a bin edge when it lies near the values; a threshold far away (1e308, or
    # below every value) would only make the bin indices overflow, so the edges then start at a
    # multiple of the width below the smallest value.
    anchor = threshold if math.isfinite(threshold) and lo_v - width <= threshold <= hi_v + width \
        else math.floor(lo_v / width) * width

    def index(v: float) -> int:  # bin j is (anchor + (j-1)*width, anchor + j*width]
        return math.ceil(round((v - anchor) / width, 9))

    first, last = index(lo_v), index(hi_v)
    counts = [0] * (last - first + 1)
    for v in values:
        counts[index(v) - first] += 1
    return [(anchor + (first + i - 1) * width, anchor + (first + i) * width, c)
            for i, c in enumerate(counts)]


def histogram_lines(values, threshold: float) -> list[str]:
    bins = histogram(values, threshold)
    if not bins:
        return ["  (no decode intervals)"]
    peak = max(c for _, _, c in bins) or 1
    lines = []
    for lo, hi, c in bins:
        bar = "#" * (math.ceil(c * BAR_WIDTH / peak) if c else 0)
        mark = "  <= threshold" if hi <= threshold + 1e-9 and c else ""
        lines.append(f"  ({lo:5.2f}, {hi:5.2f}] {c:>8} {bar}{mark}")
    return lines


# ------------------------------------------------------------------------------ verdict

def verdict(r: ScanResult) -> str:
    base = _verdict_vllm(r) if r.has_vllm else _verdict_sglang(r)
    bad = r.not_logs()
    if not bad:
        return base
    head = ("NO DECODE LINES: " + "; ".join(f"{b.name}: {b.reason}" for b in bad) +
            f". The decode lines read are {KNOWN_LINES} (log level INFO): the wrong file?")
    if len(bad) < len(r.formats()):
        head += f" The other file(s): {base}"
    return head


def _verdict_sglang(r: ScanResult) -> str:
    n = r.intervals
    if not r.decode_lines:
        return ("no 'Decode batch' lines found: is this an SGLang server log (scheduler output, "
                "log level info)?")
    if not n:
        return (f"no decode interval carries 'accept len' ({r.decode_lines} decode lines): speculative "
                "decoding is off, so this signature cannot be applied")
    if not r.flagged:
        return (f"clean: none of {n} decode intervals has accept len <= {r.threshold:.2f} with "
                f"#running-req >= {r.min_running}")
    ranks = ", ".join(f"{p or '(no prefix)'}: {s.flagged}" for p, s in sorted(r.by_prefix.items()) if s.flagged)
    return (f"SIGNATURE FOUND: {len(r.flagged)} of {n} decode intervals have accept len <= "
            f"{r.threshold:.2f} with #running-req >= {r.min_running} ({ranks}). Under load this is what "
            "corrupted collective output looks like (the target model rejects the draft); check the "
            "flagged windows against request-level output checks and run `hazsan check` on a "
            "captured trace")


def _verdict_vllm(r: ScanResult) -> str:
    """vLLM or mixed input: the same verdicts, in words that fit both formats."""
    n = r.intervals
    sig = f"accept length <= {r.threshold:.2f} with running requests >= {r.min_running}"
    if not n:
        if r.vllm_spec_lines:
            return (f"no vLLM 'SpecDecoding metrics' line carries '{MEAN_LEN}' ({r.vllm_spec_lines} lines in the "
                    "vLLM 0.8.3-0.8.4 format), so this signature cannot be applied")
        if r.vllm_legacy_lines:
            return (f"{r.vllm_legacy_lines} vLLM 'Speculative metrics' lines (V0 engine, or V1 up to 0.8.2) carry "
                    "no per-interval mean acceptance length, so this signature cannot be applied")
        if r.vllm_stats_lines or r.decode_lines:
            return (f"no decode interval carries an accept length ({r.vllm_stats_lines} vLLM stats lines without a "
                    f"'SpecDecoding metrics' line, {r.decode_lines} 'Decode batch' lines): speculative decoding is "
                    "off (or vLLM logs below INFO), so this signature cannot be applied")
        return (f"no vLLM metrics line parsed ({r.vllm_unparsed} unparsed): is the log cut, or written in "
                "another format?")
    if not r.flagged:
        extra = ""
        if r.unknown_load_below:
            extra = (f"; {r.unknown_load_below} interval(s) at or below the threshold have unknown load (no stats "
                     "line before them) and are not flagged")
        return f"clean: none of {n} decode intervals has {sig}{extra}"
    ranks = ", ".join(f"{p or '(no prefix)'}: {st.flagged}" for p, st in sorted(r.by_prefix.items()) if st.flagged)
    return (f"SIGNATURE FOUND: {len(r.flagged)} of {n} decode intervals have {sig} ({ranks}). Under load this "
            "is what corrupted collective output looks like (the target model rejects the draft); check the "
            "flagged windows against request-level output checks and run `hazsan check` on a captured trace")


def notes(r: ScanResult) -> list[str]:
    """What a reader of a vLLM scan should know beside the verdict (empty for SGLang logs)."""
    out = []
    k = r.max_spec_tokens
    if k is not None and r.threshold >= k + 1:
        out.append(f"with {k} draft token(s) per step an accept length is at most {k + 1}, at or below the "
                   f"threshold {r.threshold:.2f}: every interval under load is flagged; lower --threshold")
    if r.unknown_load:
        head = (f"{r.unknown_load} vLLM interval(s) had no stats line before them from the same process: "
                "load unknown; ")
        out.append(head + (f"{r.unknown_load_below} of them at or below the threshold were not flagged "
                           "(--min-running 0 flags them)" if r.min_running > 0 else
                           "judged by accept length alone (--min-running is 0)"))
    if r.bonus_added:
        out.append(f"{r.bonus_added} vLLM interval(s) in 0.8.5's convention (mean acceptance length without the "
                   "bonus token, recognised by its per-position rates): one added, as vLLM >= 0.9 and SGLang count")
    if r.vllm_legacy_lines:
        out.append(f"{r.vllm_legacy_lines} vLLM 'Speculative metrics' line(s) (V0 engine or V1 <= 0.8.2) not read: "
                   "no per-interval mean acceptance length")
    if r.records_dropped:
        out.append(f"{r.records_dropped} vLLM interval(s) beyond the first {len(r.records)} counted but not kept "
                   "one by one")
    return out


def _format_line(r: ScanResult) -> str:
    per_file = r.formats()
    if len(per_file) == 1:
        return f"format: {r.format}"
    return f"format: {r.format} (" + ", ".join(f"{f}: {fmt}" for f, fmt in per_file.items()) + ")"


def _signature_line(r: ScanResult) -> str:
    if not r.has_vllm:
        return f"signature: accept len <= {r.threshold:.2f} with #running-req >= {r.min_running}"
    return (f"signature: accept length <= {r.threshold:.2f} with running requests >= {r.min_running} "
            "(vLLM: 'Mean acceptance length', and 'Running' of the stats line the same process logged before it)")


def _running(v) -> str:
    return "?" if v is None else str(v)


# ------------------------------------------------------------------------------ text

def _prefix_rows(r: ScanResult) -> list[list]:
    rows = []
    for prefix, s in sorted(r.by_prefix.items()):
        d = s.to_dict()
        rows.append([prefix or "(none)", d["decode_lines"], d["intervals"], d["flagged"],
                     _f(d["accept_len_min"]), _f(d["accept_len_median"]), _f(d["accept_len_mean"])])
    return rows


def _f(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def render_text(r: ScanResult, max_lines: int = 50) -> str:
    from tabulate import tabulate

    if not r.has_vllm:  # SGLang logs: the report as it always was
        out = [f"hazsan logscan: {len(r.files)} file(s), {r.lines} lines, {r.decode_lines} 'Decode batch' "
               f"lines, {r.intervals} decode intervals with accept len, {r.unparsed_count} unparsed",
               _signature_line(r), ""]
    else:
        sglang = f"{r.decode_lines} 'Decode batch' lines, " if r.decode_lines or r.format == "mixed" else ""
        out = [f"hazsan logscan: {len(r.files)} file(s), {r.lines} lines, {sglang}{r.vllm_stats_lines} vLLM stats "
               f"lines, {r.vllm_spec_lines} 'SpecDecoding metrics' lines, {r.intervals} decode intervals with "
               f"accept length, {r.unparsed_count} unparsed", _format_line(r), _signature_line(r), ""]
    if r.by_prefix:
        out.append("per rank prefix:" if not r.has_vllm else "per rank prefix (SGLang) or process and engine (vLLM):")
        out.append(tabulate(_prefix_rows(r), headers=["prefix", "decode lines" if not r.has_vllm else "lines",
                                                      "intervals", "flagged", "accept len min", "median", "mean"],
                            tablefmt="simple", disable_numparse=True))
        out.append("")
    out.append("accept-length distribution:")
    out.extend(histogram_lines(r.accept_lens(), r.threshold))
    if r.below_min_running:
        out.append(f"  ({r.below_min_running} interval(s) at or below the threshold with fewer than "
                   f"{r.min_running} running requests: not flagged)")
    if r.cold_start:
        out.append(f"  ({r.cold_start} interval(s) at or below the threshold right after a prefill that admitted "
                   "every running request: their first decode step, which NGRAM cannot draft; not flagged)")
    out.append("")
    if r.flagged:
        shown = r.flagged[:max_lines] if max_lines else r.flagged
        out.append(f"flagged intervals ({len(shown)} of {len(r.flagged)} shown):")
        out.append(tabulate([[f"{i.file}:{i.line}", i.time or "-", i.prefix or "(none)", f"{i.accept_len:.2f}",
                              _running(i.running_req), _f(i.accept_rate)] for i in shown],
                            headers=["where", "time", "prefix", "accept len",
                                     "#running-req" if not r.has_vllm else "running", "accept rate"],
                            tablefmt="simple", disable_numparse=True))
        out.append("")
    if r.unparsed_count:
        shown = r.unparsed[:max_lines] if max_lines else r.unparsed
        what = "'Decode batch' lines" if not r.has_vllm else "lines"
        out.append(f"unparsed {what} ({len(shown)} of {r.unparsed_count} shown):")
        for u in shown:
            out.append(f"  {u.file}:{u.line}: {u.reason}")
            if u.text:
                out.append(f"    {u.text[:160]}")
        out.append("")
    for note in notes(r):
        out.append(f"note: {note}")
    out.append(f"verdict: {verdict(r)}")
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ json

def to_dict(r: ScanResult) -> dict:
    d = {
        "intervals": r.intervals,
        "flagged": [i.to_dict() for i in r.flagged],
        "threshold": r.threshold,
        "min_running": r.min_running,
        "files": r.files,
        "lines": r.lines,
        "decode_lines": r.decode_lines,
        "below_min_running": r.below_min_running,
        "cold_start": r.cold_start,
        "by_prefix": {p: s.to_dict() for p, s in sorted(r.by_prefix.items())},
        "histogram": [{"lo": lo, "hi": hi, "count": c} for lo, hi, c in histogram(r.accept_lens(), r.threshold)],
        "unparsed": r.unparsed_count,
        "unparsed_lines": [u.to_dict() for u in r.unparsed],
        "verdict": verdict(r),
        "signature_found": bool(r.flagged),
        "format": r.format,
        "formats": r.formats(),
        "not_logs": [b.to_dict() for b in r.not_logs()],
    }
    if r.has_vllm:
        d["vllm"] = {"stats_lines": r.vllm_stats_lines, "spec_lines": r.vllm_spec_lines,
                     "legacy_lines": r.vllm_legacy_lines, "unparsed": r.vllm_unparsed,
                     "unknown_load": r.unknown_load, "unknown_load_below": r.unknown_load_below,
                     "bonus_added": r.bonus_added, "max_spec_tokens": r.max_spec_tokens,
                     "records_dropped": r.records_dropped}
        d["records"] = [rec.to_dict() for rec in r.records]
        d["notes"] = notes(r)
    return d


def render_json(r: ScanResult) -> str:
    d = to_dict(r)
    try:
        return orjson.dumps(d, option=orjson.OPT_INDENT_2).decode() + "\n"
    except TypeError:
        # a number in the log beyond 64 bits (orjson's limit): the standard library writes it
        import json
        return json.dumps(d, indent=2, ensure_ascii=False) + "\n"


# ------------------------------------------------------------------------------ markdown

def _md(text: str) -> str:
    """A log excerpt in a table cell: no pipes or backticks to break the row."""
    return text.replace("|", "\\|").replace("`", "'")


def render_markdown(r: ScanResult, max_lines: int = 50) -> str:
    """For CI step summaries: the verdict, the format read, per-prefix table, flagged and unparsed lines."""
    from tabulate import tabulate

    out = ["# hazsan logscan", "", f"**Verdict:** {_md(verdict(r))}", ""]
    out.append(f"- files: {len(r.files)}, lines: {r.lines}, decode intervals: {r.intervals}, "
               f"flagged: {len(r.flagged)}, unparsed: {r.unparsed_count}")
    out.append(f"- format: **{r.format}**" + "".join(f"\n  - `{_md(f)}`: {fmt}" for f, fmt in r.formats().items()))
    out.append(f"- {_signature_line(r)}")
    if r.has_vllm:
        out.append(f"- vLLM: {r.vllm_stats_lines} stats lines, {r.vllm_spec_lines} 'SpecDecoding metrics' lines, "
                   f"{r.unknown_load} interval(s) with unknown load")
    out.extend(f"- note: {_md(n)}" for n in notes(r))
    if r.by_prefix:
        out += ["", "## Per prefix", "", tabulate(
            [[_md(row[0])] + row[1:] for row in _prefix_rows(r)],
            headers=["prefix", "lines", "intervals", "flagged", "accept len min", "median", "mean"],
            tablefmt="github", disable_numparse=True)]
    if r.flagged:
        shown = r.flagged[:max_lines] if max_lines else r.flagged
        out += ["", f"## Flagged intervals ({len(shown)} of {len(r.flagged)})", "", tabulate(
            [[_md(f"{i.file}:{i.line}"), i.time or "-", _md(i.prefix or "(none)"), i.format, f"{i.accept_len:.2f}",
              _running(i.running_req), _f(i.accept_rate)] for i in shown],
            headers=["where", "time", "prefix", "format", "accept len", "running", "accept rate"],
            tablefmt="github", disable_numparse=True)]
    if r.unparsed_count:
        shown = r.unparsed[:max_lines] if max_lines else r.unparsed
        out += ["", f"## Unparsed lines ({len(shown)} of {r.unparsed_count})", ""]
        out += [f"- `{_md(u.file)}:{u.line}` ({u.format}): {_md(u.reason)}" for u in shown]
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ html

MATPLOTLIB_MISSING = ("matplotlib is not installed, so this report has no plot; "
                      "`pip install matplotlib` and rerun for one. The terminal histogram follows.")


def plot_png(r: ScanResult) -> bytes | None:
    """The accept-length distribution as a PNG, or None when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # no display on servers
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(8, 4), dpi=100)
    ax = fig.add_subplot()
    bins = histogram(r.accept_lens(), r.threshold)
    if bins:
        width = bins[0][1] - bins[0][0]
        colors = ["#c0392b" if hi <= r.threshold + 1e-9 else "#2e86c1" for _, hi, _ in bins]
        ax.bar([lo for lo, _, _ in bins], [c for _, _, c in bins], width=width, align="edge",
               color=colors, edgecolor="white")
    ax.axvline(r.threshold, color="#c0392b", linestyle="--", label=f"threshold {r.threshold:.2f}")
    ax.set_xlabel("accept len (per decode interval)")
    ax.set_ylabel("decode intervals")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_title({"vllm": "vLLM", "mixed": "SGLang and vLLM"}.get(r.format, "SGLang") + " accept-length distribution")
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def render_html(r: ScanResult, max_lines: int = 500) -> tuple[str, bool]:
    """The HTML report and whether it holds a plot."""
    from tabulate import tabulate

    png = plot_png(r)
    e = html.escape
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>hazsan logscan</title>",
             "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px}"
             ".bad{color:#c0392b;font-weight:bold}pre{background:#f6f6f6;padding:1em}</style></head><body>",
             "<h1>hazsan logscan</h1>",
             f"<p class='{'bad' if r.flagged or r.not_logs() else ''}'>Verdict: {e(verdict(r))}</p>",
             f"<p>{len(r.files)} file(s): {e(', '.join(r.files))}. Signature: accept len &le; {r.threshold:.2f} "
             f"with #running-req &ge; {r.min_running}.</p>",
             "<h2>Accept-length distribution</h2>"]
    if r.has_vllm:
        sig = _signature_line(r).removeprefix("signature: ")
        parts[-1:-1] = [f"<p>{e(_format_line(r).capitalize())}. For vLLM the signature is {e(sig)}.</p>"]
        parts[-1:-1] = [f"<p>Note: {e(n)}</p>" for n in notes(r)]
    if png is not None:
        parts.append(f"<img alt='accept-length histogram' src='data:image/png;base64,{base64.b64encode(png).decode()}'>")
    else:
        parts.append(f"<p class='bad'>{e(MATPLOTLIB_MISSING)}</p>")
        parts.append("<pre>" + e("\n".join(histogram_lines(r.accept_lens(), r.threshold))) + "</pre>")
    parts.append("<h2>Per rank prefix</h2>")
    parts.append(tabulate(_prefix_rows(r), headers=["prefix", "decode lines", "intervals", "flagged",
                                                    "accept len min", "median", "mean"],
                          tablefmt="html", disable_numparse=True))
    if r.flagged:
        parts.append(f"<h2>Flagged intervals ({min(len(r.flagged), max_lines)} of {len(r.flagged)} shown)</h2>")
        parts.append(tabulate([[f"{i.file}:{i.line}", i.time or "-", i.prefix or "(none)", f"{i.accept_len:.2f}",
                                _running(i.running_req), i.text] for i in r.flagged[:max_lines]],
                              headers=["where", "time", "prefix", "accept len", "#running-req", "line"],
                              tablefmt="html", disable_numparse=True))
    if r.unparsed_count:
        what = "lines" if r.has_vllm else "'Decode batch' lines"
        parts.append(f"<h2>Unparsed {what} ({r.unparsed_count})</h2><pre>")
        parts.extend(e(f"{u.file}:{u.line}: {u.reason}\n    {u.text}\n") for u in r.unparsed[:max_lines])
        parts.append("</pre>")
    parts.append("</body></html>\n")
    return "".join(parts), png is not None
