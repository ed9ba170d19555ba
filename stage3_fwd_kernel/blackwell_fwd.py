"""Stage 3, Blackwell (sm_100a): the FA4 forward pipeline -- tcgen05 MMAs, tensor memory, two
softmax warpgroups and a correction warpgroup. COMPILED AND INSPECTED ONLY: no Blackwell GPU is
reachable from this project, so this kernel has never run on hardware (see the Blackwell section of README.md).

Compared with Hopper step 3, this moves the accumulators out of the register file, because
Blackwell's tcgen05 MMA writes them to tensor memory (TMEM) and a 128 x 128 tile is one
instruction issued by one thread. That changes who does what (the paper, section 3.1):

* **MMA warp** (1 warp, one elected thread issues): S_i = Q_i K_j^T with both operands in SMEM
  (the "SS" form) and O_i += P_i V_j with P read from TMEM (the "TS" form), for the two 128-row
  query tiles i = 0, 1 of the CTA. Each tcgen05.commit arrives on an mbarrier when the MMAs issued
  before it have completed.
* **load warp**: TMA loads Q_0, K_0, Q_1, V_0, K_1, V_1, ... K and V share one ring of
  ``kv_stages`` slots in SMEM, in exactly the order the MMA warp consumes them.
* **softmax warpgroups 0 and 1** (128 threads each): thread r owns row r of its tile -- the whole
  row of S (tile_n = 128 fp32 values) arrives in its registers with tcgen05.ld, so the row max and
  row sum need no shuffles. The two warpgroups run free of each other, as in the official kernel:
  the MMA warp's order already staggers their S tiles, and a named-barrier "exp turn" between
  them would serialise more work than a key block's MMAs take (blackwell_softmax.py says why).
* **correction warpgroup**: rescales O_i in TMEM when a row max moved (off the softmax critical
  path), and at the end computes O / l and lse and writes O to SMEM.
* **epilogue warp**: O from SMEM to global memory (TMA store; row-guarded 16-byte stores when
  sequences are packed, so a tile never writes into the next sequence).

The roles' device code is in mixins of the kernel class: the load and MMA warps in
``blackwell_load_mma.py``, the softmax and correction warpgroups in ``blackwell_softmax.py``, O's
epilogue in ``blackwell_output.py``; the tcgen05 fences around barriers are in ``blackwell_sync.py``.

The shared softmax policy (stage3_fwd_kernel/softmax_policy.py, verified on Hopper hardware) is
used unchanged: ``rescale_vote`` (conditional rescaling, tau = 8, one warp vote) and ``exp2_row``
(partial exp2 emulation with a compile-time pattern from stage 2's polynomial).

Per key block j the MMA warp issues, for a CTA with tiles 0 and 1 (the paper's pipeline):

    S_0(0) = Q_0 K_0^T,  S_1(0) = Q_1 K_0^T
    for j = 1 .. n-1:   O_0 += P_0(j-1) V_(j-1),  S_0(j) = Q_0 K_j^T,
                        O_1 += P_1(j-1) V_(j-1),  S_1(j) = Q_1 K_j^T
    O_0 += P_0(n-1) V_(n-1),  O_1 += P_1(n-1) V_(n-1)

so while softmax warpgroup 0 exponentiates S_0(j), the tensor core runs O_1 += P_1 V and
S_1(j + 1)... and vice versa. tcgen05 MMAs from one thread execute in order, which is what lets
P_i live in the columns of S_i: O_i += P_i V reads them before S_i(j + 1) = Q_i K^T overwrites them.

P goes to TMEM in two parts (the paper: "stage out storing P"): the softmax thread converts its
row a quarter at a time; after three quarters are stored it signals the MMA warp, which issues
O += P V on the first 3/4 of the K dimension (6 of 8 K = 16 instructions) and waits for the last
quarter before the other 2. No thread ever holds the fp32 row and the packed row together.

Arithmetic (B200, per key block, M = 2 x 128, N = 128, d = 128; roofline.py): the two tiles cost
2 x 1024 MMA clk and 2 x 1024 MUFU clk, so the kernel only reaches the roofline if the exp2 of
one tile runs under the MMAs of the other -- hence the two Q tiles, the correction warpgroup (the
O rescale does not delay P), and moving emulation_fraction of the exp2s onto the FMA pipe.

Synchronisation (all mbarriers in SMEM; "count" = arrivals per phase):

    q_full[i]     TMA -> MMA                     1 (+ tx bytes)
    kv_full[s]    TMA -> MMA                     1 (+ tx bytes of the K or V tile in slot s)
    kv_empty[s]   MMA (tcgen05.commit) -> TMA    1
    s_full[i]     MMA (commit) -> softmax i      1
    p_full[i]     softmax i (3/4 of P stored) + correction (O_i rescaled) -> MMA   256
    p_full_2[i]   softmax i (last 1/4 of P) -> MMA                                 128
    scale_full[i] softmax i (rescale factor in TMEM) -> correction                 128
    final_full[i] softmax i (row sum, row max in TMEM) -> correction               128
    o_full[i]     MMA (commit after the last O_i += P V) -> correction             1
    epi_full[i]   correction (O_i in SMEM) -> epilogue warp                        128
    tmem_dealloc  softmax WGs + correction done with TMEM -> MMA warp frees it     384 (one Q tile: 256)
  varlen builds only (their last V's rows past the sequence's keys are zeroed):
    v_tail        TMA -> load warp (it zeroes those rows, then arrives on kv_full)  1 (+ tx bytes)
  persistent builds only (blackwell_persistent.py):
    q_empty[i]    MMA (commit after the tile's last S_i) -> TMA: sQ_i free         1
    final_empty[i] correction (final row stats read) -> MMA: S_i may be rewritten  128
    epi_empty[i]  epilogue warp (sO_i stored) -> correction: sO_i free             32

Supported: fp16/bf16, head dims 64, 96, 128, (192, 128), and 256 with ONE Q tile per CTA
(q_tiles_per_cta=1: two do not fit TMEM; one softmax warpgroup, warpgroup 1 idle); causal
(bottom-right aligned); GQA/MQA; varlen (cu_seqlens_q/k, packed (total, heads, dim)); lse output;
the StaticTileScheduler interface (one (m_block, head, batch) tile per CTA, the default), or a persistent grid over any tile order
(tile_scheduler.PersistentScheduler with static striding: one CTA per SM walks tiles c, c + P, ...
carrying every barrier phase across its tiles; blackwell_persistent.py; head dims up to 128).
"""
from __future__ import annotations

import functools
import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator
from cutlass.pipeline import NamedBarrier

from stage3_fwd_kernel import blackwell_paged, compile_cache, host_io, runner, sass_report, tile_scheduler
from stage3_fwd_kernel.blackwell_config import (SUPPORTED_HEAD_DIMS, BlackwellFwdConfig, blackwell_fwd_config,
                                               q_tiles_for)
from stage3_fwd_kernel.blackwell_config import TILE_N
from stage3_fwd_kernel.blackwell_config import check_page_size as check_blackwell_page_size
from stage3_fwd_kernel.blackwell_load_mma import LoadMmaRoles
from stage3_fwd_kernel.blackwell_output import OutputRoles
from stage3_fwd_kernel.blackwell_persistent import PersistentRoles, TileWalkArgs, check_persistent
from stage3_fwd_kernel.blackwell_softmax import SoftmaxCorrectionRoles
from stage3_fwd_kernel.blackwell_sync import tcgen05_fence_after_sync, tcgen05_fence_before_sync
from stage3_fwd_kernel.components import block_range
from stage3_fwd_kernel.components.mask import AttentionMask
from stage3_fwd_kernel.components.page_sizes import box_rows
from stage3_fwd_kernel.components.score_mod import Softcap
from stage3_fwd_kernel.components.window import NO_WINDOW, Window, make_window
from stage3_fwd_kernel.components.work_tile import SequenceInfo, locate_tile
from stage3_fwd_kernel.hopper.host import (_nothing_visible, _outputs, make_variant,  # the same checks and rules
                                           paged_cache_inputs)
from stage3_fwd_kernel.softmax_policy import SoftmaxPolicy

# The process target is the package's (sm_90a without a GPU, so Hopper kernels compiled in the
# same process keep working); compiles below pass `--gpu-arch sm_100a` explicitly. To launch on a
# Blackwell GPU the process must target sm_100a before cutlass loads: fa4 does that from the
# device, a standalone run takes CUTE_DSL_ARCH=sm_100a.

STEP = "blackwell_fwd"
TARGET_ARCH = "sm_100a"

