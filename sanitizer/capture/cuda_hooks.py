"""CUDA ordering: events, waits, synchronisations, record_stream and CUDA graphs -> trace events.

What is recorded, and from where
  * `record` / `wait` (event, stream), `sync` (stream / event / device): torch.cuda._gpu_trace
    callbacks, which c10 fires from CUDAEvent::record / block, the stream and event synchronize
    calls and torch.cuda.synchronize. They carry the raw cudaEvent_t and cudaStream_t, which is what
    the trace needs (streams.py turns a handle into the process's stable stream id). This covers
    `Stream.wait_stream` and `Stream.wait_event` too: torch implements them as an event record on one
    stream and an event wait on the other.
  * `record_stream` (id, stream): a wrapper of torch.Tensor.record_stream (no callback carries the
    tensor). The block remembers the stream; when it is freed, its `free_done` is deferred.
  * `free_done` (id): the caching allocator reuses a block freed with record_stream streams once
    the events it recorded on them have completed. The host knows that at the first moment it
    observes each of those streams finished after the free: a device synchronize, a synchronize
    of that stream, or a synchronize of an event recorded on it after the free. `free_done` is
    written then (never earlier, so the analysis never assumes an order the program lacks).
    The allocator itself also observes it: DeviceCachingAllocator::malloc first runs
    process_events(), which queries those events and returns the blocks whose events are done
    to the pool (c10/cuda/CUDACachingAllocator.cpp), and it never hands out bytes of a block
    still waiting. So a CUDA allocation that overlaps such a block proves its events were done:
    its `free_done` is written just before that `alloc` (block_table.BlockTable asks `reused`).
  * `graph_begin` / `graph_end` / `graph_replay` / `graph_free`: wrappers of torch.cuda.CUDAGraph's
    capture_begin / capture_end / replay / reset (torch.cuda.graph and make_graphed_callables go
    through them), plus a finalizer for a graph object that dies without reset. Each capture gets a
    fresh id (`g<n>`); allocations during capture are recorded in the graph's pool.

Every callback and wrapper body runs under the capture's failure accounting: nothing raises into
the program, and the original torch call always runs (its exceptions are the program's own).

Installing initialises no CUDA: the _gpu_trace registries are Python lists, and
torch._C._activate_gpu_trace only sets c10's trace interpreter; the wrappers are set on classes.
The device and stream a callback names come through cuda_state.py (the current device only once
the program initialised CUDA).
"""
from __future__ import annotations

import functools
import itertools
import threading
import weakref

import torch

from sanitizer.capture import cuda_state


