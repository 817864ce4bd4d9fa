"""Trace writer: one schema-1 JSON Lines file per process (docs/trace-format.md; docs/capture.md, "Files").

Events are buffered as dicts and serialised with orjson at flush time, so the hot path is one
list append. A flush writes whole lines with os.write on an O_APPEND descriptor: a process killed
with SIGKILL leaves every line of every completed flush, and at worst one cut-short last line
(which the reader treats as "trace truncated", a warning).

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

File naming: ``rank<R>.jsonl`` once the rank is known (torch.distributed, else RANK / LOCAL_RANK),
else ``pid<PID>.jsonl`` with header rank ``-PID`` (a process without a distributed rank; distinct
from every real rank and from other such processes). Files are created with O_EXCL; a name already
taken (two processes claiming one rank) becomes ``rank<R>.pid<PID>.jsonl``. When the rank becomes
known after the file was opened under its pid name, the file is rewritten once under the rank name
with the right header.
"""
from __future__ import annotations

import os
import threading
import time

import orjson

from sanitizer.trace.schema import SCHEMA_VERSION


_ENCODE_SLICE = 1024
_CAPPED_RECORD_SECONDS = 60.0


class TraceWriter:
    """Buffered writer for one process's trace. Thread-safe; never raises from emit()."""

    def __init__(self, directory: str, *, max_events: int = 20_000_000, buffer_events: int = 65_536,
                 flush_seconds: float = 2.0, header_extra: dict | None = None):
        self.directory = directory
        self.max_events = max_events
        self.buffer_events = max(1, buffer_events)
        self.flush_seconds = flush_seconds
        self.header_extra = dict(header_extra or {})
        self.header_source = None   # callable -> dict of more header keys, asked when the header is written
        self.write_empty = True     # close() writes the header even when no event was recorded
        self.rank: int | None = None
        self.world_size: int | None = None
        self.device = "cpu"
        self.path: str | None = None
        self._fd: int | None = None
        self._buf: list = []
        self._lock = threading.RLock()      # file state; flush may re-enter (GC during a flush)
        self._buf_lock = threading.RLock()  # the buffer append/swap only
        self._flushing = False
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
        self._tick = 0
        self.closed = False
        env_rank = _env_int("RANK", _env_int("LOCAL_RANK"))
        if env_rank is not None:
            self.rank = env_rank
            self.world_size = _env_int("WORLD_SIZE", _env_int("LOCAL_WORLD_SIZE"))

    # ------------------------------------------------------------------ hot path
    def emit(self, ev: dict) -> None:
        """Queue one event. Flushes when the buffer is full or the flush interval passed.

        Called from any thread (frees arrive on whichever thread drops a storage): the append and
        the swap in flush() share a lock, so no event can land in a batch already written."""
        with self._buf_lock:
            buf = self._buf
            buf.append(ev)
            n = len(buf)
        if self._flushing:        # a free fired by GC inside flush() on this thread: next time
            return
        if n >= self.buffer_events:
            self.flush()
        else:
            self._tick += 1
            if self._tick >= 512:
                self._tick = 0
                if time.monotonic() - self._last_flush >= self.flush_seconds:
                    self.flush()

    def hook_failed(self, hook: str, exc: BaseException) -> None:
        """Count a caught hook failure; written into the trace at the next flush."""
        entry = self._hook_errors.get(hook)
        text = f"{type(exc).__name__}: {exc}"[:300]
        if entry is None:
            self._hook_errors[hook] = [1, text]
        else:
            entry[0] += 1
            entry[1] = text

    def count_drop(self, n: int, reason: str) -> None:
        self._dropped += n
        self.dropped_total += n
        self._drop_reason = reason

    # ------------------------------------------------------------------ identity
    def set_rank(self, rank: int, world_size: int | None = None, device: str | None = None) -> None:
        """The distributed rank became known: name (or rename) the file after it."""
        with self._lock:
            if device:
                self.device = device
            same = rank == self.rank and (world_size is None or world_size == self.world_size)
            self.rank, self.world_size = rank, world_size if world_size is not None else self.world_size
            if self._fd is None or same:
                return
            self._reopen_under_rank()

    def _header(self) -> bytes:
        rank = self.rank if self.rank is not None else -os.getpid()
        h = {"hazsan": SCHEMA_VERSION, "rank": rank, "world_size": self.world_size or 1,
             "device": self.device, "pid": os.getpid(), "end_record": True}
        h.update(self.header_extra)
        if self.header_source is not None:
            try:
                h.update(self.header_source())
            except Exception as exc:
                self.hook_failed("writer.header", exc)
        return orjson.dumps(h) + b"\n"

    def _open(self) -> None:
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        names = ([f"rank{self.rank}.jsonl", f"rank{self.rank}.pid{os.getpid()}.jsonl"]
                 if self.rank is not None else [f"pid{os.getpid()}.jsonl"])
        last_exc = None
        for name in names:
            path = os.path.join(self.directory, name)
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
            except FileExistsError as exc:
                last_exc = exc
                continue
            self._fd, self.path = fd, path
            self._in_file = 0
            _write_all(fd, self._header())
            return
        raise last_exc  # type: ignore[misc]

    def _reopen_under_rank(self) -> None:
        old_fd, old_path = self._fd, self.path
        self._fd = self.path = None
        try:
            os.close(old_fd)
            with open(old_path, "rb") as f:
                f.readline()                 # the old header
                body = f.read()
            self._open()
            _write_all(self._fd, body)
            self._in_file = self._written
            os.unlink(old_path)
        except OSError as exc:
            self.hook_failed("writer.rename", exc)
            if self._fd is None:   # keep writing where we were
                self._fd = os.open(old_path, os.O_WRONLY | os.O_APPEND)
                self.path = old_path

    # ------------------------------------------------------------------ flushing
    def flush(self) -> None:
        """Write everything buffered as whole lines. Never raises."""
        with self._lock:
            self._flushing = True
            try:
                self._flush_locked()
            finally:
                self._flushing = False

    def _flush_locked(self) -> None:
        self._last_flush = time.monotonic()
        fresh = []                      # allocated outside the lock: an allocation may run GC,
        with self._buf_lock:            # whose storage finalizers emit (and take this lock)
            batch, self._buf = self._buf, fresh
        if self.closed:
            if batch:
                self.count_drop(len(batch), "after-close")
            return
        room = self.max_events - self._written
        if len(batch) > room:
            self.count_drop(len(batch) - max(room, 0), "max-events")
            batch = batch[:max(room, 0)]
        if room <= 0 and not self._closing and time.monotonic() - self._last_record < _CAPPED_RECORD_SECONDS:
            return  # past the cap, the counts go out once a minute and at close: the file stays bounded
        self._last_record = time.monotonic()
        try:
            if self._fd is not None and os.fstat(self._fd).st_nlink == 0:
                self._file_removed()   # before the records below, so that they count it
        except OSError:
            pass
        if self._hook_errors:
            for hook, (count, error) in self._hook_errors.items():
                batch.append({"ev": "hook_error", "hook": hook, "count": count, "error": error})
            self._hook_errors = {}
        if self._dropped:
            batch.append({"ev": "dropped", "count": self._dropped, "reason": self._drop_reason})
            self._dropped = 0
        if not batch:
            return
        done = 0
        try:
            if self._fd is None:
                self._open()
            # orjson's result keeps its ~4 KiB working buffer: holding a whole batch of them at
            # once would add ~270 MB to the host's peak RSS per 65k events. Slices keep it ~4 MB.
            for i in range(0, len(batch), _ENCODE_SLICE):
                part = batch[i:i + _ENCODE_SLICE]
                _write_all(self._fd, b"".join([_dumps(ev) for ev in part]))
                done += len(part)
                self._written += len(part)
                self._in_file += len(part)
        except Exception as exc:   # disk full, unserialisable field, directory gone
            self.count_drop(len(batch) - done, f"write-failed: {type(exc).__name__}")
            self.hook_failed("writer.flush", exc)
            self._warn(exc)

    def _file_removed(self) -> None:
        """The trace file was unlinked (its folder removed mid-run): what it held is lost. Count
        it, and let the next _open make the folder and the file again."""
        lost = self._in_file
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._fd = None
        self.path = None
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

    def close(self) -> None:
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
            if self._fd is not None:
                try:
                    if not self._dropped and not self._hook_errors and os.fstat(self._fd).st_nlink:
                        # the last line of a complete trace; without it the reader says truncated
                        _write_all(self._fd, _dumps({"ev": "end", "events": self._written,
                                                     "dropped": self.dropped_total}))
                except Exception:
                    pass
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = None

    def reopen(self, directory: str, preamble: list | None = None) -> None:
        """Continue in a new file in `directory` (same rank and naming): what is buffered goes to
        the old file first; the new file starts with `preamble` (events that re-declare the live
        state, so the new file reads on its own). Used by the pytest plugin: one trace per test."""
        with self._lock:
            self.flush()
            with self._buf_lock:
                if self._fd is not None:
                    try:
                        os.close(self._fd)
                    except OSError:
                        pass
                self._fd = None
                self.path = None
                self._written = 0
                self.directory = directory
                self.closed = False
                if preamble:
                    self._buf = list(preamble) + self._buf

    def discard_after_fork(self) -> None:
        """In a forked child: forget the parent's buffer and file (they belong to the parent)."""
        self._lock = threading.RLock()
        self._buf_lock = threading.RLock()
        self._flushing = False
        self._buf = []
        self._fd = None
        self.path = None
        self._written = 0
        self._in_file = 0
        self._dropped = 0
        self._hook_errors = {}
        self.closed = False
        self._closing = False
        self._last_record = 0.0
        env_rank = _env_int("RANK", _env_int("LOCAL_RANK"))
        self.rank = env_rank
        self.world_size = None


def _dumps(ev: dict) -> bytes:
    return orjson.dumps(ev, option=orjson.OPT_APPEND_NEWLINE)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _env_int(name: str, default: int | None = None) -> int | None:
    v = os.environ.get(name)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        return default
