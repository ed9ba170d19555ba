"""Stage 3, Blackwell (sm_100a): the persistent forward -- one CTA per SM walks the tiles of any tile
order, carrying every barrier phase from one tile to the next. COMPILED AND INSPECTED ONLY: no
Blackwell GPU is reachable from this project, so this has never run on hardware.

Compared with one CTA per tile (``blackwell_fwd.FlashAttentionForwardSm100.one_tile_roles``), this
adds a tile loop around every warp role, because a CTA that stays resident pays its launch, barrier
initialisation, TMEM allocation and first loads once per SM instead of once per tile, and the next
tile's Q and K/V loads run while the correction warpgroup and the epilogue warp finish the previous
tile's O. The order is the scheduler's ``tile_at(linear, M, H, B)`` (the static grid order, or stage
5's LPT order), walked with static striding: CTA c computes tiles c, c + P, c + 2P, ... (P = the
grid's width = min(tiles, SMs)). Every role walks the same tiles and skips the same empty ones
(varlen tiles past a short sequence), so they agree on every barrier's phase.

The barriers are initialised once and never re-initialised; each role carries two counters:

    blocks_done   key blocks its earlier tiles walked: the per-key-block barriers (s_full, p_full,
                  p_full_2) complete once per block, the K/V ring takes 2 loads per block, and
                  scale_full completes at every block but a tile's first (blocks_done - tiles_done)
    tiles_done    tiles it finished: the once-per-tile barriers (q_full, final_full, o_full,
                  epi_full and the three below) have parity tiles_done % 2

Three hand-overs exist only because a buffer is reused by the next tile (blackwell_config's
``persistent_barriers``; one-tile builds do not have them):

    q_empty[i]     MMA warp (tcgen05.commit after the tile's last S_i = Q_i K^T) -> load warp:
                   sQ_i may take the next tile's Q_i
    final_empty[i] correction warpgroup (read the final row sum / row max) -> MMA warp: the next
                   S_i(0) overwrites those TMEM columns (they live inside S_i)
    epi_empty[i]   epilogue warp (sO_i stored) -> correction warpgroup: sO_i may take the next O_i

The next tile's first O_i += P_i V (which overwrites O_i) needs no new barrier: it waits for p_full,
which the correction warpgroup arrives on only after reading the previous O_i. TMEM is allocated once
per CTA and freed after the last tile.

Registers: the one-tile build's split (softmax 192, correction 72, MMA / load / epilogue 56) holds,
because what a loop-invariant address or bound would keep live across every tile is recomputed per
tile instead: the compiler hoists loop-invariant code above the tile loop, and the MMA warp's Q
descriptors (16 of them), the correction warpgroup's swizzled sO addresses (32) and the order's
divisions spilled there (up to 240 bytes). ``blackwell_sync.opaque_i32`` (an asm mov the compiler
cannot look through) feeds a zero offset to sQ in the MMA warp, the thread index in the correction
warpgroup and the walk's extents in ``_tile_info_at``; each costs a few integer instructions a tile.

Not here: the dynamic hand-out (``PersistentScheduler(dynamic=True)``: an atomic tile counter whose
value every role would need, broadcast through SMEM), head dims whose sO lies over sQ ((192, 128):
the next Q would overwrite O before it is stored), and a learnable sink at head_dim_v = 128 (the
correction warpgroup spills 16 bytes) -- all refused by check_persistent (config.persistent_supported).
Also as in the one-tile build (whose PTX this module leaves byte-identical): the epilogue warp's TMA
stores of O are issued by all 32 of its lanes (no elect_one around them in the PTX), 32 copies of
each store; the epilogue is shared, so the fix belongs to both builds at once.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.memory import TmemAllocator

from stage3_fwd_kernel.blackwell_sync import opaque_i32, tcgen05_fence_after_sync, tcgen05_fence_before_sync
from stage3_fwd_kernel.components.work_tile import SequenceInfo, locate_tile


def check_persistent(scheduler, config) -> bool:
    """Whether `scheduler` asks for a persistent grid (a plain bool); ValueError when this kernel
    cannot run it persistently (the message names what is missing)."""
    if not getattr(scheduler, "persistent", False):
        return False
    if not callable(getattr(scheduler, "tile_at", None)):
        raise ValueError("scheduler: a persistent scheduler needs tile_at(linear, M, H, B) "
                         "(tile_scheduler.PersistentScheduler over a tile order)")
    if getattr(scheduler, "dynamic", False):
        raise ValueError("scheduler: the Blackwell forward walks a persistent order with static striding only; "
                         "PersistentScheduler(dynamic=True) is not implemented here")
    why = config.persistent_supported
    if why is not None:
        raise ValueError(f"scheduler: no persistent build at head dims ({config.head_dim}, {config.head_dim_v}): {why}")
    return True


class TileWalkArgs(NamedTuple):
    """What every role needs to locate work tile `linear` of a persistent walk."""

    cu_seqlens_q: Any      # int32 (batch + 1,) or None
    cu_seqlens_k: Any
    seqlen_q: Any          # Int32: dense extents (varlen: unused)
    seqlen_k: Any
    qhead_per_kvhead: Any  # Int32
    num_m_blocks: Any      # Int32: CTA tiles (256 query rows) per head
    num_heads: Any         # Int32
    num_batch: Any         # Int32
    seqused_k: Any = None  # int32 (batch,) or None: the keys each sequence uses (varlen)


class PersistentRoles:
    """The tile loops of a persistent build (a mixin of FlashAttentionForwardSm100). Each loop
    calls the one-tile role (load, mma, softmax, correction, epilogue) with the carried counters."""

    # ------------------------------------------------------------------ the walk
    def _walk_bounds(self, walk: TileWalkArgs):
        """(first work tile, stride, number of tiles): CTA c walks c, c + P, c + 2P, ... (static)."""
        total = walk.num_m_blocks * walk.num_heads * walk.num_batch
        return Int32(cute.arch.block_idx()[0]), Int32(cute.arch.grid_dim()[0]), total

    @cute.jit
    def _tile_info_at(self, walk: TileWalkArgs, linear: Int32):
        """The one-tile build's _tile_info for work tile `linear` of the scheduler's order. The extents
        pass through opaque_i32, so what is derived from them alone (divisions of the order's map,
        the key-block bounds) is recomputed per tile instead of hoisted above the loop and kept live
        across every tile (28 bytes spilled in the correction warpgroup at d = 128 non-causal, 4 in the
        MMA warp under the LPT order)."""
        num_m_blocks, num_heads, num_batch = (opaque_i32(walk.num_m_blocks), opaque_i32(walk.num_heads),
                                              opaque_i32(walk.num_batch))
        m_block, head, batch = self.scheduler.tile_at(linear, num_m_blocks, num_heads, num_batch)
        seq = SequenceInfo(opaque_i32(walk.seqlen_q), opaque_i32(walk.seqlen_k), opaque_i32(walk.qhead_per_kvhead),
                           walk.cu_seqlens_q, walk.cu_seqlens_k, walk.seqused_k, None)
        tile = locate_tile(seq, m_block, head, batch)
        tile_valid = tile.m_block * self.cfg.cta_tile_m < tile.seqlen_q  # varlen: the sequence may be shorter
        n_block_min, n_blocks = self._key_blocks(tile.m_block, tile.seqlen_q, tile.seqlen_k)
        return tile, n_block_min, n_blocks, tile_valid

    # ------------------------------------------------------------------ the CTA
    @cute.jit
    def persistent_roles(self, walk: TileWalkArgs, wg_idx: Int32, warp_idx: Int32, tmem: TmemAllocator,
                         mbar: cute.Pointer, tma_Q: cute.Tensor, tma_K: cute.Tensor, tma_V: cute.Tensor,
                         tma_O: cute.Tensor | None, mO: cute.Tensor, mLSE: cute.Tensor, softmax_scale_log2: Float32,
                         tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
                         tma_atom_O: cute.CopyAtom | None, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
                         sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor, sO: cute.Tensor,
                         tP_layout: cute.ComposedLayout, score_scale: Float32 | None, mSink: cute.Tensor | None):
        """The warp roles of a persistent CTA: as one_tile_roles, each inside its tile loop."""
        roles = self.roles
        thr_mma_qk = tiled_mma_qk.get_slice(0)
        thr_mma_pv = tiled_mma_pv.get_slice(0)
        if wg_idx == 3:
            # ---------------------------------------------------------------- MMA / load / epilogue
            cute.arch.setmaxregister_decrease(self.cfg.regs.other)
            if warp_idx == roles.load:
                self.load_tiles(walk, mbar, tma_Q, tma_K, tma_V, tma_atom_Q, tma_atom_K, tma_atom_V, sQ, sK, sV,
                                thr_mma_qk, thr_mma_pv)
            if warp_idx == roles.mma:
                tmem.allocate(self.tmem.alloc)  # once per CTA, for all its tiles
                tmem.relinquish_alloc_permit()
                tmem.wait_for_alloc()
                tmem_ptr = tmem.retrieve_ptr(Float32)
                self.mma_tiles(walk, mbar, tmem_ptr, sQ, sK, sV, tP_layout, tiled_mma_qk, tiled_mma_pv)
                cute.arch.mbarrier_wait(self._bar(mbar, "tmem_dealloc", 0), 0)
                tcgen05_fence_after_sync()
                tmem.free(tmem_ptr)
            if warp_idx == roles.epilogue:
                self.epilogue_tiles(walk, mbar, sO, tma_O, tma_atom_O, mO)
        elif wg_idx == 2:
            # ---------------------------------------------------------------- correction warpgroup
            cute.arch.setmaxregister_decrease(self.cfg.regs.correction)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.correction_tiles(walk, softmax_scale_log2, mbar, tmem_ptr, sO, mLSE, thr_mma_qk, thr_mma_pv, mSink)
            tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "tmem_dealloc", 0))
        else:
            # ---------------------------------------------------------------- softmax warpgroups
            cute.arch.setmaxregister_increase(self.cfg.regs.softmax)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(Float32)
            self.softmax_tiles(walk, softmax_scale_log2, mbar, tmem_ptr, thr_mma_qk, score_scale)
            tcgen05_fence_before_sync()
            cute.arch.mbarrier_arrive(self._bar(mbar, "tmem_dealloc", 0))

    # ------------------------------------------------------------------ one loop per role
    # The loops are written out per role rather than shared through a callback: each is what its
    # role's SASS shows, and the protocol checker reads each (blackwell_protocol, --persistent).
    @cute.jit
    def load_tiles(self, walk: TileWalkArgs, mbar: cute.Pointer, tma_Q: cute.Tensor, tma_K: cute.Tensor,
                   tma_V: cute.Tensor, tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom,
                   tma_atom_V: cute.CopyAtom, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                   thr_mma_qk: cute.ThrMma, thr_mma_pv: cute.ThrMma):
        blocks_done, tiles_done = Int32(0), Int32(0)
        linear, stride, total = self._walk_bounds(walk)
        while linear < total:
            t, n_block_min, n_blocks, tile_valid = self._tile_info_at(walk, linear)
            if tile_valid:
                self.load(t.m_block, t.head, t.head_kv, t.batch, t.offset_q, t.offset_k, n_blocks, mbar,
                          tma_Q, tma_K, tma_V, tma_atom_Q, tma_atom_K, tma_atom_V, sQ, sK, sV,
                          thr_mma_qk, thr_mma_pv, n_block_min=n_block_min, blocks_done=blocks_done,
                          tiles_done=tiles_done, tile=t)
                blocks_done += n_blocks
                tiles_done += 1
            linear += stride

    @cute.jit
    def mma_tiles(self, walk: TileWalkArgs, mbar: cute.Pointer, tmem_ptr: cute.Pointer, sQ: cute.Tensor,
                  sK: cute.Tensor, sV: cute.Tensor, tP_layout: cute.ComposedLayout,
                  tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma):
        blocks_done, tiles_done = Int32(0), Int32(0)
        linear, stride, total = self._walk_bounds(walk)
        while linear < total:
            t, n_block_min, n_blocks, tile_valid = self._tile_info_at(walk, linear)
            if tile_valid:
                self.mma(n_blocks, mbar, tmem_ptr, sQ, sK, sV, tP_layout, tiled_mma_qk, tiled_mma_pv,
                         blocks_done=blocks_done, tiles_done=tiles_done)
                blocks_done += n_blocks
                tiles_done += 1
            linear += stride

    @cute.jit
    def epilogue_tiles(self, walk: TileWalkArgs, mbar: cute.Pointer, sO: cute.Tensor, tma_O: cute.Tensor | None,
                       tma_atom_O: cute.CopyAtom | None, mO: cute.Tensor):
        tiles_done = Int32(0)
        linear, stride, total = self._walk_bounds(walk)
        while linear < total:
            t, n_block_min, n_blocks, tile_valid = self._tile_info_at(walk, linear)
            if tile_valid:
                self.epilogue(t.m_block, t.head, t.batch, t.offset_q, t.seqlen_q, mbar, sO, tma_O, tma_atom_O, mO,
                              tiles_done=tiles_done)
                tiles_done += 1
            linear += stride

    @cute.jit
    def correction_tiles(self, walk: TileWalkArgs, softmax_scale_log2: Float32, mbar: cute.Pointer,
                         tmem_ptr: cute.Pointer, sO: cute.Tensor, mLSE: cute.Tensor, thr_mma_qk: cute.ThrMma,
                         thr_mma_pv: cute.ThrMma, mSink: cute.Tensor | None):
        blocks_done, tiles_done = Int32(0), Int32(0)
        linear, stride, total = self._walk_bounds(walk)
        while linear < total:
            t, n_block_min, n_blocks, tile_valid = self._tile_info_at(walk, linear)
            if tile_valid:
                self.correction(t.m_block, t.head, t.batch, t.offset_q, t.seqlen_q, n_blocks, softmax_scale_log2,
                                mbar, tmem_ptr, sO, mLSE, thr_mma_qk, thr_mma_pv, mSink=mSink,
                                blocks_done=blocks_done, tiles_done=tiles_done)
                blocks_done += n_blocks
                tiles_done += 1
            linear += stride

    @cute.jit
    def softmax_tiles(self, walk: TileWalkArgs, softmax_scale_log2: Float32, mbar: cute.Pointer,
                      tmem_ptr: cute.Pointer, thr_mma_qk: cute.ThrMma, score_scale: Float32 | None):
        blocks_done = Int32(0)
        linear, stride, total = self._walk_bounds(walk)
        while linear < total:
            t, n_block_min, n_blocks, tile_valid = self._tile_info_at(walk, linear)
            if tile_valid:
                self.softmax(t.m_block, t.seqlen_q, t.seqlen_k, n_blocks, softmax_scale_log2, mbar, tmem_ptr,
                             thr_mma_qk, score_scale=score_scale, n_block_min=n_block_min, blocks_done=blocks_done)
                blocks_done += n_blocks
            linear += stride
