"""The wide head dims of the production Hopper backward, 256 (and (192, 128) with ``kv_swap=False``;
its default is the 96-key design, wide_swap.py): both consumer warpgroups on the same 64 keys.

Why. The register-sourced design (consumer.py) gives each warpgroup 64 keys of its own and keeps their
dK and dV in registers: d / 2 + dv / 2 per thread, 160 at (192, 128) and 256 at 256, beside S^T, dP^T
and P^T (80 more). That does not fit the 240 registers of a consumer. Here a CTA owns 64 keys and the
warpgroups split the work of each 64-query tile instead (``roofline.WIDE_DESIGNS["exchange_dims"]``):

* S^T = K Q^T and dP^T = V dO^T by queries: warpgroup w scores queries [32 w, 32 w + 32) (wgmma N = 32);
* P^T and dS^T go to SMEM (the slots of sdSt), since each warpgroup's dV / dK need all 64 queries;
* dV += P^T dO and dK += dS^T Q by columns: warpgroup w owns columns [dv w / 2, dv (w + 1) / 2) of dV and
  [d w / 2, d (w + 1) / 2) of dK, with A read from SMEM (SS wgmmas);
* dQ = dS K as at d = 96: each warpgroup its d / 2 columns, handed to the writer warp (dq_writer.py),
  or at 256 (``dq_atomic``) added by the warpgroup itself with 16-byte reds, in the writer's order.

Registers per consumer thread (128 a warpgroup): dK 64 d / 256 + dV 64 dv / 256 held across the walk
(80 at (192, 128), 128 at 256), plus S^T 16 + dP^T 16, or the dQ accumulator 64 d / 256 (48 / 64),
which are not live at once. SMEM (``options.smem_need``): 186 KB at (192, 128) with two Q / dO stages
and one dQ buffer. At 256 a dQ buffer (64 KB) leaves room for one stage only, which ran at 0.70x the
speed of two with the reds (docs/measurements.md): 210 KB either way; deterministic mode adds from the
registers too, in the order of ``dq_order``, in turns kept by two otherwise idle warps (pass_dq_turns).

Per tile t, in order:
    S^T (SS) ; dP^T (SS) ; wait S^T ; P^T ; ["sdSt free"] ; P^T -> SMEM ; wait dP^T ; dS^T -> SMEM
    proxy fence ; B2 ; dV += P^T dO (SS) ; dQ = dS K (SS) ; dK += dS^T Q (SS)
    wait all but dK ; release dO_i ; dQ -> sdQ, or at 256 reds (deterministic: ["dQ turn"] ; reds ;
    arrive "dQ added") ; wait dK ; release Q_i ; arrive "sdSt free"
Tile t + 1 overwrites P^T / dS^T only after both warpgroups' dV, dQ and dK of tile t have read them
(one buffer each: two measured a tie on an H200, docs/measurements.md).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from stage3_fwd_kernel import trace
from stage4_bwd_kernel import common
from stage4_bwd_kernel.hopper.consumer import gemm_issue
from stage4_bwd_kernel.hopper.scores import thread_idx_fresh
from stage4_bwd_kernel.hopper.options import (CONSUMER_BARRIER, DQ_ADDED_BARRIER, DQ_TURN_BARRIER, DQ_TURN_THREADS,
                                              NUM_CONSUMER_THREADS, NUM_WG_MMA, SDST_FREE_BARRIER)


class WideConsumer:
    """The wide tile body, a method of the kernel class (consumer.py's ``consume`` calls it)."""

    @cute.jit
    def consume_tile_wide(self, o, walk, mmas, pipes, t: Int32, m_block: Int32, n_tiles: Int32,
                          softmax_scale_log2: Float32, masked: cutlass.Constexpr[bool], score_scale=None):
        """Tile t of the walk (Q tile m_block): the order of the module docstring."""
        st = self.tile_state(t, producer=False)
        q_rows_left = walk.seqlen_q - m_block * self.tile_m
        ds_slot, pt_slot = 0, self.ds_buffers

        acc_S, acc_dP = self.issue_scores(o, mmas, pipes, st)  # this warpgroup's 32 queries
        sLSE2_t, sD_t = o.sLSE2[None, st.index], o.sD[None, st.index]

        warpgroup.wait_group(1)
        acc_S_rc, tanh_from_p = self.tile_exp(o, acc_S, walk, m_block, q_rows_left, sLSE2_t, None,
                                              softmax_scale_log2, masked, score_scale)
        if t > 0:  # both warpgroups' wgmmas of tile t - 1 have read the P^T / dS^T slots
            cute.arch.barrier(barrier_id=SDST_FREE_BARRIER + o.wg, number_of_threads=NUM_CONSUMER_THREADS)
        rPt = cute.make_rmem_tensor_like(acc_S, self.dtype)
        rPt.store(acc_S.load().to(self.dtype))
        cute.copy(o.smem_copy_dS, o.thr_smem_dS.retile(rPt), o.tdSsdSt[None, None, None, pt_slot])

        warpgroup.wait_group(0)  # dP^T
        self.ds_in_place(o, acc_S_rc, acc_dP, sD_t, tanh_from_p)
        rdSt = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        rdSt.store(acc_dP.load().to(self.dtype))
        cute.copy(o.smem_copy_dS, o.thr_smem_dS.retile(rdSt), o.tdSsdSt[None, None, None, ds_slot])
        cute.arch.fence_proxy("async.shared", space="cta")  # st.shared -> wgmma reads
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=NUM_CONSUMER_THREADS)  # B2

        # this warpgroup's columns of dV and dK, its share of dQ
        acc_dQ = cute.make_rmem_tensor(o.thr_dQ.partition_shape_C(o.dq_shape), Float32)
        warpgroup.fence()
        gemm_issue(mmas.dV, o.acc_dV, o.tdVrPt[None, None, None, pt_slot], o.tdVrdOt[None, None, None, st.index],
                   zero_init=False)
        gemm_issue(mmas.dQ, acc_dQ, o.tdQrA[None, None, None, ds_slot], o.tdQrB, zero_init=True)
        gemm_issue(mmas.dK, o.acc_dK, o.tdKrdSt[None, None, None, ds_slot], o.tdKrQt[None, None, None, st.index],
                   zero_init=False)
        self.finish_wide_tile(o, walk, pipes, st, acc_dQ, t, m_block, n_tiles)

    @cute.jit
    def finish_wide_tile(self, o, walk, pipes, st, acc_dQ: cute.Tensor, t: Int32, m_block: Int32, n_tiles: Int32):
        """The wide tiles' end (both designs), their dV, dQ and dK wgmmas issued in that order: dQ
        handed on once dV and dQ are done, the Q / dO stages released, the other warpgroup told that
        this one has read the P / dS slots."""
        warpgroup.wait_group(1)  # dV and dQ done, dK may run
        pipes.do.consumer_release(st)
        if const_expr(self.dq_atomic):
            if const_expr(self.deterministic):  # this warpgroup's turn on the tile (pass_dq_turns)
                cute.arch.barrier(barrier_id=DQ_TURN_BARRIER + o.wg, number_of_threads=DQ_TURN_THREADS)
            self.add_dq_from_registers(o, acc_dQ, walk, t, m_block)
            if const_expr(self.deterministic):
                cute.arch.barrier_arrive(barrier_id=DQ_ADDED_BARRIER + o.wg, number_of_threads=DQ_TURN_THREADS)
        else:
            self.hand_off_dq(o, acc_dQ, t)
        warpgroup.wait_group(0)
        pipes.q.consumer_release(st)
        if t + 1 < n_tiles:  # this warpgroup has read the slots: the other may overwrite them
            cute.arch.barrier_arrive(barrier_id=SDST_FREE_BARRIER + NUM_WG_MMA - 1 - o.wg,
                                     number_of_threads=NUM_CONSUMER_THREADS)
        trace.stamp(t, "end")

    @cute.jit
    def pass_dq_turns(self, walk, mSemaphore: cute.Tensor, w: Int32):
        """Deterministic dq_atomic, turn warp w (an idle warp of the producer warpgroup, one per consumer
        warpgroup): for every tile of the walk, in the consumers' order, wait for warpgroup w's turn on
        the tile's semaphore, let the warpgroup add its share of dQ, and once it has issued its adds
        pass the turn on. The counter counts warpgroups: the CTA of rank r in ``dq_order`` adds once it
        reads >= 2 r (both warpgroups of every earlier CTA done; each share needs only its own
        warpgroup's predecessors, so this is stronger than needed). The spin and the release's fence
        stay off the math warps, which only meet two named barriers a tile."""
        lane = cute.arch.lane_idx()
        for head_in_group in cutlass.range(walk.qhead_per_kvhead, unroll=1):
            head = walk.head_kv * walk.qhead_per_kvhead + head_in_group
            for m_block in cutlass.range(walk.m_block_min, walk.m_block_max, unroll=1):
                sem = common.elem_pointer(mSemaphore, (walk.batch, head, m_block))
                common.semaphore_wait_at_least(sem, NUM_WG_MMA * self.dq_rank(walk, m_block), lane)
                cute.arch.sync_warp()
                cute.arch.barrier_arrive(barrier_id=DQ_TURN_BARRIER + w, number_of_threads=DQ_TURN_THREADS)
                cute.arch.barrier(barrier_id=DQ_ADDED_BARRIER + w, number_of_threads=DQ_TURN_THREADS)
                # the warpgroup's adds are issued; the release (fence.acq_rel.gpu, cumulative through
                # the barrier) orders them before the count the next CTA reads
                common.semaphore_signal(sem, lane)

    @cute.jit
    def add_dq_from_registers(self, o, acc_dQ: cute.Tensor, walk, t: Int32, m_block: Int32):
        """dq_atomic: this thread's dQ registers straight into dQaccum with 16-byte reds, in the writer's
        fragment order (register i -> float (i // 4) * 512 + thread * 4 + i % 4 of the warpgroup's share,
        layouts.py), so a warp's reds cover 512 contiguous bytes and postprocess_frag reads them as ever."""
        n_m = walk.m_block_max - walk.m_block_min
        head = walk.head_kv * walk.qhead_per_kvhead + t // n_m
        share = cute.make_tensor(self.dq_frag_share_pointer(o.mdQacc, walk, head, m_block, o.wg),
                                 cute.make_layout(self.dq_frag_share_elems()))
        tQgQ = self.dq_frag_tiled_copy().get_slice(thread_idx_fresh() % 128).partition_D(share)  # (4, chunks)
        acc = cute.make_tensor(acc_dQ.iterator, cute.make_layout(cute.size(acc_dQ)))
        for c in cutlass.range_constexpr(cute.size(acc_dQ) // 4):
            common.red_add_f32x4(common.elem_pointer(tQgQ, (0, c)), acc[4 * c], acc[4 * c + 1], acc[4 * c + 2],
                                 acc[4 * c + 3])
