"""The writer's time flush and fork handling, for TraceWriter (writer.py): a daemon thread
(`hazsan-flush`) flushes what is buffered every flush_seconds, so a process whose events are rare
still has them on disk; it is stopped before a fork (no thread is copied into the child, none runs
while the fork happens) and started again in both processes, the child with a file of its own."""
from __future__ import annotations

import os
import select
import threading
import time

from sanitizer.trace import binary as B
from sanitizer.trace.trace_file import _NO_FACTS, MIN_FLUSH_SECONDS


class TimeFlush:
    """TraceWriter's start, time flush and fork handling (a mixin: it shares the writer's state)."""

    def start(self, open_file: bool = True) -> None:
        """Capture started: the file and its header are written now, before any event is
        buffered (`open_file` false: at open_now(), capture's first hook, or the first flush), and
        the time flush starts. Never raises: a file that cannot be made now is tried again at the
        next flush, which counts and reports the failure."""
        try:
            with self._lock:
                self._started = True
            if open_file:
                self.open_now()
            self._start_timer()
            if not self._fork_hooks:
                self._fork_hooks = True
                os.register_at_fork(before=self._before_fork, after_in_parent=self._after_fork_in_parent)
        except Exception as exc:
            self.hook_failed("writer.start", exc)

    def open_now(self) -> None:
        """Make the file and write its header now, if not yet made (never raises)."""
        try:
            with self._lock:
                if self._fd is None and not self.closed:
                    try:
                        self._open(facts=False)
                    except Exception:
                        pass
        except Exception as exc:
            self.hook_failed("writer.start", exc)

    def _start_timer(self) -> None:
        if self.closed or (self._timer is not None and self._timer.is_alive()):
            return
        stop, kick = threading.Event(), Kick()
        timer = threading.Thread(target=self._run_timer, args=(stop, kick), name="hazsan-flush", daemon=True)
        self._timer, self._timer_stop, self._timer_kick = timer, stop, kick
        timer.start()

    def _stop_timer(self, join: float = 0.0) -> None:
        timer, stop, kick = self._timer, self._timer_stop, self._timer_kick
        self._timer = self._timer_stop = self._timer_kick = None
        if stop is not None:
            stop.set()
        if kick is not None:
            kick.set()
        if join and timer is not None and timer.is_alive() and timer is not threading.current_thread():
            timer.join(join)

    def _run_timer(self, stop: threading.Event, kick: "Kick") -> None:
        """The time flush: wake every flush_seconds after the last flush, write what is buffered.

        In a program that marks step ends and is not quiet, it also finds out whether the last
        step ended idle_seconds ago with none started since, and then settles (_settle:
        everything written, quiet, each later event written as it comes); with a source of its
        own (the native recorder), whether records made outside Python wait while the file is
        quiet. Where the source can watch for that itself without the GIL (the native recorder's
        idle watch, which writes to `kick` only when there is something to do), this thread
        sleeps a flush period. Else it looks itself, and each look takes the GIL from the
        program's thread: every idle_seconds / 2 at first, and twice as long after each look that
        finds steps still running, up to 4 x idle_seconds (a busy server: 5 wake-ups a second
        instead of 40), back to idle_seconds / 2 once it finds none; so the file is quiet
        idle_seconds to 5 x idle_seconds after the last step. Only a step that ends while this
        thread sleeps long (before the first step end, or quiet since the last) wakes it
        (`kick`, mark_step)."""
        period = max(self.flush_seconds, MIN_FLUSH_SECONDS)
        base = look = max(self.idle_seconds / 2, 0.005)
        busy = max(base, min(4 * self.idle_seconds, period))   # the longest look while steps run
        ended_at = None     # the last step end a look saw
        wait = period
        watched = None      # the source watching for idleness (tried once per source)
        tried = None
        try:
            while True:
                self._timer_long = wait > busy and watched is None
                kick.wait(wait)
                if stop.is_set():
                    return
                try:
                    if self.closed:
                        return
                    now = time.monotonic()
                    source = self.source
                    if source is not None and source is not tried:
                        tried = source
                        watch = getattr(source, "watch_idle", None)
                        if watch is not None:
                            if watched is not None:
                                watched.watch_stop()
                                watched = None
                            try:
                                if watch(kick.w, base, self.idle_seconds):
                                    watched = source
                            except Exception as exc:   # the Python looks below instead
                                self.hook_failed("writer.idle_watch", exc)
                    if self._quiet and source is not None and source.pending():
                        # records made outside Python while the file said it was complete: written
                        # through while idle between steps (emit_many), else the header takes it back
                        source.drain_before_flush()
                    if not self._quiet and self._idle_between_steps(now):
                        self._settle()
                    left = self._last_flush + period - now
                    if left <= 0.001:
                        if self._buf or self._dropped or self._hook_errors or (source is not None and source.pending()):
                            self.flush()
                        self._settle()
                        left = period
                    wait = left               # flushed meanwhile (a step, a full buffer): the rest
                    if watched is None and ((self.step_ends and not self._quiet) or source is not None):
                        end = self._step_end_at
                        if self.step_ends and not self._quiet and end != ended_at:
                            look = min(look * 2, busy)     # steps ran since the last look
                        else:
                            look = base
                        ended_at = end
                        wait = min(wait, look)
                except Exception:             # never raise, not even at interpreter exit
                    wait = period
        finally:
            try:
                if watched is not None:
                    watched.watch_stop()      # its thread joined before the pipe it writes to closes
            except Exception:
                pass
            kick.close()

    def _before_fork(self) -> None:
        """No thread of ours may run while the process forks (the child would inherit the
        writer's lock held): stop it; both processes start it again."""
        try:
            self._was_timed = self._timer is not None
            self._stop_timer(join=1.0)
        except Exception:
            pass

    def _after_fork_in_parent(self) -> None:
        try:
            if getattr(self, "_was_timed", False) and self._started and not self.closed:
                self._start_timer()
        except Exception:
            pass

    def discard_after_fork(self, start: bool = True) -> None:
        """In a forked child: forget the parent's buffer and file (they belong to the parent). A
        started writer then starts again, its own file and header at once and its time flush
        (threads do not survive a fork); `start=False` leaves that to the first flush."""
        had_file = self._fd is not None   # the parent's: the child of a process with a file makes its own at once
        self._lock = threading.RLock()
        self._buf_lock = threading.RLock()
        self._count_lock = threading.RLock()
        self._deferred = []
        self.progress = {"quiet": False}
        self._quiet = self._through = False
        self._flush_thread = None
        self._buf = []
        self._buf_runs = self._buf_extra = 0
        self._end_unwritten = None
        self._fd = None
        self.path = None
        self._written = 0
        self._in_file = 0
        self._dropped = 0
        self._hook_errors = {}
        self.closed = False
        self._closing = False
        self._last_record = 0.0
        self._last_flush = time.monotonic()
        self._header_len = 0
        self._header_state = _NO_FACTS
        self._values = B.ValueTable()
        self._timer = self._timer_stop = self._timer_kick = None
        self._timer_long = False
        env_rank = _env_int("RANK", _env_int("LOCAL_RANK"))
        self.rank = env_rank
        self.world_size = None
        if start and self._started:
            self.start(open_file=had_file)


