"""A consumer warpgroup on one tile: set-up, the walk over key blocks, then the epilogue.

Each consumer owns 64 query rows. The walk is software-pipelined inside the warpgroup (FA3's
intra-warpgroup overlap): one tensor-core turn issues S_i = Q K_i^T *and* O += P_{i-1} V_{i-1}, so
the softmax of S_i runs while its own P V (and then the other consumers' GEMMs) occupy the tensor
cores. P_{i-1} stays in registers across the turn; O is rescaled for block i only after
P_{i-1} V_{i-1} has landed in it. Blocks are walked last first: the blocks that need a mask (the
partial last one, the causal diagonal or a window's right edge) come first, then a hot loop with no
mask code at all, then -- a left window -- the blocks crossing the rows' left edges.

Instruction order inside a step. The wait for V_{i-1} comes after S_i is issued, right before its
P V, so it no longer delays S_i. The wait for P_{i-1} V_{i-1} is written after the softmax; ptxas
hoists a `wgmma.wait_group` to the top of its basic block, so it lands after the first few
exponentials, and P is packed right after it (fragments.store_P), before the O rescale's branch.

Half blocks. A masked block is often half invisible to a warpgroup's 64 rows: on a 128 x 128 causal
tile the diagonal block's second 64 keys lie right of every row of the first warpgroup, and a left
window's last block hides its first half from the second. That warpgroup then issues S as m64n64
wgmmas over the half its rows see (the other half -inf), and -- for the last block, in the drain --
P V over that half's k-steps alone. A step that skips a half is a whole copy of the step: a branch
around the wgmmas alone, merging two register sets, made ptxas serialize them. The masks test only
the edges a block can cross (components.mask: RIGHT, LEFT or BOTH).

Descriptors built once: the wgmma operands are descriptors this function builds per tile
(`wgmma_desc`: Q's for every k-step, K's and V's for stage 0 plus `stage * stage_step` per block).
Through `cute.gemm` ptxas re-derived all three from the shared-memory base in every key block,
about 30 uniform-datapath instructions per block at d = 128; same results bit for bit.
measured: docs/measurements.md
"""
from __future__ import annotations

from typing import Any, NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import warpgroup

from stage3_fwd_kernel import trace, wgmma_desc
from stage3_fwd_kernel.components.mask import BOTH, LEFT
from stage3_fwd_kernel.components.score_mod import LOG2_E
from stage3_fwd_kernel.components.block_range import hot_loop_end, num_left_masked_blocks, num_masked_blocks
from stage3_fwd_kernel.hopper import barriers, epilogue
from stage3_fwd_kernel.hopper.fragments import acc_rowcol, scale_O_rows, store_P
from stage3_fwd_kernel.hopper.producer import SmemBuffers, kv_state, seq_view
from stage3_fwd_kernel.hopper.softmax import RowState, ScoreContext, online_softmax


class PStore(NamedTuple):
    """P's way to shared memory (kernel.p_smem): 4-byte stores in the S accumulator's order."""

    copy: Any        # the tiled copy over the S MMA's accumulator layout
    thr: Any         # this thread's slice of it
    dst: Any         # this thread's destinations in the warpgroup's (64, tn) P slab


class TileOperands(NamedTuple):
    """A consumer's MMA operands and accumulators for one tile."""

    qk: Any          # wgmma_desc.QKOperands: S = Q K^T from shared memory
    pv: Any          # wgmma_desc.PVOperands: O += P V, P from registers (or shared memory: p_store)
    thr_mma_qk: Any  # this thread's slice of the S MMA (accumulator shapes)
    acc_O: Any       # fp32 O accumulator
    tOrP: Any        # P in the input dtype, the A operand of P V
    p_store: Any = None  # PStore when P V reads P from shared memory (kernel.p_smem), else None


class ConsumerArgs(NamedTuple):
    """The kernel arguments every consumer tile uses."""

    softmax_scale_log2: Any
    score_scale: Any      # softcap's tanh input scale (components.score_mod)
    mSink: Any            # (Hq,) fp32 learnable sink logits, or None
    mO: Any               # (B, Sq, Hq, dv)
    mLSE: Any             # (B, Hq, Sq) fp32
    mma_qk: Any           # tiled MMA of S = Q K^T
    mma_pv: Any           # tiled MMA of O += P V
    sO_layout: Any        # (64, dv, nc) O staging layout
    gmem_copy_O: Any      # 128-thread, 16-byte tiled copy (O stores, V zeroing)


