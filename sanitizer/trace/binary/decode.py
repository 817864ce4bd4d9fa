"""Reading the binary format: the header and end frames, event frames into typed records
(`BinaryDecoder`: one msgspec call a frame, item by item when that fails, every problem naming the
field, the frame and its byte offset), `V` frames into the file's value tables, and frames as plain
dicts for the readers of dicts (`generic_events`, `to_dict`).
"""
from __future__ import annotations

import re
from typing import Union

import msgspec

from sanitizer.trace.binary.layout import (
    BUF_FIELDS,
    INDEXED,
    INDEXED_AT,
    INDEXED_NAMES,
    KIND_OF_TAG,
    ORDER,
    TO_JSON_CLASS_ALL,
    _record_classes,
    made,
)

_generic = msgspec.msgpack.Decoder()


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
            self._decode = made("_frame_decoder").decode
            self._kinds = made("BY_KIND")
        else:
            self._buf = made("Buf")
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


def new_values() -> dict:
    """An empty set of version 2 value tables (TraceFile.values)."""
    return {f: [] for f in INDEXED}


def add_values(values: dict, payload) -> None:
    """A `V` frame's values appended to the file's tables; ValueError saying why not (then none
    of them is added)."""
    dec = made("_values_decoder")
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
    if type(item) is tuple:       # capture's hot events are built as tuples (block_table.py)
        item = list(item)
    if type(item) is not list or not item or type(item[0]) is not int:
        return {"ev": None, "value": item}
    kind = KIND_OF_TAG.get(item[0])
    if kind is None:
        return {"ev": f"#{item[0]}", "fields": item[1:]}
    names = ORDER[kind][1]
    required = made("REQUIRED")[kind]
    ev = {"ev": kind}
    for name, value in zip(names, item[1:]):
        if value is None and name not in required:
            continue
        if name == "bufs" and type(value) is list:
            value = [dict(zip(BUF_FIELDS, b)) if type(b) is list else b for b in value]
        elif type(value) is int and values is not None and name in INDEXED_NAMES[kind]:
            table = values[name]
            if 0 <= value < len(table):
                value = table[value]
        ev[name] = value
    if len(item) - 1 > len(names):
        ev["_extra"] = item[1 + len(names):]
    return ev
