"""`--peer-completion successor`'s waits (docs/ordering-and-rules.md, "When is an op done"): a
collective's buffers inside a window of its own communicator are done for X only once a later
(program order, higher seq) collective on that communicator is locally done for X: its successor.
Those buffers wait on a per-communicator list (`SuccessorWait`) instead of the in-flight tables;
`SuccessorWaits` holds one rank's, and asks only the communicators an access or a sync concerns.

Compiled by Cython with the engine (types in successor.pxd beside it; buildinfo.COMPILED).
"""
from __future__ import annotations

from bisect import bisect_right

from sanitizer.rules.intervals import RangeIndex
from sanitizer.rules.kinds import WRITE
from sanitizer.rules.records import widen


class SuccessorWait:
    """The collectives of one communicator, in program order, until each is done for the host
    (locally complete, and a later one locally complete too).

    The usual communicator runs all its collectives on one stream with rising seq (`ordered`).
    Then the ones locally complete for a stream X are a prefix of the waiting list (one stream:
    epoch order), a later one has a higher seq, and those not done for X are a suffix: for a write,
    from the last locally complete one on (it has no successor yet); for a read, from the first one
    not locally complete. Their window buffers are found through an address index, so an access
    costs O(log n + overlaps); retiring drops a prefix. A communicator whose waiting collectives
    use a second stream, or a seq that does not rise, is scanned in full per access instead (the
    same answers, by the definition itself).
    """

    __slots__ = ("colls", "epochs", "entries", "start", "base", "index", "ordered", "ordinal", "streams")

    def __init__(self, ordinal=0):
        self.ordinal = ordinal  # its communicator's rank among the rank's (SuccessorWaits.by_comm's order)
        self.streams = set()  # the streams it is listed under in SuccessorWaits.on
        self.colls: list = []  # colls[start:] wait, in program order
        self.epochs: list = []  # their epochs (ordered: rising)
        self.entries: list = []  # per coll: its [(lo, hi, item)] in `index` (ordered only)
        self.start = 0
        self.base = 0  # colls dropped from the front of the lists: position = base + list index
        self.index = RangeIndex()  # window buffers; item (position, access, op)
        self.ordered = True

    def push(self, op) -> None:
        colls = self.colls
        n = len(colls)
        if self.start == n:
            self.ordered = True  # nothing waits: a fresh start
        elif self.ordered:
            last = colls[n - 1]
            if op.stream != last.stream or op.seq <= last.seq:
                self._unorder()
        entries = []
        if self.ordered:
            position = self.base + n
            for lo, hi, acc in op.window_bufs:
                item = (position, acc, op)
                self.index.add(lo, hi, item)
                entries.append((lo, hi, item))
        colls.append(op)
        self.epochs.append(op.epoch)
        self.entries.append(entries)

    def _unorder(self) -> None:
        self.ordered = False
        self.index = RangeIndex()
        self.entries = [[] for _ in self.entries]

    def not_done(self, clocks, stream, lo, hi, access, protected, hits):
        """Add to `hits` ({op: [lo, hi]}) the waiting collectives with a window buffer overlapping
        [lo, hi) that conflicts with `access` and is not done for `stream`; returns `hits`."""
        colls = self.colls
        start = self.start
        n = len(colls)
        if start == n:
            return hits
        write = access & WRITE
        if not self.ordered:
            done_seq = None  # highest seq among later collectives locally complete for `stream`
            for i in range(n - 1, start - 1, -1):
                op = colls[i]
                local = clocks.knows(stream, op.stream) >= op.epoch
                # done for a write: locally complete AND a later collective done ("successor")
                not_done = not (local and done_seq is not None and done_seq > op.seq) if write else not local
                if op.window_bufs and not_done and not (protected and op.stream in protected):
                    for blo, bhi, bacc in op.window_bufs:
                        if blo < hi and lo < bhi and (bacc | access) & WRITE:
                            if hits is None:
                                hits = {}
                            widen(hits, op, max(lo, blo), min(hi, bhi))
                if local:
                    if done_seq is None or op.seq > done_seq:
                        done_seq = op.seq
            return hits
        s = colls[start].stream
        if protected and s in protected:
            return hits
        k = bisect_right(self.epochs, clocks.knows(stream, s), start)  # colls[start:k] local
        first = k - 1 if write and k > start else k
        if first >= n:
            return hits
        first += self.base
        found = None
        for blo, bhi, item in self.index.overlapping(lo, hi):
            if item[0] >= first and (item[1] | access) & WRITE:
                if found is None:
                    found = []
                found.append((item[0], blo, bhi, item[2]))
        if found is not None:
            if hits is None:
                hits = {}
            if len(found) > 1:
                found.sort(key=_position, reverse=True)  # the scan's order: findings come out the same
            for _, blo, bhi, op in found:
                widen(hits, op, max(lo, blo), min(hi, bhi))
        return hits

    def retire(self, host: dict):
        """Drop the collectives done for the host (`host`: its clock). The others stay, in order:
        they may still serve as successors. Returns the dropped ones (None: none)."""
        colls = self.colls
        start = self.start
        n = len(colls)
        if start == n:
            return None
        if not self.ordered:
            done_seq = None
            gone = None
            for i in range(n - 1, start - 1, -1):
                op = colls[i]
                local = host.get(op.stream, 0) >= op.epoch
                if local and done_seq is not None and done_seq > op.seq:
                    if gone is None:
                        gone = set()
                    gone.add(i)
                if local and (done_seq is None or op.seq > done_seq):
                    done_seq = op.seq
            if gone:
                dropped = [colls[i] for i in sorted(gone)]
                keep = [i for i in range(start, n) if i not in gone]
                self.colls = [colls[i] for i in keep]
                self.epochs = [self.epochs[i] for i in keep]
                self.entries = [[] for _ in keep]
                self.base += n  # positions are unused while unordered; keep them fresh
                self.start = 0
                return dropped
            return None
        k = bisect_right(self.epochs, host.get(colls[start].stream, 0), start)
        stop = k - 1  # colls[start:stop] have a later collective locally complete for the host
        if stop <= start:
            return None
        dropped = colls[start:stop]
        index = self.index
        entries = self.entries
        for i in range(start, stop):
            for lo, hi, item in entries[i]:
                index.remove(lo, hi, item)
        self.start = stop
        if stop > 1024 and stop * 2 > n:  # compact now and then
            del colls[:stop]
            del self.epochs[:stop]
            del entries[:stop]
            self.base += stop
            self.start = 0
        return dropped

    def __len__(self):
        return len(self.colls) - self.start