class Turns(NamedTuple):
    """The named barriers of this consumer's tensor-core turn (barriers.turn / next_turn), and its
    own 128-thread one (barriers.own: P's stores before its P V reads them, kernel.p_smem)."""

    mine: Any
    successor: Any
    own: Any = None


@cute.jit
def next_kv_state(st: pipeline.PipelineState) -> pipeline.PipelineState:
    """The ring slot after st: the next stage, the phase flipped on wrapping round (one add, a
    compare and two selects, rather than dividing the slot out of the block count)."""
    nxt = st.clone()
    nxt.advance()
    return nxt


@cute.jit
def consume(cfg, wg: Int32, ctidx: Int32, tile, n_block_max: Int32, kv_base: Int32, q_phase: Int32,
            args: ConsumerArgs, smem: SmemBuffers, n_block_min=None, chunk=None, mSplit=None):
    """Consumer wg on `tile` (cfg: the kernel; ctidx: the thread in the warpgroup). kv_base: K/V
    blocks consumed for earlier tiles (the ring position); q_phase: Q's phase for this tile. Split
    tail: keys [n_block_min, n_block_max) only, and a chunk >= 0 leaves its (O, lse) in mSplit."""
    softmax_scale_log2, mO, tiled_mma_qk, tiled_mma_pv = args.softmax_scale_log2, args.mO, args.mma_qk, args.mma_pv
    trace.cta_stamp("start")
    tm, tn, dv = cfg.wg_m, cfg.tile_n, cfg.head_dim_v
    nc = cfg.num_consumers
    row0 = tile.m_block * cfg.tile_m + wg * tm  # first query row of this warpgroup
    turns = Turns(barriers.turn(wg), barriers.next_turn(wg, nc), barriers.own(wg, nc))

    sQ_wg = smem.sQ[None, None, wg]                                          # (64, d)
    sO_wg = epilogue.o_staging(cfg, smem.storage, sQ_wg, args.sO_layout, wg)      # (64, dv) or None
    gO = cute.local_tile(seq_view(mO[tile.batch_out, None, tile.head, None], tile.offset_q, cfg.rows_shifted()),
                         (tm, dv), (tile.m_block * cfg.num_consumers + wg, 0))

    # MMA partitions: accumulators in registers, the smem operands as descriptors built once per tile
    thr_mma_qk = tiled_mma_qk.get_slice(ctidx)
    thr_mma_pv = tiled_mma_pv.get_slice(ctidx)
    qk = wgmma_desc.QKOperands(sQ_wg, smem.sK, cfg.dtype, cfg.head_dim, tn)
    sP_wg = smem.sP[None, None, wg] if const_expr(cfg.p_smem) else None        # (64, tn) or None
    pv = wgmma_desc.PVOperands(smem.sV, cfg.dtype, dv, tn, sP=sP_wg)
    p_store = None
    if const_expr(cfg.p_smem):
        copy_P = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cfg.dtype, num_bits_per_copy=32), tiled_mma_qk)
        thr_copy_P = copy_P.get_slice(ctidx)
        p_store = PStore(copy_P, thr_copy_P, thr_copy_P.partition_D(sP_wg))
    acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((tm, dv)), Float32)
    acc_O.fill(0.0)
    acc_O_rc = acc_rowcol(acc_O)
    # (row, col) of each S element inside the (tm, tn) tile: this thread's, and thread 0's (the mask)
    tScS_rc = acc_rowcol(thr_mma_qk.partition_C(cute.make_identity_tensor((tm, tn))))
    tScS0_rc = acc_rowcol(tiled_mma_qk.get_slice(0).partition_C(cute.make_identity_tensor((tm, tn))))
    num_rows = cute.size(tScS_rc, mode=[0])  # 2 rows per thread
    row_max = cute.make_rmem_tensor((num_rows,), Float32)
    row_max_new = cute.make_rmem_tensor((num_rows,), Float32)
    row_sum = cute.make_rmem_tensor((num_rows,), Float32)
    row_limit = cute.make_rmem_tensor((num_rows,), Float32)
    row_bias = cute.make_rmem_tensor((num_rows,), Float32)
    row_max.fill(-Float32.inf)
    row_sum.fill(0.0)
    row_limit.fill(-Float32.inf)
    row_bias.fill(0.0)
    rescale_margin = Float32(cfg.policy.rescale_threshold) / softmax_scale_log2

    q_state = pipeline.PipelineState(1, Int32(0), Int32(0), q_phase)
    smem.pipe_Q.consumer_wait(q_state)

    tOrP = cute.make_rmem_tensor(thr_mma_pv.partition_shape_A((tm, tn)), cfg.dtype)
    row_scale = cute.make_rmem_tensor((num_rows,), Float32)
    query_len = cfg.query_len(tile)  # = seqlen_q, or its tokens when GQA heads are packed as rows
    n_masked = num_masked_blocks(tile.m_block, query_len, tile.seqlen_k, n_block_max, tile_m=cfg.query_tile_m,
                                 tile_n=tn, window=cfg.window)  # walked first (i < n_masked)
    n_blocks = n_block_max
    if const_expr(n_block_min is not None):
        n_blocks = n_block_max - n_block_min
        n_masked = cutlass.min(n_masked, n_blocks)
    # a left window: the last n_left blocks walked cross some row's left edge (mask them too)
    n_left = num_left_masked_blocks(tile.m_block, query_len, tile.seqlen_k, n_block_min, n_blocks,
                                    tile_m=cfg.query_tile_m, tile_n=tn, window=cfg.window)
    rows = RowState(row_max, row_max_new, row_sum, row_scale, row_limit, row_bias)
    ctx = ScoreContext(row0, query_len, tile.seqlen_k, softmax_scale_log2, args.score_scale, rescale_margin,
                       tScS_rc, tScS0_rc)
    ops = TileOperands(qk, pv, thr_mma_qk, acc_O, tOrP, p_store)
    if n_blocks > 0:
        walk_key_blocks(cfg, wg, ctidx, kv_base, n_block_max, n_blocks, n_masked, n_left, rows, ctx, ops, smem,
                        turns, q_state, args.gmem_copy_O)

    if const_expr(cfg.persistent):
        pipe_Q = smem.pipe_Q  # a local: CuTe-DSL would carry `smem` through the `if` that calls it
        if n_blocks == 0:
            pipe_Q.consumer_release(q_state)

    sink_log2 = None
    if const_expr(args.mSink is not None):
        sink_log2 = args.mSink[tile.head] * LOG2_E
    out = epilogue.OutputTiles(args.mLSE, gO, sO_wg, tiled_mma_pv, args.gmem_copy_O, mSplit)
    epilogue.finish_tile(cfg, wg, ctidx, tile, row0, acc_O, acc_O_rc, rows, ctx, out, chunk, sink_log2)
    trace.cta_stamp("end")


