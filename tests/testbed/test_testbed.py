"""The CPU symmetric-memory testbed: placement in the window, collectives across rank processes,
and a real corruption from an early free followed by a transient in the window.

In-process tests use a world of one rank (collectives then need no peers); the multi-rank tests
run one spawned world of 2 ranks each (process start-up dominates their time).
"""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")

from sanitizer.place import CachingAllocator, Arena  # noqa: E402
from sanitizer.rules.driver import analyze  # noqa: E402
from sanitizer.testbed import (  # noqa: E402
    PeerFailure, SymmetricCommunicator, TestbedError, WindowFiles, spawn)


def _events(path):
    with open(path) as f:
        lines = [json.loads(x) for x in f if x.strip()]
    return lines[0], lines[1:]


@pytest.fixture
def solo(tmp_path):
    files = WindowFiles.create(1, 8 << 20, directory=str(tmp_path))
    comm = SymmetricCommunicator(files, 0, trace_dir=str(tmp_path / "trace"))
    yield comm
    comm.close()
    files.unlink()


# ------------------------------------------------------------------------------ one rank
def test_scope_places_fresh_outputs_in_the_window_where_the_model_says(solo):
    comm = solo
    outside = torch.arange(1000, dtype=torch.float32)
    with comm.scope():
        a = torch.full((1000,), 2.0)            # factory: placed
        b = a * outside                         # fresh output: placed
        v = b[10:20]                            # view: not a new block
        outside.add_(1)                         # in place on an outside tensor: stays outside
    base, size = comm.window.base, comm.window.size
    for t in (a, b, v):
        assert base <= t.data_ptr() < base + size
    assert not base <= outside.data_ptr() < base + size
    assert torch.equal(b, 2.0 * torch.arange(1000, dtype=torch.float32))
    assert comm.pool.allocations == 2
    # the placement model, fed the same requests, puts the blocks at the same window offsets
    model = CachingAllocator()
    model.create_pool("symm", segment_source=Arena(base=0, capacity=size), kind="symmetric")
    want = [model.malloc(4000, stream="cpu", pool="symm").addr for _ in range(2)]
    assert [comm.offset(a), comm.offset(b)] == want
    # the bytes really are the shared window's
    assert comm.window.view(comm.offset(b), 4000, torch.float32)[3].item() == 6.0


def test_freed_block_is_reused_and_events_are_recorded(solo):
    comm = solo
    with comm.scope():
        x = torch.zeros(4096)
    off = comm.offset(x)
    del x                                      # storage dies: block back to the pool
    with comm.scope():
        y = torch.ones(4096)
    assert comm.offset(y) == off               # same stream, same size: same bytes
    comm.recorder.flush()
    header, evs = _events(comm.recorder.path)
    assert header["hazsan"] == 1 and header["rank"] == 0
    kinds = [e["ev"] for e in evs]
    assert kinds[0] == "window" and "segment" in kinds
    allocs = [e for e in evs if e["ev"] == "alloc"]
    frees = [e for e in evs if e["ev"] == "free"]
    assert [a["addr"] - comm.window.base for a in allocs] == [off, off]
    assert frees == [{"ev": "free", "id": allocs[0]["id"], "t": frees[0]["t"]}]
    assert allocs[0]["site"].endswith(":test_freed_block_is_reused_and_events_are_recorded")
    assert allocs[0]["shape"] == [4096] and allocs[0]["dtype"] == "float32"
    assert [e["enter"] for e in evs if e["ev"] == "scope"] == [True, False, True, False]


def test_record_stream_holds_the_block_until_the_comm_work_is_done(solo):
    comm = solo
    comm.read_delay = 0.3                      # the collective is still queued when we free
    with comm.scope():
        x = torch.ones(2048)
    work = comm.all_reduce(x)
    comm.record_stream(x)
    off = comm.offset(x)
    del x
    with comm.scope():
        t = torch.full((2048,), 7.0)           # must not land on the in-flight buffer
    assert comm.offset(t) != off
    work.wait()
    with comm.scope():
        u = torch.zeros(2048)                  # after completion the held block is free again
    assert comm.offset(u) == off
    comm.recorder.flush()
    _, evs = _events(comm.recorder.path)
    kinds = [e["ev"] for e in evs]
    assert "record_stream" in kinds and "free_done" in kinds and "coll_done" in kinds
    assert kinds.index("free_done") > kinds.index("coll_done") or kinds.index("free_done") > kinds.index("free")


def test_buffers_outside_the_window_are_refused(solo):
    with pytest.raises(TestbedError, match="not inside the window"):
        solo.all_reduce(torch.ones(16))
    with solo.scope():
        x = torch.ones(16, 4)
    with pytest.raises(TestbedError, match="contiguous"):
        solo.all_reduce(x.t())
    with pytest.raises(TestbedError, match="outside"):
        solo.all_reduce_at(solo.window.size - 8, 16, torch.float32)
    with pytest.raises(TestbedError, match="multiples"):
        solo.all_reduce_at(2, 16, torch.float32)


def test_a_full_window_says_so(solo):
    with pytest.raises(TestbedError, match="larger window_bytes"):
        with solo.scope():
            torch.empty(16 << 20, dtype=torch.uint8)


def test_missing_peer_times_out_instead_of_hanging(tmp_path):
    files = WindowFiles.create(2, 4 << 20, directory=str(tmp_path))
    comm = SymmetricCommunicator(files, 0, timeout=0.5)
    try:
        x = comm.empty((8,), torch.float32)
        with pytest.raises(PeerFailure, match=r"ranks \[1\] did not arrive"):
            comm.all_reduce(x).wait(timeout=10)
    finally:
        comm.close()
        files.unlink()


