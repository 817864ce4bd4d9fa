"""Build schema-1 traces in tests: each call appends one event and returns its line number."""
from __future__ import annotations

import gzip
from pathlib import Path

import orjson


class Trace:
    def __init__(self, rank: int = 0, world_size: int = 1, **header):
        self.header = {"hazsan": 1, "rank": rank, "world_size": world_size, "device": f"cuda:{rank}", **header}
        self.events: list[dict] = []

    def ev(self, kind: str, **fields) -> int:
        self.events.append({"ev": kind, **fields})
        return len(self.events) + 1  # the header is line 1

    # Shorthands for the common events.
    def alloc(self, id, addr, size, stream="s0", pool="default", **kw):
        return self.ev("alloc", id=id, addr=addr, size=size, stream=stream, pool=pool, **kw)

    def free(self, id):
        return self.ev("free", id=id)

    def launch(self, stream="s0", reads=(), writes=(), **kw):
        return self.ev("launch", stream=stream, reads=[list(r) for r in reads], writes=[list(w) for w in writes], **kw)

    def coll(self, cid, stream="comm", comm="tp", seq=None, op="all_reduce", bufs=(), **kw):
        return self.ev("coll", cid=cid, comm=comm, seq=cid if seq is None else seq, op=op, stream=stream,
                       bufs=[{"addr": a, "size": s, "access": acc} for a, s, acc in bufs], **kw)

    def lines(self) -> list[bytes]:
        return [orjson.dumps(self.header)] + [orjson.dumps(e) for e in self.events]

    def write(self, path, *, gz: bool = False, cut_last: int = 0) -> Path:
        path = Path(path)
        data = b"\n".join(self.lines()) + b"\n"
        if cut_last:
            data = data[: len(data) - 1 - cut_last]  # drop the newline and some bytes
        if gz:
            with gzip.open(path, "wb") as f:
                f.write(data)
        else:
            path.write_bytes(data)
        return path
