"""Classifying what a scope's body allocates.

The algorithm, in one place:

1. Every call in the body (not inside nested defs/lambdas, not inside nested scopes, which are
   reported on their own) gets a kind from its resolved callee: `neutral` (metadata, views,
   built-ins), `kernel` (a launch that only writes into tensors passed to it: Triton
   `kernel[grid](...)`, an op given `out=`, a call settled by a `call:` allow-list entry),
   `alloc` (an output allocation: torch.empty & co.), `copy` (one copy or cast: .contiguous(),
   .to(), torch.cat, transposes, copy_), or `compute` (everything else: torch ops, compiled
   extension ops, sub-module calls, and every callee it cannot resolve, marked unresolved).
   An operator expression on tensors (`x @ w`, `h * mix`, `-x`: operands.py says which) is an op
   too: `compute`, listed as `operator @`. Operators on numbers, strings and shapes are not.
2. A callee defined in the scanned tree is followed, to `depth` levels, and takes the kind of its
   own body (compute if anything in it computes or leaves a transient behind).
3. An allocating call is an output when its result outlives the region (bound to a name used
   after the scope / returned by the helper / stored in an attribute, a container or an `out=`),
   a reservation when its result is dropped unused at once (`torch.empty(n)` as a statement: it
   grows the pool and is never read), otherwise a transient: a workspace handed to another op and
   freed inside the window.
4. The scope is `compute` when any call computes or any allocation is a transient, else `copy`
   when any call copies, else `alloc` (its kernels listed). A compute scope whose every compute
   call is unresolved is `compute (unresolved)`: nothing known computes, something unknown may.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

from sanitizer.scan.catalog import (ALLOC, COMPUTE, COPY, EXTENSION_ROOTS, KERNEL, KIND_RANK, NEUTRAL,
                                    OUT_KEYWORDS, CallCatalog, is_inplace_method)
from sanitizer.scan.operands import OperandTyper, operator_symbol
from sanitizer.scan.resolve import Func, Resolver, Target, Where, own_nodes
from sanitizer.scan.scopes import ScopeSite

STORE_METHODS = frozenset({"append", "extend", "insert", "setdefault", "update", "add", "put"})
VIEW_ATTRS = frozenset({"T", "mT", "H", "mH", "real", "imag", "data"})


@dataclass
class CallRecord:
    callee: str                  # as written
    file: str
    line: int
    kind: str                    # alloc / copy / compute
    transient: bool              # may leave an allocation behind in the window
    reason: str
    resolved: bool = True        # False: counted as compute because nothing better was known
    helper: str | None = None    # "qualname (file:line)" of a followed tree function
    inner: list["CallRecord"] = field(default_factory=list)
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # followed helpers' (file, first, last)
    conditions: list = field(default_factory=list)  # fallback.Condition: when this call runs (in its function)
    result_transient: bool = False   # its result, if it allocates one, is freed inside the scope

    def as_dict(self) -> dict:
        d = {"call": self.callee, "file": self.file, "line": self.line, "kind": self.kind,
             "transient": self.transient, "reason": self.reason, "resolved": self.resolved}
        if self.helper:
            d["helper"] = self.helper
        if self.inner:
            d["inner"] = [r.as_dict() for r in self.inner]
        if self.conditions:
            d["conditions"] = [c.text for c in self.conditions]
        return d


@dataclass
class Summary:
    kind: str
    records: list[CallRecord]


def region_class(records: list[CallRecord]) -> str:
    if any(r.kind == COMPUTE or r.transient for r in records):
        return COMPUTE
    if any(r.kind == COPY for r in records):
        return COPY
    return ALLOC


def known_compute(r: CallRecord) -> bool:
    """The record shows compute or a transient that the scan knows of (not a guess about an
    unresolved callee): a resolved op, a transient allocation, or a helper holding one."""
    if r.kind == COMPUTE and r.resolved and not r.helper:
        return True
    if r.transient and r.kind != COMPUTE:
        return True
    return r.kind == COMPUTE and any(known_compute(i) for i in r.inner)


def records_under(records: list[CallRecord], assume) -> list[CallRecord]:
    """The records whose calls can run under `assume` (their conditions not false), with each
    followed helper's kind recomputed from its inner calls that can run."""
    from sanitizer.scan.fallback import ScopePath, path_survives
    out = []
    for r in records:
        if r.conditions and not path_survives(ScopePath(r.conditions), assume):
            continue
        if r.inner:
            inner = records_under(r.inner, assume)
            kind = NEUTRAL
            for i in inner:
                kind = max(kind, COMPUTE if i.transient else i.kind, key=KIND_RANK.__getitem__)
            if kind == NEUTRAL:
                continue
            transient = kind == COMPUTE or (kind in (ALLOC, COPY) and r.result_transient)
            r = CallRecord(r.callee, r.file, r.line, kind, transient, r.reason, r.resolved, r.helper,
                           inner, r.spans, r.conditions, r.result_transient)
        out.append(r)
    return out


