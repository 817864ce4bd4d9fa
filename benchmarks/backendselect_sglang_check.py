#!/usr/bin/env python3
"""mode_free_collectives_probe.py's BackendSelect kernels on the real SGLang server: do they see
every collective capture's dispatch mode records, in every SGLang process, in inference mode?

A hook (HOOK below) registers, in each process that has BSPROBE=1, the probe's BackendSelect
kernels (mode_free_collectives_probe.register) once SGLang is imported (torch is by then), and
appends the outermost calls, one name a line, to LOG/<pid>.txt (line-buffered: schedulers are
SIGKILLed at shutdown). `install` puts it in a venv as a .pth line (SGLang's scheduler processes
are spawned: a .pth is what reaches them); `compare` matches each rank's trace (header pid) with
its process's log; `uninstall` removes the .pth line again.

    .venv/bin/python benchmarks/backendselect_sglang_check.py install .venv-sglang
    BSPROBE=1 .venv-sglang/bin/python examples/sglang_e2e/run.py --only engine-tp2-ngram-alloc --work /tmp/sg
    .venv/bin/python benchmarks/backendselect_sglang_check.py compare /tmp/sg/traces/engine-tp2-ngram-alloc
    .venv/bin/python benchmarks/backendselect_sglang_check.py uninstall .venv-sglang

With BSPROBE_FLOOR=<the probe's .so> (native_alloc_probe.py builds it) instead, the hook is the
mode-free design's floor in every SGLang process: the probe's native allocation hook (every CPU
allocation and free with its call site, read back packed every 20 ms) and the BackendSelect
kernels; run the bare configurations with and without it and compare their batch CPU time. Each
process rewrites LOG/floor-<pid>.txt about every second with what it read (records, dropped,
collectives). The hook also starts when vLLM is imported, so the same lines installed in
.venv-e2e put the floor in vLLM's processes (examples/vllm_e2e/run.py --only eager-bare):

    (make the probe .so: .venv/bin/python benchmarks/native_alloc_probe.py, or its load_inline line)
    .venv/bin/python benchmarks/backendselect_sglang_check.py install .venv-sglang
    BSPROBE=1 BSPROBE_FLOOR=/tmp/hazsan-native-probe/hazsan_native_probe.so \
        .venv-sglang/bin/python examples/sglang_e2e/run.py --only engine-tp1-bare --work /tmp/sgf
"""
from __future__ import annotations

import argparse
import difflib
import glob
import os
import sys
import tempfile
from collections import Counter

LOG = os.path.join(tempfile.gettempdir(), "hazsan-backendselect-log")
PTH = "zz_hazsan_backendselect_probe.pth"
HOOK = r'''
import os, sys
LOG, BENCHMARKS = %r, %r
class _LineLog:
    """A log whose append writes the name as a line of this process's file (line-buffered)."""
    def __init__(self):
        os.makedirs(LOG, exist_ok=True)
        self.out = open(os.path.join(LOG, f"{os.getpid()}.txt"), "a", buffering=1)
    def append(self, name):
        self.out.write(name + "\n")
def _floor(so):
    """The mode-free design's floor: native_alloc_probe.py's allocation hook on torch's CPU
    allocator (every allocation and free, with its call site), its records read back packed by a
    thread every 20 ms as a recorder's writer would, and the collectives' names kept in a list."""
    import importlib.util, threading, time
    spec = importlib.util.spec_from_file_location("hazsan_native_probe", so)
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    names = []
    if not probe.install(1 << 20):
        raise RuntimeError("the allocation hook is already installed in this process")
    def drain():
        # what it read, rewritten about every second (schedulers are SIGKILLed: the last second
        # may be missing): allocations and frees, records dropped, collectives seen
        records = collectives = rounds = 0
        out = os.path.join(LOG, f"floor-{os.getpid()}.txt")
        os.makedirs(LOG, exist_ok=True)
        while True:
            time.sleep(0.02)
            packed, _, dropped = probe.drain_packed()
            records += len(packed) // 32
            collectives += len(names)
            del names[:]
            rounds += 1
            if rounds %% 50 == 0:
                with open(out, "w") as f:
                    f.write(f"records {records} dropped {dropped} collectives {collectives}\n")
    def start():
        threading.Thread(target=drain, name="floor-drain", daemon=True).start()
    start()
    # a forked child (vLLM's workers) inherits the hook but not the thread (the probe has no
    # at-fork handler for its lock: a fork while the drain holds it would hang the child)
    os.register_at_fork(after_in_child=start)
    return names
class _WhenServer:
    done = False
    def find_spec(self, name, path=None, target=None):
        torch = sys.modules.get("torch")
        if not _WhenServer.done and name.startswith(("sglang", "vllm")) and hasattr(torch, "ops") and hasattr(torch, "library"):
            _WhenServer.done = True
            try:
                sys.path.insert(0, BENCHMARKS)
                from mode_free_collectives_probe import register
                sys.path.remove(BENCHMARKS)
                floor = os.environ.get("BSPROBE_FLOOR")
                log = _floor(floor) if floor else _LineLog()
                # kept alive: destroying the Library objects would unregister the kernels
                sys.modules["_hazsan_backendselect_probe"] = register(log, "backendselect")
            except Exception as exc:
                print("backendselect probe: not registered:", exc, file=sys.stderr)
        return None
# once per process: site.py processes a venv's .pth files twice (from venv() and again from
# main()), and a second finder would register the kernels again over the first ones
if not any(type(m).__name__ == "_WhenServer" for m in sys.meta_path):
    sys.meta_path.insert(0, _WhenServer())
''' % (LOG, os.path.dirname(os.path.abspath(__file__)))


