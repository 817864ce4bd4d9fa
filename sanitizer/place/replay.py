"""Trace transform: replay a rank's allocation requests through the model, rewrite addresses.

Input: schema-1 events whose addresses mean nothing on a GPU (captured on CPU), read through
sanitizer.trace.reader.TypedEvents, the reader and schema (sanitizer.trace.events) of `hazsan
check`: a line check refuses, place refuses with the same message naming file and line, and every
field reaches the placer typed and in range. Output: the same events (unknown kinds and fields
dropped with a warning, as check ignores them) with every alloc, window and buffer address
replaced by where the model places it, plus a `segment` event before the first allocation that
lands in each new segment.

Rules (also in `hazsan place --help`):
- Pool of an alloc: the innermost open `scope` that names a `pool`; else the alloc's own `pool`
  when it is not the default; else the graph pool while a `graph_begin` capture is open
  (graph_begin's `pool`, or "graph:<id>"); else the default pool. Streams stay as recorded.
- A pool bound to a communicator (its scope has `comm`) is fed by a pluggable allocator
  (ncclMemAlloc): its segments come from a second address space and every new one is registered
  as a window of the communicator at once (a `window` event after its `segment`), as SGLang's
  allocator does. Input windows that register such segments are replaced by these. An input
  segment that is registered before any allocation landed in it is SGLang's preallocation
  (SGLANG_SYMM_MEM_PREALLOC_GB_SIZE): the model allocates and drops a block of that size in the
  pool, so the pool caches a segment that size, registered likewise.
- A `window` declared before anything was placed in it is an arena (the CPU symmetric-memory
  testbed): the communicator's pools carve their segments from it, window offset = addr - base.
  A `window` over other existing blocks becomes the hull of the model segments holding them.
- A scope with `no_split: true` (or --no-split POOL) makes a no_split pool, as torch symmetric
  memory's MemPool(no_split=True).
- A buffer address maps through the input block that contains it (same offset within the block),
  also after that block was freed (a stale pointer stays stale); else through an arena window;
  memory the allocator never handed out (weights made before tracing, ...) moves to a separate
  range (FOREIGN_BASE + addr) so that it can never overlap a modelled block.
- Input `segment`/`segment_free` events are dropped: the model's segments replace them.
- free of a block with record_stream streams holds it until its `free_done`.
"""
from __future__ import annotations

import bisect
import gzip
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import orjson

from sanitizer.rules.intervals import RangeIndex
from sanitizer.trace.events import ADDR_LIMIT

from .allocator import DEFAULT_POOL, AllocatorBlock, CachingAllocator, PlacementError
from .config import AllocatorConfig
from .records import RecordDicts, records
from .segments import DEFAULT_PLUGGABLE_BASE, Arena, DeviceDriver, OutOfMemory, SegmentSource

WINDOW_BASE = 0x7D0000000000      # where arena windows are put
FOREIGN_BASE = 1 << 48            # memory the allocator never handed out
_DEFAULT_NAMES = (None, "", DEFAULT_POOL, 0, "0", "native")


class PlaceError(Exception):
    """A trace the schema accepts that cannot be placed (a free of an unknown id, a block the
    model cannot fit, an address placed past the format's limit); names file and line."""

    def __init__(self, path, line, message):
        self.path, self.line, self.message = str(path), line, message
        super().__init__(f"{path}:{line}: {message}" if line else f"{path}: {message}")


@dataclass
class PlaceStats:
    events: int = 0
    allocs: int = 0
    segments: int = 0
    dropped_segment_events: int = 0
    foreign_buffers: int = 0
    windows_arena: int = 0
    windows_registered: int = 0
    preallocated: int = 0
    segments_released: int = 0
    windows_synthesized: int = 0
    windows_replaced: int = 0
    pools: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)


class _ArenaChain(SegmentSource):
    """Several windows of one communicator: a new segment goes in the first with room."""

    name = "windows"

    def __init__(self, arenas: list[Arena]):
        self.arenas = arenas

    def allocate(self, size: int) -> int:
        last = None
        for a in self.arenas:
            try:
                return a.allocate(size)
            except OutOfMemory as exc:
                last = exc
        raise last or OutOfMemory("no window")

    def release(self, addr: int, size: int) -> None:
        for a in self.arenas:
            if a.contains(addr):
                a.release(addr, size)
                return

    def window_offset(self, addr: int):
        for a in self.arenas:
            if a.contains(addr):
                return addr - a.base
        return None


