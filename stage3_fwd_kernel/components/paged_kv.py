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

The sequence's first logical key (the tile's offset_k, cu_seqlens_k[b]) is where a split-KV
segment starts inside the sequence; it is a multiple of tile_n (0 for a whole sequence).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32


def check_page_size(page_size: int, tile_n: int) -> int:
    """The page size a kernel is built for: a positive multiple of its key tile."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0 or page_size % tile_n:
        raise ValueError(f"page_size: the kernel reads pages by TMA one key block ({tile_n} rows) at a time, so "
                         f"the page size must be a multiple of {tile_n}; got {page_size!r}")
    return page_size


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
