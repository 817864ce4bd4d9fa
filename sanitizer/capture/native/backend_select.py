"""Collectives dispatched as ops, without a dispatch mode: a kernel at torch's BackendSelect key.

With the native recorder there is no TorchDispatchMode to see the c10d and functional collective
ops (and the registered custom ones, collective_ops.CUSTOM). Each of their overloads gets a Python
kernel at `BackendSelect` that hands the call to capture's own handler (collectives.py: the same
code the mode calls), the op itself run by redispatching to the keys after BackendSelect.

Why BackendSelect (benchmarks/README.md, "Collectives without a dispatch mode", measured on gloo
ranks and in real SGLang): it is in every call's key set (one of torch's default TLS-included keys;
inference mode does not exclude it, where autograd-key kernels never run) and sits just above the
backends, so a kernel there runs for every dispatched call of the op, from Python or from C++
(`dist.all_reduce` reaches `c10d::allreduce_` from ProcessGroup's C++ method), inside a tensor
subclass's own dispatch too. Only the outermost call is handed over, as the mode saw it (a
functional collective runs its c10d op inside its kernel), except inside an op whose kernel issues
the collectives itself (collective_ops.TRANSPARENT), whose inner calls are the program's.

Other ops cost nothing: only the collectives' own overloads get a kernel.
"""
from __future__ import annotations

import threading

import torch

from sanitizer.capture.collective_ops import COLLECTIVE_NAMESPACES, CUSTOM, TRANSPARENT


class Redispatch:
    """Stands for the OpOverload in a handler: calling it runs the op below BackendSelect."""

    __slots__ = ("op", "keys")

    def __init__(self, op, keys):
        self.op = op
        self.keys = keys

    def __call__(self, *args, **kwargs):
        return self.op.redispatch(self.keys, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.op, name)

    def __str__(self):
        return str(self.op)

    # the handlers cache per op (names, argument plans): one entry per op, not per call
    def __hash__(self):
        return hash(self.op)

    def __eq__(self, other):
        return self.op == (other.op if type(other) is Redispatch else other)

    __repr__ = __str__


class BackendSelectKernels:
    def __init__(self, capture, collectives):
        self.capture = capture
        self.collectives = collectives
        self.after = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.BackendSelect)
        self.depth = threading.local()
        self.libs: dict = {}
        self.covered: set = set()     # qualified names of the overloads with a kernel
        self.failed: list = []
        # told of each op given a kernel, with its handler: the recorder's launch observer
        # (level full) launches nothing for a collective
        self.on_covered = None

    def scan(self) -> int:
        """Register a kernel for every collective overload not covered yet (ops registered later,
        a server's custom ones, are picked up by the next scan). Returns how many were added."""
        names = set(CUSTOM) | set(TRANSPARENT) | set(self.collectives.custom)
        added = 0
        for full in torch._C._dispatch_get_all_op_names():
            ns, _, rest = full.partition("::")
            if ns not in COLLECTIVE_NAMESPACES and full.split(".")[0] not in names:
                continue
            name = rest.split(".")[0]
            packet = getattr(getattr(torch.ops, ns), name, None)
            if packet is None:
                continue
            for overload in packet.overloads():
                op = getattr(packet, overload)
                qualified = name if overload == "default" else f"{name}.{overload}"
                label = f"{ns}::{qualified}"
                if label in self.covered:
                    continue
                try:
                    if self.collectives.handler(op) is False:
                        continue           # (looked at again by the next scan: a later table entry)
                    lib = self.libs.get(ns)
                    if lib is None:
                        lib = self.libs[ns] = torch.library.Library(ns, "IMPL")
                    lib.impl(qualified, self._kernel(op), "BackendSelect", with_keyset=True)
                    self.covered.add(label)
                    if self.on_covered is not None:
                        self.on_covered(f"{ns}::{name}.{overload}", self.collectives.handler(op))
                    added += 1
                except Exception as exc:
                    self.failed.append(f"{label}: {exc}")
                    self.capture.failed("native.backend_select", exc)
        return added

    def watch_definitions(self) -> None:
        """Scan again after an op is defined from Python in a collective namespace (or one the
        CUSTOM table names): torch.library.Library.define. Ops a C++ extension registers are
        picked up by the scan at the program's first step (Capture.mark_step)."""
        original = torch.library.Library.define
        if getattr(original, "_hazsan", False):
            return
        kernels = self

        def define(lib, schema, *args, **kwargs):
            out = original(lib, schema, *args, **kwargs)
            try:
                name = str(schema).split("(")[0].split(".")[0].strip()
                ns = getattr(lib, "ns", "")
                if ns in COLLECTIVE_NAMESPACES or f"{ns}::{name}" in CUSTOM \
                        or f"{ns}::{name}" in kernels.collectives.custom:
                    kernels.scan()
            except Exception as exc:
                kernels.capture.failed("native.backend_select", exc)
            return out

        define._hazsan = True
        define.__doc__ = original.__doc__
        torch.library.Library.define = define

    def _kernel(self, op):
        after = self.after
        depth = self.depth
        colls = self.collectives
        transparent = colls._transparent
        custom = colls._custom
        capture = self.capture
        meta = torch._C.DispatchKey.Meta
        is_compiling = torch.compiler.is_compiling

        def kernel(keyset, *args, **kwargs):
            keys = keyset & after
            # inside a collective's own kernel: its work, not the program's call; on meta tensors
            # (torch.compile tracing a graph, a fake implementation calling the real one): no
            # memory and nothing sent, as the dispatch mode steps aside while compiling
            if getattr(depth, "n", 0) or keyset.has(meta) or is_compiling():
                return op.redispatch(keys, *args, **kwargs)
            handler = colls.handler(op)       # (the tables may have changed since registration)
            if handler is False:
                return op.redispatch(keys, *args, **kwargs)
            nested_ok = handler == transparent
            if not nested_ok:
                depth.n = 1
            try:
                table = capture.blocks
                if table is not None:
                    # the frees made before the call first: the handlers look storages up by key
                    # (not a registered op's, which the recorder records in order with its own
                    # records: `_custom` drains before it looks anything up on Python's side)
                    if colls.native is None or handler != custom:
                        table.drain_pending()
                    if table.unowned:
                        colls.poll()
                return handler(Redispatch(op, keys), args, kwargs, None)
            finally:
                if not nested_ok:
                    depth.n = 0
        return kernel
