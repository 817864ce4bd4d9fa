"""Where the testbed's events go: into hazsan capture's trace when capture is on, else into a
schema-1 file of its own, else nowhere.

The testbed places window blocks itself (the memory is real shared memory, not a model), so it
writes the `window`, `segment`, `scope`, `alloc`/`free`, `record_stream`/`free_done`, `coll` and
`coll_done` events for them. With capture on (HAZSAN=1) they go through capture's writer, into
the same rank file as everything else capture records, and the testbed *claims* each window
storage in capture's block table, so capture neither adopts it a second time nor misses it as a
collective buffer of torch.distributed. Ids and cids come from a range of their own
(ID_BASE and up) so that they never meet capture's.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
import time

ID_BASE = 1 << 40          # testbed ids and cids when sharing capture's file


class Recorder:
    """Null recorder: the interface, doing nothing."""

    active = False

    def __init__(self):
        self._ids = itertools.count(1)
        self._cids = itertools.count(1)
        self._lock = threading.Lock()

    def next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def next_cid(self) -> int:
        with self._lock:
            return next(self._cids)

    def emit(self, ev: dict, site: bool = False) -> None:
        pass

    def step(self, n: int, phase: str | None = None, tokens: int | None = None) -> None:
        pass

    def claim(self, storage, block_id: int, addr: int, size: int) -> None:
        pass

    def unclaim(self, key) -> None:
        pass

    def flush(self) -> None:
        pass

    def device_work(self):
        """Context for the comm thread's body: the collectives' own loads and stores, which a real
        NCCL kernel makes out of the host's sight. Nothing to hide without capture."""
        import contextlib
        return contextlib.nullcontext()

    def close(self) -> None:
        pass

    @property
    def path(self) -> str | None:
        return None


class FileRecorder(Recorder):
    """The testbed's own schema-1 file (`rank<R>.jsonl` in `directory`: JSON Lines, whatever
    HAZSAN_TRACE_FORMAT says; the examples and their docs show these files)."""

    active = True

    def __init__(self, directory: str, rank: int, world_size: int, header_extra: dict | None = None,
                 device: str = "cpu"):
        super().__init__()
        from sanitizer.capture.sites import SiteFinder
        from sanitizer.trace.writer import TraceWriter
        self.writer = TraceWriter(os.path.abspath(directory), header_extra=header_extra, trace_format="jsonl")
        self.writer.set_rank(rank, world_size, device=device)
        self.sites = SiteFinder("site")
        torch = sys.modules.get("torch")
        if torch is not None:
            self.sites.add_internal(torch)

    def emit(self, ev: dict, site: bool = False) -> None:
        ev["t"] = time.time_ns()
        if site:
            where, _ = self.sites.where()
            if where is not None:
                ev["site"] = where
        self.writer.emit(ev)

    def step(self, n: int, phase: str | None = None, tokens: int | None = None) -> None:
        ev = {"ev": "step", "n": int(n)}
        if phase is not None:
            ev["phase"] = phase
        if tokens is not None:
            ev["tokens"] = int(tokens)
        self.emit(ev)
        self.writer.flush()

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()

    @property
    def path(self) -> str | None:
        return self.writer.path


class CaptureRecorder(Recorder):
    """Events into the running hazsan capture (HAZSAN=1) of this process."""

    active = True

    def __init__(self, capture):
        super().__init__()
        self.capture = capture
        self._ids = itertools.count(ID_BASE)
        self._cids = itertools.count(ID_BASE)
        self._claimed: dict = {}

    def device_work(self):
        """The comm thread is the device's comm stream: its torch ops (the sums into the window)
        are the collective's own work, recorded as its `coll`, never as the program's launches.
        The dispatch mode is off there already (comm.py); capture's native op observer sees every
        thread, and is told this one launches nothing. Its allocations are recorded as before."""
        import contextlib

        blocks = self.capture.blocks

        @contextlib.contextmanager
        def no_launches():
            if blocks is not None:
                blocks.launches_here(False)
            try:
                yield
            finally:
                if blocks is not None:
                    blocks.launches_here(True)
        return no_launches()

    def emit(self, ev: dict, site: bool = False) -> None:
        try:
            self.capture.event(ev, with_site=site)
        except Exception as exc:   # never into the program
            self.capture.failed("testbed.emit", exc)

    def step(self, n: int, phase: str | None = None, tokens: int | None = None) -> None:
        self.capture.mark_step(n, phase, tokens)

    def claim(self, storage, block_id: int, addr: int, size: int) -> None:
        """Tell capture's block table that this storage is recorded (by the testbed)."""
        blocks = getattr(self.capture, "blocks", None)
        if blocks is None:
            return
        try:
            declare = getattr(blocks, "declare_external", None)
            if declare is not None:      # the public hook, when capture offers one
                declare(storage, block_id=block_id, addr=addr, size=size)
                return
            from sanitizer.capture.block_table import new_block
            key = storage._cdata
            # no callback: the testbed writes this block's free itself
            b = new_block(storage, None, block_id, key, storage.data_ptr(), storage.nbytes(), addr, size, None)
            blocks.live[key] = b
            self._claimed[key] = b
        except Exception as exc:
            self.capture.failed("testbed.claim", exc)

    def unclaim(self, key) -> None:
        b = self._claimed.pop(key, None)
        if b is None:
            return
        try:
            blocks = self.capture.blocks
            forget = getattr(blocks, "forget_external", None)
            if forget is not None:
                forget(key)
            elif blocks.live.get(key) is b:
                del blocks.live[key]
        except Exception as exc:
            self.capture.failed("testbed.claim", exc)

    def flush(self) -> None:
        self.capture.writer.flush()


def for_process(trace_dir: str | None, rank: int, world_size: int, header_extra: dict | None = None,
                device: str = "cpu") -> Recorder:
    """Capture's trace if capture is on, else a file in trace_dir if given, else nothing."""
    runtime = sys.modules.get("sanitizer.capture.runtime")
    cap = runtime.active() if runtime is not None else None
    if cap is not None:
        try:
            cap.writer.set_rank(rank, world_size, device=device)
        except Exception as exc:
            cap.failed("testbed.rank", exc)
        return CaptureRecorder(cap)
    if trace_dir:
        return FileRecorder(trace_dir, rank, world_size, header_extra, device)
    return Recorder()
