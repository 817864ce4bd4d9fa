"""Static name resolution: what a call's callee is, as far as the source alone says.

A callee resolves to functions defined in the scanned tree (followed by the classifier), to a
qualified name outside it (`torch.einsum`, looked up in the call catalog), to a method on an object
of unknown type (`x.contiguous`), or to nothing (counted as compute, and reported as unresolved).
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

from sanitizer.scan.source import ClassInfo, ModuleInfo, SourceTree, class_info, collect_imports

FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


@dataclass(eq=False)
class Func:
    """A function or method defined in the scanned tree."""

    module: ModuleInfo
    node: FunctionNode
    cls: ClassInfo | None
    qualname: str
    outer: "Func | None" = None
    _imports: dict[str, str] | None = None
    _local_defs: dict[str, list[FunctionNode]] | None = None

    def __repr__(self) -> str:
        return f"Func({self.where} {self.qualname})"

    @property
    def where(self) -> str:
        return f"{self.module.rel}:{self.node.lineno}"

    @property
    def self_name(self) -> str | None:
        """The first parameter of a method (`self`/`cls`), unless it is a staticmethod."""
        if self.cls is None or not self.node.args.args:
            return None
        if any(ast.unparse(d).endswith("staticmethod") for d in self.node.decorator_list):
            return None
        return self.node.args.args[0].arg

    def local_imports(self) -> dict[str, str]:
        if self._imports is None:
            inherited = self.outer.local_imports() if self.outer else {}
            self._imports = {**inherited, **collect_imports(self.module, own_nodes(self.node.body))}
        return self._imports

    def local_defs(self) -> dict[str, list[FunctionNode]]:
        if self._local_defs is None:
            defs: dict[str, list[FunctionNode]] = dict(self.outer.local_defs()) if self.outer else {}
            for stmt in own_statements(self.node.body):
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defs.setdefault(stmt.name, []).append(stmt)
            self._local_defs = defs
        return self._local_defs


def own_statements(body):
    """Statements of a body, descending into compound statements but not into nested defs."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for name in ("body", "orelse", "finalbody"):
            inner = getattr(stmt, name, None)
            if isinstance(inner, list) and inner and isinstance(inner[0], ast.stmt):
                yield from own_statements(inner)
        for handler in getattr(stmt, "handlers", []) or []:
            yield from own_statements(handler.body)
        for case in getattr(stmt, "cases", []) or []:
            yield from own_statements(case.body)


def own_nodes(body):
    """Every node of a body except those inside nested function/class/lambda definitions."""
    stack = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


@dataclass
class Where:
    """A lexical position: module, and the enclosing function (with its class) if any."""

    module: ModuleInfo
    func: Func | None = None

    @property
    def cls(self) -> ClassInfo | None:
        return self.func.cls if self.func else None

    @property
    def qualname(self) -> str:
        return self.func.qualname if self.func else "<module>"


@dataclass
class Target:
    """What a callee resolved to. Exactly one of funcs / qualified / method is meaningful."""

    text: str                                   # the callee as written (one line)
    funcs: list[Func] = field(default_factory=list)
    qualified: str | None = None                # dotted name outside the tree (or a builtin)
    method: str | None = None                   # attribute name on an object of unknown type
    is_class: ClassInfo | None = None           # a tree class being constructed
    launch: bool = False                        # kernel[grid](...)
    unresolved: str | None = None               # why nothing better was found
    attribute_call: bool = False                # written as a.b(...), not b(...)


