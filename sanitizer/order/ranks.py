"""Ordering across ranks: a send is complete for its sender once a message the peer sent after
receiving it has arrived (docs/ordering-and-rules.md, "Ordering across ranks").

Each rank is analysed alone (sanitizer.rules.engine), so a send the program never waits for (an
`isend` whose Work it drops or keeps, as vLLM's NIXL connector and ai-dynamo/dynamo#826 do) stays
in flight for its sender for good, and every later write or free of its buffer is flagged, even
where the program learned, from the peer, that the data arrived. This module adds the edges that
capture's messages carry, as MPI correctness tools (MUST, ISP) do:

* a matched receive is ordered after its send; a collective in which every rank contributes data
  (all-reduce, all-gather, reduce-scatter, all-to-all, barrier) completes on a rank only after
  every rank entered it;
* so when the peer P knew its receive of rank R's send O complete (the program's own completion:
  a plain `coll_done`, a blocking receive returning, a `sync`) and then issued a message M that
  reaches R (a send to R, or such a collective of a group R is in), R knows O complete once its
  program knows its own end of M complete.

One hop only: what P learnt through a third rank is not passed on (docs: a limit).

It costs nothing where nothing needs it: `hazsan check` runs every rank's analysis first, and only
when a finding is about a send still in flight to a rank of the check does it ask this module
(`candidates`). Then `scan` reads the rank files involved (the candidates' and their peers', in
the same pool as the analysis: `--jobs`, Dask) for their messages only, each rank's result a few
integer arrays per channel; `settle` joins them here and says, per rank file, after which line the
program knew which of its sends complete. The driver reruns those ranks with a plain `coll_done`
of each such send fed after that line (sanitizer.rules.driver, `extra_done`), and `annotate` gives
each finding still on a send to a rank of the check a note: the order may come from a channel
capture does not record (ZMQ, NIXL).

Never imports torch; reads only the trace.
"""
from __future__ import annotations

import re
from array import array
from bisect import bisect_right

#: `<group>:p2p:<lo>-<hi>`: capture's communicator of a point-to-point pair (global ranks)
P2P = re.compile(r"^(?P<group>.*):p2p:(?P<lo>-?\d+)-(?P<hi>-?\d+)$")
#: the last part of an op's name, lowercased, underscores out, an NCCL prefix off: a send ...
_SENDS = frozenset({"send", "isend"})
_RECVS = frozenset({"recv", "irecv"})
#: ... and the collectives in which every rank's data reaches every rank (or which wait for every
#: rank: a barrier). Broadcast and scatter (only the root's data travels: the root learns nothing),
#: reduce and gather (only the root receives) are not, nor anything unknown.
_EVERY_RANK = ("allreduce", "allgather", "reducescatter", "alltoall", "barrier", "monitoredbarrier")

NOTE = ("nothing recorded orders this send complete for rank {rank}: no message from rank {peer} "
        "sent after it received the data has arrived here. If the program learns it through a "
        "channel capture does not record (ZMQ, NIXL, a TCP store), the order is real and not in "
        "the traces (docs/ordering-and-rules.md, \"Ordering across ranks\")")

NEVER = -1   # a line: the program never knew it complete


def _short(name) -> str:
    if not isinstance(name, str):
        return ""
    last = name.rsplit(".", 1)[-1].rsplit("::", 1)[-1].lower().replace("_", "")
    return last[4:] if last.startswith("nccl") else last


def kind_of(op_name, comm, me: int):
    """("send", peer) / ("recv", peer) for a point-to-point op of rank `me`, ("all", None) for a
    collective every rank's data reaches every rank through, else None."""
    short = _short(op_name)
    if isinstance(comm, str) and ":p2p:" in comm:
        m = P2P.match(comm)
        if m is None:
            return None                     # `<group>:p2p:any`: a receive from any source
        lo, hi = int(m["lo"]), int(m["hi"])
        if me not in (lo, hi) or lo == hi:
            return None
        peer = hi if me == lo else lo
        if short in _SENDS:
            return "send", peer
        if short in _RECVS:
            return "recv", peer
        return None                         # batch_p2p_ops: both ways, its parts unknown
    if short.startswith(_EVERY_RANK):
        return "all", None
    return None


