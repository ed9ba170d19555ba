"""Configuration of the production Hopper backward: thread roles, named barriers, tiles, the SMEM
plan and the per-configuration options. Plain Python (no device code): the kernel, the host and the
tests read the same numbers.

Roles (384 threads): warpgroup 0 is the producer (warp 0 issues the TMA loads, warps 1 .. dq_writers
reduce dQ; with ``dq_atomic`` the consumers add dQ themselves and those warps idle, or in deterministic
mode warps 1 and 2 keep the consumers' turns on the dQ semaphores), warpgroups 1 and 2
are the consumers: keys [64 w, 64 w + 64) of the K/V tile each, or at the wide head dims
(``WIDE_HEAD_DIMS``) the same keys: at 256 64 of them split by queries and by columns (``wide.py``), at
(192, 128) 96 split by keys for S / dP and dK^T / dV^T (``wide_swap.py``, ``kv_swap``).

Named barriers (0 is __syncthreads, used only before the role split; ids 2 and 3 are not used):
    1               the 256 consumers: "dS^T stored" (B2) once per tile, and the epilogue
    4 + w           "sdSt free" for warpgroup w (one dS^T buffer; the wide body always): the other
                    warpgroup's dQ wgmma (wide: its dV, dQ and dK wgmmas) of the previous tile has read sdSt
    6 + b           "dQ full" of dQ buffer b: 256 consumer arrivals + the writer warp's sync = 288
    6 + B + 2 b + w "dQ empty" of buffer b, share w (B buffers): the writer's arrival + warpgroup w's
                    sync = 160. Tile t waits only when t >= B and the writer arrives only when t + B
                    < tiles, so every barrier generation completes before the CTA exits (persistent:
                    the writer arrives after every tile and the consumers sync the last B at exit).
    6 + w, 8 + w    deterministic dq_atomic (no writer): turn warp w -> warpgroup w "add tile t", and
                    warpgroup w -> turn warp w "added"; 128 + 32 = 160 each, once a tile (wide.py)
The ids are computed at run time (bar.sync takes them in a register), so ptxas reserves all 16.
"""
from __future__ import annotations

import dataclasses

from stage3_fwd_kernel.host_io import SMEM_BUDGET

NUM_WG_MMA = 2
NUM_THREADS = 128 * (1 + NUM_WG_MMA)
NUM_CONSUMER_THREADS = 128 * NUM_WG_MMA
NUM_STAGES = 2                                    # Q / dO ring
CONSUMER_BARRIER = 1
SDST_FREE_BARRIER = 2 + NUM_WG_MMA
DQ_FULL_BARRIER = 2 + 2 * NUM_WG_MMA
# deterministic dq_atomic (wide.py): a turn warp per consumer warpgroup, on the writer's ids (no writer then)
DQ_TURN_BARRIER = DQ_FULL_BARRIER                 # turn warp w -> warpgroup w: add tile t's share
DQ_ADDED_BARRIER = DQ_FULL_BARRIER + NUM_WG_MMA   # warpgroup w -> turn warp w: the adds are issued
DQ_TURN_THREADS = 128 + 32                        # one consumer warpgroup + its turn warp
DQ_FULL_THREADS = NUM_CONSUMER_THREADS + 32       # consumers + the writer warp
DQ_EMPTY_THREADS = 128 + 32                       # one consumer warpgroup + the writer warp
NUM_NAMED_BARRIERS = 16
DQ_WRITER_WARP = 1      # first dQ writer warp of the producer warpgroup (warp 0 issues the TMA loads)
MAX_DQ_BUFFERS = 2
RS_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (128, 64))
# dK + dV of 64 keys do not fit one warpgroup's registers: the warpgroups share the keys (wide.py)
WIDE_HEAD_DIMS = ((192, 128), (256, 256))
# the 96-key design (wide_swap.py): S = Q K^T split by keys, dK^T / dV^T with the head dim as wgmma M
SWAP_HEAD_DIMS = ((192, 128),)
SWAP_TILE_N = 96
WIDE_TILE_N = 64  # wide.py's keys a CTA


def wide_tile_n(kv_swap: bool) -> int:
    """Keys a CTA of the wide designs: 96 (wide_swap.py) or 64 (wide.py)."""
    return SWAP_TILE_N if kv_swap else WIDE_TILE_N


REGS_PRODUCER, REGS_CONSUMER = 24, 240  # sums to 3 x 168: setmaxnreg only redistributes the launch registers


def is_banded(window, causal: bool) -> bool:
    """A window (stage3_fwd_kernel.components.window) with an edge beyond causal's diagonal."""
    return window.left is not None or (window.right is not None and not causal)


