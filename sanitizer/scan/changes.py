"""`hazsan scan --changed-since REF`: keep the scopes whose code, or whose helpers' code, changed.

The changed lines come from `git diff --unified=0 REF` (the new side of each hunk; a pure
deletion marks the line after it) plus every untracked file, in the repository that holds each
scanned PATH. A scope is kept when a changed line falls in its `with` statement and body, or in
the body of any helper the classifier followed from it (to the scan's depth).
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from sanitizer.scan.scanner import ScanResult, ScopeReport

_HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")
GIT_TIMEOUT_S = 120


class ChangesError(Exception):
    """git is missing, PATH is not in a repository, or REF is unknown: one line, exit 2."""


def _git(cwd: Path, *args: str) -> str:
    try:
        proc = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                              timeout=GIT_TIMEOUT_S, errors="replace")
    except FileNotFoundError as exc:
        raise ChangesError("--changed-since needs git on PATH") from exc
    except subprocess.TimeoutExpired as exc:
        raise ChangesError(f"git {' '.join(args[:2])} took more than {GIT_TIMEOUT_S} s") from exc
    if proc.returncode != 0:
        msg = (proc.stderr.strip().splitlines() or ["failed"])[-1]
        raise ChangesError(f"git {' '.join(args[:2])} in {cwd}: {msg}")
    return proc.stdout


def changed_lines(roots: list[Path], ref: str) -> dict[str, set[int] | None]:
    """Real path of each changed file -> changed line numbers (None: the whole file)."""
    if ref.startswith("-"):
        raise ChangesError(f"--changed-since {ref!r}: a git ref cannot start with '-'")
    out: dict[str, set[int] | None] = {}
    tops: set[str] = set()
    for root in roots:
        where = root if root.is_dir() else root.parent
        tops.add(_git(where, "rev-parse", "--show-toplevel").strip())
    for top in sorted(tops):
        try:
            _git(Path(top), "rev-parse", "--verify", "--quiet", ref + "^{commit}")
        except ChangesError as exc:
            raise ChangesError(f"--changed-since {ref}: not a commit in {top}") from exc
        diff = _git(Path(top), "diff", "--unified=0", "--no-color", "--no-ext-diff", ref, "--", ".")
        current: str | None = None
        for line in diff.splitlines():
            if line.startswith("+++ "):
                name = line[4:]
                current = None if name == "/dev/null" else os.path.realpath(os.path.join(top, name[2:]))
                if current is not None:
                    out.setdefault(current, set())
            elif current is not None and line.startswith("@@"):
                m = _HUNK.match(line)
                if m:
                    start, count = int(m.group(1)), int(m.group(2) or 1)
                    lines = out[current]
                    if lines is not None:
                        lines.update(range(start, start + max(count, 1)))
        for name in _git(Path(top), "ls-files", "--others", "--exclude-standard", "-z").split("\0"):
            if name:
                out[os.path.realpath(os.path.join(top, name))] = None
    return out


def _spans(report: ScopeReport):
    yield str(report.path), report.line, report.end_line, report.file
    stack = list(report.records)
    while stack:
        rec = stack.pop()
        for rel, lo, hi in rec.spans:
            yield None, lo, hi, rel
        stack.extend(rec.inner)


def keep_changed(result: ScanResult, changes: dict[str, set[int] | None], rel_to_real: dict[str, str]) -> None:
    """Drop the scopes with no changed line in their own code or their helpers' code."""
    kept = []
    for r in result.scopes:
        hits = []
        for path, lo, hi, rel in _spans(r):
            real = os.path.realpath(path) if path else rel_to_real.get(rel)
            if real is None or real not in changes:
                continue
            lines = changes[real]
            if lines is None:
                hits.append(f"{rel} (new file)")
            else:
                touched = sorted(n for n in lines if lo <= n <= hi)
                if touched:
                    hits.append(f"{rel}:{touched[0]}" + (f"-{touched[-1]}" if len(touched) > 1 else ""))
        if hits:
            r.changed = list(dict.fromkeys(hits))
            kept.append(r)
    result.filtered["changed_since"] = len(result.scopes) - len(kept)
    result.scopes = kept
