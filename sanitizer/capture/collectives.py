"""torch.distributed collectives: `coll` when enqueued, `coll_done` when the host observes completion.

Wrapped (in both torch.distributed and torch.distributed.distributed_c10d, so internal callers such
as all_gather_object are seen too): the functions in SPECS below. A blocking call records `coll`,
runs, then records `coll_done`. With async_op=True the returned Work is remembered; `coll_done` is
recorded when the host observes completion: Work.wait(), Work.is_completed() returning True, or
wait()/value() (or done() returning True) on the Future from Work.get_future(). A Work dropped
without any of these never gets a `coll_done` (its buffers stay in flight for the analysis).

Fields: comm = the process group's group_name (equal on all ranks); seq = per-comm counter of the
collectives this process issued on it (equal across ranks, as every rank must issue the same
collectives in the same order); stream = "<backend>:<group_name>", the process group's own worker
(gloo runs every op of a group on its worker threads; ProcessGroupGloo's barrier waits for prior
work, so treating the group as one in-order stream matches its ordering). Point-to-point ops use
comm "<group>:p2p:<lo>-<hi>" (the pair of global ranks), so their seq is equal on both ends.
Nested calls (a wrapped function calling another) record the outermost one only.

NCCL process groups: the host observing that wait() returned does not mean the collective is done.
ProcessGroupNCCL's Work.wait() (and a blocking call, which waits internally) makes the *current*
CUDA stream wait for the collective's stream and returns at once. That is recorded as what it is,
a stream-ordering edge: `record` of a synthetic event "coll<cid>" on the collective's stream, then
`wait` of the current stream on it. At enqueue, the NCCL stream likewise waits for the caller's
current stream (`record`/`wait` of "coll<cid>:in"), as ProcessGroupNCCL does before every op. Only Work.is_completed() returning True (it queries the
collective's CUDA event) is a host observation, `coll_done`. Gloo and the other CPU backends block
the host in wait(), so their wait() is `coll_done`.
"""
from __future__ import annotations

import inspect
import itertools
import threading
import time
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def _one(name, access):
    return lambda a, me: [(a.get(name), access)]


def _lst(name, access):
    return lambda a, me: [(t, access) for t in (a.get(name) or ())]


def _cat(*parts):
    return lambda a, me: [x for p in parts for x in p(a, me)]


def _rooted(tensor, root, root_access, other_access):
    def spec(a, me):
        src = a.get(root)
        if src is None:
            src = a.get("group_" + root)
        return [(a.get(tensor), root_access if src == me else other_access)]
    return spec


# name -> (buffers(bound_arguments, my_global_rank), point_to_point_peer_argument or None)
SPECS = {
    "all_reduce": (_one("tensor", "rw"), None),
    "reduce": (_one("tensor", "rw"), None),
    "broadcast": (_rooted("tensor", "src", "r", "w"), None),
    "all_gather": (_cat(_one("tensor", "r"), _lst("tensor_list", "w")), None),
    "all_gather_into_tensor": (_cat(_one("input_tensor", "r"), _one("output_tensor", "w")), None),
    "all_gather_single": (_cat(_one("input_tensor", "r"), _one("output_tensor", "w")), None),
    "reduce_scatter": (_cat(_lst("input_list", "r"), _one("output", "w")), None),
    "reduce_scatter_single": (_cat(_one("input", "r"), _one("output", "w")), None),
    "reduce_scatter_tensor": (_cat(_one("input", "r"), _one("output", "w")), None),
    "all_to_all": (_cat(_lst("input_tensor_list", "r"), _lst("output_tensor_list", "w")), None),
    "all_to_all_single": (_cat(_one("input", "r"), _one("output", "w")), None),
    "gather": (_cat(_one("tensor", "r"), _lst("gather_list", "w")), None),
    "scatter": (_cat(_lst("scatter_list", "r"), _one("tensor", "w")), None),
    "barrier": (lambda a, me: [], None),
    "send": (_one("tensor", "r"), "dst"),
    "recv": (_one("tensor", "w"), "src"),
    "isend": (_one("tensor", "r"), "dst"),
    "irecv": (_one("tensor", "w"), "src"),
}
ASYNC_ALWAYS = {"isend", "irecv"}
SETTLE_SECONDS = 0.0002


