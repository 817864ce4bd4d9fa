"""The HTML report's bars and the Perfetto export's collective slices end where the engine says
the collective is done, under both `--peer-completion` modes (issue 28 item 1: the renderings ran
clocks of their own, by other rules, and ignored the mode).

A bar or slice must never end before a finding that says its collective is still in flight, and
must end at the line where the engine retires it (done for the host: no stream can see it
unfinished again)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("matplotlib")

import sanitizer.report.html as html_report
from sanitizer.cli import main
from sanitizer.rules.driver import analyze

from tracebuilder import Trace

WIN = 0x10000
MODES = ("local", "successor")


def _successor_trace(t: Trace) -> dict:
    """A window buffer locally complete (its coll_done) and then freed: `successor` says it is
    still in flight until the later collective on the communicator completes."""
    t.alloc(1, WIN, 4096, stream="s0", pool="symm")
    t.ev("window", addr=WIN, size=1 << 20, comm="tp")
    coll = t.coll(1, stream="nccl:tp", comm="tp", seq=0, bufs=[(WIN, 1024, "rw")])
    local_done = t.ev("coll_done", cid=1)
    t.free(1)
    t.coll(2, stream="nccl:tp", comm="tp", seq=1)
    successor_done = t.ev("coll_done", cid=2)
    t.launch(stream="s0")
    return {"coll": coll, "local": local_done, "successor": successor_done}


def _other_stream_trace(t: Trace) -> dict:
    """A window buffer seen finished by another stream (s1 waits on it) but not by the block's
    stream nor the host: the free on s0 is free-in-flight in both modes, so the collective is not
    done at the free whatever another stream saw."""
    t.alloc(1, WIN, 4096, stream="s0", pool="symm")
    t.ev("window", addr=WIN, size=1 << 20, comm="tp")
    coll = t.coll(1, stream="nccl:tp", comm="tp", seq=0, bufs=[(WIN, 1024, "rw")])
    t.ev("record", event="e1", stream="nccl:tp")
    t.ev("wait", event="e1", stream="s1")
    t.free(1)
    local_done = t.ev("coll_done", cid=1)
    t.coll(2, stream="nccl:tp", comm="tp", seq=1)
    successor_done = t.ev("coll_done", cid=2)
    t.launch(stream="s0")
    return {"coll": coll, "local": local_done, "successor": successor_done}


SCENARIOS = {"successor": _successor_trace, "other-stream": _other_stream_trace}


def _bars_by_line(timelines) -> dict:
    """coll line -> end line of its bar(s) (one window here)."""
    out = {}
    for tl in timelines:
        for w in tl.windows:
            for start, end, *_ in w.colls:
                out.setdefault(start, set()).add(end)
    return out


def _report_timelines(path, tmp_path, mode, monkeypatch) -> list:
    """What `hazsan report --peer-completion MODE` draws: the timelines render_html reads."""
    seen = []
    real = html_report.read_timelines

    def spy(*args, **kwargs):
        got = real(*args, **kwargs)
        seen.append(got)
        return got

    monkeypatch.setattr(html_report, "read_timelines", spy)
    main(["report", str(path), "-o", str(tmp_path / f"{mode}.html"), "--peer-completion", mode])
    assert len(seen) == 1
    return seen[0]


def _perfetto_slices(path, tmp_path, mode) -> tuple[dict, list]:
    """(coll line -> (start ts, end ts)), finding instants) of `hazsan export --perfetto`."""
    out = tmp_path / f"{mode}.json"
    assert main(["export", "--perfetto", str(path), "-o", str(out), "--peer-completion", mode]) == 0
    events = json.loads(out.read_bytes())["traceEvents"]
    slices = {e["args"]["line"]: (e["ts"], e["ts"] + e["dur"]) for e in events
              if e["ph"] == "X" and e.get("cat") == "coll"}
    return slices, [e for e in events if e["ph"] == "i"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_bars_and_slices_end_where_the_engine_retires_the_collective(scenario, mode, tmp_path, monkeypatch):
    t = Trace(rank=0, world_size=1)
    lines = SCENARIOS[scenario](t)
    path = t.write(tmp_path / "rank0.jsonl")
    findings = analyze([path], peer_completion=mode).findings
    in_flight_at = [f.line for f in findings if f.op is not None and f.op.line == lines["coll"]]
    if scenario == "successor":
        # the point of the mode: the free is a hazard only under `successor`
        assert in_flight_at == ([lines["local"] + 1] if mode == "successor" else []), findings
    else:
        assert in_flight_at == [lines["local"] - 1], findings
    done = lines[mode]

    bars = _bars_by_line(_report_timelines(path, tmp_path, mode, monkeypatch))
    assert bars == {lines["coll"]: {done}}, (bars, lines)
    for line in in_flight_at:
        assert all(end > line for end in bars[lines["coll"]])

    slices, instants = _perfetto_slices(path, tmp_path, mode)
    start, end = slices[lines["coll"]]
    # a file without `t` counts one microsecond a line, the first event (line 2) at 1
    assert end == done - 1, (slices, lines)
    assert sorted(i["args"]["line"] for i in instants) == sorted(f.line for f in findings)
    for i in instants:
        if i["args"]["line"] in in_flight_at:
            assert start <= i["ts"] < end


def test_report_model_follows_the_mode_without_the_cli(tmp_path):
    """read_timelines itself takes the mode (the HTML report passes the analysis's)."""
    t = Trace(rank=0, world_size=1)
    lines = _successor_trace(t)
    path = t.write(tmp_path / "rank0.jsonl")
    for mode in MODES:
        got = _bars_by_line(html_report.read_timelines([path], peer_completion=mode))
        assert got == {lines["coll"]: {lines[mode]}}
