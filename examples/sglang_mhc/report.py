"""reports/sglang-mhc/README.md and results.json from proof.py's results (nothing here is typed in
by hand: every number comes from the runs and from hazsan check / compare / logscan on them)."""
from __future__ import annotations

import json
from pathlib import Path

from tabulate import tabulate

# The incident this project exists for (README.md): SGLang, NGRAM depth 5, about 39 corrupted
# requests per 1,000; after the fix 323 of 323 clean.
INCIDENT = {"depth": 5, "corrupted_per_1000": 39, "fixed_clean": 323}


def _accept(run: dict) -> str:
    vals = run.get("accept_lens") or []
    if not vals:
        return "-"
    return f"{sum(vals) / len(vals):.2f} / {min(vals):.2f}"


def _flagged(scan: dict) -> str:
    return f"{len(scan.get('flagged', []))}/{scan.get('intervals', len(scan.get('records', [])))}"


def _rules(by_rule: dict, *names) -> str:
    return " / ".join(str(by_rule.get(n, 0)) for n in names)


def _p(c: dict) -> float | None:
    primary = next((m for m in c.get("measures", []) if m.get("name") == "corrupted"), {})
    p = (primary.get("fisher") or {}).get("p_one_sided")
    return p if isinstance(p, (int, float)) else None


def decode_lines(log: Path, limit: int = 6) -> list[str]:
    """SGLang's own `Decode batch` lines, as written (the timestamp and the throughput cut)."""
    out = []
    for ln in log.read_text(errors="replace").splitlines():
        if "Decode batch" not in ln:
            continue
        text = ln[ln.index("Decode batch"):]
        text = text.split(", gen throughput")[0]
        out.append(text)
    return out[:limit]


SMALL_POOL = 1 << 20      # the CUDA caching allocator's small-pool limit (the testbed's placement model)


def partial_in_large_pool(results: dict, depth: int) -> bool:
    """Is a verify step's row-parallel partial (bfloat16) in the large pool, where the float32
    mixing transients are (the necessary condition of a collision)? A full verify step has
    max_running x (depth + 1) tokens."""
    tokens = results["max_running_requests"] * (depth + 1)
    return tokens * 2 * results["model"]["hidden_size"] > SMALL_POOL


def _steps(pred: dict | None) -> str:
    """Predicted colliding steps of a replay: "1-9 of 10" (indices in its schedule), "none", "-"."""
    if not pred:
        return "-"
    hit, n = pred.get("colliding", []), len(pred.get("schedule", []))
    return f"{_ranges(hit)} of {n}" if hit else f"none of {n}"


def _ranges(vals: list[int], gap: int = 1) -> str:
    """[1, 2, 3, 7] -> "1-3, 7" (values at most `gap` apart joined)."""
    vals = sorted(vals)
    out: list[str] = []
    for v in vals:
        if out and v - last <= gap:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
        last = v
    return ", ".join(out)


def collides(pred: dict | None) -> bool | None:
    return None if not pred else bool(pred.get("colliding"))


def measured(run: dict) -> bool:
    return bool(run["corrupted"] or run["findings"].get("reuse-in-flight"))


