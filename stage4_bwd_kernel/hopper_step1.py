"""Stage 4, Hopper step 1: a first correct FlashAttention backward with wgmma.

Compared with the previous step (stage 1's NumPy ``flash_backward``, whose loop structure this
keeps, and stage 3's forward step 1, whose wgmma patterns it reuses), this moves the tiled backward
onto the tensor cores of an H100: **each CTA owns one K/V tile** (``tile_n`` keys of one KV head)
and walks the Q tiles of every query head that reads that KV head, because then dK and dV -- sums
over *queries* -- stay in registers for the whole CTA and are written once, while dQ -- a sum over
*keys*, i.e. over CTAs -- is added into an fp32 buffer in global memory::

    load K_j, V_j                                        (once per CTA)
    for each query head h of the KV head's group:        (GQA: sequential, so no dK/dV races)
      for each Q tile i (causal: from the diagonal on):
        load Q_i, dO_i, lse2_i, D_i
        S^T  = K_j Q_i^T                                 SS wgmma        (tile_n x tile_m)
        P^T  = exp2(S^T * scale*log2(e) - lse2_i)        masked entries -> 0
        dP^T = V_j dO_i^T                                SS wgmma
        dS^T = P^T * (dP^T - D_i)
        P^T, dS^T -> shared memory (bf16)
        dV_j += P^T dO_i                                 SS wgmma (A = P^T, B = dO_i as an MN-major view)
        dK_j += dS^T Q_i                                 SS wgmma (A = dS^T, B = Q_i as an MN-major view)
        dQ_i  = dS K_j                                   SS wgmma (A = dS, an MN-major view of dS^T)
        dQaccum_i += dQ_i                                red.global.add.v2.f32 (deterministic: in order)
    dK_j *= softmax_scale; store dK_j, dV_j

Why these choices:

* **Transposed scores (S^T, "SdP_swapAB").** wgmma's accumulator rows are the MMA's M. With keys
  as M, the P^T and dS^T tiles come out with keys as rows -- exactly the A operands of
  dV = P^T dO and dK = dS^T Q, whose outputs have keys as rows. lse and D then index *columns*:
  each thread holds 2 columns per 8-column group, read from a 2 x tile_m fp32 shared array.
* **Two warpgroups split N, every operand in shared memory.** 256 threads; for every GEMM the two
  warpgroups take the two halves of N (queries for S^T/dP^T, head dim for dK/dV/dQ). Registers per
  thread at d = 128, tile_n = 128, tile_m = 64: dK and dV accumulators 128 * 128 / 256 = 64 each,
  S^T and dP^T 32 each, dQ 32 -> ~190 live fp32 values at the peak, under the 255 cap without a
  register split (step 2's warp specialization buys that). One layout serves every head dim up to
  256 (dK + dV = 128 registers at d = 256, tile_n = 64), which is why step 1 takes it; the price
  is shared-memory traffic for P^T (written, then read by both warpgroups) that a register (RS)
  operand would avoid -- the roofline in ``roofline.py`` counts it.
* **One shared buffer, two majors.** Q (tile_m x d, d contiguous) is the K-major B operand of
  S^T = K Q^T and the MN-major B operand of dK = dS^T Q. The same bytes serve both when the swizzle
  atom fits in one warpgroup's N-half of the MN-major use (d/2 columns): so sQ, sdO and sK are laid
  out with the swizzle chosen for d/2, and the transposed views are ``cute.composition`` with an
  ordered layout (stage 3's sVt trick). dS^T in smem is the K-major A of dK and, viewed transposed,
  the MN-major A of dQ = dS K.
* **dQ: fp32 atomics on a natural-layout buffer.** Each thread owns pairs of adjacent dQ columns
  (the accumulator layout), so one 8-byte ``red.global.add.v2.f32`` per pair: tile_m * d / 2
  reductions per tile (4096 at 64 x 128), predicated on rows < seqlen_q. The postprocess scales and
  converts. Atomic order varies run to run, so dQ's last bits do too; ``deterministic=True``
  serialises the adds per dQ tile with a semaphore in global memory: thread 0 spins
  (``ld.acquire.gpu``) until the tile's counter equals this CTA's rank in the order, the CTA adds,
  a barrier, then ``fence.acq_rel.gpu`` + atomic increment releases the next CTA. The order is a
  parameter (``common.KVAscendingOrder`` / ``KVDescendingOrder``; stage 5 can supply SPT).
* **GQA inside the CTA.** Looping over the query heads of a group in one CTA (instead of one CTA per
  query head with fp32 dK/dV scratch and a reduction pass) keeps dK/dV exact, race-free and
  deterministic in both modes and needs no extra memory; it costs parallelism (group x fewer CTAs),
  which matters only when batch x kv_heads x n_blocks is below the SM count.
* **Loads are synchronous cp.async** (16 B per thread, rows past the sequence zero-filled), like the
  forward's step 1. Nothing overlaps; step 2's job.

Causal (bottom-right): K/V tile n is visible from query tile m_min(n) = max(0, n*tile_n + Sq - Sk)
// tile_m on, so the walk starts there; dQ tile m receives tiles 0 .. n_last(m). Masked scores get
-inf before exp2. Rows past seqlen_q have lse2 = +inf and D = 0 (P = dS = 0); keys past seqlen_k
are masked. Varlen: q/k/v/dout packed (total, H, d), sequences from cu_seqlens_q/k, optional
seqused_k (keys past it get zero gradient).

Shared memory (bf16): Q tm*d + dO tm*dv + K tn*d + V tn*dv + P^T, dS^T 2*tn*tm (+ 2*tm fp32)
  d=64   (tm=128, tn=128): 16 + 16 + 16 + 16 + 64 = 128 KB      d=96 (64, 128): 12+12+24+24+32 = 104 KB
  d=128  (tm=64,  tn=128): 16 + 16 + 32 + 32 + 32 = 128 KB      (192,128) (64, 64): 24+16+24+16+16 = 96 KB
  d=256  (tm=64,  tn=64):  32 + 32 + 32 + 32 + 16 = 144 KB
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory.smem import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from stage3_fwd_kernel.hopper_step1_wgmma import acc_rowcol  # (proven on H100)
from stage4_bwd_kernel import common, schedule

STEP = "hopper_bwd_step1"
NUM_WG = 2
NUM_THREADS = 128 * NUM_WG


def default_tiles(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """(tile_m, tile_n): keep the dK + dV accumulators ((d + dv) * tile_n / 256 registers) plus
    S^T and dP^T (2 * tile_n * tile_m / 256) under ~200 registers (arithmetic in the docstring)."""
    if max(head_dim, head_dim_v) <= 64:
        return 128, 128
    if max(head_dim, head_dim_v) <= 128:
        return 64, 128
    return 64, 64


@cute.jit
def gemm_issue(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
               zero_init: cutlass.Constexpr[bool]):
    """Issue acc (+)= A B over all k-blocks as one wgmma group (the caller fences before the first
    group and waits after the last)."""
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


class FlashAttentionBackwardSm90Step1:
    """256 threads (2 warpgroups) per CTA, one K/V tile per CTA, synchronous cp.async loads, five SS wgmmas."""

    def __init__(self, dtype, head_dim: int, head_dim_v: int, causal: bool, deterministic: bool = False, *,
                 varlen: bool = False, has_seqused_k: bool = False, tile_m: int | None = None,
                 tile_n: int | None = None, dq_order=None):
        common.check_head_dims(head_dim, head_dim_v)
        dm, dn = default_tiles(head_dim, head_dim_v)
        self.tile_m = tile_m or dm
        self.tile_n = tile_n or dn
        if self.tile_n % 64 or self.tile_m % 16:
            raise ValueError(f"tile_n: must be a multiple of 64 and tile_m of 16, got {self.tile_n}, {self.tile_m}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.deterministic = deterministic
        self.varlen = varlen
        self.has_seqused_k = has_seqused_k
        self.dq_order = dq_order or common.default_dq_order(causal, deterministic, head_dim=head_dim)
        self.num_threads = NUM_THREADS
        self.smem_bytes = None

    # -------------------------------------------------------------- host side (traced once)
    def _smem_layout(self, rows: int, cols: int, major_mode_size: int):
        """Row-major (rows, cols) tile; the swizzle atom is the widest that divides
        `major_mode_size` (the extent one warpgroup sees when the tile is used MN-major)."""
        atom_kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, major_mode_size)
        atom = warpgroup.make_smem_layout_atom(atom_kind, self.dtype)
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))

    def _gmem_copy(self, cols: int, async_copy: bool):
        """All threads, 16 bytes each, a 128/64/32-byte row chunk per group of adjacent threads."""
        elems = 128 // self.dtype.width
        atom_cols = 64 if cols % 64 == 0 else (32 if cols % 32 == 0 else 16)
        threads_per_row = atom_cols // elems
        op = (cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL) if async_copy
              else cute.nvgpu.CopyUniversalOp())
        atom = cute.make_copy_atom(op, self.dtype, num_bits_per_copy=128)
        thr = cute.make_ordered_layout((self.num_threads // threads_per_row, threads_per_row), order=(1, 0))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor,
                 mSemaphore: cute.Tensor, num_n_blocks: Int32, softmax_scale_log2: Float32,
                 softmax_scale: Float32, stream):
        # mQ (B, Sq, Hq, d), mK (B, Sk, Hkv, d), mV (B, Sk, Hkv, dv), mdO (B, Sq, Hq, dv),
        # mLSE2 / mD (B, Hq, Sq) fp32, mdQacc (B, Sq, Hq, d) fp32, mdK / mdV like mK / mV,
        # mSemaphore (B, Hq, num_m_blocks) int32 (deterministic only).
        # Varlen: B = 1 and Sq / Sk are the packed totals; cu_seqlens (batch + 1,) give the sequences.
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mdO.element_type
                           == mdK.element_type == mdV.element_type == self.dtype)):
            raise TypeError("q, k, v, dout, dk, dv must share the kernel's dtype")
        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        mQ, mK, mdK = (common.assume_aligned(t, d) for t in (mQ, mK, mdK))
        mV, mdO, mdV = (common.assume_aligned(t, dv) for t in (mV, mdO, mdV))
        mdQacc = common.assume_aligned(mdQacc, d)

        # shared memory: see the module docstring for why sQ / sdO / sK use the d/2 swizzle
        sQ_layout = self._smem_layout(tm, d, d // NUM_WG)
        sdO_layout = self._smem_layout(tm, dv, dv // NUM_WG)
        sK_layout = self._smem_layout(tn, d, d // NUM_WG)
        sV_layout = self._smem_layout(tn, dv, dv // NUM_WG)  # d/2 too: it stages dV at the end
        sPdS_layout = self._smem_layout(tn, tm, tm)  # P^T and dS^T: (keys, queries)

        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wg_n = (1, NUM_WG, 1)  # both warpgroups share M and split N
        # S^T = K Q^T, dP^T = V dO^T: (tn, tm), A and B K-major
        tiled_mma_SdP = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32,
                                                          wg_n, (64, tm // NUM_WG))
        # dV = P^T dO: (tn, dv); dK = dS^T Q: (tn, d); A K-major (P^T, dS^T), B MN-major (dO, Q)
        tiled_mma_dV = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32,
                                                         wg_n, (64, dv // NUM_WG))
        tiled_mma_dK = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32,
                                                         wg_n, (64, d // NUM_WG))
        # dQ = dS K: (tm, d); A = dS (M = queries contiguous: MN-major), B = K (d contiguous: MN-major)
        tiled_mma_dQ = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32,
                                                         wg_n, (64, d // NUM_WG))

        @cute.struct
        class SharedStorage:
            sLSE2: cute.struct.Align[cute.struct.MemRange[Float32, tm], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, tm], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sPt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sdSt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()

        batch = mCuSeqlensQ.shape[0] - 1 if const_expr(self.varlen) else mQ.shape[0]
        self.kernel(mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
                    mSemaphore, num_n_blocks, mQ.shape[2] // mK.shape[2], softmax_scale_log2, softmax_scale,
                    tiled_mma_SdP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ,
                    sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout,
                    self._gmem_copy(d, True), self._gmem_copy(dv, True),
                    self._gmem_copy(d, False), self._gmem_copy(dv, False),
                    ).launch(grid=(num_n_blocks, mK.shape[2], batch), block=[self.num_threads, 1, 1], stream=stream)

    # -------------------------------------------------------------- device side
    @cute.jit
    def tile_bounds(self, num_n_blocks: Int32, total_q: Int32, total_k: Int32, mCuSeqlensQ: cute.Tensor,
                    mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor):
        """This CTA's (n_block, kv head, batch) and its sequence bounds. Varlen is a batch of one whose
        packed rows [offset, offset + seqlen) come from cu_seqlens; seqlen_k_rows are the keys that
        exist (dK / dV are written for all of them), seqlen_k those attended to (seqused_k), and
        stats_q the sequence's first row of lse2 / D."""
        if const_expr(hasattr(self.dq_order, "tile_for_launch")):
            # an order that also swizzles heads (stage 5's SPT) maps the whole launch index
            n_block, head_kv, batch = self.dq_order.tile_for_launch()
        else:
            bx, head_kv, batch = cute.arch.block_idx()
            n_block = self.dq_order.n_block_for_launch(bx, num_n_blocks)
        bidx = batch
        offset_q = Int32(0)
        stats_q = offset_q
        offset_k = Int32(0)
        seqlen_q = total_q
        seqlen_k_rows = total_k
        if const_expr(self.varlen):
            bidx = 0
            offset_q = mCuSeqlensQ[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
            stats_q = common.stats_offset(offset_q, batch)  # the preprocess's (aligned) rows of lse2 / D
            offset_k = mCuSeqlensK[batch]
            seqlen_k_rows = mCuSeqlensK[batch + 1] - offset_k
        seqlen_k = seqlen_k_rows
        if const_expr(self.has_seqused_k):
            seqlen_k = cutlass.min(mSeqUsedK[batch], seqlen_k_rows)
        return n_block, head_kv, batch, bidx, offset_q, stats_q, offset_k, seqlen_q, seqlen_k_rows, seqlen_k

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
               mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
               mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor,
               mSemaphore: cute.Tensor, num_n_blocks: Int32, qhead_per_kvhead: Int32,
               softmax_scale_log2: Float32, softmax_scale: Float32,
               tiled_mma_SdP: cute.TiledMma, tiled_mma_dV: cute.TiledMma, tiled_mma_dK: cute.TiledMma,
               tiled_mma_dQ: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sPdS_layout: cute.ComposedLayout,
               gmem_copy_QK: cute.TiledCopy, gmem_copy_VdO: cute.TiledCopy,
               gmem_store_dK: cute.TiledCopy, gmem_store_dV: cute.TiledCopy):
        tn = self.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        (n_block, head_kv, batch, bidx, offset_q, stats_q, offset_k, seqlen_q, seqlen_k_rows,
         seqlen_k) = self.tile_bounds(num_n_blocks, mQ.shape[1], mK.shape[1], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)

        if n_block * tn < seqlen_k_rows:
            smem = SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            walk = (seqlen_q, seqlen_k, seqlen_k_rows, offset_q, stats_q, offset_k, bidx, batch, head_kv, n_block,
                    qhead_per_kvhead)
            self.compute(walk, tidx, storage, mQ, mK, mV, mdO, mLSE2, mD, mdQacc, mdK, mdV, mSemaphore,
                         softmax_scale_log2, softmax_scale, tiled_mma_SdP, tiled_mma_dV, tiled_mma_dK,
                         tiled_mma_dQ, sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout,
                         gmem_copy_QK, gmem_copy_VdO, gmem_store_dK, gmem_store_dV)

    @cute.jit
    def compute(self, walk, tidx: Int32, storage, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                mdO: cute.Tensor, mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor,
                mdV: cute.Tensor, mSemaphore: cute.Tensor, softmax_scale_log2: Float32, softmax_scale: Float32,
                tiled_mma_SdP: cute.TiledMma, tiled_mma_dV: cute.TiledMma, tiled_mma_dK: cute.TiledMma,
                tiled_mma_dQ: cute.TiledMma, sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
                sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout, sPdS_layout: cute.ComposedLayout,
                gmem_copy_QK: cute.TiledCopy, gmem_copy_VdO: cute.TiledCopy, gmem_store_dK: cute.TiledCopy,
                gmem_store_dV: cute.TiledCopy):
        """Everything the 256 threads do for one K/V tile: load it, walk the Q tiles, store dK and dV."""
        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        (seqlen_q, seqlen_k, seqlen_k_rows, offset_q, stats_q, offset_k, bidx, batch, head_kv, n_block,
         qhead_per_kvhead) = walk

        sLSE2 = storage.sLSE2.get_tensor(cute.make_layout(tm))
        sD = storage.sD.get_tensor(cute.make_layout(tm))
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)        # (tm, d)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)    # (tm, dv)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)        # (tn, d)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)        # (tn, dv)
        sPt = storage.sPt.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner)  # (tn, tm)
        sdSt = storage.sdSt.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner)  # (tn, tm)
        # transposed views of the same bytes (MN-major operands)
        sQt = cute.composition(sQ, cute.make_ordered_layout((d, tm), order=(1, 0)))      # (d, tm)
        sdOt = cute.composition(sdO, cute.make_ordered_layout((dv, tm), order=(1, 0)))   # (dv, tm)
        sKt = cute.composition(sK, cute.make_ordered_layout((d, tn), order=(1, 0)))      # (d, tn)
        sdS = cute.composition(sdSt, cute.make_ordered_layout((tm, tn), order=(1, 0)))   # (tm, tn)

        # MMA partitions: smem operands become wgmma descriptors, accumulators registers
        thr_SdP = tiled_mma_SdP.get_slice(tidx)
        thr_dV = tiled_mma_dV.get_slice(tidx)
        thr_dK = tiled_mma_dK.get_slice(tidx)
        thr_dQ = tiled_mma_dQ.get_slice(tidx)
        tSrK = thr_SdP.make_fragment_A(thr_SdP.partition_A(sK))
        tSrQ = thr_SdP.make_fragment_B(thr_SdP.partition_B(sQ))
        tPrV = thr_SdP.make_fragment_A(thr_SdP.partition_A(sV))
        tPrdO = thr_SdP.make_fragment_B(thr_SdP.partition_B(sdO))
        tdVrPt = thr_dV.make_fragment_A(thr_dV.partition_A(sPt))
        tdVrdOt = thr_dV.make_fragment_B(thr_dV.partition_B(sdOt))
        tdKrdSt = thr_dK.make_fragment_A(thr_dK.partition_A(sdSt))
        tdKrQt = thr_dK.make_fragment_B(thr_dK.partition_B(sQt))
        tdQrdS = thr_dQ.make_fragment_A(thr_dQ.partition_A(sdS))
        tdQrKt = thr_dQ.make_fragment_B(thr_dQ.partition_B(sKt))
        acc_dV = cute.make_rmem_tensor(thr_dV.partition_shape_C((tn, dv)), Float32)
        acc_dK = cute.make_rmem_tensor(thr_dK.partition_shape_C((tn, d)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        # (key, query) coordinates of this thread's S^T elements, as (rows, cols)
        tScS_rc = acc_rowcol(thr_SdP.partition_C(cute.make_identity_tensor((tn, tm))))
        tdQcdQ = thr_dQ.partition_C(cute.make_identity_tensor((tm, d)))
        # accumulator (fp32) -> shared P^T / dS^T (bf16), 2 adjacent columns per store
        smem_copy_PdS = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma_SdP)
        thr_smem_PdS = smem_copy_PdS.get_slice(tidx)
        tPsPt = thr_smem_PdS.partition_D(sPt)
        tPsdSt = thr_smem_PdS.partition_D(sdSt)

        thr_copy_QK = gmem_copy_QK.get_slice(tidx)
        thr_copy_VdO = gmem_copy_VdO.get_slice(tidx)

        # 1. load K_j, V_j once (rows past the sequence zero-filled, so 0 * row is never NaN)
        gK = cute.local_tile(cute.domain_offset((offset_k, 0), mK[bidx, None, head_kv, None]), (tn, d), (n_block, 0))
        gV = cute.local_tile(cute.domain_offset((offset_k, 0), mV[bidx, None, head_kv, None]), (tn, dv), (n_block, 0))
        k_rows_left = seqlen_k_rows - n_block * tn
        self.load_rows(gmem_copy_QK, thr_copy_QK, gK, sK, (tn, d), k_rows_left)
        self.load_rows(gmem_copy_VdO, thr_copy_VdO, gV, sV, (tn, dv), k_rows_left)
        cute.arch.cp_async_commit_group()

        # 2. walk (query head of the group, Q tile)
        m_block_min, m_block_max = self.q_tile_range(n_block, seqlen_q, seqlen_k)
        for head_in_group in cutlass.range(qhead_per_kvhead, unroll=1):
            head = head_kv * qhead_per_kvhead + head_in_group
            gQ_all = cute.domain_offset((offset_q, 0), mQ[bidx, None, head, None])
            gdO_all = cute.domain_offset((offset_q, 0), mdO[bidx, None, head, None])
            gdQ_all = cute.domain_offset((offset_q, 0), mdQacc[bidx, None, head, None])
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                # 2a. every warp is done with the previous tile's shared memory; load Q_i, dO_i
                cute.arch.sync_threads()
                q_rows_left = seqlen_q - m_block * tm
                self.load_rows(gmem_copy_QK, thr_copy_QK, cute.local_tile(gQ_all, (tm, d), (m_block, 0)),
                               sQ, (tm, d), q_rows_left)
                self.load_rows(gmem_copy_VdO, thr_copy_VdO, cute.local_tile(gdO_all, (tm, dv), (m_block, 0)),
                               sdO, (tm, dv), q_rows_left)
                cute.arch.cp_async_commit_group()
                if tidx < tm:  # row statistics; rows past the sequence: P = 0 (lse2 = +inf), D = 0
                    row = m_block * tm + tidx
                    sLSE2[tidx] = Float32.inf
                    sD[tidx] = Float32(0.0)
                    if row < seqlen_q:
                        sLSE2[tidx] = mLSE2[bidx, head, stats_q + row]
                        sD[tidx] = mD[bidx, head, stats_q + row]
                cute.arch.cp_async_wait_group(0)
                # cp.async / st.shared are generic-proxy writes that wgmma reads through the
                # async proxy: fence in every writer, then the barrier publishes the tile
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()

                # 2b. S^T = K_j Q_i^T and dP^T = V_j dO_i^T, both in flight at once
                acc_S = cute.make_rmem_tensor(thr_SdP.partition_shape_C((tn, tm)), Float32)
                acc_dP = cute.make_rmem_tensor(thr_SdP.partition_shape_C((tn, tm)), Float32)
                warpgroup.fence()
                gemm_issue(tiled_mma_SdP, acc_S, tSrK, tSrQ, zero_init=True)
                gemm_issue(tiled_mma_SdP, acc_dP, tPrV, tPrdO, zero_init=True)
                warpgroup.wait_group(1)  # S^T is ready; dP^T may still run

                # 2c. P^T = exp2(S^T * scale_log2 - lse2), masked entries -> 0
                acc_S_rc = self.probs_from_scores(acc_S, tScS_rc, sLSE2, m_block, n_block, seqlen_q, seqlen_k,
                                                  softmax_scale_log2)
                tPrP = cute.make_rmem_tensor_like(acc_S, self.dtype)
                tPrP.store(acc_S.load().to(self.dtype))
                cute.copy(smem_copy_PdS, thr_smem_PdS.retile(tPrP), tPsPt)

                # 2d. dS^T = P^T * (dP^T - D)
                warpgroup.wait_group(0)
                self.ds_from_dp(acc_dP, acc_S_rc, tScS_rc, sD)
                tdSrdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
                tdSrdS.store(acc_dP.load().to(self.dtype))
                cute.copy(smem_copy_PdS, thr_smem_PdS.retile(tdSrdS), tPsdSt)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_threads()  # both warpgroups' halves of P^T / dS^T are in smem

                # 2e. dV += P^T dO, dK += dS^T Q, dQ = dS K: three groups, one wait
                acc_dQ = cute.make_rmem_tensor(thr_dQ.partition_shape_C((tm, d)), Float32)
                warpgroup.fence()
                gemm_issue(tiled_mma_dV, acc_dV, tdVrPt, tdVrdOt, zero_init=False)
                gemm_issue(tiled_mma_dK, acc_dK, tdKrdSt, tdKrQt, zero_init=False)
                gemm_issue(tiled_mma_dQ, acc_dQ, tdQrdS, tdQrKt, zero_init=True)
                warpgroup.wait_group(0)

                # 2f. dQaccum_i += dQ_i (fp32 atomics; deterministic: in the order's turn)
                tdQgdQ = thr_dQ.partition_C(cute.local_tile(gdQ_all, (tm, d), (m_block, 0)))
                self.add_dq(acc_dQ, tdQgdQ, tdQcdQ, q_rows_left, mSemaphore, walk, head, m_block, tidx)

        # 3. epilogue: dK *= softmax_scale; registers -> smem (over sK / sV) -> 16-byte stores.
        #    An empty walk (a varlen sequence without queries, keys past seqused_k) never waited
        #    for the K/V cp.async: wait now, or it could land on top of the dK/dV staging.
        cute.arch.cp_async_wait_group(0)
        cute.arch.sync_threads()  # every wgmma that read sK / sV has completed
        acc_dK.store(acc_dK.load() * softmax_scale)
        self.store_tile(acc_dK, tiled_mma_dK, sK, gmem_store_dK, tidx,
                        cute.local_tile(cute.domain_offset((offset_k, 0), mdK[bidx, None, head_kv, None]),
                                        (tn, d), (n_block, 0)), (tn, d), k_rows_left)
        self.store_tile(acc_dV, tiled_mma_dV, sV, gmem_store_dV, tidx,
                        cute.local_tile(cute.domain_offset((offset_k, 0), mdV[bidx, None, head_kv, None]),
                                        (tn, dv), (n_block, 0)), (tn, dv), k_rows_left)

    # -------------------------------------------------------------- helpers (device)
    @cute.jit
    def q_tile_range(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """The Q tiles [m_block_min, m_block_max) this K/V tile adds into: causal starts at its
        diagonal (key j is visible from query i iff j <= i + seqlen_k - seqlen_q), and a tile past
        the used keys (seqused_k) adds into nothing."""
        m_block_min, m_block_max = schedule.m_block_range(n_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k,
                                                          self.causal, imax=cutlass.max)
        m_block_min = Int32(m_block_min)
        if n_block * self.tile_n >= seqlen_k:
            m_block_max = m_block_min
        return m_block_min, m_block_max

    @cute.jit
    def probs_from_scores(self, acc_S: cute.Tensor, tScS_rc: cute.Tensor, sLSE2: cute.Tensor, m_block: Int32,
                          n_block: Int32, seqlen_q: Int32, seqlen_k: Int32, softmax_scale_log2: Float32):
        """P^T = exp2(S^T * scale_log2 - lse2) in place over the S^T accumulator; masked entries
        (keys past seqlen_k, causal) become 0. Returns the (rows, cols) view of it."""
        tm, tn = self.tile_m, self.tile_n
        acc_S_rc = acc_rowcol(acc_S)
        key_limit, diag = schedule.mask_bounds(m_block, n_block, tm, tn, seqlen_q, seqlen_k)
        needs_mask = schedule.tile_needs_mask(key_limit, diag, tn, self.causal)
        for c in cutlass.range_constexpr(cute.size(tScS_rc, mode=[1])):
            col = tScS_rc[0, c][1]
            lse2 = sLSE2[col]
            for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
                s = acc_S_rc[r, c]
                if needs_mask:
                    if schedule.is_masked(tScS_rc[r, c][0], col, key_limit, diag, self.causal):
                        s = -Float32.inf
                acc_S_rc[r, c] = cute.math.exp2(s * softmax_scale_log2 - lse2, fastmath=True)
        return acc_S_rc

    @cute.jit
    def ds_from_dp(self, acc_dP: cute.Tensor, acc_S_rc: cute.Tensor, tScS_rc: cute.Tensor, sD: cute.Tensor):
        """dS^T = P^T * (dP^T - D) in place over the dP^T accumulator."""
        acc_dP_rc = acc_rowcol(acc_dP)
        for c in cutlass.range_constexpr(cute.size(tScS_rc, mode=[1])):
            dpsum = sD[tScS_rc[0, c][1]]
            for r in cutlass.range_constexpr(cute.size(acc_dP_rc, mode=[0])):
                acc_dP_rc[r, c] = acc_S_rc[r, c] * (acc_dP_rc[r, c] - dpsum)

    @cute.jit
    def add_dq(self, acc_dQ: cute.Tensor, tdQgdQ: cute.Tensor, tdQcdQ: cute.Tensor, q_rows_left: Int32,
               mSemaphore: cute.Tensor, walk, head: Int32, m_block: Int32, tidx: Int32):
        """dQaccum_i += dQ_i with fp32 atomics on rows < q_rows_left; deterministic: wait for this
        CTA's turn on the tile's semaphore, add, then release the next CTA."""
        (seqlen_q, seqlen_k, seqlen_k_rows, offset_q, stats_q, offset_k, bidx, batch, head_kv, n_block,
         qhead_per_kvhead) = walk
        if const_expr(self.deterministic):
            n_block_last = schedule.n_block_last(m_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, self.causal,
                                                 imin=cutlass.min)
            sem = common.elem_pointer(mSemaphore, (batch, head, m_block))
            common.semaphore_wait(sem, self.dq_order.rank(n_block, Int32(0), n_block_last), tidx)
            cute.arch.sync_threads()
        for i in cutlass.range_constexpr(cute.size(acc_dQ) // 2):
            if tdQcdQ[2 * i][0] < q_rows_left:
                common.red_add_f32x2(common.elem_pointer(tdQgdQ, 2 * i), acc_dQ[2 * i], acc_dQ[2 * i + 1])
        if const_expr(self.deterministic):
            cute.arch.sync_threads()  # every thread's adds precede thread 0's release
            common.semaphore_signal(sem, tidx)

    @cute.jit
    def load_rows(self, tiled_copy: cute.TiledCopy, thr_copy, gX: cute.Tensor, sX: cute.Tensor,
                  shape: cutlass.Constexpr, rows_left: Int32):
        """cp.async a (rows, cols) tile; rows >= rows_left are zero-filled instead."""
        tXgX, tXsX = thr_copy.partition_S(gX), thr_copy.partition_D(sX)
        tXcX = thr_copy.partition_S(cute.make_identity_tensor(shape))
        for m in cutlass.range_constexpr(cute.size(tXsX.shape[1])):
            if tXcX[0, m, 0][0] < rows_left:
                cute.copy(tiled_copy, tXgX[None, m, None], tXsX[None, m, None])
            else:
                tXsX[None, m, None].fill(0)

    @cute.jit
    def store_tile(self, acc: cute.Tensor, tiled_mma: cute.TiledMma, sX: cute.Tensor, gmem_copy: cute.TiledCopy,
                   tidx: Int32, gX: cute.Tensor, shape: cutlass.Constexpr, rows_left: Int32):
        """fp32 accumulator -> dtype -> smem (accumulator layout) -> row-guarded 16-byte stores."""
        rX = cute.make_rmem_tensor_like(acc, self.dtype)
        rX.store(acc.load().to(self.dtype))
        smem_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma)
        thr_smem = smem_copy.get_slice(tidx)
        cute.copy(smem_copy, thr_smem.retile(rX), thr_smem.partition_D(sX))
        cute.arch.sync_threads()
        thr_copy = gmem_copy.get_slice(tidx)
        tXsX, tXgX = thr_copy.partition_S(sX), thr_copy.partition_D(gX)
        tXcX = thr_copy.partition_S(cute.make_identity_tensor(shape))
        tXrX = cute.make_rmem_tensor_like(tXsX, self.dtype)
        cute.autovec_copy(tXsX, tXrX)
        for m in cutlass.range_constexpr(cute.size(tXgX.shape[1])):
            if tXcX[0, m, 0][0] < rows_left:
                cute.copy(gmem_copy, tXrX[None, m, None], tXgX[None, m, None])


# ------------------------------------------------------------------------------------------------
# Host API
# ------------------------------------------------------------------------------------------------
def make_kernel(dtype, head_dim, head_dim_v, causal, deterministic, *, varlen=False, has_seqused_k=False,
                dq_order=None, tiles=None):
    tm, tn = tiles if tiles is not None else (None, None)
    return FlashAttentionBackwardSm90Step1(dtype, head_dim, head_dim_v, causal, deterministic, varlen=varlen,
                                           has_seqused_k=has_seqused_k, tile_m=tm, tile_n=tn, dq_order=dq_order)


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, varlen=False,
                 has_seqused_k=False, dq_order=None, tiles=None) -> common.Compiled:
    """Compile for sm_90a with fake tensors (no GPU needed); returns the compiled kernel + report."""
    from stage4_bwd_kernel import host

    return host.compile_fake(STEP, make_kernel, dtype=dtype, head_dim=head_dim,
                             head_dim_v=head_dim if head_dim_v is None else head_dim_v, causal=causal,
                             deterministic=deterministic, varlen=varlen, has_seqused_k=has_seqused_k,
                             dq_order=dq_order, tiles=tiles)


def attention_backward(q, k, v, out, dout, lse, *, softmax_scale=None, causal=False, deterministic=False,
                       dq=None, dk=None, dv=None, dq_order=None, tiles=None):
    """(B,S,H,D) CUDA fp16/bf16 q, k, v, out, dout and lse (B,Hq,Sq) fp32 -> (dq, dk, dv)."""
    from stage4_bwd_kernel import host

    return host.backward(STEP, make_kernel, q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal,
                         deterministic=deterministic, dq=dq, dk=dk, dv=dv, dq_order=dq_order, tiles=tiles)


def attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              seqused_k=None, softmax_scale=None, causal=False, deterministic=False,
                              dq_order=None, tiles=None):
    """Packed (T,H,D) q, k, v, out, dout, lse (Hq, Tq) fp32, int32 cu_seqlens -> (dq, dk, dv)."""
    from stage4_bwd_kernel import host

    return host.backward(STEP, make_kernel, q, k, v, out, dout, lse, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         seqused_k=seqused_k, softmax_scale=softmax_scale, causal=causal,
                         deterministic=deterministic, dq_order=dq_order, tiles=tiles)


def run(batch=2, seqlen_q=1024, seqlen_k=None, heads=8, heads_kv=None, head_dim=128, head_dim_v=None,
        causal=False, deterministic=False, dtype="bf16", check=True, compare_deterministic=True, verbose=True):
    """On a Hopper GPU: check dq/dk/dv against autograd (FA4 rule), time, and time deterministic vs
    default. Otherwise: compile for sm_90a and print the resource report."""
    from stage4_bwd_kernel import host

    return host.run_step(STEP, compile_only, attention_backward, batch=batch, seqlen_q=seqlen_q,
                         seqlen_k=seqlen_q if seqlen_k is None else seqlen_k, heads=heads,
                         heads_kv=heads if heads_kv is None else heads_kv, head_dim=head_dim,
                         head_dim_v=head_dim if head_dim_v is None else head_dim_v, causal=causal,
                         deterministic=deterministic, dtype=dtype, check=check,
                         compare_deterministic=compare_deterministic, verbose=verbose)


if __name__ == "__main__":
    from stage4_bwd_kernel import host

    host.cli(run, __doc__)
