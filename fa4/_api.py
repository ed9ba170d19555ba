"""The public attention functions: the official FlashAttention-4 interface's keyword names and
defaults (flash_attn.cute.interface; everything after q, k, v keyword-only), validation first,
then one custom op (fa4._ops) per call -- or, in eager mode on plain CUDA tensors, the same
implementation without the op's dispatcher round trip (fa4._ops.eager_ok).

Two return conventions: fa4.flash_attn_func / flash_attn_varlen_func return out, or (out, lse)
with return_lse=True; fa4.compat's functions return the official's (out, lse) tuple always. Both
run attention_pair / varlen_attention_pair below (one validation, one op).

Conventions (the project's, see docs/ARCHITECTURE.md): tensors are (batch, seqlen, heads, head_dim);
varlen packs them as (total_tokens, heads, head_dim) with int32 cu_seqlens; GQA/MQA when
heads_q % heads_kv == 0; causal masks are aligned to the bottom-right corner when
seqlen_q != seqlen_k (row i sees keys j <= i + seqlen_k - seqlen_q: the last query is the last
token, which is what decoding with a KV cache needs); a row with no visible key has output 0 and
lse -inf; lse is the natural-log logsumexp of the *scaled* scores.
"""
from __future__ import annotations

import functools

import torch

from . import _decode_route, _kvcache, _ops, _paged  # _kvcache registers fa4::kvcache_attention
from ._layouts import VarlenLayout, pad_head_dims, refuse_pair_without_backward
from ._validate import (check_fixed, check_grid, check_unservable, check_variants, check_varlen, check_varlen_arch,
                        check_varlen_sides)

# What a positional argument after q, k, v meant elsewhere, for the keyword-only TypeError.
_FIXED_HINT = ("FlashAttention-2's 4th positional argument is dropout_p (then softmax_scale, causal), and earlier "
               "fa4 took softmax_scale there")
_VARLEN_HINT = ("FlashAttention-2 and earlier fa4 took cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k there, "
                "and FlashAttention-2's 8th positional argument is dropout_p")


def keyword_only_after_qkv(hint: str):
    """Decorate a function `f(q, k, v, *, ...)` so that an extra positional argument raises a
    TypeError that says what happened (FlashAttention-2 code passes dropout_p, fa4's old varlen code
    cu_seqlens, positionally) instead of Python's generic "takes 3 positional arguments".
    inspect.signature and help() still show f's own signature (functools.wraps)."""
    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(q, k, v, *args, **kwargs):
            if args:
                raise TypeError(f"{fn.__name__}: the arguments after q, k, v are keyword-only, as in "
                                f"flash_attn.cute; got {len(args)} more positional argument(s). {hint}: "
                                "pass every argument after v by name")
            return fn(q, k, v, **kwargs)
        return wrapper
    return decorate


def attention_pair(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None,
                   softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, return_lse=False, dropout_p=0.0):
    """flash_attn_func's work: validate, then one op. Returns (out, lse) whatever return_lse says
    (the forward computes lse anyway; with return_lse=False its gradient is ignored, as in the
    official interface). The public function and fa4.compat differ only in what they return."""
    check_unservable(num_splits, pack_gqa, dropout_p)
    q, k, v, scale = check_fixed(q, k, v, softmax_scale, causal, deterministic, return_lse)
    left, right, causal, softcap, sink = check_variants(q, causal, window_size, softcap, learnable_sink)
    if _decode_route.takes(q, k, v, sink, q.shape[1], k.shape[1], q.shape[0]):  # decode-shaped, no gradient
        return _decode_route.attend(q, k, v, scale, causal, left, right, softcap, sink)
    q, k, v, unpad = pad_head_dims(q, k, v, sink=sink)
    out, lse = _ops.attention(q, k, v, scale, causal, deterministic, return_lse, (left, right), softcap, sink)
    return unpad(out), lse


def _query_rows(q, max_seqlen_q):
    """The longest sequence's query rows as far as the shapes tell: a padded q's seqlen, else
    max_seqlen_q, else every packed row (no device values are read)."""
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        return q.shape[1]
    if max_seqlen_q is not None:
        return max_seqlen_q
    return q.shape[0] if isinstance(q, torch.Tensor) else None


