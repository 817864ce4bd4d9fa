"""Raw pointer -> live storage block, for collectives that pass raw pointers (NCCL's ctypes calls)."""
from __future__ import annotations

import bisect


class LiveRanges:
    """Raw pointer -> the live block whose memory [real, real + nbytes) holds it.

    Collectives through NCCL's ctypes wrapper pass raw pointers, not tensors. A sorted index of
    block start addresses answers a lookup with one bisect. The allocation hot path is untouched:
    on a miss, the blocks recorded since the last look are taken from the end of the live dict
    (insertion order is id order) and inserted; dead entries are skipped by a liveness check and
    dropped by a full rebuild only when one shadows a lookup or they outnumber the live ones."""

    def __init__(self, live: dict):
        self.live = live
        self.starts: list[int] = []
        self.blocks: list = []
        self.max_id = 0

    def _rebuild(self) -> None:
        blocks = sorted((b for b in list(self.live.values()) if b.nbytes), key=lambda b: b.real)
        self.blocks = blocks
        self.starts = [b.real for b in blocks]
        self.max_id = max((b.id for b in blocks), default=self.max_id)

    def _add_new(self) -> None:
        fresh = []
        try:
            for b in reversed(self.live.values()):
                if b.id <= self.max_id:
                    break
                fresh.append(b)
        except RuntimeError:            # the dict changed size under us (another thread): rebuild
            self._rebuild()
            return
        if len(fresh) > 64 and len(fresh) * 8 > len(self.starts):   # many: one sort is cheaper
            self._rebuild()
            return
        for b in fresh:
            if b.nbytes:
                i = bisect.bisect_right(self.starts, b.real)
                self.starts.insert(i, b.real)
                self.blocks.insert(i, b)
            if b.id > self.max_id:
                self.max_id = b.id

    def _lookup(self, ptr: int):
        """(live block holding ptr or None, whether a dead entry was in the way)."""
        i = bisect.bisect_right(self.starts, ptr) - 1
        if i < 0:
            return None, False
        b = self.blocks[i]
        if self.live.get(b.key) is not b:
            return None, True
        return (b if ptr < b.real + b.nbytes else None), False

    def find(self, ptr: int):
        if not ptr:
            return None
        b, dead = self._lookup(ptr)
        if b is None:
            if len(self.starts) > 2 * len(self.live) + 1024:
                self._rebuild()
            else:
                self._add_new()
            b, dead = self._lookup(ptr)
            if b is None and dead:
                self._rebuild()
                b, _ = self._lookup(ptr)
        return b
