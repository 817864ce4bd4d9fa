"""`hazsan scan --trace`: which scopes actually placed transients in a window at run time.

A transient at run time: an `alloc` made while a `scope` is entered, landing inside a live
`window`, and freed without any collective (`coll` bufs) having touched it. It is attributed to
the static scope whose body holds its site (or a frame of its stack), or holds the call of a
helper (followed by the scan) whose body holds it; innermost frame first, innermost scope first.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from sanitizer.scan.scanner import ScanResult, ScopeReport
from sanitizer.trace.reader import TraceError, expand_paths, open_trace

MAX_LISTED = 20


@dataclass
class RuntimeTransient:
    rank: int
    file: str          # trace file
    line: int          # line of the alloc event
    site: str | None
    stack: list[str]
    size: int


@dataclass
class _Block:
    transient: RuntimeTransient
    addr: int
    end: int
    used: bool = False


@dataclass
class TraceFacts:
    transients: list[RuntimeTransient] = field(default_factory=list)
    scope_sites: list[str] = field(default_factory=list)   # site of every scope enter that had one
    events: int = 0
    warnings: list[str] = field(default_factory=list)
    files: int = 0


def read_facts(paths: list[Path]) -> TraceFacts:
    facts = TraceFacts()
    for path in paths:
        _read_one(path, facts)
        facts.files += 1
    return facts


def _read_one(path: Path, facts: TraceFacts) -> None:
    tf = open_trace(path)
    rank = tf.rank
    windows: dict[int, int] = {}          # addr -> end
    depth = 0
    live: dict[object, _Block] = {}
    bad = 0
    for line_no, ev in tf.events():
        if isinstance(ev, TraceError):
            bad += 1
            if bad <= 5:
                facts.warnings.append(str(ev))
            continue
        facts.events += 1
        if not isinstance(ev, dict):
            continue
        kind = ev.get("ev")
        try:
            if kind == "window":
                windows[int(ev["addr"])] = int(ev["addr"]) + int(ev["size"])
            elif kind == "window_free":
                windows.pop(int(ev["addr"]), None)
            elif kind == "scope":
                if ev.get("enter"):
                    depth += 1
                    if isinstance(ev.get("site"), str):
                        facts.scope_sites.append(ev["site"])
                elif depth > 0:
                    depth -= 1
                else:
                    facts.warnings.append(f"{path}:{line_no}: scope exit without an enter")
            elif kind == "alloc":
                addr, size = int(ev["addr"]), int(ev["size"])
                if depth > 0 and any(lo <= addr and addr + size <= hi for lo, hi in windows.items()):
                    stack = [s for s in ev.get("stack") or [] if isinstance(s, str)]
                    site = ev.get("site") if isinstance(ev.get("site"), str) else None
                    t = RuntimeTransient(rank, str(path), line_no, site, stack, size)
                    live[ev["id"]] = _Block(t, addr, addr + size)
            elif kind == "coll":
                for buf in ev.get("bufs") or []:
                    lo = int(buf["addr"])
                    hi = lo + int(buf["size"])
                    for block in live.values():
                        if block.addr < hi and lo < block.end:
                            block.used = True
            elif kind == "free":
                block = live.pop(ev["id"], None)
                if block is not None and not block.used:
                    facts.transients.append(block.transient)
        except (KeyError, TypeError, ValueError) as exc:
            bad += 1
            if bad <= 5:
                facts.warnings.append(f"{path}:{line_no}: {kind} event unusable ({exc!r}); skipped")
    if bad > 5:
        facts.warnings.append(f"{path}: {bad - 5} more unusable line(s) skipped")
    facts.warnings.extend(tf.warnings)


def _parse_frame(frame: str) -> tuple[str, int] | None:
    """'file:line:function' -> (file, line); None when it does not have that shape."""
    parts = frame.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    return parts[0].replace(os.sep, "/"), int(parts[1])


def _same_file(trace_file: str, rel: str) -> bool:
    return trace_file == rel or trace_file.endswith("/" + rel)


class RuntimeMatcher:
    def __init__(self, paths: list[Path]):
        self.paths = paths

    @classmethod
    def from_path(cls, path: str | os.PathLike) -> "RuntimeMatcher":
        return cls(expand_paths([path]))   # raises TraceError on a missing path / empty dir

    def apply(self, result: ScanResult) -> None:
        facts = read_facts(self.paths)
        regions = [(r, self._regions(r)) for r in result.scopes]
        for r in result.scopes:
            r.runtime = {"entered": 0, "transients": 0, "bytes": 0, "sites": []}
        for site in facts.scope_sites:
            frame = _parse_frame(site)
            if frame is None:
                continue
            hit = self._innermost(frame, [(r, [(r.file, r.line, r.end_line)]) for r in result.scopes])
            if hit is not None:
                hit.runtime["entered"] += 1
        unattributed: dict[str, int] = {}
        attributed = 0
        for t in facts.transients:
            report = self._attribute(t, regions)
            label = t.site or (t.stack[0] if t.stack else "<no site>")
            if report is None:
                unattributed[label] = unattributed.get(label, 0) + 1
                continue
            attributed += 1
            rt = report.runtime
            rt["transients"] += 1
            rt["bytes"] += t.size
            if label not in rt["sites"] and len(rt["sites"]) < MAX_LISTED:
                rt["sites"].append(label)
        result.runtime = {
            "files": facts.files, "events": facts.events, "transients": len(facts.transients),
            "bytes": sum(t.size for t in facts.transients), "attributed": attributed,
            "unattributed": len(facts.transients) - attributed,
            "unattributed_sites": [f"{site} x{n}" for site, n in sorted(unattributed.items())][:MAX_LISTED],
            "warnings": facts.warnings,
        }

    @staticmethod
    def _regions(report: ScopeReport) -> list[tuple[str, int, int]]:
        """The scope body, then every helper body the scan followed from it."""
        out = [(report.file, report.body_span[0], report.body_span[1])]
        stack = list(report.records)
        while stack:
            rec = stack.pop()
            out.extend(rec.spans)
            stack.extend(rec.inner)
        return out

    def _attribute(self, t: RuntimeTransient, regions) -> ScopeReport | None:
        frames = t.stack or ([t.site] if t.site else [])
        # The scope's own body first (innermost frame up), then helper bodies.
        for only_body in (True, False):
            for frame_text in frames:
                frame = _parse_frame(frame_text)
                if frame is None:
                    continue
                cands = [(r, regs[:1] if only_body else regs[1:]) for r, regs in regions]
                hit = self._innermost(frame, cands)
                if hit is not None:
                    return hit
        return None

    @staticmethod
    def _innermost(frame: tuple[str, int], candidates) -> ScopeReport | None:
        file, line = frame
        best, best_len = None, None
        for report, spans in candidates:
            for rel, lo, hi in spans:
                if lo <= line <= hi and _same_file(file, rel):
                    if best is None or hi - lo < best_len:
                        best, best_len = report, hi - lo
        return best
