"""`hazsan check`: analyse rank traces together (DESIGN.md section 5)."""
from __future__ import annotations

import sys

HELP = "analyse one or more rank traces (files or directories) and report hazards"


def add_arguments(p) -> None:
    p.add_argument("paths", nargs="+", metavar="TRACE_OR_DIR",
                   help="rank trace files (*.jsonl, *.jsonl.gz) or directories holding them")
    p.add_argument("--format", choices=("text", "json", "sarif"), default="text")
    p.add_argument("--fail-on", choices=("error", "warning"), default="error",
                   help="lowest severity that makes the exit code 1 (default: error)")
    p.add_argument("--peer-completion", choices=("local", "successor"), default="local",
                   help="local: NCCL's contract, a buffer is free once the op is locally complete; "
                        "successor: symmetric-window buffers only once a later collective on the "
                        "same communicator is (for barrier-less symmetric kernels)")
    p.add_argument("--lenient", action="store_true",
                   help="skip and count malformed lines instead of failing with exit 2")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also print which engine ran (compiled or interpreted), events and events/s, on stderr")
    p.add_argument("--max-per-group", type=int, default=100, metavar="N",
                   help="list at most N findings per rule and call site (all are counted; 0: no limit)")


def run(args) -> int:
    import time

    from sanitizer.report import render
    from sanitizer.rules.driver import analyze

    started = time.perf_counter()
    analysis = analyze(args.paths, peer_completion=args.peer_completion, lenient=args.lenient,
                       max_per_group=args.max_per_group)
    if args.verbose:
        s = analysis.summary
        seconds = time.perf_counter() - started
        print(f"hazsan: engine: {s.get('engine')}; {s['events']:,} events from {s['ranks']} rank(s) "
              f"in {seconds:.2f} s ({s['events'] / max(seconds, 1e-9):,.0f} events/s)", file=sys.stderr)
    sys.stdout.write(render(analysis, args.format))
    if args.format != "text":
        for e in analysis.errors:
            print(f"hazsan: error: {e}", file=sys.stderr)
    return analysis.exit_code(args.fail_on)
