"""The native recorder's packed runs (alloc_recorder.cpp, PackedRun): a drain's plain records kept
as structs until the writer encodes them. They must reach a binary trace byte for byte as the
tuple path writes the same events, through every way the writer cuts and counts a batch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gloo_programs import require_native

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _native_here():
    require_native()


def _env(traces, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN") or k == "HAZSAN_NATIVE_CACHE"}
    # level alloc unless asked: packed runs hold the allocation records (launches are not packed)
    env.update(HAZSAN="1", HAZSAN_DIR=str(traces), HAZSAN_NATIVE="1", HAZSAN_RAISE="1",
               HAZSAN_TRACE_FORMAT="binary", HAZSAN_LEVEL="alloc", PYTHONPATH=str(ROOT))
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _run(tmp_path, code, env, timeout=180):
    (tmp_path / "prog.py").write_text(textwrap.dedent(code))
    out = subprocess.run([sys.executable, "prog.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


# In one captured process (level full: allocations, frees and launches, one with hundreds of
# ranges), the records are drained once as a packed run; every comparison below encodes that
# run and the tuples it stands for (`events()`, the tuple path's own builders) with fresh value
# tables, and must give the same bytes.
EQUAL = """
    import json, threading, torch
    from sanitizer.capture import runtime
    from sanitizer.trace import binary as B

    cap = runtime.active()
    lib = cap.blocks.lib
    with cap.blocks._lock:
        cap.blocks.drain()                  # what capture recorded so far goes its own way
    keep = [torch.ones(i + 1) for i in range(40)]
    for i in range(700):
        x = (keep[i % 40] * 2.0).contiguous()
    parts = [torch.ones(3) for _ in range(700)]
    for _ in range(600):                    # launches with 700 reads: 512 of them outgrow a frame
        big = torch.cat(parts)
    def no_python_frame():
        torch.ones(1000).add_(1.0)          # (a site is still found: this frame is Python's)
    th = threading.Thread(target=no_python_frame)
    th._hazsan_sync = False                 # no start/join edges: their events would drain the records
    th.start(); th.join()
    # registered ops' collectives (record_coll): short and long comm names (fixstr and str8), views
    for i in range(30):
        lib.record_coll(10_000 + i, "ring:0" if i % 2 else "a-communicator-named-at-length:" + "x" * i, i,
                        "hz.allreduce", [keep[i], [keep[i + 1][1:], None], parts[i]], [2, 0, 1], i % 3 != 0)
    del keep, x, big
    with cap.blocks._lock:
        events, specials, *_ = lib.drain_events(False, True)
    run = events
    tuples = run.events()
    kinds = sorted({t[0] for t in tuples})
    out = {"n": len(run), "tuples": len(tuples), "kinds": kinds, "specials": len(specials),
           "sites": len({t[11] for t in tuples if t[0] == 5}), "no_site": sum(1 for t in tuples if t[0] == 5 and t[11] is None)}

    def _frames(data):
        at, n = len(B.signature_and_header({"hazsan": 1})), 0
        while at < len(data):
            kind, size = B.PREFIX.unpack_from(data, at)
            n += kind == B.FRAME_EVENTS
            at += B.PREFIX_SIZE + size
        return n

    def both(make_batch, prefill=()):
        got = []
        for packed in (True, False):
            table = B.ValueTable()
            for field, value in prefill:
                table.ref(field, value)
            table.pending()
            batch = make_batch(packed)
            got.append(B.encode_frames(batch, table, packed=packed) if packed else B.encode_frames(batch, table))
        return got[0] == got[1], len(got[0])

    n = len(run)
    cut = lambda packed, a, b: run.part(a, b) if packed else tuples[a:b]
    step = {"ev": "step", "n": 3, "t": 1}
    out["whole"] = both(lambda p: [run] if p else list(tuples))
    # Python's events between parts, frames cut inside runs (512 events a frame), empty parts
    out["mixed"] = both(lambda p: [step, *([cut(p, 0, 100)] if p else cut(p, 0, 100)), (6, 1, 2),
                                   *([cut(p, 100, 100)] if p else []),
                                   *([cut(p, 100, 1337)] if p else cut(p, 100, 1337)), step,
                                   *([cut(p, 1337, n)] if p else cut(p, 1337, n))])
    # some of the sites and op labels already in the file's tables, with the indices they have
    sites = sorted({t[11] for t in tuples if t[0] == 5 and t[11] is not None})
    ops = sorted({t[8] for t in tuples if t[0] == 9 and t[8] is not None})
    out["prefilled"] = both(lambda p: [run] if p else list(tuples),
                            [("site", "elsewhere.py:1:f")] + [("site", s) for s in sites[::2]] + [("op", o) for o in ops[:1]])
    # the result decodes to the tuple path's events
    table = B.ValueTable()
    data = B.signature_and_header({"hazsan": 1}) + B.encode_frames([run], table, packed=True)
    out["ops"] = ops
    out["frames_split"] = data.count(bytes([B.FRAME_EVENTS])) > 0 and _frames(data) > len(run) // 512 + 1
    out["big_launch_ranges"] = max(len(t[2] or ()) for t in tuples if t[0] == 9)
    out["part_bounds"] = [len(run.part(-5, 3)), len(run.part(5, 2)), len(run.part(n - 2, n + 10))]
    open("packed.hzs", "wb").write(data)
    print(json.dumps(out))
