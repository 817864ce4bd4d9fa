"""What the collectives recorder keeps beyond single collectives: which stream each Work
completes on, per backend (CompletionStreams); what capture knows it cannot record (CoverageGaps);
how long a PyTorch >= 2.8 NCCL Work keeps its tensors (NcclWorkLifetimes), and what the death of
a storage a gloo Work held proves (WorkHeldTensors)."""
from __future__ import annotations

import threading
import weakref

import torch

from sanitizer.capture.collective_ops import (BARRIER_COMPLETES_PRIOR, IN_ORDER_BACKENDS, P2P_OPS,
                                              WORK_HOLDS_TENSORS, current_stream)


class CompletionStreams:
    """Which stream a collective is written on, so that the engine's in-order streams say what
    each backend really guarantees. NCCL (IN_ORDER_BACKENDS) runs a group's collectives in order
    on one stream: the group's stream. gloo runs each async Work on a thread pool (a later small
    all-gather finishes before an earlier large one), so one Work's completion says nothing of
    another's: each Work in flight gets a stream of its own, a lane of the group. Lane 0 is the
    group's stream itself (what sequential blocking calls always use), lane n `<stream>#<n>`.
    A lane is handed out again once the program synchronised with its Work (its `coll_done`
    written, not an observed one): a later Work on it then completes nothing the program had not
    already synchronised with. A Work never synchronised with keeps its lane, whether capture saw
    it finish or not (an observed `coll_done`: were the lane reused, a later Work's wait would
    order this one, an edge only this run's timing made): the streams of a rank are as many as the
    Works it had in flight at once and those it dropped unwaited."""

    def __init__(self):
        self._lock = threading.Lock()
        self._busy: dict[str, set] = {}       # group stream -> lanes held by Works in flight
        self._held: dict[int, tuple] = {}     # cid -> (group stream, lane, op)

    def stream_for(self, stream: str, cid: int, op: str = "") -> str:
        if stream.partition(":")[0] in IN_ORDER_BACKENDS:
            return stream
        with self._lock:
            busy = self._busy.setdefault(stream, set())
            lane = 0
            while lane in busy:
                lane += 1
            busy.add(lane)
            self._held[cid] = (stream, lane, op)
        return stream if lane == 0 else f"{stream}#{lane}"

    def completed_with(self, cid: int) -> list[int]:
        """The Works that the completion of `cid` completes too: for a barrier that waits on its
        group's earlier Works (BARRIER_COMPLETES_PRIOR), those still in flight, in order."""
        with self._lock:
            held = self._held.get(cid)
            if held is None:
                return []
            stream, _, op = held
            if op not in BARRIER_COMPLETES_PRIOR.get(stream.partition(":")[0], ()):
                return []
            return sorted(c for c, (s, _, o) in self._held.items()
                          if c < cid and s == stream and o not in P2P_OPS)

    def complete(self, cid: int) -> None:
        with self._lock:
            held = self._held.pop(cid, None)
            if held is not None:
                self._busy[held[0]].discard(held[1])


class CoverageGaps:
    """Collectives capture knows it cannot record, for the trace header's `coverage` key and
    `hazsan check`'s warning: never silence. `static`: what a program can issue unseen in this
    process (known at install), `unrecorded`: calls that happened, counted by name."""

    def __init__(self):
        self.static: list[str] = []
        self.unrecorded: dict[str, int] = {}

    def count(self, name: str) -> None:
        self.unrecorded[name] = self.unrecorded.get(name, 0) + 1

    def facts(self) -> dict | None:
        if not self.static and not self.unrecorded:
            return None
        out: dict = {}
        if self.static:
            out["unseen"] = list(self.static)
        if self.unrecorded:
            out["unrecorded"] = dict(sorted(self.unrecorded.items()))
        return out


