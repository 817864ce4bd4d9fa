"""The in-flight tables (docs/ordering-and-rules.md, "When is an op done", "What the analysis
keeps"): the ops with declared buffers that are not yet done for the host, and the queries "which
of them are not done for stream X and overlap [lo, hi)".

* Per stream (`InFlight`): in epoch order, so that retiring what the host has seen done is a
  bisect and "all of S's ops are done for X" one comparison; and by address (`BufferIndex`,
  filled only once a query needs it: most accesses find every op of S done for them and never
  look), so that "S's ops overlapping [lo, hi)" costs O(log n + overlaps). A stream leaves the
  table once none of its ops is in flight.
* Per rank (`InFlightTable`): with few streams in flight an access walks them: O(streams with ops
  not done for X, each log n) plus the overlaps. Past CROWD streams that walk would make a trace
  with a stream per launch quadratic (issue 21), so every in-flight buffer is also in one address
  index for all streams (`wide`): an access finds there the streams it overlaps an unfinished op
  of and queries only those, in the table's order, so its findings and their order are the
  walk's, and it costs O(log n + overlaps) however many streams are unfinished for it.

Compiled by Cython with the engine (types in inflight.pxd beside it; buildinfo.COMPILED).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right

from sortedcontainers import SortedList

from sanitizer.rules.intervals import BIG
from sanitizer.rules.kinds import WRITE
from sanitizer.rules.records import widen

#: Streams with work in flight past which every in-flight buffer is also indexed by address in one
#: index for all streams (InFlightTable.wide), so that an access costs O(log n + overlaps) however
#: many streams are unfinished for it; the index is dropped again at a quarter of that.
CROWD = 32


class InFlight:
    """Ops of one stream in epoch order; ops[start:] are not yet done for the host.

    Their buffers are indexed by address (`index`) only once a query needs them: most accesses
    find all of a stream's ops done for them (one comparison) and never look, so most ops retire
    without ever being indexed. ops[:indexed] have been handed to the index. `classes` holds the
    length classes of the in-flight buffers (each with the number, counted from 1, of the last
    op pushed that has one) in the order the index would hold them had every op been indexed at
    once: queries list overlaps class by class, so findings keep that order. It too is brought up
    to date only when needed (a query, a compaction): the first `tracked` ops are counted in it,
    and `cuts` are the retirements since, as (ops pushed by then, ops retired by then).
    """

    __slots__ = ("ops", "epochs", "last", "start", "index", "indexed", "classes", "pushed", "base",
                 "tracked", "cuts", "order")

    def __init__(self, order=0):
        self.ops: list = []
        self.epochs: list = []
        self.last = 0  # epochs[-1]
        self.start = 0
        self.index = None  # BufferIndex, made at the first query
        self.indexed = 0
        self.classes: dict = {}
        self.pushed = 0
        self.base = 0  # ops compacted away: ops[i] is op number base + i + 1
        self.tracked = 0
        self.cuts: list = []
        # when the stream entered the table (InFlightTable.streams, whose order it is): the wide
        # index sorts by it, so that findings come out in the order a walk of the table gives
        self.order = order

    def push(self, op, epoch=None) -> None:
        """`epoch`: op.epoch as the int object the clock holds, if at hand (not made again)."""
        self.ops.append(op)
        self.epochs.append(op.epoch if epoch is None else epoch)
        self.last = op.epoch
        self.pushed += 1

    def retire_upto(self, known: int) -> list:
        """Drop the ops with epoch <= known; returns them."""
        epochs, start, n = self.epochs, self.start, len(self.epochs)
        if start == n or epochs[start] > known:
            return []
        stop = bisect_right(epochs, known, start)
        gone = self.ops[start:stop]
        self.start = stop
        if self.indexed > start:
            for op in gone:
                if op.index_keys is not None:
                    self.index.remove(op)
        self.cuts.append((self.pushed, self.base + stop))
        if stop > 1024 and stop * 2 > n:  # compact now and then
            self._track()  # the ops about to go are counted first
            del self.ops[:stop]
            del self.epochs[:stop]
            self.base += stop
            self.start = 0
            self.indexed = self.indexed - stop if self.indexed > stop else 0
        return gone

    def _track(self) -> None:
        """Bring `classes` up to date: replay, in order, the pushes and retirements since the
        last time (a class is left once the last op that had one is retired)."""
        classes = self.classes
        ops = self.ops
        base = self.base
        i = self.tracked
        for pushed, retired in self.cuts:
            while i < pushed:
                track_op(classes, ops[i - base], i + 1)
                i += 1
            for c in [c for c, last in classes.items() if last <= retired]:
                del classes[c]
        self.cuts = []
        pushed = self.pushed
        while i < pushed:
            track_op(classes, ops[i - base], i + 1)
            i += 1
        self.tracked = i

    def by_address(self) -> "BufferIndex":
        """The index, holding every op in flight."""
        index = self.index
        if index is None:
            index = self.index = BufferIndex()
        ops = self.ops
        n = len(ops)
        i = self.indexed if self.indexed > self.start else self.start
        if i < n:
            while i < n:
                op = ops[i]
                op.buffers()
                index.add(op)
                i += 1
            self.indexed = n
            self._track()
            held = index.classes
            if list(held) != list(self.classes):
                index.classes = {c: held[c] for c in self.classes}
        return index


def track_op(classes, op, number) -> None:
    """InFlight._track for one op, pushed as number `number`: the length class of each of its
    buffers, in order, from its event when they are not made yet (their lengths are the sizes)."""
    bufs = op.bufs
    if bufs is None:
        ev = op.ev
        if ev.reads:
            for _, n in ev.reads:
                classes[n.bit_length()] = number
        if ev.writes:
            for _, n in ev.writes:
                classes[n.bit_length()] = number
    else:
        for lo, hi, _ in bufs:
            classes[(hi - lo).bit_length()] = number


class BufferIndex:
    """Buffers of in-flight ops by address: overlap queries in O(log n + overlaps).

    Buffers are grouped by length class (the bit length of hi - lo); within a class they are
    sorted by lo, and a buffer of class c overlapping [lo, hi) starts in [lo - longest of c, hi).
    The scan of one class meets, besides the overlaps, only buffers of that class starting less
    than twice their own length before lo. A class is a plain sorted list while it is small (the
    usual case: bisect and insert in C) and a SortedList (O(log n) insert and remove) past
    `BIG` entries (sanitizer.rules.intervals, as RangeIndex).
    """

    __slots__ = ("classes", "longest", "serial")

    def __init__(self):
        self.classes: dict = {}  # length class -> sorted list or SortedList of entries
        self.longest: dict = {}
        self.serial = 0

    def add(self, op) -> None:
        """Index op.bufs (its entries kept in op.index_keys)."""
        op.index_keys = self.add_keys(op.bufs, op)

    def add_keys(self, bufs, op) -> list:
        """Index `bufs` of `op`; each entry is (lo, serial, hi, access, op), the serial making it
        unique (comparisons never reach the op). Returns [(class, entry)] for remove_keys."""
        keys = []
        for lo, hi, acc in bufs:
            n = hi - lo
            c = n.bit_length()
            self.serial += 1
            key = (lo, self.serial, hi, acc, op)
            entries = self.classes.get(c)
            if entries is None:
                self.classes[c] = [key]
                self.longest[c] = n
            else:
                if n > self.longest[c]:
                    self.longest[c] = n
                if type(entries) is list:
                    if not entries or entries[-1] < key:
                        entries.append(key)
                    else:
                        entries.insert(bisect_right(entries, key), key)
                    if len(entries) > BIG:
                        self.classes[c] = SortedList(entries)
                else:
                    entries.add(key)
            keys.append((c, key))
        return keys

    def remove(self, op) -> None:
        self.remove_keys(op.index_keys)
        op.index_keys = None

    def add_serial(self, bufs, op) -> int:
        """Index `bufs` of `op`; returns the serial of the first entry (the others follow it), by
        which remove_serial finds them again. Nothing of the index is kept on the op: no
        reference cycle between op and entry."""
        first = self.serial + 1
        self.add_keys(bufs, op)
        return first

    def remove_serial(self, bufs, first) -> None:
        serial = first
        for lo, hi, _ in bufs:
            c = (hi - lo).bit_length()
            entries = self.classes[c]
            key = (lo, serial)  # sorts just before the entry (lo, serial, hi, access, op)
            if type(entries) is list:
                del entries[bisect_left(entries, key)]
            else:
                del entries[entries.bisect_left(key)]
            if not entries:
                del self.classes[c]
                del self.longest[c]
            serial += 1

    def remove_keys(self, keys) -> None:
        for c, key in keys:
            entries = self.classes[c]
            if type(entries) is list:
                i = bisect_right(entries, key) - 1
                del entries[i]
            else:
                entries.remove(key)
            if not entries:
                del self.classes[c]
                del self.longest[c]

    def overlapping(self, lo, hi) -> list:
        """Entries (lo, serial, hi, access, op) whose [lo, hi) overlaps the given range."""
        found = []
        for c, entries in self.classes.items():
            start = (lo - self.longest[c],)
            if type(entries) is list:
                i = bisect_right(entries, start)
                n = len(entries)
                while i < n:
                    key = entries[i]
                    if key[0] >= hi:
                        break
                    if lo < key[2]:
                        found.append(key)
                    i += 1
            else:
                for key in entries.irange(start, (hi,), (True, False)):
                    if lo < key[2]:
                        found.append(key)
        return found

    def __len__(self):
        return sum(len(e) for e in self.classes.values())


class InFlightTable:
    """One rank's ops in flight: stream -> InFlight (`streams`, in the order streams entered it),
    and past CROWD streams the `wide` index of all their buffers; `colls`, how many of the ops
    are collectives (a window transient allocated while one is in flight is exposed to it:
    RankAnalyzer.on_alloc)."""

    __slots__ = ("streams", "wide", "entered", "settled", "colls")

    def __init__(self):
        self.streams = {}  # stream -> InFlight, only streams with an op in flight
        self.entered = 0  # streams that entered `streams` so far (InFlight.order)
        # past CROWD streams in flight: every in-flight buffer of every stream by address (see
        # wide_unfinished); None while few streams have work in flight
        self.wide = None
        # a stream for which no op in flight was unfinished, and no other stream has pushed an op
        # since: the answer stands (clocks only grow, retiring only removes), see unfinished
        self.settled = None
        self.colls = 0  # collectives (replayed ones too) among the ops in flight

    def unfinished(self, clocks, stream, protected=None):
        """[(InFlight, how far `stream` knows its stream)] of the streams with an op in flight that
        is not done for `stream` (none of `protected`); None when there is none (the usual case).

        With more than CROWD streams in flight this walk would cost O(streams) per access: an
        empty list is returned instead, which tells not_done to ask the wide index, per range."""
        if not protected and self.settled is not None and self.settled == stream:
            return None  # nothing in flight was unfinished for it, and only it has pushed since
        if self.wide is not None:
            return []
        unfinished = None
        vh = clocks.host
        vx = clocks.streams.get(stream) or vh
        for s, fl in self.streams.items():
            known = vx.get(s, 0)
            if fl.last <= known:
                continue  # all of s's in-flight ops are done for `stream` (the usual case)
            h = vh.get(s, 0)
            if h > known:
                known = h
            if protected:
                if s in protected:
                    continue
                known = known_by_recorded(clocks, protected, s, known)
            if fl.last <= known:
                continue
            if unfinished is None:
                unfinished = []
            unfinished.append((fl, known))
        if unfinished is None and not protected:
            self.settled = stream
        return unfinished

    def not_done(self, clocks, stream, lo, hi, access, unfinished, protected):
        """The in-flight ops with a buffer overlapping [lo, hi) that conflicts with `access` and is
        not done for `stream`, as {op: [overlap_lo, overlap_hi]} (None: none). `unfinished`: what
        `unfinished(clocks, stream, protected)` says now, not None."""
        hits = None
        if self.wide is not None:
            unfinished = self.wide_unfinished(clocks, stream, lo, hi, access, protected)
            if unfinished is None:
                return None
        for fl, known in unfinished:
            for key in fl.by_address().overlapping(lo, hi):
                bacc = key[3]
                if not (bacc | access) & WRITE:
                    continue
                op = key[4]
                if op.epoch <= known:
                    continue
                blo = key[0]
                bhi = key[2]
                if op.released is not None and overlaps_any(op.released, blo, bhi):
                    continue  # an observed op's buffer in a block freed since: not its memory now
                if hits is None:
                    hits = {}
                widen(hits, op, max(lo, blo), min(hi, bhi))
        return hits

    def wide_unfinished(self, clocks, stream, lo, hi, access, protected):
        """What unfinished would list, restricted to the streams that have a buffer overlapping
        [lo, hi) that conflicts with `access` and is not done for `stream`: found through the wide
        index in O(log n + overlaps), not by walking every stream in flight. They come in the
        table's order (InFlight.order), and each is then queried as unfinished's list would be,
        so the findings and their order are the same as the walk's. None when there is none."""
        vh = clocks.host
        vx = clocks.streams.get(stream) or vh
        found = None
        for key in self.wide.overlapping(lo, hi):
            if not (key[3] | access) & WRITE:
                continue
            op = key[4]
            s = op.stream
            known = vx.get(s, 0)
            h = vh.get(s, 0)
            if h > known:
                known = h
            if protected:
                if s in protected:
                    continue
                known = known_by_recorded(clocks, protected, s, known)
            if op.epoch <= known:
                continue
            if found is None:
                found = {}
            found[self.streams[s]] = known
        if found is None:
            return None
        unfinished = list(found.items())
        if len(unfinished) > 1:
            unfinished.sort(key=_entered)
        return unfinished

    def push(self, op, epoch) -> None:
        """`op`, just enqueued as `epoch` on its stream, is in flight."""
        stream = op.stream
        fl = self.streams.get(stream)
        if fl is None:
            self.entered += 1
            fl = self.streams[stream] = InFlight(self.entered)
            fl.push(op, epoch)
            if self.wide is None and len(self.streams) > CROWD:
                self.widen_index()
            elif self.wide is not None:
                op.wide_serial = self.wide.add_serial(op.buffers(), op)
        else:
            fl.push(op, epoch)
            if self.wide is not None:
                op.wide_serial = self.wide.add_serial(op.buffers(), op)
        if self.settled is not None and self.settled != stream:
            self.settled = None  # an op of another stream may be unfinished for it
        if op.cid is not None:
            self.colls += 1

    def retire(self, host, learned, colls_in_flight) -> None:
        """Drop the ops done for the host (`host`: its clock). `learned`: the clock the host just
        learned (only its streams can have new ops done), None for all. A collective retired
        leaves `colls_in_flight` too."""
        streams = self.streams
        asked = streams if learned is None or len(learned) > len(streams) else learned
        emptied = None
        for s in asked:
            fl = streams.get(s)
            if fl is None:
                continue
            known = host.get(s, 0)
            if known:
                for op in fl.retire_upto(known):
                    if op.cid is not None and not op.observed:  # (an observed one left at its observation)
                        self.colls -= 1
                    if op.clock is not None:
                        colls_in_flight.pop(op.cid, None)
                    if op.wide_serial:
                        self.wide.remove_serial(op.bufs, op.wide_serial)
                        op.wide_serial = 0
                if fl.start == len(fl.epochs):
                    if emptied is None:
                        emptied = []
                    emptied.append(s)
        if emptied:
            # only streams with ops in flight stay: queries walk them
            for s in emptied:
                del streams[s]
            if self.wide is not None and len(streams) <= CROWD // 4:
                self.narrow_index()

    def widen_index(self) -> None:
        """More than CROWD streams have work in flight: index all of it in one place."""
        wide = self.wide = BufferIndex()
        for fl in self.streams.values():
            ops = fl.ops
            for i in range(fl.start, len(ops)):
                op = ops[i]
                op.wide_serial = wide.add_serial(op.buffers(), op)

    def narrow_index(self) -> None:
        """Few streams left with work in flight: the walk is cheaper than the wide index."""
        for fl in self.streams.values():
            ops = fl.ops
            for i in range(fl.start, len(ops)):
                ops[i].wide_serial = 0
        self.wide = None


def overlaps_any(ranges, lo, hi) -> bool:
    """Whether [lo, hi) overlaps one of `ranges` ([(lo, hi)])."""
    for rlo, rhi in ranges:
        if rlo < hi and lo < rhi:
            return True
    return False


def _entered(item):
    return item[0].order


def known_by_recorded(clocks, protected, s, known):
    """How far `s` is known once the streams a freed block was record_stream'd on are counted:
    the allocator hands the block out again only after the events it records on each of them at
    the free complete, and each such event follows everything its stream had waited for. So an op
    done for any of them is done for the block (c10/cuda/CUDACachingAllocator.cpp, insert_events
    at free, process_events before a later malloc)."""
    streams = clocks.streams
    for p in protected:
        vp = streams.get(p)
        if vp is not None:
            k = vp.get(s, 0)
            if k > known:
                known = k
    return known
