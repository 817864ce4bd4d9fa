"""`hazsan scan`: find the scopes, classify them, apply the allow-list; the result as data."""
from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from sanitizer.scan.allow import AllowEntry, AllowList
from sanitizer.scan.classify import (BodyClassifier, CallRecord, kernels_of, known_compute, records_under,
                                     region_class)
from sanitizer.scan.config import WINDOW_SCOPES, ScanConfig
from sanitizer.scan.fallback import (BASELINE, Assumption, Condition, PathFinder, needs_particular_hardware, parse_condition,
                                     path_survives)
from sanitizer.scan.pools import WindowPools
from sanitizer.scan.resolve import Resolver, Where, own_nodes
from sanitizer.scan.scopes import ScopeMatcher, ScopeSite
from sanitizer.scan.source import ModuleInfo, SourceProblem, SourceTree, _real

SNIPPET_LINES = 12


@dataclass
class ScopeReport:
    file: str
    line: int
    end_line: int
    function: str
    scope: str                       # configured name matched
    call: str                        # the scope call as written
    entered: str                     # with / async with / ExitStack.enter_context
    via: list[str]
    guard: str | None
    disabled: bool                   # statically disabled (disabled=True): never in the window
    klass: str
    records: list[CallRecord]
    nested: list[int]
    parent: int | None
    pool: str | None
    symmetric: bool | None
    snippet: list[tuple[int, str]]
    body_span: tuple[int, int]
    path: Path                       # the file on disk (for matching trace sites)
    yields: bool = False             # a @contextmanager body: its callers' blocks are the real bodies
    allowed: AllowEntry | None = None
    runtime: dict | None = None
    paths: list = field(default_factory=list)   # fallback.Path: the conditions on each way here
    changed: list[str] = field(default_factory=list)  # --changed-since: what changed ("file:lines")
    when: dict | None = None         # --when: {"condition": NAME, "only": bool}
    # how the scan knows: {"how": "name" / "inferred" / "private pool", "name", "chain": [...]}
    recognised: dict = field(default_factory=dict)

    @property
    def window(self) -> bool:
        """The scope allocates into a symmetric window (only these can fail): SGLang's scopes,
        torch symmetric memory, a pool the tree registers as a window, or a configured scope."""
        return self.symmetric is not False

    @property
    def unresolved(self) -> bool:
        """compute only because of calls the scan cannot see into (compiled extensions, objects
        of unknown type): nothing known computes or leaves a transient."""
        return self.klass == "compute" and not any(known_compute(r) for r in self.records)

    @property
    def label(self) -> str:
        return "compute (unresolved)" if self.unresolved else self.klass

    @property
    def kernels(self) -> list[CallRecord]:
        return kernels_of(self.records)

    @property
    def failing(self) -> bool:
        return self.klass == "compute" and not self.disabled and self.allowed is None and self.window

    def class_under(self, assume) -> str:
        """The class with only the calls that can run under `assume` (`--when`, fallback)."""
        return region_class(records_under(self.records, assume))

    @property
    def fallback_only(self) -> bool:
        """A compute scope that computes only on particular hardware: every way here needs it,
        or the calls that compute run only under hardware conditions (not on the common case)."""
        if self.klass != "compute":
            return False
        if self.paths and all(needs_particular_hardware(p) for p in self.paths):
            return True
        return self.class_under(BASELINE) != "compute"

    def as_dict(self) -> dict:
        d = {
            "file": self.file, "line": self.line, "end_line": self.end_line,
            "function": self.function, "class": self.klass,
            "calls": [r.as_dict() for r in self.records],
            "guard": self.guard, "disabled": self.disabled,
            "scope": self.scope, "scope_call": self.call, "entered": self.entered, "via": self.via,
            "nested": self.nested, "parent": self.parent,
            "pool": self.pool, "symmetric": self.symmetric, "window": self.window,
            "recognised": self.recognised,
            "label": self.label, "unresolved_only": self.unresolved,
            "kernels": [f"{r.callee} ({r.file}:{r.line})" for r in self.kernels],
            "yields": self.yields,
            "transients": [f"{r.callee} ({r.file}:{r.line})" for r in _flat(self.records) if r.transient
                           and not r.inner],
            "unresolved": sum(1 for r in _flat(self.records) if not r.resolved),
            "allowed": ({"entry": self.allowed.pattern, "reason": self.allowed.reason,
                         "source": self.allowed.source} if self.allowed else None),
            "failing": self.failing,
            "paths": [p.as_dict() for p in self.paths],
            "fallback_only": self.fallback_only,
        }
        if self.when is not None:
            d["when"] = self.when
        if self.changed:
            d["changed"] = self.changed
        if self.runtime is not None:
            d["runtime"] = self.runtime
        return d


