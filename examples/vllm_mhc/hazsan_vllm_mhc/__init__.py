"""vLLM general plugin (entry point `vllm.general_plugins`): hazsan's reference hazard in vLLM.

vLLM calls `register()` in every process it starts (the front end, the EngineCore, each worker).
It registers the mHC model (`HazsanMHCForCausalLM`, model.py). The model, when vLLM's workers
build it, records each `execute_model` call's schedule (schedule.py) when HAZSAN_MHC_OUT names a
folder, and routes vLLM's TP all-reduce and all-gather over hazsan's symmetric-memory testbed when it
is built (testbed_comm.py), as HAZSAN_MHC_VARIANT asks:

    HAZSAN_MHC_VARIANT=stock   the mHC combine computes inside the symmetric scope (the fault)
    HAZSAN_MHC_VARIANT=fixed   it computes outside and only allocates its output inside
    HAZSAN_MHC_VARIANT=bare    no testbed: vLLM's own CPU communicator (the reference tokens)
"""
from __future__ import annotations

ARCH = "HazsanMHCForCausalLM"


def register() -> None:
    # Called more than once per process by some vLLM versions: both steps are idempotent.
    from vllm import ModelRegistry
    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, "hazsan_vllm_mhc.model:MHCForCausalLM")