def send_peer(op: dict | None, rank: int):
    """The peer of a finding's op when it is a point-to-point send of `rank`, else None."""
    if not op or op.get("kind") != "coll" or op.get("replay_of_line") is not None:
        return None
    k = kind_of(op.get("op"), op.get("comm"), rank)
    return k[1] if k is not None and k[0] == "send" else None


def candidates(p2p_ops, ranks: dict) -> dict:
    """{file: {cid: peer}}: the sends still in flight that findings are about, whose peer is a rank
    of the check. `p2p_ops`: ((rank, cid), OpRecord) of the findings' ops; `ranks`: rank -> file,
    every rank once (a finding's rank names its file)."""
    out: dict = {}
    for (rank, cid), op in p2p_ops:
        peer = send_peer(op.to_dict(), rank)
        if peer is None or peer not in ranks or rank not in ranks:
            continue
        out.setdefault(ranks[rank], {})[cid] = peer
    return out


class Summary:
    """One rank's messages, as `scan` reads them. Lines are trace lines (header = 1). Arrays hold
    NEVER where the program never knew an op complete.

    sends   {cid: (comm, peer, k, line)}: the asked sends, k their index among this rank's sends to
            peer on comm, line their `coll`'s
    recv    {(comm, src): array of the line the program knew its k-th receive from src complete}
    out_p   {(comm, dst): array of the lines of its sends to dst, in order}
    out_c   {comm: (array of seqs, array of lines)}: its every-rank collectives, in program order
    in_c    {comm: {seq: line known complete}}
    """

    __slots__ = ("rank", "sends", "recv", "out_p", "out_c", "in_c")

    def __init__(self, rank):
        self.rank = rank
        self.sends: dict = {}
        self.recv: dict = {}
        self.out_p: dict = {}
        self.out_c: dict = {}
        self.in_c: dict = {}

    def __getstate__(self):
        return tuple(getattr(self, k) for k in self.__slots__)

    def __setstate__(self, state):
        for k, v in zip(self.__slots__, state):
            setattr(self, k, v)


def scan(path: str, cids=(), limits=None) -> Summary | None:
    """Read one rank file for its messages (module docstring). `cids`: the sends whose (comm,
    peer, k) are asked. None where the file cannot be read (the analysis reported why)."""
    from sanitizer.trace import events as E
    from sanitizer.trace.reader import TraceError, TypedEvents, open_trace

    try:
        trace = open_trace(path, limits)
    except TraceError:
        return None
    me = trace.rank
    s = Summary(me)
    asked = set(cids)
    kinds: dict = {cls: cls for cls in E.KINDS}

    def learn(classes):
        kinds.update(classes)

    if trace.format == "binary" and trace.values is None:
        from sanitizer.trace.binary import TO_JSON_CLASS

        learn(TO_JSON_CLASS)
    source = TypedEvents(trace, 512, on_classes=learn)
    Coll, CollDone, Sync = E.Coll, E.CollDone, E.Sync
    GraphBegin, GraphEnd = E.GraphBegin, E.GraphEnd
    described = E.described
    sent: dict = {}           # (comm, peer) -> sends so far
    got: dict = {}            # (comm, peer) -> receives so far
    pending: dict = {}        # cid -> (array, index) or (dict, seq): where its known line goes
    by_stream: dict = {}      # stream -> cids pending on it
    capturing = 0
    problems: list = []
    try:
        while True:
            try:
                first, items = source.next(problems)
            except StopIteration:
                break
            line = first - 1
            for ev in items:
                line += 1
                if ev is None:
                    continue
                kind = kinds.get(type(ev))
                if kind is CollDone:
                    if ev.observed:
                        continue
                    slot = pending.pop(ev.cid, None)
                    if slot is not None:
                        slot[0][slot[1]] = line
                elif kind is Coll:
                    if capturing:
                        continue                    # captured, not run: no message (docs)
                    k = kind_of(described(ev, "op"), ev.comm, me)
                    if k is None:
                        continue
                    what, peer = k
                    comm, cid = ev.comm, ev.cid
                    if what == "send":
                        key = (comm, peer)
                        n = sent.get(key, 0)
                        sent[key] = n + 1
                        lines = s.out_p.get(key)
                        if lines is None:
                            lines = s.out_p[key] = array("q")
                        lines.append(line)
                        if cid in asked:
                            s.sends[cid] = (comm, peer, n, line)
                        continue
                    if what == "recv":
                        key = (comm, peer)
                        n = got.get(key, 0)
                        got[key] = n + 1
                        known = s.recv.get(key)
                        if known is None:
                            known = s.recv[key] = array("q")
                        known.append(NEVER)
                        slot = (known, n)
                    else:
                        seqs = s.out_c.get(comm)
                        if seqs is None:
                            seqs = s.out_c[comm] = (array("q"), array("q"))
                            s.in_c[comm] = {}
                        seqs[0].append(ev.seq)
                        seqs[1].append(line)
                        s.in_c[comm][ev.seq] = NEVER
                        slot = (s.in_c[comm], ev.seq)
                    pending[cid] = slot
                    by_stream.setdefault(ev.stream, []).append(cid)
                elif kind is Sync:
                    if ev.stream is None and ev.event is None:
                        done = [c for cids_ in by_stream.values() for c in cids_]
                        by_stream.clear()
                    elif ev.stream is not None:
                        done = by_stream.pop(ev.stream, ())
                    else:
                        continue                    # an event's sync: not followed (conservative)
                    for c in done:
                        slot = pending.pop(c, None)
                        if slot is not None:
                            slot[0][slot[1]] = line
                elif kind is GraphBegin:
                    capturing += 1
                elif kind is GraphEnd:
                    capturing = max(0, capturing - 1)
    except TraceError:
        pass                                        # the analysis reports it; what was read counts
    finally:
        source.forget()
    return s


