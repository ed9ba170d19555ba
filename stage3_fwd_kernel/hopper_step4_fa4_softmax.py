"""Stage 3, Hopper step 4: FA4's softmax -- conditional rescaling with a warp vote, and optional
partial exp2 emulation on the FMA pipe.

Compared with step 3, this adds **a per-warp vote that rescales O and l only when some row's
running max grew by more than tau (log2 units; 8 by default, a factor 256), and a compile-time
share of the exponentials computed by stage 2's polynomial on the FMA pipe instead of MUFU.EX2**
because step 3 multiplies its whole O accumulator after every key block whether or not a max moved,
and sends every exponential to the one unit (MUFU) that does only 16 of them per clock per SM.
Both changes are confined to a consumer's per-tile softmax: the producer, the K/V ring, the
ping-pong turns, the walk order and the epilogue are step 3's. The policy (tau, the emulated share,
the polynomial degree) is a `softmax_policy.SoftmaxPolicy`, fixed at compile time, and the device
functions come from that module, which the production kernel uses too.

* Conditional rescaling (stage 1 models it in NumPy; `softmax_policy.rescale_vote`). After a
  tile's row maxima, each thread asks whether one of its 2 rows grew by more than tau, and one
  `vote.sync.any` makes that the decision of all 16 rows of the warp, so the branch never
  diverges. Yes: every row of the warp moves to its new max and l is rescaled at once, O by the
  caller once the P V still in flight has landed (step 3's order). No: the warp keeps its stale
  maxima, every P = 2^(s - m) stays <= 2^tau, and the O multiply is skipped. Exact either way: O
  and l carry the same factor 2^-m, which O / l cancels, and lse = m * scale + log2(l) uses the m
  that was kept. tau = 0 is classic FlashAttention (the warp rescales whenever any of its rows
  grew; a row that did not grow multiplies by exactly 1). Headroom: P <= 2^tau is stored in the
  input dtype, so fp16 (max 65504 < 2^16) needs tau <= 15; l <= seqlen_k * 2^tau in fp32.
* Partial emulation (`softmax_policy.exp2_row`, stage 2's degree-3 polynomial): k of every 16
  consecutive scores of a thread's row take FMNMX, FADD.RM, 2 FADD, 3 FFMA and a LEA (6 ops on the
  FMA pipe, 2 on the ALU) instead of one MUFU.EX2; k = 16 x emulation_fraction, spread evenly so
  that the two units' work interleaves. Off by default on Hopper, for the reason below.

Arithmetic (H100 and H200 share the SM; bf16, 128 x 128 tile per key block and CTA; a consumer
thread holds 2 rows x tile_n / 4 = 64 scores and 2 rows x dv / 4 values of O):

  What the vote skips. A rescale costs dv multiplies per row: 128 x dv = 16384 FMUL per block at
  dv = 128, 64 per thread, as many as its exponentials (plus 2 MUFU for the factors and 2 FMUL for
  l). With random inputs (q, k ~ N(0, 1), 4096 keys in 128-key blocks walked last first), a 16-row
  warp at tau = 0 finds a row whose max grew in 64% of its blocks (5109 of 7936 warp-blocks at
  d = 128). At tau = 8 a row's max would have to jump 8 / log2(e) = 5.5 standard deviations of the
  scores past everything it has seen: 0 of 7936. Only a tile's first block moves m (from -inf), and
  there O is still 0. On an H100, in paired rounds, the kernel with tau = 8 ran 3.8 / 5.0% faster
  than a branch-free tau = 0 build at d = 128 non-causal 4k / 16k and 0.2 / 1.9% causal, and tied at
  d = 64 (docs/measurements.md, runs 59 and 61).

  Where emulation would pay. A block's 128 x 128 = 16384 exponentials keep MUFU busy for 1024
  clk; its two GEMMs, 4 x 128 x 128 x d FLOP at ~4096 dense bf16 FLOP per clk, take 16 d clk:
  1024 at d = 64 (a tie with MUFU) and 2048 at d = 128 (MUFU half busy, hidden under the other
  consumer's GEMMs). Emulating 4 of 16 takes 256 clk off MUFU (1024 -> 768) and adds 4096 x 8
  instructions = 1024 warp instructions, ~256 issue clk on the SM's four schedulers, to the score
  FFMAs, maxima, sums and conversions they already issue. At d = 128 MUFU was not the bound; at
  d = 64 a MUFU bound becomes an issue and dependency-chain bound. Measured in the production
  kernel on an H100, 1-3 of 16 emulated cost 2-9% at d = 64 and up to 4% at d = 128
  (`softmax_policy.HOPPER_EMULATION_FRACTION`): a consumer waits on its softmax's chain of dependent
  instructions, which the polynomial lengthens. So emulation_fraction defaults to 0 here; it is the
  technique for Blackwell, whose tensor cores are twice as fast against the same MUFU.

Not in this step (product features of `stage3_fwd_kernel.hopper`, the kernel fa4 runs): varlen,
persistent CTAs and their LPT order, the split tail, the lean mask, wgmma descriptors built once
per tile, P packed between the exponentials, the vote against limits kept beside m.

Everything step 3 supports is still supported (fp16/bf16, head dims 64/96/128/(192,128)/256,
causal bottom-right, GQA/MQA, any seqlens, 16-byte aligned strides).
"""
from __future__ import annotations

