"""Streaming reader for schema-1 traces: one file per rank, JSON Lines or binary (frames of
msgpack arrays, sanitizer.trace.binary), plain or gzip. The format is told by the file's first
byte, never by its name.

Memory stays flat: lines (frames) are parsed one at a time and nothing is kept. Every problem
names the file and the 1-based line (the header is line 1); in a binary trace an event's line is
its ordinal, the line it has in the JSON Lines `hazsan cat` prints, and problems name the frame
and its byte offset too.
"""
from __future__ import annotations

import gzip
import io
import os
import stat
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from itertools import islice
from typing import Iterator

import orjson

from sanitizer.limits import Limits
from sanitizer.trace import binary as B
from sanitizer.trace.progress import no_end_record
from sanitizer.trace.schema import NON_TRACE_FILES, SCHEMA_VERSION, is_trace_name


#: The last line a capture writer writes on a clean close (sanitizer.trace.writer).
END_RECORD = b'{"ev":"end"'


class TraceError(Exception):
    """Unusable input: a malformed line, a bad header, an unreadable file."""

    def __init__(self, path: str | os.PathLike, line: int | None, message: str):
        self.path = str(path)
        self.line = line
        self.message = message
        where = f"{self.path}:{line}" if line else self.path
        super().__init__(f"{where}: {message}")


