"""Trace writer: one schema-1 trace file per process (docs/trace-format.md; docs/capture.md, "Files").

Two formats: binary (the default: length-prefixed frames of msgpack arrays, sanitizer.trace.binary,
`rank<R>.hzs`) and JSON Lines (`rank<R>.jsonl`); `HAZSAN_TRACE_FORMAT=jsonl` (or
`TraceWriter(trace_format="jsonl")`) chooses the latter. Everything below holds for both: a "line"
is a binary frame there, the header line the header frame.

Where each part lives: this module buffers, flushes, counts drops and closes; trace_file.py
names the file and writes its header (and rewrites it); flush_timer.py runs the time flush and
handles forks. TraceWriter is the one class, made of those three.

Events are buffered as dicts, or, for capture's hot kinds, as the binary layout's arrays
(binary.source_item; tuples, which the garbage collector stops tracking), and serialised at flush time (orjson, or msgspec's msgpack encoder), so the
hot path is one list append. A flush writes whole lines (frames) with os.write on an
O_APPEND descriptor: a process killed with SIGKILL leaves every line of every completed flush, and
at worst one cut-short last line (which the reader treats as "trace truncated", a warning).

Bounds (memory and disk):
  * the buffer holds at most ``buffer_events`` events; reaching it triggers a flush, not a drop;
  * a file receives at most ``max_events`` events; beyond that events are dropped and counted;
  * a failing write (disk full, ...) drops that batch and counts it.
Every drop is written into the trace as ``{"ev": "dropped", "count": N, "reason": ...}`` (N is the
number dropped since the previous such record) so that every report says findings may be missing.
Hook failures are likewise written as ``{"ev": "hook_error", "hook": name, "count": N, "error": ...}``.

Failing safe: a write that fails (disk full, folder unwritable) drops and counts, and the next write
that succeeds records the count; a trace folder removed while the process runs is made again at
the next flush, its file starting with a ``dropped`` record for the events the removed file held.
The header says ``"end_record": true`` and a clean close writes ``{"ev": "end", ...}`` as the last
line, so a trace without it (a killed process, a disk that stayed full) is reported as truncated.
Folders and files are created owner-only (0700 / 0600): traces hold addresses and call sites.

Nothing lost (``start()``, what capture calls when it starts): the file and its header line are
written at once, before any event is buffered, so a process killed before its first flush still
leaves a file (header only, no end record: reported as truncated). The header line is padded with
spaces to ``HEADER_ROOM`` bytes, so that the facts known later (what was hooked, versions; the
``header_source``) are written over it in place (``pwrite``) at the first flush, whenever
``header_key()`` changes, and at close; a header that outgrows its room is rewritten with a copy
of the file. A daemon thread (``hazsan-flush``) waits on an Event and flushes a non-empty buffer
every ``flush_seconds``, so a process whose events are rare still has them on disk: emit() does
no clock reads. The thread is stopped before a fork (no thread is copied into the child, none runs
while the fork happens) and started again in both processes. A writer whose process recorded
nothing and must leave no file (``write_empty`` false) removes its header-only file at close.
Capture starts its writer with ``open_file=False`` and makes the file (``open_now()``) when torch is
imported: a process that never records anything leaves none, even killed.

What a killed process proves (sanitizer/trace/progress.py reads it): the header's ``progress`` is
rewritten in place whenever it changes. ``quiet``: every event recorded is in the file (set by the
time flush when nothing is left to write; taken back, header first, before the next event is
buffered; between steps of a program that marks their ends, ``idle_seconds`` after the last one
ended with no step started, each event is written as it comes instead). ``step``/``step_ended``: the last step and
whether it ended (only where ends are marked: the start must reach the header before its events,
the end only after them, at the step's end when the last flush is ``step_flush_seconds`` old, else
with the next flush: ``end_step``). Where only the progress changed, just its bytes are written
over the old ones (TraceFile._write_progress_in_place).
``signal``: a terminating signal the program's handler took. Signal handlers that interrupt the
writer (Python runs them between any two bytecodes) are deferred until it is left
(``when_outside``).

Threads: each event is the issuing host thread's (docs/trace-format.md, `thread`). An event
appended by another thread than the last one's is preceded by ``{"ev": "thread", "thread": K}``,
K its ``threading.get_ident()``, 0 for the process's main thread (the current one where a file
starts); the cost is one get_ident() and a compare per event. ``emit_on`` and ``emit_many``'s
``thread`` append events another thread issued (the native recorder's records, drained by
whichever thread drains them). A file that starts, or a batch whose predecessor was cut or lost,
begins with the switch to the thread its first event belongs to.

File naming: ``rank<R>.jsonl`` once the rank is known (torch.distributed, else RANK / LOCAL_RANK),
else ``pid<PID>.jsonl`` with header rank ``-PID`` (a process without a distributed rank; distinct
from every real rank and from other such processes). Files are created with O_EXCL; a name already
taken (two processes claiming one rank) becomes ``rank<R>.pid<PID>.jsonl``, then
``...pid<PID>.<n>.jsonl`` (a process that started a second file in one folder: the pytest plugin's
idle folder). A taken name whose file holds only a header of this very pid is the trace of this
process before an exec (exec runs no exit handler): it is taken over. When the rank becomes known
after the file was opened under its pid name, the file is rewritten once under the rank name with
the right header.
"""
from __future__ import annotations

