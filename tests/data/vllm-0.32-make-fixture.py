"""Writes tests/data/vllm-0.32-specdecode.log (and -color.log) with vLLM 0.32's own code.

    .venv-e2e/bin/python tests/data/vllm-0.32-make-fixture.py tests/data

No engine runs: vLLM's logging is configured as a server configures it (`configure_logging`,
the process named `APIServer` as `vllm serve` names it), two per-engine `LoggingStatLogger`s
(data parallel 2, as `PerEngineStatLoggerAdapter` holds them) are fed `SchedulerStats` with
`SpecDecodingStats` (k = 3 draft tokens) and `IterationStats`, and their `log()` writes the stats
line and the `SpecDecoding metrics` line exactly as a server does. Only the clock is stepped by
10 s per interval (VLLM_LOG_STATS_INTERVAL's default): the loggers' `time.monotonic` (so the
throughputs are those of a 10 s interval) and the log records' time (from 2026-03-01 10:00:00
UTC); the pid is this run's. The lines before the first stats line are what `VllmConfig()` logs
on this CPU build.

The story, per 10 s interval: engine 0 decodes well (accept length ~3.4 of 4) at 8, 32 and 64
running requests, then collapses (1.15, 1.30) with 64 running, then finishes its last requests
(Running: 0, accept 1.10: not under load); engine 1 decodes well throughout. Interval 4 has one
engine-0 interval with no drafts at all (stats line, no spec line).
"""
from __future__ import annotations

import io
import os
import sys


def main(out_dir: str) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    for color in (False, True):
        os.environ["VLLM_LOGGING_COLOR"] = "1" if color else "0"
        buf = io.StringIO()
        _run(buf)
        name = "vllm-0.32-specdecode-color.log" if color else "vllm-0.32-specdecode.log"
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.write(buf.getvalue())


def _run(buf: io.StringIO) -> None:
    import vllm.logger as vlog
    import vllm.v1.metrics.loggers as loggers_mod
    import vllm.v1.spec_decode.metrics as spec_mod
    from vllm.config import VllmConfig
    from vllm.config.logging import LoggingConfig
    from vllm.v1.metrics.loggers import LoggingStatLogger
    from vllm.v1.metrics.stats import IterationStats, PrefixCacheStats, SchedulerStats
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    vlog.configure_logging(LoggingConfig(log_level="INFO"))
    vlog.set_vllm_process_name("APIServer")
    import logging
    import time
    handler = logging.getLogger("vllm").handlers[0]
    handler.setStream(buf)  # the server writes to stdout; here into the fixture

    class Clock:  # the loggers' time.monotonic and the records' wall time, stepped per interval
        now = 1000.0
        wall = 1772359200.0  # 2026-03-01 10:00:00 UTC

        @classmethod
        def monotonic(cls):
            return cls.now

    factory = logging.getLogRecordFactory()  # vLLM's, which names the process

    def stamped(*args, **kwargs):
        record = factory(*args, **kwargs)
        record.created = Clock.wall + (Clock.now - 1000.0)
        record.msecs = 0.0
        return record

    os.environ["TZ"] = "UTC"
    time.tzset()
    logging.setLogRecordFactory(stamped)

    loggers_mod.time = Clock
    spec_mod.time = Clock

    cfg = VllmConfig()
    engines = [LoggingStatLogger(cfg, engine_index=i) for i in (0, 1)]
    k = 3
    # (running, waiting, kv usage, drafts, accepted-per-draft pattern) per engine per interval
    story = {
        0: [(8, 0, 0.05, 400, [3, 3, 2, 3, 1]), (32, 0, 0.21, 1500, [3, 2, 3, 3, 2]),
            (64, 4, 0.44, 2600, [3, 3, 2, 3, 2]), (64, 0, 0.45, None, None),
            (64, 2, 0.45, 2900, [0, 0, 0, 1, 0, 0, 0]), (64, 0, 0.46, 2800, [0, 1, 0, 0, 1, 0, 0, 0, 1, 0]),
            (0, 0, 0.00, 30, [0, 0, 0, 0, 0, 0, 0, 0, 0, 1])],
        1: [(16, 0, 0.10, 800, [3, 3, 2, 3]), (32, 0, 0.20, 1500, [3, 2, 3, 3, 3]),
            (60, 0, 0.40, 2500, [2, 3, 3, 3]), (60, 0, 0.41, 2500, [3, 3, 2, 3]),
            (61, 1, 0.42, 2500, [3, 3, 3, 2]), (58, 0, 0.40, 2400, [3, 2, 3, 3]),
            (40, 0, 0.30, 1800, [3, 3, 2, 3])],
    }
    for interval in range(7):
        Clock.now += 10.0
        for idx, lg in enumerate(engines):
            running, waiting, kv, drafts, pattern = story[idx][interval]
            spec = None
            if drafts is not None:
                spec = SpecDecodingStats.new(k)
                for d in range(drafts):
                    spec.observe_draft(k, pattern[d % len(pattern)])
            prefix = PrefixCacheStats(requests=running, queries=1000, hits=125)
            sched = SchedulerStats(num_running_reqs=running, num_waiting_reqs=waiting, kv_cache_usage=kv,
                                   prefix_cache_stats=prefix, spec_decoding_stats=spec)
            it = IterationStats()
            it.num_generation_tokens = (drafts or 0) * 3 + running * 5
            lg.record(sched, it, engine_idx=idx)
        for lg in engines:
            lg.log()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
