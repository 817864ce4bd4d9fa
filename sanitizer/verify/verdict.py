"""The verdict on what the load saw: the signature, clean, or no verdict (exit 1, 0, 2).

A *sample* is one reading of acceptance: a request's own accept length (SGLang's meta_info), a
/metrics interval, or a log decode interval (logscan's). It is *under load* when at least
`min_running` requests ran (the log's #running-req or vLLM's Running, the metrics' running gauge,
for a request the fewest of the load's requests in flight while it ran) and it is not the log's
cold-start step (logscan's rule). It is *flagged* when under load its accept length is at or below

    limit = min(threshold, collapse x baseline)

the absolute signature (2.0: at most one draft token in two accepted), made stricter when the
content accepts little even at one request at a time (the baseline): a correct server's
acceptance does not fall with the batch (greedy verification accepts the same drafts), while the
incident's collisions land at the token counts full batches make.
"""
from __future__ import annotations

from dataclasses import dataclass, field

EXIT_CLEAN, EXIT_SIGNATURE, EXIT_UNUSABLE = 0, 1, 2
SOURCES = ("log", "metrics", "request")  # the order they are reported in: the finest grained first
SOURCE_NAMES = {"request": "per request (meta_info.spec_accept_length)",
                "metrics": "/metrics", "log": "server log"}


@dataclass(slots=True)
class Sample:
    t: float  # seconds since the session started
    phase: str  # "baseline", "load", "prose"
    source: str  # "request", "metrics", "log"
    accept_len: float
    running: int | None
    cold: bool = False
    where: str = ""

    def to_dict(self) -> dict:
        d = {"t": round(self.t, 3), "phase": self.phase, "source": self.source,
             "accept_len": round(self.accept_len, 4), "running": self.running}
        if self.cold:
            d["cold_start"] = True
        if self.where:
            d["where"] = self.where
        return d


@dataclass
class Criterion:
    threshold: float
    min_running: int
    collapse: float
    baseline: float | None

    @property
    def limit(self) -> float:
        if self.baseline is None:
            return self.threshold
        return min(self.threshold, self.collapse * self.baseline)

    def under_load(self, s: Sample) -> bool:
        return s.phase == "load" and not s.cold and s.running is not None and s.running >= self.min_running

    def flagged(self, s: Sample) -> bool:
        return self.under_load(s) and s.accept_len <= self.limit + 1e-9


@dataclass
class Verdict:
    code: int
    headline: str  # "SIGNATURE", "CLEAN", "NO VERDICT"
    text: str
    flagged: list[Sample] = field(default_factory=list)
    under_load: int = 0
    by_source: dict = field(default_factory=dict)  # source -> {"under_load", "flagged", "min", "median"}

    def to_dict(self) -> dict:
        return {"exit": self.code, "verdict": self.headline.lower().replace(" ", "_"), "text": self.text,
                "under_load": self.under_load, "flagged": len(self.flagged), "by_source": self.by_source}


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def by_source(samples: list[Sample], crit: Criterion) -> dict:
    out = {}
    for src in SOURCES:
        under = [s.accept_len for s in samples if s.source == src and crit.under_load(s)]
        seen = [s for s in samples if s.source == src]
        if not seen:
            continue
        out[src] = {"samples": len(seen), "under_load": len(under),
                    "flagged": sum(1 for s in samples if s.source == src and crit.flagged(s)),
                    "min": min(under) if under else None, "median": _median(under)}
    return out


def judge(samples: list[Sample], crit: Criterion, *, ok_requests: int, failed_requests: int,
          first_error: str | None, stopped: str | None, speculative_off: str | None,
          min_intervals: int, max_running_seen: int | None) -> Verdict:
    """`stopped`: why the load ended early other than the verdict (the server stopped answering);
    `speculative_off`: the server's own word that it does not speculate (None: it did not say)."""
    table = by_source(samples, crit)
    flagged = [s for s in samples if crit.flagged(s)]
    under = sum(1 for s in samples if crit.under_load(s))
    v = Verdict(EXIT_UNUSABLE, "NO VERDICT", "", flagged, under, table)
    limit = crit.limit
    if not ok_requests:
        v.text = f"no request succeeded ({failed_requests} failed): {first_error or 'no request was sent'}"
        return v
    if not samples:
        if speculative_off:
            v.text = f"not a speculative server ({speculative_off}): it has no accept length, so no signature"
        else:
            v.text = ("no acceptance observed: the replies carry no spec_accept_length, /metrics no speculative-"
                      "decoding metric and the log (--log) no accept length: speculative decoding is off, or the "
                      "server shows it nowhere this can read (SGLang: --enable-metrics; --log FILE)")
        return v
    if crit.baseline is not None and crit.baseline <= crit.threshold:
        v.text = (f"the load cannot show the signature: at one request at a time these prompts accept only "
                  f"{crit.baseline:.2f} tokens a step (<= {crit.threshold:.2f}), so a collapse under load could "
                  "not be told from the content. Either the content accepts little on this model (use prompts it "
                  "accepts more of: --prompts FILE), or the server is broken at one request too: if these prompts "
                  "accept more on a server you trust, --baseline-requests 0 judges by the absolute signature alone")
        return v
    if flagged:
        where = ", ".join(f"{src}: {row['flagged']}" for src, row in table.items() if row["flagged"])
        v.code, v.headline = EXIT_SIGNATURE, "SIGNATURE"
        v.text = (f"signature: {len(flagged)} of {under} intervals <= {limit:.2f} at >= {crit.min_running} running "
                  f"({where}); capture with HAZSAN=1 and run hazsan check")
        if crit.baseline is not None:
            v.text += f" (baseline at one request at a time: {crit.baseline:.2f})"
        return v
    if stopped:
        v.text = f"{stopped}; {under} interval(s) under load seen, none flagged: not enough to call the server clean"
        return v
    if failed_requests > ok_requests:
        v.text = (f"the server failed {failed_requests} of {failed_requests + ok_requests} requests "
                  f"(first: {first_error}): not enough load to judge")
        return v
    if under < min_intervals:
        most = "none" if max_running_seen is None else str(max_running_seen)
        v.text = (f"too little load: {under} interval(s) with >= {crit.min_running} requests running (the most "
                  f"seen running: {most}; --min-intervals {min_intervals}): raise --concurrency or --duration, "
                  "or check the server's max running requests")
        return v
    lowest = min(s.accept_len for s in samples if crit.under_load(s))
    v.code, v.headline = EXIT_CLEAN, "CLEAN"
    v.text = f"clean: {under} intervals under load (>= {crit.min_running} running), min accept len {lowest:.2f}"
    return v
