"""asymmetric-offset, the one rule across ranks (docs/ordering-and-rules.md): the same collective
(comm, seq) must use the same window offsets on every rank. Each rank's engine submits its
collectives' window signatures while the driver reads the ranks round-robin; entries settle at the
end of a round, so pending matches stay bounded by how far ranks drift apart.

Compiled by Cython with the engine (buildinfo.COMPILED); the engine module re-exports the class
(`engine.CollectiveMatcher`, the driver's default).
"""
from __future__ import annotations

from sanitizer.rules.findings import ERROR, Finding, OpRecord


def _reported_or_ended(entry: dict, members: set, finished: set) -> bool:
    """Every member of the communicator reported this collective or was read to its end."""
    for r in members:
        if r not in entry and r not in finished:
            return False
    return True


class CollectiveMatcher:
    """asymmetric-offset: the same (comm, seq) must use the same window offsets on every rank.

    The lowest rank's signature is the reference. Ranks are read round-robin, a batch each; an
    entry is settled at the end of a round once every rank known to use the communicator has
    reported it (a rank that first uses it later in the same round is known by then). A rank may
    first use a communicator long after the others (thousands of other events first): the
    settled references of a communicator are therefore kept until no rank can still bring it for
    the first time, that is until every rank of the run (`ranks`) uses it or has been read to
    its end (`rank_finished`); with all ranks in the communicator, the usual case, that is at
    once. A member whose file ended (a killed rank) is not waited for: a collective it never
    reported is compared among the others at the end of the round and counted as unmatched. At most `max_retained` references are kept so: past that the oldest go, and a rank
    later than that is counted as unmatched (a warning), never silently passed.
    """

    MAX_RETAINED = 1_000_000

    def __init__(self, sink, enabled: bool, ranks=None, max_retained: int = MAX_RETAINED):
        self.sink = sink
        self.enabled = enabled
        self.ranks = set(ranks) if ranks is not None else None
        self.finished: set = set()
        self.closed: set = set()  # communicators no rank can still join
        self.max_retained = max_retained
        self.pending: dict[tuple, dict] = {}
        # comm -> {seq: [reference rank, its entry value, ranks that reported it]}, oldest first
        self.settled: dict[object, dict] = {}
        self.retained = 0
        self.members: dict[object, set] = {}
        self.round = 0
        self.unmatched = 0
        self.dropped = 0  # references dropped past max_retained

    def submit(self, analyzer, comm, seq, op, sig: tuple) -> None:
        if not self.enabled:
            return
        members = self.members.get(comm)
        if members is None:
            members = self.members[comm] = set()
        members.add(analyzer.rank)
        key = (comm, seq)
        value = (sig, analyzer, op, analyzer.step)
        by_seq = self.settled.get(comm)
        if by_seq is not None:
            done = by_seq.get(seq)
            if done is not None:
                self._compare(key, done[0], done[1], analyzer.rank, value)
                done[2] += 1
                if done[2] >= len(members) and comm in self.closed:
                    del by_seq[seq]  # every rank of the communicator has reported it
                    self.retained -= 1
                return
        entry = self.pending.get(key)
        if entry is None:
            self.pending[key] = {analyzer.rank: value}
        else:
            entry[analyzer.rank] = value

    def rank_finished(self, rank) -> None:
        """`rank`'s file has been read to its end: it brings no more collectives."""
        self.finished.add(rank)

    def _may_still_join(self, comm) -> bool:
        """Some rank neither uses `comm` yet nor has been read to its end."""
        if self.ranks is None:
            return True
        members = self.members.get(comm, ())
        return any(r not in members and r not in self.finished for r in self.ranks)

    def end_round(self) -> None:
        """Settle complete entries; keep references only while some rank may still report them."""
        self.round += 1
        for comm in self.members:
            if comm not in self.closed and not self._may_still_join(comm):
                self.closed.add(comm)
                by_seq = self.settled.get(comm)
                if by_seq:
                    n = len(self.members[comm])
                    for seq in [q for q, v in by_seq.items() if v[2] >= n]:
                        del by_seq[seq]
                        self.retained -= 1
        finished = self.finished
        members = self.members
        for key in [k for k, e in self.pending.items()
                    if len(e) >= len(members[k[0]]) or (finished and _reported_or_ended(e, members[k[0]], finished))]:
            self._settle(key, self.pending.pop(key))
        while self.retained > self.max_retained:
            settled = self.settled
            comm = min((c for c in settled if settled[c]), key=lambda c: next(iter(settled[c].values()))[3])
            by_seq = settled[comm]
            del by_seq[next(iter(by_seq))]
            self.retained -= 1
            self.dropped += 1

    def _forget(self, comm) -> None:
        """Stop keeping `comm`'s references; those some member never reported are unmatched."""
        by_seq = self.settled.pop(comm)
        self.retained -= len(by_seq)
        n = len(self.members.get(comm, ()))
        self.unmatched += sum(1 for v in by_seq.values() if v[2] < n)

    def _settle(self, key, entry) -> None:
        ranks = sorted(entry)
        ref_value = entry[ranks[0]]
        for r in ranks[1:]:
            self._compare(key, ranks[0], ref_value, r, entry[r])
        if key[0] in self.closed:
            # no rank can still report it; members missing from it were read to their end (a
            # killed rank): unmatched now, not kept until the end of the run
            if len(ranks) < len(self.members[key[0]]):
                self.unmatched += 1
            return
        by_seq = self.settled.get(key[0])
        if by_seq is None:
            by_seq = self.settled[key[0]] = {}
        if key[1] not in by_seq:
            self.retained += 1
        by_seq[key[1]] = [ranks[0], ref_value, len(ranks), self.round]

    def _compare(self, key, ref_rank, ref_value, rank, value) -> None:
        ref_sig, ref_an, ref_op, _ = ref_value
        sig, an, op, step = value
        if sig == ref_sig:
            return
        ref = OpRecord.of(ref_op, rank=ref_rank, file=ref_an.file, window_sig=ref_sig)
        mine = OpRecord.of(op, window_sig=sig)
        self.sink.add(Finding(
            rule="asymmetric-offset", severity=ERROR, rank=rank, step=step, file=an.file,
            line=op.line, block=mine, op=ref, overlap=None, site=op.site,
            detail=(f"{key[0]!r} seq {key[1]}: rank {rank} uses window (ordinal, offset, size) "
                    f"{list(sig)}, rank {ref_rank} uses {list(ref_sig)}")))

    def finish(self) -> None:
        for key, entry in list(self.pending.items()):
            if len(entry) > 1:
                self._settle(key, entry)
                continue  # counted with the settled ones below
            self.unmatched += 1 if len(entry) < len(self.members.get(key[0], ())) else 0
        self.pending.clear()
        for comm in list(self.settled):
            self._forget(comm)