class CudaOrdering:
    def __init__(self, capture):
        self.capture = capture
        self.streams = capture.streams
        # reentrant: a collection inside a locked section (any allocation may start one) runs
        # finalizers on this thread, BlockTable.died -> on_free and an Event's deletion among them;
        # the sections that walk `pending` walk a copy, which such an on_free cannot change
        self._lock = threading.RLock()
        self._tick = itertools.count(1)
        self.recorded_on: dict = {}   # event handle -> (stream id, tick of the record)
        # block id -> [streams not yet seen finished, tick of the free, (start, end) of its bytes]
        self.pending: dict = {}
        self._graphs = itertools.count(1)
        # a graph's pool id (CUDAGraph.pool(), known once its capture ended) -> the pool's name in
        # the trace: `capture_begin(pool=g1.pool())` shares g1's pool, named when g1's capture
        # began, before its id could be asked
        self._pool_names: dict = {}

    # ------------------------------------------------------------------ naming
    def stream(self, handle) -> str:
        return self.streams.of_handle(handle, _current_device())

    @staticmethod
    def event_name(handle) -> str:
        return f"e{int(handle):x}"

    def stream_of_torch(self, stream) -> str:
        """Stream id of a torch.cuda.Stream, or of a generic torch.Stream of any device type."""
        if hasattr(stream, "cuda_stream"):
            return self.streams.of_torch(stream)
        dtype = getattr(stream, "device_type", None)
        if dtype == 1 and not cuda_state.initialized():
            # building the CUDA view sets the device (cudaSetDevice makes a context): without
            # CUDA initialised there is no work on any CUDA stream, name the device's
            return f"cuda:{int(getattr(stream, 'device_index', 0) or 0)}"
        if dtype == 1:   # a generic torch.Stream on CUDA: its cudaStream_t is on the CUDA view
            cs = torch.cuda.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                                   device_type=stream.device_type)
            return self.streams.of_torch(cs)
        device = getattr(stream, "device", None)
        return str(getattr(device, "type", "cpu"))

    # ------------------------------------------------------------------ _gpu_trace callbacks
    def on_event_record(self, event, stream) -> None:
        try:
            sid = self.stream(stream)
            with self._lock:
                self.recorded_on[event] = (sid, next(self._tick))
            self.capture.event({"ev": "record", "event": self.event_name(event), "stream": sid})
        except Exception as exc:
            self.capture.failed("cuda.record", exc)

    def on_event_wait(self, event, stream) -> None:
        try:
            self.capture.event({"ev": "wait", "event": self.event_name(event), "stream": self.stream(stream)})
        except Exception as exc:
            self.capture.failed("cuda.wait", exc)

    def on_event_deletion(self, event) -> None:
        try:
            with self._lock:
                self.recorded_on.pop(event, None)
        except Exception as exc:
            self.capture.failed("cuda.event_delete", exc)

    def on_stream_sync(self, stream) -> None:
        try:
            sid = self.stream(stream)
            self.capture.event({"ev": "sync", "stream": sid})
            self._finished(lambda s, tick: s == sid)
        except Exception as exc:
            self.capture.failed("cuda.sync", exc)

    def on_event_sync(self, event) -> None:
        try:
            self.capture.event({"ev": "sync", "event": self.event_name(event)})
            with self._lock:
                rec = self.recorded_on.get(event)
            if rec is not None:
                sid, at = rec
                # the event covers the work its stream had queued when it was recorded
                self._finished(lambda s, tick: s == sid and at > tick)
        except Exception as exc:
            self.capture.failed("cuda.sync", exc)

    def on_device_sync(self) -> None:
        """torch.cuda.synchronize(device) sets `device` current, then c10's device_synchronize()
        fires this callback (no device argument) and runs cudaDeviceSynchronize(): the streams of
        the current device only. A process that named streams on one device gets a bare `sync`
        (the same thing, cheaper); one with several gets a `sync` per stream of that device."""
        try:
            device = _current_device()
            if not self.streams.devices - {device}:
                self.capture.event({"ev": "sync"})
                self._finished(lambda s, tick: True)
                return
            mine = self.streams.of_device(device)
            for sid in mine:
                self.capture.event({"ev": "sync", "stream": sid})
            prefix = f"cuda:{device}:"
            self._finished(lambda s, tick: s == mine[0] or s.startswith(prefix))
        except Exception as exc:
            self.capture.failed("cuda.sync", exc)

    # ------------------------------------------------------------------ record_stream
    def on_record_stream(self, tensor, stream) -> None:
        try:
            blocks = self.capture.blocks
            b = blocks.block_of(tensor) if blocks is not None else None
            if b is None:
                return
            sid = self.stream_of_torch(stream)
            if sid == b.stream:        # the allocator ignores the block's own stream
                return
            if b.recorded is None:
                b.recorded = set()
            b.recorded.add(sid)
            self.capture.event({"ev": "record_stream", "id": b.id, "stream": sid})
        except Exception as exc:
            self.capture.failed("cuda.record_stream", exc)

    def on_free(self, block) -> None:
        """block_table.BlockTable: `block` (with record_stream streams) was just freed."""
        with self._lock:
            self.pending[block.id] = [set(block.recorded), next(self._tick),
                                      (block.real, block.real + block.nbytes)]

    def reused(self, ptr: int, nbytes: int) -> None:
        """block_table.BlockTable: a CUDA allocation at [ptr, ptr + nbytes) is about to be recorded.
        The allocator recycled every pending block it overlaps: their free_done comes first."""
        try:
            end = ptr + nbytes
            done = []
            with self._lock:
                for bid, entry in self.pending.copy().items():
                    lo, hi = entry[2]
                    if lo < end and ptr < hi:
                        del self.pending[bid]
                        done.append(bid)
            for bid in done:
                self.capture.event({"ev": "free_done", "id": bid}, with_site=False)
        except Exception as exc:
            self.capture.failed("cuda.free_done", exc)

    def _finished(self, covers) -> None:
        """Streams seen finished: covers(stream, tick_of_free) says which pending streams. Writes
        free_done for every freed block none of whose streams is left."""
        if not self.pending:
            return
        done = []
        with self._lock:
            for bid, entry in self.pending.copy().items():
                left, tick = entry[0], entry[1]
                for s in [s for s in left if covers(s, tick)]:
                    left.discard(s)
                if not left:
                    del self.pending[bid]
                    done.append(bid)
        for bid in done:
            self.capture.event({"ev": "free_done", "id": bid}, with_site=False)

    # ------------------------------------------------------------------ CUDA graphs
    def graph_begin(self, graph, pool) -> None:
        """Graphs given one pool handle get one pool name (the engine reserves per pool: graphs
        sharing one replay one at a time). A handle from torch.cuda.graph_pool_handle() is
        (0, n) and names "graph-pool:(0, n)"; one from another graph's pool() names that graph's
        pool; without one, the graph's own pool is "graph:<id>"."""
        gid = f"g{next(self._graphs)}"
        graph._hazsan_graph = gid
        if pool is not None:
            pid = _pool_id(pool)
            pool_name = self._pool_names.get(pid) or f"graph-pool:{pid}"
        else:
            pool_name = f"graph:{gid}"
        graph._hazsan_pool = pool_name
        if self.capture.blocks is not None:
            self.capture.blocks.graph_pool = pool_name
        self.capture.event({"ev": "graph_begin", "graph": gid, "stream": _current_stream(self.streams),
                            "pool": pool_name})

    def graph_end(self, graph) -> None:
        gid = getattr(graph, "_hazsan_graph", None)
        if self.capture.blocks is not None:
            self.capture.blocks.graph_pool = None
        if gid is None:
            return
        self.capture.event({"ev": "graph_end", "graph": gid, "stream": _current_stream(self.streams)})
        try:
            # CUDAGraph::pool() answers only once the capture ended (aten/src/ATen/cuda/CUDAGraph.cpp)
            pid = _pool_id(graph.pool())
        except Exception:      # no pool() (a binding without it): nothing to share by it
            pid = None
        if pid is not None:
            self._pool_names.setdefault(pid, graph._hazsan_pool)
        # a graph object that dies without reset() frees its graph (and reservation) then
        graph._hazsan_finalizer = weakref.finalize(graph, self._graph_died, gid)

    def graph_replay(self, graph) -> None:
        gid = getattr(graph, "_hazsan_graph", None)
        if gid is not None:
            self.capture.event({"ev": "graph_replay", "graph": gid, "stream": _current_stream(self.streams)})

    def graph_reset(self, graph) -> None:
        gid = getattr(graph, "_hazsan_graph", None)
        if gid is None:
            return
        fin = getattr(graph, "_hazsan_finalizer", None)
        if fin is not None:
            fin.detach()
        del graph._hazsan_graph
        self.capture.event({"ev": "graph_free", "graph": gid})

    def _graph_died(self, gid) -> None:
        try:
            self.capture.event({"ev": "graph_free", "graph": gid}, with_site=False)
        except Exception as exc:
            self.capture.failed("cuda.graph_free", exc)


