"""A mistyped field is a one-line error blamed on the line that holds it, exit 2, never a
traceback: on one rank and in the cross-rank comparison (issue 14). Decoding is msgspec's."""
from __future__ import annotations

import json
import pytest

from sanitizer.cli import main
from sanitizer.rules.driver import compiled_available

ENGINES = ["interpreted", "compiled"] if compiled_available()[0] else ["interpreted"]
WIN = 1 << 30


def write(tmp, ranks: list[list[dict]]):
    paths = []
    for r, events in enumerate(ranks):
        p = tmp / f"rank{r}.jsonl"
        lines = [{"hazsan": 1, "rank": r, "world_size": len(ranks)}, *events]
        p.write_bytes(b"\n".join(json.dumps(x).encode() for x in lines) + b"\n")
        paths.append(p)
    return paths


def coll(site="m.py:1:f", seq=1, comm="tp", addr=WIN):
    return {"ev": "coll", "cid": seq, "comm": comm, "seq": seq, "op": "all_reduce", "stream": 2, "site": site,
            "bufs": [{"addr": addr, "size": 64, "access": "rw"}]}


WINDOW = {"ev": "window", "addr": WIN, "size": 1 << 20, "comm": "tp"}
BAD_SITES = [["a", "b"], {"file": "m.py"}, 7]


def run_check(capsys, monkeypatch, engine, paths):
    monkeypatch.setenv("HAZSAN_ENGINE", engine)
    code = main(["check", "--format", "json", *map(str, paths)])
    out = capsys.readouterr()
    return code, out.err


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("site", BAD_SITES)
def test_bad_site_on_alloc_blames_the_alloc_line(tmp_path, capsys, monkeypatch, engine, site):
    paths = write(tmp_path, [[{"ev": "alloc", "id": 1, "addr": 4096, "size": 64, "stream": 0, "pool": None,
                               "site": site}, {"ev": "free", "id": 1}]])
    code, err = run_check(capsys, monkeypatch, engine, paths)
    assert code == 2
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error:" in line]
    # the first error is the alloc's line, naming the field (the free then frees an unknown id)
    assert f"{paths[0]}:2: alloc: field 'site'" in errors[0], err


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("site", BAD_SITES)
def test_bad_site_in_the_cross_rank_comparison(tmp_path, capsys, monkeypatch, engine, site):
    """Rank 1's collective differs in offset from rank 0's and holds a bad site: the comparison
    would make a finding with that site; the line is an error instead."""
    paths = write(tmp_path, [[WINDOW, coll()], [WINDOW, coll(site=site, addr=WIN + 256)]])
    code, err = run_check(capsys, monkeypatch, engine, paths)
    assert code == 2
    assert "Traceback" not in err
    assert any(f"{paths[1]}:3:" in line and "site" in line for line in err.splitlines()), err


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("field,value", [("seq", "1"), ("seq", [1]), ("comm", ["tp"]), ("comm", {"a": 1}),
                                         ("cid", 1.5), ("stream", None), ("op", 3)])
def test_mistyped_collective_field_across_ranks(tmp_path, capsys, monkeypatch, engine, field, value):
    bad = coll()
    bad[field] = value
    paths = write(tmp_path, [[WINDOW, coll()], [WINDOW, bad]])
    code, err = run_check(capsys, monkeypatch, engine, paths)
    assert code == 2
    assert "Traceback" not in err
    assert any(f"{paths[1]}:3:" in line and field in line for line in err.splitlines()), err


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("rng", [[4096, -1], [-4096, 64], [4096, 2**64], ["4096", 64], [4096]])
def test_bad_launch_range(tmp_path, capsys, monkeypatch, engine, rng):
    paths = write(tmp_path, [[{"ev": "launch", "stream": 0, "writes": [rng]}]])
    code, err = run_check(capsys, monkeypatch, engine, paths)
    assert code == 2
    assert "Traceback" not in err
    assert any(f"{paths[0]}:2:" in line and "writes" in line for line in err.splitlines()), err


@pytest.mark.parametrize("kind", ["dropped", "hook_error"])
def test_negative_capture_count_is_an_error_on_its_line(tmp_path, capsys, monkeypatch, kind):
    # a negative count would cancel a real loss and make an incomplete trace look complete
    [p] = write(tmp_path, [[{"ev": kind, "count": 5}, {"ev": kind, "count": -5}]])
    code, err = run_check(capsys, monkeypatch, ENGINES[-1], [p])
    assert code == 2
    assert f"{p}:3: {kind}: field 'count' must be an integer >= 0" in err
    assert "Traceback" not in err


def test_capture_counts_summed_past_64_bits_still_render_as_json(tmp_path, capsys, monkeypatch):
    big = (1 << 63) - 2
    [p] = write(tmp_path, [[{"ev": "hook_error", "count": big}] * 3])
    monkeypatch.setenv("HAZSAN_ENGINE", ENGINES[-1])
    code = main(["check", "--format", "json", str(p)])
    out = capsys.readouterr()
    assert code == 2, out.err                        # hook failures: no verdict without a finding
    assert f"{3 * big} capture hook failure(s) in {p}" in out.err
    doc = json.loads(out.out)
    assert doc["summary"]["hook_errors"] == 3 * big
    assert doc["summary"]["complete"] is False
