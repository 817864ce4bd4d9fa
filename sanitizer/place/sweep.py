"""Replay one recorded decode step at other token counts, to separate hazard from collision.

A collision (`reuse-in-flight`) happens only when the allocator happens to hand a block in use by
a collective to someone else, and that depends on pool occupancy, i.e. on the batch shape. The
hazard (`free-in-flight`, `transient-in-window`) is in the program order and is there at every
shape. The sweep shows both, per shape.

Scaling: the chosen step's `alloc` events that carry `shape` get their first dimension equal to the
step's `tokens` multiplied by the scale (or the dimensions listed in `token_dims`, when the capture
recorded them); the size follows the element count. Buffers inside such a block keep their relative
position (offset and size scale with the block). Allocations without `shape` keep their size.

Trace built for each scale, per rank: the events before the first `step` marker (set-up: windows,
weights, caches) unchanged, then the chosen step `repeat` times with fresh ids, cids, sequence
numbers and graph ids per repetition, so that a later repetition's allocations meet the previous
one's collectives, as consecutive decode steps do. Frees of blocks allocated in earlier steps that
the sweep leaves out are dropped (counted). Each trace is placed with the allocator model, then
analysed by the engine.
"""
from __future__ import annotations

import bisect
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from .config import AllocatorConfig
from .records import RecordDicts, records
from .replay import PlaceError, place_file

SYNTH_BASE = 1 << 50      # fresh input addresses for scaled blocks (placement rewrites them anyway)
LATENT_RULES = ("free-in-flight", "transient-in-window")
REALISED_RULES = ("reuse-in-flight",)


class SweepError(Exception):
    pass


@dataclass
class ScaleResult:
    scale: float
    tokens: int
    by_rule: dict
    findings: list
    allocs_scaled: int = 0
    allocs_unscaled: int = 0
    dropped: int = 0
    segments: int = 0
    warnings: list = field(default_factory=list)
    recorded_step: int = 0      # n of the replayed step (a finding's step minus it: its repetition)

    @property
    def realised(self) -> int:
        return sum(self.by_rule.get(r, 0) for r in REALISED_RULES)

    @property
    def latent(self) -> int:
        return sum(self.by_rule.get(r, 0) for r in LATENT_RULES)

    @property
    def verdict(self) -> str:
        if self.realised:
            return "COLLIDES"
        if self.latent:
            return "latent hazard"
        return "clean" if not self.by_rule else "other findings"


def _read(path: Path, limits):
    """The header and the (line, event dict) pairs of one rank file, read as `hazsan check` and
    `hazsan place` read it (place.records): a line check refuses is a TraceError naming this
    file and line, before anything is scaled."""
    from sanitizer.trace.reader import TypedEvents, open_trace

    tf = open_trace(path, limits)
    source = TypedEvents(tf)
    as_dict = RecordDicts()
    try:
        events = [(line, as_dict(rec)) for line, rec in records(source, path)]
    finally:
        tf.close()
        source.forget()
    return tf.header, events


def split_step(events, step: int | None):
    """(prologue, step marker, step events) for step n == `step` (default: first with tokens).

    The prologue is what precedes the first `step` marker of the trace; steps between it and the
    chosen one are left out."""
    prologue, marker, body = [], None, []
    seen_step = False
    for _line, ev in events:
        if not isinstance(ev, dict):
            continue
        if ev.get("ev") == "step":
            if marker is not None:
                break
            seen_step = True
            if (step is None and isinstance(ev.get("tokens"), int)) or (step is not None and ev.get("n") == step):
                marker = ev
            continue
        if marker is not None:
            body.append(ev)
        elif not seen_step:
            prologue.append(ev)
    if marker is None:
        raise SweepError(f"no step marker {'with tokens' if step is None else f'n={step}'} found")
    tokens = marker.get("tokens")
    if not isinstance(tokens, int) or tokens <= 0:
        raise SweepError(f"step {marker.get('n')} has no positive integer 'tokens' field")
    return prologue, marker, body


