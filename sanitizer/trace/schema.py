"""Schema 1 of the hazsan trace (docs/trace-format.md, "Event kinds"), as data.

The reader and the engine use these tables to name fields in error messages and to tell known
fields from unknown ones (unknown ones are ignored with a counted warning).
"""
from __future__ import annotations

SCHEMA_VERSION = 1

#: Fields every event may carry (all optional).
COMMON_FIELDS = frozenset({"ev", "t", "step", "site", "stack", "op", "shape", "dtype"})

#: Known event kinds -> the fields docs/trace-format.md ("Event kinds") names for them (required and optional together).
EVENT_FIELDS: dict[str, frozenset[str]] = {
    "segment": frozenset({"addr", "size", "pool"}),
    "segment_free": frozenset({"addr", "pool"}),
    "window": frozenset({"addr", "size", "comm"}),
    "window_free": frozenset({"addr", "comm"}),
    # token_dims: which dimensions of `shape` scale with the step's token count (hazsan sweep).
    "alloc": frozenset({"id", "addr", "size", "stream", "pool", "requested", "segment", "token_dims"}),
    "free": frozenset({"id"}),
    "free_done": frozenset({"id"}),
    "record_stream": frozenset({"id", "stream"}),
    "launch": frozenset({"stream", "reads", "writes"}),
    "coll": frozenset({"cid", "comm", "seq", "op", "stream", "bufs"}),
    # observed: capture saw it finish, the program did not wait (docs/ordering-and-rules.md)
    "coll_done": frozenset({"cid", "observed"}),
    "record": frozenset({"event", "stream"}),
    "wait": frozenset({"event", "stream"}),
    "sync": frozenset({"stream", "event"}),
    "graph_begin": frozenset({"graph", "stream", "pool"}),
    "graph_end": frozenset({"graph", "stream"}),
    "graph_replay": frozenset({"graph", "stream"}),
    "graph_free": frozenset({"graph"}),
    "scope": frozenset({"name", "enter", "pool", "comm", "no_split"}),
    "step": frozenset({"n", "phase", "tokens"}),
    # Written by capture (docs/trace-format.md, "Annotations and capture bookkeeping"): events the writer had to drop, and hook failures.
    "dropped": frozenset({"count", "reason"}),
    "hook_error": frozenset({"count", "hook", "error"}),
    # Host threads (docs/ordering-and-rules.md, "Host threads"): who issued the events that
    # follow, and the edges between threads the program made.
    "thread": frozenset({"thread", "lane", "name"}),
    "thread_start": frozenset({"thread", "lane"}),
    "thread_end": frozenset({"thread"}),
    "thread_join": frozenset({"thread"}),
    "release": frozenset({"sync"}),
    "acquire": frozenset({"sync"}),
}

ACCESS_CODES = {"r": 1, "w": 2, "rw": 3}

#: Names of trace files a directory argument reads: JSON Lines and the binary format
#: (docs/trace-format.md), plain or gzip-compressed. The reader tells the formats apart by their
#: first bytes, not by the name.
TRACE_SUFFIXES = (".jsonl", ".jsonl.gz", ".hzs", ".hzs.gz")


def is_trace_name(name: str) -> bool:
    return name.endswith(TRACE_SUFFIXES)


def jsonl_name(name: str) -> str:
    """The name a JSON Lines copy of trace `name` takes: rank0.hzs -> rank0.jsonl (.gz kept)."""
    for binary, text in ((".hzs.gz", ".jsonl.gz"), (".hzs", ".jsonl")):
        if name.endswith(binary):
            return name[:-len(binary)] + text
    return name


#: Files a run directory may hold beside the rank traces (the example's per-request outcomes,
#: see sanitizer.proof.outcomes); a directory argument skips them.
NON_TRACE_FILES = frozenset({"outcomes.jsonl", "outcomes.jsonl.gz"})
