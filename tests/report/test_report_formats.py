"""Machine formats of `hazsan check`: SARIF against the SARIF 2.1.0 JSON schema, markdown for CI."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from sanitizer.cli import main
from sanitizer.report.markdown import cell, code_block
from sanitizer.rules.driver import analyze

from tracebuilder import Trace

ROOT = Path(__file__).resolve().parents[2]
TRACES = ROOT / "examples" / "traces"
SCHEMA = json.loads((Path(__file__).parents[1] / "fixtures" / "sarif" / "sarif-schema-2.1.0.json").read_text())


def _check(capsys, *args):
    rc = main(["check", *map(str, args)])
    return rc, capsys.readouterr().out


@pytest.mark.parametrize("target", ["", "clean.jsonl", "asymmetric-offset"])
def test_sarif_is_valid_sarif_2_1_0(capsys, target):
    rc, out = _check(capsys, TRACES / target, "--format", "sarif")
    doc = json.loads(out)
    validator = jsonschema.Draft4Validator(SCHEMA, format_checker=jsonschema.FormatChecker())
    problems = sorted(validator.iter_errors(doc), key=lambda e: list(e.path))
    assert not problems, "\n".join(f"{list(e.path)}: {e.message}" for e in problems[:10])
    results = doc["runs"][0]["results"]
    expected = analyze([str(TRACES / target)]).summary["findings"]
    assert len(results) == expected and rc == (1 if expected else 0)
    rule_ids = {r["id"] for r in doc["runs"][0]["tool"]["driver"]["rules"]}
    assert all(r["ruleId"] in rule_ids for r in results)


def test_the_schema_rejects_a_broken_sarif(capsys):
    # the schema check can fail: a result without a message, a level SARIF does not know
    _, out = _check(capsys, TRACES / "reuse-in-flight.jsonl", "--format", "sarif")
    doc = json.loads(out)
    doc["runs"][0]["results"][0]["level"] = "fatal"
    del doc["runs"][0]["results"][0]["message"]
    assert len(list(jsonschema.Draft4Validator(SCHEMA).iter_errors(doc))) >= 2


def test_markdown_summary(capsys):
    rc, out = _check(capsys, TRACES, "--format", "markdown")
    assert rc == 1
    assert out.startswith("## hazsan check\n")
    assert ":x: **9 finding(s)**" in out
    assert "| `reuse-in-flight` | error | 1 |" in out
    assert out.count("<details>") == out.count("</details>") >= 5
    assert "Memory allocated at:" in out and "Op enqueued at:" in out    # both stacks
    rc, out = _check(capsys, TRACES / "clean.jsonl", "--format", "markdown")
    assert rc == 0 and ":white_check_mark: **No hazards**" in out and "<details>" not in out


def test_markdown_escapes_what_comes_from_a_trace(tmp_path, capsys):
    t = Trace(rank=0, world_size=1)
    t.alloc(1, 0x1000, 256, stream="s0")
    t.coll(1, stream="c", bufs=[(0x1000, 256, "rw")], site="a|b.py:1:<script>x</script>")
    t.launch(stream="s0", reads=[(0x1000, 16)], site="```evil``` | <img src=x>:2:f")
    t.write(tmp_path / "rank0.jsonl")
    rc, out = _check(capsys, tmp_path, "--format", "markdown")
    assert rc == 1
    # outside code blocks (where markdown shows text as is) no markup from the trace survives
    import re
    prose = re.sub(r"(`{3,})text\n.*?\n\1", "", out, flags=re.S)
    assert "<script>" not in prose and "<img" not in prose
    assert "&lt;img src=x&gt;" in prose
    # every code block's fence is longer than the backticks inside it
    assert "````text" in out
    assert cell("a|b") == "a\\|b" and "\n" not in cell("x\ny")
    assert code_block(["``` x"]).startswith("````text\n")
