"""What `hazsan verify`'s load costs a real server: requests per second, tokens per second, the
running requests it holds, and the server's CPU time, at several concurrencies.

Starts real SGLang 0.5.23 (`python -m sglang.launch_server`, TP=2 over gloo on CPU, NGRAM with 4
draft tokens, the tiny random Llama of examples/tiny_llama.py; tests/verify/sglang_server.py) once,
then runs `hazsan verify` against it for --seconds at each concurrency (no baseline: the load
alone) and prints one row per run from verify's own JSON (`phases`).

    .venv-sglang/bin/python benchmarks/verify_load.py [--concurrency 1,4,8] [--seconds 30]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "verify"))
sys.path.insert(0, str(ROOT / "examples" / "sglang_e2e"))
import sglang_server  # noqa: E402
import run as sglang_e2e  # noqa: E402  (examples/sglang_e2e/run.py: server_args)


def cpu_seconds(pid: int) -> float:
    import psutil
    p = psutil.Process(pid)
    total = 0.0
    for q in [p, *p.children(recursive=True)]:
        try:
            t = q.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "verify-bench")
    args = ap.parse_args(argv)
    model = args.work / "tiny-llama"
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r}); "
                    f"from tiny_llama import make_model; make_model({str(model)!r}, tokenizer=True)"],
                   env=sglang_server.base_env(1), check=True, capture_output=True)
    server = sglang_e2e.server_args(str(model), 2, True)
    server["enable_metrics"] = True
    rows = []
    with sglang_server.launch(server, sglang_server.base_env(2), args.work) as (base, log, proc):
        for n in [int(x) for x in args.concurrency.split(",")]:
            cpu0, t0 = cpu_seconds(proc.pid), time.monotonic()
            out = subprocess.run([sys.executable, "-m", "sanitizer", "verify", base, "--log", str(log), "--quiet",
                                  "--format", "json", "--concurrency", str(n), "--min-running", str(max(1, n // 2)),
                                  "--duration", str(args.seconds), "--baseline-requests", "0",
                                  "--max-tokens", str(args.max_tokens)], capture_output=True, text=True)
            wall = time.monotonic() - t0
            cpu = cpu_seconds(proc.pid) - cpu0
            doc = json.loads(out.stdout)
            load = next(p for p in doc["phases"] if p["phase"] == "load")
            rows.append((n, load["requests"], load["requests_per_s"], load["tokens_per_s"], load["running_held_median"],
                         doc["max_running_seen"], round(cpu / wall, 2), doc["verdict"]))
    print(f"SGLang 0.5.23, TP=2 NGRAM (4 draft tokens), tiny random Llama, {args.max_tokens} tokens a request, "
          f"{args.seconds:g} s per row; server CPU in cores (2-core machine)")
    print(f"{'concurrency':>11} {'requests':>8} {'req/s':>6} {'tok/s':>6} {'held':>5} {'server running':>14} "
          f"{'server CPU':>10}  verdict")
    for r in rows:
        print(f"{r[0]:>11} {r[1]:>8} {r[2]:>6.2f} {r[3]:>6.0f} {r[4]:>5} {str(r[5]):>14} {r[6]:>10}  {r[7]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