@dataclass
class TraceFile:
    """One rank's trace. Iterate `events()` for (line_no, event) pairs in program order."""

    path: Path
    header: dict
    truncated: bool = False  # set once the last line turned out cut short (a killed writer)
    #: (index of its warning, line, why) of the truncation, once found
    truncation: tuple | None = None
    ended: bool = False      # the writer's end record was read (header "end_record": true)
    compressed: bool = False
    #: "jsonl" or "binary" (sanitizer.trace.binary)
    format: str = "jsonl"
    #: binary: the byte offset of the first frame after the header (for messages)
    body_offset: int = 0
    #: binary version 2: the value tables its `V` frames fill as they are read (binary.INDEXED); None otherwise
    values: dict | None = None
    #: the end record's fields, once read (`events`, `dropped`)
    end: dict | None = None
    #: the file is still being written (a live process: the pytest plugin's own file, a helper
    #: still running): its missing end record, or a last line not yet complete, is no truncation
    live: bool = False
    warnings: list[str] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)
    _stream: io.BufferedIOBase | None = None

    def __post_init__(self):
        # the bytes under the stream, kept for consumed() once the iteration has taken the stream
        self._raw = getattr(self._stream, "raw", None)

    def consumed(self) -> int:
        """Bytes of the file read so far (of the .gz file for a compressed one): a progress bar's."""
        raw = self._raw
        try:
            if raw is None:
                return 0
            packed = raw.compressed_source
            return packed.tell() if packed is not None else raw.produced
        except (AttributeError, OSError, ValueError):
            return 0

    @property
    def rank(self) -> int:
        return self.header.get("rank", 0)

    def events(self) -> Iterator[tuple[int, object]]:
        """Yield (line_no, parsed event as a dict, or a TraceError for a line that is not JSON or
        a binary frame that cannot be read), in either format."""
        batches = self.binary_dicts() if self.format == "binary" else self.batches()
        for first, items in batches:
            for line_no, item in enumerate(items, first):
                if item is not None:
                    yield line_no, item

    def binary_dicts(self) -> Iterator[tuple[int, list]]:
        """A binary trace's events as dicts, the events of a JSON Lines trace (`hazsan cat`)."""
        values = self.values

        def decode(first, payload, frame_no, offset):
            try:
                return B.generic_events(payload, values)
            except ValueError as exc:
                return [TraceError(self.path, first, f"{exc} (frame {frame_no} at byte {offset}; counted as one event)")]

        def bad(first, message):
            return [TraceError(self.path, first, message)]

        return self.frames(decode, bad)

    def frames(self, decode, bad) -> Iterator[tuple[int, list]]:
        """A binary trace's event frames: yield (line of the first event, decode(first, payload,
        frame number, byte offset)), the list's length advancing the line. `bad(first, message)`
        gives the items for a frame that is no event frame (it counts as one event).

        A frame cut short (a killed writer, a gzip stream that ends early) ends the iteration with
        a truncation warning; a frame longer than the limit is a TraceError.
        """
        stream = self._stream
        if stream is None:
            raise RuntimeError("trace already consumed")
        self._stream = None
        line = 2
        frame_no = 1
        offset = self.body_offset
        wants_end = self.header.get("end_record") is True
        limit = self.limits.max_line_bytes
        cut = (EOFError, gzip.BadGzipFile, zlib.error)
        try:
            while True:
                try:
                    prefix = stream.read(B.PREFIX_SIZE)
                except cut as exc:
                    self._truncate(line, f"compressed stream ends early: {exc}: the writer was killed?")
                    break
                if not prefix:
                    break
                if len(prefix) < B.PREFIX_SIZE:
                    self._truncate(line, f"last frame cut short: {len(prefix)} of its {B.PREFIX_SIZE} prefix "
                                   f"bytes at byte {offset}: the writer was killed?")
                    break
                kind, length = B.PREFIX.unpack(prefix)
                if limit and length > limit:
                    raise TraceError(self.path, line, f"frame {frame_no} at byte {offset}: length {length} is "
                                     f"more than {limit} bytes (not a hazsan trace? --max-line-bytes raises the limit)")
                try:
                    payload = stream.read(length)
                except cut as exc:
                    self._truncate(line, f"compressed stream ends early: {exc}: the writer was killed?")
                    break
                if len(payload) < length:
                    self._truncate(line, f"last frame cut short: {len(payload)} of its {length} bytes at byte "
                                   f"{offset}: the writer was killed?")
                    break
                if kind == B.FRAME_EVENTS:
                    items = decode(line, payload, frame_no, offset)
                elif kind == B.FRAME_VALUES and self.values is not None:
                    try:
                        B.add_values(self.values, payload)
                        items = None
                    except ValueError as exc:
                        items = bad(line, f"frame {frame_no} at byte {offset}: {exc} (its values are not "
                                    "defined; counted as one event)")
                elif kind == B.FRAME_END and wants_end and not _more(stream):
                    self.ended = True
                    self.end = B.decode_end(payload)
                    break
                elif kind == B.FRAME_END:
                    items = bad(line, f"frame {frame_no} at byte {offset}: an end frame that is not the last "
                                "frame of a trace whose header announces one (counted as one event)")
                else:
                    items = bad(line, f"frame {frame_no} at byte {offset}: unknown frame kind {kind:#04x} "
                                "(not a hazsan trace? counted as one event)")
                if items:
                    yield line, items
                    line += len(items)
                frame_no += 1
                offset += B.PREFIX_SIZE + length
        except OSError as exc:
            raise TraceError(self.path, line, f"read error: {exc}") from exc
        finally:
            stream.close()
        self._end_check(wants_end, line)

    def line_batches(self, size: int = 4096) -> Iterator[tuple[int, list[bytes]]]:
        """Yield (line_no of the first line, [raw line, ...]) in file order, unparsed.

        A gzip stream cut short (a killed writer) ends the iteration with a truncation warning.
        """
        stream = self._stream
        if stream is None:
            raise RuntimeError("trace already consumed")
        self._stream = None
        lines = _tolerant_lines(self, stream) if self.compressed else stream
        first = 2
        wants_end = self.header.get("end_record") is True
        try:
            raws = list(islice(lines, size))
            while raws:
                following = list(islice(lines, size)) if wants_end else None
                if wants_end and not following and raws[-1].startswith(END_RECORD):
                    self.ended = True
                    try:
                        end = orjson.loads(raws.pop())   # the writer's closing line: not an event
                        self.end = {k: v for k, v in end.items() if k != "ev"} if type(end) is dict else {}
                    except orjson.JSONDecodeError:
                        self.end = {}
                    if not raws:
                        break
                yield first, raws
                first += len(raws)
                raws = following if wants_end else list(islice(lines, size))
        except OSError as exc:
            raise TraceError(self.path, first, f"read error: {exc}") from exc
        finally:
            stream.close()
        self._end_check(wants_end, first)

    def _end_check(self, wants_end: bool, first: int) -> None:
        """The header announced an end record and none was read: a truncated trace."""
        if wants_end and not self.ended and not self.truncated and not self.live:
            # first == 2: the header alone, no event was ever flushed. What the header's
            # `progress` proves decides between "nothing missing" and what may be (progress.py).
            complete, why = no_end_record(self.header, header_only=first == 2)
            if complete:
                self.warnings.append(f"{self.path}: {why}")
            else:
                self._truncate(first, why)

    def batches(self, size: int = 4096) -> Iterator[tuple[int, list]]:
        """Yield (line_no of the first item, [parsed event or TraceError, ...]) in file order.

        Parsing a batch in one comprehension is the fast path; a batch with a bad line is parsed
        again line by line. A last line without its newline that does not parse is what a killed
        process leaves: it becomes a warning (`truncated`), never an error. Blank lines are skipped
        but keep their line numbers (an item `None`).
        """
        loads = orjson.loads
        for first, raws in self.line_batches(size):
            try:
                items = [loads(raw) for raw in raws]
            except orjson.JSONDecodeError:
                items = []
                for i, raw in enumerate(raws):
                    try:
                        items.append(loads(raw))
                    except orjson.JSONDecodeError as exc:
                        if not raw.endswith(b"\n"):
                            self._truncate(first + i)
                            break
                        if raw.strip():
                            items.append(TraceError(self.path, first + i, f"not JSON: {exc}"))
                        else:
                            items.append(None)
            yield first, items

    def mark_truncated(self, line_no: int, why: str = "last line cut short: the writer was killed?") -> None:
        """Record that the file ends early at `line_no` (a warning, never an error)."""
        self._truncate(line_no, why)

    def _truncate(self, line_no: int, why: str = "last line cut short: the writer was killed?") -> None:
        self.truncated = True
        if self.live:    # read while its writer writes: the line after the last flush is not there yet
            self.warnings.append(f"{self.path}:{line_no}: still being written: read up to line {line_no - 1}")
            return
        self.warnings.append(f"{self.path}:{line_no}: trace truncated ({why})")
        self.truncation = (len(self.warnings) - 1, line_no, why)

    def steps_contradict(self, steps_seen) -> None:
        """The header's `progress` says its last step ended (nothing of a step is missing), but the
        events read stop before that step: the file was cut after the header was written (a copy, a
        disk), and events of steps are missing. The truncation's reason says so instead."""
        from sanitizer.trace.progress import STEPS_COMPLETE

        cut = self.truncation
        if cut is None or STEPS_COMPLETE not in cut[2]:
            return
        progress = self.header.get("progress") if isinstance(self.header, dict) else None
        claimed = progress.get("step") if isinstance(progress, dict) else None
        if type(claimed) is int and (not steps_seen or max(steps_seen) < claimed):
            last = max(steps_seen) if steps_seen else None
            self.warnings[cut[0]] = (f"{self.path}:{cut[1]}: trace truncated (no end record, and its events end "
                                     f"{f'in step {last}' if last is not None else 'before any step'}, though its "
                                     f"header says step {claimed} ended: events of steps are missing)")

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def _more(stream) -> bool:
    """Whether bytes follow (a gzip stream cut right after the last frame: no)."""
    try:
        return bool(stream.peek(1))
    except (EOFError, gzip.BadGzipFile, zlib.error):
        return False


