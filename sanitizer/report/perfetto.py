"""`hazsan export --perfetto`: rank traces as a Chrome Trace Event Format file for ui.perfetto.dev.

The JSON object form ({"traceEvents": [...], "displayTimeUnit": "ns"}), timestamps in microseconds
from the earliest event of all ranks (the trace's `t`; a file without `t` counts one microsecond a
line). Mapping:

  process (pid)       one per rank file, named "rank R (file)"
  thread (tid) 0      the host: decode steps as complete slices ("X"), step to step
  thread (tid) 1..    one per stream: collectives and launches as complete slices. A stream runs
                      its work in order, so each slice starts at max(enqueue, end of the previous one)
                      and a collective ends where the host or the block's stream first knows it done
                      (the engine's StreamClocks, DESIGN.md section 3), a launch one microsecond
                      later: slices on one track never overlap.
  counter "memory"    bytes allocated per pool ("C"), on every alloc and free
  instant "i"         each finding, on the track of the stream or host where it fired (scope "t")
  flow "s"/"t"/"f"    the same collective (comm, seq) across ranks, one flow id per collective
"""
from __future__ import annotations

import itertools

import orjson

from sanitizer.order.clocks import StreamClocks
from sanitizer.trace.reader import TraceError, expand_paths, open_trace

LAUNCH_US = 1.0


class _Rank:
    def __init__(self, pid, trace):
        self.pid = pid
        self.trace = trace
        self.tids: dict = {}
        self.events: list = []
        self.coll_slices: dict = {}  # (comm, seq) -> its slice (placed at the end of _convert)

    def tid(self, stream) -> int:
        t = self.tids.get(stream)
        if t is None:
            t = self.tids[stream] = len(self.tids) + 1
        return t


def _first_t(path):
    try:
        trace = open_trace(path)
    except TraceError:
        return None
    try:
        for _, ev in trace.events():
            if isinstance(ev, dict) and isinstance(ev.get("t"), int):
                return ev["t"]
            return None      # the first event has no t: this file counts lines
    finally:
        trace.close()
    return None


def export_perfetto(paths, findings=()) -> dict:
    files = expand_paths(paths)
    starts = [t for t in (_first_t(p) for p in files) if t is not None]
    t0 = min(starts) if starts else 0
    by_file: dict = {}
    for f in findings:
        by_file.setdefault(str(f.file), {}).setdefault(f.line, []).append(f)
    ranks = []
    for pid, path in enumerate(files):
        try:
            trace = open_trace(path)
        except TraceError:
            continue
        rank = _Rank(pid, trace)
        _convert(rank, t0, by_file.get(str(path), {}))
        ranks.append(rank)
    events: list = []
    for r in ranks:
        events.append({"ph": "M", "name": "process_name", "pid": r.pid, "tid": 0,
                       "args": {"name": f"rank {r.trace.rank} ({r.trace.path.name})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r.pid, "tid": 0,
                       "args": {"sort_index": r.pid}})
        events.append({"ph": "M", "name": "thread_name", "pid": r.pid, "tid": 0, "args": {"name": "host"}})
        for stream, tid in r.tids.items():
            events.append({"ph": "M", "name": "thread_name", "pid": r.pid, "tid": tid,
                           "args": {"name": f"stream {stream}"}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": r.pid, "tid": tid,
                           "args": {"sort_index": tid}})
        events.extend(r.events)
    events.extend(_flows(ranks))
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"producer": "hazsan export --perfetto", "ranks": len(ranks)}}


def _flows(ranks) -> list:
    """One flow per collective seen on two or more ranks: s on the first, t between, f on the last."""
    keys: dict = {}
    for r in ranks:
        for key, sl in r.coll_slices.items():
            keys.setdefault(key, []).append((r.pid, sl["tid"], sl["ts"]))
    out = []
    ids = itertools.count(1)
    for key, hops in keys.items():
        if len(hops) < 2:
            continue
        fid = next(ids)
        name = f"{key[0]} seq {key[1]}"
        for i, (pid, tid, ts) in enumerate(hops):
            ph = "s" if i == 0 else ("f" if i == len(hops) - 1 else "t")
            ev = {"ph": ph, "name": name, "cat": "collective", "id": fid, "pid": pid, "tid": tid, "ts": ts}
            if ph == "f":
                ev["bp"] = "e"
            out.append(ev)
    return out


