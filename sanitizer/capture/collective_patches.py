"""The methods of torch.distributed's classes that capture wraps, where collectives hand their
Work to Python and where the host observes completion: ProcessGroup (the Work a dispatched
collective returns), Backend (a backend used directly, past the dispatcher ops), Work and Future
(wait, is_completed, done, value, then), `torch._C._collect_all` (wait_all's aggregate Future),
DDP's communication hooks and the default group (the rank). Classes and private helpers only:
every public function of torch.distributed keeps its identity. Each wrapper records through the
recorder (collectives.DispatchedCollectives) and never raises into the program."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from sanitizer.capture.block_table import entering_quiet, leaving_quiet
from sanitizer.capture.collective_ops import BACKEND_METHODS
from sanitizer.capture.collective_state import CoverageGaps

_C10D = torch._C._distributed_c10d
_API_MODULE = "torch.distributed.distributed_c10d"   # torch.distributed's Python functions

# the stock methods, for the recorder's own calls (the patched ones observe)
ORIGINAL: dict = {}


def install_patches(capture, colls) -> None:
    """Wrap the classes' methods for the recorder `colls` (once per process)."""
    _patch_work(capture, colls)
    _patch_process_group(capture, colls)
    _patch_backend(capture, colls)
    _patch_collect_all(capture, colls)
    _static_gaps(colls.coverage)
    _patch_default_group(capture)
    _patch_comm_hooks(capture, colls)


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
    ORIGINAL["Work.get_future"] = w_fut
    ORIGINAL["Future.done"] = f_done
    ORIGINAL["Work.is_completed"] = w_done
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
        entering_quiet()
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
            leaving_quiet()
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
        entering_quiet()
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
            leaving_quiet()
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
