"""Which source the compiled engine was built from (used by setup.py at build time and by the
driver at run time; standard library only, so that setup.py can load it without the package's
dependencies).

A checkout keeps the extension modules that `pip install -e .` compiled; after an edit of the
engine's source they would run the old algorithm. The build writes the digest of the source into
engine_build.digest beside the engine; the driver refuses a compiled engine whose digest is not
the source's (it then runs the interpreted engine, or fails where HAZSAN_REQUIRE_COMPILED is set).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

#: The modules Cython compiles, each a module of its own (extension of the same name), those
#: another imports first (sanitizer.rules.select loads them in this order when interpreted).
COMPILED = ("sanitizer/order/clocks.py", "sanitizer/rules/kinds.py", "sanitizer/rules/records.py",
            "sanitizer/rules/intervals.py", "sanitizer/rules/inflight.py", "sanitizer/rules/successor.py",
            "sanitizer/rules/windows.py", "sanitizer/rules/matcher.py", "sanitizer/rules/engine.py")
#: The engine's source, relative to the directory that holds the `sanitizer` package: the compiled
#: modules and the types Cython reads beside them.
SOURCES = COMPILED + ("sanitizer/order/clocks.pxd", "sanitizer/rules/kinds.pxd", "sanitizer/rules/records.pxd",
                      "sanitizer/rules/intervals.pxd", "sanitizer/rules/inflight.pxd",
                      "sanitizer/rules/successor.pxd", "sanitizer/rules/windows.pxd",
                      "sanitizer/rules/engine.pxd")
DIGEST_FILE = "sanitizer/rules/engine_build.digest"


def source_digest(root: Path) -> str | None:
    """sha256 prefix over the engine's source files under `root`; None if any is missing."""
    h = hashlib.sha256()
    for name in SOURCES:
        try:
            data = (Path(root) / name).read_bytes()
        except OSError:
            return None
        h.update(name.encode() + b"\0" + data)
    return h.hexdigest()[:16]


def built_digest(root: Path) -> str | None:
    try:
        return (Path(root) / DIGEST_FILE).read_text().strip() or None
    except OSError:
        return None
