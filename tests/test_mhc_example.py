"""The mHC decode example at small sizes: the stock combine really corrupts requests, the fixed one
does not, and both runs leave traces and outcomes that hazsan reads.

One spawned 2-rank world: the reference decode, then one run per variant (~20 s).
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from examples.mhc_decode.decode import RunConfig, Schedule  # noqa: E402
from examples.mhc_decode.model import ModelConfig  # noqa: E402
from examples.mhc_decode.sweep import main as sweep_main  # noqa: E402
from sanitizer.proof.outcomes import read_outcomes  # noqa: E402
from sanitizer.rules.driver import analyze  # noqa: E402
from sanitizer.trace.reader import open_trace  # noqa: E402

SMALL = ["--hidden", "512", "--layers", "1", "--batch", "4", "--steps", "4", "--request-steps", "2",
         "--vocab", "1024", "--ranks", "2"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mhc")
    assert sweep_main(["--depths", "1", "--out", str(root)] + SMALL) == 0
    return {v: root / f"{v}-d1" for v in ("stock", "fixed")}


def _outcomes(d):
    return read_outcomes(d / "outcomes.jsonl")


def _schedule(d):
    cfg = json.loads((d / "summary.json").read_text())["config"]
    cfg.pop("tokens")
    return Schedule(RunConfig(**{**cfg, "model": ModelConfig(**cfg["model"])}))


def test_fixed_variant_is_never_corrupted(runs):
    outs = _outcomes(runs["fixed"])
    assert len(outs) == len(_schedule(runs["fixed"]).requests) >= 4
    assert not any(o.corrupted for o in outs)
    assert all(o.extra["max_abs_err"] == 0.0 for o in outs)


def test_stock_variant_really_corrupts_requests(runs):
    outs = _outcomes(runs["stock"])
    sched = _schedule(runs["stock"])
    assert len(outs) == len(sched.requests)
    bad = [o for o in outs if o.corrupted]
    assert bad, "the stock combine's transients should land on the freed all-reduce input"
    summary = json.loads((runs["stock"] / "summary.json").read_text())
    assert summary["corrupted"] == len(bad)
    assert sum(summary["corrupted_request_steps_by_rank"].values()) > 0
    assert all(o.steps == sched.span(o.request) for o in outs)
    for o in bad:                                         # corruption is placed in the request's own steps
        assert o.extra["corrupted_steps"] and all(o.steps[0] <= n <= o.steps[1] for n in o.extra["corrupted_steps"])


@pytest.mark.parametrize("variant", ["stock", "fixed"])
def test_traces_parse_and_hold_window_scope_and_collectives(runs, variant):
    files = sorted(runs[variant].glob("rank*.jsonl"))
    sched = _schedule(runs[variant])
    assert [f.name for f in files] == ["rank0.jsonl", "rank1.jsonl"]
    for f in files:
        tf = open_trace(f)
        assert tf.header["world_size"] == 2
        kinds = {}
        for _, ev in tf.events():
            kinds.setdefault(ev["ev"], []).append(ev)
        assert len(kinds["window"]) == 1 and kinds["window"][0]["comm"] == "tp"
        assert kinds["scope"] and kinds["alloc"] and kinds["free"]
        # per step: 2 all-reduces (attention, MoE) on 1 layer + the logits all-gather
        running = [n for n, a in enumerate(sched.active) if a]
        assert [c["op"] for c in kinds["coll"][:3]] == ["all_reduce", "all_reduce", "all_gather"]
        assert len(kinds["coll"]) == 3 * len(running) == len(kinds["coll_done"])
        assert [s["n"] for s in kinds["step"]] == running
        assert [s["tokens"] for s in kinds["step"]] == [2 * len(sched.active[n]) for n in running]
        lo, hi = kinds["window"][0]["addr"], kinds["window"][0]["addr"] + kinds["window"][0]["size"]
        assert all(lo <= a["addr"] < hi for a in kinds["alloc"])


def test_findings_stock_vs_fixed(runs):
    stock = analyze([str(runs["stock"])])
    fixed = analyze([str(runs["fixed"])])
    assert stock.errors == [] and fixed.errors == []
    s_rules, f_rules = stock.summary["by_rule"], fixed.summary["by_rule"]
    assert s_rules.get("reuse-in-flight", 0) > 0 and s_rules.get("transient-in-window", 0) > 0
    assert f_rules.get("reuse-in-flight", 0) == 0 and f_rules.get("transient-in-window", 0) == 0
    assert "asymmetric-offset" not in s_rules and "asymmetric-offset" not in f_rules
    # the latent cause, the all-reduce input freed before its wait, is in both builds
    assert s_rules.get("free-in-flight", 0) > 0 and f_rules.get("free-in-flight", 0) > 0
    # every corrupted request is preceded by a realised collision in one of its steps
    hits = {f.step for f in stock.findings if f.rule == "reuse-in-flight"}
    for o in _outcomes(runs["stock"]):
        if o.corrupted:
            first, last = o.steps
            assert any(first <= s <= last for s in hits), o
