"""The CUDA caching allocator's own record, on stock PyTorch (HAZSAN_ALLOC_SOURCE=history).

EXPERIMENTAL, never the default (config.Settings.alloc_source is `dispatch`): on an H200 with torch
2.11 a program under this source died of SIGSEGV at a step boundary in four runs of five, inside
torch's own calls of the drain (`_cuda_memoryStats` right after the history was cleared, or the
snapshot; reports/gpu-kit/README.md, h200-run6-c4-crash.json). The cause is not established: the
GPU kit's C4 probe (gpu_selfcheck_history.py) tells the ranked candidates apart the next time a GPU
is available. A process that starts capture with this source says so on stderr (install).

Source: `torch.cuda.memory._record_memory_history` makes c10's DeviceCachingAllocator append one
TraceEntry per action to a per-device ring buffer of `max_entries`; `_snapshot()` returns them as
`device_traces` (one list per device, oldest first). The entry format, from torch/cuda/memory.py
(`_snapshot` docstring, TraceEntry) and torch/csrc/cuda/memory_snapshot.cpp: `action` (alloc,
free_requested, free_completed, segment_alloc, segment_free, segment_map, segment_unmap, oom,
snapshot), `addr` (`device_free` instead on oom), `size` (alloc: the size requested, as the dispatch
mode's storage nbytes; segments: the cudaMalloc'd size), `stream` (the cudaStream_t as an int),
`pool_id` ((0, 0) = the default pools), `time_us`, `frames`.

Cost choices: recording runs with `context=None` (no stack is gathered per entry: the dispatch
mode already has the site) and `stacks="python"` (no C++ unwinder warm-up). Stock PyTorch has no
"drain": at each step boundary this module reads the ring buffer and re-enables recording with
`clear_history=True`. The read asks for the snapshot of a memory pool id no pool has, so that
c10 returns the traces without walking every live block (DeviceCachingAllocator::snapshot filters
by pool id); where a torch build refuses that form, the full `_snapshot()` is used instead.

Losses are counted, never silent, from the allocator's own counters (memory_stats' cumulative
allocation / free / segment counts): entries the ring buffer overwrote (more actions than
`max_entries` within one step) and any action in the window between the read and the clear (only
another thread can allocate there) become `dropped` records.

How the two sources combine. The trace's order is the analysis's clock, and the allocator's
record can only be read at step boundaries, long after the collectives of the step were written.
So the dispatch mode stays the source of every `alloc` / `free` (in program order, with shapes,
sites and ops, which the allocator does not know); the allocator history adds what the dispatch
mode cannot see: the real `segment` / `segment_free` (cudaMalloc / cudaFree, expandable segments'
map / unmap) with their pools, and a check of each block: every allocator `alloc` is matched
against the dispatch mode's allocations of the same window by address, and its stream compared.
Blocks the dispatch mode never saw (C++ allocations outside the dispatcher: workspaces, c10d
internals) are counted, not written: written at the step boundary they would sit after the very
collectives they might collide with, and a later adoption by the dispatch mode would duplicate
them. `stats()` reports the agreement (the GPU self-check prints it).

Every entry point swallows and counts its exceptions (Capture.failed): nothing raises into the host.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter

from sanitizer.trace.binary import ORDER, position

_ALLOC, _ADDR, _STREAM = ORDER["alloc"][0], position("alloc", "addr"), position("alloc", "stream")

#: what a process that starts capture with this source says on stderr
EXPERIMENTAL_NOTE = ("hazsan: HAZSAN_ALLOC_SOURCE=history is experimental: torch 2.11 crashed (SIGSEGV) in it "
                     "on a GPU, cause not established (reports/gpu-kit); the default source, dispatch, is not affected")

# every TraceEntry action c10 writes (memory_snapshot.cpp action_to_str)
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
           "segment_map", "segment_unmap", "oom", "snapshot")
# no pool has this id: a snapshot "of" it lists no segments, only the traces
_NO_POOL = (2 ** 62 + 7, 2 ** 62 + 7)


def pool_name(pool_id) -> str:
    """The trace's pool name of an allocator pool id: "default" for (0, 0), else mempool:<a>:<b>."""
    if not pool_id:
        return "default"
    a, b = (int(x) for x in pool_id)
    return "default" if (a, b) == (0, 0) else f"mempool:{a}:{b}"