class _InputRanges:
    """Input blocks by input address, non-overlapping, sorted: [start, end, model_addr, alive, block].

    The model address is kept as a number: once freed, the allocator may reuse the AllocatorBlock object.

    A freed block's entry stays (dead) until a new block overlaps it, so a stale pointer keeps
    mapping to where its block was placed."""

    def __init__(self):
        self.starts: list[int] = []
        self.entries: list[list] = []

    def add(self, start: int, end: int, block: AllocatorBlock) -> None:
        k = bisect.bisect_left(self.starts, start)
        j = k - 1 if k > 0 and self.entries[k - 1][1] > start else k
        m = k
        while m < len(self.starts) and self.starts[m] < end:
            m += 1
        del self.entries[j:m]
        del self.starts[j:m]
        self.starts.insert(j, start)
        self.entries.insert(j, [start, end, block.addr, True, block])

    def kill(self, start: int, block: AllocatorBlock) -> None:
        k = bisect.bisect_right(self.starts, start) - 1
        if k >= 0 and self.entries[k][4] is block:
            self.entries[k][3] = False

    def find(self, addr: int):
        k = bisect.bisect_right(self.starts, addr) - 1
        if k >= 0 and addr < self.entries[k][1]:
            return self.entries[k]
        return None

    def overlapping_live(self, start: int, end: int) -> list:
        k = max(0, bisect.bisect_right(self.starts, start) - 1)
        out = []
        while k < len(self.entries) and self.entries[k][0] < end:
            e = self.entries[k]
            if e[3] and e[1] > start:
                out.append(e)
            k += 1
        return out


