"""One `hazsan verify` session: probe the server, a baseline at one request at a time, the load at
the concurrency with every acceptance observer running, an optional prose phase, the verdict."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from sanitizer.verify import observers, prompts as prompt_mod
from sanitizer.verify.http import Client, HttpFailure
from sanitizer.verify.load import Load, RequestRecord
from sanitizer.verify.observers import LogFollower, MetricsError, MetricsSnapshot
from sanitizer.verify.server import ServerFacts, probe
from sanitizer.verify.verdict import Criterion, Sample, Verdict, judge

TICK_S = 0.25  # how often the log is read and the stop conditions looked at
MAX_CONCURRENCY = 256


class VerifyError(Exception):
    """No session at all (unreachable server, bad prompts, unreadable log): exit 2."""


@dataclass
class Options:
    url: str
    log: str | None = None
    duration: float = 120.0
    concurrency: int | None = None  # None: the server's max running requests, at most 64; else 16
    api: str = "auto"
    prompts: str | None = None
    prose: bool = False
    max_tokens: int = 256
    threshold: float = 2.0
    min_running: int | None = None  # None: half the concurrency, rounded up
    collapse: float = 0.75
    baseline_requests: int = 4
    stop_after: int = 5
    min_intervals: int = 3
    poll: float = 2.0
    request_timeout: float = 120.0
    max_response_bytes: int = 16 << 20
    max_requests: int = 100_000
    metrics: bool = True
    log_from_start: bool = False


@dataclass
class PhaseStats:
    name: str
    concurrency: int
    started: float = 0.0
    ended: float = 0.0
    requests: int = 0
    failed: int = 0
    completion_tokens: int = 0
    metrics_accept_len: float | None = None  # vLLM: over the phase, from the counters
    running_held: list = field(default_factory=list)  # the load's own in-flight count, sampled each tick

    def to_dict(self) -> dict:
        secs = max(self.ended - self.started, 1e-9)
        held = sorted(self.running_held)
        return {"phase": self.name, "concurrency": self.concurrency, "seconds": round(secs, 2),
                "requests": self.requests, "failed": self.failed, "requests_per_s": round(self.requests / secs, 3),
                "tokens_per_s": round(self.completion_tokens / secs, 1),
                "running_held_median": held[len(held) // 2] if held else None,
                "running_held_min": held[0] if held else None, "metrics_accept_len": self.metrics_accept_len}


@dataclass
class Result:
    options: Options
    facts: ServerFacts
    api: str
    prompt_class: str
    concurrency: int
    criterion: Criterion
    samples: list[Sample] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)
    phases: list[PhaseStats] = field(default_factory=list)
    baseline_source: str | None = None
    metrics_status: str = "not asked"  # what /metrics gave: "spec metrics", "no spec metric", "HTTP 404", ...
    log_status: str = "not given"
    log_rotations: int = 0
    log_unparsed: int = 0
    stopped: str | None = None
    early_stop: str | None = None
    max_running_seen: int | None = None
    elapsed: float = 0.0
    verdict: Verdict | None = None

    def sources(self) -> dict[str, bool]:
        seen = {s.source for s in self.samples}
        return {"request": "request" in seen, "metrics": "metrics" in seen, "log": "log" in seen}


class Session:
    def __init__(self, opts: Options, progress=None):
        self.opts = opts
        self.progress = progress  # called with (Session, phase) every tick; None: silent
        self._t0 = time.monotonic()
        self._lock = threading.Lock()
        self.client = Client(opts.url, timeout=opts.request_timeout, max_bytes=opts.max_response_bytes)
        self.samples: list[Sample] = []
        self.records: list[RequestRecord] = []
        self.phase = "probe"
        self.load: Load | None = None
        self.last_snapshot: MetricsSnapshot | None = None
        self.metrics_ok = False
        self.follower: LogFollower | None = None
        self.criterion: Criterion | None = None

    def clock(self) -> float:
        return time.monotonic() - self._t0

    # ------------------------------------------------------------------ observers
    def _on_record(self, rec: RequestRecord) -> None:
        with self._lock:
            self.records.append(rec)
            f = rec.facts
            if rec.ok and f is not None and f.accept_len is not None and (f.verify_ct or 0) > 0:
                self.samples.append(Sample(rec.ended, rec.phase, "request", f.accept_len, rec.min_inflight))

    def _poll_metrics(self, result: Result) -> MetricsSnapshot | None:
        if not self.metrics_ok:
            return None
        try:
            snap = observers.parse_metrics(self.client.get_text("/metrics", timeout=min(10.0, self.opts.request_timeout)))
        except (HttpFailure, MetricsError) as exc:
            result.metrics_status = f"stopped answering: {exc}"
            return None
        if snap.has_spec:
            result.metrics_status = "speculative-decoding metrics"
        reading = observers.metrics_interval(self.last_snapshot, snap)
        self.last_snapshot = snap
        if reading is not None:
            with self._lock:
                self.samples.append(Sample(self.clock(), self.phase, "metrics", reading.accept_len, reading.running))
        if snap.running is not None:
            r = int(round(snap.running))
            result.max_running_seen = max(result.max_running_seen or 0, r)
        return snap

    def _read_log(self, result: Result) -> None:
        if self.follower is None:
            return
        for reading in self.follower.poll():
            with self._lock:
                self.samples.append(Sample(self.clock(), self.phase, "log", reading.accept_len, reading.running,
                                           reading.cold, reading.where))
            if reading.running is not None:
                result.max_running_seen = max(result.max_running_seen or 0, reading.running)

    def flagged_count(self) -> int:
        crit = self.criterion
        if crit is None:
            return 0
        with self._lock:
            return sum(1 for s in self.samples if crit.flagged(s))

    # ------------------------------------------------------------------ phases
    def _phase(self, result: Result, name: str, prompts: list, concurrency: int, seconds: float,
               max_requests: int) -> PhaseStats:
        self.phase = name
        stats = PhaseStats(name, concurrency, started=self.clock())
        before = self._poll_metrics(result)
        next_poll = self.clock() + self.opts.poll
        load = self.load = Load(self.client, result.api, prompts, concurrency=concurrency,
                                max_tokens=self.opts.max_tokens, model=result.facts.model,
                                deadline=self.clock() + seconds, max_requests=max_requests, phase=name,
                                clock=self.clock, on_record=self._on_record)
        load.start()
        dead_after = max(3, concurrency)
        while load.alive():
            time.sleep(TICK_S)
            self._read_log(result)
            if self.clock() >= next_poll:
                self._poll_metrics(result)
                next_poll = self.clock() + self.opts.poll
            stats.running_held.append(load.inflight)
            if self.progress is not None:
                self.progress(self, name)
            if load.consecutive_failures >= dead_after:
                with self._lock:
                    last = next((r for r in reversed(self.records) if not r.ok), None)
                if last is not None and last.error_kind in ("unreachable", "timeout"):
                    result.stopped = f"the server stopped answering ({last.error})"
                    break
            if name == "load" and self.flagged_count() >= self.opts.stop_after:
                result.early_stop = f"stopped early: {self.opts.stop_after} intervals flagged, the verdict is certain"
                break
            if self.clock() > load.deadline + self.opts.request_timeout + 5:
                break  # a worker stuck past its own request timeout: leave it (a daemon thread)
        load.stop()
        load.join(min(5.0, self.opts.request_timeout))
        self._read_log(result)
        after = self._poll_metrics(result)
        stats.metrics_accept_len = observers.phase_accept_len(before, after)
        stats.ended = self.clock()
        with self._lock:
            mine = [r for r in self.records if r.phase == name]
        stats.requests = len(mine)
        stats.failed = sum(1 for r in mine if not r.ok)
        stats.completion_tokens = sum(r.facts.completion_tokens or 0 for r in mine if r.facts)
        result.phases.append(stats)
        return stats

    def run(self) -> Result:
        o = self.opts
        try:
            load_prompts = prompt_mod.load(o.prompts) if o.prompts else prompt_mod.builtin("code")
            prose = prompt_mod.builtin("prose") if o.prose else None
        except prompt_mod.PromptError as exc:
            raise VerifyError(str(exc)) from None
        try:
            facts = probe(self.client)
        except HttpFailure as exc:
            raise VerifyError(f"cannot reach the server: {exc}") from None
        api = o.api
        if api == "auto":
            api = "generate" if facts.engine == "sglang" else "completions"
        if api == "generate" and facts.engine not in ("sglang",):
            raise VerifyError(f"--api generate is SGLang's /generate, and {o.url} is not an SGLang server "
                              f"({facts.engine}): use --api completions or chat")
        if api != "generate" and not facts.model:
            raise VerifyError(f"{o.url}/v1/models lists no model: the OpenAI APIs need one")
        if api == "chat" and any(p.input_ids is not None for p in load_prompts):
            raise VerifyError("--api chat takes text prompts; the prompt file has token ids (use --api completions or generate)")
        concurrency = o.concurrency or (min(facts.max_running, 64) if facts.max_running else 16)
        concurrency = max(1, min(concurrency, MAX_CONCURRENCY))
        min_running = o.min_running if o.min_running is not None else max(1, (concurrency + 1) // 2)
        result = Result(o, facts, api, "file" if o.prompts else "code", concurrency,
                        Criterion(o.threshold, min_running, o.collapse, None))
        if o.metrics:
            try:
                snap = observers.parse_metrics(self.client.get_text("/metrics", timeout=min(10.0, o.request_timeout)))
                # read on even without a speculative metric yet: SGLang's appear at the first verify step
                self.metrics_ok = snap.engine is not None
                result.metrics_status = "speculative-decoding metrics" if snap.has_spec else (
                    "no speculative-decoding metric" if snap.engine else "no SGLang or vLLM metric")
                if snap.has_spec and facts.max_accept is None:
                    if snap.positions:
                        facts.max_accept, facts.depth_source = snap.positions + 1, "/metrics per-position counters"
                    elif snap.draft_tokens_per_step:
                        facts.max_accept = int(snap.draft_tokens_per_step)
                        facts.depth_source = "/metrics sglang:spec_num_draft_tokens"
                self.last_snapshot = snap
            except HttpFailure as exc:
                result.metrics_status = (f"HTTP {exc.status} (SGLang serves /metrics with --enable-metrics)"
                                         if exc.kind == "status" else str(exc))
            except MetricsError as exc:
                result.metrics_status = str(exc)
        if o.log:
            from sanitizer.logscan import LogScanner
            self.follower = LogFollower(o.log, LogScanner(o.threshold, min_running), from_start=o.log_from_start)
            try:
                self.follower.open()
            except MetricsError as exc:
                raise VerifyError(str(exc)) from None
        budget = o.duration
        if o.baseline_requests:
            secs = max(5.0, budget / 4)
            b = self._phase(result, "baseline", load_prompts, 1, secs, o.baseline_requests)
            budget = max(0.0, budget - (b.ended - b.started))
            result.criterion.baseline, result.baseline_source = self._baseline(b)
        self.criterion = result.criterion
        base = result.criterion.baseline
        if base is not None and base <= o.threshold:
            # the verdict is already "the load cannot show the signature": the load would not change it
            result.early_stop = f"no load after the baseline: it accepts {base:.2f} <= {o.threshold:.2f} one request at a time"
        elif result.stopped is None:
            prose_secs = budget / 4 if prose else 0.0
            self._phase(result, "load", load_prompts, concurrency, budget - prose_secs, o.max_requests)
            # content's effect on acceptance is context for a verdict still open, not after a certain one
            if prose and result.stopped is None and result.early_stop is None and prose_secs > 0:
                self._phase(result, "prose", prose, concurrency, prose_secs, o.max_requests)
        result.samples = sorted(self.samples, key=lambda s: s.t)
        result.records = list(self.records)
        if self.follower is not None:
            result.log_rotations = self.follower.rotations
            result.log_unparsed = self.follower.scanner.result.unparsed_count
            result.log_status = f"{self.follower.lines} lines read"
        result.elapsed = self.clock()
        ok = [r for r in result.records if r.ok and r.phase != "prose"]
        failed = [r for r in result.records if not r.ok and r.phase != "prose"]
        off = None
        if facts.speculative_known and not facts.speculative:
            off = f"{facts.info_endpoint or 'its configuration'} says speculative decoding is off"
        result.verdict = judge([s for s in result.samples if s.phase != "prose"], result.criterion,
                               ok_requests=len(ok), failed_requests=len(failed),
                               first_error=failed[0].error if failed else None, stopped=result.stopped,
                               speculative_off=off, min_intervals=o.min_intervals,
                               max_running_seen=result.max_running_seen or max(
                                   (r.min_inflight for r in ok if r.phase == "load"), default=None))
        return result

    def _baseline(self, phase: PhaseStats) -> tuple[float | None, str | None]:
        """The accept length at one request at a time: per request (SGLang) where the replies carry it,
        else vLLM's counters over the phase, else the metrics or log intervals seen during it."""
        from statistics import median
        with self._lock:
            mine = [s for s in self.samples if s.phase == "baseline"]
        per_request = [s.accept_len for s in mine if s.source == "request"]
        if per_request:
            return median(per_request), "per request"
        if phase.metrics_accept_len is not None:
            return phase.metrics_accept_len, "/metrics counters"
        for src in ("metrics", "log"):
            xs = [s.accept_len for s in mine if s.source == src and not s.cold]
            if xs:
                return median(xs), src
        return None, None
