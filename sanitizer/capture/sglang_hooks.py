"""SGLang: symmetric-memory scopes and decode-step boundaries, recognised when SGLang is imported.

Written against SGLang 0.5.23 (see shared/REFERENCES.md); every attribute is looked up defensively
and a missing one is a counted hook failure, never an error in the server.
  * pynccl_allocator.SymmetricMemoryContext.__enter__/__exit__ -> `scope` events (pool "symm").
    The pool's windows belong to the coordinator's pynccl communicator, so the scope carries that
    communicator's name (nccl.py: "pynccl:<group_name>", what its `coll` and `window` events
    carry); without one, runtime.comm_name(group coordinator).
  * SymmetricMemoryContext._register_segments_for_comm (scope exit, where SGLang's C++ plugin
    registers the pool's new segments with ncclCommWindowRegister, out of Python's sight) ->
    `segment` and `window` events for every segment of the pool's own snapshot not yet reported
    for that communicator. (allocate_symmetric_buffer goes through NCCLLibrary.ncclMemAlloc and
    ncclCommWindowRegister: nccl.py records those.) The snapshot is read again only when the
    allocator made or released a segment since the last read (PoolView): an eager prefill step
    exits hundreds of scopes, almost all without growing the pool.
  * A CUDA allocation inside the scope that lands in a pool segment not yet reported: that
    segment will be registered for the scope's communicator at this scope's exit (the plugin
    registers every segment it allocated since the comm's last registration), so its `segment`
    and `window` are written before that allocation's `alloc`. Otherwise a transient allocated
    and freed inside the scope (an einsum's scratch in a fresh segment) would never be seen in
    the window it shifts. The segment is found in the pool's snapshot only when an allocation
    falls outside every segment known: once per new segment.
  * pynccl_wrapper.NCCLLibrary and pynccl.PyNcclCommunicator: nccl.py's class-level hooks.
  * Collective paths not recorded, written to the header's `coverage` once the process uses them
    (`hazsan check` warns, and its verdict says what it could not check):
    FlashInferWorkspaceManager.initialize leaving a workspace, or
    resolve_flashinfer_allreduce_fusion_backend naming a backend (layers/flashinfer_comm_fusion.py:
    the fused all-reduce + residual + RMSNorm kernel, flashinfer.comm.allreduce_fusion, works on
    that workspace's IPC buffers); custom all-reduce v2's _allocate_symmetric_memory (its push and
    pull planes in torch symmetric memory, which its fused kernels also use).
  * Scheduler.run_batch(batch) -> a `step` event per batch (phase = the batch's forward mode,
    tokens = the token count of the step's model forward: `step_tokens`) and a flush: SGLang's
    decode-step boundary; when it returns, a flush and the step's end in the header (what a
    scheduler SIGKILLed by Engine.shutdown proves).
  * Engine.shutdown() -> first, at most 1 s, wait until every child process's trace says quiet
    (child_traces.py): it SIGKILLs the schedulers, usually before they are idle long enough to
    have said so themselves.
"""
from __future__ import annotations

import itertools
import operator


def _comm_name(ctx) -> str:
    from sanitizer.capture.runtime import active, comm_name
    from sanitizer.capture.nccl import comm_name_of
    coordinator = getattr(ctx, "group_coordinator", None)
    pynccl = getattr(coordinator, "pynccl_comm", None)
    cap = active()
    if pynccl is not None and cap is not None:
        name = comm_name_of(cap, pynccl)
        if name:
            return name
    for attr in ("group_coordinator", "group"):
        holder = getattr(ctx, attr, None)
        if holder is not None:
            return comm_name(holder)
    return "sglang"