@cute.jit
def walk_key_blocks(cfg, wg: Int32, ctidx: Int32, kv_base: Int32, n_block_max: Int32, n_blocks: Int32,
                    n_masked: Int32, n_left, rows: RowState, ctx: ScoreContext, ops: TileOperands,
                    smem: SmemBuffers, turns: Turns, q_state: pipeline.PipelineState, gmem_copy_O: cute.TiledCopy):
    """The tile's key blocks n_block_max - 1 down to n_block_max - n_blocks: the first alone, the
    masked ones, the hot loop, (left window) the last n_left blocks masked again, then the last P V."""
    # 1. prologue: S_0 alone (O is still 0: nothing to rescale)
    st0 = kv_state(kv_base, cfg.num_stages, producer=False)
    wait_kv(cfg, smem.pipe_K, st0)
    # a key split's chunk may end inside the left window: its first block is masked on both sides
    side0 = BOTH if cfg.key_split else cfg.mask.right_blocks_side()
    hidden = hidden_half(cfg, side0, n_block_max - 1, ctx)
    if const_expr(hidden is None):
        first_block(cfg, wg, ctidx, st0, n_block_max, side0, None, rows, ctx, ops, smem, turns, gmem_copy_O)
    else:
        if hidden.hidden:
            first_block(cfg, wg, ctidx, st0, n_block_max, side0, 1 - hidden.half, rows, ctx, ops, smem, turns,
                        gmem_copy_O)
        else:
            first_block(cfg, wg, ctidx, st0, n_block_max, side0, None, rows, ctx, ops, smem, turns, gmem_copy_O)

    # 2. steady state: masked blocks first, then the hot loop; the ring slot is carried. Blocks masked
    # on the right test the right edge (and the left one where the window is narrow); the left-masked
    # blocks at the end the left edge alone (components.mask)
    st_prev = st0
    right_side = cfg.mask.right_blocks_side()
    for i in cutlass.range(1, n_masked, unroll=1):
        st = next_kv_state(st_prev)
        overlapped_step(cfg, st, st_prev, n_block_max - 1 - i, right_side, rows, ctx, ops, smem, turns)
        st_prev = st
    hot_end = n_blocks
    if const_expr(cfg.window.left is not None):
        hot_end = hot_loop_end(n_blocks, n_masked, n_left)
    for i in cutlass.range(cutlass.max(n_masked, 1), hot_end, unroll=1):
        st = next_kv_state(st_prev)
        overlapped_step(cfg, st, st_prev, n_block_max - 1 - i, None, rows, ctx, ops, smem, turns)
        st_prev = st
    if const_expr(cfg.window.left is not None):
        for i in cutlass.range(hot_end, n_blocks, unroll=1):
            st = next_kv_state(st_prev)
            overlapped_step(cfg, st, st_prev, n_block_max - 1 - i, LEFT, rows, ctx, ops, smem, turns)
            st_prev = st

    if const_expr(cfg.persistent):
        smem.pipe_Q.consumer_release(q_state)  # every S of the tile has landed: the next Q may load
    # 3. drain: the last P V
    st_last = st_prev
    wait_kv(cfg, smem.pipe_V, st_last)
    # (left window) the last block walked, masked on the left, may hide its first half from these rows
    hidden = hidden_half(cfg, LEFT, n_block_max - n_blocks, ctx)
    barriers.take_turn(turns.mine, cfg.num_consumers)
    gemm_PV(ops, st_last.index, hidden)
    barriers.hand_turn(turns.successor, cfg.num_consumers)
    warpgroup.wait_group(0)
    smem.pipe_V.consumer_release(st_last)


