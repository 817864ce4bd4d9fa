"""hazsan compare: statistics checked against scipy directly, hand-written trace directories,
outcomes, exit codes and the three output formats."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from scipy import stats as sps

from sanitizer.cli import main
from sanitizer.proof import Comparison, OutcomeError, Rate, fisher, load_run, read_outcomes
from sanitizer.proof.run import trace_files


# ------------------------------------------------------------------------------ statistics

def test_zero_of_1000_upper_bound_and_rule_of_three():
    r = Rate(0, 1000)
    assert r.upper_bound(0.95) == pytest.approx(0.002991, abs=5e-7)
    assert r.upper_bound(0.95) == pytest.approx(1 - 0.05 ** (1 / 1000), rel=1e-9)
    assert r.upper_bound(0.95) == pytest.approx(sps.beta.ppf(0.95, 1, 1000), rel=1e-9)
    assert r.rule_of_three() == pytest.approx(0.003)
    assert r.upper_bound(0.99) == pytest.approx(sps.beta.ppf(0.99, 1, 1000), rel=1e-9)


@pytest.mark.parametrize("k, n", [(39, 1000), (1, 10), (5, 5), (0, 3), (17, 250)])
def test_exact_bounds_match_clopper_pearson_beta_quantiles(k, n):
    r = Rate(k, n)
    upper = sps.beta.ppf(0.95, k + 1, n - k) if k < n else 1.0
    assert r.upper_bound(0.95) == pytest.approx(upper, rel=1e-7)
    lo, hi = r.interval(0.95)
    assert lo == pytest.approx(sps.beta.ppf(0.025, k, n - k + 1) if k else 0.0, rel=1e-7, abs=1e-12)
    assert hi == pytest.approx(sps.beta.ppf(0.975, k + 1, n - k) if k < n else 1.0, rel=1e-7)
    assert (r.rule_of_three() is None) == (k != 0)


def test_fisher_matches_scipy_for_the_reference_case():
    stock, fixed = Rate(39, 1000), Rate(0, 1000)
    got = fisher(stock, fixed)
    table = [[39, 961], [0, 1000]]
    assert got.p_one_sided == pytest.approx(sps.fisher_exact(table, alternative="greater")[1], rel=1e-12)
    assert got.p_two_sided == pytest.approx(sps.fisher_exact(table)[1], rel=1e-12)
    assert got.p_one_sided < 1e-10
    # a symmetric table is not significant at all
    same = fisher(Rate(3, 100), Rate(3, 100))
    assert same.p_one_sided == pytest.approx(sps.fisher_exact([[3, 97], [3, 97]], alternative="greater")[1])
    assert same.p_two_sided == pytest.approx(1.0)


def test_empty_and_impossible_rates():
    assert Rate(0, 0).upper_bound() is None and Rate(0, 0).interval() is None and Rate(0, 0).rule_of_three() is None
    assert fisher(Rate(0, 0), Rate(1, 4)).p_one_sided is None
    with pytest.raises(ValueError):
        Rate(5, 3)
    with pytest.raises(ValueError):
        Rate(-1, 3)


# ------------------------------------------------------------------------------ hand-written runs

def _write(path: Path, lines: list[dict], gz: bool = False) -> None:
    data = ("\n".join(json.dumps(x) for x in lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if gz else data)


def rank_trace(rank: int, steps: int, hazard_steps=(), *, world: int = 2, outside_hazard: bool = False) -> list[dict]:
    """Per step: a block is all-reduced on the comm stream; in a hazard step the program frees it
    before the collective completes (free-in-flight) and the next allocation lands on it
    (reuse-in-flight). In a clean step the host waits for the collective first."""
    ev = [{"hazsan": 1, "rank": rank, "world_size": world, "device": f"cuda:{rank}"}]
    bid = cid = 0

    def one(hazard: bool):
        nonlocal bid, cid
        bid += 1
        cid += 1
        a, b = f"a{bid}", f"b{bid}"
        ev.append({"ev": "alloc", "id": a, "addr": 8192, "size": 2048, "stream": "s0", "pool": "symm"})
        ev.append({"ev": "launch", "stream": "s0", "writes": [[8192, 2048]], "op": "aten::mm"})
        ev.append({"ev": "record", "event": f"e{cid}", "stream": "s0"})  # the collective waits for the producer
        ev.append({"ev": "wait", "event": f"e{cid}", "stream": "comm"})
        ev.append({"ev": "coll", "cid": cid, "comm": "tp", "seq": cid, "op": "all_reduce", "stream": "comm",
                   "bufs": [{"addr": 8192, "size": 2048, "access": "rw"}]})
        if not hazard:
            ev.append({"ev": "coll_done", "cid": cid})
        ev.append({"ev": "free", "id": a})
        ev.append({"ev": "alloc", "id": b, "addr": 8192, "size": 1024, "stream": "s0", "pool": "symm"})
        ev.append({"ev": "sync"})
        ev.append({"ev": "free", "id": b})

    if outside_hazard:
        one(True)
    for n in range(steps):
        ev.append({"ev": "step", "n": n, "phase": "decode"})
        one(n in hazard_steps)
    return ev


def make_run(root: Path, name: str, steps: int, hazards_by_rank: dict, outcomes=None, *, gz=False, **kw) -> Path:
    d = root / name
    d.mkdir()
    for rank, hz in hazards_by_rank.items():
        _write(d / (f"rank{rank}.jsonl" + (".gz" if gz else "")), rank_trace(rank, steps, hz, world=len(hazards_by_rank), **kw), gz=gz)
    if outcomes is not None:
        _write(d / ("outcomes.jsonl" + (".gz" if gz else "")), outcomes, gz=gz)
    return d


def _json(capsys, *argv):
    code = main(["compare", "--format", "json", *map(str, argv)])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if out.out else None), out.err


def test_hazard_every_step_vs_clean_is_confirmed(tmp_path, capsys):
    n = 12
    stock = make_run(tmp_path, "stock", n, {0: range(n), 1: range(n)})
    fixed = make_run(tmp_path, "fixed", n, {0: (), 1: ()})
    code, doc, _ = _json(capsys, stock, fixed)
    assert code == 0
    v = doc["verdict"]
    assert v["confirmed"] and v["fixed_clean"] and v["significant"] and v["fixed_problems"] == []
    steps = next(m for m in doc["measures"] if m["name"] == "steps")
    assert (steps["stock"]["k"], steps["stock"]["n"], steps["fixed"]["k"], steps["fixed"]["n"]) == (n, n, 0, n)
    assert steps["fixed"]["upper_bound"] == pytest.approx(sps.beta.ppf(0.95, 1, n))
    assert steps["fixed"]["rule_of_three"] == pytest.approx(3 / n)
    assert steps["fisher"]["p_one_sided"] == pytest.approx(
        sps.fisher_exact([[n, 0], [0, n]], alternative="greater")[1])
    s = doc["stock"]
    assert s["by_rule"] == {"free-in-flight": {"findings": 2 * n, "steps": n},
                            "reuse-in-flight": {"findings": 2 * n, "steps": n}}
    assert s["per_step"]["3"] == {"free-in-flight": 2, "reuse-in-flight": 2}  # one of each on both ranks
    assert s["steps"] == n and s["steps_by_rank"] == {"0": n, "1": n}
    assert doc["fixed"]["by_rule"] == {} and doc["fixed"]["per_step"] == {}
    assert "FIX CONFIRMED" in v["text"]


def test_realised_and_latent_measures_are_separate(tmp_path, capsys):
    stock = make_run(tmp_path, "stock", 10, {0: {1, 4, 7}})
    fixed = make_run(tmp_path, "fixed", 10, {0: ()})
    code, doc, _ = _json(capsys, stock, fixed)
    m = {x["name"]: x for x in doc["measures"]}
    assert (m["steps"]["stock"]["k"], m["steps_realised"]["stock"]["k"]) == (3, 3)
    assert m["steps"]["fisher"]["p_one_sided"] == pytest.approx(
        sps.fisher_exact([[3, 7], [0, 10]], alternative="greater")[1])
    # 3 of 10 vs 0 of 10 is not significant at 0.05 (p ~ 0.105): fixed clean but not confirmed.
    assert code == 1 and doc["verdict"]["fixed_clean"] and not doc["verdict"]["significant"]
    assert "not significant" in doc["verdict"]["text"]
    assert "requests" not in m  # no outcomes files


def test_fixed_side_with_a_finding_is_not_confirmed(tmp_path, capsys):
    n = 30
    stock = make_run(tmp_path, "stock", n, {0: range(n)})
    fixed = make_run(tmp_path, "fixed", n, {0: {17}})
    code, doc, _ = _json(capsys, stock, fixed)
    assert code == 1
    v = doc["verdict"]
    assert v["significant"] and not v["fixed_clean"]
    assert v["fixed_problems"][0].startswith("2 finding(s) at or above warning")
    steps = next(m for m in doc["measures"] if m["name"] == "steps")
    assert steps["fixed"]["k"] == 1 and steps["fixed"]["rule_of_three"] is None
    assert steps["fixed"]["upper_bound"] == pytest.approx(sps.beta.ppf(0.95, 2, n - 1))
    assert doc["fixed"]["per_step"] == {"17": {"free-in-flight": 1, "reuse-in-flight": 1}}


def test_findings_outside_any_step_make_the_fixed_side_unclean(tmp_path, capsys):
    stock = make_run(tmp_path, "stock", 20, {0: range(20)})
    fixed = make_run(tmp_path, "fixed", 20, {0: ()}, outside_hazard=True)
    code, doc, _ = _json(capsys, stock, fixed)
    assert code == 1
    assert doc["fixed"]["outside_steps"] == {"free-in-flight": 1, "reuse-in-flight": 1}
    assert next(m for m in doc["measures"] if m["name"] == "steps")["fixed"]["k"] == 0


def test_a_transient_in_the_window_keeps_the_fixed_side_unclean_at_every_threshold(tmp_path, capsys):
    """transient-in-window is an error (docs/hazard-model.md): a fixed build that still places a
    transient in the window is not clean, at --fail-on error as at warning."""
    stock = make_run(tmp_path, "stock", 20, {0: range(20)})
    fixed = tmp_path / "fixed"
    fixed.mkdir()
    ev = rank_trace(0, 20, (), world=1)
    ev[1:1] = [{"ev": "window", "addr": 1 << 20, "size": 1 << 20, "comm": "tp"}]
    # the transients are allocated while an all-reduce is in flight: peers may write the window
    ev += [{"ev": "coll", "cid": 999, "comm": "tp", "seq": 999, "op": "all_reduce", "stream": "comm",
            "bufs": [{"addr": 8192, "size": 2048, "access": "rw"}]}]
    ev += [{"ev": "alloc", "id": f"t{i}", "addr": (1 << 20) + 4096 * i, "size": 4096, "stream": "s0", "pool": "symm",
            "site": "mhc.py:10:hc_pre"} for i in range(3)]
    ev += [{"ev": "free", "id": f"t{i}"} for i in range(3)]
    _write(fixed / "rank0.jsonl", ev)
    code, doc, _ = _json(capsys, stock, fixed)
    assert code == 1
    assert doc["fixed"]["transient_in_window"] == {"frees": 3, "bytes": 3 * 4096, "sites": 1}
    assert doc["fixed"]["by_rule"] == {"transient-in-window": {"findings": 1, "steps": 0}}
    code, doc, _ = _json(capsys, "--fail-on", "error", stock, fixed)
    assert code == 1 and not doc["verdict"]["fixed_clean"]


# ------------------------------------------------------------------------------ outcomes

def _outcomes(n_steps: int, per_step: int, corrupted=(), ranks=(0, 1), **extra):
    out, rid = [], 0
    for s in range(n_steps):
        for _ in range(per_step):
            out.append({"request": rid, "step": s, "rank": ranks[rid % len(ranks)],
                        "corrupted": rid in corrupted, **extra})
            rid += 1
    return out


def test_requests_affected_corrupted_and_preceded(tmp_path, capsys):
    # 10 steps x 4 requests, alternating ranks 0/1 (requests 0,2 on rank 0; 1,3 on rank 1 in step 0).
    # Rank 0 has hazards at steps 2 and 5; rank 1 at step 5 only.
    outcomes = _outcomes(10, 4, corrupted={8, 21, 9, 37})  # 8: step 2 r0; 21: step 5 r1; 9: step 2 r1; 37: step 9 r1
    stock = make_run(tmp_path, "stock", 10, {0: {2, 5}, 1: {5}}, outcomes)
    fixed = make_run(tmp_path, "fixed", 10, {0: (), 1: ()}, _outcomes(10, 4))
    code, doc, _ = _json(capsys, stock, fixed)
    req = doc["stock"]["requests"]
    assert req["total"] == 40 and req["corrupted"] == 4
    # affected: step 2 on rank 0 (requests 8, 10), step 5 on both ranks (20..23)
    assert req["with_findings"] == 6
    # 8 (finding at its step), 21 (rank 1 step 5), 37 (rank 1, step 5 earlier): preceded; 9: rank 1 had none by step 2
    assert req["preceded"] == 3 and req["not_preceded"] == [9]
    assert req["preceded_on_any_rank"] == 4  # rank 0's step-2 finding precedes request 9 on any rank
    assert req["every_corrupted_preceded"] is False
    assert req["max_lag_steps"] == 4  # request 37 at step 9, last finding on rank 1 at step 5
    per = {r["request"]: r for r in doc["stock"]["per_request"]}
    assert per[8]["findings"] == {"free-in-flight": 1, "reuse-in-flight": 1} and per[8]["finding_step"] == 2
    assert per[37]["findings"] == {} and per[37]["finding_step"] == 5
    m = {x["name"]: x for x in doc["measures"]}
    assert (m["requests"]["stock"]["k"], m["requests"]["stock"]["n"]) == (6, 40)
    assert (m["corrupted"]["stock"]["k"], m["corrupted"]["fixed"]["k"]) == (4, 0)
    assert m["corrupted"]["fisher"]["p_two_sided"] == pytest.approx(sps.fisher_exact([[4, 36], [0, 40]])[1])
    assert "stock: 3 of 4 corrupted requests preceded" in doc["verdict"]["text"]


def test_corrupted_request_on_the_fixed_side_is_not_clean(tmp_path, capsys):
    stock = make_run(tmp_path, "stock", 20, {0: range(20)}, _outcomes(20, 1, ranks=(0,)))
    fixed = make_run(tmp_path, "fixed", 20, {0: ()}, _outcomes(20, 1, corrupted={7}, ranks=(0,)))
    code, doc, _ = _json(capsys, stock, fixed)
    assert code == 1 and "1 corrupted request(s)" in doc["verdict"]["fixed_problems"]
    code, doc, _ = _json(capsys, "--primary", "corrupted", stock, fixed)
    assert code == 1 and not doc["verdict"]["significant"]


def test_primary_corrupted_and_rank_null_and_first_step(tmp_path, capsys):
    n = 40
    stock_out = [{"request": f"r{s}", "step": s, "first_step": max(0, s - 2), "corrupted": s % 2 == 0, "depth": 3}
                 for s in range(n)]
    stock = make_run(tmp_path, "stock", n, {0: set(range(0, n, 2)), 1: ()}, stock_out)
    fixed = make_run(tmp_path, "fixed", n, {0: (), 1: ()},
                     [{"request": f"r{s}", "step": s, "corrupted": False} for s in range(n)])
    code, doc, _ = _json(capsys, "--primary", "corrupted", stock, fixed)
    assert code == 0
    req = doc["stock"]["requests"]
    assert req["corrupted"] == 20 and req["preceded"] == 20 and req["every_corrupted_preceded"]
    # every request spans 3 steps, at least one of which is even: all affected
    assert req["with_findings"] == n
    per = {r["request"]: r for r in doc["stock"]["per_request"]}
    assert per["r5"]["findings"] == {"free-in-flight": 1, "reuse-in-flight": 1}  # step 4 of 3..5
    assert per["r4"]["extra"] == {"depth": 3} and per["r4"]["rank"] is None


def test_outcomes_file_is_not_read_as_a_trace_and_gzip_works(tmp_path, capsys):
    stock = make_run(tmp_path, "stock", 15, {0: range(15)}, _outcomes(15, 2, ranks=(0,)), gz=True)
    fixed = make_run(tmp_path, "fixed", 15, {0: ()}, _outcomes(15, 2, ranks=(0,)), gz=True)
    assert [p.name for p in trace_files(stock)] == ["rank0.jsonl.gz"]
    code, doc, _ = _json(capsys, stock, fixed)
    assert code == 0 and doc["stock"]["requests"]["total"] == 30
    assert doc["stock"]["outcomes_file"].endswith("outcomes.jsonl.gz")


@pytest.mark.parametrize("line, message", [
    ('{"request": 1, "step": 0, "corrupted": "yes"}', "'corrupted' must be true or false"),
    ('{"request": 1, "corrupted": false}', "'step' must be an integer"),
    ('{"request": [1], "step": 0, "corrupted": false}', "'request' must be an integer or a string"),
    ('{"request": 1, "step": 0, "rank": "0", "corrupted": false}', "'rank' must be an integer"),
    ('{"request": 1, "step": 2, "first_step": 3, "corrupted": false}', "first_step 3 is after step 2"),
    ('{"request": 0, "step": 0, "corrupted": false}', "already given on line 1"),
    ('{"request": 1, "step": 0, "corrupted": fals', "not JSON"),
    ("[1, 2]", "must be a JSON object"),
])
def test_malformed_outcomes_name_file_and_line(tmp_path, capsys, line, message):
    p = tmp_path / "outcomes.jsonl"
    p.write_text('{"request": 0, "step": 0, "corrupted": false}\n\n' + line + "\n")
    with pytest.raises(OutcomeError) as exc:
        read_outcomes(p)
    assert str(exc.value).startswith(f"{p}:3: ") and message in str(exc.value)
    stock = make_run(tmp_path, "stock", 3, {0: ()})
    (stock / "outcomes.jsonl").write_text(p.read_text())
    fixed = make_run(tmp_path, "fixed", 3, {0: ()})
    code, _, err = _json(capsys, stock, fixed)
    assert code == 2 and f"{stock / 'outcomes.jsonl'}:3:" in err


# ------------------------------------------------------------------------------ input errors

def test_missing_or_empty_directory_exits_2(tmp_path, capsys):
    fixed = make_run(tmp_path, "fixed", 3, {0: ()})
    code, _, err = _json(capsys, tmp_path / "nope", fixed)
    assert code == 2 and "nope: not a directory" in err
    (tmp_path / "empty").mkdir()
    code, _, err = _json(capsys, tmp_path / "empty", fixed)
    assert code == 2 and "no *.jsonl" in err


def test_malformed_trace_exits_2_and_lenient_makes_the_fixed_side_unclean(tmp_path, capsys):
    n = 20
    stock = make_run(tmp_path, "stock", n, {0: range(n)})
    fixed = make_run(tmp_path, "fixed", n, {0: ()})
    trace = fixed / "rank0.jsonl"
    lines = trace.read_text().splitlines()
    lines.insert(5, '{"ev": "free", "id": "never-allocated"}')
    trace.write_text("\n".join(lines) + "\n")
    code, _, err = _json(capsys, stock, fixed)
    assert code == 2 and f"{trace}:6" in err
    code, doc, _ = _json(capsys, "--lenient", stock, fixed)
    assert code == 1
    assert any("skipped" in p for p in doc["verdict"]["fixed_problems"])


def test_cut_short_fixed_trace_is_not_evidence_of_absence(tmp_path, capsys):
    n = 20
    stock = make_run(tmp_path, "stock", n, {0: range(n)})
    fixed = make_run(tmp_path, "fixed", n, {0: ()})
    trace = fixed / "rank0.jsonl"
    trace.write_bytes(trace.read_bytes()[:-15])
    code, doc, _ = _json(capsys, stock, fixed)
    assert code == 1 and "a trace was cut short" in doc["verdict"]["fixed_problems"]


def test_bad_alpha_exits_2(tmp_path, capsys):
    d = make_run(tmp_path, "x", 2, {0: ()})
    assert main(["compare", "--alpha", "1.5", str(d), str(d)]) == 2


# ------------------------------------------------------------------------------ text and markdown

def test_text_report_sections(tmp_path, capsys):
    stock = make_run(tmp_path, "stock", 50, {0: range(50)}, _outcomes(50, 2, corrupted={4, 60}, ranks=(0,)))
    fixed = make_run(tmp_path, "fixed", 50, {0: ()}, _outcomes(50, 2, ranks=(0,)))
    code = main(["compare", "--max-rows", "5", str(stock), str(fixed)])
    out = capsys.readouterr().out
    assert code == 0
    for heading in ("Findings per rule:", "Statistics (confidence 95%", "Findings per decode step (5 of 50",
                    "Requests:", "Corrupted or affected requests (5 of 100", "Verdict:"):
        assert heading in out
    assert "0/50" in out and "6.00%" in out  # rule of three for 0 of 50
    assert "FIX CONFIRMED" in out and "stock: 2 of 2 corrupted requests preceded" in out


def test_markdown_report(tmp_path, capsys):
    stock = make_run(tmp_path, "stock", 30, {0: range(30)})
    fixed = make_run(tmp_path, "fixed", 30, {0: {3}})
    code = main(["compare", "--format", "markdown", str(stock), str(fixed)])
    out = capsys.readouterr().out
    assert code == 1
    assert out.startswith("# hazsan compare")
    assert "## Statistics" in out and "| measure" in out and "|---" in out.replace(":", "-").replace(" ", "")
    assert "| 3 " in out  # step 3 row of the per-step table
    assert "**FIX NOT CONFIRMED" in out


def test_load_run_api(tmp_path):
    stock = make_run(tmp_path, "stock", 6, {0: {1, 2}, 1: {2}})
    fixed = make_run(tmp_path, "fixed", 6, {0: (), 1: ()})
    c = Comparison(load_run("stock", stock), load_run("fixed", fixed))
    assert c.stock.affected_steps() == {1, 2}
    assert c.stock.index.in_range(1, 0, 5) == {"free-in-flight": 1, "reuse-in-flight": 1}
    assert c.stock.index.latest_at_or_before(0, 5) == 2 and c.stock.index.latest_at_or_before(1, 1) is None
    assert c.exit_code() == 1  # 2 of 6 vs 0 of 6 is not significant
    with pytest.raises(ValueError):
        Comparison(c.stock, c.fixed, primary="nonsense")


def test_primary_measure_needing_outcomes_is_unavailable_without_them(tmp_path, capsys):
    stock = make_run(tmp_path, "stock", 20, {0: range(20)})
    fixed = make_run(tmp_path, "fixed", 20, {0: ()})
    code, doc, _ = _json(capsys, "--primary", "corrupted", stock, fixed)
    assert code == 1 and not doc["verdict"]["significant"] and doc["verdict"]["fixed_clean"]
    assert "unavailable (needs outcomes.jsonl on both sides)" in doc["verdict"]["text"]


# ------------------------------------------------------------------------------ runs without decode steps (issue 49)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "traces"


def stepless_run(root: Path, name: str, hazards: int, clean: int = 2, ranks=(0,)) -> Path:
    """A small program's run: the same per-block pattern as `rank_trace`, but no `step` event."""
    d = root / name
    d.mkdir()
    for rank in ranks:
        ev = rank_trace(rank, hazards + clean, range(hazards), world=len(ranks))
        _write(d / f"rank{rank}.jsonl", [e for e in ev if e.get("ev") != "step"])
    return d


