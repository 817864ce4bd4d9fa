"""The block table fed by the native recorder (HAZSAN_NATIVE): records -> `alloc` and `free` events.

The recorder (alloc_recorder.cpp) buffers one record per allocation and free of torch's CPU
allocator. They become trace events here, in batches (`drain`), and always before any event capture
writes from Python (`emit` below drains first): so the trace's order is the host's, an allocation
before the scope exit or the collective that follows it, a free before the `coll` that reuses its
bytes. The writer drains too before each flush and before it says the file is complete (`quiet`).

What an event holds, against the dispatch mode's (block_table.py):
  * `alloc`: id, address, size, stream `cpu`, pool, the call site, `t` taken where it happened.
    No `op`, `shape` or `dtype` (the allocator sees bytes: docs/capture.md says so). Every
    allocation of the CPU allocator is one, torch's own scratch too (the mode saw one storage per
    op result), and those made inside a symmetric scope are placed in its modelled window, as the
    mode placed the op results (on a GPU every allocation inside a pool's scope is the pool's).
  * `free`: when the memory goes back to the allocator (the mode: when the storage object dies;
    the same moment for a CPU storage, which owns its memory).
  * A free on a thread inside a collective's wait is written after that wait records the
    collective's completion, as the mode's DispatchSlot.deferred does; a storage a gloo Work let go
    of gets its collective's `coll_done` first (WorkHeldTensors), as before.

Storages the recorder did not see (made before it was installed, or by another allocator) reach
collectives as before: adopted through the Python path (BlockTable._new), with a weakref free;
one no allocator made (not resizable) is a BorrowedBlock there, at the trace address of the
recorder's block that holds it (`_holder_addr`: its modelled address when placed in a window).
A raw pointer (NCCL's ctypes calls) is translated the same way (`resolve`).
"""
from __future__ import annotations

import contextlib
import os
import threading
from time import time_ns

from sanitizer.capture import block_table as _bt
from sanitizer.capture import runtime as _runtime
from sanitizer.capture.block_table import BlockTable
from sanitizer.capture.native import MAX_RECORDS, QUIET
from sanitizer.trace.binary.layout import ORDER

_ALLOC, _FREE = _bt._ALLOC, _bt._FREE
_COLL = ORDER["coll"][0]       # (the recorder writes 10 and 11 itself: test_native_collectives checks)


class NativeBlock:
    """A block the recorder saw allocated (BlockTable's StorageBlock fields; no storage reference)."""

    __slots__ = ("id", "key", "real", "nbytes", "addr", "size", "model", "stream", "recorded")

    def __init__(self, bid, real, nbytes, addr, size, model):
        self.id = bid
        self.key = None          # the StorageImpl address, once a collective looked it up
        self.real = real
        self.nbytes = nbytes
        self.addr = addr
        self.size = size
        self.model = model
        self.stream = "cpu"
        self.recorded = None

    def __call__(self):
        return None              # (StorageBlock: the storage object) not kept: the memory is the record


class UnownedCollectives(dict):
    """BlockTable.unowned (collectives only C++ waits for: cid -> Future) that tells the recorder
    whether it has any, so that at level full each op first polls them (alloc_recorder.cpp)."""

    def __init__(self, lib):
        super().__init__()
        self._lib = lib

    def __setitem__(self, cid, fut):
        super().__setitem__(cid, fut)
        self._lib.want_poll(True)

    def pop(self, *args):
        out = super().pop(*args)
        if not self:
            self._lib.want_poll(False)
        return out


