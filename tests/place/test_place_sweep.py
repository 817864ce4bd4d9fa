"""`hazsan sweep`: one decode step at several token counts; collision depends on shape, hazard not."""
import orjson
import pytest

from sanitizer.cli import main
from sanitizer.place import AllocatorConfig
from sanitizer.place.sweep import SweepError, _Scaler, split_step, sweep

H = 7168


def mhc_step_trace(tokens=4):
    """The reference fault in small: inside the symmetric-memory scope, the mHC combine allocates an
    einsum transient (and its output) while the previous all-reduce on the side stream still uses
    a freed block of the same pool. Set-up leaves two holes in the pool (warm-up buffers)."""
    T = tokens
    symm_in = {"ev": "scope", "name": "symm", "enter": True, "pool": "symm", "comm": "tp"}
    symm_out = {"ev": "scope", "name": "symm", "enter": False}
    return [
        {"hazsan": 1, "rank": 0, "world_size": 1, "device": "cpu"},
        {"ev": "window", "addr": 0x40000000, "size": 256 << 20, "comm": "tp"},
        symm_in,
        {"ev": "alloc", "id": "warm1", "addr": 0x100000, "size": 98304, "stream": 0, "pool": "default"},
        {"ev": "alloc", "id": "pin1", "addr": 0x200000, "size": 512, "stream": 0, "pool": "default"},
        {"ev": "alloc", "id": "warm2", "addr": 0x300000, "size": 540672, "stream": 0, "pool": "default"},
        {"ev": "alloc", "id": "pin2", "addr": 0x400000, "size": 512, "stream": 0, "pool": "default"},
        {"ev": "free", "id": "warm1"},
        {"ev": "free", "id": "warm2"},
        symm_out,
        {"ev": "step", "n": 0, "phase": "warmup"},           # no tokens: not the step replayed
        {"ev": "alloc", "id": "kv", "addr": 0x500000, "size": 4096, "stream": 0, "pool": "default"},
        {"ev": "step", "n": 1, "tokens": T},
        symm_in,
        {"ev": "alloc", "id": "h", "addr": 0x10000, "size": T * H * 2, "stream": 0, "pool": "default", "shape": [T, H],
         "dtype": "bfloat16", "site": "model.py:10:forward"},
        symm_out,
        {"ev": "launch", "stream": 0, "writes": [[0x10000, T * H * 2]]},
        {"ev": "record", "event": "e1", "stream": 0},
        {"ev": "wait", "event": "e1", "stream": 1},
        {"ev": "coll", "cid": 1, "comm": "tp", "seq": 0, "op": "all_reduce", "stream": 1,
         "bufs": [{"addr": 0x10000, "size": T * H * 2, "access": "rw"}], "site": "comm.py:5:all_reduce"},
        {"ev": "free", "id": "h", "site": "model.py:12:forward"},
        symm_in,
        {"ev": "alloc", "id": "t", "addr": 0x900000, "size": T * 4 * H * 4, "stream": 0, "pool": "default",
         "shape": [T, 4, H], "dtype": "float32", "site": "mhc.py:2743:mhc_combine"},
        {"ev": "launch", "stream": 0, "writes": [[0x900000, T * 4 * H * 4]]},
        {"ev": "alloc", "id": "y", "addr": 0x2000000, "size": T * H * 2, "stream": 0, "pool": "default",
         "shape": [T, H], "dtype": "bfloat16", "site": "mhc.py:2745:mhc_combine"},
        {"ev": "launch", "stream": 0, "reads": [[0x900000 + 64, 128]], "writes": [[0x2000000, T * H * 2]]},
        {"ev": "free", "id": "t", "site": "mhc.py:2744:mhc_combine"},
        symm_out,
        {"ev": "coll", "cid": 2, "comm": "tp", "seq": 1, "op": "all_reduce", "stream": 0,
         "bufs": [{"addr": 0x2000000, "size": T * H * 2, "access": "rw"}]},
        {"ev": "free", "id": "y"},
        # the next step's compute consumes the side-stream all-reduce: stream 0 waits for it
        {"ev": "record", "event": "e2", "stream": 1},
        {"ev": "wait", "event": "e2", "stream": 0},
        {"ev": "free", "id": "kv"},                          # allocated in a step left out
        {"ev": "step", "n": 2, "tokens": T},
        {"ev": "alloc", "id": "later", "addr": 0x10000, "size": 64, "stream": 0, "pool": "default"},
    ]


def write(path, events):
    path.write_bytes(b"\n".join(orjson.dumps(e) for e in events) + b"\n")
    return path


