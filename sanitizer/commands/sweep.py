"""`hazsan sweep TRACE --scale 1,2,3`: one decode step replayed at several token counts."""
from __future__ import annotations

import argparse
import sys

from sanitizer.commands import _options as options

HELP = "replay one recorded decode step at several token counts; realised collisions vs latent hazards per shape"

EPILOG = """\
The chosen step (the first `step` marker with `tokens`, or --step N) is replayed at each scale:
the first dimension of each recorded `alloc` shape equal to the step's token count (or the
dimensions listed in its `token_dims`) is multiplied, the size follows; everything before the first step marker is kept as set-up. Each
scaled trace is placed with the caching-allocator model (as `hazsan place`) and analysed (as
`hazsan check`). A shape COLLIDES when `reuse-in-flight` fires (the allocator really handed out
bytes a collective still uses); the latent hazards `free-in-flight` and `transient-in-window` are
independent of the shape. Exit 0 when no shape collides, 1 when one does, 2 on unusable input."""


MAX_SCALE = 1024.0  # token counts beyond a thousand times the recorded one are not a decode step


def _scales(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--scale expects numbers separated by commas, got {text!r}") from None
    if not vals or not all(0 < v <= MAX_SCALE for v in vals):  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"--scale values must be positive and at most {MAX_SCALE:g}")
    return vals


MAX_SCHEDULE = 1_000_000   # steps


def _schedule(text: str) -> list[int]:
    where = "--schedule"
    if text.startswith("@"):
        where = text[1:]
        try:
            with open(where) as f:
                text = f.read()
        except OSError as exc:
            raise argparse.ArgumentTypeError(f"--schedule: cannot read {where}: {exc.strerror}") from None
    parts = text.replace(",", " ").split()
    try:
        vals = [int(x) for x in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{where}: token counts must be integers") from None
    if not vals or len(vals) > MAX_SCHEDULE or not all(0 < v <= 1 << 24 for v in vals):
        raise argparse.ArgumentTypeError(f"{where}: 1 to {MAX_SCHEDULE:,} token counts, each from 1 to {1 << 24}")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("trace", metavar="TRACE", help="a rank file or a directory of rank files")
    p.add_argument("--scale", type=_scales, default=[1.0, 2.0, 3.0], metavar="S1,S2,...",
                   help="token-count multipliers (default 1,2,3)")
    p.add_argument("--step", type=int, default=None, metavar="N",
                   help="the step to replay (default: the first step marker with tokens)")
    p.add_argument("--repeat", type=int, default=2, metavar="R",
                   help="replay the step R times in a row, as consecutive decode steps (default 2)")
    p.add_argument("--schedule", type=_schedule, default=None, metavar="T1,T2,...|@FILE",
                   help="instead of --scale/--repeat: replay the step once per token count, in order, "
                        "as a server's consecutive steps (e.g. the tokens of each step vLLM's scheduler "
                        "made); @FILE reads the counts from a file (commas or whitespace)")
    p.add_argument("--format", choices=("text", "json"), default="text")
    p.add_argument("--alloc-conf", metavar="CONF", default=None,
                   help="allocator settings (default: $PYTORCH_ALLOC_CONF / $PYTORCH_CUDA_ALLOC_CONF)")
    options.add_peer_completion(p)
    p.add_argument("--no-split", action="append", default=[], metavar="POOL")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="keep the scaled and placed traces under DIR (one folder per scale)")
    options.add_read_limits(p)

def _site(f) -> str:
    block = f.block or {}
    return f.site or block.get("site") or "(no site)"


