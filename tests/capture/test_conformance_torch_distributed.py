"""Conformance, fast subset: PyTorch's own distributed tests (the suite in the torch wheel, driven as
its test_distributed_spawn.py drives it: gloo, 2 spawned ranks per test) give the same outcomes
bare, under HAZSAN=1 HAZSAN_LEVEL=alloc and under HAZSAN_LEVEL=full, and capture finds nothing,
loses nothing and raises no hook error on them.

The whole suite is benchmarks/conformance.py (its figures: benchmarks/README.md); this runs that
script's functions on six tests that between them use all_reduce (async, waited), gather,
isend/irecv through batch_isend_irecv (P2POp), barrier, the object collectives (all_gather) and DDP
(its C++ reducer's all-reduces and the broadcast of the module state). The three modes run at the
same time: about 140 s of CPU, a bit over a minute of wall time on 2 idle cores.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
# `long` (make test-long; .ci/run runs it after make test): PyTorch's own distributed tests under capture at every level: about 2.5 minutes
pytestmark = [pytest.mark.long, pytest.mark.usefixtures("jsonl_capture")]

REPO = Path(__file__).resolve().parents[2]

SUBSET = [
    "test_all_reduce_sum_async",         # all_reduce with async_op=True, then wait
    "test_gather",                       # gather to each rank in turn
    "test_batch_isend_irecv_gloo",       # dist.P2POp(dist.isend/irecv) + batch_isend_irecv
    "test_barrier",                      # barrier, and a timed check around it
    "test_all_gather_object_default_pg", # object collectives: pickled sizes and data, all_gather
    "test_DistributedDataParallelCPU",   # DDP: broadcast of the module state, reducer all-reduces
    # DDP communication hooks: the hook's Future (and its .then child) goes to the C++ reducer,
    # which waits on it in C++ (false unordered-access / free-in-flight before capture polled it)
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
]

# Collective ops the subset's traces must hold between them, at each level (c10d op names as the
# dispatcher-level recording writes them). A capture that records nothing passes the outcome
# comparison trivially; this keeps the test honest.
EXPECTED_OPS = {"allreduce_", "allgather_", "broadcast_", "gather_", "send", "recv_", "barrier"}


def _load_conformance():
    spec = importlib.util.spec_from_file_location("hazsan_conformance",
                                                  REPO / "benchmarks" / "conformance.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    conf = _load_conformance()
    out = conf.run(node_ids=SUBSET, modes=conf.ALL_MODES, timeout=240, parallel_modes=True,
                   workdir=str(tmp_path_factory.mktemp("conformance")))
    return conf, out


def _logs(out) -> str:
    text = []
    for m, r in out["results"].items():
        try:
            text.append(f"--- {m}: {r['log']}\n" + Path(r["log"]).read_text()[-4000:])
        except OSError:
            pass
    return "\n".join(text)


def test_every_selected_test_ran_in_every_mode(run):
    conf, out = run
    for m, r in out["results"].items():
        missing = [n for n in SUBSET if n not in r["outcomes"]]
        assert not missing, f"[{m}] not run: {missing}\n{_logs(out)}"
    bare = out["results"]["bare"]["outcomes"]
    # the subset is meant to exercise collectives: most of it must run to completion bare
    passed = [n for n in SUBSET if bare[n] == "passed"]
    assert len(passed) >= len(SUBSET) // 2, f"bare outcomes {bare}\n{_logs(out)}"


def test_same_outcomes_bare_alloc_full(run):
    conf, out = run
    diffs = out["compare"]["diffs"]
    if diffs:
        detail = []
        for d in diffs:
            for m in out["results"]:
                msg = out["results"][m]["messages"].get(d["test"])
                if msg and d[m] != "skipped":
                    detail.append(f"--- {d['test']} [{m}] {d[m]}\n" + "\n".join(msg.splitlines()[-30:]))
        pytest.fail(f"outcomes differ between modes: {json.dumps(diffs, indent=1)}\n"
                    + "\n".join(detail))


@pytest.mark.parametrize("mode", ["alloc", "full"])
def test_capture_clean_and_whole(run, mode):
    conf, out = run
    p = out["compare"]["problems"][mode]
    assert not p["findings"], {n: out["results"][mode]["checks"][n]["findings"][:5]
                               for n in p["findings"]}
    assert not p["hook_errors"], p["hook_errors"]
    assert not p["dropped"], p["dropped"]
    assert not p["incomplete"], p["incomplete"]
    assert not p["unusable"], p["unusable"]
    assert not p["no_trace"], f"tests whose ranks left no trace: {p['no_trace']}"


@pytest.mark.parametrize("mode", ["alloc", "full"])
def test_capture_recorded_the_collectives(run, mode):
    conf, out = run
    r = out["results"][mode]
    ops = set()
    for n, c in r["checks"].items():
        for f in conf.trace_files(Path(c["dir"])):
            for ev in conf.trace_events(f):
                if ev.get("ev") == "coll":
                    ops.add(ev["op"].rsplit(".", 1)[-1])
    missing = EXPECTED_OPS - ops
    assert not missing, f"[{mode}] no coll recorded for {sorted(missing)}; recorded {sorted(ops)}"
    # each passed test that spawned ranks left one trace per rank
    for n, o in r["outcomes"].items():
        if o == "passed":
            assert r["checks"][n]["files"] >= 2, (n, r["checks"][n])


def test_harness_sees_a_difference():
    """The comparison is not vacuous: a changed outcome and a finding each fail the verdict."""
    conf = _load_conformance()
    results = {
        "bare": {"outcomes": {"t1": "passed", "t2": "skipped"}},
        "alloc": {"outcomes": {"t1": "failed", "t2": "skipped"},
                  "checks": {"t1": {"files": 2, "by_rule": {}, "hook_errors": 0, "dropped": 0,
                                    "incomplete": [], "rc": 0, "errors": []},
                             "t2": {"files": 2, "by_rule": {"unordered-access": 3},
                                    "hook_errors": 0, "dropped": 0, "incomplete": [], "rc": 1,
                                    "errors": []}}},
    }
    cmp = conf.compare(results)
    assert cmp["diffs"] == [{"test": "t1", "bare": "passed", "alloc": "failed"}]
    assert cmp["problems"]["alloc"]["findings"] == {"t2": {"unordered-access": 3}}
    assert conf.verdict(cmp) == 1
    results["alloc"]["outcomes"]["t1"] = "passed"
    results["alloc"]["checks"]["t2"]["by_rule"] = {}
    assert conf.verdict(conf.compare(results)) == 0


# PyTorch's own test files from its repository (not in the wheel; never committed here): opt-in,
# HAZSAN_UPSTREAM_TESTS=<dir> holding any of these files (and test_c10d_common.py, which
# test_c10d_gloo.py imports, when it is the whole upstream file). Each runs bare, at alloc and at
# full: identical outcomes, no finding, and the collectives of every passing test recorded.
UPSTREAM_FILES = ("test_c10d_gloo.py", "test_c10d_object_collectives.py", "test_redistribute.py")


def test_upstream_pytorch_tests_clean_and_recorded(tmp_path):
    import os
    where = os.environ.get("HAZSAN_UPSTREAM_TESTS")
    if not where:
        pytest.skip("HAZSAN_UPSTREAM_TESTS (a folder of PyTorch's upstream test files) is not set")
    files = [str(Path(where) / f) for f in UPSTREAM_FILES if (Path(where) / f).exists()]
    helpers = [str(p) for p in Path(where).glob("test_c10d_common.py")]
    if not files:
        pytest.skip(f"none of {UPSTREAM_FILES} in {where}")
    conf = _load_conformance()
    out = conf.run(modes=conf.ALL_MODES, timeout=600, upstream=files, helpers=helpers,
                   workdir=str(tmp_path), k=os.environ.get("HAZSAN_UPSTREAM_K"))
    bare = out["results"]["bare"]["outcomes"]
    assert bare, _logs(out)
    assert not out["compare"]["diffs"], out["compare"]["diffs"]
    for mode in ("alloc", "full"):
        p = out["compare"]["problems"][mode]
        passed = [n for n, o in out["results"][mode]["outcomes"].items() if o == "passed"]
        assert not {n: f for n, f in p["findings"].items() if n in passed}, (mode, p["findings"])
        assert not p["hook_errors"] and not p["unusable"], (mode, p)
        assert not p["no_collectives"], (mode, p["no_collectives"])
