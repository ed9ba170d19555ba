"""The score mask: a score whose key the row does not see (`components.window`: past the
sequence's end, right of the row's right edge -- causal: its diagonal --, left of its left edge)
gets -inf before the row maximum.

The lean form. A thread's (row, col) coordinates of its score fragment are, on the MMAs the
kernels use, thread 0's coordinates (compile-time constants) with the columns shifted by the
thread's first column (`hopper.fragments.mask_shift_holds` checks this on the Hopper S MMA). So
each row needs one limit per edge, shifted once into thread 0's columns, and every element is a
compare of an immediate against that limit and a select -- no column index held in registers, and
no `if` per element, whose lowering re-selects fragment values at every branch (~2100 extra
selects in the bf16 kernels; at 160 registers per thread it spills). A left edge costs a second
compare, only in the blocks that cross it. A thread that holds a whole row (Blackwell's tcgen05.ld)
turns the limit into a bit mask per 32 columns instead, and ptxas tests eight bits per R2P.
measured: docs/measurements.md
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, const_expr

from stage3_fwd_kernel.components.window import Window


# The edges a masked block's compares test (`AttentionMask.apply`'s side): the right edge and the
# sequence's end, the left edge, or both.
RIGHT, LEFT, BOTH = "right", "left", "both"


class AttentionMask:
    """Masking of the scores of one tile_n-wide key block for a Window (causal is right = 0).

    Which edges a block needs. A walk masks its first blocks on the right (`block_range.num_masked_blocks`)
    and, with a left window, its last blocks on the left. The left ones lie before
    `num_unmasked_blocks`: full of keys and left of every row's right edge, so they test the left
    edge alone. The right ones start at or after the last row's left edge -- so test the right edge
    alone -- when the window reaches at least tile_m + tile_n keys left (a block right of
    row0 + off + right - tile_n, or of the sequence's last whole block, starts past
    row0 + tile_m - 1 + off - left: left >= tile_m + tile_n covers the tile rows past the sequence
    too). Narrower windows test both there. tile_m: query tokens of a tile (None: always both)."""

    def __init__(self, window: Window, tile_n: int, rows_per_query: int = 1, tile_m: int | None = None):
        self.window = window
        self.tile_n = tile_n
        # GQA heads packed as rows (row t g + j is query token t): rows of one token share its edges
        self.rows_per_query = rows_per_query
        self.sides_apart = (tile_m is not None and window.left is not None
                            and window.left >= tile_m + tile_n)

    def right_blocks_side(self) -> str:
        """The edges the blocks masked on the right test (class docstring)."""
        return RIGHT if self.sides_apart else BOTH

    def right_half_hidden(self, row_last, n_block, seqlen_q, seqlen_k):
        """Whether no row up to `row_last` sees the second tile_n / 2 keys of block n_block (its
        right edge or the sequence's end comes first): the warpgroup's S and P V may skip them."""
        return self.key_limit(self.query_of(row_last), n_block, seqlen_q, seqlen_k) <= self.tile_n // 2

    def left_half_hidden(self, row_first, n_block, seqlen_q, seqlen_k):
        """Whether no row from `row_first` on sees the first tile_n / 2 keys of block n_block (left
        window: its left edge lies past them)."""
        return self.key_start(self.query_of(row_first), n_block, seqlen_q, seqlen_k) >= self.tile_n // 2

    def query_of(self, row):
        """The query token of a tile row: the row itself, or with packed GQA heads (row t g + j) t."""
        if const_expr(self.rows_per_query > 1):
            return row // self.rows_per_query  # row >= 0: a shift for a power of two
        return row

    def key_limit(self, row, n_block, seqlen_q, seqlen_k):
        """Query `row` sees the keys of block n_block before this column (block coordinates): the
        sequence's end and the row's right edge."""
        col_limit = seqlen_k - n_block * self.tile_n
        if const_expr(self.window.right is not None):
            edge = row + 1 + seqlen_k - seqlen_q - n_block * self.tile_n
            if const_expr(self.window.right != 0):
                edge = edge + self.window.right
            col_limit = cutlass.min(col_limit, edge)
        return col_limit

    def key_start(self, row, n_block, seqlen_q, seqlen_k):
        """The first column of block n_block that `row` sees (its left edge; left window only)."""
        return row + seqlen_k - seqlen_q - self.window.left - n_block * self.tile_n

    @cute.jit
    def apply(self, acc_S_rc: cute.Tensor, tScS_rc: cute.Tensor, tScS0_rc: cute.Tensor, n_block: Int32,
              row0: Int32, seqlen_q: Int32, seqlen_k: Int32, side: cutlass.Constexpr[str] = BOTH):
        """A fragment of several rows (wgmma): acc_S_rc is this thread's scores as (rows, cols);
        tScS_rc / tScS0_rc the (row, col) of each element for this thread / for thread 0
        (compile-time); row0 the fragment's first query row in the sequence; side: the edges tested
        (RIGHT, LEFT or BOTH; without a left window both is the right edge)."""
        shift = tScS_rc[0, 0][1]  # into thread 0's column coordinates (a select each)
        for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
            row = self.query_of(row0 + tScS_rc[r, 0][0])
            if const_expr(side == LEFT):
                col_start = self.key_start(row, n_block, seqlen_q, seqlen_k) - shift
                for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
                    acc_S_rc[r, c] = -Float32.inf if tScS0_rc[r, c][1] < col_start else acc_S_rc[r, c]
            elif const_expr(self.window.left is None or side == RIGHT):
                col_limit = self.key_limit(row, n_block, seqlen_q, seqlen_k) - shift
                for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
                    acc_S_rc[r, c] = -Float32.inf if tScS0_rc[r, c][1] >= col_limit else acc_S_rc[r, c]
            else:
                col_limit = self.key_limit(row, n_block, seqlen_q, seqlen_k) - shift
                col_start = self.key_start(row, n_block, seqlen_q, seqlen_k) - shift
                for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
                    col = tScS0_rc[r, c][1]
                    acc_S_rc[r, c] = -Float32.inf if (col >= col_limit) | (col < col_start) else acc_S_rc[r, c]

    @cute.jit
    def apply_row(self, acc_S: cute.Tensor, tScS: cute.Tensor, n_block: Int32, row: Int32, seqlen_q: Int32,
                  seqlen_k: Int32):
        """A thread that holds one whole row (tcgen05.ld 32x32b: lane = row): acc_S its scores,
        tScS their (row, col) coordinates, the columns compile-time constants."""
        col_limit = self.key_limit(row, n_block, seqlen_q, seqlen_k)
        if const_expr(self.window.left is None):
            # the row's visible columns of each 32-column group as a bit mask (one shift per group),
            # then a bit test per value, which ptxas turns into predicates eight at a time (R2P)
            # instead of a compare per value: 176 instructions over the unmasked loop, not 262
            # (d = 128 causal, sm_100a; the official kernel's masked loop adds 175)
            for g in cutlass.range_constexpr(cute.size(acc_S) // 32):
                first = tScS[32 * g][1]
                # bit c stands for column first + c: the row's values must be consecutive columns
                if const_expr(any(tScS[32 * g + c][1] != first + c for c in range(32))):
                    raise ValueError("apply_row: a 32-value group of the row is not 32 consecutive columns")
                n = cutlass.max(cutlass.min(col_limit - first, Int32(32)), Int32(0))
                # in 64 bits: a 32-bit shift by 32 (the whole group visible) is undefined in LLVM
                bits = Int32((Int64(1) << Int64(n)) - 1)
                for c in cutlass.range_constexpr(32):
                    acc_S[32 * g + c] = Float32(cutlass.select_(((bits >> c) & 1) == 0, -Float32.inf,
                                                                acc_S[32 * g + c]))
        else:
            col_start = self.key_start(row, n_block, seqlen_q, seqlen_k)
            for c in cutlass.range_constexpr(cute.size(acc_S)):
                col = tScS[c][1]
                acc_S[c] = Float32(cutlass.select_((col >= col_limit) | (col < col_start), -Float32.inf, acc_S[c]))
