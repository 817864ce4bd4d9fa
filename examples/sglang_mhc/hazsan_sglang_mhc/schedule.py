"""Each SGLang model step's requests, to attribute a wrong token to the step that produced it.

Wraps `Scheduler.run_batch` (outside hazsan's own step hook, so both count the same calls: the
step numbers here are capture's `step` numbers) in TP rank 0's scheduler and appends, per call, one
line to HAZSAN_MHC_OUT/schedule.ndjson:

    {"step": n, "mode": "DECODE", "reqs": {rid: [prompt tokens, output tokens before the step]}}

A request's output token k was produced by the last step of that request whose count before is
at most k (the scheduler appends a step's tokens after run_batch returns, in
process_batch_result). Written and flushed per step: Engine.shutdown() SIGKILLs the scheduler.
"""
from __future__ import annotations

import itertools
import json
import os

_installed = False


def install_in_scheduler() -> None:
    global _installed
    out = os.environ.get("HAZSAN_MHC_OUT")
    if _installed or not out:
        return
    from sglang.srt.managers import scheduler as module
    from sglang.srt.runtime_context import get_parallel
    if get_parallel().tp_rank != 0:
        return
    cls = module.Scheduler
    run_batch = cls.run_batch
    counter = itertools.count()
    path = os.path.join(out, "schedule.ndjson")

    def wrapped(self, batch, *args, **kwargs):
        n = next(counter)
        reqs = list(getattr(batch, "reqs", None) or [])
        row = {"step": n, "mode": getattr(getattr(batch, "forward_mode", None), "name", None),
               "reqs": {r.rid: [len(r.origin_input_ids), len(r.output_ids)] for r in reqs}}
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")
        return run_batch(self, batch, *args, **kwargs)

    wrapped._hazsan_mhc = True
    cls.run_batch = wrapped
    _installed = True
