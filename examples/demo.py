"""The demo that `make demo` runs on CPU: the mHC reference case, found, explained and fixed.

1. The placement model (examples/mhc_decode/predict.py) replays the window traffic of draft depths
   1 to 8 and computes which depth collides.
2. That depth and its two neighbours run stock and fixed (6 runs, each a 2-rank decode on the CPU
   symmetric-memory testbed under HAZSAN=1, as a server would be captured), one progress line per
   run. Each run's output is compared bit for bit with a reference decode, its traces checked.
3. Shown: corrupted requests and `hazsan check`'s verdict per run, the statistics, one finding
   exactly as `hazsan check` prints it, the log signature (`hazsan logscan` on the run's
   SGLang-format server log), and the HTML report (`hazsan report`), written under --out.
4. Only where a CUDA device and CuPy are present: the GPU self-check (examples/mhc_decode/gpu_check.py).

Every number printed is measured in this run (or computed by the placement model); the exit
status is 0 only when the story holds: stock corrupted and flagged where predicted, fixed clean.
The 8-depth proof is `make proof` (python -m examples.mhc_decode.proof; reports/mhc-proof/).

    python examples/demo.py                  # about 90 s on 2 cores
    python examples/demo.py --traces-only    # the hand-written example traces, one per rule (seconds)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from tabulate import tabulate

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "traces"))
sys.path.insert(1, str(ROOT))   # `examples.mhc_decode` as a package, as the subprocesses (cwd ROOT, -m) see it

from examples.mhc_decode import proof as P  # noqa: E402

SEARCH = range(1, 9)            # the draft depths the placement model looks at


def say(text: str = "") -> None:
    print(text, flush=True)


def shown(path: Path) -> str:
    """A path as the reader types it: relative to the current folder when below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def hazsan(*args: str) -> subprocess.CompletedProcess:
    """The real command line (`python -m sanitizer` is the `hazsan` program)."""
    return subprocess.run([sys.executable, "-m", "sanitizer", *args], capture_output=True, text=True)


def neighbours(depth: int, lo: int = 1) -> list[int]:
    """The colliding depth and the depths either side of it (from `lo` up)."""
    return [d for d in (depth - 1, depth, depth + 1) if d >= lo]


def trace_tour() -> bool:
    from make_traces import SCENARIOS

    from sanitizer.report import render
    from sanitizer.rules.driver import analyze
    rows, ok = [], True
    for name, (_, expected) in SCENARIOS.items():
        a = analyze([HERE / "traces" / name])
        found = set(a.summary["by_rule"])
        match = found == expected and not a.errors
        ok &= match
        rows.append([name, ", ".join(f"{r} x{n}" for r, n in a.summary["by_rule"].items()) or "clean",
                     a.exit_code("error"), "yes" if match else f"NO (expected {sorted(expected) or 'clean'})"])
    say("The example traces (examples/traces/), one clean and one per rule (hazsan check):\n")
    say(tabulate(rows, headers=["trace", "findings", "exit", "as expected"]))
    say("\nThe reference fault in small (hazsan check examples/traces/reuse-in-flight.jsonl):\n")
    say(render(analyze([HERE / "traces" / "reuse-in-flight.jsonl"]), "text"))
    return ok


def check_cell(side) -> str:
    """What `hazsan check RUN_DIR` says of one run: exit status (--fail-on error), findings (every
    rule is an error)."""
    text = f"exit {side.analysis.exit_code('error')}: {sum(side.by_rule.values())} finding(s)"
    if side.capture_incomplete:
        text += " INCOMPLETE: " + "; ".join(side.capture_incomplete)
    return text


def rules_line(result: dict, label: str) -> str:
    """Findings per rule in each run of one variant, depth by depth (transient-in-window: frees)."""
    per = {}
    for e in result["per_depth"]:
        side = result["evidence"][(label, e["depth"])]
        for r, n in side.by_rule.items():
            per.setdefault(r, {})[e["depth"]] = (side.transient_occurrences()[0] if r == "transient-in-window" else n)
    depths = [e["depth"] for e in result["per_depth"]]
    from sanitizer.rules.findings import ERROR, RULES
    order = sorted(per, key=lambda r: RULES.get(r, (ERROR,))[0] != ERROR)      # errors first
    return "; ".join(f"{r} " + " / ".join(str(per[r].get(d, 0)) for d in depths)
                     + (" frees" if r == "transient-in-window" else "") for r in order) or "none"


