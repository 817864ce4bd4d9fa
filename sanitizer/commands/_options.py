"""Command options that several commands share, defined once (docs/cli.md; not a subcommand:
the leading underscore keeps sanitizer.cli from listing it): the peer-completion
rule, lenient reading, the exit-code threshold, and the limits on what hostile input may cost
(sanitizer.limits.Limits, which `limits(args)` makes from them).
"""
from __future__ import annotations

import argparse
import re

from sanitizer.limits import Limits

PEER_COMPLETION_HELP = ("local: NCCL's contract, a buffer is free once the op is locally complete; "
                        "successor: symmetric-window buffers only once a later collective on the "
                        "same communicator is (for barrier-less symmetric kernels)")
LENIENT_HELP = "skip and count malformed lines instead of failing with exit 2"
FAIL_ON_HELP = "lowest severity that makes the exit code 1 (default: {default})"


def add_peer_completion(p, help: str = PEER_COMPLETION_HELP) -> None:
    p.add_argument("--peer-completion", choices=("local", "successor"), default="local", help=help)


def add_lenient(p, help: str = LENIENT_HELP) -> None:
    p.add_argument("--lenient", action="store_true", help=help)


def add_fail_on(p, default: str | None = "error", help: str | None = None) -> None:
    p.add_argument("--fail-on", choices=("error", "warning"), default=default,
                   help=help if help is not None else FAIL_ON_HELP.format(default=default))


def _size(text: str) -> int:
    """A byte count: 8388608, 8MiB, 512KiB, 1GiB (0: no limit)."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]i?B?)?\s*", text, re.I)
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 8388608 or 8MiB, got {text!r}")
    unit = (m.group(2) or " ")[0].upper()
    return int(m.group(1)) << {"K": 10, "M": 20, "G": 30}.get(unit, 0)


def _ratio(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def add_read_limits(p) -> None:
    """What one trace file may cost to read (Limits.max_line_bytes, .max_gzip_ratio)."""
    d = Limits()
    p.add_argument("--max-line-bytes", type=_size, default=d.max_line_bytes, metavar="N",
                   help=f"longest trace line (or binary frame) read (default {d.max_line_bytes >> 20}MiB; "
                        "0: no limit); a longer one is an error")
    p.add_argument("--max-gzip-ratio", type=_ratio, default=d.max_gzip_ratio, metavar="R",
                   help=f"a .gz trace may expand at most R times (default {d.max_gzip_ratio:g}; "
                        "0: no limit), beyond its first "
                        f"{d.gzip_ratio_floor >> 20}MiB")


def add_engine_limits(p) -> None:
    """What one rank may hold in the engine (Limits.max_streams, .max_events, .max_comms)."""
    d = Limits()
    # --max-event-ids, not --max-events: that is `hazsan run`'s events per trace file (HAZSAN_MAX_EVENTS)
    for name, flag, what in (("streams", "streams", "stream ids"), ("events", "event-ids", "CUDA event ids"),
                             ("comms", "comms", "communicators")):
        default = getattr(d, f"max_{name}")
        p.add_argument(f"--max-{flag}", dest=f"max_{name}", type=_count, default=default, metavar="N",
                       help=f"distinct {what} one rank may use (default {default:,}); "
                            "one more is an error on its line")


def limits(args) -> Limits:
    """The Limits the options of add_read_limits (and add_engine_limits, where the command has
    them) set; the defaults for those it has not."""
    values = {name: getattr(args, name) for name in
              ("max_line_bytes", "max_gzip_ratio", "max_streams", "max_events", "max_comms")
              if hasattr(args, name)}
    return Limits(**values)


def add_run_choice(p) -> None:
    p.add_argument("--run", metavar="ID",
                   help="judge this run where the paths hold several (a trace header's `run`; "
                        "default: of one folder's runs the newest, and a warning names the others)")


def add_allow_incomplete(p) -> None:
    p.add_argument("--allow-incomplete", action="store_true",
                   help="exit 0, not 2, when nothing is found in a capture that lost events "
                        "(dropped, hook failures, a trace cut during a step); the report still says INCOMPLETE")


def add_verdict_options(p) -> None:
    """What `check` and `run` share after the analysis: the rule, suppressions, where the report goes."""
    from sanitizer.rules.findings import RULES

    p.add_argument("--rule", choices=sorted(RULES), metavar="RULE",
                   help=f"only this rule's findings make the verdict and the report ({', '.join(sorted(RULES))})")
    p.add_argument("--suppressions", action="append", metavar="FILE", default=[],
                   help="accept the findings its [[allow]] entries name (the pytest plugin's allow-list "
                        "format: rule, site, reason; repeatable): counted as suppressed, not reported")
    p.add_argument("--gen-suppressions", action="store_true",
                   help="after the report, print a suppressions entry for each rule and site found "
                        "(each reason left empty: the file is refused until you say why)")
    p.add_argument("-o", "--log-file", metavar="FILE",
                   help="write the report to FILE instead of stdout")
    p.add_argument("--color", choices=("auto", "always", "never"), default="auto",
                   help="colour the text report (auto: when it goes to a terminal and NO_COLOR is unset)")


def suppressions(args):
    """allowlist.Suppressions of --suppressions, or None. Raises AllowListError naming file and line."""
    if not getattr(args, "suppressions", None):
        return None
    from sanitizer.allowlist import Suppressions, load_allow_list

    return Suppressions([a for f in args.suppressions for a in load_allow_list(f)])


def use_color(args, stream) -> bool:
    import os

    choice = getattr(args, "color", "never")
    if choice != "auto":
        return choice == "always"
    return not os.environ.get("NO_COLOR") and not getattr(args, "log_file", None) and stream.isatty()
