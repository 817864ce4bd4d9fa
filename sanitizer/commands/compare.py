"""`hazsan compare STOCK_DIR FIXED_DIR`: does the fix remove the hazard, with statistics.

Each directory holds one run's rank traces (schema 1, `*.jsonl[.gz]`) and optionally the run's
`outcomes.jsonl` (format: sanitizer/proof/outcomes.py). Both are analysed with the same engine
settings; the report gives findings per rule, per decode step and per request for each side, the
exact rates and tests, and a verdict.

Exit codes: 0 the fix is confirmed (fixed side clean, and the primary measure's difference is
significant by Fisher's exact test, one-sided, p < alpha; or, when a side marks no decode step
so that the step measures count nothing, the stock side has a finding at or above --fail-on: the
verdict is then judged on findings and says so); 1 not confirmed; 2 unusable input (a missing
directory, a malformed trace line without --lenient, a malformed outcomes file).
"""
from __future__ import annotations

import sys

from sanitizer.commands import _options as options

HELP = "compare a stock run with a fixed run: findings per step and request, exact statistics, verdict"


def add_arguments(p) -> None:
    p.add_argument("stock", metavar="STOCK_DIR", help="trace directory of the run without the fix")
    p.add_argument("fixed", metavar="FIXED_DIR", help="trace directory of the run with the fix")
    p.add_argument("--format", choices=("text", "json", "markdown"), default="text")
    options.add_peer_completion(p, help="as in `hazsan check` (applied to both sides)")
    options.add_lenient(p, help="skip and count malformed trace lines (a fixed side with skipped lines is not clean)")
    p.add_argument("--primary", choices=("steps", "steps_realised", "requests", "corrupted"), default="steps",
                   help="the measure whose difference must be significant (default: steps with any finding); "
                        "a step measure on runs without decode steps (no sanitizer.step(n)) falls back to "
                        "judging the findings themselves")
    p.add_argument("--alpha", type=float, default=0.05,
                   help="significance level; bounds are one-sided at 1 - alpha (default 0.05)")
    options.add_fail_on(p, default="warning",
                        help="lowest severity that makes the fixed side not clean (default: warning, i.e. any finding)")
    p.add_argument("--max-rows", type=int, default=40, metavar="N",
                   help="text/markdown: at most N rows in the per-step and per-request tables (0: all)")


def run(args) -> int:
    from sanitizer.proof import Comparison, OutcomeError, RunError, load_run
    from sanitizer.proof.render import render_json, render_markdown, render_text

    if not 0 < args.alpha < 1:
        print("hazsan compare: error: --alpha must be between 0 and 1", file=sys.stderr)
        return 2
    sides = []
    for label, path in (("stock", args.stock), ("fixed", args.fixed)):
        try:
            side = load_run(label, path, peer_completion=args.peer_completion, lenient=args.lenient)
        except (RunError, OutcomeError) as exc:
            print(f"hazsan compare: error: {exc}", file=sys.stderr)
            return 2
        if side.analysis.errors:
            for e in side.analysis.errors:
                print(f"hazsan compare: error: {e}", file=sys.stderr)
            print(f"hazsan compare: {label} side has unusable input (use --lenient to skip malformed lines)",
                  file=sys.stderr)
            return 2
        sides.append(side)
    comparison = Comparison(sides[0], sides[1], primary=args.primary, alpha=args.alpha, fail_on=args.fail_on)
    if args.format == "json":
        sys.stdout.write(render_json(comparison))
    elif args.format == "markdown":
        sys.stdout.write(render_markdown(comparison, args.max_rows))
    else:
        sys.stdout.write(render_text(comparison, args.max_rows))
    return comparison.exit_code()
