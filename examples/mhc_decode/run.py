"""Command line: run the mHC decode example once (one variant, one draft depth).

    python -m examples.mhc_decode --variant stock --depth 4 --ranks 2 --steps 24 --out runs/stock-d4

Writes into --out: the rank traces (rank<R>.jsonl from the testbed, or rank<R>.hzs from hazsan capture when
HAZSAN=1: the rank processes get HAZSAN_DIR=--out), outcomes.jsonl (one line per request, the format of
sanitizer/proof/outcomes.py) and summary.json (configuration, counts, timings).
Exit status 0 whether or not requests were corrupted (corruption is the measurement), 2 on errors.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.mhc_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", choices=("stock", "fixed"), default="stock",
                   help="stock: mHC float32 einsums inside the symmetric scope; fixed: outside, output only inside")
    p.add_argument("--depth", type=int, default=4, help="speculative draft depth (verify takes depth+1 tokens per request)")
    p.add_argument("--ranks", type=int, default=2, help="rank processes (2 to 4)")
    p.add_argument("--steps", type=int, default=16, help="verify steps")
    p.add_argument("--batch", type=int, default=18, help="batch slots (most requests decoded together)")
    p.add_argument("--request-steps", type=int, default=4, help="mean verify steps per request")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size (DeepSeek-V4's by default)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8, help="attention heads (split over ranks)")
    p.add_argument("--experts", type=int, default=8, help="routed experts (split over ranks)")
    p.add_argument("--shared-inter", type=int, default=512, help="shared expert size (split over ranks); "
                   "3 ranks need e.g. --heads 6 --experts 6 --shared-inter 384 --vocab 1536")
    p.add_argument("--embed-scale", type=float, default=None, help="token embedding scale against the blocks' outputs")
    p.add_argument("--head-margin", type=float, default=None,
                   help="how far the target's successor logit stands above the random head's (default 9)")
    p.add_argument("--draft-match", type=float, default=None, help="share of tokens the draft model predicts right")
    p.add_argument("--comm-latency-ms", type=float, default=5.0,
                   help="delay before a collective's loads (the time a real one is in flight)")
    p.add_argument("--hold-partial", action="store_true",
                   help="keep each all-reduce input referenced until its wait (removes the latent early free)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: the CuPy GPU testbed (sanitizer/testbed/cuda.py), rank r on GPU r %% device count")
    p.add_argument("--warmup", choices=("none", "max", "pow2"), default="pow2",
                   help="warm-up verify steps before serving: batch sizes 1, 2, 4, ... up to --batch (pow2), --batch only (max)")
    p.add_argument("--log-interval", type=int, default=1,
                   help="verify steps per SGLang-format 'Decode batch' line in OUT/server.log")
    p.add_argument("--reference-cache", metavar="DIR",
                   help="reuse (or store) the reference decode here; stock and fixed runs of one shape share it")
    p.add_argument("--out", required=True, help="directory for traces, outcomes.jsonl, summary.json")
    return p


def model_config(args):
    from .model import ModelConfig
    extra = {k: v for k, v in (("embed_scale", args.embed_scale), ("draft_match", args.draft_match),
                               ("head_margin", args.head_margin)) if v is not None}
    return ModelConfig(hidden=args.hidden, layers=args.layers, vocab=args.vocab, heads=args.heads,
                       experts=args.experts, shared_inter=args.shared_inter, **extra)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not 2 <= args.ranks <= 4:
        print("--ranks must be 2, 3 or 4", file=sys.stderr)
        return 2
    if args.depth < 0 or args.steps < 1 or args.batch < 1 or args.request_steps < 1:
        print("--depth must be >= 0; --steps, --batch, --request-steps >= 1", file=sys.stderr)
        return 2
    from .decode import RunConfig

    try:
        model = model_config(args)
        run = RunConfig(variant=args.variant, depth=args.depth, batch=args.batch, steps=args.steps,
                        request_steps=args.request_steps, comm_latency_ms=args.comm_latency_ms,
                        hold_partial=args.hold_partial, log_interval=args.log_interval, warmup=args.warmup, device=args.device, model=model)
        if model.heads % args.ranks or model.experts % args.ranks or model.vocab % args.ranks \
                or model.shared_inter % args.ranks:
            raise ValueError(f"--ranks {args.ranks} must divide --heads ({model.heads}), --experts ({model.experts}), "
                             f"--shared-inter ({model.shared_inter}) and --vocab ({model.vocab})")
        if max(1, 3 * args.request_steps // 2) * (args.depth + 1) + run.prompt > model.max_context:
            raise ValueError("context too long: lower --request-steps or --depth")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    try:
        summaries = execute([(run, args.out)], args.ranks, args.reference_cache)
    except RunFailed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    s = summaries[0]
    print(f"{args.variant} depth {args.depth}: {s['corrupted']} of {s['requests']} requests corrupted "
          f"({args.ranks} ranks, up to {run.tokens} tokens per step, {s['seconds']['total']:.1f} s) -> {s['out']}")
    return 0


class RunFailed(RuntimeError):
    pass


def _prepare(out: str) -> str:
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    for old in [p for stem in ("rank*", "pid*") for ext in (".jsonl*", ".hzs*")     # traces of either format
                for p in glob.glob(os.path.join(out, stem + ext))] + \
            [os.path.join(out, n) for n in ("outcomes.jsonl", "summary.json", "server.log")]:
        if os.path.exists(old):
            os.unlink(old)
    return out


def execute(plan, ranks: int, reference_cache: str | None = None, progress=None) -> list[dict]:
    """Run each (RunConfig, out_dir) of the plan; write outcomes.jsonl and summary.json into each
    out_dir; return the summaries. Without capture the whole plan runs in one world of rank
    processes; with capture (HAZSAN=1) each run gets its own world, with HAZSAN_DIR set to its
    out_dir, so that each run's trace files hold that run only (capture writes one file per
    process); the reference decodes then run in worlds of their own, without capture.
    `progress(text)`, if given, is called with one line per run as it ends (per world without
    capture). With a reference_cache, the rank processes also keep their drawn weights there
    (model.Weights, $MHC_WEIGHTS_CACHE) while the plan runs."""
    from .model import WEIGHTS_CACHE_ENV
    saved = os.environ.get(WEIGHTS_CACHE_ENV)
    if reference_cache:     # the rank processes (spawned: they inherit it) reuse the weights they drew
        os.environ[WEIGHTS_CACHE_ENV] = os.path.abspath(reference_cache)
    try:
        return _execute(plan, ranks, reference_cache, progress)
    finally:
        if reference_cache:     # about 300 MB per rank: kept for this plan only
            for path in glob.glob(os.path.join(reference_cache, "weights-*.pt")):
                os.unlink(path)
        if saved is None:
            os.environ.pop(WEIGHTS_CACHE_ENV, None)
        else:
            os.environ[WEIGHTS_CACHE_ENV] = saved


def _execute(plan, ranks: int, reference_cache: str | None = None, progress=None) -> list[dict]:
    from sanitizer.testbed import RankFailed, spawn

    from .decode import free_port, reference_rank, sanitised_rank, trace_env_dir, world_rank
    plan = [(run, _prepare(out)) for run, out in plan]
    window = max(run.window_mb for run, _ in plan) << 20
    summaries = []
    captured = trace_env_dir()
    if captured is None:
        t0 = time.monotonic()
        try:
            per_rank = spawn(world_rank, ranks, args=(plan, free_port()), window_bytes=window)
        except RankFailed as exc:
            raise RunFailed(f"decode failed: {exc}") from None
        elapsed = time.monotonic() - t0
        for i, (run, out) in enumerate(plan):
            results = [per_rank[r][i] for r in range(ranks)]
            sanitised = max(r["seconds"] for r in results)
            summaries.append(_write(run, out, ranks, results,
                                    {"sanitised": round(sanitised, 2), "world_total": round(elapsed, 2),
                                     "total": round(elapsed / len(plan), 2)}))
            if progress:
                progress(_progress_line(i + 1, len(plan), run, summaries[-1]))
        return summaries
    for run, out in plan:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="mhc-ref-") as tmp:
            ref_path = os.path.join(reference_cache or tmp, f"reference-{run.reference_key(ranks)}.pt")
            ref_ran = not os.path.exists(ref_path)
            if ref_ran:
                if reference_cache:
                    os.makedirs(reference_cache, exist_ok=True)
                saved = os.environ.pop("HAZSAN", None)       # the reference is not under capture
                try:
                    part = ref_path + f".{os.getpid()}.part"
                    spawn(reference_rank, ranks, args=(run, free_port(), part), window_bytes=1 << 16)
                    os.replace(part, ref_path)
                except RankFailed as exc:
                    raise RunFailed(f"reference run failed: {exc}") from None
                finally:
                    if saved is not None:
                        os.environ["HAZSAN"] = saved
            t1 = time.monotonic()
            saved_dir = os.environ.get("HAZSAN_DIR")
            os.environ["HAZSAN_DIR"] = out               # each run's rank traces beside its outcomes
            try:
                results = spawn(sanitised_rank, ranks, args=(run, ref_path, out), window_bytes=window)
            except RankFailed as exc:
                raise RunFailed(f"sanitised run failed: {exc}") from None
            finally:
                if saved_dir is None:
                    os.environ.pop("HAZSAN_DIR", None)
                else:
                    os.environ["HAZSAN_DIR"] = saved_dir
        t2 = time.monotonic()
        summaries.append(_write(run, out, ranks, results, {"reference": round(t1 - t0, 2),
                                                            "sanitised": round(t2 - t1, 2), "total": round(t2 - t0, 2)}))
        if progress:
            progress(_progress_line(len(summaries), len(plan), run, summaries[-1], ref_ran))
    return summaries


def _progress_line(i: int, n: int, run, s: dict, ref_ran: bool = False) -> str:
    sec = s["seconds"]
    how = (f"{sec['total']:.1f} s: reference decode {sec['reference']:.1f} s + captured run {sec['sanitised']:.1f} s"
           if ref_ran else f"{sec['total']:.1f} s")
    return (f"  run {i}/{n}: {run.variant:5} depth {run.depth}: {s['corrupted']:3d} of {s['requests']} requests "
            f"corrupted ({how})")


def _write(run, out, ranks, results, seconds) -> dict:
    outcomes = outcomes_of(run, results)
    with open(os.path.join(out, "outcomes.jsonl"), "w") as f:
        for o in outcomes:
            f.write(json.dumps(o) + "\n")
    summary = {
        "out": out, "config": run.to_dict(), "ranks": ranks, "requests": len(outcomes),
        "corrupted": sum(o["corrupted"] for o in outcomes),
        "corrupted_request_steps_by_rank": {r["rank"]: sum(1 for row in r["errors"] for _, e in row if e != 0)
                                            for r in results},
        "corrupted_steps": sorted({n for o in outcomes for n in o["corrupted_steps"]}),
        "window_allocations": {r["rank"]: r["window_allocations"] for r in results},
        "collectives": {r["rank"]: r["collectives"] for r in results},
        "accept_len": accept_lengths(results),
        "server_log": server_log_summary(out),
        "seconds": seconds,
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def accept_lengths(results) -> dict:
    """Mean tokens gained per request per verify step on rank 0 (accepted drafts + 1): what its
    own verify step measured (`observed`) and what the reference decode accepted (`reference`)."""
    r0 = next(r for r in results if r["rank"] == 0)
    out = {}
    for key, name in (("observed", "observed"), ("expected", "reference")):
        vals = [a for row in r0[key] for _, a in row]
        out[name] = round(sum(vals) / len(vals) + 1, 4) if vals else None
    return out


def server_log_summary(out: str) -> dict | None:
    """What `hazsan logscan` (default threshold 2.0) says about the run's server log."""
    from sanitizer.logscan.scan import scan

    from .serverlog import LOG_NAME
    path = os.path.join(out, LOG_NAME)
    if not os.path.exists(path):
        return None
    res = scan([path])
    lens = list(res.accept_lens())
    return {"path": path, "intervals": res.intervals, "flagged": len(res.flagged),
            "accept_len_min": min(lens) if lens else None,
            "accept_len_mean": round(sum(lens) / len(lens), 4) if lens else None}