class NativeBlockTable(BlockTable):
    """BlockTable whose allocations come from the native recorder instead of the dispatch mode."""

    def __init__(self, capture, lib):
        super().__init__(capture)
        self.lib = lib
        self.unowned = UnownedCollectives(lib)
        self.writer = capture.writer
        self._ids = iter(lib.new_id, None)         # one id sequence with the recorder's blocks
        # real address -> block object, for the recorder's blocks Python holds: named by a
        # collective (BlockTable.live has it under its storage key too) or placed in a window
        self.named: dict[int, NativeBlock] = {}
        self.scope_index: dict[tuple, int] = {}    # (pool, comm) -> the recorder's scope number
        self.scope_of: list = [None]               # number -> (pool, comm); 0: none
        self.deferred_by_thread: dict[int, list] = {}   # thread ident -> blocks freed inside its wait
        self._lock = threading.RLock()             # a drain and the event after it, whole
        self._draining = None                      # the thread inside drain() (a GC free re-enters)
        self._dropped = 0
        self._passed = 0
        self._observer_errors = 0
        self.records_seen = 0
        # the plain records stay in C++ as packed runs until the writer encodes them (binary
        # traces: their msgpack items made there; JSON Lines takes them as tuples)
        self.packed = self.writer.format == "binary" and os.environ.get("HAZSAN_NATIVE_PACKED", "1") != "0"

    # ------------------------------------------------------------------ ordering with Python's events
    def emit_after_drain(self, ev) -> None:
        """capture.emit: the recorder's pending records first, then `ev`."""
        with self._lock:
            if self.lib.pending():
                self.drain()
            self.writer.emit(ev)

    def drain_before_flush(self, timeout: float = 2.0) -> None:
        """The writer's source hook: called before each flush, outside the writer's locks."""
        if not self.lib.pending():
            return
        if self._lock.acquire(timeout=timeout):
            try:
                self.drain()
            finally:
                self._lock.release()

    @contextlib.contextmanager
    def ordered(self):
        """The recorder's pending records drained, and none drained by another thread until the
        block ends (collectives.done: a completion and the state it changes, whole)."""
        with self._lock:
            if self.lib.pending():
                self.drain()
            yield

    def pending(self) -> int:
        return self.lib.pending()

    # ------------------------------------------------------------------ the writer's idle watch
    def watch_idle(self, fd: int, look: float, idle: float) -> bool:
        """The time flush's source hook: a thread of the recorder looks every `look` s, without
        the GIL, and writes a byte to `fd` when the time flush has something to do (the last
        step ended `idle` s ago, or records wait; alloc_recorder.cpp, "the idle watch")."""
        return bool(self.lib.watch_start(fd, look, idle))

    def watch_stop(self) -> None:
        self.lib.watch_stop()

    def step_marked(self, ended: bool) -> None:
        self.lib.watch_step(ended)

    def drain_pending(self) -> None:
        """Drain what is pending now. Before a lookup in `live` by storage key: a free still
        pending leaves its block there, and a storage made since may have the dead one's
        StorageImpl address (SGLang's broadcast_pyobj: a new size tensor per call)."""
        if self.lib.pending():
            with self._lock:
                self.drain()

    def buffer(self, t):
        self.drain_pending()
        return super().buffer(t)

    def block_of(self, t):
        self.drain_pending()
        return super().block_of(t)

    def drain(self) -> None:
        """Turn the recorder's records into events (callers hold self._lock). The plain ones come
        back from C++ as the events themselves; Python handles the rest, in their place."""
        me = threading.get_ident()
        if self._draining == me:
            return        # a collection inside this drain freed an adopted storage: next time
        self._draining = me
        try:
            events, specials, dropped, passed, launched, observer_errors = \
                self.lib.drain_events(bool(self.held_by_work or self.stashed), self.packed, _runtime.MAIN_THREAD)
            if launched:
                self.capture.host_work_unsynced = True     # (BlockTable.on_op_full: a `cpu` launch)
            if observer_errors != self._observer_errors:
                self.capture.failed("native.launch_observer",
                                    RuntimeError(f"{observer_errors - self._observer_errors} op callback(s) failed, "
                                                 f"their launches not recorded; the latest: "
                                                 f"{self.lib.observer_error()[:300]}"))
                self._observer_errors = observer_errors
            if dropped != self._dropped:
                self.writer.count_drop(dropped - self._dropped, "native-buffer-full")
                self._dropped = dropped
            if passed != self._passed:
                self.capture.failed("native.unrecorded_allocation",
                                    RuntimeError(f"{passed - self._passed} allocations of an unknown shape "
                                                 f"handed out unrecorded"))
                self._passed = passed
            if not events and not specials:
                return
            writer = self.writer     # (quiet: emit_many writes a batch through, or wakes the writer)
            # specials (4, thread) say whose records follow (every batch starts with one): the
            # events are written as that thread's, whichever thread drains them
            thread = None
            cut = events.__getitem__ if type(events) is list else lambda s: events.part(s.start, s.stop)
            at, n = 0, len(events)
            for pos, rec in specials:
                if pos > at:
                    writer.emit_many(cut(slice(at, pos)), thread)
                    at = pos
                if rec[0] == 4:
                    thread = rec[1]
                else:
                    self._special(rec, thread)
            if at < n:
                writer.emit_many(events if at == 0 else cut(slice(at, n)), thread)
            self.records_seen += len(events) + len(specials)
            if self.unowned and self.collectives is not None:
                self.collectives.poll()
        except Exception as exc:
            self.capture.failed("native.drain", exc)
        finally:
            self._draining = None

    def _special(self, rec, thread) -> None:
        """A record Python handles, issued by `thread` (None: the calling one)."""
        if thread is None:
            thread = threading.get_ident()
        if rec[0] == 2:
            self._launch(rec, thread)
            return
        if rec[0] == 3:
            self._coll(rec, thread)
            return
        if rec[0] == 0:                        # an allocation inside a scope: placed in its window
            _, addr, size, site, t, scope, bid = rec
            pool, comm = self.scope_of[scope]
            model, a, s = None, addr, size
            try:
                model = self.capture.arenas_model().malloc(pool, comm, size, "cpu")
                a, s, pool = model.addr, model.size, model.pool
            except Exception as exc:           # window full: the real placement instead
                pool = "default"
                self.capture.failed("window", exc)
            self.writer.emit_on((_ALLOC, bid, a, s, "cpu", pool, None if model is None else size, None, None, t, None,
                                 site), thread)
            self.named[addr] = NativeBlock(bid, addr, size, a, s, model)
            return
        _, addr, size, tid, t, flags, bid, block_flags = rec
        b = self.named.pop(addr, None) if block_flags else None
        if b is None:
            b = NativeBlock(bid, addr, size, addr, size, None)
        if b.key is not None and self.live.get(b.key) is b:
            del self.live[b.key]
        if self.held_by_work:
            self.on_held_death(b.addr, b.size)   # a Work let go of it: its coll_done first
        if flags & QUIET:
            self.deferred_by_thread.setdefault(tid, []).append((b, t))
        else:
            self._release_native(b, t, tid)

    def _launch(self, rec, thread) -> None:
        """A launch with a range Python must translate: in a block placed in a modelled window
        (`named`, which is as it was at the launch: the specials are handled in order), or in a
        storage the recorder never saw (adopted here, as BlockTable._ranges adopts it: its tensor
        came with the record). The recorder resolved the others at the launch's place."""
        _, op, site, t, ranges = rec
        reads, writes = [], []
        for write, addr, size in self._translated(ranges, "native.launch", op, site):
            (writes if write else reads).append((addr, size))
        if reads or writes:
            # another thread's launch: on its own lane (runtime.cpu_lane)
            lane = "cpu" if thread == _runtime.MAIN_THREAD else f"cpu@{thread}"
            self.writer.emit_on((_bt._LAUNCH, lane, tuple(reads) or None, tuple(writes) or None, t, None, site,
                                 None, op), thread)

    def _coll(self, rec, thread) -> None:
        """A registered op's collective (alloc_recorder.cpp, record_coll) with a range Python must
        translate, as `_launch`; written as the recorder writes a plain one (its coll_tuple)."""
        _, cid, comm, seq, op, site, t, ranges = rec
        bufs = [[addr, size, access] for access, addr, size in self._translated(ranges, "native.coll", op, site)]
        ev = (_COLL, cid, comm, seq, op, "cpu", bufs, t) + ((None, site) if site is not None else ())
        self.writer.emit_on(ev, thread)

    def _translated(self, ranges, hook: str, op, site):
        """(access, trace address, size) of each range of a special record: one of the
        recorder's plain blocks as it is, one in a modelled window or a storage the recorder never
        saw (adopted now, with the record's call site: its tensor came with the record) translated
        into its block's addresses."""
        out = []
        for access, base, ptr, size, tensor, resolved in ranges:
            if resolved:                       # a plain block of the recorder's: its own address
                out.append((access, ptr, size))
                continue
            b = self._adopted(tensor, site) if tensor is not None else self._named_block(base)
            if b is None:
                self.capture.failed(hook, RuntimeError(f"{op}: a range in no known block"))
                continue
            out.append((access, b.addr + (ptr - b.real), size))
        return out

    def _release_native(self, b: NativeBlock, t: int, thread: int | None = None) -> None:
        if self.stashed:
            self.on_stash_release(b.addr, b.size)
        if b.model is not None:
            self.capture.arenas_model().free(b.model)
        if thread is None:
            self.writer.emit((_FREE, b.id, t))
        else:
            self.writer.emit_on((_FREE, b.id, t), thread)

    # ------------------------------------------------------------------ the Python path's lookups
    def _new(self, t, s, opname, live, placed_by_scope=True, where=None, key=None):
        """A storage a collective or an op handler names: the recorder's block for its memory when
        it has one (registered under the storage's key), else adopted as the Python path does. A
        storage that is not resizable was not made by an allocator (BlockTable._new): it is never
        the recorder's block, even over the same first byte (from_dlpack of a whole tensor), but
        a BorrowedBlock at its holder's trace addresses (_holder_addr)."""
        try:
            with self._lock:
                if self.lib.pending():
                    self.drain()
                if s.resizable():
                    b = self._named_block(s.data_ptr())
                    if b is not None and b.nbytes >= s.nbytes():
                        b.key = key if key is not None else s._cdata
                        live[b.key] = b
                        return b
        except Exception as exc:
            self.capture.failed("native.lookup", exc)
        return super()._new(t, s, opname, live, placed_by_scope, where, key)

    def _holder_addr(self, real: int) -> int | None:
        """BlockTable._holder_addr, among the recorder's blocks too: one Python holds (claimed,
        or placed in a window: its modelled address), else a plain one (its trace address is its
        own)."""
        addr = super()._holder_addr(real)
        if addr is not None:
            return addr
        found = self.lib.containing(real)
        if found is None:
            return None
        base = found[0]
        b = self.named.get(base)
        return (b.addr if b is not None else base) + (real - base)

    def resolve(self, ptr: int, nbytes: int):
        """BlockTable.resolve for the recorder's blocks: a raw pointer (NCCL's ctypes calls) inside
        one is translated as the dispatch mode translates it: a block placed in a modelled window
        names its modelled range, and the range is host memory (so the collective is on `cpu`).
        The recorder's records are drained first: the pointer's block may be pending."""
        try:
            self.drain_pending()
            b = self.ranges.find(ptr)
            if b is not None:
                s = b()
                host = type(b) is NativeBlock or (s is not None and s.device.type == "cpu")
                return b.addr + (ptr - b.real), nbytes, host
            addr = self._holder_addr(ptr)
            if addr is not None:
                return addr, nbytes, True
        except Exception as exc:
            self.capture.failed("native.lookup", exc)
        return ptr, nbytes, False

    def _adopted(self, t, site):
        """BlockTable.block_of, an adoption placed at `site` (where the op was called, not where
        its record is drained)."""
        if type(t) not in _bt._PLAIN or t.layout != _bt._STRIDED:
            return None
        s = t.untyped_storage()
        b = self.known(s._cdata)
        if b is None:
            b = self._new(t, s, "adopted", self.live, False, (site, None))
        return b

    def _named_block(self, real: int) -> NativeBlock | None:
        """The block object Python holds for the recorder's block at `real`, taken now if the
        recorder has one there (`claim`: from now on its free comes to Python), else None."""
        b = self.named.get(real)
        if b is None:
            claimed = self.lib.claim(real)
            if claimed is not None:
                bid, size, _ = claimed
                b = self.named[real] = NativeBlock(bid, real, size, real, size, None)
        return b

    def _release(self, b) -> None:
        if type(b) is NativeBlock:      # released by a resize: its memory's free is not written again
            if self.named.get(b.real) is b:
                del self.named[b.real]
            self.lib.forget(b.real)
            self._release_native(b, time_ns())
            return
        super()._release(b)

    def launches_here(self, on: bool) -> None:
        """Whether this thread's ops are launches: the recorder's op observer sees every thread,
        so a thread that disables the dispatch mode for its own work says so here."""
        self.lib.launches_on_this_thread(on)

    def native_deferred(self) -> bool:
        return True        # (which thread's, and whether any, is known only once drained)

    def release_deferred(self) -> None:
        with self._lock:
            if self.lib.pending():
                self.drain()
            if not self.slot.quiet:
                mine = self.deferred_by_thread.pop(threading.get_ident(), None)
                for b, t in mine or ():
                    try:
                        self._release_native(b, t)
                    except Exception as exc:
                        self.capture.failed("free", exc)
        super().release_deferred()

    def redeclare_after_fork(self) -> None:
        super().redeclare_after_fork()
        for addr, bid, size, _ in self.lib.alive():
            b = self.named.get(addr)
            if b is not None and b.key is not None and self.live.get(b.key) is b:
                continue                 # declared again by the Python path's loop above
            a, n = (b.addr, b.size) if b is not None else (addr, size)
            self.emit({"ev": "alloc", "id": bid, "addr": a, "size": n, "stream": "cpu",
                       "pool": "default", "op": "inherited-by-fork", "t": time_ns()})

    # ------------------------------------------------------------------ scopes
    def scope_changed(self, stack) -> None:
        """Capture entered or left a symmetric scope on this thread: tell the recorder which."""
        top = stack[-1] if stack else None
        n = 0
        if top is not None:
            n = self.scope_index.get(top)
            if n is None:
                self.scope_of.append(top)
                n = self.scope_index[top] = len(self.scope_of) - 1
        self.lib.set_scope(n)