def first_finding(run_dir: Path) -> tuple[str, str, int]:
    """`hazsan check RUN_DIR` run for real: its first finding block as printed, its totals line (the
    one before the closing `SUMMARY:` verdict), its exit."""
    r = hazsan("check", shown(run_dir))
    lines = r.stdout.rstrip("\n").splitlines()
    if lines and lines[-1].startswith("SUMMARY:"):
        lines = lines[:-1]
    seps = [i for i, line in enumerate(lines) if line.startswith("=====")]
    block = lines[:seps[1]] if len(seps) > 1 else lines[:-1]
    return "\n".join(block), lines[-1] if lines else r.stderr.strip(), r.returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces-only", action="store_true", help="only the hand-written example traces (seconds)")
    p.add_argument("--out", default=str(ROOT / "out" / "demo"), help="where the runs and the HTML report go (default out/demo)")
    p.add_argument("--no-runs", action="store_true", help="show the runs already in --out again (no new runs)")
    p.add_argument("--readme", action="store_true",
                   help="also rewrite README.md's sample finding from this run (`make readme`)")
    args = p.parse_args(argv)
    if args.traces_only:
        return 0 if trace_tour() else 1
    t0, cpu0 = time.monotonic(), _cpu()
    out = Path(args.out)

    say("hazsan demo: the mHC reference case (examples/mhc_decode/). A DeepSeek-V4-style speculative decode\n"
        "with mHC on 2 ranks of the CPU symmetric-memory testbed; the stock build computes inside the\n"
        "symmetric window, the fixed build only allocates its output there.\n")
    pred = P.predicted(SEARCH)
    hit = P.colliding(pred)
    if not hit:
        say("The placement model predicts no colliding depth for this configuration: nothing to show.")
        return 1
    depth = hit[0]
    depths = neighbours(depth)
    say("1. Which draft depth collides? The placement model (examples/mhc_decode/predict.py) replays each\n"
        "   depth's window traffic through the caching-allocator model (no model run). Predicted:\n")
    table = [["depth"] + sorted(pred), ["corrupted requests"]
             + [f"{len(q.corrupted_requests)}/{q.requests}" for _, q in sorted(pred.items())]]
    say("\n".join("     " + line for line in tabulate(table, tablefmt="plain").splitlines()))
    say(f"\n   Colliding: depth {', '.join(map(str, hit))}. Running depths {', '.join(map(str, depths))}, "
        f"stock and fixed, each under HAZSAN=1 ({2 * len(depths)} runs):")
    sweep_s = 0.0 if args.no_runs else P.run_sweep(depths, out)
    result = P.proof(out, depths)
    ev, signature = result["evidence"], P.log_signature(out, depths)

    rows = []
    for e in result["per_depth"]:
        d = e["depth"]
        sig = signature["per"]
        rows.append([d, f"{len(pred[d].corrupted_requests)}/{pred[d].requests}",
                     f"{e['stock']['corrupted']}/{e['stock']['requests']}", check_cell(ev[("stock", d)]),
                     f"{e['fixed']['corrupted']}/{e['fixed']['requests']}", check_cell(ev[("fixed", d)]),
                     f"{sig[('stock', d)]['flagged']}/{sig[('stock', d)]['intervals']} / "
                     f"{sig[('fixed', d)]['flagged']}/{sig[('fixed', d)]['intervals']}"])
    say(f"\n2. What happened (corrupted: output compared bit for bit with a reference decode; hazsan check on the\n"
        f"   captured traces; log: decode intervals hazsan logscan flags in the run's server.log):\n")
    say(tabulate(rows, headers=["depth", "predicted", "stock corrupted", "stock: hazsan check", "fixed corrupted",
                                "fixed: hazsan check", "log flagged stock / fixed"]))
    at = next(e for e in result["per_depth"] if e["depth"] == depth)
    measured = [e["depth"] for e in result["per_depth"] if e["stock"]["corrupted"]]
    real = {r.outcome.request for r in ev[("stock", depth)].corrupted}
    same = "the very requests predicted" if real == pred[depth].corrupted_requests else \
        f"{len(real & pred[depth].corrupted_requests)} of them among the {len(pred[depth].corrupted_requests)} predicted"
    say(f"\n   Measured colliding depth(s): {', '.join(map(str, measured)) or 'none'} "
        f"(predicted: {', '.join(str(d) for d in depths if d in hit)}); at depth {depth}, {len(real)} corrupted: {same}.\n"
        f"   At depth {depth}, Fisher's exact test, stock rate > fixed rate: p = {at['fisher p (corrupted, one-sided)']:.2g}.")
    for line in P.summary_lines(result, over=f"depths {P.depths_text(depths)}"):
        say("   " + line)
    latent = [e["depth"] for e in result["per_depth"]
              if e["stock"]["free-in-flight"] and e["stock"]["transient-in-window frees"]]
    say(f"\n   Findings per rule at depths {' / '.join(map(str, depths))}:\n"
        f"     stock: {rules_line(result, 'stock')}\n     fixed: {rules_line(result, 'fixed')}")
    say(f"   reuse-in-flight is the realised collision. The latent hazard, free-in-flight with\n"
        f"   transient-in-window, is in the stock build at depth(s) {', '.join(map(str, latent)) or 'none'}: "
        f"hazsan flags it at every shape,\n   as errors, so CI fails the stock build where nothing collided; "
        f"the allocator's fit decides where it corrupts.\n   The fixed build computes outside the window and keeps "
        f"its all-reduce input until the wait: clean.")

    stock_dir, fixed_dir = out / f"stock-d{depth}", out / f"fixed-d{depth}"
    block, last, code = first_finding(stock_dir)
    if args.readme:
        write_readme_sample(stock_dir)
    say(f"\n3. The first finding, exactly as `hazsan check {shown(stock_dir)}` prints it (exit {code}):\n")
    say(block)
    say("   [... the other findings ...]")
    say(last)
    _, fixed_last, fixed_code = first_finding(fixed_dir)
    say(f"\n   hazsan check {shown(fixed_dir)}: exit {fixed_code}; {fixed_last}")

    s_sig, f_sig = signature["per"][("stock", depth)], signature["per"][("fixed", depth)]
    say(f"\n4. The log signature: `hazsan logscan {shown(stock_dir / 'server.log')}` flags {s_sig['flagged']} of "
        f"{s_sig['intervals']} decode intervals\n   (accept len <= 2.0 under load; mean {s_sig['accept_len_mean']:.2f}, "
        f"fixed build {f_sig['accept_len_mean']:.2f} with {f_sig['flagged']} flagged):\n")
    for line in s_sig["flagged_lines"]:
        say("   " + line)

    report = out / "report.html"
    r = hazsan("report", shown(stock_dir), "-o", shown(report))
    fixed_report = out / "report-fixed.html"
    r2 = hazsan("report", shown(fixed_dir), "-o", shown(fixed_report))
    if r.returncode not in (0, 1) or not report.exists():
        say(f"\n5. hazsan report failed (exit {r.returncode}): {r.stderr.strip()}")
    else:
        say(f"\n5. The HTML report (hazsan report {shown(stock_dir)} -o {shown(report)}), one self-contained file:\n"
            f"   {report.resolve().as_uri()}\n"
            f"   window timelines per rank (collective buffers in flight, transients, the collisions), findings per\n"
            f"   step and call site. The fixed build's: {shown(fixed_report)}"
            + ("" if r2.returncode in (0, 1) else f" (failed, exit {r2.returncode})") + ".")

    ok = (measured == [d for d in depths if d in hit] and at["stock"]["corrupted"] > 0
          and ev[("stock", depth)].analysis.exit_code("error") == 1 and code == 1 and fixed_code == 0
          and result["pooled"]["fixed corrupted"][0] == 0
          and result["pooled"]["every corrupted request preceded by a finding"]
          and all(ev[("fixed", d)].analysis.exit_code("error") == 0 for d in depths)
          and s_sig["flagged"] > 0 and all(signature["per"][("fixed", d)]["flagged"] == 0 for d in depths if d > 1))
    say(f"\nVerdict: {'as predicted: stock corrupted and flagged, fixed clean' if ok else 'THE STORY DID NOT HOLD (see above)'}. "
        f"{time.monotonic() - t0:.0f} s wall ({sweep_s:.0f} s in the runs), {_cpu() - cpu0:.0f} s CPU, "
        f"load average {os.getloadavg()[0]:.2f}.\nAll 8 depths with the statistics: make proof (reports/mhc-proof/README.md).")
    gpu_ok = run_gpu_check()
    return 0 if ok and gpu_ok else 1


