"""The end of a tile: O /= l, lse, and the stores.

* lse = (m * scale_log2 + log2 l) * ln 2 per row; a row that saw no key (l = 0) gets O = 0 and
  lse = -inf; a learnable sink joins l (`components.sink`). The thread holding column 0 of a row
  writes its lse.
* O through shared memory (the default): registers -> this warpgroup's smem slab -> 16-byte
  coalesced, row-guarded stores. One CTA per tile puts the slab at the start of its own Q slab
  (`o_in_q`: Q is dead after the last S); a persistent CTA has an O buffer of its own, since the
  next tile's Q loads during the epilogue.
* O straight from registers (`o_direct`, persistent CTAs above head dim 128, where Q, O and two K/V
  stages do not fit in shared memory): 4-byte stores, two adjacent columns each.
* Split tail: a key chunk of a tail tile leaves O (over its own row sums) and lse in an fp32
  workspace that `split_combine` merges.
Rows past the sequence's end (they belong to the next sequence) and q_shift's padding rows are
never written.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from stage3_fwd_kernel.components.sink import finish_row
from stage3_fwd_kernel.hopper import barriers
from stage3_fwd_kernel.hopper.fragments import quad_allreduce, row_stored


class OutputTiles(NamedTuple):
    """Where a consumer's results go."""

    mLSE: Any          # (B, Hq, Sq) fp32
    gO: Any            # (64, dv): this warpgroup's rows of O in global memory
    sO_wg: Any         # (64, dv) smem staging slab, or None (o_direct)
    tiled_mma_pv: Any  # O's accumulator layout
    gmem_copy_O: Any   # 128-thread, 16-byte tiled copy
    mSplit: Any        # split-tail workspace or None


def o_staging(cfg, storage, sQ_wg: cute.Tensor, sO_layout: cute.ComposedLayout, wg):
    """This warpgroup's (64, dv) O staging slab: the base of its Q slab (o_in_q, same 128B swizzle
    phase), None (o_direct), or its slab of the O buffer."""
    if const_expr(cfg.o_in_q):
        sO_slab = cute.slice_(sO_layout, (None, None, 0))
        return cute.make_tensor(cute.recast_ptr(sQ_wg.iterator, sO_slab.inner, cfg.dtype), sO_slab.outer)
    if const_expr(cfg.o_direct):
        return None
    return storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)[None, None, wg]


@cute.jit
def finish_tile(cfg, wg: Int32, ctidx: Int32, tile, row0: Int32, acc_O: cute.Tensor, acc_O_rc: cute.Tensor,
                rows, ctx, out: OutputTiles, chunk=None, sink_log2=None):
    """Normalize O, compute lse (components.sink: with the head's sink when sink_log2 is given),
    and store both (or, a split-tail chunk, its workspace rows)."""
    num_rows = cute.size(rows.row_sum)
    lse = cute.make_rmem_tensor((num_rows,), Float32)
    for r in cutlass.range_constexpr(num_rows):
        l = quad_allreduce(rows.row_sum[r], lambda a, b: a + b)
        inv, lse_r = finish_row(l, rows.row_max[r] * ctx.softmax_scale_log2, sink_log2)
        lse[r] = lse_r
        for c in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[1])):
            acc_O_rc[r, c] = acc_O_rc[r, c] * inv

    whole = True
    if const_expr(cfg.split_tail):
        whole = chunk < 0
        if not whole:
            store_split(cfg, acc_O, lse, out.mSplit, chunk, wg, ctidx, out.tiled_mma_pv, ctx.tScS_rc)
    if whole:
        store_lse(cfg, lse, out.mLSE, tile, row0, ctx.tScS_rc)
        rO = cute.make_rmem_tensor_like(acc_O, cfg.dtype)
        rO.store(acc_O.load().to(cfg.dtype))
        rows_skip = None
        if const_expr(cfg.q_shift):
            rows_skip = -tile.offset_q - row0  # padding rows at the top of this warpgroup's rows
        if const_expr(cfg.o_direct):
            store_O_direct(cfg, rO, out.gO, out.tiled_mma_pv, ctidx, tile.seqlen_q - row0, rows_skip)
        else:
            store_O_via_smem(cfg, rO, out.gO, out.sO_wg, out.tiled_mma_pv, out.gmem_copy_O, ctidx,
                             tile.seqlen_q - row0, wg, rows_skip)


@cute.jit
def store_lse(cfg, lse: cute.Tensor, mLSE: cute.Tensor, tile, row0: Int32, tScS_rc: cute.Tensor):
    """The thread holding column 0 of a row writes its lse, for rows inside the sequence."""
    if tScS_rc[0, 0][1] == 0:
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = row0 + tScS_rc[r, 0][0]
            live = row < tile.seqlen_q  # rows past the sequence belong to the next one
            if const_expr(cfg.q_shift):
                live = live & (tile.offset_q + row >= 0)  # nor the padding rows before it
            if live:
                mLSE[tile.batch_out, tile.head, tile.offset_q + row] = lse[r]


