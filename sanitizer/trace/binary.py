"""The binary trace: schema 1 in length-prefixed frames of msgpack arrays (docs/trace-format.md,
"The binary format").

The same header and the same events as a JSON Lines trace, smaller and cheaper to read: each event
is a msgpack array `[kind number, field, field, ...]` in a fixed field order per kind (LAYOUT), and
events travel in frames of a few hundred, each frame one msgpack array decoded by one msgspec call
into typed records (`array_like` structs, tagged by the kind number). The records have the same
field names and types as sanitizer.trace.events, so the engine reads them the same way.

    file  := MAGIC VERSION frame*
    frame := kind (1 byte) length (4 bytes, little-endian, the payload's) payload

Frame kinds: `H` the header (first, exactly once), `E` events, `V` values, `Z` the end record (last).

Version 2 interns the descriptive fields (INDEXED: `site`, `stack`, `op`, `shape`, `dtype`): a `V`
frame appends values to the file's table of each such field, and an event then holds the index of
its value there instead of the value. A decode server repeats a few hundred call sites, ops and
shapes millions of times: written once each, the trace is half the size, and the reader makes an
integer where it made a string or a list (a fifth of the decoding, most of it allocation). The
index is checked against the table when its frame is decoded, like every other field; it is turned
back into its value only where a value is read (a finding, `hazsan cat`): events.described.

What a killed writer leaves (a frame cut short) is a warning; everything else that breaks this is
a problem naming the frame and its byte offset. Problems are (line, message) pairs, as for JSON
Lines: an event's "line" is its ordinal, the header counting as line 1, which is the line it has in
the JSON Lines that `hazsan cat` prints.
"""
from __future__ import annotations

import re
import struct
from typing import Union

import msgspec


#: The first 7 bytes of every binary trace: a byte that is not ASCII (no JSON, no gzip file starts
#: so), "HZS", and CR LF SUB, which a text-mode copy would alter (as PNG's signature does).
MAGIC = b"\x89HZS\r\n\x1a"
#: Byte 8: the version of the framing and of LAYOUT. A reader refuses a version it does not know.
#: 1: values in place; 2: `V` frames, and INDEXED fields may hold an index into them.
VERSION = 2
READ_VERSIONS = (1, 2)
SIGNATURE = MAGIC + bytes([VERSION])

FRAME_HEADER, FRAME_EVENTS, FRAME_VALUES, FRAME_END = ord("H"), ord("E"), ord("V"), ord("Z")
PREFIX = struct.Struct("<BI")        # kind, payload length
PREFIX_SIZE = PREFIX.size            # 5

#: Events per frame written by capture: one msgspec call decodes a frame.
FRAME_EVENTS_MAX = 512
#: A frame the writer makes bigger than this is split (long stacks, huge range lists): frames stay
#: far below the reader's limit (--max-line-bytes, 8 MiB).
FRAME_BYTES_SOFT = 1 << 20

