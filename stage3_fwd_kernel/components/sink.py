"""The end of a row's softmax: O's factor and lse, with or without a learnable sink.

A row's online softmax ends with m (the maximum its exponentials were taken against, in log2
units after scaling: m2 = m * scale_log2) and l = sum_j 2^(s_j scale_log2 - m2). Then

    O = (sum_j P_j V_j) / l,   lse = (m2 + log2 l) * ln 2,   and a row that saw nothing (l = 0):
    O = 0, lse = -inf.

A learnable sink (gpt-oss) is one more logit per head, sink_h (natural-log units, like the scaled
scores), that joins the denominator and carries no value: l' = l 2^(m2 - t) + 2^(sink_h log2 e - t)
with t = max(m2, sink_h log2 e) so neither term overflows, O = (sum_j P_j V_j) 2^(m2 - t) / l',
lse = (t + log2 l') ln 2. A row that saw nothing gets O = 0 and lse = sink_h. The backward needs
nothing else: with this lse its P is the sink-aware one, and dsink_h = -sum_i 2^(sink_h log2 e -
lse_i log2 e) D_i comes from the row statistics D_i = dO_i . O_i the backward computes anyway.
"""
from __future__ import annotations

import math

import cutlass.cute as cute
from cutlass import Float32, const_expr

LN2 = math.log(2.0)


@cute.jit
def finish_row(l: Float32, m_scaled: Float32, sink_log2=None):
    """(factor for O's accumulator, lse) of one row. l: its row sum (reduced over the row's
    threads); m_scaled: m * scale_log2 (-inf for a row that saw nothing); sink_log2: the head's
    sink * log2(e), or None."""
    if const_expr(sink_log2 is None):
        inv = Float32(0.0) if l == 0.0 else cute.arch.rcp_approx(l)
        lse = -Float32.inf if l == 0.0 else (m_scaled + cute.math.log2(l, fastmath=True)) * LN2
        return inv, lse
    top = cute.arch.fmax(m_scaled, sink_log2)
    keep = cute.math.exp2(m_scaled - top, fastmath=True)  # 0 for a row that saw nothing
    total = l * keep + cute.math.exp2(sink_log2 - top, fastmath=True)
    return keep * cute.arch.rcp_approx(total), (top + cute.math.log2(total, fastmath=True)) * LN2
