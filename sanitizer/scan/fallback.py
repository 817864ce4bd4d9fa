"""Fallback paths: the conditions on the way to each scope, and which platforms reach it.

The algorithm, in one place:

1. A *path* is the list of conditions under which a scope's body runs with its window on:
   - inside its function: every enclosing `if` (`when T` in its body, `unless T` in its else),
     `while T`, every earlier `if T: return/raise/continue/break` in an enclosing block
     (`unless T`), a conditional scope expression (`with (a if T else nullcontext())`), and the
     scope's `disabled=D` guard (`unless D`);
   - on every call chain that reaches the function within the parsed files, up to
     CALLER_DEPTH calls up: the same conditions at each call site. A function with no caller
     found is a root (one path, its own conditions); so is a public one (no leading
     underscore), which code outside the parsed files or dynamic dispatch may call.
2. `--when NAME` evaluates each condition with three-valued logic (true / false / unknown) under
   an assignment (Assumption): NAME true, and for a platform NAME the other platforms false
   (`--when sm120`: `is_sm120()` true, `is_sm100()`, `is_hip()`, `_is_npu` false, `_is_cuda`
   true, `get_device_capability()[0] >= 9` true). A path survives unless a condition is false;
   a scope is kept when a path survives, and is *only under NAME* when no path survives NAME
   being false.
3. A scope is *fallback-only* when every path needs particular hardware: some condition on it is
   false on the common case (Baseline: CUDA, no architecture predicate true), as `when
   is_sm120()`, `when _is_hip`, `unless _is_cuda`.

Callers are found by name among the parsed modules (each function and call visited once), then
confirmed by resolving the call; a method call on an object of unknown type counts when exactly
one parsed function has that name.
"""
from __future__ import annotations

import ast
import re
from bisect import bisect_left
from dataclasses import dataclass, field

from sanitizer.scan.resolve import Func, Resolver, Where, own_nodes

CALLER_DEPTH = 3
MAX_PATHS = 16
MAX_GUARDS = 8          # earlier early-exit guards kept per block (the nearest ones)

TERMINAL = (ast.Return, ast.Raise, ast.Continue, ast.Break)
FUNCTION_NODES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Module)

# Platform predicates by identifier (leading underscores dropped, lower case).
PLATFORMS = ("cuda", "hip", "npu", "xpu", "cpu", "mps", "musa", "hpu")
_PLATFORM_RE = re.compile(r"^(?:is_|use_)?(cuda|hip|rocm|npu|xpu|cpu|mps|musa|hpu)(?:_available|_platform|_runtime)?$")
_AMD_RE = re.compile(r"^(?:is_gfx\w*|use_aiter\w*|is_aiter\w*|aiter\w*|is_mi\d+\w*)$")
_ARCH_RE = re.compile(r"(?:^|_)sm_?(\d{2,3})(?:_|$|a\b)")
_ARCH_NAMES = {"hopper": (9,), "blackwell": (10, 12), "ampere": (8,), "ada": (8,)}


@dataclass
class Condition:
    text: str                # "when is_sm120()" / "unless _is_hip"
    test: ast.expr | None    # the expression (None: not parseable, always unknown)
    positive: bool           # when (True) / unless (False)
    where: str               # file:line

    def as_text(self) -> str:
        return f"{self.text} ({self.where})"


@dataclass
class ScopePath:
    conditions: list[Condition]
    via: list[str] = field(default_factory=list)   # callers, innermost first: "f (file:line)"

    def as_dict(self) -> dict:
        return {"via": self.via, "conditions": [c.as_text() for c in self.conditions]}


