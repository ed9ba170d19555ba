"""P^T from S^T in the production Hopper backward: the row statistics, the mask, the exponentials.

P^T = exp2(S^T * scale * log2(e) - lse2) per score, with lse2 = lse * log2(e) of the score's query (a
*column* of the consumer's S^T accumulator: keys are its rows). A thread holds tm / 4 columns, so it
needs tm / 4 different statistics per tile.

Row statistics by shuffle (``stats_shuffle``, d = 64 outside causal default mode): instead of tm / 8
LDS.64 each for lse2 and D per tile, lane l keeps 4 of them in registers -- queries q0, q0 + 1, q0 + 8,
q0 + 9 with q0 = 16 (l // 4) + 2 (l % 4), two LDS.64 -- and fetches each one it needs with a shfl.idx
from the lane that holds it (``stats_shuffle_source``; the same register index in every lane, as shfl
needs). LDS and MUFU share the MIO queue, so fewer loads leave more room for the exponentials.

The mask. The walk compiles two tile bodies (consumer.py): tiles that need no mask run a body without
any test. The masked body sends to -inf the scores of keys past the sequence, above the causal
diagonal, and of queries past the sequence (with TMA those rows may hold the next sequence's data).
Three ways to write that test, picked per tile by what ptxas schedules best:

* plain: ``schedule.is_masked`` per score, plus the query bound (3 FSEL, a VIADD, 1.5 ISETP a score);
* ``column_limit`` (d = 96 and 128): one key limit per query column (``schedule.column_key_limit``,
  zero for a query past the sequence), then one compare and select per score;
* ``mask_offsets`` (causal d = 64 and 96 outside deterministic mode and varlen): every thread's scores
  sit at the same offsets (dr, dc) from its first one (row0, col0), known at trace time, so the causal
  test row0 + dr > col0 + dc + diag becomes rel_r > dc with rel_r = row0 - col0 - diag + dr: one
  register per accumulator row, one compare against an immediate per score. A key row past the keys
  sets its rel_r beyond every dc; a query past the sequence sets its column's lse2 to +inf.

``key_select`` (the 80-query tile outside deterministic mode): the *unmasked* body also selects -inf
for keys past key_limit. That never happens there (same bits), but with the select ptxas keeps about
13 of a thread's 40 exponentials between the S^T and dP^T waits, i.e. under the dP^T wgmma, instead of 4
(``test_key_select_moves_exponentials_under_the_dp_wgmma`` counts them). Measured: docs/measurements.md.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from stage4_bwd_kernel import schedule


@dsl_user_op
def thread_idx_fresh(*, loc=None, ip=None) -> Int32:
    """%tid.x read again where it is used (volatile asm: not merged with earlier reads), so that values
    derived from it need not stay live across the walk, where they spilled."""
    return Int32(llvm.inline_asm(T.i32(), [], "mov.u32 $0, %tid.x;", "=r",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


def stats_shuffle_source(c: int, lane):
    """(source lane, register index) holding the statistic of accumulator column c of this lane:
    column c of a 64 x tm wgmma C fragment (row-col view) is query 8 (c // 2) + 2 (lane % 4) + c % 2."""
    j = c // 2
    return (j // 2) * 4 + lane % 4, (j % 2) * 2 + c % 2


def stats_shuffle_query(lane: int, reg: int) -> int:
    """The query whose statistic lane `lane` keeps in register `reg` (load_quad_stats)."""
    return lane // 4 * 16 + lane % 4 * 2 + reg % 2 + 8 * (reg // 2)


class TanhFromP(NamedTuple):
    """Softcap: what dS^T needs to recover each score's tanh from its P^T instead of keeping it.
    P = exp2(t * scale_log2 - lse2) with t = tanh(S * score_scale), so t = (log2 P + lse2) / scale_log2
    (one MUFU.LG2 a score). Keeping 1 - t^2 in registers from the exponentials to dS^T spilled
    0.6-1.0 KB a consumer thread (32 more registers at d = 128)."""

    sLSE2: Any            # this tile's lse2 per query (SMEM; read again for dS^T)
    inv_scale_log2: Any   # Float32: 1 / scale_log2


class Scores:
    """Statistics and exponential methods of the kernel class."""

    @cute.jit
    def softcap_grad(self, p: Float32, lse2: Float32, inv_scale_log2: Float32) -> Float32:
        """The tanh's derivative 1 - t^2 of a score, t recovered from its P^T and its query's lse2
        (TanhFromP). A P of 0 (a masked score, a query past the sequence, a row that sees no key and
        whose lse2 is infinite) gives t = -inf or NaN: its derivative is selected to 0 (dS^T is 0
        there anyway, and 0 * NaN is not)."""
        t = (cute.math.log2(p, fastmath=True) + lse2) * inv_scale_log2
        t = cutlass.min(cutlass.max(t, Float32(-1.0)), Float32(1.0))
        grad = 1.0 - t * t
        if p <= Float32(0.0):
            grad = Float32(0.0)
        return grad

    @cute.jit
    def load_quad_stats(self, sStat: cute.Tensor):
        """With stats_shuffle, this lane's 4 statistics (queries q0, q0 + 1, q0 + 8, q0 + 9); else None."""
        if const_expr(not self.stats_shuffle):
            return None
        quad = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        lane = thread_idx_fresh() % 32
        q0 = lane // 4 * 16 + lane % 4 * 2
        pairs = cute.make_tensor(sStat.iterator + q0, cute.make_layout((2, 2), stride=(1, 8)))
        cute.autovec_copy(pairs, cute.make_tensor(quad.iterator, cute.make_layout((2, 2), stride=(1, 2))))
        return quad

    @cute.jit
    def column_stat(self, sStat: cute.Tensor, quad, c: cutlass.Constexpr[int], col: Int32) -> Float32:
        """The statistic of this thread's accumulator column c (query col): shuffled from the lane that
        holds it (stats_shuffle), else read from SMEM."""
        if const_expr(not self.stats_shuffle):
            return sStat[col]
        src_lane, reg = stats_shuffle_source(c, cute.arch.lane_idx())
        return cute.arch.shuffle_sync(quad[reg], src_lane)

    @cute.jit
    def row_offsets(self, tScS_rc: cute.Tensor, tScS0_rc: cute.Tensor, key_limit: Int32, diag: Int32):
        """mask_offsets: rel_r per accumulator row (a key row past key_limit: a bound no dc reaches)."""
        row0, col0 = tScS_rc[0, 0][0], tScS_rc[0, 0][1]
        rel = [None] * cute.size(tScS_rc, mode=[0])
        for r in cutlass.range_constexpr(cute.size(tScS_rc, mode=[0])):
            dr = tScS0_rc[r, 0][0] - tScS0_rc[0, 0][0]
            rel_r = row0 - col0 - diag + dr if const_expr(self.causal) else Int32(-1)
            if row0 + dr >= key_limit:
                rel_r = Int32(1 << 20)
            rel[r] = rel_r
        return rel

    @cute.jit
    def exp_scores(self, acc_S_rc: cute.Tensor, tScS_rc: cute.Tensor, sLSE2: cute.Tensor, lse2_quad,
                   softmax_scale_log2: Float32, key_limit: Int32, diag: Int32, q_rows_left: Int32,
                   masked: cutlass.Constexpr[bool], tScS0_rc: cute.Tensor, score_scale=None):
        """P^T = exp2(S^T * scale_log2 - lse2) in place; masked=True also sends masked scores to -inf.
        tScS_rc: this thread's (key, query) coordinates; tScS0_rc: thread 0's (static). Softcap
        (components.score_mod): S^T = tanh(S^T * score_scale) first (dS^T recovers it from P^T:
        TanhFromP)."""
        if const_expr(masked and self.mask_offsets):
            rel = self.row_offsets(tScS_rc, tScS0_rc, key_limit, diag)
            cols_left = q_rows_left - tScS_rc[0, 0][1]
        for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
            col = tScS_rc[0, c][1]
            lse2 = self.column_stat(sLSE2, lse2_quad, c, col)
            if const_expr(masked and self.mask_offsets):
                dc = tScS0_rc[0, c][1] - tScS0_rc[0, 0][1]
                if cols_left <= dc:
                    lse2 = Float32.inf
            if const_expr(masked and self.column_limit and not self.mask_offsets):
                limit = schedule.column_key_limit(col, key_limit, diag, self.causal, imin=cutlass.min)
                if col >= q_rows_left:
                    limit = Int32(0)
            for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
                s = acc_S_rc[r, c]
                if const_expr(self.score_mod.on):
                    s = cute.math.tanh(s * score_scale, approx=True)
                if const_expr(self.key_select and not masked):
                    if schedule.is_masked(tScS_rc[r, c][0], col, key_limit, diag, causal=False):
                        s = -Float32.inf
                if const_expr(masked and self.mask_offsets):
                    if rel[r] > dc:
                        s = -Float32.inf
                elif const_expr(masked and self.column_limit):
                    if tScS_rc[r, c][0] >= limit:
                        s = -Float32.inf
                elif const_expr(masked):
                    if schedule.is_masked(tScS_rc[r, c][0], col, key_limit, diag, self.causal,
                                          self.window_or_none) | (col >= q_rows_left):
                        s = -Float32.inf
                acc_S_rc[r, c] = cute.math.exp2(s * softmax_scale_log2 - lse2, fastmath=True)
