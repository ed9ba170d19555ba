"""The dQ writer warp(s) of the production Hopper backward: dQ_i = dS_i K_j of every Q tile is added
into the fp32 dQaccum by the TMA unit, off the math warps.

Hand-off (barrier ids in options.py). After its dQ wgmma a consumer warpgroup stores its share of the
tile into sdQ[b] (b = t % dq_buffers), fences the generic -> async proxy and *arrives* on "dQ full[b]";
it does not wait. The writer syncs on "dQ full[b]", issues one reduce per share, commits, waits until
the bulk copies have *read* SMEM, and arrives on "dQ empty[b][w]", which warpgroup w syncs on before it
overwrites its share dq_buffers tiles later. So the math runs up to dq_buffers tiles ahead of the adds.
Share 0 is freed as soon as it has been read, whatever share 1 is doing.

The reduce (``dq_frag``): a share is one contiguous chunk of tm * d / 2 floats in fragment order (see
layouts.py), added with one 1-D ``cp.reduce.async.bulk ... add.f32`` (SASS UBLKRED); two 16 KB requests
per tile at d = 64. The row-order form (causal deterministic d = 128) issues one TMA tensor reduce-add
per share (``UTMAREDG``, one per swizzle span); rows past a dense sequence lie outside the tensor and
are skipped. Varlen: the last tile of a sequence also adds into the next sequence's first rows, and
what lands there is exactly +-0 (those queries' P, hence dS and dQ, are 0). That changes no value, and
the sign of a sum of zeros does not depend on the order of the adds, so deterministic mode stays
bitwise reproducible (for finite inputs: an inf in the next sequence's dO would turn the zeros into NaN).

First stores (``dq_first_store``): nobody zeroes dQaccum. Each tile has an int32 arrival counter
(``mDqArrivals``, (B, H, tiles) like the accumulator's tiles, zeroed by the preprocess). Once the consumers
have filled the buffer, lane 0 adds 1 to it with an acquire atomic; the CTA that finds 0 *stores* its
shares (bulk copies, not reduces) and, once they have landed, adds ``DQ_STORED``; a later CTA that finds
the counter below DQ_STORED spins until it is set, then reduces as before. A tile that no K/V tile reaches
keeps the counter 0, and the postprocess writes its rows as zeros. What it saves is the preprocess's
zeroing: 4 bytes x d per query row and head written to HBM (at 2k causal, d = 128, ~4% of the backward).

Deterministic mode: the CTAs of one (kv head, batch) add into each dQ tile in the fixed order of
``dq_order`` (schedule.py). Lane 0 acquires the tile's semaphore *before* waiting for the consumers'
tile, so the spin overlaps their math, frees the buffer once the TMA has read it, and releases the
semaphore once the adds have *landed*. With two dQ buffers there are two writer warps, warp 1 + w
taking the tiles of buffer w, so two tiles' acquire / reduce / release chains overlap; each buffer's
barriers still see one writer warp.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync
from cutlass.cutlass_dsl import dsl_user_op

from stage4_bwd_kernel import common, schedule
from stage4_bwd_kernel.hopper.options import DQ_EMPTY_THREADS, DQ_FULL_THREADS, NUM_WG_MMA


@dsl_user_op
def bulk_reduce_add_f32(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, num_bytes: cutlass.Constexpr[int], *,
                        loc=None, ip=None) -> None:
    """gmem[0:n] += smem[0:n] (fp32, n = num_bytes / 4) by the TMA unit (SASS UBLKRED):
    ``cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32``; 16-byte aligned addresses, num_bytes
    a multiple of 16. Completion: ``cp.async.bulk.commit_group``, then ``wait_group[.read]``."""
    g = gmem_ptr.toint(loc=loc, ip=ip).ir_value()
    s = smem_ptr.toint(loc=loc, ip=ip).ir_value()
    ptx = f"cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], {num_bytes};"
    llvm.inline_asm(None, [g, s], ptx, "l,r", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def bulk_store_f32(gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, num_bytes: cutlass.Constexpr[int], *,
                   loc=None, ip=None) -> None:
    """gmem[0:n] = smem[0:n] by the TMA unit (SASS UBLKCP): ``cp.async.bulk.global.shared::cta.bulk_group``;
    alignment and completion as bulk_reduce_add_f32's."""
    g = gmem_ptr.toint(loc=loc, ip=ip).ir_value()
    s = smem_ptr.toint(loc=loc, ip=ip).ir_value()
    llvm.inline_asm(None, [g, s], f"cp.async.bulk.global.shared::cta.bulk_group [$0], [$1], {num_bytes};", "l,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


# added to a dQ tile's arrival counter once the first CTA's stores have landed (first stores, above);
# arrivals stay far below it (one per K/V tile of the sequence)
DQ_STORED = 1 << 30


class DqWriter:
    """dQ writer methods of the kernel class, and the two barriers it shares with the consumers."""

    @cute.jit
    def write_dq(self, walk, storage, mdQacc: cute.Tensor, tma_dQ: cute.Tensor, tma_atom_dQ: cute.CopyAtom,
                 mSemaphore: cute.Tensor, mDqArrivals: cute.Tensor, sdQ_layout: cute.ComposedLayout, writer: Int32):
        """Every dQ tile of the walk whose buffer belongs to writer warp `writer` -> dQaccum: (acquire,)
        wait for the tile, (claim it,) reduce or store its shares, free the buffer share by share
        (release, or publish a first store)."""
        lane = cute.arch.lane_idx()
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)  # (rows, cols, shares)
        share = self._dq_share()
        n_m = walk.m_block_max - walk.m_block_min
        n_tiles = walk.qhead_per_kvhead * n_m
        for head_in_group in cutlass.range(walk.qhead_per_kvhead, unroll=1):
            head = walk.head_kv * walk.qhead_per_kvhead + head_in_group
            tDsD, tDgD = None, None
            if const_expr(not self.dq_frag):
                gdQ = cute.local_tile(cute.domain_offset((walk.offset_q, 0), tma_dQ[None, None, head, walk.bidx]),
                                      share, (None, None))                      # (rows, cols, m, n)
                tDsD, tDgD = cpasync.tma_partition(tma_atom_dQ, 0, cute.make_layout(1),
                                                   cute.group_modes(sdQ, 0, 2), cute.group_modes(gdQ, 0, 2))
            for m_pos in cutlass.range(walk.m_block_min, walk.m_block_max, unroll=1):
                t = head_in_group * n_m + m_pos - walk.m_block_min
                m_block = self.m_at(walk, m_pos)  # walk.py
                buf = t % self.dq_buffers
                mine = True
                if const_expr(self.dq_writers > 1):
                    mine = t % self.dq_writers == writer   # writer w: the tiles of its buffers
                if mine:
                    if const_expr(self.deterministic):
                        self.acquire_dq_tile(mSemaphore, walk, head, m_block, lane)
                    self.dq_full(buf, wait=True)
                    first = False
                    if const_expr(self.dq_first_store):
                        first = self.claim_dq_tile(self.dq_arrival_counter(mDqArrivals, walk, head, m_block), lane)
                    # a loop, not unrolled: each TMA tensor copy expands to one elected issue per swizzle
                    # span, and two copies' worth of them spilled the writer's 24 registers
                    for w in cutlass.range(NUM_WG_MMA, unroll=1):
                        # the whole warp calls the copy (it elects one lane, which needs the warp
                        # converged); every lane commits and waits on its own, possibly empty, bulk group
                        g_m, g_n = m_block, w
                        if const_expr(self.dq_split_m):
                            g_m, g_n = m_block * NUM_WG_MMA + w, 0
                        if const_expr(self.dq_frag):
                            if lane == 0:
                                self.add_dq_share(self.dq_frag_share_pointer(mdQacc, walk, head, m_block, w),
                                                  common.elem_pointer(sdQ, (0, buf * NUM_WG_MMA + w)), first)
                        else:
                            cute.copy(tma_atom_dQ, tDsD[None, buf * NUM_WG_MMA + w], tDgD[None, g_m, g_n])
                        cute.arch.cp_async_bulk_commit_group()
                    refill = t + self.dq_buffers < n_tiles  # a tile t + buffers will wait for this buffer
                    if const_expr(not self.deterministic):
                        # share 0 may be refilled once it has been read, whatever share 1 is doing
                        cute.arch.cp_async_bulk_wait_group(1, read=True)
                        cute.arch.sync_warp()
                        if refill:
                            self.dq_empty(buf, 0, wait=False)
                    cute.arch.cp_async_bulk_wait_group(0, read=True)  # the shares have been read
                    cute.arch.sync_warp()
                    if refill:
                        for w in cutlass.range_constexpr(NUM_WG_MMA):
                            if const_expr(self.deterministic or w > 0):
                                self.dq_empty(buf, w, wait=False)
                    if const_expr(self.deterministic):
                        self.release_dq_tile(mSemaphore, walk, head, m_block, lane)
                    if const_expr(self.dq_first_store):
                        if first:
                            self.publish_dq_tile(self.dq_arrival_counter(mDqArrivals, walk, head, m_block), lane)
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.sync_warp()

    @cute.jit
    def add_dq_share(self, gmem_ptr: cute.Pointer, smem_ptr: cute.Pointer, first):
        """(lane 0) one warpgroup's share of a dQ tile into dQaccum: stored if this CTA claimed the tile
        first (dq_first_store), else reduced."""
        num_bytes = self.dq_frag_share_elems() * 4
        if const_expr(self.dq_first_store):
            if first:
                bulk_store_f32(gmem_ptr, smem_ptr, num_bytes)
            else:
                bulk_reduce_add_f32(gmem_ptr, smem_ptr, num_bytes)
        else:
            bulk_reduce_add_f32(gmem_ptr, smem_ptr, num_bytes)

    def dq_arrival_counter(self, mDqArrivals: cute.Tensor, walk, head, m_block) -> cute.Pointer:
        """The arrival counter of dQ tile m_block of this walk's sequence and query head (first stores)."""
        return common.elem_pointer(mDqArrivals, (walk.bidx, head, self.dq_frag_tile(walk.offset_q, walk.batch, m_block)))

    @cute.jit
    def claim_dq_tile(self, arrival: cute.Pointer, lane: Int32):
        """First stores: count this CTA's arrival at a dQ tile -> whether it is the first (it stores).
        A later arrival waits until the first one's stores have landed (DQ_STORED) before it reduces."""
        seen = Int32(0)
        if lane == 0:
            seen = cute.arch.atomic_add(arrival, Int32(1), sem="acquire", scope="gpu")  # the old count
            if seen != 0 and seen < DQ_STORED:
                common.semaphore_wait_at_least(arrival, DQ_STORED, lane)
        seen = cute.arch.shuffle_sync(seen, 0)  # the warp follows lane 0's acquire
        cute.arch.fence_proxy("async.global")   # ... and so do its async-proxy reduces
        return seen == 0

    @cute.jit
    def publish_dq_tile(self, arrival: cute.Pointer, lane: Int32):
        """First stores: once this CTA's stores into the tile have *landed*, let later arrivals reduce."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_proxy("async.global")
        cute.arch.sync_warp()
        if lane == 0:
            common.release_add_gpu(arrival, DQ_STORED)

    @cute.jit
    def dq_rank(self, walk, m_block: Int32) -> Int32:
        """This CTA's place (K/V tile walk.n_block's) among the K/V tiles that add into dQ tile m_block,
        in the order of ``dq_order``: the writer's acquire below, and the turn warps of 256's
        deterministic adds (wide.py, pass_dq_turns)."""
        n_block_last = schedule.n_block_last(m_block, self.tile_m, self.tile_n, walk.seqlen_q, walk.seqlen_k,
                                             self.causal, imin=cutlass.min, window=self.window_or_none)
        n_block_first = Int32(0)
        if const_expr(self.window_or_none is not None):
            n_block_first = schedule.n_block_first(m_block, self.tile_m, self.tile_n, walk.seqlen_q, walk.seqlen_k,
                                                   self.causal, imax=cutlass.max, window=self.window_or_none)
        return self.dq_order.rank(walk.n_block, n_block_first, n_block_last)

    @cute.jit
    def acquire_dq_tile(self, mSemaphore: cute.Tensor, walk, head: Int32, m_block: Int32, lane: Int32):
        """Deterministic mode: lane 0 spins until dQ tile (batch, head, m_block)'s counter reaches this
        CTA's rank (K/V tile n_block's) in the dQ order; the warp, and its async-proxy adds, follow."""
        common.semaphore_wait(common.elem_pointer(mSemaphore, (walk.batch, head, m_block)),
                              self.dq_rank(walk, m_block), lane)
        cute.arch.sync_warp()                  # lane 0's acquire precedes everyone
        cute.arch.fence_proxy("async.global")  # ... and the async-proxy adds below

    @cute.jit
    def release_dq_tile(self, mSemaphore: cute.Tensor, walk, head: Int32, m_block: Int32, lane: Int32):
        """Deterministic mode: once this CTA's adds into dQ tile (batch, head, m_block) have *landed*,
        lane 0 lets the next CTA in the order add (the pointer is formed again: kept from the acquire,
        it spilled in the writer's 24 registers)."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        cute.arch.fence_proxy("async.global")
        cute.arch.sync_warp()
        common.semaphore_signal(common.elem_pointer(mSemaphore, (walk.batch, head, m_block)), lane)

    @cute.jit
    def dq_full(self, buf: Int32, wait: cutlass.Constexpr[bool]):
        """bar.sync (the writer, wait) or bar.arrive (a consumer warpgroup) on "dQ full" of buffer buf."""
        bar_id = self.dq_full_barrier + buf
        if const_expr(wait):
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=DQ_FULL_THREADS)
        else:
            cute.arch.barrier_arrive(barrier_id=bar_id, number_of_threads=DQ_FULL_THREADS)

    @cute.jit
    def dq_empty(self, buf: Int32, w, wait: cutlass.Constexpr[bool]):
        """bar.sync (consumer warpgroup w, wait) or bar.arrive (the writer) on "dQ empty" of buffer buf,
        share w."""
        bar_id = self.dq_empty_barrier + buf * NUM_WG_MMA + w
        if const_expr(wait):
            cute.arch.barrier(barrier_id=bar_id, number_of_threads=DQ_EMPTY_THREADS)
        else:
            cute.arch.barrier_arrive(barrier_id=bar_id, number_of_threads=DQ_EMPTY_THREADS)
