"""Windows through SGLang 0.5.23's real NCCLLibrary (issue 29, items 6 and 8), on CPU.

The library below NCCLLibrary is tests/support/sglang_cpu.py's ctypes-level stand-in, whose
ncclCommWindowRegister does what NCCL 2.29+'s src/dev_runtime.cc does:

    *win = nullptr;
    ...
    if (!comm->symmetricSupport) return ncclSuccess;        // success, no window
    NCCLCHECK(ncclGroupStartInternal());
    ... task->outWinDev = win; ncclIntruQueueEnqueue(...)   // written when the group ends
    exit: ncclGroupEndInternal()

so a communicator without symmetric support gets a NULL ncclWindow_t, which SGLang
(pynccl_allocator.allocate_symmetric_buffer: `window = window if window.value else None`) treats
as no window; and inside the caller's ncclGroupStart/End the handle is only written by the
outermost ncclGroupEnd. The pool's snapshot is torch's own MemPool.snapshot (include_traces
defaults to True, torch/cuda/memory.py) over a stand-in of its C binding.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("jsonl_capture")

pytest.importorskip("torch")


def _sglang_version():
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


if _sglang_version() != "0.5.23":
    pytest.skip("SGLang 0.5.23 is installed by `make test`", allow_module_level=True)

TESTS = Path(__file__).parents[1] / "support"   # the stand-in modules these runs import

PROGRAM = textwrap.dedent(r'''
    import json, os, sys
    import torch, torch.distributed as dist
    import sanitizer
    from sglang_cpu import Boundary, SO
    os.environ["SGLANG_NCCL_SO_PATH"] = SO
    dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
    fake = Boundary(0)
    from sglang.srt.distributed.device_communicators.pynccl_wrapper import NCCLLibrary, buffer_type
    lib = NCCLLibrary(SO)
    out = {}

    def comm(tag):
        uid = lib.ncclGetUniqueId()
        uid.internal[0] = tag                       # two communicators, two names
        return lib.ncclCommInitRank(1, uid, 0)

    # 1. no symmetric support: success, NULL window
    fake.nccl.symmetric = False
    plain = comm(1)
    p1 = lib.ncclMemAlloc(4096)
    w1 = lib.ncclCommWindowRegister(plain, buffer_type(p1), 4096, 1)
    out["null"] = [p1, w1.value]
    # 2. symmetric support, registered inside a group: the handle appears at ncclGroupEnd
    fake.nccl.symmetric = True
    sym = comm(2)
    p2, p3 = lib.ncclMemAlloc(8192), lib.ncclMemAlloc(8192)
    lib.ncclGroupStart()
    w2 = lib.ncclCommWindowRegister(sym, buffer_type(p2), 8192, 1)
    w3 = lib.ncclCommWindowRegister(sym, buffer_type(p3), 8192, 1)
    out["in_group"] = w2.value
    lib.ncclGroupEnd()
    out["after_group"] = [w2.value, w3.value]
    lib.ncclCommWindowDeregister(sym, w3)         # the second one first: found by its handle
    lib.ncclCommWindowDeregister(sym, w2)
    out["windowed"] = [p2, p3]
    # 3. the symmetric pool of SGLang's scope, for a communicator known to have no symmetric
    #    support (its C++ plugin drops the ncclWindow_t), and the snapshot it reads
    from sanitizer.capture import runtime
    calls = runtime.active().nccl
    out["no_symmetric"] = sorted(calls.no_symmetric)
    from sglang.srt.distributed.device_communicators import pynccl_allocator

    class Ctx:
        group_coordinator = None
    ctx = Ctx()
    ctx._hazsan_comm = out["no_symmetric"][0]
    fake.pool.segments = [{"address": 0x7F0000000000, "total_size": 2 << 20, "blocks": []}]
    from sanitizer.capture import sglang_hooks
    reported = set()                               # one per installed hook, as on_pynccl_allocator keeps
    sglang_hooks._report_pool_windows(runtime.active(), pynccl_allocator, ctx, reported)
    ctx._hazsan_comm = "pynccl:tp"
    sglang_hooks._report_pool_windows(runtime.active(), pynccl_allocator, ctx, reported)
    out["snapshot_requests"] = fake.pool.requests
    print(json.dumps(out))
    dist.destroy_process_group()
''')


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("windows")
    (d / "prog.py").write_text(PROGRAM)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(d / "traces"),
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "prog.py", f"file://{d}/rdv"], cwd=d, env=env, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    lines = [json.loads(line) for line in (d / "traces" / "rank0.jsonl").read_bytes().splitlines()]
    return out, lines[0], lines[1:]


def test_the_stand_in_behaves_as_dev_runtime_cc(run):
    out, _, _ = run
    assert out["null"][1] is None                       # success, *win == NULL
    assert out["in_group"] is None                      # not written before the group ends
    assert all(out["after_group"])


def test_null_window_is_no_window(run):
    out, header, events = run
    assert not header["hooks"]["failed"]
    assert not [e for e in events if e["ev"] == "hook_error"]
    p1 = out["null"][0]
    assert [e for e in events if e["ev"] == "segment" and e["addr"] == p1]
    assert not [e for e in events if e["ev"] == "window" and e["addr"] == p1]


def test_group_windows_are_recorded_at_group_end_and_keyed_by_comm_and_address(run):
    out, _, events = run
    p2, p3 = out["windowed"]
    wins = [e for e in events if e["ev"] in ("window", "window_free") and e["addr"] in (p2, p3)]
    assert [(e["ev"], e["addr"]) for e in wins] == [("window", p2), ("window", p3),
                                                   ("window_free", p3), ("window_free", p2)]
    assert len({e["comm"] for e in wins}) == 1 and wins[0]["comm"] not in out["no_symmetric"]


def test_pool_segments_of_a_comm_without_symmetric_support_are_not_windows(run):
    out, _, events = run
    pool = [e for e in events if e.get("addr") == 0x7F0000000000]
    assert [(e["ev"], e.get("comm")) for e in pool] == [("segment", None), ("window", "pynccl:tp")]


def test_pool_snapshot_leaves_the_traces_out(run):
    """Item 8: every scope exit reads the pool's snapshot; with the traces it would turn the
    allocator's whole ring buffer into Python dicts each time."""
    out, _, _ = run
    assert out["snapshot_requests"] and all(r == [1, 0, False] for r in out["snapshot_requests"])


