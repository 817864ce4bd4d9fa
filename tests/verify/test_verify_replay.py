"""`hazsan verify` against in-process servers on loopback that replay real SGLang 0.5.23 replies
(tests/verify/data/sglang-0.5.23/, recorded by tests/verify/record_sglang.py from
`python -m sglang.launch_server`: TP=2 NGRAM with 4 draft tokens, and TP=1 without speculative
decoding), and the faults a real session meets: a 500, a server that dies, a huge reply, a slow
server, a rotated log. vLLM 0.32's replays are in test_verify_units.py (recorded by record_vllm.py).

Every session here is bounded: a few seconds of --duration, a few requests."""
from __future__ import annotations

import itertools
import json
import threading
import time

import pytest

from replay import Replay, recorded, sglang_routes
from sanitizer.cli import main

FAST = ["--quiet", "--format", "json", "--poll", "0.3", "--max-tokens", "8"]


def verify(capsys, url: str, *args: str) -> tuple[int, dict]:
    code = main(["verify", url, *FAST, *args])
    out = capsys.readouterr().out
    return code, json.loads(out) if out.strip() else {}


def test_recorded_sglang_server_judged_clean(capsys, tmp_path):
    # the recorded reply accepts 2.29 tokens a step: the baseline, and the same under load
    with Replay(sglang_routes("spec"), delay=0.05) as server:
        code, doc = verify(capsys, server.url, "--duration", "3", "--concurrency", "4", "--baseline-requests", "2",
                           "--html", str(tmp_path / "v.html"))
    assert code == 0, doc["text"]
    assert doc["verdict"] == "clean" and doc["text"].startswith("clean: ")
    s = doc["server"]
    # /server_info's speculative_num_draft_tokens (sglang srt/utils/common.py build_server_info)
    assert (s["engine"], s["version"], s["speculative"], s["max_accept"], s["tp_size"], s["max_running"]) == \
        ("sglang", "0.5.23", "NGRAM", 4, 2, 8)
    assert doc["api"] == "generate" and doc["baseline"] == pytest.approx(2.2857142857142856)
    assert doc["baseline_source"] == "per request"
    assert doc["limit"] == pytest.approx(0.75 * 2.2857142857142856)
    assert doc["sources"]["request"] and doc["sources"]["metrics"] and not doc["sources"]["log"]
    assert doc["under_load"] >= 3 and doc["flagged"] == 0
    assert server.max_inflight >= 4  # the load held the concurrency
    load = next(p for p in doc["phases"] if p["phase"] == "load")
    assert load["requests"] > 4 and load["failed"] == 0 and load["running_held_median"] >= 3
    page = (tmp_path / "v.html").read_text()
    assert "data:image/png;base64," in page and "CLEAN" in page


def test_collapse_under_load_flagged_and_stops_early(capsys):
    # the recorded reply, its spec_accept_length set to 1.0 once more than one request is in flight:
    # what a batch-shape-dependent fault gives (hand-made from the recording)
    def accept(replay):
        return 1.0 if replay.inflight > 1 else None

    with Replay(sglang_routes("spec", accept_len=accept), delay=0.05) as server:
        t = time.monotonic()
        code, doc = verify(capsys, server.url, "--duration", "20", "--concurrency", "4", "--baseline-requests", "2",
                           "--stop-after", "3")
        took = time.monotonic() - t
    assert code == 1, doc["text"]
    assert doc["text"].startswith(f"signature: {doc['flagged']} of {doc['under_load']} intervals <= ")
    assert "capture with HAZSAN=1 and run hazsan check" in doc["text"]
    assert doc["flagged"] >= 3 and doc["early_stop"] and took < 15
    assert all(f["accept_len"] == 1.0 and f["running"] >= 2 for f in doc["flagged_samples"])
    assert doc["baseline"] == pytest.approx(2.2857142857142856)  # one at a time: the recorded value


