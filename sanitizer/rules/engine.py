"""The happens-before engine: the algorithm, and nothing else (docs/ordering-and-rules.md).

One statement of the algorithm: RankAnalyzer, which event fires which rule and which query it
asks. It runs as plain Python, and the same source is compiled by Cython (pure-Python mode; the
types are in the .pxd files beside each module) into extensions. Which of the two runs is
sanitizer.rules.select's; everything around the algorithm (finding the files, reading and decoding
them, round-robin over ranks, the summary) sanitizer.rules.driver's. What it keeps, each compiled
with it (buildinfo.COMPILED), is in a module of its own:

  kinds       each event kind's number in the dispatch, where its fields sit, access bits
  records     LiveBlock, Op, Window, Graph (and `widen`, an op's overlap in a query's hits)
  intervals   RangeIndex, SeenIds: interval and id sets that know nothing of ops or clocks
  inflight    InFlight, BufferIndex, InFlightTable: the ops not yet done for the host
  successor   SuccessorWait(s): `--peer-completion successor`'s collectives awaiting a successor
  windows     WindowTable, BlockSet, WindowBlocks: live windows, the blocks in them, transients
  matcher     CollectiveMatcher: asymmetric-offset across ranks

* Each rank is replayed in program order. `StreamClocks` (sanitizer.order.clocks) answers "is op
  O done for stream X". An op with declared buffers (a `launch` with reads/writes, a `coll` with
  bufs) stays *in flight* until it is done for the host; then nobody can ever see it unfinished
  again and it is retired.
* In-flight ops are kept per stream, in epoch order and by address (InFlightTable): an access
  costs O(streams with ops not done for X, each log n) plus the overlaps, and past CROWD streams
  in flight O(log n + overlaps) through one index for all of them. Never O(in-flight ops),
  O(streams seen) nor O(trace length) (docs/ordering-and-rules.md, "When is an op done", "What
  the analysis keeps").
* The host clock takes in only what changed (`StreamClocks.dirty`), and only the streams whose
  host entry grew retire work: a device-wide sync costs O(streams changed since the last one).
* transient-in-window asks, at the free of a window block, whether a collective touched it during
  its life: collectives mark the live window blocks (few) at once; their buffers outside windows
  are logged for blocks that a window registered later makes window blocks (WindowBlocks).
* Per event: a switch on the kind's number (kinds.KIND_CODES, either trace format), the frequent
  kinds' fields read from their slots when compiled, a launch's buffers made from its event only when a
  query needs them. On the decode trace the engine costs about 2,100 instructions per event
  (benchmarks/README.md, "streams_scaling.py").
* `--peer-completion successor`: a collective's buffers inside a window of its own communicator
  are done for X only once a later (program order, higher seq) collective on that communicator is
  locally done for X: its successor. Those buffers sit on a per-communicator list instead
  (SuccessorWaits).
* Rules fire on the event that exposes the hazard:
  alloc  -> reuse-in-flight, graph-buffer-released
  free   -> free-in-flight, graph-buffer-released, transient-in-window
  launch / coll / graph_replay -> unordered-access
  coll (all ranks together) -> asymmetric-offset, matched by (comm, seq) while the driver reads
  ranks round-robin, so pending matches stay bounded by how far ranks drift apart (the
  CollectiveMatcher, sanitizer.rules.matcher).
* Captured ops (between graph_begin and graph_end) neither run nor tick clocks; every
  graph_replay enqueues them again: those captured on another stream than the graph's on a lane
  of their own (replay_lane), forked from the replay stream and joined back, ordered in between
  by the record/wait captured with them (Graph.ordering). From graph_end to graph_free their buffers are reserved, per
  private pool: an allocation from the graph's pool or during a capture into it may take them
  (graphs of one pool replay one at a time), anything else is graph-buffer-released
  (_shares_pool). Blocks a capture takes from another pool (the window pool under SGLang's
  paused graph pool) are reserved for the graph too (Graph.foreign).
* transient-in-window also asks that the block was exposed to a collective: one not done for the
  host at its alloc (InFlightTable.colls, or a window buffer waiting for its successor), one
  issued before its free (colls_issued), or a capture took it (LiveBlock.colls_seen).
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

from sanitizer.limits import Limits
from sanitizer.order.clocks import MAX_EVENTS, MAX_STREAMS, StreamClocks, TooMany, merge_changed
from sanitizer.order.threads import HostThreads
from sanitizer.rules.findings import BlockRecord, Finding, OpRecord, severity_of
from sanitizer.rules.inflight import InFlightTable
from sanitizer.rules.intervals import RangeIndex, SeenIds
from sanitizer.rules.kinds import ACCESS, KIND_CODES, WRITE, kind_entry
from sanitizer.rules.records import Graph, new_block, new_op, widen
from sanitizer.rules.successor import SuccessorWaits
from sanitizer.rules.windows import WindowBlocks
from sanitizer.trace import events as E

# The engine's parts, by the names the driver and the tests use on the engine they loaded
# (compiled, or the interpreted copies select loads together).
from sanitizer.rules.inflight import CROWD, BufferIndex, InFlight  # noqa: F401
from sanitizer.rules.matcher import CollectiveMatcher  # noqa: F401 - the driver's default
from sanitizer.rules.records import LiveBlock, Op, Window  # noqa: F401
from sanitizer.rules.successor import SuccessorWait  # noqa: F401
from sanitizer.rules.windows import BlockSet, WindowTable  # noqa: F401

#: Distinct communicators one rank may use by default (sanitizer.limits.Limits; `hazsan check --max-comms`).
MAX_COMMS = Limits.max_comms
LOCAL, SUCCESSOR = "local", "successor"


class Malformed(Exception):
    """An event that breaks the contract given the state (docs/trace-format.md); the message names the problem."""


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
        # None while one host thread wrote the trace (the usual case); else the threads' clocks
        # (sanitizer.order.threads): accesses are judged with the issuing thread's, the memory
        # rules with what all know together (StreamClocks.union)
        self.threads = None
        self.comms = set()  # communicators this rank used (windows, collectives)
        self.max_comms = max_comms
        self.inflight = InFlightTable()  # the ops with buffers not yet done for the host
        # successor mode: the collectives whose window buffers wait for their successor
        self.successor_waits = SuccessorWaits()
        self.live = {}  # block id -> LiveBlock
        # every live block by address, for collective-buffer marking: the blocks of the first
        # `ranges_upto` allocs (serials) are in it, the later ones enter at the next query
        self.live_ranges = RangeIndex()
        self.allocs = 0
        self.ranges_upto = 0
        # the live windows, the live blocks in them, and the transients among those freed
        self.window_blocks = WindowBlocks()
        self.pending_free = {}  # block id -> clocks its record_stream streams had at the free
        self.colls_in_flight = {}  # cid -> Op
        # collectives an observed coll_done retired for the free rules while the program has not
        # synchronised with them: a free after the observation releases their buffers in it
        self.observed_ops = []
        self.cids = SeenIds()
        self.graphs = {}
        self.capturing = []
        self.live_graphs = []
        # every reserved buffer of every live graph, item the graph: a free asks only the graphs
        # with one overlapping it (_graph_hits)
        self.graph_index = RangeIndex()
        self.graphs_made_live = 0
        # collectives issued (outside captures, replayed ones too): a window block freed after
        # one was issued during its life was exposed to peers' writes (transient-in-window)
        self.colls_issued = 0
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
            E.HookError: self.on_hook_error, E.Thread: self.on_thread, E.ThreadStart: self.on_thread_start,
            E.ThreadEnd: self.on_thread_end, E.ThreadJoin: self.on_thread_join, E.Release: self.on_release,
            E.Acquire: self.on_acquire,
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
                entry = kind_entry(type(ev))
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

    def _not_done(self, stream, lo, hi, access, unfinished, protected=None):
        """Ops with a buffer overlapping [lo, hi) that conflicts with `access` and is not done
        for `stream` (docs/ordering-and-rules.md, "When is an op done"). Returns {op: [overlap_lo, overlap_hi]}.
        `unfinished`: what InFlightTable.unfinished says now for `stream` and `protected`."""
        hits = None
        if unfinished is not None:
            hits = self.inflight.not_done(self.clocks, stream, lo, hi, access, unfinished, protected)
        if self.successor_waits.by_comm:
            # Successor mode: reuse and writes wait for a later collective (peers may still read
            # my window); a read of the result needs the collective locally complete only, the
            # local kernel itself wrote it.
            hits = self.successor_waits.not_done(self.clocks, stream, lo, hi, access, protected, hits)
        return hits

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

    def _graph_hits(self, lo, hi, pool, block):
        """Captured ops of live graphs whose buffers overlap [lo, hi), graph by graph in the
        order of live_graphs: (released, shared), each {op: overlap} or None. `released`: the
        graphs whose reservation this allocation (`block` None, from `pool`) or the free of
        `block` (of `pool`) breaks; `shared`: those whose pool contract allows it (_shares_pool).
        Only the graphs that graph_index finds with a reserved buffer there are asked: an access
        costs O(log n + overlaps), not O(live graphs)."""
        released = None
        shared = None
        asked = None
        for _, _, g in self.graph_index.overlapping(lo, hi):
            if asked is None:
                asked = {}
            asked[g] = None
        if asked is None:
            return None, None
        for g in (sorted(asked, key=_ordinal) if len(asked) > 1 else asked):
            hits = None
            for blo, bhi, op in g.reserved.overlapping(lo, hi):
                if hits is None:
                    hits = {}
                widen(hits, op, max(lo, blo), min(hi, bhi))
            if hits is None and g.foreign_reserved is not None:
                # bytes its capture took from another pool, where no captured op of it is seen
                for blo, bhi, op in g.foreign_reserved.overlapping(lo, hi):
                    if hits is None:
                        hits = {}
                    widen(hits, op, max(lo, blo), min(hi, bhi))
            if hits is None:
                continue
            if self._shares_pool(g, pool, block):
                if shared is None:
                    shared = hits
                else:
                    shared.update(hits)  # an op is one graph's: no key is in both
            elif released is None:
                released = hits
            else:
                released.update(hits)
        return released, shared

    def _shares_pool(self, g, pool, block) -> bool:
        """Whether touching live graph g's reserved bytes is the shared-pool contract
        (docs/ordering-and-rules.md, "Graphs"): graphs captured into one private pool replay one
        at a time, and a later capture into the pool may take a graph's released bytes. So an
        allocation from g's pool, or made while a capture into g's pool runs, is no hazard; nor
        the free of a block of g's pool (its bytes stay where only captures into the pool take
        them), nor that of a block taken and given back within captures into g's pool. Anything
        else over g's bytes (eager allocations, other pools: the window pool, a MemPool) can be
        handed to work that runs while g replays."""
        gpool = g.pool
        if pool == gpool:
            return True
        if not self.capturing:
            return False
        if block is not None:
            cap = block.captured_in
            if cap is None or cap.pool != gpool:
                return False
        for c in self.capturing:
            if c.pool == gpool:
                return True
        return False

    def _capturing_graph(self, stream):
        """The graph a captured op or allocation on `stream` belongs to: the innermost capturing
        graph on the same stream, else the innermost."""
        for g in reversed(self.capturing):
            if g.stream == stream:
                return g
        return self.capturing[-1]

    # ------------------------------------------------------------------ memory events

    def on_alloc(self, ev, line, at=None):
        if at is None:
            bid = ev.id
            addr = ev.addr
            size = ev.size
            stream = ev.stream
        else:  # compiled: the same fields, from their slots (kinds.slots_of)
            bid = hazsan_slot(ev, at[0])
            addr = hazsan_slot(ev, at[1])
            size = hazsan_slot(ev, at[2])
            stream = hazsan_slot(ev, at[3])
        if bid in self.live:
            raise Malformed(f"alloc of id {bid!r}, which is live (allocated at line {self.live[bid].line})")
        if self.threads is not None:
            self._memory_rule(True)
            try:
                self._alloc(ev, line, bid, addr, size, stream)
            finally:
                self._memory_rule(False)
            return
        self._alloc(ev, line, bid, addr, size, stream)

    def _coll_running(self) -> bool:
        """With host threads: a collective with buffers that no thread knows done (the in-flight
        table keeps ops until every thread does), or a window buffer waiting for its successor."""
        if self.successor_waits.index.count:
            return True
        union = self.clocks.union
        for op in self.colls_in_flight.values():
            if op.bufs and not op.observed and union.get(op.stream, 0) < op.epoch:
                return True
        return False

    def _memory_rule(self, on) -> None:
        """With host threads: the memory rules ask what all threads know together (a block is
        freed or handed out again only once every thread holding it let go: the reference counts
        order that), the access rules the current thread's clock."""
        clocks = self.clocks
        clocks.host = clocks.union if on else self.threads.clocks[self.threads.current]
        self.inflight.settled = None

    def _alloc(self, ev, line, bid, addr, size, stream):
        block = new_block(bid, addr, size, stream, line, self.step, ev)
        pool = None
        if self.capturing:
            pool = ev.pool
            g = self._capturing_graph(stream)
            block.captured_in = g
            if pool != g.pool and g.stream == stream:
                # SGLang's symmetric scope pauses the graph pool during capture: the block is
                # another pool's, yet the graph's kernels write it at every replay. (Only on the
                # capture stream: a host tensor made meanwhile, stream "cpu", is no graph's.)
                if g.foreign is None:
                    g.foreign = []
                g.foreign.append(block)
            block.colls_seen = -1  # a replay's collectives run amid it: exposed for good
        elif self.threads is not None:
            block.colls_seen = -1 if self._coll_running() else self.colls_issued
        elif self.inflight.colls or self.successor_waits.index.count:
            block.colls_seen = -1  # a collective not done for the host may write the window now
        else:
            block.colls_seen = self.colls_issued
        windows = self.window_blocks.windows
        if windows.count:
            block.window = windows.first_at(addr, block.end)
            if block.window is not None:
                self.window_blocks.blocks.add(block)
        end = block.end
        graph_ops = shared = None
        if self.live_graphs:
            if pool is None:
                pool = ev.pool
            graph_ops, shared = self._graph_hits(addr, end, pool, None)
        if graph_ops:
            for op, ov in graph_ops.items():
                self._report("graph-buffer-released", line, block, op, ov,
                             detail=_released_detail(op, pool, "a different block was allocated over a live graph's buffer"))
        # None, the usual case: every op in flight is done for `stream`
        unfinished = self.inflight.unfinished(self.clocks, stream)
        hits = self._not_done(stream, addr, end, WRITE, unfinished) \
            if unfinished is not None or self.successor_waits.by_comm else None
        if hits:
            for op, ov in hits.items():
                if (graph_ops and op.captured in graph_ops) or (shared and op.captured in shared):
                    continue
                if op.observed:
                    continue  # seen finished: its memory is free, whatever the program knows
                self._report("reuse-in-flight", line, block, op, ov)
        self.live[bid] = block
        self.allocs += 1
        block.serial = self.allocs

    def on_free(self, ev, line, at=None):
        bid = ev.id if at is None else hazsan_slot(ev, at[0])
        block = self.live.pop(bid, None)
        if block is None:
            raise Malformed(f"free of unknown or already freed id {bid!r}")
        if self.threads is not None:
            self._memory_rule(True)
            try:
                self._free(bid, block, line)
            finally:
                self._memory_rule(False)
            return
        self._free(bid, block, line)

    def _free(self, bid, block, line):
        addr, end = block.addr, block.end
        graph_ops = shared = None
        if self.live_graphs:
            graph_ops, shared = self._graph_hits(addr, end, block.pool, block)
        if graph_ops:
            for op, ov in graph_ops.items():
                self._report("graph-buffer-released", line, block, op, ov,
                             detail=_released_detail(op, None, "a block holding a live graph's buffer was freed"))
        protected = block.record_streams
        unfinished = self.inflight.unfinished(self.clocks, block.stream, protected)
        hits = self._not_done(block.stream, addr, end, WRITE, unfinished, protected) \
            if unfinished is not None or self.successor_waits.by_comm else None
        if hits:
            for op, ov in hits.items():
                if (graph_ops and op.captured in graph_ops) or (shared and op.captured in shared):
                    continue
                if op.observed:
                    continue  # seen finished: nothing of it reads or writes the block any more
                self._report("free-in-flight", line, block, op, ov)
        if self.observed_ops:
            self._release_observed(addr, end)
        if self.threads is not None:
            self._release_done(addr, end)
        if protected is not None:
            # Until free_done the allocator holds the block; then the host knows these streams
            # as they were now (docs/ordering-and-rules.md, "record_stream and free_done"). With only its own stream recorded there is
            # nothing to learn, but the free_done that follows is still expected.
            self.pending_free[bid] = [self.clocks.snapshot(s) for s in protected]
        if block.serial <= self.ranges_upto:
            self.live_ranges.remove(addr, end, block)
        if block.window is not None:
            self.window_blocks.blocks.remove(block)
            # transient-in-window: never a collective buffer, and exposed to one during its life
            # (one not done for the host at its alloc, or one issued before this free): peers'
            # symmetric kernels write this rank's window only while its own collective runs
            # (docs/hazard-model.md, "When a window transient is a hazard")
            if not block.coll_touched and (block.colls_seen < 0 or self.colls_issued > block.colls_seen):
                self.window_blocks.transient(block, line, self.rank, self.step, self.file)

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
        else:  # compiled: from their slots (kinds.slots_of)
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
        w = self.window_blocks.register(addr, size, comm)
        # SGLang registers a segment as a window when the scope exits, after the allocations
        # inside it: blocks already live there count as window blocks too, and the collectives
        # that touched them before (logged, see WindowBlocks.mark_coll_touched) are marked on
        # them first.
        self.window_blocks.adopt(w, self._live_ranges())

    def on_window_free(self, ev, line):
        addr = ev.addr
        comm = ev.comm
        if not self.window_blocks.windows.remove(addr, comm):
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
        else:  # compiled: from their slots (kinds.slots_of)
            stream = hazsan_slot(ev, at[0])
            reads = hazsan_slot(ev, at[1])
            writes = hazsan_slot(ev, at[2])
        if not reads and not writes:
            if not self.capturing:
                if self.threads is not None:
                    self._issued_by(stream)
                self.clocks.enqueue(stream)
            return
        op = new_op("launch", stream, None, line, self.step, ev)  # buffers made when needed
        if self.capturing:
            self._capture(op, stream)
            return
        self._enqueue(op)
        if self.threads is not None:
            self._own_lane(op)

    def _own_lane(self, op) -> None:
        """A launch on the CPU lane of the thread that issued it, other than thread 0, ran before
        the thread went on: the thread knows it done, and so do the memory rules. (Thread 0's lane
        "cpu" keeps the lazy `sync` capture writes, as before there were threads.)"""
        threads = self.threads
        cur = threads.current
        if cur == 0 or threads.lanes.get(cur) != op.stream:
            return
        known = {op.stream: op.epoch}
        changed = self.clocks.host_learns_clock(known)
        if changed is not None:
            self._retire(changed)

    def on_coll(self, ev, line, at=None):
        if at is None:
            cid = ev.cid
            comm = ev.comm
            seq = ev.seq
            stream = ev.stream
            evbufs = ev.bufs
        else:  # compiled: from their slots (kinds.slots_of)
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
        op = new_op("coll", stream, bufs, line, self.step, ev)
        op.cid, op.comm, op.seq = cid, comm, seq
        # a block is a collective buffer once any collective touches part of it (even before a
        # window is registered over it); only the free of a window block asks (transient-in-window)
        if self.window_blocks.mark_coll_touched(bufs, self.allocs):
            self.window_blocks.apply_touches(self._live_ranges())
        # Window buffers: for asymmetric-offset and successor mode.
        in_window = []
        windows = self.window_blocks.windows
        if windows.count:
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
        self.colls_issued += 1
        self._enqueue(op)
        # (with host threads, what the issuing thread knew goes with it to whoever waits it)
        op.clock = self.clocks.snapshot(stream) if self.threads is None else self.clocks.snapshot_of_host(stream)
        self.colls_in_flight[cid] = op

    def _new_comm(self, comm) -> None:
        if len(self.comms) >= self.max_comms:
            raise Malformed(f"communicator {comm!r} is one more than the limit of {self.max_comms:,} distinct "
                            "communicators on one rank (raise it with --max-comms)")
        self.comms.add(comm)

    def _enqueue(self, op: Op) -> None:
        stream = op.stream
        clocks = self.clocks
        if self.threads is not None:
            self._issued_by(stream)
        epoch = clocks.enqueue(stream)
        op.epoch = epoch
        if self.completions is not None:
            self.completions.enqueued(op)
        # unordered-access: this op's accesses against everything not done for its stream.
        conflicts = None
        unfinished = self.inflight.unfinished(self.clocks, stream)
        if unfinished is not None or self.successor_waits.by_comm:
            for lo, hi, acc in (*op.bufs, *op.window_bufs) if op.window_bufs else op.buffers():
                hits = self._not_done(stream, lo, hi, acc, unfinished)
                if hits:
                    if conflicts is None:
                        conflicts = hits
                    else:
                        for other, (olo, ohi) in hits.items():
                            widen(conflicts, other, olo, ohi)
        if conflicts:
            for other, ov in conflicts.items():
                self._report("unordered-access", self.line, None, other, ov, access_op=op)
        if op.bufs is None or op.bufs:  # None: a launch with buffers not made yet
            self.inflight.push(op, epoch)
        if self.successor and op.kind == "coll" and op.captured is None:
            self.successor_waits.push(op)

    def on_coll_done(self, ev, line):
        cid = ev.cid
        if ev.observed:
            self._observed(cid)
            return
        threads = self.threads
        op = self.colls_in_flight.pop(cid, None) if threads is None else self.colls_in_flight.get(cid)
        if op is None:
            if cid in self.cids:
                return  # already retired (done for the host) or captured in a graph
            raise Malformed(f"coll_done of unknown cid {cid!r}")
        changed = self.clocks.host_learns(op.clock)
        if changed is not None:
            self._retire(changed)
        if threads is not None and cid in self.colls_in_flight:
            # with host threads, each thread that waits it learns from it, until all have
            if threads.floor((op.stream,)).get(op.stream, 0) >= op.epoch:
                del self.colls_in_flight[cid]

    def _observed(self, cid) -> None:
        """Capture saw collective `cid` finish; the program did not wait for it (docs/ordering-and-
        rules.md, "Observed completion"). Its memory is done with: no free or reuse of its buffers
        is in flight from now on. The host learns nothing: an access is ordered after it only by
        a later wait, barrier, event or synchronize of the program, or the verdict would depend on
        which of the two finished first in this run. It stays in flight for accesses until then."""
        op = self.colls_in_flight.get(cid)
        if op is None:
            if cid in self.cids:
                return  # already done for the host, or captured in a graph
            raise Malformed(f"coll_done of unknown cid {cid!r}")
        if op.observed or op.window_bufs:
            # (successor mode: its window buffers wait for peers, whom a local look says nothing of)
            return
        op.observed = True
        if op.bufs:
            self.inflight.colls -= 1  # no longer exposes a window transient (it writes nothing now)
            self.observed_ops.append(op)

    def _release_observed(self, addr, end) -> None:
        """A block [addr, end) was freed: the buffers in it of the collectives seen finished are
        the old block's, and no access to what is allocated there next conflicts with them. Those
        the program has since synchronised with (done for the host) leave the list."""
        host = self.clocks.host
        keep = []
        for op in self.observed_ops:
            if host.get(op.stream, 0) >= op.epoch:
                continue
            keep.append(op)
            for lo, hi, _ in op.bufs:
                if lo < end and addr < hi:
                    if op.released is None:
                        op.released = []
                    op.released.append((addr, end))
                    break
        self.observed_ops = keep

    def _release_done(self, addr, end) -> None:
        """With host threads, a block [addr, end) was freed: the ops in it that some thread knows
        done (they stay in flight until every thread does) touched the old block, and no access
        to what is allocated there next conflicts with them (as ThreadSanitizer forgets a freed
        range's accesses). Ops not done for any thread stay: their memory is a reuse hazard."""
        union = self.clocks.union
        inflight = self.inflight
        if inflight.wide is not None:
            # past CROWD streams in flight (a gloo lane per Work): one index, not a walk of them all
            self._release_keys(inflight.wide.overlapping(addr, end), union, addr, end)
            return
        for fl in inflight.streams.values():
            self._release_keys(fl.by_address().overlapping(addr, end), union, addr, end)

    def _release_keys(self, keys, union, addr, end) -> None:
        for key in keys:
            op = key[4]
            if union.get(op.stream, 0) >= op.epoch:
                if op.released is None:
                    op.released = []
                op.released.append((addr, end))

    def on_record(self, ev, line, at=None):
        if at is None:
            event = ev.event
            stream = ev.stream
        else:  # compiled: from their slots (kinds.slots_of)
            event = hazsan_slot(ev, at[0])
            stream = hazsan_slot(ev, at[1])
        if self.capturing:
            self._capture_ordering(False, event, stream)
        else:
            self.clocks.record(event, stream)

    def on_wait(self, ev, line, at=None):
        if at is None:
            event = ev.event
            stream = ev.stream
        else:  # compiled: from their slots (kinds.slots_of)
            event = hazsan_slot(ev, at[0])
            stream = hazsan_slot(ev, at[1])
        if self.capturing:
            self._capture_ordering(True, event, stream)
        elif not self.clocks.wait(stream, event):
            self.unrecorded_waits += 1

    def on_sync(self, ev, line):
        stream = ev.stream
        event = ev.event
        clocks = self.clocks
        if self.threads is not None and stream is not None and stream in self._other_lanes():
            return  # another thread's CPU work: no stream synchronize waits for a thread
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
        elif self.threads is None:
            changed = clocks.sync_device()
        else:
            changed = clocks.sync_device(self._other_lanes())
        if changed is not None:
            self._retire(changed)

    def _retire(self, learned=None) -> None:
        """Drop ops done for the host: no stream can ever see them unfinished again. `learned`:
        the clock the host just learned (only its streams can have new ops done), None for all."""
        if self.completions is not None:
            self.completions.host_learned(learned)
        host = self.clocks.host
        if self.threads is not None:
            self.threads.grew(self.threads.current)
            # done for every live thread; only the streams just learned can have moved
            host = self.threads.floor(self.clocks.union if learned is None else learned)
        self.inflight.retire(host, learned, self.colls_in_flight)
        if self.successor_waits.by_comm:
            self.successor_waits.retire(host, learned, self.completions)

    # ------------------------------------------------------------------ graphs

    def _capture(self, op: Op, stream) -> None:
        self._capturing_graph(stream).ops.append(op)

    def _capture_ordering(self, is_wait, event, stream) -> None:
        """A `record` or `wait` during a capture: an edge between the graph's own streams, run at
        every replay between the ops captured around it (on_graph_replay)."""
        g = self._capturing_graph(stream)
        if g.ordering is None:
            g.ordering = []
        g.ordering.append((len(g.ops), is_wait, event, stream))

    def on_graph_begin(self, ev, line):
        gid = ev.graph
        stream = ev.stream
        if gid in self.graphs:
            raise Malformed(f"graph_begin of graph {gid!r}, which already exists")
        pool = ev.pool
        g = Graph(gid, stream, line, f"graph:{gid}" if pool is None else pool)
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
        if g.foreign is not None:
            # what its kernels write in other pools' bytes: each block stands as one captured
            # write of its whole range, on the graph's stream, named by its alloc (line, site)
            g.foreign_reserved = RangeIndex()
            for block in g.foreign:
                op = new_op("launch", g.stream, [(block.addr, block.end, WRITE)], block.line, block.step, block.ev)
                g.foreign_reserved.add(block.addr, block.end, op)
                every.add(block.addr, block.end, g)
        side = None
        for op in g.ops:
            if op.stream != g.stream:
                if side is None:
                    side = []
                if op.stream not in side:
                    side.append(op.stream)
        if g.ordering is not None:
            for _, _, _, s in g.ordering:
                if s != g.stream:
                    if side is None:
                        side = []
                    if s not in side:
                        side.append(s)
        g.side_streams = side
        self.graphs_made_live += 1
        g.ordinal = self.graphs_made_live
        self.live_graphs.append(g)

    def on_graph_replay(self, ev, line):
        gid = ev.graph
        stream = ev.stream
        g = self.graphs.get(gid)
        if g is None or not g.live:
            raise Malformed(f"graph_replay of graph {gid!r}, which is not a captured, live graph")
        clocks = self.clocks
        lanes = None
        if g.side_streams is not None:
            # A replay is one launch on `stream`: the graph's first nodes follow what `stream` did
            # before, and what `stream` does next follows all of it. Inside, each captured stream
            # is a lane of its own, ordered only by the record/wait captured between them
            # (docs/ordering-and-rules.md, "CUDA graphs").
            lanes = {g.stream: stream}
            clocks.record(_FORK, stream)
            for s in g.side_streams:
                lane = replay_lane(s, stream)
                lanes[s] = lane
                clocks.wait(lane, _FORK)
        ordering = g.ordering
        k = 0
        n = 0 if ordering is None else len(ordering)
        for i, op in enumerate(g.ops):
            while k < n and ordering[k][0] <= i:
                self._replay_ordering(g, ordering[k], lanes, stream)
                k += 1
            replay = op.replay(stream if lanes is None else lanes[op.stream], line, self.step)
            if replay.kind == "coll":
                self.colls_issued += 1
                if self.window_blocks.mark_coll_touched((*replay.bufs, *replay.window_bufs), self.allocs):
                    self.window_blocks.apply_touches(self._live_ranges())
            if replay.window_bufs:
                # A replay carries no new seq: in successor mode its window buffers follow the
                # local rule (they are reserved for the graph's life anyway).
                replay.bufs = [*replay.bufs, *replay.window_bufs]
                replay.window_bufs = ()
            self._enqueue(replay)
        while k < n:
            self._replay_ordering(g, ordering[k], lanes, stream)
            k += 1
        if lanes is not None:
            for s in g.side_streams:
                clocks.record(_JOIN, lanes[s])
                clocks.wait(stream, _JOIN)

    def _replay_ordering(self, g, item, lanes, stream) -> None:
        """A captured record/wait at replay, on the lanes of its streams; its event is the
        graph's own (an event recorded inside a capture is a node of that graph)."""
        _, is_wait, event, s = item
        lane = stream if lanes is None else lanes[s]
        key = (g.id, event)
        if is_wait:
            self.clocks.wait(lane, key)
        else:
            self.clocks.record(key, lane)

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
            if g.foreign_reserved is not None:
                for block in g.foreign:
                    every.remove(block.addr, block.end, g)
            g.live = False
        if g in self.live_graphs:
            self.live_graphs.remove(g)

    # ------------------------------------------------------------------ host threads

    def _host_threads(self):
        """The threads' clocks, made at the first event that names a thread other than 0: until
        then the host clock was thread 0's (docs/ordering-and-rules.md, "Host threads")."""
        threads = self.threads
        if threads is None:
            clocks = self.clocks
            threads = self.threads = HostThreads(clocks.host, clocks.max_events)
            clocks.union = dict(clocks.host)
        return threads

    def _switch(self, thread, lane=None) -> None:
        threads = self.threads
        clocks = self.clocks
        merge_changed(clocks.union, threads.clock(thread, clocks.union, clocks.streams, lane), None)
        threads.current = thread
        clocks.host = threads.clocks[thread]
        self.inflight.settled = None  # its answers were for another thread's clock

    def _issued_by(self, stream) -> None:
        """The current thread enqueues on `stream`: VC_S = max(VC_S, VC_cur), as the table says
        (with one thread the sparse clocks take the host's part at each query instead; with several,
        work on a stream carries what its issuing thread knew then, whoever asks later). Only when
        the thread learned something since it last did so."""
        threads = self.threads
        cur = threads.current
        stamp = (cur, threads.version.get(cur, 0))
        if threads.merged.get(stream) != stamp:
            self.clocks.fold(stream, threads.clocks[cur])
            threads.merged[stream] = stamp

    def _other_lanes(self):
        threads = self.threads
        cur = threads.current
        return {lane for t, lane in threads.lanes.items() if t != cur}

    def on_thread(self, ev, line):
        thread = ev.thread
        if self.threads is None:
            if thread == 0:
                return
            self._host_threads()
        elif thread == self.threads.current:
            return
        self._switch(thread, ev.lane)

    def on_thread_start(self, ev, line):
        thread = ev.thread
        if thread == 0:
            raise Malformed("thread_start of thread 0, the main thread")
        threads = self._host_threads()
        if thread == threads.current:
            raise Malformed(f"thread_start of thread {thread!r} by itself")
        threads.start(thread, ev.lane, self.clocks.streams)
        merge_changed(self.clocks.union, threads.clocks[thread], None)  # (its start lane count)

    def on_thread_end(self, ev, line):
        threads = self.threads
        if threads is None or ev.thread not in threads.clocks:
            return  # a thread that issued nothing judged
        threads.end(ev.thread, self.clocks.streams)
        self._retire(None)  # it no longer holds back what the others know

    def on_thread_join(self, ev, line):
        threads = self.threads
        if threads is None:
            return
        final = threads.ended.get(ev.thread)
        if final is None:
            final = threads.clocks.get(ev.thread)
            if final is None:
                self.unrecorded_waits += 1
                return
            final = threads.published(ev.thread, self.clocks.streams)
        changed = self.clocks.host_learns_clock(final)
        if changed is not None:
            self._retire(changed)

    def on_release(self, ev, line):
        # With one thread so far, an edge orders nothing: a thread started later begins with what
        # its starter knows, one not seen starting with what all know, either way more than this.
        if self.threads is not None:
            self.threads.release(ev.sync, self.clocks.streams)

    def on_acquire(self, ev, line):
        threads = self.threads
        if threads is None:
            return
        released = threads.syncs.get(ev.sync)
        if released is None:
            self.unrecorded_waits += 1
            return
        changed = self.clocks.host_learns_clock(released)
        if changed is not None:
            self._retire(changed)

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

    def finish(self) -> None:
        self.window_blocks.finish(self.sink)


#: the events a replay forks its lanes from the replay stream with, and joins them back with
_FORK = ("graph replay", "fork")
_JOIN = ("graph replay", "join")


def replay_lane(captured_stream, replay_stream):
    """The stream that work captured on `captured_stream`, a side stream of a graph, runs on when
    the graph is replayed on `replay_stream`. A lane per (replay stream, captured stream): graphs
    replayed on one stream run one after the other, so their lanes may be shared."""
    return f"{captured_stream}@replay-on:{replay_stream}"


def _ordinal(g):
    return g.ordinal


def _released_detail(op, pool, what) -> str:
    """graph-buffer-released's detail: for a block its graph's capture took from another pool
    (RankAnalyzer.on_graph_end's stand-in op, whose event is that block's alloc), which pool."""
    ev = op.ev
    if type(ev) is E.Alloc:
        what = (f"{what}: bytes of block {ev.id!r} (pool {ev.pool!r}), which the graph's capture took from a "
                f"pool other than its own and which the graph rewrites at every replay")
        if pool is not None:
            what += f"; this allocation is from pool {pool!r}"
    return what
