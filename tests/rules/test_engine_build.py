"""The one engine, compiled and interpreted: which one runs, that both are the same source and
give the same reports, and that a machine without a compiler still installs (with one warning)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sanitizer.report import render
from sanitizer.rules import buildinfo, driver
from sanitizer.rules.driver import REQUIRE_ENV, analyze, compiled_available

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "traces"
COMPILED, WHY_NOT = compiled_available()
needs_compiled = pytest.mark.skipif(not COMPILED and not os.environ.get(REQUIRE_ENV),
                                    reason=f"compiled engine not built here: {WHY_NOT}")


def test_compiled_engine_is_built_where_required():
    """CI sets HAZSAN_REQUIRE_COMPILED: there a missing or stale build fails this test."""
    if not os.environ.get(REQUIRE_ENV):
        pytest.skip(f"{REQUIRE_ENV} not set")
    assert COMPILED, WHY_NOT
    assert analyze([EXAMPLES / "clean.jsonl"]).summary["engine"] == "compiled"


@needs_compiled
def test_the_interpreted_engine_is_the_source_and_the_compiled_one_is_not():
    compiled, kind, _ = driver.load_engine("compiled")
    interpreted, kind2, _ = driver.load_engine("interpreted")
    assert (kind, kind2) == ("compiled", "interpreted")
    assert Path(interpreted.__file__).name == "engine.py"
    assert not compiled.__file__.endswith(".py")
    assert compiled.RankAnalyzer is not interpreted.RankAnalyzer
    # the interpreted engine's clocks are interpreted too
    assert sys.modules[interpreted.StreamClocks.__module__].__file__.endswith("clocks.py")


def _reports(engine):
    out = {}
    cases = sorted(EXAMPLES.glob("*.jsonl")) + [EXAMPLES / "asymmetric-offset"]
    for path in cases:
        for mode in ("local", "successor"):
            doc = json.loads(render(analyze([path], engine=engine, peer_completion=mode), "json"))
            assert doc["summary"].pop("engine") == engine
            out[(path.name, mode)] = doc
    return out


@needs_compiled
def test_compiled_and_interpreted_give_identical_reports():
    compiled, interpreted = _reports("compiled"), _reports("interpreted")
    assert compiled == interpreted
    assert sum(d["summary"]["findings"] for d in compiled.values()) > 10  # the cases do find things


def test_engine_choice(monkeypatch, capsys):
    from sanitizer.cli import main

    monkeypatch.setenv("HAZSAN_ENGINE", "interpreted")
    assert main(["check", "--verbose", str(EXAMPLES / "clean.jsonl"), "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["summary"]["engine"] == "interpreted"
    assert err.startswith("hazsan: engine: interpreted;")
    monkeypatch.setenv("HAZSAN_ENGINE", "fast")
    a = analyze([EXAMPLES / "clean.jsonl"])
    assert a.exit_code() == 2 and "HAZSAN_ENGINE must be one of auto, compiled, interpreted" in str(a.errors[0])


def test_a_stale_or_missing_build_falls_back_with_one_warning_or_fails_where_required(monkeypatch):
    monkeypatch.setattr(buildinfo, "built_digest", lambda root: "0" * 16)
    monkeypatch.delenv("HAZSAN_ENGINE", raising=False)
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    ok, why = compiled_available()
    if not ok and "not built" in why:
        pytest.skip(why)
    assert not ok and "built from another version of its source" in why
    a = analyze([EXAMPLES / "clean.jsonl"])
    assert a.summary["engine"] == "interpreted" and a.exit_code() == 0
    assert [w for w in a.warnings if "interpreted engine" in w] == [f"running the interpreted engine: {why}"]
    monkeypatch.setenv(REQUIRE_ENV, "1")
    a = analyze([EXAMPLES / "clean.jsonl"])
    assert a.exit_code() == 2 and "HAZSAN_REQUIRE_COMPILED is set" in str(a.errors[0])
    assert analyze([EXAMPLES / "clean.jsonl"], engine="compiled").exit_code() == 2


def _project_copy(tmp_path) -> Path:
    """setup.py and the package, with the C that Cython generated at install (so that only the C
    compile runs), without built extensions."""
    dst = tmp_path / "proj"
    shutil.copytree(ROOT / "sanitizer", dst / "sanitizer", ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.digest"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dst / name)
    shutil.copytree(ROOT / "hooks", dst / "hooks")
    return dst


@pytest.mark.skipif(not (ROOT / "sanitizer" / "rules" / "engine.c").exists(), reason="no generated C in this checkout")
def test_without_a_compiler_the_build_warns_once_and_goes_on(tmp_path):
    proj = _project_copy(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != REQUIRE_ENV}
    env["CC"] = "false"  # a compiler that always fails
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=proj, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if "compiled engine was not built" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING: hazsan's compiled engine was not built")
    assert not list(proj.glob("sanitizer/**/*.so"))
    env[REQUIRE_ENV] = "1"
    r = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=proj, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "HAZSAN_REQUIRE_COMPILED is set and the compiled engine did not build" in r.stderr


def test_the_interpreted_engine_needs_no_cython(tmp_path):
    """Cython is a build requirement only: the interpreted engine runs where it is not installed."""
    code = ("import sys; sys.modules['cython'] = None; sys.modules['Cython'] = None\n"
            "from sanitizer.rules.driver import analyze\n"
            f"a = analyze([{str(EXAMPLES / 'reuse-in-flight.jsonl')!r}], engine='interpreted')\n"
            "print(a.summary['engine'], a.summary['by_rule'])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("interpreted {") and "reuse-in-flight" in r.stdout
