"""hazsan scan on the real SGLang 0.5.23 source (issue 13's acceptance check).

Needs SGLang 0.5.23's files, never imported: `pip install --no-deps sglang==0.5.23` (the test
environment's), or HAZSAN_SGLANG_SRC=/path/to/sglang (the package folder of an unpacked wheel).
Skipped, with the reason, when neither is there. Scans the layers, the DeepSeek-V4 model and the
kernels (about 3 s), not the whole 4,700-file tree (`make scan-report` does that).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

import pytest

from sanitizer.scan.config import ScanConfig
from sanitizer.scan.scanner import Scanner

VERSION = "0.5.23"


def sglang_source() -> Path:
    env = os.environ.get("HAZSAN_SGLANG_SRC")
    if env:
        root = Path(env)
        if not (root / "srt" / "layers" / "linear.py").is_file():
            pytest.skip(f"HAZSAN_SGLANG_SRC={env} holds no srt/layers/linear.py")
        return root
    try:
        spec = importlib.util.find_spec("sglang")   # locates the package; runs none of it
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SGLang is not installed (pip install --no-deps sglang==0.5.23) and "
                    "HAZSAN_SGLANG_SRC is unset")
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    if version != VERSION:
        pytest.skip(f"SGLang {version} is installed; these checks read {VERSION}'s code")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def scopes():
    root = sglang_source()
    roots = [root / "srt" / "layers", root / "srt" / "models" / "deepseek_v4.py", root / "kernels" / "ops"]
    result = Scanner(ScanConfig.build()).run(roots)
    assert not [p for p in result.problems if "internal error" in p.message]
    return result.scopes


def by_function(scopes, qualname):
    hits = [s for s in scopes if s.function == qualname]
    assert hits, f"no scope in {qualname}"
    return hits


def test_fixed_hc_pre_does_not_fail(scopes):
    # 0.5.23's fix: mhc_combine allocates its output and launches a Triton kernel into it
    (s,) = [s for s in by_function(scopes, "DeepseekV4DecoderLayerBase.hc_pre")
            if s.file == "deepseek_v4.py"]
    assert s.klass == "alloc" and not s.failing
    assert [k.callee.split("[")[0] for k in s.kernels] == ["_mhc_combine_kernel"]


@pytest.mark.parametrize("qualname", [
    "RowParallelLinear.forward",             # the GEMM writing the all-reduce input
    "TopK.forward_cuda",                     # routing inside the window
    "FusedMoE.forward_impl",                 # the MoE combine
    "VocabParallelEmbedding._embed_local_shard",
])
def test_compute_scopes_still_fail(scopes, qualname):
    assert any(s.failing and s.klass == "compute" for s in by_function(scopes, qualname))


def test_topk_computes_for_a_known_reason(scopes):
    (s,) = by_function(scopes, "TopK.forward_cuda")
    assert not s.unresolved, "torch fallbacks leave transients: known, not a guess"


def test_triton_embedding_path_is_alloc_others_fail(scopes):
    shard = by_function(scopes, "VocabParallelEmbedding._embed_local_shard")
    assert sorted(s.klass for s in shard) == ["alloc", "compute", "compute"]
    (triton_path,) = [s for s in shard if s.klass == "alloc"]
    assert [c.text for p in triton_path.paths for c in p.conditions][:2] == [
        "unless self.tp_size == 1", "when self._use_triton_embedding(input_)"]
