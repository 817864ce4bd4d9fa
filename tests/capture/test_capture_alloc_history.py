"""HAZSAN_ALLOC_SOURCE=history (sanitizer/capture/allocator_history.py), on CPU.

A CPU build of torch has no caching allocator to record, so these are FORMAT TESTS: the converter
is driven with snapshot dicts in torch's documented format, taken from torch's own source:
  * torch/cuda/memory.py, `_snapshot` docstring: Snapshot {segments, device_traces}, TraceEntry
    {action, addr (device_free on oom), frames, size, stream, pool_id};
  * torch/csrc/cuda/memory_snapshot.cpp (action_to_str, the trace entry keys): the actions
    segment_map / segment_unmap and the keys time_us, compile_context, user_metadata;
  * c10/cuda/CUDACachingAllocator.cpp: an alloc entry's size is the size requested, free() writes
    free_requested then, unless the block has record_stream streams, free_completed at once.
The fixture is first read by torch's own consumer of that format (torch.cuda._memory_viz.trace).
The drain logic (ring-buffer and read-window losses, agreement with the dispatch mode) is driven
through an injected `cuda` namespace returning such dicts; on a GPU, gpu_selfcheck's
`alloc-history` scenario runs the real thing (not run here: no GPU in this task).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from sanitizer.capture import allocator_history as ah  # noqa: E402
from sanitizer.capture.config import Settings  # noqa: E402
from sanitizer.capture.streams import StreamIds  # noqa: E402

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

SIDE = 0x55AA00          # a cudaStream_t of a non-default stream
SEG = 0x7F0000000000     # default-pool small segment
POOL = 0x7E0000000000    # a MemPool's large segment
EXP = 0x7D0000000000     # an expandable segment's mapped range


def entry(action, addr, size, stream=0, pool=(0, 0), t=1_000):
    e = {"action": action, "size": size, "stream": stream, "frames": [], "time_us": t,
         "pool_id": pool, "compile_context": "N/A", "user_metadata": ""}
    e["device_free" if action == "oom" else "addr"] = addr
    return e


def snapshot_fixture():
    """One device's trace, oldest first, as _snapshot() returns it."""
    trace = [
        entry("segment_alloc", SEG, 2 << 20),
        entry("alloc", SEG, 4096),
        entry("alloc", SEG + 4096, 4096),
        entry("free_requested", SEG, 4096),
        entry("free_completed", SEG, 4096),                 # at once: no record_stream
        entry("segment_alloc", POOL, 20 << 20, SIDE, (1, 0)),
        entry("alloc", POOL, 4 << 20, SIDE, (1, 0)),
        entry("free_requested", SEG + 4096, 4096),          # had record_stream: completion later
        entry("alloc", POOL + (4 << 20), 1 << 20, SIDE, (1, 0)),
        entry("free_completed", SEG + 4096, 4096),
        entry("oom", 1024, 1 << 40),
        entry("free_requested", POOL, 4 << 20, SIDE, (1, 0)),
        entry("free_completed", POOL, 4 << 20, SIDE, (1, 0)),
        entry("segment_map", EXP, 2 << 20),
        entry("segment_unmap", EXP, 2 << 20),
        entry("snapshot", 0, 0),
    ]
    return {"segments": [], "device_traces": [trace]}


def converter():
    ids = iter(range(1, 1000))
    return ah.HistoryConverter(StreamIds().of_handle, lambda: next(ids))


def test_every_action_torch_documents_is_handled():
    doc = torch.cuda.memory._snapshot.__doc__ + torch.cuda.memory._record_memory_history.__doc__
    documented = set(re.findall(r'"(alloc|free_\w+|segment_\w+|oom|snapshot)"', doc))
    assert {"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
            "oom", "snapshot"} <= documented
    assert documented <= set(ah.ACTIONS)


def test_fixture_is_torchs_format():
    out = torch.cuda._memory_viz.trace(snapshot_fixture())
    assert "cudaMalloc" in out and "raise OutOfMemoryError" in out and "free completed" in out


