"""SGLang end to end, on CPU: the seed's own server under capture (`make test-sglang`).

Runs SGLang 0.5.23 (the PyPI wheel) on the tiny random Llama of examples/tiny_llama.py (float32,
a locally built tokenizer; token-id prompts), through `sglang.Engine` and through
`python -m sglang.launch_server` (HTTP `/generate` on loopback), at TP=1 and TP=2 over gloo,
plain and with NGRAM speculative decoding, bare and under HAZSAN=1 (the real bootstrap: the .pth
line in every SGLang process). What a stock CPU install lacks is supplied by cpu_setup/ (test
set-up, not hazsan, and outside what capture hooks: see cpu_setup/sitecustomize.py). It checks:

  * the greedy tokens: captured identical to bare, and NGRAM identical to plain decoding;
  * every rank's collectives: recorded in each rank's trace, each completed (a `coll_done`: a
    second record of a collective that cannot complete is what made every TP=2 + NGRAM run
    report thousands of false unordered-access errors), the same (comm, seq, op) on every rank;
  * the steps come from hazsan's own Scheduler hook (sglang.Scheduler.run_batch): prefill and
    decode marked, the same on every rank;
  * the header names SGLang's and torch's versions, and no hook failed;
  * `hazsan check` on the folder: exit 0, no finding, the capture COMPLETE (at level `full` too:
    engine-tp1-full, one `launch` per op);
  * a seeded early read in SGLang's real all-reduce path (cpu_setup/seed_early_read.py: the
    all-reduce of GroupCoordinator.all_reduce issued asynchronously and its buffer read before
    the wait) flagged at level `full` as `unordered-access` and nothing else, launches from the
    dispatch mode and from the native recorder's op observer (`full-native`) alike.
  and prints the cost of each run: wall time, start-up, one batch (wall: the fastest of REPEAT;
  CPU time of every SGLang process: the mean), event counts and findings.

Usage (in the venv `make test-sglang` builds): python examples/sglang_e2e/run.py [--work DIR] [--only ...]
Exit status 0 when every check passes, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SETUP = HERE / "cpu_setup"
sys.path.insert(0, str(HERE.parent))
import tiny_llama  # noqa: E402  (examples/tiny_llama.py: the model and the prompts)
from tiny_llama import MODEL, make_model  # noqa: E402

N_PROMPTS = 4
# benchmark knobs (the children inherit them): longer and more batches than the checks need, for
# CPU ratios above the 10 ms resolution of process CPU times
MAX_TOKENS = int(os.environ.get("SGLANG_E2E_TOKENS", 12))
REPEAT = int(os.environ.get("SGLANG_E2E_REPEAT", 3))  # the timed batch, repeated: the fastest wall time and the mean CPU time
DRAFT_TOKENS = 4
# name -> (entry point, tp, speculative, capture level or None, seeded early read)
CONFIGS = {
    "engine-tp1-bare": ("engine", 1, False, None, False),
    "engine-tp1-alloc": ("engine", 1, False, "alloc", False),
    "engine-tp1-full": ("engine", 1, False, "full", False),
    "engine-tp1-native": ("engine", 1, False, "alloc-native", False),
    "engine-tp1-full-native": ("engine", 1, False, "full-native", False),
    "engine-tp2-ngram-bare": ("engine", 2, True, None, False),
    "engine-tp2-ngram-alloc": ("engine", 2, True, "alloc", False),
    "engine-tp2-ngram-native": ("engine", 2, True, "alloc-native", False),
    "server-tp2-bare": ("server", 2, False, None, False),
    "server-tp2-alloc": ("server", 2, False, "alloc", False),
    "server-tp1-ngram-bare": ("server", 1, True, None, False),
    "server-tp1-ngram-alloc": ("server", 1, True, "alloc", False),
    "engine-tp2-seeded-full": ("engine", 2, False, "full", True),
    "engine-tp2-seeded-full-native": ("engine", 2, False, "full-native", True),
}
# `alloc-native`: level alloc recorded by the native recorder (HAZSAN_NATIVE=1, `hazsan native build`
# first); `full-native`: level full, launches from the recorder's RecordFunction observer; the other
# levels pin the dispatch mode (HAZSAN_NATIVE=0).
# what `make test-sglang` runs (about 10 minutes on 2 cores): every dimension at least once, bare
# and captured; the server's bare runs are left to --all (every run's tokens are checked against
# every other's, so the captured server is checked against the bare Engine)
DEFAULT = [n for n in CONFIGS if not (n.startswith("server-") and n.endswith("-bare"))]
ALL_REDUCE = {"c10d.allreduce_"}
ALL_GATHER = {"c10d._allgather_base_", "c10d.allgather_"}


def group_level(name: str) -> tuple[str, str]:
    """A configuration's name as (what runs, how it is captured): eager-full-native -> eager, full-native."""
    if name.endswith("-full-native"):
        return name[: -len("-full-native")], "full-native"
    return tuple(name.rsplit("-", 1))


