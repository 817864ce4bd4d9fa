"""hazsan scan as a CI gate (issue 13): what places transients in a window, which pools are
windows, the conditions on the way to each scope (--when, fallback-only), --changed-since.

Runs on tests/fixtures/scan/gate/gate.py (parsed with ast, never imported).
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from sanitizer.cli import main
from sanitizer.scan.allow import AllowList
from sanitizer.scan.config import ScanConfig
from sanitizer.scan.scanner import Scanner

GATE = Path(__file__).parents[1] / "fixtures" / "scan" / "gate"


def scan(path=GATE, allow=None):
    return Scanner(ScanConfig.build(), allow).run([path])


@pytest.fixture(scope="module")
def scopes():
    return scan().scopes


def one(scopes, function, line_text=None):
    hits = [s for s in scopes if s.function == function]
    if line_text is not None:
        src = (GATE / "gate.py").read_text().splitlines()
        hits = [s for s in hits if line_text in src[s.line]]   # the line after `with`
    assert len(hits) == 1, [(s.function, s.line) for s in hits]
    return hits[0]


def run(capsys, *argv):
    code = main(["scan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def as_json(capsys, *argv):
    code, out, err = run(capsys, *argv, "--format", "json")
    return code, {s["function"] + ":" + str(s["line"]): s for s in json.loads(out)["scopes"]}, err


# -- what places transients in the window ------------------------------------------------------
def test_kernel_writing_into_its_output_is_alloc_and_listed(scopes):
    s = one(scopes, "kernel_writes_into_output")
    assert s.klass == "alloc" and not s.failing
    assert [k.callee for k in s.kernels] == ["_combine_kernel[x.shape[0],]"]
    assert not any(r.transient for r in s.records)


def test_inline_launch_and_out_keyword_allocate_nothing(scopes):
    s = one(scopes, "inline_kernel_and_out_keyword")
    assert s.klass == "alloc" and not s.failing
    kinds = {r.callee: r.kind for r in s.records}
    assert kinds["_combine_kernel[4,]"] == "kernel" and kinds["torch.add"] == "kernel"


def test_helper_allocating_a_workspace_is_compute(scopes):
    s = one(scopes, "helper_allocates_workspace")
    assert s.klass == "compute" and s.failing and not s.unresolved
    (rec,) = s.records
    transients = [i for i in rec.inner if i.transient]
    assert [i.callee for i in transients] == ["torch.empty"], "the workspace, not the output"


def test_compiled_extension_is_compute_unresolved_and_a_call_entry_settles_it(tmp_path, scopes):
    s = one(scopes, "extension_op")
    assert s.klass == "compute" and s.unresolved and s.label == "compute (unresolved)" and s.failing
    allow = tmp_path / "allow.txt"
    allow.write_text("call:sgl_kernel.fused_norm   writes its output only (reviewed)\n")
    settled = one(scan(allow=AllowList.load([allow])).scopes, "extension_op")
    assert settled.klass == "alloc" and not settled.failing
    assert "settled by allow-list" in settled.records[0].reason


def test_private_pool_never_fails_registered_pool_does(scopes):
    kv = one(scopes, "KVPool.__init__")
    assert kv.klass == "compute" and kv.symmetric is False and not kv.window and not kv.failing
    win = one(scopes, "Communicator.reduce_scratch")
    assert win.klass == "compute" and win.window and win.failing, "register_mem_pool(self.win_pool)"


def test_private_pools_have_their_own_section(capsys, scopes):
    code, out, _ = run(capsys, str(GATE))
    assert code == 1
    private = out.index("== private pools (1)")
    assert out.index("KVPool.__init__") > private
    kv, win = one(scopes, "KVPool.__init__"), one(scopes, "Communicator.reduce_scratch")
    fail_line = out.splitlines()[-1]
    assert f"gate.py:{win.line}" in fail_line and f"gate.py:{kv.line}" not in fail_line


# -- conditions, --when, fallback-only ---------------------------------------------------------
def test_scope_guarded_by_is_sm120_is_reported_under_that_condition(scopes):
    s = one(scopes, "combine_sm120_fallback", "einsum")
    assert [c.text for p in s.paths for c in p.conditions] == ["when is_sm120()"]
    assert s.fallback_only
    other = one(scopes, "combine_sm120_fallback", "combine_into_output")
    assert [c.text for p in other.paths for c in p.conditions] == ["unless is_sm120()"]


def test_when_keeps_reachable_scopes_and_marks_only_under(capsys):
    _, sm120, _ = as_json(capsys, str(GATE), "--when", "sm120")
    guarded = [v for k, v in sm120.items() if k.startswith("combine_sm120_fallback")]
    assert len(guarded) == 1 and guarded[0]["when"]["only_under"] == ["sm120"]
    assert not any(k.startswith("_hip_only_reduce") for k in sm120), "hip-only: left out"
    _, sm100, _ = as_json(capsys, str(GATE), "--when", "sm100")
    kept = [v for k, v in sm100.items() if k.startswith("combine_sm120_fallback")]
    assert [v["class"] for v in kept] == ["alloc"], "only the non-SM120 branch runs on SM100"
    _, hip, _ = as_json(capsys, str(GATE), "--when", "hip")
    (h,) = [v for k, v in hip.items() if k.startswith("_hip_only_reduce")]
    assert h["when"]["only_under"] == ["hip"]


def test_conditions_on_the_call_chain(scopes):
    s = one(scopes, "_hip_only_reduce")
    (path,) = s.paths
    assert path.via[0].startswith("dispatch_reduce (gate.py:")
    assert [c.text for c in path.conditions] == ["unless not _is_hip"]
    assert s.fallback_only


def test_fallback_inside_a_helper_changes_the_class_per_hardware(capsys, scopes):
    pre = one(scopes, "hc_pre_like")
    assert pre.klass == "compute" and not pre.fallback_only, "the einsum runs on every GPU but SM100"
    post = one(scopes, "hc_post_like")
    assert post.klass == "compute" and post.fallback_only, "the einsum runs on SM120 only"
    _, sm100, _ = as_json(capsys, str(GATE), "--when", "sm100")
    (p,) = [v for k, v in sm100.items() if k.startswith("hc_pre_like")]
    assert p["class"] == "alloc" and not p["failing"] and p["when"]["class_before"] == "compute"
    _, sm120, _ = as_json(capsys, str(GATE), "--when", "sm120")
    (p,) = [v for k, v in sm120.items() if k.startswith("hc_post_like")]
    assert p["class"] == "compute" and p["failing"]


def test_when_rejects_a_malformed_name(capsys):
    code, out, err = run(capsys, str(GATE), "--when", "a b")
    assert code == 2 and out == "" and err.count("\n") == 1


# -- --changed-since ---------------------------------------------------------------------------
def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                   check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    root = tmp_path / "repo"
    (root / "pkg").mkdir(parents=True)
    shutil.copy(GATE / "gate.py", root / "pkg" / "gate.py")
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "base")
    return root


def test_changed_since_keeps_scopes_whose_helper_changed(capsys, repo):
    code, scopes, _ = as_json(capsys, str(repo), "--changed-since", "HEAD")
    assert code == 0 and scopes == {}, "nothing changed: nothing reported, exit 0"
    src = repo / "pkg" / "gate.py"
    text = src.read_text().replace("workspace = torch.empty(1 << 20,", "workspace = torch.empty(1 << 21,")
    src.write_text(text)
    code, scopes, _ = as_json(capsys, str(repo), "--changed-since", "HEAD")
    assert code == 1
    assert [k.split(":")[0] for k in scopes] == ["helper_allocates_workspace"]
    (s,) = scopes.values()
    assert s["changed"] == [f"pkg/gate.py:{text.splitlines().index('    workspace = torch.empty(1 << 21, dtype=torch.uint8, device=x.device)') + 1}"]


def test_changed_since_counts_a_committed_change_and_an_untracked_file(capsys, repo):
    _git(repo, "tag", "base")
    src = repo / "pkg" / "gate.py"
    src.write_text(src.read_text().replace('torch.matmul(x, x)', 'torch.matmul(x, x.t())'))
    _git(repo, "commit", "-qam", "change")
    (repo / "pkg" / "new.py").write_text(
        "from x import use_symmetric_memory\n\ndef f(g, y):\n    with use_symmetric_memory(g):\n"
        "        z = y.float()\n    return z\n")
    code, scopes, _ = as_json(capsys, str(repo), "--changed-since", "base")
    assert sorted(k.split(":")[0] for k in scopes) == ["_hip_only_reduce", "f"]


@pytest.mark.parametrize("ref", ["no-such-ref", "--output=x"])
def test_changed_since_bad_ref_is_exit_2_one_line(capsys, repo, ref):
    code, out, err = run(capsys, str(repo), f"--changed-since={ref}")
    assert code == 2 and out == "" and err.count("\n") == 1 and "hazsan scan:" in err


def test_changed_since_outside_a_repository(capsys, tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    (tmp_path / "a.py").write_text("x = 1\n")
    code, out, err = run(capsys, str(tmp_path), "--changed-since", "HEAD")
    assert code == 2 and out == "" and err.count("\n") == 1


def test_environment_flags_and_server_arguments_are_conditions(capsys, scopes):
    s = one(scopes, "flag_and_server_arg")
    assert [c.text for p in s.paths for c in p.conditions] == [
        "when os.environ.get('SGLANG_USE_TORCH_COMBINE') and server_args.enable_dp_attention"]
    assert not s.fallback_only, "a flag is no hardware"
    _, kept, _ = as_json(capsys, str(GATE), "--when", "SGLANG_USE_TORCH_COMBINE",
                         "--when", "enable_dp_attention")
    (k,) = [v for n, v in kept.items() if n.startswith("flag_and_server_arg")]
    assert sorted(k["when"]["only_under"]) == ["SGLANG_USE_TORCH_COMBINE", "enable_dp_attention"]
    _, sm120, _ = as_json(capsys, str(GATE), "--when", "sm120")
    assert any(n.startswith("flag_and_server_arg") for n in sm120), "unknown under sm120: kept"


def test_a_public_function_stays_a_root_beside_its_callers(capsys, scopes):
    s = one(scopes, "public_reduce")
    assert sorted(p.via[0].split(" ")[0] if p.via else "" for p in s.paths) == ["", "dispatch_public"]
    texts = sorted(tuple(c.text for c in p.conditions) for p in s.paths)
    assert texts == [(), ("when _is_hip",)]
    assert not s.fallback_only, "callable from outside the parsed files, on any hardware"
    _, sm120, _ = as_json(capsys, str(GATE), "--when", "sm120")
    assert any(n.startswith("public_reduce") for n in sm120)