#: The kind numbers (the array's first element) and each kind's fields after it, in order:
#: required fields first, then the kind's optional ones, then the fields every event may carry.
#: Fixed by VERSION: a new field goes at the end of its kind (older readers ignore trailing
#: elements), a new kind gets a new number.
COMMON = ("t", "step", "site", "stack", "op", "shape", "dtype")
LAYOUT: dict[str, tuple[int, tuple[str, ...]]] = {
    "segment": (1, ("addr", "size", "pool")),
    "segment_free": (2, ("addr", "pool")),
    "window": (3, ("addr", "size", "comm")),
    "window_free": (4, ("addr", "comm")),
    "alloc": (5, ("id", "addr", "size", "stream", "pool", "requested", "segment", "token_dims")),
    "free": (6, ("id",)),
    "free_done": (7, ("id",)),
    "record_stream": (8, ("id", "stream")),
    "launch": (9, ("stream", "reads", "writes")),
    "coll": (10, ("cid", "comm", "seq", "op", "stream", "bufs")),
    "coll_done": (11, ("cid",)),
    "record": (12, ("event", "stream")),
    "wait": (13, ("event", "stream")),
    "sync": (14, ("stream", "event")),
    "graph_begin": (15, ("graph", "stream", "pool")),
    "graph_end": (16, ("graph", "stream")),
    "graph_replay": (17, ("graph", "stream")),
    "graph_free": (18, ("graph",)),
    "scope": (19, ("name", "enter", "pool", "comm", "no_split")),
    "step": (20, ("n", "phase", "tokens")),
    "dropped": (21, ("count", "reason")),
    "hook_error": (22, ("count", "hook", "error")),
}
#: kind -> (number, every field in array order, the common ones included)
ORDER: dict[str, tuple[int, tuple[str, ...]]] = {
    kind: (tag, own + tuple(f for f in COMMON if f not in own)) for kind, (tag, own) in LAYOUT.items()
}
KIND_OF_TAG: dict[int, str] = {tag: kind for kind, (tag, _) in LAYOUT.items()}
#: Version 2: the fields every event may carry that may hold an index into the file's table of that
#: field's values (a `V` frame adds to them) instead of the value itself; `coll`'s own `op` does not.
INDEXED = ("site", "stack", "op", "shape", "dtype")
#: kind -> ((position in the item, field), ...) of its INDEXED fields
INDEXED_AT: dict[str, tuple[tuple[int, str], ...]] = {
    kind: tuple((1 + names.index(f), f) for f in INDEXED if f in names and f not in LAYOUT[kind][1])
    for kind, (_, names) in ORDER.items()
}
#: A collective's buffer: [addr, size, access].
BUF_FIELDS = ("addr", "size", "access")


def _record_classes(buf, indexed=None, values=None, prefix="Bin") -> dict:
    """kind -> an array_like struct with the fields and types of sanitizer.trace.events' class, in
    ORDER. `indexed` (version 2): field -> how many values its table holds, or None for no bound:
    that field (INDEXED_AT) also takes an index below the bound; the classes then carry the file's
    tables (`hazsan_values`) and which of their fields are indexed (`hazsan_indexed`), which
    events.described reads."""
    from typing import Annotated, Optional, Union

    from sanitizer.trace import events as E

    by_kind = {}
    for kind, (tag, names) in ORDER.items():
        cls = E.BY_KIND[kind]
        info = _fields_of(cls)
        assert set(info) == set(names), (kind, set(info) ^ set(names))
        at = {f for _, f in INDEXED_AT[kind]} if indexed is not None else set()
        fields = []
        for name in names:
            f = info[name]
            typ = list[buf] if (kind == "coll" and name == "bufs") else f.type
            if name in at:
                bound = indexed.get(name)
                inner = _VALUE_TYPES[name]
                if bound is None:
                    typ = Optional[Union[Annotated[int, msgspec.Meta(ge=0)], inner]]
                elif bound > 0:
                    typ = Optional[Union[Annotated[int, msgspec.Meta(ge=0, lt=bound)], inner]]
            fields.append((name, typ) if f.required else (name, typ, f.default))
        namespace = None
        if indexed is not None:
            namespace = {"hazsan_values": values, "hazsan_indexed": frozenset(at)}
        by_kind[kind] = msgspec.defstruct(prefix + cls.__name__, fields, array_like=True, tag=tag, gc=False,
                                          module=__name__, namespace=namespace)
    return by_kind


_FIELDS_OF: dict = {}


def _fields_of(cls) -> dict:
    """name -> msgspec's FieldInfo of an events.py class, worked out once (msgspec evaluates the
    annotations on every call: most of the cost of making a file's classes)."""
    info = _FIELDS_OF.get(cls)
    if info is None:
        info = _FIELDS_OF[cls] = {f.name: f for f in msgspec.structs.fields(cls)}
    return info


