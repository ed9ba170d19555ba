"""The producer warp's cp.async gather of a paged K/V block, for page sizes TMA boxes cannot read
(components.paged_kv: 1 to 8 rows, sizes that do not divide the key tile, ...).

Why. A TMA box reads a rectangle of rows. Pages of 8 rows or fewer would need 16 or more boxes per
key block, each with its own table entry held in a register, and pages that do not divide the key
tile (24, 160) straddle blocks; the only in-place reader for them is a row-by-row copy.

How. The producer warpgroup's tile_n / 32 warps (4; 2 at tile_n = 64) each copy 32 rows of the
block, and walk the same tiles (so a gathered build takes no dynamic tile counter; warp 0 alone
loads Q). Lane j of warp w looks up row 32 w + j once for K and V and keeps its index in the flat
cache, or -1 past the sequence's keys. The copy is 16-byte cp.async tiled over the (tile_n, cols)
ring slot: `tpr` lanes per row, 32 / tpr rows per instruction; a row's index comes from its lane by
a shuffle. Rows past the keys are skipped (the mask discards their scores and the consumers zero
those V rows). Each lane then arrives on the slot's "full" barrier with
cp.async.mbarrier.arrive.noinc: the barrier (32 arrivals a warp, PipelineCpAsync) completes once
every lane's copies have landed.

Arithmetic (d = 128, bf16, tile_n = 128): a block is 2 x 32 KB = 4096 16-byte copies, 32 a lane
(16 instructions each for K and V per warp), against ~5000 cycles for 64 KB at an SM's share of
HBM bandwidth (25 GB/s at 1.98 GHz). What bounds it is copies in flight, not their count: one warp
doing all 128 rows ran ~190 cycles a copy instruction (0.2-0.3x of dense decode on an H200), four
warps with 4 rows a loop trip 0.6-0.7x, with 8 rows (40 producer registers, `gather_unroll`)
0.83-0.96x.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cute.nvgpu import cpasync

from stage3_fwd_kernel.components.paged_kv import logical_block

COPY_BITS = 128  # one cp.async moves 16 bytes


def lanes_per_row(dtype, cols: int) -> int:
    """Lanes that share one row: the largest power of two <= 32 that divides the row's 16-byte chunks."""
    chunks = cols * dtype.width // COPY_BITS
    tpr = 32
    while chunks % tpr:
        tpr //= 2
    return tpr


def gather_copy(dtype, cols: int) -> cute.TiledCopy:
    """One warp's 16-byte cp.async (global -> shared, L2 only) over a (rows, cols) tile."""
    elems = COPY_BITS // dtype.width
    tpr = lanes_per_row(dtype, cols)
    atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dtype,
                               num_bits_per_copy=COPY_BITS)
    thr = cute.make_ordered_layout((32 // tpr, tpr), order=(1, 0))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))


def gather_unroll(producer_regs: int) -> int:
    """Copy instructions a lane issues per loop trip (each 32 / tpr rows of the warp): 8 in 40 producer
    registers, 4 in 32 (three consumer warpgroups); spill-free in tests/test_hopper_paged.py, and
    measured against the alternatives in docs/measurements.md (2026-11-29, "cp.async gather")."""
    return 8 if producer_regs >= 40 else 4


@cute.jit
def flat_rows(page_table: cute.Tensor, tile, n_block: Int32, warp: Int32, tile_n: cutlass.Constexpr[int],
              page_size: cutlass.Constexpr[int]) -> Int32:
    """Lane j of producer warp w: row 32 w + j of key block n_block as a row of the flat cache
    (page_table[sequence, key // page_size] * page_size + key % page_size), -1 past the keys."""
    key = logical_block(tile, tile_n, n_block) * tile_n + warp * 32 + cute.arch.lane_idx()
    row = Int32(-1)
    if key < tile.offset_k + tile.seqlen_k:
        row = page_table[tile.sequence, key // page_size] * page_size + key % page_size
    return row


@cute.jit
def copy_rows(mX: cute.Tensor, sX: cute.Tensor, row: Int32, warp: Int32, cols: cutlass.Constexpr[int],
              unroll: cutlass.Constexpr[int]):
    """Rows 32 warp .. 32 warp + 31 of sX (tile_n, cols) <- mX[row of each, :] (mX: (flat rows, cols)
    of one head) by cp.async; `row` as flat_rows returns it (lane j holds row 32 warp + j)."""
    lane = cute.arch.lane_idx()
    copy = gather_copy(mX.element_type, cols)
    tpr = lanes_per_row(mX.element_type, cols)
    rpi = 32 // tpr                                             # rows per instruction
    elems = COPY_BITS // mX.element_type.width
    tXsX = copy.get_slice(lane).partition_D(sX)                 # (atom, tile_n / rpi, cols / (tpr * elems))
    # instruction m = warp * per_warp + i copies row 32 warp + rpi i + lane // tpr, which lane
    # rpi i + lane // tpr holds; `unroll` copies in flight a trip, as many as the producer's registers hold
    per_warp = 32 // rpi
    for i in cutlass.range(per_warp, unroll=unroll):
        src_row = cute.arch.shuffle_sync(row, i * rpi + lane // tpr)
        if src_row >= 0:
            gRow = cute.zipped_divide(mX[src_row, None], (elems,))  # (elems, chunks) of the row
            for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
                dst = tXsX[None, warp * per_warp + i, k]
                src = gRow[None, lane % tpr + k * tpr]
                cute.copy(copy, cute.make_tensor(src.iterator, dst.layout), dst)


@cute.jit
def gather_kv(cfg, st, tile, n_block: Int32, smem, tma):
    """This producer warp's share (32 rows) of the K/V load of ring slot st (key block n_block of
    the tile): wait for the slot, copy K's rows, arrive when they land; then V the same way."""
    warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())   # producer warps 0 .. tile_n / 32 - 1
    row = flat_rows(tma.page_table, tile, n_block, warp, cfg.tile_n, cfg.page_size)
    mK = tma.flat_K[0, None, tile.head_kv, None]                # (flat rows, d)
    mV = tma.flat_V[0, None, tile.head_kv, None]                # (flat rows, dv)
    smem.pipe_K.producer_acquire(st)
    copy_rows(mK, smem.sK[None, None, st.index], row, warp, cfg.head_dim, cfg.gather_unroll)
    smem.pipe_K.producer_commit(st)
    smem.pipe_V.producer_acquire(st)
    copy_rows(mV, smem.sV[None, None, st.index], row, warp, cfg.head_dim_v, cfg.gather_unroll)
    smem.pipe_V.producer_commit(st)
