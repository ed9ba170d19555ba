"""Stage 0: attention in NumPy float64, the oracle every later stage is checked against.

Nothing clever happens here on purpose. The full score matrix S = Q K^T is materialized,
softmax is taken row by row, and the backward pass is the textbook chain rule. Every kernel
in this project, however fast, must agree with these few lines.

Conventions (shared by all stages, see docs/ARCHITECTURE.md):
  q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv)  ->  out (B, Sq, Hq, Dv)
  lse (B, Hq, Sq): natural-log log-sum-exp of the *scaled* scores, as FlashAttention returns.
  GQA/MQA: query head h reads kv head h // (Hq // Hkv).
  causal: query i sees key j iff j <= i + Sk - Sq (aligned to the bottom-right corner).
  A row that sees no key has out = 0 and lse = -inf (never NaN).
  window_size (left, right): query i sees key j iff i + off - left <= j <= i + off + right,
    off = Sk - Sq; None (or -1) is unlimited on that side; causal is right = 0.
  softcap > 0: scores s become softcap * tanh(s / softcap) before the mask and softmax.
  learnable_sink (Hq,): a per-head logit that joins every row's softmax denominator but has no
    value: lse = log(sum_j exp(s_ij) + exp(sink_h)); a row that sees no key has out 0, lse = sink.
  varlen: packed (total, H, D) with int32 cu_seqlens of length batch + 1.
"""
from __future__ import annotations

import math

import numpy as np

from .validation import (
    check_dense,
    check_learnable_sink,
    check_softcap,
    check_varlen,
    normalize_window,
)

__all__ = [
    "visible_mask",
    "attention_forward",
    "attention_backward",
    "attention_varlen_forward",
    "attention_varlen_backward",
    "default_softmax_scale",
]


def default_softmax_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


def visible_mask(seqlen_q: int, seqlen_k: int, causal: bool, window=(None, None)) -> np.ndarray:
    """(Sq, Sk) bool: True where query i may attend to key j (causal / window_size, bottom-right)."""
    left, right = normalize_window(window, causal)
    mask = np.ones((seqlen_q, seqlen_k), dtype=bool)
    i = np.arange(seqlen_q)[:, None]
    j = np.arange(seqlen_k)[None, :]
    off = seqlen_k - seqlen_q
    if right is not None:
        mask &= j <= i + off + right
    if left is not None:
        mask &= j >= i + off - left
    return mask


def _expand_kv(x: np.ndarray, heads_q: int) -> np.ndarray:
    """(B, S, Hkv, D) -> (B, S, Hq, D): each kv head serves a contiguous group of q heads."""
    return np.repeat(x, heads_q // x.shape[2], axis=2)


def _reduce_kv(dx: np.ndarray, heads_kv: int) -> np.ndarray:
    """(B, S, Hq, D) -> (B, S, Hkv, D): a kv head's gradient is the sum over its q group."""
    b, s, hq, d = dx.shape
    return dx.reshape(b, s, heads_kv, hq // heads_kv, d).sum(axis=3)


def _scores(q, kx, scale, softcap):
    """Scaled scores (B, H, Sq, Sk), capped to (-softcap, softcap) by tanh when softcap > 0."""
    s = np.einsum("bqhd,bkhd->bhqk", q, kx) * scale
    if softcap > 0:
        s = softcap * np.tanh(s / softcap)
    return s


def _probabilities(q, k, scale, causal, window=(None, None), softcap=0.0, sink=None):
    """P (B, Hq, Sq, Sk) and lse (B, Hq, Sq), float64, with masked entries exactly 0.

    With a sink, exp(sink_h) joins each row's denominator (it takes probability mass but adds no
    value), so P's rows sum to less than 1 and a row with no visible key has lse = sink_h.
    """
    kx = _expand_kv(k, q.shape[2])
    s = _scores(q, kx, scale, softcap)  # (B, H, Sq, Sk)
    mask = visible_mask(q.shape[1], k.shape[1], causal, window)  # (Sq, Sk)
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)  # (B, H, Sq, 1); -inf: nothing visible
    if sink is not None:
        m = np.maximum(m, sink[:, None, None])  # the sink is one more logit in the row max
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe)  # exp(-inf) = 0 on masked entries
    l = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        l = l + np.exp(sink[:, None, None] - m_safe)
    with np.errstate(divide="ignore"):
        lse = np.where(l > 0, m_safe + np.log(l), -np.inf)[..., 0]
    p = np.divide(e, l, out=np.zeros_like(e), where=l > 0)
    return p, lse