def _tolerant_lines(trace: TraceFile, stream):
    """Lines of a gzip stream; one cut short (killed writer) ends with a truncation warning."""
    line_no = 1
    try:
        for line_no, raw in enumerate(stream, 2):
            yield raw
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        trace._truncate(line_no + 1, f"compressed stream ends early: {exc}: the writer was killed?")


_PEEK = 4096  # bytes searched at each end of a chunk read from a plain file


class _BoundedRaw(io.RawIOBase):
    """The bytes of one trace file, checked as they are read: no line longer than the limit, no
    gzip stream expanding past the ratio. Either raises TraceError naming the line, so memory and
    time stay bounded whatever the file holds; line iteration above it stays in C.

    Newlines are not counted on the way (bytes.count costs as much as the reading itself): the
    error's line number is counted again from the start of a regular file; a pipe or a device
    cannot be read twice, so for those every chunk's newlines are counted as it passes."""

    #: A plain attribute that close() sets: the BufferedReader above asks it on every line, and
    #: IOBase's own `closed` property costs more than the rest of reading that line.
    closed = False

    def __init__(self, path: Path, source, limits: Limits, compressed_source=None):
        self.path, self.source, self.limits = path, source, limits
        # read1: what one decompression step gives (GzipFile.read would keep reading and lose
        # the part before a cut-short end with the EOFError)
        self._read = getattr(source, "read1", source.read)
        self._readinto = source.readinto if compressed_source is None else None
        self.compressed_source = compressed_source  # the .gz file under a GzipFile, for its position
        try:
            self.count_lines = not stat.S_ISREG(os.stat(path).st_mode)
        except OSError:
            self.count_lines = True
        self.lines = True    # check line lengths (a binary trace turns it off: it has frames)
        self.newlines = 0    # newlines so far, when count_lines
        self.run = 0         # bytes of the current line so far
        self.line_start = 0  # offset of the current line
        self.produced = 0    # bytes handed out

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if not self.lines:
            return self._readinto_frames(buffer)
        limit = self.limits.max_line_bytes
        want = len(buffer) if not limit else min(len(buffer), limit)  # lines inside one read stay < limit
        if self._readinto is not None:
            # a plain file: read straight into the buffer, and search copies of its two ends only
            # (lines are short; a copy of every chunk costs more than the reading)
            n = self._readinto(buffer[:want])
            if not n:
                return 0
            head = bytes(buffer[:min(n, _PEEK)])
            first = head.find(b"\n")
            if first < 0 and n > _PEEK:
                head = bytes(buffer[:n])
                first = head.find(b"\n")
            tail_at = max(0, n - _PEEK)
            last = bytes(buffer[tail_at:n]).rfind(b"\n")
            last = tail_at + last if last >= 0 else (head.rfind(b"\n") if first >= 0 else -1)
            count = (lambda: bytes(buffer[:n]).count(b"\n")) if self.count_lines else None
        else:
            data = self._read(want)
            n = len(data)
            if not n:
                return 0
            buffer[:n] = data
            first = data.find(b"\n")
            last = data.rfind(b"\n")
            count = (lambda: data.count(b"\n")) if self.count_lines else None
        if limit and self.run + (n if first < 0 else first) > limit:
            raise self._error(self.line_start, f"line longer than {limit} bytes (not a hazsan trace? "
                              "--max-line-bytes raises the limit)")
        if first < 0:
            self.run += n
        else:
            self.run = n - 1 - last
            self.line_start = self.produced + last + 1
            if count is not None:
                self.newlines += count()
        self.produced += n
        ratio = self.limits.max_gzip_ratio
        if ratio and self.compressed_source is not None and self.produced > self.limits.gzip_ratio_floor:
            packed = max(self.compressed_source.tell(), 1)
            if self.produced > ratio * packed:
                raise self._error(self.produced, f"gzip data expands more than {ratio:g}x ({self.produced} "
                                  f"bytes from {packed}): a decompression bomb? (--max-gzip-ratio raises the limit)")
        return n

    def _readinto_frames(self, buffer) -> int:
        """A binary trace's bytes: frame lengths are checked by the reader; here the gzip ratio."""
        if self._readinto is not None:
            n = self._readinto(buffer)
            if not n:
                return 0
        else:
            data = self._read(len(buffer))
            n = len(data)
            if not n:
                return 0
            buffer[:n] = data
        self.produced += n
        ratio = self.limits.max_gzip_ratio
        if ratio and self.compressed_source is not None and self.produced > self.limits.gzip_ratio_floor:
            packed = max(self.compressed_source.tell(), 1)
            if self.produced > ratio * packed:
                raise TraceError(self.path, None, f"gzip data expands more than {ratio:g}x ({self.produced} "
                                 f"bytes from {packed}): a decompression bomb? (--max-gzip-ratio raises the limit)")
        return n

    def _error(self, offset: int, message: str) -> TraceError:
        """A TraceError naming the line that holds byte `offset` (within the line counted so far)."""
        if self.count_lines:
            return TraceError(self.path, self.newlines + 1, message)
        newlines = 0
        try:
            with (gzip.open(self.path, "rb") if self.compressed_source is not None else open(self.path, "rb")) as f:
                left = offset
                while left > 0:
                    chunk = f.read(min(left, 1 << 20))
                    if not chunk:
                        break
                    newlines += chunk.count(b"\n")
                    left -= len(chunk)
        except (OSError, EOFError, zlib.error):
            return TraceError(self.path, None, f"{message} (at byte {offset})")
        return TraceError(self.path, newlines + 1, message)

    def close(self) -> None:
        try:
            self.source.close()
            if self.compressed_source is not None:
                self.compressed_source.close()
        finally:
            super().close()
            self.closed = True