def test_runs_without_steps_are_judged_on_findings(tmp_path, capsys):
    stock = stepless_run(tmp_path, "stock", hazards=4)  # 4 free-in-flight + 4 reuse-in-flight: 8 errors
    fixed = stepless_run(tmp_path, "fixed", hazards=0)
    code, doc, _ = _json(capsys, stock, fixed)
    assert code == 0
    v = doc["verdict"]
    assert v["confirmed"] and v["basis"] == "findings" and v["fixed_clean"]
    assert v["significant"] is None  # no test was made
    assert v["stock_findings"] == 8 and v["steps_marked"] == {"stock": 0, "fixed": 0}
    assert "no decode steps were marked on either side" in v["steps_note"]
    assert "sanitizer.step(n)" in v["steps_note"] and "`step` event" in v["steps_note"]
    assert v["text"].startswith("FIX CONFIRMED on findings: stock 8 finding(s) at or above warning")
    assert "not statistics" in v["text"] and "bounds no rate" in v["text"]
    assert doc["stock"]["steps"] == 0 and doc["stock"]["outside_steps"] == {"free-in-flight": 4, "reuse-in-flight": 4}
    code = main(["compare", str(stock), str(fixed)])
    out = capsys.readouterr().out
    assert code == 0
    assert "FIX CONFIRMED on findings" in out and "FIX NOT CONFIRMED" not in out
    assert "Note: no decode steps were marked on either side" in out and "the verdict is judged on findings" in out
    assert "no decode steps marked on either side" in out  # the per-step section
    code = main(["compare", "--format", "markdown", str(stock), str(fixed)])
    assert code == 0 and "**FIX CONFIRMED on findings" in capsys.readouterr().out


