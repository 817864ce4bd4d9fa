"""hazsan scan, compute written with operators (issue 49, item 8): `(x @ w) * mix` in a window is
compute like `torch.matmul(x, w) * mix`, arithmetic on numbers and shapes is not, and hazsan's own
`sanitizer.symmetric_scope` is a scope by name. Each test writes its source to a temporary tree
(parsed with ast, never imported).
"""
from __future__ import annotations

import json
import textwrap

import pytest

from sanitizer.cli import main
from sanitizer.scan.config import ScanConfig
from sanitizer.scan.scanner import Scanner

SGLANG_IMPORTS = """
import torch
from sglang.srt.distributed.device_communicators.pynccl_allocator import use_symmetric_memory
"""


def write(tmp_path, source: str, name: str = "model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def scan_one(path, function: str):
    result = Scanner(ScanConfig.build()).run([path])
    assert not result.problems
    (scope,) = [s for s in result.scopes if s.function == function]
    return scope


def line_of(path, needle: str) -> int:
    return next(no for no, text in enumerate(path.read_text().splitlines(), 1) if needle in text)


def exit_code(capsys, path) -> int:
    code = main(["scan", str(path)])
    capsys.readouterr()
    return code


def operators(scope) -> list[str]:
    return [r.callee for r in scope.records if r.callee.startswith("operator ")]


# -- tensor arithmetic in a window is compute --------------------------------------------------
@pytest.mark.parametrize("statement, expected", [
    ("out = (x @ w) * mix", ["operator *", "operator @"]),
    ("out = x + y * 3", ["operator +", "operator *"]),
    ("out = -x", ["operator unary -"]),
    ("out = ~mask.bool()", ["operator ~"]),
    ("out = x.float() / y.shape[0]", ["operator /"]),
    ("out = x\n        out = out + y", ["operator +"]),     # a new tensor each time, unlike `+=`
    ("out = torch.softmax(x, -1) ** 2", ["operator **"]),
])
def test_operator_compute_in_use_symmetric_memory_fails(tmp_path, capsys, statement, expected):
    path = write(tmp_path, SGLANG_IMPORTS + f"""
def hc_pre(group, x, w, y, mix, mask):
    with use_symmetric_memory(group):
        {statement}
    return out
""")
    s = scan_one(path, "hc_pre")
    assert s.klass == "compute" and s.failing and not s.unresolved
    assert sorted(operators(s)) == sorted(expected)
    assert all(r.kind == "compute" and r.resolved and "tensor arithmetic" in r.reason
               for r in s.records if r.callee.startswith("operator "))
    assert exit_code(capsys, path) == 1


def test_operator_record_says_why_the_operand_is_a_tensor(tmp_path):
    path = write(tmp_path, SGLANG_IMPORTS + """
def mix_streams(group, comb, x):
    y = torch.einsum("mkj,mjh->mkh", comb, x)
    with use_symmetric_memory(group):
        out = y * 2.0
    return out
""")
    (rec,) = scan_one(path, "mix_streams").records
    assert rec.callee == "operator *" and rec.line == line_of(path, "out = y * 2.0")
    assert rec.reason == ('op: tensor arithmetic `y * 2.0` (operator *; y = torch.einsum('
                          f"'mkj,mjh->mkh', comb, x) (line {line_of(path, 'y = torch.einsum')}))")


def test_operator_in_a_followed_helper_makes_the_scope_compute(tmp_path):
    path = write(tmp_path, SGLANG_IMPORTS + """
def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w


def reduce_input(group, x, w):
    with use_symmetric_memory(group):
        out = project(x, w)
    return out
""")
    s = scan_one(path, "reduce_input")
    assert s.klass == "compute" and s.failing
    (rec,) = s.records
    assert rec.helper.startswith("project (") and [i.callee for i in rec.inner] == ["operator @"]


def test_json_lists_the_operator_as_a_call(tmp_path, capsys):
    path = write(tmp_path, SGLANG_IMPORTS + """
def hc_pre(group, x, w, mix):
    with use_symmetric_memory(group):
        out = (x @ w) * mix
    return out
""")
    assert main(["scan", str(path), "--format", "json"]) == 1
    (scope,) = json.loads(capsys.readouterr().out)["scopes"]
    assert [c["call"] for c in scope["calls"]] == ["operator *", "operator @"]
    line = line_of(path, "out = (x @ w) * mix")
    assert scope["transients"] == [f"operator * (model.py:{line})", f"operator @ (model.py:{line})"]


# -- hazsan's own scope, recognised by name ------------------------------------------------------
@pytest.mark.parametrize("imports, scope_call", [
    ("import sanitizer", "sanitizer.symmetric_scope(group)"),
    ("import sanitizer as hz", "hz.symmetric_scope(group, pool='symm')"),
    ("from sanitizer import symmetric_scope", "symmetric_scope(group)"),
    ("from sanitizer import symmetric_scope as window", "window()"),
    ("from sanitizer import *", "symmetric_scope(group)"),
])
def test_sanitizer_symmetric_scope_is_a_window_by_name(tmp_path, capsys, imports, scope_call):
    path = write(tmp_path, f"""
import torch
{imports}


def hc_pre(group, x, w, mix):
    with {scope_call}:
        out = (x @ w) * mix
    return out
""")
    s = scan_one(path, "hc_pre")
    assert s.scope == "sanitizer.symmetric_scope" and s.symmetric is True and s.window
    assert s.recognised["how"] == "name"
    assert s.klass == "compute" and s.failing and operators(s) == ["operator *", "operator @"]
    assert exit_code(capsys, path) == 1


def test_sanitizer_symmetric_scope_only_allocating_passes(tmp_path, capsys):
    path = write(tmp_path, """
import torch
import sanitizer


def hc_pre(group, x, n):
    with sanitizer.symmetric_scope(group):
        out = torch.empty(n * 2, x.shape[-1], dtype=x.dtype)
    return out
""")
    s = scan_one(path, "hc_pre")
    assert s.window and s.klass == "alloc" and not s.failing
    assert exit_code(capsys, path) == 0


def test_another_projects_symmetric_scope_is_not_hazsans(tmp_path):
    path = write(tmp_path, """
import torch
from mylib.regions import symmetric_scope


def f(group, x, w):
    with symmetric_scope(group):
        out = x @ w
    return out
""")
    assert Scanner(ScanConfig.build()).run([path]).scopes == []


# -- arithmetic that allocates nothing on the device -------------------------------------------
def test_scalar_and_shape_arithmetic_stays_alloc(tmp_path, capsys):
    path = write(tmp_path, SGLANG_IMPORTS + """
import math

BLOCK = 128


def gather_out(group, x, n, world, hidden: int, eps=1e-6):
    size = x.numel()
    with use_symmetric_memory(group):
        rows = x.shape[0] * 4
        half = n * 2
        chunk = size // world
        width = hidden * 2 + len(x.shape) + 1 - x.dim() % 2
        blocks = math.ceil(rows / BLOCK) * BLOCK
        scale = -eps
        label = "rank %d of %d" % (n, world) + f" ({hidden})"
        shape = x.shape[:-1] + (width,)
        parts = [x] * 2
        out = torch.empty(rows, half // world, width, blocks, dtype=x.dtype, device=x.device)
        view = out[: chunk * 2]
    return out, view, label, shape, parts, scale
""")
    s = scan_one(path, "gather_out")
    assert s.klass == "alloc" and not s.failing
    assert [r.callee for r in s.records] == ["torch.empty"]
    assert exit_code(capsys, path) == 0


def test_inplace_augmented_assignment_allocates_nothing(tmp_path, capsys):
    path = write(tmp_path, SGLANG_IMPORTS + """
def accumulate(group, x, y):
    with use_symmetric_memory(group):
        out = torch.empty_like(x)
        out += y
        out *= 2
    return out
""")
    s = scan_one(path, "accumulate")
    assert s.klass == "alloc" and operators(s) == [] and not s.failing
    assert exit_code(capsys, path) == 0


def test_inplace_update_with_a_computed_value_computes(tmp_path):
    path = write(tmp_path, SGLANG_IMPORTS + """
def accumulate(group, x, y, z):
    with use_symmetric_memory(group):
        out = torch.empty_like(x)
        out += y * z
    return out
""")
    s = scan_one(path, "accumulate")
    assert s.klass == "compute" and operators(s) == ["operator *"]


def test_size_argument_arithmetic_is_an_allocation(tmp_path, capsys):
    path = write(tmp_path, SGLANG_IMPORTS + """
def alloc_double(group, x, n):
    with use_symmetric_memory(group):
        out = torch.empty(n * 2, dtype=x.dtype)
        flag = out.new_zeros((n + 1, 4))
    return out, flag
""")
    s = scan_one(path, "alloc_double")
    assert s.klass == "alloc" and [r.callee for r in s.records] == ["torch.empty", "out.new_zeros"]
    assert exit_code(capsys, path) == 0


def test_a_followed_helper_doing_integer_math_stays_alloc(tmp_path):
    # its parameters are no tensors by default: the function handles none (no torch op, no `@`,
    # no tensor annotation, no scope); a helper that does handle tensors computes
    path = write(tmp_path, SGLANG_IMPORTS + """
def divide(numerator, denominator):
    assert numerator % denominator == 0, "{} is not divisible by {}".format(numerator, denominator)
    return numerator // denominator


def gate(x, w):
    return torch.sigmoid(w) * x


def gather_out(group, x, world):
    with use_symmetric_memory(group):
        out = torch.empty(divide(x.shape[0], world), dtype=x.dtype)
    return out


def gated(group, x, w):
    with use_symmetric_memory(group):
        out = gate(x, w)
    return out
""")
    s = scan_one(path, "gather_out")
    assert s.klass == "alloc" and [r.callee for r in s.records] == ["torch.empty"]
    g = scan_one(path, "gated")
    assert g.klass == "compute" and sorted(i.callee for i in g.records[0].inner) == ["operator *", "torch.sigmoid"]


def test_constructor_parameters_are_settings(tmp_path):
    path = write(tmp_path, SGLANG_IMPORTS + """
class Attention:
    def __init__(self, hidden, heads, dim_head):
        self.inner = heads * dim_head
        self.scale = dim_head ** -0.5
        self.out = torch.empty(hidden, dtype=torch.bfloat16)


def build(group, hidden, heads, dim_head):
    with use_symmetric_memory(group):
        layer = Attention(hidden, heads, dim_head)
    return layer
""")
    s = scan_one(path, "build")
    assert s.klass == "alloc" and not s.failing
    assert [i.callee for i in s.records[0].inner] == ["torch.empty"]


@pytest.mark.parametrize("statement", [
    "count = n * 2",                         # n: annotated int
    "count = int(k) + 1",
    "count = k.size(0) // world",
    "count = steps - 1",                     # steps: defaults to a number
    "count = dist.get_world_size() * 2",
    "count = torch.finfo(x.dtype).max * 0.5",
    "count = self.tp_size * 2",              # unknown on both sides: not counted
])
def test_scalar_operands_from_annotations_defaults_and_metadata(tmp_path, statement):
    path = write(tmp_path, SGLANG_IMPORTS + f"""
import torch.distributed as dist


class Layer:
    def forward(self, group, x, k, world, n: int, steps=4):
        with use_symmetric_memory(group):
            {statement}
            out = torch.empty(4, dtype=x.dtype)
        return out, count
""")
    assert operators(scan_one(path, "Layer.forward")) == []