def open_trace(path: str | os.PathLike, limits: Limits | None = None) -> TraceFile:
    """Open one rank file and parse its header, reading it within `limits` (default: Limits()).
    Raises TraceError on unusable input."""
    path = Path(path)
    limits = limits or Limits()
    compressed = path.name.endswith(".gz")
    try:
        if compressed:
            packed = open(path, "rb")
            raw = _BoundedRaw(path, gzip.GzipFile(fileobj=packed, mode="rb"), limits, packed)
            stream = io.BufferedReader(raw, 1 << 16)  # a bigger buffer would hit a cut tail early
        else:
            stream = io.BufferedReader(_BoundedRaw(path, open(path, "rb", buffering=0), limits), 1 << 20)
    except OSError as exc:
        raise TraceError(path, None, f"cannot open: {exc.strerror or exc}") from exc
    try:
        if stream.peek(1)[:1] == B.MAGIC[:1]:
            return _open_binary(path, stream, compressed, limits)
        first = stream.readline()
    except (EOFError, OSError, zlib.error) as exc:
        stream.close()
        raise TraceError(path, 1, f"cannot read header: {exc}") from exc
    except TraceError:
        stream.close()
        raise
    if not first:
        stream.close()
        raise TraceError(path, 1, "empty file: expected a header line {\"hazsan\": 1, ...}")
    try:
        header = orjson.loads(first)
    except orjson.JSONDecodeError as exc:
        stream.close()
        # what it is not, then the parser's detail last: a newcomer's wrong file reads as such
        raise TraceError(path, 1, f"not a hazsan trace: its first line is not the JSON header "
                                  f'{{"hazsan": 1, "rank": ...}} (header is not JSON: {exc.msg})') from exc
    return _checked(path, header, TraceFile(path=path, header=header, compressed=compressed, _stream=stream,
                                            limits=limits))


