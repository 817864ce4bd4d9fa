"""`hazsan report TRACES -o report.html`: one self-contained HTML file (opens offline)."""
from __future__ import annotations

import sys

from sanitizer.commands import _options as options

HELP = "write a self-contained HTML report: window timelines per rank, findings per step and call site"


def add_arguments(p) -> None:
    p.add_argument("paths", nargs="+", metavar="TRACE_OR_DIR")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the HTML file to write")
    options.add_peer_completion(p)
    options.add_lenient(p)
    p.add_argument("--max-items", type=int, default=5000, metavar="N",
                   help="draw at most N collective buffers and N blocks per window (the first ones)")
    options.add_fail_on(p)
    options.add_run_choice(p)
    options.add_allow_incomplete(p)
    p.add_argument("--jobs", "-j", type=int, default=1, metavar="N", help="as for hazsan check")


def run(args) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("hazsan report: needs matplotlib (pip install 'hazsan[report]')", file=sys.stderr)
        return 2
    from sanitizer.report.html import render_html
    from sanitizer.rules.parallel import analyze_parallel

    from sanitizer.rules.driver import analyze_runs
    from sanitizer.trace.reader import TraceError

    analysis = analyze_runs(args.paths, analyze_parallel, jobs=args.jobs, peer_completion=args.peer_completion,
                            lenient=args.lenient, max_per_group=100, run=args.run)
    if analysis.errors or not analysis.files:   # unusable input: no page that could pass for a report
        for err in analysis.errors:
            print(f"hazsan: error: {err}", file=sys.stderr)
        print(f"hazsan report: unusable input: {args.output} not written", file=sys.stderr)
        return 2
    try:
        page = render_html(analysis, analysis.files, max_items=args.max_items, peer_completion=args.peer_completion)
    except TraceError as exc:          # no such file, a folder without traces
        print(f"hazsan: error: {exc}", file=sys.stderr)
        return 2
    try:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(page)
    except OSError as exc:
        print(f"hazsan report: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"hazsan report: {args.output} ({analysis.summary.get('findings', 0)} finding(s))", file=sys.stderr)
    from sanitizer.commands import _verdict

    return _verdict.exit_code(args, analysis)
