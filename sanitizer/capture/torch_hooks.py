"""What happens when the program imports torch (and torch.distributed): install the capture.

Run from a post-import hook, so torch is never imported early on the program's behalf.
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch


def on_torch(capture) -> None:
    capture.sites.add_internal(torch)
    capture.sites.add_external_dir(os.path.join(os.path.dirname(torch.__file__), "testing"))
    for name in ("wrapt", "typing_extensions"):
        mod = sys.modules.get(name)
        if mod is not None:
            capture.sites.add_internal(mod)
    # torch.compile's generated code: its ops and collectives are the compiled function's, whose
    # call site is the user's
    capture.sites.add_internal_dir(_inductor_cache_dir())
    table = _install_native(capture)
    if table is None:
        from sanitizer.capture import memory
        table = memory.install(capture)
        capture.installed.append("dispatch-mode")
    if capture.settings.alloc_source == "history":
        try:
            from sanitizer.capture import allocator_history
            allocator_history.install(capture, table)
        except Exception as exc:
            capture.failed("install.alloc_history", exc)
    try:
        from sanitizer.capture import cuda_hooks
        cuda_hooks.install(capture)
    except Exception as exc:
        capture.failed("install.cuda", exc)
    try:
        _patch_mem_pools(capture)
    except Exception as exc:
        capture.failed("install.use_mem_pool", exc)
    try:      # host threads: start/join, Event, Queue, torch futures (threads.py)
        from sanitizer.capture import threads
        threads.install(capture)
    except Exception as exc:
        capture.failed("install.threads", exc)


def _install_native(capture):
    """The native recorder as the allocation source, where it can be (sanitizer/capture/native):
    its table, or None for the dispatch mode. Says which, and why, in capture.alloc_path (the
    trace header's `hooks.alloc`); a refusal the user asked against goes to stderr too."""
    from sanitizer.capture import native
    settings = capture.settings
    wanted = native.mode()
    why = None
    if wanted == "off":
        why = "HAZSAN_NATIVE=0"
    elif settings.level not in ("alloc", "full"):
        why = f"level {settings.level}"
    elif settings.alloc_source != "dispatch":
        why = f"HAZSAN_ALLOC_SOURCE={settings.alloc_source}"
    elif settings.stacks == "full":
        why = "HAZSAN_STACKS=full: the recorder keeps one site per allocation"
    table = None
    if why is None:
        try:
            lib = native.load(torch, build=wanted == "on")
            from sanitizer.capture.native import native_table
            table = native_table.install(capture, lib)
        except Exception as exc:   # NativeUnavailable, or an install that failed: the Python path
            why = str(exc) if isinstance(exc, native.NativeUnavailable) else f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, native.NativeUnavailable):
                capture.failed("install.native", exc)
    if table is not None:
        capture.alloc_path = {"source": "native"}
        if settings.level == "full":
            capture.alloc_path["launches"] = "record-function"
        capture.installed.append("native-recorder")
        return table
    capture.alloc_path = {"source": "dispatch-mode", "native": why}
    if wanted == "on":
        print(f"hazsan: HAZSAN_NATIVE=1 but the native recorder is not used: {why}; "
              f"allocations are recorded by the dispatch mode", file=sys.stderr)
    elif wanted != "off" and (getattr(capture, "speaks", False) or os.environ.get("RANK") == "0"):
        # once a run (its first process, or rank 0): capture works, but slower than it could
        print(f"hazsan: the native recorder is not used ({why}); capture records through its "
              f"dispatch mode, which costs more per op (docs/capture.md, \"The native recorder\")",
              file=sys.stderr)
    return None


def on_distributed(capture) -> None:
    import torch.distributed as dist
    if not dist.is_available():
        return
    from sanitizer.capture import collectives
    colls = collectives.install(capture)
    capture.installed.append("collectives")
    if capture.alloc_path.get("source") == "native":
        try:
            from sanitizer.capture.native.backend_select import BackendSelectKernels
            kernels = capture.backend_select = BackendSelectKernels(capture, colls)
            if capture.settings.level == "full":
                lib = capture.blocks.lib
                kernels.on_covered = lambda qualified, handler: lib.mark_op(
                    qualified, handler == colls._transparent)
            kernels.scan()
            kernels.watch_definitions()
            capture.installed.append("backend-select-collectives")
        except Exception as exc:
            capture.failed("install.backend_select", exc)


