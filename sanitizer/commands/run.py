"""`hazsan run [--dir D] -- CMD...`: run CMD with capture on, then check every rank's trace together.

CMD and everything it spawns run with HAZSAN=1 and HAZSAN_DIR=D (the .pth bootstrap installed with
hazsan turns capture on in every Python interpreter of this environment that sees them). When CMD
ends, the traces in D are analysed exactly as `hazsan check D` would, and the exit code is check's:
0 clean, 1 findings at or above --fail-on, 2 unusable input (including: no trace was written).
CMD's own exit status is reported on stderr. With --format json or sarif, CMD's standard output is
sent to stderr, so that stdout holds the report alone.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

HELP = "run a command with capture on (HAZSAN=1), then check every rank's trace together"


def add_arguments(p) -> None:
    p.add_argument("--dir", metavar="D",
                   help="trace folder (default: a new ./hazsan-traces/run-<time>-<pid>); "
                        "must not hold traces already unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the traces (*.hzs, *.jsonl, either .gz) already in --dir before running")
    p.add_argument("--stacks", choices=("none", "site", "full"),
                   help="call-site detail recorded (HAZSAN_STACKS; default site)")
    p.add_argument("--max-events", type=int, metavar="N",
                   help="events per trace file before counted drops (HAZSAN_MAX_EVENTS)")
    p.add_argument("--format", choices=("text", "json", "sarif", "markdown"), default="text")
    p.add_argument("--fail-on", choices=("error", "warning"), default="error")
    p.add_argument("--peer-completion", choices=("local", "successor"), default="local")
    p.add_argument("--lenient", action="store_true",
                   help="skip and count malformed lines instead of failing with exit 2")
    p.add_argument("cmd", nargs="...", metavar="-- CMD",
                   help="the command to run, after --")


def _traces(d: str) -> list[str]:
    try:
        from sanitizer.trace.schema import is_trace_name

        return sorted(f for f in os.listdir(d) if is_trace_name(f))
    except FileNotFoundError:
        return []


def _prepare_dir(args) -> str | None:
    if args.dir is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        d = os.path.join("hazsan-traces", f"run-{stamp}-{os.getpid()}")
    else:
        d = args.dir
        old = _traces(d)
        if old and not args.overwrite:
            print(f"hazsan run: {d} already holds {len(old)} trace file(s) ({old[0]}, ...); "
                  "they would be checked with this run's. Choose another --dir or pass --overwrite.",
                  file=sys.stderr)
            return None
        for f in old:
            os.unlink(os.path.join(d, f))
    os.makedirs(d, exist_ok=True)
    return os.path.abspath(d)


def _run(cmd: list[str], env: dict, stdout=None) -> int:
    try:
        proc = subprocess.Popen(cmd, env=env, stdout=stdout)
    except OSError as exc:
        print(f"hazsan run: cannot start {cmd[0]!r}: {exc.strerror or exc}", file=sys.stderr)
        return -1
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:   # pass Ctrl-C on and let the program flush and exit
            proc.send_signal(signal.SIGINT)


def run(args) -> int:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("hazsan run: no command given (usage: hazsan run [--dir D] -- CMD ...)", file=sys.stderr)
        return 2
    d = _prepare_dir(args)
    if d is None:
        return 2
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=d)
    if args.stacks:
        env["HAZSAN_STACKS"] = args.stacks
    if args.max_events:
        env["HAZSAN_MAX_EVENTS"] = str(args.max_events)
    # With a machine-readable report, stdout carries the report alone: CMD's output goes to stderr.
    status = _run(cmd, env, stdout=None if args.format == "text" else sys.stderr.fileno())
    if status < 0 and status != -1:
        why = f"killed by signal {-status}"
    else:
        why = f"exited with status {status}" if status != -1 else "could not start"
    print(f"hazsan run: {' '.join(cmd)} {why}; traces in {d}", file=sys.stderr)
    if not _traces(d):
        print("hazsan run: no trace was written. Did the command run Python that imports torch, "
              "with hazsan installed in that interpreter (hazsan_capture.pth in its site-packages)?",
              file=sys.stderr)
        return 2

    from sanitizer.report import render
    from sanitizer.rules.driver import analyze

    analysis = analyze([d], peer_completion=args.peer_completion, lenient=args.lenient)
    sys.stdout.write(render(analysis, args.format))
    sys.stdout.flush()
    for e in analysis.errors:
        print(f"hazsan: error: {e}", file=sys.stderr)
    return analysis.exit_code(args.fail_on)
