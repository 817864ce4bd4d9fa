"""Run both variants at several draft depths and print corrupted requests side by side.

    python -m examples.mhc_decode.sweep --depths 1-8 --out runs/sweep [run.py options...]

Each (variant, depth) is one run of run.py into OUT/<variant>-d<depth>/ (traces, outcomes.jsonl,
summary.json); the reference decode of a depth is computed once and shared by both variants.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_depths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out += list(range(int(a), int(b) + 1))
        elif part:
            out.append(int(part))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m examples.mhc_decode.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", default="1-8")
    p.add_argument("--variants", default="stock,fixed")
    p.add_argument("--out", required=True)
    p.add_argument("--quiet", action="store_true", help="only the progress line of each run, no table")
    args, rest = p.parse_known_args(argv)
    from tabulate import tabulate

    from .decode import RunConfig
    from .run import RunFailed, build_parser, execute, model_config
    base = build_parser().parse_args(rest + ["--out", args.out])
    model = model_config(base)
    if any(x % base.ranks for x in (model.heads, model.experts, model.shared_inter, model.vocab)):
        print(f"error: --ranks {base.ranks} must divide --heads, --experts, --shared-inter and --vocab", file=sys.stderr)
        return 2
    depths, variants = parse_depths(args.depths), args.variants.split(",")
    plan = [(RunConfig(variant=v, depth=d, batch=base.batch, steps=base.steps, request_steps=base.request_steps,
                       comm_latency_ms=base.comm_latency_ms, hold_partial=base.hold_partial,
                       log_interval=base.log_interval, warmup=base.warmup, device=base.device, model=model),
             os.path.join(args.out, f"{v}-d{d}")) for d in depths for v in variants]
    t = time.monotonic()
    try:
        summaries = execute(plan, base.ranks, os.path.join(args.out, "reference-cache"),
                            progress=lambda line: print(line, flush=True))
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = {}
    for (run, _), s in zip(plan, summaries):
        row = rows.setdefault(run.depth, {"depth": run.depth, "max tokens": run.tokens})
        row[f"{run.variant} corrupted"] = f"{s['corrupted']}/{s['requests']}"
        log = s.get("server_log") or {}
        row[f"{run.variant} accept len (min)"] = (f"{s['accept_len']['observed']:.2f} ({log.get('accept_len_min', 0):.2f})"
                                                  if log else f"{s['accept_len']['observed']:.2f}")
        row[f"{run.variant} flagged"] = f"{log.get('flagged', 0)}/{log.get('intervals', 0)}"
        row[f"{run.variant} s"] = s["seconds"]["sanitised"]
    if not args.quiet:
        print(tabulate(list(rows.values()), headers="keys"))
        print(f"total {time.monotonic() - t:.1f} s")
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump({"rows": list(rows.values()), "summaries": summaries}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