def test_baseline_too_low_to_show_the_signature(capsys):
    # the recorded text-prompt reply: the tiny random model accepts 1.39 tokens a step on it, one
    # request at a time, with nothing wrong: no verdict (exit 2), and no load after that baseline
    assert recorded("spec", "generate_text.json")["meta_info"]["spec_accept_length"] == pytest.approx(32 / 23)
    with Replay(sglang_routes("spec", reply="generate_text.json"), delay=0.02) as server:
        code, doc = verify(capsys, server.url, "--duration", "20", "--concurrency", "4", "--baseline-requests", "2")
        posts = server.posts
    assert code == 2
    assert doc["text"].startswith("the load cannot show the signature: at one request at a time these prompts "
                                  "accept only 1.39 tokens a step (<= 2.00)")
    assert [p["phase"] for p in doc["phases"]] == ["baseline"] and posts == 2 and doc["elapsed_s"] < 10


def test_server_without_speculative_decoding(capsys):
    # recorded from SGLang TP=1 without --speculative-algorithm: no spec_* in meta_info, none in /metrics
    assert "spec_accept_length" not in recorded("nospec", "generate_ids.json")["meta_info"]
    with Replay(sglang_routes("nospec"), delay=0.02) as server:
        code, doc = verify(capsys, server.url, "--duration", "2", "--concurrency", "2", "--baseline-requests", "1")
    assert code == 2
    assert doc["text"].startswith("not a speculative server (/server_info says speculative decoding is off)")
    assert doc["server"]["speculative"] is None and doc["server"]["speculative_known"]
    assert doc["metrics_status"] == "no speculative-decoding metric"