# named barriers (id 0 is __syncthreads)
BAR_TMEM_ALLOC = 1   # MMA warp + softmax WGs + correction: the TMEM address is in SMEM


class FlashAttentionForwardSm100(LoadMmaRoles, SoftmaxCorrectionRoles, OutputRoles, PersistentRoles):
    """The FA4 forward pipeline for one BlackwellFwdConfig (2 Q tiles x 128 rows, tile_n = 128; one Q
    tile at d = 256, where warpgroup 1 idles).
    The load and MMA warps are in ``blackwell_load_mma.LoadMmaRoles``, the softmax and correction
    warpgroups in ``blackwell_softmax.SoftmaxCorrectionRoles``, O's epilogue in
    ``blackwell_output.OutputRoles``, the persistent builds' tile loops in
    ``blackwell_persistent.PersistentRoles``."""

    # the mbarrier block, per Q tile (blackwell_config counts them; the protocol checker reads these)
    PER_Q_BARRIERS = ("q_full", "s_full", "p_full", "p_full_2", "scale_full", "final_full", "o_full", "epi_full")
    PERSISTENT_BARRIERS = ("q_empty", "final_empty", "epi_empty")  # after the plan's, persistent builds only
    gpu_arch = TARGET_ARCH  # compile_cache compiles launchable builds for it whatever the process targets

    def __init__(self, config: BlackwellFwdConfig, *, varlen: bool = False,
                 scheduler=tile_scheduler.StaticTileScheduler, page_size: int | None = None):
        # a plain bool (the protocol checker reads it): one CTA per SM walking tiles, phases carried
        self.persistent = check_persistent(scheduler, config)
        self.cfg = config
        self.varlen = varlen
        # a paged K/V cache read in place (components.paged_kv): pages of whole key blocks, one TMA
        # box a block, or pages of 16 / 32 / 64 keys, boxes_per_block boxes a block (blackwell_paged)
        self.page_size = check_blackwell_page_size(page_size, config.tile_n, varlen, self.persistent,
                                                   (config.head_dim, config.head_dim_v))
        self.blocks_per_page = 1 if page_size is None else max(page_size // config.tile_n, 1)
        self.box_rows = box_rows(page_size, config.tile_n)
        self.boxes_per_block = config.tile_n // self.box_rows
        # varlen: rows past a sequence's keys (unused cache slots past seqused_k, a paged cache's unused
        # rows, a buffer's end) may hold NaN, which P = 0 does not cancel: the load warp zeroes those V
        # rows of the walk's last block (LoadMmaRoles.load_v_tail), as the Hopper consumers do
        self.zero_v_tail = bool(varlen)
        if self.zero_v_tail and 8 * (self._barriers_before_tail() + 1) + 4 > config.smem.header:
            raise ValueError("varlen: the V tail's barrier does not fit the SMEM header at these head dims")
        self.scheduler = scheduler
        self.dtype = host_io.cutlass_dtype(config.dtype)
        self.d, self.dv = config.head_dim, config.head_dim_v
        # varlen epilogue: threads per O row, a divisor of 32 (a warp covers whole rows), of 16-byte
        # stores (8 values at 16 bits): dv = 64 / 96 / 128 -> 8 / 4 / 16 threads (96: 24 values each)
        self.varlen_store_threads_per_row = math.gcd(self.dv // 8, 32)
        self.tm, self.tn = config.tile_m, config.tile_n
        self.num_q = config.q_tiles_per_cta
        self.stages = config.kv_stages
        self.causal = config.causal
        # the keys a row sees (components.window): causal is a right edge at 0; a left window
        # makes every role walk key blocks [n_block_min, n_block_max) instead of [0, n_block_max)
        self.window = Window(config.window.left, 0 if config.causal else config.window.right)
        self.left_window = self.window.left is not None  # a plain bool: the protocol checker reads it
        self.mask = AttentionMask(self.window, config.tile_n)
        self.score_mod = Softcap(config.softcap)  # components.score_mod: tanh on S in the softmax warps
        self.sink = config.sink                   # components.sink: the correction's final O / l and lse
        self.policy = SoftmaxPolicy(rescale_threshold=config.rescale_threshold,
                                    emulation_fraction=config.emulation_fraction)
        self.policy.check_dtype(self.dtype)
        self.roles = config.roles
        self.num_threads = config.num_threads
        self.tmem = config.tmem
        self.p_chunk_cols = self.tmem.p_cols // config.p_store_chunks  # fp32 columns per P store
        self.s_chunk = self.tn // config.p_store_chunks                 # S values per P store
        self.smem_bytes = None

    # ------------------------------------------------------------------ host side (traced once)
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale_log2: Float32,
                 mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
                 max_seqlen_q: Int32 | None, score_scale: Float32 | None, mSink: cute.Tensor | None, stream,
                 max_ctas: Int32 | None = None, mSeqUsedK: cute.Tensor | None = None,
                 mPageTable: cute.Tensor | None = None):
        """Dense: mQ (B, Sq, Hq, d), mK (B, Sk, Hkv, d), mV (B, Sk, Hkv, dv), mO (B, Sq, Hq, dv),
        mLSE (B, Hq, Sq). Varlen: mQ (Tq, Hq, d), mK / mV (Tk, Hkv, *), mO (Tq, Hq, dv),
        mLSE (Hq, Tq), cu_seqlens int32 (B + 1,), max_seqlen_q a runtime int; mSeqUsedK int32 (B,) or
        None: sequence b attends to the first mSeqUsedK[b] of its keys (components.work_tile).
        Variants: score_scale the softcap's tanh input scale (Softcap.kernel_scales;
        softmax_scale_log2 is then softcap * log2 e), None without softcap; mSink fp32 (Hq,) sink
        logits, None without a sink. max_ctas: persistent builds only, the grid's width (the
        device's SMs); None otherwise. mPageTable int32 (B, pages) in a paged build (with mSeqUsedK):
        mK / mV are then the flat cache (pages x page_size, Hkv, *) and cu_seqlens_k logical first keys."""
        if const_expr(self.persistent != (max_ctas is not None)):
            raise TypeError("max_ctas: persistent kernels take the grid width (the SM count), others None")
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mO.element_type == self.dtype)):
            raise TypeError("q, k, v, out must share the kernel's dtype")
        if const_expr(self.varlen != (mCuSeqlensQ is not None)):
            raise TypeError("varlen kernels take cu_seqlens_q / cu_seqlens_k, dense ones None")
        if const_expr(mSeqUsedK is not None and not self.varlen):
            raise TypeError("seqused_k: varlen kernels only (a dense call's keys are all used)")
        if const_expr(self.score_mod.on != (score_scale is not None)):
            raise TypeError("score_scale: softcap kernels take the tanh's input scale, others None")
        if const_expr(self.sink != (mSink is not None)):
            raise TypeError("learnable_sink: sink kernels take an fp32 (Hq,) tensor, others None")
        if const_expr((self.page_size is not None) != (mPageTable is not None) or
                      (mPageTable is not None and mSeqUsedK is None)):
            raise TypeError("page_table: paged builds take one and seqused_k, others None")
        d, dv, tm, tn = self.d, self.dv, self.tm, self.tn
        # 1. views the TMA and MMA want
        mQ, mK, mV, mO = self.gmem_views(mQ, mK, mV, mO)

        # 2. the two MMAs: S = Q K^T (A, B from SMEM, both K-major); O = P V (A = P from TMEM)
        cta_group = tcgen05.CtaGroup.ONE
        tiled_mma_qk, tiled_mma_pv, tP_layout = self.mmas_and_p_layout()
        mma_tiler_qk = (tm, tn, d)
        mma_tiler_pv = (tm, dv, tn)

        # 3. SMEM layouts (128B swizzle atoms chosen by the helpers). K and V share the ring: each
        #    gets a stage stride of one slot = the larger tile, so slot s is the same bytes for both.
        sQ_layout = sm100_utils.make_smem_layout_a(tiled_mma_qk, mma_tiler_qk, self.dtype, self.num_q)
        sK_layout = self._restage(sm100_utils.make_smem_layout_b(tiled_mma_qk, mma_tiler_qk, self.dtype, 1))
        sV_layout = self._restage(sm100_utils.make_smem_layout_b(tiled_mma_pv, mma_tiler_pv, self.dtype, 1))
        sO_layout = self.o_smem_layout()

        # 4. TMA atoms; the byte counts the "full" barriers expect
        cluster_vmnk = cute.tiled_divide(cute.make_layout((1, 1, 1)), (tiled_mma_qk.thr_id.shape,)).shape
        tma_load = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_A(
            tma_load, mQ, cute.select(sQ_layout, mode=[0, 1, 2]), mma_tiler_qk, tiled_mma_qk, cluster_vmnk)
        if const_expr(self.boxes_per_block > 1):  # pages smaller than a key block: one box a page
            tma_atom_K, tma_K, tma_atom_V, tma_V = blackwell_paged.box_tma_atoms(
                tma_load, mK, mV, sK_layout, sV_layout, tiled_mma_pv, self.dtype, tm, self.box_rows, d, dv,
                cluster_vmnk)
        else:
            tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(
                tma_load, mK, cute.select(sK_layout, mode=[0, 1, 2]), mma_tiler_qk, tiled_mma_qk, cluster_vmnk)
            tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_B(
                tma_load, mV, cute.select(sV_layout, mode=[0, 1, 2]), mma_tiler_pv, tiled_mma_pv, cluster_vmnk)
        self.bytes_Q = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1, 2]))
        self.bytes_K = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1, 2]))
        self.bytes_V = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1, 2]))
        tma_atom_O, tma_O = None, None
        if const_expr(not self.varlen):  # packed sequences cannot use a box store (next sequence)
            tma_atom_O, tma_O = self.o_tma_store_atom(mO, sO_layout)

        # 5. shared storage: barriers first, then 1024-byte aligned tiles (blackwell_config.py)
        st = self.stages
        slot_elems = self.cfg.smem.kv_slot // 2
        o_elems = 0 if self.cfg.smem.o_overlaps_q else cute.cosize(sO_layout)
        num_barriers = self._barriers_before_tail() + (1 if self.zero_v_tail else 0)

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, num_barriers]
            tmem_addr: Int32
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, o_elems], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, st * slot_elems], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()

        # 6. grid: one CTA per (256 query rows, head, batch), or (persistent) min(tiles, max_ctas) CTAs
        #    that walk the tiles; only they get the extents as kernel arguments
        if const_expr(not self.varlen):
            seqlen_q_static, batch = mQ.shape[0], mQ.shape[3]
        else:
            seqlen_q_static, batch = max_seqlen_q, mCuSeqlensQ.shape[0] - 1
        num_m_blocks = (seqlen_q_static + self.cfg.cta_tile_m - 1) // self.cfg.cta_tile_m
        extents = (None, None, None)
        if const_expr(self.persistent):
            width = cutlass.max(max_ctas, 1)
            if const_expr(self.scheduler.num_ctas is not None):  # a width fixed at compile time
                width = self.scheduler.num_ctas
            grid = self.scheduler.grid_shape(num_m_blocks, mQ.shape[2], batch, width)
            extents = (Int32(num_m_blocks), Int32(mQ.shape[2]), Int32(batch))
        else:
            grid = self.scheduler.grid_shape(num_m_blocks, mQ.shape[2], batch)
        self.launch_grid = grid  # (traced values; plain ints when the shapes and the width are static)
        self.kernel(tma_Q, tma_K, tma_V, tma_O, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, softmax_scale_log2,
                    mQ.shape[0], mK.shape[0], mQ.shape[2] // mK.shape[2],
                    tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O, tiled_mma_qk, tiled_mma_pv,
                    sQ_layout, sK_layout, sV_layout, tP_layout, sO_layout, score_scale, mSink, mSeqUsedK, mPageTable,
                    *extents).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    def gmem_views(self, mQ, mK, mV, mO):
        """(seq, dim, head[, batch]) for Q / K / O, (dim, seq, ...) for V (the B operand of O += P V is
        V^T: N = dv is its contiguous, "MN-major", mode), strides promised 16-byte multiples."""
        mQ, mK = host_io.assume_strides_16B(mQ, self.d), host_io.assume_strides_16B(mK, self.d)
        mV, mO = host_io.assume_strides_16B(mV, self.dv), host_io.assume_strides_16B(mO, self.dv)
        if const_expr(not self.varlen):
            qko_modes, v_modes = [1, 3, 2, 0], [3, 1, 2, 0]
        else:
            qko_modes, v_modes = [0, 2, 1], [2, 0, 1]
        mQ, mK, mO = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=qko_modes)) for t in (mQ, mK, mO)]
        mV = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=v_modes))
        return mQ, mK, mV, mO

    def mmas_and_p_layout(self):
        """(tiled_mma_qk, tiled_mma_pv, tP_layout): S = Q K^T (SS, both K-major), O = P V (TS: A = P
        from TMEM) and the layout the TS operand's TMEM fragment is made from. A method only so that
        blackwell_tmem_check builds them at trace time exactly as __call__ does."""
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        cta_group = tcgen05.CtaGroup.ONE
        tiled_mma_qk = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, cta_group, (self.tm, self.tn))
        tiled_mma_pv = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, cta_group, (self.tm, self.dv),
            tcgen05.OperandSource.TMEM)
        tP_layout = sm100_utils.make_smem_layout_a(tiled_mma_pv, (self.tm, self.dv, self.tn), self.dtype, 1)
        return tiled_mma_qk, tiled_mma_pv, tP_layout

    def _restage(self, layout_one_stage):
        """Replace the stage mode of a 1-stage (swizzled) tile layout with `kv_stages` slots spaced
        by one ring slot (cfg.smem.kv_slot bytes)."""
        outer = cute.select(layout_one_stage.outer, mode=[0, 1, 2])
        slot_elems = self.cfg.smem.kv_slot // 2
        staged = cute.make_layout((*outer.shape, self.stages), stride=(*outer.stride, slot_elems))
        return cute.make_composed_layout(layout_one_stage.inner, 0, staged)

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, tma_Q: cute.Tensor, tma_K: cute.Tensor, tma_V: cute.Tensor, tma_O: cute.Tensor | None,
               mO: cute.Tensor, mLSE: cute.Tensor, mCuSeqlensQ: cute.Tensor | None,
               mCuSeqlensK: cute.Tensor | None, softmax_scale_log2: Float32,
               seqlen_q_static: Int32, seqlen_k_static: Int32, qhead_per_kvhead: Int32,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tma_atom_O: cute.CopyAtom | None, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               tP_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout, score_scale: Float32 | None,
               mSink: cute.Tensor | None, mSeqUsedK: cute.Tensor | None, mPageTable: cute.Tensor | None,
               num_m_blocks: Int32 | None, num_heads: Int32 | None, num_batch: Int32 | None):
        # the last three: a persistent grid's tile space (None in one-tile-per-CTA builds)
        roles, nq = self.roles, self.num_q
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(warp_idx // 4)

        # 0. shared memory, barriers, tensors
        storage = SmemAllocator().allocate(self.shared_storage)
        mbar = storage.mbar.data_ptr()
        if warp_idx == roles.load:
            cpasync.prefetch_descriptor(tma_atom_Q)
            cpasync.prefetch_descriptor(tma_atom_K)
            cpasync.prefetch_descriptor(tma_atom_V)
            if const_expr(not self.varlen):
                cpasync.prefetch_descriptor(tma_atom_O)
        if warp_idx == 0:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(nq):
                    cute.arch.mbarrier_init(self._bar(mbar, "q_full", i), 1)
                    cute.arch.mbarrier_init(self._bar(mbar, "s_full", i), 1)
                    cute.arch.mbarrier_init(self._bar(mbar, "p_full", i), 2 * 128)
                    cute.arch.mbarrier_init(self._bar(mbar, "p_full_2", i), 128)
                    cute.arch.mbarrier_init(self._bar(mbar, "scale_full", i), 128)
                    cute.arch.mbarrier_init(self._bar(mbar, "final_full", i), 128)
                    cute.arch.mbarrier_init(self._bar(mbar, "o_full", i), 1)
                    cute.arch.mbarrier_init(self._bar(mbar, "epi_full", i), 128)
                for s in cutlass.range_constexpr(self.stages):
                    cute.arch.mbarrier_init(self._bar(mbar, "kv_full", s), 1)
                    cute.arch.mbarrier_init(self._bar(mbar, "kv_empty", s), 1)
                cute.arch.mbarrier_init(self._bar(mbar, "tmem_dealloc", 0), roles.tmem_users)
                if const_expr(self.persistent):
                    for i in cutlass.range_constexpr(nq):
                        cute.arch.mbarrier_init(self._bar(mbar, "q_empty", i), 1)
                        cute.arch.mbarrier_init(self._bar(mbar, "final_empty", i), 128)
                        cute.arch.mbarrier_init(self._bar(mbar, "epi_empty", i), 32)
                if const_expr(self.zero_v_tail):
                    cute.arch.mbarrier_init(self._bar(mbar, "v_tail", 0), 1)
        cute.arch.mbarrier_init_fence()  # inits visible to the async proxy (TMA, tcgen05.commit)
        cute.arch.sync_threads()         # ... and to every thread

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)      # (MMA, M, K, q tile)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)     # (MMA, N, K, slot)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        if const_expr(self.cfg.smem.o_overlaps_q):
            sO = cute.make_tensor(cute.recast_ptr(sQ.iterator, sO_layout.inner), sO_layout.outer)
        else:
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)  # (tm, dv, q tile)

        # the MMA warp, the softmax warpgroups and the correction warpgroup wait for the address
        tmem = TmemAllocator(storage.tmem_addr.ptr, allocator_warp_id=roles.mma,
                             barrier_for_retrieve=NamedBarrier(barrier_id=BAR_TMEM_ALLOC,
                                                               num_threads=32 * (4 * nq + 5)),
                             arch="sm_100")
        if const_expr(self.persistent):
            walk = TileWalkArgs(mCuSeqlensQ, mCuSeqlensK, seqlen_q_static, seqlen_k_static, qhead_per_kvhead,
                                num_m_blocks, num_heads, num_batch, mSeqUsedK)
            self.persistent_roles(walk, wg_idx, warp_idx, tmem, mbar, tma_Q, tma_K, tma_V, tma_O, mO, mLSE,
                                  softmax_scale_log2, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
                                  tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, sO, tP_layout, score_scale, mSink)
        else:
            self.one_tile_roles(mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, seqlen_q_static, seqlen_k_static, qhead_per_kvhead,
                                wg_idx, warp_idx, tmem, mbar, tma_Q, tma_K, tma_V, tma_O, mO, mLSE,
                                softmax_scale_log2, tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
                                tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, sO, tP_layout, score_scale, mSink,
                                mPageTable)

    @cute.jit
    def one_tile_roles(self, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
                       mSeqUsedK: cute.Tensor | None,
                       seqlen_q_static: Int32, seqlen_k_static: Int32, qhead_per_kvhead: Int32,
                       wg_idx: Int32, warp_idx: Int32, tmem: TmemAllocator, mbar: cute.Pointer,
                       tma_Q: cute.Tensor, tma_K: cute.Tensor, tma_V: cute.Tensor, tma_O: cute.Tensor | None,
                       mO: cute.Tensor, mLSE: cute.Tensor, softmax_scale_log2: Float32,
                       tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
                       tma_atom_O: cute.CopyAtom | None, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
                       sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sO: cute.Tensor,
                       tP_layout: cute.ComposedLayout, score_scale: Float32 | None, mSink: cute.Tensor | None,
                       mPageTable: cute.Tensor | None = None):
        """The warp roles of a CTA that computes one tile (the default, StaticTileScheduler interface)."""
        roles = self.roles
        thr_mma_qk = tiled_mma_qk.get_slice(0)
        thr_mma_pv = tiled_mma_pv.get_slice(0)
        # which tile / sequence: every role computes it after its setmaxnreg (values computed
        # before it would have to fit the smallest register budget, cfg.regs.other)
        tile = functools.partial(self._tile_info, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, seqlen_q_static, seqlen_k_static,
                                 qhead_per_kvhead)

        if wg_idx == roles.other_wg:
            # ---------------------------------------------------------------- MMA / load / epilogue
            cute.arch.setmaxregister_decrease(self.cfg.regs.other)
            t, n_block_min, n_blocks, tile_valid = tile()
            if warp_idx == roles.load:
                if tile_valid:
                    self.load(t.m_block, t.head, t.head_kv, t.batch, t.offset_q, t.offset_k, n_blocks, mbar,
                              tma_Q, tma_K, tma_V, tma_atom_Q, tma_atom_K, tma_atom_V, sQ, sK, sV,
                              thr_mma_qk, thr_mma_pv, n_block_min=n_block_min, page_table=mPageTable, tile=t)
            if warp_idx == roles.mma:
                tmem.allocate(self.tmem.alloc)
                tmem.relinquish_alloc_permit()
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                if tile_valid:
                    self.mma(n_blocks, mbar, tmem_ptr, sQ, sK, sV, tP_layout, tiled_mma_qk, tiled_mma_pv)
                # every TMEM reader has finished: give the columns back
                cute.arch.mbarrier_wait(self._bar(mbar, "tmem_dealloc", 0), 0)
                tcgen05_fence_after_sync()
                tmem.free(tmem_ptr)
            if warp_idx == roles.epilogue:
                if tile_valid:
                    self.epilogue(t.m_block, t.head, t.batch, t.offset_q, t.seqlen_q, mbar, sO, tma_O, tma_atom_O, mO)
        elif wg_idx == roles.correction_wg:
            # ---------------------------------------------------------------- correction warpgroup
            cute.arch.setmaxregister_decrease(self.cfg.regs.correction)
            t, _, n_blocks, tile_valid = tile()
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            if tile_valid:
                self.correction(t.m_block, t.head, t.batch, t.offset_q, t.seqlen_q, n_blocks, softmax_scale_log2,
                                mbar, tmem_ptr, sO, mLSE, thr_mma_qk, thr_mma_pv, mSink=mSink)
            tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "tmem_dealloc", 0))
        else:
            # ---------------------------------------------------------------- softmax warpgroups
            if const_expr(self.num_q == 2):  # (an int test: the protocol checker decides it)
                self.softmax_role(tile, tmem, mbar, softmax_scale_log2, thr_mma_qk, score_scale)
            else:  # one Q tile: warpgroup 1 has no rows; its registers go to the softmax warpgroup
                if wg_idx == roles.idle_warpgroup:
                    cute.arch.setmaxregister_decrease(self.cfg.regs.idle)
                else:
                    self.softmax_role(tile, tmem, mbar, softmax_scale_log2, thr_mma_qk, score_scale)

    @cute.jit
    def softmax_role(self, tile, tmem: TmemAllocator, mbar: cute.Pointer, softmax_scale_log2: Float32,
                     thr_mma_qk: cute.ThrMma, score_scale: Float32 | None):
        """A softmax warpgroup (one work tile per CTA): its rows of S -> P, then the TMEM hand-back."""
        cute.arch.setmaxregister_increase(self.cfg.regs.softmax)
        t, n_block_min, n_blocks, tile_valid = tile()
        tmem.wait_for_alloc()
        tmem_ptr = tmem.retrieve_ptr(Float32)
        if tile_valid:
            self.softmax(t.m_block, t.seqlen_q, t.seqlen_k, n_blocks, softmax_scale_log2,
                         mbar, tmem_ptr, thr_mma_qk, score_scale=score_scale, n_block_min=n_block_min)
        tcgen05_fence_before_sync()
        cute.arch.mbarrier_arrive(self._bar(mbar, "tmem_dealloc", 0))

    # ------------------------------------------------------------------ bookkeeping
    def _bar(self, mbar, name: str, i):
        """Pointer to barrier `name`[i]; the order matches blackwell_config._num_barriers."""
        nq, st = self.num_q, self.stages
        per_q = self.PER_Q_BARRIERS
        if name in per_q:
            return mbar + per_q.index(name) * nq + i
        base = len(per_q) * nq
        if name == "kv_full":
            return mbar + base + i
        if name == "kv_empty":
            return mbar + base + st + i
        if name == "tmem_dealloc":
            return mbar + base + 2 * st
        if name == "v_tail":  # builds that zero V's tail rows (zero_v_tail): after all the others
            return mbar + self._barriers_before_tail()
        # persistent builds only (cfg.persistent_barriers): after the plan's barriers
        return mbar + base + 2 * st + 1 + self.PERSISTENT_BARRIERS.index(name) * nq + i

    def _barriers_before_tail(self) -> int:
        return self.cfg.persistent_barriers if self.persistent else self.cfg.smem.num_barriers

    @cute.jit
    def _tile_info(self, mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
                   mSeqUsedK: cute.Tensor | None, seqlen_q_static: Int32, seqlen_k_static: Int32,
                   qhead_per_kvhead: Int32):
        """This CTA's AttentionTile (components.work_tile), the first key block it walks (None
        without a left window: block 0), how many it walks, and whether it has rows at all: the same
        arithmetic in every role (they must agree on the walk, or a barrier phase goes out of step)."""
        work = self.scheduler.initial_work()
        seq = SequenceInfo(seqlen_q_static, seqlen_k_static, qhead_per_kvhead, mCuSeqlensQ, mCuSeqlensK,
                           mSeqUsedK, None)
        tile = locate_tile(seq, work.m_block, work.head, work.batch)
        tile_valid = tile.m_block * self.cfg.cta_tile_m < tile.seqlen_q  # varlen: the sequence may be shorter
        n_block_min, n_blocks = self._key_blocks(tile.m_block, tile.seqlen_q, tile.seqlen_k)
        return tile, n_block_min, n_blocks, tile_valid

    @cute.jit
    def _key_blocks(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """(n_block_min or None, n_blocks): the key blocks [n_block_min, n_block_min + n_blocks) the
        CTA's 256 query rows visit (both tiles visit the same ones, so every role runs the same
        walk). At least 1, so that rows seeing nothing still run the pipeline once (P = 0, O = 0,
        lse = -inf or the sink); the walk is empty only when n_block_max = 0 (and so n_block_min),
        so that one block is block 0."""
        n_block_max = block_range.num_key_blocks(m_block, seqlen_q, seqlen_k, tile_m=self.cfg.cta_tile_m,
                                                 tile_n=self.tn, window=self.window)
        n_block_min = block_range.first_key_block(m_block, seqlen_q, seqlen_k, n_block_max,
                                                  tile_m=self.cfg.cta_tile_m, tile_n=self.tn, window=self.window)
        return n_block_min, cutlass.max(block_range.blocks_walked(n_block_min, n_block_max), 1)

    @staticmethod
    def _key_block(n_block_min, j):
        """The key block of walk step j (phases and ring slots count j from the walk's start)."""
        return j if n_block_min is None else n_block_min + j

    def _ring(self, load_idx):
        """K_j is the (2j)-th load of the ring, V_j the (2j+1)-th: slot and phase parity."""
        return load_idx % self.stages, (load_idx // self.stages) % 2

    # The phases a persistent CTA carries from tile to tile (blackwell_persistent.py): blocks_done =
    # key blocks its earlier tiles walked, tiles_done = tiles it finished. A one-tile build ignores
    # them (None), so its code is exactly what it was before persistent builds existed.
    def _walk_step(self, blocks_done, j):
        """Walk step j of this tile counted from the CTA's first tile: what the per-key-block barriers'
        phases (s_full, p_full, p_full_2) and the K/V ring (loads 2 x step, 2 x step + 1) count."""
        if const_expr(self.persistent):
            return blocks_done + j
        return j

    def _scale_step(self, blocks_done, tiles_done, j):
        """scale_full completes at walk steps 1 .. n-1 of every tile: its j-th completion of this tile,
        counted from the CTA's first tile (earlier tiles completed it blocks_done - tiles_done times)."""
        if const_expr(self.persistent):
            return blocks_done - tiles_done + j
        return j

    def _tile_parity(self, tiles_done):
        """The phase parity of the once-per-tile barriers (q_full, final_full, o_full, epi_full)."""
        if const_expr(self.persistent):
            return tiles_done % 2
        return 0

    def _tmem_tensors(self, tmem_ptr, thr_mma_qk, thr_mma_pv, tP_layout):
        """S_i, O_i accumulators and P_i (the TS operand) at the columns of cfg.tmem."""
        tStS_layout = thr_mma_qk.make_fragment_C(thr_mma_qk.partition_shape_C((self.tm, self.tn))).layout
        tOtO_layout = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C((self.tm, self.dv))).layout
        tStS = [cute.make_tensor(tmem_ptr + self.tmem.s[i], tStS_layout) for i in range(self.num_q)]
        tOtO = [cute.make_tensor(tmem_ptr + self.tmem.o[i], tOtO_layout) for i in range(self.num_q)]
        tOrP = None
        if const_expr(tP_layout is not None):
            # make_fragment_A gives the TS operand's layout (16-bit elements, two per column); its
            # iterator is not anchored on our allocation, so re-anchor it at P_i's first column
            tOrP_layout = thr_mma_pv.make_fragment_A(cute.make_tensor(tmem_ptr, tP_layout.outer))[None, None, None, 0].layout
            tOrP = [cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem.p[i], dtype=self.dtype), tOrP_layout)
                    for i in range(self.num_q)]
        return tStS, tOtO, tOrP


