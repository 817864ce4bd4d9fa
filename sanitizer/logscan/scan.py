"""Scan SGLang and vLLM server logs for the corruption signature (docs/cli.md, "hazsan logscan";
docs/logscan-formats.md).

A *decode interval* is a `Decode batch` line carrying `accept len` (SGLang, speculative decoding
on): the mean accepted tokens per verify step since the previous such line; or a vLLM
`SpecDecoding metrics` line carrying `Mean acceptance length` (the same quantity, bonus token
included, over VLLM_LOG_STATS_INTERVAL seconds), whose load is the `Running: N reqs` of the stats
line the same process logged right before it. Corrupted collective output makes the target model
disagree with the draft, so the accept length collapses towards 1 while the server is under load.
An interval is *flagged* when its accept length <= threshold and its running requests >=
min_running (an idle server legitimately logs low values). A vLLM interval with no stats line
before it has unknown load: flagged only when min_running is 0, else counted (`unknown_load`).
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

from sanitizer.logscan.parse import BrokenLine, DecodeLine, PrefillLine, parse_line, parse_prefill
from sanitizer.logscan.vllm import VllmBroken, VllmLegacy, VllmSpec, VllmStats, parse_vllm_line

GZIP_MAGIC = b"\x1f\x8b"
MAX_LINE_CHARS = 4 << 20  # a `Decode batch` line is a few hundred characters
MAX_RECORDS = 100_000  # vLLM intervals kept one by one (one per engine per 10 s: 11 days of one engine)

MAX_PENDING = 4096  # vLLM processes whose last stats line is remembered (a server has a handful)

SGLANG = "sglang"
VLLM = "vllm"

#: The lines that make a file a server log here, for the "not a server log" message.
KNOWN_LINES = ("SGLang's 'Decode batch' lines; vLLM's 'SpecDecoding metrics', engine stats "
               "('Avg prompt throughput: ..., Running: N reqs') and V0 'Speculative metrics' lines")


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
    running_req: int | None  # None: a vLLM interval with unknown load (flagged with min_running 0)
    accept_rate: float | None
    text: str
    record: VllmRecord | None = None  # the vLLM interval; None for SGLang

    @property
    def format(self) -> str:
        return SGLANG if self.record is None else VLLM

    def to_dict(self) -> dict:
        d = {"file": self.file, "line": self.line, "prefix": self.prefix, "time": self.time,
             "accept_len": self.accept_len, "running_req": self.running_req,
             "accept_rate": self.accept_rate}
        if self.record is not None:
            d.update(self.record.extra_dict())
        return d


def vllm_prefix(process: str, engine: str | None, paired: bool) -> str:
    """A vLLM interval's grouping key: process and engine ("APIServer pid=7 Engine 000"); never
    empty, so never SGLang's prefix-less "" (and SGLang's are rank tags, "DP0 TP0")."""
    engine = engine or ("vLLM" if paired else "engine unknown")
    return f"{process} {engine}" if process else engine


@dataclass(slots=True)
class VllmRecord:
    """One vLLM `SpecDecoding metrics` line with a mean acceptance length, paired with its load."""

    file: str
    line: int
    process: str  # "APIServer pid=7", "" without a process prefix
    engine: str | None  # from the paired stats line: "Engine 000"; None when unknown
    time: str | None
    accept_len: float  # bonus token included (one added to vLLM 0.8.5's value)
    logged_accept_len: float
    bonus_added: bool
    running_req: int | None  # `Running` of the stats line before it; None: no such line (unknown load)
    waiting_req: int | None
    stats_line: int | None
    accept_rate: float | None
    accepted: int | None
    drafted: int | None
    num_spec_tokens: int | None
    flagged: bool = False

    @property
    def prefix(self) -> str:
        return vllm_prefix(self.process, self.engine, self.stats_line is not None)

    def extra_dict(self) -> dict:
        """What a vLLM interval adds to an SGLang one in JSON."""
        return {"format": VLLM, "process": self.process, "engine": self.engine,
                "stats_line": self.stats_line, "waiting_req": self.waiting_req,
                "accepted": self.accepted, "drafted": self.drafted,
                "num_spec_tokens": self.num_spec_tokens, "logged_accept_len": self.logged_accept_len,
                "bonus_added": self.bonus_added}

    def to_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "prefix": self.prefix, "time": self.time,
                "accept_len": self.accept_len, "running_req": self.running_req,
                "accept_rate": self.accept_rate, "flagged": self.flagged, **self.extra_dict()}


@dataclass(slots=True)
class Unparsed:
    file: str
    line: int
    reason: str
    text: str
    format: str = SGLANG

    def to_dict(self) -> dict:
        d = {"file": self.file, "line": self.line, "reason": self.reason, "text": self.text}
        if self.format != SGLANG:
            d["format"] = self.format
        return d


@dataclass(slots=True)
class NotALog:
    """A file with no line of either format: not a server log (or not one this reads)."""

    file: str
    lines: int
    prefill_lines: int  # SGLang `Prefill batch` lines: a server log that never logged a decode step

    @property
    def reason(self) -> str:
        if not self.lines:
            return "empty: no decode line, no line at all"
        if self.prefill_lines:
            return (f"no decode line in {self.lines} lines, only {self.prefill_lines} SGLang 'Prefill batch' "
                    "line(s): the server logged no decode step")
        return f"not a server log: no decode line in {self.lines} lines"

    @property
    def name(self) -> str:
        return "standard input" if self.file == "-" else self.file

    def to_dict(self) -> dict:
        return {"file": self.file, "lines": self.lines, "prefill_lines": self.prefill_lines, "reason": self.reason}


@dataclass
class PrefixStats:
    """Per rank prefix (`DP0 TP0`, ...): every accept len seen and how many were flagged."""

    decode_lines: int = 0  # vLLM: `SpecDecoding metrics` lines
    flagged: int = 0
    accept_lens: array = field(default_factory=lambda: array("d"))
    format: str = SGLANG

    def to_dict(self) -> dict:
        a = self.accept_lens
        d = {
            "decode_lines": self.decode_lines,
            "intervals": len(a),
            "flagged": self.flagged,
            "accept_len_min": min(a) if a else None,
            "accept_len_median": median(a) if a else None,
            "accept_len_mean": sum(a) / len(a) if a else None,
        }
        if self.format != SGLANG:
            d["format"] = self.format
        return d


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
    # ...at or below the threshold in the first decode interval of requests all just admitted by the
    # prefill logged right before it: not flagged (see LogScanner._decode)
    cold_start: int = 0
    by_prefix: dict[str, PrefixStats] = field(default_factory=dict)
    # What each file held: {"sglang"}, {"vllm"}, both, or nothing (see `formats`).
    file_formats: dict[str, set] = field(default_factory=dict)
    file_lines: dict[str, int] = field(default_factory=dict)  # lines read per file
    file_prefill: dict[str, int] = field(default_factory=dict)  # SGLang `Prefill batch` lines per file
    # vLLM (all zero / empty for SGLang logs)
    vllm_stats_lines: int = 0  # `Avg prompt throughput: ..., Running: N reqs, ...`
    vllm_spec_lines: int = 0  # `SpecDecoding metrics: ...`, with or without a mean acceptance length
    vllm_legacy_lines: int = 0  # `Speculative metrics: ...` (V0 / V1 <= 0.8.2): not read
    vllm_unparsed: int = 0
    unknown_load: int = 0  # vLLM intervals with no stats line before them
    unknown_load_below: int = 0  # ...at or below the threshold, not flagged (min_running > 0)
    bonus_added: int = 0  # vLLM 0.8.5 intervals whose mean acceptance length got its bonus token
    records: list[VllmRecord] = field(default_factory=list)  # every vLLM interval, up to MAX_RECORDS
    records_dropped: int = 0
    max_spec_tokens: int | None = None  # the largest k among vLLM intervals

    @property
    def has_vllm(self) -> bool:
        return bool(self.vllm_stats_lines or self.vllm_spec_lines or self.vllm_legacy_lines or self.vllm_unparsed)

    def formats(self) -> dict[str, str]:
        """Per file: "sglang", "vllm", "sglang+vllm", or "none" (neither format's lines)."""
        return {f: "+".join(sorted(self.file_formats.get(f, ()))) or "none" for f in self.files}

    @property
    def format(self) -> str:
        """Over all files: "sglang", "vllm", "mixed" (both read) or "none"."""
        seen = set().union(*self.file_formats.values()) if self.file_formats else set()
        return "mixed" if len(seen) > 1 else (next(iter(seen)) if seen else "none")

    @property
    def intervals(self) -> int:
        return sum(len(s.accept_lens) for s in self.by_prefix.values())

    def accept_lens(self) -> array:
        out = array("d")
        for s in self.by_prefix.values():
            out.extend(s.accept_lens)
        return out

    def not_logs(self) -> list[NotALog]:
        """The files that hold no line of either format (empty ones included): not server logs."""
        return [NotALog(f, self.file_lines.get(f, 0), self.file_prefill.get(f, 0))
                for f, fmt in self.formats().items() if fmt == "none"]

    def exit_code(self) -> int:
        """2 when a file is not a server log (a CI gate must not pass on the wrong file), else 1
        when an interval is flagged, else 0."""
        if self.not_logs():
            return 2
        return 1 if self.flagged else 0


class LogScanner:
    """Feeds lines through `parse_line` and keeps the tallies. Nothing here raises on bad lines."""

    def __init__(self, threshold: float = 2.0, min_running: int = 1, max_unparsed: int = 1000,
                 max_line_chars: int = MAX_LINE_CHARS, max_records: int = MAX_RECORDS):
        self.result = ScanResult(threshold=threshold, min_running=min_running)
        self.max_unparsed = max_unparsed
        self.max_line_chars = max_line_chars  # 0: no limit
        self.max_records = max_records
        # vLLM: per (file, process prefix), the stats line waiting for its `SpecDecoding metrics`
        # line (None: the last one was broken, so the next spec line's load is unknown).
        self._pending: dict[tuple[str, str], tuple[int, VllmStats] | None] = {}
        # SGLang: per (file, rank prefix), the `#new-seq` of the `Prefill batch` lines logged since
        # the last `Decode batch` line of that prefix, summed
        self._admitted: dict[tuple[str, str], int] = {}

    def _seen(self, file: str, fmt: str) -> None:
        formats = self.result.file_formats.get(file)
        if formats is None:
            formats = self.result.file_formats[file] = set()
        formats.add(fmt)

    def _unparsed(self, file: str, line_no: int, reason: str, text: str, fmt: str) -> None:
        r = self.result
        r.unparsed_count += 1
        if len(r.unparsed) < self.max_unparsed:
            r.unparsed.append(Unparsed(file, line_no, reason, text.rstrip("\r\n")[:300], fmt))

    def feed(self, file: str, line_no: int, text: str) -> None:
        r = self.result
        r.lines += 1
        parsed = parse_line(text)
        if parsed is None:
            prefill = parse_prefill(text)
            if prefill is not None:
                r.file_prefill[file] = r.file_prefill.get(file, 0) + 1
                self._prefill(file, prefill)
                return
            vllm = parse_vllm_line(text)
            if vllm is not None:
                self._vllm(file, line_no, text, vllm)
            return
        self._seen(file, SGLANG)
        if isinstance(parsed, BrokenLine):
            self._unparsed(file, line_no, parsed.reason, text, SGLANG)
            return
        self._decode(file, line_no, text, parsed)

    def _vllm(self, file: str, line_no: int, text: str, v) -> None:
        r = self.result
        self._seen(file, VLLM)
        if isinstance(v, VllmBroken):
            r.vllm_unparsed += 1
            self._unparsed(file, line_no, v.reason, text, VLLM)
            if v.kind == "spec":  # the stats line before it was this interval's: spent
                self._pending.pop((file, v.process), None)
            else:  # the next spec line's own stats line is this broken one: its load is unknown
                self._remember(file, v.process, None)
            return
        if isinstance(v, VllmStats):
            r.vllm_stats_lines += 1
            self._remember(file, v.process, (line_no, v))
            return
        if isinstance(v, VllmLegacy):
            r.vllm_legacy_lines += 1
            return
        self._spec(file, line_no, text, v)

    def _remember(self, file: str, process: str, stats: tuple[int, VllmStats] | None) -> None:
        key = (file, process)
        self._pending.pop(key, None)
        if len(self._pending) >= MAX_PENDING:  # hostile input: a new pid every line
            del self._pending[next(iter(self._pending))]
        self._pending[key] = stats

    def _spec(self, file: str, line_no: int, text: str, s: VllmSpec) -> None:
        r = self.result
        r.vllm_spec_lines += 1
        paired = self._pending.pop((file, s.process), None)
        stats_line, stats = paired if paired is not None else (None, None)
        if s.accept_len is None:  # vLLM 0.8.3-0.8.4: no mean acceptance length
            prefix = vllm_prefix(s.process, stats.engine if stats else None, stats is not None)
            self._prefix_stats(prefix).decode_lines += 1
            return
        rec = VllmRecord(
            file=file, line=line_no, process=s.process, engine=stats.engine if stats else None,
            time=s.time, accept_len=s.accept_len, logged_accept_len=s.logged_accept_len,
            bonus_added=s.bonus_added, running_req=stats.running_req if stats else None,
            waiting_req=stats.waiting_req if stats else None, stats_line=stats_line,
            accept_rate=s.accept_rate, accepted=s.accepted, drafted=s.drafted,
            num_spec_tokens=s.num_spec_tokens)
        k = rec.num_spec_tokens
        if k is not None and (r.max_spec_tokens is None or k > r.max_spec_tokens):
            r.max_spec_tokens = k
        r.bonus_added += s.bonus_added
        stats_p = self._prefix_stats(rec.prefix)
        stats_p.decode_lines += 1
        stats_p.accept_lens.append(rec.accept_len)
        if rec.running_req is None:
            r.unknown_load += 1
        if rec.accept_len <= r.threshold:
            if rec.running_req is None and r.min_running > 0:
                r.unknown_load_below += 1
            elif rec.running_req is None or rec.running_req >= r.min_running:
                rec.flagged = True
                stats_p.flagged += 1
                r.flagged.append(Interval(file, line_no, rec.prefix, rec.time, rec.accept_len, rec.running_req,
                                          rec.accept_rate, text.rstrip("\r\n"), rec))
            else:
                r.below_min_running += 1
        if len(r.records) < self.max_records:
            r.records.append(rec)
        else:
            r.records_dropped += 1

    def _prefix_stats(self, prefix: str) -> PrefixStats:
        stats = self.result.by_prefix.get(prefix)
        if stats is None:
            stats = self.result.by_prefix[prefix] = PrefixStats(format=VLLM)
        return stats

    def _prefill(self, file: str, p: PrefillLine) -> None:
        if len(self._admitted) >= MAX_PENDING:  # hostile input: a new prefix every line
            del self._admitted[next(iter(self._admitted))]
        # prefills in a row (no decode step between them) all admit requests whose first decode
        # step is the next one: a batch admitted by several prefills (1 then 15) is just as cold
        key = (file, p.prefix)
        self._admitted[key] = self._admitted.pop(key, 0) + p.new_seq

    def _decode(self, file: str, line_no: int, text: str, d: DecodeLine) -> None:
        r = self.result
        r.decode_lines += 1
        # Every running request was admitted by the prefill(s) logged right before: this interval
        # is their first decode step. SGLang's NGRAM puts a request's tokens into its corpus only
        # after its decode steps (ngram_worker.py `_update_ngram_corpus`; prefill is not inserted),
        # so that step has no draft and its accept len is 1 on a healthy server: not the signature.
        admitted = self._admitted.pop((file, d.prefix), None)
        cold = admitted is not None and admitted >= d.running_req
        stats = r.by_prefix.get(d.prefix)
        if stats is None:
            stats = r.by_prefix[d.prefix] = PrefixStats()
        stats.decode_lines += 1
        if d.accept_len is None:
            return
        stats.accept_lens.append(d.accept_len)
        if d.accept_len <= r.threshold:
            if cold:
                r.cold_start += 1
            elif d.running_req >= r.min_running:
                stats.flagged += 1
                r.flagged.append(Interval(file, line_no, d.prefix, d.time, d.accept_len, d.running_req,
                                          d.number("accept rate"), text.rstrip("\r\n")))
            else:
                r.below_min_running += 1

    def scan_file(self, path: str) -> None:
        """Read one log (plain or gzip, by content; `-` is stdin). Raises LogError if unreadable."""
        self.result.files.append(path)
        self._pending = {k: v for k, v in self._pending.items() if k[0] != path}  # a file read twice
        before = self.result.lines
        try:
            self._read(path)
        finally:
            self.result.file_lines[path] = self.result.file_lines.get(path, 0) + self.result.lines - before

    def _read(self, path: str) -> None:
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
