"""hazsan verify's parts on their own: the server info, replies, /metrics pages and logs recorded from
real SGLang 0.5.23 and vLLM 0.32 servers (tests/verify/record_sglang.py, record_vllm.py), read as
the real servers wrote them;
the live log follower across a rotation; the prompts; the command's refusals of bad options."""
from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest

from replay import Replay, recorded, sglang_routes, vllm_routes
from sanitizer.cli import main
from sanitizer.logscan import LogScanner
from sanitizer.verify import prompts
from sanitizer.verify.load import ProtocolError, parse_reply, request_body
from sanitizer.verify.observers import LogFollower, MetricsSnapshot, metrics_interval, parse_metrics, phase_accept_len
from sanitizer.verify.server import ServerFacts, from_sglang_info, from_vllm_config

# ------------------------------------------------------------------ recorded SGLang 0.5.23


def test_recorded_server_info():
    # srt/entrypoints/http_server.py /server_info: ServerArgs.resolved_dict() (srt/utils/common.py build_server_info)
    f = from_sglang_info(recorded("spec", "server_info.json"), "/server_info")
    assert (f.speculative, f.max_accept, f.tp_size, f.max_running, f.version) == ("NGRAM", 4, 2, 8, "0.5.23")
    assert "3 draft token(s) a step: at most 4 tokens accepted a step" in f.depth_text()
    off = from_sglang_info(recorded("nospec", "server_info.json"), "/server_info")
    assert off.speculative is None and off.speculative_known and off.depth_text() == "speculative decoding off"


def test_recorded_generate_reply():
    # srt/managers/tokenizer_manager.py _calculate_spec_decoding_metrics: completion_tokens / spec_verify_ct
    facts = parse_reply("generate", recorded("spec", "generate_ids.json"))
    assert facts.completion_tokens == 32 and facts.verify_ct == 14
    assert facts.accept_len == pytest.approx(32 / 14) and facts.accept_rate == pytest.approx(17 / 42)
    plain = parse_reply("generate", recorded("nospec", "generate_ids.json"))
    assert plain.completion_tokens == 32 and plain.accept_len is None and plain.verify_ct is None
    assert parse_reply("completions", recorded("spec", "completions.json")).completion_tokens == 32


@pytest.mark.parametrize("reply, message", [
    ({"text": "x"}, "no meta_info in the /generate reply"),
    ({"meta_info": {"completion_tokens": 3, "spec_accept_length": "nan"}}, "meta_info.spec_accept_length is not a number"),
    ({"meta_info": {"completion_tokens": 3, "spec_accept_length": float("inf")}}, "is not a number from 0 to"),
    ({"meta_info": {"spec_accept_rate": 1.5}}, "meta_info.spec_accept_rate is not a number from 0 to 1"),
])
def test_malformed_generate_reply(reply, message):
    with pytest.raises(ProtocolError, match=message):
        parse_reply("generate", reply)


def test_request_bodies():
    ids = prompts.Prompt(input_ids=(1, 2, 3))
    assert request_body("generate", ids, 9, None) == {
        "input_ids": [1, 2, 3], "sampling_params": {"temperature": 0.0, "max_new_tokens": 9, "ignore_eos": True}}
    assert request_body("completions", ids, 9, "m")["prompt"] == [1, 2, 3]
    with pytest.raises(ProtocolError, match="chat API takes text"):
        request_body("chat", ids, 9, "m")


def test_recorded_sglang_metrics_page():
    # srt/observability/metrics_collector.py: sglang:spec_accept_length gauge, spec_verify_calls_total
    snap = parse_metrics(recorded("spec", "metrics.txt"))
    assert snap.engine == "sglang" and snap.has_spec
    assert (snap.accept_len, snap.verify_calls, snap.running, snap.draft_tokens_per_step) == (2.0, 313.0, 0.0, 4.0)
    # the gauges exist without speculative decoding too, at 0: not an accept length
    plain = parse_metrics(recorded("nospec", "metrics.txt"))
    assert plain.engine == "sglang" and not plain.has_spec and plain.accept_len is None


def test_sglang_gauge_counted_only_when_a_verify_step_happened():
    a = MetricsSnapshot(engine="sglang", accept_len=3.0, verify_calls=10, running=8)
    b = MetricsSnapshot(engine="sglang", accept_len=3.0, verify_calls=10, running=8)
    c = MetricsSnapshot(engine="sglang", accept_len=1.2, verify_calls=14, running=8)
    assert metrics_interval(a, b) is None
    r = metrics_interval(b, c)
    assert (r.accept_len, r.running) == (1.2, 8)


# ------------------------------------------------------------------ recorded vLLM 0.32


