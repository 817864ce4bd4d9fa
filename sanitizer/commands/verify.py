"""`hazsan verify URL`: load a running SGLang or vLLM server with the right content and judge its
speculative-decoding acceptance under load (the corruption signature), in two minutes.

Exit codes: 0 clean, 1 the signature (intervals at or below the limit under load), 2 no verdict:
unreachable, not speculative, the load never kept the batch full, the server stopped answering or
failed most requests, or prompts that accept too little even at one request at a time.
"""
from __future__ import annotations

import argparse
import math
import sys

HELP = "load a running SGLang or vLLM server and judge its accept length under load (the corruption signature)"

DESCRIPTION = """\
Sends greedy requests with code and tool-call-like prompts (shipped with hazsan), first one at a
time (the baseline), then --concurrency at once for at most --duration seconds, and watches the
speculative-decoding accept length in every way the server shows it: SGLang's per-request
meta_info.spec_accept_length (/generate), /metrics (sglang:spec_accept_length; vLLM's
spec_decode counters), and the server log (--log, followed live with logscan's parser and rules).

An interval under load (>= --min-running requests running) is flagged when its accept length is at
or below min(--threshold, --collapse x baseline). It stops early once --stop-after intervals are
flagged.

Exit: 0 clean; 1 the signature; 2 no verdict (unreachable, not speculative, too little load, the
server failing, or prompts that accept too little even one request at a time)."""


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = -1
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
        return value
    return parse


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}")
    return value


def add_arguments(p) -> None:
    from sanitizer.commands._options import _size

    if isinstance(p, argparse.ArgumentParser):
        p.description = DESCRIPTION
        p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("url", metavar="URL", help="the server's base URL, e.g. http://127.0.0.1:30000")
    p.add_argument("--log", metavar="FILE", help="the server's log, followed live (SGLang 'Decode batch', vLLM "
                                                 "'SpecDecoding metrics' lines); rotation is followed")
    p.add_argument("--duration", type=_positive(float), default=120.0, metavar="S",
                   help="seconds of load at most, baseline included (default 120)")
    p.add_argument("--concurrency", type=_positive(int), metavar="N",
                   help="requests in flight (default: the server's max running requests, at most 64; else 16)")
    p.add_argument("--api", choices=("auto", "generate", "completions", "chat"), default="auto",
                   help="auto (default): SGLang's /generate on SGLang (per-request acceptance), "
                        "/v1/completions elsewhere")
    p.add_argument("--prompts", metavar="FILE",
                   help='JSON Lines of {"text": ...} or {"input_ids": [...]} instead of the shipped code prompts')
    p.add_argument("--prose", action="store_true",
                   help="also load a prose class for a quarter of the time (shown, not judged: acceptance depends on content)")
    p.add_argument("--max-tokens", type=_positive(int), default=256, metavar="N",
                   help="tokens generated per request (default 256; ignore_eos keeps each decoding)")
    p.add_argument("--threshold", type=float, default=2.0, help="the signature's accept length (default 2.0)")
    p.add_argument("--collapse", type=float, default=0.75, metavar="F",
                   help="with a baseline, flag only at or below F x baseline too (default 0.75)")
    p.add_argument("--min-running", type=_positive(int), metavar="K",
                   help="an interval is under load with >= K running (default: half the concurrency)")
    p.add_argument("--baseline-requests", type=_non_negative_int, default=4, metavar="N",
                   help="requests sent one at a time first (default 4; 0: no baseline)")
    p.add_argument("--stop-after", type=_positive(int), default=5, metavar="N",
                   help="stop once N intervals are flagged (default 5)")
    p.add_argument("--min-intervals", type=_positive(int), default=3, metavar="N",
                   help="intervals under load needed to call the server clean (default 3)")
    p.add_argument("--poll", type=_positive(float), default=2.0, metavar="S", help="seconds between /metrics reads (default 2)")
    p.add_argument("--no-metrics", action="store_true", help="do not read /metrics")
    p.add_argument("--request-timeout", type=_positive(float), default=120.0, metavar="S",
                   help="seconds one request may take (default 120)")
    p.add_argument("--max-requests", type=_positive(int), default=100_000, metavar="N",
                   help="requests sent under load at most (default 100000)")
    p.add_argument("--max-response-bytes", type=_size, default=16 << 20, metavar="N",
                   help="largest reply read (default 16MiB; 0: no limit); a larger one fails its request")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--html", metavar="OUT", help="also write an HTML page with the accept length over time")
    p.add_argument("--quiet", action="store_true", help="no live progress on standard error")


def run(args) -> int:
    from sanitizer.logscan.parse import MAX_ACCEPT_LEN
    from sanitizer.verify import Options, Session, VerifyError
    from sanitizer.verify.render import MATPLOTLIB_MISSING, Progress, render_html, render_json, render_text

    def error(msg: str) -> int:
        print(f"hazsan verify: error: {msg}", file=sys.stderr)
        return 2

    if not 0 <= args.threshold <= MAX_ACCEPT_LEN:  # also refuses nan
        return error(f"--threshold must be a number from 0 to {MAX_ACCEPT_LEN:g}")
    if not 0 < args.collapse <= 1:
        return error("--collapse must be a number in (0, 1]")
    if not args.url.startswith(("http://", "https://")):
        return error(f"URL must start with http:// or https://, got {args.url!r}")
    opts = Options(url=args.url, log=args.log, duration=args.duration, concurrency=args.concurrency, api=args.api,
                   prompts=args.prompts, prose=args.prose, max_tokens=args.max_tokens, threshold=args.threshold,
                   min_running=args.min_running, collapse=args.collapse, baseline_requests=args.baseline_requests,
                   stop_after=args.stop_after, min_intervals=args.min_intervals, poll=args.poll,
                   request_timeout=args.request_timeout, max_response_bytes=args.max_response_bytes or (1 << 62),
                   max_requests=args.max_requests, metrics=not args.no_metrics)
    progress = None if args.quiet else Progress()
    try:
        result = Session(opts, progress).run()
    except VerifyError as exc:
        return error(str(exc))
    finally:
        if progress is not None:
            progress.finish()
    if args.html:
        page, has_plot = render_html(result)
        try:
            with open(args.html, "w", encoding="utf-8") as f:
                f.write(page)
        except OSError as exc:
            return error(f"{args.html}: cannot write: {exc.strerror or exc}")
        if not has_plot:
            print(f"hazsan verify: note: {MATPLOTLIB_MISSING}", file=sys.stderr)
        print(f"hazsan verify: HTML page written to {args.html}", file=sys.stderr)
    sys.stdout.write(render_json(result) if args.format == "json" else render_text(result))
    return result.verdict.code
