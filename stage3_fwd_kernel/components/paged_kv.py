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


# A box covers whole 8-row swizzle atoms of the shared-memory tile; 16 rows at least because the
# issuing loop holds one page index per box and 16 boxes of 8 rows spilled the producer's 24 registers
MIN_BOX_ROWS = 16


def tma_pages(page_size: int, tile_n: int) -> bool:
    """Whether TMA boxes can read pages of page_size in place: a multiple of the key tile (one box
    per block), or a divisor of it that is a multiple of MIN_BOX_ROWS rows (tile_n / page_size
    boxes per block). Other sizes are gathered (`gathered`)."""
    return page_size % tile_n == 0 or (tile_n % page_size == 0 and page_size % MIN_BOX_ROWS == 0)


def page_size_ok(page_size: int, tile_n: int) -> bool:
    """Whether a kernel with key tile tile_n reads pages of page_size in place: any positive page
    size (TMA boxes where `tma_pages`, else the cp.async gather)."""
    return not isinstance(page_size, bool) and isinstance(page_size, int) and page_size > 0


def gathered(page_size, tile_n: int) -> bool:
    """Whether a build reads its pages with the cp.async gather (a paged build TMA cannot serve)."""
    return page_size is not None and not tma_pages(page_size, tile_n)


def check_page_size(page_size: int, tile_n: int) -> int:
    """The page size a kernel is built for (page_size_ok), else a ValueError naming it."""
    if not page_size_ok(page_size, tile_n):
        raise ValueError(f"page_size: expected a positive int (rows of one page), got {page_size!r}")
    return page_size


def box_rows(page_size, tile_n: int) -> int:
    """Rows of one K / V TMA box: the key tile, or a whole page when TMA reads pages smaller than it."""
    return tile_n if page_size is None or gathered(page_size, tile_n) else min(page_size, tile_n)


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
