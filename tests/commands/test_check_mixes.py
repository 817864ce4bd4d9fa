"""benchmarks/gen_decode_trace.py --mix (issue 30, part 2): traces with other event mixes are valid,
clean by construction, their planted hazards are found exactly, and they have the mix they say."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from sanitizer.rules.driver import analyze
from sanitizer.rules.select import compiled_available
from sanitizer.trace.reader import open_trace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import check_throughput  # noqa: E402
import gen_decode_trace as gen  # noqa: E402

VARIANTS = ("alloc-heavy", "alloc-heavy,ids=capture,streams=3,events=16", "alloc-heavy,fence=launch,streams=4",
            "alloc=6,free=6,launch=9,record=2,wait=2,coll=1,sites=5")


def _spec(mix: str) -> str:
    name, _, extra = mix.partition(",")
    return gen.MIXES[name] + "," + extra if name in gen.MIXES and extra else mix


def _events(path: Path) -> list[dict]:
    trace = open_trace(path)
    try:
        return [ev for _, ev in trace.events()]
    finally:
        trace.close()


def test_alloc_heavy_has_issue_30s_shares_and_three_sites(tmp_path):
    gen.generate(tmp_path, events=20_000, fmt="binary", mix="alloc-heavy")
    evs = _events(tmp_path / "rank0.hzs")
    assert len(evs) == 20_000
    kinds = Counter(e["ev"] for e in evs)
    share = {k: 100 * v / len(evs) for k, v in kinds.items()}
    for kind, want in {"alloc": 25, "free": 25, "scope": 10, "launch": 10, "record": 10, "wait": 10, "coll": 5,
                       "record_stream": 2.5, "free_done": 2.5}.items():
        assert abs(share[kind] - want) < 0.3, (kind, share[kind])
    assert len({e["site"] for e in evs if e.get("site")}) == 3


@pytest.mark.parametrize("mix", VARIANTS)
@pytest.mark.parametrize("fmt", ["binary", "jsonl"])
def test_mixes_are_clean_by_construction(tmp_path, mix, fmt):
    gen.generate(tmp_path, events=15_000, ranks=2, fmt=fmt, mix=_spec(mix))
    res = analyze([tmp_path])
    assert not res.errors, res.errors[:3]
    assert res.summary["events"] == 30_000
    assert res.findings == []
    assert not [w for w in res.warnings if "never recorded" in w]


@pytest.mark.parametrize("mix", ["alloc-heavy", "alloc-heavy,ids=capture,streams=3"])
def test_planted_hazards_in_a_mix_are_found_exactly(tmp_path, mix):
    gen.generate(tmp_path, events=60_000, ranks=2, inject=12, fmt="binary", mix=_spec(mix))
    expected = json.loads((tmp_path / "expected.json").read_text())["findings"]
    assert {e["hazard"] for e in expected} == set(gen.HAZARD_KINDS)
    res = analyze([tmp_path])
    report = {"findings": [f.to_dict() for f in res.findings], "summary": res.summary}
    ok, notes = check_throughput.compare_with_expected(tmp_path, report)
    assert ok, notes


@pytest.mark.skipif(not compiled_available()[0], reason="the compiled engine is not built")
def test_compiled_and_interpreted_agree_on_a_mix(tmp_path):
    gen.generate(tmp_path, events=20_000, ranks=2, inject=6, fmt="binary", mix=_spec("alloc-heavy,ids=capture"))
    for mode in ("local", "successor"):
        a = analyze([tmp_path], engine="compiled", peer_completion=mode)
        b = analyze([tmp_path], engine="interpreted", peer_completion=mode)
        assert [f.to_dict() for f in a.findings] == [f.to_dict() for f in b.findings]
        assert a.findings


@pytest.mark.parametrize("spec, why", [
    ("alloc=3,free=2", "free must equal alloc"),
    ("alloc=2,free=2,scope=3", "scope must be even"),
    ("alloc=2,free=2,record_stream=1", "free_done must equal record_stream"),
    ("alloc=2,free=2,bogus=1", "is not KIND=COUNT"),
    ("alloc=2,free=2,ids=str", "ids must be"),
    ("alloc=2,free=2,sites=0", "sites must be"),
])
def test_bad_mixes_are_refused(spec, why):
    with pytest.raises(ValueError, match=why):
        gen.parse_mix(spec)


def test_inject_needs_a_fenced_collective(tmp_path):
    with pytest.raises(ValueError, match="fenced collective"):
        gen.generate(tmp_path, events=5_000, inject=1, mix="alloc=4,free=4,launch=2,coll=1")
