"""Bounded fuzz of `hazsan check` (issue 14): mutated traces (tests/support/hostile_inputs.py) end in exit
0, 1 or 2, never a traceback. The black-box test runs the real command line; the in-process one
runs many more inputs through both engines. benchmarks/fuzz.py is the long run."""
from __future__ import annotations

import contextlib
import io
import json
import random
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile_inputs import trace_binary, trace_lines
from sanitizer.cli import main
from sanitizer.rules.driver import compiled_available

ENGINES = ["interpreted"] + (["compiled"] if compiled_available()[0] else [])


def _judge(argv, code, out, err, d):
    """What the command said must agree with its exit code: 2 only with a message on stderr that
    names the trace it could not read; 0 or 1 (check) only with a JSON report whose error-level
    findings decide which; never a traceback."""
    assert code in (0, 1, 2), (code, err[-500:])
    assert "Traceback" not in err and "Traceback" not in out, err[-2000:]
    if code == 2:
        assert str(d) in err, f"exit 2 must name the file: {err[-500:]!r}"
        return
    if argv[0] == "check":
        doc = json.loads(out)
        errors = [f for f in doc["findings"] if f["severity"] == "error"]
        assert code == (1 if errors else 0), (code, doc["summary"].get("by_rule"))


def _write(d, seed, ranks, rate):
    rng = random.Random(seed)
    for r in range(ranks):
        (d / f"rank{r}.jsonl").write_bytes(trace_lines(rng, rank=r, events=60, mutation_rate=rate))


@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 2), rate=st.sampled_from([0.0, 0.02, 0.2]),
       fmt=st.sampled_from(["text", "json", "sarif"]))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzz_check_command_line(tmp_path_factory, seed, ranks, rate, fmt):
    d = tmp_path_factory.mktemp("fuzz")
    _write(d, seed, ranks, rate)
    r = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(d), "--format", fmt],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1, 2), r.stderr
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout


@pytest.mark.parametrize("engine", ENGINES)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 3), rate=st.sampled_from([0.0, 0.01, 0.05, 0.3]),
       lenient=st.booleans())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzz_check_in_process(tmp_path_factory, monkeypatch, engine, seed, ranks, rate, lenient):
    monkeypatch.setenv("HAZSAN_ENGINE", engine)
    d = tmp_path_factory.mktemp("fuzz")
    _write(d, seed, ranks, rate)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        argv = ["check", str(d), "--format", "json"] + (["--lenient"] if lenient else [])
        code = main(argv)
    _judge(argv, code, out.getvalue(), err.getvalue(), d)


# ------------------------------------------------------------------ the binary format
def _write_binary(d, seed, ranks, rate, gz=False):
    import gzip

    rng = random.Random(seed)
    for r in range(ranks):
        data = trace_binary(rng, rank=r, events=60, mutation_rate=rate)
        if gz:
            (d / f"rank{r}.hzs.gz").write_bytes(gzip.compress(data, 1))
        else:
            (d / f"rank{r}.hzs").write_bytes(data)


@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 2), rate=st.sampled_from([0.0, 0.02, 0.2]))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzz_binary_command_line(tmp_path_factory, seed, ranks, rate):
    d = tmp_path_factory.mktemp("fuzzb")
    _write_binary(d, seed, ranks, rate)
    for argv in (["check", str(d), "--format", "json"], ["cat", str(d)]):
        r = subprocess.run([sys.executable, "-m", "sanitizer", *argv], capture_output=True, text=True, timeout=120)
        assert r.returncode in (0, 1, 2), r.stderr
        assert "Traceback" not in r.stderr and "Traceback" not in r.stdout


@pytest.mark.parametrize("engine", ENGINES)
@given(seed=st.integers(0, 2**32 - 1), ranks=st.integers(1, 3), rate=st.sampled_from([0.0, 0.01, 0.05, 0.3]),
       lenient=st.booleans(), gz=st.booleans())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzz_binary_in_process(tmp_path_factory, monkeypatch, engine, seed, ranks, rate, lenient, gz):
    """Binary traces (tests/hostile_inputs.trace_binary): garbled frames, wrong lengths and kinds,
    items of the wrong shape, cut files; check, check --jobs and cat end in 0, 1 or 2."""
    monkeypatch.setenv("HAZSAN_ENGINE", engine)
    d = tmp_path_factory.mktemp("fuzzb")
    _write_binary(d, seed, ranks, rate, gz)
    for argv in (["check", str(d), "--format", "json"] + (["--lenient"] if lenient else []), ["cat", str(d)]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        _judge(argv, code, out.getvalue(), err.getvalue(), d)
