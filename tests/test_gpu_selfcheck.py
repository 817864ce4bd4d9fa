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
