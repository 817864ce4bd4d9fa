"""Tensor arithmetic written with operators: which `x @ w`, `a * b + c`, `-x` in a body are ops.

An operator on tensors runs an op and allocates its result, like the call it stands for (`x @ w`
is `torch.matmul(x, w)`); on Python numbers, strings, shapes and containers it allocates nothing
on the device. The source alone seldom says which, so each operand gets a kind from what its
function shows (nothing is imported or run), computed on demand and memoised per function:

- size (an integer; every size is also a scalar): `len(...)`, `int(...)`, `round(...)`,
  `triton.cdiv(...)`, a tensor's `.shape` / `.ndim` and what is indexed out of them
  (`x.shape[0]`), `.size(...)` / `.numel()` / `.dim()` / `.stride(...)`, a parameter annotated
  `int`, a `range` loop variable, and every value used as a size (below);
- scalar: a number literal, `float(...)` & co., `math.*`, a tensor's `.dtype` / `.device` /
  flags, `.item()`, an attribute of an imported module (`torch.float32`, `math.pi`),
  `torch.finfo(...)`, arithmetic on scalars, a parameter annotated `float` / `bool` /
  `torch.dtype` / ... or defaulting to a number;
- object: a string (literal, f-string), a container (a tuple, list, dict or set display, a
  comprehension), any other non-tensor (a parameter annotated with a class, `self`, `*args`):
  never an operand of tensor arithmetic (`"%d" % n`, `[x] * 2`, `shape + (1,)` are not);
- tensor: a `torch.*` / `F.*` op or allocation (not metadata such as `torch.finfo`, nor the
  `torch.cuda` / `torch.distributed` namespaces), a method call on a tensor other than metadata
  (`x.float()`, `x.sum()`), a tensor-only method on anything (`.contiguous()`, `.view(...)`, ...),
  indexing a tensor, `@`, a parameter annotated `Tensor` / `Parameter` or read as a tensor in its
  function (`x.shape`, `x.size(0)`, `x.float()`, an operand of `@`), and by default an
  unannotated parameter that nothing makes a scalar, of a function that handles tensors (enters a
  symmetric scope, calls a torch op or a tensor-only method, uses `@`, has a parameter annotated a
  tensor or read as one) and is no constructor: the arguments around a symmetric scope are mostly
  tensors, a constructor's are settings;
- unknown: everything else (`self.x`, results of tree functions and compiled extensions).

A name takes the kind of its bindings in the function (assignments, loop targets, parameters; a
closure's free names those of the enclosing function, a module-level name those of the module):
tensor when any binding is one, scalar when all are, object when all are known and none is a
tensor. An unannotated parameter's default tensor kind gives way to a scalar binding of the same
name (`n = int(n)`), to its use as a size, and, in arithmetic, to a size operand
(`x.size(0) // world`: a parameter met with a size is a count).

A size position: a positional argument of an allocation that takes sizes (`torch.empty(n * 2)`,
`torch.arange`, ...), of a method taking sizes or dims (`.view`, `.reshape`, `.new_empty`,
`.narrow`, `.split`, ...), of `range`, `int`, `round`, `math.*`, `triton.cdiv`, a `dim=` /
`size=` / `shape=` keyword, a slice bound, an argument or the grid of a Triton launch
`kernel[grid](...)`. It is seen through arithmetic, tuples and lists (`torch.empty((n * 2, h))`),
and backwards through assignments (`chunk = n // world` then `x[:chunk]` makes n and world
sizes).

An operator expression is tensor arithmetic (compute) when it is `@`; or it is another binary
operator or unary `-` / `~`, it is not in a size position, no operand is an object, and the
operands' kinds meet in a tensor. `x += y` is not an operator expression here: on a tensor it
writes in place and allocates nothing (`x = x + y` allocates). Comparisons (`x > 0`) are not
counted: their operands are flags and sizes far more often than tensors.
"""
from __future__ import annotations

import ast
import fnmatch

from sanitizer.scan.catalog import ALLOC, COPY, NEUTRAL, VIEW_METHODS, CallCatalog
from sanitizer.scan.resolve import Resolver, Where, own_nodes

