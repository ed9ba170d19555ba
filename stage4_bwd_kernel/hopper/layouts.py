"""Shared-memory layouts, tiled MMAs and the dQ layouts of the production Hopper backward.

Every operand tile is row-major with the widest swizzle its major mode allows. The dQ accumulator has
two forms:

* fragment order (``dq_frag``, the default): register i of consumer thread t of warpgroup w is float
  (i // 4) * 512 + t * 4 + i % 4 of share w, in sdQ and in dQaccum alike, so a warpgroup stores its
  share with 16-byte STS (a warp's 512 bytes contiguous, no bank conflicts) and the writer adds it with
  one contiguous bulk reduce. ``postprocess_frag`` asks ``make_tiled_mma_dQ`` where each register
  belongs and writes dq.
* row order (causal deterministic d = 128): each warpgroup's share of a dQ tile is a swizzled tile of
  its own that one TMA tensor reduce-add reads.
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, const_expr, pipeline
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

from stage3_fwd_kernel.host_io import top_padding
from stage4_bwd_kernel import common
from stage4_bwd_kernel.hopper.options import NUM_WG_MMA


class Mmas(NamedTuple):
    SdP: cute.TiledMma   # S^T, dP^T (tn x tm): the warpgroups split the keys (wide: the queries)
    dV: cute.TiledMma    # dV (tn x dv) += P^T dO, A from registers (wide: from SMEM, columns split)
    dK: cute.TiledMma    # dK (tn x d) += dS^T Q, likewise
    dQ: cute.TiledMma    # dQ = dS K, or dQ^T = K^T dS^T (LayoutPlan.make_tiled_mma_dQ)


def dq_frag_tiled_copy() -> cute.TiledCopy:
    """dq_frag: a warpgroup's 128 threads x 4 consecutive fp32 (16 bytes) per copy over a flat share."""
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
    return cute.make_tiled_copy_tv(atom, cute.make_layout(128), cute.make_layout(4))


