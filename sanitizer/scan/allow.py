"""Allow-list: compute scopes a person has looked at and accepted, each with a reason.

Text format, one entry a line (``#`` starts a comment line)::

    srt/models/deepseek_v4.py:3499   output only; the kernel allocates nothing
    srt/layers/linear.py:RowParallelLinear.forward   GEMM output is the all-reduce input
    srt/mem_cache/*:*   KV pools: long-lived, registered once

The part before the first whitespace is FILE:LINE or FILE:FUNCTION (fnmatch globs allowed in
both halves; FUNCTION matches the qualified name, e.g. Class.method, or its last component), or
``call:CALLEE``: one call settled wherever it occurs, e.g. ``call:sgl_kernel.rmsnorm`` or
``call:self.quant_method.apply`` (a glob on the callee as written, its qualified name, or the
followed helper's qualified name): the call is then taken to write into the tensors it is given
and allocate nothing, and the scopes are classified again with that knowledge. The rest of the
line is the reason, which is required. TOML/JSON files hold the same as
``[[allow]] scope = "..."  reason = "..."``.
"""
from __future__ import annotations

import fnmatch
import json
from sanitizer.scan import _toml as tomllib
from dataclasses import dataclass
from pathlib import Path


class AllowListError(Exception):
    pass


@dataclass
class AllowEntry:
    pattern: str
    reason: str
    source: str        # file:line of the entry
    used: int = 0

    @property
    def is_call(self) -> bool:
        return self.pattern.startswith("call:")

    def matches_call(self, names) -> bool:
        glob = self.pattern[len("call:"):]
        for name in names:
            if not name:
                continue
            if fnmatch.fnmatchcase(name, glob) or fnmatch.fnmatchcase(name.split(" (")[0], glob):
                return True
        return False

    def matches(self, file: str, line: int, function: str) -> bool:
        if self.is_call:
            return False
        file_pat, _, where = self.pattern.rpartition(":")
        if not file_pat or not where:
            return False
        if not fnmatch.fnmatchcase(file, file_pat):
            return False
        if where.isdigit():
            return int(where) == line
        return (fnmatch.fnmatchcase(function, where)
                or fnmatch.fnmatchcase(function.rsplit(".", 1)[-1], where))


class AllowList:
    def __init__(self, entries: list[AllowEntry]):
        self.entries = entries

    @classmethod
    def load(cls, paths) -> "AllowList":
        entries: list[AllowEntry] = []
        for path in paths:
            entries += _load_one(Path(path))
        return cls(entries)

    def accept(self, file: str, line: int, function: str) -> AllowEntry | None:
        for entry in self.entries:
            if entry.matches(file, line, function):
                entry.used += 1
                return entry
        return None

    def settle(self, names) -> AllowEntry | None:
        """The `call:` entry that settles a call known by any of `names`, else None."""
        for entry in self.entries:
            if entry.is_call and entry.matches_call(names):
                entry.used += 1
                return entry
        return None

    @property
    def has_calls(self) -> bool:
        return any(e.is_call for e in self.entries)

    def unused(self) -> list[AllowEntry]:
        return [e for e in self.entries if not e.used]


def _load_one(path: Path) -> list[AllowEntry]:
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AllowListError(f"{path}: cannot read allow-list: {exc}") from exc
    if path.suffix in (".toml", ".json"):
        return _load_structured(path, raw)
    entries = []
    for no, line in enumerate(raw.splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.split(None, 1)
        pattern = parts[0]
        reason = parts[1].strip() if len(parts) > 1 else ""
        _check(path, no, pattern, reason)
        entries.append(AllowEntry(pattern, reason, f"{path}:{no}"))
    return entries


def _load_structured(path: Path, raw: str) -> list[AllowEntry]:
    try:
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise AllowListError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}") from exc
    items = data.get("allow") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise AllowListError(f"{path}: expected a list under 'allow'")
    entries = []
    for i, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise AllowListError(f"{path}: allow entry {i} is not a table/object")
        pattern, reason = item.get("scope", ""), item.get("reason", "")
        if not isinstance(pattern, str) or not isinstance(reason, str):
            raise AllowListError(f"{path}: allow entry {i}: 'scope' and 'reason' must be strings")
        _check(path, f"entry {i}", pattern, reason.strip())
        entries.append(AllowEntry(pattern, reason.strip(), f"{path}:entry {i}"))
    return entries


def _check(path: Path, where, pattern: str, reason: str) -> None:
    if pattern.startswith("call:"):
        if not pattern[len("call:"):]:
            raise AllowListError(f"{path}:{where}: entry {pattern!r} names no callee (call:NAME)")
        if not reason:
            raise AllowListError(f"{path}:{where}: entry {pattern!r} has no reason; say why it is accepted")
        return
    file_pat, sep, rest = pattern.rpartition(":")
    if not sep or not file_pat or not rest:
        raise AllowListError(f"{path}:{where}: entry {pattern!r} is not FILE:LINE or FILE:FUNCTION")
    if not reason:
        raise AllowListError(f"{path}:{where}: entry {pattern!r} has no reason; say why it is accepted")
