"""SGLang external model package (SGLANG_EXTERNAL_MODEL_PACKAGE=hazsan_sglang_mhc): hazsan's
reference hazard inside SGLang's decode.

SGLang 0.5.23 (srt/models/registry.py) imports every module of the package named in that variable
and registers each module's `EntryClass` under its class name; model.py's is
`HazsanMHCForCausalLM`, the architecture the checkpoint's config.json names. When SGLang's TP
workers build it, the model routes SGLang's symmetric-memory scope and TP all-reduce over hazsan's
testbed (testbed_comm.py) and records each scheduler step's requests (schedule.py), as
HAZSAN_MHC_VARIANT asks:

    HAZSAN_MHC_VARIANT=stock   the mHC combine computes inside the symmetric scope (the fault)
    HAZSAN_MHC_VARIANT=fixed   it computes outside and only allocates its output inside
    HAZSAN_MHC_VARIANT=bare    no testbed: SGLang's own gloo all-reduce (the reference tokens)
"""
