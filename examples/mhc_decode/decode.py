"""The decode loop: speculative verify steps over a batch of requests, on 2-4 rank processes.

Two phases, each a world of rank processes:

  reference  plain tensors, torch.distributed (gloo) gathers and the testbed's arithmetic (sum of
             the ranks' partials in rank order, in float32): no symmetric memory anywhere. It
             decides every step's input tokens and acceptances and keeps the logits.
  sanitised  the same decode on the symmetric-memory testbed, in the chosen mHC variant, fed the
             reference's inputs (teacher forcing), its logits compared with the reference's bit
             for bit. A request is corrupted when any of its rows differs on any rank.

A verify step takes (running requests) x (depth + 1) tokens: per request its last accepted token
and `depth` draft tokens from a draft model (a fixed bigram table); acceptance is the longest
prefix of drafts that equals the target's greedy tokens, plus the target's own next token. The
batch changes from step to step (continuous batching, see Schedule), so the verify shape does.
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass

import torch

from .model import DT, KVCache, Model, ModelConfig


@dataclass(frozen=True)
class RunConfig:
    variant: str = "stock"
    depth: int = 4
    batch: int = 18
    steps: int = 16
    request_steps: int = 4
    prompt: int = 16
    # How long a collective waits before loading its inputs (the time a real one is in flight). Long
    # enough that a transient placed over a freed input is written before the load on a loaded machine
    # too: with 1 ms, 39 of the 50 predicted requests were corrupted under load 5-10, with 5 ms all 50.
    comm_latency_ms: float = 5.0
    hold_partial: bool = False
    window_mb: int = 128
    device: str = "cpu"             # "cuda": rank r on GPU r % device_count, the CuPy testbed
    log_interval: int = 1           # verify steps per `Decode batch` line of the server log
    # Warm-up verify steps before serving, at these batch sizes, largest first (a server captures
    # its CUDA graphs so, and the symmetric pool keeps the segments they leave): "pow2" for
    # 1, 2, 4, ... up to batch, "max" for batch only, "none". The warm-up waits for each
    # collective before going on (no overlap), so it leaves segments but no hazard of its own.
    warmup: str = "pow2"
    model: ModelConfig = ModelConfig()

    @property
    def tokens_per_request(self) -> int:
        return self.depth + 1

    @property
    def tokens(self) -> int:
        """Tokens of a verify step with every batch slot running."""
        return self.batch * (self.depth + 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens"] = self.tokens
        return d

    def reference_key(self, ranks: int) -> str:
        """Identifies the reference decode (independent of variant, latency and partial lifetime)."""
        import hashlib
        import json
        d = self.to_dict()
        for k in ("variant", "comm_latency_ms", "hold_partial", "window_mb", "log_interval", "warmup"):
            d.pop(k)
        d["ranks"] = ranks
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- reference comm
class _Done:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


class PlainComm:
    """No symmetric memory: ordinary tensors, gloo all_gather, then the testbed's reduction."""

    def __init__(self, rank: int, world: int, port: int):
        import torch.distributed as dist
        self.dist = dist
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        self.world = world

    def scope(self):
        return contextlib.nullcontext()

    def step(self, n, phase=None, tokens=None):
        pass

    def _gather(self, t):
        src = t.contiguous()
        wire = src.view(torch.uint8).cpu()               # exact bytes, any dtype, through gloo
        parts = [torch.empty_like(wire) for _ in range(self.world)]
        self.dist.all_gather(parts, wire)
        return [p.to(src.device).view(src.dtype) for p in parts]

    def all_reduce(self, t, out=None):
        acc = None
        for part in self._gather(t):
            part = part.to(torch.float32, copy=True)
            acc = part if acc is None else acc.add_(part)
        (t if out is None else out).copy_(acc)
        return _Done()

    def all_gather(self, t, out):
        for q, part in enumerate(self._gather(t)):
            out[q].copy_(part)
        return _Done()

    def close(self):
        self.dist.destroy_process_group()


