"""`hazsan place` end to end: CPU traces whose addresses mean nothing become GPU placements."""
import gzip
from pathlib import Path

import orjson
import pytest

from sanitizer.cli import main
from sanitizer.place import MB
from sanitizer.place.replay import FOREIGN_BASE
from sanitizer.rules.driver import analyze

HEADER = {"hazsan": 1, "rank": 0, "world_size": 1, "device": "cpu"}


def write(path, events, header=HEADER):
    lines = [orjson.dumps(header)] + [orjson.dumps(e) for e in events]
    data = b"\n".join(lines) + b"\n"
    if str(path).endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def read(path):
    raw = path.read_bytes()
    if str(path).endswith(".gz"):
        raw = gzip.decompress(raw)
    rows = [orjson.loads(x) for x in raw.splitlines()]
    return rows[0], rows[1:]


def place(tmp_path, events, *extra, name="rank0.jsonl"):
    src = tmp_path / "in"
    src.mkdir(exist_ok=True)
    write(src / name, events)
    out = tmp_path / "out"
    rc = main(["place", str(src / name), "--out", str(out), "--quiet", *extra])
    assert rc == 0
    return read(out / name)


def allocs(events):
    return {e["id"]: e for e in events if e["ev"] == "alloc"}


# A collective on stream 8 still runs when block 1 (stream 7) is freed and a same-size block is
# allocated. The CPU allocator put the second block elsewhere, so the raw trace shows no collision;
# the caching allocator hands out the same bytes, which `hazsan check` must then report.
COLLISION = [
    {"ev": "step", "n": 0, "tokens": 4},
    {"ev": "alloc", "id": 1, "addr": 1_000_000, "size": 4096, "stream": 7, "pool": "default"},
    {"ev": "coll", "cid": 1, "comm": "tp", "seq": 0, "op": "all_reduce", "stream": 8,
     "bufs": [{"addr": 1_000_000, "size": 4096, "access": "rw"}]},
    {"ev": "free", "id": 1},
    {"ev": "alloc", "id": 2, "addr": 5_000_000, "size": 4000, "stream": 7, "pool": "default"},
    {"ev": "launch", "stream": 7, "writes": [[5_000_100, 64]]},
]


def test_cpu_addresses_become_a_collision_that_check_finds(tmp_path, capsys):
    header, out = place(tmp_path, COLLISION)
    assert header["placed"]["by"] == "hazsan place"
    a = allocs(out)
    assert a[1]["addr"] == a[2]["addr"]                  # same block, same bytes
    seg = [e for e in out if e["ev"] == "segment"]
    assert len(seg) == 1 and out.index(seg[0]) < out.index(a[1])
    assert seg[0]["size"] == 2 * MB and a[1]["segment"] == seg[0]["addr"]
    coll = next(e for e in out if e["ev"] == "coll")
    assert coll["bufs"][0]["addr"] == a[1]["addr"]
    launch = next(e for e in out if e["ev"] == "launch")
    assert launch["writes"] == [[a[2]["addr"] + 100, 64]]   # same offset within the block

    raw = analyze([tmp_path / "in"]).summary["by_rule"]
    placed = analyze([tmp_path / "out"]).summary["by_rule"]
    assert raw.get("reuse-in-flight", 0) == 0 and raw.get("free-in-flight") == 1
    assert placed.get("reuse-in-flight") == 1 and placed.get("free-in-flight") == 1
    capsys.readouterr()
    assert main(["check", str(tmp_path / "out")]) == 1
    # the unplaced trace: its early free is an error of its own, the collision only placement shows
    assert main(["check", str(tmp_path / "in")]) == 1
    assert main(["check", "--rule", "reuse-in-flight", str(tmp_path / "in")]) == 0


def test_record_stream_block_unavailable_until_free_done(tmp_path):
    ev = [
        {"ev": "alloc", "id": "a", "addr": 100, "size": 4096, "stream": 0, "pool": "default"},
        {"ev": "record_stream", "id": "a", "stream": 1},
        {"ev": "free", "id": "a"},
        {"ev": "alloc", "id": "b", "addr": 100, "size": 4096, "stream": 0, "pool": "default"},
        {"ev": "free_done", "id": "a"},
        {"ev": "alloc", "id": "c", "addr": 100_000, "size": 4096, "stream": 0, "pool": "default"},
    ]
    _, out = place(tmp_path, ev)
    a = allocs(out)
    assert a["b"]["addr"] == a["a"]["addr"] + 4096
    assert a["c"]["addr"] == a["a"]["addr"]


