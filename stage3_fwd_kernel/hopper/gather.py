"""The producer warp's cp.async gather of a paged K/V block, for page sizes TMA boxes cannot read
(components.paged_kv: 1 to 8 rows, sizes that do not divide the key tile, ...).

Why. A TMA box reads a rectangle of rows. Pages of 8 rows or fewer would need 16 or more boxes per
key block, each with its own table entry held in a register, and pages that do not divide the key
tile (24, 160) straddle blocks; the only in-place reader for them is a row-by-row copy.

How. The block's tile_n key rows are looked up once for K and V: lane j reads the page of rows
j, j + 32, ... (tile_n / 32 table reads a lane, in parallel) and keeps each row's index in the flat
cache, or -1 past the sequence's keys. The copy is one warp's 16-byte cp.async tiled over the
(tile_n, cols) ring slot: `tpr` lanes per row, 32 / tpr rows per instruction; row r's index comes
from lane r % 32 by a shuffle. Rows past the keys are skipped (the mask discards their scores and
the consumers zero those V rows). Each lane then arrives on the slot's "full" barrier with
cp.async.mbarrier.arrive.noinc: the barrier (32 arrivals, PipelineCpAsync) completes once every
lane's copies have landed.

Arithmetic (d = 128, bf16, tile_n = 128): a block is 2 x 32 KB = 4096 16-byte copies, 128 a lane
(64 instructions each for K and V) and 4 table reads a lane, against ~5000 cycles for 64 KB at an
SM's share of HBM bandwidth (25 GB/s at 1.98 GHz): the issue rate is not the limit.
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


@cute.jit
def flat_rows(page_table: cute.Tensor, tile, n_block: Int32, tile_n: cutlass.Constexpr[int],
              page_size: cutlass.Constexpr[int]) -> cute.Tensor:
    """(tile_n / 32,) int32: lane j's rows j + 32 i of key block n_block as rows of the flat cache
    (page_table[sequence, key // page_size] * page_size + key % page_size), -1 past the keys."""
    lane = cute.arch.lane_idx()
    first = logical_block(tile, tile_n, n_block) * tile_n       # logical key of the block's row 0
    end = tile.offset_k + tile.seqlen_k
    rows = cute.make_rmem_tensor((tile_n // 32,), Int32)
    for i in cutlass.range_constexpr(tile_n // 32):
        key = first + i * 32 + lane
        row = Int32(-1)
        if key < end:
            row = page_table[tile.sequence, key // page_size] * page_size + key % page_size
        rows[i] = row
    return rows


@cute.jit
def copy_rows(mX: cute.Tensor, sX: cute.Tensor, rows: cute.Tensor, cols: cutlass.Constexpr[int]):
    """sX (tile_n, cols) <- mX[rows[...], :] (mX: (flat rows, cols) of one head) by cp.async;
    rows as flat_rows returns them."""
    lane = cute.arch.lane_idx()
    copy = gather_copy(mX.element_type, cols)
    tpr = lanes_per_row(mX.element_type, cols)
    rpi = 32 // tpr                                             # rows per instruction
    elems = COPY_BITS // mX.element_type.width
    tXsX = copy.get_slice(lane).partition_D(sX)                 # (atom, tile_n / rpi, cols / (tpr * elems))
    # instructions m = slot * per_slot + i copy rows 32 slot + rpi i + (lane // tpr), held by one lane of
    # rows[slot]; a rolled loop over i keeps the producer within its 24 registers (unrolled: spills)
    per_slot = 32 // rpi
    for slot in cutlass.range_constexpr(cute.size(rows)):
        for i in cutlass.range(per_slot, unroll=1):
            row = cute.arch.shuffle_sync(rows[slot], i * rpi + lane // tpr)
            if row >= 0:
                gRow = cute.zipped_divide(mX[row, None], (elems,))  # (elems, chunks) of the row
                for k in cutlass.range_constexpr(cute.size(tXsX, mode=[2])):
                    dst = tXsX[None, slot * per_slot + i, k]
                    src = gRow[None, lane % tpr + k * tpr]
                    cute.copy(copy, cute.make_tensor(src.iterator, dst.layout), dst)


@cute.jit
def gather_kv(cfg, st, tile, n_block: Int32, smem, tma):
    """The K/V load of ring slot st (key block n_block of the tile) by the gather: wait for the slot,
    copy K's rows, arrive when they land; then V the same way (the same rows)."""
    rows = flat_rows(tma.page_table, tile, n_block, cfg.tile_n, cfg.page_size)
    mK = tma.flat_K[0, None, tile.head_kv, None]                # (flat rows, d)
    mV = tma.flat_V[0, None, tile.head_kv, None]                # (flat rows, dv)
    smem.pipe_K.producer_acquire(st)
    copy_rows(mK, smem.sK[None, None, st.index], rows, cfg.head_dim)
    smem.pipe_K.producer_commit(st)
    smem.pipe_V.producer_acquire(st)
    copy_rows(mV, smem.sV[None, None, st.index], rows, cfg.head_dim_v)
    smem.pipe_V.producer_commit(st)
