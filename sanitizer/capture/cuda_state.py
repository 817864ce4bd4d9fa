"""What capture may ask about CUDA without initialising it.

A process that has not initialised CUDA must not get a CUDA context because of capture: the
driver initialised in a parent makes every forked child unable to use CUDA ("Cannot re-initialize
CUDA in forked subprocess"), and servers decide between fork and spawn by asking
`torch.cuda.is_initialized()`. Every public `torch.cuda` device query does initialise it:
`is_available()` calls cudaGetDeviceCount (cuInit), `current_device()`, `current_stream()`,
`get_device_name()`, `get_device_capability()` and `synchronize()` run `_lazy_init()`, and
`device_count()` falls back to cudaGetDeviceCount where NVML cannot answer.

So capture asks only:
  * `compiled()`: whether torch was built with CUDA (an attribute of torch._C);
  * `initialized()`: `torch.cuda.is_initialized()`, which reads a flag (false in a child forked
    from an initialised parent, where CUDA cannot be used at all);
  * `current_device()`: the current device, only once `initialized()` is true, else None;
and reads device facts from NVML (facts.py), which creates no CUDA context. Nothing here imports
torch: a process that has not imported it has no CUDA state to ask about.
"""
from __future__ import annotations

import sys


def _cuda():
    torch = sys.modules.get("torch")
    return getattr(torch, "cuda", None) if torch is not None else None


def compiled() -> bool:
    """torch is imported and built with CUDA (or ROCm). Reads an attribute, calls nothing."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return hasattr(torch._C, "_cuda_getDeviceCount")
    except Exception:
        return False


def initialized() -> bool:
    """torch.cuda.is_initialized(): a flag torch sets at the end of its lazy initialisation.
    False while torch is not imported, on a failure, and in a child forked after the parent
    initialised CUDA (no CUDA there)."""
    cuda = _cuda()
    if cuda is None:
        return False
    try:
        return bool(cuda.is_initialized())
    except Exception:
        return False


def current_device(default=None):
    """The program's current CUDA device (int) once CUDA is initialised, else `default`.
    `torch.cuda.current_device()` initialises CUDA: it is called only when that has happened."""
    if not initialized():
        return default
    try:
        return int(_cuda().current_device())
    except Exception:
        return default


def group_device(pg, default: int = 0) -> str:
    """The header's device for an NCCL process group, never initialising CUDA: `cuda:<d>` with d
    the device the group is bound to (`init_process_group(device_id=...)`), else the current
    device once CUDA is initialised, else `default`."""
    try:
        bound = getattr(pg, "bound_device_id", None)
        index = getattr(bound, "index", None)
        if index is not None:
            return f"cuda:{int(index)}"
    except Exception:
        pass
    return f"cuda:{current_device(default)}"
