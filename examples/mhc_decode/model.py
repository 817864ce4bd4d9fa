"""A small DeepSeek-V4-style decoder, tensor-parallel over the symmetric-memory testbed.

Per layer two blocks, each wrapped in mHC (manifold-constrained hyper-connections) with
`streams` = 4 residual streams x[m, k, h]:

    coefficients   from RMSNorm(flatten(x)) @ W_phi: pre[m, k] (sigmoid), post[m, k] (2 sigmoid),
                   comb[m, k, j] (Sinkhorn-normalised, doubly stochastic)
    hc_pre         y[m, h] = sum_k pre[m, k] * x[m, k, h]                  (the combine)
    block          attention (heads split over ranks) or MoE (experts split over ranks, shared
                   expert split by intermediate size); its row-parallel output is a partial sum
    all-reduce     out-of-place on the testbed: partial -> y (the combine's output buffer, dead
                   after the block's first norm, is reused as the block's output)
    hc_post        x'[m, k, h] = post[m, k] * y[m, h] + sum_j comb[m, k, j] * x[m, j, h]
                   (the residual mixing does not need the all-reduce, so it overlaps it)

The two mHC variants differ only in where their float32 einsums allocate:
    stock   the fallback runs the einsums inside the symmetric scope, so every float32 transient
            (upcast copies, the einsum results) is placed in the window;
    fixed   the einsums run outside the scope; only the combine's output y is allocated inside
            (it is a collective buffer) and filled.
The arithmetic is identical, so with no corruption both produce bit-identical outputs.

The partial handed to the all-reduce is a temporary: the stock caller keeps no reference to it, as
code written for torch.distributed does (c10d's Work keeps its tensors alive). The testbed's
collective, like an NCCL symmetric kernel, keeps none: the partial's block is free while the
collective still reads it (free-in-flight, a latent hazard), and the stock variant allocates in the
window while the collective is in flight (the overlapped mixing), so a transient can land on the
freed partial. The fixed variant removes both: its einsums run outside the scope, and it keeps the
partial referenced until the wait. `hold_partial=True` gives the stock variant that discipline too
(its transients then stay in the window, but land on no freed buffer).
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

DT = torch.bfloat16


@dataclass(frozen=True)
class ModelConfig:
    hidden: int = 7168              # DeepSeek-V4's: the window's bytes per token are the real ones
    layers: int = 2
    heads: int = 8
    head_dim: int = 64
    experts: int = 8
    top_k: int = 2
    expert_inter: int = 256
    shared_inter: int = 512
    vocab: int = 2048
    streams: int = 4
    sinkhorn_iters: int = 4
    max_context: int = 256
    seed: int = 1234
    # The draft model proposes the target's own next token for this share of the vocabulary (a
    # random one elsewhere): each draft is accepted with about this probability, as with a good
    # MTP/EAGLE draft head (accept len about 4 at depth 4).
    draft_match: float = 0.92
    # Scale of the token embedding against the blocks' outputs (which see normalised inputs):
    # below 1 the blocks' outputs weigh more in the final hidden state, so a corrupted block
    # output changes the greedy tokens, as it does in a real model.
    embed_scale: float = 1.0
    # The successor's logit (times the cosine between the final hidden state and the token's
    # embedding) against the random head's N(0, 1) logits: how confident the target's greedy
    # choice is. About 9 keeps every clean choice (the best of 2048 normals is about 3.5) and lets
    # a corrupted block output flip it, whatever the hidden size.
    head_margin: float = 9.0

    def to_dict(self) -> dict:
        return asdict(self)


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


WEIGHTS_CACHE_ENV = "MHC_WEIGHTS_CACHE"     # a folder: each rank's drawn shards are kept there and reused


class Weights:
    """Full weights drawn from one seed (equal on every rank), then this rank's shards. Drawn on
    the CPU (the same numbers whatever the device), then moved to torch's default device.
    With $MHC_WEIGHTS_CACHE set (run.execute sets it beside the reference cache) the shards drawn
    once are saved there and loaded by every later process of the same configuration, rank and
    world size: the same tensors, without drawing them again (1.8 s of CPU per process)."""

    def __init__(self, cfg: ModelConfig, rank: int, world: int):
        device = torch.get_default_device()
        with torch.device("cpu"):
            cache = os.environ.get(WEIGHTS_CACHE_ENV)
            path = None
            if cache:
                with open(__file__, "rb") as f:      # a change to this file draws them anew
                    source = f.read()
                key = hashlib.sha256(repr((asdict(cfg), rank, world)).encode() + source).hexdigest()[:16]
                path = os.path.join(cache, f"weights-{key}.pt")
            if path and os.path.exists(path):
                vars(self).update(torch.load(path))
            else:
                self._draw(cfg, rank, world)
                if path:
                    os.makedirs(cache, exist_ok=True)
                    part = f"{path}.{os.getpid()}.part"
                    torch.save(dict(vars(self)), part)
                    os.replace(part, path)
        if device.type != "cpu":
            for L in self.layers:
                for k, v in L.items():
                    if isinstance(v, torch.Tensor):
                        L[k] = v.to(device)
            for k in ("embed", "head_phi", "successor", "lm_head"):
                setattr(self, k, getattr(self, k).to(device))

    def _draw(self, cfg: ModelConfig, rank: int, world: int):
        if cfg.heads % world or cfg.experts % world or cfg.shared_inter % world or cfg.vocab % world:
            raise ValueError(f"heads, experts, shared_inter and vocab must divide by the world size {world}")
        g = torch.Generator().manual_seed(cfg.seed)
        h, n = cfg.hidden, cfg.streams

        def w(*shape, scale=None):
            scale = scale if scale is not None else 1.0 / math.sqrt(shape[0])
            return (torch.randn(*shape, generator=g) * scale).to(DT)

        self.embed = w(cfg.vocab, h, scale=cfg.embed_scale)
        hl = cfg.heads // world
        q0, q1 = rank * hl * cfg.head_dim, (rank + 1) * hl * cfg.head_dim
        el = cfg.experts // world
        sl = cfg.shared_inter // world
        vl = cfg.vocab // world
        self.layers = []
        for _ in range(cfg.layers):
            L = {}
            for blk in ("attn", "moe"):
                L[blk + ".phi"] = (torch.randn(n * h, 2 * n + n * n, generator=g) / math.sqrt(n * h)).float()
                L[blk + ".b"] = (torch.randn(2 * n + n * n, generator=g) * 0.1).float()
            L["wq"] = w(h, cfg.heads * cfg.head_dim)[:, q0:q1].contiguous()
            L["wk"] = w(h, cfg.heads * cfg.head_dim)[:, q0:q1].contiguous()
            L["wv"] = w(h, cfg.heads * cfg.head_dim)[:, q0:q1].contiguous()
            L["wo"] = w(cfg.heads * cfg.head_dim, h)[q0:q1].contiguous()
            L["router"] = w(h, cfg.experts).float()
            w1 = w(cfg.experts, h, cfg.expert_inter, scale=1 / math.sqrt(h))
            w3 = w(cfg.experts, h, cfg.expert_inter, scale=1 / math.sqrt(h))
            w2 = w(cfg.experts, cfg.expert_inter, h, scale=1 / math.sqrt(cfg.expert_inter))
            L["w1"], L["w3"], L["w2"] = (t[rank * el:(rank + 1) * el].contiguous() for t in (w1, w3, w2))
            L["expert0"] = rank * el
            s1, s3, s2 = w(h, cfg.shared_inter), w(h, cfg.shared_inter), w(cfg.shared_inter, h)
            L["s1"], L["s3"] = s1[:, rank * sl:(rank + 1) * sl].contiguous(), s3[:, rank * sl:(rank + 1) * sl].contiguous()
            L["s2"] = s2[rank * sl:(rank + 1) * sl].contiguous()
            self.layers.append(L)
        self.head_phi = (torch.randn(n * h, n, generator=g) / math.sqrt(n * h)).float()
        # The LM head is tied to the embedding through a permutation: column v is the embedding
        # of the token whose successor is v, so the target's greedy next token after t is
        # successor[t] (the residual stream keeps t's embedding dominant). That gives the target
        # a behaviour a draft model can predict, so acceptance means something, and corrupted
        # block outputs (garbage sums) change the greedy tokens and lower it.
        self.successor = torch.randperm(cfg.vocab, generator=g)
        tied = self.embed[torch.argsort(self.successor)].t().float() / (h * cfg.embed_scale)
        head = tied * cfg.head_margin + torch.randn(h, cfg.vocab, generator=g) / math.sqrt(h)
        self.lm_head = head[:, rank * vl:(rank + 1) * vl].to(DT).contiguous()
        self.heads_local = hl


class MHC:
    """The mHC combine and post-mixing, in one of the two variants."""

    def __init__(self, variant: str, comm, cfg: ModelConfig):
        if variant not in ("stock", "fixed"):
            raise ValueError(f"variant must be stock or fixed, not {variant!r}")
        self.variant, self.comm, self.cfg = variant, comm, cfg

    def coefficients(self, x: torch.Tensor, phi: torch.Tensor, b: torch.Tensor):
        m, n, h = x.shape
        d = _rms(x.reshape(m, n * h)).float() @ phi + b
        pre = torch.sigmoid(d[:, :n])
        post = 2.0 * torch.sigmoid(d[:, n:2 * n])
        comb = torch.exp(d[:, 2 * n:].reshape(m, n, n).clamp(-8, 8))
        for _ in range(self.cfg.sinkhorn_iters):
            comb = comb / comb.sum(-1, keepdim=True)
            comb = comb / comb.sum(-2, keepdim=True)
        return pre, post, comb

    def _scope(self):
        return self.comm.scope() if self.variant == "stock" else contextlib.nullcontext()

    def pre(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """y[m, h] = sum_k pre[m, k] x[m, k, h], as a window tensor (the all-reduce writes it)."""
        if self.variant == "stock":
            with self.comm.scope():
                return torch.einsum("mk,mkh->mh", pre.float(), x.float()).to(DT)
        y32 = torch.einsum("mk,mkh->mh", pre.float(), x.float())
        with self.comm.scope():
            y = torch.empty(y32.shape, dtype=DT)
        return y.copy_(y32)

    def mix(self, x: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """sum_j comb[m, k, j] x[m, j, h] in float32 (runs while the all-reduce is in flight)."""
        with self._scope():
            return torch.einsum("mkj,mjh->mkh", comb.float(), x.float())

    @staticmethod
    def post(mixed: torch.Tensor, post: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (mixed + post.unsqueeze(-1) * y.float().unsqueeze(1)).to(DT)


class KVCache:
    """Per layer, per batch slot: keys and values of this rank's heads."""

    def __init__(self, cfg: ModelConfig, batch: int, heads_local: int):
        shape = (cfg.layers, batch, cfg.max_context, heads_local, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=DT)
        self.v = torch.zeros(shape, dtype=DT)
        self.length = torch.zeros(batch, dtype=torch.long)


