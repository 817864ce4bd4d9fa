"""Hostile inputs for the fuzz tests and `benchmarks/fuzz.py`: traces and log lines from a small
grammar, then mutated (a field's type or range swapped, fields dropped, lines cut, garbage lines).

Deterministic per `random.Random`, so a failing input is reproduced from its seed.
"""
from __future__ import annotations

import random

import orjson

# Values that broke some reader once: wrong types, unhashable containers, 64-bit edges, huge text.
HOSTILE_VALUES = [
    None, True, False, 0, -1, 1.5, float("1e308"), "", "x" * 300, [], [1], [[1, 2]], {}, {"a": 1},
    2**63 - 1, 2**63, 2**64 - 1, -(2**63), [0, -5], [2**64 - 1, 2**64 - 1], "nan",
]
IDENT_FIELDS = ("id", "stream", "graph", "comm", "pool", "cid", "event")
STREAMS = (0, 1, 2, "s0", "comm")


def _event(rng: random.Random, state: dict) -> dict:
    """One event that keeps the trace well-formed (frees of live ids, completions of pending
    collectives, paired scopes and graph captures), so unmutated traces reach the rules."""
    live = state["live"]
    kind = rng.choice(("alloc", "alloc", "alloc", "free", "free", "launch", "launch", "coll", "coll_done",
                       "record", "wait", "sync", "record_stream", "free_done", "graph", "scope",
                       "window", "step", "dropped", "hook_error", "mystery"))
    addr = rng.choice((0x1000, 0x10000, 0x40000000, rng.randrange(0, 1 << 40)))
    size = rng.choice((512, 4096, 1 << 20, rng.randrange(0, 1 << 22)))
    if kind == "alloc" or (kind in ("free", "record_stream", "launch") and not live):
        state["next_id"] += 1
        bid = state["next_id"]
        live.append((bid, addr, size))
        stream = state["streams"][bid] = rng.choice(STREAMS)
        pool = "symm" if state["scopes"] else rng.choice(("default", 0))
        return {"ev": "alloc", "id": bid, "addr": addr, "size": size, "stream": stream,
                "pool": pool, "shape": [rng.randrange(1, 64), 128], "site": f"model.py:{rng.randrange(9)}:forward"}
    if kind == "free":
        bid, _, _ = live.pop(rng.randrange(len(live)))
        if bid in state["recorded"]:
            state["pending_done"].append(bid)
        return {"ev": "free", "id": bid}
    if kind == "record_stream":
        bid = rng.choice(live)[0]
        state["recorded"].add(bid)  # on another stream than its own (that one PyTorch ignores)
        return {"ev": "record_stream", "id": bid,
                "stream": rng.choice([s for s in STREAMS if s != state["streams"][bid]])}
    if kind == "free_done" and state["pending_done"]:
        return {"ev": "free_done", "id": state["pending_done"].pop(0)}
    if kind == "launch":
        pick = [(a, s) for _, a, s in rng.sample(live, min(len(live), 2))]
        return {"ev": "launch", "stream": rng.choice(STREAMS), "reads": [list(pick[0])],
                "writes": [list(p) for p in pick[1:]]}
    if kind == "coll":
        state["cid"] += 1
        state["pending_cids"].append(state["cid"])
        bufs = [{"addr": a, "size": s, "access": "rw"} for _, a, s in live[-2:]] or \
            [{"addr": addr, "size": size, "access": "rw"}]
        return {"ev": "coll", "cid": state["cid"], "comm": "tp", "seq": state["cid"], "op": "all_reduce",
                "stream": rng.choice(STREAMS), "bufs": bufs}
    if kind == "coll_done" and state["pending_cids"]:
        return {"ev": "coll_done", "cid": state["pending_cids"].pop(rng.randrange(len(state["pending_cids"])))}
    if kind in ("record", "wait"):
        return {"ev": kind, "event": rng.choice(("e1", "e2", 7)), "stream": rng.choice(STREAMS)}
    if kind == "graph":
        g = state["graph"]
        if g is None:
            state["graph"] = g = rng.choice((len(state["graphs"]), f"g{len(state['graphs'])}"))
            return {"ev": "graph_begin", "graph": g, "stream": 0}
        state["graph"] = None
        state["graphs"].append(g)
        return {"ev": "graph_end", "graph": g, "stream": 0}
    if kind == "scope":
        if state["scopes"] and rng.random() < 0.5:
            state["scopes"].pop()
            return {"ev": "scope", "name": "symm", "enter": False, "pool": "symm", "comm": "tp"}
        state["scopes"].append(1)
        return {"ev": "scope", "name": "symm", "enter": True, "pool": "symm", "comm": "tp"}
    if kind == "window":
        if state["windows"] and rng.random() < 0.3:
            return {"ev": "window_free", "addr": state["windows"].pop(), "comm": "tp"}
        w = 0x7000_0000_0000 + len(state["windows"]) * (1 << 30)
        state["windows"].append(w)
        return {"ev": "window", "addr": w, "size": 1 << 28, "comm": "tp"}
    if kind == "step":
        state["step"] += 1
        return {"ev": "step", "n": state["step"], "tokens": rng.randrange(1, 64)}
    if kind == "dropped":
        return {"ev": "dropped", "count": rng.randrange(1, 9), "reason": "max_events"}
    if kind == "hook_error":
        return {"ev": "hook_error", "count": 1, "hook": "alloc", "error": "RuntimeError"}
    if kind == "mystery":
        return {"ev": "mystery", "x": 1}
    return {"ev": "sync"}