# -- three-valued evaluation ------------------------------------------------------------------
@dataclass(frozen=True)
class Assumption:
    """What `--when NAME` asserts (negated: what NAME being false asserts)."""

    name: str
    negated: bool = False

    @property
    def arch(self) -> int | None:
        m = re.fullmatch(r"sm_?(\d{2,3})a?", self.name.lower())
        return int(m.group(1)) if m else None

    @property
    def platform(self) -> str | None:
        n = self.name.lower()
        if self.arch is not None:
            return "cuda"
        if n in ("rocm", "amd"):
            return "hip"
        return n if n in PLATFORMS else None

    @property
    def torch_version(self) -> tuple[int, ...] | None:
        """`--when torch2.9`: the torch version assumed (comparisons with `torch.__version__`)."""
        m = re.fullmatch(r"torch-?(\d+(?:\.\d+)*)", self.name.lower())
        return tuple(int(p) for p in m.group(1).split(".")) if m else None

    def torch_compare(self, op: ast.cmpop, literal: str) -> bool | None:
        """`torch version <op> literal` under this assumption (unknown when negated or unset)."""
        mine = self.torch_version
        theirs = _release(literal)
        if mine is None or theirs is None or self.negated:
            return None
        release, pre = theirs
        width = max(len(mine), len(release))
        a, b = mine + (0,) * (width - len(mine)), release + (0,) * (width - len(release))
        if a == b and pre:          # 2.8 against 2.8.0a0: a release is newer than its pre-releases
            a, b = (1,), (0,)
        return _compare(op, a, b)

    def opposite(self) -> "Assumption":
        return Assumption(self.name, not self.negated)

    # A predicate's value under this assumption: True / False / None (unknown).
    def predicate(self, ident: str) -> bool | None:
        ident = ident.lstrip("_").lower()
        kind = predicate_kind(ident)
        if kind is None:
            if self.platform is None and self.name.lower() in ident:
                return not self.negated       # a flag or server argument named NAME
            return None
        family, value = kind
        plat, arch = self.platform, self.arch
        if self.negated:
            if family == "platform" and plat is not None and value == plat and arch is None:
                return False
            if family == "arch" and arch is not None and arch in value:
                return False if len(value) == 1 else None
            return None
        if family == "platform":
            if plat is None:
                return None
            return value == plat
        # family == "arch"
        if plat is not None and plat != "cuda":
            return False
        if arch is None:
            return None
        return arch in value

    def capability(self, op: ast.cmpop, const) -> bool | None:
        arch = self.arch
        if arch is None:
            if self.platform not in (None, "cuda") and not self.negated:
                return False
            return None
        major, minor = divmod(arch, 10)
        if self.negated:  # any other architecture: only an equality test is decided
            if isinstance(const, int) and isinstance(op, (ast.Eq, ast.NotEq)) and const == major:
                return isinstance(op, ast.NotEq)
            return None
        mine = major if isinstance(const, int) else (major, minor)[:len(const)]
        return _compare(op, mine, const)


class Baseline(Assumption):
    """The common case: CUDA, no particular architecture asked for. A path with a condition
    false here needs particular hardware (`is_sm120()`, `_is_hip`, `not _is_cuda`): a fallback."""

    def __init__(self):
        super().__init__("cuda")

    def predicate(self, ident: str) -> bool | None:
        kind = predicate_kind(ident)
        if kind is None:
            return None
        family, value = kind
        return value == "cuda" if family == "platform" else False

    def capability(self, op, const) -> bool | None:
        return None

    def torch_compare(self, op, literal) -> bool | None:
        return None


def _release(text: str) -> tuple[tuple[int, ...], bool] | None:
    """"2.8.0.a0" -> ((2, 8, 0), True): the release numbers, and whether it is a pre-release."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)(.*)$", text)
    if not m:
        return None
    rest = m.group(2).lstrip(".").lower()
    return tuple(int(p) for p in m.group(1).split(".")), rest.startswith(("a", "b", "rc", "dev", "pre"))


def _version_literal(expr: ast.AST) -> str | None:
    """A version written as a string, a call on one (`version.parse("2.8")`) or an int tuple."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.Call) and len(expr.args) == 1 and not expr.keywords:
        return _version_literal(expr.args[0])
    const = _constant(expr)
    if isinstance(const, tuple):
        return ".".join(map(str, const))
    return None


