"""The same NCCLLibrary hook on vLLM's own wrapper: vLLM's NCCLLibrary and PyNcclCommunicator
(installed with --no-deps; their import needs only `regex` besides torch), two gloo ranks on CPU,
with only libnccl's function table and the current stream faked (tests/support/sglang_cpu.py's FakeNccl).

vLLM is opt-in for `make test` (its wheel is 239 MB, 473 MB installed, almost all compiled CUDA
kernels): `make test VLLM_PIN=vllm==0.34.0`. Without it this file is skipped.
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
try:
    from importlib.metadata import version
    VLLM = version("vllm")
except Exception:
    VLLM = None
if VLLM is None:
    pytest.skip("vLLM not installed (make test VLLM_PIN=vllm==0.34.0)", allow_module_level=True)

TESTS = Path(__file__).parents[1] / "support"   # the stand-in modules these runs import

SERVER = textwrap.dedent(r'''
    import json, os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp

    def worker(rank, ws, init, outdir):
        from sglang_cpu import FakeNccl, FakeStream, SO
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
        from vllm.distributed.device_communicators import pynccl, pynccl_wrapper
        lib = pynccl_wrapper.NCCLLibrary
        lib.path_to_library_cache[SO] = object()
        lib.path_to_dict_mapping[SO] = FakeNccl(rank).table()
        stream = FakeStream(0xBEE0)
        pynccl.current_stream = lambda: stream
        pc = pynccl.PyNcclCommunicator(dist.group.WORLD, device="cpu", library_path=SO)
        x = torch.ones(32)
        y = pc.all_reduce(x)                                 # out of place: a new output tensor
        part, whole = torch.full((4,), float(rank)), torch.empty(8)
        pc.all_gather(whole, part)
        pc.group_start()
        pc.send(torch.ones(3), (rank + 1) % 2)
        pc.recv(torch.empty(3), (rank + 1) % 2)
        pc.group_end()
        with open(os.path.join(outdir, f"ptr{rank}.json"), "w") as fh:
            json.dump({"x": x.data_ptr(), "y": y.data_ptr(), "part": part.data_ptr(), "whole": whole.data_ptr()}, fh)
        dist.barrier()
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
''')


def test_vllm_nccllibrary_collectives_recorded(tmp_path):
    (tmp_path / "server.py").write_text(SERVER)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(tmp_path / "traces"),
               PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "server.py", f"file://{tmp_path}/rdv", str(tmp_path)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-4000:]
    seen = {}
    for r in (0, 1):
        with open(tmp_path / "traces" / f"rank{r}.jsonl", "rb") as f:
            lines = [json.loads(line) for line in f]
        header, events = lines[0], lines[1:]
        ptr = json.loads((tmp_path / f"ptr{r}.json").read_text())
        assert {"vllm.NCCLLibrary", "vllm.PyNcclCommunicator"} <= set(header["hooks"]["installed"])
        assert header["hooks"]["failed"] == {} and header["versions"]["vllm"] == VLLM
        colls = [e for e in events if e["ev"] == "coll" and e["comm"].startswith("pynccl:")]
        seen[r] = [(c["comm"], c["seq"], c["op"]) for c in colls]
        warm, ar, ag, group = colls
        assert warm["op"] == ar["op"] == "ncclAllReduce" and ag["op"] == "ncclAllGather"
        assert group["op"] == "group:ncclSend+ncclRecv"
        assert [b["addr"] for b in ar["bufs"]] == [ptr["x"], ptr["y"]]       # CPU blocks: real addresses
        assert [(b["size"], b["access"]) for b in ar["bufs"]] == [(128, "r"), (128, "w")]
        assert [(b["addr"], b["size"]) for b in ag["bufs"]] == [(ptr["part"], 16), (ptr["whole"], 32)]
        assert group["comm"].endswith(":p2p:0-1") and group["seq"] == 0   # one peer: the pair's comm
        assert all("site-packages/vllm/distributed/device_communicators/pynccl.py" in c["site"] for c in colls)
    assert seen[0] == seen[1]