class Model:
    def __init__(self, cfg: ModelConfig, comm, rank: int, world: int, variant: str,
                 hold_partial: bool = False):
        self.cfg = cfg
        # keep the partial referenced until the wait (safe). The fixed build always does: its early
        # free is a hazard of its own (free-in-flight), harmless in this run only because nothing
        # else is placed in the window while the all-reduce reads it.
        self.hold_partial = hold_partial or variant == "fixed"
        self.sync_collectives = False      # wait for each all-reduce at once (warm-up: no overlap)
        self.comm = comm
        self.rank, self.world = rank, world
        self.W = Weights(cfg, rank, world)
        self.mhc = MHC(variant, comm, cfg)

    # ---- blocks (row-parallel partial sums, allocated in the window) -----------------------
    def _attention_partial(self, y, li, cache: KVCache, tokens_per_req: int):
        cfg, L = self.cfg, self.W.layers[li]
        m = y.shape[0]
        b, t = m // tokens_per_req, tokens_per_req
        hl, dh = self.W.heads_local, cfg.head_dim
        n = _rms(y)
        q = (n @ L["wq"]).view(b, t, hl, dh)
        k = (n @ L["wk"]).view(b, t, hl, dh)
        v = (n @ L["wv"]).view(b, t, hl, dh)
        active = self._active
        lengths = cache.length[active]
        ctx = int(lengths.max())
        keys = torch.cat([cache.k[li, active, :ctx], k], 1)         # [b, ctx + t, hl, dh]
        vals = torch.cat([cache.v[li, active, :ctx], v], 1)
        pos = torch.arange(ctx + t)
        valid_ctx = pos.unsqueeze(0) < lengths.unsqueeze(1)         # [b, ctx + t]
        valid_ctx[:, ctx:] = False
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        mask = valid_ctx.unsqueeze(1).expand(b, t, ctx + t).clone()
        mask[:, :, ctx:] = causal
        scores = torch.einsum("bthd,bshd->bhts", q.float(), keys.float()) / math.sqrt(dh)
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        attn = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), vals.float()).to(DT).reshape(m, hl * dh)
        self._new_kv = (k, v)
        with self.comm.scope():
            return attn @ L["wo"]

    def _moe_partial(self, y, li):
        cfg, L = self.cfg, self.W.layers[li]
        n = _rms(y)
        logits = n.float() @ L["router"]
        weights, chosen = logits.softmax(-1).topk(cfg.top_k, -1)
        weights = weights / weights.sum(-1, keepdim=True)
        acc = (F.silu(n @ L["s1"]) * (n @ L["s3"])) @ L["s2"]        # shared expert, this rank's slice
        acc = acc.float()
        for e in range(L["w1"].shape[0]):
            rows, slot = (chosen == L["expert0"] + e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            xe = n[rows]
            ye = (F.silu(xe @ L["w1"][e]) * (xe @ L["w3"][e])) @ L["w2"][e]
            acc.index_add_(0, rows, ye.float() * weights[rows, slot].unsqueeze(-1))
        with self.comm.scope():
            return acc.to(DT)

    # ---- one mHC-wrapped block --------------------------------------------------------------
    def _block(self, x, li, kind, cache, tokens_per_req):
        L = self.W.layers[li]
        pre, post, comb = self.mhc.coefficients(x, L[kind + ".phi"], L[kind + ".b"])
        y = self.mhc.pre(x, pre)
        if kind == "attn":
            partial = self._attention_partial(y, li, cache, tokens_per_req)
        else:
            partial = self._moe_partial(y, li)
        # Out-of-place all-reduce into y. The partial is a temporary: after this line nothing
        # references it, and the collective (one-sided, by offset) holds no reference either.
        work = self.comm.all_reduce(partial, out=y)
        if self.sync_collectives:
            work.wait()                    # same placement as below, but nothing left in flight
        if not self.hold_partial:
            del partial
        mixed = self.mhc.mix(x, comb)      # overlaps the all-reduce
        work.wait()
        return self.mhc.post(mixed, post, y)

    def forward(self, tokens: torch.Tensor, cache: KVCache, tokens_per_req: int, active: torch.Tensor):
        """tokens [m] of the batch slots `active` -> logits [m, vocab] (float32) and each layer's
        new keys/values."""
        cfg = self.cfg
        self._active = active
        x = self.W.embed[tokens].unsqueeze(1).expand(-1, cfg.streams, -1).contiguous()
        new_kv = []
        for li in range(cfg.layers):
            x = self._block(x, li, "attn", cache, tokens_per_req)
            new_kv.append(self._new_kv)
            x = self._block(x, li, "moe", cache, tokens_per_req)
        m = x.shape[0]
        head = torch.sigmoid(_rms(x.reshape(m, -1)).float() @ self.W.head_phi)
        h = _rms(torch.einsum("mk,mkh->mh", head, x.float()).to(DT))
        local = (h @ self.W.lm_head).float()
        with self.comm.scope():                      # vocab-parallel head: gather the shards
            shard = torch.empty(local.shape, dtype=torch.float32)
            gathered = torch.empty((self.world,) + local.shape, dtype=torch.float32)
        shard.copy_(local)
        self.comm.all_gather(shard, gathered).wait()
        logits = gathered.permute(1, 0, 2).reshape(m, cfg.vocab).clone()
        return logits, new_kv