# ------------------------------------------------------------------------------------------------
# Host API
# ------------------------------------------------------------------------------------------------
def make_config(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, *, window_size=(None, None),
                softcap: float = 0.0, learnable_sink: bool = False, **kw) -> BlackwellFwdConfig:
    """The plan of one build; the variants (window_size, softcap, learnable_sink: a bool, built for a
    sink) are checked by blackwell_fwd_config (TypeError / ValueError naming the argument). Head dim
    256 takes q_tiles_per_cta=1 (blackwell_config.q_tiles_for; the plan's default, 2, does not fit TMEM)."""
    return blackwell_fwd_config(head_dim, head_dim_v, dtype, causal=causal, window_size=window_size,
                                softcap=softcap, learnable_sink=learnable_sink, **kw)


def _fake_varlen(dtype, dim):
    shape = (cute.sym_int32(), cute.sym_int32(), dim)
    stride = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=16)


def fake_args(cfg: BlackwellFwdConfig, varlen: bool):
    dt = host_io.cutlass_dtype(cfg.dtype)
    d, dv = cfg.head_dim, cfg.head_dim_v
    stream = cute.runtime.make_fake_stream()
    # the variants' arguments: None in builds without them (no kernel parameter)
    score_scale = Float32(1.0) if cfg.softcap else None
    sink = host_io.fake_f32_vector() if cfg.sink else None
    if not varlen:
        return (host_io.fake_bshd(dt, d), host_io.fake_bshd(dt, d), host_io.fake_bshd(dt, dv),
                host_io.fake_bshd(dt, dv), host_io.fake_lse(), Float32(1.0), None, None, None, score_scale, sink,
                stream)
    cu = lambda: cute.runtime.make_fake_tensor(Int32, (cute.sym_int32(),), stride=(1,), assumed_align=4)  # noqa: E731
    lse = cute.runtime.make_fake_tensor(Float32, (cute.sym_int32(), cute.sym_int32()),
                                        stride=(cute.sym_int64(), 1), assumed_align=4)
    return (_fake_varlen(dt, d), _fake_varlen(dt, d), _fake_varlen(dt, dv), _fake_varlen(dt, dv), lse,
            Float32(1.0), cu(), cu(), Int32(1), score_scale, sink, stream)


