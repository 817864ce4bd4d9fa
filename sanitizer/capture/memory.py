"""Interception of torch's allocations: the dispatch mode that sees every aten op.

Every op runs as it would, then goes to the block table (block_table.py: the recording half,
which says what is recorded and how addresses are chosen); collectives dispatched as ops go to
their handlers (collectives.py).

How the mode is installed: the Python dispatch-mode stack is thread-local. `install()` pushes one
mode instance on the importing thread (normally the main thread, at `import torch`) and wraps
`threading.Thread._bootstrap_inner` so that every Python thread started afterwards pushes its own
instance before running. Threads already running when torch was imported, and C++ threads (gloo
workers, autograd's device threads), run without it; their tensors are adopted when they reach a
recorded op or collective. The mode is never popped; user modes stack above it.
"""
from __future__ import annotations

import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sanitizer.capture.block_table import _PLAIN, BlockTable

_Tensor = torch.Tensor


class AllocationMode(TorchDispatchMode):
    """Runs every aten op, then reports its outputs (and unknown inputs) to the BlockTable."""

    def __init__(self, table: BlockTable):
        super().__init__()
        self._table = table
        self._on_op = table.on_op
        self._special = table.special
        self._unowned = table.unowned
        self._slot = table.slot
        self._full = False

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Capture steps aside while torch.compile traces and compiles (Dynamo, AOTAutograd,
        # Inductor see the stock program) and is on again when the compiled code runs, so the
        # graph's collectives and allocations that go through the dispatcher are recorded then.
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # TorchDispatchMode wraps __torch_dispatch__ in torch._dynamo.disable by default: that
        # imports torch._dynamo on the first op (seconds) and costs several us on every op. With
        # ignore_compile_internals, Dynamo never traces into a frame while this mode is on.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if types and (len(types) > 1 or types[0] is not _Tensor) and _wrapped(types):
            # A wrapper subclass (DTensor, AsyncCollectiveTensor) runs its own __torch_dispatch__
            # first, and its plain-tensor ops come back through this mode: its collectives, its
            # waits and the memory behind it are recorded, not hidden inside its handler.
            return NotImplemented
        h = self._special.get(func)
        if h is None:
            h = self._table.classify(func)
        if h is not False:
            return h(func, args, kwargs or {}, self)
        if self._unowned:
            self._table.collectives.poll()
        out = func(*args, **kwargs) if kwargs else func(*args)
        if self._full and not self._slot.quiet:
            self._on_op_full(func, args, kwargs, out)
        else:                # alloc level, or inside a collective's own call (its work, not a launch)
            self._on_op(func, args, out)
        return out



class LaunchMode(AllocationMode):
    """HAZSAN_LEVEL=full: also records each op as a `launch` with its reads and writes."""

    def __init__(self, table: BlockTable):
        super().__init__(table)
        self._on_op_full = table.on_op_full
        self._full = True


def _wrapped(types) -> bool:
    """Whether any of the op's tensor types is a traceable wrapper subclass (it has
    __tensor_flatten__: DTensor, AsyncCollectiveTensor, ...). FakeTensor and friends are not:
    they hold no memory, and the mode runs them as they are."""
    for t in types:
        if t not in _PLAIN and hasattr(t, "__tensor_flatten__"):
            return True
    return False


def mode_for(table: BlockTable) -> AllocationMode:
    return LaunchMode(table) if table.full else AllocationMode(table)


_installed_table: BlockTable | None = None


def install(capture) -> BlockTable:
    """Create the table, push the mode on this thread and on every thread started from now on."""
    global _installed_table
    table = BlockTable(capture)
    capture.blocks = table
    _installed_table = table
    mode_for(table).__enter__()
    _wrap_thread_start(table)
    _wrap_compiled_allocators(table)
    return table


# Inductor's generated code allocates its buffers through these C functions, not through the
# dispatcher (torch/_inductor/codegen/wrapper.py binds them by attribute when a compiled module is
# loaded), so the mode would only see each buffer when it reaches an op, as "adopted".
_COMPILED_ALLOCATORS = ("_empty_strided_cpu", "_empty_strided_cpu_pinned", "_empty_strided_cuda")


def _wrap_compiled_allocators(table: BlockTable) -> None:
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    if guards is None:
        return
    stack_len = torch._C._len_torch_dispatch_stack
    for name in _COMPILED_ALLOCATORS:
        original = getattr(guards, name, None)
        if original is None or getattr(original, "_hazsan", False):
            continue
        op = "inductor." + name.lstrip("_")

        def allocate(*args, __original=original, __op=op, **kwargs):
            out = __original(*args, **kwargs)
            # only while the mode is on: compilation itself (autotuning) runs with modes off
            if stack_len():
                table.on_op(__op, (), out)
            return out

        allocate._hazsan = True
        allocate.__doc__ = getattr(original, "__doc__", None)
        try:
            setattr(guards, name, allocate)
        except Exception as exc:
            table.capture.failed("install.compiled_allocators", exc)


def _wrap_thread_start(table: BlockTable) -> None:
    on_every_new_thread(table.capture, lambda: mode_for(table).__enter__(),
                        "new threads run without the dispatch mode")


def on_every_new_thread(capture, start, unhooked: str) -> None:
    """Call start() first thing on every Python thread started from now on (capture's per-thread
    set-up: the dispatch mode pushed, or the native recorder told the thread's ops are launches).
    `unhooked`: what is lost where the hook cannot be placed (said as a hook failure)."""
    original = getattr(threading.Thread, "_bootstrap_inner", None)
    if original is None or getattr(original, "_hazsan", False):
        if original is None:
            capture.failed("threads", RuntimeError(f"threading.Thread._bootstrap_inner not found: {unhooked}"))
        return

    def _bootstrap_inner(self):
        try:
            start()
        except Exception as exc:
            capture.failed("threads", exc)
        return original(self)

    _bootstrap_inner._hazsan = True
    threading.Thread._bootstrap_inner = _bootstrap_inner
