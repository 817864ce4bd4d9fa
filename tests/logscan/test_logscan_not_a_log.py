"""hazsan logscan on a file that is not a server log (issue 49): a README, a Python traceback, an
empty file. Such a file holds no decode line of either format; the scan says so, names the file
and the formats it reads, and exits 2 in every output format, also beside real logs (a CI gate
must not pass on the wrong file). A real log with decode lines, flagged or not, is unaffected."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sanitizer.cli import main
from sanitizer.logscan import scan
from sanitizer.logscan.render import render_html, render_markdown, render_text, to_dict

LOGS = Path(__file__).parents[1] / "fixtures" / "logs"

README = "# my project\n\nInstall with `pip install -e .`, then run `python serve.py`.\n\n## Usage\n\nSee docs.\n"
TRACEBACK = ('Traceback (most recent call last):\n  File "serve.py", line 12, in <module>\n    main()\n'
             'RuntimeError: NCCL error: unhandled cuda error\n')
CLEAN_SGLANG = "".join(
    f"[2026-03-01 10:00:{i:02d} DP0 TP0] Decode batch, #running-req: 16, #token: 9000, token usage: 0.05, "
    f"accept len: {2.5 + i / 100:.2f}, accept rate: 0.50, cuda graph: True, gen throughput (token/s): 900.00, "
    "#queue-req: 0\n" for i in range(10))
PREFILL_ONLY = ("[2026-03-01 10:00:00 TP0] Prefill batch, #new-seq: 4, #new-token: 512, #cached-token: 0, "
                "token usage: 0.01, #running-req: 0, #queue-req: 0\n")
NO_SPEC_SGLANG = ("[2026-03-01 10:00:00 TP0] Decode batch, #running-req: 4, #token: 40, token usage: 0.00, "
                  "cuda graph: True, gen throughput (token/s): 12.41, #queue-req: 0\n")
VLLM_STATS_ONLY = ("(APIServer pid=4242) INFO 03-01 10:00:10 [loggers.py:335] Engine 000: Avg prompt throughput: "
                   "0.0 tokens/s, Avg generation throughput: 812.4 tokens/s, Running: 64 reqs, Waiting: 0 reqs, "
                   "GPU KV cache usage: 41.2%, Prefix cache hit rate: 12.5%\n")


def _file(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _run(capsys, *argv):
    code = main(["logscan", *map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("name, text, reason", [
    ("README.md", README, "not a server log: no decode line in 7 lines"),
    ("traceback.txt", TRACEBACK, "not a server log: no decode line in 4 lines"),
    ("empty.log", "", "empty: no decode line, no line at all"),
    ("prefill.log", PREFILL_ONLY,
     "no decode line in 1 lines, only 1 SGLang 'Prefill batch' line(s): the server logged no decode step"),
])
@pytest.mark.parametrize("fmt", ["text", "json", "markdown"])
def test_not_a_server_log_exits_2_naming_file_and_formats(tmp_path, capsys, name, text, reason, fmt):
    f = _file(tmp_path, name, text)
    code, out, err = _run(capsys, "--format", fmt, f)
    assert code == 2
    assert f"hazsan logscan: error: {f}: {reason}" in err
    assert "'Decode batch'" in err and "'SpecDecoding metrics'" in err  # the formats it reads
    assert "NO DECODE LINES" in out and str(f) in out
    if fmt == "json":
        doc = json.loads(out)
        assert doc["not_logs"] == [{"file": str(f), "lines": len(text.splitlines()),
                                    "prefill_lines": int(text == PREFILL_ONLY), "reason": reason}]
        assert doc["formats"] == {str(f): "none"} and not doc["signature_found"]


def test_the_api_says_it_too(tmp_path):
    r = scan([_file(tmp_path, "README.md", README)])
    assert r.exit_code() == 2 and [b.file for b in r.not_logs()] == [str(tmp_path / "README.md")]
    assert to_dict(r)["verdict"].startswith("NO DECODE LINES: ")
    assert "verdict: NO DECODE LINES" in render_text(r)
    assert "**Verdict:** NO DECODE LINES" in render_markdown(r)
    page, _ = render_html(r)
    assert "class='bad'>Verdict: NO DECODE LINES" in page


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_one_not_a_log_among_real_logs_exits_2_and_keeps_the_others_verdict(tmp_path, capsys, fmt):
    readme = _file(tmp_path, "README.md", README)
    flagged = LOGS / "sglang_old_scheduler.log"  # 2 flagged intervals: alone it exits 1
    code, out, err = _run(capsys, "--format", fmt, flagged, readme)
    assert code == 2
    assert f"{readme}: not a server log" in err and str(flagged) not in err
    if fmt == "json":
        doc = json.loads(out)
        assert len(doc["flagged"]) == 2 and doc["signature_found"]  # the real log's findings are still reported
        assert [b["file"] for b in doc["not_logs"]] == [str(readme)]
        assert doc["formats"] == {str(flagged): "sglang", str(readme): "none"}
        verdict = doc["verdict"]
    else:
        verdict = out.rsplit("verdict: ", 1)[1]
    assert verdict.startswith(f"NO DECODE LINES: {readme}: ")
    assert "The other file(s): SIGNATURE FOUND: 2 of 4" in verdict
    clean = _file(tmp_path, "clean.log", CLEAN_SGLANG)
    code, out, _ = _run(capsys, clean, readme)
    assert code == 2 and "The other file(s): clean: none of 10" in out
    empty = _file(tmp_path, "empty.log", "")
    code, _, err = _run(capsys, clean, empty, readme)
    assert code == 2 and f"{empty}: empty" in err and f"{readme}: not a server log" in err


@pytest.mark.parametrize("text, verdict", [
    (CLEAN_SGLANG, "clean: none of 10"),
    (NO_SPEC_SGLANG, "speculative decoding is off"),  # decode lines without accept len: a real log
    (VLLM_STATS_ONLY, "speculative decoding is off"),
    (None, ""),  # broken.log: mangled 'Decode batch' lines (some unparsed) are still a server log
])
def test_real_logs_with_decode_lines_and_nothing_flagged_still_exit_0(tmp_path, capsys, text, verdict):
    if text is None:
        f = tmp_path / "broken.log"
        f.write_bytes((LOGS / "broken.log").read_bytes())
    else:
        f = _file(tmp_path, "server.log", text)
    code, out, err = _run(capsys, "--format", "json", "--threshold", "1.0", f)
    doc = json.loads(out)
    assert code == (1 if doc["flagged"] else 0), doc["verdict"]
    assert doc["not_logs"] == [] and "error" not in err
    assert verdict in doc["verdict"]


def test_stdin_that_is_not_a_log_is_named_standard_input():
    proc = subprocess.run([sys.executable, "-m", "sanitizer", "logscan", "-"], input=TRACEBACK.encode(),
                          capture_output=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert b"error: standard input: not a server log" in proc.stderr


def test_html_report_is_written_and_the_exit_is_still_2(tmp_path, capsys):
    page = tmp_path / "report.html"
    code, _, err = _run(capsys, "--html", page, _file(tmp_path, "README.md", README))
    assert code == 2 and page.exists() and "NO DECODE LINES" in page.read_text()
