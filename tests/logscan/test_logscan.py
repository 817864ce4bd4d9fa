"""hazsan logscan: SGLang decode-line formats, the signature, output contract and exit codes.

Fixture lines in tests/fixtures/logs/ follow SGLang's own format strings
(0.5.23 scheduler_components/metrics_reporter.py + pool_stats_observer.py; 0.4.x scheduler.py).
"""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sanitizer.cli import main
from sanitizer.logscan import BrokenLine, DecodeLine, parse_line, scan
from sanitizer.logscan.render import histogram, render_html, render_text, to_dict

LOGS = Path(__file__).parents[1] / "fixtures" / "logs"


def _json(capsys, argv):
    code = main(["logscan", "--format", "json", *argv])
    return code, json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------------------ line formats

def test_current_format_with_rank_prefix_and_optional_spec_fields():
    d = parse_line("[2026-03-01 10:00:09 DP1 TP4 EP4] Decode batch, #running-req: 31, #token: 41321, "
                   "token usage: 0.21, accept len: 1.21, accept rate: 0.05, cap len: 3.90, block accept len: 1.10, "
                   "cuda graph: True, gen throughput (token/s): 870.44, #queue-req: 0\n")
    assert isinstance(d, DecodeLine)
    assert (d.prefix, d.time, d.iter, d.running_req, d.accept_len) == ("DP1 TP4 EP4", "2026-03-01 10:00:09", None, 31, 1.21)
    assert d.number("accept rate") == 0.05
    assert d.number("cap len") == 3.90
    assert d.number("block accept len") == 1.10
    assert d.fields["#queue-req"] == "0"


def test_iter_milliseconds_every_rank_tag_and_hybrid_swa_fields():
    d = parse_line((LOGS / "sglang_iter_swa.log").read_text().splitlines()[1])
    assert isinstance(d, DecodeLine)
    assert d.iter == 1060
    assert d.time == "2026-03-02 08:15:01.502"
    assert d.prefix == "DP0 PP1 ATTN_CP0 MOE_DP0 TP2 EP2"
    assert d.fields["#full token"] == "24576" and d.fields["#swa token"] == "8192"
    assert d.number("swa token usage") == 0.16
    assert "#token" not in d.fields
    # DSPARK's estimate holds a bracketed pair with a comma inside: one field, not two.
    assert d.fields["est uncap acc len"] == "4.81 [4.55, 5.07]"
    assert d.number("est uncap acc len") == 4.81
    assert d.accept_len == 4.62 and d.running_req == 16


def test_block_accept_len_and_estimate_are_not_the_accept_len():
    # Low block accept len and a low estimate, but accept len 3.05: not the signature.
    line = (LOGS / "sglang_iter_swa.log").read_text().splitlines()[2]
    d = parse_line(line)
    assert d.accept_len == 3.05 and d.number("block accept len") == 1.40
    # Same fields, reordered so `block accept len` comes first: still read by exact key.
    d2 = parse_line("[2026-03-02 08:15:03] Decode batch, #running-req: 16, block accept len: 1.40, "
                    "est uncap acc len: 1.62 [1.20, 2.04], accept len: 3.05, #queue-req: 0")
    assert d2.accept_len == 3.05
    r = scan([LOGS / "sglang_iter_swa.log"])
    assert [i.line for i in r.flagged] == [4]  # only the 1.75 interval


def test_older_scheduler_format_with_period_and_trailing_comma():
    lines = (LOGS / "sglang_old_scheduler.log").read_text().splitlines()
    plain = parse_line(lines[1])  # speculative decoding off: a decode line, not an interval
    assert isinstance(plain, DecodeLine) and plain.accept_len is None and plain.running_req == 1
    spec = parse_line(lines[3])
    assert (spec.prefix, spec.accept_len, spec.running_req) == ("TP0", 1.04, 4)
    assert spec.number("accept rate") is None
    noprefix = parse_line(lines[5])
    assert noprefix.prefix == "" and noprefix.time == "2025-01-20 03:12:49" and noprefix.accept_len == 1.5


def test_iter_with_older_separator_and_no_timestamp_bracket():
    d = parse_line("Decode batch [77]. #running-req: 3, #token: 10, token usage: 0.00, accept len: 2.50, ")
    assert (d.iter, d.prefix, d.time, d.accept_len) == (77, "", None, 2.5)


