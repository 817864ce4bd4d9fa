"""The scanned tree: file discovery, module names, lazy parsing (ast only, nothing is imported).

Files are parsed on demand and cached, so a scan of a large tree parses only the files that
mention a scope and the modules its helpers live in. A file that cannot be read or parsed becomes
a `SourceProblem` (file, line, message) and the scan goes on.
"""
from __future__ import annotations

import ast
import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path

SKIP_DIRS = frozenset({".git", "__pycache__", ".venv", "venv", ".tox", "node_modules", ".mypy_cache"})


@dataclass(frozen=True)
class SourceProblem:
    file: str
    line: int | None
    message: str

    def as_dict(self) -> dict:
        return {"file": self.file, "line": self.line, "message": self.message}


@dataclass(eq=False)
class SourceFile:
    path: Path       # on disk
    rel: str         # relative to the PATH given (posix); what reports show
    module: str      # dotted name from the package structure (walking up __init__.py files)
    rel_module: str  # dotted name of `rel` under the PATH's own name (sglang/srt/x.py -> sglang.srt.x)
    bare_module: str  # dotted name of `rel` alone (srt.x), for script-style trees


@dataclass(eq=False)
class ClassInfo:
    module: "ModuleInfo"
    node: ast.ClassDef
    qualname: str
    methods: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"ClassInfo({self.module.rel}:{self.node.lineno} {self.qualname})"

    @property
    def is_plain_record(self) -> bool:
        """dataclass / NamedTuple / Enum: constructing one allocates no tensors by itself."""
        for dec in self.node.decorator_list:
            text = ast.unparse(dec)
            if "dataclass" in text:
                return True
        return any(ast.unparse(b).split(".")[-1] in ("NamedTuple", "Enum", "IntEnum", "TypedDict")
                   for b in self.node.bases)


@dataclass(eq=False)
class ModuleInfo:
    source: SourceFile
    tree: ast.Module
    text: str
    imports: dict[str, str] = field(default_factory=dict)       # local name -> qualified name
    functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = field(default_factory=dict)
    classes: dict[str, ClassInfo] = field(default_factory=dict)
    star_imports: list[str] = field(default_factory=list)     # `from x import *` -> "x"
    _parents: dict[int, ast.AST] | None = None
    _lines: list[str] | None = None
    _positions: dict[int, dict[int, int]] | None = None

    def __repr__(self) -> str:
        return f"ModuleInfo({self.source.rel})"

    @property
    def rel(self) -> str:
        return self.source.rel

    @property
    def package(self) -> str:
        name = self.source.module
        return name if self.source.path.name == "__init__.py" else name.rpartition(".")[0]

    def parent(self, node: ast.AST) -> ast.AST | None:
        if self._parents is None:
            self._parents = {id(child): node for node in ast.walk(self.tree)
                             for child in ast.iter_child_nodes(node)}
        return self._parents.get(id(node))

    def position(self, stmt: ast.AST, block: list) -> int | None:
        """Index of `stmt` in `block` (a statement list), by identity; O(1) after one pass."""
        if self._positions is None:
            self._positions = {}
        table = self._positions.get(id(block))
        if table is None:
            table = self._positions[id(block)] = {id(s): i for i, s in enumerate(block)}
        return table.get(id(stmt))

    def lines(self, first: int, last: int) -> list[str]:
        if self._lines is None:
            self._lines = self.text.splitlines()
        return self._lines[first - 1:last]


