"""A symmetric-memory communicator on CPU: windows in shared memory, one-sided collectives on a
comm thread, blocks placed by the caching-allocator model.

What makes NCCL symmetric memory dangerous, reproduced here on purpose:
  * peers address my window by *offset* (the offset of their own buffer) and load from / store to
    it directly; nothing on my side is told when;
  * the collective keeps no reference to any tensor: it is given (offset, nbytes, dtype) and runs
    later, on a thread of its own (the "comm stream"), so dropping the last Python reference to a
    buffer while the collective is queued or running frees the block at once;
  * a freed block goes back to the allocator model (sanitizer.place.CachingAllocator, a pool whose
    segments are carved from the window), and the next allocation of a fitting size gets the same
    bytes: what it writes there is what the collective (or a peer's) reads.

The algorithm of each collective, as run by every rank's comm thread (ranks see the same sequence):

  all_reduce (one-shot, pull):  barrier (every input is ready)  ->  [read_delay]  ->  load the input
      range from every rank's window, sum in rank order (bitwise equal on all ranks)  ->  in place
      only: barrier (every rank has finished loading, so nobody's input is overwritten early)  ->
      store the sum into my output range  ->  end barrier (if end_barrier)  ->  locally complete.
  all_gather (pull):  barrier  ->  [read_delay]  ->  load every rank's input range into my output
      at rank * nbytes  ->  end barrier (if end_barrier)  ->  locally complete.

With end_barrier=True (default) a rank completes only after every peer is done with its window,
which is what NCCL documents for its symmetric kernels (docs/ordering-and-rules.md, "`local` (the default)"). With
end_barrier=False a slow peer can still be loading my *input* after my completion, as with a
barrier-less kernel (docs/ordering-and-rules.md, "`successor`"); `read_delay` makes a rank that slow
peer, deterministically.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

from sanitizer.place import AllocatorConfig, Arena, CachingAllocator, OutOfMemory

from . import record as _record
from .shm import Mapping, WindowFiles
from .sync import Counters, PeerFailure

HOST_STREAM = "cpu"          # the stream name capture uses for host work on CPU


class TestbedError(RuntimeError):
    """Misuse of the testbed (a buffer outside the window, a closed communicator, ...)."""

    __test__ = False   # not a pytest test class, whatever its name


# ------------------------------------------------------------------------------------ handles
class Work:
    """Completion handle of one collective (like torch.distributed's Work)."""

    __slots__ = ("comm", "cid", "seq", "op", "_done", "_error", "_observed", "__weakref__")

    def __init__(self, comm: "SymmetricCommunicator", cid: int, seq: int, op: str):
        self.comm, self.cid, self.seq, self.op = comm, cid, seq, op
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._observed = False

    def is_completed(self) -> bool:
        """Non-blocking; a True answer is the host observing completion (recorded once)."""
        if not self._done.is_set():
            return False
        self._observe()
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until this rank's part is complete. Raises if the collective failed."""
        if not self._done.wait(self.comm.timeout if timeout is None else timeout):
            raise PeerFailure(f"{self.op} seq {self.seq} on {self.comm.name!r} did not complete within "
                              f"{self.comm.timeout if timeout is None else timeout} s")
        self._observe()
        return True

    def _observe(self) -> None:
        if self._error is not None:
            raise PeerFailure(f"{self.op} seq {self.seq} on {self.comm.name!r} failed: {self._error}") from self._error
        if not self._observed:
            self._observed = True
            self.comm.recorder.emit({"ev": "coll_done", "cid": self.cid})

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()


@dataclass(frozen=True)
class _Job:
    op: str
    seq: int
    in_off: int
    nbytes: int
    dtype: object
    out_off: int
    work: Work


# ------------------------------------------------------------------------------------ blocks
class _Live:
    __slots__ = ("model", "key", "nbytes")

    def __init__(self, model, key, nbytes):
        self.model, self.key, self.nbytes = model, key, nbytes


class WindowPool:
    """This rank's window: blocks placed by the caching-allocator model, memory in shared memory.

    Owns the block table (id -> model block), the record_stream bookkeeping, and the alloc / free /
    free_done / segment events. Thread-safe: storages may die on any thread.
    """

    def __init__(self, comm: "SymmetricCommunicator", mapping: Mapping, pool: str,
                 config: AllocatorConfig | None):
        self.comm = comm
        self.mapping = mapping
        self.pool = pool
        self.recorder = comm.recorder
        self.arena = Arena(base=mapping.base, capacity=mapping.size, name=f"{comm.name}-window", comm=comm.name)
        self.allocator = CachingAllocator(config, on_segment=self._segment)
        self.allocator.create_pool(pool, segment_source=self.arena, kind="symmetric")
        self.live: dict[int, _Live] = {}
        self.by_key: dict[int, int] = {}               # storage key -> block id
        self.held: dict[int, tuple[_Live, int]] = {}    # block id -> (block, comm jobs enqueued at free)
        self.stream = getattr(mapping, "alloc_stream", HOST_STREAM)   # the stream blocks are handed to
        self._lock = threading.RLock()
        self.allocations = 0

    # ---- placement ---------------------------------------------------------------------
    def place(self, nbytes: int, op: str, shape=None, dtype=None):
        """A block of nbytes in the window, as a uint8 tensor with a storage of its own."""
        rec = self.recorder
        with self._lock:
            self._release_finished()
            try:
                model = self.allocator.malloc(nbytes, stream=self.stream, pool=self.pool)
            except OutOfMemory as exc:
                raise TestbedError(f"{exc}; create the world with a larger window_bytes") from None
            bid = rec.next_id()
            off = model.addr - self.mapping.base
            u8 = self.mapping.bytes_at(off, nbytes)
            storage = u8.untyped_storage()
            key = storage._cdata
            self.live[bid] = _Live(model, key, nbytes)
            self.by_key[key] = bid
            self.allocations += 1
            weakref.finalize(storage, self._died, bid).atexit = False   # nothing to release at exit
        if rec.active:
            ev = {"ev": "alloc", "id": bid, "addr": model.addr, "size": model.size, "requested": nbytes,
                  "stream": self.stream, "pool": self.pool, "op": op}
            if shape is not None:
                ev["shape"] = [int(s) for s in shape]
            if dtype is not None:
                ev["dtype"] = str(dtype).removeprefix("torch.")
            rec.emit(ev, site=True)
            rec.claim(storage, bid, model.addr, model.size)
        return u8

    def block_of(self, tensor) -> int | None:
        return self.by_key.get(tensor.untyped_storage()._cdata)

    def offset_of(self, bid: int) -> int:
        return self.live[bid].model.addr - self.mapping.base

    # ---- frees -------------------------------------------------------------------------
    def record_stream(self, tensor, stream: str) -> None:
        with self._lock:
            bid = self.block_of(tensor)
            if bid is None:
                raise TestbedError("record_stream: tensor is not a block of this window")
            self.allocator.record_stream(self.live[bid].model, stream)
        self.recorder.emit({"ev": "record_stream", "id": bid, "stream": stream})

    def _died(self, bid: int) -> None:
        """Storage finalizer (any thread, possibly at interpreter exit): release the block."""
        try:
            with self._lock:
                b = self.live.pop(bid, None)
                if b is None:
                    return
                if self.by_key.get(b.key) == bid:
                    del self.by_key[b.key]
                if not self.allocator.free(b.model):
                    # record_stream on the comm stream: held until the work queued so far is done
                    self.held[bid] = (b, self.comm.enqueued)
            self.recorder.emit({"ev": "free", "id": bid})
            self.recorder.unclaim(b.key)
        except Exception:   # a finalizer must not raise (interpreter shutdown, closed writer)
            pass

    def _release_finished(self) -> None:
        """process_events: blocks whose recorded comm work has finished go back to the pool."""
        if not self.held:
            return
        done = self.comm.completed
        for bid, (b, needed) in list(self.held.items()):
            if done >= needed:
                del self.held[bid]
                self.allocator.free_done(b.model)
                self.recorder.emit({"ev": "free_done", "id": bid})

    def _segment(self, seg) -> None:
        self.recorder.emit({"ev": "segment", "addr": seg.addr, "size": seg.size, "pool": seg.pool})


# ------------------------------------------------------------------------------------ scope
class WindowAllocationMode:
    """TorchDispatchMode (built lazily, torch is imported on first use) that moves every fresh
    output storage of an op into the window: the op runs as usual, then its result is copied into
    a placed block and the block is what the program gets. Views, in-place and out= results
    (storages the op was given) are left alone."""

    _cls = None

    @classmethod
    def create(cls, pool: WindowPool, scope_event: dict | None = None):
        if cls._cls is None:
            cls._cls = _build_mode_class()
        return cls._cls(pool, scope_event)


def _build_mode_class():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map

    Tensor = torch.Tensor

    class _Mode(TorchDispatchMode):
        def __init__(self, pool: WindowPool, scope_event: dict | None = None):
            super().__init__()
            self.pool = pool
            # Under capture the op's own output is a CPU allocation that capture records before
            # it is copied into the window: the scope is closed around the op in the trace, so
            # that a replay (hazsan place / sweep) places only the window block in the pool.
            rec = pool.comm.recorder
            self.rec = rec if scope_event is not None and isinstance(rec, _record.CaptureRecorder) else None
            self.scope_event = scope_event
            self.lo = pool.mapping.base
            self.hi = pool.mapping.base + pool.mapping.size
            self.device_type = getattr(pool.mapping, "device_type", "cpu")

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if self.rec is None:
                out = func(*args, **kwargs)
            else:
                self.rec.emit({**self.scope_event, "enter": False})
                try:
                    out = func(*args, **kwargs)
                finally:
                    self.rec.emit({**self.scope_event, "enter": True})
            given = set()
            for a in tree_flatten((args, kwargs))[0]:
                if isinstance(a, Tensor) and a.layout == torch.strided:
                    given.add(a.untyped_storage().data_ptr())
            moved: dict = {}
            name = str(func)

            def relocate(t):
                if not isinstance(t, Tensor) or t.layout != torch.strided or t.device.type != self.device_type:
                    return t
                s = t.untyped_storage()
                ptr, nbytes = s.data_ptr(), s.nbytes()
                if nbytes == 0 or ptr in given or self.lo <= ptr < self.hi:
                    return t
                u8 = moved.get(ptr)
                if u8 is None:
                    u8 = self.pool.place(nbytes, name, t.shape, t.dtype)
                    u8.copy_(torch.empty(0, dtype=torch.uint8, device=t.device).set_(s))
                    moved[ptr] = u8
                return u8.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())

            return tree_map(relocate, out)

    return _Mode


