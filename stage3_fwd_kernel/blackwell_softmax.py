"""The softmax and correction warpgroups of the Blackwell forward (``blackwell_fwd.py``).

Two softmax warpgroups (one at d = 256) each own one 128-row Q tile (thread r holds row r of S); a
correction warpgroup rescales O in TMEM when a row max moved and writes the final O / l and lse.
They are methods of a mixin so the kernel class keeps the MMA, load and epilogue roles and the
pipeline wiring. The mixin reads the kernel's plan attributes: ``cfg``, ``tm``, ``tn``, ``dv``,
``num_q``, ``dtype``, ``causal``, ``window``, ``left_window``, ``mask``, ``score_mod``, ``varlen``, ``policy``,
``tmem``, ``p_chunk_cols``, ``s_chunk``, ``persistent``, and its helpers ``_bar``, ``_tmem_tensors``,
``o_tile_row0`` and the phase counters of persistent builds ``_walk_step``, ``_scale_step``, ``_tile_parity``
(identities in a one-tile build; blackwell_persistent.py).

Variants (compile-time; a plain build generates none of their code): a softcap turns S into
tanh(S * score_scale) right after the tcgen05.ld, before the mask and the max (components.score_mod);
a learnable sink joins the final row sum in the correction warpgroup (components.sink.finish_row);
a left window makes the walk start at key block n_block_min, and the blocks walked first that
cross some row's left edge go through the masked step (components.block_range, components.mask).
"""
from __future__ import annotations

import functools
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import tcgen05

from stage2_emulated_exp.gpu_kernel import ex2_approx_f32, fma_rn_f32
from stage3_fwd_kernel.blackwell_sync import opaque_i32, tcgen05_fence_after_sync, tcgen05_fence_before_sync
from stage3_fwd_kernel.components import block_range
from stage3_fwd_kernel.components.score_mod import LOG2_E
from stage3_fwd_kernel.components.sink import finish_row
from stage3_fwd_kernel.softmax_policy import exp2_row_packed, rescale_vote, row_sum_packed, scale_row_packed

LN2 = math.log(2.0)
# No "exp turn" between the two softmax warpgroups (a named-barrier ping-pong, removed), as in the
# official kernel: its section (exp2, pack, P stores) was ~1210 of a warp's ~1490 static issue cycles
# a key block, so two warpgroups in turn needed >= 2 x 1210 > the 2048 MMA cycles of a key block at
# d = 128, while the MUFU work it kept apart (2 x 904 a sub-partition) is the same either way
# (sass_schedule.py; docs/measurements.md, 2026-11-29).