class Resolver:
    MAX_HOPS = 8  # re-exports followed (`from .impl import f` in an __init__.py)

    def __init__(self, tree: SourceTree):
        self.tree = tree
        self._funcs: dict[int, Func] = {}

    # -- function objects (one per node, so caches can key on them) -----------------------
    def func(self, module: ModuleInfo, node: FunctionNode, cls: ClassInfo | None,
             qualname: str, outer: Func | None = None) -> Func:
        f = self._funcs.get(id(node))
        if f is None:
            f = self._funcs[id(node)] = Func(module, node, cls, qualname, outer)
        return f

    def module_functions(self, module: ModuleInfo):
        """Every function in a module, methods and nested functions included, with context."""
        def visit(body, cls, prefix, outer):
            for stmt in own_statements(body):
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    f = self.func(module, stmt, cls, prefix + stmt.name, outer)
                    yield f
                    yield from visit(stmt.body, None, f.qualname + ".", f)
                elif isinstance(stmt, ast.ClassDef):
                    info = module.classes.get(stmt.name) if outer is None and not prefix else None
                    if info is None or info.node is not stmt:
                        info = class_info(module, stmt, prefix + stmt.name)
                    yield from visit(stmt.body, info, prefix + stmt.name + ".", outer)
        yield from visit(module.tree.body, None, "", None)

    # -- names ------------------------------------------------------------------------------
    def qualify(self, expr: ast.expr, where: Where) -> str | None:
        """Dotted name of a Name/Attribute chain with the import aliases applied, else None."""
        if isinstance(expr, ast.Name):
            name = expr.id
            if where.func is not None:
                local = where.func.local_imports().get(name)
                if local:
                    return local
            imported = where.module.imports.get(name)
            if imported:
                return imported
            if name in where.module.functions or name in where.module.classes:
                return f"{where.module.source.module}.{name}"
            return name
        if isinstance(expr, ast.Attribute):
            base = self.qualify(expr.value, where)
            return f"{base}.{expr.attr}" if base else None
        return None

    def resolve_qualified(self, dotted: str, near=None, hops: int = 0):
        """Tree functions (or a tree class) that a fully qualified name denotes, else None."""
        if hops > self.MAX_HOPS:
            return None
        parts = dotted.split(".")
        for i in range(len(parts) - 1, 0, -1):
            sf = self.tree.find_module(".".join(parts[:i]), near)
            if sf is None:
                continue
            module = self.tree.parse(sf)
            if module is None:
                return None
            return self._lookup_in_module(module, parts[i:], hops)
        return None

    def _lookup_in_module(self, module: ModuleInfo, rest: list[str], hops: int):
        head = rest[0]
        if head in module.functions and len(rest) == 1:
            return [self.func(module, n, None, head) for n in module.functions[head]]
        if head in module.classes:
            cls = module.classes[head]
            if len(rest) == 1:
                return cls
            if len(rest) == 2:
                return self.find_method(cls, rest[1]) or None
            return None
        if head in module.imports:  # re-exported name
            return self.resolve_qualified(".".join([module.imports[head], *rest[1:]]),
                                          module.source, hops + 1)
        for base in module.star_imports:  # `from .common import *` in a package __init__
            hit = self.resolve_qualified(".".join([base, *rest]), module.source, hops + 1)
            if hit:
                return hit
        return None

    def class_of(self, expr: ast.expr, where_module: ModuleInfo) -> ClassInfo | None:
        q = self.qualify(expr, Where(where_module))
        if not q:
            return None
        if "." not in q and q in where_module.classes:
            return where_module.classes[q]
        hit = self.resolve_qualified(q, where_module.source)
        return hit if isinstance(hit, ClassInfo) else None

    def find_method(self, cls: ClassInfo, name: str, skip_self: bool = False, _seen=None) -> list[Func]:
        """Method lookup along the bases that are defined in the tree (depth-first, like a simple MRO)."""
        seen = _seen if _seen is not None else set()
        if id(cls) in seen or len(seen) > 32:
            return []
        seen.add(id(cls))
        if not skip_self and name in cls.methods:
            return [self.func(cls.module, n, cls, f"{cls.qualname}.{name}") for n in cls.methods[name]]
        for base in cls.node.bases:
            base_cls = self.class_of(base, cls.module)
            if base_cls is not None:
                found = self.find_method(base_cls, name, False, seen)
                if found:
                    return found
        return []

    # -- calls ------------------------------------------------------------------------------
    def resolve_call(self, call: ast.Call, where: Where) -> Target:
        func = call.func
        text = _one_line(func)
        if isinstance(func, ast.Subscript):
            return Target(text, launch=True)
        if isinstance(func, ast.Name):
            name = func.id
            if where.func is not None and name in where.func.local_defs():
                nodes = where.func.local_defs()[name]
                return Target(text, funcs=[self.func(where.module, n, None, f"{where.qualname}.{name}",
                                                     where.func) for n in nodes])
            if name in where.module.functions and not (where.func and name in where.func.local_imports()):
                return Target(text, funcs=[self.func(where.module, n, None, name)
                                           for n in where.module.functions[name]])
            if name in where.module.classes and not (where.func and name in where.func.local_imports()):
                return Target(text, is_class=where.module.classes[name])
            return self._by_qualified(text, self.qualify(func, where), where)
        if isinstance(func, ast.Attribute):
            receiver = func.value
            # self.method(...) / cls.method(...) inside a class
            if (isinstance(receiver, ast.Name) and where.func is not None
                    and receiver.id == where.func.self_name and where.cls is not None):
                found = self.find_method(where.cls, func.attr)
                if found:
                    return Target(text, funcs=found)
                return Target(text, method=func.attr)
            # super().method(...)
            if (isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name)
                    and receiver.func.id == "super" and where.cls is not None):
                found = self.find_method(where.cls, func.attr, skip_self=True)
                if found:
                    return Target(text, funcs=found)
                return Target(text, method=func.attr)
            if _is_dotted(receiver) and self._is_module_like(receiver, where):
                target = self._by_qualified(text, self.qualify(func, where), where)
                target.attribute_call = True
                return target
            return Target(text, method=func.attr)
        return Target(text, unresolved="callee is an expression")

    def _is_module_like(self, receiver: ast.expr, where: Where) -> bool:
        """True when the receiver's root name is an import (a module or an imported class)."""
        root = receiver
        while isinstance(root, ast.Attribute):
            root = root.value
        if not isinstance(root, ast.Name):
            return False
        name = root.id
        if where.func is not None and name in where.func.local_imports():
            return True
        return name in where.module.imports or name in where.module.classes

    def _by_qualified(self, text: str, qualified: str | None, where: Where) -> Target:
        if not qualified:
            return Target(text, unresolved="callee is an expression")
        hit = self.resolve_qualified(qualified, where.module.source) if "." in qualified else None
        if isinstance(hit, ClassInfo):
            return Target(text, qualified=qualified, is_class=hit)
        if hit:
            return Target(text, qualified=qualified, funcs=hit)
        return Target(text, qualified=qualified)


def _is_dotted(expr: ast.expr) -> bool:
    while isinstance(expr, ast.Attribute):
        expr = expr.value
    return isinstance(expr, ast.Name)


def _one_line(node: ast.AST, limit: int = 80) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
