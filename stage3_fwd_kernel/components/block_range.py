"""Which key blocks a query tile walks.

Keys are cut into blocks of tile_n. Query row i sees keys [i + off - left, i + off + right] of
[0, seqlen_k) (`components.window`; off = seqlen_k - seqlen_q, causal is right = 0). A tile of
tile_m rows starting at row m_block * tile_m therefore walks blocks [n_block_min, n_block_max):
n_block_max from its last row's right edge, n_block_min from its first row's left edge (0 without
a left window, so the cost of a windowed tile grows with the window, not the sequence). Only blocks
at the two ends need a mask. The kernels walk the blocks last first: the blocks masked on the
right come first, then a hot loop with no mask code, then (left window) the blocks masked on the
left.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from stage3_fwd_kernel.components.window import Window


def _plus(x, c: int):
    """x + c for a compile-time c, with no instruction when c is 0 (causal)."""
    return x + c if c else x


def num_key_blocks(m_block, seqlen_q, seqlen_k, *, tile_m: int, tile_n: int, window: Window):
    """n_block_max: all ceil(seqlen_k / tile_n) blocks, or (a right edge: causal, window) those up
    to the right edge of the tile's last row. All consumers of a CTA walk the same blocks."""
    n_block_max = (seqlen_k + tile_n - 1) // tile_n
    if const_expr(window.right is not None):
        last_visible = _plus((m_block + 1) * tile_m + seqlen_k - seqlen_q, window.right)  # exclusive bound
        n_block_max = cutlass.min(n_block_max, cutlass.max((last_visible + tile_n - 1) // tile_n, 0))
    return n_block_max


def first_key_block(m_block, seqlen_q, seqlen_k, n_block_max, *, tile_m: int, tile_n: int, window: Window):
    """n_block_min: the block holding the first row's left edge (None without a left window: the
    walk starts at block 0), never past n_block_max."""
    if const_expr(window.left is None):
        return None
    first_visible = m_block * tile_m + seqlen_k - seqlen_q - window.left
    return cutlass.min(cutlass.max(first_visible, 0) // tile_n, n_block_max)


def num_unmasked_blocks(row0, seqlen_q, seqlen_k, *, tile_n: int, window: Window):
    """Key blocks [0, n) that no query row from row0 on masks on the right: blocks full of keys and
    left of row0's right edge. (Not clipped to the blocks a tile walks: the caller takes the min.)"""
    n_unmasked = seqlen_k // tile_n
    if const_expr(window.right is not None):
        edge = _plus(row0 + 1 + seqlen_k - seqlen_q, window.right)
        n_unmasked = cutlass.min(n_unmasked, cutlass.max(edge, 0) // tile_n)
    return n_unmasked


def num_masked_blocks(m_block, seqlen_q, seqlen_k, n_block_max, *, tile_m: int, tile_n: int, window: Window):
    """How many of the walked blocks (counted from the last) need a mask on the right: blocks
    [0, n_unmasked) are full and left of the right edge of the tile's first row."""
    n_unmasked = num_unmasked_blocks(m_block * tile_m, seqlen_q, seqlen_k, tile_n=tile_n, window=window)
    return n_block_max - cutlass.min(n_unmasked, n_block_max)


def num_left_masked_blocks(m_block, seqlen_q, seqlen_k, n_block_min, n_blocks, *, tile_m: int, tile_n: int,
                           window: Window):
    """How many of the walked blocks (counted from n_block_min, the last ones walked) cross the left
    edge of some row: those before the block of the tile's last row's left edge. 0 without a left
    window."""
    if const_expr(window.left is None):
        return 0
    last_row_edge = (m_block + 1) * tile_m - 1 + seqlen_k - seqlen_q - window.left
    n_left = (cutlass.max(last_row_edge, 0) + tile_n - 1) // tile_n - n_block_min
    return cutlass.min(cutlass.max(n_left, 0), n_blocks)


def hot_loop_end(n_blocks, n_masked, n_left):
    """Walk index where the unmasked blocks end: the first block is always masked (the walk's
    prologue), blocks before n_masked on the right, the last n_left (not those) on the left."""
    return cutlass.max(n_blocks - n_left, cutlass.max(n_masked, 1))


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
