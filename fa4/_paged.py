"""A paged KV cache read in place: flash_attn_varlen_func(page_table=...) without the page gather.

A cache (num_pages, page_size, Hkv, D) with page_table (batch, pages per sequence) int32 reaches the
Hopper varlen forward as it is: the kernel's producer looks up the page of every key block it loads
(stage3_fwd_kernel.components.paged_kv), so no dense copy of the keys is made per call. Any page
size: multiples of the forward's key tile (128 rows; 64 at head dim 256) and its divisors of 16
rows or more are read by TMA boxes, the others (1 to 8 rows, 24, 160, ...) row by row with cp.async
(stage3_fwd_kernel.hopper.gather), which pays off for short queries only
(fa4._dispatch.GATHER_MAX_QUERY_ROWS). Pages of 16 keys are 8 TMA boxes a key block, slower than a
dense copy once many query rows attend each key (fa4._dispatch.SMALL_PAGE_COPY_HEAD_ROWS,
`head_rows`). The Blackwell varlen forward reads pages of 16, 32, 64 (not at head dims (192, 128))
or a multiple of 128 keys in place the same way, by TMA boxes, with the same rule for pages of 16;
it has no cp.async gather (compiled for sm_100a, never run). A forward only: the backward reads dense
K / V.

Every other paged call -- inputs that need a gradient, seqused_q, head-dim pairs that run padded,
an arch without the paged forward, long queries over pages TMA cannot read or over pages of 16 --
keeps the gather (fa4._layouts.VarlenLayout.unpage): a copy of each sequence's pages, then the
dense varlen call. `in_place` makes that choice.
"""
from __future__ import annotations

import torch


