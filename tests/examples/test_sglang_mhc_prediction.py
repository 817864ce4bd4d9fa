"""examples/sglang_mhc's prediction (predict.py) and how the report sets it beside the runs (report.py).

The expected schedule is checked against what SGLang 0.5.23 recorded in `make sglang-proof`'s fixed
runs (16 requests of 40 tokens: a 571-token prefill, then 11, 9, 8 and 6 verify steps at depths 3,
4, 5 and 8); the report must say where prediction and runs disagree, not only where they agree."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("tabulate")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "sglang_mhc"))
import predict  # noqa: E402
import report  # noqa: E402


def test_expected_schedule_is_sglang_s_recorded_one():
    assert [predict.verify_steps(d, 40) for d in (3, 4, 5, 8)] == [11, 9, 8, 6]
    assert predict.expected_schedule(571, 4, 16, 40) == [571] + [80] * 9


def _run(corrupted, reuse, pred_one, pred_own):
    def replay(hit, n):
        return {"colliding": hit, "schedule": [571] + [0] * (n - 1)}
    return {"corrupted": corrupted, "requests": 16, "findings": {"reuse-in-flight": reuse},
            "first_collision": None, "predicted_from_one": replay(*pred_one), "predicted": replay(*pred_own),
            "fixed_schedule_is_expected": True}


def test_report_names_agreement_and_disagreement():
    results = {"model": {"hidden_size": 7168, "hc_streams": 4}, "max_running_requests": 16, "output_tokens": 40,
               "depths": [3, 4, 8],
               "prediction": {"capture": "stock-d3", "template_step": 1, "prefill_tokens": 571,
                              "shapes": {"template_step": 1, "repeat": 4, "colliding": [76, 80, 144], "clean": [64]}},
               "runs": {"stock-d3": _run(0, 0, ([], 12), ([], 12)),
                        "stock-d4": _run(16, 104, ([1, 2, 3], 10), ([1, 2, 3], 10)),
                        # predicted clean, measured corrupted: a disagreement the report must name
                        "stock-d8": _run(5, 2, ([], 7), ([], 7))}}
    text = "\n".join(report.why_lines(results))
    assert "agrees with the runs at depth(s) 3, 4;" in text
    assert "DISAGREES at depth(s) 8" in text
    assert "| 1-3 of 10 " in text and "| none of 7 " in text
    # depth 8 collides held constant and was predicted clean after the prefill: that is explained
    # only where the run bears the prediction out, so not here (it corrupted)
    assert "collide when their verify shape is held constant" not in text