def _sink_share(sink, lse):
    """exp(sink - lse): the part of each row's softmax that went to the sink (0 where lse = -inf)."""
    finite = np.isfinite(lse)
    return np.where(finite, np.exp(sink - np.where(finite, lse, 0.0)), 0.0)


def _variant_args(heads_q, causal, window_size, softcap, learnable_sink):
    """Validated (window, softcap, sink) for one call; see stage0_reference.validation."""
    return (normalize_window(window_size, causal), check_softcap(softcap),
            check_learnable_sink(learnable_sink, heads_q))


def attention_forward(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                      learnable_sink=None):
    """softmax(Q K^T * scale) V in float64. Returns (out (B,Sq,Hq,Dv), lse (B,Hq,Sq))."""
    q, k, v = check_dense(q, k, v)
    window, softcap, sink = _variant_args(q.shape[2], causal, window_size, softcap, learnable_sink)
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    p, lse = _probabilities(q, k, scale, causal, window, softcap, sink)
    out = np.einsum("bhqk,bkhd->bqhd", p, _expand_kv(v, q.shape[2]))
    return out, lse


def attention_backward(q, k, v, out, dout, lse, *, softmax_scale=None, causal=False, window_size=(None, None),
                       softcap=0.0, learnable_sink=None, dlse=None):
    """Gradients of attention_forward's out w.r.t. q, k, v, given dout: (dq, dk, dv).

    out and lse are the forward's results (recomputing P from lse is what every
    FlashAttention backward does, so the oracle does it too). With learnable_sink the
    result is (dq, dk, dv, dsink), dsink (Hq,) summed over batch and rows.
    dlse (B, Hq, Sq): a gradient flowing in through lse too. d lse_i / d s_ij = P_ij, so it adds
    P * dlse to dS: D becomes D - dlse (rows with lse = -inf take none).
    """
    q, k, v = check_dense(q, k, v)
    window, softcap, sink = _variant_args(q.shape[2], causal, window_size, softcap, learnable_sink)
    out = np.asarray(out, dtype=np.float64)
    dout = np.asarray(dout, dtype=np.float64)
    lse = np.asarray(lse, dtype=np.float64)
    b, sq, hq, _ = q.shape
    dv_dim = v.shape[-1]
    for name, arr, shape in (("out", out, (b, sq, hq, dv_dim)), ("dout", dout, (b, sq, hq, dv_dim)),
                             ("lse", lse, (b, hq, sq))):
        if arr.shape != shape:
            raise ValueError(f"{name}: expected shape {shape}, got {arr.shape}")
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    heads_kv = k.shape[2]
    kx, vx = _expand_kv(k, hq), _expand_kv(v, hq)

    s = _scores(q, kx, scale, softcap)  # (B, H, Sq, Sk); lse already holds the sink
    mask = visible_mask(sq, k.shape[1], causal, window)
    lse_safe = np.where(np.isfinite(lse), lse, 0.0)[..., None]
    p = np.where(mask & np.isfinite(lse)[..., None], np.exp(s - lse_safe), 0.0)

    dv = np.einsum("bhqk,bqhd->bkhd", p, dout)  # dV = P^T dO
    dp = np.einsum("bqhd,bkhd->bhqk", dout, vx)  # dP = dO V^T
    delta = np.einsum("bqhd,bqhd->bhq", dout, out)[..., None]  # D = rowsum(dO * O)
    if dlse is not None:
        dlse = np.asarray(dlse, dtype=np.float64)
        if dlse.shape != lse.shape:
            raise ValueError(f"dlse: expected shape {lse.shape} like lse, got {dlse.shape}")
        delta = delta - np.where(np.isfinite(lse), dlse, 0.0)[..., None]
    ds = p * (dp - delta)  # dS = P * (dP - D): the softmax Jacobian, applied row by row
    if softcap > 0:
        ds = ds * (1.0 - (s / softcap) ** 2)  # d(c tanh(x / c))/dx = 1 - tanh^2, and tanh = s / c
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kx) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    grads = dq, _reduce_kv(dk, heads_kv), _reduce_kv(dv, heads_kv)
    if sink is None:
        return grads
    # the sink is a logit with value 0: dsink = P_sink * (0 - D) (D less dlse), summed over every row it joined
    dsink = -(_sink_share(sink[:, None], lse) * delta[..., 0]).sum(axis=(0, 2))
    return grads + (dsink,)