def _torch_version_side(expr: ast.AST) -> bool:
    """`torch.__version__`, `version.parse(torch.__version__)`, `torch_release`, `TORCH_VERSION`."""
    text = ast.unparse(expr).lower()
    return "torch.__version__" in text or bool(re.search(r"\btorch_(?:version|release)\b", text))


_FLIPPED = {ast.Lt: ast.Gt, ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE, ast.Eq: ast.Eq,
            ast.NotEq: ast.NotEq}


def predicate_kind(ident: str):
    """('platform', name) / ('arch', (sm, ...)) for a hardware predicate identifier, else None."""
    ident = ident.lstrip("_").lower()
    m = _PLATFORM_RE.match(ident)
    if m:
        name = m.group(1)
        return ("platform", "hip" if name == "rocm" else name)
    if _AMD_RE.match(ident):
        return ("platform", "hip")
    m = _ARCH_RE.search(ident)
    if m and (ident.startswith(("is_", "use_", "sm")) or "support" in ident):
        return ("arch", (int(m.group(1)),))
    for word, majors in _ARCH_NAMES.items():
        if word in ident and ident.startswith(("is_", "use_")):
            return ("arch", tuple(mj * 10 for mj in majors))
    return None


def _compare(op, a, b) -> bool | None:
    try:
        return {ast.Eq: a == b, ast.NotEq: a != b, ast.Lt: a < b, ast.LtE: a <= b,
                ast.Gt: a > b, ast.GtE: a >= b}.get(type(op))
    except TypeError:
        return None


def _ident(expr: ast.AST) -> str | None:
    """The identifier a predicate expression names: `is_sm120()`, `_is_hip`, `envs.X.get()`,
    `server_args.enable_dp_attention`."""
    if isinstance(expr, ast.Call):
        f = expr.func
        if isinstance(f, ast.Attribute) and f.attr in ("get", "value") and not expr.args:
            return _ident(f.value)
        name = _ident(f) or ""
        if (expr.args and isinstance(expr.args[0], ast.Constant) and isinstance(expr.args[0].value, str)
                and (name in ("get", "getenv") or "env" in name.lower())):
            return expr.args[0].value      # os.environ.get("X"), get_bool_env_var("X")
        return name or None
    if (isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant)
            and isinstance(expr.slice.value, str)):
        return expr.slice.value            # server_args_dict["enable_x"], os.environ["X"]
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return None


def _capability_side(expr: ast.AST) -> bool:
    text = ast.unparse(expr).lower()
    return "capability" in text or text.endswith(("major", "cc_major", "sm_version"))


def _constant(expr: ast.AST):
    if isinstance(expr, ast.Constant) and type(expr.value) is int:
        return expr.value
    if isinstance(expr, ast.Tuple) and all(isinstance(e, ast.Constant) and type(e.value) is int
                                           for e in expr.elts):
        return tuple(e.value for e in expr.elts)
    return None


def evaluate(expr: ast.AST | None, assume: Assumption, depth: int = 0) -> bool | None:
    if expr is None or depth > 50:
        return None
    if isinstance(expr, ast.Constant) and isinstance(expr.value, (bool, int, type(None))):
        return bool(expr.value)
    if isinstance(expr, ast.BoolOp):
        values = [evaluate(v, assume, depth + 1) for v in expr.values]
        if isinstance(expr.op, ast.And):
            return False if False in values else (True if all(v is True for v in values) else None)
        return True if True in values else (False if all(v is False for v in values) else None)
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        v = evaluate(expr.operand, assume, depth + 1)
        return None if v is None else not v
    if isinstance(expr, ast.Compare) and len(expr.ops) == 1:
        left, right = expr.left, expr.comparators[0]
        if isinstance(left, ast.Subscript) and _constant(left.slice) == 0:
            left = left.value   # get_device_capability()[0] >= 9
        op = expr.ops[0]
        for side, other, cmp in ((left, right, op), (right, left, _FLIPPED.get(type(op), type(op))())):
            literal = _version_literal(other)
            if literal is not None and _torch_version_side(side):
                return assume.torch_compare(cmp, literal)
        const = _constant(right)
        if const is not None and _capability_side(left):
            return assume.capability(expr.ops[0], const)
        return None
    if (isinstance(expr, ast.Call) and _ident(expr.func) in TORCH_AT_LEAST and len(expr.args) == 1
            and _version_literal(expr.args[0]) is not None):
        return assume.torch_compare(ast.GtE(), _version_literal(expr.args[0]))
    ident = _ident(expr)
    return assume.predicate(ident) if ident else None