class SoftmaxCorrectionRoles:
    """Device code of the softmax warpgroups (rows of S -> P in TMEM) and the correction warpgroup."""

    # ------------------------------------------------------------------ softmax warpgroups
    @cute.jit
    def softmax(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, n_blocks: Int32,
                softmax_scale_log2: Float32, mbar: cute.Pointer, tmem_ptr: cute.Pointer,
                thr_mma_qk: cute.ThrMma, score_scale: Float32 | None = None, n_block_min: Int32 | None = None,
                blocks_done: Int32 | None = None):
        """One warpgroup, one Q tile: thread r owns row r. Per key block: S row -> registers, (softcap),
        mask, row max + warp vote (conditional rescaling), rescale factor -> TMEM for the correction
        warpgroup, exp2 (partial emulation), P -> TMEM in 3/4 + 1/4. The walk is key blocks
        [n_block_min, n_block_min + n_blocks) (n_block_min None: from 0). blocks_done: persistent
        builds, the key blocks of the CTA's earlier tiles (s_full's phase counts on from them)."""
        tidx = cute.arch.thread_idx()[0] % 128
        # which Q tile: re-derived here rather than carried from the kernel prologue, where every
        # live value must also fit the small register budget of the fourth warpgroup
        stage = cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // 128)
        tStS, tScS, tStP, tScP = self.s_p_tmem_views(tmem_ptr, stage, thr_mma_qk)
        tiled_t2r = tcgen05.make_tmem_copy(self.s_load_atom(), tStS)
        thr_t2r = tiled_t2r.get_slice(tidx)
        tStS_t2r = thr_t2r.partition_S(tStS)
        tScS_t2r = thr_t2r.partition_D(tScS)
        tiled_r2t = tcgen05.make_tmem_copy(self.p_store_atom(), tStP)
        thr_r2t = tiled_r2t.get_slice(tidx)
        tStP_r2t = thr_r2t.partition_D(tStP)
        tSrP_shape = thr_r2t.partition_S(cute.make_tensor(tScS.iterator, tScP)).shape
        # rescale factor (1 column) and final row sum / row max (2 columns)
        tStScale = cute.make_tensor(tStS.iterator + (self.tmem.scale[0] - self.tmem.s[0]),
                                    cute.composition(tStS.layout, cute.make_layout((self.tm, 1))))
        tStFinal = self.final_stats_view(tStS, self.tmem.final[0] - self.tmem.s[0])
        tiled_r2t_1 = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(1)), Float32), tStScale)
        tiled_r2t_2 = tcgen05.make_tmem_copy(self.final_stats_atom(store=True), tStFinal)
        tStScale_r2t = tiled_r2t_1.get_slice(tidx).partition_D(tStScale)
        tStFinal_r2t = tiled_r2t_2.get_slice(tidx).partition_D(tStFinal)
        # register fragments take their shapes from a coordinate tensor (TMEM partitions are per warp)
        rScale = cute.make_rmem_tensor(tiled_r2t_1.get_slice(tidx).partition_S(
            cute.make_identity_tensor((self.tm, 1))).shape, Float32)
        rFinal = cute.make_rmem_tensor(tiled_r2t_2.get_slice(tidx).partition_S(
            cute.make_identity_tensor((self.tm, 2))).shape, Float32)

        row0 = m_block * self.cfg.cta_tile_m + stage * self.tm         # first row of the tile
        row = row0 + tScS_t2r[0][0]                                     # this thread's row (= tidx)
        row_max = cute.make_rmem_tensor((1,), Float32)
        row_max[0] = -Float32.inf
        row_sum = Float32(0.0)

        # key blocks every row of this tile sees in full need no mask; the rest (the last block
        # when seqlen_k % 128 != 0, and for causal the blocks crossing the diagonal) are masked.
        # Two loops, so the unmasked one -- almost all of them -- carries no masking code at all.
        n_unmasked = cutlass.min(n_blocks, block_range.num_unmasked_blocks(row0, seqlen_q, seqlen_k, tile_n=self.tn,
                                                                          window=self.window))
        step = functools.partial(
            self.softmax_step, stage=stage, row=row, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
            softmax_scale_log2=softmax_scale_log2, mbar=mbar, row_max=row_max, tiled_t2r=tiled_t2r,
            tStS_t2r=tStS_t2r, tScS_t2r=tScS_t2r, tiled_r2t=tiled_r2t, tStP_r2t=tStP_r2t, tSrP_shape=tSrP_shape,
            tiled_r2t_1=tiled_r2t_1, tStScale_r2t=tStScale_r2t, rScale=rScale, score_scale=score_scale,
            n_block_min=n_block_min, blocks_done=blocks_done)

        if const_expr(not (self.left_window or self.score_mod.on)):
            for n_block in cutlass.range(n_unmasked, unroll=1):
                row_sum = step(n_block=n_block, row_sum=row_sum, masked=False)
            for n_block in cutlass.range(n_unmasked, n_blocks, unroll=1):
                row_sum = step(n_block=n_block, row_sum=row_sum, masked=True)
        else:
            # softcap / left window: one loop whose walk step i takes a warp-uniform branch to the
            # mask-free body when it is past the n_left steps that cross some row's left edge and
            # before the first block masked on the right (num_unmasked_blocks counts blocks from 0;
            # step i is key block n_block_min + i). The plain builds' two loops (or Hopper's three)
            # spilled here at 192 registers: 12-36 spill stores at d = 128 window, d = 192 softcap
            n_left, first = 0, 0
            if const_expr(self.left_window):
                n_left = block_range.num_left_masked_blocks(m_block * self.num_q + stage, seqlen_q, seqlen_k,
                                                            n_block_min, n_blocks, tile_m=self.tm, tile_n=self.tn,
                                                            window=self.window)
                first = n_block_min
            hot_end = cutlass.max(block_range.num_unmasked_blocks(row0, seqlen_q, seqlen_k, tile_n=self.tn,
                                                                  window=self.window) - first, n_left)
            hot_len = cutlass.Uint32(cutlass.min(hot_end, n_blocks) - n_left)  # one compare per step
            for i in cutlass.range(n_blocks, unroll=1):
                unmasked = cutlass.Uint32(i - n_left) < hot_len  # (the protocol checker may fix it)
                if unmasked:
                    row_sum = step(n_block=i, row_sum=row_sum, masked=False)
                else:
                    row_sum = step(n_block=i, row_sum=row_sum, masked=True)

        # after the last block: the final statistics for the correction warpgroup, in their own
        # TMEM columns (it may not have read the last scale yet)
        rFinal[0] = row_sum
        rFinal[1] = row_max[0]
        cute.copy(tiled_r2t_2, rFinal, tStFinal_r2t)
        cute.arch.fence_view_async_tmem_store()
        tcgen05_fence_before_sync()
        cute.arch.mbarrier_arrive(self._bar(mbar, "final_full", 0) + stage)

    # S_stage / P_stage addressing and the tcgen05 copies that move them; methods so that
    # blackwell_tmem_check evaluates exactly these at trace time
    def s_p_tmem_views(self, tmem_base, stage, thr_mma_qk):
        """(tStS, tScS, tStP, tScP): S_stage in TMEM and its coordinates, and P_stage (16-bit values
        packed in pairs, p_cols fp32 columns over the upper half of S_stage) and its coordinates.
        `tmem_base` may be a plain int: the views are then counting tensors of TMEM addresses."""
        tStS_layout = thr_mma_qk.make_fragment_C(thr_mma_qk.partition_shape_C((self.tm, self.tn))).layout
        tStS = cute.make_tensor(tmem_base + self.tmem.s[0] + stage * self.tn, tStS_layout)
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((self.tm, self.tn)))
        p_cols = cute.make_layout((self.tm, self.tmem.p_cols))
        p_off = self.tmem.p[0] - self.tmem.s[0]
        tStP = cute.make_tensor(tStS.iterator + p_off, cute.composition(tStS.layout, p_cols))
        tScP = cute.composition(tScS.layout, p_cols)
        return tStS, tScS, tStP, tScP

    def s_load_atom(self):
        """S: 32 columns per tcgen05.ld (32x32b: lane = row = thread, one column per register)."""
        return cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32)

    def p_store_atom(self):
        """P: p_chunk_cols fp32 columns (2 x as many 16-bit values) per tcgen05.st 32x32b."""
        return cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(self.p_chunk_cols)), Float32)

    @cute.jit
    def softmax_step(self, n_block: Int32, row_sum: Float32, masked: cutlass.Constexpr[bool], stage: Int32,
                     row: Int32, seqlen_q: Int32, seqlen_k: Int32, softmax_scale_log2: Float32,
                     mbar: cute.Pointer, row_max: cute.Tensor, tiled_t2r: cute.TiledCopy, tStS_t2r: cute.Tensor,
                     tScS_t2r: cute.Tensor, tiled_r2t: cute.TiledCopy, tStP_r2t: cute.Tensor,
                     tSrP_shape: cutlass.Constexpr, tiled_r2t_1: cute.TiledCopy, tStScale_r2t: cute.Tensor,
                     rScale: cute.Tensor, score_scale: Float32 | None = None,
                     n_block_min: Int32 | None = None, blocks_done: Int32 | None = None) -> Float32:
        """Step `n_block` of one softmax warpgroup's walk (key block n_block_min + n_block with a left
        window; the barrier phases count the walk's steps); returns the running row sum."""
        # 1. S row -> registers (4 x tcgen05.ld 32x32b.x32: lane = row = thread, a column per register)
        cute.arch.mbarrier_wait(self._bar(mbar, "s_full", 0) + stage, self._walk_step(blocks_done, n_block) % 2)
        tcgen05_fence_after_sync()
        tSrS = cute.make_rmem_tensor(tScS_t2r.shape, Float32)
        cute.copy(tiled_t2r, tStS_t2r, tSrS)
        cute.arch.fence_view_async_tmem_load()
        # 2. softcap (before the mask: -inf must stay -inf), then mask keys >= seqlen_k, (causal,
        #    bottom-right) keys right of this row's diagonal and (window) left of its left edge
        if const_expr(self.score_mod.on):
            self.score_mod.apply(tSrS, score_scale)
        if const_expr(masked):
            key_block = n_block
            if const_expr(n_block_min is not None):
                key_block = n_block_min + n_block
            self.mask.apply_row(tSrS, tScS_t2r, key_block, row, seqlen_q, seqlen_k)
        # 3. row max; the warp moves its maxima only if some row grew by more than tau
        row_max_new = cute.make_rmem_tensor((1,), Float32)
        m_old = row_max[0]
        row_max_new[0] = cute.arch.fmax(m_old, tSrS.load().reduce(cute.ReductionOp.MAX, -Float32.inf, 0))
        if rescale_vote(row_max, row_max_new, softmax_scale_log2, self.policy.rescale_threshold):
            row_max[0] = row_max_new[0]
        m_new = row_max[0]
        m_safe = Float32(0.0) if m_new == -Float32.inf else m_new  # nothing visible yet: P = 0
        bias = m_safe * softmax_scale_log2
        acc_scale = Float32(1.0)
        if m_new != m_old:
            # m_old * scale - bias: one FFMA, where (m_old - m_safe) * scale took two
            acc_scale = ex2_approx_f32(fma_rn_f32(m_old, softmax_scale_log2, -bias))
        row_sum = row_sum * acc_scale
        # 4. the factor O_i must be multiplied by before P(j) V(j) -> correction warpgroup
        if n_block > 0:
            rScale[0] = acc_scale
            cute.copy(tiled_r2t_1, rScale, tStScale_r2t)
            cute.arch.fence_view_async_tmem_store()
            tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "scale_full", 0) + stage)
        # 5. exp2 and P packed to 16 bits a quarter at a time, then the four P stores; after 3/4 the
        #    MMA warp may start O += P V. ptxas moves each store up to its quarter either way; in this
        #    order (the official kernel's) the packed polynomial fits the registers, where a store (or
        #    the scaling, or the sum) per quarter spilled.
        tSrP = cute.make_rmem_tensor(tSrP_shape, Float32)
        tSrP_16 = cute.make_tensor(cute.recast_ptr(tSrP.iterator, dtype=self.dtype), cute.make_layout(self.tn))
        tSrS_flat = cute.make_tensor(tSrS.iterator, cute.make_layout(self.tn))
        scale_row_packed(tSrS_flat, softmax_scale_log2, bias)
        pairs = self.policy.row_pair_pattern(self.tn)  # the emulated pairs: in the last quarter
        for q in cutlass.range_constexpr(self.cfg.p_store_chunks):
            chunk = cute.make_tensor(tSrS_flat.iterator + q * self.s_chunk, cute.make_layout(self.s_chunk))
            half = self.s_chunk // 2
            exp2_row_packed(chunk, self.policy, None if pairs is None else pairs[q * half:(q + 1) * half])
            chunk_16 = cute.make_tensor(tSrP_16.iterator + q * self.s_chunk, cute.make_layout(self.s_chunk))
            chunk_16.store(chunk.load().to(self.dtype))
        for q in cutlass.range_constexpr(self.cfg.p_store_chunks):
            cute.copy(tiled_r2t, tSrP[None, None, q], tStP_r2t[None, None, q])
            if const_expr(q == self.cfg.p_first_chunks - 1):
                cute.arch.fence_view_async_tmem_store()
                tcgen05_fence_before_sync()
                cute.arch.mbarrier_arrive(self._bar(mbar, "p_full", 0) + stage)
        cute.arch.fence_view_async_tmem_store()
        tcgen05_fence_before_sync()
        cute.arch.mbarrier_arrive(self._bar(mbar, "p_full_2", 0) + stage)
        return row_sum_packed(tSrS_flat, row_sum)

    # ------------------------------------------------------------------ correction warpgroup
    @cute.jit
    def correction(self, m_block: Int32, head: Int32, batch: Int32, offset_q: Int32, seqlen_q: Int32,
                   n_blocks: Int32, softmax_scale_log2: Float32, mbar: cute.Pointer, tmem_ptr: cute.Pointer,
                   sO: cute.Tensor, mLSE: cute.Tensor, thr_mma_qk: cute.ThrMma, thr_mma_pv: cute.ThrMma,
                   mSink: cute.Tensor | None = None, blocks_done: Int32 | None = None,
                   tiles_done: Int32 | None = None):
        """Rescale O_i in TMEM when the softmax moved a row max (warp-uniform skip otherwise), then
        O_i / l_i -> SMEM (16-bit) and lse -> global memory (mSink: the head's sink joins l_i).
        blocks_done / tiles_done: persistent builds, what the CTA's earlier tiles walked (phases)."""
        tidx = cute.arch.thread_idx()[0] % 128
        if const_expr(self.persistent):  # the tile's sO / TMEM addresses are computed per tile
            tidx = opaque_i32(tidx)
        tStS, tOtO, _ = self._tmem_tensors(tmem_ptr, thr_mma_qk, thr_mma_pv, None)
        # the per-step scale (1 column) and the final (row_sum, row_max) of each tile
        ld1 = cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(1)), Float32)
        ld2 = self.final_stats_atom(store=False)
        tStScale = [cute.make_tensor(tStS[i].iterator + (self.tmem.scale[i] - self.tmem.s[i]),
                                     cute.composition(tStS[i].layout, cute.make_layout((self.tm, 1))))
                    for i in range(self.num_q)]
        tStFinal = [self.final_stats_view(tStS[i], self.tmem.final[i] - self.tmem.s[i]) for i in range(self.num_q)]
        tiled_t2r_1 = tcgen05.make_tmem_copy(ld1, tStScale[0])
        tiled_t2r_2 = tcgen05.make_tmem_copy(ld2, tStFinal[0])
        tStScale_t2r = [tiled_t2r_1.get_slice(tidx).partition_S(t) for t in tStScale]
        tStFinal_t2r = [tiled_t2r_2.get_slice(tidx).partition_S(t) for t in tStFinal]
        # register fragments take their shapes from a coordinate tensor (TMEM partitions are per warp)
        rScale = cute.make_rmem_tensor(tiled_t2r_1.get_slice(tidx).partition_D(
            cute.make_identity_tensor((self.tm, 1))).shape, Float32)
        rFinal = cute.make_rmem_tensor(tiled_t2r_2.get_slice(tidx).partition_D(
            cute.make_identity_tensor((self.tm, 2))).shape, Float32)
        # O in chunks of 32 columns
        oc = self.O_CHUNK_COLS
        tOtO_c = self.o_chunk_views(tOtO)
        tiled_ld_o = tcgen05.make_tmem_copy(self.o_load_atom(), tOtO_c[0])
        tiled_st_o = tcgen05.make_tmem_copy(
            cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(oc)), Float32), tOtO_c[0])
        thr_ld_o, thr_st_o = tiled_ld_o.get_slice(tidx), tiled_st_o.get_slice(tidx)
        tOcO_t2r = self.o_register_coords(thr_ld_o)
        rO_shape = tOcO_t2r.shape
        tOcO_row = tOcO_t2r[0][0]  # the row this thread's TMEM lane holds (= tidx)
        n_oc = self.dv // oc

        # 1. key block 0: O_i has nothing to rescale (its first P V overwrites it). Persistent: that
        #    P V overwrites the previous tile's O_i, which this warpgroup read last (step 3)
        for i in cutlass.range_constexpr(self.num_q):
            if const_expr(self.persistent):
                tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "p_full", i))
        # 2. key blocks 1 .. n-1: O_i *= scale when any row of the warp moved its max
        for n_block in cutlass.range(1, n_blocks, unroll=1):
            for i in cutlass.range_constexpr(self.num_q):
                cute.arch.mbarrier_wait(self._bar(mbar, "scale_full", i),
                                        self._scale_step(blocks_done, tiles_done, n_block - 1) % 2)
                tcgen05_fence_after_sync()
                cute.copy(tiled_t2r_1, tStScale_t2r[i], rScale)
                cute.arch.fence_view_async_tmem_load()
                scale = rScale[0]
                if cute.arch.vote_any_sync(scale != 1.0):
                    for c in cutlass.range_constexpr(n_oc):
                        tO = cute.make_tensor(tOtO_c[i].iterator + c * oc, tOtO_c[i].layout)
                        tOtO_t2r = thr_ld_o.partition_S(tO)
                        rO = cute.make_rmem_tensor(rO_shape, Float32)
                        cute.copy(tiled_ld_o, tOtO_t2r, rO)
                        cute.arch.fence_view_async_tmem_load()
                        for e in cutlass.range_constexpr(0, cute.size(rO), 2):
                            rO[e], rO[e + 1] = cute.arch.mul_packed_f32x2((rO[e], rO[e + 1]), (scale, scale))
                        cute.copy(tiled_st_o, rO, thr_st_o.partition_D(tO))
                    cute.arch.fence_view_async_tmem_store()
                tcgen05_fence_before_sync()
                cute.arch.mbarrier_arrive(self._bar(mbar, "p_full", i))

        # 3. epilogue: O_i / l_i -> sO_i (16-bit), lse -> global; empty rows: O = 0, lse = -inf
        #    (with a sink: l_i and the sink share a maximum, components.sink; empty rows: lse = sink)
        sink_log2 = None
        if const_expr(mSink is not None):
            sink_log2 = mSink[head] * LOG2_E
        for i in cutlass.range_constexpr(self.num_q):
            cute.arch.mbarrier_wait(self._bar(mbar, "final_full", i), self._tile_parity(tiles_done))
            cute.arch.mbarrier_wait(self._bar(mbar, "o_full", i), self._tile_parity(tiles_done))
            tcgen05_fence_after_sync()
            cute.copy(tiled_t2r_2, tStFinal_t2r[i], rFinal)
            cute.arch.fence_view_async_tmem_load()
            if const_expr(self.persistent):  # the next tile's S_i = Q_i K^T may overwrite the statistics
                tcgen05_fence_before_sync()
                cute.arch.mbarrier_arrive(self._bar(mbar, "final_empty", i))
            row_sum, row_max = rFinal[0], rFinal[1]
            if const_expr(sink_log2 is None):
                empty = row_sum == 0.0 or row_sum != row_sum
                inv = Float32(0.0) if empty else cute.arch.rcp_approx(row_sum)
            else:
                empty = row_sum == 0.0  # saw no key: O = 0 below, lse = the sink
                inv, lse_sink = finish_row(row_sum, row_max * softmax_scale_log2, sink_log2)
            row = self.o_tile_row0(m_block, i) + tOcO_row
            if row < seqlen_q:
                if const_expr(sink_log2 is None):
                    lse = -Float32.inf
                    if not empty:
                        lse = (row_max * softmax_scale_log2 + cute.math.log2(row_sum, fastmath=True)) * LN2
                else:
                    lse = lse_sink
                mLSE[self.lse_coord(batch, head, offset_q, row)] = lse
            sO_i = sO[None, None, i]
            if const_expr(self.persistent):  # the epilogue warp has stored the previous tile's O_i
                cute.arch.mbarrier_wait(self._bar(mbar, "epi_empty", i), self._tile_parity(tiles_done) ^ 1)
            for c in cutlass.range_constexpr(n_oc):
                _, tOtO_t2r, tOsO_r2s = self.o_epilogue_chunk(thr_ld_o, tOtO_c[i], sO_i, c)
                rO = cute.make_rmem_tensor(rO_shape, Float32)
                cute.copy(tiled_ld_o, tOtO_t2r, rO)
                cute.arch.fence_view_async_tmem_load()
                for e in cutlass.range_constexpr(0, cute.size(rO), 2):
                    rO[e], rO[e + 1] = cute.arch.mul_packed_f32x2((rO[e], rO[e + 1]), (inv, inv))
                rO16 = cute.make_rmem_tensor(rO.shape, self.dtype)
                rO16.store(rO.load().to(self.dtype))
                if empty:  # 0 * (garbage or NaN) is not 0
                    rO16.fill(0.0)
                cute.autovec_copy(rO16, tOsO_r2s)
            cute.arch.fence_view_async_shared()  # generic-proxy writes -> visible to the TMA store
            cute.arch.mbarrier_arrive(self._bar(mbar, "epi_full", i))

    # O's way from TMEM to sO and the final statistics' hand-over, as methods so that
    # blackwell_epilogue_check traces exactly these
    O_CHUNK_COLS = 32  # O columns per tcgen05.ld / st of the correction warpgroup

    def final_stats_view(self, tStS_i, offset):
        """(row_sum, row_max) per row: 2 TMEM columns `offset` columns into S_i (lane = row)."""
        return cute.make_tensor(tStS_i.iterator + offset,
                                cute.composition(tStS_i.layout, cute.make_layout((self.tm, 2))))

    def final_stats_atom(self, store: bool):
        """tcgen05.st (softmax) / tcgen05.ld (correction) 32x32b.x2 of the final statistics."""
        op = tcgen05.copy.St32x32bOp if store else tcgen05.copy.Ld32x32bOp
        return cute.make_copy_atom(op(tcgen05.copy.Repetition(2)), Float32)

    def o_chunk_views(self, tOtO):
        """Each O_i as a (tm, O_CHUNK_COLS) view: the columns one tcgen05.ld / st moves."""
        layout = cute.make_layout((self.tm, self.O_CHUNK_COLS))
        return [cute.make_tensor(t.iterator, cute.composition(t.layout, layout)) for t in tOtO]

    def o_load_atom(self):
        """O: O_CHUNK_COLS columns per tcgen05.ld 32x32b (lane = row = thread, a column per register)."""
        return cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(self.O_CHUNK_COLS)), Float32)

    def o_register_coords(self, thr_ld_o):
        """(row, column in the chunk) of each register the O load fills."""
        return thr_ld_o.partition_D(cute.make_identity_tensor((self.tm, self.O_CHUNK_COLS)))

    def o_epilogue_chunk(self, thr_ld_o, tOtO_c, sO_i, c):
        """(chunk c of O_i in TMEM, its tcgen05.ld source, the sO_i elements its registers go to)."""
        oc = self.O_CHUNK_COLS
        tO = cute.make_tensor(tOtO_c.iterator + c * oc, tOtO_c.layout)
        return tO, thr_ld_o.partition_S(tO), thr_ld_o.partition_D(cute.local_tile(sO_i, (self.tm, oc), (0, c)))

    def lse_coord(self, batch, head, offset_q, row):
        """Where the lse of `row` (of this sequence) goes: mLSE (B, Hq, Sq), packed (Hq, Tq)."""
        if const_expr(not self.varlen):
            return batch, head, row
        return head, offset_q + row