def _inductor_cache_dir() -> str:
    """Where Inductor writes generated modules (torch/_inductor/runtime/cache_dir_utils.py, whose
    cache_dir() creates the folder and sets the variable: not called here)."""
    import getpass
    import os
    import re
    import tempfile
    d = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if d:
        return d
    try:
        user = getpass.getuser()
    except Exception:
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


class WindowPools:
    """torch.cuda.MemPool objects known to be registered as symmetric windows: pool id -> comm."""

    def __init__(self):
        self.comm_of: dict = {}

    def mark(self, pool, comm: str) -> None:
        self.comm_of[_pool_key(pool)] = comm

    def comm(self, pool):
        return self.comm_of.get(_pool_key(pool))


def _pool_key(pool):
    pid = getattr(pool, "id", None)
    return tuple(pid) if isinstance(pid, (tuple, list)) else pid


def _patch_mem_pools(capture) -> None:
    """use_mem_pool on a pool registered as a window is a symmetric scope (GPU programs)."""
    windows = capture.window_pools = WindowPools()
    memory_mod = getattr(torch.cuda, "memory", None)
    original = getattr(memory_mod, "use_mem_pool", None)
    if original is None or getattr(original, "_hazsan", False):
        return

    @contextlib.contextmanager
    def use_mem_pool(pool, *args, **kwargs):
        comm = None
        try:
            comm = windows.comm(pool)
            if comm is not None:
                capture.enter_scope(f"mempool:{_pool_key(pool)}", comm)
        except Exception as exc:
            capture.failed("use_mem_pool", exc)
        try:
            with original(pool, *args, **kwargs):
                yield
        finally:
            if comm is not None:
                try:
                    capture.exit_scope(f"mempool:{_pool_key(pool)}", comm)
                except Exception as exc:
                    capture.failed("use_mem_pool", exc)

    use_mem_pool._hazsan = True
    use_mem_pool.__doc__ = original.__doc__
    memory_mod.use_mem_pool = use_mem_pool
    if getattr(torch.cuda, "use_mem_pool", None) is original:
        torch.cuda.use_mem_pool = use_mem_pool

    # Pools that become windows: ProcessGroupNCCL.register_mem_pool(pool, symm=True). (Torch
    # symmetric memory's get_mem_pool is not hooked: docs/capture-details.md, limits.)
    c10d = getattr(torch._C, "_distributed_c10d", None)
    pg_nccl = getattr(c10d, "ProcessGroupNCCL", None)
    reg = getattr(pg_nccl, "register_mem_pool", None)
    if reg is not None and not getattr(reg, "_hazsan", False):
        pg_nccl.register_mem_pool = register_mem_pool_hook(capture, windows, reg)


def register_mem_pool_hook(capture, windows: WindowPools, original):
    """ProcessGroupNCCL.register_mem_pool: C++ `registerMemPool(MemPool* pool, bool symm = false)`
    (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp): every segment of the pool is registered
    with the communicator, as a symmetric window only with symm=True; without it the registration
    is local (zero-copy user buffers), not a window. `self` is the backend, which has no
    `group_name`: distributed_c10d.py sets `backend_options.group_name = group_name`, the name the
    group's collectives carry (collectives.py)."""
    def register_mem_pool(self, pool, *args, **kwargs):
        r = original(self, pool, *args, **kwargs)
        try:
            symm = args[0] if args else kwargs.get("symm", False)
            if symm:
                windows.mark(pool, backend_group_name(self))
        except Exception as exc:
            capture.failed("register_mem_pool", exc)
        return r
    register_mem_pool._hazsan = True
    register_mem_pool.__doc__ = getattr(original, "__doc__", None)
    return register_mem_pool


def backend_group_name(backend) -> str:
    """The process group name of a c10d Backend (ProcessGroupNCCL, ProcessGroupGloo, ...)."""
    options = getattr(backend, "options", None)
    name = getattr(options, "group_name", None) or getattr(backend, "group_name", None)
    return str(name) if name else f"nccl:{id(backend):x}"
