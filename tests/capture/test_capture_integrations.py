"""Framework recognition (SGLang), fork children, and `hazsan run`'s own argument handling.

SGLang itself is several GB and needs CUDA, so its recognition is exercised on a stand-in package
with the same module paths, class names and attributes as SGLang 0.5.23
(sglang/srt/distributed/device_communicators/pynccl_allocator.py: SymmetricMemoryContext with
.group_coordinator; sglang/srt/managers/scheduler.py: Scheduler.run_batch(batch) with
batch.forward_mode, batch.reqs and batch.extend_num_tokens; the speculative decode's token
count is tested on the real SGLang, tests/examples/test_sglang_step_tokens.py). What is tested is
that the post-import hooks fire when the program imports those modules, and what they record.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# these tests read the trace lines by hand: capture writes JSON Lines here (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("jsonl_capture")

pytest.importorskip("torch")

STAND_IN = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/distributed/__init__.py": "",
    "sglang/srt/distributed/device_communicators/__init__.py": "",
    "sglang/srt/distributed/device_communicators/pynccl_allocator.py": textwrap.dedent('''
        from contextlib import nullcontext

        class GroupCoordinator:
            def __init__(self, group_name):
                self.group_name = group_name
                self.unique_name = group_name + ":0"
                self.pynccl_comm = object()

        class SymmetricMemoryContext:
            def __init__(self, group_coordinator):
                self.group_coordinator = group_coordinator
            def __enter__(self):
                return self
            def __exit__(self, exc_type, exc_val, exc_tb):
                self._register_segments_for_comm()
                return False
            def _register_segments_for_comm(self):
                pass

        def use_symmetric_memory(group_coordinator, disabled=False):
            return nullcontext() if disabled else SymmetricMemoryContext(group_coordinator)
    '''),
    "sglang/srt/managers/__init__.py": "",
    "sglang/srt/managers/scheduler.py": textwrap.dedent('''
        import enum

        class ForwardMode(enum.IntEnum):
            EXTEND = 1
            DECODE = 2
            IDLE = 3

            def is_decode(self):
                return self == ForwardMode.DECODE

            def is_idle(self):
                return self == ForwardMode.IDLE

        class Batch:
            def __init__(self, mode, n, extend_num_tokens=None):
                self.forward_mode, self.reqs = mode, list(range(n))
                self.extend_num_tokens = extend_num_tokens

        class Scheduler:
            def run_batch(self, batch):
                return len(batch.reqs)
    '''),
}

SERVER = textwrap.dedent('''
    import torch
    from sglang.srt.distributed.device_communicators.pynccl_allocator import (
        GroupCoordinator, use_symmetric_memory)
    from sglang.srt.managers.scheduler import Batch, ForwardMode, Scheduler

    tp = GroupCoordinator("tp")
    s = Scheduler()
    print(s.run_batch(Batch(ForwardMode.EXTEND, 3, extend_num_tokens=42)))
    for _ in range(2):
        s.run_batch(Batch(ForwardMode.DECODE, 5))
        with use_symmetric_memory(tp):
            out = torch.empty(256)
        with use_symmetric_memory(tp, disabled=True):
            plain = torch.empty(256)
''')


def load(path):
    with open(path, "rb") as f:
        return [json.loads(line) for line in f]


def test_sglang_scopes_and_steps_recognised(tmp_path):
    for rel, text in STAND_IN.items():
        p = tmp_path / "pkgs" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    (tmp_path / "server.py").write_text(SERVER)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(tmp_path / "t"), PYTHONPATH=str(tmp_path / "pkgs"))
    out = subprocess.run([sys.executable, "server.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "3"                       # the wrapped method's result
    (path,) = (tmp_path / "t").iterdir()
    events = load(path)[1:]
    assert not [e for e in events if e["ev"] == "hook_error"]
    steps = [(e["n"], e.get("phase"), e.get("tokens")) for e in events if e["ev"] == "step"]
    # tokens: the forward's token count (a prefill's new tokens; one per request in a plain decode)
    assert steps == [(0, "extend", 42), (1, "decode", 5), (2, "decode", 5)]
    scopes = [(e["enter"], e["pool"], e["comm"]) for e in events if e["ev"] == "scope"]
    assert scopes == [(True, "symm", "tp"), (False, "symm", "tp")] * 2   # disabled: no scope
    (window,) = [e for e in events if e["ev"] == "window"]
    allocs = [e for e in events if e["ev"] == "alloc" and e.get("shape") == [256]]
    in_window = [window["addr"] <= e["addr"] < window["addr"] + window["size"] for e in allocs]
    assert in_window == [True, False, True, False]
    # step 2's output is placed while step 1's is still alive (the caching-allocator model)
    assert [allocs[0]["addr"] - window["addr"], allocs[2]["addr"] - window["addr"]] == [0, 1024]


FORK = textwrap.dedent('''
    import multiprocessing as mp, os, sys
    import torch

    def child(q):
        y = torch.zeros(55)
        q.put(os.getpid())

    if __name__ == "__main__":
        keep = torch.ones(77)
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,))
        p.start(); pid = q.get(timeout=60); p.join()
        after = torch.ones(99)
        print(os.getpid(), pid)
''')


def test_fork_child_writes_its_own_trace(tmp_path):
    from sanitizer.rules.driver import analyze
    (tmp_path / "fork.py").write_text(FORK)
    env = dict(os.environ, HAZSAN="1", HAZSAN_DIR=str(tmp_path / "t"))
    out = subprocess.run([sys.executable, "fork.py"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    parent_pid, child_pid = map(int, out.stdout.split())
    parent = load(tmp_path / "t" / f"pid{parent_pid}.jsonl")
    child = load(tmp_path / "t" / f"pid{child_pid}.jsonl")
    shapes = lambda evs: [e.get("shape") for e in evs if e["ev"] == "alloc"]   # noqa: E731
    assert [55] not in shapes(parent[1:]) and [99] in shapes(parent[1:])
    assert [55] in shapes(child[1:]) and [99] not in shapes(child[1:])
    inherited = [e for e in child[1:] if e["ev"] == "alloc" and e["op"] == "inherited-by-fork"]
    assert any(e["size"] == 77 * 4 for e in inherited)        # the parent's live block, declared again
    a = analyze([tmp_path / "t"])
    assert not a.errors, a.errors


def test_run_without_command_or_into_used_dir_is_a_usage_error(tmp_path):
    base = [sys.executable, "-m", "sanitizer", "run"]
    out = subprocess.run(base + ["--dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no command" in out.stderr
    (tmp_path / "rank0.jsonl").write_text('{"hazsan": 1, "rank": 0}\n')
    out = subprocess.run(base + ["--dir", str(tmp_path), "--", sys.executable, "-c", "pass"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--overwrite" in out.stderr
    assert (tmp_path / "rank0.jsonl").exists()
    # --overwrite clears it; a command that writes no trace is exit 2 with an explanation
    out = subprocess.run(base + ["--dir", str(tmp_path), "--overwrite", "--", sys.executable, "-c", "pass"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no trace was written" in out.stderr
    assert not (tmp_path / "rank0.jsonl").exists()


def test_run_exit_code_follows_check(tmp_path):
    prog = tmp_path / "p.py"
    prog.write_text("import os, tempfile, torch, torch.distributed as dist, sanitizer\n"
                    "dist.init_process_group('gloo', init_method='file://' + os.path.join(tempfile.mkdtemp(), 'r'),\n"
                    "                        rank=0, world_size=1)\n"
                    "with sanitizer.symmetric_scope('tp'):\n"
                    "    t = torch.ones(64) * 2\n"           # a transient in the window, freed: an error,
                    "    dist.all_reduce(torch.ones(4))\n"  # for a collective runs while it lives
                    "    del t\n"
                    "dist.destroy_process_group()\n")
    cmd = [sys.executable, "-m", "sanitizer", "run", "--dir", str(tmp_path / "t"), "--format", "json"]
    out = subprocess.run(cmd + ["--", sys.executable, str(prog)], capture_output=True, text=True, timeout=90)
    assert out.returncode == 1, out.stderr                   # the latent hazard fails at the default --fail-on
    assert {f["rule"] for f in json.loads(out.stdout)["findings"]} == {"transient-in-window"}
    out = subprocess.run(cmd + ["--overwrite", "--rule", "reuse-in-flight", "--", sys.executable, str(prog)],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr                   # narrowed to another rule: nothing
    assert Path(tmp_path / "t").is_dir()
