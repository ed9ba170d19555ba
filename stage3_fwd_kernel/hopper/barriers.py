"""Named barriers of the Hopper forward (16 per CTA; id 0 is sync_threads).

The consumer warpgroups take turns on the tensor cores (ping-pong): consumer w issues its GEMMs
once barrier `turn(w)` completes and hands the turn on by arriving at `next_turn(w)`. The turn
goes round robin 0 -> 1 -> .. -> nc-1 -> 0, so each turn barrier joins exactly two warpgroups
(TURN_THREADS). `own(w)` is warpgroup w's private 128-thread barrier (O staging, V zeroing).
With nc <= 3 consumers the ids run 1..2 nc <= 6.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

TURN_THREADS = 2 * 128
WARPGROUP_THREADS = 128


def turn(wg: Int32):
    """Consumer wg may use the tensor cores."""
    return 1 + wg


def next_turn(wg: Int32, nc: int):
    """The turn barrier of consumer wg's successor."""
    if const_expr(nc == 2):
        return 2 - wg
    return 1 + (wg + 1) % nc


def own(wg: Int32, nc: int):
    """Consumer wg's own 128-thread barrier."""
    return 1 + nc + wg


@cute.jit
def take_turn(turn_id, nc: cutlass.Constexpr[int]):
    """Wait for this consumer's tensor-core turn (`turn`); a lone consumer (64-row tiles) has no turn."""
    if const_expr(nc > 1):
        cute.arch.barrier(barrier_id=turn_id, number_of_threads=TURN_THREADS)


@cute.jit
def hand_turn(successor_id, nc: cutlass.Constexpr[int]):
    """Give the turn to the successor (`next_turn`); nothing to hand on for a lone consumer."""
    if const_expr(nc > 1):
        cute.arch.barrier_arrive(barrier_id=successor_id, number_of_threads=TURN_THREADS)


@cute.jit
def pass_turn(wg: Int32, nc: cutlass.Constexpr[int], first: cutlass.Constexpr[bool]):
    """The tensor-core turn around the CTA's whole life: before the first tile the last consumer
    hands consumer 0 the first turn; after the last, consumer 0 takes the last hand-over so that no
    arrival outlives the CTA."""
    if const_expr(first):
        if wg == nc - 1:
            hand_turn(turn(0), nc)
    else:
        if wg == 0:
            take_turn(turn(0), nc)


@cute.jit
def sync_own(wg: Int32, nc: cutlass.Constexpr[int]):
    """Consumer wg's 128 threads only (the producer warpgroup may have exited already)."""
    cute.arch.barrier(barrier_id=own(wg, nc), number_of_threads=WARPGROUP_THREADS)
