"""Stage 4, Blackwell (sm_100a): the 2-CTA FA4 backward -- a cluster of two CTAs runs every MMA as
one CTA-pair tcgen05 MMA. COMPILED AND INSPECTED ONLY: no Blackwell GPU is reachable from this
project; this kernel has never run (stage4_bwd_kernel/README.md, "Blackwell").

Compared with the 1-CTA kernel (blackwell_bwd.py), this adds the CTA-pair MMA (M = 256), because the
1-CTA backward is bound by shared memory, not by the tensor core. Per 128 x 128 tile at d = 128
(roofline.paper_table(), B200 cycles): the five MMAs cost 2560 cycles, but feeding them costs 3328
SMEM cycles -- 2048 for the eight SMEM operands, 256 to write dS, 1024 for the dQ round trip. A pair
MMA splits its B operand by N across the two CTAs, so each CTA stages and reads only half of B:
operand traffic drops to 1536, and dQ, now owned half per CTA, to 512. The price is the dS exchange
below, 384 cycles (three passes over 16 KB: stage, read, write to the peer):
1536 + 256 + 384 + 512 = 2688 SMEM cycles per tile, 5% above the MMA time instead of 30%.
(The paper's dQ term is an SMEM write + TMA reduce; this kernel, like the 1-CTA one, drains dQ from
TMEM with register atomics, so that term becomes d/4 instead of d/2 8-byte REDs per thread.)

The pair (cluster (2, 1, 1), CTA rank c = blockIdx.x % 2) owns 256 keys; CTA c owns keys
[128c, 128c + 128) -- its K, V tiles, its rows of S^T, dP^T, P^T, dS^T, dV, dK, all in its own TMEM
and SMEM, exactly as in the 1-CTA kernel. Both walk the same Q tiles (128 queries):

    S^T  = K Q^T      pair MMA, M = 256 keys, N = 128 queries  (each CTA stages 64 queries of Q)
    dP^T = V dO^T     pair MMA, M = 256, N = 128               (64 queries of dO per CTA)
    dV  += P^T dO     pair MMA, A = P^T from TMEM, N = dv       (dv/2 columns of dO per CTA)
    dK  += dS^T Q     pair MMA, A = dS^T from TMEM, N = d       (d/2 columns of Q per CTA)
    dQ   = dS K       pair MMA, M = 128 queries (64 per CTA), N = d (d/2 of K per CTA), K = 256 keys

dQ reduces over keys, and the keys are split across the pair. So each CTA sends the peer the half of
its dS (64 query rows x its 128 keys) whose query rows the peer owns: through SMEM staging and one
``cp.async.bulk.shared::cluster`` that completes on an mbarrier in the peer (the paper's Figure,
"2-CTA backward dQ step"). Then each CTA holds 64 query rows x all 256 keys, the dQ MMA reduces over
2N = 256, and each CTA drains and atomically adds its own 64 rows: half the atomics of a CTA.

Pipeline (the paper's reordering; one MMA thread in the even CTA issues for both):

    S(j), dK(j-1), dP(j), dQ(j-1), dV(j)

dP of tile j runs before dQ of tile j-1, so the elementwise dS of tile j overlaps the dQ MMA of tile
j-1 and the DSMEM exchange has a tile to land. dQ therefore cannot live over dP^T (the 1-CTA plan);
it shares the S/P region with P^T (blackwell_config, Bwd2CtaTmemPlan).

Roles per CTA (12 warps, as in the 1-CTA kernel; setmaxnreg 240 / 136 / 128):
* WG 0, elementwise (thread r = key r): as in the 1-CTA kernel (shared helpers), plus the dS split:
  its own 64 query rows -> sdS, the peer's 64 -> sXchg, one thread bulk-copies sXchg to the peer.
  All its signals to the MMA go to the even CTA's barriers (remote ``mbarrier.arrive`` from CTA 1).
* warp 4: in CTA 0 the MMA warp; in CTA 1 the relay (waits its own xchg_full, arrives on CTA 0's
  xchg_peer, so CTA 0 knows both halves of the exchange landed). Both allocate / free TMEM together.
* warp 5, load: K, V, Kt once; Q, dO, dOt, Qt per Q tile with 2-SM TMA (``cta_group::2``): each CTA
  loads its halves, the transfer completes on CTA 0's barrier (CTA 0 expects the bytes of both).
* WG 2, dQ drain: 128 lanes x d/2 columns (lane l: query row 64c + l % 64, columns of head-dim half
  l // 64) -> registers, dq_empty, then ``red.global.add.v2.f32``; deterministic: the stage-4 semaphores, one counter per dQ
  tile, rank per pair (``schedule`` orders over 256-key pairs; both CTAs wait for 2 x rank).

Barriers (count per phase; "leader" = CTA 0, the only one whose copy is waited on):
    kv_full, q/do/qt/dot_full[s]  2-SM TMA -> MMA (leader; expects both CTAs' bytes)     1 + tx
    q/do/qt/dot_empty[s]          MMA commit, multicast to both CTAs -> load warps       1
    s_full, dp_full, dq_full, dkv_full   MMA commit, multicast -> WG 0 / WG 2              1
    p_full, dst_full, ds_full     WG 0 of each CTA (named barrier, one thread) -> MMA    2
    dq_empty                      WG 2 of each CTA (named barrier, one thread) -> MMA    2
    xchg_full                     the peer's bulk copy of dS rows -> this CTA            1 + 16 KB tx
    xchg_peer                     CTA 1's relay -> MMA (leader)                          1
    tmem_dealloc                  WG 0 + WG 2 -> warp 4 (then the allocator's pair barrier)  256

Scheduling: pairs, not CTAs, are ordered. ``dq_order.n_block_for_launch(blockIdx.x // 2, pairs)``
gives the pair's 256-key block, ``schedule.m_block_range`` / ``n_block_last`` are called with
tile_n = 256 (the pair acts as one K/V tile), and ``dq_order.rank`` ranks pairs. With the causal
default (``KVDescendingOrder``, the paper's SPT order) the shortest pairs, at the end of the keys,
launch first, each walks Q tiles upward from its diagonal, and every dQ tile receives its pairs in
descending key order -- so a pair's first dQ add does not wait.

Not implemented (README): varlen / seqused_k, head dims other than 64 and 128, a persistent
scheduler, a second sdS buffer (does not fit next to sXchg at d = 128), dQ through SMEM + TMA reduce.
"""
from __future__ import annotations