def _suffix_min(values) -> array:
    """out[i] = the least known line (not NEVER) of values[i:], NEVER where none."""
    out = array("q", bytes(8 * len(values)))
    best = NEVER
    for i in range(len(values) - 1, -1, -1):
        v = values[i]
        if v != NEVER and (best == NEVER or v < best):
            best = v
        out[i] = best
    return out


def settle(summaries: dict, wanted: dict, files: dict) -> dict:
    """{file: {line: [cids]}}: after which line each rank's program knew which of its asked sends
    complete, by one hop through the peer. `summaries`: rank -> Summary (None: unreadable);
    `wanted`: {file: {cid: peer}} (candidates); `files`: file -> rank."""
    out: dict = {}
    cache: dict = {}
    for file, cids in wanted.items():
        r = files.get(file)
        mine = summaries.get(r)
        if mine is None:
            continue
        for cid in cids:
            sent = mine.sends.get(cid)
            if sent is None:
                continue
            comm, p, k, issued = sent
            peer = summaries.get(p)
            if peer is None:
                continue
            known = peer.recv.get((comm, r))
            if known is None or k >= len(known) or known[k] == NEVER:
                continue                            # the peer never knew it received it
            x = known[k]
            best = NEVER
            # its sends to r after x, and r's receives of them
            for (c2, dst), lines in peer.out_p.items():
                if dst != r:
                    continue
                j = bisect_right(lines, x)
                if j >= len(lines):
                    continue
                key = ("p", r, c2, p)
                tail = cache.get(key)
                if tail is None:
                    tail = cache[key] = _suffix_min(mine.recv.get((c2, p), array("q")))
                if j < len(tail) and tail[j] != NEVER and (best == NEVER or tail[j] < best):
                    best = tail[j]
            # its every-rank collectives after x on groups r is in, and r's completions of them
            for c2, (seqs, lines) in peer.out_c.items():
                mine_c = mine.in_c.get(c2)
                if mine_c is None:
                    continue
                j = bisect_right(lines, x)
                if j >= len(lines):
                    continue
                key = ("c", r, p, c2)
                tail = cache.get(key)
                if tail is None:
                    tail = cache[key] = _suffix_min(array("q", [mine_c.get(q, NEVER) for q in seqs]))
                if tail[j] != NEVER and (best == NEVER or tail[j] < best):
                    best = tail[j]
            if best != NEVER and best > issued:
                out.setdefault(file, {}).setdefault(best, []).append(cid)
    return out


def annotate(findings, ranks: dict) -> int:
    """Give every finding still on a send to a rank of the check (`ranks`: rank -> file) the note
    (module docstring). Returns how many got it."""
    n = 0
    for f in findings:
        op = f.op
        peer = send_peer(op.to_dict() if op is not None else None, f.rank)
        if peer is None or peer not in ranks or f.note:
            continue
        f.note = NOTE.format(rank=f.rank, peer=peer)
        n += 1
    return n
