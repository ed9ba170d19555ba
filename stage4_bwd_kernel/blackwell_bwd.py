"""Stage 4, Blackwell (sm_100a): the 1-CTA FA4 backward -- five tcgen05 MMAs, TMEM accumulators,
dQ by atomics (or, deterministic, by semaphore-ordered atomics; or, ``dq_tma``, staged in SMEM and
added by TMA reduce-add). COMPILED AND INSPECTED ONLY: no
Blackwell GPU is reachable from this project; this kernel has never run (see the Blackwell section of README.md).

One CTA = one K/V tile (128 keys) of one KV head; it walks every (query head of the GQA group,
Q tile) that sees the tile. Warps (blackwell_config.py has the TMEM / SMEM plan):

* WG 0, elementwise (128 threads, thread r = key r = TMEM lane r): S^T row -> registers,
  P = exp2(S * scale_log2 - lse2) (masked -> 0), P^T (16-bit) -> TMEM over S^T; then dP^T in
  32-column chunks, dS = P (dP - D), dS^T (16-bit) -> TMEM over dP^T and dS -> SMEM (column r of
  the dQ MMA's A).
  At the end: dV and scale * dK from TMEM -> global memory.
* warp 4, MMA (one elected thread): S^T = K Q^T, dP^T = V dO^T (SS); dV += P^T dO,
  dK += dS^T Q (TS: A from TMEM); dQ = dS K (SS) into the columns of dP^T. Issue order per
  Q tile j (the paper's 1-CTA pipeline): S(j), dK(j-1), dQ(j-1), dP(j), dV(j) -- the exp of
  P(j) overlaps the previous tile's dK and dQ MMAs.
* warp 5, load: TMA K, V once; Q, dO into a 2-stage ring. lse2 / D are read by WG 0 itself.
* WG 2, dQ drain (thread r = query r): the dQ row from TMEM into registers, dq_empty (the MMA warp
  may write dP^T over it), then red.global.add.v2.f32 into the fp32 dQ accumulator; deterministic:
  the stage-4 semaphore protocol (schedule.py ranks and orders, common.semaphore_wait /
  semaphore_signal) around each tile's adds, after dq_empty so a stall does not hold the MMAs.
  dq_tma (the paper's way; opt-in, dense non-deterministic builds): the row goes to sdQ in 32-column
  chunks (2 buffers of 128 x 32 fp32, 128B swizzle), fence.proxy.async.shared::cta, named barrier 3
  (WG 2), and warp 0 issues one cp.reduce.async.bulk.tensor .add per chunk (SASS UTMAREDG), a bulk
  group each; before that barrier it waits (wait_group.read 0) until the previous chunk's reduce has
  read the buffer the next chunk overwrites. At d = 128 the staging fits only if dO gets a 1-stage
  ring of its own (do_full / do_empty below; blackwell_config.py has the arithmetic).

Barriers (mbarriers; "count" = arrivals per phase):
    kv_full         TMA -> MMA                          1 (+ K and V bytes)
    qdo_full[s]     TMA -> MMA                          1 (+ Q and dO bytes)
    qdo_empty[s]    MMA commit -> TMA                   1
    s_full, dp_full MMA commit -> WG 0                  1
    p_full, ds_full WG 0 -> MMA                         128
    dq_full         MMA commit -> WG 2 (and WG 0: sdS is free again)   1
    dq_empty        WG 2 -> MMA (dQ is in registers: dP^T may overwrite it)   128
    dkv_full        MMA commit after the last dK -> WG 0               1
    tmem_dealloc    WG 0 + WG 2 -> MMA warp                            256
    do_full[s]      TMA -> MMA (dq_tma at d = 128: dO's own ring)       1 (+ dO bytes; qdo_full then has Q's)
    do_empty[s]     MMA commit after dV -> TMA                          1

Varlen (``varlen=True``; the Hopper backward's conventions, compiled and checked structurally, never run):
packed (1, T, H, D) tensors as a batch of one, blockIdx.z = sequence. Every role locates its K/V tile
in its sequence with the Hopper walk's ``tile_bounds`` / ``make_walk`` (cu_seqlens, optional
seqused_k), so a tile past the sequence's keys walks no Q tile (n_iter = 0: every role still runs its
barrier-free empty path, as a dense causal tile above the diagonal does). TMA boxes start at the
sequence's first row (``cute.domain_offset``); the rows a partial tile reads past the end (the next
sequence's, or TMA's zero fill) are masked: keys by the key limit, queries by lse2 = +inf (P = 0).
lse2 / D are read at ``common.stats_offset(cu_seqlens_q[b], b) + row`` (the preprocess's varlen rows),
dQ is added at packed row offset_q + row for rows < seqlen_q only, dK / dV are stored at offset_k + key
for keys < the sequence's key rows only, and the deterministic semaphores are (sequence, head, Q tile).

Window and softcap (``window_size=``, ``softcap=``; compiled and checked structurally, never run): the
walk is schedule.py's band (``_m_range``; varlen ``WalkPlan.make_walk``) with the real window, the
deterministic ranks schedule.py's (``_dq_rank``), the masks and softcap's tanh / derivative in WG 0
(blackwell_elementwise.py); the 2-CTA kernel refuses both.

Head dims (192, 128) and 256 do not fit this kernel's TMEM plan: the wide kernel (blackwell_bwd_wide.py,
a subclass) serves them, and stage4_bwd_kernel.blackwell (what fa4 imports) routes them there. The 2-CTA kernel (blackwell_bwd_2cta.py)
subclasses this one and reuses its elementwise helpers (_row_copies, _p_phase, _stage_stats, _exp_row,
_store16, _store_dkdv, in blackwell_elementwise.py) and gemm.
"""
from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator
from cutlass.pipeline import NamedBarrier
from cutlass.tensor_utils import LayoutEnum

from stage3_fwd_kernel import blackwell_fwd as _fwd  # compile_sm100, blackwell_gpu_available
from stage3_fwd_kernel import compile_cache
from stage3_fwd_kernel.blackwell_sync import tcgen05_fence_after_sync, tcgen05_fence_before_sync
from stage3_fwd_kernel.components.score_mod import Softcap
from stage3_fwd_kernel.components.window import NO_WINDOW, Window
from stage4_bwd_kernel import common, schedule
from stage4_bwd_kernel.blackwell_config import DQ_STAGE_BUFS, DQ_STAGE_COLS, BlackwellBwdConfig, blackwell_bwd_config
from stage4_bwd_kernel.blackwell_dq import DqDrainRole
from stage4_bwd_kernel.blackwell_elementwise import ElementwiseRoles
from stage4_bwd_kernel.hopper.walk import SeqBounds, WalkPlan

