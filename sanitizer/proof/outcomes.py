"""Request outcomes: what a run's own output check found, next to its rank traces.

File: `outcomes.jsonl` (or `outcomes.jsonl.gz`) in the run directory, written by the program
under test (examples/ writes it after comparing each request's decode output with a reference
computed without symmetric memory). JSON Lines, no header, one object per request:

    {"request": 17, "step": 42, "rank": 0, "corrupted": true, "max_abs_err": 0.31}

| field | type | meaning |
|---|---|---|
| `request` | int or str, required | request id, unique within the file |
| `step` | int, required | the decode step (trace `step` event `n`) that produced the checked output; for a request spanning several steps, its last one |
| `corrupted` | bool, required | the output differed from the reference |
| `rank` | int or null | the rank whose output was checked; absent or null: every rank served it |
| `first_step` | int, optional | the first decode step of the request (default: `step`) |
| anything else | any | kept in `extra` and shown in JSON output (e.g. `max_abs_err`, `depth`, `tokens`) |

A request is *affected* when a finding lies on its rank (any rank if `rank` is null) in a step
from `first_step` to `step`; a corrupted request is *preceded by a finding* when a finding lies on
its rank in `step` or any earlier step. Blank lines are skipped; anything else that does not fit
is an `OutcomeError` naming file and line (hazsan compare exits 2). The name ends in `.jsonl`, so
hazsan compare leaves it out of the trace files of the directory.
"""
from __future__ import annotations

import gzip
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import orjson

OUTCOME_NAMES = ("outcomes.jsonl", "outcomes.jsonl.gz")
_KNOWN = frozenset({"request", "step", "rank", "corrupted", "first_step"})


class OutcomeError(Exception):
    def __init__(self, path, line: int | None, message: str):
        self.path, self.line = str(path), line
        super().__init__(f"{path}:{line}: {message}" if line else f"{path}: {message}")


@dataclass(slots=True)
class Outcome:
    request: int | str
    step: int
    corrupted: bool
    rank: int | None = None
    first_step: int | None = None
    line: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def steps(self) -> tuple[int, int]:
        return (self.step if self.first_step is None else self.first_step, self.step)


def find_outcomes(run_dir: Path) -> Path | None:
    for name in OUTCOME_NAMES:
        p = run_dir / name
        if p.is_file():
            return p
    return None


def _int(obj: dict, key: str, path, line: int, required: bool) -> int | None:
    v = obj.get(key)
    if v is None and not required:
        return None
    if type(v) is not int:
        raise OutcomeError(path, line, f"field {key!r} must be an integer, got {v!r}")
    return v


def read_outcomes(path: Path) -> list[Outcome]:
    """Parse an outcomes file. Raises OutcomeError on anything malformed."""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.name.endswith(".gz") else path.read_bytes()
    except (OSError, EOFError, zlib.error) as exc:
        raise OutcomeError(path, None, f"cannot read: {getattr(exc, 'strerror', None) or exc}") from exc
    out: list[Outcome] = []
    seen: dict = {}
    for line_no, text in enumerate(raw.split(b"\n"), 1):
        if not text.strip():
            continue
        try:
            obj = orjson.loads(text)
        except orjson.JSONDecodeError as exc:
            raise OutcomeError(path, line_no, f"not JSON: {exc}") from exc
        if not isinstance(obj, dict):
            raise OutcomeError(path, line_no, "each line must be a JSON object")
        req = obj.get("request")
        if type(req) not in (int, str):
            raise OutcomeError(path, line_no, f"field 'request' must be an integer or a string, got {req!r}")
        if req in seen:
            raise OutcomeError(path, line_no, f"request {req!r} already given on line {seen[req]} (one line per request)")
        seen[req] = line_no
        corrupted = obj.get("corrupted")
        if type(corrupted) is not bool:
            raise OutcomeError(path, line_no, f"field 'corrupted' must be true or false, got {corrupted!r}")
        step = _int(obj, "step", path, line_no, True)
        first = _int(obj, "first_step", path, line_no, False)
        if first is not None and first > step:
            raise OutcomeError(path, line_no, f"first_step {first} is after step {step}")
        out.append(Outcome(request=req, step=step, corrupted=corrupted,
                           rank=_int(obj, "rank", path, line_no, False), first_step=first, line=line_no,
                           extra={k: v for k, v in obj.items() if k not in _KNOWN}))
    return out