def is_wide(head_dim: int, head_dim_v: int) -> bool:
    return (head_dim, head_dim_v) in WIDE_HEAD_DIMS


def check_product_head_dims(head_dim: int, head_dim_v: int):
    """ValueError for head dims the production kernel has no design for."""
    if (head_dim, head_dim_v) not in RS_HEAD_DIMS + WIDE_HEAD_DIMS:
        raise ValueError(f"head_dim: the Hopper backward supports (q/k, v) head dims {RS_HEAD_DIMS + WIDE_HEAD_DIMS}, "
                         f"got {(head_dim, head_dim_v)}")


def default_tiles(head_dim: int, head_dim_v: int) -> tuple[int, int]:
    """(tile_m, tile_n): 64 keys per consumer warpgroup (wgmma M); 128 queries at d = 64 (dV issued
    after dS and dQ split by query rows keep it in 240 registers), 64 at d = 96, 80 at d = 128
    (dQ^T = K^T dS^T, since 80 is no wgmma M, and one dQ buffer); (128, 64) keeps d = 128's 80 x 128
    (measured faster than 64 x 128 in the non-causal backward, equal causal: docs/measurements.md).
    The wide head dims: 64 x 96 at (192, 128) (wide_swap.py), 64 x 64 at 256, both warpgroups on the same
    keys (wide.py)."""
    check_product_head_dims(head_dim, head_dim_v)
    if is_wide(head_dim, head_dim_v):
        return 64, wide_tile_n((head_dim, head_dim_v) in SWAP_HEAD_DIMS)
    return {(64, 64): (128, 128), (128, 128): (80, 128), (128, 64): (80, 128)}.get((head_dim, head_dim_v), (64, 128))


def smem_need(tile_m: int, tile_n: int, head_dim: int, head_dim_v: int, ds_buffers: int, dq_buffers: int,
              stages: int = NUM_STAGES, pt_buffers: int = 0) -> int:
    # dq_buffers = 0: dQ added from registers (dq_atomic), no sdQ
    """Bytes of K, V, the Q/dO stages, the 16-bit dS^T (and, wide, P^T) buffers and the fp32 dQ
    buffers, + 2 KB for the mbarriers and the row statistics' ring.

        d = 64  (128 x 128): 16 + 16 + 2 * 32 + 1 * 32 + 2 * 32 = 192 KB
        d = 96  (64 x 128):  24 + 24 + 2 * 24 + 2 * 16 + 1 * 24 = 152 KB  (deterministic, two dQ buffers: 176)
        d = 128 (80 x 128):  32 + 32 + 2 * 40 + 2 * 20 + 1 * 40 = 224 KB  (two dQ buffers: 264)
        (192, 128) (64 x 96): 36 + 24 + 2 * 40 + 12 + 12 + 1 * 48 = 212 KB  (the 64-key design, 64 x 64:
                              24 + 16 + 2 * 40 + 8 + 8 + 1 * 48 = 184 KB, two dQ buffers 232)
        (256, 256) (64 x 64): 32 + 32 + 2 * 64 + 8 + 8 + 0 = 208 KB  (dQ from registers, deterministic
                              mode too; a dQ buffer would cost the second stage: 32 + 32 + 64 + 16 + 64)
    """
    tm, tn, d, dv = tile_m, tile_n, head_dim, head_dim_v
    operands = (tn * (d + dv) + stages * tm * (d + dv) + (ds_buffers + pt_buffers) * tn * tm) * 2
    return operands + dq_buffers * tm * d * 4 + 2048