def prompts() -> list[list[int]]:
    return tiny_llama.prompts(N_PROMPTS)


def server_args(model: str, tp: int, spec: bool) -> dict:
    """SGLang's ServerArgs for these runs: CPU, float32, the torch_native attention backend (no
    CPU kernels for the others here), a small KV pool, every decode batch logged."""
    args = dict(model_path=model, device="cpu", tp_size=tp, dtype="float32",
                attention_backend="torch_native", disable_cuda_graph=True,
                mem_fraction_static=0.5, max_total_tokens=4096, max_running_requests=8,
                random_seed=0, decode_log_interval=1, disable_overlap_schedule=True, log_level="info")
    if spec:
        args.update(speculative_algorithm="NGRAM", speculative_num_draft_tokens=DRAFT_TOKENS)
    return args


SAMPLING = {"temperature": 0.0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}
WARM = {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}


def cpu_seconds(root: int) -> float:
    """CPU time (user + system) of process `root` and every process under it so far."""
    import psutil
    total = 0.0
    try:
        me = psutil.Process(root)
        procs = [me, *me.children(recursive=True)]
    except psutil.Error:
        return total
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


# --------------------------------------------------------------------------- child: sglang.Engine
def child(spec: dict) -> None:
    t0 = time.perf_counter()
    import sglang
    import torch
    llm = sglang.Engine(**server_args(spec["model"], spec["tp"], spec["spec"]))
    t1 = time.perf_counter()
    batch = prompts()
    llm.generate(input_ids=batch[:1], sampling_params=WARM)       # first-use costs out of the timing
    outs, wall, cpu = timed(lambda: llm.generate(input_ids=batch, sampling_params=SAMPLING), os.getpid())
    t3 = time.perf_counter()
    llm.shutdown()
    t4 = time.perf_counter()
    Path(spec["result"]).write_text(json.dumps({
        "sglang": sglang.__version__, "torch": torch.__version__,
        "tokens": [list(o["output_ids"]) for o in outs] if outs else None,
        "repeats_identical": outs is not None,
        "startup_s": round(t1 - t0, 2), "generate_s": round(wall, 3), "cpu_s": round(cpu, 2),
        "shutdown_s": round(t4 - t3, 2)}))


def timed(generate, root: int):
    """The batch REPEAT times: (its outputs, or None when a repeat gave other tokens; the fastest
    wall time, less sensitive to the other load on the machine; the mean CPU time of every
    SGLang process)."""
    runs, walls = [], []
    cpu0 = cpu_seconds(root)
    for _ in range(REPEAT):
        t = time.perf_counter()
        runs.append(generate())
        walls.append(time.perf_counter() - t)
    cpu = (cpu_seconds(root) - cpu0) / REPEAT
    same = all([o["output_ids"] for o in r] == [o["output_ids"] for o in runs[0]] for r in runs)
    return (runs[0] if same else None), min(walls), cpu