def on_pynccl_allocator(capture, module) -> None:
    ctx_cls = getattr(module, "SymmetricMemoryContext", None)
    if ctx_cls is None:
        raise RuntimeError("sglang: SymmetricMemoryContext not found; symmetric scopes are not recognised")
    enter, exit_ = ctx_cls.__enter__, ctx_cls.__exit__
    if getattr(enter, "_hazsan", False):
        return

    def __enter__(self):
        r = enter(self)
        try:
            self._hazsan_comm = _comm_name(self)
            capture.enter_scope("symm", self._hazsan_comm)
        except Exception as exc:
            capture.failed("sglang.scope", exc)
        return r

    def __exit__(self, *exc_info):
        try:
            capture.exit_scope("symm", getattr(self, "_hazsan_comm", "sglang"))
        except Exception as exc:
            capture.failed("sglang.scope", exc)
        return exit_(self, *exc_info)

    __enter__._hazsan = True
    ctx_cls.__enter__, ctx_cls.__exit__ = __enter__, __exit__
    capture.installed.append("sglang.SymmetricMemoryContext")

    register = getattr(ctx_cls, "_register_segments_for_comm", None)
    if register is None:
        raise RuntimeError("sglang: SymmetricMemoryContext._register_segments_for_comm not found; "
                           "pool windows are not recorded")
    reported: set = set()     # (segment address, comm) already written
    view = PoolView(module)
    early = PoolSegments(capture, module, reported, view)
    if capture.blocks is not None:
        capture.blocks.scope_allocs["symm"] = early.allocated

    def _register_segments_for_comm(self, *args, **kwargs):
        r = register(self, *args, **kwargs)
        try:
            _report_pool_windows(capture, module, self, reported, view)
        except Exception as exc:
            capture.failed("sglang.windows", exc)
        return r

    _register_segments_for_comm._hazsan = True
    ctx_cls._register_segments_for_comm = _register_segments_for_comm
    capture.installed.append("sglang.pool-windows")


class PoolView:
    """The symmetric pool's segments [(address, size)], from its snapshot, read again only when
    the caching allocator's segment counters moved since the last read.

    c10's DeviceStats count every segment the device's allocator maps (`segment`: allocated and
    freed, cumulative; `reserved_bytes`), the pool's own included: a pool grows only through a
    new segment (pools with a custom allocator, like SGLang's ncclMemAlloc pool, have no
    expandable segments: c10/cuda/CUDACachingAllocator.cpp). torch._C._cuda_memoryStats answers
    them as a dict of counters, without walking any block; the snapshot builds a dict per segment
    and per block. The counters are read before the snapshot: a segment made in between moves
    them again, so the next read takes a fresh snapshot. Without the counters (a build that has
    none, an error) every read is a snapshot, as before."""

    def __init__(self, module):
        self.module = module
        self.pool = None
        self.mark = None             # the counters when `segments` was read
        self.segments: list[tuple[int, int]] = []
        self.snapshots = 0

    def current(self) -> list[tuple[int, int]]:
        pool = getattr(self.module, "_mem_pool", None)
        if pool is None:
            return []
        mark = _segment_counters(getattr(self.module, "_cur_device", None))
        if mark is None or mark != self.mark or pool is not self.pool:
            self.segments = [(int(seg["address"]), int(seg["total_size"])) for seg in _pool_segments(pool)]
            self.pool, self.mark = pool, mark
            self.snapshots += 1
        return self.segments


def _segment_counters(device) -> tuple | None:
    """(segments allocated, segments freed, reserved bytes) of the device's caching allocator,
    or None where torch cannot say (a CPU build, CUDA not ready)."""
    import sys
    torch = sys.modules.get("torch")
    stats = getattr(getattr(torch, "_C", None), "_cuda_memoryStats", None)
    if stats is None:
        return None
    try:
        s = stats(int(device or 0))
        seg = s["segment"]["all"]
        return int(seg["allocated"]), int(seg["freed"]), int(s["reserved_bytes"]["all"]["current"])
    except Exception:
        return None