class RankPlacer:
    """Places one rank's events. Feed (line_no, typed record) pairs (sanitizer.trace.events or
    the binary format's classes) in program order to `place`."""

    def __init__(self, config: AllocatorConfig, path="<trace>", *, no_split_pools=(),
                 device_base: int | None = None):
        self.path = path
        self.config = config
        self.no_split_pools = set(no_split_pools)
        self._new_segments: list = []
        self.alloc = CachingAllocator(config, on_segment=self._new_segments.append,
                                      **({"driver": DeviceDriver(device_base)} if device_base else {}))
        self.stats = PlaceStats()
        self.blocks: dict = {}                 # trace id -> model AllocatorBlock
        self.input_start: dict = {}            # trace id -> input address
        self.freed: set = set()                # ids freed (their AllocatorBlock may be reused by the model)
        self.held: dict = {}                   # id -> AllocatorBlock freed with record_stream, until free_done
        self.inputs = _InputRanges()
        self.scopes: list[dict] = []           # open scopes
        self.captures: dict = {}               # graph id -> pool name (open graph_begin)
        self.pool_comm: dict = {}              # pool -> comm (from scopes)
        self.pool_no_split: set = set(no_split_pools)
        self.arenas: dict = {}                 # comm -> [Arena]
        self.windows = _WindowMap()            # (input addr, comm) -> (model addr, size)
        self._window_cursor = WINDOW_BASE
        self._pluggable_cursor = DEFAULT_PLUGGABLE_BASE
        self.pending_segments: dict = {}       # input segment addr -> (size, pool, line), no alloc yet
        self.last_stream = 0                   # the stream of the latest alloc ("current stream")
        self._replaced_windows: set = set()    # input windows the model's own registrations replace
        self._releasing = False                # inside a run of input segment_free events
        self._empty_windows: dict = {}         # (input addr, comm) -> model addr of a size-0 window
        self._as_dict = RecordDicts()

    # ---- helpers ------------------------------------------------------------------------
    def _err(self, line, msg):
        return PlaceError(self.path, line, msg)

    def _placed(self, addr: int, line, what: str) -> int:
        """An address written out: the placed trace must be one `hazsan check` reads."""
        if not 0 <= addr < ADDR_LIMIT:
            raise self._err(line, f"{what} would be placed at {addr:#x}, past the trace format's address "
                                  f"limit {ADDR_LIMIT:#x}: the input address or size is out of any device's range")
        return addr

    def _pool_for(self, ev) -> str:
        for s in reversed(self.scopes):
            if s.get("pool") not in (None, ""):
                return str(s["pool"])
        p = ev.get("pool")
        if p not in _DEFAULT_NAMES:
            return str(p)
        if self.captures:
            return next(reversed(self.captures.values()))
        return DEFAULT_POOL

    def _ensure_pool(self, name: str) -> None:
        if name in self.alloc.pools:
            return
        comm = self.pool_comm.get(name)
        no_split = name in self.pool_no_split
        kind = "graph" if any(name == p for p in self.captures.values()) else "mempool"
        source = None
        if comm is not None:
            kind = "symmetric"
            if self.arenas.get(comm):
                source = _ArenaChain(self.arenas[comm])
            else:
                source = DeviceDriver(self._pluggable_cursor, name=f"ncclMemAlloc[{comm}]")
                self._pluggable_cursor += 1 << 40
        self.alloc.create_pool(name, no_split=no_split, segment_source=source, kind=kind)
        self.stats.pools[name] = {"kind": kind, "no_split": no_split,
                                  "source": source.name if source else "cudaMalloc"}

    def map_addr(self, addr: int, line=None) -> int:
        e = self.inputs.find(addr)
        if e is not None:
            return e[2] + (addr - e[0])
        held = self.windows.holding(addr)
        if held is not None:
            waddr, model = held
            return self._placed(model + (addr - waddr), line, f"address {addr:#x}")
        self.stats.foreign_buffers += 1
        return self._placed(FOREIGN_BASE + addr, line, f"address {addr:#x} (outside every block)")

    # ---- the event loop ---------------------------------------------------------------------
    def place(self, line: int, record) -> Iterator[dict]:
        """Yield the output events (dicts) for one input record (0, 1 or several)."""
        ev = self._as_dict(record)
        self.stats.events += 1
        kind = ev["ev"]
        if kind != "segment_free":
            self._releasing = False
        handler = getattr(self, f"_ev_{kind}", None)
        if handler is None:
            yield ev
            return
        try:
            yield from handler(line, ev)
        except (TypeError, ValueError, OverflowError, KeyError) as exc:
            # The schema typed every field; this only keeps a case the placer missed from
            # becoming a traceback, and still names the line.
            raise self._err(line, f"cannot place this {kind!r} event: {type(exc).__name__}: {exc}") from None

    def _ev_segment(self, line, ev):
        # The model makes its own segments. One kind of input segment matters, though: a segment
        # no allocation lands in before it is registered as a window, i.e. SGLang's symmetric
        # pool preallocation (torch.empty(N GiB) in the pool, dropped at once). Remember it until
        # an allocation lands in it (then it was an ordinary segment) or a window claims it.
        self.stats.dropped_segment_events += 1
        addr, size = ev["addr"], ev["size"]
        if size > 0:
            self.pending_segments[addr] = (size, ev.get("pool"), line)
            if len(self.pending_segments) > 64:
                self.pending_segments.pop(next(iter(self.pending_segments)))
        return iter(())

    def _ev_segment_free(self, line, ev):
        # Segments go back to the driver only in release_cached_blocks (torch.cuda.empty_cache(),
        # or the out-of-memory retry): it first waits for every pending record_stream event, then
        # frees every unsplit cached segment of the default pool. The first segment_free of a run
        # replays that on the model; the model's own segment_free events replace the input's.
        self.stats.dropped_segment_events += 1
        if self.pending_segments.pop(ev["addr"], None) is not None or self._releasing:
            return
        self._releasing = True
        for bid, b in list(self.held.items()):
            self.alloc.free_done(b)
            del self.held[bid]
        extra = {k: ev[k] for k in ("t", "step") if k in ev}
        for seg in self.alloc.empty_cache(DEFAULT_POOL):
            self.stats.segments_released += 1
            yield {"ev": "segment_free", "addr": seg.addr, "pool": seg.pool, **extra}

    def _claim_pending(self, addr: int) -> None:
        for start, (size, _pool, _line) in list(self.pending_segments.items()):
            if start <= addr < start + size:
                del self.pending_segments[start]

    def _ev_scope(self, line, ev):
        if ev["enter"]:
            pool, comm = ev.get("pool"), ev.get("comm")
            self.scopes.append(ev)
            if pool not in (None, ""):
                if comm is not None:
                    self.pool_comm.setdefault(str(pool), comm)
                if ev.get("no_split"):
                    self.pool_no_split.add(str(pool))
        else:
            for k in range(len(self.scopes) - 1, -1, -1):
                if self.scopes[k].get("name") == ev.get("name"):
                    del self.scopes[k]
                    break
        yield ev

    def _ev_graph_begin(self, line, ev):
        g, pool = ev["graph"], ev.get("pool")
        self.captures[g] = str(pool) if pool not in (None, "") else f"graph:{g}"
        yield ev

    def _ev_graph_end(self, line, ev):
        self.captures.pop(ev["graph"], None)
        yield ev

    def _ev_alloc(self, line, ev):
        bid, addr, size, stream = ev["id"], ev["addr"], ev["size"], ev["stream"]
        if bid in self.blocks and bid not in self.freed:
            raise self._err(line, f"alloc of id {bid!r} which is still allocated")
        self.freed.discard(bid)
        # a trace that records both gives `size` = the block its allocator made and `requested` =
        # the bytes asked for: the request is what the model must place
        requested = ev.get("requested")
        has_request = requested is not None and 0 <= requested <= size
        request = requested if has_request else size
        pool = self._pool_for(ev)
        self._ensure_pool(pool)
        self.last_stream = stream
        if self.pending_segments:
            self._claim_pending(addr)
        try:
            block = self.alloc.malloc(request, stream, pool)
        except OutOfMemory as exc:
            raise self._err(line, f"cannot place alloc {bid!r} ({size} bytes) in pool {pool!r}: {exc}") from None
        self.stats.allocs += 1
        self.blocks[bid] = block
        self.input_start[bid] = addr
        self.inputs.add(addr, addr + max(size, 1), block)
        yield from self._flush_segments(ev)
        out = dict(ev)
        out["addr"] = self._placed(block.addr, line, f"alloc {bid!r}")
        if has_request:
            out["size"] = block.size       # the input's size was its allocator's block size
        out["pool"] = pool
        out["segment"] = block.segment.addr
        yield out

    def _flush_segments(self, ev):
        extra = {k: ev[k] for k in ("t", "step") if k in ev}
        for seg in self._new_segments:
            self.stats.segments += 1
            yield {"ev": "segment", "addr": seg.addr, "size": seg.size, "pool": seg.pool, **extra}
            comm = self.pool_comm.get(seg.pool)
            if comm is not None and not isinstance(seg.source, _ArenaChain):
                # SGLang's allocator registers every ncclMemAlloc segment as a window of the
                # group's communicator (ncclCommWindowRegister in nccl_alloc_plug; 0.5.2x does it
                # at scope exit): the window is the segment
                self.stats.windows_synthesized += 1
                yield {"ev": "window", "addr": seg.addr, "size": seg.size, "comm": comm, **extra}
        self._new_segments.clear()

    def _block(self, line, ev):
        bid = ev["id"]
        b = self.blocks.get(bid)
        if b is None:
            raise self._err(line, f"{ev.get('ev')} of unknown id {bid!r}")
        return b

    def _ev_free(self, line, ev):
        b = self._block(line, ev)
        if ev["id"] in self.freed:
            raise self._err(line, f"free of id {ev['id']!r}, which is already freed")
        self.freed.add(ev["id"])
        try:
            if not self.alloc.free(b):
                self.held[ev["id"]] = b
        except PlacementError as exc:
            raise self._err(line, str(exc)) from None
        self.inputs.kill(self.input_start[ev["id"]], b)
        yield ev

    def _ev_record_stream(self, line, ev):
        b = self._block(line, ev)
        if ev["id"] not in self.freed:
            self.alloc.record_stream(b, ev["stream"])
        yield ev

    def _ev_free_done(self, line, ev):
        self._block(line, ev)             # an unknown id is refused
        held = self.held.pop(ev["id"], None)
        if held is not None:
            self.alloc.free_done(held)
        yield ev

    def _ev_launch(self, line, ev):
        out = dict(ev)
        for key in ("reads", "writes"):
            if key in ev:
                out[key] = [[self.map_addr(a, line), n] for a, n in ev[key]]
        yield out

    def _ev_coll(self, line, ev):
        out = dict(ev)
        out["bufs"] = [{**b, "addr": self.map_addr(b["addr"], line)} for b in ev["bufs"]]
        yield out

    def _ev_window(self, line, ev):
        addr, size, comm = ev["addr"], ev["size"], ev["comm"]
        if size == 0:
            # an empty registration (the schema allows it, as check does): nothing can land in
            # it, its address moves as a pointer's would, and its window_free's with it
            moved = self._empty_windows[(addr, comm)] = self.map_addr(addr, line)
            yield {**ev, "addr": moved}
            return
        covered = self.inputs.overlapping_live(addr, addr + size)
        pre = self.pending_segments.pop(addr, None)
        if not covered and pre is not None:
            # registration of a preallocated segment: allocate and drop a block of its size in
            # its pool (what the preallocation did), so that the pool caches a segment that size
            psize, pname, _ = pre
            pname = str(pname) if pname not in _DEFAULT_NAMES else DEFAULT_POOL
            if pname not in self.alloc.pools and comm is not None:
                self.pool_comm.setdefault(pname, comm)
            self._ensure_pool(pname)
            try:
                blk = self.alloc.malloc(psize, self.last_stream, pname)
            except OutOfMemory as exc:
                raise self._err(line, f"cannot place the preallocated segment of pool {pname!r}: {exc}") from None
            seg = blk.segment
            self.alloc.free(blk)
            self.stats.preallocated += 1
            synthesized = self.stats.windows_synthesized
            yield from self._flush_segments(ev)
            if self.stats.windows_synthesized > synthesized:
                self._replaced_windows.add((addr, comm))   # the model registered it itself
                self.windows[(addr, comm)] = (seg.addr, size)
                return
            self.stats.windows_registered += 1
            self.windows[(addr, comm)] = (seg.addr, size)
            yield {**ev, "addr": seg.addr, "size": seg.size}
            return
        if covered:
            segs = {id(e[4].segment): e[4].segment for e in covered}.values()
            self.windows[(addr, comm)] = (min(s.addr for s in segs), size)
            if all(self.pool_comm.get(s.pool) == comm and not isinstance(s.source, _ArenaChain)
                   for s in segs):
                # registration of segments of a symmetric pool: the model registered its own
                # segments when it made them; this input window is replaced
                self._replaced_windows.add((addr, comm))
                self.stats.windows_replaced += 1
                return
            # registration of other memory: the hull of the model segments holding it
            lo = min(s.addr for s in segs)
            hi = max(s.end for s in segs)
            self.stats.windows_registered += 1
            yield {**ev, "addr": lo, "size": hi - lo}
            return
        base = self._placed((self._window_cursor + (2 << 20) - 1) & ~((2 << 20) - 1), line,
                            f"window {addr:#x}")
        self._window_cursor = base + size + (2 << 20)
        arena = Arena(base=base, capacity=size, name=f"window[{comm}]@{addr:#x}", comm=comm)
        self.arenas.setdefault(comm, []).append(arena)
        self.windows[(addr, comm)] = (base, size)
        self.stats.windows_arena += 1
        for pname, c in self.pool_comm.items():
            if c == comm and pname in self.alloc.pools:
                self.stats.notes.append(
                    f"{self.path}:{line}: window for comm {comm!r} declared after pool {pname!r} "
                    "already had segments; that pool keeps its ncclMemAlloc address space")
        yield {**ev, "addr": base}

    def _ev_window_free(self, line, ev):
        addr, comm = ev["addr"], ev["comm"]
        if (addr, comm) in self._replaced_windows:
            self._replaced_windows.discard((addr, comm))
            return
        model = self.windows.get((addr, comm))
        out = dict(ev)
        if (addr, comm) in self._empty_windows:
            out["addr"] = self._empty_windows.pop((addr, comm))
        else:
            out["addr"] = model[0] if model is not None else self.map_addr(addr, line)
        yield out