def _open_binary(path: Path, stream, compressed: bool, limits: Limits) -> TraceFile:
    """The signature and the header frame of a binary trace (its first byte was 0x89)."""
    stream.raw.lines = False
    try:
        try:
            sig = stream.read(len(B.SIGNATURE))
            if len(sig) < len(B.SIGNATURE) or not sig.startswith(B.MAGIC):
                raise TraceError(path, 1, "not a hazsan trace: it starts with byte 0x89 but not with the binary "
                                 "trace signature 89 48 5A 53 0D 0A 1A")
            if sig[-1] not in B.READ_VERSIONS:
                raise TraceError(path, 1, f"unsupported binary trace version {sig[-1]} (this hazsan reads "
                                 f"{', '.join(map(str, B.READ_VERSIONS))})")
            prefix = stream.read(B.PREFIX_SIZE)
            if len(prefix) < B.PREFIX_SIZE:
                raise TraceError(path, 1, "binary trace cut short in its header frame: the writer was killed "
                                 "while starting?")
            kind, length = B.PREFIX.unpack(prefix)
            if kind != B.FRAME_HEADER:
                raise TraceError(path, 1, f"not a hazsan trace: the first frame (at byte {len(sig)}) must be the "
                                 f"header frame 'H', got kind {kind:#04x}")
            limit = limits.max_line_bytes
            if limit and length > limit:
                raise TraceError(path, 1, f"header frame length {length} is more than {limit} bytes (not a hazsan "
                                 "trace? --max-line-bytes raises the limit)")
            payload = stream.read(length)
        except (EOFError, OSError, zlib.error) as exc:
            raise TraceError(path, 1, f"cannot read header: {exc}") from exc
        if len(payload) < length:
            raise TraceError(path, 1, f"binary trace cut short in its header frame ({len(payload)} of {length} "
                             "bytes): the writer was killed while starting?")
        try:
            header = B.decode_header(payload)
        except ValueError as exc:
            raise TraceError(path, 1, str(exc)) from None
    except TraceError:
        stream.close()
        raise
    tf = TraceFile(path=path, header=header, compressed=compressed, format="binary", _stream=stream,
                   body_offset=len(B.SIGNATURE) + B.PREFIX_SIZE + length, limits=limits,
                   values=B.new_values() if sig[-1] >= 2 else None)
    return _checked(path, header, tf)


