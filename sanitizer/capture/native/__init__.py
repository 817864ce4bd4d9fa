"""The native recorder: capture's allocation source (and at level `full` its launch source) without a
dispatch mode.

Why: a Python TorchDispatchMode costs every op of the program its toll (2.5x a bare tiny op before
capture records anything), and a decode of small ops is host-bound, so capture at `alloc` cost a
real server 2-3x its CPU (issue 30, benchmarks/README.md). This recorder wraps torch's CPU
allocator in C++ (alloc_recorder.cpp) and records each allocation and free where it happens;
Python only turns the records into trace events, in batches, in order with its own events
(native_table.py). At level `full` a RecordFunction observer in the same extension records each op
the dispatch mode would have seen as a `launch` (docs/capture.md, "The native recorder"). Collectives, which the mode also caught, come from kernels registered at
torch's BackendSelect key for the collective ops (backend_select.py): a few per step.

When it is used (HAZSAN_NATIVE, docs/capture.md "The native recorder"): `auto` (the default) uses
it at levels `alloc` and `full` when it can be (a CPU build of torch, CPython 3.11, call sites at most `site`,
and the extension already built for this torch and source: `hazsan native build`), else the
dispatch mode, and the trace header says which path ran and why (`alloc_path`). `1` also builds it
at start if it is not built. `0` never uses it. A build that fails, or a module that will not load,
is the Python path with the reason in the header and one line on stderr: never a failed start.

The extension is built with torch.utils.cpp_extension against the installed torch, into a cache
folder keyed by the torch version, the Python version and a hash of the source
(HAZSAN_NATIVE_CACHE, else $XDG_CACHE_HOME/hazsan/native, else ~/.cache/hazsan/native). This
module never imports torch itself until asked to load.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("alloc_recorder.cpp")
#: A free made on a thread inside a collective's wait (alloc_recorder.cpp's record flag).
QUIET = 2
MODES = ("auto", "on", "off")
#: The records a process may hold between two drains before it counts drops (40 bytes each).
MAX_RECORDS = 1 << 24


class NativeUnavailable(Exception):
    """Why the native recorder cannot be used here (said in the trace header and on stderr)."""


def mode(environ=os.environ) -> str:
    raw = (environ.get("HAZSAN_NATIVE") or "auto").strip().lower()
    if raw in ("1", "on", "true", "yes", "build"):
        return "on"
    if raw in ("0", "off", "false", "no"):
        return "off"
    return "auto"


def cache_root(environ=os.environ) -> Path:
    d = environ.get("HAZSAN_NATIVE_CACHE")
    if d:
        return Path(d)
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hazsan" / "native"


def build_key(torch_version: str) -> str:
    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    h.update(torch_version.encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def refusal(torch) -> str | None:
    """Why this process cannot use the recorder at all (before any build), or None."""
    if sys.implementation.name != "cpython" or sys.version_info[:2] != (3, 11):
        return f"it reads CPython 3.11's frames; this is {sys.implementation.name} {sys.version.split()[0]}"
    if getattr(torch.version, "cuda", None) or getattr(torch.version, "hip", None):
        return ("a GPU build of torch: its device allocations come from the CUDA caching allocator, "
                "which this recorder does not wrap")
    return None


def _paths(torch):
    name = f"hazsan_native_{build_key(torch.__version__)}"
    folder = cache_root() / name
    return name, folder, folder / f"{name}.so"


def load(torch, build: bool = False):
    """The extension module for this torch, built first when `build` (under a file lock, so that
    ranks starting together build it once). Raises NativeUnavailable with the reason."""
    why = refusal(torch)
    if why:
        raise NativeUnavailable(why)
    name, folder, so = _paths(torch)
    if not so.exists():
        if not build:
            raise NativeUnavailable(f"not built for torch {torch.__version__} (`hazsan native build`, "
                                    f"about a minute, or HAZSAN_NATIVE=1)")
        _build(name, folder, so)
    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise NativeUnavailable(f"built module {so} does not load: {exc}") from exc
    return module


def _build(name: str, folder: Path, so: Path) -> None:
    import fcntl
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if so.exists():
            return                        # another process built it meanwhile
        try:
            from torch.utils import cpp_extension
            cpp_extension.load(name, sources=[str(SOURCE)], build_directory=str(folder),
                               extra_cflags=["-O2", "-DNDEBUG"], verbose=bool(os.environ.get("HAZSAN_DEBUG")))
        except BaseException as exc:      # a compiler or ninja missing, a header mismatch
            text = str(exc).strip().splitlines()
            raise NativeUnavailable(f"build failed: {type(exc).__name__}: {text[-1] if text else ''}"[:400]) from exc
        if not so.exists():
            raise NativeUnavailable(f"build made no {so.name} in {folder}")


def status(torch) -> dict:
    """What `hazsan native status` prints: whether this environment can use the recorder."""
    out = {"mode": mode(), "torch": torch.__version__, "python": sys.version.split()[0]}
    why = refusal(torch)
    if why:
        out.update(usable=False, reason=why)
        return out
    name, folder, so = _paths(torch)
    out.update(module=str(so), built=so.exists(), usable=so.exists())
    if not so.exists():
        out["reason"] = "not built (`hazsan native build`)"
    return out
