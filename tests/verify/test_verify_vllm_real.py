"""`hazsan verify` against real vLLM 0.32 CPU servers on loopback (`make test-e2e`, in .venv-e2e):
vLLM's OpenAI server, TP=2 (mp executor), eager, ngram speculative decoding, the mHC model of
examples/vllm_mhc (its vLLM plugin, installed by make test-e2e), stock and fixed, at draft depth 4
(reports/vllm-mhc: stock corrupted requests at depths 4 to 6, fixed none). vLLM's replies carry no
acceptance: verify reads it from /metrics (the spec_decode counters) and the log (VLLM_LOG_STATS_INTERVAL=1).

Skipped where vLLM or the plugin is not installed (`make test` has neither)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None or importlib.util.find_spec("hazsan_vllm_mhc") is None:
    pytest.skip("vLLM and the mHC plugin not installed: `make test-e2e` runs this in .venv-e2e",
                allow_module_level=True)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(ROOT))
import vllm_server  # noqa: E402
from examples.vllm_mhc import run as vllm_mhc  # noqa: E402

DEPTH = 4


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("verify-vllm")


@pytest.fixture(scope="module")
def model_and_prompts(work):
    model = work / "mhc-model"
    vllm_mhc.make_checkpoint(model)
    prompts = work / "mhc-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p, _ in vllm_mhc.prompts()[:vllm_mhc.MAX_SEQS]))
    return model, prompts


def serve(variant: str, work: Path, model: Path):
    out = work / f"{variant}-d{DEPTH}"
    out.mkdir(parents=True, exist_ok=True)
    args = ["--skip-tokenizer-init", "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
            "--enforce-eager", "--max-model-len", "256", "--dtype", "bfloat16", "--seed", "0",
            "--max-num-seqs", str(vllm_mhc.MAX_SEQS), "--max-num-batched-tokens", str(vllm_mhc.MAX_BATCHED),
            *vllm_server.spec_args(DEPTH)]
    env = vllm_server.env(work, HAZSAN_MHC_VARIANT=variant, HAZSAN_MHC_OUT=str(out))
    return out, vllm_server.launch(model, args, env, out)


def verify(base: str, log: Path, prompts: Path, out: Path, *extra: str) -> tuple[int, dict, float]:
    t = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sanitizer", "verify", base, "--log", str(log), "--prompts", str(prompts),
                           "--format", "json", "--quiet", "--html", str(out / "verify.html"), "--concurrency",
                           str(vllm_mhc.MAX_SEQS), "--max-tokens", "40", "--duration", "120", "--min-running", "8",
                           "--poll", "1", *extra], capture_output=True, text=True, timeout=400)
    (out / "verify.json").write_text(proc.stdout)
    assert proc.stdout, proc.stderr[-3000:]
    return proc.returncode, json.loads(proc.stdout), time.monotonic() - t


def check_facts(doc):
    s = doc["server"]
    assert (s["engine"], s["max_accept"]) == ("vllm", DEPTH + 1)  # k from /metrics' per-position counters
    assert doc["sources"]["metrics"] and doc["sources"]["log"] and not doc["sources"]["request"]


def test_vllm_mhc_stock_flagged(work, model_and_prompts):
    model, prompts = model_and_prompts
    out, server = serve("stock", work, model)
    with server as (base, log, _):
        code, doc, took = verify(base, log, prompts, out, "--baseline-requests", "0")
    print(f"vllm stock-d{DEPTH}: exit {code} in {took:.0f} s: {doc['text']}; flagged: {doc['flagged_samples'][:5]}")
    check_facts(doc)
    assert code == 1, doc["text"]
    assert doc["elapsed_s"] < 180


def test_vllm_mhc_fixed_clean(work, model_and_prompts):
    model, prompts = model_and_prompts
    out, server = serve("fixed", work, model)
    with server as (base, log, _):
        code, doc, took = verify(base, log, prompts, out)
    print(f"vllm fixed-d{DEPTH}: exit {code} in {took:.0f} s: {doc['text']} (baseline {doc['baseline']})")
    check_facts(doc)
    assert code == 0, doc["text"]
    assert doc["elapsed_s"] < 180


def test_vllm_tiny_random_model_not_flagged(work):
    """A correct server whose acceptance is low (the tiny random Llama, its token-id prompts): not flagged."""
    sys.path.insert(0, str(ROOT / "examples"))
    import tiny_llama
    model = work / "tiny-llama"
    tiny_llama.make_model(model, tokenizer=True)
    prompts = work / "tiny-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in tiny_llama.prompts(8)))
    out = work / "tiny"
    out.mkdir(parents=True, exist_ok=True)
    args = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "--enforce-eager",
            "--max-model-len", "256", "--dtype", "float32", "--seed", "0", "--max-num-seqs", "8",
            *vllm_server.spec_args(3)]
    with vllm_server.launch(model, args, vllm_server.env(work), out) as (base, log, _):
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "sanitizer", "verify", base, "--log", str(log), "--prompts",
                               str(prompts), "--format", "json", "--quiet", "--max-tokens", "48", "--duration", "40",
                               "--poll", "1"], capture_output=True, text=True, timeout=300)
    doc = json.loads(proc.stdout)
    print(f"vllm tiny: exit {proc.returncode} in {time.monotonic() - t:.0f} s: {doc['text']}")
    assert proc.returncode != 1, doc["text"]
    assert doc["server"]["max_accept"] == 4
