"""Stage 3, Blackwell (sm_100a): the 2-CTA forward -- a cluster of two CTAs runs S = Q K^T and
O += P V as CTA-pair tcgen05 MMAs (M = 256). COMPILED AND INSPECTED ONLY: no Blackwell GPU is
reachable from this project, so this kernel has never run on hardware (docs/blackwell.md, "The
2-CTA forward").

Compared with the 1-CTA forward (blackwell_fwd.py), this adds the CTA-pair MMA, because a pair MMA
splits its B operand by N across the two CTAs: each CTA loads and stages half of every K tile (64
keys x d) and half of every V tile (dv / 2 columns x 128 keys). Per key block at d = 128 a CTA's
SMEM then feeds the tensor core 2 x (64 + 64) x 128 x 2 bytes of B operands instead of twice that,
and the L2 -> SMEM traffic for K / V halves; the ring holds 6 half-slots in the 1-CTA's 3 slots'
bytes. Q (the A operand), S, P and O stay per CTA exactly as in the 1-CTA kernel, so the softmax and
correction warpgroups run the 1-CTA code unchanged (blackwell_softmax.SoftmaxCorrectionRoles).

The pair (cluster (2, 1, 1), rank c = blockIdx.x % 2): CTA c computes the 256 query rows of
m_block = blockIdx.x, as a 1-CTA kernel would; Q tile i of both CTAs forms the pair MMA's 256 rows.
One thread of the even CTA issues every MMA:

    S_i(j)  = Q_i K_j^T   pair MMA, M = 256 (Q_i of CTA 0 | Q_i of CTA 1), N = 128 keys
                          (keys [64c, 64c + 64) from CTA c's SMEM), K = d
    O_i    += P_i V_j     pair MMA, A = P_i in each CTA's TMEM, N = dv (columns [dv/2 c, dv/2 (c+1))
                          of V from CTA c's SMEM), K = 128 keys

in the 1-CTA kernel's order (S_0(0), S_1(0), then O_0 += P_0 V, S_0(j), O_1 += P_1 V, S_1(j) ...).

Barriers (count per phase; "leader" = the even CTA, where the MMA thread waits):
    q_full[i], kv_full[s]   2-SM TMA -> MMA (leader's copy; expects both CTAs' bytes)   1 + tx
    kv_empty[s]             MMA commit, multicast to both CTAs -> each load warp        1
    s_full[i], o_full[i]    MMA commit, multicast -> each CTA's softmax / correction    1
    p_full[i], p_full_2[i]  each CTA's softmax (+ correction) -> its own copy           256 / 128
    p_full_peer[i], p_full_2_peer[i]  the odd CTA's relay (warp 12) -> leader, remote   1
    scale_full, final_full, epi_full, tmem_dealloc   local, as in the 1-CTA kernel
    tmem_pair               the TMEM allocator's pair handshake before dealloc          (allocator's)

The odd CTA's MMA warp, which issues nothing, relays its CTA's p_full / p_full_2 to the leader in
exactly the order the MMA thread consumes them (tile 0, tile 0's last quarter, tile 1, ..., per key
block): each forward is an ``mbarrier.arrive.release.cluster`` on the leader's barrier, so the MMA
thread waits on its own CTA's barrier and on the relayed one before it reads P from both TMEMs.
Causal: both CTAs walk the pair's longer walk (the odd CTA's rows see more keys); the even CTA's
extra key blocks go through its masked step (P = 0).

Not here (a ValueError names the argument): varlen, window / softcap / learnable sink, persistent
or other schedulers, head dims other than 128 and (192, 128).
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

from stage3_fwd_kernel import blackwell_fwd as _one
from stage3_fwd_kernel import compile_cache, host_io, tile_scheduler
from stage3_fwd_kernel.blackwell_2cta_config import PAIR, blackwell_fwd_2cta_config
from stage3_fwd_kernel.blackwell_config import BlackwellFwdConfig
from stage3_fwd_kernel.blackwell_fwd import BAR_TMEM_ALLOC, FlashAttentionForwardSm100
from stage3_fwd_kernel.blackwell_sync import tcgen05_fence_after_sync, tcgen05_fence_before_sync
from stage3_fwd_kernel.components.work_tile import SequenceInfo, locate_tile

STEP = "blackwell_fwd_2cta"
BOTH = 0b11                                # multicast mask: both CTAs of the cluster
CLUSTER_SCOPE = nvvm.MemScopeKind.CLUSTER
PER_Q = FlashAttentionForwardSm100.PER_Q_BARRIERS + ("p_full_peer", "p_full_2_peer")  # the 1-CTA's, then the pair's


def check_supported(*, varlen=False, persistent=False, scheduler=None, window_size=(None, None), softcap=0.0,
                    learnable_sink=None):
    """ValueError naming the first argument the 2-CTA forward does not implement."""
    if varlen:
        raise ValueError("varlen: the 2-CTA forward is dense only (use blackwell_fwd.attention_varlen_forward)")
    if persistent:
        raise ValueError("persistent: the 2-CTA forward launches one cluster per 2 x 256 query rows")
    if scheduler is not None and scheduler is not tile_scheduler.StaticTileScheduler:
        raise ValueError("scheduler: the 2-CTA forward uses the static grid (pairs of adjacent m_blocks)")
    if window_size is None or tuple(x if x is not None and x >= 0 else None for x in window_size) != (None, None):
        raise ValueError(f"window_size: the 2-CTA forward has no local window, got {window_size!r}")
    if softcap:
        raise ValueError(f"softcap: the 2-CTA forward has no softcap, got {softcap!r}")
    if learnable_sink is not None and learnable_sink is not False:
        raise ValueError("learnable_sink: the 2-CTA forward has no learnable sink")


class FlashAttentionForwardSm100TwoCta(FlashAttentionForwardSm100):
    """The 2-CTA forward for one blackwell_fwd_2cta_config plan. The softmax, correction and
    epilogue roles are the 1-CTA kernel's; the load warp, the MMA warp (leader) / relay (odd CTA),
    the barriers and the launch are the pair's."""

    def __init__(self, config: BlackwellFwdConfig):
        if not config.plain:
            raise ValueError("window_size / softcap / learnable_sink: the 2-CTA forward builds none of them")
        super().__init__(config)

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale_log2: Float32,
                 mCuSeqlensQ: cute.Tensor | None, mCuSeqlensK: cute.Tensor | None,
                 max_seqlen_q: Int32 | None, score_scale: Float32 | None, mSink: cute.Tensor | None, stream,
                 max_ctas: Int32 | None = None):
        """blackwell_fwd's arguments (dense: mQ (B, Sq, Hq, d), mK (B, Sk, Hkv, d), mV (B, Sk, Hkv, dv),
        mO (B, Sq, Hq, dv), mLSE (B, Hq, Sq)); the varlen / variant / persistent ones must be None."""
        if const_expr(mCuSeqlensQ is not None or score_scale is not None or mSink is not None
                      or max_ctas is not None):
            raise TypeError("the 2-CTA forward is dense and plain: cu_seqlens, score_scale, sink, max_ctas are None")
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mO.element_type == self.dtype)):
            raise TypeError("q, k, v, out must share the kernel's dtype")
        mQ, mK, mV, mO = self.gmem_views(mQ, mK, mV, mO)   # (s, d, h, b); V as (dv, s, h, b)
        mma_qk, mma_pv = self.pair_mmas()
        one_qk, one_pv, _ = self.mmas_and_p_layout()        # per-CTA views of S / O / P for the warpgroups
        self.check_accumulators(mma_qk, mma_pv, one_qk, one_pv)
        m2 = PAIR * self.tm
        tiler_qk, tiler_pv = (m2, self.tn, self.d), (m2, self.dv, self.tn)
        # per CTA: Q 128 rows x d per tile; K 64 keys x d and V dv/2 x 128 keys per ring slot
        sQ_layout = sm100_utils.make_smem_layout_a(mma_qk, tiler_qk, self.dtype, self.num_q)
        sK_layout = self._restage(sm100_utils.make_smem_layout_b(mma_qk, tiler_qk, self.dtype, 1))
        sV_layout = self._restage(sm100_utils.make_smem_layout_b(mma_pv, tiler_pv, self.dtype, 1))
        tP_layout = sm100_utils.make_smem_layout_a(mma_pv, tiler_pv, self.dtype, 1)
        sO_layout = self.o_smem_layout()

        # 2-SM TMA: each CTA loads its half, the transfer completes on the even CTA's barrier
        cluster = cute.tiled_divide(cute.make_layout((PAIR, 1, 1)), (mma_qk.thr_id.shape,)).shape
        g2s = cpasync.CopyBulkTensorTileG2SOp(tcgen05.CtaGroup.TWO)
        sel = lambda L: cute.select(L, mode=[0, 1, 2])  # noqa: E731
        tma_atom_Q, tma_Q = cute.nvgpu.make_tiled_tma_atom_A(g2s, mQ, sel(sQ_layout), tiler_qk, mma_qk, cluster)
        tma_atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(g2s, mK, sel(sK_layout), tiler_qk, mma_qk, cluster)
        tma_atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_B(g2s, mV, sel(sV_layout), tiler_pv, mma_pv, cluster)
        # the leader's barriers expect the bytes of both CTAs' halves
        self.bytes_Q = PAIR * cute.size_in_bytes(self.dtype, sel(sQ_layout))
        self.bytes_K = PAIR * cute.size_in_bytes(self.dtype, sel(sK_layout))
        self.bytes_V = PAIR * cute.size_in_bytes(self.dtype, sel(sV_layout))
        tma_atom_O, tma_O = self.o_tma_store_atom(mO, sO_layout)

        slot_elems = self.cfg.smem.kv_slot // 2

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.cfg.smem.num_barriers]
            tmem_addr: Int32
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sKV: cute.struct.Align[cute.struct.MemRange[self.dtype, self.stages * slot_elems], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()
        # one CTA per 256 query rows, rounded up to whole pairs (an odd CTA past the end loads zeros
        # through TMA, stores nothing: its rows fail every row guard, its TMA boxes are clipped)
        num_m_blocks = (mQ.shape[0] + self.cfg.cta_tile_m - 1) // self.cfg.cta_tile_m
        grid = (PAIR * ((num_m_blocks + 1) // PAIR), mQ.shape[2], mQ.shape[3])
        self.launch_grid, self.launch_cluster = grid, (PAIR, 1, 1)
        self.kernel(tma_Q, tma_K, tma_V, tma_O, mO, mLSE, softmax_scale_log2, mQ.shape[0], mK.shape[0],
                    mQ.shape[2] // mK.shape[2], tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
                    mma_qk, mma_pv, one_qk, one_pv, sQ_layout, sK_layout, sV_layout, tP_layout, sO_layout,
                    ).launch(grid=grid, block=[self.num_threads, 1, 1], cluster=self.launch_cluster, stream=stream,
                             min_blocks_per_mp=1)

    def pair_mmas(self):
        """(mma_qk, mma_pv): S = Q K^T (SS, both K-major) and O = P V (TS, V MN-major), M = 256 pair MMAs."""
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        two, m2 = tcgen05.CtaGroup.TWO, PAIR * self.tm
        mma_qk = sm100_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, two,
                                                    (m2, self.tn))
        mma_pv = sm100_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, two,
                                                    (m2, self.dv), tcgen05.OperandSource.TMEM)
        return mma_qk, mma_pv

    def check_accumulators(self, mma_qk, mma_pv, one_qk, one_pv):
        """The warpgroups address S / O / P with the 1-CTA kernel's views: a pair MMA's per-CTA slice
        must be the same TMEM map (lane = row of this CTA's 128, a column per N) -- checked at trace time."""
        pairs = (((mma_qk, (PAIR * self.tm, self.tn)), (one_qk, (self.tm, self.tn))),
                 ((mma_pv, (PAIR * self.tm, self.dv)), (one_pv, (self.tm, self.dv))))
        for (two, s2), (one, s1) in pairs:
            t2, t1 = two.get_slice(0), one.get_slice(0)
            l2 = str(t2.make_fragment_C(t2.partition_shape_C(s2)).layout)
            l1 = str(t1.make_fragment_C(t1.partition_shape_C(s1)).layout)
            if l2 != l1:
                raise ValueError(f"the pair MMA's per-CTA accumulator {l2} is not the 1-CTA map {l1}")

    # ------------------------------------------------------------------ device side
    def _bar(self, mbar, name: str, i=0):
        """Pointer to barrier `name`[i] (blackwell_2cta_config.num_pair_barriers counts them)."""
        nq, st = self.num_q, self.stages
        if name in PER_Q:
            return mbar + PER_Q.index(name) * nq + i
        base = len(PER_Q) * nq
        if name == "kv_full":
            return mbar + base + i
        if name == "kv_empty":
            return mbar + base + st + i
        if name == "tmem_dealloc":
            return mbar + base + 2 * st
        return mbar + base + 2 * st + 1   # tmem_pair

    def _commit(self, bar):
        """tcgen05.commit from the MMA thread: arrives on `bar` in both CTAs once the pair's MMAs issued
        so far have completed."""
        with cute.arch.elect_one():
            tcgen05.commit(bar, BOTH, tcgen05.CtaGroup.TWO)

    @cute.kernel
    def kernel(self, tma_Q: cute.Tensor, tma_K: cute.Tensor, tma_V: cute.Tensor, tma_O: cute.Tensor,
               mO: cute.Tensor, mLSE: cute.Tensor, softmax_scale_log2: Float32, seqlen_q_static: Int32,
               seqlen_k_static: Int32, qhead_per_kvhead: Int32, tma_atom_Q: cute.CopyAtom,
               tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom, tma_atom_O: cute.CopyAtom,
               mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, one_qk: cute.TiledMma, one_pv: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               tP_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        storage = SmemAllocator().allocate(self.shared_storage)
        mbar = storage.mbar.data_ptr()
        if warp_idx == self.roles.load:
            for atom in (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O):
                cpasync.prefetch_descriptor(atom)
        if warp_idx == 0:
            with cute.arch.elect_one():
                self.init_barriers(mbar)
        cute.arch.mbarrier_init_fence()
        tmem = TmemAllocator(storage.tmem_addr.ptr, allocator_warp_id=self.roles.mma,
                             barrier_for_retrieve=NamedBarrier(barrier_id=BAR_TMEM_ALLOC, num_threads=32 * 13),
                             is_two_cta=True, two_cta_tmem_dealloc_mbar_ptr=self._bar(mbar, "tmem_pair"),
                             arch="sm_100")
        # both CTAs' barriers are initialised before any remote arrive, multicast commit or 2-SM TMA
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)      # (MMA, M, K, q tile)
        sK = storage.sKV.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)     # (MMA, N/2, K, slot)
        sV = cute.make_tensor(cute.recast_ptr(sK.iterator, sV_layout.inner), sV_layout.outer)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)      # (tm, dv, q tile)
        self.pair_roles(seqlen_q_static, seqlen_k_static, qhead_per_kvhead, warp_idx, tmem, mbar,
                        tma_Q, tma_K, tma_V, tma_O, mO, mLSE, softmax_scale_log2, tma_atom_Q, tma_atom_K,
                        tma_atom_V, tma_atom_O, mma_qk, mma_pv, one_qk, one_pv, sQ, sK, sV, sO, tP_layout)
        # no CTA leaves while the leader's commits or the relay's arrives may still reach its barriers
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def init_barriers(self, mbar: cute.Pointer):
        for i in cutlass.range_constexpr(self.num_q):
            for name, count in (("q_full", 1), ("s_full", 1), ("p_full", 2 * 128), ("p_full_2", 128),
                                ("scale_full", 128), ("final_full", 128), ("o_full", 1), ("epi_full", 128),
                                ("p_full_peer", 1), ("p_full_2_peer", 1)):
                cute.arch.mbarrier_init(self._bar(mbar, name, i), count)
        for s in cutlass.range_constexpr(self.stages):
            cute.arch.mbarrier_init(self._bar(mbar, "kv_full", s), 1)
            cute.arch.mbarrier_init(self._bar(mbar, "kv_empty", s), 1)
        cute.arch.mbarrier_init(self._bar(mbar, "tmem_dealloc"), 3 * 128)

    @cute.jit
    def pair_roles(self, seqlen_q_static: Int32, seqlen_k_static: Int32, qhead_per_kvhead: Int32, warp_idx: Int32,
                   tmem: TmemAllocator, mbar: cute.Pointer, tma_Q: cute.Tensor, tma_K: cute.Tensor,
                   tma_V: cute.Tensor, tma_O: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                   softmax_scale_log2: Float32, tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom,
                   tma_atom_V: cute.CopyAtom, tma_atom_O: cute.CopyAtom, mma_qk: cute.TiledMma,
                   mma_pv: cute.TiledMma, one_qk: cute.TiledMma, one_pv: cute.TiledMma, sQ: cute.Tensor,
                   sK: cute.Tensor, sV: cute.Tensor, sO: cute.Tensor, tP_layout: cute.ComposedLayout):
        """The warp roles of one CTA of the pair (the 1-CTA one_tile_roles, with the pair's load and MMA)."""
        roles = self.roles
        wg_idx = cute.arch.make_warp_uniform(warp_idx // 4)
        thr_qk, thr_pv = one_qk.get_slice(0), one_pv.get_slice(0)
        if wg_idx == 3:
            cute.arch.setmaxregister_decrease(self.cfg.regs.other)
            t, n_blocks = self._pair_tile(seqlen_q_static, seqlen_k_static, qhead_per_kvhead)
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            if warp_idx == roles.load:
                self.load_pair(rank, t.m_block, t.head, t.head_kv, t.batch, n_blocks, mbar, tma_Q, tma_K, tma_V,
                               tma_atom_Q, tma_atom_K, tma_atom_V, sQ, sK, sV, mma_qk, mma_pv)
            if warp_idx == roles.mma:
                tmem.allocate(self.tmem.alloc)
                tmem.relinquish_alloc_permit()
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                if rank == 0:
                    self.mma_pair(n_blocks, mbar, tmem_ptr, sQ, sK, sV, tP_layout, mma_qk, mma_pv)
                else:
                    self.relay(n_blocks, mbar)
                cute.arch.mbarrier_wait(self._bar(mbar, "tmem_dealloc"), 0)
                tcgen05_fence_after_sync()
                tmem.free(tmem_ptr)
            if warp_idx == roles.epilogue:
                self.epilogue(t.m_block, t.head, t.batch, t.offset_q, t.seqlen_q, mbar, sO, tma_O, tma_atom_O, mO)
        elif wg_idx == 2:
            cute.arch.setmaxregister_decrease(self.cfg.regs.correction)
            t, n_blocks = self._pair_tile(seqlen_q_static, seqlen_k_static, qhead_per_kvhead)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.correction(t.m_block, t.head, t.batch, t.offset_q, t.seqlen_q, n_blocks, softmax_scale_log2,
                            mbar, tmem_ptr, sO, mLSE, thr_qk, thr_pv)
            tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "tmem_dealloc"))
        else:
            cute.arch.setmaxregister_increase(self.cfg.regs.softmax)
            t, n_blocks = self._pair_tile(seqlen_q_static, seqlen_k_static, qhead_per_kvhead)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.softmax(t.m_block, t.seqlen_q, t.seqlen_k, n_blocks, softmax_scale_log2, mbar, tmem_ptr, thr_qk)
            tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "tmem_dealloc"))

    @cute.jit
    def _pair_tile(self, seqlen_q_static: Int32, seqlen_k_static: Int32, qhead_per_kvhead: Int32):
        """This CTA's AttentionTile (m_block = blockIdx.x) and the pair's walk: the odd CTA's, the
        longer one (without a window the walk never shrinks as rows go down: causal, the odd CTA's
        rows see more keys), so both CTAs' barrier phases stay in step. Every CTA runs it, in range
        or not (the pair's MMAs need both)."""
        work = self.scheduler.initial_work()
        seq = SequenceInfo(seqlen_q_static, seqlen_k_static, qhead_per_kvhead, None, None, None, None)
        tile = locate_tile(seq, work.m_block, work.head, work.batch)
        _, n_blocks = self._key_blocks(tile.m_block - tile.m_block % PAIR + 1, tile.seqlen_q, tile.seqlen_k)
        return tile, n_blocks

    # ------------------------------------------------------------------ load warp (both CTAs)
    @cute.jit
    def load_pair(self, rank: Int32, m_block: Int32, head: Int32, head_kv: Int32, batch: Int32, n_blocks: Int32,
                  mbar: cute.Pointer, tma_Q: cute.Tensor, tma_K: cute.Tensor, tma_V: cute.Tensor,
                  tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
                  sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, mma_qk: cute.TiledMma, mma_pv: cute.TiledMma):
        """Q_0, K_0, Q_1, V_0, then K_j, V_j: each CTA its halves (its slice of the pair MMA)."""
        thr_qk, thr_pv = mma_qk.get_slice(rank), mma_pv.get_slice(rank)
        one = cute.make_layout(1)
        part = lambda atom, s, g: cpasync.tma_partition(atom, 0, one, cute.group_modes(s, 0, 3),  # noqa: E731
                                                        cute.group_modes(g, 0, 3))
        mQ_cur = tma_Q[None, None, head, batch]        # (sq, d)
        gK = cute.local_tile(tma_K[None, None, head_kv, batch], (self.tn, self.d), (None, 0))   # (tn, d, n)
        gV = cute.local_tile(tma_V[None, None, head_kv, batch], (self.dv, self.tn), (0, None))  # (dv, tn, n)
        tKsK, tKgK = part(tma_atom_K, sK, thr_qk.partition_B(gK))   # keys [64 rank, 64 rank + 64) of a block
        tVsV, tVgV = part(tma_atom_V, sV, thr_pv.partition_B(gV))   # V columns [dv/2 rank, ...)
        for i in cutlass.range_constexpr(self.num_q):
            tQsQ, tQgQ = part(tma_atom_Q, sQ, self.pair_q_view(thr_qk, mQ_cur, rank, i))
            if rank == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(self._bar(mbar, "q_full", i), self.bytes_Q)
            cute.copy(tma_atom_Q, tQgQ[None, self.pair_q_block(m_block, rank)], tQsQ[None, i],
                      tma_bar_ptr=self._bar(mbar, "q_full", i))
            if const_expr(i == 0):
                self.load_half(rank, 0, 0, mbar, tma_atom_K, tKgK, tKsK, self.bytes_K)
        self.load_half(rank, 1, 0, mbar, tma_atom_V, tVgV, tVsV, self.bytes_V)
        for j in cutlass.range(1, n_blocks, unroll=1):
            self.load_half(rank, 2 * j, j, mbar, tma_atom_K, tKgK, tKsK, self.bytes_K)
            self.load_half(rank, 2 * j + 1, j, mbar, tma_atom_V, tVgV, tVsV, self.bytes_V)

    def pair_q_view(self, thr_qk, mQ_cur, rank, i):
        """Rank's A partition of Q tile i's rows: (MMA, M, K, 256-row blocks). The pair MMA's 256 rows
        of tile i are 128 of each CTA, but CTA c's tile i starts at row 256 m_block + 128 i: shifting
        the view by 128 (c + i) rows makes rank c's half of block pair_q_block(m_block, c) exactly
        those rows (check_q_rows evaluates this at trace time)."""
        shifted = cute.domain_offset((self.tm * (rank + i), 0), mQ_cur)
        return thr_qk.partition_A(cute.local_tile(shifted, (PAIR * self.tm, self.d), (None, 0)))

    @staticmethod
    def pair_q_block(m_block, rank):
        return m_block - rank

    @cute.jit
    def load_half(self, rank: Int32, load_idx: Int32, n_block: Int32, mbar: cute.Pointer, tma_atom: cute.CopyAtom,
                  tXgX: cute.Tensor, tXsX: cute.Tensor, num_bytes: cutlass.Constexpr[int]):
        """This CTA's half of K_j or V_j into ring slot load_idx % stages; only the leader's kv_full
        counts the bytes (of both halves). kv_empty is multicast: each CTA waits on its own copy."""
        slot, phase = self._ring(load_idx)
        cute.arch.mbarrier_wait(self._bar(mbar, "kv_empty", slot), phase ^ 1)  # first lap: passes
        if rank == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(self._bar(mbar, "kv_full", slot), num_bytes)
        cute.copy(tma_atom, tXgX[None, n_block], tXsX[None, slot], tma_bar_ptr=self._bar(mbar, "kv_full", slot))

    # ------------------------------------------------------------------ MMA warp (leader) / relay (odd CTA)
    def _pair_tmem(self, tmem_ptr, mma_qk, mma_pv, tP_layout):
        """S_i, O_i (the pair MMAs' per-CTA accumulators) and P_i (their TS operand) at cfg.tmem's columns."""
        t_qk, t_pv = mma_qk.get_slice(0), mma_pv.get_slice(0)
        m2 = PAIR * self.tm
        s_layout = t_qk.make_fragment_C(t_qk.partition_shape_C((m2, self.tn))).layout
        o_layout = t_pv.make_fragment_C(t_pv.partition_shape_C((m2, self.dv))).layout
        p_layout = t_pv.make_fragment_A(cute.make_tensor(tmem_ptr, tP_layout.outer))[None, None, None, 0].layout
        tStS = [cute.make_tensor(tmem_ptr + self.tmem.s[i], s_layout) for i in range(self.num_q)]
        tOtO = [cute.make_tensor(tmem_ptr + self.tmem.o[i], o_layout) for i in range(self.num_q)]
        tOrP = [cute.make_tensor(cute.recast_ptr(tmem_ptr + self.tmem.p[i], dtype=self.dtype), p_layout)
                for i in range(self.num_q)]
        return tStS, tOtO, tOrP

    @cute.jit
    def mma_pair(self, n_blocks: Int32, mbar: cute.Pointer, tmem_ptr: cute.Pointer, sQ: cute.Tensor,
                 sK: cute.Tensor, sV: cute.Tensor, tP_layout: cute.ComposedLayout, mma_qk: cute.TiledMma,
                 mma_pv: cute.TiledMma):
        """The 1-CTA issue order with pair MMAs; every commit multicast to both CTAs."""
        t_qk, t_pv = mma_qk.get_slice(0), mma_pv.get_slice(0)
        tSrQ = t_qk.make_fragment_A(sQ)   # SMEM descriptors (MMA, M, K, q tile)
        tSrK = t_qk.make_fragment_B(sK)   # (MMA, N, K, slot)
        tOrV = t_pv.make_fragment_B(sV)   # (MMA, N, K, slot)
        tStS, tOtO, tOrP = self._pair_tmem(tmem_ptr, mma_qk, mma_pv, tP_layout)

        # 1. S_i(0) = Q_i K_0^T for both tiles
        k_slot, k_phase = self._ring(0)
        cute.arch.mbarrier_wait(self._bar(mbar, "kv_full", k_slot), k_phase)
        for i in cutlass.range_constexpr(self.num_q):
            cute.arch.mbarrier_wait(self._bar(mbar, "q_full", i), 0)
            self.gemm_qk(mma_qk, tStS[i], tSrQ[None, None, None, i], tSrK[None, None, None, k_slot])
            self._commit(self._bar(mbar, "s_full", i))
        self._commit(self._bar(mbar, "kv_empty", k_slot))
        # 2. O_i += P_i(j-1) V_(j-1), then S_i(j) = Q_i K_j^T, tile 0 then tile 1
        for j in cutlass.range(1, n_blocks, unroll=1):
            v_slot, v_phase = self._ring(2 * j - 1)
            k_slot, k_phase = self._ring(2 * j)
            cute.arch.mbarrier_wait(self._bar(mbar, "kv_full", v_slot), v_phase)
            for i in cutlass.range_constexpr(self.num_q):
                self.gemm_pv_pair(mma_pv, mbar, i, j - 1, tOtO[i], tOrP[i], tOrV[None, None, None, v_slot], j > 1)
                if const_expr(i == 0):
                    cute.arch.mbarrier_wait(self._bar(mbar, "kv_full", k_slot), k_phase)
                self.gemm_qk(mma_qk, tStS[i], tSrQ[None, None, None, i], tSrK[None, None, None, k_slot])
                self._commit(self._bar(mbar, "s_full", i))
            self._commit(self._bar(mbar, "kv_empty", v_slot))
            self._commit(self._bar(mbar, "kv_empty", k_slot))
        # 3. the last O_i += P_i V; each commit tells both CTAs' correction warpgroups O_i is final
        v_slot, v_phase = self._ring(2 * n_blocks - 1)
        cute.arch.mbarrier_wait(self._bar(mbar, "kv_full", v_slot), v_phase)
        for i in cutlass.range_constexpr(self.num_q):
            self.gemm_pv_pair(mma_pv, mbar, i, n_blocks - 1, tOtO[i], tOrP[i], tOrV[None, None, None, v_slot],
                              n_blocks > 1)
            self._commit(self._bar(mbar, "o_full", i))
        # no kv_empty commit for the last V: no load waits for it, and a multicast arrive still in flight
        # when the odd CTA passes the exit cluster barrier would reach a CTA that has left

    @cute.jit
    def gemm_pv_pair(self, tiled_mma: cute.TiledMma, mbar: cute.Pointer, i: cutlass.Constexpr[int], step: Int32,
                     tOtO: cute.Tensor, tOrP: cute.Tensor, tOrV: cute.Tensor, accumulate: cutlass.Boolean):
        """blackwell_load_mma.LoadMmaRoles.gemm_pv for the pair: 3/4 of P stored (and O rescaled) in both CTAs -- this
        CTA's barrier and the odd CTA's, relayed -- then 6 K-steps; the last quarter in both, 2 more."""
        tiled_mma = cute.make_tiled_mma(cute.make_mma_atom(tiled_mma.op))  # ACCUMULATE stays local
        phase = step % 2
        num_k = cute.size(tOrP, mode=[2])
        first = self.cfg.pv_k_blocks_first
        cute.arch.mbarrier_wait(self._bar(mbar, "p_full", i), phase)
        cute.arch.mbarrier_wait(self._bar(mbar, "p_full_peer", i), phase)
        tcgen05_fence_after_sync()
        for k in cutlass.range_constexpr(num_k):
            if const_expr(k == first):
                cute.arch.mbarrier_wait(self._bar(mbar, "p_full_2", i), phase)
                cute.arch.mbarrier_wait(self._bar(mbar, "p_full_2_peer", i), phase)
                tcgen05_fence_after_sync()
            if const_expr(k == 0):
                tiled_mma.set(tcgen05.Field.ACCUMULATE, accumulate)
            else:
                tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
            cute.gemm(tiled_mma, tOtO, tOrP[None, None, k], tOrV[None, None, k], tOtO)

    @cute.jit
    def relay(self, n_blocks: Int32, mbar: cute.Pointer):
        """Odd CTA, warp 12: forward this CTA's p_full / p_full_2 phases to the leader, in the order the
        MMA thread consumes them, with a cluster-scope release arrive on the leader's copy."""
        for j in cutlass.range(n_blocks, unroll=1):
            for i in cutlass.range_constexpr(self.num_q):
                for name in ("p_full", "p_full_2"):
                    cute.arch.mbarrier_wait(self._bar(mbar, name, i), j % 2)
                    with cute.arch.elect_one():
                        cute.arch.mbarrier_arrive(self._bar(mbar, name + "_peer", i), Int32(0), scope=CLUSTER_SCOPE)


