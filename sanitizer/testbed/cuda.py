"""Symmetric memory on a GPU with CuPy: the CPU testbed's interface, on device memory.

The same fault class as the CPU testbed (comm.py), on real device memory and real device
kernels, so that what the placement model and hazsan say can be checked on the hardware:

  * each rank's window is one cudaMalloc'd arena; its CUDA IPC handle goes to every rank process
    through a file next to the shared control block, and every peer maps it with
    cudaIpcOpenMemHandle (two or more rank processes on one GPU, or one rank per GPU with peer
    access);
  * blocks in the window are placed by hazsan's caching-allocator model (the WindowPool of
    comm.py, unchanged); tensors made inside `comm.scope()` are torch views of the arena
    (DLPack over the arena's bytes, one storage per block, so a block dies with its storage);
  * one-sided all_reduce and all_gather are CuPy RawKernels run on a communication stream by the
    comm thread: they load peers' windows at (base of the peer's window + offset) and hold no
    tensor references; barriers between ranks go through the shared control block (sync.py) as
    on CPU; `end_barrier=False` is the barrier-less (successor) variant;
  * each collective's input readiness and completion are CUDA events: the comm thread waits for
    the event recorded on the producer's stream at enqueue time, and Work.wait() makes the
    caller's current stream wait for the completion event. They are torch.cuda.Event objects
    (the comm stream seen by torch as an ExternalStream), so that torch.cuda._gpu_trace reports
    their records, waits and synchronizations to capture as it does the program's own; streams
    are named as capture names them (`cuda:<d>`, `cuda:<d>:s<n>`: capture/streams.py).

CuPy and a CUDA build of torch are needed only here: `import sanitizer.testbed.cuda` works
without them, `CudaSymmetricCommunicator(...)` raises TestbedError naming what is missing.

    from sanitizer.testbed import spawn
    from sanitizer.testbed.cuda import CudaSymmetricCommunicator

    def worker(rank, files):
        with CudaSymmetricCommunicator(files, rank, device=0) as comm:   # both ranks on GPU 0
            with comm.scope():
                x = torch.full((1024,), float(rank + 1), device="cuda:0")
            comm.all_reduce(x).wait()
            return x.sum().item()

    spawn(worker, world_size=2)
"""
from __future__ import annotations

import os
import time

from .comm import SymmetricCommunicator, TestbedError, Work, _Job
from .shm import WindowFiles

KERNELS = r"""
// Element i of a window range as float (float32: as is; bfloat16: the upper half of a float32).
__device__ __forceinline__ float hz_load(unsigned long long base, long long i, int dtype) {
    if (dtype == 0) return ((const float*)base)[i];
    unsigned int b = ((const unsigned short*)base)[i];
    return __uint_as_float(b << 16);
}
// Store as dtype; bfloat16 rounds to nearest even, NaN becomes 0x7fc0 (torch's conversion).
__device__ __forceinline__ void hz_store(unsigned long long base, long long i, float v, int dtype) {
    if (dtype == 0) { ((float*)base)[i] = v; return; }
    unsigned int u = __float_as_uint(v);
    unsigned short out;
    if ((u & 0x7fffffffu) > 0x7f800000u) out = 0x7fc0;
    else out = (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    ((unsigned short*)base)[i] = out;
}
// One-shot pull all-reduce: out[i] = sum over ranks q, in rank order, of window_q[in_off + i].
extern "C" __global__ void hazsan_all_reduce(const unsigned long long* bases, int world, long long in_off,
                                             int in_dtype, unsigned long long out, int out_dtype, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float acc = hz_load(bases[0] + in_off, i, in_dtype);
        for (int q = 1; q < world; ++q) acc += hz_load(bases[q] + in_off, i, in_dtype);
        hz_store(out, i, acc, out_dtype);
    }
}
// Pull one peer's range into mine (all-gather, one launch per rank).
extern "C" __global__ void hazsan_copy(unsigned long long src, unsigned long long dst, long long nbytes) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < nbytes; i += stride)
        ((unsigned char*)dst)[i] = ((const unsigned char*)src)[i];
}
"""

_DTYPES = {"torch.float32": 0, "torch.bfloat16": 1}
_THREADS = 256


def _require():
    try:
        import cupy
        import torch
    except ImportError as exc:
        raise TestbedError(f"the GPU testbed needs CuPy and a CUDA build of torch ({exc}); "
                           f"install with `pip install hazsan[gpu-cu13]` (CUDA 13; gpu-cu12 for "
                           f"CUDA 12)") from None
    if not torch.cuda.is_available():
        raise TestbedError("the GPU testbed needs a CUDA device (torch.cuda.is_available() is False)")
    return cupy, torch


_STREAM_IDS = None


def stream_name(device: int, handle: int) -> str:
    """The stream's id as hazsan capture writes it: capture's own table when capture runs in this
    process (so the testbed's events and capture's name one stream alike), else a table of the
    same kind: `cuda:<device>` for the default stream, `cuda:<device>:s<n>` for others."""
    global _STREAM_IDS
    from sanitizer.capture import runtime
    from sanitizer.capture.streams import StreamIds
    cap = runtime.active()
    table = getattr(cap, "streams", None)
    if table is None:
        if _STREAM_IDS is None:
            _STREAM_IDS = StreamIds()
        table = _STREAM_IDS
    return table.of_handle(handle, device)


