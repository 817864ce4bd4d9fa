"""The CPU model of symmetric-memory windows.

On a GPU, allocations inside a symmetric scope come from the communicator's window pool
(SGLang: a MemPool over ncclMemAlloc, registered with ncclCommWindowRegister) and a block's offset
in the window is what peers use. On CPU, torch's allocator puts the data anywhere, so offsets would
mean nothing. Capture therefore *models* the placement: each (pool, comm) pair gets an arena
[base, base + HAZSAN_WINDOW_BYTES) in a synthetic address range that no CPU pointer can have
(from 2**62 up), registered once as a `window` of `comm`, and every CPU storage allocated inside a
scope is placed there by sanitizer.place's CachingAllocator (same rounding, splitting, caching and
stream rules as the CUDA caching allocator). The alloc event carries the modelled address and
block size (with `requested` = the bytes asked for); collective buffers inside such a storage are
translated to the same modelled range (block_table.BlockTable.buffer), and the model block is freed when
the storage dies. The tensor's real data stays where torch put it; only the trace is modelled.
"""
from __future__ import annotations

import time

from sanitizer.place import Arena, CachingAllocator

WINDOW_BASE = 1 << 62          # above every user-space address on Linux x86-64/aarch64
WINDOW_STRIDE = 1 << 40        # room between the arenas of different (pool, comm) pairs


class SymmetricArenas:
    def __init__(self, capture):
        self.capture = capture
        self.window_bytes = capture.settings.window_bytes
        self.alloc = CachingAllocator(on_segment=self._segment)
        self.pools: dict[tuple[str, str], str] = {}
        self.arenas: dict[str, Arena] = {}

    def pool_name(self, pool: str, comm: str) -> str:
        name = self.pools.get((pool, comm))
        if name is None:
            taken = any(p == pool for p, _ in self.pools)
            name = f"{pool}@{comm}" if taken else pool
            base = WINDOW_BASE + len(self.pools) * WINDOW_STRIDE
            arena = Arena(base=base, capacity=self.window_bytes, name=f"{pool}:{comm}", comm=comm)
            self.alloc.create_pool(name, segment_source=arena, kind="symmetric")
            self.pools[(pool, comm)] = name
            self.arenas[name] = arena
            self.capture.emit({"ev": "window", "addr": base, "size": self.window_bytes, "comm": comm,
                               "t": time.time_ns()})
        return name

    def malloc(self, pool: str, comm: str, nbytes: int, stream):
        return self.alloc.malloc(nbytes, stream=stream, pool=self.pool_name(pool, comm))

    def free(self, block) -> None:
        self.alloc.free(block)

    def _segment(self, seg) -> None:
        self.capture.emit({"ev": "segment", "addr": seg.addr, "size": seg.size, "pool": seg.pool,
                           "t": time.time_ns()})
