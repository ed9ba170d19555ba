"""The persistent Hopper backward (``options.persistent``): one CTA per SM walks K/V tiles that a
counter hands out, instead of one CTA per K/V tile.

Why: a CTA of the one-per-tile grid pays, for every K/V tile, its set-up (barrier init, the launch
order's arithmetic), the wait for K, V and the first Q / dO before its first wgmma, and a dK / dV
epilogue with nothing else in flight. On an H200 at 2k causal, d = 128, that was ~1030 cycles of
prologue and ~2650 cycles of first tile beyond a steady one, per CTA of ~40k cycles
(docs/measurements.md, "short causal backwards"). A persistent CTA pays the set-up once, and the
next tile's loads run under the current one's end.

How:
* Work items are the one-per-tile grid's launch indices, mapped by ``dq_order`` as that grid maps
  them (``host_tile`` of the sectioned orders, else blockIdx order), so sections and LPT carry over.
  CTA c takes item c first, then grid width + the previous value of a global counter, so whichever CTA
  frees first takes the next item, as the hardware dispatches a grid (``TileWalk.next_linear``). The
  counter is the semaphores argument's first int32, zeroed per call; its length is the grid's width.
* The producer warp publishes each live item's index in a two-slot SMEM ring (slot = the item's
  parity) before arming K/V's barrier for it; that arrival (a release) orders the store before the
  consumers' wait. An index past the end, on a phase completed by a real load, ends the consumers.
* The Q / dO ring and the dS^T / dQ buffers count tiles across items (``tiles_before``), so the
  producer loads the next item's first Q / dO as soon as the consumers free their stage.
* The epilogue stages dK, then dV, through sdSt (free once the last tile's wgmmas are done) instead of
  sK / sV, and releases K/V's stage at its start: the next item's K and V load under the epilogue.
* The dQ writer warp follows no walk: the first consumer thread writes each dQ tile's place (batch,
  head, first row) beside its buffer before arriving on "dQ full", and a row of -1 ends the writer.
  The writer arrives on "dQ empty" after every tile; the consumers sync, before they exit, the
  arrivals no tile waited for, so every named-barrier generation completes (as the one-per-tile
  kernel's "refill" test ensures).
Outside it: deterministic mode (its semaphore order assumes launch order), the wide designs, the
row-order dQ and ``kv_with_first``; ``options.check`` refuses them.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline

from stage3_fwd_kernel.components.tile_walk import TileWalk
from stage3_fwd_kernel.intdiv import fast_div
from stage4_bwd_kernel import common
from stage4_bwd_kernel.hopper.dq_writer import bulk_reduce_add_f32
from stage4_bwd_kernel.hopper.options import (CONSUMER_BARRIER, MAX_DQ_BUFFERS, NUM_CONSUMER_THREADS, NUM_WG_MMA,
                                              SDST_FREE_BARRIER)
from stage4_bwd_kernel.hopper.scores import thread_idx_fresh

PLACE_WORDS = 3       # a dQ tile's place: (batch index of dQaccum, query head, first row)
TILES_CAP = 1 << 30   # "a next tile follows" always holds inside a persistent CTA's walks


class ItemSpace(NamedTuple):
    """The one-per-tile grid a persistent CTA walks, and what locating an item needs."""
    num_n_blocks: Any     # Int32: K/V tiles per sequence (of the longest)
    num_heads_kv: Any     # Int32
    num_batch: Any        # Int32: sequences
    total_q: Any          # Int32: dense query rows (varlen: unused)
    total_k: Any          # Int32
    cu_seqlens_q: Any     # int32 tensors (stand-ins when the build reads none)
    cu_seqlens_k: Any
    seqused_k: Any
    tile_counter: Any     # int32 (1, 1, ctas), zeroed per call: the hand-out's counter
    qhead_per_kvhead: Any  # Int32

    def num_items(self):
        return self.num_n_blocks * self.num_heads_kv * self.num_batch


def item_pipeline_state(item: Int32, producer: bool) -> pipeline.PipelineState:
    """K/V's single stage for item `item` of a CTA: the phase flips every item; the producer starts one
    phase ahead (its first acquire must not wait)."""
    phase = item % 2
    if producer:
        phase = phase ^ 1
    return pipeline.PipelineState(1, item, Int32(0), phase)


class PersistentRoles:
    """Persistent methods of the kernel class (the module docstring)."""

    @cute.jit
    def item_walk(self, linear: Int32, space: ItemSpace):
        """(the walk of item `linear`, whether its K/V tile has rows): a tile past a shorter varlen
        sequence's end has none, and is skipped by the producer, as its CTA would exit."""
        if const_expr(hasattr(self.dq_order, "host_tile")):
            n_block, head_kv, batch = self.dq_order.host_tile(linear, space.num_n_blocks, space.num_heads_kv,
                                                              space.num_batch, imin=cutlass.min, div=fast_div)
        else:
            rest = linear // space.num_n_blocks
            batch = rest // space.num_heads_kv
            head_kv = rest - batch * space.num_heads_kv
            n_block = self.dq_order.n_block_for_launch(linear - rest * space.num_n_blocks, space.num_n_blocks)
        b = self.sequence_bounds(n_block, head_kv, batch, space.total_q, space.total_k, space.cu_seqlens_q,
                                 space.cu_seqlens_k, space.seqused_k)
        return self.make_walk(b, space.qhead_per_kvhead), b.n_block * self.tile_n < b.seqlen_k_rows

    def next_item(self, linear: Int32, space: ItemSpace) -> Int32:
        """(one warp) the item after `linear`: the counter's hand-out."""
        return TileWalk(None, dynamic=True, split_tail=False, locate=None, key_range=None).next_linear(linear, space)

    # ------------------------------------------------------------------ producer warp
    @cute.jit
    def produce_items(self, space: ItemSpace, storage, loads, layouts, pipes):
        """Warp 0: every live item's K, V and Q / dO tiles, publishing each item's index first."""
        items = storage.sItems.get_tensor(cute.make_layout(2))
        total = space.num_items()
        linear = Int32(cute.arch.block_idx()[0])
        item = Int32(0)
        tiles_before = Int32(0)
        while linear < total:
            walk, live = self.item_walk(linear, space)
            if live:
                # one lane stores: the elected lane that arms the barrier (lane 0 of the converged warp)
                if cute.arch.lane_idx() == 0:
                    items[item % 2] = linear
                self.produce(walk, storage, loads, layouts, pipes, kv_state=item_pipeline_state(item, True),
                             tiles_before=tiles_before)
                tiles_before += walk.qhead_per_kvhead * (walk.m_block_max - walk.m_block_min)
                item += 1
            linear = self.next_item(linear, space)
        # no more work: an index past the end, on a K/V phase that item 0's K and V (a real load, no
        # Q tiles) complete
        if cute.arch.lane_idx() == 0:
            items[item % 2] = total
        first, _ = self.item_walk(Int32(0), space)
        self.produce(first._replace(m_block_max=first.m_block_min), storage, loads, layouts, pipes,
                     kv_state=item_pipeline_state(item, True), tiles_before=tiles_before)

    # ------------------------------------------------------------------ dQ writer warp
    @cute.jit
    def write_dq_stream(self, storage, mdQacc: cute.Tensor, sdQ_layout: cute.ComposedLayout):
        """Every dQ tile the consumers hand off, at the place they wrote beside it, until a row of -1."""
        lane = cute.arch.lane_idx()
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)  # (share elems, shares)
        places = storage.sDqPlace.get_tensor(cute.make_layout((PLACE_WORDS, MAX_DQ_BUFFERS)))
        share_elems = self.dq_frag_share_elems()
        g = Int32(0)
        self.dq_full(Int32(0), wait=True)
        row = places[2, 0]
        while row >= 0:
            buf = g % self.dq_buffers
            for w in cutlass.range(NUM_WG_MMA, unroll=1):
                if lane == 0:
                    bulk_reduce_add_f32(common.elem_pointer(mdQacc, (places[0, buf], places[1, buf], row, 0))
                                        + w * share_elems,
                                        common.elem_pointer(sdQ, (0, buf * NUM_WG_MMA + w)), share_elems * 4)
                cute.arch.cp_async_bulk_commit_group()
            # share 0 may be refilled once it has been read, whatever share 1 is doing
            cute.arch.cp_async_bulk_wait_group(1, read=True)
            cute.arch.sync_warp()
            self.dq_empty(buf, 0, wait=False)
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.sync_warp()
            for w in cutlass.range_constexpr(1, NUM_WG_MMA):
                self.dq_empty(buf, w, wait=False)
            g += 1
            following = g % self.dq_buffers
            self.dq_full(following, wait=True)
            row = places[2, following]
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.sync_warp()

    @cute.jit
    def post_dq_place(self, o, buf: Int32, walk, head: Int32, m_block: Int32):
        """(consumers, before arriving on "dQ full" of buf) the first consumer thread writes where the
        tile goes: its writer has read the previous place of buf before arriving on "dQ empty"."""
        places = o.dq_places
        if thread_idx_fresh() == 128:
            places[0, buf] = walk.bidx
            places[1, buf] = head
            places[2, buf] = self.dq_frag_tile_row(walk.offset_q, walk.batch, m_block)

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume_items(self, space: ItemSpace, ctidx: Int32, storage, mdK: cute.Tensor, mdV: cute.Tensor,
                      mdQacc: cute.Tensor, softmax_scale_log2: Float32, softmax_scale: Float32, mmas, layouts,
                      gmem_stores, pipes):
        """The 256 consumer threads: every item the producer publishes, walk then epilogue."""
        # reached through self inside the loop: CuTe-DSL would try to carry a local Python object
        self.item_operands, self.item_body = self.design_operands(ctidx, storage, mmas, layouts, mdQacc)
        self.item_operands.dq_places = storage.sDqPlace.get_tensor(cute.make_layout((PLACE_WORDS, MAX_DQ_BUFFERS)))
        items = storage.sItems.get_tensor(cute.make_layout(2))
        scale_log2, score_scale = self.score_scales(softmax_scale_log2, softmax_scale)
        total = space.num_items()
        item = Int32(0)
        tiles_before = Int32(0)
        pipes.kv.consumer_wait(item_pipeline_state(item, False))
        linear = items[0]
        while linear < total:
            walk, _ = self.item_walk(linear, space)
            sOffsets = self.save_offsets(walk, ctidx, storage)
            self.item_operands.acc_dK.fill(0.0)
            self.item_operands.acc_dV.fill(0.0)
            tiles_before += self.walk_tiles(self.item_operands, self.item_body, walk, mmas, pipes, scale_log2,
                                            score_scale, tiles_before=tiles_before, tiles_cap=Int32(TILES_CAP),
                                            dq_heads=True)
            self.store_dk_dv_staged(self.item_operands, walk, mdK, mdV, mmas, gmem_stores, sOffsets, softmax_scale, storage, layouts,
                                    pipes, item)
            item += 1
            pipes.kv.consumer_wait(item_pipeline_state(item, False))
            linear = items[item % 2]
        self.end_dq_stream(self.item_operands, tiles_before)

    @cute.jit
    def store_dk_dv_staged(self, o, walk, mdK: cute.Tensor, mdV: cute.Tensor, mmas, gmem_stores,
                           sOffsets: cute.Tensor, softmax_scale: Float32, storage, layouts, pipes, item: Int32):
        """The epilogue (epilogue.py's store_tile) staged through sdSt, K/V's stage released first."""
        tn, d, dv = self.tile_n, self.head_dim, self.head_dim_v
        # both warpgroups' last wgmmas (readers of sK, sV, sdSt) have completed
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=NUM_CONSUMER_THREADS)
        pipes.kv.consumer_release(item_pipeline_state(item, False))
        o.acc_dK.store(o.acc_dK.load() * softmax_scale)
        offset_k, k_rows_left = sOffsets[0], sOffsets[1]
        ctidx = thread_idx_fresh() - 128
        sK_stage = storage.sdSt.get_tensor(layouts.sK.outer, swizzle=layouts.sK.inner)   # (tn, d) over sdSt
        sV_stage = storage.sdSt.get_tensor(layouts.sV.outer, swizzle=layouts.sV.inner)   # (tn, dv) over sdSt
        self.store_tile(o.acc_dK, mmas.dK, sK_stage, sK_stage, gmem_stores[0], ctidx,
                        cute.local_tile(cute.domain_offset((offset_k, 0), mdK[walk.bidx, None, walk.head_kv, None]),
                                        (tn, d), (walk.n_block, 0)), (tn, d), k_rows_left)
        # every thread has read dK from sdSt before dV overwrites it ...
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=NUM_CONSUMER_THREADS)
        self.store_tile(o.acc_dV, mmas.dV, sV_stage, sV_stage, gmem_stores[1], ctidx,
                        cute.local_tile(cute.domain_offset((offset_k, 0), mdV[walk.bidx, None, walk.head_kv, None]),
                                        (tn, dv), (walk.n_block, 0)), (tn, dv), k_rows_left)
        # ... and dV, before the next walk's dS^T does
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=NUM_CONSUMER_THREADS)

    @cute.jit
    def end_dq_stream(self, o, tiles: Int32):
        """After the last walk: a place with row -1 ends the writer; then the "dQ empty" arrivals of the
        last dq_buffers - 1 tiles (which no tile waits for) and, with one dS^T buffer, the other
        warpgroup's last "sdSt free" arrival are synced."""
        buffers = self.dq_buffers
        buf = tiles % buffers
        if tiles >= buffers:
            self.dq_empty(buf, o.wg, wait=True)
        places, wg = o.dq_places, o.wg
        if thread_idx_fresh() == 128:
            places[2, buf] = Int32(-1)
        self.dq_full(buf, wait=False)
        for k in cutlass.range_constexpr(1, buffers):
            if tiles - buffers + k >= 0:
                self.dq_empty((tiles - buffers + k) % buffers, wg, wait=True)
        if const_expr(self.ds_buffers == 1):
            if tiles > 0:
                cute.arch.barrier(barrier_id=SDST_FREE_BARRIER + wg, number_of_threads=NUM_CONSUMER_THREADS)