_CACHE: dict = {}


def compile_sm100(kernel, args) -> tuple:
    """cute.compile for sm_100a, explicitly (``--gpu-arch``), whatever CUTE_DSL_ARCH this process
    has; returns (fn, report, sass, ptx) with the ptxas log parsed by resource_report. Shared by
    the Blackwell forward and stage 4's Blackwell backward."""
    import contextlib
    import io
    import re
    import warnings

    opts = (f"--gpu-arch {TARGET_ARCH} --keep-ptx --keep-cubin --dump-dir {compile_cache.dump_dir()} "
            "remarks{ptx}")
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf), warnings.catch_warnings(), \
            compile_cache.without_source_locations():
        # the 128-value row loops are unrolled on purpose: a thread's row lives in registers, so
        # every index must be a compile-time constant (the DSL suggests a runtime loop instead)
        warnings.filterwarnings("ignore", message=r".*static loop has \d+ iterations")
        fn = cute.compile(kernel, *args, options=opts)
    log = re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue())
    ptx, cubin = fn.__ptx__ or "", fn.__cubin__
    sass = sass_report.disassemble(cubin) if cubin else ""
    return fn, resource_report(log, sass, ptx, cubin), sass, ptx


def compile_config(cfg: BlackwellFwdConfig, varlen: bool = False,
                   scheduler=tile_scheduler.StaticTileScheduler, seqused_k: bool = False,
                   page_size: int | None = None) -> compile_cache.Compiled:
    """Compile for sm_100a with fake tensors, for inspection (the resource report below); `scheduler`
    is the tile order (the StaticTileScheduler interface: stage 5's LPT order for long causal calls),
    or a persistent grid over one (tile_scheduler.PersistentScheduler(order): blackwell_persistent.py);
    seqused_k: a varlen build that takes the keys each sequence uses; page_size: a varlen build that
    reads a paged cache in place (with seqused_k). The launches build the same kernel through
    `compile_launchable_config`. Returns compile_cache.Compiled (fn, report, sass, ptx)."""
    key, build = _build(cfg, varlen, scheduler, seqused_k, page_size, launchable=False)
    if key in _CACHE:
        return _CACHE[key]
    kernel, args = build()
    fn, report, sass, ptx = compile_sm100(kernel, args)
    report.update(smem_bytes=kernel.smem_bytes, threads=kernel.num_threads,
                  tmem_cols_used=cfg.tmem.used, tmem_cols_alloc=cfg.tmem.alloc,
                  regs_softmax=cfg.regs.softmax, regs_correction=cfg.regs.correction, regs_other=cfg.regs.other)
    out = compile_cache.Compiled(fn, report, sass, ptx)
    _CACHE[key] = out
    return out


