"""Where acceptance is seen, beside the replies (sanitizer/verify/load.py): the server's Prometheus
page and its log followed live.

/metrics, by the Prometheus text parser of prometheus_client:

* SGLang 0.5.23 (--enable-metrics; srt/observability/metrics_collector.py): the gauge
  `sglang:spec_accept_length` (accepted drafts + bonus token per verify step, set at each logged
  decode batch, `mostrecent` across processes), the counter `sglang:spec_verify_calls_total` (a new
  value of the gauge is only counted when it moved) and `sglang:num_running_reqs`;
* vLLM 0.32 (vllm/v1/spec_decode/metrics.py `SpecDecodingProm`): the counters
  `vllm:spec_decode_num_drafts_total`, `..._num_draft_tokens_total`, `..._num_accepted_tokens_total`
  and `..._num_accepted_tokens_per_pos_total{position="i"}` (one per draft position: k); the mean
  acceptance length of an interval is 1 + d(accepted) / d(drafts) (vLLM's own PromQL in that
  class's docstring); `vllm:num_requests_running` (vllm/v1/metrics/loggers.py) is the load.

The log: lines fed to logscan's LogScanner (its parser, its cold-start and #running-req rules),
read from where the file ended when verify started, reopened from its start when it is rotated
(a new inode) or truncated.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from sanitizer.logscan import LogScanner
from sanitizer.logscan.parse import MAX_ACCEPT_LEN, DecodeLine, parse_line

SGLANG_ACCEPT = "sglang:spec_accept_length"
SGLANG_VERIFY_CALLS = "sglang:spec_verify_calls_total"
SGLANG_RUNNING = "sglang:num_running_reqs"
SGLANG_DRAFT_TOKENS = "sglang:spec_num_draft_tokens"
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
VLLM_RUNNING = "vllm:num_requests_running"


class MetricsError(Exception):
    pass


@dataclass
class MetricsSnapshot:
    engine: str | None = None  # "sglang", "vllm" or None (neither's metrics)
    accept_len: float | None = None  # SGLang's gauge (the lowest over its series: a rank collapsing)
    verify_calls: float | None = None  # SGLang
    draft_tokens_per_step: float | None = None  # SGLang's sglang:spec_num_draft_tokens gauge
    drafts: float | None = None  # vLLM counters, summed over engines
    draft_tokens: float | None = None
    accepted: float | None = None
    positions: int | None = None  # vLLM: k, from the per-position counter's labels
    running: float | None = None

    @property
    def has_spec(self) -> bool:
        return self.accept_len is not None or self.verify_calls is not None or self.drafts is not None


def parse_metrics(text: str) -> MetricsSnapshot:
    from prometheus_client.parser import text_string_to_metric_families

    snap = MetricsSnapshot()
    sums: dict[str, float] = {}
    accept: list[float] = []
    positions: set[str] = set()
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                name, value = s.name, float(s.value)
                if not math.isfinite(value):
                    continue
                if snap.engine is None and (name.startswith("sglang:") or name.startswith("vllm:")):
                    snap.engine = name.split(":", 1)[0]
                if name == SGLANG_ACCEPT:
                    accept.append(value)
                elif name == VLLM_PER_POS:
                    positions.add(s.labels.get("position", ""))
                elif name in (SGLANG_VERIFY_CALLS, SGLANG_RUNNING, SGLANG_DRAFT_TOKENS, VLLM_DRAFTS,
                              VLLM_DRAFT_TOKENS, VLLM_ACCEPTED, VLLM_RUNNING):
                    sums[name] = sums.get(name, 0.0) + value
    except (ValueError, TypeError, IndexError, KeyError) as exc:  # what the parser raises on a malformed line
        raise MetricsError(f"not a Prometheus text page ({type(exc).__name__}: {str(exc)[:120]})") from None
    # an accept length counts the bonus token, so a verify step makes it >= 1; SGLang's gauge reads
    # 0 before the first one, and on a server without speculative decoding forever
    valid = [a for a in accept if 1 <= a <= MAX_ACCEPT_LEN]
    snap.accept_len = min(valid) if valid else None
    snap.verify_calls = sums.get(SGLANG_VERIFY_CALLS)
    snap.draft_tokens_per_step = sums.get(SGLANG_DRAFT_TOKENS)
    snap.drafts = sums.get(VLLM_DRAFTS)
    snap.draft_tokens = sums.get(VLLM_DRAFT_TOKENS)
    snap.accepted = sums.get(VLLM_ACCEPTED)
    snap.positions = len(positions) or None
    snap.running = sums.get(SGLANG_RUNNING, sums.get(VLLM_RUNNING))
    return snap


@dataclass
class Reading:
    """One acceptance reading: an interval's accept length and its load."""

    accept_len: float
    running: int | None
    cold: bool = False  # the log's first decode step of a batch just admitted (logscan's rule)
    where: str = ""  # log: file:line