@dataclasses.dataclass(frozen=True)
class BackwardOptions:
    """What differs between the production configurations; each field is documented where its code
    is (see the field comments). ``for_config`` gives the default of a configuration; any field may be
    overridden (``dataclasses.replace``) to compare a build against the default, e.g. in the tests."""

    stats_shuffle: bool    # row statistics by warp shuffle (scores.py)
    dq_frag: bool          # dQaccum in fragment order (dq_writer.py)
    q_shift: bool          # Q tiles counted from the sequence's end (kernel.py)
    key_select: bool       # key-bound select in the unmasked body (scores.py)
    column_limit: bool     # one key limit per query column in the masked body (scores.py)
    mask_offsets: bool     # the masked test against the accumulator's static offsets (scores.py)
    kv_with_first: bool    # K / V on the first Q / dO tile's barriers (producer.py)
    ds_buffers: int        # dS^T buffers (SMEM plan below)
    dq_buffers: int        # fp32 dQ buffers (SMEM plan below)
    dq_writers: int        # dQ writer warps (dq_writer.py)
    stages: int = NUM_STAGES  # Q / dO ring (producer.py)
    dq_atomic: bool = False   # wide: the consumers add dQ with 16-byte reds, no sdQ nor writer (wide.py;
                              # deterministic: in turns on the semaphores)
    kv_swap: bool = False     # wide: 96 keys a CTA, S by keys, dK^T / dV^T with the head dim as M (wide_swap.py)
    persistent: bool = False  # one CTA per SM takes K/V tiles from a counter (persistent.py); the call picks
                              # it (backward.persistent_pays), so no configuration's default sets it
    dq_first_store: bool = False  # each dQ tile's first arrival stores, the rest reduce: no zeroing (dq_writer.py)
    rotate_walk: bool = False     # each K/V tile starts its walk at its own Q tile and wraps (walk.py)
    half_tiles: bool = False      # a warpgroup whose 64 keys a masked edge tile hides idles there (consumer.py)

    @classmethod
    def for_config(cls, head_dim: int, head_dim_v: int, causal: bool, deterministic: bool,
                   varlen: bool, banded: bool = False, softcap: bool = False) -> "BackwardOptions":
        """The measured default of a configuration (docs/measurements.md). banded: a window edge
        beyond causal's (``is_banded``), so the walk has masked tiles at both ends; softcap: scores
        capped (its builds keep the walk in order, ``rotation_pays``)."""
        tm, tn = default_tiles(head_dim, head_dim_v)
        if is_wide(head_dim, head_dim_v):
            return cls.for_wide(head_dim, head_dim_v, deterministic, banded, causal=causal)
        # dS^T double-buffered below the 128-query tile where it fits beside one dQ buffer; the
        # 128 x 128 tile measured a tie and keeps one (two fill the 227 KB exactly)
        ds_buffers = 1
        if tm < 128 and smem_need(tm, tn, head_dim, head_dim_v, 2, 1) <= SMEM_BUDGET:
            ds_buffers = 2
        dq_buffers = MAX_DQ_BUFFERS
        if smem_need(tm, tn, head_dim, head_dim_v, ds_buffers, MAX_DQ_BUFFERS) > SMEM_BUDGET:
            dq_buffers = 1
        # d = 96: one buffer on an H200 (log 2026-12-01) non-causal +0.1..+1.4%, a (1024, 1024) band +1.7..+2.6%,
        # causal a tie (mean +0.7%); deterministic mode keeps a buffer per writer warp
        if tm == 64 and not deterministic:
            dq_buffers = 1
        # the TMA tensor reduce measured faster only for the 80-query tile in causal deterministic mode
        dq_frag = not (causal and deterministic and tm == 80)
        rotate_walk = rotation_pays(head_dim, causal, banded, deterministic, softcap, varlen)
        return cls(
            stats_shuffle=tm == 128 and stats_shuffle_pays(causal, banded, deterministic, softcap, varlen),
            dq_frag=dq_frag,
            q_shift=causal and not varlen and not deterministic and dq_frag and tn % tm != 0,
            key_select=tm == 80 and not deterministic,
            # the two fast masked bodies know one edge (scores.py); a band takes the plain test
            column_limit=tm != 128 and not banded,  # the 128-query tile spilled with it
            mask_offsets=causal and not banded and not deterministic and not varlen and head_dim <= 96,
            kv_with_first=causal and not deterministic and tm == 128,
            ds_buffers=ds_buffers,
            dq_buffers=dq_buffers,
            dq_writers=dq_buffers if deterministic else 1,
            dq_first_store=dq_frag and not deterministic and first_stores_pay(head_dim, causal, banded,
                                                                              rotate_walk, varlen),
            rotate_walk=rotate_walk,
            # not with softcap in deterministic mode: d = 128 causal spilled 84 bytes with them (60 without)
            half_tiles=tm < 128 and not (softcap and deterministic),
        )

    @classmethod
    def for_wide(cls, head_dim: int, head_dim_v: int, deterministic: bool, banded: bool = False,
                 kv_swap: bool = True, causal: bool = False) -> "BackwardOptions":
        """The wide design (wide.py): no register-sourced dV / dK, statistics from SMEM (the query
        split moves the columns the shuffle assumes), one dS^T and one P^T buffer, two Q / dO stages;
        a dQ buffer (two where they fit) for the writer warp, or at 256, where no buffer fits beside the
        two stages, dQ added by the consumers (dq_atomic; deterministic mode in turns). banded: the plain masked
        test instead of column_limit (one key edge per column)."""
        tm, _ = default_tiles(head_dim, head_dim_v)
        kv_swap = kv_swap and (head_dim, head_dim_v) in SWAP_HEAD_DIMS
        tn = wide_tile_n(kv_swap)

        def fits(stages, dq_buffers):
            return smem_need(tm, tn, head_dim, head_dim_v, 1, dq_buffers, stages, 1) <= SMEM_BUDGET
        # two Q / dO stages first (one measured 0.55x the speed at (192, 128)); where they leave no
        # room for a dQ buffer, dQ is added from registers -- in deterministic mode too, each
        # warpgroup taking its turn on the tile's semaphore (wide.py)
        dq_atomic = not fits(NUM_STAGES, 1) and fits(NUM_STAGES, 0)
        stages = NUM_STAGES if dq_atomic or fits(NUM_STAGES, 1) else 1
        dq_buffers = MAX_DQ_BUFFERS if not dq_atomic and fits(stages, MAX_DQ_BUFFERS) else 1
        return cls(stats_shuffle=False, dq_frag=True, q_shift=False, key_select=False,
                   column_limit=not banded, mask_offsets=False, kv_with_first=False, ds_buffers=1,
                   dq_buffers=dq_buffers, dq_writers=dq_buffers if deterministic else 1, stages=stages,
                   dq_atomic=dq_atomic, kv_swap=kv_swap,
                   dq_first_store=not dq_atomic and not deterministic and first_stores_pay(head_dim, causal, banded))

    def check(self, varlen: bool, wide: bool = False, deterministic: bool = False, banded: bool = False,
              tile_m: int = 0, head_dim: int = 0, head_dim_v: int = 0, causal: bool = False):
        """ValueError for a combination the kernel cannot build (only overrides can produce one).
        tile_m, head_dim, head_dim_v: the build's, for the checks that need them (persistent's staging).
        wide: the options of the register-sourced body that the wide one (wide.py) has no path for.
        banded: a window edge beyond causal's, which the one-edge masked bodies cannot test."""
        if banded and (self.column_limit or self.mask_offsets):
            name = "column_limit" if self.column_limit else "mask_offsets"
            raise ValueError(f"{name}: tests one key edge per query column; a window with an edge beyond "
                             "causal's takes the plain masked test (scores.py)")
        if wide:
            rs_only = [name for name in ("stats_shuffle", "q_shift", "mask_offsets", "kv_with_first")
                       if getattr(self, name)]
            if rs_only or self.ds_buffers != 1:
                name = rs_only[0] if rs_only else "ds_buffers"
                raise ValueError(f"{name}: a choice of the register-sourced kernel (head dims 64 / 96 / 128); the "
                                 "wide head dims' body (wide.py) has no such path (one P^T / dS^T buffer)")
        if self.dq_atomic and not wide:
            raise ValueError("dq_atomic: the wide head dims only (wide.py adds dQ from its warpgroups' registers)")
        if self.ds_buffers not in (1, 2):
            raise ValueError(f"ds_buffers: expected 1 or 2, got {self.ds_buffers!r}")
        if self.dq_buffers not in (1, 2):
            raise ValueError(f"dq_buffers: expected 1 or 2, got {self.dq_buffers!r}")
        if self.dq_writers not in (1, 2) or self.dq_buffers % self.dq_writers:
            raise ValueError(f"dq_writers: expected 1 or 2 dividing dq_buffers ({self.dq_buffers}), "
                             f"got {self.dq_writers!r}")
        if self.kv_swap and (not wide or self.dq_atomic or not self.dq_frag):
            raise ValueError("kv_swap: the 96-key design of the wide head dims (wide_swap.py), with dQ through the "
                             "writer warp in fragment order")
        if self.dq_atomic and not self.dq_frag:
            raise ValueError("dq_atomic: adds dQ in fragment order, which needs dq_frag")
        if self.persistent and (wide or deterministic or self.kv_with_first or not self.dq_frag or self.dq_writers != 1):
            raise ValueError("persistent: the register-sourced body (head dims 64 / 96 / 128) outside deterministic "
                             "mode, with dQ in fragment order, one writer warp and K / V on their own barrier")
        if self.persistent and self.ds_buffers * tile_m < max(head_dim, head_dim_v):
            raise ValueError(f"persistent: the epilogue stages a dK / dV tile in the dS^T buffers, which hold "
                             f"{self.ds_buffers} x {tile_m} of the {max(head_dim, head_dim_v)} columns it needs "
                             "(ds_buffers)")
        if self.dq_first_store and (deterministic or self.dq_atomic or not self.dq_frag):
            raise ValueError("dq_first_store: the dQ writer warp's fragment-order adds outside deterministic mode "
                             "(deterministic adds keep their fixed order into a zeroed accumulator)")
        if self.rotate_walk and (deterministic or causal or banded):
            raise ValueError("rotate_walk: plain non-causal walks outside deterministic mode (causal and banded walks "
                             "already start at staggered Q tiles; deterministic adds keep the dq_order's fixed order)")
        if self.stages not in (1, 2):
            raise ValueError(f"stages: expected 1 or 2, got {self.stages!r}")
        if self.half_tiles and wide:
            raise ValueError("half_tiles: the register-sourced body, whose warpgroups own 64 keys each; the wide "
                             "head dims' warpgroups share their keys (wide.py)")
        if self.q_shift and (varlen or not self.dq_frag):
            raise ValueError("q_shift: needs a dense (not varlen) kernel with dq_frag (the padding rows are "
                             "loaded past the tensor's start, as zeros)")


