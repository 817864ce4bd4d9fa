"""Speculative verification (TARGET_VERIFY) for SGLang 0.5.23's torch_native attention backend,
which has none (its extend path asserts on `extend_prefix_lens`, None when verifying). Test set-up
of `make test-sglang` (see sitecustomize.py), not hazsan.

What a verify forward computes, as SGLang's Triton backend does: each request's draft_token_num
query tokens attend to the request's committed KV (seq_lens, which exclude the drafts) and to the
drafts themselves through the tree mask. The spec info's `custom_mask` holds, per request, the
row-major [n, n] tree mask among the drafts (what NGRAM builds on CPU: ngram_worker.py,
`_prepare_for_speculative_decoding`, every draft attending to the whole committed prefix), or the
full [n, seq_len + n] block (its GPU layout, `USE_FULL_MASK`), the blocks one after the other.
"""
from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention


def install(module) -> None:
    cls = module.TorchNativeAttnBackend
    extend = cls.forward_extend
    if getattr(extend, "_verify_standin", False):
        return

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        if not forward_batch.forward_mode.is_target_verify():
            return extend(self, q, k, v, layer, forward_batch, save_kv_cache)
        return _verify(self, q, k, v, layer, forward_batch, save_kv_cache, module.KVWriteLoc)

    forward_extend._verify_standin = True
    cls.forward_extend = forward_extend


def _verify(backend, q, k, v, layer, forward_batch, save_kv_cache, kv_write_loc):
    cache_loc = forward_batch.out_cache_loc
    if save_kv_cache and k is not None and v is not None:
        backend.token_to_kv_pool.set_kv_buffer(
            layer, kv_write_loc(cache_loc, backend.swa_out_cache_loc), k, v)
    k_cache = backend.token_to_kv_pool.get_key_buffer(layer.layer_id)
    v_cache = backend.token_to_kv_pool.get_value_buffer(layer.layer_id)
    spec = forward_batch.spec_info
    n = spec.draft_token_num
    mask = spec.custom_mask
    heads, kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
    q_ = q.view(-1, heads, layer.qk_head_dim)
    o = q.new_empty((q_.shape[0], heads * layer.v_head_dim))
    o_ = o.view(-1, heads, layer.v_head_dim)
    req_to_token = backend.req_to_token_pool.req_to_token
    seq_lens = forward_batch.seq_lens.tolist()
    qlen_only = mask.numel() == len(seq_lens) * n * n
    offset = 0
    for b, (row, seq_len) in enumerate(zip(forward_batch.req_pool_indices.tolist(),
                                           seq_lens)):
        locs = torch.cat([req_to_token[row, :seq_len].to(cache_loc.dtype), cache_loc[b * n:(b + 1) * n]])
        width = n if qlen_only else seq_len + n
        attend = mask[offset:offset + n * width].view(n, width).to(torch.bool)
        offset += n * width
        if qlen_only:
            attend = torch.cat([attend.new_ones((n, seq_len)), attend], dim=1)
        query = q_[b * n:(b + 1) * n].movedim(0, 1).unsqueeze(0)          # [1, H, n, D]
        key = k_cache[locs].movedim(0, 1).unsqueeze(0).to(query.dtype)    # [1, Hkv, L, D]
        value = v_cache[locs].movedim(0, 1).unsqueeze(0).to(query.dtype)
        out = scaled_dot_product_attention(query, key, value, attn_mask=attend, scale=layer.scaling,
                                           enable_gqa=heads != kv_heads)
        o_[b * n:(b + 1) * n] = out.squeeze(0).movedim(0, 1)
    return o
