"""The public attention functions: FlashAttention-compatible signatures, validation first,
then one custom op (fa4._ops) per call -- or, in eager mode on plain CUDA tensors, the same
implementation without the op's dispatcher round trip (fa4._ops.eager_ok).

Conventions (the project's, see docs/ARCHITECTURE.md): tensors are (batch, seqlen, heads, head_dim);
varlen packs them as (total_tokens, heads, head_dim) with int32 cu_seqlens; GQA/MQA when
heads_q % heads_kv == 0; causal masks are aligned to the bottom-right corner when
seqlen_q != seqlen_k (row i sees keys j <= i + seqlen_k - seqlen_q: the last query is the last
token, which is what decoding with a KV cache needs); a row with no visible key has output 0 and
lse -inf; lse is the natural-log logsumexp of the *scaled* scores.
"""
from __future__ import annotations

import torch

from . import _ops
from ._validate import check_fixed, check_variants, check_varlen


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, deterministic=False, return_lse=False, *,
                    window_size=(None, None), softcap=0.0, learnable_sink=None):
    """Attention on (batch, seqlen, heads, head_dim) tensors.

    q: (B, Sq, Hq, D); k: (B, Sk, Hkv, D); v: (B, Sk, Hkv, Dv); fp16 or bf16, CUDA.
    softmax_scale: default 1/sqrt(D). causal: bottom-right aligned. deterministic: the backward
    accumulates dq in a fixed order (bitwise reproducible, a little slower).
    Returns out (B, Sq, Hq, Dv), or (out, lse) with lse (B, Hq, Sq) fp32 if return_lse. Both are
    differentiable (the lse gradient enters the backward as a D-term correction; see
    fa4._dispatch.add_lse_grad for the derivation).

    Variants (keyword-only, as in flash_attn.cute.interface; sm_90 only, Blackwell refuses them):
      window_size=(left, right): sliding window. Row i sees key j iff
        i + off - left <= j <= i + off + right, off = seqlen_k - seqlen_q (bottom-right, like
        causal); None or -1 (FlashAttention-2's spelling) = unlimited on that side. causal=True
        is right = 0 (so right must be None, -1 or 0); a non-causal right of 0 is causal.
      softcap: > 0 caps the scaled scores as softcap * tanh(s / softcap) (0: off).
      learnable_sink: (Hq,) float32 or q's dtype, on q's device: one logit per query head that
        joins each row's softmax denominator (gpt-oss attention sinks); lse includes it, and it
        receives a gradient.
    """
    q, k, v, scale = check_fixed(q, k, v, softmax_scale, causal, deterministic, return_lse)
    left, right, causal, softcap, sink = check_variants(q, causal, window_size, softcap, learnable_sink)
    out, lse = _ops.attention(q, k, v, scale, causal, deterministic, return_lse, (left, right), softcap, sink)
    return (out, lse) if return_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                           causal=False, deterministic=False, return_lse=False, seqused_k=None, *,
                           window_size=(None, None), softcap=0.0, learnable_sink=None):
    """Attention on packed variable-length batches.

    q: (total_q, Hq, D); k: (total_k, Hkv, D); v: (total_k, Hkv, Dv). Sequence b owns rows
    cu_seqlens_q[b]:cu_seqlens_q[b+1] of q and cu_seqlens_k[b]:cu_seqlens_k[b+1] of k/v
    (int32, length batch + 1, starting at 0, non-decreasing, ending at the total). max_seqlen_*
    are upper bounds of the per-sequence lengths (a static bound is fine, e.g. for CUDA graphs).
    seqused_k (int32, length batch): use only the first seqused_k[b] keys of sequence b.
    Returns out (total_q, Hq, Dv), or (out, lse) with lse (Hq, total_q) fp32 if return_lse.
    cu_seqlens values are checked only with FA4_VALIDATE=1 (the check synchronises; see
    fa4/_validate.py). The variants (window_size: per sequence, bottom-right in each) are those
    of flash_attn_func.
    """
    q, k, v, cu_q, cu_k, used, scale = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                    softmax_scale, causal, deterministic, return_lse, seqused_k)
    left, right, causal, softcap, sink = check_variants(q, causal, window_size, softcap, learnable_sink)
    out, lse = _ops.varlen_attention(q, k, v, cu_q, cu_k, used, max_seqlen_q, max_seqlen_k, scale, causal,
                                     deterministic, return_lse, (left, right), softcap, sink)
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
