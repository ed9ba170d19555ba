"""The producer warp: TMA loads of Q and the K/V ring, and the ring's slot arithmetic.

One elected lane issues every TMA load (a gathered paged build: tile_n / 32 warps copy K / V). A
tile's loads are Q's nc 64-row slabs (all on one mbarrier),
then every visible K/V block, each as soon as its ring slot is free, last block first (the order
the consumers walk them). A persistent CTA loads a tile's first K/V block before its Q: that slot
frees while the consumers still read the previous tile's Q, which they release after their last
S = Q K^T.

A paged K/V cache (components.paged_kv) changes only where a block comes from: its coordinate in
the flat cache through the page table (`load_block`), one box per block, or one box per page when
pages are smaller than the key tile (`load_kv_pages`), or row by row with cp.async for the page
sizes TMA cannot read (hopper/gather.py).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync

from stage3_fwd_kernel import intdiv
from stage3_fwd_kernel.components.paged_kv import block_pages, key_block, logical_block
from stage3_fwd_kernel.hopper.gather import gather_kv


class TmaLoads(NamedTuple):
    """The TMA tensors (seqlen, head_dim, heads, batch) and their copy atoms."""

    tma_Q: Any
    tma_K: Any
    tma_V: Any
    atom_Q: Any
    atom_K: Any
    atom_V: Any
    page_table: Any = None  # int32 (sequences, pages) of a paged K/V cache (components.paged_kv), or None
    flat_K: Any = None      # a gathered paged build (hopper/gather.py): the flat cache (1, rows, Hkv, d)
    flat_V: Any = None      # ... and (1, rows, Hkv, dv); None otherwise


class SmemBuffers(NamedTuple):
    """The CTA's shared storage, its Q / K / V tensors and their mbarrier pipelines."""

    storage: Any
    sQ: Any      # (64, d, nc): one slab per consumer warpgroup
    sK: Any      # (tn, d, stages)
    sV: Any      # (tn, dv, stages)
    pipe_Q: Any
    pipe_K: Any
    pipe_V: Any
    sP: Any = None  # (64, tn, nc): P staged for P V (kernel.p_smem), else None


def kv_state(i: Int32, stages: int, producer: bool) -> pipeline.PipelineState:
    """Pipeline slot of the i-th key block walked: stage i % stages; the phase flips every lap round
    the ring. A producer starts one phase ahead: its first lap must not wait for "empty". The
    consumers carry their slot from block to block instead (PipelineState.advance)."""
    index, phase = intdiv.ring_slot(i, stages)
    if const_expr(producer):
        phase = phase ^ 1
    return pipeline.PipelineState(stages, i, index, phase)


def seq_view(t: cute.Tensor, offset, shifted: bool) -> cute.Tensor:
    """(rows, cols) view of one head starting at the sequence's first row (varlen; q_shift: the
    padding rows before row 0, for Q and O, whose offset is then negative; K / V's is 0)."""
    if const_expr(shifted):
        return cute.domain_offset((offset, 0), t)
    return t


@cute.jit
def load_kv(i: Int32, n_block: Int32, stages: cutlass.Constexpr[int], smem: SmemBuffers, tma: TmaLoads,
            tKgK: cute.Tensor, tKsK: cute.Tensor, tVgV: cute.Tensor, tVsV: cute.Tensor):
    """The i-th K/V load, key block n_block of the K/V views (a paged cache: the flat cache's block,
    components.paged_kv): wait until ring slot i is free, post the byte count, issue K then V."""
    st = kv_state(i, stages, producer=True)
    smem.pipe_K.producer_acquire(st)
    cute.copy(tma.atom_K, tKgK[None, n_block], tKsK[None, st.index], tma_bar_ptr=smem.pipe_K.producer_get_barrier(st))
    smem.pipe_V.producer_acquire(st)
    cute.copy(tma.atom_V, tVgV[None, n_block], tVsV[None, st.index], tma_bar_ptr=smem.pipe_V.producer_get_barrier(st))


@cute.jit
def load_kv_pages(i: Int32, page: Int32, boxes: cutlass.Constexpr[int], stages: cutlass.Constexpr[int],
                  smem: SmemBuffers, tma: TmaLoads, tKgK: cute.Tensor, tKsK: cute.Tensor, tVgV: cute.Tensor,
                  tVsV: cute.Tensor):
    """load_kv for pages smaller than the key tile (components.paged_kv): the block is `boxes`
    pages, box j from the page lane j holds (block_pages) into rows j * page_size .. of the ring
    slot; the slot's barrier expects the whole block."""
    st = kv_state(i, stages, producer=True)
    smem.pipe_K.producer_acquire(st)
    for j in cutlass.range_constexpr(boxes):
        cute.copy(tma.atom_K, tKgK[None, cute.arch.shuffle_sync(page, j)], tKsK[None, j, 0, st.index],
                  tma_bar_ptr=smem.pipe_K.producer_get_barrier(st))
    smem.pipe_V.producer_acquire(st)
    for j in cutlass.range_constexpr(boxes):
        cute.copy(tma.atom_V, tVgV[None, cute.arch.shuffle_sync(page, j)], tVsV[None, j, 0, st.index],
                  tma_bar_ptr=smem.pipe_V.producer_get_barrier(st))


