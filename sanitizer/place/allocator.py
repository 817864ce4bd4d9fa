"""A placement model of PyTorch's CUDA caching allocator (DeviceCachingAllocator).

Read from c10/cuda/CUDACachingAllocator.cpp, two versions compared line by line:
  - pytorch/pytorch at 001074d25084fdb87a799823e395a50f5ec044d3 (the 2.4 era: settings in
    CUDAAllocatorConfig, the oversize rounding limit hard-wired to kLargeBuffer, MemPool without
    allocator or no_split, captures_underway searched first to last);
  - a late-2025 main (2.10 era; found by content, commit not recorded by the search index: CUDA 13
    capture APIs, graph_capture_record_stream_reuse, AcceleratorAllocatorConfig with
    max_non_split_rounding_size and large_segment_size, PrivatePool with a pluggable allocator
    (allocPrimitive -> allocator()->raw_alloc), no_split_pools, captures_underway searched LIFO);
  - c10/core/AllocatorConfig.cpp at 065861fba7598880aa3216822742a1172d0a197c for the parser.
The placement rules below are identical in both except where a comment names a version; 2.4 to
2.14 is covered by their union (a setting an older version lacks is simply never set there: e.g.
max_non_split_rounding_mb defaults to the 20 MiB that 2.4 hard-wires).

The algorithm, in the allocator's own order (malloc):
  0. process_events: the events recorded at the free of record_stream'd blocks are queried, and
     the blocks whose events have all completed go back to their pools (free_block) before the
     search. Here a held block goes back when `stream_done` (a constructor argument) says each of
     its record_stream streams has finished its work, e.g. an idle side stream: the real allocator
     then reuses the block at once, with no synchronize in the program. Without `stream_done`
     held blocks wait for free_done / process_events (a trace says when: its `free_done`).
  1. size = round_size(request)                       512-byte granularity, optional power-2 divisions
  2. pool = small blocks of P if size <= 1 MiB else large blocks of P   (P: default or a private pool)
  3. get_free_block: the smallest free block of the *same stream* with size >= request, ties by
     address (std::set ordered by (stream, size, ptr), lower_bound). Oversize rules (max_split_size):
     a request below max_split_size never takes a block >= max_split_size; a request at or above it
     takes a block only if block.size < request + max_non_split_rounding_size (default 20 MiB).
  4. none found -> new segment of get_allocation_size(size): 2 MiB (small), large_segment_size
     (20 MiB) below 10 MiB, else size rounded up to 2 MiB; from cudaMalloc or the pool's allocator.
  5. should_split: never in a no_split pool; small pool: remaining >= 512; large pool:
     size < max_split_size and remaining > 1 MiB (strictly). The caller gets the low end.
free: a block with record_stream streams other than its own is held outside the pool (events
pending) until those streams finish (free_done); otherwise free_block merges it with free
neighbours of the same segment and returns it to its pool. A held block also blocks merges.

Not modelled (the config parser refuses what would change placement): expandable segments,
cudaMallocAsync, out-of-memory retries (release_cached_blocks), garbage collection, use_on_oom
fallback pools, graph-capture free-marker reuse. The fake driver never runs out of memory; an Arena
can, and then OutOfMemory is raised.
"""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from .config import (
    AllocatorConfig,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
)
from .segments import DEFAULT_DEVICE_BASE, DeviceDriver, Segment, SegmentSource

DEFAULT_POOL = "default"


class PlacementError(RuntimeError):
    """A request the allocator would reject (double free, unknown pool, ...)."""


# ---------------------------------------------------------------- sizes -------------------
def roundup_power2_next_division(size: int, divisions: int) -> int:
    """CUDACachingAllocator.cpp roundup_power2_next_division."""
    if size & (size - 1) == 0:
        return size
    power2_floor = 1 << (size.bit_length() - 1)
    power2_division = power2_floor >> (divisions.bit_length() - 1)
    if power2_division == 0:
        return power2_floor << 1
    floor = size & ~(power2_division - 1)
    return size if floor == size else floor + power2_division


