"""The binary format's layout (docs/trace-format.md, "The binary format"): the signature, the frame
prefix and kinds, each event kind's number and field order (LAYOUT, fixed by VERSION), the fields
version 2 interns (INDEXED), and the typed records msgspec decodes a frame into, made at their first
use (a reader of binary traces; capture, which only writes, never makes them).
"""
from __future__ import annotations

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
    "thread": (23, ("thread", "lane", "name")),
    "thread_start": (24, ("thread", "lane")),
    "thread_end": (25, ("thread",)),
    "thread_join": (26, ("thread",)),
    "release": (27, ("sync",)),
    "acquire": (28, ("sync",)),
}
#: Fields a kind gained after COMMON was fixed behind its own: they follow the common fields, so
#: that an array written before them keeps every position (a reader of that file finds them absent).
APPENDED: dict[str, tuple[str, ...]] = {
    # true: capture saw the collective finish (a dropped Work found complete), the program did not
    # wait for it (docs/trace-format.md, docs/ordering-and-rules.md "Observed completion")
    "coll_done": ("observed",),
}
#: kind -> (number, every field in array order, the common and the appended ones included)
ORDER: dict[str, tuple[int, tuple[str, ...]]] = {
    kind: (tag, own + tuple(f for f in COMMON if f not in own) + APPENDED.get(kind, ()))
    for kind, (tag, own) in LAYOUT.items()
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
#: kind -> its INDEXED fields' names
INDEXED_NAMES = {kind: frozenset(f for _, f in at) for kind, at in INDEXED_AT.items()}

#: Every binary record class met so far (version 1's and each file's version 2 ones) -> the JSON
#: Lines class of its kind: the engine's dispatch (rules.kinds.kind_entry) pairs them through it.
TO_JSON_CLASS_ALL: dict = {}


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


def made(name: str):
    """One of the record classes or decoders made at the first use (_LAZY), made if need be."""
    return globals().get(name) or __getattr__(name)


#: Positions in a source array (ORDER), for the code that builds or reads one.
def position(kind: str, field: str) -> int:
    return 1 + ORDER[kind][1].index(field)