def why_lines(results: dict) -> list[str]:
    m = results["model"]
    h, n, running = m["hidden_size"], m["hc_streams"], results["max_running_requests"]
    partial, transient = 2 * h, 4 * n * h
    lo = SMALL_POOL // partial + 1
    pred = results.get("prediction") or {}
    one = pred.get("capture", "?")
    rows, agree, disagree = [], [], []
    for d in results["depths"]:
        s = results["runs"].get(f"stock-d{d}")
        if s is None:
            continue
        tokens = running * (d + 1)
        first = s.get("first_collision")
        p1, p2 = s.get("predicted_from_one"), s.get("predicted")
        calls = {c for c in (collides(p1), collides(p2)) if c is not None}
        if calls:
            (agree if calls == {measured(s)} else disagree).append(d)
        rows.append([d, tokens, f"{tokens * partial:,}", "large" if partial_in_large_pool(results, d) else "small",
                     _steps(p1), _steps(p2), f"{s['corrupted']}/{s['requests']}",
                     f"step {first['step']}: a {first['block_size']:,}-byte block from {first['site']} over "
                     f"{first['overlap']:,} bytes that all_reduce seq {first['seq']} still loads" if first else "-",
                     ("yes" if calls == {measured(s)} else "NO") if calls else "-"])
    lines = ["## Which depths collide: the placement model's prediction and the runs", "",
             f"Where a step's window blocks are placed depends only on its token count and on what earlier "
             f"steps left in the pool, never on values. Per token the row-parallel partial is {partial:,} bytes "
             f"(bfloat16, hidden {h}) and each float32 mixing transient {transient:,} bytes ({n} streams). The "
             f"caching allocator (the model the testbed places with) serves requests up to 1 MiB from its small "
             f"pool, larger ones from the large pool. Up to {lo - 1} tokens the partial is in the small pool and "
             f"the transients in the large one: they cannot meet. From {lo} tokens both are in the large pool, "
             f"and a mixing transient allocated while the all-reduce still loads the freed partial is given the "
             f"best-fitting free block, which can be the partial's bytes merged with free space next to them; "
             f"whether it is depends on the segments earlier steps left, which the allocator model replays.", ""]
    shapes = pred.get("shapes") or {}
    if shapes:
        lines += [f"`hazsan sweep --schedule` on `{one}`'s step {shapes['template_step']} (its first verify step), "
                  f"each token count replayed {shapes['repeat']} times right after the capture's set-up: collides at "
                  f"{_ranges(shapes['colliding'], 4) or 'no count'} tokens; clean at "
                  f"{_ranges(shapes['clean'], 4) or 'no count'}.", ""]
    lines += [f"A server's steps are not one shape held constant: SGLang's NGRAM decode at depth d is a "
              f"prefill, then verify steps of {running} requests x (d + 1) tokens (the Scheduler hook records "
              f"each step's token count: sanitizer/capture/sglang_hooks.py). Two predictions per depth, both "
              f"`hazsan sweep --schedule` through the allocator model:", "",
              f"- **from one capture**: `{one}` alone (step {pred.get('template_step', '?')} replayed), along the "
              f"schedule SGLang makes at depth d with every draft accepted: its {pred.get('prefill_tokens', '?')}-token "
              f"prefill, then 1 + ceil(({results['output_tokens']} - 2) / (d + 1)) verify steps (the first verify "
              f"step has no draft: NGRAM's corpus holds a request's tokens only after its first decode). No run at "
              f"depth d is used: what a user with one capture can ask;",
              "- **from the depth's own capture**: its stock run's first verify step, along the schedule its fixed "
              "run recorded (the shapes before corruption changed them)"
              + (", which is the expected schedule at every depth" if all(
                  results["runs"].get(f"stock-d{d}", {}).get("fixed_schedule_is_expected")
                  for d in results["depths"] if f"stock-d{d}" in results["runs"]) else
                 "; it differs from the expected schedule at depth(s) " + ", ".join(
                     str(d) for d in results["depths"]
                     if not results["runs"].get(f"stock-d{d}", {}).get("fixed_schedule_is_expected", True))) + ".",
              "",
              tabulate(rows, headers=["depth", "tokens per verify step", "partial bytes", "partial's pool",
                                      f"predicted colliding steps: {one} alone", "predicted: own capture, clean schedule",
                                      "measured: corrupted stock", "measured: first realised collision (hazsan check)",
                                      "prediction agrees"],
                       tablefmt="github"), ""]
    text = []
    if agree:
        text.append(f"The prediction agrees with the runs at depth(s) {', '.join(map(str, agree))}")
    if disagree:
        text.append(f"it DISAGREES at depth(s) {', '.join(map(str, disagree))} (see the table: a predicted "
                    "collision the run did not have, or a collision it did not predict)")
    if text:
        lines.append("; ".join(text) + ".")
    spared = [d for d in results["depths"] if f"stock-d{d}" in results["runs"]
              and running * (d + 1) in shapes.get("colliding", [])
              and collides(results["runs"][f"stock-d{d}"].get("predicted_from_one")) is False
              and not measured(results["runs"][f"stock-d{d}"])]
    if spared:
        lines[-1] += (f" Depth(s) {', '.join(map(str, spared))} collide when their verify shape is held constant "
                      "from the set-up on, and not after the prefill: the step replayed at the prefill's token "
                      "count leaves other segments behind, and the best-fitting free block for a mixing transient "
                      "is then not the freed partial. The large pool is the necessary condition, not a sufficient "
                      "one; the replay of the schedule decides.")
    lines.append("")
    return lines