def test_unreachable_server(capsys):
    with Replay({}) as server:
        url = server.url
    code = main(["verify", url, "--quiet", "--duration", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "hazsan verify: error: cannot reach the server" in err and url in err


def test_every_request_answered_500(capsys):
    routes = sglang_routes("spec")
    routes["POST /generate"] = lambda r, b: (500, {"object": "error", "message": "CUDA error: an illegal memory access"})
    with Replay(routes) as server:
        code, doc = verify(capsys, server.url, "--duration", "2", "--concurrency", "2", "--baseline-requests", "1")
        posts = server.posts
    assert code == 2
    assert doc["text"].startswith("no request succeeded (") and "HTTP 500" in doc["text"]
    assert "illegal memory access" in doc["text"]
    assert 0 < posts < 40  # failures are paced (0.2 s a worker), not hammered
    assert all(not q["ok"] and q["error_kind"] == "status" for q in doc["requests"])


def test_some_requests_500_still_judged(capsys):
    base = sglang_routes("spec")
    numbers = itertools.count(1)  # each request its own number (next() on a count is atomic)

    def flaky(replay, body):  # every third request fails
        return (500, {"message": "overloaded"}) if next(numbers) % 3 == 0 else base["POST /generate"](replay, body)

    routes = dict(base, **{"POST /generate": flaky})
    with Replay(routes, delay=0.05) as server:
        code, doc = verify(capsys, server.url, "--duration", "4", "--concurrency", "3", "--baseline-requests", "2",
                           "--min-running", "1")
    assert code == 0, doc["text"]
    failed = [q for q in doc["requests"] if not q["ok"]]
    assert failed and all("HTTP 500" in q["error"] for q in failed)


def test_server_dies_mid_run(capsys):
    routes = sglang_routes("spec")
    with Replay(routes, delay=0.05) as server:
        def kill():
            while server.posts < 6:
                time.sleep(0.02)
            server.stop()
        threading.Thread(target=kill, daemon=True).start()
        t = time.monotonic()
        code, doc = verify(capsys, server.url, "--duration", "30", "--concurrency", "3", "--baseline-requests", "1",
                           "--request-timeout", "5")
        took = time.monotonic() - t
    assert code == 2
    assert doc["stopped"].startswith("the server stopped answering (")
    assert "not enough to call the server clean" in doc["text"]
    assert took < 15  # noticed, not waited out


def test_huge_reply_fails_its_request(capsys):
    routes = sglang_routes("spec")
    reply = recorded("spec", "generate_ids.json")
    reply["text"] = "x" * (3 << 20)  # a 3 MiB reply: over the 1 MiB cap below
    routes["POST /generate"] = lambda r, b: (200, reply)
    with Replay(routes) as server:
        code, doc = verify(capsys, server.url, "--duration", "2", "--concurrency", "2", "--baseline-requests", "1",
                           "--max-response-bytes", "1MiB")
    assert code == 2
    assert "reply over 1,048,576 bytes (--max-response-bytes)" in doc["text"]


def test_slow_server_bounded_by_the_request_timeout(capsys):
    with Replay(sglang_routes("spec"), delay=3.0) as server:
        t = time.monotonic()
        code, doc = verify(capsys, server.url, "--duration", "2", "--concurrency", "2", "--baseline-requests", "1",
                           "--request-timeout", "0.5")
        took = time.monotonic() - t
    assert code == 2
    assert "no reply in 0.5 s" in doc["text"]
    assert took < 2 + 0.5 + 6  # the duration, one request timeout, the wind-down


def test_not_a_json_reply(capsys):
    routes = sglang_routes("spec")
    routes["POST /generate"] = lambda r, b: (200, b"<html>proxy error</html>", "text/html")
    with Replay(routes) as server:
        code, doc = verify(capsys, server.url, "--duration", "1", "--concurrency", "1", "--baseline-requests", "1")
    assert code == 2 and "the reply is not JSON: '<html>proxy error</html>'" in doc["text"]


def test_chat_api_error_is_reported(capsys):
    # recorded: SGLang's /v1/chat/completions on a tokenizer without a chat template answers 400
    body = recorded("spec", "chat.json")
    routes = sglang_routes("spec")
    routes["POST /v1/chat/completions"] = lambda r, b: (400, body)
    with Replay(routes) as server:
        code, doc = verify(capsys, server.url, "--api", "chat", "--duration", "1", "--concurrency", "1",
                           "--baseline-requests", "1")
    assert code == 2 and "HTTP 400" in doc["text"] and "chat_template" in doc["text"]


@pytest.mark.parametrize("gauge, expected", [(3.5, 0), (None, 1)])
def test_completions_api_on_sglang(capsys, gauge, expected):
    # the recorded /v1/completions reply carries no acceptance: /metrics is where it is seen. Its
    # recorded sglang:spec_accept_length gauge is 2.0 (the tiny random model's last batch), at the
    # threshold: flagged with no baseline; set to 3.5, clean
    body = recorded("spec", "completions.json")
    seen = []

    def completions(replay, req):
        seen.append(req)
        return 200, body

    routes = sglang_routes("spec", accept_len=None if gauge is None else (lambda r: gauge))
    routes["POST /v1/completions"] = completions
    with Replay(routes, delay=0.05) as server:
        code, doc = verify(capsys, server.url, "--api", "completions", "--duration", "3", "--concurrency", "3",
                           "--baseline-requests", "0", "--min-running", "1")
    assert seen and seen[0]["model"] == recorded("spec", "models.json")["data"][0]["id"]
    assert seen[0]["temperature"] == 0.0 and seen[0]["ignore_eos"] is True and isinstance(seen[0]["prompt"], str)
    assert not doc["sources"]["request"] and doc["sources"]["metrics"]
    assert code == expected, doc["text"]
    row = doc["by_source"]["metrics"]
    assert row["min"] == (gauge if gauge is not None else 2.0)
    assert (row["flagged"] > 0) == (expected == 1)


def test_prose_class_shown_not_judged(capsys):
    # prose prompts (the shipped class) answered with the recorded reply, its spec_accept_length set
    # to 1.5 (what reasoning prose accepts; hand-made): shown beside the code load, never a signature
    from sanitizer.verify.prompts import builtin
    prose_texts = {p.text for p in builtin("prose")}
    routes = sglang_routes("spec")
    generate = routes["POST /generate"]

    def by_content(replay, body):
        status, reply = generate(replay, body)
        if body.get("text") in prose_texts:
            reply["meta_info"]["spec_accept_length"] = 1.5
        return status, reply

    routes["POST /generate"] = by_content
    with Replay(routes, delay=0.05) as server:
        code, doc = verify(capsys, server.url, "--duration", "6", "--concurrency", "3", "--baseline-requests", "1",
                           "--prose")
    assert [p["phase"] for p in doc["phases"]] == ["baseline", "load", "prose"]
    prose = [s["accept_len"] for s in doc["samples"] if s["phase"] == "prose" and s["source"] == "request"]
    assert prose and set(prose) == {1.5}
    assert code == 0 and doc["flagged"] == 0, doc["text"]
