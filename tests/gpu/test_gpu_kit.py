"""The GPU kit (sanitizer/capture/gpu_kit.py, `make gpu-kit`) on a machine without a GPU.

A reduced kit (run.sh and examples/, no wheels: `make test` downloads nothing) is built, then
`run.sh --dry-run` must skip every check (C0-C12, the C4 probe C4P) with its reason, compile every child program, and
exit 0; the real runner, on this CPU machine, must report C0 failed for want of a GPU through the
same subprocess path the GPU machine takes. The checks themselves only run on a GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from sanitizer.capture import gpu_kit  # noqa: E402

IDS = [f"C{i}" for i in range(13)] + ["C4P"]


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    d = tmp_path_factory.mktemp("kit") / "gpu-kit"
    subprocess.run([sys.executable, "-m", "sanitizer.capture.gpu_kit", "build", "--out", str(d), "--no-wheels"],
                   check=True, timeout=120)
    return d


def test_kit_layout(kit):
    assert os.access(kit / "run.sh", os.X_OK)
    assert (kit / "examples" / "mhc_decode" / "gpu_check.py").is_file()
    assert (kit / "wheels").is_dir()


def test_dry_run_skips_every_check_with_its_reason(kit, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    p = subprocess.run(["bash", str(kit / "run.sh"), "--dry-run"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["dry_run"] is True and report["timeout_s"] == 480
    assert [c["id"] for c in report["checks"]] == IDS
    for c in report["checks"]:
        assert c["status"] == "skip" and c["reason"].startswith("dry run: not run here (needs "), c
        assert c["name"] and "figures" in c
    compiled = {c["id"]: c["figures"]["compiled"] for c in report["checks"]}
    assert compiled["C2"] == list(gpu_kit.C2_SCENARIOS) and compiled["C3"] == list(gpu_kit.C3_SCENARIOS)
    assert compiled["C1"] == ["quiet"] and compiled["C6"] == ["pynccl"]
    assert compiled["C10"] == ["shared-pool"] and compiled["C11"] == ["symmetric"] and compiled["C12"] == ["alias"]
    from sanitizer.capture import gpu_selfcheck_history
    assert compiled["C4P"] == list(gpu_selfcheck_history.VARIANTS) + ["snapshot-api"]
    reasons = {c["id"]: c["reason"] for c in report["checks"]}
    assert "SGLang 0.5.23" in reasons["C11"] and "nvcc" in reasons["C11"]
    assert "NCCL" in reasons["C10"] and "NCCL" in reasons["C12"] and "allocator history" in reasons["C4P"]
    assert report["summary"] == {"pass": 0, "fail": 0, "skip": len(IDS)}
    assert "C9 overhead per decode step: skip" in (out / "run.log").read_text()
    # what comes back through the device tool: at most 8 flat files
    assert sorted(f.name for f in out.iterdir()) == ["gpu-check.json", "run.log"]


def test_dry_run_fails_on_a_program_that_does_not_compile(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_kit, "QUIET_PROGRAM", "import torch\nif True print(1)\n")
    report = gpu_kit.run(tmp_path, 480, dry=True, only={"C1"})
    (c1,) = report["checks"]
    assert c1["status"] == "fail" and "does not compile" in c1["reason"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU is present: C0 would pass")
def test_real_run_without_a_gpu_fails_preflight(tmp_path):
    """The runner's own path (a check in its own interpreter, its result line parsed), on CPU."""
    p = subprocess.run([sys.executable, "-m", "sanitizer.capture.gpu_kit", "run", "--out", str(tmp_path),
                        "--only", "C0"], capture_output=True, text=True, timeout=180)
    assert p.returncode == 1, p.stdout + p.stderr
    (c0,) = json.loads((tmp_path / "gpu-check.json").read_text())["checks"]
    assert c0["status"] == "fail" and "no CUDA device" in c0["reason"]
    assert c0["figures"]["torch"] and c0["figures"]["msgspec"] and c0["seconds"] >= 0


def test_overall_time_limit_skips_what_is_left(tmp_path):
    report = gpu_kit.run(tmp_path, 0, dry=False)
    assert {c["status"] for c in report["checks"]} == {"skip"}
    assert all("overall time limit" in c["reason"] for c in report["checks"])
