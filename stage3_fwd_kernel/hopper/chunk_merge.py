"""A key split's merge inside the split launch: the last chunk of a tile to finish merges them all.

A split decode step was two kernels: the split launch leaves n parts per row (O over its chunk's own
row sums, and lse), and `split_combine.PartsCombine` merges them. Between the two sits a grid
boundary -- every CTA of the first kernel done and its stores flushed before the merge's wait
returns -- and the merge's own launch and tail: on an H200 a 1 x 16k step took 22.1 us where the
split launch alone took 18.2 (docs/measurements.md, 2026-12-01).

Here each consumer warpgroup, once its part is stored, counts itself on an int32 counter of its
rows -- one per (sequence, head, query tile, warpgroup) -- with an acq_rel atomic add. The
warpgroup that sees n - 1 arrivals before its own is the last: every other chunk's part is visible
to it (each released its stores with its add; the add it read from acquires them), so it merges
the rows right away, one warp per row (`split_combine.merge_row_into`, the merge kernel's arithmetic),
writes the merged out and lse, and sets the counter back to 0 for the next launch. The counters
stay zero between launches, so the host allocates them once per stream (split_combine.arrival_counters)
and no launch zeroes them; two launches on one stream never overlap (the next one's CTAs wait for
this grid at entry, griddepcontrol.wait).

The release covers the whole warpgroup's stores: every thread's O and lse stores come before a
128-thread barrier, and the barrier orders them before thread 0's add (PTX's release is cumulative).
On the acquiring side thread 0 reads the count, and the same barrier orders the other threads'
loads of the parts after it.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from stage3_fwd_kernel.hopper import barriers
from stage3_fwd_kernel.split_combine import merge_row_into


class ChunkMerge(NamedTuple):
    """The merged results and the counters of a key split that merges in the kernel."""

    out: Any          # (B, R, H', dv) merged O (rows by token: components.key_split.rows_by_token)
    lse: Any          # (B, H', R) fp32 merged lse (the same rows)
    arrivals: Any     # int32 (>= B H' M nc,), zero between launches: the chunks stored of each warpgroup's rows
    seen: Any         # smem int32 (nc,): the count thread 0 read, for its warpgroup
    num_splits: Any   # n
    num_heads: Any    # H' (the kernel's heads)
    num_m_blocks: Any  # M (query tiles a head)


@cute.jit
def merge_if_last(merge: ChunkMerge, parts_O: cute.Tensor, parts_lse: cute.Tensor, tile, wg: Int32, ctidx: Int32,
                  row0: Int32, rows: cute.Tensor, nc: cutlass.Constexpr[int], dtype: cutlass.Constexpr):
    """Called by consumer warpgroup wg (ctidx its thread) after its part of chunk (tile.batch_out) is
    stored: parts_O (B n, R, H', dv), parts_lse (B n, H', R); row0 its first row, `rows` its 64-row
    slab's row count (the tile's rows). Merges the warpgroup's rows of sequence tile.sequence if this
    chunk is the last of the n to arrive."""
    n = merge.num_splits
    slot = ((tile.sequence * merge.num_heads + tile.head) * merge.num_m_blocks + tile.m_block) * nc + wg
    barriers.sync_own(wg, nc)  # every thread's part stores before the release below
    if ctidx == 0:
        merge.seen[wg] = cute.arch.atomic_add(merge.arrivals.iterator + slot, Int32(1), sem="acq_rel", scope="gpu")
    barriers.sync_own(wg, nc)  # the count to every thread, and its acquire before their loads
    if merge.seen[wg] == n - 1:
        lane = ctidx % 32
        live = cutlass.min(tile.seqlen_q - row0, rows)
        for m in cutlass.range(ctidx // 32, live, 4, unroll=1):  # a warp a row
            merge_row_into(parts_lse[(None, tile.head, row0 + m)], parts_O[(None, row0 + m, tile.head, None)],
                           tile.sequence * n, n, lane, merge.out, merge.lse, tile.sequence, row0 + m, tile.head,
                           dtype)
        if ctidx == 0:
            merge.arrivals[slot] = Int32(0)  # for the next launch (which waits for this grid to finish)
