"""The GPU self-check can only run on a GPU; here: its programs compile, and without CUDA it says so
(exit 2) instead of failing half-way."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from sanitizer.capture import gpu_selfcheck as sc  # noqa: E402


@pytest.mark.parametrize("name", sorted(sc.SCENARIOS))
def test_scenario_programs_compile(name):
    body, expect = sc.SCENARIOS[name]
    compile(sc.PRELUDE + textwrap.dedent(body), name, "exec")
    assert expect.get("clean") or expect.get("any_of")


def test_decode_program_compiles():
    compile(sc.DECODE_STEP, "decode", "exec")


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