def _mutate(rng: random.Random, ev: dict) -> dict:
    ev = dict(ev)
    r = rng.random()
    if r < 0.45:
        name = rng.choice(list(ev) + list(IDENT_FIELDS) + ["addr", "size", "reads", "writes", "bufs", "n"])
        ev[name] = rng.choice(HOSTILE_VALUES)
    elif r < 0.6 and len(ev) > 1:
        del ev[rng.choice([k for k in ev if k != "ev"] or ["ev"])]
    elif r < 0.75:
        for key in ("reads", "writes"):
            if key in ev:
                ev[key] = [[rng.choice((0, 2**64 - 1, -1, 2**63)), rng.choice((-1, 0, 2**64 - 1, 1 << 40))]]
        if "bufs" in ev:
            ev["bufs"] = rng.choice(([{"addr": 2**64 - 1, "size": 1}], [{"size": 1}], [1], {"a": 1},
                                     [{"addr": 1, "size": -4096}]))
    elif r < 0.85:
        ev["ev"] = rng.choice(("alloc", "free", "coll", "launch", "window", 5, None, ["alloc"]))
    else:
        ev["unknown_" + str(rng.randrange(3))] = rng.choice(HOSTILE_VALUES)
    return ev


def trace_lines(rng: random.Random, *, rank: int = 0, events: int = 40, mutation_rate: float = 0.15) -> bytes:
    """One rank file's bytes: a header, then grammar events of which some are mutated, and now and
    then a garbage line, a blank line, a non-object, a cut last line or a hostile header."""
    state = {"live": [], "next_id": 0, "cid": 0, "step": 0, "recorded": set(), "pending_done": [],
             "pending_cids": [], "graph": None, "graphs": [], "scopes": [], "windows": [], "streams": {}}
    header = {"hazsan": 1, "rank": rank, "world_size": 2}
    hostile = mutation_rate > 0
    if hostile and rng.random() < 0.05:
        header = rng.choice(({"hazsan": 2}, {"hazsan": 1, "rank": [0]}, [1], {"rank": 0}, "x"))
    lines = [orjson.dumps(header)]
    lines.append(orjson.dumps({"ev": "step", "n": 0, "tokens": 16}))  # sweep needs a step with tokens
    for _ in range(rng.randrange(0, events + 1)):
        ev = _event(rng, state)
        if rng.random() < mutation_rate:
            ev = _mutate(rng, ev)
        try:
            lines.append(orjson.dumps(ev))
        except orjson.JSONEncodeError:  # an integer past 64 bits: write it by hand, as a file could hold it
            lines.append(repr(ev).replace("'", '"').replace("None", "null").replace("True", "true")
                         .replace("False", "false").encode())
        r = rng.random() if hostile else 1.0
        if r < 0.01:
            lines.append(b"{not json")
        elif r < 0.02:
            lines.append(b"")
        elif r < 0.03:
            lines.append(rng.choice((b"[1,2]", b"3", b'"s"', b"null", b"\xff\xfe")))
    data = b"\n".join(lines) + b"\n"
    if hostile and rng.random() < 0.05:
        data = data[: rng.randrange(1, len(data))]  # cut anywhere: a killed writer, a half copy
    return data