def _paged_span(k_pages, page_table):
    """The keys a dense copy of a paged call holds per sequence (the table's width x page size), or
    None where the shapes do not tell (the checks then refuse the call)."""
    if isinstance(page_table, torch.Tensor) and page_table.dim() == 2 and isinstance(k_pages, torch.Tensor) \
            and k_pages.dim() == 4:
        return page_table.shape[1] * k_pages.shape[1]
    return None


def varlen_attention_pair(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                          seqused_q=None, seqused_k=None, softmax_scale=None, causal=False, window_size=(None, None),
                          learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False,
                          return_lse=False, dropout_p=0.0, page_table=None):
    """flash_attn_varlen_func's work; returns (out, lse) like attention_pair."""
    check_unservable(num_splits, pack_gqa, dropout_p)
    check_varlen_arch(q, seqused_k)
    if page_table is not None and seqused_q is None:
        routed = _decode_route.paged_pair(q, k, v, page_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, seqused_k, softmax_scale, causal, window_size,
                                          learnable_sink, softcap, deterministic, return_lse)
        if routed is not None:  # a decode-shaped call with no gradient: the split launch
            return routed
    if page_table is not None and seqused_q is None and not _paged.needs_grad(q, k, v, learnable_sink) and \
            _paged.in_place(q, k, v, _query_rows(q, max_seqlen_q), keys=max_seqlen_k, span=_paged_span(k, page_table),
                            causal=causal, window=window_size):
        return _paged.varlen_pair(q, k, v, page_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                  seqused_k, softmax_scale, causal, window_size, learnable_sink, softcap, deterministic,
                                  return_lse)
    if page_table is not None:  # every check, on stand-ins of the gathered keys, before the pages are copied
        _paged.check_call(q, k, v, page_table, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k,
                          softmax_scale, causal, window_size, learnable_sink, softcap, deterministic, return_lse,
                          seqused_q)
    q, k, v, cu_q, cu_k, max_q, max_k, padded_q, seqlen_k = check_varlen_sides(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                                     max_seqlen_q, max_seqlen_k, page_table,
                                                                     seqused_q, seqused_k, learnable_sink)
    q, k, v, cu_q, cu_k, used, max_q, max_k, scale = check_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, deterministic, return_lse, seqused_k, seqused_q)
    left, right, causal, softcap, sink = check_variants(q, causal, window_size, softcap, learnable_sink)
    # seqused_q runs each sequence's unused rows as a sequence of their own (fa4._layouts.split_unused_rows)
    split_rows = seqused_q is not None
    check_grid("q" if padded_q is not None else "cu_seqlens_q", (cu_q.shape[0] - 1) * (2 if split_rows else 1),
               q.shape[1], "sequences x 2 (seqused_q)" if split_rows else "sequences")
    if padded_q is not None and seqlen_k is not None and seqused_q is None and \
            _decode_route.takes(q, k, v, sink, padded_q[1], seqlen_k, padded_q[0]):  # both sides padded: a cache
        return _decode_route.attend(q.unflatten(0, padded_q), k.unflatten(0, (padded_q[0], seqlen_k)),
                                    v.unflatten(0, (padded_q[0], seqlen_k)), scale, causal, left, right, softcap, sink,
                                    seqlens=used)
    q, k, v, unpad = pad_head_dims(q, k, v, sink=sink)
    lay = VarlenLayout.of(q, k, v, cu_q, cu_k, seqused_q, used, max_q, max_k, padded_q, sink, seqlen_k)
    out, lse = _ops.varlen_attention(lay.q, lay.k, lay.v, lay.cu_q, lay.cu_k, lay.seqused_k, lay.max_q, lay.max_k,
                                     scale, causal, deterministic, return_lse, (left, right), softcap,
                                     lay.kernel_sink(sink))
    return lay.restore(unpad(out), lse)