def _flat(records):
    for r in records:
        yield r
        yield from _flat(r.inner)


@dataclass
class ScanResult:
    scopes: list[ScopeReport]
    problems: list[SourceProblem]
    files_total: int
    files_parsed: int
    depth: int
    scope_names: tuple[str, ...]
    allow_unused: list[AllowEntry] = field(default_factory=list)
    runtime: dict | None = None
    command: str | None = None
    rel_to_real: dict[str, str] = field(default_factory=dict)
    filtered: dict[str, int] = field(default_factory=dict)   # scopes left out, by filter
    when: list[str] = field(default_factory=list)

    def keep_when(self, names: list[str]) -> None:
        """--when NAME...: keep the scopes some path reaches with every NAME true; mark those
        that no path reaches with NAME false (reachable only under it)."""
        assumptions = [Assumption(n) for n in names]
        kept = []
        for s in self.scopes:
            if not all(any(path_survives(p, a) for p in s.paths) for a in assumptions):
                continue
            only = [a.name for a in assumptions
                    if not any(path_survives(p, a.opposite()) for p in s.paths)]
            s.when = {"conditions": names, "only_under": only, "class_before": s.klass}
            if s.klass == "compute":
                # the class on this hardware: calls whose conditions are false here are dropped
                records = s.records
                for a in assumptions:
                    records = records_under(records, a)
                s.klass = region_class(records)
                if s.klass != "compute":
                    s.allowed = None
            kept.append(s)
        self.filtered["when"] = len(self.scopes) - len(kept)
        self.when = list(names)
        self.scopes = kept

    @property
    def failing(self) -> list[ScopeReport]:
        return [s for s in self.scopes if s.failing]

    def by_class(self) -> dict[str, int]:
        """Classes of the window scopes (private-pool scopes are counted apart)."""
        out = {"compute": 0, "copy": 0, "alloc": 0}
        for s in self.scopes:
            if s.window:
                out[s.klass] += 1
        return out

    def summary(self) -> dict:
        d = {
            "files": self.files_total, "files_parsed": self.files_parsed,
            "scopes": len(self.scopes), "by_class": self.by_class(),
            "window_scopes": sum(1 for s in self.scopes if s.window),
            "private_pool_scopes": sum(1 for s in self.scopes if not s.window),
            "compute_unresolved": sum(1 for s in self.scopes if s.window and s.unresolved),
            "failing": len(self.failing),
            "allowed": sum(1 for s in self.scopes if s.allowed is not None),
            "statically_disabled": sum(1 for s in self.scopes if s.disabled),
            "syntax_errors": sum(1 for p in self.problems if p.message.startswith("syntax error")),
            "internal_errors": sum(1 for p in self.problems if p.message.startswith("internal error")),
            "unreadable": sum(1 for p in self.problems
                              if not p.message.startswith(("syntax error", "internal error"))),
            "depth": self.depth, "scope_names": list(self.scope_names),
            "allow_unused": [f"{e.source}: {e.pattern}" for e in self.allow_unused],
        }
        d["fallback_only_compute"] = sum(1 for s in self.scopes if s.window and s.klass == "compute"
                                         and s.fallback_only)
        if self.when:
            d["when"] = self.when
            d["only_under_when"] = sum(1 for s in self.scopes if s.when and s.when["only_under"])
        if self.filtered:
            d["left_out"] = dict(self.filtered)
        if self.command:
            d["command"] = self.command
        if self.runtime is not None:
            d["runtime"] = self.runtime
        return d

    def as_dict(self) -> dict:
        return {"scopes": [s.as_dict() for s in self.scopes],
                "errors": [p.as_dict() for p in self.problems],
                "summary": self.summary()}