def log_lines(rng: random.Random, count: int = 30) -> str:
    """SGLang-like log text with hostile `Decode batch` lines mixed in."""
    values = ("1.5", "3.2", "inf", "-inf", "nan", "1e999", "-1", "1e300", "", "x", "2.0 [1.0, 3.0]")
    out = []
    for _ in range(rng.randrange(0, count + 1)):
        fields = [f"#running-req: {rng.choice(('64', '0', '-3', 'x', '1e9'))}", "#token: 1",
                  f"accept len: {rng.choice(values)}", "accept rate: 0.5",
                  "est uncap acc len: 3.4 [3.1, 3.7]", "gen throughput (token/s): 1.0"]
        rng.shuffle(fields)
        if rng.random() < 0.3:
            fields = fields[: rng.randrange(0, len(fields))]
        sep = rng.choice((",", ",", ".", "", ";"))
        prefix = rng.choice(("[2026-03-01 10:00:00 DP0 TP1] ", "", "[bad] ", "\x1b[32m"))
        line = f"{prefix}Decode batch{sep} " + ", ".join(fields)
        if rng.random() < 0.05:
            line += " Decode batch, #running-req: 1"
        if rng.random() < 0.05:
            line += "," * rng.randrange(0, 5000) + "[" * rng.randrange(0, 50)
        out.append(line if rng.random() > 0.1 else "INFO some other line")
    return "\n".join(out) + rng.choice(("\n", ""))