class Collectives:
    def __init__(self, capture):
        self.capture = capture
        self.emit = capture.emit
        self.seq: dict[str, int] = {}
        self.next_cid = getattr(capture, "next_cid", None) or itertools.count(1).__next__
        self.groups: dict = {}                  # ProcessGroup -> (name, stream)
        self.device_streamed: dict[int, str] = {}   # cid -> the NCCL stream of a collective not yet waited for
        self.pending: dict[int, tuple] = {}     # id(Work or Future) -> (weakref, cid)
        self.local = threading.local()

    # ------------------------------------------------------------------ naming
    def group_of(self, group):
        pg = group if group is not None else c10d._get_default_group()
        info = self.groups.get(pg)
        if info is None:
            name = getattr(pg, "group_name", None) or str(id(pg))
            try:
                backend = str(dist.get_backend(pg))
            except Exception:
                backend = "pg"
            info = self.groups[pg] = (name, f"{backend}:{name}")
        return info

    # ------------------------------------------------------------------ the wrapper
    def wrap(self, name: str, fn):
        spec, peer_arg = SPECS[name]
        sig = inspect.signature(fn)
        always_async = name in ASYNC_ALWAYS
        local = self.local

        def wrapper(*args, **kwargs):
            if getattr(local, "depth", 0):
                return fn(*args, **kwargs)
            cid = None
            try:
                cid, async_op = self._record(name, spec, peer_arg, sig, args, kwargs, always_async)
            except Exception as exc:
                self.capture.failed(f"coll.{name}", exc)
            local.depth = 1
            try:
                result = fn(*args, **kwargs)
            finally:
                local.depth = 0
            if cid is not None:
                try:
                    if async_op and result is not None:
                        self._remember(result, cid)
                    elif not async_op:
                        self.done(cid, waited=True)
                except Exception as exc:
                    self.capture.failed(f"coll.{name}", exc)
            return result

        wrapper.__wrapped__ = fn
        wrapper.__name__ = fn.__name__
        wrapper.__qualname__ = getattr(fn, "__qualname__", fn.__name__)
        wrapper.__doc__ = fn.__doc__
        wrapper._hazsan = True
        return wrapper

    def _record(self, name, spec, peer_arg, sig, args, kwargs, always_async):
        a = sig.bind(*args, **kwargs).arguments
        me = dist.get_rank()
        comm, stream = self.group_of(a.get("group"))
        if peer_arg is not None:
            peer = a.get(peer_arg)
            if peer is None:
                peer = a.get("group_" + peer_arg)
            lo, hi = sorted((me, peer if peer is not None else -1))
            comm = f"{comm}:p2p:{lo}-{hi}"
        seq = self.seq.get(comm, 0)
        self.seq[comm] = seq + 1
        bufs = []
        table = self.capture.blocks
        for t, access in spec(a, me):
            if t is None or table is None:
                continue
            r = table.buffer(t)
            if r is not None:
                bufs.append({"addr": r[0], "size": r[1], "access": access})
        cid = self.next_cid()
        if stream.startswith("nccl:"):
            # ProcessGroupNCCL's stream first waits for the caller's current stream (its inputs
            # were written there): without this edge every NCCL collective whose input a kernel
            # wrote would read as unordered.
            event, t = f"coll{cid}:in", time.time_ns()
            self.emit({"ev": "record", "event": event, "stream": _current_stream(self.capture), "t": t})
            self.emit({"ev": "wait", "event": event, "stream": stream, "t": t})
        self.capture.event({"ev": "coll", "cid": cid, "comm": comm, "seq": seq, "op": name,
                            "stream": stream, "bufs": bufs})
        if stream.startswith("nccl:"):
            self.device_streamed[cid] = stream
        return cid, always_async or bool(a.get("async_op", False))

    # ------------------------------------------------------------------ completion
    def _remember(self, handle, cid) -> None:
        key = id(handle)
        pending = self.pending

        def forget(_ref, key=key):
            entry = pending.get(key)
            if entry is not None and entry[0] is _ref:
                del pending[key]

        pending[key] = (weakref.ref(handle, forget), cid)

    def _take(self, handle):
        entry = self.pending.get(id(handle))
        if entry is None or entry[0]() is not handle:
            return None
        del self.pending[id(handle)]
        return entry[1]

    def observed(self, handle, waited: bool = True) -> None:
        """The host saw `handle` (a Work or its Future) complete (waited=True: through wait())."""
        try:
            cid = self._take(handle)
            if cid is not None:
                self.done(cid, waited)
                # The process group's worker thread drops its own reference to the Work (and so to
                # the buffers) just after marking it complete. Yield once so that it does so now:
                # otherwise a buffer the program releases right after wait() dies later, on the
                # worker, and the modelled window placement of the next block depends on timing.
                time.sleep(SETTLE_SECONDS)
        except Exception as exc:
            self.capture.failed("coll.done", exc)

    def future_of(self, work, fut) -> None:
        try:
            entry = self.pending.get(id(work))
            if entry is not None and entry[0]() is work and fut is not None:
                self._remember(fut, entry[1])
        except Exception as exc:
            self.capture.failed("coll.future", exc)

    def done(self, cid, waited: bool = False) -> None:
        nccl_stream = self.device_streamed.pop(cid, None)
        if nccl_stream is not None and waited:
            # NCCL: wait() orders the current stream after the collective; the host goes on
            event = f"coll{cid}"
            t = time.time_ns()
            self.emit({"ev": "record", "event": event, "stream": nccl_stream, "t": t})
            self.emit({"ev": "wait", "event": event, "stream": _current_stream(self.capture), "t": t})
        else:
            self.emit({"ev": "coll_done", "cid": cid, "t": time.time_ns()})
        # the same collective may be observed through its Work and its Future: once is enough
        for key, (ref, c) in list(self.pending.items()):
            if c == cid:
                self.pending.pop(key, None)


