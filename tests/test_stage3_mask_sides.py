"""Which edges the Hopper forward's masked blocks test, and the block halves it skips, on the CPU.

The walk (hopper/mainloop.py) masks its first block and the blocks before `num_masked_blocks` with
`AttentionMask.right_blocks_side()` -- the right edge and the sequence's end alone where the left
window reaches tile_m + tile_n keys, else both edges --, the blocks from `hot_loop_end` on with the
left edge alone, and the rest not at all. A consumer warpgroup computes half a masked block where
`right_half_hidden` / `left_half_hidden` say its rows see none of the other half. Here every
(row, key) a walk covers is checked against the visibility rule of stage 0 (components.window), on
Python integers through the same functions the kernel traces.
"""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from stage3_fwd_kernel.components.block_range import (first_key_block, hot_loop_end, num_key_blocks,
                                                      num_left_masked_blocks, num_masked_blocks)
from stage3_fwd_kernel.components.mask import BOTH, LEFT, RIGHT, AttentionMask
from stage3_fwd_kernel.components.window import Window

pytestmark = [pytest.mark.cpu, pytest.mark.stage3]


def visible(rows, keys, sq, sk, window):
    """(rows, keys) Boolean array: query row sees key (stage 0's rule)."""
    off = sk - sq
    r, k = rows[:, None], keys[None, :]
    seen = np.broadcast_to((k >= 0) & (k < sk), (len(rows), len(keys))).copy()
    if window.left is not None:
        seen &= k >= r + off - window.left
    if window.right is not None:
        seen &= k <= r + off + window.right
    return seen


def kernel_hides(mask, side, rows, block, sq, sk):
    """(rows, tile_n) Boolean array: the kernel's mask with `side` sets (row, block's column) to -inf."""
    cols = np.arange(mask.tile_n)[None, :]
    hides = np.zeros((len(rows), mask.tile_n), dtype=bool)
    if side is None:
        return hides
    if side in (RIGHT, BOTH) or mask.window.left is None:
        limits = np.array([int(mask.key_limit(int(r), block, sq, sk)) for r in rows])
        hides |= cols >= limits[:, None]
    if side in (LEFT, BOTH) and mask.window.left is not None:
        starts = np.array([int(mask.key_start(int(r), block, sq, sk)) for r in rows])
        hides |= cols < starts[:, None]
    return hides


def walk(sq, sk, window, tile_m, tile_n, wg_m=64):
    """Yield (mask, rows of a consumer, block, side, the half S skips or None, the half P V skips or None)
    for every block a consumer walks."""
    mask = AttentionMask(window, tile_n, tile_m=tile_m)
    for m_block in range(math.ceil(sq / tile_m)):
        n_max = int(num_key_blocks(m_block, sq, sk, tile_m=tile_m, tile_n=tile_n, window=window))
        n_min = first_key_block(m_block, sq, sk, n_max, tile_m=tile_m, tile_n=tile_n, window=window)
        n_min = 0 if n_min is None else int(n_min)
        n_blocks = n_max - n_min
        if n_blocks <= 0:
            continue
        n_masked = int(num_masked_blocks(m_block, sq, sk, n_max, tile_m=tile_m, tile_n=tile_n, window=window))
        n_left = int(num_left_masked_blocks(m_block, sq, sk, n_min, n_blocks, tile_m=tile_m, tile_n=tile_n,
                                            window=window))
        hot_end = int(hot_loop_end(n_blocks, n_masked, n_left)) if window.left is not None else n_blocks
        for row0 in range(m_block * tile_m, (m_block + 1) * tile_m, wg_m):
            rows = range(row0, min(row0 + wg_m, sq))
            for i in range(n_blocks):
                block = n_max - 1 - i
                side, hidden = None, None
                if i == 0 or i < n_masked:
                    side = mask.right_blocks_side()
                    hidden = 1 if mask.right_half_hidden(row0 + wg_m - 1, block, sq, sk) else None
                elif i >= hot_end:
                    side = LEFT
                    hidden = 0 if mask.left_half_hidden(row0, block, sq, sk) else None
                # the drain's last P V asks the left rule of the last block walked, whatever its side
                pv_hidden = None
                if i == n_blocks - 1 and window.left is not None:
                    pv_hidden = 0 if mask.left_half_hidden(row0, block, sq, sk) else None
                yield mask, rows, block, side, hidden, pv_hidden


def check_walk(sq, sk, window, tile_m, tile_n):
    halves = 0
    for mask, rows, block, side, hidden, pv_hidden in walk(sq, sk, window, tile_m, tile_n):
        rows = np.arange(rows.start, rows.stop)
        seen = visible(rows, block * tile_n + np.arange(tile_n), sq, sk, window)
        wrong = np.argwhere(seen == kernel_hides(mask, side, rows, block, sq, sk))
        assert wrong.size == 0, (f"row {rows[wrong[0][0]]} key {block * tile_n + wrong[0][1]}: side {side} "
                                 f"({sq}x{sk}, {window}, {tile_m}x{tile_n})")
        for skipped in {hidden, pv_hidden} - {None}:
            half = seen[:, tile_n // 2:] if skipped == 1 else seen[:, :tile_n // 2]
            assert not half.any(), f"rows {rows[0]}.. see keys of the hidden half {skipped} of block {block}"
        halves += hidden is not None
    return halves


@pytest.mark.parametrize("tile_m,tile_n", [(128, 128), (192, 128), (128, 64), (64, 128)])
def test_walk_masks_exactly_the_hidden_keys(tile_m, tile_n):
    rng = random.Random(tile_m * 1000 + tile_n)
    shapes = [(1, 1), (3, 3), (64, 1), (239, 1), (799, 3), (113, 203), (255, 256), (1023, 1024), (1024, 1024),
              (700, 1500)]
    windows = [Window(None, 0), Window(1024, 0), Window(tile_m + tile_n, 0), Window(tile_m + tile_n - 1, 0),
               Window(300, None), Window(64, 32), Window(0, 0), Window(400, 700), Window(None, 100)]
    halves = 0
    for sq, sk in shapes:
        for window in windows + [Window(rng.randrange(0, 600), rng.choice([None, 0, rng.randrange(0, 300)]))]:
            halves += check_walk(sq, sk, window, tile_m, tile_n)
    assert halves > 0  # the skipped halves were exercised


def test_sides_apart_only_for_wide_left_windows():
    assert AttentionMask(Window(1024, 0), 128, tile_m=128).right_blocks_side() == RIGHT
    assert AttentionMask(Window(256, 0), 128, tile_m=128).right_blocks_side() == RIGHT
    assert AttentionMask(Window(255, 0), 128, tile_m=128).right_blocks_side() == BOTH
    assert AttentionMask(Window(1024, 0), 128).right_blocks_side() == BOTH   # tile_m unknown
    assert AttentionMask(Window(None, 0), 128, tile_m=128).right_blocks_side() == BOTH  # no left edge: right only


def test_causal_diagonal_hides_half_a_block_from_the_first_warpgroup():
    # 128 x 128 causal tiles on an aligned sequence: rows 0-63 see keys 0-63 of their diagonal block
    hidden = [(rows[0], block, h) for _, rows, block, _, h, _ in walk(512, 512, Window(None, 0), 128, 128)
              if h is not None]
    assert hidden == [(r, r // 128, 1) for r in range(0, 512, 128)]