def _fits(value):
    """`value` with integers msgpack cannot hold (past 64 bits) clamped: msgpack has no bigger ones."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return min(max(value, -(2**63)), 2**64 - 1)
    if isinstance(value, list):
        return [_fits(v) for v in value]
    if isinstance(value, dict):
        return {k: _fits(v) for k, v in value.items()}
    return value


class _Raw:
    """An item written as it is (not an event: a hostile shape)."""

    def __init__(self, item):
        self.item = item


class _Trailing:
    """An event whose item gets elements past its kind's last field (a newer writer's)."""

    def __init__(self, ev, extra):
        self.ev, self.extra = ev, extra


def _as_item(B, it, table):
    if isinstance(it, _Raw):
        return it.item
    if isinstance(it, _Trailing):
        item = _as_item(B, it.ev, table)
        return item + it.extra if isinstance(item, list) else item
    if isinstance(it, dict) and isinstance(it.get("ev"), str):
        return _fits(B.to_item(it, table))
    return it


def trace_binary(rng: random.Random, *, rank: int = 0, events: int = 40, mutation_rate: float = 0.15) -> bytes:
    """One rank file's bytes in the binary format (sanitizer/trace/binary/): the grammar's events,
    some mutated as in trace_lines, then items of the wrong shape, trailing elements, map items;
    frames of random sizes, some with their payload garbled, their kind or length wrong, an end
    frame in the middle; half the files with version 2's value tables (`V` frames, some lost,
    cut short or holding values of the wrong type: dangling indices); now and then a bad
    signature or header, a file cut anywhere."""
    import msgspec

    from sanitizer.trace import binary as B

    encode = msgspec.msgpack.encode
    state = {"live": [], "next_id": 0, "cid": 0, "step": 0, "recorded": set(), "pending_done": [],
             "pending_cids": [], "graph": None, "graphs": [], "scopes": [], "windows": [], "streams": {}}
    hostile = mutation_rate > 0
    header = {"hazsan": 1, "rank": rank, "world_size": 2, "end_record": rng.random() < 0.5}
    if hostile and rng.random() < 0.05:
        header = rng.choice(({"hazsan": 2}, {"hazsan": 1, "rank": [0]}, [1], {"rank": 0}, "x", {1: 2}))
    # version 2's value tables (binary.ValueTable) for half the files: the indexed fields then hold
    # indices, defined by a `V` frame before the first event frame that uses them
    table = B.ValueTable() if rng.random() < 0.5 else None
    items = [{"ev": "step", "n": 0, "tokens": 16}]   # events (dicts) are made items when framed
    for _ in range(rng.randrange(0, events + 1)):
        ev = _event(rng, state)
        if rng.random() < mutation_rate:
            ev = _mutate(rng, ev)
        item = _fits(ev)
        r = rng.random() if hostile else 1.0
        if r < 0.02:
            item = _Raw(rng.choice(([], [999, 1], "str", 5, [5], [None, 1], ["alloc", 1], [1.5], {"ev": 5},
                                    {1: 2}, [10, 1, "tp", 0, "ar", 0, [[1, 2]]], [10, 1, "tp", 0, "ar", 0, [{"a": 1}]],
                                    [9, 0, [[1, -2]]], [9, 0, [1, 2]], b"bytes",
                                    [9, 0, None, None, None, None, 10**6], [5, 1, 2, 3, 0, "p", None, None, None,
                                                                            None, None, None, None, None, 7])))
        elif r < 0.04 and isinstance(ev.get("ev"), str):
            trailing = [rng.choice(HOSTILE_VALUES)] * rng.randrange(1, 12)      # fields of a newer writer
            item = _Trailing(item, trailing)
        items.append(item)
    room = rng.choice((0, 0, 4096))
    if isinstance(header, dict) and all(isinstance(k, str) for k in header):
        data = B.signature_and_header(header, room) or B.signature_and_header(header)
    else:
        data = B.SIGNATURE + B.frame(B.FRAME_HEADER, encode([_fits(header), b""]))
    if hostile and rng.random() < 0.03:
        data = rng.choice((b"\x89HZS\r\n\x1a\x03", b"\x89HZS\n\x1a\x01", b"\x89", b"\x89PNG\r\n\x1a\n",
                           b"\x89HZS\r\n\x1a\x01")) + data[8:]
    i = 0
    while i < len(items):
        n = rng.randrange(1, 65)
        chunk = [_as_item(B, it, table) for it in items[i:i + n]]
        payload = encode(chunk)
        i += n
        if table is not None:
            new = table.pending()
            if new is not None:
                v = rng.random() if hostile else 1.0
                if v < 0.03:
                    new = None                                                   # a lost `V` frame: dangling indices
                elif v < 0.05:
                    new = rng.choice(({"site": [5]}, {"shape": ["x"]}, {"stack": "s"}, [1, 2], "x",
                                      {"site": [None]}, {"later": [1]}, {"op": [[1]]}))  # values of the wrong type
                if new is not None:
                    vpayload = encode(new)
                    if v < 0.06 and v >= 0.05 and vpayload:
                        vpayload = vpayload[: rng.randrange(len(vpayload))]       # cut short: not msgpack
                    data += B.PREFIX.pack(B.FRAME_VALUES, len(vpayload)) + vpayload
        kind = B.FRAME_EVENTS
        r = rng.random() if hostile else 1.0
        if r < 0.02:
            payload = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))     # not msgpack
        elif r < 0.03:
            kind = rng.choice((B.FRAME_HEADER, B.FRAME_END, B.FRAME_VALUES, 0, 0xFF))
        elif r < 0.04:
            payload = encode(rng.choice(({"a": 1}, 5, "x", None)))                        # not an array
        elif r < 0.05 and payload:
            k = rng.randrange(len(payload))
            payload = payload[:k] + bytes([rng.randrange(256)]) + payload[k + 1:]         # a flipped byte
        prefix = B.PREFIX.pack(kind, len(payload))
        if r > 0.995:
            prefix = B.PREFIX.pack(kind, rng.choice((2**32 - 1, len(payload) + 1000, 9 << 20)))  # past the file
        data += prefix + payload
    if rng.random() < 0.7:
        data += B.end_frame(len(items), 0)
    if hostile and rng.random() < 0.05:
        data = data[: rng.randrange(1, len(data))]  # cut anywhere: a killed writer, a half copy
    return data
