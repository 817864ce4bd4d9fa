"""`hazsan scan PATH...`: static scan of Python sources for symmetric-memory scopes (docs/cli.md, "hazsan scan")."""
from __future__ import annotations

import argparse
import shlex
import sys

HELP = "static scan of Python sources for symmetric-memory scopes that may hold transients"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="Python files or directories (parsed with ast; nothing is imported or run)")
    parser.add_argument("--format", choices=("text", "json", "markdown"), default="text")
    parser.add_argument("--scope", action="append", default=[], metavar="NAME",
                        help="another callable that opens a scope (repeatable); a bare name matches "
                             "any callee ending in it, a dotted name the resolved qualified name")
    parser.add_argument("--no-default-scopes", action="store_true",
                        help="use only the scopes given by --scope / --config")
    parser.add_argument("--config", metavar="FILE",
                        help="TOML or JSON settings (scopes, depth, guard_keywords, exclude, calls)")
    parser.add_argument("--depth", type=int, default=None,
                        help="how many levels of helpers defined in the tree to follow (default 3)")
    parser.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                        help="skip files whose path relative to PATH matches (repeatable)")
    parser.add_argument("--allow", action="append", default=[], metavar="FILE",
                        help="allow-list of accepted compute scopes: FILE:LINE or FILE:FUNCTION and a reason")
    parser.add_argument("--trace", metavar="DIR",
                        help="schema-1 trace file or directory: mark scopes that placed transients in a window")
    parser.add_argument("--when", action="append", default=[], metavar="NAME",
                        help="keep the scopes reachable when NAME holds and mark those reachable only "
                             "then: a platform (sm120, sm100, sm90, cuda, hip, npu, xpu, cpu), a torch "
                             "version (torch2.9: compared with torch.__version__), or a flag / server "
                             "argument named in the conditions (repeatable: all hold)")
    parser.add_argument("--changed-since", metavar="REF",
                        help="keep the scopes whose code, or whose followed helpers' code, changed since "
                             "the git ref REF (working tree against REF, untracked files included)")
    parser.add_argument("--caller-depth", type=int, default=None, metavar="N",
                        help="call-chain levels searched for the conditions on each scope (default 3)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the report here instead of stdout")
    parser.add_argument("--title", default="hazsan scan", help="markdown title")
    parser.add_argument("--command-line", metavar="TEXT",
                        help="the command to print as 'regenerate with' (default: this invocation)")


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except RecursionError:
        print("hazsan scan: input nested too deeply to analyse (RecursionError); please report it",
              file=sys.stderr)
        return 2
    except MemoryError:
        print("hazsan scan: out of memory", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sanitizer.scan.allow import AllowList, AllowListError
    from sanitizer.scan.config import ConfigError, ScanConfig
    from sanitizer.scan.render import render_json, render_markdown, render_text
    from sanitizer.scan.scanner import Scanner

    roots = [Path(p) for p in args.paths]
    for root in roots:
        if not root.exists():
            print(f"hazsan scan: {root}: no such file or directory", file=sys.stderr)
            return 2
        if not root.is_file() and not root.is_dir():
            print(f"hazsan scan: {root}: not a regular file or directory", file=sys.stderr)
            return 2
        if root.is_file() and root.suffix != ".py":
            print(f"hazsan scan: {root}: not a Python file", file=sys.stderr)
            return 2
    if args.caller_depth is not None and args.caller_depth < 0:
        print(f"hazsan scan: --caller-depth must be >= 0, got {args.caller_depth}", file=sys.stderr)
        return 2
    try:
        config = ScanConfig.build(args.config, args.scope, args.no_default_scopes, args.depth, args.exclude)
        allow = AllowList.load(args.allow)
    except (ConfigError, AllowListError) as exc:
        print(f"hazsan scan: {exc}", file=sys.stderr)
        return 2
    if args.caller_depth is not None:
        config.caller_depth = args.caller_depth
    changes = None
    if args.changed_since is not None:
        from sanitizer.scan.changes import ChangesError, changed_lines
        try:
            changes = changed_lines(roots, args.changed_since)
        except ChangesError as exc:
            print(f"hazsan scan: {exc}", file=sys.stderr)
            return 2
    result = Scanner(config, allow).run(roots)
    if changes is not None:
        from sanitizer.scan.changes import keep_changed
        keep_changed(result, changes, result.rel_to_real)
    if args.when:
        bad = [w for w in args.when
               if not w or not w.replace("_", "").replace("-", "").replace(".", "").isalnum()]
        if bad:
            print(f"hazsan scan: --when {bad[0]!r}: expected a name (sm120, hip, torch2.9, a flag)",
                  file=sys.stderr)
            return 2
        result.keep_when(args.when)
    result.command = args.command_line or "hazsan scan " + " ".join(shlex.quote(a) for a in sys.argv[2:])
    if args.trace:
        from sanitizer.scan.runtime import RuntimeMatcher
        from sanitizer.trace.reader import TraceError
        try:
            RuntimeMatcher.from_path(args.trace).apply(result)
        except TraceError as exc:
            print(f"hazsan scan: {exc}", file=sys.stderr)
            return 2
    if args.format == "json":
        text = render_json(result)
    elif args.format == "markdown":
        text = render_markdown(result, args.title)
    else:
        text = render_text(result)
    if args.output:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as exc:
            print(f"hazsan scan: {args.output}: cannot write: {exc.strerror or exc}", file=sys.stderr)
            return 2
    else:
        sys.stdout.write(text)
    for p in result.problems:
        print(f"hazsan scan: warning: {p.file}:{p.line or '-'}: {p.message}", file=sys.stderr)
    return 1 if result.failing else 0
