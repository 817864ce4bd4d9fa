"""Collectives, seen where every caller's collectives meet: the dispatcher.

Every torch.distributed collective, whoever issues it, reaches the dispatcher as an op: the
Python functions (`dist.all_reduce`, `isend`, `batch_isend_irecv`, the object collectives) call
ProcessGroup methods, which dispatch `c10d::allreduce_` and friends; DDP's C++ reducer, FSDP2,
`torch.distributed.pipelining` and checkpointing do the same from C++ or Python; DTensor,
transformers' tensor parallelism and compiled graphs use the functional collectives
(`_c10d_functional::*`, completed by `wait_tensor`); serving engines register their own
collective ops (the CUSTOM table). The dispatch mode (memory.py) hands each of those ops to
`DispatchedCollectives.run`, which runs it and records one `coll`. Nothing in torch.distributed's
Python namespace is replaced, so every public function keeps its identity (`dist.P2POp` compares
`op` against `dist.isend`), and Dynamo traces the stock functions.

Exactly once: inside a dispatched op's own kernel the mode is off (the dispatcher pops it for the
handler), so the c10d op a functional collective issues underneath is not seen again. A Python
hook that records a collective itself (ops.py) holds `capture.collective_depth` (runtime.py):
the registered kernel it stands for (CUSTOM) stands back inside it, and the hook itself stands
back when its call went out through a collective recorded here or by the NCCL wrapper.

What a `coll` carries
  comm    the process group's `group_name` (equal on every rank); point-to-point:
          `<group>:p2p:<lo>-<hi>` over the pair of global ranks, so both ends count alike
  seq     this process's count of collectives on that comm, from 0 (every rank issues the same
          collectives on a group in the same order, so it is equal across ranks)
  stream  where the collective runs, per backend (collective_state.CompletionStreams): NCCL runs a group's
          collectives in order on one CUDA stream, `nccl:<group_name>`; gloo and the other CPU
          backends run async work on a thread pool and complete it out of order, so each Work
          in flight gets a stream of its own, `<backend>:<group_name>` or, while that one is
          busy, `<backend>:<group_name>#<n>` (reused once its Work is seen complete)
  bufs    the ranges it reads and writes after the call returns, from the op's arguments (the
          op tables, collective_ops.py); an input the backend copies inside the call
          (COPIED_AT_ENQUEUE) is
          host work of the call, not in flight
  op      the dispatcher's name, `c10d.allreduce_`, `_c10d_functional.all_gather_into_tensor`, ...

Completion, `coll_done`, is when the program synchronises with it (its wait, a barrier, a blocking
call, `is_completed()` or a Future's `done()` the program asked). What capture sees by itself (a
dropped Work found complete: WorkHeldTensors; a stash the NCCL watchdog released:
NcclWorkLifetimes) is written as an observed `coll_done` (`"observed": true`): the collective's
memory is free, but no access is ordered by it, or the verdict would depend on which finished
first in this run (docs/ordering-and-rules.md, "Observed completion"). A later wait of the program
on the same collective still writes its own `coll_done`. The program's completions:
  * a Work the Python program holds: `Work.wait()`, `Work.is_completed()` true, `wait()`/`value()`
    (or `done()` true) on its Future. Python is handed the very Work object the op returned (the
    dispatcher's ScriptObject is unboxed here, and pybind returns the existing wrapper of a C++
    object), so the Work is known by identity. A Work dropped unobserved never completes: its
    buffers stay in flight for the analysis.
  * a Work only C++ holds (DDP's reducer, `_broadcast_coalesced`: the caller is not
    torch.distributed's Python API): C++ waits on it where Python cannot look, then uses the
    buffers. Its Future is polled before every op and collective while any is pending; the first
    poll that finds it done writes `coll_done`, so the reducer's copies after its wait are ordered.
    That poll stands for the C++ caller's own wait, which is the program's (the reducer reads the
    buckets only after it), so it is not written as observed; Python never holds such a Work.
  * a functional collective: `wait_tensor` on its output (or on the in-place input).
  Ops dispatched inside `Work.wait()` (gloo's reduce_scatter copies its result out there) are the
  collective's own work: no `launch` is recorded for them. A storage that dies inside a wait
  (the Work held the last reference to a padded input) has its `free` written after the
  wait's `coll_done`: the collective had finished when the Work let go.
  * `torch.futures.wait_all` / `collect_all`: the Future they return completes when every input
    Future has; its values are new Python wrappers of the same futures, so completion is filed
    under the aggregate Future (matched by the futures it holds, not by wrapper identity).
  A collective whose kernel raises (a non-contiguous input to alltoall_base_) never ran: it is
  not recorded. The `coll` is written once the op has returned.

Backends built directly (`c10d.ProcessGroupGloo(store, rank, size, opts)`, as PyTorch's own
tests do) are Backend objects whose methods call the backend in C++ without the dispatcher ops:
their methods are wrapped too (collective_patches.py, BACKEND_METHODS) and record the same `coll`, named after the
backend (`<backend>:backend<n>`, n counting the Backends a process used, in the order it first
used them). What capture knows it cannot see is written in the header's `coverage` and
reported by `hazsan check` (collective_state.CoverageGaps).

NCCL process groups: the host observing that wait() returned does not mean the collective is done.
ProcessGroupNCCL's Work.wait() makes the *current* CUDA stream wait for the collective's stream and
returns at once. That is recorded as what it is, a stream-ordering edge: `record` of a synthetic
event "coll<cid>" on the collective's stream, then `wait` of the current stream on it. At enqueue,
the NCCL stream likewise waits for the caller's current stream (`record`/`wait` of "coll<cid>:in"),
as ProcessGroupNCCL does before every op. Only a host query that finds it complete
(`Work.is_completed()`, a Future's `done()`) is `coll_done`. Gloo and the other CPU backends block
the host in wait(), so their wait() is `coll_done`; a gloo Work's completion says nothing of
another Work's (its thread pool runs them concurrently), hence one stream per Work in flight.
"""
from __future__ import annotations