def compile_launchable_config(cfg: BlackwellFwdConfig, varlen: bool = False,
                              scheduler=tile_scheduler.StaticTileScheduler,
                              seqused_k: bool = False, page_size: int | None = None) -> compile_cache.Compiled:
    """What attention_forward / attention_varlen_forward launch: the kernel compile_config builds,
    compiled with TVM-FFI (`host_io.launch_stream`) through stage 3's compile cache, so the call
    passes torch tensors and Python numbers (`_call_args`) and a store set there (fa4's disk cache)
    keeps the build across processes, as the Hopper forward's. For sm_100a whatever the process
    targets (the kernel's `gpu_arch`)."""
    return compile_cache.compile_cached(*_build(cfg, varlen, scheduler, seqused_k, page_size, launchable=True))


def _build(cfg: BlackwellFwdConfig, varlen: bool, scheduler, seqused_k: bool, page_size, launchable: bool):
    """(cache key, build) of one configuration: build() -> (kernel, fake arguments), the stream TVM-FFI's
    environment stream when launchable (torch's current one at the call), and the optional tail the
    build takes -- a persistent grid's width (any value: a runtime argument), seqused_k (a paged
    build always takes it), a paged build's table."""
    if (seqused_k or page_size is not None) and not varlen:
        raise ValueError(f"{'seqused_k' if seqused_k else 'page_size'}: a varlen build's option (varlen=True)")
    seqused_k = seqused_k or page_size is not None
    key = ((STEP, "gpu") if launchable else ("fake",)) + (cfg.key(), varlen, scheduler) \
        + (("seqused_k",) if seqused_k else ()) + (() if page_size is None else ("paged", page_size))

    def build():  # only on a miss
        kernel = FlashAttentionForwardSm100(cfg, varlen=varlen, scheduler=scheduler, page_size=page_size)
        args = fake_args(cfg, varlen)
        if launchable:
            args = args[:-1] + (host_io.launch_stream(),)
        return kernel, _launch_tail(args, Int32(1) if kernel.persistent else None,
                                    host_io.fake_i32_vector() if seqused_k else None,
                                    host_io.fake_i32_matrix() if page_size is not None else None)
    return key, build


