"""The production Hopper (sm_90) forward kernel: the object that owns the configuration, traces
the launch and lays out the CTA. The work itself is in named components:

  producer warp ........ producer.produce (TMA loads of Q and the K/V ring)
  consumer warpgroups .. mainloop.consume (S, softmax, P V per key block) -> epilogue.finish_tile
  softmax .............. softmax.online_softmax + stage3_fwd_kernel.softmax_policy
  mask ................. components.mask.AttentionMask
  sequences / tiles .... components.work_tile (AttentionTile, SequenceInfo, locate_tile)
  key-block range ...... components.block_range
  tile scheduling ...... components.tile_walk (persistent walk) + tile_scheduler orders
  named barriers ....... barriers

A CTA is one producer warpgroup (one warp issues every TMA load; a paged build whose pages TMA
cannot read has tile_n / 32 warps gather K / V, hopper/gather.py) and tile_m / 64 consumer
warpgroups of 64 query rows that take turns on the tensor cores. setmaxnreg moves registers from
the producer to the consumers inside the CTA's pool: 128 * (p + nc * c) = 65536, (24, 240) with
two consumers ((40, 232) in a gathered build), (32, 160) with three.

Persistent CTAs (`tile_scheduler.PersistentScheduler`, the default for dense calls at head dims
<= 128 but the 192-row d = 96 tile, see `scheduling.default_persistent`): one CTA per SM walks the
tiles (components.tile_walk),
so the per-CTA fixed cost -- launch, barrier set-up, the first Q and K loads, the O store, about
2-3 key-block steps of a tile -- is paid once per SM. The producer carries the K/V ring position
(`kv_base`) and Q's phase across tiles; consumers release Q after their last S, and O gets its own
buffer (or, `o_direct`, goes from registers to global memory). Causal calls take the next tile
from an atomic counter (dynamic): the producer publishes each tile id in shared memory before
arming that tile's Q barrier, and the consumers read it once Q has landed. Bitwise the results of
one CTA per tile on the same key tiles (a persistent 192-row d = 96 CTA walks 128 keys, not 144).
measured: docs/measurements.md
"""

from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory.smem import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from stage3_fwd_kernel import trace
from stage3_fwd_kernel.components.block_range import blocks_walked, first_key_block, num_key_blocks
from stage3_fwd_kernel.components.key_split import KeySplit, chunk_blocks, rows_by_token
from stage3_fwd_kernel.components.mask import AttentionMask
from stage3_fwd_kernel.components.paged_kv import box_rows, check_page_size, gathered
from stage3_fwd_kernel.components.score_mod import Softcap
from stage3_fwd_kernel.components.window import NO_WINDOW, Window
from stage3_fwd_kernel.components.tile_walk import TileSpace, TileWalk
from stage3_fwd_kernel.components.work_tile import SequenceInfo, empty_tile, locate_tile
from stage3_fwd_kernel.hopper import barriers
from stage3_fwd_kernel.hopper.gather import gather_unroll
from stage3_fwd_kernel.hopper.config import (
    DEFAULT_POLICY, MAX_HEAD_DIM_192, Q_SHIFT_TILE_MS, TILE_MS, check_persistent_smem, default_num_stages,
    default_tile_n, half_blocks, o_fits_beside_q, p_through_smem, plain_scores)
from stage3_fwd_kernel.hopper.mainloop import ConsumerArgs, consume, row_copy
from stage3_fwd_kernel.hopper.producer import SmemBuffers, TmaLoads, produce
from stage3_fwd_kernel.hopper.split_tail import SPLIT_TAIL_UNSUPPORTED, split_tail_supported
from stage3_fwd_kernel.host_io import assume_strides_16B, top_padding
from stage3_fwd_kernel.softmax_policy import SoftmaxPolicy
from stage3_fwd_kernel.tile_scheduler import StaticTileScheduler