import re

import cutlass
import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator
from cutlass.pipeline import NamedBarrier

from stage3_fwd_kernel import compile_cache
from stage3_fwd_kernel.blackwell_fwd import tcgen05_fence_after_sync, tcgen05_fence_before_sync
from stage4_bwd_kernel import blackwell_bwd as _one
from stage4_bwd_kernel import common, schedule
from stage4_bwd_kernel.blackwell_bwd import BAR_TMEM_ALLOC, LOAD_WARP, MMA_WARP, FlashAttentionBackwardSm100
from stage4_bwd_kernel.blackwell_dq import BAR_DQ
from stage4_bwd_kernel.blackwell_config import BlackwellBwdConfig, blackwell_bwd_2cta_config

STEP = "blackwell_bwd_2cta"
BAR_EW = 4            # WG 0: all 128 threads done (TMEM stores, sdS / sXchg writes) before one signals
PAIR = 2
BOTH = 0b11           # multicast mask: both CTAs of the cluster
BARRIERS = ("kv_full", "s_full", "dp_full", "p_full", "dst_full", "ds_full", "dq_full", "dq_empty", "dkv_full",
            "xchg_full", "xchg_peer", "tmem_dealloc", "tmem_pair")
STAGED = ("q_full", "q_empty", "do_full", "do_empty", "qt_full", "qt_empty", "dot_full", "dot_empty")
CLUSTER_SCOPE = nvvm.MemScopeKind.CLUSTER


