"""The seeded hazard of `make test-sglang` (SGLANG_E2E_SEED=early-read; test set-up, not hazsan):
an early read in SGLang's real all-reduce path.

GroupCoordinator.all_reduce on CPU tensors (SGLang 0.5.23, parallel_state.py) runs
`torch.distributed.all_reduce(input_, group=self.device_group)`. Seeded, the same all-reduce is
issued asynchronously and its buffer is read before the wait: the read can see a half-reduced
buffer. The value read is discarded, so the tokens do not change; hazsan at level `full` must flag
the read as `unordered-access`.
"""
from __future__ import annotations


def install(module) -> None:
    cls = module.GroupCoordinator
    original = cls.all_reduce

    def all_reduce(self, input_):
        if self.world_size == 1 or not input_.is_cpu:
            return original(self, input_)
        import torch.distributed as dist
        work = dist.all_reduce(input_, group=self.device_group, async_op=True)
        early_read(input_)
        work.wait()
        return input_

    cls.all_reduce = all_reduce


def early_read(buf):
    return buf.sum()      # the seeded hazard: reads the buffer the all-reduce is still writing