class SuccessorWaits:
    """One rank's SuccessorWaits: comm -> its SuccessorWait (`by_comm`, in the order communicators
    first waited); the window buffers of every waiting collective by address (`index`, item
    (SuccessorWait, op)), so that an access asks only the communicators with one overlapping it,
    not all of them; and stream -> the SuccessorWaits with a collective waiting on it (`on`, as a
    dict in the order they were listed), so that a sync retires only those of the streams it
    taught the host. A SuccessorWait leaves `on` when nothing of it waits."""

    __slots__ = ("by_comm", "index", "on")

    def __init__(self):
        self.by_comm = {}
        self.index = RangeIndex()
        self.on = {}

    def push(self, op) -> None:
        """Collective `op`, just enqueued, waits for its successor."""
        sc = self.by_comm.get(op.comm)
        if sc is None:
            sc = self.by_comm[op.comm] = SuccessorWait(len(self.by_comm))
        sc.push(op)
        if op.window_bufs:
            keys = []
            waiting = self.index
            for lo, hi, _ in op.window_bufs:
                item = (sc, op)
                waiting.add(lo, hi, item)
                keys.append((lo, hi, item))
            op.succ_keys = keys
        stream = op.stream
        if stream not in sc.streams:
            sc.streams.add(stream)
            listed = self.on.get(stream)
            if listed is None:
                listed = self.on[stream] = {}
            listed[sc] = None

    def not_done(self, clocks, stream, lo, hi, access, protected, hits):
        """What every communicator's SuccessorWait.not_done adds to `hits`, in the order of
        by_comm. Only one with a waiting window buffer overlapping [lo, hi) can add anything, so
        only those are asked (`index` finds them): an access costs O(log n + overlaps), not
        O(communicators)."""
        waiting = self.index
        if not waiting.count:
            return hits
        asked = None
        for _, _, item in waiting.overlapping(lo, hi):
            if asked is None:
                asked = {}
            asked[item[0]] = None
        if asked is not None:
            for sc in (sorted(asked, key=_ordinal) if len(asked) > 1 else asked):
                hits = sc.not_done(clocks, stream, lo, hi, access, protected, hits)
        return hits

    def retire(self, host, learned, completions) -> None:
        """A collective leaves once it is done for the host itself, locally complete and a later
        one done (SuccessorWait.retire). Only the host's entries for its streams decide that, so
        only the communicators waiting on a stream the host just learned more of (`learned`;
        None: all) are asked: a sync costs what it changed, not O(communicators). `completions`
        (None: none) is told of those that leave."""
        on = self.on
        if learned is None:
            asked = list(self.by_comm.values())
        else:
            asked = []
            for s in learned:
                listed = on.get(s)
                if listed:
                    asked.extend(listed)
        waiting = self.index
        for sc in asked:
            gone = sc.retire(host)
            if gone:
                if completions is not None:
                    completions.successor_done(gone)
                for op in gone:
                    keys = op.succ_keys
                    if keys is not None:
                        for lo, hi, item in keys:
                            waiting.remove(lo, hi, item)
                        op.succ_keys = None
                if not len(sc) and sc.streams:
                    for s in sc.streams:
                        listed = on.get(s)
                        if listed is not None:
                            listed.pop(sc, None)
                            if not listed:
                                del on[s]
                    sc.streams.clear()


def _ordinal(sc):
    return sc.ordinal


def _position(entry):
    return entry[0]
