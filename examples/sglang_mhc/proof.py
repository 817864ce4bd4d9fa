"""The reference hazard inside SGLang's decode: stock vs fixed mHC combine at several NGRAM depths.

Runs SGLang 0.5.23 (`sglang.Engine`, tp_size=2 over gloo, CPU) on the mHC model of the external
model package hazsan_sglang_mhc (SGLANG_EXTERNAL_MODEL_PACKAGE), whose mHC combine computes inside
SGLang's own `use_symmetric_memory` scope and whose TP all-reduce, both routed over hazsan's
symmetric-memory testbed, are captured with HAZSAN=1. SGLang's scheduler, its radix cache and its
NGRAM speculative decoding make the batch shapes; nothing is forced. The CPU set-up stand-ins of
`make test-sglang` (examples/sglang_e2e/cpu_setup: the `*_cpu` ops NGRAM calls, torchvision's two
schemas, the torch_native verify path) are test set-up, outside what capture hooks. Per run, in
OUT/<variant>-d<depth>/:

  rank0.hzs, rank1.hzs   capture's traces (the testbed's scope, window and collectives included)
  server.log             SGLang's own log, with its `Decode batch, ... accept len: ...` lines
  schedule.ndjson        per scheduler step, each request's prompt and output tokens before it
  tokens.json            the greedy tokens per request, wall / start-up / CPU time
  outcomes.jsonl         per request: corrupted (tokens differ from the bare run's) and the step
                         that produced its first wrong token (sanitizer/proof/outcomes.py)

Then the placement model's prediction of which depths collide (predict.py: `hazsan sweep
--schedule` on the captures), next to what the runs measured.

The bare run (HAZSAN_MHC_VARIANT=bare: SGLang's gloo all-reduce, no testbed, no capture, no
speculative decoding) gives the reference tokens; greedy speculative decoding does not change
them, so one reference serves every depth.

    python examples/sglang_mhc/proof.py [--depths "1-8"] [--out DIR] [--report reports/sglang-mhc]
    python examples/sglang_mhc/proof.py --one stock:5                 (one run, kept in OUT)

Needs the venv of `make test-sglang` (`make sglang-proof` uses it).
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
SETUP = ROOT / "examples" / "sglang_e2e" / "cpu_setup"
VLLM_MHC = ROOT / "examples" / "vllm_mhc"
for _path in (ROOT, HERE):          # examples.vllm_mhc; predict.py and report.py next to this file
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
from examples.vllm_mhc import run as vllm_mhc  # noqa: E402  (the checkpoint, the prompts, hazsan())

MODEL = vllm_mhc.MODEL
REQUESTS = 16          # requests per run, all submitted at once
MAX_RUNNING = 16       # SGLang's max_running_requests: one batch, decoded together
OUTPUT_TOKENS = 40     # per request
IDLE_S = 2.0           # idle before Engine.shutdown() (which SIGKILLs the schedulers): 4 flush periods
FLUSH_S = 0.5          # HAZSAN_FLUSH_SECONDS of the runs
DEFAULT_DEPTHS = "1 2 3 4 5 6 7 8"


def prompts() -> list[list[int]]:
    """The first REQUESTS prompts of examples/vllm_mhc: each walks one successor cycle twice and a
    bit (33 to 39 tokens), so its greedy continuation is the cycle again and NGRAM drafts it."""
    return [p for p, _ in vllm_mhc.prompts()[:REQUESTS]]


def server_args(model: str, depth: int) -> dict:
    args = dict(model_path=model, device="cpu", tp_size=2, dtype="bfloat16", skip_tokenizer_init=True,
                attention_backend="torch_native", disable_cuda_graph=True, mem_fraction_static=0.5,
                max_total_tokens=8192, max_running_requests=MAX_RUNNING, random_seed=0,
                decode_log_interval=1, disable_overlap_schedule=True, log_level="info")
    if depth:
        # SGLang's draft token count includes the verified token the drafts follow: depth + 1
        args.update(speculative_algorithm="NGRAM", speculative_num_draft_tokens=depth + 1)
    return args


# --------------------------------------------------------------------------- child: one Engine
def child(spec: dict) -> None:
    import sglang
    t0 = time.perf_counter()
    llm = sglang.Engine(**server_args(spec["model"], spec["depth"]))
    t1 = time.perf_counter()
    cpu0 = cpu_seconds(os.getpid())
    outs = llm.generate(input_ids=prompts(), sampling_params={"temperature": 0.0, "max_new_tokens": OUTPUT_TOKENS,
                                                            "ignore_eos": True})
    t2 = time.perf_counter()
    cpu = cpu_seconds(os.getpid()) - cpu0
    # Engine.shutdown() SIGKILLs the schedulers (kill_process_tree): idle first, so that capture's
    # time flush (HAZSAN_FLUSH_SECONDS) has written every step and the traces are complete
    time.sleep(IDLE_S)
    llm.shutdown()
    Path(spec["result"]).write_text(json.dumps({
        "sglang": sglang.__version__, "startup_s": round(t1 - t0, 1), "generate_s": round(t2 - t1, 1),
        "generate_cpu_s": round(cpu, 1),
        "requests": [{"id": o["meta_info"]["id"], "prompt": len(p), "tokens": list(o["output_ids"])}
                     for p, o in zip(prompts(), outs)]}))


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


def run_env(variant: str, out: Path, capture: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAZSAN")}
    paths = [str(SETUP), str(HERE), str(VLLM_MHC)] + [p for p in [env.get("PYTHONPATH")] if p]
    env.update(PYTHONPATH=os.pathsep.join(paths), SGLANG_USE_CPU_ENGINE="1", SGLANG_CPU_OMP_THREADS_BIND="0|1",
               SGLANG_EXTERNAL_MODEL_PACKAGE="hazsan_sglang_mhc", HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", HAZSAN_MHC_VARIANT=variant, HAZSAN_MHC_OUT=str(out))
    if capture:
        env.update(HAZSAN="1", HAZSAN_DIR=str(out), HAZSAN_LEVEL=capture, HAZSAN_FLUSH_SECONDS=str(FLUSH_S))
    return env


def run_one(variant: str, depth: int, out: Path, model: Path, capture: str | None, timeout: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for p in out.iterdir():
        if p.is_file():
            p.unlink()
    result = out / "tokens.json"
    spec = json.dumps({"model": str(model), "depth": depth, "result": str(result)})
    t0 = time.perf_counter()
    c0 = os.times()
    with open(out / "server.log", "w") as log:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", spec],
                              env=run_env(variant, out, capture), cwd=out, stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - t0
    c1 = os.times()
    if proc.returncode != 0 or not result.exists():
        tail = (out / "server.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{out.name}: exit {proc.returncode}\n{tail}")
    res = json.loads(result.read_text())
    res["wall_s"] = round(wall, 1)
    # every process of the run (the Engine and its schedulers, reaped children included)
    res["cpu_s"] = round((c1.children_user - c0.children_user) + (c1.children_system - c0.children_system), 1)
    result.write_text(json.dumps(res))
    return res


# --------------------------------------------------------------------------- analysis of one run
def write_outcomes(run_dir: Path, reference: list[list[int]], result: dict) -> list[dict]:
    """outcomes.jsonl: per request, corrupted or not against the bare tokens (requests in
    submission order), and the scheduler step that produced its first wrong token (the last step
    of the request whose output count before it is at most that token's index); for a clean
    request its last step."""
    steps: dict[str, list[tuple[int, int]]] = {}
    path = run_dir / "schedule.ndjson"
    for line in path.read_text().splitlines() if path.exists() else []:
        s = json.loads(line)
        for rid, (_prompt, before) in s.get("reqs", {}).items():
            steps.setdefault(rid, []).append((s["step"], before))
    rows = []
    for i, (ref, r) in enumerate(zip(reference, result["requests"])):
        got = r["tokens"]
        wrong = next((k for k, (a, b) in enumerate(zip(ref, got)) if a != b),
                     None if len(ref) == len(got) else min(len(ref), len(got)))
        sp = steps.get(r["id"]) or [(0, 0)]
        k = len(got) - 1 if wrong is None else wrong
        step = max(s for s, before in sp if before <= k) if any(b <= k for _, b in sp) else sp[0][0]
        rows.append({"request": i, "rid": r["id"], "step": step, "first_step": sp[0][0], "rank": None,
                     "corrupted": wrong is not None, "first_wrong_token": wrong, "tokens": len(got)})
    with open(run_dir / "outcomes.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return rows


def logscan_options(depth: int) -> list[str]:
    """The log signature's criterion: an interval whose accept len is at most half the clean one
    (depth + 1: every draft accepted, as this model's prompts make it), with at least half the
    batch running."""
    return ["--threshold", f"{(depth + 1) / 2:g}", "--min-running", str(MAX_RUNNING // 2)]


def accept_lens(log: Path) -> list[float]:
    """`accept len` of each of SGLang's `Decode batch` lines (hazsan logscan's parser)."""
    from sanitizer.logscan.parse import DecodeLine, parse_line
    out = []
    for line in log.read_text(errors="replace").splitlines():
        rec = parse_line(line)
        if isinstance(rec, DecodeLine) and rec.accept_len is not None:
            out.append(rec.accept_len)
    return out


def analyse(run_dir: Path, reference: list[list[int]], result: dict, depth: int) -> dict:
    rows = write_outcomes(run_dir, reference, result)
    code, check = vllm_mhc.hazsan("check", str(run_dir))
    findings = check["findings"]
    reuse = [f for f in findings if f["rule"] == "reuse-in-flight"]
    first_finding = min((f["step"] for f in findings if f.get("step") is not None), default=None)
    corrupted = [r for r in rows if r["corrupted"]]
    preceded = sum(1 for r in corrupted if first_finding is not None and first_finding <= r["step"])
    scan_code, scan = vllm_mhc.hazsan("logscan", str(run_dir / "server.log"), *logscan_options(depth))
    first = None
    if reuse:
        f = min(reuse, key=lambda f: (f["step"] if f["step"] is not None else 1 << 30, f["line"]))
        ov = f.get("overlap") or [0, 0]
        first = {"step": f["step"], "site": (f["block"].get("site") or "?").rsplit("/", 1)[-1],
                 "block_size": f["block"]["size"], "seq": (f.get("op") or {}).get("seq"),
                 "overlap": ov[1] - ov[0], "rank": f["rank"]}
    return {
        "depth": depth, "requests": len(rows), "corrupted": len(corrupted),
        "corrupted_ids": [r["request"] for r in corrupted],
        "first_corruption_step": min((r["step"] for r in corrupted), default=None),
        "corrupted_preceded_by_finding": preceded,
        "first_finding_step": first_finding, "first_collision": first,
        "findings": check["summary"]["by_rule"], "check_exit": code,
        "complete": check["summary"].get("complete"),
        "reuse_steps": sorted({f["step"] for f in reuse if f["step"] is not None}),
        "accept_lens": accept_lens(run_dir / "server.log"), "logscan_exit": scan_code, "logscan": scan, "logscan_options": logscan_options(depth),
        "startup_s": result["startup_s"], "generate_s": result["generate_s"],
        "generate_cpu_s": result.get("generate_cpu_s"), "wall_s": result["wall_s"], "cpu_s": result.get("cpu_s"),
    }


def main(argv=None) -> int:
    import tempfile
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "hazsan-sglang-mhc")
    ap.add_argument("--depths", default=os.environ.get("SGLANG_PROOF_DEPTHS", DEFAULT_DEPTHS),
                    help="NGRAM draft depths, e.g. \"3 4 5 8\" or 3-5 (default: $SGLANG_PROOF_DEPTHS or %(default)s)")
    ap.add_argument("--variants", default="stock,fixed")
    ap.add_argument("--capture", default="alloc", help="HAZSAN_LEVEL of the runs")
    ap.add_argument("--report", type=Path, help="write README.md and results.json here (reports/sglang-mhc)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--reuse", action="store_true", help="analyse the runs already in OUT instead of running again")
    ap.add_argument("--one", help="VARIANT:DEPTH, one run (debugging)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    model = args.out / "model"
    vllm_mhc.make_checkpoint(model)
    if args.one:
        v, d = args.one.split(":")
        r = run_one(v, int(d), args.out / f"{v}-d{d}", model, None if v == "bare" else args.capture, args.timeout)
        print(json.dumps({k: r[k] for k in ("startup_s", "generate_s", "generate_cpu_s", "wall_s", "cpu_s")}))
        return 0
    depths = parse_depths(args.depths)
    t0 = time.monotonic()

    def run_or_reuse(variant, depth, out, capture):
        if args.reuse and (out / "tokens.json").exists():
            return json.loads((out / "tokens.json").read_text())
        return run_one(variant, depth, out, model, capture, args.timeout)

    print("[sglang-mhc] bare reference run (SGLang's gloo all-reduce, no testbed, no NGRAM) ...", flush=True)
    bare = run_or_reuse("bare", 0, args.out / "bare", None)
    reference = [r["tokens"] for r in bare["requests"]]
    print(f"[sglang-mhc] bare: {len(reference)} requests, {bare['wall_s']} s wall, {bare.get('cpu_s')} s CPU",
          flush=True)
    runs = {}
    for d in depths:
        for v in args.variants.split(","):
            out = args.out / f"{v}-d{d}"
            res = run_or_reuse(v, d, out, args.capture)
            s = analyse(out, reference, res, d)
            runs[f"{v}-d{d}"] = s
            print(f"[sglang-mhc] {v:5s} depth {d}: {s['corrupted']}/{s['requests']} corrupted "
                  f"({s['corrupted_preceded_by_finding']} preceded by a finding), findings {s['findings']}, "
                  f"capture {'COMPLETE' if s['complete'] else 'INCOMPLETE'}, logscan exit {s['logscan_exit']}, "
                  f"{res['wall_s']} s wall, {res.get('cpu_s')} s CPU", flush=True)
    comparisons = {}
    if "stock" in args.variants and "fixed" in args.variants:
        for d in depths:
            # --fail-on error: the fixed build keeps the latent early free of the partial (a
            # warning, in both builds); the fix removes the realised collisions and corruption
            code, cmp = vllm_mhc.hazsan("compare", str(args.out / f"stock-d{d}"), str(args.out / f"fixed-d{d}"),
                                        "--primary", "corrupted", "--fail-on", "error")
            comparisons[str(d)] = {"exit": code, **cmp}
            print(f"[sglang-mhc] depth {d}: hazsan compare exit {code}: {(cmp.get('verdict') or {}).get('text', '?')}", flush=True)
    prediction = predict_depths(args.out, depths, runs) if "stock" in args.variants else {}
    results = {"sglang": bare["sglang"], "model": MODEL, "requests": REQUESTS, "max_running_requests": MAX_RUNNING,
               "output_tokens": OUTPUT_TOKENS, "capture": args.capture, "idle_before_shutdown_s": IDLE_S,
               "flush_seconds": FLUSH_S, "depths": depths,
               "bare": {k: bare.get(k) for k in ("startup_s", "generate_s", "generate_cpu_s", "wall_s", "cpu_s")},
               "runs": runs, "compare": comparisons, "prediction": prediction,
               "seconds": round(time.monotonic() - t0, 1),
               "sglang_seconds": round(sum(r.get("wall_s") or 0 for r in runs.values()) + (bare.get("wall_s") or 0), 1),
               "sglang_cpu_seconds": round(sum(r.get("cpu_s") or 0 for r in runs.values()) + (bare.get("cpu_s") or 0), 1)}
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"[sglang-mhc] done in {results['seconds']} s: {args.out / 'results.json'}", flush=True)
    if args.report:
        from report import write_report
        write_report(results, args.report, args.out)
        print(f"[sglang-mhc] report: {args.report / 'README.md'}", flush=True)
    return 0


def predict_depths(out: Path, depths: list[int], runs: dict) -> dict:
    """The placement model's prediction per depth (predict.py), stored in each stock run's summary:
    `predicted_from_one` (the first depth's stock capture alone, along the schedule SGLang makes at
    that depth), `predicted` (the depth's own stock capture along its fixed run's recorded
    schedule); and the constant-shape sweep of that one capture."""
    import predict
    t0 = time.monotonic()
    one = out / f"stock-d{depths[0]}"
    step, prefill = predict.template(one)
    if step is None or prefill is None:
        print(f"[sglang-mhc] {one.name}: no decode or prefill step with tokens: no prediction", flush=True)
        return {}
    for d in depths:
        stock = runs.get(f"stock-d{d}")
        if stock is None:
            continue
        expected = predict.expected_schedule(prefill, d, MAX_RUNNING, OUTPUT_TOKENS)
        stock["predicted_from_one"] = predict.replay(vllm_mhc.hazsan, one, step, expected)
        own_step, _ = predict.template(out / f"stock-d{d}")
        clean = predict.recorded_schedule(out / f"fixed-d{d}")
        if own_step is not None and clean:
            stock["predicted"] = predict.replay(vllm_mhc.hazsan, out / f"stock-d{d}", own_step, clean)
        stock["fixed_schedule_is_expected"] = clean == expected
        print(f"[sglang-mhc] depth {d}: prediction from {one.name} alone: "
              f"{'COLLIDES' if stock['predicted_from_one']['colliding'] else 'clean'}; from its own capture: "
              f"{'COLLIDES' if (stock.get('predicted') or {}).get('colliding') else 'clean'}; measured "
              f"{stock['corrupted']}/{stock['requests']} corrupted", flush=True)
    shapes = predict.constant_shapes(vllm_mhc.hazsan, one, step, list(range(16, 161, 4)))
    return {"capture": one.name, "template_step": step, "prefill_tokens": prefill, "shapes": shapes,
            "seconds": round(time.monotonic() - t0, 1)}


def parse_depths(text: str) -> list[int]:
    """"3 4 5 8", "3,4,5,8" or "1-8" -> a sorted list of depths."""
    from examples.mhc_decode.sweep import parse_depths as parse
    return parse(",".join(text.split()))


if __name__ == "__main__":
    sys.exit(main())