BASELINE = Baseline()
# Helpers that test `torch version >= X` (vLLM's vllm.utils.torch_utils).
TORCH_AT_LEAST = frozenset({"is_torch_equal_or_newer"})


def needs_particular_hardware(path: ScopePath) -> bool:
    return not path_survives(path, BASELINE)


def path_survives(path: ScopePath, assume: Assumption) -> bool:
    for c in path.conditions:
        v = evaluate(c.test, assume)
        if v is not None and v != c.positive:
            return False
    return True


# -- conditions inside one function -----------------------------------------------------------
class Conditions:
    """Conditions on the way to a node within its function, from the module's parent map."""

    def __init__(self):
        self._guards: dict[int, tuple[list[int], list[Condition]]] = {}

    def within(self, module, node: ast.AST, stop: ast.AST | None = None) -> list[Condition]:
        """Conditions between the start of node's function (or `stop`, a scope's with) and node."""
        out: list[Condition] = []
        cur = node
        for _ in range(10_000):
            parent = module.parent(cur)
            if parent is None or parent is stop:
                break
            if isinstance(cur, ast.stmt):
                for name in ("body", "orelse", "finalbody"):
                    block = getattr(parent, name, None)
                    if isinstance(block, list):
                        at = module.position(cur, block)
                        if at is not None:
                            out += self._early_exits(module, block, at)
                            break
            if isinstance(parent, FUNCTION_NODES):
                break
            if isinstance(parent, ast.If):
                if module.position(cur, parent.body) is not None:
                    out.append(_cond("when", parent.test, True, module))
                elif module.position(cur, parent.orelse) is not None:
                    out.append(_cond("unless", parent.test, False, module))
            elif isinstance(parent, ast.While) and module.position(cur, parent.body) is not None:
                out.append(_cond("when", parent.test, True, module))
            elif isinstance(parent, ast.IfExp) and cur is not parent.test:
                positive = cur is parent.body
                out.append(_cond("when" if positive else "unless", parent.test, positive, module))
            cur = parent
        out.reverse()   # outermost first
        return out

    def _early_exits(self, module, block: list, at: int) -> list[Condition]:
        cached = self._guards.get(id(block))
        if cached is None:
            idx, conds = [], []
            for i, stmt in enumerate(block):
                if not isinstance(stmt, ast.If):
                    continue
                body_exits = bool(stmt.body) and isinstance(stmt.body[-1], TERMINAL)
                else_exits = bool(stmt.orelse) and isinstance(stmt.orelse[-1], TERMINAL)
                if body_exits and not else_exits:
                    idx.append(i)
                    conds.append(_cond("unless", stmt.test, False, module))
                elif else_exits and not body_exits:
                    idx.append(i)
                    conds.append(_cond("when", stmt.test, True, module))
            cached = self._guards[id(block)] = (idx, conds)
        idx, conds = cached
        end = bisect_left(idx, at)
        return list(reversed(conds[max(0, end - MAX_GUARDS):end]))


def _cond(word: str, test: ast.expr, positive: bool, module) -> Condition:
    return Condition(f"{word} {_one_line(test)}", test, positive, f"{module.rel}:{test.lineno}")


