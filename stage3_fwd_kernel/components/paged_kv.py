"""Paged K/V: which rows of a paged cache hold a sequence's key block.

A paged cache is (num_pages, page_size, Hkv, D) with a page table int32 (sequences, pages per
sequence): key j of sequence b lives in page page_table[b, j // page_size], row j % page_size.
The kernel sees the cache flattened to (num_pages * page_size) rows, the layout of a packed
varlen tensor, so the TMA tensor map, the box and the shared-memory ring stay as they are and only
the block coordinate of each K/V load changes.

With page_size a multiple of tile_n, a key block never straddles two pages: logical block n of
the sequence is block n % bpp of page page_table[b, n // bpp] (bpp = page_size / tile_n blocks per
page), which is block page * bpp + n % bpp of the flat cache. One table read per K/V load, by the
producer's one issuing lane; the consumers, the mask and the softmax see logical positions only.

With pages smaller than tile_n (a divisor of it, at least 16 rows), a block is
L = tile_n / page_size pages: the K and V TMA boxes shrink to one page each and the producer issues
L of them per block into consecutive row ranges of the ring slot, page page_table[b, n * L + j] for
box j (the flat cache tiled by page_size rows is indexed by the page itself). Lane j of the producer
warp reads entry j (L reads in parallel) and the issuing lane takes each by a shuffle. The slot's
barrier still expects the whole block's bytes.

Every other page size (1 to 8 rows, 24, 160, ...) is gathered row by row (`gathered`,
hopper/gather.py): tile_n / 32 producer warps each take 32 key rows, a lane looks up one row's page,
and the rows are copied with 16-byte cp.async, each lane a few columns of a row, into the swizzled
ring slot. The slot's barrier then counts the lanes' cp.async completions (32 a warp,
cp.async.mbarrier.arrive.noinc) instead of TMA bytes. Rows past the sequence's keys
are not copied: the mask discards their scores and the consumers zero those V rows.

The sequence's first logical key (the tile's offset_k, cu_seqlens_k[b]) is where a split-KV
segment starts inside the sequence; it is a multiple of tile_n (0 for a whole sequence).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from stage3_fwd_kernel.components.page_sizes import (  # noqa: F401  (re-exported)
    MIN_BOX_ROWS, box_rows, check_page_size, gathered, page_size_ok, tma_pages)


@cute.jit
def logical_block(tile, tile_n: cutlass.Constexpr[int], n_block: Int32) -> Int32:
    """Key block n_block of the tile counted from its sequence's first key (offset_k is logical)."""
    return tile.offset_k // tile_n + n_block


@cute.jit
def key_block(page_table, blocks_per_page: cutlass.Constexpr[int], tile_n: cutlass.Constexpr[int], tile,
              n_block: Int32) -> Int32:
    """The block coordinate, in the flat cache tiled by tile_n rows, of the tile's key block n_block
    (counted from the tile's offset_k). page_table None (keys are rows of the tensor): n_block."""
    block = n_block
    if cutlass.const_expr(page_table is not None):
        logical = tile.offset_k // tile_n + n_block
        page = page_table[tile.sequence, logical // blocks_per_page]
        block = page * blocks_per_page + logical % blocks_per_page
    return block


@cute.jit
def block_pages(page_table: cute.Tensor, tile, block: Int32, boxes: cutlass.Constexpr[int],
                page_size: cutlass.Constexpr[int]) -> Int32:
    """Lane j < boxes of the loading warp: the page of box j of logical key block `block` (one
    table read per lane, in parallel; the issuing lane takes them by shuffle). A box past the
    segment's last key reads no table entry (the row may end there): page 0, whose rows the mask
    and the V zeroing discard."""
    lane = cute.arch.lane_idx()
    entry = block * boxes + lane
    page = Int32(0)
    if lane < boxes and entry * page_size < tile.offset_k + tile.seqlen_k:
        page = page_table[tile.sequence, entry]
    return page