class SourceTree:
    """Every *.py under the PATHs given, indexed by module name; parsed lazily."""

    def __init__(self, roots: list[Path], exclude: tuple[str, ...] = ()):
        self.files: list[SourceFile] = []
        self.problems: list[SourceProblem] = []
        self._by_module: dict[str, SourceFile] = {}
        self._by_rel_module: dict[str, SourceFile] = {}
        self._by_bare_module: dict[str, SourceFile] = {}
        self._by_path: dict[Path, SourceFile] = {}
        self._parsed: dict[int, ModuleInfo | None] = {}
        for root in roots:
            self._discover(root, exclude)
        for sf in self.files:
            self._by_module.setdefault(sf.module, sf)
            self._by_rel_module.setdefault(sf.rel_module, sf)
            self._by_bare_module.setdefault(sf.bare_module, sf)

    # -- discovery --------------------------------------------------------------------------
    def _discover(self, root: Path, exclude: tuple[str, ...]) -> None:
        if root.is_file():
            candidates, base = [root], root.parent
        else:
            candidates, base = self._walk(root), root
        root_name = Path(_real(root)).name
        for path in candidates:
            rel = path.relative_to(base).as_posix()
            if any(fnmatch.fnmatchcase(rel, pat) for pat in exclude):
                continue
            resolved = Path(_real(path))
            if resolved in self._by_path:
                continue
            bare = _dotted(rel)
            prefixed = bare if root.is_file() else ".".join(p for p in (root_name, bare) if p)
            sf = SourceFile(path, rel, _package_module_name(path), prefixed, bare)
            self._by_path[resolved] = sf
            self.files.append(sf)

    def _walk(self, root: Path):
        """Every *.py under root, depth first in name order. A directory reached twice (through
        symlinks, or a symlink to an ancestor) is entered once: each real directory is listed at
        most once, so the walk is linear in the tree whatever its links."""
        seen: set[tuple[int, int]] = set()
        stack = [root]
        while stack:
            d = stack.pop()
            rel = d.relative_to(root).as_posix() if d != root else "."
            try:
                st = os.stat(d)
                key = (st.st_dev, st.st_ino)
                if key in seen:
                    continue
                seen.add(key)
                with os.scandir(d) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError as exc:
                self.problems.append(SourceProblem(rel, None, f"cannot list directory: {exc.strerror or exc}"))
                continue
            subdirs = []
            for e in entries:
                try:
                    is_dir = e.is_dir()
                except OSError:
                    is_dir = False    # a symlink loop or a vanished entry: not a directory
                if is_dir:
                    if e.name not in SKIP_DIRS and not e.name.startswith("."):
                        subdirs.append(d / e.name)
                elif e.name.endswith(".py") and _regular(e):
                    yield d / e.name   # never a FIFO or device named *.py: reading one would block
            stack.extend(reversed(subdirs))

    # -- lookup -----------------------------------------------------------------------------
    def find_module(self, dotted: str, near: SourceFile | None = None) -> SourceFile | None:
        """The tree's file for an imported module name, or None when it lies outside the tree.

        Exact names first (from the package structure, or from the path under the PATH's own
        directory name, or from the path alone); then the import with leading components dropped
        against the path under the PATH's name (PATH sglang/srt, import `sglang.srt.x` -> `srt.x`;
        the PATH's name must match, so `torch.utils` never lands on a scanned `utils.py`); then a
        sibling of the importing file (script-style `import helpers`).
        """
        sf = (self._by_module.get(dotted) or self._by_rel_module.get(dotted)
              or self._by_bare_module.get(dotted))
        if sf is not None:
            return sf
        parts = dotted.split(".")
        for i in range(1, len(parts)):
            sf = self._by_rel_module.get(".".join(parts[i:]))
            if sf is not None:
                return sf
        if near is not None:
            sibling = near.path.parent.joinpath(*parts)
            for cand in (sibling.with_suffix(".py"), sibling / "__init__.py"):
                hit = self._by_path.get(Path(_real(cand)))
                if hit is not None:
                    return hit
        return None

    def parse(self, sf: SourceFile) -> ModuleInfo | None:
        key = id(sf)
        if key in self._parsed:
            return self._parsed[key]
        info = None
        try:
            raw = sf.path.read_bytes()
            text = raw.decode("utf-8")
            tree = ast.parse(text, filename=sf.rel)
        except OSError as exc:
            self.problems.append(SourceProblem(sf.rel, None, f"cannot read: {exc.strerror or exc}"))
        except UnicodeDecodeError as exc:
            self.problems.append(SourceProblem(sf.rel, None, f"not UTF-8: {exc}"))
        except SyntaxError as exc:
            self.problems.append(SourceProblem(sf.rel, exc.lineno, f"syntax error: {exc.msg}"))
        except (ValueError, RecursionError) as exc:  # NUL bytes; absurdly deep nesting
            self.problems.append(SourceProblem(sf.rel, None, f"cannot parse: {exc}"))
        else:
            info = ModuleInfo(sf, tree, text)
            _index_module(info)
        self._parsed[key] = info
        return info

    def read_bytes(self, sf: SourceFile) -> bytes:
        try:
            return sf.path.read_bytes()
        except OSError as exc:
            self.problems.append(SourceProblem(sf.rel, None, f"cannot read: {exc.strerror or exc}"))
            self._parsed[id(sf)] = None
            return b""

    def parsed_modules(self) -> list[ModuleInfo]:
        return [m for m in self._parsed.values() if m is not None]

    @property
    def parsed_count(self) -> int:
        return sum(1 for v in self._parsed.values() if v is not None)


