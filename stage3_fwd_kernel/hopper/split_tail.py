"""The split tail: the last partial wave of a persistent launch cut along the keys.

A persistent CTA walks tiles c, c + P, ... of P CTAs, so T equal tiles take ceil(T / P)
tile-times however few tiles the last wave holds. At d = 128 with 32k tokens per batch and 16
heads, T = 4096 tiles on 132 SMs are 31 full waves and 4 tiles: the 32nd wave runs 4 CTAs while 128
idle, about 3% of the call. Split, the last R = T mod P tiles become R * S key chunks (S = P // R,
at most the tile's key blocks): one wave in which every CTA walks nb / S blocks. Each chunk leaves
O (divided by its own row sums) and lse in an fp32 workspace, and one small kernel
(`split_combine`) merges them, O = sum_j exp(lse_j - lse) O_j with lse = log sum_j exp(lse_j).
The full waves keep their bits; the tail's rows change by the order of additions (within the
FA4 tolerance rule). Only non-causal dense calls on the static persistent order split (every tile
walks the same keys, and the chunks are work items after its full waves).
measured: docs/measurements.md
"""
from __future__ import annotations

from stage3_fwd_kernel.tile_scheduler import StaticTileScheduler

# split by default from this many key blocks a tile on (4k keys at tile_n = 128): a chunk of a
# shorter tile saves less than the combine costs
SPLIT_TAIL_MIN_KEY_BLOCKS = 64

SPLIT_TAIL_UNSUPPORTED = ("split_tail: needs a non-causal dense call on the static persistent order "
                          "(persistent, no custom scheduler)")


def split_tail_supported(scheduler, causal) -> bool:
    """Whether a build can split its tail: the static persistent order, non-causal."""
    return (getattr(scheduler, "persistent", False) and not getattr(scheduler, "dynamic", False)
            and getattr(scheduler, "order", None) is StaticTileScheduler and not causal)


def split_tail_plan(split_tail, scheduler, causal, batch, seqlen_q, heads, seqlen_k, tile_m, tile_n,
                    ctas) -> tuple[int, int] | None:
    """(tail tiles R, chunks per tile S) when a call's last partial wave is split along the keys,
    else None. Only calls whose query tiles are all full (seqlen_q % tile_m == 0) split.
    split_tail: None = when the tiles have >= SPLIT_TAIL_MIN_KEY_BLOCKS key blocks, True = whenever
    there is a partial wave, False = never."""
    if split_tail is not None and not isinstance(split_tail, bool):
        raise TypeError(f"split_tail: expected None or a bool, got {type(split_tail).__name__}")
    eligible = split_tail_supported(scheduler, causal)
    if split_tail and not eligible:
        raise ValueError(SPLIT_TAIL_UNSUPPORTED)
    if split_tail is False or not eligible or seqlen_q % tile_m:
        return None
    key_blocks = -(-seqlen_k // tile_n)
    if split_tail is None and key_blocks < SPLIT_TAIL_MIN_KEY_BLOCKS:
        return None
    tiles = seqlen_q // tile_m * heads * batch
    tail = tiles % ctas
    if tiles <= ctas or tail == 0:
        return None
    chunks = min(ctas // tail, key_blocks)
    return (tail, chunks) if chunks >= 2 else None


def split_tail_combine(split, tail: int, chunks: int, out, lse, num_m_blocks: int):
    """Merge the key chunks of the last R tiles into out and lse (split_combine: one small kernel
    on the same stream)."""
    from stage3_fwd_kernel import split_combine

    b, _, heads, _ = out.shape
    split_combine.combine(split, chunks, out, lse, num_m_blocks * heads * b, num_m_blocks)
