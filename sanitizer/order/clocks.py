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

Nothing here walks every stream ever seen: the host learns only what changed. `dirty` holds the
streams whose clock may hold more than the host knows (work enqueued, or a `wait`, since the host
last took that clock in); a device-wide sync takes in those alone, a sync of a stream not in it
learns nothing. Every merge into the host returns the streams whose entry grew, so that the engine
retires in-flight work of those streams only.
"""
from __future__ import annotations

Clock = dict

#: Distinct stream and event ids one rank may use (`hazsan check --max-streams/--max-events`).
MAX_STREAMS = 100_000
MAX_EVENTS = 100_000


class TooMany(Exception):
    """A new stream or event id past the limit; the message says which and how to raise it."""


def merge_into(target: Clock, other: Clock) -> bool:
    """target = max(target, other); True when target changed."""
    changed = False
    for key, value in other.items():
        if value > target.get(key, 0):
            target[key] = value
            changed = True
    return changed


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


class StreamClocks:
    """The ordering state of one rank. Knows nothing of memory; the engine asks it questions."""

    __slots__ = ("streams", "host", "events", "max_streams", "max_events", "dirty")

    def __init__(self, max_streams: int = MAX_STREAMS, max_events: int = MAX_EVENTS) -> None:
        self.streams: dict[object, Clock] = {}
        self.host: Clock = {}
        self.events: dict[object, Clock] = {}
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
                          "events on one rank (raise it with --max-events)")
        clock = self.streams.get(stream)
        self.events[event] = dict(clock) if clock else {}

    def wait(self, stream, event) -> bool:
        """False when the event was never recorded (CUDA treats that wait as a no-op)."""
        clock = self.events.get(event)
        if clock is None:
            return False
        if clock and merge_into(self.stream_clock(stream), clock):
            self.dirty.add(stream)
        return True

    def host_learns(self, clock: Clock):
        """VC_H = max(VC_H, clock); the streams whose host entry grew (None: none)."""
        return merge_changed(self.host, clock, None)

    def sync_stream(self, stream):
        """VC_H = max(VC_H, VC_stream); the streams whose host entry grew (None: none). A stream
        not dirty has nothing the host lacks: O(1)."""
        if stream not in self.dirty:
            return None
        self.dirty.discard(stream)
        return merge_changed(self.host, self.streams[stream], None)

    def sync_event(self, event) -> bool:
        clock = self.events.get(event)
        if clock is None:
            return False
        merge_into(self.host, clock)
        return True

    def sync_device(self):
        """VC_H = max over every stream: only the dirty ones can add anything. The streams whose
        host entry grew (None: none)."""
        changed = None
        streams = self.streams
        for stream in self.dirty:
            changed = merge_changed(self.host, streams[stream], changed)
        self.dirty.clear()
        return changed

    def snapshot(self, stream) -> Clock:
        """A copy of what `stream` knows now, beyond the host (for coll_done and free_done)."""
        clock = self.streams.get(stream)
        return dict(clock) if clock else {}

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
