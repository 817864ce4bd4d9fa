"""Finding the places where a symmetric-memory scope is entered.

Entries recognised (all statically, per function):

- ``with SCOPE(...):`` and ``async with``, any item of a multi-item ``with``;
- a conditional ``with (SCOPE(...) if cond else nullcontext()):``;
- a variable: ``ctx = SCOPE(...)`` (in any branch) then ``with ctx:``; also ``self.attr = SCOPE(...)``
  in any method, then ``with self.attr:``;
- a helper that returns a scope (``def f(): return SCOPE(...)``), or a ``@contextmanager`` helper
  that yields inside one, then ``with f():`` (helpers of helpers too, to a fixed point);
- ``stack.enter_context(SCOPE(...))``: the scope covers the statements after it, up to the end of
  the ``with ExitStack() as stack:`` block;
- a class-based context manager: a class whose ``__enter__`` enters a scope (``self.ctx.__enter__()``
  or ``stack.enter_context(...)`` on a scope bound in any of its methods, vLLM's
  ``nccl_symm_mem_context``), then ``with Cls(...):``. The conditions under which the class binds
  the scope (its ``if self.disabled:`` branch, with ``self.disabled`` replaced by what it was
  assigned) become conditions on every scope entered through it.

SCOPE is any configured callable (config.ScanConfig.scopes), matched on the qualified name the
call resolves to through the file's imports.
"""
from __future__ import annotations

import ast
import copy
import fnmatch
import re
from dataclasses import dataclass, replace

from sanitizer.scan.fallback import Conditions
from sanitizer.scan.resolve import Func, Resolver, Where, own_nodes, own_statements
from sanitizer.scan.source import ModuleInfo


@dataclass
class ScopeMatch:
    """How one expression enters a scope."""

    scope: str                 # the configured name it matched
    call: ast.Call             # the scope call itself (maybe inside a helper)
    call_module: ModuleInfo    # where that call is written
    via: list[str]             # how it is reached: "variable ctx (line 12)", "helper f (a.py:3)"
    conditions: list[str]      # "when c" / "unless c" from conditional expressions
    call_where: Where | None = None   # the function the scope call is written in

    def through(self, how: str, conditions=()) -> "ScopeMatch":
        """This match reached through one more link (a variable, a helper, a class)."""
        return replace(self, via=[how, *self.via], conditions=[*conditions, *self.conditions])


@dataclass
class ScopeSite:
    module: ModuleInfo
    where: Where
    node: ast.AST              # the With/AsyncWith, or the enter_context call
    body: list[ast.stmt]
    match: ScopeMatch
    entered: str               # "with", "async with", "ExitStack.enter_context"

    @property
    def line(self) -> int:
        return self.node.lineno

    @property
    def body_span(self) -> tuple[int, int]:
        if not self.body:
            return (self.node.lineno, getattr(self.node, "end_lineno", self.node.lineno))
        return (self.body[0].lineno, max(s.end_lineno or s.lineno for s in self.body))


