"""Capture's cost on the real vLLM server, batch against batch (issue 30): every configuration's
server started once and kept up, their batches interleaved.

`examples/vllm_e2e/run.py --rounds` starts a fresh server per configuration and round; on this
2-core machine a bare batch moves by 30-50% between such runs (the machine's other load, where the
OS puts each process), more than the capture cost being measured. Here each configuration gets one
long-lived `vllm.LLM` (TP=2, eager by default, the tiny random Llama of run.py: the same workload and
environment, from run.py's `config_env` and `make_llm`), and the parent asks them for one batch in
turn (the order rotated every round), pausing between turns so that the last server's workers are
idle again (vLLM's readers busy-loop for 1 s after their last message, then wait on a socket).
Drift of the machine then reaches every configuration of a round alike, and each round gives a
ratio against the bare batch next to it.

Per batch: the CPU time of the server's every process (the driver, the EngineCore and both
workers; every thread's on-CPU time from /proc/PID/task/TID/schedstat, in nanoseconds) during
`generate()`, as the issue measures it, and its wall time. Printed per
configuration: the median of the per-round ratios against the same round's bare batch, their
quartiles, and the ratio of the best (lowest) batch of each ("best of N", the issue's method).
Every batch's tokens must equal the bare server's; at the end the captured servers are shut down
and their traces checked as run.py checks them (clean, complete, steps and collectives).

    .venv-e2e/bin/python benchmarks/vllm_interleaved.py --rounds 20
    .venv-e2e/bin/python benchmarks/vllm_interleaved.py --only eager-bare,eager-native --rounds 40 --json out.json
    .venv-e2e/bin/python benchmarks/vllm_interleaved.py --only eager-native,eager-native+HAZSAN_STACKS=none

A configuration is one of run.py's, optionally with more environment for its server (NAME+VAR=VALUE...:
a capture setting's cost, side by side with the default).

The --json file has every batch's figures and its CLOCK_MONOTONIC window, and each server's process
ids: a profile taken meanwhile (`perf record -a -k CLOCK_MONOTONIC`) splits by them.

Exit status 0 when every check passed (identical tokens, traces clean and complete), 1 otherwise.
A measurement aid: nothing here is part of hazsan.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "examples" / "vllm_e2e"))
import run as e2e  # noqa: E402  (examples/vllm_e2e/run.py: configurations, environment, model, checks)

DEFAULT = "eager-bare,eager-native,eager-full-native"


# --------------------------------------------------------------------------- a server's side
def serve(spec: dict) -> None:
    """Build the configuration's LLM, then for each line on stdin: `batch` runs one timed batch and
    answers one JSON line on the result descriptor; `quit` shuts the engine down."""
    import psutil
    out = os.fdopen(spec["fd"], "w", buffering=1)
    t0 = time.perf_counter()
    llm, batch, greedy, _ = e2e.make_llm(spec)
    me = psutil.Process()
    tree = [me, *me.children(recursive=True)]      # the EngineCore and the workers: fixed from here

    def cpu() -> list:
        # on-CPU seconds of every thread (/proc/PID/task/TID/schedstat, nanoseconds), per process
        # of the tree: the clock-tick resolution of cpu_times() (10 ms a process, 5 processes) is
        # ~8% of a 0.6 s batch
        out = []
        for p in tree:
            total = 0
            try:
                for tid in os.listdir(f"/proc/{p.pid}/task"):
                    try:
                        with open(f"/proc/{p.pid}/task/{tid}/schedstat") as f:
                            total += int(f.read().split()[0])
                    except (OSError, ValueError, IndexError):
                        pass       # a thread that ended meanwhile
            except OSError:
                pass
            out.append(total / 1e9)
        return out

    import vllm
    out.write(json.dumps({"ready": round(time.perf_counter() - t0, 1), "vllm": vllm.__version__,
                          "processes": len(tree), "pids": [q.pid for q in tree]}) + "\n")
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "batch":
            c, m, w = cpu(), time.monotonic(), time.perf_counter()
            outs = llm.generate(batch, greedy, use_tqdm=False)
            w, by = time.perf_counter() - w, [b - a for a, b in zip(c, cpu())]
            out.write(json.dumps({"wall": w, "cpu": sum(by), "cpu_by_process": by, "monotonic": [m, time.monotonic()],
                                  "tokens": [list(o.outputs[0].token_ids) for o in outs]}) + "\n")
        elif cmd == "quit":
            break
    llm.llm_engine.engine_core.shutdown(timeout=120)
    out.write(json.dumps({"done": True}) + "\n")


# --------------------------------------------------------------------------- the parent
class Server:
    """One configuration's long-lived server process, spoken to over its stdin and a result pipe."""

    def __init__(self, name: str, work: Path, model: Path, extra_env: dict):
        self.name = name
        eager, level, spec, kernels = e2e.CONFIGS[name]
        env = e2e.config_env(name, work)
        env.update(extra_env)
        read, write = os.pipe()
        payload = {"model": str(model), "eager": eager, "spec": spec, "fd": write}
        self.log = open(work / f"interleaved-{name}.log", "w")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve", json.dumps(payload)],
                                     env=env, cwd=work, stdin=subprocess.PIPE, stdout=self.log,
                                     stderr=subprocess.STDOUT, pass_fds=(write,), text=True)
        os.close(write)
        self.results = os.fdopen(read, "r")

    def answer(self, timeout: float) -> dict:
        line = self.results.readline()
        if not line:
            self.proc.wait(timeout=timeout)
            raise RuntimeError(f"{self.name}: the server exited ({self.proc.returncode}); "
                               f"see {self.log.name}")
        return json.loads(line)

    def ask(self, cmd: str, timeout: float = 900) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self.answer(timeout)

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.ask("quit")
                self.proc.wait(timeout=180)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.log.close()


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], q[1], q[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default=str(ROOT / "build" / "vllm-interleaved"))
    ap.add_argument("--only", default=DEFAULT, help=f"comma-separated configurations of run.py (default {DEFAULT}); "
                                                    "each group's bare one is added")
    ap.add_argument("--rounds", type=int, default=20, help="batches per configuration (default 20)")
    ap.add_argument("--pause", type=float, default=1.2,
                    help="seconds between two turns, so the last server's workers stop spinning (default 1.2)")
    ap.add_argument("--json", help="write every batch's figures here")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        serve(json.loads(args.serve))
        return 0
    names = [n for n in args.only.split(",") if n]
    extra_env: dict[str, dict] = {}
    group: dict[str, str] = {}
    for n in names:
        base, *pairs = n.split("+")      # a variant: NAME+VAR=VALUE+...: run.py's NAME with more environment
        if base not in e2e.CONFIGS or any("=" not in kv for kv in pairs):
            ap.error(f"unknown configuration {n!r}; known: {', '.join(e2e.CONFIGS)} (each may take +VAR=VALUE)")
        e2e.CONFIGS.setdefault(n, e2e.CONFIGS[base])
        extra_env[n] = dict(kv.split("=", 1) for kv in pairs)
        group[n] = e2e.group_level(base)[0]
    for n in list(names):
        bare = f"{group[n]}-bare"
        if bare not in names:
            names.insert(0, bare)
            group[bare], extra_env[bare] = group[n], {}
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny-llama"
    e2e.make_model(model)
    problems: list[str] = []
    servers: dict[str, Server] = {}
    batches: dict[str, list[dict]] = {n: [] for n in names}
    version = "?"
    pids: dict[str, list[int]] = {}
    t_all = time.perf_counter()
    try:
        for n in names:        # one at a time: start-ups are not measured, and together they thrash
            servers[n] = Server(n, work, model, extra_env[n])
            ready = servers[n].answer(900)
            version = ready["vllm"]
            pids[n] = ready["pids"]
            print(f"[{n}] up in {ready['ready']} s ({ready['processes']} processes: {ready['pids']})", flush=True)
        time.sleep(args.pause)
        for rnd in range(args.rounds):
            order = names[rnd % len(names):] + names[:rnd % len(names)]
            for n in order:
                r = servers[n].ask("batch")
                r["round"] = rnd
                batches[n].append(r)
                time.sleep(args.pause)
            line = "  ".join(f"{n} {batches[n][-1]['cpu']:.3f}/{batches[n][-1]['wall']:.3f}" for n in names)
            print(f"round {rnd + 1:3}: CPU/wall s  {line}", flush=True)
    finally:
        for s in servers.values():
            try:
                s.stop()
            except Exception as exc:
                problems.append(f"{s.name}: shutdown: {exc}")
    # tokens: every batch equals the bare server's first
    for n in names:
        bare = batches[f"{group[n]}-bare"]
        if not bare or not batches[n]:
            problems.append(f"{n}: no batches")
            continue
        want = bare[0]["tokens"]
        if any(b["tokens"] != want for b in batches[n]):
            problems.append(f"{n}: tokens differ from the bare server's")
    captures = {}
    for n in names:
        if e2e.CONFIGS[n][1] is not None:
            captures[n] = e2e.check_capture(n, work, version, problems)
            print(f"[{n}] capture: {json.dumps(captures[n])}", flush=True)
    print(f"\nvLLM {version}, {len(e2e.prompts())} prompts x {e2e.MAX_TOKENS} tokens a batch, {args.rounds} rounds, "
          f"{args.pause} s between turns; CPU of every process of the server during generate()")
    print(f"{'configuration':36} {'CPU s med':>9} {'x bare: median':>14} {'q1-q3':>11} {'best/best':>9} "
          f"{'wall s med':>10} {'x bare: median':>14} {'best/best':>9}")
    summary = {}
    for n in names:
        own = batches[n]
        bare = {b["round"]: b for b in batches[f"{group[n]}-bare"]}
        cr = [b["cpu"] / bare[b["round"]]["cpu"] for b in own if b["round"] in bare]
        wr = [b["wall"] / bare[b["round"]]["wall"] for b in own if b["round"] in bare]
        if not cr:
            continue
        q1, med, q3 = quartiles(cr)
        best_c = min(b["cpu"] for b in own) / min(b["cpu"] for b in bare.values())
        best_w = min(b["wall"] for b in own) / min(b["wall"] for b in bare.values())
        summary[n] = {"cpu_ratio_median": med, "cpu_ratio_q1": q1, "cpu_ratio_q3": q3, "cpu_ratio_best": best_c,
                      "wall_ratio_median": statistics.median(wr), "wall_ratio_best": best_w,
                      "cpu_s_median": statistics.median(b["cpu"] for b in own),
                      "wall_s_median": statistics.median(b["wall"] for b in own)}
        s = summary[n]
        print(f"{n:36} {s['cpu_s_median']:9.3f} {med:14.2f} {q1:5.2f}-{q3:<5.2f} {best_c:9.2f} "
              f"{s['wall_s_median']:10.3f} {s['wall_ratio_median']:14.2f} {best_w:9.2f}")
    # where the CPU goes: each process of the tree (the LLM's own, the EngineCore, the workers,
    # in the order psutil lists them), its median CPU per batch and the per-round median ratio to
    # the same process of the bare server
    print("\nCPU s per batch by process (median; x bare, per-round median):")
    for n in names:
        own = [b for b in batches[n] if "cpu_by_process" in b]
        bare = {b["round"]: b for b in batches[f"{group[n]}-bare"] if "cpu_by_process" in b}
        if not own:
            continue
        cells = []
        for i in range(len(own[0]["cpu_by_process"])):
            med = statistics.median(b["cpu_by_process"][i] for b in own)
            r = [b["cpu_by_process"][i] / bare[b["round"]]["cpu_by_process"][i] for b in own
                 if b["round"] in bare and bare[b["round"]]["cpu_by_process"][i] > 0]
            cells.append(f"p{i} {med:.3f}" + (f" ({statistics.median(r):.2f}x)" if r and n in summary and
                                               group[n] + "-bare" != n else ""))
        print(f"  {n:36} " + "  ".join(cells))
    print(f"total {time.perf_counter() - t_all:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"vllm": version, "rounds": args.rounds, "pause": args.pause, "pids": pids,
                                               "summary": summary, "captures": captures,
                                               "batches": {n: [{k: v for k, v in b.items() if k != "tokens"}
                                                               for b in bs] for n, bs in batches.items()}},
                                              indent=1))
    if problems:
        print("\nFAILED:\n  " + "\n  ".join(problems))
        return 1
    print("\nOK: identical tokens in every batch; every capture clean and complete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
