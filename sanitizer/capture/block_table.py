"""The block table: live torch storages -> trace blocks, and the events an op makes of them.

The recording half of capture's memory tracking (memory.py is the interception half: the
dispatch mode that hands every op to this table).

What is recorded
  * `alloc` once per storage: the first time an op returns a tensor whose storage we do not know
    (factory functions, `torch.tensor`/`from_numpy` via `lift_fresh`, every op's fresh output). An
    op that returns a known storage (views, in-place and out= ops) records nothing, unless the
    storage was resized (its data pointer or byte size changed): then the old block is freed and
    the new one allocated.
  * tensors that reach an op or a collective without having been seen (created before capture
    started, on a thread without the mode, by C++ code that bypasses the dispatcher) are adopted
    the first time they are seen, with `op: "adopted"`.
  * nothing for a storage no allocator gave its memory (not resizable: from_blob, from_dlpack,
    frombuffer, numpy's memory): a BorrowedBlock, whose ranges are its owner's trace addresses
    when it lies in a live block (an alias), else its own (docs/capture-details.md, "Storages
    that are not allocations").
  * `free` when the storage dies: a weakref callback on the UntypedStorage. PyTorch preserves a
    storage's Python object while the C++ StorageImpl lives, so the callback fires exactly when the
    last view, autograd-saved tensor, module buffer or C++ holder (a collective's Work) lets go.

Addresses: the block is [storage.data_ptr(), +nbytes) as the real allocator placed it, except for
CPU storages allocated inside a symmetric scope: those are placed by the caching-allocator model in
the scope's window arena (window.py), and every later reference to the storage (collective buffers)
is translated into that modelled range, so the trace is self-consistent.

Launches (HAZSAN_LEVEL=full): after each op, one `launch` on the stream it ran on, with the ranges
it reads and writes, derived from the op's schema the way PyTorch's CUDA sanitizer does it
(torch/cuda/_sanitizer.py, ArgumentHandler): an argument whose alias annotation is a write
(`Tensor(a!)`: in-place, out=) is written; any other tensor argument is read, except a view's
(an alias that is not written: metadata only); a fresh result (no alias) is written. A
maybe-alias op (CompositeImplicitAutograd, seen whole where autograd is off: `to.dtype`,
`contiguous`, `reshape`) is a view or a copy by what it returned, not by its schema: a result
in a new storage was written, and the arguments it may alias read. Allocation without a kernel (empty and friends) launches nothing. On CPU the stream is `cpu`, on a GPU the
current stream of the tensor's device (streams.py names it). A thread other than the main one
has a CPU lane of its own, `cpu@<K>` (runtime.cpu_lane; docs/capture.md, "Host threads").
"""
from __future__ import annotations

import itertools
import threading
import weakref
from time import time_ns

import torch

from sanitizer.capture import cuda_state
from sanitizer.capture import runtime as _runtime
from sanitizer.capture.live_ranges import LiveRanges
from sanitizer.trace.binary import ORDER

_STRIDED = torch.strided
# The hot events are built as the binary layout's arrays (tuples), in these fields' order (a test holds
# them to binary.ORDER): [kind number, field, ...], None for an absent field.
_ALLOC, _FREE, _LAUNCH = ORDER["alloc"][0], ORDER["free"][0], ORDER["launch"][0]
ALLOC_FIELDS = ("id", "addr", "size", "stream", "pool", "requested", "segment", "token_dims", "t", "step",
                "site", "stack", "op", "shape", "dtype")
FREE_FIELDS = ("id", "t")
LAUNCH_FIELDS = ("stream", "reads", "writes", "t", "step", "site", "stack", "op")
# Plain tensors only: wrapper subclasses (DTensor, FakeTensor, ...) have no storage of their own;
# the plain tensors inside them are recorded when they are made or first used.
_CURRENT_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)   # absent on CPU builds
# The StorageImpl address of a (strided) tensor's storage, the key of BlockTable.live: one C call
# where t.untyped_storage()._cdata makes a storage object and reads an attribute of it.
_STORAGE_KEY = getattr(torch._C, "_storage_address", None) or (lambda t: t.untyped_storage()._cdata)
_PLAIN = frozenset(c for c in (torch.Tensor, torch.nn.Parameter,
                               getattr(torch.nn.parameter, "Buffer", None)) if c is not None)




