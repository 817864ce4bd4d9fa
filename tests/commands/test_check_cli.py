"""`hazsan check` end to end: input handling (docs/trace-format.md) and the CLI contract (docs/cli.md)."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from sanitizer.cli import main
from sanitizer.rules.driver import analyze
from sanitizer.rules.engine import CollectiveMatcher, RankAnalyzer
from sanitizer.rules.findings import FindingSink
from sanitizer.trace.events import EventDecoder
from sanitizer.trace.reader import open_trace
from tracebuilder import Trace


def hazard_trace():
    t = Trace()
    t.alloc(1, 0x1000, 4096, stream="s0", site="m.py:1:f")
    t.coll(1, stream="comm", bufs=[(0x1000, 4096, "rw")])
    t.free(1)  # free-in-flight (warning)
    t.alloc(2, 0x1000, 4096, stream="s0")  # reuse-in-flight (error)
    return t


def clean_trace():
    t = Trace()
    t.alloc(1, 0x1000, 4096, stream="s0")
    t.coll(1, stream="comm", bufs=[(0x1000, 4096, "rw")])
    t.ev("coll_done", cid=1)
    t.free(1)
    return t


def check(capsys, *argv):
    code = main(["check", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_exit_codes_and_fail_on(tmp_path, capsys):
    clean = clean_trace().write(tmp_path / "clean.jsonl")
    bad = hazard_trace().write(tmp_path / "bad.jsonl")
    assert check(capsys, clean)[0] == 0
    code, out, _ = check(capsys, bad)
    assert code == 1 and "reuse-in-flight" in out and "free-in-flight" in out
    # Only the latent early free: an error too (docs/hazard-model.md), at either threshold.
    t = Trace()
    t.alloc(1, 0x1000, 4096, stream="s0")
    t.coll(1, stream="comm", bufs=[(0x1000, 4096, "rw")])
    t.free(1)
    latent = t.write(tmp_path / "latent.jsonl")
    assert check(capsys, latent)[0] == 1
    assert check(capsys, latent, "--fail-on", "warning")[0] == 1
    assert check(capsys, tmp_path / "missing.jsonl")[0] == 2


def test_text_report_groups_and_totals(tmp_path, capsys):
    code, out, _ = check(capsys, hazard_trace().write(tmp_path / "r.jsonl"))
    # errors first, then warnings, then totals
    assert out.index("reuse-in-flight") < out.index("free-in-flight")
    assert "Memory allocated at:" in out and "Op enqueued at:" in out and "#0 m.py:1:f" in out
    # what went wrong, then the op, then where the memory came from (ASan's order)
    assert out.index("Allocation of block") < out.index("collides with") < out.index("Memory allocated at:")
    last = out.strip().splitlines()
    assert last[-2].startswith("hazsan: 2 finding(s) in 4 events, 1 rank(s)")
    assert last[-1].startswith("SUMMARY: hazsan: reuse-in-flight at ")


def test_json_format(tmp_path, capsys):
    code, out, _ = check(capsys, hazard_trace().write(tmp_path / "r.jsonl"), "--format", "json")
    doc = json.loads(out)
    assert code == 1
    assert doc["summary"]["events"] == 4 and doc["summary"]["ranks"] == 1
    assert doc["summary"]["by_rule"] == {"free-in-flight": 1, "reuse-in-flight": 1}
    for f in doc["findings"]:
        assert {"rule", "severity", "rank", "file", "line", "step", "block", "op", "overlap"} <= set(f)
        for key in ("addr", "size", "stream", "pool", "window_offset", "site", "stack", "op"):
            assert key in f["block"]
        assert f["op"]["cid"] == 1 and f["op"]["seq"] == 1 and f["op"]["stream"] == "comm"


def test_sarif_format(tmp_path, capsys):
    code, out, _ = check(capsys, hazard_trace().write(tmp_path / "r.jsonl"), "--format", "sarif")
    doc = json.loads(out)
    results = doc["runs"][0]["results"]
    assert doc["version"] == "2.1.0" and {r["ruleId"] for r in results} == {"reuse-in-flight", "free-in-flight"}
    free = next(r for r in results if r["ruleId"] == "free-in-flight")
    assert free["level"] == "error"       # a latent hazard is an error (docs/hazard-model.md)
    assert free["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == "m.py"
    assert free["locations"][0]["physicalLocation"]["region"]["startLine"] == 1


def test_directory_reads_plain_and_gz(tmp_path, capsys):
    d = tmp_path / "run"
    d.mkdir()
    hazard_trace().write(d / "rank0.jsonl")
    t = clean_trace()
    t.header["rank"] = 1
    t.write(d / "rank1.jsonl.gz", gz=True)
    (d / "notes.txt").write_text("ignored")
    (d / "outcomes.jsonl").write_text('{"request": 1, "step": 0, "corrupted": false}\n')  # not a trace
    code, out, _ = check(capsys, d, "--format", "json")
    doc = json.loads(out)
    assert doc["summary"]["ranks"] == 2 and doc["summary"]["events"] == 8


def test_malformed_line_exits_2_naming_file_and_line(tmp_path, capsys):
    p = clean_trace().write(tmp_path / "m.jsonl")
    lines = p.read_text().splitlines()
    lines.insert(2, '{"ev": "alloc", "id": 5, "addr": "0x10", "size": 4, "stream": "s0", "pool": 0}')
    lines.insert(3, "{not json")
    p.write_text("\n".join(lines) + "\n")
    code, out, _ = check(capsys, p)
    assert code == 2
    assert f"{p}:3:" in out and "'addr' must be an integer" in out
    assert f"{p}:4:" in out and "not JSON" in out
    code, out, _ = check(capsys, p, "--lenient")
    assert code == 0 and "skipped 2 malformed line(s)" in out


@pytest.mark.parametrize("body,needle", [
    ('{"ev": "free", "id": 42}', "free of unknown or already freed id 42"),
    ('{"ev": "free_done", "id": 1}', "free_done of id 1, which is still live"),
    ('{"ev": "coll_done", "cid": 99}', "coll_done of unknown cid 99"),
    ('{"ev": "coll", "cid": 1, "comm": "tp", "seq": 2, "op": "x", "stream": "c", "bufs": []}', "duplicate cid 1"),
    ('{"ev": "alloc", "id": 1, "addr": 0, "size": 1, "stream": "s0", "pool": 0}', "which is live"),
    ('{"ev": "launch"}', "missing field 'stream'"),
    ('{"t": 5}', "missing field 'ev'"),
    ('{"ev": ["alloc"]}', "field 'ev' must be a string"),
    ('{"ev": "coll", "cid": 9, "comm": "tp", "seq": 2, "op": "x", "stream": "c", "bufs": []}\n'
     '{"ev": "coll", "cid": 8, "comm": "tp", "seq": 3, "op": "x", "stream": "c", "bufs": []}\n'
     '{"ev": "coll", "cid": 2, "comm": "tp", "seq": 4, "op": "x", "stream": "c", "bufs": []}\n'
     '{"ev": "coll", "cid": 9, "comm": "tp", "seq": 5, "op": "x", "stream": "c", "bufs": []}', "duplicate cid 9"),
    ('{"ev": "launch", "stream": "s0", "reads": [[1]]}', "lists of [addr, size]"),
])
def test_contract_violations_are_malformed(tmp_path, capsys, body, needle):
    t = Trace()
    t.alloc(1, 0x1000, 4096, stream="s0")
    t.coll(1, stream="comm", bufs=[(0x1000, 4096, "r")])
    p = t.write(tmp_path / "v.jsonl")
    p.write_text(p.read_text() + body + "\n")
    a = analyze([p])
    assert a.exit_code() == 2
    assert [(e.line, needle in e.message) for e in a.errors] == [(4 + body.count("\n"), True)], [str(e) for e in a.errors]


def test_unknown_kinds_and_fields_are_counted_warnings(tmp_path):
    t = clean_trace()
    t.ev("kernel_profile", name="x")
    t.ev("kernel_profile", name="y")
    t.alloc(9, 0x9000, 64, stream="s0", color="blue")
    a = analyze([t.write(tmp_path / "u.jsonl")])
    assert a.exit_code() == 0 and a.errors == []
    assert any("2 event(s) of unknown kind 'kernel_profile'" in w for w in a.warnings)
    assert any("unknown field 'color' ignored in 1 event(s)" in w for w in a.warnings)


def test_truncated_last_line_is_a_warning(tmp_path, capsys):
    t = hazard_trace()
    t.ev("free", id=2)
    p = t.write(tmp_path / "cut.jsonl", cut_last=3)
    code, out, _ = check(capsys, p)
    assert code == 1  # the findings before the cut still count
    assert "trace truncated" in out and f"{p}:6:" in out


def test_truncated_gzip_is_a_warning(tmp_path):
    t = clean_trace()
    for i in range(2, 2000):
        t.alloc(i, 0x100000 + 64 * i, 64, stream="s0")
    p = t.write(tmp_path / "cut.jsonl.gz", gz=True)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) * 2 // 3])
    a = analyze([p])
    assert a.errors == [] and any("trace truncated" in w for w in a.warnings)
    assert 0 < a.summary["events"] < 2002


def test_bad_headers(tmp_path):
    p = tmp_path / "h.jsonl"
    for text, needle in [("", "empty file"), ('{"rank": 0}\n', "not a hazsan trace"),
                         ('{"hazsan": 2}\n', "unsupported schema version 2"), ("[1,2\n", "header is not JSON")]:
        p.write_text(text)
        a = analyze([p])
        assert a.exit_code() == 2 and needle in str(a.errors[0]) and ":1:" in str(a.errors[0])


def test_dropped_events_and_hook_errors_reach_the_report(tmp_path, capsys):
    t = clean_trace()
    t.ev("dropped", count=17, reason="HAZSAN_MAX_EVENTS")
    t.ev("hook_error", count=2, hook="dispatch", error="RuntimeError: boom")
    code, out, _ = check(capsys, t.write(tmp_path / "d.jsonl"))
    assert "dropped 17 event(s)" in out and "2 capture hook error(s)" in out


def test_memory_stays_bounded_by_in_flight_work(tmp_path):
    """A long decode trace: in-flight ops are retired at each sync, live blocks freed."""
    t = Trace()
    for step in range(500):
        t.ev("step", n=step)
        for layer in range(10):
            bid = step * 100 + layer
            addr = 0x100000 + layer * 8192
            t.alloc(bid, addr, 4096, stream="s0")
            t.launch("s0", writes=[(addr, 4096)])
            t.ev("record", event="e", stream="s0")
            t.ev("wait", event="e", stream="comm")
            t.coll(step * 10 + layer, stream="comm", bufs=[(addr, 4096, "rw")])
            t.ev("record", event="f", stream="comm")
            t.ev("wait", event="f", stream="s0")
            t.free(bid)
        t.ev("sync")
    trace = open_trace(t.write(tmp_path / "long.jsonl"))
    sink = FindingSink()
    an = RankAnalyzer(str(trace.path), trace.rank, sink, CollectiveMatcher(sink, enabled=False))
    peak = 0
    decoded = []
    for first, raws in trace.line_batches():
        decoded.extend(enumerate(EventDecoder().decode(first, raws, []), first))
    for line, ev in decoded:
        an.feed(line, ev)
        inflight = sum(len(fl.epochs) - fl.start for fl in an.inflight.streams.values())
        stored = sum(len(fl.epochs) for fl in an.inflight.streams.values())
        peak = max(peak, stored)
        assert inflight <= 20
    assert sink.findings == [] and len(an.live) == 0 and len(an.colls_in_flight) == 0
    assert peak <= 2 * (1024 + 20)  # two streams, compacted; nothing grows with the 500 steps
    assert an.cids.other == set()  # consecutive cids are remembered as one run


def test_python_dash_m_sanitizer_works(tmp_path):
    p = hazard_trace().write(tmp_path / "r.jsonl")
    r = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(p), "--format", "json"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and json.loads(r.stdout)["summary"]["by_rule"]["reuse-in-flight"] == 1


def test_internal_error_is_one_line_exit_2_unless_raise_is_set(monkeypatch, capsys, tmp_path):
    """A bug in a command (here: the check command's run made to raise) ends as one line and exit
    2 for a user; with HAZSAN_RAISE set (the suite sets it) the exception propagates."""
    import sanitizer.commands.check as check_cmd
    from sanitizer.cli import main as cli_main

    def broken(args):
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(check_cmd, "run", broken)
    trace = tmp_path / "rank0.jsonl"
    trace.write_text('{"hazsan": 1, "rank": 0, "world_size": 1}\n')
    with pytest.raises(ZeroDivisionError):
        cli_main(["check", str(trace)])
    monkeypatch.delenv("HAZSAN_RAISE")
    assert cli_main(["check", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("hazsan check: internal error: ZeroDivisionError: boom")


def test_suppressions_generated_then_filled_in_accept_exactly_their_findings(tmp_path, capsys):
    bad = hazard_trace().write(tmp_path / "bad.jsonl")
    code, out, _ = check(capsys, bad, "--gen-suppressions")
    assert code == 1
    entries = out[out.index("# hazsan suppressions"):]
    gen = tmp_path / "allow.toml"
    gen.write_text(entries)
    # as generated, every reason is empty: refused, naming file and line, until someone says why
    code, _, err = check(capsys, bad, "--suppressions", gen)
    assert code == 2 and f"{gen}:" in err and "reason" in err
    # the free's entry filled in: that finding is suppressed and counted, the other still fails
    text = entries.split("[[allow]]")
    free_entry = next(e for e in text if 'rule = "free-in-flight"' in e)
    gen.write_text("[[allow]]" + free_entry.replace('reason = ""', 'reason = "the test\'s own"'))
    code, out, _ = check(capsys, bad, "--suppressions", gen, "--format", "json")
    doc = json.loads(out)
    assert code == 1 and doc["summary"]["by_rule"] == {"reuse-in-flight": 1}
    assert doc["summary"]["suppressed"] == 1 and doc["summary"]["suppressed_by_rule"] == {"free-in-flight": 1}
    code, out, _ = check(capsys, bad, "--suppressions", gen)
    assert out.strip().splitlines()[-1].endswith("; 1 finding(s); 1 suppressed")
    # --jobs gives the same, per file (two copies: two suppressed, two left)
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(bad.read_bytes())
    code, out, _ = check(capsys, bad, copy, "--suppressions", gen, "--jobs", "2", "--format", "json")
    doc = json.loads(out)["summary"]
    assert doc["suppressed"] == 2 and doc["by_rule"] == {"reuse-in-flight": 2}


def test_log_file_rule_and_colour(tmp_path, capsys):
    bad = hazard_trace().write(tmp_path / "bad.jsonl")
    log = tmp_path / "report.txt"
    code, out, err = check(capsys, bad, "-o", log)
    assert code == 1 and out == "" and "hazsan ERROR: reuse-in-flight" in log.read_text()
    assert err.startswith("SUMMARY: hazsan: reuse-in-flight") and str(log) in err
    code, out, _ = check(capsys, bad, "--rule", "free-in-flight")
    assert code == 1 and "reuse-in-flight" not in out.split("SUMMARY")[0].split("=" * 78)[-2]
    code, out, _ = check(capsys, bad, "--color", "always")
    assert "\x1b[1;31mhazsan ERROR: reuse-in-flight" in out
    code, out, _ = check(capsys, bad)
    assert "\x1b[" not in out                       # not a terminal: plain


def test_version_and_exit_codes_in_help(capsys):
    from sanitizer import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"hazsan {__version__}"
    for argv, words in ((["--help"], "exit status"), (["check", "--help"], "(--allow-incomplete: 0)"),
                        (["run", "--help"], "its own exit status")):
        with pytest.raises(SystemExit):
            main(argv)
        assert words in capsys.readouterr().out.replace("\n", " ").replace("  ", " "), argv
