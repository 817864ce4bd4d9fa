"""The sgl_kernel `*_cpu` ops NGRAM speculative decoding calls, in torch (test set-up, not hazsan).

Each follows the contract of the Triton kernel SGLang 0.5.23 runs on GPUs for the same step (named
per function); sizes here are a handful of requests and draft tokens, so plain loops suffice.
"""
from __future__ import annotations

import ctypes

import torch


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """srt/mem_cache/allocation.py:assign_req_to_token_pool: request i's slots
    [start_i, end_i) of req_to_token take the next end_i - start_i entries of out_cache_loc."""
    out = 0
    for row, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        req_to_token[row, s:e] = out_cache_loc[out:out + e - s].to(req_to_token.dtype)
        out += e - s


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """kernels/ops/speculative/cache_locs.py:assign_extend_cache_locs: the reverse, packing
    req_to_token[row_i, start_i:end_i] one after the other into out_cache_loc."""
    out = 0
    for row, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        out_cache_loc[out:out + e - s] = req_to_token[row, s:e].to(out_cache_loc.dtype)
        out += e - s


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """kernels/ops/kvcache/cache_move.py:copy_all_layer_kv_cache_tiled: in every buffer b (a raw
    address, rows of strides[b] bytes) row src_loc[k] is copied to row tgt_loc[k]; every source
    row is read before any is written (safe in place)."""
    src, tgt = src_loc.tolist(), tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * stride, row, stride)


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """kernels/ops/speculative/eagle.py:fill_accept_out_cache_loc: the cache locations of the
    accepted entries (accept_index != -1), packed in order."""
    flat = accept_index.reshape(-1)
    kept = flat[flat != -1]
    accept_out_cache_loc[:kept.numel()] = out_cache_loc[kept].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """kernels/ops/speculative/eagle.py:fill_bonus_tokens: the last accepted token of each request."""
    flat = accept_tokens.reshape(-1)
    for i, n in enumerate(accept_lens.tolist()):
        bonus_tokens[i] = flat[accept_stride * i + n - 1]


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """kernels/ops/speculative/spec_tree.py:verify_tree_greedy_kernel_triton: walk each request's
    draft tree from its root, at each level taking the first child whose token equals the target
    model's prediction at the last accepted node."""
    bs, n = candidates.shape
    steps = accept_index.shape[1]
    cand, ridx = candidates.tolist(), retrive_index.tolist()
    nxt, sib = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    for b in range(bs):
        last = ridx[b][0]
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, steps):
            cur = nxt[b][cur]
            want = target[last]
            while cur != -1 and cand[b][cur] != want:
                cur = sib[b][cur]
            if cur == -1:
                break
            predicts[last] = want
            accepted += 1
            accept_index[b, accepted] = ridx[b][cur]
            last = ridx[b][cur]
        accept_token_num[b] = accepted
        predicts[last] = target[last]


def reconstruct_indices_from_tree_mask(tree_mask, verified_seq_len, positions, retrieve_index,
                                       retrieve_next_token, retrieve_next_sibling, batch_size,
                                       draft_token_num):
    """sgl_kernel.speculative's op, with the contract kernels/ops/speculative/reconstruct_tree.py
    states: per request, from the n x n ancestor mask, each node's position, index, first child
    and next sibling."""
    n = draft_token_num
    mask = tree_mask.reshape(batch_size, n, n).tolist()
    seq = verified_seq_len.tolist()
    flat_positions = positions.view(-1)
    for b in range(batch_size):
        anc = [[bool(mask[b][i][j]) and j < i for j in range(n)] for i in range(n)]
        parent = [max((j for j in range(i) if anc[i][j]), default=-1) for i in range(n)]
        for t in range(n):
            flat_positions[b * n + t] = sum(anc[t]) + seq[b]
            retrieve_index[b, t] = b * n + t
            retrieve_next_token[b, t] = next((k for k in range(t + 1, n) if anc[k][t]), -1)
            retrieve_next_sibling[b, t] = -1 if parent[t] < 0 else next(
                (k for k in range(t + 1, n) if parent[k] == parent[t]), -1)
