"""SGLang 0.5.23's pynccl all-reduce on a buffer allocated inside its symmetric scope, captured by
both allocation paths (the native recorder and the dispatch mode, HAZSAN_NATIVE=0): the `coll`
names the same trace addresses as the buffer's `alloc` (issue 50, item 8).

The program is SGLang's own communicator code on CPU, only the CUDA/NCCL boundary faked
(tests/support/sglang_cpu.py): `SymmetricMemoryContext` (what
pynccl_allocator.use_symmetric_memory returns when symmetric memory is on, pynccl_allocator.py:425),
then `GroupCoordinator._all_reduce_in_place` -> `PyNcclCommunicator.all_reduce` ->
`NCCLLibrary.ncclAllReduce(buffer_type(tensor.data_ptr()), ...)` (pynccl.py): a raw pointer, which
capture translates (nccl.py -> the block table's `resolve`). On CPU the allocation made inside the
scope is placed in the modelled window (window.py), so the pointer's trace address is that modelled
address, on both paths; before the fix the native recorder's table left it raw, the buffer then
looked like a transient in the window and its collective ran on `cuda:0:s1` instead of `cpu`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gloo_programs import require_native

pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("jsonl_capture")


def _sglang_version():
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


if _sglang_version() != "0.5.23":
    pytest.skip("SGLang 0.5.23 is installed by `make test` (pip install --no-deps sglang==0.5.23)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SUPPORT = ROOT / "tests" / "support"
HANDLE = 0xABC0

PROGRAM = textwrap.dedent(r'''
    import json, os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    import sanitizer

    def worker(rank, ws, init, outdir):
        from sglang_cpu import Boundary, SO
        os.environ["SGLANG_NCCL_SO_PATH"] = SO
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
        Boundary(rank, stream_handle=%(handle)d)
        from sglang.srt.distributed.parallel_state import GroupCoordinator
        from sglang.srt.distributed.device_communicators.pynccl_allocator import SymmetricMemoryContext
        tp = GroupCoordinator([[0, 1]], rank, "gloo", use_pynccl=True, use_mscclpp=False,
                              use_custom_allreduce=False, use_torch_symm_mem_all_reduce=False,
                              use_hpu_communicator=False, use_xpu_communicator=False, group_name="tp")
        sanitizer.step(1)
        with tp.pynccl_comm.change_state(enable=True):
            with SymmetricMemoryContext(tp):
                res = torch.empty(16, 32)
            res.fill_(1.0)
            tp._all_reduce_in_place(res)                         # ncclAllReduce(res.data_ptr(), ...)
            tp._all_reduce_in_place(res[4:8])                    # a slice: 4 rows in
        with open(os.path.join(outdir, f"ptr{rank}.json"), "w") as fh:
            json.dump({"res": res.data_ptr()}, fh)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
''') % {"handle": HANDLE}


@pytest.mark.parametrize("path", ["native", "dispatch"])
def test_pynccl_buffer_allocated_in_the_scope_is_translated_on_both_paths(tmp_path, path):
    if path == "native":
        require_native()
    (tmp_path / "prog.py").write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN") or k == "HAZSAN_NATIVE_CACHE"}
    env.update(HAZSAN="1", HAZSAN_DIR=str(tmp_path / "t"), HAZSAN_NATIVE="1" if path == "native" else "0",
               HAZSAN_RAISE="1", HAZSAN_TRACE_FORMAT="jsonl",
               PYTHONPATH=os.pathsep.join([str(SUPPORT), str(ROOT)]))
    out = subprocess.run([sys.executable, "prog.py", f"file://{tmp_path}/rdv", str(tmp_path)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    for rank in (0, 1):
        lines = [json.loads(x) for x in (tmp_path / "t" / f"rank{rank}.jsonl").read_text().splitlines()]
        header, events = lines[0], lines[1:]
        assert header["hooks"]["alloc"]["source"] == ("native" if path == "native" else "dispatch-mode")
        assert not [e for e in events if e["ev"] == "hook_error"]
        real = json.loads((tmp_path / f"ptr{rank}.json").read_text())["res"]
        # res's alloc: placed in the scope's modelled window (never at its real host address)
        windows = [e for e in events if e["ev"] == "window"]
        allocs = [e for e in events if e["ev"] == "alloc" and e["size"] >= 16 * 32 * 4
                  and any(w["addr"] <= e["addr"] < w["addr"] + w["size"] for w in windows)]
        assert len(allocs) == 1, allocs
        (res,) = allocs
        assert res["addr"] != real and res["pool"] == "symm"
        colls = [e for e in events if e["ev"] == "coll" and e["comm"].startswith("pynccl:")
                 and e["op"] == "ncclAllReduce"]
        whole, part = colls[-2:]
        assert whole["bufs"] == [{"addr": res["addr"], "size": 16 * 32 * 4, "access": "rw"}]
        assert part["bufs"] == [{"addr": res["addr"] + 4 * 32 * 4, "size": 4 * 32 * 4, "access": "rw"}]
        assert whole["stream"] == part["stream"] == "cpu"     # host memory: the host's own order
    report = json.loads(subprocess.run([sys.executable, "-m", "sanitizer", "check", str(tmp_path / "t"),
                                        "--format", "json"], capture_output=True, text=True,
                                       timeout=120).stdout)
    assert report["findings"] == [], report["findings"]
