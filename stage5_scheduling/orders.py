"""Stage 5, part 1: tile orders as index maps that a GPU tile scheduler can evaluate.

A FlashAttention forward launch is a set of *work tiles* ``(m_block, head, batch)``: one
block of ``tile_m`` query rows of one head of one sequence. Which SM runs which tile, and
when, is decided by a scheduler that walks a **linear tile index** ``linear = 0, 1, 2, ...``
(a CTA's ``blockIdx`` for a one-tile-per-CTA grid, or a persistent CTA's work counter) and
turns it into tile coordinates. The hardware (or the persistent loop) hands each next linear
index to the first SM that is free. So an *order* is nothing but a map

    linear in [0, num_tiles)  ->  (block, head, batch)

and that map is the whole difference between the schedulers of this stage. Every map below
uses only integer ``//``, ``%``, ``*``, ``+``, ``-`` and one ``min`` (varlen adds a search in a
prefix-sum table and two table look-ups), works elementwise on NumPy arrays, and is meant to
be ported formula for formula into the device scheduler (a later step tests device == host
on every index).

Why the order matters (paper, "Scheduling"): under a causal mask the tiles are unequal.
With ``tile_m = tile_n = 128`` and bottom-right alignment, Q block ``m`` visits ``m + 1`` K/V
blocks, so an 8k sequence has tiles of cost 1, 2, ..., 64. The standard grid
``(m_blocks, heads, batches)`` launched with ``m_block`` fastest hands out the short tiles
first and leaves the longest ones (``m = 63``) for the very end, where a few SMs finish
them while the rest idle. Longest-processing-time-first (LPT, Graham 1969) fixes the tail:
start the long tiles first, fill the gaps with short ones.

The orders, from the paper:

* ``naive``: the CUDA grid ``(m_blocks, heads, batches)``, ``m_block`` fastest, ascending.
* ``lpt_no_sections``: ``m_block`` in reverse, *outermost*, over all heads and batches. Good
  balance, but consecutive tiles belong to different heads: between two visits of one head
  the scheduler touches every other head of every batch, so when ``batch * heads_kv`` K/V
  working sets exceed L2 each head's K and V are evicted before they are reused.
* ``lpt_causal``: the paper's order. Batches outermost; within a batch the heads are cut into
  *sections* of ``heads_per_section`` heads whose K+V fit in L2; within a section
  ``m_block`` in reverse is the outer loop and the section's heads the inner loop. For GQA/MQA
  the query heads of one KV head are adjacent (head ``h`` reads KV head ``h // group``), and
  sections hold whole groups, so all query heads of a KV head run before ``m_block`` moves.
* ``lpt_causal_flat``: the same, with the sections cut from the (batch, head) pairs in a row
  (head fastest) instead of inside each batch -- what the official FA4 kernel does
  (``SingleTileLPTScheduler``). When ``heads_per_section`` does not divide the head count,
  ``lpt_causal`` ends *every* batch with a narrow section, and the last one starts its longest
  tiles too late to balance: the tail. Flattened, only the very last section can be narrow,
  and only when it does not divide ``batch * heads``. With the head count dividing the section
  (16 heads in sections of 4) both orders are the same list.
* ``lpt_varlen``: sequences differ, so first sort the *batches* by their longest tile,
  descending. A preprocessing kernel would write that permutation (``batch_map``, int32,
  virtual -> actual batch) and the attention kernel reads it. Inside a batch: as above.
* ``spt_bwd`` (deterministic backward): tiles are K/V blocks ``n``. Under a causal mask KV
  block ``n`` is seen by Q blocks ``m >= diagonal(n)``, so *high* ``n`` is *short*.
  Launching ``n`` in descending order is therefore shortest-processing-time-first; with
  dQ reductions ordered by descending ``n`` no CTA waits on its first dQ write -- for a square
  mask with tile_n >= tile_m (see ``dq_rank`` and ``simulator.simulate_bwd``).
* ``naive_bwd``: the backward grid ``(n_blocks, heads, batches)``, ``n`` fastest, ascending.

Two observations make the code short:

1. ``naive``, ``lpt_causal`` and ``spt_bwd`` are one formula, ``sectioned``: sections of
   ``S`` heads, the block index as the outer loop inside a section, optionally reversed.
   ``naive`` is ``S = 1`` and not reversed (one head per section -> block fastest).
2. The forward "mainloop bounds" a kernel already computes (how many K/V blocks Q block ``m``
   visits; the first Q block that sees K/V block ``n``) are exactly the per-tile work that
   LPT sorts by, so they live here too and the varlen sort uses them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from stage4_bwd_kernel.schedule import section_tile  # heads in sections, blocks outer (shared with the kernels)

__all__ = [
    "H100_L2_BYTES", "Tiles", "cdiv", "kv_blocks_visited", "first_q_block", "dq_rank",
    "heads_per_section", "naive", "sectioned", "sectioned_flat", "lpt_causal", "lpt_causal_flat", "lpt_no_sections",
    "naive_bwd", "lpt_bwd", "spt_bwd", "VarlenMeta", "varlen_metadata", "lpt_varlen",
    "list_order",
]

# L2 capacity of H100 SXM5: 50 MB, from NVIDIA's H100 Tensor Core GPU datasheet /
# architecture whitepaper (the full GH100 die has 60 MB; H200 keeps the 50 MB of H100).
# We read "MB" as MiB; the safety factor in `heads_per_section` dwarfs that 5% difference.
H100_L2_BYTES = 50 * 1024 * 1024


class Tiles(NamedTuple):
    """Tile coordinates in launch order, one int64 array each (same length)."""

    block: np.ndarray  # m_block (forward) or n_block (backward)
    head: np.ndarray   # query head
    batch: np.ndarray  # actual batch index (after any virtual -> actual map)

    def __len__(self) -> int:  # number of tiles, not number of fields
        return int(np.asarray(self.block).shape[0])


def cdiv(a, b):
    """ceil(a / b) for non-negative integers (arrays welcome)."""
    return -(-np.asarray(a) // b)


# --------------------------------------------------------------------------------------------
# 1. per-tile work: the mainloop bounds of the forward and backward kernels
# --------------------------------------------------------------------------------------------
def kv_blocks_visited(m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool):
    """How many K/V blocks forward tile ``m_block`` loops over (its mainloop trip count).

    Causal, bottom-right aligned: query ``i`` sees key ``j`` iff ``j <= i + seqlen_k - seqlen_q``.
    The tile's last row is ``min((m+1) tile_m, seqlen_q) - 1``, so it needs keys
    ``[0, min((m+1) tile_m, seqlen_q) + seqlen_k - seqlen_q)`` (clamped to ``[0, seqlen_k]``),
    i.e. ``ceil(keys / tile_n)`` blocks; the diagonal block is partly masked but still costs a
    full MMA. Rows above the diagonal when ``seqlen_q > seqlen_k`` see nothing: 0 blocks.
    """
    m_block = np.asarray(m_block)
    seqlen_q, seqlen_k = np.asarray(seqlen_q), np.asarray(seqlen_k)
    if not causal:
        return np.broadcast_to(cdiv(seqlen_k, tile_n), m_block.shape).copy()
    row_end = np.minimum((m_block + 1) * tile_m, seqlen_q)
    keys = np.clip(row_end + seqlen_k - seqlen_q, 0, seqlen_k)
    return cdiv(keys, tile_n)


def first_q_block(n_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool):
    """Backward: the first Q block that sees K/V block ``n_block`` (its "diagonal").

    Key ``n tile_n`` is visible to rows ``i >= n tile_n - (seqlen_k - seqlen_q)``. With
    bottom-right alignment every key is visible to the last query row, so a K/V block always
    has work: Q blocks ``first_q_block(n) .. m_blocks - 1``. This is the exact transpose of
    ``kv_blocks_visited``: ``n < kv_blocks_visited(m)  <=>  m >= first_q_block(n)``.
    """
    n_block = np.asarray(n_block)
    if not causal:
        return np.zeros_like(n_block)
    first_row = np.maximum(n_block * tile_n - (np.asarray(seqlen_k) - np.asarray(seqlen_q)), 0)
    return first_row // tile_m


def dq_rank(n_block, m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool,
            descending: bool):
    """Position of K/V block ``n`` in the fixed reduction order of dQ block ``m``.

    The deterministic backward gives each dQ tile ``(m, head, batch)`` a semaphore counting
    the adds done so far. The CTA for K/V block ``n`` spins until ``semaphore == rank``,
    adds its partial dQ, fences, and stores ``rank + 1``. The adders of dQ block ``m`` are
    K/V blocks ``0 .. last(m)`` with ``last(m) = kv_blocks_visited(m) - 1``, so

        ascending  (naive):  rank = n
        descending (SPT):    rank = last(m) - n

    In the descending order the first adder of dQ block ``m`` is the K/V block whose
    diagonal it is, which is exactly the first dQ write of that CTA: no stall on it.
    """
    n_block = np.asarray(n_block)
    if not descending:
        return n_block.copy()
    last = kv_blocks_visited(m_block, seqlen_q, seqlen_k, tile_m, tile_n, causal) - 1
    return last - n_block


# --------------------------------------------------------------------------------------------
# 2. how many heads fit in L2
# --------------------------------------------------------------------------------------------
def heads_per_section(l2_bytes: int, seqlen_k: int, head_dim: int, dtype_bytes: int = 2,
                      heads_kv_group: int = 1, head_dim_v: int | None = None,
                      safety: float = 0.5, power_of_two: bool = False) -> int:
    """Query heads per L2 section: whole KV groups whose K and V fit in ``safety * l2_bytes``.

    One KV head's working set is its K and V for the whole sequence:
    ``seqlen_k * (head_dim + head_dim_v) * dtype_bytes``; for 8k keys, d = 128, bf16 that
    is 8192 * 256 * 2 = 4 MiB. With H100's 50 MiB and ``safety = 0.5``: floor(25 / 4) = 6 KV
    heads per section. The safety factor is a modelling choice: the L2 is physically two
    partitions, and Q tiles, O tiles and LSE stream through the same cache. On the H100, 0.5 and
    1.0 (the official kernel's sizing) time the same through fa4 (stage 5 README, "Section size").

    For GQA/MQA a KV head serves ``heads_kv_group`` query heads, and a section holds whole
    groups (so all query heads of a KV head are adjacent): the result is a multiple of
    ``heads_kv_group`` and at least one group. ``power_of_two`` rounds the KV-head count
    down to a power of two (cheap ``>>``/``&`` on device instead of division).
    """
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    kv_bytes = seqlen_k * (head_dim + head_dim_v) * dtype_bytes
    kv_heads = max(1, int(safety * l2_bytes) // max(kv_bytes, 1))
    if power_of_two:
        kv_heads = 1 << (kv_heads.bit_length() - 1)
    return kv_heads * heads_kv_group


# --------------------------------------------------------------------------------------------
# 3. fixed-length orders: linear -> (block, head, batch)
# --------------------------------------------------------------------------------------------
def naive(linear, num_blocks: int, num_heads: int, num_batch: int):
    """The CUDA grid (blocks, heads, batches) linearized with the block index fastest."""
    linear = np.asarray(linear)
    block = linear % num_blocks
    head = (linear // num_blocks) % num_heads
    batch = linear // (num_blocks * num_heads)
    return block, head, batch


def sectioned(linear, num_blocks: int, num_heads: int, num_batch: int, heads_per_section: int,
              reverse_blocks: bool):
    """Batches outermost, then head sections, then blocks (optionally reversed), then the
    section's heads. ``naive == sectioned(S=1, reverse=False)``;
    ``lpt_causal == sectioned(S, reverse=True)`` over Q blocks; ``spt_bwd`` the same over
    K/V blocks."""
    linear = np.asarray(linear)
    per_batch = num_blocks * num_heads
    batch = linear // per_batch
    section = max(1, min(heads_per_section, num_heads))
    block, head = section_tile(linear % per_batch, num_blocks, num_heads, section, reverse_blocks, np.minimum)
    return block, head, batch


def _check_groups(num_heads: int, heads_kv: int | None, section: int) -> None:
    heads_kv = num_heads if heads_kv is None else heads_kv
    if num_heads % heads_kv:
        raise ValueError(f"heads_q={num_heads} is not a multiple of heads_kv={heads_kv}")
    group = num_heads // heads_kv
    if section < num_heads and section % group:
        raise ValueError(f"heads_per_section={section} must hold whole KV groups of {group} "
                         "query heads (use heads_per_section(..., heads_kv_group=group))")


def lpt_causal(linear, num_m_blocks: int, num_heads: int, num_batch: int,
               heads_per_section: int, heads_kv: int | None = None):
    """FA4's causal LPT order: batch > head section > m_block (reversed) > head in section.

    Example, 2 batches, 4 heads, 3 m_blocks, sections of 2 heads:
    (m,h,b) = (2,0,0) (2,1,0) (1,0,0) (1,1,0) (0,0,0) (0,1,0) (2,2,0) (2,3,0) ... (0,3,1).
    """
    _check_groups(num_heads, heads_kv, heads_per_section)
    return sectioned(linear, num_m_blocks, num_heads, num_batch, heads_per_section, True)


def sectioned_flat(linear, num_blocks: int, num_heads: int, num_batch: int, heads_per_section: int,
                   reverse_blocks: bool):
    """``sectioned`` with the sections cut from the (batch, head) pairs in a row: u = batch * heads +
    head, sections of ``heads_per_section`` pairs, blocks outer inside a section (optionally
    reversed), u inner. A section may span two batches; only the very last can be narrow."""
    linear = np.asarray(linear)
    units = num_heads * num_batch
    block, unit = section_tile(linear, num_blocks, units, max(1, min(heads_per_section, units)), reverse_blocks,
                               np.minimum)
    return block, unit % num_heads, unit // num_heads


def lpt_causal_flat(linear, num_m_blocks: int, num_heads: int, num_batch: int,
                    heads_per_section: int, heads_kv: int | None = None):
    """``lpt_causal`` over the flattened (batch, head) pairs: ``sectioned_flat`` with m_block reversed.

    Example, 2 batches, 3 heads, 2 m_blocks, sections of 2: the second section is head 2 of
    batch 0 and head 0 of batch 1. (m,h,b) = (1,0,0) (1,1,0) (0,0,0) (0,1,0) (1,2,0) (1,0,1)
    (0,2,0) (0,0,1) (1,1,1) (1,2,1) (0,1,1) (0,2,1). GQA groups never straddle a section or a
    batch: heads is a multiple of the group, and so is the section.
    """
    _check_groups(num_heads, heads_kv, heads_per_section)
    return sectioned_flat(linear, num_m_blocks, num_heads, num_batch, heads_per_section, True)


def lpt_no_sections(linear, num_m_blocks: int, num_heads: int, num_batch: int):
    """Naive LPT: m_block reversed outermost, then batches, then heads (heads fastest, so GQA
    groups stay adjacent). Balanced, but revisits every (batch, head) once per m_block."""
    linear = np.asarray(linear)
    per_block = num_heads * num_batch
    m_block = num_m_blocks - 1 - linear // per_block
    r = linear % per_block
    return m_block, r % num_heads, r // num_heads


def naive_bwd(linear, num_n_blocks: int, num_heads: int, num_batch: int):
    """Backward grid (n_blocks, heads, batches), n fastest ascending: the longest K/V block
    first (LPT by accident), with consecutive CTAs sharing the same dQ tiles."""
    return naive(linear, num_n_blocks, num_heads, num_batch)


def lpt_bwd(linear, num_n_blocks: int, num_heads: int, num_batch: int, heads_per_section: int):
    """Backward with head sections (swizzle) and K/V blocks ascending: longest first."""
    return sectioned(linear, num_n_blocks, num_heads, num_batch, heads_per_section, False)


def spt_bwd(linear, num_n_blocks: int, num_heads: int, num_batch: int, heads_per_section: int):
    """Deterministic backward, paper's SPT: head sections, K/V blocks *descending* (short
    first under a causal mask). Pair it with ``dq_rank(..., descending=True)``."""
    return sectioned(linear, num_n_blocks, num_heads, num_batch, heads_per_section, True)


# --------------------------------------------------------------------------------------------
# 4. varlen: a virtual -> actual batch map written by a preprocessing (sort) kernel
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VarlenMeta:
    """What a varlen scheduler reads at run time (all int32, as a kernel would store them).

    batch_map     (B,)   virtual batch -> actual batch; the paper's sort output
    num_m_blocks  (B,)   Q blocks of each *actual* batch: ceil(seqlen_q[b] / tile_m)
    cu_tiles      (B+1,) exclusive prefix sum of num_heads * num_m_blocks in *virtual* order:
                         virtual batch v owns linear tiles [cu_tiles[v], cu_tiles[v+1])
    max_tile_work (B,)   K/V blocks of each actual batch's longest tile (the sort key)
    """

    batch_map: np.ndarray
    num_m_blocks: np.ndarray
    cu_tiles: np.ndarray
    max_tile_work: np.ndarray
    num_heads: int
    heads_per_section: int
    reverse_blocks: bool

    @property
    def num_tiles(self) -> int:
        return int(self.cu_tiles[-1])


def varlen_metadata(cu_seqlens_q, cu_seqlens_k, num_heads: int, tile_m: int, tile_n: int,
                    causal: bool = True, heads_per_section: int = 1, sort: bool = True,
                    reverse_blocks: bool = True) -> VarlenMeta:
    """The preprocessing step: per-batch tile counts and longest-tile work, then a stable
    sort of the batches by that work, descending (``sort=False`` keeps the given order).

    Longest tile of batch ``b`` = ``kv_blocks_visited(num_m_blocks[b] - 1)``: the last Q block
    sees the most keys under a bottom-right causal mask (and every block sees all of them
    without one). A 16k prefill's last tile visits 128 K/V blocks, a 300-token chat turn's
    visits 3: the prefill must start first or its last tiles end the kernel alone.
    The stable sort keeps equal-work batches in their given order, so the map is
    deterministic and cacheable, as the paper notes.
    """
    cu_q = np.asarray(cu_seqlens_q, dtype=np.int64)
    cu_k = np.asarray(cu_seqlens_k, dtype=np.int64)
    seq_q, seq_k = np.diff(cu_q), np.diff(cu_k)
    m_blocks = cdiv(seq_q, tile_m)
    longest = np.where(m_blocks > 0,
                       kv_blocks_visited(np.maximum(m_blocks - 1, 0), seq_q, seq_k, tile_m, tile_n,
                                         causal), 0)
    if sort:
        batch_map = np.argsort(-longest, kind="stable")
    else:
        batch_map = np.arange(len(seq_q))
    tiles_virtual = num_heads * m_blocks[batch_map]
    cu_tiles = np.concatenate([[0], np.cumsum(tiles_virtual)])
    return VarlenMeta(batch_map.astype(np.int32), m_blocks.astype(np.int32),
                      cu_tiles.astype(np.int32), longest.astype(np.int32), num_heads,
                      max(1, min(heads_per_section, num_heads)), reverse_blocks)


def lpt_varlen(linear, meta: VarlenMeta):
    """linear -> (m_block, head, actual batch) for a varlen launch described by ``meta``.

    1. virtual batch v: the last v with ``cu_tiles[v] <= linear`` (a device scheduler scans
       ``cu_tiles`` or, as FA does, prefix-sums the tile counts a warp at a time);
    2. b = batch_map[v]; r = linear - cu_tiles[v];
    3. inside the batch: the ``sectioned`` formula with that batch's ``num_m_blocks[b]``.
    The naive varlen order is ``varlen_metadata(sort=False, heads_per_section=1,
    reverse_blocks=False)``: batches as given, m_block fastest ascending.
    """
    linear = np.asarray(linear)
    v = np.searchsorted(meta.cu_tiles, linear, side="right") - 1
    b = meta.batch_map[v].astype(np.int64)
    r = linear - meta.cu_tiles[v]
    m_blocks = meta.num_m_blocks[b].astype(np.int64)
    block, head = section_tile(r, m_blocks, meta.num_heads, meta.heads_per_section, meta.reverse_blocks,
                               np.minimum)
    return block, head, b


# --------------------------------------------------------------------------------------------
# 5. the whole order as arrays
# --------------------------------------------------------------------------------------------
def list_order(order, num_tiles: int, *args, **kwargs) -> Tiles:
    """Evaluate an order on every linear index: ``list_order(lpt_causal, M*H*B, M, H, B, S)``."""
    block, head, batch = order(np.arange(num_tiles, dtype=np.int64), *args, **kwargs)
    return Tiles(np.asarray(block, dtype=np.int64), np.asarray(head, dtype=np.int64),
                 np.asarray(batch, dtype=np.int64))