# ------------------------------------------------------------------------------ two ranks
def _collectives_and_corruption(rank, files, trace_root):
    torch.set_num_threads(1)
    out = {}
    # 1. correct collectives, traced
    with SymmetricCommunicator(files, rank, name="tp", trace_dir=os.path.join(trace_root, "clean")) as comm:
        ramp = torch.arange(3000, dtype=torch.float32)      # outside: a transient in the scope is flagged
        with comm.scope():
            a = ramp * (rank + 1)
            b = torch.full((1024,), float(rank + 1), dtype=torch.bfloat16)
            o = torch.empty(1024, dtype=torch.bfloat16)
            g = torch.empty(2 * 3000, dtype=torch.float32)
        w1 = comm.all_reduce(a)
        w2 = comm.all_reduce(b, out=o)
        w1.wait()
        w2.wait()
        assert w1.is_completed() and w2.is_completed()
        comm.all_gather(a, g).wait()
        out["sum"] = bool(torch.equal(a, torch.arange(3000, dtype=torch.float32) * 3))
        out["sum_bf16"] = bool(torch.equal(o, torch.full((1024,), 3.0, dtype=torch.bfloat16)))
        out["input_untouched"] = bool(torch.equal(b, torch.full((1024,), float(rank + 1), dtype=torch.bfloat16)))
        out["gather"] = bool(torch.equal(g, torch.cat([a, a])))
        out["offsets"] = [comm.offset(t) for t in (a, b, o, g)]
        # the same by offsets alone, as a symmetric kernel is called
        comm.all_reduce_at(comm.offset(b), b.numel() * 2, torch.bfloat16).wait()
        out["by_offset"] = bool(torch.equal(b, torch.full((1024,), 3.0, dtype=torch.bfloat16)))
    # 2. the hazard: the input's last reference dropped before the wait, then a transient
    with SymmetricCommunicator(files, rank, name="tp", trace_dir=os.path.join(trace_root, "early"),
                               read_delay=0.3) as comm:
        with comm.scope():
            x = torch.full((4096,), float(rank + 1))
            y = torch.empty(4096)
        x_off = comm.offset(x)
        work = comm.all_reduce(x, out=y)
        del x                                         # the collective keeps no reference
        with comm.scope():
            t = torch.full((4096,), 100.0)            # a transient: lands on the freed input
        out["transient_on_input"] = comm.offset(t) == x_off
        work.wait()
        out["corrupted"] = int((y != 3.0).sum())      # expected 1 + 2 everywhere
        out["transient_overwritten"] = int((t != 100.0).sum())
    # 3. a barrier-less kernel: rank 1 is slow, rank 0 completes without waiting for it and frees
    #    its input only after its own wait (fine by local completion), then writes a transient there
    with SymmetricCommunicator(files, rank, name="tp", trace_dir=os.path.join(trace_root, "barrierless"),
                               end_barrier=False, read_delay=0.6 if rank == 1 else 0.0) as comm:
        with comm.scope():
            x = torch.full((4096,), float(rank + 1))
            y = torch.empty(4096)
        work = comm.all_reduce(x, out=y)
        work.wait()
        if rank == 0:
            del x
            with comm.scope():
                t = torch.full((4096,), 100.0)        # rank 1 is still loading this range
        out["barrierless_corrupted"] = int((y != 3.0).sum())
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("testbed2")
    results = spawn(_collectives_and_corruption, 2, args=(str(root),), window_bytes=8 << 20, timeout=120)
    return root, results


def test_collectives_sum_and_gather_across_two_ranks(two_ranks):
    root, results = two_ranks
    for r in results:
        assert r["sum"] and r["sum_bf16"] and r["input_untouched"] and r["gather"] and r["by_offset"], r
    assert results[0]["offsets"] == results[1]["offsets"]      # symmetric placement
    analysis = analyze([str(root / "clean")])
    assert analysis.errors == []
    assert analysis.findings == []
    assert analysis.summary["ranks"] == 2
    _, evs = _events(root / "clean" / "rank1.jsonl")
    colls = [e for e in evs if e["ev"] == "coll"]
    assert [(c["op"], c["seq"]) for c in colls] == [("all_reduce", 1), ("all_reduce", 2), ("all_gather", 3),
                                                    ("all_reduce", 4)]
    assert colls[1]["bufs"][0]["access"] == "r" and colls[1]["bufs"][1]["access"] == "w"
    assert {e["cid"] for e in evs if e["ev"] == "coll_done"} == {c["cid"] for c in colls}


def test_early_free_then_transient_really_corrupts_and_is_flagged(two_ranks):
    root, results = two_ranks
    for r in results:
        assert r["transient_on_input"]
        # every peer loaded 100.0 from the freed input: the sum is wrong everywhere, on both ranks
        assert r["corrupted"] == 4096
    analysis = analyze([str(root / "early")])
    rules = analysis.summary["by_rule"]
    assert rules.get("free-in-flight") == 2 and rules.get("reuse-in-flight") == 2, rules
    assert analysis.exit_code() == 1


def test_barrierless_kernel_peer_reads_after_local_completion(two_ranks):
    root, results = two_ranks
    # rank 0 finished before rank 1 loaded its input: its own sum is right, rank 1's is not
    assert results[0]["barrierless_corrupted"] == 0
    assert results[1]["barrierless_corrupted"] == 4096
    # by local completion (NCCL's contract) nothing is wrong on rank 0; by successor semantics
    # (for barrier-less kernels) the transient overlaps a collective buffer peers may still use
    assert analyze([str(root / "barrierless")]).summary["by_rule"] == {}
    strict = analyze([str(root / "barrierless")], peer_completion="successor").summary["by_rule"]
    assert strict.get("reuse-in-flight") == 1, strict
