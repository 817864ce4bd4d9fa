"""What a trace without its end record proves, from the `progress` its header carries.

Capture rewrites its header in place as the file progresses (docs/trace-format.md, "progress";
sanitizer/trace/writer.py): `quiet` while every event recorded so far is in the file, the last
step and whether it ended (where the program's step hook marks ends: SGLang's run_batch, vLLM's
execute_model), a termination signal the program handled, and `flush_seconds`, the period of the
time flush. A process killed with SIGKILL runs no code, so this is all there is to go on:

  * `quiet`: nothing is missing. The header says so only after the time flush found nothing left
    to write, and takes it back before the next event is buffered.
  * otherwise what may be missing is what the process recorded after its last flush: at most the
    last `flush_seconds` before it died (the time flush writes anything older). With step ends
    marked, `step_ended` says whether that window lies inside a step or after the last one.
"""
from __future__ import annotations

#: What a trace cut after its last step's end proves (said in its reason, and read back by
#: report.render.verdict_blockers): every event of every step is in the file, so a verdict on the
#: steps stands; only what the process did after its last step (its shutdown) may be missing.
STEPS_COMPLETE = "nothing recorded during a step is missing"

HEADER_ONLY = ("header only, no end record: the process was killed, or ended without a clean exit, "
               "before its first flush; its events are missing")


def _int(v):
    return v if type(v) is int else None


def _seconds(header: dict) -> str:
    f = header.get("flush_seconds")
    if type(f) in (int, float) and f >= 0:
        return f"{f:g} s"
    return "HAZSAN_FLUSH_SECONDS"


def no_end_record(header: dict, header_only: bool) -> tuple[bool, str]:
    """(nothing is missing, what to say) for a trace whose header announced an end record and
    which has none."""
    progress = header.get("progress")
    if not isinstance(progress, dict):
        progress = {}
    signal = progress.get("signal") if isinstance(progress.get("signal"), str) else None
    shutdown = (f"during shutdown ({signal} arrived and the program's own handler ran; the process "
                "died before it exited)") if signal else None
    if progress.get("quiet") is True:
        what = ("it had recorded nothing" if header_only
                else "every event it recorded is in the file")
        when = f"killed {shutdown}" if shutdown else "killed, or ended without a clean exit,"
        return True, f"no end record, nothing missing: the process was {when} while idle: {what}"
    if header_only:
        return False, HEADER_ONLY
    window = f"in at most the last {_seconds(header)} before it died"
    step, ended = _int(progress.get("step")), progress.get("step_ended")
    if step is not None and ended is True:
        where = (f"after its last step ({step}): every event up to the end of step {step} is in the "
                 f"file, so {STEPS_COMPLETE}; only what it recorded after "
                 f"step {step} ended, {window}, may be missing")
    elif step is not None and ended is False:
        where = (f"during step {step}: what it recorded after its last flush, {window}, may be "
                 f"missing, events of step {step} among them")
    else:
        where = f"what it recorded after its last flush, {window}, may be missing"
    if shutdown:
        return False, f"no end record: killed {shutdown}, {where}"
    if step is not None and ended in (True, False):
        return False, f"no end record: the process was killed, or its last writes failed, {where}"
    return False, f"no end record: the process was killed, or its last writes failed; {where}"
