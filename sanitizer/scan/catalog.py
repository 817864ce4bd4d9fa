"""What a call does to the allocator, by name: the tables the body classifier looks names up in.

A name is either a qualified function (``torch.empty``, resolved through the file's imports) or a
tensor method (written with a leading dot, ``.contiguous``), matched on the attribute name when the
receiver is not a module. Anything not listed counts as compute: unknown code may allocate.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

# Kinds, in increasing order of concern. `neutral` allocates nothing on the device; `kernel` is
# a launch that only writes into tensors passed to it (`kernel[grid](...)`, `out=`): it places
# nothing in the pool, so a region of allocations and such launches is still `alloc`.
NEUTRAL, KERNEL, ALLOC, COPY, COMPUTE = "neutral", "kernel", "alloc", "copy", "compute"
KIND_RANK = {NEUTRAL: 0, KERNEL: 1, ALLOC: 2, COPY: 3, COMPUTE: 4}
# Roots of compiled extensions: what their ops allocate besides their outputs is unknown.
EXTENSION_ROOTS = ("flashinfer", "deep_gemm", "sgl_kernel", "vllm", "tvm_ffi", "cutlass", "aiter",
                   "flash_attn", "mooncake", "nixl", "tilelang", "kernels")
# Keyword arguments that name the tensor an op writes into (no output of its own).
OUT_KEYWORDS = frozenset({"out", "output"})

# Output allocations: one tensor, nothing else (the fill of zeros/ones/full/rand/arange is one
# kernel writing the output; torch.tensor copies host data into it).
DEFAULT_ALLOC = (
    "torch.empty", "torch.zeros", "torch.ones", "torch.full", "torch.empty_strided",
    "torch.empty_like", "torch.zeros_like", "torch.ones_like", "torch.full_like",
    "torch.rand", "torch.randn", "torch.randint", "torch.rand_like", "torch.randn_like",
    "torch.randint_like", "torch.randperm", "torch.arange", "torch.linspace", "torch.eye",
    "torch.tensor", "torch.as_tensor", "torch.from_numpy",
    ".new_empty", ".new_zeros", ".new_ones", ".new_full", ".new_empty_strided", ".new_tensor",
    ".zero_", ".fill_",
)

# One copy or cast (or the view it starts from): what becomes a collective's input.
DEFAULT_COPY = (
    "torch.cat", "torch.concat", "torch.concatenate", "torch.stack", "torch.clone",
    "torch.reshape", "torch.flatten", "torch.nn.functional.pad",
    ".contiguous", ".to", ".clone", ".copy_", ".float", ".half", ".bfloat16", ".double", ".int",
    ".long", ".bool", ".byte", ".type", ".type_as", ".cuda", ".reshape", ".flatten",
)

# Transposes count as copies (they set up the copy that follows) but are views themselves:
# they allocate nothing, and the tensor they return shares its receiver's storage.
DEFAULT_VIEW_COPIES = (
    "torch.transpose", "torch.permute", "torch.movedim", "torch.t", "torch.swapaxes",
    ".transpose", ".t", ".permute", ".movedim", ".swapaxes", ".swapdims", ".mT",
)

# Metadata, views, Python built-ins, logging: no device allocation at all.
DEFAULT_NEUTRAL = (
    "len", "int", "float", "bool", "str", "bytes", "isinstance", "issubclass", "getattr", "hasattr",
    "setattr", "range", "enumerate", "zip", "min", "max", "abs", "tuple", "list", "dict", "set",
    "frozenset", "print", "type", "id", "repr", "divmod", "round", "any", "all", "sorted", "reversed",
    "iter", "next", "super", "callable", "hash", "format", "object", "slice", "vars", "locals",
    "globals", "ord", "chr", "bin", "hex", "pow", "filter", "map", "NotImplementedError",
    "RuntimeError", "ValueError", "AssertionError", "TypeError", "KeyError",
    "contextlib.nullcontext", "nullcontext", "torch.inference_mode", "torch.no_grad",
    "torch.enable_grad", "torch.device", "torch.Size", "torch.dtype", "torch.finfo", "torch.iinfo",
    "torch.is_tensor", "torch.is_grad_enabled", "torch.is_inference_mode_enabled",
    "torch.cuda.current_stream", "torch.cuda.current_device", "torch.cuda.stream",
    "torch.cuda.get_device_capability", "torch.cuda.is_current_stream_capturing",
    "torch.compiler.is_compiling", "torch._dynamo.is_compiling",
    "triton.cdiv", "triton.next_power_of_2", "math.*", "logging.*", "logger.*", "warnings.warn",
    "numpy.*", "os.*", "time.*", "itertools.*", "operator.*", "typing.*", "json.*",
    "torch.get_device_module", "torch.cuda.Event", "torch.cuda.Stream", "torch.cuda.device_count",
    "torch.cuda.is_available", "torch.version.*", "torch.get_default_dtype",
    "functools.partial", "dataclasses.replace", "os.environ.get", "os.getenv",
    "torch.as_strided", "torch.narrow", "torch.squeeze", "torch.unsqueeze", "torch.split",
    "torch.chunk", "torch.unbind", "torch.view_as_real", "torch.view_as_complex", "torch.select",
    ".size", ".stride", ".dim", ".ndimension", ".numel", ".nelement", ".element_size", ".data_ptr",
    ".is_contiguous", ".storage_offset", ".get_device", ".untyped_storage", ".view", ".view_as",
    ".squeeze", ".unsqueeze", ".expand", ".expand_as", ".narrow", ".select", ".unbind", ".split",
    ".chunk", ".as_strided", ".unflatten", ".detach", ".item", ".unsqueeze_", ".squeeze_",
    ".as_strided_", ".resize_as_", ".set_", ".tolist", ".record_stream",
    ".wait_stream", ".append", ".extend", ".pop", ".get", ".items", ".keys", ".values", ".update",
    ".setdefault", ".format", ".join", ".startswith", ".endswith", ".debug", ".info", ".warning",
    ".error", ".exception", ".tag", ".__enter__", ".__exit__", ".bit_length", ".lower", ".upper",
    ".strip", ".replace", ".is_set", ".synchronize", ".record", ".wait", ".query",
)


@dataclass
class CallCatalog:
    """Looks a qualified name or a method name up in the kind tables (globs allowed: ``math.*``)."""

    alloc: tuple[str, ...] = DEFAULT_ALLOC
    copy: tuple[str, ...] = DEFAULT_COPY
    neutral: tuple[str, ...] = DEFAULT_NEUTRAL
    views: tuple[str, ...] = DEFAULT_VIEW_COPIES
    compute: tuple[str, ...] = ()  # forced compute: beats every other table
    _exact: dict[str, str] = field(default_factory=dict, init=False, repr=False)
    _globs: list[tuple[str, str]] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        # Later tables override earlier ones; `compute` entries win (a user forcing a name).
        for kind, names in ((NEUTRAL, self.neutral), (ALLOC, self.alloc), (COPY, self.copy),
                            (COPY, self.views), (COMPUTE, self.compute)):
            for name in names:
                if any(c in name for c in "*?["):
                    self._globs.append((name, kind))
                else:
                    self._exact[name] = kind

    def extended(self, alloc=(), copy=(), neutral=(), compute=()) -> "CallCatalog":
        return CallCatalog(alloc=self.alloc + tuple(alloc), copy=self.copy + tuple(copy),
                           neutral=self.neutral + tuple(neutral), views=self.views,
                           compute=self.compute + tuple(compute))

    def is_view(self, name: str) -> bool:
        """A qualified name or ``.method`` that returns a view (no allocation)."""
        return (name in self.views or name in VIEW_FUNCTIONS
                or (name.startswith(".") and name[1:] in VIEW_METHODS))

    def function_kind(self, qualified: str) -> str | None:
        """Kind of a function reached through a module (or a builtin); None when unlisted."""
        kind = self._exact.get(qualified)
        if kind is None:
            kind = self._glob(qualified)
        return kind

    def method_kind(self, method: str) -> str | None:
        """Kind of ``obj.method(...)`` on an object hazsan cannot type; None when unlisted."""
        kind = self._exact.get("." + method)
        if kind is None:
            kind = self._glob("." + method)
        return kind

    def _glob(self, name: str) -> str | None:
        found = None
        for pattern, kind in self._globs:
            if fnmatch.fnmatchcase(name, pattern):
                found = kind  # last match wins, so `compute` globs override
        return found


# Neutral methods that return a view of (or the same storage as) their receiver.
VIEW_METHODS = frozenset({
    "view", "view_as", "squeeze", "unsqueeze", "expand", "expand_as", "narrow", "select", "unbind",
    "split", "chunk", "as_strided", "unflatten", "detach", "unsqueeze_", "squeeze_", "as_strided_",
})
VIEW_FUNCTIONS = frozenset({
    "torch.as_strided", "torch.narrow", "torch.squeeze", "torch.unsqueeze", "torch.split",
    "torch.chunk", "torch.unbind", "torch.view_as_real", "torch.view_as_complex", "torch.select",
})


def is_inplace_method(name: str) -> bool:
    """``x.add_(...)``: returns its receiver, so the receiver's storage lives on."""
    return name.endswith("_") and not name.endswith("__")
