"""examples/ci: every hazsan command in the example workflow is one the CLI accepts, and the
example allow-list loads."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from sanitizer.cli import build_parser
from sanitizer.pytest_plugin import load_allow_list

CI = Path(__file__).resolve().parents[2] / "examples" / "ci"


def test_workflow_commands_parse():
    text = (CI / "hazsan.yml").read_text()
    commands = re.findall(r"(?<![\w-])hazsan (check|report|export|run) ([^|>\n]*)", text)
    assert {c for c, _ in commands} >= {"check", "report", "export"}
    parser = build_parser()
    for cmd, rest in commands:
        argv = [cmd] + [a.replace('"$d"', "d").replace("$d", "d") for a in shlex.split(rest.split("||")[0])]
        args = parser.parse_args(argv)          # exits 2 (fails the test) on an unknown option
        assert args.command == cmd
    assert "--hazsan " in text and "--hazsan-allow hazsan-allow.toml" in text
    assert "GITHUB_STEP_SUMMARY" in text and "upload-sarif" in text


def test_example_allow_list_loads():
    (entry,) = load_allow_list(CI / "hazsan-allow.toml")
    assert entry.rule == "transient-in-window" and entry.reason
