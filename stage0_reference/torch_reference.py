"""The stage 0 oracle in PyTorch, and FA4's tolerance rule for GPU tests.

GPU kernels are judged the way the official FlashAttention judges itself: against an fp32
reference, a kernel may be at most twice as wrong as a plain PyTorch implementation run in
the input precision (bf16/fp16), plus a tiny absolute term. The rule scales itself to the
problem, so no test carries a hand-picked tolerance.

The math is the same as `reference.py` (tested against it on CPU); this copy exists because
GPU tests need the reference on the GPU, in fp32 and in low precision.
"""
from __future__ import annotations

import math

import torch

from .validation import check_softcap, normalize_window

__all__ = ["attention_ref", "attention_varlen_ref", "assert_fa4_close", "fa4_error_bound", "grad_atol", "visible_mask"]


def visible_mask(sq, sk, window, device):
    """(Sq, Sk) bool mask from a normalized (left, right) window, bottom-right aligned."""
    left, right = window
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if right is not None:
        mask &= j <= i + (sk - sq) + right
    if left is not None:
        mask &= j >= i + (sk - sq) - left
    return mask


def _check_sink(learnable_sink, heads_q, device):
    if learnable_sink is None:
        return None
    sink = torch.as_tensor(learnable_sink, device=device)  # a tensor keeps its autograd graph
    if sink.shape != (heads_q,):
        raise ValueError(f"learnable_sink: expected shape ({heads_q},) (one logit per query head), "
                         f"got {tuple(sink.shape)}")
    return sink


def _softmax_with_sink(s, sink):
    """Softmax over [s_row, sink_h] in fp32 (or float64), the sink's column dropped: P and lse."""
    s_hi = s.double() if s.dtype == torch.float64 else s.float()
    b, h, sq, _ = s.shape
    col = sink.to(s_hi.dtype).view(1, h, 1, 1).expand(b, h, sq, 1)
    s_cat = torch.cat([s_hi, col], dim=-1)  # (B, H, Sq, Sk + 1): fully -inf only with a -inf sink
    # such a row (no visible key, a -inf sink) has lse -inf and P = 0; logsumexp and exp(-inf - -inf)
    # would give NaN there (and in the gradients), so its row goes through finite stand-ins
    empty = torch.isneginf(s_cat).all(dim=-1, keepdim=True)                              # (B, H, Sq, 1)
    lse = torch.logsumexp(torch.where(empty, torch.zeros_like(s_cat), s_cat), dim=-1)
    lse = torch.where(empty[..., 0], torch.full_like(lse, -math.inf), lse)               # (B, H, Sq)
    p = torch.exp(torch.where(empty, torch.zeros_like(s_hi), s_hi - lse[..., None]))
    return torch.where(empty, torch.zeros_like(p), p), lse


