"""An mHC-wrapped decoder written as an SGLang model: SGLang's layers, attention, KV cache and
symmetric-memory scope (examples/vllm_mhc's model, in SGLang).

Per layer two blocks (attention, then a dense MLP), each wrapped in mHC with `hc_streams` residual
streams x[m, k, h] (the arithmetic of examples/mhc_decode/model.py):

    coefficients   from RMSNorm(flatten(x)) @ phi: pre[m, k], post[m, k], comb[m, k, j] (Sinkhorn)
    hc_pre         y[m, h] = sum_k pre[m, k] x[m, k, h]                       (the combine)
    block          SGLang's QKVParallelLinear + RadixAttention + RowParallelLinear(reduce_results=
                   False), or MergedColumnParallelLinear + SiluAndMul + RowParallelLinear: SGLang's
                   RowParallelLinear makes its partial sum inside `use_symmetric_memory(tp_group)`
                   (linear.py), so the partial is a window buffer
    all-reduce     `tensor_model_parallel_all_reduce` (the TP GroupCoordinator's), in flight while...
    hc_post        x'[m, k, h] = post[m, k] y_sum[m, h] + sum_j comb[m, k, j] x[m, j, h]
                   (...the residual mixing, which does not need the all-reduce, runs)

The variants (HAZSAN_MHC_VARIANT) differ only in where the float32 einsums of hc_pre and of the
mixing allocate: `stock` runs them inside SGLang's `use_symmetric_memory(get_tp_group())` (every
float32 transient is placed in the window, as SGLang's SM120 fallback did); `fixed` runs them
outside, allocates only the combine's output inside, and keeps the partial referenced until the
all-reduce's wait. In `stock` the partial is a temporary: nothing references it once the all-reduce
is issued, and the testbed's collective holds none (an NCCL symmetric kernel neither), so its block
is free while the all-reduce still loads from it (free-in-flight), and a mixing transient can be
placed on those bytes while the load is pending; whether it is depends on the step's token count,
which SGLang's scheduler and NGRAM's draft depth decide.
`bare`: no testbed, SGLang's own gloo all-reduce and no symmetric scope (the reference tokens).

The scope and the all-reduce reach the testbed through testbed_comm.install(); the checkpoint is
examples/vllm_mhc's (run.py make_checkpoint: the same weight names and architecture name).
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

import torch
from torch import nn

from sglang.srt.distributed import get_tp_group, tensor_model_parallel_all_reduce
from sglang.srt.distributed.device_communicators.pynccl_allocator import use_symmetric_memory
from sglang.srt.layers.activation import SiluAndMul
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.runtime_context import get_parallel

VARIANTS = ("stock", "fixed", "bare")


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def symmetric_scope():
    """SGLang's own scope for the TP group (routed to the testbed's window by testbed_comm)."""
    return use_symmetric_memory(get_tp_group())


class MHC:
    """The mHC combine and residual mixing, in one of the variants."""

    def __init__(self, variant: str, streams: int, sinkhorn_iters: int):
        self.variant, self.n, self.iters = variant, streams, sinkhorn_iters

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
            with symmetric_scope():
                return torch.einsum("mk,mkh->mh", pre.float(), x.float()).to(x.dtype)
        y32 = torch.einsum("mk,mkh->mh", pre.float(), x.float())
        with symmetric_scope():
            y = torch.empty(y32.shape, dtype=x.dtype)
        return y.copy_(y32)

    def mix(self, x, comb):
        """sum_j comb[m, k, j] x[m, j, h] in float32 (runs while the all-reduce is in flight)."""
        with symmetric_scope() if self.variant == "stock" else contextlib.nullcontext():
            return torch.einsum("mkj,mjh->mkh", comb.float(), x.float())

    @staticmethod
    def post(mixed, post, y):
        return (mixed + post.unsqueeze(-1) * y.float().unsqueeze(1)).to(y.dtype)


class AttentionBlock(nn.Module):
    def __init__(self, config, layer_id: int, prefix: str):
        super().__init__()
        tp = get_parallel().tp_size
        h, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = heads // tp * self.head_dim
        self.kv_size = max(1, kv // tp) * self.head_dim
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.qkv_proj = QKVParallelLinear(h, self.head_dim, heads, kv, bias=False, prefix=f"{prefix}.qkv_proj")
        self.o_proj = RowParallelLinear(heads * self.head_dim, h, bias=False, reduce_results=False,
                                        prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(self.head_dim, rotary_dim=self.head_dim,
                                   max_position=config.max_position_embeddings, base=10000, is_neox_style=True)
        self.attn = RadixAttention(heads // tp, self.head_dim, self.head_dim ** -0.5,
                                   num_kv_heads=max(1, kv // tp), layer_id=layer_id, prefix=f"{prefix}.attn")

    def forward(self, positions, y, forward_batch):
        qkv, _ = self.qkv_proj(self.norm(y))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        a = self.attn(q, k, v, forward_batch)
        partial, _ = self.o_proj(a)          # in SGLang's symmetric scope (linear.py)
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

    def forward(self, positions, y, forward_batch):
        g, _ = self.gate_up_proj(self.norm(y))
        partial, _ = self.down_proj(self.act(g))
        return partial


class MHCBlock(nn.Module):
    """One block wrapped in mHC: combine, block, all-reduce overlapped with the mixing, post."""

    def __init__(self, inner: nn.Module, config, owner: "HazsanMHCForCausalLM"):
        super().__init__()
        n, h = config.hc_streams, config.hidden_size
        self.phi = nn.Parameter(torch.empty(n * h, 2 * n + n * n, dtype=torch.float32), requires_grad=False)
        self.b = nn.Parameter(torch.empty(2 * n + n * n, dtype=torch.float32), requires_grad=False)
        self.inner = inner
        self._owner = [owner]               # not a submodule

    def forward(self, positions, x, forward_batch):
        owner = self._owner[0]
        mhc, tb = owner.mhc, owner.tb
        pre, post, comb = mhc.coefficients(x, self.phi, self.b)
        y = mhc.pre(x, pre)
        partial = self.inner(positions, y, forward_batch)
        if tb is None:                       # bare: SGLang's own gloo all-reduce, synchronous
            y_sum = tensor_model_parallel_all_reduce(partial)
            mixed = mhc.mix(x, comb)
        else:
            # the all-reduce stays in flight during the mixing and writes its sum into y (the
            # combine's output, dead after the block's first norm), as examples/mhc_decode does
            with tb.overlap(into=y):
                y_sum = tensor_model_parallel_all_reduce(partial)
                if mhc.variant == "stock":
                    del partial              # a temporary: nothing keeps it alive (module doc)
                # fixed: held until the overlap's wait (its early free is a hazard of its own)
                mixed = mhc.mix(x, comb)
        return mhc.post(mixed, post, y_sum)


class HazsanMHCForCausalLM(nn.Module):
    def __init__(self, config, quant_config=None, prefix: str = ""):
        super().__init__()
        self.config = config
        self.variant = os.environ.get("HAZSAN_MHC_VARIANT", "stock")
        if self.variant not in VARIANTS:
            raise ValueError(f"HAZSAN_MHC_VARIANT must be one of {VARIANTS}, not {self.variant!r}")
        self.tb = None
        if self.variant != "bare":
            from .testbed_comm import install
            self.tb = install()
        from . import schedule
        schedule.install_in_scheduler()
        n, h = config.hc_streams, config.hidden_size
        self.mhc = MHC(self.variant, n, config.sinkhorn_iters)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, h, prefix="embed_tokens")
        blocks = []
        for i in range(config.num_hidden_layers):
            blocks.append(MHCBlock(AttentionBlock(config, i, f"layers.{2 * i}.inner"), config, self))
            blocks.append(MHCBlock(MLPBlock(config, f"layers.{2 * i + 1}.inner"), config, self))
        self.layers = nn.ModuleList(blocks)
        self.head_phi = nn.Parameter(torch.empty(n * h, n, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, h, prefix="lm_head")
        self.logits_processor = LogitsProcessor(config)

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch, input_embeds=None, **kwargs):
        e = input_embeds if input_embeds is not None else self.embed_tokens(input_ids)
        n = self.config.hc_streams
        x = e.unsqueeze(1).expand(-1, n, -1).contiguous()
        for block in self.layers:
            x = block(positions, x, forward_batch)
        m = x.shape[0]
        head = torch.sigmoid(_rms(x.reshape(m, -1)).float() @ self.head_phi)
        hidden = self.norm(torch.einsum("mk,mkh->mh", head, x.float()).to(x.dtype))
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch)

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


EntryClass = HazsanMHCForCausalLM
