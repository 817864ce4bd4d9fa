"""The records the engine replays a rank with (docs/ordering-and-rules.md, "What the analysis
keeps"): a live allocation (`LiveBlock`), device work with declared buffers (`Op`), a registered
window (`Window`), a captured CUDA graph (`Graph`); and `widen`, how an op's overlap with an
access grows in a query's hits.

Compiled by Cython with the engine (types in records.pxd beside it; buildinfo.COMPILED). The
frequent ones are made by `new_block` and `new_op`, without a call through the type.
"""
from __future__ import annotations

from sanitizer.rules.kinds import READ, WRITE
from sanitizer.trace import events as E


class LiveBlock:
    """A live allocation as the engine replays it (made by new_block); sanitizer.place's
    AllocatorBlock is the placement model's, sanitizer.capture's StorageBlock capture's."""

    __slots__ = ("id", "addr", "end", "stream", "line", "step", "ev",
                 "record_streams", "window", "coll_touched", "serial", "captured_in", "colls_seen")

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


def new_block(bid, addr, size, stream, line, step, ev):
    """A LiveBlock, made without a call through the type (no __init__: its argument parsing cost)."""
    block = LiveBlock.__new__(LiveBlock)
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
    block.captured_in = None  # the Graph being captured when it was allocated (RankAnalyzer.on_alloc)
    # transient-in-window's exposure: -1 when a collective could write a window over it from its
    # alloc on (one was not done for the host, or a graph capture took it), else the collectives the
    # rank had issued by then; one issued before its free exposes it too (RankAnalyzer.on_free)
    block.colls_seen = 0
    return block


def new_op(kind, stream, bufs, line, step, ev):
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
    op.observed = False
    op.released = None
    return op


class Op:
    """Device work with declared buffers: (lo, hi, access) triples, access READ/WRITE bitmask.
    `bufs` is None for a launch whose buffers are still only in its event (it has at least one):
    `buffers()` makes them."""

    __slots__ = ("kind", "stream", "epoch", "bufs", "line", "step", "ev", "cid", "comm", "seq",
                 "clock", "captured", "window_bufs", "index_keys", "wide_serial", "succ_keys", "observed",
                 "released")

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
        self.index_keys = None  # its entries in its stream's BufferIndex while in flight (inflight.py)
        self.wide_serial = 0  # the serial of its first entry in InFlightTable.wide while there (0: none)
        self.succ_keys = None  # successor mode: its window buffers' entries in SuccessorWaits.index
        # an observed `coll_done` (capture saw it finish, the program did not wait): done for the
        # free rules, still unordered for accesses (docs/ordering-and-rules.md, "Observed completion")
        self.observed = False
        # once observed: the ranges of the blocks freed since; a buffer overlapping one is the
        # old block's, gone with it, and no longer conflicts with an access (None: none)
        self.released = None

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
        op.observed = False
        op.released = None
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
    """A registered window: [addr, end) of communicator `comm`, the `ordinal`-th it registered
    on this rank (asymmetric-offset compares offsets within the same ordinal)."""

    __slots__ = ("addr", "end", "comm", "ordinal")

    def __init__(self, addr, size, comm, ordinal):
        self.addr, self.end, self.comm, self.ordinal = addr, addr + size, comm, ordinal


class Graph:
    """A CUDA graph: its captured ops, and once live (graph_end) their buffers, reserved until
    graph_free; `pool`, the private pool it was captured into (graphs that share one replay one
    at a time, so a capture into the same pool may take a live graph's bytes: RankAnalyzer._graph_hits).

    `foreign`: the blocks allocated during its capture from another pool (SGLang's symmetric scope
    pauses the graph pool: an einsum's transients land in the window pool). Captured kernels
    write them at every replay whether or not the trace saw those kernels, so from graph_end
    their bytes are reserved too (`foreign_reserved`, item an Op standing for those writes), and
    asked only where no captured op of the graph covers the range."""

    __slots__ = ("id", "stream", "ops", "live", "line", "reserved", "ordinal", "pool", "foreign",
                 "foreign_reserved", "ordering", "side_streams")

    def __init__(self, gid, stream, line, pool):
        self.id, self.stream, self.line, self.pool = gid, stream, line, pool
        self.ops: list[Op] = []
        self.live = False
        self.reserved = None  # RangeIndex of the captured ops' buffers, once live
        self.ordinal = 0  # graphs made live before it, once live (RankAnalyzer.live_graphs' order)
        self.foreign = None  # list of LiveBlock allocated during capture from another pool (None: none)
        self.foreign_reserved = None  # RangeIndex of their ranges, once live (None: none)
        # the `record`/`wait` captured with its ops: (ops captured before it, is a wait, event,
        # stream), in capture order (None: none). A replay runs them between its ops.
        self.ordering = None
        # the captured streams other than `stream`, once live (None: every op on `stream`): each
        # is a lane of its own at replay, forked from the replay stream and joined back at the end
        self.side_streams = None


def widen(hits, op, lo, hi) -> None:
    """Grow `op`'s overlap in `hits` ({op: [overlap lo, overlap hi]}, a query's answer) to
    cover [lo, hi)."""
    cur = hits.get(op)
    if cur is None:
        hits[op] = [lo, hi]
    else:
        if lo < cur[0]:
            cur[0] = lo
        if hi > cur[1]:
            cur[1] = hi
