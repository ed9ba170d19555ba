"""Stage 4, Hopper step 3: P^T and dS^T stay in registers as the A operand of dV and dK (RS wgmma).

Compared with the previous step, this adds **register-sourced (RS) wgmmas for dV += P^T dO and
dK += dS^T Q**, because step 2's tile is shared-memory bound: its five GEMMs read both operands from
shared memory, P^T and dS^T make a round trip through it (registers -> ``st.shared`` -> wgmma), and
with the warpgroups splitting N each of them reads every A operand whole. A wgmma can take its A
operand from registers (``warpgroup.OperandSource.RMEM``; B always comes from shared memory), so
once each warpgroup owns the rows of P^T and dS^T that its wgmmas need, they go from the softmax
math straight into the tensor cores.

What changes:

* The consumer warpgroups split the keys (M) instead of the queries / head dim (N). A register A
  operand holds the rows of the issuing warpgroup's own 64-row wgmma, so the warpgroup that
  multiplies P^T by dO must own P^T's rows. S^T, dP^T, dV and dK all have the keys as rows, so
  consumer w takes keys [64 w, 64 w + 64) in all four: S^T and dP^T for its keys and every query of
  the tile, dV and dK for its keys and every column. Hence tile_n = 2 x 64 = 128.
* The fp32 accumulator of a 64-row wgmma and the 16-bit A fragment of the next one hold the same
  (row, column) pairs in the same register order: the accumulator's column group j (8 columns) is
  half j % 2 of the A fragment's k-block j // 2 (``tests/test_stage4_step3.py`` checks it thread by
  thread). So P^T becomes dV's A operand by a plain fp32 -> 16-bit conversion, read through a view
  with the A fragment's shape: no shuffle, no shared memory.
* dQ = dS K needs all 128 keys of dS, which the two warpgroups computed between them: dS^T still
  goes to shared memory (one store per element instead of P^T's and dS^T's two), and the dQ wgmma
  is step 2's (SS, head dim split). dV and dK need no barrier (each warpgroup reads its own
  registers and the Q / dO stage); they are issued where step 2 issues them, after the barrier that
  publishes dS^T, so step 2's pipeline and barrier protocol is unchanged.
* Q and dO are the B operands of dK and dV with N = d whole in one warpgroup: their swizzle is sized
  for d instead of d / 2.

Arithmetic (H100, bf16, tile 64 x 128, KB per tile; ``roofline.hopper_tile_cycles``: 128 B/clk of
shared memory, every 64-row block of a wgmma reads its B slice, a shared-memory A operand is read
by each warpgroup that uses it):

                              S^T   dP^T   dV   dK   dQ   P^T / dS^T stored   total
    step 2 (N split, all SS)   96    96    64   64   64          32            416 KB = 3328 clk
    step 3 (M split, dV/dK RS) 64    64    32   32   64          16            272 KB = 2176 clk

K and V are read once instead of once per warpgroup (the key split), P^T and dS^T are not read as
A (RS), and P^T is not stored: 144 KB less per tile. The tensor cores need 10 x 64 x 128 x 128 /
4096 = 2560 clk, so at d = 128 the tile goes from SMEM-bound (3328, 1.30x the MMA time) to MMA-
bound. d = 64: 2176 -> 1280 clk (MMA 1280); d = 96: 2752 -> 1728 (MMA 1920).

Registers per consumer thread (fp32 unless noted): dK d/2, dV dv/2, S^T and dP^T 64 x 64 / 128 = 32
each and dQ d/4, as in step 2; new are the 16-bit P^T and dS^T fragments, 16 registers each, live
until the dV / dK wgmmas have read them (step 2's died at their shared-memory store). Peak while
dS^T is formed, d = 128: 64 + 64 + 32 + 32 + 16 = 208 of the 240 that ``setmaxnreg`` gives a
consumer; d = 96: 176; d = 64: 144. The price of the key split: a thread now holds 2 rows x 16
columns of S^T instead of 4 rows x 8, so it reads twice as many per-column statistics (lse2, D).
**(192, 128) and (256, 256) do not fit**: tile_n is 128 here, so dK + dV alone take 64 (d + dv) /
128 = 160 / 256 registers, before S^T, dP^T, the fragments and dQ (step 2 gave them 64-key tiles
split by N); built anyway, (192, 128) spills 304 bytes and ptxas serializes its wgmmas (C7511).
They raise ValueError; steps 1 and 2 serve them.

Shared memory = K + V + stages * (Q + dO) + dS^T (P^T's buffer is gone):
  d=64 (64 x 128): 16 + 16 + 2 * 16 + 16 = 80 KB    d=96: 24 + 24 + 2 * 24 + 16 = 112 KB
  d=128 (64 x 128): 32 + 32 + 2 * 32 + 16 = 144 KB

Why this technique before the others of the product kernel: by the roofline above the tile is
shared-memory bound, and only a change of the GEMMs' operands removes shared-memory traffic. Moving
dQ's fp32 atomics to a writer warp with TMA reduce-adds (the other candidate) frees the math warps
from the atomics but routes dQ through shared memory (64 KB more per tile at d = 128), so it pays
only once the tile is no longer SMEM-bound. That, other tiles, and the rest of the tuning are in
the product kernel, ``stage4_bwd_kernel.hopper``, not here.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory.smem import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from stage3_fwd_kernel.compile_cache import Compiled
from stage3_fwd_kernel.hopper_step1_wgmma import acc_rowcol
from stage4_bwd_kernel import common, schedule
from stage4_bwd_kernel.hopper_step1 import gemm_issue

STEP = "hopper_bwd_step3_rs"
NUM_WG_MMA = 2
NUM_THREADS = 128 * (1 + NUM_WG_MMA)
CONSUMER_BARRIER = 1  # named barrier of the 256 consumer threads (0 is __syncthreads)
RS_HEAD_DIMS = ((64, 64), (96, 96), (128, 128))


def default_tiles(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """(tile_m, tile_n) = (64, 128) for every head dim this step serves: 64 keys per consumer
    warpgroup (one wgmma M), and 64 queries (dQ's M; 128 would double S^T and dP^T to 64 registers
    each)."""
    if (head_dim, head_dim_v) not in RS_HEAD_DIMS:
        need = 64 * (head_dim + head_dim_v) // 128 + 2 * 32 + 16  # dK + dV, S^T + dP^T, 16-bit P^T
        raise ValueError(f"head_dim: {STEP} supports (q/k, v) head dims {RS_HEAD_DIMS}, got {(head_dim, head_dim_v)}: "
                         f"with 128 keys per tile its accumulators would take {need} of a consumer's 240 registers "
                         "before dQ and addresses (module docstring); steps 1 and 2 serve it")
    return 64, 64 * NUM_WG_MMA


class FlashAttentionBackwardSm90Step3:
    """Step 2 with the keys split across the consumer warpgroups and dV / dK as RS wgmmas."""

    def __init__(self, dtype, head_dim: int, head_dim_v: int, causal: bool, deterministic: bool = False, *,
                 varlen: bool = False, has_seqused_k: bool = False, tile_m: int | None = None,
                 tile_n: int | None = None, num_stages: int = 2, dq_order=None):
        common.check_head_dims(head_dim, head_dim_v)
        dm, dn = default_tiles(head_dim, head_dim_v)
        self.tile_m = tile_m or dm
        self.tile_n = tile_n or dn
        if self.tile_n != 64 * NUM_WG_MMA or self.tile_m % 64:
            raise ValueError(f"tiles: {STEP} needs tile_n = {64 * NUM_WG_MMA} (64 keys per consumer warpgroup) and "
                             f"tile_m a multiple of 64 (dQ's wgmma M), got {self.tile_m} x {self.tile_n}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.deterministic = deterministic
        self.varlen = varlen
        self.has_seqused_k = has_seqused_k
        self.num_stages = num_stages
        self.dq_order = dq_order or common.default_dq_order(causal, deterministic, head_dim=head_dim)
        self.num_threads = NUM_THREADS
        self.regs_producer, self.regs_consumer = 24, 240
        self.smem_bytes = None

    # -------------------------------------------------------------- host side (traced once)
    def _smem_layout(self, rows: int, cols: int, major_mode_size: int, stages: int | None = None):
        """Row-major (rows, cols) tile, swizzle atom sized for `major_mode_size` (step 1), with an
        optional trailing stage mode."""
        atom_kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, major_mode_size)
        atom = warpgroup.make_smem_layout_atom(atom_kind, self.dtype)
        if stages is None:
            return cute.tile_to_shape(atom, (rows, cols), (0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))

    def _gmem_store(self, cols: int):
        """256 consumer threads, 16-byte stores, a 128/64/32-byte row chunk per thread group."""
        elems = 128 // self.dtype.width
        atom_cols = 64 if cols % 64 == 0 else (32 if cols % 32 == 0 else 16)
        threads_per_row = atom_cols // elems
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        thr = cute.make_ordered_layout((128 * NUM_WG_MMA // threads_per_row, threads_per_row), order=(1, 0))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))

    def make_tiled_mmas(self) -> tuple:
        """(S^T and dP^T, dV, dK, dQ) wgmma tilings. The first three split the keys (M) between the
        consumer warpgroups, so the accumulator rows of S^T / dP^T are the A rows of dV / dK."""
        tm, d, dv = self.tile_m, self.head_dim, self.head_dim_v
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        wg_m, wg_n = (NUM_WG_MMA, 1, 1), (1, NUM_WG_MMA, 1)
        # S^T, dP^T (tn x tm): 64 keys and every query of the tile per warpgroup
        tiled_mma_SdP = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32,
                                                          wg_m, (64, tm))
        # dV (tn x dv) += P^T dO, dK (tn x d) += dS^T Q: the same keys, A from registers
        tiled_mma_dV = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32,
                                                         wg_m, (64, dv), a_source=warpgroup.OperandSource.RMEM)
        tiled_mma_dK = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32,
                                                         wg_m, (64, d), a_source=warpgroup.OperandSource.RMEM)
        # dQ (tm x d) = dS K: step 2's, both operands in SMEM, the warpgroups split d
        tiled_mma_dQ = sm90_utils.make_trivial_tiled_mma(self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32,
                                                         wg_n, (64, d // NUM_WG_MMA))
        return tiled_mma_SdP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
                 mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
                 mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor,
                 mSemaphore: cute.Tensor, num_n_blocks: Int32, softmax_scale_log2: Float32,
                 softmax_scale: Float32, stream):
        # same arguments as step 1 (see there for shapes)
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mdO.element_type
                           == mdK.element_type == mdV.element_type == self.dtype)):
            raise TypeError("q, k, v, dout, dk, dv must share the kernel's dtype")
        tm, tn, d, dv, stages = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        mQ, mK, mdK = (common.assume_aligned(t, d) for t in (mQ, mK, mdK))
        mV, mdO, mdV = (common.assume_aligned(t, dv) for t in (mV, mdO, mdV))
        mdQacc = common.assume_aligned(mdQacc, d)

        # Q / dO: the B of dK / dV with N = d / dv whole in one warpgroup, so the swizzle is sized for it
        sQ_layout = self._smem_layout(tm, d, d, stages)
        sdO_layout = self._smem_layout(tm, dv, dv, stages)
        sK_layout = self._smem_layout(tn, d, d // NUM_WG_MMA)
        sV_layout = self._smem_layout(tn, dv, dv // NUM_WG_MMA)
        sdSt_layout = self._smem_layout(tn, tm, tm)  # dS^T only: P^T never leaves the registers

        tiled_mma_SdP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ = self.make_tiled_mmas()

        # TMA: (B, S, H, D) seen as (S, D, H, B) so a (rows, head_dim) box tiles the first two modes
        def seq_dim_first(t):
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mQ), cute.slice_(sQ_layout, (None, None, 0)), (tm, d))
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mdO), cute.slice_(sdO_layout, (None, None, 0)), (tm, dv))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(tma_load, seq_dim_first(mK), sK_layout, (tn, d))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(tma_load, seq_dim_first(mV), sV_layout, (tn, dv))
        self.tma_bytes_Q = cute.size_in_bytes(self.dtype, cute.slice_(sQ_layout, (None, None, 0)))
        self.tma_bytes_dO = cute.size_in_bytes(self.dtype, cute.slice_(sdO_layout, (None, None, 0)))
        self.tma_bytes_KV = cute.size_in_bytes(self.dtype, sK_layout) + cute.size_in_bytes(self.dtype, sV_layout)

        @cute.struct
        class SharedStorage:
            mbar_KV: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_dO: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sLSE2: cute.struct.Align[cute.struct.MemRange[Float32, tm], 128]
            sD: cute.struct.Align[cute.struct.MemRange[Float32, tm], 128]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sdSt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdSt_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()

        batch = mCuSeqlensQ.shape[0] - 1 if const_expr(self.varlen) else mQ.shape[0]
        self.kernel(tma_Q, tma_dO, tma_K, tma_V, mQ.shape[1], mK.shape[1], mLSE2, mD, mdQacc, mdK, mdV,
                    mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSemaphore, num_n_blocks, mQ.shape[2] // mK.shape[2],
                    softmax_scale_log2, softmax_scale,
                    tma_atom_Q, tma_atom_dO, tma_atom_K, tma_atom_V,
                    tiled_mma_SdP, tiled_mma_dV, tiled_mma_dK, tiled_mma_dQ,
                    sQ_layout, sdO_layout, sK_layout, sV_layout, sdSt_layout,
                    self._gmem_store(d), self._gmem_store(dv),
                    # min_blocks_per_mp=1 caps registers at entry (65536/384), which setmaxnreg needs
                    ).launch(grid=(num_n_blocks, mK.shape[2], batch), block=[self.num_threads, 1, 1],
                             stream=stream, min_blocks_per_mp=1)

    # -------------------------------------------------------------- device side
    @cute.jit
    def tile_bounds(self, num_n_blocks: Int32, total_q: Int32, total_k: Int32, mCuSeqlensQ: cute.Tensor,
                    mCuSeqlensK: cute.Tensor, mSeqUsedK: cute.Tensor):
        """This CTA's (n_block, kv head, batch) and its sequence bounds. Varlen is a batch of one whose
        packed rows [offset, offset + seqlen) come from cu_seqlens; seqlen_k_rows are the keys that
        exist (dK / dV are written for all of them), seqlen_k those attended to (seqused_k)."""
        if const_expr(hasattr(self.dq_order, "tile_for_launch")):
            # an order that also swizzles heads (stage 5's SPT) maps the whole launch index
            n_block, head_kv, batch = self.dq_order.tile_for_launch()
        else:
            bx, head_kv, batch = cute.arch.block_idx()
            n_block = self.dq_order.n_block_for_launch(bx, num_n_blocks)
        bidx = batch
        offset_q = Int32(0)
        offset_k = Int32(0)
        seqlen_q = total_q
        seqlen_k_rows = total_k
        if const_expr(self.varlen):
            bidx = 0
            offset_q = mCuSeqlensQ[batch]
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
            offset_k = mCuSeqlensK[batch]
            seqlen_k_rows = mCuSeqlensK[batch + 1] - offset_k
        seqlen_k = seqlen_k_rows
        if const_expr(self.has_seqused_k):
            seqlen_k = cutlass.min(mSeqUsedK[batch], seqlen_k_rows)
        return n_block, head_kv, batch, bidx, offset_q, offset_k, seqlen_q, seqlen_k_rows, seqlen_k

    def make_pipelines(self, storage):
        """K/V (one stage) and the Q / dO rings. Producer = 1 arrival (the elected lane of warp 0
        posts the byte count); consumers = the 8 warps of the two MMA warpgroups. Ends with the last
        CTA-wide barrier: the inits are visible to every thread and to the TMA unit."""
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_WG_MMA * 4)
        pipes = [pipeline.PipelineTmaAsync.create(barrier_storage=bar.data_ptr(), num_stages=n,
                                                  producer_group=producer_group, consumer_group=consumer_group,
                                                  tx_count=tx, defer_sync=True)
                 for bar, n, tx in ((storage.mbar_KV, 1, self.tma_bytes_KV),
                                    (storage.mbar_Q, self.num_stages, self.tma_bytes_Q),
                                    (storage.mbar_dO, self.num_stages, self.tma_bytes_dO))]
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return pipes

    @cute.jit
    def make_walk(self, n_block: Int32, head_kv: Int32, batch: Int32, bidx: Int32, offset_q: Int32,
                  offset_k: Int32, seqlen_q: Int32, seqlen_k_rows: Int32, seqlen_k: Int32, qhead_per_kvhead: Int32):
        """Bounds + the Q tiles [m_block_min, m_block_max) this K/V tile adds into: causal starts at
        its diagonal (key j is visible from query i iff j <= i + seqlen_k - seqlen_q), and a tile past
        the used keys (seqused_k) adds into nothing. Every role unpacks this tuple."""
        m_block_min, m_block_max = schedule.m_block_range(n_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k,
                                                          self.causal, imax=cutlass.max)
        m_block_min = Int32(m_block_min)
        if n_block * self.tile_n >= seqlen_k:
            m_block_max = m_block_min
        return (seqlen_q, seqlen_k, seqlen_k_rows, offset_q, offset_k, bidx, batch, head_kv, n_block,
                m_block_min, m_block_max, qhead_per_kvhead)

    @cute.kernel
    def kernel(self, tma_Q: cute.Tensor, tma_dO: cute.Tensor, tma_K: cute.Tensor, tma_V: cute.Tensor,
               total_q: Int32, total_k: Int32, mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor,
               mdK: cute.Tensor, mdV: cute.Tensor, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
               mSeqUsedK: cute.Tensor, mSemaphore: cute.Tensor, num_n_blocks: Int32, qhead_per_kvhead: Int32,
               softmax_scale_log2: Float32, softmax_scale: Float32,
               tma_atom_Q: cute.CopyAtom, tma_atom_dO: cute.CopyAtom, tma_atom_K: cute.CopyAtom,
               tma_atom_V: cute.CopyAtom,
               tiled_mma_SdP: cute.TiledMma, tiled_mma_dV: cute.TiledMma, tiled_mma_dK: cute.TiledMma,
               tiled_mma_dQ: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sdSt_layout: cute.ComposedLayout,
               gmem_store_dK: cute.TiledCopy, gmem_store_dV: cute.TiledCopy):
        tn = self.tile_n
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group_idx = cute.arch.make_warp_uniform(tidx // 128)
        n_block, head_kv, batch, bidx, offset_q, offset_k, seqlen_q, seqlen_k_rows, seqlen_k = self.tile_bounds(
            num_n_blocks, total_q, total_k, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)

        if n_block * tn < seqlen_k_rows:
            if warp_idx == 0:
                cpasync.prefetch_descriptor(tma_atom_Q)
                cpasync.prefetch_descriptor(tma_atom_dO)
                cpasync.prefetch_descriptor(tma_atom_K)
                cpasync.prefetch_descriptor(tma_atom_V)
            smem = SmemAllocator()
            storage = smem.allocate(self.shared_storage)
            pipe_KV, pipe_Q, pipe_dO = self.make_pipelines(storage)
            walk = self.make_walk(n_block, head_kv, batch, bidx, offset_q, offset_k, seqlen_q, seqlen_k_rows,
                                  seqlen_k, qhead_per_kvhead)

            if warp_group_idx == 0:
                # ---------------------------------------------------------------- producer
                cute.arch.setmaxregister_decrease(self.regs_producer)
                if warp_idx == 0:
                    self.produce(walk, storage, tma_Q, tma_dO, tma_K, tma_V, tma_atom_Q, tma_atom_dO,
                                 tma_atom_K, tma_atom_V, sQ_layout, sdO_layout, sK_layout, sV_layout,
                                 pipe_KV, pipe_Q, pipe_dO)
            else:
                # ---------------------------------------------------------------- consumers
                cute.arch.setmaxregister_increase(self.regs_consumer)
                self.consume(walk, tidx - 128, storage, mLSE2, mD, mdQacc, mdK, mdV, mSemaphore,
                             softmax_scale_log2, softmax_scale, tiled_mma_SdP, tiled_mma_dV, tiled_mma_dK,
                             tiled_mma_dQ, sQ_layout, sdO_layout, sK_layout, sV_layout, sdSt_layout,
                             gmem_store_dK, gmem_store_dV, pipe_KV, pipe_Q, pipe_dO)

    # -------------------------------------------------------------- producer warp
    @cute.jit
    def produce(self, walk, storage, tma_Q: cute.Tensor, tma_dO: cute.Tensor, tma_K: cute.Tensor,
                tma_V: cute.Tensor, tma_atom_Q: cute.CopyAtom, tma_atom_dO: cute.CopyAtom,
                tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom, sQ_layout: cute.ComposedLayout,
                sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
                pipe_KV, pipe_Q, pipe_dO):
        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        (seqlen_q, seqlen_k, seqlen_k_rows, offset_q, offset_k, bidx, batch, head_kv, n_block,
         m_block_min, m_block_max, qhead_per_kvhead) = walk
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        # 1. K_j and V_j on one barrier
        gK = cute.local_tile(cute.domain_offset((offset_k, 0), tma_K[None, None, head_kv, bidx]), (tn, d), (n_block, 0))
        gV = cute.local_tile(cute.domain_offset((offset_k, 0), tma_V[None, None, head_kv, bidx]), (tn, dv), (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        kv_state = pipeline.PipelineState(1, Int32(0), Int32(0), Int32(1))
        pipe_KV.producer_acquire(kv_state)
        cute.copy(tma_atom_K, tKgK, tKsK, tma_bar_ptr=pipe_KV.producer_get_barrier(kv_state))
        cute.copy(tma_atom_V, tVgV, tVsV, tma_bar_ptr=pipe_KV.producer_get_barrier(kv_state))

        # 2. Q_i, dO_i for every tile of the walk, each as soon as its stage is free
        n_m = m_block_max - m_block_min
        for head_in_group in cutlass.range(qhead_per_kvhead, unroll=1):
            head = head_kv * qhead_per_kvhead + head_in_group
            gQ = cute.local_tile(cute.domain_offset((offset_q, 0), tma_Q[None, None, head, bidx]), (tm, d), (None, 0))
            gdO = cute.local_tile(cute.domain_offset((offset_q, 0), tma_dO[None, None, head, bidx]), (tm, dv), (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            tdOsdO, tdOgdO = cpasync.tma_partition(tma_atom_dO, 0, cute.make_layout(1), cute.group_modes(sdO, 0, 2),
                                                   cute.group_modes(gdO, 0, 2))
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                t = head_in_group * n_m + m_block - m_block_min
                st = self.tile_state(t, producer=True)
                pipe_Q.producer_acquire(st)
                cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, st.index],
                          tma_bar_ptr=pipe_Q.producer_get_barrier(st))
                pipe_dO.producer_acquire(st)
                cute.copy(tma_atom_dO, tdOgdO[None, m_block], tdOsdO[None, st.index],
                          tma_bar_ptr=pipe_dO.producer_get_barrier(st))

    # -------------------------------------------------------------- consumer warpgroups
    @cute.jit
    def consume(self, walk, ctidx: Int32, storage, mLSE2: cute.Tensor, mD: cute.Tensor, mdQacc: cute.Tensor,
                mdK: cute.Tensor, mdV: cute.Tensor, mSemaphore: cute.Tensor, softmax_scale_log2: Float32,
                softmax_scale: Float32, tiled_mma_SdP: cute.TiledMma, tiled_mma_dV: cute.TiledMma,
                tiled_mma_dK: cute.TiledMma, tiled_mma_dQ: cute.TiledMma, sQ_layout: cute.ComposedLayout,
                sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
                sdSt_layout: cute.ComposedLayout, gmem_store_dK: cute.TiledCopy, gmem_store_dV: cute.TiledCopy,
                pipe_KV, pipe_Q, pipe_dO):
        """Step 1's per-tile math on the 256 consumer threads (ctidx 0..255)."""
        tm, tn, d, dv, stages = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        (seqlen_q, seqlen_k, seqlen_k_rows, offset_q, offset_k, bidx, batch, head_kv, n_block,
         m_block_min, m_block_max, qhead_per_kvhead) = walk
        nthr = 128 * NUM_WG_MMA

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)          # (tm, d, stages)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)      # (tm, dv, stages)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)          # (tn, d)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)          # (tn, dv)
        sdSt = storage.sdSt.get_tensor(sdSt_layout.outer, swizzle=sdSt_layout.inner)  # (tn, tm)
        sQt = cute.composition(sQ, cute.make_ordered_layout((d, tm, stages), order=(1, 0, 2)))
        sdOt = cute.composition(sdO, cute.make_ordered_layout((dv, tm, stages), order=(1, 0, 2)))
        sKt = cute.composition(sK, cute.make_ordered_layout((d, tn), order=(1, 0)))
        sdS = cute.composition(sdSt, cute.make_ordered_layout((tm, tn), order=(1, 0)))

        thr_SdP = tiled_mma_SdP.get_slice(ctidx)
        thr_dV = tiled_mma_dV.get_slice(ctidx)
        thr_dK = tiled_mma_dK.get_slice(ctidx)
        thr_dQ = tiled_mma_dQ.get_slice(ctidx)
        tSrK = thr_SdP.make_fragment_A(thr_SdP.partition_A(sK))        # this warpgroup's 64 keys
        tSrQ = thr_SdP.make_fragment_B(thr_SdP.partition_B(sQ))        # (..., stages)
        tPrV = thr_SdP.make_fragment_A(thr_SdP.partition_A(sV))
        tPrdO = thr_SdP.make_fragment_B(thr_SdP.partition_B(sdO))      # (..., stages)
        tdVrdOt = thr_dV.make_fragment_B(thr_dV.partition_B(sdOt))     # (..., stages)
        tdKrQt = thr_dK.make_fragment_B(thr_dK.partition_B(sQt))       # (..., stages)
        tdQrdS = thr_dQ.make_fragment_A(thr_dQ.partition_A(sdS))
        tdQrKt = thr_dQ.make_fragment_B(thr_dQ.partition_B(sKt))
        acc_dV = cute.make_rmem_tensor(thr_dV.partition_shape_C((tn, dv)), Float32)
        acc_dK = cute.make_rmem_tensor(thr_dK.partition_shape_C((tn, d)), Float32)
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        tScS_rc = acc_rowcol(thr_SdP.partition_C(cute.make_identity_tensor((tn, tm))))
        tdQcdQ = thr_dQ.partition_C(cute.make_identity_tensor((tm, d)))
        smem_copy_dS = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma_SdP)
        thr_smem_dS = smem_copy_dS.get_slice(ctidx)
        tdSsdSt = thr_smem_dS.partition_D(sdSt)
        sLSE2 = storage.sLSE2.get_tensor(cute.make_layout(tm))
        sD = storage.sD.get_tensor(cute.make_layout(tm))
        stats_q = self.stats_offset(offset_q, batch)

        # 1. K_j, V_j (waited for even when the walk is empty: no TMA may outlive the CTA)
        pipe_KV.consumer_wait(pipeline.PipelineState(1, Int32(0), Int32(0), Int32(0)))

        # 2. the walk: (query head of the group) x (Q tile)
        n_m = m_block_max - m_block_min
        for head_in_group in cutlass.range(qhead_per_kvhead, unroll=1):
            head = head_kv * qhead_per_kvhead + head_in_group
            gdQ_all = cute.domain_offset((offset_q, 0), mdQacc[bidx, None, head, None])
            for m_block in cutlass.range(m_block_min, m_block_max, unroll=1):
                st = self.tile_state(head_in_group * n_m + m_block - m_block_min, producer=False)
                q_rows_left = seqlen_q - m_block * tm
                # 2a. row statistics into smem (rows past the sequence: lse2 = +inf, D = 0). The
                #     barrier also tells us both warpgroups' previous dQ GEMMs -- the readers of
                #     sdSt -- have completed, and that the previous tile's statistics have been read.
                if ctidx < tm:
                    sLSE2[ctidx] = Float32.inf
                    sD[ctidx] = Float32(0.0)
                    if ctidx < q_rows_left:
                        sLSE2[ctidx] = mLSE2[bidx, head, stats_q + m_block * tm + ctidx]
                        sD[ctidx] = mD[bidx, head, stats_q + m_block * tm + ctidx]
                cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=nthr)

                # 2b. S^T = K Q_i^T as soon as Q_i has landed, dP^T = V dO_i^T when dO_i has
                acc_S = cute.make_rmem_tensor(thr_SdP.partition_shape_C((tn, tm)), Float32)
                acc_dP = cute.make_rmem_tensor(thr_SdP.partition_shape_C((tn, tm)), Float32)
                pipe_Q.consumer_wait(st)
                warpgroup.fence()
                gemm_issue(tiled_mma_SdP, acc_S, tSrK, tSrQ[None, None, None, st.index], zero_init=True)
                pipe_dO.consumer_wait(st)
                gemm_issue(tiled_mma_SdP, acc_dP, tPrV, tPrdO[None, None, None, st.index], zero_init=True)
                warpgroup.wait_group(1)

                # 2c. P^T = exp2(S^T * scale_log2 - lse2), masked (keys, causal, and queries past
                #     the sequence: with TMA those rows may hold the next sequence's data)
                acc_S_rc = self.probs_from_scores(acc_S, tScS_rc, sLSE2, m_block, n_block, q_rows_left, seqlen_q,
                                                  seqlen_k, softmax_scale_log2)
                tPrP = cute.make_rmem_tensor_like(acc_S, self.dtype)
                tPrP.store(acc_S.load().to(self.dtype))
                # the same registers, seen as dV's A operand (same pairs, same order: module docstring)
                tdVrPt = cute.make_tensor(tPrP.iterator, cute.make_layout(thr_dV.partition_shape_A((tn, tm))))

                # 2d. dS^T = P^T * (dP^T - D)
                warpgroup.wait_group(0)
                self.ds_from_dp(acc_dP, acc_S_rc, tScS_rc, sD)
                tdSrdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
                tdSrdS.store(acc_dP.load().to(self.dtype))
                tdKrdSt = cute.make_tensor(tdSrdS.iterator, cute.make_layout(thr_dK.partition_shape_A((tn, tm))))
                # dQ needs both warpgroups' keys of dS: dS^T still goes through smem, and the barrier stays
                cute.copy(smem_copy_dS, thr_smem_dS.retile(tdSrdS), tdSsdSt)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=nthr)

                # 2e. dV += P^T dO, dK += dS^T Q (A from registers: no barrier needed, but step 2's place),
                #     dQ = dS K; the fence orders the P^T / dS^T register writes before the wgmmas read them
                acc_dQ = cute.make_rmem_tensor(thr_dQ.partition_shape_C((tm, d)), Float32)
                warpgroup.fence()
                gemm_issue(tiled_mma_dV, acc_dV, tdVrPt, tdVrdOt[None, None, None, st.index], zero_init=False)
                gemm_issue(tiled_mma_dK, acc_dK, tdKrdSt, tdKrQt[None, None, None, st.index], zero_init=False)
                gemm_issue(tiled_mma_dQ, acc_dQ, tdQrdS, tdQrKt, zero_init=True)
                warpgroup.wait_group(0)
                pipe_Q.consumer_release(st)
                pipe_dO.consumer_release(st)

                # 2f. dQaccum_i += dQ_i (fp32 atomics; deterministic: in the order's turn)
                tdQgdQ = thr_dQ.partition_C(cute.local_tile(gdQ_all, (tm, d), (m_block, 0)))
                self.add_dq(acc_dQ, tdQgdQ, tdQcdQ, q_rows_left, mSemaphore, walk, head, m_block, ctidx)

        # 3. epilogue: dK *= scale; registers -> smem (over sK / sV) -> 16-byte row-guarded stores
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=nthr)
        acc_dK.store(acc_dK.load() * softmax_scale)
        k_rows_left = seqlen_k_rows - n_block * tn
        self.store_tile(acc_dK, tiled_mma_dK, sK, gmem_store_dK, ctidx,
                        cute.local_tile(cute.domain_offset((offset_k, 0), mdK[bidx, None, head_kv, None]),
                                        (tn, d), (n_block, 0)), (tn, d), k_rows_left)
        self.store_tile(acc_dV, tiled_mma_dV, sV, gmem_store_dV, ctidx,
                        cute.local_tile(cute.domain_offset((offset_k, 0), mdV[bidx, None, head_kv, None]),
                                        (tn, dv), (n_block, 0)), (tn, dv), k_rows_left)

    # -------------------------------------------------------------- helpers
    def stats_offset(self, offset_q, batch):
        """First row of this sequence's lse2 / D: varlen sequences start 16-byte aligned there
        (common.stats_offset), dense ones at offset_q (0)."""
        return common.stats_offset(offset_q, batch) if const_expr(self.varlen) else offset_q

    def tile_state(self, t: Int32, producer: bool) -> pipeline.PipelineState:
        """Pipeline slot of tile t of the walk: stage t % stages, phase flips every lap; the
        producer starts one phase ahead (its first lap must not wait for "empty")."""
        phase = (t // self.num_stages) % 2
        if const_expr(producer):
            phase = phase ^ 1
        return pipeline.PipelineState(self.num_stages, t, t % self.num_stages, phase)

    @cute.jit
    def probs_from_scores(self, acc_S: cute.Tensor, tScS_rc: cute.Tensor, sLSE2: cute.Tensor, m_block: Int32,
                          n_block: Int32, q_rows_left: Int32, seqlen_q: Int32, seqlen_k: Int32,
                          softmax_scale_log2: Float32):
        """P^T = exp2(S^T * scale_log2 - lse2) in place over the S^T accumulator; masked entries
        (keys past seqlen_k, causal, and queries past the sequence: with TMA those rows may hold the
        next sequence's data) become 0. Returns the (rows, cols) view of it."""
        tm, tn = self.tile_m, self.tile_n
        acc_S_rc = acc_rowcol(acc_S)
        key_limit, diag = schedule.mask_bounds(m_block, n_block, tm, tn, seqlen_q, seqlen_k)
        needs_mask = schedule.tile_needs_mask(key_limit, diag, tn, self.causal) | (q_rows_left < tm)
        for c in cutlass.range_constexpr(cute.size(tScS_rc, mode=[1])):
            col = tScS_rc[0, c][1]
            lse2 = sLSE2[col]
            for r in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[0])):
                s = acc_S_rc[r, c]
                if needs_mask:
                    if schedule.is_masked(tScS_rc[r, c][0], col, key_limit, diag, self.causal) | (col >= q_rows_left):
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
               mSemaphore: cute.Tensor, walk, head: Int32, m_block: Int32, ctidx: Int32):
        """dQaccum_i += dQ_i with fp32 atomics on rows < q_rows_left; deterministic: wait for this
        CTA's turn on the tile's semaphore, add, then release the next CTA."""
        (seqlen_q, seqlen_k, seqlen_k_rows, offset_q, offset_k, bidx, batch, head_kv, n_block,
         m_block_min, m_block_max, qhead_per_kvhead) = walk
        nthr = 128 * NUM_WG_MMA
        if const_expr(self.deterministic):
            n_block_last = schedule.n_block_last(m_block, self.tile_m, self.tile_n, seqlen_q, seqlen_k, self.causal,
                                                 imin=cutlass.min)
            sem = common.elem_pointer(mSemaphore, (batch, head, m_block))
            common.semaphore_wait(sem, self.dq_order.rank(n_block, Int32(0), n_block_last), ctidx)
            cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=nthr)
        for i in cutlass.range_constexpr(cute.size(acc_dQ) // 2):
            if tdQcdQ[2 * i][0] < q_rows_left:
                common.red_add_f32x2(common.elem_pointer(tdQgdQ, 2 * i), acc_dQ[2 * i], acc_dQ[2 * i + 1])
        if const_expr(self.deterministic):
            # every thread's adds precede thread 0's release
            cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=nthr)
            common.semaphore_signal(sem, ctidx)

    @cute.jit
    def store_tile(self, acc: cute.Tensor, tiled_mma: cute.TiledMma, sX: cute.Tensor, gmem_copy: cute.TiledCopy,
                   ctidx: Int32, gX: cute.Tensor, shape: cutlass.Constexpr, rows_left: Int32):
        """fp32 accumulator -> dtype -> smem -> row-guarded 16-byte stores (consumer threads only)."""
        rX = cute.make_rmem_tensor_like(acc, self.dtype)
        rX.store(acc.load().to(self.dtype))
        smem_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma)
        thr_smem = smem_copy.get_slice(ctidx)
        cute.copy(smem_copy, thr_smem.retile(rX), thr_smem.partition_D(sX))
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=128 * NUM_WG_MMA)
        thr_copy = gmem_copy.get_slice(ctidx)
        tXsX, tXgX = thr_copy.partition_S(sX), thr_copy.partition_D(gX)
        tXcX = thr_copy.partition_S(cute.make_identity_tensor(shape))
        tXrX = cute.make_rmem_tensor_like(tXsX, self.dtype)
        cute.autovec_copy(tXsX, tXrX)
        for m in cutlass.range_constexpr(cute.size(tXgX.shape[1])):
            if tXcX[0, m, 0][0] < rows_left:
                cute.copy(gmem_copy, tXrX[None, m, None], tXgX[None, m, None])


# ------------------------------------------------------------------------------------------------
# Host API (shared with step 1 through host.py)
# ------------------------------------------------------------------------------------------------
def make_kernel(dtype, head_dim, head_dim_v, causal, deterministic, *, varlen=False, has_seqused_k=False,
                dq_order=None, tiles=None):
    tm, tn = tiles if tiles is not None else (None, None)
    return FlashAttentionBackwardSm90Step3(dtype, head_dim, head_dim_v, causal, deterministic, varlen=varlen,
                                           has_seqused_k=has_seqused_k, tile_m=tm, tile_n=tn, dq_order=dq_order)


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, varlen=False,
                 has_seqused_k=False, dq_order=None, tiles=None) -> Compiled:
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