class _WindowMap:
    """Input windows: (input addr, comm) -> (model addr, size), registered ones never dropped, and
    which of them holds an address: the first registered, as a scan in registration order says,
    through an address index (O(log n + windows holding it), not O(windows) per address)."""

    def __init__(self):
        self.by_key: dict = {}  # key -> (registration order, value, index item)
        self.index = RangeIndex()
        self.order = 0

    def __setitem__(self, key, value) -> None:
        old = self.by_key.get(key)
        if old is None:
            order = self.order
            self.order += 1
        else:  # registered again: its place in the order stays, its range may change
            order = old[0]
            self.index.remove(key[0], key[0] + old[1][1], old[2])
        item = (order, key[0], value[0])
        self.index.add(key[0], key[0] + value[1], item)
        self.by_key[key] = (order, value, item)

    def get(self, key):
        entry = self.by_key.get(key)
        return None if entry is None else entry[1]

    def holding(self, addr: int):
        """(input addr, model addr) of the first registered window holding `addr`, or None."""
        best = None
        for _, _, item in self.index.overlapping(addr, addr + 1):
            if best is None or item[0] < best[0]:
                best = item
        return None if best is None else (best[1], best[2])


# ---------------------------------------------------------------- files ------------------
def _open_out(path: Path, gz: bool):
    if gz:
        return gzip.open(path, "wb", compresslevel=5)
    return open(path, "wb")