def test_docker_compose_prefix_and_ansi_colour_codes():
    d = parse_line("sglang-tp-1  | \x1b[32m[2026-03-01 10:00:05 TP1]\x1b[0m Decode batch, #running-req: 8, "
                   "#token: 100, token usage: 0.01, accept len: 1.90, accept rate: 0.30, cuda graph: True, "
                   "gen throughput (token/s): 10.00, #queue-req: 0")
    assert (d.prefix, d.accept_len, d.running_req) == ("TP1", 1.9, 8)


def test_non_decode_lines_are_ignored():
    for line in ("[2026-03-01 10:00:02 DP0 TP0] Prefill batch, #new-seq: 8, #running-req: 0, accept len: 1.00",
                 "[2026-03-01] Decode out of memory happened. #retracted_reqs: 3",
                 "", "\x00\xff"):
        assert parse_line(line) is None


@pytest.mark.parametrize("line, reason", [
    ("[t] Decode batch, #running-req: 12, #token: 9100, token usage: 0.05, accept le", "no value"),
    ("[t] Decode batch, #running-req: 12, accept len: n/a, #queue-req: 0", "not a number"),
    ("[t] Decode batch, #running-req: 12, accept len: nan, #queue-req: 0", "out of range"),
    ("[t] Decode batch, #running-req: many, accept len: 1.10", "not an integer"),
    ("[t] Decode batch, #token: 1, accept len: 1.10", "no '#running-req'"),
    ("[t] Decode batch #running-req: 12", "not followed"),
    ("[a TP0] Decode batch, #running-req: 1, tok[b TP1] Decode batch, #running-req: 2, accept len: 3.00", "interleaved"),
])
def test_broken_decode_lines_are_recognised_with_a_reason(line, reason):
    got = parse_line(line)
    assert isinstance(got, BrokenLine) and reason in got.reason


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80), st.text(max_size=120))
def test_parse_never_raises_on_anything_that_looks_like_a_decode_line(before, after):
    got = parse_line(before + "Decode batch" + after)
    assert got is None or isinstance(got, (DecodeLine, BrokenLine))


# ------------------------------------------------------------------------------ the signature

def test_threshold_is_inclusive_and_idle_intervals_are_not_flagged():
    r = scan([LOGS / "sglang_0523_dp_tp.log"])
    assert r.intervals == 8 and r.decode_lines == 8 and r.unparsed_count == 0
    assert [(i.line, i.prefix, i.accept_len, i.running_req) for i in r.flagged] == [
        (7, "DP1 TP4 EP4", 1.21, 31), (8, "DP0 TP0 EP0", 2.0, 32)]
    assert r.below_min_running == 1  # accept len 1.00 with #running-req 0
    assert {p: (s.decode_lines, s.flagged) for p, s in r.by_prefix.items()} == {
        "DP0 TP0 EP0": (4, 1), "DP1 TP4 EP4": (4, 1)}


def test_threshold_and_min_running_options_change_what_is_flagged():
    assert [i.line for i in scan([LOGS / "sglang_0523_dp_tp.log"], threshold=1.5).flagged] == [7]
    assert [i.line for i in scan([LOGS / "sglang_0523_dp_tp.log"], min_running=32).flagged] == [8]
    assert [i.line for i in scan([LOGS / "sglang_0523_dp_tp.log"], min_running=0).flagged] == [7, 8, 10]


def test_broken_lines_are_counted_and_shown_and_good_ones_still_scanned(capsys):
    code = main(["logscan", str(LOGS / "broken.log")])
    out = capsys.readouterr().out
    assert code == 1  # line 7 is a real flagged interval
    assert "5 unparsed" in out
    assert "broken.log:2: field 'accept le' has no value" in out
    assert "broken.log:4: two 'Decode batch' records" in out
    r = scan([LOGS / "broken.log"])
    assert r.unparsed_count == 5 and [u.line for u in r.unparsed] == [2, 3, 4, 5, 6]
    assert [i.line for i in r.flagged] == [7]


def test_text_report_has_prefix_table_histogram_flagged_lines_and_verdict(capsys):
    code = main(["logscan", str(LOGS / "sglang_0523_dp_tp.log")])
    out = capsys.readouterr().out
    assert code == 1
    assert "DP1 TP4 EP4" in out and "per rank prefix" in out
    assert "accept-length distribution" in out and "<= threshold" in out
    assert "sglang_0523_dp_tp.log:7" in out and "sglang_0523_dp_tp.log:8" in out
    assert "verdict: SIGNATURE FOUND: 2 of 8" in out