def _call_args(cfg: BlackwellFwdConfig, q, k, v, out, lse, softmax_scale, cu_q=None, cu_k=None, max_seqlen_q=None,
               sink=None, max_ctas=None, seqused_k=None, page_table=None) -> tuple:
    """A launchable build's arguments, in ``__call__`` order without the stream, from torch tensors:
    None where its fake argument was None (no cu_seqlens in a dense build, no score scale without a
    softcap), and the persistent grid's width, seqused_k and the page table last as `_launch_tail` put them."""
    opt = host_io.launch_view
    scale_log2, score_scale = Softcap(cfg.softcap).kernel_scales(softmax_scale)
    args = (opt(q), opt(k), opt(v), out, lse, scale_log2, cu_q, cu_k, max_seqlen_q,
            score_scale if cfg.softcap else None, sink)
    return _launch_tail(args, max_ctas, seqused_k, page_table)


def resource_report(ptxas_log: str, sass: str, ptx: str, cubin) -> dict:
    """sass_report.parse_resources plus what is Blackwell-specific in the PTX and the SASS.

    SASS names (this ptxas, sm_100a): tcgen05.mma kind::f16 -> UTCHMMA (first operand gdesc[..]
    = A from SMEM, "SS"; tmem[..] = A from TMEM, "TS"); tcgen05.commit -> UTCBAR;
    tcgen05.ld / st -> LDTM / STTM; tcgen05.alloc / dealloc / relinquish -> UTCATOMSWS;
    setmaxnreg -> USETMAXREG; TMA load / store -> UTMALDG / UTMASTG."""
    import re

    rep = sass_report.parse_resources(ptxas_log, sass, cubin)

    def count(pat, text):
        return len(re.findall(pat, text)) if text else None
    rep["UTCHMMA"] = count(r"\bUTCHMMA\b", sass)
    rep["UTCHMMA.SS"] = count(r"\bUTCHMMA\s+gdesc\[", sass)
    rep["UTCHMMA.TS"] = count(r"\bUTCHMMA\s+tmem\[", sass)
    rep["UTCBAR"] = count(r"\bUTCBAR\b", sass)
    rep["UTCATOMSWS"] = count(r"\bUTCATOMSWS\b", sass)
    rep["LDTM"] = count(r"\bLDTM\b", sass)
    rep["STTM"] = count(r"\bSTTM\b", sass)
    rep["USETMAXREG"] = count(r"\bUSETMAXREG\b", sass)
    rep["UTMASTG"] = count(r"\bUTMASTG\b", sass)
    for op in ("mma", "alloc", "dealloc", "relinquish_alloc_permit", "commit", "ld", "st"):
        rep[f"ptx_tcgen05.{op}"] = count(rf"\btcgen05\.{op}\.", ptx)
    rep["ptx_st_32x32b.x16"] = count(r"tcgen05\.st\.sync\.aligned\.32x32b\.x16\b", ptx)  # P quarters
    rep["ptx_setmaxnreg"] = re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx) if ptx else None
    m = re.search(r"^\.target\s+(\S+)", ptx or "", re.M)
    rep["ptx_target"] = m.group(1) if m else None
    return rep


REPORT_KEYS = ["threads", "registers", "regs_softmax", "regs_correction", "regs_other", "smem_bytes",
               "tmem_cols_used", "tmem_cols_alloc", "stack_frame", "spill_stores", "spill_loads",
               "UTCHMMA.SS", "UTCHMMA.TS", "LDTM", "STTM", "UTMALDG", "UTMASTG", "MUFU.EX2", "LDL/STL"]


def format_report(name: str, rep: dict) -> str:
    return f"{name}: " + ", ".join(f"{k}={rep.get(k)}" for k in REPORT_KEYS)


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, varlen=False,
                 scheduler=tile_scheduler.StaticTileScheduler, **kw) -> compile_cache.Compiled:
    """Compile for sm_100a with fake tensors (no GPU needed). kw: make_config's, e.g. the variants
    window_size=(left, right), softcap=float, learnable_sink=True (built to take the sink tensor);
    q_tiles_per_cta defaults to what the launch takes (one at d = 256)."""
    kw.setdefault("q_tiles_per_cta", q_tiles_for(head_dim, head_dim if head_dim_v is None else head_dim_v))
    return compile_config(make_config(dtype, head_dim, head_dim_v, causal, **kw), varlen, scheduler=scheduler)


def blackwell_gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10
    except Exception:  # no torch / broken CUDA: compile-only use still works
        return False


def _launch_args(q, k, v, out, lse, softmax_scale, cu_q=None, cu_k=None, max_seqlen_q=None, softcap=0.0,
                 sink=None):
    import torch
    from cuda.bindings import driver as cuda

    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    varlen = cu_q is not None
    # softcap folds the scales around the tanh (components.score_mod); without it score_scale is None
    scale_log2, score_scale = Softcap(softcap).kernel_scales(softmax_scale)
    return (host_io.to_cute(q), host_io.to_cute(k), host_io.to_cute(v), host_io.to_cute(out),
            host_io.to_cute(lse, assumed_align=4), Float32(scale_log2),
            host_io.to_cute(cu_q, assumed_align=4) if varlen else None,
            host_io.to_cute(cu_k, assumed_align=4) if varlen else None,
            Int32(max_seqlen_q) if varlen else None, Float32(score_scale) if softcap else None,
            host_io.to_cute(sink, assumed_align=4) if sink is not None else None, stream)


def _check_variants(q, causal, window_size, softcap, learnable_sink):
    """make_config's variant keywords and the sink tensor (fp32 (Hq,) on q's device, or None),
    checked as the Hopper forward checks them (hopper.host.make_variant: errors name the argument)."""
    import torch

    if not isinstance(q, torch.Tensor) or q.dim() < 3:
        raise TypeError(f"q: expected a torch tensor (..., heads, dim), got {type(q).__name__}")
    variant, sink = make_variant(causal, window_size, softcap, learnable_sink, q.shape[-2], q.device)
    return dict(window_size=tuple(variant.window), softcap=variant.softcap, learnable_sink=variant.sink), sink


