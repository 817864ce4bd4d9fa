"""`hazsan check`: analyse rank traces together (docs/cli.md, "hazsan check")."""
from __future__ import annotations

import sys

from sanitizer.commands import _options as options

HELP = "analyse one or more rank traces (files or directories) and report hazards"
EPILOG = """exit status:
  0  clean: no finding at or above --fail-on, and a complete capture
  1  findings at or above --fail-on
  2  unusable input or arguments; or no finding in a capture that lost events (--allow-incomplete: 0)"""


def add_arguments(p) -> None:
    p.add_argument("paths", nargs="+", metavar="TRACE_OR_DIR",
                   help="rank trace files (*.hzs, *.jsonl, either .gz) or directories holding them "
                        "(a directory of run folders, such as the pytest plugin's: each run on its own)")
    p.add_argument("--format", choices=("text", "json", "sarif", "markdown"), default="text",
                   help="markdown: for CI step summaries (e.g. >> $GITHUB_STEP_SUMMARY)")
    options.add_fail_on(p, default=None, help="lowest severity that makes the exit code 1 (default: error; "
                                              "with --rule, that rule's severity)")
    options.add_verdict_options(p)
    options.add_run_choice(p)
    options.add_allow_incomplete(p)
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

    from sanitizer.allowlist import AllowListError
    from sanitizer.commands import _verdict

    if args.scheduler and args.jobs > 1:
        print("hazsan check: --jobs and --scheduler: give one of them", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        analysis = _verdict.judge(args, args.paths)
    except (AllowListError, ValueError) as exc:
        print(f"hazsan check: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from sanitizer.rules.dask_check import SchedulerError

        if not isinstance(exc, SchedulerError):
            raise
        print(f"hazsan check: error: {exc}", file=sys.stderr)
        return 2
    if args.verbose:
        s = analysis.summary
        seconds = time.perf_counter() - started
        print(f"hazsan: engine: {s.get('engine')}; {s['events']:,} events from {s['ranks']} rank(s) "
              f"in {seconds:.2f} s ({s['events'] / max(seconds, 1e-9):,.0f} events/s)", file=sys.stderr)
    _verdict.write_report(args, analysis)
    return _verdict.exit_code(args, analysis)