def check_q_rows(kernel: FlashAttentionForwardSm100TwoCta | None = None, m_pair: int = 3,
                 view=None) -> dict:
    """Trace-time check of the Q rows each CTA's 2-SM TMA loads (pair_q_view / pair_q_block, evaluated
    on an identity tensor): CTA c of pair m_pair (m_block = 2 m_pair + c) must load, for tile i, rows
    [256 m_block + 128 i, + 128) x all d columns. Returns {(rank, i): (first row, last row, elements)
    wrong}; `view` replaces pair_q_view (to show that a wrong shift is caught)."""
    import itertools

    from stage3_fwd_kernel.blackwell_tmem_check import _static

    kernel = kernel or FlashAttentionForwardSm100TwoCta(make_config("bf16", 128))
    view = view or kernel.pair_q_view
    traced = {}

    def collect():  # plain Python inside the trace: the loops stay Python loops
        mma_qk, _ = kernel.pair_mmas()
        ident = cute.make_identity_tensor((4 * PAIR * kernel.cfg.cta_tile_m * (m_pair + 1), kernel.d))
        for rank in range(PAIR):
            for i in range(kernel.num_q):
                v = view(mma_qk.get_slice(rank), ident, rank, i)
                traced[(rank, i)] = _static(v[None, None, None, kernel.pair_q_block(PAIR * m_pair + rank, rank)])

    @cute.jit
    def probe():
        collect()

    cute.compile(probe, options=f"--gpu-arch {_one.TARGET_ARCH}")  # builds nothing: only the trace matters
    out = {}
    for (rank, i), t in traced.items():
        coords = {t.at_modes(idx) for idx in itertools.product(*[range(n) for n in t.mode_sizes])}
        row0 = (PAIR * m_pair + rank) * kernel.cfg.cta_tile_m + i * kernel.tm
        expect = {(row0 + r, c) for r in range(kernel.tm) for c in range(kernel.d)}
        rows = sorted(r for r, _ in coords)
        out[(rank, i)] = (rows[0], rows[-1], len(coords ^ expect))
    return out


