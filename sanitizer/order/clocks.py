"""Vector clocks per stream, host and recorded event (docs/ordering-and-rules.md, "Vector clocks").

As in ThreadSanitizer and torch.cuda._sanitizer: every stream S has a clock VC_S, the host VC_H,
every recorded event E a copy VC_E. A clock is a dict {stream: count}; a missing key means 0.

- enqueue on S:      VC_S = max(VC_S, VC_H); VC_S[S] += 1; the op's epoch is (S, VC_S[S])
- record E on S:     VC_E = max(VC_S, VC_H)
- wait S on E:       VC_S = max(VC_S, VC_E)
- sync stream S:     VC_H = max(VC_H, VC_S)    (event E: VC_H = max(VC_H, VC_E); bare: all streams)
- coll_done C:       VC_H = max(VC_H, clock of C)
- op O is locally complete for stream X when max(VC_X, VC_H)[O.stream] >= O's epoch.

Sparse: the host's part is never copied into another clock. The host clock only grows, and every
use of a stream's or an event's clock takes the max with the host clock *as it is then* (a query,
a record, a wait that is later queried, a sync that the host learns), which is at least the host
clock at the time of the copy. So stored clocks hold only what their stream learned through
`wait` (and its own count), and memory grows with the streams that actually synchronise, not
with (streams x streams known to the host).

Stored clocks share: a recorded event's clock, and the snapshot a collective or a `record_stream`
free keeps, is (base, stream, count): `base` a copy of the stream's clock taken at the first record
or snapshot after the stream last learned something through a `wait`, shared by every one taken
until the next such `wait`, and the stream's own count at the time, which `enqueue` alone moves on
(so `base` may hold an older one; the larger wins). Only `wait` changes a stream's entries for other
streams, so a stream that learned N streams' counts and then records M events costs N + M, not
N x M.

Nothing here walks every stream ever seen: the host learns only what changed. `dirty` holds the
streams whose clock may hold more than the host knows (work enqueued, or a `wait`, since the host
last took that clock in); a device-wide sync takes in those alone, a sync of a stream not in it
learns nothing. Every merge into the host returns the streams whose entry grew, so that the engine
retires in-flight work of those streams only.
"""
from __future__ import annotations

from sanitizer.limits import Limits

Clock = dict
#: A stored clock (an event's, a snapshot): (base clock, shared and never changed; stream; that
#: stream's own count then). What it stands for is max(base, {stream: count}).
Stored = tuple
_EMPTY: Clock = {}

#: Distinct stream and event ids one rank may use by default (sanitizer.limits.Limits; `hazsan
#: check --max-streams/--max-event-ids`).
MAX_STREAMS = Limits.max_streams
MAX_EVENTS = Limits.max_events


class TooMany(Exception):
    """A new stream or event id past the limit; the message says which and how to raise it."""


def merge_changed(target: Clock, other: Clock, changed):
    """target = max(target, other); returns `changed` (a list, or None for a new one) with the
    keys whose entry grew appended, None when none did and none was given."""
    for key, value in other.items():
        if value > target.get(key, 0):
            target[key] = value
            if changed is None:
                changed = []
            changed.append(key)
    return changed


def merge_stored(target: Clock, stored: Stored, changed):
    """merge_changed for a stored clock: target = max(target, base, {stream: count})."""
    base, stream, count = stored
    if count > target.get(stream, 0):   # first: base's entry for the stream is never the larger
        target[stream] = count
        if changed is None:
            changed = []
        changed.append(stream)
    if base:
        changed = merge_changed(target, base, changed)
    return changed


