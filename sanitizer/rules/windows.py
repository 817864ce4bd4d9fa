"""The live windows and transient-in-window's bookkeeping (docs/ordering-and-rules.md,
"transient-in-window"): `WindowTable`, the windows a rank registered and has not freed;
`BlockSet`, the live blocks inside them; `WindowBlocks`, the two together with whether a
collective touched each window block during its life, and the findings of those freed untouched.

A rank usually has a few windows and a few window blocks live: each set is a list while small and
an address index (sanitizer.rules.intervals.RangeIndex) past that, until it empties.

Compiled by Cython with the engine (types in windows.pxd beside it; buildinfo.COMPILED).
"""
from __future__ import annotations

from sanitizer.rules.findings import BlockRecord, Finding, severity_of
from sanitizer.rules.intervals import RangeIndex
from sanitizer.rules.records import Window

#: Collective buffers outside windows logged before they are marked on the blocks they touch
#: (WindowBlocks.mark_coll_touched).
TOUCH_LOG = 4096


class WindowTable:
    """The live windows: the first registered of those overlapping a range, and the one a
    `window_free` names, by (addr, comm); neither costs O(windows). A rank usually has a few
    windows: while there are at most SMALL, a list in registration order answers (cheaper than
    the index); past that the address index does, until no window is left."""

    __slots__ = ("index", "by_key", "count", "small")

    SMALL = 8

    def __init__(self):
        self.index = RangeIndex()
        self.by_key: dict = {}  # (addr, comm) -> its live windows, first registered first
        self.count = 0
        self.small: list | None = []  # the live windows in registration order, while few

    def add(self, w) -> None:
        self.index.add(w.addr, w.end, w)
        key = (w.addr, w.comm)
        same = self.by_key.get(key)
        if same is None:
            self.by_key[key] = [w]
        else:
            same.append(w)
        self.count += 1
        if self.small is not None:
            if self.count > self.SMALL:
                self.small = None
            else:
                self.small.append(w)

    def remove(self, addr, comm) -> bool:
        """Drop the first registered live window at `addr` of `comm`; False when there is none."""
        key = (addr, comm)
        same = self.by_key.get(key)
        if same is None:
            return False
        w = same.pop(0)
        if not same:
            del self.by_key[key]
        self.index.remove(w.addr, w.end, w)
        self.count -= 1
        if self.small is not None:
            self.small.remove(w)
        elif self.count == 0:
            self.small = []
        return True

    def first_at(self, lo, hi):
        """Of the live windows overlapping [lo, hi), the first registered (None if none)."""
        small = self.small
        if small is not None:
            for w in small:
                if w.addr < hi and lo < w.end:
                    return w
            return None
        return self.index.first_added(lo, hi)

    def __len__(self):
        return self.count


class BlockSet:
    """Live blocks for overlap queries (the live window blocks): a list while there are at most
    SMALL (a rank has a few live at a time: a scan of them is cheaper than an index), the address
    index (RangeIndex) past that, until none is left."""

    __slots__ = ("small", "index", "count")

    SMALL = 16

    def __init__(self):
        self.small: list | None = []
        self.index = None
        self.count = 0

    def add(self, block) -> None:
        self.count += 1
        small = self.small
        if small is not None:
            if len(small) < self.SMALL:
                small.append(block)
                return
            self.index = RangeIndex()
            for b in small:
                self.index.add(b.addr, b.end, b)
            self.small = None
        self.index.add(block.addr, block.end, block)

    def remove(self, block) -> None:
        self.count -= 1
        if self.small is not None:
            self.small.remove(block)
            return
        self.index.remove(block.addr, block.end, block)
        if self.count == 0:
            self.small = []
            self.index = None

    def overlapping(self, lo, hi) -> list:
        """The blocks overlapping [lo, hi)."""
        small = self.small
        if small is not None:
            found = []
            for b in small:
                if b.addr < hi and lo < b.end:
                    found.append(b)
            return found
        return [item for _, _, item in self.index.overlapping(lo, hi)]


