import os
import sys
from pathlib import Path

# An internal error in a command propagates with its traceback (sanitizer/cli.py would print one
# line and exit 2): a test that only checks the exit code must not pass over a bug. Subprocesses
# the tests start inherit it.
os.environ["HAZSAN_RAISE"] = "1"
# Capture's allocations are recorded by its dispatch mode here unless a test asks for the native
# recorder (HAZSAN_NATIVE=1): the dispatch mode is the reference path, whose events carry op, shape
# and dtype that many tests read; the native path runs the same programs in the tests that name it
# (`alloc-native` in tests/support/gloo_programs.py, tests/capture/test_capture_native.py).
os.environ.setdefault("HAZSAN_NATIVE", "0")

# tests/support/ helpers (tracebuilder, reference_model, engine_scenarios) import as plain modules;
# the tests themselves are grouped by the package they test (tests/capture/, tests/rules/, ...).
sys.path.insert(0, str(Path(__file__).parent / "support"))

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def jsonl_capture():
    """Capture in this module's tests (and the processes they start) writes JSON Lines: for tests
    that read the trace lines by hand. Module-scoped, so that module-scoped fixtures that run
    capture see it too (a module asks for it with `pytestmark = pytest.mark.usefixtures(...)`,
    which puts it before the fixtures its tests name). The binary default has its own tests
    (test_trace_binary.py; the writer, nothing-lost, failsafe and rotation tests run in both)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HAZSAN_TRACE_FORMAT", "jsonl")
        yield


@pytest.fixture(params=["binary", "jsonl"])
def trace_format(request, monkeypatch):
    """Run the test once per trace format (HAZSAN_TRACE_FORMAT set for it and its children)."""
    monkeypatch.setenv("HAZSAN_TRACE_FORMAT", request.param)
    return request.param