def test_runs_without_steps_from_the_example_traces(tmp_path, capsys):
    """examples/traces/unordered-access.jsonl vs clean.jsonl with their `step` lines removed."""
    for name, src in (("stock", "unordered-access.jsonl"), ("fixed", "clean.jsonl")):
        (tmp_path / name).mkdir()
        lines = (EXAMPLES / src).read_text().splitlines(keepends=True)
        (tmp_path / name / "rank0.jsonl").write_text("".join(x for x in lines if '"ev":"step"' not in x))
    code, doc, _ = _json(capsys, tmp_path / "stock", tmp_path / "fixed")
    assert code == 0 and doc["verdict"]["basis"] == "findings"
    assert "unordered-access 1" in doc["verdict"]["text"]
    code, doc, _ = _json(capsys, tmp_path / "fixed", tmp_path / "stock")  # the wrong way round
    assert code == 1 and doc["verdict"]["fixed_problems"] and "nothing for the fix to remove" in doc["verdict"]["text"]


def test_runs_without_steps_fixed_side_with_findings_is_not_confirmed(tmp_path, capsys):
    stock = stepless_run(tmp_path, "stock", hazards=4)
    fixed = stepless_run(tmp_path, "fixed", hazards=1)
    code, doc, _ = _json(capsys, stock, fixed)
    v = doc["verdict"]
    assert code == 1 and not v["confirmed"] and v["basis"] == "findings"
    assert v["fixed_problems"][0].startswith("2 finding(s) at or above warning")
    assert v["text"].startswith("FIX NOT CONFIRMED: fixed side not clean: 2 finding(s)")
    assert "no decode steps were marked" in v["text"]