def kernels_of(records: list[CallRecord]) -> list[CallRecord]:
    """Kernel launches (writing into given tensors) in the records and the helpers they follow."""
    out, stack = [], list(records)
    while stack:
        r = stack.pop(0)
        if r.kind == KERNEL:
            out.append(r)
        stack.extend(r.inner)
    return out


class BodyClassifier:
    def __init__(self, resolver: Resolver, catalog: CallCatalog, depth: int, scope_nodes: set[int],
                 settled_calls=None, scope_functions: set[int] = frozenset()):
        self.resolver = resolver
        self.settled_calls = settled_calls  # callable(names) -> allow entry or None (`call:` entries)
        self.catalog = catalog
        self.depth = depth
        self.scope_nodes = scope_nodes      # ids of With nodes that are scope sites themselves
        self._summaries: dict[tuple[int, int], Summary] = {}
        self._in_progress: set[int] = set()
        self._uses: dict[int, NameUses] = {}
        # ids of the function nodes that enter a scope: their parameters are tensors by default
        self.operands = OperandTyper(resolver, catalog, scope_functions)
        from sanitizer.scan.fallback import Conditions
        self.conditions = Conditions()

    # -- entry points -----------------------------------------------------------------------
    def scope_records(self, site: ScopeSite) -> tuple[list[CallRecord], list[int]]:
        """Records for a scope body, and the lines of the scopes nested in it."""
        escapes = _scope_escapes(site, self.catalog, self._name_uses(site))
        nested: list[int] = []
        records = self._records(site.body, site.where, escapes, self.depth, nested, stop=site.node)
        return records, nested

    def _name_uses(self, site: ScopeSite) -> "NameUses":
        owner = site.where.func.node if site.where.func is not None else site.module.tree
        uses = self._uses.get(id(owner))
        if uses is None:
            body = owner.body
            uses = self._uses[id(owner)] = NameUses(body, loads_only=site.where.func is not None)
        return uses

    def function_summary(self, func: Func, remaining: int) -> Summary:
        key = (id(func.node), remaining)
        cached = self._summaries.get(key)
        if cached is not None:
            return cached
        if id(func.node) in self._in_progress:   # recursion: judged by the outer activation
            return Summary(NEUTRAL, [])
        self._in_progress.add(id(func.node))
        try:
            records = self._records(func.node.body, Where(func.module, func),
                                    _function_escapes(func.node, self.catalog), remaining, [])
        finally:
            self._in_progress.discard(id(func.node))
        kind = NEUTRAL
        for r in records:
            kind = max(kind, COMPUTE if r.transient else r.kind, key=KIND_RANK.__getitem__)
        summary = Summary(kind, records)
        self._summaries[key] = summary
        return summary

    # -- the walk ---------------------------------------------------------------------------
    def _records(self, body, where: Where, escapes: set[str], remaining: int,
                 nested: list[int], stop: ast.AST | None = None) -> list[CallRecord]:
        records = []
        for node in self._operations(body, nested):
            if isinstance(node, ast.Call):
                rec = self._categorize(node, where, escapes, remaining)
            else:
                rec = self._operator_record(node, where, escapes)
            if rec is not None:
                rec.conditions = self.conditions.within(where.module, node, stop)
                records.append(rec)
        records.sort(key=lambda r: r.line)
        return records

    def _operations(self, body, nested: list[int]):
        """The calls and operator expressions of a body, in source order (annotations, which
        never run as arithmetic, left out)."""
        stack = list(reversed(body))
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                continue
            if isinstance(node, (ast.With, ast.AsyncWith)) and id(node) in self.scope_nodes:
                nested.append(node.lineno)
                continue
            if isinstance(node, ast.Call) or operator_symbol(node) is not None:
                yield node
            if isinstance(node, ast.AnnAssign):
                children = [node.target] + ([node.value] if node.value is not None else [])
            else:
                children = list(ast.iter_child_nodes(node))
            stack.extend(reversed(children))

    def _operator_record(self, node: ast.expr, where: Where, escapes: set[str]) -> CallRecord | None:
        """An operator expression on tensors: an op like the call it stands for (`x @ w` is
        torch.matmul), so compute; None for arithmetic on numbers, strings and shapes."""
        reason = self.operands.tensor_arithmetic(node, where)
        if reason is None:
            return None
        fate = _fate(node, where.module, escapes, self.catalog)
        return CallRecord(f"operator {operator_symbol(node)}", where.module.rel, node.lineno, COMPUTE,
                          True, reason, result_transient=fate == "transient")

    def _categorize(self, call: ast.Call, where: Where, escapes: set[str],
                    remaining: int) -> CallRecord | None:
        target = self.resolver.resolve_call(call, where)
        followed: list[Func] = []
        kind, allocates, reason, resolved, helper, inner = self._kind_of(target, remaining, followed)
        spans = [(f.module.rel, f.node.lineno, f.node.end_lineno or f.node.lineno) for f in followed]
        if kind == NEUTRAL:
            return None
        if kind == COMPUTE and not target.funcs and any(k.arg in OUT_KEYWORDS for k in call.keywords):
            kind, allocates, resolved = KERNEL, False, True
            reason = f"writes into its out= argument, allocates nothing ({reason})"
        if kind == COMPUTE and self.settled_calls is not None:
            entry = self.settled_calls([target.text, target.qualified or "", helper or ""])
            if entry is not None:
                kind, allocates, resolved, inner = KERNEL, False, True, []
                reason = f"settled by allow-list {entry.source}: {entry.reason}"
        fate = _fate(call, where.module, escapes, self.catalog) if kind != KERNEL else "output"
        if kind == COMPUTE:
            transient = True
        else:
            fate = fate if allocates else "output"
            transient = fate == "transient"
            if transient:
                reason += "; its result is freed inside the scope (a transient)"
            elif fate == "reservation":
                reason += "; dropped unused at once (reserves pool memory)"
        return CallRecord(target.text, where.module.rel, call.lineno, kind, transient, reason,
                          resolved, helper, inner, spans, result_transient=fate == "transient")

    def _kind_of(self, target: Target, remaining: int, followed: list[Func]):
        """(kind, allocates, reason, resolved, helper, inner records); `followed` gets the
        tree functions whose bodies were read."""
        cat = self.catalog
        if target.launch:
            return KERNEL, False, "kernel launch: writes into the tensors passed to it", True, None, []
        if target.qualified:
            kind = cat.function_kind(target.qualified)
            if kind is not None:
                allocates = kind in (ALLOC, COPY) and not cat.is_view(target.qualified)
                return kind, allocates, f"{kind}: {target.qualified}", True, None, []
        funcs = target.funcs
        if target.is_class is not None and not funcs:
            cls = target.is_class
            if cls.is_plain_record:
                return NEUTRAL, False, "", True, None, []
            funcs = self.resolver.find_method(cls, "__init__")
            if not funcs:
                return (COMPUTE, True, f"unresolved: constructs {cls.qualname}, whose __init__ is "
                        "outside the scanned tree", False, None, [])
        if funcs:
            names = ", ".join(sorted({f"{f.qualname} ({f.where})" for f in funcs}))
            if remaining <= 0:
                return (COMPUTE, True, f"not followed: helper depth limit {self.depth} reached",
                        False, names, [])
            kind, inner = NEUTRAL, []
            followed.extend(funcs)
            for f in funcs:
                s = self.function_summary(f, remaining - 1)
                kind = max(kind, s.kind, key=KIND_RANK.__getitem__)
                inner += s.records
            allocates = kind in (ALLOC, COPY)
            reason = {COMPUTE: "helper computes", COPY: "helper copies", ALLOC: "helper allocates",
                      KERNEL: "helper launches kernels into given tensors", NEUTRAL: ""}[kind]
            return kind, allocates, reason, True, names, inner
        if target.method:
            kind = cat.method_kind(target.method)
            if kind is not None:
                allocates = (kind in (ALLOC, COPY) and not is_inplace_method(target.method)
                             and not cat.is_view("." + target.method))
                return kind, allocates, f"{kind}: .{target.method}()", True, None, []
            return (COMPUTE, True, f"unresolved: method .{target.method}() on an object of unknown type",
                    False, None, [])
        if target.qualified and "." in target.qualified and target.attribute_call:
            # `envs.FLAG.get()`: an imported object, not a module function: judge by the method
            kind = cat.method_kind(target.qualified.rsplit(".", 1)[1])
            if kind is not None and not target.qualified.startswith(("torch.", "triton.")):
                method = target.qualified.rsplit(".", 1)[1]
                allocates = (kind in (ALLOC, COPY) and not is_inplace_method(method)
                             and not cat.is_view("." + method))
                return kind, allocates, f"{kind}: .{method}()", True, None, []
        if target.qualified:
            root = target.qualified.split(".")[0]
            if root in ("torch", "triton", "tl"):
                return COMPUTE, True, f"op: {target.qualified}", True, None, []
            if root in EXTENSION_ROOTS:
                return (COMPUTE, True, f"unresolved: compiled extension op {target.qualified} "
                        "(what it allocates besides its outputs is unknown)", False, None, [])
            where = "outside the scanned tree" if "." in target.qualified else "not defined in the scanned tree"
            return COMPUTE, True, f"unresolved: {target.qualified} ({where})", False, None, []
        return COMPUTE, True, f"unresolved: {target.unresolved or 'unknown callee'}", False, None, []