"""


def test_a_packed_run_encodes_as_the_tuples_it_stands_for(tmp_path):
    # no time flush drains part of the run first (a loaded machine takes over 2 s here)
    out = _run(tmp_path, EQUAL, _env(tmp_path / "t", HAZSAN_LEVEL="full", HAZSAN_FLUSH_SECONDS=600,
                                     HAZSAN_IDLE_SECONDS=600))
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["n"] == got["tuples"] > 2000, got
    assert got["kinds"] == [5, 6, 9, 10, 11], got         # allocations, frees, launches, colls, their ends
    assert got["sites"] >= 2, got
    assert got["big_launch_ranges"] == 700 and got["frames_split"], got
    assert got["whole"][0] and got["mixed"][0] and got["prefilled"][0], got
    assert got["part_bounds"] == [3, 0, 2], got
    # the run's frames decode: every record with its kind, sites and op labels as values again
    from sanitizer.trace.reader import open_trace
    tf = open_trace(tmp_path / "packed.hzs")
    events = [ev for _, ev in tf.events()]
    assert not [e for e in events if isinstance(e, Exception)]
    assert len(events) == got["n"]
    assert {e["ev"] for e in events} == {"alloc", "free", "launch", "coll", "coll_done"}
    colls = [e for e in events if e["ev"] == "coll"]
    assert len(colls) == 30 and sum(e["ev"] == "coll_done" for e in events) == 20
    assert [b["access"] for b in colls[0]["bufs"]] == ["rw", "r", "w"] and colls[1]["comm"] == "ring:0"
    assert colls[28]["comm"].endswith("x" * 28) and colls[28]["seq"] == 28 and colls[28]["op"] == "hz.allreduce"
    assert {e["op"] for e in events if e["ev"] == "launch"} == set(got["ops"])
    assert all(isinstance(e.get("site", ""), str) for e in events)


STEPS = """
    import torch, sanitizer
    x = torch.ones(64)
    for n in range(40):
        with sanitizer.step(n, phase="decode"):
            for i in range(25):
                x = (x * 1.0001).contiguous()
            with sanitizer.symmetric_scope("tp", pool="tp"):    # placed in the window: a special
                y = torch.empty(256 + n)
            del y
            z = torch.empty(100 + n)
"""


def _events(traces):
    from sanitizer.trace.reader import open_trace
    (path,) = Path(traces).glob("*.hzs")
    tf = open_trace(path)
    out = []
    for _, ev in tf.events():
        assert not isinstance(ev, Exception), ev
        out.append({k: v for k, v in ev.items() if k not in ("t", "addr")})
    return tf, out


@pytest.mark.parametrize("cap", [None, 500])
def test_packed_and_tuple_paths_write_the_same_trace(tmp_path, cap):
    """The same program with packed runs and without (HAZSAN_NATIVE_PACKED=0): the same events in
    the same order (but times and real addresses), the same drops counted under HAZSAN_MAX_EVENTS."""
    extra = {} if cap is None else {"HAZSAN_MAX_EVENTS": cap}
    got = {}
    for packed in ("1", "0"):
        traces = tmp_path / f"t{packed}"
        _run(tmp_path, STEPS, _env(traces, HAZSAN_NATIVE_PACKED=packed, **extra))
        tf, events = _events(traces)
        got[packed] = (events, tf.end)
    (packed_events, packed_end), (tuple_events, tuple_end) = got["1"], got["0"]
    # (where drops are counted depends on when flushes ran: the counts must agree, not the records)
    assert [e for e in packed_events if e["ev"] != "dropped"] == [e for e in tuple_events if e["ev"] != "dropped"]
    assert packed_end["dropped"] == tuple_end["dropped"]
    assert sum(e["count"] for e in packed_events if e["ev"] == "dropped") == packed_end["dropped"]
    kinds = [e["ev"] for e in packed_events]
    assert packed_end["events"] == len(packed_events), packed_end
    if cap is None:
        assert kinds.count("step") == 40 and kinds.count("alloc") > 1000 and "dropped" not in kinds
        assert any(e["ev"] == "alloc" and e.get("pool") == "tp" for e in packed_events)   # the specials
    else:
        assert sum(1 for k in kinds if k != "dropped") == cap and packed_end["dropped"] > 1000, packed_end