def _make_kinds() -> dict:
    """The typed records of the binary format, version 1 (the values in place): per kind an
    array_like struct with the fields and types of sanitizer.trace.events' class, in ORDER; and
    the decoders. Built at the first use (reading a binary trace), not at import: capture (the
    writer) and JSON Lines need none of it. Version 2's are made per file (BinaryDecoder)."""
    from sanitizer.trace import events as E

    # One buffer of a collective, as [addr, size, access] (the types of events.Buf).
    buf = msgspec.defstruct("Buf", [(f.name, f.type) for f in msgspec.structs.fields(E.Buf)],
                            array_like=True, gc=False, module=__name__)
    assert buf.__struct_fields__ == BUF_FIELDS
    by_kind = _record_classes(buf)
    kinds = tuple(by_kind.values())
    TO_JSON_CLASS_ALL.update({by_kind[k]: E.BY_KIND[k] for k in by_kind})
    return {
        "Buf": buf,
        "BY_KIND": by_kind,
        "KINDS": kinds,
        # binary record class -> the JSON Lines class of the same kind (the engine's dispatch table)
        "TO_JSON_CLASS": {by_kind[k]: E.BY_KIND[k] for k in by_kind},
        "REQUIRED": {kind: frozenset(f.name for f in msgspec.structs.fields(E.BY_KIND[kind]) if f.required)
                     for kind in LAYOUT},
        "_frame_decoder": msgspec.msgpack.Decoder(list[Union[kinds]]),  # type: ignore[valid-type]
        "_values_decoder": msgspec.msgpack.Decoder(_values_struct()),
    }


#: The type of each INDEXED field's values (what events.py gives the field, less None).
_VALUE_TYPES = {"site": str, "stack": list[str], "op": str, "shape": list[int], "dtype": str}


def _values_struct():
    """A `V` frame's payload: a map from INDEXED field to the values it appends to that field's
    table (unknown keys ignored: a later writer may intern more fields)."""
    return msgspec.defstruct("Values", [(f, list[_VALUE_TYPES[f]], []) for f in INDEXED], gc=False,
                             module=__name__)


_LAZY = ("Buf", "BY_KIND", "KINDS", "TO_JSON_CLASS", "REQUIRED", "_frame_decoder", "_values_decoder")


def __getattr__(name: str):
    """BY_KIND, KINDS, TO_JSON_CLASS, Buf, REQUIRED: made at the first use (PEP 562)."""
    if name in _LAZY or name.startswith("Bin"):
        made = globals().get("BY_KIND") and {k: globals()[k] for k in _LAZY}
        if not made:
            made = _make_kinds()
            globals().update(made)
            globals().update({cls.__name__: cls for cls in made["KINDS"]})   # pickle finds them by name
        if name in made:
            return made[name]
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_generic = msgspec.msgpack.Decoder()
_encode = msgspec.msgpack.Encoder().encode


# ----------------------------------------------------------------------------- writing


def signature_and_header(header: dict, room: int = 0) -> bytes | None:
    """The file's first bytes: the signature and the header frame, padded to `room` bytes in all
    (0: not padded). None when the header does not fit in `room`.

    The header frame's payload is a msgpack array [header map, padding bytes]: the padding lets a
    later header be written over it in place, the frame's length unchanged."""
    body = _encode(header)
    fixed = len(SIGNATURE) + PREFIX_SIZE + 1 + len(body)   # + fixarray(2) marker
    if not room:
        pad = b"\xc4\x00"                                  # bin8, empty
    else:
        left = room - fixed
        if left < 3:
            return None
        if left - 3 <= 0xFFFF:
            pad = b"\xc5" + (left - 3).to_bytes(2, "big") + bytes(left - 3)        # bin16
        elif left - 5 <= 0xFFFFFFFF:
            pad = b"\xc6" + (left - 5).to_bytes(4, "big") + bytes(left - 5)        # bin32
        else:
            return None
    payload = b"\x92" + body + pad
    return SIGNATURE + PREFIX.pack(FRAME_HEADER, len(payload)) + payload


