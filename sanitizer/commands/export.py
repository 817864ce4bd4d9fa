"""`hazsan export TRACES -o trace.json`: Chrome Trace Event Format, for ui.perfetto.dev (the default
format, and so far the only one: `--format perfetto`, or the older `--perfetto`)."""
from __future__ import annotations

import sys

from sanitizer.commands import _options as options

HELP = "export rank traces for other tools (--perfetto: Chrome trace format for the Perfetto UI)"


def add_arguments(p) -> None:
    p.add_argument("paths", nargs="+", metavar="TRACE_OR_DIR")
    p.add_argument("--format", choices=("perfetto",), default="perfetto",
                   help="perfetto (the default): Chrome Trace Event Format (JSON) for ui.perfetto.dev: "
                        "streams, collectives, memory, findings")
    p.add_argument("--perfetto", action="store_const", dest="format", const="perfetto",
                   help="the same as --format perfetto")
    p.add_argument("-o", "--output", required=True, metavar="FILE")
    options.add_run_choice(p)
    options.add_peer_completion(p)
    options.add_lenient(p)


def run(args) -> int:
    from sanitizer.report.perfetto import export_perfetto
    from sanitizer.rules.driver import analyze
    from sanitizer.trace.reader import TraceError

    from sanitizer.trace.runs import SeveralRuns

    try:
        analysis = analyze(args.paths, peer_completion=args.peer_completion, lenient=args.lenient,
                           max_per_group=0, run=args.run)
    except SeveralRuns as exc:        # one timeline is one run: name them
        print(f"hazsan: error: {exc}", file=sys.stderr)
        return 2
    for err in analysis.errors:
        print(f"hazsan: error: {err}", file=sys.stderr)
    if analysis.errors:
        return 2
    try:
        with open(args.output, "wb") as fh:
            done = export_perfetto(analysis.files, analysis.findings, fh, peer_completion=args.peer_completion)
    except TraceError as exc:
        print(f"hazsan: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"hazsan export: cannot write {args.output}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"hazsan export: {args.output}: {done['events']} trace events, {done['ranks']} rank(s), "
          f"{len(analysis.findings)} finding(s); open it in https://ui.perfetto.dev", file=sys.stderr)
    return 0
