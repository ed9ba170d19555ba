"""Stage 4, Blackwell (sm_100a): the dQ warpgroup of the 1-CTA backward (a mixin of
``blackwell_bwd.FlashAttentionBackwardSm100``). COMPILED AND INSPECTED ONLY: no Blackwell GPU is
reachable from this project, so this code has never run on hardware.

Per Q tile of the walk, warpgroup 2 takes dQ = dS K out of TMEM (one row a thread), hands the columns
back to the MMA warp at once (dq_empty), then adds the row into the fp32 dQ accumulator: per-row
atomics, or (dq_tma) 32-column chunks staged in sdQ and added by a TMA reduce. In deterministic mode
the adds of a dQ tile go in ``dq_order``'s rank order, kept by the tile's semaphore.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05

from stage3_fwd_kernel.blackwell_sync import tcgen05_fence_after_sync, tcgen05_fence_before_sync
from stage4_bwd_kernel import common, schedule
from stage4_bwd_kernel.blackwell_config import DQ_STAGE_BUFS, DQ_STAGE_COLS
from stage4_bwd_kernel.hopper.walk import SeqBounds

BAR_DQ = 3  # named barrier of WG 2: the deterministic hand-over and the dQ reduce's chunks


class DqDrainRole:
    """dQ from TMEM into the accumulator (``dq_drain``), by TMA reduce (``_dq_reduce_tma``), in rank
    order when deterministic (``_dq_rank``)."""

    def _dq_rank(self, n_block, m_block, seqlen_q, seqlen_k):
        """This K/V tile's place among those adding into Q tile m_block (schedule.py's ranks, as the
        Hopper dQ writer takes them): a window bounds both ends, else the first tile is 0."""
        last = schedule.n_block_last(m_block, self.tm, self.tn, seqlen_q, seqlen_k, self.causal, imin=cutlass.min,
                                     window=self.window_or_none)
        first = Int32(0)
        if self.window_or_none is not None:
            first = schedule.n_block_first(m_block, self.tm, self.tn, seqlen_q, seqlen_k, self.causal,
                                           imax=cutlass.max, window=self.window_or_none)
        return self.dq_order.rank(n_block, first, last)

    @cute.jit
    def dq_drain(self, n_block: Int32, seq: SeqBounds, head_kv: Int32, m_min: Int32, n_m: Int32, n_iter: Int32,
                 group: Int32, mbar: cute.Pointer, tmem_ptr: cute.Pointer, mdQacc: cute.Tensor, mSemaphore: cute.Tensor,
                 mma_dq: cute.TiledMma, sdQ: cute.Tensor | None, tma_atom_dQ: cute.CopyAtom | None,
                 tma_dQ: cute.Tensor | None):
        """dQ rows of each Q tile: TMEM -> registers, then reduce-adds at the tile's rows of the sequence
        (varlen: packed row offset_q + row; rows past the sequence's end add nothing) -- per-row atomics,
        or (dq_tma) staged in sdQ and added by TMA (_dq_reduce_tma)."""
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        tidx = cute.arch.thread_idx()[0] % 128
        tm, ch = self.tm, 32
        accdQ = self._tmem_acc(tmem_ptr, mma_dq, (tm, self.d), self.tmem.dq)
        sub = lambda t, off: cute.make_tensor(t.iterator + off, cute.composition(t.layout, cute.make_layout((tm, ch))))  # noqa: E731
        ld = tcgen05.make_tmem_copy(cute.make_copy_atom(tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(ch)), Float32),
                                    sub(accdQ, 0))
        thr_ld = ld.get_slice(tidx)
        r_shape = thr_ld.partition_D(cute.make_identity_tensor((tm, ch))).shape
        for it in cutlass.range(n_iter, unroll=1):
            head = head_kv * group + it // n_m
            m_block = m_min + it % n_m
            row = m_block * tm + tidx
            cute.arch.mbarrier_wait(self._bar(mbar, "dq_full"), it % 2)
            tcgen05_fence_after_sync()
            # the whole dQ row -> registers, then hand the columns back at once: dP^T(it + 1) waits
            # on dq_empty, and the atomics (and, deterministic, the semaphore) are then off its path
            rdq = cute.make_rmem_tensor((self.d,), Float32)
            self._tmem_load_row(rdq, lambda c: sub(accdQ, c * ch), ld, thr_ld, r_shape, self.d // ch)
            tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "dq_empty"))
            if const_expr(self.dq_tma):
                self._dq_reduce_tma(rdq, it, m_block, head, seq.bidx, sdQ, tma_atom_dQ, tma_dQ, thr_ld, r_shape)
            if const_expr(self.deterministic):
                sem = common.elem_pointer(mSemaphore, (seq.batch, head, m_block))  # varlen: per sequence
                common.semaphore_wait(sem, self._dq_rank(n_block, m_block, seqlen_q, seqlen_k), tidx)
                cute.arch.barrier(barrier_id=BAR_DQ, number_of_threads=128)
            if const_expr(not self.dq_tma):
                if row < seqlen_q:
                    g = mdQacc[seq.bidx, self._packed_row(row, seq.offset_q), head, None]
                    for j in cutlass.range_constexpr(self.d // 2):
                        common.red_add_f32x2(common.elem_pointer(g, 2 * j), rdq[2 * j], rdq[2 * j + 1])
            if const_expr(self.deterministic):
                cute.arch.barrier(barrier_id=BAR_DQ, number_of_threads=128)
                common.semaphore_signal(sem, tidx)
        if const_expr(self.dq_tma):
            # sdQ must outlive the last reduce's reads (the CTA's SMEM goes away when it exits)
            if cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4 == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _dq_reduce_tma(self, rdq: cute.Tensor, it: Int32, m_block: Int32, head: Int32, batch: Int32,
                       sdQ: cute.Tensor, tma_atom_dQ: cute.CopyAtom, tma_dQ: cute.Tensor, thr_ld,
                       r_shape: cutlass.Constexpr):
        """Q tile `it`'s dQ rows (thread r: rdq = row r, d fp32) into dQaccum by TMA reduce-add, in
        chunks of 32 columns: the warpgroup stores a chunk in sdQ (buffers alternate), fences it to
        the async proxy, syncs, and warp 0 issues one cp.reduce.async.bulk.tensor .add per chunk and
        commits it as a bulk group. Before that sync warp 0 waits until the previous chunk's reduce
        has read its buffer (wait_group.read 0), which is the buffer the next chunk overwrites: one
        reduce reads while the next chunk is stored. Rows past seqlen_q are clipped by the tensor map."""
        nch, bufs, cols = self.d // DQ_STAGE_COLS, DQ_STAGE_BUFS, DQ_STAGE_COLS
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) % 4
        gdQ = cute.local_tile(tma_dQ[None, None, head, batch], (self.tm, cols), (None, None))  # (tm, 32, m tiles, d/32)
        tdQsdQ, tdQgdQ = cpasync.tma_partition(tma_atom_dQ, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2),
                                               cute.group_modes(gdQ, 0, 2))  # (box, buffers), (box, m tiles, d/32)
        for c in cutlass.range_constexpr(nch):
            # the buffer sequence runs on across tiles; with an even chunk count it is c's parity
            buf = c % bufs if const_expr(nch % bufs == 0) else (it * nch + c) % bufs
            r = cute.make_rmem_tensor(r_shape, Float32)
            for j in cutlass.range_constexpr(cols):
                r[j] = rdq[c * cols + j]
            cute.autovec_copy(r, thr_ld.partition_D(sdQ[None, None, buf]))  # row r, swizzled 16-byte stores
            cute.arch.fence_proxy("async.shared", space="cta")  # generic stores -> visible to the TMA's reads
            if warp == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=BAR_DQ, number_of_threads=128)
            if warp == 0:
                cute.copy(tma_atom_dQ, tdQsdQ[None, buf], tdQgdQ[None, m_block, c])
                cute.arch.cp_async_bulk_commit_group()
