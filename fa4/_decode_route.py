"""Decode-shaped calls of flash_attn_func and flash_attn_varlen_func on the split-KV launch.

A forward with a few query tokens against many keys (a decode step, a speculative-decoding step)
fills one 64-row tile per sequence and query head on the attention kernel's grid: at batch 1 with 32
query heads that is 32 CTAs streaming the whole cache while the other SMs idle, and each query head
reads its KV head again. flash_attn_with_kvcache runs such calls on the split-KV launch instead (key
chunks on CTAs of their own, a GQA group's query heads packed as rows of one tile, a merge through
the lse; fa4/_kvcache.py). A call of the official interface with that shape that needs no gradient
is the same computation, so it takes the same route:

- flash_attn_func: q (B, Sq, Hq, D) with Sq <= DECODE_ROUTE_MAX_QUERY, k / v (B, Sk, Hkv, *): a dense
  cache whose every key is used;
- flash_attn_varlen_func with page_table (the official interface's paged decode): q padded (B, Sq, ...)
  or packed with one token a sequence (max_seqlen_q = 1 and total_q = batch), seqused_k the cache
  lengths (None: every key of the table's pages), at a native head-dim pair (padding the head dims
  would copy the whole page pool; the gathering route pads only the pages used);
- flash_attn_varlen_func with q and k / v padded: the same, seqused_k the lengths.

Causal masks and windows are bottom-right aligned to each sequence's keys in both functions, as in
flash_attn_with_kvcache, so the route changes no semantics. It changes bits: the split launch sums a
row's keys chunk by chunk, so the two routes agree under the FA4 rule, not bit for bit. A call that
needs a gradient (grad mode on and an input or the sink requiring it, or inside a forward-mode AD
level) keeps the forward whose backward it needs; so does every call off sm_90 (the split launch is
Hopper's), with no keys or no heads, or with seqused_q. fa4._dispatch.DECODE_ROUTE_MAX_QUERY = None
turns the route off (the benchmarks' old path).
"""
from __future__ import annotations

import torch
from torch.autograd import forward_ad

from . import _kvcache, _paged
from ._paged import needs_grad


def _size(n):
    """An int or symbolic size as it is, else None. Only comparisons are made of it, so a traced call
    guards on those, not on its value (a growing cache under torch.compile keeps one graph)."""
    return n if isinstance(n, (int, torch.SymInt)) and not isinstance(n, bool) else None


def _forward_ad_active() -> bool:
    """Inside a forward-mode AD level (torch.autograd.forward_ad.dual_level) inputs may carry tangents,
    which the split launch would drop without a word; the forward's op refuses them instead."""
    return getattr(forward_ad, "_current_level", -1) >= 0


def takes(q, k, v, sink, tokens, keys, batch) -> bool:
    """Whether a call of `batch` sequences with at most `tokens` query tokens and `keys` cache rows
    each runs on the split launch: no gradient wanted, sm_90, 1 <= tokens <= DECODE_ROUTE_MAX_QUERY,
    and the grid and offsets flash_attn_with_kvcache accepts. Reads shapes only."""
    from . import _dispatch

    limit = _dispatch.DECODE_ROUTE_MAX_QUERY
    if limit is None or needs_grad(q, k, v, sink) or _forward_ad_active():
        return False
    if q.device.type != "cuda" or not torch.cuda.is_available():
        return False  # (fake CUDA tensors on a machine without one: no arch to ask, the op's own fake serves)
    if not _dispatch.backend_for(q.device).SPLIT_KV_LAUNCH:
        return False
    sizes = tokens, keys, batch, heads, heads_kv = [_size(n) for n in (tokens, keys, batch, q.shape[-2], k.shape[-2])]
    if any(n is None for n in sizes):
        return False
    grid_ok = batch <= _kvcache.MAX_GRID_Z and heads <= _kvcache.MAX_GRID_Z
    return (1 <= tokens <= limit and keys >= 1 and batch >= 1 and heads_kv >= 1 and heads >= 1 and grid_ok
            and k.shape[0] * k.shape[1] < 2 ** 31)


