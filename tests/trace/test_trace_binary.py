"""The binary trace format (docs/trace-format.md, "The binary format"; sanitizer/trace/binary/):
the same analysis as the JSON Lines it stands for, `hazsan cat` back to that JSON Lines, and the
reader's treatment of hostile input: frames cut short (a killed writer: a warning), lengths past
the limit or the file, wrong types, unknown kinds, garbage, bad signatures, gzip."""
from __future__ import annotations

import contextlib
import gzip
import io
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from sanitizer.cli import main
from sanitizer.rules.driver import analyze
from sanitizer.trace import binary as B
from sanitizer.trace import events as E
from sanitizer.trace.reader import TraceError, open_trace
from sanitizer.trace.writer import HEADER_ROOM, TraceWriter
from trace_files import records

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "traces"
HEADER = {"hazsan": 1, "rank": 0, "world_size": 1}
ALLOC = {"ev": "alloc", "id": 1, "addr": 4096, "size": 1024, "stream": "s0", "pool": "default", "site": "m.py:1:f"}
COLL = {"ev": "coll", "cid": 1, "comm": "tp", "seq": 0, "op": "all_reduce", "stream": "comm",
        "bufs": [{"addr": 4096, "size": 1024, "access": "rw"}]}
FREE = {"ev": "free", "id": 1}
#: free-in-flight at line 4 (docs/ordering-and-rules.md)
EVENTS = [ALLOC, COLL, FREE]


