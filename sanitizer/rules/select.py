"""Which engine runs: the compiled one (Cython's build of the engine's source) or that source run
by the interpreter (docs/cli.md, "hazsan check": `HAZSAN_ENGINE=auto|compiled|interpreted`; auto:
compiled where it was built and is not stale).

Cython compiles the engine's modules (buildinfo.COMPILED: the algorithm, its clocks, its interval
indexes, the cross-rank matcher) into extension modules of the same names, which the import
system prefers over the .py files. The interpreted engine is those .py files loaded as modules
of their own (private names), each one's imports of the others pointed at their interpreted
copies while it loads.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from sanitizer.rules import buildinfo

ENV = "HAZSAN_ENGINE"
CHOICES = ("auto", "compiled", "interpreted")
#: CI sets it: a missing compiled engine is then an error, not a fallback.
REQUIRE_ENV = "HAZSAN_REQUIRE_COMPILED"
INTERPRETED = "sanitizer.rules._engine_interpreted"


def _module_name(source: str) -> str:
    return source[:-3].replace("/", ".")


def _private_name(name: str) -> str:
    """sanitizer.order.clocks -> sanitizer.order._clocks_interpreted"""
    package, _, last = name.rpartition(".")
    return f"{package}._{last}_interpreted"


def _engine_modules() -> list:
    """The engine's modules, imported (compiled where built), dependencies first."""
    return [importlib.import_module(_module_name(src)) for src in buildinfo.COMPILED]


def _load_interpreted():
    """The engine's source run by the interpreter, even where the compiled modules sit beside it."""
    loaded = sys.modules.get(INTERPRETED)
    if loaded is not None:
        return loaded
    modules = _engine_modules()
    engine_mod = modules[-1]
    if not any(_is_compiled(m) for m in modules):
        sys.modules[INTERPRETED] = engine_mod
        return engine_mod
    sources = [Path(m.__file__).with_name(Path(src).name) for m, src in zip(modules, buildinfo.COMPILED)]
    missing = [str(s) for s in sources if not s.exists()]
    if missing:
        raise RuntimeError(f"the engine's source is not installed: {', '.join(missing)}")
    saved = {m.__name__: m for m in modules}
    try:
        loaded = None
        for m, src in zip(modules, sources):
            private = INTERPRETED if m is engine_mod else _private_name(m.__name__)
            spec = importlib.util.spec_from_file_location(private, src)
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[private] = loaded
            spec.loader.exec_module(loaded)
            sys.modules[m.__name__] = loaded  # what the next module imports while it loads
        return loaded
    finally:
        sys.modules.update(saved)


def _is_compiled(module) -> bool:
    return not str(getattr(module, "__file__", "")).endswith(".py")


def compiled_available() -> tuple[bool, str | None]:
    """(True, None) where the compiled engine loaded, else (False, why not)."""
    modules = _engine_modules()
    missing = [m.__name__ for m in modules if not _is_compiled(m)]
    if missing:
        return False, (f"the compiled engine is not built ({', '.join(missing)} run from source); "
                       "reinstall with a C compiler: pip install -e .")
    root = Path(modules[-1].__file__).resolve().parents[2]
    source = buildinfo.source_digest(root)
    if source is not None and source != buildinfo.built_digest(root):
        return False, ("the compiled engine was built from another version of its source; "
                       "rebuild: pip install -e . (or python setup.py build_ext --inplace)")
    return True, None


def load_engine(choice: str | None = None):
    """(engine module, 'compiled' or 'interpreted', why the compiled one did not run or None) for
    `choice` (default: $HAZSAN_ENGINE, else auto)."""
    choice = (choice if choice is not None else os.environ.get(ENV, "auto")).strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "interpreted":
        return _load_interpreted(), "interpreted", None
    ok, why = compiled_available()
    if ok:
        import sanitizer.rules.engine as engine_mod

        return engine_mod, "compiled", None
    if choice == "compiled" or os.environ.get(REQUIRE_ENV):
        raise RuntimeError(f"{ENV}={choice}: {why}" if choice == "compiled" else f"{REQUIRE_ENV} is set: {why}")
    return _load_interpreted(), "interpreted", why