def test_collision_depends_on_shape_hazard_does_not(tmp_path):
    trace = write(tmp_path / "rank0.jsonl", mhc_step_trace())
    results = sweep([trace], [1, 2, 3, 4])
    assert [r.tokens for r in results] == [4, 8, 12, 16]
    # worked out with the model: at 4 and 8 tokens the transient and the output fit the set-up
    # holes; from 12 tokens on, one of them takes the bytes of the in-flight all-reduce buffer
    assert [r.verdict for r in results] == ["latent hazard", "latent hazard", "COLLIDES", "COLLIDES"]
    for r in results:
        assert r.by_rule.get("free-in-flight", 0) >= 2          # h, in each of the 2 repetitions
        assert r.by_rule.get("transient-in-window", 0) >= 1     # the einsum transient
        assert r.allocs_scaled == 3 and r.allocs_unscaled == 0  # warm-up allocs are set-up
        assert r.dropped == 1                                   # free of kv (a step left out)
    sites = {f.block.get("site") for f in results[2].findings if f.rule == "reuse-in-flight"}
    assert sites & {"mhc.py:2743:mhc_combine", "mhc.py:2745:mhc_combine"}


def test_scaler_scales_token_dims_buffers_and_renames_per_repetition():
    events = [(i + 2, e) for i, e in enumerate(mhc_step_trace()[1:])]
    prologue, marker, body = split_step(events, None)
    assert marker["n"] == 1 and len(prologue) == 9
    assert all(e.get("id") != "later" for e in body)          # the next step is not included
    out = _Scaler(prologue, marker, body, 2.0, 2).build()
    allocs = [e for e in out if e["ev"] == "alloc" and "@" in str(e["id"])]
    t0 = next(e for e in allocs if e["id"] == "t@0")
    assert t0["shape"] == [8, 4, H] and t0["size"] == 8 * 4 * H * 4
    assert {e["id"] for e in allocs} == {"h@0", "t@0", "y@0", "h@1", "t@1", "y@1"}
    reads = [e for e in out if e["ev"] == "launch" and "reads" in e]
    assert reads[0]["reads"] == [[t0["addr"] + 128, 256]]   # offset and size scale with the block
    colls = [e for e in out if e["ev"] == "coll"]
    assert [(c["cid"], c["seq"]) for c in colls] == [("1@0", 0), ("2@0", 1), ("1@1", 2), ("2@1", 3)]
    steps = [e for e in out if e["ev"] == "step"]
    assert [(s["n"], s["tokens"]) for s in steps] == [(1, 8), (2, 8)]
    frees = [e["id"] for e in out if e["ev"] == "free"]
    assert frees.count("warm1") == 1 and "kv" not in frees    # set-up frees once; kv dropped


def test_token_dims_field_overrides_the_heuristic(tmp_path):
    events = mhc_step_trace()
    for e in events:
        if e.get("id") == "t":
            e["token_dims"] = []          # recorded as not token-dependent
    prologue, marker, body = split_step([(i, e) for i, e in enumerate(events[1:])], None)
    out = _Scaler(prologue, marker, body, 3.0, 1).build()
    t = next(e for e in out if e.get("id") == "t@0")
    assert t["size"] == 4 * 4 * H * 4


def test_cli_table_json_and_exit_codes(tmp_path, capsys):
    trace = write(tmp_path / "rank0.jsonl", mhc_step_trace())
    assert main(["sweep", str(trace), "--scale", "1,2"]) == 0
    text = capsys.readouterr().out
    assert "reuse-in-flight" in text and "latent hazard" in text and "COLLIDES" not in text
    assert main(["sweep", str(trace), "--scale", "1,3", "--format", "json"]) == 1
    doc = orjson.loads(capsys.readouterr().out)
    assert [s["verdict"] for s in doc["shapes"]] == ["latent hazard", "COLLIDES"]
    assert doc["shapes"][1]["collisions"] and doc["shapes"][1]["realised"] >= 1
    keep = tmp_path / "keep"
    assert main(["sweep", str(trace), "--scale", "3", "--keep", str(keep)]) == 1
    assert (keep / "x3" / "placed" / "rank0.jsonl").exists()
    capsys.readouterr()
    assert main(["check", str(keep / "x3" / "placed")]) == 1


def test_bad_input(tmp_path, capsys):
    trace = write(tmp_path / "rank0.jsonl", [mhc_step_trace()[0], {"ev": "step", "n": 0}])
    assert main(["sweep", str(trace)]) == 2
    assert "no step marker with tokens" in capsys.readouterr().err
    with pytest.raises(SweepError):
        sweep([trace], [1], step=5)
    good = write(tmp_path / "good.jsonl", mhc_step_trace())
    assert main(["sweep", str(good), "--alloc-conf", "backend:cudaMallocAsync"]) == 2
    assert "cudaMallocAsync is not modelled" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sweep", str(good), "--scale", "0,x"])