@keyword_only_after_qkv(_FIXED_HINT)
def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, return_lse=False, dropout_p=0.0):
    """Attention on (batch, seqlen, heads, head_dim) tensors.

    q: (B, Sq, Hq, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv); fp16 or bf16, CUDA.
    Everything after q, k, v is keyword-only, with the names and defaults of the official
    flash_attn.cute.interface.flash_attn_func (a positional one raises a TypeError).
    softmax_scale: default 1/sqrt(D). causal: bottom-right aligned. deterministic: the backward
    accumulates dq in a fixed order (bitwise reproducible, a little slower).
    Returns out (B, Sq, Hq, Dv), or (out, lse) with lse (B, Hq, Sq) fp32 if return_lse. Both are
    differentiable (the lse gradient enters the backward as a D-term correction, D - dlse, which the
    backward's preprocess stores; see stage4_bwd_kernel/preprocess.py). fa4.compat.flash_attn_func returns the
    official's (out, lse) tuple instead.

    Variants (sm_90; passed to the sm_100 kernels too, which are compiled but never run here):
      window_size=(left, right): sliding window. Row i sees key j iff
        i + off - left <= j <= i + off + right, off = seqlen_k - seqlen_q (bottom-right, like
        causal); None or -1 (FlashAttention-2's spelling) = unlimited on that side. causal=True
        is right = 0 (so right must be None, -1 or 0); a non-causal right of 0 is causal.
      softcap: > 0 caps the scaled scores as softcap * tanh(s / softcap) (0: off).
      learnable_sink: (Hq,) float32 or q's dtype, on q's device: one logit per query head that
        joins each row's softmax denominator (gpt-oss attention sinks); lse includes it, and it
        receives a gradient.

    Head dims: qk and v any multiples of 8 up to 256. The pairs with kernels of their own
    (fa4.supported()["archs"][...]["head_dims"]) run as they are; any other pair runs on the
    cheapest native pair that covers it, zero-padded (a copy of the padded inputs and of out; see
    fa4/_layouts.py). softmax_scale's default is 1/sqrt(D) of the caller's D either way.

    Decode: a call of at most fa4._dispatch.DECODE_ROUTE_MAX_QUERY (64) query tokens that needs no
    gradient runs on sm_90 as flash_attn_with_kvcache over k / v (split-KV, GQA heads packed;
    fa4/_decode_route.py): the same attention, not the same bits as the forward a training call runs.

    Taken at their no-op values only (anything else is a ValueError naming it): num_splits 1, or
    <= 0 (the official's automatic choice; fa4 splits keys itself where that pays -- the split tail, and
    flash_attn_with_kvcache, which takes num_splits); pack_gqa None (fa4 picks its
    GQA layout itself); dropout_p 0.0 (FlashAttention-2's keyword).
    """
    out, lse = attention_pair(q, k, v, softmax_scale, causal, window_size, learnable_sink, softcap, num_splits,
                              pack_gqa, deterministic, return_lse, dropout_p)
    return (out, lse) if return_lse else out