def _pool_id(pool):
    """A pool handle (MempoolId_t: a tuple of two ints from torch, or a list) as a dict key."""
    return tuple(pool) if isinstance(pool, (tuple, list)) else pool


def _current_device() -> int:
    """The current CUDA device once the program initialised CUDA, else 0 (cuda_state.py: never
    initialises it)."""
    return cuda_state.current_device(0)


def _current_stream(streams) -> str:
    try:
        if cuda_state.initialized():
            return streams.current(_current_device())
    except Exception:          # no usable CUDA runtime (CPU build)
        pass
    return f"cuda:{_current_device()}"   # the device's default stream


# ---------------------------------------------------------------------- installation
def install(capture) -> CudaOrdering:
    hooks = CudaOrdering(capture)
    capture.cuda = hooks
    if capture.blocks is not None:
        capture.blocks.on_free = hooks.on_free
        capture.blocks.held_frees = hooks.pending     # the same dict: non-empty = ask `reused`
        capture.blocks.on_reuse = hooks.reused
    _register_gpu_trace(capture, hooks)
    _wrap(capture, torch.Tensor, "record_stream", lambda orig: _after(orig, hooks.on_record_stream, "record_stream"))
    graph_cls = getattr(torch.cuda, "CUDAGraph", None)
    if graph_cls is not None:
        _wrap(capture, graph_cls, "capture_begin", lambda orig: _capture_begin(orig, hooks, capture))
        _wrap(capture, graph_cls, "capture_end", lambda orig: _capture_end(orig, hooks, capture))
        for name, fn in (("replay", hooks.graph_replay),
                         ("reset", hooks.graph_reset)):
            _wrap(capture, graph_cls, name, lambda orig, fn=fn, name=name: _after_self(orig, fn, capture, name))
    return hooks


