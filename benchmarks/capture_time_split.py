#!/usr/bin/env python3
"""Where the alloc level's CPU time per tiny op goes (issue 30): one process under HAZSAN=1
HAZSAN_LEVEL=alloc, the same loop as op_instructions.py (`a + 1.0` on 16 elements, a new storage
each) timed with capture's dispatch mode replaced step by step:

  capture as is | no mode at all | a no-op mode (torch's Dynamo wrapper off, as capture's) |
  capture's mode with a no-op table | + the storage key | + the storage object, nbytes,
  data_ptr, dtype, is_cpu and a weakref with a callback (what a new block reads) | + the call-site
  walk | capture as is, again | capture with its events appended to a list (no writer)

Best of --rounds rounds of --ops ops each (CPU time). Run it under capture:

    HAZSAN=1 HAZSAN_LEVEL=alloc HAZSAN_DIR=/tmp/split .venv/bin/python benchmarks/capture_time_split.py
"""
from __future__ import annotations

import argparse
import sys
import time
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode

from sanitizer.capture import memory, runtime


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", type=int, default=20000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    cap = runtime.active()
    if cap is None or cap.settings.level != "alloc":
        sys.exit("run under HAZSAN=1 HAZSAN_LEVEL=alloc (see the docstring)")
    torch.set_num_threads(1)
    table = cap.blocks
    a = torch.ones(16)

    def loop(n):
        for _ in range(n):
            a + 1.0

    def measure(label):
        loop(2000)
        best = min(_timed(loop, args.ops) for _ in range(args.rounds))
        print(f"  {label:62s} {best:6.2f} us/op")
        return best

    class NoOp(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls):
            return False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **kwargs) if kwargs else func(*args)

    def with_table_step(on_op):
        mode = memory.AllocationMode(table)
        mode._on_op = on_op
        _pop_mode()
        mode.__enter__()

    key = torch._C._storage_address

    def died(ref):
        pass

    def reads(func, args, out, where=None):
        key(out)
        s = out.untyped_storage()
        s.nbytes(), s.data_ptr(), out.dtype, out.is_cpu
        return weakref.ref(s, died)

    def reads_and_site(func, args, out, where=None):
        reads(func, args, out)
        cap.sites.where()

    print(f"CPU time per tiny op, best of {args.rounds} x {args.ops}:")
    measure("capture (alloc) as is")
    capture_mode = _pop_mode()
    measure("no mode at all (bare)")
    with NoOp():
        measure("a no-op dispatch mode")
    capture_mode.__enter__()
    with_table_step(lambda func, args, out, where=None: None)
    measure("capture's mode, the table's on_op a no-op")
    with_table_step(lambda func, args, out, where=None: key(out))
    measure("+ the storage key")
    with_table_step(reads)
    measure("+ storage object, nbytes, data_ptr, dtype, is_cpu, weakref")
    with_table_step(reads_and_site)
    measure("+ the call-site walk")
    with_table_step(table.on_op)
    measure("capture (alloc) as is, again")
    sink: list = []
    emit, table.emit = table.emit, sink.append
    measure("capture, its events appended to a list (no writer)")
    table.emit = emit
    return 0


def _timed(loop, n: int) -> float:
    t0 = time.process_time()
    loop(n)
    return (time.process_time() - t0) / n * 1e6


if __name__ == "__main__":
    sys.exit(main())
