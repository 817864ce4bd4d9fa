"""Reading an asynchronous all-reduce's output before waiting for it, on the symmetric-memory testbed.

Two ranks all-reduce a buffer in their windows, asynchronously (the testbed's comm thread plays
the comm stream), then compute on the output. `--variant early` reads it before `work.wait()`
(the bug: the result is whatever the collective had written by then); `--variant wait` waits
first. Under capture at level full, hazsan sees the read as a `launch` and flags the early one:

    HAZSAN=1 HAZSAN_LEVEL=full HAZSAN_DIR=t-early python examples/read_before_wait.py --variant early
    hazsan check t-early          # unordered-access (exit 1)
    HAZSAN=1 HAZSAN_LEVEL=full HAZSAN_DIR=t-wait python examples/read_before_wait.py --variant wait
    hazsan check t-wait           # clean (exit 0)

At level alloc no launch is recorded, so the early read goes unseen (that level's documented limit).
"""
from __future__ import annotations

import argparse


def worker(rank, files, variant, n):
    import torch
    from sanitizer.testbed import SymmetricCommunicator
    torch.set_num_threads(1)
    with SymmetricCommunicator(files, rank, read_delay=0.05) as comm:
        comm.step(0)
        with comm.scope():
            x = torch.full((n,), float(rank + 1))
            y = torch.empty(n)
        work = comm.all_reduce(x, out=y)
        if variant == "early":
            total = float((y * 2).sum())          # reads y while the all-reduce may still write it
            work.wait()
        else:
            work.wait()
            total = float((y * 2).sum())
        comm.step(1)
        return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=("early", "wait"), default="early")
    p.add_argument("--elements", type=int, default=4096)
    args = p.parse_args()
    from sanitizer.testbed import spawn
    totals = spawn(worker, 2, args=(args.variant, args.elements), window_bytes=8 << 20, timeout=120)
    expected = 2 * 3.0 * args.elements
    print(f"{args.variant}: sum of 2*y per rank {totals} (expected {expected} when ordered)")


if __name__ == "__main__":
    main()