import os
import threading
import time

import orjson

from sanitizer.trace import binary as B
from sanitizer.trace.flush_timer import TimeFlush, _env_int
from sanitizer.trace.trace_file import _NO_FACTS, HEADER_ROOM, MIN_FLUSH_SECONDS, MIN_IDLE_SECONDS, TraceFile, _write_all

__all__ = ["DEFAULT_FORMAT", "FORMATS", "FORMAT_ENV", "HEADER_ROOM", "MIN_FLUSH_SECONDS", "SUFFIX",
           "TraceWriter", "default_format"]

#: HAZSAN_TRACE_FORMAT: what capture writes.
FORMAT_ENV = "HAZSAN_TRACE_FORMAT"
FORMATS = ("binary", "jsonl")
DEFAULT_FORMAT = "binary"
SUFFIX = {"binary": ".hzs", "jsonl": ".jsonl"}


def default_format(environ=os.environ) -> str:
    """The format HAZSAN_TRACE_FORMAT asks for (binary when unset or not understood)."""
    value = (environ.get(FORMAT_ENV) or "").strip().lower()
    return value if value in FORMATS else DEFAULT_FORMAT


_ENCODE_SLICE = 1024
_PLAIN = B.PLAIN_TYPES
_CAPPED_RECORD_SECONDS = 60.0
#: how long close() waits for the time flush to return (it is woken: normally well under 1 ms)
CLOSE_JOIN_SECONDS = 1.0