class ScopeMatcher:
    MAX_CHAIN = 6  # variable -> helper -> variable ... links followed for one expression

    def __init__(self, resolver: Resolver, scope_names: tuple[str, ...]):
        self.resolver = resolver
        self.names = scope_names
        self.factories: dict[int, ScopeMatch] = {}   # id(function node) -> what it enters
        self.class_factories: dict[int, ScopeMatch] = {}  # id(class node) -> what __enter__ enters
        self.factory_names: set[str] = set()         # their names: text pre-filter tokens
        self._conditions = Conditions()
        self._assign_cache: dict[int, dict[str, list[ast.expr]]] = {}
        self._attr_cache: dict[int, dict[str, list[tuple[ast.expr, Func]]]] = {}

    # -- configured names -------------------------------------------------------------------
    def name_matches(self, qualified: str) -> str | None:
        last = qualified.rsplit(".", 1)[-1]
        for name in self.names:
            if any(c in name for c in "*?["):
                if fnmatch.fnmatchcase(qualified, name):
                    return name
            elif "." not in name:
                if last == name:
                    return name
            elif qualified == name or qualified.endswith("." + name):
                return name
        return None

    def text_tokens(self) -> set[str]:
        """Identifiers a file must contain to possibly enter a scope (a cheap pre-filter)."""
        tokens = set()
        for name in self.names:
            literal = [p for p in re.split(r"[*?\[\]]", name.rsplit(".", 1)[-1]) if p]
            if not literal:
                return set()  # a pure glob: no pre-filter possible
            tokens.add(max(literal, key=len))
        return tokens | self.factory_names

    # -- expressions ------------------------------------------------------------------------
    def match(self, expr: ast.expr, where: Where, chain: int = 0) -> ScopeMatch | None:
        if chain > self.MAX_CHAIN:
            return None
        if isinstance(expr, ast.Call):
            return self._match_call(expr, where, chain)
        if isinstance(expr, ast.IfExp):
            for branch, word in ((expr.body, "when"), (expr.orelse, "unless")):
                m = self.match(branch, where, chain + 1)
                if m is not None:
                    return replace(m, conditions=[f"{word} {_one_line(expr.test)}", *m.conditions])
            return None
        if isinstance(expr, ast.NamedExpr):
            return self.match(expr.value, where, chain + 1)
        if isinstance(expr, ast.Name) and where.func is not None:
            for value in self.assignments(where.func).get(expr.id, []):
                m = self.match(value, where, chain + 1)
                if m is not None:
                    return m.through(f"variable {expr.id} (line {value.lineno})")
            return None
        if isinstance(expr, ast.Name):
            for value in _module_assignments(where.module).get(expr.id, []):
                m = self.match(value, where, chain + 1)
                if m is not None:
                    return m.through(f"variable {expr.id} (line {value.lineno})")
            return None
        if (isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name)
                and where.func is not None and expr.value.id == where.func.self_name and where.cls):
            for value, owner in self.attributes(where.func).get(expr.attr, []):
                m = self.match(value, Where(owner.module, owner), chain + 1)
                if m is not None:
                    return m.through(f"attribute self.{expr.attr} ({owner.qualname}, line {value.lineno})")
        return None

    def _match_call(self, call: ast.Call, where: Where, chain: int) -> ScopeMatch | None:
        qualified = self.resolver.qualify(call.func, where)
        if qualified:
            # a bare name the file does not import may come from a `from pkg import *`
            # (`from sanitizer import *` then `symmetric_scope(...)`)
            candidates = [qualified] + ([f"{base}.{qualified}" for base in where.module.star_imports]
                                        if "." not in qualified else [])
            for candidate in candidates:
                name = self.name_matches(candidate)
                if name is not None:
                    return ScopeMatch(name, call, where.module, [], [], where)
        if not self.factories and not self.class_factories:
            return None
        target = self.resolver.resolve_call(call, where)
        for f in target.funcs:
            m = self.factories.get(id(f.node))
            if m is not None:
                return m.through(f"helper {f.qualname} ({f.where})")
        if target.is_class is not None:
            return self.class_factories.get(id(target.is_class.node))
        return None

    def assignments(self, func: Func) -> dict[str, list[ast.expr]]:
        table = self._assign_cache.get(id(func.node))
        if table is None:
            table = {}
            for node in own_nodes(func.node.body):
                for target, value in _bindings(node):
                    if isinstance(target, ast.Name):
                        table.setdefault(target.id, []).append(value)
            self._assign_cache[id(func.node)] = table
        return table

    def attributes(self, func: Func) -> dict[str, list[tuple[ast.expr, Func]]]:
        cls = func.cls
        table = self._attr_cache.get(id(cls.node))
        if table is None:
            table = {}
            for methods in cls.methods.values():
                for node in methods:
                    owner = self.resolver.func(cls.module, node, cls, f"{cls.qualname}.{node.name}")
                    me = owner.self_name
                    for n in own_nodes(node.body):
                        for target, value in _bindings(n):
                            if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                                    and target.value.id == me):
                                table.setdefault(target.attr, []).append((value, owner))
            self._attr_cache[id(cls.node)] = table
        return table

    # -- helpers that hand out scopes --------------------------------------------------------
    def discover_factories(self, modules: list[ModuleInfo]) -> bool:
        """Add functions that return or yield inside a scope; True when any was new."""
        grew = False
        for module in modules:
            for f in self.resolver.module_functions(module):
                if id(f.node) in self.factories:
                    continue
                m = self._factory_match(f)
                if m is not None:
                    self.factories[id(f.node)] = m
                    self.factory_names.add(f.node.name)
                    grew = True
            for cls in module.classes.values():
                if id(cls.node) in self.class_factories:
                    continue
                m = self._class_factory_match(cls)
                if m is not None:
                    self.class_factories[id(cls.node)] = m
                    self.factory_names.add(cls.node.name)
                    grew = True
        return grew

    def _class_factory_match(self, cls) -> ScopeMatch | None:
        """What a class-based context manager enters: `X.__enter__()` or `stack.enter_context(X)`
        in its `__enter__`, X a scope (a self attribute bound in any method, or a local)."""
        methods = cls.methods.get("__enter__") or cls.methods.get("__aenter__")
        if not methods:
            return None
        enter = self.resolver.func(cls.module, methods[0], cls, f"{cls.qualname}.{methods[0].name}")
        where = Where(cls.module, enter)
        for node in own_nodes(enter.node.body):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr in ("__enter__", "__aenter__"):
                entered = node.func.value
            elif node.func.attr == "enter_context" and node.args:
                entered = node.args[0]
            else:
                continue
            m = self._bound_scope(entered, where)
            if m is not None:
                return m.through(f"class {cls.qualname} ({cls.module.rel}:{cls.node.lineno})")
        return None

    def _bound_scope(self, expr: ast.expr, where: Where) -> ScopeMatch | None:
        """The scope a `self.attr` holds, with the conditions under which it is bound (inlined:
        `unless self.disabled` reads `unless disabled or not is_cuda() ...`); else match()."""
        if (isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name)
                and expr.value.id == where.func.self_name):
            for value, owner in self.attributes(where.func).get(expr.attr, []):
                m = self.match(value, Where(owner.module, owner))
                if m is None:
                    continue
                conds = self._conditions.within(owner.module, value)
                texts = [f"{c.text.split(' ', 1)[0]} {_inlined(c.test, owner, self)}" for c in conds]
                return m.through(f"attribute self.{expr.attr} ({owner.qualname}, line {value.lineno})",
                                 texts)
        return self.match(expr, where)

    def _factory_match(self, f: Func) -> ScopeMatch | None:
        where = Where(f.module, f)
        nodes = list(own_nodes(f.node.body))
        for node in nodes:
            if isinstance(node, ast.Return) and node.value is not None:
                m = self.match(node.value, where)
                if m is not None:
                    return m
        if _is_contextmanager(f.node):
            for site in self.sites_in_function(f):
                if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for s in site.body for n in own_nodes([s])):
                    return site.match
        return None

    # -- sites ------------------------------------------------------------------------------
    def sites(self, module: ModuleInfo) -> list[ScopeSite]:
        found: list[ScopeSite] = []
        found += self._sites_in(module.tree.body, Where(module))
        for f in self.resolver.module_functions(module):
            found += self.sites_in_function(f)
        return found

    def sites_in_function(self, f: Func) -> list[ScopeSite]:
        return self._sites_in(f.node.body, Where(f.module, f))

    def _sites_in(self, body: list[ast.stmt], where: Where) -> list[ScopeSite]:
        found = []
        for stmt in own_statements(body):
            if isinstance(stmt, (ast.With, ast.AsyncWith)):
                entered = "async with" if isinstance(stmt, ast.AsyncWith) else "with"
                for item in stmt.items:
                    m = self.match(item.context_expr, where)
                    if m is not None:
                        found.append(ScopeSite(where.module, where, stmt, stmt.body, m, entered))
        for node in own_nodes(body):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "enter_context" and node.args):
                m = self.match(node.args[0], where)
                if m is not None:
                    rest = _statements_after(where.module, node, node.func.value)
                    found.append(ScopeSite(where.module, where, node, rest, m, "ExitStack.enter_context"))
        return found


