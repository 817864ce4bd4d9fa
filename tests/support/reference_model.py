"""A brute-force reference for hazsan's rules, written from the ordering and rules contract alone
(docs/ordering-and-rules.md; first written from the older text of the contract).

It shares no code with `sanitizer/` on purpose: the property test in test_engine_property.py
runs both on the same random traces and compares what they find. Where the engine is built for
speed (indexes, pruning of finished ops, incremental state), this model is built to be obviously
right: it keeps every op that ever ran, and at every alloc, free and enqueue it looks at all of
them, buffer by buffer, and recomputes "done" from the vector clocks.

Decisions taken where the contract was silent (now in docs/ordering-and-rules.md; agreed with the lead, see the issue-2 report):
- One finding per (triggering event, op instance) pair, however many buffers overlap; its
  `overlap` spans the lowest lo to the highest hi of the hazardous intersections.
- A graph replay enqueues every captured launch/coll again, in capture order, one clock tick each;
  each instance's op line is the `graph_replay` line. Captured ops do not run at capture time and
  are not checked then. Work captured on the capture stream runs on the replay stream; work
  captured on another stream runs on a lane of its own per (replay stream, captured stream),
  which starts after what the replay stream had done and which the replay stream waits for at
  the end; in between, only the `record`/`wait` captured with the ops order the lanes (issue 50).
- `graph-buffer-released` names the captured `launch`/`coll` line as its op line; for that event
  and that captured op (and all its replays) no free-in-flight / reuse-in-flight is reported.
- Strict peer completion (`successor`) applies, per buffer, wherever "done" is asked: a coll's
  buffer that lies inside a live window of the coll's own comm (at enqueue time) is done for X only
  when the coll is locally complete for X *and* a later (program order) coll with a higher seq on
  that comm is locally complete for X ("only when" adds a condition: strict never reports less
  than local). Reads may be exempted from the second condition (see Semantics).
  A replayed coll carries no seq of its own: its buffers follow the local rule, and it is nobody's
  successor (DESIGN is silent; the engine's choice).
- `record_stream` to the block's own stream is a no-op, as in PyTorch. At the free, ops on a
  `record_stream` stream R and ops done for R are not in flight for it.
- `free_done` merges into the host clock the clocks the record_stream streams had at the free.
- `coll_done` merges the clock the coll's stream had right after enqueuing it. An `observed` one
  (capture saw the collective finish, the program did not wait) merges nothing: the collective is
  then done for free-in-flight and reuse-in-flight (and exposes no window transient), never for an
  access; a block freed after it takes the collective's buffers that overlap it along (an access
  to what is allocated there next does not conflict with them). Under `successor`, a collective
  with a buffer in its own window is not retired by an observation (its peers are not observed).
  A `coll_done` without `observed` after an observed one merges as ever (issue 54).
- `transient-in-window`: a block that overlapped a live window at some moment of its life (at its
  alloc, or when a window was registered over it: SGLang registers the pool segment as a window
  when the scope exits), freed, with no coll buffer (a coll line, captured or not, or a replayed
  coll) overlapping it between its alloc and its free, and exposed to a collective: allocated
  during a graph capture, or a coll with a buffer not done for the host (under the mode's rule)
  at its alloc, or a coll (or replayed coll) issued between its alloc and its free (issue 50,
  docs/hazard-model.md). Reported per (rank, alloc site, allocated during a capture) with a
  count and the sum of block sizes.
- Graph pools (issue 50): a graph's pool is its graph_begin's `pool`, else "graph:<graph>". A block
  allocated during a capture, on its stream, from a pool other than that graph's stands, from graph_end, as one
  write of its whole range by the graph (op line: its alloc line), asked only where no captured
  op of the graph overlaps the range. Touching a live graph's bytes is no graph-buffer-released
  (and, as for a finding, no free-in-flight / reuse-in-flight against its replays) where the pool
  contract allows it: an alloc from the graph's pool or while capturing into it; the free of a
  block of its pool, or of one allocated during a capture into its pool and freed during one.
- `asymmetric-offset`: per (comm, seq) the ordered list of (window ordinal, offset, size) of the
  coll's buffers lying inside a live window of that comm, the ordinal counting that comm's window
  registrations on the rank (NCCL registers windows collectively, so the n-th is the same window
  on every rank); every rank whose list differs from that of the lowest rank holding the same
  (comm, seq) gets one finding at its coll line.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

SEVERITY = {
    "reuse-in-flight": "error",
    # the latent hazards are errors too (docs/hazard-model.md, "Severity: every hazard is an error")
    "free-in-flight": "error",
    "transient-in-window": "error",
    "unordered-access": "error",
    "graph-buffer-released": "error",
    "asymmetric-offset": "error",
}

READ, WRITE = 1, 2
ACCESS = {"r": READ, "w": WRITE, "rw": READ | WRITE}


@dataclass(frozen=True)
class RefFinding:
    rule: str
    rank: int
    line: int | None = None
    op_line: int | None = None
    overlap: tuple[int, int] | None = None
    site: str | None = None
    count: int | None = None
    bytes: int | None = None

    @property
    def severity(self) -> str:
        return SEVERITY[self.rule]


@dataclass
class Buf:
    lo: int
    hi: int
    access: int
    in_own_window: bool = False  # only meaningful for colls


@dataclass
class Op:
    """One op instance that ran (a launch, a coll, or one replayed captured op)."""
    position: int          # program order of instances (replays give several per line)
    line: int              # enqueuing line: launch/coll, or graph_replay
    stream: object
    epoch: int
    clock: dict            # the stream's clock right after enqueue (for coll_done)
    bufs: list[Buf]
    is_coll: bool
    comm: object = None
    seq: object = None
    captured: tuple | None = None  # (graph, captured line) for replays
    observed: bool = False  # an observed coll_done: done for the free rules only


@dataclass
class CapturedOp:
    line: int
    raw: dict


@dataclass
class CapturedOrdering:
    """A `record` or `wait` during a capture: run at every replay, on its stream's lane."""
    is_wait: bool
    event: object
    stream: object


