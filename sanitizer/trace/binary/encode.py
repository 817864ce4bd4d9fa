"""Writing the binary format (capture's writer, `jsonl_to_binary`): the signature and header frame,
events as arrays in LAYOUT's order, version 2's value tables (`ValueTable`, `V` frames), frames of
at most FRAME_EVENTS_MAX events.
"""
from __future__ import annotations

import operator

import msgspec

from sanitizer.trace.binary.decode import to_dict
from sanitizer.trace.binary.layout import (
    BUF_FIELDS,
    FRAME_BYTES_SOFT,
    FRAME_END,
    FRAME_EVENTS,
    FRAME_EVENTS_MAX,
    FRAME_HEADER,
    FRAME_VALUES,
    INDEXED,
    INDEXED_AT,
    KIND_OF_TAG,
    LAYOUT,
    ORDER,
    PREFIX,
    PREFIX_SIZE,
    SIGNATURE,
)

_encode = msgspec.msgpack.Encoder().encode
msgpack_bytes = _encode          # one value as msgpack, as the format writes it


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
_TAG = {kind: tag for kind, (tag, _) in ORDER.items()}
_INDEXED_AT_TAG = {tag: INDEXED_AT[kind] for kind, (tag, _) in ORDER.items()}
#: kind -> {the keys of an event in their order: to_item's plan for them}
_PLANS: dict[str, dict] = {kind: {} for kind in ORDER}
_PLANS_GET = _PLANS.get


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
        if type(value) is tuple:
            key = value
        elif type(value) is list:
            key = None
        else:
            return None
        try:
            if key is None:
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
    fields hold the index of their value in the table. Trailing absent fields are left out."""
    if type(ev) is tuple or type(ev) is list:
        return _source_item(ev, table)
    plans = _PLANS_GET(ev.get("ev"))
    if plans is None:
        return ev
    # capture makes each kind of event from a few key layouts: the layout, worked out once
    # (_plan), reorders the values into the array in one C call
    keys = tuple(ev)
    plan = plans.get(keys)
    if plan is None:
        plan = _plan(ev["ev"], keys)
        if len(plans) < 1024:     # a program of capture's makes a handful per kind
            plans[keys] = plan
    if plan is False:
        return ev
    values = list(ev.values())
    if None in values:            # a field set to None: the reader treats it as JSON Lines does
        return ev
    values.append(None)           # what the getter takes for an absent field
    item = list(plan[1](values))
    tag = item[0] = plan[0]
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
        at = table.at[tag]
        for i in plan[2]:
            pos, field, seen = at[i]
            value = item[pos]
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


def _source_item(ev: list, table: ValueTable | None):
    """An event capture made as an array already (its hot kinds: `alloc`, `free`, `launch`; see
    source_item): values in place, which version 2 interns here."""
    if table is None:
        return ev
    item = None
    n = len(ev)
    for pos, field, seen in table.at[ev[0]]:
        if pos >= n:
            continue
        value = ev[pos]
        kind_of = type(value)
        if kind_of is str or kind_of is tuple:
            try:
                found = seen.get(value)
            except TypeError:              # a tuple with an unhashable element
                return to_dict(ev)
        elif kind_of is list:
            try:
                found = seen.get(tuple(value))
            except TypeError:
                return to_dict(ev)
        elif value is None:
            continue
        else:
            return to_dict(ev)
        if found is None:
            found = table.ref(field, value)
            if found is None:
                return to_dict(ev)
        if item is None:
            item = list(ev)      # the caller's array keeps its values (to_dict above needs them)
        item[pos] = found
    return ev if item is None else item


def source_item(kind: str, **fields) -> list:
    """The array `to_item` would make of {"ev": kind, **fields}, for code that builds its events
    as arrays on a hot path (the block table): the layout's order, values not interned."""
    tag, names = ORDER[kind]
    item = [tag] + [fields.pop(n, None) for n in names]
    if fields:
        raise KeyError(f"{kind} has no field(s) {sorted(fields)}")
    while len(item) > 1 + len(LAYOUT[kind][1]) and item[-1] is None:
        item.pop()
    return item