class FlashAttentionForwardSm90:
    """Producer warp + tile_m / 64 consumer warpgroups (tile_m = 128 or 192), ping-pong on the
    tensor cores, TMA K/V ring, FA4's softmax, varlen, persistent CTAs and the split tail."""

    def __init__(self, dtype, head_dim: int, head_dim_v: int, causal: bool, *,
                 policy: SoftmaxPolicy = DEFAULT_POLICY, tile_m: int = 128, tile_n: int | None = None,
                 num_stages: int | None = None, scheduler=StaticTileScheduler, split_tail: bool = False,
                 window: Window = NO_WINDOW, softcap: float = 0.0, page_size: int | None = None,
                 key_split: bool = False, rows_per_query: int = 1):
        if head_dim % 16 or head_dim_v % 16 or not (16 <= head_dim <= 256 and 16 <= head_dim_v <= 256):
            raise ValueError(f"head_dim: expected multiples of 16 in [16, 256], got ({head_dim}, {head_dim_v})")
        if not isinstance(policy, SoftmaxPolicy):
            raise TypeError(f"policy: expected a SoftmaxPolicy, got {type(policy).__name__}")
        policy.check_dtype(dtype)
        self.persistent = bool(getattr(scheduler, "persistent", False))
        self.dynamic = self.persistent and bool(getattr(scheduler, "dynamic", False))
        if self.persistent and not callable(getattr(scheduler, "tile_at", None)):
            raise TypeError("scheduler: a persistent scheduler needs tile_at(linear, M, H, B)")
        if tile_m not in TILE_MS:
            raise ValueError(f"tile_m: expected one of {TILE_MS} (64 query rows per consumer warpgroup), got {tile_m}")
        if tile_m == 192 and max(head_dim, head_dim_v) > MAX_HEAD_DIM_192:
            # S + O registers per thread no longer fit 160 (config.p_through_smem): ptxas spills
            raise ValueError(f"tile_m: 192 needs head dims <= {MAX_HEAD_DIM_192} (160 registers per consumer "
                             f"thread), got ({head_dim}, {head_dim_v})")
        if split_tail and not split_tail_supported(scheduler, causal or window.limited):
            raise ValueError(SPLIT_TAIL_UNSUPPORTED)
        if rows_per_query != 1 and not (key_split and isinstance(rows_per_query, int) and rows_per_query > 1
                                        and tile_m % rows_per_query == 0):
            raise ValueError(f"rows_per_query: GQA heads packed as rows need a key split build and a divisor of "
                             f"tile_m ({tile_m}) above 1, got {rows_per_query!r}")
        if key_split and self.persistent:
            raise ValueError("scheduler: a key split runs one CTA per tile (components.key_split), not persistent CTAs")
        self.policy = policy
        self.dtype = dtype
        self.bf16 = dtype == cutlass.BFloat16
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.tile_m = tile_m
        # the 144-key d = 96 tile takes a causal mask in the grid's order (an LPT order's build spills in its loop)
        plain = plain_scores(causal and scheduler is not StaticTileScheduler, window, softcap)
        self.tile_n = tile_n or default_tile_n(head_dim, head_dim_v, tile_m, plain=plain, persistent=self.persistent,
                                               cache=page_size is not None or key_split)
        # P V's A operand: registers, or (192 rows above d = 64) P stored to shared memory (config.p_through_smem)
        self.p_smem = p_through_smem(tile_m, head_dim, head_dim_v)
        # a paged K/V cache (components.paged_kv): K/V loads go through the page table
        self.page_size = None if page_size is None else check_page_size(page_size, self.tile_n)
        self.blocks_per_page = 1 if page_size is None else max(1, page_size // self.tile_n)
        self.box_rows = box_rows(page_size, self.tile_n)          # rows of one K / V TMA box
        self.boxes_per_block = self.tile_n // self.box_rows       # > 1: pages smaller than a key block
        self.gather = gathered(page_size, self.tile_n)            # pages TMA cannot read: hopper/gather.py
        self.producer_warps = self.tile_n // 32 if self.gather else 1  # the gather's warps walk the same tiles
        if self.gather and self.dynamic:
            raise ValueError(f"scheduler: page_size {page_size} is read by the producer warps' gather, whose "
                             f"warps walk the tiles in step; a dynamic (atomic counter) scheduler cannot serve it")
        if self.gather and self.tile_n not in (64, 128):
            raise ValueError(f"tile_n: the gather gives each of the producer warpgroup's 4 warps 32 key rows, so "
                             f"page_size {page_size} needs tile_n 64 or 128, got {self.tile_n}")
        # the keys a row sees (components.window): causal is a right edge at 0
        self.window = Window(window.left, 0 if causal else window.right)
        # rows_per_query > 1: row t g + j is query token t (packed GQA heads); the mask and the key-block
        # range count tokens (query_tile_m tokens a tile), the stores rows
        self.rows_per_query = rows_per_query
        self.query_tile_m = tile_m // rows_per_query
        self.mask = AttentionMask(self.window, self.tile_n, rows_per_query, tile_m=self.query_tile_m)
        self.half_blocks = half_blocks(tile_m, self.tile_n, self.window)  # mainloop: "Half blocks"
        self.score_mod = Softcap(softcap)
        # a persistent CTA stages O apart from Q (the next tile's Q loads during the epilogue); where
        # Q + O + two K/V stages do not fit (head dims > 128) it stores O straight from registers
        self.o_direct = self.persistent and not o_fits_beside_q(head_dim, head_dim_v, self.tile_n, tile_m,
                                                                self.p_smem)
        self.num_stages = num_stages or default_num_stages(head_dim, head_dim_v, self.tile_n, tile_m,
                                                           separate_o=self.persistent and not self.o_direct,
                                                           p_smem=self.p_smem)
        self.split_tail = bool(split_tail)
        self.key_split = bool(key_split)  # batch indexes (sequence, key chunk): components.key_split
        self.scheduler = scheduler
        self.num_consumers = tile_m // 64          # consumer warpgroups, one wgmma M = 64 row block each
        self.wg_m = tile_m // self.num_consumers   # 64 query rows per consumer
        self.num_threads = 128 * (1 + self.num_consumers)
        self.regs_producer, self.regs_consumer = {1: (24, 240), 2: (24, 240), 3: (32, 160)}[self.num_consumers]
        if self.gather and self.num_consumers < 3:
            # the gather's copy loops unroll 8 rows in 40 registers (24 spilled past 4)
            self.regs_producer, self.regs_consumer = 40, 232
        self.gather_unroll = gather_unroll(self.regs_producer)
        if self.persistent:
            check_persistent_smem(head_dim, head_dim_v, self.tile_n, tile_m, self.num_stages, self.o_direct,
                                  self.p_smem)
        self.smem_bytes = None

    # -------------------------------------------------------------- configuration queries
    def q_shift_for(self, varlen: bool) -> bool:
        """Whether a call counts its Q tiles from the sequence's end (components.work_tile): causal,
        dense (a varlen sequence's padding rows would be the previous sequence's; a key split locates
        its rows itself), 192-row tiles."""
        return self.causal and not varlen and not self.key_split and self.tile_m in Q_SHIFT_TILE_MS

    def top_padding(self, seqlen_q):
        """q_shift: rows before query 0 that make the Q tiles end with the sequence (< tile_m)."""
        return top_padding(seqlen_q, self.tile_m)

    def rows_shifted(self) -> bool:
        """Whether tiles address rows from a per-sequence offset (varlen, q_shift)."""
        return self.varlen or self.q_shift

    def num_key_blocks(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """seqlen_q in query tokens (`query_len`)."""
        return num_key_blocks(m_block, seqlen_q, seqlen_k, tile_m=self.query_tile_m, tile_n=self.tile_n,
                              window=self.window)

    def query_len(self, tile):
        """The tile's sequence in query tokens (its rows over rows_per_query)."""
        return tile.seqlen_q if const_expr(self.rows_per_query == 1) else tile.seqlen_q // self.rows_per_query

    def key_range(self, tile):
        """(n_block_min, n_block_max) a tile walks; n_block_min is None (block 0) without a left window."""
        n_block_max = self.num_key_blocks(tile.m_block, self.query_len(tile), tile.seqlen_k)
        if const_expr(self.key_split):  # seqlen_k runs to the sequence's end; the chunk ends first
            n_block_max = cutlass.min(n_block_max, chunk_blocks(self.split, self.tile_n))
        n_block_min = first_key_block(tile.m_block, self.query_len(tile), tile.seqlen_k, n_block_max,
                                      tile_m=self.query_tile_m, tile_n=self.tile_n, window=self.window)
        return n_block_min, n_block_max

    def locate(self, m_block, head, batch, seq: SequenceInfo):
        return locate_tile(seq, m_block, head, batch, self.tile_m if self.q_shift else None)

    def tile_live(self, tile):
        """Whether a tile starts before its sequence's end (varlen tiles past it are skipped)."""
        return tile.m_block * self.tile_m < tile.seqlen_q

    # -------------------------------------------------------------- host side (traced once)
    def _tiled_mma_qk(self) -> cute.TiledMma:
        """S (64 x tn) = Q (64 x d) . K (tn x d)^T: one wgmma atom, A and B K-major from smem."""
        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (self.wg_m, self.tile_n))

    def _tiled_mma_pv(self) -> cute.TiledMma:
        """O (64 x dv) = P (64 x tn) . V: A = P from registers, B = V^T (dv x tn) MN-major."""
        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, (1, 1, 1), (self.wg_m, self.head_dim_v),
            a_source=warpgroup.OperandSource.RMEM)

    def _smem_layout(self, rows: int, cols: int, stages: int | None = None):
        """Row-major (contiguous along `cols`) tile with the widest swizzle wgmma accepts,
        optionally with a trailing stage mode."""
        atom_kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, cols)
        atom = warpgroup.make_smem_layout_atom(atom_kind, self.dtype)
        if stages is None:
            return cute.tile_to_shape(atom, (rows, cols), (0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))

    def _box_layout(self, ring_layout, rows: int, cols: int):
        """The shared-memory layout one TMA box fills: a ring slot's (tile_n, cols) tile, or its
        first `rows` rows (the box's row stride stays the slot's, so box j lands at row j * rows)."""
        slot = cute.slice_(ring_layout, (None, None, 0))
        if rows == self.tile_n:
            return slot
        return cute.composition(slot, cute.make_layout((rows, cols), stride=(1, self.tile_n)))

    def _check_call(self, mQ, mK, mV, mO, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mBatchMap, mTileCounter, mSplit,
                    mPageTable):
        if (mPageTable is not None) != (self.page_size is not None):
            raise ValueError("page_table: pass one exactly when the kernel is built with a page_size")
        if mPageTable is not None and mSeqUsedK is None:
            raise ValueError("page_table: needs seqused_k (the keys each sequence uses)")
        if (mSplit is not None) != self.split_tail:
            raise ValueError("split workspace: pass one exactly when the kernel is built with split_tail")
        if (mTileCounter is not None) != self.dynamic:
            raise ValueError("tile_counter: pass one exactly when the scheduler is dynamic")
        if not (mQ.element_type == mK.element_type == mV.element_type == mO.element_type == self.dtype):
            raise TypeError("q, k, v, out must share the kernel's dtype")
        if self.key_split:
            if mCuSeqlensQ is not None:
                raise ValueError("key_split: a dense call (no cu_seqlens_q); seqused_k gives the keys of each sequence")
            if mPageTable is not None and (mBatchMap is not None or mCuSeqlensK is not None):
                raise ValueError("batch_map / cu_seqlens_k: a key split reads them as each sequence's row and first "
                                 "key of a dense cache; a paged cache's rows are its page table's")
        elif (mCuSeqlensQ is None) != (mCuSeqlensK is None):
            raise ValueError("cu_seqlens_q and cu_seqlens_k: pass both or neither")
        elif mPageTable is not None and mCuSeqlensK is None:
            raise ValueError("page_table: needs cu_seqlens_k (each sequence's first logical key)")
        elif mSeqUsedK is not None and mCuSeqlensK is None:
            raise ValueError("seqused_k: needs cu_seqlens_k")

    def _shared_storage(self, sQ_layout, sK_layout, sV_layout, sO_layout, sP_layout):
        """The CTA's shared memory: barriers, the dynamic scheduler's tile ids, Q, the K/V ring, O, and
        (p_smem) P."""
        stages = self.num_stages

        @cute.struct
        class SharedStorage:
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2]               # full + empty, 1 stage
            mbar_K: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_V: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            tile_ids: cute.struct.MemRange[Int32, 2]  # dynamic: the tile of each Q phase, from the producer
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[
                self.dtype, 0 if self.o_in_q or self.o_direct else cute.cosize(sO_layout)], 1024]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout) if self.p_smem else 0], 1024]

        return SharedStorage

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale_log2: Float32, softmax_scale: Float32,
                 mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
                 mSeqUsedK: Optional[cute.Tensor], mBatchMap: Optional[cute.Tensor],
                 mTileCounter: Optional[cute.Tensor], max_seqlen_q: Int32, max_ctas: Int32,
                 mSplit: Optional[cute.Tensor], split_chunks: Int32, mSink: Optional[cute.Tensor],
                 mPageTable: Optional[cute.Tensor], num_splits: Int32, chunk_keys: Int32, range_keys: Int32,
                 stream):
        # dense:  mQ (B, Sq, Hq, d), mK (B, Sk, Hkv, d), mV (B, Sk, Hkv, dv), mO (B, Sq, Hq, dv),
        #         mLSE (B, Hq, Sq); the four optional tensors are None.
        # varlen: the same tensors with B = 1 and S = total tokens (packed), mLSE (1, Hq, total_q);
        #         mCuSeqlensQ / mCuSeqlensK (batch + 1,), mSeqUsedK / mBatchMap (batch,) or None.
        # max_ctas: a persistent grid's width (the device's SMs); unused by one-tile-per-CTA grids.
        # mTileCounter: int32 (1,), zeroed, for a dynamic persistent scheduler; None otherwise.
        # mSplit: the split tail's workspace, fp32 (R * split_chunks, tile_m, dv + 1); None otherwise.
        # mSink: fp32 (Hq,) learnable sink logits, or None. softmax_scale: with softcap, the tanh's
        # input scale (components.score_mod.Softcap.kernel_scales); otherwise unused.
        # mPageTable: int32 (batch, pages) with a page_size build (components.paged_kv); mK / mV are then
        # the flat cache (1, num_pages * page_size, Hkv, d) and cu_seqlens_k the logical first keys.
        # key_split build (components.key_split): mQ (B, R, Hq, d), mK / mV (B, S, Hkv, *) or the flat
        # paged cache, mO (B * num_splits, R, Hq, dv) and mLSE (B * num_splits, Hq, R) the parts, mSeqUsedK
        # (B,) or None; chunk_keys keys a chunk; range_keys the keys each sequence reads from its end
        # (key_split.RANGE_ALL: all); mBatchMap / mCuSeqlensK (B,) or None: each sequence's dense cache row
        # and first key. Other builds ignore num_splits, chunk_keys and range_keys.
        self._check_call(mQ, mK, mV, mO, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mBatchMap, mTileCounter, mSplit,
                         mPageTable)
        self.varlen = mCuSeqlensQ is not None
        self.q_shift = self.q_shift_for(self.varlen)
        tm, tn, d, dv, stages = self.wg_m, self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        nc = self.num_consumers
        mQ, mK = assume_strides_16B(mQ, d), assume_strides_16B(mK, d)
        mV, mO = assume_strides_16B(mV, dv), assume_strides_16B(mO, dv)
        if const_expr(self.rows_per_query > 1):
            mQ = rows_by_token(mQ, self.rows_per_query)   # no copy packs q (components.key_split)

        # Q and O: one 64-row slab per consumer warpgroup (a trailing mode of size nc)
        sQ_layout = self._smem_layout(tm, d, nc)
        sK_layout = self._smem_layout(tn, d, stages)
        sV_layout = self._smem_layout(tn, dv, stages)
        sO_layout = self._smem_layout(tm, dv, nc)
        sP_layout = self._smem_layout(tm, tn, nc)  # p_smem: each consumer's P, K-major (keys contiguous)
        tiled_mma_qk = self._tiled_mma_qk()
        tiled_mma_pv = self._tiled_mma_pv()

        # TMA: the tensor map sees (seqlen, head_dim, heads, batch) so that a (rows, head_dim) box
        # tiles the first two modes; head and batch are fixed per CTA by slicing the TMA tensor.
        def seq_dim_first(t):  # (B, S, H, D) -> (S, D, H, B), same memory
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mQ), cute.slice_(sQ_layout, (None, None, 0)), (tm, d))
        rows = self.box_rows  # a key tile, or one page when pages are smaller (components.paged_kv)
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mK), self._box_layout(sK_layout, rows, d), (rows, d))
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mV), self._box_layout(sV_layout, rows, dv), (rows, dv))
        # bytes each stage's "full" barrier waits for (the whole box, zero-filled rows included)
        self.tma_bytes_Q = cute.size_in_bytes(self.dtype, sQ_layout)  # all nc slabs, one barrier
        self.tma_bytes_K = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))
        self.tma_bytes_V = cute.size_in_bytes(self.dtype, cute.slice_(sV_layout, (None, None, 0)))

        # O is written once, after the last QK^T: one CTA per tile puts each consumer's O slab at the
        # start of its own Q slab (never over another consumer's slab, which may still be in use)
        self.o_in_q = not self.persistent and cute.cosize(cute.slice_(sO_layout, (None, None, 0))) <= cute.cosize(
            cute.slice_(sQ_layout, (None, None, 0)))
        self.shared_storage = self._shared_storage(sQ_layout, sK_layout, sV_layout, sO_layout, sP_layout)
        self.smem_bytes = self.shared_storage.size_in_bytes()

        # dense: max_seqlen_q = Sq; varlen: the longest sequence (CTAs past a shorter one exit)
        num_m_blocks = (max_seqlen_q + self.tile_m - 1) // self.tile_m
        batch = mO.shape[0]  # a key split launches B * num_splits virtual sequences
        if const_expr(self.varlen):
            batch = mCuSeqlensQ.shape[0] - 1
        if const_expr(self.persistent):
            grid = self.scheduler.grid_shape(num_m_blocks, mQ.shape[2], batch, cutlass.max(max_ctas, 1))
        else:
            grid = self.scheduler.grid_shape(num_m_blocks, mQ.shape[2], batch)
        self.kernel(tma_Q, tma_K, tma_V, mO, mLSE, softmax_scale_log2, softmax_scale,
                    cute.size(mQ, mode=[1]), mK.shape[1], mQ.shape[2] // mK.shape[2],
                    mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mBatchMap, mTileCounter,
                    tma_atom_Q, tma_atom_K, tma_atom_V,
                    tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, sO_layout, sP_layout,
                    row_copy(self.dtype, dv), num_m_blocks, mQ.shape[2], batch, mSplit, split_chunks, mSink, mPageTable,
                    *((mK, mV) if self.gather else (None, None)), num_splits, chunk_keys, range_keys,
                    # min_blocks_per_mp=1 caps registers at entry (65536/threads), which setmaxnreg needs
                    ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1,
                             use_pdl=self.key_split)

    # -------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_Q: cute.Tensor, tma_K: cute.Tensor, tma_V: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, softmax_scale_log2: Float32, softmax_scale: Float32,
               seqlen_q: Int32, seqlen_k: Int32, qhead_per_kvhead: Int32,
               mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
               mSeqUsedK: Optional[cute.Tensor], mBatchMap: Optional[cute.Tensor],
               mTileCounter: Optional[cute.Tensor],
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout,
               gmem_copy_O: cute.TiledCopy, num_m_blocks: Int32, num_heads: Int32, num_batch: Int32,
               mSplit: Optional[cute.Tensor], split_chunks: Int32, mSink: Optional[cute.Tensor],
               mPageTable: Optional[cute.Tensor], mK_flat: Optional[cute.Tensor], mV_flat: Optional[cute.Tensor],
               num_splits: Int32, chunk_keys: Int32, range_keys: Int32):
        if const_expr(self.key_split):
            # the merge kernel that follows is a programmatic dependent (split_combine.PartsCombine):
            # its CTAs may take the SMs this launch leaves free and wait there for it to finish
            cute.arch.griddepcontrol_launch_dependents()
            # and it is one itself: its CTAs may start while the kernel before it ends (a decode step's
            # previous merge), and wait here, before any global load or store, until that kernel is done
            cute.arch.griddepcontrol_wait()
        # no code unless trace.enable() turned tracing on; a key split stamps after its wait (a store
        # before it could race the kernel before, e.g. the trace buffer's zeroing)
        trace.cta_stamp("entry")
        # a paged cache's range starts on a key block (its pages are found block by block)
        # under a key split, batch_map holds each sequence's K / V cache row and cu_seqlens_k its first key
        # (cache_leftpad; components.key_split)
        split = KeySplit(num_splits, chunk_keys, self.page_size is not None, range_keys,
                         self.tile_n if const_expr(self.page_size is not None) else 1, mBatchMap, mCuSeqlensK) \
            if const_expr(self.key_split) else None
        self.split = split  # read by key_range (through self, like the walk below)
        seq = SequenceInfo(seqlen_q, seqlen_k, qhead_per_kvhead, mCuSeqlensQ,
                           None if const_expr(self.key_split) else mCuSeqlensK, mSeqUsedK,
                           None if const_expr(self.key_split) else mBatchMap, split)
        tma = TmaLoads(tma_Q, tma_K, tma_V, tma_atom_Q, tma_atom_K, tma_atom_V, mPageTable, mK_flat, mV_flat)
        args = ConsumerArgs(softmax_scale_log2, softmax_scale, mSink, mO, mLSE, tiled_mma_qk, tiled_mma_pv, sO_layout,
                            gmem_copy_O)
        layouts = (sQ_layout, sK_layout, sV_layout, sP_layout)
        if const_expr(self.persistent):
            # every CTA lives to the end: the tiles past a sequence's end are skipped inside the loop
            space = TileSpace(num_m_blocks, num_heads, num_batch, mTileCounter, mSplit, split_chunks)
            self.attend(None, seq, space, tma, args, layouts)
        else:
            work = self.scheduler.initial_work()
            tile = self.locate(work.m_block, work.head, work.batch, seq)
            # a CTA past the end of its (shorter than max_seqlen_q) sequence leaves before any barrier
            if self.tile_live(tile):
                self.attend(tile, seq, None, tma, args, layouts)

    def _pipelines(self, storage):
        """mbarrier pipelines: producer = 1 arrival (an elected lane of the producer warp, which also
        posts the expected byte count), consumers = the 4 * nc warps of all consumer warpgroups. A
        gathered paged build's K / V: 32 producer arrivals a gathering warp, one per lane when its
        cp.async copies land, and 128 * nc consumer arrivals."""
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumers * 4)

        def make(barriers_mem, stages, tx_count):
            return pipeline.PipelineTmaAsync.create(
                barrier_storage=barriers_mem.data_ptr(), num_stages=stages, producer_group=producer_group,
                consumer_group=consumer_group, tx_count=tx_count, defer_sync=True)

        def make_gathered(barriers_mem):
            # its consumer_release arrives from every consumer thread (the TMA pipeline's from one lane
            # a warp), so "empty" counts threads here
            return pipeline.PipelineCpAsync.create(
                barrier_storage=barriers_mem.data_ptr(), num_stages=self.num_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * self.producer_warps),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumers * 128),
                defer_sync=True)

        pipe_Q = make(storage.mbar_Q, 1, self.tma_bytes_Q)
        if self.gather:
            return pipe_Q, make_gathered(storage.mbar_K), make_gathered(storage.mbar_V)
        return (pipe_Q, make(storage.mbar_K, self.num_stages, self.tma_bytes_K),
                make(storage.mbar_V, self.num_stages, self.tma_bytes_V))

    def _walk(self, seq: SequenceInfo) -> TileWalk:
        return TileWalk(self.scheduler, dynamic=self.dynamic, split_tail=self.split_tail,
                        locate=lambda m_block, head, batch: self.locate(m_block, head, batch, seq),
                        key_range=self.key_range)

    @cute.jit
    def attend(self, tile, seq: SequenceInfo, space, tma: TmaLoads, args: ConsumerArgs, layouts):
        """The CTA: barriers and shared memory once, then the producer warp and the consumer
        warpgroups on one tile (`tile`), or -- persistent -- on every work item of `space`."""
        sQ_layout, sK_layout, sV_layout, sP_layout = layouts
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group_idx = cute.arch.make_warp_uniform(tidx // 128)

        if warp_idx == 0:  # fetch the tensor maps (they live in kernel params) into the TMA unit
            cpasync.prefetch_descriptor(tma.atom_Q)
            cpasync.prefetch_descriptor(tma.atom_K)
            cpasync.prefetch_descriptor(tma.atom_V)

        storage = SmemAllocator().allocate(self.shared_storage)
        pipe_Q, pipe_K, pipe_V = self._pipelines(storage)
        cute.arch.mbarrier_init_fence()  # make the barrier inits visible to the async proxy (TMA)
        cute.arch.sync_threads()         # ... and to every thread; the last CTA-wide barrier

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (64, d, nc)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (tn, d, stages)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (tn, dv, stages)
        sP = None
        if const_expr(self.p_smem):
            sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner)  # (64, tn, nc)
        smem = SmemBuffers(storage, sQ, sK, sV, pipe_Q, pipe_K, pipe_V, sP)
        tile_ids = storage.tile_ids.get_tensor(cute.make_layout(2))  # (2,) int32, by Q phase
        # the walk is reached through self inside the loops: CuTe-DSL would try to carry a local
        # object whose methods a dynamic loop calls
        self.walk = self._walk(seq)

        if warp_group_idx == 0:
            cute.arch.setmaxregister_decrease(self.regs_producer)
            if const_expr(self.gather):  # tile_n / 32 warps gather K / V (hopper/gather.py)
                if warp_idx < self.producer_warps:
                    self.producer_warp(tile, space, tma, smem, tile_ids)
                    cute.arch.cp_async_wait_group(0)  # no warp exits with its copies (and arrivals) in flight
            elif warp_idx == 0:  # one warp issues (elect.sync inside needs the whole warp converged)
                self.producer_warp(tile, space, tma, smem, tile_ids)
        else:
            cute.arch.setmaxregister_increase(self.regs_consumer)
            wg = warp_group_idx - 1
            barriers.pass_turn(wg, self.num_consumers, first=True)
            self.consumer_warpgroup(wg, tidx, tile, space, args, smem, tile_ids)
            barriers.pass_turn(wg, self.num_consumers, first=False)

    @cute.jit
    def producer_warp(self, tile, space, tma: TmaLoads, smem: SmemBuffers, tile_ids: cute.Tensor):
        """The loads of one tile, or of every work item of a persistent CTA."""
        if const_expr(self.persistent):
            kv_base, q_phase = Int32(0), Int32(0)  # loads so far, Q's phase
            linear = self.walk.first_linear()
            total = self.walk.num_items(space)
            while linear < total:
                item = self.walk.item_at(linear, space)
                if self.tile_live(item.tile):  # else: past its sequence's end (varlen)
                    if const_expr(self.dynamic):
                        # published before Q's full barrier is armed: its arrival (release) orders
                        # the store before the consumers' wait (acquire). One lane only: the elected
                        # lane that arrives; a store by the other lanes would be unordered (a race
                        # under the PTX memory model, and 48 racecheck hazards when all 32 stored)
                        if cute.arch.lane_idx() == 0:
                            tile_ids[q_phase] = linear
                    produce(self, item.tile, item.n_block_max, kv_base, q_phase, tma, smem,
                            n_block_min=item.n_block_min)
                    kv_base += blocks_walked(item.n_block_min, item.n_block_max)
                    q_phase ^= 1
                linear = self.walk.next_linear(linear, space)
            if const_expr(self.dynamic):
                # tell the consumers there is no more work: an out-of-range tile id, on a Q phase
                # completed by a real load (the first Q slabs of the tensors)
                if cute.arch.lane_idx() == 0:  # one lane, as above
                    tile_ids[q_phase] = total
                produce(self, empty_tile(), Int32(0), kv_base, q_phase, tma, smem)
        else:
            n_block_min, n_block_max = self.key_range(tile)
            produce(self, tile, n_block_max, Int32(0), Int32(0), tma, smem, n_block_min=n_block_min)

    @cute.jit
    def consumer_warpgroup(self, wg: Int32, tidx: Int32, tile, space, args: ConsumerArgs,
                           smem: SmemBuffers, tile_ids: cute.Tensor):
        """Consumer wg on one tile, or on every tile of a persistent CTA (tidx: the CTA thread index)."""
        pipe_Q = smem.pipe_Q
        if const_expr(self.dynamic):
            # the producer publishes each tile id with that tile's Q (total: no more work)
            kv_base, q_phase = Int32(0), Int32(0)
            total = space.num_tiles()
            pipe_Q.consumer_wait(pipeline.PipelineState(1, Int32(0), Int32(0), q_phase))
            linear = tile_ids[q_phase]
            while linear < total:
                t = self.walk.tile_at(linear, space)
                n_block_min, n_block_max = self.key_range(t)
                consume(self, wg, tidx % 128, t, n_block_max, kv_base, q_phase, args, smem, n_block_min=n_block_min)
                kv_base += blocks_walked(n_block_min, n_block_max)
                q_phase ^= 1
                pipe_Q.consumer_wait(pipeline.PipelineState(1, Int32(0), Int32(0), q_phase))
                linear = tile_ids[q_phase]
        elif const_expr(self.persistent):
            kv_base, q_phase = Int32(0), Int32(0)
            linear = self.walk.first_linear()
            total = self.walk.num_items(space)
            while linear < total:
                item = self.walk.item_at(linear, space)
                if self.tile_live(item.tile):
                    consume(self, wg, tidx % 128, item.tile, item.n_block_max, kv_base, q_phase, args, smem,
                            n_block_min=item.n_block_min, chunk=item.chunk, mSplit=space.split)
                    kv_base += blocks_walked(item.n_block_min, item.n_block_max)
                    q_phase ^= 1
                linear += self.walk.num_walkers()
        else:
            n_block_min, n_block_max = self.key_range(tile)
            consume(self, wg, tidx % 128, tile, n_block_max, Int32(0), Int32(0), args, smem, n_block_min=n_block_min)