class StorageBlock(weakref.ref):
    """A live storage as the trace knows it (not the engine's nor the placement model's block record).

    The block is itself the weak reference to its storage (`b()` is the storage while it lives):
    the one object per allocation capture keeps, and one shared callback (BlockTable.died, called
    with the block) instead of a partial and a bound method per storage."""

    __slots__ = ("id", "key", "real", "nbytes", "addr", "size", "model", "stream", "recorded")


class BorrowedBlock(StorageBlock):
    """A storage over bytes no allocator handed to it: made over another storage's memory (an
    alias: `torch::from_blob` as sgl_kernel's weak_ref_tensor makes it, `torch.from_dlpack`,
    `torch.frombuffer` / `torch.as_tensor` over a tensor's memory) or over memory torch's
    allocators never held (numpy's, a ctypes buffer, another process's). Not an allocation: no
    `alloc` or `free` is written for it. Its ranges are its bytes in the trace: an alias's are its
    owner's trace addresses (`addr`: the owner's, at the alias's offset, fixed when first seen),
    other memory's its own address. `id` is None. (BlockTable._new: which storages these are.)"""

    __slots__ = ()


def new_block(storage, callback, bid, key, real, nbytes, addr, size, model, stream="cpu") -> StorageBlock:
    """A StorageBlock for `storage` (callback: called with the block when the storage dies, or None)."""
    b = StorageBlock(storage, callback)
    b.id = bid
    b.key = key
    b.real = real          # storage.data_ptr() at allocation
    b.nbytes = nbytes
    b.addr = addr          # address in the trace (== real, or modelled inside a window)
    b.size = size
    b.model = model        # sanitizer.place AllocatorBlock when modelled, else None
    b.stream = stream      # the stream it was allocated on
    b.recorded = None      # streams given to record_stream (set), when any
    return b


#: Whether any thread ever went quiet (DispatchSlot.quiet: inside a collective's wait): until one
#: does, a storage's death need not read its thread's slot. Set before the first `quiet += 1`.
QUIET_ENTERED = False


#: The native recorder's per-thread quiet depth (native/native_table.py), kept equal to
#: DispatchSlot.quiet: a storage freed inside a wait is recorded as such where it dies.
NATIVE_QUIET = None


def entering_quiet() -> None:
    """Called just before a thread's `slot.quiet += 1` (leaving_quiet after its `-= 1`)."""
    global QUIET_ENTERED
    QUIET_ENTERED = True
    if NATIVE_QUIET is not None:
        NATIVE_QUIET(1)


def leaving_quiet() -> None:
    if NATIVE_QUIET is not None:
        NATIVE_QUIET(-1)


class DispatchSlot(threading.local):
    """Per thread: how deep the thread is inside a collective's own call (Work.wait, wait_tensor),
    where ops are the collective's work, not the program's launches; and the collectives a
    ProcessGroup method dispatched, for the Work it returns (collective_patches.py)."""

    def __init__(self):
        self.quiet = 0
        # blocks whose storage died on this thread inside such a wait: their `free` is written
        # once the wait has recorded the collective's completion (a Work's last reference to its
        # input goes inside wait_tensor, after the collective finished)
        self.deferred: list = []
        self.in_method = False   # inside a ProcessGroup method (collective_patches.py)
        self.in_dispatch = 0     # inside a dispatched c10d op (collectives.py)
        self.in_backend = 0      # inside a wrapped Backend method (collective_patches.py)
        self.cids: list = []     # collectives it dispatched
        self.coalesced = None    # cids since _start_coalescing, while coalescing


