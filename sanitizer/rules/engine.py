"""The happens-before engine: the algorithm, and nothing else (docs/ordering-and-rules.md).

One statement of the algorithm. It runs as plain Python, and the same file is compiled by Cython
(pure-Python mode; the types are in engine.pxd beside it) into an extension. Which of the two runs
is sanitizer.rules.select's; everything around the algorithm (finding the files, reading and
decoding them, round-robin over ranks, the summary) sanitizer.rules.driver's. The interval and id
sets it keeps (`RangeIndex`, `SeenIds`) are sanitizer.rules.intervals', compiled with it.

* Each rank is replayed in program order. `StreamClocks` (sanitizer.order.clocks) answers "is op
  O done for stream X". An op with declared buffers (a `launch` with reads/writes, a `coll` with
  bufs) stays *in flight* until it is done for the host; then nobody can ever see it unfinished
  again and it is retired.
* In-flight ops are kept per stream (`InFlight`): in epoch order, so that retiring what the host
  has seen done is a bisect and "all of S's ops are done for X" one comparison; and by address
  (`BufferIndex`, filled only once a query needs it: most accesses find every op of S done for
  them and never look), so that "S's ops overlapping [lo, hi)" costs O(log n + overlaps). A stream
  leaves the table once none of its ops is in flight. With few streams in flight an access walks
  them: O(streams with ops not done for X, each log n) plus the overlaps. Past CROWD streams that
  walk would make a trace with a stream per launch quadratic (issue 21), so every in-flight buffer
  is also in one address index for all streams (`wide`): an access finds there the streams it
  overlaps an unfinished op of and queries only those, in the table's order, so its findings and
  their order are the walk's, and it costs O(log n + overlaps) however many streams are unfinished
  for it. Never O(in-flight ops), O(streams seen) nor O(trace length)
  (docs/ordering-and-rules.md, "When is an op done", "What the analysis keeps").
* The host clock takes in only what changed (`StreamClocks.dirty`), and only the streams whose
  host entry grew retire work: a device-wide sync costs O(streams changed since the last one).
* transient-in-window asks, at the free of a window block, whether a collective touched it during
  its life: collectives mark the live window blocks (few) at once; their buffers outside windows
  are logged for blocks that a window registered later makes window blocks.
* Per event: a switch on the kind's number (KIND_CODES, either trace format), the frequent kinds'
  fields read from their slots when compiled, a launch's buffers made from its event only when a
  query needs them. On the decode trace the engine costs about 2,100 instructions per event
  (benchmarks/README.md, "streams_scaling.py").
* `--peer-completion successor`: a collective's buffers inside a window of its own communicator
  are done for X only once a later (program order, higher seq) collective on that communicator is
  locally done for X: its successor. Those buffers sit on a per-communicator list instead
  (`SuccessorWait`).
* Rules fire on the event that exposes the hazard:
  alloc  -> reuse-in-flight, graph-buffer-released
  free   -> free-in-flight, graph-buffer-released, transient-in-window
  launch / coll / graph_replay -> unordered-access
  coll (all ranks together) -> asymmetric-offset, matched by (comm, seq) while the driver reads
  ranks round-robin, so pending matches stay bounded by how far ranks drift apart (the
  CollectiveMatcher, sanitizer.rules.matcher).
* Captured ops (between graph_begin and graph_end) neither run nor tick clocks; every
  graph_replay enqueues them again. From graph_end to graph_free their buffers are reserved.
* A listener (`listen`, sanitizer.rules.completions) learns when each op becomes done for the
  host, by the same clocks and the same peer-completion rule: the HTML report and the Perfetto
  export draw from it and run no clocks of their own. Without one it costs a comparison.

Events arrive as typed records (sanitizer.trace.events): the decoder has checked every field's
type, and that sizes are not negative. What is left to check here is what needs state: ids that
are unknown, live, duplicate.

Settled (docs/trace-format.md, "Decisions the old text left open"; docs/ordering-and-rules.md,
"record_stream and free_done"): a `wait` or `sync` on an event never recorded is a no-op (CUDA's
cudaStreamWaitEvent on a never-recorded event does nothing), counted for a warning;
`record_stream` on the block's own stream is ignored, and a `free_done` after a free whose only
record_stream streams were its own is accepted and changes nothing.
"""
from __future__ import annotations

import sys
from bisect import bisect_left, bisect_right

from sortedcontainers import SortedList

from sanitizer.order.clocks import MAX_EVENTS, MAX_STREAMS, StreamClocks, TooMany
from sanitizer.rules.findings import BlockRecord, Finding, OpRecord, severity_of
from sanitizer.rules.intervals import BIG, RangeIndex, SeenIds
from sanitizer.rules.matcher import CollectiveMatcher  # noqa: F401 - the driver's default, re-exported
from sanitizer.trace import events as E

READ, WRITE = 1, 2
#: Distinct communicators one rank may use (`hazsan check --max-comms`).
MAX_COMMS = 100_000
LOCAL, SUCCESSOR = "local", "successor"
ACCESS = {"r": READ, "w": WRITE, "rw": READ | WRITE}
#: Collective buffers outside windows logged before they are marked on the blocks they touch
#: (RankAnalyzer._mark_coll_touched).
TOUCH_LOG = 4096
#: Streams with work in flight past which every in-flight buffer is also indexed by address in one
#: index for all streams (RankAnalyzer.wide), so that an access costs O(log n + overlaps) however
#: many streams are unfinished for it; the index is dropped again at a quarter of that.
CROWD = 32


#: Event kind -> its number in RankAnalyzer.feed_batch's dispatch (a switch when compiled: no
#: Python call per event); kinds without one go through RankAnalyzer.handlers.
_KIND_NUMBER = {"launch": 1, "alloc": 2, "free": 3, "record": 4, "wait": 5, "scope": 6, "coll": 7,
                "free_done": 8, "record_stream": 9, "sync": 10, "coll_done": 11, "step": 12}
#: Whether this is the compiled engine (the same source, built by Cython; see engine.pxd).
COMPILED = not __file__.endswith(".py")
#: Per dispatch number, the fields its handler reads, in the order it reads them (_slots_of).
_FIELDS = {1: ("stream", "reads", "writes"), 2: ("id", "addr", "size", "stream"), 3: ("id",),
           4: ("event", "stream"), 5: ("event", "stream"), 7: ("cid", "comm", "seq", "stream", "bufs"),
           8: ("id",), 9: ("id", "stream")}


