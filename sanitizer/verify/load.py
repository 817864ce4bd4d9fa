"""The load: a fixed number of worker threads, each sending one greedy request after another, so
that the server's running batch stays at the concurrency; bounded in time (no request starts after
the deadline) and in count (max_requests).

The request bodies, per protocol:

* SGLang `/generate` (srt/managers/io_struct.py GenerateReqInput): `text` or `input_ids`,
  `sampling_params` {temperature 0, max_new_tokens, ignore_eos}; the reply's `meta_info` carries
  `completion_tokens` and, with speculative decoding, `spec_accept_length` (completion tokens per
  verify step, bonus token included), `spec_verify_ct`, `spec_accept_rate`
  (srt/managers/tokenizer_manager.py `_calculate_spec_decoding_metrics`);
* OpenAI `/v1/completions` (`prompt`: text or token ids) and `/v1/chat/completions` (`messages`),
  `temperature` 0, `max_tokens`, `ignore_eos` (an extension SGLang and vLLM both accept); their
  replies carry no acceptance, only `usage.completion_tokens`.

`ignore_eos` keeps every request decoding for max_tokens: a batch of requests that stop early
would not stay full.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass

from sanitizer.logscan.parse import MAX_ACCEPT_LEN
from sanitizer.verify.http import Client, HttpFailure
from sanitizer.verify.prompts import Prompt

APIS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}


class ProtocolError(Exception):
    """A reply that is not what the protocol says (status 200 but the wrong body)."""


def request_body(api: str, prompt: Prompt, max_tokens: int, model: str | None) -> dict:
    if api == "generate":
        body = {"input_ids": list(prompt.input_ids)} if prompt.input_ids is not None else {"text": prompt.text}
        body["sampling_params"] = {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": True}
        return body
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    if api == "completions":
        body["prompt"] = list(prompt.input_ids) if prompt.input_ids is not None else prompt.text
    else:
        if prompt.input_ids is not None:
            raise ProtocolError("the chat API takes text, not token ids")
        body["messages"] = [{"role": "user", "content": prompt.text}]
    return body


@dataclass
class ReplyFacts:
    completion_tokens: int | None
    accept_len: float | None = None  # SGLang meta_info.spec_accept_length
    verify_ct: int | None = None
    accept_rate: float | None = None


def _number(meta: dict, key: str, lo: float, hi: float) -> float | None:
    v = meta.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise ProtocolError(f"meta_info.{key} is not a number from {lo:g} to {hi:g}: {str(v)[:40]!r}")
    return float(v)


def parse_reply(api: str, reply) -> ReplyFacts:
    if api == "generate":
        if isinstance(reply, list) and len(reply) == 1:
            reply = reply[0]
        if not isinstance(reply, dict) or not isinstance(reply.get("meta_info"), dict):
            raise ProtocolError("no meta_info in the /generate reply: not SGLang's /generate?")
        meta = reply["meta_info"]
        tokens = _number(meta, "completion_tokens", 0, 1e12)
        verify = _number(meta, "spec_verify_ct", 0, 1e12)
        return ReplyFacts(None if tokens is None else int(tokens), _number(meta, "spec_accept_length", 0, MAX_ACCEPT_LEN),
                          None if verify is None else int(verify), _number(meta, "spec_accept_rate", 0, 1))
    if not isinstance(reply, dict) or not isinstance(reply.get("choices"), list) or not reply["choices"]:
        raise ProtocolError(f"no choices in the {APIS[api]} reply: not an OpenAI-compatible server?")
    usage = reply.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return ReplyFacts(tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None)


@dataclass
class RequestRecord:
    phase: str
    started: float  # seconds since the session started
    ended: float
    min_inflight: int  # the fewest of the load's requests in flight while this one ran (itself included)
    ok: bool
    facts: ReplyFacts | None = None
    error: str | None = None
    error_kind: str | None = None  # HttpFailure.kind, or "protocol"

    def to_dict(self) -> dict:
        d = {"phase": self.phase, "started": round(self.started, 3), "ended": round(self.ended, 3),
             "min_inflight": self.min_inflight, "ok": self.ok}
        if self.facts is not None:
            d.update(completion_tokens=self.facts.completion_tokens, accept_len=self.facts.accept_len,
                     verify_ct=self.facts.verify_ct, accept_rate=self.facts.accept_rate)
        if self.error:
            d.update(error=self.error, error_kind=self.error_kind)
        return d


class Load:
    """`concurrency` daemon threads (a request stuck in a dead server never holds the process)."""

    def __init__(self, client: Client, api: str, prompts: list[Prompt], *, concurrency: int, max_tokens: int,
                 model: str | None, deadline: float, max_requests: int, phase: str, clock, on_record):
        self.client, self.api, self.prompts = client, api, prompts
        self.concurrency, self.max_tokens, self.model = concurrency, max_tokens, model
        self.deadline, self.max_requests, self.phase = deadline, max_requests, phase
        self.clock, self.on_record = clock, on_record
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        self.issued = 0
        self.inflight = 0
        self.consecutive_failures = 0
        self._active: dict[int, int] = {}  # request number -> the fewest in flight seen while it ran
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.concurrency):
            t = threading.Thread(target=self._worker, name=f"hazsan-verify-{self.phase}-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self.stop_event.set()

    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def join(self, timeout: float) -> bool:
        """Wait for the workers; False when some are still in a request after `timeout`."""
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))
        return not self.alive()

    def _next(self) -> tuple[int, Prompt] | None:
        with self._lock:
            if self.stop_event.is_set() or self.issued >= self.max_requests or self.clock() >= self.deadline:
                return None
            n = self.issued
            self.issued += 1
            self.inflight += 1
            for k in self._active:
                self._active[k] = min(self._active[k], self.inflight)
            self._active[n] = self.inflight
            return n, self.prompts[n % len(self.prompts)]

    def _done(self, n: int) -> int:
        with self._lock:
            self.inflight -= 1
            least = self._active.pop(n)
            for k in self._active:
                self._active[k] = min(self._active[k], self.inflight)
            return least

    def _worker(self) -> None:
        path = APIS[self.api]
        while True:
            nxt = self._next()
            if nxt is None:
                return
            n, prompt = nxt
            started = self.clock()
            facts = error = kind = None
            try:
                body = request_body(self.api, prompt, self.max_tokens, self.model)
                facts = parse_reply(self.api, self.client.post_json(path, body))
            except HttpFailure as exc:
                error, kind = str(exc), exc.kind
            except ProtocolError as exc:
                error, kind = f"{self.client.base}{path}: {exc}", "protocol"
            least = self._done(n)
            rec = RequestRecord(self.phase, started, self.clock(), least, error is None, facts, error, kind)
            with self._lock:
                self.consecutive_failures = 0 if rec.ok else self.consecutive_failures + 1
            self.on_record(rec)
            if not rec.ok:
                # a failing server is not hammered: the request count bounds the loop, this its rate
                self.stop_event.wait(0.2)