def test_symmetric_scope_places_blocks_in_the_window_and_check_sees_transients(tmp_path):
    W = 0x5000_0000
    ev = [
        {"ev": "window", "addr": W, "size": 64 * MB, "comm": "tp"},
        {"ev": "scope", "name": "symm", "enter": True, "pool": "symm", "comm": "tp"},
        {"ev": "alloc", "id": "out", "addr": 9_000_000, "size": 1 * MB, "stream": 0, "pool": "default"},
        {"ev": "alloc", "id": "tmp", "addr": 12_000_000, "size": 3 * MB, "stream": 0, "pool": "default",
         "site": "mhc.py:2743:mhc_combine"},
        # another group's collective issued while tmp lives: peers may write the window then
        # (transient-in-window asks for that exposure; its buffers do not matter here)
        {"ev": "coll", "cid": 0, "comm": "ep", "seq": 0, "op": "all_reduce", "stream": 0, "bufs": []},
        {"ev": "free", "id": "tmp"},
        {"ev": "scope", "name": "symm", "enter": False},
        {"ev": "coll", "cid": 1, "comm": "tp", "seq": 0, "op": "all_reduce", "stream": 0,
         "bufs": [{"addr": 9_000_000, "size": 1 * MB, "access": "rw"}]},
        {"ev": "alloc", "id": "plain", "addr": 9_000_000 + 2 * MB, "size": 4096, "stream": 0, "pool": "default"},
    ]
    _, out = place(tmp_path, ev)
    win = next(e for e in out if e["ev"] == "window")
    a = allocs(out)
    assert a["out"]["pool"] == a["tmp"]["pool"] == "symm"
    assert a["out"]["addr"] - win["addr"] == 0            # window offsets: small segment first
    assert a["tmp"]["addr"] - win["addr"] == 2 * MB       # then a 20 MiB large segment
    assert not (win["addr"] <= a["plain"]["addr"] < win["addr"] + win["size"])
    assert a["plain"]["pool"] == "default"
    segs = [e for e in out if e["ev"] == "segment"]
    assert [(s["pool"], s["size"]) for s in segs] == [("symm", 2 * MB), ("symm", 20 * MB), ("default", 2 * MB)]
    assert analyze([tmp_path / "in"]).summary["by_rule"].get("transient-in-window", 0) == 0
    assert analyze([tmp_path / "out"]).summary["by_rule"].get("transient-in-window") == 1


def test_symmetric_pool_segments_are_windows_input_registrations_replaced(tmp_path):
    ev = [
        {"ev": "scope", "name": "symm", "enter": True, "pool": "symm", "comm": "tp"},
        {"ev": "alloc", "id": 1, "addr": 7_000_000, "size": 8192, "stream": 0, "pool": "default"},
        {"ev": "alloc", "id": 2, "addr": 9_000_000, "size": 3 * MB, "stream": 0, "pool": "default"},
        {"ev": "scope", "name": "symm", "enter": False},
        {"ev": "window", "addr": 7_000_000, "size": 8192, "comm": "tp"},     # SGLang at scope exit
        {"ev": "window_free", "addr": 7_000_000, "comm": "tp"},
        {"ev": "alloc", "id": 3, "addr": 7_000_000, "size": 64, "stream": 0, "pool": "default"},
    ]
    _, out = place(tmp_path, ev)
    kinds = [e["ev"] for e in out]
    assert kinds == ["scope", "segment", "window", "alloc", "segment", "window", "alloc", "scope",
                     "segment", "alloc"]
    segs = [e for e in out if e["ev"] == "segment"]
    wins = [e for e in out if e["ev"] == "window"]
    assert [(w["addr"], w["size"], w["comm"]) for w in wins] == [(s["addr"], s["size"], "tp") for s in segs[:2]]
    assert [s["size"] for s in segs] == [2 * MB, 20 * MB, 2 * MB] and segs[2]["pool"] == "default"
    a = allocs(out)
    assert a[1]["addr"] == wins[0]["addr"] and a[2]["addr"] == wins[1]["addr"]