def _run(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _check_json(path, *extra):
    code, out, err = _run("check", path, "--format", "json", *extra)
    return code, json.loads(out), err


def _jsonl(header, events) -> bytes:
    return b"".join(json.dumps(x, separators=(",", ":")).encode() + b"\n" for x in [header, *events])


def _binary(header, items, end=None) -> bytes:
    """A binary trace from items (arrays, maps, or dicts turned into items), frames of 2 items."""
    items = [B.to_item(i) if isinstance(i, dict) and isinstance(i.get("ev"), str) else i for i in items]
    data = B.signature_and_header(header)
    for k in range(0, len(items), 2):
        data += B.frame(B.FRAME_EVENTS, msgspec.msgpack.encode(items[k:k + 2]))
    if end is not None:
        data += B.end_frame(*end)
    return data


def _no_files(value):
    if isinstance(value, dict):
        return {k: _no_files(v) for k, v in value.items() if k != "file"}
    if isinstance(value, list):
        return [_no_files(v) for v in value]
    return value


def _comparable(a):
    """Findings, summary and errors, file names left out (the two formats' files differ)."""
    findings = [_no_files(f.to_dict()) for f in a.findings]
    summary = {k: v for k, v in a.summary.items() if k not in ("warnings",)}
    errors = [(e.line, e.message.split(" (frame ")[0]) for e in a.errors]
    return findings, summary, errors


# ------------------------------------------------------------------ the layout


def test_layout_holds_every_field_of_every_kind_required_ones_first():
    tags = [tag for tag, _ in B.LAYOUT.values()]
    assert len(set(tags)) == len(tags) and set(B.LAYOUT) == set(E.BY_KIND)
    for kind, (tag, names) in B.ORDER.items():
        json_cls, bin_cls = E.BY_KIND[kind], B.BY_KIND[kind]
        assert set(names) == set(json_cls.__struct_fields__) and len(names) == len(set(names))
        assert bin_cls.__struct_fields__ == names and bin_cls.__struct_config__.tag == tag
        info = {f.name: f for f in msgspec.structs.fields(json_cls)}
        required = [n for n in names if info[n].required]
        assert list(names[:len(required)]) == required, kind          # required first
        for f in msgspec.structs.fields(bin_cls):
            if f.name != "bufs":
                assert f.type == info[f.name].type and f.default == info[f.name].default, (kind, f.name)
        assert B.TO_JSON_CLASS[bin_cls] is json_cls


def test_the_docs_list_the_layout():
    text = (ROOT / "docs" / "trace-format.md").read_text()
    for kind, (tag, names) in B.LAYOUT.items():
        row = f"| {tag} | `{kind}` | " + ", ".join(f"`{n}`" for n in names)
        after = B.APPENDED.get(kind)
        row += f" (after the common fields: " + ", ".join(f"`{n}`" for n in after) + ") |" if after else " |"
        assert row in text, row
    assert "`" + ", ".join(B.COMMON) + "`" in text.replace("`, `", ", ")


# ------------------------------------------------------------------ the same analysis


def _example_sets():
    out = []
    for p in sorted(EXAMPLES.iterdir()):
        if p.suffix == ".jsonl" or p.is_dir():
            out.append(p.name)
    return out


@pytest.mark.parametrize("name", _example_sets())
def test_examples_give_the_same_report_in_both_formats(name, tmp_path):
    src = EXAMPLES / name
    files = [src] if src.is_file() else sorted(src.iterdir())
    out = tmp_path / "bin"
    out.mkdir()
    for f in files:
        tf = open_trace(f)
        events = [ev for _, ev in tf.events()]
        (out / (f.stem + ".hzs")).write_bytes(B.jsonl_to_binary(tf.header, events))
    a, b = analyze(files), analyze(sorted(out.iterdir()))
    assert (a.findings or name == "clean.jsonl") and _comparable(a) == _comparable(b)
    assert [w.replace(".jsonl", "") for w in a.warnings] == [
        w.replace(str(out), str(src if src.is_dir() else src.parent)).replace(".hzs", "") for w in b.warnings]


def test_decode_trace_with_planted_hazards_gives_the_same_findings_and_lines(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gen_decode_trace as gen

    gen.generate(tmp_path / "j", events=20_000, ranks=2, inject=8)
    gen.generate(tmp_path / "b", events=20_000, ranks=2, inject=8, fmt="binary")
    assert sorted(p.name for p in (tmp_path / "b").glob("rank*")) == ["rank0.hzs", "rank1.hzs"]
    size = lambda d: sum(p.stat().st_size for p in d.glob("rank*"))  # noqa: E731
    assert size(tmp_path / "b") < 0.6 * size(tmp_path / "j")
    a, b = analyze([tmp_path / "j"]), analyze([tmp_path / "b"])
    assert a.findings and _comparable(a) == _comparable(b)
    expected = json.loads((tmp_path / "b" / "expected.json").read_text())["findings"]
    assert {(e["rule"], e["line"]) for e in expected if e["rule"] != "transient-in-window"} <= {
        (f.rule, f.line) for f in b.findings}


def test_cat_prints_the_json_lines_the_binary_trace_stands_for(tmp_path):
    events = [ALLOC, {**COLL, "t": 5}, {"ev": "launch", "stream": "s0", "reads": [[4096, 8]], "op": "mm"},
              {"ev": "alloc", "id": 2, "addr": 0, "size": 8, "stream": 1, "pool": None},
              {"ev": "step", "n": 3, "future_field": [1]}, {"ev": "newer_kind", "x": 1}, FREE]
    path = tmp_path / "rank0.hzs"
    path.write_bytes(B.jsonl_to_binary({**HEADER, "end_record": True}, events, {"events": 7, "dropped": 0}))
    code, out, err = _run("cat", path)
    assert code == 0 and err == ""
    lines = [json.loads(x) for x in out.splitlines()]
    assert lines == [{**HEADER, "end_record": True}, *events, {"ev": "end", "events": 7, "dropped": 0}]
    # and the JSON Lines it prints reads as the binary file does (line numbers included)
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "rank0.jsonl").write_text(out)
    assert _comparable(analyze([tmp_path / "j"])) == _comparable(analyze([path]))


def test_cat_of_a_json_lines_trace_is_that_trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_bytes(_jsonl(HEADER, EVENTS))
    code, out, _ = _run("cat", p)
    assert code == 0 and out.encode() == _jsonl(HEADER, EVENTS)


def test_check_jobs_reads_binary_rank_files(tmp_path):
    for r in range(2):
        (tmp_path / f"rank{r}.hzs").write_bytes(B.jsonl_to_binary({**HEADER, "rank": r}, EVENTS))
    serial = _check_json(tmp_path)
    jobs = _check_json(tmp_path, "--jobs", "2")
    assert serial[0] == jobs[0] == 1 and serial[1]["findings"] == jobs[1]["findings"]   # free-in-flight: an error
    assert serial[1]["summary"]["by_rule"] == {"free-in-flight": 2}


# ------------------------------------------------------------------ what a killed writer leaves


def test_every_cut_of_a_binary_trace_is_a_warning_or_a_header_error(tmp_path):
    full = _binary({**HEADER, "end_record": True}, EVENTS, end=(3, 0))
    header_end = len(B.signature_and_header({**HEADER, "end_record": True}))
    p = tmp_path / "cut.hzs"
    for n in range(1, len(full) + 1):
        p.write_bytes(full[:n])
        code, doc, err = _check_json(p)
        if n < header_end:
            assert code == 2 and ":1: " in err, (n, err)        # no usable header: unusable file
            continue
        s = doc["summary"]
        # the free-in-flight once read is a verdict; before it, a cut capture gives none (exit 2)
        assert code == (1 if s["findings"] else 2), (n, err)
        if n == len(full):
            assert s["complete"] and s["events"] == 3
        else:
            assert not s["complete"] and "truncated" in " ".join(s["warnings"]), n


def test_a_frame_cut_short_is_named_with_its_byte_offset(tmp_path):
    data = _binary(HEADER, EVENTS)
    p = tmp_path / "rank0.hzs"
    p.write_bytes(data[:-3])
    a = analyze([p])
    assert not a.errors and a.summary["events"] == 2          # the first frame's two events
    (w,) = [w for w in a.warnings if "truncated" in w]
    assert f"{p}:4: trace truncated (last frame cut short: " in w and "at byte " in w


def test_sigkilled_binary_capture_reads_up_to_its_last_flush(tmp_path):
    w = TraceWriter(str(tmp_path), trace_format="binary", flush_seconds=1000)
    w.set_rank(0, 1)
    w.start()
    for ev in EVENTS:
        w.emit(dict(ev))
    w.flush()
    w.emit({"ev": "step", "n": 1})               # buffered only: lost with the process
    a = analyze([w.path])                         # no close: what SIGKILL leaves
    assert a.summary["events"] == 3 and not a.errors
    assert [f.rule for f in a.findings] == ["free-in-flight"]
    assert any("no end record" in x for x in a.warnings)
    w.close()


# ------------------------------------------------------------------ hostile frames


def test_a_length_past_the_limit_is_an_error_naming_frame_and_byte(tmp_path):
    head = B.signature_and_header(HEADER)
    p = tmp_path / "rank0.hzs"
    p.write_bytes(head + B.frame(B.FRAME_EVENTS, msgspec.msgpack.encode([B.to_item(ALLOC)]))
                  + B.PREFIX.pack(B.FRAME_EVENTS, 2**32 - 1) + b"\x90")
    code, doc, err = _check_json(p)
    offset = len(head) + B.PREFIX_SIZE + len(msgspec.msgpack.encode([B.to_item(ALLOC)]))
    assert code == 2
    assert f"{p}:3: frame 2 at byte {offset}: length 4294967295 is more than 8388608 bytes" in err
    code, _, err = _check_json(p, "--lenient")
    assert code == 2                                  # like a line past --max-line-bytes: not skippable


def test_a_plausible_length_past_the_end_of_the_file_is_a_cut_frame(tmp_path):
    p = tmp_path / "rank0.hzs"
    p.write_bytes(B.signature_and_header(HEADER) + B.PREFIX.pack(B.FRAME_EVENTS, 1000) + b"\x91\x06")
    code, doc, _ = _check_json(p)
    assert code == 2 and "last frame cut short: 2 of its 1000 bytes" in " ".join(doc["summary"]["warnings"])


def test_max_line_bytes_bounds_frames_too(tmp_path):
    p = tmp_path / "rank0.hzs"
    p.write_bytes(_binary(HEADER, [{**ALLOC, "site": "m.py:1:" + "f" * 300}, COLL, FREE]))
    assert _check_json(p)[0] == 1                 # read whole: its free-in-flight
    code, _, err = _check_json(p, "--max-line-bytes", "256")
    assert code == 2 and "frame 1 at byte" in err and "--max-line-bytes" in err


@pytest.mark.parametrize("item, message", [
    ([5, 1, "4096", 1024, "s0", "default"], "alloc: field 'addr' must be an integer, got str"),
    ([5, 1, 4096, -8, "s0", "default"], "alloc: field 'size' must be an integer >= 0"),
    ([5, 1, 4096, 1024, "s0"], "alloc: missing field 'pool'"),
    ([5, 1, 4096, 1024, [1], "default"], "alloc: field 'stream' must be an integer or a string, got array"),
    ([10, 1, "tp", 0, "all_reduce", "comm", [[4096, 8, "x"]]], "coll: Invalid enum value 'x' - at `$.bufs[0].access`"),
    ([10, 1, "tp", 0, "all_reduce", "comm", [[4096]]], "coll: missing field 'bufs[0].size'"),
    ([10, 1, "tp", 0, "all_reduce", "comm", [{"addr": 1}]], "coll: field 'bufs[0]' must be a list, got object"),
    ([9, "s0", [[4096]]], "launch: 'reads' and 'writes' must be lists of [addr, size] integer pairs, size >= 0 (reads[0]: Expected `array` of length 2)"),
    ([9, "s0", [[4096, -1]]], "launch: 'reads' and 'writes' must be lists of [addr, size] integer pairs, size >= 0 (reads[0][1]: negative size)"),
    ([19, "symm", 1], "scope: field 'enter' must be true or false, got int"),
    ([5, 1, 4096, 1024, "s0", "default", None, None, None, True], "alloc: field 't' must be an integer or null, got bool"),
    ([], "an event must not be an empty array"),
    (["alloc", 1], "an event's first element must be its kind number"),
    ("alloc", "an event must be a msgpack array [kind, fields...] or a map, got str"),
    ({"ev": "alloc", "id": 1}, "alloc: missing field 'addr'"),
    ({"ev": 5}, "field 'ev' must be a string"),
])
def test_wrong_types_are_errors_naming_field_frame_and_byte(tmp_path, item, message):
    p = tmp_path / "rank0.hzs"
    head = B.signature_and_header(HEADER)
    p.write_bytes(head + B.frame(B.FRAME_EVENTS, msgspec.msgpack.encode([{"ev": "step", "n": 0}, item])))
    code, doc, err = _check_json(p)
    assert code == 2 and doc["summary"]["malformed"] == 1
    assert f"{p}:3: {message}" in err and f"(frame 1 at byte {len(head)}, event 1)" in err, err
    code, doc, _ = _check_json(p, "--lenient")
    assert code == 0 and doc["summary"]["skipped_lines"] == 1 and doc["summary"]["events"] == 1


def _padded(item):
    """The item with every field of its kind's layout (the writer leaves trailing absent ones out)."""
    return item + [None] * (1 + len(B.ORDER[B.KIND_OF_TAG[item[0]]][1]) - len(item))


def test_unknown_kinds_warn_and_trailing_fields_of_newer_writers_are_read(tmp_path):
    p = tmp_path / "rank0.hzs"
    p.write_bytes(_binary(HEADER, [[99, 1, 2], _padded(B.to_item(ALLOC)) + [None, "later", 7], B.to_item(COLL),
                                   {**FREE, "future": 1}]))
    code, doc, _ = _check_json(p)
    assert code == 1 and doc["summary"]["by_rule"] == {"free-in-flight": 1}
    assert doc["findings"][0]["line"] == 5
    ws = " ".join(doc["summary"]["warnings"])
    assert "1 event(s) of unknown kind '#99' ignored" in ws and "unknown field 'future' ignored in 1 event(s)" in ws


@pytest.mark.parametrize("payload, kind, message", [
    (b"\xc1\xc1", B.FRAME_EVENTS, "not msgpack"),
    (msgspec.msgpack.encode({"a": 1}), B.FRAME_EVENTS, "an event frame must hold a msgpack array"),
    (msgspec.msgpack.encode([]), 0x51, "unknown frame kind 0x51"),
    (msgspec.msgpack.encode([]), B.FRAME_HEADER, "unknown frame kind 0x48"),
])
def test_bad_frames_are_errors_counted_as_one_event(tmp_path, payload, kind, message):
    p = tmp_path / "rank0.hzs"
    head = _binary(HEADER, [ALLOC])
    p.write_bytes(head + B.frame(kind, payload) + B.frame(B.FRAME_EVENTS, msgspec.msgpack.encode([B.to_item(FREE)])))
    code, doc, err = _check_json(p)
    assert code == 2 and f"{p}:3: " in err and message in err and f"at byte {len(head)}" in err, err
    code, doc, _ = _check_json(p, "--lenient")
    assert code == 0 and doc["summary"]["events"] == 2          # the alloc, and the free after it


def test_an_end_frame_before_the_last_frame_is_an_error(tmp_path):
    p = tmp_path / "rank0.hzs"
    p.write_bytes(_binary({**HEADER, "end_record": True}, [ALLOC], end=(1, 0)) + _binary(HEADER, [FREE])[
        len(B.signature_and_header(HEADER)):])
    code, _, err = _check_json(p)
    assert code == 2 and "an end frame that is not the last frame" in err


@pytest.mark.parametrize("data, message", [
    (b"\x89HZS\r\n\x1a\x03", "unsupported binary trace version 3"),
    (b"\x89PNG\r\n\x1a\n", "not a hazsan trace: it starts with byte 0x89"),
    (b"\x89HZS\r\n\x1a\x01" + B.PREFIX.pack(B.FRAME_EVENTS, 1) + b"\x90", "the first frame (at byte 8) must be the header frame"),
    (b"\x89HZS\r\n\x1a\x01" + B.frame(B.FRAME_HEADER, b"\x92\x01\xc4\x00"), "the header frame must hold a map"),
    (b"\x89HZS\r\n\x1a\x01" + B.frame(B.FRAME_HEADER, msgspec.msgpack.encode([{"hazsan": 2}])), "unsupported schema version 2"),
    (b"\x89HZS\r\n\x1a\x01" + B.frame(B.FRAME_HEADER, msgspec.msgpack.encode({"hazsan": 1, "rank": "0"})), "header field 'rank' must be an integer"),
    (b"\x89HZS\r\n\x1a\x01" + B.PREFIX.pack(B.FRAME_HEADER, 100) + b"\x81", "cut short in its header frame"),
    (b"\x89HZS\r\n\x1a\x01" + B.PREFIX.pack(B.FRAME_HEADER, 2**32 - 1), "header frame length 4294967295 is more than"),
])
def test_bad_signatures_and_headers_make_the_file_unusable(tmp_path, data, message):
    p = tmp_path / "rank0.hzs"
    p.write_bytes(data)
    code, _, err = _check_json(p, "--lenient")
    assert code == 2 and f"{p}:1: " in err and message in err, err


def test_gzip_binary_traces_read_and_a_cut_one_is_a_warning(tmp_path):
    data = _binary({**HEADER, "end_record": True}, EVENTS, end=(3, 0))
    p = tmp_path / "rank0.hzs.gz"
    p.write_bytes(gzip.compress(data))
    code, doc, _ = _check_json(tmp_path)
    assert code == 1 and doc["summary"]["complete"] and doc["summary"]["by_rule"] == {"free-in-flight": 1}
    packed = gzip.compress(data)
    p.write_bytes(packed[:len(packed) - 12])
    code, doc, _ = _check_json(p)
    assert code in (1, 2) and code == (1 if doc["summary"]["findings"] else 2) and not doc["summary"]["complete"]
    assert "compressed stream ends early" in " ".join(doc["summary"]["warnings"])


def test_gzip_bomb_limit_holds_for_binary_traces(tmp_path):
    from sanitizer.limits import Limits

    p = tmp_path / "rank0.hzs.gz"
    body = msgspec.msgpack.encode([[20, 1]] * 50_000)
    data = B.signature_and_header(HEADER) + B.frame(B.FRAME_EVENTS, body) * 12  # 1.8 MB, over the 1 MiB floor
    p.write_bytes(gzip.compress(data, 9))
    tf = open_trace(p, Limits(max_gzip_ratio=20, gzip_ratio_floor=1 << 20))
    with pytest.raises(TraceError, match="gzip data expands more than 20x"):
        list(tf.events())
    tf = open_trace(p, Limits(max_gzip_ratio=0))
    assert sum(1 for _ in tf.events()) == 600_000


# ------------------------------------------------------------------ the writer


def test_the_writer_keeps_events_it_cannot_lay_out_as_map_items(tmp_path):
    w = TraceWriter(str(tmp_path), trace_format="binary")
    w.set_rank(0, 1)
    evs = [{"ev": "step", "n": 0, "k": 1}, {"ev": "sync", "stream": None}, {"ev": "mystery", "a": [1]},
           {**COLL, "bufs": [{"addr": 1, "size": 2, "access": "r", "extra": 1}]}, dict(ALLOC)]
    for ev in evs:
        w.emit(dict(ev))
    w.close()
    assert records(w.path)[1:-1] == evs


def test_frames_stay_small_when_events_are_huge(tmp_path):
    w = TraceWriter(str(tmp_path), trace_format="binary")
    w.set_rank(0, 1)
    for i in range(8):
        w.emit({"ev": "launch", "stream": 0, "reads": [[a * 64, 64] for a in range(30_000)]})
    w.close()
    data = Path(w.path).read_bytes()
    offset, sizes = open_trace(w.path).body_offset, []
    while offset < len(data):
        kind, length = B.PREFIX.unpack_from(data, offset)
        sizes.append(length)
        offset += B.PREFIX_SIZE + length
    assert max(sizes) <= B.FRAME_BYTES_SOFT + (1 << 20) and len(sizes) > 2
    assert analyze([w.path]).summary["events"] == 8


def test_header_padding_and_in_place_update_in_binary(tmp_path):
    w = TraceWriter(str(tmp_path), trace_format="binary", header_extra={"x": 1})
    w.set_rank(0, 1)
    w.start()
    assert Path(w.path).stat().st_size == HEADER_ROOM
    w.header_source = lambda: {"hooks": {"installed": ["a"]}}
    w.header_key = lambda: 1
    w.emit({"ev": "step", "n": 0})
    w.close()
    tf = open_trace(w.path)
    assert tf.body_offset == HEADER_ROOM and tf.header["hooks"] == {"installed": ["a"]} and tf.header["x"] == 1


def test_trace_format_setting(monkeypatch):
    from sanitizer.capture.config import Settings
    from sanitizer.trace.writer import default_format

    assert Settings.from_env({})[0].trace_format is None and default_format({}) == "binary"
    assert Settings.from_env({"HAZSAN_TRACE_FORMAT": "JSONL"})[0].trace_format == "jsonl"
    s, problems = Settings.from_env({"HAZSAN_TRACE_FORMAT": "xml"})
    assert s.trace_format == "binary" and "HAZSAN_TRACE_FORMAT='xml'" in problems[0]
    with pytest.raises(ValueError):
        TraceWriter("/nonexistent", trace_format="xml")


def test_cat_command_line_and_errors(tmp_path):
    p = tmp_path / "rank0.hzs"
    p.write_bytes(_binary(HEADER, [ALLOC, [5, 1, "x", 1, "s", None], FREE]))
    r = subprocess.run([sys.executable, "-m", "sanitizer", "cat", str(p), "--no-header"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr      # cat shows what is there, types unchecked
    assert [json.loads(x)["ev"] for x in r.stdout.splitlines()] == ["alloc", "alloc", "free"]
    p.write_bytes(_binary(HEADER, [ALLOC]) + B.frame(B.FRAME_EVENTS, b"\xc1") + _binary(HEADER, [FREE])[
        len(B.signature_and_header(HEADER)):])
    code, out, err = _run("cat", p)
    assert code == 2 and f"{p}:3: not msgpack" in err
    assert out.splitlines()[2] == "" and json.loads(out.splitlines()[3])["ev"] == "free"   # numbering kept
    code, _, err = _run("cat", tmp_path / "nope.hzs")
    assert code == 2 and "no such file" in err


# ------------------------------------------------------------------ version 2: the value tables

SITE_A, SITE_B = "model.py:10:forward", "model.py:20:backward"


def _frames_of(path) -> list[tuple[int, bytes]]:
    """(kind, payload) of every frame after the signature."""
    data = Path(path).read_bytes()
    return _frames_in(data, len(B.SIGNATURE))


def _frames_in(data: bytes, pos: int = 0) -> list[tuple[int, bytes]]:
    out = []
    while pos < len(data):
        kind, length = B.PREFIX.unpack_from(data, pos)
        out.append((kind, data[pos + B.PREFIX_SIZE:pos + B.PREFIX_SIZE + length]))
        pos += B.PREFIX_SIZE + length
    return out


def _launch(i, site, op="gemm", shape=None):
    ev = {"ev": "launch", "stream": 0, "writes": [[4096 + 64 * i, 64]], "site": site, "op": op}
    return ev


def test_the_writer_interns_descriptive_values_once_per_file(tmp_path):
    """Capture writes each call site, op, shape, dtype and stack once, in a `V` frame before the
    first event frame that uses it; events hold indices; `hazsan cat` gives the values back."""
    w = TraceWriter(str(tmp_path), trace_format="binary")
    w.set_rank(0, 1)
    first = [dict(ALLOC, id=i, addr=4096 * (i + 1), shape=[8, 16], dtype="bfloat16", stack=["a.py:1", "b.py:2"])
             for i in range(3)]
    for ev in first:
        w.emit(ev)
    w.flush()
    second = [dict(ALLOC, id=10 + i, addr=65536 * (i + 1), site=SITE_B if i else ALLOC["site"], shape=[8, 16],
                   dtype="float32") for i in range(3)]
    for ev in second:
        w.emit(ev)
    w.close()
    path = Path(w.path)
    assert path.read_bytes()[len(B.MAGIC)] == 2
    frames = _frames_of(path)
    values = [msgspec.msgpack.decode(p) for k, p in frames if k == B.FRAME_VALUES]
    assert values == [{"site": [ALLOC["site"]], "stack": [["a.py:1", "b.py:2"]], "shape": [[8, 16]],
                       "dtype": ["bfloat16"]},
                      {"site": [SITE_B], "dtype": ["float32"]}]          # only what is new
    kinds = [k for k, _ in frames]
    assert kinds.index(B.FRAME_VALUES) < kinds.index(B.FRAME_EVENTS)
    items = [i for k, p in frames if k == B.FRAME_EVENTS for i in msgspec.msgpack.decode(p)]
    site_at = 1 + B.ORDER["alloc"][1].index("site")
    assert [i[site_at] for i in items] == [0, 0, 0, 0, 1, 1]
    code, out, err = _run("cat", path)
    got = [json.loads(line) for line in out.splitlines()[1:]]
    want = [{k: v for k, v in ev.items()} for ev in first + second]
    assert [{k: v for k, v in g.items() if k != "t"} for g in got[:-1]] == want, err


def test_interned_traces_are_smaller_and_give_the_same_findings(tmp_path):
    events = []
    for i in range(200):
        events += [dict(ALLOC, id=i, addr=4096, site=f"m.py:{i % 7}:f", shape=[4, 256], dtype="float16"),
                   dict(COLL, cid=i, seq=i, site="comm.py:5:all_reduce"),
                   dict(FREE, id=i, site="m.py:99:f")]
    interned = tmp_path / "v2" / "rank0.hzs"
    plain = tmp_path / "v1" / "rank0.hzs"
    for p, intern in ((interned, True), (plain, False)):
        p.parent.mkdir()
        p.write_bytes(B.jsonl_to_binary(HEADER, events, intern=intern))
    assert interned.stat().st_size < 0.7 * plain.stat().st_size
    a, b = analyze([plain]), analyze([interned])
    assert a.findings and _comparable(a) == _comparable(b)
    assert {f.site for f in b.findings} <= {"m.py:99:f"} | {f"m.py:{i}:f" for i in range(7)} | {None}
    assert all(isinstance(f.block.site, str) for f in b.findings if f.block is not None)
    assert any(f.op is not None and f.op.site == "comm.py:5:all_reduce" for f in b.findings)


def test_a_version_1_trace_still_reads(tmp_path):
    """What earlier hazsan wrote (version 1: no `V` frame, values in place) reads as before; an
    index there is a wrong type, as it always was."""
    p = tmp_path / "rank0.hzs"
    v1 = b"\x89HZS\r\n\x1a\x01" + B.signature_and_header(HEADER)[8:]
    p.write_bytes(v1 + B.frame(B.FRAME_EVENTS, msgspec.msgpack.encode([B.to_item(e) for e in EVENTS])))
    code, out, _ = _check_json(p)
    assert code == 1 and [f["rule"] for f in out["findings"]] == ["free-in-flight"]
    assert out["findings"][0]["block"]["site"] == ALLOC["site"]
    bad = B.to_item(ALLOC)
    bad[1 + B.ORDER["alloc"][1].index("site")] = 0
    p.write_bytes(v1 + B.frame(B.FRAME_EVENTS, msgspec.msgpack.encode([bad])))
    code, _, err = _check_json(p)
    assert code == 2 and f"{p}:2: alloc: field 'site'" in err and "must be a string" in err, err
    p.write_bytes(v1 + B.frame(B.FRAME_VALUES, msgspec.msgpack.encode({"site": ["x"]})))
    code, _, err = _check_json(p)
    assert code == 2 and "unknown frame kind 0x56" in err, err


def test_values_in_place_are_still_read_in_a_version_2_trace(tmp_path):
    """Interning is the writer's choice, field by field: a value in place is read as in version 1."""
    t = B.ValueTable()
    items = [B.to_item(ALLOC, t), B.to_item(dict(COLL, site="c.py:1"), None), B.to_item(FREE, t)]
    p = tmp_path / "rank0.hzs"
    p.write_bytes(B.signature_and_header(HEADER) + B.values_frame(t.pending())
                  + B.frame(B.FRAME_EVENTS, msgspec.msgpack.encode(items)))
    a = analyze([p])
    assert not a.errors and [f.rule for f in a.findings] == ["free-in-flight"]
    assert a.findings[0].block.site == ALLOC["site"] and a.findings[0].op.site == "c.py:1"


@pytest.mark.parametrize("lenient", [False, True])
def test_an_index_past_its_table_names_field_line_and_frame(tmp_path, lenient):
    t = B.ValueTable()
    items = [B.to_item(ALLOC, t)]
    dangling = B.to_item(dict(COLL, site="c.py:1"), t)
    t.pending()                                        # c.py:1 is never written: a lost `V` frame
    p = tmp_path / "rank0.hzs"
    p.write_bytes(B.signature_and_header(HEADER) + B.values_frame({"site": [ALLOC["site"]]})
                  + B.frame(B.FRAME_EVENTS, msgspec.msgpack.encode(items + [dangling, B.to_item(FREE)])))
    code, out, err = _check_json(p, *(["--lenient"] if lenient else []))
    if lenient:
        assert code == 0 and out["summary"]["skipped_lines"] == 1 and not out["findings"], out["summary"]
    else:
        assert code == 2 and (f"{p}:3: coll: field 'site' holds index 1, but the trace's site values so far "
                              "are 1 (indices 0 to 0) (frame 2 at byte") in err, err
    code, out, _ = _run("cat", p)
    assert json.loads(out.splitlines()[2])["site"] == 1      # cat keeps it: the JSON Lines rules refuse it
    assert json.loads(out.splitlines()[1])["site"] == ALLOC["site"]


@pytest.mark.parametrize("payload, message", [
    (msgspec.msgpack.encode({"site": [5]}), "values frame: Expected `str`, got `int` - at `$.site[0]`"),
    (msgspec.msgpack.encode({"shape": [["x"]]}), "values frame: Expected `int`, got `str` - at `$.shape[0][0]`"),
    (msgspec.msgpack.encode([1, 2]), "values frame: Expected `object`, got `array`"),
    (b"\xc1", "values frame: "),
])
def test_a_bad_values_frame_is_an_error_and_defines_nothing(tmp_path, payload, message):
    t = B.ValueTable()
    item = B.to_item(ALLOC, t)
    p = tmp_path / "rank0.hzs"
    p.write_bytes(B.signature_and_header(HEADER) + B.frame(B.FRAME_VALUES, payload)
                  + B.frame(B.FRAME_EVENTS, msgspec.msgpack.encode([item])))
    code, _, err = _check_json(p)
    assert code == 2 and f"{p}:2: frame 1 at byte " in err and message in err, err
    assert f"{p}:3: alloc: field 'site' holds index 0, but the trace defined no site value before it" in err, err


def test_unknown_fields_of_a_values_frame_are_ignored(tmp_path):
    t = B.ValueTable()
    items = [B.to_item(e, t) for e in EVENTS]
    new = dict(t.pending(), later=[1, 2, 3])
    p = tmp_path / "rank0.hzs"
    p.write_bytes(B.signature_and_header(HEADER) + B.values_frame(new)
                  + B.frame(B.FRAME_EVENTS, msgspec.msgpack.encode(items)))
    code, out, err = _check_json(p)
    assert code == 1 and out["findings"][0]["block"]["site"] == ALLOC["site"], err


def test_values_added_in_every_frame_cost_few_class_rounds_and_read_right(tmp_path):
    """A file that adds a call site in each of 300 frames: every event reads with its own site,
    and the reader made its record classes again at most REBUILDS + log2 times."""
    from sanitizer.trace.reader import TypedEvents

    t = B.ValueTable()
    data = B.signature_and_header(HEADER)
    for i in range(300):
        item = B.to_item(_launch(i, f"gen.py:{i}:f"), t)
        data += B.values_frame(t.pending()) + B.frame(B.FRAME_EVENTS, msgspec.msgpack.encode([item]))
    p = tmp_path / "rank0.hzs"
    p.write_bytes(data)
    tf = open_trace(p)
    src = TypedEvents(tf)
    problems, sites = [], []
    with contextlib.suppress(StopIteration):
        while True:
            _, records = src.next(problems)
            sites += [E.described(r, "site") for r in records]
    assert not problems and sites == [f"gen.py:{i}:f" for i in range(300)]
    assert src.decoder.rebuilds <= B.BinaryDecoder.REBUILDS + 6, src.decoder.rebuilds
    made = src.forget()
    assert made and not set(made) & set(B.TO_JSON_CLASS_ALL)


def test_repeated_analyses_leave_no_classes_behind(tmp_path):
    """Each version 2 file gets record classes of its own; they leave the engine's tables when
    its analysis ends (the pytest plugin analyses one trace per test)."""
    from sanitizer.rules import driver

    p = tmp_path / "rank0.hzs"
    p.write_bytes(B.jsonl_to_binary(HEADER, EVENTS))
    analyze([p])
    eng = driver.load_engine(None)[0]
    before = (len(eng.KIND_CODES), len(B.TO_JSON_CLASS_ALL))
    for _ in range(5):
        a = analyze([p])
        assert [f.rule for f in a.findings] == ["free-in-flight"] and a.findings[0].block.site == ALLOC["site"]
    assert (len(eng.KIND_CODES), len(B.TO_JSON_CLASS_ALL)) == before


def test_a_failed_write_takes_its_new_values_back(tmp_path, monkeypatch):
    """A flush whose write fails (disk full) loses its events, counted; the values first seen in it
    are not in the file, so the next flush that uses them defines them again."""
    from sanitizer.trace import writer as W

    w = TraceWriter(str(tmp_path), trace_format="binary")
    w.set_rank(0, 1)
    w.emit(dict(ALLOC, id=1))
    w.flush()
    real = W._write_all
    fail = {"left": 1}

    def flaky(fd, data):
        if fail["left"]:
            fail["left"] -= 1
            raise OSError(28, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(W, "_write_all", flaky)
    w.emit(dict(ALLOC, id=2, addr=8192, site=SITE_B))          # lost with its V frame
    w.flush()
    w.emit(dict(ALLOC, id=3, addr=12288, site=SITE_B, op="empty"))
    w.close()
    path = Path(w.path)
    code, out, _ = _run("cat", path)
    got = [json.loads(line) for line in out.splitlines()[1:]]
    allocs = [(g["id"], g.get("site"), g.get("op")) for g in got if g["ev"] == "alloc"]
    assert allocs == [(1, ALLOC["site"], None), (3, SITE_B, "empty")]
    assert any(g["ev"] == "dropped" and g["count"] == 1 for g in got)
    a = analyze([path])
    assert not a.errors


def test_values_survive_the_copy_under_the_rank_name(tmp_path):
    """A file started before the rank was known is copied under rank<R>.hzs with its `V` frames;
    later events refer to the values defined before the copy, and read back right."""
    w = TraceWriter(str(tmp_path), trace_format="binary")
    w.start()
    w.emit(dict(ALLOC, id=1, shape=[2, 3], dtype="int8"))
    w.flush()
    first = w.path
    w.set_rank(3, 4)
    assert w.path != first and Path(w.path).name == "rank3.hzs"
    w.emit(dict(ALLOC, id=2, addr=8192, shape=[2, 3], dtype="int8"))
    w.close()
    values = [msgspec.msgpack.decode(p) for k, p in _frames_of(w.path) if k == B.FRAME_VALUES]
    assert values == [{"site": [ALLOC["site"]], "shape": [[2, 3]], "dtype": ["int8"]}]   # once, before the copy
    allocs = [ev for _, ev in open_trace(w.path).events() if ev["ev"] == "alloc"]
    assert [(a["id"], a["site"], a["shape"], a["dtype"]) for a in allocs] == [
        (1, ALLOC["site"], [2, 3], "int8"), (2, ALLOC["site"], [2, 3], "int8")]


def test_the_native_recorders_arrays_encode_as_the_generic_path_does():
    """encode_frames does the native recorder's arrays (`free` with no site, `alloc` whose only
    interned field is its site) inline: the frames decode to the same events, the same values
    tables and indices, as to_item of each event one by one; sites new, seen, None, and a
    non-str site (which the layout cannot intern: a map item) included."""
    from sanitizer.trace.binary import encode as enc

    def native_alloc(i, site):
        return (5, i, 4096 * i, 64, "cpu", "default", None, None, None, 1000 + i, None, site)

    def native_launch(i, site, op):
        return (9, "cpu", ((4096 * i, 64),), ((8192 * i, 32), (9000 * i, 8)) if i % 2 else None, 1000 + i,
                None, site, None, op)

    batch = [native_alloc(1, "m.py:1:f"), (6, 1, 2000), native_alloc(2, "m.py:1:f"),
             native_alloc(3, None), native_alloc(4, "m.py:2:g"), (6, 2, 2001), native_alloc(5, 7),
             dict(ALLOC, id=6), (6, 3, 2002, None, "m.py:3:h"), native_alloc(7, "m.py:2:g"),
             native_launch(1, "m.py:1:f", "aten.add.Tensor"), native_launch(2, "m.py:4:k", "aten.add.Tensor"),
             native_launch(3, None, "aten.mul.Tensor"), native_launch(4, "m.py:4:k", "aten.mul.Tensor"),
             native_launch(5, "m.py:1:f", 3)]

    def decoded(items_of):
        table = enc.ValueTable()
        original = enc._items
        enc._items = items_of
        try:
            data = enc.encode_frames(list(batch), table)
        finally:
            enc._items = original
        values, events = B.new_values(), []
        for kind, payload in _frames_in(data):
            if kind == B.FRAME_VALUES:
                B.add_values(values, payload)
            else:
                events.append(msgspec.msgpack.decode(payload))
        return values, events

    fast = decoded(enc._items)
    generic = decoded(lambda part, table: [enc.to_item(ev, table) for ev in part])
    assert fast == generic
    values, events = fast
    assert values["site"] == ["m.py:1:f", "m.py:2:g", "m.py:3:h", "m.py:4:k"]
    assert values["op"][-2:] == ["aten.add.Tensor", "aten.mul.Tensor"]
    launches = [i for i in events[0] if type(i) is list and i[0] == 9]
    assert len(launches) == 4 and [i[1 + B.ORDER["launch"][1].index("site")] for i in launches] == [0, 3, None, 3]
    site_at = 1 + B.ORDER["alloc"][1].index("site")
    allocs = [i for i in events[0] if type(i) is list and i[0] == 5]
    assert [i[site_at] for i in allocs] == [0, 0, None, 1, 0, 1]   # ALLOC's own site is m.py:1:f
    assert {"ev": "alloc", "id": 5, "site": 7} == {k: v for k, v in
                                                   next(i for i in events[0] if type(i) is dict).items()
                                                   if k in ("ev", "id", "site")}


def test_an_observed_coll_done_round_trips_and_older_items_keep_their_positions(tmp_path):
    """`coll_done`'s `observed` follows the common fields (layout.APPENDED): an item written before
    it existed, [11, cid, t], reads as before, and the field comes back from both formats."""
    from sanitizer.trace.reader import TypedEvents
    assert B.ORDER["coll_done"][1][-1] == "observed"
    assert B.ORDER["coll_done"][1][:len(B.COMMON) + 1] == ("cid", *B.COMMON)
    events = [{"ev": "coll", "cid": 1, "comm": "0", "seq": 0, "op": "all_gather", "stream": "gloo:0",
               "bufs": [{"addr": 4096, "size": 64, "access": "w"}]},
              {"ev": "coll_done", "cid": 1, "t": 5, "observed": True},
              {"ev": "coll_done", "cid": 1, "t": 6}]
    assert B.to_item(events[1]) == [11, 1, 5, None, None, None, None, None, None, True]
    assert B.to_item(events[2]) == [11, 1, 6]
    old_item = [11, 1, 7]                    # as a writer before `observed` wrote it
    for name, data in (("t.hzs", _binary(HEADER, [*events, old_item])),
                       ("t.jsonl", _jsonl(HEADER, [*events, {"ev": "coll_done", "cid": 1, "t": 7}]))):
        (tmp_path / name).write_bytes(data)
        src = TypedEvents(open_trace(tmp_path / name))
        problems, got = [], []
        with contextlib.suppress(StopIteration):
            while True:
                _, records = src.next(problems)
                got += [(r.cid, r.t, r.observed) for r in records if hasattr(r, "observed")]
        assert not problems and got == [(1, 5, True), (1, 6, None), (1, 7, None)], (name, got)
