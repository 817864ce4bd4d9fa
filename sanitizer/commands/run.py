"""`hazsan run [--dir D] -- CMD...`: run CMD with capture on, then check every rank's trace together.

CMD and everything it spawns run with HAZSAN=1, HAZSAN_DIR=D, HAZSAN_LEVEL (--level, default full)
and a new HAZSAN_RUN_ID (the .pth bootstrap installed with hazsan turns capture on in every Python
interpreter of this environment that sees them). When CMD ends, the traces in D are judged as
`hazsan check D` would. The exit code keeps both verdicts visible, as compute-sanitizer and valgrind
do (EPILOG): findings give --error-exitcode; otherwise a command that failed gives its own status
(128+N when killed by signal N); otherwise check's code. With --format json or sarif, CMD's standard
output is sent to stderr, so that stdout holds the report alone.

--bisect makes it a `git bisect run` step: the traces of the previous step in D are replaced, stdout
holds one line (the commit, the verdict, the first finding's site), and the exit codes are the ones
`git bisect run` reads: 0 clean (good), 1 findings at or above --fail-on (bad), 125 unusable capture
or input, or a failed command whose traces hold no finding (skip this commit). --rule RULE narrows
the verdict to one rule.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from sanitizer.commands import _options as options

HELP = "run a command with capture on (HAZSAN=1), then check every rank's trace together"
EPILOG = """exit status (the first that applies):
  N    findings at or above --fail-on: --error-exitcode (default 1)
  S    the command failed: its own exit status (128+N when killed by signal N)
  2    no trace written, unusable traces, or nothing found in a capture that lost events
       (--allow-incomplete: 0); 127 when the command cannot be started
  0    the command succeeded and its traces are clean and complete
--bisect maps these to `git bisect run`'s 0 good / 1 bad / 125 skip."""


def add_arguments(p) -> None:
    p.add_argument("--dir", metavar="D",
                   help="trace folder (default: a new ./hazsan-traces/run-<time>-<pid>); "
                        "must not hold traces already unless --overwrite")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the traces (*.hzs, *.jsonl, either .gz) already in --dir before running")
    p.add_argument("--level", choices=("full", "alloc"),
                   help="what is recorded (HAZSAN_LEVEL; default: $HAZSAN_LEVEL, else full): full "
                        "also records every op's reads and writes, which unordered-access needs")
    p.add_argument("--stacks", choices=("none", "site", "full"),
                   help="call-site detail recorded (HAZSAN_STACKS; default site)")
    p.add_argument("--max-events", dest="capture_max_events", type=int, metavar="N",
                   help="events per trace file before counted drops (HAZSAN_MAX_EVENTS)")
    p.add_argument("--format", choices=("text", "json", "sarif", "markdown"), default="text")
    options.add_fail_on(p, default=None, help="lowest severity that makes the exit code --error-exitcode "
                                              "(default: error; with --rule, that rule's severity)")
    p.add_argument("--error-exitcode", type=int, default=1, metavar="N",
                   help="the exit code when there are findings (default 1), whatever the command's own status")
    options.add_verdict_options(p)
    options.add_allow_incomplete(p)
    p.add_argument("--bisect", action="store_true",
                   help="a `git bisect run` step: replace D's traces, print one line (commit, verdict, "
                        "first finding's site), exit 0 clean / 1 findings / 125 unusable capture (skip)")
    options.add_peer_completion(p)
    options.add_lenient(p)
    p.add_argument("cmd", nargs="...", metavar="-- CMD",
                   help="the command to run, after --")


