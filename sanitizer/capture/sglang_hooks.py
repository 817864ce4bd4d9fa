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
    ncclCommWindowRegister: nccl.py records those.)
  * A CUDA allocation inside the scope that lands in a pool segment not yet reported: that
    segment will be registered for the scope's communicator at this scope's exit (the plugin
    registers every segment it allocated since the comm's last registration), so its `segment`
    and `window` are written before that allocation's `alloc`. Otherwise a transient allocated
    and freed inside the scope (an einsum's scratch in a fresh segment) would never be seen in
    the window it shifts. The segment is found in the pool's snapshot only when an allocation
    falls outside every segment known: once per new segment.
  * pynccl_wrapper.NCCLLibrary and pynccl.PyNcclCommunicator: nccl.py's class-level hooks.
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
    early = PoolSegments(capture, module, reported)
    if capture.blocks is not None:
        capture.blocks.scope_allocs["symm"] = early.allocated

    def _register_segments_for_comm(self, *args, **kwargs):
        r = register(self, *args, **kwargs)
        try:
            _report_pool_windows(capture, module, self, reported)
        except Exception as exc:
            capture.failed("sglang.windows", exc)
        return r

    _register_segments_for_comm._hazsan = True
    ctx_cls._register_segments_for_comm = _register_segments_for_comm
    capture.installed.append("sglang.pool-windows")


class PoolSegments:
    """The symmetric pool's segments, learnt at the first allocation inside a scope that lands in
    one (block_table.BlockTable calls `allocated` before writing that allocation)."""

    def __init__(self, capture, module, reported: set):
        self.capture, self.module, self.reported = capture, module, reported
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
            pool = getattr(self.module, "_mem_pool", None)
            if pool is None:
                return
            for seg in _pool_segments(pool):
                addr, size = int(seg["address"]), int(seg["total_size"])
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
    if not any(a == addr for a, _ in reported):
        capture.event({"ev": "segment", "addr": addr, "size": size, "pool": "symm"})
    if (addr, comm) in reported:
        return
    reported.add((addr, comm))
    # the C++ plugin drops the ncclWindow_t it gets; a communicator whose registrations through
    # NCCLLibrary came back NULL (no symmetric support: nccl.py) gets NULL ones here too
    calls = getattr(capture, "nccl", None)
    if calls is None or comm not in calls.no_symmetric:
        capture.event({"ev": "window", "addr": addr, "size": size, "comm": comm})


def _report_pool_windows(capture, module, ctx, reported: set) -> None:
    """`segment` + `window` for the pool's segments newly registered with ctx's communicator."""
    pool = getattr(module, "_mem_pool", None)
    if pool is None:
        return
    comm = getattr(ctx, "_hazsan_comm", None) or _comm_name(ctx)
    for seg in _pool_segments(pool):
        _report_segment(capture, int(seg["address"]), int(seg["total_size"]), comm, reported)


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
