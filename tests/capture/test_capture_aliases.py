"""Storages that are not allocations (issue 50, item 3; docs/capture-details.md, "Storages that are
not allocations"), captured by both allocation paths (the native recorder and the dispatch mode,
HAZSAN_NATIVE=0), at level full.

SGLang's breakable prefill graphs `weak_ref_tensor` their intermediates
(sglang/srt/model_executor/runner_backend_utils/weak_ref_tensor.py: `from sgl_kernel import
weak_ref_tensor`). sgl-kernel registers it as `weak_ref_tensor(Tensor tensor) -> Tensor`
(sgl-kernel/csrc/common_extension.cc) and implements it as
`at::from_blob(tensor.data_ptr(), sizes, strides, options)` (sgl-kernel/csrc/memory/weak_ref_tensor.cpp):
a new StorageImpl over bytes another block owns, which holds no reference to that block. The CPU
programs below make the same kind of storage with torch's own entry points: `torch.from_dlpack`
over a tensor (at::fromDLPack: from_blob with the DLPack deleter), `torch.frombuffer` over a ctypes
array at a tensor's data_ptr (from_blob without an owner, as weak_ref_tensor), `torch.as_tensor` of
a numpy view of a tensor's memory (torch.from_numpy: from_blob over the array). The weak_ref_tensor
op itself is the program's own op with sgl-kernel's schema and that body (frombuffer at the
data_ptr): the kernel is CUDA-only in sgl-kernel.

Before: each alias was recorded as an `alloc` (adopted, or a fresh result of the op) over its
owner's live bytes, and a `free` when it died; the op's result was a write launch. Now: no alloc,
no free; the alias's accesses are its owner's trace addresses (the modelled window address for an
owner allocated in a symmetric scope); the op launches nothing; a real hazard through an alias (a
write before the wait of an all-reduce on its owner) is still found.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gloo_programs import require_native

pytest.importorskip("torch")
pytest.importorskip("numpy")
pytestmark = pytest.mark.usefixtures("jsonl_capture")

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent(r'''
    import ctypes, json, os, sys
    import numpy as np
    import torch, torch.distributed as dist
    import sanitizer

    HAZARD = sys.argv[1] == "hazard"
    dist.init_process_group("gloo", init_method="file://" + os.path.abspath("store"), rank=0, world_size=1)

    def from_blob(t):
        """A storage over t's bytes holding no reference to t: torch::from_blob's shape."""
        raw = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
        return torch.frombuffer(raw, dtype=t.dtype).view(t.shape)

    lib = torch.library.Library("hz_alias", "DEF")
    lib.define("weak_ref_tensor(Tensor tensor) -> Tensor")     # sgl-kernel's schema
    lib.impl("weak_ref_tensor", from_blob, "CPU")

    ptr = {}
    sanitizer.step(1)
    a = torch.zeros(64)
    ptr["a"] = a.data_ptr()
    work = dist.all_reduce(a, async_op=True)
    if HAZARD:
        torch.from_dlpack(a[16:]).add_(1.0)                    # written before the wait: the hazard
    work.wait()
    d = torch.from_dlpack(a[16:])                              # 64 bytes in
    d.add_(1.0)
    f = from_blob(a[8:])                                       # 32 bytes in
    g = f * 2
    n = torch.as_tensor(a.numpy()[4:])                         # 16 bytes in
    n.mul_(3.0)
    ptr["aliases"] = [d.data_ptr(), f.data_ptr(), n.data_ptr()]
    del d, f, n
    sanitizer.step(2)
    x = torch.ones(32) * 3
    y = torch.ops.hz_alias.weak_ref_tensor(x)                  # launches nothing: a view of x
    z = y + 1
    ptr["x"], ptr["y"] = x.data_ptr(), y.data_ptr()
    del y
    sanitizer.step(3)
    with sanitizer.symmetric_scope("tp"):                      # w placed in the modelled window
        w = torch.empty(64)
    wa = torch.from_dlpack(w[8:])
    wa.fill_(2.0)                                              # at w's modelled address, 32 bytes in
    dist.all_reduce(wa)                                        # the collective names w's bytes too
    ptr["w"], ptr["wa"] = w.data_ptr(), wa.data_ptr()
    del wa
    sanitizer.step(4)
    foreign = bytearray(64)
    e = torch.frombuffer(foreign, dtype=torch.float32)         # memory no allocator made
    e.add_(1.0)
    ptr["foreign"] = e.data_ptr()
    del e
    sanitizer.step(5)
    dist.destroy_process_group()
    json.dump(ptr, open("ptr.json", "w"))
''')


def _run(tmp_path, path, variant):
    d = tmp_path / f"{path}-{variant}"
    d.mkdir()
    (d / "prog.py").write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN") or k == "HAZSAN_NATIVE_CACHE"}
    env.update(HAZSAN="1", HAZSAN_DIR=str(d / "t"), HAZSAN_NATIVE="1" if path == "native" else "0",
               HAZSAN_LEVEL="full", HAZSAN_RAISE="1", HAZSAN_TRACE_FORMAT="jsonl", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "prog.py", variant], cwd=d, env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-4000:]
    ((trace),) = (d / "t").glob("*.jsonl")
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    report = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(d / "t"), "--format", "json"],
                            capture_output=True, text=True, timeout=120)
    return lines[0], lines[1:], json.loads((d / "ptr.json").read_text()), json.loads(report.stdout)


@pytest.mark.parametrize("path", ["native", "dispatch"])
def test_aliases_are_not_allocations_and_read_their_owners_bytes(tmp_path, path):
    if path == "native":
        require_native()
    header, events, ptr, report = _run(tmp_path, path, "clean")
    assert header["hooks"]["alloc"]["source"] == ("native" if path == "native" else "dispatch-mode")
    assert not [e for e in events if e["ev"] == "hook_error"]
    allocs = {e["id"]: e for e in events if e["ev"] == "alloc"}
    # no alloc at an alias's bytes: only the owners' own (a, x, w's window block), and nothing adopted
    for name in ("a", "x"):
        assert [e["addr"] for e in allocs.values() if e["addr"] <= ptr[name] < e["addr"] + e["size"]] == [ptr[name]]
    for p in ptr["aliases"] + [ptr["y"], ptr["wa"], ptr["foreign"]]:
        assert not [e for e in allocs.values() if e["addr"] <= p < e["addr"] + e["size"] and e["addr"] != ptr["a"]
                    and e["addr"] != ptr["x"]], p
    assert not [e for e in allocs.values() if e.get("op") == "adopted"]
    # and so no free that is not an alloc's
    assert {e["id"] for e in events if e["ev"] == "free"} <= set(allocs)

    launches = [e for e in events if e["ev"] == "launch"]
    writes = [tuple(r) for e in launches for r in e.get("writes") or []]
    reads = [tuple(r) for e in launches for r in e.get("reads") or []]
    # through the aliases: a's bytes, at a's address (a plain block: its real one)
    assert (ptr["a"] + 64, 48 * 4) in writes           # d.add_
    assert (ptr["a"] + 32, 56 * 4) in reads            # f * 2
    assert (ptr["a"] + 16, 60 * 4) in writes           # n.mul_
    # the weak_ref_tensor op launches nothing; the read through its result is x's bytes
    assert not [e for e in launches if e["op"].startswith("hz_alias.")]
    assert ptr["y"] == ptr["x"] and (ptr["x"], 32 * 4) in reads
    # an alias of a block in the modelled window: that block's modelled address
    windows = [e for e in events if e["ev"] == "window"]
    (w_alloc,) = [e for e in allocs.values() if any(v["addr"] <= e["addr"] < v["addr"] + v["size"] for v in windows)]
    assert (w_alloc["addr"] + 32, 56 * 4) in writes    # wa.fill_
    (coll,) = [e for e in events if e["ev"] == "coll" and e["op"] == "c10d.allreduce_" and e["bufs"][0]["size"] == 56 * 4]
    assert coll["bufs"][0]["addr"] == w_alloc["addr"] + 32
    # memory no allocator made: where it is
    assert (ptr["foreign"], 64) in writes
    assert report["findings"] == [], report["findings"]
    assert report["summary"]["complete"] and report["summary"]["hook_errors"] == 0


@pytest.mark.parametrize("path", ["native", "dispatch"])
def test_a_write_through_an_alias_before_the_wait_is_still_found(tmp_path, path):
    if path == "native":
        require_native()
    _, events, ptr, report = _run(tmp_path, path, "hazard")
    found = [f for f in report["findings"] if f["rule"] == "unordered-access"]
    assert found, report["findings"]
    assert all(f["step"] == 1 for f in found)
    # the access is a's bytes: the all-reduce's buffer
    (coll,) = [e for e in events if e["ev"] == "coll" and e["op"] == "c10d.allreduce_" and e["bufs"][0]["size"] == 256]
    assert coll["bufs"][0]["addr"] == ptr["a"]
    assert (ptr["a"] + 64, 48 * 4) in [tuple(r) for e in events if e["ev"] == "launch" for r in e.get("writes") or []]