def _plan(kind: str, keys: tuple):
    """(tag, getter, which of the kind's INDEXED fields are present) for `kind` events with these
    keys in this order, or False when the layout cannot hold them (a field it does not have).
    The getter takes the event's values with None appended and returns the array: the values in
    the kind's field order, None for an absent field, cut after the last present one (never
    before the kind's own fields: the reader names a missing required field)."""
    tag, names = ORDER[kind]
    if not set(keys) <= {"ev", *names}:
        return False
    absent = len(keys)                       # the index of the appended None
    where = [keys.index("ev")] + [keys.index(n) if n in keys else absent for n in names]
    last = max([1 + len(LAYOUT[kind][1])] + [2 + i for i, n in enumerate(names) if n in keys])
    where = where[:last]
    present = tuple(i for i, (pos, f) in enumerate(INDEXED_AT[kind]) if f in keys and pos < last)
    return tag, operator.itemgetter(*where), present


_COLL = LAYOUT["coll"][0]
_BUFS = 1 + ORDER["coll"][1].index("bufs")
_no_buf = object()   # a buffer with other keys than addr, size, access: the event goes as a map


#: What a batch's events are made of besides packed runs (see is_packed)
PLAIN_TYPES = frozenset((dict, tuple, list))


def is_packed(ev) -> bool:
    """Whether a buffered entry is a packed run: many plain events kept outside Python (the native
    recorder's PackedRun) with `len()`, `part(start, stop)`, `events()` (their arrays, as
    source_item makes them) and `encode(sites, ops, ref)` (their msgpack items, back to back, the
    call sites and op labels as indices in the tables given; None when one cannot be interned)."""
    return type(ev) not in PLAIN_TYPES


def unpacked(batch: list) -> list:
    """`batch` with each packed run replaced by its events' arrays."""
    out = []
    for ev in batch:
        if type(ev) in PLAIN_TYPES:
            out.append(ev)
        else:
            out.extend(ev.events())
    return out


def encode_frames(batch: list, table: ValueTable | None = None, packed: bool = False) -> bytes:
    """Event frames for capture events (dicts), FRAME_EVENTS_MAX a frame; with `table`, the
    INDEXED fields as indices, and first a `V` frame with the values new to the table. `packed`:
    the batch may hold packed runs (is_packed), each counting as its events."""
    if packed:
        if table is None:
            batch = unpacked(batch)
        else:
            return _encode_mixed(batch, table)
    out = []
    for i in range(0, len(batch), FRAME_EVENTS_MAX):
        out.append(_encode_part(_items(batch[i:i + FRAME_EVENTS_MAX], table)))
    if table is not None:
        new = table.pending()
        if new is not None:
            out.insert(0, values_frame(new))
    return b"".join(out)


# The first position of an INDEXED field in each kind's array: a shorter array has none to intern.
_FIRST_INDEXED = {tag: min(pos for pos, _ in at) if at else 1 << 30 for tag, at in _INDEXED_AT_TAG.items()}
_ALLOC_TAG = LAYOUT["alloc"][0]
_ALLOC_SITE = 1 + ORDER["alloc"][1].index("site")
_LAUNCH_TAG = LAYOUT["launch"][0]
_LAUNCH_SITE = 1 + ORDER["launch"][1].index("site")
_LAUNCH_STACK = 1 + ORDER["launch"][1].index("stack")
_LAUNCH_OP = 1 + ORDER["launch"][1].index("op")


