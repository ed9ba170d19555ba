"""The dK / dV epilogue of the production Hopper backward.

After the walk: dK *= softmax_scale (dV needs none: P already holds it), each fp32 accumulator is
rounded to the inputs' dtype and staged through SMEM -- over sK / sV, which no wgmma reads any more
once both warpgroups have passed the barrier (a persistent CTA, whose next K and V are already loading
there, stages both in turn through sdSt) -- and written with 16-byte stores of the key rows that exist
(a partial last K/V tile, or a varlen sequence's end).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from stage4_bwd_kernel.hopper.options import CONSUMER_BARRIER, NUM_CONSUMER_THREADS
from stage4_bwd_kernel.hopper.scores import thread_idx_fresh


class Epilogue:
    """Epilogue methods of the kernel class."""

    @cute.jit
    def store_dk_dv(self, o, walk, mdK: cute.Tensor, mdV: cute.Tensor, mmas, gmem_stores, sOffsets: cute.Tensor,
                    softmax_scale: Float32, staging=None, release=None):
        """o: ConsumerOperands; gmem_stores: (dK copy, dV copy); sOffsets: (offset_k, key rows left).
        staging: None (dK over sK, dV over sV), or one buffer's (dK view, dV view) that dK then dV pass
        through in turn (persistent.py: sdSt); release: called once no wgmma reads SMEM any more (a
        persistent CTA frees K/V's stage there)."""
        tn, d, dv = self.tile_n, self.head_dim, self.head_dim_v
        # both warpgroups' last wgmmas (readers of sK, sV, sdSt) have completed
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=NUM_CONSUMER_THREADS)
        if const_expr(release is not None):
            release()
        o.acc_dK.store(o.acc_dK.load() * softmax_scale)
        offset_k, k_rows_left = sOffsets[0], sOffsets[1]
        ctidx = thread_idx_fresh() - 128  # re-read: values derived from it, kept across the walk, spilled
        # kv_swap holds dK^T / dV^T: they land in sK / sV through transposed views (wide_swap.py)
        sK, sV, sK_acc, sV_acc = o.sK, o.sV, o.sK, o.sV
        if const_expr(staging is not None):
            sK, sV = staging
            sK_acc, sV_acc = staging
        if const_expr(self.kv_swap):
            sK_acc = cute.composition(o.sK, cute.make_ordered_layout((d, tn), order=(1, 0)))
            sV_acc = cute.composition(o.sV, cute.make_ordered_layout((dv, tn), order=(1, 0)))
        self.store_tile(o.acc_dK, mmas.dK, sK, sK_acc, gmem_stores[0], ctidx,
                        cute.local_tile(cute.domain_offset((offset_k, 0), mdK[walk.bidx, None, walk.head_kv, None]),
                                        (tn, d), (walk.n_block, 0)), (tn, d), k_rows_left)
        if const_expr(staging is not None):  # every thread has read dK from the buffer before dV overwrites it
            cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=NUM_CONSUMER_THREADS)
        self.store_tile(o.acc_dV, mmas.dV, sV, sV_acc, gmem_stores[1], ctidx,
                        cute.local_tile(cute.domain_offset((offset_k, 0), mdV[walk.bidx, None, walk.head_kv, None]),
                                        (tn, dv), (walk.n_block, 0)), (tn, dv), k_rows_left)
        if const_expr(staging is not None):  # ... and dV, before the next walk's dS^T does
            cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=NUM_CONSUMER_THREADS)

    @cute.jit
    def store_tile(self, acc: cute.Tensor, tiled_mma: cute.TiledMma, sX: cute.Tensor, sX_acc: cute.Tensor,
                   gmem_copy: cute.TiledCopy, ctidx: Int32, gX: cute.Tensor, shape: cutlass.Constexpr, rows_left: Int32):
        """fp32 accumulator -> dtype -> smem (sX_acc: sX as the accumulator's (M, N) sees it) -> row-guarded
        16-byte stores (consumer threads only). A transposed view takes one element per store: the
        accumulator's adjacent pair is two rows of sX then."""
        rX = cute.make_rmem_tensor_like(acc, self.dtype)
        rX.store(acc.load().to(self.dtype))
        bits = 16 if const_expr(self.kv_swap) else 32
        smem_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=bits), tiled_mma)
        thr_smem = smem_copy.get_slice(ctidx)
        cute.copy(smem_copy, thr_smem.retile(rX), thr_smem.partition_D(sX_acc))
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=NUM_CONSUMER_THREADS)
        thr_copy = gmem_copy.get_slice(ctidx)
        tXsX, tXgX = thr_copy.partition_S(sX), thr_copy.partition_D(gX)
        tXcX = thr_copy.partition_S(cute.make_identity_tensor(shape))
        tXrX = cute.make_rmem_tensor_like(tXsX, self.dtype)
        cute.autovec_copy(tXsX, tXrX)
        for m in cutlass.range_constexpr(cute.size(tXgX.shape[1])):
            if tXcX[0, m, 0][0] < rows_left:
                cute.copy(gmem_copy, tXrX[None, m, None], tXgX[None, m, None])
