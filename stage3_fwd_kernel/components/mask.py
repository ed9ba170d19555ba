"""The score mask: keys past the sequence's end and, causal, keys past each row's diagonal
(bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q) get -inf before the
row maximum.

The lean form. A thread's (row, col) coordinates of its score fragment are, on the MMAs the
kernels use, thread 0's coordinates (compile-time constants) with the columns shifted by the
thread's first column (`hopper.fragments.mask_shift_holds` checks this on the Hopper S MMA). So
each row needs one limit, shifted once into thread 0's columns, and every element is a compare of
an immediate against that limit and a select -- no column index held in registers, and no `if`
per element, whose lowering re-selects fragment values at every branch (~2100 extra selects in
the bf16 kernels; at 160 registers per thread it spills).

Window, softcap and sinks plug in here: each changes the per-row limits or the scores, not the
kernel's walk.
measured: docs/measurements.md
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr


class AttentionMask:
    """Sequence-end and (optionally) causal masking of one (rows, cols) score fragment of a
    tile_n-wide key block."""

    def __init__(self, causal: bool, tile_n: int):
        self.causal = causal
        self.tile_n = tile_n

    @cute.jit
    def apply(self, acc_S_rc: cute.Tensor, tScS_rc: cute.Tensor, tScS0_rc: cute.Tensor, n_block: Int32,
              row0: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """acc_S_rc: this thread's scores as (rows, cols); tScS_rc / tScS0_rc: the (row, col) of each
        element for this thread / for thread 0 (compile-time); row0: the fragment's first query row
        in the sequence; n_block: the key block."""
        tn = self.tile_n
        for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
            col_limit = seqlen_k - n_block * tn  # in this block's column coordinates
            if const_expr(self.causal):
                row = row0 + tScS_rc[r, 0][0]
                col_limit = cutlass.min(col_limit, row + 1 + seqlen_k - seqlen_q - n_block * tn)
            col_limit -= tScS_rc[0, 0][1]  # into thread 0's column coordinates (a select each)
            for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
                acc_S_rc[r, c] = -Float32.inf if tScS0_rc[r, c][1] >= col_limit else acc_S_rc[r, c]
