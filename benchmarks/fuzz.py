"""Longer fuzz run of hazsan's readers: mutated traces (JSON Lines and binary, alternating) through
check, place, sweep and cat, hostile logs through logscan (issues 14, 21). Not a test: the suite runs bounded versions of the same inputs.

    .venv/bin/python benchmarks/fuzz.py --inputs 2000 --seed 1
    .venv/bin/python benchmarks/fuzz.py --inputs 500 --seed 7 --commands check --ranks 2 --subprocess-every 50

Inputs come from tests/support/hostile_inputs.py (a small trace grammar, then fields swapped for lists,
objects, 64-bit edges, lines cut, garbage lines; SGLang-like logs with inf/nan/huge values and
comma floods). Each command runs in this process through `sanitizer.cli.main` (an exception that
escapes is the traceback a user would see) and, every --subprocess-every inputs, as a real
`python -m sanitizer` process whose stderr must hold no traceback. A crash is an escaped
exception, an exit code outside {0, 1, 2}, or a run longer than --slow seconds. Prints inputs per
command, exit codes, crash kinds with the seed that reproduces each, and the slowest input.
Exit status 1 when anything crashed.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from hostile_inputs import log_lines, trace_binary, trace_lines  # noqa: E402

from sanitizer.cli import RAISE_ENV, main as hazsan  # noqa: E402

# an internal error must escape (and show in a subprocess's stderr), not end as a quiet exit 2
os.environ[RAISE_ENV] = "1"

COMMANDS = ("check", "place", "sweep", "cat", "logscan")


def _argv(cmd: str, d: Path, files: list[Path]) -> list[str]:
    if cmd == "check":
        return ["check", *map(str, files), "--format", "json"]
    if cmd == "place":
        return ["place", str(files[0]), "--out", str(d / "placed"), "--quiet"]
    if cmd == "sweep":
        return ["sweep", str(files[0]), "--scale", "1,2", "--repeat", "1"]
    if cmd == "cat":
        return ["cat", *map(str, files)]
    return ["logscan", str(files[0]), "--format", "json"]


def _inputs(cmd: str, rng: random.Random, d: Path, ranks: int, fmt: str = "jsonl") -> list[Path]:
    if cmd == "logscan":
        p = d / "server.log"
        p.write_text(log_lines(rng, 40), encoding="utf-8")
        return [p]
    files = []
    for r in range(ranks if cmd in ("check", "cat") else 1):
        rate = rng.choice((0.0, 0.0, 0.01, 0.05, 0.2))
        if fmt == "binary":
            p = d / f"rank{r}.hzs"
            p.write_bytes(trace_binary(rng, rank=r, events=80, mutation_rate=rate))
        else:
            p = d / f"rank{r}.jsonl"
            p.write_bytes(trace_lines(rng, rank=r, events=80, mutation_rate=rate))
        files.append(p)
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=1000, help="inputs per command (default 1000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--commands", default=",".join(COMMANDS))
    ap.add_argument("--ranks", type=int, default=2, help="rank files per check input (default 2)")
    ap.add_argument("--subprocess-every", type=int, default=100, metavar="K",
                    help="also run every K-th input as a real process (0: never)")
    ap.add_argument("--slow", type=float, default=10.0, help="seconds after which an input counts as a hang")
    ap.add_argument("--formats", default="jsonl,binary",
                    help="trace formats, inputs alternate between them (default jsonl,binary; "
                         "binary: tests/support/hostile_inputs.trace_binary)")
    args = ap.parse_args(argv)
    commands = [c for c in args.commands.split(",") if c]
    formats = [f for f in args.formats.split(",") if f in ("jsonl", "binary")] or ["jsonl"]
    crashes: dict[tuple, list] = {}
    codes: dict[str, Counter] = {c: Counter() for c in commands}
    slowest = (0.0, None)
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hazsan-fuzz-") as tmp:
        for cmd in commands:
            for k in range(args.inputs):
                seed = args.seed * 1_000_003 + k
                rng = random.Random(f"{cmd}:{seed}")
                d = Path(tmp) / f"{cmd}-{k}"
                d.mkdir()
                fmt = formats[k % len(formats)]
                argv = _argv(cmd, d, _inputs(cmd, rng, d, args.ranks, fmt))
                t0 = time.monotonic()
                try:
                    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                        code = hazsan(argv)
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 2
                except BaseException as exc:  # noqa: BLE001 - any escape is the finding
                    frame = traceback.extract_tb(exc.__traceback__)[-1]
                    key = (cmd, type(exc).__name__, f"{Path(frame.filename).name}:{frame.lineno}")
                    crashes.setdefault(key, []).append(seed)
                    code = "crash"
                spent = time.monotonic() - t0
                if spent > slowest[0]:
                    slowest = (spent, f"{cmd} seed {seed}")
                if spent > args.slow:
                    crashes.setdefault((cmd, "slow", f">{args.slow:g}s"), []).append(seed)
                if code not in (0, 1, 2, "crash"):
                    crashes.setdefault((cmd, "exit", str(code)), []).append(seed)
                codes[cmd][code] += 1
                if args.subprocess_every and k % args.subprocess_every == 0:
                    r = subprocess.run([sys.executable, "-m", "sanitizer", *argv], capture_output=True,
                                       text=True, timeout=max(60.0, args.slow * 6))
                    if r.returncode not in (0, 1, 2) or "Traceback" in r.stderr:
                        crashes.setdefault((cmd, "process", f"exit {r.returncode}"), []).append(seed)
                    codes[cmd]["process-runs"] += 1
                for p in sorted(d.rglob("*"), reverse=True):
                    p.rmdir() if p.is_dir() else p.unlink()
                d.rmdir()
    total = sum(args.inputs for _ in commands)
    print(f"hazsan fuzz: {total:,} inputs ({args.inputs:,} per command), seed {args.seed}, "
          f"{time.monotonic() - t_start:.0f} s; python {sys.version.split()[0]}, engine "
          f"{os.environ.get('HAZSAN_ENGINE', 'auto')}")
    for cmd in commands:
        print(f"  {cmd:8} exit codes: {dict(sorted(codes[cmd].items(), key=str))}")
    print(f"  slowest input: {slowest[0]:.2f} s ({slowest[1]})")
    if not crashes:
        print("  crashes: none")
        return 0
    print(f"  crashes: {len(crashes)} kind(s)")
    for (cmd, what, where), seeds in sorted(crashes.items()):
        print(f"    {cmd}: {what} at {where}: {len(seeds)} input(s), e.g. seed {seeds[0]}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
