"""Op-level hooks for SGLang's collective paths that bypass NCCL: custom all-reduce (v1, v2), quick
all-reduce, torch symmetric-memory all-reduce, MSCCL++ and the Triton multimem all-gather.

These run their own kernels on the current stream over IPC-mapped or multicast buffers, so neither
torch.distributed nor the NCCLLibrary hook sees them. Each method in OPS is wrapped at class level;
after it returns, one `coll` is recorded with the tensors it read ("r") and wrote ("w", the output
or the returned tensor), resolved to trace ranges by the block table, on the current stream
(`cpu` for host tensors), comm "<kind>:<group name>" and a per-comm seq.

Peer semantics: every kernel here synchronises with its peers at entry and exit, except the
Triton multimem all-gather built with skip_entry_sync: its op is recorded as
"multimem_all_gather(skip_entry_sync)", the case the analysis checks with
`--peer-completion successor` (docs/ordering-and-rules.md, "successor"): its buffers are free only after a later collective
on the same comm.

Verified on SGLang 0.5.23's source (names and signatures); these classes need CUDA IPC to be
built, so the CPU tests drive the hook through the real methods only where those run on CPU.
"""
from __future__ import annotations

import functools
import threading

DC = "sglang.srt.distributed.device_communicators."

# module -> [(class, method, kind, how to find its buffers)]
#   args(a, result, self) -> [(tensor, access)]
OPS = {
    DC + "custom_all_reduce": [("CustomAllreduce", "custom_all_reduce", "custom_ar",
                                lambda a, r, s: [(a[0], "r"), (r, "w")])],
    DC + "custom_all_reduce_v2": [("CustomAllReduceV2", "custom_all_reduce", "custom_ar_v2",
                                   lambda a, r, s: [(a[0], "r"), (r, "w")])],
    DC + "quick_all_reduce": [("QuickAllReduce", "quick_all_reduce", "quick_ar",
                               lambda a, r, s: [(a[0], "r"), (r, "w")])],
    DC + "torch_symm_mem": [("TorchSymmMemCommunicator", "all_reduce", "torch_symm_mem",
                             lambda a, r, s: [(a[0], "r"), (_staging(s, a[0]), "rw"), (r, "w")])],
    DC + "pymscclpp": [("PyMscclppCommunicator", "all_reduce", "mscclpp",
                        lambda a, r, s: [(a[0], "rw")]),
                       ("PyMscclppCommunicator", "all_gather", "mscclpp",
                        lambda a, r, s: [(a[1], "r"), (a[0], "w")])],
    DC + "triton_symm_mem_ag": [("MultimemAllGatherer", "__call__", "multimem_ag",
                                 lambda a, r, s: [(a[0], "r"), (r, "w")])],
}


def _staging(comm, inp):
    buf = getattr(comm, "buffer", None)
    try:
        return buf[: inp.numel()] if buf is not None else None
    except Exception:
        return None


class OpCollectives:
    def __init__(self, capture):
        self.capture = capture
        self.seq: dict[str, int] = {}
        self._lock = threading.Lock()

    def record(self, kind, method, obj, args, result, spec) -> None:
        from sanitizer.capture.runtime import comm_name
        import torch
        cap = self.capture
        group = getattr(obj, "group", None)
        comm = f"{kind}:{comm_name(group) if group is not None else 'default'}"
        bufs, host = [], True
        table = cap.blocks
        for t, access in spec(args, result, obj):
            if not isinstance(t, torch.Tensor) or table is None:
                continue
            r = table.buffer(t)
            if r is not None:
                bufs.append({"addr": r[0], "size": r[1], "access": access})
                host = host and t.is_cpu
        if host:
            stream = "cpu"
        else:
            stream = cap.streams.current()
        op = f"{kind}.{method}"
        if kind == "multimem_ag":
            op = "multimem_all_gather" + ("(skip_entry_sync)" if getattr(obj, "_skip_entry_sync", False) else "")
        with self._lock:
            seq = self.seq.get(comm, 0)
            self.seq[comm] = seq + 1
        cap.event({"ev": "coll", "cid": cap.next_cid(), "comm": comm, "seq": seq, "op": op,
                   "stream": stream, "bufs": bufs})


def install_for(capture, module) -> list[str]:
    """Wrap the OPS entries of `module` (called from its post-import hook)."""
    ops = getattr(capture, "op_collectives", None)
    if ops is None:
        ops = capture.op_collectives = OpCollectives(capture)
    hooked = []
    for cls_name, method, kind, spec in OPS.get(module.__name__, ()):
        cls = getattr(module, cls_name, None)
        original = getattr(cls, method, None) if cls is not None else None
        if original is None:
            capture.failed(f"install.{kind}.{method}",
                           RuntimeError(f"{module.__name__}.{cls_name}.{method} not found"))
            continue
        if getattr(original, "_hazsan", False):
            continue

        def make(original=original, method=method, kind=kind, spec=spec):
            @functools.wraps(original)
            def wrapper(self, *args, **kwargs):
                scope = capture.collective_depth
                if scope.depth:         # nested (pymscclpp inside custom AR ...): the outer records
                    return original(self, *args, **kwargs)
                before = scope.recorded
                scope.depth = 1
                try:
                    result = original(self, *args, **kwargs)
                finally:
                    scope.depth = 0
                if scope.recorded != before:
                    # the call went out through torch.distributed or pynccl (a fallback path),
                    # which recorded it with its completion: no second record
                    return result
                if result is not None or method in ("all_gather",):
                    try:
                        a = list(args)
                        for k in ("out", "output_tensor", "input_tensor"):
                            if k in kwargs:
                                a.append(kwargs[k])
                        ops.record(kind, method, self, a, result if result is not None else kwargs.get("out"), spec)
                    except Exception as exc:
                        capture.failed(f"{kind}.{method}", exc)
                return result
            wrapper._hazsan = True
            return wrapper

        setattr(cls, method, make())
        hooked.append(f"sglang.{cls_name}.{method}")
    capture.installed.extend(hooked)
    return hooked