def _bindings(node: ast.AST):
    if isinstance(node, ast.Assign):
        for target in node.targets:
            yield target, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
        yield node.target, node.value
    elif isinstance(node, ast.NamedExpr):
        yield node.target, node.value


def _module_assignments(module: ModuleInfo) -> dict[str, list[ast.expr]]:
    table: dict[str, list[ast.expr]] = {}
    for stmt in own_statements(module.tree.body):
        for target, value in _bindings(stmt):
            if isinstance(target, ast.Name):
                table.setdefault(target.id, []).append(value)
    return table


def _is_contextmanager(node) -> bool:
    return any(ast.unparse(d).split(".")[-1] in ("contextmanager", "asynccontextmanager")
               for d in node.decorator_list)


def _statements_after(module: ModuleInfo, call: ast.Call, stack_expr: ast.expr) -> list[ast.stmt]:
    """Statements that run after `stack.enter_context(...)` while the ExitStack is open."""
    stack_text = ast.unparse(stack_expr)
    out: list[ast.stmt] = []
    node: ast.AST = call
    while True:
        parent = module.parent(node)
        if parent is None:
            return out
        if isinstance(node, ast.stmt):
            for name in ("body", "orelse", "finalbody"):
                block = getattr(parent, name, None)
                if isinstance(block, list):
                    at = module.position(node, block)
                    if at is not None:
                        out += block[at + 1:]
                        break
            if isinstance(parent, (ast.With, ast.AsyncWith)) and any(
                    item.optional_vars is not None and ast.unparse(item.optional_vars) == stack_text
                    for item in parent.items):
                return out
            if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)):
                return out
        node = parent


def _inlined(test: ast.expr, owner: Func, matcher: ScopeMatcher) -> str:
    """A condition with each `self.attr` / local name that `owner` assigns exactly once replaced
    by its value (so `--when` can evaluate what `if self.disabled:` really tests). Not truncated:
    the text is parsed again as the condition."""
    me = owner.self_name
    attrs = matcher.attributes(owner) if owner.cls else {}
    local = matcher.assignments(owner)

    class Inline(ast.NodeTransformer):
        def visit_Attribute(self, node):
            if isinstance(node.value, ast.Name) and node.value.id == me:
                values = [v for v, o in attrs.get(node.attr, []) if o is owner]
                if len(values) == 1 and len(attrs.get(node.attr, [])) == 1:
                    return values[0]
            return self.generic_visit(node)

        def visit_Name(self, node):
            values = local.get(node.id, [])
            return values[0] if len(values) == 1 else node

    try:
        return " ".join(ast.unparse(Inline().visit(copy.deepcopy(test))).split())
    except (RecursionError, ValueError):
        return _one_line(test)


def _one_line(node: ast.AST, limit: int = 100) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