def frame(kind: int, payload: bytes) -> bytes:
    return PREFIX.pack(kind, len(payload)) + payload


def end_frame(events: int, dropped: int) -> bytes:
    return frame(FRAME_END, _encode({"events": events, "dropped": dropped}))


#: kind -> ("ev", every field in array order), and kind -> its number: to_item's tables
_KEYS = {kind: ("ev",) + names for kind, (_, names) in ORDER.items()}
_KEYS_GET = _KEYS.get
_TAG = {kind: tag for kind, (tag, _) in ORDER.items()}
_INDEXED_AT_TAG = {tag: INDEXED_AT[kind] for kind, (tag, _) in ORDER.items()}


class ValueTable:
    """The writer's side of version 2's value tables, for one file: each INDEXED field's values by
    the index they got, and those not yet written (`V` frame). A value of the wrong type (which
    the reader would refuse) is never interned: its event goes as a map, and the reader names the
    field, as for JSON Lines."""

    __slots__ = ("index", "new", "at")

    def __init__(self) -> None:
        self.index: dict[str, dict] = {f: {} for f in INDEXED}
        self.new: dict[str, list] = {f: [] for f in INDEXED}
        # kind number -> ((position in the item, field, that field's index), ...): to_item's table
        self.at = {tag: tuple((pos, f, self.index[f]) for pos, f in at) for tag, at in _INDEXED_AT_TAG.items()}

    def ref(self, field: str, value):
        """The index of `value` in `field`'s table (added if new), or None when it cannot be
        interned (a wrong type)."""
        table = self.index[field]
        if type(value) is str:
            if field in _STR_FIELDS:
                found = table.get(value)
                if found is None:
                    found = self._add(field, table, value, value)
                return found
            return None
        if type(value) is not list:
            return None
        try:
            key = tuple(value)
            found = table.get(key)
        except TypeError:                  # an element that is not hashable: not a list of ints or strs
            return None
        if found is None:
            want = str if field == "stack" else int
            if field in _STR_FIELDS or not all(type(x) is want for x in value):
                return None
            found = self._add(field, table, key, list(value))
        return found

    def _add(self, field, table, key, value) -> int:
        found = table[key] = len(table)
        self.new[field].append(value)
        return found

    def pending(self) -> dict | None:
        """The values added since the last call, by field (None: none), now counted as written."""
        out = {f: v for f, v in self.new.items() if v}
        if not out:
            return None
        self.new = {f: [] for f in INDEXED}
        return out

    def mark(self) -> tuple:
        """The table's state, for `rollback` when the frames that define new values are not written."""
        return tuple(len(self.index[f]) - len(self.new[f]) for f in INDEXED)

    def rollback(self, mark: tuple) -> None:
        """Forget the values added since `mark` was taken (their `V` frame never reached the file)."""
        for f, size in zip(INDEXED, mark):
            table = self.index[f]
            if len(table) > size:
                for key in [k for k, i in table.items() if i >= size]:
                    del table[key]
            self.new[f] = []


_STR_FIELDS = frozenset(("site", "op", "dtype"))


