"""Allow-list files: the one reader behind `hazsan scan --allow` and the pytest plugin's `--hazsan-allow`.

Both accept TOML or JSON, an `allow` list of tables of strings, each with a `reason`; `scan` also
reads a plain text format (one `PATTERN reason...` a line, `#` comments). What the entries mean is
the caller's (scope patterns for the scan, rule/site/test for the plugin): this module reads the
file, checks its shape, and names the file and line of every problem, so that a mistake in an
allow-list is never a silent acceptance.
"""
from __future__ import annotations

import fnmatch
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


# ------------------------------------------------------------------ findings accepted (suppressions)
# One format for the pytest plugin's allow-list and the suppressions of `hazsan check` / `hazsan run`
# (docs/ci.md): `[[allow]]` tables with `rule`, `site` (an fnmatch pattern), `test` (plugin only) and
# the required `reason`.

FINDING_FIELDS = frozenset({"rule", "site", "test", "reason"})


class Allowance:
    """One accepted kind of finding: any of rule, site, test may be None (matches everything)."""

    __slots__ = ("rule", "site", "test", "reason", "source")

    def __init__(self, rule=None, site=None, test=None, reason=None, source=""):
        if rule is None and site is None:
            raise AllowListError(f"{source}: an allowance needs a rule, a site or both")
        from sanitizer.rules.findings import RULES
        if rule is not None and rule not in RULES:
            raise AllowListError(f"{source}: unknown rule {rule!r} (one of {', '.join(RULES)})")
        self.rule, self.site, self.test, self.reason, self.source = rule, site, test, reason, source

    def __getstate__(self):          # pickled to `hazsan check --jobs` workers
        return tuple(getattr(self, k) for k in self.__slots__)

    def __setstate__(self, state):
        for k, v in zip(self.__slots__, state):
            setattr(self, k, v)

    def accepts(self, finding, nodeid: str | None = None) -> bool:
        """`nodeid`: the pytest test the finding came from (None outside the plugin: an entry
        naming a test then accepts nothing)."""
        if self.rule is not None and finding.rule != self.rule:
            return False
        if self.test is not None and (nodeid is None or not fnmatch.fnmatchcase(nodeid, self.test)):
            return False
        if self.site is None:
            return True
        return any(_site_matches(s, self.site) for s in _sites_of(finding))


def _sites_of(f) -> list[str]:
    out = [f.site] if f.site else []
    for part in (f.block, f.op):
        if part:
            if part.get("site"):
                out.append(part["site"])
            out.extend(part.get("stack") or ())
    return [s for s in out if isinstance(s, str)]


def _site_matches(site: str, pattern: str) -> bool:
    for p in (pattern, pattern + ":*"):
        if fnmatch.fnmatchcase(site, p) or fnmatch.fnmatchcase(site, "*/" + p):
            return True
    return False


def load_allow_list(path) -> list[Allowance]:
    return [Allowance(e.fields.get("rule"), e.fields.get("site"), e.fields.get("test"), e.fields["reason"], e.source)
            for e in read_entries(path, FINDING_FIELDS)]


class Suppressions:
    """What `hazsan check --suppressions FILE` accepts: a finding any entry accepts is counted, not
    reported (the engine's FindingSink asks `accepts`)."""

    def __init__(self, allowances: list[Allowance]):
        self.allowances = list(allowances)

    def __call__(self, finding) -> bool:
        return any(a.accepts(finding) for a in self.allowances)


def suppression_entries(findings) -> str:
    """TOML `[[allow]]` entries, one per rule and headline site of `findings` (valgrind's
    --gen-suppressions): each with an empty reason, which the reader refuses until it is filled in,
    so that no finding is accepted without saying why."""
    seen: dict[tuple, int] = {}
    for f in findings:
        key = (f.rule, _short_site(f.headline_site()))
        seen[key] = seen.get(key, 0) + 1
    out = ["# hazsan suppressions (the pytest plugin's allow-list format): fill in each reason,",
           "# then pass this file to `hazsan check --suppressions FILE` or `pytest --hazsan-allow FILE`."]
    for (rule, site), n in seen.items():
        out += ["", "[[allow]]", f'rule = "{rule}"']
        if site:
            out.append(f"site = {json.dumps(site)}")
        out.append(f'reason = ""   # why are these {n} finding(s) accepted? (required)')
    return "\n".join(out) + "\n"


def _short_site(site: str | None) -> str | None:
    """'path/to/x.py:12:fn' -> 'x.py:12' (matched against the tail of every site)."""
    if not site:
        return None
    path, _, rest = site.partition(":")
    line = rest.split(":", 1)[0]
    return f"{Path(path).name}:{line}" if line.isdigit() else Path(path).name