def run(args) -> int:
    import orjson
    from tabulate import tabulate

    from sanitizer.place import AllocatorConfig, ConfigError
    from sanitizer.place.replay import PlaceError
    from sanitizer.place.sweep import LATENT_RULES, REALISED_RULES, SweepError, sweep
    from sanitizer.trace.reader import TraceError

    if args.repeat < 1:
        print("hazsan sweep: --repeat must be >= 1", file=sys.stderr)
        return 2
    try:
        config = (AllocatorConfig.parse(args.alloc_conf) if args.alloc_conf is not None
                  else AllocatorConfig.from_env())
        results = sweep([args.trace], args.scale, step=args.step, repeat=args.repeat, config=config,
                        peer_completion=args.peer_completion, workdir=args.keep,
                        no_split_pools=args.no_split, schedule=args.schedule, limits=options.limits(args))
    except (ConfigError, SweepError, TraceError, PlaceError) as exc:
        print(f"hazsan sweep: {exc}", file=sys.stderr)
        return 2

    if args.schedule:
        return _report_schedule(args, config, results[0])
    other_rules = sorted({r for res in results for r in res.by_rule}
                         - set(REALISED_RULES) - set(LATENT_RULES))
    if args.format == "json":
        doc = {"trace": args.trace, "allocator": config.describe(), "repeat": args.repeat, "shapes": [
            {"scale": r.scale, "tokens": r.tokens, "verdict": r.verdict, "by_rule": r.by_rule,
             "realised": r.realised, "latent": r.latent, "segments": r.segments,
             "allocs_scaled": r.allocs_scaled, "allocs_unscaled": r.allocs_unscaled,
             "events_dropped": r.dropped,
             "collisions": [{"rank": f.rank, "step": f.step, "line": f.line, "site": _site(f),
                             "op": (f.op or {}).get("op") or (f.op or {}).get("kind")}
                            for f in r.findings if f.rule in REALISED_RULES]}
            for r in results]}
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        headers = ["scale", "tokens", "reuse-in-flight\n(realised)", "free-in-flight\n(latent)",
                   "transient-in-window\n(latent)", *other_rules, "verdict"]
        rows = [[f"x{r.scale:g}", r.tokens, r.by_rule.get("reuse-in-flight", 0),
                 r.by_rule.get("free-in-flight", 0), r.by_rule.get("transient-in-window", 0),
                 *[r.by_rule.get(o, 0) for o in other_rules], r.verdict] for r in results]
        print(f"hazsan sweep {args.trace}: step replayed {args.repeat}x per shape, allocator "
              f"{config.describe()}")
        print(tabulate(rows, headers=headers, tablefmt="github"))
        for r in results:
            sites = sorted({_site(f) for f in r.findings if f.rule in REALISED_RULES})
            if sites:
                print(f"x{r.scale:g} ({r.tokens} tokens) collides at: " + ", ".join(sites))
        first = results[0]
        if first.allocs_unscaled and not first.allocs_scaled:
            print("note: no alloc in the step carries a shape with the token count; nothing was scaled")
        if any(r.dropped for r in results):
            print(f"note: {results[0].dropped} free/record_stream/free_done event(s) of blocks from "
                  "steps outside the replay were dropped")
        if any(r.realised for r in results) and all(r.latent for r in results):
            print("The hazard is present at every shape; only the shapes marked COLLIDES corrupt data "
                  "with this allocator state.")
    return 1 if any(r.realised for r in results) else 0


def _report_schedule(args, config, r) -> int:
    """One replay along a schedule: which of its steps collide (index in the schedule, tokens)."""
    import orjson

    from sanitizer.place.sweep import REALISED_RULES
    first = r.recorded_step
    colliding = sorted({f.step - first for f in r.findings
                        if f.rule in REALISED_RULES and isinstance(f.step, int)})
    if args.format == "json":
        doc = {"trace": args.trace, "allocator": config.describe(), "schedule": args.schedule,
               "by_rule": r.by_rule, "realised": r.realised, "latent": r.latent,
               "colliding_steps": [{"index": i, "tokens": args.schedule[i]} for i in colliding
                                   if 0 <= i < len(args.schedule)],
               "collisions": [{"rank": f.rank, "index": f.step - first, "line": f.line, "site": _site(f)}
                              for f in r.findings if f.rule in REALISED_RULES]}
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(f"hazsan sweep {args.trace}: step replayed along a schedule of {len(args.schedule)} steps "
              f"({min(args.schedule)} to {max(args.schedule)} tokens), allocator {config.describe()}")
        print(f"findings: {dict(sorted(r.by_rule.items())) or 'none'}")
        if colliding:
            print("COLLIDES at step(s) " + ", ".join(f"{i} ({args.schedule[i]} tokens)" for i in colliding
                                                     if 0 <= i < len(args.schedule)))
        else:
            print("no step of the schedule collides")
    return 1 if r.realised else 0

