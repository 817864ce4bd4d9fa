"""Streaming reader for schema-1 traces: one JSON Lines file per rank, plain or gzip.

Memory stays flat: lines are parsed one at a time and nothing is kept. Every problem names the
file and the 1-based line (the header is line 1).
"""
from __future__ import annotations

import gzip
import io
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from itertools import islice
from typing import Iterator

import orjson

from sanitizer.trace.schema import NON_TRACE_FILES, SCHEMA_VERSION


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
    warnings: list[str] = field(default_factory=list)
    _stream: io.BufferedIOBase | None = None

    @property
    def rank(self) -> int:
        return self.header.get("rank", 0)

    def events(self) -> Iterator[tuple[int, object]]:
        """Yield (line_no, parsed event, or a TraceError for a line that is not JSON)."""
        for first, items in self.batches():
            for line_no, item in enumerate(items, first):
                if item is not None:
                    yield line_no, item

    def line_batches(self, size: int = 4096) -> Iterator[tuple[int, list[bytes]]]:
        """Yield (line_no of the first line, [raw line, ...]) in file order, unparsed.

        A gzip stream cut short (a killed writer) ends the iteration with a truncation warning.
        """
        stream = self._stream
        if stream is None:
            raise RuntimeError("trace already consumed")
        self._stream = None
        lines = _tolerant_lines(self, stream) if isinstance(stream, gzip.GzipFile) else stream
        first = 2
        try:
            while True:
                raws = list(islice(lines, size))
                if not raws:
                    return
                yield first, raws
                first += len(raws)
        except OSError as exc:
            raise TraceError(self.path, first, f"read error: {exc}") from exc
        finally:
            stream.close()

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

    def mark_truncated(self, line_no: int, why: str = "last line cut short") -> None:
        """Record that the file ends early at `line_no` (a warning, never an error)."""
        self._truncate(line_no, why)

    def _truncate(self, line_no: int, why: str = "last line cut short") -> None:
        self.truncated = True
        self.warnings.append(f"{self.path}:{line_no}: trace truncated ({why}: the writer was killed?)")

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None


def _tolerant_lines(trace: TraceFile, stream):
    """Lines of a gzip stream; one cut short (killed writer) ends with a truncation warning."""
    line_no = 1
    try:
        for line_no, raw in enumerate(stream, 2):
            yield raw
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        trace._truncate(line_no + 1, f"compressed stream ends early: {exc}")


def open_trace(path: str | os.PathLike) -> TraceFile:
    """Open one rank file and parse its header. Raises TraceError on unusable input."""
    path = Path(path)
    try:
        if path.name.endswith(".gz"):
            stream = gzip.open(path, "rb")  # buffered itself; a bigger buffer would hit a cut tail early
        else:
            stream = open(path, "rb", buffering=1 << 20)
    except OSError as exc:
        raise TraceError(path, None, f"cannot open: {exc.strerror or exc}") from exc
    try:
        first = stream.readline()
    except (EOFError, OSError, zlib.error) as exc:
        stream.close()
        raise TraceError(path, 1, f"cannot read header: {exc}") from exc
    if not first:
        stream.close()
        raise TraceError(path, 1, "empty file: expected a header line {\"hazsan\": 1, ...}")
    try:
        header = orjson.loads(first)
    except orjson.JSONDecodeError as exc:
        stream.close()
        raise TraceError(path, 1, f"header is not JSON: {exc}") from exc
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
    tf = TraceFile(path=path, header=header, _stream=stream)
    return tf


def expand_paths(paths) -> list[Path]:
    """Files named, and for a directory every `*.jsonl` and `*.jsonl.gz` in it (sorted)."""
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(
                q for q in p.iterdir()
                if q.is_file() and (q.name.endswith(".jsonl") or q.name.endswith(".jsonl.gz"))
                and q.name not in NON_TRACE_FILES
            )
            if not found:
                raise TraceError(p, None, "directory holds no *.jsonl or *.jsonl.gz trace files")
            out.extend(found)
        elif p.exists():
            out.append(p)
        else:
            raise TraceError(p, None, "no such file or directory")
    return out
