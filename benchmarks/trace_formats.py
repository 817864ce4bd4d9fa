#!/usr/bin/env python3
"""JSON Lines against the binary trace format, side by side in one run (issue 21, part 2).

On the synthetic decode trace (gen_decode_trace.py), the same events in JSON Lines, in the binary
format as capture writes it (version 2: call sites, ops, shapes interned), and in the binary format
with every value in place (what version 1 wrote, and what interning saves), everything pinned to
one core:

1. size: bytes per event on disk, plain and gzip (level 1);
2. capture's cost: the writer's encoding of a flush (what TraceWriter.flush does to its buffered
   dicts: orjson per event, or msgpack items in frames), and emit -> flush -> close through a real
   TraceWriter into a file (the buffer's flushes at 65,536 events and the writes included), in CPU
   microseconds per event;
3. reading: the file read and decoded into the engine's typed records (sanitizer.trace.reader.
   TypedEvents, no engine), microseconds per event;
4. end to end: `hazsan check TRACE --format json` in a subprocess pinned to the core (interpreter
   start-up included), events/s wall and CPU, and `analyze()` in this process (best of --repeats);
   the findings of both must be identical (exit 1 otherwise).

    .venv/bin/python benchmarks/trace_formats.py                       # 2,000,000 events
    .venv/bin/python benchmarks/trace_formats.py --events 300000 --repeats 2
"""
from __future__ import annotations

import argparse
import gzip
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))

import check_throughput as ct  # noqa: E402
import gen_decode_trace as gen  # noqa: E402

TARGET = 1_500_000


class _Collect:
    """A stand-in for the generator's writer: keeps the events (dicts, with their `t`)."""

    def __init__(self, limit: int):
        self.limit, self.events, self.t = limit, [], 1_000_000_000

    @property
    def next_line(self) -> int:
        return len(self.events) + 2

    @property
    def full(self) -> bool:
        return len(self.events) >= self.limit

    def emit(self, ev: dict) -> None:
        self.t += 900 + (len(self.events) * 7919) % 1300
        ev["t"] = self.t
        self.events.append(ev)


def capture_events(count: int, seed: int) -> list[dict]:
    sink = _Collect(count)
    gen.DecodeRank(0, sink, seed, {}, False).run()
    return sink.events[:count]


def best(fn, repeats: int) -> tuple[float, float, object]:
    """(best CPU seconds, its wall seconds, the last result)."""
    runs, result = [], None
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        result = fn()
        runs.append((time.process_time() - c, time.perf_counter() - w))
    cpu, wall = min(runs)
    return cpu, wall, result


def _writer(directory, fmt: str, **kw):
    """A TraceWriter for `fmt`; "inplace": binary with no value table (every value in place)."""
    from sanitizer.trace import binary as B
    from sanitizer.trace.writer import TraceWriter

    w = TraceWriter(directory, trace_format="binary" if fmt == "inplace" else fmt, **kw)
    if fmt == "inplace":
        w._encode = lambda part: B.encode_frames(part)
    return w


def encode_cost(events: list[dict], fmt: str, repeats: int) -> float:
    """CPU seconds to encode the events as a flush does (slices of the writer's size); the value
    table persists from run to run, as it does from flush to flush: the best run is the steady state."""
    from sanitizer.trace.writer import _ENCODE_SLICE

    w = _writer(tempfile.gettempdir(), fmt)
    encode = w._encode

    def run():
        for i in range(0, len(events), _ENCODE_SLICE):
            encode(events[i:i + _ENCODE_SLICE])

    return best(run, repeats)[0]


def writer_cost(events: list[dict], fmt: str, repeats: int) -> float:
    """CPU seconds for emit of every event, the flushes on a full buffer, and close, into a file."""
    def run():
        with tempfile.TemporaryDirectory() as d:
            w = _writer(d, fmt, flush_seconds=1e9)
            w.set_rank(0, 1)
            emit = w.emit
            for ev in events:          # the writer keeps the dicts as they are: no copy needed
                emit(ev)
            w.close()

    return best(run, repeats)[0]


def read_cost(path: Path, repeats: int) -> tuple[float, int]:
    """CPU seconds to read and decode the file into typed records, and the events seen."""
    from sanitizer.trace.reader import TypedEvents, open_trace

    def run():
        src = TypedEvents(open_trace(path))
        problems: list = []
        n = 0
        try:
            while True:
                n += len(src.next(problems)[1])
        except StopIteration:
            pass
        assert not problems, problems[:3]
        return n

    cpu, _, n = best(run, repeats)
    return cpu, n