import functools
import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory.smem import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from stage3_fwd_kernel import compile_cache, host_io, runner, softmax_policy, tile_scheduler
from stage3_fwd_kernel.softmax_policy import DEFAULT_RESCALE_THRESHOLD, HOPPER_EMULATION_FRACTION, SoftmaxPolicy

STEP = "hopper_step4_fa4_softmax"
# tau = 8 and every exponential on MUFU: the Hopper default (module docstring)
DEFAULT_POLICY = SoftmaxPolicy(DEFAULT_RESCALE_THRESHOLD, HOPPER_EMULATION_FRACTION)


def default_tile_n(head_dim: int, head_dim_v: int) -> int:
    """Key-tile rows: 128, or 64 when O (dv/2 registers) would leave a consumer too few for S."""
    return 64 if max(head_dim, head_dim_v) > 192 else 128


def default_num_stages(head_dim: int, head_dim_v: int, tile_n: int, tile_m: int = 128) -> int:
    """As many K/V stages as fit next to Q (2 bytes/element), between 2 and 4 (step 3's table)."""
    q_bytes = tile_m * head_dim * 2
    stage_bytes = tile_n * (head_dim + head_dim_v) * 2
    return max(2, min(4, (host_io.SMEM_BUDGET - q_bytes - 2048) // stage_bytes))


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
               zero_init: cutlass.Constexpr[bool], wait: cutlass.Constexpr[bool] = True):
    """acc (+)= A B over all k-blocks, issued by the whole warpgroup; waited for unless wait=False
    (then the caller does `warpgroup.wait_group(0)` before touching acc).

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
    if const_expr(wait):
        warpgroup.wait_group(0)


class FlashAttentionForwardSm90Step4:
    """Step 3's kernel (producer warp + 2 ping-ponging consumer warpgroups of 64 rows, a TMA K/V
    ring) whose consumers run FA4's softmax: `policy` fixes tau and the emulated share."""

    def __init__(self, dtype, head_dim: int, head_dim_v: int, causal: bool, *,
                 policy: SoftmaxPolicy = DEFAULT_POLICY, tile_m: int = 128,
                 tile_n: int | None = None, num_stages: int | None = None, pingpong: bool = True,
                 scheduler=tile_scheduler.StaticTileScheduler):
        if head_dim % 16 or head_dim_v % 16 or not (16 <= head_dim <= 256 and 16 <= head_dim_v <= 256):
            raise ValueError(f"head_dim: expected multiples of 16 in [16, 256], got ({head_dim}, {head_dim_v})")
        if not isinstance(policy, SoftmaxPolicy):
            raise TypeError(f"policy: expected a SoftmaxPolicy, got {type(policy).__name__}")
        policy.check_dtype(dtype)  # fp16 holds P <= 2^tau only for tau <= 15
        assert tile_m == 128, "step 3: two consumer warpgroups x one wgmma M=64 row block"
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.policy = policy
        self.tile_m = tile_m
        self.tile_n = tile_n or default_tile_n(head_dim, head_dim_v)
        self.num_stages = num_stages or default_num_stages(head_dim, head_dim_v, self.tile_n, tile_m)
        self.pingpong = pingpong
        self.scheduler = scheduler
        self.num_consumers = 2               # consumer warpgroups
        self.wg_m = tile_m // self.num_consumers  # 64 query rows per consumer
        self.num_threads = 128 * (1 + self.num_consumers)
        self.regs_producer, self.regs_consumer = 24, 240
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
        thr = cute.make_ordered_layout((128 // threads_per_row, threads_per_row), order=(1, 0))  # one warpgroup
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale_log2: Float32, softmax_scale: Float32, stream):
        # mQ (B, Sq, Hq, d), mK (B, Sk, Hkv, d), mV (B, Sk, Hkv, dv), mO (B, Sq, Hq, dv), mLSE (B, Hq, Sq)
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mO.element_type == self.dtype)):
            raise TypeError("q, k, v, out must share the kernel's dtype")
        tm, tn, d, dv, stages = self.wg_m, self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        nc = self.num_consumers
        mQ, mK = host_io.assume_strides_16B(mQ, d), host_io.assume_strides_16B(mK, d)
        mV, mO = host_io.assume_strides_16B(mV, dv), host_io.assume_strides_16B(mO, dv)

        # Q and O: one 64-row slab per consumer warpgroup (a trailing mode of size 2)
        sQ_layout = self._smem_layout(tm, d, nc)
        sK_layout = self._smem_layout(tn, d, stages)
        sV_layout = self._smem_layout(tn, dv, stages)
        sO_layout = self._smem_layout(tm, dv, nc)

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
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mQ), cute.slice_(sQ_layout, (None, None, 0)), (tm, d))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mK), cute.slice_(sK_layout, (None, None, 0)), (tn, d))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mV), cute.slice_(sV_layout, (None, None, 0)), (tn, dv))
        # bytes each stage's "full" barrier waits for (the whole box, zero-filled rows included)
        self.tma_bytes_Q = cute.size_in_bytes(self.dtype, sQ_layout)  # both slabs, one barrier
        self.tma_bytes_K = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))
        self.tma_bytes_V = cute.size_in_bytes(self.dtype, cute.slice_(sV_layout, (None, None, 0)))

        # O is written once, after the last QK^T: each consumer puts its O slab at the start of its
        # own Q slab (never over the other consumer's slab, which may still be in use)
        self.o_in_q = cute.cosize(cute.slice_(sO_layout, (None, None, 0))) <= cute.cosize(
            cute.slice_(sQ_layout, (None, None, 0)))

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

        num_m_blocks = (mQ.shape[1] + self.tile_m - 1) // self.tile_m
        grid = self.scheduler.grid_shape(num_m_blocks, mQ.shape[2], mQ.shape[0])
        self.kernel(tma_Q, tma_K, tma_V, mO, mLSE, softmax_scale_log2, softmax_scale,
                    mQ.shape[1], mK.shape[1], mQ.shape[2] // mK.shape[2],
                    tma_atom_Q, tma_atom_K, tma_atom_V,
                    tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, sO_layout,
                    self._gmem_copy_O(dv),
                    # min_blocks_per_mp=1 caps registers at entry (65536/384), which setmaxnreg needs
                    ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

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
        tn, d, dv, stages = self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group_idx = cute.arch.make_warp_uniform(tidx // 128)

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

        # mbarrier pipelines: producer = 1 arrival (an elected lane of the producer warp, which also
        # posts the expected byte count), consumers = the 8 warps of both consumer warpgroups
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumers * 4)
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
        cute.arch.sync_threads()         # ... and to every thread; the last CTA-wide barrier

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (64, d, 2)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (tn, d, stages)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (tn, dv, stages)

        # key blocks this 128-row query tile can see: all of them, or (causal) up to the diagonal
        # of its last row (query i sees key j iff j <= i + seqlen_k - seqlen_q). Both consumers
        # walk the same blocks: they share every K/V stage.
        n_block_max = (seqlen_k + tn - 1) // tn
        if const_expr(self.causal):
            last_visible = (m_block + 1) * self.tile_m + seqlen_k - seqlen_q  # exclusive bound on keys
            n_block_max = cutlass.min(n_block_max, cutlass.max((last_visible + tn - 1) // tn, 0))

        if warp_group_idx == 0:
            # ---------------------------------------------------------------- producer warpgroup
            cute.arch.setmaxregister_decrease(self.regs_producer)
            if warp_idx == 0:  # one warp issues (elect.sync inside needs the whole warp converged)
                gQ = cute.local_tile(tma_Q[None, None, head, batch], (self.wg_m, d), (None, 0))   # (64, d, m64)
                gK = cute.local_tile(tma_K[None, None, head_kv, batch], (tn, d), (None, 0))       # (tn, d, n_blocks)
                gV = cute.local_tile(tma_V[None, None, head_kv, batch], (tn, dv), (None, 0))      # (tn, dv, n_blocks)
                tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1),
                                                   cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
                tKsK, tKgK = cpasync.tma_partition(tma_atom_K, 0, cute.make_layout(1),
                                                   cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
                tVsV, tVgV = cpasync.tma_partition(tma_atom_V, 0, cute.make_layout(1),
                                                   cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
                # 1. Q: both 64-row slabs on one barrier (it expects both slabs' bytes)
                q_state = pipeline.PipelineState(1, Int32(0), Int32(0), Int32(1))
                pipe_Q.producer_acquire(q_state)
                for wg in cutlass.range_constexpr(self.num_consumers):
                    cute.copy(tma_atom_Q, tQgQ[None, m_block * self.num_consumers + wg], tQsQ[None, wg],
                              tma_bar_ptr=pipe_Q.producer_get_barrier(q_state))
                # 2. every visible K/V block, each as soon as its stage has been released
                #    (last block first: the order the consumers walk them in)
                for i in cutlass.range(n_block_max, unroll=1):
                    self.load_kv(i, n_block_max - 1 - i, pipe_K, pipe_V, tma_atom_K, tma_atom_V,
                                 tKgK, tKsK, tVgV, tVsV)
        else:
            # ---------------------------------------------------------------- consumer warpgroups
            cute.arch.setmaxregister_increase(self.regs_consumer)
            self.consume(warp_group_idx - 1, tidx % 128, m_block, head, batch, n_block_max, seqlen_q, seqlen_k,
                         softmax_scale_log2, mO, mLSE, sQ, sK, sV, storage, pipe_Q, pipe_K, pipe_V,
                         tiled_mma_qk, tiled_mma_pv, sO_layout, gmem_copy_O)

    @cute.jit
    def consume(self, wg: Int32, ctidx: Int32, m_block: Int32, head: Int32, batch: Int32, n_block_max: Int32,
                seqlen_q: Int32, seqlen_k: Int32, softmax_scale_log2: Float32, mO: cute.Tensor, mLSE: cute.Tensor,
                sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, storage, pipe_Q, pipe_K, pipe_V,
                tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, sO_layout: cute.ComposedLayout,
                gmem_copy_O: cute.TiledCopy):
        """One consumer warpgroup: step 2's per-tile math on its own 64 query rows."""
        tm, tn, d, dv, stages = self.wg_m, self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        row0 = m_block * self.tile_m + wg * tm  # first query row of this warpgroup
        # named barriers (0 is sync_threads): 1 + w = "consumer w may use the tensor cores",
        # 3 + w = this warpgroup's own 128-thread barrier
        my_turn, other_turn = 1 + wg, 2 - wg
        turn_threads = 2 * 128

        sQ_wg = sQ[None, None, wg]                                              # (64, d)
        if const_expr(self.o_in_q):  # (64, dv) at the base of our Q slab (same 128B swizzle phase)
            sO_slab = cute.slice_(sO_layout, (None, None, 0))
            sO_wg = cute.make_tensor(cute.recast_ptr(sQ_wg.iterator, sO_slab.inner, self.dtype), sO_slab.outer)
        else:
            sO_wg = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)[None, None, wg]
        # the same V bytes seen as (dv, tn, stages): the MN-major B operand of O = P V
        sVt = cute.composition(sV, cute.make_ordered_layout((dv, tn, stages), order=(1, 0, 2)))
        gO = cute.local_tile(mO[batch, None, head, None], (tm, dv), (m_block * self.num_consumers + wg, 0))

        # MMA partitions: smem operands become wgmma descriptors, accumulators registers
        thr_mma_qk = tiled_mma_qk.get_slice(ctidx)
        thr_mma_pv = tiled_mma_pv.get_slice(ctidx)
        tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ_wg))
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

        if const_expr(self.pingpong):
            if wg == 1:  # consumer 0 takes the first turn
                cute.arch.barrier_arrive(barrier_id=other_turn, number_of_threads=turn_threads)
        pipe_Q.consumer_wait(pipeline.PipelineState(1, Int32(0), Int32(0), Int32(0)))

        # 2. mainloop over key tiles, software-pipelined inside the warpgroup (FA3's intra-warpgroup
        #    overlap): one tensor-core turn issues S_i = Q K^T *and* O += P_{i-1} V, so the softmax
        #    of S_i runs while our own P V (and then the other consumer's GEMMs) occupy the tensor
        #    cores. P_{i-1} stays in registers (tOrP) across the turn; O is rescaled for tile i only
        #    after P_{i-1} V has landed in it. Blocks are walked last first: the blocks that need a
        #    mask (the partial last one, the causal diagonal) come first, then a hot loop with no
        #    mask code at all.
        tOrP = cute.make_rmem_tensor(thr_mma_pv.partition_shape_A((tm, tn)), self.dtype)
        row_scale = cute.make_rmem_tensor((num_rows,), Float32)
        # blocks [0, n_unmasked) need no mask for any row of the CTA: full, and (causal) left of the
        # diagonal of the CTA's first row (key j visible to row i iff j <= i + seqlen_k - seqlen_q)
        n_unmasked = seqlen_k // tn
        if const_expr(self.causal):
            diag = m_block * self.tile_m + 1 + seqlen_k - seqlen_q
            n_unmasked = cutlass.min(n_unmasked, cutlass.max(diag, 0) // tn)
        n_masked = n_block_max - cutlass.min(n_unmasked, n_block_max)  # walked first (i < n_masked)
        if n_block_max > 0:
            # 2a. prologue: S_0 alone (O is still 0: nothing to rescale)
            st0 = self.kv_state(Int32(0), producer=False)
            pipe_K.consumer_wait(st0)
            acc_S0 = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((tm, tn)), Float32)
            if const_expr(self.pingpong):
                cute.arch.barrier(barrier_id=my_turn, number_of_threads=turn_threads)
            wgmma_gemm(tiled_mma_qk, acc_S0, tSrQ, tSrK[None, None, None, st0.index], zero_init=True, wait=False)
            if const_expr(self.pingpong):
                cute.arch.barrier_arrive(barrier_id=other_turn, number_of_threads=turn_threads)
            warpgroup.wait_group(0)
            pipe_K.consumer_release(st0)
            self.online_softmax(acc_S0, n_block_max - 1, True, row0, seqlen_q, seqlen_k, softmax_scale_log2,
                                tScS_rc, row_max, row_sum, row_scale)
            self.store_P(acc_S0, tOrP)

            # 2b. steady state, masked blocks first, then the hot loop
            for i in cutlass.range(1, n_masked, unroll=1):
                self.overlapped_step(i, n_block_max - 1 - i, True, row0, seqlen_q, seqlen_k, softmax_scale_log2,
                                     tScS_rc, row_max, row_sum, row_scale, acc_O, tOrP,
                                     tSrQ, tSrK, tOrVt, thr_mma_qk, tiled_mma_qk, tiled_mma_pv, pipe_K, pipe_V,
                                     my_turn, other_turn)
            for i in cutlass.range(cutlass.max(n_masked, 1), n_block_max, unroll=1):
                self.overlapped_step(i, n_block_max - 1 - i, False, row0, seqlen_q, seqlen_k, softmax_scale_log2,
                                     tScS_rc, row_max, row_sum, row_scale, acc_O, tOrP,
                                     tSrQ, tSrK, tOrVt, thr_mma_qk, tiled_mma_qk, tiled_mma_pv, pipe_K, pipe_V,
                                     my_turn, other_turn)

            # 2c. drain: the last P V
            st_last = self.kv_state(n_block_max - 1, producer=False)
            pipe_V.consumer_wait(st_last)
            if const_expr(self.pingpong):
                cute.arch.barrier(barrier_id=my_turn, number_of_threads=turn_threads)
            wgmma_gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, st_last.index], zero_init=False, wait=False)
            if const_expr(self.pingpong):
                cute.arch.barrier_arrive(barrier_id=other_turn, number_of_threads=turn_threads)
            warpgroup.wait_group(0)
            pipe_V.consumer_release(st_last)

        if const_expr(self.pingpong):
            if wg == 0:  # consume consumer 1's last hand-over: no arrival outlives the loop
                cute.arch.barrier(barrier_id=my_turn, number_of_threads=turn_threads)

        # 3. epilogue: O /= l and lse, then O to global memory
        self.normalize_O_write_lse(acc_O, row_max, row_sum, softmax_scale_log2, tScS_rc,
                                   mLSE, batch, head, row0, seqlen_q)
        self.store_O(acc_O, tiled_mma_pv, gmem_copy_O, sO_wg, gO, ctidx, row0, seqlen_q, wg)

    @cute.jit
    def overlapped_step(self, i: Int32, n_block: Int32, mask: cutlass.Constexpr[bool], row0: Int32,
                        seqlen_q: Int32, seqlen_k: Int32, softmax_scale_log2: Float32, tScS_rc: cute.Tensor,
                        row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor,
                        acc_O: cute.Tensor, tOrP: cute.Tensor, tSrQ: cute.Tensor,
                        tSrK: cute.Tensor, tOrVt: cute.Tensor, thr_mma_qk, tiled_mma_qk: cute.TiledMma,
                        tiled_mma_pv: cute.TiledMma, pipe_K, pipe_V, my_turn: Int32, other_turn: Int32):
        """The i-th key block walked (block n_block): one turn issues S_i and O += P_{i-1} V_{i-1}."""
        tm, tn = self.wg_m, self.tile_n
        turn_threads = 2 * 128
        st = self.kv_state(i, producer=False)
        st_prev = self.kv_state(i - 1, producer=False)
        pipe_K.consumer_wait(st)
        pipe_V.consumer_wait(st_prev)
        acc_S = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((tm, tn)), Float32)
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=my_turn, number_of_threads=turn_threads)
        wgmma_gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, st.index], zero_init=True, wait=False)
        wgmma_gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, st_prev.index], zero_init=False, wait=False)
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=other_turn, number_of_threads=turn_threads)
        warpgroup.wait_group(1)  # S_i has landed (P_{i-1} V_{i-1} may still run)
        pipe_K.consumer_release(st)
        rescale_O = self.online_softmax(acc_S, n_block, mask, row0, seqlen_q, seqlen_k, softmax_scale_log2,
                                        tScS_rc, row_max, row_sum, row_scale)
        warpgroup.wait_group(0)  # P_{i-1} V_{i-1} has landed: O and tOrP are ours again
        pipe_V.consumer_release(st_prev)
        if rescale_O:  # the warp's vote: some row's max grew by more than tau
            acc_O_rc = acc_rowcol(acc_O)
            for r in cutlass.range_constexpr(cute.size(row_scale)):
                for c in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[1])):
                    acc_O_rc[r, c] = acc_O_rc[r, c] * row_scale[r]
        self.store_P(acc_S, tOrP)

    @cute.jit
    def online_softmax(self, acc_S: cute.Tensor, n_block: Int32, mask: cutlass.Constexpr[bool], row0: Int32,
                       seqlen_q: Int32, seqlen_k: Int32, softmax_scale_log2: Float32, tScS_rc: cute.Tensor,
                       row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor):
        """S_j (accumulator) -> P_j = 2^(S*scale - m*scale) in place, with the mask, the running
        (possibly stale) max and sum (log2 domain, one row pair per thread). Returns the warp's vote:
        True when O must be multiplied by row_scale, which the caller does once the in-flight P V
        that writes O has landed. mask=False: a block the caller knows to be fully visible to every
        row (no mask code is generated)."""
        tn = self.tile_n
        acc_S_rc = acc_rowcol(acc_S)
        num_rows = cute.size(row_max)
        # mask keys >= seqlen_k, and (causal) keys past each row's diagonal
        if const_expr(mask):
            for r in cutlass.range_constexpr(num_rows):
                col_limit = seqlen_k - n_block * tn  # in this tile's column coordinates
                if const_expr(self.causal):
                    row = row0 + tScS_rc[r, 0][0]
                    col_limit = cutlass.min(col_limit, row + 1 + seqlen_k - seqlen_q - n_block * tn)
                for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
                    if tScS_rc[r, c][1] >= col_limit:
                        acc_S_rc[r, c] = -Float32.inf
        row_max_new = cute.make_rmem_tensor((num_rows,), Float32)
        for r in cutlass.range_constexpr(num_rows):
            m_tile = acc_S_rc[r, 0]
            for c in cutlass.range_constexpr(1, cute.size(acc_S_rc, mode=[1])):
                m_tile = cute.arch.fmax(m_tile, acc_S_rc[r, c])
            m_tile = quad_allreduce(m_tile, cute.arch.fmax)
            row_max_new[r] = cute.arch.fmax(row_max[r], m_tile)
        # FA4: one warp-uniform vote over the warp's 16 rows; only when some row's max grew by more
        # than tau do they all move to their new max (l here, O in the caller)
        rescale = softmax_policy.rescale_vote(row_max, row_max_new, softmax_scale_log2,
                                              self.policy.rescale_threshold)
        if rescale:
            for r in cutlass.range_constexpr(num_rows):
                # a row with nothing visible yet keeps m = -inf: subtract 0 instead (no inf - inf)
                m_safe = Float32(0.0) if row_max_new[r] == -Float32.inf else row_max_new[r]
                row_scale[r] = cute.math.exp2((row_max[r] - m_safe) * softmax_scale_log2, fastmath=True)
                row_max[r] = row_max_new[r]
                row_sum[r] = row_sum[r] * row_scale[r]
        # P = 2^(S*scale - m*scale) <= 2^tau with the kept m; the policy's share on the FMA pipe
        for r in cutlass.range_constexpr(num_rows):
            m_safe = Float32(0.0) if row_max[r] == -Float32.inf else row_max[r]
            row_sum[r] += softmax_policy.exp2_row(acc_S_rc[r, None], softmax_scale_log2,
                                                  m_safe * softmax_scale_log2, self.policy)
            # (row_sum is a per-thread partial; quad-reduced at the end)
        return rescale

    @cute.jit
    def store_P(self, acc_S: cute.Tensor, tOrP: cute.Tensor):
        """P (fp32 accumulator) -> the 16-bit A-operand fragment of O += P V: the same registers in
        accumulator order (step 1's docstring), converted in place."""
        tOrP_as_acc = cute.make_tensor(tOrP.iterator, cute.make_layout(acc_S.shape))
        tOrP_as_acc.store(acc_S.load().to(self.dtype))

    @cute.jit
    def normalize_O_write_lse(self, acc_O: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor,
                              softmax_scale_log2: Float32, tScS_rc: cute.Tensor, mLSE: cute.Tensor,
                              batch: Int32, head: Int32, row0: Int32, seqlen_q: Int32):
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
                row = row0 + tScS_rc[r, 0][0]
                if row < seqlen_q:
                    mLSE[batch, head, row] = lse[r]

    @cute.jit
    def store_O(self, acc_O: cute.Tensor, tiled_mma_pv: cute.TiledMma, gmem_copy_O: cute.TiledCopy,
                sO: cute.Tensor, gO: cute.Tensor, ctidx: Int32, row0: Int32, seqlen_q: Int32, wg: Int32):
        """O: registers -> smem (accumulator layout) -> 16-byte coalesced, row-guarded stores.
        Only this warpgroup touches its slab, so a 128-thread named barrier replaces sync_threads
        (the producer warpgroup may have exited already)."""
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        if const_expr(self.o_in_q):
            cute.arch.barrier(barrier_id=3 + wg, number_of_threads=128)  # our last QK^T has read our Q slab
        smem_copy_O = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma_pv)
        thr_smem_copy_O = smem_copy_O.get_slice(ctidx)
        cute.copy(smem_copy_O, thr_smem_copy_O.retile(rO), thr_smem_copy_O.partition_D(sO))
        cute.arch.barrier(barrier_id=3 + wg, number_of_threads=128)
        thr_copy_O = gmem_copy_O.get_slice(ctidx)
        tOsO, tOgO = thr_copy_O.partition_S(sO), thr_copy_O.partition_D(gO)
        tOcO = thr_copy_O.partition_S(cute.make_identity_tensor((self.wg_m, self.head_dim_v)))
        tOrO = cute.make_rmem_tensor_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        q_rows_left = seqlen_q - row0
        for m in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
            if tOcO[0, m, 0][0] < q_rows_left:
                cute.copy(gmem_copy_O, tOrO[None, m, None], tOgO[None, m, None])

    # -------------------------------------------------------------- pipeline bookkeeping
    def kv_state(self, i: Int32, producer: bool) -> pipeline.PipelineState:
        """Pipeline slot of the i-th key block walked: stage i % stages; the phase flips every lap
        round the ring. A producer starts one phase ahead: its first lap must not wait for "empty"."""
        phase = (i // self.num_stages) % 2
        if const_expr(producer):
            phase = phase ^ 1
        return pipeline.PipelineState(self.num_stages, i, i % self.num_stages, phase)

    @cute.jit
    def load_kv(self, i: Int32, n_block: Int32, pipe_K, pipe_V, tma_atom_K: cute.CopyAtom,
                tma_atom_V: cute.CopyAtom, tKgK: cute.Tensor, tKsK: cute.Tensor, tVgV: cute.Tensor,
                tVsV: cute.Tensor):
        """(producer warp) the i-th load, key block n_block: wait until ring slot i is free, post the
        byte count, issue K then V."""
        st = self.kv_state(i, producer=True)
        pipe_K.producer_acquire(st)
        cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, st.index], tma_bar_ptr=pipe_K.producer_get_barrier(st))
        pipe_V.producer_acquire(st)
        cute.copy(tma_atom_V, tVgV[None, n_block], tVsV[None, st.index], tma_bar_ptr=pipe_V.producer_get_barrier(st))