class NcclWorkLifetimes:
    """Where ProcessGroupNCCL runs a collective, and how long its Work keeps the tensors
    (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, ProcessGroupNCCL::collective, since the c10d
    ops carry `async_op`, PyTorch 2.8):

        // in asyncOp=false [default] mode, we use currentStream as ncclStream
        auto ncclStream = asyncOp ? ncclStreams_.at(key) : at::cuda::getCurrentCUDAStream(...);
        if (asyncOp) { work->stashed_for_allocator_safety_->stash(inputs); ...(outputs); }

    * async_op=False: the collective is enqueued on the caller's current stream; later work on
      that stream is ordered after it, the Work's wait() adds nothing. Recorded on the current
      stream, with no edges and no `coll_done` (the host observed nothing).
    * async_op=True: on the group's NCCL stream, its tensors stashed in the Work until
      WorkNCCL::synchronizeStream() (wait(): the current stream waits, then unstash) or, for a Work
      never waited for, until the watchdog finds it complete and hands the shelf to the main
      thread, which unstashes at the next collective it enqueues (Watchdog: "In case user didn't
      call `work.wait()` with async collectives, watchdog would unstage the stashed tensors when
      detecting completion"). So a stashed tensor's storage dies before wait() only after the
      collective completed: the free of a block of a collective not yet waited for is preceded by
      that collective's `coll_done`, observed (the watchdog's look, not the program's wait): never
      flagged free-in-flight, and no edge for an access (docs/ordering-and-rules.md, "Observed
      completion").
    Older PyTorch (no `async_op` in the op) is left as it was: the NCCL stream for every op."""

    def __init__(self, colls):
        self.colls = colls
        self.current: set[int] = set()      # cids enqueued on the caller's current stream
        self.async_ops = False              # the ops carry async_op: stashes (>= 2.8)
        table = getattr(colls.capture, "blocks", None)
        self.ranges: dict[int, list] = {}   # cid -> [(lo, hi)] of a stashed, unwaited collective
        if table is not None:
            table.stashed = self.ranges     # non-empty: the table asks `released` at each free
            table.on_stash_release = self.released

    def stream(self, stream: str, named: dict) -> str:
        if not stream.startswith("nccl:") or "async_op" not in named:
            return stream
        self.async_ops = True
        if named["async_op"]:
            return stream
        return current_stream(self.colls.capture)

    def stashed(self, cid: int, bufs: list) -> None:
        if self.async_ops and bufs:
            self.ranges[cid] = [(b["addr"], b["addr"] + b["size"]) for b in bufs]

    def finished(self, cid: int) -> bool:
        """done() of cid: True when there is nothing to write (a current-stream collective)."""
        self.ranges.pop(cid, None)
        if cid in self.current:
            self.current.discard(cid)
            return True
        return False

    def released(self, addr: int, size: int) -> None:
        """block_table.BlockTable: the block [addr, addr+size) is about to be freed."""
        try:
            end = addr + size
            for cid, ranges in list(self.ranges.items()):
                if any(lo < end and addr < hi for lo, hi in ranges):
                    self.ranges.pop(cid, None)
                    # the watchdog's look, not the program's wait: done for the free, no edge
                    self.colls._observed_done(cid)
        except Exception as exc:
            self.colls.capture.failed("coll.stash_release", exc)