class _Scaler:
    """Builds the scaled event list for one rank and one scale."""

    def __init__(self, prologue, marker, body, scale: float, repeat: int, schedule=None):
        self.prologue, self.marker, self.body = prologue, marker, body
        self.tokens = marker["tokens"]
        # schedule: one token count per repetition (a server's steps, in order); else `repeat`
        # repetitions at one scale
        self.schedule = list(schedule) if schedule else [max(1, round(self.tokens * scale))] * repeat
        self.repeat = len(self.schedule)
        self._at(0)
        self.prologue_ids = {e.get("id") for e in prologue if e.get("ev") == "alloc"}
        self.step_ids = {e.get("id") for e in body if e.get("ev") == "alloc"}
        self.step_graphs = {e.get("graph") for e in body if e.get("ev") == "graph_begin"}
        spans: dict = {}
        for e in body:
            if e.get("ev") == "coll" and isinstance(e.get("seq"), int):
                lo, hi = spans.get(e.get("comm"), (e["seq"], e["seq"]))
                spans[e.get("comm")] = (min(lo, e["seq"]), max(hi, e["seq"]))
        self.seq_span = {c: hi - lo + 1 for c, (lo, hi) in spans.items()}
        self.cursor = SYNTH_BASE
        self.scaled = self.unscaled = self.dropped = 0

    def _ratio(self, ev) -> tuple[float, list | None]:
        shape = ev.get("shape")
        if not isinstance(shape, list) or not shape or not all(isinstance(d, int) for d in shape):
            return 1.0, None
        dims = ev.get("token_dims")
        if not isinstance(dims, list):
            # the first dimension equal to the token count (the flattened batch*seq dimension
            # leads in serving code; a later equal dimension, e.g. 4 heads at 4 tokens, is not it)
            dims = [i for i, d in enumerate(shape) if d == self.tokens][:1]
        new = list(shape)
        for i in dims:
            if isinstance(i, int) and 0 <= i < len(new):
                new[i] = self.new_tokens if shape[i] == self.tokens else max(1, round(shape[i] * self.scale))
        old_n, new_n = math.prod(shape), math.prod(new)
        if old_n <= 0 or not dims:
            return 1.0, None
        return new_n / old_n, new

    def _at(self, k: int) -> None:
        """Repetition k's token count and scale."""
        self.new_tokens = self.schedule[k]
        self.scale = self.new_tokens / self.tokens

    def build(self) -> list[dict]:
        out = list(self.prologue)
        for k in range(self.repeat):
            self._at(k)
            out.extend(self._repetition(k))
        self._at(0)
        return out

    def _repetition(self, k: int) -> list[dict]:
        ranges_start: list[int] = []
        ranges: list[tuple] = []        # (old_start, old_end, new_start, ratio)
        # (the scale and the recorded token count go in the header: no extra fields on events)
        out = [{**self.marker, "n": (self.marker.get("n") or 0) + k, "tokens": self.new_tokens}]

        def rid(x):
            return f"{x}@{k}" if x in self.step_ids else x

        def map_buf(addr, size):
            j = bisect.bisect_right(ranges_start, addr) - 1
            if j >= 0 and addr < ranges[j][1]:
                o0, _, n0, r = ranges[j]
                return n0 + int((addr - o0) * r), max(1, math.ceil(size * r)) if size else size
            return addr, size

        for ev in self.body:
            kind = ev.get("ev")
            e = dict(ev)
            if "step" in e and isinstance(e["step"], int):
                e["step"] = e["step"] + k
            if kind == "step":
                continue
            if kind == "alloc":
                ratio, new_shape = self._ratio(ev)
                size = ev.get("size", 0)
                if not isinstance(size, int):
                    raise SweepError(f"alloc {ev.get('id')!r} has no integer size")
                new_size = max(0, math.ceil(size * ratio))
                if new_shape is None:
                    self.unscaled += k == 0
                else:
                    self.scaled += k == 0
                    e["shape"] = new_shape
                new_addr = self.cursor
                self.cursor += max(new_size, 1) + 4096
                e.update(id=rid(ev.get("id")), addr=new_addr, size=new_size)
                if isinstance(ev.get("requested"), int):
                    e["requested"] = min(new_size, max(0, math.ceil(ev["requested"] * ratio)))
                old = ev.get("addr")
                if isinstance(old, int):
                    j = bisect.bisect_left(ranges_start, old)
                    # the CPU allocator reuses addresses: the newest block at an address wins
                    while j < len(ranges_start) and ranges_start[j] < old + max(size, 1):
                        del ranges_start[j], ranges[j]
                    if j > 0 and ranges[j - 1][1] > old:
                        del ranges_start[j - 1], ranges[j - 1]
                        j -= 1
                    ranges_start.insert(j, old)
                    ranges.insert(j, (old, old + max(size, 1), new_addr, ratio))
            elif kind in ("free", "record_stream", "free_done"):
                bid = ev.get("id")
                if bid in self.step_ids:
                    e["id"] = rid(bid)
                elif bid in self.prologue_ids and k == 0:
                    pass
                else:
                    self.dropped += k == 0
                    continue
            elif kind == "launch":
                for key in ("reads", "writes"):
                    if isinstance(ev.get(key), list):
                        e[key] = [list(map_buf(a, s)) for a, s in ev[key]]
            elif kind == "coll":
                e["cid"] = f"{ev.get('cid')}@{k}"
                if isinstance(ev.get("seq"), int):
                    e["seq"] = ev["seq"] + k * self.seq_span.get(ev.get("comm"), 0)
                if isinstance(ev.get("bufs"), list):
                    nb = []
                    for b in ev["bufs"]:
                        a, s = map_buf(b["addr"], b.get("size", 0))
                        nb.append({**b, "addr": a, "size": s})
                    e["bufs"] = nb
            elif kind == "coll_done":
                e["cid"] = f"{ev.get('cid')}@{k}"
            elif kind in ("graph_begin", "graph_end", "graph_replay", "graph_free"):
                if ev.get("graph") in self.step_graphs:
                    e["graph"] = f"{ev.get('graph')}@{k}"
            elif kind == "window" and isinstance(ev.get("addr"), int):
                e["addr"], _ = map_buf(ev["addr"], ev.get("size", 0))
            out.append(e)
        return out


