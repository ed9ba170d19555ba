"""Where a CTA works: its K/V tile, the sequence bounds, and the Q tiles it walks.

A CTA owns K/V tile n_block of one (kv head, batch) and walks, for each query head of the group, the
Q tiles [m_block_min, m_block_max) that see those keys (``schedule.m_block_range``; causal skips the
tiles above the diagonal, a K/V tile past seqused_k walks none). Varlen is a batch of one whose rows
come from cu_seqlens (offset_q / offset_k into the packed tensors).

A rotated walk (``options.rotate_walk``) visits the same tiles starting at m_block_min + m_rot and
wrapping at m_block_max, with m_rot = n_block x (Q tiles) / (K/V tiles): the K/V tiles of one head
start spread over its Q tiles instead of all at the first, so they reach each dQ tile one after
another, as causal walks do, rather than together. Every role maps a walk position to its Q tile
with ``m_at``; the tile counter t (ring stages, dS^T / dQ buffers) counts positions.
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from stage4_bwd_kernel import schedule


class SeqBounds(NamedTuple):
    """This CTA's tile and its sequence (traced Int32 values)."""
    n_block: Int32         # K/V tile
    head_kv: Int32
    batch: Int32           # sequence index (varlen: into cu_seqlens)
    bidx: Int32            # batch index of the tensors (varlen: 0)
    offset_q: Int32        # first row of the sequence in the packed tensors (dense: 0)
    offset_k: Int32
    seqlen_q: Int32
    seqlen_k_rows: Int32   # key rows of the sequence
    seqlen_k: Int32        # keys attended to (seqused_k, else seqlen_k_rows)


class Walk(NamedTuple):
    """SeqBounds + the Q tiles of the walk, shared by every role of the CTA."""
    seqlen_q: Int32
    seqlen_k: Int32
    seqlen_k_rows: Int32
    offset_q: Int32
    offset_k: Int32
    bidx: Int32
    batch: Int32
    head_kv: Int32
    n_block: Int32
    m_block_min: Int32
    m_block_max: Int32
    qhead_per_kvhead: Int32
    m_rot: Int32 = 0       # rotate_walk: the first Q tile is m_block_min + m_rot (0: in order)


class WalkPlan:
    """Walk methods of the kernel class (they read tile_m, tile_n, causal, varlen, dq_order)."""

    q_shift = False  # the Hopper kernel sets its options (kernel.py); the Blackwell kernels have none
    rotate_walk = False

    @cute.jit
    def tile_bounds(self, num_n_blocks: Int32, total_q: Int32, total_k: Int32, mCuSeqlensQ: cute.Tensor,
                    mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor):
        """This CTA's (n_block, kv head, batch) from the launch order, and its sequence bounds."""
        if const_expr(hasattr(self.dq_order, "tile_for_launch")):
            # an order that also swizzles heads (stage 5's SPT) maps the whole launch index
            n_block, head_kv, batch = self.dq_order.tile_for_launch()
        else:
            bx, head_kv, batch = cute.arch.block_idx()
            n_block = self.dq_order.n_block_for_launch(bx, num_n_blocks)
        return self.sequence_bounds(n_block, head_kv, batch, total_q, total_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)

    @cute.jit
    def sequence_bounds(self, n_block: Int32, head_kv: Int32, batch: Int32, total_q: Int32, total_k: Int32,
                        mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor):
        """SeqBounds of K/V tile n_block of (kv head, batch); with q_shift, the padding rows come first
        (kernel.py's docstring)."""
        bidx = batch
        offset_q = Int32(0)
        offset_k = Int32(0)
        seqlen_q = total_q
        seqlen_k_rows = total_k
        if const_expr(self.varlen):
            bidx = 0
            offset_q = mCuSeqlensQ[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
            offset_k = mCuSeqlensK[batch]
            seqlen_k_rows = mCuSeqlensK[batch + 1] - offset_k
        seqlen_k = seqlen_k_rows
        if const_expr(self.has_seqused_k):
            seqlen_k = cutlass.min(mSeqUsedK[batch], seqlen_k_rows)
        if const_expr(self.q_shift):
            pad = self.top_padding(seqlen_q)
            offset_q, seqlen_q = offset_q - pad, seqlen_q + pad
        return SeqBounds(n_block, head_kv, batch, bidx, offset_q, offset_k, seqlen_q, seqlen_k_rows, seqlen_k)

    @cute.jit
    def make_walk(self, b, qhead_per_kvhead: Int32):
        """The bounds + the Q tiles [m_block_min, m_block_max) this K/V tile adds into (empty for a
        tile past seqused_k)."""
        m_block_min, m_block_max = schedule.m_block_range(b.n_block, self.tile_m, self.tile_n, b.seqlen_q,
                                                          b.seqlen_k, self.causal, imax=cutlass.max,
                                                          window=self.window_or_none, imin=cutlass.min)
        m_block_min = Int32(m_block_min)
        if b.n_block * self.tile_n >= b.seqlen_k:
            m_block_max = m_block_min
        m_rot = 0
        if const_expr(self.rotate_walk):
            m_rot = schedule.walk_rotation(b.n_block, self.tile_n, b.seqlen_k, m_block_min, m_block_max,
                                           imax=cutlass.max)
        return Walk(b.seqlen_q, b.seqlen_k, b.seqlen_k_rows, b.offset_q, b.offset_k, b.bidx, b.batch, b.head_kv,
                    b.n_block, m_block_min, m_block_max, qhead_per_kvhead, m_rot)

    @cute.jit
    def m_at(self, walk, m_pos: Int32) -> Int32:
        """The Q tile at walk position m_pos - m_block_min (schedule.rotated_m, with a traced branch)."""
        if const_expr(not self.rotate_walk):
            return m_pos
        m_block = m_pos + walk.m_rot
        if m_block >= walk.m_block_max:
            m_block = m_block - (walk.m_block_max - walk.m_block_min)
        return m_block