class StreamClocks:
    """The ordering state of one rank. Knows nothing of memory; the engine asks it questions."""

    __slots__ = ("streams", "host", "union", "events", "max_streams", "max_events", "dirty", "frozen")

    def __init__(self, max_streams: int = MAX_STREAMS, max_events: int = MAX_EVENTS) -> None:
        self.streams: dict[object, Clock] = {}
        self.host: Clock = {}
        # None while one host thread wrote the trace. Once there are more (sanitizer.order.threads),
        # `host` is the current thread's clock and `union` what all threads know together: every
        # merge into the host goes into both, and `dirty` no longer says what a thread lacks.
        self.union = None
        self.events: dict[object, Stored] = {}
        # stream -> the base its stored clocks share until its next `wait` that changes it
        self.frozen: dict[object, Clock] = {}
        # streams whose clock may exceed the host's (enqueue or wait since the host took it in)
        self.dirty: set = set()
        self.max_streams = max_streams
        self.max_events = max_events

    def _new_stream(self, stream) -> Clock:
        if len(self.streams) >= self.max_streams:
            raise TooMany(f"stream {stream!r} is one more than the limit of {self.max_streams:,} distinct "
                          "streams on one rank (raise it with --max-streams)")
        clock = self.streams[stream] = {}
        return clock

    def stream_clock(self, stream) -> Clock:
        clock = self.streams.get(stream)
        if clock is None:
            clock = self._new_stream(stream)
        return clock

    def enqueue(self, stream) -> int:
        """Work enqueued on `stream`; returns its epoch (the op's own component), the int the
        clock holds.

        VC_H[S] never exceeds VC_S[S] (the host learns S's count only from copies of VC_S), so
        the max with the host leaves the own component as it is."""
        clock = self.streams.get(stream)
        if clock is None:
            clock = self._new_stream(stream)
        epoch = clock.get(stream, 0) + 1
        clock[stream] = epoch
        self.dirty.add(stream)
        return epoch

    def record(self, event, stream) -> None:
        if len(self.events) >= self.max_events and event not in self.events:
            raise TooMany(f"event {event!r} is one more than the limit of {self.max_events:,} distinct "
                          "events on one rank (raise it with --max-event-ids)")
        self.events[event] = self.snapshot(stream) if self.union is None else self.snapshot_of_host(stream)

    def wait(self, stream, event) -> bool:
        """False when the event was never recorded (CUDA treats that wait as a no-op)."""
        stored = self.events.get(event)
        if stored is None:
            return False
        if merge_stored(self.stream_clock(stream), stored, None) is not None:
            self.dirty.add(stream)
            self.frozen.pop(stream, None)   # its stored clocks from now on need a new base
        return True

    def host_learns(self, stored: Stored):
        """VC_H = max(VC_H, stored clock); the streams whose host entry grew (None: none)."""
        if self.union is not None:
            merge_stored(self.union, stored, None)
        return merge_stored(self.host, stored, None)

    def host_learns_clock(self, clock: Clock):
        """VC_H = max(VC_H, clock) for a plain clock (a thread's, a synchronisation object's)."""
        if self.union is not None:
            merge_changed(self.union, clock, None)
        return merge_changed(self.host, clock, None)

    def sync_stream(self, stream):
        """VC_H = max(VC_H, VC_stream); the streams whose host entry grew (None: none). A stream
        not dirty has nothing the host lacks: O(1)."""
        if self.union is not None:
            clock = self.streams.get(stream)
            if clock is None:
                return None
            merge_changed(self.union, clock, None)
            return merge_changed(self.host, clock, None)
        if stream not in self.dirty:
            return None
        self.dirty.discard(stream)
        return merge_changed(self.host, self.streams[stream], None)

    def sync_event(self, event) -> bool:
        stored = self.events.get(event)
        if stored is None:
            return False
        self.host_learns(stored)
        return True

    def sync_device(self, lanes=None):
        """VC_H = max over every stream: only the dirty ones can add anything. The streams whose
        host entry grew (None: none). With host threads, every stream but the CPU lanes of the
        other threads (`lanes`: a device synchronize waits for no thread)."""
        changed = None
        streams = self.streams
        if self.union is not None:
            for stream, clock in streams.items():
                if lanes is not None and stream in lanes:
                    continue
                merge_changed(self.union, clock, None)
                changed = merge_changed(self.host, clock, changed)
            return changed
        for stream in self.dirty:
            changed = merge_changed(self.host, streams[stream], changed)
        self.dirty.clear()
        return changed

    def fold(self, stream, clock: Clock) -> None:
        """VC_stream = max(VC_stream, clock): another host thread enqueues on `stream` now, and the
        work the previous one enqueued there followed what that one knew (sanitizer.order.threads)."""
        if merge_changed(self.stream_clock(stream), clock, None) is not None:
            self.dirty.add(stream)
            self.frozen.pop(stream, None)

    def snapshot(self, stream) -> Stored:
        """What `stream` knows now, beyond the host, as a stored clock (for an event, coll_done and
        free_done): O(1) but for the first one after the stream learned something by a `wait`."""
        clock = self.streams.get(stream)
        if not clock:
            return (_EMPTY, stream, 0)
        base = self.frozen.get(stream)
        if base is None:
            base = self.frozen[stream] = dict(clock)
        return (base, stream, clock.get(stream, 0))

    def snapshot_of_host(self, stream) -> Stored:
        """With host threads: what `stream` knows now together with the current thread's clock, as
        a stored clock (an event recorded, a collective issued: whoever learns it later learns what
        the issuing thread knew, which the sparse clocks otherwise take from the learner's own)."""
        base, s, count = self.snapshot(stream)
        merged = dict(self.host)
        merge_changed(merged, base, None)
        return (merged, s, count)

    def knows(self, stream, of_stream) -> int:
        """max(VC_X, VC_H)[of_stream]: how far `stream` is known to have seen `of_stream`."""
        known = self.host.get(of_stream, 0)
        clock = self.streams.get(stream)
        if clock is not None:
            v = clock.get(of_stream, 0)
            if v > known:
                return v
        return known

    def is_done_for(self, op_stream, epoch: int, stream) -> bool:
        return self.knows(stream, op_stream) >= epoch