def _segments(cu_seqlens):
    return [(int(a), int(b)) for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, causal=False,
                             window_size=(None, None), softcap=0.0, learnable_sink=None):
    """Packed variable-length batch: q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv).

    Sequence i owns rows cu_seqlens_q[i]:cu_seqlens_q[i+1] of q (and likewise for k/v);
    zero-length sequences are allowed. Returns out (Tq, Hq, Dv) and lse (Hq, Tq).
    Masks (causal, window) are aligned per sequence.
    """
    q, k, v, cu_q, cu_k = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    window, softcap, sink = _variant_args(q.shape[1], causal, window_size, softcap, learnable_sink)
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out = np.zeros(q.shape[:2] + (v.shape[-1],))
    lse = np.full((q.shape[1], q.shape[0]), -np.inf)
    for (q0, q1), (k0, k1) in zip(_segments(cu_q), _segments(cu_k)):
        if q1 == q0:
            continue
        o, l = attention_forward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale=scale,
                                 causal=causal, window_size=window, softcap=softcap, learnable_sink=sink)
        out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None,
                              causal=False, window_size=(None, None), softcap=0.0, learnable_sink=None, dlse=None):
    """Backward of attention_varlen_forward: dq (Tq,Hq,D), dk (Tk,Hkv,D), dv (Tk,Hkv,Dv),
    and dsink (Hq,) summed over all tokens when learnable_sink is given; dlse (Hq, Tq) as
    attention_backward's."""
    q, k, v, cu_q, cu_k = check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    window, softcap, sink = _variant_args(q.shape[1], causal, window_size, softcap, learnable_sink)
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    out, dout, lse = (np.asarray(a, dtype=np.float64) for a in (out, dout, lse))
    dlse = None if dlse is None else np.asarray(dlse, dtype=np.float64)
    if dlse is not None and dlse.shape != lse.shape:
        raise ValueError(f"dlse: expected shape {lse.shape} like lse, got {dlse.shape}")
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for (q0, q1), (k0, k1) in zip(_segments(cu_q), _segments(cu_k)):
        if q1 == q0 or k1 == k0:
            continue  # no query or no key: every gradient of this sequence is zero
        # P comes from lse, which already holds the sink: dq/dk/dv need no sink argument
        g = attention_backward(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], out[None, q0:q1],
                               dout[None, q0:q1], lse[None, :, q0:q1], softmax_scale=scale, causal=causal,
                               window_size=window, softcap=softcap,
                               dlse=None if dlse is None else dlse[None, :, q0:q1])
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = (x[0] for x in g)
    if sink is None:
        return dq, dk, dv
    delta = np.einsum("thd,thd->ht", dout, out)  # (Hq, Tq): D_i = rowsum(dO_i * O_i)
    if dlse is not None:
        delta = delta - np.where(np.isfinite(lse), dlse, 0.0)
    dsink = -(_sink_share(sink[:, None], lse) * delta).sum(axis=1)
    return dq, dk, dv, dsink