def _register_gpu_trace(capture, hooks) -> None:
    try:
        from torch.cuda import _gpu_trace as gt
        gt.register_callback_for_event_record(hooks.on_event_record)
        gt.register_callback_for_event_wait(hooks.on_event_wait)
        gt.register_callback_for_event_deletion(hooks.on_event_deletion)
        gt.register_callback_for_stream_synchronization(hooks.on_stream_sync)
        gt.register_callback_for_event_synchronization(hooks.on_event_sync)
        gt.register_callback_for_device_synchronization(hooks.on_device_sync)
        activate = getattr(torch._C, "_activate_gpu_trace", None)
        if activate is not None:
            activate()             # makes c10 call the registries above
        capture.installed.append("gpu-trace")
    except Exception as exc:
        capture.failed("install.gpu_trace", exc)


def _wrap(capture, owner, name, make) -> None:
    try:
        orig = getattr(owner, name, None)
        if orig is None or getattr(orig, "_hazsan", False):
            return
        wrapper = make(orig)
        functools.update_wrapper(wrapper, orig)
        wrapper._hazsan = True
        setattr(owner, name, wrapper)
        capture.installed.append(f"{getattr(owner, '__name__', owner)}.{name}")
    except Exception as exc:
        capture.failed(f"install.{name}", exc)


def _after(orig, record, hook):
    """Run the torch call, then record it (with the call's arguments)."""
    def wrapper(self, *args, **kwargs):
        r = orig(self, *args, **kwargs)
        record(self, *args, **kwargs)      # records guard themselves
        return r
    return wrapper


def _after_self(orig, record, capture, hook):
    def wrapper(self, *args, **kwargs):
        r = orig(self, *args, **kwargs)
        try:
            record(self)
        except Exception as exc:
            capture.failed(f"cuda.{hook}", exc)
        return r
    return wrapper


def _capture_begin(orig, hooks, capture):
    def capture_begin(self, *args, **kwargs):
        r = orig(self, *args, **kwargs)
        try:
            pool = args[0] if args else kwargs.get("pool")
            hooks.graph_begin(self, pool)
        except Exception as exc:
            capture.failed("cuda.capture_begin", exc)
        return r
    return capture_begin


def _capture_end(orig, hooks, capture):
    def capture_end(self, *args, **kwargs):
        try:
            r = orig(self, *args, **kwargs)
        except BaseException:
            # a failed capture (invalidated by an illegal call) captured nothing we can replay:
            # later allocations are no longer the graph's
            if capture.blocks is not None:
                capture.blocks.graph_pool = None
            raise
        try:
            hooks.graph_end(self)
        except Exception as exc:
            capture.failed("cuda.capture_end", exc)
        return r
    return capture_end