def _current_stream(capture) -> str:
    try:
        if torch.cuda.is_available():
            return capture.streams.current()
    except Exception as exc:
        capture.failed("coll.stream", exc)
    return "cuda:0"


def install(capture) -> Collectives:
    colls = Collectives(capture)
    capture.collectives = colls
    for name in SPECS:
        for module in (c10d, dist):
            fn = getattr(module, name, None)
            if fn is None or getattr(fn, "_hazsan", False):
                continue
            try:
                setattr(module, name, colls.wrap(name, fn))
            except Exception as exc:
                capture.failed(f"install.coll.{name}", exc)
    _patch_work(capture, colls)
    _patch_init(capture)
    return colls


def _patch_work(capture, colls) -> None:
    Work = torch._C._distributed_c10d.Work
    Future = torch._C.Future
    if getattr(Work.wait, "_hazsan", False):
        return
    w_wait, w_done, w_fut = Work.wait, Work.is_completed, Work.get_future
    f_wait, f_value, f_done = Future.wait, Future.value, Future.done

    def wait(self, *a, **k):
        r = w_wait(self, *a, **k)
        colls.observed(self)
        return r

    def is_completed(self):
        r = w_done(self)
        if r:
            colls.observed(self, waited=False)
        return r

    def get_future(self):
        fut = w_fut(self)
        colls.future_of(self, fut)
        return fut

    def fwait(self, *a, **k):
        r = f_wait(self, *a, **k)
        colls.observed(self)
        return r

    def fvalue(self, *a, **k):
        r = f_value(self, *a, **k)
        colls.observed(self)
        return r

    def fdone(self):
        r = f_done(self)
        if r:
            colls.observed(self, waited=False)
        return r

    for cls, name, fn, orig in ((Work, "wait", wait, w_wait), (Work, "is_completed", is_completed, w_done),
                                (Work, "get_future", get_future, w_fut), (Future, "wait", fwait, f_wait),
                                (Future, "value", fvalue, f_value), (Future, "done", fdone, f_done)):
        fn._hazsan = True
        fn.__doc__ = orig.__doc__
        fn.__name__ = name
        setattr(cls, name, fn)


def _patch_init(capture) -> None:
    for module in (c10d, dist):
        fn = getattr(module, "init_process_group", None)
        if fn is None or getattr(fn, "_hazsan", False):
            continue

        def init_process_group(*args, __fn=fn, **kwargs):
            r = __fn(*args, **kwargs)
            try:
                device = "cpu"
                if str(dist.get_backend()) == "nccl" and torch.cuda.is_available():
                    device = f"cuda:{torch.cuda.current_device()}"
                capture.writer.set_rank(dist.get_rank(), dist.get_world_size(), device)
            except Exception as exc:
                capture.failed("init_process_group", exc)
            return r

        init_process_group.__wrapped__ = fn
        init_process_group.__doc__ = fn.__doc__
        init_process_group._hazsan = True
        setattr(module, "init_process_group", init_process_group)
