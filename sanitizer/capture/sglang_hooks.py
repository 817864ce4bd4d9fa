"""SGLang: symmetric-memory scopes and decode-step boundaries, recognised when SGLang is imported.

Written against SGLang 0.5.23 (see shared/REFERENCES.md); every attribute is looked up defensively
and a missing one is a counted hook failure, never an error in the server.
  * pynccl_allocator.SymmetricMemoryContext.__enter__/__exit__ -> `scope` events (pool "symm",
    comm = runtime.comm_name(group coordinator): its device group's group_name, which is what
    torch.distributed collectives on that group record, else its group_name, else unique_name).
  * Scheduler.run_batch(batch) -> a `step` event per batch (phase = forward mode, tokens =
    len(batch.reqs) where known) and a flush: SGLang's decode-step boundary.
"""
from __future__ import annotations

import itertools


def _comm_name(ctx) -> str:
    from sanitizer.capture.runtime import comm_name
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


def on_scheduler(capture, module) -> None:
    sched = getattr(module, "Scheduler", None)
    run_batch = getattr(sched, "run_batch", None)
    if run_batch is None:
        raise RuntimeError("sglang: Scheduler.run_batch not found; steps are not detected")
    if getattr(run_batch, "_hazsan", False):
        return
    counter = itertools.count()

    def wrapped(self, batch, *args, **kwargs):
        try:
            mode = getattr(getattr(batch, "forward_mode", None), "name", None)
            reqs = getattr(batch, "reqs", None)
            capture.mark_step(next(counter), phase=mode.lower() if mode else None,
                              tokens=len(reqs) if reqs is not None else None)
        except Exception as exc:
            capture.failed("sglang.step", exc)
        return run_batch(self, batch, *args, **kwargs)

    wrapped._hazsan = True
    sched.run_batch = wrapped
