"""The GPU self-check: the reference case on the CuPy testbed, two rank processes on one GPU.

    python -m examples.mhc_decode.gpu_check [--out runs/gpu-check] [--report] [--capture]   # about 1-2 minutes

1. The placement model predicts the draft depth at which the stock build collides (predict.py).
2. Stock and fixed run at that depth with `--device cuda` (sanitizer/testbed/cuda.py: windows in
   cudaMalloc arenas shared by CUDA IPC, collectives as CuPy raw kernels on a comm stream); with a
   single GPU both rank processes share it (IPC within a device).
3. Corruption is counted against the reference decode (bit for bit), the testbed's traces are
   analysed (`hazsan check` semantics), every corrupted request must be preceded by a finding on
   its rank, and `hazsan logscan` must flag the stock run's server log and not the fixed one's.

Exit 0 when all of that holds, 1 when something does not, 2 when there is no GPU or CuPy.
`--report` writes reports/mhc-proof-gpu/ (README.md, result.json); `make demo` does so itself
whenever it finds a GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def gpu_ready() -> str | None:
    """None when a CUDA device and CuPy are usable here, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    import importlib.util
    if importlib.util.find_spec("cupy") is None:
        return ("CuPy is not installed (pip install -e '.[gpu-cu13]' for a CUDA 13 torch, "
                "'.[gpu-cu12]' for a CUDA 12 one)")
    return None


def check(out: Path, depth: int | None = None, ranks: int = 2) -> dict:
    """Run stock and fixed at the predicted colliding depth on the GPU; return the evidence."""
    from dataclasses import replace

    from sanitizer.logscan.scan import scan
    from sanitizer.proof import Comparison, load_run

    from .decode import RunConfig
    from .predict import predict_depths
    from .run import execute
    base = RunConfig(device="cuda")
    predicted = {p.depth: p for p in predict_depths(base, ranks, range(1, 9))}
    if depth is None:
        colliding = [d for d, p in predicted.items() if p.corrupted_requests]
        if len(colliding) != 1:
            raise SystemExit(f"gpu_check: the default configuration is predicted to collide at depths {colliding}, "
                             f"expected exactly one; give --depth")
        depth = colliding[0]
    plan = [(replace(base, variant=v, depth=depth), str(out / f"{v}-d{depth}")) for v in ("stock", "fixed")]
    t0 = time.monotonic()
    summaries = execute(plan, ranks)
    seconds = time.monotonic() - t0
    result = {"depth": depth, "ranks": ranks, "seconds": round(seconds, 1),
              "predicted corrupted (stock)": len(predicted[depth].corrupted_requests) if depth in predicted else None}
    sides = {}
    for (run, d), s in zip(plan, summaries):
        side = load_run(run.variant, Path(d))
        log = scan([os.path.join(d, "server.log")])
        sides[run.variant] = side
        result[run.variant] = {
            "corrupted": s["corrupted"], "requests": s["requests"], "by_rule": dict(side.by_rule),
            "accept_len": s["accept_len"], "logscan flagged": len(log.flagged), "logscan intervals": log.intervals,
        }
    prec = Comparison.precedence(sides["stock"])
    result["every corrupted request preceded by a finding"] = prec["every_corrupted_preceded"] if prec else None
    st, fx = result["stock"], result["fixed"]
    result["ok"] = bool(st["corrupted"] > 0 and fx["corrupted"] == 0 and result["every corrupted request preceded by a finding"]
                        and st["logscan flagged"] > 0 and fx["logscan flagged"] == 0)
    return result


def render(result: dict) -> str:
    from tabulate import tabulate
    rows = []
    for v in ("stock", "fixed"):
        r = result[v]
        rows.append([v, f"{r['corrupted']}/{r['requests']}", r["by_rule"].get("reuse-in-flight", 0),
                     r["by_rule"].get("free-in-flight", 0), r["by_rule"].get("transient-in-window", 0),
                     r["accept_len"]["observed"], r["accept_len"]["reference"],
                     f"{r['logscan flagged']}/{r['logscan intervals']}"])
    table = tabulate(rows, headers=["variant", "corrupted", "reuse-in-flight", "free-in-flight", "transient-in-window",
                                    "accept len", "accept len (reference)", "logscan flagged"], tablefmt="github")
    return (f"GPU self-check at draft depth {result['depth']} ({result['ranks']} rank processes, {result['seconds']} s; "
            f"predicted stock corrupted: {result['predicted corrupted (stock)']})\n\n{table}\n\n"
            f"Every corrupted request preceded by a finding: {result['every corrupted request preceded by a finding']}\n"
            f"Verdict: {'OK' if result['ok'] else 'FAILED'}\n")


def write_report(result: dict, device_name: str) -> Path:
    out = ROOT / "reports" / "mhc-proof-gpu"
    out.mkdir(parents=True, exist_ok=True)
    (out / "README.md").write_text(
        "# The mHC reference case on a GPU (written by `python -m examples.mhc_decode.gpu_check --report`)\n\n"
        f"Device: {device_name}. Windows are cudaMalloc arenas shared by CUDA IPC, collectives CuPy raw kernels "
        "on a comm stream (sanitizer/testbed/cuda.py).\n\n```\n" + render(result) + "```\n")
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.mhc_decode.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "out" / "gpu-check"))
    p.add_argument("--depth", type=int, default=None, help="default: the depth the placement model predicts")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--report", action="store_true", help="write reports/mhc-proof-gpu/")
    p.add_argument("--capture", action="store_true",
                   help="record with hazsan capture (HAZSAN=1) instead of the testbed's own trace files")
    args = p.parse_args(argv)
    if args.capture:
        os.environ["HAZSAN"] = "1"
        os.environ.setdefault("HAZSAN_STACKS", "site")
    why = gpu_ready()
    if why is not None:
        print(f"gpu_check: {why}", file=sys.stderr)
        return 2
    result = check(Path(args.out), args.depth, args.ranks)
    print(render(result))
    if args.report:
        import torch
        print(f"written: {write_report(result, torch.cuda.get_device_name(0))}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
