"""The SGLang reference case's model package (examples/sglang_mhc) as SGLang loads it: with
SGLANG_EXTERNAL_MODEL_PACKAGE=hazsan_sglang_mhc, SGLang 0.5.23's real registry
(srt/models/registry.py) imports the package and resolves the checkpoint's architecture to the
class written with SGLang's layers. Runs in `make test-sglang` (.venv-sglang: SGLang with its
dependencies); skipped where SGLang's model layers cannot be imported (`make test`'s venv holds the
SGLang wheel without its dependencies)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# found, not imported: transformers imports torchvision, whose CUDA-only build needs cpu_setup's
# schemas (the probe's interpreter has them on its PYTHONPATH)
if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("SGLang with its dependencies not installed: `make test-sglang` runs this in .venv-sglang",
                allow_module_level=True)

PROBE = """
import json
from sglang.srt.models.registry import ModelRegistry
cls, arch = ModelRegistry.resolve_model_cls(["HazsanMHCForCausalLM"])
from hazsan_sglang_mhc import testbed_comm
from sglang.srt.distributed.device_communicators import pynccl_allocator
print(json.dumps({"module": cls.__module__, "name": cls.__name__, "arch": arch,
                  "methods": [m for m in ("forward", "load_weights", "get_input_embeddings") if callable(getattr(cls, m, None))],
                  "defaults_loaded": ModelRegistry._default_models_loaded,
                  "context_routed": pynccl_allocator.SymmetricMemoryContext is testbed_comm.TestbedSymmetricMemoryContext}))
"""


def test_sglang_registry_resolves_the_external_model():
    setup = ROOT / "examples" / "sglang_e2e" / "cpu_setup"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    env.update(PYTHONPATH=os.pathsep.join(map(str, [setup, ROOT / "examples" / "sglang_mhc", ROOT / "examples" / "vllm_mhc"])),
               SGLANG_EXTERNAL_MODEL_PACKAGE="hazsan_sglang_mhc", SGLANG_USE_CPU_ENGINE="1")
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (got["module"], got["name"], got["arch"]) == ("hazsan_sglang_mhc.model", "HazsanMHCForCausalLM",
                                                        "HazsanMHCForCausalLM")
    assert got["methods"] == ["forward", "load_weights", "get_input_embeddings"]
    assert got["defaults_loaded"] is False        # SGLang's external-package path, not its own models
    # importing the package routes nothing: only a TP worker building the model installs the testbed
    assert got["context_routed"] is False
