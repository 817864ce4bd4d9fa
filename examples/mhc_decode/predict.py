"""Predict, without running the model, at which draft depths the stock build collides.

The window's placement depends on nothing but the sequence of allocation sizes, and those depend
only on each verify step's token count m (running requests x (depth + 1)), the hidden size h, the
vocabulary shard and the world size: the weights, the routing and the values play no part. So the
window traffic of a decode can be replayed through hazsan's caching-allocator model
(sanitizer.place, the same model the testbed places blocks with) in milliseconds, where running
the decode takes minutes. Per mHC block, as the testbed records it (model.py, stock):

    hc_pre   x.float() [m,4,h] f32, einsum [m,h] f32, free x.float(), y = .to(bf16) [m,h], free einsum
    block    partial [m,h] bf16 (attention `attn @ wo`, MoE `acc.to(bf16)`)
    comm     all_reduce(partial -> y) starts; the partial is dropped at once (free)
    hc_post  x.float() [m,4,h] f32, einsum [m,4,h] f32, free x.float()   <- while the all-reduce runs
    wait     free y, free the einsum (after hc_post)

and per step the logits gather: shard [m, vocab/world] f32, gathered [world, m, vocab/world] f32.
The fixed build allocates only y and the partial in the window. A step *collides* when a block
placed during hc_post overlaps the freed partial (`reuse-in-flight`); the rows it covers are the
corrupted rows, their requests the corrupted requests.

    python -m examples.mhc_decode.predict --depths 1-8 [run options]      # one configuration
    python -m examples.mhc_decode.predict --search                        # configurations colliding at one depth

tests/examples/test_mhc_example.py checks the prediction against the reuse-in-flight findings of real runs.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

BF16, F32 = 2, 4


@dataclass
class Prediction:
    depth: int
    requests: int
    colliding_steps: list = field(default_factory=list)
    corrupted_requests: set = field(default_factory=set)
    collisions: int = 0          # (block, step) pairs whose freed partial was overwritten

    @property
    def rate(self) -> float:
        return len(self.corrupted_requests) / self.requests if self.requests else 0.0


def predict(run, world: int, variant: str = "stock") -> Prediction:
    """Replay the decode's window allocations through the placement model."""
    from sanitizer.place import AllocatorConfig, Arena, CachingAllocator

    from .decode import Schedule
    cfg = run.model
    sched = Schedule(run)
    alloc = CachingAllocator(AllocatorConfig())
    alloc.create_pool("symm", segment_source=Arena(base=0, capacity=run.window_mb << 20), kind="symmetric")
    h, n, T, shard = cfg.hidden, cfg.streams, run.tokens_per_request, cfg.vocab // world
    out = Prediction(run.depth, len(sched.requests))

    def malloc(nbytes):
        return alloc.malloc(nbytes, stream="cpu", pool="symm")

    steps = [(None, [(s, None) for s in range(b)]) for b in warmup_batches(run)]
    steps += list(enumerate(sched.active))
    for step, running in steps:
        if not running:
            continue
        m = len(running) * T
        for _ in range(cfg.layers * 2):                    # attention and MoE blocks
            if variant == "stock":
                up, comb = malloc(m * n * h * F32), malloc(m * h * F32)
                alloc.free(up)
                y = malloc(m * h * BF16)
                alloc.free(comb)
            else:
                y = malloc(m * h * BF16)
            partial = malloc(m * h * BF16)
            lo, hi = partial.addr, partial.addr + m * h * BF16
            alloc.free(partial)                            # dropped while the all-reduce reads it
            if variant == "stock":
                up = malloc(m * n * h * F32)
                mixed = malloc(m * n * h * F32)
                alloc.free(up)
                hit = False
                for b in (up, mixed):
                    a, z = max(lo, b.addr), min(hi, b.addr + b.requested)
                    if a < z:
                        hit = True
                        rows = range((a - lo) // (h * BF16), (z - lo - 1) // (h * BF16) + 1)
                        if step is not None:
                            out.corrupted_requests.update(running[r // T][1] for r in rows)
                if hit and step is not None:
                    out.collisions += 1
                    if step not in out.colliding_steps:
                        out.colliding_steps.append(step)
                alloc.free(y)
                alloc.free(mixed)
            else:
                alloc.free(y)
        s = malloc(m * shard * F32)
        g = malloc(world * m * shard * F32)
        alloc.free(s)
        alloc.free(g)
    return out


def warmup_batches(run) -> list[int]:
    """Batch sizes of the warm-up verify steps (decode.warmup), largest first."""
    from .decode import warmup_batches as wb
    return wb(run)


def predict_depths(base, world: int, depths) -> list[Prediction]:
    from dataclasses import replace
    return [predict(replace(base, depth=d), world) for d in depths]


def search(world: int = 2, depths=range(1, 9)):
    """Configurations (hidden size, batch) of DeepSeek-V4's shape whose stock build collides at
    exactly one depth of `depths`, smallest compute first."""
    from .decode import RunConfig
    from .model import ModelConfig
    found = []
    for hidden in (1024, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 7168):
        for batch in (4, 6, 8, 12, 16):
            run = RunConfig(depth=1, batch=batch, model=ModelConfig(hidden=hidden))
            preds = predict_depths(run, world, depths)
            hit = [p for p in preds if p.corrupted_requests]
            if len(hit) == 1:
                found.append((hidden, batch, hit[0]))
    return found


def main(argv=None) -> int:
    from tabulate import tabulate

    from .decode import RunConfig
    from .run import build_parser, model_config
    from .sweep import parse_depths
    p = argparse.ArgumentParser(prog="python -m examples.mhc_decode.predict", description=__doc__.split("\n\n")[0])
    p.add_argument("--depths", default="1-8")
    p.add_argument("--search", action="store_true", help="list hidden sizes and batches that collide at one depth")
    args, rest = p.parse_known_args(argv)
    base = build_parser().parse_args(rest + ["--out", "-"])
    if args.search:
        rows = [[h, b, pr.depth, f"{len(pr.corrupted_requests)}/{pr.requests}", pr.colliding_steps]
                for h, b, pr in search(base.ranks, parse_depths(args.depths))]
        print(tabulate(rows, headers=["hidden", "batch", "colliding depth", "corrupted (predicted)", "steps"]))
        return 0
    run = RunConfig(batch=base.batch, steps=base.steps, request_steps=base.request_steps, warmup=base.warmup,
                    model=model_config(base))
    rows = []
    for pr in predict_depths(run, base.ranks, parse_depths(args.depths)):
        rows.append([pr.depth, pr.depth + 1, f"{len(pr.corrupted_requests)}/{pr.requests}",
                     pr.collisions, pr.colliding_steps or "-"])
    print(tabulate(rows, headers=["depth", "tokens/request", "corrupted (predicted)", "collisions", "steps"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
