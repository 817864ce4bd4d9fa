"""What `hazsan check` and `hazsan run` share after the traces are chosen (not a subcommand: the
leading underscore keeps sanitizer.cli from listing it): judge the traces, narrow to one rule,
write the report where asked, and the exit code (docs/cli.md, "Conventions for every command")."""
from __future__ import annotations

import dataclasses
import sys

from sanitizer.commands import _options as options


def judge(args, paths):
    """The Analysis of `paths` under the command's options: one run (--run), suppressions, --jobs
    or --scheduler, each run of a folder of runs on its own. Raises AllowListError for a bad
    suppressions file."""
    from sanitizer.rules.driver import analyze, analyze_runs

    common = dict(peer_completion=args.peer_completion, lenient=args.lenient,
                  max_per_group=getattr(args, "max_per_group", 100), limits=options.limits(args),
                  suppress=options.suppressions(args))
    scheduler = getattr(args, "scheduler", None)
    jobs = getattr(args, "jobs", 1)
    if scheduler:
        from sanitizer.rules.dask_check import analyze_on_cluster

        if common.pop("suppress") is not None:
            raise ValueError("--suppressions is not available with --scheduler")
        analysis = analyze_on_cluster(paths, scheduler=scheduler, timeout=args.scheduler_timeout, **common)
    elif jobs > 1:
        from sanitizer.rules.parallel import analyze_parallel

        analysis = analyze_runs(paths, analyze_parallel, jobs=jobs, run=getattr(args, "run", None), **common)
    else:                    # a bar of the bytes read on a terminal, as --jobs shows
        analysis = analyze_runs(paths, analyze, run=getattr(args, "run", None), progress=None, **common)
    rule = getattr(args, "rule", None)
    return narrowed(analysis, rule) if rule else analysis


def fail_on(args) -> str:
    """--fail-on, else the severity of --rule's rule, else error."""
    from sanitizer.rules.findings import RULES

    rule = getattr(args, "rule", None)
    return args.fail_on or (RULES[rule][0] if rule else "error")


def narrowed(analysis, rule: str):
    """The analysis with only RULE's findings (the summary's counts too)."""
    kept = [f for f in analysis.findings if f.rule == rule]
    n = analysis.summary.get("by_rule", {}).get(rule, 0)
    summary = dict(analysis.summary, by_rule={rule: n} if n else {}, findings=n, listed=len(kept),
                   narrowed_to=rule)
    return dataclasses.replace(analysis, findings=kept, summary=summary)


def write_report(args, analysis) -> None:
    """The report in --format, to --log-file or stdout (coloured where options.use_color says), then
    the suppressions --gen-suppressions asks for; errors on stderr when stdout is machine-read."""
    from sanitizer.report import render
    from sanitizer.report.render import render_text

    out = sys.stdout
    if args.format == "text":
        text = render_text(analysis, color=options.use_color(args, out))
    else:
        text = render(analysis, args.format)
    if args.gen_suppressions and analysis.findings:
        from sanitizer.allowlist import suppression_entries

        entries = suppression_entries(analysis.findings)
        if args.format == "text":
            text += "\n" + entries
        else:                   # machine-read stdout holds the report alone
            print(entries, file=sys.stderr)
    if args.log_file:
        with open(args.log_file, "w", encoding="utf-8") as fh:
            fh.write(text)
        from sanitizer.report.render import summary_line

        print(f"{summary_line(analysis)} (report in {args.log_file})", file=sys.stderr)
    else:
        out.write(text)
        out.flush()
    if args.format != "text" or args.log_file:
        for e in analysis.errors:
            print(f"hazsan: error: {e}", file=sys.stderr)


def exit_code(args, analysis) -> int:
    """The analysis's exit code under the command's options; a capture without a verdict (exit 2
    with no unusable input) says why on stderr, naming the files, as every exit 2 does."""
    code = analysis.exit_code(fail_on(args), getattr(args, "allow_incomplete", False))
    if code == 2 and not analysis.errors:
        print(f"hazsan: no verdict: the capture is INCOMPLETE ({'; '.join(analysis.blockers())}); "
              "--allow-incomplete accepts it", file=sys.stderr)
    return code
