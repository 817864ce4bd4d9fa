"""The collectives of registered ops (collective_ops.CUSTOM, `register_collective_op`: vLLM's
`_C.shm_allreduce`) recorded by the native recorder itself (alloc_recorder.cpp, record_coll):
their `coll` and `coll_done` go in order with the allocation records, the buffers resolved in C++.
The trace must say what Python's own recording of the same calls says (HAZSAN_NATIVE_COLLECTIVES=0),
through every way a buffer is placed: a fresh block, a view, no elements, a block placed in a
symmetric window, a storage the recorder never saw, a list argument, the op's result."""
from __future__ import annotations

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


PROGRAM = """
    import threading, torch, sanitizer
    from sanitizer.capture import collectives, runtime

    lib = torch.library.Library("hz_ncoll", "DEF")
    lib.define("allreduce(Tensor(a!) data, int handle) -> ()")
    lib.define("gather(Tensor x, Tensor[] parts, int handle) -> Tensor")
    lib.impl("allreduce", lambda data, handle: None, "CPU")
    lib.impl("gather", lambda x, parts, handle: torch.cat([x, *parts]), "CPU")
    collectives.register_collective_op("hz_ncoll::allreduce", kind="ring", comm="handle")
    collectives.register_collective_op("hz_ncoll::gather", kind="ring", comm="handle")
    assert (runtime.active().collectives.native is not None) == NATIVE_COLLS, "the path asked for"

    # memory the allocator never made: not an allocation, recorded where it is (BorrowedBlock)
    foreign = torch.frombuffer(bytearray(64), dtype=torch.float32)
    def on_a_thread():
        y = torch.ones(8)
        torch.ops.hz_ncoll.allreduce(y, 3)

    for n in range(6):
        with sanitizer.step(n):
            x = torch.full((16,), float(n))
            torch.ops.hz_ncoll.allreduce(x, 0)                      # a fresh block
            torch.ops.hz_ncoll.allreduce(x[::2], 1)                 # a strided view
            torch.ops.hz_ncoll.allreduce(torch.empty(0), 0)         # no memory: no buffer
            with sanitizer.symmetric_scope("tp", pool="tp"):
                w = torch.empty(32)                                 # placed in the modelled window
            torch.ops.hz_ncoll.allreduce(w[4:12], 0)
            torch.ops.hz_ncoll.allreduce(foreign, 2)                # its own bytes, no block
            g = torch.ops.hz_ncoll.gather(x, [w[:4], x[2:6]], 0)    # a list argument and a result
            th = threading.Thread(target=on_a_thread); th.start(); th.join()
            del w, g
"""


