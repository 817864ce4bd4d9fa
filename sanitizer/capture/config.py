"""Capture settings, all from the environment (so that they reach every spawned process)."""
from __future__ import annotations

import os
from dataclasses import dataclass

STACK_MODES = ("none", "site", "full")
# HAZSAN_LEVEL: what is recorded. `full` (the default everywhere: HAZSAN=1, `hazsan run`, the pytest
# plugin): allocations, collectives, windows, scopes, streams, events and graphs, and one `launch`
# per op with the ranges it reads and writes, which the commonest asynchronous bug (a tensor touched
# before its collective's wait) needs; `alloc`: no launches, cheaper, every rule but
# `unordered-access` on kernels.
LEVELS = ("alloc", "full")
# HAZSAN_ALLOC_SOURCE: where CUDA block facts come from. `dispatch`: the dispatch mode alone;
# `history`: also the caching allocator's own record (allocator_history.py: real segments, and
# each block's address and stream checked against the allocator's). `history` is experimental and
# never the default: torch 2.11 crashed in it on a GPU (allocator_history.py).
ALLOC_SOURCES = ("dispatch", "history")
OFF_VALUES = ("", "0", "false", "no", "off")
# HAZSAN_TRACE_FORMAT: what the trace files hold. `binary` (the default: rank<R>.hzs, frames of
# msgpack arrays, smaller and faster to read) or `jsonl` (rank<R>.jsonl, JSON Lines, for people and
# tools that read lines); docs/trace-format.md. `hazsan cat` prints either as JSON Lines.
TRACE_FORMATS = ("binary", "jsonl")


#: The run a process belongs to: set by the first captured process of a run (or by `hazsan run`, the
#: pytest plugin) and inherited by every process it starts, so that `hazsan check` never judges the
#: files of two runs as one (docs/capture.md, "Runs").
RUN_ENV = "HAZSAN_RUN_ID"


def run_id(environ=os.environ) -> str:
    """This process's run id: the inherited one, else a new one, exported to `environ` so that
    every child started from here on inherits it. A new id reads as when and where the run began."""
    rid = (environ.get(RUN_ENV) or "").strip()
    if not rid:
        import secrets
        import time
        rid = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(2)}"
        environ[RUN_ENV] = rid
    return rid


#: Every variable capture and its commands read (docs/capture.md): a HAZSAN_* name close to one of
#: these but not one is a typo, said at start.
KNOWN_SETTINGS = frozenset({
    "HAZSAN", "HAZSAN_DIR", "HAZSAN_TRACE_FORMAT", "HAZSAN_LEVEL", "HAZSAN_STACKS", "HAZSAN_MAX_EVENTS",
    "HAZSAN_BUFFER_EVENTS", "HAZSAN_FLUSH_SECONDS", "HAZSAN_IDLE_SECONDS", "HAZSAN_STEP_FLUSH_SECONDS",
    "HAZSAN_WINDOW_BYTES", "HAZSAN_ALLOC_SOURCE", "HAZSAN_ALLOC_HISTORY_ENTRIES", "HAZSAN_NATIVE",
    "HAZSAN_NATIVE_CACHE", "HAZSAN_NATIVE_MAX_RECORDS", "HAZSAN_NATIVE_COLLECTIVES", "HAZSAN_NATIVE_PACKED",
    "HAZSAN_DEBUG", "HAZSAN_ENGINE", "HAZSAN_REQUIRE_COMPILED", "HAZSAN_RAISE", RUN_ENV, "HAZSAN_PYTEST_DIR",
})


def unknown_settings(environ=os.environ) -> list[str]:
    """Problems with HAZSAN_* names that are near misses of a setting (HAZSAN_LEVLE): such a name is
    read by nothing, so the setting it meant silently keeps its default. Names far from every
    setting (a program's own HAZSAN_MY_FLAG) are left alone."""
    import difflib

    out = []
    for name in sorted(environ):
        if name.startswith("HAZSAN") and name not in KNOWN_SETTINGS:
            near = difflib.get_close_matches(name, KNOWN_SETTINGS, n=1, cutoff=0.85)
            if near:
                out.append(f"{name} is not a setting (did you mean {near[0]}?); it is ignored")
    return out


def requested(environ=os.environ) -> bool:
    """Is capture asked for? (HAZSAN set to anything but an off value)."""
    return environ.get("HAZSAN", "").strip().lower() not in OFF_VALUES


