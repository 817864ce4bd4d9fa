"""`hazsan place TRACE_OR_DIR --out DIR`: put a CPU trace's allocations where a GPU would."""
from __future__ import annotations

import argparse
import os
import sys

HELP = "replay each rank's allocations through the CUDA caching-allocator model and rewrite addresses"

EPILOG = """\
Every alloc, window and buffer address is rewritten to where the model of PyTorch's CUDA caching
allocator (2.4-2.14) places it, and a `segment` event precedes the first allocation in each new
segment; the files keep their names. Absolute addresses come from a deterministic fake driver (real
cudaMalloc addresses are not ordered): offsets within segments and windows are what match a GPU.
Allocations inside a `scope` that names a pool go to that pool; a scope with `comm` makes the pool
symmetric: its segments come from ncclMemAlloc (a second address space) and each is registered as a
window of that communicator when made, as SGLang does (input registrations of such segments are
replaced; a segment registered before anything landed in it is a preallocation and is made too);
when the communicator's window was declared before anything was placed (an arena, as in the CPU
testbed), the pool's segments are carved from it instead. `no_split: true` on the scope (or
--no-split) makes a no_split pool (torch symmetric memory). A block freed
after record_stream stays unavailable until its free_done. PYTORCH_CUDA_ALLOC_CONF keys that change
placement are honoured; unmodelled ones (expandable_segments:True, backend:cudaMallocAsync, ...) are
refused. Input is read as `hazsan check` reads it (JSON Lines or binary .hzs, the same schema): a
line check refuses stops place with check's message, naming file and line; unknown kinds and fields
are dropped with check's warnings. Then run `hazsan check DIR`: its line numbers are those of the
placed files (segment and window events are inserted, input segment events dropped)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("trace", metavar="TRACE_OR_DIR", help="a rank file (.jsonl, .hzs, either .gz) or a directory of them")
    p.add_argument("--out", required=True, metavar="DIR", help="directory for the placed traces (created)")
    p.add_argument("--alloc-conf", metavar="CONF", default=None,
                   help="allocator settings, PYTORCH_CUDA_ALLOC_CONF syntax "
                        "(default: $PYTORCH_ALLOC_CONF, else $PYTORCH_CUDA_ALLOC_CONF, else PyTorch defaults)")
    p.add_argument("--no-split", action="append", default=[], metavar="POOL",
                   help="treat POOL as a no_split pool (torch symmetric memory); repeatable")
    p.add_argument("--quiet", action="store_true", help="print nothing on success")
    from sanitizer.commands._options import add_read_limits
    add_read_limits(p)


def run(args) -> int:
    from pathlib import Path

    from sanitizer.place import AllocatorConfig, ConfigError
    from sanitizer.place.replay import PlaceError, place_file
    from sanitizer.commands._options import limits
    from sanitizer.trace.reader import TraceError, expand_paths
    from sanitizer.trace.schema import jsonl_name

    read_limits = limits(args)

    try:
        config = (AllocatorConfig.parse(args.alloc_conf) if args.alloc_conf is not None
                  else AllocatorConfig.from_env())
    except ConfigError as exc:
        print(f"hazsan place: {exc}", file=sys.stderr)
        return 2
    try:
        files = expand_paths([args.trace])
    except TraceError as exc:
        print(f"hazsan place: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    if any(f.parent.resolve() == out_dir.resolve() for f in files if out_dir.exists()):
        print("hazsan place: --out must differ from the input directory (files keep their names)",
              file=sys.stderr)
        return 2
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"hazsan place: cannot create {out_dir}: {exc}", file=sys.stderr)
        return 2
    for note in config.notes:
        print(f"hazsan place: note: {note}", file=sys.stderr)
    for f in files:
        try:
            stats = place_file(f, out_dir / jsonl_name(f.name), config, no_split_pools=args.no_split,
                               limits=read_limits)
        except (TraceError, PlaceError) as exc:
            print(f"hazsan place: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(f"hazsan place: {f}: {exc}", file=sys.stderr)
            return 2
        for note in stats.notes:
            print(f"hazsan place: warning: {note}", file=sys.stderr)
        if not args.quiet:
            pools = ", ".join(f"{n} ({v['kind']}{', no_split' if v['no_split'] else ''}, {v['source']})"
                              for n, v in stats.pools.items()) or "default only"
            print(f"{f.name}: {stats.allocs} allocs placed in {stats.segments} segments; "
                  f"pools: {pools}; windows: {stats.windows_arena} arena, {stats.windows_synthesized} "
                  f"per symmetric segment ({stats.windows_replaced} input registrations replaced, "
                  f"{stats.preallocated} preallocated), {stats.windows_registered} other registrations; "
                  f"{stats.foreign_buffers} buffer refs outside any block"
                  + (f"; {stats.dropped_segment_events} input segment events replaced"
                     if stats.dropped_segment_events else ""))
    if not args.quiet:
        print(f"wrote {len(files)} file(s) to {os.fspath(out_dir)} (allocator: {config.describe()})")
    return 0