class HistoryConverter:
    """Allocator trace entries -> hazsan events. Pure: no torch, no capture (format-tested on CPU).

    alloc -> `alloc`; free_requested -> `free`; free_completed -> `free_done` only when the
    allocator deferred it (the block had record_stream streams: its completion is not the entry
    right after the request), otherwise nothing; segment_alloc / segment_map -> `segment`;
    segment_free / segment_unmap -> `segment_free`; oom and snapshot are counted."""

    def __init__(self, stream_of, next_id):
        self.stream_of = stream_of          # (handle, device) -> stream id
        self.next_id = next_id              # () -> a fresh block id
        self.live: dict = {}                # (device, addr) -> id
        self.pending: dict = {}             # (device, addr) -> id, freed, completion not yet seen
        self.counts: Counter = Counter()

    def convert(self, entries, device: int) -> list[dict]:
        out: list[dict] = []
        previous = None                     # (action, addr) of the entry before
        for e in entries:
            action = e.get("action")
            self.counts[action] += 1
            addr = e.get("addr")
            t = e.get("time_us")
            stamp = {"t": int(t) * 1000} if isinstance(t, int) else {}
            key = (device, addr)
            if action == "alloc":
                bid = self.next_id()
                self.live[key] = bid
                out.append({"ev": "alloc", "id": bid, "addr": addr, "size": int(e["size"]),
                            "stream": self.stream_of(e.get("stream", 0), device),
                            "pool": pool_name(e.get("pool_id")), "op": "allocator", **stamp})
            elif action == "free_requested":
                bid = self.live.pop(key, None)
                if bid is None:             # allocated before recording began
                    self.counts["free_of_unknown"] += 1
                else:
                    self.pending[key] = bid
                    out.append({"ev": "free", "id": bid, **stamp})
            elif action == "free_completed":
                bid = self.pending.pop(key, None)
                if bid is not None and previous != ("free_requested", addr):
                    out.append({"ev": "free_done", "id": bid, **stamp})
            elif action in ("segment_alloc", "segment_map"):
                out.append({"ev": "segment", "addr": addr, "size": int(e["size"]),
                            "pool": pool_name(e.get("pool_id")), **stamp})
            elif action in ("segment_free", "segment_unmap"):
                out.append({"ev": "segment_free", "addr": addr, **stamp})
            previous = (action, addr)
        return out


def _counters(stats: dict) -> tuple[int, int, int, int]:
    """(allocations, frees, segments allocated, segments freed), cumulative, from the nested dict
    of torch._C._cuda_memoryStats (c10 DeviceStats: allocation / segment, StatType "all")."""
    a = stats["allocation"]["all"]
    s = stats["segment"]["all"]
    return int(a["allocated"]), int(a["freed"]), int(s["allocated"]), int(s["freed"])


