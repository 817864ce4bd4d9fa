"""Schema 1 events as typed records, decoded by msgspec (docs/trace-format.md).

Every field is type-checked while the line is decoded, by msgspec's JSON decoder (a maintained,
fuzzed library), never by hand-written scanning: the engine receives records whose fields already
have their types. One class per event kind, tagged by `ev`; the field names are schema.EVENT_FIELDS
(a test checks that they agree).

`EventDecoder` turns raw lines into records, or into a one-line problem naming the field, and
counts unknown kinds and unknown fields (ignored with a warning, docs/trace-format.md). Problems
are (line, message) pairs; the driver adds the file name.
"""
from __future__ import annotations

import re
from typing import Annotated, Literal, Optional, Union

import msgspec

#: Names of streams, events, blocks, collectives, graphs, communicators and pools.
Key = Union[int, str]
#: Device addresses below 3 * 2**61 (user space is below 2**57; capture models CPU symmetric windows
#: from 2**62 up, sanitizer/capture/window.py) and sizes below 2**61 (never negative:
#: docs/trace-format.md, settled): an end address then fits a signed 64-bit integer in the
#: compiled engine.
ADDR_LIMIT = 3 << 61
Addr = Annotated[int, msgspec.Meta(ge=0, lt=ADDR_LIMIT)]
Size = Annotated[int, msgspec.Meta(ge=0, lt=1 << 61)]
#: Counts capture writes (dropped events, hook failures): never negative, so that a negative count
#: can never cancel a real loss and make an incomplete trace look complete.
Count = Annotated[int, msgspec.Meta(ge=0, lt=(1 << 63) - 1)]
#: A `[addr, size]` pair of a launch's reads or writes.
Range = tuple[Addr, Size]


def described(ev, name: str):
    """Field `name` of a typed event, by value. A version 2 binary record may hold, in a field that
    describes the event (sanitizer.trace.binary.INDEXED: site, stack, op, shape, dtype), the index
    of its value in its file's table of them instead (checked against the table when decoded):
    here it becomes the value. Every other record holds the value itself."""
    value = getattr(ev, name, None)
    if type(value) is int:
        cls = type(ev)
        values = getattr(cls, "hazsan_values", None)
        if values is not None and name in cls.hazsan_indexed:
            return values[name][value]
    return value


class Event(msgspec.Struct, tag_field="ev", forbid_unknown_fields=True, kw_only=True, gc=False):
    """Fields every event may carry (schema.COMMON_FIELDS)."""

    t: Optional[int] = None
    step: Optional[int] = None
    site: Optional[str] = None
    stack: Optional[list[str]] = None
    op: Optional[str] = None
    shape: Optional[list[int]] = None
    dtype: Optional[str] = None


class Segment(Event, tag="segment"):
    addr: Addr
    size: Size
    pool: Optional[Key]


class SegmentFree(Event, tag="segment_free"):
    addr: Addr
    pool: Optional[Key] = None


class Window(Event, tag="window"):
    addr: Addr
    size: Size
    comm: Key


class WindowFree(Event, tag="window_free"):
    addr: Addr
    comm: Key


class Alloc(Event, tag="alloc"):
    id: Key
    addr: Addr
    size: Size
    stream: Key
    pool: Optional[Key]
    requested: Optional[int] = None
    segment: Optional[int] = None
    token_dims: Optional[list[int]] = None


class Free(Event, tag="free"):
    id: Key


class FreeDone(Event, tag="free_done"):
    id: Key


class RecordStream(Event, tag="record_stream"):
    id: Key
    stream: Key


class Launch(Event, tag="launch"):
    stream: Key
    reads: Optional[list[Range]] = None
    writes: Optional[list[Range]] = None


class Buf(msgspec.Struct, gc=False):
    """One buffer of a collective."""

    addr: Addr
    size: Size
    access: Literal["r", "w", "rw"]


class Coll(Event, tag="coll"):
    cid: Key
    comm: Key
    seq: int
    op: str
    stream: Key
    bufs: list[Buf]


class CollDone(Event, tag="coll_done"):
    cid: Key
    # true: capture's own observation of the collective's end, not the program's wait: it retires
    # the collective for the free rules only (docs/ordering-and-rules.md, "Observed completion")
    observed: Optional[bool] = None