class Scanner:
    def __init__(self, config: ScanConfig, allow: AllowList | None = None):
        self.config = config
        self.allow = allow or AllowList([])

    def run(self, roots: list[Path]) -> ScanResult:
        tree = SourceTree(roots, self.config.exclude)
        resolver = Resolver(tree)
        matcher = ScopeMatcher(resolver, self.config.scopes)
        modules = self._candidates(tree, matcher)
        sites = self._sites(modules, matcher, tree)
        classifier = BodyClassifier(resolver, self.config.catalog, self.config.depth,
                                    {id(s.node) for s in sites if not isinstance(s.node, ast.Call)},
                                    self.allow.settle if self.allow.has_calls else None,
                                    {id(s.where.func.node) for s in sites if s.where.func is not None})
        reports, report_sites = [], []
        for site in sites:
            try:
                reports.append(self._report(site, classifier))
                report_sites.append(site)
            except (RecursionError, ValueError, TypeError, AttributeError, KeyError) as exc:
                # A construct the analysis does not handle must not end the whole scan.
                tree.problems.append(SourceProblem(
                    site.module.rel, site.line, f"internal error while classifying this scope "
                    f"({type(exc).__name__}: {exc}); please report it"))
        _link_nesting(reports)
        # Callers are searched among the files the scopes and their helpers led to; the files
        # read only for pool registrations (next) add no callers.
        finder = PathFinder(resolver, tree.parsed_modules(), self.config.caller_depth)
        pools = WindowPools(tree, resolver)
        for r, site in zip(reports, report_sites):
            try:
                r.pool, r.symmetric, r.recognised = _recognise(site.match, matcher, site, pools)
            except (RecursionError, ValueError, TypeError, AttributeError, KeyError) as exc:
                tree.problems.append(SourceProblem(
                    site.module.rel, site.line, f"internal error while identifying this scope's "
                    f"pool ({type(exc).__name__}: {exc}); please report it"))
        for r, site in zip(reports, report_sites):
            try:
                r.paths = finder.paths(site.where.func, self._own_conditions(site, finder))
            except (RecursionError, ValueError, TypeError, AttributeError, KeyError) as exc:
                tree.problems.append(SourceProblem(
                    site.module.rel, site.line, f"internal error while finding the conditions of this "
                    f"scope ({type(exc).__name__}: {exc}); please report it"))
        for r in reports:
            if r.klass == "compute" and not r.disabled and r.window:
                r.allowed = self.allow.accept(r.file, r.line, r.function)
        reports.sort(key=lambda r: (r.file, r.line))
        result = ScanResult(reports, sorted(tree.problems, key=lambda p: (p.file, p.line or 0)),
                            len(tree.files), tree.parsed_count, self.config.depth, self.config.scopes,
                            self.allow.unused())
        result.rel_to_real = {sf.rel: _real(sf.path) for sf in tree.files}
        return result

    # -- steps ------------------------------------------------------------------------------
    @staticmethod
    def _candidates(tree: SourceTree, matcher: ScopeMatcher) -> list[ModuleInfo]:
        """Files that can enter a scope: they mention a scope name or a helper that hands one out.

        A cheap text pre-filter, repeated while new scope-returning helpers turn up (their
        names become tokens too), keeps a scan of a large tree to the files that matter.
        """
        modules: list[ModuleInfo] = []
        taken: set[int] = set()
        seen_tokens: set[str] = set()
        for _ in range(ScopeMatcher.MAX_CHAIN + 1):
            tokens = matcher.text_tokens()
            new = {t.encode() for t in tokens - seen_tokens}
            if tokens and not new:
                break
            seen_tokens |= tokens
            added = []
            for sf in tree.files:
                if id(sf) in taken:
                    continue
                if tokens:
                    data = tree.read_bytes(sf)
                    if not any(t in data for t in new):
                        continue
                taken.add(id(sf))
                info = tree.parse(sf)
                if info is not None:
                    added.append(info)
            modules += added
            grew = matcher.discover_factories(modules)
            if not tokens or not grew:
                break
        for _ in range(ScopeMatcher.MAX_CHAIN):  # helpers of helpers within these files, bounded
            if not matcher.discover_factories(modules):
                break
        return modules

    @staticmethod
    def _sites(modules: list[ModuleInfo], matcher: ScopeMatcher, tree: SourceTree) -> list[ScopeSite]:
        sites, seen = [], set()
        for module in modules:
            try:
                found = matcher.sites(module)
            except (RecursionError, ValueError, TypeError, AttributeError, KeyError) as exc:
                tree.problems.append(SourceProblem(
                    module.rel, None, f"internal error while finding scopes "
                    f"({type(exc).__name__}: {exc}); please report it"))
                continue
            for site in found:
                if id(site.node) in seen:
                    continue  # `with a(), b():` both scopes: one report for the block
                seen.add(id(site.node))
                sites.append(site)
        return sites

    def _own_conditions(self, site: ScopeSite, finder: PathFinder) -> list[Condition]:
        """Conditions inside the scope's function: enclosing ifs and early exits, a conditional
        scope expression, and the `disabled=` guard (the window is on unless it holds)."""
        own = finder.conditions.within(site.module, site.node)
        where = f"{site.module.rel}:{site.line}"
        own += [parse_condition(c, where) for c in site.match.conditions]
        for kw in site.match.call.keywords:
            if kw.arg in self.config.guard_keywords:
                own.append(Condition(f"unless {kw.arg}={_one_line(kw.value)}", kw.value, False, where))
        return own

    def _report(self, site: ScopeSite, classifier: BodyClassifier) -> ScopeReport:
        records, nested = classifier.scope_records(site)
        m = site.match
        guard_parts, disabled = [], False
        for kw in m.call.keywords:
            if kw.arg in self.config.guard_keywords:
                guard_parts.append(f"{kw.arg}={_one_line(kw.value)}")
                if isinstance(kw.value, ast.Constant) and kw.value.value is True:
                    disabled = True
        guard_parts += m.conditions
        first = site.line
        last = site.body_span[1]
        snippet_end = min(last, first + SNIPPET_LINES - 1)
        snippet = list(zip(range(first, snippet_end + 1), site.module.lines(first, snippet_end)))
        return ScopeReport(
            file=site.module.rel, line=site.line, end_line=last, function=site.where.qualname,
            scope=m.scope, call=_one_line(m.call), entered=site.entered, via=m.via,
            guard="; ".join(guard_parts) or None, disabled=disabled,
            klass=region_class(records), records=records, nested=sorted(set(nested)), parent=None,
            pool=None, symmetric=None, snippet=snippet, body_span=site.body_span,
            path=site.module.source.path,
            yields=any(isinstance(n, (ast.Yield, ast.YieldFrom)) for s in site.body for n in own_nodes([s])))