# --------------------------------------------------------------------------- parent
def sglang_env(tp: int, level: str | None, seeded: bool, traces: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    paths = [str(SETUP)] + [p for p in [env.get("PYTHONPATH")] if p]
    env.update(PYTHONPATH=os.pathsep.join(paths), SGLANG_USE_CPU_ENGINE="1",
               SGLANG_CPU_OMP_THREADS_BIND="|".join(str(r) for r in range(tp)),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if seeded:
        env["SGLANG_E2E_SEED"] = "early-read"
    if level is not None:
        env.update(HAZSAN="1", HAZSAN_DIR=str(traces), HAZSAN_LEVEL=level.split("-")[0],
                   HAZSAN_NATIVE="1" if level.endswith("-native") else "0")
    return env


def run_engine(name: str, work: Path, model: Path, env: dict, timeout: float) -> dict:
    _, tp, spec, _, _ = CONFIGS[name]
    result = work / f"{name}.json"
    result.unlink(missing_ok=True)
    spec_json = json.dumps({"model": str(model), "tp": tp, "spec": spec, "result": str(result)})
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", spec_json],
                              env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0 or not result.exists():
        raise RuntimeError(f"exit {proc.returncode}\n{tail(work / f'{name}.log')}")
    return json.loads(result.read_text())


def run_server(name: str, work: Path, model: Path, env: dict, timeout: float) -> dict:
    """`python -m sglang.launch_server` on a free loopback port; the prompts through HTTP
    /generate; then SIGTERM, SGLang's own graceful stop."""
    _, tp, spec, _, _ = CONFIGS[name]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port),
            "--skip-server-warmup"]
    for k, v in server_args(str(model), tp, spec).items():
        flag = "--" + k.replace("_", "-")
        argv += [flag] if v is True else [flag, str(v)]
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    log = open(work / f"{name}.log", "w")
    proc = subprocess.Popen(argv, env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}\n{tail(work / f'{name}.log')}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready in {timeout:.0f} s\n{tail(work / f'{name}.log')}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        t1 = time.perf_counter()
        post(base, prompts()[:1], WARM)
        outs, wall, cpu = timed(lambda: post(base, prompts(), SAMPLING), proc.pid)
        t3 = time.perf_counter()
        version = json.loads(urllib.request.urlopen(base + "/get_server_info", timeout=30).read()).get("version")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        t4 = time.perf_counter()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    return {"sglang": version, "tokens": [o["output_ids"] for o in outs] if outs else None,
            "repeats_identical": outs is not None,
            "startup_s": round(t1 - t0, 2), "generate_s": round(wall, 3), "cpu_s": round(cpu, 2),
            "shutdown_s": round(t4 - t3, 2), "exit": proc.returncode}


def post(base: str, batch: list[list[int]], sampling: dict) -> list[dict]:
    body = json.dumps({"input_ids": batch, "sampling_params": sampling}).encode()
    req = urllib.request.Request(base + "/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def tail(path: Path, n: int = 3000) -> str:
    return path.read_text(errors="replace")[-n:]


def run_config(name: str, work: Path, model: Path, timeout: float) -> dict:
    entry, tp, _, level, seeded = CONFIGS[name]
    traces = work / "traces" / name
    shutil.rmtree(traces, ignore_errors=True)
    env = sglang_env(tp, level, seeded, traces)
    t0 = time.perf_counter()
    runner = run_engine if entry == "engine" else run_server
    out = runner(name, work, model, env, timeout)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    log = (work / f"{name}.log").read_text(errors="replace")
    out["decode_log_lines"] = sum(1 for line in log.splitlines() if "Decode batch" in line)
    accept = [line for line in log.splitlines() if "accept len:" in line]
    out["accept_log_line"] = max(accept, key=accept_len).strip() if accept else None
    out["max_accept_len"] = max(map(accept_len, accept)) if accept else None
    return out


def accept_len(line: str) -> float:
    """`accept len: X` of one of SGLang's 'Decode batch' log lines."""
    try:
        return float(line.split("accept len:")[1].split(",")[0])
    except (IndexError, ValueError):
        return 0.0


# --------------------------------------------------------------------------- the trace checks
def read_trace(path: Path) -> tuple[dict, list[dict]]:
    """Header and events (dicts) of a trace in either format (capture writes binary by default)."""
    from sanitizer.trace.reader import open_trace
    tf = open_trace(path)
    events = [ev for _, ev in tf.events() if isinstance(ev, dict)]
    return {**tf.header, "_ended": tf.ended}, events


def by_step(events: list[dict]) -> list[dict]:
    """Per marked step: its (n, phase, tokens) and the collectives issued until the next step."""
    steps, cur = [], None
    for e in events:
        if e["ev"] == "step":
            cur = {"n": e["n"], "phase": e.get("phase"), "tokens": e.get("tokens"), "colls": []}
            steps.append(cur)
        elif e["ev"] == "coll" and cur is not None:
            cur["colls"].append((e["comm"], e["seq"], e["op"]))
    return steps


def hazsan_check(folder: Path) -> tuple[int, dict, str]:
    chk = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(folder), "--format", "json"],
                         capture_output=True, text=True, cwd=ROOT)
    try:
        doc = json.loads(chk.stdout)
    except Exception:
        doc = {}
    return chk.returncode, doc, chk.stderr