def install(capture, lib) -> NativeBlockTable:
    """Install the recorder as capture's allocation source (no dispatch mode). Raises when the
    recorder cannot be installed: the caller falls back to the dispatch mode."""
    import os

    table = NativeBlockTable(capture, lib)
    sites = capture.sites

    def copy_rules(finder) -> None:
        lib.set_filters(list(finder.prefixes), list(finder.external), list(finder.stdlib), finder.cwd,
                        finder.mode != "none")
    copy_rules(sites)
    sites.on_change = copy_rules
    limit = MAX_RECORDS
    try:      # HAZSAN_NATIVE_MAX_RECORDS: records held between two drains before drops are counted
        limit = max(1, int(os.environ.get("HAZSAN_NATIVE_MAX_RECORDS") or MAX_RECORDS))
    except ValueError:
        pass
    if not lib.install(limit) and not lib.installed():
        raise RuntimeError("the CPU allocator could not be wrapped")
    capture.blocks = table
    capture.emit = table.emit_after_drain
    table.emit = table.emit_after_drain
    capture.writer.source = table
    capture.on_scope_change = table.scope_changed
    _bt.NATIVE_QUIET = lib.quiet_add
    from sanitizer.capture.collective_ops import PLAIN_TYPES
    lib.set_plain_types(list(PLAIN_TYPES))
    os.register_at_fork(before=lambda: table.drain_before_flush(timeout=1.0))
    if capture.settings.level == "full":
        enable_launches(table, lib)
    return table


def enable_launches(table: NativeBlockTable, lib) -> None:
    """Level full: launches from the recorder's RecordFunction observer (alloc_recorder.cpp), on
    the threads the dispatch mode would be on: this one and every Python thread started later."""
    from sanitizer.capture.memory import on_every_new_thread

    lib.enable_launches(sorted(_bt._COLLECTIVE_NAMESPACES), sorted(_bt._NO_KERNEL), _bt._LAUNCH)

    def poll() -> None:
        colls = table.collectives
        if colls is not None and table.unowned:
            colls.poll()
    lib.set_poll(poll)
    lib.launches_on_this_thread()
    on_every_new_thread(table.capture, lib.launches_on_this_thread, "new threads' ops launch nothing")
