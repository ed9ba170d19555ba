"""Split-KV: a decode call's keys cut into chunks, each chunk the work of its own CTAs.

One query token against a long cache is one tile per KV head: at batch 1 with 8 KV heads, 8 CTAs
stream the whole cache while the other 124 SMs of an H200 idle. Split n ways, the launch's batch
mode counts B x n virtual sequences, v = b n + j, and the CTAs of v

  - read sequence b's query rows (q keeps its B batch rows: nothing is replicated),
  - read keys [j c, j c + c) of sequence b's cache, c keys a chunk (a multiple of the key tile),
    of which the first clamp(L_b - j c, 0, c) are used (L_b = seqused_k[b], else the cache length),
    the mask seeing L_b - j c keys from the chunk's start to the sequence's end, so a causal
    diagonal (bottom-right, at the sequence's end) falls where it does in the whole sequence,
  - write O, divided by the chunk's own row sums, and its lse to batch row v of the parts.

A merge (stage3_fwd_kernel.split_combine) then forms O = sum_j exp(lse_j - lse) O_j with
lse = log sum_j exp(lse_j). The chunk's bounds are arithmetic on (v, n, c, L_b) inside the kernel,
so a decode step needs no per-call index tensors and no copy of the queries: on an H200 those were
three of a 1 x 16k step's five kernels (docs/measurements.md).

Causal splits this way: every chunk but the last few is wholly left of the diagonal and unmasked,
and a speculative-decoding step (a few query tokens at the cache's end) splits like one token. A
window splits the same way: its edges, too, are measured from the sequence's end, so each chunk's
walk (components.block_range, from keys_to_end) starts at the block of its rows' left edge, and a
chunk wholly left of the window walks nothing. So that the chunks hold the window rather than the
whole cache, `range_keys` W cuts the keys read: T query tokens with a left edge `left` see the last
W = left + T keys of their sequence, and the chunks start at key s_b = max(L_b - W, 0) instead of 0
(chunk j: keys [s_b + j c, s_b + j c + c)). One token's window is then all of the range and needs no
mask at all. s_b need not be a multiple of the key tile in a dense cache (TMA takes any row); a
paged cache finds its pages block by block, so there s_b is rounded down to the key tile
(`range_align`) and the window's mask hides the keys before max(L_b - W, 0). A learnable sink joins
the merged row once, after the merge, never a chunk's.

A dense cache need not hold sequence b in row b: `cache_rows` (int32 (B,), FlashAttention-2's
cache_batch_idx) names each sequence's row of K and V, one load per CTA before its first K/V copy.
q, seqused_k and the parts stay indexed by b.

Nor need a sequence start at key 0: `key_starts` p_b (int32 (B,), FlashAttention-2's cache_leftpad: a
left-padded batch) moves the chunks' origin to max(s_b, p_b), so the keys read are [p_b, L_b). The
mask still counts from the sequence's end, so a causal diagonal or a window is where it is without
the padding; only the first keys change. Dense caches only (a paged range is rounded to its pages).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from stage3_fwd_kernel import intdiv


class KeySplit(NamedTuple):
    """The split of a launch (Int32 on the device, paged a compile-time bool)."""

    num_splits: Any   # n: chunks per sequence
    chunk_keys: Any   # c: keys per chunk, a multiple of tile_n
    paged: bool       # K / V are a flat paged cache (a batch of one): the page-table row picks the pages
    range_keys: Any = None  # W: the keys each sequence reads, its last W (Int32; RANGE_ALL or None: all)
    range_align: int = 1    # the range's first key rounded down to a multiple of this (paged: the key tile)
    cache_rows: Any = None  # int32 (B,) or None: sequence b's batch row of a dense K / V (None: row b)
    key_starts: Any = None  # int32 (B,) or None: sequence b's first key p_b (a dense cache; None: key 0)


RANGE_ALL = 2**31 - 1  # range_keys that reads every key: max(L - RANGE_ALL, 0) = 0 for any L >= 0


class KeyChunk(NamedTuple):
    """Where virtual sequence v's CTAs read and write."""

    sequence: Any     # b: the batch row of q (and the page-table row of a paged cache)
    first_key: Any    # s_b + j c: the chunk's first key within sequence b (s_b = 0 without a key range or key starts)
    keys_to_end: Any  # max(L_b - j c, 0): the keys from the chunk's start to the sequence's end (the
                      # mask's seqlen_k); the walk stops at the chunk's end (`chunk_blocks`)
    batch_kv: Any     # batch index of the K / V tensors: b (cache_rows[b] when given), or 0 for the flat paged cache


def chunk_of(split: KeySplit, virtual, seqlen_k, seqused_k) -> KeyChunk:
    """Virtual sequence `virtual` (b n + j) of the launch; seqlen_k the cache length, seqused_k
    int32 (B,) or None. fast_div: the launch's B n rows are below its 2**22 bound (grid z <= 65535)."""
    b = intdiv.fast_div(virtual, split.num_splits)
    first = (virtual - b * split.num_splits) * split.chunk_keys
    total = seqlen_k
    if cutlass.const_expr(seqused_k is not None):
        total = seqused_k[b]
    if cutlass.const_expr(split.range_keys is not None):
        start = cutlass.max(total - split.range_keys, Int32(0))
        if cutlass.const_expr(split.range_align > 1):
            start = start // split.range_align * split.range_align   # start >= 0: a mask for a power of two
        if cutlass.const_expr(split.key_starts is not None):
            start = cutlass.max(start, split.key_starts[b])
        first = first + start
    elif cutlass.const_expr(split.key_starts is not None):
        first = first + split.key_starts[b]
    batch_kv = b
    if cutlass.const_expr(split.paged):
        batch_kv = Int32(0)
    elif cutlass.const_expr(split.cache_rows is not None):
        batch_kv = split.cache_rows[b]
    return KeyChunk(b, first, cutlass.max(total - first, Int32(0)), batch_kv)


def chunk_blocks(split: KeySplit, tile_n: int):
    """Key blocks a chunk walks at most (the last chunk of a sequence fewer: its keys_to_end)."""
    return (split.chunk_keys + tile_n - 1) // tile_n


def rows_by_token(t: cute.Tensor, g: int | None = None) -> cute.Tensor:
    """GQA heads packed as rows by token, without a copy: (B, T, H, g, d) -- or (B, T, H g, d) with g
    given, its head mode read as (H, g) -- seen as (B, (g, T), H, d), a row mode whose linear index
    is t g + j (query head h g + j of token t). The split launch reads q this way (Q's TMA box then
    spans g heads and 64 / g tokens) and the merge writes the call's out (split_combine)."""
    shape, stride = t.layout.shape, t.layout.stride
    if cutlass.const_expr(g is not None):
        shape = (shape[0], shape[1], shape[2] // g, g, shape[3])
        stride = (stride[0], stride[1], stride[2] * g, stride[2], stride[3])
    return cute.make_tensor(t.iterator, cute.make_layout((shape[0], (shape[3], shape[1]), shape[2], shape[4]),
                                                         stride=(stride[0], (stride[3], stride[1]), stride[2],
                                                                 stride[4])))