def to_item(ev: dict, table: ValueTable | None = None):
    """One capture event (a dict) as a binary item: its array, or, for an event this layout cannot
    hold exactly (an unknown kind or field, a field set to None), the dict itself: a map item,
    which the reader treats as it treats a JSON Lines event. With `table` (version 2), its INDEXED
    fields hold the index of their value in the table."""
    kind = ev.get("ev")
    keys = _KEYS_GET(kind)
    if keys is None:
        return ev
    item = list(map(ev.get, keys))        # [kind name, fields...]: the loop in C
    # every key of the event among `keys`, none of them None: then the array holds the whole event
    if len(ev) + item.count(None) != len(keys):
        return ev
    tag = item[0] = _TAG[kind]
    if tag == _COLL:
        bufs = item[_BUFS]
        if type(bufs) is list:
            try:
                item[_BUFS] = [[b["addr"], b["size"], b["access"]] if len(b) == 3 else _no_buf for b in bufs]
            except (KeyError, TypeError):
                return ev
            if _no_buf in item[_BUFS]:
                return ev
    if table is not None:
        # a value seen before costs one lookup, inline (capture pays this per event); a new one,
        # or one of the wrong type, goes through ValueTable.ref
        for pos, field, seen in table.at[tag]:
            value = item[pos]
            if value is None:
                continue
            kind_of = type(value)
            if kind_of is str:
                found = seen.get(value)
            elif kind_of is list:
                try:
                    found = seen.get(tuple(value))
                except TypeError:
                    return ev
            else:
                return ev
            if found is None:
                found = table.ref(field, value)
                if found is None:
                    return ev
            item[pos] = found
    return item


_COLL = LAYOUT["coll"][0]
_INDEXED_NAMES = {kind: frozenset(f for _, f in at) for kind, at in INDEXED_AT.items()}
_BUFS = 1 + ORDER["coll"][1].index("bufs")
_no_buf = object()   # a buffer with other keys than addr, size, access: the event goes as a map


def encode_frames(batch: list, table: ValueTable | None = None) -> bytes:
    """Event frames for capture events (dicts), FRAME_EVENTS_MAX a frame; with `table`, the
    INDEXED fields as indices, and first a `V` frame with the values new to the table."""
    out = []
    for i in range(0, len(batch), FRAME_EVENTS_MAX):
        out.append(_encode_part([to_item(ev, table) for ev in batch[i:i + FRAME_EVENTS_MAX]]))
    if table is not None:
        new = table.pending()
        if new is not None:
            out.insert(0, values_frame(new))
    return b"".join(out)


def values_frame(new: dict) -> bytes:
    """A `V` frame: {field: [values appended to its table], ...}."""
    return frame(FRAME_VALUES, _encode(new))


def _encode_part(items: list) -> bytes:
    payload = _encode(items)
    if len(payload) > FRAME_BYTES_SOFT and len(items) > 1:
        half = len(items) // 2
        return _encode_part(items[:half]) + _encode_part(items[half:])
    return frame(FRAME_EVENTS, payload)


def encode_records(records, table: ValueTable | None = None) -> bytes:
    """Event frames for typed records of either format, or dicts (gen_decode_trace, tests); with
    `table` (one per file), version 2's indices and `V` frame, as capture writes them."""
    from sanitizer.trace.events import described

    items = []
    for r in records:
        if isinstance(r, dict):
            items.append(to_item(r, table))
        else:
            kind = r.__struct_config__.tag
            if isinstance(kind, int):
                kind = KIND_OF_TAG[kind]
            ev = {"ev": kind}
            for n in ORDER[kind][1]:
                v = _plain(described(r, n))
                if v is not None:
                    ev[n] = [dict(zip(BUF_FIELDS, b)) for b in v] if n == "bufs" else v
            items.append(to_item(ev, table))
    body = encode_frames_items(items)
    new = table.pending() if table is not None else None
    return body if new is None else values_frame(new) + body


def encode_frames_items(items: list) -> bytes:
    return b"".join(_encode_part(items[i:i + FRAME_EVENTS_MAX]) for i in range(0, len(items), FRAME_EVENTS_MAX))


def _plain(v):
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, msgspec.Struct):
        return [getattr(v, f) for f in v.__struct_fields__]
    return v


def jsonl_to_binary(header: dict, events, end: dict | None = None, intern: bool = True) -> bytes:
    """A whole binary trace from a header and events (dicts), optionally with an end record;
    `intern=False` keeps every value in place (no `V` frame)."""
    data = signature_and_header(header) + encode_frames(list(events), ValueTable() if intern else None)
    if end is not None:
        data += end_frame(end.get("events", 0), end.get("dropped", 0))
    return data


