"""Stable stream ids for a process: the one name every hook uses for a device stream.

Allocations (the dispatch mode), collectives (torch.distributed, the NCCL wrapper hook) and
ordering events (CUDA events, stream waits, graphs) all name the stream they run on. They see it
in different forms: a `torch.cuda.Stream`, the raw `cudaStream_t` a ctypes call passes, or only
"the current stream of device d". This table maps each form to one id, so that the engine can
relate an all-reduce enqueued through pynccl with the allocation that reuses its buffer.

Ids: `cuda:<d>` is device d's default (legacy or per-thread) stream, the one most work runs on;
any other stream gets `cuda:<d>:s<n>`, numbered per device in the order first seen. CPU work is
`cpu`. The handle is the process-wide key (CUDA stream handles are unique pointers), except for
the default-stream sentinels, which exist once per device.
"""
from __future__ import annotations

import threading

# cudaStreamLegacy and cudaStreamPerThread, and the null stream torch reports as 0.
DEFAULT_STREAM_HANDLES = (0, 1, 2)


class StreamIds:
    def __init__(self) -> None:
        self._ids: dict = {}          # handle (or (device, sentinel)) -> id
        self._count: dict[int, int] = {}
        self._lock = threading.Lock()
        self.devices: set[int] = set()   # every device a stream was named on

    def of_handle(self, handle: int, device: int = 0) -> str:
        """The id of raw stream handle `handle` (a cudaStream_t as an int) on device `device`."""
        handle = int(handle or 0)
        device = int(device or 0)
        if device not in self.devices:
            self.devices.add(device)
        if handle in DEFAULT_STREAM_HANDLES:
            return f"cuda:{device}"
        sid = self._ids.get(handle)
        if sid is None:
            with self._lock:
                sid = self._ids.get(handle)
                if sid is None:
                    n = self._count.get(device, 0) + 1
                    self._count[device] = n
                    sid = self._ids[handle] = f"cuda:{device}:s{n}"
        return sid

    def of_torch(self, stream) -> str:
        """The id of a `torch.cuda.Stream` (or anything with `cuda_stream` and `device_index`)."""
        device = getattr(stream, "device_index", None)
        if device is None:
            dev = getattr(stream, "device", None)
            device = getattr(dev, "index", 0) or 0
        return self.of_handle(getattr(stream, "cuda_stream", 0), device)

    def current(self, device=None) -> str:
        """The id of the current CUDA stream of `device` (a torch.device, an int or None).
        Before the program initialised CUDA (torch.cuda.current_stream would initialise it) no
        stream has work: the device's default stream."""
        from sanitizer.capture import cuda_state
        if not cuda_state.initialized():
            index = getattr(device, "index", device)
            return f"cuda:{int(index or 0)}"
        import torch
        return self.of_torch(torch.cuda.current_stream(device))

    def of_device(self, device: int) -> list[str]:
        """The ids of every stream of `device` named so far, its default stream first."""
        prefix = f"cuda:{device}:"
        return [f"cuda:{device}"] + sorted(s for s in list(self._ids.values()) if s.startswith(prefix))

    def known(self) -> dict:
        """handle -> id for every non-default stream seen (for the trace header and tests)."""
        return dict(self._ids)
