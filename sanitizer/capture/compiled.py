"""torch.compile: waits that happen while the compiler runs, with capture's dispatch mode off.

The dispatch mode steps aside while Dynamo, AOTAutograd and Inductor compile (memory.py,
`ignore_compile_internals`), so an op the compiler runs on real tensors is not seen. One of them
is a real wait: AOTAutograd resolves an AsyncCollectiveTensor input of the compiled function with
`trigger_wait()` before it traces (torch/_functorch/_aot_autograd/frontend_utils.py), which waits
for the collective in C++. The runtime wrapper it generates calls `trigger_wait()` again before
each call (subclass_codegen.py), a no-op for the tensor already waited on. So on the first call of
a compiled block fed an all-gathered AsyncCollectiveTensor (FSDP2 and tensor-parallel blocks;
pytorch#125677's fix keeps that wait), the collective completes inside the compiler and no
`wait_tensor` reaches the trace: its buffers would read as in flight for the rest of the run.

`AsyncCollectiveTensor.trigger_wait` is wrapped on the class: when it really waited (the tensor
was not completed before), the collective of its tensor is done (collectives.waited), unless the
dispatch mode already recorded the wait_tensor it issued (eager: then nothing more is written).
A collective nobody waits on is still in flight: only a wait that happened is recorded.
"""
from __future__ import annotations


def on_functional_collectives(capture, module) -> None:
    act = getattr(module, "AsyncCollectiveTensor", None)
    trigger_wait = getattr(act, "trigger_wait", None)
    if trigger_wait is None:
        raise RuntimeError("torch.distributed._functional_collectives: AsyncCollectiveTensor.trigger_wait "
                           "not found; a wait inside torch.compile is not recorded")
    if getattr(trigger_wait, "_hazsan", False):
        return
    # Not traced by Dynamo: AOTAutograd resolves AsyncCollectiveTensor inputs before it traces, and
    # the class defines no __torch_function__ that a compiled frame could reach it through. (Nor
    # can torch.compiler.is_compiling() tell, it is true in the compiler's own Python too.)
    def wrapped(self):
        was = getattr(self, "completed", True)
        out = trigger_wait(self)
        if not was:
            try:
                colls = getattr(capture, "collectives", None)
                if colls is not None:
                    colls.waited(self.elem)
            except Exception as exc:
                capture.failed("compile.trigger_wait", exc)
        return out

    wrapped._hazsan = True
    wrapped.__wrapped__ = trigger_wait
    wrapped.__name__ = trigger_wait.__name__
    wrapped.__qualname__ = trigger_wait.__qualname__
    wrapped.__doc__ = trigger_wait.__doc__
    act.trigger_wait = wrapped
    capture.installed.append("AsyncCollectiveTensor.trigger_wait")
