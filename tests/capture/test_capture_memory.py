"""Capture of allocations and frees (sanitizer/capture/memory.py), in a real HAZSAN=1 interpreter.

One program runs every scenario, separated by `sanitizer.step(n)` markers; the tests read its trace
and check each step's events. The program prints the real data pointers it saw, so addresses are
checked against torch, not against constants.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")

from sanitizer.capture.window import WINDOW_BASE  # noqa: E402

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

PROGRAM = textwrap.dedent(r'''
    import gc, json, threading
    import numpy as np
    import torch
    import sanitizer
    from torch.utils._python_dispatch import _disable_current_modes

    ptr = {}
    sanitizer.step(1)                       # views share one storage
    a = torch.ones(1000)
    ptr["a"] = a.untyped_storage().data_ptr()
    v1 = a.view(10, 100)
    v2 = a[10:20]
    v2.add_(1.0)                            # in-place on a view: no new storage
    del a
    sanitizer.step(2)
    del v1
    sanitizer.step(3)
    del v2                                  # the last view: the storage dies here
    sanitizer.step(4)                       # autograd keeps exp's output for backward
    x = torch.randn(256, requires_grad=True)
    h = x.exp()
    ptr["h"] = h.untyped_storage().data_ptr()
    loss = h.sum()
    del h
    gc.collect()
    sanitizer.step(5)
    loss.backward()
    del loss
    sanitizer.step(6)                       # module parameters and buffers
    m = torch.nn.BatchNorm1d(64)
    ptr["running_mean"] = m.running_mean.untyped_storage().data_ptr()
    sanitizer.step(7)
    del m
    gc.collect()
    sanitizer.step(8)                       # a thread started after torch was imported
    out = []
    th = threading.Thread(target=lambda: out.append(torch.zeros(77)))
    th.start(); th.join()
    ptr["thread"] = out[0].untyped_storage().data_ptr()
    sanitizer.step(9)                       # numpy memory: no allocator made it
    n = torch.from_numpy(np.ones(33))
    ptr["numpy"] = n.untyped_storage().data_ptr()
    del n
    sanitizer.step(10)                      # resize_ moves the same storage
    r = torch.empty(10)
    r.resize_(10000)
    ptr["resized"] = r.untyped_storage().data_ptr()
    sanitizer.step(11)                      # created where the mode could not see it: adopted
    with _disable_current_modes():
        q = torch.ones(5)
    ptr["hidden"] = q.untyped_storage().data_ptr()
    q2 = q + 1
    sanitizer.step(12)                      # symmetric scope: modelled window placement
    with sanitizer.symmetric_scope("tp", pool="symm"):
        s1 = torch.empty(1000)
        t1 = s1 * 2                         # a transient made inside the scope
    del t1
    outside = torch.empty(1000)
    del s1
    with sanitizer.symmetric_scope("tp", pool="symm"):
        s2 = torch.empty(1000)              # the cached block of s1 (same size) again
    sanitizer.step(13)                      # adopted inside a scope: it was not placed there
    with _disable_current_modes():
        old = torch.ones(7)
    ptr["old"] = old.untyped_storage().data_ptr()
    with sanitizer.symmetric_scope("tp", pool="symm"):
        new = old + 1
    sanitizer.step(14)
    print(json.dumps(ptr))
''')


def _events(path):
    with open(path, "rb") as f:
        lines = [json.loads(line) for line in f]
    return lines[0], lines[1:]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("mem")
    prog = d / "prog.py"
    prog.write_text(PROGRAM)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(d / "traces"))
    env.pop("RANK", None), env.pop("LOCAL_RANK", None)
    out = subprocess.run([sys.executable, str(prog)], env=env, capture_output=True, text=True,
                         timeout=120, cwd=d)
    assert out.returncode == 0, out.stderr
    ptr = json.loads(out.stdout.strip().splitlines()[-1])
    files = list((d / "traces").iterdir())
    assert len(files) == 1, files
    header, events = _events(files[0])
    steps: dict[int, list] = {}
    cur = None
    for ev in events:
        if ev["ev"] == "step":
            cur = ev["n"]
            steps[cur] = []
        elif cur is not None:
            steps[cur].append(ev)
    return header, events, steps, ptr


def kinds(evs, kind):
    return [e for e in evs if e["ev"] == kind]


def test_header_names_a_process_without_rank(run):
    header, _, _, _ = run
    assert header["hazsan"] == 1 and header["device"] == "cpu"
    assert header["rank"] == -header["pid"]


def test_one_alloc_per_storage_and_free_at_last_view(run):
    _, _, steps, ptr = run
    allocs = kinds(steps[1], "alloc")
    assert len(allocs) == 1, allocs          # view, slice and add_ create no storage
    a = allocs[0]
    assert (a["addr"], a["size"], a["op"]) == (ptr["a"], 4000, "aten.ones.default")
    assert a["shape"] == [1000] and a["dtype"] == "float32" and a["stream"] == "cpu"
    assert a["site"].startswith("prog.py:") and a["site"].endswith(":<module>")
    assert not kinds(steps[1], "free") and not kinds(steps[2], "free")
    assert [e["id"] for e in kinds(steps[3], "free")] == [a["id"]]


def test_autograd_saved_tensor_freed_after_backward(run):
    _, _, steps, ptr = run
    exp = [e for e in kinds(steps[4], "alloc") if e["addr"] == ptr["h"]]
    assert len(exp) == 1 and exp[0]["op"] == "aten.exp.default"
    assert exp[0]["id"] not in [e["id"] for e in kinds(steps[4], "free")]   # del h: still saved
    assert exp[0]["id"] in [e["id"] for e in kinds(steps[5], "free")]       # backward released it


def test_module_buffers_allocated_and_freed_with_module(run):
    _, _, steps, ptr = run
    allocs = kinds(steps[6], "alloc")
    mean = [e for e in allocs if e["addr"] == ptr["running_mean"]]
    assert len(mean) == 1 and mean[0]["size"] == 64 * 4
    assert len(allocs) >= 5                                  # weight, bias, mean, var, count
    freed = {e["id"] for e in kinds(steps[7], "free")}
    assert {e["id"] for e in allocs} <= freed


def test_thread_started_later_runs_under_the_mode(run):
    _, _, steps, ptr = run
    z = [e for e in kinds(steps[8], "alloc") if e["addr"] == ptr["thread"]]
    assert len(z) == 1 and z[0]["op"] == "aten.zeros.default"    # seen as an op, not adopted later


def test_numpy_memory_and_resize(run):
    _, _, steps, ptr = run
    # torch.from_numpy is a storage over the array's memory, made not resizable
    # (torch/csrc/utils/tensor_numpy.cpp, at::from_blob): not an allocation, no alloc and no free
    # (docs/capture-details.md, "Storages that are not allocations")
    assert not [e for e in kinds(steps[9], "alloc") if e["addr"] <= ptr["numpy"] < e["addr"] + e["size"]]
    assert not kinds(steps[9], "free")
    allocs = kinds(steps[10], "alloc")
    assert [e["size"] for e in allocs] == [40, 40000]
    assert allocs[1]["addr"] == ptr["resized"]
    assert [e["id"] for e in kinds(steps[10], "free")] == [allocs[0]["id"]]


def test_unseen_storage_is_adopted_when_used(run):
    _, _, steps, ptr = run
    allocs = kinds(steps[11], "alloc")
    assert allocs[0]["addr"] == ptr["hidden"] and allocs[0]["op"] == "adopted"
    assert allocs[1]["op"] == "aten.add.Tensor"


def test_symmetric_scope_places_blocks_in_modelled_window(run):
    _, events, steps, _ = run
    evs = steps[12]
    windows = kinds(events, "window")
    assert len(windows) == 1 and windows[0]["comm"] == "tp" and windows[0]["addr"] == WINDOW_BASE
    w_lo, w_hi = windows[0]["addr"], windows[0]["addr"] + windows[0]["size"]
    scope = kinds(evs, "scope")
    assert [(e["enter"], e["pool"], e["comm"]) for e in scope] == [
        (True, "symm", "tp"), (False, "symm", "tp"), (True, "symm", "tp"), (False, "symm", "tp")]
    order = [e["ev"] for e in evs]
    assert order.index("window") < order.index("alloc")        # the window precedes its blocks
    allocs = kinds(evs, "alloc")
    inside = [e for e in allocs if w_lo <= e["addr"] < w_hi]
    s1, t1, s2 = inside                                         # s1, the transient, s2
    assert all(e["pool"] == "symm" and e["requested"] == 4000 and e["size"] == 4096 for e in inside)
    assert (s1["addr"] - w_lo, t1["addr"] - w_lo) == (0, 4096)  # caching-allocator placement
    assert s2["addr"] == s1["addr"]                              # s1's cached block is reused
    outside = [e for e in allocs if not w_lo <= e["addr"] < w_hi]
    assert len(outside) == 1 and outside[0]["pool"] == "default" and outside[0]["addr"] < 1 << 48
    seg = kinds(evs, "segment")
    assert seg and seg[0]["pool"] == "symm" and seg[0]["addr"] == w_lo


def test_trace_is_clean_for_the_engine(run, tmp_path):
    """The whole single-process trace is valid input: no malformed lines, one finding class only."""
    from sanitizer.rules.driver import analyze
    _, events, _, _ = run
    p = tmp_path / "t.jsonl"
    with open(p, "w") as f:
        f.write(json.dumps(run[0]) + "\n")
        for e in events:
            f.write(json.dumps(e) + "\n")
    a = analyze([p])
    assert not a.errors
    # the transient made inside the scope is freed with no collective in flight nor issued while
    # it lived (the program runs none): no peer can write it, so it is no finding
    # (docs/hazard-model.md, "When a window transient is a hazard"); the program has no other hazard
    assert a.findings == []


def test_storage_adopted_inside_scope_keeps_its_real_address(run):
    _, events, steps, ptr = run
    (window,) = kinds(events, "window")
    old, new = kinds(steps[13], "alloc")
    assert (old["op"], old["addr"], old["pool"]) == ("adopted", ptr["old"], "default")
    assert new["op"] == "aten.add.Tensor" and new["pool"] == "symm"
    assert window["addr"] <= new["addr"] < window["addr"] + window["size"]


def test_full_stacks_innermost_first(tmp_path):
    code = textwrap.dedent("""
        import torch
        def inner():
            return torch.ones(3)
        def outer():
            return inner()
        x = outer()
    """)
    (tmp_path / "deep.py").write_text(code)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(tmp_path / "t"), HAZSAN_STACKS="full")
    out = subprocess.run([sys.executable, "deep.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (path,) = (tmp_path / "t").iterdir()
    _, events = _events(path)
    (a,) = [e for e in events if e["ev"] == "alloc" and e.get("shape") == [3]]
    assert [f.rsplit(":", 1)[1] for f in a["stack"]] == ["inner", "outer", "<module>"]
    assert a["site"] == a["stack"][0] == "deep.py:4:inner"
