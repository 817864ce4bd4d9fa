"""The shipped example traces give exactly the findings their names promise, and stay in sync
with the script that writes them."""
import sys
from pathlib import Path

import pytest

from sanitizer.rules.driver import analyze

TRACES = Path(__file__).resolve().parents[2] / "examples" / "traces"
sys.path.insert(0, str(TRACES))
from make_traces import SCENARIOS  # noqa: E402


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_example_trace(name, tmp_path, monkeypatch):
    make, expected = SCENARIOS[name]
    a = analyze([TRACES / name])
    assert a.errors == [] and set(a.summary["by_rule"]) == expected
    # The committed file is what the script writes.
    import make_traces
    monkeypatch.setattr(make_traces, "HERE", tmp_path)
    make()
    for committed in ([TRACES / name] if name.endswith(".jsonl") else sorted((TRACES / name).iterdir())):
        rel = committed.relative_to(TRACES)
        assert (tmp_path / rel).read_bytes() == committed.read_bytes(), f"regenerate {rel}"