class DeviceWindow:
    """One rank's window as this process sees it: a device range (own, or a peer's opened by IPC).

    Offers what comm.WindowPool and comm.SymmetricCommunicator use of a shm.Mapping: `base`,
    `size`, `bytes_at` (a uint8 torch tensor with a storage of its own), `view`, `close`."""

    device_type = "cuda"

    def __init__(self, cupy, torch, device: int, base: int, size: int, *, owned: bool, alloc_stream: str):
        self.cupy, self.torch = cupy, torch
        self.device, self.base, self.size, self.owned = device, base, size, owned
        self.alloc_stream = alloc_stream
        self.path = f"cuda:{device}@{base:#x}"
        self._mem = cupy.cuda.UnownedMemory(base, size, self, device)

    def _array(self, offset: int, nbytes: int):
        cp = self.cupy
        return cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(self._mem, offset))

    def bytes_at(self, offset: int, nbytes: int):
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"range [{offset}, {offset + nbytes}) outside the {self.size}-byte window {self.path}")
        if nbytes == 0:
            return self.torch.empty(0, dtype=self.torch.uint8, device=f"cuda:{self.device}")
        # DLPack: torch shares the bytes and keeps the CuPy array (not the tensor) alive; each
        # call is a storage of its own, so each block's storage dies on its own.
        return self.torch.from_dlpack(self._array(offset, nbytes))

    def view(self, offset: int, nbytes: int, dtype, shape=None):
        t = self.bytes_at(offset, nbytes).view(dtype)
        return t if shape is None else t.view(shape)

    def close(self) -> None:
        rt = self.cupy.cuda.runtime
        try:
            with self.cupy.cuda.Device(self.device):
                if self.owned:
                    rt.free(self.base)
                else:
                    rt.ipcCloseMemHandle(self.base)
        except Exception:
            pass   # at interpreter exit the context may be gone; the driver frees it with the process


class CudaWork(Work):
    """Completion handle: the host waits for the comm thread, then the caller's current stream
    waits for the collective's completion event (what NCCL's Work.wait() does)."""

    __slots__ = ("event",)

    def __init__(self, comm, cid, seq, op):
        super().__init__(comm, cid, seq, op)
        self.event = None

    def wait(self, timeout: float | None = None) -> bool:
        super().wait(timeout)
        if self.event is not None:
            self.comm.torch.cuda.current_stream(self.comm.device_index).wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        if self.event is not None and not self.event.query():
            return False
        return super().is_completed()