class PoolSegments:
    """The symmetric pool's segments, learnt at the first allocation inside a scope that lands in
    one (block_table.BlockTable calls `allocated` before writing that allocation)."""

    def __init__(self, capture, module, reported: set, view: PoolView | None = None):
        self.capture, self.module, self.reported = capture, module, reported
        self.view = view if view is not None else PoolView(module)
        self.starts: list[int] = []         # known segments, sorted by address
        self.ends: list[int] = []

    def _known(self, ptr: int) -> bool:
        import bisect
        i = bisect.bisect_right(self.starts, ptr) - 1
        return i >= 0 and ptr < self.ends[i]

    def allocated(self, comm: str, ptr: int, nbytes: int) -> None:
        try:
            if self._known(ptr):
                return
            import bisect
            for addr, size in self.view.current():
                if not self._known(addr):
                    i = bisect.bisect_right(self.starts, addr)
                    self.starts.insert(i, addr)
                    self.ends.insert(i, addr + size)
                if addr <= ptr < addr + size:
                    _report_segment(self.capture, addr, size, comm, self.reported)
        except Exception as exc:
            self.capture.failed("sglang.windows", exc)


def _report_segment(capture, addr: int, size: int, comm: str, reported: set) -> None:
    """`segment` (once per address) and `window` (once per (address, comm)) of a pool segment."""
    if (addr, comm) in reported:        # the usual case at a scope exit: one set lookup
        return
    if not any(a == addr for a, _ in reported):
        capture.event({"ev": "segment", "addr": addr, "size": size, "pool": "symm"})
    reported.add((addr, comm))
    # the C++ plugin drops the ncclWindow_t it gets; a communicator whose registrations through
    # NCCLLibrary came back NULL (no symmetric support: nccl.py) gets NULL ones here too
    calls = getattr(capture, "nccl", None)
    if calls is None or comm not in calls.no_symmetric:
        capture.event({"ev": "window", "addr": addr, "size": size, "comm": comm})


def _report_pool_windows(capture, module, ctx, reported: set, view: PoolView | None = None) -> None:
    """`segment` + `window` for the pool's segments newly registered with ctx's communicator."""
    segments = (view if view is not None else PoolView(module)).current()
    if not segments:
        return
    comm = getattr(ctx, "_hazsan_comm", None) or _comm_name(ctx)
    for addr, size in segments:
        _report_segment(capture, addr, size, comm, reported)


def _pool_segments(pool) -> list:
    """The pool's segments without their allocation history: MemPool.snapshot() defaults to
    include_traces=True (torch/cuda/memory.py), which turns the allocator's whole trace ring buffer
    (up to HAZSAN_ALLOC_HISTORY_ENTRIES = 1M entries under HAZSAN_ALLOC_SOURCE=history) into
    Python dicts at every scope exit. Older torch has no such parameter."""
    try:
        return pool.snapshot(include_traces=False)
    except TypeError:
        return pool.snapshot()


def on_pynccl_wrapper(capture, module) -> None:
    from sanitizer.capture import nccl
    cls = getattr(module, "NCCLLibrary", None)
    if cls is None:
        raise RuntimeError(f"{module.__name__}: NCCLLibrary not found; pynccl collectives are not recorded")
    label = module.__name__.split(".")[0] + ".NCCLLibrary"
    if nccl.hook_library(capture, cls, label):
        capture.installed.append(label)


def on_pynccl(capture, module) -> None:
    from sanitizer.capture import nccl
    cls = getattr(module, "PyNcclCommunicator", None)
    if cls is None:
        raise RuntimeError(f"{module.__name__}: PyNcclCommunicator not found; communicators keep local names")
    label = module.__name__.split(".")[0] + ".PyNcclCommunicator"
    if nccl.hook_communicator(capture, cls, label):
        capture.installed.append(label)


# Modules whose collective paths capture does not record: their use is a coverage gap.
FLASHINFER_FUSION = "sglang.srt.layers.flashinfer_comm_fusion"
CUSTOM_AR_V2 = "sglang.srt.distributed.device_communicators.custom_all_reduce_v2"
UNRECORDED_COLLECTIVES = (FLASHINFER_FUSION, CUSTOM_AR_V2)


