#!/usr/bin/env python3
"""Instructions per event in the compiled engine's RankAnalyzer.feed_batch, counted by callgrind
(independent of the machine's load): the figure the engine's commits quote. `--stage` counts the
other parts of `hazsan check` the same way: reading and decoding the trace into typed records, and
the whole `analyze()`.

Stages (each a separate valgrind run; `--stage all` runs the three):

- `feed` (default): the trace is decoded first; only feed_batch is counted (valgrind
  --toggle-collect on its C function), the ranks fed round-robin a batch at a time with the
  CollectiveMatcher on when there are several, as `hazsan check` does;
- `decode`: reading every rank file and decoding it into the engine's typed records
  (`TypedEvents`, what `hazsan check` feeds its engine), no engine, the records freed batch by
  batch as `analyze()` frees them;
- `analyze`: `sanitizer.rules.driver.analyze()` on the trace, everything `hazsan check` does
  after start-up and imports (a first call on a 1-event trace made the classes and imports).

`decode` and `analyze` are counted by toggling on `builtin_divmod`, which the child calls once
with an object whose `__divmod__` runs the stage: nothing else in the process calls it.

    python benchmarks/gen_decode_trace.py --events 50000 --ranks 1 --out /tmp/d1
    python benchmarks/feed_instructions.py /tmp/d1            # 1 rank
    python benchmarks/feed_instructions.py /tmp/d1 --stage all
    python benchmarks/feed_instructions.py /tmp/d2 --peer-completion successor

Needs valgrind (callgrind_annotate) and the compiled engine built and current.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

FEED = "__pyx_f_9sanitizer_5rules_6engine_12RankAnalyzer_feed_batch"
DIVMOD = "builtin_divmod"
STAGES = ("feed", "decode", "analyze")


def feed(path: str, peer_completion: str) -> None:
    """The counted part: decode every rank file, then feed them round-robin."""
    import gc

    from sanitizer.rules.findings import FindingSink
    from sanitizer.rules.select import load_engine
    from sanitizer.trace.reader import TypedEvents, expand_paths, open_trace

    eng, kind, why = load_engine("compiled")
    paths = expand_paths([path])
    sink = FindingSink()
    matcher = eng.CollectiveMatcher(sink, enabled=len(paths) > 1, ranks={i: str(p) for i, p in enumerate(paths)})
    ranks = []
    for p in paths:
        trace = open_trace(p)
        source = TypedEvents(trace, 512)
        batches = []
        while True:
            try:
                batches.append(source.next([]))
            except StopIteration:
                break
        ranks.append((eng.RankAnalyzer(str(p), trace.rank, sink, matcher, peer_completion), batches))
    gc.disable()
    for i in range(max(len(b) for _, b in ranks)):
        for analyzer, batches in ranks:
            if i < len(batches):
                analyzer.feed_batch(batches[i][0], batches[i][1], [])
        matcher.end_round()
    matcher.finish()
    events = 0
    for analyzer, _ in ranks:
        analyzer.finish()
        events += analyzer.events
    print(f"events {events} findings {sum(sink.by_rule.values())}")


def decode(path: str) -> None:
    """The counted part (inside divmod): every rank file read and decoded, batch by batch."""
    import gc

    from sanitizer.trace.reader import TypedEvents, expand_paths, open_trace

    paths = expand_paths([path])

    class Stage:
        def __divmod__(self, _):
            events = 0
            for p in paths:
                source = TypedEvents(open_trace(p), 512)
                while True:
                    try:
                        _, items = source.next([])
                    except StopIteration:
                        break
                    events += len(items) - items.count(None)
            return events

    gc.disable()
    print(f"events {divmod(Stage(), 0)} findings -")


def analyze(path: str, peer_completion: str) -> None:
    """The counted part (inside divmod): analyze() on the trace, after one on a 1-event trace."""
    from sanitizer.rules.driver import analyze as run

    with tempfile.TemporaryDirectory() as tmp:   # warm-up: imports, the engine, the record classes
        small = os.path.join(tmp, "rank0.jsonl")
        with open(small, "w") as f:
            f.write('{"hazsan": 1, "rank": 0}\n{"ev": "launch", "stream": 1, "reads": [[0, 8]]}\n')
        run([small], engine="compiled")

    class Stage:
        def __divmod__(self, _):
            return run([path], peer_completion=peer_completion, engine="compiled")

    res = divmod(Stage(), 0)
    print(f"events {res.summary['events']} findings {len(res.findings)}")


def count(stage: str, trace: str, peer_completion: str) -> tuple[int, int]:
    """(instructions, events) of one stage, in a child process under callgrind."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        run = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                              f"--toggle-collect={FEED if stage == 'feed' else DIVMOD}", sys.executable, __file__,
                              "--child", stage, "--peer-completion", peer_completion, trace],
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(run.stderr[-2000:], file=sys.stderr)
            raise SystemExit(2)
        events = int(re.search(r"^events (\d+)", run.stdout, re.M).group(1))
        totals = subprocess.run(["callgrind_annotate", out], capture_output=True, text=True).stdout
        instructions = int(re.search(r"([\d,]+) \S*\s*PROGRAM TOTALS", totals).group(1).replace(",", ""))
    return instructions, events


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a rank file or a directory of them")
    ap.add_argument("--peer-completion", choices=("local", "successor"), default="local")
    ap.add_argument("--stage", choices=(*STAGES, "all"), default="feed",
                    help="what to count: feed (feed_batch, default), decode (reading + decoding), "
                         "analyze (the whole analyze()), all (the three)")
    ap.add_argument("--child", choices=STAGES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "feed":
        feed(args.trace, args.peer_completion)
        return 0
    if args.child == "decode":
        decode(args.trace)
        return 0
    if args.child == "analyze":
        analyze(args.trace, args.peer_completion)
        return 0
    from sanitizer.rules.select import compiled_available

    ok, why = compiled_available()
    if not ok:
        print(f"feed_instructions: {why}", file=sys.stderr)
        return 2
    for stage in (STAGES if args.stage == "all" else (args.stage,)):
        instructions, events = count(stage, args.trace, args.peer_completion)
        what = {"feed": "in feed_batch", "decode": "reading + decoding", "analyze": "in analyze()"}[stage]
        print(f"{args.trace}: {instructions:,} instructions {what}, {events:,} events, "
              f"{instructions / events:,.0f} per event ({args.peer_completion})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
