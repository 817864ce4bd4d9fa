"""pytest plugin: hazard checks in CI, test by test (`pytest --hazsan`).

Registered through the `pytest11` entry point, so every pytest run of an environment with hazsan
loads it; it does nothing unless asked for (`--hazsan`, or `hazsan = true` in the ini file).
Importing it imports nothing beyond pytest, the standard library and hazsan's allow-list reader.

What it does when asked:

* capture on in the pytest process (and, through HAZSAN=1 in the environment, in every process a
  test starts: rank processes, pytest-xdist workers);
* one trace folder per test, `<dir>/tests/<worker>-<n>-<test>/`: the pytest process switches to a
  new trace file there when the test's setup starts (the live blocks and windows re-declared at its
  top, so it reads on its own) and marks the test as step n; HAZSAN_DIR points there, so the rank
  processes the test spawns write their rank files next to it;
* after the test's call phase the folder is analysed (`hazsan check`'s engine, leniently: a trace cut
  at a test boundary is not the test's fault). Findings at or above `--hazsan-fail-on` fail the test,
  with the report (rule, both stacks, the colliding collective) as its failure text; findings that
  appear only during teardown make a teardown error. After the teardown the pytest process ends the
  test's file (its `end` record) and switches back to the session's folder before the last analysis,
  so a clean test's traces are complete; during the call phase its own file is still being written
  and is read as such. A file whose process still runs (a helper such as multiprocessing's resource
  tracker) is read up to its last flush; one whose process is gone without its end record (a rank
  the test killed) makes the test's capture INCOMPLETE, named in the terminal summary;
* the level is `full` (capture's default everywhere) unless --hazsan-level, the ini key or
  $HAZSAN_LEVEL say otherwise: every op's reads and writes are recorded, so a read of an
  asynchronous collective's output before its wait fails the test;
* accepted findings: `@pytest.mark.hazsan_allow(rule=..., site=..., reason=...)` on a test, and an
  allow-list file (`--hazsan-allow FILE`, TOML/JSON `[[allow]]` tables with rule, site, test,
  reason) for the session. `site` is an fnmatch pattern matched against every call site of the
  finding (the block's, the op's, the access's, and their stacks) and against its tail, so
  "test_x.py:12" matches "tests/test_x.py:12:test_fn";
* the terminal summary lists the findings per test (with -v every captured test).

Each test's outcome for hazsan travels in its teardown report's `user_properties` (key "hazsan",
a JSON string), which is how pytest-xdist workers hand it to the controller.
"""
from __future__ import annotations

import json
import os
import re
import time

import pytest

from sanitizer.allowlist import Allowance, AllowListError, load_allow_list

ENV_SESSION_DIR = "HAZSAN_PYTEST_DIR"   # the session folder, handed to xdist workers
FAIL_ON = ("error", "warning")
_THRESHOLD = {"error": ("error",), "warning": ("error", "warning")}
# the environment the session sets for itself and the processes tests start; restored at unconfigure
_SESSION_ENV = (ENV_SESSION_DIR, "HAZSAN", "HAZSAN_DIR", "HAZSAN_STACKS", "HAZSAN_LEVEL", "HAZSAN_RUN_ID")
# per test: what hazsan found in it (pytest's own per-item store, gone with the item)
VERDICT = pytest.StashKey["HazardVerdict"]()


def pytest_addoption(parser):
    group = parser.getgroup("hazsan", "hazsan memory-allocation hazard checks")
    group.addoption("--hazsan", action="store_true", default=None,
                    help="capture every test (and the processes it starts) and fail tests with hazards")
    group.addoption("--hazsan-fail-on", choices=FAIL_ON, default=None,
                    help="lowest severity that fails a test (default: error)")
    group.addoption("--hazsan-allow", action="append", default=None, metavar="FILE",
                    help="allow-list file (TOML or JSON, [[allow]] rule/site/test/reason) for the session")
    group.addoption("--hazsan-dir", default=None, metavar="DIR",
                    help="where the traces go (default: hazsan-traces/pytest-<time>-<pid>)")
    group.addoption("--hazsan-stacks", choices=("none", "site", "full"), default=None,
                    help="call-site detail recorded (default: full, so reports show both stacks)")
    group.addoption("--hazsan-level", choices=("alloc", "full"), default=None,
                    help="what is recorded, as HAZSAN_LEVEL (default: $HAZSAN_LEVEL, else full); full "
                         "records every op's reads and writes, so unordered-access covers kernels (a read "
                         "before an asynchronous collective's wait)")
    parser.addini("hazsan", "capture every test with hazsan (as --hazsan)", type="bool", default=False)
    parser.addini("hazsan_fail_on", "lowest severity that fails a test (error or warning)", default="error")
    parser.addini("hazsan_allow", "allow-list files for the session", type="paths", default=[])
    parser.addini("hazsan_dir", "where the traces go", default="")
    parser.addini("hazsan_level", "what is recorded: alloc or full (as --hazsan-level)", default="")


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "hazsan_allow(rule=None, site=None, reason=None): accept hazsan findings of this rule "
        "and/or call site in this test")
    if not (config.getoption("hazsan") or config.getini("hazsan")):
        return
    try:
        plugin = HazsanSession(config)
    except AllowListError as exc:
        raise pytest.UsageError(f"hazsan: {exc}") from None
    config.pluginmanager.register(plugin, "hazsan-session")


