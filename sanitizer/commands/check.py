"""`hazsan check`: analyse rank traces together (docs/cli.md, "hazsan check")."""
from __future__ import annotations

import sys

from sanitizer.commands import _options as options

HELP = "analyse one or more rank traces (files or directories) and report hazards"


def add_arguments(p) -> None:
    p.add_argument("paths", nargs="+", metavar="TRACE_OR_DIR",
                   help="rank trace files (*.hzs, *.jsonl, either .gz) or directories holding them")
    p.add_argument("--format", choices=("text", "json", "sarif", "markdown"), default="text",
                   help="markdown: for CI step summaries (e.g. >> $GITHUB_STEP_SUMMARY)")
    options.add_fail_on(p)
    options.add_peer_completion(p)
    options.add_lenient(p)
    options.add_read_limits(p)
    options.add_engine_limits(p)
    p.add_argument("--verbose", "-v", action="store_true",
                   help="also print which engine ran (compiled or interpreted), events and events/s, on stderr")
    p.add_argument("--max-per-group", type=int, default=100, metavar="N",
                   help="list at most N findings per rule and call site (all are counted; 0: no limit)")
    p.add_argument("--jobs", "-j", type=int, default=1, metavar="N",
                   help="analyse rank files in N processes, then join them (default 1); "
                        "a progress bar shows on a terminal")
    p.add_argument("--scheduler", metavar="ADDRESS",
                   help="analyse each rank file on a Dask distributed worker that can read it "
                        "(tcp://host:8786; the paths are the workers'), join the results here; "
                        "needs hazsan[dask]")
    p.add_argument("--scheduler-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="how long to wait for the scheduler and its first worker (default 10)")


def run(args) -> int:
    import time

    from sanitizer.report import render
    from sanitizer.rules.driver import analyze

    limits = options.limits(args)
    started = time.perf_counter()
    if args.scheduler:
        if args.jobs > 1:
            print("hazsan check: --jobs and --scheduler: give one of them", file=sys.stderr)
            return 2
        from sanitizer.rules.dask_check import SchedulerError, analyze_on_cluster

        try:
            analysis = analyze_on_cluster(args.paths, scheduler=args.scheduler, peer_completion=args.peer_completion,
                                          lenient=args.lenient, max_per_group=args.max_per_group,
                                          timeout=args.scheduler_timeout, limits=limits)
        except SchedulerError as exc:
            print(f"hazsan check: error: {exc}", file=sys.stderr)
            return 2
    elif args.jobs > 1:
        from sanitizer.rules.parallel import analyze_parallel
        analysis = analyze_parallel(args.paths, jobs=args.jobs, peer_completion=args.peer_completion,
                                    lenient=args.lenient, max_per_group=args.max_per_group, limits=limits)
    else:
        analysis = analyze(args.paths, peer_completion=args.peer_completion, lenient=args.lenient,
                           max_per_group=args.max_per_group, limits=limits)
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
