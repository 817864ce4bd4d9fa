"""The trace header (hooks, versions, device), header-only traces, sites in installed packages,
the server-plugin entry points, and NCCL waits recorded as stream edges."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

TESTS = Path(__file__).parents[1] / "support"   # the stand-in modules these runs import


def py(code, tmp_path, env_extra=None, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("HAZSAN", "RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.update(HAZSAN="1", HAZSAN_DIR=str(tmp_path / "t"))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout)


def traces(tmp_path):
    out = {}
    for p in sorted((tmp_path / "t").iterdir()):
        with open(p, "rb") as f:
            lines = [json.loads(line) for line in f]
        out[p.name] = (lines[0], lines[1:])
    return out


def test_a_run_that_records_nothing_still_writes_its_header(tmp_path):
    r = py("import torch", tmp_path)
    assert r.returncode == 0, r.stderr
    ((name, (header, events)),) = traces(tmp_path).items()
    assert events == [{"ev": "end", "events": 0, "dropped": 0}]    # nothing but the clean-close record
    assert {"dispatch-mode", "collectives"} <= set(header["hooks"]["installed"])
    assert header["hooks"]["failed"] == {}
    assert header["versions"]["torch"].startswith("2.") and header["gpu"] is None


def test_a_process_that_never_imports_torch_leaves_no_file(tmp_path):
    r = py("print(1)", tmp_path)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / "t").exists() or not list((tmp_path / "t").iterdir())


def test_failed_hooks_are_listed_in_the_header(tmp_path):
    # a module at SGLang's allocator path without SymmetricMemoryContext: that hook fails, counted
    pkg = tmp_path / "pkgs" / "sglang" / "srt" / "distributed" / "device_communicators"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent, pkg.parent.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "pynccl_allocator.py").write_text("x = 1\n")
    r = py("import torch, sglang.srt.distributed.device_communicators.pynccl_allocator", tmp_path,
           {"PYTHONPATH": str(tmp_path / "pkgs")})
    assert r.returncode == 0, r.stderr
    ((_, (header, events)),) = traces(tmp_path).items()
    assert header["hooks"]["failed"] == {"import.sglang.srt.distributed.device_communicators.pynccl_allocator": 1}
    assert [e for e in events if e["ev"] == "hook_error"]


def test_single_file_module_does_not_make_site_packages_internal(tmp_path):
    from sanitizer.capture.sites import SiteFinder
    site_dir = tmp_path / "site-packages"
    (site_dir / "pkg").mkdir(parents=True)
    single = types.ModuleType("typing_extensions")
    single.__file__ = str(site_dir / "typing_extensions.py")
    package = types.ModuleType("wrapt")
    package.__file__ = str(site_dir / "wrapt" / "__init__.py")
    package.__path__ = [str(site_dir / "wrapt")]
    finder = SiteFinder()
    finder.add_internal(single)
    finder.add_internal(package)

    def code_at(path):
        return compile("0", str(path), "exec")
    assert finder._name(code_at(site_dir / "typing_extensions.py")) is None
    assert finder._name(code_at(site_dir / "wrapt" / "wrappers.py")) is None
    user = site_dir / "sglang" / "srt" / "parallel_state.py"
    assert finder._name(code_at(user)) == str(user)            # an installed package is a site


def test_installed_package_frames_are_sites(tmp_path):
    # a package installed into a site-packages folder next to typing_extensions (as pip lays it out)
    site_dir = tmp_path / "site"
    (site_dir / "userpkg").mkdir(parents=True)
    import typing_extensions
    (site_dir / "typing_extensions.py").write_text(Path(typing_extensions.__file__).read_text())
    (site_dir / "userpkg" / "__init__.py").write_text(
        "import torch\n\ndef make():\n    return torch.ones(123)\n")
    code = """
        import typing_extensions, torch, userpkg
        assert typing_extensions.__file__.endswith("site/typing_extensions.py")  # the copy beside userpkg
        t = userpkg.make()
    """
    r = py(code, tmp_path, {"PYTHONPATH": str(site_dir)})
    assert r.returncode == 0, r.stderr
    ((_, (_, events)),) = traces(tmp_path).items()
    (alloc,) = [e for e in events if e["ev"] == "alloc" and e.get("shape") == [123]]
    assert alloc["site"] == "site/userpkg/__init__.py:4:make"     # (relative to the working directory)


def test_plugin_entry_points_are_declared_and_start_capture(tmp_path):
    from importlib.metadata import entry_points
    for group in ("sglang.srt.plugins", "vllm.general_plugins"):
        (ep,) = [e for e in entry_points(group=group) if e.name == "hazsan"]
        assert ep.value == "sanitizer.capture.bootstrap:plugin"
    # where the .pth line did not start capture, the plugin call does (and is a no-op without HAZSAN)
    code = """
        from sanitizer.capture import runtime
        assert runtime.active() is None
        import os
        from importlib.metadata import entry_points
        (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "hazsan"]
        os.environ.pop("HAZSAN")
        ep.load()()
        assert runtime.active() is None
        os.environ["HAZSAN"] = "1"
        ep.load()()
        import torch
        x = torch.ones(7)
    """
    r = py(code, tmp_path, {"HAZSAN": "0"})
    assert r.returncode == 0, r.stderr
    ((_, (header, events)),) = traces(tmp_path).items()
    assert "plugin" in header["hooks"]["installed"]
    assert [e for e in events if e["ev"] == "alloc" and e.get("shape") == [7]]


def test_nccl_wait_is_a_stream_edge_and_is_completed_a_host_observation():
    torch = pytest.importorskip("torch")
    from sanitizer.capture import collectives

    emitted = []
    cap = types.SimpleNamespace(emit=emitted.append, failed=lambda h, e: (_ for _ in ()).throw(e),
                                streams=None, next_cid=iter(range(1, 100)).__next__)
    colls = collectives.DispatchedCollectives(cap)
    # as _record leaves them: a collective on a NCCL group's stream, one on gloo's
    colls.device_streamed[1] = "nccl:0"
    colls.done(1, waited=True)            # Work.wait() / blocking call on NCCL
    colls.device_streamed[2] = "nccl:0"
    colls.done(2, waited=False)           # Work.is_completed() returned True
    colls.done(3, waited=True)            # gloo: the host blocked in wait()
    kinds = [(e["ev"], e.get("event"), e.get("stream"), e.get("cid")) for e in emitted]
    assert kinds == [("record", "coll1", "nccl:0", None), ("wait", "coll1", "cuda:0", None),
                     ("coll_done", None, None, 2), ("coll_done", None, None, 3)]


def test_live_range_lookup_follows_allocations_frees_and_reuse():
    torch = pytest.importorskip("torch")
    from sanitizer.capture.block_table import BlockTable
    from sanitizer.capture.runtime import ScopeStack
    from sanitizer.capture.sites import SiteFinder
    from sanitizer.capture.config import Settings
    cap = types.SimpleNamespace(emit=lambda e: None, sites=SiteFinder("none"), scopes=ScopeStack(),
                                settings=Settings.from_env({})[0],
                                failed=lambda h, e: (_ for _ in ()).throw(e))
    table = BlockTable(cap)
    keep = [torch.empty(256) for _ in range(300)]
    for t in keep:
        table.buffer(t)
    t = keep[17]
    assert table.resolve(t.data_ptr() + 100, 8) == (t.data_ptr() + 100, 8, True)   # inside a block
    assert table.resolve(12345, 64) == (12345, 64, False)                        # memory torch never saw
    for i in range(0, 300, 2):                     # free half; the allocator hands addresses out again
        keep[i] = None
    fresh = [torch.empty(256) for _ in range(150)]
    for f in fresh:
        table.buffer(f)
    for x in [k for k in keep if k is not None] + fresh:
        b = table.ranges.find(x.data_ptr() + 4)
        assert b is not None and b.real == x.data_ptr()