def test_allocator_settings_change_the_outcome(tmp_path):
    trace = write(tmp_path / "rank0.jsonl", mhc_step_trace())
    default = [r.verdict for r in sweep([trace], [1, 2, 3])]
    rounded = [r.verdict for r in sweep([trace], [1, 2, 3],
                                        config=AllocatorConfig.parse("roundup_power2_divisions:2"))]
    assert default == ["latent hazard", "latent hazard", "COLLIDES"]
    assert all(v in ("latent hazard", "COLLIDES") for v in rounded)


def test_schedule_replays_the_step_once_per_token_count_in_order(tmp_path):
    """--schedule: a server's consecutive steps; the collision is found at the steps whose token
    count collides (3x and 4x the recorded count do, 1x and 2x do not: the test above)."""
    trace = write(tmp_path / "t.jsonl", mhc_step_trace())
    (r,) = sweep([trace], [99.0], schedule=[4, 12, 8, 16, 4])
    assert r.recorded_step == 1 and r.tokens == 4
    colliding = sorted({f.step - r.recorded_step for f in r.findings if f.rule == "reuse-in-flight"})
    assert colliding and set(colliding) <= {1, 3}             # the 12- and 16-token steps only
    assert r.by_rule.get("free-in-flight", 0) >= 5            # the hazard at every step
    sc = _Scaler(*split_step([(i, e) for i, e in enumerate(mhc_step_trace()[1:], 2)], None), 1.0, 2, [4, 12])
    evs = sc.build()
    tokens = [e["tokens"] for e in evs if e.get("ev") == "step" and "tokens" in e]
    assert tokens == [4, 12]                                  # one marker per scheduled count
    big = [e for e in evs if e.get("ev") == "alloc" and e.get("id") == "t@1"]
    assert big and big[0]["size"] == 12 * 4 * H * 4          # sized for its own token count


def test_schedule_cli(tmp_path, capsys):
    trace = write(tmp_path / "t.jsonl", mhc_step_trace())
    assert main(["sweep", str(trace), "--schedule", "4,8"]) == 0
    assert "no step of the schedule collides" in capsys.readouterr().out
    (tmp_path / "s.txt").write_text("4\n12\n4\n")
    assert main(["sweep", str(trace), "--schedule", f"@{tmp_path / 's.txt'}", "--format", "json"]) == 1
    doc = orjson.loads(capsys.readouterr().out)
    assert doc["schedule"] == [4, 12, 4] and {"index": 1, "tokens": 12} in doc["colliding_steps"]
    with pytest.raises(SystemExit):
        main(["sweep", str(trace), "--schedule", "4,0"])
    assert "token counts" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sweep", str(trace), "--schedule", f"@{tmp_path / 'missing.txt'}"])
    assert "cannot read" in capsys.readouterr().err


def test_files_without_steps_are_skipped(tmp_path):
    """A server's front-end process records no step: the sweep replays the ranks that have one."""
    d = tmp_path / "run"
    d.mkdir()
    write(d / "rank0.jsonl", mhc_step_trace())
    write(d / "pid123.jsonl", [{"hazsan": 1, "rank": -123, "world_size": 1, "device": "cpu"},
                               {"ev": "alloc", "id": 1, "addr": 4096, "size": 64, "stream": 0, "pool": "default"}])
    (r,) = sweep([d], [3.0])
    assert r.realised
    write(d / "rank0.jsonl", mhc_step_trace()[:10])            # no step marker left anywhere
    with pytest.raises(SweepError, match="no trace file has a step marker"):
        sweep([d], [1.0])


def test_a_size_scaled_past_the_formats_limit_names_the_input_not_the_scratch_file(tmp_path):
    """The input is read as check reads it; a scaled trace the format refuses (a size past 2^61)
    is a SweepError naming the input and the scale, never the temporary file placed."""
    trace = write(tmp_path / "rank0.jsonl", [
        {"hazsan": 1, "rank": 0, "world_size": 1},
        {"ev": "step", "n": 1, "tokens": 4},
        {"ev": "alloc", "id": 1, "addr": 4096, "size": 1 << 58, "stream": 0, "pool": "default",
         "shape": [4, 1 << 56], "dtype": "uint8"},
        {"ev": "free", "id": 1},
    ])
    assert sweep([trace], [1])[0].verdict == "clean"
    with pytest.raises(SweepError) as err:
        sweep([trace], [16])
    assert str(err.value).startswith(f"{trace}: scale 16: line 3 of the scaled trace: alloc: field 'size'")
    assert "hazsan-sweep-" not in str(err.value)