# `size` is the scalar that counts (an integer: a dimension, a length, an index); every size is
# a scalar, and what the rule says of scalars holds for sizes.
TENSOR, SCALAR, SIZE, OBJECT = "tensor", "scalar", "size", "object"
NUMBERS = (SCALAR, SIZE)
_WEAK_TENSOR = "tensor by default"  # an unannotated parameter: a tensor unless a binding or a use says not
_CYCLE = "cycle"             # a name whose kind is being computed: no evidence either way

OPERATOR_SYMBOLS = {
    ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.MatMult: "@", ast.Div: "/", ast.FloorDiv: "//",
    ast.Mod: "%", ast.Pow: "**", ast.LShift: "<<", ast.RShift: ">>", ast.BitOr: "|",
    ast.BitXor: "^", ast.BitAnd: "&", ast.USub: "unary -", ast.Invert: "~",
}

# Tensor attributes that are metadata: sizes, and a dtype, a device, a flag.
SIZE_ATTRS = frozenset({"shape", "ndim", "itemsize", "nbytes"})
METADATA_ATTRS = SIZE_ATTRS | frozenset({
    "dtype", "device", "is_cuda", "is_cpu", "is_meta", "layout", "requires_grad", "is_leaf",
    "is_sparse", "is_quantized", "is_contiguous",
})
# Attributes that are the tensor itself, viewed.
VIEW_ATTRS = frozenset({"T", "mT", "H", "mH", "real", "imag", "data"})
# Methods returning a size, or another Python number or flag, whatever the receiver.
METHODS_RETURNING_SIZES = frozenset({
    "size", "stride", "dim", "ndimension", "numel", "nelement", "element_size", "data_ptr",
    "storage_offset", "get_device", "bit_length",
})
METHODS_RETURNING_SCALARS = METHODS_RETURNING_SIZES | frozenset({
    "item", "tolist", "is_contiguous", "is_floating_point", "is_complex", "is_signed",
})
# Methods only a tensor has (beyond the allocation and copy methods of the call catalog): the
# receiver of one is a tensor, and so is its result.
TENSOR_ONLY_METHODS = frozenset({
    "sum", "mean", "amax", "amin", "softmax", "sigmoid", "exp", "sqrt", "rsqrt", "abs", "clamp",
    "matmul", "mm", "bmm", "pow", "norm", "argmax", "argmin", "topk", "cumsum",
    "masked_fill", "index_select", "gather", "scatter", "float", "half", "bfloat16", "contiguous",
    "view", "view_as", "reshape", "expand", "expand_as", "unsqueeze", "squeeze", "transpose",
    "permute", "movedim", "flatten", "unflatten", "narrow", "repeat", "clone", "detach",
})
# Builtins and functions whose result is a size, or another Python number (or a flag), whatever
# their arguments.
FUNCTIONS_RETURNING_SIZES = frozenset({
    "len", "int", "round", "ord", "triton.cdiv", "triton.next_power_of_2", "torch.Size", "torch.numel",
})
FUNCTIONS_RETURNING_SCALARS = FUNCTIONS_RETURNING_SIZES | frozenset({
    "float", "bool", "hash", "id", "divmod", "isinstance", "issubclass", "callable", "hasattr",
    "torch.finfo", "torch.iinfo", "torch.device", "torch.get_default_dtype", "torch.is_tensor",
    "torch.is_grad_enabled",
})
FUNCTION_GLOBS_RETURNING_SCALARS = ("math.*", "numpy.*", "operator.*")
FUNCTIONS_RETURNING_OBJECTS = frozenset({
    "str", "repr", "format", "bytes", "chr", "hex", "bin", "list", "tuple", "dict", "set",
    "frozenset", "sorted", "reversed", "zip", "enumerate", "map", "filter", "iter", "range", "slice",
    "type", "object", "super", "vars", "locals", "globals", "print",
})
# Builtins whose result is one of their arguments (or arithmetic on them).
PASS_THROUGH_FUNCTIONS = frozenset({"min", "max", "abs", "sum", "pow"})
CONSTRUCTORS = frozenset({"__init__", "__new__", "__post_init__"})
# torch namespaces that hold no tensor ops (`torch.distributed.get_rank()` is a number).
NON_TENSOR_TORCH = frozenset({"cuda", "distributed", "backends", "compiler", "_dynamo", "version",
                              "utils", "jit", "fx", "library", "accelerator", "mps", "xpu", "npu"})