def test_recorded_vllm_metrics_page():
    # vllm/v1/spec_decode/metrics.py SpecDecodingProm; vllm/v1/metrics/loggers.py vllm:num_requests_running
    snap = parse_metrics(recorded("vllm", "metrics.txt"))
    assert snap.engine == "vllm" and snap.has_spec
    assert (snap.drafts, snap.draft_tokens, snap.accepted, snap.positions, snap.running) == (188, 457, 253, 3, 0)
    before = parse_metrics(recorded("vllm", "metrics_before.txt"))
    assert before.drafts is not None and before.drafts < snap.drafts
    # vLLM's own PromQL: 1 + d(accepted) / d(drafts)
    assert phase_accept_len(before, snap) == pytest.approx(1 + (253 - before.accepted) / (188 - before.drafts))


def test_recorded_vllm_server_info():
    # /server_info?config_format=json (vllm/entrypoints/serve/dev/server_info, VLLM_SERVER_DEV_MODE=1)
    facts = ServerFacts(engine="vllm")
    from_vllm_config(recorded("vllm", "server_info.json"), facts)
    assert (facts.speculative, facts.max_accept, facts.max_running, facts.tp_size) == ("ngram", 4, 8, 2)


def test_recorded_vllm_log_through_the_follower(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("")
    f = LogFollower(str(log), LogScanner(2.0, 1))
    f.open()
    log.write_text(recorded("vllm", "server.log"))
    got = f.poll()
    spec_lines = [line for line in recorded("vllm", "server.log").splitlines() if "SpecDecoding metrics" in line]
    assert len(got) == len(spec_lines) >= 1
    assert [g.accept_len for g in got] == [float(re.search(r"Mean acceptance length: ([0-9.]+)", line).group(1))
                                           for line in spec_lines]
    assert all(g.running is not None for g in got)  # each paired with the stats line before it


def run_json(capsys, *argv) -> tuple[int, dict]:
    code = main(["verify", *argv, "--quiet", "--format", "json", "--poll", "0.2", "--max-tokens", "8"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("accepted, expected", [(lambda r: 2.5, 0), (lambda r: 0.0 if r.inflight > 1 else 2.5, 1)])
@pytest.mark.parametrize("dev_mode", [False, True])
def test_vllm_metrics_counters(capsys, accepted, expected, dev_mode):
    with Replay(vllm_routes(accepted, dev_mode), delay=0.1) as server:
        code, doc = run_json(capsys, server.url, "--duration", "4", "--concurrency", "3", "--baseline-requests", "2",
                             "--stop-after", "2")
    assert doc["server"]["engine"] == "vllm" and doc["api"] == "completions"
    # k = 3: from the per-position counters' labels, or the dev-mode config: at most 4 tokens a step
    assert doc["server"]["max_accept"] == 4
    assert doc["server"]["depth_source"] == ("/server_info vllm_config.speculative_config.num_speculative_tokens"
                                             if dev_mode else "/metrics per-position counters")
    assert doc["baseline"] == pytest.approx(3.5) and doc["baseline_source"] == "/metrics counters"
    assert code == expected, doc["text"]
    if expected:
        assert all(s["source"] == "metrics" and s["accept_len"] <= doc["limit"] for s in doc["flagged_samples"])


# ------------------------------------------------------------------ the log, followed live

SGLANG_LINES = [line for line in recorded("spec", "server.log").splitlines() if "Decode batch" in line]


def test_log_followed_across_a_rotation(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("an earlier run's line\n" + SGLANG_LINES[0] + "\n")  # before verify: not this run's
    f = LogFollower(str(log), LogScanner(2.0, 1))
    f.open()
    assert f.poll() == []
    with open(log, "a") as out:
        out.write(SGLANG_LINES[1] + "\n" + SGLANG_LINES[2][:40])  # a line still being written
    got = f.poll()
    assert len(got) == 1 and got[0].where == f"{log}:3"
    os.rename(log, tmp_path / "server.log.1")  # rotated (logrotate's create mode)
    with open(tmp_path / "server.log.1", "a") as out:
        out.write(SGLANG_LINES[2][40:] + "\n")  # the old file's last line, finished after the rename
    log.write_text(SGLANG_LINES[3] + "\n" + SGLANG_LINES[4] + "\n")
    got = f.poll()
    assert f.rotations == 1
    assert [g.where for g in got] == [f"{log}:4", f"{log}:1", f"{log}:2"]
    # copytruncate: the same file cut to nothing, then written again
    with open(log, "w") as out:
        out.write(SGLANG_LINES[5] + "\n")
    got = f.poll()
    assert f.rotations == 2 and len(got) == 1


def test_log_rotated_during_a_session(capsys, tmp_path):
    """A session whose replies and /metrics show nothing (--no-metrics, the OpenAI API): the log
    alone, written while the load runs and rotated half-way."""
    log = tmp_path / "server.log"
    log.write_text("")
    body = recorded("spec", "completions.json")
    # recorded lines, hand-edited: each accept len made >= 10 and #running-req >= 10 (clean under load)
    lines = [line.replace("accept len: ", "accept len: 1").replace("#running-req: ", "#running-req: 1", 1)
             for line in SGLANG_LINES[:40]]
    done = threading.Event()

    def writer():
        for i, line in enumerate(lines):
            if done.is_set():
                return
            if i == 20:
                os.rename(log, tmp_path / "server.log.1")
                log.write_text("")
            with open(log, "a") as out:
                out.write(line + "\n")
            time.sleep(0.05)

    with Replay(dict(sglang_routes("spec", metrics=False), **{"POST /v1/completions": lambda r, b: (200, body)}),
                delay=0.05) as server:
        t = threading.Thread(target=writer, daemon=True)
        t.start()
        code, doc = run_json(capsys, server.url, "--api", "completions", "--log", str(log), "--duration", "4",
                             "--concurrency", "2", "--baseline-requests", "0", "--no-metrics")
        done.set()
    assert doc["log_rotations"] == 1, (doc["log_status"], doc["elapsed_s"], len(doc["samples"]), doc["text"])
    assert doc["sources"] == {"request": False, "metrics": False, "log": True}
    logged = [s for s in doc["samples"] if s["source"] == "log"]
    # the lines written before verify opened the log are not this session's: most of the 40 are
    assert 20 < len(logged) <= 40 and {s["where"].rsplit(":", 1)[0] for s in logged} == {str(log)}
    assert {s["where"] for s in logged} >= {f"{log}:1", f"{log}:20"}  # both files' lines
    assert code == 0, doc["text"]


def test_log_missing_is_an_error(capsys, tmp_path):
    with Replay(sglang_routes("spec")) as server:
        code = main(["verify", server.url, "--quiet", "--log", str(tmp_path / "nope.log")])
    assert code == 2 and "nope.log: cannot read the log" in capsys.readouterr().err


# ------------------------------------------------------------------ prompts and options


def test_shipped_prompts():
    code, prose = prompts.builtin("code"), prompts.builtin("prose")
    assert len(code) >= 10 and len(prose) >= 5 and all(p.text for p in code + prose)


@pytest.mark.parametrize("content, message", [
    ("", "no prompt in it"),
    ("{not json\n", ":1: not JSON"),
    ('{"text": "a", "input_ids": [1]}\n', 'expected an object with "text" or "input_ids"'),
    ('{"input_ids": [1, -2]}\n', '"input_ids" must be a non-empty list of token ids'),
    ('{"text": ""}\n', '"text" must be a non-empty string'),
])
def test_bad_prompt_file(tmp_path, capsys, content, message):
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(prompts.PromptError, match=message):
        prompts.load(str(path))
    assert main(["verify", "http://127.0.0.1:9", "--prompts", str(path), "--quiet"]) == 2
    assert message.lstrip(":1") in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["ftp://x"], "URL must start with http:// or https://"),
    (["http://x", "--threshold", "nan"], "--threshold must be a number"),
    (["http://x", "--collapse", "1.5"], "--collapse must be a number in (0, 1]"),
])
def test_bad_options(capsys, argv, message):
    assert main(["verify", *argv, "--quiet"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["http://x", "--duration", "0"], ["http://x", "--concurrency", "-1"]])
def test_bad_option_values_refused_by_argparse(argv):
    with pytest.raises(SystemExit) as e:
        main(["verify", *argv])
    assert e.value.code == 2


def test_generate_api_refused_on_a_non_sglang_server(capsys):
    with Replay(vllm_routes(lambda r: 2.0)) as server:
        assert main(["verify", server.url, "--api", "generate", "--quiet"]) == 2
    assert "--api generate is SGLang's /generate" in capsys.readouterr().err


def test_text_report_and_progress(capfd):
    with Replay(sglang_routes("spec"), delay=0.05) as server:
        code = main(["verify", server.url, "--duration", "2", "--concurrency", "2", "--baseline-requests", "1",
                     "--max-tokens", "8", "--poll", "0.3"])
    out, err = capfd.readouterr()
    assert code == 0
    assert out.splitlines()[-1].startswith("CLEAN: clean: ")
    assert "depth: NGRAM, 3 draft token(s) a step: at most 4 tokens accepted a step" in out
    assert "] load: " in err  # the live progress line (not a terminal: a line every few seconds)
