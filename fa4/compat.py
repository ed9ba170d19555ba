"""fa4 with the official FlashAttention-4 return convention: a drop-in for `flash_attn.cute`.

Code written for the official package works after changing only the import:

    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func   # before
    from fa4.compat import flash_attn_func, flash_attn_varlen_func        # after

    out, lse = flash_attn_func(q, k, v, causal=True)

The two return conventions:

* `fa4.flash_attn_func` / `fa4.flash_attn_varlen_func` (fa4's own): `out`, or `(out, lse)` with
  `return_lse=True` -- FlashAttention-2's habit, what a model's attention layer wants.
* `fa4.compat.flash_attn_func` / `flash_attn_varlen_func` (the official's, mirrored here): always
  the tuple `(out, lse)`. `lse` is a tensor when `return_lse=True`, and also when any of q, k, v,
  learnable_sink requires grad (the official returns the lse its backward saves; its gradient is
  ignored unless return_lse=True); otherwise `lse` is None.

Both run the same validation and op (fa4._api.attention_pair / varlen_attention_pair); only the
return differs. The keywords are the official ones that fa4 serves (see fa4/README.md, "The
official interface"): softmax_scale, causal, window_size, learnable_sink, softcap, num_splits,
pack_gqa, deterministic, return_lse, and for varlen cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, seqused_q, seqused_k, page_table. num_splits and pack_gqa are taken at their
no-op values only (a ValueError names any other). The official's qv, gather_kv_indices,
score_mod, mask_mod, aux_*, block_sparse_*, ... are not taken: passing one is
Python's unexpected-keyword TypeError, and so is a positional argument after v (the official's
4th positional argument is qv).
"""
from __future__ import annotations

from . import _api

_HINT = "flash_attn.cute's 4th positional argument is qv (MLA), which fa4 does not take"


def _official_lse(lse, return_lse, *tensors):
    """The official's rule (flash_attn.cute.interface._flash_attn_fwd): lse is allocated, and
    returned, when return_lse or when any input requires grad; None otherwise."""
    if return_lse or any(t is not None and t.requires_grad for t in tensors):
        return lse
    return None


@_api.keyword_only_after_qkv(_HINT)
def flash_attn_func(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), learnable_sink=None,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, return_lse=False):
    """fa4.flash_attn_func with the official return: always (out, lse), lse None unless
    return_lse=True or an input requires grad. q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv)
    -> out (B, Sq, Hq, Dv), lse (B, Hq, Sq) fp32."""
    out, lse = _api.attention_pair(q, k, v, softmax_scale, causal, window_size, learnable_sink, softcap,
                                   num_splits, pack_gqa, deterministic, return_lse)
    return out, _official_lse(lse, return_lse, q, k, v, learnable_sink)


@_api.keyword_only_after_qkv(_HINT)
def flash_attn_varlen_func(q, k, v, *, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None, max_seqlen_k=None,
                           seqused_q=None, seqused_k=None, page_table=None, softmax_scale=None, causal=False,
                           window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                           deterministic=False, return_lse=False):
    """fa4.flash_attn_varlen_func with the official return: always (out, lse), lse as in
    flash_attn_func. Layouts as fa4.flash_attn_varlen_func: each side packed (with its cu_seqlens)
    or padded (cu_seqlens None), k / v paged with page_table; out and lse in q's layout
    ((total_q, Hq, Dv) and (Hq, total_q), or (B, Sq, Hq, Dv) and (B, Hq, Sq)). max_seqlen_* of a
    packed side default to its token total, as in the official (no host sync)."""
    out, lse = _api.varlen_attention_pair(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          seqused_q, seqused_k, softmax_scale, causal, window_size, learnable_sink,
                                          softcap, num_splits, pack_gqa, deterministic, return_lse,
                                          page_table=page_table)
    return out, _official_lse(lse, return_lse, q, k, v, learnable_sink)
