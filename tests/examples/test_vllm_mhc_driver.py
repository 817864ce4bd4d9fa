"""The vLLM reference case's driver (examples/vllm_mhc/run.py), without vLLM: the attribution of a
corrupted token to the model step that produced it, and the model's prompts (the greedy
continuation must be what the ngram proposer can draft)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run():
    spec = importlib.util.spec_from_file_location("vllm_mhc_run", ROOT / "examples" / "vllm_mhc" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _schedule(tmp_path: Path, steps: list[dict]) -> None:
    with open(tmp_path / "schedule.ndjson", "w") as f:
        for n, reqs in enumerate(steps):
            f.write(json.dumps({"step": n, "reqs": reqs}) + "\n")


def test_first_wrong_token_is_attributed_to_the_step_that_produced_it(run, tmp_path):
    # request 0: prompt of 5 tokens, computed in step 0 (positions 0-4, samples position 5);
    # step 1 verifies 1 + 2 drafts (positions 5-7): all accepted -> tokens at 6, 7, 8;
    # step 2 verifies positions 8-10, one draft rejected -> tokens at 9, 10;
    # step 3 verifies positions 10-12 again (the rejected draft recomputed).
    _schedule(tmp_path, [
        {"0-aa": [0, 5], "1-bb": [0, 4]},
        {"0-aa": [5, 3], "1-bb": [4, 1]},
        {"0-aa": [8, 3], "1-bb": [5, 1]},
        {"0-aa": [10, 3]},
    ])
    reference = {"0": [10, 11, 12, 13, 14, 15, 16], "1": [20, 21, 22]}
    result = {"requests": [
        # first wrong token k=5 -> position 5 + 5 = 10, produced from position 9: steps 2 (8-10)
        # and 3 (10-12) ... only step 2 holds 9
        {"id": "0", "prompt": 5, "tokens": [10, 11, 12, 13, 14, 99, 16]},
        {"id": "1", "prompt": 4, "tokens": [20, 21, 22]},
    ]}
    rows = run.write_outcomes(tmp_path, reference, result)
    assert rows[0]["corrupted"] and rows[0]["first_wrong_token"] == 5 and rows[0]["step"] == 2
    assert rows[0]["first_step"] == 0
    assert not rows[1]["corrupted"] and rows[1]["step"] == 2       # clean: its last step
    # the outcome file is what hazsan compare reads
    from sanitizer.proof.outcomes import read_outcomes
    got = read_outcomes(tmp_path / "outcomes.jsonl")
    assert [(o.request, o.step, o.corrupted) for o in got] == [(0, 2, True), (1, 2, False)]


def test_a_later_recompute_wins_over_the_rejected_draft(run, tmp_path):
    # position 10's token: step 2 computed 8-10 (holding 9) ... a wrong token at position 11
    # comes from position 10, which steps 2 (8-10) and 3 (10-12) both computed: the later one.
    _schedule(tmp_path, [{"0-aa": [0, 5]}, {"0-aa": [5, 3]}, {"0-aa": [8, 3]}, {"0-aa": [10, 3]}])
    rows = run.write_outcomes(tmp_path, {"0": [1, 2, 3, 4, 5, 6, 7]},
                              {"requests": [{"id": "0", "prompt": 5, "tokens": [1, 2, 3, 4, 5, 6, 0]}]})
    assert rows[0]["first_wrong_token"] == 6 and rows[0]["step"] == 3


def test_a_shorter_output_is_corrupted_at_its_end(run, tmp_path):
    _schedule(tmp_path, [{"0-aa": [0, 3]}, {"0-aa": [3, 2]}])
    rows = run.write_outcomes(tmp_path, {"0": [1, 2, 3]}, {"requests": [{"id": "0", "prompt": 3, "tokens": [1, 2]}]})
    assert rows[0]["corrupted"] and rows[0]["first_wrong_token"] == 2


def test_prompts_walk_the_successor_cycles(run):
    torch = pytest.importorskip("torch")
    del torch
    succ = run.successor_table().tolist()
    assert sorted(succ) == list(range(run.MODEL["vocab_size"]))           # a permutation
    for prompt, max_tokens in run.prompts():
        assert all(succ[a] == b for a, b in zip(prompt, prompt[1:]))      # the greedy walk itself
        # the continuation repeats the prompt's cycle, so ngram lookup drafts it
        assert len(prompt) > 2 * run.MODEL["cycle"] and max_tokens >= 16
    lengths = {len(p) for p, _ in run.prompts()}
    assert len(lengths) > 1            # prompts of several lengths
    assert len(run.prompts()) > run.MAX_SEQS   # more requests than batch slots: later ones join


def test_base_id(run):
    assert run.base_id("17-a1b2c3d4") == "17" and run.base_id("3") == "3"


# ---- the plugin's testbed endpoint (what vLLM's GroupCoordinator calls), on a real 2-rank testbed
def _endpoint_worker(rank, files, plugin_dir):
    import sys
    import torch
    sys.path.insert(0, plugin_dir)
    from hazsan_vllm_mhc.testbed_comm import TestbedTP
    from sanitizer.testbed import SymmetricCommunicator
    out = {}
    with SymmetricCommunicator(files, rank, read_delay=0.2) as comm:
        tb = TestbedTP(comm, files, is_owner=False)
        x = torch.full((4, 8), float(rank + 1))                 # not a window tensor: staged
        out["sum"] = tb.all_reduce(x).tolist()
        g = tb.all_gather(torch.full((2, 3), float(rank)), dim=-1)
        out["gather"] = g.tolist()
        with tb.scope():
            part = torch.full((4, 8), float(10 * (rank + 1)))
            into = torch.empty((4, 8))
        with tb.overlap(into=into):
            y = tb.all_reduce(part)
            out["in_flight_inside"] = comm.completed < comm.enqueued   # deferred, not waited
            out["same_buffer"] = y.data_ptr() == into.data_ptr()
        out["done_after"] = comm.completed == comm.enqueued
        out["overlap_sum"] = float(y[0, 0])
    return out


def test_the_plugin_endpoint_reduces_gathers_and_defers_inside_overlap():
    pytest.importorskip("torch")
    from sanitizer.testbed import spawn
    plugin = str(ROOT / "examples" / "vllm_mhc")
    res = spawn(_endpoint_worker, 2, args=(plugin,), window_bytes=8 << 20, timeout=120)
    for r in res:
        assert r["sum"] == [[3.0] * 8] * 4                       # 1 + 2
        # vLLM's all_gather semantics: concatenation along dim (CpuCommunicator.all_gather)
        assert r["gather"] == [[0.0, 0.0, 0.0, 1.0, 1.0, 1.0]] * 2
        assert r["in_flight_inside"] and r["done_after"]
        assert r["same_buffer"] and r["overlap_sum"] == 30.0


# ---- logscan on a real vLLM engine's log (not the loggers alone): reports/vllm-mhc's depth 6 runs
DATA = ROOT / "tests" / "data"


def test_logscan_on_a_real_vllm_engine_log_flags_stock_not_fixed():
    """The stats and SpecDecoding lines of vLLM 0.32's engine in the stock and fixed runs at depth
    6 (`make vllm-proof`; lines of loggers.py and metrics.py kept, nothing edited): with the
    report's criterion (half the clean accept length 7, half the 16 slots running) the stock log
    has the signature and the fixed one not."""
    from sanitizer.logscan import scan
    stock = scan([str(DATA / "vllm-0.32-engine-mhc-stock-d6.log")], threshold=3.5, min_running=8)
    fixed = scan([str(DATA / "vllm-0.32-engine-mhc-fixed-d6.log")], threshold=3.5, min_running=8)
    assert stock.format == fixed.format == "vllm"
    assert stock.unparsed_count == fixed.unparsed_count == 0
    assert [round(r.accept_len, 2) for r in stock.records][:2] == [1.75, 1.62]
    assert all(r.running_req == 16 for r in stock.records[:2])        # paired with the stats line
    assert len(stock.flagged) == 3 and stock.exit_code() == 1
    assert not fixed.flagged and fixed.exit_code() == 0
    assert {round(r.accept_len, 2) for r in fixed.records} == {7.0}    # every draft accepted
