#!/usr/bin/env python3
"""Instructions per event in the compiled engine's RankAnalyzer.feed_batch, counted by callgrind
(independent of the machine's load): the figure the engine's commits quote.

The trace is decoded first; only feed_batch is counted (valgrind --toggle-collect on its C
function), the ranks fed round-robin a batch at a time with the CollectiveMatcher on when there
are several, as `hazsan check` does.

    python benchmarks/gen_decode_trace.py --events 50000 --ranks 1 --out /tmp/d1
    python benchmarks/feed_instructions.py /tmp/d1            # 1 rank
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a rank file or a directory of them")
    ap.add_argument("--peer-completion", choices=("local", "successor"), default="local")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        feed(args.trace, args.peer_completion)
        return 0
    from sanitizer.rules.select import compiled_available

    ok, why = compiled_available()
    if not ok:
        print(f"feed_instructions: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        run = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                              f"--toggle-collect={FEED}", sys.executable, __file__, "--child",
                              "--peer-completion", args.peer_completion, args.trace],
                             capture_output=True, text=True)
        if run.returncode != 0:
            print(run.stderr[-2000:], file=sys.stderr)
            return 2
        events = int(re.search(r"^events (\d+)", run.stdout, re.M).group(1))
        totals = subprocess.run(["callgrind_annotate", out], capture_output=True, text=True).stdout
        instructions = int(re.search(r"([\d,]+) \S*\s*PROGRAM TOTALS", totals).group(1).replace(",", ""))
    print(f"{args.trace}: {instructions:,} instructions in feed_batch, {events:,} events, "
          f"{instructions / events:,.0f} per event ({args.peer_completion})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
