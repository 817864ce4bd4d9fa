#!/usr/bin/env python3
"""Issue 30's second design question, measured: can capture see every collective that goes
through torch's dispatcher without a Python dispatch mode, and what does that cost the other ops?

A dispatch mode is called for every op, which is what puts the `alloc` level's floor at the no-op
mode's 2.5x bare per tiny op (native_alloc_probe.py). A native allocation source removes the need
for it for allocations; collectives are the other thing the mode is there for. Three ways to see
the ops of the `c10d` and `_c10d_functional` namespaces without it, each tried:

- `autograd`: one Python kernel per overload at the `AutogradCPU` dispatch key (torch.library,
  `Library(ns, "IMPL")`), redispatching below autograd (`torch._C._AutoDispatchBelowAutograd`);
- `opcall`: each overload's OpOverload object made to log before calling its op;
- `backendselect`: one Python kernel per overload at `BackendSelect` (`with_keyset=True`),
  redispatching to the keys after it (`OpOverload.redispatch`), the outermost call logged.

Two gloo ranks (fork) run a program of collectives (blocking, async and waited, all-gather,
reduce-scatter, all-to-all, broadcast, send/recv, barrier, a functional all-reduce and its
wait_tensor, a coalesced batch_isend_irecv, a DTensor Shard -> Replicate redistribute) under
HAZSAN=1 (capture's dispatch mode on, level alloc) and again without capture, each interception
normally and under `torch.inference_mode()` (how servers decode). Each rank checks its numbers
and compares what each interception saw with the collectives capture's mode recorded in its
trace: missed ones, and whether the same ops come in the same order. Then, capture off, a loop of
tiny ops (a 16-element add, as op_instructions.py) is timed without kernels and with each kind of
kernel registered (Library destroyed between rounds), alternating: their cost to the ops that are
not collectives.

    .venv/bin/python benchmarks/mode_free_collectives_probe.py [--ops 20000] [--rounds 5]

Prints a JSON line per rank, interception and mode; exit 1 when a program's result is wrong.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

NAMESPACES = ("c10d", "_c10d_functional")


def overloads():
    """(label `<ns>.<op>`, qualified name for Library.impl, OpOverload) of every overload of the
    collective namespaces' ops."""
    import torch
    for ns in NAMESPACES:
        packet_ns = getattr(torch.ops, ns)
        for full in torch._C._dispatch_get_all_op_names():
            if not full.startswith(ns + "::"):
                continue
            name = full.split("::", 1)[1]
            packet = getattr(packet_ns, name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                yield f"{ns}.{name}", (name if overload == "default" else f"{name}.{overload}"), \
                    getattr(packet, overload)


def register(log, how: str = "autograd"):
    """Make every collective overload log its calls (`log.append(label)`), one of three ways:

    - `autograd`: a kernel at AutogradCPU that redispatches below autograd;
    - `opcall`: each OpOverload object made to log before it calls its op (what every Python
      caller of `torch.ops.<ns>.<op>.<overload>` goes through; C++ callers do not);
    - `backendselect`: a kernel at BackendSelect that redispatches to the keys after it, the
      outermost call logged (a functional collective runs its c10d op inside it). BackendSelect
      is in every call's key set (torch's default TLS-included keys; inference mode does not
      exclude it) and sits below the Python mode key, just above the backends: such a kernel runs
      for every dispatched call of the op, from Python or C++, inside a subclass's
      `__torch_dispatch__` too.

    Returns (undo, covered): undo() unregisters (destroys the Library objects, or restores the
    overloads); covered names each overload, "FAILED ..." where it could not be registered."""
    import threading

    import torch
    if how == "opcall":
        return _patch_opcalls(log)
    if how == "autograd":
        def make(label, op):
            def kernel(*args, **kwargs):
                log.append(label)
                with torch._C._AutoDispatchBelowAutograd():
                    return op(*args, **kwargs)
            return kernel, "AutogradCPU", False
    else:
        after = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
        depth = threading.local()

        def make(label, op):
            def kernel(keyset, *args, **kwargs):
                depth.n = getattr(depth, "n", 0) + 1
                try:
                    if depth.n == 1:
                        log.append(label)
                    return op.redispatch(keyset & after, *args, **kwargs)
                finally:
                    depth.n -= 1
            return kernel, "BackendSelect", True
    libs = {ns: torch.library.Library(ns, "IMPL") for ns in NAMESPACES}
    covered = []
    for label, qualified, op in overloads():
        kernel, key, with_keyset = make(label, op)
        try:
            libs[label.split(".", 1)[0]].impl(qualified, kernel, key, with_keyset=with_keyset)
            covered.append(label)
        except Exception as exc:   # noqa: BLE001 - reported, not fatal
            covered.append(f"FAILED {label} ({qualified}): {exc}")

    def undo():
        for lib in libs.values():
            lib._destroy()
    return undo, covered


def _patch_opcalls(log):
    saved, covered = [], []
    for label, qualified, op in overloads():
        original = op._op

        def call(*args, __original=original, __label=label, **kwargs):
            log.append(__label)
            return __original(*args, **kwargs)

        op._op = call
        saved.append((op, original))
        covered.append(label)

    def undo():
        for op, original in saved:
            op._op = original
    return undo, covered


def program(rank: int) -> None:
    """The collectives, each result checked."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    world = dist.get_world_size()
    x = torch.full((8,), float(rank + 1))
    dist.all_reduce(x)
    assert torch.equal(x, torch.full((8,), 3.0))
    y = torch.ones(8)
    dist.all_reduce(y, async_op=True).wait()
    assert torch.equal(y, torch.full((8,), 2.0))
    g = torch.empty(8 * world)
    dist.all_gather_into_tensor(g, torch.full((8,), float(rank)))
    assert torch.equal(g, torch.cat([torch.zeros(8), torch.ones(8)]))
    rs = torch.empty(4)
    dist.reduce_scatter_tensor(rs, torch.arange(8, dtype=torch.float32))
    assert torch.equal(rs, 2 * torch.arange(8, dtype=torch.float32)[rank * 4:(rank + 1) * 4])
    a2a = torch.empty(4)
    dist.all_to_all_single(a2a, torch.full((4,), float(rank)))
    assert torch.equal(a2a, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    b = torch.full((4,), float(rank))
    dist.broadcast(b, 1)
    assert torch.equal(b, torch.ones(4))
    p = torch.full((4,), float(rank))
    if rank == 0:
        dist.send(p, 1)
    else:
        dist.recv(p, 0)
        assert torch.equal(p, torch.zeros(4))
    ops = [dist.P2POp(dist.isend, torch.full((2,), float(rank)), 1 - rank),
           dist.P2POp(dist.irecv, q := torch.empty(2), 1 - rank)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(q, torch.full((2,), float(1 - rank)))
    f = fc.all_reduce(torch.ones(4), "sum", dist.group.WORLD)
    assert torch.equal(f + 0, torch.full((4,), 2.0))      # the wait_tensor runs here
    # DTensor: the all-gather of a Shard -> Replicate redistribute is issued inside its dispatch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8, dtype=torch.float32)
    d = distribute_tensor(full, mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    assert torch.equal(d.to_local(), full)
    dist.barrier()


def tiny_ops(n: int) -> float:
    import torch
    a = torch.ones(16)
    t0 = time.process_time()
    for _ in range(n):
        a + 1.0
    return (time.process_time() - t0) / n * 1e6


def trace_collectives(folder: str, rank: int) -> list[list[str]]:
    """The `coll` events of rank's trace, as `<namespace>.<op>` in trace order, one list per run
    (the worker writes a `step` marker before each run and after the last)."""
    from sanitizer.trace.reader import open_trace
    path = next(os.path.join(folder, f) for f in os.listdir(folder) if f.startswith(f"rank{rank}."))
    runs: list[list[str]] = []
    for _, ev in open_trace(path).events():   # (line, event dict)
        if not isinstance(ev, dict):
            continue
        if ev.get("ev") == "step":
            runs.append([])
        elif ev.get("ev") == "coll" and runs:
            runs[-1].append(str(ev.get("op")))
    return runs


def worker(rank: int, port: int, args, out: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    from sanitizer.capture import runtime
    cap = runtime.active()
    result = {"rank": rank, "runs": []}
    for how in ("autograd", "opcall", "backendselect"):
        for inference in (False, True):
            log: list = []
            if cap is not None:
                cap.writer.emit({"ev": "step", "n": len(result["runs"])})   # a marker between runs
            undo, covered = register(log, how)
            run = {"interception": how, "inference_mode": inference, "covered": len(covered),
                   "failed_to_register": [c for c in covered if c.startswith("FAILED")]}
            try:
                if inference:
                    with torch.inference_mode():
                        program(rank)
                else:
                    program(rank)
                run["program"] = "ok"
            except Exception as exc:   # noqa: BLE001 - reported in the verdict
                run["program"] = f"{type(exc).__name__}: {exc}"
            undo()
            run["seen"] = list(log)
            result["runs"].append(run)
    if cap is not None:
        cap.writer.emit({"ev": "step", "n": len(result["runs"])})
        cap.writer.flush()
    dist.destroy_process_group()
    if cap is None:   # capture off: the cost to ordinary ops, alternating without / with kernels
        without, with_, with_bs = [], [], []
        tiny_ops(2000)
        for _ in range(args.rounds):
            without.append(tiny_ops(args.ops))
            undo, _ = register([], "autograd")
            with_.append(tiny_ops(args.ops))
            undo()
            undo, _ = register([], "backendselect")
            with_bs.append(tiny_ops(args.ops))
            undo()
        result["tiny_op_us"] = {"without": min(without), "with_kernels": min(with_),
                                "with_backend_select_kernels": min(with_bs)}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(result, fh)


def launch(args, out: str, env: dict) -> None:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, args, out), nprocs=2, start_method="fork")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        launch(args, args.child, dict(os.environ))
        return 0
    ok = True
    with tempfile.TemporaryDirectory(prefix="hazsan-modefree-") as work:
        runs = {}
        for label, extra in (("captured", {"HAZSAN": "1", "HAZSAN_LEVEL": "alloc"}), ("bare", {})):
            out = os.path.join(work, label)
            os.makedirs(out)
            env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
            env.update(extra, HAZSAN_DIR=os.path.join(out, "traces"), PYTHONWARNINGS="ignore")
            subprocess.run([sys.executable, __file__, "--child", out, "--ops", str(args.ops),
                            "--rounds", str(args.rounds)], env=env, check=True, timeout=600)
            runs[label] = {r: json.load(open(os.path.join(out, f"rank{r}.json"))) for r in (0, 1)}
        from collections import Counter
        for r in (0, 1):
            recorded = trace_collectives(os.path.join(work, "captured", "traces"), r)
            for i, run in enumerate(runs["captured"][r]["runs"]):
                mode = recorded[i] if i < len(recorded) else []
                missed = Counter(mode) - Counter(run["seen"])
                extra = Counter(run["seen"]) - Counter(mode)   # ops that are not collectives (wait_tensor), or issued twice
                ok &= run["program"] == "ok" and not run["failed_to_register"]
                print(json.dumps({"rank": r, "interception": run["interception"],
                                  "inference_mode": run["inference_mode"], "program": run["program"],
                                  "ops_covered": run["covered"], "recorded_by_capture": len(mode),
                                  "seen": len(run["seen"]), "missed": dict(missed), "more": dict(extra),
                                  "same_sequence": [n for n in run["seen"] if n in mode] == mode}))
            # without capture's mode (whose handlers call each op through its OpOverload, which an
            # `opcall` patch would see either way): what each interception sees of the captured run's list
            for i, run in enumerate(runs["bare"][r]["runs"]):
                mode = recorded[i] if i < len(recorded) else []
                missed = Counter(mode) - Counter(run["seen"])
                ok &= run["program"] == "ok"
                print(json.dumps({"rank": r, "capture": "off", "interception": run["interception"],
                                  "inference_mode": run["inference_mode"], "program": run["program"],
                                  "seen": len(run["seen"]), "missed": dict(missed),
                                  "same_sequence": [n for n in run["seen"] if n in mode] == mode}))
        costs = [runs["bare"][r]["tiny_op_us"] for r in (0, 1)]
        print("tiny op us, without / with AutogradCPU kernels / with BackendSelect kernels:",
              ", ".join(f"rank {r}: {c['without']:.2f} / {c['with_kernels']:.2f} / "
                        f"{c['with_backend_select_kernels']:.2f}" for r, c in enumerate(costs)))
    print("programs:", "every result right" if ok else "A FAILURE (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
