"""`hazsan run --bisect` under `git bisect run` (issue 31, part 2): a real git repository made in the
test, whose history introduces a transient inside a symmetric scope at one commit among commits that
do not; the bisection, driven by hazsan's verdict alone, must name that commit.

The program is a small 2-rank decode loop on gloo over loopback (ranks started with multiprocessing's
spawn context; capture reaches them through the .pth, as in test_capture_release.py).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("torch")
if shutil.which("git") is None:
    pytest.skip("git is not installed", allow_module_level=True)

PROGRAM = r'''
import multiprocessing as mp
import os
import sys
import tempfile

STEPS = 2


def decode_step(pg, x):
    import torch.distributed as dist
    import sanitizer

    with sanitizer.symmetric_scope(pg):
        out = WINDOW_BODY
    TAIL
    return out, dist.all_reduce(out, async_op=True)


def worker(rank, world_size, init):
    import torch
    import torch.distributed as dist
    import sanitizer

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    outputs = []          # every step's output stays alive: the window layout is the same on each rank
    pending = None
    for step in range(STEPS):
        sanitizer.step(step)
        x = torch.full((1024,), float(rank + step + 1))
        # this step's window work runs while the previous step's all-reduce is still in flight,
        # as a serving stack overlaps them: a transient there is exposed to peers' writes
        out, work = decode_step(dist.group.WORLD, x)
        if pending is not None:
            pending.wait()
        pending = work
        outputs.append(out)
    pending.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    init = "file://" + os.path.join(tempfile.mkdtemp(), "rendezvous")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, 2, init)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(p.exitcode for p in procs))
'''

CLEAN = {"WINDOW_BODY": "torch_empty_like(x)", "TAIL": "out.copy_(x)"}
# The regression: the residual is computed inside the window; `x * 2` is a transient there.
TRANSIENT = {"WINDOW_BODY": "x * 2 - x", "TAIL": "pass"}

# (message, how the program changes): the regression lands at index BAD.
HISTORY = [
    ("decode loop: all-reduce from the symmetric window", dict(CLEAN)),
    ("docs: say what the loop does", dict(CLEAN, doc=True)),
    ("decode: three steps", dict(CLEAN, doc=True, steps=3)),
    ("decode: compute the residual in place", dict(TRANSIENT, doc=True, steps=3)),
    ("decode: four steps", dict(TRANSIENT, doc=True, steps=4)),
    ("style: name the world size", dict(TRANSIENT, doc=True, steps=4, named=True)),
]
BAD = 3


def program(change: dict) -> str:
    text = PROGRAM.replace("WINDOW_BODY", change["WINDOW_BODY"].replace("torch_empty_like",
                                                                         "__import__('torch').empty_like"))
    text = text.replace("TAIL", change["TAIL"])
    if change.get("doc"):
        text = '"""A 2-rank decode loop: each step all-reduces a window buffer."""\n' + text
    if change.get("steps"):
        text = text.replace("STEPS = 2", f"STEPS = {change['steps']}")
    if change.get("named"):
        text = text.replace("args=(r, 2, init)", "args=(r, WORLD_SIZE, init)").replace(
            "STEPS =", "WORLD_SIZE = 2\nSTEPS =", 1)
    return text


def git(repo, *args) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com")
    out = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (args, out.stdout, out.stderr)
    return out.stdout


@pytest.fixture()
def repo(tmp_path):
    repo = tmp_path / "server"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    commits = []
    for message, change in HISTORY:
        (repo / "decode.py").write_text(program(change))
        git(repo, "add", "decode.py")
        git(repo, "commit", "-q", "-m", message)
        commits.append(git(repo, "rev-parse", "HEAD").strip())
    return repo, commits


def step_command(traces, *extra) -> list[str]:
    return [sys.executable, "-m", "sanitizer", "run", "--bisect", "--dir", str(traces), *extra,
            "--", sys.executable, "decode.py"]


# git bisect run over the history: one 2-rank program per step (about 10 s): `make test-long`
@pytest.mark.long
def test_git_bisect_run_names_the_commit_that_put_a_transient_in_the_window(repo, tmp_path):
    repo, commits = repo
    git(repo, "bisect", "start", commits[-1], commits[0])
    out = git(repo, "bisect", "run", *step_command(tmp_path / "traces", "--rule", "transient-in-window"))
    first_bad = git(repo, "rev-parse", "refs/bisect/bad").strip()
    assert first_bad == commits[BAD], out
    assert f"{commits[BAD]} is the first bad commit" in out
    steps = [line for line in out.splitlines() if line.startswith("hazsan bisect: ")]
    assert steps, out
    for line in steps:
        if ": bad (" in line:
            assert "transient-in-window" in line and "first: transient-in-window at decode.py:" in line
            assert ":decode_step (rank " in line
        else:
            assert ": good (no finding)" in line, line
    git(repo, "bisect", "reset")


def test_step_exit_codes_and_the_rule_filter(repo, tmp_path):
    repo, commits = repo
    traces = tmp_path / "traces"
    # the bad commit: bad on its rule (a warning: --rule makes the rule's severity the threshold);
    # clean when the verdict is narrowed to another rule
    bad = subprocess.run(step_command(traces, "--rule", "transient-in-window"), cwd=repo,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1, bad.stderr
    (line,) = bad.stdout.splitlines()
    assert line.startswith(f"hazsan bisect: {commits[-1][:7]}") and ": bad (transient-in-window: " in line
    other = subprocess.run(step_command(traces, "--rule", "reuse-in-flight"), cwd=repo,
                           capture_output=True, text=True, timeout=300)
    assert other.returncode == 0 and ": good (no finding)" in other.stdout, other.stderr
    # a command that writes no trace: skip this commit
    skip = subprocess.run([sys.executable, "-m", "sanitizer", "run", "--bisect", "--dir", str(traces),
                           "--", sys.executable, "-c", "pass"], cwd=repo, capture_output=True, text=True,
                          timeout=120)
    assert skip.returncode == 125 and "skip (unusable capture: no trace was written)" in skip.stdout
    # a command that fails (a commit that does not run) and leaves no finding: skip it too
    crash = subprocess.run([sys.executable, "-m", "sanitizer", "run", "--bisect", "--dir", str(traces),
                            "--", sys.executable, "-c", "import sys, torch; sys.exit(3)"], cwd=repo,
                           capture_output=True, text=True, timeout=120)
    assert crash.returncode == 125, (crash.stdout, crash.stderr)
    assert "skip (unusable capture: the command exited with status 3" in crash.stdout