# Where a value is a size (an integer): positional arguments of these callees ...
FUNCTIONS_TAKING_SIZES = frozenset({
    "torch.empty", "torch.zeros", "torch.ones", "torch.full", "torch.empty_strided", "torch.rand",
    "torch.randn", "torch.randint", "torch.randperm", "torch.arange", "torch.linspace", "torch.eye",
    "range", "int", "round", "divmod", "triton.cdiv", "triton.next_power_of_2",
})
FUNCTION_GLOBS_TAKING_SIZES = ("math.*",)
METHODS_TAKING_SIZES = frozenset({
    "view", "reshape", "expand", "repeat", "tile", "new_empty", "new_zeros", "new_ones", "new_full",
    "new_empty_strided", "narrow", "unflatten", "permute", "transpose", "flatten", "split", "chunk",
    "select", "squeeze", "unsqueeze", "movedim", "size", "stride", "resize_",
})
# ... and these keywords anywhere.
SIZE_KEYWORDS = frozenset({"dim", "dims", "size", "shape"})
SIZE_ANNOTATIONS = frozenset({"int", "Size", "SymInt"})
SCALAR_ANNOTATIONS = frozenset({"float", "bool", "complex", "dtype", "device", "SymFloat"})
TENSOR_ANNOTATIONS = frozenset({"Tensor", "Parameter"})
UNKNOWN_ANNOTATIONS = frozenset({"Any", "object"})


def operator_symbol(node: ast.AST) -> str | None:
    """The operator of an expression that may be tensor arithmetic, else None."""
    if isinstance(node, ast.BinOp):
        return OPERATOR_SYMBOLS.get(type(node.op))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Invert)):
        return OPERATOR_SYMBOLS[type(node.op)]
    return None


def _matches(name: str, exact: frozenset, globs: tuple[str, ...]) -> bool:
    return name in exact or any(fnmatch.fnmatchcase(name, g) for g in globs)


class OperandTyper:
    """The operand kinds of every function the classifier reads, one `FunctionKinds` each."""

    def __init__(self, resolver: Resolver, catalog: CallCatalog, scope_functions=frozenset()):
        self.resolver = resolver
        self.catalog = catalog
        self.scope_functions = scope_functions   # ids of the function nodes that enter a scope
        self._kinds: dict[int, FunctionKinds] = {}

    def kinds(self, where: Where) -> "FunctionKinds":
        owner = where.func.node if where.func is not None else where.module.tree
        kinds = self._kinds.get(id(owner))
        if kinds is None:
            if where.func is None:
                enclosing = None
            elif where.func.outer is not None:
                enclosing = self.kinds(Where(where.module, where.func.outer))
            else:
                enclosing = self.kinds(Where(where.module))
            kinds = self._kinds[id(owner)] = FunctionKinds(self, where, enclosing)
        return kinds

    def tensor_arithmetic(self, node: ast.AST, where: Where) -> str | None:
        """Why the operator expression `node` is tensor arithmetic, or None when it is not."""
        return self.kinds(where).tensor_arithmetic(node)


