"""`hazsan verify` against real SGLang 0.5.23 servers on loopback (`make test-sglang`, in .venv-sglang):
`python -m sglang.launch_server`, TP=2 over gloo on CPU, NGRAM speculative decoding, each started
by the test (tests/verify/sglang_server.py) and stopped after it.

* The mHC reference model of `make sglang-proof` (examples/sglang_mhc: the combine inside SGLang's
  own symmetric-memory scope over hazsan's testbed), stock, at draft depth 4, where the proof's
  batches corrupted every request (reports/sglang-mhc). Served by launch_server it collides at one
  request at a time too (its log: accept len 1.00 with #running-req 1, where the fixed build logs
  5.00), so the baseline is itself collapsed: by default verify says the load cannot show the
  signature (exit 2, naming --baseline-requests 0); with --baseline-requests 0, judged by the
  absolute signature alone, it is flagged (exit 1), within the duration.
* The same model fixed, at the same depth: clean, exit 0, with a baseline of 5 (the whole window).
* The tiny random Llama (examples/tiny_llama.py), a correct server whose acceptance on its first
  token-id prompts is low even one request at a time: never flagged (exit 0 or 2, not 1).

Skipped where SGLang cannot serve (`make test`'s venv has SGLang's wheel without its dependencies).
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

if any(importlib.util.find_spec(m) is None for m in ("sglang", "transformers", "uvicorn")):
    pytest.skip("SGLang with its dependencies not installed: `make test-sglang` runs this in .venv-sglang",
                allow_module_level=True)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
import sglang_server  # noqa: E402

DEPTH = 4  # a colliding depth of reports/sglang-mhc (stock corrupted 16 of 16 requests at 4, 5 and 6)
MAX_RUNNING = 16


def mhc_args(model: Path, depth: int) -> dict:
    """examples/sglang_mhc/proof.py's server arguments, with /metrics on."""
    sys.path.insert(0, str(ROOT / "examples" / "sglang_mhc"))
    from examples.sglang_mhc import proof
    args = proof.server_args(str(model), depth)
    args.update(enable_metrics=True, max_running_requests=MAX_RUNNING)
    return args


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("verify-sglang")


@pytest.fixture(scope="module")
def mhc_model(work) -> Path:
    from examples.vllm_mhc import run as vllm_mhc
    model = work / "mhc-model"
    vllm_mhc.make_checkpoint(model)
    return model


@pytest.fixture(scope="module")
def mhc_prompts(work) -> Path:
    """The proof's token-id prompts (each walks the model's successor cycle, which NGRAM drafts)."""
    from examples.vllm_mhc import run as vllm_mhc
    path = work / "mhc-prompts.jsonl"
    path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p, _ in vllm_mhc.prompts()[:MAX_RUNNING]))
    return path


def verify(base: str, log: Path, prompts: Path, out: Path, *extra: str) -> tuple[int, dict, float]:
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sanitizer", "verify", base, "--log", str(log), "--prompts", str(prompts),
                           "--format", "json", "--quiet", "--html", str(out / "verify.html"), *extra],
                          capture_output=True, text=True, timeout=400)
    took = time.monotonic() - t
    (out / "verify.json").write_text(proc.stdout)
    assert proc.stdout, proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout), took


MHC_LOAD = ("--concurrency", str(MAX_RUNNING), "--max-tokens", "40", "--duration", "120", "--min-running", "8")


def check_server_facts(doc):
    assert doc["server"]["speculative"] == "NGRAM" and doc["server"]["max_accept"] == DEPTH + 1
    assert doc["server"]["tp_size"] == 2
    assert doc["sources"] == {"request": True, "metrics": True, "log": True}  # every observer saw acceptance


def test_mhc_stock_at_a_colliding_depth(work, mhc_model, mhc_prompts):
    out = work / f"stock-d{DEPTH}"
    with sglang_server.launch(mhc_args(mhc_model, DEPTH), sglang_server.mhc_env("stock", out), out) as (base, log, _):
        code, doc, took = verify(base, log, mhc_prompts, out, *MHC_LOAD)
        print(f"stock-d{DEPTH}, default baseline: exit {code} in {took:.0f} s: {doc['text']}")
        assert code == 2 and doc["text"].startswith("the load cannot show the signature"), doc["text"]
        assert doc["baseline"] <= 2.0 and "--baseline-requests 0" in doc["text"]
        assert [p["phase"] for p in doc["phases"]] == ["baseline"] and took < 60  # no load after such a baseline
        code, doc, took = verify(base, log, mhc_prompts, out, *MHC_LOAD, "--baseline-requests", "0")
    print(f"stock-d{DEPTH}, --baseline-requests 0: exit {code} in {took:.0f} s: {doc['text']}")
    check_server_facts(doc)
    assert code == 1, doc["text"]
    assert doc["flagged"] >= 5 and doc["early_stop"] and took < 130
    assert all(s["accept_len"] <= 2.0 and s["running"] >= 8 for s in doc["flagged_samples"])


def test_mhc_fixed_at_a_colliding_depth(work, mhc_model, mhc_prompts):
    out = work / f"fixed-d{DEPTH}"
    with sglang_server.launch(mhc_args(mhc_model, DEPTH), sglang_server.mhc_env("fixed", out), out) as (base, log, _):
        code, doc, took = verify(base, log, mhc_prompts, out, *MHC_LOAD)
    print(f"fixed-d{DEPTH}: exit {code} in {took:.0f} s: {doc['text']}")
    check_server_facts(doc)
    assert code == 0, doc["text"]
    assert doc["baseline"] > 4.0 and doc["under_load"] >= 3 and doc["flagged"] == 0
    assert doc["elapsed_s"] < 180


def test_tiny_random_model_low_acceptance_not_flagged(work):
    sys.path.insert(0, str(ROOT / "examples"))
    import tiny_llama
    model = work / "tiny-llama"
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r}); "
                    f"from tiny_llama import make_model; make_model({str(model)!r}, tokenizer=True)"],
                   env=sglang_server.base_env(1), check=True, capture_output=True)
    prompts = work / "tiny-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in tiny_llama.prompts(8)))
    sys.path.insert(0, str(ROOT / "examples" / "sglang_e2e"))
    import run as sglang_e2e
    args = sglang_e2e.server_args(str(model), 2, True)
    args["enable_metrics"] = True
    out = work / "tiny"
    with sglang_server.launch(args, sglang_server.base_env(2), out) as (base, log, _):
        code, doc, took = verify(base, log, prompts, out, "--max-tokens", "48", "--duration", "40")
    print(f"tiny: exit {code} in {took:.0f} s: {doc['text']}")
    assert code != 1, doc["text"]
    assert doc["server"]["max_accept"] == sglang_e2e.DRAFT_TOKENS
