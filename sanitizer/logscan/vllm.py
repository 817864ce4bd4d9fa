"""One vLLM server log line -> a stats record, a spec-decode record, a recognised-but-broken line,
or nothing (docs/logscan-formats.md says what is read and why).

vLLM's V1 engine logs, every VLLM_LOG_STATS_INTERVAL seconds (default 10) per engine, from the
process that owns the stat loggers (the API server, or the `LLM` process offline), two lines in a
row through the same `log_fn` (`vllm/v1/metrics/loggers.py` `LoggingStatLogger.log`, then
`vllm/v1/spec_decode/metrics.py` `SpecDecodingLogging.log`)::

    (APIServer pid=7) INFO 03-01 10:00:10 [loggers.py:271] Engine 000: Avg prompt throughput:
    0.0 tokens/s, Avg generation throughput: 812.4 tokens/s, Running: 64 reqs, Waiting: 0 reqs,
    GPU KV cache usage: 41.2%, Prefix cache hit rate: 12.5%
    (APIServer pid=7) INFO 03-01 10:00:10 [metrics.py:126] SpecDecoding metrics: Mean acceptance
    length: 3.21, Accepted throughput: ..., Drafted throughput: ..., Accepted: N tokens, Drafted:
    N tokens, Per-position acceptance rate: 0.900, 0.800, 0.510, Avg Draft acceptance rate: 74.0%

The logger's format (`vllm/logger.py` 0.32) is `{VLLM_LOGGING_PREFIX}(%(vllm_process_name)s
pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s`, date `%m-%d
%H:%M:%S`; 0.10-0.2x put the same `(name pid=N)` prefix in front of each line by wrapping stdout,
and older versions had none. `ColoredFormatter` adds ANSI colours around the prefix, the level,
the time and the file info.

The stats line (`Engine NNN: ` per engine, `N Engines Aggregated: ` with aggregated logging,
nothing before 0.8): `Avg prompt throughput`, `Avg generation throughput`, `Running: N reqs`,
`Waiting: N reqs`, optional `Deferred`, `KV fetch`, `Preemptions`, then `{GPU,CPU,XPU,...} KV
cache usage` (the device's name since 0.2x; `GPU KV cache usage` before), optional `Prefix cache
hit rate`, `Corrupted`, `External prefix cache hit rate`, `MM cache hit rate`. Only `Running`
matters here; the other fields are kept by name.

The spec-decode line, in the orders vLLM has written it (release numbers inferred from the pull
requests' merge dates; nothing depends on them: fields are read by name, the bonus token by value):

* 0.32 (the order since PR #24127, Sept 2025): `Mean acceptance length`, `Accepted throughput`,
  `Drafted throughput`, `Accepted: N tokens`, `Drafted: N tokens`, `Per-position acceptance
  rate: r1, r2, ...`, `Avg Draft acceptance rate: P%`;
* PR #24127's posted test output: `Draft acceptance rate: P%`, `Mean acceptance length`, the two
  throughputs, `Accepted`, `Drafted`, `Per-position acceptance rate`;
* PR #16665 (April 2025, 0.8.5) to PR #24127: `Draft acceptance rate: P%`, `Mean acceptance
  length`, `Accepted`, `Drafted`, `Per-position acceptance rate`. Until PR #17908 (May 2025,
  0.9.0) the mean acceptance length left the bonus token out; such a line is recognised by its
  value (without the bonus token it equals the sum of the per-position rates, with it one more)
  and one is added;
* PR #15902 (0.8.3-0.8.4): `Draft acceptance rate: P%, Accepted: N tokens, Drafted: N tokens`,
  no mean acceptance length: recognised, not an interval (as an SGLang line without accept len).

`Speculative metrics: ...` (the V0 engine, and V1 before PR #15902) carries no per-interval mean
acceptance length (V0's counts are cumulative since start): counted and reported, not read.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from sanitizer.logscan.parse import MAX_ACCEPT_LEN, BrokenLine

SPEC_MARKER = "SpecDecoding metrics:"
STATS_MARKER = "Avg prompt throughput:"
LEGACY_MARKER = "Speculative metrics:"

MEAN_LEN = "Mean acceptance length"
PER_POS = "Per-position acceptance rate"
RUNNING = "Running"

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# `(APIServer pid=12)`, `(EngineCore_DP0 pid=13)`, `(VllmWorker TP0 pid=14)`.
_PROC = re.compile(r"\((?P<name>[^()\n]{1,80}?) pid=(?P<pid>\d+)\)")
_TIME = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+(?P<ts>\d{2}-\d{2} \d{2}:\d{2}:\d{2}(?:[.,]\d+)?)")
_ENGINE = re.compile(r"(?:\bEngine (?P<idx>\d+)|(?<!\d)(?P<n>\d+) Engines Aggregated):\s*$")
# Fields are `Key: value` joined by ", "; a value may itself hold ", " (the per-position rates,
# `KV fetch: 1 waiting to start, 0 in progress, ...`), so only a ", " followed by a key (a letter,
# then key characters, then ": ") starts a new field.
_SPLIT = re.compile(r", (?=[A-Za-z][A-Za-z0-9 _()/.\-]{0,60}: )")


@dataclass(slots=True)
class VllmBroken(BrokenLine):
    """A vLLM metrics line that does not parse; `kind` says which record it was meant to be."""

    kind: str = ""  # "stats", "spec" or "interleaved"
    process: str = ""  # its process prefix, as far as the line goes


@dataclass(slots=True)
class VllmStats:
    """An `Avg prompt throughput: ..., Running: N reqs, ...` line."""

    process: str  # "APIServer pid=12"; "" when the line has no process prefix
    time: str | None
    engine: str | None  # "Engine 000", "2 Engines Aggregated"; None before vLLM 0.8
    running_req: int
    waiting_req: int | None
    fields: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class VllmSpec:
    """A `SpecDecoding metrics: ...` line. `accept_len` is None in the 0.8.3-0.8.4 format."""

    process: str
    time: str | None
    accept_len: float | None  # the mean acceptance length, bonus token included
    logged_accept_len: float | None  # as written (differs when the bonus token was added)
    bonus_added: bool
    accept_rate: float | None  # the draft acceptance rate as a fraction, like SGLang's accept rate
    accepted: int | None
    drafted: int | None
    per_position: list[float] | None
    fields: dict[str, str] = field(default_factory=dict)

    @property
    def num_spec_tokens(self) -> int | None:
        """k, the draft tokens per step: one per-position rate each."""
        return len(self.per_position) if self.per_position else None


@dataclass(slots=True)
class VllmLegacy:
    """A `Speculative metrics: ...` line (V0 engine or V1 <= 0.8.2): no interval accept length."""

    process: str
    time: str | None


def _header(text: str, at: int) -> tuple[str, str | None]:
    """The process prefix and time written before the message that starts at `at`."""
    head = text[:at]
    process = ""
    for m in _PROC.finditer(head):
        process = f"{m.group('name').strip()} pid={m.group('pid')}"
    t = _TIME.search(head)
    return process, (t.group("ts") if t else None)


def _fields(body: str) -> dict[str, str] | BrokenLine:
    fields: dict[str, str] = {}
    for part in _SPLIT.split(body.strip().rstrip(",")):
        key, colon, value = part.partition(":")
        key, value = key.strip(), value.strip()
        if not colon or not key or not value:
            return BrokenLine(f"field {part[:40]!r} has no value (line cut short?)")
        if key in fields:
            return BrokenLine(f"field {key[:40]!r} twice (interleaved writers?)")
        fields[key] = value
    return fields


def _percent(raw: str | None) -> float | None:
    if raw is None or not raw.endswith("%"):
        return None
    try:
        v = float(raw[:-1])
    except ValueError:
        return None
    return v / 100 if math.isfinite(v) else None


def _count(fields: dict[str, str], key: str, unit: str) -> int | None | BrokenLine:
    """`N reqs` / `N tokens` as an int; None when the field is absent."""
    raw = fields.get(key)
    if raw is None:
        return None
    number, _, rest = raw.partition(" ")
    if rest != unit or not number.isdigit() or not number.isascii():
        return BrokenLine(f"vLLM '{key}' is not 'N {unit}': {raw[:20]!r} (line cut short?)")
    return int(number)


def _stats(text: str, at: int) -> VllmStats | BrokenLine:
    process, ts = _header(text, at)
    eng = _ENGINE.search(text, max(0, at - 60), at)
    engine = None
    if eng is not None:
        engine = f"Engine {eng.group('idx')}" if eng.group("idx") else f"{eng.group('n')} Engines Aggregated"
    fields = _fields(text[at:])
    if isinstance(fields, BrokenLine):
        return BrokenLine(f"vLLM stats line: {fields.reason}")
    if RUNNING not in fields:
        return BrokenLine(f"vLLM stats line without '{RUNNING}: N reqs' (line cut short?)")
    if next(reversed(fields)) == RUNNING:  # every vLLM version writes fields after it
        return BrokenLine(f"vLLM stats line ends at '{RUNNING}' (line cut short?)")
    running = _count(fields, RUNNING, "reqs")
    if isinstance(running, BrokenLine):
        return running
    waiting = _count(fields, "Waiting", "reqs")
    if isinstance(waiting, BrokenLine):
        return waiting
    return VllmStats(process=process, time=ts, engine=engine, running_req=running, waiting_req=waiting,
                     fields=fields)


def _rates(raw: str | None) -> list[float] | None:
    if not raw:
        return None
    try:
        rates = [float(p) for p in raw.split(",")]
    except ValueError:
        return None
    return rates if all(0 <= r <= 1 for r in rates) else None


def _spec(text: str, at: int) -> VllmSpec | BrokenLine:
    process, ts = _header(text, at)
    fields = _fields(text[at + len(SPEC_MARKER):])
    if isinstance(fields, BrokenLine):
        return BrokenLine(f"vLLM 'SpecDecoding metrics': {fields.reason}")
    accepted = _count(fields, "Accepted", "tokens")
    drafted = _count(fields, "Drafted", "tokens")
    for v in (accepted, drafted):
        if isinstance(v, BrokenLine):
            return v
    if accepted is None or drafted is None:
        # Every format writes both after the acceptance rate and the mean acceptance length.
        return BrokenLine("vLLM 'SpecDecoding metrics' without 'Accepted: N tokens, Drafted: N tokens' "
                          "(line cut short?)")
    rate_raw = fields.get("Avg Draft acceptance rate", fields.get("Draft acceptance rate"))
    accept_rate = _percent(rate_raw)
    raw = fields.get(MEAN_LEN)
    per_position = _rates(fields.get(PER_POS))
    if raw is None:
        if rate_raw is None:
            return BrokenLine(f"vLLM 'SpecDecoding metrics' with neither '{MEAN_LEN}' nor an acceptance rate")
        return VllmSpec(process, ts, None, None, False, accept_rate, accepted, drafted, per_position, fields)
    try:
        logged = float(raw)
    except ValueError:
        return BrokenLine(f"vLLM '{MEAN_LEN}' is not a number: {raw[:20]!r}")
    if not 0 <= logged <= MAX_ACCEPT_LEN:  # nan, inf, negative or huge: not a real length
        return BrokenLine(f"vLLM '{MEAN_LEN}' out of range: {raw[:20]!r}")
    accept_len, bonus_added = logged, False
    if per_position:
        # The per-position rates sum to accepted tokens per draft; the mean acceptance length is
        # that plus the bonus token since vLLM 0.9.0, and was that alone in 0.8.5 (PR #17908).
        s = sum(per_position)
        tol = 0.006 + 0.0006 * len(per_position)  # %.2f and k times %.3f rounding
        if abs(logged - (1 + s)) > tol and abs(logged - s) <= tol:
            accept_len, bonus_added = logged + 1, True
    return VllmSpec(process, ts, accept_len, logged, bonus_added, accept_rate, accepted, drafted, per_position, fields)


def parse_vllm_line(text: str) -> VllmStats | VllmSpec | VllmLegacy | BrokenLine | None:
    """Parse one log line. None: not a vLLM stats or spec-decode line."""
    if SPEC_MARKER not in text and STATS_MARKER not in text and LEGACY_MARKER not in text:
        return None
    if "\x1b" in text:
        text = _ANSI.sub("", text)
    text = text.rstrip("\r\n")
    n_spec, n_stats = text.count(SPEC_MARKER), text.count(STATS_MARKER)
    if n_spec + n_stats > 1:
        return VllmBroken("two vLLM metrics records on one line (interleaved writers?)", "interleaved",
                          _header(text, min(i for i in (text.find(SPEC_MARKER), text.find(STATS_MARKER)) if i >= 0))[0])
    kind, at = ("spec", text.find(SPEC_MARKER)) if n_spec else ("stats", text.find(STATS_MARKER))
    if at < 0:
        process, ts = _header(text, text.find(LEGACY_MARKER))
        return VllmLegacy(process, ts)
    got = _spec(text, at) if n_spec else _stats(text, at)
    if isinstance(got, BrokenLine):
        return VllmBroken(got.reason, kind, _header(text, at)[0])
    return got