# ------------------------------------------------------------------------------------ comm
class SymmetricCommunicator:
    """One rank's endpoint: its window (mapped with every peer's), its pool, its comm thread.

    Create one per rank process with the WindowFiles the launcher made:

        comm = SymmetricCommunicator(files, rank, name="tp", trace_dir="traces/")
        with comm.scope():                 # fresh tensors made in here live in the window
            y = torch.empty(n, dtype=torch.bfloat16)
        work = comm.all_reduce(y)          # asynchronous; keeps no reference to y
        work.wait()                        # y now holds the sum over ranks
    """

    def __init__(self, files: WindowFiles, rank: int, *, name: str = "tp", pool: str = "symm",
                 end_barrier: bool = True, read_delay: float = 0.0, timeout: float = 120.0,
                 allocator_config: AllocatorConfig | None = None, trace_dir: str | None = None,
                 recorder: _record.Recorder | None = None):
        if not 0 <= rank < files.world_size:
            raise ValueError(f"rank {rank} outside world of {files.world_size}")
        self.files = files
        self.rank = rank
        self.world_size = files.world_size
        self.name = name
        self.end_barrier = end_barrier
        self.read_delay = float(read_delay)
        self.timeout = timeout
        self.stream = f"symm:{name}"
        self.recorder = recorder or _record.for_process(
            trace_dir, rank, files.world_size, {"testbed": "hazsan.testbed", "comm": name}, device=self.device)
        self.windows = self._open_windows(files)
        self.window = self.windows[rank]
        self.counters = Counters(Mapping(files.control_path(), self._control_bytes()), files.world_size, rank)
        self.recorder.emit({"ev": "window", "addr": self.window.base, "size": self.window.size, "comm": name})
        self.pool = WindowPool(self, self.window, pool, allocator_config or AllocatorConfig())
        self._seq = itertools.count(1)
        self.enqueued = 0        # jobs handed to the comm thread
        self.completed = 0       # jobs the comm thread finished (successfully or not)
        self.collectives = 0
        self._queue: queue.Queue = queue.Queue()
        self._failure: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"hazsan-symm-{name}-r{rank}", daemon=True)
        self._thread.start()

    # Overridden by a device backend (cuda.py): the windows, the Work class, the record device.
    work_class = Work
    device = "cpu"

    def _open_windows(self, files: WindowFiles) -> list:
        """Every rank's window mapped into this process, in rank order."""
        return [Mapping(files.window_path(q), files.window_bytes) for q in range(files.world_size)]

    def _control_bytes(self) -> int:
        from .shm import CONTROL_BYTES_PER_RANK
        return CONTROL_BYTES_PER_RANK * (self.world_size + 1)

    def step(self, n: int, phase: str | None = None, tokens: int | None = None) -> None:
        """Decode-step marker in the trace (capture's sanitizer.step when capture is on)."""
        self.recorder.step(n, phase, tokens)

    # ---- allocation ----------------------------------------------------------------------
    @contextmanager
    def scope(self, name: str = "symm"):
        """Allocations made in here (on this thread) are placed in the window."""
        rec = self.recorder
        event = {"ev": "scope", "name": name, "enter": True, "pool": self.pool.pool, "comm": self.name}
        rec.emit(event, site=True)
        mode = WindowAllocationMode.create(self.pool, event)
        mode.__enter__()
        try:
            yield self
        finally:
            mode.__exit__(None, None, None)
            rec.emit({"ev": "scope", "name": name, "enter": False, "pool": self.pool.pool, "comm": self.name})

    def empty(self, shape, dtype):
        """A window tensor (uninitialised), without a scope."""
        import torch
        shape = tuple(shape) if not isinstance(shape, int) else (shape,)
        numel = 1
        for s in shape:
            numel *= int(s)
        nbytes = numel * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return self.pool.place(nbytes, "testbed.empty", shape, dtype).view(dtype).view(shape)

    def record_stream(self, tensor) -> None:
        """tensor.record_stream(comm stream): its block is not reused before the comm work queued
        so far has finished (the placement model holds it, as the CUDA caching allocator does)."""
        self.pool.record_stream(tensor, self.stream)

    def offset(self, tensor) -> int:
        """Window offset of a tensor's first element."""
        return self._locate(tensor, "offset")[0]

    def _locate(self, tensor, what: str) -> tuple[int, int]:
        if not tensor.is_contiguous():
            raise TestbedError(f"{what}: buffer must be contiguous")
        ptr = tensor.data_ptr()
        nbytes = tensor.numel() * tensor.element_size()
        base = self.window.base
        if not (base <= ptr and ptr + nbytes <= base + self.window.size):
            raise TestbedError(f"{what}: buffer at {ptr:#x} (+{nbytes}) is not inside the window of {self.name!r}; "
                               f"allocate it inside comm.scope() or with comm.empty()")
        return ptr - base, nbytes

    # ---- collectives ---------------------------------------------------------------------
    def all_reduce(self, tensor, out=None) -> Work:
        """Sum `tensor` over ranks into `out` (default: in place). Asynchronous; the collective
        is given the buffers' window offsets only, never the tensors."""
        in_off, nbytes = self._locate(tensor, "all_reduce")
        out_off = None
        if out is not None:
            if out.dtype != tensor.dtype or out.numel() != tensor.numel():
                raise TestbedError("all_reduce: out must have the input's dtype and number of elements")
            out_off, _ = self._locate(out, "all_reduce out")
        return self.all_reduce_at(in_off, nbytes, tensor.dtype, out_off)

    def all_gather(self, tensor, out) -> Work:
        """Concatenate every rank's `tensor` into `out` (world_size times its size). Asynchronous."""
        in_off, nbytes = self._locate(tensor, "all_gather")
        out_off, out_bytes = self._locate(out, "all_gather out")
        if out.dtype != tensor.dtype or out_bytes != nbytes * self.world_size:
            raise TestbedError("all_gather: out must be world_size times the input, same dtype")
        return self.all_gather_at(in_off, nbytes, tensor.dtype, out_off)

    def all_reduce_at(self, offset: int, nbytes: int, dtype, out_offset: int | None = None) -> Work:
        """The symmetric kernel's view: sum [offset, offset+nbytes) of every rank's window, as
        `dtype`, into [out_offset, ...) of mine (default: in place)."""
        self._check_range(offset, nbytes, dtype, "all_reduce")
        base = self.window.base
        if out_offset is None or out_offset == offset:
            out_offset = offset
            bufs = [{"addr": base + offset, "size": nbytes, "access": "rw"}]
        else:
            self._check_range(out_offset, nbytes, dtype, "all_reduce out")
            if abs(out_offset - offset) < nbytes:
                raise TestbedError("all_reduce: out overlaps the input without being the same buffer")
            bufs = [{"addr": base + offset, "size": nbytes, "access": "r"},
                    {"addr": base + out_offset, "size": nbytes, "access": "w"}]
        return self._enqueue("all_reduce", offset, nbytes, dtype, out_offset, bufs)

    def all_gather_at(self, offset: int, nbytes: int, dtype, out_offset: int) -> Work:
        """Every rank's [offset, offset+nbytes) into [out_offset + q*nbytes, ...) of mine."""
        out_bytes = nbytes * self.world_size
        self._check_range(offset, nbytes, dtype, "all_gather")
        self._check_range(out_offset, out_bytes, dtype, "all_gather out")
        if offset < out_offset + out_bytes and out_offset < offset + nbytes:
            raise TestbedError("all_gather: in-place all_gather is not supported")
        base = self.window.base
        bufs = [{"addr": base + offset, "size": nbytes, "access": "r"},
                {"addr": base + out_offset, "size": out_bytes, "access": "w"}]
        return self._enqueue("all_gather", offset, nbytes, dtype, out_offset, bufs)

    def _check_range(self, offset: int, nbytes: int, dtype, what: str) -> None:
        import torch
        item = torch.empty(0, dtype=dtype).element_size()
        if offset < 0 or nbytes < 0 or offset + nbytes > self.window.size:
            raise TestbedError(f"{what}: [{offset}, {offset + nbytes}) is outside the {self.window.size}-byte window")
        if nbytes % item or offset % item:
            raise TestbedError(f"{what}: offset and size must be multiples of the {item}-byte {dtype}")

    def _enqueue(self, op, in_off, nbytes, dtype, out_off, bufs) -> Work:
        if self._closed:
            raise TestbedError(f"communicator {self.name!r} is closed")
        seq = next(self._seq)
        cid = self.recorder.next_cid()
        self.recorder.emit({"ev": "coll", "cid": cid, "comm": self.name, "seq": seq, "op": op,
                            "stream": self.stream, "bufs": bufs}, site=True)
        work = self.work_class(self, cid, seq, op)
        self.enqueued += 1
        self.collectives += 1
        self._queue.put(_Job(op, seq, in_off, nbytes, dtype, out_off, work))
        return work

    # ---- the comm thread -------------------------------------------------------------------
    def _run(self) -> None:
        import torch
        from torch.utils._python_dispatch import _disable_current_modes
        # This thread is the comm stream: its own tensors are scratch, not program allocations,
        # so no dispatch mode (hazsan capture's included) sees them, nor capture's native op
        # observer (recorder.device_work).
        with _disable_current_modes(), torch.inference_mode(), self.recorder.device_work():
            while True:
                job = self._queue.get()
                if job is None:
                    return
                try:
                    if self._failure is not None:
                        raise PeerFailure(f"an earlier collective failed: {self._failure}")
                    if job.op == "all_reduce":
                        self._all_reduce(job, torch)
                    else:
                        self._all_gather(job)
                    job.work._finish()
                except BaseException as exc:
                    if self._failure is None:
                        self._failure = exc
                        self.counters.abort()
                    job.work._finish(exc)
                finally:
                    self.completed += 1

    def _all_reduce(self, job: _Job, torch) -> None:
        what = f"all_reduce seq {job.seq}"
        self.counters.barrier(self.timeout, what)                # every input is ready
        if self.read_delay:
            time.sleep(self.read_delay)
        acc = None
        for q in range(self.world_size):                         # rank order: equal on every rank
            part = self.windows[q].view(job.in_off, job.nbytes, job.dtype).to(torch.float32, copy=True)
            acc = part if acc is None else acc.add_(part)
        if job.out_off == job.in_off:
            self.counters.barrier(self.timeout, what)            # nobody's input is overwritten early
        self.window.view(job.out_off, job.nbytes, job.dtype).copy_(acc)
        if self.end_barrier:
            self.counters.barrier(self.timeout, what)

    def _all_gather(self, job: _Job) -> None:
        what = f"all_gather seq {job.seq}"
        self.counters.barrier(self.timeout, what)
        if self.read_delay:
            time.sleep(self.read_delay)
        for q in range(self.world_size):
            src = self.windows[q].view(job.in_off, job.nbytes, job.dtype)
            self.window.view(job.out_off + q * job.nbytes, job.nbytes, job.dtype).copy_(src)
        if self.end_barrier:
            self.counters.barrier(self.timeout, what)

    # ---- lifecycle ---------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every collective queued so far (like a stream synchronize)."""
        done = threading.Event()
        deadline = time.monotonic() + self.timeout
        while self.completed < self.enqueued:
            if time.monotonic() > deadline:
                raise PeerFailure(f"{self.name!r}: collectives still running after {self.timeout} s")
            done.wait(1e-3)
        self.recorder.emit({"ev": "sync", "stream": self.stream})

    def close(self) -> None:
        """Stop the comm thread (after the queued work) and flush the trace. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(self.timeout)
        self.recorder.emit({"ev": "window_free", "addr": self.window.base, "comm": self.name})
        self.recorder.flush()
        if isinstance(self.recorder, _record.FileRecorder):
            self.recorder.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