# -- where a result goes ---------------------------------------------------------------------
def _fate(call: ast.expr, module, escapes: set[str], catalog: CallCatalog) -> str:
    """'output' when the allocation (a call's, or an operator's result) outlives the region,
    else 'transient'."""
    node: ast.AST = call
    while True:
        parent = module.parent(node)
        if parent is None:
            return "transient"
        if isinstance(parent, ast.Attribute) and parent.value is node:
            grand = module.parent(parent)
            if isinstance(grand, ast.Call) and grand.func is parent:
                m = parent.attr
                if is_inplace_method(m) or catalog.is_view("." + m):
                    node = grand  # same storage flows on
                    continue
                if m in STORE_METHODS:
                    return "transient"  # x.append(...) on the result: odd; be conservative
                return "transient"      # consumed by another op (e.g. .float().contiguous())
            if parent.attr in VIEW_ATTRS:
                node = parent
                continue
            return "transient"          # only metadata read (e.g. .shape): the block is dropped
        if isinstance(parent, (ast.Tuple, ast.List, ast.Set, ast.Dict, ast.Starred, ast.BoolOp,
                               ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            node = parent
            continue
        if isinstance(parent, ast.IfExp) and node is not parent.test:
            node = parent
            continue
        if isinstance(parent, ast.Subscript) and parent.value is node:
            node = parent
            continue
        if isinstance(parent, ast.keyword):
            return "output" if parent.arg == "out" else "transient"
        if isinstance(parent, ast.Call):
            f = parent.func
            if isinstance(f, ast.Attribute) and f.attr in STORE_METHODS:
                return "output"         # outputs.append(torch.empty(...))
            return "transient"          # an argument of another op
        if isinstance(parent, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            return "output" if any(_target_escapes(t, escapes) for t in targets) else "transient"
        if isinstance(parent, (ast.Return, ast.Yield, ast.YieldFrom)):
            return "output"
        if isinstance(parent, (ast.withitem, ast.For, ast.AsyncFor, ast.comprehension)):
            return "output"  # handed to a context manager / iterated: not judged here
        if isinstance(parent, ast.Expr) and node is call:
            return "reservation"  # `torch.empty(n)` alone: grows the pool, never read
        return "transient"


def _target_escapes(target: ast.expr, escapes: set[str]) -> bool:
    if isinstance(target, ast.Name):
        return target.id in escapes
    if isinstance(target, (ast.Tuple, ast.List)):
        return any(_target_escapes(t, escapes) for t in target.elts)
    if isinstance(target, ast.Starred):
        return _target_escapes(target.value, escapes)
    return True  # attribute or subscript: stored somewhere that outlives the region


def _fresh_call(call: ast.Call, catalog: CallCatalog) -> bool:
    """A call whose result is a new tensor that holds no reference to its inputs."""
    func = call.func
    if isinstance(func, ast.Attribute):
        text = ast.unparse(func)
        if text.startswith(("torch.", "F.")):
            return not catalog.is_view(text if text.startswith("torch.") else "torch.nn.functional." + func.attr)
        kind = catalog.method_kind(func.attr)
        return kind in (ALLOC, COPY) and not is_inplace_method(func.attr) and not catalog.is_view("." + func.attr)
    return False


def _referenced_names(expr: ast.AST | None, catalog: CallCatalog) -> set[str]:
    """Names whose objects the value of `expr` may keep alive (a view, a container, a wrapper).

    Stops at calls known to return fresh tensors (torch ops, copies, allocations): their inputs
    can die while the result lives on. Unknown calls (constructors, helpers) may keep their
    arguments, so their arguments count.
    """
    out: set[str] = set()
    stack = [expr] if expr is not None else []
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Call):
            if not _fresh_call(node, catalog):
                stack.extend(ast.iter_child_nodes(node))
        elif isinstance(node, (ast.BinOp, ast.UnaryOp, ast.Compare, ast.Lambda, ast.JoinedStr)):
            continue  # arithmetic makes new tensors; comparisons make bools
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        else:
            stack.extend(ast.iter_child_nodes(node))
    return out


class _Escapes:
    """A set of names, plus the names a `used_outside` test admits lazily: asking whether one
    name is used after a scope costs a lookup, not a pass over the whole function, so that a
    function with n scopes is classified in linear time."""

    def __init__(self, names=(), used_outside=None):
        self.names = set(names)
        self.used_outside = used_outside

    def __contains__(self, name: str) -> bool:
        return name in self.names or (self.used_outside is not None and self.used_outside(name))

    def add_all(self, names) -> bool:
        new = {n for n in names if n not in self}
        self.names |= new
        return bool(new)


def _escaping_names(region_nodes, seed: "_Escapes", catalog: CallCatalog) -> "_Escapes":
    """Names whose objects outlive a region: `seed` (used after it), plus whatever is returned,
    yielded, stored in an attribute/subscript/container or declared global inside it, closed
    over assignments to names that escape."""
    escapes = seed
    assigns = []
    for node in region_nodes:
        if isinstance(node, (ast.Return, ast.Yield, ast.YieldFrom)):
            escapes.add_all(_referenced_names(node.value, catalog))
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            escapes.add_all(node.names)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in STORE_METHODS:
            for arg in node.args:
                escapes.add_all(_referenced_names(arg, catalog))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)):
            assigns.append(node)
    changed = True
    while changed:
        changed = False
        for node in assigns:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(_target_escapes(t, escapes) for t in targets):
                if escapes.add_all(_referenced_names(node.value, catalog)):
                    changed = True
    return escapes