@keyword_only_after_qkv(_VARLEN_HINT)
def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, return_lse=False, dropout_p=0.0):
    """Attention on variable-length batches, packed or padded.

    Each side is packed -- q (total_q, Hq, D) with cu_seqlens_q; k (total_k, Hkv, D) and v
    (total_k, Hkv, Dv) with cu_seqlens_k -- or padded -- q (B, Sq, Hq, D) with cu_seqlens_q=None;
    k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) with cu_seqlens_k=None -- in any of the four
    combinations, as in flash_attn.cute. Everything after q, k, v is keyword-only. Packed sequence
    b owns rows cu_seqlens[b]:cu_seqlens[b+1] (int32, length batch + 1, starting at 0,
    non-decreasing, ending at the total); padded sequence b is row b.
    seqused_q / seqused_k (int32, length batch): use only the first seqused_*[b] query rows / keys
    of sequence b (causal and window masks align to those lengths). Query rows past seqused_q[b]
    get out 0 and lse -inf (with or without a learnable sink) and no gradient.
    page_table (int32, (batch, pages per sequence)), as in the official: k / v are a paged cache
    (num_pages, page_size, Hkv, D / Dv), cu_seqlens_k is None, and sequence b's keys are pages
    page_table[b, 0], page_table[b, 1], ... (seqused_k[b] keys, default all). On sm_90, with a page
    size that is a multiple of the forward's key tile (128; 64 at head dim 256) or divides it and is
    a multiple of 16, a native head-dim pair, no seqused_q and nothing that needs a gradient, the
    kernel reads the pages in place (fa4/_paged.py) -- pages of 16 at the 128-key tile only below
    fa4._dispatch.SMALL_PAGE_COPY_HEAD_ROWS query-head rows attending a key per KV head (from the
    query rows as max_seqlen_q or a padded q tells, else every packed row; the keys as max_seqlen_k
    tells, else the queries' own; over the keys a copy would hold, the table's width x page size;
    causal, window), other sizes it can read up to 256 query rows; on sm_100 (compiled, never run)
    pages of 16, 32, 64 (not at head dims (192, 128)) or a multiple of 128 keys are read in place;
    otherwise fa4 gathers them into a padded copy first (a copy per call;
    fa4/_layouts.VarlenLayout.unpage). Decode (no gradient wanted, sm_90): with page_table and q padded
    (at most 64 tokens) or packed one token a sequence (max_seqlen_q=1, total_q = batch), or with q and
    k / v both padded, the call runs as flash_attn_with_kvcache (split-KV; fa4/_decode_route.py).
    max_seqlen_* are upper bounds of the per-sequence lengths (a static bound is fine, e.g. for
    CUDA graphs); None means a padded side's seqlen, or, as in the official, a packed side's token
    total: no host sync, but the grid is sized from the bound, so a batch of many short sequences
    launches many CTAs that exit at once -- pass the real bounds when you know them.
    Returns out, or (out, lse) with return_lse: out (total_q, Hq, Dv) and lse (Hq, total_q) fp32
    for a packed q; out (B, Sq, Hq, Dv) and lse (B, Hq, Sq) for a padded q.
    cu_seqlens / seqused values are checked only with FA4_VALIDATE=1 (the check synchronises; see
    fa4/_validate.py). Head dims, the variants (window_size: per sequence, bottom-right in each)
    and the no-op-only keywords (num_splits, pack_gqa, dropout_p) are those of flash_attn_func.
    """
    out, lse = varlen_attention_pair(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                     seqused_k, softmax_scale, causal, window_size, learnable_sink, softcap,
                                     num_splits, pack_gqa, deterministic, return_lse, dropout_p, page_table)
    return (out, lse) if return_lse else out


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """A drop-in for the common case of torch.nn.functional.scaled_dot_product_attention.

    Takes SDPA's (batch, heads, seqlen, head_dim) layout and returns (B, Hq, Sq, Dv).

    Semantics follow SDPA, not FlashAttention, so that swapping the function never changes a
    model's output:
      * is_causal is TOP-LEFT aligned, like SDPA (row i sees keys j <= i), also when Sq != Sk.
        FlashAttention's causal is bottom-right; the two agree only when Sq == Sk. Top-left is
        computed exactly with the bottom-right kernel: for Sq < Sk no query sees a key beyond
        Sq - 1, so it is causal attention on the first Sq keys; for Sq > Sk the first Sk rows are a
        square causal problem and the remaining rows see every key (a non-causal call).
      * GQA (fewer key/value heads) needs enable_gqa=True, as in SDPA.
      * attn_mask and dropout_p are refused (ValueError) rather than ignored.
    """
    if attn_mask is not None:
        raise ValueError("attn_mask: fa4 does not support explicit attention masks; use is_causal=True, or "
                         "fa4.flash_attn_varlen_func for padded batches")
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or dropout_p != 0.0:
        raise ValueError(f"dropout_p: fa4 does not support attention dropout (got {dropout_p!r}); pass 0.0")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal: expected a bool, got {type(is_causal).__name__}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa: expected a bool, got {type(enable_gqa).__name__}")
    names = ("query", "key", "value")
    for n, t in zip(names, (query, key, value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{n}: expected rank 4 (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"enable_gqa: query has {query.shape[1]} heads and key {key.shape[1]}; pass "
                         "enable_gqa=True for grouped-query attention (as torch SDPA requires)")
    # (B, H, S, D) -> (B, S, H, D): a view; the last dim keeps stride 1, so no copy
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    q, k, v, sm_scale = check_fixed(q, k, v, scale, is_causal, names=names, scale_name="scale")
    refuse_pair_without_backward(q, k, v, names=names)  # refusals name query / key / value, not fa4's q
    sq, sk = q.shape[1], k.shape[1]
    if not is_causal or sq == sk:
        out = flash_attn_func(q, k, v, softmax_scale=sm_scale, causal=is_causal)
    elif sq < sk:
        out = flash_attn_func(q, k[:, :sq], v[:, :sq], softmax_scale=sm_scale, causal=True)
    else:
        head = flash_attn_func(q[:, :sk], k, v, softmax_scale=sm_scale, causal=True)
        tail = flash_attn_func(q[:, sk:], k, v, softmax_scale=sm_scale, causal=False)
        out = torch.cat([head, tail], dim=1)
    return out.transpose(1, 2)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None,
                            cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                            softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                            learnable_sink=None, rotary_interleaved=True, num_splits=0, pack_gqa=None,
                            return_softmax_lse=False):
    """Attention against a KV cache, FlashAttention-2's flash_attn_with_kvcache (forward only).

    q (B, Sq, Hq, D). k_cache / v_cache: dense (B_cache, S_cache, Hkv, D / Dv), or paged
    (num_pages, page_size, Hkv, D / Dv) with block_table (B, pages per sequence) int32.
    cache_seqlens (int or (B,) int32): keys already in each sequence's cache (default: all of it; with k / v, all
        but the last k.shape[1] rows, where the new keys go -- FlashAttention-2 requires cache_seqlens then).
    k, v (B, Sn, Hkv, *): new tokens, written into the cache in place at cache_seqlens[b], then
    attended to. rotary_cos / rotary_sin (seqlen_ro, rotary_dim / 2): rotary embedding of q and the
    new k (needs k, v): k at positions cache_seqlens + i; q the same when causal or windowed, else
    all of q at cache_seqlens (FlashAttention-2's rule); seqlen_ro >= the cache's rows, and past q's
    last position when q has more tokens than k (ValueError); rotary_interleaved pairs dims (0, 1), ...
    instead of (i, i + rotary_dim / 2). cache_batch_idx (B,): which cache row each sequence uses.
    cache_leftpad (B,) int32 (a dense cache): sequence b's keys start at row cache_leftpad[b] (a
    left-padded batch): it attends to rows [cache_leftpad[b], cache_seqlens[b] + Sn); the new keys are
    still written at cache_seqlens[b] and rotary positions stay row indices (FlashAttention-2's rules).
    Its values, like cache_seqlens' and cache_batch_idx's, are read only under FA4_VALIDATE=1 (0 <=
    cache_leftpad[b] <= cache_seqlens[b]); a value outside that reads rows outside the sequence.
    causal / window_size / softcap / learnable_sink / softmax_scale as in flash_attn_func (causal
    bottom-right: the last query is the last key). Head dims: the kernels' native pairs only (the cache is
    read in place; flash_attn_func pads the others). num_splits: split-KV count, 0 or less = choose from
    (batch, heads, cache length, SM count); used where the mask allows (fa4/_kvcache.py). pack_gqa:
    None = pack a GQA group's query heads into one tile where the mask allows, False = never.
    Returns out (B, Sq, Hq, Dv), or (out, lse (B, Hq, Sq) fp32) with return_softmax_lse (a row with
    no key: out 0, lse -inf, where FlashAttention-2 writes +inf; with a learnable sink, its logit). No
    host sync: works under
    CUDA-graph capture (FA4_VALIDATE=1 adds a synchronising range check of cache_seqlens). A tensor
    that requires grad is refused.
    """
    return _kvcache.with_kvcache(q, k_cache, v_cache, k, v, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                 cache_seqlens=cache_seqlens, cache_batch_idx=cache_batch_idx,
                                 cache_leftpad=cache_leftpad, block_table=block_table, softmax_scale=softmax_scale,
                                 causal=causal, window_size=window_size, softcap=softcap, learnable_sink=learnable_sink,
                                 rotary_interleaved=rotary_interleaved, num_splits=num_splits, pack_gqa=pack_gqa,
                                 return_softmax_lse=return_softmax_lse)