def sweep(paths, scales, *, step=None, repeat: int = 2, config: AllocatorConfig | None = None,
          peer_completion: str = "local", workdir=None, no_split_pools=(), schedule=None,
          limits=None) -> list[ScaleResult]:
    """Run the sweep; returns one ScaleResult per scale (in the order given).

    With `schedule` (token counts), `scales` is ignored: the step is replayed once per listed
    token count, in order, as a server's consecutive steps, and one ScaleResult comes back
    (scale 1.0, `tokens` the first count); a finding's `step` minus the recorded step's `n` is
    its index in the schedule. `limits` (sanitizer.limits.Limits; default: its defaults): what
    reading the input and analysing the placed traces may cost."""
    if schedule:
        schedule = [int(t) for t in schedule]
        if not all(t > 0 for t in schedule):
            raise SweepError("every token count of the schedule must be positive")
        scales = [1.0]
    from sanitizer.rules.driver import analyze
    from sanitizer.trace.reader import TraceError, expand_paths

    config = config or AllocatorConfig()
    files = expand_paths(paths)
    ranks = []
    skipped = []
    for f in files:
        header, events = _read(f, limits)
        if not any(isinstance(ev, dict) and ev.get("ev") == "step" for _, ev in events):
            # a process that ran no step (a server's front end, an engine core without the model)
            skipped.append(f)
            continue
        try:
            ranks.append((f, header, *split_step(events, step)))
        except SweepError as exc:
            raise SweepError(f"{f}: {exc}") from None
    if not ranks:
        raise SweepError(f"no trace file has a step marker ({len(skipped)} file(s) without one)")
    tmp = tempfile.TemporaryDirectory(prefix="hazsan-sweep-") if workdir is None else None
    root = Path(workdir or tmp.name)
    results = []
    try:
        for scale in scales:
            tag = f"x{scale:g}"
            raw_dir, placed_dir = root / tag / "raw", root / tag / "placed"
            raw_dir.mkdir(parents=True, exist_ok=True)
            placed_dir.mkdir(parents=True, exist_ok=True)
            res = None
            segments = 0
            for f, header, prologue, marker, body in ranks:
                sc = _Scaler(prologue, marker, body, scale, repeat, schedule)
                evs = sc.build()
                name = f.name[:-3] if f.name.endswith(".gz") else f.name
                with open(raw_dir / name, "wb") as fh:
                    head = {**{k: v for k, v in header.items() if k != "end_record"}, "sweep": {
                        "scale": scale, "source": str(f), "step": marker.get("n"),
                        "recorded_tokens": marker["tokens"], "tokens": sc.new_tokens, "repeat": sc.repeat,
                        **({"schedule": schedule} if schedule else {})}}
                    for e in (head, *evs):
                        try:
                            fh.write(orjson.dumps(e) + b"\n")
                        except TypeError as exc:  # an int past 64 bits (hostile sizes, shapes, token counts)
                            what = (f"{e.get('ev')} {e.get('id')!r}" if "id" in e else str(e.get("ev"))) \
                                if e is not head else "header (step, token count)"
                            raise SweepError(f"{f}: scale {scale:g}: the scaled {what} is out of range "
                                             f"({exc})") from None
                try:
                    stats = place_file(raw_dir / name, placed_dir / name, config, no_split_pools=no_split_pools,
                                       limits=limits)
                except (TraceError, PlaceError) as exc:
                    # the input was read whole above: what fails here is the scaled trace (a size
                    # scaled past the format's bounds, a block the model cannot fit), in a
                    # temporary file the message should not send the user to
                    where = f"line {exc.line} of the scaled trace" if exc.line else "the scaled trace"
                    raise SweepError(f"{f}: scale {scale:g}: {where}: {exc.message}") from None
                segments += stats.segments
                if res is None:
                    res = ScaleResult(scale, sc.new_tokens, {}, [], recorded_step=marker.get("n") or 0)
                res.allocs_scaled += sc.scaled
                res.allocs_unscaled += sc.unscaled
                res.dropped += sc.dropped
                res.warnings.extend(stats.notes)
            analysis = analyze([placed_dir], peer_completion=peer_completion, limits=limits)
            if analysis.errors:
                raise SweepError(f"scale {scale:g}: the engine rejected the placed trace: {analysis.errors[0]}")
            res.by_rule = dict(analysis.summary.get("by_rule", {}))
            res.findings = analysis.findings
            res.segments = segments
            results.append(res)
    finally:
        if tmp is not None:
            tmp.cleanup()
    return results