class WindowBlocks:
    """transient-in-window asks, at the free of a window block, whether a collective touched it
    during its life. A live block that overlaps a live window is a window block (from its alloc,
    or from the window's registration when that comes later, as SGLang's scope exit does).

    Collectives mark the live window blocks (few, `blocks`) at once. A buffer inside one live
    window can touch no other block. A buffer outside windows may touch blocks that are not window
    blocks yet and become ones if a window is registered over them while they live: it is logged
    (`touches`, with the rank's allocs made by then: the blocks live then have serials up to
    that) and marked on every live block through the rank's address index of them when a window
    is registered or the log grows long. Most collectives of a serving stack work inside windows,
    and most blocks are freed before any of that matters: they never enter that index."""

    __slots__ = ("windows", "blocks", "ordinals", "touches", "transients")

    def __init__(self):
        self.windows = WindowTable()
        self.blocks = BlockSet()  # the live window blocks
        self.ordinals: dict = {}  # comm -> windows it registered so far
        self.touches: list = []  # collective buffers not yet marked: (lo, hi, allocs by then)
        self.transients: dict = {}  # (site, allocated during a capture) -> its transient-in-window Finding

    def register(self, addr, size, comm):
        """A new live window of `comm` (its ordinal: the windows `comm` registered before)."""
        ordinal = self.ordinals.get(comm, 0)
        self.ordinals[comm] = ordinal + 1
        w = Window(addr, size, comm, ordinal)
        self.windows.add(w)
        return w

    def adopt(self, w, ranges) -> None:
        """The live blocks in window `w` (just registered) are window blocks from now; first the
        logged collectives are marked on the blocks they touched. `ranges`: every live block by
        address."""
        if self.touches:
            self.apply_touches(ranges)
        for _, _, block in ranges.overlapping(w.addr, w.end):
            if block.window is None:
                block.window = w
                self.blocks.add(block)

    def mark_coll_touched(self, bufs, allocs) -> bool:
        """A collective used `bufs` ((lo, hi, access)) with `allocs` blocks allocated so far:
        marks the window blocks it touched, logs its buffers outside windows. True when the log
        is long: the caller then applies it (apply_touches)."""
        touches = self.touches
        blocks = self.blocks
        windows = self.windows
        for lo, hi, _ in bufs:
            if blocks.count:
                for blk in blocks.overlapping(lo, hi):
                    blk.coll_touched = True
            if windows.count:
                w = windows.first_at(lo, hi)
                if w is not None and w.addr <= lo and hi <= w.end:
                    continue
            touches.append((lo, hi, allocs))
        return len(touches) > TOUCH_LOG

    def apply_touches(self, ranges) -> None:
        """Mark the logged collective buffers on the live blocks they touched (`ranges`: every
        live block by address)."""
        for lo, hi, t in self.touches:
            for _, _, blk in ranges.overlapping(lo, hi):
                if blk.serial <= t:  # live when the collective ran (allocated before it, not freed since)
                    blk.coll_touched = True
        self.touches = []

    def transient(self, block, line, rank, step, file) -> None:
        """Window block `block`, which no collective touched, was freed (on `line`, in `step`):
        a transient, counted into its site's finding. Those allocated during a graph capture
        (`block.captured_in`) have a finding of their own per site: the graph rewrites their
        bytes at every replay, a hazard that outlives the free (docs/ordering-and-rules.md,
        "transient-in-window"), not to be lost among the site's eager transients."""
        graph = block.captured_in
        key = (block.site, graph is not None)
        f = self.transients.get(key)
        size = block.end - block.addr
        if f is None:
            detail = f"window of communicator {block.window.comm!r}"
            if graph is not None:
                detail += (f"; allocated while capturing CUDA graph {graph.id!r} (pool {graph.pool!r}): "
                           "the graph rewrites these bytes at every replay")
            f = self.transients[key] = Finding(
                rule="transient-in-window", severity=severity_of("transient-in-window"), rank=rank,
                step=step, file=file, line=line, block=BlockRecord.of(block), op=None,
                overlap=None, count=1, bytes=size, site=block.site, detail=detail)
        else:
            f.count += 1
            f.bytes += size
        f.by_step[step] = f.by_step.get(step, 0) + 1

    def finish(self, sink) -> None:
        """The rank's file ended: its transient findings go to `sink`."""
        for f in self.transients.values():
            sink.add(f)
        self.transients.clear()