# ----------------------------------------------------------------------------- reading


def decode_header(payload: bytes) -> dict:
    """The header map of a header frame's payload; ValueError saying why not."""
    try:
        obj = _generic.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"header frame is not msgpack: {exc}") from None
    if type(obj) is list and obj and type(obj[0]) is dict:
        obj = obj[0]
    if type(obj) is not dict:
        raise ValueError("not a hazsan trace: the header frame must hold a map {\"hazsan\": 1, \"rank\": ...}")
    if not all(type(k) is str for k in obj):
        raise ValueError("header keys must be strings")
    return obj


def decode_end(payload: bytes) -> dict:
    try:
        obj = _generic.decode(payload)
    except msgspec.DecodeError:
        obj = None
    return obj if type(obj) is dict else {}


_PATH = re.compile(r"(.*?)(?: - at `\$((?:\[\d+\])*)(.*)`)?$", re.S)
_LENGTH = re.compile(r"Expected `array` of at least length (\d+), got (\d+)")
_INDEX = re.compile(r"\[(\d+)\]")
_GOT_LENGTH = re.compile(r"(of (?:at (?:least|most) )?length \d+), got \d+")


def _named(kind: str, message: str) -> str:
    """msgspec's message about one item (path `$[k]...`) with the path in field names, as the JSON
    decoder would have said it (`$.bufs[0].size`), then worded by events.describe."""
    from sanitizer.trace.events import describe

    m = _PATH.match(message)
    text, indices, rest = m.groups() if m else (message, None, "")
    idx = [int(i) for i in _INDEX.findall(indices or "")]
    names = ORDER[kind][1]
    path, container = "", names               # the field named so far, and the names inside it
    if idx:
        k = idx.pop(0)
        if k == 0:
            return f"{kind}: kind number: {text}"
        name = names[k - 1] if k - 1 < len(names) else f"[{k}]"
        path, container = "." + name, None
        if name == "bufs" and idx:
            path += f"[{idx.pop(0)}]"
            container = BUF_FIELDS
            if idx:
                j = idx.pop(0)
                path += "." + (BUF_FIELDS[j] if j < len(BUF_FIELDS) else f"[{j}]")
                container = None
        path += "".join(f"[{i}]" for i in idx)
    short = _LENGTH.match(text)
    if short and container is not None and not rest:
        got = int(short.group(2)) - (1 if container is names else 0)   # the kind number is no field
        missing = container[got] if 0 <= got < len(container) else "?"
        where = f" - at `${path}`" if path else ""
        return describe(kind, f"Object missing required field `{missing}`{where}")
    text = _GOT_LENGTH.sub(r"\1", text)     # msgpack knows an array's length, JSON's decoder does not say it
    if not path:
        return describe(kind, text)
    return describe(kind, f"{text} - at `${path}{rest}`")


def _frame():
    return globals().get("_frame_decoder") or __getattr__("_frame_decoder")


def _kinds():
    return globals().get("BY_KIND") or __getattr__("BY_KIND")


def _required():
    return globals().get("REQUIRED") or __getattr__("REQUIRED")


