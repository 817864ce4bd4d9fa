"""SGLang 0.5.23's real distributed code on a CPU: only the CUDA/NCCL boundary is faked.

The package under test is SGLang from PyPI (installed with --no-deps by the Makefile); nothing of
SGLang is replaced. What is faked, and only that:
  * the NCCL library: NCCLLibrary's ctypes function table (`path_to_dict_mapping[so]`, the dict
    its methods call through) holds Python functions with libnccl's signatures that work on host
    memory (all-reduce, all-gather, ... move no data between processes: the trace is under test,
    not the arithmetic);
  * CUDA: torch.cuda.device / Stream / stream / current_device / synchronize /
    is_current_stream_capturing, and the private pool calls SymmetricMemoryContext makes
    (torch._C._cuda_beginAllocateCurrentThreadToPool, _cuda_endAllocateToPool, _cuda_releasePool);
    the symmetric pool itself (pynccl_allocator._mem_pool, a MemPool over SGLang's C++ plugin
    built with nvcc) is a stand-in whose snapshot() lists what the test says the pool holds, and
    the C++ registration function (_register_func) records the comm it was called with;
  * the stream handle: pynccl's get_current_device_stream_fast returns an object with the
    `cuda_stream` handle the test chooses.

Stubbed at import time (not faked behaviour, just made importable):
  * `triton` (about 1 GB installed): sglang.srt.utils.common imports it at module level and sets
    `triton.next_power_of_2`; no Triton kernel runs on the paths under test. torch._dynamo is
    imported first, so torch itself saw no triton and keeps its CPU-only code paths.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.machinery
import sys
import types

SO = "libnccl-fake.so.2"
NCCL_VERSION = 22903


def stub_triton() -> None:
    if "triton" in sys.modules:
        return
    import torch._dynamo  # noqa: F401  (torch decides "no triton" before the stub exists)

    def module(name):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        m.__path__ = []

        def __getattr__(attr, m=m):
            if attr.startswith("__"):
                raise AttributeError(attr)
            v = type(attr, (), {})       # any name SGLang refers to at import time is a class
            setattr(m, attr, v)
            return v
        m.__getattr__ = __getattr__
        sys.modules[name] = m
        return m

    t = module("triton")
    t.jit = lambda fn=None, **k: fn if fn is not None else (lambda f: f)
    t.autotune = t.heuristics = lambda *a, **k: (lambda f: f)
    t.cdiv = lambda a, b: -(-a // b)
    t.__version__ = "0.0.0"
    t.language = module("triton.language")
    t.runtime = module("triton.runtime")
    t.runtime.jit = module("triton.runtime.jit")


class FakeStream:
    def __init__(self, handle=0, device_index=0):
        self.cuda_stream = handle
        self.device_index = device_index

    def synchronize(self):
        pass


class FakePool:
    """The symmetric MemPool: an id and the segments the test sets. Its snapshot() is torch's own
    MemPool.snapshot (torch/cuda/memory.py: memory_snapshot(self.id, include_traces=...) ->
    torch._C._cuda_memorySnapshot((id0, id1, include_traces))["segments"]) over a stand-in of that
    C binding (absent from a CPU build), which answers the segments and records every request."""

    def __init__(self):
        import torch
        self.id = (1, 0)
        self.segments: list[dict] = []
        self.requests: list[tuple] = []       # what _cuda_memorySnapshot was asked for
        self._seen: set = set()               # every (address, size) it ever held
        pools = getattr(torch._C, "_hazsan_fake_pools", None)
        if pools is None:
            pools = torch._C._hazsan_fake_pools = {}

            def memory_snapshot(mempool_id):
                pool = pools.get(tuple(mempool_id[:2])) if mempool_id is not None else None
                if pool is None:
                    return {"segments": [], "device_traces": []}
                pool.requests.append(tuple(mempool_id))
                return {"segments": list(pool.segments),
                        "device_traces": [[{"action": "alloc"}] * 1000] if mempool_id[2:] != (False,) else []}
            torch._C._cuda_memorySnapshot = memory_snapshot
        pools[self.id] = self

    def memory_stats(self) -> dict:
        """The counters torch._C._cuda_memoryStats(device) nests (c10 DeviceStats, StatType
        "all"): segments mapped and released so far, cumulative, and the bytes they reserve now,
        as the caching allocator keeps them for the segments this pool holds."""
        for seg in self.segments:
            self._seen.add((int(seg["address"]), int(seg["total_size"])))
        now = {(int(seg["address"]), int(seg["total_size"])) for seg in self.segments}
        return {"segment": {"all": {"allocated": len(self._seen), "freed": len(self._seen - now),
                                    "current": len(now)}},
                "reserved_bytes": {"all": {"current": sum(size for _, size in now)}}}

    def snapshot(self, include_traces=True):
        import torch
        return torch.cuda.memory.MemPool.snapshot(self, include_traces)


class FakeNccl:
    """libnccl's functions, called with exactly the ctypes arguments NCCLLibrary passes.

    ncclCommWindowRegister as NCCL 2.29+ has it (src/dev_runtime.cc): `*win = nullptr` first; a
    communicator without symmetric support (`symmetric = False` here: NCCL without cuMem, one
    rank, ...) returns ncclSuccess with the window still NULL; otherwise the registration is a
    task queued inside ncclGroupStartInternal/EndInternal, so inside the caller's
    ncclGroupStart/End the handle is written only when the outermost ncclGroupEnd runs.
    With `version` below 22902 (2.28.x, src/dev_runtime.cc of v2.28.9-1): the registration is
    queued whatever the support (NCCL_LOCAL_REGISTER defaults to 1), and
    ncclDevrWindowRegisterInGroup writes ncclCommRegister's local-registration handle where
    `!comm->symmetricSupport`: non-NULL, no window."""

    def __init__(self, rank: int, symmetric: bool = True, version: int = NCCL_VERSION):
        self.rank = rank
        self.symmetric = symmetric
        self.version = version
        self.calls: list[tuple] = []
        self.buffers: dict[int, object] = {}   # ncclMemAlloc: ptr -> ctypes buffer kept alive
        self._next_comm = 0x5000 + rank
        self._group_depth = 0
        self._queued_windows: list = []        # (ncclWindow_t*, handle) written at group end

    def table(self) -> dict:
        def ok(name):
            def fn(*args):
                self.calls.append((name,) + args)
                return 0
            return fn

        def get_version(ptr):
            ptr._obj.value = self.version
            return 0

        def unique_id(ptr):
            for i in range(128):
                ptr._obj.internal[i] = (i * 7 + 3) % 128
            return 0

        def init_rank(ptr, nranks, uid, rank, *config):
            self._next_comm += 0x100
            ptr._obj.value = self._next_comm
            return 0

        def mem_alloc(ptr, size):
            buf = ctypes.create_string_buffer(size)
            addr = ctypes.addressof(buf)
            self.buffers[addr] = buf
            ptr._obj.value = addr
            return 0

        def mem_free(ptr):
            self.buffers.pop(ptr.value, None)
            return 0

        def window_register(comm, buff, size, win, flags):
            win._obj.value = None                       # *win = nullptr
            self.calls.append(("ncclCommWindowRegister", comm, buff, size, flags))
            if not self.symmetric and self.version >= 22902:
                return 0                                # success, no window
            # 2.28 without symmetric support: the local registration's handle (0x9000...)
            handle = (0x7000 if self.symmetric else 0x9000) + len(self.calls)
            if self._group_depth:
                self._queued_windows.append((win._obj, handle))
            else:
                win._obj.value = handle
            return 0

        def group_start():
            self._group_depth += 1
            self.calls.append(("ncclGroupStart",))
            return 0

        def group_end():
            self._group_depth -= 1
            self.calls.append(("ncclGroupEnd",))
            if self._group_depth == 0:
                for obj, handle in self._queued_windows:
                    obj.value = handle
                self._queued_windows = []
            return 0

        t = {name: ok(name) for name in (
            "ncclAllReduce", "ncclAllGather", "ncclReduce", "ncclReduceScatter", "ncclSend", "ncclRecv",
            "ncclBroadcast", "ncclCommDestroy", "ncclCommWindowDeregister")}
        t.update(ncclGetErrorString=lambda r: b"fake error", ncclGetVersion=get_version,
                 ncclGetUniqueId=unique_id, ncclCommInitRank=init_rank,
                 ncclCommInitRankConfig=init_rank, ncclMemAlloc=mem_alloc, ncclMemFree=mem_free,
                 ncclCommWindowRegister=window_register, ncclGroupStart=group_start,
                 ncclGroupEnd=group_end)
        return t


class Boundary:
    """Install every fake listed in the module docstring; returns handles for the test."""

    def __init__(self, rank: int, stream_handle: int = 0, symmetric: bool = True):
        import torch
        stub_triton()
        from sglang.srt.distributed.device_communicators import pynccl, pynccl_allocator, pynccl_wrapper

        self.nccl = FakeNccl(rank, symmetric)
        lib = pynccl_wrapper.NCCLLibrary
        lib.path_to_library_cache[SO] = object()
        lib.path_to_dict_mapping[SO] = self.nccl.table()

        self.stream = FakeStream(stream_handle)
        pynccl.get_current_device_stream_fast = lambda: self.stream

        cuda = torch.cuda
        cuda.device = lambda device=None: contextlib.nullcontext()
        cuda.Stream = lambda *a, **k: FakeStream(0xDEAD0 + rank)
        cuda.stream = lambda s=None: contextlib.nullcontext()
        cuda.current_device = lambda: 0
        cuda.synchronize = lambda device=None: None
        cuda.is_current_stream_capturing = lambda: False
        for name in ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_endAllocateToPool",
                     "_cuda_releasePool"):
            setattr(torch._C, name, lambda *a: None)

        self.pool = FakePool()
        # the allocator's counters (absent from a CPU build) over the same state the pool's
        # snapshot answers from
        torch._C._cuda_memoryStats = lambda device: self.pool.memory_stats()
        self.registered: list[int] = []

        def register(comm_ptr):
            self.registered.append(comm_ptr)
            return 0
        pynccl_allocator._allocator = object()
        pynccl_allocator._mem_pool = self.pool
        pynccl_allocator._cur_device = 0
        pynccl_allocator._register_func = register
