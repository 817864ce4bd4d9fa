"""`hazsan export --perfetto`: rank traces as a Chrome Trace Event Format file for ui.perfetto.dev.

The JSON object form ({"traceEvents": [...], "displayTimeUnit": "ns"}), timestamps in microseconds
from the earliest event of all ranks (the trace's `t`; a file without `t` counts one microsecond a
line). Mapping:

  process (pid)       one per rank file, named "rank R (file)"
  thread (tid) 0      the host: decode steps as complete slices ("X"), step to step
  thread (tid) 1..    one per stream: collectives and launches as complete slices. A stream runs
                      its work in order, so each slice starts at max(enqueue, end of the previous one)
                      and a collective ends where the engine finds it done for the host under the
                      `--peer-completion` mode of the findings (sanitizer.rules.completions: their
                      own clocks and rule), a launch one microsecond later: slices on one track
                      never overlap, and none ends before a finding that says it is in flight.
  counter "memory"    bytes allocated per pool ("C"), on every alloc and free
  instant "i"         each finding, on the track of the stream or host where it fired (scope "t")
  flow "s"/"t"/"f"    the same collective (comm, seq) across ranks, one flow id per collective

Events are written as they are made (a slice waits only while a collective ahead of it on its
stream is not yet known done), so memory stays small whatever the trace length.
"""
from __future__ import annotations

import itertools
from collections import deque

import orjson

from sanitizer.rules.completions import CompletionReplay
from sanitizer.trace.reader import TraceError, expand_paths, open_trace

LAUNCH_US = 1.0


class _Writer:
    """The traceEvents array, written one event at a time."""

    def __init__(self, fh):
        self.fh = fh
        self.count = 0
        fh.write(b'{"traceEvents":[\n')

    def __call__(self, ev: dict) -> None:
        self.fh.write((b",\n" if self.count else b"") + orjson.dumps(ev))
        self.count += 1

    def close(self, extra: dict) -> None:
        self.fh.write(b"\n]," + orjson.dumps(extra)[1:] + b"\n")


class _Track:
    """One stream of one rank: slices wait here while a collective ahead of them is not known done."""

    __slots__ = ("queue", "cursor")

    def __init__(self):
        self.queue: deque = deque()
        self.cursor = 0.0


class _Rank:
    def __init__(self, pid, trace, emit):
        self.pid = pid
        self.trace = trace
        self.emit = emit
        self.tids: dict = {}
        self.tracks: dict = {}
        self.coll_slices: dict = {}  # (comm, seq) -> (tid, start ts) of its slice

    def tid(self, stream) -> int:
        t = self.tids.get(stream)
        if t is None:
            t = self.tids[stream] = len(self.tids) + 1
            self.tracks[t] = _Track()
            self.emit({"ph": "M", "name": "thread_name", "pid": self.pid, "tid": t,
                       "args": {"name": f"stream {stream}"}})
            self.emit({"ph": "M", "name": "thread_sort_index", "pid": self.pid, "tid": t,
                       "args": {"sort_index": t}})
        return t

    def place(self, tid) -> None:
        """Emit the track's slices up to the first collective not yet known done. A stream runs
        its work in order: a slice starts when enqueued or when the previous one ended, whichever
        is later; a collective lasts until it is known done."""
        track = self.tracks[tid]
        queue = track.queue
        while queue:
            sl = queue[0]
            if "done" in sl and sl["done"] is None:
                return
            queue.popleft()
            start = max(sl["ts"], track.cursor)
            end = start + LAUNCH_US
            if "done" in sl:
                end = max(end, sl.pop("done"))
                args = sl["args"]
                self.coll_slices[(args["comm"], args["seq"])] = (tid, start)
            sl["ts"], sl["dur"] = start, end - start
            track.cursor = end
            self.emit(sl)


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


