"""Stage 3, Blackwell (sm_100a): the load warp and the MMA warp of the FA4 forward (a mixin of
``blackwell_fwd.FlashAttentionForwardSm100``). COMPILED AND INSPECTED ONLY: no Blackwell GPU is
reachable from this project, so this code has never run on hardware.

The load warp fills sQ (both Q tiles) and the K / V ring; the MMA warp issues S_i = Q_i K_j^T (SS) and
O_i += P_i V_j (TS: P from TMEM) in the order the kernel's module docstring draws, each tcgen05.commit
arriving on the mbarrier that hands a result on. Both read the kernel's plan (self.cfg, self.stages,
self.tmem) and its barrier map (``_bar``, ``_ring``, ``_walk_step`` ...), which stay with the kernel class.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05

from stage3_fwd_kernel.blackwell_sync import opaque_i32, tcgen05_fence_after_sync
from stage3_fwd_kernel import blackwell_paged
from stage3_fwd_kernel.components.paged_kv import block_pages, key_block, logical_block


class LoadMmaRoles:
    """The load warp (``load``, ``load_kv``) and the MMA warp (``mma``, ``gemm_qk``, ``gemm_pv``)."""

    # ------------------------------------------------------------------ load warp
    @cute.jit
    def load(self, m_block: Int32, head: Int32, head_kv: Int32, batch: Int32, offset_q: Int32,
             offset_k: Int32, n_blocks: Int32, mbar: cute.Pointer, tma_Q: cute.Tensor, tma_K: cute.Tensor,
             tma_V: cute.Tensor, tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom,
             tma_atom_V: cute.CopyAtom, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
             thr_mma_qk: cute.ThrMma, thr_mma_pv: cute.ThrMma, n_block_min: Int32 | None = None,
             blocks_done: Int32 | None = None, tiles_done: Int32 | None = None,
             page_table: cute.Tensor | None = None, tile=None):
        """page_table (a paged build): K and V are the flat cache of pages, and key block n of the walk
        is found through the table (components.paged_kv; pages smaller than a block: blackwell_paged).
        tile: the AttentionTile (paged and varlen builds read its sequence, offset_k and seqlen_k)."""
        if const_expr(not self.varlen):
            mQ_cur = tma_Q[None, None, head, batch]      # (sq, d)
            mK_cur = tma_K[None, None, head_kv, batch]   # (sk, d)
            mV_cur = tma_V[None, None, head_kv, batch]   # (dv, sk)
        else:  # this sequence's rows start at its cu_seqlens offset
            mQ_cur = cute.domain_offset((offset_q, 0), tma_Q[None, None, head])
            mK_cur = tma_K[None, None, head_kv]          # (rows, d); paged: (pages x page_size, d)
            mV_cur = tma_V[None, None, head_kv]          # (dv, rows)
            if const_expr(page_table is None):  # paged: offset_k is a logical key, which key_block adds
                mK_cur = cute.domain_offset((offset_k, 0), mK_cur)
                mV_cur = cute.domain_offset((0, offset_k), mV_cur)
        gQ = cute.local_tile(mQ_cur, (self.tm, self.d), (None, 0))     # (tm, d, q tiles)
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
                                           cute.group_modes(thr_mma_qk.partition_A(gQ), 0, 3))
        tKsK, tKgK, tVsV, tVgV = self.kv_partitions(mK_cur, mV_cur, sK, sV, tma_atom_K, tma_atom_V, thr_mma_qk,
                                                    thr_mma_pv)
        # the first row of the walk's last V block past the sequence's keys (varlen builds zero it onwards)
        tail_row = None
        if const_expr(self.zero_v_tail):
            tail_row = tile.seqlen_k - self._key_block(n_block_min, n_blocks - 1) * self.tn
        # 1. Q_0, K_0, Q_1, V_0: S_0(0) can start as soon as Q_0 and K_0 are in
        for i in cutlass.range_constexpr(self.num_q):
            if const_expr(self.persistent):
                # sQ_i feeds the previous tile's S_i until the MMA warp's q_empty commit (first tile: passes)
                cute.arch.mbarrier_wait(self._bar(mbar, "q_empty", i), self._tile_parity(tiles_done) ^ 1)
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(self._bar(mbar, "q_full", i), self.bytes_Q)
            cute.copy(tma_atom_Q, tQgQ[None, m_block * self.num_q + i], tQsQ[None, i],
                      tma_bar_ptr=self._bar(mbar, "q_full", i))
            if const_expr(i == 0):
                first = self._block_source(page_table, tile, n_block_min, 0)
                self.load_kv(2 * self._walk_step(blocks_done, 0), first, mbar, tma_atom_K, tKgK, tKsK, self.bytes_K)
        self.load_v(2 * self._walk_step(blocks_done, 0) + 1, first, n_blocks == 1, mbar, tma_atom_V, tVgV, tVsV, sV,
                    tail_row, tiles_done)
        # 2. K_j, V_j as ring slots free up (load j of the walk: slot and phase count from its start)
        for j in cutlass.range(1, n_blocks, unroll=1):
            source = self._block_source(page_table, tile, n_block_min, j)
            self.load_kv(2 * self._walk_step(blocks_done, j), source, mbar, tma_atom_K, tKgK, tKsK, self.bytes_K)
            self.load_v(2 * self._walk_step(blocks_done, j) + 1, source, j == n_blocks - 1, mbar, tma_atom_V, tVgV,
                        tVsV, sV, tail_row, tiles_done)

    @cute.jit
    def kv_partitions(self, mK_cur: cute.Tensor, mV_cur: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                      tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom, thr_mma_qk: cute.ThrMma,
                      thr_mma_pv: cute.ThrMma):
        """(tKsK, tKgK, tVsV, tVgV): the TMA views of the ring, (TMA, slot) -- (TMA, box, slot) when
        pages are smaller than a key block -- and of the keys, (TMA, block) or (TMA, page)."""
        rows = self.box_rows
        if const_expr(self.boxes_per_block > 1):
            thr_mma_qk = blackwell_paged.box_mma_qk(self.dtype, self.tm, rows).get_slice(0)
            sK = blackwell_paged.boxed_ring(sK, rows, self.boxes_per_block, False)
            sV = blackwell_paged.boxed_ring(sV, rows, self.boxes_per_block, True)
        gK = cute.local_tile(mK_cur, (rows, self.d), (None, 0))     # (rows, d, boxes)
        gV = cute.local_tile(mV_cur, (self.dv, rows), (0, None))    # (dv, rows, boxes)
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
                                           cute.group_modes(thr_mma_qk.partition_B(gK), 0, 3))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
                                           cute.group_modes(thr_mma_pv.partition_B(gV), 0, 3))
        return tKsK, tKgK, tVsV, tVgV

    @cute.jit
    def _block_source(self, page_table: cute.Tensor | None, tile, n_block_min: Int32 | None, j: Int32) -> Int32:
        """Where walk step j's K / V come from: the block coordinate (a paged cache: its block in the flat
        cache), or, pages smaller than a block, the page of the lane's box (blackwell_paged)."""
        n_block = self._key_block(n_block_min, j)
        if const_expr(self.boxes_per_block > 1):
            return block_pages(page_table, tile, logical_block(tile, self.tn, n_block), self.boxes_per_block,
                               self.box_rows)
        return key_block(page_table, self.blocks_per_page, self.tn, tile, n_block)

    @cute.jit
    def load_kv(self, load_idx: Int32, source: Int32, mbar: cute.Pointer, tma_atom: cute.CopyAtom,
                tXgX: cute.Tensor, tXsX: cute.Tensor, num_bytes: cutlass.Constexpr[int]):
        slot, phase = self._ring(load_idx)
        cute.arch.mbarrier_wait(self._bar(mbar, "kv_empty", slot), phase ^ 1)  # first lap: passes
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(self._bar(mbar, "kv_full", slot), num_bytes)
        self._copy_block(tma_atom, tXgX, tXsX, slot, source, self._bar(mbar, "kv_full", slot))

    @cute.jit
    def load_v(self, load_idx: Int32, source: Int32, last: Boolean, mbar: cute.Pointer, tma_atom: cute.CopyAtom,
               tVgV: cute.Tensor, tVsV: cute.Tensor, sV: cute.Tensor, tail_row: Int32 | None,
               tiles_done: Int32 | None):
        """V of one walk step; a varlen build's last one by way of its tail zeroing (blackwell_paged)."""
        if const_expr(self.zero_v_tail):
            if last:
                self.load_v_tail(load_idx, source, mbar, tma_atom, tVgV, tVsV, sV, tail_row, tiles_done)
            else:
                self.load_kv(load_idx, source, mbar, tma_atom, tVgV, tVsV, self.bytes_V)
        else:
            self.load_kv(load_idx, source, mbar, tma_atom, tVgV, tVsV, self.bytes_V)

    @cute.jit
    def load_v_tail(self, load_idx: Int32, source: Int32, mbar: cute.Pointer, tma_atom: cute.CopyAtom,
                    tVgV: cute.Tensor, tVsV: cute.Tensor, sV: cute.Tensor, tail_row: Int32,
                    tiles_done: Int32 | None):
        """The walk's last V: TMA onto v_tail, rows tail_row.. zeroed, then kv_full (a plain arrive)."""
        slot, phase = self._ring(load_idx)
        cute.arch.mbarrier_wait(self._bar(mbar, "kv_empty", slot), phase ^ 1)
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(self._bar(mbar, "v_tail", 0), self.bytes_V)
        self._copy_block(tma_atom, tVgV, tVsV, slot, source, self._bar(mbar, "v_tail", 0))
        cute.arch.mbarrier_wait(self._bar(mbar, "v_tail", 0), self._tile_parity(tiles_done))
        if tail_row < self.tn:
            self.zero_v_rows(sV, slot, tail_row)
            cute.arch.fence_view_async_shared()  # generic-proxy stores -> visible to the tensor core
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive(self._bar(mbar, "kv_full", slot))

    @cute.jit
    def zero_v_rows(self, sV: cute.Tensor, slot: Int32, first_row: Int32):
        """Zero V rows first_row .. tn - 1 of ring slot `slot` (sV ((cols, 16), 1, tn / 16, slot)):
        lane l takes rows first_row + l, + 32, ..., a row's columns in 16-byte stores."""
        zeros = cute.make_rmem_tensor(sV[(None, 0), 0, 0, 0].layout.shape, sV.element_type)
        zeros.fill(0.0)
        for r in cutlass.range(first_row + cute.arch.lane_idx(), self.tn, 32, unroll=1):
            cute.autovec_copy(zeros, sV[(None, r % blackwell_paged.ROWS_PER_MMA_K), 0,
                                        r // blackwell_paged.ROWS_PER_MMA_K, slot])

    @cute.jit
    def _copy_block(self, tma_atom: cute.CopyAtom, tXgX: cute.Tensor, tXsX: cute.Tensor, slot: Int32,
                    source: Int32, bar: cute.Pointer):
        """One key block into ring slot `slot`: one TMA box, or one a page, box j from the page lane j
        read (blackwell_paged)."""
        if const_expr(self.boxes_per_block > 1):
            for b in cutlass.range(self.boxes_per_block, unroll=1):  # unrolled, the load warp's 56 registers spill
                cute.copy(tma_atom, tXgX[None, cute.arch.shuffle_sync(source, b)], tXsX[None, b, slot],
                          tma_bar_ptr=bar)
        else:
            cute.copy(tma_atom, tXgX[None, source], tXsX[None, slot], tma_bar_ptr=bar)

    # ------------------------------------------------------------------ MMA warp
    @cute.jit
    def mma(self, n_blocks: Int32, mbar: cute.Pointer, tmem_ptr: cute.Pointer, sQ: cute.Tensor,
            sK: cute.Tensor, sV: cute.Tensor, tP_layout: cute.ComposedLayout,
            tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, blocks_done: Int32 | None = None,
            tiles_done: Int32 | None = None):
        thr_mma_qk = tiled_mma_qk.get_slice(0)
        thr_mma_pv = tiled_mma_pv.get_slice(0)
        if const_expr(self.persistent):
            # Q's SMEM descriptors from an address the compiler cannot hoist above the tile loop, where
            # this warp's 56 registers cannot hold all 16 for every tile (they spilled); not marked
            # warp-uniform: then they go back to uniform registers and spill there
            zero = cute.assume(opaque_i32(0), divby=1024)
            sQ = cute.make_tensor(sQ.iterator + zero, sQ.layout)
        tSrQ = thr_mma_qk.make_fragment_A(sQ)   # SMEM descriptors (MMA, M, K, q tile)
        tSrK = thr_mma_qk.make_fragment_B(sK)   # (MMA, N, K, slot)
        tOrV = thr_mma_pv.make_fragment_B(sV)   # (MMA, N, K, slot)
        tStS, tOtO, tOrP = self._tmem_tensors(tmem_ptr, thr_mma_qk, thr_mma_pv, tP_layout)

        # 1. S_i(0) = Q_i K_0^T for both tiles, then K_0's slot goes back to the load warp
        k_slot, k_phase = self._ring(2 * self._walk_step(blocks_done, 0))
        cute.arch.mbarrier_wait(self._bar(mbar, "kv_full", k_slot), k_phase)
        for i in cutlass.range_constexpr(self.num_q):
            cute.arch.mbarrier_wait(self._bar(mbar, "q_full", i), self._tile_parity(tiles_done))
            if const_expr(self.persistent):
                # S_i(0) overwrites the previous tile's final row statistics: the correction has read them
                cute.arch.mbarrier_wait(self._bar(mbar, "final_empty", i), self._tile_parity(tiles_done) ^ 1)
                tcgen05_fence_after_sync()
            self.gemm_qk(tiled_mma_qk, tStS[i], tSrQ[None, None, None, i], tSrK[None, None, None, k_slot])
            with cute.arch.elect_one():
                tcgen05.commit(self._bar(mbar, "s_full", i))
        with cute.arch.elect_one():
            tcgen05.commit(self._bar(mbar, "kv_empty", k_slot))

        # 2. steady state: O_i += P_i(j-1) V_(j-1), then S_i(j) = Q_i K_j^T, tile 0 then tile 1
        for j in cutlass.range(1, n_blocks, unroll=1):
            v_slot, v_phase = self._ring(2 * self._walk_step(blocks_done, j) - 1)
            k_slot, k_phase = self._ring(2 * self._walk_step(blocks_done, j))
            cute.arch.mbarrier_wait(self._bar(mbar, "kv_full", v_slot), v_phase)
            for i in cutlass.range_constexpr(self.num_q):
                self.gemm_pv(tiled_mma_pv, mbar, i, self._walk_step(blocks_done, j - 1), tOtO[i], tOrP[i],
                             tOrV[None, None, None, v_slot], accumulate=j > 1)
                if const_expr(i == 0):
                    cute.arch.mbarrier_wait(self._bar(mbar, "kv_full", k_slot), k_phase)
                self.gemm_qk(tiled_mma_qk, tStS[i], tSrQ[None, None, None, i], tSrK[None, None, None, k_slot])
                with cute.arch.elect_one():
                    tcgen05.commit(self._bar(mbar, "s_full", i))
            with cute.arch.elect_one():
                tcgen05.commit(self._bar(mbar, "kv_empty", v_slot))
                tcgen05.commit(self._bar(mbar, "kv_empty", k_slot))

        if const_expr(self.persistent):
            # every S_i of the tile is issued: sQ is free for the next tile's Q once they complete
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(self.num_q):
                    tcgen05.commit(self._bar(mbar, "q_empty", i))

        # 3. the last O_i += P_i V; each commit tells the correction warpgroup O_i is final
        v_slot, v_phase = self._ring(2 * self._walk_step(blocks_done, n_blocks) - 1)
        cute.arch.mbarrier_wait(self._bar(mbar, "kv_full", v_slot), v_phase)
        for i in cutlass.range_constexpr(self.num_q):
            self.gemm_pv(tiled_mma_pv, mbar, i, self._walk_step(blocks_done, n_blocks - 1), tOtO[i], tOrP[i],
                         tOrV[None, None, None, v_slot], accumulate=n_blocks > 1)
            with cute.arch.elect_one():
                tcgen05.commit(self._bar(mbar, "o_full", i))
        with cute.arch.elect_one():
            tcgen05.commit(self._bar(mbar, "kv_empty", v_slot))

    @cute.jit
    def gemm_qk(self, tiled_mma: cute.TiledMma, tStS: cute.Tensor, tSrQ: cute.Tensor, tSrK: cute.Tensor):
        """S = Q K^T: d / 16 tcgen05.mma (SS), the first one overwriting S. A fresh MMA object per
        call: we flip its ACCUMULATE field, and a field rebound inside a loop must not escape it."""
        tiled_mma = cute.make_tiled_mma(cute.make_mma_atom(tiled_mma.op))
        for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            tiled_mma.set(tcgen05.Field.ACCUMULATE, k != 0)
            cute.gemm(tiled_mma, tStS, tSrQ[None, None, k], tSrK[None, None, k], tStS)

    @cute.jit
    def gemm_pv(self, tiled_mma: cute.TiledMma, mbar: cute.Pointer, i: cutlass.Constexpr[int], n_block: Int32,
                tOtO: cute.Tensor, tOrP: cute.Tensor, tOrV: cute.Tensor, accumulate: Boolean):
        """O += P V (TS: P from TMEM): wait for 3/4 of P (and for the correction warpgroup's O
        rescale), issue 3/4 of the K = 16 steps, wait for the last quarter of P, issue the rest.
        n_block: the walk step whose P it is (persistent: counted from the CTA's first tile)."""
        tiled_mma = cute.make_tiled_mma(cute.make_mma_atom(tiled_mma.op))  # see gemm_qk
        phase = n_block % 2
        num_k = cute.size(tOrP, mode=[2])
        first = self.cfg.pv_k_blocks_first
        cute.arch.mbarrier_wait(self._bar(mbar, "p_full", i), phase)
        tcgen05_fence_after_sync()
        for k in cutlass.range_constexpr(num_k):
            if const_expr(k == first):
                cute.arch.mbarrier_wait(self._bar(mbar, "p_full_2", i), phase)
                tcgen05_fence_after_sync()
            if const_expr(k == 0):
                tiled_mma.set(tcgen05.Field.ACCUMULATE, accumulate)
            else:
                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
            cute.gemm(tiled_mma, tOtO, tOrP[None, None, k], tOrV[None, None, k], tOtO)
