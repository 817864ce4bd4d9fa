"""The demo that `make demo` runs on CPU.

Part 1 checks the example traces in examples/traces/ (one clean, one per rule) with the same
engine `hazsan check` uses, and shows that each gives exactly the findings its name promises.
"""
from __future__ import annotations

import sys
from pathlib import Path

from tabulate import tabulate

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "traces"))

from make_traces import SCENARIOS  # noqa: E402

from sanitizer.report import render  # noqa: E402
from sanitizer.rules.engine import analyze  # noqa: E402


def trace_tour() -> bool:
    rows, ok = [], True
    for name, (_, expected) in SCENARIOS.items():
        a = analyze([HERE / "traces" / name])
        found = set(a.summary["by_rule"])
        match = found == expected and not a.errors
        ok &= match
        rows.append([name, ", ".join(f"{r} x{n}" for r, n in a.summary["by_rule"].items()) or "clean",
                     a.exit_code("error"), "yes" if match else f"NO (expected {sorted(expected) or 'clean'})"])
    print("Part 1: example traces, one clean and one per rule (hazsan check)\n")
    print(tabulate(rows, headers=["trace", "findings", "exit", "as expected"]))
    print("\nThe reference fault, as a person sees it (hazsan check examples/traces/reuse-in-flight.jsonl):\n")
    print(render(analyze([HERE / "traces" / "reuse-in-flight.jsonl"]), "text"))
    return ok


def main() -> int:
    ok = trace_tour()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