def parse_condition(text: str, where: str) -> Condition:
    """A condition given as text ("when x" / "unless x"), as ScopeMatch keeps them."""
    word, _, rest = text.partition(" ")
    try:
        test = ast.parse(rest, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        test = None
    return Condition(text, test, word != "unless", where)


# -- callers ----------------------------------------------------------------------------------
class CallerIndex:
    """Calls by callee name among the parsed modules. A module is indexed (each of its functions
    and calls visited once) the first time a name it mentions is asked for."""

    def __init__(self, resolver: Resolver, modules):
        self.resolver = resolver
        self.modules = list(modules)
        self._indexed: dict[int, dict[str, list[tuple[Func, ast.Call]]]] = {}
        self._defs: dict[int, dict[str, int]] = {}
        self._callers: dict[int, list] = {}

    def _module_index(self, module):
        table = self._indexed.get(id(module))
        if table is None:
            table, defs = {}, {}
            for f in self.resolver.module_functions(module):
                defs[f.node.name] = defs.get(f.node.name, 0) + 1
                for node in own_nodes(f.node.body):
                    if isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
                        name = _ident(node.func)
                        if name:
                            table.setdefault(name, []).append((f, node))
            self._indexed[id(module)] = table
            self._defs[id(module)] = defs
        return table

    def _calls_named(self, name: str):
        for module in self.modules:
            if name in module.text:
                yield from self._module_index(module).get(name, [])

    def _defs_named(self, name: str) -> int:
        total = 0
        for module in self.modules:
            if name in module.text:
                self._module_index(module)
                total += self._defs[id(module)].get(name, 0)
        return total

    def callers(self, func: Func) -> list[tuple[Func, ast.Call, str]]:
        cached = self._callers.get(id(func.node))
        if cached is None:
            cached = self._callers[id(func.node)] = self._find_callers(func)
        return cached

    def _find_callers(self, func: Func) -> list[tuple[Func, ast.Call, str]]:
        out = []
        name = func.node.name
        defs = None
        for caller, call in self._calls_named(name):
            if caller is func:
                continue
            target = self.resolver.resolve_call(call, Where(caller.module, caller))
            if any(f.node is func.node for f in target.funcs):
                out.append((caller, call, ""))
            elif not target.funcs and target.method == name and not name.startswith("__"):
                if defs is None:
                    defs = self._defs_named(name)
                if defs == 1:
                    out.append((caller, call, " by name"))
        return out


class PathFinder:
    def __init__(self, resolver: Resolver, modules, depth: int = CALLER_DEPTH):
        self.index = CallerIndex(resolver, modules)
        self.conditions = Conditions()
        self.depth = depth
        self._cache: dict[tuple[int, int], list[ScopePath]] = {}

    def paths(self, func: Func | None, own: list[Condition]) -> list[ScopePath]:
        if func is None:
            return [ScopePath(own)]
        out = []
        for up in self._reaching(func, self.depth):
            out.append(ScopePath(up.conditions + own, up.via))
            if len(out) >= MAX_PATHS:
                break
        return out

    def _reaching(self, func: Func, depth: int) -> list[ScopePath]:
        """Paths from the roots of the call graph (or CALLER_DEPTH calls up) to `func`'s entry.
        Memoised per (function, depth); the depth bounds recursion, cycles included."""
        key = (id(func.node), depth)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        self._cache[key] = [ScopePath([])]      # a cycle back here reads the root path
        callers = self.index.callers(func) if depth > 0 else []
        # A public function (no leading underscore) may also be called from outside the parsed
        # files or through dynamic dispatch (`forward_cuda`): it stays a root of its own.
        public = not func.node.name.startswith("_")
        result = [ScopePath([])] if (public or not callers) else []
        for caller, call, how in callers:
            at_call = self.conditions.within(caller.module, call)
            hop = f"{caller.qualname} ({caller.module.rel}:{call.lineno}{how})"
            for up in self._reaching(caller, depth - 1):
                result.append(ScopePath(up.conditions + at_call, [hop] + up.via))
                if len(result) >= MAX_PATHS:
                    break
            if len(result) >= MAX_PATHS:
                break
        self._cache[key] = result
        return result


def _one_line(node: ast.AST, limit: int = 100) -> str:
    try:
        text = " ".join(ast.unparse(node).split())
    except (RecursionError, ValueError):
        text = "<expression>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
