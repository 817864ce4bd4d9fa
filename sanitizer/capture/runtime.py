"""The per-process capture state: settings, the trace writer, scopes, and hook-failure accounting.

One `Capture` per process (module global `_active`), created by `bootstrap.activate()`. Hooks in
torch_hooks / collectives / sglang_hooks call into it; every hook body runs under `guard` or an
explicit try/except that hands the exception to `failed()`, which counts it and writes a
`hook_error` event at the next flush: a hook never raises into the host program.
"""
from __future__ import annotations

import functools
import itertools
import os
import sys
import threading
import time

from sanitizer.capture.config import Settings
from sanitizer.capture.sites import SiteFinder
from sanitizer.capture.streams import StreamIds
from sanitizer.trace.writer import TraceWriter

_active: "Capture | None" = None
#: Whether any thread of this process ever entered a symmetric scope: until one does, an
#: allocation need not read its thread's scope stack (a thread-local read on every allocation).
SCOPES_ENTERED = False
# events that enqueue device work on their `stream`
_ENQUEUES = frozenset({"coll", "launch", "record", "graph_replay"})


def active() -> "Capture | None":
    return _active


_get_ident = threading.get_ident
#: threading.get_ident() of the process's main thread (thread 0 of the trace; after a fork, the
#: thread that forked: Capture.after_fork_in_child)
MAIN_THREAD = threading.main_thread().ident
_LANES: dict = {}


def cpu_lane() -> str:
    """The stream of a CPU access made by the calling thread: `cpu` on the main thread, else its
    own lane `cpu@<K>`, K its threading.get_ident() (docs/capture.md, "Host threads")."""
    k = _get_ident()
    if k == MAIN_THREAD:
        return "cpu"
    lane = _LANES.get(k)
    if lane is None:
        if len(_LANES) > 4096:
            _LANES.clear()
        lane = _LANES[k] = f"cpu@{k}"
    return lane


class ScopeStack(threading.local):
    """Symmetric scopes entered on this thread (innermost last): (pool, comm) pairs."""

    def __init__(self):
        self.stack: list = []

    def current(self):
        s = self.stack
        return s[-1] if s else None


class CollectiveDepth(threading.local):
    """Exactly one `coll` per collective, whichever layers it passes (docs/capture.md, "Exactly
    once"). A Python-level hook that records a collective itself (ops.py: SGLang's custom
    communicators) holds `depth` while its call runs. Inside it, the registered kernel it stands
    for (collective_ops.CUSTOM) and nested hooks stand back: the hook records that kernel once, named
    by its group. But when the call goes out through a path that records itself (torch.distributed
    at the dispatcher, pynccl's NCCLLibrary: a fallback, such as the multimem all-gather on a
    tensor its kernel does not take), that record carries the real op, comm and completion, and
    the hook must not add a second one that never completes: `recorded` counts the `coll` events
    written on this thread, and the hook records only when its call added none."""

    def __init__(self):
        self.depth = 0
        self.recorded = 0


