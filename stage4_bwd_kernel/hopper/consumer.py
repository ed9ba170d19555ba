"""The two consumer warpgroups of the production Hopper backward: S^T, dP^T, dV, dS^T, dQ, dK per Q tile.

Consumer warpgroup w owns keys [64 w, 64 w + 64) of the 128-key tile, so the rows of its S^T = K Q^T
and dP^T = V dO^T accumulators are its own keys. dV += P^T dO and dK += dS^T Q have those same keys as
M, so P^T and dS^T are converted in place into 16-bit A-operand fragments (a 64 x N wgmma's accumulator
and A fragment hold the same (row, column) pairs in the same register order) and the wgmma reads A from
registers. Only dS^T goes to SMEM, as the operand of dQ = dS K.

SMEM cycles per 64 x 128 tile at d = 128 (128 B/clk, ``roofline.hopper_tile_cycles``): operands 2048 +
the dS^T store 128 + dQ through SMEM 512 = 2688 against 2560 on the tensor cores (all operands from
SMEM: 3328). Registers per consumer thread: dK d/2 + dV dv/2 + S^T 32 + dP^T 32 + P^T 16; at d = 128
that is 208 of the 240 ``setmaxnreg`` gives a consumer.

Per tile t, wgmma groups committed in this order:
    S^T (SS) ; dP^T (SS) ; wait S^T ; P^T ; wait dP^T ; dS^T
    dS^T -> sdSt ; dV += P^T dO (RS) ; proxy fence ; B2 ; dQ = dS K (SS) ; dK += dS^T Q (RS)
    wait all but dK ; release dO_i ; dQ -> sdQ[t % buffers] ; arrive "dQ full" ; wait dK ; release Q_i

* dV is issued after dS^T is formed, so the fp32 P^T, its 16-bit copy and dP^T are never all live (the
  register peak), and before the proxy fence that publishes the dS^T stores: dV reads registers and dO,
  only the dQ wgmma after B2 reads sdSt. (dV issued right after P^T, overlapping dS^T, measured 4-7%
  slower at d = 96 on an H200, the last tile that used it: log 2026-12-01.)
* dQ goes before dK so that its hand-off to the writer warp runs under dK's wgmma; dO_i's stage is
  released as soon as dP^T and dV have read it.
* dS^T buffers (``ds_buffers``): with two, a warpgroup stores tile t's dS^T after B2 of tile t - 1, which
  the other reaches only after its dQ wgmma of tile t - 2, the last reader of that buffer; with one
  (the 128 x 128 tile, whose SMEM is full), "sdSt free" barriers guard it.
* The shapes of dQ: ``dq_split_m`` (128 queries) splits its query rows between the warpgroups, so each
  reads half of dS once; ``dq_swap_ab`` (80 queries, no wgmma M) forms dQ^T = K^T dS^T with d on M.
* Descriptors built once: shared-memory operands become wgmma descriptors that depend only on the
  warpgroup; slicing by its first thread, marked warp-uniform, keeps their arithmetic in uniform
  registers (sliced per thread, every descriptor was rebuilt per tile).
* The walk is cut into three segments, masked / mask-free / masked (``schedule.unmasked_m_range``),
  each a copy of the tile body compiled with or without the mask test: no branch inside a body (a
  uniform ``if`` there made ptxas serialize every wgmma at d = 64).
* Half tiles (``half_tiles``, ``edge_tile``): a masked segment's tile whose queries see none of one
  warpgroup's 64 keys (``schedule.keys_hidden``) runs a third body copy: that warpgroup only takes the
  barriers and its dQ share (``idle_tile``), and both dQ wgmmas read the other 64 keys.
Measured: docs/measurements.md.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import warpgroup

from stage3_fwd_kernel import trace
from stage3_fwd_kernel.components.score_mod import LOG2_E
from stage3_fwd_kernel.hopper.fragments import acc_rowcol
from stage4_bwd_kernel import common, schedule
from stage4_bwd_kernel.hopper.layouts import dq_frag_tiled_copy
from stage4_bwd_kernel.hopper.options import CONSUMER_BARRIER, NUM_CONSUMER_THREADS, NUM_WG_MMA, SDST_FREE_BARRIER
from stage4_bwd_kernel.hopper.producer import swizzled
from stage4_bwd_kernel.hopper.scores import TanhFromP


@cute.jit
def gemm_issue(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
               zero_init: cutlass.Constexpr[bool], k_half: cutlass.Constexpr = None):
    """Issue acc (+)= A B over all k-blocks as one wgmma group (the caller fences before the first
    group and waits after the last); k_half 0 / 1: over the first / second half of them only."""
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    k_blocks = cute.size(tA.shape[2])
    k_lo, k_hi = 0, k_blocks
    if const_expr(k_half is not None):
        k_lo, k_hi = k_half * k_blocks // 2, (k_half + 1) * k_blocks // 2
    for k in cutlass.range_constexpr(k_lo, k_hi):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


class ConsumerOperands:
    """What a consumer thread holds across the walk: its MMA slices, the operand fragments of its
    warpgroup, the accumulators of dK and dV, the copies into sdSt / sdQ (built once, by operands())."""


class Consumer:
    """Consumer methods of the kernel class."""

    @cute.jit
    def operands(self, ctidx: Int32, storage, mmas, layouts):
        """ConsumerOperands of consumer thread ctidx (0..255). mmas: Mmas; layouts: SmemLayouts."""
        tm, tn, d, dv, stages = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        o = ConsumerOperands()
        sQ, sdO = swizzled(storage, "sQ", layouts), swizzled(storage, "sdO", layouts)       # (tm, d|dv, stages)
        o.sK, o.sV = swizzled(storage, "sK", layouts), swizzled(storage, "sV", layouts)     # (tn, d|dv)
        sdSt = swizzled(storage, "sdSt", layouts)                          # (tn, tm, ds_buffers [+ P^T, wide])
        sdQ = cute.composition(swizzled(storage, "sdQ", layouts), self._sdq_tile_view())    # (tm, d, buffers) fp32
        sQt = cute.composition(sQ, cute.make_ordered_layout((d, tm, stages), order=(1, 0, 2)))
        sdOt = cute.composition(sdO, cute.make_ordered_layout((dv, tm, stages), order=(1, 0, 2)))
        sKt = cute.composition(o.sK, cute.make_ordered_layout((d, tn), order=(1, 0)))
        sdS = cute.composition(sdSt, cute.make_ordered_layout((tm, tn, self.ds_buffers), order=(1, 0, 2)))

        o.thr_SdP = mmas.SdP.get_slice(ctidx)
        o.thr_dV = mmas.dV.get_slice(ctidx)
        o.thr_dK = mmas.dK.get_slice(ctidx)
        o.thr_dQ = mmas.dQ.get_slice(ctidx)
        # descriptors built once, per warpgroup (module docstring)
        o.wg = cute.arch.make_warp_uniform(ctidx // 128)
        wg_first = o.wg * 128
        wg_SdP, wg_dV = mmas.SdP.get_slice(wg_first), mmas.dV.get_slice(wg_first)
        wg_dK, wg_dQ = mmas.dK.get_slice(wg_first), mmas.dQ.get_slice(wg_first)
        o.tSrK = wg_SdP.make_fragment_A(wg_SdP.partition_A(o.sK))         # this warpgroup's 64 keys
        o.tSrQ = wg_SdP.make_fragment_B(wg_SdP.partition_B(sQ))           # (..., stages)
        o.tPrV = wg_SdP.make_fragment_A(wg_SdP.partition_A(o.sV))
        o.tPrdO = wg_SdP.make_fragment_B(wg_SdP.partition_B(sdO))         # (..., stages)
        o.tdVrdOt = wg_dV.make_fragment_B(wg_dV.partition_B(sdOt))        # (..., stages)
        o.tdKrQt = wg_dK.make_fragment_B(wg_dK.partition_B(sQt))          # (..., stages)
        if const_expr(self.dq_swap_ab):  # dQ^T = K^T dS^T: A = K^T (d, tn), B = dS (tm, tn), both MN-major
            o.tdQrA = wg_dQ.make_fragment_A(wg_dQ.partition_A(sKt))
            o.tdQrB = wg_dQ.make_fragment_B(wg_dQ.partition_B(sdS))       # (..., ds_buffers)
        else:
            o.tdQrA = wg_dQ.make_fragment_A(wg_dQ.partition_A(sdS))       # (..., ds_buffers)
            o.tdQrB = wg_dQ.make_fragment_B(wg_dQ.partition_B(sKt))
        if const_expr(self.wide):  # dV / dK read P^T / dS^T from SMEM (wide.py)
            o.tdVrPt = wg_dV.make_fragment_A(wg_dV.partition_A(sdSt))      # (..., slots): P^T in the last
            o.tdKrdSt = wg_dK.make_fragment_A(wg_dK.partition_A(sdSt))
        o.acc_dV = cute.make_rmem_tensor(o.thr_dV.partition_shape_C((tn, dv)), Float32)
        o.acc_dK = cute.make_rmem_tensor(o.thr_dK.partition_shape_C((tn, d)), Float32)
        o.acc_dV.fill(0.0)
        o.acc_dK.fill(0.0)
        o.tScS_rc = acc_rowcol(o.thr_SdP.partition_C(cute.make_identity_tensor((tn, tm))))  # (key, query)
        o.tScS0_rc = acc_rowcol(mmas.SdP.get_slice(0).partition_C(cute.make_identity_tensor((tn, tm))))
        # dS^T (16-bit, accumulator order) -> sdSt: 2 adjacent queries per 4-byte store
        o.smem_copy_dS = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), mmas.SdP)
        o.thr_smem_dS = o.smem_copy_dS.get_slice(ctidx)
        o.tdSsdSt = o.thr_smem_dS.partition_D(sdSt)                       # (..., ds_buffers [+ P^T])
        # dQ (fp32) -> sdQ[buf], row order: 2 adjacent columns per 8-byte store; dq_swap_ab holds dQ^T,
        # whose adjacent pair is 2 query rows of sdQ: 4-byte stores into the transposed view
        o.smem_copy_dQ = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32,
                                num_bits_per_copy=32 if const_expr(self.dq_swap_ab) else 64), mmas.dQ)
        o.thr_smem_dQ = o.smem_copy_dQ.get_slice(ctidx)
        if const_expr(self.dq_swap_ab):
            sdQ = cute.composition(sdQ, cute.make_ordered_layout((d, tm, self.dq_buffers), order=(1, 0, 2)))
        o.sdQ = sdQ
        o.dq_shape = (d, tm) if const_expr(self.dq_swap_ab) else (tm, d)
        if const_expr(self.dq_frag):
            # register i of the dQ fragment -> element (i // 4) * 512 + (thread in warpgroup) * 4 + i % 4
            # of the warpgroup's share: 16-byte stores, a warp's 512 bytes contiguous (no conflicts)
            sdQ_frag = storage.sdQ.get_tensor(layouts.sdQ.outer)                # (share elems, shares)
            thr_frag = dq_frag_tiled_copy().get_slice(ctidx % 128)
            o.tQsQ_frag = thr_frag.partition_D(sdQ_frag)                        # (4, chunks, shares)
        o.sLSE2 = storage.sLSE2.get_tensor(layouts.sStat)                       # (tm, stages), TMA-filled
        o.sD = storage.sD.get_tensor(layouts.sStat)
        return o

    @cute.jit
    def consume(self, walk, ctidx: Int32, storage, mdK: cute.Tensor, mdV: cute.Tensor, mdQacc: cute.Tensor,
                softmax_scale_log2: Float32, softmax_scale: Float32, mmas, layouts, gmem_stores, pipes):
        """The 256 consumer threads (ctidx 0..255): the walk, then the dK / dV epilogue. mdQacc: read
        only with dq_atomic (wide.py)."""
        trace.cta_stamp("start")
        o, tile_body = self.design_operands(ctidx, storage, mmas, layouts, mdQacc)
        sOffsets = self.save_offsets(walk, ctidx, storage)
        # K_j, V_j (waited for even when the walk is empty: no TMA may outlive the CTA); with
        # kv_with_first they come with the first tile's Q and dO, and an empty walk loads neither
        if const_expr(not self.kv_with_first):
            pipes.kv.consumer_wait(pipeline.PipelineState(1, Int32(0), Int32(0), Int32(0)))
        scale_log2, score_scale = self.score_scales(softmax_scale_log2, softmax_scale)
        self.walk_tiles(o, tile_body, walk, mmas, pipes, scale_log2, score_scale)
        trace.cta_stamp("walked")
        self.store_dk_dv(o, walk, mdK, mdV, mmas, gmem_stores, sOffsets, softmax_scale)
        trace.cta_stamp("end")

    def design_operands(self, ctidx: Int32, storage, mmas, layouts, mdQacc: cute.Tensor):
        """The design's operands and tile body, picked once (wide.py / wide_swap.py at the wide head
        dims) -> (ConsumerOperands, tile body)."""
        operands, tile_body = self.operands, self.consume_tile
        if const_expr(self.wide):
            tile_body = self.consume_tile_wide
        if const_expr(self.kv_swap):
            operands, tile_body = self.operands_swap, self.consume_tile_swap
        o = operands(ctidx, storage, mmas, layouts)
        o.mdQacc = mdQacc
        return o, tile_body

    @cute.jit
    def save_offsets(self, walk, ctidx: Int32, storage) -> cute.Tensor:
        """The epilogue's key offset and row count wait in SMEM rather than in registers live across the
        walk (the d = 64 varlen kernel spilled); read back after the walk's last consumer barrier. The
        third word (the statistics' first row) is read by nobody since the producer loads them; without
        its store ptxas schedules every build differently (690 SASS lines at d = 64 varlen), unmeasured."""
        sOffsets = storage.sOffsets.get_tensor(cute.make_layout(3))
        if ctidx == 0:
            sOffsets[0] = walk.offset_k
            sOffsets[1] = walk.seqlen_k_rows - walk.n_block * self.tile_n
            sOffsets[2] = self.stats_offset(walk.offset_q, walk.batch)
        return sOffsets

    def score_scales(self, softmax_scale_log2: Float32, softmax_scale: Float32):
        """(P's exponent scale, the tanh's input scale or None): with softcap, softcap * log2(e) and
        softmax_scale / softcap."""
        if const_expr(self.score_mod.on):
            return Float32(self.score_mod.cap * LOG2_E), softmax_scale * (1.0 / self.score_mod.cap)
        return softmax_scale_log2, None

    @cute.jit
    def walk_tiles(self, o: ConsumerOperands, tile_body, walk, mmas, pipes, softmax_scale_log2: Float32,
                   score_scale, tiles_before=0, tiles_cap=None) -> Int32:
        """The walk: (query head of the group) x (Q tile), in three segments (module docstring), each
        cut in two by a rotated walk's wrap (walk.py) -> its tile count. tiles_before: the CTA's tiles
        before this walk (a persistent CTA's earlier K/V tiles: the ring, dS^T and dQ buffers count
        on); tiles_cap: the count the bodies' "a next tile follows" tests compare with (persistent.py:
        every tile, the CTA ends the last hand-offs itself)."""
        tm, tn = self.tile_m, self.tile_n
        n_m = walk.m_block_max - walk.m_block_min
        n_tiles = walk.qhead_per_kvhead * n_m
        trace.note(n_tiles)
        tiles_seen = n_tiles
        if const_expr(tiles_cap is not None):
            tiles_seen = tiles_cap
        hot_lo, hot_hi = schedule.unmasked_m_range(walk.n_block, tm, tn, walk.seqlen_q, walk.seqlen_k, self.causal,
                                                   walk.m_block_min, walk.m_block_max, imin=cutlass.min,
                                                   imax=cutlass.max, window=self.window_or_none)
        segments = ((walk.m_block_min, hot_lo, True), (hot_lo, hot_hi, False), (hot_hi, walk.m_block_max, True))
        # runs of Q tiles (first, end, a tile's walk position minus its index): one in order, two rotated
        runs = ((walk.m_block_min, walk.m_block_max, 0),)
        if const_expr(self.rotate_walk):
            runs = schedule.rotated_runs(walk.m_block_min, walk.m_block_max, walk.m_rot)
        for head_in_group in cutlass.range(walk.qhead_per_kvhead, unroll=1):
            for run in cutlass.range_constexpr(len(runs)):
                run_lo, run_hi, shift = runs[run]
                for seg in cutlass.range_constexpr(3):
                    seg_lo, seg_hi, masked = segments[seg]
                    if const_expr(self.rotate_walk):  # the segment's part inside the run
                        seg_lo, seg_hi = schedule.run_segment(seg_lo, seg_hi, run_lo, run_hi, imin=cutlass.min,
                                                              imax=cutlass.max)
                    edge = self.half_tile_edges[seg]
                    for m_block in cutlass.range(seg_lo, seg_hi, unroll=1):
                        t = tiles_before + head_in_group * n_m + m_block - walk.m_block_min
                        if const_expr(self.rotate_walk):
                            t = t + shift  # the tile's walk position
                        if const_expr(edge is None):
                            tile_body(o, walk, mmas, pipes, t, m_block, tiles_seen, softmax_scale_log2, masked,
                                      score_scale)
                        else:
                            self.edge_tile(o, walk, mmas, pipes, t, m_block, tiles_seen, softmax_scale_log2,
                                           score_scale, edge)
        return n_tiles

    @cute.jit
    def edge_tile(self, o: ConsumerOperands, walk, mmas, pipes, t: Int32, m_block: Int32, n_tiles: Int32,
                  softmax_scale_log2: Float32, score_scale, edge: cutlass.Constexpr[str]):
        """A masked tile at the walk's `edge` end: the masked body, or, where no query of the tile sees
        the 64 keys past that edge (the last ones past a right edge, the first ones before a left
        edge: ``schedule.keys_hidden``), the half-tile body. Two whole body copies behind one branch:
        a branch around the wgmmas inside a body makes ptxas serialize them."""
        hidden_wg = schedule.IDLE_WARPGROUP[edge]
        key_limit, diag = schedule.mask_bounds(m_block, walk.n_block, self.tile_m, self.tile_n, walk.seqlen_q,
                                               walk.seqlen_k)
        if schedule.idle_warpgroup_hidden(edge, key_limit, diag, self.tile_m, self.causal, self.window_or_none):
            if o.wg == hidden_wg:
                self.idle_tile(o, mmas, pipes, t, n_tiles, dq_keys=1 - hidden_wg)
            else:
                self.consume_tile(o, walk, mmas, pipes, t, m_block, n_tiles, softmax_scale_log2, True, score_scale,
                                  dq_keys=1 - hidden_wg)
        else:
            self.consume_tile(o, walk, mmas, pipes, t, m_block, n_tiles, softmax_scale_log2, True, score_scale)

    @cute.jit
    def idle_tile(self, o: ConsumerOperands, mmas, pipes, t: Int32, n_tiles: Int32, dq_keys: cutlass.Constexpr[int]):
        """Tile t for the warpgroup whose keys no query of the tile sees: no S^T, dP^T, dV or dK, only
        its share of dQ over the other warpgroup's keys (their dS^T in sdSt), and every barrier
        consume_tile takes, so that both warpgroups stay in step."""
        st = self.tile_state(t, producer=False)
        pipes.q.consumer_wait(st)
        pipes.do.consumer_wait(st)
        self.sdst_free_wait(o, t)
        self.consumers_meet(divergent=True)  # B2
        acc_dQ = self.issue_dq(o, mmas, t % self.ds_buffers, dq_keys)
        warpgroup.wait_group(0)
        self.sdst_free_arrive(o, t, n_tiles)
        pipes.do.consumer_release(st)
        self.hand_off_dq(o, acc_dQ, t)
        pipes.q.consumer_release(st)
        trace.stamp(t, "end")

    @cute.jit
    def sdst_free_wait(self, o: ConsumerOperands, t: Int32):
        """One dS^T buffer: wait until the other warpgroup's dQ wgmma of tile t - 1 has read sdSt."""
        if const_expr(self.ds_buffers == 1):
            if t > 0:
                cute.arch.barrier(barrier_id=SDST_FREE_BARRIER + o.wg, number_of_threads=NUM_CONSUMER_THREADS)

    @cute.jit
    def sdst_free_arrive(self, o: ConsumerOperands, t: Int32, n_tiles: Int32):
        """One dS^T buffer: this warpgroup's dQ wgmma has read sdSt, the other may overwrite it (a next
        tile follows)."""
        if const_expr(self.ds_buffers == 1):
            if t + 1 < n_tiles:
                cute.arch.barrier_arrive(barrier_id=SDST_FREE_BARRIER + NUM_WG_MMA - 1 - o.wg,
                                         number_of_threads=NUM_CONSUMER_THREADS)

    def consumers_meet(self, divergent: bool):
        """B2, both consumer warpgroups: the non-aligned barrier where a half tile's two bodies meet at it
        from different instructions (common.barrier_sync_divergent), bar.sync elsewhere."""
        if const_expr(divergent):
            common.barrier_sync_divergent(CONSUMER_BARRIER, NUM_CONSUMER_THREADS)
        else:
            cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=NUM_CONSUMER_THREADS)

    def issue_dq(self, o: ConsumerOperands, mmas, ds_buf: Int32, dq_keys=None) -> cute.Tensor:
        """This warpgroup's share of dQ_i = dS K_j as one wgmma group (fenced, not waited for); dq_keys
        0 / 1: over the first / second 64 keys only (half tiles) -> the accumulator."""
        acc_dQ = cute.make_rmem_tensor(o.thr_dQ.partition_shape_C(o.dq_shape), Float32)
        warpgroup.fence()
        if const_expr(self.dq_swap_ab):
            gemm_issue(mmas.dQ, acc_dQ, o.tdQrA, o.tdQrB[None, None, None, ds_buf], zero_init=True, k_half=dq_keys)
        else:
            gemm_issue(mmas.dQ, acc_dQ, o.tdQrA[None, None, None, ds_buf], o.tdQrB, zero_init=True, k_half=dq_keys)
        return acc_dQ

    @cute.jit
    def consume_tile(self, o: ConsumerOperands, walk, mmas, pipes, t: Int32, m_block: Int32, n_tiles: Int32,
                     softmax_scale_log2: Float32, masked: cutlass.Constexpr[bool], score_scale=None,
                     dq_keys: cutlass.Constexpr = None):
        """Tile t of the walk (Q tile m_block): the wgmma order of the module docstring. dq_keys 0 / 1
        (half tiles, edge_tile): dQ over those 64 keys only, the others' dS^T being 0."""
        tm, tn = self.tile_m, self.tile_n
        st = self.tile_state(t, producer=False)
        q_rows_left = walk.seqlen_q - m_block * tm

        acc_S, acc_dP = self.issue_scores(o, mmas, pipes, st)
        # this lane's 4 lse2 (stats_shuffle) now, so the LDS runs under the S^T wait
        sLSE2_t, sD_t = o.sLSE2[None, st.index], o.sD[None, st.index]  # this tile's statistics
        lse2_quad = self.load_quad_stats(sLSE2_t)

        # P^T = exp2(S^T * scale_log2 - lse2), masked (scores.py)
        warpgroup.wait_group(1)
        acc_S_rc, tanh_from_p = self.tile_exp(o, acc_S, walk, m_block, q_rows_left, sLSE2_t, lse2_quad,
                                              softmax_scale_log2, masked, score_scale)
        # P^T's 16-bit A fragment of dV (the accumulator's register order), packed in form_ds
        tdVrPt = cute.make_rmem_tensor(o.thr_dV.partition_shape_A((tn, tm)), self.dtype)
        tdVrPt_acc = cute.make_tensor(tdVrPt.iterator, cute.make_layout(acc_S.shape))

        # dS^T = P^T * (dP^T - D) -> 16-bit A fragment of dK, and -> sdSt for dQ
        warpgroup.wait_group(0)  # dP^T
        tdKrdSt = self.form_ds(o, acc_S, acc_S_rc, acc_dP, sD_t, tdVrPt_acc, tanh_from_p)
        ds_buf = t % self.ds_buffers
        self.sdst_free_wait(o, t)
        tdSrdS = cute.make_tensor(tdKrdSt.iterator, cute.make_layout(acc_dP.shape))
        cute.copy(o.smem_copy_dS, o.thr_smem_dS.retile(tdSrdS), o.tdSsdSt[None, None, None, ds_buf])
        warpgroup.fence()
        gemm_issue(mmas.dV, o.acc_dV, tdVrPt, o.tdVrdOt[None, None, None, st.index], zero_init=False)  # dV += P^T dO
        cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> wgmma reads
        self.consumers_meet(divergent=dq_keys is not None)  # B2

        # dQ_i = dS K_j (this warpgroup's share), then dK += dS^T Q_i
        acc_dQ = self.issue_dq(o, mmas, ds_buf, dq_keys)
        gemm_issue(mmas.dK, o.acc_dK, tdKrdSt, o.tdKrQt[None, None, None, st.index], zero_init=False)
        warpgroup.wait_group(1)  # dV and dQ done, dK may run
        self.sdst_free_arrive(o, t, n_tiles)
        pipes.do.consumer_release(st)   # dP^T and dV have read dO_i
        self.hand_off_dq(o, acc_dQ, t)
        warpgroup.wait_group(0)  # dK has read Q_i: the Q/dO stage goes back
        pipes.q.consumer_release(st)
        trace.stamp(t, "end")  # no code unless tracing is on

    @cute.jit
    def tile_exp(self, o: ConsumerOperands, acc_S: cute.Tensor, walk, m_block: Int32, q_rows_left: Int32,
                 sLSE2_t: cute.Tensor, lse2_quad, softmax_scale_log2: Float32, masked: cutlass.Constexpr[bool],
                 score_scale=None):
        """P^T of Q tile m_block in place of S^T (scores.py) -> (its row-column view, with softcap what
        dS^T needs to recover the tanh from P^T (scores.TanhFromP), else None)."""
        tm, tn = self.tile_m, self.tile_n
        acc_S_rc = acc_rowcol(acc_S)
        key_limit, diag = schedule.mask_bounds(m_block, walk.n_block, tm, tn, walk.seqlen_q, walk.seqlen_k)
        tanh_from_p = None
        if const_expr(self.score_mod.on):
            tanh_from_p = TanhFromP(sLSE2_t, Float32(1.0) / softmax_scale_log2)
        self.exp_scores(acc_S_rc, o.tScS_rc, sLSE2_t, lse2_quad, softmax_scale_log2, key_limit, diag,
                        q_rows_left, masked=masked, tScS0_rc=o.tScS0_rc, score_scale=score_scale)
        return acc_S_rc, tanh_from_p

    @cute.jit
    def issue_scores(self, o: ConsumerOperands, mmas, pipes, st: pipeline.PipelineState):
        """S^T = K Q_i^T as soon as Q_i has landed, dP^T = V dO_i^T when dO_i has (two wgmma groups,
        not waited for) -> their accumulators."""
        acc_S = cute.make_rmem_tensor(o.thr_SdP.partition_shape_C((self.tile_n, self.tile_m)), Float32)
        acc_dP = cute.make_rmem_tensor(o.thr_SdP.partition_shape_C((self.tile_n, self.tile_m)), Float32)
        pipes.q.consumer_wait(st)
        warpgroup.fence()
        gemm_issue(mmas.SdP, acc_S, o.tSrK, o.tSrQ[None, None, None, st.index], zero_init=True)
        pipes.do.consumer_wait(st)
        gemm_issue(mmas.SdP, acc_dP, o.tPrV, o.tPrdO[None, None, None, st.index], zero_init=True)
        return acc_S, acc_dP

    @cute.jit
    def form_ds(self, o: ConsumerOperands, acc_S: cute.Tensor, acc_S_rc: cute.Tensor, acc_dP: cute.Tensor,
                sD_t: cute.Tensor, tdVrPt_acc: cute.Tensor, tanh_from_p=None):
        """dS^T = P^T * (dP^T - D) in acc_dP (softcap: times the tanh's derivative, from P^T), then its
        16-bit copy (the A fragment of dK, returned); P^T is packed for dV only now."""
        self.ds_in_place(o, acc_S_rc, acc_dP, sD_t, tanh_from_p)
        # P^T packed only now: the fp32 P^T, the 16-bit copy and dP^T are never all live
        tdVrPt_acc.store(acc_S.load().to(self.dtype))
        tdKrdSt = cute.make_rmem_tensor(o.thr_dK.partition_shape_A((self.tile_n, self.tile_m)), self.dtype)
        tdSrdS = cute.make_tensor(tdKrdSt.iterator, cute.make_layout(acc_dP.shape))
        tdSrdS.store(acc_dP.load().to(self.dtype))
        return tdKrdSt

    @cute.jit
    def ds_in_place(self, o: ConsumerOperands, acc_S_rc: cute.Tensor, acc_dP: cute.Tensor, sD_t: cute.Tensor,
                    tanh_from_p=None):
        """acc_dP := dS^T = P^T * (dP^T - D), times the tanh's derivative with softcap (recovered from
        P^T: scores.TanhFromP)."""
        acc_dP_rc = acc_rowcol(acc_dP)
        dpsum_quad = self.load_quad_stats(sD_t)
        lse2_quad = None
        if const_expr(tanh_from_p is not None):
            lse2_quad = self.load_quad_stats(tanh_from_p.sLSE2)  # loaded again: not held across the tile
        rows = cute.size(acc_dP_rc, mode=[0])
        for c in cutlass.range_constexpr(cute.size(o.tScS_rc, mode=[1])):
            col = o.tScS_rc[0, c][1]
            dpsum = self.column_stat(sD_t, dpsum_quad, c, col)
            lse2 = None
            if const_expr(tanh_from_p is not None):
                lse2 = self.column_stat(tanh_from_p.sLSE2, lse2_quad, c, col)
            for r in cutlass.range_constexpr(rows):
                ds = acc_S_rc[r, c] * (acc_dP_rc[r, c] - dpsum)
                if const_expr(tanh_from_p is not None):
                    ds = ds * self.softcap_grad(acc_S_rc[r, c], lse2, tanh_from_p.inv_scale_log2)
                acc_dP_rc[r, c] = ds

    @cute.jit
    def hand_off_dq(self, o: ConsumerOperands, acc_dQ: cute.Tensor, t: Int32):
        """dQ_i to the writer warp: sdQ[buf] free (t >= buffers) -> store -> proxy fence -> arrive."""
        buf = t % self.dq_buffers
        if t >= self.dq_buffers:
            self.dq_empty(buf, o.wg, wait=True)
        if const_expr(self.dq_frag):
            dst = o.tQsQ_frag[None, None, buf * NUM_WG_MMA + o.wg]
            cute.autovec_copy(cute.make_tensor(acc_dQ.iterator, dst.layout.shape), dst)
        else:
            cute.copy(o.smem_copy_dQ, o.thr_smem_dQ.retile(acc_dQ), o.thr_smem_dQ.partition_D(o.sdQ[None, None, buf]))
        cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> bulk-copy reads
        self.dq_full(buf, wait=False)
