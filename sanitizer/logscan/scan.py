"""Scan SGLang server logs for the corruption signature (docs/cli.md, "hazsan logscan").

A *decode interval* is a `Decode batch` line carrying `accept len` (speculative decoding on): the
mean accepted tokens per verify step since the previous such line. Corrupted collective output
makes the target model disagree with the draft, so accept len collapses towards 1 while the
server is under load. An interval is *flagged* when accept len <= threshold and #running-req >=
min_running (an idle server legitimately logs low values).
"""
from __future__ import annotations

import gzip
import io
import os
import sys
import zlib
from array import array
from dataclasses import dataclass, field
from statistics import median

from sanitizer.logscan.parse import BrokenLine, DecodeLine, parse_line

GZIP_MAGIC = b"\x1f\x8b"
MAX_LINE_CHARS = 4 << 20  # a `Decode batch` line is a few hundred characters


class LogError(Exception):
    """An input that cannot be read at all. Names the file."""

    def __init__(self, path: str, message: str):
        self.path = path
        super().__init__(f"{path}: {message}")


@dataclass(slots=True)
class Interval:
    """A flagged decode interval, with where it came from."""

    file: str
    line: int
    prefix: str
    time: str | None
    accept_len: float
    running_req: int
    accept_rate: float | None
    text: str

    def to_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "prefix": self.prefix, "time": self.time,
                "accept_len": self.accept_len, "running_req": self.running_req,
                "accept_rate": self.accept_rate}


@dataclass(slots=True)
class Unparsed:
    file: str
    line: int
    reason: str
    text: str

    def to_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "reason": self.reason, "text": self.text}


@dataclass
class PrefixStats:
    """Per rank prefix (`DP0 TP0`, ...): every accept len seen and how many were flagged."""

    decode_lines: int = 0
    flagged: int = 0
    accept_lens: array = field(default_factory=lambda: array("d"))

    def to_dict(self) -> dict:
        a = self.accept_lens
        return {
            "decode_lines": self.decode_lines,
            "intervals": len(a),
            "flagged": self.flagged,
            "accept_len_min": min(a) if a else None,
            "accept_len_median": median(a) if a else None,
            "accept_len_mean": sum(a) / len(a) if a else None,
        }


@dataclass
class ScanResult:
    threshold: float
    min_running: int
    files: list[str] = field(default_factory=list)
    lines: int = 0
    decode_lines: int = 0  # every parsed `Decode batch` line, with or without accept len
    flagged: list[Interval] = field(default_factory=list)
    unparsed: list[Unparsed] = field(default_factory=list)
    unparsed_count: int = 0
    below_min_running: int = 0  # accept len at or below threshold but too few running requests
    by_prefix: dict[str, PrefixStats] = field(default_factory=dict)

    @property
    def intervals(self) -> int:
        return sum(len(s.accept_lens) for s in self.by_prefix.values())

    def accept_lens(self) -> array:
        out = array("d")
        for s in self.by_prefix.values():
            out.extend(s.accept_lens)
        return out

    def exit_code(self) -> int:
        return 1 if self.flagged else 0


class LogScanner:
    """Feeds lines through `parse_line` and keeps the tallies. Nothing here raises on bad lines."""

    def __init__(self, threshold: float = 2.0, min_running: int = 1, max_unparsed: int = 1000,
                 max_line_chars: int = MAX_LINE_CHARS):
        self.result = ScanResult(threshold=threshold, min_running=min_running)
        self.max_unparsed = max_unparsed
        self.max_line_chars = max_line_chars  # 0: no limit

    def feed(self, file: str, line_no: int, text: str) -> None:
        r = self.result
        r.lines += 1
        parsed = parse_line(text)
        if parsed is None:
            return
        if isinstance(parsed, BrokenLine):
            r.unparsed_count += 1
            if len(r.unparsed) < self.max_unparsed:
                r.unparsed.append(Unparsed(file, line_no, parsed.reason, text.rstrip("\r\n")[:300]))
            return
        self._decode(file, line_no, text, parsed)

    def _decode(self, file: str, line_no: int, text: str, d: DecodeLine) -> None:
        r = self.result
        r.decode_lines += 1
        stats = r.by_prefix.get(d.prefix)
        if stats is None:
            stats = r.by_prefix[d.prefix] = PrefixStats()
        stats.decode_lines += 1
        if d.accept_len is None:
            return
        stats.accept_lens.append(d.accept_len)
        if d.accept_len <= r.threshold:
            if d.running_req >= r.min_running:
                stats.flagged += 1
                r.flagged.append(Interval(file, line_no, d.prefix, d.time, d.accept_len, d.running_req,
                                          d.number("accept rate"), text.rstrip("\r\n")))
            else:
                r.below_min_running += 1

    def scan_file(self, path: str) -> None:
        """Read one log (plain or gzip, by content; `-` is stdin). Raises LogError if unreadable."""
        self.result.files.append(path)
        line_no = 0
        try:
            with _open_text(path) as stream:
                limit = self.max_line_chars
                lines = iter(lambda: stream.readline(limit + 1), "") if limit else stream
                for line_no, text in enumerate(lines, 1):
                    if limit and len(text) > limit:
                        # Reading on would hold the whole line (`/dev/zero` never ends one).
                        raise LogError(f"{path}:{line_no}", f"line longer than {limit} characters "
                                       "(not a server log? --max-line-chars raises the limit)")
                    self.feed(path, line_no, text)
        except LogError:
            raise
        except (OSError, EOFError, zlib.error) as exc:
            if line_no == 0:
                raise LogError(path, f"cannot read: {getattr(exc, 'strerror', None) or exc}") from exc
            # A gzip cut short (log rotated while being compressed): keep what came before.
            self.result.unparsed_count += 1
            self.result.unparsed.append(Unparsed(path, line_no + 1, f"read stopped: {exc}", ""))


def _open_text(path: str):
    if path == "-":
        return io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8", errors="replace")
    if os.path.isdir(path):
        raise LogError(path, "is a directory (give the log files)")
    try:
        with open(path, "rb") as probe:
            magic = probe.read(2)
        binary = gzip.open(path, "rb") if magic == GZIP_MAGIC else open(path, "rb")
    except OSError as exc:
        raise LogError(path, f"cannot open: {exc.strerror or exc}") from exc
    # Logs hold whatever the model printed; never fail on an undecodable byte.
    return io.TextIOWrapper(binary, encoding="utf-8", errors="replace", newline="")


def scan(paths, threshold: float = 2.0, min_running: int = 1) -> ScanResult:
    scanner = LogScanner(threshold, min_running)
    for p in paths:
        scanner.scan_file(str(p))
    return scanner.result
