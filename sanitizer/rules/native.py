"""The C accelerator of the per-rank engine, and the choice between it and the Python one.

`engine.RankAnalyzer` is the statement of the algorithm; `_fastengine` (sanitizer/rules/
_fastengine.c, built by hatch_build.py at install time) runs the same algorithm on the same parsed
events, several times faster, and gives identical findings, problems and counters. Only the
per-event work moves to C; everything rare stays Python and is shared with the engine as is:
findings are made by `engine.RankAnalyzer._report` and `._transient`, `finish` is the engine's,
and the CollectiveMatcher gets the C ops through their `describe()`, `.line` and `.site`.

`feed_batch` takes parsed events (TraceFile.batches, as the Python engine) or raw lines
(`read_batches`, what analyze() uses). Raw lines are read by a scanner in C straight into the
engine's field table, without the dict, strs and ints orjson would build (most of the run's cost
otherwise); it takes only lines it understands completely (a compact object of schema fields, ASCII
strings without escapes, integers of up to 18 digits) and hands every other line to orjson.loads and
the dict path, so problems, warnings and line numbers stay exactly the Python engine's. Either way an
event is dropped as soon as it is applied, which spares the cyclic GC its passes over batches.
`_fastengine._scanner(False)` switches the scanner off (tests, benchmarks).

Which one runs: `HAZSAN_ENGINE=python|native|auto` (default auto: native when it is built).
`available` says whether the extension loaded; `reason` why not.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import orjson

from sanitizer.rules import engine
from sanitizer.trace.reader import TraceError
from sanitizer.trace.schema import ACCESS_CODES

ENV = "HAZSAN_ENGINE"
CHOICES = ("auto", "native", "python")

class _Stale(Exception):
    pass


def _check_source(module) -> None:
    """A checkout can keep an extension built from an older _fastengine.c: refuse it (the digest
    of the source is compiled in). Installed wheels ship the source beside it, so this holds there
    too; without the source there is nothing to compare."""
    src = Path(__file__).with_name("_fastengine.c")
    try:
        digest = hashlib.sha256(src.read_bytes()).hexdigest()[:16]
    except OSError:
        return
    if getattr(module, "SOURCE_DIGEST", None) != digest:
        raise _Stale(f"C engine accelerator was built from an older {src.name}; rebuild: python hatch_build.py")


try:
    from sanitizer.rules import _fastengine
except ImportError as exc:  # not built (no compiler at install time) or built for another Python
    _fastengine = None
    available = False
    reason = f"C engine accelerator not built ({exc}); run: python hatch_build.py"
else:
    try:
        _check_source(_fastengine)
        # field numbering and allowed fields per kind come from the schema tables themselves; a
        # schema with a kind the C code does not handle is refused here, not ignored later
        _fastengine.setup(engine._ALLOWED, TraceError, ACCESS_CODES)
        available, reason = True, None
    except _Stale as exc:
        available, reason = False, str(exc)
    except (ValueError, TypeError) as exc:
        available, reason = False, f"C engine accelerator does not match this schema: {exc}"


if available:

    class RankAnalyzer(_fastengine.Analyzer):
        """engine.RankAnalyzer's interface as analyze() uses it, with the event loop in C."""

        # Rare paths, shared with the Python engine so that findings are made in one place.
        _report = engine.RankAnalyzer._report
        _transient = engine.RankAnalyzer._transient
        finish = engine.RankAnalyzer.finish
        feed = engine.RankAnalyzer.feed

        def __init__(self, trace, sink, matcher, peer_completion: str = engine.LOCAL):
            super().__init__(str(trace.path), trace.rank, sink, matcher, peer_completion == engine.SUCCESSOR)
            self.trace = trace

        def read_batches(self, size: int = 4096):
            """This rank's trace as (first line number, [raw line, ...]) batches, for feed_batch.

            Raw lines rather than parsed events: feed_batch then reads each line (the C scanner,
            else orjson) and applies it at once, so no batch of parsed events stays alive and the
            cyclic GC has nothing young to walk (with TraceFile.batches() it spends about a third
            of the run there). Outcome identical to TraceFile.batches(): the reader's line_batches does the
            stream handling (plain or gzip, a compressed stream cut short, read errors), and
            feed_batch handles blank lines, "not JSON" lines and a last line cut short as
            TraceFile.batches() does.
            """
            return self.trace.line_batches(size)

        def feed_batch(self, first: int, items: list, problems: list) -> None:
            """Apply a batch: parsed events (TraceFile.batches) or raw lines (read_batches)."""
            if items and type(items[0]) is bytes:
                trace = self.trace
                cut = self._feed_lines(first, items, problems, orjson.loads, orjson.JSONDecodeError, trace.path)
                if cut is not None:
                    trace._truncate(cut)
            else:
                _fastengine.Analyzer.feed_batch(self, first, items, problems)

else:
    RankAnalyzer = None  # type: ignore[assignment,misc]


def engine_name(choice: str | None = None) -> str:
    """'native' or 'python': what `choice` (default: $HAZSAN_ENGINE, else auto) selects here."""
    choice = (choice if choice is not None else os.environ.get(ENV, "auto")).strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "native" and not available:
        raise RuntimeError(f"{ENV}=native, but {reason}")
    if choice == "python" or not available:
        return "python"
    return "native"


def analyzer_class(choice: str | None = None):
    """The RankAnalyzer class to use: native when built (and not HAZSAN_ENGINE=python)."""
    return RankAnalyzer if engine_name(choice) == "native" else engine.RankAnalyzer
