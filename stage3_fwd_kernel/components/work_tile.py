"""The work tile and the sequence information that locates it.

A tile scheduler names a tile as (m_block, head, batch) of its launch order. Before loading
anything a CTA turns that into the rows it reads: which KV head (GQA), which batch slot of the
tensors, where the sequence starts in packed (varlen) tensors and how long it is. `locate_tile`
does this once per tile; everything downstream reads the named fields of `AttentionTile`.

`AttentionTile` is a NamedTuple: CuTe-DSL passes it through `@cute.jit` calls and dynamic `if`
bodies like any tuple, and a loop that needs one builds it inside its body, so no tile crosses a
loop boundary as a carried value.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from cutlass import Int32, const_expr

from stage3_fwd_kernel import intdiv
from stage3_fwd_kernel.components.key_split import chunk_of
from stage3_fwd_kernel.host_io import top_padding


class AttentionTile(NamedTuple):
    """One query tile of one head, with the rows it reads (all Int32 on the device)."""

    m_block: Any    # which tile of tile_m query rows (counted from the padded top with q_shift)
    head: Any       # query head
    head_kv: Any    # its K/V head: head // (query heads per KV head)
    batch: Any      # batch index into the tensors (0 for varlen: packed tensors are a batch of one)
    offset_q: Any   # first query row of the sequence in the tensor (negative with q_shift padding)
    offset_k: Any   # first key row of the sequence in the tensor
    seqlen_q: Any   # query rows of the sequence (+ the q_shift padding rows)
    seqlen_k: Any   # keys the sequence attends to (seqused_k when given)
    sequence: Any   # which sequence (after batch_map): the row of a paged cache's page table
    batch_kv: Any   # batch index into K / V (= batch, except under a key split: components.key_split)
    batch_out: Any  # batch index into O / lse (= batch, except under a key split: the virtual sequence)


class SequenceInfo(NamedTuple):
    """What a kernel knows about the batch's sequences: dense extents, or varlen index tensors.
    The optional tensors are None when the kernel is built without them (compile-time)."""

    seqlen_q: Any           # Int32: the dense query length (varlen: unused)
    seqlen_k: Any           # Int32: the dense key length (varlen: unused)
    qhead_per_kvhead: Any   # Int32: query heads per KV head (GQA group)
    cu_seqlens_q: Any       # int32 (batch + 1,) or None
    cu_seqlens_k: Any       # int32 (batch + 1,) or None
    seqused_k: Any          # int32 (batch,) or None: keys actually used per sequence
    batch_map: Any          # int32 (batch,) or None: the sequence each virtual batch index computes
    key_split: Any = None   # components.key_split.KeySplit or None: batch indexes (sequence, key chunk)

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None


def locate_tile(seq: SequenceInfo, m_block, head, batch, q_shift_tile_m=None) -> AttentionTile:
    """The scheduler's (m_block, head, virtual batch) -> AttentionTile.

    batch_map (stage 5's reordering, longest sequence first) says which sequence a virtual batch
    index computes. Varlen: the sequence starts at row cu_seqlens[b] of the packed tensors and has
    cu_seqlens[b + 1] - cu_seqlens[b] rows (keys: seqused_k[b] when given).

    q_shift (q_shift_tile_m, causal dense calls on 192-row tiles): count the Q tiles from the
    sequence's end. A 192-row tile rarely divides the sequence (4096 = 21 x 192 + 64), and the
    partial tile, last when counted from row 0, is the one that sees every key block. top_padding
    virtual rows (128 at 4096) go before query 0, so the partial tile is the first and sees one key
    block: 363 instead of 384 tile-block steps per 4k head at tile_n = 128. The causal diagonal
    depends only on seqlen_k - seqlen_q, which the padding leaves alone; padded rows load as zeros
    (TMA fills rows before the tensor's start) and are never stored.
    measured: docs/measurements.md"""
    seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
    if const_expr(seq.key_split is not None):  # dense q, one chunk of sequence b's keys
        c = chunk_of(seq.key_split, batch, seqlen_k, seq.seqused_k)
        return AttentionTile(m_block, head, intdiv.fast_div(head, seq.qhead_per_kvhead), c.sequence, Int32(0),
                             c.first_key, seqlen_q, c.keys_to_end, c.sequence, c.batch_kv, batch)
    if const_expr(seq.batch_map is not None):
        batch = seq.batch_map[batch]
    offset_q, offset_k, batch_t = Int32(0), Int32(0), batch
    if const_expr(seq.varlen):
        offset_q, offset_k, batch_t = seq.cu_seqlens_q[batch], seq.cu_seqlens_k[batch], Int32(0)
        seqlen_q = seq.cu_seqlens_q[batch + 1] - offset_q
        if const_expr(seq.seqused_k is not None):
            seqlen_k = seq.seqused_k[batch]
        else:
            seqlen_k = seq.cu_seqlens_k[batch + 1] - offset_k
    if const_expr(q_shift_tile_m is not None):
        pad = top_padding(seqlen_q, q_shift_tile_m)
        offset_q, seqlen_q = offset_q - pad, seqlen_q + pad
    # fast_div, not `//`: a signed software division is ~40 dependent instructions on every CTA's
    # way to its first K load
    head_kv = intdiv.fast_div(head, seq.qhead_per_kvhead)
    return AttentionTile(m_block, head, head_kv, batch_t, offset_q, offset_k, seqlen_q, seqlen_k, batch, batch_t,
                         batch_t)


def empty_tile() -> AttentionTile:
    """A tile of zeros: the dynamic scheduler's end-of-work marker rides on a real Q load of it."""
    zero = Int32(0)
    return AttentionTile(zero, zero, zero, zero, zero, zero, zero, zero, zero, zero, zero)
