"""Score transforms applied to S before the mask and the softmax.

Softcap (Gemma 2): the scaled score s = q.k * softmax_scale becomes softcap * tanh(s / softcap), so
no logit leaves (-softcap, softcap). A kernel folds the two scales around the tanh:

    S' = tanh(S * (softmax_scale / softcap))       in place, once per score (MUFU.TANH)
    P  = 2^(S' * softcap * log2(e) - m')           the softmax's usual exp2, with scale_log2 = softcap log2 e

so the rest of the softmax, the mask (-inf stays -inf after the mask, which comes second) and lse
= m' * scale_log2 + log2 l are unchanged. tanh.approx has a relative error near 2^-11, below bf16's
2^-8 rounding of P. Exp2 emulation sees S' in [-1, 1] times softcap * log2(e) -- a narrower range
than without the cap, so the polynomial's range reduction has less to do, and its error bound is
the same.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import const_expr

from stage0_reference.validation import check_softcap

LOG2_E = math.log2(math.e)


class Softcap:
    """softcap * tanh(s / softcap) on the scaled scores; cap = 0: the identity (no code)."""

    def __init__(self, cap: float = 0.0):
        self.cap = check_softcap(cap)

    @property
    def on(self) -> bool:
        return self.cap > 0

    def kernel_scales(self, softmax_scale: float) -> tuple[float, float]:
        """(scale_log2 the softmax uses, score_scale the tanh's input takes) for a launch."""
        if not self.on:
            return softmax_scale * LOG2_E, softmax_scale
        return self.cap * LOG2_E, softmax_scale / self.cap

    @cute.jit
    def apply(self, acc_S: cute.Tensor, score_scale):
        """S = tanh(S * score_scale) in place (nothing when off)."""
        if const_expr(self.on):
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                acc_S[i] = cute.math.tanh(acc_S[i] * score_scale, approx=True)
