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
    args, rest = p.parse_known_args(argv)
    from tabulate import tabulate

    from .run import main as run_main
    rows = []
    cache = os.path.join(args.out, "reference-cache")
    for d in parse_depths(args.depths):
        row = {"depth": d}
        for v in args.variants.split(","):
            out = os.path.join(args.out, f"{v}-d{d}")
            t = time.monotonic()
            rc = run_main(["--variant", v, "--depth", str(d), "--out", out, "--reference-cache", cache] + rest)
            if rc != 0:
                return rc
            with open(os.path.join(out, "summary.json")) as f:
                s = json.load(f)
            row[f"{v} corrupted"] = f"{s['corrupted']}/{s['requests']}"
            row[f"{v} s"] = round(time.monotonic() - t, 1)
            row["tokens"] = s["config"]["tokens"]
        rows.append(row)
    print(tabulate(rows, headers="keys"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
