"""Tile schedulers: which (m_block, head, batch) tile a CTA computes, and the grid that launches them.

One protocol, used by every forward and backward kernel of stages 3-5:

* ``grid_shape(num_m_blocks, num_heads, batch[, max_ctas])`` -- host side, inside the ``@cute.jit``
  launcher (arguments may be dynamic ``Int32``);
* ``initial_work()`` / ``next_work(work)`` -- device side, the CTA's first and following `WorkTile`
  (``is_valid`` False when the CTA is done);
* ``persistent`` -- a compile-time flag: False lets a kernel unroll its work loop to a single `if`;
* ``tile_at(linear, M, H, B)`` -- the order's linear-th tile, for persistent grids that walk it.

`StaticTileScheduler` launches one CTA per tile; `PersistentScheduler` keeps one CTA per SM
walking any order. Stage 5 supplies LPT / varlen orders with the same methods.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32


class WorkTile(NamedTuple):
    m_block: Any  # Int32: which tile of `tile_m` query rows
    head: Any     # Int32: query head
    batch: Any    # Int32
    is_valid: Any  # Boolean / bool: False when a persistent scheduler has run out of work


class StaticTileScheduler:
    """One CTA per (m_block, head, batch) tile: grid = (ceil(seqlen_q / tile_m), heads, batch).

    The interface every scheduler implements (stage 5 adds LPT / varlen ones):
      * ``grid_shape(num_m_blocks, num_heads, batch)`` -- host side, inside the ``@cute.jit``
        launcher (arguments may be dynamic ``Int32``);
      * ``initial_work()`` -- device side, the first ``WorkTile`` of this CTA;
      * ``next_work(work)`` -- device side, the following one (``is_valid`` False when done).
    A static scheduler hands each CTA exactly one tile, so ``next_work`` always ends the loop;
    a kernel written as ``work = initial_work(); while work.is_valid: ...; work = next_work(work)``
    therefore runs unchanged under a persistent scheduler.
    """

    persistent = False  # compile-time: kernels may unroll the work loop to a single `if`

    @staticmethod
    def grid_shape(num_m_blocks, num_heads, batch):
        return (num_m_blocks, num_heads, batch)

    @staticmethod
    def initial_work() -> WorkTile:
        bx, by, bz = cute.arch.block_idx()
        return WorkTile(Int32(bx), Int32(by), Int32(bz), True)

    @staticmethod
    def next_work(work: WorkTile) -> WorkTile:
        return WorkTile(work.m_block, work.head, work.batch, False)

    @staticmethod
    def tile_at(linear, num_m_blocks, num_heads, batch):
        """(m_block, head, batch) of the linear-th tile in this grid's dispatch order (x fastest),
        for a persistent loop that walks the same order (`PersistentScheduler`)."""
        m_block = linear % num_m_blocks
        rest = linear // num_m_blocks
        return m_block, rest % num_heads, rest // num_heads


@dataclass(frozen=True)
class PersistentScheduler:
    """A persistent grid over any tile order that has ``tile_at(linear, M, H, B)``: ``num_ctas``
    CTAs (None: one per SM of the launching device, passed at launch, so one compiled kernel serves
    every GPU), CTA c computes the tiles c, c + num_ctas, c + 2 num_ctas, ... of the order.

    Compared with one CTA per tile it saves what every CTA pays once -- launch, barrier set-up,
    the first Q and K loads before any MMA, the last P V and the O store after the last one --
    because the producer loads tile t+1's Q and K/V while the consumers finish tile t. The
    kernel carries the pipeline state across tiles (``persistent`` is what it checks).

    dynamic=True: CTA c starts with tile c, and each next tile is num_ctas + the value a global
    counter held before the CTA's producer added 1 to it (one int32, zeroed per launch), so
    whichever CTA frees first takes the next tile of the order, as the hardware does for a grid of
    one CTA per tile. Needed when tiles differ in length (causal, varlen): with the fixed striding
    a CTA that drew long tiles finishes late.
    """

    # frozen dataclass, as stage 5's schedulers: equal configurations compare and hash equal, so
    # the compile caches keyed on the scheduler build one kernel per configuration
    order: Any = StaticTileScheduler
    num_ctas: Optional[int] = None
    dynamic: bool = False

    persistent: ClassVar[bool] = True

    def __post_init__(self):
        order, num_ctas = self.order, self.num_ctas
        if not callable(getattr(order, "tile_at", None)):
            raise TypeError(f"order: expected a tile order with tile_at(linear, M, H, B), got {order!r}")
        if getattr(order, "persistent", False):
            raise TypeError("order: expected a one-tile-per-CTA order, got a persistent scheduler")
        if num_ctas is not None and (isinstance(num_ctas, bool) or not isinstance(num_ctas, int) or num_ctas < 1):
            raise ValueError(f"num_ctas: expected None or an int >= 1, got {num_ctas!r}")
        if not isinstance(self.dynamic, bool):
            raise TypeError(f"dynamic: expected a bool, got {type(self.dynamic).__name__}")

    def grid_shape(self, num_m_blocks, num_heads, batch, max_ctas):
        """max_ctas: the launch's CTA count (num_ctas, or the device's SMs when num_ctas is None)."""
        return (cutlass.min(num_m_blocks * num_heads * batch, max_ctas), 1, 1)

    def launch_ctas(self, device) -> int:
        return self.num_ctas if self.num_ctas is not None else sm_count(device)

    def tile_at(self, linear, num_m_blocks, num_heads, batch):
        return self.order.tile_at(linear, num_m_blocks, num_heads, batch)


def check_grid(scheduler, num_m_blocks: int, heads: int, batch: int):
    """A tile order's own host-side limit on the grid (stage 5's flat LPT map), if it has one (a
    persistent scheduler passes its order's)."""
    check = getattr(getattr(scheduler, "order", scheduler), "check_grid", None)
    if check is not None:
        check(num_m_blocks, heads, batch)


def sm_count(device=None) -> int:
    """Streaming multiprocessors of a CUDA device (the persistent grid's width)."""
    import torch

    index = torch.device(device).index if device is not None else None
    return _sm_count(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count