def _slots_of(kind, number):
    """Compiled engine only: where, in an event of class `kind`, the fields that handler
    `number` reads are kept (msgspec keeps a struct's fields in slots, each with its member
    descriptor on the class); None when interpreted, or when one of them is not such a slot.
    Read from its slot, a field costs a load; through the attribute protocol (type lookup,
    descriptor call) it cost a sixth of the engine's time on the decode trace."""
    names = _FIELDS.get(number)
    if not COMPILED or names is None:
        return None
    offsets = []
    for name in names:
        offset = hazsan_slot_offset(getattr(kind, name, None))
        if offset < 0:
            return None
        offsets.append(offset)
    return tuple(offsets)


#: Event class -> (its number, where its fields are: _slots_of, the JSON Lines class of its kind,
#: whose entry in RankAnalyzer.handlers handles it); number -1: none. The JSON Lines classes from
#: the start; the binary format's records, classes of their own with the same fields (elsewhere
#: in the struct), at their first event (_kind_entry).
KIND_CODES = {cls: (_KIND_NUMBER.get(kind, -1), _slots_of(cls, _KIND_NUMBER.get(kind, -1)), cls)
              for kind, cls in E.BY_KIND.items()}


def _kind_entry(kind) -> tuple:
    """KIND_CODES' entry for an event class not met before: a binary record's number is its
    JSON Lines class's (the binary module, loaded by then since it made the record, pairs them;
    it is not loaded here otherwise: its classes cost tens of ms to make); -1 for any other."""
    number = -1
    binary = sys.modules.get("sanitizer.trace.binary")
    json_cls = getattr(binary, "TO_JSON_CLASS_ALL", {}).get(kind) if binary is not None else None
    if json_cls is not None:
        number = KIND_CODES.get(json_cls, (-1, None, None))[0]
    entry = KIND_CODES[kind] = (number, _slots_of(kind, number), json_cls if json_cls is not None else kind)
    return entry


class Malformed(Exception):
    """An event that breaks the contract given the state (docs/trace-format.md); the message names the problem."""


# ----------------------------------------------------------------------------------- records


class Block:
    """A live allocation (made by _new_block)."""

    __slots__ = ("id", "addr", "end", "stream", "line", "step", "ev",
                 "record_streams", "window", "coll_touched", "serial")

    @property
    def pool(self):
        return self.ev.pool

    @property
    def site(self):
        return E.described(self.ev, "site")

    @property
    def stack(self):
        return E.described(self.ev, "stack")

    @property
    def op(self):
        return E.described(self.ev, "op")


def _new_block(bid, addr, size, stream, line, step, ev):
    """A Block, made without a call through the type (no __init__: its argument parsing cost)."""
    block = Block.__new__(Block)
    block.id = bid
    block.addr = addr
    block.end = addr + size
    block.stream = stream
    block.line = line
    block.step = step
    # the alloc event: its pool, site, stack and op are read only for a finding (most blocks never
    # have one; reading them off every event cost more than keeping the event)
    block.ev = ev
    block.record_streams = None  # None: no record_stream; else the streams other than its own (possibly none)
    block.window = None  # the Window it lies in, once known
    block.coll_touched = False  # some collective used part of it during its life
    block.serial = 0  # allocs of the rank up to this one, once live
    return block


def _new_op(kind, stream, bufs, line, step, ev):
    """Op(...) without the call through the type (its __init__'s argument parsing)."""
    op = Op.__new__(Op)
    op.kind = kind
    op.stream = stream
    op.epoch = 0
    op.bufs = bufs
    op.line = line
    op.step = step
    op.ev = ev
    op.cid = op.comm = op.seq = None
    op.clock = None
    op.captured = None
    op.window_bufs = ()
    op.index_keys = None
    op.wide_serial = 0
    op.succ_keys = None
    return op


class Op:
    """Device work with declared buffers: (lo, hi, access) triples, access READ/WRITE bitmask.
    `bufs` is None for a launch whose buffers are still only in its event (it has at least one):
    `buffers()` makes them."""

    __slots__ = ("kind", "stream", "epoch", "bufs", "line", "step", "ev", "cid", "comm", "seq",
                 "clock", "captured", "window_bufs", "index_keys", "wide_serial", "succ_keys")

    def __init__(self, kind, stream, bufs, line, step, ev):
        self.kind = kind
        self.stream = stream
        self.epoch = 0
        self.bufs = bufs
        self.line = line
        self.step = step
        self.ev = ev  # the launch or coll event: its op, site and stack are read only for a finding
        self.cid = self.comm = self.seq = None
        self.clock = None  # collectives: what their stream knew at enqueue (for coll_done)
        self.captured = None  # replays: the captured op they re-run
        self.window_bufs = ()  # successor mode: bufs in a window of the op's own communicator
        self.index_keys = None  # its entries in the BufferIndex while in flight
        self.wide_serial = 0  # the serial of its first entry in RankAnalyzer.wide while there (0: none)
        self.succ_keys = None  # successor mode: its window buffers' entries in RankAnalyzer.successor_index

    def buffers(self) -> list:
        """(lo, hi, access) of every buffer. A launch's are made from its event at the first
        need: most launches retire without anyone asking (no stream unfinished for theirs)."""
        bufs = self.bufs
        if bufs is None:
            ev = self.ev
            reads = ev.reads
            writes = ev.writes
            bufs = [(a, a + n, READ) for a, n in reads] if reads else []
            if writes:
                bufs += [(a, a + n, WRITE) for a, n in writes]
            self.bufs = bufs
        return bufs

    def replay(self, stream, line, step) -> "Op":
        op = Op.__new__(Op)
        op.kind, op.stream, op.bufs, op.line, op.step = self.kind, stream, self.bufs, line, step
        op.ev = self.ev
        op.cid, op.comm, op.seq = self.cid, self.comm, self.seq
        op.epoch, op.clock, op.window_bufs = 0, None, self.window_bufs
        op.captured = self
        op.index_keys = None
        op.wide_serial = 0
        op.succ_keys = None
        return op

    @property
    def name(self):
        return E.described(self.ev, "op")

    @property
    def site(self):
        return E.described(self.ev, "site")

    @property
    def stack(self):
        return E.described(self.ev, "stack")


class Window:
    __slots__ = ("addr", "end", "comm", "ordinal")

    def __init__(self, addr, size, comm, ordinal):
        self.addr, self.end, self.comm, self.ordinal = addr, addr + size, comm, ordinal


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