def round_size(size: int, config: AllocatorConfig) -> int:
    """DeviceCachingAllocator::round_size."""
    if size < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    divisions = config.divisions_for(size)
    if divisions > 1 and size > K_MIN_BLOCK_SIZE * divisions:
        return roundup_power2_next_division(size, divisions)
    return K_MIN_BLOCK_SIZE * ((size + K_MIN_BLOCK_SIZE - 1) // K_MIN_BLOCK_SIZE)


def allocation_size(size: int, config: AllocatorConfig) -> int:
    """DeviceCachingAllocator::get_allocation_size: the segment size for a new segment."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return config.large_segment_size
    return K_ROUND_LARGE * ((size + K_ROUND_LARGE - 1) // K_ROUND_LARGE)


# ---------------------------------------------------------------- blocks ------------------
_block_serial = itertools.count()


class AllocatorBlock:
    """A piece of a segment in the caching-allocator model (c10's Block): handed out (allocated),
    cached (free), or held (events pending). The engine's live allocation is
    sanitizer.rules.records.LiveBlock, capture's sanitizer.capture.block_table.StorageBlock."""

    __slots__ = ("addr", "size", "requested", "stream", "pool", "segment", "allocated",
                 "prev", "next", "stream_uses", "pending", "serial", "__weakref__")

    def __init__(self, addr: int, size: int, stream, pool: str, segment: Segment):
        self.addr = addr
        self.size = size
        self.requested = 0
        self.stream = stream
        self.pool = pool
        self.segment = segment
        self.allocated = False
        self.prev: AllocatorBlock | None = None
        self.next: AllocatorBlock | None = None
        self.stream_uses: set = set()
        self.pending = False          # freed, waiting for record_stream streams (event_count > 0)
        self.serial = next(_block_serial)

    @property
    def end(self) -> int:
        return self.addr + self.size

    @property
    def offset(self) -> int:
        """Offset of the block within its segment: what must match a GPU."""
        return self.addr - self.segment.addr

    @property
    def window_offset(self) -> int | None:
        """Offset within the window/arena its segment was carved from, if any."""
        return self.segment.source.window_offset(self.addr)

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    @property
    def is_free(self) -> bool:
        return not self.allocated and not self.pending

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("held" if self.pending else "free")
        return (f"AllocatorBlock({self.addr:#x}, size={self.size}, requested={self.requested}, "
                f"stream={self.stream!r}, pool={self.pool!r}, offset={self.offset}, {state})")


class BlockPool:
    """Free blocks of one size class of one pool, ordered per stream by (size, addr).

    Keeping one sorted list per stream is the (stream, size, ptr) std::set of the .cpp: a lookup
    never sees another stream's blocks, which is the no-cross-stream-reuse rule.
    """

    def __init__(self, is_small: bool):
        self.is_small = is_small
        self.by_stream: dict[object, list[tuple[int, int, AllocatorBlock]]] = {}

    def insert(self, block: AllocatorBlock) -> None:
        bisect.insort(self.by_stream.setdefault(block.stream, []), (block.size, block.addr, block),
                      key=lambda e: (e[0], e[1]))

    def remove(self, block: AllocatorBlock) -> None:
        lst = self.by_stream[block.stream]
        k = bisect.bisect_left(lst, (block.size, block.addr), key=lambda e: (e[0], e[1]))
        assert lst[k][2] is block, "free-block index out of sync"
        del lst[k]

    def lower_bound(self, stream, size: int) -> AllocatorBlock | None:
        lst = self.by_stream.get(stream)
        if not lst:
            return None
        k = bisect.bisect_left(lst, (size, -1), key=lambda e: (e[0], e[1]))
        return lst[k][2] if k < len(lst) else None

    def blocks(self):
        for lst in self.by_stream.values():
            for _, _, b in lst:
                yield b


@dataclass(eq=False)
class Pool:
    """The default pool or a private pool (MemPool, CUDA graph pool): its own small and large pools."""

    name: str
    source: SegmentSource
    no_split: bool = False
    kind: str = "default"       # default | mempool | graph | symmetric
    small: BlockPool = field(default_factory=lambda: BlockPool(True))
    large: BlockPool = field(default_factory=lambda: BlockPool(False))
    segments: list = field(default_factory=list)

    def block_pool(self, rounded: int) -> BlockPool:
        return self.small if rounded <= K_SMALL_SIZE else self.large


# ---------------------------------------------------------------- the allocator -----------
class CachingAllocator:
    """One device's caching allocator. Requests in, blocks with addresses out.

    >>> a = CachingAllocator()
    >>> b = a.malloc(1000, stream=0)
    >>> (b.size, b.offset, b.segment.size)
    (1024, 0, 2097152)
    """

    def __init__(self, config: AllocatorConfig | None = None, *, driver: SegmentSource | None = None,
                 on_segment=None, stream_done=None):
        self.config = config or AllocatorConfig()
        self.stream_done = stream_done       # (stream) -> bool: its queued work is finished
        self.driver = driver or DeviceDriver(DEFAULT_DEVICE_BASE)
        self.pools: dict[str, Pool] = {DEFAULT_POOL: Pool(DEFAULT_POOL, self.driver)}
        self.live: set[AllocatorBlock] = set()        # allocated blocks
        self.held: set[AllocatorBlock] = set()        # freed, record_stream events pending
        self.on_segment = on_segment         # callback(segment) for every new segment

    # ---- pools ------------------------------------------------------------------------
    def create_pool(self, name: str, *, no_split: bool = False,
                    segment_source: SegmentSource | None = None, kind: str = "mempool") -> Pool:
        """A private pool. segment_source: where its segments come from (default: cudaMalloc).

        - torch.cuda.MemPool() / a CUDA graph pool: create_pool(name) (kind="graph" for the latter)
        - SGLang's NCCL symmetric pool (MemPool(CUDAPluggableAllocator(ncclMemAlloc))):
          create_pool(name, segment_source=DeviceDriver(base, name="ncclMemAlloc")) or an Arena
        - torch symmetric memory (get_mem_pool: MemPool(..., no_split=True)): no_split=True
        """
        if name in self.pools:
            raise PlacementError(f"pool {name!r} exists already")
        pool = Pool(name, segment_source or self.driver, no_split=no_split, kind=kind)
        self.pools[name] = pool
        return pool

    def pool(self, name: str | None) -> Pool:
        try:
            return self.pools[name or DEFAULT_POOL]
        except KeyError:
            raise PlacementError(f"unknown pool {name!r}; create it with create_pool()") from None

    # ---- malloc -----------------------------------------------------------------------
    def malloc(self, size: int, stream=0, pool: str | None = None) -> AllocatorBlock:
        if size < 0:
            raise PlacementError(f"negative allocation size {size}")
        p = self.pool(pool)
        if self.held and self.stream_done is not None:
            # DeviceCachingAllocator::malloc runs process_events() first (outside graph capture)
            done = self.stream_done
            self.process_events([s for b in self.held for s in b.stream_uses if done(s)])
        rounded = round_size(size, self.config)
        bp = p.block_pool(rounded)
        block = self._get_free_block(bp, stream, rounded)
        if block is None:
            block = self._alloc_segment(p, bp, stream, rounded)
        if self._should_split(p, bp, block, rounded):
            block = self._split(bp, block, rounded, stream)
        block.allocated = True
        block.requested = size
        self.live.add(block)
        return block

    def _get_free_block(self, bp: BlockPool, stream, size: int) -> AllocatorBlock | None:
        block = bp.lower_bound(stream, size)
        if block is None:
            return None
        cfg = self.config
        # "Do not return an oversized block for a large request"
        if size < cfg.max_split_size and block.size >= cfg.max_split_size:
            return None
        # "Allow oversized block size to be rounded up but within a limit"
        # (2.4: the limit is kLargeBuffer = 20 MiB; later max_non_split_rounding_mb, default 20 MiB)
        if size >= cfg.max_split_size and block.size >= size + cfg.max_non_split_rounding_size:
            return None
        bp.remove(block)
        return block

    def _alloc_segment(self, p: Pool, bp: BlockPool, stream, size: int) -> AllocatorBlock:
        seg_size = allocation_size(size, self.config)
        addr = p.source.allocate(seg_size)
        seg = Segment(addr, seg_size, p.name, p.source, bp.is_small, stream)
        p.segments.append(seg)
        if self.on_segment is not None:
            self.on_segment(seg)
        return AllocatorBlock(addr, seg_size, stream, p.name, seg)

    def _should_split(self, p: Pool, bp: BlockPool, block: AllocatorBlock, size: int) -> bool:
        if p.no_split:
            return False
        remaining = block.size - size
        if bp.is_small:
            return remaining >= K_MIN_BLOCK_SIZE
        return size < self.config.max_split_size and remaining > K_SMALL_SIZE

    @staticmethod
    def _split(bp: BlockPool, block: AllocatorBlock, size: int, stream) -> AllocatorBlock:
        """alloc_found_block with split_remainder: the caller gets the low `size` bytes."""
        front = AllocatorBlock(block.addr, size, stream, block.pool, block.segment)
        front.prev = block.prev
        if front.prev is not None:
            front.prev.next = front
        front.next = block
        block.prev = front
        block.addr += size
        block.size -= size
        bp.insert(block)
        return front

    # ---- free -------------------------------------------------------------------------
    def record_stream(self, block: AllocatorBlock, stream) -> None:
        if not block.allocated:
            raise PlacementError(f"record_stream on a block that is not allocated: {block!r}")
        if stream != block.stream:   # uses on the allocation stream need no event
            block.stream_uses.add(stream)

    def free(self, block: AllocatorBlock) -> bool:
        """Release a block. Returns True when it went back to the pool now, False when it is held
        until free_done (record_stream streams other than its own)."""
        if not block.allocated:
            raise PlacementError(f"free of a block that is not allocated: {block!r}")
        block.allocated = False
        self.live.discard(block)
        if block.stream_uses:
            block.pending = True
            self.held.add(block)
            return False
        self._free_block(block)
        return True

    def free_done(self, block: AllocatorBlock) -> None:
        """The record_stream streams of a held block finished (process_events saw its events)."""
        if not block.pending:
            raise PlacementError(f"free_done for a block that is not waiting for streams: {block!r}")
        block.pending = False
        block.stream_uses.clear()
        self.held.discard(block)
        self._free_block(block)

    def process_events(self, finished_streams=None) -> list[AllocatorBlock]:
        """Release held blocks whose recorded streams have all finished.

        finished_streams=None means every stream finished (synchronize_and_free_events)."""
        done = [b for b in self.held
                if finished_streams is None or b.stream_uses <= set(finished_streams)]
        for b in sorted(done, key=lambda b: b.serial):
            self.free_done(b)
        return done

    def _free_block(self, block: AllocatorBlock) -> None:
        bp = self._block_pool_of(block)
        for other in (block.prev, block.next):
            if other is None or not other.is_free:
                continue
            bp.remove(other)
            if other is block.prev:       # [other block]
                block.addr = other.addr
                block.prev = other.prev
                if block.prev is not None:
                    block.prev.next = block
            else:                          # [block other]
                block.next = other.next
                if block.next is not None:
                    block.next.prev = block
            block.size += other.size
        bp.insert(block)

    def _block_pool_of(self, block: AllocatorBlock) -> BlockPool:
        p = self.pools[block.pool]
        return p.small if block.segment.is_small else p.large

    # ---- cache release ---------------------------------------------------------------------
    def empty_cache(self, pool: str | None = None) -> list[Segment]:
        """Return every fully free segment of a pool (all pools when None) to its source."""
        released = []
        names = [pool] if pool else list(self.pools)
        for name in names:
            p = self.pool(name)
            for bp in (p.small, p.large):
                for b in [b for b in bp.blocks() if not b.is_split()]:
                    bp.remove(b)
                    b.segment.released = True
                    p.source.release(b.segment.addr, b.segment.size)
                    p.segments.remove(b.segment)
                    released.append(b.segment)
        return released

    # ---- inspection -------------------------------------------------------------------------
    def segment_blocks(self, segment: Segment) -> list[AllocatorBlock]:
        """The blocks of a segment, in address order (allocated, held and free)."""
        owner = [b for b in self.live | self.held if b.segment is segment]
        p = self.pools[segment.pool]
        owner += [b for b in (p.small if segment.is_small else p.large).blocks() if b.segment is segment]
        if not owner:
            return []
        head = owner[0]
        while head.prev is not None:
            head = head.prev
        out = []
        while head is not None:
            out.append(head)
            head = head.next
        return out

    def find(self, addr: int) -> AllocatorBlock | None:
        """The live or held block containing addr."""
        for b in self.live:
            if b.addr <= addr < b.end:
                return b
        for b in self.held:
            if b.addr <= addr < b.end:
                return b
        return None

    def snapshot(self) -> list[dict]:
        """Segments and their blocks, like torch.cuda.memory._snapshot()['segments'] (subset)."""
        out = []
        for p in self.pools.values():
            for seg in p.segments:
                blocks = self.segment_blocks(seg)
                out.append({
                    "address": seg.addr, "total_size": seg.size, "pool": p.name,
                    "segment_type": "small" if seg.is_small else "large", "stream": seg.stream,
                    "blocks": [{"address": b.addr, "size": b.size, "requested_size": b.requested,
                                "state": "active_allocated" if b.allocated else (
                                    "active_pending_free" if b.pending else "inactive")}
                               for b in blocks],
                })
        out.sort(key=lambda s: s["address"])
        return out