# ------------------------------------------------------------------------------------------------
# Host API
# ------------------------------------------------------------------------------------------------
def make_config(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, **kw) -> BlackwellFwdConfig:
    return blackwell_fwd_2cta_config(head_dim, head_dim_v, dtype, causal=causal, **kw)


_CACHE: dict = {}


def compile_config(cfg: BlackwellFwdConfig, args=None) -> compile_cache.Compiled:
    """Compile for sm_100a (cluster launch) with fake tensors unless `args` are given."""
    key = (cfg.key(), "fake" if args is None else "real")
    if key in _CACHE:
        return _CACHE[key]
    kernel = FlashAttentionForwardSm100TwoCta(cfg)
    fn, report, sass, ptx = _one.compile_sm100(kernel, _one.fake_args(cfg, False) if args is None else args)
    report.update(smem_bytes=kernel.smem_bytes, threads=kernel.num_threads, kv_stages=cfg.kv_stages,
                  tmem_cols_used=cfg.tmem.used, tmem_cols_alloc=cfg.tmem.alloc, cluster=kernel.launch_cluster,
                  **pair_report(sass, ptx))
    out = compile_cache.Compiled(fn, report, sass, ptx)
    _CACHE[key] = out
    return out


def pair_report(sass: str, ptx: str) -> dict:
    """What is specific to the pair in the PTX and SASS (names as this ptxas prints them)."""
    def n(pat, text):
        return len(re.findall(pat, text)) if text else None
    return {
        "ptx_cluster_ctarank": n(r"%cluster_ctarank\b", ptx),
        "ptx_mma_cta2": n(r"\btcgen05\.mma\.cta_group::2\b", ptx),
        "ptx_mma_cta1": n(r"\btcgen05\.mma\.cta_group::1\b", ptx),
        "ptx_commit_mc": n(r"\btcgen05\.commit\.cta_group::2\.[^\s]*multicast::cluster", ptx),
        "ptx_alloc_cta2": n(r"\btcgen05\.alloc\.cta_group::2\b", ptx),
        "ptx_tma_cta2": n(r"\bcp\.async\.bulk\.tensor\.[^\s]*\.cta_group::2\b", ptx),
        "ptx_remote_arrive": n(r"\bmbarrier\.arrive\.release\.cluster\.shared::cluster\b", ptx),
        "ptx_barrier_cluster": n(r"\bbarrier\.cluster\.(?:arrive|wait)\b", ptx),
        "UTCHMMA.2CTA": n(r"\bUTCHMMA\.2CTA\b", sass),
        "UTCHMMA.2CTA.SS": n(r"\bUTCHMMA\.2CTA\s+gdesc\[", sass),   # S = Q K^T
        "UTCHMMA.2CTA.TS": n(r"\bUTCHMMA\.2CTA\s+tmem\[", sass),    # O += P V
        "UTCHMMA.1CTA": n(r"\bUTCHMMA\b(?!\.2CTA)", sass),
        "UTMALDG.2CTA": n(r"\bUTMALDG\.\dD\.2CTA\b", sass),
    }


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, *, varlen=False, persistent=False,
                 scheduler=None, window_size=(None, None), softcap=0.0, learnable_sink=None,
                 **kw) -> compile_cache.Compiled:
    """Compile for sm_100a with fake tensors (no GPU needed); what the pair does not implement is
    refused with a ValueError naming the argument."""
    check_supported(varlen=varlen, persistent=persistent, scheduler=scheduler, window_size=window_size,
                    softcap=softcap, learnable_sink=learnable_sink)
    return compile_config(make_config(dtype, head_dim, head_dim_v, causal, **kw))