class CudaSymmetricCommunicator(SymmetricCommunicator):
    """SymmetricCommunicator on a GPU: same constructor, scope(), empty(), all_reduce(),
    all_gather(), *_at(), record_stream(), synchronize(), close(); plus `device` (default:
    LOCAL_RANK modulo the devices; give the same index to every rank for IPC within one GPU)."""

    work_class = CudaWork

    def __init__(self, files: WindowFiles, rank: int, *, device: int | None = None, **kwargs):
        self.cupy, self.torch = _require()
        count = self.torch.cuda.device_count()
        if device is None:
            device = int(os.environ.get("LOCAL_RANK", rank)) % count
        if not 0 <= device < count:
            raise TestbedError(f"device {device} does not exist ({count} CUDA devices)")
        self.device_index = device
        self.device = f"cuda:{device}"
        self.torch.cuda.set_device(device)
        self.cupy.cuda.Device(device).use()
        import collections
        import threading
        self._ready: collections.deque = collections.deque()    # one readiness event per queued job
        self._enqueue_lock = threading.Lock()
        self._module = None
        self.comm_stream = None
        super().__init__(files, rank, **kwargs)
        self.comm_stream = self.cupy.cuda.Stream(non_blocking=True)
        # the same cudaStream_t for torch: events recorded on it go through torch's GPU trace
        self.comm_stream_torch = self.torch.cuda.ExternalStream(self.comm_stream.ptr, device=self.device)
        self.stream = stream_name(device, self.comm_stream.ptr)
        cp = self.cupy
        self._bases = cp.asarray([w.base for w in self.windows], dtype=cp.uint64)
        cp.cuda.runtime.deviceSynchronize()      # the comm stream does not order after the null stream
        self._module = cp.RawModule(code=KERNELS)
        self._reduce = self._module.get_function("hazsan_all_reduce")
        self._copy = self._module.get_function("hazsan_copy")

    # ---- windows: a cudaMalloc arena per rank, exchanged by IPC handle -------------------------
    def _handle_path(self, files: WindowFiles, q: int) -> str:
        return os.path.join(files.directory, f"{files.job}.cuda{q}")

    def _open_windows(self, files: WindowFiles) -> list:
        cp, torch = self.cupy, self.torch
        rt = cp.cuda.runtime
        alloc_stream = stream_name(self.device_index, torch.cuda.current_stream(self.device_index).cuda_stream)
        base = rt.malloc(files.window_bytes)
        rt.memset(base, 0, files.window_bytes)
        own = DeviceWindow(cp, torch, self.device_index, base, files.window_bytes, owned=True,
                           alloc_stream=alloc_stream)
        path = self._handle_path(files, self.rank)
        with open(path + ".part", "wb") as f:
            f.write(bytes(rt.ipcGetMemHandle(base)))
        os.replace(path + ".part", path)
        windows = []
        deadline = time.monotonic() + self.timeout
        for q in range(files.world_size):
            if q == self.rank:
                windows.append(own)
                continue
            other = self._handle_path(files, q)
            while not os.path.exists(other):
                if time.monotonic() > deadline:
                    raise TestbedError(f"rank {q} did not publish its window's IPC handle within {self.timeout:.0f} s")
                time.sleep(0.01)
            with open(other, "rb") as f:
                handle = f.read()
            ptr = rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)
            windows.append(DeviceWindow(cp, torch, self.device_index, ptr, files.window_bytes, owned=False,
                                        alloc_stream=alloc_stream))
        return windows

    # ---- collectives: enqueue records readiness on the caller's stream ---------------------------
    def _enqueue(self, op, in_off, nbytes, dtype, out_off, bufs) -> Work:
        if str(dtype) not in _DTYPES and op == "all_reduce":
            raise TestbedError(f"{op}: the GPU testbed sums float32 and bfloat16, not {dtype}")
        ready = self.torch.cuda.Event()
        ready.record(self.torch.cuda.current_stream(self.device_index))
        with self._enqueue_lock:          # the comm thread takes jobs and events in the same order
            self._ready.append(ready)
            return super()._enqueue(op, in_off, nbytes, dtype, out_off, bufs)

    def _run(self) -> None:
        self.cupy.cuda.Device(self.device_index).use()
        self.torch.cuda.set_device(self.device_index)
        super()._run()

    def _launch(self, kernel, n: int, args) -> None:
        grid = max(1, min(1024, (n + _THREADS - 1) // _THREADS))
        with self.comm_stream:
            kernel((grid,), (_THREADS,), args)

    def _inputs_ready(self, job: _Job) -> None:
        self._ready.popleft().synchronize()   # the producer's stream reached the enqueue point

    def _complete(self, job: _Job, what: str) -> None:
        self.comm_stream.synchronize()
        if self.end_barrier:
            self.counters.barrier(self.timeout, what)
        done = self.torch.cuda.Event()
        done.record(self.comm_stream_torch)
        job.work.event = done

    def _all_reduce(self, job: _Job, torch) -> None:
        import numpy as np
        what = f"all_reduce seq {job.seq}"
        code = _DTYPES[str(job.dtype)]
        n = job.nbytes // (4 if code == 0 else 2)
        self._inputs_ready(job)
        self.counters.barrier(self.timeout, what)                # every input is ready
        if self.read_delay:
            time.sleep(self.read_delay)
        out = self.window.base + job.out_off
        if job.out_off == job.in_off:                            # in place: sum into scratch first
            with self.comm_stream:
                scratch = self.cupy.empty((n,), dtype=self.cupy.float32)
                one = self.cupy.asarray([scratch.data.ptr], dtype=self.cupy.uint64)
            self._launch(self._reduce, n, (self._bases, np.int32(self.world_size), np.int64(job.in_off),
                                           np.int32(code), np.uint64(scratch.data.ptr), np.int32(0), np.int64(n)))
            self.comm_stream.synchronize()
            self.counters.barrier(self.timeout, what)            # nobody's input is overwritten early
            self._launch(self._reduce, n, (one, np.int32(1), np.int64(0), np.int32(0),
                                           np.uint64(out), np.int32(code), np.int64(n)))
            self.comm_stream.synchronize()
            del scratch, one
        else:
            self._launch(self._reduce, n, (self._bases, np.int32(self.world_size), np.int64(job.in_off),
                                           np.int32(code), np.uint64(out), np.int32(code), np.int64(n)))
        self._complete(job, what)

    def _all_gather(self, job: _Job) -> None:
        import numpy as np
        what = f"all_gather seq {job.seq}"
        self._inputs_ready(job)
        self.counters.barrier(self.timeout, what)
        if self.read_delay:
            time.sleep(self.read_delay)
        for q in range(self.world_size):
            self._launch(self._copy, job.nbytes, (np.uint64(self.windows[q].base + job.in_off),
                                                  np.uint64(self.window.base + job.out_off + q * job.nbytes),
                                                  np.int64(job.nbytes)))
        self._complete(job, what)

    def synchronize(self) -> None:
        super().synchronize()
        if self.comm_stream is not None:
            self.comm_stream.synchronize()

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        try:
            self.torch.cuda.synchronize(self.device_index)
        except Exception:
            pass
        # peers may still be reading my window until every rank is here
        try:
            self.counters.barrier(self.timeout, "close")
        except Exception:
            pass
        if self.pool.live:
            return   # the program still holds window tensors: the memory goes with the process
        for w in self.windows:
            if not w.owned:
                w.close()
        self.window.close()
        try:
            os.unlink(self._handle_path(self.files, self.rank))
        except OSError:
            pass
