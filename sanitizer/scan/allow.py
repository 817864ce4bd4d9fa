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
from dataclasses import dataclass
from pathlib import Path

from sanitizer.allowlist import AllowListError, read_entries

__all__ = ["AllowEntry", "AllowList", "AllowListError"]


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
    entries = []
    for raw in read_entries(path, frozenset({"scope", "reason"}), text_field="scope"):
        pattern = raw.fields.get("scope", "")
        _check(raw.source, pattern, raw.fields["reason"])
        entries.append(AllowEntry(pattern, raw.fields["reason"], raw.source))
    return entries


def _check(source: str, pattern: str, reason: str) -> None:
    if pattern.startswith("call:"):
        if not pattern[len("call:"):]:
            raise AllowListError(f"{source}: entry {pattern!r} names no callee (call:NAME)")
        if not reason:
            raise AllowListError(f"{source}: entry {pattern!r} has no reason; say why it is accepted")
        return
    file_pat, sep, rest = pattern.rpartition(":")
    if not sep or not file_pat or not rest:
        raise AllowListError(f"{source}: entry {pattern!r} is not FILE:LINE or FILE:FUNCTION")
    if not reason:
        raise AllowListError(f"{source}: entry {pattern!r} has no reason; say why it is accepted")