@dataclass
class Block:
    lo: int
    hi: int
    stream: object
    site: object
    alloc_position: int
    in_window: bool
    record_streams: set = field(default_factory=set)
    pool: object = None
    captured_pool: object = None   # the capturing graph's pool at its alloc (None: not captured)
    exposed: bool = False          # a collective could write a window over it from its alloc on


def _join(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        if v > out.get(k, 0):
            out[k] = v
    return out


def _intersection(alo, ahi, blo, bhi):
    lo = alo if alo > blo else blo
    hi = ahi if ahi < bhi else bhi
    return (lo, hi) if lo < hi else None


def _span(ranges):
    ranges = list(ranges)
    if not ranges:
        return None
    return (min(r[0] for r in ranges), max(r[1] for r in ranges))


@dataclass(frozen=True)
class Semantics:
    """Readings of the contract that the engine has (so far) taken differently; defaults = the
    literal text (docs/ordering-and-rules.md, "`successor`").

    strict_reads: in successor mode a *read* of a window buffer whose collective is not yet
        peer-complete is unordered too (docs/hazard-model.md: "peers read and write my window"; my local
        completion "says nothing about peers finishing theirs", so their writes may still land).
        False (the lead's decision on issue 2): only writes and reuse get the successor rule; a
        read needs the collective locally complete, as in local mode.
    """
    strict_reads: bool = True


DESIGN_SEMANTICS = Semantics()


class RankReference:
    """Replays one rank's events, in program order, and collects per-rank findings."""

    def __init__(self, rank: int, *, strict: bool, semantics: Semantics = DESIGN_SEMANTICS):
        self.rank = rank
        self.strict = strict
        self.semantics = semantics
        self.stream_clock: dict = defaultdict(dict)
        self.host: dict = {}
        self.event_clock: dict = {}
        self.coll_clock: dict = {}
        self.coll_op: dict = {}          # cid -> its Op (observed coll_done)
        self.ops: list[Op] = []
        self.blocks: dict = {}
        self.pending_free: dict = {}     # id -> list of stream clocks at the free
        self.windows: list[tuple] = []   # live (comm, lo, hi, ordinal)
        self.registrations: dict = defaultdict(int)  # comm -> windows registered so far
        self.graphs: dict = {}           # name -> list[CapturedOp]
        self.live_graphs: set = set()    # ended and not freed
        self.graph_pool: dict = {}       # name -> its pool
        self.graph_stream: dict = {}     # name -> its capture stream
        self.foreign: dict = defaultdict(list)  # name -> [(alloc line, lo, hi)] of other pools' blocks
        self.coll_issues: list = []      # positions of every coll enqueued (not captured; replays too)
        self.capturing = None
        self.coll_uses: list[tuple] = []  # (position, lo, hi) of every coll buffer use
        self.coll_offsets: dict = {}     # (comm, seq) -> (line, [(offset, size), ...])
        self.transients: dict = defaultdict(lambda: [0, 0])
        self.findings: list[RefFinding] = []
        self.position = 0
        # host threads: None while only thread 0 has shown up (self.host is its clock)
        self.tclock: dict | None = None   # thread -> its clock (the current one's is self.host)
        self.cur = 0
        self.lanes: dict = {}              # thread -> its lane
        self.live_threads: set = set()
        self.ended: dict = {}              # thread -> its clock and lane count at its end
        self.syncs: dict = {}              # synchronisation object -> the clock released into it
        self.union: dict = {}              # the max of every clock any thread ever had

    # ---- ordering (DESIGN 3) ----
    def _locally_complete(self, op: Op, x, host=None) -> bool:
        # the later of what stream x and the host have seen of op's stream (spelled out: the
        # quadratic checks call this millions of times on long scenarios). `host`: the clock of
        # the host that asks (None: the current thread's; the memory rules pass the union)
        if host is None:
            host = self.host
        return self.stream_clock[x].get(op.stream, 0) >= op.epoch or host.get(op.stream, 0) >= op.epoch

    def _buf_done(self, op: Op, buf: Buf, x, *, reading: bool = False, host=None) -> bool:
        local = self._locally_complete(op, x, host)
        if not (self.strict and op.is_coll and buf.in_own_window):
            return local
        successor_done = any(
            later.is_coll and later.captured is None and later.comm == op.comm
            and later.position > op.position
            and later.seq > op.seq and self._locally_complete(later, x, host)
            for later in self.ops
        )
        if reading and not self.semantics.strict_reads:
            return local
        # "Only when" adds a condition to the local rule: strict never reports less than local.
        return local and successor_done

    def _in_window_of(self, comm, lo, hi) -> bool:
        return self._window_of(comm, lo, hi) is not None

    def _window_of(self, comm, lo, hi):
        for c, wlo, whi, ordinal in self.windows:
            if c == comm and wlo <= lo and hi <= whi:
                return wlo, ordinal
        return None

    # ---- alloc / free rules ----
    def _graph_released(self, line, lo, hi, pool, block=None) -> set:
        """graph-buffer-released for every captured op of a live graph overlapping [lo, hi) (or
        its other pools' blocks, where no captured op does), unless the pool contract allows it.
        Returns every (graph, line) overlapped, reported or not (no in-flight finding on top)."""
        touched = set()
        for graph in sorted(self.live_graphs):
            gpool = self.graph_pool[graph]
            found = []
            for cap in self.graphs[graph]:
                if not isinstance(cap, CapturedOp):
                    continue
                hits = [_intersection(lo, hi, b.lo, b.hi) for b in _bufs_of(cap.raw)]
                hits = [h for h in hits if h]
                if hits:
                    found.append((cap.line, hits))
            if not found:
                for aline, flo, fhi in self.foreign[graph]:
                    hit = _intersection(lo, hi, flo, fhi)
                    if hit:
                        found.append((aline, [hit]))
            capturing_into = self.capturing is not None and self.graph_pool[self.capturing] == gpool
            if block is None:
                shared = pool == gpool or capturing_into
            else:
                shared = pool == gpool or (capturing_into and block.captured_pool == gpool)
            for op_line, hits in found:
                touched.add((graph, op_line))
                if not shared:
                    self._emit("graph-buffer-released", line=line, op_line=op_line, overlap=_span(hits))
        return touched

    def _memory_host(self) -> dict:
        """The host clock the memory rules ask: what all threads know together (the current
        thread's own while there is one)."""
        return self.host if self.tclock is None else self.union

    def _in_flight(self, rule, line, lo, hi, x, *, skip_streams=(), released=frozenset()):
        host = self._memory_host()
        for op in self.ops:
            if op.captured in released or op.stream in skip_streams or op.observed:
                continue
            # docs/ordering-and-rules.md, "record_stream and free_done": at the free, ops on a
            # record_stream stream R and ops done for R (the allocator's event on R follows them)
            # are no hazard for it
            hits = [
                _intersection(lo, hi, b.lo, b.hi)
                for b in op.bufs
                if _intersection(lo, hi, b.lo, b.hi) and not self._buf_done(op, b, x, host=host)
                and not any(self._buf_done(op, b, r, host=host) for r in skip_streams)
            ]
            if hits:
                self._emit(rule, line=line, op_line=op.line, overlap=_span(hits))

    def _emit(self, rule, **kw):
        self.findings.append(RefFinding(rule=rule, rank=self.rank, **kw))

    # ---- enqueue and unordered-access ----
    def _enqueue(self, line, stream, bufs, *, is_coll, comm=None, seq=None, captured=None):
        clock = _join(self.stream_clock[stream], self.host)
        clock[stream] = clock.get(stream, 0) + 1
        self.stream_clock[stream] = clock
        for b in bufs:
            b.in_own_window = is_coll and captured is None and self._in_window_of(comm, b.lo, b.hi)
        for other in self.ops:
            hits = []
            for nb in bufs:
                for ob in other.bufs:
                    inter = _intersection(nb.lo, nb.hi, ob.lo, ob.hi)
                    if inter and ((nb.access | ob.access) & WRITE) and not self._buf_done(
                            other, ob, stream, reading=not nb.access & WRITE):
                        hits.append(inter)
            if hits:
                self._emit("unordered-access", line=line, op_line=other.line, overlap=_span(hits))
        self.position += 1
        op = Op(position=self.position, line=line, stream=stream, epoch=clock[stream], clock=dict(clock),
                bufs=bufs, is_coll=is_coll, comm=comm, seq=seq, captured=captured)
        self.ops.append(op)
        if is_coll:
            self._note_coll_use(bufs)
            self.coll_issues.append(self.position)
        return op

    def _note_coll_use(self, bufs) -> None:
        self.coll_uses.extend((self.position, b.lo, b.hi) for b in bufs)

    # ---- the event loop ----
    def feed(self, line: int, ev: dict) -> None:
        kind = ev.get("ev")
        handler = getattr(self, "_ev_" + str(kind), None)
        if handler is not None:
            handler(line, ev)

    def _done_for_host(self, op: Op, buf: Buf, host=None) -> bool:
        if host is None:
            host = self.host
        if host.get(op.stream, 0) < op.epoch:
            return False
        if not (self.strict and op.is_coll and buf.in_own_window):
            return True
        return any(later.is_coll and later.captured is None and later.comm == op.comm
                   and later.position > op.position and later.seq > op.seq
                   and host.get(later.stream, 0) >= later.epoch for later in self.ops)

    def _ev_alloc(self, line, ev):
        lo, hi, x = ev["addr"], ev["addr"] + ev["size"], ev["stream"]
        released = self._graph_released(line, lo, hi, ev.get("pool"))
        self._in_flight("reuse-in-flight", line, lo, hi, x, released=released)
        self.position += 1
        in_window = any(_intersection(lo, hi, w[1], w[2]) for w in self.windows)
        block = Block(lo, hi, x, ev.get("site"), self.position, in_window, pool=ev.get("pool"))
        if self.capturing is not None:
            block.captured_pool = self.graph_pool[self.capturing]
            block.exposed = True
            if block.pool != block.captured_pool and x == self.graph_stream[self.capturing]:
                self.foreign[self.capturing].append((line, lo, hi))
        else:
            host = self._memory_host()
            block.exposed = any(op.is_coll and not op.observed
                                and any(not self._done_for_host(op, b, host) for b in op.bufs)
                                for op in self.ops)
        self.blocks[ev["id"]] = block

    def _ev_free(self, line, ev):
        block = self.blocks.pop(ev["id"])
        released = self._graph_released(line, block.lo, block.hi, block.pool, block)
        self._in_flight("free-in-flight", line, block.lo, block.hi, block.stream,
                        skip_streams=block.record_streams, released=released)
        for op in self.ops:
            if op.observed:   # the buffers it had in the freed block went with the block
                op.bufs = [b for b in op.bufs if not _intersection(block.lo, block.hi, b.lo, b.hi)]
            elif self.tclock is not None:
                # host threads: what some thread knows done touched the old block only
                op.bufs = [b for b in op.bufs if not (_intersection(block.lo, block.hi, b.lo, b.hi)
                                                      and self._done_for_host(op, b, self.union))]
        if block.record_streams:
            # the allocator's event on R at the free: max(VC_R, VC_H) then (H: the freeing thread)
            self.pending_free[ev["id"]] = [_join(self.stream_clock[s], self.host) for s in block.record_streams]
        if block.in_window:
            used = any(block.alloc_position < pos and _intersection(block.lo, block.hi, lo, hi)
                       for pos, lo, hi in self.coll_uses)
            exposed = block.exposed or any(block.alloc_position < pos for pos in self.coll_issues)
            if not used and exposed:
                entry = self.transients[(block.site, block.captured_pool is not None)]
                entry[0] += 1
                entry[1] += block.hi - block.lo
        self.position += 1

    def _ev_free_done(self, line, ev):
        for clock in self.pending_free.pop(ev["id"]):
            self._learn(clock)

    def _ev_record_stream(self, line, ev):
        block = self.blocks[ev["id"]]
        if ev["stream"] != block.stream:
            block.record_streams.add(ev["stream"])

    def _ev_launch(self, line, ev):
        if self.capturing is not None:
            self.graphs[self.capturing].append(CapturedOp(line, ev))
            return
        op = self._enqueue(line, ev["stream"], _bufs_of(ev), is_coll=False)
        if self.tclock is not None and self.cur != 0 and self.lanes[self.cur] == op.stream:
            # a thread's own CPU work ran before it went on (thread 0's "cpu": capture's lazy sync)
            self._learn({op.stream: op.epoch})

    def _ev_coll(self, line, ev):
        self._note_offsets(line, ev)
        if self.capturing is not None:
            self.graphs[self.capturing].append(CapturedOp(line, ev))
            self.position += 1
            self._note_coll_use(_bufs_of(ev))
            return
        op = self._enqueue(line, ev["stream"], _bufs_of(ev), is_coll=True, comm=ev["comm"], seq=ev["seq"])
        self.coll_clock[ev["cid"]] = op.clock
        self.coll_op[ev["cid"]] = op

    def _note_offsets(self, line, ev):
        offsets = []
        for b in ev["bufs"]:
            window = self._window_of(ev["comm"], b["addr"], b["addr"] + b["size"])
            if window is not None:
                offsets.append((window[1], b["addr"] - window[0], b["size"]))
        self.coll_offsets[(ev["comm"], ev["seq"])] = (line, offsets)

    def _ev_coll_done(self, line, ev):
        if ev.get("observed"):
            op = self.coll_op.get(ev["cid"])
            if op is not None and not (self.strict and any(b.in_own_window for b in op.bufs)):
                op.observed = True
            return
        self._learn(self.coll_clock[ev["cid"]])

    def _ev_record(self, line, ev):
        if self.capturing is not None:
            self.graphs[self.capturing].append(CapturedOrdering(False, ev["event"], ev["stream"]))
            return
        self.event_clock[ev["event"]] = _join(self.stream_clock[ev["stream"]], self.host)

    def _ev_wait(self, line, ev):
        if self.capturing is not None:
            self.graphs[self.capturing].append(CapturedOrdering(True, ev["event"], ev["stream"]))
            return
        s = ev["stream"]
        self.stream_clock[s] = _join(self.stream_clock[s], self.event_clock.get(ev["event"], {}))

    def _ev_sync(self, line, ev):
        # with host threads: no synchronize waits for another thread's CPU work (its lane)
        others = set() if self.tclock is None else {lane for t, lane in self.lanes.items() if t != self.cur}
        if ev.get("stream") is not None:
            if ev["stream"] not in others:
                self._learn(self.stream_clock[ev["stream"]])
        elif ev.get("event") is not None:
            self._learn(self.event_clock[ev["event"]])
        else:
            for stream, clock in list(self.stream_clock.items()):
                if stream not in others:
                    self._learn(clock)

    def _ev_graph_begin(self, line, ev):
        self.capturing = ev["graph"]
        self.graphs[ev["graph"]] = []
        self.graph_pool[ev["graph"]] = ev.get("pool") or f"graph:{ev['graph']}"
        self.graph_stream[ev["graph"]] = ev["stream"]

    def _ev_graph_end(self, line, ev):
        self.capturing = None
        self.live_graphs.add(ev["graph"])

    def _ev_graph_replay(self, line, ev):
        # A replay is one launch on its stream; inside, each captured stream other than the
        # capture stream is a lane of its own (per replay stream), forked from the replay stream
        # at the start, ordered by the captured record/wait only, joined back at the end.
        graph, replay_stream = ev["graph"], ev["stream"]
        origin = self.graph_stream[graph]
        items = self.graphs[graph]
        lane = {origin: replay_stream}
        for item in items:
            s = item.raw["stream"] if isinstance(item, CapturedOp) else item.stream
            if s not in lane:
                lane[s] = f"{s}@replay-on:{replay_stream}"
                self.stream_clock[lane[s]] = _join(self.stream_clock[lane[s]],
                                                   _join(self.stream_clock[replay_stream], self.host))
        for item in items:
            if isinstance(item, CapturedOrdering):
                key = (graph, item.event)
                if item.is_wait:
                    s = lane[item.stream]
                    self.stream_clock[s] = _join(self.stream_clock[s], self.event_clock.get(key, {}))
                else:
                    self.event_clock[key] = _join(self.stream_clock[lane[item.stream]], self.host)
                continue
            raw = item.raw
            is_coll = raw["ev"] == "coll"
            self._enqueue(line, lane[raw["stream"]], _bufs_of(raw), is_coll=is_coll,
                          comm=raw.get("comm"), seq=raw.get("seq"), captured=(graph, item.line))
        for s in lane.values():
            if s != replay_stream:
                self.stream_clock[replay_stream] = _join(self.stream_clock[replay_stream], self.stream_clock[s])

    def _ev_graph_free(self, line, ev):
        self.live_graphs.discard(ev["graph"])

    def _ev_window(self, line, ev):
        lo, hi = ev["addr"], ev["addr"] + ev["size"]
        self.windows.append((ev["comm"], lo, hi, self.registrations[ev["comm"]]))
        self.registrations[ev["comm"]] += 1
        for block in self.blocks.values():
            if _intersection(block.lo, block.hi, lo, hi):
                block.in_window = True

    def _ev_window_free(self, line, ev):
        self.windows = [w for w in self.windows if not (w[0] == ev["comm"] and w[1] == ev["addr"])]

    # ---- host threads ----
    def _learn(self, clock: dict) -> None:
        """The current thread learns `clock` (and so does the union)."""
        self.host = _join(self.host, clock)
        if self.tclock is not None:
            self.tclock[self.cur] = self.host
            self.union = _join(self.union, clock)

    def _threads(self) -> None:
        """A second thread shows up: thread 0's clock is the host's so far."""
        if self.tclock is None:
            self.tclock = {0: self.host}
            self.lanes = {0: "cpu"}
            self.live_threads = {0}
            self.union = dict(self.host)

    def _lane_count(self, thread) -> int:
        lane = self.lanes[thread]
        return self.stream_clock[lane].get(lane, 0) if lane in self.stream_clock else 0

    def _published(self, thread) -> dict:
        """What `thread` hands on (a start, a release, its end): its clock and its CPU work."""
        out = dict(self.tclock[thread])
        lane = self.lanes[thread]
        if self._lane_count(thread) > out.get(lane, 0):
            out[lane] = self._lane_count(thread)
        return out

    def _new_thread(self, thread, clock, lane) -> None:
        self.tclock[thread] = clock
        self.lanes[thread] = lane if lane is not None else ("cpu" if thread == 0 else f"cpu@{thread}")
        self.live_threads.add(thread)
        self.ended.pop(thread, None)
        self.union = _join(self.union, clock)

    def _ev_thread(self, line, ev):
        k = ev["thread"]
        if self.tclock is None and k == 0:
            return
        self._threads()
        if k == self.cur:
            return
        if k not in self.tclock or k in self.ended:
            # not seen starting: knows what all threads know, their CPU work included
            clock = dict(self.union)
            for t in self.live_threads:
                lane = self.lanes[t]
                if self._lane_count(t) > clock.get(lane, 0):
                    clock[lane] = self._lane_count(t)
            self._new_thread(k, clock, ev.get("lane"))
        self.cur = k
        self.host = self.tclock[k]

    def _ev_thread_start(self, line, ev):
        self._threads()
        self._new_thread(ev["thread"], self._published(self.cur), ev.get("lane"))

    def _ev_thread_end(self, line, ev):
        k = ev["thread"]
        if self.tclock is None or k not in self.tclock:
            return
        self.ended[k] = self._published(k)
        self.live_threads.discard(k)

    def _ev_thread_join(self, line, ev):
        k = ev["thread"]
        if self.tclock is None or k not in self.tclock:
            return
        self._learn(self.ended[k] if k in self.ended else self._published(k))

    def _ev_release(self, line, ev):
        if self.tclock is None:
            return
        self.syncs[ev["sync"]] = _join(self.syncs.get(ev["sync"], {}), self._published(self.cur))

    def _ev_acquire(self, line, ev):
        if self.tclock is None:
            return
        self._learn(self.syncs.get(ev["sync"], {}))

    def finish(self) -> list[RefFinding]:
        for (site, _), (count, nbytes) in self.transients.items():
            self._emit("transient-in-window", site=site, count=count, bytes=nbytes)
        return self.findings


def _bufs_of(ev: dict) -> list[Buf]:
    if ev["ev"] == "coll":
        return [Buf(b["addr"], b["addr"] + b["size"], ACCESS[b["access"]]) for b in ev["bufs"]]
    return ([Buf(a, a + s, READ) for a, s in ev.get("reads") or []]
            + [Buf(a, a + s, WRITE) for a, s in ev.get("writes") or []])


def reference_findings(ranks: list[list[dict]], *, peer_completion: str = "local",
                       semantics: Semantics = DESIGN_SEMANTICS) -> list[RefFinding]:
    """All findings for rank files whose events (header excluded) are `ranks[r]`; rank r is r."""
    strict = peer_completion == "successor"
    findings: list[RefFinding] = []
    offsets_by_rank = []
    for rank, events in enumerate(ranks):
        model = RankReference(rank, strict=strict, semantics=semantics)
        for index, ev in enumerate(events):
            model.feed(index + 2, ev)  # the header is line 1
        findings.extend(model.finish())
        offsets_by_rank.append(model.coll_offsets)
    if len(ranks) >= 2:
        keys = set().union(*offsets_by_rank)
        for key in keys:
            holders = [r for r in range(len(ranks)) if key in offsets_by_rank[r]]
            base = offsets_by_rank[holders[0]][key][1]
            for r in holders[1:]:
                line, offsets = offsets_by_rank[r][key]
                if offsets != base:
                    findings.append(RefFinding("asymmetric-offset", rank=r, line=line))
    return findings
