"""The example's server log: SGLang-format `Decode batch` lines, one per logging interval.

SGLang's scheduler (srt/managers/scheduler_components/metrics_reporter.py, 0.5.x) logs, every
`decode_log_interval` forward steps,

    [2026-03-01 10:00:00 TP0] Decode batch, #running-req: 8, #token: 1234, token usage: 0.06,
    accept len: 3.21, accept rate: 0.74, cuda graph: False, gen throughput (token/s): 45.67, #queue-req: 0

where `accept len` is the mean number of tokens a request gains per verify step over the
interval (accepted drafts plus the target's own token) and `accept rate` the accepted share of
the drafts. This is the log in which the reference fault was first seen: intervals with accept
len at or below 2.0 under load, which `hazsan logscan` flags.

Here the accept length is what the sanitised decode's own verify step measures (drafts compared
with the greedy tokens of its own, possibly corrupted, logits), not the reference's: a corrupted
verify rejects drafts the reference accepts.
"""
from __future__ import annotations

import time

LOG_NAME = "server.log"


class DecodeLog:
    """Accumulates verify steps and writes one `Decode batch` line per `interval` steps."""

    def __init__(self, path: str | None, *, depth: int, interval: int, capacity: int, prefix: str = "TP0",
                 clock=time.time):
        self.path, self.depth, self.interval = path, depth, max(1, int(interval))
        self.capacity, self.prefix, self.clock = capacity, prefix, clock
        self.lines: list[str] = []
        self._reset()
        self._t0 = clock()
        self._file = open(path, "w") if path else None

    def _reset(self) -> None:
        self.steps = self.forward_ct = self.gained = self.drafts_accepted = 0
        self.running = self.cached = 0

    def step(self, running: int, accepted_drafts: list[int], cached_tokens: int) -> None:
        """One verify step: `running` requests, each one's accepted drafts, tokens in the KV cache."""
        self.steps += 1
        self.forward_ct += len(accepted_drafts)
        self.drafts_accepted += sum(accepted_drafts)
        self.gained += sum(accepted_drafts) + len(accepted_drafts)
        self.running, self.cached = running, cached_tokens
        if self.steps >= self.interval:
            self.flush()

    def flush(self) -> None:
        """Write the interval so far (nothing if it is empty)."""
        if not self.forward_ct:
            self._reset()
            return
        now = self.clock()
        accept_len = self.gained / self.forward_ct
        accept_rate = self.drafts_accepted / (self.forward_ct * self.depth) if self.depth else 0.0
        throughput = self.gained / max(now - self._t0, 1e-9)
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
        line = (f"[{stamp} {self.prefix}] Decode batch, #running-req: {self.running}, #token: {self.cached}, "
                f"token usage: {self.cached / self.capacity:.2f}, accept len: {accept_len:.2f}, "
                f"accept rate: {accept_rate:.2f}, cuda graph: False, gen throughput (token/s): {throughput:.2f}, "
                f"#queue-req: 0")
        self.lines.append(line)
        if self._file is not None:
            self._file.write(line + "\n")
            self._file.flush()
        self._t0 = now
        self._reset()

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None
