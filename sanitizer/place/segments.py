"""Where segments come from: a fake cudaMalloc, or an arena such as a symmetric-memory window.

Real cudaMalloc addresses are not ordered and differ from run to run, so no model can predict
absolute addresses. What must match a GPU is the *offset of every block within its segment* (and,
for an arena, within the arena: the window offset). The fake driver hands out segments in increasing
address order, 2 MiB aligned, never reusing freed address space; with that, the allocator's tie-break
between equal-size free blocks (by raw address) prefers the older segment. On a GPU the tie-break
follows cudaMalloc's addresses instead; this is the one ordering the model cannot know.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .config import K_SMALL_BUFFER

DEFAULT_DEVICE_BASE = 0x7F0000000000   # looks like a CUDA VA; any base gives the same offsets
DEFAULT_PLUGGABLE_BASE = 0x7E0000000000  # a second address space (ncclMemAlloc, symmetric memory)


class OutOfMemory(RuntimeError):
    """A segment source cannot provide a segment (an arena is full)."""


@dataclass(eq=False)
class Segment:
    """[addr, addr+size) obtained from `source` for pool `pool`."""

    addr: int
    size: int
    pool: str
    source: "SegmentSource"
    is_small: bool
    stream: object = None
    released: bool = False

    @property
    def end(self) -> int:
        return self.addr + self.size

    def offset(self, addr: int) -> int:
        return addr - self.addr

    def __repr__(self) -> str:
        kind = "small" if self.is_small else "large"
        return f"Segment({self.addr:#x}, {self.size}, pool={self.pool!r}, {kind}, source={self.source.name})"


class SegmentSource:
    """Provides whole segments (cudaMalloc, a pluggable allocator's raw_alloc)."""

    name = "source"

    def allocate(self, size: int) -> int:  # pragma: no cover - interface
        raise NotImplementedError

    def release(self, addr: int, size: int) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def window_offset(self, addr: int) -> int | None:
        """Offset of addr in this source's window, or None when the source is not a window."""
        return None


class DeviceDriver(SegmentSource):
    """Deterministic stand-in for cudaMalloc (or ncclMemAlloc): a bump pointer, 2 MiB aligned."""

    def __init__(self, base: int = DEFAULT_DEVICE_BASE, *, alignment: int = K_SMALL_BUFFER,
                 gap: int = 0, name: str = "cudaMalloc"):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError("alignment must be a power of two")
        self.base = base
        self.alignment = alignment
        self.gap = gap
        self.name = name
        self._next = base
        self.live: dict[int, int] = {}

    def allocate(self, size: int) -> int:
        addr = (self._next + self.alignment - 1) & ~(self.alignment - 1)
        self._next = addr + size + self.gap
        self.live[addr] = size
        return addr

    def release(self, addr: int, size: int) -> None:
        # Freed VA is not handed out again: offsets, not absolute addresses, are what must match.
        self.live.pop(addr, None)

    def __repr__(self) -> str:
        return f"DeviceDriver({self.name}, base={self.base:#x})"


@dataclass(eq=False)
class Arena(SegmentSource):
    """A fixed range [base, base+capacity) that segments are carved from, lowest address first.

    Models a registered window that a pool's segments live in (SGLang's symmetric pool, the CPU
    shared-memory testbed): a block's window offset is ``block.addr - arena.base``.
    """

    base: int
    capacity: int
    name: str = "window"
    alignment: int = K_SMALL_BUFFER
    comm: object = None
    _free: list = field(default_factory=list, repr=False)   # sorted [(addr, size)]

    def __post_init__(self):
        if self.capacity <= 0:
            raise ValueError("arena capacity must be positive")
        self._free = [(self.base, self.capacity)]

    @property
    def end(self) -> int:
        return self.base + self.capacity

    def contains(self, addr: int) -> bool:
        return self.base <= addr < self.end

    def window_offset(self, addr: int) -> int | None:
        return addr - self.base if self.contains(addr) else None

    def free_bytes(self) -> int:
        return sum(s for _, s in self._free)

    def allocate(self, size: int) -> int:
        a = self.alignment
        for k, (start, length) in enumerate(self._free):
            addr = start + (-(start - self.base) % a)
            pad = addr - start
            if pad + size <= length:
                del self._free[k]
                if pad:
                    self._free.insert(k, (start, pad))
                    k += 1
                rest = length - pad - size
                if rest:
                    self._free.insert(k, (addr + size, rest))
                return addr
        raise OutOfMemory(
            f"window {self.name!r} at {self.base:#x} ({self.capacity} bytes) has no free range of "
            f"{size} bytes for a new segment ({self.free_bytes()} bytes free in pieces)")

    def release(self, addr: int, size: int) -> None:
        k = bisect.bisect_left(self._free, (addr, 0))
        self._free.insert(k, (addr, size))
        # merge with neighbours
        if k + 1 < len(self._free) and addr + size == self._free[k + 1][0]:
            self._free[k] = (addr, size + self._free[k + 1][1])
            del self._free[k + 1]
        if k > 0 and self._free[k - 1][0] + self._free[k - 1][1] == addr:
            self._free[k - 1] = (self._free[k - 1][0], self._free[k - 1][1] + self._free[k][1])
            del self._free[k]
