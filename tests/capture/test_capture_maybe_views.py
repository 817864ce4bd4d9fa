"""A maybe-view op that copies is a read, on both capture paths (issue 54, class 4).

pytorch/pytorch#152534 ("AsyncCollectiveTensor doesn't trigger wait upon dtype cast"): where
autograd is off (`torch.inference_mode()`, a custom op's kernel), `x.to(dtype)` reaches the
dispatcher below autograd as one op, `aten::to.dtype`, whose schema in native_functions.yaml is

    to.dtype(Tensor(a) self, ScalarType dtype, bool non_blocking=False, bool copy=False,
             MemoryFormat? memory_format=None) -> Tensor(a)

`Tensor(a)` says the result MAY alias `self`: it does when nothing changes, and otherwise the
CompositeImplicitAutograd kernel copies (`_to_copy`, inside it). AsyncCollectiveTensor took the
annotation for a view and skipped its wait (torch's fix: `_is_view_op` no longer counts
CompositeImplicitAutograd ops, pytorch#133421). Capture did the same: it recorded the cast as a view,
no read, so a cast of an all-reduce's buffer before the wait was missed under inference mode and
flagged under no_grad (where autograd decomposes `to` and `_to_copy` is seen). Now both paths (the
dispatch mode, HAZSAN_NATIVE=0; the native recorder's op observer, HAZSAN_NATIVE=1) decide view or
copy from what the op returned: a result in a storage of its arguments is a view, any other a copy
that read them. The same holds for the class (`contiguous`, `reshape`, `to.device`, `type_as`), and
true views stay views.

Real gloo, 2 ranks on loopback, under `hazsan run` at level `full`:
  10/11  async all_reduce, `.to(bfloat16)` of its buffer before / after `wait()`, inference
         tensors, the race lost (rank 1 joins the all-reduce 0.5 s late: rank 0's cast reads its
         own, unreduced values)
  12/13  the same, the race won (a small all-reduce, the cast 0.5 s after it): flagged all the same
  20/21  a functional all-reduce in place on a tensor made with autograd on (not an inference
         tensor), cast under inference mode before / after `wait_tensor`
  22     step 20 under no_grad (flagged before the fix too)
  30/31  `t().contiguous()`, `t().reshape(-1)`, `type_as(float64)`, `to("cpu", float64)`: copies of
         a buffer under its all-reduce / after the wait
  40     true views of a buffer under its all-reduce (`to(float32)` of a float32, `view`, `reshape`
         and `contiguous` of a contiguous tensor, `type_as` of the same dtype): no launch at all
  50     funcol's AsyncCollectiveTensor cast under inference mode: torch waits (its fix), clean, and
         its `_c10d_functional._wrap_tensor_autograd` (a wrapper, not a collective) is no coverage gap
"""
from __future__ import annotations

import re
import textwrap

import pytest

from gloo_programs import by_op_step, run_under_hazsan

pytest.importorskip("torch")

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

