"""`hazsan logscan LOG...`: flag SGLang decode intervals whose accept length collapsed under load.

Exit codes: 0 nothing flagged, 1 at least one interval flagged, 2 an unreadable input (named) or
bad arguments. Plain and gzip logs (detected by content), `-` for standard input.
"""
from __future__ import annotations

import sys

HELP = "scan SGLang server logs for the corruption signature (accept len collapsing under load)"


def add_arguments(p) -> None:
    p.add_argument("logs", nargs="+", metavar="LOG", help="SGLang server logs (plain or gzip; '-' for stdin)")
    p.add_argument("--threshold", type=float, default=2.0,
                   help="flag decode intervals with accept len at or below this (default 2.0)")
    p.add_argument("--min-running", type=int, default=1, metavar="N",
                   help="...only when #running-req is at least N (default 1): idle servers log low values")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--html", metavar="OUT", help="also write an HTML report (with a plot if matplotlib is installed)")
    p.add_argument("--max-line-chars", type=int, default=4 << 20, metavar="N",
                   help="longest log line read (default 4 MiB; 0: no limit); a longer one is an error")
    p.add_argument("--max-lines", type=int, default=50, metavar="N",
                   help="text output: show at most N flagged and N unparsed lines (0: all)")


def run(args) -> int:
    from sanitizer.logscan import LogError, LogScanner
    from sanitizer.logscan.parse import MAX_ACCEPT_LEN
    from sanitizer.logscan.render import MATPLOTLIB_MISSING, render_html, render_json, render_text

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
    sys.stdout.write(render_json(result) if args.format == "json" else render_text(result, args.max_lines))
    return result.exit_code()
