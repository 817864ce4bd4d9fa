"""`hazsan place`: the window holding an address outside every input block is the first
registered one that holds it, as a scan of the registrations in order says (issue 14: not a scan
per address)."""
from __future__ import annotations

import random

from sanitizer.place.replay import _WindowMap


def test_window_map_answers_as_a_scan_in_registration_order():
    rng = random.Random(5)
    wm, scan = _WindowMap(), {}   # the dict: what the old code scanned, in insertion order
    for _ in range(4000):
        if rng.random() < 0.4:
            # a few addresses again and again: registered twice, sizes changing, overlaps
            addr = rng.randrange(1 << 20) * 64 if rng.random() < 0.6 else rng.randrange(16) * 4096
            key = (addr, rng.choice(("tp", "ep")))
            value = (rng.randrange(1 << 40), rng.choice((0, 64, 4096, 1 << 16, 1 << 24)))
            wm[key] = value
            scan[key] = value
            assert wm.get(key) == value
        else:
            q = rng.randrange(1 << 26) if rng.random() < 0.7 else rng.randrange(16) * 4096 + rng.randrange(8192)
            want = next(((waddr, model) for (waddr, _), (model, size) in scan.items() if waddr <= q < waddr + size), None)
            assert wm.holding(q) == want
