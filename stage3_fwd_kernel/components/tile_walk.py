"""The tile-scheduler protocol of a kernel, in one place.

A tile order maps a linear index to (m_block, head, batch) with `tile_at(linear, M, H, B)`, and
may check its grid on the host with `check_grid(M, H, B)`. `tile_scheduler.StaticTileScheduler`
is the hardware's dispatch order; stage 5 passes its LPT orders through the same hook (causal
tiles longest first, heads walked in sections that fit in L2, varlen sequences reordered through
`batch_map`), so this stage never imports stage 5. A kernel runs an order in one of two ways:

* one CTA per tile: `scheduler.grid_shape(M, H, B)` is the grid, `scheduler.initial_work()` the
  CTA's tile;
* persistent (`tile_scheduler.PersistentScheduler`): one CTA per SM walks work items c, c + P,
  c + 2P, ... of the order (static striding), or -- dynamic -- takes each next one from an atomic
  counter, so whichever CTA frees first takes the next tile (tiles of different lengths: causal,
  varlen). Every CTA pays its launch, barrier set-up, first loads and last store once per SM
  instead of once per tile.

With the split tail, the work items are the tiles before the last partial wave, then S key chunks
of each of its R tiles (see `hopper.split_tail`). `TileWalk` answers, for work item `linear`:
which tile, which key blocks, which chunk.
measured: docs/measurements.md
"""
from __future__ import annotations

from typing import Any, NamedTuple

import cutlass.cute as cute
from cutlass import Int32, const_expr

from stage3_fwd_kernel.components.block_range import chunk_block_range


class TileSpace(NamedTuple):
    """The extent of a persistent launch's tile order and its run-time helpers."""

    num_m_blocks: Any   # Int32: query tiles per head
    num_heads: Any      # Int32
    num_batch: Any      # Int32
    tile_counter: Any   # int32 (1,), zeroed per launch: the dynamic hand-out's counter, or None
    split: Any          # fp32 split-tail workspace (R * S, tile_m, dv + 1), or None
    split_chunks: Any   # Int32: S, key chunks per tail tile

    def num_tiles(self):
        return self.num_m_blocks * self.num_heads * self.num_batch


class WorkItem(NamedTuple):
    """One unit of a persistent walk: a tile, its key blocks [n_block_min, n_block_max) and its
    split-tail chunk. Without a split tail n_block_min and chunk are None (the whole tile)."""

    tile: Any
    n_block_min: Any
    n_block_max: Any
    chunk: Any


class TileWalk:
    """Work items of a persistent CTA. `locate(m_block, head, batch) -> tile` and
    `key_range(tile) -> (n_block_min or None, n_block_max)` come from the kernel (they know the
    sequences and the window)."""

    def __init__(self, scheduler, *, dynamic: bool, split_tail: bool, locate, key_range):
        self.scheduler = scheduler
        self.dynamic = dynamic
        self.split_tail = split_tail
        self.locate = locate
        self.key_range = key_range

    def first_linear(self) -> Int32:
        """A walker's first work item: its CTA index."""
        return Int32(cute.arch.block_idx()[0])

    def num_walkers(self) -> Int32:
        """The static striding: CTAs of the persistent grid."""
        return cute.arch.grid_dim()[0]

    def tile_at(self, linear: Int32, space: TileSpace):
        """The located tile `linear` of the order."""
        m_block, head, batch = self.scheduler.tile_at(linear, space.num_m_blocks, space.num_heads, space.num_batch)
        return self.locate(m_block, head, batch)

    def num_items(self, space: TileSpace) -> Int32:
        """Work items: the tiles, or (split tail) the tiles before the last partial wave and
        split_chunks key chunks of each tile in it."""
        total = space.num_tiles()
        if const_expr(self.split_tail):
            split_tiles = space.split.shape[0] // space.split_chunks
            total = total - split_tiles + space.split.shape[0]
        return total

    @cute.jit
    def item_at(self, linear: Int32, space: TileSpace) -> WorkItem:
        """Work item `linear`. Past the full waves (split tail), chunk c = j + S r is keys
        [j nb / S, (j+1) nb / S) of tail tile r; before them the whole tile, chunk -1."""
        if const_expr(not self.split_tail):
            t = self.tile_at(linear, space)
            n_block_min, n_block_max = self.key_range(t)
            return WorkItem(t, n_block_min, n_block_max, None)
        chunks = space.split_chunks
        tail_start = space.num_tiles() - space.split.shape[0] // chunks
        tile_linear = linear
        chunk = Int32(-1)
        if linear >= tail_start:
            chunk = linear - tail_start
            tile_linear = tail_start + chunk // chunks
        t = self.tile_at(tile_linear, space)
        n_block_min, n_block_max = chunk_block_range(chunk, chunks, self.key_range(t)[1])  # no window here
        return WorkItem(t, n_block_min, n_block_max, chunk)

    @cute.jit
    def next_linear(self, linear: Int32, space: TileSpace) -> Int32:
        """(one warp) the item after `linear`: num_walkers further (static), or -- dynamic -- the
        grid width + the count of items other CTAs have taken beyond their first (one atomic by
        lane 0, broadcast to the warp)."""
        nxt = linear + self.num_walkers()
        if const_expr(self.dynamic):
            nxt = next_from_counter(space.tile_counter)
        return nxt


@cute.jit
def next_from_counter(tile_counter: cute.Tensor) -> Int32:
    """(one warp) a dynamic hand-out's next work item: the grid width + the count of items other CTAs
    have taken beyond their first (one atomic add on the zeroed int32 at tile_counter's start, by lane
    0, broadcast to the warp). The persistent Hopper backward takes its K/V tiles the same way."""
    taken = Int32(0)
    if cute.arch.lane_idx() == 0:
        taken = cute.arch.atomic_add(tile_counter.iterator, Int32(1), sem="relaxed", scope="gpu")
    return cute.arch.grid_dim()[0] + cute.arch.shuffle_sync(taken, 0)
