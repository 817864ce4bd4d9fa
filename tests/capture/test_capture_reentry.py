"""Capture's locks re-entered on one thread: a signal handler and a GC finalizer (issue 50, item 9).

Python runs a signal handler on the main thread between any two bytecodes, inside capture's own
code too; a garbage collection (CPython 3.11: at any allocation of a tracked object) runs weakref
finalizers, BlockTable.died among them, on whichever thread allocated. Either may ask for a lock
that the interrupted frame of the same thread holds. A plain Lock then deadlocks the host program
for good, so each program below runs in its own interpreter under a timeout: a regression fails
by hanging.

  * SIGTERM during the allocator history's drain (allocator_history.AllocatorHistory.drain holds
    its lock around the read and the clear): with the default action, capture's handler
    (signals.SignalChain) closes the trace, and close() drains the history again. The close must
    wait for the interrupted drain to end (writer.when_outside: the drain's lock is one of the
    writer's guards), then run: the process dies of the signal, the trace complete, holding the
    segment the interrupted drain read.
  * A finalizer inside CudaOrdering's lock (cuda_hooks.py): a collection inside `_finished` (a
    stream sync) frees a storage that had record_stream streams; BlockTable.died -> on_free takes
    the same lock.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from trace_files import records

pytest.importorskip("torch")

TIMEOUT = 40


def _env(traces, **extra):
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(traces), PYTHONWARNINGS="ignore",
               HAZSAN_FLUSH_SECONDS="1000")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "HAZSAN_LEVEL", "HAZSAN_IDLE_SECONDS",
              "HAZSAN_TRACE_FORMAT", "HAZSAN_STEP_FLUSH_SECONDS", "HAZSAN_ALLOC_SOURCE", "HAZSAN_NATIVE"):
        env.pop(k, None)
    env.update(extra)
    return env


def _run(code, env):
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                              text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"deadlocked: no exit in {TIMEOUT} s; stderr: {exc.stderr!r}"[:3000])


# The torch.cuda surface AllocatorHistory reads (injectable: a CPU build has none), whose snapshot
# read sends the process a real SIGTERM: the handler runs at the next bytecode of the main thread,
# inside drain's locked section. One segment_alloc in the ring buffer: what the interrupted drain
# must still write before the close.
HISTORY_PROGRAM = """
import os, signal, sys, torch
from sanitizer.capture import allocator_history as ah, runtime

SEG = 0x7f0000000000
cap = runtime.active()
torch.ones(3)                                # capture is hooked: the trace file exists

class Allocator:
    def __init__(self):
        self.memory = self
        self.counts = (0, 0, 0, 0)
        self.signalled = False
    def device_count(self):
        return 1
    def _record_memory_history(self, enabled, **kw):
        pass
    def memory_stats_as_nested_dict(self, device):
        a, f, sa, sf = self.counts
        return {"allocation": {"all": {"allocated": a, "freed": f}},
                "segment": {"all": {"allocated": sa, "freed": sf}}}
    def _snapshot(self):
        trace = []
        if not self.signalled:
            self.signalled = True
            os.kill(os.getpid(), signal.SIGTERM)
            trace = [{"action": "segment_alloc", "addr": SEG, "size": 2 << 20, "stream": 0,
                      "pool_id": (0, 0), "time_us": 1}]
        return {"segments": [], "device_traces": [trace]}

class Table:
    def __init__(self):
        import itertools
        self._ids = itertools.count(1 << 40)
        self.emit = lambda ev: None

