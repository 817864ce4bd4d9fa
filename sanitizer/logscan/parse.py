"""One SGLang server log line -> a decode record, a recognised-but-broken line, or nothing.

The formats, as SGLang's schedulers write them (logger format `[%(asctime)s{.msecs}{prefix}] %(message)s`):

* 0.5.x, `srt/managers/scheduler_components/metrics_reporter.py`::

    [2026-03-01 10:00:00 DP0 TP0 EP0] Decode batch, #running-req: 64, #token: 81234, token usage: 0.42,
    accept len: 3.21, accept rate: 0.74, cap len: 3.90, block accept len: 3.40, cuda graph: True,
    gen throughput (token/s): 4567.89, #queue-req: 0

  ` [iter]` follows `Decode batch` with SGLANG_LOG_FORWARD_ITERS=1. Hybrid-SWA models replace
  `#token`/`token usage` with `#full token`, `full token usage`, `#swa token`, `swa token usage`
  (hybrid SSM adds `mamba num`/`mamba usage`). `accept rate`, `cap len`, `block accept len`,
  DSPARK's `est uncap acc len: M [lo, hi]`, disaggregation and MFU fields are all optional.
* Older `scheduler.py` (0.4.x): `Decode batch. #running-req: N, #token: N, token usage: U,
  accept len: X.XX, [cuda graph: B,] gen throughput (token/s): T, #queue-req: Q, ` (no accept rate,
  trailing comma).

The timestamp bracket carries the rank prefix: ` DPd`, ` PPp`, ` ATTN_CPc`, ` MOE_DPm`, ` TPt`,
` EPe` (scheduler.py `configure_scheduler_process`), with optional milliseconds (SGLANG_LOG_MS).

Only the field named exactly `accept len` is the accept length: `block accept len` (tokens
accepted per verify block under CAP_ACCEPT) and `est uncap acc len` are different quantities.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

MARKER = "Decode batch"

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# `Decode batch` [ [iter]] then `,` (0.5.x) or `.` (older), then the fields.
_HEAD = re.compile(r"Decode batch(?: \[(?P<iter>\d+)\])?(?P<sep>[,.])[ \t]*(?P<fields>.*)$")
# The logger's bracket right before the message: timestamp and/or rank tags.
_BRACKET = re.compile(
    r"\[(?P<ts>\d{4}-\d{2}-\d{2}[ T]\d{2}:\d{2}:\d{2}(?:[.,]\d+)?)?(?P<ranks>(?:\s*[A-Z][A-Z_]*\d+)*)\s*\]\s*$"
)
_RANK_TAG = re.compile(r"[A-Z][A-Z_]*\d+")
# Fields are `key: value` separated by commas; a value may hold a bracketed list with commas
# (`est uncap acc len: 3.40 [3.10, 3.70]`), so a comma whose next bracket is a `]` does not split.
_DELIMS = re.compile(r"[,\[\]]")

ACCEPT_LEN = "accept len"
#: Far beyond any speculative draft length (tokens accepted per verify step): larger values are
#: not rates but damage, and would only stretch the histogram and the plot to infinity.
MAX_ACCEPT_LEN = 1e6
RUNNING_REQ = "#running-req"


@dataclass(slots=True)
class DecodeLine:
    """A parsed `Decode batch` line. `accept_len` is None when speculative decoding is off."""

    prefix: str  # rank tags from the timestamp bracket, e.g. "DP0 TP3"; "" when there are none
    time: str | None
    iter: int | None
    running_req: int
    accept_len: float | None
    fields: dict[str, str] = field(default_factory=dict)

    def number(self, key: str) -> float | None:
        """A numeric field (`accept rate`, `cap len`, `block accept len`, ...), None if absent."""
        raw = self.fields.get(key)
        if raw is None:
            return None
        try:
            return float(raw.split(" [", 1)[0].rstrip("%"))
        except ValueError:
            return None


@dataclass(slots=True)
class BrokenLine:
    """A line that carries `Decode batch` but does not parse (cut short, interleaved, edited)."""

    reason: str


def split_fields(text: str) -> list[str]:
    """Split on the commas whose next bracket (if any) is not a `]`.

    One pass from the right over the commas and brackets, so linear in the line's length (the
    lookahead `,(?![^[]*])` it replaces rescanned the rest of the line at every comma).
    """
    cuts = []
    closing_ahead = False  # the nearest bracket to the right is a `]`
    for m in reversed(list(_DELIMS.finditer(text))):
        pos, c = m.start(), m.group()
        if c == ",":
            if not closing_ahead:
                cuts.append(pos)
        else:
            closing_ahead = c == "]"
    parts, start = [], 0
    for pos in reversed(cuts):
        parts.append(text[start:pos])
        start = pos + 1
    parts.append(text[start:])
    return parts


PREFILL_MARKER = "Prefill batch"
_PREFILL = re.compile(r"Prefill batch(?: \[\d+\])?[,.].*?#new-seq: (?P<new>\d+)")


@dataclass(slots=True)
class PrefillLine:
    """A `Prefill batch` line: how many requests that prefill admitted (`#new-seq`)."""

    prefix: str
    new_seq: int


def parse_prefill(text: str) -> PrefillLine | None:
    """A `Prefill batch, #new-seq: N, ...` line (SGLang's scheduler), else None (never raises)."""
    at = text.find(PREFILL_MARKER)
    if at < 0:
        return None
    m = _PREFILL.match(text, at)
    if m is None:
        return None
    bracket = _BRACKET.search(text, 0, at)
    prefix = " ".join(_RANK_TAG.findall(bracket.group("ranks"))) if bracket is not None else ""
    return PrefillLine(prefix=prefix, new_seq=int(m.group("new")))


def parse_line(text: str) -> DecodeLine | BrokenLine | None:
    """Parse one log line. None: not a decode line at all (prefill, HTTP, warnings, ...)."""
    at = text.find(MARKER)
    if at < 0:
        return None
    if "\x1b" in text:
        text = _ANSI.sub("", text)
        at = text.find(MARKER)
    text = text.rstrip("\r\n")
    if text.count(MARKER) > 1:
        return BrokenLine("two 'Decode batch' records on one line (interleaved writers?)")
    head = _HEAD.match(text, at)
    if head is None:
        return BrokenLine("'Decode batch' not followed by ',' or '.' and fields")
    prefix, ts = "", None
    bracket = _BRACKET.search(text, 0, at)
    if bracket is not None and (bracket.group("ts") or bracket.group("ranks").strip()):
        ts = bracket.group("ts")
        prefix = " ".join(_RANK_TAG.findall(bracket.group("ranks")))
    fields: dict[str, str] = {}
    for part in split_fields(head.group("fields")):
        part = part.strip()
        if not part:
            continue  # older formats end with ", "
        key, colon, value = part.partition(":")
        value = value.strip()
        if not colon or not value:
            return BrokenLine(f"field {part[:40]!r} has no value (line cut short?)")
        fields[key.strip()] = value
    running = fields.get(RUNNING_REQ)
    if running is None:
        return BrokenLine(f"no '{RUNNING_REQ}' field")
    try:
        running_req = int(running)
    except ValueError:
        return BrokenLine(f"'{RUNNING_REQ}' is not an integer: {running[:20]!r}")
    accept_len = None
    raw = fields.get(ACCEPT_LEN)
    if raw is not None:
        try:
            accept_len = float(raw)
        except ValueError:
            return BrokenLine(f"'{ACCEPT_LEN}' is not a number: {raw[:20]!r}")
        if not 0 <= accept_len <= MAX_ACCEPT_LEN:  # nan, inf, negative or huge: not a real rate
            return BrokenLine(f"'{ACCEPT_LEN}' out of range: {raw[:20]!r}")
    it = head.group("iter")
    return DecodeLine(prefix=prefix, time=ts, iter=int(it) if it else None,
                      running_req=running_req, accept_len=accept_len, fields=fields)
