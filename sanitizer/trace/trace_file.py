"""The trace file on disk, for TraceWriter (writer.py): its name, its header line written padded
at once, and the header's rewrite in place (pwrite) when the facts known later change, or with a
copy of the file when it outgrows its room (docs/trace-format.md, "Files"; writer.py's docstring
says when each happens)."""
from __future__ import annotations

import os

import orjson

from sanitizer.trace import binary as B
from sanitizer.trace.schema import SCHEMA_VERSION

#: Bytes the header line takes (padded with spaces): room for the facts learnt later, in place.
HEADER_ROOM = 4096
#: The time-flush thread wakes at most this often (HAZSAN_FLUSH_SECONDS=0 means "as often as this").
MIN_FLUSH_SECONDS = 0.05
#: A program that marks step ends counts as idle at the soonest this long after one (HAZSAN_IDLE_SECONDS).
MIN_IDLE_SECONDS = 0.01
_COPY_CHUNK = 1 << 20


class TraceFile:
    """TraceWriter's file and header (a mixin: it shares the writer's state and lock; every
    method runs with the writer's lock held)."""

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

    def _key(self):
        """What the header's facts depend on (header_key), cheap to ask at every flush."""
        if self.header_key is None:
            return 0
        try:
            return self.header_key()
        except Exception as exc:
            self.hook_failed("writer.header", exc)
            return self._header_state

    def _header_json(self, facts: bool = True) -> tuple[dict, object]:
        """The header (a dict), and the header_key() it was made under (_NO_FACTS when the
        header_source was not asked: capture just started)."""
        rank = self.rank if self.rank is not None else -os.getpid()
        h = {"hazsan": SCHEMA_VERSION, "rank": rank, "world_size": self.world_size or 1,
             "device": self.device, "pid": os.getpid(), "end_record": True,
             "flush_seconds": max(self.flush_seconds, MIN_FLUSH_SECONDS), "progress": dict(self.progress)}
        h.update(self.header_extra)
        state = _NO_FACTS
        if facts or self.header_source is None:
            state = self._key()
        if facts and self.header_source is not None:
            cached = self._facts_cache
            if cached is not None and cached[0] == state:
                h.update(cached[1])
            else:
                try:
                    more = dict(self.header_source())
                    self._facts_cache = (state, more)
                    h.update(more)
                except Exception as exc:
                    self.hook_failed("writer.header", exc)
        return h, state

    def _header_bytes(self, h: dict, room: int) -> bytes | None:
        """The file's first bytes, the header padded to `room` bytes (0: to at least HEADER_ROOM,
        never too short); None when it does not fit in `room`."""
        if self.format == "binary":
            if room:
                return B.signature_and_header(h, room)
            exact = B.signature_and_header(h)
            return B.signature_and_header(h, max(HEADER_ROOM, len(exact) + 3))
        js = orjson.dumps(h)
        if room:
            return _padded(js, room) if len(js) + 1 <= room else None
        return _padded(js, max(HEADER_ROOM, len(js) + 1))

    def _header_grown(self, h: dict) -> bytes:
        """The header padded for a file rewritten because it outgrew its room."""
        if self.format == "binary":
            size = len(B.signature_and_header(h)) + 3 + HEADER_ROOM // 4
            return B.signature_and_header(h, size)
        js = orjson.dumps(h)
        return _padded(js, len(js) + 1 + HEADER_ROOM // 4)

    def _open(self, facts: bool = True, keep: str | None = None) -> None:
        """Create this process's file (O_EXCL, owner-only) and write its header line, padded to
        HEADER_ROOM so that later facts fit in place. `keep`: the file this writer still has open
        (a rename in progress), never taken over as a stale one."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        pid = os.getpid()
        sfx = self.suffix
        if self.rank is not None:
            names = [f"rank{self.rank}{sfx}"]
            stem = f"rank{self.rank}.pid{pid}"
        else:
            names = []
            stem = f"pid{pid}"
        first = self._next_suffix.get((self.directory, stem), 2)   # a folder this process wrote before
        names += [f"{stem}{sfx}"] + [f"{stem}.{n}{sfx}" for n in range(first, first + 100)]
        h, state = self._header_json(facts)
        header = self._header_bytes(h, 0)
        last_exc = None
        for i, name in enumerate(names):
            if i >= len(names) - 100:
                self._next_suffix[(self.directory, stem)] = first + (i - (len(names) - 100)) + 1
            path = os.path.join(self.directory, name)
            try:
                fd = _create(path)
            except FileExistsError as exc:
                last_exc = exc
                if path == keep or not _stale_own_header(path, pid):
                    continue
                try:                    # this process's own file from before an exec: take it over
                    os.unlink(path)
                    fd = _create(path)
                except OSError:
                    continue
            try:
                _write_all(fd, header)
            except BaseException:
                os.close(fd)
                try:
                    os.unlink(path)
                except OSError:
                    pass
                raise
            self._fd, self.path = fd, path
            self._progress_at = None
            self._in_file = 0
            self._values = B.ValueTable()
            self._header_len = len(header)
            self._header_state = state
            return
        raise last_exc  # type: ignore[misc]

    def _reopen_under_rank(self) -> None:
        """Copy the file under its rank's name with the right header; on failure keep writing
        where we were."""
        old_fd, old_path = self._fd, self.path
        if old_path is not None and os.path.basename(old_path) == f"rank{self.rank}{self.suffix}":
            # already named after this rank (the rank came from RANK, the world size only now):
            # the header is written again in place; copying the file onto its own name would
            # take it over and unlink it ("removed while running")
            self._refresh_header()
            return
        self._fd = self.path = None
        values = self._values            # the body is copied: its `V` frames with it
        try:
            self._open(facts=True, keep=old_path)
        except OSError as exc:
            self.hook_failed("writer.rename", exc)
            self._fd, self.path = old_fd, old_path
            return
        finally:
            self._values = values
        try:
            _copy_body(old_path, self._fd)
        except OSError as exc:
            self.hook_failed("writer.rename", exc)
            try:
                os.close(self._fd)
                os.unlink(self.path)
            except OSError:
                pass
            self._fd, self.path = old_fd, old_path
            return
        self._in_file = self._written
        self._close_header_fd()
        try:
            os.close(old_fd)
            os.unlink(old_path)
        except OSError as exc:
            self.hook_failed("writer.rename", exc)

    def _refresh_header(self) -> None:
        """Write the header again with the facts known now: over the old one in place when it
        fits its room (pwrite on a second descriptor: the first appends), else with a copy."""
        if self._fd is None or self.path is None:
            return
        h, state = self._header_json(True)
        self._header_state = state       # tried once per change of the facts, even if it fails
        self._progress_at = None
        try:
            data = self._header_bytes(h, self._header_len)
            if data is not None:
                fd = self._header_fd()
                if fd is None:
                    return               # not our file any more (the folder was removed)
                _pwrite_all(fd, data, 0)
                self._progress_at = self._find_progress(data, h["progress"], fd)
            else:
                self._rewrite_with_header(h)
        except Exception as exc:
            self.hook_failed("writer.header", exc)

    # A program that marks steps changes the header's `progress` at every step start. Only those
    # bytes are written then, over the same bytes of the header on disk, when their length did not
    # change (the facts are brought up to date by the next flush, _flush_locked): the header
    # rebuilt, encoded and padded twice a step was most of what a mark cost in a vLLM worker.
    def _progress_bytes(self, progress: dict) -> bytes:
        return B.msgpack_bytes(progress) if self.format == "binary" else orjson.dumps(progress)

    def _find_progress(self, data: bytes, progress: dict, fd: int):
        """(header descriptor, offset, length) of `progress`'s value in header bytes `data` just
        written through `fd`, or None when it is not found exactly once."""
        key = B.msgpack_bytes("progress") if self.format == "binary" else b'"progress":'
        needle = key + self._progress_bytes(progress)
        at = data.find(needle)
        if at < 0 or data.find(needle, at + 1) >= 0:
            return None
        return fd, at + len(key), len(needle) - len(key)

    def _write_progress_in_place(self) -> bool:
        """Write the header's progress over its old bytes; False when that cannot be done (the
        header was not written by _refresh_header since the file changed, the length changed and
        cannot be padded)."""
        at = self._progress_at
        if at is None or self._fd is None:
            return False
        fd = self._header_fd()       # (a file changed since: its descriptor closed, _progress_at None)
        if fd is None or self._progress_at is not at or fd != at[0]:
            return False
        data = self._progress_bytes(dict(self.progress))
        if len(data) != at[2]:
            # JSON may end the value with spaces (`false` is a byte longer than `true`); msgpack's
            # bytes are all structure
            if self.format == "binary" or len(data) > at[2]:
                return False
            data += b" " * (at[2] - len(data))
        _pwrite_all(fd, data, at[1])
        return True

    def _header_fd(self) -> int | None:
        """The second descriptor the header is written through (the first appends: O_APPEND
        ignores pwrite's offset), opened once per file and kept: a program that marks steps
        rewrites the header's progress twice a step. None when the path is no longer our file (its folder
        was removed and made again). A file replaced since (rename, rotation, fork, reopen) is a
        new (descriptor, path) pair: the old one is closed, a new one opened."""
        cached = getattr(self, "_hdr", None)
        if cached is not None:
            if cached[0] == self._fd and cached[1] == self.path and cached[3] == os.getpid():
                return cached[2]
            self._close_header_fd()
        fd = os.open(self.path, os.O_WRONLY)
        try:
            if os.fstat(fd).st_ino != os.fstat(self._fd).st_ino:
                os.close(fd)
                return None
        except OSError:
            os.close(fd)
            raise
        self._hdr = (self._fd, self.path, fd, os.getpid())
        return fd

    def _close_header_fd(self) -> None:
        cached = getattr(self, "_hdr", None)
        self._hdr = None
        self._progress_at = None
        if cached is not None:
            try:
                os.close(cached[2])
            except OSError:
                pass

    def _rewrite_with_header(self, h: dict) -> None:
        """The header outgrew its room: the file copied under the new header, then renamed over."""
        tmp = self.path + ".tmp"          # not *.jsonl / *.hzs: never read as a trace
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
        try:
            header = self._header_grown(h)
            _write_all(fd, header)
            _copy_body(self.path, fd)
            os.replace(tmp, self.path)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        self._close_header_fd()
        try:
            os.close(self._fd)
        except OSError:
            pass
        self._fd = fd
        self._header_len = len(header)
        self._progress_at = None


_NO_FACTS = object()   # a header written before its facts were asked (capture start)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    done = 0
    view = memoryview(data)
    while done < len(data):
        done += os.pwrite(fd, view[done:], offset + done)


def _padded(js: bytes, size: int) -> bytes:
    """The header line: JSON, spaces up to `size` - 1 bytes, a newline (JSON allows the spaces)."""
    return js + b" " * max(0, size - len(js) - 1) + b"\n"


def _create(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)


def _stale_own_header(path: str, pid: int) -> bool:
    """`path` holds nothing but a header with this `pid` (and no end record): the trace this very
    process started before an exec replaced its program (exec runs no exit handler)."""
    try:
        with open(path, "rb") as f:
            skip = _header_size(f)
            if skip is None:
                return False
            f.seek(0)
            head = f.read(skip)
            if f.read(1):
                return False
        if head.startswith(B.MAGIC):
            header = B.decode_header(head[len(B.SIGNATURE) + B.PREFIX_SIZE:])
        else:
            header = orjson.loads(head)
        return header.get("pid") == pid
    except Exception:
        return False


def _header_size(f) -> int | None:
    """Bytes of the header (line, or signature and header frame) at the start of open file `f`,
    or None when it is not whole."""
    first = f.read(len(B.SIGNATURE))
    if first.startswith(B.MAGIC):
        prefix = f.read(B.PREFIX_SIZE)
        if len(prefix) < B.PREFIX_SIZE:
            return None
        _, length = B.PREFIX.unpack(prefix)
        size = len(B.SIGNATURE) + B.PREFIX_SIZE + length
        f.seek(0, os.SEEK_END)
        return size if f.tell() >= size else None
    f.seek(0)
    line = f.readline()
    return len(line) if line.endswith(b"\n") else None


def _copy_body(src_path: str, dst_fd: int) -> None:
    """Everything after the header of `src_path`, appended to `dst_fd`, a chunk at a time."""
    with open(src_path, "rb") as f:
        skip = _header_size(f)
        f.seek(skip or 0)
        while True:
            chunk = f.read(_COPY_CHUNK)
            if not chunk:
                return
            _write_all(dst_fd, chunk)




def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