def export_perfetto(paths, findings, fh, *, peer_completion: str = "local") -> dict:
    """Write the Chrome trace of `paths` (with `findings` as instants, made under
    `peer_completion`) to the binary file `fh`. Returns {"events": written, "ranks": converted}."""
    files = expand_paths(paths)
    starts = [t for t in (_first_t(p) for p in files) if t is not None]
    t0 = min(starts) if starts else 0
    by_file: dict = {}
    for f in findings:
        by_file.setdefault(str(f.file), {}).setdefault(f.line, []).append(f)
    emit = _Writer(fh)
    ranks = []
    for pid, path in enumerate(files):
        try:
            trace = open_trace(path)
        except TraceError:
            continue
        rank = _Rank(pid, trace, emit)
        emit({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
              "args": {"name": f"rank {trace.rank} ({trace.path.name})"}})
        emit({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        emit({"ph": "M", "name": "thread_name", "pid": pid, "tid": 0, "args": {"name": "host"}})
        _convert(rank, t0, by_file.get(str(path), {}), peer_completion)
        ranks.append(rank)
    for ev in _flows(ranks):
        emit(ev)
    emit.close({"displayTimeUnit": "ns", "otherData": {"producer": "hazsan export --perfetto", "ranks": len(ranks)}})
    return {"events": emit.count, "ranks": len(ranks)}


def _flows(ranks):
    """One flow per collective seen on two or more ranks: s on the first, t between, f on the last."""
    keys: dict = {}
    for r in ranks:
        for key, (tid, ts) in r.coll_slices.items():
            keys.setdefault(key, []).append((r.pid, tid, ts))
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
            yield ev


def _convert(r: _Rank, t0: int, findings_at: dict, peer_completion: str) -> None:
    emit = r.emit
    pending: dict = {}             # coll line -> its slice: collectives not yet known done
    blocks: dict = {}              # id -> (pool, size)
    pools: dict = {}               # pool -> bytes live
    step_open = None
    ts = 0.0
    capturing = 0

    def done(op, line):
        sl = pending.pop(op.line, None)
        if sl is not None:
            sl["done"] = ts
            r.place(sl["tid"])

    replay = CompletionReplay(r.trace.path, done, peer_completion=peer_completion)
    for line, ev in r.trace.events():
        if not isinstance(ev, dict):
            replay.upto(line)
            continue
        t = ev.get("t")
        ts = max(ts, (t - t0) / 1000.0) if isinstance(t, int) else ts + 1.0
        kind = ev.get("ev")
        try:
            if kind == "step":
                if step_open is not None:
                    step_open["dur"] = max(ts - step_open["ts"], 0.0)
                    emit(step_open)
                step_open = {"ph": "X", "name": f"step {ev.get('n')}", "cat": "step", "pid": r.pid, "tid": 0,
                             "ts": ts, "dur": 0.0, "args": {"n": ev.get("n"), "tokens": ev.get("tokens"), "line": line}}
            elif kind == "alloc":
                pool, size = str(ev.get("pool")), ev["size"]
                blocks[ev["id"]] = (pool, size)
                pools[pool] = pools.get(pool, 0) + size
                emit({"ph": "C", "name": "memory", "pid": r.pid, "tid": 0, "ts": ts, "args": pools})
            elif kind == "free":
                got = blocks.pop(ev["id"], None)
                if got is not None:
                    pools[got[0]] -= got[1]
                    emit({"ph": "C", "name": "memory", "pid": r.pid, "tid": 0, "ts": ts, "args": pools})
            elif kind == "graph_begin":
                capturing += 1
            elif kind == "graph_end":
                capturing = max(0, capturing - 1)
            elif kind in ("launch", "coll") and not capturing:
                stream = ev["stream"]
                tid = r.tid(stream)
                sl = {"ph": "X", "name": str(ev.get("op") or kind), "cat": kind, "pid": r.pid, "tid": tid,
                      "ts": ts, "dur": LAUNCH_US, "args": {"line": line, "site": ev.get("site")}}
                if kind == "coll":
                    sl["args"].update(cid=ev.get("cid"), comm=ev.get("comm"), seq=ev.get("seq"))
                    sl["done"] = None
                    pending[line] = sl
                r.tracks[tid].queue.append(sl)
                r.place(tid)
        except (KeyError, TypeError):
            pass               # malformed: `hazsan check` reports it
        replay.upto(line)      # the collectives done at this line end here
        for f in findings_at.get(line, ()):
            stream = (f.block or {}).get("stream")
            tid = r.tids.get(stream, 0) if stream is not None else 0
            emit({"ph": "i", "name": f.rule, "cat": "finding", "s": "t", "pid": r.pid, "tid": tid, "ts": ts,
                  "args": {"severity": f.severity, "line": f.line, "step": f.step, "site": f.site,
                           "detail": f.detail, "overlap": list(f.overlap) if f.overlap else None}})
    if step_open is not None:
        step_open["dur"] = max(ts - step_open["ts"], 0.0)
        emit(step_open)
    replay.close()
    for sl in pending.values():            # never known done: until the end of the trace
        sl["done"] = ts
    for tid in r.tracks:
        r.place(tid)
    r.trace.close()