def native_head_dims(q, v) -> bool:
    """Whether (q's, v's) head dims are a pair the device's kernels have. The others run padded, and
    padding a cache's head dim copies the whole cache (the gathering routes pad only what they read)."""
    from . import _dispatch

    return (q.shape[-1], v.shape[-1]) in _dispatch.backend_for(q.device).arch.head_dims


def attend(q, k, v, scale, causal, left, right, softcap, sink, seqlens=None, page_table=None):
    """q (B, Sq, Hq, D) against a dense cache k / v (B, Sk, Hkv, *) or pages with page_table, the first
    seqlens[b] keys of each sequence (None: all): flash_attn_with_kvcache's attention. The arguments
    were checked by the caller, and `takes` said yes; head dims that run padded are padded here. A
    dense call skips flash_attn_with_kvcache's checks (_kvcache.dense_decode: flash_attn_func's imply
    them); a paged one keeps them (its own checks saw stand-ins for the pages). Returns (out (B, Sq,
    Hq, Dv), lse (B, Hq, Sq) fp32)."""
    from ._layouts import pad_head_dims
    from ._validate import _last_dim_contiguous

    if page_table is None and seqlens is None:
        q, k, v, unpad = pad_head_dims(q, k, v, sink=sink)
        out, lse = _kvcache.dense_decode(q, k, v, scale, causal, left, right, softcap, sink)
        return unpad(out), lse
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    q, k, v, unpad = pad_head_dims(q, k, v, sink=sink)
    out, lse = _kvcache.with_kvcache(q, k, v, cache_seqlens=seqlens, block_table=page_table, softmax_scale=scale,
                                     causal=causal, window_size=(left, right), softcap=softcap,
                                     learnable_sink=sink, return_softmax_lse=True)
    return unpad(out), lse


def paged_tokens(q, cu_seqlens_q, max_seqlen_q, batch):
    """A paged varlen call's q as (B, Sq, Hq, D) when its shape says it is decode-shaped, else None: a
    padded q as it is; a packed q of `batch` tokens whose max_seqlen_q is 1 (each sequence then holds
    exactly one token, whatever cu_seqlens_q says) as (B, 1, Hq, D). No device values are read."""
    if cu_seqlens_q is None:
        return q if q.dim() == 4 else None
    if q.dim() == 3 and _size(max_seqlen_q) == 1 and _size(q.shape[0]) == _size(batch):
        return q.unsqueeze(1)
    return None


def packed_result(out, lse, packed: bool):
    """(out, lse) of `attend` in a varlen call's layout: unchanged for a padded q; for a packed q of one
    token a sequence, out (B, Hq, Dv) and lse (Hq, B)."""
    if not packed:
        return out, lse
    return out.squeeze(1), lse.squeeze(2).t().contiguous()


def paged_pair(q, k_pages, v_pages, page_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
               softmax_scale, causal, window_size, learnable_sink, softcap, deterministic, return_lse):
    """flash_attn_varlen_func(page_table=...) when decode-shaped (a few tokens a sequence, no gradient)
    on flash_attn_with_kvcache's split launch, after the call's own checks (fa4._paged.check_call);
    None where it is not one (shapes only; the caller takes the other routes). Returns (out, lse) in
    the varlen call's layouts."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k_pages, v_pages, page_table)) or page_table.dim() != 2 \
            or k_pages.dim() != 4:
        return None
    tokens = paged_tokens(q, cu_seqlens_q, max_seqlen_q, page_table.shape[0])
    span = page_table.shape[1] * k_pages.shape[1]
    if tokens is None or not takes(q, k_pages, v_pages, learnable_sink, tokens.shape[1], span, page_table.shape[0]):
        return None
    if not native_head_dims(q, v_pages):
        return None  # padding the head dims would copy the whole page pool: the gathering route pads the pages used
    _, _, used, _, scale, (left, right, causal, softcap, sink), _ = _paged.check_call(
        q, k_pages, v_pages, page_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
        softmax_scale, causal, window_size, learnable_sink, softcap, deterministic, return_lse)
    out, lse = attend(tokens, k_pages, v_pages, scale, causal, left, right, softcap, sink, seqlens=used,
                      page_table=page_table)
    return packed_result(out, lse, packed=tokens is not q)