class AllocatorHistory:
    """Records the allocator's history for a Capture, drains it at step boundaries and at close."""

    def __init__(self, capture, table, max_entries: int, cuda=None):
        self.capture = capture
        self.table = table
        self.max_entries = int(max_entries)
        self.cuda = cuda                   # torch.cuda (injectable for tests)
        self.enabled = False
        self.converter = HistoryConverter(capture.streams.of_handle, lambda: next(table._ids))
        self.seen: dict = {}               # addr -> streams of the dispatch mode's CUDA allocs there
                                           # since the last drain, oldest first
        # held around a drain's read and clear. A signal handler's close() drains again: the lock
        # is one of the writer's guards, so a handler that interrupts a drain on this thread runs
        # when the drain has ended (drain() calls run_deferred); reentrant, so that whatever still
        # comes back here on the same thread is skipped and counted (drain), never a deadlock
        self._lock = threading.RLock()
        guard = getattr(getattr(capture, "writer", None), "guard", None)
        if guard is not None:
            guard(self._lock)
        self._base: dict = {}              # device -> counters after the last clear
        self._cheap_read = True
        import torch
        # c10's snapshot of one pool (torch._C, absent from CPU builds): traces without the walk
        self.pool_snapshot = getattr(torch._C, "_cuda_memorySnapshot", None)
        # the allocator's counters, read through torch._C: enable() runs inside torch.cuda's lazy
        # init, where torch.cuda.memory_stats_as_nested_dict still answers {} (not initialised)
        self.memory_stats = getattr(torch._C, "_cuda_memoryStats", None)
        self.totals: Counter = Counter()
        self._tapped = False               # the dispatch mode is tapped when recording starts:
                                           # until CUDA is initialised there is no CUDA alloc

    # ------------------------------------------------------------------ dispatch side
    def _tap(self, table) -> None:
        """Note the address of every CUDA `alloc` the dispatch mode writes (one dict update)."""
        emit = table.emit
        hist = self

        def tap(ev):
            # the block table writes its allocations as arrays (tuples; binary.source_item)
            if type(ev) is tuple or type(ev) is list:
                if ev[0] == _ALLOC and ev[_STREAM] != "cpu":
                    hist.seen.setdefault(ev[_ADDR], []).append(ev[_STREAM])
            elif ev["ev"] == "alloc" and ev["stream"] != "cpu":
                hist.seen.setdefault(ev["addr"], []).append(ev["stream"])
            emit(ev)
        table.emit = tap

    # ------------------------------------------------------------------ allocator side
    def enable(self) -> None:
        """Start recording (called at CUDA initialisation, through torch.cuda._lazy_call)."""
        try:
            if not self._tapped:
                self._tap(self.table)
                self._tapped = True
            self._record(clear=True)
            self.enabled = True
            # runs inside torch's lazy init (CUDA is being initialised by the program): the
            # device count is cudaGetDeviceCount's, no new side effect
            for d in range(self.cuda.device_count()):
                self._base[d] = self._read_counters(d)
        except Exception as exc:
            self.capture.failed("alloc_history.enable", exc)
            if self.enabled:               # recording started but cannot be accounted: stop it
                self.enabled = False
                try:
                    self.cuda.memory._record_memory_history(None)
                except Exception:
                    pass

    def _record(self, clear: bool) -> None:
        self.cuda.memory._record_memory_history("all", context=None, stacks="python",
                                                max_entries=self.max_entries, clear_history=clear)

    def _read_counters(self, device: int):
        read = self.memory_stats or self.cuda.memory.memory_stats_as_nested_dict
        return _counters(read(device))

    def _read_traces(self) -> list:
        if self._cheap_read:
            try:
                return self.pool_snapshot(_NO_POOL)["device_traces"]
            except Exception:
                self._cheap_read = False
        return self.cuda.memory._snapshot()["device_traces"]

    def drain(self) -> None:
        """Read and clear the ring buffers; write segments, count agreement and losses."""
        if not self.enabled:
            return
        if self._lock._is_owned():
            # re-entered on this thread inside a drain (a finalizer, a handler that was not
            # deferred): the outer drain reads and clears everything this one would have
            self.totals["reentered"] += 1
            self.capture.failed("alloc_history.drain", RuntimeError(
                "drain re-entered on its own thread: skipped, the interrupted drain reads it all"))
            return
        t0 = time.perf_counter()
        try:
            self._drain_locked()
        except Exception as exc:
            self.capture.failed("alloc_history.drain", exc)
        finally:
            self.totals["drain_us"] += int((time.perf_counter() - t0) * 1e6)
        # a signal that arrived inside the drain (its handler deferred by the writer) runs now
        run_deferred = getattr(getattr(self.capture, "writer", None), "run_deferred", None)
        if run_deferred is not None:
            run_deferred()

    def _drain_locked(self) -> None:
        with self._lock:
            devices = sorted(self._base)
            before = {d: self._read_counters(d) for d in devices}
            traces = self._read_traces()
            if self._cheap_read and not any(traces) and \
                    any(before[d] != self._base.get(d) for d in devices):
                # this build filters the traces by pool too: read them all from now on
                self._cheap_read = False
                traces = self._read_traces()
            self._record(clear=True)
            after = {d: self._read_counters(d) for d in devices}
            seen, self.seen = self.seen, {}
            for d, entries in enumerate(traces):
                self._account(d, entries, before.get(d), after.get(d))
                for ev in self.converter.convert(entries, d):
                    self._reconcile(ev, seen)
            self.totals["dispatch_only"] += sum(len(v) for v in seen.values())
            self.totals["drains"] += 1

    def _account(self, device, entries, before, after) -> None:
        """Count what the ring buffer lost (overwritten) or what the read/clear window lost."""
        base = self._base.get(device)
        if before is None or after is None or base is None:
            return
        got = Counter(e.get("action") for e in entries)
        # expandable segments map / unmap pages where others cudaMalloc / cudaFree
        recorded = (got["alloc"], got["free_requested"], got["segment_alloc"] + got["segment_map"],
                    got["segment_free"] + got["segment_unmap"])
        expected = tuple(b - a for a, b in zip(base, before))
        if min(expected) < 0:             # the program reset the allocator's accumulated stats
            self._base[device] = after
            return
        # fewer entries than the counters say happened before the read: the ring overwrote them
        overwritten = sum(max(0, e - r) for e, r in zip(expected, recorded))
        # actions between the first counter read and the clear that are not in the read (entries
        # beyond `expected` were recorded in that window before the read)
        window = sum(max(0, (a1 - a0) - max(0, r - e))
                     for a0, a1, r, e in zip(before, after, recorded, expected))
        if overwritten:
            self.totals["overwritten"] += overwritten
            self.capture.writer.count_drop(overwritten, "allocator history ring buffer full "
                                                        "(raise HAZSAN_ALLOC_HISTORY_ENTRIES)")
        if window:
            self.totals["window"] += window
            self.capture.writer.count_drop(window, "allocator actions between reading and "
                                                   "clearing the history (another thread)")
        self._base[device] = after

    def _reconcile(self, ev, seen) -> None:
        kind = ev["ev"]
        if kind in ("segment", "segment_free"):
            self.capture.emit(ev)
            self.totals[kind] += 1
        elif kind == "alloc":
            streams = seen.get(ev["addr"])
            if streams:
                self.totals["matched"] += 1
                if streams.pop(0) != ev["stream"]:
                    self.totals["stream_mismatch"] += 1
            else:
                self.totals["unseen_allocs"] += 1
                self.totals["unseen_bytes"] += ev["size"]

    def stats(self) -> dict:
        return {**dict(self.totals), "actions": dict(self.converter.counts),
                "read": "pool-filtered" if self._cheap_read else "full-snapshot"}

    def close(self) -> None:
        try:
            self.drain()
            if self.enabled:
                self.enabled = False
                self.cuda.memory._record_memory_history(None)
        except Exception as exc:
            self.capture.failed("alloc_history.close", exc)


