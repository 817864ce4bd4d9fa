"""Re-record tests/verify/data/sglang-0.5.23/ from a real SGLang server (what the replay tests serve).

Starts `python -m sglang.launch_server` (SGLang 0.5.23, CPU, the tiny random Llama of
examples/tiny_llama.py with its word-level tokenizer) on a free loopback port, sends the requests
`hazsan verify` sends, and writes each reply as the server gave it:

  spec/      TP=2, NGRAM with 4 draft tokens, --enable-metrics (what verify judges)
  nospec/    TP=1, no speculative decoding, --enable-metrics (verify must say "not speculative")

each with server_info.json (/get_server_info), generate_text.json and generate_ids.json (/generate),
completions.json (/v1/completions), chat.json (/v1/chat/completions: status and body, an error
included), models.json (/v1/models), metrics.txt (/metrics after a concurrent load),
server.log (SGLang's own log) and record.json (what was sent, versions, timings); the path of the
repository on this machine written as `<repo>` (scrub).

    .venv-sglang/bin/python tests/verify/record_sglang.py [--only spec|nospec] [--out DIR]

Needs the venv of `make test-sglang` (.venv-sglang): examples/sglang_e2e/cpu_setup supplies what a
stock CPU install lacks. About 2 minutes per server on 2 idle cores.
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "examples" / "sglang_e2e"))
sys.path.insert(0, str(ROOT / "examples"))
import run as sglang_e2e  # noqa: E402  (examples/sglang_e2e/run.py: server_args, sglang_env)

DATA = HERE / "data" / "sglang-0.5.23"
# A code-like prompt in the tiny tokenizer's words (token i is the word `t<i>`): a repeated
# pattern, so that NGRAM finds drafts as it does in code; and its token ids.
IDS = [1] + [3 + (j * 7) % 40 for j in range(12)] * 3
TEXT = " ".join(f"t{i}" for i in IDS[1:])
GREEDY = {"temperature": 0.0, "max_new_tokens": 32, "ignore_eos": True}


def request(base: str, path: str, body: dict | None = None, timeout: float = 300) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def scrub(out: Path) -> None:
    """This machine's path to the repository, in every recorded file (the model's path in the
    server info, the metrics' labels, the log), becomes `<repo>`: the repository holds no machine
    paths (tests/examples/test_demo.py)."""
    for path in out.iterdir():
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="surrogateescape")
            if str(ROOT) in text:
                path.write_text(text.replace(str(ROOT), "<repo>"), encoding="utf-8", errors="surrogateescape")


def record(name: str, tp: int, spec: bool, out: Path, model: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = sglang_e2e.server_args(str(model), tp, spec)
    argv = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port),
            "--skip-server-warmup", "--enable-metrics"]
    for k, v in args.items():
        argv += ["--" + k.replace("_", "-")] + ([] if v is True else [str(v)])
    base = f"http://127.0.0.1:{port}"
    env = sglang_e2e.sglang_env(tp, None, False, out)
    t0 = time.monotonic()
    log = open(out / "server.log", "w")
    proc = subprocess.Popen(argv, env=env, cwd=out, stdout=log, stderr=subprocess.STDOUT)
    timings = {}
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{name}: server exited {proc.returncode}: see {out / 'server.log'}")
            if time.monotonic() - t0 > 600:
                raise RuntimeError(f"{name}: server not ready in 600 s")
            try:
                if request(base, "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                time.sleep(1)
        timings["startup_s"] = round(time.monotonic() - t0, 1)

        def save(file: str, status: int, body: bytes) -> None:
            try:
                doc = json.loads(body)
            except ValueError:
                doc = body.decode("utf-8", "replace")
            (out / file).write_text(json.dumps({"status": status, "body": doc}, indent=1) + "\n")

        save("server_info.json", *request(base, "/get_server_info"))
        save("models.json", *request(base, "/v1/models"))
        save("generate_text.json", *request(base, "/generate", {"text": TEXT, "sampling_params": GREEDY}))
        save("generate_ids.json", *request(base, "/generate", {"input_ids": IDS, "sampling_params": GREEDY}))
        model_id = json.loads(request(base, "/v1/models")[1])["data"][0]["id"]
        save("completions.json", *request(base, "/v1/completions", {
            "model": model_id, "prompt": TEXT, "max_tokens": 32, "temperature": 0.0}))
        save("chat.json", *request(base, "/v1/chat/completions", {
            "model": model_id, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 32,
            "temperature": 0.0}))
        # a concurrent load (8 = max_running_requests), then the metrics it left
        t = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(lambda i: request(base, "/generate", {
                "input_ids": [1] + [3 + (j * (i + 3)) % 50 for j in range(10)] * 3,
                "sampling_params": GREEDY}), range(16)))
        timings["load_s"] = round(time.monotonic() - t, 1)
        timings["load_requests"] = len(replies)
        status, body = request(base, "/metrics")
        (out / "metrics.txt").write_bytes(body)
        version = json.loads(request(base, "/get_server_info")[1]).get("version")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    (out / "record.json").write_text(json.dumps({
        "server": "sglang", "version": version, "tp": tp, "speculative": "NGRAM" if spec else None,
        "draft_tokens": sglang_e2e.DRAFT_TOKENS if spec else None, "argv": [a if not a.startswith(str(ROOT)) else
                                                                           a.replace(str(ROOT), "<repo>") for a in argv[1:]],
        "text_prompt": TEXT, "ids_prompt": IDS, "sampling": GREEDY, **timings}, indent=1) + "\n")
    scrub(out)
    print(f"{name}: recorded in {out} ({timings})", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DATA)
    ap.add_argument("--only", choices=("spec", "nospec"))
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "verify-record")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.work / "tiny-llama"
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT / 'examples')!r}); "
                    f"from tiny_llama import make_model; make_model({str(model)!r}, tokenizer=True)"],
                   env=sglang_e2e.sglang_env(1, None, False, args.work), check=True)
    for name, tp, spec in (("spec", 2, True), ("nospec", 1, False)):
        if args.only in (None, name):
            record(name, tp, spec, args.out / name, model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