def _run(tmp_path, name, native_colls, **extra):
    traces = tmp_path / name
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN") or k == "HAZSAN_NATIVE_CACHE"}
    env.update(HAZSAN="1", HAZSAN_DIR=str(traces), HAZSAN_NATIVE="1", HAZSAN_RAISE="1", PYTHONPATH=str(ROOT),
               HAZSAN_NATIVE_COLLECTIVES="1" if native_colls else "0")
    env.update({k: str(v) for k, v in extra.items()})
    src = tmp_path / f"{name}-src"           # (one file name: the call sites are compared)
    src.mkdir()
    (src / "prog.py").write_text(textwrap.dedent(PROGRAM).replace("NATIVE_COLLS", str(native_colls)))
    out = subprocess.run([sys.executable, "prog.py"], cwd=src, env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    (path,) = [p for p in traces.iterdir() if p.suffix in (".hzs", ".jsonl")]
    return path


def _normalized(path):
    """The trace's events without times, every address as (block, offset): two runs place their
    memory differently, never their blocks in a different order. A block is named by the order of
    its `alloc` in the trace (its id is only a label: the recorder numbers the blocks of a drain
    before Python adopts a storage among them). An address in no block is ("external", None)."""
    from sanitizer.trace.reader import open_trace
    tf = open_trace(path)
    live: dict[int, tuple] = {}
    names: dict[int, int] = {}
    threads: dict[int, str] = {}
    counter = iter(range(1, 1 << 30))
    out = []

    def where(addr):
        for bid, (a, size) in live.items():
            if a <= addr < a + max(size, 1):
                return bid, addr - a
        return "external", None

    for _, ev in tf.events():
        assert not isinstance(ev, Exception), ev
        ev = {k: v for k, v in ev.items() if k != "t"}
        if ev["ev"] == "alloc":
            ev["id"] = names.setdefault(ev["id"], len(names) + 1)
            live[ev["id"]] = (ev.pop("addr"), ev["size"])
        elif ev["ev"] == "free":
            ev["id"] = names.get(ev["id"], ev["id"])
            live.pop(ev["id"], None)
        elif ev["ev"] == "coll":
            ev["bufs"] = [(*where(b["addr"]), b["size"], b["access"]) for b in ev["bufs"]]
        elif ev["ev"] in ("thread", "thread_start", "thread_end", "thread_join") and ev["thread"] != 0:
            # host threads, named in order of appearance (an id the system reused is a new thread)
            if ev["ev"] == "thread_start" or ev["thread"] not in threads:
                threads[ev["thread"]] = f"T{next(counter)}"
            ev["thread"] = threads[ev["thread"]]
        out.append(ev)
    assert tf.end is not None and not tf.end.get("dropped"), (path, tf.end)
    return out


@pytest.mark.parametrize("fmt,packed", [("binary", "1"), ("binary", "0"), ("jsonl", "1")])
def test_the_recorder_writes_what_python_writes_of_a_registered_collective(tmp_path, fmt, packed):
    extra = dict(HAZSAN_TRACE_FORMAT=fmt, HAZSAN_NATIVE_PACKED=packed, HAZSAN_LEVEL="alloc")
    native = _normalized(_run(tmp_path, "native", True, **extra))
    python = _normalized(_run(tmp_path, "python", False, **extra))
    assert native == python
    colls = [e for e in native if e["ev"] == "coll"]
    assert len(colls) == 6 * 7 and sum(e["ev"] == "coll_done" for e in native) == len(colls)
    first = colls[:7]
    assert [e["comm"] for e in first] == ["ring:0", "ring:1", "ring:0", "ring:0", "ring:2", "ring:0", "ring:3"]
    assert [e["seq"] for e in first] == [0, 0, 1, 2, 0, 3, 0]
    assert {e["op"] for e in colls} == {"hz_ncoll.allreduce", "hz_ncoll.gather"}
    fresh, view, empty, windowed, external, gather, threaded = first
    assert [b[1:] for b in fresh["bufs"]] == [(0, 64, "rw")]
    assert [b[1:] for b in view["bufs"]] == [(0, 60, "rw")]      # 8 elements 2 apart: 15 spanned
    assert empty["bufs"] == []
    assert [b[1:] for b in windowed["bufs"]] == [(16, 32, "rw")]
    assert external["bufs"] == [("external", None, 64, "rw")]
    assert [b[1:] for b in gather["bufs"]] == [(0, 64, "r"), (0, 16, "r"), (8, 16, "r"), (0, 96, "w")]
    assert gather["bufs"][0][0] == gather["bufs"][2][0] == fresh["bufs"][0][0]
    assert threaded["site"].endswith(":on_a_thread") and [b[1:] for b in threaded["bufs"]] == [(0, 32, "rw")]
    assert all(b[0] != "external" for e in colls if e["comm"] != "ring:2" for b in e["bufs"]), \
        "every buffer but the frombuffer memory's in a known block"
    windows = {e["id"] for e in native if e["ev"] == "alloc" and e.get("pool") == "tp"}
    assert windowed["bufs"][0][0] in windows
    # the frombuffer storage is no allocation (docs/capture-details.md, "Storages that are not
    # allocations"): never adopted, on either path
    assert not [e for e in native if e["ev"] == "alloc" and e.get("op") == "adopted"]
    # every coll is completed at once, before anything else happens on the host
    for i, e in enumerate(native):
        if e["ev"] == "coll":
            assert native[i + 1] == {"ev": "coll_done", "cid": e["cid"]}, native[i:i + 3]
    assert all(e.get("site", "").startswith("prog.py:") for e in colls), colls[0]


def test_a_collective_the_recorder_cannot_place_is_left_to_python(tmp_path):
    """record_coll records nothing and says so for a tensor off the host (its stream is not
    `cpu`): the caller (`_custom`) then records the collective itself."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "prog.py").write_text(textwrap.dedent("""
        import torch
        from sanitizer.capture import runtime
        lib = runtime.active().blocks.lib
        host = torch.ones(4)
        before = lib.pending()
        print(lib.record_coll(1, "ring:0", 0, "x.y", [torch.ones(4, device="meta")], [2], True),
              lib.pending() - before,
              lib.record_coll(2, "ring:0", 1, "x.y", [[host, None], 7, None], [0, 0, 1], True),
              lib.pending() - before)
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN") or k == "HAZSAN_NATIVE_CACHE"}
    env.update(HAZSAN="1", HAZSAN_DIR=str(tmp_path / "t"), HAZSAN_NATIVE="1", HAZSAN_RAISE="1",
               PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "prog.py"], cwd=src, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["False", "0", "True", "2"], out.stdout