def in_place(q, k_pages, v_pages, tokens=None, *, keys=None, span=None, causal=False, window=(None, None),
             packed=False) -> bool:
    """Whether this paged call can be read in place (see the module docstring). tokens: the longest
    sequence's query rows (None: unknown); keys: its keys where the call says (max_seqlen_k), else
    None; span: the keys a dense copy would hold per sequence (pages per sequence x page size);
    causal / window as the call gives them (unchecked: a form the checks refuse counts as no
    window); packed: the kernel holds a GQA group's heads as rows of one tile (flash_attn_with_kvcache's
    decode), so its rows are tokens x group. Only shapes are read: no device values."""
    from . import _dispatch

    if not all(isinstance(t, torch.Tensor) for t in (q, k_pages, v_pages)) or q.device.type != "cuda" \
            or k_pages.dim() != 4:
        return False
    backend = _dispatch.backend_for(q.device)
    d, dv = q.shape[-1], v_pages.shape[-1]
    # int(): a symbolic size under torch.compile's dynamic shapes is guarded to its value; a length
    # that is not an int (a tensor, say) counts as unknown, so no device value is read
    tokens, keys, span = (int(n) if isinstance(n, (int, torch.SymInt)) and not isinstance(n, bool) else None
                          for n in (tokens, keys, span))
    group = max(1, int(q.shape[-2]) // max(1, int(k_pages.shape[-2])))
    rows = None if tokens is None else tokens * (group if packed else 1)
    per_key = None if tokens is None else head_rows(tokens, keys, group, causal, window, span)
    return (d, dv) in backend.arch.head_dims and backend.paged_in_place(int(d), int(dv), int(k_pages.shape[1]), rows,
                                                                        per_key)


def _edge(e):
    """A window edge as a count of keys, or None: unlimited (None, -1, or any form the checks refuse)."""
    return int(e) if isinstance(e, (int, torch.SymInt)) and not isinstance(e, bool) and e >= 0 else None


def head_rows(tokens: int, keys, group: int, causal: bool, window=(None, None), span=None) -> float:
    """Query-head rows per KV head that attend an average key of the copy: the attention's work per key
    that a dense copy of the pages would move (a cost per key and KV head), which that copy is weighed
    against. The queries sit at the end of the keys (bottom-right, as fa4's causal mask and window); a
    window bounds the pairs from above. keys None (not known from the shapes): the queries' own count,
    the fewest a prefill has, so an unknown length leans to reading in place. span: the copy's keys per
    sequence (the page table's width; None: the keys); it bounds the keys."""
    keys = tokens if keys is None else keys
    span = keys if span is None else span
    keys = min(keys, span)
    if keys <= 0 or tokens <= 0 or span <= 0:
        return 0.0
    pairs = tokens * keys                                       # (query row, key) pairs attended
    if causal:   # row i sees keys up to keys - tokens + i; rows past the keys' start see none
        seen = min(tokens, keys)
        pairs = seen * (seen + 1) // 2 + seen * (keys - seen)
    left, right = (_edge(e) for e in window) if isinstance(window, (tuple, list)) and len(window) == 2 \
        else (None, None)
    if left is not None:
        reach = left + 1 + (0 if causal else (keys if right is None else right))
        pairs = min(pairs, tokens * min(reach, keys))
    return group * pairs / span


def needs_grad(*tensors) -> bool:
    # not-a-tensor values pass here: the argument checks after this name them (TypeError)
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def check_call(q, k_pages, v_pages, page_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
               softmax_scale, causal, window_size, learnable_sink, softcap, deterministic, return_lse, seqused_q=None):
    """flash_attn_varlen_func's checks of a paged call, run on zero-stride (batch, pages * page_size)
    stand-ins for the gathered keys (shapes only, no copy; max_seqlen_k is checked there, the kernel
    taking the table's span). Returns (q packed, cu_q, used (B,) int32 or None: every key of the
    pages, max_q, scale, (left, right, causal, softcap, sink), padded_q). seqused_q: checked only (the
    routes that read pages in place take none; the gathered copy's route checks with it before copying)."""
    from ._validate import check_page_table, check_variants, check_varlen, check_varlen_sides

    check_page_table(q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k, page_table, seqused_k)
    batch, pages = page_table.shape
    max_k = pages * k_pages.shape[1]
    k_shape, v_shape = (t.as_strided((batch, max_k) + tuple(t.shape[2:]), (0, 0) + tuple(t.stride()[2:]))
                        for t in (k_pages, v_pages))
    q, k_flat, v_flat, cu_q, cu_k, max_q, given_k, padded_q, _ = check_varlen_sides(
        q, k_shape, v_shape, cu_seqlens_q, None, max_seqlen_q, max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k)
    q, _, _, cu_q, _, used, max_q, _, scale = check_varlen(q, k_flat, v_flat, cu_q, cu_k, max_q, given_k, softmax_scale,
                                                           causal, deterministic, return_lse, seqused_k, seqused_q)
    variants = check_variants(q, causal, window_size, softcap, learnable_sink)
    return q, cu_q, used, max_q, scale, variants, padded_q


def varlen_pair(q, k_pages, v_pages, page_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                softmax_scale, causal, window_size, learnable_sink, softcap, deterministic, return_lse):
    """flash_attn_varlen_func over a paged cache read in place (the caller checked `in_place`; the
    checks are `check_call`'s). A learnable sink joins each row's denominator after the kernel
    (fa4._lse_merge.add_sink).
    Returns (out (total, Hq, Dv) or (B, Sq, Hq, Dv) for a padded q, lse (Hq, total) / (B, Hq, Sq))."""
    from . import _ops
    from ._layouts import restore_padded_q
    from ._lse_merge import add_sink

    q, cu_q, used, max_q, scale, (left, right, causal, softcap, sink), padded_q = check_call(
        q, k_pages, v_pages, page_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
        softmax_scale, causal, window_size, learnable_sink, softcap, deterministic, return_lse)
    batch, pages = page_table.shape
    max_k = pages * k_pages.shape[1]
    if used is None:
        used = torch.full((batch,), max_k, dtype=torch.int32, device=q.device)
    first_keys = torch.zeros_like(cu_q)                                                 # (batch + 1,)
    out, lse = _ops.paged_varlen_attention(q, k_pages, v_pages, page_table, cu_q, first_keys, used, max_q, max_k,
                                           scale, causal, (left, right), softcap)
    if sink is not None:
        out, lse_t = add_sink(out, lse.t(), sink)                                       # lse as (total, Hq)
        out, lse = out.to(q.dtype), lse_t.t().contiguous()
    return restore_padded_q(out, lse, padded_q)