def place_file(in_path, out_path, config: AllocatorConfig, *, no_split_pools=(), limits=None) -> PlaceStats:
    """Place one rank file (either format, sanitizer.trace.reader), read within `limits`
    (sanitizer.limits.Limits; default: its defaults); write the result as JSON Lines (gzip if
    the name ends .gz). Raises the reader's TraceError for what `hazsan check` refuses, with its
    message, or PlaceError for what cannot be placed."""
    from sanitizer.trace.reader import TypedEvents, open_trace

    tf = open_trace(in_path, limits)
    source = TypedEvents(tf)
    placer = RankPlacer(config, in_path, no_split_pools=no_split_pools)
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + ".part")
    dumps = orjson.dumps
    try:
        with _open_out(tmp, out_path.name.endswith(".gz")) as fh:
            header = dict(tf.header)
            header.pop("end_record", None)  # written by place, not by a capture writer that ends it
            header["placed"] = {"by": "hazsan place", "allocator_conf": config.describe(),
                                "model": "c10/cuda/CUDACachingAllocator.cpp (PyTorch 2.4-2.14)"}
            fh.write(dumps(header) + b"\n")
            for line_no, record in records(source, in_path):
                for out in placer.place(line_no, record):
                    try:
                        fh.write(dumps(out) + b"\n")
                    except orjson.JSONEncodeError as exc:
                        raise PlaceError(in_path, line_no, f"placed event cannot be written: {exc}") from None
        os.replace(tmp, out_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        tf.close()
        source.forget()     # a binary version 2 file's record classes leave the registry
    placer.stats.notes.extend(tf.warnings)
    placer.stats.notes.extend(source.warnings(str(in_path)))
    return placer.stats


def place_events(header: dict, events: Iterable[tuple[int, dict]], config: AllocatorConfig,
                 path="<memory>", *, no_split_pools=()) -> tuple[list[dict], PlaceStats]:
    """In-memory variant over (line, event dict) pairs: each event is read by the schema's rules
    for a JSON Lines line (sanitizer.trace.events.EventDecoder: unknown kinds skipped, unknown
    fields dropped, anything else a TraceError naming `path` and the line). Returns the placed
    events (header not included) and the stats."""
    from sanitizer.trace.events import EventDecoder
    from sanitizer.trace.reader import TraceError

    decoder = EventDecoder()
    placer = RankPlacer(config, path, no_split_pools=no_split_pools)
    out: list[dict] = []
    for line_no, ev in events:
        record = decoder.object(dict(ev)) if type(ev) is dict else "an event must be a JSON object"
        if type(record) is str:
            raise TraceError(path, line_no, record)
        if record is not None:
            out.extend(placer.place(line_no, record))
    placer.stats.notes.extend(decoder.warnings(str(path)))
    return out, placer.stats
