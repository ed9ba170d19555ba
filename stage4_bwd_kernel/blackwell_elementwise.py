"""The elementwise warpgroup of the Blackwell backward (``blackwell_bwd.py``; the 2-CTA kernel reuses it).

WG 0, thread r = key r = TMEM lane r: lse2 / D to SMEM, P^T = exp2(S^T * scale_log2 - lse2) with the
mask hoisted to one threshold column, dS = P (dP - D) to TMEM (for dK) and SMEM (for dQ), and at the
end dV and scale * dK from TMEM to global memory. A mixin, so the kernel class keeps the MMA, load and
dQ roles and the pipeline wiring. It reads the kernel's ``tm``, ``tn``, ``d``, ``dv``, ``dtype``,
``causal``, ``varlen``, ``tmem``, ``window_or_none``, ``score_mod`` and its helpers ``_bar`` and ``_tmem_acc``.

Variants (the 1-CTA kernel; compiled, never run): a window masks both edges with one threshold column
per edge (``mask_col_min`` / ``mask_col_max``, equal to schedule.is_masked); softcap takes tanh of the
scaled S^T before the exp and keeps P * (1 - tanh^2) for dS.

Varlen (the 1-CTA kernel): lse2 / D rows start at the sequence's ``common.stats_offset`` (the
preprocess's varlen layout), dK / dV rows at its offset_k; the guards stay in the sequence's own
coordinates (row < seqlen_q, key < its key rows), so nothing lands in the next sequence's rows.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import tcgen05

from stage3_fwd_kernel.blackwell_sync import tcgen05_fence_after_sync, tcgen05_fence_before_sync
from stage4_bwd_kernel import common, schedule
from stage4_bwd_kernel.blackwell_config import mask_col_max, mask_col_min

BAR_STATS = 2        # WG 0: sLSE / sD written / consumed (named barrier id)


class ElementwiseRoles:
    """Device code of the backward's elementwise warpgroup: P^T, dS^T / dS and the dK / dV epilogue."""

    # ------------------------------------------------------------------ elementwise warpgroup
    def _packed_row(self, row, offset):
        """Row `row` of the sequence in its tensor: varlen adds the sequence's first packed row; dense
        (offset unused) emits nothing, so the dense builds trace exactly as before."""
        if self.varlen:
            return offset + row
        return row

    def _dkdv_keeps(self, key_g, seqlen_k):
        """Whether the epilogue stores key key_g's dK / dV row: keys of the sequence only (a partial last
        K/V tile reads the next sequence's keys, or TMA's zeros, and must not write over them)."""
        return key_g < seqlen_k

    def _dkdv_chunk0(self, width: int):
        """The first 32-column chunk of dK / dV (width columns a CTA) this CTA stores: 0 when it owns the
        whole head dim (a Python int: no code); the wide kernel's head-dim split overrides it."""
        return 0

    def _ds_smem_chunk(self, sdS: cute.Tensor, key, c: int) -> cute.Tensor:
        """The 32 16-bit SMEM elements dS[32c : 32c + 32, key] of the dQ MMA's dS operand (thread = key):
        here the A operand of dQ = dS K, MN-major (queries contiguous)."""
        col = sdS[((None, None), key % 16), 0, key // 16, 0]       # dS[:, key]: (64, 2) of 16-bit
        ch = 32
        return cute.local_tile(col[None, (c * ch) // 64], (ch,), ((c * ch % 64) // ch,))

    def _dkdv_dst(self, mOut, batch, key_g, head_kv, c, offset_k):
        """The 32 global elements chunk c of key key_g's dK / dV row is stored to (key_g counted in the
        sequence; varlen: packed row offset_k + key_g). Plain Python: the layout check evaluates it."""
        return cute.local_tile(mOut[batch, self._packed_row(key_g, offset_k), head_kv, None], (32,), (c,))

    def _row_copies(self, accS: cute.Tensor, tidx):
        """TMEM <-> register copies of one 128-lane fp32 accumulator (thread r = lane r): 32-column
        loads, and stores of 32 16-bit values packed into 16 columns. Shared with the 2-CTA kernel."""
        tn, ch = self.tn, 32
        sub = lambda t, off, w: cute.make_tensor(t.iterator + off, cute.composition(t.layout, cute.make_layout((tn, w))))  # noqa: E731
        ld = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(ch)), Float32),
                                    sub(accS, 0, ch))
        st16 = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(ch // 2)),
                                                          Float32), sub(accS, 0, ch // 2))
        thr_ld, thr_st = ld.get_slice(tidx), st16.get_slice(tidx)
        r_shape = thr_ld.partition_D(cute.make_identity_tensor((tn, ch))).shape
        r16_shape = thr_st.partition_S(cute.make_identity_tensor((tn, ch // 2))).shape
        return sub, ld, st16, thr_ld, thr_st, r_shape, r16_shape

    @cute.jit
    def _stage_stats(self, tidx: Int32, batch: Int32, head: Int32, m_block: Int32, seqlen_q: Int32,
                     mLSE2: cute.Tensor, mD: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor, stats_row0=None):
        """lse2 / D of this Q tile -> SMEM (rows past the sequence: lse2 = +inf -> P = 0, D = 0).
        stats_row0 (varlen): the sequence's first row in the preprocess's lse2 / D rows."""
        cute.arch.barrier(barrier_id=BAR_STATS, number_of_threads=128)
        if const_expr(self.tm < 128):
            if tidx < self.tm:  # a 64-query tile (the wide kernel): half the warpgroup stages it
                self._stage_stats_row(tidx, batch, head, m_block, seqlen_q, mLSE2, mD, sLSE, sD, stats_row0)
        else:
            self._stage_stats_row(tidx, batch, head, m_block, seqlen_q, mLSE2, mD, sLSE, sD, stats_row0)
        cute.arch.barrier(barrier_id=BAR_STATS, number_of_threads=128)

    @cute.jit
    def _stage_stats_row(self, tidx: Int32, batch: Int32, head: Int32, m_block: Int32, seqlen_q: Int32,
                         mLSE2: cute.Tensor, mD: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor, stats_row0):
        row = m_block * self.tm + tidx
        lse2, dsum = Float32.inf, Float32(0.0)
        if row < seqlen_q:
            srow = self._packed_row(row, stats_row0)
            lse2, dsum = mLSE2[batch, head, srow], mD[batch, head, srow]
        sLSE[tidx], sD[tidx] = lse2, dsum

    @cute.jit
    def _tmem_load_row(self, dst: cute.Tensor, chunk, ld: cute.TiledCopy, thr_ld, r_shape: cutlass.Constexpr,
                       n_chunks: cutlass.Constexpr[int]):
        """dst[0 : 32 n_chunks] <- this thread's TMEM lane, 32 fp32 columns per load (chunk(c): the
        TMEM view of chunk c), then the fence that makes the loaded registers readable."""
        ch = 32
        for c in cutlass.range_constexpr(n_chunks):
            r = cute.make_rmem_tensor(r_shape, Float32)
            cute.copy(ld, thr_ld.partition_S(chunk(c)), r)
            for j in cutlass.range_constexpr(ch):
                dst[c * ch + j] = r[j]
        cute.arch.fence_view_async_tmem_load()

    def _mask_score(self, s, c: int, col_min, col_max):
        """Score s of query column c -> -inf where masked: c < col_min, and (a left edge) c > col_max."""
        s = Float32(cutlass.select_(col_min > c, -Float32.inf, s))
        if col_max is not None:
            s = Float32(cutlass.select_(col_max < c, -Float32.inf, s))
        return s

    @cute.jit
    def _exp_row(self, rP: cute.Tensor, accS: cute.Tensor, sub, ld: cute.TiledCopy, thr_ld, r_shape: cutlass.Constexpr,
                 key: Int32, key_limit: Int32, diag: Int32, need_mask, softmax_scale_log2: Float32, sLSE: cute.Tensor,
                 softcap_scale=None, store_p=None, r16_shape: cutlass.Constexpr = None):
        """rP = P^T row of key `key`: exp2(S^T * scale_log2 - lse2), masked -> 0 (S^T read from TMEM).
        Softcap: _softcap_row, which also stores P^T (store_p) and returns P * (1 - tanh^2)."""
        tm, ch = self.tm, 32
        if const_expr(not self.score_mod.on):
            self._tmem_load_row(rP, lambda c: sub(accS, c * ch, ch), ld, thr_ld, r_shape, tm // ch)
        # schedule.is_masked hoisted to one threshold column per thread and edge (blackwell_config.mask_col_min)
        col_min = Int32(0)
        if need_mask:
            col_min = mask_col_min(key, key_limit, diag, tm, self.causal, imax=cutlass.max,
                                   select=lambda c, a, b: cutlass.select_(c, Int32(a), Int32(b)),
                                   window=self.window_or_none)
        # a left edge: exact on every tile (unmasked ones never reach it), None (no code) without one
        col_max = mask_col_max(key, diag, self.window_or_none)
        if const_expr(self.score_mod.on):
            self._softcap_row(rP, accS, sub, ld, thr_ld, r_shape, col_min, col_max, softmax_scale_log2, sLSE,
                              softcap_scale, store_p, r16_shape)
        else:
            for c in cutlass.range_constexpr(tm):
                s = rP[c] * softmax_scale_log2 - sLSE[c]
                rP[c] = cute.math.exp2(self._mask_score(s, c, col_min, col_max), fastmath=True)

    @cute.jit
    def _softcap_row(self, rP: cute.Tensor, accS: cute.Tensor, sub, ld: cute.TiledCopy, thr_ld,
                     r_shape: cutlass.Constexpr, col_min: Int32, col_max, softmax_scale_log2: Float32,
                     sLSE: cute.Tensor, softcap_scale: Float32, store_p, r16_shape: cutlass.Constexpr):
        """The softcap P^T row (components.score_mod; the caller passes scale_log2 = softcap * log2(e)
        and softcap_scale = softmax_scale): t = tanh(S^T * softmax_scale / softcap), P = exp2(t *
        scale_log2 - lse2) masked; P -> 16-bit (in pairs) -> TMEM one
        32-column chunk at a time (store_p(packed, chunk)); rP keeps P * (1 - t^2), the only form in
        which dS = P (dP - D) dtanh needs P, so the derivative takes no register of its own.
        Chunk by chunk, last first: P^T chunk k lands in S^T columns [tn/2 + 16k, +16), which the
        chunks >= k already read, and the row is never live as S, tanh and P at once (the whole-row
        load spilled 88 words at d = 128)."""
        tm, ch, T = self.tm, 32, self.tmem
        if const_expr(T.p - T.s < tm // 2):
            raise ValueError("softcap: the chunked P^T store needs P^T in the upper half of the S^T columns")
        tanh_scale = softcap_scale * (1.0 / self.score_mod.cap)   # Softcap.kernel_scales' score_scale
        pair = cute.make_rmem_tensor((2,), Float32)
        for kk in cutlass.range_constexpr(tm // ch):
            k = tm // ch - 1 - kk
            self._tmem_load_row(cute.make_tensor(rP.iterator + k * ch, cute.make_layout(ch)),
                                lambda c: sub(accS, k * ch, ch), ld, thr_ld, r_shape, 1)
            packed = cute.make_rmem_tensor(r16_shape, Float32)   # 32 16-bit values, two a column
            for j in cutlass.range_constexpr(ch):
                c = k * ch + j
                t = cute.math.tanh(rP[c] * tanh_scale, approx=True)
                s = self._mask_score(t * softmax_scale_log2 - sLSE[c], c, col_min, col_max)
                pair[j % 2] = cute.math.exp2(s, fastmath=True)
                rP[c] = pair[j % 2] * (1.0 - t * t)
                if const_expr(j % 2 == 1):
                    v16 = cute.make_tensor(cute.recast_ptr(packed.iterator, dtype=self.dtype) + (j - 1),
                                           cute.make_layout(2))
                    v16.store(pair.load().to(self.dtype))
            store_p(packed, k)

    @cute.jit
    def _p_phase(self, it: Int32, tidx: Int32, batch: Int32, head: Int32, m_block: Int32, n_block: Int32,
                 seqlen_q: Int32, seqlen_k: Int32, softmax_scale_log2: Float32, mbar: cute.Pointer,
                 accS: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor,
                 sub, ld: cute.TiledCopy, st16: cute.TiledCopy, thr_ld, thr_st, r_shape: cutlass.Constexpr,
                 r16_shape: cutlass.Constexpr, stats_row0=None, softcap_scale=None) -> cute.Tensor:
        """The elementwise warpgroup's first half of a Q tile (both kernels): lse2 / D -> SMEM, wait for
        S^T, P^T row (thread = key) = exp2(S^T * scale_log2 - lse2), masked -> 0, in registers (returned)
        and as 16-bit P^T in TMEM, fenced for the MMA; the caller signals p_full its own way.
        seqlen_q / seqlen_k: the sequence's (varlen: its keys in use), stats_row0 as _stage_stats.
        Softcap (softcap_scale: softmax_scale, None without one): the returned row is P * (1 - tanh^2)."""
        tm, tn, T, ch = self.tm, self.tn, self.tmem, 32
        self._stage_stats(tidx, batch, head, m_block, seqlen_q, mLSE2, mD, sLSE, sD, stats_row0)
        key_limit, diag = schedule.mask_bounds(m_block, n_block, tm, tn, seqlen_q, seqlen_k)
        need_mask = schedule.tile_needs_mask(key_limit, diag, tn, self.causal, self.window_or_none, tm)
        cute.arch.mbarrier_wait(self._bar(mbar, "s_full"), it % 2)
        tcgen05_fence_after_sync()
        rP = cute.make_rmem_tensor((tm,), Float32)
        store_p = None
        if const_expr(self.score_mod.on):  # P^T chunk c -> TMEM from inside the exp loop
            store_p = lambda packed, c: cute.copy(  # noqa: E731
                st16, packed, thr_st.partition_D(sub(accS, T.p - T.s + c * ch // 2, ch // 2)))
        self._exp_row(rP, accS, sub, ld, thr_ld, r_shape, Int32(tidx), key_limit, diag, need_mask,
                      softmax_scale_log2, sLSE, softcap_scale, store_p, r16_shape)
        for c in cutlass.range_constexpr(0 if self.score_mod.on else tm // ch):
            self._store16(rP, c * ch, ch, st16, thr_st, sub(accS, T.p - T.s + c * ch // 2, ch // 2), r16_shape)
        cute.arch.fence_view_async_tmem_store()
        tcgen05_fence_before_sync()
        return rP

    @cute.jit
    def _store_dkdv(self, key: Int32, n_block: Int32, batch: Int32, head_kv: Int32, n_iter: Int32, seqlen_k: Int32,
                    softmax_scale: Float32, tmem_ptr: cute.Pointer, accS: cute.Tensor, sub, ld: cute.TiledCopy,
                    thr_ld, r_shape: cutlass.Constexpr, mdK: cute.Tensor, mdV: cute.Tensor, offset_k=None):
        """Epilogue: dV, scale * dK (fp32 TMEM, lane = key) -> 16-bit global rows (keys past seqlen_k skipped;
        a K/V tile that no Q tile sees writes zeros). Varlen: seqlen_k is the sequence's key rows (keys
        past seqused_k get zeros), the row offset_k + key of the packed tensor."""
        T, ch = self.tmem, 32
        key_g = n_block * self.tn + key
        for which in cutlass.range_constexpr(2):
            width = self.dv_cols if const_expr(which == 0) else self.dk_cols
            col0 = T.dv if const_expr(which == 0) else T.dk
            chunk0 = self._dkdv_chunk0(width)   # this CTA's first 32-column chunk of the head dim
            scale = Float32(1.0) if const_expr(which == 0) else softmax_scale
            mOut = mdV if const_expr(which == 0) else mdK
            acc = cute.make_tensor(tmem_ptr + col0, accS.layout)
            for c in cutlass.range_constexpr(width // ch):
                r = cute.make_rmem_tensor(r_shape, Float32)
                cute.copy(ld, thr_ld.partition_S(sub(acc, c * ch, ch)), r)
                cute.arch.fence_view_async_tmem_load()
                out = cute.make_rmem_tensor((ch,), self.dtype)
                for j in cutlass.range_constexpr(ch):
                    v = r[j] * scale
                    if n_iter == 0:
                        v = Float32(0.0)
                    out[j] = v.to(self.dtype)
                if self._dkdv_keeps(key_g, seqlen_k):
                    cute.autovec_copy(out, self._dkdv_dst(mOut, batch, key_g, head_kv, chunk0 + c, offset_k))

    @cute.jit
    def elementwise(self, n_block: Int32, seq, head_kv: Int32, m_min: Int32, n_m: Int32, n_iter: Int32,
                    group: Int32, softmax_scale_log2: Float32, softmax_scale: Float32, mbar: cute.Pointer,
                    tmem_ptr: cute.Pointer, sdS: cute.Tensor, sLSE: cute.Tensor, sD: cute.Tensor, mLSE2: cute.Tensor,
                    mD: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor, mma_s: cute.TiledMma):
        """The 1-CTA kernel's WG 0 over its walk; seq: the CTA's hopper.walk.SeqBounds (tensor batch
        index, packed offsets, the sequence's lengths)."""
        batch, seqlen_q, seqlen_k = seq.bidx, seq.seqlen_q, seq.seqlen_k
        stats_row0 = None
        if const_expr(self.varlen):
            stats_row0 = common.stats_offset(seq.offset_q, seq.batch)
        tidx = cute.arch.thread_idx()[0] % 128
        tm, tn, T = self.tm, self.tn, self.tmem
        ch = 32                                    # fp32 columns per TMEM load
        softcap_scale = None
        if const_expr(self.score_mod.on):
            # softcap, folded as the forward folds it (Softcap.kernel_scales): P's exponent scale is
            # softcap * log2(e), the tanh's input scale softmax_scale / softcap; dK's epilogue scale
            # and the postprocess's dQ scale stay softmax_scale (dS already carries 1 - tanh^2)
            scale_log2, _ = self.score_mod.kernel_scales(1.0)
            softmax_scale_log2 = Float32(scale_log2)
            # the tanh's scale is formed per Q tile (_softcap_row): held across the walk, one more live
            # register spilled the d = 128 varlen window + softcap build (4 bytes)
            softcap_scale = softmax_scale
        accS = self._tmem_acc(tmem_ptr, mma_s, (tn, tm), T.s)
        sub, ld, st16, thr_ld, thr_st, r_shape, r16_shape = self._row_copies(accS, tidx)
        key = tidx                                  # TMEM lane = key row of the tile
        n_chunks = tm // ch

        for it in cutlass.range(n_iter, unroll=1):
            head = head_kv * group + it // n_m
            m_block = m_min + it % n_m
            # 1.-2. lse2 / D -> SMEM; P^T row -> registers and (16-bit) -> TMEM
            rP = self._p_phase(it, tidx, batch, head, m_block, n_block, seqlen_q, seqlen_k, softmax_scale_log2,
                               mbar, accS, sLSE, sD, mLSE2, mD, sub, ld, st16, thr_ld, thr_st, r_shape, r16_shape,
                               stats_row0, softcap_scale)
            cute.arch.mbarrier_arrive(self._bar(mbar, "p_full"))
            # 3. dS = P (dP - D) in 32-column chunks (softcap: rP is P (1 - tanh^2), so dS carries the
            #    derivative); dS^T -> TMEM over the dP^T chunks already read
            #    (for dK), dS -> SMEM (for dQ). S^T(it + 1) may already be running meanwhile.
            cute.arch.mbarrier_wait(self._bar(mbar, "dp_full"), it % 2)
            if it > 0:  # sdS is free once the previous dQ = dS K has completed (implied by dp_full: kept explicit)
                cute.arch.mbarrier_wait(self._bar(mbar, "dq_full"), (it - 1) % 2)
            tcgen05_fence_after_sync()
            accdP = cute.make_tensor(tmem_ptr + T.dp, accS.layout)
            for c in cutlass.range_constexpr(n_chunks):
                r = cute.make_rmem_tensor(r_shape, Float32)
                cute.copy(ld, thr_ld.partition_S(sub(accdP, c * ch, ch)), r)
                cute.arch.fence_view_async_tmem_load()
                for j in cutlass.range_constexpr(ch):
                    rP[c * ch + j] = rP[c * ch + j] * (r[j] - sD[c * ch + j])
                r16 = self._store16(rP, c * ch, ch, st16, thr_st, sub(accS, T.ds - T.s + c * ch // 2, ch // 2), r16_shape)
                cute.autovec_copy(cute.make_tensor(cute.recast_ptr(r16.iterator, dtype=self.dtype),
                                                   cute.make_layout(ch)), self._ds_smem_chunk(sdS, key, c))
            cute.arch.fence_view_async_tmem_store()
            cute.arch.fence_view_async_shared()  # generic-proxy dS stores -> visible to the MMA
            tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "ds_full"))

        # 4. epilogue: dV, scale * dK -> global
        if n_iter > 0:
            cute.arch.mbarrier_wait(self._bar(mbar, "dkv_full"), 0)
            tcgen05_fence_after_sync()
        self._store_dkdv(Int32(key), n_block, batch, head_kv, n_iter, seq.seqlen_k_rows, softmax_scale, tmem_ptr, accS,
                         sub, ld, thr_ld, r_shape, mdK, mdV, seq.offset_k)

    @cute.jit
    def _store16(self, rP: cute.Tensor, off: cutlass.Constexpr[int], n: cutlass.Constexpr[int],
                 st16: cute.TiledCopy, thr_st, tmem_dst: cute.Tensor, r16_shape: cutlass.Constexpr):
        """rP[off : off + n] -> 16-bit, packed two per 32-bit TMEM column, stored at tmem_dst."""
        r16 = cute.make_rmem_tensor(r16_shape, Float32)
        v16 = cute.make_tensor(cute.recast_ptr(r16.iterator, dtype=self.dtype), cute.make_layout(n))
        src = cute.make_tensor(rP.iterator + off, cute.make_layout(n))
        v16.store(src.load().to(self.dtype))
        cute.copy(st16, r16, thr_st.partition_D(tmem_dst))
        return r16
