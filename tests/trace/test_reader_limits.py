"""The trace reader's limits (issue 14): the longest line, and how far a gzip stream may expand.
`hazsan check /dev/zero` and a small .gz holding a huge line end quickly with exit 2 and a one-line
error naming file and line; both limits are options of `hazsan check`."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time
import zlib

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sanitizer.limits import Limits
from sanitizer.trace.reader import TraceError, open_trace

HEADER = orjson.dumps({"hazsan": 1, "rank": 0}) + b"\n"
SYNC = b'{"ev":"sync"}\n'


def _check(*argv, timeout=120):
    return subprocess.run([sys.executable, "-m", "sanitizer", "check", *argv], capture_output=True,
                          text=True, timeout=timeout)


def _gzip_stream(path, parts):
    """Write a .gz from an iterable of byte chunks without holding them together."""
    comp = zlib.compressobj(1, zlib.DEFLATED, 31)
    with open(path, "wb") as f:
        for part in parts:
            f.write(comp.compress(part))
        f.write(comp.flush())
    return path


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("hazsan: error:")]


def test_dev_zero_ends_quickly_with_exit_2():
    t0 = time.monotonic()
    r = _check("/dev/zero", "--format", "json")
    assert r.returncode == 2
    assert time.monotonic() - t0 < 30
    assert "Traceback" not in r.stderr
    assert _error_lines(r.stderr)[0].startswith("hazsan: error: /dev/zero:1: line longer than 8388608 bytes")


def test_small_gzip_holding_a_huge_line_is_not_decompressed_whole(tmp_path):
    """256 MiB of one line in a few hundred KB of gzip: stopped at the line limit, memory bounded."""
    path = _gzip_stream(tmp_path / "rank0.jsonl.gz",
                        [HEADER, SYNC, b'{"ev":"sync","x":"'] + [b"a" * (1 << 20)] * 256 + [b'"}\n'])
    assert path.stat().st_size < 2 << 20
    # The command's own peak RSS, read by a small launcher with os.wait4: a child forked straight
    # from this worker (hundreds of MB once a test imported torch) inherits its high-water mark.
    launcher = ("import os, subprocess, sys, json\n"
                "with open(sys.argv[1], 'wb') as err:\n"
                "    p = subprocess.Popen(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=err)\n"
                "    _, status, usage = os.wait4(p.pid, 0)\n"
                "print(json.dumps([os.waitstatus_to_exitcode(status), usage.ru_maxrss]))\n")
    err = tmp_path / "err"
    r = subprocess.run([sys.executable, "-c", launcher, str(err), sys.executable, "-m", "sanitizer", "check",
                        str(path), "--format", "json"], capture_output=True, text=True, timeout=120)
    code, peak_kib = json.loads(r.stdout)
    assert code == 2
    assert _error_lines(err.read_text()) == [f"hazsan: error: {path}:3: line longer than 8388608 bytes "
                                             "(not a hazsan trace? --max-line-bytes raises the limit)"]
    assert peak_kib < 200 * 1024, f"peak RSS {peak_kib} KiB: the line was held whole"


def test_max_line_bytes_option_raises_and_lifts_the_limit(tmp_path):
    long_line = orjson.dumps({"ev": "sync", "pad": "x" * 3000}) + b"\n"
    path = tmp_path / "rank0.jsonl"
    path.write_bytes(HEADER + SYNC + long_line + SYNC)
    assert _check(str(path)).returncode == 0
    r = _check(str(path), "--max-line-bytes", "1KiB", "--format", "json")
    assert r.returncode == 2
    assert _error_lines(r.stderr)[0].startswith(f"hazsan: error: {path}:3: line longer than 1024 bytes")
    assert _check(str(path), "--max-line-bytes", "0").returncode == 0
    assert _check(str(path), "--max-line-bytes", "3100").returncode == 0
    bad = _check(str(path), "--max-line-bytes", "lots")
    assert bad.returncode == 2 and "--max-line-bytes" in bad.stderr and "Traceback" not in bad.stderr


def test_gzip_ratio_limit_stops_a_decompression_bomb(tmp_path):
    path = _gzip_stream(tmp_path / "rank0.jsonl.gz", [HEADER] + [SYNC * 20000] * 40)  # 11 MB of lines
    ratio = 11_200_000 / path.stat().st_size
    assert ratio > 150
    with pytest.raises(TraceError) as info:
        tf = open_trace(path, Limits(max_gzip_ratio=100, gzip_ratio_floor=1 << 20))
        for _ in tf.line_batches():
            pass
    assert "gzip data expands more than 100x" in str(info.value) and info.value.line > 1
    # the same file within limits: every line read
    tf = open_trace(path, Limits(max_gzip_ratio=0))
    assert sum(len(b) for _, b in tf.line_batches()) == 800_000


def test_gzip_ratio_option_of_check(tmp_path):
    """One 70 MiB line of spaces (ratio about 1000) with the line limit off: the ratio stops it."""
    path = _gzip_stream(tmp_path / "rank0.jsonl.gz", [HEADER, b'{"ev":"sync","x":"'] + [b" " * (1 << 20)] * 70 + [b'"}\n'])
    r = _check(str(path), "--max-line-bytes", "0", "--format", "json")
    assert r.returncode == 2
    assert _error_lines(r.stderr)[0].startswith(f"hazsan: error: {path}:2: gzip data expands more than 200x")
    assert _check(str(path), "--max-line-bytes", "0", "--max-gzip-ratio", "0").returncode == 0


def test_a_cut_gzip_is_still_read_up_to_the_cut(tmp_path):
    data = HEADER + SYNC * 5000
    packed = gzip.compress(data)
    path = tmp_path / "rank0.jsonl.gz"
    path.write_bytes(packed[:-20])
    tf = open_trace(path)
    lines = sum(len(b) for _, b in tf.line_batches())
    assert 4000 < lines <= 5000 and tf.truncated


@given(lengths=st.lists(st.integers(0, 300), max_size=30), limit=st.integers(40, 200),
       chunked=st.booleans())
@settings(max_examples=200, deadline=None)
def test_line_limit_is_exact_and_names_the_first_long_line(tmp_path_factory, lengths, limit, chunked):
    """Lines up to `limit` bytes (newline not counted) pass unchanged; the first longer one is the
    error's line, wherever the read boundaries fall."""
    d = tmp_path_factory.mktemp("lim")
    lines = [b"x" * n + b"\n" for n in lengths]
    path = d / ("r.jsonl.gz" if chunked else "r.jsonl")
    data = HEADER + b"".join(lines)
    path.write_bytes(gzip.compress(data) if chunked else data)
    first_long = next((i for i, n in enumerate(lengths) if n > limit), None)
    tf = open_trace(path, Limits(max_line_bytes=limit))
    got = []
    if first_long is None:
        for _, batch in tf.line_batches(7):
            got.extend(batch)
        assert got == lines
    else:
        with pytest.raises(TraceError) as info:
            for _, batch in tf.line_batches(7):
                got.extend(batch)
        assert info.value.line == first_long + 2
        assert got == lines[: len(got)] and len(got) <= first_long


def test_place_and_sweep_take_the_same_limits(tmp_path, capsys):
    from sanitizer.cli import main

    path = tmp_path / "rank0.jsonl"
    path.write_bytes(HEADER + b'{"ev":"step","n":1,"tokens":4}\n' + orjson.dumps({"ev": "sync", "pad": "x" * 3000}) + b"\n")
    assert main(["place", str(path), "--out", str(tmp_path / "o"), "--max-line-bytes", "1KiB"]) == 2
    assert f"{path}:3: line longer than 1024 bytes" in capsys.readouterr().err
    assert main(["place", str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 0
    assert main(["sweep", str(path), "--max-line-bytes", "1KiB"]) == 2
    assert f"{path}:3: line longer than 1024 bytes" in capsys.readouterr().err
    assert main(["place", "/dev/zero", "--out", str(tmp_path / "z")]) == 2
    assert capsys.readouterr().err.startswith("hazsan place: /dev/zero:1: line longer than 8388608 bytes")
