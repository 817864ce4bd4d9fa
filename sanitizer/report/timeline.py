"""What the HTML report draws, read from the traces in one pass per rank: each symmetric window's
blocks and collective buffers against program order (trace line numbers).

Per rank and window (comm, ordinal):
  * coll bars: a collective's buffer inside the window, from its `coll` line to the line where it
    is locally complete (docs/ordering-and-rules.md, "When is an op done"; the engine's StreamClocks) for the host or for the
    stream of the block it lies in (or the end of the trace: never seen done);
  * blocks: allocations inside the window, from `alloc` to `free` (or the end), marked transient
    when no collective buffer ever overlapped them (the transient-in-window case);
and per rank the line where each decode step starts. The engine's findings are placed on top by
the renderer. At most `max_items` bars and blocks are kept per window (the first ones in program
order), so a long trace still gives a small file; the counts say how many there were.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sanitizer.order.clocks import StreamClocks
from sanitizer.trace.reader import TraceError, expand_paths, open_trace

_ORDERING = frozenset(("record", "wait", "sync", "coll_done", "launch", "coll"))


@dataclass
class WindowTimeline:
    comm: object
    ordinal: int
    addr: int
    size: int
    colls: list = field(default_factory=list)     # (start line, end line, offset, size, op, cid, access)
    blocks: list = field(default_factory=list)    # [start line, end line, offset, size, id, site, transient]
    coll_count: int = 0
    block_count: int = 0

    def holds(self, addr: int) -> bool:
        return self.addr <= addr < self.addr + self.size


@dataclass
class RankTimeline:
    rank: int
    file: str
    last_line: int = 1
    windows: list = field(default_factory=list)
    steps: list = field(default_factory=list)     # (line, step n)


def _window_of(windows, addr):
    for w in windows:
        if w.holds(addr):
            return w
    return None


def read_timeline(path, max_items: int = 5000) -> RankTimeline:
    trace = open_trace(path)
    tl = RankTimeline(rank=trace.rank, file=str(path))
    ordinals: dict = {}
    live: dict = {}          # id -> block record (only blocks inside a window)
    pending: dict = {}       # id -> (addr, size, line, site): live blocks outside any window yet
    clocks = StreamClocks()
    in_flight: list = []     # [op stream, epoch, consumer stream, bar]: bars not yet done
    coll_clock: dict = {}    # cid -> the op stream's clock at enqueue (for coll_done)
    capturing = 0
    line = 1
    for line, ev in trace.events():
        if isinstance(ev, TraceError) or not isinstance(ev, dict):
            continue
        kind = ev.get("ev")
        try:
            if kind == "alloc":
                addr, size = ev["addr"], ev["size"]
                w = _window_of(tl.windows, addr)
                if w is None:
                    pending[ev["id"]] = (addr, size, line, ev.get("site"), ev.get("stream"))
                    continue
                _add_block(w, ev["id"], addr, size, line, ev.get("site"), ev.get("stream"), live, max_items)
            elif kind == "free":
                bid = ev["id"]
                pending.pop(bid, None)
                rec = live.pop(bid, None)
                if rec is not None:
                    rec[1] = line
            elif kind == "window":
                comm = ev["comm"]
                n = ordinals.get(comm, 0)
                ordinals[comm] = n + 1
                w = WindowTimeline(comm, n, ev["addr"], ev["size"])
                tl.windows.append(w)
                for bid, (addr, size, aline, site, stream) in list(pending.items()):
                    if w.holds(addr):
                        del pending[bid]
                        _add_block(w, bid, addr, size, aline, site, stream, live, max_items)
            elif kind == "graph_begin":
                capturing += 1
            elif kind == "graph_end":
                capturing = max(0, capturing - 1)
            elif kind == "coll" and not capturing:
                stream = ev["stream"]
                epoch = clocks.enqueue(stream)
                coll_clock[ev.get("cid")] = clocks.snapshot(stream)
                for b in ev.get("bufs") or ():
                    addr, size = b["addr"], b["size"]
                    w = _window_of(tl.windows, addr)
                    if w is None:
                        continue
                    lo, hi = addr - w.addr, addr - w.addr + size
                    consumer = None
                    for rec in live.values():
                        if rec[8] is w and rec[2] < hi and lo < rec[2] + rec[3]:
                            rec[6] = False          # a collective buffer: not a transient
                            consumer = rec[7]
                    w.coll_count += 1
                    if len(w.colls) < max_items:
                        bar = [line, None, lo, size, ev.get("op"), ev.get("cid"), b.get("access")]
                        w.colls.append(bar)
                        in_flight.append([stream, epoch, consumer, bar])
            elif kind == "launch" and not capturing:
                clocks.enqueue(ev["stream"])
            elif kind == "record":
                clocks.record(ev["event"], ev["stream"])
            elif kind == "wait":
                clocks.wait(ev["stream"], ev["event"])
            elif kind == "sync":
                if "event" in ev:
                    clocks.sync_event(ev["event"])
                elif "stream" in ev:
                    clocks.sync_stream(ev["stream"])
                else:
                    clocks.sync_device()
            elif kind == "coll_done":
                clock = coll_clock.pop(ev.get("cid"), None)
                if clock is not None:
                    clocks.host_learns(clock)
            elif kind == "step":
                tl.steps.append((line, ev.get("n")))
            if in_flight and kind in _ORDERING:
                still = []
                for item in in_flight:
                    op_stream, epoch, consumer, bar = item
                    if (clocks.knows(None, op_stream) >= epoch
                            or (consumer is not None and consumer != op_stream
                                and clocks.is_done_for(op_stream, epoch, consumer))):
                        bar[1] = line
                    else:
                        still.append(item)
                in_flight = still
        except (KeyError, TypeError):
            continue          # a malformed line: `hazsan check` reports it; the picture skips it
    tl.last_line = line
    for w in tl.windows:
        for bar in w.colls:
            if bar[1] is None:
                bar[1] = line
        for rec in w.blocks:
            if rec[1] is None:
                rec[1] = line
    # the window back-reference is only needed while reading
    for w in tl.windows:
        w.blocks = [rec[:7] for rec in w.blocks]
    trace.close()
    return tl


def _add_block(w, bid, addr, size, line, site, stream, live, max_items):
    w.block_count += 1
    if len(w.blocks) >= max_items:
        return
    rec = [line, None, addr - w.addr, size, bid, site, True, stream, w]
    w.blocks.append(rec)
    live[bid] = rec


def read_timelines(paths, max_items: int = 5000) -> list[RankTimeline]:
    out = []
    for p in expand_paths(paths):
        try:
            out.append(read_timeline(p, max_items))
        except TraceError:
            continue        # unreadable file: the check section reports it
    return sorted(out, key=lambda t: (t.rank, t.file))
