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
         "--vocab", "1024", "--ranks", "2", "--warmup", "none"]
DEPTH = 3     # accept len reaches 4 here, so logscan's 2.0 threshold separates a corrupted verify


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mhc")
    assert sweep_main(["--depths", str(DEPTH), "--out", str(root)] + SMALL) == 0
    return {v: root / f"{v}-d{DEPTH}" for v in ("stock", "fixed")}


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
        assert [s["tokens"] for s in kinds["step"]] == [(DEPTH + 1) * len(sched.active[n]) for n in running]
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
    # the latent cause, the all-reduce input freed before its wait, is in the stock build; the
    # fixed one keeps its input until the wait: not one finding, so CI passes it
    assert s_rules.get("free-in-flight", 0) > 0 and f_rules == {}
    assert fixed.exit_code() == 0 and stock.exit_code() == 1
    # every corrupted request is preceded by a realised collision in one of its steps
    hits = {f.step for f in stock.findings if f.rule == "reuse-in-flight"}
    for o in _outcomes(runs["stock"]):
        if o.corrupted:
            first, last = o.steps
            assert any(first <= s <= last for s in hits), o


# ------------------------------------------------------------------ the seed's signature
def test_verify_accepts_the_longest_prefix_of_drafts_the_target_agrees_with():
    import torch

    from examples.mhc_decode.decode import verify
    vocab = 8
    inputs = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 0]])
    # target's greedy next token at each position: row 0 agrees with every draft, row 1 with the
    # first only, row 2 with none (position 0 says 1, the draft is 6)
    want = torch.tensor([[2, 3, 4, 7], [2, 5, 4, 7], [1, 7, 0, 2]])
    logits = torch.nn.functional.one_hot(want, vocab).float()
    greedy, accepted = verify(inputs, logits)
    assert greedy.tolist() == want.tolist()
    assert accepted.tolist() == [3, 1, 0]


def test_decode_log_lines_are_sglang_format_and_parse_in_logscan(tmp_path):
    from examples.mhc_decode.serverlog import DecodeLog
    from sanitizer.logscan.parse import DecodeLine, parse_line
    log = DecodeLog(str(tmp_path / "server.log"), depth=3, interval=2, capacity=1000, clock=iter(range(100)).__next__)
    log.step(4, [3, 3, 3, 2], 100)
    log.step(4, [0, 0, 1, 0], 120)          # interval 1: (11 + 4 + 1 + 4) / 8 = 2.5
    log.step(3, [0, 0, 0], 130)             # interval 2, flushed by close: 1.0
    log.close()
    lines = (tmp_path / "server.log").read_text().splitlines()
    assert len(lines) == 2 and all("] Decode batch, #running-req: " in x for x in lines)
    parsed = [parse_line(x) for x in lines]
    assert all(isinstance(p, DecodeLine) for p in parsed)
    assert [p.accept_len for p in parsed] == [2.5, 1.0]
    assert [p.running_req for p in parsed] == [4, 3]
    assert parsed[0].prefix == "TP0" and parsed[0].fields["#token"] == "120"
    assert parsed[0].number("accept rate") == 0.5          # 12 of 24 drafts
    assert parsed[0].number("token usage") == 0.12


@pytest.mark.parametrize("variant", ["stock", "fixed"])
def test_server_log_logscan_flags_stock_and_not_fixed(runs, variant):
    from sanitizer.logscan.scan import scan
    res = scan([str(runs[variant] / "server.log")])
    sched = _schedule(runs[variant])
    assert res.intervals == sum(1 for a in sched.active if a) and not res.unparsed
    summary = json.loads((runs[variant] / "summary.json").read_text())
    assert summary["server_log"]["flagged"] == len(res.flagged)
    if variant == "fixed":
        assert not res.flagged
        assert summary["accept_len"]["observed"] == summary["accept_len"]["reference"] > 2.0
    else:
        assert res.flagged, "the corrupted verify steps should drop accept len to 2.0 or below"
        # the corrupted verify rejects drafts the reference accepts: acceptance is lower
        assert summary["accept_len"]["observed"] < summary["accept_len"]["reference"]
        outs = _outcomes(runs[variant])
        assert sum(o.extra["accepted_drafts"] for o in outs) < sum(o.extra["reference_accepted_drafts"] for o in outs)


def test_placement_prediction_matches_the_real_runs(runs):
    from examples.mhc_decode.predict import predict
    for variant in ("stock", "fixed"):
        cfg = json.loads((runs[variant] / "summary.json").read_text())["config"]
        cfg.pop("tokens")
        run = RunConfig(**{**cfg, "model": ModelConfig(**cfg["model"])})
        pred = predict(run, 2, variant)
        real = {o.request for o in _outcomes(runs[variant]) if o.corrupted}
        assert pred.corrupted_requests == real
        hits = sorted({f.step for f in analyze([str(runs[variant])]).findings if f.rule == "reuse-in-flight"})
        assert pred.colliding_steps == hits
    assert pred.collisions == 0                     # fixed


def test_default_configuration_collides_at_exactly_one_depth():
    """DeepSeek-V4's hidden size; the placement model (checked against real runs above) says the
    stock build collides at one draft depth of 1 to 8 only, and the fixed build at none."""
    from examples.mhc_decode.predict import predict, predict_depths
    base = RunConfig()
    assert base.model.hidden == 7168 and base.model.streams == 4
    preds = predict_depths(base, 2, range(1, 9))
    colliding = [p.depth for p in preds if p.corrupted_requests]
    assert colliding == [base.depth] == [4]
    p = preds[3]
    assert 0 < len(p.corrupted_requests) < p.requests      # a rate, not everything
    from dataclasses import replace
    assert not predict(replace(base, depth=4), 2, "fixed").corrupted_requests