def metrics_interval(prev: MetricsSnapshot | None, cur: MetricsSnapshot) -> Reading | None:
    """The acceptance between two polls, or None when no verify step happened between them."""
    running = None if cur.running is None else int(round(cur.running))
    if cur.drafts is not None and cur.accepted is not None:
        if prev is None or prev.drafts is None or prev.accepted is None:
            return None
        d_drafts, d_acc = cur.drafts - prev.drafts, cur.accepted - prev.accepted
        if d_drafts < 0 or d_acc < 0:  # counters went back: the server restarted
            return None
        if d_drafts == 0:
            return None
        return Reading(1.0 + d_acc / d_drafts, running)
    if cur.accept_len is not None:
        if cur.verify_calls is not None:
            if prev is None or prev.verify_calls is None or cur.verify_calls <= prev.verify_calls:
                return None  # the gauge did not move: no new verify step since the last poll
        return Reading(cur.accept_len, running)
    return None


def phase_accept_len(start: MetricsSnapshot | None, end: MetricsSnapshot | None) -> float | None:
    """vLLM: the mean acceptance length over a phase, from its counters at both ends."""
    if start is None or end is None or None in (start.drafts, start.accepted, end.drafts, end.accepted):
        return None
    d = end.drafts - start.drafts
    return 1.0 + (end.accepted - start.accepted) / d if d > 0 else None


@dataclass
class LogFollower:
    """Follows a server log as it grows (like `tail -F`): rotation and truncation reopen it."""

    path: str
    scanner: LogScanner
    max_line_chars: int = 1 << 20
    from_start: bool = False
    rotations: int = 0
    lines: int = 0
    error: str | None = None
    _f: object = None
    _inode: int | None = None
    _partial: str = ""
    _line_no: int = 0
    _intervals: int = 0
    _cold: int = 0

    def open(self) -> None:
        """At start: the log must exist; what it held before is not this run's (unless from_start)."""
        try:
            self._f = open(self.path, "r", encoding="utf-8", errors="replace", newline="")
            st = os.fstat(self._f.fileno())
        except OSError as exc:
            raise MetricsError(f"{self.path}: cannot read the log: {exc.strerror or exc}") from None
        self._inode = st.st_ino
        if not self.from_start:
            self._f.seek(0, os.SEEK_END)
            # line numbers stay those of the file: count what is skipped
            self._line_no = self._count_lines()

    def _count_lines(self) -> int:
        with open(self.path, "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))

    def poll(self) -> list[Reading]:
        """New decode intervals since the last poll."""
        out: list[Reading] = []
        if self._f is None:
            return out
        self._drain(out)
        try:
            st = os.stat(self.path)
        except OSError:
            return out  # rotated away and not yet recreated: keep the old handle, look again later
        pos = self._f.tell()
        if st.st_ino != self._inode or st.st_size < pos:
            self._drain(out)  # the end of the old file first
            self._f.close()
            try:
                self._f = open(self.path, "r", encoding="utf-8", errors="replace", newline="")
            except OSError:
                self._f = None
                return out
            self._inode = os.fstat(self._f.fileno()).st_ino
            self._partial, self._line_no = "", 0
            self.rotations += 1
            self._drain(out)
        return out

    def _drain(self, out: list[Reading]) -> None:
        while True:
            chunk = self._f.read(1 << 20)
            if not chunk:
                return
            text = self._partial + chunk
            lines = text.split("\n")
            self._partial = lines.pop()
            if len(self._partial) > self.max_line_chars:  # a line with no end in sight: not a log line
                self._partial = ""
            for line in lines:
                self._line_no += 1
                self.lines += 1
                if len(line) <= self.max_line_chars:
                    self._feed(line, out)

    def _feed(self, line: str, out: list[Reading]) -> None:
        r = self.scanner.result
        self.scanner.feed(self.path, self._line_no, line)
        n = r.intervals
        if n == self._intervals:
            return
        self._intervals = n
        cold = r.cold_start > self._cold
        self._cold = r.cold_start
        where = f"{self.path}:{self._line_no}"
        parsed = parse_line(line)
        if isinstance(parsed, DecodeLine) and parsed.accept_len is not None:
            out.append(Reading(parsed.accept_len, parsed.running_req, cold, where))
        elif r.records and r.records[-1].line == self._line_no:  # a vLLM interval
            rec = r.records[-1]
            out.append(Reading(rec.accept_len, rec.running_req, False, where))