PROGRAM = textwrap.dedent(r'''
    import json, sys, time
    import torch.multiprocessing as mp

    def worker(rank, ws, init, out):
        import torch, torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        import sanitizer
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ws)
        group = dist.group.WORLD
        res = {}

        # 10-13: pytorch#152534's cast of an in-flight buffer, the race lost (slow) and won (fast)
        for step, fixed, slow in ((10, False, True), (11, True, True), (12, False, False), (13, True, False)):
            sanitizer.step(step)
            with torch.inference_mode():
                x = torch.full((1 << 18,) if slow else (256,), float(rank + 1))
                if slow and rank == 1:
                    time.sleep(0.5)                       # rank 0's all-reduce waits for rank 1
                w = dist.all_reduce(x, async_op=True)
                if fixed:
                    w.wait()
                elif not slow:
                    time.sleep(0.5)                       # long done, but nothing says so
                y = x.to(torch.bfloat16)                  # CAST-A
                if not fixed:
                    w.wait()
            res[f"cast_{step}"] = float(y[0])
            del x, y, w
            dist.barrier()

        # 20-22: a functional all-reduce in place on a tensor made with autograd on (no inference
        # tensor), cast before its wait
        for step, fixed, ctx in ((20, False, torch.inference_mode), (21, True, torch.inference_mode),
                                 (22, False, torch.no_grad)):
            sanitizer.step(step)
            grad = torch.full((4096,), float(rank + 1))
            with ctx():
                torch.ops._c10d_functional.all_reduce_(grad, "sum", group.group_name)
                if fixed:
                    torch.ops._c10d_functional.wait_tensor(grad)
                half = grad.to(torch.float16)             # CAST-B
                if not fixed:
                    torch.ops._c10d_functional.wait_tensor(grad)
            res[f"func_{step}"] = float(half[0])
            del grad, half
            dist.barrier()

        # 30/31: the other maybe-alias ops, each copying here
        for step, fixed in ((30, False), (31, True)):
            sanitizer.step(step)
            with torch.inference_mode():
                kv = torch.full((64, 64), float(rank + 1))
                kv[0, 1] = 0.5
                other = torch.zeros(1, dtype=torch.float64)
                w = dist.all_reduce(kv, async_op=True)
                if fixed:
                    w.wait()
                a = kv.t().contiguous()                   # COPY-contiguous
                b = kv.t().reshape(-1)                    # COPY-reshape
                c = kv.type_as(other)                     # COPY-type_as
                d = kv.to("cpu", torch.float64)           # COPY-to.device
                if not fixed:
                    w.wait()
                res[f"copies_{step}"] = [float(a[1, 0]), float(b[64]), float(c[0, 1]), float(d.sum()),
                                         any(t.untyped_storage().data_ptr() == kv.untyped_storage().data_ptr()
                                             for t in (a, b, c, d))]
            del kv, other, w, a, b, c, d
            dist.barrier()

        # 40: true views under the all-reduce: no read, no write (a tensor made with autograd on)
        sanitizer.step(40)
        buf = torch.full((64, 64), float(rank + 1))
        with torch.inference_mode():
            same = torch.zeros(1)
            w = dist.all_reduce(buf, async_op=True)
            v1 = buf.to(torch.float32)                    # VIEW-to
            v2 = buf.view(-1)                             # VIEW-view
            v3 = buf.reshape(-1)                          # VIEW-reshape
            v4 = buf.contiguous()                         # VIEW-contiguous
            v5 = buf.type_as(same)                        # VIEW-type_as
            w.wait()
        res["views_40"] = [v.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                           for v in (v1, v2, v3, v4, v5)] + [float(v3[0])]
        del buf, same, w, v1, v2, v3, v4, v5
        dist.barrier()

        # 50: funcol's AsyncCollectiveTensor: torch waits before the cast (pytorch#133421)
        sanitizer.step(50)
        with torch.inference_mode():
            act = funcol.all_reduce(torch.full((4096,), float(rank + 1)), "sum", group)
            h = act.to(torch.float16)                     # CAST-ACT
        res["act_50"] = [type(act).__name__, float(h[0])]
        del act, h

        sanitizer.step(190)
        dist.barrier()
        json.dump(res, open(f"{out}/res{rank}.json", "w"))
        dist.destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(worker, args=(2, sys.argv[1], sys.argv[2]), nprocs=2)
''')


def _line(marker: str) -> str:
    """The site (`prog.py:<line>:worker`) of the program line that carries `# <marker>`."""
    (n,) = [i for i, text in enumerate(PROGRAM.splitlines(), 1) if re.search(rf"# {re.escape(marker)}\b", text)]
    return f"prog.py:{n}:worker"


COPIES = ("COPY-contiguous", "COPY-reshape", "COPY-type_as", "COPY-to.device")
VIEWS = ("VIEW-to", "VIEW-view", "VIEW-reshape", "VIEW-contiguous", "VIEW-type_as")
# each bug step, the lines flagged there
BUGS = {10: ("CAST-A",), 12: ("CAST-A",), 20: ("CAST-B",), 22: ("CAST-B",), 30: COPIES}
CLEAN = (11, 13, 21, 31, 40, 50, 190)


