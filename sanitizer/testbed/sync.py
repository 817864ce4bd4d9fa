"""Barriers between the ranks' comm threads, through counters in shared memory.

Every rank's comm thread runs the same sequence of collectives and, inside each, the same sequence
of barrier phases, so one monotonically increasing counter per rank is enough: the k-th barrier
is passed when every rank's counter is at least k. A rank that fails sets the abort word, and
every waiter raises instead of hanging. Waiting polls with a growing sleep (no busy spinning on
machines shared with other work).

Ordering: the data a comm thread stored before bumping its counter is visible to a peer that has
seen the counter (x86-64 and ARM64 with the GIL's release/acquire around each Python step; the
counters are aligned 8-byte words).
"""
from __future__ import annotations

import time

from .shm import CONTROL_BYTES_PER_RANK

_WORDS = CONTROL_BYTES_PER_RANK // 8


class PeerFailure(RuntimeError):
    """A barrier could not complete: a peer aborted, or the timeout passed."""


class Counters:
    def __init__(self, mapping, world_size: int, rank: int):
        self.words = memoryview(mapping.mm).cast("q")     # aligned int64 words, plain loads/stores
        self.world_size = world_size
        self.rank = rank
        self.passed = int(self.words[rank * _WORDS])   # barriers this rank has entered so far
        self._abort = world_size * _WORDS

    def aborted(self) -> int:
        return int(self.words[self._abort])

    def abort(self, code: int = 1) -> None:
        self.words[self._abort] = code

    def barrier(self, timeout: float, what: str = "barrier") -> None:
        """Arrive, then wait until every rank has arrived at this barrier."""
        target = self.passed + 1
        words, n, stride = self.words, self.world_size, _WORDS
        words[self.rank * stride] = target
        self.passed = target
        deadline = None
        pause = 0.0
        while True:
            if min(int(words[q * stride]) for q in range(n)) >= target:
                return
            if words[self._abort]:
                raise PeerFailure(f"{what}: a peer aborted (rank {self.rank} waiting at barrier {target})")
            now = time.monotonic()
            if deadline is None:
                deadline = now + timeout
            elif now > deadline:
                late = [q for q in range(n) if int(words[q * stride]) < target]
                self.abort(2)
                raise PeerFailure(f"{what}: ranks {late} did not arrive within {timeout:.0f} s "
                                  f"(rank {self.rank} waiting at barrier {target})")
            time.sleep(pause)
            pause = min(pause * 2 or 20e-6, 1e-3)