def test_format_conversion():
    conv = converter()
    evs = conv.convert(snapshot_fixture()["device_traces"][0], 0)
    strip = [{k: v for k, v in e.items() if k != "t"} for e in evs]
    assert strip == [
        {"ev": "segment", "addr": SEG, "size": 2 << 20, "pool": "default"},
        {"ev": "alloc", "id": 1, "addr": SEG, "size": 4096, "stream": "cuda:0", "pool": "default", "op": "allocator"},
        {"ev": "alloc", "id": 2, "addr": SEG + 4096, "size": 4096, "stream": "cuda:0", "pool": "default", "op": "allocator"},
        {"ev": "free", "id": 1},
        {"ev": "segment", "addr": POOL, "size": 20 << 20, "pool": "mempool:1:0"},
        {"ev": "alloc", "id": 3, "addr": POOL, "size": 4 << 20, "stream": "cuda:0:s1", "pool": "mempool:1:0", "op": "allocator"},
        {"ev": "free", "id": 2},
        {"ev": "alloc", "id": 4, "addr": POOL + (4 << 20), "size": 1 << 20, "stream": "cuda:0:s1", "pool": "mempool:1:0", "op": "allocator"},
        {"ev": "free_done", "id": 2},                       # deferred completion only
        {"ev": "free", "id": 3},
        {"ev": "segment", "addr": EXP, "size": 2 << 20, "pool": "default"},
        {"ev": "segment_free", "addr": EXP},
    ]
    assert evs[0]["t"] == 1_000_000                          # time_us -> ns
    assert conv.counts["oom"] == 1 and conv.counts["snapshot"] == 1


def test_free_of_a_block_allocated_before_recording_is_counted_not_written():
    conv = converter()
    evs = conv.convert([entry("free_requested", SEG, 512), entry("free_completed", SEG, 512)], 0)
    assert evs == [] and conv.counts["free_of_unknown"] == 1


def test_converted_events_are_a_valid_trace(tmp_path):
    """The engine reads the converted events without a malformed line or an unknown field."""
    trace = [e for e in snapshot_fixture()["device_traces"][0]
             if e["addr" if "addr" in e else "device_free"] != SEG + 4096]   # no record_stream here
    evs = converter().convert(trace, 0)
    path = tmp_path / "rank0.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"hazsan": 1, "rank": 0, "world_size": 1, "device": "cuda:0"}) + "\n")
        for e in evs:
            f.write(json.dumps(e) + "\n")
    out = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(path), "--format", "json",
                          "--fail-on", "warning"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert not report.get("findings") and not report.get("malformed")


# ---------------------------------------------------------------------- drain logic
class Writer:
    def __init__(self):
        self.drops = []

    def count_drop(self, n, reason):
        self.drops.append((n, reason))


class Cap:
    """The Capture surface the history uses (emit, writer, streams, failed)."""

    def __init__(self):
        self.events, self.failures = [], Counter()
        self.writer = Writer()
        self.streams = StreamIds()
        self.emit = self.events.append

    def failed(self, hook, exc):
        self.failures[hook] += 1


class Table:
    def __init__(self, cap):
        import itertools
        self._ids = itertools.count(1000)
        self.emit = cap.emit


class Allocator:
    """Injected torch.cuda surface: returns queued snapshot traces and counter values."""

    def __init__(self):
        self.traces, self.counters, self.calls = [], [], []
        self.memory = self

    def device_count(self):
        return 1

    def _record_memory_history(self, enabled, **kw):
        self.calls.append((enabled, kw))

    def memory_stats_as_nested_dict(self, device):
        a, f, sa, sf = self.counters.pop(0)
        return {"allocation": {"all": {"allocated": a, "freed": f}},
                "segment": {"all": {"allocated": sa, "freed": sf}}}

    def _snapshot(self):
        return {"segments": [], "device_traces": [self.traces.pop(0)]}


def make(max_entries=100):
    cap, alloc = Cap(), Allocator()
    table = Table(cap)
    hist = ah.AllocatorHistory(cap, table, max_entries, alloc)
    hist._cheap_read = False
    assert hist.memory_stats is None        # a CPU build: torch._C has no _cuda_memoryStats
    alloc.counters.append((0, 0, 0, 0))
    hist.enable()
    return cap, alloc, table, hist


def test_enable_records_without_stacks_and_clears():
    cap, alloc, _, hist = make(4096)
    assert hist.enabled and alloc.calls == [("all", {"context": None, "stacks": "python",
                                                      "max_entries": 4096, "clear_history": True})]