# ------------------------------------------------------------------------------------------------
# Host API
# ------------------------------------------------------------------------------------------------
def make_kernel(dtype, head_dim, head_dim_v, causal, *, policy: SoftmaxPolicy = DEFAULT_POLICY):
    return FlashAttentionForwardSm90Step4(dtype, head_dim, head_dim_v, causal, policy=policy)


def _for_policy(rescale_threshold, emulation_fraction):
    """(policy, cache name, make_kernel) of one softmax policy: each policy is its own kernel, so the
    shared host helpers, which cache one compile per name, see the policy in the name."""
    policy = SoftmaxPolicy(rescale_threshold, emulation_fraction)  # validates both arguments
    return policy, f"{STEP}[{policy.describe()}]", functools.partial(make_kernel, policy=policy)


def attention_forward(q, k, v, *, softmax_scale=None, causal=False, out=None, lse=None,
                      rescale_threshold=DEFAULT_RESCALE_THRESHOLD, emulation_fraction=HOPPER_EMULATION_FRACTION):
    """q (B,Sq,Hq,D), k (B,Sk,Hkv,D), v (B,Sk,Hkv,Dv) CUDA fp16/bf16 -> (out (B,Sq,Hq,Dv), lse (B,Hq,Sq) fp32).
    rescale_threshold: tau in log2 units (0 = rescale whenever a max grows; <= 15 for fp16);
    emulation_fraction: share of the exponentials on the FMA pipe, in steps of 1/16."""
    policy, name, make = _for_policy(rescale_threshold, emulation_fraction)
    if str(getattr(q, "dtype", "")) == "torch.float16":
        policy.check_dtype(cutlass.Float16)
    return host_io.attention_forward_impl(name, make, q, k, v, softmax_scale=softmax_scale,
                                          causal=causal, out=out, lse=lse)


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, *,
                 rescale_threshold=DEFAULT_RESCALE_THRESHOLD,
                 emulation_fraction=HOPPER_EMULATION_FRACTION) -> compile_cache.Compiled:
    """Compile for sm_90a with fake tensors (no GPU needed); returns the compiled kernel + report."""
    _, name, make = _for_policy(rescale_threshold, emulation_fraction)
    return host_io.compile_fake(name, make, dtype=dtype, head_dim=head_dim,
                                head_dim_v=head_dim if head_dim_v is None else head_dim_v, causal=causal)