class BlockTable:
    """Live storages -> trace blocks. All public methods swallow and count their own errors."""

    def __init__(self, capture):
        self.capture = capture
        self.emit = capture.emit
        self.full = capture.settings.level == "full"
        self.sites = capture.sites
        self.scopes = capture.scopes
        self.live: dict[int, StorageBlock] = {}     # StorageImpl address (storage._cdata) -> Block
        self._ids = itertools.count(1)       # next() is atomic under the GIL
        self._names: dict = {}               # OpOverload -> "aten.add.Tensor"
        self._dtypes: dict = {}              # torch.float32 -> "float32"
        self.ranges = LiveRanges(self.live)  # raw pointer -> live block (NCCL's ctypes calls)
        self._stream_ids: dict = {}          # c10 current-stream tuple -> stream id
        self._plans: dict = {}               # OpOverload -> launch plan (or False: no kernel)
        self.graph_pool: str | None = None   # set by cuda_hooks while a CUDA graph is captured
        self.on_free = None                  # cuda_hooks: called with a freed block that has record_stream streams
        # cuda_hooks: its record_stream'd blocks freed and not yet free_done (non-empty: ask
        # on_reuse before a CUDA alloc), and the call that writes the free_done of those it overlaps
        self.held_frees: dict = {}
        self.on_reuse = None
        # collective_state.NcclWorkLifetimes: buffers a Work still stashes (non-empty: ask
        # on_stash_release before a free)
        self.stashed: dict = {}
        self.on_stash_release = None
        # collective_state.WorkHeldTensors: tensors of gloo collectives not yet seen complete
        # (non-empty: ask on_held_death when a storage dies, before its free)
        self.held_by_work: dict = {}
        self.on_held_death = None
        # pool name -> callable(comm, ptr, nbytes): a CUDA allocation inside a scope of that pool,
        # before its `alloc` is written (sglang_hooks: the pool segment's window, learnt early)
        self.scope_allocs: dict = {}
        # Ops the mode does not simply run and record: OpOverload -> handler (collectives.py
        # records collectives) or False, filled on an op's first sight. Emptied when the
        # collectives are installed, so no op classified before stays plain.
        self.special: dict = {}
        self.collectives = None              # collectives.DispatchedCollectives, once installed
        self.unowned: dict = {}              # collectives only C++ waits for: polled before each op
        self.slot = DispatchSlot()           # per thread: inside a collective's own call?
        self._died = self.died               # every block's weakref callback (one bound method)
        # storages that are not allocations (BorrowedBlock), by StorageImpl address: kept apart
        # from `live`, which is what the allocator handed out (raw-pointer lookups, a new
        # trace's and a forked child's live blocks)
        self.borrowed: dict[int, BorrowedBlock] = {}
        self._borrowed_died = self.borrowed_died

    def classify(self, func):
        """The handler for op func (False: an ordinary op), cached in self.special."""
        colls = self.collectives
        h = colls.handler(func) if colls is not None else False
        self.special[func] = h
        return h

    # ------------------------------------------------------------------ dispatch hot path
    def on_op(self, func, args, out, where=None) -> None:
        """alloc level: record the op's new storages (and adopt unknown inputs). `where`: the
        (site, stack) of the op when the caller already looked it up."""
        try:
            live = self.live
            plain = _PLAIN
            key_of = _STORAGE_KEY
            for a in args:
                if type(a) in plain:
                    # the storage's key first, the layout only for a storage not known: a tensor
                    # of another layout has no storage to ask for (sparse, mkldnn: it raises)
                    try:
                        k = key_of(a)
                    except Exception:
                        continue
                    if k not in live and a.layout == _STRIDED:
                        self._new(a, a.untyped_storage(), "adopted", live, False, None, k)
            t = type(out)
            if t in plain:
                self._output(out, func, live, where)
            elif t is tuple or t is list:
                for o in out:
                    if type(o) in plain:
                        self._output(o, func, live, where)
                    elif type(o) is list or type(o) is tuple:
                        for p in o:
                            if type(p) in plain:
                                self._output(p, func, live, where)
        except Exception as exc:
            self.capture.failed("dispatch", exc)

    def on_op_full(self, func, args, kwargs, out) -> None:
        """full level: as on_op, then one `launch` with the ranges the op read and wrote."""
        plan = self._plans.get(func)
        if plan is None:
            try:
                plan = self._plans[func] = _launch_plan(func)
            except Exception as exc:
                self.capture.failed("launch", exc)
                plan = self._plans[func] = False
        if plan is False:
            self.on_op(func, args, out)
            return
        try:
            where = self.sites.where()   # one lookup for the op's allocations and its launch
        except Exception as exc:         # a hook never raises into the program: no site, counted
            self.capture.failed("dispatch", exc)
            where = (None, None)
        self.on_op(func, args, out, where)
        try:
            name, reads_at, writes_at, fresh, maybe_at = plan
            reads, writes = [], []
            device = None
            n = len(args)
            written = out if fresh else None
            if maybe_at is not None and out is not None:
                # a maybe-alias op (CompositeImplicitAutograd, seen whole where autograd is off):
                # its schema's `Tensor(a)` says only that the result MAY alias (`to.dtype`,
                # `contiguous`, `reshape`); what it returned says whether it did. A result in a
                # storage of its arguments is a view (nothing read or written); any other is a copy
                # the op made: it read the arguments the result may alias, and wrote the result.
                written, views = self._made_by_op(out, args, kwargs, reads_at + writes_at + maybe_at, True)
                if views and not written and not any(
                        (args[i] if i < n else (kwargs.get(key) if kwargs else None)) is not None
                        for i, key in writes_at):
                    return
                if written:
                    reads_at = reads_at + maybe_at
            elif fresh and out is not None and self.borrowed:
                # a result made over an argument's bytes (sgl_kernel's weak_ref_tensor: from_blob
                # over its input, schema `-> Tensor`) was neither allocated nor written by the op;
                # an op whose every result is one and that writes no argument is a view op
                written, views = self._made_by_op(out, args, kwargs, reads_at + writes_at)
                if views and not written and not any(
                        (args[i] if i < n else (kwargs.get(key) if kwargs else None)) is not None
                        for i, key in writes_at):
                    return
            for i, key in reads_at:
                v = args[i] if i < n else (kwargs.get(key) if kwargs else None)
                if v is not None:
                    device = self._ranges(v, reads, device)
            for i, key in writes_at:
                v = args[i] if i < n else (kwargs.get(key) if kwargs else None)
                if v is not None:
                    device = self._ranges(v, writes, device)
            if written is not None:
                device = self._ranges(written, writes, device)
            if not reads and not writes:
                return
            stream = _runtime.cpu_lane() if device is None or device.type == "cpu" else self.stream_of_device(device)
            cap = self.capture
            if cap.host_work_unsynced and stream != "cpu":
                cap.host_ran_cpu_work()
            site, frames = where
            self.emit((_LAUNCH, stream, tuple(reads) or None, tuple(writes) or None, time_ns(), None, site,  # LAUNCH_FIELDS
                       (tuple(frames) if frames is not None else None) if site is not None else None, name))
            if stream == "cpu":
                cap.host_work_unsynced = True
        except Exception as exc:
            self.capture.failed("launch", exc)

    def _made_by_op(self, out, args, kwargs, args_at, same=False):
        """(the results of an op that it made, how many are views of its arguments `args_at`): a
        view is a BorrowedBlock storage whose first byte lies in an argument's storage, or with
        `same` (a maybe-alias op) an argument's storage itself (the native recorder's exit_op
        applies the same rules: alloc_recorder.cpp, views_an_argument)."""
        outs = [out] if type(out) in _PLAIN else [o for o in out if type(o) in _PLAIN] \
            if type(out) in (list, tuple) else []
        spans, keys = [], set()
        n = len(args)
        borrowed = self.borrowed
        for i, key in args_at:
            v = args[i] if i < n else (kwargs.get(key) if kwargs else None)
            for a in ([v] if type(v) in _PLAIN else v if type(v) in (list, tuple) else ()):
                if type(a) in _PLAIN and a.layout == _STRIDED:
                    if same:
                        keys.add(_STORAGE_KEY(a))
                    if borrowed:
                        st = a.untyped_storage()
                        if st.data_ptr():
                            spans.append((st.data_ptr(), st.data_ptr() + st.nbytes()))
        made, views = [], 0
        for o in outs:
            if o.layout != _STRIDED:
                made.append(o)
                continue
            k = _STORAGE_KEY(o)
            b = borrowed.get(k) if borrowed else None
            if k in keys or (b is not None and any(lo <= b.real < hi for lo, hi in spans)):
                views += 1
            else:
                made.append(o)
        return made, views

    def _ranges(self, v, acc, device):
        """Append the trace ranges of tensor(s) v to acc; return the device of the work (a CUDA
        device wins over cpu: a CPU scalar tensor passed to a CUDA kernel is read by the host)."""
        t = type(v)
        if t in _PLAIN or (t is not list and t is not tuple and _storage_subclass(t)):
            if v.layout != _STRIDED:
                return device
            b = self.live.get(_STORAGE_KEY(v))
            if b is None:
                b = self._new(v, v.untyped_storage(), "adopted", self.live, False)
                if b is None:
                    return device
            if v.is_contiguous():
                size = v.numel() * v.element_size()
            else:
                size = (1 + sum((n - 1) * st for n, st in zip(v.shape, v.stride()) if n > 1)) * v.element_size()
            if size:
                acc.append((b.addr + (v.data_ptr() - b.real), size))
                if device is None or device.type == "cpu":
                    device = v.device
        elif t is list or t is tuple:
            for x in v:
                if type(x) in _PLAIN:
                    device = self._ranges(x, acc, device)
        return device

    def _stream_of(self, device) -> str:
        if device is None or device.type == "cpu":
            return "cpu"
        return self.stream_of_device(device)

    def stream_of_device(self, device) -> str:
        """The id of the current stream of `device` (a CUDA torch.device)."""
        if device.type != "cuda":
            return f"{device.type}:{device.index or 0}"
        index = device.index or 0
        if not cuda_state.initialized():
            # a fake or meta "cuda" tensor before CUDA starts: asking for the stream would start it
            return f"cuda:{index}"
        if _CURRENT_STREAM is not None:
            # (c10 stream id, device, type) is cheap to get and names one cudaStream_t for the
            # process's life; the handle is looked up once per stream
            key = _CURRENT_STREAM(index)
            sid = self._stream_ids.get(key)
            if sid is None:
                handle = torch.cuda.current_stream(index).cuda_stream
                sid = self._stream_ids[key] = self.capture.streams.of_handle(handle, index)
            return sid
        return self.capture.streams.of_handle(torch.cuda.current_stream(index).cuda_stream, index)

    def _output(self, t, func, live, where=None) -> None:
        try:
            key = _STORAGE_KEY(t)
        except Exception:          # a layout without a storage (sparse, mkldnn)
            return
        b = live.get(key)
        if b is None:
            if t.layout != _STRIDED:
                return
            name = self._names.get(func)
            if name is None:
                name = self._names[func] = str(func)
            self._new(t, t.untyped_storage(), name, live, True, where, key)
            return
        s = b()                    # the block's storage object (the same StorageImpl), while it lives
        if s is None:
            s = t.untyped_storage()
        if (s.nbytes() != b.nbytes or (b.nbytes and s.data_ptr() != b.real)) and t.layout == _STRIDED:
            # resize_/set_/out= resizing: same StorageImpl, new memory
            self._release(b)
            live.pop(b.key, None)
            self._new(t, s, str(func), live, True, where)

    # ------------------------------------------------------------------ allocation
    def _new(self, t, s, opname, live, placed_by_scope=True, where=None, key=None):
        """Record a storage not seen before. Everything that can fail runs before the block is
        registered, so a failing hook never leaves a block whose free would have no alloc.

        A storage that is not resizable was not handed its memory by an allocator: torch makes
        those with a DataPtr from an allocator and resizable (at::empty, the caching allocators,
        MemPools), while `torch::from_blob` (sgl_kernel's weak_ref_tensor, `torch.from_dlpack`,
        `torch.frombuffer`, `torch.from_numpy` / `torch.as_tensor` over an array or a
        `__cuda_array_interface__`) and CUDA IPC storages are made not resizable over memory
        someone else owns. Such a storage is a BorrowedBlock, not an allocation."""
        b = self.borrowed.get(key if key is not None else s._cdata) if self.borrowed else None
        if b is not None and b() is not None:
            return b
        nbytes = s.nbytes()
        real = s.data_ptr()
        if nbytes == 0 or real == 0:       # meta tensors and empty storages hold no memory
            return None
        if not s.resizable():
            return self._borrow(s, key, real, nbytes)
        dtype = self._dtypes.get(t.dtype)
        if dtype is None:
            dtype = self._dtypes[t.dtype] = str(t.dtype).replace("torch.", "")
        site, frames = where if where is not None else self.sites.where()
        # an adopted storage existed before this moment: a scope entered now did not place it
        stack = self.scopes.stack if placed_by_scope and _runtime.SCOPES_ENTERED else None
        pool = "default"
        model = None
        addr, size = real, nbytes
        if t.is_cpu:
            stream = "cpu"
            if stack:
                pool, comm = stack[-1]
                try:
                    model = self.capture.arenas_model().malloc(pool, comm, nbytes, stream)
                    addr, size, pool = model.addr, model.size, model.pool
                except Exception as exc:   # window full: record the real placement instead
                    pool = "default"
                    self.capture.failed("window", exc)
        else:
            stream = self.stream_of_device(s.device)
            if self.held_frees:
                # the caching allocator placed this block over freed record_stream'd bytes only
                # if their events were done (malloc runs process_events first): free_done first
                self.on_reuse(real, nbytes)
            if stack:
                pool, comm = stack[-1]
                if pool in self.scope_allocs:
                    self.scope_allocs[pool](comm, real, nbytes)
            elif self.graph_pool is not None and placed_by_scope:
                pool = self.graph_pool      # inside CUDA graph capture: the graph's private pool
        if key is None:
            key = s._cdata
        bid = next(self._ids)
        # the event as the binary layout's array (ALLOC_FIELDS; None: absent): no dict to make
        # here nor to take apart at flush time (binary.source_item)
        # (a tuple of strs, ints and None: the collector untracks it at its first pass, so a
        # buffered event is never promoted to an older generation, nor makes a full collection due)
        ev = (_ALLOC, bid, addr, size, stream, pool, None if model is None else nbytes, None, None,
              time_ns(), None, site, (tuple(frames) if frames is not None else None) if site is not None else None,
              opname, tuple(t.shape), dtype)
        b = StorageBlock(s, self._died)    # new_block, inline
        b.id = bid
        b.key = key
        b.real = real
        b.nbytes = nbytes
        b.addr = addr
        b.size = size
        b.model = model
        b.stream = stream
        b.recorded = None
        # registered once written: a block whose alloc a failing emit lost must get no free
        # (it may die steps later, when emitting works again)
        try:
            self.emit(ev)
        except BaseException:
            if model is not None:
                self.capture.arenas_model().free(model)
            raise
        live[key] = b
        return b

    def _borrow(self, s, key, real, nbytes) -> BorrowedBlock:
        """The BorrowedBlock of storage s: at its owner's trace addresses when its first byte lies
        in a live block (an alias), else at its own address."""
        owner = self._holder_addr(real)
        b = BorrowedBlock(s, self._borrowed_died)
        b.id = None
        b.key = key if key is not None else s._cdata
        b.real = real
        b.nbytes = nbytes
        b.addr = real if owner is None else owner
        b.size = nbytes
        b.model = None
        b.stream = None
        b.recorded = None
        self.borrowed[b.key] = b
        return b

    def _holder_addr(self, real: int) -> int | None:
        """The trace address of host or device byte `real` in the live block that holds it, or None."""
        b = self.ranges.find(real)
        return None if b is None else b.addr + (real - b.real)

    def borrowed_died(self, b: BorrowedBlock) -> None:
        """Weakref callback of a BorrowedBlock: nothing was allocated, nothing is freed. A gloo
        Work that held it let go of it, though (WorkHeldTensors)."""
        try:
            if self.borrowed.get(b.key) is b:
                del self.borrowed[b.key]
            if self.held_by_work:
                self.on_held_death(b.addr, b.size)
        except Exception as exc:
            self.capture.failed("free", exc)

    def known(self, key) -> StorageBlock | None:
        """The block of the storage at StorageImpl address `key`: an allocation or a BorrowedBlock."""
        b = self.live.get(key)
        return b if b is not None else self.borrowed.get(key)

    def _release(self, b: StorageBlock) -> None:
        if self.stashed:
            self.on_stash_release(b.addr, b.size)
        if b.model is not None:
            self.capture.arenas_model().free(b.model)
        self.emit((_FREE, b.id, time_ns()))           # FREE_FIELDS
        if b.recorded and self.on_free is not None:
            self.on_free(b)             # its free_done comes when those streams are seen finished

    def drain_pending(self) -> None:
        """(The native table drains its recorder's records here: this table has none.)"""

    def block_of(self, t) -> StorageBlock | None:
        """The live allocation of tensor t's storage (adopting an unknown one), or None. None for a
        BorrowedBlock: record_stream on a storage the caching allocator did not make is a no-op
        there (c10/cuda/CUDACachingAllocator.cpp, recordStream: "If a tensor is not allocated by
        this instance, simply skip")."""
        if type(t) not in _PLAIN or t.layout != _STRIDED:
            return None
        s = t.untyped_storage()
        b = self.live.get(s._cdata)
        if b is None:
            b = self._new(t, s, "adopted", self.live, False)
        return None if type(b) is BorrowedBlock else b

    def died(self, b: StorageBlock) -> None:
        """Weakref callback of block b: its storage died (any thread, possibly during interpreter exit)."""
        try:
            live = self.live
            if live.get(b.key) is not b:
                return                     # already released by a resize
            del live[b.key]
            if self.held_by_work:
                self.on_held_death(b.addr, b.size)     # a Work let go of it: its coll_done first
            if QUIET_ENTERED and self.slot.quiet:
                self.slot.deferred.append(b)    # dies inside a wait: after its coll_done (see DispatchSlot)
            else:
                self._release(b)
        except Exception as exc:
            self.capture.failed("free", exc)

    def native_deferred(self) -> bool:
        """Whether frees recorded natively inside a wait may be held back (native_table.py)."""
        return False

    def launches_here(self, on: bool) -> None:
        """Whether this thread's ops are launches. The dispatch mode is per thread already: a
        thread that disables it launches nothing (the native recorder's table overrides this)."""

    def release_deferred(self) -> None:
        """Write the frees of the blocks that died inside this thread's wait, now that the wait
        recorded what it completed. Called by the waits themselves (collectives.py), once the
        thread is out of every wait."""
        slot = self.slot
        while slot.deferred and not slot.quiet:
            b = slot.deferred.pop(0)
            try:
                self._release(b)
            except Exception as exc:
                self.capture.failed("free", exc)

    # ------------------------------------------------------------------ lookups for collectives
    def buffer(self, t) -> tuple[int, int] | None:
        """The trace range [addr, size] of tensor t's elements (adopting an unknown storage)."""
        if type(t) not in _PLAIN or t.layout != _STRIDED:
            return None
        s = t.untyped_storage()
        b = self.live.get(s._cdata)
        if b is None:
            b = self._new(t, s, "adopted", self.live, False)
            if b is None:
                return None
        base = b.addr + (t.data_ptr() - s.data_ptr())
        if t.numel() == 0:
            return base, 0
        if t.is_contiguous():
            return base, t.numel() * t.element_size()
        span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()) if n > 1)
        return base, span * t.element_size()

    def resolve(self, ptr: int, nbytes: int):
        """The trace range of raw pointer range [ptr, ptr+nbytes), and whether it is host memory.

        A pointer inside a live block is translated into that block's trace addresses (a slice of a
        tensor placed in a modelled window names the modelled range); an unknown pointer (memory
        torch never saw: ncclMemAlloc buffers, other libraries) is recorded as it is."""
        b = self.ranges.find(ptr)
        if b is None:
            return ptr, nbytes, False
        s = b()
        host = s is not None and s.device.type == "cpu"
        return b.addr + (ptr - b.real), nbytes, host

    def redeclare_after_fork(self) -> None:
        """In a forked child: the inherited storages are live there too; declare them again."""
        for b in list(self.live.values()):
            self.emit({"ev": "alloc", "id": b.id, "addr": b.addr, "size": b.size, "stream": "cpu",
                       "pool": "default", "op": "inherited-by-fork", "t": time_ns()})



