"""The commonest asynchronous bug, as a newcomer writes it: a tensor updated while its all-reduce runs.

Two gloo ranks on loopback. Each step all-reduces a gradient asynchronously; the bug scales it before
`work.wait()`, so the collective and the update race on the same bytes (the result depends on which
wins). `--fixed` waits first. The README's recipes find the bug at the scaling line:

    HAZSAN=1 python examples/first_programs/async_allreduce.py          # then: hazsan check hazsan-traces
    hazsan run -- python examples/first_programs/async_allreduce.py     # exit 1: unordered-access
    hazsan run -- python examples/first_programs/async_allreduce.py --fixed   # exit 0
"""
from __future__ import annotations

import argparse
import os


def worker(rank: int, world: int, port: int, fixed: bool, steps: int) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for _ in range(steps):
        grad = torch.randn(1 << 14)
        work = dist.all_reduce(grad, async_op=True)
        if fixed:
            work.wait()
            grad.mul_(1.0 / world)        # the average, once the sum is in
        else:
            grad.mul_(1.0 / world)        # BUG: races the all-reduce still reading and writing grad
            work.wait()
    dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixed", action="store_true", help="wait for the all-reduce before scaling")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(2, free_port(), args.fixed, args.steps), nprocs=2)


if __name__ == "__main__":
    main()
