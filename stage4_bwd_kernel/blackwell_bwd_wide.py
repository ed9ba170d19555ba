"""Stage 4, Blackwell (sm_100a): the wide-head 1-CTA backward, head dims (192, 128) and 256. COMPILED AND
INSPECTED ONLY: no Blackwell GPU is reachable from this project; this kernel has never run.

The 1-CTA kernel (blackwell_bwd.py) keeps S^T, dP^T, dV and dK of a 128 x 128 tile in TMEM: at d = 192
that is 128 + 128 + 128 + 192 = 576 columns, and dQ has nowhere to go. This kernel changes three things
(blackwell_config.py, "The wide 1-CTA kernel", has the column and byte counts):

* **A 64-query tile.** S^T = K Q^T and dP^T = V dO^T are M = 128 keys x N = 64 queries, 64 columns each;
  P^T and dS^T (16-bit) take 32. dK and dV still accumulate over the whole walk.
* **dQ transposed.** dQ^T = K^T dS^T has M = 128 head-dim rows (lane = head-dim column of dQ), N = 64
  queries, K = 128 keys: the B operand is dS^T from SMEM with the queries contiguous -- the bytes the
  elementwise warpgroup already writes (thread = key, a 128-byte column of 64 queries) -- and A is a
  128-column window of the K tile read MN-major. At d = 192 two windows cover rows [0, 128) and
  [64, 192); the drain keeps rows [128, 192) of the second (1/3 more dQ MMA work, 1/14 of the tile's).
  Thread r of the drain owns head-dim column r, so a warp's dQ atomics hit 32 consecutive floats of one
  row: one coalesced 128-byte reduction, where the 1-CTA kernel's row-per-thread v2 adds touch 32 rows.
* **A serial schedule.** Per Q tile j the MMA warp issues S(j), dP(j), dV(j), dK(j), dQ^T(j). At
  (192, 128) the dQ^T windows lie over S^T and dP^T, so S(j + 1) waits until WG 2 has drained dQ^T(j)
  (dq_empty); at 256 the window has columns of its own and only dQ^T(j + 1) waits. The exp of tile
  j + 1 no longer overlaps the tensor core's dK / dQ of tile j (the 1-CTA pipeline's gain): at (192, 128)
  nothing else fits TMEM, and at 256 the one Q / dO stage cannot take Q(j + 1) before dK(j) read Q(j).

At d = 256 dK and dV alone fill TMEM. A pair of CTAs then splits the head dim (``head_splits`` = 2):
CTA h = blockIdx.x % 2 owns columns [128h, 128h + 128) of dK, dV and dQ. Both load the whole K, V, Q, dO
tiles (S^T and dP^T reduce over the whole head dim, so both compute them: 1.4x the MMA work of an
unsplit tile) and read their halves of Q, dO and K as the B / A operands of dK, dV and dQ^T (SMEM views
at a whole-swizzle-atom offset). The launch order gives the two halves adjacent blockIdx.x, so they
read the same tiles through L2 at about the same time. Deterministic: both halves of a K/V tile wait
for 2 x its rank on the Q tile's semaphore and add 1 each (the 2-CTA kernel's rule).

Roles, barriers and the elementwise warpgroup are the 1-CTA kernel's (same names and counts); what
differs is listed above. Supported: bf16 / fp16, causal or not, GQA / MQA, deterministic, varlen
(+ seqused_k), window and softcap. Not here: dQ by TMA reduce-add (no SMEM is left at d = 256), a
persistent scheduler.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import tcgen05

from stage3_fwd_kernel import compile_cache
from stage3_fwd_kernel.blackwell_sync import tcgen05_fence_after_sync, tcgen05_fence_before_sync
from stage4_bwd_kernel import common
from stage4_bwd_kernel import blackwell_bwd as _one
from stage4_bwd_kernel.blackwell_bwd import FlashAttentionBackwardSm100
from stage4_bwd_kernel.blackwell_dq import BAR_DQ
from stage4_bwd_kernel.blackwell_config import (DQT_WINDOW, WIDE_TILE_M, BlackwellBwdConfig, BwdWideTmemPlan,
                                                blackwell_bwd_wide_config)
from stage4_bwd_kernel.hopper.walk import SeqBounds

STEP = "blackwell_bwd_wide"
ATOM_COLS = 64    # head-dim columns of one 128B-swizzle atom (16-bit): the unit of a sub-tile view's offset


def part_offset(col: int, rows: int) -> int:
    """Elements from a K-major (rows, head dim) tile's start to head-dim column `col` (a multiple of 64):
    each 64-column swizzle-atom column of the tile is rows x 64 contiguous elements."""
    if col % ATOM_COLS:
        raise ValueError(f"col: a sub-tile view starts at a multiple of {ATOM_COLS} columns, got {col}")
    return (col // ATOM_COLS) * rows * ATOM_COLS


def split_order(order, splits: int):
    """`order` with each K/V tile launched as `splits` adjacent CTAs (blockIdx.x // splits picks the
    tile, blockIdx.x % splits the head-dim part); the ranks are the order's own."""
    if splits == 1:
        return order

    class HeadSplitOrder(order):
        name = f"{order.name}_split{splits}"

        @staticmethod
        def n_block_for_launch(bx, num_n_blocks):
            return order.n_block_for_launch(bx // splits, num_n_blocks)

    return HeadSplitOrder


class FlashAttentionBackwardSm100Wide(FlashAttentionBackwardSm100):
    """The wide 1-CTA backward for one blackwell_bwd_wide_config plan."""

    def __init__(self, config: BlackwellBwdConfig, dq_order=None, *, varlen: bool = False,
                 has_seqused_k: bool = False):
        if config.tile_m != WIDE_TILE_M or not isinstance(config.tmem, BwdWideTmemPlan):
            raise ValueError("FlashAttentionBackwardSm100Wide needs a wide plan (blackwell_bwd_wide_config)")
        super().__init__(config, dq_order, varlen=varlen, has_seqused_k=has_seqused_k)
        self.splits = config.head_splits
        self.dk_cols, self.dv_cols = self.d // self.splits, self.dv // self.splits
        self.windows = config.tmem.dq_windows
        self.dq_order = split_order(self.dq_order, self.splits)

    # ------------------------------------------------------------------ host side
    def mmas_and_smem_layouts(self):
        """The five tiled MMAs (dQ^T in place of dQ) and the SMEM layouts. sQt / sdOt / sKt are the
        views of this CTA's head-dim part (sKt: one 128-row dQ^T window), placed by _part_view."""
        MN_ = cute.nvgpu.OperandMajorMode.MN
        dt, d, dv, tm, tn = self.dtype, self.d, self.dv, self.tm, self.tn
        dkc, dvc = self.dk_cols, self.dv_cols
        mma_s, mma_dp, mma_dv, mma_dk = self.tile_mmas()
        mma_dqt = sm100_utils.make_trivial_tiled_mma(dt, dt, MN_, MN_, Float32, tcgen05.CtaGroup.ONE, (DQT_WINDOW, tm))
        tiler_s, tiler_dp = (tn, tm, d), (tn, tm, dv)
        tiler_dv, tiler_dk, tiler_dqt = (tn, dvc, tm), (tn, dkc, tm), (DQT_WINDOW, tm, tn)
        st = self.stages
        layouts = dict(
            sK=sm100_utils.make_smem_layout_a(mma_s, tiler_s, dt, 1),
            sV=sm100_utils.make_smem_layout_a(mma_dp, tiler_dp, dt, 1),
            sQ=sm100_utils.make_smem_layout_b(mma_s, tiler_s, dt, st),
            sdO=sm100_utils.make_smem_layout_b(mma_dp, tiler_dp, dt, st),
            sQt=sm100_utils.make_smem_layout_b(mma_dk, tiler_dk, dt, st),
            sdOt=sm100_utils.make_smem_layout_b(mma_dv, tiler_dv, dt, st),
            sKt=sm100_utils.make_smem_layout_a(mma_dqt, tiler_dqt, dt, 1),
            sdS=sm100_utils.make_smem_layout_b(mma_dqt, tiler_dqt, dt, 1),   # dS^T: (64 queries, 128 keys)
            tP=sm100_utils.make_smem_layout_a(mma_dv, tiler_dv, dt, 1),
            tdS=sm100_utils.make_smem_layout_a(mma_dk, tiler_dk, dt, 1))
        return (mma_s, mma_dp, mma_dv, mma_dk, mma_dqt), layouts

    def _grid(self, num_n_blocks, mK, mCuSeqlensQ) -> tuple:
        grid = super()._grid(num_n_blocks, mK, mCuSeqlensQ)
        return (grid[0] * self.splits, grid[1], grid[2])

    # ------------------------------------------------------------------ device side
    def _head_part(self):
        """This CTA's head-dim part (0 .. splits - 1): blockIdx.x % splits; a Python 0 when unsplit."""
        if self.splits == 1:
            return 0
        return cute.arch.block_idx()[0] % self.splits

    def _part_view(self, view: cute.Tensor, part, col0: int, part_cols: int, rows: int) -> cute.Tensor:
        """`view` (a transposed view of a K-major (rows, head dim) tile) moved to head-dim column
        part * part_cols + col0 (part: this CTA's head-dim part, dynamic; the rest constants), by
        part_offset: whole swizzle atoms, so the swizzle phase is kept (blackwell_layout_check checks it)."""
        move = part_offset(col0, rows)
        if const_expr(self.splits > 1):
            move = move + part * part_offset(part_cols, rows)
        return cute.make_tensor(view.iterator + move, view.layout)

    def _dkdv_chunk0(self, width: int):
        if self.splits == 1:
            return 0
        return self._head_part() * (width // 32)

    def _ds_smem_chunk(self, sdS: cute.Tensor, key, c: int) -> cute.Tensor:
        """dS^T as the dQ^T MMA's MN-major B operand: key's 64 queries are one 128-byte row."""
        col = sdS[(None, key % 16), 0, key // 16, 0]           # dS[:, key]: (64,) of 16-bit
        return cute.local_tile(col, (32,), (c,))

    @cute.jit
    def mma(self, n_iter: Int32, mbar: cute.Pointer, tmem_ptr: cute.Pointer, sK: cute.Tensor, sV: cute.Tensor,
            sQ: cute.Tensor, sdO: cute.Tensor, sQt: cute.Tensor, sdOt: cute.Tensor, sKt: cute.Tensor,
            sdS: cute.Tensor, tP_layout: cute.ComposedLayout, tdS_layout: cute.ComposedLayout,
            mma_s: cute.TiledMma, mma_dp: cute.TiledMma, mma_dv: cute.TiledMma, mma_dk: cute.TiledMma,
            mma_dq: cute.TiledMma):
        """The serial schedule: per Q tile S, dP, dV, dK, the dQ^T windows. Where the windows lie over
        S^T and dP^T ((192, 128)), S(j + 1) waits for dq_empty(j); where they have columns of their own
        (256), only dQ^T(j + 1) does. Q / dO go back to the load warp after dK, their last reader."""
        tm, tn, T = self.tm, self.tn, self.tmem
        over = T.dq_over_scores
        part = self._head_part()
        s_, dp_, dv_, dk_, dq_ = (m.get_slice(0) for m in (mma_s, mma_dp, mma_dv, mma_dk, mma_dq))
        tK, tQ = s_.make_fragment_A(sK), s_.make_fragment_B(sQ)
        tV, tdO = dp_.make_fragment_A(sV), dp_.make_fragment_B(sdO)
        tdOt = dv_.make_fragment_B(self._part_view(sdOt, part, 0, self.dv_cols, tm))
        tQt = dk_.make_fragment_B(self._part_view(sQt, part, 0, self.dk_cols, tm))
        tdSt_b = dq_.make_fragment_B(sdS)
        # each dQ^T window: its K^T view (A) and its accumulator, made once for the walk
        tKw = [dq_.make_fragment_A(self._part_view(sKt, part, w0, self.dk_cols, tn)) for w0 in self.windows]
        accQ = [self._tmem_acc(tmem_ptr, mma_dq, (DQT_WINDOW, tm), T.dq + w * tm) for w in range(len(self.windows))]
        accS = self._tmem_acc(tmem_ptr, mma_s, (tn, tm), T.s)
        accdP = self._tmem_acc(tmem_ptr, mma_dp, (tn, tm), T.dp)
        accdV = self._tmem_acc(tmem_ptr, mma_dv, (tn, self.dv_cols), T.dv)
        accdK = self._tmem_acc(tmem_ptr, mma_dk, (tn, self.dk_cols), T.dk)
        tP = self._tmem_a(tmem_ptr, mma_dv, tP_layout, T.p)
        tdSt = self._tmem_a(tmem_ptr, mma_dk, tdS_layout, T.ds)

        cute.arch.mbarrier_wait(self._bar(mbar, "kv_full"), 0)
        for j in cutlass.range(n_iter, unroll=1):
            slot, phase = j % self.stages, (j // self.stages) % 2
            cute.arch.mbarrier_wait(self._bar(mbar, "qdo_full", slot), phase)
            if const_expr(over):
                self._wait_dq_drained(mbar, j)
            self.gemm(mma_s, accS, tK[None, None, None, 0], tQ[None, None, None, slot], False)
            with cute.arch.elect_one():
                tcgen05.commit(self._bar(mbar, "s_full"))
            self.gemm(mma_dp, accdP, tV[None, None, None, 0], tdO[None, None, None, slot], False)
            with cute.arch.elect_one():
                tcgen05.commit(self._bar(mbar, "dp_full"))
            # dV += P^T dO  (TS; this CTA's dO columns)
            cute.arch.mbarrier_wait(self._bar(mbar, "p_full"), j % 2)
            tcgen05_fence_after_sync()
            self.gemm(mma_dv, accdV, tP, tdOt[None, None, None, slot], j > 0)
            # dK += dS^T Q  (TS; Q's last reader), then dQ^T = K^T dS^T per window -- at (192, 128) over
            # S^T / dP^T: issued after the MMAs that read P^T and dS^T there, which run in issue order
            cute.arch.mbarrier_wait(self._bar(mbar, "ds_full"), j % 2)
            tcgen05_fence_after_sync()
            self.gemm(mma_dk, accdK, tdSt, tQt[None, None, None, slot], j > 0)
            with cute.arch.elect_one():
                tcgen05.commit(self._bar(mbar, "qdo_empty", slot))
            if const_expr(not over):
                self._wait_dq_drained(mbar, j)
            for w in cutlass.range_constexpr(len(self.windows)):
                self.gemm(mma_dq, accQ[w], tKw[w][None, None, None, 0], tdSt_b[None, None, None, 0], False)
            with cute.arch.elect_one():
                tcgen05.commit(self._bar(mbar, "dq_full"))
        with cute.arch.elect_one():
            tcgen05.commit(self._bar(mbar, "dkv_full"))

    @cute.jit
    def _wait_dq_drained(self, mbar: cute.Pointer, j: Int32):
        """Before Q tile j's first write over dQ^T(j - 1): WG 2 has it in registers (dq_empty)."""
        if j > 0:
            cute.arch.mbarrier_wait(self._bar(mbar, "dq_empty"), (j - 1) % 2)
            tcgen05_fence_after_sync()

    # ------------------------------------------------------------------ dQ warpgroup
    def _window_keeps_from(self, w: int) -> int:
        """The first lane of window w whose head-dim row no earlier window covered."""
        return 0 if w == 0 else self.windows[w - 1] + DQT_WINDOW - self.windows[w]

    @cute.jit
    def dq_drain(self, n_block: Int32, seq: SeqBounds, head_kv: Int32, m_min: Int32, n_m: Int32, n_iter: Int32,
                 group: Int32, mbar: cute.Pointer, tmem_ptr: cute.Pointer, mdQacc: cute.Tensor, mSemaphore: cute.Tensor,
                 mma_dq: cute.TiledMma, sdQ, tma_atom_dQ, tma_dQ):
        """dQ^T of each Q tile: thread r = head-dim column (window start + r) of the 64 query rows ->
        registers, dq_empty, then one red.global.add.f32 per (query, kept window) -- lanes of a warp
        add consecutive columns of one row (coalesced). Rows past the sequence add nothing."""
        seqlen_q, seqlen_k = seq.seqlen_q, seq.seqlen_k
        tidx = cute.arch.thread_idx()[0] % 128
        tm, ch, nw = self.tm, 32, len(self.windows)
        col_base = self._head_part() * self.dk_cols + tidx
        acc = self._tmem_acc(tmem_ptr, mma_dq, (DQT_WINDOW, tm), self.tmem.dq)
        sub, ld, _, thr_ld, _, r_shape, _ = self._row_copies(acc, tidx)
        for it in cutlass.range(n_iter, unroll=1):
            head = head_kv * group + it // n_m
            m_block = m_min + it % n_m
            rows = cutlass.min(seqlen_q - m_block * tm, tm)
            cute.arch.mbarrier_wait(self._bar(mbar, "dq_full"), it % 2)
            tcgen05_fence_after_sync()
            rdq = cute.make_rmem_tensor((nw * tm,), Float32)        # the windows are adjacent columns
            self._tmem_load_row(rdq, lambda c: sub(acc, c * ch, ch), ld, thr_ld, r_shape, nw * tm // ch)
            tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "dq_empty"))
            if const_expr(self.deterministic):
                sem = common.elem_pointer(mSemaphore, (seq.batch, head, m_block))
                common.semaphore_wait_at_least(sem, self.splits * self._dq_rank(n_block, m_block, seqlen_q, seqlen_k),
                                               tidx)
                cute.arch.barrier(barrier_id=BAR_DQ, number_of_threads=128)
            g = mdQacc[seq.bidx, None, head, None]                   # (rows, d) fp32
            row_stride = g.layout.stride[0]
            p0 = common.elem_pointer(g, (self._packed_row(m_block * tm, seq.offset_q), col_base))
            for w in cutlass.range_constexpr(nw):
                if tidx >= self._window_keeps_from(w):
                    # one pointer stepped a row at a time by an opaque stride (a volatile mov, ordered with
                    # the adds): the 64 offsets q * stride, invariant across the walk, were otherwise
                    # hoisted out of it and spilled
                    p = p0 + self.windows[w]
                    for q in cutlass.range_constexpr(tm):
                        if q < rows:
                            common.red_add_f32(p, rdq[w * tm + q])
                        p = p + common.opaque_i32(row_stride)
            if const_expr(self.deterministic):
                cute.arch.barrier(barrier_id=BAR_DQ, number_of_threads=128)
                common.semaphore_signal(sem, tidx)


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------
def make_config(dtype="bf16", head_dim=192, head_dim_v=None, causal=False, deterministic=False, *,
                window_size=(None, None), softcap=0.0, **kw):
    """The wide plan of one build (window_size / softcap checked there, naming the argument)."""
    if head_dim_v is None:
        head_dim_v = 128 if head_dim == 192 else head_dim
    return blackwell_bwd_wide_config(head_dim, head_dim_v, dtype, causal=causal, deterministic=deterministic,
                                     window_size=window_size, softcap=softcap, **kw)


def make_kernel(dtype, head_dim, head_dim_v, causal, deterministic, *, varlen=False, has_seqused_k=False,
                dq_order=None, tiles=None, window=_one.NO_WINDOW, softcap: float = 0.0):
    """host.py's make_kernel interface for the wide head dims (dense or varlen, default or deterministic)."""
    if tiles not in (None, (WIDE_TILE_M, 128)):
        raise ValueError(f"tiles: the wide Blackwell backward uses ({WIDE_TILE_M}, 128), got {tiles!r}")
    return _one.make_dense_kernel(FlashAttentionBackwardSm100Wide, make_config, "wide", dtype, head_dim, head_dim_v,
                                  causal, deterministic, varlen=varlen, has_seqused_k=has_seqused_k,
                                  dq_order=dq_order, tiles=None, supports_varlen=True, window=window,
                                  softcap=softcap)


_CACHE: dict = {}


def compile_config(cfg: BlackwellBwdConfig, dq_order=None, *, varlen: bool = False,
                   has_seqused_k: bool = False) -> compile_cache.Compiled:
    """Compile for sm_100a with fake tensors; the report adds the dQ reduction counts."""
    import re

    def atomics(sass, ptx):
        return {"RED": len(re.findall(r"\bREDG?\b[^\n]*\.ADD", sass)) if sass else None,
                "ptx_red_f32": len(re.findall(r"red\.global\.add\.f32", ptx)),
                "ptx_red_v2": len(re.findall(r"red\.global\.add\.v2\.f32", ptx))}
    return _one.compile_cached(FlashAttentionBackwardSm100Wide, cfg, dq_order, _CACHE, atomics, varlen=varlen,
                               has_seqused_k=has_seqused_k)


def compile_only(dtype="bf16", head_dim=192, head_dim_v=None, causal=False, deterministic=False, *, varlen=False,
                 has_seqused_k=False, window_size=(None, None), softcap=0.0, **kw):
    """Compile the wide backward for sm_100a without a GPU (resource report in .report)."""
    if has_seqused_k and not varlen:
        raise ValueError("seqused_k: only with varlen (cu_seqlens_q / cu_seqlens_k)")
    cfg = make_config(dtype, head_dim, head_dim_v, causal, deterministic, window_size=window_size, softcap=softcap,
                      **kw)
    return compile_config(cfg, varlen=varlen, has_seqused_k=has_seqused_k)


if __name__ == "__main__":
    for d, dv in ((192, 128), (256, 256)):
        for causal in (False, True):
            for det in (False, True):
                rep = compile_only("bf16", d, dv, causal=causal, deterministic=det).report
                print(_one.format_report(f"{STEP} d={d}/{dv} causal={causal} det={det}", rep))
