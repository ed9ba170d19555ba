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
  frees first takes the next item, as the hardware dispatches a grid (``tile_walk.next_from_counter``). The
  counter is the semaphores argument's first int32, zeroed per call; its length is the most CTAs the
  grid may have (one per SM, or ``host.backward``'s ``persistent_ctas``; the grid is never wider than
  the items).
* The producer warp publishes each live item's index in a two-slot SMEM ring (slot = the item's
  parity) before arming K/V's barrier for it; that arrival (a release) orders the store before the
  consumers' wait. An index past the end, on a phase completed by a real load, ends the consumers.
* The Q / dO ring and the dS^T / dQ buffers count tiles across items (``tiles_before``), so the
  producer loads the next item's first Q / dO as soon as the consumers free their stage.
* The epilogue stages dK, then dV, through sdSt (free once the last tile's wgmmas are done) instead of
  sK / sV, and releases K/V's stage at its start: the next item's K and V load under the epilogue.
* The dQ writer warp follows no walk of its own: before loading each walk with tiles, the producer
  warp writes a record of it (batch index of dQaccum, first query head, first row, Q tiles per head,
  tiles; a rotated walk's first row is its first tile's, and a sixth word says how many of a head's
  tiles come before the wrap, walk.py) into a ring of ``RECORDS`` slots, and the writer counts the
  walk's tiles itself; a record of -1 tiles ends the writer. Each slot has a "full" and an "empty"
  mbarrier (the producer's lane 0 arrives on one, every lane of the writer on the other once it has
  read the record), so every access to a record is ordered by a release and an acquire of the thread
  that made it; so is the item ring
  ("items read": every consumer thread arrives once it has read an index, and the producer waits for
  the slot's previous readers before storing the next). compute-sanitizer's racecheck reported
  hazards for the orderings these replace: a record ordered by the "dQ full" named barrier (a
  bar.arrive before the writer's bar.sync), and reads whose order came through another lane's arrival.
  (Posted from the consumers, the records cost the 80-query tile 48 spill bytes and serialized wgmmas;
  read by the writer's lane 0 and shuffled to the warp, the writer's 24 registers spilled.)
  The writer arrives on "dQ empty" after every tile; before they exit the consumers sync the arrivals
  no tile waited for, so every named-barrier generation completes (as the one-per-tile kernel's
  "refill" test ensures).
Outside it: deterministic mode (its semaphore order assumes launch order), the wide designs, the
row-order dQ, ``kv_with_first`` and dS^T buffers too small to stage a dK / dV tile; ``options.check``
refuses them. d = 64 builds compile but spill (28 / 16 bytes), and were not timed.

The hand-offs are modelled, with the same phases, parities and counts, in
``stage4_bwd_kernel/persistent_protocol.py`` (``python -m stage4_bwd_kernel.persistent_protocol``: random
item lists and schedules; it finds the hang of waiting for item i - 2's readers, and the unwaited
phase synccheck reported).

Where it runs: ``backward.persistent_pays`` -- d = 128 calls of at most 2k keys and (128, 64) ones of
1k (queries x GQA group too), where it measured faster on an H200; longer walks keep one CTA per tile (docs/measurements.md, 2026-12-01, "the
persistent backward by default on short walks"). compute-sanitizer's racecheck, memcheck and synccheck
are clean on it (tests/test_sanitizers.py, ``bwd-d128-persistent``).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline

from stage3_fwd_kernel.components.tile_walk import next_from_counter
from stage3_fwd_kernel.intdiv import fast_div
from stage4_bwd_kernel import common
from stage4_bwd_kernel.hopper.options import NUM_CONSUMER_THREADS, NUM_WG_MMA, SDST_FREE_BARRIER

RECORD_WORDS = 5      # a walk's record for the writer: (dQaccum batch, first head, first row, tiles a head, tiles)
# a rotated walk's record (walk.py) adds the tiles of a head before its wrap; its first row is the first tile's
ROTATED_RECORD_WORDS = RECORD_WORDS + 1
RECORDS = 4
# A record slot's stride and the item ring's size, in words: 32 and 16 bytes, each slot in 16-byte
# chunks of its own (the struct aligns both). The writer's read of record 0 compiled to 16-byte loads
# over its 5 words, one word before them -- the item ring's -- included, which racecheck reported as a
# WAR hazard against the producer's next item store; a padded slot keeps such over-reads inside it.
RECORD_STRIDE = 8
ITEM_WORDS = 4
TILES_CAP = 1 << 30   # "a next tile follows" always holds inside a persistent CTA's walks


def records_layout(words: int = RECORD_WORDS):
    """(words, RECORDS) words of the record ring, slot-major with a RECORD_STRIDE stride."""
    return cute.make_layout((words, RECORDS), stride=(1, RECORD_STRIDE))


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

    # ------------------------------------------------------------------ producer warp
    @cute.jit
    def produce_items(self, space: ItemSpace, storage, loads, layouts, pipes):
        """Warp 0: every live item's K, V and Q / dO tiles, publishing each item's index first."""
        items = storage.sItems.get_tensor(cute.make_layout(2))
        total = space.num_items()
        linear = Int32(cute.arch.block_idx()[0])
        item = Int32(0)
        tiles_before = Int32(0)
        recorded = Int32(0)
        while linear < total:
            walk, live = self.item_walk(linear, space)
            if live:
                self.publish_item(storage, items, item, linear)
                n_tiles = walk.qhead_per_kvhead * (walk.m_block_max - walk.m_block_min)
                if n_tiles > 0:  # the dQ writer's record of the walk
                    self.post_record(storage, recorded, walk, n_tiles)
                    recorded += 1
                self.produce(walk, storage, loads, layouts, pipes, kv_state=item_pipeline_state(item, True),
                             tiles_before=tiles_before)
                tiles_before += n_tiles
                item += 1
            # the counter may be zeroed by the preprocess (host.zeroed_words): wait for it (PDL) before the
            # first hand-out, which an item without Q tiles reaches before any produce() has waited
            cute.arch.griddepcontrol_wait()
            linear = next_from_counter(space.tile_counter)
        self.post_record(storage, recorded, None, Int32(-1))
        # no more work: an index past the end, on a K/V phase that item 0's K and V (a real load, no
        # Q tiles) complete
        self.publish_item(storage, items, item, total)
        first, _ = self.item_walk(Int32(0), space)
        self.produce(first._replace(m_block_max=first.m_block_min), storage, loads, layouts, pipes,
                     kv_state=item_pipeline_state(item, True), tiles_before=tiles_before)

    @cute.jit
    def publish_item(self, storage, items: cute.Tensor, item: Int32, linear: Int32):
        """(the producer warp) lane 0 stores item `item`'s index in its slot once every consumer thread
        has read item - 1 ("items read"), hence, earlier in its program, the slot's previous index (item -
        2). Waiting for item - 2's readers instead would hang: "items read" has completed item - 1 or item
        phases here (K/V's acquire of item - 1 already waited for item - 2's release), and parity cannot
        tell item - 2's completion from item's. Item 1 waits too, though its slot is fresh: synccheck
        reports a phase that no thread waited for before the next phase's arrivals ("Missing wait"), so
        every phase but the last is waited for. One lane stores; the warp then syncs, so that whichever
        lane arms K/V's barrier orders the store before the consumers' wait."""
        if cute.arch.lane_idx() == 0:
            if item >= 1:
                cute.arch.mbarrier_wait(storage.mbar_records.data_ptr() + 2 * RECORDS, (item - 1) % 2)
            items[item % 2] = linear
        cute.arch.sync_warp()

    # ------------------------------------------------------------------ dQ writer warp
    @cute.jit
    def write_dq_stream(self, storage, mdQacc: cute.Tensor, mDqArrivals: cute.Tensor, sdQ_layout: cute.ComposedLayout):
        """Every dQ tile the consumers hand off, walk by walk as their records say, until a record of -1
        tiles."""
        g = Int32(0)
        r = Int32(0)
        bidx, head, row, n_m, n_tiles, wrap_at = self.take_record(storage, r)
        while n_tiles >= 0:
            m = Int32(0)
            for t in cutlass.range(n_tiles, unroll=1):
                self.dq_full(g % self.dq_buffers, wait=True)
                self.reduce_dq_tile(storage, mdQacc, mDqArrivals, sdQ_layout, g % self.dq_buffers, bidx, head, row)
                m += 1
                row += self.tile_m
                if const_expr(self.rotate_walk):
                    if m == wrap_at:  # past the last Q tile: on from the first (walk.py)
                        row -= n_m * self.tile_m
                    if m == n_m:      # the next query head of the group, from the same Q tile
                        m = Int32(0)
                        head += 1
                else:
                    if m == n_m:  # the next query head of the group
                        m = Int32(0)
                        head += 1
                        row -= n_m * self.tile_m
                g += 1
            r += 1
            bidx, head, row, n_m, n_tiles, wrap_at = self.take_record(storage, r)
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.sync_warp()

    @cute.jit
    def reduce_dq_tile(self, storage, mdQacc: cute.Tensor, mDqArrivals: cute.Tensor,
                       sdQ_layout: cute.ComposedLayout, buf: Int32, bidx: Int32, head: Int32, row: Int32):
        """One dQ tile of buffer buf into dQaccum rows [row, row + tile_m) of (bidx, head), a bulk reduce
        (or, claimed first, a store: dq_writer.py) per warpgroup share; each share's "dQ empty" once the
        TMA has read it."""
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)  # (share elems, shares)
        share_elems = self.dq_frag_share_elems()
        lane = cute.arch.lane_idx()
        first = False
        if const_expr(self.dq_first_store):
            first = self.claim_dq_tile(common.elem_pointer(mDqArrivals, (bidx, head, row // self.tile_m)), lane)
        for w in cutlass.range(NUM_WG_MMA, unroll=1):
            if lane == 0:
                self.add_dq_share(common.elem_pointer(mdQacc, (bidx, head, row, 0)) + w * share_elems,
                                  common.elem_pointer(sdQ, (0, buf * NUM_WG_MMA + w)), first)
            cute.arch.cp_async_bulk_commit_group()
        # share 0 may be refilled once it has been read, whatever share 1 is doing
        cute.arch.cp_async_bulk_wait_group(1, read=True)
        cute.arch.sync_warp()
        self.dq_empty(buf, 0, wait=False)
        cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.sync_warp()
        for w in cutlass.range_constexpr(1, NUM_WG_MMA):
            self.dq_empty(buf, w, wait=False)
        if const_expr(self.dq_first_store):
            if first:
                self.publish_dq_tile(common.elem_pointer(mDqArrivals, (bidx, head, row // self.tile_m)), lane)

    def init_record_barriers(self, storage):
        """(thread 0, before the pipelines' init fence) each record slot's "full" and "empty" mbarrier, and
        "items read" (every consumer thread arrives once it has read a published item index)."""
        bars = storage.mbar_records.data_ptr()
        for i in range(RECORDS):  # plain Python: unrolled as traced
            cute.arch.mbarrier_init(bars + i, 1)             # "full": the producer's lane 0
            cute.arch.mbarrier_init(bars + RECORDS + i, 32)  # "empty": every lane of the writer warp
        cute.arch.mbarrier_init(bars + 2 * RECORDS, NUM_CONSUMER_THREADS)  # "items read"

    @cute.jit
    def take_record(self, storage, r: Int32):
        """(the writer warp) record r, once published; its slot is handed back as soon as it is read."""
        num_words = ROTATED_RECORD_WORDS if const_expr(self.rotate_walk) else RECORD_WORDS
        records = storage.sDqRecords.get_tensor(records_layout(num_words))
        bars = storage.mbar_records.data_ptr()
        slot = r % RECORDS
        cute.arch.mbarrier_wait(bars + slot, (r // RECORDS) % 2)
        # every lane reads and hands the slot back itself: its arrival orders its own reads before the
        # producer's next store (lane 0 reading for the warp, then shuffling, spilled the writer)
        words = tuple(records[i, slot] for i in range(num_words))
        cute.arch.mbarrier_arrive(bars + RECORDS + slot)
        if const_expr(not self.rotate_walk):
            words = words + (words[3],)  # in order: a head's tiles all come before the wrap
        return words

    @cute.jit
    def post_record(self, storage, r: Int32, walk, n_tiles: Int32):
        """(the producer warp) lane 0 publishes record r: the walk's place and its tile count, or (walk
        None) n_tiles = -1, the end. It first waits until the writer has read the slot's last record."""
        if cute.arch.lane_idx() == 0:
            words = ROTATED_RECORD_WORDS if const_expr(self.rotate_walk) else RECORD_WORDS
            records = storage.sDqRecords.get_tensor(records_layout(words))
            bars = storage.mbar_records.data_ptr()
            slot = r % RECORDS
            if r >= RECORDS:
                cute.arch.mbarrier_wait(bars + RECORDS + slot, (r // RECORDS - 1) % 2)
            if const_expr(walk is not None):
                records[0, slot] = walk.bidx
                records[1, slot] = walk.head_kv * walk.qhead_per_kvhead
                first_m = walk.m_block_min
                if const_expr(self.rotate_walk):
                    first_m = first_m + walk.m_rot
                    records[5, slot] = walk.m_block_max - first_m  # tiles of a head before the wrap
                records[2, slot] = self.dq_frag_tile_row(walk.offset_q, walk.batch, first_m)
                records[3, slot] = walk.m_block_max - walk.m_block_min
            records[4, slot] = n_tiles
            cute.arch.mbarrier_arrive(bars + slot)

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume_items(self, space: ItemSpace, ctidx: Int32, storage, mdK: cute.Tensor, mdV: cute.Tensor,
                      mdQacc: cute.Tensor, softmax_scale_log2: Float32, softmax_scale: Float32, mmas, layouts,
                      gmem_stores, pipes):
        """The 256 consumer threads: every item the producer publishes, walk then epilogue."""
        # reached through self inside the loop: CuTe-DSL would try to carry a local Python object
        self.item_operands, self.item_body = self.design_operands(ctidx, storage, mmas, layouts, mdQacc)
        items = storage.sItems.get_tensor(cute.make_layout(2))
        bars = storage.mbar_records.data_ptr()
        scale_log2, score_scale = self.score_scales(softmax_scale_log2, softmax_scale)
        total = space.num_items()
        item = Int32(0)
        tiles_before = Int32(0)
        pipes.kv.consumer_wait(item_pipeline_state(item, False))
        linear = self.read_item(items, bars, item)
        while linear < total:
            walk, _ = self.item_walk(linear, space)
            sOffsets = self.save_offsets(walk, ctidx, storage)
            self.item_operands.acc_dK.fill(0.0)
            self.item_operands.acc_dV.fill(0.0)
            tiles_before += self.walk_tiles(self.item_operands, self.item_body, walk, mmas, pipes, scale_log2,
                                            score_scale, tiles_before=tiles_before, tiles_cap=Int32(TILES_CAP))
            # staged through sdSt (free once the last wgmmas are done), K/V's stage freed first
            self.store_dk_dv(self.item_operands, walk, mdK, mdV, mmas, gmem_stores, sOffsets, softmax_scale,
                             staging=(storage.sdSt.get_tensor(layouts.sK.outer, swizzle=layouts.sK.inner),
                                      storage.sdSt.get_tensor(layouts.sV.outer, swizzle=layouts.sV.inner)),
                             release=lambda: pipes.kv.consumer_release(item_pipeline_state(item, False)))
            item += 1
            pipes.kv.consumer_wait(item_pipeline_state(item, False))
            linear = self.read_item(items, bars, item)
        self.end_dq_stream(self.item_operands.wg, tiles_before)

    @cute.jit
    def read_item(self, items: cute.Tensor, bars, item: Int32) -> Int32:
        """(every consumer thread, after K/V's wait for item `item`) its published index; each reader then
        arrives on "items read", which the producer waits for before it stores item + 1 (so before item + 2
        reuses this slot)."""
        linear = items[item % 2]
        cute.arch.mbarrier_arrive(bars + 2 * RECORDS)
        return linear

    @cute.jit
    def end_dq_stream(self, wg: Int32, tiles: Int32):
        """After the last walk: sync the "dQ empty" arrivals of the last dq_buffers tiles (which no tile
        waits for) and, with one dS^T buffer, the other warpgroup's last "sdSt free" arrival, so every
        named-barrier generation completes before the CTA exits."""
        buffers = self.dq_buffers
        for k in cutlass.range_constexpr(buffers):
            if tiles - buffers + k >= 0:
                self.dq_empty((tiles - buffers + k) % buffers, wg, wait=True)
        if const_expr(self.ds_buffers == 1):
            if tiles > 0:
                cute.arch.barrier(barrier_id=SDST_FREE_BARRIER + wg, number_of_threads=NUM_CONSUMER_THREADS)