def _regular(entry: os.DirEntry) -> bool:
    try:
        return entry.is_file()
    except OSError:
        return True   # a symlink loop: listed, then reported as unreadable


def _real(path: Path) -> str:
    """The canonical path; never raises (a symlink loop stays as written, unlike Path.resolve)."""
    try:
        return os.path.realpath(path)
    except (OSError, RuntimeError, ValueError):
        return os.path.abspath(path)


def _dotted(rel: str) -> str:
    parts = rel[:-3].split("/") if rel.endswith(".py") else rel.split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _package_module_name(path: Path) -> str:
    parts = [] if path.name == "__init__.py" else [path.stem]
    d = path.parent
    while (d / "__init__.py").exists() and d.parent != d:
        parts.append(d.name)
        d = d.parent
    return ".".join(reversed(parts)) or path.stem


def resolve_relative(info: ModuleInfo, module: str | None, level: int) -> str:
    if level == 0:
        return module or ""
    base = info.package.split(".") if info.package else []
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def collect_imports(info: ModuleInfo, body_nodes) -> dict[str, str]:
    """local name -> qualified name for every import statement among `body_nodes` (walked)."""
    table: dict[str, str] = {}
    for node in body_nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    table[alias.asname] = alias.name
                else:  # `import a.b` binds `a`
                    root = alias.name.split(".")[0]
                    table.setdefault(root, root)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_relative(info, node.module, node.level)
            for alias in node.names:
                if alias.name == "*":
                    continue
                table[alias.asname or alias.name] = f"{base}.{alias.name}" if base else alias.name
    return table


def _toplevel_statements(body):
    """Module statements, descending into if/try/with blocks (conditional definitions)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.Try, ast.With, ast.AsyncWith)) or \
                type(stmt).__name__ == "TryStar":
            for name in ("body", "orelse", "finalbody"):
                yield from _toplevel_statements(getattr(stmt, name, []))
            for handler in getattr(stmt, "handlers", []):
                yield from _toplevel_statements(handler.body)


def _index_module(info: ModuleInfo) -> None:
    stmts = list(_toplevel_statements(info.tree.body))
    info.imports = collect_imports(info, stmts)
    info.star_imports = [resolve_relative(info, s.module, s.level) for s in stmts
                         if isinstance(s, ast.ImportFrom) and any(a.name == "*" for a in s.names)]
    for stmt in stmts:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            info.functions.setdefault(stmt.name, []).append(stmt)
        elif isinstance(stmt, ast.ClassDef):
            info.classes[stmt.name] = class_info(info, stmt, stmt.name)


def class_info(info: ModuleInfo, node: ast.ClassDef, qualname: str) -> ClassInfo:
    cls = ClassInfo(info, node, qualname)
    for stmt in _toplevel_statements(node.body):
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            cls.methods.setdefault(stmt.name, []).append(stmt)
    return cls