@cute.jit
def store_split(cfg, acc_O: cute.Tensor, lse: cute.Tensor, mSplit: cute.Tensor, chunk: Int32, wg: Int32,
                ctidx: Int32, tiled_mma_pv: cute.TiledMma, tScS_rc: cute.Tensor):
    """Split tail: this warpgroup's rows of chunk `chunk` into the workspace, fp32 -- O (already
    divided by the chunk's own row sums) in columns [0, dv), lse in column dv. Every row is
    written, past the sequence's end too (the combine reads only live rows)."""
    tm, dv = cfg.wg_m, cfg.head_dim_v
    tOcO = tiled_mma_pv.get_slice(ctidx).partition_C(cute.make_identity_tensor((tm, dv)))
    first = wg * tm
    for i in cutlass.range_constexpr(cute.size(acc_O)):
        mSplit[chunk, first + tOcO[i][0], tOcO[i][1]] = acc_O[i]
    if tScS_rc[0, 0][1] == 0:
        for r in cutlass.range_constexpr(cute.size(lse)):
            mSplit[chunk, first + tScS_rc[r, 0][0], dv] = lse[r]


def _copy_acc_O(dtype, tiled_mma_pv: cute.TiledMma, ctidx: Int32):
    """(32-bit copy atom, this thread's slice of it tiled over O's accumulator layout): two adjacent
    columns per copy, for O leaving the registers."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=32)
    return atom, cute.make_tiled_copy_C(atom, tiled_mma_pv).get_slice(ctidx)


@cute.jit
def store_O_direct(cfg, rO: cute.Tensor, gO: cute.Tensor, tiled_mma_pv: cute.TiledMma, ctidx: Int32,
                   q_rows_left: Int32, q_rows_skip=None):
    """O from the accumulator registers to global memory, 4 bytes per store. The stores half-fill
    each 32-byte sector (a quad writes 16 contiguous bytes of a row), which matters little once per
    tile."""
    atom, thr_copy_O = _copy_acc_O(cfg.dtype, tiled_mma_pv, ctidx)
    # mode 0 of each partition is all of a thread's values, (2 adjacent columns, rest):
    # src ((2, 32), 1, 1), dst and crd ((2, (2 rows 8 apart, 16 column groups)), 1, 1) at dv = 128
    src = thr_copy_O.retile(rO)
    dst = thr_copy_O.partition_D(gO)
    crd = thr_copy_O.partition_D(cute.make_identity_tensor((cfg.wg_m, cfg.head_dim_v)))
    for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
        for n in cutlass.range_constexpr(cute.size(dst, mode=[2])):
            for i in cutlass.range_constexpr(cute.size(dst, mode=[0, 1])):
                if row_stored(crd[(0, i), m, n][0], q_rows_left, q_rows_skip):
                    cute.copy(atom, src[(None, i), m, n], dst[(None, i), m, n])


@cute.jit
def store_O_via_smem(cfg, rO: cute.Tensor, gO: cute.Tensor, sO_wg: cute.Tensor, tiled_mma_pv: cute.TiledMma,
                     gmem_copy_O: cute.TiledCopy, ctidx: Int32, q_rows_left: Int32, wg: Int32, q_rows_skip=None):
    """O through this warpgroup's smem slab. Only this warpgroup touches its slab, so its own
    128-thread barrier replaces sync_threads (the producer warpgroup may have exited already)."""
    tm, dv, nc = cfg.wg_m, cfg.head_dim_v, cfg.num_consumers
    if const_expr(cfg.o_in_q or cfg.persistent):
        # o_in_q: our last QK^T has read sQ_wg; persistent: every thread has read the last tile's O
        barriers.sync_own(wg, nc)
    atom, thr_smem_copy_O = _copy_acc_O(cfg.dtype, tiled_mma_pv, ctidx)
    cute.copy(atom, thr_smem_copy_O.retile(rO), thr_smem_copy_O.partition_D(sO_wg))
    barriers.sync_own(wg, nc)
    thr_copy_O = gmem_copy_O.get_slice(ctidx)
    tOsO, tOgO = thr_copy_O.partition_S(sO_wg), thr_copy_O.partition_D(gO)
    tOcO = thr_copy_O.partition_S(cute.make_identity_tensor((tm, dv)))
    tOrO = cute.make_rmem_tensor_like(tOsO, cfg.dtype)
    cute.autovec_copy(tOsO, tOrO)
    for m in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
        if row_stored(tOcO[0, m, 0][0], q_rows_left, q_rows_skip):
            cute.copy(gmem_copy_O, tOrO[None, m, None], tOgO[None, m, None])
