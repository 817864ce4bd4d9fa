"""What the HTML report draws, read from the traces in one pass per rank (the engine replaying the
same file beside it says when collectives are done): each symmetric window's blocks and
collective buffers against program order (trace line numbers).

Per rank and window (comm, ordinal):
  * coll bars: a collective's buffer inside the window, from its `coll` line to the line where the
    engine finds the collective done for the host under the analysis's `--peer-completion` mode
    (sanitizer.rules.completions: the findings' own clocks and rule), or the end of the trace when
    it never is: a bar never ends before a finding that says its collective is still in flight;
  * blocks: allocations inside the window, from `alloc` to `free` (or the end), marked transient
    when no collective buffer ever overlapped them (the transient-in-window case);
and per rank the line where each decode step starts. The engine's findings are placed on top by
the renderer. At most `max_items` bars and blocks are kept per window (the first ones in program
order), so a long trace still gives a small file; the counts say how many there were.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sanitizer.rules.completions import CompletionReplay
from sanitizer.trace.reader import TraceError, expand_paths, open_trace


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


def read_timeline(path, max_items: int = 5000, *, peer_completion: str = "local") -> RankTimeline:
    trace = open_trace(path)
    tl = RankTimeline(rank=trace.rank, file=str(path))
    ordinals: dict = {}
    live: dict = {}          # id -> block record (only blocks inside a window)
    pending: dict = {}       # id -> (addr, size, line, site): live blocks outside any window yet
    in_flight: dict = {}     # coll line -> its bars not yet done

    def done(op, at_line):
        for bar in in_flight.pop(op.line, ()):
            bar[1] = at_line

    replay = CompletionReplay(path, done, peer_completion=peer_completion)
    capturing = 0
    line = 1
    for line, ev in trace.events():
        replay.upto(line)
        if isinstance(ev, TraceError) or not isinstance(ev, dict):
            continue
        kind = ev.get("ev")
        try:
            if kind == "alloc":
                addr, size = ev["addr"], ev["size"]
                w = _window_of(tl.windows, addr)
                if w is None:
                    pending[ev["id"]] = (addr, size, line, ev.get("site"))
                    continue
                _add_block(w, ev["id"], addr, size, line, ev.get("site"), live, max_items)
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
                for bid, (addr, size, aline, site) in list(pending.items()):
                    if w.holds(addr):
                        del pending[bid]
                        _add_block(w, bid, addr, size, aline, site, live, max_items)
            elif kind == "graph_begin":
                capturing += 1
            elif kind == "graph_end":
                capturing = max(0, capturing - 1)
            elif kind == "coll" and not capturing:
                for b in ev.get("bufs") or ():
                    addr, size = b["addr"], b["size"]
                    w = _window_of(tl.windows, addr)
                    if w is None:
                        continue
                    lo, hi = addr - w.addr, addr - w.addr + size
                    for rec in live.values():
                        if rec[7] is w and rec[2] < hi and lo < rec[2] + rec[3]:
                            rec[6] = False          # a collective buffer: not a transient
                    w.coll_count += 1
                    if len(w.colls) < max_items:
                        bar = [line, None, lo, size, ev.get("op"), ev.get("cid"), b.get("access")]
                        w.colls.append(bar)
                        in_flight.setdefault(line, []).append(bar)
            elif kind == "step":
                tl.steps.append((line, ev.get("n")))
        except (KeyError, TypeError):
            continue          # a malformed line: `hazsan check` reports it; the picture skips it
    replay.close()
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


def _add_block(w, bid, addr, size, line, site, live, max_items):
    w.block_count += 1
    if len(w.blocks) >= max_items:
        return
    rec = [line, None, addr - w.addr, size, bid, site, True, w]
    w.blocks.append(rec)
    live[bid] = rec


def read_timelines(paths, max_items: int = 5000, *, peer_completion: str = "local") -> list[RankTimeline]:
    out = []
    for p in expand_paths(paths):
        try:
            out.append(read_timeline(p, max_items, peer_completion=peer_completion))
        except TraceError:
            continue        # unreadable file: the check section reports it
    return sorted(out, key=lambda t: (t.rank, t.file))
