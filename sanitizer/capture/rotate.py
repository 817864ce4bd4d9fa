"""Start a new trace file mid-run, one that reads on its own: the pytest plugin's one trace per test.

The new file begins with the live state re-declared (the same ids and addresses as before): the
modelled symmetric windows, then every live block. What is not carried over: ops still in flight
at the switch (a later `coll_done` of one is a malformed line; the plugin analyses leniently) and
the stream clocks (every file starts with nothing in flight). A block's stream is known only for
blocks placed in a modelled window; others are re-declared on stream "cpu", as after a fork.
"""
from __future__ import annotations

import os
import sys
import time


def live_state_events(cap) -> list[dict]:
    t = time.time_ns()
    events: list[dict] = []
    arenas = cap.arenas
    if arenas is not None:
        for arena in list(arenas.arenas.values()):
            events.append({"ev": "window", "addr": arena.base, "size": arena.capacity,
                           "comm": arena.comm, "t": t})
    blocks = cap.blocks
    if blocks is not None:
        for b in list(blocks.live.values()):
            model = b.model
            pool, stream = (model.pool, model.stream) if model is not None else ("default", "cpu")
            events.append({"ev": "alloc", "id": b.id, "addr": b.addr, "size": b.size,
                           "stream": stream, "pool": pool, "op": "live-at-new-trace", "t": t})
    return events


def rotate(cap, directory: str) -> None:
    """Write this process's events from now on into a new file in `directory`. Never raises.

    A process that was a rank in an earlier test (a process group since destroyed) is not one now:
    its new file is named after its pid again, so it does not claim the rank of the processes the
    next test spawns."""
    try:
        writer = cap.writer
        dist = sys.modules.get("torch.distributed")
        in_group = dist is not None and dist.is_available() and dist.is_initialized()
        if writer.rank is not None and not in_group and "RANK" not in os.environ and "LOCAL_RANK" not in os.environ:
            writer.rank = writer.world_size = None
        cap.writer.reopen(directory, live_state_events(cap))
    except Exception as exc:
        cap.failed("rotate", exc)
