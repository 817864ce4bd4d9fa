"""The one allow-list reader (sanitizer/allowlist.py) behind `hazsan scan --allow` and the pytest
plugin's `--hazsan-allow`: the same file errors the same way in both, naming file and line."""
import os
import subprocess
import sys

import pytest

from sanitizer.allowlist import AllowListError, read_entries
from sanitizer.pytest_plugin import load_allow_list
from sanitizer.scan.allow import AllowList

FIELDS = frozenset({"rule", "site", "test", "reason"})


def test_toml_entries_carry_the_line_of_their_table(tmp_path):
    f = tmp_path / "allow.toml"
    f.write_text('# accepted\n\n[[allow]]\nrule = "reuse-in-flight"\nreason = "known"\n\n'
                 '[[allow]]\nsite = "x.py:3"\nreason = "  reviewed  "\n')
    entries = read_entries(f, FIELDS)
    assert [e.source for e in entries] == [f"{f}:3", f"{f}:7"]
    assert entries[1].fields == {"site": "x.py:3", "reason": "reviewed"}


@pytest.mark.parametrize("body, message", [
    ('[[allow]]\nrule = "reuse-in-flight"\nreason = "ok"\n\n[[allow]]\nrule = "free-in-flight"\n',
     ":5: say why it is accepted (reason)"),
    ('[[allow]]\nrule = "reuse-in-flight"\nreason = "ok"\nscope = "a:1"\n', ":1: unknown key(s) scope"),
    ('[[allow]]\nrule = 3\nreason = "ok"\n', ":1: rule must be string(s)"),
    ('allow = 3\n', "expected a list of tables under 'allow'"),
    ('[[allow]\n', "not valid TOML"),
])
def test_bad_toml_names_file_and_line_in_both_consumers(tmp_path, body, message):
    f = tmp_path / "allow.toml"
    f.write_text(body)
    with pytest.raises(AllowListError) as plugin:
        load_allow_list(f)
    assert str(plugin.value).startswith(str(f)) and message in str(plugin.value)
    scan_body = body.replace("rule", "scope").replace('"reuse-in-flight"', '"a.py:1"').replace(
        '"free-in-flight"', '"b.py:2"')
    if "unknown key" in message:
        scan_body = '[[allow]]\nscope = "a.py:1"\nreason = "ok"\nrule = "x"\n'
    f.write_text(scan_body)
    with pytest.raises(AllowListError) as scan:
        AllowList.load([f])
    assert str(scan.value).startswith(str(f))
    assert message.replace("rule", "scope") in str(scan.value) or "unknown key(s) rule" in str(scan.value)


def test_json_entries_are_numbered(tmp_path):
    f = tmp_path / "allow.json"
    f.write_text('{"allow": [{"rule": "free-in-flight", "reason": "ok"}, {"rule": "free-in-flight"}]}')
    with pytest.raises(AllowListError, match=r"allow\.json: allow entry 2: say why"):
        load_allow_list(f)


def test_text_format_is_the_scans_only(tmp_path):
    f = tmp_path / "allow.txt"
    f.write_text("# c\npkg/a.py:12   the reason\n")
    assert AllowList.load([f]).entries[0].source == f"{f}:2"
    with pytest.raises(AllowListError, match="is a .toml or .json file"):
        load_allow_list(f)


def test_unreadable_file(tmp_path):
    with pytest.raises(AllowListError, match="cannot read allow-list"):
        read_entries(tmp_path / "missing.toml", FIELDS)


def test_plugin_gives_back_the_environment_it_set(tmp_path):
    """Two pytest sessions in one process: the first's HAZSAN settings do not leak into the second
    or into the program after it (pytest_unconfigure restores them)."""
    (tmp_path / "test_plain.py").write_text("def test_ok():\n    assert True\n")
    script = (
        "import os, sys, pytest\n"
        "keys = ('HAZSAN', 'HAZSAN_DIR', 'HAZSAN_LEVEL', 'HAZSAN_STACKS', 'HAZSAN_PYTEST_DIR')\n"
        "rc = pytest.main(['-q', '-p', 'no:cacheprovider', '--hazsan', '--hazsan-dir', 'traces', 'test_plain.py'])\n"
        "print('RC', int(rc))\n"
        "print('AFTER', sorted((k, os.environ.get(k)) for k in keys))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    env["HAZSAN_LEVEL"] = "alloc"          # a value of the caller's own: must come back as it was
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert "RC 0" in out.stdout, out.stdout + out.stderr
    after = out.stdout.split("AFTER ", 1)[1].strip()
    assert after == str(sorted([("HAZSAN", None), ("HAZSAN_DIR", None), ("HAZSAN_LEVEL", "alloc"),
                                ("HAZSAN_STACKS", None), ("HAZSAN_PYTEST_DIR", None)])), after