def check_capture(name: str, work: Path, result: dict, problems: list) -> dict:
    entry, tp, spec, level, seeded = CONFIGS[name]
    folder = work / "traces" / name

    def fail(msg):
        problems.append(f"{name}: {msg}")

    facts: dict = {}
    ranks = {}
    for r in range(tp):
        f = next((folder / f"rank{r}{ext}" for ext in (".hzs", ".jsonl") if (folder / f"rank{r}{ext}").exists()),
                 folder / f"rank{r}.hzs")
        if not f.exists():
            fail(f"no trace for rank {r} in {folder}")
            return facts
        ranks[r] = read_trace(f)
    for r, (header, events) in ranks.items():
        versions = header.get("versions", {})
        if versions.get("sglang") != result["sglang"] or not versions.get("torch"):
            fail(f"rank {r}: header versions {versions} do not name SGLang {result['sglang']} and torch")
        installed = header["hooks"]["installed"]
        source = header["hooks"].get("alloc", {}).get("source")
        if source != ("native" if level.endswith("-native") else "dispatch-mode"):
            fail(f"rank {r}: allocations recorded by {source} ({header['hooks'].get('alloc')})")
        if "sglang.Scheduler.run_batch" not in installed:
            fail(f"rank {r}: the Scheduler step hook is not installed: {installed}")
        if header["hooks"]["failed"]:
            fail(f"rank {r}: hooks failed: {header['hooks']['failed']}")
        if header.get("world_size") != tp:
            fail(f"rank {r}: world_size {header.get('world_size')}, expected {tp}")
        # every collective recorded completes: no record that nothing will ever complete
        issued = {e["cid"]: e for e in events if e["ev"] == "coll"}
        done = {e["cid"] for e in events if e["ev"] == "coll_done"}
        never = [e for cid, e in issued.items() if cid not in done]
        if not header["_ended"] and never and never[-1]["cid"] == max(issued):
            # SIGKILLed (Engine.shutdown): the blocking collective it was in when killed, the idle
            # loop's broadcast, can be cut; only the last one recorded
            never = never[:-1]
        if never:
            ops = Counter(f"{e['op']} on {e['comm']}" for e in never)
            fail(f"rank {r}: {len(never)} collective record(s) never complete: {dict(ops)}")
        facts.setdefault("collectives", {})[r] = len(issued)
    rc, doc, err = hazsan_check(folder)
    summary = doc.get("summary", {})
    complete = bool(summary.get("complete"))
    steps = {r: by_step(ev) for r, (_, ev) in ranks.items()}
    marks = {r: [(s["n"], s["phase"], s["tokens"]) for s in st] for r, st in steps.items()}
    if not marks[0]:
        fail("no step marked")
    if any(marks[r] != marks[0] for r in marks):
        fail(f"the ranks marked different steps: {[len(m) for m in marks.values()]}")
    # SGLang's forward modes: EXTEND (prefill), DECODE (NGRAM turns it into TARGET_VERIFY inside
    # the step, after the hook has seen it)
    phases = Counter(p for _, p, _ in marks[0])
    if not phases.get("extend") or not phases.get("decode"):
        fail(f"phases seen: {dict(phases)}; expected extend and decode")
    if tp > 1:
        seqs = {r: [c for s in st for c in s["colls"]] for r, st in steps.items()}
        if not all(h["_ended"] for h, _ in ranks.values()):
            # killed ranks stop at different points of the idle loop after the last step
            n = min(len(q) for q in seqs.values())
            seqs = {r: q[:n] for r, q in seqs.items()}
        if any(seqs[r] != seqs[0] for r in seqs):
            fail("the ranks' collectives differ (comm, seq, op)")
        ops = Counter(c[2] for c in seqs[0])
        model_steps = [s for s in steps[0] if s["phase"] in ("extend", "decode")]
        if not complete:
            # a killed process loses what it had not flushed: its last step's events (the
            # completeness check below names the files)
            model_steps = model_steps[:-1]
        short = [s for s in model_steps
                 if not any(c[2] in ALL_REDUCE for c in s["colls"])
                 or not any(c[2] in ALL_GATHER for c in s["colls"])]
        if short:
            fail(f"{len(short)} model step(s) without the TP all-reduce and all-gather, e.g. {short[0]['n']} "
                 f"({short[0]['phase']}): {Counter(c[2] for c in short[0]['colls'])}")
        facts["ops"] = dict(ops)
    if not summary:
        fail(f"hazsan check exit {rc}: {err[-500:]}")
    by_rule = summary.get("by_rule") or {}
    if seeded:
        flagged = [f for f in doc.get("findings", []) if f.get("rule") == "unordered-access"]
        if rc != 1 or not flagged:
            fail(f"the seeded early read is not flagged: exit {rc}, findings {by_rule}")
        elif not all("seed_early_read.py" in json.dumps(f) for f in flagged):
            elsewhere = [f for f in flagged if "seed_early_read.py" not in json.dumps(f)]
            fail(f"{len(elsewhere)} unordered-access finding(s) not at the seeded read "
                 f"(cpu_setup/seed_early_read.py), e.g. {json.dumps(elsewhere[0])[:400]}")
        other = {k: v for k, v in by_rule.items() if k != "unordered-access"}
        if other:
            fail(f"findings besides the seeded read: {other}")
    elif rc != 0 or summary.get("findings"):
        fail(f"hazsan check: exit {rc}, findings {by_rule}")
    if summary and not summary.get("complete"):
        # Engine.shutdown() SIGKILLs its children (srt/utils/common.py, kill_process_tree); capture
        # waits first until their traces say quiet (sanitizer/capture/child_traces.py), so every
        # run that ends normally must be complete.
        reasons = summary.get("incomplete") or []
        files = summary.get("incomplete_files") or []
        fail(f"hazsan check: capture INCOMPLETE: {reasons}: {[f['why'] for f in files]}")
    if entry == "engine":
        # what makes that so: the hook in the Engine's own process (its pid trace)
        from sanitizer.trace.reader import read_header
        hooked = [p.name for p in folder.iterdir() if p.name.endswith((".jsonl", ".hzs"))
                  and "sglang.Engine.shutdown" in ((read_header(p) or {}).get("hooks") or {}).get("installed", [])]
        if not hooked:
            fail("no trace lists sglang.Engine.shutdown among its installed hooks")
    facts.update(steps=len(marks[0]), phases=dict(phases),
                 files=len([p for p in folder.iterdir() if p.name.endswith((".jsonl", ".hzs"))]),
                 events=summary.get("events"), findings=by_rule,
                 check=f"exit {rc}, {summary.get('findings')} findings, "
                       f"{'complete' if summary.get('complete') else 'INCOMPLETE'}")
    return facts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default=str(ROOT / "build" / "sglang-e2e"))
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--all", action="store_true", help="every configuration (default: %s)" % ", ".join(DEFAULT))
    ap.add_argument("--timeout", type=float, default=600, help="seconds per SGLang run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    names = [n for n in args.only.split(",") if n] or (list(CONFIGS) if args.all else DEFAULT)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny-llama"
    t0 = time.perf_counter()
    # the model is written in a process with the set-up (transformers imports torchvision)
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(HERE.parent)!r}); "
                    f"from tiny_llama import make_model; make_model({str(model)!r}, tokenizer=True)"],
                   env=sglang_env(1, None, False, work), check=True, capture_output=True)
    print(f"model: tiny random Llama {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, "
          f"vocab {MODEL['vocab_size']} at {model} ({time.perf_counter() - t0:.1f} s); "
          f"{N_PROMPTS} token-id prompts, {MAX_TOKENS} greedy tokens each", flush=True)
    problems: list[str] = []
    results: dict = {}
    for name in names:
        t = time.perf_counter()
        try:
            results[name] = run_config(name, work, model, args.timeout)
        except Exception as exc:
            problems.append(f"{name}: did not run: {exc}")
            print(f"[{name}] FAILED to run ({time.perf_counter() - t:.0f} s)", flush=True)
            continue
        r = results[name]
        if not r["repeats_identical"]:
            problems.append(f"{name}: the {REPEAT} identical batches gave different tokens")
        if CONFIGS[name][2] and not (r.get("max_accept_len") or 0) > 1:
            problems.append(f"{name}: NGRAM accepted no draft token (SGLang's log: {r.get('accept_log_line')})")
        print(f"[{name}] {r['wall_s']:.0f} s: start-up {r['startup_s']} s, one batch {r['generate_s']} s "
              f"wall, {r['cpu_s']} s CPU, shutdown {r['shutdown_s']} s; {r['decode_log_lines']} "
              f"'Decode batch' log lines", flush=True)
        if r.get("accept_log_line"):
            print(f"    SGLang's log: {r['accept_log_line']}", flush=True)
        if CONFIGS[name][3] is not None:
            r["capture"] = check_capture(name, work, r, problems)
            print(f"    capture: {json.dumps(r['capture'])}", flush=True)
    # the tokens: every run against its bare run, and every run against plain decoding
    reference = None
    print(f"\none batch of {N_PROMPTS} x {MAX_TOKENS} tokens: wall the fastest of {REPEAT}, CPU (every SGLang process) the mean")
    print("configuration            level       tokens-vs-bare  start-up s  batch wall s  x bare  batch CPU s  x bare")
    for name in names:
        r = results.get(name)
        if r is None:
            continue
        group, level = group_level(name)
        bare = results.get(f"{group}-bare")
        same = "-" if bare is None or name == f"{group}-bare" else (
            "identical" if r["tokens"] == bare["tokens"] else "DIFFERENT")
        if same == "DIFFERENT":
            problems.append(f"{name}: greedy tokens differ from {group}-bare")
        if reference is None:
            reference = (name, r["tokens"])
        elif r["tokens"] != reference[1]:
            problems.append(f"{name}: greedy tokens differ from {reference[0]}'s")
        ratio = f"{r['generate_s'] / bare['generate_s']:.2f}" if bare and bare["generate_s"] else "-"
        cratio = f"{r['cpu_s'] / bare['cpu_s']:.2f}" if bare and bare["cpu_s"] else "-"
        print(f"{group:24} {level:11} {same:15} {r['startup_s']:10.1f} {r['generate_s']:13.3f} {ratio:>7}"
              f" {r['cpu_s']:12.2f} {cratio:>7}")
    if reference:
        print(f"\nSGLang {next(iter(results.values()))['sglang']}; greedy tokens of prompt 0: {reference[1][0]}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if problems:
        print("\nFAILED:\n  " + "\n  ".join(problems))
        return 1
    print("\nOK: every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