def attention_forward_2cta(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0,
                           learnable_sink=None, out=None, lse=None, scheduler=None, persistent: bool = False,
                           **cfg_kw):
    """blackwell_fwd.attention_forward through the 2-CTA kernel: q (B,Sq,Hq,D), k (B,Sk,Hkv,D),
    v (B,Sk,Hkv,Dv) fp16/bf16, (D, Dv) = (128, 128) or (192, 128), on a Blackwell GPU ->
    (out (B,Sq,Hq,Dv), lse (B,Hq,Sq) fp32). UNVERIFIED: never run on hardware here."""
    # every argument is checked before the GPU check (errors name the argument; devices come after it)
    check_supported(persistent=persistent, scheduler=scheduler, window_size=window_size, softcap=softcap,
                    learnable_sink=learnable_sink)
    host_io.check_causal(causal)  # a string such as "False" would build a causal kernel
    host_io.check_dense_shapes(q, k, v)
    b, sq, hq, d = q.shape
    dv = v.shape[-1]
    cfg = make_config(str(q.dtype), d, dv, causal, **cfg_kw)  # ValueError before any compile
    softmax_scale = host_io.check_scale(softmax_scale, d)
    out, lse = _one._outputs(out, lse, (b, sq, hq, dv), (b, hq, sq), q)
    if not _one.blackwell_gpu_available():
        raise RuntimeError("attention_forward_2cta needs a Blackwell (sm_100) GPU; use compile_only() elsewhere")
    q, k, v = host_io.dense_on_cuda(q, k, v)
    if b == 0 or sq == 0 or hq == 0:
        return out, lse
    if k.shape[1] == 0:
        return _one._nothing_visible(out, lse, None, head_dim=1)
    args = _one._launch_args(q, k, v, out, lse, softmax_scale)
    compile_config(cfg, args).fn(*args)
    return out, lse