def _sweep_example(results: dict) -> list[str]:
    """The prediction's command line for the first depth predicted to collide (or the first depth)."""
    pred = results.get("prediction") or {}
    runs = [results["runs"].get(f"stock-d{d}") or {} for d in results["depths"]]
    replays = [r["predicted_from_one"] for r in runs if r.get("predicted_from_one")]
    if not pred or not replays:
        return []
    r = next((r for r in replays if r["colliding"]), replays[0])
    d = results["depths"][[x.get("predicted_from_one") for x in runs].index(r)]
    return [f"    hazsan sweep DIR/{pred['capture']} --step {pred['template_step']} --schedule "
            f"{','.join(map(str, r['schedule']))}     # the prediction for depth {d} from {pred['capture']}'s capture"]


def write_report(results: dict, out: Path, runs_root: Path | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    runs, cmp_ = results["runs"], results.get("compare", {})
    depths = results["depths"]
    rows, pooled = [], {"stock": [0, 0], "fixed": [0, 0]}
    for d in depths:
        s, f = runs.get(f"stock-d{d}"), runs.get(f"fixed-d{d}")
        if s is None or f is None:
            continue
        for v, r in (("stock", s), ("fixed", f)):
            pooled[v][0] += r["corrupted"]
            pooled[v][1] += r["requests"]
        p = _p(cmp_.get(str(d)) or {})
        rows.append([
            d, f"{s['corrupted']}/{s['requests']}", f"{f['corrupted']}/{f['requests']}",
            f"{s['corrupted_preceded_by_finding']}/{s['corrupted']}" if s["corrupted"] else "-",
            s["findings"].get("reuse-in-flight", 0),
            _rules(s["findings"], "free-in-flight", "transient-in-window"),
            _rules(f["findings"], "free-in-flight", "transient-in-window", "reuse-in-flight"),
            "yes" if s["complete"] and f["complete"] else "NO",
            _accept(s), _accept(f),
            f"{_flagged(s['logscan'])} / {_flagged(f['logscan'])}",
            f"{p:.3g}" if p is not None else "-",
            f"{s['wall_s']} / {f['wall_s']}", f"{s.get('cpu_s')} / {f.get('cpu_s')}",
        ])
        rows[-1].insert(3, " / ".join({True: "collides", False: "clean", None: "-"}[collides(s.get(k))]
                                      for k in ("predicted_from_one", "predicted")))
    one = (results.get("prediction") or {}).get("capture", "one capture")
    headers = ["depth", "corrupted stock", "corrupted fixed",
               f"predicted (hazsan sweep: {one} alone / own capture)", "stock corruptions preceded by a finding",
               "stock reuse-in-flight", "stock free-in-flight / transient-in-window",
               "fixed free-in-flight / transient / reuse", "captures complete",
               "stock accept len mean / min (SGLang log)", "fixed accept len mean / min",
               "logscan flagged stock / fixed", "compare p (Fisher, one-sided)", "wall s stock / fixed",
               "CPU s stock / fixed"]
    m = results["model"]
    colliding = [d for d in depths if runs.get(f"stock-d{d}", {}).get("corrupted")]
    clean = [d for d in depths if f"stock-d{d}" in runs and not runs[f"stock-d{d}"]["corrupted"]]
    lines = [
        "# The reference hazard inside SGLang's decode (regenerated by `make sglang-proof`)",
        "",
        f"SGLang {results['sglang']} (the PyPI wheel), `sglang.Engine` with `tp_size=2` over gloo, on this "
        "machine's CPUs, SGLang's own scheduler and NGRAM speculative decoding. The model is "
        "`examples/sglang_mhc/`'s mHC decoder, an external model package registered through SGLang's own "
        "mechanism (`SGLANG_EXTERNAL_MODEL_PACKAGE=hazsan_sglang_mhc`, srt/models/registry.py) and written "
        f"with SGLang's layers (hidden size {m['hidden_size']} as DeepSeek-V4, {m['hc_streams']} mHC residual "
        f"streams, {m['num_hidden_layers']} layer of attention + MLP blocks, vocabulary {m['vocab_size']}, "
        "bfloat16). Its combine and residual mixing run inside SGLang's own `use_symmetric_memory(tp_group)` "
        "(`SymmetricMemoryContext`), RowParallelLinear makes its partial inside the same scope (SGLang's "
        "linear.py), and the TP all-reduce is the group's `all_reduce`; scope and all-reduce are routed to "
        "hazsan's CPU symmetric-window testbed (one-sided, on a comm thread, buffers placed by the "
        "caching-allocator model), as `make vllm-proof` does for vLLM. Stock: the combine and mixing "
        "compute with `einsum` in float32 inside the scope. Fixed: they compute outside, only the combine's "
        f"output is allocated inside, and the partial is held until the all-reduce's wait. {results['requests']} requests of {results['output_tokens']} greedy "
        f"tokens (`max_running_requests={results['max_running_requests']}`), every run captured (`HAZSAN=1`, "
        f"level `{results['capture']}`, `HAZSAN_FLUSH_SECONDS={results['flush_seconds']}`, "
        f"{results['idle_before_shutdown_s']} s idle before `Engine.shutdown()`, which SIGKILLs the "
        "schedulers); corruption counted request by request against the greedy tokens of a bare run "
        "(SGLang's own gloo all-reduce, no testbed, no NGRAM). Depth d is `speculative_num_draft_tokens = "
        "d + 1` (SGLang counts the verified token the drafts follow).",
        "",
        tabulate(rows, headers=headers, tablefmt="github"),
        "",
        f"- Pooled: stock {pooled['stock'][0]} of {pooled['stock'][1]} requests corrupted, fixed "
        f"{pooled['fixed'][0]} of {pooled['fixed'][1]}.",
        f"- Colliding depth(s): {', '.join(map(str, colliding)) or 'none'}; clean stock depth(s): "
        f"{', '.join(map(str, clean)) or 'none'}.",
        *([f"- Predicted colliding depth(s), by the placement model from `{one}`'s capture alone: "
           f"{', '.join(str(d) for d in depths if collides(runs.get(f'stock-d{d}', {}).get('predicted_from_one'))) or 'none'}"
           f"; from each depth's own capture: "
           f"{', '.join(str(d) for d in depths if collides(runs.get(f'stock-d{d}', {}).get('predicted'))) or 'none'} "
           f"(`hazsan sweep --schedule`, {results['prediction'].get('seconds')} s for every replay; below)."]
          if results.get("prediction") else []),
        f"- Cost: bare reference run {results['bare']['wall_s']} s wall, {results['bare'].get('cpu_s')} s CPU; "
        f"all {len(runs) + 1} SGLang runs {results.get('sglang_seconds')} s wall and {results.get('sglang_cpu_seconds')} s "
        "CPU on this 2-core machine, shared with other work. Wall and "
        "CPU time per run are in the table (CPU: every process of the run, the Engine and both "
        "schedulers, start-up included).",
        "",
        "## Compared with the incident",
        "",
        f"The incident: depth {INCIDENT['depth']}, about {INCIDENT['corrupted_per_1000']} corrupted requests "
        f"per 1,000 on a GPU server, {INCIDENT['fixed_clean']}/{INCIDENT['fixed_clean']} clean after the fix. "
    ]
    s5, f5 = runs.get("stock-d5"), runs.get("fixed-d5")
    if s5 and f5:
        lines[-1] += (
            f"Here, depth 5: stock {s5['corrupted']}/{s5['requests']} corrupted, fixed "
            f"{f5['corrupted']}/{f5['requests']}. The rate is not the incident's: in this workload every "
            "request of the batch is decoded in every step, and a collision corrupts the all-reduce's sum "
            "on every rank, so every request running in a colliding step is hit (the incident's server "
            "mixed many batch shapes, of which few collided). What carries over is the shape of the fault: "
            "which depths collide is decided by the step's token count and the window's placement"
            + (", the fixed build is clean at every depth" if pooled["fixed"][0] == 0 else
               f", but the fixed build has {pooled['fixed'][0]} corrupted request(s)")
            + (", and every corruption is preceded by a finding." if all(
                r["corrupted_preceded_by_finding"] == r["corrupted"] for r in runs.values()) else
               ", but NOT every corruption is preceded by a finding (see the table)."))
    lines.append("")
    lines += why_lines(results)
    # a depth where the stock build corrupted nothing has nothing to confirm (compare exits 1 there)
    verdicts = [(d, c) for d, c in sorted(cmp_.items(), key=lambda kv: int(kv[0]))
                if runs.get(f"stock-d{d}", {}).get("corrupted") or (c.get("verdict") or {}).get("confirmed")]
    if verdicts:
        lines += ["## The proof (`hazsan compare STOCK FIXED --primary corrupted --fail-on error`)", "",
                  "The fix removes the transients from the window and the early free of the partial (the "
                  "fixed build holds it until the all-reduce's wait), so the latent hazards "
                  "(`transient-in-window`, `free-in-flight`), the realised collisions (`reuse-in-flight`) "
                  "and the corruption: the fixed build has no finding.", ""]
        for d, c in verdicts:
            text = (c.get("verdict") or {}).get("text", "?")
            lines.append(f"- depth {d} (exit {c.get('exit')}): {text}")
        if clean:
            lines.append(f"- depth(s) {', '.join(map(str, clean))}: the stock build corrupted nothing, so there is "
                         "no fix to confirm (compare exits 1: no significant difference).")
        lines.append("")
    if colliding and runs_root is not None:
        d = 5 if 5 in colliding else colliding[0]
        lines += ["## SGLang's own log", "",
                  f"Depth {d}, the first `Decode batch` lines SGLang's scheduler wrote (`--decode-log-interval 1`; "
                  "timestamp and throughput cut), stock then fixed:", ""]
        for variant in ("stock", "fixed"):
            log = runs_root / f"{variant}-d{d}" / "server.log"
            if log.exists():
                lines.append(f"{variant}:")
                lines.append("")
                lines += [f"    {ln}" for ln in decode_lines(log)]
                lines.append("")
        for variant in ("stock", "fixed"):
            r = runs.get(f"{variant}-d{d}")
            if r:
                lines.append(f"- `hazsan logscan {variant}-d{d}/server.log {' '.join(r.get('logscan_options', []))}` "
                             f"(exit {r['logscan_exit']}): {r['logscan'].get('verdict', '?')}")
        lines.append("")
    lines += [
        "## Reproduce",
        "",
        "    make sglang-proof                         # .venv-sglang (as make test-sglang), depths $SGLANG_PROOF_DEPTHS (default 1 to 8), rewrites this folder",
        "    .venv-sglang/bin/python examples/sglang_mhc/proof.py --depths 5 --out DIR     # one depth; DIR keeps the runs",
        "    hazsan check DIR/stock-d5; hazsan compare DIR/stock-d5 DIR/fixed-d5; hazsan logscan DIR/stock-d5/server.log",
        *_sweep_example(results),
        "",
        "Per run folder: `rank0.hzs`, `rank1.hzs` (the two schedulers' traces: model, testbed, steps), "
        "`pid*.hzs` (the Engine's and the detokenizer's processes, no model step), `server.log` (SGLang's "
        "log), `schedule.ndjson` (each step's requests), `tokens.json`, `outcomes.jsonl` (per request: "
        "corrupted, and the step that produced its first wrong token).",
    ]
    (out / "README.md").write_text("\n".join(lines) + "\n")
    slim = dict(results)
    slim["compare"] = {d: {"exit": c.get("exit"), "verdict": c.get("verdict"), "measures": c.get("measures"),
                           "stock_requests": {k: v for k, v in ((c.get("stock") or {}).get("requests") or {}).items()
                                              if k != "outcomes_file"},
                           "fixed_requests": {k: v for k, v in ((c.get("fixed") or {}).get("requests") or {}).items()
                                              if k != "outcomes_file"}}
                       for d, c in cmp_.items()}
    slim["runs"] = {k: {kk: vv for kk, vv in r.items() if kk != "logscan"} | {
        "logscan_verdict": r["logscan"].get("verdict"), "logscan_flagged": len(r["logscan"].get("flagged", []))}
        for k, r in runs.items()}
    text = json.dumps(slim, indent=1, default=str)
    if runs_root:
        text = text.replace(str(runs_root), "<runs>")
    (out / "results.json").write_text(text + "\n")