class Graph:
    __slots__ = ("id", "stream", "ops", "live", "line", "reserved", "ordinal")

    def __init__(self, gid, stream, line):
        self.id, self.stream, self.line = gid, stream, line
        self.ops: list[Op] = []
        self.live = False
        self.reserved: RangeIndex | None = None
        self.ordinal = 0  # graphs made live before it, once live (RankAnalyzer.live_graphs' order)


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
        # when the stream entered the table (RankAnalyzer.inflight, whose order it is): the wide
        # index sorts by it, so that findings come out in the order a walk of the table gives
        self.order = order

    def push(self, op, epoch=None) -> None:
        """`epoch`: op.epoch as the int object the clock holds, if at hand (not made again)."""
        self.ops.append(op)
        self.epochs.append(op.epoch if epoch is None else epoch)
        self.last = op.epoch
        self.pushed += 1

    def retire_upto(self, known: int) -> list[Op]:
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
                _track_op(classes, ops[i - base], i + 1)
                i += 1
            for c in [c for c, last in classes.items() if last <= retired]:
                del classes[c]
        self.cuts = []
        pushed = self.pushed
        while i < pushed:
            _track_op(classes, ops[i - base], i + 1)
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


class SuccessorWait:
    """Successor mode: the collectives of one communicator, in program order, until each is done
    for the host (locally complete, and a later one locally complete too).

    The usual communicator runs all its collectives on one stream with rising seq (`ordered`).
    Then the ones locally complete for a stream X are a prefix of the waiting list (one stream:
    epoch order), a later one has a higher seq, and those not done for X are a suffix: for a write,
    from the last locally complete one on (it has no successor yet); for a read, from the first one
    not locally complete. Their window buffers are found through an address index, so an access
    costs O(log n + overlaps); retiring drops a prefix. A communicator whose waiting collectives
    use a second stream, or a seq that does not rise, is scanned in full per access instead (the
    same answers, by the definition itself).
    """

    __slots__ = ("colls", "epochs", "entries", "start", "base", "index", "ordered", "ordinal", "streams")

    def __init__(self, ordinal=0):
        self.ordinal = ordinal  # its communicator's rank among the rank's (RankAnalyzer.successor_waits' order)
        self.streams = set()  # the streams it is listed under in RankAnalyzer.successor_on
        self.colls: list[Op] = []  # colls[start:] wait, in program order
        self.epochs: list = []  # their epochs (ordered: rising)
        self.entries: list = []  # per coll: its [(lo, hi, item)] in `index` (ordered only)
        self.start = 0
        self.base = 0  # colls dropped from the front of the lists: position = base + list index
        self.index = RangeIndex()  # window buffers; item (position, access, op)
        self.ordered = True

    def push(self, op) -> None:
        colls = self.colls
        n = len(colls)
        if self.start == n:
            self.ordered = True  # nothing waits: a fresh start
        elif self.ordered:
            last = colls[n - 1]
            if op.stream != last.stream or op.seq <= last.seq:
                self._unorder()
        entries = []
        if self.ordered:
            position = self.base + n
            for lo, hi, acc in op.window_bufs:
                item = (position, acc, op)
                self.index.add(lo, hi, item)
                entries.append((lo, hi, item))
        colls.append(op)
        self.epochs.append(op.epoch)
        self.entries.append(entries)

    def _unorder(self) -> None:
        self.ordered = False
        self.index = RangeIndex()
        self.entries = [[] for _ in self.entries]

    def not_done(self, clocks, stream, lo, hi, access, protected, hits):
        """Add to `hits` ({op: [lo, hi]}) the waiting collectives with a window buffer overlapping
        [lo, hi) that conflicts with `access` and is not done for `stream`; returns `hits`."""
        colls = self.colls
        start = self.start
        n = len(colls)
        if start == n:
            return hits
        write = access & WRITE
        if not self.ordered:
            done_seq = None  # highest seq among later collectives locally complete for `stream`
            for i in range(n - 1, start - 1, -1):
                op = colls[i]
                local = clocks.knows(stream, op.stream) >= op.epoch
                # done for a write: locally complete AND a later collective done ("successor")
                not_done = not (local and done_seq is not None and done_seq > op.seq) if write else not local
                if op.window_bufs and not_done and not (protected and op.stream in protected):
                    for blo, bhi, bacc in op.window_bufs:
                        if blo < hi and lo < bhi and (bacc | access) & WRITE:
                            if hits is None:
                                hits = {}
                            _widen(hits, op, max(lo, blo), min(hi, bhi))
                if local:
                    if done_seq is None or op.seq > done_seq:
                        done_seq = op.seq
            return hits
        s = colls[start].stream
        if protected and s in protected:
            return hits
        k = bisect_right(self.epochs, clocks.knows(stream, s), start)  # colls[start:k] local
        first = k - 1 if write and k > start else k
        if first >= n:
            return hits
        first += self.base
        found = None
        for blo, bhi, item in self.index.overlapping(lo, hi):
            if item[0] >= first and (item[1] | access) & WRITE:
                if found is None:
                    found = []
                found.append((item[0], blo, bhi, item[2]))
        if found is not None:
            if hits is None:
                hits = {}
            if len(found) > 1:
                found.sort(key=_position, reverse=True)  # the scan's order: findings come out the same
            for _, blo, bhi, op in found:
                _widen(hits, op, max(lo, blo), min(hi, bhi))
        return hits

    def retire(self, host: dict):
        """Drop the collectives done for the host (`host`: its clock). The others stay, in order:
        they may still serve as successors. Returns the dropped ones (None: none)."""
        colls = self.colls
        start = self.start
        n = len(colls)
        if start == n:
            return None
        if not self.ordered:
            done_seq = None
            gone = None
            for i in range(n - 1, start - 1, -1):
                op = colls[i]
                local = host.get(op.stream, 0) >= op.epoch
                if local and done_seq is not None and done_seq > op.seq:
                    if gone is None:
                        gone = set()
                    gone.add(i)
                if local and (done_seq is None or op.seq > done_seq):
                    done_seq = op.seq
            if gone:
                dropped = [colls[i] for i in sorted(gone)]
                keep = [i for i in range(start, n) if i not in gone]
                self.colls = [colls[i] for i in keep]
                self.epochs = [self.epochs[i] for i in keep]
                self.entries = [[] for _ in keep]
                self.base += n  # positions are unused while unordered; keep them fresh
                self.start = 0
                return dropped
            return None
        k = bisect_right(self.epochs, host.get(colls[start].stream, 0), start)
        stop = k - 1  # colls[start:stop] have a later collective locally complete for the host
        if stop <= start:
            return None
        dropped = colls[start:stop]
        index = self.index
        entries = self.entries
        for i in range(start, stop):
            for lo, hi, item in entries[i]:
                index.remove(lo, hi, item)
        self.start = stop
        if stop > 1024 and stop * 2 > n:  # compact now and then
            del colls[:stop]
            del self.epochs[:stop]
            del entries[:stop]
            self.base += stop
            self.start = 0
        return dropped

    def __len__(self):
        return len(self.colls) - self.start


