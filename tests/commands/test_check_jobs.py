"""`hazsan check --jobs N`: rank files analysed in parallel processes and joined give what the
serial engine gives (findings, counts, summary, warnings, errors), asymmetric-offset included."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from sanitizer.cli import main
from sanitizer.rules.driver import analyze
from sanitizer.rules.parallel import analyze_parallel

from tracebuilder import Trace

ROOT = Path(__file__).resolve().parents[2]
ASYM = ROOT / "examples" / "traces" / "asymmetric-offset"


def _same(serial, parallel):
    assert [f.to_dict() for f in parallel.findings] == [f.to_dict() for f in serial.findings]
    assert parallel.summary == serial.summary
    assert sorted(map(str, parallel.errors)) == sorted(map(str, serial.errors))


def _gen(out: Path, ranks: int, events: int, inject: int):
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gen_decode_trace.py"), "--events", str(events),
                    "--ranks", str(ranks), "--inject", str(inject), "--out", str(out)],
                   check=True, capture_output=True)
    for extra in ("meta.json", "expected.json"):
        (out / extra).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def decode_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode")
    _gen(out, 3, 20000, 4)
    return out


def test_jobs_matches_serial_on_the_asymmetric_offset_example():
    serial = analyze([str(ASYM)], max_per_group=0)
    assert serial.summary["by_rule"].get("asymmetric-offset")
    _same(serial, analyze_parallel([str(ASYM)], jobs=2, max_per_group=0))


def test_jobs_matches_serial_on_decode_traces_with_planted_hazards(decode_dir):
    serial = analyze([str(decode_dir)], max_per_group=0)
    assert serial.summary["ranks"] == 3 and serial.summary["findings"] > 0
    _same(serial, analyze_parallel([str(decode_dir)], jobs=2, max_per_group=0))
    # capped listing: counts and warnings identical, listed per group at most the cap
    capped_serial = analyze([str(decode_dir)], max_per_group=1)
    capped = analyze_parallel([str(decode_dir)], jobs=3, max_per_group=1)
    assert capped.summary == capped_serial.summary
    assert len(capped.findings) == len(capped_serial.findings)


def test_jobs_finds_asymmetry_between_generated_ranks(decode_dir, tmp_path):
    # shift one all-reduce's window buffer on rank 1: the same (comm, seq) at another offset
    d = tmp_path / "asym"
    shutil.copytree(decode_dir, d)
    lines = (d / "rank1.jsonl").read_bytes().splitlines()
    for i, raw in enumerate(lines[1:], 1):
        ev = orjson.loads(raw)
        if ev.get("ev") == "coll" and ev.get("seq") == 200:
            ev["bufs"][0]["addr"] += 512
            ev["bufs"][0]["size"] -= 512
            lines[i] = orjson.dumps(ev)
            break
    (d / "rank1.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    serial = analyze([str(d)], max_per_group=0)
    assert serial.summary["by_rule"].get("asymmetric-offset") == 1
    _same(serial, analyze_parallel([str(d)], jobs=2, max_per_group=0))


def test_jobs_matches_serial_on_bad_input(tmp_path):
    t = Trace(rank=0, world_size=2)
    t.alloc(1, 0x1000, 256)
    t.free(7)                                   # unknown id: malformed
    t.ev("coll", cid=1)                         # missing fields: malformed
    t.write(tmp_path / "rank0.jsonl")
    u = Trace(rank=0, world_size=2)             # the same rank again
    u.alloc(1, 0x1000, 256)
    u.write(tmp_path / "rank0b.jsonl")
    (tmp_path / "rank2.jsonl").write_text("not a header\n")
    for lenient in (False, True):
        serial = analyze([str(tmp_path)], lenient=lenient, max_per_group=0)
        assert serial.errors
        _same(serial, analyze_parallel([str(tmp_path)], jobs=2, lenient=lenient, max_per_group=0))


def test_check_cli_jobs_json_equals_serial(decode_dir, capsys):
    rc1 = main(["check", str(decode_dir), "--format", "json", "--max-per-group", "0"])
    out1 = json.loads(capsys.readouterr().out)
    rc2 = main(["check", str(decode_dir), "--format", "json", "--max-per-group", "0", "--jobs", "2"])
    out2 = json.loads(capsys.readouterr().out)
    assert rc1 == rc2 == 1
    assert out1 == out2


def test_progress_bar_only_on_a_terminal(decode_dir):
    cmd = [sys.executable, "-m", "sanitizer", "check", str(decode_dir), "--jobs", "2", "--format", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True)       # stderr is a pipe: no bar
    assert done.returncode == 1 and "hazsan check" not in done.stderr
    import pty
    import fcntl
    import struct
    import termios
    master, slave = pty.openpty()                                      # stderr is a terminal: a bar
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:            # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    assert proc.wait() == 1
    assert b"hazsan check:" in seen and b"%|" in seen, seen


def test_jobs_counts_collectives_missing_on_a_rank_as_serial_does(decode_dir, tmp_path):
    d = tmp_path / "short"
    shutil.copytree(decode_dir, d)
    lines = (d / "rank2.jsonl").read_bytes().splitlines()
    (d / "rank2.jsonl").write_bytes(b"\n".join(lines[: len(lines) // 2]) + b"\n")   # rank 2 stopped early
    serial = analyze([str(d)], max_per_group=0)
    assert any("were not seen on every rank" in w for w in serial.warnings)
    _same(serial, analyze_parallel([str(d)], jobs=2, max_per_group=0))


def test_driver_matcher_seam_sees_every_collective_of_one_file():
    # the seam --jobs uses: analyze(matcher=factory) hands each collective's signature to it
    from sanitizer.rules.parallel import SignatureRecorder

    rank1 = ASYM / "rank1.jsonl"
    colls = [orjson.loads(raw) for raw in rank1.read_bytes().splitlines()[1:]]
    colls = [ev for ev in colls if ev.get("ev") == "coll"]
    recorder = SignatureRecorder()
    made = []

    def factory(sink, enabled, ranks=None):
        made.append(enabled)
        return recorder

    a = analyze([str(rank1)], matcher=factory)
    assert made == [False]                         # one rank: nothing to match across ranks
    assert [(c[0], c[1]) for c in recorder.colls] == [(ev["comm"], ev["seq"]) for ev in colls]
    assert any(c[2] for c in recorder.colls)       # window signatures recorded
    assert "asymmetric-offset" not in a.summary["by_rule"]
