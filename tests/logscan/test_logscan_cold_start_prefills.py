"""logscan's cold-start rule over several prefills in a row: the lines below are real SGLang 0.5.23
output (launch_server, TP=2, NGRAM depth 4, the fixed mHC model of examples/sglang_mhc, under the
load of `hazsan verify`: tests/verify/test_verify_sglang_real.py), where 16 requests were admitted
by two prefills (1, then 15) and their first decode step logged accept len 2.00 with 16 running."""
from __future__ import annotations

from sanitizer.logscan import LogScanner

PREFILL_1 = ("[2026-12-07 21:41:41 TP0] Prefill batch, #new-seq: 1, #new-token: 1, #cached-token: 32, token usage: 0.00, "
             "#running-req: 0, #queue-req: 0, #pending-token: 0, cpu graph: False, input throughput (token/s): 0.47")
PREFILL_15 = ("[2026-12-07 21:41:43 TP0] Prefill batch, #new-seq: 15, #new-token: 436, #cached-token: 102, token usage: "
              "0.07, #running-req: 1, #queue-req: 0, #pending-token: 0, cpu graph: False, input throughput (token/s): 206.23")
FIRST_DECODE = ("[2026-12-07 21:41:43 TP0] Decode batch, #running-req: 16, #token: 891, token usage: 0.11, accept len: "
                "2.00, accept rate: 0.25, cpu graph: False, gen throughput (token/s): 12.73, #queue-req: 0")


def scan(lines, min_running=8):
    s = LogScanner(2.0, min_running)
    for i, line in enumerate(lines, 1):
        s.feed("server.log", i, line)
    return s.result


def test_two_prefills_in_a_row_admit_the_whole_batch():
    r = scan([PREFILL_1, PREFILL_15, FIRST_DECODE])
    assert r.cold_start == 1 and not r.flagged


def test_the_last_prefill_alone_is_not_the_whole_batch():
    # 15 admitted, 16 running: one request decoded before, so the step is not all cold: flagged
    r = scan([PREFILL_15, FIRST_DECODE])
    assert r.cold_start == 0 and len(r.flagged) == 1


def test_a_decode_line_between_prefills_resets_the_count():
    second = FIRST_DECODE.replace("#running-req: 16", "#running-req: 1").replace("accept len: 2.00", "accept len: 5.00")
    r = scan([PREFILL_1, second, PREFILL_15, FIRST_DECODE])
    assert r.cold_start == 0 and len(r.flagged) == 1