class HiddenHalf(NamedTuple):
    """Which half of a masked key block no row of the warpgroup sees: `hidden` (a run-time Boolean)
    tells whether `half` (0: the first tile_n / 2 keys, 1: the second) is hidden; S and P V then
    compute the other half alone (gemm_S, gemm_PV)."""

    hidden: Any
    half: int


@cute.jit
def hidden_half(cfg, side, n_block: Int32, ctx: ScoreContext):
    """The HiddenHalf of block n_block under a mask testing `side` (a right side: the second half,
    past the last row's right edge or the sequence's end; LEFT: the first, before the first row's
    left edge), or None where the kernel cannot split its blocks or the block is not masked."""
    if const_expr(side is None or not cfg.half_blocks or (side == LEFT and cfg.window.left is None)):
        return None
    if const_expr(side == LEFT):
        return HiddenHalf(cfg.mask.left_half_hidden(ctx.row0, n_block, ctx.seqlen_q, ctx.seqlen_k), 0)
    return HiddenHalf(cfg.mask.right_half_hidden(ctx.row0 + cfg.wg_m - 1, n_block, ctx.seqlen_q, ctx.seqlen_k), 1)


@cute.jit
def gemm_S(ops: TileOperands, acc_S: cute.Tensor, stage: Int32, half: cutlass.Constexpr):
    """S = Q K_stage^T issued: whole (half None), or only keys of `half` (0 / 1), the other half's
    scores -inf (the mask would set them too; this leaves no value undefined)."""
    if const_expr(half is None):
        ops.qk.gemm(acc_S, stage)
    else:
        n_half = cute.size(acc_S) // 2
        for i in cutlass.range_constexpr(n_half):
            acc_S[(1 - half) * n_half + i] = -Float32.inf
        ops.qk.gemm(acc_S, stage, half=half)


@cute.jit
def gemm_PV(ops: TileOperands, stage: Int32, hidden):
    """O += P V_stage issued: whole, or (hidden: a HiddenHalf whose half is hidden, so P is 0 there)
    over the other half's keys alone."""
    if const_expr(hidden is None):
        ops.pv.gemm(ops.acc_O, ops.tOrP, stage)
    else:
        if hidden.hidden:
            ops.pv.gemm(ops.acc_O, ops.tOrP, stage, half=1 - hidden.half)
        else:
            ops.pv.gemm(ops.acc_O, ops.tOrP, stage)