@functools.lru_cache(maxsize=256)  # fa4 asks on every dense call; the plan is the same for the same arguments
def persistent_available(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, **variant_kw) -> bool:
    """Whether this configuration has a persistent build (for a router deciding persistent=True):
    head dims up to 128, no learnable sink at head_dim_v = 128 (blackwell_config.persistent_supported).
    variant_kw: make_config's (window_size, softcap, learnable_sink as a bool)."""
    variant_kw.setdefault("q_tiles_per_cta", q_tiles_for(head_dim, head_dim_v))
    return make_config(dtype, head_dim, head_dim_v, causal, **variant_kw).persistent_supported is None


def default_persistent(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, window_size=(None, None),
                       softcap: float = 0.0, learnable_sink: bool = False) -> bool:
    """Whether a dense call of this configuration runs on persistent CTAs by default: where the official
    sm100 forward runs its static persistent schedule -- neither causal nor a window -- and only where the
    build exists (`persistent_available`). fa4's route and `compile_launchable` both ask here."""
    if causal or make_window(False, window_size) != NO_WINDOW:  # (-1, -1) is no window too
        return False
    return persistent_available(dtype, head_dim, head_dim_v, False, softcap=softcap,
                                learnable_sink=bool(learnable_sink))


def compile_launchable(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, *, varlen=False,
                       seqused_k=False, scheduler=None, seqlen_k=None, window_size=(None, None),
                       softcap: float = 0.0, learnable_sink: bool = False, tile_m=None) -> list:
    """What attention_forward (varlen=True: attention_varlen_forward) launches for this configuration
    under fa4's route, compiled without a GPU under the launch's cache key (TVM-FFI, fake tensors, for
    sm_100a whatever the process targets): a list of one Compiled. Dense calls: `scheduler` if given
    (fa4's LPT order for long causal calls), else persistent CTAs where `default_persistent` says so,
    else the static grid; varlen calls `scheduler` or the static grid. seqlen_k: accepted for the Hopper module's
    signature -- no Blackwell build depends on the key count but through `scheduler`. tile_m: the tile
    is fixed here, so only None. With fa4's disk cache installed this fills it on a CPU machine
    (python -m fa4 precompile --arch sm_100a)."""
    if tile_m is not None:
        raise ValueError(f"tile_m: the Blackwell forward's query tile is fixed (128 rows a tile), got {tile_m}")
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    variant = dict(window_size=tuple(window_size), softcap=softcap, learnable_sink=bool(learnable_sink))
    cfg = make_config(dtype, head_dim, head_dim_v, causal, q_tiles_per_cta=q_tiles_for(head_dim, head_dim_v),
                      **variant)
    persistent = not varlen and scheduler is None and default_persistent(dtype, head_dim, head_dim_v, causal,
                                                                         **variant)
    return [compile_launchable_config(cfg, varlen, _persistent_scheduler(scheduler, persistent), seqused_k)]


def _persistent_scheduler(scheduler, persistent: bool):
    """The call's scheduler: `scheduler` (None: the static grid), walked by one CTA per SM when
    persistent=True (a scheduler that is persistent itself is used as it is)."""
    if not isinstance(persistent, bool):
        raise TypeError(f"persistent: expected a bool, got {type(persistent).__name__}")
    scheduler = scheduler or tile_scheduler.StaticTileScheduler
    if persistent and not getattr(scheduler, "persistent", False):
        scheduler = tile_scheduler.PersistentScheduler(scheduler)
    return scheduler


def _launch_tail(args, grid_width, seqused_k, page_table=None):
    """`args` (through the stream) and the launch's optional trailing arguments, ``__call__``'s last three:
    a persistent build's grid width, a seqused_k build's tensor, a paged build's table -- up to the last
    one the build takes (a None before it stands for an absent one)."""
    tail = [grid_width, seqused_k, page_table]
    while tail and tail[-1] is None:
        tail.pop()
    return args + tuple(tail)


def _grid_width(scheduler, device):
    """A persistent build's launch also takes its grid's width: the device's SMs (or num_ctas); None
    for a grid of one CTA a tile."""
    return int(scheduler.launch_ctas(device)) if getattr(scheduler, "persistent", False) else None


def attention_forward(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                      learnable_sink=None, out=None, lse=None, scheduler=None, persistent: bool = False, **cfg_kw):
    """q (B,Sq,Hq,D), k (B,Sk,Hkv,D), v (B,Sk,Hkv,Dv) CUDA fp16/bf16 on a Blackwell GPU ->
    (out (B,Sq,Hq,Dv), lse (B,Hq,Sq) fp32). scheduler: the tile order (None: the static grid; fa4
    passes stage 5's LPT order for long causal calls), or tile_scheduler.PersistentScheduler(order)
    for one CTA per SM walking that order (blackwell_persistent.py; static striding, head dims <= 128);
    persistent=True wraps `scheduler` so. Variants as the Hopper forward's: window_size
    (left, right), softcap, learnable_sink (Hq,) floating. UNVERIFIED: never run on hardware here."""
    # every argument is checked before the GPU check (errors name the argument; devices come after it)
    variants, sink = _check_variants(q, causal, window_size, softcap, learnable_sink)
    scheduler = _persistent_scheduler(scheduler, persistent)
    host_io.check_dense_shapes(q, k, v)
    b, sq, hq, d = q.shape
    dv = v.shape[-1]
    cfg_kw.setdefault("q_tiles_per_cta", q_tiles_for(d, dv))  # one Q tile at d = 256
    cfg = make_config(str(q.dtype), d, dv, causal, **variants, **cfg_kw)  # ValueError before any compile
    tile_scheduler.check_grid(scheduler, -(-sq // cfg.cta_tile_m), hq, b)
    softmax_scale = host_io.check_scale(softmax_scale, d)
    out, lse = _outputs(out, lse, (b, sq, hq, dv), (b, hq, sq), q)
    if not blackwell_gpu_available():
        raise RuntimeError("attention_forward needs a Blackwell (sm_100) GPU; use compile_only() elsewhere")
    q, k, v = host_io.dense_on_cuda(q, k, v)
    if b == 0 or sq == 0 or hq == 0:
        return out, lse
    if k.shape[1] == 0:
        return _nothing_visible(out, lse, sink, head_dim=1)
    comp = compile_launchable_config(cfg, False, scheduler)
    comp.fn(*_call_args(cfg, q, k, v, out, lse, softmax_scale, sink=sink, max_ctas=_grid_width(scheduler, q.device)))
    return out, lse


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, *, seqused_k=None,
                             softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                             learnable_sink=None, out=None, lse=None, scheduler=None, persistent: bool = False,
                             page_table=None, **cfg_kw):
    """Packed q (Tq,Hq,D), k/v (Tk,Hkv,*), int32 cu_seqlens (B+1,) -> (out (Tq,Hq,Dv), lse (Hq,Tq)).
    seqused_k: int32 (B,) on q's device, or None: sequence b attends to the first seqused_k[b] keys
    from cu_seqlens_k[b] (at most its cu_seqlens_k length: the caller's contract, not checked here,
    which would synchronize). Variants, scheduler and persistent as attention_forward's (the grid's
    tiles run over max_seqlen_q; tiles past a shorter sequence are skipped). page_table int32 (B, pages):
    k / v are a paged cache (num_pages, page_size, Hkv, *) read in place, page_size a multiple of 128 or
    16, 32, 64 (blackwell_config.pages_in_place); seqused_k is then required and cu_seqlens_k holds
    each sequence's first logical key, a multiple of 128 (None: 0). UNVERIFIED: never run on hardware here."""
    # every argument is checked before the GPU check (errors name the argument; devices come after it)
    variants, sink = _check_variants(q, causal, window_size, softcap, learnable_sink)
    scheduler = _persistent_scheduler(scheduler, persistent)
    page_size = None
    if page_table is not None:  # the cache's shapes and the table checked, then the page size
        k, v, cu_seqlens_k, page_size, page_table = paged_cache_inputs(k, v, page_table, cu_seqlens_q, cu_seqlens_k,
                                                                       seqused_k, TILE_N)
        check_blackwell_page_size(page_size, TILE_N, True, getattr(scheduler, "persistent", False),
                                  (q.shape[-1], v.shape[-1]))
    # this entry takes no max_seqlen_k (0 stands in for the shared check's)
    host_io.check_varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, 0, seqused_k=seqused_k)
    d, dv = q.shape[-1], v.shape[-1]
    cfg_kw.setdefault("q_tiles_per_cta", q_tiles_for(d, dv))  # one Q tile at d = 256
    cfg = make_config(str(q.dtype), d, dv, causal, **variants, **cfg_kw)
    softmax_scale = host_io.check_scale(softmax_scale, d)
    out, lse = _outputs(out, lse, (q.shape[0], q.shape[1], dv), (q.shape[1], q.shape[0]), q)
    if not blackwell_gpu_available():
        raise RuntimeError("attention_varlen_forward needs a Blackwell (sm_100) GPU")
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, _ = host_io.varlen_on_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                                              seqused_k=seqused_k)
    if q.shape[0] == 0 or max_seqlen_q == 0:
        return out, lse
    if k.shape[0] == 0:  # no sequence has a key (and a TMA map cannot have a 0 extent)
        return _nothing_visible(out, lse, sink, head_dim=0)
    comp = compile_launchable_config(cfg, True, scheduler, seqused_k is not None, page_size)
    comp.fn(*_call_args(cfg, q.contiguous(), k.contiguous(), v.contiguous(), out, lse, softmax_scale, cu_seqlens_q,
                        cu_seqlens_k, max_seqlen_q, sink=sink, max_ctas=_grid_width(scheduler, q.device),
                        seqused_k=seqused_k, page_table=page_table))
    return out, lse


