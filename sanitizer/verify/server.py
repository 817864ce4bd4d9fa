"""What the server says about itself: which engine, which model, its speculative depth, its batch.

* SGLang 0.5.23 (srt/entrypoints/http_server.py): `GET /server_info` (and the deprecated
  `/get_server_info`, older releases' only one) returns `ServerArgs.resolved_dict()` plus the
  scheduler's info and `version` (srt/utils/common.py `build_server_info`): `speculative_algorithm`
  (null, "NGRAM", "EAGLE", ...), `speculative_num_draft_tokens` (the tokens one verify step checks,
  the verified one included, so at most that many are accepted a step: tokenizer_manager.py
  proposes `speculative_num_draft_tokens - 1` drafts a step), `tp_size`, `max_running_requests`.
* vLLM 0.32: `GET /v1/models` (the model id, `max_model_len`); the depth from
  `GET /server_info?config_format=json` (vllm/entrypoints/serve/dev/server_info: only with
  VLLM_SERVER_DEV_MODE=1) `vllm_config.speculative_config.num_speculative_tokens`, else from
  /metrics: one `vllm:spec_decode_num_accepted_tokens_per_pos_total` series per draft position.
* Anything else that answers `/v1/models`: an OpenAI-compatible server of unknown depth.
"""
from __future__ import annotations

from dataclasses import dataclass

from sanitizer.verify.http import Client, HttpFailure


@dataclass
class ServerFacts:
    engine: str = "unknown"  # "sglang", "vllm", "openai" (answers /v1/models only)
    version: str | None = None
    model: str | None = None  # the id /v1/models lists (the OpenAI APIs' "model")
    speculative: str | None = None  # "NGRAM", "EAGLE", "ngram", ...; None: off or unknown
    speculative_known: bool = False  # the server said whether it speculates
    max_accept: int | None = None  # the most tokens one verify step can yield (the window)
    depth_source: str | None = None  # where max_accept came from
    tp_size: int | None = None
    max_running: int | None = None
    info_endpoint: str | None = None

    def depth_text(self) -> str:
        if not self.speculative_known and self.max_accept is None:
            return "speculative depth unknown (the server does not say)"
        if self.speculative_known and not self.speculative:
            return "speculative decoding off"
        what = self.speculative or "speculative decoding"
        if self.max_accept is None:
            return f"{what}, depth unknown"
        return (f"{what}, {self.max_accept - 1} draft token(s) a step: at most {self.max_accept} tokens "
                f"accepted a step (from {self.depth_source})")

    def to_dict(self) -> dict:
        return {"engine": self.engine, "version": self.version, "model": self.model,
                "speculative": self.speculative, "speculative_known": self.speculative_known,
                "max_accept": self.max_accept, "depth_source": self.depth_source, "tp_size": self.tp_size,
                "max_running": self.max_running, "info_endpoint": self.info_endpoint}


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def from_sglang_info(info: dict, endpoint: str) -> ServerFacts:
    facts = ServerFacts(engine="sglang", info_endpoint=endpoint, speculative_known="speculative_algorithm" in info)
    facts.version = info.get("version") if isinstance(info.get("version"), str) else None
    algo = info.get("speculative_algorithm")
    facts.speculative = algo if isinstance(algo, str) and algo and algo.upper() != "NONE" else None
    if facts.speculative:
        n = _int(info.get("speculative_num_draft_tokens"))
        if n:
            facts.max_accept, facts.depth_source = n, f"{endpoint} speculative_num_draft_tokens"
    facts.tp_size = _int(info.get("tp_size"))
    facts.max_running = _int(info.get("max_running_requests"))
    if not facts.max_running:
        # the scheduler's resolved value (scheduler_info), when the argument was left unset
        for state in info.get("internal_states") or []:
            if isinstance(state, dict) and _int(state.get("max_running_requests")):
                facts.max_running = state["max_running_requests"]
                break
    served = info.get("served_model_name") or info.get("model_path")
    facts.model = served if isinstance(served, str) else None
    return facts


def from_vllm_config(info: dict, facts: ServerFacts) -> None:
    cfg = info.get("vllm_config")
    if not isinstance(cfg, dict):
        return
    spec = cfg.get("speculative_config")
    facts.speculative_known = True
    if isinstance(spec, dict):
        facts.speculative = spec.get("method") if isinstance(spec.get("method"), str) else "speculative"
        k = _int(spec.get("num_speculative_tokens"))
        if k:
            facts.max_accept, facts.depth_source = k + 1, "/server_info vllm_config.speculative_config.num_speculative_tokens"
    sched = cfg.get("scheduler_config")
    if isinstance(sched, dict) and _int(sched.get("max_num_seqs")):
        facts.max_running = sched["max_num_seqs"]
    par = cfg.get("parallel_config")
    if isinstance(par, dict) and _int(par.get("tensor_parallel_size")):
        facts.tp_size = par["tensor_parallel_size"]


def probe(client: Client) -> ServerFacts:
    """Raises HttpFailure("unreachable"/"timeout") when nothing answers."""
    facts = None
    last: HttpFailure | None = None
    for endpoint in ("/server_info", "/get_server_info"):
        try:
            info = client.get_json(endpoint, timeout=min(client.timeout, 30))
        except HttpFailure as exc:
            if exc.kind in ("unreachable", "timeout"):
                raise
            last = exc
            continue
        if isinstance(info, dict) and ("speculative_algorithm" in info or "tp_size" in info):
            facts = from_sglang_info(info, endpoint)
            break
        if isinstance(info, dict) and "vllm_config" in info:
            break  # vLLM's dev-mode endpoint, in text: asked again below for JSON
    try:
        models = client.get_json("/v1/models", timeout=min(client.timeout, 30))
    except HttpFailure as exc:
        if facts is None:
            raise HttpFailure(exc.kind, f"neither SGLang's /server_info nor an OpenAI /v1/models answers "
                                        f"({last or exc}; {exc})", exc.status) from None
        models = None
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("id"), str):
        if facts is None:
            facts = ServerFacts(engine="vllm" if data[0].get("owned_by") == "vllm" else "openai")
        facts.model = data[0]["id"]
    elif facts is None:
        raise HttpFailure("not-json", f"{client.base}/v1/models: no model listed: not an SGLang or vLLM server?")
    if facts.engine == "vllm" and facts.info_endpoint is None:
        try:
            info = client.get_json("/server_info?config_format=json", timeout=min(client.timeout, 30))
            if isinstance(info, dict):
                facts.info_endpoint = "/server_info"
                from_vllm_config(info, facts)
        except HttpFailure:
            pass  # dev-mode endpoint off (the default): the depth comes from /metrics
    return facts