README_BEGIN, README_END = "<!-- sample: make readme -->", "<!-- end of sample -->"


def readme_sample(run_dir: Path) -> str:
    """The README's sample: `hazsan check RUN_DIR` as printed, its first finding, a line for the
    others, its totals and its SUMMARY line."""
    r = hazsan("check", shown(run_dir))
    lines = r.stdout.rstrip("\n").splitlines()
    seps = [i for i, line in enumerate(lines) if line.startswith("=====")]
    head = lines[:seps[1]] if len(seps) > 1 else lines
    others = sorted({m for line in lines[seps[1]:seps[-1]] if (m := line.split("  at ")[0]).startswith("hazsan ")})
    rules = ", ".join(o.split(": ", 1)[1] for o in others) if others else ""
    tail = [line for line in lines[seps[-1] + 1:] if not line.startswith("hazsan: warning")]
    body = head + ([f"[... the other findings: {rules} ...]"] if rules else []) + tail
    return "\n".join([f"$ hazsan check {shown(run_dir)}"] + body)


def write_readme_sample(run_dir: Path) -> None:
    """Replace the README's sample block (between README_BEGIN and README_END) by this run's."""
    path = ROOT / "README.md"
    text = path.read_text(encoding="utf-8")
    start, end = text.index(README_BEGIN), text.index(README_END)
    text = text[:start] + f"{README_BEGIN}\n```text\n{readme_sample(run_dir)}\n```\n" + text[end:]
    path.write_text(text, encoding="utf-8")
    say(f"   (README.md's sample rewritten from {shown(run_dir)})")


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the rank processes included)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def run_gpu_check() -> bool:
    """On a machine with a GPU and CuPy: the GPU self-check, and its report under reports/."""
    from examples.mhc_decode.gpu_check import gpu_ready
    why = gpu_ready()
    if why is not None:
        say(f"(The GPU self-check is skipped: {why}.)")
        return True
    say("\n6. The reference case on the GPU (python -m examples.mhc_decode.gpu_check --report) ...")
    cmd = [sys.executable, "-m", "examples.mhc_decode.gpu_check", "--report"]
    return subprocess.run(cmd, cwd=ROOT).returncode == 0


if __name__ == "__main__":
    sys.exit(main())