@cute.jit
def first_block(cfg, wg: Int32, ctidx: Int32, st0: pipeline.PipelineState, n_block_max: Int32,
                side: cutlass.Constexpr, s_half: cutlass.Constexpr, rows: RowState, ctx: ScoreContext,
                ops: TileOperands, smem: SmemBuffers, turns: Turns, gmem_copy_O: cute.TiledCopy):
    """The first key block walked (n_block_max - 1, ring slot st0, K waited for): S alone (O is
    still 0: nothing to rescale), masked on `side`; s_half: gemm_S's half, None whole."""
    tm, tn, nc = cfg.wg_m, cfg.tile_n, cfg.num_consumers
    acc_S0 = cute.make_rmem_tensor(ops.thr_mma_qk.partition_shape_C((tm, tn)), Float32)
    barriers.take_turn(turns.mine, cfg.num_consumers)
    gemm_S(ops, acc_S0, st0.index, s_half)
    barriers.hand_turn(turns.successor, cfg.num_consumers)
    pipe_V = smem.pipe_V  # a local: CuTe-DSL would carry `smem` through the `if` that calls it
    if const_expr(cfg.varlen or cfg.key_split):
        # V rows past the sequence (or key chunk) belong to the next one, or are unused cache slots
        # that may hold NaN; P is 0 there but 0 * NaN is not. Only the first block walked (the last
        # one) can be partial: every consumer zeroes its whole tail itself (so what it reads is its
        # own zeros; the others only write the same zeros), then makes the writes visible to wgmma.
        if n_block_max * tn > ctx.seqlen_k:
            pipe_V.consumer_wait(st0)
            zero_rows(cfg, smem.sV[None, None, st0.index], ctx.seqlen_k - (n_block_max - 1) * tn, ctidx,
                      gmem_copy_O)
            cute.arch.fence_view_async_shared()
            barriers.sync_own(wg, nc)
    warpgroup.wait_group(0)
    smem.pipe_K.consumer_release(st0)
    online_softmax(acc_S0, n_block_max - 1, side, rows, ctx, cfg.mask, cfg.policy, cfg.score_mod)
    publish_P(cfg, turns, acc_S0, ops)


@cute.jit
def overlapped_step(cfg, st: pipeline.PipelineState, st_prev: pipeline.PipelineState, n_block: Int32,
                    side: cutlass.Constexpr, rows: RowState, ctx: ScoreContext, ops: TileOperands,
                    smem: SmemBuffers, turns: Turns):
    """The i-th key block walked (block n_block, ring slot st; st_prev the (i-1)-th's): one turn
    issues S_i and O += P_{i-1} V_{i-1}. side: the mask's edges (components.mask), None unmasked.
    A masked block whose half no row of the warpgroup sees runs a copy of the step that computes
    S over the other half: one code path per accumulator shape (a branch around the wgmmas alone,
    merging two register sets, made ptxas serialize them)."""
    trace.stamp(n_block, "top")
    wait_kv(cfg, smem.pipe_K, st)
    hidden = hidden_half(cfg, side, n_block, ctx)
    if const_expr(hidden is None):
        step_body(cfg, st, st_prev, n_block, side, None, rows, ctx, ops, smem, turns)
    else:
        if hidden.hidden:
            step_body(cfg, st, st_prev, n_block, side, 1 - hidden.half, rows, ctx, ops, smem, turns)
        else:
            step_body(cfg, st, st_prev, n_block, side, None, rows, ctx, ops, smem, turns)