class TraceWriter(TraceFile, TimeFlush):
    """Buffered writer for one process's trace. Thread-safe; never raises from emit()."""

    def __init__(self, directory: str, *, max_events: int = 20_000_000, buffer_events: int = 65_536,
                 flush_seconds: float = 2.0, header_extra: dict | None = None,
                 trace_format: str | None = None, idle_seconds: float = 0.05,
                 step_flush_seconds: float = 0.05):
        self.directory = directory
        self.format = trace_format or default_format()
        if self.format not in FORMATS:
            raise ValueError(f"trace_format must be one of {', '.join(FORMATS)}, got {self.format!r}")
        self.suffix = SUFFIX[self.format]
        self.max_events = max_events
        self.buffer_events = max(1, buffer_events)
        self.flush_seconds = flush_seconds
        # a program that marks step ends is idle this long after one with no step started: quiet
        self.idle_seconds = max(idle_seconds, MIN_IDLE_SECONDS)
        # a step's end flushes when the last flush is this old (end_step); 0: every step
        self.step_flush_seconds = max(step_flush_seconds, 0.0)
        self.header_extra = dict(header_extra or {})
        self.header_source = None   # callable -> dict of more header keys, asked when the header is written
        self.header_key = None      # callable -> hashable; the header is written again when it changes
        # events recorded outside Python and buffered there (capture's native recorder): an object
        # with pending() -> int and drain_before_flush(), drained before each flush and before the
        # header may say that everything recorded is in the file
        self.source = None
        self.write_empty = True     # close() keeps a header-only file (false: a header-only file is removed)
        self.rank: int | None = None
        self.world_size: int | None = None
        self.device = "cpu"
        self.path: str | None = None
        self._fd: int | None = None
        self._buf: list = []
        # packed runs in the buffer (binary.is_packed: the native recorder's plain records, kept
        # as structs until the flush encodes them), and the events they hold beyond one entry each
        self._buf_runs = 0
        self._buf_extra = 0
        # Host threads (docs/trace-format.md, `thread`): the thread (threading.get_ident()) that
        # issued the last event buffered, the one current at the buffer's start, and the one
        # current at the end of what the file holds (None: not known, a batch was cut or lost)
        self._main = threading.main_thread().ident
        self._thread = self._buf_thread = self._file_thread = self._main
        self._lock = threading.RLock()      # file state; flush may re-enter (GC during a flush)
        self._buf_lock = threading.RLock()  # the buffer append/swap only
        self._count_lock = threading.RLock() # drop and hook-error counts: hooks add, a flush (any thread) takes
        # (thread ident, action): what a signal handler asked for while its thread was inside the
        # writer or one of its guards; run by that thread alone, as it leaves (_run_deferred)
        self._deferred: list = []
        # other capture locks (RLocks) that a signal handler's flush or close would take again: a
        # thread holding one counts as inside the writer (guard())
        self._guards: list = []
        # What the header says about the file's progress (docs/trace-format.md, "progress"): whether
        # everything recorded is in the file (`quiet`), the last step and whether it ended, a
        # termination signal received. Rewritten in place when it changes.
        self.progress: dict = {"quiet": False}
        self._quiet = False          # every event recorded so far is in the file; the header says so
        self._through = False        # (quiet) idle between steps: each event is written as it comes
        self._hdr = None             # (descriptor, path, header descriptor, pid): TraceFile._header_fd
        self._progress_at = None     # (header descriptor, offset, length) of progress on disk: TraceFile
        self.step_ends = False       # the program marks where its steps end (progress says so then)
        self._step_end_at = 0.0      # monotonic time the last step ended
        self._end_unwritten = None   # the step that ended last, its end not yet flushed (end_step)
        self._flush_thread = None    # ident of the thread inside flush() (a GC free there must not re-enter)
        self._written = 0            # events accepted into the file (header excluded)
        self._dropped = 0            # dropped since the last `dropped` record
        self._drop_reason = None
        self.dropped_total = 0
        self._hook_errors: dict[str, list] = {}   # hook -> [count since last record, last error]
        self._in_file = 0            # events in the current file (lost with it if it is removed)
        self._warned = False         # one line on stderr the first time the trace cannot be written
        self._closing = False
        self._last_record = 0.0      # when counts were last written (rate-limited past max_events)
        self._last_flush = time.monotonic()
        self._header_len = 0         # bytes of the header line on disk (padded): 0 before the file exists
        self._header_state = _NO_FACTS   # header_key() when the facts were written; _NO_FACTS: not yet
        # binary: the current file's value tables (binary.ValueTable: its call sites, ops, shapes
        # written once, then referred to by index); a new file starts its own
        self._values = B.ValueTable()
        self._facts_cache = None     # (header_key(), header_source()'s dict): a rotation asks it again only on a change
        self._next_suffix: dict = {} # (folder, stem) -> the next n of `stem.<n>.jsonl` to try there
        self._timer = None           # the time-flush thread, once start() ran
        self._timer_stop = None      # its Event
        self._timer_kick = None      # the Kick it sleeps on: set to wake it (stop, a step ended)
        self._timer_long = False     # it sleeps for a flush period, not the idle look (flush_timer)
        self._started = False
        self._fork_hooks = False
        self.closed = False
        env_rank = _env_int("RANK", _env_int("LOCAL_RANK"))
        if env_rank is not None:
            self.rank = env_rank
            self.world_size = _env_int("WORLD_SIZE", _env_int("LOCAL_WORLD_SIZE"))

    # ------------------------------------------------------------------ hot path
    def emit(self, ev: dict) -> None:
        """Queue one event. Flushes when the buffer is full; the time flush is the timer thread's.

        Called from any thread (frees arrive on whichever thread drops a storage): the append and
        the swap in flush() share a lock, so no event can land in a batch already written. An
        event from another thread than the last one's is preceded by a `thread` event (host
        threads: the module's docstring, "Threads")."""
        me = _get_ident()
        with self._buf_lock:
            if self._quiet:
                n = -1
            else:
                buf = self._buf
                if me != self._thread:
                    buf.append(self._switch(me))
                buf.append(ev)
                n = len(buf)
        if n < 0:             # the header says nothing is missing
            if self._through and self._write_through(ev, thread=me):
                return
            self._wake()      # say otherwise before buffering
            self.emit_on(ev, me)
            return
        self._queued(n)

    def emit_on(self, ev: dict, thread: int) -> None:
        """emit(), for an event that host thread `thread` (its threading.get_ident()) issued, not
        the calling one (the native recorder's records, turned into events by whichever thread
        drains them)."""
        with self._buf_lock:
            if self._quiet:
                n = -1
            else:
                buf = self._buf
                if thread != self._thread:
                    buf.append(self._switch(thread))
                buf.append(ev)
                n = len(buf)
        if n < 0:
            if self._through and self._write_through(ev, thread=thread):
                return
            self._wake()
            self.emit_on(ev, thread)
            return
        self._queued(n)

    def _switch(self, thread: int) -> dict:
        """(with _buf_lock) The `thread` event that makes `thread` the current one: the process's
        main thread is 0."""
        self._thread = thread
        return {"ev": "thread", "thread": 0 if thread == self._main else thread}

    def _queued(self, n: int) -> None:
        """After an append that left `n` events buffered."""
        if n >= self.buffer_events and self._flush_thread != threading.get_ident():
            self.flush()      # (on the flushing thread itself: a free fired by GC inside flush(), next time)
        if self._deferred:
            self._run_deferred()

    def emit_many(self, evs, thread: int | None = None) -> None:
        """Queue events in order, one lock for all (the native recorder's batches): a list, or a
        packed run (binary.is_packed), which stays one entry until the flush encodes it. `thread`:
        the host thread that issued them (threading.get_ident()), when not the calling one."""
        if thread is None:
            thread = _get_ident()
        with self._buf_lock:
            if self._quiet:
                n = -1
            else:
                n = self._append_many(evs, thread)
        if n < 0:             # the header says nothing is missing
            if self._through and self._write_through(evs, many=True, thread=thread):
                return        # idle between steps: the batch written at once, still quiet
            self._wake()
            self.emit_many(evs, thread)
            return
        self._queued(n)

    def _append_many(self, evs, thread: int) -> int:
        """(with _buf_lock) Append events to the buffer; the number of events it holds now."""
        buf = self._buf
        if thread != self._thread:
            buf.append(self._switch(thread))
        if type(evs) is list:
            buf.extend(evs)
        elif len(evs):
            buf.append(evs)
            self._buf_runs += 1
            self._buf_extra += len(evs) - 1
        return len(buf) + self._buf_extra

    def hook_failed(self, hook: str, exc: BaseException) -> None:
        """Count a caught hook failure; written into the trace at the next flush."""
        text = f"{type(exc).__name__}: {exc}"[:300]
        if self._quiet:
            self._wake()
        with self._count_lock:
            entry = self._hook_errors.get(hook)
            if entry is None:
                self._hook_errors[hook] = [1, text]
            else:
                entry[0] += 1
                entry[1] = text
        if self._deferred:
            self._run_deferred()

    def count_drop(self, n: int, reason: str) -> None:
        if self._quiet:
            self._wake()
        with self._count_lock:
            self._dropped += n
            self.dropped_total += n
            self._drop_reason = reason
        if self._deferred:
            self._run_deferred()

    # ------------------------------------------------------------------ progress (what a killed process proves)
    def _wake(self) -> None:
        """Leave the quiet state: the header stops saying that nothing is missing before the
        event that ends it is buffered (the header first: a kill in between loses nothing that
        the header vouches for)."""
        with self._lock:
            if not self._quiet:
                return
            self.progress["quiet"] = False
            self._write_progress()
            with self._buf_lock:
                self._quiet = self._through = False

    def _write_through(self, ev, many: bool = False, thread: int | None = None) -> bool:
        """Idle between steps (see _settle): write `ev` now (`many`: the events of list `ev`), so
        that the file keeps holding every event recorded. False when that cannot be done here (the
        mode ended meanwhile; this thread is inside a flush, a GC finalizer): the caller buffers it
        the usual way."""
        with self._lock:
            if not (self._quiet and self._through) or self._flush_thread == threading.get_ident():
                return False
            with self._buf_lock:
                if thread is None:
                    thread = _get_ident()
                if many:
                    self._append_many(ev, thread)
                else:
                    if thread != self._thread:
                        self._buf.append(self._switch(thread))
                    self._buf.append(ev)
            self.flush(drain_source=False)   # a failed write counts a drop, which ends the quiet state
        if self._deferred:
            self._run_deferred()
        return True

    def _settle(self) -> bool:
        """The time flush found everything written: say so in the header (`quiet`), so that a
        process killed now (SGLang's Engine.shutdown SIGKILLs its schedulers) is known to have
        lost nothing. Any later event, drop or hook error first takes it back (_wake).

        A program between steps for `idle_seconds` (its last step ended, no step started since;
        the time flush looks that soon, _run_timer) may still record events, an idle server's
        polling (SGLang's TP ranks broadcast the requests they receive, none, every loop): it is
        made quiet anyway, everything buffered written first, and each event after that is written
        as it is recorded, until the next step starts (mark_step) or a write fails. So a server
        killed as soon as its last request is answered (SGLang's Engine.shutdown SIGKILLs its
        schedulers) has lost nothing, not only one idle for a flush period."""
        source = self.source
        if source is not None and source.pending():
            self.flush()
        with self._lock:
            if self._quiet or self.closed or self._fd is None:
                return False
            idle = self._idle_between_steps(time.monotonic())
            with self._buf_lock:
                if idle:    # appends wait meanwhile: an idle loop's events cannot slip in between
                    self.flush(drain_source=False)    # (drained above: its lock is taken before ours)
                if self._buf or self._dropped or self._hook_errors or (source is not None and source.pending()):
                    return False
                self._quiet = True
                self._through = idle
            self.progress["quiet"] = True
            self._write_progress()
            if not self._quiet:           # woken inside (a GC finalizer on this thread): say so again
                self.progress["quiet"] = False
                self._write_progress()
            return True

    def _idle_between_steps(self, now: float) -> bool:
        """A program that marks step ends, its last step ended `idle_seconds` ago or more and no
        step started since."""
        return (self.step_ends and (self._end_unwritten is not None or self.progress.get("step_ended") is True)
                and now - self._step_end_at >= self.idle_seconds)

    def _write_progress(self) -> None:
        if self._fd is not None:
            try:
                if self._write_progress_in_place():
                    return
            except Exception as exc:
                self.hook_failed("writer.header", exc)
            self._refresh_header()

    def end_step(self, n: int) -> None:
        """Step `n` ended: its events are flushed and the header says it ended, at once when the
        last flush is `step_flush_seconds` old or more, else with the next flush (a later step's
        end, the time flush, idleness, a signal, close). Until then the header goes on saying
        that step `n` runs, so it never claims more than the file holds: a process killed in
        between is reported killed during step `n`, with what it recorded since its last flush
        possibly missing. Steps of a few milliseconds (a host-bound decode) then pay a flush and
        a header write every `step_flush_seconds`, not each (most of what capture adds to them)."""
        if time.monotonic() - self._last_flush >= self.step_flush_seconds:
            self.flush()
            self.mark_step(n, ended=True)
        else:
            self.mark_step(n, ended=True, flushed=False)

    def mark_step(self, n: int, ended: bool, flushed: bool = True) -> None:
        """Step `n` starts (`ended` false: before its first event is buffered) or ended (after
        its events were flushed; `flushed` false: they are not yet, and the next flush says that
        it ended). Only a program that marks ends (SGLang's and vLLM's step hooks) has the header
        say which: the start of a step must reach the header before its events, so that a kill
        during it is never read as "after its last step"."""
        # the native recorder's idle watch times the step ends too: told of a start first, of an
        # end after _step_end_at is set, so that its idle moment is never before this one's
        marked = getattr(self.source, "step_marked", None)
        if marked is not None and not ended:
            self._tell_source(marked, False)
        try:
            self._mark_step(n, ended, flushed)
        finally:
            if marked is not None and ended:
                self._tell_source(marked, True)
        if self._deferred:
            self._run_deferred()

    def _tell_source(self, marked, ended: bool) -> None:
        try:
            marked(ended)
        except Exception as exc:
            self.hook_failed("writer.source", exc)

    def _mark_step(self, n: int, ended: bool, flushed: bool = True) -> None:
        with self._lock:
            if ended:
                self.step_ends = True
                self._step_end_at = time.monotonic()
                kick = self._timer_kick
                if self._timer_long and kick is not None:   # asleep for a flush period: look sooner
                    kick.set()
                if not flushed:
                    self._end_unwritten = int(n)
                    return
            if not self.step_ends:
                return
            self._end_unwritten = None
            self.progress.update(step=int(n), step_ended=bool(ended))
            if not ended and self._quiet:     # the step's events are buffered again
                self.progress["quiet"] = False
                self._write_progress()
                with self._buf_lock:
                    self._quiet = self._through = False
            else:
                self._write_progress()

    def note_signal(self, name: str) -> None:
        """A termination signal arrived and the program handles it: flush, and let the header say
        when, so that a kill during the shutdown that follows (vLLM: SIGKILL 5 s after SIGTERM) is
        named as such."""
        source = self.source
        if source is not None:       # before our lock, as flush() does
            try:
                source.drain_before_flush()
            except Exception as exc:
                self.hook_failed("writer.source", exc)
        with self._lock:
            self.progress.update(signal=name, signal_t=time.time_ns())
            self.flush()
            if not self._settle():        # nothing left to write: quiet too (one header write)
                self._write_progress()
        if self._deferred:
            self._run_deferred()

    # ------------------------------------------------------------------ signal handlers
    def when_outside(self, fn) -> None:
        """Run `fn` now, or, when this thread is inside the writer or one of its guards (a signal
        handler: Python runs them on the main thread between any two bytecodes, also in the middle
        of a flush, an append or a drain of the allocator history), as soon as it leaves: a flush
        nested there would write events out of order or lose the batch being appended to, and a
        close nested in a drain would wait for the drain's own lock for ever."""
        if self._inside():
            self._deferred.append((threading.get_ident(), fn))
        else:
            fn()

    def guard(self, lock) -> None:
        """Make `lock` (an RLock) one of the writer's guards: a signal handler that arrives while
        its thread holds it is deferred until the lock is released, and the holder calls
        run_deferred() right after releasing it (the allocator history's drain, which close()
        runs again)."""
        self._guards.append(lock)

    def run_deferred(self) -> None:
        """What a signal handler deferred on this thread, now that it left a guard."""
        if self._deferred:
            self._run_deferred()

    def _inside(self) -> bool:
        if self._lock._is_owned() or self._buf_lock._is_owned() or self._count_lock._is_owned():
            return True
        for lock in self._guards:
            if lock._is_owned():
                return True
        return False

    def _run_deferred(self) -> None:
        # Only the thread that deferred an action runs it: the time flush, leaving a flush of its
        # own, must not close the trace under the main thread's interrupted drain, nor take a
        # default action that only the main thread may (signal.signal raises elsewhere).
        me = threading.get_ident()
        while self._deferred and not self._inside():
            for i, (tid, fn) in enumerate(self._deferred):
                if tid == me:
                    del self._deferred[i]
                    break
            else:
                return
            fn()

    # ------------------------------------------------------------------ identity
    def discard_after_fork(self, start: bool = True) -> None:
        """TimeFlush.discard_after_fork; the child's main thread is the one that forked (threading
        made it so before this runs), 0 in the child's trace."""
        self._main = threading.main_thread().ident
        self._thread = self._buf_thread = self._file_thread = self._main
        super().discard_after_fork(start)


    def _encode(self, part: list, packed: bool = False) -> bytes:
        if self.format == "binary":
            return B.encode_frames(part, self._values, packed)
        if packed:
            part = B.unpacked(part)
        # capture's hot kinds come as arrays (binary.source_item): their dicts are made here
        return b"".join([_dumps(ev if type(ev) is dict else B.to_dict(ev)) for ev in part])

    def _end_bytes(self) -> bytes:
        if self.format == "binary":
            return B.end_frame(self._written, self.dropped_total)
        return _dumps({"ev": "end", "events": self._written, "dropped": self.dropped_total})


    # ------------------------------------------------------------------ start and the time flush


    # ------------------------------------------------------------------ flushing
    def flush(self, drain_source: bool = True) -> None:
        """Write everything buffered as whole lines. Never raises."""
        source = self.source
        if source is not None and drain_source:       # outside the locks: the source emits, and orders its own lock first
            try:
                source.drain_before_flush()
            except Exception as exc:
                self.hook_failed("writer.source", exc)
        with self._lock:
            outer = self._flush_thread
            self._flush_thread = threading.get_ident()
            try:
                self._flush_locked()
                ended = self._end_unwritten
                if ended is not None and (drain_source or source is None or not source.pending()):
                    # the step that ended last (end_step) is in the file now, its records too
                    self._end_unwritten = None
                    self.progress.update(step=ended, step_ended=True)
                    self._write_progress()
            except Exception as exc:
                try:
                    self.hook_failed("writer.flush", exc)
                except Exception:
                    pass
            finally:
                self._flush_thread = outer
        if self._deferred:
            self._run_deferred()

    def _flush_locked(self) -> None:
        self._last_flush = time.monotonic()
        fresh = []                      # allocated outside the lock: an allocation may run GC,
        with self._buf_lock:            # whose storage finalizers emit (and take this lock)
            batch, self._buf = self._buf, fresh
            runs, extra = self._buf_runs, self._buf_extra
            self._buf_runs = self._buf_extra = 0
            first_thread, self._buf_thread = self._buf_thread, self._thread
        last_thread = self._buf_thread
        total = len(batch) + extra
        if self.closed:
            if total:
                self.count_drop(total, "after-close")
            return
        room = self.max_events - self._written
        if total > room:
            self.count_drop(total - max(room, 0), "max-events")
            if runs:
                batch, runs = B.unpacked(batch), 0
            batch = batch[:max(room, 0)]
            last_thread = first_thread    # the thread where the kept part ends
            for ev in batch:
                if type(ev) is dict and ev.get("ev") == "thread":
                    last_thread = self._main if ev["thread"] == 0 else ev["thread"]
        if room <= 0 and not self._closing and time.monotonic() - self._last_record < _CAPPED_RECORD_SECONDS:
            return  # past the cap, the counts go out once a minute and at close: the file stays bounded
        self._last_record = time.monotonic()
        try:
            if self._fd is not None and os.fstat(self._fd).st_nlink == 0:
                self._file_removed()   # before the records below, so that they count it
        except OSError:
            pass
        own = len(batch)                # the events recorded (what follows: the writer's counts)
        with self._count_lock:          # taken whole: a count added meanwhile goes to the next flush
            errors, self._hook_errors = self._hook_errors, {}
            dropped, self._dropped = self._dropped, 0
            reason = self._drop_reason
        for hook, (count, error) in errors.items():
            batch.append({"ev": "hook_error", "hook": hook, "count": count, "error": error})
        if dropped:
            batch.append({"ev": "dropped", "count": dropped, "reason": reason})
        if not batch:
            return
        done = 0
        try:
            if self._fd is None:
                self._open()
                self._file_thread = self._main     # a new file starts on the main thread
            elif self.header_source is not None and self._header_state != self._key():
                self._refresh_header()
            if own and first_thread != self._file_thread:
                # the file is not where the batch starts (a new file, a batch lost or cut)
                batch.insert(0, {"ev": "thread", "thread": 0 if first_thread == self._main else first_thread})
            self._file_thread = None       # known again once the whole batch is written
            # orjson's result keeps its ~4 KiB working buffer: holding a whole batch of them at
            # once would add ~270 MB to the host's peak RSS per 65k events. Slices keep it ~4 MB.
            encode = self._encode
            for i in range(0, len(batch), _ENCODE_SLICE):
                part = batch[i:i + _ENCODE_SLICE]
                n = len(part) if not runs else sum(1 if type(ev) in _PLAIN else len(ev) for ev in part)
                mark = self._values.mark()
                try:
                    _write_all(self._fd, encode(part, bool(runs)))
                except BaseException:
                    # values whose `V` frame did not reach the file are not in its table: a later
                    # event that has one writes it again
                    self._values.rollback(mark)
                    raise
                done += n
                self._written += n
                self._in_file += n
            self._file_thread = last_thread
        except Exception as exc:   # disk full, unserialisable field, directory gone
            count = len(batch) + (extra if runs else 0)
            self.count_drop(count - done, f"write-failed: {type(exc).__name__}")
            self.hook_failed("writer.flush", exc)
            self._warn(exc)

    def _file_removed(self) -> None:
        """The trace file was unlinked (its folder removed mid-run): what it held is lost. Count
        it (where it held events), and let the next _open make the folder and the file again."""
        lost = self._in_file
        self._close_header_fd()
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._fd = None
        self.path = None
        if lost:    # a file that held its header alone loses nothing: made again, nothing to count
            self.count_drop(lost, "trace-file-removed")
            self.hook_failed("writer.flush", FileNotFoundError(f"trace file removed while running ({lost} events lost)"))

    def _warn(self, exc: BaseException) -> None:
        if self._warned:
            return
        self._warned = True
        try:
            os.write(2, f"hazsan: cannot write the trace in {self.directory}: {type(exc).__name__}: {exc} "
                        "(the program runs on; lost events are counted)\n".encode(errors="replace"))
        except OSError:
            pass

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        # The time flush is joined, not only told to stop: at exit no thread of ours may still be
        # running when the interpreter finalizes. A daemon thread that wakes then is ended with
        # pthread_exit as it takes the GIL, and if that happens under a C++ frame (a torch call
        # that released the GIL, a destructor run by a collection) the process aborts with
        # "terminate called without an active exception" (pytorch#38228). Bounded: it is told to
        # stop and woken, so it returns at once unless it is inside a flush.
        self._stop_timer(join=CLOSE_JOIN_SECONDS)
        source = self.source
        if source is not None:       # before our lock, as flush() does
            try:
                source.drain_before_flush()
            except Exception as exc:
                self.hook_failed("writer.source", exc)
        with self._lock:
            if self.closed:
                return
            self._closing = True
            self.flush()
            if self._fd is None and self.write_empty:   # nothing recorded: the header says what was hooked
                try:
                    self._open()
                except Exception as exc:
                    self.hook_failed("writer.open", exc)
            self.closed = True
            self._finish_file(remove_empty=not self.write_empty)
        if self._deferred:
            self._run_deferred()

    def _finish_file(self, remove_empty: bool = False) -> None:
        """Close the current file: its header brought up to date, then the `end` record (unless
        drops or hook errors are still unrecorded). `remove_empty`: a file that holds nothing but
        its header is removed instead (a process that hooked nothing leaves no file)."""
        fd = self._fd
        if fd is None:
            return
        self._fd = None
        try:
            if remove_empty and self._in_file == 0 and not self._dropped and not self._hook_errors:
                try:
                    if self.path is not None and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                        os.unlink(self.path)
                except OSError:
                    pass
                self.path = None
                return
            self._fd = fd
            if self.header_source is not None and self._header_state != self._key():
                self._refresh_header()
            fd = self._fd                 # (a header rewritten with a copy is a new descriptor)
            if not self._dropped and not self._hook_errors and os.fstat(fd).st_nlink:
                # the last line of a complete trace; without it the reader says truncated
                _write_all(fd, self._end_bytes())
        except Exception:
            pass
        finally:
            self._fd = None
            self._close_header_fd()
            try:
                os.close(fd)
            except OSError:
                pass

    def reopen(self, directory: str, preamble: list | None = None) -> None:
        """Continue in a new file in `directory` (same rank and naming): what is buffered goes to
        the old file first, which is then ended with its `end` record (it is complete: the pytest
        plugin analyses it); the new file starts with `preamble` (events that re-declare the live
        state, so the new file reads on its own) and, once started, is made at once. Used by the
        pytest plugin: one trace per test."""
        with self._lock:
            self.flush()
            self._finish_file()
            self._file_thread = self._main     # the new file starts on the main thread
            with self._buf_lock:
                self._quiet = self._through = False   # the new file starts with what the preamble re-declares
                self.progress["quiet"] = False
                self.path = None
                self._written = 0
                self._in_file = 0
                self.directory = directory
                self.closed = False
                self._closing = False
                if preamble:
                    self._buf = list(preamble) + self._buf
            if self._started:
                try:
                    self._open()
                except Exception:
                    pass                  # tried again, counted and reported, at the next flush


_get_ident = threading.get_ident


def _dumps(ev: dict) -> bytes:
    return orjson.dumps(ev, option=orjson.OPT_APPEND_NEWLINE)
