"""The GPU self-check can only run on a GPU; here: its programs compile, and without CUDA it says so
(exit 2) instead of failing half-way."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from sanitizer.capture import gpu_selfcheck as sc  # noqa: E402


def _undefined_names(source: str, name: str) -> str:
    """pyflakes' undefined names in a program (what would fail only when it runs on a GPU); an
    unused import is the program's business (the scenarios import what the prelude may need)."""
    import io

    api = pytest.importorskip("pyflakes.api")
    from pyflakes.reporter import Reporter
    out, err = io.StringIO(), io.StringIO()
    api.check(source, name, Reporter(out, err))
    return "".join(line for line in (out.getvalue() + err.getvalue()).splitlines(True)
                   if "imported but unused" not in line)


@pytest.mark.parametrize("name", sorted(sc.SCENARIOS))
def test_scenario_programs_and_their_expectations_are_sound(name):
    """What can be known of a GPU scenario without a GPU: its program has no undefined name, and
    its expectation is one the harness can judge (real rule names, real event kinds, clean or a
    rule, never both)."""
    from sanitizer.rules.findings import RULES
    from sanitizer.trace.schema import EVENT_FIELDS

    body, expect = sc.SCENARIOS[name]
    source = sc.PRELUDE + textwrap.dedent(body)
    compile(source, name, "exec")
    assert _undefined_names(source, name) == ""
    assert set(expect) <= {"clean", "any_of", "events", "replays", "recycled", "stream_ids", "graph_pool"}, expect
    assert bool(expect.get("clean")) != bool(expect.get("any_of")), "clean, or flagged with a rule"
    assert set(expect.get("any_of", ())) <= set(RULES), expect
    assert set(expect.get("events", ())) <= set(EVENT_FIELDS), expect


def test_decode_program_compiles_with_every_name_defined():
    compile(sc.DECODE_STEP, "decode", "exec")
    assert _undefined_names(sc.DECODE_STEP, "decode") == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the real check applies")
def test_without_cuda_it_exits_2():
    out = subprocess.run([sys.executable, "-m", "sanitizer.capture.gpu_selfcheck"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "no CUDA device" in out.stderr


def test_harness_runs_a_scenario_and_judges_it(tmp_path, monkeypatch):
    """The harness (child under capture at level full, hazsan check, expectations) on a CPU
    scenario of the same shape: gloo instead of NCCL."""
    cpu_prelude = sc.PRELUDE.split("import torch, torch.distributed")[0] + textwrap.dedent('''
        import torch, torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://" + os.environ["SELFCHECK_STORE"],
                                rank=0, world_size=1)
    ''')
    monkeypatch.setattr(sc, "PRELUDE", cpu_prelude)
    early = ('''
        x = torch.ones(1024)
        work = dist.all_reduce(x, async_op=True)
        y = x * 2
        work.wait()
    ''')
    monkeypatch.setattr(sc, "SCENARIOS", {
        "flagged": (early, {"any_of": {"unordered-access"}}),
        "wrongly-expected-clean": (early, {"clean": True, "events": {"coll", "graph_begin"}}),
    })
    ok = sc.scenario("flagged", str(tmp_path))
    assert ok["ok"] and ok["rules"] == ["unordered-access"], ok
    bad = sc.scenario("wrongly-expected-clean", str(tmp_path))
    assert not bad["ok"]
    assert "expected clean" in bad["why"] and "graph_begin" in bad["why"]


# Every file on the GPU path: none of them can run here, so an undefined name (item 1 of issue 29:
# gpu_selfcheck_nccl printed a `path` it never defined) would only show on the GPU.
GPU_FILES = ["sanitizer/capture/gpu_selfcheck.py", "sanitizer/capture/gpu_selfcheck_nccl.py",
             "sanitizer/capture/gpu_kit.py", "sanitizer/capture/nccl.py",
             "sanitizer/capture/allocator_history.py", "sanitizer/capture/cuda_hooks.py",
             "sanitizer/capture/cuda_state.py", "sanitizer/capture/window.py",
             "sanitizer/capture/facts.py", "sanitizer/place/allocator.py", "sanitizer/place/gpu_check.py",
             "sanitizer/testbed/cuda.py", "examples/mhc_decode/gpu_check.py"]


def test_gpu_files_are_pyflakes_clean():
    from pathlib import Path

    api = pytest.importorskip("pyflakes.api")
    from pyflakes.reporter import Reporter
    import io

    root = Path(__file__).resolve().parents[2]
    out, err = io.StringIO(), io.StringIO()
    n = sum(api.checkPath(str(root / f), Reporter(out, err)) for f in GPU_FILES)
    assert n == 0, out.getvalue() + err.getvalue()


def test_pynccl_wrapper_imports_without_the_server_and_is_hooked(tmp_path):
    """C6 on a GPU image that lacks SGLang's server dependencies (0.5.23's package __init__ files
    import IPython, pydantic, starlette, pyzmq, triton...; here triton is missing): the real
    pynccl_wrapper.py is imported with its parent packages left empty, and capture's post-import
    hook patches its NCCLLibrary as in a server."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        if version("sglang") != "0.5.23":
            pytest.skip("SGLang 0.5.23 is installed by `make test`")
    except PackageNotFoundError:
        pytest.skip("SGLang 0.5.23 is installed by `make test`")
    import json
    import os
    code = textwrap.dedent("""
        import json, os, sys
        __import__("sanitizer.capture.bootstrap").capture.bootstrap.activate()
        import torch
        from sanitizer.capture.gpu_selfcheck_nccl import import_wrapper
        mod, how = import_wrapper("sglang.srt.distributed.device_communicators.pynccl_wrapper")
        from sanitizer.capture import runtime
        print(json.dumps({"how": how, "file": mod.__file__,
                          "hooked": bool(getattr(mod.NCCLLibrary.ncclAllReduce, "_hazsan", False)),
                          "installed": runtime.active().installed}))
    """)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(tmp_path / "t"))
    env.pop("PYTHONPATH", None)                 # no tests/ stub of triton on the path
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["how"].startswith("file alone") and "triton" in r["how"], r
    assert r["file"].endswith("sglang/srt/distributed/device_communicators/pynccl_wrapper.py")
    assert r["hooked"] and "sglang.NCCLLibrary" in r["installed"]
