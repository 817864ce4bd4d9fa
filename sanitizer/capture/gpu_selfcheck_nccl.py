"""GPU self-check of NCCL capture: real collectives in a symmetric window, then what was recorded.

    python -m sanitizer.capture.gpu_selfcheck_nccl [--dir DIR]

Needs one CUDA GPU (one rank: NCCL runs a one-rank communicator for real). Runs a child interpreter
with HAZSAN=1 (capture activated by the child itself, as the .pth line does in a server, so that a
plain checkout works too: gpu_selfcheck.ACTIVATE and child_env) that
  1. through SGLang's NCCLLibrary (or vLLM's) on torch's libnccl: ncclCommInitRank, ncclMemAlloc,
     ncclCommWindowRegister, an ncclAllReduce on the window and one on a torch tensor slice, on the
     current CUDA stream; then deregisters and frees. NCCL >= 2.29 returns a NULL window where the
     communicator has no symmetric support (src/dev_runtime.cc): then no `window` may be recorded;
  2. through torch.distributed's NCCL backend (one rank): a blocking all_reduce and an async one
     followed by Work.wait() (recorded as stream waits, not as host completion). Capture records
     them as `c10d.allreduce_`; where the op carries `async_op` (PyTorch >= 2.8) the blocking one
     runs on the current stream (ProcessGroupNCCL::collective);
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

from sanitizer.capture.gpu_selfcheck import ACTIVATE, child_env

CHILD = ACTIVATE + textwrap.dedent(r'''
    import os, sys, json
    import torch
    import torch.distributed as dist
    report = {"library": None}
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    from sanitizer.capture.gpu_selfcheck_nccl import import_wrapper
    lib_mod = None
    for name in ("sglang.srt.distributed.device_communicators.pynccl_wrapper",
                 "vllm.distributed.device_communicators.pynccl_wrapper"):
        try:
            lib_mod, report["import_path"] = import_wrapper(name)
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
        # SGLang's wrapper returns the ncclWindow_t object; NULL (.value None) = no symmetric support
        report["window"] = win is not None and bool(getattr(win, "value", win))
        lib.ncclAllReduce(lib_mod.buffer_type(ptr), lib_mod.buffer_type(ptr), 4096,
                          lib_mod.ncclDataTypeEnum.ncclFloat32, 0, comm, lib_mod.cudaStream_t(stream.cuda_stream))
        x = torch.ones(8192, device=dev)
        part = x[1024:3072]
        lib.ncclAllReduce(lib_mod.buffer_type(part.data_ptr()), lib_mod.buffer_type(part.data_ptr()), part.numel(),
                          lib_mod.ncclDataTypeEnum.ncclFloat32, 0, comm, lib_mod.cudaStream_t(stream.cuda_stream))
        torch.cuda.synchronize()
        report["x_ptr"], report["raw_ptr"] = x.data_ptr(), ptr
        if report["window"]:
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


def import_wrapper(name: str):
    """The real `pynccl_wrapper` module `name` of an installed SGLang (or vLLM), and how it was
    imported. Its own imports are the standard library and torch, but its packages' __init__
    files import the whole server (SGLang 0.5.23: IPython, pydantic, starlette, pyzmq, ...), which a
    GPU image may lack. When the plain import fails, the parent packages are made empty packages
    over their installed folders (their __init__ files not run) and the import is tried again:
    the file itself is SGLang's, imported by the import system, so capture's post-import hook
    patches it as in a server."""
    import importlib
    import importlib.util
    import types
    try:
        return importlib.import_module(name), "package"
    except ImportError as first:
        top = name.split(".")[0]
        spec = importlib.util.find_spec(top) if top not in sys.modules else None
        if spec is None or not spec.submodule_search_locations:
            raise
        root = list(spec.submodule_search_locations)[0]
        parts = name.split(".")
        for i in range(1, len(parts)):
            pkg = ".".join(parts[:i])
            if pkg not in sys.modules:
                m = types.ModuleType(pkg)
                m.__path__ = [os.path.join(root, *parts[1:i])]
                sys.modules[pkg] = m
        try:
            return importlib.import_module(name), f"file alone ({type(first).__name__}: {first})"
        except ImportError:
            raise first from None


def run(work: str) -> dict:
    """Run the child, judge its trace. {"status": pass|fail|skip, "reason", "figures", "traces"}."""
    try:
        import torch
    except ImportError:
        return {"status": "skip", "reason": "torch is not installed", "figures": {}}
    if not torch.cuda.is_available():
        return {"status": "skip", "reason": "no CUDA GPU visible", "figures": {}}
    work = os.path.abspath(work)
    os.makedirs(work, exist_ok=True)
    traces = os.path.join(work, "traces")
    env = child_env("alloc", traces, RANK="0", WORLD_SIZE="1", NCCL_CUMEM_ENABLE="1")
    child = subprocess.run([sys.executable, "-c", CHILD, work], env=env, text=True, capture_output=True,
                           timeout=300)
    if child.returncode != 0:
        return {"status": "fail", "traces": traces, "figures": {},
                "reason": f"the child failed (exit {child.returncode}): {child.stderr[-3000:]}"}
    with open(os.path.join(work, "report.json")) as f:
        report = json.load(f)
    from sanitizer.trace.reader import expand_paths, open_trace

    rank0 = [p for p in expand_paths([traces]) if p.name.startswith("rank0.")]
    if not rank0:
        return {"status": "fail", "traces": traces, "figures": {},
                "reason": "no rank0 trace: capture did not start in the child (" + child.stderr[-1500:] + ")"}
    tf = open_trace(rank0[0])
    header, events = tf.header, [ev for _, ev in tf.events() if isinstance(ev, dict)]
    missing = judge(report, header, events)
    check = subprocess.run([sys.executable, "-m", "sanitizer", "check", traces, "--format", "json"],
                           text=True, capture_output=True, env=child_env(None, ""))
    try:
        rules = sorted({f["rule"] for f in json.loads(check.stdout).get("findings", [])})
    except ValueError:
        rules = None
        missing.append("hazsan check failed: " + (check.stdout + check.stderr)[-1000:])
    figures = {"library": report.get("library"), "import": report.get("import_path"),
               "window_handle": report.get("window"),
               "events": len(events), "rules": rules,
               "windows": sum(1 for e in events if e["ev"] == "window"),
               "versions": header.get("versions"), "gpu": header.get("gpu")}
    return {"status": "fail" if missing else "pass", "reason": "; ".join(missing), "figures": figures,
            "traces": traces, "report": report, "header": header, "events": events}


def judge(report: dict, header: dict, events: list) -> list[str]:
    """What is missing from the trace (empty: everything expected is there)."""
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
        windows = [e for e in events if e["ev"] == "window" and e["addr"] == report["raw_ptr"]]
        if report.get("window") and not windows:
            missing.append("window of ncclCommWindowRegister")
        if not report.get("window") and windows:
            missing.append("no window for a NULL ncclWindow_t (the communicator has no symmetric support)")
    else:
        missing.append("SGLang or vLLM (NCCLLibrary) importable: " + json.dumps(report.get("import_errors")))
    # capture names the dispatcher's op (collectives.py), c10d::allreduce_
    torch_colls = [c for c in colls if c["op"] == "c10d.allreduce_"]
    if len(torch_colls) != 2:
        missing.append(f"torch NCCL c10d.allreduce_ x2 (got {len(torch_colls)})")
    else:
        waited = torch_colls[1]
        event = f"coll{waited['cid']}"
        if not waited["stream"].startswith("nccl:"):
            missing.append("the async all_reduce on the process group's NCCL stream")
        elif not [e for e in events if e["ev"] == "wait" and e["event"] == event]:
            missing.append("Work.wait() recorded as a stream wait")
    if not (header.get("gpu") or {}).get("capability"):
        missing.append("GPU facts in the header")
    if any(e["ev"] == "hook_error" for e in events):
        missing.append("hook errors: " + json.dumps([e for e in events if e["ev"] == "hook_error"])[:1000])
    return missing


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sanitizer.capture.gpu_selfcheck_nccl", description=__doc__.split("\n")[0])
    ap.add_argument("--dir", help="where the trace goes (default: a new temporary folder)")
    args = ap.parse_args(argv)
    work = os.path.abspath(args.dir or tempfile.mkdtemp(prefix="hazsan-nccl-"))
    result = run(work)
    if result["status"] == "skip":
        print(f"gpu_selfcheck_nccl: {result['reason']}; nothing checked", file=sys.stderr)
        return 2
    if "header" in result:
        print("header:", json.dumps(result["header"], indent=1))
        print("library:", result["report"].get("library"), result["report"].get("import_errors", ""))
        for e in result["events"]:
            if e["ev"] not in ("alloc", "free"):
                print(json.dumps({k: v for k, v in e.items() if k not in ("t", "stack")}))
    print(f"trace: {result.get('traces')}")
    if result["status"] != "pass":
        print("gpu_selfcheck_nccl: MISSING: " + result["reason"])
        return 1
    print("gpu_selfcheck_nccl: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
