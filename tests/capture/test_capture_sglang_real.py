"""Capture on SGLang 0.5.23's own communicator code (installed from PyPI, --no-deps), two ranks on CPU.

Driven for real: NCCLLibrary, PyNcclCommunicator, GroupCoordinator (its pynccl routes, as SGLang
takes them under `pynccl_comm.change_state(enable=True)`), pynccl_allocator.SymmetricMemoryContext.
Faked: only the CUDA/NCCL boundary (tests/support/sglang_cpu.py says exactly what, and what is stubbed).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

pytest.importorskip("torch")

def _sglang_version():
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


if _sglang_version() != "0.5.23":
    pytest.skip("SGLang 0.5.23 is installed by `make test` (pip install --no-deps sglang==0.5.23)",
                allow_module_level=True)

TESTS = Path(__file__).parents[1] / "support"   # the stand-in modules these runs import
HANDLE = 0xABC0          # the cudaStream_t the fake current stream reports

SERVER = textwrap.dedent(r'''
    import json, os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    import sanitizer

    def worker(rank, ws, init, outdir):
        from sglang_cpu import Boundary, SO
        os.environ["SGLANG_NCCL_SO_PATH"] = SO
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
        fake = Boundary(rank, stream_handle=%(handle)d)
        from sglang.srt.distributed.parallel_state import GroupCoordinator
        from sglang.srt.distributed.device_communicators.pynccl_allocator import SymmetricMemoryContext
        from sglang.srt.distributed.device_communicators.pynccl_wrapper import buffer_type, cudaStream_t
        tp = GroupCoordinator([[0, 1]], rank, "gloo", use_pynccl=True, use_mscclpp=False,
                              use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
                              use_hpu_communicator=False, use_xpu_communicator=False, group_name="tp")
        pc = tp.pynccl_comm
        ptr = {}
        torch.manual_seed(0)
        w = torch.randn(64, 32)
        sanitizer.step(1)
        with pc.change_state(enable=True):
            x = torch.randn(16, 64)
            with SymmetricMemoryContext(tp):
                h = torch.einsum("tk,kd->td", x, w)          # the mHC mistake: compute in the scope
                out = torch.empty(16, 32)
                out.copy_(h)
                del h
            ptr["out"] = [out.data_ptr(), out.nbytes]
            tp._all_reduce_in_place(out)                         # ncclAllReduce, in place
            part = torch.full((8,), float(rank))
            gathered = torch.empty(16)
            tp._all_gather_into_tensor(gathered, part)           # ncclAllGather
            rs_in, rs_out = torch.ones(2, 6), torch.empty(1, 6)
            tp._reduce_scatter_tensor(rs_out, rs_in)             # ncclReduceScatter
            b = torch.zeros(10, dtype=torch.bfloat16)
            tp.broadcast(b, src=0)                               # ncclBroadcast
            big = torch.zeros(40)
            ptr["big"] = [big.data_ptr(), big.nbytes]
            tp._all_reduce_in_place(big[8:24])                   # a slice of a block
            ag_out = torch.empty(8, 2)
            pc.all_gather(ag_out, torch.ones(3 if rank == 0 else 5, 2), sizes=[3, 5])  # grouped broadcasts
            a_in, a_out = torch.arange(4.0), torch.empty(4)
            tp._all_to_all_single(a_out, a_in)                   # grouped send+recv, every peer
            if rank == 0:
                tp.send(torch.ones(5), dst=1)                    # p2p
            else:
                got = tp.recv(torch.Size([5]), torch.float32, src=0)
            sanitizer.step(2)
            # the GPU path: the pool reports a segment at scope exit, registered for this comm
            fake.pool.segments = [{"address": 0x7F0000000000, "total_size": 2 << 20, "blocks": []}]
            with SymmetricMemoryContext(tp):
                y = torch.empty(4)
            # NCCL memory and a window of its own, through SGLang's communicator methods
            p = pc.nccl.ncclMemAlloc(4096)
            win = pc.register_comm_window_raw(p, 4096)
            pc.nccl.ncclAllReduce(buffer_type(p), buffer_type(p), 1024, 7, 0, pc.comm, cudaStream_t(%(handle)d))
            pc.deregister_comm_window(win)
            pc.nccl.ncclMemFree(p)
            ptr["raw"] = p
        # custom all-reduce's own kernel path (op-level hook). Its __init__ maps peer buffers with CUDA
        # IPC, so the instance is made without it; custom_all_reduce itself runs for real (warm-up branch)
        from sglang.srt.distributed.device_communicators.custom_all_reduce import CustomAllreduce
        ca = CustomAllreduce.__new__(CustomAllreduce)
        ca.disabled, ca.world_size, ca.full_nvlink, ca.max_size = False, 2, True, 1 << 20
        ca._IS_CAPTURING, ca.group = True, tp.cpu_group
        ca_in = torch.ones(64)
        ca_out = ca.custom_all_reduce(ca_in)
        ptr["ca"] = [ca_in.data_ptr(), ca_out.data_ptr()]
        # pynccl disabled again: GroupCoordinator falls back to torch's *_single on the device group
        g2 = torch.empty(16)
        tp._all_gather_into_tensor(g2, torch.ones(8))
        r2 = torch.empty(6)
        tp._reduce_scatter_tensor(r2, torch.ones(12))
        # the Triton multimem all-gather (op hook) on a path its kernel does not take (here disabled:
        # no multicast memory; on CPU float32 never fits it): it falls back to GroupCoordinator.all_gather,
        # torch's _allgather_base_ on the device group, recorded there with its completion
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.distributed.device_communicators.triton_symm_mem_ag import MultimemAllGatherer
        gatherer = MultimemAllGatherer(64, enabled=False, skip_entry_sync=True)
        with get_parallel().override(tp_group=tp):           # the TP group, as the server states it
            ptr["mm"] = list(gatherer(torch.ones(4, 8)).shape)
        with open(os.path.join(outdir, f"ptr{rank}.json"), "w") as fh:
            json.dump(ptr, fh)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
''') % {"handle": HANDLE}


def _load(path):
    with open(path, "rb") as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("sglang")
    (d / "server.py").write_text(SERVER)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(d / "traces"),
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "server.py", f"file://{d}/rdv", str(d)], cwd=d, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    ranks = {}
    for r in (0, 1):
        header, events = _load(d / "traces" / f"rank{r}.jsonl")
        ranks[r] = (header, events, json.loads((d / f"ptr{r}.json").read_text()))
    return d, ranks


def _pynccl_colls(events):
    return [e for e in events if e["ev"] == "coll" and e["comm"].startswith("pynccl:")]


def test_header_names_hooks_and_versions(run):
    _, ranks = run
    for r, (header, events, _) in ranks.items():
        hooks = header["hooks"]
        assert {"sglang.NCCLLibrary", "sglang.PyNcclCommunicator", "sglang.SymmetricMemoryContext",
                "sglang.pool-windows", "dispatch-mode", "collectives"} <= set(hooks["installed"])
        assert hooks["failed"] == {}
        assert header["versions"]["sglang"] == "0.5.23" and header["versions"]["torch"].startswith("2.")
        assert header["versions"]["nccl(sglang.NCCLLibrary)"] == "2.29.3"   # what the (fake) libnccl reported
        assert header["gpu"] is None                      # CPU run: no device facts to give
        assert not [e for e in events if e["ev"] == "hook_error"]


def test_every_pynccl_collective_with_exact_ranges_stream_and_seq(run):
    _, ranks = run
    per_rank = {}
    for r, (header, events, ptr) in ranks.items():
        blocks = {e["id"]: e for e in events if e["ev"] == "alloc"}
        colls = _pynccl_colls(events)
        per_rank[r] = [(c["comm"], c["seq"], c["op"]) for c in colls]
        comm = colls[0]["comm"]
        ops = [c["op"] for c in colls if c["comm"] == comm]
        assert ops == ["ncclAllReduce",            # PyNcclCommunicator's warm-up
                       "ncclAllReduce", "ncclAllGather", "ncclReduceScatter", "ncclBroadcast",
                       "ncclAllReduce", "group:ncclBroadcast", "group:ncclSend+ncclRecv", "ncclAllReduce"]
        assert [c["seq"] for c in colls if c["comm"] == comm] == list(range(9))
        by_op = [c for c in colls if c["comm"] == comm]
        warm, ar, ag, rs, bc, sl, gb, a2a, raw = by_op
        # bytes = count x dtype size, at the block's trace address
        (out_alloc,) = [e for e in blocks.values() if e.get("shape") == [16, 32] and e["op"] == "aten.empty.memory_format"]
        assert ar["bufs"] == [{"addr": out_alloc["addr"], "size": 16 * 32 * 4, "access": "rw"}]
        assert ar["stream"] == "cpu"            # host memory: ordered as the host's own work
        assert [b["size"] for b in ag["bufs"]] == [8 * 4, 16 * 4] and [b["access"] for b in ag["bufs"]] == ["r", "w"]
        assert [b["size"] for b in rs["bufs"]] == [12 * 4, 6 * 4]
        assert bc["bufs"][0]["size"] == 10 * 2 and bc["bufs"][0]["access"] == ("rw" if r == 0 else "w")
        # the slice big[8:24] names the block of `big`, 32 bytes in
        big_alloc = [e for e in blocks.values() if e.get("shape") == [40]][-1]
        assert sl["bufs"] == [{"addr": big_alloc["addr"] + 8 * 4, "size": 16 * 4, "access": "rw"}]
        # grouped: one coll, with every part's buffers
        assert len(gb["bufs"]) == 4 and len(a2a["bufs"]) == 4
        # a raw ncclMemAlloc pointer on the fake stream handle: the StreamIds id of that handle
        assert raw["bufs"] == [{"addr": ptr["raw"], "size": 4096, "access": "rw"}]
        assert raw["stream"] == "cuda:0:s1"
        p2p = [c for c in colls if ":p2p:" in c["comm"]]
        assert [(c["comm"], c["seq"], c["op"]) for c in p2p] == [(comm + ":p2p:0-1", 0, "ncclSend" if r == 0 else "ncclRecv")]
    # seq and comm match across ranks (ops differ only in send/recv)
    strip = lambda xs: [(c, s) for c, s, _ in xs]
    assert strip(per_rank[0]) == strip(per_rank[1])
    # the comm is named after the ProcessGroup pynccl is built on: equal on both ranks
    assert per_rank[0][0][0] == per_rank[1][0][0]


def test_torch_single_collectives_from_sglang(run):
    _, ranks = run
    for _, events, _ in ranks.values():
        # torch's all_gather_single / reduce_scatter_single, recorded as the c10d ops they dispatch
        singles = [e for e in events if e["ev"] == "coll" and e["op"].startswith("c10d.")
                   and "sglang/srt/distributed/parallel_state.py" in e.get("site", "")]
        assert [(e["op"], [(b["size"], b["access"]) for b in e["bufs"]]) for e in singles] == [
            ("c10d._allgather_base_", [(32, "r"), (64, "w")]),
            # gloo clones a reduce-scatter's input inside the call: only its output is in flight
            # (collective_ops.py: COPIED_AT_ENQUEUE)
            ("c10d._reduce_scatter_base_", [(24, "w")]),
            ("c10d._allgather_base_", [(128, "r"), (256, "w")])]     # the multimem fallback
        assert all(e["stream"].startswith("gloo:") and "sglang/srt/distributed/parallel_state.py" in e["site"]
                   for e in singles)
        done = {e["cid"] for e in events if e["ev"] == "coll_done"}
        assert all(e["cid"] in done for e in singles)     # gloo blocks the host: done at return


def test_custom_all_reduce_op_hook(run):
    _, ranks = run
    for header, events, ptr in ranks.values():
        assert "sglang.CustomAllreduce.custom_all_reduce" in header["hooks"]["installed"]
        (c,) = [e for e in events if e["ev"] == "coll" and e["op"] == "custom_ar.custom_all_reduce"]
        assert c["comm"].startswith("custom_ar:") and c["seq"] == 0 and c["stream"] == "cpu"
        assert [(b["size"], b["access"]) for b in c["bufs"]] == [(256, "r"), (256, "w")]
        assert c["site"].startswith("server.py:") and c["site"].endswith(":worker")


def test_op_hook_whose_call_falls_back_to_a_recorded_collective_leaves_no_second_record(run):
    """MultimemAllGatherer.__call__ (ops.py) ended up in torch's _allgather_base_, which the
    dispatcher recorded with its completion: the hook's own record (which would never complete,
    and made every TP=2 + NGRAM run report thousands of unordered-access errors) is not written."""
    d, ranks = run
    for header, events, ptr in ranks.values():
        assert "sglang.MultimemAllGatherer.__call__" in header["hooks"]["installed"]
        assert ptr["mm"] == [4, 16]
        assert not [e for e in events if e["ev"] == "coll" and e["comm"].startswith("multimem_ag")]
        (fallback,) = [e for e in events if e["ev"] == "coll" and e["op"] == "c10d._allgather_base_"
                       and (e["bufs"][0]["size"], e["bufs"][-1]["size"]) == (128, 256)]
        assert "sglang/srt/distributed/parallel_state.py" in fallback["site"]
        assert fallback["site"].endswith(":all_gather")           # GroupCoordinator.all_gather
        done = {e["cid"] for e in events if e["ev"] == "coll_done"}
        assert fallback["cid"] in done
        # no collective recorded anywhere in the run is left without its completion, but pynccl's
        # (NCCL completes on its stream: test_no_coll_done_for_nccl) and the custom all-reduce's
        # warm-up call (the op hook's own record: ordered on the current stream, no completion)
        pending = [e for e in events if e["ev"] == "coll" and e["cid"] not in done
                   and not e["comm"].startswith(("pynccl:", "custom_ar:"))]
        assert not pending, pending


def test_no_coll_done_for_nccl(run):
    _, ranks = run
    for _, events, _ in ranks.values():
        pyn = {c["cid"] for c in _pynccl_colls(events)}
        assert pyn and not [e for e in events if e["ev"] == "coll_done" and e["cid"] in pyn]


def test_scope_window_and_pool_segments_carry_the_pynccl_comm(run):
    _, ranks = run
    for _, events, ptr in ranks.values():
        comm = _pynccl_colls(events)[0]["comm"]
        scopes = [e for e in events if e["ev"] == "scope"]
        assert scopes and {e["comm"] for e in scopes} == {comm}
        windows = [e for e in events if e["ev"] == "window"]
        assert {w["comm"] for w in windows} == {comm}
        pool_seg = [e for e in events if e["ev"] == "segment" and e["addr"] == 0x7F0000000000]
        assert pool_seg and pool_seg[0]["size"] == 2 << 20 and pool_seg[0]["pool"] == "symm"
        assert [w for w in windows if w["addr"] == 0x7F0000000000 and w["size"] == 2 << 20]
        raw_win = [w for w in windows if w["addr"] == ptr["raw"]]
        assert raw_win and raw_win[0]["size"] == 4096
        assert [e for e in events if e["ev"] == "window_free" and e["addr"] == ptr["raw"]]
        assert [e for e in events if e["ev"] == "segment" and e["addr"] == ptr["raw"] and e["pool"] == "ncclMemAlloc"]
        assert [e for e in events if e["ev"] == "segment_free" and e["addr"] == ptr["raw"]]


def test_sites_name_sglang_frames(run):
    _, ranks = run
    _, events, _ = ranks[0]
    colls = _pynccl_colls(events)
    sites = [c["site"] for c in colls]
    assert all("site-packages/sglang/srt/distributed/" in s for s in sites[:-1]), sites
    assert any("/device_communicators/pynccl.py:" in s and s.endswith(":all_reduce") for s in sites)
    # allocations SGLang makes itself are attributed to SGLang's frames, not the caller's
    allocs = [e.get("site", "") for e in events if e["ev"] == "alloc"]
    assert any("site-packages/sglang/srt/distributed/parallel_state.py:" in s and s.endswith(":__init__")
               for s in allocs)
    _, events1, _ = ranks[1]
    (recv_alloc,) = [e for e in events1 if e["ev"] == "alloc" and e.get("site", "").endswith(":recv")]
    assert "sglang/srt/distributed/parallel_state.py" in recv_alloc["site"]


def test_check_flags_the_einsum_transient_not_the_collective_buffer(run):
    d, ranks = run
    out = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(d / "traces"), "--format", "json",
                          "--fail-on", "warning"], capture_output=True, text=True, timeout=120)
    report = json.loads(out.stdout)
    tiw = [f for f in report["findings"] if f["rule"] == "transient-in-window"]
    assert tiw, report
    for f in tiw:
        site = json.dumps(f)
        assert "server.py" in site and "worker" in site
    _, events, ptr = ranks[0]
    einsum_line = next(i for i, l in enumerate(SERVER.splitlines(), 1) if "torch.einsum" in l)
    assert any(f"server.py:{einsum_line}:worker" in json.dumps(f) for f in tiw)
    # the collective's own buffer (`out`, allocated two lines below) is never flagged
    out_line = einsum_line + 1
    assert not any(f"server.py:{out_line}:worker" in json.dumps(f) for f in report["findings"])
    assert out.returncode == 1
