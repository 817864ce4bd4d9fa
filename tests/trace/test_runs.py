"""Which files are judged together (sanitizer/trace/runs.py; docs/cli.md, "Runs"): headers written by
hand as capture writes them (`run`, `started`), file times set where the rule reads them."""
from __future__ import annotations

import json
import os

import pytest

from sanitizer.cli import main
from sanitizer.rules.driver import analyze, analyze_runs
from sanitizer.trace import runs
from sanitizer.trace.reader import TraceError

S = 1_000_000_000          # ns in a second
T0 = 1_800_000_000 * S


def write(d, name, rank, run=None, started=None, ended=None, events=()):
    d.mkdir(parents=True, exist_ok=True)
    header = {"hazsan": 1, "rank": rank}
    if run is not None:
        header["run"] = run
    if started is not None:
        header["started"] = started
    p = d / name
    p.write_text("".join(json.dumps(x) + "\n" for x in [header, *events]))
    if ended is not None:
        os.utime(p, ns=(ended, ended))
    return p


LATENT = [{"ev": "alloc", "id": 1, "addr": 4096, "size": 64, "stream": "s0", "pool": "default"},
          {"ev": "coll", "cid": 1, "comm": "tp", "seq": 0, "op": "all_reduce", "stream": "comm",
           "bufs": [{"addr": 4096, "size": 64, "access": "rw"}]},
          {"ev": "free", "id": 1}]


def test_one_folder_used_twice_is_judged_on_its_newest_run(tmp_path):
    d = tmp_path / "t"
    write(d, "rank0.jsonl", 0, "old", T0, T0 + 5 * S, LATENT)
    write(d, "rank1.jsonl", 1, "old", T0, T0 + 5 * S, LATENT)
    write(d, "rank0.pid9.jsonl", 0, "new", T0 + 60 * S, T0 + 65 * S)
    write(d, "rank1.pid10.jsonl", 1, "new", T0 + 60 * S, T0 + 65 * S)
    files, notes = runs.choose([d])
    assert [f.name for f in files] == ["rank0.pid9.jsonl", "rank1.pid10.jsonl"]
    assert "holds 2 runs; judged the newest, run new" in notes[0] and "left out: run old" in notes[0]
    a = analyze([d])
    assert a.findings == [] and a.summary["ranks"] == 2 and notes[0] in a.warnings
    old = analyze([d], run="old")
    assert old.summary["by_rule"] == {"free-in-flight": 2}
    with pytest.raises(TraceError, match="no run 'nope' here"):
        runs.choose([d], run="nope")


def test_ranks_started_by_hand_are_one_run_when_they_ran_together(tmp_path):
    d = tmp_path / "t"
    write(d, "rank0.jsonl", 0, "a", T0, T0 + 10 * S)
    write(d, "rank1.jsonl", 1, "b", T0 + 1 * S, T0 + 11 * S)       # overlapping, another rank
    files, notes = runs.choose([d])
    assert len(files) == 2 and notes == []
    # the same rank twice is never one run, however they overlap: the later id stays apart
    write(d, "rank1.pid7.jsonl", 1, "c", T0 + 2 * S, T0 + 12 * S)
    found, _, _ = runs.find_runs([d])
    assert sorted(sorted(f.name for f in r.files) for r in found) == [
        ["rank0.jsonl", "rank1.jsonl"], ["rank1.pid7.jsonl"]]
    files, notes = runs.choose([d])
    assert [f.name for f in files] == ["rank1.pid7.jsonl"] and "holds 2 runs" in notes[0]


def test_files_of_two_runs_named_together_are_refused_naming_both(tmp_path, capsys):
    d = tmp_path / "t"
    a = write(d, "rank0.jsonl", 0, "first", T0, T0 + S)
    b = write(d, "rank0.pid5.jsonl", 0, "second", T0 + 60 * S, T0 + 61 * S)
    assert main(["check", str(a), str(b)]) == 2
    out = capsys.readouterr().out
    assert "come from 2 different runs" in out and "run first" in out and "run second" in out


def test_an_unreadable_file_is_judged_with_the_run_chosen(tmp_path):
    d = tmp_path / "t"
    write(d, "rank0.jsonl", 0, "r", T0, T0 + S)
    (d / "rank1.jsonl").write_text("not a trace\n")
    a = analyze([d])
    assert [e.path for e in a.errors] == [str(d / "rank1.jsonl")] and a.exit_code() == 2


def test_a_folder_of_run_folders_is_judged_run_by_run(tmp_path):
    s = tmp_path / "session"
    write(s / "tests" / "a", "rank0.jsonl", 0, "sess", T0, T0 + S, LATENT)
    write(s / "tests" / "b", "rank0.jsonl", 0, "sess", T0 + 2 * S, T0 + 3 * S)
    with pytest.raises(runs.SeveralRuns):
        analyze([s])
    a = analyze_runs([s])
    assert a.summary["by_rule"] == {"free-in-flight": 1} and len(a.summary["runs"]) == 2
    assert a.exit_code() == 1
    # the same folders named together (a glob over one session's tests): one judgement, as asked
    files, notes = runs.choose([s / "tests" / "a", s / "tests" / "b"])
    assert len(files) == 2 and notes == []


def test_files_without_an_id_are_one_run_as_hand_written_traces_always_were(tmp_path):
    d = tmp_path / "t"
    write(d, "rank0.jsonl", 0)
    write(d, "rank1.jsonl", 1)
    files, notes = runs.choose([d])
    assert len(files) == 2 and notes == []
