"""Limits on what one rank may hold (issue 14): distinct streams, events and communicators. One
more than the limit is a one-line error naming file and line, exit 2; each limit has an option."""
from __future__ import annotations

import json

import pytest

from sanitizer.cli import main
from sanitizer.limits import Limits
from sanitizer.rules.driver import analyze, compiled_available

ENGINES = ["interpreted", "compiled"] if compiled_available()[0] else ["interpreted"]


def trace(tmp_path, kind: str, n: int):
    lines = [{"hazsan": 1, "rank": 0, "world_size": 1}]
    for i in range(n):
        if kind == "streams":
            lines.append({"ev": "launch", "stream": i, "op": "k"})
        elif kind == "events":
            lines.append({"ev": "record", "event": i, "stream": 0})
        else:
            lines.append({"ev": "window", "addr": 4096 * (i + 1), "size": 64, "comm": f"c{i}"})
    p = tmp_path / "rank0.jsonl"
    p.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return p


FLAG = {"streams": "--max-streams", "events": "--max-event-ids", "comms": "--max-comms"}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["streams", "events", "comms"])
def test_one_more_than_the_limit_is_an_error_on_its_line(tmp_path, capsys, monkeypatch, engine, kind):
    monkeypatch.setenv("HAZSAN_ENGINE", engine)
    p = trace(tmp_path, kind, 6)
    code = main(["check", FLAG[kind], "5", str(p)])
    out = capsys.readouterr()
    err = out.out + out.err
    assert code == 2
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert f"{p}:7:" in errors[0] and FLAG[kind] in errors[0] and "limit of 5 " in errors[0]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["streams", "events", "comms"])
def test_at_the_limit_is_clean_and_the_default_is_generous(tmp_path, capsys, monkeypatch, engine, kind):
    monkeypatch.setenv("HAZSAN_ENGINE", engine)
    p = trace(tmp_path, kind, 5)
    assert main(["check", FLAG[kind], "5", str(p)]) == 0
    p = trace(tmp_path, kind, 2000)
    assert main(["check", str(p)]) == 0
    assert getattr(Limits(), f"max_{kind}") == 100_000


@pytest.mark.parametrize("kind", ["streams", "events", "comms"])
def test_limits_are_a_value_passed_to_analyze(tmp_path, kind):
    """A command's limits do not outlive it: analyze() takes them as a value, and a later call
    without them has the defaults."""
    p = trace(tmp_path, kind, 6)
    assert main(["check", FLAG[kind], "5", str(p)]) == 2
    assert analyze([p]).exit_code() == 0
    a = analyze([p], limits=Limits(**{f"max_{kind}": 5}))
    assert a.exit_code() == 2 and "limit of 5 " in str(a.errors[0])


def test_limit_option_rejects_nonsense(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["check", "--max-streams", "0", "x.jsonl"])
    assert exc.value.code == 2
