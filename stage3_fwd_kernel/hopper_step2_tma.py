"""Stage 3, Hopper step 2: TMA loads into a multi-stage shared-memory pipeline (mbarriers).

Compared with the previous step, this adds **TMA loads (the bulk tensor copy engine) into a
2-stage K/V ring buffer guarded by mbarriers** because in step 1 every key tile was loaded *and
waited for* before its math started, so the tensor cores idled for a full load per tile, and all
128 threads spent issue slots on 16-byte cp.async copies, their addresses and predicates.

What changes (the math of a tile, the softmax and the epilogue are step 1 verbatim):

* A tile is one ``cp.async.bulk.tensor`` per 128-byte-wide column strip (SASS ``UTMALDG``),
  issued by one elected lane of warp 0. The TMA unit walks the (seqlen, head_dim) box, writes the
  128-byte swizzle wgmma expects, and zero-fills rows past the end of the sequence by itself (the
  tensor map knows each extent), so step 1's row predicates and ``fill(0)`` disappear.
* Completion is tracked by transaction-count mbarriers: the issuing lane posts the byte count
  (``mbarrier.arrive.expect_tx``), the copy engine counts the bytes down, consumers wait on the
  barrier's phase. ``cutlass.pipeline.PipelineTmaAsync`` packages this "full" barrier per stage
  plus an "empty" barrier that the 4 consumer warps arrive on when done with a stage, and that the
  producer waits on before overwriting it. We use one pipeline for K and one for V (so QK^T starts
  while V is still landing) and a 1-stage one for Q. The stage and phase of key block n are
  computed, not carried: stage = n % stages, phase = (n // stages) & 1 (a producer starts one
  phase ahead, since all slots begin empty).
* Block j + stages is requested as soon as block j's stage is released, so while the warpgroup
  computes block j, blocks j+1 .. j+stages-1 are in flight. The warpgroup is still its own
  producer (warp 0 issues between its MMAs); step 3 moves loading to a dedicated warp.

Arithmetic (H100 SXM: 132 SMs at ~1.8 GHz, 989 TFLOP/s dense bf16 -> ~4096 FLOP/clk/SM; MUFU
16 ex2/clk/SM; bf16, tile_m = 64 query rows, d = dv = 128, tile_n = 64):

  per key tile:  K + V bytes = 64 * 128 * 2 * 2 = 32 KB
                 MMA FLOPs   = 4 * 64 * 64 * 128 = 2.1 M  -> ~512 clk on the tensor cores
                 exp2        = 64 * 64 = 4096             -> ~256 clk on MUFU (plus FFMA/max/sum)
  A 32 KB tile takes ~2300 clk to arrive from DRAM when all SMs stream it (3.35 TB/s / 132 SMs =
  ~14 B/clk/SM), ~800-1200 clk from L2 (2-3x the rate), plus ~500-800 clk of latency. In step 1 a tile therefore
  costs load + compute in series; with two stages the load of j+1 runs under the ~800+ clk of
  compute of block j, and a co-resident CTA covers the rest.

  Shared memory = Q + stages * (K + V) (O reuses Q's buffer after the last QK^T), bf16:
    d=64,       tile_n=128:  8 + 2 * (16 + 16) =  72 KB  -> 3 CTAs/SM by smem (227 KB)
    d=96,       tile_n=128: 12 + 2 * (24 + 24) = 108 KB  -> 2 CTAs/SM
    d=128,      tile_n=64:  16 + 2 * (16 + 16) =  80 KB  -> 2 CTAs/SM
    d=192/128,  tile_n=64:  24 + 2 * (24 + 16) = 104 KB  -> 2 CTAs/SM
    d=256,      tile_n=64:  32 + 2 * (32 + 32) = 160 KB  -> 1 CTA/SM
  Two stages suffice to overlap one load with one tile of compute; we spend the rest of the
  budget on a second CTA per SM rather than deeper stages: with one warpgroup per CTA the tensor
  cores idle during softmax, and the other CTA's MMAs are what fill that gap until step 3
  overlaps softmax and MMA inside one CTA. That is why d=128 drops from step 1's tile_n=128 to
  64 here: 16 + 2 * (32 + 32) = 144 KB would leave room for a single CTA.

Everything the previous step supports is still supported (fp16/bf16, head dims 64/96/128/
(192,128)/256, causal bottom-right, GQA/MQA, any seqlens, 16-byte aligned strides).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory.smem import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from stage3_fwd_kernel import compile_cache, host_io, runner, tile_scheduler

STEP = "hopper_step2_tma"


def default_tile_n(head_dim: int, head_dim_v: int) -> int:
    """Key-tile rows: the largest of 128 / 64 with which Q + 2 stages of K and V fit in ~113 KB,
    i.e. two CTAs per SM (see the table above); d=256 gets 64 and one CTA per SM."""
    for tile_n in (128, 64):
        if (64 * head_dim + 2 * tile_n * (head_dim + head_dim_v)) * 2 <= 113 * 1024:
            return tile_n
    return 64


# ------------------------------------------------------------------------------------------------
# Register-layout helpers for the Hopper accumulator (see the module docstring for the picture)
# ------------------------------------------------------------------------------------------------
def acc_rowcol(acc: cute.Tensor) -> cute.Tensor:
    """View a wgmma accumulator ((2, 2, N/8), MMA_M, MMA_N) as (rows, cols) of this thread:
    rows = (the 2 rows 8 apart, MMA_M), cols = (2 adjacent columns, N/8 groups, MMA_N)."""
    shp, std = acc.layout.shape, acc.layout.stride
    rows = ((shp[0][1], shp[1]), (std[0][1], std[1]))
    cols = ((shp[0][0], shp[0][2], shp[2]), (std[0][0], std[0][2], std[2]))
    return cute.make_tensor(acc.iterator, cute.make_layout((rows[0], cols[0]), stride=(rows[1], cols[1])))


@cute.jit
def quad_allreduce(x: Float32, op: cutlass.Constexpr) -> Float32:
    """Reduce over the 4 lanes of a quad (the 4 threads that share an accumulator row)."""
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return x


@cute.jit
def wgmma_gemm(tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor,
               zero_init: cutlass.Constexpr[bool]):
    """acc (+)= A B over all k-blocks, issued by the whole warpgroup, then waited for.

    wgmma.fence orders our earlier register writes (the P fragment, the rescaled O) before the
    asynchronous MMA reads them; commit + wait(0) makes the result visible before we touch acc.
    """
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)  # a fresh atom: we flip its ACCUMULATE field
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in cutlass.range_constexpr(cute.size(tA.shape[2])):
        cute.gemm(atom, acc, tA[None, None, k], tB[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    warpgroup.wait_group(0)


class FlashAttentionForwardSm90Step2:
    """One warpgroup per CTA, Q tile 64 x d, TMA loads into a `num_stages` K/V ring, SS + RS wgmma."""

    def __init__(self, dtype, head_dim: int, head_dim_v: int, causal: bool, *, tile_m: int = 64,
                 tile_n: int | None = None, num_stages: int = 2, scheduler=tile_scheduler.StaticTileScheduler):
        if head_dim % 16 or head_dim_v % 16 or not (16 <= head_dim <= 256 and 16 <= head_dim_v <= 256):
            raise ValueError(f"head_dim: expected multiples of 16 in [16, 256], got ({head_dim}, {head_dim_v})")
        assert tile_m == 64, "step 2 is still one warpgroup = one wgmma M=64 row block"
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.tile_m = tile_m
        self.tile_n = tile_n or default_tile_n(head_dim, head_dim_v)
        self.num_stages = num_stages
        self.scheduler = scheduler
        self.num_threads = 128
        self.smem_bytes = None

    # -------------------------------------------------------------- host side (traced once)
    def _smem_layout(self, rows: int, cols: int, stages: int | None = None):
        """Row-major (contiguous along `cols`) tile with the widest swizzle wgmma accepts,
        optionally with a trailing stage mode."""
        atom_kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, cols)
        atom = warpgroup.make_smem_layout_atom(atom_kind, self.dtype)
        if stages is None:
            return cute.tile_to_shape(atom, (rows, cols), (0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))

    def _gmem_copy_O(self, cols: int):
        """128 threads, 16 bytes each, a row of the swizzle atom per group of threads."""
        elems = 128 // self.dtype.width
        atom_cols = 64 if cols % 64 == 0 else (32 if cols % 32 == 0 else 16)
        threads_per_row = atom_cols // elems
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        thr = cute.make_ordered_layout((self.num_threads // threads_per_row, threads_per_row), order=(1, 0))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale_log2: Float32, softmax_scale: Float32, stream):
        # mQ (B, Sq, Hq, d), mK (B, Sk, Hkv, d), mV (B, Sk, Hkv, dv), mO (B, Sq, Hq, dv), mLSE (B, Hq, Sq)
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mO.element_type == self.dtype)):
            raise TypeError("q, k, v, out must share the kernel's dtype")
        tm, tn, d, dv, stages = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        mQ, mK = host_io.assume_strides_16B(mQ, d), host_io.assume_strides_16B(mK, d)
        mV, mO = host_io.assume_strides_16B(mV, dv), host_io.assume_strides_16B(mO, dv)

        sQ_layout = self._smem_layout(tm, d)
        sK_layout = self._smem_layout(tn, d, stages)
        sV_layout = self._smem_layout(tn, dv, stages)
        sO_layout = self._smem_layout(tm, dv)

        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S (tm x tn) = Q (tm x d) . K (tn x d)^T : A and B both K-major, both from smem
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (tm, tn))
        # O (tm x dv) = P (tm x tn) . V : A = P from registers, B = V^T (dv x tn) is MN-major
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, (1, 1, 1), (tm, dv),
            a_source=warpgroup.OperandSource.RMEM)

        # TMA: the tensor map sees (seqlen, head_dim, heads, batch) so that a (rows, head_dim) box
        # tiles the first two modes; head and batch are fixed per CTA by slicing the TMA tensor.
        def seq_dim_first(t):  # (B, S, H, D) -> (S, D, H, B), same memory
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(tma_load, seq_dim_first(mQ), sQ_layout, (tm, d))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mK), cute.slice_(sK_layout, (None, None, 0)), (tn, d))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mV), cute.slice_(sV_layout, (None, None, 0)), (tn, dv))
        # bytes each stage's "full" barrier waits for (the whole box, zero-filled rows included)
        self.tma_bytes_Q = cute.size_in_bytes(self.dtype, sQ_layout)
        self.tma_bytes_K = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))
        self.tma_bytes_V = cute.size_in_bytes(self.dtype, cute.slice_(sV_layout, (None, None, 0)))

        # O is written once, after the last QK^T: it can live in Q's buffer when it fits
        self.o_in_q = cute.cosize(sO_layout) <= cute.cosize(sQ_layout)

        @cute.struct
        class SharedStorage:
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2]               # full + empty, 1 stage
            mbar_K: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_V: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[
                self.dtype, 0 if self.o_in_q else cute.cosize(sO_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()

        num_m_blocks = (mQ.shape[1] + tm - 1) // tm
        grid = self.scheduler.grid_shape(num_m_blocks, mQ.shape[2], mQ.shape[0])
        self.kernel(tma_Q, tma_K, tma_V, mO, mLSE, softmax_scale_log2, softmax_scale,
                    mQ.shape[1], mK.shape[1], mQ.shape[2] // mK.shape[2],
                    tma_atom_Q, tma_atom_K, tma_atom_V,
                    tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, sO_layout,
                    self._gmem_copy_O(dv),
                    ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    # -------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_Q: cute.Tensor, tma_K: cute.Tensor, tma_V: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, softmax_scale_log2: Float32, softmax_scale: Float32,
               seqlen_q: Int32, seqlen_k: Int32, qhead_per_kvhead: Int32,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
               gmem_copy_O: cute.TiledCopy):
        tm, tn, d, dv, stages = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        # warp 0 issues the TMA loads. A whole warp, not one thread: the DSL wraps expect_tx and the
        # TMA instruction in `elect.sync` (one lane acts), which needs all 32 lanes converged.
        is_producer = warp_idx == 0

        # 0. which tile, which sequence lengths (varlen would plug in here)
        work = self.scheduler.initial_work()
        m_block, head, batch = work.m_block, work.head, work.batch
        head_kv = head // qhead_per_kvhead  # GQA: q head h reads kv head h // ratio

        if warp_idx == 0:  # fetch the tensor maps (they live in kernel params) into the TMA unit
            cpasync.prefetch_descriptor(tma_atom_Q)
            cpasync.prefetch_descriptor(tma_atom_K)
            cpasync.prefetch_descriptor(tma_atom_V)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # mbarrier pipelines: producer = 1 arrival (an elected lane of warp 0, which also posts the
        # expected byte count), consumers = the 4 warps of the warpgroup (lane 0 of each arrives
        # on "empty")
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_threads // 32)
        pipe_Q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_Q.data_ptr(), num_stages=1, producer_group=producer_group,
            consumer_group=consumer_group, tx_count=self.tma_bytes_Q, defer_sync=True)
        pipe_K = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_K.data_ptr(), num_stages=stages, producer_group=producer_group,
            consumer_group=consumer_group, tx_count=self.tma_bytes_K, defer_sync=True)
        pipe_V = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_V.data_ptr(), num_stages=stages, producer_group=producer_group,
            consumer_group=consumer_group, tx_count=self.tma_bytes_V, defer_sync=True)
        cute.arch.mbarrier_init_fence()  # make the barrier inits visible to the async proxy (TMA)
        cute.arch.sync_threads()         # ... and to every thread before anyone waits on them

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (tm, d)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (tn, d, stages)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (tn, dv, stages)
        if const_expr(self.o_in_q):
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)  # (tm, dv) over sQ
        else:
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        # the same V bytes seen as (dv, tn, stages): the MN-major B operand of O = P V
        sVt = cute.composition(sV, cute.make_ordered_layout((dv, tn, stages), order=(1, 0, 2)))

        # TMA views: coordinates of this (head, batch) slice, tiled by the box
        gQ = cute.local_tile(tma_Q[None, None, head, batch], (tm, d), (m_block, 0))     # (tm, d)
        gK = cute.local_tile(tma_K[None, None, head_kv, batch], (tn, d), (None, 0))     # (tn, d, n_blocks)
        gV = cute.local_tile(tma_V[None, None, head_kv, batch], (tn, dv), (None, 0))    # (tn, dv, n_blocks)
        gO = cute.local_tile(mO[batch, None, head, None], (tm, dv), (m_block, 0))       # (tm, dv)
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1),
                                           cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1),
                                           cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1),
                                           cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

        # MMA partitions: smem operands become wgmma descriptors, accumulators registers
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
        tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK))     # (..., stages)
        tOrVt = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt))   # (..., stages)
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((tm, dv)), Float32)
        acc_O.fill(0.0)
        # (row, col) of each S accumulator element inside the (tm, tn) tile, for masking
        tScS_rc = acc_rowcol(thr_mma_qk.partition_C(cute.make_identity_tensor((tm, tn))))
        num_rows = cute.size(tScS_rc, mode=[0])  # 2 rows per thread
        row_max = cute.make_rmem_tensor((num_rows,), Float32)
        row_sum = cute.make_rmem_tensor((num_rows,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)

        # key blocks this query tile can see: all of them, or (causal) up to the diagonal of its
        # last row: query i sees key j iff j <= i + seqlen_k - seqlen_q
        n_block_max = (seqlen_k + tn - 1) // tn
        if const_expr(self.causal):
            last_visible = (m_block + 1) * tm + seqlen_k - seqlen_q  # exclusive bound on keys
            n_block_max = cutlass.min(n_block_max, cutlass.max((last_visible + tn - 1) // tn, 0))

        # 1. prologue: Q, then the first `stages` key tiles, all in flight at once
        q_state = pipeline.PipelineState(1, Int32(0), Int32(0), Int32(0))
        if is_producer:
            pipe_Q.producer_acquire(pipeline.PipelineState(1, Int32(0), Int32(0), Int32(1)))
            cute.copy(tma_atom_Q, tQgQ, tQsQ, tma_bar_ptr=pipe_Q.producer_get_barrier(q_state))
            for n_block in cutlass.range(cutlass.min(stages, n_block_max), unroll=1):
                self.load_kv(n_block, pipe_K, pipe_V, tma_atom_K, tma_atom_V, tKgK, tKsK, tVgV, tVsV)
        pipe_Q.consumer_wait(q_state)  # even a tile with no visible key waits: no TMA may outlive the CTA

        # 2. mainloop over key tiles
        for n_block in cutlass.range(n_block_max, unroll=1):
            st = self.kv_state(n_block, producer=False)
            # 2b. S = Q K_j^T, as soon as K_j has landed
            pipe_K.consumer_wait(st)
            acc_S = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((tm, tn)), Float32)
            wgmma_gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, st.index], zero_init=True)

            # 2c-2d. S_j -> P_j in place (mask, running max and sum), O rescaled
            self.online_softmax(acc_S, n_block, m_block, seqlen_q, seqlen_k, softmax_scale_log2,
                                tScS_rc, row_max, row_sum, acc_O)

            # 2e. P -> bf16/fp16 in the A-operand register fragment, then O += P V_j
            tOrP = cute.make_rmem_tensor(thr_mma_pv.partition_shape_A((tm, tn)), self.dtype)
            # same registers in accumulator order (see module docstring): convert in place
            tOrP_as_acc = cute.make_tensor(tOrP.iterator, cute.make_layout(acc_S.shape))
            tOrP_as_acc.store(acc_S.load().to(self.dtype))
            pipe_V.consumer_wait(st)
            wgmma_gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, st.index], zero_init=False)

            # 2f. both wgmmas have completed (wait_group 0): hand the stage back, and refill it
            #     with key block n + stages
            pipe_K.consumer_release(st)
            pipe_V.consumer_release(st)
            if is_producer:
                if n_block + stages < n_block_max:
                    self.load_kv(n_block + stages, pipe_K, pipe_V, tma_atom_K, tma_atom_V,
                                 tKgK, tKsK, tVgV, tVsV)

        # 3. epilogue: O /= l and lse, then O to global memory
        self.normalize_O_write_lse(acc_O, row_max, row_sum, softmax_scale_log2, tScS_rc,
                                   mLSE, batch, head, m_block, seqlen_q)
        self.store_O(acc_O, tiled_mma_pv, gmem_copy_O, sO, gO, tidx, m_block, seqlen_q)

    @cute.jit
    def online_softmax(self, acc_S: cute.Tensor, n_block: Int32, m_block: Int32, seqlen_q: Int32,
                       seqlen_k: Int32, softmax_scale_log2: Float32, tScS_rc: cute.Tensor,
                       row_max: cute.Tensor, row_sum: cute.Tensor, acc_O: cute.Tensor):
        """S_j (accumulator) -> P_j = 2^(S*scale - m*scale) in place, with the mask, the running max
        and sum (log2 domain, one row pair per thread); O is rescaled by the change of the max."""
        tm, tn = self.tile_m, self.tile_n
        acc_S_rc = acc_rowcol(acc_S)
        acc_O_rc = acc_rowcol(acc_O)
        num_rows = cute.size(row_max)
        # mask keys >= seqlen_k, and (causal) keys past each row's diagonal
        needs_mask = (n_block + 1) * tn > seqlen_k
        if const_expr(self.causal):
            needs_mask = needs_mask or (n_block + 1) * tn > m_block * tm + 1 + seqlen_k - seqlen_q
        if needs_mask:
            for r in cutlass.range_constexpr(num_rows):
                col_limit = seqlen_k - n_block * tn  # in this tile's column coordinates
                if const_expr(self.causal):
                    row = m_block * tm + tScS_rc[r, 0][0]
                    col_limit = cutlass.min(col_limit, row + 1 + seqlen_k - seqlen_q - n_block * tn)
                for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
                    if tScS_rc[r, c][1] >= col_limit:
                        acc_S_rc[r, c] = -Float32.inf
        for r in cutlass.range_constexpr(num_rows):
            m_tile = acc_S_rc[r, 0]
            for c in cutlass.range_constexpr(1, cute.size(acc_S_rc, mode=[1])):
                m_tile = cute.arch.fmax(m_tile, acc_S_rc[r, c])
            m_tile = quad_allreduce(m_tile, cute.arch.fmax)
            m_new = cute.arch.fmax(row_max[r], m_tile)
            # a row with nothing visible yet keeps m = -inf: subtract 0 instead (no inf - inf)
            m_safe = Float32(0.0) if m_new == -Float32.inf else m_new
            m_scaled = m_safe * softmax_scale_log2
            rescale = cute.math.exp2(row_max[r] * softmax_scale_log2 - m_scaled, fastmath=True)
            row_max[r] = m_new
            s = Float32(0.0)
            for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
                p = cute.math.exp2(acc_S_rc[r, c] * softmax_scale_log2 - m_scaled, fastmath=True)
                acc_S_rc[r, c] = p
                s += p
            row_sum[r] = row_sum[r] * rescale + s  # per-thread partial; quad-reduced at the end
            for c in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[1])):
                acc_O_rc[r, c] = acc_O_rc[r, c] * rescale

    @cute.jit
    def normalize_O_write_lse(self, acc_O: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                              softmax_scale_log2: Float32, tScS_rc: cute.Tensor, mLSE: cute.Tensor,
                              batch: Int32, head: Int32, m_block: Int32, seqlen_q: Int32):
        """O /= l, lse = m*scale + ln(l); empty rows (l = 0) -> O = 0, lse = -inf."""
        acc_O_rc = acc_rowcol(acc_O)
        num_rows = cute.size(row_max)
        lse = cute.make_rmem_tensor((num_rows,), Float32)
        for r in cutlass.range_constexpr(num_rows):
            l = quad_allreduce(row_sum[r], lambda a, b: a + b)
            inv = Float32(0.0) if l == 0.0 else cute.arch.rcp_approx(l)
            lse[r] = (-Float32.inf if l == 0.0 else
                      (row_max[r] * softmax_scale_log2 + cute.math.log2(l, fastmath=True)) * math.log(2.0))
            for c in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[1])):
                acc_O_rc[r, c] = acc_O_rc[r, c] * inv
        # the thread holding column 0 of a row writes its lse
        if tScS_rc[0, 0][1] == 0:
            for r in cutlass.range_constexpr(num_rows):
                row = m_block * self.tile_m + tScS_rc[r, 0][0]
                if row < seqlen_q:
                    mLSE[batch, head, row] = lse[r]

    @cute.jit
    def store_O(self, acc_O: cute.Tensor, tiled_mma_pv: cute.TiledMma, gmem_copy_O: cute.TiledCopy,
                sO: cute.Tensor, gO: cute.Tensor, tidx: Int32, m_block: Int32, seqlen_q: Int32):
        """O: registers -> smem (accumulator layout) -> 16-byte coalesced, row-guarded stores."""
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        if const_expr(self.o_in_q):
            cute.arch.sync_threads()  # every warp's last QK^T (which reads sQ) has completed
        smem_copy_O = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma_pv)
        thr_smem_copy_O = smem_copy_O.get_slice(tidx)
        cute.copy(smem_copy_O, thr_smem_copy_O.retile(rO), thr_smem_copy_O.partition_D(sO))
        cute.arch.sync_threads()
        thr_copy_O = gmem_copy_O.get_slice(tidx)
        tOsO, tOgO = thr_copy_O.partition_S(sO), thr_copy_O.partition_D(gO)
        tOcO = thr_copy_O.partition_S(cute.make_identity_tensor((self.tile_m, self.head_dim_v)))
        tOrO = cute.make_rmem_tensor_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        q_rows_left = seqlen_q - m_block * self.tile_m
        for m in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
            if tOcO[0, m, 0][0] < q_rows_left:
                cute.copy(gmem_copy_O, tOrO[None, m, None], tOgO[None, m, None])

    # -------------------------------------------------------------- pipeline bookkeeping
    def kv_state(self, n_block: Int32, producer: bool) -> pipeline.PipelineState:
        """Pipeline slot of key block n: stage n % stages; the phase flips every lap round the ring.
        A producer starts one phase ahead: its first lap must not wait for "empty"."""
        phase = (n_block // self.num_stages) % 2
        if const_expr(producer):
            phase = phase ^ 1
        return pipeline.PipelineState(self.num_stages, n_block, n_block % self.num_stages, phase)

    @cute.jit
    def load_kv(self, n_block: Int32, pipe_K, pipe_V, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
                tKgK: cute.Tensor, tKsK: cute.Tensor, tVgV: cute.Tensor, tVsV: cute.Tensor):
        """(producer warp) wait until the slot is free, post the byte count, issue K then V."""
        st = self.kv_state(n_block, producer=True)
        pipe_K.producer_acquire(st)
        cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, st.index], tma_bar_ptr=pipe_K.producer_get_barrier(st))
        pipe_V.producer_acquire(st)
        cute.copy(tma_atom_V, tVgV[None, n_block], tVsV[None, st.index], tma_bar_ptr=pipe_V.producer_get_barrier(st))


# ------------------------------------------------------------------------------------------------
# Host API
# ------------------------------------------------------------------------------------------------
def make_kernel(dtype, head_dim, head_dim_v, causal):
    return FlashAttentionForwardSm90Step2(dtype, head_dim, head_dim_v, causal)


def attention_forward(q, k, v, *, softmax_scale=None, causal=False, out=None, lse=None):
    """q (B,Sq,Hq,D), k (B,Sk,Hkv,D), v (B,Sk,Hkv,Dv) CUDA fp16/bf16 -> (out (B,Sq,Hq,Dv), lse (B,Hq,Sq) fp32)."""
    return host_io.attention_forward_impl(STEP, make_kernel, q, k, v, softmax_scale=softmax_scale,
                                          causal=causal, out=out, lse=lse)


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False) -> compile_cache.Compiled:
    """Compile for sm_90a with fake tensors (no GPU needed); returns the compiled kernel + report."""
    return host_io.compile_fake(STEP, make_kernel, dtype=dtype, head_dim=head_dim,
                                head_dim_v=head_dim if head_dim_v is None else head_dim_v, causal=causal)


def run(batch=2, seqlen_q=1024, seqlen_k=1024, heads=8, heads_kv=None, head_dim=128, head_dim_v=None,
        causal=False, dtype="bf16", check=True):
    """On a Hopper GPU: check against the stage-0 reference (FA4 rule) and time. Otherwise:
    compile for sm_90a and print the resource report."""
    return runner.run_step(STEP, make_kernel, attention_forward, batch=batch, seqlen_q=seqlen_q,
                           seqlen_k=seqlen_k, heads=heads, heads_kv=heads_kv, head_dim=head_dim,
                           head_dim_v=head_dim_v, causal=causal, dtype=dtype, check=check)


if __name__ == "__main__":
    run(**runner.shape_kwargs(runner.shape_parser(__doc__).parse_args()))
