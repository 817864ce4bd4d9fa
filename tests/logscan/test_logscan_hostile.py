"""hazsan logscan on hostile input (issue 14): non-finite numbers, a quadratic field split, lines
without end. Every run ends in exit 0, 1 or 2 with a one-line error, never a traceback."""
from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sanitizer.logscan import DecodeLine, parse_line, scan
from sanitizer.logscan.parse import BrokenLine, split_fields
from sanitizer.logscan.render import histogram, render_json, render_text

HEAD = "[2026-03-01 10:00:00 TP0] Decode batch, #running-req: 64, #token: 1, "


def _line(accept: str) -> str:
    return f"{HEAD}accept len: {accept}, gen throughput (token/s): 1.0\n"


def _hazsan(*argv, stdin=None, timeout=60):
    return subprocess.run([sys.executable, "-m", "sanitizer", *argv], capture_output=True, text=True,
                          input=stdin, timeout=timeout)


@pytest.mark.parametrize("value", ["inf", "-inf", "1e999", "nan", "Infinity", "-1", "1e300"])
def test_non_finite_or_absurd_accept_len_is_an_unparsed_line_not_a_value(value):
    parsed = parse_line(_line(value))
    assert isinstance(parsed, BrokenLine)
    assert "out of range" in parsed.reason or "not a number" in parsed.reason


def test_inf_accept_len_in_a_log_renders_every_format(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(_line("inf") + _line("1e999") + _line("1.5") + _line("3.0"))
    for argv in (["--format", "json"], ["--format", "text"], ["--html", str(tmp_path / "r.html")]):
        r = _hazsan("logscan", *argv, str(log))
        assert r.returncode == 1, r.stderr
        assert "Traceback" not in r.stderr
    res = scan([log])
    assert list(res.accept_lens()) == [1.5, 3.0]
    assert res.unparsed_count == 2


@pytest.mark.parametrize("threshold", ["inf", "-inf", "nan", "1e999", "1e308", "-1"])
def test_threshold_that_is_not_a_usable_number_is_refused_with_exit_2(tmp_path, threshold):
    log = tmp_path / "server.log"
    log.write_text(_line("1.5"))
    r = _hazsan("logscan", f"--threshold={threshold}", str(log))
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "--threshold" in r.stderr


@given(values=st.lists(st.floats(min_value=0, max_value=1e6), min_size=1, max_size=50),
       threshold=st.floats(min_value=0, max_value=1e6))
@settings(max_examples=300, deadline=None)
def test_histogram_counts_every_value_once_whatever_the_range(values, threshold):
    bins = histogram(values, threshold)
    assert sum(c for _, _, c in bins) == len(values)
    assert len(bins) <= 40
    for lo, hi, _ in bins:
        assert lo < hi


def test_field_split_is_linear_in_line_length():
    """250 KB of commas took 7 s with the lookahead split (quadratic); the scan must stay linear."""
    def cost(n):            # best of 3 in CPU time: a loaded machine only ever adds to one sample
        text = HEAD + "accept len: 1.5, " + ",x: 1" * n
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            parse_line(text)
            best = min(best, time.process_time() - t0)
        return best
    small, large = cost(5_000), cost(50_000)  # 250 KB
    assert large < 3.0                        # the quadratic split took 7 s here
    assert large < 40 * max(small, 1e-3)  # 10x the input: far less than the 100x of a quadratic


@given(st.text(alphabet="ab,[] :1", max_size=40))
@settings(max_examples=500, deadline=None)
def test_field_split_matches_the_old_lookahead_split(text):
    assert split_fields(text) == re.split(r",(?![^\[]*\])", text)


def test_line_without_end_is_an_error_naming_file_and_line_not_unbounded_memory(tmp_path):
    r = _hazsan("logscan", "/dev/zero", timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("hazsan logscan: error: /dev/zero:1: line longer than")
    log = tmp_path / "long.log"
    log.write_text(_line("1.5") + "x" * 5000 + "\n")
    r = _hazsan("logscan", "--max-line-chars", "1000", str(log))
    assert r.returncode == 2 and f"{log}:2: line longer than 1000" in r.stderr
    r = _hazsan("logscan", "--max-line-chars", "10000", str(log))
    assert r.returncode == 1, r.stderr


_FIELD = st.sampled_from(["#running-req", "accept len", "accept rate", "#token", "x", ""])
_VALUE = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr),
                   st.integers(-2**70, 2**70).map(str),
                   st.text(alphabet="0123456789.e-+[], infa", max_size=12))


@st.composite
def _decode_lines(draw):
    fields = draw(st.lists(st.tuples(_FIELD, _VALUE), max_size=8))
    sep = draw(st.sampled_from([",", ".", "", " "]))
    body = ", ".join(f"{k}: {v}" for k, v in fields)
    prefix = draw(st.sampled_from(["", "[2026-03-01 10:00:00 TP0] ", "[x DP1] ", "\x1b[31m"]))
    return f"{prefix}Decode batch{sep} {body}" + draw(st.sampled_from(["", "\n", "\r\n", ",,"]))


def test_a_count_beyond_64_bits_renders_as_json(tmp_path):
    """Found by the fuzz below: orjson refuses integers beyond 64 bits; the report still renders."""
    import json
    log = tmp_path / "big.log"
    log.write_text("Decode batch, \nDecode batch, #running-req: 18446744073709551616, accept len: 0.0\n")
    doc = json.loads(render_json(scan([log], threshold=0.0)))
    assert "18446744073709551616" in json.dumps(doc)


@given(lines=st.lists(st.one_of(_decode_lines(), st.text(max_size=60)), max_size=20),
       threshold=st.floats(min_value=0, max_value=1e6))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzz_logscan_parses_and_renders_anything(tmp_path, lines, threshold):
    """Bounded fuzz: any log text parses, and the renderings succeed."""
    log = tmp_path / "fuzz.log"
    log.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
    res = scan([log], threshold=threshold)
    for raw in lines:
        parsed = parse_line(raw)
        assert parsed is None or isinstance(parsed, (DecodeLine, BrokenLine))
        if isinstance(parsed, DecodeLine) and parsed.accept_len is not None:
            assert 0 <= parsed.accept_len <= 1e6
    render_text(res, 10)  # holds the histogram the HTML report shows (its plot: the test above)
    render_json(res)
    # 2 exactly when the file held no line of either format (not a server log), else 1 iff flagged
    assert res.exit_code() == (2 if res.formats()[str(log)] == "none" else 1 if res.flagged else 0)
