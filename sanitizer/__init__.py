"""hazsan: memory-allocation hazard sanitizer for distributed PyTorch serving stacks.

The public API for programs being sanitised. It is safe to call whether or not capture is on
(``HAZSAN=1``): without capture every call is a cheap no-op. Importing this module imports nothing
but the standard library.

    import sanitizer

    for n in range(steps):
        with sanitizer.step(n, phase="decode", tokens=batch):  # decode step n: flushes the trace
            ...
        with sanitizer.symmetric_scope(group, pool="symm"):  # allocations here go to the window
            out = torch.empty(...)
"""
from __future__ import annotations

import sys

__version__ = "0.1.0"
__all__ = ["enabled", "step", "symmetric_scope"]


def _capture():
    runtime = sys.modules.get("sanitizer.capture.runtime")   # imported only when capture is on
    return runtime._active if runtime is not None else None


def enabled() -> bool:
    """True when this process is being captured."""
    return _capture() is not None


def step(n: int, phase: str | None = None, tokens: int | None = None) -> "_StepEnd":
    """Mark the start of decode step `n` (optionally its phase and token count) and flush the trace.

    Used as a context manager (`with sanitizer.step(n): ...`) it also marks where the step ends:
    the trace is flushed there instead of at the next start, and a process killed between steps is
    reported as such, with nothing recorded during a step missing (docs/capture.md, "Files")."""
    cap = _capture()
    if cap is None:
        return _NO_STEP
    try:
        cap.mark_step(n, phase, tokens)
    except Exception as exc:
        cap.failed("step", exc)
    return _StepEnd(cap, n)


class _StepEnd:
    """What step() returns: as a context manager, its exit marks the end of the step."""

    __slots__ = ("cap", "n")

    def __init__(self, cap, n):
        self.cap, self.n = cap, n

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        if self.cap is not None:
            try:
                self.cap.end_step(self.n)
            except Exception as exc:
                self.cap.failed("step", exc)
        return False


_NO_STEP = _StepEnd(None, 0)


class symmetric_scope:
    """Context manager: allocations made inside go to the symmetric pool `pool` of communicator `comm`.

    `comm` is a torch.distributed ProcessGroup (recorded as its group_name, the name its collectives
    carry), an SGLang GroupCoordinator, or a name. It marks the scope in the trace and, on CPU,
    places the scope's allocations in a modelled window (see sanitizer/capture/window.py). It does
    not change where your tensors really live.
    """

    __slots__ = ("comm", "pool", "_entered")

    def __init__(self, comm=None, pool: str = "symm"):
        self.comm = comm
        self.pool = pool
        self._entered = None

    def __enter__(self):
        cap = _capture()
        if cap is not None:
            try:
                from sanitizer.capture.runtime import comm_name
                name = comm_name(self.comm)
                cap.enter_scope(self.pool, name)
                self._entered = (cap, name)
            except Exception as exc:
                cap.failed("symmetric_scope", exc)
        return self

    def __exit__(self, *exc_info):
        if self._entered is not None:
            cap, name = self._entered
            self._entered = None
            try:
                cap.exit_scope(self.pool, name)
            except Exception as exc:
                cap.failed("symmetric_scope", exc)
        return False