def test_preallocated_symmetric_segment_is_made_and_carved(tmp_path):
    # SGLang's SGLANG_SYMM_MEM_PREALLOC_GB_SIZE: a big segment in the pool, registered, no alloc
    ev = [
        {"ev": "alloc", "id": "w", "addr": 50, "size": 4096, "stream": 1, "pool": "default"},
        {"ev": "segment", "addr": 1 << 32, "size": 64 * MB, "pool": "symm"},
        {"ev": "scope", "name": "symm", "enter": True, "pool": "symm", "comm": "tp"},
        {"ev": "scope", "name": "symm", "enter": False},
        {"ev": "window", "addr": 1 << 32, "size": 64 * MB, "comm": "tp"},
        {"ev": "scope", "name": "symm", "enter": True, "pool": "symm", "comm": "tp"},
        {"ev": "alloc", "id": "big", "addr": (1 << 32) + 4096, "size": 12 * MB, "stream": 1, "pool": "default"},
        {"ev": "scope", "name": "symm", "enter": False},
    ]
    _, out = place(tmp_path, ev)
    wins = [e for e in out if e["ev"] == "window"]
    assert len(wins) == 1 and wins[0]["size"] == 64 * MB
    big = allocs(out)["big"]
    assert big["addr"] == wins[0]["addr"]               # carved from the cached preallocation
    assert sum(e["ev"] == "segment" for e in out) == 2  # default 2 MiB + the preallocation


def test_no_split_scope_and_graph_pool(tmp_path):
    ev = [
        {"ev": "scope", "name": "symm", "enter": True, "pool": "tsymm", "no_split": True},
        {"ev": "alloc", "id": 1, "addr": 10, "size": 4096, "stream": 0, "pool": "default"},
        {"ev": "alloc", "id": 2, "addr": 20_000, "size": 4096, "stream": 0, "pool": "default"},
        {"ev": "scope", "name": "symm", "enter": False},
        {"ev": "graph_begin", "graph": 3, "stream": 0},
        {"ev": "alloc", "id": 3, "addr": 10, "size": 4096, "stream": 0, "pool": "default"},
        {"ev": "graph_end", "graph": 3, "stream": 0},
        {"ev": "alloc", "id": 4, "addr": 10, "size": 4096, "stream": 0, "pool": "default"},
    ]
    _, out = place(tmp_path, ev)
    a = allocs(out)
    segs = {e["addr"]: e for e in out if e["ev"] == "segment"}
    assert a[2]["addr"] - a[1]["addr"] == 2 * MB           # no_split: one block per 2 MiB segment
    assert a[3]["pool"] == "graph:3" and segs[a[3]["segment"]]["pool"] == "graph:3"
    assert a[4]["pool"] == "default" and a[4]["segment"] not in (a[1]["segment"], a[3]["segment"])


def test_foreign_buffers_move_out_of_the_way_and_stale_pointers_stay_stale(tmp_path):
    ev = [
        {"ev": "alloc", "id": 1, "addr": 1000, "size": 4096, "stream": 0, "pool": "default"},
        {"ev": "free", "id": 1},
        {"ev": "launch", "stream": 0, "reads": [[1000 + 8, 8], [77, 4]]},
    ]
    _, out = place(tmp_path, ev)
    launch = out[-1]
    assert launch["reads"] == [[allocs(out)[1]["addr"] + 8, 8], [FOREIGN_BASE + 77, 4]]


def test_gzip_in_gzip_out_and_input_segments_replaced(tmp_path):
    ev = [{"ev": "segment", "addr": 0, "size": 1 << 30, "pool": "cpu"}] + COLLISION
    header, out = place(tmp_path, ev, name="rank0.jsonl.gz")
    assert [e["ev"] for e in out].count("segment") == 1
    assert next(e for e in out if e["ev"] == "segment")["pool"] == "default"