def stats_shuffle_pays(causal: bool, banded: bool, deterministic: bool, softcap: bool, varlen: bool) -> bool:
    """Where the 128-query tile (d = 64) keeps each lane's row statistics in registers (scores.py) rather
    than reading them from SMEM, as measured on an H200. Plain walks: without softcap (with it the lanes'
    statistics spilled 116 bytes a thread, 36 without, and the backward ran 1.20x faster without them, in
    both modes; log 2026-12-04, "the d = 64 softcap backward"). Causal or banded walks: in deterministic
    mode (the softcap builds spill 40 bytes with them, 60 without; untimed), and in the default mode on
    causal walks without a window or softcap: varlen 1.07-1.09x faster (0.93x with softcap; 2026-12-04, "the
    d = 64 varlen backward"), dense +0.3..0.7% (2026-12-04, "variants re-timed") and +0.3..2.5% (2026-12-05,
    "row statistics by shuffle"). A (1024, 0) window lost 2.4-3.3%; before first stores ptxas serialized
    those builds' wgmmas (C7512)."""
    if not (causal or banded):
        return not softcap
    return deterministic or not (banded or softcap)


def first_stores_pay(head_dim: int, causal: bool, banded: bool, rotated: bool = False, varlen: bool = False) -> bool:
    """Where first stores into dQ (dq_writer.py) measured at or above the zeroed accumulator on an H200
    (docs/measurements.md, 2026-12-02, "first stores into the dQ accumulator"): causal, banded or rotated
    walks, whose K/V tiles reach a dQ tile at different times. In a plain non-causal walk in order every
    CTA reaches each dQ tile together and all but the first wait for its store: -15% / -17% at 2k for
    d = 96 / (192, 128) (64-query tiles). d = 96 causal tied or lost (-1.5% at 8k), so it keeps the
    zeroing too. d = 64 varlen walks in order (``rotation_pays``) take them: 0.97-1.01x of the official
    kernel at 1k-16k against 0.95-0.96x zeroed (2026-12-04, "the d = 64 varlen backward")."""
    return (causal or banded or rotated or (varlen and head_dim == 64)) and head_dim != 96


