"""Facts for the trace header: what capture hooked, the versions it ran against, the device.

Computed when the header is written (the first flush, or at exit for a capture that recorded
nothing). Nothing is imported on the program's behalf: torch facts only when the program imported
torch, NVML (`pynvml`) only when torch sees a GPU and pynvml is installed.
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
    versions = {"hazsan": _version("hazsan")}
    for mod, dist in (("sglang", "sglang"), ("vllm", "vllm")):
        if mod in sys.modules:
            versions[mod] = _version(dist)
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "__version__"):
        versions["torch"] = str(torch.__version__)
        try:
            h.update(_device_facts(torch, versions))
        except Exception as exc:
            capture.failed("header.device", exc)
    versions.update(getattr(capture, "versions", {}))
    h["versions"] = {k: v for k, v in versions.items() if v is not None}
    return h


def _device_facts(torch, versions: dict) -> dict:
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_available():
        return {"gpu": None}
    dev = cuda.current_device()
    major, minor = cuda.get_device_capability(dev)
    gpu = {"name": cuda.get_device_name(dev), "capability": f"SM{major}{minor}",
           "count": cuda.device_count(), "cuda": getattr(torch.version, "cuda", None)}
    try:
        nccl = cuda.nccl.version()
        versions["nccl"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
    except Exception:
        pass
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
            gpu["driver"] = driver.decode() if isinstance(driver, bytes) else str(driver)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass      # no NVML: the header says what torch knows
    return {"gpu": gpu}
