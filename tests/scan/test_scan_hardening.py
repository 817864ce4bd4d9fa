"""hazsan scan on hostile input (issue 14): symlink loops, directory symlinks to '.', many scopes
in one file, and a bounded fuzz of generated Python. Every run ends in exit 0/1/2, one line per
error on stderr, never a traceback; time grows linearly."""
from __future__ import annotations

import contextlib
import io
import os
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sanitizer.cli import main


def run_scan(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(["scan", *argv])
        except SystemExit as exc:   # argparse
            code = exc.code
    return code, out.getvalue(), err.getvalue()


def assert_clean(code, err):
    assert code in (0, 1, 2), code
    assert "Traceback" not in err
    for line in err.splitlines():
        assert line.startswith("hazsan scan:"), line
    assert "internal error" not in err, err


needs_symlinks = pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symlinks")


@needs_symlinks
def test_symlink_to_itself_is_a_one_line_problem(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "loop.py").symlink_to("loop.py")
    (tmp_path / "loopdir").symlink_to("loopdir")
    code, out, err = run_scan(str(tmp_path))
    assert_clean(code, err)
    assert code == 0 and "loop.py" in err and "symbolic links" in err


@needs_symlinks
def test_root_that_is_a_symlink_loop_is_exit_2(tmp_path):
    (tmp_path / "root").symlink_to("root")
    code, out, err = run_scan(str(tmp_path / "root"))
    assert code == 2 and out == "" and err.count("\n") == 1


@needs_symlinks
def test_directory_symlinks_to_dot_are_walked_once(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text("from x import use_symmetric_memory\nimport torch\n\ndef f(g, x):\n"
                              "    with use_symmetric_memory(g):\n        y = torch.einsum('i->i', x)\n"
                              "    return y\n")
    for name in ("l1", "l2", "l3"):
        (pkg / name).symlink_to(".")
    (pkg / "up").symlink_to("..")
    start = time.perf_counter()
    code, out, err = run_scan(str(pkg), "--format", "json")
    assert time.perf_counter() - start < 10
    assert_clean(code, err)
    import json
    doc = json.loads(out)
    assert doc["summary"]["files"] == 1 and len(doc["scopes"]) == 1


def _many_scopes(root: Path, n: int) -> Path:
    d = root / f"n{n}"
    d.mkdir()
    lines = ["import torch", "from x import use_symmetric_memory", "", "def f(g, x):"]
    for i in range(n):
        lines += ["    with use_symmetric_memory(g):", f"        y{i} = torch.einsum('i,i->i', x, x)"]
    lines.append("    return x")
    (d / "m.py").write_text("\n".join(lines) + "\n")
    return d


def test_cost_is_linear_in_scopes_per_file(tmp_path):
    small, large = _many_scopes(tmp_path, 200), _many_scopes(tmp_path, 800)

    def best(path):
        times = []
        for _ in range(2):
            start = time.perf_counter()
            code, _, err = run_scan(str(path), "--format", "json")
            times.append(time.perf_counter() - start)
            assert code == 1 and "Traceback" not in err
        return min(times)

    t_small, t_large = best(small), best(large)
    # 4x the scopes: linear is ~4x; the quadratic cost this replaces was ~16x
    assert t_large < 8 * t_small + 0.5, (t_small, t_large)


# -- fuzz ----------------------------------------------------------------------------------------
NAMES = ["f", "g", "helper", "combine", "C", "self.m", "use_symmetric_memory", "is_sm120", "_is_hip"]
EXPRS = ["torch.empty(4)", "torch.einsum('i->i', x)", "x.float()", "helper(x)", "combine(x, y)",
         "k[(1,)](x, y)", "sgl_kernel.op(x)", "torch.add(x, x, out=y)", "x if c else y", "y",
         "self.m(x)", "C()", "lambda: x", "[torch.empty(1) for _ in x]", "(yield x)", "not _is_hip",
         "torch.cuda.get_device_capability()[0] >= 9", "is_sm120() and flag", "*x", "x.y.z()"]
HEADERS = ["with use_symmetric_memory(g):", "with use_symmetric_memory(g, disabled=not ok):",
           "with torch.cuda.use_mem_pool(pool):", "with torch.cuda.use_mem_pool(self.win):",
           "if is_sm120():", "if not _is_hip:", "while flag:", "for i in x:", "try:",
           "with ExitStack() as stack:", "with (use_symmetric_memory(g) if c else nullcontext()):",
           "def f(g, x):", "def helper(x):", "def combine(x, y):", "class C:", "async def a(g):",
           "@contextmanager\ndef scope():", "if x:\n{i}    pass\n{i}elif y:"]
SIMPLE = ["y = {e}", "return {e}", "{e}", "stack.enter_context(use_symmetric_memory(g))",
          "import torch", "from .x import *", "from x import use_symmetric_memory as usm",
          "backend.register_mem_pool(self.win)", "yield", "del y", "pass", "raise ValueError()",
          "global y", "x = y = {e}", "self.win = torch.cuda.MemPool()", "ctx = use_symmetric_memory(g)",
          "with ctx:\n{i}    pass"]


@st.composite
def block(draw, depth=0):
    lines = []
    for _ in range(draw(st.integers(1, 4))):
        indent = "    " * depth
        if depth < 4 and draw(st.booleans()):
            header = draw(st.sampled_from(HEADERS)).replace("{i}", indent)
            lines.append(indent + header.replace("\n", "\n" + indent) if "\n" in header and "{i}" not in header
                         else indent + header)
            lines += draw(block(depth + 1))
            if header == "try:":
                lines.append(indent + "except Exception:")
                lines.append(indent + "    pass")
        else:
            stmt = draw(st.sampled_from(SIMPLE)).replace("{e}", draw(st.sampled_from(EXPRS)))
            lines.append(indent + stmt.replace("{i}", indent))
    return lines


@st.composite
def source(draw):
    text = "\n".join(draw(block())) + "\n"
    if draw(st.integers(0, 9)) == 0:   # sometimes break it
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.sampled_from(["(", "\x00", "\ufeff", ":", "\t", "é"])) + text[cut:]
    return text


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=st.lists(source(), min_size=1, max_size=3),
       options=st.sampled_from([[], ["--when", "sm120"], ["--format", "json"], ["--format", "markdown"],
                                ["--when", "hip", "--depth", "1"], ["--caller-depth", "0"]]),
       links=st.booleans())
def test_fuzz_generated_python_never_crashes(files, options, links):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "pkg"
        root.mkdir()
        (root / "__init__.py").write_text("")
        for i, text in enumerate(files):
            (root / f"m{i}.py").write_bytes(text.encode("utf-8", "surrogatepass"))
        if links and hasattr(os, "symlink"):
            (root / "again").symlink_to(".")
            (root / "self.py").symlink_to("self.py")
        code, out, err = run_scan(str(root), *options)
        assert_clean(code, err)
        assert code in (0, 1)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_fifo_named_py_is_never_read(tmp_path):
    os.mkfifo(tmp_path / "pipe.py")     # reading it would block forever
    (tmp_path / "ok.py").write_text("x = 1\n")
    code, out, err = run_scan(str(tmp_path), "--format", "json")
    assert_clean(code, err)
    assert code == 0
    code, out, err = run_scan(str(tmp_path / "pipe.py"))
    assert code == 2 and out == "" and err.count("\n") == 1
