"""Which key blocks a query tile walks.

Keys are cut into blocks of tile_n. Query row i sees key j when j < seqlen_k and, causal, when
j <= i + seqlen_k - seqlen_q (the mask aligned to the bottom-right corner). A tile of tile_m rows
starting at row m_block * tile_m therefore walks blocks [0, n_block_max), and only the last few of
them need a mask at all. The kernels walk the blocks last first, so those masked blocks come first
and the hot loop after them carries no mask code.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


def num_key_blocks(m_block, seqlen_q, seqlen_k, *, tile_m: int, tile_n: int, causal: bool):
    """Key blocks a query tile sees: all ceil(seqlen_k / tile_n), or (causal) those up to the
    diagonal of its last row. All consumers of a CTA walk the same blocks."""
    n_block_max = (seqlen_k + tile_n - 1) // tile_n
    if const_expr(causal):
        last_visible = (m_block + 1) * tile_m + seqlen_k - seqlen_q  # exclusive bound on keys
        n_block_max = cutlass.min(n_block_max, cutlass.max((last_visible + tile_n - 1) // tile_n, 0))
    return n_block_max


def num_masked_blocks(m_block, seqlen_q, seqlen_k, n_block_max, *, tile_m: int, tile_n: int, causal: bool):
    """How many of the walked blocks (counted from the last) need a mask: blocks [0, n_unmasked) are
    full and (causal) left of the diagonal of the tile's first row, so no row masks anything."""
    n_unmasked = seqlen_k // tile_n
    if const_expr(causal):
        diag = m_block * tile_m + 1 + seqlen_k - seqlen_q
        n_unmasked = cutlass.min(n_unmasked, cutlass.max(diag, 0) // tile_n)
    return n_block_max - cutlass.min(n_unmasked, n_block_max)


@cute.jit
def chunk_block_range(chunk: Int32, chunks: Int32, n_block_max: Int32):
    """A split-tail work item's key blocks: chunk c = j + S r of tail tile r walks blocks
    [j nb / S, (j + 1) nb / S) of the tile's nb (S = chunks); chunk < 0 is a whole tile, [0, nb).
    Returns (n_block_min, n_block_max)."""
    n_block_min = Int32(0)
    if chunk >= 0:
        j = chunk - (chunk // chunks) * chunks
        n_block_min = (j * n_block_max) // chunks
        n_block_max = ((j + 1) * n_block_max) // chunks
    return n_block_min, n_block_max


def blocks_walked(n_block_min, n_block_max):
    """Key blocks of a work item (n_block_min None: a whole tile, from block 0)."""
    if const_expr(n_block_min is None):
        return n_block_max
    return n_block_max - n_block_min