# ------------------------------------------------------------------------------- allowances


def marker_allowances(item) -> list[Allowance]:
    out = []
    for m in item.iter_markers("hazsan_allow"):
        kw = dict(m.kwargs)
        if m.args:
            kw.setdefault("rule", m.args[0])
        unknown = set(kw) - {"rule", "site", "reason"}
        if unknown:
            raise AllowListError(f"{item.nodeid}: hazsan_allow takes rule=, site=, reason= (not {sorted(unknown)})")
        out.append(Allowance(kw.get("rule"), kw.get("site"), None, kw.get("reason"), f"{item.nodeid} marker"))
    return out


# ------------------------------------------------------------------------------- the session


def _slug(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid.split("/")[-1])[:80].strip("_") or "test"


class HazardVerdict:
    """What hazsan found in one test (built in the process that ran it)."""

    def __init__(self, nodeid, directory):
        self.nodeid = nodeid
        self.directory = directory
        self.seen: set = set()          # findings already reported (call phase) by identity
        self.failing: dict[str, int] = {}
        self.allowed: dict[str, int] = {}
        self.below: dict[str, int] = {}   # findings under the --hazsan-fail-on threshold
        self.events = 0
        self.files: list[str] = []
        self.ranks: list[int] = []
        self.warnings = 0
        self.incomplete: list[str] = []   # why the test's capture is incomplete (render.incomplete)
        self.running: list[str] = []      # files whose process still ran when analysed

    def record(self) -> str:
        return json.dumps({"nodeid": self.nodeid, "dir": self.directory, "failing": self.failing,
                           "allowed": self.allowed, "below": self.below, "events": self.events,
                           "files": self.files, "ranks": self.ranks, "warnings": self.warnings,
                           "incomplete": self.incomplete, "running": self.running})


