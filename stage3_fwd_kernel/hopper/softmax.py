"""The online softmax of one consumer warpgroup on one key block, with FA4's conditional rescaling.

A Hopper warp holds 16 query rows of the S accumulator (2 per thread, 4 threads per row). After
the block's row maxima each thread asks "did one of my rows grow by more than tau (log2 units)?"
against a limit m + tau / scale kept beside m (one compare per row), and `vote.sync.any` makes it
a warp decision (`softmax_policy.rescale_vote_limits`): yes -> every row of the warp moves to its
new max and l (here) and O (the caller, once the P V in flight has landed) are rescaled; no -> the
warp keeps its stale maxima, P = 2^(s - m) <= 2^tau, and the dv / 2 multiplies of the O rescale are
skipped. Uniform per warp, so the branch never diverges. The epilogue stays exact: O / l cancels
whatever m was used, and lse = m * scale + log2(l) with that same m. Headroom: P <= 2^tau in the
input dtype (fp16 overflows past 2^15, so tau <= 15 there), l <= Sk * 2^tau in fp32.

The exponentials go through `softmax_policy.exp2_row`: MUFU.EX2, or a compile-time share on the
FMA pipe with stage 2's polynomial (0 by default on Hopper, see softmax_policy).
measured: docs/measurements.md
"""
from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from stage2_emulated_exp.gpu_kernel import ex2_approx_f32
from stage3_fwd_kernel import softmax_policy
from stage3_fwd_kernel.hopper.fragments import acc_rowcol, quad_allreduce


class RowState(NamedTuple):
    """Per-row softmax state of a thread (rmem tensors, one entry per row it holds). row_limit and
    row_bias move only when m does (in the rarely taken rescale branch), so the loop does not
    recompute them per block."""

    row_max: Any       # m: the running (possibly stale) maximum of the raw scores
    row_max_new: Any   # max(m, this block's row maximum)
    row_sum: Any       # l: this thread's partial row sum (quad-reduced in the epilogue)
    row_scale: Any     # 2^((m_old - m_new) * scale), for the caller's O rescale
    row_limit: Any     # the vote's limit m + tau / scale_log2
    row_bias: Any      # the exponent's bias m * scale_log2 (0 while m = -inf)


class ScoreContext(NamedTuple):
    """What masking and the softmax need about a consumer's rows, fixed for a tile."""

    row0: Any                # first query row of the warpgroup in the sequence
    seqlen_q: Any            # query tokens (= rows, unless GQA heads are packed as rows: the mask's)
    seqlen_k: Any
    softmax_scale_log2: Any  # softmax_scale * log2(e) (softcap: softcap * log2(e))
    score_scale: Any         # softcap: the tanh's input scale softmax_scale / softcap (else unused)
    rescale_margin: Any      # tau / softmax_scale_log2
    tScS_rc: Any             # (row, col) of each S element of this thread, (rows, cols)
    tScS0_rc: Any            # the same for thread 0 (compile-time): the lean mask compares to it


@cute.jit
def online_softmax(acc_S: cute.Tensor, n_block, side: cutlass.Constexpr, rows: RowState,
                   ctx: ScoreContext, mask, policy: cutlass.Constexpr, score_mod):
    """S (accumulator) -> P = 2^(S * scale - m * scale) in place, with the score transform
    (components.score_mod), the mask, the running max and sum. Returns the warp's vote: True when O
    must be multiplied by row_scale. side: the edges the mask tests (components.mask's RIGHT, LEFT,
    BOTH), or None: a block every row sees whole (no mask code is generated)."""
    score_mod.apply(acc_S, ctx.score_scale)
    acc_S_rc = acc_rowcol(acc_S)
    num_rows = cute.size(rows.row_max)
    if const_expr(side is not None):
        mask.apply(acc_S_rc, ctx.tScS_rc, ctx.tScS0_rc, n_block, ctx.row0, ctx.seqlen_q, ctx.seqlen_k, side)
    # this block's row maxima, one row pair per thread (quad-reduced)
    for r in cutlass.range_constexpr(num_rows):
        m_tile = acc_S_rc[r, 0]
        for c in cutlass.range_constexpr(1, cute.size(acc_S_rc, mode=[1])):
            m_tile = cute.arch.fmax(m_tile, acc_S_rc[r, c])
        m_tile = quad_allreduce(m_tile, cute.arch.fmax)
        rows.row_max_new[r] = cute.arch.fmax(rows.row_max[r], m_tile)
    rescale = softmax_policy.rescale_vote_limits(rows.row_max_new, rows.row_limit)
    if rescale:
        for r in cutlass.range_constexpr(num_rows):
            # a row with nothing visible yet keeps m = -inf: subtract 0 instead (no inf - inf)
            m_safe = Float32(0.0) if rows.row_max_new[r] == -Float32.inf else rows.row_max_new[r]
            rows.row_scale[r] = ex2_approx_f32((rows.row_max[r] - m_safe) * ctx.softmax_scale_log2)
            rows.row_max[r] = rows.row_max_new[r]
            rows.row_limit[r] = rows.row_max_new[r] + ctx.rescale_margin
            rows.row_bias[r] = m_safe * ctx.softmax_scale_log2
            rows.row_sum[r] = rows.row_sum[r] * rows.row_scale[r]
    for r in cutlass.range_constexpr(num_rows):
        rows.row_sum[r] += softmax_policy.exp2_row(acc_S_rc[r, None], ctx.softmax_scale_log2, rows.row_bias[r],
                                                   policy)
    return rescale
