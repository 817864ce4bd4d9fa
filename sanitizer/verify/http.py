"""The few HTTP calls verify makes, over the standard library (urllib): a bounded load of plain
JSON requests needs no client library. Every call has a timeout and a cap on the reply's size, and
every failure is one `HttpFailure` that says what happened in words."""
from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request

DEFAULT_MAX_BYTES = 16 << 20  # a generate reply is a few KiB; SGLang's /server_info about 45 KiB


class HttpFailure(Exception):
    """`kind`: "unreachable" (no connection: refused, reset, DNS), "timeout", "status" (an HTTP error
    status; `status` holds it), "too-large", "not-json"."""

    def __init__(self, kind: str, message: str, status: int | None = None):
        self.kind = kind
        self.status = status
        super().__init__(message)


class Client:
    def __init__(self, base: str, timeout: float = 60.0, max_bytes: int = DEFAULT_MAX_BYTES):
        self.base = base.rstrip("/")
        self.timeout = timeout
        self.max_bytes = max_bytes

    def _call(self, path: str, body: dict | None, timeout: float | None) -> bytes:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data,
                                     headers={"Content-Type": "application/json", "Accept": "application/json, text/plain"})
        url = self.base + path
        try:
            with urllib.request.urlopen(req, timeout=self.timeout if timeout is None else timeout) as r:
                raw = r.read(self.max_bytes + 1)
        except urllib.error.HTTPError as exc:
            try:
                detail = exc.read(2000).decode("utf-8", "replace").strip()
            except OSError:
                detail = ""
            raise HttpFailure("status", f"{url}: HTTP {exc.code}{': ' + detail[:300] if detail else ''}",
                              exc.code) from None
        except (socket.timeout, TimeoutError) as exc:
            raise HttpFailure("timeout", f"{url}: no reply in {self.timeout if timeout is None else timeout:g} s") from exc
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise HttpFailure("timeout", f"{url}: no reply in {self.timeout if timeout is None else timeout:g} s") from None
            raise HttpFailure("unreachable", f"{url}: {getattr(reason, 'strerror', None) or reason}") from None
        except OSError as exc:  # the connection reset while the reply was read
            raise HttpFailure("unreachable", f"{url}: {exc.strerror or exc}") from None
        except http.client.HTTPException as exc:  # a reply cut short or not HTTP (the server died mid-reply)
            raise HttpFailure("unreachable", f"{url}: broken reply ({type(exc).__name__}: {exc})") from None
        if len(raw) > self.max_bytes:
            raise HttpFailure("too-large", f"{url}: reply over {self.max_bytes:,} bytes (--max-response-bytes)")
        return raw

    def get_text(self, path: str, timeout: float | None = None) -> str:
        return self._call(path, None, timeout).decode("utf-8", "replace")

    def get_json(self, path: str, timeout: float | None = None):
        return self._json(path, self._call(path, None, timeout))

    def post_json(self, path: str, body: dict, timeout: float | None = None):
        return self._json(path, self._call(path, body, timeout))

    def _json(self, path: str, raw: bytes):
        try:
            return json.loads(raw)
        except ValueError:
            text = raw[:120].decode("utf-8", "replace")
            raise HttpFailure("not-json", f"{self.base + path}: the reply is not JSON: {text!r}") from None