def run(batch=2, seqlen_q=1024, seqlen_k=1024, heads=8, heads_kv=None, head_dim=128, head_dim_v=None,
        causal=False, dtype="bf16", check=True, verbose=True) -> dict:
    """On a Blackwell GPU: check against the stage-0 reference (FA4's rule). Anywhere else: compile for
    sm_100a and print the resource report (the only mode ever exercised here)."""
    heads_kv = heads if heads_kv is None else heads_kv
    if not _one.blackwell_gpu_available():
        rep = compile_only(dtype, head_dim, head_dim_v, causal).report
        if verbose:
            print(format_report(f"{STEP} [sm_100a, {dtype}, d={head_dim}/{head_dim_v or head_dim}, causal={causal}] "
                                "(no Blackwell GPU: compiled only, never run)", rep))
        return {"step": STEP, "mode": "compile-only", "report": rep}

    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref

    tdt, dv = host_io.torch_dtype(dtype), head_dim_v or head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=tdt, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=tdt, generator=gen)
    v = torch.randn(batch, seqlen_k, heads_kv, dv, device="cuda", dtype=tdt, generator=gen)
    out, lse = attention_forward_2cta(q, k, v, causal=causal)
    torch.cuda.synchronize()
    if check:
        ref_o, ref_lse = attention_ref(q, k, v, causal=causal, upcast=True)
        base_o, base_lse = attention_ref(q, k, v, causal=causal, upcast=False)
        assert_fa4_close(f"{STEP} out", out, ref_o, base_o)
        assert_fa4_close(f"{STEP} lse", lse, ref_lse, base_lse)
    if verbose:
        print(f"{'PASS' if check else '(unchecked)'} {STEP} b={batch} sq={seqlen_q} sk={seqlen_k} d={head_dim}/{dv}")
    return {"step": STEP, "mode": "gpu"}


REPORT_KEYS = ["threads", "registers", "smem_bytes", "kv_stages", "tmem_cols_used", "tmem_cols_alloc", "spill_stores",
               "spill_loads", "LDL/STL", "UTCHMMA.2CTA.SS", "UTCHMMA.2CTA.TS", "UTCHMMA.1CTA", "LDTM", "STTM",
               "UTMALDG.2CTA", "UTCBAR", "MUFU.EX2", "cluster", "ptx_remote_arrive"]


def format_report(name: str, rep: dict) -> str:
    return f"{name}: " + ", ".join(f"{k}={rep.get(k)}" for k in REPORT_KEYS)


if __name__ == "__main__":
    for d, dv in ((128, 128), (192, 128)):
        for causal in (False, True):
            print(format_report(f"{STEP} [sm_100a, bf16, d={d}/{dv}, causal={causal}] (compiled only, never run)",
                                compile_only("bf16", d, dv, causal).report), flush=True)
