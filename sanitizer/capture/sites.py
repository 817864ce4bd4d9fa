"""Call sites: the innermost frame outside torch, hazsan and the import machinery.

The decision "is this code object internal?" is cached per code object, so a lookup is a short
walk over frames with one dict hit each (no string work after the first visit).
"""
from __future__ import annotations

import os
import sys
import sysconfig


class SiteFinder:
    def __init__(self, mode: str = "site", max_stack: int = 16, internal_dirs=()):
        self.mode = mode
        self.max_stack = max_stack
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the sanitizer package
        dirs = [here + os.sep]
        for d in internal_dirs:
            if d:
                dirs.append(os.path.abspath(d) + os.sep)
        self.prefixes = tuple(dirs)
        # The standard library (multiprocessing's bootstrap, threading, runpy, unittest) is never
        # the program's call site; site-packages can sit inside its folder (a non-venv install),
        # and stays the program's. torch.testing is test code: its frames are the caller's.
        self.stdlib = tuple(os.path.abspath(p) + os.sep for p in {sysconfig.get_paths().get("stdlib"),
                                                                  sysconfig.get_paths().get("platstdlib")} if p)
        self.external: tuple = ()
        self.cwd = os.getcwd() + os.sep
        self._names: dict = {}   # id(code) -> (code, display file name or None when internal)
        self.on_change = None    # called after the rules change (the native recorder keeps a copy)

    def add_internal(self, module) -> None:
        """Treat `module` as internal: every file of a package (torch, wrapt, ...), or the one file
        of a single-file module (typing_extensions.py sits directly in site-packages: its folder
        is where every installed package lives, sglang and the user's own included)."""
        path = getattr(module, "__file__", None)
        if not path:
            return
        path = os.path.abspath(path)
        if hasattr(module, "__path__"):
            prefix = os.path.dirname(path) + os.sep
        else:
            prefix = os.path.splitext(path)[0] + "."    # typing_extensions.py and its .pyc
        self.prefixes += (prefix,)
        self._changed()

    def add_external_dir(self, path: str) -> None:
        """Treat files under `path` as the program's even inside an internal package (torch's
        own test code, torch/testing)."""
        self.external += (os.path.abspath(path) + os.sep,)
        self._changed()

    def add_internal_dir(self, path: str) -> None:
        """Treat every file under folder `path` as internal (generated code, such as Inductor's)."""
        self.prefixes += (os.path.abspath(path) + os.sep,)
        self._changed()

    def _changed(self) -> None:
        self._names.clear()
        if self.on_change is not None:
            try:
                self.on_change(self)
            except Exception:
                pass

    def _name(self, code):
        return self._entry(code)[1]

    def _entry(self, code):
        """(code, display file name or None when internal, {f_lasti: site text}) for a code
        object, made on its first visit."""
        # Keyed by id(code): hashing a code object hashes its bytecode and constants on every
        # lookup. The entry keeps the code object, so an id reused after the code died is noticed.
        entry = self._names.get(id(code))
        if entry is not None and entry[0] is code:
            return entry
        fn = code.co_filename
        if fn.startswith(self.external):
            name = fn[len(self.cwd):] if fn.startswith(self.cwd) else fn
        elif fn.startswith("<frozen") or fn.startswith(self.prefixes) or fn.endswith(("contextlib.py", "threading.py")) \
                or (fn.startswith(self.stdlib) and "-packages" + os.sep not in fn):
            name = None
        else:
            name = fn[len(self.cwd):] if fn.startswith(self.cwd) else fn
        entry = self._names[id(code)] = (code, name, {} if name is not None else None)
        return entry

    def where(self) -> tuple[str | None, list | None]:
        """(site, stack) of the innermost external frame; stack only in "full" mode."""
        if self.mode == "none":
            return None, None
        f = sys._getframe(1)
        # This runs on every recorded allocation: the cache hit of _entry is inlined (a method
        # call per frame is a third of the walk's cost), and _entry is called only on a code
        # object's first visit. A frame's site text is cached per (code object, last instruction):
        # the instruction decides the line, so the line table is decoded and the text formatted
        # once per code location, not once per allocation.
        names = self._names
        if self.mode == "site":
            while f is not None:
                code = f.f_code
                entry = names.get(id(code))
                if entry is None or entry[0] is not code:
                    entry = self._entry(code)
                texts = entry[2]
                if texts is not None:
                    lasti = f.f_lasti
                    site = texts.get(lasti)
                    if site is None:
                        site = texts[lasti] = f"{entry[1]}:{f.f_lineno}:{code.co_name}"
                    return site, None
                f = f.f_back
            return None, None
        stack = []
        while f is not None and len(stack) < self.max_stack:
            code = f.f_code
            entry = names.get(id(code))
            if entry is None or entry[0] is not code:
                entry = self._entry(code)
            texts = entry[2]
            if texts is not None:
                lasti = f.f_lasti
                site = texts.get(lasti)
                if site is None:
                    site = texts[lasti] = f"{entry[1]}:{f.f_lineno}:{code.co_name}"
                stack.append(site)
            f = f.f_back
        return (stack[0] if stack else None), (stack or None)
