"""hazsan scan, the analysis: scope entry forms, body classes, helper following, nesting, guards.

Runs the scanner on the fixture tree tests/fixtures/scan/tree (parsed with ast, never imported).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from sanitizer.scan.config import ScanConfig
from sanitizer.scan.scanner import Scanner

FIXTURES = Path(__file__).parents[1] / "fixtures" / "scan"
TREE = FIXTURES / "tree"


def scan(path=TREE, **options):
    return Scanner(ScanConfig.build(**options)).run([path])


@pytest.fixture(scope="module")
def by_function():
    result = scan()
    table: dict[str, list] = {}
    for s in result.scopes:
        table.setdefault(s.function, []).append(s)
    return table


def only(table, function):
    scopes = table[function]
    assert len(scopes) == 1, [(s.file, s.line) for s in scopes]
    return scopes[0]


def line_of(rel: str, needle: str) -> int:
    """1-based line of the first fixture line containing `needle` (keeps tests edit-proof)."""
    for no, text in enumerate((TREE / rel).read_text().splitlines(), 1):
        if needle in text:
            return no
    raise AssertionError(f"{needle!r} not in {rel}")


# -- the three classes -------------------------------------------------------------------------
def test_alloc_class_only_output_allocations(by_function):
    s = only(by_function, "alloc_only")
    assert s.klass == "alloc"
    assert [r.callee for r in s.records] == ["torch.empty", "out.new_zeros"]
    assert not any(r.transient for r in s.records)
    assert s.file == "pkg/models.py" and s.line == line_of("pkg/models.py", "def alloc_only") + 1


def test_copy_class_view_then_one_copy(by_function):
    s = only(by_function, "copy_for_collective")
    assert s.klass == "copy"
    kinds = {r.callee: r.kind for r in s.records}
    assert kinds["x.movedim(0, 1).contiguous"] == "copy"
    assert not any(r.transient for r in s.records), "movedim is a view: nothing is left behind"


def test_compute_class_inline_einsum(by_function):
    s = only(by_function, "einsum_inline")
    assert s.klass == "compute"
    (rec,) = s.records
    assert rec.callee == "torch.einsum" and rec.kind == "compute" and rec.transient and rec.resolved


def test_chained_copies_leave_a_transient(by_function):
    s = only(by_function, "chained_copies")
    assert s.klass == "compute"
    transients = [r.callee for r in s.records if r.transient]
    assert transients == ["x.float"], "x.float() is consumed by .contiguous() and freed in the window"


def test_discarded_allocation_is_a_reservation_not_a_transient(by_function):
    # `torch.empty(n)` alone grows the pool and is never read (SGLang's
    # prealloc_symmetric_memory_pool): it only allocates.
    s = only(by_function, "discarded_scratch")
    assert s.klass == "alloc" and not s.failing
    (rec,) = s.records
    assert not rec.transient and "reserves pool memory" in rec.reason


def test_unresolved_call_counts_as_compute_and_says_so(by_function):
    s = only(by_function, "Coordinator.unresolved_submodule")
    assert s.klass == "compute"
    (rec,) = s.records
    assert not rec.resolved and rec.reason.startswith("unresolved")


def test_plain_context_manager_is_not_a_scope(by_function):
    assert "plain_context_is_not_a_scope" not in by_function


# -- helpers followed into the tree ------------------------------------------------------------
def test_helper_running_einsum_makes_the_scope_compute(by_function):
    s = only(by_function, "combine_via_helper")
    assert s.klass == "compute"
    (rec,) = s.records
    assert rec.helper == "combine (pkg/helpers.py:8)"
    assert [i.callee for i in rec.inner] == ["torch.einsum"]
    assert rec.inner[0].file == "pkg/helpers.py"
    assert rec.spans == [("pkg/helpers.py", 8, line_of("pkg/helpers.py", "return y"))]


def test_helper_that_only_allocates_its_output_stays_alloc(by_function):
    s = only(by_function, "alloc_via_helper")
    assert s.klass == "alloc"
    assert s.records[0].kind == "alloc" and not s.records[0].transient


def test_helper_scratch_buffer_is_a_transient(by_function):
    s = only(by_function, "helper_with_scratch")
    assert s.klass == "compute"
    inner = s.records[0].inner
    scratch = [r for r in inner if r.transient]
    assert [r.line for r in scratch] == [line_of("pkg/helpers.py", "tmp = torch.empty_like")]


def test_self_method_followed(by_function):
    s = only(by_function, "Coordinator.self_method_helper")
    assert s.klass == "compute"
    assert s.records[0].helper.startswith("Coordinator._project")
    assert s.records[0].inner[0].callee == "torch.matmul"


def test_depth_limit_stops_following_and_counts_as_compute():
    def deepest(rec):
        while rec.inner:
            rec = rec.inner[0]
        return rec

    result = scan()
    s = next(s for s in result.scopes if s.function == "deep_chain")
    leaf = deepest(s.records[0])
    assert leaf.callee == "level4" and "depth limit 3" in leaf.reason and not leaf.resolved
    deeper = next(s for s in scan(depth=4).scopes if s.function == "deep_chain")
    leaf = deepest(deeper.records[0])
    assert leaf.callee == "torch.matmul" and leaf.resolved
    shallow = next(s for s in scan(depth=0).scopes if s.function == "combine_via_helper")
    assert "depth limit 0" in shallow.records[0].reason and not shallow.records[0].inner


# -- how scopes are entered --------------------------------------------------------------------
@pytest.mark.parametrize("function, scope, via_prefix", [
    ("aliased", "use_symmetric_memory", None),
    ("module_attribute", "SymmetricMemoryContext", None),
    ("Coordinator.method_form", "use_symmetric_memory", None),
    ("through_variable", "use_symmetric_memory", "variable ctx"),
    ("through_conditional_variable", "use_symmetric_memory", "variable ctx"),
    ("Coordinator.attribute_form", "use_symmetric_memory", "attribute self._ctx"),
    ("through_contextmanager_helper", "use_symmetric_memory", "helper symm_region"),
    ("through_factory_helper", "use_symmetric_memory", "helper make_ctx"),
    ("torch_symmetric_pool", "torch.cuda.use_mem_pool", None),
])
def test_entry_forms(by_function, function, scope, via_prefix):
    s = only(by_function, function)
    assert s.scope == scope
    if via_prefix is None:
        assert s.via == []
    else:
        assert s.via and s.via[0].startswith(via_prefix)


def test_async_with_and_exit_stack(by_function):
    a = only(by_function, "async_scope")
    assert a.entered == "async with" and a.klass == "alloc"
    e = only(by_function, "exit_stack")
    assert e.entered == "ExitStack.enter_context"
    assert e.klass == "copy" and [r.callee for r in e.records] == ["torch.cat"]


def test_torch_symmetric_memory_pool_is_marked_symmetric(by_function):
    s = only(by_function, "torch_symmetric_pool")
    assert s.pool == "symm_mem.get_mem_pool(device)" and s.symmetric is True
    v = only(by_function, "torch_symmetric_pool_variable")
    assert v.pool == "pool" and v.symmetric is True, "the variable's assignment says get_mem_pool"
    o = only(by_function, "other_pool")
    assert o.pool == "pool" and o.symmetric is False and not o.window
    assert not o.failing
    assert only(by_function, "alloc_only").symmetric is True


def test_contextmanager_body_is_reported_too(by_function):
    s = only(by_function, "symm_region")
    assert s.file == "pkg/helpers.py" and s.klass == "alloc" and s.records == [] and s.yields
    assert not only(by_function, "alloc_only").yields


# -- nesting and guards ------------------------------------------------------------------------
def test_nested_scopes_reported_separately(by_function):
    outer, inner = sorted(by_function["nested"], key=lambda s: s.line)
    assert inner.parent == outer.line and outer.nested == [inner.line]
    assert outer.klass == "alloc", "the inner einsum belongs to the inner scope's report"
    assert inner.klass == "compute"


def test_guards(by_function):
    assert only(by_function, "einsum_inline").guard == "disabled=not flag"
    assert only(by_function, "through_conditional_variable").guard == "when x.is_cuda"
    assert only(by_function, "through_factory_helper").guard == "disabled=not symmetric_ok()"
    assert only(by_function, "alloc_only").guard is None
    off = only(by_function, "statically_disabled")
    assert off.guard == "disabled=True" and off.disabled and off.klass == "compute" and not off.failing
    assert not only(by_function, "einsum_inline").disabled


# -- configuration -----------------------------------------------------------------------------
def test_custom_scope_names():
    default = {s.function for s in scan().scopes}
    assert "custom_scope" not in default
    custom = [s for s in scan(scopes=["my_region"]).scopes if s.function == "custom_scope"]
    assert len(custom) == 1 and custom[0].klass == "compute" and custom[0].scope == "my_region"
    only_custom = scan(scopes=["my_region"], no_default_scopes=True).scopes
    assert {s.function for s in only_custom} == {"custom_scope"}


def test_dotted_scope_name_matches_resolved_name_only():
    hits = scan(scopes=["vendor.regions.my_region"], no_default_scopes=True).scopes
    assert [s.function for s in hits] == ["custom_scope"]
    assert scan(scopes=["other.my_region"], no_default_scopes=True).scopes == []


def test_exclude_glob():
    result = scan(exclude=["pkg/models.py"])
    assert {s.file for s in result.scopes} == {"pkg/helpers.py"}


# -- robustness --------------------------------------------------------------------------------
def test_syntax_error_reported_and_scan_continues():
    result = scan(FIXTURES / "broken")
    assert [(p.file, p.line) for p in result.problems] == [("bad.py", 5)]
    assert "syntax error" in result.problems[0].message
    assert [(s.file, s.function, s.klass) for s in result.scopes] == [("good.py", "ok", "alloc")]
    assert result.summary()["syntax_errors"] == 1


def test_single_file_path_relative_name():
    result = scan(TREE / "pkg" / "helpers.py")
    assert [s.file for s in result.scopes] == ["helpers.py"]


def test_scanned_code_is_never_imported(tmp_path):
    bomb = tmp_path / "bomb.py"
    marker = tmp_path / "ran"
    bomb.write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "from a import use_symmetric_memory\n"
        "def f(g):\n    with use_symmetric_memory(g):\n        return torch.empty(1)\n")
    result = scan(tmp_path)
    assert not marker.exists()
    assert [s.function for s in result.scopes] == ["f"]


def test_internal_error_in_one_scope_does_not_end_the_scan(monkeypatch):
    from sanitizer.scan.classify import BodyClassifier

    original = BodyClassifier.scope_records

    def flaky(self, site):
        if site.where.qualname == "einsum_inline":
            raise ValueError("boom")
        return original(self, site)

    monkeypatch.setattr(BodyClassifier, "scope_records", flaky)
    result = scan()
    assert "einsum_inline" not in {s.function for s in result.scopes}
    assert "combine_via_helper" in {s.function for s in result.scopes}
    (problem,) = result.problems
    assert problem.file == "pkg/models.py" and problem.line == line_of("pkg/models.py", "disabled=not flag")
    assert "internal error" in problem.message and "boom" in problem.message
    assert result.summary()["internal_errors"] == 1


def test_undecodable_file_is_a_problem_not_a_crash(tmp_path):
    (tmp_path / "latin.py").write_bytes(b"# use_symmetric_memory \xff\xfe\n")
    (tmp_path / "nul.py").write_bytes(b"use_symmetric_memory\x00\n")
    result = scan(tmp_path)
    assert sorted(p.file for p in result.problems) == ["latin.py", "nul.py"]
    assert result.scopes == []


def test_every_reported_line_is_a_scope_entry(by_function):
    """Each report's line holds a `with`/`async with` or an enter_context call in the source."""
    for scopes in by_function.values():
        for s in scopes:
            text = (TREE / s.file).read_text().splitlines()[s.line - 1]
            assert "with " in text or "enter_context" in text, (s.file, s.line, text)
            ast.parse((TREE / s.file).read_text())