def test_clean_log_exits_0_with_a_clean_verdict(tmp_path, capsys):
    log = tmp_path / "clean.log"
    log.write_text("".join(
        f"[2026-03-01 10:00:{i:02d} DP0 TP0] Decode batch, #running-req: 16, #token: 9000, token usage: 0.05, "
        f"accept len: {2.5 + i / 100:.2f}, accept rate: 0.50, cuda graph: True, gen throughput (token/s): 900.00, "
        "#queue-req: 0\n" for i in range(30)))
    code, doc = _json(capsys, [str(log)])
    assert code == 0 and doc["intervals"] == 30 and doc["flagged"] == [] and not doc["signature_found"]
    assert doc["verdict"].startswith("clean")
    assert sum(b["count"] for b in doc["histogram"]) == 30


def test_json_contract(capsys):
    code, doc = _json(capsys, [str(LOGS / "sglang_0523_dp_tp.log"), str(LOGS / "sglang_old_scheduler.log")])
    assert code == 1
    assert doc["intervals"] == 12
    assert doc["flagged"][0] == {"file": str(LOGS / "sglang_0523_dp_tp.log"), "line": 7, "prefix": "DP1 TP4 EP4",
                                 "time": "2026-03-01 10:00:09", "accept_len": 1.21, "running_req": 31,
                                 "accept_rate": 0.05}
    assert [(f["prefix"], f["line"]) for f in doc["flagged"]] == [
        ("DP1 TP4 EP4", 7), ("DP0 TP0 EP0", 8), ("TP0", 4), ("", 6)]
    assert doc["by_prefix"]["TP0"] == {"decode_lines": 4, "intervals": 3, "flagged": 1, "accept_len_min": 1.04,
                                       "accept_len_median": 2.71, "accept_len_mean": pytest.approx((2.95 + 1.04 + 2.71) / 3)}
    assert doc["decode_lines"] == 13 and doc["unparsed"] == 0


def test_gzip_logs_are_read_by_content(tmp_path, capsys):
    gz = tmp_path / "server.log.1"  # rotated name without .gz: detected by the magic bytes
    gz.write_bytes(gzip.compress((LOGS / "sglang_0523_dp_tp.log").read_bytes()))
    code, doc = _json(capsys, [str(gz)])
    assert code == 1 and doc["intervals"] == 8 and len(doc["flagged"]) == 2


def test_cut_short_gzip_keeps_what_came_before(tmp_path):
    data = gzip.compress((LOGS / "sglang_0523_dp_tp.log").read_bytes() * 50)
    gz = tmp_path / "cut.log.gz"
    gz.write_bytes(data[: len(data) * 2 // 3])
    r = scan([gz])
    assert 0 < r.intervals < 400
    assert any("read stopped" in u.reason for u in r.unparsed)


@pytest.mark.parametrize("make", ["missing", "directory", "bad_gzip"])
def test_unreadable_input_exits_2_naming_the_file(tmp_path, capsys, make):
    target = tmp_path / make
    if make == "directory":
        target.mkdir()
    elif make == "bad_gzip":
        target.write_bytes(b"\x1f\x8b\x08\x00garbage, not deflate")
    code = main(["logscan", str(LOGS / "sglang_0523_dp_tp.log"), str(target)])
    err = capsys.readouterr().err
    assert code == 2
    assert str(target) in err


def test_stdin():
    proc = subprocess.run([sys.executable, "-m", "sanitizer", "logscan", "--format", "json", "-"],
                          input=(LOGS / "sglang_old_scheduler.log").read_bytes(), capture_output=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert len(json.loads(proc.stdout)["flagged"]) == 2


def test_no_speculative_decoding_is_said_plainly(tmp_path):
    log = tmp_path / "nospec.log"
    log.write_text("[2026-03-01 10:00:00 TP0] Decode batch, #running-req: 4, #token: 40, token usage: 0.00, "
                   "cuda graph: True, gen throughput (token/s): 12.41, #queue-req: 0\n")
    r = scan([log])
    assert r.decode_lines == 1 and r.intervals == 0 and r.exit_code() == 0
    assert "speculative decoding is off" in to_dict(r)["verdict"]
    assert "no decode interval" in render_text(r)


# ------------------------------------------------------------------------------ histogram and HTML

@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=9, allow_nan=False).map(lambda v: round(v, 2)), min_size=1, max_size=60),
       st.sampled_from([1.5, 2.0, 2.5]))
