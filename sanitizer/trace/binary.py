"""The binary trace: schema 1 in length-prefixed frames of msgpack arrays (docs/trace-format.md,
"The binary format").

The same header and the same events as a JSON Lines trace, smaller and cheaper to read: each event
is a msgpack array `[kind number, field, field, ...]` in a fixed field order per kind (LAYOUT), and
events travel in frames of a few hundred, each frame one msgpack array decoded by one msgspec call
into typed records (`array_like` structs, tagged by the kind number). The records have the same
field names and types as sanitizer.trace.events, so the engine reads them the same way.

    file  := MAGIC VERSION frame*
    frame := kind (1 byte) length (4 bytes, little-endian, the payload's) payload

Frame kinds: `H` the header (first, exactly once), `E` events, `Z` the end record (last).

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
#: Byte 8: the version of the framing and of LAYOUT. A reader refuses another version.
VERSION = 1
SIGNATURE = MAGIC + bytes([VERSION])

FRAME_HEADER, FRAME_EVENTS, FRAME_END = ord("H"), ord("E"), ord("Z")
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
#: A collective's buffer: [addr, size, access].
BUF_FIELDS = ("addr", "size", "access")


def _make_kinds() -> dict:
    """The typed records of the binary format: per kind an array_like struct with the fields and
    types of sanitizer.trace.events' class, in ORDER; and the decoders. Built at the first use
    (reading a binary trace), not at import: capture (the writer) and JSON Lines need none of it."""
    import msgspec

    from sanitizer.trace import events as E

    # One buffer of a collective, as [addr, size, access] (the types of events.Buf).
    buf = msgspec.defstruct("Buf", [(f.name, f.type) for f in msgspec.structs.fields(E.Buf)],
                            array_like=True, gc=False, module=__name__)
    assert buf.__struct_fields__ == BUF_FIELDS
    by_kind = {}
    for kind, (tag, names) in ORDER.items():
        cls = E.BY_KIND[kind]
        info = {f.name: f for f in msgspec.structs.fields(cls)}
        assert set(info) == set(names), (kind, set(info) ^ set(names))
        fields = []
        for name in names:
            f = info[name]
            typ = list[buf] if (kind == "coll" and name == "bufs") else f.type
            fields.append((name, typ) if f.required else (name, typ, f.default))
        by_kind[kind] = msgspec.defstruct("Bin" + cls.__name__, fields, array_like=True, tag=tag, gc=False,
                                          module=__name__)
    kinds = tuple(by_kind.values())
    return {
        "Buf": buf,
        "BY_KIND": by_kind,
        "KINDS": kinds,
        # binary record class -> the JSON Lines class of the same kind (the engine's dispatch table)
        "TO_JSON_CLASS": {by_kind[k]: E.BY_KIND[k] for k in by_kind},
        "REQUIRED": {kind: frozenset(f.name for f in msgspec.structs.fields(E.BY_KIND[kind]) if f.required)
                     for kind in LAYOUT},
        "_frame_decoder": msgspec.msgpack.Decoder(list[Union[kinds]]),  # type: ignore[valid-type]
    }


_LAZY = ("Buf", "BY_KIND", "KINDS", "TO_JSON_CLASS", "REQUIRED", "_frame_decoder")


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


def to_item(ev: dict):
    """One capture event (a dict) as a binary item: its array, or, for an event this layout cannot
    hold exactly (an unknown kind or field, a field set to None), the dict itself: a map item,
    which the reader treats as it treats a JSON Lines event."""
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
    return item


_COLL = LAYOUT["coll"][0]
_BUFS = 1 + ORDER["coll"][1].index("bufs")
_no_buf = object()   # a buffer with other keys than addr, size, access: the event goes as a map


def encode_frames(batch: list) -> bytes:
    """Event frames for capture events (dicts), FRAME_EVENTS_MAX a frame."""
    out = []
    for i in range(0, len(batch), FRAME_EVENTS_MAX):
        out.append(_encode_part([to_item(ev) for ev in batch[i:i + FRAME_EVENTS_MAX]]))
    return b"".join(out)


def _encode_part(items: list) -> bytes:
    payload = _encode(items)
    if len(payload) > FRAME_BYTES_SOFT and len(items) > 1:
        half = len(items) // 2
        return _encode_part(items[:half]) + _encode_part(items[half:])
    return frame(FRAME_EVENTS, payload)


def encode_records(records) -> bytes:
    """Event frames for typed records of either format, or dicts (gen_decode_trace, tests)."""
    items = []
    for r in records:
        if isinstance(r, dict):
            items.append(to_item(r))
        else:
            kind = r.__struct_config__.tag
            if isinstance(kind, int):
                kind = KIND_OF_TAG[kind]
            tag, names = ORDER[kind]
            items.append([tag, *(_plain(getattr(r, n)) for n in names)])
    return encode_frames_items(items)


def encode_frames_items(items: list) -> bytes:
    return b"".join(_encode_part(items[i:i + FRAME_EVENTS_MAX]) for i in range(0, len(items), FRAME_EVENTS_MAX))


def _plain(v):
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, msgspec.Struct):
        return [getattr(v, f) for f in v.__struct_fields__]
    return v


def jsonl_to_binary(header: dict, events, end: dict | None = None) -> bytes:
    """A whole binary trace from a header and events (dicts), optionally with an end record."""
    data = signature_and_header(header) + encode_frames(list(events))
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
    """

    def __init__(self) -> None:
        from sanitizer.trace.events import EventDecoder

        self.json = EventDecoder()        # map items: the JSON Lines rules, counts included
        self.unknown_kinds: dict[str, int] = {}

    def decode(self, first: int, payload: bytes, frame_no: int, offset: int, problems: list) -> list:
        """Records for the events of one frame numbered from `first`; None where an item gives no
        event. Problems are appended as (line, message)."""
        try:
            return _frame().decode(payload)
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
        try:
            return msgspec.convert(item, _kinds()[kind])
        except msgspec.ValidationError as exc:
            return _named(kind, str(exc))

    def warnings(self, file: str) -> list[str]:
        out = self.json.warnings(file)
        out += [f"{file}: {n} event(s) of unknown kind {kind!r} ignored" for kind, n in sorted(self.unknown_kinds.items())]
        return out


def generic_events(payload: bytes) -> list:
    """A frame's events as plain values, for the readers of dicts (hazsan cat, report, place):
    arrays become dicts named by LAYOUT; raises ValueError for a frame that is not msgpack."""
    try:
        items = _generic.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not msgpack: {exc}") from None
    if type(items) is not list:
        raise ValueError("an event frame must hold a msgpack array of events")
    return [to_dict(item) for item in items]


def to_dict(item):
    """One item as the JSON Lines event it stands for (fields that are None left out: they are
    absent ones). A map stays as it is; an item no layout knows becomes {"ev": "#N", ...}."""
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
        ev[name] = value
    if len(item) - 1 > len(names):
        ev["_extra"] = item[1 + len(names):]
    return ev