@pytest.mark.parametrize("events,needle", [
    ([{"ev": "free", "id": 9}], "rank0.jsonl:2: free of unknown id 9"),
    ([{"ev": "alloc", "id": 1, "addr": 0, "size": 8, "stream": 0, "pool": "default"}, {"ev": "free", "id": 1},
      {"ev": "free", "id": 1}],
     "rank0.jsonl:4: free of id 1, which is already freed"),
    ([{"ev": "alloc", "id": 1, "size": 8}], "rank0.jsonl:2: alloc: missing field 'addr'"),   # check's words
])
def test_bad_input_names_file_and_line(tmp_path, capsys, events, needle):
    write(tmp_path / "rank0.jsonl", events)
    assert main(["place", str(tmp_path / "rank0.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "o" / "rank0.jsonl").exists()


# A trace as `hazsan check` reads it: in both formats, a malformed alloc (a negative size) is
# refused by place with check's own line. An alloc without its required `pool` is malformed JSON
# Lines; the binary writer stores an absent pool as nil, the null the schema allows.
MALFORMED = [
    {"ev": "alloc", "id": 1, "addr": 4096, "size": 512, "stream": 0, "pool": "default", "site": "a.py:1:f"},
    {"ev": "alloc", "id": 2, "addr": 8192, "size": -8, "stream": 0, "pool": "default", "site": "a.py:2:g"},
    {"ev": "alloc", "id": 3, "addr": 9192, "size": 8, "stream": 0},
]


@pytest.mark.parametrize("name", ["rank0.jsonl", "rank0.hzs"])
def test_malformed_alloc_is_refused_by_place_with_checks_file_line_error(tmp_path, capsys, name):
    from sanitizer.trace import binary as B

    path = tmp_path / name
    if name.endswith(".hzs"):
        path.write_bytes(B.jsonl_to_binary(HEADER, MALFORMED))
    else:
        write(path, MALFORMED)
    capsys.readouterr()
    assert main(["check", str(path)]) == 2
    check = [line.removeprefix("hazsan: error: ") for line in capsys.readouterr().out.splitlines()
             if line.startswith("hazsan: error: ")]
    assert check[0].startswith(f"{path}:3: alloc: field 'size'") and "negative size" in check[0]
    if name.endswith(".jsonl"):
        assert len(check) == 2 and check[1] == f"{path}:4: alloc: missing field 'pool'"
    else:
        assert len(check) == 1
    assert main(["place", str(path), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"hazsan place: {check[0]}\n"      # the first refused line, same words
    assert not (tmp_path / "o" / "rank0.jsonl").exists()
    # the line check refuses is the only thing wrong: mended, both accept the trace
    mended = [MALFORMED[0], {**MALFORMED[1], "size": 8}, {**MALFORMED[2], "pool": None}]
    path.write_bytes(B.jsonl_to_binary(HEADER, mended)) if name.endswith(".hzs") else write(path, mended)
    assert main(["check", str(path)]) == 0
    assert main(["place", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 0


@pytest.mark.parametrize("intern", [False, True], ids=["binary-v1", "binary-v2"])
def test_binary_trace_places_as_its_json_lines_twin(tmp_path, intern):
    """A .hzs trace and the same events as JSON Lines place to the same events (described fields,
    interned in version 2, come out as their values), and check finds the collision in both."""
    from sanitizer.trace import binary as B

    events = [{**e, "site": f"model.py:{k}:f", "stack": [f"model.py:{k}:f", "run.py:1:main"]}
              for k, e in enumerate(COLLISION)]
    (tmp_path / "jl").mkdir()
    (tmp_path / "bin").mkdir()
    write(tmp_path / "jl" / "rank0.jsonl", events)
    (tmp_path / "bin" / "rank0.hzs").write_bytes(B.jsonl_to_binary(HEADER, events, intern=intern))
    for d in ("jl", "bin"):
        assert main(["place", str(tmp_path / d), "--out", str(tmp_path / f"{d}-out"), "--quiet"]) == 0
    _, from_jsonl = read(tmp_path / "jl-out" / "rank0.jsonl")
    _, from_binary = read(tmp_path / "bin-out" / "rank0.jsonl")   # rank0.hzs -> rank0.jsonl
    assert from_binary == from_jsonl
    assert allocs(from_binary)[2]["site"] == "model.py:4:f" and allocs(from_binary)[2]["stack"][1] == "run.py:1:main"
    assert allocs(from_binary)[1]["addr"] == allocs(from_binary)[2]["addr"]
    assert analyze([tmp_path / "bin-out"]).summary["by_rule"].get("reuse-in-flight") == 1


def test_unknown_kinds_and_fields_are_dropped_with_checks_warnings(tmp_path, capsys):
    """place reads what check reads: an unknown kind or field is ignored with check's warning, not
    carried into the placed trace."""
    events = [{**COLLISION[1], "colour": "red"}, {"ev": "mystery", "x": 1}, *COLLISION[2:]]
    write(tmp_path / "rank0.jsonl", events)
    assert main(["place", str(tmp_path / "rank0.jsonl"), "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "unknown field 'colour' ignored in 1 event(s)" in err
    assert "1 event(s) of unknown kind 'mystery' ignored" in err
    _, out = read(tmp_path / "o" / "rank0.jsonl")
    assert [e["ev"] for e in out] == ["segment", "alloc", "coll", "free", "alloc", "launch"]
    assert "colour" not in allocs(out)[1]


def test_unmodelled_allocator_setting_is_refused(tmp_path, capsys, monkeypatch):
    write(tmp_path / "rank0.jsonl", COLLISION)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert main(["place", str(tmp_path / "rank0.jsonl"), "--out", str(tmp_path / "o")]) == 2
    assert "expandable_segments:True is not modelled" in capsys.readouterr().err
    assert main(["place", str(tmp_path / "rank0.jsonl"), "--out", str(tmp_path / "o"),
                 "--alloc-conf", "max_split_size_mb:64", "--quiet"]) == 0


def test_requested_bytes_are_placed_and_size_becomes_the_model_block(tmp_path):
    # a trace from an allocator that made a 20 MiB block for 19 MiB (no split below 1 MiB + 1)
    ev = [
        {"ev": "alloc", "id": 1, "addr": 0, "size": 20 * MB, "requested": 19 * MB + 600 * 1024, "stream": 0,
         "pool": "default"},
        {"ev": "alloc", "id": 2, "addr": 20 * MB, "size": 4 * MB, "requested": 3 * MB, "stream": 0, "pool": "default"},
    ]
    _, out = place(tmp_path, ev)
    a = allocs(out)
    assert a[1]["size"] == 20 * MB and a[1]["requested"] == 19 * MB + 600 * 1024
    assert a[2]["size"] == 3 * MB                        # the model's block for 3 MiB (split)
    assert a[2]["segment"] != a[1]["segment"]            # the first 20 MiB segment is used up


EXAMPLES = sorted((p for p in (Path(__file__).parents[2] / "examples" / "traces").glob("*")
                   if p.suffix == ".jsonl" or p.is_dir()), key=str)


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_traces_keep_their_hazards_after_placement(tmp_path, example):
    """Placement moves blocks; it must not invent or lose the latent hazards, which are in the
    program order (and a clean trace stays clean)."""
    out = tmp_path / "out"
    assert main(["place", str(example), "--out", str(out), "--quiet"]) == 0
    raw = analyze([example]).summary["by_rule"]
    placed = analyze([out]).summary["by_rule"]
    for rule in ("free-in-flight", "transient-in-window", "graph-buffer-released"):
        assert placed.get(rule, 0) == raw.get(rule, 0), rule
    if not raw:
        assert not placed


def test_empty_cache_in_the_input_releases_the_models_free_segments(tmp_path):
    ev = [
        {"ev": "alloc", "id": 1, "addr": 100, "size": 4096, "stream": 0, "pool": "default"},
        {"ev": "alloc", "id": 2, "addr": 9000, "size": 3 * MB, "stream": 0, "pool": "default"},
        {"ev": "alloc", "id": 3, "addr": 5 * MB, "size": 4096, "stream": 0, "pool": "default"},
        {"ev": "record_stream", "id": 3, "stream": 1},
        {"ev": "free", "id": 2},
        {"ev": "free", "id": 3},                    # held: stream 1 may still use it
        {"ev": "segment_free", "addr": 9000},       # torch.cuda.empty_cache(): syncs, then releases
        {"ev": "segment_free", "addr": 77},
        {"ev": "free_done", "id": 3},
        {"ev": "alloc", "id": 4, "addr": 9000, "size": 3 * MB, "stream": 0, "pool": "default"},
    ]
    _, out = place(tmp_path, ev)
    a = allocs(out)
    released = [e for e in out if e["ev"] == "segment_free"]
    assert [r["addr"] for r in released] == [a[2]["segment"]]   # the small segment still holds id 1
    assert a[4]["segment"] != a[2]["segment"]                   # a fresh segment from the driver
    assert [e["ev"] for e in out].count("segment") == 3
