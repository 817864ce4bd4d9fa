"""Issue 50, items 5, 7 and 11, on SGLang 0.5.23's own code (installed from PyPI, --no-deps), two
ranks on CPU. Faked: only the CUDA/NCCL boundary (tests/support/sglang_cpu.py), FlashInfer's
comm library and torch's CUDA-only symmetric memory (below).

Item 5: local registrations are not symmetric windows. SGLang registers with
NCCL_WIN_COLL_SYMMETRIC (pynccl.py register_comm_window_raw passes win_flags 1; the C++ plugin of
pynccl_allocator.py passes NCCL_WIN_COLL_SYMMETRIC) and reads a NULL handle as no window
(allocate_symmetric_buffer: "NCCL >= 2.29.2 returns NULL when the comm has no symmetric memory
support ...; 2.28.x returns a local-registration handle"). NCCL's src/dev_runtime.cc:
  * v2.29.2-1 ncclCommWindowRegister: `*win = nullptr; ... if (!comm->symmetricSupport) return
    ncclSuccess;`
  * v2.28.9-1 ncclDevrWindowRegisterInGroup: `ncclCommRegister(comm, userPtr, userSize,
    &localRegHandle); if (!comm->symmetricSupport) { *outWinDev = localRegHandle; return ncclSuccess; }`
with `comm->symmetricSupport = comm->isAllCudaP2p && ncclParamWinEnable() && ncclCuMemEnable()`
(src/init.cc), and symmetric kernels only for windows whose winFlags carry NCCL_WIN_COLL_SYMMETRIC
(src/scheduler/symmetric_sched.cc). The 2.28 local communicator here is made under
NCCL_CUMEM_ENABLE=0, what SGLang's engine sets unless --enable-symm-mem (entrypoints/engine.py);
the 2.29 one has no such hint: its NULL handle says it.

Item 11: SymmetricMemoryContext.__exit__ -> _register_segments_for_comm reads the pool's snapshot
only when the allocator's segment counters moved (torch._C._cuda_memoryStats).

Item 7: FlashInfer's fused all-reduce (layers/flashinfer_comm_fusion.py: the workspace
FlashInferWorkspaceManager.initialize makes with flashinfer.comm.create_allreduce_fusion_workspace,
then flashinfer.comm.allreduce_fusion) and custom all-reduce v2's workspace
(custom_all_reduce_v2._allocate_symmetric_memory: torch symmetric memory) are not recorded: once
used they are coverage gaps in the header, and `hazsan check` says so in its verdict.
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
SEG = 0x7F0000000000

PROGRAM = textwrap.dedent(r'''
    import json, os, sys, types
    import torch, torch.distributed as dist, torch.multiprocessing as mp

    SEG = %(seg)d
    CASES = [  # name, NCCL version, symmetric support, NCCL_CUMEM_ENABLE when the comm is made
        ("v228local", 22809, False, "0"),
        ("v228sym", 22809, True, None),
        ("v229local", 22903, False, None),
        ("v229sym", 22903, True, None),
    ]

    def worker(rank, ws, init, outdir):
        from sglang_cpu import Boundary, SO
        os.environ["SGLANG_NCCL_SO_PATH"] = SO
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
        fake = Boundary(rank)
        from sglang.srt.distributed.parallel_state import GroupCoordinator
        from sglang.srt.distributed.device_communicators import pynccl_allocator as pa
        from sglang.srt.distributed.device_communicators.pynccl_wrapper import buffer_type
        from sanitizer.capture import runtime
        from sanitizer.capture.nccl import comm_name_of
        cap = runtime.active()
        out = {"cases": {}}

        def coordinator(name, version, symmetric, cumem):
            fake.nccl.version, fake.nccl.symmetric = version, symmetric
            if cumem is None:
                os.environ.pop("NCCL_CUMEM_ENABLE", None)
            else:
                os.environ["NCCL_CUMEM_ENABLE"] = cumem
            return GroupCoordinator([[0, 1]], rank, "gloo", use_pynccl=True, use_mscclpp=False,
                                    use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
                                    use_hpu_communicator=False, use_xpu_communicator=False,
                                    group_name=name)

        # item 5: ncclMemAlloc + a window per case through allocate_symmetric_buffer, and a pool
        # segment registered by the real scope's exit
        for i, (name, version, symmetric, cumem) in enumerate(CASES):
            tp = coordinator(name, version, symmetric, cumem)
            pc = tp.pynccl_comm
            case = out["cases"][name] = {"comm": comm_name_of(cap, pc)}
            calls = len(fake.nccl.calls)
            try:
                pa.allocate_symmetric_buffer(pc, 8192)
            except RuntimeError as exc:   # CPU: torch.as_tensor over __cuda_array_interface__
                case["as_tensor"] = str(exc)[:40]
            reg = [c for c in fake.nccl.calls[calls:] if c[0] == "ncclCommWindowRegister"]
            case["buffer"], case["flags"] = reg[0][2].value, reg[0][4]
            fake.pool.segments.append({"address": SEG + i * (2 << 20), "total_size": 2 << 20, "blocks": []})
            with pa.SymmetricMemoryContext(tp):
                pass
        os.environ.pop("NCCL_CUMEM_ENABLE", None)
        # item 5: NCCL_WIN_DEFAULT on a communicator with symmetric support
        p = pc.nccl.ncclMemAlloc(4096)
        win = pc.nccl.ncclCommWindowRegister(pc.comm, buffer_type(p), 4096, 0)
        out["default_flags"] = [p, win.value]
        pc.nccl.ncclCommWindowDeregister(pc.comm, win)

        # item 11: scope exits without growth read no snapshot; one after growth does, and a
        # communicator new to the pool gets windows for every segment without a new snapshot
        requests = lambda: len(fake.pool.requests)
        n = requests()
        for _ in range(5):
            with pa.SymmetricMemoryContext(tp):
                pass
        out["exits_without_growth"] = requests() - n
        fake.pool.segments.append({"address": SEG + 10 * (2 << 20), "total_size": 2 << 20, "blocks": []})
        n = requests()
        with pa.SymmetricMemoryContext(tp):
            pass
        out["exit_after_growth"] = requests() - n
        tp2 = coordinator("v229sym2", 22903, True, None)
        out["new_comm"] = comm_name_of(cap, tp2.pynccl_comm)
        n = requests()
        with pa.SymmetricMemoryContext(tp2):
            pass
        out["new_comm_snapshots"] = requests() - n
        out["segments"] = [s["address"] for s in fake.pool.segments]

        # item 7: FlashInfer's workspace. Without flashinfer (a CPU install) no workspace is made;
        # with its comm library present (faked: the CUDA IPC workspace) one is
        from sglang.srt.runtime_context import get_parallel
        from sglang.srt.layers import flashinfer_comm_fusion as fi
        solo = GroupCoordinator([[0], [1]], rank, "gloo", use_pynccl=False, use_mscclpp=False,
                                use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
                                use_hpu_communicator=False, use_xpu_communicator=False, group_name="solo")

        class Workspace:                   # what create_allreduce_fusion_workspace returns
            backend, metadata = "trtllm", {"use_fp32_lamport": False}
            def is_buffer_size_sufficient(self, token_num, hidden_dim, dtype, use_oneshot=None):
                return True
        manager = fi.FlashInferWorkspaceManager()
        with get_parallel().override(tp_group=solo):   # one rank: the preflight vote needs no CUDA probe
            manager.initialize(world_size=2, rank=rank, max_token_num=16, hidden_dim=64, backend="trtllm")
            out["gaps_without_flashinfer"] = list(cap.coverage.static)
            fi._flashinfer_comm = types.SimpleNamespace()
            fi._create_allreduce_fusion_workspace = lambda **kw: Workspace()
            manager.initialize(world_size=2, rank=rank, max_token_num=16, hidden_dim=64, backend="trtllm")
        out["flashinfer_workspace"] = manager.workspace is not None
        out["gaps_with_flashinfer"] = list(cap.coverage.static)

        # item 7: custom all-reduce v2's workspace, in torch symmetric memory (CUDA only: faked)
        import torch._C._distributed_c10d as c10d

        class SymmetricMemory:
            @staticmethod
            def empty_strided_p2p(size, stride, dtype, device, group_name):
                return torch.empty(size, dtype=dtype)
            @staticmethod
            def rendezvous(tensor):
                return types.SimpleNamespace(multicast_ptr=0)
        c10d._SymmetricMemory = SymmetricMemory
        from sglang.srt.distributed.device_communicators import custom_all_reduce_v2 as v2
        v2._allocate_symmetric_memory(4096, torch.device("cpu"), tp.device_group)
        out["gaps_with_v2"] = list(cap.coverage.static)

        with open(os.path.join(outdir, f"out{rank}.json"), "w") as fh:
            json.dump(out, fh)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
''') % {"seg": SEG}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("symmwin")
    (d / "prog.py").write_text(PROGRAM)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(d / "traces"),
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    env.pop("NCCL_CUMEM_ENABLE", None)
    env.pop("NCCL_WIN_ENABLE", None)
    p = subprocess.run([sys.executable, "prog.py", f"file://{d}/rdv", str(d)], cwd=d, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    ranks = {}
    for r in (0, 1):
        lines = [json.loads(line) for line in (d / "traces" / f"rank{r}.jsonl").read_bytes().splitlines()]
        ranks[r] = (lines[0], lines[1:], json.loads((d / f"out{r}.json").read_text()))
    return d, ranks


def _windows(events, comm):
    return {e["addr"] for e in events if e["ev"] == "window" and e["comm"] == comm}


def test_the_stand_in_returns_what_each_nccl_version_returns(run):
    """2.28 without symmetric support: a non-NULL (local) handle; 2.29: NULL (FakeNccl)."""
    _, ranks = run
    for header, events, out in ranks.values():
        assert not header["hooks"]["failed"] and not [e for e in events if e["ev"] == "hook_error"]
        for case in out["cases"].values():
            assert case["flags"] == 1                    # NCCL_WIN_COLL_SYMMETRIC, as SGLang passes it
            assert case["as_tensor"]                     # the CPU stops SGLang after the registration
    assert ranks[0][2]["default_flags"][1]               # NCCL_WIN_DEFAULT: a handle all the same


@pytest.mark.parametrize("case", ["v228local", "v229local"])
def test_a_local_registration_is_no_window(run, case):
    _, ranks = run
    for _, events, out in ranks.values():
        c = out["cases"][case]
        assert [e for e in events if e["ev"] == "segment" and e["addr"] == c["buffer"]]   # the memory is
        assert _windows(events, c["comm"]) == set()      # neither its buffer nor the pool's segments


@pytest.mark.parametrize("case", ["v228sym", "v229sym"])
def test_a_symmetric_registration_is_a_window(run, case):
    _, ranks = run
    for _, events, out in ranks.values():
        c = out["cases"][case]
        i = list(out["cases"]).index(case)
        pool = {SEG + k * (2 << 20) for k in range(i + 1)}   # the plugin registers every segment so far
        if case == "v229sym":
            pool.add(SEG + 10 * (2 << 20))                   # and the one item 11 adds
        assert _windows(events, c["comm"]) == {c["buffer"]} | pool
        assert [e for e in events if e["ev"] == "window_free" and e["addr"] == c["buffer"]]


def test_default_flags_registration_is_no_window(run):
    _, ranks = run
    for _, events, out in ranks.values():
        p = out["default_flags"][0]
        assert not [e for e in events if e["ev"] in ("window", "window_free") and e["addr"] == p]


def test_scope_exits_snapshot_the_pool_only_when_it_grew(run):
    _, ranks = run
    for _, events, out in ranks.values():
        assert out["exits_without_growth"] == 0
        assert out["exit_after_growth"] == 1
        assert out["new_comm_snapshots"] == 0
        assert _windows(events, out["new_comm"]) == set(out["segments"])   # from what was read before


def test_unrecorded_collectives_are_coverage_gaps_once_used(run):
    _, ranks = run
    for header, _, out in ranks.values():
        assert out["gaps_without_flashinfer"] == []
        assert out["flashinfer_workspace"]
        [fi] = out["gaps_with_flashinfer"]
        assert "FlashInfer fused all-reduce" in fi and "backend trtllm" in fi
        [_, v2] = out["gaps_with_v2"]
        assert "custom all-reduce v2" in v2
        assert header["coverage"]["unseen"] == [fi, v2]


def test_check_says_what_it_did_not_check(run):
    d, _ = run
    p = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(d / "traces")],
                       capture_output=True, text=True, timeout=120)
    assert "hazsan: no hazards found" in p.stdout, p.stdout[-3000:]     # what was recorded is clean,
    assert "hazsan: NOT CHECKED: 2 collective path(s) capture could not record" in p.stdout   # not all
    assert p.stdout.count("coverage: FlashInfer fused all-reduce") == 2          # one per rank
    j = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(d / "traces"), "--format", "json"],
                       capture_output=True, text=True, timeout=120)
    gaps = json.loads(j.stdout)["summary"]["coverage_gaps"]
    assert len(gaps) == 2 and "custom all-reduce v2" in gaps[1]
