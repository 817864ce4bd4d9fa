"""The engine's window table (issue 14): the window a block or a collective buffer lies in is the
first registered live window overlapping it, and `window_free` drops the first registered one at
that address of that communicator, as a scan of the registration list says; without costing
O(windows) per lookup (benchmarks/engine_scaling.py, case `windows`)."""
from __future__ import annotations

import random

import pytest

from sanitizer.rules.driver import compiled_available, load_engine

ENGINES = ["interpreted", "compiled"] if compiled_available()[0] else ["interpreted"]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("seed,adds", [(1, 0.45), (2, 0.45), (3, 0.3), (4, 0.3)])
def test_window_table_answers_as_the_registration_list(engine, seed, adds):
    """Many windows (the address index answers) and a few (the list answers), in turn."""
    eng = load_engine(engine)[0]
    rng = random.Random(seed)
    table, registered = eng.WindowTable(), []  # the list: what the definition scans
    ordinal = 0
    modes = set()
    for _ in range(3000):
        r = rng.random()
        if r < adds or not registered:
            # a few addresses again and again: windows registered twice at one (addr, comm)
            addr = rng.randrange(1 << 16) * 64 if rng.random() < 0.7 else rng.randrange(8) * 64
            size = rng.choice((0, 64, 4096, 1 << 16, 1 << 20))
            w = eng.Window(addr, size, rng.choice(("tp", "ep", 7)), ordinal)
            ordinal += 1
            table.add(w)
            registered.append(w)
        elif r < 0.65:
            # the address and communicator of a live window, or ones that name none
            w = rng.choice(registered)
            addr, comm = (w.addr, w.comm) if rng.random() < 0.9 else (w.addr + 1, w.comm)
            want = next((x for x in registered if x.addr == addr and x.comm == comm), None)
            assert table.remove(addr, comm) is (want is not None)
            if want is not None:
                registered.remove(want)
        else:
            lo = rng.randrange(1 << 22)
            hi = lo + rng.choice((0, 1, 64, 4096, 1 << 18))
            want = next((w for w in registered if w.addr < hi and lo < w.end), None)
            assert table.first_at(lo, hi) is want
        assert len(table) == len(registered)
        modes.add(table.small is None)
    assert modes == {True, False}  # both ways of answering were checked