def _checked(path: Path, header, tf: TraceFile) -> TraceFile:
    """The header's checks, the same in both formats."""
    stream = tf._stream
    if not isinstance(header, dict) or "hazsan" not in header:
        stream.close()
        raise TraceError(path, 1, 'not a hazsan trace: the header must be {"hazsan": 1, "rank": ...}')
    if header["hazsan"] != SCHEMA_VERSION:
        stream.close()
        raise TraceError(path, 1, f"unsupported schema version {header['hazsan']!r} (this hazsan reads {SCHEMA_VERSION})")
    rank = header.get("rank", 0)
    if type(rank) is not int:
        stream.close()
        raise TraceError(path, 1, f"header field 'rank' must be an integer, got {rank!r}")
    return tf


def expand_paths(paths) -> list[Path]:
    """Files named, and for a directory every trace file in it (sorted): `*.jsonl`, `*.hzs`, and
    those with `.gz` added (schema.TRACE_SUFFIXES)."""
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(
                q for q in p.iterdir()
                if q.is_file() and is_trace_name(q.name) and q.name not in NON_TRACE_FILES
            )
            if not found:
                raise TraceError(p, None, "directory holds no *.jsonl, *.hzs or .gz trace files")
            out.extend(found)
        elif p.exists():
            out.append(p)
        else:
            raise TraceError(p, None, "no such file or directory")
    return out


def read_header(path: str | os.PathLike) -> dict | None:
    """The header of a trace file in either format, or None when it cannot be read."""
    try:
        tf = open_trace(path)
    except TraceError:
        return None
    tf.close()
    return tf.header


class TypedEvents:
    """One rank file's events as typed records (sanitizer.trace.events, sanitizer.trace.binary),
    a batch at a time, in either format: what `hazsan check` feeds its engine.

    `next(problems)` returns (line of the first item, [record or None, ...]) and raises
    StopIteration at the end; problems with events are appended to `problems` as (line, message).
    JSON Lines come `chunk` lines at a time, a binary trace a frame at a time.
    """

    def __init__(self, trace: TraceFile, chunk: int = 512, on_classes=None):
        """`on_classes(mapping)`: told of each set of record classes made for this file (binary
        version 2: binary.BinaryDecoder), record class -> the JSON Lines class of its kind."""
        from sanitizer.trace.events import EventDecoder

        self.trace = trace
        self.problems: list = []
        if trace.format == "binary":
            self.decoder = B.BinaryDecoder(trace.values, on_classes)
            self._batches = trace.frames(self._decode_frame, self._bad_frame)
            self.next = self._next_binary
        else:
            self.decoder = EventDecoder()
            self._batches = trace.line_batches(chunk)
            self.next = self._next_jsonl

    def _next_jsonl(self, problems: list):
        first, raws = next(self._batches)
        return first, self.decoder.decode(first, raws, problems, on_cut=self.trace.mark_truncated)

    def _next_binary(self, problems: list):
        self.problems = problems
        return next(self._batches)

    def _decode_frame(self, first, payload, frame_no, offset):
        return self.decoder.decode(first, payload, frame_no, offset, self.problems)

    def _bad_frame(self, first, message):
        self.problems.append((first, message))
        return [None]

    def warnings(self, file: str) -> list[str]:
        return self.decoder.warnings(file)

    def forget(self) -> list:
        """The record classes made for this file (binary version 2), now out of the registry."""
        forget = getattr(self.decoder, "forget", None)
        return forget() if forget is not None else []
