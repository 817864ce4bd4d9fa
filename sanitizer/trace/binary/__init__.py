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

The format in three modules: its layout (binary.layout), writing it (binary.encode), reading it
(binary.decode); this package gives their names as one (`from sanitizer.trace import binary as B`).
"""
from __future__ import annotations

from sanitizer.trace.binary import layout as _layout
from sanitizer.trace.binary.decode import (  # noqa: F401
    BinaryDecoder,
    add_values,
    decode_end,
    decode_header,
    generic_events,
    new_values,
    to_dict,
)
from sanitizer.trace.binary.encode import (  # noqa: F401
    PLAIN_TYPES,
    ValueTable,
    encode_frames,
    encode_frames_items,
    encode_records,
    end_frame,
    frame,
    is_packed,
    msgpack_bytes,
    jsonl_to_binary,
    signature_and_header,
    source_item,
    to_item,
    unpacked,
    values_frame,
)
from sanitizer.trace.binary.layout import (  # noqa: F401
    APPENDED,
    BUF_FIELDS,
    COMMON,
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
    MAGIC,
    ORDER,
    PREFIX,
    position,
    PREFIX_SIZE,
    READ_VERSIONS,
    SIGNATURE,
    TO_JSON_CLASS_ALL,
    VERSION,
)


def __getattr__(name: str):
    """The record classes (BY_KIND, KINDS, TO_JSON_CLASS, Buf, REQUIRED, Bin*): binary.layout's,
    made at their first use (PEP 562)."""
    return getattr(_layout, name)
