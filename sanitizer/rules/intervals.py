"""Interval and id sets the engine keeps (docs/ordering-and-rules.md, "What the analysis keeps"),
knowing nothing of ops or clocks: `RangeIndex`, items by address range, overlap queries in
O(log n + overlaps); `SeenIds`, ids ever used, O(1) memory for consecutive integers.

Compiled by Cython with the engine (types in intervals.pxd beside it; buildinfo.COMPILED), and used
by `hazsan place` too (sanitizer.place.replay), which needs no engine.
"""
from __future__ import annotations

from bisect import bisect_right

from sortedcontainers import SortedList

#: Entries in one length class past which it is kept in a SortedList (O(log n) insert and remove)
#: instead of a plain sorted list (bisect and insert in C, the usual case).
BIG = 4096


class RangeIndex:
    """Items with [lo, hi) ranges (live blocks, a graph's reserved buffers): overlap queries in
    O(log n + overlaps), as BufferIndex, whatever the mix of sizes (one huge block does not make
    every query scan the small ones below it)."""

    __slots__ = ("classes", "longest", "serial", "count")

    def __init__(self):
        self.classes: dict = {}  # length class -> sorted list or SortedList of (lo, serial, hi, item)
        self.longest: dict = {}
        self.serial = 0
        self.count = 0

    def add(self, lo, hi, item) -> None:
        n = hi - lo
        c = n.bit_length()
        self.serial += 1
        key = (lo, self.serial, hi, item)
        entries = self.classes.get(c)
        if entries is None:
            self.classes[c] = [key]
            self.longest[c] = n
        else:
            if n > self.longest[c]:
                self.longest[c] = n
            if type(entries) is list:
                if entries[-1] < key:
                    entries.append(key)
                else:
                    entries.insert(bisect_right(entries, key), key)
                if len(entries) > BIG:
                    self.classes[c] = SortedList(entries)
            else:
                entries.add(key)
        self.count += 1

    def remove(self, lo, hi, item) -> None:
        c = (hi - lo).bit_length()
        entries = self.classes.get(c)
        if entries is None:
            return
        i = bisect_right(entries, (lo,)) if type(entries) is list else entries.bisect_right((lo,))
        n = len(entries)
        while i < n:
            key = entries[i]
            if key[0] != lo:
                return
            if key[3] is item:
                if type(entries) is list:
                    del entries[i]
                else:
                    entries.remove(key)
                self.count -= 1
                if not entries:
                    del self.classes[c]
                    del self.longest[c]
                return
            i += 1

    def overlapping(self, lo, hi) -> list:
        """(lo, hi, item) of every item overlapping [lo, hi)."""
        found = []
        for c, entries in self.classes.items():
            if entries[0][0] >= hi:
                continue  # all of the class starts at or past hi
            start = lo - self.longest[c]
            if entries[-1][0] <= start:
                continue  # all of the class ends at or before lo
            start = (start,)
            if type(entries) is list:
                i = bisect_right(entries, start)
                n = len(entries)
                while i < n:
                    key = entries[i]
                    if key[0] >= hi:
                        break
                    if lo < key[2]:
                        found.append((key[0], key[2], key[3]))
                    i += 1
            else:
                for key in entries.irange(start, (hi,), (True, False)):
                    if lo < key[2]:
                        found.append((key[0], key[2], key[3]))
        return found

    def first_added(self, lo, hi):
        """Of the items overlapping [lo, hi), the one added first (None if none)."""
        best = None
        for c, entries in self.classes.items():
            start = (lo - self.longest[c],)
            it = entries.irange(start, (hi,), (True, False)) if type(entries) is not list else \
                entries[bisect_right(entries, start):bisect_right(entries, (hi,))]
            for key in it:
                if lo < key[2] and (best is None or key[1] < best[1]):
                    best = key
        return None if best is None else best[3]

    def __len__(self):
        return self.count


class SeenIds:
    """Ids ever used (duplicate `cid` detection) in O(1) memory for consecutive integer ids."""

    __slots__ = ("lo", "hi", "other")

    def __init__(self):
        self.lo = self.hi = None
        self.other: set = set()

    def add(self, key) -> bool:
        """False when `key` was seen before."""
        if type(key) is int:
            if self.hi is not None and key == self.hi + 1:
                if self.other and key in self.other:
                    return False  # seen before, out of order
                self.hi = key
                return True
            if self.hi is None and not self.other:
                self.lo = self.hi = key
                return True
            if self.hi is not None and self.lo <= key <= self.hi:
                return False
        if key in self.other:
            return False
        self.other.add(key)
        return True

    def __contains__(self, key) -> bool:
        if type(key) is int and self.hi is not None and self.lo <= key <= self.hi:
            return True
        return key in self.other