def flashinfer_fusion_gap(backend) -> str:
    return (f"FlashInfer fused all-reduce (--flashinfer-allreduce-fusion-backend, backend {backend}): "
            "flashinfer.comm.allreduce_fusion and its IPC workspace are not recorded; hazards on the "
            "buffers it reads and writes (all-reduce input, residual, outputs) are not checked")


CUSTOM_AR_V2_GAP = ("SGLang custom all-reduce v2 workspace (torch symmetric memory, "
                    "_SymmetricMemory.empty_strided_p2p): its push and pull planes, and the fused kernels "
                    "that use them (all-reduce + RMSNorm fusion, K3, vocab gather), are not recorded; "
                    "hazards on them are not checked (its custom_all_reduce calls are recorded)")


def coverage_gap(capture, sentence: str) -> None:
    """Add `sentence` to the header's coverage.unseen (once)."""
    from sanitizer.capture.collective_state import CoverageGaps
    gaps = getattr(capture, "coverage", None)
    if not isinstance(gaps, CoverageGaps):     # collectives not installed (yet): they adopt it
        gaps = capture.coverage = CoverageGaps()
    if sentence not in gaps.static:
        gaps.static.append(sentence)


def on_unrecorded_collectives(capture, module) -> None:
    """Record, once used, the collective paths of `module` that capture cannot record: not at
    import (every CUDA server imports custom_all_reduce_v2 through dp_attention), but where the
    process turns them on."""
    name = module.__name__
    if name == FLASHINFER_FUSION:
        resolve = getattr(module, "resolve_flashinfer_allreduce_fusion_backend", None)
        manager = getattr(module, "FlashInferWorkspaceManager", None)
        initialize = getattr(manager, "initialize", None)
        if resolve is None or initialize is None:
            raise RuntimeError(f"{name}: resolve_flashinfer_allreduce_fusion_backend or "
                               "FlashInferWorkspaceManager.initialize not found; the fused all-reduce's "
                               "use is not reported")
        if getattr(resolve, "_hazsan", False):
            return

        def resolve_backend(*args, **kwargs):
            backend = resolve(*args, **kwargs)
            try:
                if backend is not None:          # the option is on: every fused layer runs it
                    coverage_gap(capture, flashinfer_fusion_gap(backend))
            except Exception as exc:
                capture.failed("sglang.flashinfer-fusion", exc)
            return backend

        def initialize_workspace(self, *args, **kwargs):
            r = initialize(self, *args, **kwargs)
            try:
                if getattr(self, "workspace", None) is not None:
                    coverage_gap(capture, flashinfer_fusion_gap(getattr(self, "backend", None)))
            except Exception as exc:
                capture.failed("sglang.flashinfer-fusion", exc)
            return r

        for fn in (resolve_backend, initialize_workspace):
            fn._hazsan = True
        module.resolve_flashinfer_allreduce_fusion_backend = resolve_backend
        manager.initialize = initialize_workspace
        capture.installed.append("sglang.flashinfer-fusion(coverage)")
    elif name == CUSTOM_AR_V2:
        allocate = getattr(module, "_allocate_symmetric_memory", None)
        if allocate is None:
            raise RuntimeError(f"{name}: _allocate_symmetric_memory not found; custom all-reduce v2's "
                               "workspace is not reported")
        if getattr(allocate, "_hazsan", False):
            return

        def allocate_workspace(*args, **kwargs):
            r = allocate(*args, **kwargs)
            try:
                coverage_gap(capture, CUSTOM_AR_V2_GAP)
            except Exception as exc:
                capture.failed("sglang.custom-ar-v2", exc)
            return r

        allocate_workspace._hazsan = True
        module._allocate_symmetric_memory = allocate_workspace
        capture.installed.append("sglang.custom-ar-v2(coverage)")


