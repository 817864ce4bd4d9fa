"""The `hazsan` command line: discovers subcommands in `sanitizer.commands`.

Exit codes (docs/cli.md, "Conventions for every command"): 0 clean, 1 findings at or above the threshold, 2 unusable
input or arguments (argparse's own errors exit 2 too).
"""
from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys

import sanitizer.commands as _commands

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2
EXIT_CODES = """exit status (every command; `hazsan COMMAND --help` says what its own mean):
  0  clean
  1  findings (check, run, report), a flagged interval (logscan), the signature (verify), a failing scope (scan),
     a colliding shape (sweep), the fix not confirmed (compare)
  2  unusable input or arguments; no verdict (check, run: a capture that lost events)
  130 interrupted
`hazsan run` passes a failed command's own status through (see `hazsan run --help`)."""
#: Set (the test suite and benchmarks/fuzz.py set it): an internal error propagates with its traceback.
RAISE_ENV = "HAZSAN_RAISE"


def _command_modules():
    for info in sorted(pkgutil.iter_modules(_commands.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{_commands.__name__}.{info.name}")
        yield info.name.replace("_", "-"), module


def build_parser() -> argparse.ArgumentParser:
    from sanitizer import __version__

    parser = argparse.ArgumentParser(
        prog="hazsan",
        description="Memory-allocation hazard sanitizer for distributed PyTorch serving stacks.",
        epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hazsan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module in _command_modules():
        p = sub.add_parser(name, help=module.HELP, description=module.HELP,
                           epilog=getattr(module, "EPILOG", None),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args))
    except BrokenPipeError:  # `hazsan check ... | head` is normal use
        return EXIT_CLEAN
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - a bug in hazsan: still one line, never a traceback
        if os.environ.get(RAISE_ENV):
            raise
        print(f"hazsan {args.command}: internal error: {type(exc).__name__}: {exc} (a bug in hazsan; "
              f"{RAISE_ENV}=1 shows the traceback)", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
