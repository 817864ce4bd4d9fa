"""The project's own hazard at a shape where nothing collides: compute inside the symmetric scope.

A decode step of two gloo ranks: a tensor-parallel projection whose output goes to an all-reduce.
The stock step computes `tanh(x @ w)` inside `sanitizer.symmetric_scope`, so the matmul's and the
tanh's results (transients) are placed in the symmetric window, where peers address buffers by
offset: at this small shape no transient lands on a buffer in flight, so no output is corrupted,
yet the hazard is there (`transient-in-window`, an error). `--fixed` computes outside the scope and
allocates only the all-reduce's buffer inside, as the reference fix does:

    hazsan run -- python examples/first_programs/window_compute.py            # exit 1
    hazsan run -- python examples/first_programs/window_compute.py --fixed    # exit 0
"""
from __future__ import annotations

import argparse
import os


def worker(rank: int, world: int, port: int, fixed: bool, steps: int) -> None:
    import torch
    import torch.distributed as dist

    import sanitizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    group = dist.group.WORLD
    torch.manual_seed(rank)
    w = torch.randn(256, 256) / 16
    pending = None
    outputs = []
    for n in range(steps):
        with sanitizer.step(n, phase="decode", tokens=8):
            x = torch.randn(8, 256)
            # computed while the previous step's all-reduce is in flight, as a serving stack
            # overlaps them: peers may be writing the window meanwhile
            if fixed:
                y = torch.tanh(x @ w)                      # transients outside the window
                with sanitizer.symmetric_scope(group):
                    out = torch.empty_like(y)              # only the collective's buffer inside
                out.copy_(y)
            else:
                with sanitizer.symmetric_scope(group):
                    out = torch.tanh(x @ w)                # BUG: x @ w's result lands in the window
            if pending is not None:
                pending.wait()
            pending = dist.all_reduce(out, async_op=True)
            outputs.append(out)    # every output stays referenced: the same window layout on each rank
    pending.wait()
    dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fixed", action="store_true", help="compute outside the symmetric scope")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    import torch.multiprocessing as mp

    from async_allreduce import free_port

    mp.spawn(worker, args=(2, free_port(), args.fixed, args.steps), nprocs=2)


if __name__ == "__main__":
    main()