def run(batch=2, seqlen_q=1024, seqlen_k=1024, heads=8, heads_kv=None, head_dim=128, head_dim_v=None,
        causal=False, dtype="bf16", varlen=False, check=True, verbose=True, persistent=False) -> dict:
    """On a Blackwell GPU (capability 10.x): check against the stage-0 reference (FA4 rule) and time.
    Anywhere else: compile for sm_100a and print the resource report (the only mode ever exercised
    in this project: there is no Blackwell GPU here). persistent: one CTA per SM (blackwell_persistent)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    heads_kv = heads if heads_kv is None else heads_kv
    cfg = make_config(dtype, head_dim, head_dim_v, causal, q_tiles_per_cta=q_tiles_for(head_dim, head_dim_v))
    if not blackwell_gpu_available():
        comp = compile_config(cfg, varlen, scheduler=_persistent_scheduler(None, persistent))
        if verbose:
            print(format_report(f"{STEP} [{TARGET_ARCH}, {dtype}, d={head_dim}/{head_dim_v}, causal={causal}, "
                                f"varlen={varlen}, persistent={persistent}] (no Blackwell GPU: compiled only, "
                                f"never run)", comp.report))
        return {"step": STEP, "mode": "compile-only", "report": comp.report, "config": cfg}

    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref, attention_varlen_ref

    tdt = host_io.torch_dtype(dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    if not varlen:
        q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=tdt, generator=gen)
        k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=tdt, generator=gen)
        v = torch.randn(batch, seqlen_k, heads_kv, head_dim_v, device="cuda", dtype=tdt, generator=gen)
        fwd = lambda: attention_forward(q, k, v, causal=causal, persistent=persistent)  # noqa: E731
        ref = lambda up: attention_ref(q, k, v, causal=causal, upcast=up)  # noqa: E731
    else:  # `batch` sequences of lengths up to seqlen_q / seqlen_k
        lq = torch.randint(1, seqlen_q + 1, (batch,), generator=torch.Generator().manual_seed(1))
        lk = torch.randint(1, seqlen_k + 1, (batch,), generator=torch.Generator().manual_seed(2))
        cu_q = torch.cat([torch.zeros(1, dtype=torch.int32), lq.cumsum(0).int()]).cuda()
        cu_k = torch.cat([torch.zeros(1, dtype=torch.int32), lk.cumsum(0).int()]).cuda()
        total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
        q = torch.randn(total_q, heads, head_dim, device="cuda", dtype=tdt, generator=gen)
        k = torch.randn(total_k, heads_kv, head_dim, device="cuda", dtype=tdt, generator=gen)
        v = torch.randn(total_k, heads_kv, head_dim_v, device="cuda", dtype=tdt, generator=gen)
        fwd = lambda: attention_varlen_forward(q, k, v, cu_q, cu_k, int(lq.max()), causal=causal,  # noqa: E731
                                               persistent=persistent)
        ref = lambda up: attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, upcast=up)  # noqa: E731
    out, lse = fwd()
    torch.cuda.synchronize()
    if check:
        (ref_o, ref_lse), (base_o, base_lse) = ref(True), ref(False)
        assert_fa4_close(f"{STEP} out", out, ref_o, base_o)
        assert_fa4_close(f"{STEP} lse", lse, ref_lse, base_lse)
    ms = runner.benchmark_ms(fwd)
    if not varlen:
        flops = runner.attention_flops(batch, seqlen_q, seqlen_k, heads, head_dim, head_dim_v, causal)
    else:  # the same convention, summed over the packed sequences
        flops = sum(runner.attention_flops(1, int(a), int(b), heads, head_dim, head_dim_v, causal)
                    for a, b in zip(lq, lk))
    tflops = flops / (ms * 1e-3) / 1e12
    if verbose:
        print(f"{'PASS' if check else '(unchecked)'} {STEP} b={batch} sq={seqlen_q} sk={seqlen_k} varlen={varlen} "
              f"h={heads}/{heads_kv} d={head_dim}/{head_dim_v} causal={causal} {dtype}: {ms:.3f} ms, "
              f"~{tflops:.1f} TFLOP/s")
    return {"step": STEP, "mode": "gpu", "ms": ms, "tflops": tflops}


MATRIX = [(dt, d, dv, causal, varlen) for varlen in (False, True) for dt in ("bf16", "fp16")
          for d, dv in SUPPORTED_HEAD_DIMS for causal in (False, True)]


# d = 256: one Q tile per CTA (blackwell_config.ONE_Q_TILE_HEAD_DIMS)
MATRIX_ONE_Q_TILE = [(dt, 256, 256, causal, varlen) for varlen in (False, True) for dt in ("bf16", "fp16")
                     for causal in (False, True)]


def resource_table(cases=MATRIX) -> str:
    """Markdown: one row per compiled configuration (what the Blackwell section of README.md shows)."""
    lines = ["| dtype | d / dv | causal | varlen | SMEM B | TMEM cols | K/V slots | spills (st/ld) | "
             "LDL/STL | UTCHMMA SS / TS | LDTM / STTM | MUFU.EX2 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for dt, d, dv, causal, varlen in cases:
        cfg = make_config(dt, d, dv, causal, q_tiles_per_cta=q_tiles_for(d, dv))
        r = compile_config(cfg, varlen).report
        lines.append(f"| {dt} | {d} / {dv} | {causal} | {varlen} | {r['smem_bytes']} | "
                     f"{cfg.tmem.used} / {cfg.tmem.alloc} | {cfg.kv_stages} | {r['spill_stores']} / {r['spill_loads']} | "
                     f"{r['LDL/STL']} | {r['UTCHMMA.SS']} / {r['UTCHMMA.TS']} | {r['LDTM']} / {r['STTM']} | "
                     f"{r['MUFU.EX2']} |")
    return "\n".join(lines)


def compare_with_official(head_dim: int = 128, causal: bool = False, dtype: str = "bf16") -> dict:
    """blackwell_compare.compare for this kernel's build of (dtype, head_dim, causal), not varlen:
    per-role loop counts of ours and, when flash-attn-4 is installed, of the official forward."""
    from stage3_fwd_kernel import blackwell_compare

    cfg = make_config(dtype, head_dim, head_dim, causal)
    return blackwell_compare.compare(head_dim, causal, dtype, ours_sass=compile_config(cfg).sass,
                                     tile_n=cfg.tile_n)


def compare_table(head_dim: int = 128, dtype: str = "bf16") -> str:
    """Markdown: ours against the official forward, non-causal and causal (blackwell_compare)."""
    from stage3_fwd_kernel import blackwell_compare

    results = [compare_with_official(head_dim, causal, dtype) for causal in (False, True)]
    return blackwell_compare.format_table(results)


if __name__ == "__main__":
    ap = runner.shape_parser(__doc__)
    ap.add_argument("--varlen", action="store_true")
    ap.add_argument("--persistent", action="store_true", help="one CTA per SM walking the tiles (blackwell_persistent)")
    ap.add_argument("--all", action="store_true", help="compile every supported configuration for sm_100a "
                    "and print the resource table (markdown)")
    ap.add_argument("--compare", action="store_true", help="our steady-state loops against the official "
                    "flash-attn-4 forward's, in SASS, at --head_dim / --dtype, non-causal and causal (markdown)")
    a = ap.parse_args()
    if a.all:
        print(resource_table(MATRIX + MATRIX_ONE_Q_TILE))
    elif a.compare:
        from stage3_fwd_kernel import blackwell_compare

        if blackwell_compare.official_missing():
            print(f"official kernel left out: {blackwell_compare.official_missing()}")
        print(compare_table(a.head_dim, a.dtype))
    else:
        run(**runner.shape_kwargs(a), varlen=a.varlen, persistent=a.persistent)