class FunctionKinds:
    """Operand kinds in one function (or module body)."""

    def __init__(self, typer: OperandTyper, where: Where, enclosing: "FunctionKinds | None"):
        self.typer = typer
        self.where = where
        self.module = where.module
        self.enclosing = enclosing
        func = where.func
        body = func.node.body if func is not None else where.module.tree.body
        self.nodes = list(own_nodes(body))
        self.bindings: dict[str, list[tuple]] = {}
        if func is not None:
            self._bind_parameters(func)
        for node in self.nodes:
            self._bind(node)
        self.sizes = self._size_names()
        self.tensor_receivers = self._tensor_receivers()
        self.handles_tensors = func is not None and self._handles_tensors(func)
        self._name_kinds: dict[str, str | None] = {}
        self._in_progress: set[str] = set()
        self._arithmetic: dict[int, str | None] = {}   # id(BinOp) -> kind: chains stay linear

    # -- the question asked -----------------------------------------------------------------
    def tensor_arithmetic(self, node: ast.AST) -> str | None:
        symbol = operator_symbol(node)
        if symbol is None:
            return None
        text = _one_line(node)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
            return f"op: tensor arithmetic `{text}` (operator @, a matrix product)"
        if self.is_size(node):
            return None
        operands = [node.left, node.right] if isinstance(node, ast.BinOp) else [node.operand]
        kinds = [self._kind(o) for o in operands]
        if _arithmetic_kind(kinds) not in (TENSOR, _WEAK_TENSOR):
            return None
        tensor = operands[kinds.index(TENSOR if TENSOR in kinds else _WEAK_TENSOR)]
        return f"op: tensor arithmetic `{text}` (operator {symbol}; {self.explain(tensor)})"

    def explain(self, expr: ast.expr) -> str:
        """Why `expr` is a tensor, in a few words."""
        if isinstance(expr, ast.Name):
            owner = self._owner_of(expr.id)
            for binding in owner.bindings.get(expr.id, []):
                if binding[0] == "parameter":
                    kind = owner._binding_kind(expr.id, binding)
                    if kind in (TENSOR, _WEAK_TENSOR):
                        how = ("annotated a tensor" if binding[1].annotation is not None
                               else "read as a tensor" if kind == TENSOR else "unannotated")
                        return f"{expr.id} is a parameter, {how}"
                elif owner._binding_kind(expr.id, binding) == TENSOR:
                    value = binding[1]
                    return f"{expr.id} = {_one_line(value, 60)} (line {value.lineno})"
        if isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.MatMult):
            return f"{_one_line(expr, 60)} is a matrix product"
        return f"{_one_line(expr, 60)} is a tensor"

    # -- kinds ------------------------------------------------------------------------------
    def kind(self, expr: ast.AST | None) -> str | None:
        k = self._kind(expr)
        return TENSOR if k == _WEAK_TENSOR else (None if k == _CYCLE else k)

    def _kind(self, expr: ast.AST | None):
        if expr is None:
            return None
        if isinstance(expr, ast.Constant):
            return OBJECT if isinstance(expr.value, (str, bytes)) else SCALAR
        if isinstance(expr, (ast.JoinedStr, ast.Tuple, ast.List, ast.Set, ast.Dict, ast.ListComp,
                             ast.SetComp, ast.DictComp, ast.GeneratorExp, ast.Lambda)):
            return OBJECT
        if isinstance(expr, ast.Name):
            return self.name_kind(expr.id)
        if isinstance(expr, ast.NamedExpr):
            return self._kind(expr.value)
        if isinstance(expr, ast.Attribute):
            return self._attribute_kind(expr)
        if isinstance(expr, ast.Subscript):
            base = self._kind(expr.value)
            return base if base in (TENSOR, _WEAK_TENSOR, SCALAR, SIZE) else None
        if isinstance(expr, ast.Call):
            return self._call_kind(expr)
        if isinstance(expr, ast.BinOp):
            known = self._arithmetic.get(id(expr))
            if known is not None:
                return known
            if isinstance(expr.op, ast.MatMult):
                kind = TENSOR
            elif self.is_size(expr):
                kind = SIZE
            else:
                kind = _arithmetic_kind([self._kind(expr.left), self._kind(expr.right)])
            if not self._in_progress:   # not resting on a name still being worked out
                self._arithmetic[id(expr)] = kind
            return kind
        if isinstance(expr, ast.UnaryOp):
            return SCALAR if isinstance(expr.op, ast.Not) else self._kind(expr.operand)
        if isinstance(expr, ast.IfExp):
            return _meet([self._kind(expr.body), self._kind(expr.orelse)])
        if isinstance(expr, ast.BoolOp):
            return _meet([self._kind(v) for v in expr.values])
        if isinstance(expr, ast.Compare):
            kinds = [self.kind(v) for v in [expr.left, *expr.comparators]]
            identity = all(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn)) for op in expr.ops)
            return TENSOR if TENSOR in kinds and not identity else SCALAR
        return None

    def _attribute_kind(self, expr: ast.Attribute):
        if expr.attr in SIZE_ATTRS:
            return SIZE
        if expr.attr in METADATA_ATTRS:
            return SCALAR
        base = self._kind(expr.value)
        if expr.attr in VIEW_ATTRS and base in (TENSOR, _WEAK_TENSOR):
            return base
        if base in NUMBERS:
            return SCALAR
        if self._imported_root(expr.value):
            return SCALAR     # torch.float32, math.pi, a module's constant
        return None

    def _imported_root(self, expr: ast.expr) -> bool:
        """The dotted expression starts at an imported name (a module, or an imported object)."""
        while isinstance(expr, ast.Attribute):
            expr = expr.value
        if not isinstance(expr, ast.Name):
            return False
        bindings = self._owner_of(expr.id).bindings.get(expr.id)
        if bindings:
            return all(b[0] == "import" for b in bindings)
        return expr.id in self.module.imports

    def _call_kind(self, call: ast.Call):
        func = call.func
        if isinstance(func, ast.Subscript):
            return None       # a kernel launch returns nothing useful
        qualified = None
        if isinstance(func, ast.Name) or (isinstance(func, ast.Attribute) and self._imported_root(func.value)):
            qualified = self.typer.resolver.qualify(func, self.where)
        if qualified is not None:
            return self._function_kind(qualified, call)
        if isinstance(func, ast.Attribute):
            method = func.attr
            if method in METHODS_RETURNING_SIZES:
                return SIZE
            if method in METHODS_RETURNING_SCALARS:
                return SCALAR
            receiver = self._kind(func.value)
            if receiver == TENSOR:
                return TENSOR     # a method on a tensor: weakly typed receivers (parameters) need a tensor-only method
            if receiver in NUMBERS:
                return SCALAR
            catalog = self.typer.catalog
            if method in TENSOR_ONLY_METHODS or method in VIEW_METHODS - {"split", "select"} or (
                    catalog.method_kind(method) in (ALLOC, COPY) and method not in ("to", "type", "cuda")):
                return TENSOR
        return None

    def _function_kind(self, qualified: str, call: ast.Call):
        if qualified in FUNCTIONS_RETURNING_SIZES:
            return SIZE
        if _matches(qualified, FUNCTIONS_RETURNING_SCALARS, FUNCTION_GLOBS_RETURNING_SCALARS):
            return SCALAR
        if qualified in FUNCTIONS_RETURNING_OBJECTS:
            return OBJECT
        if qualified in PASS_THROUGH_FUNCTIONS:
            return _meet([self._kind(a) for a in call.args]) if call.args else None
        parts = qualified.split(".")
        if parts[0] == "torch" and len(parts) > 1 and parts[1] not in NON_TENSOR_TORCH:
            if parts[-1][:1].isupper() and not parts[-1].endswith(("Tensor", "Parameter")):
                return None   # a class: nn.Linear(...), torch.Generator(...) build no tensor
            kind = self.typer.catalog.function_kind(qualified)
            if kind is None or kind != NEUTRAL or self.typer.catalog.is_view(qualified):
                return TENSOR
        return None

    # -- names ------------------------------------------------------------------------------
    def _owner_of(self, name: str) -> "FunctionKinds":
        kinds = self
        while name not in kinds.bindings and kinds.enclosing is not None:
            kinds = kinds.enclosing
        return kinds

    def name_kind(self, name: str):
        owner = self._owner_of(name)
        if owner is not self:
            return owner.name_kind(name)
        if name in self._name_kinds:
            return self._name_kinds[name]
        if name in self._in_progress:
            return _CYCLE
        self._in_progress.add(name)
        try:
            kinds = [self._binding_kind(name, b) for b in self.bindings.get(name, [])]
        finally:
            self._in_progress.discard(name)
        strong = [k for k in kinds if k not in (_WEAK_TENSOR, _CYCLE)]
        if TENSOR in strong:
            kind = TENSOR
        elif _WEAK_TENSOR in kinds and all(k is None for k in strong):
            kind = _WEAK_TENSOR
        else:
            kind = _meet(strong) if strong else None
        if kind != TENSOR and kind != _WEAK_TENSOR and name in self.sizes:
            kind = SIZE
        self._name_kinds[name] = kind
        return kind

    def _binding_kind(self, name: str, binding: tuple):
        how = binding[0]
        if how == "parameter":
            arg, default = binding[1], binding[2]
            if arg.annotation is not None:
                return _annotation_kind(arg.annotation)
            if isinstance(default, ast.Constant) and default.value is not None:
                return OBJECT if isinstance(default.value, (str, bytes)) else SCALAR
            if name in self.sizes:
                return SIZE
            if name in self.tensor_receivers:
                return TENSOR
            return _WEAK_TENSOR if self.handles_tensors else None
        if how == "value":
            return self._kind(binding[1])
        if how == "annotated":
            kind = _annotation_kind(binding[1])
            return kind if kind is not None else self._kind(binding[2])
        if how == "part":
            whole = self._kind(binding[1])
            return whole if whole in (TENSOR, _WEAK_TENSOR, SCALAR, SIZE) else None
        if how == "item":
            return self._item_kind(binding[1])
        if how == "augmented":
            node = binding[1]   # `n += 1`: arithmetic on the name's other bindings and the value
            if isinstance(node.op, ast.MatMult):
                return TENSOR
            return _arithmetic_kind([_CYCLE, self._kind(node.value)])
        return binding[1] if how == "fixed" else None

    def _item_kind(self, iterable: ast.expr):
        """The kind of what iterating `iterable` yields."""
        if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name) and iterable.func.id == "range":
            return SIZE
        whole = self._kind(iterable)
        return whole if whole in (TENSOR, _WEAK_TENSOR, SCALAR, SIZE) else None

    # -- bindings ---------------------------------------------------------------------------
    def _bind_parameters(self, func) -> None:
        args = func.node.args
        positional = [*args.posonlyargs, *args.args]
        defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
        me = func.self_name
        for arg, default in zip(positional, defaults):
            if arg.arg == me:
                self.bindings.setdefault(arg.arg, []).append(("fixed", OBJECT))
            else:
                self.bindings.setdefault(arg.arg, []).append(("parameter", arg, default))
        for arg, default in zip(args.kwonlyargs, args.kw_defaults):
            self.bindings.setdefault(arg.arg, []).append(("parameter", arg, default))
        for arg in (args.vararg, args.kwarg):
            if arg is not None:
                self.bindings.setdefault(arg.arg, []).append(("fixed", OBJECT))

    def _bind(self, node: ast.AST) -> None:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                self._bind_target(target, ("value", node.value))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            self._add(node.target.id, ("annotated", node.annotation, node.value))
        elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
            self._add(node.target.id, ("augmented", node))
        elif isinstance(node, ast.NamedExpr):
            self._add(node.target.id, ("value", node.value))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            self._bind_loop(node.target, node.iter)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self._add(node.name, ("fixed", OBJECT))
        elif isinstance(node, ast.ExceptHandler) and node.name:
            self._add(node.name, ("fixed", OBJECT))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                self._add((alias.asname or alias.name).split(".")[0], ("import",))
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            self._bind_target(node.optional_vars, ("fixed", None))
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            for name in node.names:
                self._add(name, ("fixed", None))

    def _add(self, name: str, binding: tuple) -> None:
        self.bindings.setdefault(name, []).append(binding)

    def _bind_target(self, target: ast.expr, binding: tuple) -> None:
        if isinstance(target, ast.Name):
            self._add(target.id, binding)
        elif isinstance(target, ast.Starred):
            self._bind_target(target.value, ("fixed", OBJECT))
        elif isinstance(target, (ast.Tuple, ast.List)):
            value = binding[1] if binding[0] == "value" else None
            if (isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts)
                    and not any(isinstance(e, ast.Starred) for e in (*value.elts, *target.elts))):
                for t, v in zip(target.elts, value.elts):
                    self._bind_target(t, ("value", v))
            else:
                for t in target.elts:
                    self._bind_target(t, ("part", value) if value is not None else ("fixed", None))

    def _bind_loop(self, target: ast.expr, iterable: ast.expr) -> None:
        call = iterable if isinstance(iterable, ast.Call) and isinstance(iterable.func, ast.Name) else None
        if (call is not None and call.func.id == "enumerate" and call.args
                and isinstance(target, ast.Tuple) and len(target.elts) == 2):
            self._bind_target(target.elts[0], ("fixed", SIZE))
            self._bind_loop(target.elts[1], call.args[0])
        elif (call is not None and call.func.id == "zip" and isinstance(target, ast.Tuple)
              and len(target.elts) == len(call.args)):
            for t, a in zip(target.elts, call.args):
                self._bind_loop(t, a)
        elif isinstance(target, ast.Name):
            self._add(target.id, ("item", iterable))
        else:
            for name in (n for n in ast.walk(target) if isinstance(n, ast.Name)):
                self._add(name.id, ("fixed", None))

    # -- sizes ------------------------------------------------------------------------------
    def is_size(self, node: ast.AST) -> bool:
        """`node` (an expression) ends up where only an integer can go: see the module's doc."""
        module = self.module
        cur = node
        while True:
            parent = module.parent(cur)
            if isinstance(parent, (ast.BinOp, ast.UnaryOp, ast.Tuple, ast.List, ast.Starred)):
                cur = parent
                continue
            if isinstance(parent, ast.IfExp) and cur is not parent.test:
                cur = parent
                continue
            break
        if isinstance(parent, ast.Slice):
            return True
        if isinstance(parent, ast.keyword):
            call = module.parent(parent)
            return parent.arg in SIZE_KEYWORDS or (isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript))
        if isinstance(parent, ast.Subscript) and cur is parent.slice:
            grand = module.parent(parent)
            return isinstance(grand, ast.Call) and grand.func is parent   # a launch's grid
        if isinstance(parent, ast.Call) and any(a is cur for a in parent.args):
            return self._takes_sizes(parent)
        return False

    def _takes_sizes(self, call: ast.Call) -> bool:
        func = call.func
        if isinstance(func, ast.Subscript):
            return True       # kernel[grid](...): a launch's arithmetic arguments are sizes and strides
        if isinstance(func, ast.Attribute) and not self._imported_root(func.value):
            return func.attr in METHODS_TAKING_SIZES
        qualified = self.typer.resolver.qualify(func, self.where)
        return qualified is not None and _matches(qualified, FUNCTIONS_TAKING_SIZES, FUNCTION_GLOBS_TAKING_SIZES)

    def _size_names(self) -> set[str]:
        """Names used as sizes in this function, directly or through what they are assigned to."""
        sizes = {n.id for n in self.nodes
                 if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and self.is_size(n)}
        assigns = [(t.id, node.value) for node in self.nodes if isinstance(node, ast.Assign)
                   for t in node.targets if isinstance(t, ast.Name)]
        changed = bool(sizes)
        while changed:
            changed = False
            for target, value in assigns:
                if target in sizes:
                    new = _arithmetic_names(value) - sizes
                    if new:
                        sizes |= new
                        changed = True
        return sizes


    def _tensor_receivers(self) -> set[str]:
        """Names used as tensors: read for a tensor's metadata (`x.shape`, `x.size(0)`), given a
        tensor-only method (`x.float()`), or an operand of `@`."""
        names = set()
        for node in self.nodes:
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                parent = self.module.parent(node)
                called = isinstance(parent, ast.Call) and parent.func is node
                if (node.attr in SIZE_ATTRS or node.attr in ("dtype", "device")
                        or (called and (node.attr in TENSOR_ONLY_METHODS
                                        or node.attr in ("size", "numel", "dim", "stride", "item")))):
                    names.add(node.value.id)
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                names |= {o.id for o in (node.left, node.right) if isinstance(o, ast.Name)}
        return names


    def _handles_tensors(self, func) -> bool:
        """The function works on tensors, so an unannotated parameter of it is most likely one:
        it enters a symmetric scope, has a parameter annotated a tensor or read as one, uses `@`,
        calls a torch op or a tensor-only method. Read from the syntax alone (no name kinds: those
        rest on this). `divide(numerator, denominator)` does none of these. A constructor's
        parameters are settings (`dim`, `heads`), whatever the constructor does with them."""
        if func.node.name in CONSTRUCTORS:
            return False
        if id(func.node) in self.typer.scope_functions or self.tensor_receivers:
            return True
        args = func.node.args
        if any(a.annotation is not None and _annotation_kind(a.annotation) == TENSOR
               for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)):
            return True
        for node in self.nodes:
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.MatMult):
                return True
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if self._imported_root(node.func.value):
                    qualified = self.typer.resolver.qualify(node.func, self.where) or ""
                    if qualified.startswith("torch.") and self._function_kind(qualified, node) == TENSOR:
                        return True
                elif node.func.attr in TENSOR_ONLY_METHODS:
                    return True
        return False