class PairGeometry:
    """Where a CTA's share of the pair's operands lies: the five CTA-pair tiled MMAs, the dQ MMA's dS
    operand and its columns, the exchange's landing offset, and the dQ drain's rows and columns (host
    and device code of the 2-CTA kernel read them; blackwell_2cta_check rebuilds the MMAs)."""

    def pair_mmas(self):
        """The five CTA-pair tiled MMAs: S^T, dP^T, dV, dK, dQ (blackwell_2cta_check rebuilds them)."""
        K_, MN_ = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        two, dt, m2 = tcgen05.CtaGroup.TWO, self.dtype, PAIR * self.tn
        d, dv, tm = self.d, self.dv, self.tm
        mma_s = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, K_, Float32, two, (m2, tm))
        mma_dp = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, K_, Float32, two, (m2, tm))
        mma_dv = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, MN_, Float32, two, (m2, dv), tcgen05.OperandSource.TMEM)
        mma_dk = sm100_utils.make_trivial_tiled_mma(dt, dt, K_, MN_, Float32, two, (m2, d), tcgen05.OperandSource.TMEM)
        mma_dq = sm100_utils.make_trivial_tiled_mma(dt, dt, MN_, MN_, Float32, two, (tm, d))
        return mma_s, mma_dp, mma_dv, mma_dk, mma_dq

    def sds_layout(self, mma_dq):
        """sdS, the dQ MMA's A operand in one CTA: 64 query rows x the pair's 256 keys."""
        return sm100_utils.make_smem_layout_a(mma_dq, (self.tm, self.d, PAIR * self.tn), self.dtype, 1)

    def ds_column(self, t, key):
        """Column `key` (0..255) of an sdS-shaped tensor: the 64 query rows of one key."""
        return t[((None, key % 16), 0, key // 16, 0)]

    def xchg_dst_offset(self, rank):
        """Where CTA `rank`'s sXchg lands in the peer's sdS: key column 128 x rank, in elements."""
        return rank * (self.xchg_bytes // 2)

    def dq_row(self, rank, tidx, m_block):
        """Global query row that dQ drain thread `tidx` (TMEM lane tidx) of CTA `rank` adds."""
        return m_block * self.tm + rank * (self.tm // 2) + tidx % (self.tm // 2)

    def dq_col0(self, tidx):
        """First head-dim column of drain thread `tidx` (lanes 64..127 hold the upper half)."""
        return (tidx // (self.tm // 2)) * (self.d // 2)


class FlashAttentionBackwardSm100TwoCta(PairGeometry, FlashAttentionBackwardSm100):
    """The 2-CTA backward for one 2-CTA BlackwellBwdConfig (blackwell_bwd_2cta_config). Reuses the
    1-CTA kernel's elementwise helpers (stats, exp2 row, 16-bit TMEM stores, dK/dV epilogue) and gemm."""

    def __init__(self, config: BlackwellBwdConfig, dq_order=None):
        if config.cta_group != 2:
            raise ValueError("FlashAttentionBackwardSm100TwoCta needs a 2-CTA plan (blackwell_bwd_2cta_config)")
        super().__init__(config, dq_order=dq_order)
        self.xchg_bytes = (self.tm // 2) * self.tn * 2      # 64 query rows x 128 keys, 16-bit

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor,
                 mSemaphore: cute.Tensor, num_n_blocks: Int32, softmax_scale_log2: Float32,
                 softmax_scale: Float32, stream):
        """The 1-CTA kernel's arguments (host.fake_main_args / main_args); num_n_blocks counts 128-key
        tiles, the grid is rounded up to pairs. Dense only."""
        d, dv, tm, tn = self.d, self.dv, self.tm, self.tn
        mQ, mK, mV, mdO, mdQacc, mdK, mdV = self.aligned(mQ, mK, mV, mdO, mdQacc, mdK, mdV)
        # (seq, dim, head, batch): B operands with N = queries (S^T, dP^T), A operands K, V
        rows = [1, 3, 2, 0]
        tQ, tK, tV, tdO = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=rows)) for t in (mQ, mK, mV, mdO)]
        # (dim, seq, head, batch): B operands with N = head dim (dK, dV, dQ), MN-major
        cols = [3, 1, 2, 0]
        tQt, tKt, tdOt = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=cols)) for t in (mQ, mK, mdO)]

        dt, m2 = self.dtype, PAIR * tn
        mma_s, mma_dp, mma_dv, mma_dk, mma_dq = self.pair_mmas()
        tiler_s, tiler_dp = (m2, tm, d), (m2, tm, dv)
        tiler_dv, tiler_dk, tiler_dq = (m2, dv, tm), (m2, d, tm), (tm, d, m2)
        # dQ's per-CTA accumulator: 64 rows as 128 lanes x d/2 columns (lane l: row l % 64, half l // 64);
        # the drain warpgroup relies on exactly this map
        dq_frag = mma_dq.make_fragment_C(mma_dq.partition_shape_C((tm, d))).layout
        expect = f"((64,({d // 2},2)),1,1):((65536,(1,{64 << 16})),0,0)"
        if const_expr(str(dq_frag) != expect):
            raise ValueError(f"unexpected TMEM layout of the 2-CTA dQ accumulator: {dq_frag} (expected {expect})")

        st = self.stages
        sK_layout = sm100_utils.make_smem_layout_a(mma_s, tiler_s, dt, 1)        # own 128 keys x d
        sV_layout = sm100_utils.make_smem_layout_a(mma_dp, tiler_dp, dt, 1)
        sQ_layout = sm100_utils.make_smem_layout_b(mma_s, tiler_s, dt, st)       # 64 queries x d
        sdO_layout = sm100_utils.make_smem_layout_b(mma_dp, tiler_dp, dt, st)    # 64 queries x dv
        sQt_layout = sm100_utils.make_smem_layout_b(mma_dk, tiler_dk, dt, st)    # d/2 x 128 queries
        sdOt_layout = sm100_utils.make_smem_layout_b(mma_dv, tiler_dv, dt, st)   # dv/2 x 128 queries
        sKt_layout = sm100_utils.make_smem_layout_b(mma_dq, tiler_dq, dt, 1)     # d/2 x 256 keys
        sdS_layout = self.sds_layout(mma_dq)                                     # 64 queries x 256 keys
        tP_layout = sm100_utils.make_smem_layout_a(mma_dv, tiler_dv, dt, 1)
        tdS_layout = sm100_utils.make_smem_layout_a(mma_dk, tiler_dk, dt, 1)
        if const_expr(cute.cosize(sdS_layout.outer) * dt.width // 8 != 2 * self.xchg_bytes):
            raise ValueError("sdS must hold 2 x the exchanged half (64 rows x 256 keys)")

        cluster = cute.tiled_divide(cute.make_layout((PAIR, 1, 1)), (mma_s.thr_id.shape,)).shape
        # 2-SM TMA: completes on the even CTA's barrier
        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.TWO)
        sel = lambda L: cute.select(L, mode=[0, 1, 2])  # noqa: E731
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_A(g2s, tK, sel(sK_layout), tiler_s, mma_s, cluster)
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_A(g2s, tV, sel(sV_layout), tiler_dp, mma_dp, cluster)
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_B(g2s, tQ, sel(sQ_layout), tiler_s, mma_s, cluster)
        tma_atom_dO, tma_dO = cute.nvgpu.make_tiled_tma_atom_B(g2s, tdO, sel(sdO_layout), tiler_dp, mma_dp, cluster)
        tma_atom_Qt, tma_Qt = cute.nvgpu.make_tiled_tma_atom_B(g2s, tQt, sel(sQt_layout), tiler_dk, mma_dk, cluster)
        tma_atom_dOt, tma_dOt = cute.nvgpu.make_tiled_tma_atom_B(g2s, tdOt, sel(sdOt_layout), tiler_dv, mma_dv,
                                                                 cluster)
        tma_atom_Kt, tma_Kt = cute.nvgpu.make_tiled_tma_atom_B(g2s, tKt, sel(sKt_layout), tiler_dq, mma_dq, cluster)
        nbytes = lambda L: cute.size_in_bytes(dt, sel(L))  # noqa: E731
        # the even CTA expects the bytes of both CTAs' halves
        self.tx = {"kv": PAIR * (nbytes(sK_layout) + nbytes(sV_layout) + nbytes(sKt_layout)),
                   "q": PAIR * nbytes(sQ_layout), "do": PAIR * nbytes(sdO_layout),
                   "qt": PAIR * nbytes(sQt_layout), "dot": PAIR * nbytes(sdOt_layout)}

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.cfg.smem.num_barriers]
            tmem_addr: Int32
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sV_layout)], 1024]
            sKt: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sKt_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdO_layout)], 1024]
            sQt: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sQt_layout)], 1024]
            sdOt: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdOt_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdS_layout)], 1024]
            sXchg: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sdS_layout) // 2], 1024]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, tm], 16]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, tm], 16]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        grid = (PAIR * ((num_n_blocks + 1) // 2), mK.shape[2], mK.shape[0])
        self.kernel(tma_K, tma_V, tma_Kt, tma_Q, tma_dO, tma_Qt, tma_dOt,
                    tma_atom_K, tma_atom_V, tma_atom_Kt, tma_atom_Q, tma_atom_dO, tma_atom_Qt, tma_atom_dOt,
                    mLSE2, mD, mdQacc, mdK, mdV, mSemaphore, num_n_blocks, mQ.shape[1], mK.shape[1],
                    mQ.shape[2] // mK.shape[2], softmax_scale_log2, softmax_scale,
                    mma_s, mma_dp, mma_dv, mma_dk, mma_dq,
                    sK_layout, sV_layout, sKt_layout, sQ_layout, sdO_layout, sQt_layout, sdOt_layout,
                    sdS_layout, tP_layout, tdS_layout,
                    ).launch(grid=grid, block=[self.num_threads, 1, 1], cluster=(PAIR, 1, 1), stream=stream,
                             min_blocks_per_mp=1)

    # ------------------------------------------------------------------ device side
    def _bar(self, mbar, name, i=0):
        if name in STAGED:
            return mbar + len(BARRIERS) + STAGED.index(name) * self.stages + i
        return mbar + BARRIERS.index(name)

    def _commit(self, bar):
        """tcgen05.commit from the MMA thread, arriving on `bar` in both CTAs once the pair's MMAs
        issued so far have completed."""
        with cute.arch.elect_one():
            tcgen05.commit(bar, BOTH, tcgen05.CtaGroup.TWO)

    def _arrive_leader(self, bar):
        """Arrive on the even CTA's copy of `bar` (mapa'd; remote from CTA 1) with release at cluster
        scope, so this CTA's earlier writes are visible to the MMA thread there."""
        cute.arch.mbarrier_arrive(bar, Int32(0), scope=CLUSTER_SCOPE)

    @cute.jit
    def _signal_leader(self, bar: cute.Pointer, tidx: Int32, barrier_id: cutlass.Constexpr[int]):
        """A warpgroup's 'done' to the MMA thread: a named barrier over its 128 threads, then one
        cluster-scope release arrive (the barrier makes every thread's writes precede it; one
        release instead of 128: a cluster-scope release is a MEMBAR in SASS). `bar` counts 2: one
        arrival per CTA."""
        cute.arch.barrier(barrier_id=barrier_id, number_of_threads=128)
        if tidx == 0:
            self._arrive_leader(bar)

    @cute.kernel
    def kernel(self, tma_K: cute.Tensor, tma_V: cute.Tensor, tma_Kt: cute.Tensor, tma_Q: cute.Tensor,
               tma_dO: cute.Tensor, tma_Qt: cute.Tensor, tma_dOt: cute.Tensor,
               tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom, tma_atom_Kt: cute.CopyAtom,
               tma_atom_Q: cute.CopyAtom, tma_atom_dO: cute.CopyAtom, tma_atom_Qt: cute.CopyAtom,
               tma_atom_dOt: cute.CopyAtom, mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mSemaphore: cute.Tensor, num_n_blocks: Int32,
               seqlen_q: Int32, seqlen_k: Int32, qhead_per_kvhead: Int32, softmax_scale_log2: Float32,
               softmax_scale: Float32, mma_s: cute.TiledMma, mma_dp: cute.TiledMma, mma_dv: cute.TiledMma,
               mma_dk: cute.TiledMma, mma_dq: cute.TiledMma,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, sKt_layout: cute.ComposedLayout,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout, sQt_layout: cute.ComposedLayout,
               sdOt_layout: cute.ComposedLayout, sdS_layout: cute.ComposedLayout, tP_layout: cute.ComposedLayout,
               tdS_layout: cute.ComposedLayout):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(warp_idx // 4)
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        storage = SmemAllocator().allocate(self.shared_storage)
        mbar = storage.mbar.data_ptr()
        if warp_idx == LOAD_WARP:
            for atom in (tma_atom_K, tma_atom_V, tma_atom_Kt, tma_atom_Q, tma_atom_dO, tma_atom_Qt, tma_atom_dOt):
                cpasync.prefetch_descriptor(atom)
        if warp_idx == 0:
            with cute.arch.elect_one():
                for name, count in (("kv_full", 1), ("s_full", 1), ("dp_full", 1), ("p_full", PAIR),
                                    ("dst_full", PAIR), ("ds_full", PAIR), ("dq_full", 1), ("dq_empty", PAIR),
                                    ("dkv_full", 1), ("xchg_full", 1), ("xchg_peer", 1), ("tmem_dealloc", 256)):
                    cute.arch.mbarrier_init(self._bar(mbar, name), count)
                for name in STAGED:
                    for s in cutlass.range_constexpr(self.stages):
                        cute.arch.mbarrier_init(self._bar(mbar, name, s), 1)
        cute.arch.mbarrier_init_fence()
        tmem = TmemAllocator(storage.tmem_addr.ptr, allocator_warp_id=MMA_WARP,
                             barrier_for_retrieve=NamedBarrier(barrier_id=BAR_TMEM_ALLOC, num_threads=32 * 9),
                             is_two_cta=True, two_cta_tmem_dealloc_mbar_ptr=self._bar(mbar, "tmem_pair"),
                             arch="sm_100")
        # every barrier of both CTAs is initialised before any remote arrive, 2-SM TMA or bulk copy
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()

        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sKt = storage.sKt.get_tensor(sKt_layout.outer, swizzle=sKt_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sQt = storage.sQt.get_tensor(sQt_layout.outer, swizzle=sQt_layout.inner)
        sdOt = storage.sdOt.get_tensor(sdOt_layout.outer, swizzle=sdOt_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        # sXchg has sdS's layout restricted to keys [0, 128): the swizzle acts within 1 KB, so its
        # bytes land unchanged in the peer's sdS at key offset 128 x rank (a 16 KB offset)
        sXchg = cute.make_tensor(cute.recast_ptr(storage.sXchg.data_ptr(), sdS_layout.inner), sdS_layout.outer)
        sLSE = storage.sLSE.get_tensor(cute.make_layout(self.tm))
        sD = storage.sD.get_tensor(cute.make_layout(self.tm))

        if wg_idx == 1:
            cute.arch.setmaxregister_decrease(self.cfg.regs.other)
            n_block, pair, head_kv, batch, m_min, n_m, n_iter = self._work(num_n_blocks, seqlen_q, seqlen_k,
                                                                             qhead_per_kvhead)
            if warp_idx == LOAD_WARP:
                self.load(rank, pair, head_kv, batch, m_min, n_m, n_iter, qhead_per_kvhead, mbar,
                          tma_K, tma_V, tma_Kt, tma_Q, tma_dO, tma_Qt, tma_dOt,
                          tma_atom_K, tma_atom_V, tma_atom_Kt, tma_atom_Q, tma_atom_dO, tma_atom_Qt, tma_atom_dOt,
                          sK, sV, sKt, sQ, sdO, sQt, sdOt, mma_s, mma_dp, mma_dv, mma_dk, mma_dq)
            if warp_idx == MMA_WARP:
                tmem.allocate(self.tmem.alloc)
                tmem.relinquish_alloc_permit()
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                if rank == 0:
                    self.mma(n_iter, mbar, tmem_ptr, sK, sV, sKt, sQ, sdO, sQt, sdOt, sdS, tP_layout, tdS_layout,
                             mma_s, mma_dp, mma_dv, mma_dk, mma_dq)
                else:
                    self.relay(n_iter, mbar)
                cute.arch.mbarrier_wait(self._bar(mbar, "tmem_dealloc"), 0)
                tcgen05_fence_after_sync()
                tmem.free(tmem_ptr)
        elif wg_idx == 2:
            cute.arch.setmaxregister_decrease(self.cfg.regs.dq)
            n_block, pair, head_kv, batch, m_min, n_m, n_iter = self._work(num_n_blocks, seqlen_q, seqlen_k,
                                                                             qhead_per_kvhead)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.dq_drain_pair(rank, pair, batch, head_kv, m_min, n_m, n_iter, qhead_per_kvhead, seqlen_q, seqlen_k,
                               mbar, tmem_ptr, mdQacc, mSemaphore, mma_s)
            tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "tmem_dealloc"))
        else:
            cute.arch.setmaxregister_increase(self.cfg.regs.elementwise)
            n_block, pair, head_kv, batch, m_min, n_m, n_iter = self._work(num_n_blocks, seqlen_q, seqlen_k,
                                                                             qhead_per_kvhead)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.elementwise_pair(rank, n_block, batch, head_kv, m_min, n_m, n_iter, qhead_per_kvhead, seqlen_q,
                                  seqlen_k, softmax_scale_log2, softmax_scale, mbar, tmem_ptr, sdS, sXchg,
                                  storage.sdS.data_ptr(), storage.sXchg.data_ptr(), sLSE, sD, mLSE2, mD, mdK, mdV,
                                  mma_s)
            tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "tmem_dealloc"))
        # no CTA leaves while its peer may still arrive on its barriers or copy into its SMEM
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def _work(self, num_n_blocks: Int32, seqlen_q: Int32, seqlen_k: Int32, qhead_per_kvhead: Int32):
        """This CTA's 128-key tile and its pair's 256-key block (the dQ order maps pairs), and the Q
        tiles the pair sees -- the same for both CTAs, so their barrier phases stay in step."""
        bx, head_kv, batch = cute.arch.block_idx()
        pair = self.dq_order.n_block_for_launch(bx // PAIR, (num_n_blocks + 1) // PAIR)
        n_block = PAIR * pair + bx % PAIR
        m_min, m_max = schedule.m_block_range(pair, self.tm, PAIR * self.tn, seqlen_q, seqlen_k, self.causal,
                                              imax=cutlass.max)
        n_m = cutlass.max(m_max - m_min, 0)
        return n_block, pair, head_kv, batch, m_min, n_m, n_m * qhead_per_kvhead

    # ------------------------------------------------------------------ load warp (both CTAs)
    @cute.jit
    def load(self, rank: Int32, pair: Int32, head_kv: Int32, batch: Int32, m_min: Int32, n_m: Int32, n_iter: Int32,
             group: Int32, mbar: cute.Pointer, tma_K: cute.Tensor, tma_V: cute.Tensor, tma_Kt: cute.Tensor,
             tma_Q: cute.Tensor, tma_dO: cute.Tensor, tma_Qt: cute.Tensor, tma_dOt: cute.Tensor,
             tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom, tma_atom_Kt: cute.CopyAtom,
             tma_atom_Q: cute.CopyAtom, tma_atom_dO: cute.CopyAtom, tma_atom_Qt: cute.CopyAtom,
             tma_atom_dOt: cute.CopyAtom, sK: cute.Tensor, sV: cute.Tensor, sKt: cute.Tensor, sQ: cute.Tensor,
             sdO: cute.Tensor, sQt: cute.Tensor, sdOt: cute.Tensor, mma_s: cute.TiledMma, mma_dp: cute.TiledMma,
             mma_dv: cute.TiledMma, mma_dk: cute.TiledMma, mma_dq: cute.TiledMma):
        # this CTA's slice of each pair MMA picks its half of every operand
        thr_s, thr_dp, thr_dv, thr_dk, thr_dq = (m.get_slice(rank) for m in (mma_s, mma_dp, mma_dv, mma_dk, mma_dq))
        tm, d, dv, m2 = self.tm, self.d, self.dv, PAIR * self.tn
        one = cute.make_layout(1)
        part = lambda atom, s, g: cpasync.tma_partition(atom, 0, one, cute.group_modes(s, 0, 3),  # noqa: E731
                                                        cute.group_modes(g, 0, 3))
        tKsK, tKgK = part(tma_atom_K, sK, thr_s.partition_A(
            cute.local_tile(tma_K[None, None, head_kv, batch], (m2, d), (None, 0))))
        tVsV, tVgV = part(tma_atom_V, sV, thr_dp.partition_A(
            cute.local_tile(tma_V[None, None, head_kv, batch], (m2, dv), (None, 0))))
        tKtsKt, tKtgKt = part(tma_atom_Kt, sKt, thr_dq.partition_B(
            cute.local_tile(tma_Kt[None, None, head_kv, batch], (d, m2), (0, None))))
        if rank == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(self._bar(mbar, "kv_full"), self.tx["kv"])
        cute.copy(tma_atom_K, tKgK[None, pair], tKsK[None, 0], tma_bar_ptr=self._bar(mbar, "kv_full"))
        cute.copy(tma_atom_V, tVgV[None, pair], tVsV[None, 0], tma_bar_ptr=self._bar(mbar, "kv_full"))
        cute.copy(tma_atom_Kt, tKtgKt[None, pair], tKtsKt[None, 0], tma_bar_ptr=self._bar(mbar, "kv_full"))
        for it in cutlass.range(n_iter, unroll=1):
            head = head_kv * group + it // n_m
            m_block = m_min + it % n_m
            slot, phase = it % self.stages, (it // self.stages) % 2
            tQsQ, tQgQ = part(tma_atom_Q, sQ, thr_s.partition_B(
                cute.local_tile(tma_Q[None, None, head, batch], (tm, d), (None, 0))))
            tOsO, tOgO = part(tma_atom_dO, sdO, thr_dp.partition_B(
                cute.local_tile(tma_dO[None, None, head, batch], (tm, dv), (None, 0))))
            tOtsOt, tOtgOt = part(tma_atom_dOt, sdOt, thr_dv.partition_B(
                cute.local_tile(tma_dOt[None, None, head, batch], (dv, tm), (0, None))))
            tQtsQt, tQtgQt = part(tma_atom_Qt, sQt, thr_dk.partition_B(
                cute.local_tile(tma_Qt[None, None, head, batch], (d, tm), (0, None))))
            # in the order the MMA thread consumes them: S(j) <- Q, dP(j) <- dO, dV(j) <- dOt, dK(j) <- Qt
            for name, atom, src, dst in (("q", tma_atom_Q, tQgQ, tQsQ), ("do", tma_atom_dO, tOgO, tOsO),
                                         ("dot", tma_atom_dOt, tOtgOt, tOtsOt), ("qt", tma_atom_Qt, tQtgQt, tQtsQt)):
                cute.arch.mbarrier_wait(self._bar(mbar, name + "_empty", slot), phase ^ 1)
                if rank == 0:
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive_and_expect_tx(self._bar(mbar, name + "_full", slot), self.tx[name])
                cute.copy(atom, src[None, m_block], dst[None, slot], tma_bar_ptr=self._bar(mbar, name + "_full", slot))

    # ------------------------------------------------------------------ MMA warp (even CTA) / relay (odd CTA)
    def _acc(self, tmem_ptr, mma, shape, col):
        """This CTA's slice of a pair MMA's accumulator at TMEM column `col`."""
        return cute.make_tensor(tmem_ptr + col, mma.make_fragment_C(mma.partition_shape_C(shape)).layout)

    @cute.jit
    def mma(self, n_iter: Int32, mbar: cute.Pointer, tmem_ptr: cute.Pointer, sK: cute.Tensor, sV: cute.Tensor,
            sKt: cute.Tensor, sQ: cute.Tensor, sdO: cute.Tensor, sQt: cute.Tensor, sdOt: cute.Tensor,
            sdS: cute.Tensor, tP_layout: cute.ComposedLayout, tdS_layout: cute.ComposedLayout,
            mma_s: cute.TiledMma, mma_dp: cute.TiledMma, mma_dv: cute.TiledMma, mma_dk: cute.TiledMma,
            mma_dq: cute.TiledMma):
        tm, T, m2 = self.tm, self.tmem, PAIR * self.tn
        s_, dp_, dv_, dk_, dq_ = (m.get_slice(0) for m in (mma_s, mma_dp, mma_dv, mma_dk, mma_dq))
        tK, tQ = s_.make_fragment_A(sK), s_.make_fragment_B(sQ)
        tV, tdO = dp_.make_fragment_A(sV), dp_.make_fragment_B(sdO)
        tdOt, tQt = dv_.make_fragment_B(sdOt), dk_.make_fragment_B(sQt)
        tdS, tKt = dq_.make_fragment_A(sdS), dq_.make_fragment_B(sKt)
        accS = self._acc(tmem_ptr, mma_s, (m2, tm), T.s)
        accdP = self._acc(tmem_ptr, mma_dp, (m2, tm), T.dp)
        accdV = self._acc(tmem_ptr, mma_dv, (m2, self.dv), T.dv)
        accdK = self._acc(tmem_ptr, mma_dk, (m2, self.d), T.dk)
        accdQ = self._acc(tmem_ptr, mma_dq, (tm, self.d), T.dq)
        tP = self._tmem_a(tmem_ptr, mma_dv, tP_layout, T.p)
        tdSt = self._tmem_a(tmem_ptr, mma_dk, tdS_layout, T.ds)
        st = self.stages

        # one pass per tile plus a tail pass (it = n_iter: dK and dQ of the last tile only), so every
        # MMA is emitted once -- a duplicated tail made ptxas hoist twice the SMEM descriptors and spill
        cute.arch.mbarrier_wait(self._bar(mbar, "kv_full"), 0)
        for it in cutlass.range(n_iter + 1, unroll=1):
            slot, phase = it % st, (it // st) % 2
            pslot, pphase = (it - 1) % st, ((it - 1) // st) % 2
            # dQ(j-2) lives in [64, 64 + d/2) until WG 2 drained it; S(j) and dQ(j-1) overwrite it
            if it >= 2:
                cute.arch.mbarrier_wait(self._bar(mbar, "dq_empty"), it % 2)
                tcgen05_fence_after_sync()
            # 1. S^T(j) = K Q^T
            if it < n_iter:
                cute.arch.mbarrier_wait(self._bar(mbar, "q_full", slot), phase)
                self.gemm(mma_s, accS, tK[None, None, None, 0], tQ[None, None, None, slot], False)
                self._commit(self._bar(mbar, "s_full"))
                self._commit(self._bar(mbar, "q_empty", slot))
            # 2. dK += dS^T(j-1) Q(j-1)  (reads dS^T over dP^T before dP(j) overwrites it)
            if it > 0:
                cute.arch.mbarrier_wait(self._bar(mbar, "qt_full", pslot), pphase)
                cute.arch.mbarrier_wait(self._bar(mbar, "dst_full"), (it - 1) % 2)
                tcgen05_fence_after_sync()
                self.gemm(mma_dk, accdK, tdSt, tQt[None, None, None, pslot], it > 1)
                self._commit(self._bar(mbar, "qt_empty", pslot))
                if it == n_iter:
                    self._commit(self._bar(mbar, "dkv_full"))     # every dV and dK issued
            # 3. dP^T(j) = V dO^T; then wait until both CTAs have read S^T(j) (p_full)
            if it < n_iter:
                cute.arch.mbarrier_wait(self._bar(mbar, "do_full", slot), phase)
                self.gemm(mma_dp, accdP, tV[None, None, None, 0], tdO[None, None, None, slot], False)
                self._commit(self._bar(mbar, "dp_full"))
                self._commit(self._bar(mbar, "do_empty", slot))
                cute.arch.mbarrier_wait(self._bar(mbar, "p_full"), it % 2)
                tcgen05_fence_after_sync()
            # 4. dQ(j-1) = dS K over the pair's 256 keys, once both halves of the dS exchange have landed
            #    (own xchg_full, the odd CTA's via xchg_peer)
            if it > 0:
                self._wait_ds(mbar, it - 1)
                self.gemm(mma_dq, accdQ, tdS[None, None, None, 0], tKt[None, None, None, 0], False)
                self._commit(self._bar(mbar, "dq_full"))
            # 5. dV += P^T(j) dO(j)
            if it < n_iter:
                cute.arch.mbarrier_wait(self._bar(mbar, "dot_full", slot), phase)
                self.gemm(mma_dv, accdV, tP, tdOt[None, None, None, slot], it > 0)
                self._commit(self._bar(mbar, "dot_empty", slot))

    @cute.jit
    def _wait_ds(self, mbar: cute.Pointer, j: Int32):
        """dS of tile j complete in both CTAs' sdS: own rows (ds_full, 256 arrivals) and both exchanges."""
        cute.arch.mbarrier_wait(self._bar(mbar, "ds_full"), j % 2)
        cute.arch.mbarrier_wait(self._bar(mbar, "xchg_full"), j % 2)
        cute.arch.mbarrier_wait(self._bar(mbar, "xchg_peer"), j % 2)
        tcgen05_fence_after_sync()

    @cute.jit
    def relay(self, n_iter: Int32, mbar: cute.Pointer):
        """Odd CTA: forward 'the even CTA's dS rows have landed in my sdS' to the MMA thread."""
        for it in cutlass.range(n_iter, unroll=1):
            cute.arch.mbarrier_wait(self._bar(mbar, "xchg_full"), it % 2)
            with cute.arch.elect_one():
                self._arrive_leader(self._bar(mbar, "xchg_peer"))

    # ------------------------------------------------------------------ elementwise warpgroup (both CTAs)
    @cute.jit
    def elementwise_pair(self, rank: Int32, n_block: Int32, batch: Int32, head_kv: Int32, m_min: Int32, n_m: Int32,
                         n_iter: Int32, group: Int32, seqlen_q: Int32, seqlen_k: Int32, softmax_scale_log2: Float32,
                         softmax_scale: Float32, mbar: cute.Pointer, tmem_ptr: cute.Pointer, sdS: cute.Tensor,
                         sXchg: cute.Tensor, sdS_ptr: cute.Pointer, sXchg_ptr: cute.Pointer, sLSE: cute.Tensor,
                         sD: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                         mma_s: cute.TiledMma):
        tidx = cute.arch.thread_idx()[0] % 128
        tm, tn, T = self.tm, self.tn, self.tmem
        ch, half = 32, self.tm // 2
        accS = self._acc(tmem_ptr, mma_s, (PAIR * tn, tm), T.s)
        sub, ld, st16, thr_ld, thr_st, r_shape, r16_shape = self._row_copies(accS, tidx)
        key = tidx                                   # TMEM lane = this CTA's key row
        n_chunks = tm // ch
        peer = rank ^ 1
        # dS[:, key] lands in column 128 x rank + key of sdS (own query rows) and of the peer's sdS
        # (the peer's rows, via sXchg whose column `key` is copied to that offset)
        kk = rank * tn + key
        sdS_col = self.ds_column(sdS, kk)                       # (64,) 16-bit, one 128-byte column
        sX_col = self.ds_column(sXchg, key)
        rdS = cute.make_rmem_tensor((tm,), self.dtype)           # the dS row, kept until sdS is free

        for it in cutlass.range(n_iter, unroll=1):
            head = head_kv * group + it // n_m
            m_block = m_min + it % n_m
            # 1. lse2 / D -> SMEM; 2. P^T row -> registers -> 16-bit P^T in [0, 64) (the 1-CTA kernel's)
            rP = self._p_phase(it, tidx, batch, head, m_block, n_block, seqlen_q, seqlen_k, softmax_scale_log2,
                               mbar, accS, sLSE, sD, mLSE2, mD, sub, ld, st16, thr_ld, thr_st, r_shape, r16_shape)
            self._signal_leader(self._bar(mbar, "p_full"), tidx, BAR_EW)   # S^T(j) read: dQ(j-1) may take [64, ...)
            # 3. dS = P (dP - D); dS^T (16-bit) in place over dP^T for dK; the row kept in rdS
            cute.arch.mbarrier_wait(self._bar(mbar, "dp_full"), it % 2)
            tcgen05_fence_after_sync()
            accdP = cute.make_tensor(tmem_ptr + T.dp, accS.layout)
            for c in cutlass.range_constexpr(n_chunks):
                r = cute.make_rmem_tensor(r_shape, Float32)
                cute.copy(ld, thr_ld.partition_S(sub(accdP, c * ch, ch)), r)
                cute.arch.fence_view_async_tmem_load()   # chunk c read before dS^T overwrites [16c, 16c + 16)
                for j in cutlass.range_constexpr(ch):
                    rP[c * ch + j] = rP[c * ch + j] * (r[j] - sD[c * ch + j])
                r16 = self._store16(rP, c * ch, ch, st16, thr_st, sub(accdP, T.ds - T.dp + c * ch // 2, ch // 2),
                                    r16_shape)
                v16 = cute.make_tensor(cute.recast_ptr(r16.iterator, dtype=self.dtype), cute.make_layout(ch))
                for j in cutlass.range_constexpr(ch):
                    rdS[c * ch + j] = v16[j]
            cute.arch.fence_view_async_tmem_store()
            tcgen05_fence_before_sync()
            self._signal_leader(self._bar(mbar, "dst_full"), tidx, BAR_EW)
            # 4. sdS / sXchg are free once dQ(j-1) completed (it read both CTAs' sdS after the exchange
            #    of tile j-1, i.e. after the bulk copy had read sXchg)
            if it > 0:
                cute.arch.mbarrier_wait(self._bar(mbar, "dq_full"), (it - 1) % 2)
            for h in cutlass.range_constexpr(2):
                src = cute.make_tensor(rdS.iterator + h * half, cute.make_layout(half))
                if h == rank:
                    cute.autovec_copy(src, sdS_col)
                else:
                    cute.autovec_copy(src, sX_col)
            cute.arch.fence_view_async_shared()      # generic stores -> async proxy (MMA, bulk copy)
            cute.arch.barrier(barrier_id=BAR_EW, number_of_threads=128)
            # 5. own rows done (ds_full); the peer's rows: one bulk copy sXchg -> peer sdS at key offset 128 x rank
            if tidx == 0:
                self._arrive_leader(self._bar(mbar, "ds_full"))
                cute.arch.mbarrier_arrive_and_expect_tx(self._bar(mbar, "xchg_full"), self.xchg_bytes, peer,
                                                        scope=CLUSTER_SCOPE)
                common.bulk_copy_to_peer(sdS_ptr + self.xchg_dst_offset(rank), sXchg_ptr,
                                         self._bar(mbar, "xchg_full"), self.xchg_bytes, peer)

        # 6. epilogue: dV, scale * dK of this CTA's keys (all pair MMAs issued before dkv_full's commit)
        if n_iter > 0:
            cute.arch.mbarrier_wait(self._bar(mbar, "dkv_full"), 0)
            tcgen05_fence_after_sync()
        self._store_dkdv(Int32(key), n_block, batch, head_kv, n_iter, seqlen_k, softmax_scale, tmem_ptr, accS, sub, ld,
                         thr_ld, r_shape, mdK, mdV)

    # ------------------------------------------------------------------ dQ warpgroup (both CTAs)
    @cute.jit
    def dq_drain_pair(self, rank: Int32, pair: Int32, batch: Int32, head_kv: Int32, m_min: Int32, n_m: Int32,
                      n_iter: Int32, group: Int32, seqlen_q: Int32, seqlen_k: Int32, mbar: cute.Pointer,
                      tmem_ptr: cute.Pointer, mdQacc: cute.Tensor, mSemaphore: cute.Tensor, mma_s: cute.TiledMma):
        tidx = cute.arch.thread_idx()[0] % 128
        tm, ch, half_d = self.tm, 32, self.d // 2
        # read dQ as a plain 128-lane fp32 block of d/2 columns (lane l: query row l % 64, half l // 64)
        accQ = self._acc(tmem_ptr, mma_s, (PAIR * self.tn, tm), self.tmem.dq)
        sub, ld, _, thr_ld, _, r_shape, _ = self._row_copies(accQ, tidx)
        col0 = self.dq_col0(tidx)
        for it in cutlass.range(n_iter, unroll=1):
            head = head_kv * group + it // n_m
            m_block = m_min + it % n_m
            row = self.dq_row(rank, tidx, m_block)
            cute.arch.mbarrier_wait(self._bar(mbar, "dq_full"), it % 2)
            tcgen05_fence_after_sync()
            # this thread's d/2 dQ values -> registers, then the columns go back to the MMA warp at
            # once (as in the 1-CTA kernel): the atomics and the semaphore are off its path
            rdq = cute.make_rmem_tensor((half_d,), Float32)
            self._tmem_load_row(rdq, lambda c: sub(accQ, c * ch, ch), ld, thr_ld, r_shape, half_d // ch)
            tcgen05_fence_before_sync()
            self._signal_leader(self._bar(mbar, "dq_empty"), tidx, BAR_DQ)
            if const_expr(self.deterministic):
                # one counter per dQ tile; the pair's CTAs add disjoint rows, so both go at 2 x pair rank
                sem = common.elem_pointer(mSemaphore, (batch, head, m_block))
                last = schedule.n_block_last(m_block, tm, PAIR * self.tn, seqlen_q, seqlen_k, self.causal,
                                             imin=cutlass.min)
                common.semaphore_wait_at_least(sem, PAIR * self.dq_order.rank(pair, Int32(0), last), tidx)
                cute.arch.barrier(barrier_id=BAR_DQ, number_of_threads=128)
            if row < seqlen_q:
                g = mdQacc[batch, row, head, None]
                for j in cutlass.range_constexpr(half_d // 2):
                    common.red_add_f32x2(common.elem_pointer(g, col0 + 2 * j), rdq[2 * j], rdq[2 * j + 1])
            if const_expr(self.deterministic):
                cute.arch.barrier(barrier_id=BAR_DQ, number_of_threads=128)  # every add precedes the release
                common.semaphore_signal(sem, tidx)


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------
def make_config(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, **kw):
    return blackwell_bwd_2cta_config(head_dim, head_dim_v, dtype, causal=causal, deterministic=deterministic, **kw)


def make_kernel(dtype, head_dim, head_dim_v, causal, deterministic, *, varlen=False, has_seqused_k=False,
                dq_order=None, tiles=None):
    """host.py's make_kernel interface (dense only). The semaphores host.py allocates (one int32
    per (batch, head, 128-row dQ tile)) are what this kernel uses."""
    return _one.make_dense_kernel(FlashAttentionBackwardSm100TwoCta, make_config, "2-CTA", dtype, head_dim,
                                  head_dim_v, causal, deterministic, varlen=varlen, has_seqused_k=has_seqused_k,
                                  dq_order=dq_order, tiles=tiles)


_CACHE: dict = {}


def compile_config(cfg: BlackwellBwdConfig, dq_order=None) -> compile_cache.Compiled:
    """Compile for sm_100a (cluster launch) with fake tensors; the report adds the 2-CTA counts."""
    return _one.compile_cached(FlashAttentionBackwardSm100TwoCta, cfg, dq_order, _CACHE,
                               lambda sass, ptx: dict(qdo_stages=cfg.qdo_stages, **pair_report(sass, ptx)))


def pair_report(sass: str, ptx: str) -> dict:
    """What is specific to the pair in the PTX and SASS (names as this ptxas prints them)."""
    def n(pat, text):
        return len(re.findall(pat, text)) if text else None
    return {
        "ptx_mma_cta2": n(r"\btcgen05\.mma\.cta_group::2\b", ptx),
        "ptx_mma_cta1": n(r"\btcgen05\.mma\.cta_group::1\b", ptx),
        "ptx_commit_mc": n(r"\btcgen05\.commit\.cta_group::2\.[^\s]*multicast::cluster", ptx),
        "ptx_alloc_cta2": n(r"\btcgen05\.alloc\.cta_group::2\b", ptx),
        "ptx_tma_cta2": n(r"\bcp\.async\.bulk\.tensor\.[^\s]*\.cta_group::2\b", ptx),
        "ptx_bulk_s2cluster": n(r"\bcp\.async\.bulk\.shared::cluster\.shared::cta\b", ptx),
        "ptx_mapa": n(r"\bmapa\b", ptx),
        "ptx_remote_arrive": n(r"\bmbarrier\.arrive[^\n;]*shared::cluster", ptx),
        "ptx_barrier_cluster": n(r"\bbarrier\.cluster\.(arrive|wait)\b", ptx),
        "ptx_red_v2": n(r"red\.global\.add\.v2\.f32", ptx),
        "ptx_ld_acquire": n(r"ld\.global\.acquire\.gpu", ptx),
        "UTCHMMA.2CTA": n(r"\bUTCHMMA\.2CTA\b", sass),
        "UTCHMMA.2CTA.SS": n(r"\bUTCHMMA\.2CTA\s+gdesc\[", sass),   # A from SMEM: S^T, dP^T, dQ
        "UTCHMMA.2CTA.TS": n(r"\bUTCHMMA\.2CTA\s+tmem\[", sass),    # A from TMEM: dV, dK
        "UBLKCP.S.S": n(r"\bUBLKCP\.S\.S\b", sass),
        "MEMBAR/UCGABAR": n(r"\bUCGABAR_(ARV|WAIT)\b", sass),
        "RED": n(r"\bREDG?\b[^\n]*\.ADD", sass),
    }


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, **kw):
    return compile_config(make_config(dtype, head_dim, head_dim_v, causal, deterministic, **kw))


REPORT_KEYS = ["threads", "registers", "smem_bytes", "qdo_stages", "tmem_cols_used", "tmem_cols_alloc",
               "spill_stores", "spill_loads", "LDL/STL", "UTCHMMA.2CTA.SS", "UTCHMMA.2CTA.TS", "LDTM", "STTM",
               "UTMALDG", "UBLKCP.S.S", "RED", "ptx_mma_cta2", "ptx_bulk_s2cluster", "ptx_mapa"]


def format_report(name, rep):
    return f"{name}: " + ", ".join(f"{k}={rep.get(k)}" for k in REPORT_KEYS)


if __name__ == "__main__":
    for d in (64, 128):
        for causal in (False, True):
            for det in (False, True):
                print(format_report(f"{STEP} d={d} causal={causal} det={det}",
                                    compile_only("bf16", d, causal=causal, deterministic=det).report), flush=True)
