"""Register-fragment helpers for the Hopper wgmma accumulator (ladder step 1's docstring has the
picture): a (rows, cols) view of a thread's values, quad reductions, P packed to 16 bits, O scaled
per row, and the host-side check of the lean mask's premise."""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


def acc_rowcol(acc: cute.Tensor) -> cute.Tensor:
    """View a wgmma accumulator ((2, 2, N/8), MMA_M, MMA_N) as (rows, cols) of this thread:
    rows = (the 2 rows 8 apart, MMA_M), cols = (2 adjacent columns, N/8 groups, MMA_N)."""
    shp, std = acc.layout.shape, acc.layout.stride
    rows = ((shp[0][1], shp[1]), (std[0][1], std[1]))
    cols = ((shp[0][0], shp[0][2], shp[2]), (std[0][0], std[0][2], std[2]))
    return cute.make_tensor(acc.iterator, cute.make_layout((rows[0], cols[0]), stride=(rows[1], cols[1])))


@cute.jit
def quad_allreduce(x: Float32, op: cutlass.Constexpr) -> Float32:
    """Reduce over the 4 lanes of a quad (the 4 threads that share an accumulator row)."""
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return x


def row_stored(row, q_rows_left, q_rows_skip=None):
    """Whether an output row (relative to the warpgroup's first) is written: before the sequence's end
    and, with q_shift (q_rows_skip: its padding rows at the top), not a padding row."""
    live = row < q_rows_left
    if const_expr(q_rows_skip is not None):
        live = live & (row >= q_rows_skip)
    return live


@dsl_user_op
def pack_pair_pinned(lo: Float32, hi: Float32, bf16: bool, *, loc=None, ip=None) -> Int32:
    """(lo, hi) -> one 32-bit word of two 16-bit floats, lo in the low half (round to nearest): a
    volatile cvt, which the compiler neither moves nor merges, the same F2FP a plain conversion emits."""
    cvt = "cvt.rn.bf16x2.f32 $0, $1, $2;" if bf16 else "cvt.rn.f16x2.f32 $0, $1, $2;"
    operands = [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)]  # PTX: $1 -> the high half
    return Int32(llvm.inline_asm(T.i32(), operands, cvt, "=r,f,f", has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.jit
def store_P(acc_S: cute.Tensor, tOrP: cute.Tensor, bf16: cutlass.Constexpr[bool]):
    """P packed between the exponentials. P (fp32 accumulator) -> the 16-bit A operand of O += P V:
    the same registers in accumulator order, converted in place, a pair per 32-bit word.

    Each pair is a volatile cvt (the same F2FP as a plain `.to(dtype)`), so it stays where it is
    written, right after the wait for the previous P V and before the O rescale's branch. A plain
    conversion sinks to its first use (the next P V) past that branch, leaving all 32 packs in a
    row at the end of the step; pinned, they interleave with the exponentials still in flight.
    measured: docs/measurements.md"""
    words = cute.make_tensor(cute.recast_ptr(tOrP.iterator, dtype=Int32), cute.make_layout(cute.size(acc_S) // 2))
    for k in cutlass.range_constexpr(cute.size(acc_S) // 2):
        words[k] = pack_pair_pinned(acc_S[2 * k], acc_S[2 * k + 1], bf16)


@cute.jit
def scale_O_rows(acc_O: cute.Tensor, row_scale: cute.Tensor):
    """O *= row_scale, row by row (the conditional rescale's "yes")."""
    acc_O_rc = acc_rowcol(acc_O)
    for r in cutlass.range_constexpr(cute.size(row_scale)):
        for c in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[1])):
            acc_O_rc[r, c] = acc_O_rc[r, c] * row_scale[r]


def mask_shift_holds(kernel) -> bool:
    """Host-side check of the lean mask's premise (components.mask) on the kernel's own S MMA: for
    every thread of a consumer warpgroup, each accumulator element's (row, col) is (its own row,
    thread 0's col + the thread's first col), and the 128 threads cover the 64 x tile_n tile exactly
    once. Traced, not run (the coordinates of a constant thread index are compile-time), so it needs
    no GPU."""
    tm, tn = kernel.wg_m, kernel.tile_n
    coords = []

    def collect():  # plain Python (not AST-rewritten): 128 x 2 x tn / 4 static coordinates
        mma, ident = kernel._tiled_mma_qk(), cute.make_identity_tensor((tm, tn))
        for t in range(128):
            rc = acc_rowcol(mma.get_slice(t).partition_C(ident))
            coords.append([[tuple(rc[r, c]) for c in range(cute.size(rc, mode=[1]))]
                           for r in range(cute.size(rc, mode=[0]))])

    @cute.jit
    def trace():
        collect()
    cute.compile(trace)
    shifted = all(x == (rows[0][0], coords[0][r][c][1] + coords[t][0][0][1])
                  for t in range(128) for r, rows in enumerate(coords[t]) for c, x in enumerate(rows))
    cover = sorted(x for thr in coords for rows in thr for x in rows) == [(i, j) for i in range(tm) for j in range(tn)]
    return shifted and cover and coords[0][0][0] == (0, 0)