def test_drain_writes_segments_and_checks_dispatch_allocs():
    cap, alloc, table, hist = make()
    table.emit({"ev": "alloc", "id": 1, "addr": SEG, "size": 4096, "stream": "cuda:0"})
    table.emit({"ev": "alloc", "id": 2, "addr": POOL, "size": 4 << 20, "stream": "cuda:0"})   # wrong stream
    table.emit({"ev": "alloc", "id": 3, "addr": 0x1000, "size": 64, "stream": "cpu"})        # not CUDA
    alloc.traces.append([entry("segment_alloc", SEG, 2 << 20), entry("alloc", SEG, 4096),
                         entry("segment_alloc", POOL, 20 << 20, SIDE, (1, 0)),
                         entry("alloc", POOL, 4 << 20, SIDE, (1, 0)),
                         entry("alloc", SEG + 4096, 512)])          # a C++ allocation
    alloc.counters += [(3, 0, 2, 0), (3, 0, 2, 0)]
    hist.drain()
    written = [e["ev"] for e in cap.events]
    assert written == ["alloc", "alloc", "alloc", "segment", "segment"]   # dispatch's 3, then segments
    s = hist.stats()
    assert s["matched"] == 2 and s["stream_mismatch"] == 1 and s["unseen_allocs"] == 1
    assert s["unseen_bytes"] == 512 and s.get("dispatch_only", 0) == 0
    assert cap.writer.drops == [] and not cap.failures
    assert alloc.calls[-1][1]["clear_history"] is True


def test_ring_buffer_overflow_is_counted_as_dropped():
    cap, alloc, _, hist = make(max_entries=2)
    alloc.traces.append([entry("alloc", SEG + 512 * i, 512) for i in range(3, 5)])  # 5 happened, 2 kept
    alloc.counters += [(5, 0, 0, 0), (5, 0, 0, 0)]
    hist.drain()
    assert cap.writer.drops and cap.writer.drops[0][0] == 3 and "ring buffer" in cap.writer.drops[0][1]
    assert hist.stats()["overwritten"] == 3 and hist.stats()["dispatch_only"] == 0


def test_actions_between_read_and_clear_are_counted():
    cap, alloc, _, hist = make()
    alloc.traces.append([entry("alloc", SEG, 512)])
    alloc.counters += [(1, 0, 0, 0), (3, 1, 0, 0)]   # 2 allocs and a free after the read
    hist.drain()
    assert [n for n, _ in cap.writer.drops] == [3] and hist.stats()["window"] == 3


def test_a_failing_allocator_never_raises():
    cap, alloc, _, hist = make()
    alloc.counters.clear()                            # memory_stats now raises IndexError
    hist.drain()
    assert cap.failures["alloc_history.drain"] == 1


def test_enable_on_a_cpu_build_is_a_counted_failure():
    """The real torch.cuda of a CPU build: recording cannot start; the failure is counted."""
    cap = Cap()
    hist = ah.AllocatorHistory(cap, Table(cap), 16, torch.cuda)
    hist.enable()
    hist.drain()
    assert not hist.enabled and cap.failures["alloc_history.enable"] == 1


def test_setting_parsed_and_bad_value_falls_back():
    s, problems = Settings.from_env({"HAZSAN_ALLOC_SOURCE": "History", "HAZSAN_ALLOC_HISTORY_ENTRIES": "4096"})
    assert s.alloc_source == "history" and s.alloc_history_entries == 4096 and not problems
    s, problems = Settings.from_env({"HAZSAN_ALLOC_SOURCE": "cupti"})
    assert s.alloc_source == "dispatch" and "HAZSAN_ALLOC_SOURCE" in problems[0]


def test_history_source_in_a_captured_cpu_program(tmp_path):
    """HAZSAN=1 HAZSAN_ALLOC_SOURCE=history on CPU: nothing to record, the capture is unchanged."""
    prog = textwrap.dedent('''
        import torch, sanitizer
        from sanitizer.capture import allocator_history
        sanitizer.step(0)
        x = torch.ones(64) * 2
        sanitizer.step(1)
        print(allocator_history.stats())
    ''')
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    env.update(HAZSAN="1", HAZSAN_DIR=str(tmp_path), HAZSAN_ALLOC_SOURCE="history", HAZSAN_TRACE_FORMAT="jsonl")
    out = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"           # no CUDA: no history, dispatch path untouched
    files = [f for f in os.listdir(tmp_path) if f.endswith(".jsonl")]
    lines = [json.loads(x) for x in open(tmp_path / files[0]).read().splitlines()]
    installed = lines[0]["hooks"]["installed"]
    assert "dispatch-mode" in installed and "allocator-history" not in installed
    assert not [e for e in lines[1:] if e["ev"] == "hook_error"]
    assert any(e["ev"] == "alloc" for e in lines[1:])