class BinaryDecoder:
    """Event frames -> typed records, one rank file's worth; counts what it ignored.

    The fast path decodes a whole frame with one call. A frame that fails is decoded again item by
    item (rare): an item of an unknown kind is counted and skipped, a map item (what a writer
    writes for an event with fields this layout lacks) is read as a JSON Lines event would be,
    anything else is a problem naming the field, the frame and the frame's byte offset.

    Version 2 (`values`: the file's tables, which TraceFile.frames fills from the `V` frames): the
    records are classes of this file's own, whose INDEXED fields take an index below the size
    each table had when they were made. A frame that uses a value added since fails that check
    and gets classes made again for the tables as they are now; REBUILDS such rounds, then only
    when a table has doubled (a file that adds values in every frame costs O(log) class sets, not
    one per frame). Between two rounds such a frame is read item by item, its indices checked
    against the tables as they are.
    """

    REBUILDS = 16

    def __init__(self, values: dict | None = None, on_classes=None) -> None:
        from sanitizer.trace.events import EventDecoder

        self.json = EventDecoder()        # map items: the JSON Lines rules, counts included
        self.unknown_kinds: dict[str, int] = {}
        self.values = values
        self.on_classes = on_classes      # called with each new set of record classes (the engine's dispatch)
        self.rebuilds = 0
        self.made: list = []              # this file's record classes (version 2), for forget()
        self._bounds: dict = {}
        if values is None:
            self._decode = _frame().decode
            self._kinds = _kinds()
        else:
            self._buf = _kinds_buf()
            self._decode = None           # made at the first event frame: the tables are filled by then
            self._kinds = None            # the item-by-item path's classes (no bound: it checks), when needed

    def _classes(self, bounds) -> dict:
        by_kind = _record_classes(self._buf, bounds if bounds is not None else {}, self.values, prefix="Bin2")
        json_classes = TO_JSON_CLASS_ALL
        from sanitizer.trace.events import BY_KIND as JSON_BY_KIND

        for kind, cls in by_kind.items():
            json_classes[cls] = JSON_BY_KIND[kind]
        self.made.extend(by_kind.values())
        if self.on_classes is not None:
            self.on_classes({cls: JSON_BY_KIND[kind] for kind, cls in by_kind.items()})
        return by_kind

    def _build(self) -> None:
        self._bounds = {f: len(v) for f, v in self.values.items()}
        by_kind = self._classes(self._bounds)
        self._decode = msgspec.msgpack.Decoder(list[Union[tuple(by_kind.values())]]).decode  # type: ignore[misc]

    def _stale(self) -> bool:
        """Whether a table grew since the classes were made, enough for another round."""
        values, bounds = self.values, self._bounds
        if self.rebuilds < self.REBUILDS:
            return any(len(values[f]) > bounds[f] for f in values)
        return any(len(values[f]) >= 2 * max(bounds[f], 1) for f in values)

    def decode(self, first: int, payload, frame_no: int, offset: int, problems: list) -> list:
        """Records for the events of one frame numbered from `first`; None where an item gives no
        event. Problems are appended as (line, message)."""
        decode = self._decode
        if decode is None:
            self._build()
            decode = self._decode
        try:
            return decode(payload)
        except msgspec.DecodeError:
            pass
        if self.values is not None and self._stale():
            self.rebuilds += 1
            self._build()
            try:
                return self._decode(payload)
            except msgspec.DecodeError:
                pass
        where = f"frame {frame_no} at byte {offset}"
        try:
            items = _generic.decode(payload)
        except msgspec.DecodeError as exc:
            problems.append((first, f"not msgpack: {exc} ({where}; counted as one event)"))
            return [None]
        if type(items) is not list:
            problems.append((first, f"an event frame must hold a msgpack array of events ({where}; counted as one event)"))
            return [None]
        out = []
        for i, item in enumerate(items):
            problem = self._item(item)
            if type(problem) is str:
                problems.append((first + i, f"{problem} ({where}, event {i})"))
                out.append(None)
            else:
                out.append(problem)
        return out

    def _item(self, item):
        """The record for one item, None to skip it, or the problem (a str)."""
        if type(item) is dict:
            return self.json.object(item)
        if type(item) is not list:
            return f"an event must be a msgpack array [kind, fields...] or a map, got {type(item).__name__}"
        if not item:
            return "an event must not be an empty array"
        tag = item[0]
        if type(tag) is not int:
            return f"an event's first element must be its kind number (an integer), got {tag!r}"[:200]
        kind = KIND_OF_TAG.get(tag)
        if kind is None:
            name = f"#{tag}"
            self.unknown_kinds[name] = self.unknown_kinds.get(name, 0) + 1
            return None
        if self.values is not None:
            for pos, field in INDEXED_AT[kind]:
                if pos < len(item):
                    v = item[pos]
                    if type(v) is int and not 0 <= v < len(self.values[field]):
                        n = len(self.values[field])
                        return (f"{kind}: field '{field}' holds index {v}, but the trace's {field} values so far "
                                f"are {n} (indices 0 to {n - 1})" if n else
                                f"{kind}: field '{field}' holds index {v}, but the trace defined no {field} "
                                f"value before it")
        kinds = self._kinds
        if kinds is None:
            kinds = self._kinds = self._classes(None)
        try:
            return msgspec.convert(item, kinds[kind])
        except msgspec.ValidationError as exc:
            return _named(kind, str(exc))

    def warnings(self, file: str) -> list[str]:
        out = self.json.warnings(file)
        out += [f"{file}: {n} event(s) of unknown kind {kind!r} ignored" for kind, n in sorted(self.unknown_kinds.items())]
        return out

    def forget(self) -> list:
        """This file's record classes leave the registry (its analysis is over): a process that
        reads many files (the pytest plugin) keeps none of them. Returns them."""
        made, self.made = self.made, []
        for cls in made:
            TO_JSON_CLASS_ALL.pop(cls, None)
        return made


