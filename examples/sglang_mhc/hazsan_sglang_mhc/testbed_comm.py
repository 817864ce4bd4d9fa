"""SGLang's symmetric-memory scope and TP all-reduce over hazsan's symmetric-memory testbed (CPU).

On a GPU, SGLang's `use_symmetric_memory(group)` returns a `SymmetricMemoryContext`
(srt/distributed/device_communicators/pynccl_allocator.py) that routes the current thread's CUDA
allocations to the NCCL symmetric MemPool, and the TP group's all-reduce runs an NCCL symmetric
kernel on those window buffers. On CPU neither exists (the context asserts on the group's pynccl
communicator and switches a CUDA pool; the all-reduce is gloo's). `install()` supplies both from
the testbed, in every TP worker, when the model is built:

  * `pynccl_allocator.SymmetricMemoryContext` becomes `TestbedSymmetricMemoryContext`: for the TP
    group it enters the testbed's `comm.scope()` (fresh tensors made in it live in this rank's
    window, placed by the caching-allocator model), for any other group nothing, and
    `pynccl_allocator.is_symmetric_memory_enabled` answers True. Every `use_symmetric_memory` call
    of SGLang's layers (RowParallelLinear's partial, VocabParallelEmbedding's output, the TP
    group's gather outputs) and of the model therefore allocates in the window, as SGLang does on
    a GPU with `--enable-symm-mem`. The testbed records the scope, the window, its placements and
    its collectives into hazsan's capture of the process (sanitizer/testbed/record.py).
    (hazsan's own hook on the CUDA context reads the CUDA pool, which a CPU run has not: the
    testbed's records stand for it here.)
  * the TP GroupCoordinator's `all_reduce` (on the instance: `tensor_model_parallel_all_reduce`
    and RowParallelLinear call it) runs on the testbed (examples/vllm_mhc's TestbedTP): one-sided,
    on a comm thread, addressed by window offset, holding no tensor. It waits before returning,
    except inside `overlap()`, which the model opens around the all-reduce and the residual mixing.

Every other collective (broadcasts, the logits gather, the scheduler's object collectives) stays
SGLang's gloo. The window files are made by TP rank 0 and their names broadcast over the TP group's
CPU group; HAZSAN_MHC_WINDOW_MB and HAZSAN_MHC_LATENCY_MS size the window and the time a collective
is in flight, as for the vLLM plugin.
"""
from __future__ import annotations

import atexit
import os

_installed = None


class TestbedSymmetricMemoryContext:
    """What `use_symmetric_memory(group)` returns once installed: the testbed's window scope for
    the routed TP group, nothing for another group."""

    __test__ = False

    def __init__(self, group_coordinator, *args, **kwargs):
        self.group_coordinator = group_coordinator
        endpoint = _installed
        routed = endpoint is not None and getattr(group_coordinator, "unique_name", None) == endpoint.group_name
        self._scope = endpoint.scope() if routed else None

    def __enter__(self):
        if self._scope is not None:
            self._scope.__enter__()
        return self

    def __exit__(self, *exc_info):
        if self._scope is not None:
            return self._scope.__exit__(*exc_info)
        return False


def install():
    """Route this worker's TP all-reduce and SGLang's symmetric-memory scope over the testbed
    (once per process); returns the endpoint (TestbedTP)."""
    global _installed
    if _installed is not None:
        return _installed
    import torch.distributed as dist
    from hazsan_vllm_mhc.testbed_comm import TestbedTP
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.distributed.device_communicators import pynccl_allocator

    from sanitizer.testbed import SymmetricCommunicator, WindowFiles

    tp = get_tp_group()
    if tp.world_size < 2:
        raise RuntimeError("hazsan_sglang_mhc: the testbed needs tp_size >= 2")
    window = int(float(os.environ.get("HAZSAN_MHC_WINDOW_MB", "512")) * (1 << 20))
    latency = float(os.environ.get("HAZSAN_MHC_LATENCY_MS", "1.0")) / 1000.0
    box = [WindowFiles.create(tp.world_size, window) if tp.rank_in_group == 0 else None]
    dist.broadcast_object_list(box, src=tp.ranks[0], group=tp.cpu_group)
    files = box[0]
    comm = SymmetricCommunicator(files, tp.rank_in_group, name="tp", read_delay=latency, timeout=300.0)
    # every rank has mapped every window: the files can go (the mappings stay valid), so a
    # scheduler Engine.shutdown() kills leaves nothing behind in /dev/shm
    dist.barrier(group=tp.cpu_group)
    if tp.rank_in_group == 0:
        files.unlink()
    endpoint = TestbedTP(comm, files, is_owner=False)
    endpoint.group_name = tp.unique_name
    tp.all_reduce = endpoint.all_reduce            # on the instance: what SGLang's callers reach
    pynccl_allocator.SymmetricMemoryContext = TestbedSymmetricMemoryContext
    pynccl_allocator.is_symmetric_memory_enabled = lambda: True
    atexit.register(endpoint.close)
    _installed = endpoint
    return endpoint
