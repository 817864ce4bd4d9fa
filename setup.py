"""Build of hazsan's compiled engine (the project metadata is in pyproject.toml).

Cython compiles the engine's own source, sanitizer/rules/engine.py and the modules compiled with it
(sanitizer/rules/buildinfo.py's COMPILED; pure-Python mode, types in the .pxd files beside them),
into extension modules of the same names.
The .py files stay installed: `HAZSAN_ENGINE=interpreted` runs them as they are.

Where no compiler is found, the install goes on with a one-line warning and hazsan runs the
interpreted engine; with HAZSAN_REQUIRE_COMPILED=1 (CI) the build fails instead.

It also puts hooks/hazsan_capture.pth at the top of the wheel (site-packages), for editable
installs too: the line that starts capture in every interpreter when HAZSAN=1.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PTH = "hooks/hazsan_capture.pth"
REQUIRED = bool(os.environ.get("HAZSAN_REQUIRE_COMPILED"))


def _buildinfo():
    """sanitizer/rules/buildinfo.py, loaded by path (the package's dependencies are not here)."""
    spec = importlib.util.spec_from_file_location("hazsan_buildinfo", ROOT / "sanitizer/rules/buildinfo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BUILDINFO = _buildinfo()


def warn(exc: BaseException) -> None:
    if REQUIRED:
        raise SystemExit(f"hazsan: HAZSAN_REQUIRE_COMPILED is set and the compiled engine did not build: {exc}")
    print(f"WARNING: hazsan's compiled engine was not built ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
          "the interpreted engine runs instead (same findings, slower)", file=sys.stderr)


class OptionalBuildExt(build_ext):
    """A failed compile leaves the interpreted engine in place, unless HAZSAN_REQUIRE_COMPILED."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - no compiler, no headers: go on without it
            warn(exc)
            return
        if not self.extensions:
            return
        # where the compiled modules went: in the tree (editable, --inplace) and/or build_lib
        for base in {Path(self.build_lib), ROOT} if self.inplace or self.editable_mode else {Path(self.build_lib)}:
            target = base / BUILDINFO.DIGEST_FILE
            if target.parent.exists():
                target.write_text(BUILDINFO.source_digest(ROOT) + "\n")


class BuildPyWithPth(build_py):
    """Copies the capture .pth line to the wheel's top level (site-packages)."""

    def run(self):
        super().run()
        # An editable wheel is made of what its install command puts in the wheel's top level,
        # not of build_lib (setuptools' editable_wheel points install_purelib there).
        base = self.distribution.get_command_obj("install").install_purelib if self.editable_mode else self.build_lib
        target = Path(base) / Path(PTH).name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / PTH, target)

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / Path(PTH).name)]


def extensions() -> list[Extension]:
    if os.environ.get("HAZSAN_NO_COMPILE"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError as exc:
        warn(exc)
        return []
    modules = [Extension(src[:-3].replace("/", "."), [src]) for src in BUILDINFO.COMPILED]
    try:
        return cythonize(modules, language_level=3, quiet=True,
                         compiler_directives={"binding": False, "annotation_typing": False})
    except Exception as exc:  # noqa: BLE001 - Cython could not translate: the interpreted engine runs
        warn(exc)
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt, "build_py": BuildPyWithPth})