def test_runs_without_steps_and_a_clean_stock_side_have_nothing_to_confirm(tmp_path, capsys):
    stock = stepless_run(tmp_path, "stock", hazards=0)
    fixed = stepless_run(tmp_path, "fixed", hazards=0)
    code, doc, _ = _json(capsys, stock, fixed)
    v = doc["verdict"]
    assert code == 1 and v["fixed_clean"] and v["stock_findings"] == 0
    assert "the stock side has no finding at or above warning: nothing for the fix to remove" in v["text"]


def test_runs_without_steps_cut_short_fixed_trace_is_not_confirmed(tmp_path, capsys):
    stock = stepless_run(tmp_path, "stock", hazards=4)
    fixed = stepless_run(tmp_path, "fixed", hazards=0)
    trace = fixed / "rank0.jsonl"
    trace.write_bytes(trace.read_bytes()[:-15])
    code, doc, _ = _json(capsys, stock, fixed)
    assert code == 1 and "a trace was cut short" in doc["verdict"]["fixed_problems"]


@pytest.mark.parametrize("stepped", ["stock", "fixed"])
def test_steps_on_one_side_only_are_named_and_judged_on_findings(tmp_path, capsys, stepped):
    n = 12
    stock = (make_run(tmp_path, "stock", n, {0: range(n)}) if stepped == "stock"
             else stepless_run(tmp_path, "stock", hazards=n))
    fixed = (make_run(tmp_path, "fixed", n, {0: ()}) if stepped == "fixed"
             else stepless_run(tmp_path, "fixed", hazards=0, clean=n))
    code, doc, _ = _json(capsys, stock, fixed)
    v = doc["verdict"]
    assert code == 0 and v["basis"] == "findings" and v["significant"] is None
    lacks = "fixed" if stepped == "stock" else "stock"
    assert f"the {stepped} run marks {n} decode step(s), the {lacks} run none" in v["text"]
    assert f"was the {lacks} run made without `sanitizer.step(n)`?" in v["text"]
    assert v["steps_marked"] == {stepped: n, lacks: 0}


