"""Reading trace files in tests, whatever their format: what `hazsan cat` shows."""
from __future__ import annotations

from pathlib import Path

from sanitizer.trace.reader import TraceError, open_trace
from sanitizer.trace.writer import SUFFIX


def records(path) -> list[dict]:
    """The header, every event (a dict) and, for a complete trace, the end record
    {"ev": "end", ...}: the lines of the JSON Lines form of the file. Raises on an unreadable
    event, as json.loads on a bad line would."""
    tf = open_trace(path)
    out = [tf.header]
    for _, ev in tf.events():
        if isinstance(ev, TraceError):
            raise ev
        out.append(ev)
    if tf.ended:
        out.append({"ev": "end", **(tf.end or {})})
    return out


def name(stem: str, fmt: str) -> str:
    """`rank0` -> the file name capture gives it in format `fmt`."""
    return stem + SUFFIX[fmt]


def traces(directory) -> list[Path]:
    """The trace files in a folder (either format), sorted."""
    from sanitizer.trace.schema import is_trace_name

    return sorted(p for p in Path(directory).iterdir() if is_trace_name(p.name))


def header_bytes(path) -> int:
    """Bytes the header takes at the start of the file: the header line with its newline (JSON
    Lines), or the signature and the header frame (binary)."""
    tf = open_trace(path)
    tf.close()
    if tf.format == "binary":
        return tf.body_offset
    with open(path, "rb") as f:
        return len(f.readline())