@dataclass(frozen=True)
class Settings:
    directory: str = "hazsan-traces"       # HAZSAN_DIR
    stacks: str = "site"                   # HAZSAN_STACKS: none | site | full
    max_events: int = 20_000_000           # HAZSAN_MAX_EVENTS: per trace file, then counted drops
    buffer_events: int = 65_536            # HAZSAN_BUFFER_EVENTS: flush when this many are queued
    flush_seconds: float = 2.0             # HAZSAN_FLUSH_SECONDS: flush at least this often while busy
    idle_seconds: float = 0.05             # HAZSAN_IDLE_SECONDS: after a step, idle from then on (quiet)
    step_flush_seconds: float = 0.05       # HAZSAN_STEP_FLUSH_SECONDS: a step's end flushes if the last flush is this old
    window_bytes: int = 1 << 30            # HAZSAN_WINDOW_BYTES: CPU model of one symmetric window
    max_stack: int = 16                    # frames kept with HAZSAN_STACKS=full
    level: str = "full"                    # HAZSAN_LEVEL: full | alloc (docs/capture.md, "Settings")
    alloc_source: str = "dispatch"         # HAZSAN_ALLOC_SOURCE: dispatch | history
    alloc_history_entries: int = 1 << 20   # HAZSAN_ALLOC_HISTORY_ENTRIES: allocator ring buffer per step
    trace_format: str | None = None        # HAZSAN_TRACE_FORMAT: binary | jsonl (None: the writer's default, binary)

    @classmethod
    def from_env(cls, environ=os.environ) -> tuple["Settings", list[str]]:
        """Settings plus a list of problems (bad values fall back to defaults, never raise)."""
        problems: list[str] = []
        d = cls()

        def num(name, default, kind=int, minimum=1):
            raw = environ.get(name)
            if raw is None or raw == "":
                return default
            try:
                v = kind(raw)
                if v < minimum:
                    raise ValueError
                return v
            except ValueError:
                problems.append(f"{name}={raw!r} is not a number >= {minimum}; using {default}")
                return default

        stacks = environ.get("HAZSAN_STACKS", d.stacks).strip().lower() or d.stacks
        if stacks not in STACK_MODES:
            problems.append(f"HAZSAN_STACKS={stacks!r} is not one of {'|'.join(STACK_MODES)}; using 'site'")
            stacks = "site"
        level = environ.get("HAZSAN_LEVEL", d.level).strip().lower() or d.level
        if level not in LEVELS:
            problems.append(f"HAZSAN_LEVEL={level!r} is not one of {'|'.join(LEVELS)}; using {d.level!r}")
            level = d.level
        source = environ.get("HAZSAN_ALLOC_SOURCE", d.alloc_source).strip().lower() or d.alloc_source
        if source not in ALLOC_SOURCES:
            problems.append(f"HAZSAN_ALLOC_SOURCE={source!r} is not one of {'|'.join(ALLOC_SOURCES)}; "
                            f"using {d.alloc_source!r}")
            source = d.alloc_source
        fmt = (environ.get("HAZSAN_TRACE_FORMAT") or "").strip().lower() or None
        if fmt is not None and fmt not in TRACE_FORMATS:
            problems.append(f"HAZSAN_TRACE_FORMAT={fmt!r} is not one of {'|'.join(TRACE_FORMATS)}; using 'binary'")
            fmt = "binary"
        return cls(
            trace_format=fmt,
            level=level,
            alloc_source=source,
            alloc_history_entries=num("HAZSAN_ALLOC_HISTORY_ENTRIES", d.alloc_history_entries),
            directory=environ.get("HAZSAN_DIR") or d.directory,
            stacks=stacks,
            max_events=num("HAZSAN_MAX_EVENTS", d.max_events),
            buffer_events=num("HAZSAN_BUFFER_EVENTS", d.buffer_events),
            flush_seconds=num("HAZSAN_FLUSH_SECONDS", d.flush_seconds, float, 0),
            idle_seconds=num("HAZSAN_IDLE_SECONDS", d.idle_seconds, float, 0),
            step_flush_seconds=num("HAZSAN_STEP_FLUSH_SECONDS", d.step_flush_seconds, float, 0),
            window_bytes=num("HAZSAN_WINDOW_BYTES", d.window_bytes, int, 1 << 21),
        ), problems