@pytest.fixture(scope="module", params=["full", "full-native"])
def run(request, tmp_path_factory):
    """The program at level full, recorded by the dispatch mode (`full`) or the native recorder."""
    return request.param, run_under_hazsan(tmp_path_factory.mktemp(request.param), request.param, PROGRAM)[:4]


def test_the_program_computed_what_it_should(run):
    """Capture changes nothing computed; the two timings are what the steps say they are."""
    _, (_, _, res, _) = run
    for r in res:
        assert r["cast_11"] == r["cast_13"] == r["func_21"] == 3.0
        assert r["copies_31"] == [1.0, 1.0, 1.0, 64 * 64 * 3.0 - 2.0, False]
        assert r["views_40"] == [True] * 5 + [3.0]
        assert r["act_50"] == ["AsyncCollectiveTensor", 3.0]
        assert r["cast_12"] == 3.0                # the race won: the bug step computed the sum
    assert res[0]["cast_10"] == 1.0               # the race lost: rank 0 cast its own values


def test_a_cast_or_copy_before_the_wait_is_flagged_at_its_line(run):
    """Each maybe-alias op that copied a buffer its collective still writes is an
    unordered-access at the op's line, on both ranks, whatever the timing and the grad mode."""
    level, (rc, report, _, _) = run
    assert rc == 1, report["summary"]["by_rule"]
    found = by_op_step(report)
    for step, markers in BUGS.items():
        got = {(f["rule"], f.get("site"), f["rank"]) for f in found.get(step, [])}
        for marker in markers:
            for rank in (0, 1):
                assert ("unordered-access", _line(marker), rank) in got, (level, step, marker, rank, sorted(got))


def test_the_fixed_steps_and_true_views_are_clean_and_the_capture_complete(run):
    level, (_, report, _, _) = run
    found = by_op_step(report)
    for step in CLEAN:
        assert not found.get(step), (level, step, found.get(step)[:3])
    s = report["summary"]
    assert s["hook_errors"] == 0 and s["complete"], s
    # `_c10d_functional._wrap_tensor_autograd` wraps a tensor in an AsyncCollectiveTensor: it is
    # not a collective capture failed to record (it was counted as one on every funcol call)
    assert not [w for w in s.get("warnings", []) if "coverage" in w], s.get("warnings")


def _launches_at(events, steps):
    step, out = None, []
    for ev in events:
        if ev["ev"] == "step":
            step = ev["n"]
        elif ev["ev"] == "launch" and step in steps:
            out.append(ev)
    return out


def test_a_copy_is_one_launch_reading_the_source_and_a_view_none(run):
    """In the trace: the cast is one `aten.to.dtype` launch that reads the whole all-reduced buffer
    and writes its new storage (the same op on both paths, inference tensor or not); a true view
    launches nothing; and no header counts an unrecorded collective."""
    level, (_, _, _, events) = run
    for r in (0, 1):
        for step, size in ((10, 4 << 18), (13, 4 * 256), (20, 4 * 4096), (21, 4 * 4096)):
            site = _line("CAST-A" if step < 20 else "CAST-B")
            (cast,) = [e for e in _launches_at(events[r], {step}) if e.get("site") == site]
            assert cast["op"] == "aten.to.dtype", (level, step, cast)
            assert [s for _, s in cast["reads"]] == [size] and [s for _, s in cast["writes"]] == [size // 2]
            assert cast["reads"][0][0] != cast["writes"][0][0]
        (cast,) = [e for e in _launches_at(events[r], {22}) if e.get("site") == _line("CAST-B")]
        assert cast["op"] == "aten._to_copy.default"          # no_grad: decomposed above both recorders
        views = {_line(m) for m in VIEWS}
        assert not [e for e in _launches_at(events[r], {40}) if e.get("site") in views], level
        copies = [e for e in _launches_at(events[r], {30, 31}) if e.get("site") in {_line(m) for m in COPIES}]
        assert sorted(e["op"] for e in copies) == sorted(2 * ["aten.contiguous.default", "aten.reshape.default",
                                                              "aten.type_as.default", "aten.to.device"]), copies
        assert all(e["reads"] and e["writes"] for e in copies)
