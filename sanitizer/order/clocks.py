"""Vector clocks per stream, host and recorded event (DESIGN.md section 3).

As in ThreadSanitizer and torch.cuda._sanitizer: every stream S has a clock VC_S, the host VC_H,
every recorded event E a copy VC_E. A clock is a dict {stream: count}; a missing key means 0.

- enqueue on S:      VC_S = max(VC_S, VC_H); VC_S[S] += 1; the op's epoch is (S, VC_S[S])
- record E on S:     VC_E = max(VC_S, VC_H)
- wait S on E:       VC_S = max(VC_S, VC_E)
- sync stream S:     VC_H = max(VC_H, VC_S)    (event E: VC_H = max(VC_H, VC_E); bare: all streams)
- coll_done C:       VC_H = max(VC_H, clock of C)
- op O is locally complete for stream X when max(VC_X, VC_H)[O.stream] >= O's epoch.
"""
from __future__ import annotations

Clock = dict


def merge_into(target: Clock, other: Clock) -> bool:
    """target = max(target, other); True when target changed."""
    changed = False
    for key, value in other.items():
        if value > target.get(key, 0):
            target[key] = value
            changed = True
    return changed


class StreamClocks:
    """The ordering state of one rank. Knows nothing of memory; the engine asks it questions."""

    __slots__ = ("streams", "host", "events", "host_version", "_merged_version")

    def __init__(self) -> None:
        self.streams: dict[object, Clock] = {}
        self.host: Clock = {}
        self.events: dict[object, Clock] = {}
        # The host clock only grows; a stream that already merged this version skips the merge.
        self.host_version = 0
        self._merged_version: dict[object, int] = {}

    def stream_clock(self, stream) -> Clock:
        clock = self.streams.get(stream)
        if clock is None:
            clock = self.streams[stream] = {}
            self._merged_version[stream] = -1
        return clock

    def enqueue(self, stream) -> int:
        """Work enqueued on `stream`; returns its epoch (the op's own component)."""
        clock = self.streams.get(stream)
        if clock is None:
            clock = self.stream_clock(stream)
        if self._merged_version[stream] != self.host_version:
            merge_into(clock, self.host)
            self._merged_version[stream] = self.host_version
        epoch = clock.get(stream, 0) + 1
        clock[stream] = epoch
        return epoch

    def record(self, event, stream) -> None:
        clock = dict(self.stream_clock(stream))
        merge_into(clock, self.host)
        self.events[event] = clock

    def wait(self, stream, event) -> bool:
        """False when the event was never recorded (CUDA treats that wait as a no-op)."""
        clock = self.events.get(event)
        if clock is None:
            return False
        merge_into(self.stream_clock(stream), clock)
        return True

    def host_learns(self, clock: Clock) -> None:
        if merge_into(self.host, clock):
            self.host_version += 1

    def sync_stream(self, stream) -> None:
        self.host_learns(self.stream_clock(stream))

    def sync_event(self, event) -> bool:
        clock = self.events.get(event)
        if clock is None:
            return False
        self.host_learns(clock)
        return True

    def sync_device(self) -> None:
        for clock in list(self.streams.values()):
            self.host_learns(clock)

    def snapshot(self, stream) -> Clock:
        """A copy of what `stream` knows now (for coll_done and free_done)."""
        clock = dict(self.stream_clock(stream))
        merge_into(clock, self.host)
        return clock

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