class Record(Event, tag="record"):
    event: Key
    stream: Key


class Wait(Event, tag="wait"):
    event: Key
    stream: Key


class Sync(Event, tag="sync"):
    stream: Optional[Key] = None
    event: Optional[Key] = None


class GraphBegin(Event, tag="graph_begin"):
    graph: Key
    stream: Key
    pool: Optional[Key] = None


class GraphEnd(Event, tag="graph_end"):
    graph: Key
    stream: Optional[Key] = None


class GraphReplay(Event, tag="graph_replay"):
    graph: Key
    stream: Key


class GraphFree(Event, tag="graph_free"):
    graph: Key


class Scope(Event, tag="scope"):
    name: str
    enter: bool
    pool: Optional[Key] = None
    comm: Optional[Key] = None
    no_split: Optional[bool] = None


class Step(Event, tag="step"):
    n: int
    phase: Optional[str] = None
    tokens: Optional[int] = None


class Thread(Event, tag="thread"):
    """The events after it were issued by host thread `thread` (0: the process's main thread,
    the current one before any `thread` event); docs/ordering-and-rules.md, "Host threads"."""

    thread: Key
    lane: Optional[Key] = None
    name: Optional[str] = None


class ThreadStart(Event, tag="thread_start"):
    """The current thread started thread `thread`, which begins knowing what it knows."""

    thread: Key
    lane: Optional[Key] = None


class ThreadEnd(Event, tag="thread_end"):
    thread: Key


class ThreadJoin(Event, tag="thread_join"):
    """The current thread joined `thread`, which had ended: it learns what that one knew."""

    thread: Key


class Release(Event, tag="release"):
    """The current thread publishes what it knows into synchronisation object `sync`."""

    sync: Key


class Acquire(Event, tag="acquire"):
    """The current thread learns what `sync` was released with (a no-op when never released)."""

    sync: Key


class Dropped(Event, tag="dropped"):
    """Written by capture: events the writer had to drop."""

    count: Count
    reason: Optional[str] = None


class HookError(Event, tag="hook_error"):
    """Written by capture: hook failures caught during the run."""

    count: Count = 1
    hook: Optional[str] = None
    error: Optional[str] = None


KINDS: tuple[type[Event], ...] = (
    Segment, SegmentFree, Window, WindowFree, Alloc, Free, FreeDone, RecordStream, Launch, Coll,
    CollDone, Record, Wait, Sync, GraphBegin, GraphEnd, GraphReplay, GraphFree, Scope, Step,
    Dropped, HookError, Thread, ThreadStart, ThreadEnd, ThreadJoin, Release, Acquire,
)
BY_KIND: dict[str, type[Event]] = {cls.__struct_config__.tag: cls for cls in KINDS}
#: Field names per kind, including the common ones (for unknown-field counting).
FIELDS: dict[str, frozenset[str]] = {kind: frozenset(cls.__struct_fields__) | {"ev"} for kind, cls in BY_KIND.items()}

_TYPE_WORDS = {"int": "an integer", "str": "a string", "bool": "true or false", "array": "a list",
               "object": "an object", "int | str": "an integer or a string",
               "int | str | null": "an integer, a string or null", "str | null": "a string or null",
               "int | null": "an integer or null", "array | null": "a list or null",
               "bool | null": "true or false or null"}