@cute.jit
def load_block(cfg, i: Int32, tile, n_block: Int32, smem: SmemBuffers, tma: TmaLoads, tKgK: cute.Tensor,
               tKsK: cute.Tensor, tVgV: cute.Tensor, tVsV: cute.Tensor):
    """The i-th K/V load of the tile, its key block n_block: one box per block, or (pages smaller
    than the key tile) one per page, or (the page sizes TMA cannot read) the cp.async gather."""
    if const_expr(cfg.gather):
        gather_kv(cfg, kv_state(i, cfg.num_stages, producer=True), tile, n_block, smem, tma)
    elif const_expr(cfg.boxes_per_block > 1):
        page = block_pages(tma.page_table, tile, logical_block(tile, cfg.tile_n, n_block), cfg.boxes_per_block,
                           cfg.box_rows)
        load_kv_pages(i, page, cfg.boxes_per_block, cfg.num_stages, smem, tma, tKgK, tKsK, tVgV, tVsV)
    else:
        load_kv(i, key_block(tma.page_table, cfg.blocks_per_page, cfg.tile_n, tile, n_block), cfg.num_stages, smem,
                tma, tKgK, tKsK, tVgV, tVsV)


@cute.jit
def kv_partitions(cfg, tma: TmaLoads, smem: SmemBuffers, mK_s: cute.Tensor, mV_s: cute.Tensor):
    """(tKsK, tKgK, tVsV, tVgV): the TMA views of the K/V ring and of the keys, in boxes of
    cfg.box_rows rows (a key tile, or a page smaller than one: then the ring slots are divided into
    boxes too, a mode of boxes_per_block before the stage)."""
    rows, d, dv = cfg.box_rows, cfg.head_dim, cfg.head_dim_v
    gK = cute.local_tile(mK_s, (rows, d), (None, 0))       # (rows, d, boxes)
    gV = cute.local_tile(mV_s, (rows, dv), (None, 0))      # (rows, dv, boxes)
    sK, sV = smem.sK, smem.sV                               # (tn, d, stages), (tn, dv, stages)
    if const_expr(cfg.boxes_per_block > 1):
        sK = cute.flat_divide(sK, (rows, d))                # (rows, d, L, 1, stages)
        sV = cute.flat_divide(sV, (rows, dv))
    tKsK, tKgK = cpasync.tma_partition(tma.atom_K, 0, cute.make_layout(1),
                                       cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
    tVsV, tVgV = cpasync.tma_partition(tma.atom_V, 0, cute.make_layout(1),
                                       cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
    return tKsK, tKgK, tVsV, tVgV


@cute.jit
def load_q(cfg, tile, q_phase: Int32, tma: TmaLoads, smem: SmemBuffers, tQgQ: cute.Tensor, tQsQ: cute.Tensor):
    """The tile's Q: the nc 64-row slabs on one barrier (it expects all slabs' bytes)."""
    q_state = pipeline.PipelineState(1, Int32(0), Int32(0), q_phase ^ 1)
    smem.pipe_Q.producer_acquire(q_state)
    for wg in cutlass.range_constexpr(cfg.num_consumers):
        cute.copy(tma.atom_Q, tQgQ[None, tile.m_block * cfg.num_consumers + wg], tQsQ[None, wg],
                  tma_bar_ptr=smem.pipe_Q.producer_get_barrier(q_state))


@cute.jit
def produce(cfg, tile, n_block_max: Int32, kv_base: Int32, q_phase: Int32, tma: TmaLoads, smem: SmemBuffers,
            n_block_min=None):
    """One tile's loads. cfg: the kernel (tile sizes, persistent, shifted rows); kv_base: loads
    issued for earlier tiles (the ring position); q_phase: Q's phase for this tile; n_block_min
    (split-tail chunks): the first key block, 0 when None."""
    n_blocks = n_block_max
    if const_expr(n_block_min is not None):
        n_blocks = n_block_max - n_block_min
    d = cfg.head_dim
    shifted = cfg.rows_shifted()
    # TMA coordinates of this sequence: rows start at its offset in the packed tensor
    mQ_s = seq_view(tma.tma_Q[None, None, tile.head, tile.batch], tile.offset_q, shifted)
    # a paged cache is addressed block by block from its first row (key_block), offset_k included;
    # a key split's chunk starts at its offset_k in a dense cache
    shifted_k = (shifted or cfg.key_split) and tma.page_table is None
    mK_s = seq_view(tma.tma_K[None, None, tile.head_kv, tile.batch_kv], tile.offset_k, shifted_k)
    mV_s = seq_view(tma.tma_V[None, None, tile.head_kv, tile.batch_kv], tile.offset_k, shifted_k)
    gQ = cute.local_tile(mQ_s, (cfg.wg_m, d), (None, 0))   # (64, d, m64)
    tQsQ, tQgQ = cpasync.tma_partition(tma.atom_Q, 0, cute.make_layout(1),
                                       cute.group_modes(smem.sQ, 0, 2), cute.group_modes(gQ, 0, 2))
    tKsK, tKgK, tVsV, tVgV = None, None, None, None  # the gather addresses the flat cache itself
    if const_expr(not cfg.gather):
        tKsK, tKgK, tVsV, tVgV = kv_partitions(cfg, tma, smem, mK_s, mV_s)
    first_kv = 0
    if const_expr(cfg.persistent):
        # the first K/V block before Q: its slot frees while the consumers still use the previous Q
        if n_blocks > 0:
            load_block(cfg, kv_base, tile, n_block_max - 1, smem, tma, tKgK, tKsK, tVgV, tVsV)
        first_kv = 1
    if const_expr(cfg.gather):
        if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:  # the other gathering warps: K / V only
            load_q(cfg, tile, q_phase, tma, smem, tQgQ, tQsQ)
    else:
        load_q(cfg, tile, q_phase, tma, smem, tQgQ, tQsQ)
    for i in cutlass.range(first_kv, n_blocks, unroll=1):
        load_block(cfg, kv_base + i, tile, n_block_max - 1 - i, smem, tma, tKgK, tKsK, tVgV, tVsV)
