"""The placement model's prediction of which NGRAM depths collide, from SGLang captures.

`hazsan sweep --schedule` replays one recorded decode step of a capture (its window traffic: the
partial, the transients, the all-reduce) along a list of step token counts, through the
caching-allocator model the testbed places with, after the capture's set-up (weights, caches); it
reports which steps of that schedule collide (`reuse-in-flight`). A step's token count is what
hazsan's SGLang Scheduler hook records as its `tokens`: a prefill's new tokens, requests x
speculative_num_draft_tokens for an NGRAM verify step (sanitizer/capture/sglang_hooks.py).

Two predictions per depth:

  * from ONE capture (the first depth's stock run), replayed along the schedule SGLang makes at
    that depth when the drafts are accepted (`expected_schedule`): the capture's prefill, then
    the verify steps. No run at that depth is used: this is what a user with one capture asks.
  * from the depth's own stock capture, replayed along the schedule its fixed (clean) run
    recorded: the shapes the depth really had, before any corruption changed them.
"""
from __future__ import annotations

import math
from pathlib import Path


def step_marks(run_dir: Path) -> list[dict]:
    """The `step` events of TP rank 0's trace: [{"n", "phase", "tokens"}]."""
    from sanitizer.trace.reader import open_trace
    path = next((run_dir / f"rank0{ext}" for ext in (".hzs", ".jsonl") if (run_dir / f"rank0{ext}").exists()), None)
    if path is None:
        return []
    return [{"n": ev["n"], "phase": ev.get("phase"), "tokens": ev.get("tokens")}
            for _, ev in open_trace(path).events() if isinstance(ev, dict) and ev.get("ev") == "step"]


def recorded_schedule(run_dir: Path) -> list[int]:
    """Token counts of the run's model steps, in order (what the Scheduler hook recorded)."""
    return [m["tokens"] for m in step_marks(run_dir) if isinstance(m["tokens"], int) and m["tokens"] > 0]


def verify_steps(depth: int, output_tokens: int) -> int:
    """NGRAM verify steps for `output_tokens` greedy tokens when every draft is accepted: the
    prefill gives the first token; the first verify step finds the corpus without the request's
    tokens (SGLang's NGRAM inserts them after a step: docs/logscan-formats.md) and gives one; each
    later one gives depth + 1."""
    return 1 + math.ceil(max(0, output_tokens - 2) / (depth + 1))


def expected_schedule(prefill_tokens: int, depth: int, running: int, output_tokens: int) -> list[int]:
    """The steps SGLang makes at `depth` with `running` requests admitted together: one prefill,
    then verify steps of running x (depth + 1) tokens."""
    return [prefill_tokens] + [running * (depth + 1)] * verify_steps(depth, output_tokens)


def template(run_dir: Path) -> tuple[int | None, int | None]:
    """(the first decode step's n, the first prefill step's tokens) of a capture: the step replayed
    (before any corruption changes the batch) and the prefill the schedule starts with."""
    marks = step_marks(run_dir)
    step = next((m["n"] for m in marks if m["phase"] == "decode" and (m["tokens"] or 0) > 0), None)
    prefill = next((m["tokens"] for m in marks if m["phase"] == "extend" and (m["tokens"] or 0) > 0), None)
    return step, prefill


def replay(hazsan, capture_dir: Path, step: int, schedule: list[int]) -> dict:
    """`hazsan sweep CAPTURE --step STEP --schedule ...`: which steps of the schedule collide."""
    code, out = hazsan("sweep", str(capture_dir), "--step", str(step), "--schedule", ",".join(map(str, schedule)))
    colliding = out.get("colliding_steps", [])
    return {"capture": capture_dir.name, "template_step": step, "schedule": schedule, "exit": code,
            "colliding": [c["index"] for c in colliding], "colliding_tokens": [c["tokens"] for c in colliding],
            "by_rule": out.get("by_rule", {})}


def constant_shapes(hazsan, capture_dir: Path, step: int, counts: list[int], repeat: int = 4) -> dict:
    """Which token counts collide when every step has that count: the step replayed `repeat` times
    at each count after the capture's set-up (no prefill before)."""
    out = {"capture": capture_dir.name, "template_step": step, "repeat": repeat, "colliding": [], "clean": []}
    for m in counts:
        _, res = hazsan("sweep", str(capture_dir), "--step", str(step), "--schedule", ",".join([str(m)] * repeat))
        (out["colliding"] if res.get("colliding_steps") else out["clean"]).append(m)
    return out