def on_scheduler(capture, module) -> None:
    sched = getattr(module, "Scheduler", None)
    run_batch = getattr(sched, "run_batch", None)
    if run_batch is None:
        raise RuntimeError("sglang: Scheduler.run_batch not found; steps are not detected")
    if getattr(run_batch, "_hazsan", False):
        return
    counter = itertools.count()

    def wrapped(self, batch, *args, **kwargs):
        n = next(counter)
        try:
            tokens = step_tokens(self, batch)
        except Exception as exc:          # the step is still marked, without its token count
            tokens = None
            capture.failed("sglang.step-tokens", exc)
        try:
            mode = getattr(getattr(batch, "forward_mode", None), "name", None)
            capture.mark_step(n, phase=mode.lower() if mode else None, tokens=tokens)
        except Exception as exc:
            capture.failed("sglang.step", exc)
        try:
            return run_batch(self, batch, *args, **kwargs)
        finally:
            try:
                capture.end_step(n)
            except Exception as exc:
                capture.failed("sglang.step", exc)

    wrapped._hazsan = True
    sched.run_batch = wrapped
    capture.installed.append("sglang.Scheduler.run_batch")


def on_engine(capture, module) -> None:
    engine = getattr(module, "Engine", None)
    shutdown = getattr(engine, "shutdown", None)
    if shutdown is None:
        raise RuntimeError("sglang: Engine.shutdown not found; its SIGKILLed schedulers may leave "
                           "traces without what they recorded after their last step")
    if getattr(shutdown, "_hazsan", False):
        return

    def wrapped(self, *args, **kwargs):
        try:
            from sanitizer.capture.child_traces import wait_until_quiet
            capture.writer.flush()
            wait_until_quiet(capture.writer.directory)
        except Exception as exc:
            capture.failed("sglang.shutdown", exc)
        return shutdown(self, *args, **kwargs)

    wrapped._hazsan = True
    engine.shutdown = wrapped
    capture.installed.append("sglang.Engine.shutdown")


def step_tokens(scheduler, batch) -> int | None:
    """The token count of the model forward that run_batch(batch) makes: the first dimension of
    its activations, what `hazsan sweep` scales (SGLang 0.5.23).

    * EXTEND / MIXED (prefill, chunked prefill beside decodes): batch.extend_num_tokens, the new
      tokens of every request (what the radix cache holds is not recomputed; MIXED counts each
      running decode's token too: ScheduleBatch.mix_with_running).
    * DECODE without speculative decoding: one token per request.
    * DECODE with speculative decoding: the scheduler hands the DECODE batch to its draft worker,
      which turns it into a TARGET_VERIFY forward of draft_token_num tokens per request (NGRAM:
      NGRAMWorker._prepare_for_speculative_decoding; the verified token and depth drafts, every
      step, whatever was accepted before): requests x draft_token_num.
    * IDLE (a data-parallel rank with nothing to run): 0.
    None where the batch says none of this (no forward mode, no request list, no draft width)."""
    mode = getattr(batch, "forward_mode", None)
    reqs = getattr(batch, "reqs", None)
    if mode is None:
        return None
    if mode.is_idle():
        return 0
    if mode.is_decode():
        if reqs is None:
            return None
        spec = getattr(batch, "spec_algorithm", None)
        if spec is None or spec.is_none():
            return len(reqs)
        width = verify_width(scheduler)
        return len(reqs) * width if width else None
    extend = getattr(batch, "extend_num_tokens", None)
    try:
        return operator.index(extend) if extend is not None else None
    except TypeError:
        return None


def verify_width(scheduler) -> int | None:
    """Tokens per request of a speculative verify forward: the draft worker's draft_token_num
    (NGRAM), else speculative_num_draft_tokens of the worker or of the server arguments."""
    worker = getattr(scheduler, "draft_worker", None)
    for holder, attr in ((worker, "draft_token_num"), (worker, "speculative_num_draft_tokens"),
                         (getattr(scheduler, "server_args", None), "speculative_num_draft_tokens")):
        width = getattr(holder, attr, None) if holder is not None else None
        if isinstance(width, int) and width > 0:
            return width
    return None
