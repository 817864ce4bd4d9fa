"""The front door: `make demo` (examples/demo.py), `make proof` (examples/mhc_decode/proof.py) and
the README.

The demo's depths come from the placement model, never from a constant; its tables are built
from real runs (here a small 2-rank sweep, ~20 s); the README stays short, shows a finding in the
format `hazsan check` prints, and the repository names no machine paths.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

pytest.importorskip("torch")

import demo  # noqa: E402

from examples.mhc_decode import proof as P  # noqa: E402

SMALL = ["--hidden", "512", "--layers", "1", "--batch", "4", "--steps", "4", "--request-steps", "2",
         "--vocab", "1024", "--ranks", "2", "--warmup", "none"]


def test_neighbours_of_the_colliding_depth():
    assert demo.neighbours(4) == [3, 4, 5]
    assert demo.neighbours(1) == [1, 2]


def test_depth_ranges_round_trip():
    assert P.parse_depths("1-3,5") == [1, 2, 3, 5]
    assert P.depths_text([3, 4, 5]) == "3-5" and P.depths_text([1, 3]) == "1,3"


def test_the_demo_runs_the_depth_the_placement_model_predicts(monkeypatch, tmp_path):
    """Whatever depth the model says collides, the demo runs that one and its neighbours."""
    class Pred:
        def __init__(self, d):
            self.depth, self.requests = d, 10
            self.corrupted_requests = {1, 2} if d == 6 else set()

    asked = {}

    def fake_sweep(depths, out):
        asked["depths"] = depths
        raise SystemExit("stop here")

    monkeypatch.setattr(P, "predicted", lambda depths: {d: Pred(d) for d in depths})
    monkeypatch.setattr(P, "run_sweep", fake_sweep)
    with pytest.raises(SystemExit, match="stop here"):
        demo.main(["--out", str(tmp_path)])
    assert asked["depths"] == [5, 6, 7]


def test_default_prediction_names_one_depth():
    pred = P.predicted(range(1, 9))
    assert len(P.colliding(pred)) == 1


@pytest.fixture(scope="module")
def small_runs(tmp_path_factory):
    from examples.mhc_decode.sweep import main as sweep_main
    root = tmp_path_factory.mktemp("demo")
    assert sweep_main(["--depths", "2-3", "--out", str(root), "--quiet"] + SMALL) == 0
    return root


def test_proof_tables_and_report_from_real_runs(small_runs, tmp_path):
    assert not list(small_runs.glob("reference-cache/weights-*"))      # the drawn weights live for the sweep only
    result = P.proof(small_runs, [2, 3])
    assert [e["depth"] for e in result["per_depth"]] == [2, 3]
    assert result["pooled"]["fixed corrupted"][0] == 0
    assert result["pooled"]["stock corrupted"][0] > 0          # SMALL collides at depth 3 (test_mhc_example)
    for (label, d), side in result["evidence"].items():
        cell = demo.check_cell(side)
        assert cell.startswith(f"exit {side.analysis.exit_code('error')}: ")
    sig = P.log_signature(small_runs, [2, 3])
    assert set(sig["per"]) == {(v, d) for v in ("stock", "fixed") for d in (2, 3)}
    assert "reuse-in-flight" in demo.rules_line(result, "stock")
    out = P.write_report(result, [2, 3], sig, P.predicted([2, 3]), out=tmp_path)
    text = (out / "README.md").read_text()
    assert "make proof" in text and "| depth |" in text.replace("   ", " ")


def test_first_finding_is_what_hazsan_check_prints(small_runs):
    block, last, code = demo.first_finding(small_runs / "stock-d3")
    assert code == 1
    assert block.splitlines()[0].startswith("=====") and "hazsan ERROR: reuse-in-flight" in block
    assert re.match(r"hazsan: \d+ finding\(s\) in \d+ events, 2 rank\(s\)", last)


README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_is_short_and_names_every_top_level_folder():
    assert len(README.splitlines()) <= 140
    for folder in ("sanitizer/", "hooks/", "reports/", "examples/", "tests/", "benchmarks/", "docs/"):
        assert f"`{folder}`" in README, folder
    for cmd in ("make demo", "make test", "hazsan scan", "pytest --hazsan", "HAZSAN=1"):
        assert cmd in README, cmd
    assert (ROOT / "docs" / "report-timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _skeleton(lines: list[str]) -> list[str]:
    """Lines with every token that names a place or a number (paths, addresses, counts, streams)
    made '#': what stays is what the renderer writes."""
    return [re.sub(r"\S*[\d/'\"]\S*", "#", line) for line in lines]


def test_readme_sample_is_what_make_readme_writes_from_a_run_like_it(small_runs):
    """The README's sample is `make readme`'s output (examples/demo.py --readme); a run of the same
    case today must render the same lines, but for places and numbers, so the sample cannot go
    stale."""
    start, end = README.index(demo.README_BEGIN), README.index(demo.README_END)
    pasted = README[start:end].split("```text\n", 1)[1].split("```", 1)[0].rstrip("\n").splitlines()
    now = demo.readme_sample(small_runs / "stock-d3").splitlines()
    assert pasted[0].startswith("$ hazsan check ") and now[0].startswith("$ hazsan check ")

    def finding(lines):           # the first finding, up to the line that lists the others like it
        i = next(i for i, line in enumerate(lines) if line.startswith("  ... and ") or line.startswith("[..."))
        return _skeleton(lines[1:i])

    assert finding(pasted) == finding(now)
    assert "hazsan ERROR: reuse-in-flight" in pasted[2]
    totals = re.compile(r"hazsan: \d+ finding\(s\) in \d+ events, 2 rank\(s\): ")
    assert totals.match(pasted[-2]) and totals.match(now[-2])
    assert pasted[-1].startswith("SUMMARY: hazsan: reuse-in-flight at ") and now[-1].startswith("SUMMARY: hazsan: ")


def test_no_machine_paths_in_the_repository():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    bad = []
    machine = re.compile(r"/work/|/home/[a-z]|/Users/[A-Za-z]")
    fixed_tmp = re.compile(r"""default\s*=\s*(Path\()?["']/tmp/""")
    for name in files:
        path = ROOT / name
        if name == "tests/examples/test_demo.py" or not path.is_file() or path.suffix in (".png", ".gz", ".whl"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if machine.search(line) or (name.startswith("benchmarks/") and fixed_tmp.search(line)):
                bad.append(f"{name}:{n}: {line.strip()}")
    assert bad == []


def test_hold_partial_removes_the_early_free(tmp_path):
    """What the demo says of the fixed build's remaining warnings: holding the all-reduce's input
    until its wait (--hold-partial) leaves no finding at all."""
    from examples.mhc_decode.sweep import main as sweep_main
    from sanitizer.rules.driver import analyze
    assert sweep_main(["--depths", "3", "--variants", "fixed", "--hold-partial", "--out", str(tmp_path), "--quiet"]
                      + SMALL) == 0
    a = analyze([str(tmp_path / "fixed-d3")])
    assert not a.errors and a.summary["by_rule"] == {}
