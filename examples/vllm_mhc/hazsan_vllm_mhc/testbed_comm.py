"""vLLM's TP all-reduce and all-gather over hazsan's symmetric-memory testbed.

vLLM's `GroupCoordinator.all_reduce` (what `tensor_model_parallel_all_reduce` and every
RowParallelLinear call) hands the tensor to the group's device communicator; on CPU platforms
there is no custom-op indirection (`use_custom_op_call` is False), so replacing the TP group's
`device_communicator.all_reduce` / `.all_gather` on the instance routes every TP all-reduce and
all-gather of the model through the testbed, and nothing else (broadcasts, gathers and the CPU
group's object collectives stay vLLM's).

On the testbed a collective is given window offsets only, runs on a comm thread (the "comm
stream") and keeps no tensor alive: exactly what makes NCCL symmetric kernels dangerous. vLLM's
call is synchronous (it returns the reduced tensor), so by default the communicator waits before
returning. Inside `overlap()` it does not: the collective stays in flight until the block ends,
as a GPU kernel on the comm stream would while the compute stream goes on; the model uses that
for the mHC residual mixing, which does not need the all-reduce's result.

The window files are made by TP rank 0 and their names broadcast over the TP group's CPU (gloo)
group, so the workers vLLM spawns need nothing from the driver but two environment variables:
HAZSAN_MHC_WINDOW_MB (window size per rank) and HAZSAN_MHC_LATENCY_MS (how long the comm thread
waits before loading, the time a collective is in flight).
"""
from __future__ import annotations

import atexit
import contextlib
import os

import torch

from sanitizer.testbed import SymmetricCommunicator, WindowFiles


class TestbedTP:
    """This worker's testbed endpoint for vLLM's TP group, installed on the group's device communicator."""

    __test__ = False

    def __init__(self, comm: SymmetricCommunicator, files: WindowFiles, is_owner: bool):
        self.comm, self.files, self.is_owner = comm, files, is_owner
        self._deferred: list | None = None
        self._into: list = []
        self.collectives = 0

    # ---- what vLLM's GroupCoordinator calls --------------------------------------------------
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """Out of place, as vLLM's all_reduce is: the sum lands in a fresh window block."""
        src, staged = self._in_window(input_)
        out = self._into.pop() if self._into else None
        if out is None or out.dtype != src.dtype or out.numel() != src.numel():
            out = self.comm.empty(src.shape, src.dtype)
        work = self.comm.all_reduce(src, out=out)
        # The collective holds no reference to the caller's tensor (an NCCL symmetric kernel
        # neither); a staging copy is the communicator's own, held until the wait.
        del src
        self._finish(work, staged)
        self.collectives += 1
        return out.view(input_.shape)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation along `dim`, as vLLM's CpuCommunicator.all_gather returns it."""
        if dim < 0:
            dim += input_.dim()
        src, staged = self._in_window(input_)
        world = self.comm.world_size
        out = self.comm.empty((world,) + tuple(input_.shape), input_.dtype)
        work = self.comm.all_gather(src, out)
        work.wait()          # the caller reads the result at once
        del src, staged
        self.collectives += 1
        size = input_.shape
        return out.movedim(0, dim).reshape(size[:dim] + (world * size[dim],) + size[dim + 1:])

    # ---- what the model uses -----------------------------------------------------------------
    def scope(self):
        """Allocations in here are placed in this rank's window: vLLM's nccl_symm_mem_context."""
        return self.comm.scope()

    @contextlib.contextmanager
    def overlap(self, into: torch.Tensor | None = None):
        """All-reduces issued in here stay in flight until the block ends (then are waited for).
        `into`: a window buffer the first one writes its sum into (instead of a fresh block), as
        SGLang's mHC path reuses the combine's output, dead after the block's first norm."""
        outer, self._deferred = self._deferred, []
        outer_into, self._into = self._into, ([into] if into is not None else [])
        try:
            yield
        finally:
            self._into = outer_into
            pending, self._deferred = self._deferred, outer
            for work, _hold in pending:
                work.wait()

    # ---- internals ---------------------------------------------------------------------------
    def _in_window(self, t: torch.Tensor):
        """(t, None) when t is a contiguous window tensor, else (copy, copy): a window staging
        buffer, as a symmetric-memory all-reduce copies a non-symmetric input."""
        base, size = self.comm.window.base, self.comm.window.size
        ptr = t.data_ptr()
        nbytes = t.numel() * t.element_size()
        if t.is_contiguous() and base <= ptr and ptr + nbytes <= base + size:
            return t, None
        staged = self.comm.empty(t.shape, t.dtype)
        staged.copy_(t)
        return staged, staged

    def _finish(self, work, hold) -> None:
        if self._deferred is None:
            work.wait()
        else:
            self._deferred.append((work, hold))

    def close(self) -> None:
        self.comm.close()
        if self.is_owner:
            self.files.unlink()


_installed: TestbedTP | None = None


def install() -> TestbedTP:
    """Route this worker's TP group's all-reduce and all-gather over the testbed (once)."""
    global _installed
    if _installed is not None:
        return _installed
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    tp = get_tp_group()
    if tp.world_size < 2 or tp.device_communicator is None:
        raise RuntimeError("hazsan_vllm_mhc: the testbed needs tensor_parallel_size >= 2")
    window = int(float(os.environ.get("HAZSAN_MHC_WINDOW_MB", "512")) * (1 << 20))
    latency = float(os.environ.get("HAZSAN_MHC_LATENCY_MS", "1.0")) / 1000.0
    box = [WindowFiles.create(tp.world_size, window) if tp.rank_in_group == 0 else None]
    dist.broadcast_object_list(box, src=tp.ranks[0], group=tp.cpu_group)
    files = box[0]
    comm = SymmetricCommunicator(files, tp.rank_in_group, name="tp", read_delay=latency, timeout=300.0)
    # Every rank has mapped every window: the files can go (the mappings stay valid), so a
    # worker vLLM kills leaves nothing behind in /dev/shm.
    dist.barrier(group=tp.cpu_group)
    if tp.rank_in_group == 0:
        files.unlink()
    endpoint = TestbedTP(comm, files, is_owner=False)
    dev = tp.device_communicator
    dev.all_reduce = endpoint.all_reduce          # on the instance: GroupCoordinator calls these
    dev.all_gather = endpoint.all_gather
    atexit.register(endpoint.close)
    _installed = endpoint
    return endpoint