def test_cheap_read_that_returns_no_traces_falls_back_to_the_full_snapshot():
    """A build whose pool-filtered snapshot also filters the traces: detected, full read used."""
    cap, alloc, _, hist = make()
    hist._cheap_read = True
    asked = []
    hist.pool_snapshot = lambda pool: asked.append(pool) or {"segments": [], "device_traces": [[]]}
    alloc.traces.append([entry("alloc", SEG, 512)])
    alloc.counters += [(1, 0, 0, 0), (1, 0, 0, 0)]
    hist.drain()
    assert asked == [ah._NO_POOL]
    assert hist.stats()["read"] == "full-snapshot" and hist.stats()["unseen_allocs"] == 1
    assert cap.writer.drops == []


def test_cheap_read_used_when_it_returns_the_traces():
    cap, alloc, _, hist = make()
    hist._cheap_read = True
    hist.pool_snapshot = lambda pool: {"segments": [], "device_traces": [[entry("alloc", SEG, 512)]]}
    alloc.counters += [(1, 0, 0, 0), (1, 0, 0, 0)]
    hist.drain()
    assert hist.stats()["read"] == "pool-filtered" and hist.stats()["unseen_allocs"] == 1
    assert alloc.traces == [] and cap.writer.drops == []


def test_gpu_selfcheck_alloc_sources_program_compiles():
    from sanitizer.capture import gpu_selfcheck as sc
    compile(sc.ALLOC_SOURCES_PROGRAM, "alloc-sources", "exec")
    assert callable(sc.alloc_sources)


def test_enable_inside_torchs_lazy_init_reads_the_c_level_counters():
    """Queued calls run before torch.cuda.is_initialized() turns true, when
    memory_stats_as_nested_dict still answers {}: the counters are read through torch._C."""
    cap, alloc = Cap(), Allocator()
    alloc.memory_stats_as_nested_dict = lambda device: {}
    hist = ah.AllocatorHistory(cap, Table(cap), 16, alloc)
    hist.memory_stats = lambda device: {"allocation": {"all": {"allocated": 7, "freed": 5}},
                                        "segment": {"all": {"allocated": 1, "freed": 0}}}
    hist.enable()
    assert hist.enabled and hist._base == {0: (7, 5, 1, 0)} and not cap.failures


def test_enable_that_cannot_read_the_counters_stops_recording():
    cap, alloc = Cap(), Allocator()                # no counters queued: reading them fails
    hist = ah.AllocatorHistory(cap, Table(cap), 16, alloc)
    hist.enable()
    assert not hist.enabled and cap.failures["alloc_history.enable"] == 1
    assert alloc.calls[-1] == (None, {})           # recording turned off again


def test_step_boundary_and_close_drain_into_the_trace(tmp_path):
    """The runtime's hook-in: Capture.mark_step drains before its `step` event and flush,
    Capture.close drains and turns recording off (real Capture, writer and BlockTable)."""
    from sanitizer.capture import block_table, runtime
    cap = runtime.Capture(Settings(directory=str(tmp_path)))
    cap.installed.append("test")
    table = block_table.BlockTable(cap)
    alloc = Allocator()
    alloc.counters.append((0, 0, 0, 0))
    hist = ah.AllocatorHistory(cap, table, 64, alloc)
    hist._cheap_read = False
    cap.alloc_history = hist
    hist.enable()
    alloc.traces += [[entry("segment_alloc", SEG, 2 << 20)], [entry("segment_free", SEG, 2 << 20)]]
    alloc.counters += [(0, 0, 1, 0), (0, 0, 1, 0), (0, 0, 1, 1), (0, 0, 1, 1)]
    cap.mark_step(1)
    cap.close()
    files = [f for f in os.listdir(tmp_path) if f.endswith(".jsonl")]
    evs = [json.loads(x)["ev"] for x in open(tmp_path / files[0]).read().splitlines()[1:]]
    assert evs == ["segment", "step", "segment_free", "end"]
    assert alloc.calls[-1] == (None, {}) and not hist.enabled


# ---------------------------------------------------------------------- lazy installation
class HistorySettings:
    alloc_history_entries = 32


