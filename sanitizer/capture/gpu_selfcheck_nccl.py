"""GPU self-check of NCCL capture: real collectives in a symmetric window, then what was recorded.

    python -m sanitizer.capture.gpu_selfcheck_nccl [--dir DIR]

Needs one CUDA GPU (one rank: NCCL runs a one-rank communicator for real). Runs a child interpreter
with HAZSAN=1 (capture starts from the installed .pth line, as in a server) that
  1. through SGLang's NCCLLibrary (or vLLM's) on torch's libnccl: ncclCommInitRank, ncclMemAlloc,
     ncclCommWindowRegister, an ncclAllReduce on the window and one on a torch tensor slice, on the
     current CUDA stream; then deregisters and frees;
  2. through torch.distributed's NCCL backend (one rank): a blocking all_reduce and an async one
     followed by Work.wait() (recorded as stream waits, not as host completion);
then prints the trace header (hooks, versions, GPU name, SM capability, driver), every event
other than allocations, and `hazsan check`'s summary. Exit 0 when the expected events are there,
1 when some are missing, 2 when there is no GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent(r'''
    import os, sys, json
    import torch
    import torch.distributed as dist
    report = {"library": None}
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    lib_mod = None
    for name in ("sglang.srt.distributed.device_communicators.pynccl_wrapper",
                 "vllm.distributed.device_communicators.pynccl_wrapper"):
        try:
            lib_mod = __import__(name, fromlist=["NCCLLibrary"])
            break
        except Exception as exc:
            report.setdefault("import_errors", {})[name] = f"{type(exc).__name__}: {exc}"
    if lib_mod is not None:
        report["library"] = lib_mod.__name__
        lib = lib_mod.NCCLLibrary()
        uid = lib.ncclGetUniqueId()
        comm = lib.ncclCommInitRank(1, uid, 0)
        stream = torch.cuda.current_stream()
        size = 2 << 20
        ptr = lib.ncclMemAlloc(size)
        win = None
        if hasattr(lib, "ncclCommWindowRegister") and "ncclCommWindowRegister" in lib._funcs:
            win = lib.ncclCommWindowRegister(comm, lib_mod.buffer_type(ptr), size, 1)
        report["window"] = win is not None
        lib.ncclAllReduce(lib_mod.buffer_type(ptr), lib_mod.buffer_type(ptr), 4096,
                          lib_mod.ncclDataTypeEnum.ncclFloat32, 0, comm, lib_mod.cudaStream_t(stream.cuda_stream))
        x = torch.ones(8192, device=dev)
        part = x[1024:3072]
        lib.ncclAllReduce(lib_mod.buffer_type(part.data_ptr()), lib_mod.buffer_type(part.data_ptr()), part.numel(),
                          lib_mod.ncclDataTypeEnum.ncclFloat32, 0, comm, lib_mod.cudaStream_t(stream.cuda_stream))
        torch.cuda.synchronize()
        report["x_ptr"], report["raw_ptr"] = x.data_ptr(), ptr
        if win is not None:
            lib.ncclCommWindowDeregister(comm, win)
        lib.ncclMemFree(ptr)
    store = dist.FileStore(os.path.join(sys.argv[1], "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
    y = torch.ones(1024, device=dev)
    dist.all_reduce(y)
    w = dist.all_reduce(y, async_op=True)
    w.wait()
    torch.cuda.synchronize()
    dist.destroy_process_group()
    with open(os.path.join(sys.argv[1], "report.json"), "w") as f:
        json.dump(report, f)
''')


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sanitizer.capture.gpu_selfcheck_nccl", description=__doc__.split("\n")[0])
    ap.add_argument("--dir", help="where the trace goes (default: a new temporary folder)")
    args = ap.parse_args(argv)
    try:
        import torch
        if not torch.cuda.is_available():
            print("gpu_selfcheck_nccl: no CUDA GPU visible; nothing checked", file=sys.stderr)
            return 2
    except ImportError:
        print("gpu_selfcheck_nccl: torch is not installed", file=sys.stderr)
        return 2
    work = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="hazsan-nccl-"))
    os.makedirs(work, exist_ok=True)
    traces = os.path.join(work, "traces")
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=traces, RANK="0", WORLD_SIZE="1",
               NCCL_CUMEM_ENABLE="1")
    child = subprocess.run([sys.executable, "-c", CHILD, work], env=env, text=True, capture_output=True,
                           timeout=300)
    if child.returncode != 0:
        print(child.stdout[-4000:], child.stderr[-4000:], sep="\n", file=sys.stderr)
        print(f"gpu_selfcheck_nccl: the child failed (exit {child.returncode})", file=sys.stderr)
        return 1
    with open(os.path.join(work, "report.json")) as f:
        report = json.load(f)
    from sanitizer.trace.reader import expand_paths, open_trace

    tf = open_trace(next(p for p in expand_paths([traces]) if p.name.startswith("rank0.")))
    header, events = tf.header, [ev for _, ev in tf.events() if isinstance(ev, dict)]
    print("header:", json.dumps(header, indent=1))
    print("library:", report.get("library"), report.get("import_errors", ""))
    for e in events:
        if e["ev"] not in ("alloc", "free"):
            print(json.dumps({k: v for k, v in e.items() if k not in ("t", "stack")}))
    missing = []
    colls = [e for e in events if e["ev"] == "coll"]
    if report.get("library"):
        pyn = [c for c in colls if c["op"].startswith("ncclAllReduce")]
        if len(pyn) != 2 or not all(c["stream"].startswith("cuda:") for c in pyn):
            missing.append("two pynccl all-reduces on a cuda stream")
        elif pyn[1]["bufs"][0]["size"] != 2048 * 4:
            missing.append("the slice's exact byte range")
        if not [e for e in events if e["ev"] == "segment" and e["addr"] == report["raw_ptr"]]:
            missing.append("segment of ncclMemAlloc")
        if report.get("window") and not [e for e in events if e["ev"] == "window" and e["addr"] == report["raw_ptr"]]:
            missing.append("window of ncclCommWindowRegister")
    else:
        missing.append("SGLang or vLLM (NCCLLibrary) importable")
    torch_colls = [c for c in colls if c["op"] == "all_reduce"]
    waits = [e for e in events if e["ev"] == "wait"]
    if len(torch_colls) != 2 or len(waits) < 2:
        missing.append("torch NCCL all_reduce x2 with stream waits")
    if not (header.get("gpu") or {}).get("capability"):
        missing.append("GPU facts in the header")
    check = subprocess.run([sys.executable, "-m", "sanitizer", "check", traces], text=True, capture_output=True)
    print(check.stdout[-3000:])
    print(f"trace: {path}")
    if missing:
        print("gpu_selfcheck_nccl: MISSING: " + "; ".join(missing))
        return 1
    print("gpu_selfcheck_nccl: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
