"""The production Hopper backward kernel, composed: one CTA per K/V tile (or, ``persistent``, one per SM
walking K/V tiles), a producer warpgroup (TMA loads, dQ writer warps) and two consumer warpgroups (the
five GEMMs), for (D, Dv) = 64, 96, 128, (128, 64) and, on the wide design, (192, 128) and (256, 256).

The class is assembled from the components of this package, each a set of methods over one
configuration (``options.py``):

    layouts.py    SMEM layouts, tiled MMAs, the dQ layouts        LayoutPlan
    walk.py       the CTA's K/V tile, sequence and Q tiles        WalkPlan
    producer.py   TMA loads of K, V, Q, dO, lse2, D               Producer
    dq_writer.py  dQ -> dQaccum by the TMA unit, semaphores       DqWriter
    scores.py     row statistics, the mask, P^T = exp2(...)      Scores
    consumer.py   S^T, dP^T, dV, dS^T, dQ, dK per Q tile          Consumer
    wide.py       the same at 256, 64 keys shared                 WideConsumer
    wide_swap.py  (192, 128): 96 keys, dK^T / dV^T                WideSwapConsumer
    epilogue.py   dK, dV -> global memory                         Epilogue
    persistent.py one CTA per SM, K/V tiles from a counter          PersistentRoles

``q_shift`` (causal d = 128, dense, outside deterministic mode): the 80-row Q tiles are counted from
the sequence's *end*. 128 / 80 is not whole, so one Q tile straddles each K/V tile's diagonal anyway,
and counted from the start the last tile of every walk was partial too (4096 = 51 x 80 + 16). With
``top_padding(seqlen_q)`` rows of zeros before query 0 (< 80, a multiple of 4 so the statistics' TMA
boxes stay 16-byte aligned) only the diagonal tile is partial: 883 -> 858 tiles per 4k head. The
kernel moves offset_q and seqlen_q by the padding; bottom-right causal alignment depends on their
difference only, the TMA loads before the tensor's start bring zeros (every product with them is
zero), the dQ tiles keep their place in dQaccum and ``postprocess_frag`` skips the padding rows.
Measured: docs/measurements.md.
"""
from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.memory.smem import SmemAllocator

from stage3_fwd_kernel import trace
from stage3_fwd_kernel.components.score_mod import Softcap
from stage3_fwd_kernel.components.window import NO_WINDOW, Window
from stage3_fwd_kernel.host_io import SMEM_BUDGET
from stage4_bwd_kernel import common, schedule
from stage4_bwd_kernel.hopper.consumer import Consumer
from stage4_bwd_kernel.hopper.dq_writer import DqWriter
from stage4_bwd_kernel.hopper.epilogue import Epilogue
from stage4_bwd_kernel.hopper.layouts import LayoutPlan, Mmas
from stage4_bwd_kernel.hopper.persistent import ITEM_WORDS, RECORD_STRIDE, RECORDS, ItemSpace, PersistentRoles
from stage4_bwd_kernel.hopper.options import (DQ_FULL_BARRIER, DQ_WRITER_WARP, NUM_THREADS, NUM_WG_MMA,
                                              REGS_CONSUMER, REGS_PRODUCER, SWAP_HEAD_DIMS, BackwardOptions,
                                              default_tiles, dq_empty_barrier, is_banded, is_wide, num_barriers,
                                              smem_need, wide_tile_n)
from stage4_bwd_kernel.hopper.producer import Producer, SmemLayouts, TmaLoads
from stage4_bwd_kernel.hopper.scores import Scores
from stage4_bwd_kernel.hopper.walk import WalkPlan
from stage4_bwd_kernel.hopper.wide import WideConsumer
from stage4_bwd_kernel.hopper.wide_swap import WideSwapConsumer