def _recognise(m, matcher: ScopeMatcher, site: ScopeSite, pools: WindowPools
               ) -> tuple[str | None, bool | None, dict]:
    """The pool a scope enters, whether it is a symmetric window, and how the scan knows.

    By name: SGLang's scopes, hazsan's `sanitizer.symmetric_scope` and any configured scope other
    than `use_mem_pool` are windows.
    A `use_mem_pool` scope is inferred to be one when its pool is (pools.py: a known symmetric
    pool, or one the tree registers as a window); any other pool is private (False)."""
    chain = [*m.via, f"{_one_line(m.call)} ({m.call_module.rel}:{m.call.lineno})"]
    if "use_mem_pool" not in m.scope:
        symmetric = True if m.scope in WINDOW_SCOPES else None
        return None, symmetric, {"how": "name", "name": m.scope, "chain": chain}
    arg = m.call.args[0] if m.call.args else next(
        (k.value for k in m.call.keywords if k.arg == "pool"), None)
    where = m.call_where or site.where
    verdict = pools.verdict(arg, where, lambda e, w: _bindings_of(matcher, e, w))
    if verdict.symmetric:
        return verdict.text, True, {"how": "inferred", "name": m.scope, "chain": chain + verdict.evidence}
    return verdict.text, False, {"how": "private pool", "name": m.scope,
                                 "chain": chain + ["the tree never registers this pool as a window"]}


def _bindings_of(matcher: ScopeMatcher, expr, where):
    """(value, where) for what a variable or a self attribute naming a pool was assigned."""
    func = where.func
    if isinstance(expr, ast.Name) and func is not None:
        for value in matcher.assignments(func).get(expr.id, []):
            yield value, where
    elif (isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and func is not None
          and func.cls is not None and expr.value.id == func.self_name):
        for value, owner in matcher.attributes(func).get(expr.attr, []):
            yield value, Where(owner.module, owner)


def _link_nesting(reports: list[ScopeReport]) -> None:
    """Each scope's parent: the innermost other scope whose body holds its line. One sweep per
    file in line order with a stack of open bodies (bodies nest, as the syntax does)."""
    by_file: dict[str, list[ScopeReport]] = {}
    for r in reports:
        by_file.setdefault(r.file, []).append(r)
    for group in by_file.values():
        group.sort(key=lambda r: (r.line, -r.body_span[1]))
        open_bodies: list[ScopeReport] = []
        for r in group:
            while open_bodies and open_bodies[-1].body_span[1] < r.line:
                open_bodies.pop()
            best = next((o for o in reversed(open_bodies) if o.body_span[0] <= r.line), None)
            if best is not None:
                r.parent = best.line
                if r.line not in best.nested:
                    best.nested.append(r.line)
            open_bodies.append(r)
        for r in group:
            r.nested.sort()


def _one_line(node: ast.AST, limit: int = 120) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
