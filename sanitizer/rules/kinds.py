"""What the engine's dispatch knows of an event before its handler runs (docs/ordering-and-rules.md):
each kind's number (RankAnalyzer.feed_batch switches on it), where the fields its handler reads
sit in the event (`slots_of`), and the access bits of a buffer.

Compiled by Cython with the engine (types in kinds.pxd beside it; buildinfo.COMPILED); the engine
re-exports KIND_CODES and kind_entry (the driver drops a file's record classes from KIND_CODES at
its end).
"""
from __future__ import annotations

import sys

from sanitizer.trace import events as E

#: A buffer's access, a bitmask.
READ, WRITE = 1, 2
ACCESS = {"r": READ, "w": WRITE, "rw": READ | WRITE}

#: Event kind -> its number in RankAnalyzer.feed_batch's dispatch (a switch when compiled: no
#: Python call per event); kinds without one go through RankAnalyzer.handlers.
KIND_NUMBER = {"launch": 1, "alloc": 2, "free": 3, "record": 4, "wait": 5, "scope": 6, "coll": 7,
               "free_done": 8, "record_stream": 9, "sync": 10, "coll_done": 11, "step": 12}
#: Whether this is the compiled engine (the same source, built by Cython; see kinds.pxd).
COMPILED = not __file__.endswith(".py")
#: Per dispatch number, the fields its handler reads, in the order it reads them (slots_of).
FIELDS = {1: ("stream", "reads", "writes"), 2: ("id", "addr", "size", "stream"), 3: ("id",),
          4: ("event", "stream"), 5: ("event", "stream"), 7: ("cid", "comm", "seq", "stream", "bufs"),
          8: ("id",), 9: ("id", "stream")}


def slots_of(kind, number):
    """Compiled engine only: where, in an event of class `kind`, the fields that handler
    `number` reads are kept (msgspec keeps a struct's fields in slots, each with its member
    descriptor on the class); None when interpreted, or when one of them is not such a slot.
    Read from its slot (kinds.pxd: hazsan_slot), a field costs a load; through the attribute
    protocol (type lookup, descriptor call) it cost a sixth of the engine's time on the decode
    trace."""
    names = FIELDS.get(number)
    if not COMPILED or names is None:
        return None
    offsets = []
    for name in names:
        offset = hazsan_slot_offset(getattr(kind, name, None))
        if offset < 0:
            return None
        offsets.append(offset)
    return tuple(offsets)


#: Event class -> (its number, where its fields are: slots_of, the JSON Lines class of its kind,
#: whose entry in RankAnalyzer.handlers handles it); number -1: none. The JSON Lines classes from
#: the start; the binary format's records, classes of their own with the same fields (elsewhere
#: in the struct), at their first event (kind_entry).
KIND_CODES = {cls: (KIND_NUMBER.get(kind, -1), slots_of(cls, KIND_NUMBER.get(kind, -1)), cls)
              for kind, cls in E.BY_KIND.items()}


def kind_entry(kind) -> tuple:
    """KIND_CODES' entry for an event class not met before: a binary record's number is its
    JSON Lines class's (the binary module, loaded by then since it made the record, pairs them;
    it is not loaded here otherwise: its classes cost tens of ms to make); -1 for any other."""
    number = -1
    binary = sys.modules.get("sanitizer.trace.binary")
    json_cls = getattr(binary, "TO_JSON_CLASS_ALL", {}).get(kind) if binary is not None else None
    if json_cls is not None:
        number = KIND_CODES.get(json_cls, (-1, None, None))[0]
    entry = KIND_CODES[kind] = (number, slots_of(kind, number), json_cls if json_cls is not None else kind)
    return entry