STEP = "blackwell_bwd"
BAR_TMEM_ALLOC = 1   # MMA warp + WG 0 + WG 2
# id 2 is BAR_STATS (WG 0: sLSE / sD written / consumed), in blackwell_elementwise.py
# id 3 is BAR_DQ (WG 2: deterministic hand-over, the dQ reduce's chunks), in blackwell_dq.py
MMA_WARP, LOAD_WARP = 4, 5
BARRIERS = ("kv_full", "s_full", "dp_full", "p_full", "ds_full", "dq_full", "dq_empty", "dkv_full", "tmem_dealloc")


class FlashAttentionBackwardSm100(ElementwiseRoles, DqDrainRole, WalkPlan):
    """The 1-CTA FA4 backward for one BlackwellBwdConfig; the elementwise warpgroup (WG 0) is in
    ``blackwell_elementwise.ElementwiseRoles``, the dQ warpgroup (WG 2) in ``blackwell_dq.DqDrainRole``,
    the varlen sequence bounds in the Hopper walk's ``WalkPlan`` (tile_bounds, make_walk)."""

    gpu_arch = _fwd.TARGET_ARCH  # compile_cache compiles launchable builds for it whatever the process targets

    def __init__(self, config: BlackwellBwdConfig, dq_order=None, *, varlen: bool = False,
                 has_seqused_k: bool = False):
        self.cfg = config
        self.dtype = common.cutlass_dtype(config.dtype)
        self.d, self.dv = config.head_dim, config.head_dim_v
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.tm, self.tn = config.tile_m, config.tile_n
        self.causal, self.deterministic = config.causal, config.deterministic
        self.stages = config.qdo_stages
        # dO's ring: the Q ring's stages and barriers, or (dq_tma at d = 128) fewer stages of its own
        self.do_stages = getattr(config.smem, "dO_stages", self.stages)  # the 2-CTA plan: one ring
        self.split_do = self.do_stages != self.stages
        self.dq_tma = config.dq_tma
        self.tmem = config.tmem
        # the dK / dV (and dQ) columns this CTA owns: all of them here; the wide kernel's head-dim split halves them
        self.dk_cols, self.dv_cols = self.d, self.dv
        self.num_threads = config.num_threads
        self.dq_order = dq_order or common.default_dq_order(config.causal, config.deterministic, sections=False)
        if has_seqused_k and not varlen:
            raise ValueError("seqused_k: only with varlen (cu_seqlens_q / cu_seqlens_k)")
        self.varlen, self.has_seqused_k = bool(varlen), bool(has_seqused_k)
        if self.dq_tma and self.varlen:
            # a TMA box clips at the packed tensor's end, not at the sequence's: its last tile's rows
            # past seqlen_q would add into the next sequence's dQ
            raise ValueError("dq_tma: varlen keeps the per-row atomics (build the plan with dq_tma=False)")
        # the keys a row sees (components.window: causal is a right edge at 0) and the score transform
        # (components.score_mod), as the Hopper backward holds them: None / off when plain, so plain
        # builds trace as before; WalkPlan.make_walk and schedule.py read window_or_none
        w = config.window
        self.window = Window(w.left, 0 if self.causal else w.right)
        self.banded = w.left is not None or (w.right is not None and not self.causal)
        self.window_or_none = self.window if self.banded else None
        self.score_mod = Softcap(config.softcap)
        self.smem_bytes = None

    # ------------------------------------------------------------------ host side
    def mmas_and_smem_layouts(self):
        """The five tiled MMAs and the SMEM layouts of the operands, at trace time: (mmas, {name:
        layout}). The transposed views (sQt, sdOt, sKt) read the bytes of sQ, sdO, sK as the other
        major mode; ``transposed_view_mismatches`` checks that element by element."""
        MN_ = cute.nvgpu.OperandMajorMode.MN
        dt, d, dv, tm, tn = self.dtype, self.d, self.dv, self.tm, self.tn
        mma_s, mma_dp, mma_dv, mma_dk = self.tile_mmas()
        mma_dq = sm100_utils.make_trivial_tiled_mma(dt, dt, MN_, MN_, Float32, tcgen05.CtaGroup.ONE, (tm, d))
        tiler_s, tiler_dp = (tn, tm, d), (tn, tm, dv)
        tiler_dv, tiler_dk, tiler_dq = (tn, dv, tm), (tn, d, tm), (tm, d, tn)

        st, st_do = self.stages, self.do_stages
        sK_layout = sm100_utils.make_smem_layout_a(mma_s, tiler_s, dt, 1)
        sV_layout = sm100_utils.make_smem_layout_a(mma_dp, tiler_dp, dt, 1)
        sQ_layout = sm100_utils.make_smem_layout_b(mma_s, tiler_s, dt, st)
        sdO_layout = sm100_utils.make_smem_layout_b(mma_dp, tiler_dp, dt, st_do)
        # the same bytes read transposed: every element at the same byte in both major modes, at
        # d = 64 / 96 / 128 (blackwell_layout_check.py checks it element by element)
        sQt_layout = sm100_utils.make_smem_layout_b(mma_dk, tiler_dk, dt, st)
        sdOt_layout = sm100_utils.make_smem_layout_b(mma_dv, tiler_dv, dt, st_do)
        sKt_layout = sm100_utils.make_smem_layout_b(mma_dq, tiler_dq, dt, 1)
        sdS_layout = sm100_utils.make_smem_layout_a(mma_dq, tiler_dq, dt, 1)
        tP_layout = sm100_utils.make_smem_layout_a(mma_dv, tiler_dv, dt, 1)
        tdS_layout = sm100_utils.make_smem_layout_a(mma_dk, tiler_dk, dt, 1)
        for a, b in ((sQ_layout, sQt_layout), (sdO_layout, sdOt_layout), (sK_layout, sKt_layout)):
            if const_expr(cute.cosize(a) != cute.cosize(b)):
                raise ValueError("transposed SMEM views must cover the same bytes")

        layouts = dict(sK=sK_layout, sV=sV_layout, sQ=sQ_layout, sdO=sdO_layout, sQt=sQt_layout, sdOt=sdOt_layout,
                       sKt=sKt_layout, sdS=sdS_layout, tP=tP_layout, tdS=tdS_layout)
        if const_expr(self.dq_tma):
            layouts["sdQ"] = self.dq_smem_layout()
        return (mma_s, mma_dp, mma_dv, mma_dk, mma_dq), layouts

    def tile_mmas(self):
        """S^T = K Q^T, dP^T = V dO^T (SS, tn x tm) and dV, dK (TS: A from TMEM) over this CTA's
        dv_cols / dk_cols head-dim columns."""
        K_, MN_ = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        one, tmem_a = tcgen05.CtaGroup.ONE, tcgen05.OperandSource.TMEM
        dt, tm, tn = self.dtype, self.tm, self.tn
        mma_s = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, K_, Float32, one, (tn, tm))
        mma_dp = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, K_, Float32, one, (tn, tm))
        mma_dv = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, MN_, Float32, one, (tn, self.dv_cols), tmem_a)
        mma_dk = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, MN_, Float32, one, (tn, self.dk_cols), tmem_a)
        return mma_s, mma_dp, mma_dv, mma_dk

    def dq_smem_layout(self):
        """sdQ: (tm, 32, buffers) fp32, row-major with the 128B swizzle (a row of a chunk is one
        128-byte swizzle row, so thread r's 16-byte stores of row r hit distinct banks within a phase of
        8 threads)."""
        return sm100_utils.make_smem_layout_epi(Float32, LayoutEnum.ROW_MAJOR, (self.tm, DQ_STAGE_COLS),
                                                DQ_STAGE_BUFS)

    def dq_tma_atom(self, mdQacc, sdQ_layout):
        """(TMA reduce-add atom, TMA coordinate tensor) over dQaccum viewed (Sq, d, Hq, B): one
        (tm, 32) box per chunk; rows past Sq are clipped by the tensor map."""
        t = cute.make_tensor(mdQacc.iterator, cute.select(mdQacc.layout, mode=[1, 3, 2, 0]))
        return cpasync.make_tiled_tma_atom(cpasync.CopyReduceBulkTensorTileS2GOp(), t,
                                           cute.select(sdQ_layout, mode=[0, 1]), (self.tm, DQ_STAGE_COLS))

    def aligned(self, mQ, mK, mV, mdO, mdQacc, mdK, mdV) -> tuple:
        """The global tensors with their rows promised 16-byte aligned (the host checks it): q, k,
        dQaccum, dk by d, v, dout, dv by dv."""
        d, dv = self.d, self.dv
        return (common.assume_aligned(mQ, d), common.assume_aligned(mK, d), common.assume_aligned(mV, dv),
                common.assume_aligned(mdO, dv), common.assume_aligned(mdQacc, d), common.assume_aligned(mdK, d),
                common.assume_aligned(mdV, dv))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor,
                 mSemaphore: cute.Tensor, num_n_blocks: Int32, softmax_scale_log2: Float32,
                 softmax_scale: Float32, stream):
        """Dense: q/k/v/dout (B, S, H, D); lse2, D (B, Hq, Sq) fp32; dQaccum (B, Sq, Hq, d) fp32;
        semaphores (B, Hq, m_blocks) int32 (deterministic); cu_seqlens / seqused_k are ignored.
        Varlen (host.main_args): the packed tensors as a batch of one, (1, T, H, D); lse2, D
        (1, Hq, rows) in the preprocess's varlen rows; dQaccum (1, Tq, Hq, d); cu_seqlens_q / _k
        (batch + 1,) int32, seqused_k (batch,) when built with it; semaphores (batch, Hq, m_blocks)."""
        d, dv, tm, tn = self.d, self.dv, self.tm, self.tn
        mQ, mK, mV, mdO, mdQacc, mdK, mdV = self.aligned(mQ, mK, mV, mdO, mdQacc, mdK, mdV)
        # (seq, dim, head, batch) views for TMA
        modes = [1, 3, 2, 0]
        tQ, tK, tV, tdO = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes)) for t in (mQ, mK, mV, mdO)]

        one = tcgen05.CtaGroup.ONE
        dt = self.dtype
        (mma_s, mma_dp, mma_dv, mma_dk, mma_dq), L = self.mmas_and_smem_layouts()
        sK_layout, sV_layout, sQ_layout, sdO_layout = L["sK"], L["sV"], L["sQ"], L["sdO"]
        sQt_layout, sdOt_layout, sKt_layout = L["sQt"], L["sdOt"], L["sKt"]
        sdS_layout, tP_layout, tdS_layout = L["sdS"], L["tP"], L["tdS"]
        tiler_s, tiler_dp = (tn, tm, d), (tn, tm, dv)

        cluster = cute.tiled_divide(cute.make_layout((1, 1, 1)), (mma_s.thr_id.shape,)).shape
        g2s = cpasync.CopyBulkTensorTileG2SOp(one)
        sel = lambda L: cute.select(L, mode=[0, 1, 2])  # noqa: E731
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_A(g2s, tK, sel(sK_layout), tiler_s, mma_s, cluster)
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_A(g2s, tV, sel(sV_layout), tiler_dp, mma_dp, cluster)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_B(g2s, tQ, sel(sQ_layout), tiler_s, mma_s, cluster)
        tma_atom_dO, tma_dO = cute.nvgpu.make_tiled_tma_atom_B(g2s, tdO, sel(sdO_layout), tiler_dp, mma_dp, cluster)
        self.bytes_kv = cute.size_in_bytes(dt, sel(sK_layout)) + cute.size_in_bytes(dt, sel(sV_layout))
        self.bytes_q, self.bytes_do = cute.size_in_bytes(dt, sel(sQ_layout)), cute.size_in_bytes(dt, sel(sdO_layout))
        self.bytes_qdo = self.bytes_q + self.bytes_do
        sdQ_layout = L.get("sdQ")  # None: dQ leaves by atomics
        tma_atom_dQ, tma_dQ = None, None
        if const_expr(self.dq_tma):
            tma_atom_dQ, tma_dQ = self.dq_tma_atom(mdQacc, sdQ_layout)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.cfg.smem.num_barriers]
            tmem_addr: Int32
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdS_layout)], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, tm], 16]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, tm], 16]
            if const_expr(self.dq_tma):  # the dQ staging buffers (atomic builds keep their layout)
                sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        # varlen: one grid z per sequence; the kernel takes the index tensors (dense: None, no parameter)
        seq_args = (None, None, None)
        if const_expr(self.varlen):
            seq_args = (mCuSeqlensQ, mCuSeqlensK, mSeqUsedK if const_expr(self.has_seqused_k) else None)
        grid = self._grid(num_n_blocks, mK, mCuSeqlensQ)
        self.kernel(tma_K, tma_V, tma_Q, tma_dO, tma_atom_K, tma_atom_V, tma_atom_Q, tma_atom_dO,
                    mLSE2, mD, mdQacc, mdK, mdV, mSemaphore, num_n_blocks, mQ.shape[1], mK.shape[1],
                    mQ.shape[2] // mK.shape[2], softmax_scale_log2, softmax_scale,
                    mma_s, mma_dp, mma_dv, mma_dk, mma_dq,
                    sK_layout, sV_layout, sQ_layout, sdO_layout, sQt_layout, sdOt_layout, sKt_layout,
                    sdS_layout, tP_layout, tdS_layout, *seq_args, sdQ_layout, tma_atom_dQ, tma_dQ,
                    ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def _grid(self, num_n_blocks, mK, mCuSeqlensQ) -> tuple:
        """(K/V tiles, KV heads, batch or sequences): one CTA per K/V tile of a head."""
        if const_expr(self.varlen):
            return (num_n_blocks, mK.shape[2], mCuSeqlensQ.shape[0] - 1)
        return (num_n_blocks, mK.shape[2], mK.shape[0])

    # ------------------------------------------------------------------ device side
    def _bar(self, mbar, name, i=0):
        if name == "qdo_full":
            return mbar + len(BARRIERS) + i
        if name == "qdo_empty":
            return mbar + len(BARRIERS) + self.stages + i
        if name == "do_full":    # only when dO has its own ring (split_do)
            return mbar + len(BARRIERS) + 2 * self.stages + i
        if name == "do_empty":
            return mbar + len(BARRIERS) + 2 * self.stages + self.do_stages + i
        return mbar + BARRIERS.index(name)

    def _set_registers(self, count: int):
        """setmaxnreg for a warpgroup: an increase above the launch's per-thread cap, else a decrease."""
        if count > self.cfg.regs.launch_cap:
            cute.arch.setmaxregister_increase(count)
        else:
            cute.arch.setmaxregister_decrease(count)

    @cute.kernel
    def kernel(self, tma_K: cute.Tensor, tma_V: cute.Tensor, tma_Q: cute.Tensor, tma_dO: cute.Tensor,
               tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom, tma_atom_Q: cute.CopyAtom,
               tma_atom_dO: cute.CopyAtom, mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mSemaphore: cute.Tensor, num_n_blocks: Int32,
               seqlen_q: Int32, seqlen_k: Int32, qhead_per_kvhead: Int32, softmax_scale_log2: Float32,
               softmax_scale: Float32, mma_s: cute.TiledMma, mma_dp: cute.TiledMma, mma_dv: cute.TiledMma,
               mma_dk: cute.TiledMma, mma_dq: cute.TiledMma,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, sQ_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout, sQt_layout: cute.ComposedLayout, sdOt_layout: cute.ComposedLayout,
               sKt_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
               tdS_layout: cute.ComposedLayout, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
               mSeqUsedK: cute.Tensor | None, sdQ_layout: cute.ComposedLayout | None,
               tma_atom_dQ: cute.CopyAtom | None, tma_dQ: cute.Tensor | None):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(warp_idx // 4)
        storage = SmemAllocator().allocate(self.shared_storage)
        mbar = storage.mbar.data_ptr()
        if warp_idx == LOAD_WARP:
            for atom in (tma_atom_K, tma_atom_V, tma_atom_Q, tma_atom_dO):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.dq_tma):
                cpasync.prefetch_descriptor(tma_atom_dQ)
        if warp_idx == 0:
            with cute.arch.elect_one():
                for name, count in (("kv_full", 1), ("s_full", 1), ("dp_full", 1), ("p_full", 128),
                                    ("ds_full", 128), ("dq_full", 1), ("dq_empty", 128), ("dkv_full", 1),
                                    ("tmem_dealloc", 256)):
                    cute.arch.mbarrier_init(self._bar(mbar, name), count)
                for s in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(self._bar(mbar, "qdo_full", s), 1)
                    cute.arch.mbarrier_init(self._bar(mbar, "qdo_empty", s), 1)
                if const_expr(self.split_do):
                    for s in cutlass.range_constexpr(self.do_stages):
                        cute.arch.mbarrier_init(self._bar(mbar, "do_full", s), 1)
                        cute.arch.mbarrier_init(self._bar(mbar, "do_empty", s), 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        view = lambda t, L: cute.make_tensor(cute.recast_ptr(t.iterator, L.inner), L.outer)  # noqa: E731
        sQt, sdOt, sKt = view(sQ, sQt_layout), view(sdO, sdOt_layout), view(sK, sKt_layout)
        sLSE = storage.sLSE.get_tensor(cute.make_layout(self.tm))
        sD = storage.sD.get_tensor(cute.make_layout(self.tm))
        sdQ = None
        if const_expr(self.dq_tma):
            sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)  # (tm, 32, buffers) fp32

        tmem = TmemAllocator(storage.tmem_addr.ptr, allocator_warp_id=MMA_WARP,
                             barrier_for_retrieve=NamedBarrier(barrier_id=BAR_TMEM_ALLOC, num_threads=32 * 9),
                             arch="sm_100")

        if wg_idx == 1:
            cute.arch.setmaxregister_decrease(self.cfg.regs.other)
            n_block, head_kv, batch, m_min, n_m, n_iter, seq = self._work(num_n_blocks, seqlen_q, seqlen_k,
                                                                       qhead_per_kvhead, mCuSeqlensQ,
                                                                       mCuSeqlensK, mSeqUsedK)
            if warp_idx == LOAD_WARP:
                self.load(n_block, head_kv, batch, m_min, n_m, n_iter, qhead_per_kvhead, mbar,
                          tma_K, tma_V, tma_Q, tma_dO, tma_atom_K, tma_atom_V, tma_atom_Q, tma_atom_dO,
                          sK, sV, sQ, sdO, mma_s, mma_dp, seq)
            if warp_idx == MMA_WARP:
                tmem.allocate(self.tmem.alloc)
                tmem.relinquish_alloc_permit()
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                self.mma(n_iter, mbar, tmem_ptr, sK, sV, sQ, sdO, sQt, sdOt, sKt, sdS, tP_layout, tdS_layout,
                         mma_s, mma_dp, mma_dv, mma_dk, mma_dq)
                cute.arch.mbarrier_wait(self._bar(mbar, "tmem_dealloc"), 0)
                tcgen05_fence_after_sync()
                tmem.free(tmem_ptr)
        elif wg_idx == 2:
            self._set_registers(self.cfg.regs.dq)
            n_block, head_kv, batch, m_min, n_m, n_iter, seq = self._work(num_n_blocks, seqlen_q, seqlen_k,
                                                                       qhead_per_kvhead, mCuSeqlensQ,
                                                                       mCuSeqlensK, mSeqUsedK)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.dq_drain(n_block, seq, head_kv, m_min, n_m, n_iter, qhead_per_kvhead, mbar, tmem_ptr, mdQacc,
                          mSemaphore, mma_dq, sdQ, tma_atom_dQ, tma_dQ)
            tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "tmem_dealloc"))
        else:
            self._set_registers(self.cfg.regs.elementwise)
            n_block, head_kv, batch, m_min, n_m, n_iter, seq = self._work(num_n_blocks, seqlen_q, seqlen_k,
                                                                       qhead_per_kvhead, mCuSeqlensQ,
                                                                       mCuSeqlensK, mSeqUsedK)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.elementwise(n_block, seq, head_kv, m_min, n_m, n_iter, qhead_per_kvhead,
                             softmax_scale_log2, softmax_scale, mbar, tmem_ptr, sdS, sLSE, sD, mLSE2, mD, mdK, mdV,
                             mma_s)
            tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "tmem_dealloc"))

    @cute.jit
    def _work(self, num_n_blocks: Int32, seqlen_q: Int32, seqlen_k: Int32, qhead_per_kvhead: Int32,
              mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None, mSeqUsedK: cute.Tensor | None):
        """This CTA's K/V tile (the dQ order maps the launch index to n_block), the Q tiles that see it
        and its sequence (a hopper.walk.SeqBounds: tensor batch index, packed offsets, lengths). Every
        role computes it after its setmaxnreg: a value live across setmaxnreg is spilled.
        Varlen: the Hopper walk's bounds (a tile past the sequence's keys walks nothing); the batch
        returned is the tensors' (0), seq.batch the sequence."""
        if const_expr(self.varlen):
            seq = self.tile_bounds(num_n_blocks, seqlen_q, seqlen_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
            walk = self.make_walk(seq, qhead_per_kvhead)
            n_block, head_kv, batch, m_min = seq.n_block, seq.head_kv, seq.bidx, walk.m_block_min
            n_m = cutlass.max(walk.m_block_max - m_min, 0)
        else:
            bx, head_kv, batch = cute.arch.block_idx()
            n_block = self.dq_order.n_block_for_launch(bx, num_n_blocks)
            m_min, m_max = self._m_range(n_block, seqlen_q, seqlen_k)
            n_m = cutlass.max(m_max - m_min, 0)
            # dense: one batch index, rows from 0, every key row in use (no value is computed here)
            seq = SeqBounds(n_block, head_kv, batch, batch, 0, 0, seqlen_q, seqlen_k, seqlen_k)
        return n_block, head_kv, batch, m_min, n_m, n_m * qhead_per_kvhead, seq

    def _m_range(self, n_block, seqlen_q, seqlen_k):
        """The dense walk's Q tiles [m_min, m_max) of K/V tile n_block: schedule.py's band (a window
        bounds both ends; causal only the start). Plain Python: tests evaluate it on ints."""
        return schedule.m_block_range(n_block, self.tm, self.tn, seqlen_q, seqlen_k, self.causal, imax=cutlass.max,
                                      window=self.window_or_none, imin=cutlass.min)

    def _seq_rows(self, t, offset):
        """A (rows, cols) view of one head from the sequence's first row on: varlen shifts the packed
        tensor by the sequence's offset (TMA boxes then start there), dense returns it as it is."""
        if self.varlen:
            return cute.domain_offset((offset, 0), t)
        return t

    # ------------------------------------------------------------------ load warp
    @cute.jit
    def load(self, n_block: Int32, head_kv: Int32, batch: Int32, m_min: Int32, n_m: Int32, n_iter: Int32,
             group: Int32, mbar: cute.Pointer, tma_K: cute.Tensor, tma_V: cute.Tensor, tma_Q: cute.Tensor,
             tma_dO: cute.Tensor, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom, tma_atom_Q: cute.CopyAtom,
             tma_atom_dO: cute.CopyAtom, sK: cute.Tensor, sV: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor,
             mma_s: cute.TiledMma, mma_dp: cute.TiledMma, seq: SeqBounds):
        thr_s, thr_dp = mma_s.get_slice(0), mma_dp.get_slice(0)
        gK = cute.local_tile(self._seq_rows(tma_K[None, None, head_kv, batch], seq.offset_k), (self.tn, self.d),
                             (None, 0))
        gV = cute.local_tile(self._seq_rows(tma_V[None, None, head_kv, batch], seq.offset_k), (self.tn, self.dv),
                             (None, 0))
        one = cute.make_layout(1)
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, one, cute.group_modes(sK, 0, 3),
                                           cute.group_modes(thr_s.partition_A(gK), 0, 3))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, one, cute.group_modes(sV, 0, 3),
                                           cute.group_modes(thr_dp.partition_A(gV), 0, 3))
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(self._bar(mbar, "kv_full"), self.bytes_kv)
        cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, 0], tma_bar_ptr=self._bar(mbar, "kv_full"))
        cute.copy(tma_atom_V, tVgV[None, n_block], tVsV[None, 0], tma_bar_ptr=self._bar(mbar, "kv_full"))
        for it in cutlass.range(n_iter, unroll=1):
            head = head_kv * group + it // n_m
            m_block = m_min + it % n_m
            slot, phase = it % self.stages, (it // self.stages) % 2
            gQ = cute.local_tile(self._seq_rows(tma_Q[None, None, head, batch], seq.offset_q), (self.tm, self.d),
                                 (None, 0))
            gdO = cute.local_tile(self._seq_rows(tma_dO[None, None, head, batch], seq.offset_q), (self.tm, self.dv),
                                  (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 3),
                                               cute.group_modes(thr_s.partition_B(gQ), 0, 3))
            tOsO, tOgO = cpasync.tma_partition(tma_atom_dO, 0, one, cute.group_modes(sdO, 0, 3),
                                               cute.group_modes(thr_dp.partition_B(gdO), 0, 3))
            cute.arch.mbarrier_wait(self._bar(mbar, "qdo_empty", slot), phase ^ 1)
            if const_expr(not self.split_do):
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(self._bar(mbar, "qdo_full", slot), self.bytes_qdo)
                cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, slot],
                          tma_bar_ptr=self._bar(mbar, "qdo_full", slot))
                cute.copy(tma_atom_dO, tOgO[None, m_block], tOsO[None, slot],
                          tma_bar_ptr=self._bar(mbar, "qdo_full", slot))
            else:
                # dO has its own (shorter) ring: Q(it) on qdo_full, then dO(it) on do_full
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(self._bar(mbar, "qdo_full", slot), self.bytes_q)
                cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, slot],
                          tma_bar_ptr=self._bar(mbar, "qdo_full", slot))
                oslot, ophase = it % self.do_stages, (it // self.do_stages) % 2
                cute.arch.mbarrier_wait(self._bar(mbar, "do_empty", oslot), ophase ^ 1)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(self._bar(mbar, "do_full", oslot), self.bytes_do)
                cute.copy(tma_atom_dO, tOgO[None, m_block], tOsO[None, oslot],
                          tma_bar_ptr=self._bar(mbar, "do_full", oslot))

    # ------------------------------------------------------------------ MMA warp
    def _tmem_acc(self, tmem_ptr, mma, shape, col):
        thr = mma.get_slice(0)
        return cute.make_tensor(tmem_ptr + col, thr.make_fragment_C(thr.partition_shape_C(shape)).layout)

    def _tmem_a(self, tmem_ptr, mma, layout, col):
        """A 16-bit TS operand in TMEM at column `col` (re-anchored fragment, as in the forward)."""
        thr = mma.get_slice(0)
        lay = thr.make_fragment_A(cute.make_tensor(tmem_ptr, layout.outer))[None, None, None, 0].layout
        return cute.make_tensor(cute.recast_ptr(tmem_ptr + col, dtype=self.dtype), lay)

    @cute.jit
    def gemm(self, mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor, accumulate):
        """acc (+)= A B over the K-blocks; a fresh MMA object so the ACCUMULATE field stays local."""
        tiled = cute.make_tiled_mma(cute.make_mma_atom(mma.op))
        for k in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            if const_expr(k == 0):
                tiled.set(tcgen05.Field.ACCUMULATE, accumulate)
            else:
                tiled.set(tcgen05.Field.ACCUMULATE, True)
            cute.gemm(tiled, acc, tA[None, None, k], tB[None, None, k], acc)

    @cute.jit
    def mma(self, n_iter: Int32, mbar: cute.Pointer, tmem_ptr: cute.Pointer, sK: cute.Tensor, sV: cute.Tensor,
            sQ: cute.Tensor, sdO: cute.Tensor, sQt: cute.Tensor, sdOt: cute.Tensor, sKt: cute.Tensor,
            sdS: cute.Tensor, tP_layout: cute.ComposedLayout, tdS_layout: cute.ComposedLayout,
            mma_s: cute.TiledMma, mma_dp: cute.TiledMma, mma_dv: cute.TiledMma, mma_dk: cute.TiledMma,
            mma_dq: cute.TiledMma):
        tm, tn, T = self.tm, self.tn, self.tmem
        s_, dp_, dv_, dk_, dq_ = (m.get_slice(0) for m in (mma_s, mma_dp, mma_dv, mma_dk, mma_dq))
        tK, tQ = s_.make_fragment_A(sK), s_.make_fragment_B(sQ)
        tV, tdO = dp_.make_fragment_A(sV), dp_.make_fragment_B(sdO)
        tdOt, tQt = dv_.make_fragment_B(sdOt), dk_.make_fragment_B(sQt)
        tdS, tKt = dq_.make_fragment_A(sdS), dq_.make_fragment_B(sKt)
        accS = self._tmem_acc(tmem_ptr, mma_s, (tn, tm), T.s)
        accdP = self._tmem_acc(tmem_ptr, mma_dp, (tn, tm), T.dp)
        accdV = self._tmem_acc(tmem_ptr, mma_dv, (tn, self.dv), T.dv)
        accdK = self._tmem_acc(tmem_ptr, mma_dk, (tn, self.d), T.dk)
        accdQ = self._tmem_acc(tmem_ptr, mma_dq, (tm, self.d), T.dq)
        tP = self._tmem_a(tmem_ptr, mma_dv, tP_layout, T.p)
        tdSt = self._tmem_a(tmem_ptr, mma_dk, tdS_layout, T.ds)

        # The paper's 1-CTA pipeline: iteration j issues S(j), then the previous tile's dK(j-1) and
        # dQ(j-1), then dP(j) and dV(j). The elementwise warpgroup computes P(j) = exp2(...) from S(j)
        # while the tensor cores run dK(j-1) and dQ(j-1), instead of idling between dS(j-1) and S(j).
        # One loop of n_iter + 1 turns with uniform branches keeps each MMA in the code once.
        # TMEM reuse relies on MMAs issued by this thread executing in issue order: S(j) overwrites
        # the P^T(j-1) that dV(j-1) reads, dQ(j-1) overwrites the dS^T(j-1) that dK(j-1) reads.
        cute.arch.mbarrier_wait(self._bar(mbar, "kv_full"), 0)
        for j in cutlass.range(n_iter + 1, unroll=1):
            slot, phase = j % self.stages, (j // self.stages) % 2
            prev_slot = (j + self.stages - 1) % self.stages
            if j < n_iter:
                # S^T(j) = K Q(j)^T  over the S/P region (P^T(j-1) was consumed by dV(j-1), issued before)
                cute.arch.mbarrier_wait(self._bar(mbar, "qdo_full", slot), phase)
                self.gemm(mma_s, accS, tK[None, None, None, 0], tQ[None, None, None, slot], False)
                with cute.arch.elect_one():
                    tcgen05.commit(self._bar(mbar, "s_full"))
            if j > 0:
                # dK += dS^T(j-1) Q(j-1)  (TS, dS^T over dP^T), then dQ(j-1) = dS K  (SS) over both
                cute.arch.mbarrier_wait(self._bar(mbar, "ds_full"), (j - 1) % 2)
                tcgen05_fence_after_sync()
                self.gemm(mma_dk, accdK, tdSt, tQt[None, None, None, prev_slot], j > 1)
                self.gemm(mma_dq, accdQ, tdS[None, None, None, 0], tKt[None, None, None, 0], False)
                with cute.arch.elect_one():
                    tcgen05.commit(self._bar(mbar, "dq_full"))
                    tcgen05.commit(self._bar(mbar, "qdo_empty", prev_slot))
            if j < n_iter:
                # dP^T(j) = V dO(j)^T, over dQ(j-1): wait until WG 2 has drained it
                if j > 0:
                    cute.arch.mbarrier_wait(self._bar(mbar, "dq_empty"), (j - 1) % 2)
                    tcgen05_fence_after_sync()
                oslot = slot
                if const_expr(self.split_do):
                    # dO's own ring: dP and dV are its only readers, so its slot comes back after dV(j)
                    oslot = j % self.do_stages
                    cute.arch.mbarrier_wait(self._bar(mbar, "do_full", oslot), (j // self.do_stages) % 2)
                self.gemm(mma_dp, accdP, tV[None, None, None, 0], tdO[None, None, None, oslot], False)
                with cute.arch.elect_one():
                    tcgen05.commit(self._bar(mbar, "dp_full"))
                # dV += P^T(j) dO(j)  (TS)
                cute.arch.mbarrier_wait(self._bar(mbar, "p_full"), j % 2)
                tcgen05_fence_after_sync()
                self.gemm(mma_dv, accdV, tP, tdOt[None, None, None, oslot], j > 0)
                if const_expr(self.split_do):
                    with cute.arch.elect_one():
                        tcgen05.commit(self._bar(mbar, "do_empty", oslot))
        with cute.arch.elect_one():
            tcgen05.commit(self._bar(mbar, "dkv_full"))


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------
def make_config(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, *,
                window_size=(None, None), softcap=0.0, **kw):
    """The plan of one build; window_size / softcap as the Hopper backward's (checked in the plan:
    TypeError / ValueError naming the argument)."""
    return blackwell_bwd_config(head_dim, head_dim_v, dtype, causal=causal, deterministic=deterministic,
                                window_size=window_size, softcap=softcap, **kw)


def make_kernel(dtype, head_dim, head_dim_v, causal, deterministic, *, varlen=False, has_seqused_k=False,
                dq_order=None, tiles=None, window: Window = NO_WINDOW, softcap: float = 0.0):
    """host.py's make_kernel interface: dense, or varlen (+ seqused_k), default or deterministic;
    window (a Window beyond causal, host.variant_of) and softcap when host.backward passes a variant.
    dQ by TMA reduce when the plan's default says so (DQ_TMA_DEFAULT), never for varlen builds.
    Head dims (192, 128) and 256: blackwell_bwd_wide.make_kernel (stage4_bwd_kernel.blackwell routes)."""
    config_fn = functools.partial(make_config, dq_tma=False) if varlen else make_config
    return make_dense_kernel(FlashAttentionBackwardSm100, config_fn, "1-CTA", dtype, head_dim, head_dim_v, causal,
                             deterministic, varlen=varlen, has_seqused_k=has_seqused_k, dq_order=dq_order, tiles=tiles,
                             supports_varlen=True, window=window, softcap=softcap)


def make_dense_kernel(kernel_cls, make_config_fn, label, dtype, head_dim, head_dim_v, causal, deterministic, *,
                      varlen, has_seqused_k, dq_order, tiles, supports_varlen=False, window=NO_WINDOW, softcap=0.0):
    """The make_kernel of a Blackwell backward variant (1-CTA, 2-CTA): refuse what it lacks, build its plan.
    supports_varlen: the kernel class takes varlen / has_seqused_k (the 1-CTA one). window / softcap
    go to the plan only when set (the 2-CTA plan refuses them; plain calls build as before)."""
    if (varlen or has_seqused_k) and not supports_varlen:
        raise ValueError(f"varlen / seqused_k: not implemented in the {label} Blackwell backward yet "
                         "(stage4_bwd_kernel/README.md, Blackwell section)")
    if has_seqused_k and not varlen:
        raise ValueError("seqused_k: only with varlen (cu_seqlens_q / cu_seqlens_k)")
    if tiles not in (None, (128, 128)):
        raise ValueError(f"tiles: the {label} Blackwell backward uses (128, 128) per CTA, got {tiles!r}")
    variant = {}
    if tuple(window) != tuple(NO_WINDOW) or softcap:
        variant = dict(window_size=tuple(window), softcap=softcap)
    cfg = make_config_fn(str(dtype).lower().replace("bfloat16", "bf16").replace("float16", "fp16"),
                         head_dim, head_dim_v, causal, deterministic, **variant)
    if not varlen:
        return kernel_cls(cfg, dq_order=dq_order)
    return kernel_cls(cfg, dq_order=blockidx_order(dq_order), varlen=True, has_seqused_k=has_seqused_k)


def blockidx_order(dq_order):
    """The dQ order a Blackwell kernel runs: it reads blockIdx.x through ``n_block_for_launch``. A
    sectioned order (host.backward's default, which maps the whole launch index with
    ``tile_for_launch``) runs as its plain base, whose ranks it shares -- what the dense kernel does,
    and, varlen, what keeps WalkPlan.tile_bounds on blockIdx. ValueError for an order without one."""
    if dq_order is None or not hasattr(dq_order, "tile_for_launch"):
        return dq_order
    for base in getattr(dq_order, "__mro__", ())[1:]:
        if "n_block_for_launch" in vars(base) and not hasattr(base, "tile_for_launch"):
            return base
    raise ValueError(f"dq_order: {getattr(dq_order, 'name', dq_order)!r} maps the whole launch index "
                     "(tile_for_launch); the Blackwell backward reads blockIdx (n_block_for_launch)")


_CACHE: dict = {}


def compile_config(cfg: BlackwellBwdConfig, dq_order=None, *, varlen: bool = False,
                   has_seqused_k: bool = False) -> compile_cache.Compiled:
    """Compile for sm_100a (``--gpu-arch``) with fake tensors; the report adds the tcgen05 counts.
    varlen: the packed build (same fake arguments: host.fake_main_args is rank 4 either way)."""
    import re

    def atomics(sass, ptx):
        return {"RED": len(re.findall(r"\bREDG?\b[^\n]*\.ADD", sass)) if sass else None,
                "UBLKRED": len(re.findall(r"\bUBLKRED\b", sass)) if sass else None,
                "UTMAREDG": len(re.findall(r"\bUTMAREDG\b", sass)) if sass else None,
                "ptx_red_v2": len(re.findall(r"red\.global\.add\.v2\.f32", ptx)),
                "ptx_bulk_tensor_reduce": len(re.findall(r"cp\.reduce\.async\.bulk\.tensor", ptx)),
                "ptx_ld_acquire": len(re.findall(r"ld\.global\.acquire\.gpu", ptx))}
    return compile_cached(FlashAttentionBackwardSm100, cfg, dq_order, _CACHE, atomics, varlen=varlen,
                          has_seqused_k=has_seqused_k)


def compile_cached(kernel_cls, cfg: BlackwellBwdConfig, dq_order, cache: dict, extra_report, *, varlen: bool = False,
                   has_seqused_k: bool = False) -> compile_cache.Compiled:
    """Compile kernel_cls(cfg) for sm_100a once per (plan, dQ order[, varlen]); extra_report(sass, ptx) -> more
    counts. varlen / has_seqused_k: only for a class that takes them (the 1-CTA kernel)."""
    from stage4_bwd_kernel import host

    dq_order = dq_order or common.default_dq_order(cfg.causal, cfg.deterministic, sections=False)
    key = (cfg.key(), dq_order.name)
    if varlen:
        key += ("varlen", bool(has_seqused_k))
    if key in cache:
        return cache[key]
    if varlen:
        kernel = kernel_cls(cfg, dq_order=blockidx_order(dq_order), varlen=True, has_seqused_k=has_seqused_k)
    else:
        kernel = kernel_cls(cfg, dq_order=dq_order)
    args = host.fake_main_args(common.cutlass_dtype(cfg.dtype), cfg.head_dim, cfg.head_dim_v)
    fn, rep, sass, ptx = _fwd.compile_sm100(kernel, args)
    rep.update(smem_bytes=kernel.smem_bytes, threads=kernel.num_threads, tmem_cols_used=cfg.tmem.used,
               tmem_cols_alloc=cfg.tmem.alloc)
    rep.update(extra_report(sass, ptx))
    out = compile_cache.Compiled(fn, rep, sass, ptx)
    cache[key] = out
    return out


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, *, varlen=False,
                 has_seqused_k=False, window_size=(None, None), softcap=0.0, **kw):
    """Compile the 1-CTA backward for sm_100a (dense, or varlen with cu_seqlens [+ seqused_k]);
    window_size / softcap: the variant builds (compiled and checked structurally, never run)."""
    if has_seqused_k and not varlen:
        raise ValueError("seqused_k: only with varlen (cu_seqlens_q / cu_seqlens_k)")
    if varlen:
        kw.setdefault("dq_tma", False)  # packed rows keep the per-row atomics (see __init__)
    cfg = make_config(dtype, head_dim, head_dim_v, causal, deterministic, window_size=window_size, softcap=softcap,
                      **kw)
    return compile_config(cfg, varlen=varlen, has_seqused_k=has_seqused_k)


REPORT_KEYS = ["threads", "registers", "smem_bytes", "tmem_cols_used", "tmem_cols_alloc", "spill_stores",
               "spill_loads", "LDL/STL", "UTCHMMA.SS", "UTCHMMA.TS", "LDTM", "STTM", "UTMALDG", "RED", "UTMAREDG"]


def format_report(name, rep):
    return f"{name}: " + ", ".join(f"{k}={rep.get(k)}" for k in REPORT_KEYS)


def compile_pre_post_sm100(dtype="bf16", head_dim=128, head_dim_v=None):
    """The arch-neutral preprocess / postprocess kernels (plain SIMT loads, stores, shuffles),
    compiled unchanged for sm_100a (the preprocess reads dO and O at head_dim_v, default head_dim).
    Returns the two compiled functions."""
    from stage4_bwd_kernel import postprocess as post
    from stage4_bwd_kernel import preprocess as pre

    dt = common.cutlass_dtype(dtype)
    dv = head_dim if head_dim_v is None else head_dim_v
    f1 = _fwd.compile_sm100(pre.BackwardPreprocess(dt, head_dim, dv, False), pre._fake_args(dt, head_dim, dv))[0]
    f2 = _fwd.compile_sm100(post.BackwardPostprocess(dt, head_dim, False), post._fake_args(dt, head_dim))[0]
    return f1, f2


def blackwell_gpu_available() -> bool:
    return _fwd.blackwell_gpu_available()


def attention_backward(q, k, v, out, dout, lse, *, softmax_scale=None, causal=False, deterministic=False,
                       window_size=(None, None), softcap=0.0, dq=None, dk=None, dv=None, dq_order=None,
                       kernel_maker=None, dlse=None):
    """Gradients on a Blackwell (capability 10.x) GPU; window_size / softcap / dlse as the Hopper backward's.
    kernel_maker: host.py's make_kernel to build (None: this module's; the wide head dims pass
    blackwell_bwd_wide.make_kernel, as stage4_bwd_kernel.blackwell does). UNVERIFIED: never run on hardware here."""
    from stage4_bwd_kernel import host

    variant = host.variant_of(causal, window_size, softcap)  # TypeError / ValueError before the GPU check
    if not blackwell_gpu_available():
        raise RuntimeError("the Blackwell backward needs a capability-10.x (sm_100) GPU; use compile_only() "
                           "elsewhere, or stage4_bwd_kernel.hopper on an H100")
    return host.backward(STEP, kernel_maker or make_kernel, q, k, v, out, dout, lse, softmax_scale=softmax_scale,
                         causal=causal, deterministic=deterministic, dq=dq, dk=dk, dv=dv, dq_order=dq_order,
                         variant=variant, dlse=dlse)


def attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              seqused_k=None, softmax_scale=None, causal=False, deterministic=False,
                              window_size=(None, None), softcap=0.0, dq=None, dk=None, dv=None, dq_order=None,
                              return_d=False, check_values=False, kernel_maker=None, dlse=None):
    """Packed (T, H, D) q, k, v, out, dout, lse (Hq, Tq) fp32, int32 cu_seqlens (batch + 1,), optional
    seqused_k (batch,) -> (dq, dk, dv) (+ D with return_d, as the Hopper one) on a Blackwell (capability 10.x) GPU, through host.backward (the
    Hopper varlen backward's preprocess / postprocess). UNVERIFIED: compiled for sm_100a and checked
    structurally, never run. window_size / softcap / dlse as the Hopper backward's."""
    from stage4_bwd_kernel import host

    variant = host.variant_of(causal, window_size, softcap)  # TypeError / ValueError before the GPU check
    if not blackwell_gpu_available():
        raise RuntimeError("the Blackwell backward needs a capability-10.x (sm_100) GPU; use compile_only(varlen=True) "
                           "elsewhere, or stage4_bwd_kernel.hopper on an H100")
    return host.backward(STEP, kernel_maker or make_kernel, q, k, v, out, dout, lse, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         seqused_k=seqused_k, softmax_scale=softmax_scale, causal=causal,
                         deterministic=deterministic, dq=dq, dk=dk, dv=dv, dq_order=dq_order, return_d=return_d,
                         variant=variant, check_values=check_values, dlse=dlse)


if __name__ == "__main__":
    for d in (64, 128):
        for causal in (False, True):
            for det in (False, True):
                print(format_report(f"{STEP} d={d} causal={causal} det={det}",
                                    compile_only("bf16", d, causal=causal, deterministic=det).report))
            # dQ by TMA reduce-add from SMEM (opt-in; deterministic builds keep the atomics)
            print(format_report(f"{STEP} d={d} causal={causal} dq_tma",
                                compile_only("bf16", d, causal=causal, dq_tma=True).report))