_EXPECTED = re.compile(r"Expected `([^`]*)`([^,`]*?)(?:, got `([^`]*)`)? - at `\$(.*)`")
_MISSING = re.compile(r"Object missing required field `([^`]*)`(?: - at `\$(.*)`)?")
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)` - at `\$`")
_TAG = re.compile(r"Invalid value '(.*)' - at `\$\.ev`")


def _field(path: str) -> str:
    """`$.bufs[0].size` -> 'bufs[0].size' (the field as a reader of the line sees it)."""
    return path[1:] if path.startswith(".") else path


def describe(kind: str | None, message: str) -> str:
    """msgspec's validation message, as one line that names the field."""
    where = f"{kind}: " if kind else ""
    m = _MISSING.match(message)
    if m:
        name = _field(m.group(2) or "") + ("." if m.group(2) else "") + m.group(1)
        return f"{where}missing field {name!r}"
    m = _EXPECTED.match(message)
    if m:
        expected, bound, got, path = m.groups()
        name = _field(path)
        ranges = name.startswith(("reads", "writes"))
        # a size under its lower bound 0 is a negative size (docs/trace-format.md, settled)
        negative = bound.strip() == ">= 0" and (name.endswith("size") or (ranges and name.endswith("[1]")))
        if ranges:
            why = "negative size" if negative else message.split(" - at")[0]
            return (f"{where}'reads' and 'writes' must be lists of [addr, size] integer pairs, size >= 0 "
                    f"({name}: {why})")
        words = _TYPE_WORDS.get(expected, f"`{expected}`") + bound
        return (f"{where}field {name!r} must be {words}" + (f", got {got}" if got else "")
                + (" (negative size)" if negative else ""))
    return f"{where}{message}"


class EventDecoder:
    """Raw lines -> typed events, one rank file's worth; counts what it ignored.

    The fast path decodes a line against the union of all kinds, unknown fields forbidden. A line
    that fails is looked at again (rare): an unknown kind is counted and skipped; unknown fields
    are counted, dropped and the rest decoded; anything else is a problem naming the field.
    """

    _decoder = msgspec.json.Decoder(Union[KINDS])  # type: ignore[valid-type]
    _generic = msgspec.json.Decoder()

    def __init__(self) -> None:
        self.unknown_kinds: dict[str, int] = {}
        self.unknown_fields: dict[str, int] = {}

    def decode(self, first: int, raws: list, problems: list, on_cut=None) -> list:
        """Events for raw lines numbered from `first`; None where a line gives no event.

        A line that breaks the contract is appended to `problems` as (line, message). A last line
        without its newline that does not decode is what a killed writer leaves: `on_cut(line)`
        is called and decoding stops there.
        """
        decode = self._decoder.decode
        try:
            return list(map(decode, raws))  # the loop in C: no bytecode per line
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass
        out = []
        for i, raw in enumerate(raws):
            try:
                out.append(decode(raw))
                continue
            except msgspec.DecodeError as exc:  # ValidationError is a DecodeError too
                if not raw.endswith(b"\n") and not isinstance(exc, msgspec.ValidationError):
                    if on_cut is not None:
                        on_cut(first + i)
                    break
                problem = self._retry(raw, exc)
            if type(problem) is str:
                problems.append((first + i, problem))
                out.append(None)
            else:
                out.append(problem)
        return out

    def _retry(self, raw: bytes, exc: Exception):
        """The event in a line the fast path refused, or the problem with it (a str)."""
        if not isinstance(exc, msgspec.ValidationError):
            return None if not raw.strip() else f"not JSON: {exc}"
        try:
            obj = self._generic.decode(raw)
        except msgspec.DecodeError as again:
            return f"not JSON: {again}"
        if type(obj) is not dict:
            return "an event must be a JSON object"
        return self.object(obj, str(exc))

    def object(self, obj: dict, message: str | None = None):
        """The event an object (a decoded JSON line, or a map item of a binary trace) stands for,
        None to skip it (an unknown kind, counted), or the problem with it (a str). Unknown fields
        are counted and dropped. `message`: msgspec's complaint, when the typed decoder already
        made one."""
        kind = obj.get("ev")
        if kind is None:
            return "missing field 'ev'"
        if type(kind) is not str:
            return "field 'ev' must be a string"
        cls = BY_KIND.get(kind)
        if cls is None:
            self.unknown_kinds[kind] = self.unknown_kinds.get(kind, 0) + 1
            return None
        known = FIELDS[kind]
        extra = [k for k in obj if k not in known]
        if not extra and message is not None:
            return describe(kind, message)
        for k in extra:
            self.unknown_fields[k] = self.unknown_fields.get(k, 0) + 1
            del obj[k]
        try:
            return msgspec.convert(obj, cls)
        except msgspec.ValidationError as why:
            return describe(kind, str(why))

    def warnings(self, file: str) -> list[str]:
        out = [f"{file}: {n} event(s) of unknown kind {kind!r} ignored" for kind, n in sorted(self.unknown_kinds.items())]
        out += [f"{file}: unknown field {name!r} ignored in {n} event(s)" for name, n in sorted(self.unknown_fields.items())]
        return out
