"""`hazsan native build|status`: the native allocation recorder (sanitizer/capture/native)."""
from __future__ import annotations

import json
import sys
import time

HELP = "build the native allocation recorder for the installed torch, or say whether capture can use it"


def add_arguments(p) -> None:
    p.add_argument("action", choices=("build", "status"),
                   help="build: compile it into the cache (about 30 s; a no-op when built); "
                        "status: print whether this environment can use it, as JSON")


def run(args) -> int:
    from sanitizer.capture import native
    try:
        import torch
    except ImportError:
        print("hazsan native: torch is not installed here", file=sys.stderr)
        return 2
    if args.action == "status":
        print(json.dumps(native.status(torch), indent=2))
        return 0
    t = time.monotonic()
    try:
        module = native.load(torch, build=True)
    except native.NativeUnavailable as exc:
        print(f"hazsan native: not built: {exc}. Capture records allocations with its dispatch mode "
              f"(slower on host-bound programs: docs/capture.md, \"The native recorder\").", file=sys.stderr)
        return 2
    print(f"hazsan native: ready ({module.__file__}, {time.monotonic() - t:.1f} s)")
    return 0