# ----------------------------------------------------------------------------- the loop
class Schedule:
    """Continuous batching: which request each batch slot serves at each step.

    Each slot serves requests one after the other; a request lasts between half and 1.5 times
    `request_steps` verify steps, and a slot sometimes idles for a step between two requests, so
    the number of running requests (and the tokens of a verify step) changes from step to step,
    as in a serving engine. Drawn from the model seed: equal on every rank and in every run of
    the same shape. A new request starts from a synthetic prefilled context of `prompt` tokens.
    """

    def __init__(self, run: RunConfig):
        import random
        self.run = run
        g = random.Random(run.model.seed * 31 + run.batch * 7 + run.request_steps)
        lo, hi = max(1, run.request_steps // 2), max(1, (3 * run.request_steps) // 2)
        spans = []
        for slot in range(run.batch):
            t = g.randrange(0, max(1, run.request_steps // 2))
            while t < run.steps:
                n = g.randint(lo, hi)
                spans.append((t, slot, min(t + n, run.steps) - 1))
                t += n + (1 if g.random() < 0.25 else 0)
        spans.sort()
        self.requests = {i: (slot, first, last) for i, (first, slot, last) in enumerate(spans)}
        self.active: list[list[tuple[int, int]]] = [[] for _ in range(run.steps)]   # step -> [(slot, req)]
        self.starting: list[set] = [set() for _ in range(run.steps)]
        for req, (slot, first, last) in self.requests.items():
            self.starting[first].add(slot)
            for n in range(first, last + 1):
                self.active[n].append((slot, req))
        for a in self.active:
            a.sort()

    def span(self, req: int) -> tuple[int, int]:
        _, first, last = self.requests[req]
        return first, last

    def prefill(self, model: Model, cache: KVCache, slot: int, req: int) -> int:
        """Fill the slot's cache with the request's context; return its first token."""
        cfg, run = model.cfg, self.run
        g = torch.Generator().manual_seed(cfg.seed * 7919 + req)
        shape = (cfg.layers, run.prompt, cfg.heads, cfg.head_dim)
        with torch.device("cpu"):
            k = torch.randn(shape, generator=g).to(DT)
            v = torch.randn(shape, generator=g).to(DT)
            first = int(torch.randint(cfg.vocab, (1,), generator=g))
        hl = model.W.heads_local
        heads = slice(model.rank * hl, (model.rank + 1) * hl)
        cache.k[:, slot].zero_()
        cache.v[:, slot].zero_()
        cache.k[:, slot, :run.prompt] = k[:, :, heads]
        cache.v[:, slot, :run.prompt] = v[:, :, heads]
        cache.length[slot] = run.prompt
        return first


def warmup_batches(run: RunConfig) -> list[int]:
    if run.warmup == "none":
        return []
    if run.warmup == "max":
        return [run.batch]
    if run.warmup == "pow2":
        sizes, b = [], 1
        while b < run.batch:
            sizes.append(b)
            b *= 2
        return sorted(set(sizes + [run.batch]), reverse=True)
    raise ValueError(f"warmup must be none, max or pow2, not {run.warmup!r}")


def warm_up(model: Model, run: RunConfig) -> None:
    """Verify steps at the warm-up batch sizes on a scratch cache, before serving (no step
    marker: they belong to the set-up). Their outputs are thrown away; what stays is the
    window's cached segments, as after a server's CUDA-graph capture."""
    cfg = model.cfg
    model.sync_collectives = True
    try:
        for b in warmup_batches(run):
            cache = KVCache(cfg, b, model.W.heads_local)
            cache.length[:] = run.prompt
            tokens = torch.zeros(b * run.tokens_per_request, dtype=torch.long)
            with torch.inference_mode():
                model.forward(tokens, cache, run.tokens_per_request, torch.arange(b))
    finally:
        model.sync_collectives = False


def draft_table(cfg: ModelConfig, successor: torch.Tensor) -> torch.Tensor:
    """The draft model, a bigram table: the target's successor for a `draft_match` share of the
    tokens, a random token for the others."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    with torch.device("cpu"):
        table = successor.cpu().clone()
        other = torch.rand(cfg.vocab, generator=g) >= cfg.draft_match
        table[other] = torch.randint(cfg.vocab, (int(other.sum()),), generator=g)
    return table.to(successor.device)


def verify(inputs: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The speculative verify step: (greedy tokens [b, T], drafts accepted [b]). inputs[:, 0] is
    each request's last token, inputs[:, 1:] its drafts; a draft is accepted when it equals the
    target's greedy token at the previous position and every earlier draft was accepted."""
    greedy = logits.argmax(-1)
    match = (inputs[:, 1:] == greedy[:, :-1]).long()
    return greedy, match.cumprod(1).sum(1)


def _append_kv(cache: KVCache, new_kv, accepted: torch.Tensor, slots: list) -> None:
    for li, (k, v) in enumerate(new_kv):
        for i, s in enumerate(slots):
            n = int(accepted[i]) + 1                 # the last token and the accepted drafts
            at = int(cache.length[s])
            cache.k[li, s, at:at + n] = k[i, :n]
            cache.v[li, s, at:at + n] = v[i, :n]
    for i, s in enumerate(slots):
        cache.length[s] += int(accepted[i]) + 1


def decode(model: Model, run: RunConfig, comm, reference: dict | None, log=None) -> dict:
    """Run the verify steps. Without `reference`, decide inputs and acceptances (and return them
    with the logits); with it, replay its inputs and return, per step, each running request's
    largest |error| against the reference logits and the drafts its own verify step accepted
    (`observed`: lower than the reference's where the logits are corrupted). `log`, a
    serverlog.DecodeLog, gets every step's running requests and accepted drafts."""
    torch.manual_seed(0)
    cfg = model.cfg
    B, T = run.batch, run.tokens_per_request
    sched = Schedule(run)
    cache = KVCache(cfg, B, model.W.heads_local)
    table = draft_table(cfg, model.W.successor)
    last = torch.zeros(B, dtype=torch.long)
    if reference is not None:
        warm_up(model, run)
    out = {"inputs": [], "accepted": [], "logits": []} if reference is None else {"errors": [], "observed": [], "expected": []}
    for n in range(run.steps):
        running = sched.active[n]
        if not running:
            if reference is None:
                out["inputs"].append(None), out["accepted"].append(None), out["logits"].append(None)
            else:
                out["errors"].append([])
                out["observed"].append([])
                out["expected"].append([])
            continue
        for s in sorted(sched.starting[n]):
            last[s] = sched.prefill(model, cache, s, dict(running)[s])
        slots = [s for s, _ in running]
        active = torch.tensor(slots, dtype=torch.long)
        comm.step(n, phase="verify", tokens=len(slots) * T)
        if reference is None:
            drafts = [last[active]]
            for _ in range(run.depth):
                drafts.append(table[drafts[-1]])
            inputs = torch.stack(drafts, 1)                       # [b, T]
        else:
            inputs = reference["inputs"][n]
        with torch.inference_mode():
            logits, new_kv = model.forward(inputs.reshape(-1), cache, T, active)
        logits = logits.view(len(slots), T, cfg.vocab)
        if reference is None:
            greedy, accepted = verify(inputs, logits)
            out["inputs"].append(inputs)
            out["accepted"].append(accepted)
            out["logits"].append(logits.clone())
        else:
            # The server's verify step on these logits: what it would accept. The decode itself
            # goes on with the reference's tokens (teacher forcing), so every step's shape, and
            # with it the window's placement, is the reference's and the comparison stays exact.
            _, observed = verify(inputs, logits)
            accepted = reference["accepted"][n]
            greedy = reference["logits"][n].argmax(-1)
            diff = (logits - reference["logits"][n]).abs().nan_to_num(nan=float("inf"))
            errs = diff.flatten(1).amax(1).cpu().tolist()
            out["errors"].append([(req, e) for (_, req), e in zip(running, errs)])
            out["observed"].append([(req, int(a)) for (_, req), a in zip(running, observed.tolist())])
            out["expected"].append([(req, int(a)) for (_, req), a in zip(running, accepted.tolist())])
            if log is not None:
                log.step(len(slots), observed.tolist(), int(cache.length[active].sum()) + len(slots) * T)
        last[active] = greedy[torch.arange(len(slots)), accepted]
        _append_kv(cache, new_kv, accepted, slots)
    if log is not None:
        log.close()
    return out


# ----------------------------------------------------------------------------- rank entry points
def use_device(rank: int, run: RunConfig) -> int | None:
    """Make the run's device torch's default in this rank process; the GPU index, or None on CPU."""
    if run.device == "cpu":
        return None
    if run.device != "cuda":
        raise ValueError(f"device must be cpu or cuda, not {run.device!r}")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS: exact comparison
    gpu = int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()
    torch.cuda.set_device(gpu)
    torch.set_default_device(f"cuda:{gpu}")
    return gpu


def reference_rank(rank: int, files, run: RunConfig, port: int, path: str):
    torch.set_num_threads(1)
    use_device(rank, run)
    comm = PlainComm(rank, files.world_size, port)
    try:
        model = Model(run.model, comm, rank, files.world_size, "fixed")
        ref = decode(model, run, comm, None)
    finally:
        comm.close()
    if rank == 0:
        torch.save(ref, path)
    return True


def sanitised_rank(rank: int, files, run: RunConfig, ref_path: str, trace_dir: str):
    """One sanitised run in its own world (the reference comes from a file)."""
    torch.set_num_threads(1)
    use_device(rank, run)
    return _sanitised(rank, files, run, torch.load(ref_path, map_location=torch.get_default_device()), trace_dir)


def world_rank(rank: int, files, plan: list, port: int):
    """Several runs in one world (no capture): each run's reference decode (computed once per
    shape) and its sanitised decode on a fresh communicator writing to its own trace_dir."""
    torch.set_num_threads(1)
    use_device(rank, plan[0][0])
    plain = PlainComm(rank, files.world_size, port)
    results, key, reference = [], None, None
    try:
        for run, trace_dir in plan:
            k = run.reference_key(files.world_size)
            if k != key:
                key, reference = k, None
                model = Model(run.model, plain, rank, files.world_size, "fixed")
                reference = decode(model, run, plain, None)
            results.append(_sanitised(rank, files, run, reference, trace_dir))
    finally:
        plain.close()
    return results


def _sanitised(rank: int, files, run: RunConfig, reference: dict, trace_dir: str) -> dict:
    from sanitizer.testbed import SymmetricCommunicator
    kwargs = {}
    if run.device == "cuda":
        from sanitizer.testbed.cuda import CudaSymmetricCommunicator as SymmetricCommunicator  # noqa: N813
        kwargs["device"] = use_device(rank, run)
    comm = SymmetricCommunicator(files, rank, name="tp", trace_dir=trace_dir,
                                 read_delay=run.comm_latency_ms / 1000.0, **kwargs)
    t0 = time.monotonic()
    try:
        model = Model(run.model, comm, rank, files.world_size, run.variant, run.hold_partial)
        log = None
        if rank == 0 and trace_dir:      # TP0's scheduler writes the server log, as in SGLang
            from .serverlog import LOG_NAME, DecodeLog
            log = DecodeLog(os.path.join(trace_dir, LOG_NAME), depth=run.depth, interval=run.log_interval,
                            capacity=run.batch * run.model.max_context)
        got = decode(model, run, comm, reference, log)
        placed = comm.pool.allocations
        colls = comm.collectives
    finally:
        comm.close()
    return {"rank": rank, "errors": got["errors"], "observed": got["observed"],
            "expected": got["expected"], "window_allocations": placed,
            "collectives": colls, "trace": comm.recorder.path, "seconds": time.monotonic() - t0}


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trace_env_dir() -> str | None:
    """Where capture writes when HAZSAN is on (its HAZSAN_DIR default)."""
    if os.environ.get("HAZSAN", "").strip().lower() in ("", "0", "false", "no", "off"):
        return None
    return os.path.abspath(os.environ.get("HAZSAN_DIR") or "hazsan-traces")
