"""Allow-list files: the one reader behind `hazsan scan --allow` and the pytest plugin's `--hazsan-allow`.

Both accept TOML or JSON, an `allow` list of tables of strings, each with a `reason`; `scan` also
reads a plain text format (one `PATTERN reason...` a line, `#` comments). What the entries mean is
the caller's (scope patterns for the scan, rule/site/test for the plugin): this module reads the
file, checks its shape, and names the file and line of every problem, so that a mistake in an
allow-list is never a silent acceptance.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from sanitizer.scan import _toml as tomllib


class AllowListError(Exception):
    """A bad allow-list (unreadable, malformed, or an entry without its reason): names file and line."""


@dataclass(frozen=True)
class RawEntry:
    """One entry as written: its fields (strings) and where it is (`path:line`)."""
    fields: dict
    source: str


_TABLE_HEADER = re.compile(r"^[ \t]*\[\[[ \t]*allow[ \t]*\]\]", re.MULTILINE)


def read_entries(path, fields: frozenset, *, text_field: str | None = None) -> list[RawEntry]:
    """The entries of allow-list `path`, each a table whose keys are among `fields`, all strings,
    with a non-empty `reason`.

    text_field: when given, a file that is neither .toml nor .json is read as text, one entry a
    line: the first word goes in `text_field`, the rest of the line is the reason."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise AllowListError(f"{path}: cannot read allow-list: {getattr(exc, 'strerror', None) or exc}") from None
    if path.suffix in (".toml", ".json"):
        return _read_tables(path, raw, fields)
    if text_field is None:
        raise AllowListError(f"{path}: an allow-list is a .toml or .json file")
    entries = []
    for no, line in enumerate(raw.splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        parts = text.split(None, 1)
        reason = parts[1].strip() if len(parts) > 1 else ""
        source = f"{path}:{no}"
        if not reason:
            raise AllowListError(f"{source}: entry {parts[0]!r} has no reason; say why it is accepted")
        entries.append(RawEntry({text_field: parts[0], "reason": reason}, source))
    return entries


def _read_tables(path: Path, raw: str, fields: frozenset) -> list[RawEntry]:
    try:
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw)
    except (ValueError, tomllib.TOMLDecodeError) as exc:     # JSONDecodeError is a ValueError
        raise AllowListError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}") from None
    items = data.get("allow") if isinstance(data, dict) else None
    if not isinstance(items, list):
        raise AllowListError(f"{path}: expected a list of tables under 'allow'")
    # TOML: the line of each [[allow]] header, so that an error names it (tomllib keeps no lines)
    lines = [raw.count("\n", 0, m.start()) + 1 for m in _TABLE_HEADER.finditer(raw)] \
        if path.suffix == ".toml" else []
    entries = []
    for i, item in enumerate(items, 1):
        source = f"{path}:{lines[i - 1]}" if len(lines) == len(items) else f"{path}: allow entry {i}"
        if not isinstance(item, dict):
            raise AllowListError(f"{source}: an allow entry is a table with {', '.join(sorted(fields))}")
        unknown = set(item) - fields
        if unknown:
            raise AllowListError(f"{source}: unknown key(s) {', '.join(sorted(unknown))} "
                                 f"(an entry has {', '.join(sorted(fields))})")
        bad = sorted(k for k, v in item.items() if not isinstance(v, str))
        if bad:
            raise AllowListError(f"{source}: {', '.join(bad)} must be string(s)")
        if not item.get("reason", "").strip():
            raise AllowListError(f"{source}: say why it is accepted (reason)")
        entries.append(RawEntry({k: (v.strip() if k == "reason" else v) for k, v in item.items()}, source))
    return entries
