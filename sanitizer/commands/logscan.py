"""`hazsan logscan LOG...`: flag decode intervals whose accept length collapsed under load, in
SGLang (`Decode batch` lines) and vLLM (`SpecDecoding metrics` lines) server logs.

Exit codes: 0 nothing flagged, 1 at least one interval flagged, 2 an unreadable input (named), a
file that is not a server log (no line of either format: a README, a traceback, an empty file;
named, and 2 even beside real logs, so a CI gate never passes on the wrong file) or bad
arguments. Plain and gzip logs (detected by content), `-` for standard input. The format is told
line by line, so each file may be either (docs/logscan-formats.md).
"""
from __future__ import annotations

import argparse
import sys

HELP = ("scan SGLang or vLLM server logs for the corruption signature (the speculative-decoding "
        "accept length collapsing under load)")

DESCRIPTION = """\
Reads SGLang and vLLM server logs (the format is recognised per line, so per file: no option).

SGLang: a decode interval is a `Decode batch` line with `accept len`; its load is its
`#running-req`.
vLLM: a decode interval is a `SpecDecoding metrics` line with `Mean acceptance length` (bonus
token included, averaged over VLLM_LOG_STATS_INTERVAL, 10 s by default); its load is `Running:
N reqs` of the stats line (`Engine NNN: Avg prompt throughput: ...`) that the same process
logged right before it. A spec line with no stats line before it has unknown load: not flagged
unless --min-running is 0 (counted and reported). vLLM 0.8.5 wrote the mean acceptance length
without the bonus token: recognised and corrected. The `Speculative metrics` lines of vLLM's V0
engine (and V1 up to 0.8.2) carry no per-interval accept length and are only counted.

An interval is flagged when its accept length <= --threshold and its running requests >=
--min-running. The same defaults serve both formats: see docs/logscan-formats.md.

Exit: 1 when an interval is flagged, 0 otherwise; 2 when a LOG cannot be read or holds no line of
either format (not a server log: the report still names it, and the other files' verdict)."""


def add_arguments(p) -> None:
    if isinstance(p, argparse.ArgumentParser):
        p.description = DESCRIPTION
        p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("logs", nargs="+", metavar="LOG",
                   help="SGLang or vLLM server logs (plain or gzip; '-' for stdin)")
    p.add_argument("--threshold", type=float, default=2.0,
                   help="flag decode intervals with accept length (SGLang 'accept len', vLLM 'Mean acceptance "
                        "length') at or below this (default 2.0)")
    p.add_argument("--min-running", type=int, default=1, metavar="N",
                   help="...only when at least N requests run (SGLang '#running-req', vLLM 'Running' of the stats "
                        "line before; default 1): idle servers log low values. 0 also flags vLLM intervals of "
                        "unknown load")
    p.add_argument("--format", choices=("text", "json", "markdown"), default="text",
                   help="text (default), json, or markdown (CI step summaries); each names the format read")
    p.add_argument("--html", metavar="OUT", help="also write an HTML report (with a plot if matplotlib is installed)")
    p.add_argument("--max-line-chars", type=int, default=4 << 20, metavar="N",
                   help="longest log line read (default 4 MiB; 0: no limit); a longer one is an error")
    p.add_argument("--max-lines", type=int, default=50, metavar="N",
                   help="text and markdown output: show at most N flagged and N unparsed lines (0: all)")


def run(args) -> int:
    from sanitizer.logscan import LogError, LogScanner
    from sanitizer.logscan.parse import MAX_ACCEPT_LEN
    from sanitizer.logscan.scan import KNOWN_LINES
    from sanitizer.logscan.render import (MATPLOTLIB_MISSING, render_html, render_json, render_markdown,
                                          render_text)

    if not 0 <= args.threshold <= MAX_ACCEPT_LEN or args.min_running < 0 or args.max_line_chars < 0:  # also refuses nan
        print(f"hazsan logscan: error: --threshold must be a number from 0 to {MAX_ACCEPT_LEN:g} "
              "and --min-running, --max-line-chars >= 0", file=sys.stderr)
        return 2
    scanner = LogScanner(args.threshold, args.min_running, max_line_chars=args.max_line_chars)
    try:
        for path in args.logs:
            scanner.scan_file(path)
    except LogError as exc:
        print(f"hazsan logscan: error: {exc}", file=sys.stderr)
        return 2
    result = scanner.result
    if args.html:
        page, has_plot = render_html(result)
        try:
            with open(args.html, "w", encoding="utf-8") as f:
                f.write(page)
        except OSError as exc:
            print(f"hazsan logscan: error: {args.html}: cannot write: {exc.strerror or exc}", file=sys.stderr)
            return 2
        if not has_plot:
            print(f"hazsan logscan: note: {MATPLOTLIB_MISSING}", file=sys.stderr)
        print(f"hazsan logscan: HTML report written to {args.html}", file=sys.stderr)
    if args.format == "json":
        sys.stdout.write(render_json(result))
    elif args.format == "markdown":
        sys.stdout.write(render_markdown(result, args.max_lines))
    else:
        sys.stdout.write(render_text(result, args.max_lines))
    bad = result.not_logs()
    for b in bad:
        print(f"hazsan logscan: error: {b.name}: {b.reason}", file=sys.stderr)
    if bad:
        print(f"hazsan logscan: a log is judged by its decode lines, {KNOWN_LINES} (log level INFO); "
              "a file without one is not a log this can judge: exit 2", file=sys.stderr)
    return result.exit_code()