def analyze_cost(path: Path, repeats: int):
    from sanitizer.rules.driver import analyze

    cpu, wall, a = best(lambda: analyze([path]), repeats)
    return cpu, wall, a


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--events", type=int, default=2_000_000, help="events in the trace (default 2,000,000)")
    ap.add_argument("--capture-events", type=int, default=200_000,
                    help="events encoded for capture's cost (default 200,000)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="best of N for the in-process timings (default 3)")
    ap.add_argument("--trace-dir", type=Path, default=Path(tempfile.gettempdir()) / "hazsan-bench",
                    help="where the generated traces are kept and reused (default: %(default)s)")
    ap.add_argument("--regenerate", action="store_true")
    ap.add_argument("--core", type=int, default=None, help="CPU core to pin to (default: the last one allowed)")
    args = ap.parse_args(argv)

    allowed = sorted(os.sched_getaffinity(0))
    core = allowed[-1] if args.core is None else args.core
    os.sched_setaffinity(0, {core})
    import msgspec

    print("== hazsan trace formats: JSON Lines vs binary (benchmarks/trace_formats.py)")
    print(f"machine: {ct.cpu_model()}, {os.cpu_count()} logical CPUs, pinned to core {core}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"python {platform.python_version()}, orjson {orjson.__version__}, msgspec {msgspec.__version__}, "
          f"hazsan at {ct.git_head()}")

    paths = {}
    for fmt in ("jsonl", "binary"):
        out = args.trace_dir / f"decode-e{args.events}-r1-i0-s{args.seed}-{fmt}"
        suffix = ".hzs" if fmt == "binary" else ".jsonl"
        meta = out / "meta.json"
        fresh = args.regenerate or not meta.exists() or not (out / f"rank0{suffix}").exists() or \
            orjson.loads(meta.read_bytes()).get("generator_version") != gen.GENERATOR_VERSION
        if fresh:
            gen.generate(out, events=args.events, seed=args.seed, fmt=fmt)
        paths[fmt] = out / f"rank0{suffix}"
    inplace = args.trace_dir / f"decode-e{args.events}-r1-i0-s{args.seed}-binary" / "inplace" / "rank0.hzs"
    if not inplace.exists() or inplace.stat().st_mtime < paths["binary"].stat().st_mtime:
        from sanitizer.trace import binary as B
        from sanitizer.trace.reader import open_trace

        inplace.parent.mkdir(exist_ok=True)
        tf = open_trace(paths["binary"])
        inplace.write_bytes(B.jsonl_to_binary(tf.header, (ev for _, ev in tf.events()), intern=False))
    paths["inplace"] = inplace

    n = args.events
    rows = {}
    events = capture_events(args.capture_events, args.seed)
    k = len(events)
    for fmt in ("jsonl", "binary", "inplace"):
        p = paths[fmt]
        size = p.stat().st_size
        with open(p, "rb") as f:
            packed = len(gzip.compress(f.read(), 1))
        enc = encode_cost(events, fmt, args.repeats)
        wr = writer_cost(events, fmt, args.repeats)
        rd, seen = read_cost(p, args.repeats)
        assert seen == n, (fmt, seen, n)
        a_cpu, a_wall, a = analyze_cost(p, args.repeats)
        cli = ct.run_check(p, core, "local")
        rows[fmt] = {"size": size, "gz": packed, "enc": enc / k * 1e6, "writer": wr / k * 1e6,
                     "read": rd / n * 1e6, "a_cpu": a_cpu, "a_wall": a_wall, "analysis": a, "cli": cli}

    def line(label, fn, unit=""):
        j, b, i = fn(rows["jsonl"]), fn(rows["binary"]), fn(rows["inplace"])
        print(f"  {label:54s} {j:>12} {b:>12} {i:>16}{unit}")

    print()
    print(f"trace: {n:,} events of the decode trace (seed {args.seed}); capture's cost on its first {k:,} events")
    print(f"  {'':54s} {'JSON Lines':>12} {'binary':>12} {'binary, in place':>16}")
    line("file size, MiB", lambda r: f"{r['size'] / 2**20:,.1f}")
    line("bytes per event", lambda r: f"{r['size'] / n:.1f}")
    line("gzip -1, bytes per event", lambda r: f"{r['gz'] / n:.1f}")
    line("capture: encoding a flush, us/event (CPU)", lambda r: f"{r['enc']:.3f}")
    line("capture: emit + flush + close into a file, us/event", lambda r: f"{r['writer']:.3f}")
    line("read + decode into typed records, us/event (CPU)", lambda r: f"{r['read']:.3f}")
    line("analyze() in process, us/event (CPU)", lambda r: f"{r['a_cpu'] / n * 1e6:.3f}")
    line("analyze() in process, events/s (CPU)", lambda r: f"{n / r['a_cpu']:,.0f}")
    line("hazsan check (CLI, one core), s wall", lambda r: f"{r['cli']['wall']:.2f}")
    line("hazsan check (CLI, one core), events/s wall", lambda r: f"{n / r['cli']['wall']:,.0f}")
    line("hazsan check (CLI, one core), events/s CPU", lambda r: f"{n / r['cli']['cpu']:,.0f}")
    line("hazsan check peak RSS, MB", lambda r: f"{r['cli']['peak_rss_mb']:,.0f}")
    rate = n / rows["binary"]["cli"]["wall"]
    print(f"  binary end to end: {rate:,.0f} events/s wall, target >= {TARGET:,}: {ct.verdict(rate >= TARGET)}")

    def comparable(a):
        return ([{k: v for k, v in f.to_dict().items() if k != "file"} for f in a.findings],
                {k: v for k, v in a.summary.items() if k != "warnings"})

    same = all(comparable(rows["jsonl"]["analysis"]) == comparable(rows[f]["analysis"]) and
               rows["jsonl"]["cli"]["report"]["summary"]["by_rule"] == rows[f]["cli"]["report"]["summary"]["by_rule"]
               for f in ("binary", "inplace"))
    print(f"  same findings and summary from all three: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