def _env_int(name: str, default: int | None = None) -> int | None:
    v = os.environ.get(name)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        return default


class Kick:
    """What the time flush sleeps on: a pipe, so that a thread without the GIL (the native
    recorder's idle watch) can wake it as well as Python can (`set`). Closed by the time flush's
    thread when it ends; a `set` after that does nothing (never a write to a reused descriptor)."""

    def __init__(self):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)      # a full pipe wakes the reader already
        self._lock = threading.RLock()      # (re-entered by a signal handler that closes the trace)
        self._poll = select.poll()          # (select.select refuses descriptors past 1023)
        self._poll.register(self.r, select.POLLIN)
        self.closed = False

    def set(self) -> None:
        with self._lock:
            if not self.closed:
                try:
                    os.write(self.w, b"k")
                except OSError:
                    pass

    def wait(self, timeout: float) -> None:
        """Sleep until woken or `timeout` s passed; then forget every wake-up so far."""
        try:
            self._poll.poll(max(timeout, 0.0) * 1000.0)
        except InterruptedError:
            pass
        try:
            while os.read(self.r, 4096):
                pass
        except OSError:          # BlockingIOError: drained
            pass

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                for fd in (self.r, self.w):
                    try:
                        os.close(fd)
                    except OSError:
                        pass
