"""Host threads (docs/ordering-and-rules.md, "Host threads"): a clock per thread of the program.

A trace written by one thread never makes one of these: the host clock of sanitizer.order.clocks
is that thread's. Once a second thread shows up (a `thread` or `thread_start` event), each thread
K has its own clock VC_K, and the host clock StreamClocks.host becomes the *current* thread's, the
one whose events are being read; StreamClocks.union keeps what all threads know together, which
the memory rules ask (a block is freed, or handed out again, only after every thread that held it
let go of it: the reference counts order that, which capture cannot see).

- `thread` K:            the events after it are K's (a thread not seen starting begins knowing
                         what all threads know together: capture missed its start, and the
                         optimistic guess gives no false finding)
- `thread_start` K:      VC_K = VC_cur, and cur's CPU work so far (its lane's count)
- `thread_end` K:        K no longer holds back retirement; what it knew is kept for a join
- `thread_join` K:       VC_cur = max(VC_cur, VC_K at its end)
- `release` S:           VC_S = max(VC_S, VC_cur, cur's lane count)
- `acquire` S:           VC_cur = max(VC_cur, VC_S); a no-op when S was never released

As in ThreadSanitizer: the edges between threads are the program's own synchronisation, written by
capture where it intercepts it; nothing else orders two threads.

An op is retired (dropped from the in-flight table) once it is done for *every* live thread:
`floor` is the entry-by-entry minimum of their clocks. A thread that never learns another's work
keeps it in flight until that thread ends.
"""
from __future__ import annotations

from sanitizer.order.clocks import TooMany, merge_changed

#: the CPU lane of thread 0, the process's main thread: stream "cpu", as before threads had lanes
MAIN_LANE = "cpu"


def lane_of(thread, lane=None):
    """The stream a thread's CPU accesses are recorded on: `lane` when the trace names it, else
    capture's convention ("cpu" for thread 0, "cpu@<thread>" for the others)."""
    if lane is not None:
        return lane
    return MAIN_LANE if thread == 0 else f"cpu@{thread}"


class HostThreads:
    """The clocks of the program's host threads, the synchronisation objects between them, and
    which thread is current."""

    __slots__ = ("clocks", "lanes", "live", "ended", "syncs", "current", "version", "stamp", "merged",
                 "max_syncs")

    def __init__(self, host: dict, max_syncs: int) -> None:
        # thread -> its clock; thread 0's is the host clock the single-thread analysis built
        self.clocks = {0: host}
        self.lanes = {0: MAIN_LANE}
        self.live = {0}
        self.ended = {}       # thread -> its clock at its end (for thread_join)
        self.syncs = {}       # synchronisation object -> the clock released into it
        self.current = 0
        # An enqueue on stream S by thread K takes VC_K into VC_S, as the table says (with one
        # thread, the sparse clocks leave that out: sanitizer.order.clocks). `version`: thread ->
        # the stamp of its clock's last growth; `merged`: stream -> (thread, version) last taken in,
        # so that an enqueue costs a comparison unless the thread learned something since.
        self.version = {}
        self.stamp = 0
        self.merged = {}
        self.max_syncs = max_syncs

    def clock(self, thread, union: dict, streams: dict, lane=None) -> dict:
        """Thread's clock, made on its first appearance: a thread not seen starting knows what all
        threads know together now, their CPU work included."""
        clock = self.clocks.get(thread)
        if clock is None or thread in self.ended:   # (an ended thread's id, used again)
            clock = self.clocks[thread] = dict(union)
            self.grew(thread)
            for t in self.live:
                lane_clock = streams.get(self.lanes[t])
                if lane_clock is not None:
                    count = lane_clock.get(self.lanes[t], 0)
                    if count > clock.get(self.lanes[t], 0):
                        clock[self.lanes[t]] = count
            self.lanes[thread] = lane_of(thread, lane)
            self.live.add(thread)
            self.ended.pop(thread, None)
        return clock

    def grew(self, thread) -> None:
        """Thread's clock grew: the streams it enqueues on next take it in again."""
        self.stamp += 1
        self.version[thread] = self.stamp

    def published(self, thread, streams: dict) -> dict:
        """What `thread` hands on at a release, a start or its end: its clock and its CPU work."""
        out = dict(self.clocks[thread])
        lane = self.lanes.get(thread)
        lane_clock = streams.get(lane)
        if lane_clock is not None:
            count = lane_clock.get(lane, 0)
            if count > out.get(lane, 0):
                out[lane] = count
        return out

    def start(self, thread, lane, streams: dict) -> None:
        """The current thread starts `thread` (a thread id used again starts afresh)."""
        self.clocks[thread] = self.published(self.current, streams)
        self.grew(thread)
        self.lanes[thread] = lane_of(thread, lane)
        self.live.add(thread)
        self.ended.pop(thread, None)

    def end(self, thread, streams: dict) -> None:
        if thread not in self.clocks:
            return
        self.ended[thread] = self.published(thread, streams)
        self.live.discard(thread)

    def release(self, sync, streams: dict) -> None:
        released = self.published(self.current, streams)
        old = self.syncs.get(sync)
        if old is None:
            if len(self.syncs) >= self.max_syncs:
                raise TooMany(f"synchronisation object {sync!r} is one more than the limit of {self.max_syncs:,} "
                              "distinct ones on one rank (raise it with --max-event-ids)")
            self.syncs[sync] = released
        else:
            merge_changed(old, released, None)

    def floor(self, streams_asked) -> dict:
        """For each stream of `streams_asked`, the least any live thread knows of it: the ops up to
        there are done for every thread, and can be retired."""
        live = [self.clocks[t] for t in self.live]
        out = {}
        for s in streams_asked:
            low = None
            for c in live:
                v = c.get(s, 0)
                if low is None or v < low:
                    low = v
                    if v == 0:
                        break
            if low:
                out[s] = low
        return out