class WorkHeldTensors:
    """When a storage of a gloo collective not yet seen complete dies (WORK_HOLDS_TENSORS).
    Its Work holds each of the collective's tensors (their TensorImpls) as members until the Work
    is destroyed, and gloo's worker lets go of its reference only after it ran the Work
    (ProcessGroupGloo::runLoop). So once every tensor of the collective in a storage is gone and
    the storage dies, the Work is gone: it ran, wherever the last reference was dropped (on gloo's
    worker, or on the program's thread when it dropped the Work after the worker was done:
    PyTorch's test_gather_stress keeps only the Futures of gathers on temporary inputs;
    DeepSpeed#8539's discarded handles and then the outputs). The collective is done: its
    `coll_done` is written before the `free`, as an observed one: capture saw it, the program did
    not wait for it, so it frees the memory and orders no access (vllm-ascend#11961: the gathers
    whose handles were dropped finished first in every run, and their outputs' reads went
    unflagged while a slower gather would corrupt them). Inputs a backend copies inside the call
    (COPIED_AT_ENQUEUE) are not among the tensors: the Work holds the copy, not them.
    Nothing is inferred otherwise:
      * a storage that dies under a tensor of the collective still alive had its memory swapped
        out from under it (`t.data = ...`, `set_`, as Megatron-LM#4047's deallocate_output_tensor
        does under an isend): the Work may still read it, the free stays in flight;
      * a collective on device tensors (gloo's CUDA Works copy the result back to the device
        asynchronously at the end of run(), so the Work's release does not order that copy):
        only a death on gloo's worker thread or a completion a held Future or Work reports counts,
        as a host-side completion of the gloo part.
    A tensor is known alive by a weak reference: PyTorch keeps a tensor's Python object while C++
    holds its TensorImpl, and clears its weak references before its storage is released.
    (DeepSpeed#8539's hazard is the read of the outputs before their Works were waited: an
    `unordered-access` at level full, which this does not touch.)"""

    def __init__(self, colls):
        self.colls = colls
        self._lock = threading.Lock()
        self.held: dict[int, list] = {}     # cid -> [(its block's addr, weakref to the tensor)]
        self.by_block: dict[int, set] = {}  # block addr -> cids holding a tensor in it
        self.on_host: set[int] = set()      # cids whose tensors are all host (CPU) tensors
        table = getattr(colls.capture, "blocks", None)
        if table is not None:
            table.held_by_work = self.held  # non-empty: the table asks `died` at each death
            table.on_held_death = self.died

    def recorded(self, cid: int, stream: str, tensors: list) -> None:
        """`tensors`: (tensor, (addr, size)) of the collective `cid`, recorded on `stream`."""
        table = self.colls.capture.blocks
        if not tensors or table is None or stream.partition(":")[0] not in WORK_HOLDS_TENSORS:
            return
        entries = []
        for t, r in tensors:
            b = table.known(t.untyped_storage()._cdata) if r[1] else None
            if b is not None:
                entries.append((b.addr, weakref.ref(t)))
        if not entries:
            return
        host = all(t.device.type == "cpu" for t, _ in tensors)
        with self._lock:
            self.held[cid] = entries
            if host:
                self.on_host.add(cid)
            for addr, _ in entries:
                self.by_block.setdefault(addr, set()).add(cid)

    def finished(self, cid: int) -> None:
        with self._lock:
            self.on_host.discard(cid)
            for addr, _ in self.held.pop(cid, ()):
                cids = self.by_block.get(addr)
                if cids is not None:
                    cids.discard(cid)
                    if not cids:
                        del self.by_block[addr]

    def died(self, addr: int, size: int) -> None:
        """block_table.BlockTable: the storage at `addr` died (not a resize)."""
        try:
            complete = []
            with self._lock:
                for cid in self.by_block.pop(addr, ()):
                    entries = self.held.get(cid, [])
                    inside = [ref for a, ref in entries if a == addr]
                    rest = [e for e in entries if e[0] != addr]
                    if rest:
                        self.held[cid] = rest          # (the dead block names nothing any more)
                    else:
                        self.held.pop(cid, None)
                    if inside and all(ref() is None for ref in inside):
                        complete.append(cid)
            for cid in complete:
                if cid not in self.colls.issued_cids:
                    continue
                if cid in self.on_host or _on_backend_thread() or self._seen_complete(cid):
                    # capture's own conclusion, never the program's synchronisation
                    self.colls.done(cid, observed=True)
        except Exception as exc:
            self.colls.capture.failed("coll.work_release", exc)

    def _seen_complete(self, cid: int) -> bool:
        """A Work or Future of `cid` the program still holds reports it complete (the stock
        methods: the patched ones would count as the program's observation)."""
        from sanitizer.capture.collective_patches import ORIGINAL
        for ref, cids in list(self.colls.pending.values()):
            handle = ref()
            if handle is None or cid not in cids:
                continue
            query = ORIGINAL["Future.done"] if isinstance(handle, torch._C.Future) \
                else ORIGINAL["Work.is_completed"]
            if query(handle):
                return True
        return False


def _on_backend_thread() -> bool:
    """The current thread was not started by Python's threading (a backend's C++ worker that
    entered Python, here to run a storage's finalizer)."""
    return isinstance(threading.current_thread(), getattr(threading, "_DummyThread", ()))