# ------------------------------------------------------------------------------ one rank


class RankAnalyzer:
    """Replays one rank's events in program order and applies the per-rank rules."""

    def __init__(self, file: str, rank: int, sink, matcher, peer_completion: str = LOCAL,
                 max_streams: int = MAX_STREAMS, max_events: int = MAX_EVENTS, max_comms: int = MAX_COMMS):
        """The limits bound what hostile input can make one rank hold: an id past one of them is
        an error on its line (the event is not applied)."""
        if peer_completion not in (LOCAL, SUCCESSOR):
            raise ValueError(f"peer_completion must be {LOCAL!r} or {SUCCESSOR!r}")
        self.file = file
        self.rank = rank
        self.sink = sink
        self.matcher = matcher
        self.successor = peer_completion == SUCCESSOR
        self.clocks = StreamClocks(max_streams, max_events)
        self.comms = set()  # communicators this rank used (windows, collectives)
        self.max_comms = max_comms
        self.inflight = {}  # stream -> InFlight
        self.entered = 0  # streams that entered `inflight` so far (InFlight.order)
        # past CROWD streams in flight: every in-flight buffer of every stream by address (see
        # _wide_unfinished); None while few streams have work in flight
        self.wide = None
        # a stream for which no op in flight was unfinished, and no other stream has pushed an op
        # since: the answer stands (clocks only grow, retiring only removes), see _unfinished
        self.settled = None
        self.successor_waits = {}  # comm -> SuccessorWait (successor mode)
        # successor mode: the window buffers of every waiting collective, item (SuccessorWait, op):
        # an access asks only the communicators with one overlapping it, not all of them
        self.successor_index = RangeIndex()
        # successor mode: stream -> the SuccessorWaits with a collective waiting on it (as a dict,
        # in the order they were listed): a sync retires only those of the streams it taught the
        # host; a SuccessorWait leaves when nothing of it waits
        self.successor_on = {}
        self.live = {}  # block id -> Block
        # every live block by address, for collective-buffer marking: the blocks of the first
        # `ranges_upto` allocs (serials) are in it, the later ones enter at the next query
        self.live_ranges = RangeIndex()
        self.allocs = 0
        self.ranges_upto = 0
        # collective buffers not yet marked on the blocks they touch: (lo, hi, allocs by then)
        self.touches = []
        # the live window blocks by address: a collective marks those it touches at once
        self.window_blocks = BlockSet()
        self.windows = WindowTable()
        self.window_ordinals = {}
        self.pending_free = {}  # block id -> clocks its record_stream streams had at the free
        self.colls_in_flight = {}  # cid -> Op
        self.cids = SeenIds()
        self.graphs = {}
        self.capturing = []
        self.live_graphs = []
        # every reserved buffer of every live graph, item the graph: a free asks only the graphs
        # with one overlapping it (_graph_hits)
        self.graph_index = RangeIndex()
        self.graphs_made_live = 0
        self.transients = {}  # site -> Finding
        self.step = None
        self.steps_seen = set()
        self.line = 0
        self.events = 0
        self.unrecorded_waits = 0
        self.counted_drops = 0
        self.hook_errors = 0
        # a listener told when ops become done (sanitizer.rules.completions.Completions); None, the
        # usual case, costs one comparison per enqueue and per host-clock growth
        self.completions = None
        self.handlers = {
            E.Alloc: self.on_alloc, E.Free: self.on_free, E.FreeDone: self.on_free_done,
            E.RecordStream: self.on_record_stream, E.Launch: self.on_launch, E.Coll: self.on_coll,
            E.CollDone: self.on_coll_done, E.Record: self.on_record, E.Wait: self.on_wait,
            E.Sync: self.on_sync, E.Window: self.on_window, E.WindowFree: self.on_window_free,
            E.Segment: self.on_segment, E.SegmentFree: self.on_segment_free,
            E.GraphBegin: self.on_graph_begin, E.GraphEnd: self.on_graph_end,
            E.GraphReplay: self.on_graph_replay, E.GraphFree: self.on_graph_free,
            E.Scope: self.on_scope, E.Step: self.on_step, E.Dropped: self.on_dropped,
            E.HookError: self.on_hook_error,
        }

    def listen(self, completions) -> None:
        """Tell `completions` (sanitizer.rules.completions.Completions) of every op enqueued, every
        growth of the host clock, and every collective successor mode retires."""
        self.completions = completions

    # ------------------------------------------------------------------ dispatch

    def feed(self, line: int, ev) -> None:
        """Apply one event. Raises Malformed for an event that breaks the contract."""
        self.line = line
        try:
            self.handlers[type(ev)](ev, line)
        except TooMany as exc:
            raise Malformed(str(exc)) from None
        self.events += 1

    def feed_batch(self, first: int, items: list, problems: list) -> None:
        """Apply a batch of decoded events, the first on line `first`; None items are skipped
        (lines that gave no event). Events that break the contract are appended to `problems`
        as (line, message) and otherwise skipped."""
        handlers = self.handlers
        codes = KIND_CODES
        line = first - 1
        for ev in items:
            line += 1
            if ev is None:
                continue
            self.line = line
            entry = codes.get(type(ev))
            if entry is None:
                entry = _kind_entry(type(ev))
            code = entry[0]
            at = entry[1]  # compiled: where the handler finds the event's fields (None: by name)
            try:
                # by number (KIND_CODES), the frequent kinds first: a direct call when compiled
                if code == 1:
                    self.on_launch(ev, line, at)
                elif code == 2:
                    self.on_alloc(ev, line, at)
                elif code == 3:
                    self.on_free(ev, line, at)
                elif code == 4:
                    self.on_record(ev, line, at)
                elif code == 5:
                    self.on_wait(ev, line, at)
                elif code == 6:
                    pass  # scope: placement context only
                elif code == 7:
                    self.on_coll(ev, line, at)
                elif code == 8:
                    self.on_free_done(ev, line, at)
                elif code == 9:
                    self.on_record_stream(ev, line, at)
                elif code == 10:
                    self.on_sync(ev, line)
                elif code == 11:
                    self.on_coll_done(ev, line)
                elif code == 12:
                    self.on_step(ev, line)
                else:
                    handlers[entry[2]](ev, line)
            except (Malformed, TooMany) as exc:
                problems.append((line, str(exc)))
                continue
            self.events += 1

    # ------------------------------------------------------------------ queries

    def _unfinished(self, stream, protected=None):
        """[(InFlight, how far `stream` knows its stream)] of the streams with an op in flight that
        is not done for `stream` (none of `protected`); None when there is none (the usual case).

        With more than CROWD streams in flight this walk would cost O(streams) per access: an
        empty list is returned instead, which tells _not_done to ask the wide index, per range."""
        if not protected and self.settled is not None and self.settled == stream:
            return None  # nothing in flight was unfinished for it, and only it has pushed since
        if self.wide is not None:
            return []
        unfinished = None
        vh = self.clocks.host
        vx = self.clocks.streams.get(stream) or vh
        for s, fl in self.inflight.items():
            known = vx.get(s, 0)
            if fl.last <= known:
                continue  # all of s's in-flight ops are done for `stream` (the usual case)
            h = vh.get(s, 0)
            if h > known:
                known = h
            if protected:
                if s in protected:
                    continue
                known = _known_by_recorded(self.clocks, protected, s, known)
            if fl.last <= known:
                continue
            if unfinished is None:
                unfinished = []
            unfinished.append((fl, known))
        if unfinished is None and not protected:
            self.settled = stream
        return unfinished

    def _not_done(self, stream, lo, hi, access, unfinished, protected=None):
        """Ops with a buffer overlapping [lo, hi) that conflicts with `access` and is not done
        for `stream` (docs/ordering-and-rules.md, "When is an op done"). Returns {op: [overlap_lo, overlap_hi]}.
        `unfinished`: what `_unfinished(stream, protected)` says now."""
        hits = None
        clocks = self.clocks
        if unfinished is not None:
            if self.wide is not None:
                unfinished = self._wide_unfinished(stream, lo, hi, access, protected)
        if unfinished is not None:
            for fl, known in unfinished:
                for key in fl.by_address().overlapping(lo, hi):
                    bacc = key[3]
                    if not (bacc | access) & WRITE:
                        continue
                    op = key[4]
                    if op.epoch <= known:
                        continue
                    if hits is None:
                        hits = {}
                    blo = key[0]
                    bhi = key[2]
                    _widen(hits, op, max(lo, blo), min(hi, bhi))
        if self.successor_waits:
            # Successor mode: reuse and writes wait for a later collective (peers may still read
            # my window); a read of the result needs the collective locally complete only, the
            # local kernel itself wrote it.
            hits = self._successor_not_done(clocks, stream, lo, hi, access, protected, hits)
        return hits

    def _successor_not_done(self, clocks, stream, lo, hi, access, protected, hits):
        """Successor mode's part of _not_done: what every communicator's SuccessorWait.not_done
        adds, in the order of successor_waits. Only one with a waiting window buffer overlapping
        [lo, hi) can add anything, so only those are asked (successor_index finds them): an access
        costs O(log n + overlaps), not O(communicators)."""
        waiting = self.successor_index
        if not waiting.count:
            return hits
        asked = None
        for _, _, item in waiting.overlapping(lo, hi):
            if asked is None:
                asked = {}
            asked[item[0]] = None
        if asked is not None:
            for sc in (sorted(asked, key=_ordinal) if len(asked) > 1 else asked):
                hits = sc.not_done(clocks, stream, lo, hi, access, protected, hits)
        return hits

    def _wide_unfinished(self, stream, lo, hi, access, protected):
        """What _unfinished would list, restricted to the streams that have a buffer overlapping
        [lo, hi) that conflicts with `access` and is not done for `stream`: found through the wide
        index in O(log n + overlaps), not by walking every stream in flight. They come in the
        table's order (InFlight.order), and each is then queried as _unfinished's list would be,
        so the findings and their order are the same as the walk's. None when there is none."""
        clocks = self.clocks
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
                known = _known_by_recorded(clocks, protected, s, known)
            if op.epoch <= known:
                continue
            if found is None:
                found = {}
            found[self.inflight[s]] = known
        if found is None:
            return None
        unfinished = list(found.items())
        if len(unfinished) > 1:
            unfinished.sort(key=_entered)
        return unfinished

    def _widen_index(self) -> None:
        """More than CROWD streams have work in flight: index all of it in one place."""
        wide = self.wide = BufferIndex()
        for fl in self.inflight.values():
            ops = fl.ops
            for i in range(fl.start, len(ops)):
                op = ops[i]
                op.wide_serial = wide.add_serial(op.buffers(), op)

    def _narrow_index(self) -> None:
        """Few streams left with work in flight: the walk is cheaper than the wide index."""
        for fl in self.inflight.values():
            ops = fl.ops
            for i in range(fl.start, len(ops)):
                ops[i].wide_serial = 0
        self.wide = None

    def _live_ranges(self) -> RangeIndex:
        """Every live block by address. A block enters the index at the first query after its
        alloc: most are freed before any query looks."""
        if self.allocs > self.ranges_upto:
            upto = self.ranges_upto
            new = []
            for block in reversed(self.live.values()):  # in alloc order: the new ones last
                if block.serial <= upto:
                    break
                new.append(block)
            ranges = self.live_ranges
            for block in reversed(new):
                ranges.add(block.addr, block.end, block)
            self.ranges_upto = self.allocs
        return self.live_ranges

    def _graph_hits(self, lo, hi):
        """Captured ops of live graphs whose buffers overlap [lo, hi), graph by graph in the
        order of live_graphs. Only the graphs that graph_index finds with a reserved buffer there
        are asked: a free costs O(log n + overlaps), not O(live graphs)."""
        hits = None
        asked = None
        for _, _, g in self.graph_index.overlapping(lo, hi):
            if asked is None:
                asked = {}
            asked[g] = None
        if asked is None:
            return None
        for g in (sorted(asked, key=_ordinal) if len(asked) > 1 else asked):
            for blo, bhi, op in g.reserved.overlapping(lo, hi):
                if hits is None:
                    hits = {}
                _widen(hits, op, max(lo, blo), min(hi, bhi))
        return hits

    # ------------------------------------------------------------------ memory events

    def on_alloc(self, ev, line, at=None):
        if at is None:
            bid = ev.id
            addr = ev.addr
            size = ev.size
            stream = ev.stream
        else:  # compiled: the same fields, from their slots (_slots_of)
            bid = hazsan_slot(ev, at[0])
            addr = hazsan_slot(ev, at[1])
            size = hazsan_slot(ev, at[2])
            stream = hazsan_slot(ev, at[3])
        if bid in self.live:
            raise Malformed(f"alloc of id {bid!r}, which is live (allocated at line {self.live[bid].line})")
        block = _new_block(bid, addr, size, stream, line, self.step, ev)
        if self.windows.count:
            block.window = self.windows.first_at(addr, block.end)
            if block.window is not None:
                self.window_blocks.add(block)
        end = block.end
        graph_ops = self._graph_hits(addr, end) if self.live_graphs else None
        if graph_ops:
            for op, ov in graph_ops.items():
                self._report("graph-buffer-released", line, block, op, ov,
                             detail="a different block was allocated over a live graph's buffer")
        unfinished = self._unfinished(stream)
        hits = self._not_done(stream, addr, end, WRITE, unfinished) if unfinished is not None or self.successor_waits else None
        if hits:
            for op, ov in hits.items():
                if graph_ops and op.captured in graph_ops:
                    continue
                self._report("reuse-in-flight", line, block, op, ov)
        self.live[bid] = block
        self.allocs += 1
        block.serial = self.allocs

    def on_free(self, ev, line, at=None):
        bid = ev.id if at is None else hazsan_slot(ev, at[0])
        block = self.live.pop(bid, None)
        if block is None:
            raise Malformed(f"free of unknown or already freed id {bid!r}")
        addr, end = block.addr, block.end
        graph_ops = self._graph_hits(addr, end) if self.live_graphs else None
        if graph_ops:
            for op, ov in graph_ops.items():
                self._report("graph-buffer-released", line, block, op, ov,
                             detail="a block holding a live graph's buffer was freed")
        protected = block.record_streams
        unfinished = self._unfinished(block.stream, protected)
        hits = self._not_done(block.stream, addr, end, WRITE, unfinished, protected) \
            if unfinished is not None or self.successor_waits else None
        if hits:
            for op, ov in hits.items():
                if graph_ops and op.captured in graph_ops:
                    continue
                self._report("free-in-flight", line, block, op, ov)
        if protected is not None:
            # Until free_done the allocator holds the block; then the host knows these streams
            # as they were now (docs/ordering-and-rules.md, "record_stream and free_done"). With only its own stream recorded there is
            # nothing to learn, but the free_done that follows is still expected.
            self.pending_free[bid] = [self.clocks.snapshot(s) for s in protected]
        if block.serial <= self.ranges_upto:
            self.live_ranges.remove(addr, end, block)
        if block.window is not None:
            self.window_blocks.remove(block)
            if not block.coll_touched:
                self._transient(block, line)

    def on_free_done(self, ev, line, at=None):
        bid = ev.id if at is None else hazsan_slot(ev, at[0])
        snaps = self.pending_free.pop(bid, None)
        if snaps is None:
            if bid in self.live:
                raise Malformed(f"free_done of id {bid!r}, which is still live (no free yet)")
            raise Malformed(f"free_done with no pending free for id {bid!r} (free_done only follows a free of a block with record_stream streams)")
        if snaps:
            for clock in snaps:
                changed = self.clocks.host_learns(clock)
                if changed is not None:
                    self._retire(changed)

    def on_record_stream(self, ev, line, at=None):
        if at is None:
            bid = ev.id
            stream = ev.stream
        else:  # compiled: from their slots (_slots_of)
            bid = hazsan_slot(ev, at[0])
            stream = hazsan_slot(ev, at[1])
        block = self.live.get(bid)
        if block is None:
            raise Malformed(f"record_stream of unknown or freed id {bid!r}")
        if block.record_streams is None:
            block.record_streams = set()
        if stream != block.stream:  # its own stream: ignored, as PyTorch does
            block.record_streams.add(stream)

    def on_window(self, ev, line):
        addr = ev.addr
        size = ev.size
        comm = ev.comm
        if comm not in self.comms:
            self._new_comm(comm)
        ordinal = self.window_ordinals.get(comm, 0)
        self.window_ordinals[comm] = ordinal + 1
        w = Window(addr, size, comm, ordinal)
        self.windows.add(w)
        # SGLang registers a segment as a window when the scope exits, after the allocations
        # inside it: blocks already live there count as window blocks too, and the collectives
        # that touched them before (logged, see _mark_coll_touched) are marked on them first.
        if self.touches:
            self._apply_touches()
        for _, _, block in self._live_ranges().overlapping(w.addr, w.end):
            if block.window is None:
                block.window = w
                self.window_blocks.add(block)

    def on_window_free(self, ev, line):
        addr = ev.addr
        comm = ev.comm
        if not self.windows.remove(addr, comm):
            raise Malformed(f"window_free of unknown window addr={addr} comm={comm!r}")

    def on_segment(self, ev, line):
        pass  # placement context for `hazsan place`; no rule needs it

    def on_segment_free(self, ev, line):
        pass

    # ------------------------------------------------------------------ device work

    def on_launch(self, ev, line, at=None):
        if at is None:
            stream = ev.stream
            reads = ev.reads
            writes = ev.writes
        else:  # compiled: from their slots (_slots_of)
            stream = hazsan_slot(ev, at[0])
            reads = hazsan_slot(ev, at[1])
            writes = hazsan_slot(ev, at[2])
        if not reads and not writes:
            if not self.capturing:
                self.clocks.enqueue(stream)
            return
        op = _new_op("launch", stream, None, line, self.step, ev)  # buffers made when needed
        if self.capturing:
            self._capture(op, stream)
            return
        self._enqueue(op)

    def on_coll(self, ev, line, at=None):
        if at is None:
            cid = ev.cid
            comm = ev.comm
            seq = ev.seq
            stream = ev.stream
            evbufs = ev.bufs
        else:  # compiled: from their slots (_slots_of)
            cid = hazsan_slot(ev, at[0])
            comm = hazsan_slot(ev, at[1])
            seq = hazsan_slot(ev, at[2])
            stream = hazsan_slot(ev, at[3])
            evbufs = hazsan_slot(ev, at[4])
        if comm not in self.comms:
            self._new_comm(comm)
        if not self.cids.add(cid):
            raise Malformed(f"duplicate cid {cid!r}")
        bufs = [(b.addr, b.addr + b.size, ACCESS[b.access]) for b in evbufs]
        op = _new_op("coll", stream, bufs, line, self.step, ev)
        op.cid, op.comm, op.seq = cid, comm, seq
        self._mark_coll_touched(bufs)
        # Window buffers: for asymmetric-offset and successor mode.
        in_window = []
        if self.windows.count:
            windows = self.windows
            for b in bufs:
                w = windows.first_at(b[0], b[1])
                if w is not None:
                    in_window.append((b, w))
        own = [(b, w) for b, w in in_window if w.comm == comm]
        self.matcher.submit(self, comm, seq, op,
                            tuple([(w.ordinal, b[0] - w.addr, b[1] - b[0]) for b, w in own]) if own else ())
        if self.successor and own:
            window_bufs = [b for b, _ in own]
            op.window_bufs = window_bufs
            # (an equal buffer is in the same window: `in` by equality is by identity here)
            op.bufs = [b for b in bufs if b not in window_bufs]
        if self.capturing:
            self._capture(op, stream)
            return
        self._enqueue(op)
        op.clock = self.clocks.snapshot(stream)
        self.colls_in_flight[cid] = op

    def _new_comm(self, comm) -> None:
        if len(self.comms) >= self.max_comms:
            raise Malformed(f"communicator {comm!r} is one more than the limit of {self.max_comms:,} distinct "
                            "communicators on one rank (raise it with --max-comms)")
        self.comms.add(comm)

    def _mark_coll_touched(self, bufs) -> None:
        """A block is a collective buffer once any collective touches part of it (even before a
        window is registered over it). Only the free of a window block asks (transient-in-window).

        A live block that overlaps a live window is a window block (it became one at its alloc
        or when the window was registered), so the live window blocks, few and indexed by
        address, are marked at once. A buffer inside one live window can touch no other block.
        A buffer outside windows may touch blocks that are not window blocks yet and become
        ones if a window is registered over them while they live: it is logged, with the allocs
        made by then (the blocks live now have serials up to that), and marked on every live
        block through the address index when a window is registered or the log grows long.
        Most collectives of a serving stack work inside windows, and most blocks are freed
        before any of that matters: they never enter the index."""
        t = self.allocs
        touches = self.touches
        window_blocks = self.window_blocks
        windows = self.windows
        for lo, hi, _ in bufs:
            if window_blocks.count:
                for blk in window_blocks.overlapping(lo, hi):
                    blk.coll_touched = True
            if windows.count:
                w = windows.first_at(lo, hi)
                if w is not None and w.addr <= lo and hi <= w.end:
                    continue
            touches.append((lo, hi, t))
        if len(touches) > TOUCH_LOG:
            self._apply_touches()

    def _apply_touches(self) -> None:
        """Mark the logged collective buffers on the live blocks they touched."""
        ranges = self._live_ranges()
        for lo, hi, t in self.touches:
            for _, _, blk in ranges.overlapping(lo, hi):
                if blk.serial <= t:  # live when the collective ran (allocated before it, not freed since)
                    blk.coll_touched = True
        self.touches = []

    def _enqueue(self, op: Op) -> None:
        stream = op.stream
        clocks = self.clocks
        epoch = clocks.enqueue(stream)
        op.epoch = epoch
        if self.completions is not None:
            self.completions.enqueued(op)
        # unordered-access: this op's accesses against everything not done for its stream.
        conflicts = None
        unfinished = self._unfinished(stream)
        if unfinished is not None or self.successor_waits:
            for lo, hi, acc in (*op.bufs, *op.window_bufs) if op.window_bufs else op.buffers():
                hits = self._not_done(stream, lo, hi, acc, unfinished)
                if hits:
                    if conflicts is None:
                        conflicts = hits
                    else:
                        for other, (olo, ohi) in hits.items():
                            _widen(conflicts, other, olo, ohi)
        if conflicts:
            for other, ov in conflicts.items():
                self._report("unordered-access", self.line, None, other, ov, access_op=op)
        if op.bufs is None or op.bufs:  # None: a launch with buffers not made yet
            fl = self.inflight.get(stream)
            if fl is None:
                self.entered += 1
                fl = self.inflight[stream] = InFlight(self.entered)
                fl.push(op, epoch)
                if self.wide is None and len(self.inflight) > CROWD:
                    self._widen_index()
                elif self.wide is not None:
                    op.wide_serial = self.wide.add_serial(op.buffers(), op)
            else:
                fl.push(op, epoch)
                if self.wide is not None:
                    op.wide_serial = self.wide.add_serial(op.buffers(), op)
            if self.settled is not None and self.settled != stream:
                self.settled = None  # an op of another stream may be unfinished for it
        if self.successor and op.kind == "coll" and op.captured is None:
            sc = self.successor_waits.get(op.comm)
            if sc is None:
                sc = self.successor_waits[op.comm] = SuccessorWait(len(self.successor_waits))
            sc.push(op)
            if op.window_bufs:
                keys = []
                waiting = self.successor_index
                for lo, hi, _ in op.window_bufs:
                    item = (sc, op)
                    waiting.add(lo, hi, item)
                    keys.append((lo, hi, item))
                op.succ_keys = keys
            if stream not in sc.streams:
                sc.streams.add(stream)
                listed = self.successor_on.get(stream)
                if listed is None:
                    listed = self.successor_on[stream] = {}
                listed[sc] = None

    def on_coll_done(self, ev, line):
        cid = ev.cid
        op = self.colls_in_flight.pop(cid, None)
        if op is None:
            if cid in self.cids:
                return  # already retired (done for the host) or captured in a graph
            raise Malformed(f"coll_done of unknown cid {cid!r}")
        changed = self.clocks.host_learns(op.clock)
        if changed is not None:
            self._retire(changed)

    def on_record(self, ev, line, at=None):
        if at is None:
            event = ev.event
            stream = ev.stream
        else:  # compiled: from their slots (_slots_of)
            event = hazsan_slot(ev, at[0])
            stream = hazsan_slot(ev, at[1])
        if not self.capturing:
            self.clocks.record(event, stream)

    def on_wait(self, ev, line, at=None):
        if at is None:
            event = ev.event
            stream = ev.stream
        else:  # compiled: from their slots (_slots_of)
            event = hazsan_slot(ev, at[0])
            stream = hazsan_slot(ev, at[1])
        if not self.capturing and not self.clocks.wait(stream, event):
            self.unrecorded_waits += 1

    def on_sync(self, ev, line):
        stream = ev.stream
        event = ev.event
        clocks = self.clocks
        # The host learns only what changed, and only streams whose host entry grew can retire
        # anything (every in-flight op has an epoch above what the host knows of its stream).
        if stream is not None:
            changed = clocks.sync_stream(stream)
        elif event is not None:
            clock = clocks.events.get(event)
            if clock is None:
                self.unrecorded_waits += 1
                return
            changed = clocks.host_learns(clock)
        else:
            changed = clocks.sync_device()
        if changed is not None:
            self._retire(changed)

    def _retire(self, learned=None) -> None:
        """Drop ops done for the host: no stream can ever see them unfinished again. `learned`:
        the clock the host just learned (only its streams can have new ops done), None for all."""
        if self.completions is not None:
            self.completions.host_learned(learned)
        vh = self.clocks.host
        inflight = self.inflight
        streams = inflight if learned is None or len(learned) > len(inflight) else learned
        emptied = None
        for s in streams:
            fl = inflight.get(s)
            if fl is None:
                continue
            known = vh.get(s, 0)
            if known:
                for op in fl.retire_upto(known):
                    if op.clock is not None:
                        self.colls_in_flight.pop(op.cid, None)
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
                del inflight[s]
            if self.wide is not None and len(inflight) <= CROWD // 4:
                self._narrow_index()
        if self.successor_waits:
            self._successor_retire(learned)

    def _successor_retire(self, learned) -> None:
        """Successor mode's part of _retire: a collective leaves once it is done for the host
        itself, locally complete and a later one done (SuccessorWait.retire). Only the host's
        entries for its streams decide that, so only the communicators waiting on a stream the
        host just learned more of (`learned`; None: all) are asked: a sync costs what it
        changed, not O(communicators)."""
        vh = self.clocks.host
        on = self.successor_on
        if learned is None:
            asked = list(self.successor_waits.values())
        else:
            asked = []
            for s in learned:
                listed = on.get(s)
                if listed:
                    asked.extend(listed)
        waiting = self.successor_index
        for sc in asked:
            gone = sc.retire(vh)
            if gone:
                if self.completions is not None:
                    self.completions.successor_done(gone)
                for op in gone:
                    keys = op.succ_keys
                    if keys is not None:
                        for lo, hi, item in keys:
                            waiting.remove(lo, hi, item)
                        op.succ_keys = None
                if not len(sc) and sc.streams:
                    for s in sc.streams:
                        listed = on.get(s)
                        if listed is not None:
                            listed.pop(sc, None)
                            if not listed:
                                del on[s]
                    sc.streams.clear()

    # ------------------------------------------------------------------ graphs

    def _capture(self, op: Op, stream) -> None:
        graph = None
        for g in reversed(self.capturing):
            if g.stream == stream:
                graph = g
                break
        (graph or self.capturing[-1]).ops.append(op)

    def on_graph_begin(self, ev, line):
        gid = ev.graph
        stream = ev.stream
        if gid in self.graphs:
            raise Malformed(f"graph_begin of graph {gid!r}, which already exists")
        g = Graph(gid, stream, line)
        self.graphs[gid] = g
        self.capturing.append(g)

    def on_graph_end(self, ev, line):
        gid = ev.graph
        g = self.graphs.get(gid)
        if g is None or g not in self.capturing:
            raise Malformed(f"graph_end of graph {gid!r}, which is not being captured")
        self.capturing.remove(g)
        g.live = True
        g.reserved = RangeIndex()
        every = self.graph_index
        for op in g.ops:
            for lo, hi, _ in (*op.buffers(), *op.window_bufs):
                g.reserved.add(lo, hi, op)
                every.add(lo, hi, g)
        self.graphs_made_live += 1
        g.ordinal = self.graphs_made_live
        self.live_graphs.append(g)

    def on_graph_replay(self, ev, line):
        gid = ev.graph
        stream = ev.stream
        g = self.graphs.get(gid)
        if g is None or not g.live:
            raise Malformed(f"graph_replay of graph {gid!r}, which is not a captured, live graph")
        for op in g.ops:
            replay = op.replay(stream, line, self.step)
            if replay.kind == "coll":
                self._mark_coll_touched((*replay.bufs, *replay.window_bufs))
            if replay.window_bufs:
                # A replay carries no new seq: in successor mode its window buffers follow the
                # local rule (they are reserved for the graph's life anyway).
                replay.bufs = [*replay.bufs, *replay.window_bufs]
                replay.window_bufs = ()
            self._enqueue(replay)

    def on_graph_free(self, ev, line):
        gid = ev.graph
        g = self.graphs.pop(gid, None)
        if g is None:
            raise Malformed(f"graph_free of unknown graph {gid!r}")
        if g in self.capturing:
            self.capturing.remove(g)
        if g.live and g.reserved is not None:
            every = self.graph_index
            for op in g.ops:
                for lo, hi, _ in (*op.buffers(), *op.window_bufs):
                    every.remove(lo, hi, g)
            g.live = False
        if g in self.live_graphs:
            self.live_graphs.remove(g)

    # ------------------------------------------------------------------ annotations

    def on_scope(self, ev, line):
        pass  # placement context (symmetric pools) for capture and `hazsan place`

    def on_step(self, ev, line):
        self.step = ev.n
        self.steps_seen.add(ev.n)

    def on_dropped(self, ev, line):
        self.counted_drops += ev.count

    def on_hook_error(self, ev, line):
        self.hook_errors += ev.count

    # ------------------------------------------------------------------ reporting

    def _report(self, rule, line, block, op, overlap, detail=None, access_op=None):
        f = Finding(rule=rule, severity=severity_of(rule), rank=self.rank, step=self.step,
                    file=self.file, line=line, block=BlockRecord.of(block) if block else None,
                    op=OpRecord.of(op), overlap=tuple(overlap), detail=detail)
        if access_op is not None:
            f.block = self._block_at(overlap[0], overlap[1])
            f.detail = (f"{access_op.kind} {access_op.name or ''} on stream {access_op.stream!r} "
                        f"(line {access_op.line}) is not ordered after the op it collides with").replace("  ", " ")
            f.site = access_op.site
        self.sink.add(f)

    def _block_at(self, lo, hi):
        """The live block holding [lo, hi), for display: of several, the one allocated first."""
        block = self._live_ranges().first_added(lo, hi)
        return BlockRecord.of(block) if block is not None else None

    def _transient(self, block: Block, line) -> None:
        key = block.site
        f = self.transients.get(key)
        size = block.end - block.addr
        if f is None:
            f = self.transients[key] = Finding(
                rule="transient-in-window", severity=severity_of("transient-in-window"), rank=self.rank,
                step=self.step, file=self.file, line=line, block=BlockRecord.of(block), op=None,
                overlap=None, count=1, bytes=size, site=block.site,
                detail=f"window of communicator {block.window.comm!r}")
        else:
            f.count += 1
            f.bytes += size
        f.by_step[self.step] = f.by_step.get(self.step, 0) + 1

    def finish(self) -> None:
        for f in self.transients.values():
            self.sink.add(f)
        self.transients.clear()


def _track_op(classes, op, number) -> None:
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


def _ordinal(sc):
    return sc.ordinal


def _position(entry):
    return entry[0]


def _entered(item):
    return item[0].order



def _known_by_recorded(clocks, protected, s, known):
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


def _widen(hits: dict, op, lo, hi) -> None:
    cur = hits.get(op)
    if cur is None:
        hits[op] = [lo, hi]
    else:
        if lo < cur[0]:
            cur[0] = lo
        if hi > cur[1]:
            cur[1] = hi
