"""The `tokens` of the steps hazsan's SGLang Scheduler hook marks, on a real sglang.Engine (0.5.23,
CPU, TP=1, NGRAM speculative decoding, the tiny Llama of `make test-sglang`) under capture.

`hazsan sweep` replays a recorded step at other token counts by scaling each allocation's dimension
equal to the step's `tokens`: that count must be the first dimension of the step's activations,
the token count of its model forward. SGLang's NGRAM decode step is one TARGET_VERIFY forward of
requests x speculative_num_draft_tokens tokens (the verified token and its drafts), which the
scheduler's DECODE batch becomes inside the draft worker; a prefill step computes the batch's new
tokens (extend_num_tokens). Runs in `make test-sglang` (.venv-sglang); skipped where SGLang's
dependencies are not installed. One Engine run, about 1-2 minutes on 2 shared cores.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = pytest.mark.long

ROOT = Path(__file__).resolve().parents[2]
E2E = ROOT / "examples" / "sglang_e2e"

if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("transformers") is None:
    pytest.skip("SGLang with its dependencies not installed: `make test-sglang` runs this in .venv-sglang",
                allow_module_level=True)

# examples/sglang_e2e/run.py: the Engine child, its environment, prompts and trace reader
_spec = importlib.util.spec_from_file_location("sglang_e2e_run", E2E / "run.py")
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)

ACTIVATION_SITE = "layers/layernorm.py:"     # RMSNorm: every token of the forward, [tokens, hidden]


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """Per marked step of rank 0: (n, phase, tokens, Counter of the leading dimensions of the
    step's RMSNorm allocations)."""
    work = tmp_path_factory.mktemp("sglang-steps")
    model, traces, result = work / "tiny-llama", work / "traces", work / "result.json"
    env = e2e.sglang_env(1, "alloc", False, traces)
    # the model is written in a process with the set-up (transformers imports torchvision)
    made = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(E2E.parent)!r}); "
                           f"from tiny_llama import make_model; make_model({str(model)!r}, tokenizer=True)"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    spec = json.dumps({"model": str(model), "tp": 1, "spec": True, "result": str(result)})
    with open(work / "engine.log", "w") as log:
        proc = subprocess.run([sys.executable, str(E2E / "run.py"), "--child", spec], env=env, cwd=work,
                              stdout=log, stderr=subprocess.STDOUT, timeout=900)
    assert proc.returncode == 0 and result.exists(), (work / "engine.log").read_text(errors="replace")[-4000:]
    header, events = e2e.read_trace(next(traces.glob("rank0.*")))
    assert "sglang.Scheduler.run_batch" in header["hooks"]["installed"]
    assert not header["hooks"]["failed"], header["hooks"]["failed"]
    out, cur = [], None
    for e in events:
        if e["ev"] == "step":
            cur = (e["n"], e.get("phase"), e.get("tokens"), Counter())
            out.append(cur)
        elif cur is not None and e["ev"] == "alloc" and ACTIVATION_SITE in (e.get("site") or "") \
                and len(e.get("shape") or []) >= 2:
            cur[3][e["shape"][0]] += 1
    return out


def test_every_model_step_carries_its_forward_token_count(steps):
    model_steps = [s for s in steps if s[3]]
    assert len(model_steps) >= 4, steps
    wrong = [(n, phase, tokens, dict(dims)) for n, phase, tokens, dims in model_steps
             if set(dims) != {tokens}]
    assert not wrong, f"steps whose tokens is not their activations' leading dimension: {wrong[:5]}"


def test_ngram_decode_step_is_requests_times_draft_tokens(steps):
    decode = [(n, tokens) for n, phase, tokens, dims in steps if phase == "decode" and dims]
    assert decode, steps
    # the warm-up request alone, then the batch of N_PROMPTS (fewer once some have finished)
    assert all(t % e2e.DRAFT_TOKENS == 0 and 1 <= t // e2e.DRAFT_TOKENS <= e2e.N_PROMPTS for _, t in decode), decode
    assert max(t for _, t in decode) == e2e.N_PROMPTS * e2e.DRAFT_TOKENS, decode


def test_prefill_step_counts_its_new_tokens(steps):
    extend = [(n, tokens) for n, phase, tokens, dims in steps if phase == "extend" and dims]
    assert extend, steps
    # the first prefill is the warm-up request's whole prompt: nothing of it is cached yet
    assert extend[0][1] == len(e2e.prompts()[0]), extend
