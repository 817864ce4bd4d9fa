"""Each model step's schedule, for attributing a corrupted token to the step that produced it.

Where HAZSAN_MHC_OUT names a folder, TP rank 0's worker appends one line per
`GPUModelRunner.execute_model` call (vLLM's CPU model runner inherits it) to
`schedule.ndjson` (not `.jsonl`: `hazsan check DIR` reads those as traces): `{"step": n, "reqs": {req_id: [num_computed_tokens, num_scheduled_tokens]}}`.
`n` counts every call from 0, as hazsan capture's vLLM step hook does, so it is the `n` of the
trace's `step` events. A token at position P of a request was produced by the last step whose
computed range [computed, computed + scheduled) holds P - 1 (a rejected draft's positions are
computed again by a later step).
"""
from __future__ import annotations

import functools
import itertools
import json
import os

_done = False


def _facts(so) -> dict:
    per_req = dict(getattr(so, "num_scheduled_tokens", None) or {})
    computed = {}
    for req in getattr(so, "scheduled_new_reqs", None) or ():
        computed[req.req_id] = int(getattr(req, "num_computed_tokens", 0))
    cached = getattr(so, "scheduled_cached_reqs", None)
    if cached is not None:
        for rid, c in zip(cached.req_ids, cached.num_computed_tokens):
            computed[rid] = int(c)
    return {rid: [computed.get(rid), int(n)] for rid, n in per_req.items()}


def install_in_worker() -> None:
    """Wrap execute_model (once per process; TP rank 0 only writes)."""
    global _done
    out = os.environ.get("HAZSAN_MHC_OUT")
    if _done or not out:
        return
    _done = True
    from vllm.distributed import get_tensor_model_parallel_rank
    if get_tensor_model_parallel_rank() != 0:
        return
    from vllm.v1.worker import gpu_model_runner
    cls = gpu_model_runner.GPUModelRunner
    inner = cls.execute_model
    steps = itertools.count()
    log = open(os.path.join(out, "schedule.ndjson"), "a", buffering=1)
    depth = [0]

    @functools.wraps(inner)
    def execute_model(self, scheduler_output, *args, **kwargs):
        if not depth[0]:
            try:
                log.write(json.dumps({"step": next(steps), "reqs": _facts(scheduler_output)}) + "\n")
            except Exception as exc:          # never break the server for the bookkeeping
                log.write(json.dumps({"error": repr(exc)}) + "\n")
        depth[0] += 1
        try:
            return inner(self, scheduler_output, *args, **kwargs)
        finally:
            depth[0] -= 1

    cls.execute_model = execute_model
