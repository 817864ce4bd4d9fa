"""Spies on torch.cuda's device queries, for tests/capture/test_capture_cuda_state.py.

Imported by a test program *before* torch: it registers a post-import hook on `torch.cuda`, which
finishes loading inside `import torch`, before capture's own hook on `torch` runs. From then on
every call of a torch.cuda function that initialises CUDA (or asks the CUDA runtime about a
device), and of the torch._C functions under them, is appended at once to the file $SPY_OUT (one
JSON line with the call stack), so that calls made at exit (capture's close) are seen too.

Environment:
  SPY_OUT               the record file (required)
  SPY_FAKE_BUILD=1      make this CPU build of torch look built with CUDA, on a machine with one
                        GPU: torch._C gets the C functions (spies), and the torch.cuda spies answer
                        as a GPU machine would instead of calling the CPU build's originals
  SPY_FAKE_INITIALIZED=1  torch.cuda.is_initialized() answers True (current device 3 of 4)
  SPY_FAKE_PYNVML=1     a fake `pynvml` module in sys.modules (two H200s), its calls recorded
"""
import json
import os
import sys
import traceback
import types

OUT = os.environ["SPY_OUT"]
FAKE_BUILD = os.environ.get("SPY_FAKE_BUILD") == "1"
FAKE_INIT = os.environ.get("SPY_FAKE_INITIALIZED") == "1"


def note(kind, **kw):
    with open(OUT, "a") as f:
        f.write(json.dumps({"kind": kind, **kw}, default=str) + "\n")


# torch.cuda's functions that initialise CUDA or ask the runtime, with a faked build's answers
QUERIES = {"is_available": True, "current_device": 3 if FAKE_INIT else 0, "device_count": 4,
           "get_device_name": "Torch Fake GPU", "get_device_capability": (9, 0),
           "get_device_properties": None, "_lazy_init": None, "init": None, "synchronize": None,
           "current_stream": None, "default_stream": None, "set_device": None,
           "mem_get_info": (0, 0), "memory_stats": {}, "memory_allocated": 0,
           "memory_stats_as_nested_dict": {}, "_record_memory_history": None,
           "_snapshot": {"segments": [], "device_traces": []}, "cudart": None, "get_arch_list": [],
           "can_device_access_peer": False, "ipc_collect": None, "empty_cache": None,
           "get_rng_state": None, "manual_seed": None, "_exchange_device": -1,
           "_maybe_exchange_device": -1, "is_bf16_supported": True, "get_device": 0}
C_QUERIES = {"_cuda_getDeviceCount": 4, "_cuda_init": None, "_cuda_getDevice": 0,
             "_cuda_setDevice": None, "_cuda_exchangeDevice": -1, "_cuda_maybeExchangeDevice": -1,
             "_cuda_synchronize": None, "_cuda_getCurrentStream": (0, 0, 1),
             "_cuda_getDefaultStream": (0, 0, 1),
             "_cuda_memorySnapshot": {"segments": [], "device_traces": []},
             "_cuda_memoryStats": {}, "_cuda_isDriverSufficient": True,
             "_cuda_getArchFlags": None, "_cuda_emptyCache": None}


def _spy(name, original, fake):
    def call(*args, **kwargs):
        note("call", name=name, stack="".join(traceback.format_stack(limit=14)[:-1]))
        if original is None or (FAKE_BUILD and not name.startswith("torch._C.")):
            return fake
        return original(*args, **kwargs)
    call._spy = True
    return call


def _install(cuda):
    import torch
    cap = None
    try:
        from sanitizer.capture import runtime
        cap = runtime._active
    except Exception:
        pass
    # capture's hooks run after this one: none is installed yet
    note("spies", hooks_before=list(cap.installed) if cap is not None else None)
    for name, fake in C_QUERIES.items():
        original = getattr(torch._C, name, None)
        if original is not None or FAKE_BUILD:
            setattr(torch._C, name, _spy("torch._C." + name, original, fake))
    mods = [m for n, m in list(sys.modules.items())
            if m is not None and (n == "torch.cuda" or n.startswith("torch.cuda."))]
    for name, fake in QUERIES.items():
        original = None
        for m in mods:
            original = getattr(m, name, None)
            if callable(original):
                break
        if not callable(original):
            continue
        s = _spy("torch.cuda." + name, original, fake)
        for m in mods:             # every alias (torch.cuda.memory.memory_stats, ...)
            if getattr(m, name, None) is original:
                setattr(m, name, s)
    if FAKE_INIT:
        cuda.is_initialized = lambda: True


def _fake_pynvml():
    m = types.ModuleType("pynvml")
    devices = [{"name": "NVIDIA H200", "cc": (9, 0), "uuid": "GPU-aaaa-0000"},
               {"name": "NVIDIA H100 80GB HBM3", "cc": (9, 0), "uuid": "GPU-bbbb-1111"}]

    def rec(name, fn):
        def call(*a):
            note("nvml", name=name)
            return fn(*a)
        return call
    m.nvmlInit = rec("nvmlInit", lambda: None)
    m.nvmlShutdown = rec("nvmlShutdown", lambda: None)
    m.nvmlDeviceGetCount = rec("nvmlDeviceGetCount", lambda: len(devices))
    m.nvmlDeviceGetHandleByIndex = rec("nvmlDeviceGetHandleByIndex", lambda i: devices[i])
    m.nvmlDeviceGetName = rec("nvmlDeviceGetName", lambda h: h["name"])
    m.nvmlDeviceGetCudaComputeCapability = rec("nvmlDeviceGetCudaComputeCapability", lambda h: h["cc"])
    m.nvmlDeviceGetUUID = rec("nvmlDeviceGetUUID", lambda h: h["uuid"])
    m.nvmlSystemGetDriverVersion = rec("nvmlSystemGetDriverVersion", lambda: b"570.86.15")
    return m


if os.environ.get("SPY_FAKE_PYNVML") == "1":
    sys.modules["pynvml"] = _fake_pynvml()

import wrapt  # noqa: E402  (capture's own dependency)

wrapt.register_post_import_hook(_install, "torch.cuda")