def test_histogram_bins_are_right_closed_and_split_at_the_threshold(values, threshold):
    bins = histogram(values, threshold)
    assert sum(c for _, _, c in bins) == len(values)
    for lo, hi, c in bins:
        inside = [v for v in values if lo + 1e-9 < v <= hi + 1e-9]
        assert len(inside) == c
        assert hi <= threshold + 1e-9 or lo >= threshold - 1e-9  # no bar straddles the threshold
    assert len(bins) <= 17


def test_html_report_without_matplotlib_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    out = tmp_path / "report.html"
    code = main(["logscan", "--html", str(out), str(LOGS / "sglang_0523_dp_tp.log")])
    err = capsys.readouterr().err
    assert code == 1
    assert "matplotlib is not installed" in err
    page = out.read_text()
    assert "matplotlib is not installed" in page and "<pre>" in page and "<img" not in page
    assert "DP1 TP4 EP4" in page and "SIGNATURE FOUND" in page


def test_html_report_with_matplotlib_embeds_a_png():
    pytest.importorskip("matplotlib")
    page, has_plot = render_html(scan([LOGS / "sglang_0523_dp_tp.log"]))
    assert has_plot and "data:image/png;base64,iVBOR" in page


def test_html_escapes_log_text(tmp_path):
    log = tmp_path / "x.log"
    log.write_text("[2026-03-01 10:00:00 TP0] Decode batch, #running-req: 4, <script>x</script>: 1, accept len: 1.00\n")
    page, _ = render_html(scan([log]))
    assert "<script>" not in page and "&lt;script&gt;" in page


# ------------------------------------------------------------------------------ NGRAM cold start
# SGLang 0.5.23's own lines (make sglang-proof, depth 5, TP=2 on CPU; the fixed build): the first
# decode step after a prefill that admitted the whole batch has no NGRAM draft (accept len 1.00).
_PREFILL = ("[2026-12-05 05:31:11 TP0] Prefill batch, #new-seq: {new}, #new-token: 571, #cached-token: 0, "
            "token usage: 0.07, #running-req: {before}, #queue-req: 0, #pending-token: 0, cpu graph: False, "
            "input throughput (token/s): 81.37\n")
_DECODE = ("[2026-12-05 05:31:12 {prefix}] Decode batch, #running-req: {running}, #token: 907, token usage: 0.11, "
           "accept len: {accept:.2f}, accept rate: 0.00, cpu graph: False, gen throughput (token/s): 312.51, "
           "#queue-req: 0\n")


def _scan_lines(tmp_path, lines, **kw):
    log = tmp_path / "server.log"
    log.write_text("".join(lines))
    return scan([log], **kw)


def test_first_decode_step_of_a_freshly_admitted_batch_is_not_the_signature(tmp_path):
    r = _scan_lines(tmp_path, [_PREFILL.format(new=16, before=0),
                               _DECODE.format(prefix="TP0", running=16, accept=1.0),
                               _DECODE.format(prefix="TP0", running=16, accept=6.0)], threshold=3.0, min_running=8)
    assert (len(r.flagged), r.cold_start, r.intervals) == (0, 1, 2)
    assert to_dict(r)["cold_start"] == 1
    assert "first decode step" in render_text(r)


def test_a_collapse_after_the_cold_start_or_with_older_requests_running_is_flagged(tmp_path):
    r = _scan_lines(tmp_path, [_PREFILL.format(new=16, before=0),
                               _DECODE.format(prefix="TP0", running=16, accept=1.0),
                               _DECODE.format(prefix="TP0", running=16, accept=1.19),     # not right after a prefill
                               _PREFILL.format(new=4, before=12),
                               _DECODE.format(prefix="TP0", running=16, accept=1.0),      # 12 requests had drafts
                               _PREFILL.format(new=16, before=0),
                               _DECODE.format(prefix="TP1", running=16, accept=1.0)],     # another rank's prefill
                      threshold=3.0, min_running=8)
    assert [f.line for f in r.flagged] == [3, 5, 7]
    assert r.cold_start == 1
