"""hazsan logscan on vLLM server logs: the stats and `SpecDecoding metrics` lines, their pairing,
the flag criterion, broken lines, mixed inputs and the output contract (docs/logscan-formats.md).

The literal lines below are vLLM's format strings filled in; `test_literal_lines_are_vllms_format_strings`
proves it against the format strings copied from the source they name (vLLM 0.32.0
`vllm/v1/spec_decode/metrics.py` `SpecDecodingLogging.log`, `vllm/v1/metrics/loggers.py`
`LoggingStatLogger.log`, `vllm/logger.py` `_FORMAT` and `logging_utils/formatter.py`
`ColoredFormatter`; older versions from vLLM pull requests #15902, #16665, #17908, #24127 and
`_add_prefix`). tests/data/vllm-0.32-specdecode.log and -color.log were written by vLLM 0.32.0's
own `LoggingStatLogger` and `SpecDecodingLogging` (no engine: their `record`/`log` fed by
`tests/data/vllm-0.32-make-fixture.py`, run as
`.venv-e2e/bin/python tests/data/vllm-0.32-make-fixture.py tests/data`; its docstring says how).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sanitizer.cli import main
from sanitizer.logscan import BrokenLine, scan
from sanitizer.logscan.render import render_markdown, render_text, to_dict
from sanitizer.logscan.vllm import VllmLegacy, VllmSpec, VllmStats, parse_vllm_line

DATA = Path(__file__).parents[1] / "data"
LOGS = Path(__file__).parents[1] / "fixtures" / "logs"
FIXTURE = DATA / "vllm-0.32-specdecode.log"
FIXTURE_COLOR = DATA / "vllm-0.32-specdecode-color.log"

# ------------------------------------------------------------------------------ vLLM's format strings

# vllm/logger.py (0.32): f"{VLLM_LOGGING_PREFIX}(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d] %(message)s"
LOG_FMT_032 = "(%s pid=%d) %s %s [%s:%d] %s"
# ColoredFormatter: cyan process prefix, level colour, grey time and file info.
LOG_FMT_032_COLOR = "\033[0;36m(%s pid=%d)\033[0;0m \033[32m%s\033[0m \033[90m%s\033[0m \033[90m[%s:%d]\033[0m %s"
# 0.10-0.2x: `_add_prefix` wrote f"{CYAN}({worker_name} pid={pid}){RESET} " before
# "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s".
LOG_FMT_DECORATED = "\033[1;36m(%s pid=%d)\033[0;0m %s %s [%s:%d] %s"
LOG_FMT_PLAIN = "%s %s [%s:%d] %s"

SPEC_032 = ("SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
            "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
            "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%")
# 0.8.5 (PR #16665, mean without the bonus token) and 0.9.0-0.10.1 (PR #17908, with it): same text.
SPEC_16665 = ("SpecDecoding metrics: Draft acceptance rate: %.1f%%, Mean acceptance length: %.2f, "
              "Accepted: %d tokens, Drafted: %d tokens, Per-position acceptance rate: %s")
SPEC_15902 = "SpecDecoding metrics: Draft acceptance rate: %.1f%%, Accepted: %d tokens, Drafted: %d tokens"
STATS_032 = "Engine %03d: " + ", ".join([
    "Avg prompt throughput: %.1f tokens/s", "Avg generation throughput: %.1f tokens/s",
    "Running: %d reqs", "Waiting: %d reqs", "%s KV cache usage: %.1f%%", "Prefix cache hit rate: %.1f%%"])
STATS_032_ALL = "Engine %03d: " + ", ".join([
    "Avg prompt throughput: %.1f tokens/s", "Avg generation throughput: %.1f tokens/s",
    "Running: %d reqs", "Waiting: %d reqs", "Deferred: %d reqs",
    "KV fetch: %d waiting to start, %d in progress, %d completed waiting", "Preemptions: %d",
    "%s KV cache usage: %.1f%%", "Prefix cache hit rate: %.1f%%", "Corrupted: %d reqs",
    "External prefix cache hit rate: %.1f%%", "MM cache hit rate: %.1f%%"])
STATS_09 = ("Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, GPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%")

# ------------------------------------------------------------------------------ literal lines

STATS_LINE = ("(APIServer pid=4242) INFO 03-01 10:00:10 [loggers.py:335] Engine 000: Avg prompt throughput: "
              "0.0 tokens/s, Avg generation throughput: 812.4 tokens/s, Running: 64 reqs, Waiting: 0 reqs, "
              "GPU KV cache usage: 41.2%, Prefix cache hit rate: 12.5%")
SPEC_LINE = ("(APIServer pid=4242) INFO 03-01 10:00:10 [metrics.py:120] SpecDecoding metrics: Mean acceptance "
             "length: 3.20, Accepted throughput: 440.00 tokens/s, Drafted throughput: 600.00 tokens/s, "
             "Accepted: 4400 tokens, Drafted: 6000 tokens, Per-position acceptance rate: 0.900, 0.800, 0.500, "
             "Avg Draft acceptance rate: 73.3%")
LOW_SPEC_LINE = ("(APIServer pid=4242) INFO 03-01 10:00:20 [metrics.py:120] SpecDecoding metrics: Mean acceptance "
                 "length: 1.14, Accepted throughput: 20.70 tokens/s, Drafted throughput: 435.00 tokens/s, "
                 "Accepted: 414 tokens, Drafted: 8700 tokens, Per-position acceptance rate: 0.143, 0.000, 0.000, "
                 "Avg Draft acceptance rate: 4.8%")
COLOR_STATS_LINE = ("\x1b[0;36m(APIServer pid=4242)\x1b[0;0m \x1b[32mINFO\x1b[0m \x1b[90m03-01 10:00:20\x1b[0m "
                    "\x1b[90m[loggers.py:335]\x1b[0m Engine 001: Avg prompt throughput: 0.0 tokens/s, Avg generation "
                    "throughput: 902.0 tokens/s, Running: 64 reqs, Waiting: 2 reqs, CPU KV cache usage: 45.0%, "
                    "Prefix cache hit rate: 12.5%")
COLOR_SPEC_LINE = ("\x1b[0;36m(APIServer pid=4242)\x1b[0;0m \x1b[32mINFO\x1b[0m \x1b[90m03-01 10:00:20\x1b[0m "
                   "\x1b[90m[metrics.py:120]\x1b[0m SpecDecoding metrics: Mean acceptance length: 1.14, Accepted "
                   "throughput: 20.70 tokens/s, Drafted throughput: 435.00 tokens/s, Accepted: 414 tokens, Drafted: "
                   "8700 tokens, Per-position acceptance rate: 0.143, 0.000, 0.000, Avg Draft acceptance rate: 4.8%")
NOPREFIX_STATS_LINE = ("INFO 05-20 08:00:10 [loggers.py:116] Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg "
                       "generation throughput: 500.0 tokens/s, Running: 12 reqs, Waiting: 0 reqs, GPU KV cache "
                       "usage: 8.0%, Prefix cache hit rate: 0.0%")
# 0.9.x: the acceptance rate first, bonus token included (1 + 0.70 + 0.40).
OLD_SPEC_LINE = ("INFO 05-20 08:00:10 [metrics.py:82] SpecDecoding metrics: Draft acceptance rate: 55.0%, Mean "
                 "acceptance length: 2.10, Accepted: 1100 tokens, Drafted: 2000 tokens, Per-position acceptance "
                 "rate: 0.700, 0.400")
# 0.8.5: the same text, bonus token left out (0.70 + 0.40): read as 2.10.
SPEC_0_8_5_LINE = ("INFO 04-30 08:00:10 [metrics.py:82] SpecDecoding metrics: Draft acceptance rate: 55.0%, Mean "
                   "acceptance length: 1.10, Accepted: 1100 tokens, Drafted: 2000 tokens, Per-position acceptance "
                   "rate: 0.700, 0.400")
# 0.8.3-0.8.4 (PR #15902's own example): no mean acceptance length.
SPEC_0_8_3_LINE = ("INFO 04-02 08:00:10 [metrics.py:58] SpecDecoding metrics: Draft acceptance rate: 100.0%, "
                   "Accepted: 66 tokens, Drafted: 66 tokens")
# PR #24127's test output (mid 2025), as posted: `_add_prefix`'s process prefix (colour off),
# the acceptance rate first, the throughputs, no average at the end.
PR24127_LINE = ("(APIServer pid=2236552) INFO 09-09 11:51:35 [metrics.py:96] SpecDecoding metrics: Draft "
                "acceptance rate: 88.8%, Mean acceptance length: 5.44, Accepted throughput: 4.37 tokens/s, "
                "Drafted throughput: 4.92 tokens/s, Accepted: 262 tokens, Drafted: 295 tokens, Per-position "
                "acceptance rate: 0.983, 0.949, 0.915, 0.881, 0.712")
DECORATED_STATS_LINE = ("\x1b[1;36m(APIServer pid=2236552)\x1b[0;0m INFO 09-09 11:51:35 [loggers.py:123] Engine 000: "
                        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 4.4 tokens/s, Running: 1 "
                        "reqs, Waiting: 0 reqs, GPU KV cache usage: 0.1%, Prefix cache hit rate: 0.0%")
# Issue #9539 (vLLM 0.6.3, V0 engine), as posted: cumulative counts, no mean acceptance length.
V0_SPEC_LINE = ("INFO 10-16 19:05:47 metrics.py:367] Speculative metrics: Draft acceptance rate: 0.642, System "
                "efficiency: 0.598, Number of speculative tokens: 3, Number of accepted tokens: 8547, Number of "
                "draft tokens: 13311, Number of emitted tokens: 10616.")


def test_literal_lines_are_vllms_format_strings():
    assert STATS_LINE == LOG_FMT_032 % ("APIServer", 4242, "INFO", "03-01 10:00:10", "loggers.py", 335,
                                        STATS_032 % (0, 0.0, 812.4, 64, 0, "GPU", 41.2, 12.5))
    assert SPEC_LINE == LOG_FMT_032 % ("APIServer", 4242, "INFO", "03-01 10:00:10", "metrics.py", 120,
                                       SPEC_032 % (3.2, 440, 600, 4400, 6000, "0.900, 0.800, 0.500", 4400 / 6000 * 100))
    assert LOW_SPEC_LINE == LOG_FMT_032 % ("APIServer", 4242, "INFO", "03-01 10:00:20", "metrics.py", 120,
                                           SPEC_032 % (1.14, 20.7, 435, 414, 8700, "0.143, 0.000, 0.000", 4.8))
    assert COLOR_STATS_LINE == LOG_FMT_032_COLOR % ("APIServer", 4242, "INFO", "03-01 10:00:20", "loggers.py", 335,
                                                    STATS_032 % (1, 0.0, 902.0, 64, 2, "CPU", 45.0, 12.5))
    assert COLOR_SPEC_LINE == LOG_FMT_032_COLOR % ("APIServer", 4242, "INFO", "03-01 10:00:20", "metrics.py", 120,
                                                   SPEC_032 % (1.14, 20.7, 435, 414, 8700, "0.143, 0.000, 0.000", 4.8))
    assert NOPREFIX_STATS_LINE == LOG_FMT_PLAIN % ("INFO", "05-20 08:00:10", "loggers.py", 116,
                                                   STATS_09 % (0, 0.0, 500.0, 12, 0, 8.0, 0.0))
    assert OLD_SPEC_LINE == LOG_FMT_PLAIN % ("INFO", "05-20 08:00:10", "metrics.py", 82,
                                             SPEC_16665 % (55.0, 2.1, 1100, 2000, "0.700, 0.400"))
    assert SPEC_0_8_5_LINE == LOG_FMT_PLAIN % ("INFO", "04-30 08:00:10", "metrics.py", 82,
                                               SPEC_16665 % (55.0, 1.1, 1100, 2000, "0.700, 0.400"))
    assert SPEC_0_8_3_LINE == LOG_FMT_PLAIN % ("INFO", "04-02 08:00:10", "metrics.py", 58, SPEC_15902 % (100.0, 66, 66))
    assert DECORATED_STATS_LINE == LOG_FMT_DECORATED % ("APIServer", 2236552, "INFO", "09-09 11:51:35", "loggers.py",
                                                        123, STATS_09 % (0, 0.0, 4.4, 1, 0, 0.1, 0.0))


# ------------------------------------------------------------------------------ one line

def test_032_stats_and_spec_lines_with_process_prefix():
    s = parse_vllm_line(STATS_LINE + "\n")
    assert isinstance(s, VllmStats)
    assert (s.process, s.time, s.engine, s.running_req, s.waiting_req) == (
        "APIServer pid=4242", "03-01 10:00:10", "Engine 000", 64, 0)
    assert s.fields["GPU KV cache usage"] == "41.2%" and s.fields["Prefix cache hit rate"] == "12.5%"
    d = parse_vllm_line(SPEC_LINE + "\n")
    assert isinstance(d, VllmSpec)
    assert (d.process, d.accept_len, d.logged_accept_len, d.bonus_added) == ("APIServer pid=4242", 3.2, 3.2, False)
    assert (d.accepted, d.drafted, d.per_position, d.num_spec_tokens) == (4400, 6000, [0.9, 0.8, 0.5], 3)
    assert d.accept_rate == pytest.approx(0.733)


def test_colour_and_cpu_device_naming():
    s = parse_vllm_line(COLOR_STATS_LINE)
    assert (s.process, s.time, s.engine, s.running_req) == ("APIServer pid=4242", "03-01 10:00:20", "Engine 001", 64)
    assert "CPU KV cache usage" in s.fields
    d = parse_vllm_line(COLOR_SPEC_LINE)
    assert (d.process, d.time, d.accept_len) == ("APIServer pid=4242", "03-01 10:00:20", 1.14)


def test_every_optional_stats_field_and_kv_fetch_commas():
    msg = STATS_032_ALL % (3, 1.5, 700.0, 40, 7, 2, 1, 0, 3, 5, "XPU", 60.0, 10.0, 0, 4.0, 50.0)
    s = parse_vllm_line(LOG_FMT_032 % ("APIServer", 1, "INFO", "03-01 10:00:00", "loggers.py", 335, msg))
    assert (s.engine, s.running_req, s.waiting_req) == ("Engine 003", 40, 7)
    assert s.fields["KV fetch"] == "1 waiting to start, 0 in progress, 3 completed waiting"
    assert s.fields["Preemptions"] == "5" and s.fields["XPU KV cache usage"] == "60.0%"
    assert s.fields["MM cache hit rate"] == "50.0%"


def test_aggregated_engines_and_older_unprefixed_lines():
    msg = ("2 Engines Aggregated: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 9.0 tokens/s, "
           "Running: 96 reqs, Waiting: 0 reqs, GPU KV cache usage: 1.0%")
    s = parse_vllm_line("INFO 03-01 10:00:00 [loggers.py:1] " + msg)
    assert (s.engine, s.running_req, s.process) == ("2 Engines Aggregated", 96, "")
    s = parse_vllm_line(NOPREFIX_STATS_LINE)
    assert (s.process, s.engine, s.running_req) == ("", "Engine 000", 12)
    # Before vLLM 0.8: no `Engine NNN: `.
    s = parse_vllm_line("INFO 02-01 10:00:00 [loggers.py:86] Avg prompt throughput: 0.0 tokens/s, Avg generation "
                        "throughput: 5.0 tokens/s, Running: 2 reqs, Waiting: 0 reqs, GPU KV cache usage: 1.0%, "
                        "Prefix cache hit rate: 0.0%")
    assert (s.engine, s.running_req) == (None, 2)


def test_older_field_orders_and_the_bonus_token():
    d = parse_vllm_line(OLD_SPEC_LINE)  # 0.9.x: acceptance rate first, bonus token included
    assert (d.accept_len, d.bonus_added, d.accept_rate) == (2.1, False, 0.55)
    d = parse_vllm_line(SPEC_0_8_5_LINE)  # 0.8.5: bonus token left out, recognised, one added
    assert (d.accept_len, d.logged_accept_len, d.bonus_added) == (pytest.approx(2.1), 1.1, True)
    d = parse_vllm_line(PR24127_LINE)  # 1 + (0.983 + 0.949 + 0.915 + 0.881 + 0.712) = 5.44
    assert (d.process, d.accept_len, d.bonus_added, d.num_spec_tokens) == ("APIServer pid=2236552", 5.44, False, 5)
    d = parse_vllm_line(SPEC_0_8_3_LINE)  # no mean acceptance length: a line, not an interval
    assert isinstance(d, VllmSpec) and d.accept_len is None and d.accept_rate == 1.0
    s = parse_vllm_line(DECORATED_STATS_LINE)
    assert (s.process, s.running_req) == ("APIServer pid=2236552", 1)
    assert isinstance(parse_vllm_line(V0_SPEC_LINE), VllmLegacy)


def test_lines_that_are_not_vllm_metrics():
    for line in ("(APIServer pid=1) INFO 03-01 10:00:00 [api_server.py:1] Started server process",
                 "(APIServer pid=1) INFO:     127.0.0.1:5000 - \"POST /v1/completions HTTP/1.1\" 200 OK",
                 "[2026-03-01 10:00:00 TP0] Decode batch, #running-req: 4, accept len: 1.00", ""):
        assert parse_vllm_line(line) is None


@pytest.mark.parametrize("line, reason", [
    (SPEC_LINE[:SPEC_LINE.index("length: 3.20") + 9], "without 'Accepted"),  # cut inside the number
    (SPEC_LINE.replace("Accepted: 4400 tokens", "Accepted: 44"), "'Accepted' is not 'N tokens'"),
    (SPEC_LINE.replace("3.20", "nan"), "out of range"),
    (SPEC_LINE.replace("3.20", "inf"), "out of range"),
    (SPEC_LINE.replace("3.20", "n/a"), "not a number"),
    (SPEC_LINE.replace("3.20,", ","), "has no value"),
    (STATS_LINE[:STATS_LINE.index("Running: 64") + 11], "ends at 'Running'"),
    (STATS_LINE[:STATS_LINE.index("Running")], "without 'Running"),
    (STATS_LINE.replace("64 reqs", "many reqs"), "'Running' is not 'N reqs'"),
    (STATS_LINE[:120] + SPEC_LINE, "two vLLM metrics records"),
    (SPEC_LINE.replace("Drafted: 6000 tokens", "Accepted: 1 tokens"), "twice"),
    ("(APIServer pid=1) INFO 03-01 10:00:00 [metrics.py:1] SpecDecoding metrics: ", "has no value"),
])
def test_broken_vllm_lines_are_recognised_with_a_reason(line, reason):
    got = parse_vllm_line(line)
    assert isinstance(got, BrokenLine) and reason in got.reason, got


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80), st.sampled_from(["SpecDecoding metrics:", "Avg prompt throughput:",
                                               "Speculative metrics:"]), st.text(max_size=160))
def test_parse_never_raises_on_anything_around_a_marker(before, marker, after):
    got = parse_vllm_line(before + marker + after)
    assert got is None or isinstance(got, (VllmStats, VllmSpec, VllmLegacy, BrokenLine))
    if isinstance(got, VllmSpec) and got.accept_len is not None:
        assert 0 <= got.accept_len <= 1e6 + 1


# ------------------------------------------------------------------------------ pairing and the criterion

def _log(tmp_path, name, *lines) -> Path:
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines))
    return p


def test_real_vllm_032_log_is_flagged_under_load_only():
    r = scan([FIXTURE])
    assert r.format == "vllm" and r.formats() == {str(FIXTURE): "vllm"}
    assert (r.vllm_stats_lines, r.vllm_spec_lines, r.intervals, r.unparsed_count) == (14, 13, 13, 0)
    assert r.decode_lines == 0 and r.unknown_load == 0
    assert [(i.line, i.accept_len, i.running_req) for i in r.flagged] == [(22, 1.14, 64), (26, 1.3, 64)]
    assert r.below_min_running == 1  # the 1.10 interval logged with Running: 0
    (pid,) = {rec.process for rec in r.records}
    assert pid.startswith("APIServer pid=")
    assert {p: (s.decode_lines, s.flagged) for p, s in r.by_prefix.items()} == {
        f"{pid} Engine 000": (6, 2), f"{pid} Engine 001": (7, 0)}
    flagged = [rec for rec in r.records if rec.flagged]
    assert [(rec.stats_line, rec.line, rec.engine) for rec in flagged] == [(21, 22, "Engine 000"), (25, 26, "Engine 000")]
    assert all(rec.num_spec_tokens == 3 and not rec.bonus_added for rec in r.records)


def test_colour_fixture_reads_as_the_plain_one():
    plain, color = scan([FIXTURE]), scan([FIXTURE_COLOR])
    key = lambda r: [(x.engine, x.accept_len, x.running_req, x.stats_line is not None, x.flagged) for x in r.records]  # noqa: E731
    assert key(plain) == key(color) and len(color.flagged) == 2


def test_pairing_is_by_process_and_the_stats_line_right_before(tmp_path):
    a_stats = STATS_LINE
    b_stats = STATS_LINE.replace("pid=4242", "pid=5151").replace("Running: 64", "Running: 3")
    a_spec = LOW_SPEC_LINE
    b_spec = LOW_SPEC_LINE.replace("pid=4242", "pid=5151")
    access = '(APIServer pid=4242) INFO:     127.0.0.1:5000 - "POST /v1/completions HTTP/1.1" 200 OK'
    r = scan([_log(tmp_path, "two-servers.log", a_stats, b_stats, access, b_spec, a_spec)], min_running=8)
    assert [(rec.process, rec.running_req, rec.stats_line, rec.flagged) for rec in r.records] == [
        ("APIServer pid=5151", 3, 2, False), ("APIServer pid=4242", 64, 1, True)]
    assert r.below_min_running == 1
    # Data parallel: engine 0 had no drafts this interval, so engine 1's spec line follows both.
    e1 = STATS_LINE.replace("Engine 000", "Engine 001").replace("Running: 64", "Running: 7")
    r = scan([_log(tmp_path, "dp.log", STATS_LINE, e1, LOW_SPEC_LINE)])
    assert [(rec.engine, rec.running_req) for rec in r.records] == [("Engine 001", 7)]


def test_spec_line_with_no_stats_line_before_has_unknown_load(tmp_path, capsys):
    log = _log(tmp_path, "cut.log", LOW_SPEC_LINE, STATS_LINE, SPEC_LINE, LOW_SPEC_LINE)
    r = scan([log])
    # The first has nothing before it; the last follows a stats line already spent on line 3.
    assert [(rec.line, rec.running_req) for rec in r.records] == [(1, None), (3, 64), (4, None)]
    assert (r.unknown_load, r.unknown_load_below, len(r.flagged)) == (2, 2, 0)
    assert r.by_prefix["APIServer pid=4242 engine unknown"].decode_lines == 2
    text = render_text(r)
    assert "load unknown; 2 of them at or below the threshold were not flagged" in text
    assert "verdict: clean" in text and "unknown load" in text
    # --min-running 0: load does not matter, so they are flagged (running shown as '?').
    r0 = scan([log], min_running=0)
    assert [(i.line, i.running_req) for i in r0.flagged] == [(1, None), (4, None)]
    assert main(["logscan", "--min-running", "0", str(log)]) == 1
    assert "  ?  " in capsys.readouterr().out


def test_a_broken_stats_line_leaves_the_next_spec_line_with_unknown_load(tmp_path):
    cut = STATS_LINE[:STATS_LINE.index("Running")]
    r = scan([_log(tmp_path, "x.log", STATS_LINE, SPEC_LINE, cut, LOW_SPEC_LINE)])
    assert [(rec.line, rec.running_req) for rec in r.records] == [(2, 64), (4, None)]
    assert [(u.line, u.format) for u in r.unparsed] == [(3, "vllm")] and r.vllm_unparsed == 1
    assert not r.flagged and r.unknown_load_below == 1


def test_pairing_never_crosses_files(tmp_path):
    a = _log(tmp_path, "a.log", STATS_LINE)
    b = _log(tmp_path, "b.log", LOW_SPEC_LINE)
    r = scan([a, b])
    assert [rec.running_req for rec in r.records] == [None] and not r.flagged


def test_threshold_and_min_running_options_apply_to_vllm():
    assert [i.line for i in scan([FIXTURE], threshold=1.2).flagged] == [22]
    assert [i.line for i in scan([FIXTURE], min_running=65).flagged] == []
    assert [i.line for i in scan([FIXTURE], min_running=0).flagged] == [22, 26, 30]
    # engine 0 under load: 3.40, 3.60, 3.60 and the collapse 1.14, 1.30
    assert [i.accept_len for i in scan([FIXTURE], threshold=3.74).flagged] == [3.4, 3.6, 3.6, 1.14, 1.3]


def test_threshold_at_or_above_k_plus_one_is_noted(tmp_path):
    k1 = (SPEC_032 % (1.9, 90, 100, 900, 1000, "0.900", 90.0))
    log = _log(tmp_path, "k1.log", STATS_LINE, LOG_FMT_032 % ("APIServer", 4242, "INFO", "03-01 10:00:10",
                                                              "metrics.py", 120, k1))
    r = scan([log])
    assert r.max_spec_tokens == 1 and len(r.flagged) == 1
    assert "with 1 draft token(s) per step an accept length is at most 2" in render_text(r)


def test_older_versions_in_one_log(tmp_path):
    r = scan([_log(tmp_path, "old.log", NOPREFIX_STATS_LINE, SPEC_0_8_5_LINE, NOPREFIX_STATS_LINE, OLD_SPEC_LINE,
                   NOPREFIX_STATS_LINE, SPEC_0_8_3_LINE, V0_SPEC_LINE)])
    assert [(rec.accept_len, rec.bonus_added, rec.running_req) for rec in r.records] == [
        (pytest.approx(2.1), True, 12), (2.1, False, 12)]
    assert (r.vllm_spec_lines, r.intervals, r.bonus_added, r.vllm_legacy_lines) == (3, 2, 1, 1)
    assert r.by_prefix["Engine 000"].decode_lines == 3  # the 0.8.3 line counts as a line, not an interval
    text = render_text(r)
    assert "0.8.5's convention" in text and "'Speculative metrics' line(s)" in text


def test_only_legacy_or_only_stats_lines_say_why_nothing_applies(tmp_path):
    r = scan([_log(tmp_path, "v0.log", V0_SPEC_LINE)])
    assert r.intervals == 0 and "carry no per-interval mean acceptance length" in to_dict(r)["verdict"]
    r = scan([_log(tmp_path, "nospec.log", STATS_LINE, STATS_LINE)])
    assert r.exit_code() == 0 and "speculative decoding is off" in to_dict(r)["verdict"]
    r = scan([_log(tmp_path, "083.log", STATS_LINE, SPEC_0_8_3_LINE)])
    assert "0.8.3-0.8.4" in to_dict(r)["verdict"]


def test_clean_vllm_log_exits_0(tmp_path, capsys):
    log = _log(tmp_path, "clean.log", *[STATS_LINE, SPEC_LINE, COLOR_STATS_LINE, SPEC_LINE] * 5)
    code = main(["logscan", str(log)])
    out = capsys.readouterr().out
    assert code == 0
    assert "format: vllm" in out and "verdict: clean: none of 10 decode intervals" in out


# ------------------------------------------------------------------------------ broken lines in reports

def test_broken_lines_are_reported_with_file_and_line(tmp_path, capsys):
    log = _log(tmp_path, "broken.log", STATS_LINE, SPEC_LINE[:SPEC_LINE.index("Accepted:")],
               STATS_LINE.replace("64 reqs", "many reqs"), LOW_SPEC_LINE, STATS_LINE[:150] + SPEC_LINE,
               STATS_LINE, LOW_SPEC_LINE)
    code = main(["logscan", str(log)])
    out = capsys.readouterr().out
    assert code == 1  # line 7 pairs with line 6 and is flagged
    assert "3 unparsed" in out and "unparsed lines (3 of 3 shown)" in out
    assert f"{log}:2: vLLM 'SpecDecoding metrics' without 'Accepted: N tokens" in out
    assert f"{log}:3: vLLM 'Running' is not 'N reqs'" in out
    assert f"{log}:5: two vLLM metrics records on one line" in out
    r = scan([log])
    assert [(rec.line, rec.running_req) for rec in r.records] == [(4, None), (7, 64)]
    assert [i.line for i in r.flagged] == [7]


# ------------------------------------------------------------------------------ mixed inputs, output contract

def test_mixed_files_keep_the_sglang_results_and_name_each_format(tmp_path, capsys):
    sglang = LOGS / "sglang_0523_dp_tp.log"
    alone = scan([sglang])
    r = scan([sglang, FIXTURE])
    assert r.format == "mixed" and r.formats() == {str(sglang): "sglang", str(FIXTURE): "vllm"}
    assert [i.to_dict() for i in r.flagged if i.format == "sglang"] == [i.to_dict() for i in alone.flagged]
    assert r.intervals == alone.intervals + 13 and r.decode_lines == alone.decode_lines
    # One file holding both (two servers' logs concatenated).
    both = _log(tmp_path, "both.log", *sglang.read_text().splitlines(), STATS_LINE, LOW_SPEC_LINE)
    r = scan([both])
    assert r.formats() == {str(both): "sglang+vllm"} and len(r.flagged) == 3
    code = main(["logscan", str(sglang), str(FIXTURE)])
    out = capsys.readouterr().out
    assert code == 1
    assert f"format: mixed ({sglang}: sglang, {FIXTURE}: vllm)" in out
    assert "8 'Decode batch' lines, 14 vLLM stats lines, 13 'SpecDecoding metrics' lines" in out


def test_sglang_only_text_report_is_unchanged_and_json_names_the_format():
    r = scan([LOGS / "sglang_0523_dp_tp.log"])
    text = render_text(r)
    assert "format:" not in text and "vLLM" not in text
    assert text.splitlines()[1] == "signature: accept len <= 2.00 with #running-req >= 1"
    d = to_dict(r)
    assert d["format"] == "sglang" and "vllm" not in d and "records" not in d


def test_json_output_fields(capsys):
    code = main(["logscan", "--format", "json", str(FIXTURE)])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    assert doc["format"] == "vllm" and doc["formats"] == {str(FIXTURE): "vllm"}
    assert doc["intervals"] == 13 and doc["signature_found"] and doc["decode_lines"] == 0
    assert doc["vllm"] == {"stats_lines": 14, "spec_lines": 13, "legacy_lines": 0, "unparsed": 0, "unknown_load": 0,
                           "unknown_load_below": 0, "bonus_added": 0, "max_spec_tokens": 3, "records_dropped": 0}
    f = doc["flagged"][0]
    pid = f["process"]
    assert f == {"file": str(FIXTURE), "line": 22, "prefix": f"{pid} Engine 000", "time": "03-01 10:00:50",
                 "accept_len": 1.14, "running_req": 64, "accept_rate": 0.048, "format": "vllm", "process": pid,
                 "engine": "Engine 000", "stats_line": 21, "waiting_req": 2, "accepted": 414, "drafted": 8700,
                 "num_spec_tokens": 3, "logged_accept_len": 1.14, "bonus_added": False}
    assert len(doc["records"]) == 13
    assert [rec["accept_len"] for rec in doc["records"] if rec["engine"] == "Engine 000"] == [
        3.4, 3.6, 3.6, 1.14, 1.3, 1.1]
    assert [rec["flagged"] for rec in doc["records"]].count(True) == 2
    assert doc["by_prefix"][f"{pid} Engine 001"]["format"] == "vllm"
    assert doc["notes"] == []


def test_markdown_output_names_the_format(capsys):
    code = main(["logscan", "--format", "markdown", str(FIXTURE), str(LOGS / "broken.log")])
    out = capsys.readouterr().out
    assert code == 1
    assert out.startswith("# hazsan logscan") and "- format: **mixed**" in out
    assert f"`{FIXTURE}`: vllm" in out and "| vllm     | 1.14" in out
    assert "## Unparsed lines (5 of 5)" in out
    assert render_markdown(scan([LOGS / "sglang_0523_dp_tp.log"])).count("format: **sglang**") == 1


def test_html_names_the_format_for_vllm(tmp_path):
    out = tmp_path / "r.html"
    assert main(["logscan", "--html", str(out), str(FIXTURE)]) == 1
    page = out.read_text()
    assert "Format: vllm" in page and "SIGNATURE FOUND" in page


def test_help_describes_vllm(capsys):
    with pytest.raises(SystemExit):
        main(["logscan", "--help"])
    out = capsys.readouterr().out
    assert "SpecDecoding metrics" in out and "unknown load" in out and "markdown" in out


# ------------------------------------------------------------------------------ hostile input

def test_long_vllm_lines_parse_in_linear_time():
    import time

    def cost(n):  # best of 3 in CPU time
        texts = [SPEC_LINE + ", 0.5" * n, SPEC_LINE[:90] + ", Ab: 1" * n, "(" * n + SPEC_LINE, " pid=1)" * n + SPEC_LINE]
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            for t in texts:
                parse_vllm_line(t)
            best = min(best, time.process_time() - t0)
        return best
    small, large = cost(5_000), cost(50_000)
    assert large < 3.0 and large < 40 * max(small, 1e-3)


_VLINE = st.sampled_from([STATS_LINE, SPEC_LINE, LOW_SPEC_LINE, COLOR_SPEC_LINE, SPEC_0_8_5_LINE, SPEC_0_8_3_LINE,
                          V0_SPEC_LINE, NOPREFIX_STATS_LINE, "[2026-03-01 10:00:00 TP0] Decode batch, #running-req: 4, "
                          "accept len: 1.00, #queue-req: 0"])


@st.composite
def _mangled(draw):
    line = draw(_VLINE)
    cut = draw(st.integers(0, len(line)))
    junk = draw(st.text(alphabet="0123456789.,: %()=[]nafi-", max_size=12))
    return line[:cut] + junk + line[cut + draw(st.integers(0, 20)):]


@given(st.lists(st.one_of(_VLINE, _mangled()), max_size=25), st.floats(0, 10), st.integers(0, 70))
@settings(max_examples=150, deadline=None)
def test_fuzz_vllm_logs_scan_and_render(lines, threshold, min_running):
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        log = Path(d) / "fuzz.log"
        log.write_text("\n".join(lines), encoding="utf-8", errors="surrogatepass")
        r = scan([log], threshold=threshold, min_running=min_running)
    assert r.intervals >= len(r.records)  # the SGLang lines' intervals too
    for rec in r.records:
        assert 0 <= rec.accept_len <= 1e6 + 1
        loaded = min_running == 0 or (rec.running_req is not None and rec.running_req >= min_running)
        assert rec.flagged == (rec.accept_len <= threshold and loaded)
    render_text(r, 10)
    render_markdown(r, 10)
    json.dumps(to_dict(r))
    # 2 exactly when the file held no line of either format (not a server log), else 1 iff flagged
    assert r.exit_code() == (2 if r.formats()[str(log)] == "none" else 1 if r.flagged else 0)