class FlashAttentionBackwardSm90(LayoutPlan, WalkPlan, Producer, DqWriter, Scores, Consumer, WideConsumer,
                                 WideSwapConsumer, Epilogue, PersistentRoles):
    """The production Hopper backward for one configuration: construct, then call (traced once)."""

    takes_dq_arrivals = True  # its launch takes the dQ tiles' arrival counters (host.main_args)

    def __init__(self, dtype, head_dim: int, head_dim_v: int, causal: bool, deterministic: bool = False, *,
                 varlen: bool = False, has_seqused_k: bool = False, dq_order=None,
                 options: BackwardOptions | None = None, window: Window = NO_WINDOW, softcap: float = 0.0):
        common.check_head_dims(head_dim, head_dim_v)
        self.tile_m, self.tile_n = default_tiles(head_dim, head_dim_v)
        self.wide = is_wide(head_dim, head_dim_v)
        self.dtype = dtype
        self.head_dim, self.head_dim_v = head_dim, head_dim_v
        self.causal, self.deterministic = causal, deterministic
        self.varlen, self.has_seqused_k = varlen, has_seqused_k
        self.dq_order = dq_order or common.default_dq_order(causal, deterministic, head_dim=head_dim)
        self.num_threads = NUM_THREADS
        self.regs_producer, self.regs_consumer = REGS_PRODUCER, REGS_CONSUMER
        self.smem_bytes = None
        # the keys a row sees (stage3_fwd_kernel.components.window: causal is a right edge at 0) and
        # the score transform (components.score_mod); None when plain, so plain builds trace as before
        self.window = Window(window.left, 0 if causal else window.right)
        self.banded = is_banded(window, causal)
        self.window_or_none = self.window if self.banded else None
        self.score_mod = Softcap(softcap)
        self.options = options or BackwardOptions.for_config(head_dim, head_dim_v, causal, deterministic, varlen,
                                                             self.banded, softcap=self.score_mod.on)
        self.options.check(varlen, wide=self.wide, deterministic=deterministic, banded=self.banded,
                           tile_m=self.tile_m, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal)
        if self.options.kv_swap and (head_dim, head_dim_v) not in SWAP_HEAD_DIMS:
            raise ValueError(f"kv_swap: the 96-key design (wide_swap.py) is built for head dims {SWAP_HEAD_DIMS}, "
                             f"got {(head_dim, head_dim_v)}")
        for field in dataclasses.fields(self.options):  # the device code reads them as attributes
            setattr(self, field.name, getattr(self.options, field.name))
        self.num_stages = self.options.stages
        if self.wide:  # the design's keys a CTA (an override may pick the other wide design)
            self.tile_n = wide_tile_n(self.kv_swap)
        need = self._smem_need(self.ds_buffers, self.dq_buffers)
        if need > SMEM_BUDGET:
            raise ValueError(f"options: {self.options} need {need} bytes of shared memory, more than the "
                             f"{SMEM_BUDGET} a CTA can have")
        self.dq_swap_ab = self.tile_m % 64 != 0        # 80 queries: dQ^T = K^T dS^T
        self.dq_split_m = self.tile_m == 64 * NUM_WG_MMA
        self.dq_full_barrier = DQ_FULL_BARRIER
        self.dq_empty_barrier = dq_empty_barrier(self.dq_buffers)
        self.num_barriers = num_barriers(self.dq_buffers, turns=self.dq_atomic and deterministic)
        # per walk segment (masked first tiles, unmasked, masked last tiles): the edge whose half tiles
        # the consumers look for (consumer.edge_tile), or None
        self.half_tile_edges = (schedule.half_tile_edges(causal, self.window_or_none) if self.half_tiles
                                else (None, None, None))

    def _smem_need(self, ds_buffers: int, dq_buffers: int) -> int:
        return smem_need(self.tile_m, self.tile_n, self.head_dim, self.head_dim_v, ds_buffers,
                         0 if self.dq_atomic else dq_buffers, self.num_stages, int(self.wide))

    # -------------------------------------------------------------- host side (traced once)
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor,
                 mSemaphore: cute.Tensor, mDqArrivals: cute.Tensor, num_n_blocks: Int32, softmax_scale_log2: Float32,
                 softmax_scale: Float32, stream):
        # mQ, mK, mdK (B, S, H, d); mV, mdO, mdV (B, S, H, dv); mLSE2, mD (B, Hq, rows) fp32; mdQacc
        # (B, Hq, rows, d) fp32 in fragment order, else like mQ; varlen: B = 1, rows from cu_seqlens;
        # mDqArrivals (B, Hq, rows / tile_m) int32, zeroed: dq_first_store's counter per dQaccum tile (other
        # builds get a stand-in they do not read)
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mdO.element_type
                           == mdK.element_type == mdV.element_type == self.dtype)):
            raise TypeError("q, k, v, dout, dk, dv must share the kernel's dtype")
        tm, tn, d, dv, stages = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        mQ, mK, mdK = (common.assume_aligned(t, d) for t in (mQ, mK, mdK))
        mV, mdO, mdV = (common.assume_aligned(t, dv) for t in (mV, mdO, mdV))
        mdQacc = common.assume_aligned(mdQacc, d)
        mLSE2, mD = common.assume_aligned(mLSE2), common.assume_aligned(mD)  # rows of 16-byte multiples

        q_swz, do_swz, k_swz, v_swz = self.operand_swizzle_widths()
        sQ_layout = self._smem_layout(tm, d, q_swz, stages)
        sdO_layout = self._smem_layout(tm, dv, do_swz, stages)
        sK_layout = self._smem_layout(tn, d, k_swz)
        sV_layout = self._smem_layout(tn, dv, v_swz)
        # dS^T: (keys, queries, buffers); wide: one more slot, P^T, after the dS^T buffers; kv_swap: dS and P
        # as (queries, keys), swizzled for a warpgroup's keys (the MN-major B of dV^T / dK^T)
        sdSt_layout = self._smem_layout(tn, tm, tm, self.ds_buffers + int(self.wide))
        if const_expr(self.kv_swap):
            sdSt_layout = self._smem_layout(tm, tn, tn // 2, self.ds_buffers + 1)
        sdQ_layout = self._sdq_frag_layout() if const_expr(self.dq_frag) else self._sdq_layout()
        tiled_mma_SdP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ = self.make_mmas()

        def seq_dim_first(t):  # (B, S, H, D) -> (S, D, H, B), same memory
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mQ), cute.slice_(sQ_layout, (None, None, 0)), (tm, d))
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mdO), cute.slice_(sdO_layout, (None, None, 0)), (tm, dv))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(tma_load, seq_dim_first(mK), sK_layout, (tn, d))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(tma_load, seq_dim_first(mV), sV_layout, (tn, dv))
        # row order: one TMA reduce-add per warpgroup share of a dQ tile (fragment order uses 1-D bulk
        # reduces and has no descriptor to build)
        tma_atom_dQ, tma_dQ = None, None
        if const_expr(not self.dq_frag):
            tma_atom_dQ, tma_dQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), seq_dim_first(mdQacc), self._sdq_layout(shares=False),
                self._dq_share())
        # lse2 / D of a Q tile: tm fp32 in a (tm, stages) ring whose stages start on 128-byte boundaries
        # (a TMA destination); they ride on the Q / dO barriers (producer.py)
        sStat_layout = cute.make_layout((tm, stages), stride=(1, (tm + 31) // 32 * 32))
        tma_atom_LSE2, tma_LSE2 = cpasync.make_tiled_tma_atom(
            tma_load, cute.make_tensor(mLSE2.iterator, cute.select(mLSE2.layout, mode=[2, 1, 0])),
            cute.slice_(sStat_layout, (None, 0)), (tm,))                  # (Sq, H, B) view
        tma_atom_D, tma_D = cpasync.make_tiled_tma_atom(
            tma_load, cute.make_tensor(mD.iterator, cute.select(mD.layout, mode=[2, 1, 0])),
            cute.slice_(sStat_layout, (None, 0)), (tm,))
        self.tma_bytes_Q = cute.size_in_bytes(self.dtype, cute.slice_(sQ_layout, (None, None, 0))) + tm * 4
        self.tma_bytes_dO = cute.size_in_bytes(self.dtype, cute.slice_(sdO_layout, (None, None, 0))) + tm * 4
        self.tma_bytes_K = cute.size_in_bytes(self.dtype, sK_layout)
        self.tma_bytes_V = cute.size_in_bytes(self.dtype, sV_layout)
        self.tma_bytes_KV = self.tma_bytes_K + self.tma_bytes_V
        stats_len = cute.cosize(sStat_layout)
        # persistent.py's item and record rings; other builds keep the small unused ones they had
        ring_words, ring_align = ((ITEM_WORDS, RECORD_STRIDE * RECORDS), 16) if self.persistent else ((2, 20), 4)

        @cute.struct
        class SharedStorage:
            mbar_KV: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_dO: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sLSE2: cute.struct.Align[cute.struct.MemRange[Float32, stats_len], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, stats_len], 128]
            sOffsets: cute.struct.MemRange[Int32, 3]  # consumer.py: the epilogue's key offset and rows left
            # persistent.py: the published items (by parity) and the walks' records for the dQ writer
            sItems: cute.struct.Align[cute.struct.MemRange[Int32, ring_words[0]], ring_align]
            sDqRecords: cute.struct.Align[cute.struct.MemRange[Int32, ring_words[1]], ring_align]
            mbar_records: cute.struct.MemRange[cutlass.Int64, 2 * RECORDS + 1]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sdSt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdSt_layout)], 1024]
            # dq_atomic: a token sdQ (its views are built, never read)
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, 4 if self.dq_atomic else cute.cosize(sdQ_layout)],
                                   1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()

        batch = mCuSeqlensQ.shape[0] - 1 if const_expr(self.varlen) else mQ.shape[0]
        grid = (num_n_blocks, mK.shape[2], batch)
        if const_expr(self.persistent):  # one CTA per SM (the counter's length), at most one per item
            grid = (cutlass.min(num_n_blocks * mK.shape[2] * batch, mSemaphore.shape[2]), 1, 1)
        self.kernel(tma_Q, tma_dO, tma_K, tma_V, mQ.shape[1], mK.shape[1], mLSE2, mD, mdQacc, mdK, mdV,
                    mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSemaphore, mDqArrivals, num_n_blocks,
                    mQ.shape[2] // mK.shape[2],
                    softmax_scale_log2, softmax_scale,
                    tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V, tma_dQ, tma_atom_dQ,
                    tiled_mma_SdP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ,
                    sQ_layout, sdO_layout, sK_layout, sV_layout, sdSt_layout, sdQ_layout,
                    self._gmem_store(d), self._gmem_store(dv), tma_LSE2, tma_D, tma_atom_LSE2, tma_atom_D,
                    sStat_layout, batch,
                    # min_blocks_per_mp=1 caps registers at entry (65536/384), which setmaxnreg needs
                    ).launch(grid=grid, block=[self.num_threads, 1, 1],
                             stream=stream, min_blocks_per_mp=1, use_pdl=True)

    # -------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_Q: cute.Tensor, tma_dO: cute.Tensor, tma_K: cute.Tensor, tma_V: cute.Tensor,
               total_q: Int32, total_k: Int32, mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
               mSeqUsedK: cute.Tensor, mSemaphore: cute.Tensor, mDqArrivals: cute.Tensor, num_n_blocks: Int32,
               qhead_per_kvhead: Int32,
               softmax_scale_log2: Float32, softmax_scale: Float32,
               tma_atom_Q: cute.CopyAtom, tma_atom_dO: cute.CopyAtom, tma_atom_K: cute.CopyAtom,
               tma_atom_V: cute.CopyAtom, tma_dQ: cute.Tensor, tma_atom_dQ: cute.CopyAtom,
               tiled_mma_SdP: cute.TiledMma, tiled_mma_dV: cute.TiledMma, tiled_mma_dK: cute.TiledMma,
               tiled_mma_dQ: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sdSt_layout: cute.ComposedLayout, sdQ_layout: cute.ComposedLayout,
               gmem_store_dK: cute.TiledCopy, gmem_store_dV: cute.TiledCopy, tma_LSE2: cute.Tensor,
               tma_D: cute.Tensor, tma_atom_LSE2: cute.CopyAtom, tma_atom_D: cute.CopyAtom,
               sStat_layout: cute.Layout, num_batch: Int32):
        # The launch arguments stay flat (a kernel's parameters); the roles get them grouped.
        # mLSE2 / mD are read through their TMA descriptors only.
        trace.cta_stamp("entry")  # no code unless tracing is on
        # PDL both ways: the postprocess may start its CTAs (they wait for this grid) on the SMs this
        # launch leaves free; and this launch follows the preprocess, whose outputs (lse2, D, the zeroed
        # dQ accumulator or arrival counters) each role reads only after its griddepcontrol.wait
        cute.arch.griddepcontrol_launch_dependents()
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group_idx = cute.arch.make_warp_uniform(tidx // 128)
        live, bounds, space = True, None, None
        if const_expr(self.persistent):  # every CTA lives; dead tiles are skipped inside (persistent.py)
            space = ItemSpace(num_n_blocks, tma_K.shape[2], num_batch, total_q, total_k, mCuSeqlensQ, mCuSeqlensK,
                              mSeqUsedK, mSemaphore, qhead_per_kvhead)
        else:
            bounds = self.tile_bounds(num_n_blocks, total_q, total_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
            live = bounds.n_block * self.tile_n < bounds.seqlen_k_rows

        if live:
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_atom_Q)
                cpasync.prefetch_descriptor(tma_atom_dO)
                cpasync.prefetch_descriptor(tma_atom_K)
                cpasync.prefetch_descriptor(tma_atom_V)
                cpasync.prefetch_descriptor(tma_atom_LSE2)
                cpasync.prefetch_descriptor(tma_atom_D)
            if const_expr(not self.dq_frag):
                if warp_idx == DQ_WRITER_WARP:
                    cpasync.prefetch_descriptor(tma_atom_dQ)
            smem = SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            if const_expr(self.persistent):
                if tidx == 0:
                    self.init_record_barriers(storage)
            pipes = self.make_pipelines(storage)  # its init fence and CTA barrier cover the records' too
            walk = None if const_expr(self.persistent) else self.make_walk(bounds, qhead_per_kvhead)
            layouts = SmemLayouts(sQ_layout, sdO_layout, sK_layout, sV_layout, sdSt_layout, sdQ_layout, sStat_layout)

            if warp_group_idx == 0:
                # ---------------------------------------------------------------- producer warpgroup
                cute.arch.setmaxregister_decrease(self.regs_producer)
                if warp_idx == 0:
                    loads = TmaLoads(tma_atom_Q, tma_Q, tma_atom_dO, tma_dO, tma_atom_K, tma_K, tma_atom_V, tma_V,
                                     tma_atom_LSE2, tma_LSE2, tma_atom_D, tma_D)
                    if const_expr(self.persistent):
                        self.produce_items(space, storage, loads, layouts, pipes)
                    else:
                        self.produce(walk, storage, loads, layouts, pipes)
                if const_expr(self.persistent):
                    if warp_idx == DQ_WRITER_WARP:
                        cute.arch.griddepcontrol_wait()
                        self.write_dq_stream(storage, mdQacc, mDqArrivals, sdQ_layout)
                elif const_expr(not self.dq_atomic):  # dq_atomic: the consumers add dQ themselves
                    if warp_idx >= DQ_WRITER_WARP and warp_idx < DQ_WRITER_WARP + self.dq_writers:
                        cute.arch.griddepcontrol_wait()
                        self.write_dq(walk, storage, mdQacc, tma_dQ, tma_atom_dQ, mSemaphore, mDqArrivals, sdQ_layout,
                                      warp_idx - DQ_WRITER_WARP)
                elif const_expr(self.deterministic):  # ... in turns that the writer's warps keep (wide.py)
                    if warp_idx >= DQ_WRITER_WARP and warp_idx < DQ_WRITER_WARP + NUM_WG_MMA:
                        cute.arch.griddepcontrol_wait()
                        self.pass_dq_turns(walk, mSemaphore, warp_idx - DQ_WRITER_WARP)
            else:
                # ---------------------------------------------------------------- consumers
                cute.arch.setmaxregister_increase(self.regs_consumer)
                cute.arch.griddepcontrol_wait()  # before any global access (dQ adds, dK / dV stores)
                mmas = Mmas(tiled_mma_SdP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ)
                if const_expr(self.persistent):
                    self.consume_items(space, tidx - 128, storage, mdK, mdV, mdQacc, softmax_scale_log2, softmax_scale,
                                       mmas, layouts, (gmem_store_dK, gmem_store_dV), pipes)
                else:
                    self.consume(walk, tidx - 128, storage, mdK, mdV, mdQacc, softmax_scale_log2, softmax_scale,
                                 mmas, layouts, (gmem_store_dK, gmem_store_dV), pipes)
        else:
            # a CTA with no keys waits too: the grid then ends only after the preprocess has, so the
            # postprocess (which waits for this grid alone) never reads what the preprocess still zeroes
            cute.arch.griddepcontrol_wait()
