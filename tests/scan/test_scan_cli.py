"""hazsan scan, the command: output formats, exit codes, allow-list, config file, --trace."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sanitizer.cli import main

FIXTURES = Path(__file__).parents[1] / "fixtures" / "scan"
TREE = str(FIXTURES / "tree")


def run(capsys, *argv):
    code = main(["scan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def scopes_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--format", "json")
    return code, json.loads(out)


def find(doc, function):
    hits = [s for s in doc["scopes"] if s["function"] == function]
    assert len(hits) == 1, hits
    return hits[0]


def test_json_shape(capsys):
    code, doc = scopes_json(capsys, TREE)
    assert code == 1
    assert set(doc) == {"scopes", "errors", "summary"}
    for s in doc["scopes"]:
        assert {"file", "line", "class", "calls", "guard"} <= set(s)
        assert s["class"] in ("compute", "copy", "alloc")
        assert isinstance(s["line"], int) and not s["file"].startswith("/")
        for c in s["calls"]:
            assert {"call", "file", "line", "kind", "transient", "reason", "resolved"} <= set(c)
    combine = find(doc, "combine_via_helper")
    assert combine["class"] == "compute" and combine["failing"] is True
    assert combine["calls"][0]["helper"] == "combine (pkg/helpers.py:8)"
    assert combine["calls"][0]["inner"][0]["call"] == "torch.einsum"
    assert "torch.einsum (pkg/helpers.py:10)" in combine["transients"]
    summ = doc["summary"]
    assert summ["scopes"] == len(doc["scopes"])
    assert summ["by_class"]["compute"] == sum(1 for s in doc["scopes"] if s["class"] == "compute" and s["window"])
    assert summ["failing"] == sum(1 for s in doc["scopes"] if s["failing"])
    assert summ["statically_disabled"] == 1 and summ["syntax_errors"] == 0


def test_text_is_grouped_with_snippets(capsys):
    code, out, _ = run(capsys, TREE)
    assert code == 1
    compute = out.index("== compute")
    copy = out.index("== copy")
    alloc = out.index("== alloc")
    assert compute < copy < alloc
    block = out[out.index("pkg/models.py:33"):copy]
    assert "y = combine(x, w)" in block          # the source snippet
    assert "torch.einsum" in block               # the helper's op under it
    assert "NOT ALLOWED" in block


def test_markdown_output(capsys, tmp_path):
    target = tmp_path / "scan.md"
    code, out, _ = run(capsys, TREE, "--format", "markdown", "-o", str(target),
                       "--command-line", "hazsan scan tree --format markdown", "--title", "Fixture scan")
    assert code == 1 and out == ""
    md = target.read_text()
    assert md.startswith("# Fixture scan\n")
    assert "Regenerate with: `hazsan scan tree --format markdown`" in md
    assert "## compute (" in md and "## copy (" in md and "## alloc (" in md
    assert "| `pkg/models.py:33` | `combine_via_helper` |" in md
    assert "```python" in md and "y = combine(x, w)" in md


def test_exit_0_when_no_compute_scope(capsys):
    code, out, _ = run(capsys, str(FIXTURES / "tree" / "pkg" / "helpers.py"))
    assert code == 0 and "0 compute scope(s) not allowed" in out


def test_syntax_error_reported_exit_follows_scopes(capsys):
    code, doc = scopes_json(capsys, str(FIXTURES / "broken"))
    assert code == 0
    assert doc["errors"] == [{"file": "bad.py", "line": 5, "message": "syntax error: '(' was never closed"}]
    code, out, err = run(capsys, str(FIXTURES / "broken"))
    assert "bad.py:5: syntax error" in out and "bad.py:5" in err


@pytest.mark.parametrize("argv", [
    ["/nonexistent/path"],
    [TREE, "--config", "/nonexistent.toml"],
    [TREE, "--allow", "/nonexistent.txt"],
    [TREE, "--trace", "/nonexistent/dir"],
    [TREE, "--depth", "-1"],
    [TREE, "--no-default-scopes"],
])
def test_exit_2_on_unusable_input(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and "hazsan scan:" in err


def test_exit_2_on_bad_arguments(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["scan", TREE, "--format", "yaml"])
    assert exc.value.code == 2


# -- allow-list --------------------------------------------------------------------------------
def test_allow_list_by_line_and_function(capsys):
    code, doc = scopes_json(capsys, TREE, "--allow", str(FIXTURES / "allow.txt"))
    assert code == 1, "other compute scopes are still not allowed"
    inline = find(doc, "einsum_inline")
    assert inline["allowed"]["reason"].startswith("the einsum output")
    assert inline["failing"] is False
    sub = find(doc, "Coordinator.unresolved_submodule")
    assert sub["allowed"]["entry"] == "pkg/models.py:Coordinator.unresolved_submodule"
    assert find(doc, "combine_via_helper")["allowed"] is None
    assert doc["summary"]["allowed"] == 2
    assert doc["summary"]["allow_unused"] == [f"{FIXTURES / 'allow.txt'}:4: pkg/gone.py:12"]


def test_allow_everything_exits_0(capsys, tmp_path):
    allow = tmp_path / "allow.txt"
    allow.write_text("pkg/*:*   reviewed every scope in this fixture\n")
    code, doc = scopes_json(capsys, TREE, "--allow", str(allow))
    assert code == 0 and doc["summary"]["failing"] == 0


def test_allow_list_toml(capsys, tmp_path):
    allow = tmp_path / "allow.toml"
    allow.write_text('[[allow]]\nscope = "pkg/*:*"\nreason = "all reviewed"\n')
    code, _ = scopes_json(capsys, TREE, "--allow", str(allow))
    assert code == 0


@pytest.mark.parametrize("text, message", [
    ("pkg/models.py:27\n", "has no reason"),
    ("pkg/models.py   reason without a line\n", "not FILE:LINE or FILE:FUNCTION"),
])
def test_allow_list_errors_name_file_and_line(capsys, tmp_path, text, message):
    allow = tmp_path / "allow.txt"
    allow.write_text("# header\n" + text)
    code, out, err = run(capsys, TREE, "--allow", str(allow))
    assert code == 2 and f"{allow}:2" in err and message in err


# -- configuration -----------------------------------------------------------------------------
def test_config_file_and_scope_option(capsys):
    code, doc = scopes_json(capsys, TREE, "--config", str(FIXTURES / "scan.toml"))
    assert doc["summary"]["depth"] == 5
    assert find(doc, "custom_scope")["scope"] == "my_region"
    deep = find(doc, "deep_chain")
    leaf = deep["calls"][0]
    while leaf.get("inner"):
        leaf = leaf["inner"][0]
    assert leaf["call"] == "torch.matmul", "depth 5 reaches level4's matmul"
    # the config makes make_ctx neutral as a call; as a scope factory it still counts
    assert find(doc, "through_factory_helper")["via"][0].startswith("helper make_ctx")
    code, doc2 = scopes_json(capsys, TREE, "--config", str(FIXTURES / "scan.toml"), "--depth", "1")
    assert doc2["summary"]["depth"] == 1, "the command line overrides the file"
    code, doc3 = scopes_json(capsys, TREE, "--scope", "my_region")
    assert find(doc3, "custom_scope")["class"] == "compute"


def test_config_json_and_unknown_key(capsys, tmp_path):
    good = tmp_path / "scan.json"
    good.write_text(json.dumps({"scopes": ["my_region"], "replace_default_scopes": True}))
    code, doc = scopes_json(capsys, TREE, "--config", str(good))
    assert [s["function"] for s in doc["scopes"]] == ["custom_scope"]
    bad = tmp_path / "bad.toml"
    bad.write_text("[scan]\nscopez = ['x']\n")
    code, out, err = run(capsys, TREE, "--config", str(bad))
    assert code == 2 and "scopez" in err and str(bad) in err


def test_config_calls_table_changes_a_class(capsys, tmp_path):
    cfg = tmp_path / "scan.toml"
    cfg.write_text('[scan.calls]\ncopy = ["torch.einsum"]\n')
    code, doc = scopes_json(capsys, TREE, "--config", str(cfg))
    assert find(doc, "einsum_inline")["class"] == "copy"


# -- runtime marking ---------------------------------------------------------------------------
def test_trace_marks_scopes_that_placed_transients(capsys):
    code, doc = scopes_json(capsys, TREE, "--trace", str(FIXTURES / "traces"))
    combine = find(doc, "combine_via_helper")["runtime"]
    assert combine == {"entered": 1, "transients": 1, "bytes": 4096,
                       "sites": ["/opt/app/pkg/helpers.py:10:combine"]}
    inline = find(doc, "einsum_inline")["runtime"]
    assert inline["transients"] == 1 and inline["bytes"] == 2048
    alloc = find(doc, "alloc_only")["runtime"]
    assert alloc == {"entered": 1, "transients": 0, "bytes": 0, "sites": []}
    rt = doc["summary"]["runtime"]
    assert rt["transients"] == 3 and rt["attributed"] == 2 and rt["unattributed"] == 1
    assert rt["unattributed_sites"] == ["/elsewhere/lib.py:3:mystery x1"]
    assert any("rank0.jsonl:28" in w and "alloc" in w for w in rt["warnings"])


def test_trace_fixture_sites_point_at_the_right_lines():
    """The hand-written trace names fixture lines; keep them honest if the fixture moves."""
    helpers = (FIXTURES / "tree" / "pkg" / "helpers.py").read_text().splitlines()
    models = (FIXTURES / "tree" / "pkg" / "models.py").read_text().splitlines()
    assert "torch.einsum" in helpers[10 - 1]
    assert "def combine_via_helper" in models[32 - 1] and "combine(x, w)" in models[34 - 1]
    assert "torch.empty" in models[15 - 1] and "torch.einsum" in models[28 - 1]


def test_trace_attribution_through_helper_without_stack(capsys, tmp_path):
    (tmp_path / "r0.jsonl").write_text("\n".join(json.dumps(e) for e in [
        {"hazsan": 1, "rank": 0},
        {"ev": "window", "addr": 0, "size": 1 << 20, "comm": "tp"},
        {"ev": "scope", "name": "symm", "enter": True},
        {"ev": "alloc", "id": 1, "addr": 4096, "size": 64, "stream": 0, "pool": "symm",
         "site": "pkg/helpers.py:19:scratch_then_copy"},
        {"ev": "free", "id": 1},
        {"ev": "scope", "name": "symm", "enter": False},
    ]) + "\n")
    code, doc = scopes_json(capsys, TREE, "--trace", str(tmp_path))
    assert find(doc, "helper_with_scratch")["runtime"]["transients"] == 1
    assert doc["summary"]["runtime"]["unattributed"] == 0


def test_trace_text_and_truncated_trace(capsys, tmp_path):
    (tmp_path / "r0.jsonl").write_text(
        '{"hazsan": 1, "rank": 0}\n{"ev": "window", "addr": 0, "size": 4096, "comm": "tp"}\n{"ev": "sco')
    code, out, err = run(capsys, TREE, "--trace", str(tmp_path))
    assert "== runtime (1 trace file(s)): 0 transient(s)" in out
    assert "truncated" in out


def test_trace_single_gzip_file_and_markdown_marks(capsys, tmp_path):
    import gzip

    src = (FIXTURES / "traces" / "rank0.jsonl").read_bytes()
    target = tmp_path / "rank0.jsonl.gz"
    with gzip.open(target, "wb") as f:
        f.write(src)
    code, out, _ = run(capsys, TREE, "--trace", str(target), "--format", "markdown")
    section = out[out.index("### `pkg/models.py:33`"):]
    assert section.startswith("### `pkg/models.py:33` (combine_via_helper, compute)")
    assert "*runtime: 1 transient(s) placed in a window, 4096 bytes" in section.split("### ")[1]