def _items(batch: list, table: ValueTable | None) -> list:
    """to_item of each event. The native recorder's arrays (`free` without a site, `alloc` whose
    only INDEXED field is its site: most of a trace at level alloc; `launch` whose only ones are
    its site and op: most of one at full) are done inline here, a known value one dict lookup;
    anything else goes through to_item."""
    if table is None:
        return [to_item(ev) for ev in batch]
    first = _FIRST_INDEXED
    sites = table.index["site"]              # value -> index
    ops = table.index["op"]
    out = []
    append = out.append
    for ev in batch:
        if type(ev) is tuple:
            n = len(ev)
            tag = ev[0]
            if n <= first.get(tag, 0):
                append(ev)                   # no INDEXED field present: as it is
                continue
            if tag == _ALLOC_TAG and n == _ALLOC_SITE + 1:
                site = ev[_ALLOC_SITE]
                found = sites.get(site) if type(site) is str else None
                if found is not None:
                    item = list(ev)
                    item[_ALLOC_SITE] = found
                    append(item)
                    continue
            elif tag == _LAUNCH_TAG and n == _LAUNCH_OP + 1 and ev[_LAUNCH_STACK] is None:
                site = ev[_LAUNCH_SITE]
                op = ev[_LAUNCH_OP]
                found_op = ops.get(op) if type(op) is str else None
                found_site = sites.get(site) if type(site) is str else (-1 if site is None else None)
                if found_op is not None and found_site is not None:
                    item = list(ev)
                    if site is not None:
                        item[_LAUNCH_SITE] = found_site
                    item[_LAUNCH_OP] = found_op
                    append(item)
                    continue
        append(to_item(ev, table))
    return out


def _encode_mixed(batch: list, table: ValueTable) -> bytes:
    """encode_frames of a batch with packed runs: frames of FRAME_EVENTS_MAX events as always. A
    run's items, as it encodes them, go into the frame's array as one msgspec.Raw (copied as they
    are), so a frame is still one msgspec call; its array header, which counted the Raw as one
    item, is then made again for the events it holds."""
    sites, ops, ref = table.index["site"], table.index["op"], table.ref
    frames = []
    items: list = []        # the current frame's items (a run's: one Raw)
    whole: list = []        # and its entries, for the rare frame too big to keep whole
    count = 0               # events in the current frame
    pending: list = []      # Python's events not yet made items, of the current frame

    def close_frame():
        nonlocal items, whole, count
        if pending:
            items.extend(_items(pending, table))
            whole.extend(pending)
            pending.clear()
        payload = _array_header(count) + _unarray(_encode(items))
        if len(payload) > FRAME_BYTES_SOFT and count > 1:
            frames.append(_encode_part(_items(unpacked(whole), table)))     # split in halves
        else:
            frames.append(frame(FRAME_EVENTS, payload))
        items, whole, count = [], [], 0

    for ev in batch:
        if type(ev) in PLAIN_TYPES:
            pending.append(ev)
            count += 1
            if count == FRAME_EVENTS_MAX:
                close_frame()
            continue
        at, n = 0, len(ev)
        while at < n:
            take = min(n - at, FRAME_EVENTS_MAX - count)
            run = ev.part(at, at + take) if take < n else ev
            if pending:
                items.extend(_items(pending, table))
                whole.extend(pending)
                pending.clear()
            encoded = run.encode(sites, ops, ref)
            if encoded is None:                   # a value that cannot be interned: as arrays
                pending.extend(run.events())
            else:
                items.append(_Raw(encoded))
                whole.append(run)
            count += take
            at += take
            if count == FRAME_EVENTS_MAX:
                close_frame()
    if count:
        close_frame()
    new = table.pending()
    if new is not None:
        frames.insert(0, values_frame(new))
    return b"".join(frames)


_Raw = msgspec.Raw


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n <= 0xFFFF:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _unarray(encoded: bytes) -> bytes:
    """msgspec's encoding of a list without the array's own header: its items back to back."""
    first = encoded[0]
    return encoded[1:] if first < 0xdc else encoded[3:] if first == 0xdc else encoded[5:]


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
