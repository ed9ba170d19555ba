"""The 96-key design of the wide head dims (``kv_swap``, (192, 128)): S by keys, dK^T / dV^T with the
head dim as wgmma M.

Why. The 64-key design (wide.py) reads each Q / dO tile and reduces each dQ tile for 64 keys of work;
a CTA of 96 keys does 1.5x the FLOPs per Q / dO load and per dQ reduce, and reads 18% fewer SMEM
bytes per FLOP (per 64 x 96 tile: S 84 KB, dP 56, dV^T 44, dK^T 60, dQ 60, P / dS stores 24, dQ
through sdQ 96 -- 424 KB for 10.2 MFLOP, against 344 KB for 6.8 at 64 x 64). 96 keys are no wgmma M,
so the keys go on N:

* S = Q K^T and dP = dO V^T (SS), the warpgroups split the keys: warpgroup w scores keys
  [48 w, 48 w + 48) of all 64 queries, so a thread's rows are queries and it needs two lse2 / D;
* P and dS go to SMEM as (queries, keys) -- slot 1 and slot 0 of sdSt;
* dV^T += dO^T P (M = dv) and dK^T += Q^T dS (M = d), SS, each warpgroup its own 48 keys as N: the
  B operand is the P / dS that warpgroup wrote itself;
* dQ = dS K (SS): each warpgroup d / 2 columns over all 96 keys -- both warpgroups' dS, so B2 first.

Registers per consumer thread: dK^T 192 x 48 / 128 = 72 and dV^T 128 x 48 / 128 = 48 across the walk,
S 24 + dP 24 or dQ 48 per tile. SMEM (``options.smem_need``): K, V 60 KB, two Q / dO stages 80 KB, P
and dS 24 KB, one dQ buffer 48 KB: 214 KB. The epilogue stores dK^T / dV^T through transposed views of
sK / sV (epilogue.py). Per tile t the order of wide.py:
    S (SS) ; dP (SS) ; wait S ; P ; ["sdSt free"] ; P -> SMEM ; wait dP ; dS -> SMEM ; proxy fence ; B2
    dV^T += dO^T P ; dQ = dS K ; dK^T += Q^T dS ; wait all but dK^T ; release dO_i ; dQ -> sdQ
    wait dK^T ; release Q_i ; arrive "sdSt free"
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from stage3_fwd_kernel.hopper.fragments import acc_rowcol
from stage4_bwd_kernel import schedule
from stage4_bwd_kernel.hopper.consumer import ConsumerOperands, gemm_issue
from stage4_bwd_kernel.hopper.layouts import Mmas, dq_frag_tiled_copy
from stage4_bwd_kernel.hopper.options import CONSUMER_BARRIER, NUM_CONSUMER_THREADS, NUM_WG_MMA, SDST_FREE_BARRIER
from stage4_bwd_kernel.hopper.producer import swizzled
from stage4_bwd_kernel.hopper.scores import TanhFromP

DS_SLOT, P_SLOT = 0, 1


class WideSwapConsumer:
    """The 96-key tile body and its operands, methods of the kernel class (consumer.py calls them)."""

    def make_mmas_swap(self) -> Mmas:
        """S / dP (tm x tn), dV^T (dv x tn), dK^T (d x tn): the warpgroups along N, 48 keys each; dQ as
        for the other wide design (d / 2 columns each, A = dS K-major: layouts.make_tiled_mma_dQ)."""
        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        split, keys = (1, NUM_WG_MMA, 1), self.tile_n // NUM_WG_MMA
        sdp = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, k_major, k_major, Float32, split, (64, keys))
        mma_dv = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, mn_major, mn_major, Float32, split,
                                                   (64, keys))
        mma_dk = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, mn_major, mn_major, Float32, split,
                                                   (64, keys))
        return Mmas(sdp, mma_dv, mma_dk, self.make_tiled_mma_dQ())

    @cute.jit
    def operands_swap(self, ctidx: Int32, storage, mmas, layouts):
        """ConsumerOperands of consumer thread ctidx for the 96-key design (consumer.operands' fields
        that the tile body and the epilogue read)."""
        tm, tn, d, dv, stages = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        o = ConsumerOperands()
        sQ, sdO = swizzled(storage, "sQ", layouts), swizzled(storage, "sdO", layouts)       # (tm, d|dv, stages)
        o.sK, o.sV = swizzled(storage, "sK", layouts), swizzled(storage, "sV", layouts)     # (tn, d|dv)
        sPdS = swizzled(storage, "sdSt", layouts)                                           # (tm, tn, 2)
        sPdS_t = cute.composition(sPdS, cute.make_ordered_layout((tn, tm, 2), order=(1, 0, 2)))  # (tn, tm, 2)
        sQt = cute.composition(sQ, cute.make_ordered_layout((d, tm, stages), order=(1, 0, 2)))
        sdOt = cute.composition(sdO, cute.make_ordered_layout((dv, tm, stages), order=(1, 0, 2)))
        sKt = cute.composition(o.sK, cute.make_ordered_layout((d, tn), order=(1, 0)))

        o.thr_SdP = mmas.SdP.get_slice(ctidx)
        o.thr_dV = mmas.dV.get_slice(ctidx)
        o.thr_dK = mmas.dK.get_slice(ctidx)
        o.thr_dQ = mmas.dQ.get_slice(ctidx)
        o.wg = cute.arch.make_warp_uniform(ctidx // 128)
        wg_first = o.wg * 128  # descriptors per warpgroup (consumer.py)
        wg_SdP, wg_dV = mmas.SdP.get_slice(wg_first), mmas.dV.get_slice(wg_first)
        wg_dK, wg_dQ = mmas.dK.get_slice(wg_first), mmas.dQ.get_slice(wg_first)
        o.tSrQ = wg_SdP.make_fragment_A(wg_SdP.partition_A(sQ))           # (..., stages)
        o.tSrK = wg_SdP.make_fragment_B(wg_SdP.partition_B(o.sK))         # this warpgroup's 48 keys
        o.tPrdO = wg_SdP.make_fragment_A(wg_SdP.partition_A(sdO))         # (..., stages)
        o.tPrV = wg_SdP.make_fragment_B(wg_SdP.partition_B(o.sV))
        o.tdVrdOt = wg_dV.make_fragment_A(wg_dV.partition_A(sdOt))        # (..., stages)
        o.tdVrP = wg_dV.make_fragment_B(wg_dV.partition_B(sPdS_t))        # (..., slots)
        o.tdKrQt = wg_dK.make_fragment_A(wg_dK.partition_A(sQt))          # (..., stages)
        o.tdKrdS = wg_dK.make_fragment_B(wg_dK.partition_B(sPdS_t))       # (..., slots)
        o.tdQrA = wg_dQ.make_fragment_A(wg_dQ.partition_A(sPdS))          # (..., slots)
        o.tdQrB = wg_dQ.make_fragment_B(wg_dQ.partition_B(sKt))
        o.acc_dV = cute.make_rmem_tensor(o.thr_dV.partition_shape_C((dv, tn)), Float32)
        o.acc_dK = cute.make_rmem_tensor(o.thr_dK.partition_shape_C((d, tn)), Float32)
        o.acc_dV.fill(0.0)
        o.acc_dK.fill(0.0)
        o.tScS_rc = acc_rowcol(o.thr_SdP.partition_C(cute.make_identity_tensor((tm, tn))))  # (query, key)
        # P / dS (16-bit, accumulator order) -> sdSt: 2 adjacent keys per 4-byte store
        o.smem_copy_dS = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), mmas.SdP)
        o.thr_smem_dS = o.smem_copy_dS.get_slice(ctidx)
        o.tdSsdSt = o.thr_smem_dS.partition_D(sPdS)                       # (..., slots)
        o.dq_shape = (tm, d)
        sdQ_frag = storage.sdQ.get_tensor(layouts.sdQ.outer)                # (share elems, shares)
        o.tQsQ_frag = dq_frag_tiled_copy().get_slice(ctidx % 128).partition_D(sdQ_frag)  # (4, chunks, shares)
        o.sLSE2 = storage.sLSE2.get_tensor(layouts.sStat)                   # (tm, stages), TMA-filled
        o.sD = storage.sD.get_tensor(layouts.sStat)
        return o

    @cute.jit
    def consume_tile_swap(self, o, walk, mmas, pipes, t: Int32, m_block: Int32, n_tiles: Int32,
                          softmax_scale_log2: Float32, masked: cutlass.Constexpr[bool], score_scale=None):
        """Tile t of the walk (Q tile m_block): the order of the module docstring."""
        tm, tn = self.tile_m, self.tile_n
        st = self.tile_state(t, producer=False)
        q_rows_left = walk.seqlen_q - m_block * tm
        sLSE2_t, sD_t = o.sLSE2[None, st.index], o.sD[None, st.index]

        acc_S = cute.make_rmem_tensor(o.thr_SdP.partition_shape_C((tm, tn)), Float32)
        acc_dP = cute.make_rmem_tensor(o.thr_SdP.partition_shape_C((tm, tn)), Float32)
        pipes.q.consumer_wait(st)
        warpgroup.fence()
        gemm_issue(mmas.SdP, acc_S, o.tSrQ[None, None, None, st.index], o.tSrK, zero_init=True)
        pipes.do.consumer_wait(st)
        gemm_issue(mmas.SdP, acc_dP, o.tPrdO[None, None, None, st.index], o.tPrV, zero_init=True)

        warpgroup.wait_group(1)
        acc_S_rc = acc_rowcol(acc_S)
        key_limit, diag = schedule.mask_bounds(m_block, walk.n_block, tm, tn, walk.seqlen_q, walk.seqlen_k)
        tanh_from_p = None
        if const_expr(self.score_mod.on):
            tanh_from_p = TanhFromP(sLSE2_t, Float32(1.0) / softmax_scale_log2)
        self.exp_rows(acc_S_rc, o.tScS_rc, sLSE2_t, softmax_scale_log2, key_limit, diag, q_rows_left, masked,
                      score_scale)
        if t > 0:  # the other warpgroup's dQ wgmma of tile t - 1 has read the dS slot
            cute.arch.barrier(barrier_id=SDST_FREE_BARRIER + o.wg, number_of_threads=NUM_CONSUMER_THREADS)
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rP.store(acc_S.load().to(self.dtype))
        cute.copy(o.smem_copy_dS, o.thr_smem_dS.retile(rP), o.tdSsdSt[None, None, None, P_SLOT])

        warpgroup.wait_group(0)  # dP
        self.ds_rows(acc_S_rc, acc_dP, o.tScS_rc, sD_t, tanh_from_p)
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdS.store(acc_dP.load().to(self.dtype))
        cute.copy(o.smem_copy_dS, o.thr_smem_dS.retile(rdS), o.tdSsdSt[None, None, None, DS_SLOT])
        cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> wgmma reads
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=NUM_CONSUMER_THREADS)  # B2

        acc_dQ = cute.make_rmem_tensor(o.thr_dQ.partition_shape_C(o.dq_shape), Float32)
        warpgroup.fence()
        gemm_issue(mmas.dV, o.acc_dV, o.tdVrdOt[None, None, None, st.index], o.tdVrP[None, None, None, P_SLOT],
                   zero_init=False)
        gemm_issue(mmas.dQ, acc_dQ, o.tdQrA[None, None, None, DS_SLOT], o.tdQrB, zero_init=True)
        gemm_issue(mmas.dK, o.acc_dK, o.tdKrQt[None, None, None, st.index], o.tdKrdS[None, None, None, DS_SLOT],
                   zero_init=False)
        self.finish_wide_tile(o, walk, pipes, st, acc_dQ, t, m_block, n_tiles)  # wide.py

    @cute.jit
    def exp_rows(self, acc_S_rc: cute.Tensor, tScS_rc: cute.Tensor, sLSE2: cute.Tensor, softmax_scale_log2: Float32,
                 key_limit: Int32, diag: Int32, q_rows_left: Int32, masked: cutlass.Constexpr[bool], score_scale=None):
        """P = exp2(S * scale_log2 - lse2) in place, a thread's rows being queries (two lse2 a tile);
        masked: keys past the sequence, beyond the window or the causal diagonal to -inf
        (``schedule.is_masked`` with the key as its row), a query past the sequence to P = 0 (its lse2
        +inf). Softcap as in scores.exp_scores."""
        for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
            row = tScS_rc[r, 0][0]
            lse2 = sLSE2[row]
            if const_expr(masked):
                if row >= q_rows_left:
                    lse2 = Float32.inf
            for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
                s = acc_S_rc[r, c]
                if const_expr(self.score_mod.on):
                    s = cute.math.tanh(s * score_scale, approx=True)
                if const_expr(masked):
                    if schedule.is_masked(tScS_rc[r, c][1], row, key_limit, diag, self.causal, self.window_or_none):
                        s = -Float32.inf
                acc_S_rc[r, c] = cute.math.exp2(s * softmax_scale_log2 - lse2, fastmath=True)

    @cute.jit
    def ds_rows(self, acc_S_rc: cute.Tensor, acc_dP: cute.Tensor, tScS_rc: cute.Tensor, sD: cute.Tensor,
                tanh_from_p=None):
        """acc_dP := dS = P * (dP - D), D per query row; softcap: times the tanh's derivative, recovered
        from P and the row's lse2 (scores.TanhFromP)."""
        acc_dP_rc = acc_rowcol(acc_dP)
        for r in cutlass.range_constexpr(cute.size(acc_dP_rc, mode=[0])):
            row = tScS_rc[r, 0][0]
            dpsum = sD[row]
            lse2 = None
            if const_expr(tanh_from_p is not None):
                lse2 = tanh_from_p.sLSE2[row]
            for c in cutlass.range_constexpr(cute.size(acc_dP_rc, mode=[1])):
                ds = acc_S_rc[r, c] * (acc_dP_rc[r, c] - dpsum)
                if const_expr(tanh_from_p is not None):
                    ds = ds * self.softcap_grad(acc_S_rc[r, c], lse2, tanh_from_p.inv_scale_log2)
                acc_dP_rc[r, c] = ds