# Ops that hand out memory without running a kernel on it (or only bookkeep): no launch.
_NO_KERNEL = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
                        "empty_permuted", "lift_fresh", "set_", "resize_", "resize_as_",
                        "record_stream", "_local_scalar_dense_meta"})


# Collectives dispatched as ops (torch.distributed's c10d ops; functional collectives): their
# schemas carry no write annotation, and the collective hooks record them as `coll` with the
# right accesses and stream. A launch for them would be a host-stream read of a buffer the
# collective itself is using.
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional",
                                    "_c10d_functional_autograd", "symm_mem"})


_SUBCLASS_HAS_STORAGE: dict = {}


def _storage_subclass(t) -> bool:
    """A tensor subclass that is its own memory (one with only __torch_function__, as_subclass):
    an op reads and writes it like a plain tensor. A wrapper subclass (__tensor_flatten__) holds
    none of its own: its plain tensors are seen by the ops they reach."""
    known = _SUBCLASS_HAS_STORAGE.get(t)
    if known is None:
        known = _SUBCLASS_HAS_STORAGE[t] = isinstance(t, type) and issubclass(t, torch.Tensor) and \
            not hasattr(t, "__tensor_flatten__") and "__torch_dispatch__" not in t.__dict__
    return known


def _launch_plan(func):
    """(name, reads, writes, fresh, maybe) for an op, from its schema; False when it launches
    nothing.

    reads / writes: (position, name) of the tensor arguments it reads / writes; fresh: whether its
    results are new tensors (written by the op), as opposed to aliases of its arguments. maybe:
    None, or for an op whose schema cannot say (a maybe-alias op, `_composite_implicit`) the
    arguments its results may alias, read only when what it returned is a copy (on_op_full)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    namespace, _, base = schema.name.rpartition("::")
    if base in _NO_KERNEL or namespace in _COLLECTIVE_NAMESPACES:
        return False
    reads, writes, aliased = [], [], []
    for i, arg in enumerate(schema.arguments):
        if "Tensor" not in str(arg.type):
            continue
        alias = arg.alias_info
        if alias is not None and alias.is_write:
            writes.append((i, arg.name))
        elif alias is None:
            reads.append((i, arg.name))
        else:
            aliased.append((i, arg.name))   # a view's input (metadata only), unless the op copied
    returns = schema.returns
    tensors = any("Tensor" in str(r.type) for r in returns)
    fresh = bool(returns) and all(r.alias_info is None for r in returns) and tensors
    maybe = tuple(aliased) if tensors and _composite_implicit(func) else None
    if not reads and not writes and not fresh and not maybe:
        return False
    name = str(func)
    return name, tuple(reads), tuple(writes), fresh, maybe


def _composite_implicit(func) -> bool:
    """Whether op `func` is a maybe-alias op: a CompositeImplicitAutograd kernel and no kernel of
    its own (alloc_recorder.cpp's composite_implicit). Its result may or may not alias an argument
    whatever its schema says: `to.dtype(Tensor(a) self, ...) -> Tensor(a)` returns self when
    nothing changes and a copy (`_to_copy`, inside it) otherwise (native_functions.yaml: `to`,
    `contiguous`, `reshape`, `type_as`, ...); PyTorch's own AsyncCollectiveTensor stopped taking
    such an op for a view for that reason (pytorch#133421, #152534). Only ops with a kernel of
    their own are views (or fresh) by their schema. Seen whole only where autograd is off
    (inference mode, inference tensors): elsewhere autograd decomposes them above the mode."""
    try:
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        name = func.name()
        return has(name, "CompositeImplicitAutograd") and not has(name, "CPU") and \
            not has(name, "CompositeExplicitAutograd") and \
            not has(name, "CompositeExplicitAutogradNonFunctional")
    except Exception:
        return False