def lazy_install(monkeypatch, compiled=True):
    """allocator_history.install with torch.cuda's device queries made to fail the test, the CUDA
    build faked (torch._C._cuda_getDeviceCount present) and torch.cuda._lazy_call recorded."""
    for name in ("is_available", "current_device", "device_count", "_lazy_init", "init",
                 "get_device_name", "get_device_capability"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, _n=name: pytest.fail(f"torch.cuda.{_n} called"))
    if compiled:
        monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: pytest.fail("cudaGetDeviceCount"),
                            raising=False)
    queued = []
    monkeypatch.setattr(torch.cuda, "_lazy_call", lambda fn, **kw: queued.append(fn))
    cap = Cap()
    cap.installed, cap.settings = [], HistorySettings()
    table = Table(cap)
    emit = table.emit
    hist = ah.install(cap, table)
    return cap, table, emit, hist, queued


def test_install_queues_recording_for_cuda_initialisation_and_asks_nothing(monkeypatch):
    cap, table, emit, hist, queued = lazy_install(monkeypatch)
    assert hist is not None and cap.alloc_history is hist and cap.installed == ["allocator-history"]
    assert len(queued) == 1 and not hist.enabled
    assert table.emit is emit                 # the dispatch mode is not tapped before CUDA exists
    hist.drain()
    hist.close()                              # exit without CUDA: nothing to read, nothing to stop
    assert not cap.failures and not cap.events
    # CUDA initialisation runs the queued call: recording starts (injected allocator)
    alloc = Allocator()
    alloc.counters.append((0, 0, 0, 0))
    hist.cuda = alloc
    queued[0]()
    assert hist.enabled and table.emit is not emit and alloc.calls[0][0] == "all"


def test_queued_start_never_raises_into_torchs_lazy_init(monkeypatch):
    """A queued call that raises would fail the program's CUDA initialisation
    (DeferredCudaCallError): a failing start is counted instead."""
    cap, _, _, hist, queued = lazy_install(monkeypatch)
    hist.cuda = object()                      # every allocator call fails
    queued[0]()
    hist.enable = lambda: 1 / 0               # even a failure outside enable's own guard
    queued[0]()
    assert not hist.enabled and cap.failures["alloc_history.enable"] == 2


def test_install_on_a_cpu_build_queues_nothing(monkeypatch):
    cap, table, emit, hist, queued = lazy_install(monkeypatch, compiled=False)
    assert hist is None and queued == [] and cap.installed == [] and table.emit is emit


def test_torchs_lazy_call_before_initialisation_only_queues(monkeypatch):
    """The real torch.cuda._lazy_call in a process where CUDA is not initialised: the callable is
    appended to torch.cuda._queued_calls and not run; nothing initialises."""
    ran = []
    monkeypatch.setattr(torch.cuda, "_queued_calls", list(torch.cuda._queued_calls))
    monkeypatch.setattr(torch._C, "_cuda_init", lambda: pytest.fail("CUDA initialised"), raising=False)
    before = len(torch.cuda._queued_calls)
    torch.cuda._lazy_call(lambda: ran.append(1))
    assert ran == [] and len(torch.cuda._queued_calls) == before + 1
    assert not torch.cuda.is_initialized()


def test_history_is_experimental_and_never_the_default(tmp_path):
    """Issue 50 item 10: until the C4 crash (torch 2.11, SIGSEGV in the drain) is understood, the
    default source is the dispatch mode, whatever else is set, and a run that asks for the
    history hears that it is experimental, once, from the process that speaks for the run."""
    from sanitizer.capture.config import Settings
    assert Settings().alloc_source == "dispatch"
    assert Settings.from_env({})[0].alloc_source == "dispatch"
    assert Settings.from_env({"HAZSAN_LEVEL": "alloc", "HAZSAN": "1"})[0].alloc_source == "dispatch"
    prog = "import torch; torch.ones(2)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    env.update(HAZSAN="1", HAZSAN_DIR=str(tmp_path / "h"), HAZSAN_ALLOC_SOURCE="history")
    out = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count(ah.EXPERIMENTAL_NOTE) == 1, out.stderr
    env.pop("HAZSAN_ALLOC_SOURCE")
    env["HAZSAN_DIR"] = str(tmp_path / "d")
    out = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and ah.EXPERIMENTAL_NOTE not in out.stderr, out.stderr