#: Every binary record class met so far (version 1's and each file's version 2 ones) -> the JSON
#: Lines class of its kind: the engine's dispatch (rules.kinds.kind_entry) pairs them through it.
TO_JSON_CLASS_ALL: dict = {}


def _kinds_buf():
    return globals().get("Buf") or __getattr__("Buf")


def new_values() -> dict:
    """An empty set of version 2 value tables (TraceFile.values)."""
    return {f: [] for f in INDEXED}


def add_values(values: dict, payload) -> None:
    """A `V` frame's values appended to the file's tables; ValueError saying why not (then none
    of them is added)."""
    dec = globals().get("_values_decoder") or __getattr__("_values_decoder")
    try:
        got = dec.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"values frame: {exc}") from None
    for f in INDEXED:
        more = getattr(got, f)
        if more:
            values[f].extend(more)


def generic_events(payload, values: dict | None = None) -> list:
    """A frame's events as plain values, for the readers of dicts (hazsan cat, report, place):
    arrays become dicts named by LAYOUT, indices (version 2) their values from `values`; raises
    ValueError for a frame that is not msgpack."""
    try:
        items = _generic.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if type(items) is not list:
        raise ValueError("an event frame must hold a msgpack array of events")
    return [to_dict(item, values) for item in items]


def to_dict(item, values: dict | None = None):
    """One item as the JSON Lines event it stands for (fields that are None left out: they are
    absent ones). A map stays as it is; an item no layout knows becomes {"ev": "#N", ...}. An
    INDEXED field's index (version 2, `values` the file's tables) becomes its value; one past
    its table stays the integer it is, which the JSON Lines rules then refuse (a string, a list
    is wanted there)."""
    if type(item) is dict:
        return item
    if type(item) is not list or not item or type(item[0]) is not int:
        return {"ev": None, "value": item}
    kind = KIND_OF_TAG.get(item[0])
    if kind is None:
        return {"ev": f"#{item[0]}", "fields": item[1:]}
    names = ORDER[kind][1]
    required = _required()[kind]
    ev = {"ev": kind}
    for name, value in zip(names, item[1:]):
        if value is None and name not in required:
            continue
        if name == "bufs" and type(value) is list:
            value = [dict(zip(BUF_FIELDS, b)) if type(b) is list else b for b in value]
        elif type(value) is int and values is not None and name in _INDEXED_NAMES[kind]:
            table = values[name]
            if 0 <= value < len(table):
                value = table[value]
        ev[name] = value
    if len(item) - 1 > len(names):
        ev["_extra"] = item[1 + len(names):]
    return ev
