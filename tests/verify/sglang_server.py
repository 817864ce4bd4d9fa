"""A real SGLang server on loopback for the opt-in end-to-end tests and the benchmark
(`python -m sglang.launch_server`, in the venv of `make test-sglang`), started and stopped here."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "examples" / "sglang_e2e" / "cpu_setup"
SGLANG_MHC = ROOT / "examples" / "sglang_mhc"
VLLM_MHC = ROOT / "examples" / "vllm_mhc"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(tp: int) -> dict:
    """examples/sglang_e2e/run.py's environment: cpu_setup on the path, the CPU engine, offline."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    env.update(PYTHONPATH=os.pathsep.join([str(SETUP)] + [p for p in [env.get("PYTHONPATH")] if p]),
               SGLANG_USE_CPU_ENGINE="1", SGLANG_CPU_OMP_THREADS_BIND="|".join(str(r) for r in range(tp)),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def mhc_env(variant: str, out: Path) -> dict:
    """examples/sglang_mhc/proof.py's environment for the mHC model package (stock or fixed)."""
    env = base_env(2)
    env["PYTHONPATH"] = os.pathsep.join([str(SGLANG_MHC), str(VLLM_MHC), env["PYTHONPATH"]])
    env.update(SGLANG_EXTERNAL_MODEL_PACKAGE="hazsan_sglang_mhc", HAZSAN_MHC_VARIANT=variant, HAZSAN_MHC_OUT=str(out))
    return env


@contextlib.contextmanager
def launch(args: dict, env: dict, work: Path, timeout: float = 600, python: str = sys.executable):
    """Yields (base URL, log path, process); SIGTERM (SGLang's own graceful stop) at the end."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    argv = [python, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port), "--skip-server-warmup"]
    for k, v in args.items():
        argv += ["--" + k.replace("_", "-")] + ([] if v is True else [str(v)])
    log_path = work / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(argv, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}: {log_path.read_text(errors='replace')[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in {timeout:.0f} s")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        yield base, log_path, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the schedulers go with it
                proc.wait()
        log.close()


def get_json(base: str, path: str):
    with urllib.request.urlopen(base + path, timeout=30) as r:
        return json.loads(r.read())
