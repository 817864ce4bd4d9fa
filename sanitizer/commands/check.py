"""`hazsan check`: analyse rank traces together (docs/cli.md, "hazsan check")."""
from __future__ import annotations

import sys
import time

HELP = "analyse one or more rank traces (files or directories) and report hazards"


def add_arguments(p) -> None:
    p.add_argument("paths", nargs="+", metavar="TRACE_OR_DIR",
                   help="rank trace files (*.hzs, *.jsonl, either .gz) or directories holding them")
    p.add_argument("--format", choices=("text", "json", "sarif", "markdown"), default="text",
                   help="markdown: for CI step summaries (e.g. >> $GITHUB_STEP_SUMMARY)")
    p.add_argument("--fail-on", choices=("error", "warning"), default="error",
                   help="lowest severity that makes the exit code 1 (default: error)")
    p.add_argument("--peer-completion", choices=("local", "successor"), default="local",
                   help="local: NCCL's contract, a buffer is free once the op is locally complete; "
                        "successor: symmetric-window buffers only once a later collective on the "
                        "same communicator is (for barrier-less symmetric kernels)")
    p.add_argument("--lenient", action="store_true",
                   help="skip and count malformed lines instead of failing with exit 2")
    add_limit_arguments(p)
    add_engine_limit_arguments(p)
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


def _size(text: str) -> int:
    """A byte count: 8388608, 8MiB, 512KiB, 1GiB (0: no limit)."""
    import argparse
    import re

    m = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B?)?\s*", text, re.I)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 8388608 or 8MiB, got {text!r}")
    unit = (m.group(2) or " ")[0].upper()
    return int(m.group(1)) << {"K": 10, "M": 20, "G": 30}.get(unit, 0)


def _ratio(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _count(text: str) -> int:
    import argparse

    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def add_limit_arguments(p) -> None:
    """The reader's limits (sanitizer.trace.reader.ReadLimits): what one trace file may cost."""
    from sanitizer.trace.reader import ReadLimits

    DEFAULT_LIMITS = ReadLimits()  # the built-in defaults, not whatever an earlier run set

    p.add_argument("--max-line-bytes", type=_size, default=DEFAULT_LIMITS.max_line_bytes, metavar="N",
                   help=f"longest trace line (or binary frame) read (default {DEFAULT_LIMITS.max_line_bytes >> 20}MiB; "
                        "0: no limit); a longer one is an error")
    p.add_argument("--max-gzip-ratio", type=_ratio, default=DEFAULT_LIMITS.max_gzip_ratio, metavar="R",
                   help=f"a .gz trace may expand at most R times (default {DEFAULT_LIMITS.max_gzip_ratio:g}; "
                        "0: no limit), beyond its first "
                        f"{DEFAULT_LIMITS.gzip_ratio_floor >> 20}MiB")


def add_engine_limit_arguments(p) -> None:
    """The engine's limits (sanitizer.rules.driver.ENGINE_LIMITS): what one rank may hold."""
    from sanitizer.rules.driver import DEFAULT_ENGINE_LIMITS as ENGINE_LIMITS  # not what an earlier run set

    for name, what in (("streams", "stream ids"), ("events", "CUDA event ids"), ("comms", "communicators")):
        p.add_argument(f"--max-{name}", type=_count, default=ENGINE_LIMITS[f"max_{name}"], metavar="N",
                       help=f"distinct {what} one rank may use (default {ENGINE_LIMITS[f'max_{name}']:,}); "
                            "one more is an error on its line")


def apply_limits(args) -> None:
    from sanitizer.trace import reader

    reader.DEFAULT_LIMITS = reader.ReadLimits(max_line_bytes=args.max_line_bytes,
                                              max_gzip_ratio=args.max_gzip_ratio)
    if hasattr(args, "max_streams"):
        from sanitizer.rules import driver

        driver.ENGINE_LIMITS = {"max_streams": args.max_streams, "max_events": args.max_events,
                                "max_comms": args.max_comms}


def run(args) -> int:
    import time

    apply_limits(args)

    from sanitizer.report import render
    from sanitizer.rules.driver import analyze

    started = time.perf_counter()
    if args.scheduler:
        if args.jobs > 1:
            print("hazsan check: --jobs and --scheduler: give one of them", file=sys.stderr)
            return 2
        from sanitizer.rules.dask_check import SchedulerError, analyze_on_cluster

        try:
            analysis = analyze_on_cluster(args.paths, scheduler=args.scheduler, peer_completion=args.peer_completion,
                                          lenient=args.lenient, max_per_group=args.max_per_group,
                                          timeout=args.scheduler_timeout)
        except SchedulerError as exc:
            print(f"hazsan check: error: {exc}", file=sys.stderr)
            return 2
    elif args.jobs > 1:
        from sanitizer.rules.parallel import analyze_parallel
        analysis = analyze_parallel(args.paths, jobs=args.jobs, peer_completion=args.peer_completion,
                                    lenient=args.lenient, max_per_group=args.max_per_group)
    else:
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
