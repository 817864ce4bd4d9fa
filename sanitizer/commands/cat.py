"""`hazsan cat TRACE_OR_DIR...`: any trace, JSON Lines or binary, printed as JSON Lines."""
from __future__ import annotations

import sys

HELP = "print rank traces (binary or JSON Lines, plain or .gz) as JSON Lines, for people and tools"


def add_arguments(p) -> None:
    p.add_argument("paths", nargs="+", metavar="TRACE_OR_DIR",
                   help="trace files (*.hzs, *.jsonl, either .gz) or directories holding them")
    p.add_argument("--no-header", action="store_true",
                   help="leave out each file's header line (line numbers then start at 2)")
    p.add_argument("--no-end", action="store_true", help="leave out the end record of a complete trace")
    from sanitizer.commands._options import add_read_limits

    add_read_limits(p)


def _default(obj):
    """msgpack values that JSON lacks: bytes as a hex string, anything else as its repr."""
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"$bytes": bytes(obj).hex()}
    return repr(obj)


class _TextOut:
    """stdout without a byte buffer (replaced by a StringIO): bytes written as text."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, data: bytes) -> None:
        self.stream.write(data.decode("utf-8", "replace"))

    def flush(self) -> None:
        self.stream.flush()


def run(args) -> int:
    import orjson

    from sanitizer.commands._options import limits
    from sanitizer.trace.reader import TraceError, expand_paths, open_trace

    read_limits = limits(args)
    out = getattr(sys.stdout, "buffer", None) or _TextOut(sys.stdout)
    options = orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE

    def dumps(obj) -> bytes:
        return orjson.dumps(obj, default=_default, option=options)

    status = 0
    try:
        files = expand_paths(args.paths)
    except TraceError as exc:
        print(f"hazsan: error: {exc}", file=sys.stderr)
        return 2
    for path in files:
        try:
            tf = open_trace(path, read_limits)
        except TraceError as exc:
            print(f"hazsan: error: {exc}", file=sys.stderr)
            status = 2
            continue
        try:
            if not args.no_header:
                out.write(dumps(tf.header))
            batches = tf.binary_dicts() if tf.format == "binary" else tf.batches()
            for first, items in batches:
                lines = []
                for item in items:
                    if item is None:
                        lines.append(b"\n")          # a blank line keeps the numbering
                    elif isinstance(item, TraceError):
                        print(f"hazsan: error: {item}", file=sys.stderr)
                        status = 2
                        lines.append(b"\n")
                    else:
                        lines.append(dumps(item))
                out.write(b"".join(lines))
            if tf.ended and tf.end is not None and not args.no_end:
                out.write(dumps({"ev": "end", **tf.end}))
        except TraceError as exc:
            print(f"hazsan: error: {exc}", file=sys.stderr)
            status = 2
        for w in tf.warnings:
            print(f"hazsan: warning: {w}", file=sys.stderr)
        out.flush()
    return status