class Capture:
    def __init__(self, settings: Settings):
        self.settings = settings
        from sanitizer.capture.config import run_id
        # `run` and `started` let `hazsan check` keep runs apart (reader.py: group_runs)
        self.writer = TraceWriter(os.path.abspath(settings.directory), max_events=settings.max_events,
                                  header_extra={"run": run_id(), "started": time.time_ns()},
                                  buffer_events=settings.buffer_events,
                                  flush_seconds=settings.flush_seconds,
                                  idle_seconds=getattr(settings, "idle_seconds", 0.05),
                                  step_flush_seconds=getattr(settings, "step_flush_seconds", 0.05),
                                  trace_format=getattr(settings, "trace_format", None))
        self.emit = self.writer.emit
        self.sites = SiteFinder(settings.stacks, settings.max_stack)
        self.scopes = ScopeStack()
        self.collective_depth = CollectiveDepth()
        self.streams = StreamIds()    # one id per device stream, shared by every hook
        self.step: int | None = None
        self.blocks = None        # block_table.BlockTable, once torch is imported
        self.backend_select = None  # native.backend_select.BackendSelectKernels (native recorder)
        self.arenas = None        # window.SymmetricArenas, on the first symmetric scope
        self.cuda = None          # cuda_hooks.CudaOrdering, once torch is imported
        self.alloc_history = None # allocator_history.AllocatorHistory under HAZSAN_ALLOC_SOURCE=history
        self.host_work_unsynced = False   # a CPU `launch` was written since the last cpu sync
        self.signals = None       # signals.SignalChain, once installed (bootstrap)
        self.speaks = False       # this process started its run: it says what the user must know (bootstrap)
        self.installed: list[str] = []   # names of the hooks installed (trace header, tests)
        self.on_scope_change = None  # native recorder: told the thread's innermost scope (native_table.py)
        # which path records allocations (`dispatch-mode` or `native`), and why not native
        self.alloc_path: dict = {}
        self.hooks_failed: dict[str, int] = {}   # hook name -> failures (trace header)
        self.versions: dict[str, str] = {}       # versions hooks learnt (the NCCL pynccl loaded)
        self._cids = itertools.count(1)  # coll ids, unique within the file, for every hook
        self.writer.header_source = self.header_facts
        self.writer.header_key = self.header_key

    def next_cid(self) -> int:
        return next(self._cids)

    def header_key(self) -> tuple:
        """What the header's facts depend on, cheap enough to ask at every flush: the writer
        writes the header again (in place) when it changes. Counts of failures are not in it (they
        are brought up to date at close), the distinct failing hooks are. torch counts once its
        hooks are installed (after its import, never while it imports: the flush thread asks)."""
        mods = sys.modules
        cuda = mods.get("torch.cuda") if self.installed else None
        try:       # never initialises CUDA: is_initialized() only reads a flag
            cuda_ready = bool(cuda is not None and cuda.is_initialized())
        except Exception:
            cuda_ready = False
        gaps = getattr(self, "coverage", None)
        return (len(self.installed), len(self.hooks_failed), len(self.versions),
                "sglang" in mods, "vllm" in mods, cuda_ready,
                (len(gaps.static), len(gaps.unrecorded)) if gaps is not None else None)

    def header_facts(self) -> dict:
        """Extra header keys, computed when the header is written: what was hooked, versions,
        the device (see facts.py)."""
        from sanitizer.capture.facts import header_facts
        return header_facts(self)

    # ---------------------------------------------------------------- failures
    def failed(self, hook: str, exc: BaseException) -> None:
        try:
            self.hooks_failed[hook] = self.hooks_failed.get(hook, 0) + 1
            self.writer.hook_failed(hook, exc)
            if os.environ.get("HAZSAN_DEBUG"):
                import traceback
                traceback.print_exception(exc)
        except Exception:
            pass

    def guard(self, hook: str):
        """Decorator: run a hook body; swallow and count its exceptions (returns None then)."""
        def deco(fn):
            @functools.wraps(fn)
            def wrapper(*a, **k):
                try:
                    return fn(*a, **k)
                except Exception as exc:
                    self.failed(hook, exc)
                    return None
            return wrapper
        return deco

    # ---------------------------------------------------------------- events
    def event(self, ev: dict, with_site: bool = True) -> dict:
        """Stamp and queue one event (t, and site/stack as configured)."""
        if self.host_work_unsynced and ev["ev"] in _ENQUEUES and ev.get("stream") != "cpu":
            self.host_ran_cpu_work()
        if ev["ev"] == "coll":
            self.collective_depth.recorded += 1
        ev["t"] = time.time_ns()
        if with_site:
            site, stack = self.sites.where()
            if site is not None:
                ev["site"] = site
            if stack is not None:
                ev["stack"] = stack
        self.emit(ev)
        return ev

    def host_ran_cpu_work(self) -> None:
        """CPU ops run synchronously on the host: by the time the host enqueues work on another
        stream, every `launch` on stream "cpu" before it has finished. Say so with one sync of
        the cpu stream, written lazily (only before such an enqueue), not after every CPU op.
        Only the main thread's: `cpu` holds its accesses alone (another thread's are on its own
        lane, complete at once for it), and another thread knows nothing of them by itself."""
        if _get_ident() != MAIN_THREAD:
            return
        self.host_work_unsynced = False
        self.emit({"ev": "sync", "stream": "cpu", "t": time.time_ns()})

    def mark_step(self, n: int, phase: str | None = None, tokens: int | None = None) -> None:
        """Start of decode step n: record it; flush what the previous step produced (where the
        program marks step ends, end_step flushes it, or a later flush does)."""
        if self.alloc_history is not None:
            self.alloc_history.drain()     # the previous step's segments, before its end
        ev = {"ev": "step", "n": int(n), "t": time.time_ns()}
        if phase is not None:
            ev["phase"] = str(phase)
        if tokens is not None:
            ev["tokens"] = int(tokens)
        if self.backend_select is not None and self.step is None:
            try:          # collective ops a server registered since torch.distributed's import
                self.backend_select.scan()
            except Exception as exc:
                self.failed("native.backend_select", exc)
        self.step = int(n)
        self.writer.mark_step(int(n), ended=False)
        self.emit(ev)
        if not self.writer.step_ends:
            # a program that marks step ends has them flushed by end_step: what came between
            # (the host's work between two steps) waits in the buffer with this step's events
            self.writer.flush()

    def end_step(self, n: int) -> None:
        """Step n's own call returned (SGLang's run_batch, vLLM's execute_model): its events are
        flushed and the header says the step ended (what `hazsan check` tells of a process killed
        afterwards: nothing recorded during a step is missing), at once if the last flush is
        HAZSAN_STEP_FLUSH_SECONDS old, else with the next flush (TraceWriter.end_step)."""
        self.writer.end_step(int(n))

    # ---------------------------------------------------------------- scopes
    def enter_scope(self, pool: str, comm: str, name: str = "symm") -> None:
        global SCOPES_ENTERED
        SCOPES_ENTERED = True
        self.scopes.stack.append((pool, comm))
        if self.on_scope_change is not None:
            self.on_scope_change(self.scopes.stack)
        self.event({"ev": "scope", "name": name, "enter": True, "pool": pool, "comm": comm})

    def exit_scope(self, pool: str, comm: str, name: str = "symm") -> None:
        stack = self.scopes.stack
        if stack and stack[-1] == (pool, comm):
            stack.pop()
        elif (pool, comm) in stack:            # exited out of order: drop the innermost match
            del stack[len(stack) - 1 - stack[::-1].index((pool, comm))]
        if self.on_scope_change is not None:
            self.on_scope_change(stack)
        self.event({"ev": "scope", "name": name, "enter": False, "pool": pool, "comm": comm})

    def arenas_model(self):
        if self.arenas is None:
            from sanitizer.capture.window import SymmetricArenas
            self.arenas = SymmetricArenas(self)
        return self.arenas

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Capture is on: the time flush starts; the trace file and its header are written when
        torch is imported (bootstrap), before any event, so a process killed before its first
        flush still leaves one."""
        try:
            # The file is made when torch is imported (bootstrap), the first moment anything can be
            # recorded: a process that never imports torch (a launcher, multiprocessing's resource
            # tracker, which SGLang's shutdown SIGKILLs with the rest) leaves no header-only file.
            self.writer.start(open_file=False)
        except Exception as exc:
            self.failed("writer.start", exc)

    def close(self) -> None:
        try:
            # A process where nothing was hooked (it never imported torch: a launcher, a resource
            # tracker) is no rank and leaves no file; one with hooks leaves at least its header.
            if self.alloc_history is not None:
                self.alloc_history.close()
            self.writer.write_empty = bool(self.installed)
            self.writer.close()
        except Exception:
            pass

    def after_fork_in_child(self) -> None:
        """A forked child owns its own trace: reset the writer (its own file and header at once, its
        own time flush), then re-declare inherited blocks. The child subprocess forks to exec another
        program (a `preexec_fn` runs the fork handlers) starts no file: exec runs no exit handler,
        so the file would stay behind header-only, read as a killed process."""
        try:
            global MAIN_THREAD
            MAIN_THREAD = threading.main_thread().ident     # the thread that forked
            self.writer.discard_after_fork(start=not _in_subprocess_exec_child())
            if self.blocks is not None:
                self.blocks.redeclare_after_fork()
            # multiprocessing's fork children end with os._exit (no atexit): flush from its exit
            # hook instead, after every other finalizer. Process._bootstrap clears the finalizer
            # registry before running after-fork callbacks, so register from one of those.
            mp_util = sys.modules.get("multiprocessing.util")
            if mp_util is not None:
                mp_util.register_after_fork(self, _close_at_multiprocessing_exit)
        except Exception as exc:
            self.failed("fork", exc)


def _in_subprocess_exec_child() -> bool:
    """Whether this fork handler runs in the child of subprocess.Popen, between fork and exec:
    _posixsubprocess runs the fork handlers there only for a preexec_fn, called from the Python
    frame of Popen._execute_child."""
    try:
        frame = sys._getframe(1)
        for _ in range(8):
            if frame is None:
                return False
            code = frame.f_code
            if code.co_name == "_execute_child" and code.co_filename.endswith("subprocess.py"):
                return True
            frame = frame.f_back
    except Exception:
        pass
    return False


def _close_at_multiprocessing_exit(cap: "Capture") -> None:
    import multiprocessing.util as mp_util
    mp_util.Finalize(cap, Capture.close, args=(cap,), exitpriority=-1000)


def comm_name(comm) -> str:
    """The communicator name recorded in traces: a ProcessGroup's group_name (what `coll` events
    carry), an SGLang GroupCoordinator's device group's name, or the string given."""
    if isinstance(comm, str):
        return comm
    if comm is None:
        try:
            import torch.distributed as dist
            comm = dist.group.WORLD
        except Exception:
            return "world"
        if comm is None:
            return "world"
    for holder in (getattr(comm, "device_group", None), comm):
        name = getattr(holder, "group_name", None)
        if isinstance(name, str) and name:
            return name
    name = getattr(comm, "unique_name", None)
    return name if isinstance(name, str) and name else str(comm)