class LayoutPlan:
    """Layout methods of the kernel class (they read tile_m, tile_n, head_dim, dtype, the options)."""

    def _smem_layout(self, rows: int, cols: int, major_mode_size: int, stages: int | None = None):
        """Row-major (rows, cols) tile, swizzle atom sized for `major_mode_size`, optional stage mode."""
        atom_kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, major_mode_size)
        atom = warpgroup.make_smem_layout_atom(atom_kind, self.dtype)
        if stages is None:
            return cute.tile_to_shape(atom, (rows, cols), (0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))

    def operand_swizzle_widths(self) -> tuple[int, int, int, int]:
        """Major-mode sizes that pick the swizzles of sQ, sdO, sK, sV. Q / dO are the MN-major B of dK /
        dV, whose N is d / dv whole (one warpgroup; wide: split in two), K the MN-major B of dQ with N
        split (d / 2); each also serves as a K-major operand of S^T / dP^T, which any swizzle does."""
        d, dv, wgs = self.head_dim, self.head_dim_v, NUM_WG_MMA
        if self.kv_swap:  # Q / dO: the MN-major A of dK^T / dV^T, whole; K: dQ's B, split (wide_swap.py)
            return d, dv, d // wgs, dv
        if self.wide:
            return d // wgs, dv // wgs, d // wgs, dv // wgs
        return d, dv, d // wgs, dv // wgs

    def make_mmas(self) -> Mmas:
        """The four tiled MMAs. Two warpgroups along M: each owns 64 keys of the 128-key tile, and
        dV / dK read P^T / dS^T from registers. Wide: along N, the 64 keys shared -- S^T / dP^T split by
        queries, dV / dK by columns with A (P^T / dS^T) from SMEM (wide.py)."""
        k_major, mn_major = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        tm, d, dv, wgs = self.tile_m, self.head_dim, self.head_dim_v, NUM_WG_MMA
        if self.kv_swap:
            return self.make_mmas_swap()
        if self.wide:
            split, sdp_n, dv_n, dk_n, a_source = (1, wgs, 1), tm // wgs, dv // wgs, d // wgs, warpgroup.OperandSource.SMEM
        else:
            split, sdp_n, dv_n, dk_n, a_source = (wgs, 1, 1), tm, dv, d, warpgroup.OperandSource.RMEM
        sdp = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, k_major, k_major, Float32, split, (64, sdp_n))
        mma_dv = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, k_major, mn_major, Float32, split,
                                                   (64, dv_n), a_source=a_source)
        mma_dk = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, k_major, mn_major, Float32, split,
                                                   (64, dk_n), a_source=a_source)
        return Mmas(sdp, mma_dv, mma_dk, self.make_tiled_mma_dQ())

    def _gmem_store(self, cols: int):
        """256 consumer threads, 16-byte stores, a 128/64/32-byte row chunk per thread group."""
        elems = 128 // self.dtype.width
        atom_cols = 64 if cols % 64 == 0 else (32 if cols % 32 == 0 else 16)
        threads_per_row = atom_cols // elems
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        thr = cute.make_ordered_layout((128 * NUM_WG_MMA // threads_per_row, threads_per_row), order=(1, 0))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))

    def _dq_share(self) -> tuple[int, int]:
        """(rows, columns) of one consumer warpgroup's share of a dQ tile: its 64 query rows (dq_split_m)
        or its d / 2 columns (the dQ wgmma splits N, or with dq_swap_ab the M of dQ^T)."""
        if self.dq_split_m:
            return self.tile_m // NUM_WG_MMA, self.head_dim
        return self.tile_m, self.head_dim // NUM_WG_MMA

    def _sdq_layout(self, shares: bool = True):
        """Row order: (rows, cols, warpgroups x buffers) fp32, each share (share s = buffer * 2 +
        warpgroup) a swizzled tile of its own that one TMA tensor copy reads. shares=False: one share,
        built rather than sliced (this CuTe-DSL aborts slicing the last mode of a swizzled layout for
        some row counts: 48, 72, 80, 112)."""
        atom_kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, Float32, self.head_dim // NUM_WG_MMA)
        atom = warpgroup.make_smem_layout_atom(atom_kind, Float32)
        rows, cols = self._dq_share()
        if not shares:
            return cute.tile_to_shape(atom, (rows, cols), (0, 1))
        return cute.tile_to_shape(atom, (rows, cols, NUM_WG_MMA * self.dq_buffers), (0, 1, 2))

    def dq_frag_share_elems(self) -> int:
        """fp32 elements of one warpgroup's share of a dQ tile (dq_frag: one contiguous chunk)."""
        return self.tile_m * self.head_dim // NUM_WG_MMA

    def dq_frag_share_pointer(self, mdQacc: cute.Tensor, walk, head, m_block, share):
        """dq_frag: the first float of warpgroup share `share` of dQ tile m_block of this walk's sequence
        and query head in the (B, H, rows, d) dQaccum (the writer's bulk reduce, or dq_atomic's reds)."""
        row = self.dq_frag_tile_row(walk.offset_q, walk.batch, m_block)
        return common.elem_pointer(mdQacc, (walk.bidx, head, row, 0)) + share * self.dq_frag_share_elems()

    def dq_frag_tiled_copy(self) -> cute.TiledCopy:
        """The copy that stores (kernel) and reads back (postprocess_frag) a share in fragment order."""
        return dq_frag_tiled_copy()

    def _sdq_frag_layout(self) -> cute.ComposedLayout:
        """Fragment order: (share elements, warpgroups x buffers), unswizzled (an identity swizzle keeps
        the ComposedLayout interface of _sdq_layout)."""
        return cute.make_composed_layout(cute.make_swizzle(0, 4, 3), 0, cute.make_layout(
            (self.dq_frag_share_elems(), NUM_WG_MMA * self.dq_buffers)))

    def top_padding(self, seqlen_q):
        """q_shift: rows of zeros before query 0, so the Q tiles end with the sequence: the distance to
        the next multiple of tile_m, rounded down to a multiple of 4 (the row statistics' TMA boxes
        start 16-byte aligned). Python ints or traced Int32."""
        return top_padding(seqlen_q, self.tile_m, multiple=4)

    def dq_frag_tile(self, offset_q, batch, m_block):
        """dq_frag: index of dQ tile m_block of sequence `batch` among the (B, H, rows, d) dQaccum's tiles
        of tile_m rows. A varlen sequence's first tile is (offset_q + batch * tile_m) // tile_m, so each
        sequence owns whole tiles and none overlaps the next (dense: tile m_block). It also indexes the
        tiles' arrival counters (dq_writer.py)."""
        first = (offset_q + batch * self.tile_m) // self.tile_m if const_expr(self.varlen) else 0
        return first + m_block

    def dq_frag_tile_row(self, offset_q, batch, m_block):
        """dq_frag: first row of dQ tile m_block of sequence `batch` in the (B, H, rows, d) dQaccum."""
        return self.dq_frag_tile(offset_q, batch, m_block) * self.tile_m

    def dq_frag_accum_rows(self, rows_q: int, batch: int) -> int:
        """Host: rows of the (B, H, rows, d) dQaccum for seqlen_q (dense) or total_q (varlen) rows."""
        extra = (batch + 1) * self.tile_m if self.varlen else 0
        return common.cdiv(rows_q + extra, self.tile_m) * self.tile_m

    def make_tiled_mma_dQ(self) -> cute.TiledMma:
        """dQ (tm x d) = dS K: A = dS (MN-major view of dS^T), B = K^T (MN-major); the warpgroups split
        the query rows (dq_split_m) or the d columns; dq_swap_ab: dQ^T (d x tm) = K^T dS^T, the
        warpgroups split d (M) and tm is the N, so tm need not be a multiple of 64."""
        mn = cute.nvgpu.OperandMajorMode.MN
        a_major = cute.nvgpu.OperandMajorMode.K if self.kv_swap else mn  # kv_swap: dS is stored (queries, keys)
        wg_m, wg_n = (NUM_WG_MMA, 1, 1), (1, NUM_WG_MMA, 1)
        if self.dq_split_m:
            dq_split, dq_tile = wg_m, (64, self.head_dim)
        else:
            dq_split, dq_tile = wg_n, (64, self.head_dim // NUM_WG_MMA)
        if const_expr(self.dq_swap_ab):
            dq_split, dq_tile = wg_m, (64, self.tile_m)
        return sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, a_major, mn, Float32, dq_split, dq_tile)

    def _sdq_tile_view(self) -> cute.Layout:
        """(tm, d, buffers) -> index into the shares of _sdq_layout: the dQ tiles as the consumers' MMA
        partitions see them (warpgroup w's rows or columns land in share buffer * 2 + w)."""
        rows, cols = self._dq_share()
        share = rows * cols
        if self.dq_split_m:
            return cute.make_layout(((rows, NUM_WG_MMA), cols, self.dq_buffers),
                                    stride=((1, share), rows, NUM_WG_MMA * share))
        return cute.make_layout((rows, (cols, NUM_WG_MMA), self.dq_buffers),
                                stride=(1, (rows, share), NUM_WG_MMA * share))

    def stats_offset(self, offset_q, batch):
        """First row of this sequence's lse2 / D: varlen sequences start 16-byte aligned there
        (common.stats_offset), dense ones at offset_q (0)."""
        return common.stats_offset(offset_q, batch) if const_expr(self.varlen) else offset_q

    def tile_state(self, t, producer: bool) -> pipeline.PipelineState:
        """Pipeline slot of tile t of the walk: stage t % stages, phase flips every lap; the producer
        starts one phase ahead (its first lap must not wait for "empty")."""
        phase = (t // self.num_stages) % 2
        if const_expr(producer):
            phase = phase ^ 1
        return pipeline.PipelineState(self.num_stages, t, t % self.num_stages, phase)