def site_packages(venv: str) -> str:
    paths = glob.glob(os.path.join(venv, "lib", "python3*", "site-packages"))
    if len(paths) != 1:
        sys.exit(f"{venv}: no single lib/python3*/site-packages")
    return paths[0]


def install(venv: str) -> None:
    os.makedirs(LOG, exist_ok=True)
    for f in glob.glob(os.path.join(LOG, "*.txt")):
        os.unlink(f)
    hook = os.path.join(LOG, "hook.py")
    with open(hook, "w") as fh:
        fh.write(HOOK)
    line = (f"import os; exec(open({hook!r}).read(), {{'__name__': 'hazsan_backendselect_probe'}}) "
            "if os.environ.get('BSPROBE') else None\n")
    with open(os.path.join(site_packages(venv), PTH), "w") as fh:
        fh.write(line)
    print(f"installed in {site_packages(venv)}; logs go to {LOG}")


def uninstall(venv: str) -> None:
    path = os.path.join(site_packages(venv), PTH)
    if os.path.exists(path):
        os.unlink(path)
    print(f"removed {path}")


def compare(folder: str) -> int:
    from sanitizer.trace.reader import open_trace
    ok = True
    for path in sorted(glob.glob(os.path.join(folder, "rank*.*"))):
        tf = open_trace(path)
        events = [ev for _, ev in tf.events() if isinstance(ev, dict)]
        pid = tf.header.get("pid")
        recorded = [str(e.get("op")) for e in events if e.get("ev") == "coll"]
        log_path = os.path.join(LOG, f"{pid}.txt")
        seen = open(log_path).read().split() if os.path.exists(log_path) else []
        missed = Counter(recorded) - Counter(seen)
        ok &= not missed and bool(seen)
        print(f"{os.path.basename(path)} (pid {pid}): capture recorded {len(recorded)} collectives "
              f"{dict(Counter(recorded))}")
        print(f"  BackendSelect kernels saw {len(seen)} outermost calls {dict(Counter(seen))}")
        print(f"  missed by the kernels: {dict(missed) or 'none'}")
        diff = difflib.SequenceMatcher(a=recorded, b=seen, autojunk=False).get_opcodes()
        for tag, i1, i2, j1, j2 in diff:
            if tag != "equal":
                where = "at the end" if i1 == len(recorded) else f"at capture's collective {i1}"
                print(f"  {tag} {where}: capture {recorded[i1:i2]}, kernels {seen[j1:j2]}")
        if all(tag == "equal" for tag, *_ in diff):
            print("  the same calls in the same order")
    print("verdict:", "nothing capture records is missed" if ok else "MISSED (see above)")
    return 0 if ok else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("install", "uninstall"):
        sub.add_parser(name).add_argument("venv")
    sub.add_parser("compare").add_argument("traces")
    args = p.parse_args()
    if args.cmd == "install":
        install(args.venv)
    elif args.cmd == "uninstall":
        uninstall(args.venv)
    else:
        return compare(args.traces)
    return 0


if __name__ == "__main__":
    sys.exit(main())
