"""What hostile input may cost hazsan's readers (docs/cli.md, "hazsan check": the limits): one
`Limits` value, its defaults stated here once, handed to whatever reads traces (`open_trace`,
`analyze`, the workers of `--jobs` and `--scheduler`). The command options that set it are
sanitizer.commands._options'.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """0 turns a reading limit off; the engine's limits are at least 1.

    Reading one trace file:
    `max_line_bytes`: the longest line (its newline not counted), or binary frame (its payload).
    Without it `/dev/zero`, or a line that never ends, is read until memory runs out.
    `max_gzip_ratio`: decompressed bytes of a `.gz` file per compressed byte read so far (after
    the first `gzip_ratio_floor` bytes). Deflate reaches about 1000x on repeated bytes; hazsan's
    own traces compress 5-20x.

    What one rank may hold in the engine (an id past one of them is an error on its line):
    `max_streams` distinct stream ids, `max_events` distinct CUDA event ids, `max_comms` distinct
    communicators.
    """

    max_line_bytes: int = 8 << 20
    max_gzip_ratio: float = 200.0
    gzip_ratio_floor: int = 64 << 20
    max_streams: int = 100_000
    max_events: int = 100_000
    max_comms: int = 100_000