def outcomes_of(run, results) -> list[dict]:
    """One line per request: corrupted when any of its rows differs from the reference on any rank."""
    from .decode import Schedule
    sched = Schedule(run)
    per: dict[int, dict] = {}
    for req in sched.requests:
        first, last = sched.span(req)
        per[req] = {"request": req, "step": last, "first_step": first, "rank": None, "corrupted": False,
                    "max_abs_err": 0.0, "corrupted_ranks": [], "corrupted_steps": [], "depth": run.depth,
                    "variant": run.variant, "accepted_drafts": 0, "reference_accepted_drafts": 0}
    for r in results:
        if r["rank"] == 0:                     # what rank 0's verify accepted, against the reference
            for key, field in (("observed", "accepted_drafts"), ("expected", "reference_accepted_drafts")):
                for row in r.get(key, []):
                    for req, a in row:
                        per[req][field] += a
        for step, row in enumerate(r["errors"]):
            for req, err in row:
                o = per[req]
                if err != 0:
                    o["corrupted"] = True
                    o["max_abs_err"] = max(o["max_abs_err"], float(err) if err == err else float("inf"))
                    if r["rank"] not in o["corrupted_ranks"]:
                        o["corrupted_ranks"].append(r["rank"])
                    if step not in o["corrupted_steps"]:
                        o["corrupted_steps"].append(step)
    for o in per.values():
        if o["max_abs_err"] == float("inf"):
            o["max_abs_err"] = "inf"
        o["corrupted_ranks"].sort()
        o["corrupted_steps"].sort()
    return [per[k] for k in sorted(per)]


if __name__ == "__main__":
    if not __package__:        # run as a script: examples/mhc_decode/run.py
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        from examples.mhc_decode.run import main as _main
        sys.exit(_main())
    sys.exit(main())
