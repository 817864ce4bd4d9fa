"""Reading a rank file for `hazsan place` and `hazsan sweep`: as `hazsan check` reads it.

`records` takes the typed records of sanitizer.trace.reader.TypedEvents, the reader and schema
check uses (sanitizer.trace.events), in either format: every field has its type and bounds when
it gets past here, and the first line check refuses stops the reading with check's message, naming
file and line. The placer rewrites events and writes JSON Lines, so `RecordDicts` turns each
record into a dict: the event as a JSON Lines trace holds it, with absent optional fields left out
(a required field that may be null, as an alloc's `pool`, stays), a collective's buffers as
objects, and, in a version 2 binary trace, a described field's index (site, stack, op, shape,
dtype) as its value (events.described).
"""
from __future__ import annotations

from typing import Iterator

import msgspec

_to_builtins = msgspec.to_builtins


class RecordDicts:
    """record -> dict, for the record classes of one file (a binary version 2 file has classes of
    its own, hence one instance per file: its cache goes with it)."""

    def __init__(self) -> None:
        self._specs: dict = {}

    def _spec(self, cls):
        from sanitizer.trace.binary.layout import TO_JSON_CLASS_ALL

        json_cls = TO_JSON_CLASS_ALL.get(cls, cls)
        config = cls.__struct_config__
        required = frozenset(f.name for f in msgspec.structs.fields(json_cls) if f.required)
        indexed = getattr(cls, "hazsan_indexed", frozenset())
        spec = (json_cls.__struct_config__.tag, cls.__struct_fields__, required,
                config.array_like, indexed, getattr(cls, "hazsan_values", None))
        self._specs[cls] = spec
        return spec

    def __call__(self, rec) -> dict:
        cls = type(rec)
        spec = self._specs.get(cls)
        if spec is None:
            spec = self._spec(cls)
        kind, names, required, array_like, indexed, values = spec
        raw = _to_builtins(rec)
        if not array_like:     # a JSON Lines record: {"ev": kind, field: value, ...}
            return {k: v for k, v in raw.items() if v is not None or k in required}
        out = {"ev": kind}     # a binary record: [kind number, values in the layout's order]
        for name, value in zip(names, raw[1:]):
            if value is None:
                if name in required:
                    out[name] = None
                continue
            if name == "bufs":
                value = [{"addr": b[0], "size": b[1], "access": b[2]} for b in value]
            elif name in indexed and type(value) is int:
                value = values[name][value]   # checked against the table when decoded
            out[name] = value
        return out


def records(source, path) -> Iterator[tuple[int, object]]:
    """(line, typed record) pairs of a rank file, in program order, read as `hazsan check` reads
    it (TypedEvents); the first line it refuses raises TraceError with check's message, after
    the records before that line."""
    from sanitizer.trace.reader import TraceError

    problems: list = []
    while True:
        try:
            first, items = source.next(problems)
        except StopIteration:
            return
        bad = min(problems) if problems else None
        for line, record in enumerate(items, first):
            if bad is not None and line >= bad[0]:
                break
            if record is not None:
                yield line, record
        if bad is not None:
            raise TraceError(path, *bad)
