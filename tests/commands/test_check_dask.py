"""`hazsan check --scheduler ADDRESS` (issue 21, part 4): each rank file analysed on a Dask
distributed worker that reads it by path, the results joined here. On a LocalCluster of two
workers on the loopback interface: the same report as a serial run, and clear errors for a
scheduler that cannot be reached and a path no worker can read."""
from __future__ import annotations

import contextlib
import io
import json
import socket
import sys
from pathlib import Path

import pytest

distributed = pytest.importorskip("distributed")

from sanitizer.cli import main  # noqa: E402
from sanitizer.rules.dask_check import analyze_on_cluster, plan  # noqa: E402
from sanitizer.rules.driver import analyze  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def scheduler():
    """Two workers, one thread each, in this process (processes=False), loopback only."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=False, protocol="tcp://", host="127.0.0.1",
                                  dashboard_address=None, silence_logs=50) as cluster:
        yield cluster.scheduler_address


@pytest.fixture(scope="module")
def decode_traces(tmp_path_factory):
    """Two ranks of the decode trace with planted hazards: rank 0 binary, rank 1 JSON Lines."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gen_decode_trace as gen

    d = tmp_path_factory.mktemp("dask")
    gen.generate(d / "b", events=12_000, ranks=2, inject=6, fmt="binary")
    gen.generate(d / "j", events=12_000, ranks=2, inject=6)
    out = d / "mixed"
    out.mkdir()
    (out / "rank0.hzs").write_bytes((d / "b" / "rank0.hzs").read_bytes())
    (out / "rank1.jsonl").write_bytes((d / "j" / "rank1.jsonl").read_bytes())
    return out


def _run(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _same(a, b):
    assert [f.to_dict() for f in a.findings] == [f.to_dict() for f in b.findings]
    assert a.summary == b.summary
    assert [str(e) for e in a.errors] == [str(e) for e in b.errors]


@pytest.mark.parametrize("name", ["asymmetric-offset", "free-in-flight.jsonl"])
def test_examples_give_the_serial_report(scheduler, name):
    path = ROOT / "examples" / "traces" / name
    _same(analyze_on_cluster([path], scheduler=scheduler), analyze([path]))


def test_decode_trace_with_planted_hazards_gives_the_serial_report(scheduler, decode_traces):
    serial = analyze([decode_traces])
    assert serial.summary["by_rule"] and serial.summary["ranks"] == 2
    _same(analyze_on_cluster([decode_traces], scheduler=scheduler), serial)
    # successor mode: thousands of findings per call site; all listed, since which 100 of them a
    # split run lists may differ (docs/cli.md, --jobs; the counts never do)
    _same(analyze_on_cluster([decode_traces], scheduler=scheduler, peer_completion="successor", max_per_group=0),
          analyze([decode_traces], peer_completion="successor", max_per_group=0))


def test_command_line_output_is_the_serial_one(scheduler, decode_traces):
    serial = _run("check", decode_traces, "--format", "json")
    cluster = _run("check", decode_traces, "--format", "json", "--scheduler", scheduler)
    assert cluster[0] == serial[0] == 1
    assert json.loads(cluster[1]) == json.loads(serial[1])


def test_malformed_lines_and_lenient_as_serial(scheduler, tmp_path):
    (tmp_path / "rank0.jsonl").write_text('{"hazsan": 1, "rank": 0}\n{"ev": "free", "id": 9}\n{"ev": "launch"}\n')
    (tmp_path / "rank1.jsonl").write_text('{"hazsan": 1, "rank": 1}\n{"ev": "step", "n": 0}\n')
    for lenient in (False, True):
        _same(analyze_on_cluster([tmp_path], scheduler=scheduler, lenient=lenient), analyze([tmp_path], lenient=lenient))


def test_a_path_no_worker_can_read_is_an_error(scheduler, tmp_path):
    code, out, err = _run("check", tmp_path / "nope", "--scheduler", scheduler, "--format", "json")
    assert code == 2 and "nope: no Dask worker can read it (" in err and "no such file" in err
    assert json.loads(out)["summary"]["errors"] == [f"{tmp_path / 'nope'}: no Dask worker can read it "
                                                    "(no such file or directory)"]


def test_an_unreachable_scheduler_is_a_clear_error(tmp_path):
    with socket.socket() as s:          # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, out, err = _run("check", ROOT / "examples" / "traces" / "clean.jsonl", "--scheduler",
                          f"tcp://127.0.0.1:{port}", "--scheduler-timeout", "1")
    assert code == 2 and out == ""
    assert f"hazsan check: error: cannot reach the Dask scheduler at 'tcp://127.0.0.1:{port}' within 1 s" in err
    assert "Traceback" not in err


def test_jobs_and_scheduler_together_are_refused(tmp_path):
    code, _, err = _run("check", tmp_path, "--jobs", "2", "--scheduler", "tcp://127.0.0.1:1")
    assert code == 2 and "give one of them" in err


def test_plan_reads_each_file_once_where_it_is():
    """Workers a and b on one machine see /shared/rank0 (the same bytes); /data/rank1 is on a only;
    /data/rank2 exists on both machines with different bytes: two files."""
    listing = {
        "tcp://a": {"files": [(0, "/shared/rank0.hzs", 10, "d0"), (1, "/data/rank1.hzs", 50, "d1"),
                              (1, "/data/rank2.hzs", 5, "x")], "missing": []},
        "tcp://b": {"files": [(0, "/shared/rank0.hzs", 10, "d0"), (1, "/data/rank2.hzs", 5, "y")],
                    "missing": [(2, "/elsewhere: no such file or directory")]},
        "tcp://c": {"files": [], "missing": [(0, "/shared: no such file"), (1, "/data: no such file"),
                                            (2, "/elsewhere: no such file or directory")]},
    }
    tasks, errors = plan(listing, ["/shared", "/data", "/elsewhere"])
    assert [p for _, p in tasks] == ["/shared/rank0.hzs", "/data/rank1.hzs", "/data/rank2.hzs", "/data/rank2.hzs"]
    assert tasks[1] == ("tcp://a", "/data/rank1.hzs")                  # only a has it
    assert {w for w, p in tasks if p == "/data/rank2.hzs"} == {"tcp://a", "tcp://b"}
    assert [str(e) for e in errors] == ["/elsewhere: no Dask worker can read it (/elsewhere: no such file or directory)"]