def install(capture, table):
    """HAZSAN_ALLOC_SOURCE=history: record from CUDA initialisation on, never initialising CUDA
    ourselves (a parent that forks workers must not own a CUDA context because of us): no device
    query here, not even `torch.cuda.is_available()` (cudaGetDeviceCount initialises the driver).

    On a torch built with CUDA, `start` is queued with `torch.cuda._lazy_call`: torch runs it inside
    its lazy initialisation, when the program first uses CUDA (at once where CUDA is initialised
    already). In a process that never initialises CUDA the queued call just stays in
    torch.cuda._queued_calls, never run; nothing else happens (a child forked from such a process
    inherits it and records from its own initialisation). A CPU build of torch has nothing to record:
    the dispatch path is left untouched and nothing is queued."""
    from sanitizer.capture import cuda_state
    if getattr(capture, "speaks", False):
        print(EXPERIMENTAL_NOTE, file=sys.stderr)
    if not cuda_state.compiled():
        return None
    import torch
    hist = AllocatorHistory(capture, table, capture.settings.alloc_history_entries, torch.cuda)
    capture.alloc_history = hist

    def start():
        try:
            hist.enable()
        except Exception as exc:      # a queued call that raises would fail torch's lazy init
            capture.failed("alloc_history.enable", exc)
    torch.cuda._lazy_call(start)
    capture.installed.append("allocator-history")
    return hist


def stats() -> dict | None:
    """The active capture's allocator-history agreement counts (None under `dispatch`)."""
    from sanitizer.capture import runtime
    cap = runtime.active()
    hist = getattr(cap, "alloc_history", None)
    return hist.stats() if hist is not None else None
