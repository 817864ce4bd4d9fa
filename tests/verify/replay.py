"""An in-process HTTP server on loopback that plays a serving engine back to `hazsan verify`:
recorded replies (tests/verify/data/, re-recorded by record_sglang.py from real SGLang 0.5.23) or
hand-written ones (labelled so where a test makes them), with the faults the tests need: a reply
status, a delay, a reply body of any size, death after N requests."""
from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
SGLANG = DATA / "sglang-0.5.23"
VLLM = DATA / "vllm-0.32"


def recorded(kind: str, name: str):
    """A recorded reply body (JSON files hold {"status", "body"}; metrics.txt and server.log are text).
    `kind`: "spec" or "nospec" (SGLang's two servers), "vllm"."""
    path = (VLLM if kind == "vllm" else SGLANG / kind) / name
    if path.suffix == ".json":
        return json.loads(path.read_text())["body"]
    return path.read_text()


def advance_sglang_metrics(page: str, verify_calls: float, running: float, accept_len: float | None = None) -> str:
    """The recorded /metrics page with its counter sglang:spec_verify_calls_total, the gauge
    sglang:num_running_reqs (and sglang:spec_accept_length) set to these values: what the page shows
    as the server works (the recording is one moment)."""
    page = re.sub(r"^(sglang:spec_verify_calls_total\{[^}]*\}) \S+$", rf"\1 {verify_calls}", page, flags=re.M)
    page = re.sub(r"^(sglang:num_running_reqs\{[^}]*\}) \S+$", rf"\1 {running}", page, flags=re.M)
    if accept_len is not None:
        page = re.sub(r"^(sglang:spec_accept_length\{[^}]*\}) \S+$", rf"\1 {accept_len}", page, flags=re.M)
    return page


class Replay:
    """routes: {"GET /path": handler} where handler(replay, body) -> (status, bytes|str|obj[, content type]).

    `generate_count` counts POSTs; `inflight` is the requests being answered now."""

    def __init__(self, routes: dict, delay: float = 0.0):
        self.routes = routes
        self.delay = delay
        self.posts = 0
        self.inflight = 0
        self.max_inflight = 0
        self.lock = threading.Lock()
        replay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _serve(self, method: str):
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                path = self.path
                handler = replay.routes.get(f"{method} {path}") or replay.routes.get(f"{method} {path.split('?')[0]}")
                if handler is None:
                    self._reply(404, {"detail": "Not Found"})
                    return
                with replay.lock:
                    if method == "POST":
                        replay.posts += 1
                    replay.inflight += 1
                    replay.max_inflight = max(replay.max_inflight, replay.inflight)
                try:
                    if replay.delay and method == "POST":
                        time.sleep(replay.delay)
                    self._reply(*handler(replay, body))
                finally:
                    with replay.lock:
                        replay.inflight -= 1

            def _reply(self, status, payload, ctype="application/json"):
                if isinstance(payload, (bytes, bytearray)):
                    data = bytes(payload)
                elif isinstance(payload, str):
                    data, ctype = payload.encode(), "text/plain; version=0.0.4"
                else:
                    data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up (its size cap or timeout)

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        """The server dies: its socket closes, new connections are refused."""
        self.server.shutdown()
        self.server.server_close()

    def __exit__(self, *exc):
        try:
            self.stop()
        except OSError:
            pass


def sglang_routes(kind: str = "spec", accept_len=None, metrics=True, reply: str = "generate_ids.json") -> dict:
    """Recorded SGLang 0.5.23 replies. `accept_len(replay) -> float | None`: the per-request
    spec_accept_length to put in the recorded /generate reply instead of its own (None: as recorded)."""
    info = recorded(kind, "server_info.json")
    models = recorded(kind, "models.json")
    gen = recorded(kind, reply)
    page = recorded(kind, "metrics.txt")
    state = {"calls": 0.0}

    def generate(replay, body):
        reply = json.loads(json.dumps(gen))
        if accept_len is not None and "spec_accept_length" in reply["meta_info"]:
            value = accept_len(replay)
            if value is not None:
                reply["meta_info"]["spec_accept_length"] = value
        return 200, reply

    def get_metrics(replay, body):
        if kind != "spec":
            return 200, page
        state["calls"] += 10 * max(replay.posts, 1)
        current = None if accept_len is None else accept_len(replay)
        return 200, advance_sglang_metrics(page, state["calls"], replay.inflight - 1, current)  # less this GET

    routes = {"GET /server_info": lambda r, b: (200, info), "GET /get_server_info": lambda r, b: (200, info),
              "GET /v1/models": lambda r, b: (200, models), "POST /generate": generate}
    if metrics:
        routes["GET /metrics"] = get_metrics
    return routes


def advance_vllm_metrics(page: str, drafts: float, accepted: float, running: float) -> str:
    """The recorded vLLM /metrics page with its spec-decode counters and running gauge set to these values."""
    for name, value in (("vllm:spec_decode_num_drafts_total", drafts),
                        ("vllm:spec_decode_num_draft_tokens_total", 3 * drafts),
                        ("vllm:spec_decode_num_accepted_tokens_total", accepted),
                        ("vllm:num_requests_running", running)):
        page = re.sub(rf"^({re.escape(name)}\{{[^}}]*\}}) \S+$", rf"\g<1> {value}", page, flags=re.M)
    return page


def vllm_routes(accepted_per_draft, dev_mode: bool = False) -> dict:
    """Recorded vLLM 0.32 replies (/v1/models, /v1/completions, /metrics; /server_info only in dev mode,
    as vLLM serves it). `accepted_per_draft(replay)`: the accepted tokens per draft (of 3) the
    /metrics counters grow by with each reply (the recording is one moment)."""
    models = recorded("vllm", "models.json")
    completion = recorded("vllm", "completions.json")
    info = recorded("vllm", "server_info.json")
    page = recorded("vllm", "metrics.txt")
    state = {"drafts": 188.0, "accepted": 253.0}  # the recorded page's counters

    def completions(replay, body):
        state["drafts"] += 10
        state["accepted"] += 10 * accepted_per_draft(replay)
        return 200, completion

    routes = {"GET /v1/models": lambda r, b: (200, models), "POST /v1/completions": completions,
              "GET /metrics": lambda r, b: (200, advance_vllm_metrics(page, state["drafts"], state["accepted"],
                                                                      r.inflight - 1))}
    if dev_mode:
        routes["GET /server_info"] = lambda r, b: (200, info)
    return routes
