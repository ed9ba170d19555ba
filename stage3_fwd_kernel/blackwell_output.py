"""Stage 3, Blackwell (sm_100a): O's way out of the FA4 forward (a mixin of
``blackwell_fwd.FlashAttentionForwardSm100``). COMPILED AND INSPECTED ONLY: no Blackwell GPU is
reachable from this project, so this code has never run on hardware.

The correction warpgroup leaves each finished O_i in sO; the epilogue warp stores it: one TMA store
per tile when sequences are dense (the tensor map clips the last tile's rows), row-guarded 16-byte
stores when they are packed (varlen), so a tile never writes into the next sequence.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.tensor_utils import LayoutEnum


class OutputRoles:
    """sO's layout, the TMA store or the varlen stores, where a tile's rows go, and the epilogue warp."""

    # O's way out, as methods so that blackwell_epilogue_check traces exactly these: the staging
    # layout in SMEM, the TMA store (dense) or the 16-byte stores (varlen), and where a tile's rows go
    def o_smem_layout(self):
        """sO: (tm, dv, q tile), row-major with the swizzle the helper picks for dv (128B / 64B)."""
        return sm100_utils.make_smem_layout_epi(self.dtype, LayoutEnum.ROW_MAJOR, (self.tm, self.dv), self.num_q)

    def o_tma_store_atom(self, mO, sO_layout):
        """(TMA store atom, TMA coordinate tensor) for one (tm, dv) stage of sO."""
        return cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(sO_layout, mode=[0, 1]), (self.tm, self.dv))

    def o_tma_partitions(self, tma_atom_O, tma_O, sO, head, batch):
        """(tOsO, tOgO): sO per q tile and O of (head, batch) per tm-row tile, as TMA boxes."""
        gO = cute.local_tile(tma_O[None, None, head, batch], (self.tm, self.dv), (None, 0))
        return cpasync.tma_partition(tma_atom_O, 0, cute.make_layout(1),
                                     cute.group_modes(sO, 0, 2), cute.group_modes(gO, 0, 2))

    def o_tile_index(self, m_block, i):
        """Q tile i of CTA m_block, counted in tm-row tiles of the sequence."""
        return m_block * self.num_q + i

    def o_tile_row0(self, m_block, i):
        """The first row of Q tile i of CTA m_block (the row guards and the lse rows count from it)."""
        return m_block * self.cfg.cta_tile_m + i * self.tm

    def varlen_o_copy(self):
        """16-byte stores, varlen_store_threads_per_row threads per O row, a warp covering whole rows:
        one 8-column vector per lane and tpr x 8 columns, repeated across dv. Not dv / tpr contiguous
        columns a lane: at dv = 96 those 24 cross sO's 32-column swizzle blocks, and the copy's view of
        sO put 8192 of a tile's 12288 elements in the wrong place (found by blackwell_epilogue_check;
        64 and 128 build the same copy either way)."""
        tpr = self.varlen_store_threads_per_row
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        thr_layout = cute.make_ordered_layout((32 // tpr, tpr), order=(1, 0))
        return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, 8)))

    def varlen_o_sequence(self, mO, head, offset_q):
        """O rows of this sequence and head: (seqlen, dv), row 0 at cu_seqlens_q[batch]."""
        return cute.domain_offset((offset_q, 0), mO[None, None, head])

    def varlen_o_partitions(self, thr_copy, mO_cur, sO_i, tile_index):
        """(tOsO, tOgO, tOcO): this lane's values of sO_i, of the tile's rows of O and their (row,
        column) in the tile; mode 1 runs over the lane's rows."""
        gO = cute.local_tile(mO_cur, (self.tm, self.dv), (tile_index, 0))
        return (thr_copy.partition_S(sO_i), thr_copy.partition_D(gO),
                thr_copy.partition_S(cute.make_identity_tensor((self.tm, self.dv))))

    def varlen_guard_row(self, tOcO, m):
        """The tile row of the lane's m-th store, as the guard reads it (its first value's row)."""
        return tOcO[0, m, 0][0]

    # ------------------------------------------------------------------ epilogue warp
    @cute.jit
    def epilogue(self, m_block: Int32, head: Int32, batch: Int32, offset_q: Int32, seqlen_q: Int32,
                 mbar: cute.Pointer, sO: cute.Tensor, tma_O: cute.Tensor | None,
                 tma_atom_O: cute.CopyAtom | None, mO: cute.Tensor, tiles_done: Int32 | None = None):
        if const_expr(not self.varlen):
            # TMA store: out-of-range rows of the last tile are clipped by the tensor map
            tOsO, tOgO = self.o_tma_partitions(tma_atom_O, tma_O, sO, head, batch)
            for i in cutlass.range_constexpr(self.num_q):
                cute.arch.mbarrier_wait(self._bar(mbar, "epi_full", i), self._tile_parity(tiles_done))
                cute.copy(tma_atom_O, tOsO[None, i], tOgO[None, self.o_tile_index(m_block, i)])
                cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # sO must outlive the reads
            if const_expr(self.persistent):
                for i in cutlass.range_constexpr(self.num_q):  # the next tile's O may go to sO
                    cute.arch.mbarrier_arrive(self._bar(mbar, "epi_empty", i))
        else:
            # packed sequences: 16-byte stores, rows past this sequence's end skipped
            tiled_copy = self.varlen_o_copy()
            thr_copy = tiled_copy.get_slice(cute.arch.lane_idx())
            mO_cur = self.varlen_o_sequence(mO, head, offset_q)
            for i in cutlass.range_constexpr(self.num_q):
                cute.arch.mbarrier_wait(self._bar(mbar, "epi_full", i), self._tile_parity(tiles_done))
                row0 = self.o_tile_row0(m_block, i)
                tOsO, tOgO, tOcO = self.varlen_o_partitions(thr_copy, mO_cur, sO[None, None, i],
                                                            self.o_tile_index(m_block, i))
                for m in cutlass.range_constexpr(cute.size(tOsO, mode=[1])):
                    if row0 + self.varlen_guard_row(tOcO, m) < seqlen_q:
                        r = cute.make_rmem_tensor_like(tOsO[None, m, None])
                        cute.autovec_copy(tOsO[None, m, None], r)
                        cute.copy(tiled_copy, r, tOgO[None, m, None])
                if const_expr(self.persistent):  # this lane has read sO_i
                    cute.arch.mbarrier_arrive(self._bar(mbar, "epi_empty", i))