def rotation_pays(head_dim: int, causal: bool, banded: bool, deterministic: bool, softcap: bool = False,
                  varlen: bool = False) -> bool:
    """Where rotated walks (walk.py) with first stores measured at or above the walk in order with a zeroed
    accumulator on an H200 (docs/measurements.md, 2026-12-02, "rotated non-causal walks"): plain non-causal
    walks at d = 64 and 128 / (128, 64), +2.2..5.1% at 1k-2k for d = 128 and a tie from 4k on. d = 96 and
    (192, 128) (64-query tiles) lost 0.4-1.3%; causal and banded walks are staggered already. Softcap
    builds (not timed) keep the order: the d = 64 one, which spills 116 bytes in order, spilled 240
    with the consumers' bodies twice over. The d = 64 varlen build spilled 32 bytes rotated (0 in order) and
    ran at 0.86-0.92x of the official kernel against 0.97-1.01x in order with first stores (2026-12-04,
    "the d = 64 varlen backward"); d = 128 varlen, which does not spill, keeps the rotation."""
    return not (causal or banded or deterministic or softcap) and (head_dim == 128 or head_dim == 64 and not varlen)


def dq_empty_barrier(dq_buffers: int) -> int:
    """First "dQ empty" id: after the "dQ full" ids of the buffers."""
    return DQ_FULL_BARRIER + dq_buffers


def num_barriers(dq_buffers: int, turns: bool = False) -> int:
    """Named barrier ids a build uses; turns: deterministic dq_atomic (the turn barriers, no writer)."""
    return DQ_ADDED_BARRIER + NUM_WG_MMA if turns else dq_empty_barrier(dq_buffers) + dq_buffers * NUM_WG_MMA