# -- module resolution across the tree ---------------------------------------------------------
SCOPE_USER = """
import torch
from {module} import combine
from sg.srt.allocator import use_symmetric_memory


def user(g, x, w):
    with use_symmetric_memory(g):
        y = combine(x, w)
    return y
"""
HELPER = "import torch\n\n\ndef combine(x, w):\n    return torch.einsum('ij,jk->ik', x, w)\n"


def _user_record(root: Path, path: Path):
    (s,) = [s for s in scan(path).scopes if s.function == "user"]
    return s.records[0]


@pytest.mark.parametrize("module", ["sg.srt.helpers", ".helpers"])
def test_imports_resolve_when_path_is_a_subpackage(tmp_path, module):
    srt = tmp_path / "sg" / "srt"
    srt.mkdir(parents=True)
    (tmp_path / "sg" / "__init__.py").write_text("")
    (srt / "__init__.py").write_text("")
    (srt / "helpers.py").write_text(HELPER)
    (srt / "models.py").write_text(SCOPE_USER.format(module=module))
    rec = _user_record(tmp_path, srt)      # scanned from sg/srt, imports name sg.srt.*
    assert rec.helper == "combine (helpers.py:4)" and rec.inner[0].callee == "torch.einsum"


@pytest.mark.parametrize("scan_from, shown", [("sg", "srt/helpers.py"), ("sg/srt", "helpers.py")])
def test_namespace_tree_without_init_files(tmp_path, scan_from, shown):
    srt = tmp_path / "sg" / "srt"
    srt.mkdir(parents=True)
    (srt / "helpers.py").write_text(HELPER)
    (srt / "models.py").write_text(SCOPE_USER.format(module="sg.srt.helpers"))
    rec = _user_record(tmp_path, tmp_path / scan_from)
    assert rec.helper == f"combine ({shown}:4)"


def test_outside_module_never_lands_on_a_same_named_scanned_file(tmp_path):
    app = tmp_path / "app"
    app.mkdir()
    (app / "utils.py").write_text("import torch\n\n\ndef checkpoint(x):\n    return torch.empty(1)\n")
    (app / "main.py").write_text(
        "import torch\nfrom torch.utils import checkpoint\nfrom x import use_symmetric_memory\n\n\n"
        "def user(g, x):\n    with use_symmetric_memory(g):\n        y = checkpoint(x)\n    return y\n")
    (s,) = scan(app).scopes
    (rec,) = s.records
    assert rec.helper is None and rec.reason == "op: torch.utils.checkpoint" and s.klass == "compute"
