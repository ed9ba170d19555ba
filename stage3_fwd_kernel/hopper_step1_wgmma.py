"""Stage 3, Hopper step 1: a first correct FlashAttention forward with wgmma.

This is stage 1's tiled online softmax, moved onto the tensor cores of an H100. One warpgroup
(128 threads = 4 warps) owns one tile of ``tile_m = 64`` query rows -- exactly the M of one
``wgmma`` instruction -- and walks over the keys in tiles of ``tile_n`` rows:

    for each K/V tile j:                      (synchronous: load, wait, compute)
        S   = Q K_j^T                         wgmma, both operands from shared memory (SS)
        S   = mask(S)                         out-of-range keys, causal
        m   = max(m, rowmax(S))               4 threads share a row -> 2 quad shuffles
        P   = exp2(S * scale*log2(e) - m * scale*log2(e))     one FFMA + MUFU.EX2 per score
        l   = l * exp2((m_old - m) * ...) + rowsum(P);   O *= same factor
        O  += P V_j                           wgmma, P from registers (RS), V from shared memory
    O /= l;  lse = (m * scale*log2(e) + log2(l)) * ln(2)

Why these choices (numbers for bf16, head_dim d = 128, tile_n = 128):

* **wgmma M = 64 per warpgroup.** A Hopper accumulator of 64 x N fp32 spreads over 128 threads as
  N/2 registers each: S is 64 registers, O is 64 more. Thread t of warp w holds rows
  16w + t/4 and 16w + t/4 + 8, columns 8j + 2(t%4) + {0, 1}: every row lives in the 4 threads of
  a quad, so a row max / row sum is a local reduction plus ``shfl.bfly`` by 2 and by 1.
* **P stays in registers (RS wgmma).** The fp32 S accumulator, converted to bf16 in place, is
  *already* the register fragment the A operand of the next wgmma expects: the accumulator's
  value order (2 columns, 2 rows 8 apart, N/8 column groups) equals the A fragment's
  (2 columns, 2 rows, 2 column halves, N/16 k-blocks) read in the same order. So P costs zero
  shared-memory traffic: writing it to smem (SS) would add 64*128*2 = 16 KB of stores and reads
  per tile, plus a barrier -- the paper's Blackwell design moves P through TMEM for the same reason.
* **Shared memory layouts are the wgmma canonical swizzles.** Q, K and V tiles are stored
  row-major with the 128-byte swizzle (a 64-element bf16 row per swizzle atom; 64-byte or 32-byte
  for head dims that are not a multiple of 64). Q K^T reads both "K-major" (contiguous along d).
  P V reads V as the B operand with N = d and K = keys: V is contiguous along d, i.e. MN-major,
  which wgmma supports for 16-bit types through the descriptor's transpose bit; we only build a
  transposed *view* of the same bytes (``sVt``).
* **Loads are plain cp.async (16 bytes per thread per instruction), then wait.** Nothing is
  overlapped: the tensor cores idle while a tile arrives. Step 2 fixes that with TMA and a
  multi-stage pipeline. Rows past the end of the sequence are zero-filled in shared memory: a
  masked score gives P = 0, but 0 * (garbage that happens to be NaN or Inf) is NaN, so V's tail
  rows must be finite.
* **-inf handling.** A row that has seen no visible key has m = -inf; we then subtract 0 instead
  of m (so exp2(-inf - -inf) = NaN never happens), and at the end l = 0 gives out = 0 and
  lse = -inf.

Shared memory (bf16): Q 64*d*2 + K tile_n*d*2 + V tile_n*dv*2 + O 64*dv*2
  d=64:  8 + 16 + 16 + 8  = 48 KB        d=128: 16 + 32 + 32 + 16 = 96 KB
  d=256 (tile_n=64): 32 + 32 + 32 + 32 = 128 KB      (192,128): 24 + 48 + 32 + 16 = 120 KB
Registers: S (tile_n/2) + O (dv/2) + P (tile_n/4) fp32/packed-bf16 per thread, well under 255.

Supports fp16/bf16, head_dim in {64, 96, 128, 192, 256} (and (192, 128) for (QK, V)), causal
(bottom-right aligned) or not, GQA/MQA, any seqlens, any 16-byte aligned strides on non-last dims.
The tile scheduler is a parameter (``tile_scheduler.StaticTileScheduler`` by default).
Varlen would enter through the two lines that read ``seqlen_q`` / ``seqlen_k`` and the batch
offset of the ``gQ``/``gK``/``gV``/``gO`` views; it is left to a later step.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory.smem import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from stage3_fwd_kernel import compile_cache, host_io, runner, tile_scheduler

STEP = "hopper_step1_wgmma"


def default_tile_n(head_dim: int, head_dim_v: int) -> int:
    """Key-tile rows: 128 while S (tile_n/2 regs) + O (dv/2 regs) fit comfortably, 64 for d=256."""
    return 64 if max(head_dim, head_dim_v) > 192 else 128


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


class FlashAttentionForwardSm90Step1:
    """One warpgroup per CTA, Q tile 64 x d, synchronous cp.async loads, SS + RS wgmma."""

    def __init__(self, dtype, head_dim: int, head_dim_v: int, causal: bool, *, tile_m: int = 64,
                 tile_n: int | None = None, scheduler=tile_scheduler.StaticTileScheduler):
        if head_dim % 16 or head_dim_v % 16 or not (16 <= head_dim <= 256 and 16 <= head_dim_v <= 256):
            raise ValueError(f"head_dim: expected multiples of 16 in [16, 256], got ({head_dim}, {head_dim_v})")
        assert tile_m == 64, "step 1 is one warpgroup = one wgmma M=64 row block"
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.tile_m = tile_m
        self.tile_n = tile_n or default_tile_n(head_dim, head_dim_v)
        self.scheduler = scheduler
        self.num_threads = 128
        self.smem_bytes = None

    # -------------------------------------------------------------- host side (traced once)
    def _smem_layout(self, rows: int, cols: int):
        """Row-major (contiguous along `cols`) tile with the widest swizzle wgmma accepts."""
        atom_kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, cols)
        atom = warpgroup.make_smem_layout_atom(atom_kind, self.dtype)
        return cute.tile_to_shape(atom, (rows, cols), (0, 1))

    def _gmem_copy(self, cols: int, async_copy: bool):
        """128 threads, 16 bytes each, a row of the swizzle atom per group of threads."""
        elems = 128 // self.dtype.width
        atom_cols = 64 if cols % 64 == 0 else (32 if cols % 32 == 0 else 16)
        threads_per_row = atom_cols // elems
        op = cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL) if async_copy else cute.nvgpu.CopyUniversalOp()
        atom = cute.make_copy_atom(op, self.dtype, num_bits_per_copy=128)
        thr = cute.make_ordered_layout((self.num_threads // threads_per_row, threads_per_row), order=(1, 0))
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale_log2: Float32, softmax_scale: Float32, stream):
        # mQ (B, Sq, Hq, d), mK (B, Sk, Hkv, d), mV (B, Sk, Hkv, dv), mO (B, Sq, Hq, dv), mLSE (B, Hq, Sq)
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mO.element_type == self.dtype)):
            raise TypeError("q, k, v, out must share the kernel's dtype")
        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        mQ, mK = host_io.assume_strides_16B(mQ, d), host_io.assume_strides_16B(mK, d)
        mV, mO = host_io.assume_strides_16B(mV, dv), host_io.assume_strides_16B(mO, dv)

        sQ_layout = self._smem_layout(tm, d)
        sK_layout = self._smem_layout(tn, d)
        sV_layout = self._smem_layout(tn, dv)
        sO_layout = self._smem_layout(tm, dv)

        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # S (tm x tn) = Q (tm x d) . K (tn x d)^T : A and B both K-major, both from smem
        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (tm, tn))
        # O (tm x dv) = P (tm x tn) . V : A = P from registers, B = V^T (dv x tn) is MN-major
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, (1, 1, 1), (tm, dv),
            a_source=warpgroup.OperandSource.RMEM)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()

        num_m_blocks = (mQ.shape[1] + tm - 1) // tm
        grid = self.scheduler.grid_shape(num_m_blocks, mQ.shape[2], mQ.shape[0])
        self.kernel(mQ, mK, mV, mO, mLSE, softmax_scale_log2, softmax_scale,
                    tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, sO_layout,
                    self._gmem_copy(d, True), self._gmem_copy(dv, True), self._gmem_copy(dv, False),
                    ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    # -------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, softmax_scale_log2: Float32, softmax_scale: Float32,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
               gmem_copy_QK: cute.TiledCopy, gmem_copy_V: cute.TiledCopy, gmem_copy_O: cute.TiledCopy):
        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        tidx, _, _ = cute.arch.thread_idx()

        # 0. which tile, which sequence lengths (varlen would plug in here)
        work = self.scheduler.initial_work()
        m_block, head, batch = work.m_block, work.head, work.batch
        seqlen_q = mQ.shape[1]
        seqlen_k = mK.shape[1]
        head_kv = head // (mQ.shape[2] // mK.shape[2])  # GQA: q head h reads kv head h // ratio

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (tm, d)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (tn, d)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (tn, dv)
        sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)  # (tm, dv)
        # the same V bytes seen as (dv, tn): the MN-major B operand of O = P V
        sVt = cute.composition(sV, cute.make_ordered_layout((dv, tn), order=(1, 0)))

        gQ = cute.local_tile(mQ[batch, None, head, None], (tm, d), (m_block, 0))      # (tm, d)
        gK = cute.local_tile(mK[batch, None, head_kv, None], (tn, d), (None, 0))      # (tn, d, n_blocks)
        gV = cute.local_tile(mV[batch, None, head_kv, None], (tn, dv), (None, 0))     # (tn, dv, n_blocks)
        gO = cute.local_tile(mO[batch, None, head, None], (tm, dv), (m_block, 0))     # (tm, dv)

        # per-thread slices of the global->shared copies, with row coordinates for predication
        thr_copy_QK = gmem_copy_QK.get_slice(tidx)
        thr_copy_V = gmem_copy_V.get_slice(tidx)
        tQgQ, tQsQ = thr_copy_QK.partition_S(gQ), thr_copy_QK.partition_D(sQ)
        tKgK, tKsK = thr_copy_QK.partition_S(gK), thr_copy_QK.partition_D(sK)
        tVgV, tVsV = thr_copy_V.partition_S(gV), thr_copy_V.partition_D(sV)
        tQcQ = thr_copy_QK.partition_S(cute.make_identity_tensor((tm, d)))
        tKcK = thr_copy_QK.partition_S(cute.make_identity_tensor((tn, d)))
        tVcV = thr_copy_V.partition_S(cute.make_identity_tensor((tn, dv)))

        # MMA partitions: smem operands become wgmma descriptors, accumulators registers
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = thr_mma_qk.make_fragment_A(thr_mma_qk.partition_A(sQ))
        tSrK = thr_mma_qk.make_fragment_B(thr_mma_qk.partition_B(sK))
        tOrVt = thr_mma_pv.make_fragment_B(thr_mma_pv.partition_B(sVt))
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((tm, dv)), Float32)
        acc_O.fill(0.0)
        # (row, col) of each S accumulator element inside the (tm, tn) tile, for masking
        tScS_rc = acc_rowcol(thr_mma_qk.partition_C(cute.make_identity_tensor((tm, tn))))
        num_rows = cute.size(tScS_rc, mode=[0])  # 2 rows per thread
        row_max = cute.make_rmem_tensor((num_rows,), Float32)
        row_sum = cute.make_rmem_tensor((num_rows,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)

        # 1. load Q (cp.async; rows past seqlen_q are zero-filled)
        q_rows_left = seqlen_q - m_block * tm
        for m in cutlass.range_constexpr(cute.size(tQsQ.shape[1])):
            if tQcQ[0, m, 0][0] < q_rows_left:
                cute.copy(gmem_copy_QK, tQgQ[None, m, None], tQsQ[None, m, None])
            else:
                tQsQ[None, m, None].fill(0)
        cute.arch.cp_async_commit_group()

        # key blocks this query tile can see: all of them, or (causal) up to the diagonal of its
        # last row: query i sees key j iff j <= i + seqlen_k - seqlen_q
        n_block_max = (seqlen_k + tn - 1) // tn
        if const_expr(self.causal):
            last_visible = (m_block + 1) * tm + seqlen_k - seqlen_q  # exclusive bound on keys
            n_block_max = cutlass.min(n_block_max, cutlass.max((last_visible + tn - 1) // tn, 0))

        # 2. mainloop over key tiles
        for n_block in cutlass.range(n_block_max, unroll=1):
            # 2a. load K_j, V_j (rows past seqlen_k zero-filled: P=0 there, and 0*NaN would be NaN)
            k_rows_left = seqlen_k - n_block * tn
            for m in cutlass.range_constexpr(cute.size(tKsK.shape[1])):
                if tKcK[0, m, 0][0] < k_rows_left:
                    cute.copy(gmem_copy_QK, tKgK[None, m, None, n_block], tKsK[None, m, None])
                else:
                    tKsK[None, m, None].fill(0)
            for m in cutlass.range_constexpr(cute.size(tVsV.shape[1])):
                if tVcV[0, m, 0][0] < k_rows_left:
                    cute.copy(gmem_copy_V, tVgV[None, m, None, n_block], tVsV[None, m, None])
                else:
                    tVsV[None, m, None].fill(0)
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            # cp.async / st.shared are generic-proxy writes; wgmma reads smem through the async
            # proxy, so each writer fences before the barrier that publishes the tile.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()

            # 2b. S = Q K_j^T
            acc_S = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((tm, tn)), Float32)
            wgmma_gemm(tiled_mma_qk, acc_S, tSrQ, tSrK, zero_init=True)

            # 2c-2d. S_j -> P_j in place (mask, running max and sum), O rescaled
            self.online_softmax(acc_S, n_block, m_block, seqlen_q, seqlen_k, softmax_scale_log2,
                                tScS_rc, row_max, row_sum, acc_O)

            # 2e. P -> bf16/fp16 in the A-operand register fragment, then O += P V_j
            tOrP = cute.make_rmem_tensor(thr_mma_pv.partition_shape_A((tm, tn)), self.dtype)
            # same registers in accumulator order (see module docstring): convert in place
            tOrP_as_acc = cute.make_tensor(tOrP.iterator, cute.make_layout(acc_S.shape))
            tOrP_as_acc.store(acc_S.load().to(self.dtype))
            wgmma_gemm(tiled_mma_pv, acc_O, tOrP, tOrVt, zero_init=False)
            cute.arch.sync_threads()  # every warp is done with sK/sV before the next load

        # 3. epilogue: O /= l and lse, then O to global memory
        self.normalize_O_write_lse(acc_O, row_max, row_sum, softmax_scale_log2, tScS_rc,
                                   mLSE, batch, head, m_block, seqlen_q)
        self.store_O(acc_O, tiled_mma_pv, gmem_copy_O, sO, gO, tidx, q_rows_left)

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
                sO: cute.Tensor, gO: cute.Tensor, tidx: Int32, q_rows_left: Int32):
        """O: registers -> smem (accumulator layout) -> 16-byte coalesced, row-guarded stores."""
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
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
        for m in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
            if tOcO[0, m, 0][0] < q_rows_left:
                cute.copy(gmem_copy_O, tOrO[None, m, None], tOgO[None, m, None])


# ------------------------------------------------------------------------------------------------
# Host API
# ------------------------------------------------------------------------------------------------
def make_kernel(dtype, head_dim, head_dim_v, causal):
    return FlashAttentionForwardSm90Step1(dtype, head_dim, head_dim_v, causal)


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
