"""Which pools are symmetric windows: the evidence that a `use_mem_pool(POOL)` scope is in one.

The algorithm, in one place. A pool expression names its pool by a *getter* (a call:
`get_nccl_mem_pool()`, `symm_mem.get_mem_pool(device)`, also through a variable or a `self.attr`
assigned from one) or by a *name* (the last identifier: `self.win_pool` -> `win_pool`). The pool
is a symmetric window when

1. its getter is a known symmetric pool (KNOWN_SYMMETRIC_POOLS: torch's symmetric-memory pool,
   SGLang's and vLLM's NCCL allocator modules), or
2. the tree registers it as a window:
   - `register_mem_pool(NAME, ...)` anywhere in the tree (torch's ProcessGroupNCCL API), or
   - a function of the tree that calls a *window registrar* also calls the pool's getter (vLLM's
     `nccl_symm_mem_context.__exit__`: `get_nccl_mem_pool().snapshot()`, then
     `register_comm_window_raw(segment...)`). A window registrar is a function of the tree that
     calls `ncclCommWindowRegister`, or one whose name says it registers (`regist` in it) that
     calls a registrar, to REGISTRAR_DEPTH levels; calls are matched by the callee's last name.

Every other pool is private: a pool the tree never registers stays private, whatever its name.
Each verdict keeps its evidence (the chain), which the report prints.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

from sanitizer.scan.resolve import Resolver, Where, own_nodes

# Getters (qualified names) whose pool is symmetric by construction.
KNOWN_SYMMETRIC_POOLS = {
    "torch.distributed._symmetric_memory.get_mem_pool": "torch's symmetric-memory pool",
    "sglang.srt.distributed.device_communicators.pynccl_allocator.get_nccl_mem_pool":
        "SGLang's NCCL window allocator module",
    "vllm.distributed.device_communicators.pynccl_allocator.get_nccl_mem_pool":
        "vLLM's NCCL window allocator module",
}
# A pool made on the spot is named by where it is stored, not by its constructor.
POOL_CONSTRUCTORS = ("torch.cuda.MemPool", "torch.cuda.memory.MemPool", "MemPool")
WINDOW_REGISTER = "ncclCommWindowRegister"
REGISTRAR_DEPTH = 3


@dataclass
class PoolVerdict:
    text: str | None            # the pool expression as written
    symmetric: bool
    evidence: list[str] = field(default_factory=list)   # why it is a window (empty: private)


@dataclass
class _Registrar:
    name: str
    chain: str                  # "register_comm_window_raw (pynccl.py:578) -> ncclCommWindowRegister"


class WindowPools:
    """The tree's registration evidence, gathered once per scan."""

    def __init__(self, tree, resolver: Resolver):
        self.resolver = resolver
        self.by_name: dict[str, str] = {}        # register_mem_pool(NAME): NAME -> "the call (file:line)"
        self.getters: dict[object, str] = {}     # getter key -> the chain registering it
        # Only files that mention a registration are parsed: one cheap text pass, then the
        # files naming each new registrar.
        self._tree = tree
        self._candidates = [sf for sf in tree.files if b"egist" in tree.read_bytes(sf)]
        self._register_mem_pool(self._files_naming([b"register_mem_pool("]))
        self._window_registrations()

    def _files_naming(self, tokens: list[bytes]):
        for sf in self._candidates:
            data = self._tree.read_bytes(sf)
            if any(t in data for t in tokens):
                module = self._tree.parse(sf)
                if module is not None:
                    yield module

    # -- gathering ----------------------------------------------------------------------------
    def _register_mem_pool(self, modules) -> None:
        for module in modules:
            for node in ast.walk(module.tree):
                if isinstance(node, ast.Call) and node.args and _last_name(node.func) == "register_mem_pool":
                    name = _last_name(node.args[0])
                    if name and name not in self.by_name:
                        call = "register_mem_pool(" + ", ".join(_one_line(a) for a in node.args) + "".join(
                            f", {k.arg}={_one_line(k.value)}" for k in node.keywords if k.arg) + ")"
                        self.by_name[name] = f"{call} ({module.rel}:{node.lineno})"

    def _window_registrations(self) -> None:
        registrars = {WINDOW_REGISTER: _Registrar(WINDOW_REGISTER, WINDOW_REGISTER)}
        seen: dict[int, tuple] = {}              # id(function node) -> (Func, its calls)
        new = [WINDOW_REGISTER]
        for level in range(REGISTRAR_DEPTH + 1):
            for module in self._files_naming([n.encode() for n in new]):
                for f in self.resolver.module_functions(module):
                    if id(f.node) not in seen:
                        seen[id(f.node)] = (f, [n for n in own_nodes(f.node.body) if isinstance(n, ast.Call)])
            new = []
            if level == REGISTRAR_DEPTH:
                break
            for f, calls in seen.values():
                name = f.node.name
                if name in registrars or "regist" not in name.lower():
                    continue
                hit = _first_call_to(calls, registrars)
                if hit is not None:
                    chain = f"{f.qualname} ({f.where}) -> {registrars[hit].chain}"
                    registrars[name] = _Registrar(name, chain)
                    new.append(name)
            if not new:
                break
        for f, calls in seen.values():   # a function calling a registrar registers the pools it fetches
            hit = _first_call_to(calls, registrars)
            if hit is None:
                continue
            where = Where(f.module, f)
            for call in calls:
                key = self._getter_key(call, where)
                if key is not None and key not in self.getters:
                    self.getters[key] = (f"registered as a window by {f.qualname} ({f.where}), "
                                         f"which calls {registrars[hit].chain}")

    # -- verdicts -----------------------------------------------------------------------------
    def verdict(self, arg: ast.expr | None, where: Where, bindings) -> PoolVerdict:
        """`bindings(expr, where)`: the values a variable or self attribute was assigned."""
        if arg is None:
            return PoolVerdict(None, False)
        text = _one_line(arg)
        values = [(arg, where)] + list(bindings(arg, where))
        for value, at in values:
            if isinstance(value, ast.Call):
                key = self._getter_key(value, at)
                if key is not None and key in self.getters:
                    return PoolVerdict(text, True, [f"pool {_one_line(value)} {self.getters[key]}"])
                qualified = self.resolver.qualify(value.func, at) or ""
                known = KNOWN_SYMMETRIC_POOLS.get(qualified)
                if known:
                    return PoolVerdict(text, True, [f"pool {_one_line(value)}: {qualified}, {known}"])
            name = _last_name(value)
            if name and name in self.by_name:
                return PoolVerdict(text, True, [f"pool {name} registered by {self.by_name[name]}"])
        return PoolVerdict(text, False)

    def _getter_key(self, call: ast.Call, where: Where):
        """The identity of the pool a getter call hands out: the tree function it resolves to,
        else its qualified name; None for a pool constructor or an uncallable expression."""
        if not isinstance(call.func, (ast.Name, ast.Attribute)):
            return None
        qualified = self.resolver.qualify(call.func, where)
        if not qualified or qualified.endswith(POOL_CONSTRUCTORS):
            return None
        target = self.resolver.resolve_call(call, where)
        if target.funcs:
            return ("func", id(target.funcs[0].node))
        if target.is_class is not None:
            return None
        return ("name", qualified)


def _first_call_to(calls, registrars) -> str | None:
    for call in calls:
        name = _last_name(call.func)
        if name in registrars:
            return name
    return None


def _last_name(expr: ast.AST) -> str | None:
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        return expr.attr
    return None


def _one_line(node: ast.AST, limit: int = 120) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."

