"""Hatchling build hook: compiles the C engine accelerator (sanitizer/rules/_fastengine.c).

`pip install .` and `pip install -e .` run it. It builds the CPython extension with the C compiler
this interpreter was built with (sysconfig: CC, CCSHARED, LDSHARED), next to its source, and checks
that the result imports. On ANY failure (no compiler, no Python headers, a compile error, a
platform without __int128) it prints a warning and the install goes on: hazsan then runs the
pure-Python engine (sanitizer/rules/engine.py), with the same findings, about 4x slower.

    python hatch_build.py          # (re)build in place, for a checkout; prints what it did
    HAZSAN_NO_NATIVE=1 pip install -e .   # skip the build altogether
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SOURCE = Path("sanitizer/rules/_fastengine.c")
MODULE = "sanitizer.rules._fastengine"
OPT_FLAGS = ["-O2", "-fno-strict-aliasing", "-fvisibility=hidden"]


class NativeBuildError(Exception):
    pass


def extension_path(root: Path = ROOT) -> Path:
    """Where the built extension goes: next to its source, named for this interpreter."""
    return root / SOURCE.parent / ("_fastengine" + sysconfig.get_config_var("EXT_SUFFIX"))


def source_digest(root: Path = ROOT) -> str:
    """Compiled into the extension; native.py refuses a build whose source has changed since."""
    return hashlib.sha256((Path(root) / SOURCE).read_bytes()).hexdigest()[:16]


def _run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise NativeBuildError(f"{shlex.join(cmd)}\n{(r.stderr or r.stdout).strip()[-4000:]}")


def build(root: Path = ROOT, out: Path | None = None, extra_cflags: list[str] | None = None,
          debug: bool = False) -> Path:
    """Compile the extension; returns its path. Raises NativeBuildError with the compiler output."""
    root = Path(root)
    src = root / SOURCE
    out = Path(out) if out is not None else extension_path(root)
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    ldshared = shlex.split(sysconfig.get_config_var("LDSHARED") or f"{cc[0]} -shared")
    if os.environ.get("CC"):  # the usual override; the link step follows it
        env_cc = shlex.split(os.environ["CC"])
        ldshared = env_cc + (ldshared[len(cc):] if ldshared[:len(cc)] == cc else ["-shared"])
        cc = env_cc
    ccshared = shlex.split(sysconfig.get_config_var("CCSHARED") or "-fPIC")
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise NativeBuildError(f"no Python.h in {include} (install the Python development headers)")
    flags = ["-g", "-O0", "-UNDEBUG"] if debug else [*OPT_FLAGS, "-DNDEBUG"]
    flags += list(extra_cflags or ())
    flags.append(f'-DHAZSAN_SOURCE_DIGEST="{source_digest(root)}"')
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        obj = Path(tmp) / "_fastengine.o"
        lib = Path(tmp) / out.name
        _run([*cc, *ccshared, *flags, "-std=gnu11", "-Wall", "-I", include, "-c", str(src), "-o", str(obj)])
        _run([*ldshared, *(f for f in flags if f.startswith("-f") or f == "-g"),
              str(obj), "-o", str(lib)])
        # it must import and configure, in a fresh interpreter, before it replaces anything
        check = ("import importlib.util, sys; "
                 f"spec = importlib.util.spec_from_file_location({MODULE!r}, {str(lib)!r}); "
                 "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
                 "assert hasattr(m, 'Analyzer')")
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        r = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, env=env)
        if r.returncode != 0 and "-fsanitize" not in " ".join(flags):
            raise NativeBuildError(f"the built extension does not import:\n{r.stderr.strip()[-2000:]}")
        tmp_out = out.with_name(out.name + ".tmp")
        tmp_out.write_bytes(lib.read_bytes())
        os.replace(tmp_out, out)  # atomic: a running hazsan never sees half a file
    return out


def warn(exc: BaseException) -> None:
    bar = "=" * 78
    print(f"\n{bar}\nWARNING: hazsan could not build its C engine accelerator ({SOURCE}).\n"
          f"hazsan works without it: `hazsan check` uses the pure-Python engine (same findings,\n"
          f"about 4x slower). To retry: python hatch_build.py\nReason: {exc}\n{bar}\n",
          file=sys.stderr, flush=True)


try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # running as a script without hatchling
    BuildHookInterface = object  # type: ignore[misc,assignment]


class NativeEngineBuildHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    """Builds the extension for the wheel and editable targets; never fails the install."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict) -> None:
        if self.target_name != "wheel" or os.environ.get("HAZSAN_NO_NATIVE"):
            return
        try:
            out = build(Path(self.root))
        except Exception as exc:  # noqa: BLE001 - any failure means: go on without it
            warn(exc)
            # an older build left in the tree would not match the source: the Python engine runs
            with contextlib.suppress(OSError):
                extension_path(Path(self.root)).unlink()
            return
        rel = out.relative_to(Path(self.root)).as_posix()
        if version != "editable":
            # a platform wheel that carries the extension inside the package
            build_data["force_include"][str(out)] = rel
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
        print(f"hazsan: built the C engine accelerator: {rel}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Build hazsan's C engine accelerator in place.")
    ap.add_argument("--debug", action="store_true", help="-O0 -g, assertions on")
    ap.add_argument("--cflags", default="", help="extra compiler flags, e.g. '-fsanitize=address'")
    ap.add_argument("--out", help="write the extension here instead of next to its source")
    ns = ap.parse_args()
    try:
        path = build(ROOT, ns.out, shlex.split(ns.cflags), debug=ns.debug)
    except NativeBuildError as exc:
        warn(exc)
        sys.exit(1)
    print(f"built {path}")