def _convert(r: _Rank, t0: int, findings_at: dict) -> None:
    out = r.events
    clocks = StreamClocks()
    tracks: dict = {}              # tid -> [(slice, enqueue ts)] in stream order
    pending: list = []             # [op stream, epoch, slice]: collectives not yet known done
    coll_clock: dict = {}
    blocks: dict = {}              # id -> (pool, size)
    pools: dict = {}               # pool -> bytes live
    step_open = None
    ts = 0.0
    capturing = 0
    for line, ev in r.trace.events():
        if not isinstance(ev, dict):
            continue
        t = ev.get("t")
        ts = max(ts, (t - t0) / 1000.0) if isinstance(t, int) else ts + 1.0
        kind = ev.get("ev")
        try:
            if kind == "step":
                if step_open is not None:
                    step_open["dur"] = max(ts - step_open["ts"], 0.0)
                step_open = {"ph": "X", "name": f"step {ev.get('n')}", "cat": "step", "pid": r.pid, "tid": 0,
                             "ts": ts, "dur": 0.0, "args": {"n": ev.get("n"), "tokens": ev.get("tokens"), "line": line}}
                out.append(step_open)
            elif kind == "alloc":
                pool, size = str(ev.get("pool")), ev["size"]
                blocks[ev["id"]] = (pool, size)
                pools[pool] = pools.get(pool, 0) + size
                out.append({"ph": "C", "name": "memory", "pid": r.pid, "tid": 0, "ts": ts, "args": dict(pools)})
            elif kind == "free":
                got = blocks.pop(ev["id"], None)
                if got is not None:
                    pools[got[0]] -= got[1]
                    out.append({"ph": "C", "name": "memory", "pid": r.pid, "tid": 0, "ts": ts, "args": dict(pools)})
            elif kind == "graph_begin":
                capturing += 1
            elif kind == "graph_end":
                capturing = max(0, capturing - 1)
            elif kind in ("launch", "coll") and not capturing:
                stream = ev["stream"]
                epoch = clocks.enqueue(stream)
                tid = r.tid(stream)
                sl = {"ph": "X", "name": str(ev.get("op") or kind), "cat": kind, "pid": r.pid, "tid": tid,
                      "ts": ts, "dur": LAUNCH_US, "args": {"line": line, "site": ev.get("site")}}
                tracks.setdefault(tid, []).append(sl)
                if kind == "coll":
                    sl["args"].update(cid=ev.get("cid"), comm=ev.get("comm"), seq=ev.get("seq"))
                    sl["done"] = None
                    coll_clock[ev.get("cid")] = clocks.snapshot(stream)
                    pending.append((stream, epoch, sl))
                    r.coll_slices[(ev.get("comm"), ev.get("seq"))] = sl
            elif kind == "record":
                clocks.record(ev["event"], ev["stream"])
            elif kind == "wait":
                clocks.wait(ev["stream"], ev["event"])
            elif kind == "sync":
                if "event" in ev:
                    clocks.sync_event(ev["event"])
                elif "stream" in ev:
                    clocks.sync_stream(ev["stream"])
                else:
                    clocks.sync_device()
            elif kind == "coll_done":
                clock = coll_clock.pop(ev.get("cid"), None)
                if clock is not None:
                    clocks.host_learns(clock)
        except (KeyError, TypeError):
            pass               # malformed: `hazsan check` reports it
        if pending and kind in ("record", "wait", "sync", "coll_done", "launch", "coll"):
            # done once the host or any other stream is known to have seen it finish
            still = []
            for op_stream, epoch, sl in pending:
                if clocks.knows(None, op_stream) >= epoch or any(
                        s != op_stream and clocks.is_done_for(op_stream, epoch, s) for s in clocks.streams):
                    sl["done"] = ts
                else:
                    still.append((op_stream, epoch, sl))
            pending = still
        for f in findings_at.get(line, ()):
            stream = (f.block or {}).get("stream")
            tid = r.tids.get(stream, 0) if stream is not None else 0
            out.append({"ph": "i", "name": f.rule, "cat": "finding", "s": "t", "pid": r.pid, "tid": tid, "ts": ts,
                        "args": {"severity": f.severity, "line": f.line, "step": f.step, "site": f.site,
                                 "detail": f.detail, "overlap": list(f.overlap) if f.overlap else None}})
    if step_open is not None:
        step_open["dur"] = max(ts - step_open["ts"], 0.0)
    # A stream runs its work in order: each slice starts when it was enqueued or when the previous
    # one ended, whichever is later; a collective lasts until it was known done (or the end).
    for slices in tracks.values():
        cursor = 0.0
        for sl in slices:
            start = max(sl["ts"], cursor)
            end = start + LAUNCH_US
            if "done" in sl:
                done = sl.pop("done")
                end = max(end, ts if done is None else done)
            sl["ts"], sl["dur"] = start, end - start
            cursor = end
            out.append(sl)
    r.trace.close()


def write_perfetto(doc: dict, out) -> None:
    out.write(orjson.dumps(doc))