SKIP = 125   # `git bisect run`: this commit cannot be tested


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
    from sanitizer.allowlist import AllowListError
    from sanitizer.capture.config import RUN_ENV, run_id
    from sanitizer.commands import _verdict

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("hazsan run: no command given (usage: hazsan run [--dir D] -- CMD ...)", file=sys.stderr)
        return 2
    if args.bisect:
        args.overwrite = True          # each step replaces the previous step's traces
    try:
        options.suppressions(args)     # a bad suppressions file is said before the command runs
    except AllowListError as exc:
        print(f"hazsan run: error: {exc}", file=sys.stderr)
        return 2
    d = _prepare_dir(args)
    if d is None:
        return 2
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=d)
    env.pop(RUN_ENV, None)
    run_id(env)                        # this run's own id, whatever the shell exported
    env["HAZSAN_LEVEL"] = args.level or os.environ.get("HAZSAN_LEVEL") or "full"
    if args.stacks:
        env["HAZSAN_STACKS"] = args.stacks
    if args.capture_max_events:
        env["HAZSAN_MAX_EVENTS"] = str(args.capture_max_events)
    # With a machine-readable report or a bisect line, stdout carries it alone: CMD's goes to stderr.
    quiet = args.bisect or args.format != "text"
    status = _run(cmd, env, stdout=sys.stderr.fileno() if quiet else None)
    if status == -1:
        why = "could not start"
    elif status < 0:
        why = f"was killed by signal {-status}"
    else:
        why = f"exited with status {status}"
    print(f"hazsan run: {' '.join(cmd)} {why}; traces in {d}", file=sys.stderr)
    own = _own_status(status)
    if not _traces(d):
        print("hazsan run: no trace was written. Did the command run Python that imports torch, "
              "with hazsan installed in that interpreter (hazsan_capture.pth in its site-packages)?",
              file=sys.stderr)
        if args.bisect:
            return _bisect_line(None, "no trace was written")
        return own if own else 2

    analysis = _verdict.judge(args, [d])
    if args.bisect:
        code = analysis.exit_code(_verdict.fail_on(args), args.allow_incomplete)
        # A command that failed may have stopped before the workload ran: no finding then says
        # nothing about this commit (findings it left are still a verdict).
        failed = f"the command {why}, and its traces hold no finding" if status != 0 and code != 1 else None
        return _bisect_line(analysis, failed, code)
    _verdict.write_report(args, analysis)
    code = _verdict.exit_code(args, analysis)
    if code != 1 and own:
        print(f"hazsan run: the command failed ({why}): exit {own}, its own status", file=sys.stderr)
    return combined(code, own, args.error_exitcode)


def _own_status(status: int) -> int:
    """The command's status as a shell reports it: 0, its exit status, 128+N for signal N, 127
    when it could not start."""
    if status == -1:
        return 127
    return 128 - status if status < 0 else status


def combined(check_code: int, own: int, error_exitcode: int = 1) -> int:
    """The exit code of `hazsan run` (EPILOG): findings first, then the command's own failure,
    then check's verdict (0 clean, 2 unusable or incomplete)."""
    if check_code == 1:
        return error_exitcode
    if own:
        return own
    return check_code


def _commit() -> str:
    """The commit checked out in the current directory (what `git bisect` is testing)."""
    try:
        out = subprocess.run(["git", "log", "-1", "--format=%h %s"], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "(no git)"
    text = out.stdout.strip()
    if out.returncode != 0 or not text:
        return "(not in a git work tree)"
    return text if len(text) <= 72 else text[:69] + "..."


def _bisect_line(analysis, unusable: str | None, code: int = SKIP) -> int:
    """Print the step's one line; return the exit code `git bisect run` reads."""
    commit = _commit()
    if unusable is None and code == 2:
        unusable = ("; ".join(str(e) for e in analysis.errors[:1])
                    or "; ".join(analysis.blockers()) or "unusable input")
    if unusable is not None:
        print(f"hazsan bisect: {commit}: skip (unusable capture: {unusable})", flush=True)
        return SKIP
    by_rule = analysis.summary.get("by_rule", {})
    counts = ", ".join(f"{r}: {n}" for r, n in by_rule.items()) or "no finding"
    verdict = "bad" if code == 1 else "good"
    line = f"hazsan bisect: {commit}: {verdict} ({counts})"
    if analysis.findings:
        f = analysis.findings[0]
        site = f.site or (f.block or {}).get("site") or "(no site recorded)"
        line += f"; first: {f.rule} at {site} (rank {f.rank}, {os.path.basename(f.file)}:{f.line})"
    print(line, flush=True)
    return code