def _arithmetic_names(expr: ast.expr) -> set[str]:
    """Names whose values flow, through arithmetic, tuples and conditionals, into `expr`'s value."""
    out, stack = set(), [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.BinOp):
            stack += [node.left, node.right]
        elif isinstance(node, ast.UnaryOp):
            stack.append(node.operand)
        elif isinstance(node, (ast.Tuple, ast.List)):
            stack += node.elts
        elif isinstance(node, ast.Starred):
            stack.append(node.value)
        elif isinstance(node, ast.IfExp):
            stack += [node.body, node.orelse]
    return out


def _arithmetic_kind(kinds: list):
    """The kind of a binary operator's result from its operands' kinds (not `@`, not a size)."""
    if OBJECT in kinds:
        return OBJECT     # string formatting, sequence repetition or concatenation
    return _meet(kinds)


def _meet(kinds: list):
    """One kind for a value that may be any of `kinds` (or is computed from all of them): a
    tensor if any is one; a parameter's default tensor kind stays a default, and gives way to a
    size (`x.size(0) // world`: a parameter met with a size is a count); a size when all are
    numbers and one is a size; a scalar when all are; an object when all are known and none is a
    tensor; else unknown. A name still being worked out (a cycle) adds no evidence."""
    kinds = [k for k in kinds if k != _CYCLE]
    if not kinds:
        return _CYCLE
    if TENSOR in kinds:
        return TENSOR
    if _WEAK_TENSOR in kinds:
        return SIZE if SIZE in kinds else _WEAK_TENSOR
    if all(k in NUMBERS for k in kinds):
        return SIZE if SIZE in kinds else SCALAR
    if all(k in (*NUMBERS, OBJECT) for k in kinds):
        return OBJECT
    return None


def _annotation_kind(annotation: ast.expr):
    """What a parameter annotated so holds: a tensor, a scalar, an object, or unknown."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return None
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        return OBJECT
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _union_kind([annotation.left, annotation.right])
    if isinstance(annotation, ast.Subscript):
        head = _last_name(annotation.value)
        if head in ("Optional", "Union"):
            inner = annotation.slice
            return _union_kind(list(inner.elts) if isinstance(inner, ast.Tuple) else [inner])
        return OBJECT if head not in ("Annotated",) else None
    name = _last_name(annotation)
    if name in TENSOR_ANNOTATIONS:
        return TENSOR
    if name in SIZE_ANNOTATIONS:
        return SIZE
    if name in SCALAR_ANNOTATIONS:
        return SCALAR
    if name in UNKNOWN_ANNOTATIONS or name is None:
        return None
    return OBJECT


def _union_kind(members: list[ast.expr]):
    kinds = [_annotation_kind(m) for m in members
             if not (isinstance(m, ast.Constant) and m.value is None)]
    if TENSOR in kinds:
        return TENSOR
    return _meet(kinds) if kinds else OBJECT


def _last_name(expr: ast.expr) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return None


def _one_line(node: ast.AST, limit: int = 80) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