def _segments_capture():
    import types
    events = []
    cap = types.SimpleNamespace(event=lambda ev, with_site=True: events.append(ev), nccl=None,
                                failed=lambda hook, exc: events.append({"ev": "hook_error", "error": repr(exc)}))
    return cap, events


@pytest.mark.parametrize("early", [True, False])
def test_a_transient_in_a_fresh_pool_segment_is_judged_in_its_window(tmp_path, early):
    """Item 9. SGLang's pool registers a new segment as a window at scope exit
    (SymmetricMemoryContext.__exit__ -> _register_segments_for_comm -> the C++ plugin's
    ncclCommWindowRegister for every segment allocated since), after a transient allocated and
    freed inside the scope. The segment's window is written at the first allocation that lands in
    it (sglang_hooks.PoolSegments, found in the pool's own snapshot), so the engine sees the
    transient in the window; written only at exit (early=False), it would not."""
    import types

    from sglang_cpu import FakePool

    from sanitizer.capture.sglang_hooks import PoolSegments, _report_pool_windows

    seg = 0x7F0000000000
    pool = FakePool()
    pool.segments = [{"address": seg, "total_size": 2 << 20, "blocks": []}]
    module = types.SimpleNamespace(_mem_pool=pool)
    cap, events = _segments_capture()
    reported: set = set()
    segments = PoolSegments(cap, module, reported)
    comm = "pynccl:tp"
    # the previous layer's all-reduce is in flight (pynccl: no work handle) while the scope's
    # blocks live: peers may write the window then, which makes a transient there a hazard
    trace = [{"ev": "coll", "cid": 0, "comm": comm, "seq": 0, "op": "ncclAllReduce", "stream": "cuda:0",
              "bufs": [{"addr": seg + (1 << 20), "size": 4096, "access": "rw"}]},
             {"ev": "scope", "name": "symm", "enter": True, "pool": "symm", "comm": comm}]
    for bid, (addr, site) in enumerate([(seg, "mhc.py:10:einsum"), (seg + 4096, "mhc.py:12:out")], 1):
        if early:
            segments.allocated(comm, addr, 4096)     # what memory.BlockTable asks before the alloc
        trace += events
        events.clear()
        trace.append({"ev": "alloc", "id": bid, "addr": addr, "size": 4096, "stream": "cuda:0",
                      "pool": "symm", "site": site})
    trace.append({"ev": "free", "id": 1})
    trace.append({"ev": "scope", "name": "symm", "enter": False, "pool": "symm", "comm": comm})
    ctx = types.SimpleNamespace(_hazsan_comm=comm)
    _report_pool_windows(cap, module, ctx, reported)             # scope exit: nothing new if early
    trace += events
    trace += [{"ev": "coll", "cid": 1, "comm": comm, "seq": 1, "op": "ncclAllReduce", "stream": "cuda:0",
               "bufs": [{"addr": seg + 4096, "size": 4096, "access": "rw"}]},
              {"ev": "sync"}, {"ev": "free", "id": 2}, {"ev": "end"}]
    kinds = [e["ev"] for e in trace]
    assert kinds.count("window") == 1 and kinds.count("segment") == 1
    assert all(r[2] is False for r in pool.requests)             # snapshots without traces
    (tmp_path / "rank0.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in [{"hazsan": 1, "rank": 0}] + trace))
    out = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(tmp_path), "--format", "json"],
                         capture_output=True, text=True, timeout=60)
    findings = json.loads(out.stdout)["findings"]
    transients = [f for f in findings if f["rule"] == "transient-in-window"]
    assert [f["site"] for f in transients] == (["mhc.py:10:einsum"] if early else []), out.stdout[-2000:]
    if early:   # once known, a later allocation in the segment asks no snapshot
        n = len(pool.requests)
        segments.allocated(comm, seg + 8192, 512)
        assert len(pool.requests) == n