@cute.jit
def step_body(cfg, st: pipeline.PipelineState, st_prev: pipeline.PipelineState, n_block: Int32,
              side: cutlass.Constexpr, s_half: cutlass.Constexpr, rows: RowState, ctx: ScoreContext,
              ops: TileOperands, smem: SmemBuffers, turns: Turns):
    """overlapped_step once K_i has landed; s_half: gemm_S's half, None whole."""
    tm, tn = cfg.wg_m, cfg.tile_n
    acc_S = cute.make_rmem_tensor(ops.thr_mma_qk.partition_shape_C((tm, tn)), Float32)
    barriers.take_turn(turns.mine, cfg.num_consumers)
    trace.stamp(n_block, "turn")
    gemm_S(ops, acc_S, st.index, s_half)
    wait_kv(cfg, smem.pipe_V, st_prev)  # only now, with S_i issued: the wait no longer delays it
    ops.pv.gemm(ops.acc_O, ops.tOrP, st_prev.index)
    barriers.hand_turn(turns.successor, cfg.num_consumers)
    trace.stamp(n_block, "issued")
    warpgroup.wait_group(1)  # S_i has landed (P_{i-1} V_{i-1} may still run)
    trace.stamp(n_block, "s_landed")
    smem.pipe_K.consumer_release(st)
    rescale_O = online_softmax(acc_S, n_block, side, rows, ctx, cfg.mask, cfg.policy, cfg.score_mod)
    trace.stamp(n_block, "softmax")
    warpgroup.wait_group(0)  # P_{i-1} V_{i-1} landed: O and tOrP are ours again
    trace.stamp(n_block, "pv_landed")
    smem.pipe_V.consumer_release(st_prev)
    publish_P(cfg, turns, acc_S, ops)
    if rescale_O:
        scale_O_rows(ops.acc_O, rows.row_scale)
    trace.stamp(n_block, "end")


@cute.jit
def publish_P(cfg, turns: Turns, acc_S: cute.Tensor, ops: TileOperands):
    """P (in place of S after the softmax) packed to the input dtype as P V's A operand: in registers,
    or (kernel.p_smem) stored on to the warpgroup's P slab and made visible to its wgmma -- the async
    proxy fence, then its 128 threads' barrier, since the wgmma reads every thread's stores. The slab
    is free: the caller has waited for the previous P V."""
    store_P(acc_S, ops.tOrP, cfg.bf16)
    if const_expr(cfg.p_smem):
        rP = cute.make_tensor(ops.tOrP.iterator, cute.make_layout(acc_S.shape))  # the accumulator's order
        cute.copy(ops.p_store.copy, ops.p_store.thr.retile(rP), ops.p_store.dst)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=turns.own, number_of_threads=barriers.WARPGROUP_THREADS)


@cute.jit
def wait_kv(cfg, pipe, st: pipeline.PipelineState):
    """Wait for a K or V ring slot. A gathered paged build's slot was written by cp.async (the generic
    proxy) and wgmma reads it through the async proxy: a proxy fence after the wait orders the two."""
    pipe.consumer_wait(st)
    if const_expr(cfg.gather):
        cute.arch.fence_view_async_shared()


def row_copy(dtype, cols: int, bits: int = 128) -> cute.TiledCopy:
    """128 threads, `bits` each (16 bytes: O's stores), a row of the swizzle atom per group of threads."""
    elems = bits // dtype.width
    atom_cols = 64 if cols % 64 == 0 else (32 if cols % 32 == 0 else 16)
    threads_per_row = atom_cols // elems
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=bits)
    thr = cute.make_ordered_layout((128 // threads_per_row, threads_per_row), order=(1, 0))  # one warpgroup
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))


def zero_copy_V(cfg, copy_16B: cute.TiledCopy) -> cute.TiledCopy:
    """The tiled copy that zeroes a V stage's tail rows: O's 16-byte one where its pass of rows (16 or 32)
    divides tile_n; else (144 keys at dv = 96: 32-row passes) 8-byte stores, 16 rows a pass."""
    if cfg.tile_n % cute.size(copy_16B.tiler_mn[0]) == 0:
        return copy_16B
    return row_copy(cfg.dtype, cfg.head_dim_v, bits=64)


@cute.jit
def zero_rows(cfg, sV_stage: cute.Tensor, first_row: Int32, ctidx: Int32, copy_16B: cute.TiledCopy):
    """sV_stage[first_row:, :] = 0 with the epilogue's 128-thread, 16-byte tiled copy, or an 8-byte one
    where its passes do not tile tile_n (zero_copy_V): a zero fragment, row-predicated."""
    copy = zero_copy_V(cfg, copy_16B)
    thr = copy.get_slice(ctidx)
    tZsV = thr.partition_D(sV_stage)
    tZcV = thr.partition_D(cute.make_identity_tensor((cfg.tile_n, cfg.head_dim_v)))
    tZrZ = cute.make_rmem_tensor_like(tZsV, cfg.dtype)
    tZrZ.fill(0.0)
    for m in cutlass.range_constexpr(cute.size(tZsV.shape[1])):
        if tZcV[0, m, 0][0] >= first_row:
            cute.copy(copy, tZrZ[None, m, None], tZsV[None, m, None])