def _function_escapes(node, catalog: CallCatalog) -> "_Escapes":
    return _escaping_names(list(own_nodes(node.body)), _Escapes(), catalog)


class NameUses:
    """Where each name is loaded in one function (or module body): name -> sorted line numbers.
    Built once per function, shared by all the scopes in it."""

    def __init__(self, body, loads_only: bool):
        self.lines: dict[str, list[int]] = {}
        for n in own_nodes(body):
            if isinstance(n, ast.Name) and (not loads_only or isinstance(n.ctx, ast.Load)):
                self.lines.setdefault(n.id, []).append(n.lineno)
        for v in self.lines.values():
            v.sort()

    def used_outside(self, name: str, first: int, last: int) -> bool:
        lines = self.lines.get(name)
        if not lines:
            return False
        if lines[0] < first or lines[-1] > last:
            return True
        return False


def _scope_escapes(site: ScopeSite, catalog: CallCatalog, uses: "NameUses") -> "_Escapes":
    """Names whose objects outlive the scope body (used after it in the enclosing function, or
    handed on inside it). At module level every name used anywhere in the module counts."""
    first, last = site.body_span
    if site.where.func is None:
        seed = _Escapes(used_outside=lambda name: name in uses.lines)
    else:
        seed = _Escapes(used_outside=lambda name: uses.used_outside(name, first, last))
    body_nodes = [n for s in site.body for n in own_nodes([s])]
    return _escaping_names(body_nodes, seed, catalog)