def attention_ref(q, k, v, *, softmax_scale=None, causal=False, upcast=True, window_size=(None, None),
                  softcap=0.0, learnable_sink=None):
    """q (B,Sq,Hq,D), k/v (B,Sk,Hkv,*) -> out (B,Sq,Hq,Dv) in q's dtype, lse (B,Hq,Sq) fp32.

    upcast=True computes in fp32 (the reference; float64 input stays float64); upcast=False stays in the input precision,
    rounding where a plain PyTorch implementation would (the baseline of the tolerance rule).
    window_size / softcap / learnable_sink as in reference.py; lse includes the sink, and the
    result is differentiable w.r.t. a learnable_sink tensor. With a sink the softmax runs in
    fp32 even for upcast=False, as FlashAttention's own reference does.
    """
    window = normalize_window(window_size, causal)
    softcap = check_softcap(softcap)
    sink = _check_sink(learnable_sink, q.shape[2], q.device)
    dtype_in = q.dtype
    if upcast and q.dtype in (torch.float16, torch.bfloat16):
        q, k, v = q.float(), k.float(), v.float()
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(hq // hkv, dim=2)
    v = v.repeat_interleave(hq // hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)  # (B, H, Sq, Sk)
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if window != (None, None):
        s = s.masked_fill(~visible_mask(sq, sk, window, q.device), float("-inf"))
    if sink is not None:
        p, lse = _softmax_with_sink(s, sink)
    else:
        s_hi = s.float() if s.dtype in (torch.float16, torch.bfloat16) else s
        lse = torch.logsumexp(s_hi, dim=-1)  # (B, H, Sq), -inf where nothing is visible
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # fully masked rows: NaN -> 0
    out = torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)
    return out.to(dtype_in), lse


def attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, *, softmax_scale=None, causal=False, upcast=True,
                         window_size=(None, None), softcap=0.0, learnable_sink=None):
    """Packed q (Tq,Hq,D), k/v (Tk,Hkv,*) -> out (Tq,Hq,Dv), lse (Hq,Tq) (float64 for float64 input)."""
    normalize_window(window_size, causal), check_softcap(softcap)  # bad input fails even with no sequence
    _check_sink(learnable_sink, q.shape[1], q.device)
    out = torch.zeros(q.shape[:2] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=lse_dtype, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        if q1 == q0:
            continue
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], softmax_scale=softmax_scale,
                             causal=causal, upcast=upcast, window_size=window_size, softcap=softcap,
                             learnable_sink=learnable_sink)
        out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def _max_abs_diff(a, b):
    a, b = a.float(), b.float()
    both_inf = torch.isinf(a) & torch.isinf(b) & (torch.sign(a) == torch.sign(b))
    diff = torch.where(both_inf, torch.zeros_like(a), (a - b).abs())
    return diff.nan_to_num(float("inf")).max().item() if diff.numel() else 0.0


def reference_and_baseline(q, k, v, dout, **kw):
    """The two sides of FA4's rule for a forward and backward: (out, lse, dq, dk, dv) of
    attention_ref in fp32 (the reference) and in the inputs' precision (the baseline), the gradients
    those of sum(out * dout). kw: attention_ref's keywords (causal, window_size, softcap, ...)."""
    sides = []
    for upcast in (True, False):
        leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_() for t in (q, k, v)]
        out, lse = attention_ref(*leaves, upcast=upcast, **kw)
        grads = torch.autograd.grad((out.float() * dout.float()).sum(), leaves)
        sides.append((out.detach(), lse.detach(), *grads))
    return tuple(sides)


def grad_atol(ref_grads, floor=1e-5):
    """The rule's tiny absolute term for gradients, scaled to the backward's magnitude.

    fp32 accumulation noise grows with the gradients, and the 2x-baseline term can vanish: with
    seqlen_k = 1, dS = dP - D cancels exactly in PyTorch's bf16 backward, so only atol is left to
    absorb a kernel's fp32 rounding. 2^-16 of the largest reference gradient is still far below a
    bf16 ulp (2^-8) of it.
    """
    scale = max((float(g.float().abs().max()) for g in ref_grads if g.numel()), default=0.0)
    return max(floor, 2.0 ** -16 * scale)


def fa4_error_bound(ref_fp32, baseline, atol=1e-5):
    """2 x (error of the low-precision PyTorch baseline) + atol."""
    return 2.0 * _max_abs_diff(baseline, ref_fp32) + atol


def assert_fa4_close(name, actual, ref_fp32, baseline, atol=1e-5):
    """FA4's rule: max|actual - ref| <= 2 max|baseline - ref| + atol (infinities must match)."""
    if actual.shape != ref_fp32.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)} != reference {tuple(ref_fp32.shape)}")
    err = _max_abs_diff(actual, ref_fp32)
    bound = fa4_error_bound(ref_fp32, baseline, atol)
    if not err <= bound:
        raise AssertionError(
            f"{name}: max abs error {err:.3e} exceeds FA4 bound {bound:.3e} "
            f"(2 x PyTorch {baseline.dtype} error {(bound - atol) / 2:.3e} + atol {atol:.0e})")
    return err, bound