import os
import threading
import time
import weakref

import torch
import torch.distributed as dist

from sanitizer.capture.collective_ops import (
    C10D, CUSTOM, FUNCTIONAL, BACKEND_METHODS, BACKEND_KW, COLLECTIVE_NAMESPACES, NOT_COLLECTIVES,
    ROOTED, TRANSPARENT, PLAIN_TYPES, backend_arg, backend_key, bind, copied_args, current_stream,
    hook_name, p2p_comm, rank_in_options, register_collective_op, register_wrapping_op,
    tensors_in, work_in)
from sanitizer.capture.block_table import entering_quiet, leaving_quiet
from sanitizer.capture.runtime import cpu_lane
from sanitizer.capture.collective_patches import ORIGINAL, install_patches
from sanitizer.capture.collective_state import (CompletionStreams, CoverageGaps, NcclWorkLifetimes,
                                                WorkHeldTensors)

_C10D = torch._C._distributed_c10d
SETTLE_SECONDS = 0.0002
_ACCESS_CODES = {"r": 0, "w": 1, "rw": 2}

# the recorder, its installation, and the public API to extend the op tables (collective_ops.py)
__all__ = ["DispatchedCollectives", "install", "register_collective_op", "register_wrapping_op"]


class DispatchedCollectives:
    def __init__(self, capture):
        self.capture = capture
        self.emit = capture.emit
        self.seq: dict[str, int] = {}
        self._seq_lock = threading.Lock()
        self.groups: dict = {}              # ProcessGroup (pybind) or group name -> (name, stream, pg)
        self.device_streamed: dict[int, str] = {}   # cid -> NCCL stream of a collective not yet waited for
        self.pending: dict[int, tuple] = {}     # id(Work or Future) -> (weakref, cid)
        # host threads (threads.py): handles whose collectives are all done -> (weakref, cids, the
        # threads that synchronised with them); a wait on one by another thread is that thread's
        # own synchronisation, written as a `coll_done` again on it (a no-op for one that knew)
        self.finished: dict[int, tuple] = {}
        self.device_done: set = set()          # cids whose completion was a record/wait (NCCL)
        table = getattr(capture, "blocks", None)
        # cid -> Future of a Work only C++ holds (polled); per-thread state: shared with the mode
        self.unowned: dict[int, object] = table.unowned if table is not None else {}
        self.slot = table.slot if table is not None else _new_slot()
        self.functional: dict[int, tuple] = {}  # storage key of a functional result -> (cid, block id)
        self.issued_cids: set[int] = set()      # recorded, not yet done
        # seen finished by capture itself (observed coll_done), not yet synchronised with by the
        # program: its later wait still writes the program's coll_done
        self.observed_cids: set[int] = set()
        self.handlers: dict = {}                # OpOverload -> bound recorder, or False
        self.custom = dict(CUSTOM)
        self._custom_plans: dict = {}          # OpOverload -> _custom_plan(op)
        # the native recorder, which records a registered op's collective itself (record_coll)
        self.native = None
        self.nccl_works = NcclWorkLifetimes(self)   # PyTorch >= 2.8's NCCL streams and stashes
        self.streams = CompletionStreams()
        self.work_held = WorkHeldTensors(self)      # gloo: a storage its Work let go of
        self.backends: dict[int, str] = {}      # id(Backend object) -> its comm name
        gaps = getattr(capture, "coverage", None)
        self.coverage = gaps if isinstance(gaps, CoverageGaps) else CoverageGaps()

    # ------------------------------------------------------------------ which ops are collectives
    def handler(self, func):
        """The recorder for op `func`, or False (cached per OpOverload: one dict hit per op)."""
        h = self.handlers.get(func)
        if h is None:
            h = False
            try:
                ns = func.namespace
                base = func._schema.name.partition("::")[2]
                if ns == "c10d" and base in C10D:
                    h = self._c10d
                elif ns in ("_c10d_functional", "_c10d_functional_autograd") and base in FUNCTIONAL:
                    h = self._functional
                elif ns == "_c10d_functional" and base == "wait_tensor":
                    h = self._wait_tensor
                elif ns in COLLECTIVE_NAMESPACES and base not in NOT_COLLECTIVES:
                    h = self._unrecorded       # a collective op no table knows: say so
                elif func._schema.name in self.custom:
                    h = self._custom
                elif func._schema.name in TRANSPARENT:
                    h = self._transparent
            except Exception as exc:
                self.capture.failed("coll.classify", exc)
            self.handlers[func] = h
        return h

    def poll(self) -> None:
        """C++-held Works: write coll_done for those whose Future is now done."""
        try:
            done = ORIGINAL["Future.done"]     # the stock method: the patched one observes
            for cid, fut in list(self.unowned.items()):
                if done(fut):
                    if self.unowned.pop(cid, None) is not None:
                        self.done(cid, waited=True)
        except Exception as exc:
            self.capture.failed("coll.poll", exc)

    # ------------------------------------------------------------------ naming
    def group(self, pg):
        """(comm name, stream, pybind ProcessGroup) of a ProcessGroup, its ScriptObject, or a
        group name (functional collectives)."""
        info = self.groups.get(pg) if not isinstance(pg, torch.ScriptObject) else None
        if info is not None:
            return info
        key = pg
        if isinstance(pg, torch.ScriptObject):
            pg = _C10D.ProcessGroup.unbox(pg)
            info = self.groups.get(pg)
            if info is not None:
                return info
            key = pg
        elif isinstance(pg, str):
            pg = _C10D._resolve_process_group(pg)
        name = getattr(pg, "group_name", None) or str(id(pg))
        try:
            backend = str(dist.get_backend(pg))
        except Exception:
            backend = "pg"
        info = self.groups[key] = (name, f"{backend}:{name}", pg)
        return info

    def _next_seq(self, comm: str) -> int:
        with self._seq_lock:
            seq = self.seq.get(comm, 0)
            self.seq[comm] = seq + 1
        return seq

    def _bufs(self, entry, named, result=None, copied=(), tensors=None):
        """The `bufs` of a collective: each argument of the entry with its access, but those the
        backend copies inside the call (`copied`, from COPIED_AT_ENQUEUE); `tensors`, a list:
        each tensor with its range is appended to it (WorkHeldTensors)."""
        table = self.capture.blocks
        out = []
        if table is None:
            return out
        for key, access in entry.items():
            if key in ("peer", "root", "kind", "comm"):
                continue
            if key in copied:
                self._copy_read(table, named.get(key))
                continue
            value = result if key == "result" else named.get(key)
            if access == ROOTED:
                access = "r" if named.get("__is_root__") else "w"
            for t in tensors_in(value):
                r = table.buffer(t)
                if r is not None:
                    out.append({"addr": r[0], "size": r[1], "access": access})
                    if tensors is not None:
                        tensors.append((t, r))
        return out

    def _copy_read(self, table, value) -> None:
        """An input the backend copied inside the call was read then, on the calling thread: at
        level full, a `launch` on `cpu` that reads it (op "backend input copy"), so that a write
        still pending on it (the output of a collective not yet waited, pytorch#116122) is an
        unordered access. After the call nothing reads it: it is not one of the `bufs`."""
        if not table.full:
            return
        reads = []
        for t in tensors_in(value):
            r = table.buffer(t)
            if r is not None and r[1]:
                reads.append([r[0], r[1]])
        if not reads:
            return
        lane = cpu_lane()
        ev = {"ev": "launch", "stream": lane, "op": "backend input copy", "reads": reads,
              "t": time.time_ns()}
        site, frames = self.capture.sites.where()
        if site is not None:
            ev["site"] = site
            if frames is not None:
                ev["stack"] = frames
        self.emit(ev)
        if lane == "cpu":
            self.capture.host_work_unsynced = True

    def _record(self, op, comm, stream, bufs, by_backend: bool = True, tensors=(), cid=None, seq=None) -> int:
        """Write one `coll`; by_backend: the stream is a process group's, ordered as its backend
        orders Works (CompletionStreams), not a stream the op runs on directly; `tensors`: the
        tensors of `bufs` with their ranges (_bufs); `cid`, `seq`: taken already."""
        cap = self.capture
        if cid is None:
            cid = cap.next_cid()
        self.issued_cids.add(cid)
        if seq is None:
            seq = self._next_seq(comm)
        if by_backend:
            stream = self.streams.stream_for(stream, cid, op)
        try:
            if stream.startswith("nccl:"):
                # ProcessGroupNCCL's stream first waits for the caller's current stream (its
                # inputs were written there): without this edge every NCCL collective whose input
                # a kernel wrote would read as unordered.
                event, t = f"coll{cid}:in", time.time_ns()
                self.emit({"ev": "record", "event": event, "stream": current_stream(cap), "t": t})
                self.emit({"ev": "wait", "event": event, "stream": stream, "t": t})
                self.device_streamed[cid] = stream
                self.nccl_works.stashed(cid, bufs)
            cap.event({"ev": "coll", "cid": cid, "comm": comm, "seq": seq, "op": op,
                       "stream": stream, "bufs": bufs})
            if by_backend:
                self.work_held.recorded(cid, stream, tensors)
        except BaseException:
            # not written: nothing may complete it later (a barrier completes what is in flight)
            self.issued_cids.discard(cid)
            self.device_streamed.pop(cid, None)
            self.streams.complete(cid)
            raise
        return cid

    # ------------------------------------------------------------------ c10d::*
    def _c10d(self, func, args, kwargs, mode=None):
        # The op runs first: one whose kernel raises (alltoall_base_ on a non-contiguous input:
        # "Tensors must be contiguous") never ran, and is not recorded.
        self.slot.in_dispatch += 1          # a Backend method called back from Python inside
        try:
            out = func(*args, **kwargs)
        finally:
            self.slot.in_dispatch -= 1
        cid = None
        try:
            named = bind(func, args, kwargs)
            entry = C10D[func._schema.name.partition("::")[2]]
            self.poll()
            comm, stream, pg = self.group(named.get("process_group"))
            group_stream = stream
            stream = self.nccl_works.stream(stream, named)
            if "root" in entry:
                named["__is_root__"] = named.get(entry["root"]) == pg.rank()
            if "peer" in entry:
                comm = p2p_comm(comm, pg, named.get(entry["peer"]) if entry["peer"] else None)
            op = f"c10d.{func._schema.name[6:]}"
            tensors: list = []
            bufs = self._bufs(entry, named, copied=copied_args(stream, op), tensors=tensors)
            # a collective on the caller's current stream (NCCL, async_op=False) runs in that
            # stream's order: no lane of its group
            cid = self._record(op, comm, stream, bufs, by_backend=stream == group_stream,
                               tensors=tensors)
            if stream != group_stream:
                self.nccl_works.current.add(cid)
        except Exception as exc:
            self.capture.failed(hook_name(func), exc)
        if cid is not None:
            try:
                work = work_in(out)
                slot = self.slot
                if work is None:                 # blocking op (monitored_barrier): done on return
                    self.done(cid, waited=True)
                elif slot.in_method:
                    # called through a ProcessGroup method: Python gets the Work from it, and
                    # the method's wrapper files it under this cid (no reference kept here)
                    slot.cids.append(cid)
                else:
                    # C++ keeps this Work and waits where Python cannot see: poll its Future
                    fut = ORIGINAL["Work.get_future"](_C10D.Work.unbox(work))
                    if fut is not None:
                        self.unowned[cid] = fut
            except Exception as exc:
                self.capture.failed(hook_name(func), exc)
        return out

    # ------------------------------------------------------------------ _c10d_functional::*
    def _functional(self, func, args, kwargs, mode=None):
        out = func(*args, **kwargs)
        try:
            named = bind(func, args, kwargs)
            base = func._schema.name.partition("::")[2]
            entry = FUNCTIONAL[base]
            self.poll()
            comm, stream, pg = self.group(named.get("group_name"))
            if "peer" in entry:
                comm = p2p_comm(comm, pg, named.get(entry["peer"]))
            table = self.capture.blocks
            if table is not None:       # the fresh result, before the coll that names it
                table.on_op(func, args, out)
            op = f"{func.namespace}.{base}"
            tensors: list = []
            bufs = self._bufs(entry, named, out, copied=copied_args(stream, op), tensors=tensors)
            cid = self._record(op, comm, stream, bufs, tensors=tensors)
            # wait_tensor names the result (for in-place forms, the input it returns)
            live = table.live if table is not None else {}
            for t in tensors_in(out):
                key = t.untyped_storage()._cdata
                b = live.get(key)
                self.functional[key] = (cid, b.id if b is not None else None)
        except Exception as exc:
            self.capture.failed(hook_name(func), exc)
        return out

    def _wait_tensor(self, func, args, kwargs, mode=None):
        # quiet until the completion is written: a storage the Work lets go of inside the wait
        # (its last reference to a padded input) is freed after the coll_done (block_table.py)
        entering_quiet()
        self.slot.quiet += 1
        try:
            out = func(*args, **kwargs)
            self._waited_tensor(args, kwargs)
        finally:
            self.slot.quiet -= 1
            leaving_quiet()
            self._release_deferred()
        return out

    def _release_deferred(self) -> None:
        """The frees held back while this thread was inside a wait (block_table.py), once it is out."""
        try:
            table = self.capture.blocks
            if table is not None and not self.slot.quiet and (self.slot.deferred or table.native_deferred()):
                table.release_deferred()
        except Exception as exc:
            self.capture.failed("free", exc)

    def _waited_tensor(self, args, kwargs) -> None:
        try:
            self.waited(args[0] if args else kwargs.get("tensor"))
        except Exception as exc:
            self.capture.failed("coll.wait_tensor", exc)

    def _unrecorded(self, func, args, kwargs, mode=None):
        """A c10d or functional collective op that none of the tables describes (a newer torch):
        run it, and count it in the header's coverage, as capture cannot say what it touches."""
        try:
            self.coverage.count(hook_name(func)[5:])
        except Exception as exc:
            self.capture.failed(hook_name(func), exc)
        out = func(*args, **kwargs)
        table = self.capture.blocks
        if table is not None:
            table.on_op(func, args, out)
        return out

    def waited(self, t) -> None:
        """`t`, a functional collective's result, was waited on: its collective is done (once:
        a tensor already waited on names no collective any more)."""
        if type(t) in PLAIN_TYPES:
            key = t.untyped_storage()._cdata
            entry = self.functional.pop(key, None)
            table = self.capture.blocks
            b = table.live.get(key) if table is not None else None
            # the storage still the one the collective wrote (not a later one at that address)
            if entry is not None and (entry[1] is None or (b is not None and b.id == entry[1])):
                cid = entry[0]
                # every other tensor of the same (coalesced) collective is complete too
                for k in [k for k, e in self.functional.items() if e[0] == cid]:
                    del self.functional[k]
                if cid in self.issued_cids or cid in self.observed_cids:   # (not waited already)
                    self.done(cid, waited=True)

    # ------------------------------------------------------------------ ops that wrap collectives
    def _transparent(self, func, args, kwargs, mode=None):
        """Run an op whose own kernel issues the collectives (vLLM's `vllm::all_reduce` on
        GPUs) with the mode on inside it: the kernel is called for its backend directly (not
        through the dispatcher again, which would come back here), so the collectives, pynccl
        calls and allocations inside are recorded as if the program had called them."""
        key = None
        try:
            if mode is not None:
                key = backend_key(func, args, kwargs)
        except Exception as exc:
            self.capture.failed(hook_name(func), exc)
        if key is None:
            return func(*args, **kwargs)
        with mode:
            return func._op_dk(key, *args, **kwargs)

    # ------------------------------------------------------------------ registered custom ops
    def _custom(self, func, args, kwargs, mode=None):
        try:
            inside = self.capture.collective_depth.depth
        except Exception:
            inside = 0
        out = func(*args, **kwargs)
        if inside:
            return out                       # a Python-level hook (ops.py) records this call itself
        try:
            if self.unowned:
                self.poll()
            plan = self._custom_plans.get(func)
            if plan is None:                 # what the schema and the table say, once per op
                plan = self._custom_plans[func] = self._custom_plan(func)
            positional, defaults, comm_arg, kind, label, tensors, result_access, codes = plan
            named = dict(zip(positional, args))
            if kwargs:
                named.update(kwargs)
            ident = None
            if comm_arg is not None:
                ident = named[comm_arg] if comm_arg in named else defaults.get(comm_arg)
            comm = f"{kind}:{ident}" if ident is not None else f"{kind}:{func._schema.name}"
            native = self.native
            cid = seq = None
            if native is not None and codes is not None:
                # the recorder writes the `coll` and its `coll_done` in order with its records,
                # the buffers resolved there (host tensors only: else False, and Python records it)
                values = [named[name] if name in named else defaults.get(name) for name, _ in tensors]
                values.append(out)
                cap = self.capture
                cid, seq = cap.next_cid(), self._next_seq(comm)
                if native.record_coll(cid, comm, seq, label, values, codes, True):
                    cap.collective_depth.recorded += 1
                    return out
            table = self.capture.blocks
            if table is not None:
                table.on_op(func, args, out)
            bufs = []
            for name, access in tensors:
                value = named[name] if name in named else defaults.get(name)
                if value is not None:
                    bufs.extend(self._ranges(value, access))
            bufs.extend(self._ranges(out, result_access))
            host = True
            for b in bufs:
                host = b.pop("_cpu") and host
            stream = "cpu" if host else current_stream(self.capture)
            cid = self._record(label, comm, stream, bufs, by_backend=False, cid=cid, seq=seq)
            self.done(cid, waited=True)    # returned: done for the host (CPU) / ordered on the stream
        except Exception as exc:
            self.capture.failed(hook_name(func), exc)
        return out

    def _custom_plan(self, func) -> tuple:
        """(argument names in order, schema defaults, the argument naming the communicator, the
        comm's kind, the op's name in the trace, [(tensor argument, access)], the result's access)
        of a registered custom collective op (collective_ops.CUSTOM, register_collective_op)."""
        schema = func._schema
        entry = self.custom[schema.name]
        arguments = schema.arguments
        defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}
        tensors = [(a.name, entry.get(a.name, "rw" if a.alias_info is not None and a.alias_info.is_write
                                      else "r"))
                   for a in arguments if "Tensor" in str(a.type)]
        result = entry.get("result", "w")
        # the accesses as the native recorder's codes (record_coll): the arguments', then the result's
        # (None: an access the recorder has no code for, recorded by Python as given)
        codes = [_ACCESS_CODES.get(access) for _, access in tensors] + [_ACCESS_CODES.get(result)]
        if None in codes:
            codes = None
        return ([a.name for a in arguments], defaults, entry.get("comm") or None,
                entry.get("kind", func.namespace), f"{func.namespace}.{schema.name.partition('::')[2]}",
                tensors, result, codes)

    def _ranges(self, value, access):
        table = self.capture.blocks
        out = []
        for t in tensors_in(value):
            r = table.buffer(t) if table is not None else None
            if r is not None:
                out.append({"addr": r[0], "size": r[1], "access": access, "_cpu": t.is_cpu})
        return out

    # ------------------------------------------------------------------ completion
    def issued_by_method(self, name, work, cids) -> None:
        """A ProcessGroup method returned `work` for the collectives `cids` it dispatched;
        `_end_coalescing`'s Work completes every collective issued since `_start_coalescing`."""
        try:
            slot = self.slot
            if name == "_start_coalescing":
                slot.coalesced = []
                return
            if name == "_end_coalescing":
                cids = cids + (slot.coalesced or [])
                slot.coalesced = None
            elif slot.coalesced is not None:
                slot.coalesced.extend(cids)
            if not cids:
                return
            if work is None:                        # nothing to wait on: done on return
                for cid in cids:
                    self.done(cid, waited=True)
            else:
                self._remember(work, cids)
        except Exception as exc:
            self.capture.failed(f"coll.{name}", exc)

    def _remember(self, handle, cid) -> None:
        key = id(handle)
        pending, finished = self.pending, self.finished

        def forget(_ref, key=key):
            entry = pending.get(key)
            if entry is not None and entry[0] is _ref:
                del pending[key]
            entry = finished.get(key)
            if entry is not None and entry[0] is _ref:
                del finished[key]

        pending[key] = (weakref.ref(handle, forget), list(cid) if isinstance(cid, list) else [cid])

    def _take(self, handle):
        entry = self.pending.get(id(handle))
        if entry is None or entry[0]() is not handle:
            return None
        del self.pending[id(handle)]
        self.finished[id(handle)] = (entry[0], entry[1], {threading.get_ident()})
        return entry[1]

    def cids_of(self, handle) -> list | None:
        """The collectives filed under `handle` (a Work or Future), done or not; None: none."""
        for table in (self.pending, self.finished):
            entry = table.get(id(handle))
            if entry is not None and entry[0]() is handle:
                return entry[1]
        return None

    def learnt(self, cids) -> None:
        """The calling thread synchronised with collectives `cids` (a Future's callback runs
        after its completion: threads.py): their `coll_done` on it, the first one or again."""
        try:
            again = []
            for cid in cids:
                if cid in self.issued_cids or cid in self.observed_cids:
                    self.done(cid, waited=True)
                elif cid not in self.device_done:
                    again.append(cid)
            for cid in again:
                self.emit({"ev": "coll_done", "cid": cid, "t": time.time_ns()})
        except Exception as exc:
            self.capture.failed("coll.done", exc)

    def _again(self, handle) -> None:
        """Another thread waited on a handle whose collectives are done: its own `coll_done`
        (docs/capture.md, "Host threads"); nothing for the thread that already synchronised."""
        entry = self.finished.get(id(handle))
        if entry is None or entry[0]() is not handle:
            return
        me = threading.get_ident()
        if me in entry[2]:
            return
        entry[2].add(me)
        for cid in entry[1]:
            if cid not in self.issued_cids and cid not in self.observed_cids and cid not in self.device_done:
                self.emit({"ev": "coll_done", "cid": cid, "t": time.time_ns()})

    def observed(self, handle, waited: bool = True, settle: bool = True,
                 future_done: bool = False) -> None:
        """The host saw `handle` (a Work or its Future) complete (waited=True: through wait()).
        settle=False: a blocking call of the Python API waited for its own Work, whose buffers
        the caller still holds (nothing to let the worker release first).
        future_done: a Future's done() returned True. ProcessGroupNCCL marks its Work's Future
        completed at enqueue (ProcessGroupNCCL.cpp, collective(): `work->future_->markCompleted(
        at::IValue(*work->outputs_))`, a CUDA Future whose completion is events on the NCCL
        stream), so for a collective on a device stream done() proves nothing on the host: it is
        not an observation (its wait()/value() still orders the current stream after it)."""
        try:
            if future_done:
                entry = self.pending.get(id(handle))
                if entry is not None and entry[0]() is handle and \
                        any(c in self.device_streamed for c in entry[1]):
                    return
            cids = self._take(handle)
            if cids is not None:
                for cid in cids:
                    if cid in self.issued_cids or cid in self.observed_cids:
                        self.done(cid, waited)
                # The process group's worker thread drops its own reference to the Work (and so to
                # the buffers) just after marking it complete. Yield once so that it does so now:
                # otherwise a buffer the program releases right after wait() dies later, on the
                # worker, and the modelled window placement of the next block depends on timing.
                if settle:
                    time.sleep(SETTLE_SECONDS)
            elif self.finished:
                self._again(handle)
            if self.unowned:
                self.poll()
        except Exception as exc:
            self.capture.failed("coll.done", exc)

    def handed_to_cpp(self, fut) -> None:
        """A Future Python got from a collective goes to C++, which waits on it where Python
        cannot look (a DDP communication hook's result): poll it from now on, as for a Work
        only C++ ever held. The Future is kept until it is seen done (C++ holds it anyway)."""
        try:
            cids = self._take(fut)
            for cid in cids or ():
                if cid in self.issued_cids or cid in self.observed_cids:
                    self.unowned[cid] = fut
        except Exception as exc:
            self.capture.failed("coll.handed_to_cpp", exc)

    def future_of(self, work, fut) -> None:
        try:
            entry = self.pending.get(id(work))
            if entry is not None and entry[0]() is work and fut is not None:
                self._remember(fut, entry[1])
        except Exception as exc:
            self.capture.failed("coll.future", exc)

    def done(self, cid, waited: bool = False, observed: bool = False) -> None:
        """Collective `cid` completed. observed=True: capture saw it finish (a dropped Work found
        complete), the program did not synchronise with it: an observed `coll_done`, which frees
        its memory for the analysis and orders nothing (docs/ordering-and-rules.md, "Observed
        completion"). Otherwise the program's own synchronisation: a wait, a blocking call, a
        barrier, `is_completed()` or a Future's `done()` that the program asked."""
        ordered = getattr(getattr(self.capture, "blocks", None), "ordered", None)
        if ordered is None:
            self._done_with_prior(cid, waited, observed)
            return
        # the native recorder's records made before this completion was seen are events before
        # it: a free among them is interpreted with the collective still in flight
        # (WorkHeldTensors), as the dispatch mode's finalizer ran at the death itself
        with ordered():
            self._done_with_prior(cid, waited, observed)

    def _done_with_prior(self, cid, waited: bool, observed: bool = False) -> None:
        # a gloo barrier has waited for every collective of its group enqueued before it (the
        # program's barrier: those it completes are synchronised with, observed or not before)
        prior = self.streams.completed_with(cid) if not observed else ()
        self._done(cid, waited, observed)
        for c in prior:
            if c in self.issued_cids or c in self.observed_cids:
                self._done(c, waited)

    def _done(self, cid, waited: bool = False, observed: bool = False) -> None:
        if observed:
            self._observed_done(cid)
            return
        self.issued_cids.discard(cid)
        self.observed_cids.discard(cid)
        self.work_held.finished(cid)
        if not self.nccl_works.finished(cid):     # a current-stream collective: nothing to write
            nccl_stream = self.device_streamed.pop(cid, None)
            if nccl_stream is not None and waited:
                # NCCL: wait() orders the current stream after the collective; the host goes on
                event = f"coll{cid}"
                t = time.time_ns()
                self.emit({"ev": "record", "event": event, "stream": nccl_stream, "t": t})
                self.emit({"ev": "wait", "event": event, "stream": current_stream(self.capture), "t": t})
                if len(self.device_done) > 65536:
                    self.device_done.clear()
                self.device_done.add(cid)
            else:
                self.emit({"ev": "coll_done", "cid": cid, "t": time.time_ns()})
        # its stream may take the next Work once the completion is written, not before
        self.streams.complete(cid)
        # the same collective may be observed through its Work and its Future: once is enough
        # (issued_cids); pending entries whose collectives are all done go
        me = threading.get_ident()
        for key, (ref, cids) in list(self.pending.items()):
            if cid in cids and not any(c in self.issued_cids or c in self.observed_cids for c in cids):
                if self.pending.pop(key, None) is not None:
                    self.finished[key] = (ref, cids, {me})

    def _observed_done(self, cid) -> None:
        """Capture itself saw `cid` finish: write `coll_done` with `observed`. The collective keeps
        what the program's own completion would release: its lane (a later Work there, waited,
        would otherwise order this one after it: an edge only the timing of this run made), its
        NCCL stream's pending wait edge, and the handles filed under it, so that a wait the
        program makes later still writes its `coll_done`."""
        if cid not in self.issued_cids or cid in self.nccl_works.current:
            return
        self.issued_cids.discard(cid)
        self.observed_cids.add(cid)
        self.work_held.finished(cid)
        self.nccl_works.ranges.pop(cid, None)
        self.emit({"ev": "coll_done", "cid": cid, "observed": True, "t": time.time_ns()})

    # ------------------------------------------------------------------ Backend objects
    def backend_comm(self, backend) -> str:
        """The comm name of a Backend object used directly: `backend<n>`, n counting the Backends
        this process used in the order it first used them (equal on every rank that builds and
        uses its backends in the same order, as the programs that do this are written)."""
        key = id(backend)
        name = self.backends.get(key)
        if name is None:
            name = self.backends[key] = f"backend{len(self.backends)}"
        return name

    def backend_call(self, name, backend, args, kwargs, work) -> None:
        """Backend method `name` returned `work` (None: a blocking one returned): record its
        collective and file the Work under it, as for a ProcessGroup method."""
        spec = BACKEND_METHODS[name]
        self.poll()
        comm = self.backend_comm(backend)
        try:
            kind = str(backend._get_backend_name())
        except Exception:
            kind = "backend"
        stream = f"{kind}:{comm}"
        rank = backend.rank()
        values = list(args[:len(spec["args"])])
        values += [None] * (len(spec["args"]) - len(values))
        for k, v in kwargs.items():
            pos = BACKEND_KW.get(k)
            if pos is not None and pos < len(values):
                values[pos] = v
        entry, named = {}, {}
        for (key, access), value in zip(spec["args"], values):
            if access == ROOTED:
                root = backend_arg(args, kwargs, spec.get("root"))
                access = "r" if (root if root is not None else rank_in_options(args)) == rank else "w"
            entry[key], named[key] = access, value
        if "peer" in spec:
            peer = backend_arg(args, kwargs, spec["peer"])
            if peer is None:
                comm = f"{comm}:p2p:any"
            else:
                lo, hi = sorted((rank, peer))
                comm = f"{comm}:p2p:{lo}-{hi}"
        op = f"Backend.{name}"
        tensors: list = []
        bufs = self._bufs(entry, named, copied=copied_args(stream, op), tensors=tensors)
        cid = self._record(op, comm, stream, bufs, tensors=tensors)
        if work is None:                             # a blocking method: done on return
            self.done(cid, waited=True)
        else:
            self._remember(work, [cid])

    # ------------------------------------------------------------------ futures through wrappers
    def collected(self, futures, aggregate) -> None:
        """`torch._C._collect_all(futures)` returned `aggregate`, which completes when all of
        them have; its value holds new Python wrappers of the same futures, which nothing here
        can know by identity. File the collectives of every input future under the aggregate."""
        try:
            cids: list = []
            for fut in futures:
                entry = self.pending.get(id(fut))
                if entry is not None and entry[0]() is fut:
                    cids.extend(c for c in entry[1] if c not in cids)
            if cids and aggregate is not None:
                self._remember(aggregate, cids)
        except Exception as exc:
            self.capture.failed("coll.collect_all", exc)



def _new_slot():
    from sanitizer.capture.block_table import DispatchSlot
    return DispatchSlot()


def install(capture) -> DispatchedCollectives:
    colls = DispatchedCollectives(capture)
    capture.collectives = colls
    capture.coverage = colls.coverage        # the header's `coverage` (facts.py)
    table = capture.blocks
    if table is not None:
        table.collectives = colls
        lib = getattr(table, "lib", None)
        if lib is not None and hasattr(lib, "record_coll") and \
                os.environ.get("HAZSAN_NATIVE_COLLECTIVES", "1").strip() != "0":
            colls.native = lib
        table.special.clear()        # ops seen before: classify again, now knowing collectives
    install_patches(capture, colls)
    return colls