def run(batch=2, seqlen_q=1024, seqlen_k=1024, heads=8, heads_kv=None, head_dim=128, head_dim_v=None,
        causal=False, dtype="bf16", check=True, rescale_threshold=DEFAULT_RESCALE_THRESHOLD,
        emulation_fraction=HOPPER_EMULATION_FRACTION):
    """On a Hopper GPU: check against the stage-0 reference (FA4 rule) and time. Otherwise:
    compile for sm_90a and print the resource report."""
    _, name, make = _for_policy(rescale_threshold, emulation_fraction)
    forward = functools.partial(attention_forward, rescale_threshold=rescale_threshold,
                                emulation_fraction=emulation_fraction)
    return runner.run_step(name, make, forward, batch=batch, seqlen_q=seqlen_q,
                           seqlen_k=seqlen_k, heads=heads, heads_kv=heads_kv, head_dim=head_dim,
                           head_dim_v=head_dim_v, causal=causal, dtype=dtype, check=check)


if __name__ == "__main__":
    _parser = runner.shape_parser(__doc__)
    _parser.add_argument("--rescale_threshold", type=float, default=DEFAULT_RESCALE_THRESHOLD, help="tau, log2 units")
    _parser.add_argument("--emulation_fraction", type=float, default=HOPPER_EMULATION_FRACTION)
    _args = _parser.parse_args()
    run(**runner.shape_kwargs(_args), rescale_threshold=_args.rescale_threshold,
        emulation_fraction=_args.emulation_fraction)