alloc = Allocator()
hist = ah.AllocatorHistory(cap, Table(), 64, alloc)
hist._cheap_read = False
hist.enable()
alloc.counts = (0, 0, 1, 0)                  # the segment_alloc the read will see
cap.alloc_history = hist                     # close() drains it, as under HAZSAN_ALLOC_SOURCE=history
print("draining", flush=True)
hist.drain()
print("drain returned: the signal's default action did not run", flush=True)
"""


def test_sigterm_inside_the_history_drain_closes_after_it_and_dies(tmp_path):
    traces = tmp_path / "t"
    run = _run(HISTORY_PROGRAM, _env(traces, HAZSAN_TRACE_FORMAT="jsonl"))
    assert run.returncode == -signal.SIGTERM, (run.returncode, run.stdout, run.stderr)
    assert "draining" in run.stdout and "drain returned" not in run.stdout
    (path,) = traces.iterdir()
    header, *evs = records(path)
    assert evs[-1]["ev"] == "end", evs[-3:]
    segments = [e for e in evs if e["ev"] == "segment"]
    assert [e["addr"] for e in segments] == [0x7f0000000000]      # the interrupted drain's, before the end
    assert not [e for e in evs if e["ev"] in ("hook_error", "dropped")], evs


def test_a_program_handler_inside_the_history_drain_runs_after_it(tmp_path):
    """A handler of the program's own (vLLM's EngineCore sets a flag, then exits): it runs once
    the drain has ended, the program goes on, and its exit completes the trace."""
    code = HISTORY_PROGRAM.replace("print(\"draining\"", textwrap.dedent("""\
        seen = []
        signal.signal(signal.SIGTERM, lambda s, f: seen.append(hist._lock._is_owned()))
        print("draining\"""")).replace(
        'print("drain returned: the signal\'s default action did not run", flush=True)',
        'print("handler ran inside the drain:", seen, flush=True)')
    traces = tmp_path / "t"
    run = _run(code, _env(traces, HAZSAN_TRACE_FORMAT="jsonl"))
    assert run.returncode == 0, run.stderr
    assert "handler ran inside the drain: [False]" in run.stdout, run.stdout
    (path,) = traces.iterdir()
    header, *evs = records(path)
    assert evs[-1]["ev"] == "end" and [e["ev"] for e in evs].count("segment") == 1
    assert header["progress"]["signal"] == "SIGTERM"


# A storage with record_stream streams (set on its block as CudaOrdering.on_record_stream does; a
# CPU build has no CUDA stream to record) kept alive only by a reference cycle, so that a
# collection frees it; and one already freed, so that a stream sync has a pending block to look at.
# The collection runs inside CudaOrdering._finished's locked loop (the `covers` test of each
# pending stream is called there; any allocation in that loop may start one on CPython 3.11).
CUDA_LOCK_PROGRAM = """
import gc, torch
from sanitizer.capture import runtime

cap = runtime.active()
torch.ones(1)
hooks, blocks = cap.cuda, cap.blocks

def with_streams(n):
    t = torch.ones(n)
    blocks.block_of(t).recorded = {"cuda:0:s7"}
    return t

first = with_streams(16)
first_id = blocks.block_of(first).id
del first                                    # on_free: pending
assert list(hooks.pending) == [first_id], hooks.pending

class Holder:
    pass
h = Holder()
h.me, h.t = h, with_streams(32)
second_id = blocks.block_of(h.t).id
del h                                        # garbage, freed by the next collection
gc.disable()
collected = []

def covers(stream, tick):
    collected.append(gc.collect())           # BlockTable.died -> on_free, inside the lock
    return False

hooks._finished(covers)
print("pending after the sync:", sorted(hooks.pending) == sorted([first_id, second_id]), flush=True)
hooks._finished(lambda stream, tick: True)   # now both streams are seen finished
print("free_done for both:", not hooks.pending, flush=True)
print("collected:", collected[0] > 0, flush=True)
"""


def test_a_finalizer_inside_the_cuda_ordering_lock_does_not_deadlock(tmp_path):
    """The dispatch path (HAZSAN_NATIVE=0): there a storage's death is a weakref finalizer
    (BlockTable.died), which is what a collection runs."""
    traces = tmp_path / "t"
    run = _run(CUDA_LOCK_PROGRAM, _env(traces, HAZSAN_TRACE_FORMAT="jsonl", HAZSAN_NATIVE="0"))
    assert run.returncode == 0, run.stderr
    assert "pending after the sync: True" in run.stdout, run.stdout + run.stderr
    assert "free_done for both: True" in run.stdout and "collected: True" in run.stdout, run.stdout
    (path,) = traces.iterdir()
    header, *evs = records(path)
    assert evs[-1]["ev"] == "end"
    assert len([e for e in evs if e["ev"] == "free_done"]) == 2
    assert not [e for e in evs if e["ev"] == "hook_error"], [e for e in evs if e["ev"] == "hook_error"]
