"""Turn capture on in this process: called by the .pth line when HAZSAN is set.

Nothing here imports torch: torch, torch.distributed, SGLang and vLLM are patched by post-import hooks
(wrapt) when, and only if, the program imports them. Everything is wrapped so that a failure to
set up capture prints one line on stderr and leaves the program running untouched.
"""
from __future__ import annotations

import atexit
import os
import sys

SGLANG_ALLOCATOR = "sglang.srt.distributed.device_communicators.pynccl_allocator"
SGLANG_SCHEDULER = "sglang.srt.managers.scheduler"
SGLANG_ENGINE = "sglang.srt.entrypoints.engine"
# NCCL's ctypes wrapper and the communicator built on it: SGLang's, and vLLM's (same class shape)
PYNCCL_WRAPPERS = ("sglang.srt.distributed.device_communicators.pynccl_wrapper",
                   "vllm.distributed.device_communicators.pynccl_wrapper")
PYNCCL_COMMUNICATORS = ("sglang.srt.distributed.device_communicators.pynccl",
                        "vllm.distributed.device_communicators.pynccl")
# vLLM's model runners (V1 and V2): execute_model is its step (vllm_hooks.py)
VLLM_MODEL_RUNNERS = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")


def activate(environ=os.environ):
    """Start capture in this process (idempotent). Returns the Capture, or None on failure (and
    None, doing nothing, in hazsan's own commands: `hazsan check` with HAZSAN=1 exported is no
    program to capture)."""
    try:
        # imported here, inside the try: a broken install must not break the program's start-up
        from sanitizer.capture import runtime
        from sanitizer.capture.config import RUN_ENV, Settings, unknown_settings
        if runtime._active is not None:
            return runtime._active
        if _is_hazsan_command():
            return None
        # The process that starts a run (none inherited its id) speaks for it on stderr: the bad
        # settings at start, where the traces are at exit. Its children, `hazsan run`'s command
        # and the pytest plugin's session (which report themselves) stay quiet.
        root = not (environ.get(RUN_ENV) or "").strip()
        settings, problems = Settings.from_env(environ)
        problems += unknown_settings(environ)
        cap = runtime.Capture(settings)
        runtime._active = cap
        cap.speaks = root
        for p in problems:
            cap.failed("settings", ValueError(p))
            if root:
                print(f"hazsan: {p}", file=sys.stderr)
        _register_import_hooks(cap)
        atexit.register(cap.close)
        if root:
            atexit.register(_say_where, cap)      # after close (atexit runs last registered first)
        from sanitizer.capture.signals import SignalChain
        cap.signals = SignalChain(cap)
        cap.signals.install()
        os.register_at_fork(after_in_child=cap.after_fork_in_child)
        cap.start()        # the file and its header now; then the time flush
        return cap
    except Exception as exc:   # never break the host program's start-up
        print(f"hazsan: capture not started: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def _is_hazsan_command() -> bool:
    """Whether this interpreter runs hazsan's own command line (`hazsan ...`, `python -m sanitizer`)."""
    argv = getattr(sys, "orig_argv", None) or sys.argv
    for i, arg in enumerate(argv):
        if arg == "-m":
            return i + 1 < len(argv) and argv[i + 1] in ("sanitizer", "sanitizer.cli")
        if arg == "-c":
            return False
        if i > 0 and not arg.startswith("-"):         # the script the interpreter runs
            return os.path.basename(arg) == "hazsan"
    return False


def _say_where(cap) -> None:
    """At exit of the run's first process: one line, where the traces are and what to run next."""
    try:
        d = cap.writer.directory
        if os.path.isdir(d):
            rel = os.path.relpath(d)
            shown = d if rel.startswith("..") else rel
            print(f"hazsan: traces in {shown} (run {os.environ.get('HAZSAN_RUN_ID', '?')}); "
                  f"next: hazsan check {shown}", file=sys.stderr)
        else:
            print("hazsan: no trace was written (capture records a process once it imports torch)",
                  file=sys.stderr)
    except Exception:
        pass


def plugin() -> None:
    """Entry point of the `sglang.srt.plugins` and `vllm.general_plugins` groups: start capture
    where the .pth line is not read (an environment that skips .pth files, an embedded
    interpreter). Same switch as the .pth line: nothing happens unless HAZSAN is set. Modules the
    server imported already are patched at once (post-import hooks fire for them immediately)."""
    from sanitizer.capture.config import requested
    if requested():
        cap = activate()
        if cap is not None and "plugin" not in cap.installed:
            cap.installed.append("plugin")


def _register_import_hooks(cap) -> None:
    import wrapt

    def hook(name, fn):
        def run(module):
            try:
                fn(module)
            except Exception as exc:
                cap.failed(f"import.{name}", exc)
        wrapt.register_post_import_hook(run, name)

    def on_torch(module):
        from sanitizer.capture import torch_hooks
        cap.writer.open_now()     # from here on events can be recorded: the file exists before any
        torch_hooks.on_torch(cap)
        # torch.distributed is imported while torch itself loads: patch it once torch is complete.
        hook("torch.distributed", lambda m: torch_hooks.on_distributed(cap))

    hook("torch", on_torch)

    def on_allocator(module):
        from sanitizer.capture import sglang_hooks
        sglang_hooks.on_pynccl_allocator(cap, module)

    def on_scheduler(module):
        from sanitizer.capture import sglang_hooks
        sglang_hooks.on_scheduler(cap, module)

    def on_wrapper(module):
        from sanitizer.capture import sglang_hooks
        sglang_hooks.on_pynccl_wrapper(cap, module)

    def on_engine(module):
        from sanitizer.capture import sglang_hooks
        sglang_hooks.on_engine(cap, module)

    def on_communicator(module):
        from sanitizer.capture import sglang_hooks
        sglang_hooks.on_pynccl(cap, module)

    def on_vllm(module):
        from sanitizer.capture import vllm_hooks
        vllm_hooks.on_vllm(cap, module)

    def on_vllm_runner(module):
        from sanitizer.capture import vllm_hooks
        vllm_hooks.on_model_runner(cap, module)

    def on_functional_collectives(module):
        from sanitizer.capture import compiled
        compiled.on_functional_collectives(cap, module)

    hook("torch.distributed._functional_collectives", on_functional_collectives)
    hook(SGLANG_ALLOCATOR, on_allocator)
    hook(SGLANG_SCHEDULER, on_scheduler)
    hook(SGLANG_ENGINE, on_engine)

    def on_unrecorded(module):       # collective paths not recorded: coverage gaps once used
        from sanitizer.capture import sglang_hooks
        sglang_hooks.on_unrecorded_collectives(cap, module)

    for name in ("sglang.srt.layers.flashinfer_comm_fusion",
                 "sglang.srt.distributed.device_communicators.custom_all_reduce_v2"):
        hook(name, on_unrecorded)
    for name in PYNCCL_WRAPPERS:
        hook(name, on_wrapper)
    for name in PYNCCL_COMMUNICATORS:
        hook(name, on_communicator)
    hook("vllm", on_vllm)
    for name in VLLM_MODEL_RUNNERS:
        hook(name, on_vllm_runner)

    def on_op_module(module):
        from sanitizer.capture import ops
        ops.install_for(cap, module)

    from sanitizer.capture.ops import OPS     # a plain table: imports nothing
    for name in OPS:
        hook(name, on_op_module)