def test_steps_realised_without_steps_needs_an_error_on_the_stock_side(tmp_path, capsys):
    stock = stepless_run(tmp_path, "stock", hazards=3)
    fixed = stepless_run(tmp_path, "fixed", hazards=0)
    code, doc, _ = _json(capsys, "--primary", "steps_realised", stock, fixed)
    assert code == 0 and doc["verdict"]["basis"] == "findings" and doc["verdict"]["stock_severity"] == "error"


def test_primary_corrupted_keeps_its_test_without_steps(tmp_path, capsys):
    """`corrupted` counts requests, not steps: its Fisher test stands; the missing steps are noted."""
    stock = stepless_run(tmp_path, "stock", hazards=3)
    fixed = stepless_run(tmp_path, "fixed", hazards=0)
    _write(stock / "outcomes.jsonl", _outcomes(20, 1, corrupted=set(range(20)), ranks=(0,)))
    _write(fixed / "outcomes.jsonl", _outcomes(20, 1, ranks=(0,)))
    code, doc, _ = _json(capsys, "--primary", "corrupted", stock, fixed)
    v = doc["verdict"]
    assert code == 0 and v["basis"] == "statistics" and v["significant"] is True
    assert v["text"].startswith("FIX CONFIRMED: fixed side clean, 0 of 20 corrupted requests")
    assert "no decode steps were marked on either side" in v["text"]


def test_primary_requests_without_outcomes_or_steps_stays_unavailable(tmp_path, capsys):
    stock = stepless_run(tmp_path, "stock", hazards=3)
    fixed = stepless_run(tmp_path, "fixed", hazards=0)
    code, doc, _ = _json(capsys, "--primary", "requests", stock, fixed)
    assert code == 1 and doc["verdict"]["basis"] == "statistics"
    assert "unavailable (needs outcomes.jsonl on both sides)" in doc["verdict"]["text"]


def test_runs_with_steps_keep_the_statistical_basis(tmp_path, capsys):
    stock = make_run(tmp_path, "stock", 12, {0: range(12)})
    fixed = make_run(tmp_path, "fixed", 12, {0: ()})
    code, doc, _ = _json(capsys, stock, fixed)
    v = doc["verdict"]
    assert code == 0 and v["basis"] == "statistics" and v["steps_note"] is None and v["significant"] is True
    assert v["steps_marked"] == {"stock": 12, "fixed": 12}