class HazsanSession:
    def __init__(self, config):
        self.config = config
        fail_on = config.getoption("hazsan_fail_on") or config.getini("hazsan_fail_on") or "error"
        if fail_on not in FAIL_ON:
            raise AllowListError(f"hazsan_fail_on must be error or warning, got {fail_on!r}")
        self.threshold = _THRESHOLD[fail_on]
        allow_files = list(config.getoption("hazsan_allow") or []) + [str(p) for p in config.getini("hazsan_allow")]
        self.allowances = [a for f in allow_files for a in load_allow_list(f)]
        self.worker = os.environ.get("PYTEST_XDIST_WORKER")
        self.is_worker = hasattr(config, "workerinput")
        self.dir = self._session_dir(config)
        self.index = 0
        self.in_test = False        # the pytest process writes into a test's folder
        self.records: list[dict] = []          # controller / single process: one per test
        # full (the plugin's default): every op is a launch with its reads and writes, so that a
        # read of a collective's output before its wait is seen; alloc (capture's default) records
        # no launches. Checked before the environment is touched: a usage error leaves it as it was.
        level = (config.getoption("hazsan_level") or config.getini("hazsan_level")
                 or os.environ.get("HAZSAN_LEVEL") or "full").strip().lower()
        if level not in ("alloc", "full"):
            raise AllowListError(f"hazsan_level must be alloc or full, got {level!r}")
        stacks = config.getoption("hazsan_stacks") or os.environ.get("HAZSAN_STACKS") or "full"
        os.makedirs(self.dir, exist_ok=True)
        self.saved_env = {k: os.environ.get(k) for k in _SESSION_ENV}
        self.idle_dir = os.path.join(self.dir, "_session")
        os.environ.update({ENV_SESSION_DIR: self.dir, "HAZSAN": "1", "HAZSAN_DIR": self.idle_dir,
                           "HAZSAN_STACKS": stacks, "HAZSAN_LEVEL": level})
        from sanitizer.capture.config import run_id
        run_id(os.environ)       # the session's run (inherited by xdist workers): it reports itself
        from sanitizer.capture.bootstrap import activate
        self.capture = activate(os.environ)

    def pytest_unconfigure(self, config):
        """Give the environment back as it was: a later session in the same process (pytester's
        in-process runs, an IDE's runner) must not inherit this one's HAZSAN settings."""
        for key, value in self.saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def _session_dir(self, config) -> str:
        inherited = os.environ.get(ENV_SESSION_DIR)
        if self.is_worker and inherited:
            return inherited
        chosen = config.getoption("hazsan_dir") or config.getini("hazsan_dir")
        if not chosen:
            chosen = os.path.join("hazsan-traces", f"pytest-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        return os.path.abspath(os.path.join(str(config.invocation_params.dir), chosen))

    # ------------------------------------------------------------------ per test

    @pytest.hookimpl(hookwrapper=True, tryfirst=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.index += 1
        name = f"{self.worker or 'main'}-{self.index:04d}-{_slug(item.nodeid)}"
        directory = os.path.join(self.dir, "tests", name)
        os.makedirs(directory, exist_ok=True)
        item.stash[VERDICT] = HazardVerdict(item.nodeid, directory)
        os.environ["HAZSAN_DIR"] = directory
        self.in_test = True
        cap = self.capture
        if cap is not None:
            from sanitizer.capture.rotate import rotate
            rotate(cap, directory)
            try:
                cap.mark_step(self.index, phase="test")
            except Exception as exc:
                cap.failed("pytest.step", exc)
        try:
            yield
        finally:
            self._leave_test()
            del item.stash[VERDICT]
            try:
                os.rmdir(directory)     # nothing was captured: no folder (`hazsan check DIR/*/` stays valid)
            except OSError:
                pass

    def _leave_test(self) -> None:
        """The test is over: its file ends (the `end` record) and the pytest process writes into
        the session's folder again."""
        if not self.in_test:
            return
        self.in_test = False
        os.environ["HAZSAN_DIR"] = self.idle_dir
        if self.capture is not None:
            from sanitizer.capture.rotate import rotate
            rotate(self.capture, self.idle_dir)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        rep = outcome.get_result()
        verdict = item.stash.get(VERDICT, None)
        if verdict is None or rep.when == "setup":
            return
        if rep.when == "teardown":
            self._leave_test()      # the test's own file complete before the last analysis
        try:
            text = self._judge(item, verdict)
        except AllowListError as exc:
            rep.outcome = "failed"
            rep.longrepr = f"hazsan: {exc}"
            return
        except Exception as exc:   # hazsan's own failure: say so, never break the test run
            rep.sections.append(("hazsan", f"hazsan could not analyse {verdict.directory}: "
                                           f"{type(exc).__name__}: {exc}"))
            return
        if text:
            if rep.when == "call" and rep.passed:
                rep.outcome = "failed"
                rep.longrepr = text
            elif rep.when == "teardown" and rep.passed:
                rep.outcome = "failed"
                rep.longrepr = "hazsan findings during teardown:\n" + text
            else:
                rep.sections.append(("hazsan findings", text))
        if rep.when == "teardown":
            if verdict.incomplete:
                rep.sections.append(("hazsan", f"INCOMPLETE capture in {verdict.directory}: "
                                               f"{'; '.join(verdict.incomplete)}"))
            rep.user_properties = [*rep.user_properties, ("hazsan", verdict.record())]

    def _judge(self, item, verdict: HazardVerdict) -> str | None:
        """Analyse the test's folder; return the report of new failing findings, or None."""
        from sanitizer.report.render import incomplete, render_text
        from sanitizer.rules.driver import Analysis, analyze

        own = None
        if self.capture is not None:
            self.capture.writer.flush()
            if self.in_test:           # the call phase: the test's file is still being written
                own = self.capture.writer.path
        from sanitizer.trace.schema import is_trace_name

        names = sorted(n for n in os.listdir(verdict.directory) if is_trace_name(n))
        if not names:
            return None
        live, running = _live_files(verdict.directory, names, own)
        analysis = analyze([verdict.directory], lenient=True, live=live)
        verdict.events = analysis.summary.get("events", 0)
        verdict.ranks = sorted(int(r) for r in analysis.summary.get("steps_by_rank", {}))
        verdict.files = names
        verdict.warnings = len(analysis.warnings)
        verdict.incomplete = incomplete(analysis.summary)
        verdict.running = running
        allow = marker_allowances(item) + self.allowances
        failing = []
        for f in analysis.findings:
            key = (f.rule, os.path.basename(f.file), f.line)
            if key in verdict.seen:
                continue
            verdict.seen.add(key)
            if any(a.accepts(f, item.nodeid) for a in allow):
                verdict.allowed[f.rule] = verdict.allowed.get(f.rule, 0) + 1
            elif f.severity in self.threshold:
                verdict.failing[f.rule] = verdict.failing.get(f.rule, 0) + 1
                failing.append(f)
            else:
                verdict.below[f.rule] = verdict.below.get(f.rule, 0) + 1
        if not failing:
            return None
        by_rule: dict[str, int] = {}
        for f in failing:
            by_rule[f.rule] = by_rule.get(f.rule, 0) + 1
        summary = dict(analysis.summary, by_rule=by_rule, findings=len(failing))
        report = render_text(Analysis(failing, summary, [], analysis.warnings))
        return f"{verdict_line(failing)}\n{report}hazsan: traces in {verdict.directory}"

    # ------------------------------------------------------------------ summary

    def pytest_runtest_logreport(self, report):
        if report.when != "teardown":
            return
        for key, value in getattr(report, "user_properties", ()):
            if key == "hazsan":
                try:
                    self.records.append(json.loads(value))
                except (TypeError, ValueError):
                    pass

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config):
        if self.is_worker:
            return
        tr = terminalreporter
        records = self.records
        tr.write_sep("=", "hazsan")
        verbose = config.getoption("verbose") > 0
        for r in records:
            lost = r.get("incomplete") or []
            found = r["failing"] or r["allowed"] or r["below"]
            if not (found or lost or verbose):
                continue
            ranks = ",".join(str(x) for x in r["ranks"]) or "-"
            tr.write_line(f"{r['nodeid']}: {r['events']} events, {len(r['files'])} trace(s), ranks {ranks}")
            for label, counts, markup in (("FAIL", r["failing"], {"red": True}),
                                          ("allowed", r["allowed"], {"yellow": True}),
                                          ("below --hazsan-fail-on", r["below"], {})):
                for rule, n in sorted(counts.items()):
                    tr.write_line(f"    {label}: {rule} x{n}", **markup)
            for why in lost:
                tr.write_line(f"    INCOMPLETE capture: {why}", yellow=True)
            if verbose:
                for name in r.get("running") or ():
                    tr.write_line(f"    still running when analysed: {name}")
        failed = sum(1 for r in records if r["failing"])
        partial = sum(1 for r in records if r.get("incomplete"))
        events = sum(r["events"] for r in records)
        tr.write_line(f"hazsan: {len(records)} test(s) captured, {events} events, "
                      f"{failed} failed on hazards"
                      + (f", {partial} with an INCOMPLETE capture" if partial else "")
                      + f"; traces in {self.dir}")
        try:
            with open(os.path.join(self.dir, "summary.json"), "w") as fh:
                json.dump({"tests": records}, fh, indent=1)
        except OSError:
            pass


def verdict_line(failing) -> str:
    """The first line of a failed test's report, which CI summaries show alone: what went wrong and
    where, `unordered-access at tests/test_x.py:20 (2 findings)`, and the other rules found."""
    from sanitizer.rules.findings import RULES

    first = sorted(failing, key=lambda f: (list(RULES).index(f.rule), f.rank, f.line))[0]
    same = sum(1 for f in failing if f.rule == first.rule)
    others = sorted({f.rule for f in failing} - {first.rule})
    line = f"{first.rule} at {first.headline_site() or '(unknown site)'} ({same} finding{'s' if same != 1 else ''})"
    return line + (f"; also {', '.join(others)}" if others else "")


def _live_files(directory: str, names: list[str], own: str | None) -> tuple[list[str], list[str]]:
    """(paths still being written, names of those written by another process still running).

    `own`: the pytest process's current file. Any other file names its writer's pid in its
    header: while that process runs (a helper such as multiprocessing's resource tracker, a server
    a fixture keeps), its file is read up to its last flush, not reported truncated."""
    from sanitizer.trace.reader import read_header

    live: list[str] = []
    running: list[str] = []
    me = os.getpid()
    for name in names:
        path = os.path.join(directory, name)
        if own is not None and os.path.abspath(path) == os.path.abspath(own):
            live.append(path)
            continue
        if not name.endswith((".jsonl", ".hzs")):
            continue
        header = read_header(path)
        pid = header.get("pid") if header else None
        if isinstance(pid, int) and pid != me and _running(pid):
            live.append(path)
            running.append(name)
    return live, running


def _running(pid: int) -> bool:
    """Whether process `pid` is alive (a zombie, killed and not yet reaped, is not)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (OSError, IndexError):
        return True
