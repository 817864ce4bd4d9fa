"""An mHC-wrapped decoder written as a vLLM model: vLLM's own layers, attention and KV cache.

Per layer two blocks (attention, then a dense MLP), each wrapped in mHC (manifold-constrained
hyper-connections) with `hc_streams` residual streams x[m, k, h], as examples/mhc_decode/model.py
(the same mHC arithmetic; here the blocks, the paged attention, the KV cache, the scheduler and
speculative decoding are vLLM's):

    coefficients   from RMSNorm(flatten(x)) @ phi: pre[m, k], post[m, k], comb[m, k, j] (Sinkhorn)
    hc_pre         y[m, h] = sum_k pre[m, k] x[m, k, h]                       (the combine)
    block          vLLM's QKVParallelLinear + Attention + RowParallelLinear(reduce_results=False),
                   or MergedColumnParallelLinear + SiluAndMul + RowParallelLinear: a partial sum,
                   produced inside the symmetric scope (placed in the window)
    all-reduce     vLLM's tensor_model_parallel_all_reduce: over the testbed, in flight while...
    hc_post        x'[m, k, h] = post[m, k] y_sum[m, h] + sum_j comb[m, k, j] x[m, j, h]
                   (...the residual mixing, which does not need the all-reduce, runs)

The two variants (HAZSAN_MHC_VARIANT) differ only in where the float32 einsums of hc_pre and
the mixing allocate: `stock` runs them inside the symmetric scope (every float32 transient is
placed in the window, as SGLang's SM120 fallback did); `fixed` runs them outside and allocates
only the combine's output inside, and keeps the partial referenced until the all-reduce's wait.
In `stock` the partial is a temporary: nothing references it once the all-reduce is issued, and
the testbed's collective holds no reference (an NCCL symmetric kernel neither), so its block is
free while the all-reduce still loads from it, here and on the peer (free-in-flight), and a
mixing transient can be placed on those bytes while the load is pending: then every rank sums
garbage. Whether that happens
depends on the step's token count (pool occupancy), which vLLM's scheduler decides.
`bare` runs the same model on vLLM's own communicator, without the testbed: the reference.

The weights (run.py writes them) tie the LM head to the embedding through a successor table made
of short cycles, so the greedy continuation of a prompt that walks a cycle is the cycle again and
vLLM's ngram proposer drafts it: clean verify steps accept nearly every draft, and a corrupted
all-reduce changes the greedy tokens, so the acceptance drops (the log signature).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

import torch
from torch import nn

from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

VARIANTS = ("stock", "fixed", "bare")


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class MHC:
    """The mHC combine and residual mixing, in one of the variants (examples/mhc_decode's MHC)."""

    def __init__(self, variant: str, tb, streams: int, sinkhorn_iters: int):
        self.variant, self.tb, self.n, self.iters = variant, tb, streams, sinkhorn_iters

    def scope(self):
        return self.tb.scope() if self.tb is not None else contextlib.nullcontext()

    def coefficients(self, x, phi, b):
        m, n, h = x.shape
        d = _rms(x.reshape(m, n * h)).float() @ phi + b
        pre = torch.sigmoid(d[:, :n])
        post = 2.0 * torch.sigmoid(d[:, n:2 * n])
        comb = torch.exp(d[:, 2 * n:].reshape(m, n, n).clamp(-8, 8))
        for _ in range(self.iters):
            comb = comb / comb.sum(-1, keepdim=True)
            comb = comb / comb.sum(-2, keepdim=True)
        return pre, post, comb

    def pre(self, x, pre):
        """y[m, h] = sum_k pre[m, k] x[m, k, h], a window tensor (the block's input)."""
        if self.variant == "stock":
            with self.scope():
                return torch.einsum("mk,mkh->mh", pre.float(), x.float()).to(x.dtype)
        y32 = torch.einsum("mk,mkh->mh", pre.float(), x.float())
        with self.scope():
            y = torch.empty(y32.shape, dtype=x.dtype)
        return y.copy_(y32)

    def mix(self, x, comb):
        """sum_j comb[m, k, j] x[m, j, h] in float32 (runs while the all-reduce is in flight)."""
        with self.scope() if self.variant == "stock" else contextlib.nullcontext():
            return torch.einsum("mkj,mjh->mkh", comb.float(), x.float())

    @staticmethod
    def post(mixed, post, y):
        return (mixed + post.unsqueeze(-1) * y.float().unsqueeze(1)).to(y.dtype)


class AttentionBlock(nn.Module):
    def __init__(self, config, cache_config, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = heads // tp * self.head_dim
        self.kv_size = max(1, kv // tp) * self.head_dim
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.qkv_proj = QKVParallelLinear(h, self.head_dim, heads, kv, bias=False, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(heads * self.head_dim, h, bias=False, reduce_results=False,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(self.head_dim, max_position=config.max_position_embeddings, is_neox_style=True)
        self.attn = Attention(heads // tp, self.head_dim, self.head_dim ** -0.5, num_kv_heads=max(1, kv // tp),
                              cache_config=cache_config, prefix=f"{prefix}.attn")

    def forward(self, positions, y, scope):
        qkv, _ = self.qkv_proj(self.norm(y))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        a = self.attn(q, k, v)
        with scope():                       # the row-parallel partial is a window buffer
            partial, _ = self.o_proj(a)
        return partial


class MLPBlock(nn.Module):
    def __init__(self, config, prefix: str):
        super().__init__()
        h = config.hidden_size
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.gate_up_proj = MergedColumnParallelLinear(h, [config.intermediate_size] * 2, bias=False,
                                                       prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(config.intermediate_size, h, bias=False, reduce_results=False,
                                           prefix=f"{prefix}.down_proj")
        self.act = SiluAndMul()

    def forward(self, positions, y, scope):
        g, _ = self.gate_up_proj(self.norm(y))
        a = self.act(g)
        with scope():
            partial, _ = self.down_proj(a)
        return partial


class MHCBlock(nn.Module):
    """One block wrapped in mHC: combine, block, all-reduce overlapped with the mixing, post."""

    def __init__(self, inner: nn.Module, config, owner: "MHCForCausalLM"):
        super().__init__()
        n, h = config.hc_streams, config.hidden_size
        self.phi = nn.Parameter(torch.empty(n * h, 2 * n + n * n, dtype=torch.float32), requires_grad=False)
        self.b = nn.Parameter(torch.empty(2 * n + n * n, dtype=torch.float32), requires_grad=False)
        self.inner = inner
        self._owner = [owner]               # not a submodule

    def forward(self, positions, x):
        owner = self._owner[0]
        mhc, tb = owner.mhc, owner.tb
        pre, post, comb = mhc.coefficients(x, self.phi, self.b)
        y = mhc.pre(x, pre)
        partial = self.inner(positions, y, mhc.scope)
        if tb is None:                       # bare: vLLM's own communicator, synchronous
            y_sum = tensor_model_parallel_all_reduce(partial)
            mixed = mhc.mix(x, comb)
        else:
            # The all-reduce stays in flight during the mixing, and writes the sum into y (the
            # combine's output, dead after the block's first norm), as examples/mhc_decode does.
            with tb.overlap(into=y):
                y_sum = tensor_model_parallel_all_reduce(partial)
                if mhc.variant == "stock":
                    del partial              # a temporary: nothing keeps it alive (module doc)
                # fixed: held until the overlap's wait (its early free is a hazard of its own)
                mixed = mhc.mix(x, comb)
        return mhc.post(mixed, post, y_sum)


class MHCForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        cache_config = vllm_config.cache_config
        self.config = config
        self.variant = os.environ.get("HAZSAN_MHC_VARIANT", "stock")
        if self.variant not in VARIANTS:
            raise ValueError(f"HAZSAN_MHC_VARIANT must be one of {VARIANTS}, not {self.variant!r}")
        self.tb = None
        if self.variant != "bare":
            from .testbed_comm import install
            self.tb = install()
        from . import schedule
        schedule.install_in_worker()
        n, h = config.hc_streams, config.hidden_size
        self.mhc = MHC(self.variant, self.tb, n, config.sinkhorn_iters)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, prefix="embed_tokens")
        blocks = []
        for i in range(config.num_hidden_layers):
            blocks.append(MHCBlock(AttentionBlock(config, cache_config, f"layers.{2 * i}.inner"), config, self))
            blocks.append(MHCBlock(MLPBlock(config, f"layers.{2 * i + 1}.inner"), config, self))
        self.layers = nn.ModuleList(blocks)
        self.head_phi = nn.Parameter(torch.empty(n * h, n, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, h, prefix="lm_head")
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        e = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        n = self.config.hc_streams
        x = e.unsqueeze(1).expand(-1, n, -1).contiguous()
        for block in self.layers:
            x = block(positions, x)
        m = x.shape[0]
        head = torch.sigmoid(_rms(x.reshape(m, -1)).float() @ self.head_phi)
        return self.norm(torch.einsum("mk,mkh->mh", head, x.float()).to(x.dtype))

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        stacked = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                   ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]
        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            for fused, part, shard in stacked:
                if f".{part}." in name:
                    target = name.replace(f".{part}.", f".{fused}.")
                    p = params[target]
                    p.weight_loader(p, w, shard)
                    break
            else:
                target = name
                p = params[target]
                getattr(p, "weight_loader", default_weight_loader)(p, w)
            loaded.add(target)
        return loaded
