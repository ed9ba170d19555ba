"""Stage 4, Blackwell: the host-side plans of the 1-CTA and 2-CTA backward kernels -- tiles, TMEM, SMEM, registers.

Plain Python (no cutlass import), tested on CPU, like stage3_fwd_kernel/blackwell_config.py.

One CTA owns one K/V tile of ``tile_n`` = 128 keys of one KV head and walks the Q tiles of
``tile_m`` = 128 queries that see it (of every query head of its GQA group). Per Q tile the MMA
warp issues five tcgen05 MMAs (the paper, section 3.3):

    S^T  = K Q^T      SS   (tile_n x tile_m)  -> TMEM, fp32
    dP^T = V dO^T     SS   (tile_n x tile_m)  -> TMEM, fp32
    dV  += P^T dO     TS   A = P^T (16-bit) from TMEM      (tile_n x dv)  accumulates in TMEM
    dK  += dS^T Q     TS   A = dS^T (16-bit) from TMEM     (tile_n x d)   accumulates in TMEM
    dQ   = dS K       SS   A = dS from SMEM (written by the elementwise warpgroup)  (tile_m x d)

TMEM (32-bit columns; lane r = key r of the tile for S^T, dP^T, dV, dK; = query r for dQ):

    S/P region     tile_n columns: S^T (fp32); after the elementwise warpgroup has read it, P^T
                   (16-bit, 2 per column) goes to its upper half
    dV             dv columns (fp32 accumulator, for the whole walk)
    dP/dS/dQ       tile_n columns: dP^T (fp32); dS^T (16-bit) is written over the chunks of dP^T
                   already read, then dQ = dS K (d <= tile_n columns) over both (the dK MMA that
                   reads dS^T is issued before it). The next dP^T waits until dQ has been drained.
    dK             d columns (fp32 accumulator)

    dS^T sits with dP^T (the paper's "dP, dS and dQ share" a region), not with S^T, so that the
    next tile's S^T can be issued before this tile's dK: the pipeline (blackwell_bwd.py) is
    S(j+1), dK(j), dQ(j), dP(j+1), dV(j+1) -- the elementwise P(j+1) = exp2(...) runs while the
    tensor cores do dK(j) and dQ(j).

    d = 64:   128 + 64 + 128 + 64   = 384 -> allocated 512
    d = 128:  128 + 128 + 128 + 128 = 512 (all of TMEM)
    d = 256:  128 + 256 + 128 + 256 = 768 > 512: does not fit (the 2-CTA kernel halves dK/dV per CTA)

SMEM (bytes; 227 KB = 232448 is the opt-in maximum per CTA on sm_100):

    header    mbarriers + TMEM address slot, padded to 1024
    sK, sV    tile_n x d x 2 and tile_n x dv x 2, loaded once (sK is also read, transposed, as
              the B operand of dQ = dS K: the K-major and MN-major 128B-swizzled layouts of the
              same tile are the same bytes)
    sQ, sdO   stages x tile_m x (d + dv) x 2, a ring (also read transposed by dK / dV)
    sdS       tile_m x tile_n x 2 (A operand of dQ = dS K, MN-major)
    sLSE, sD  2 x tile_m x 4 = 1024 (lse2 and D of the current Q tile, fp32)

    d = 64:   1024 + 16384 + 16384 + 2 x 32768 + 32768 + 1024 = 133120
    d = 128:  1024 + 32768 + 32768 + 2 x 65536 + 32768 + 1024 = 231424   (2 stages; 3 do not fit)

    dQ by TMA reduce-add (``dq_tma=True``; the paper's way out for dQ): WG 2 stages its dQ rows in
    sdQ, 2 buffers of tile_m x 32 fp32 (128-byte rows, 128B swizzle: one TMA box each) = 32768,
    and one thread reduces each into dQaccum with cp.reduce.async.bulk.tensor (.add, fp32). At
    d = 128 the 1 KB left over holds none of it (a whole dQ tile is 64 KB, a quarter 16 KB), so the
    dO ring drops to 1 stage (dO is read by dP and dV, both issued a turn before Q's last reader
    dK: its next load has S, dK, dQ to hide behind) and the Q ring keeps 2:
    d = 64:   133120 + 32768 = 165888                                       (2 Q, 2 dO stages)
    d = 96:   1024 + 2 x 24576 + 2 x (24576 + 24576) + 32768 + 1024 + 32768 = 215040   (2, 2)
    d = 128:  1024 + 32768 + 32768 + 2 x 32768 + 1 x 32768 + 32768 + 1024 + 32768 = 231424   (2 Q, 1 dO)

Registers: 12 warps = 384 threads (launch cap 65536 / 384 = 170 -> 168); setmaxnreg gives the
elementwise warpgroup 240 (a whole 128-value row of P stays in registers while dP^T is read in
32-column chunks), the dQ warpgroup 160 (a whole dQ row, so it releases the TMEM columns before its
atomics) and the MMA/load warpgroup 96: 128 x (240 + 160 + 96) = 63488. (The 2-CTA plan: 240 / 136 / 128.)
With dq_tma at d = 128 (dO's own ring) the MMA/load warpgroup takes 104: 240 + 160 + 104 = 504 = 3 x 168.
"""
from __future__ import annotations

from dataclasses import dataclass

from stage0_reference.validation import check_softcap
# the forward's plan helpers (plain Python, no cutlass import)
from stage3_fwd_kernel.blackwell_config import _dtype_name as _fwd_dtype_name
from stage3_fwd_kernel.blackwell_config import _pow2_at_least, _round_up
from stage3_fwd_kernel.components.window import NO_WINDOW, Window, beyond_causal

__all__ = ["SMEM_CAPACITY", "TMEM_COLUMNS", "SUPPORTED_HEAD_DIMS", "mask_col_min", "mask_col_max",
           "BwdTmemPlan", "BwdSmemPlan",
           "BwdRegisterPlan", "BlackwellBwdConfig", "blackwell_bwd_config", "Bwd2CtaTmemPlan", "Bwd2CtaSmemPlan",
           "blackwell_bwd_2cta_config", "blackwell_bwd_wide_config", "BwdWideTmemPlan",
           "SUPPORTED_HEAD_DIMS_WIDE", "WIDE_TILE_M", "dq_windows", "head_splits", "DQ_STAGE_COLS", "DQ_STAGE_BUFS", "DQ_TMA_DEFAULT"]

SMEM_CAPACITY = 232448
TMEM_COLUMNS = 512
TMEM_MIN_ALLOC = 32
REGISTERS_PER_SM = 65536
HEADER_ALIGN = 1024
MAX_QDO_STAGES = 2
# dQ by TMA reduce-add: WG 2 stages DQ_STAGE_COLS fp32 columns (128 bytes: one 128B-swizzled TMA box
# row) of its query row per chunk, in DQ_STAGE_BUFS alternating buffers. Off by default: the
# atomics stay the default build until the reduce has run on hardware (docs/blackwell.md).
DQ_STAGE_COLS = 32
DQ_STAGE_BUFS = 2
DQ_TMA_DEFAULT = False
SUPPORTED_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (128, 64))
DTYPES = ("bf16", "fp16")
NUM_WARPS = 12            # WG0 elementwise, WG1 = MMA warp + load warp + 2 idle, WG2 dQ drain


def _dtype_name(dtype) -> str:
    return _fwd_dtype_name(dtype, "the Blackwell backward")


def _tmem_table(rows, used: int, alloc: int, scope: str) -> str:
    """Markdown table of TMEM column ranges: rows of (buffer, first column, width)."""
    lines = ["| buffer | columns | width |", "|---|---|---|"]
    lines += [f"| {n} | [{o}, {o + w}) | {w} |" for n, o, w in rows]
    lines.append(f"| **total used / allocated{scope}** | | **{used} / {alloc}** of {TMEM_COLUMNS} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class BwdTmemPlan:
    s: int        # S^T (fp32, tile_n cols); P^T (16-bit) in its upper half
    p: int
    ds: int
    dv: int
    dp: int       # dP^T (fp32, tile_n cols); dS^T (16-bit) over its lower half, then dQ over both
    dq: int
    dk: int
    s_cols: int
    p_cols: int   # 16-bit values, two per column
    dv_cols: int
    dp_cols: int
    dk_cols: int
    used: int
    alloc: int

    def table(self) -> str:
        rows = [("S^T (fp32)", self.s, self.s_cols), ("  P^T (16-bit, over S^T)", self.p, self.p_cols),
                ("dV (fp32 acc)", self.dv, self.dv_cols), ("dP^T (fp32)", self.dp, self.dp_cols),
                ("  dS^T (16-bit, over dP^T)", self.ds, self.p_cols),
                ("  dQ (fp32, over dP^T and dS^T)", self.dq, self.dk_cols), ("dK (fp32 acc)", self.dk, self.dk_cols)]
        return _tmem_table(rows, self.used, self.alloc, "")


@dataclass(frozen=True)
class BwdSmemPlan:
    header: int
    num_barriers: int
    k: int
    v: int
    qdo_stages: int
    q: int        # one stage
    do: int       # one stage
    ds: int
    stats: int    # sLSE + sD
    do_stages: int = 0   # the dO ring's stages when it has its own (dq_tma at d = 128); 0: the Q ring's
    dq_stage: int = 0    # sdQ, the dQ staging buffers of the TMA reduce (dq_tma); 0: atomics

    @property
    def dO_stages(self) -> int:
        return self.do_stages or self.qdo_stages

    @property
    def total(self) -> int:
        return (self.header + self.k + self.v + self.qdo_stages * self.q + self.dO_stages * self.do + self.ds
                + self.stats + self.dq_stage)

    def describe(self) -> str:
        if self.dO_stages == self.qdo_stages:
            ring = f"{self.qdo_stages} x (sQ {self.q} + sdO {self.do})"
        else:
            ring = f"{self.qdo_stages} x sQ {self.q} + {self.dO_stages} x sdO {self.do}"
        dq = f" + sdQ {self.dq_stage}" if self.dq_stage else ""
        return (f"header {self.header} + sK {self.k} + sV {self.v} + {ring} "
                f"+ sdS {self.ds} + sLSE/sD {self.stats}{dq} = {self.total} bytes of {SMEM_CAPACITY}")


# WG 2 (dQ drain) of the 1-CTA kernel holds a whole dQ row (d fp32) in registers, so it can hand the
# TMEM columns back to the MMA warp before it issues the atomics: 128 x (240 + 160 + 96) = 63488.
REGS_DQ_1CTA = 160
# WG 0 of a d = 128 softcap build: tanh's scale (and a window's second threshold column) live across
# the P^T row; at 240 ptxas spilled one 64-bit pointer (8 bytes) with a window of (256, 0). 128 x (248 +
# 160 + 96) = 64512 = the launch's 168 x 384, all of it (the 2-CTA plan's total too). Only there: at d = 64
# the same 248 made ptxas spill 4 bytes that 240 does not. Plain builds keep 240.
REGS_ELEMENTWISE_SOFTCAP_D128 = 248


# WG 1 (MMA + load warps) when dO has its own ring (dq_tma at d = 128): ptxas spilled 12 bytes at 96
# (the second ring's barrier addresses and slots); 240 + 160 + 104 = 504 = 3 x 168, the launch's all.
# With softcap there (elementwise 248) WG 2 gives 8 back: 248 + 152 + 104 = 504, no spills either.
REGS_MMA_LOAD_SPLIT_DO = 104


@dataclass(frozen=True)
class BwdRegisterPlan:
    elementwise: int = 240
    dq: int = 96
    other: int = 96
    launch_cap: int = (REGISTERS_PER_SM // (32 * NUM_WARPS)) // 8 * 8

    @property
    def total(self) -> int:
        return 128 * (self.elementwise + self.dq + self.other)


@dataclass(frozen=True)
class BlackwellBwdConfig:
    head_dim: int
    head_dim_v: int
    dtype: str
    causal: bool
    deterministic: bool
    tile_m: int
    tile_n: int
    qdo_stages: int
    tmem: BwdTmemPlan
    smem: BwdSmemPlan
    regs: BwdRegisterPlan
    cta_group: int = 1
    # the score variants (compile-time, as the forward's plan): the window beyond causal
    # (components.window.beyond_causal: causal stays the `causal` flag) and softcap (0 = off)
    window: Window = NO_WINDOW
    softcap: float = 0.0
    # dQ leaves by TMA reduce-add from sdQ (WG 2 stages it) instead of per-row red.global.add.v2.f32
    dq_tma: bool = False
    # the wide plan: CTAs sharing one K/V tile's head dim (each owns 1/head_splits of dK, dV, dQ's columns)
    head_splits: int = 1

    @property
    def split_do(self) -> bool:
        """The dO ring has its own barriers and fewer stages than the Q ring (dq_tma at d = 128)."""
        return getattr(self.smem, "dO_stages", self.qdo_stages) != self.qdo_stages  # 2-CTA plans: one ring

    @property
    def plain(self) -> bool:
        return self.window == NO_WINDOW and self.softcap == 0.0

    @property
    def num_threads(self) -> int:
        return 32 * NUM_WARPS

    def key(self) -> tuple:
        base = (self.head_dim, self.head_dim_v, self.dtype, self.causal, self.deterministic, self.tile_m,
                self.tile_n, self.qdo_stages, self.cta_group)
        # plain builds keep their keys (and any stored compile) unchanged
        if self.dq_tma:
            base += ("dq_tma", self.smem.dO_stages)
        if self.head_splits > 1:
            base += ("head_splits", self.head_splits)
        return base if self.plain else base + ("variant",) + tuple(self.window) + (self.softcap,)

    def summary(self) -> str:
        stages = (f"{self.qdo_stages} Q / {self.smem.dO_stages} dO stages" if self.split_do
                  else f"{self.qdo_stages} Q/dO stages")
        dq = ", dQ by TMA reduce" if self.dq_tma else ""
        dq += f", head dim split over {self.head_splits} CTAs" if self.head_splits > 1 else ""
        variant = "" if self.plain else f", window {tuple(self.window)}, softcap {self.softcap:g}"
        return (f"Blackwell bwd {self.dtype} d={self.head_dim}/{self.head_dim_v} causal={self.causal} "
                f"deterministic={self.deterministic}: {self.cta_group}-CTA, tiles {self.tile_m} x {self.tile_n}, "
                f"TMEM {self.tmem.used}/{self.tmem.alloc} cols, SMEM {self.smem.total} B ({stages})" + dq + variant)


def mask_col_min(key, key_limit, diag, tile_m: int, causal: bool, *, imax=max,
                 select=lambda c, a, b: a if c else b, window=None):
    """The elementwise warpgroup's mask, hoisted: thread `key` (a local key row of the S^T tile)
    masks the query columns c < mask_col_min(...) (and, a left edge, c > mask_col_max(...)).
    Equivalent to schedule.is_masked(key, c, key_limit, diag, causal, window) for every c in
    [0, tile_m) (cpu-tested), but one compare per element against a constant column per edge.
    window: the kernel's banded Window (causal's right edge included), or None (causal decides).
    Works on ints and on DSL values."""
    col_min = select(key >= key_limit, tile_m, 0)
    right = (0 if causal else None) if window is None else window.right
    if right is not None:
        # key <= c + diag + right  <=>  c >= key - diag - right
        first = key - diag
        if right:
            first = first - right
        col_min = imax(col_min, first)
    return col_min


def mask_col_max(key, diag, window):
    """The last query column thread `key` sees under a left edge (key >= c + diag - left <=> c <=
    key - diag + left); None without one (the caller then emits no second compare)."""
    if window is None or window.left is None:
        return None
    return key - diag + window.left


def num_barriers(stages: int, do_stages: int = 0) -> int:
    # kv_full; qdo_full / qdo_empty per stage; s_full, dp_full, p_full, ds_full, dq_full,
    # dq_empty, dkv_full, tmem_dealloc; do_full / do_empty per dO stage when dO has its own ring
    return 1 + 2 * stages + 8 + 2 * do_stages


def _tmem_plan(tile_m, tile_n, d, dv) -> BwdTmemPlan:
    p_cols = tile_m // 2
    s, dv_off = 0, tile_n
    dp = dv_off + dv
    dk = dp + tile_n
    used = dk + d
    return BwdTmemPlan(s=s, p=s + tile_n - p_cols, ds=dp, dv=dv_off, dp=dp, dq=dp, dk=dk, s_cols=tile_m,
                       p_cols=p_cols, dv_cols=dv, dp_cols=tile_m, dk_cols=d, used=used,
                       alloc=max(TMEM_MIN_ALLOC, _pow2_at_least(used)))


def _smem_plan(tile_m, tile_n, d, dv, stages, elem=2, *, do_stages=0, dq_tma=False) -> BwdSmemPlan:
    """do_stages: the dO ring's own stage count (0: dO shares the Q ring's stages and barriers)."""
    do_stages = 0 if do_stages == stages else do_stages
    nbar = num_barriers(stages, do_stages)
    return BwdSmemPlan(header=_round_up(8 * nbar + 4, HEADER_ALIGN), num_barriers=nbar, k=tile_n * d * elem,
                       v=tile_n * dv * elem, qdo_stages=stages, q=tile_m * d * elem, do=tile_m * dv * elem,
                       ds=tile_m * tile_n * elem, stats=2 * tile_m * 4, do_stages=do_stages,
                       dq_stage=DQ_STAGE_BUFS * tile_m * DQ_STAGE_COLS * 4 if dq_tma else 0)


def _variants(causal, window_size, softcap) -> tuple:
    """(Window beyond causal, softcap), checked as the Hopper backward's host and the Blackwell
    forward's plan check them: TypeError / ValueError naming window_size or softcap."""
    return beyond_causal(bool(causal), window_size), check_softcap(softcap)


def _check_head_dims(head_dim, head_dim_v):
    for name, v in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if not (isinstance(v, int) and 16 <= v <= 256 and v % 16 == 0):
            raise ValueError(f"{name}: expected a multiple of 16 in [16, 256], got {v!r}")


def _common_args(head_dim, head_dim_v, dtype, causal, window_size, softcap) -> tuple:
    """(window, softcap, head_dim_v, dtype name), each checked: the variants first, then the head dims."""
    window, softcap = _variants(causal, window_size, softcap)
    dv = head_dim if head_dim_v is None else head_dim_v
    dt = _dtype_name(dtype)
    _check_head_dims(head_dim, dv)
    return window, softcap, dv, dt


def _dq_tma(dq_tma, deterministic, head_dim) -> bool:
    """Whether dQ leaves by TMA reduce-add; ValueError for what the kernel keeps on atomics."""
    if dq_tma is None:
        return DQ_TMA_DEFAULT and not deterministic
    if dq_tma and deterministic:
        raise ValueError("dq_tma: the deterministic backward keeps its semaphore-ordered atomics (the reduce's "
                         "global writes would need a wait_group, not .read, before each semaphore release)")
    if dq_tma and head_dim % DQ_STAGE_COLS:
        raise ValueError(f"dq_tma: head_dim must be a multiple of {DQ_STAGE_COLS} (one TMA box of "
                         f"{DQ_STAGE_COLS} fp32 columns per chunk), got {head_dim}")
    return bool(dq_tma)


def _stages(tile_m, tile_n, d, dv, qdo_stages, do_stages, dq_tma) -> tuple:
    """(Q ring stages, dO ring stages): given ones are checked, missing ones are the most that fit in
    SMEM -- 2 and 2, else (dq_tma: the staging buffers) 2 and 1, else 1 and 1."""
    for name, v in (("qdo_stages", qdo_stages), ("do_stages", do_stages)):
        if v is not None and not (isinstance(v, int) and v >= 1):
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    choices = [(2, 2), (2, 1), (1, 1)] if dq_tma else [(2, 2), (1, 1)]
    choices = [(q, o) for q, o in choices if qdo_stages in (None, q) and do_stages in (None, o)]
    for q, o in choices:
        if _smem_plan(tile_m, tile_n, d, dv, q, do_stages=o, dq_tma=dq_tma).total <= SMEM_CAPACITY:
            return q, o
    q = qdo_stages or do_stages or 1   # nothing fits: the given (or smallest) stages, refused by the caller
    o = do_stages or q
    if o > q:
        raise ValueError(f"do_stages: at most qdo_stages ({q}), got {o}")
    return q, o


def blackwell_bwd_config(head_dim: int, head_dim_v: int | None, dtype, *, causal: bool, deterministic: bool = False,
                         tile_m: int = 128, tile_n: int = 128, qdo_stages: int | None = None,
                         cta_group: int = 1, check_kernel_support: bool = True, window_size=(None, None),
                         softcap: float = 0.0, dq_tma: bool | None = None,
                         do_stages: int | None = None) -> BlackwellBwdConfig:
    """Plan one 1-CTA backward configuration; raise ValueError naming the budget (TMEM, SMEM,
    registers) that fails, then (unless check_kernel_support=False) what the kernel implements.
    dq_tma: dQ by TMA reduce-add from SMEM (None: DQ_TMA_DEFAULT, never for deterministic builds,
    which keep the semaphore-ordered atomics); do_stages: the dO ring's stages (None: the most that
    fit, at most qdo_stages; fewer than qdo_stages gives dO its own barriers).
    window_size (left, right; None or -1 unlimited, causal is right = 0) and softcap (>= 0, 0 = off):
    compile-time variants, checked first (TypeError / ValueError naming the argument)."""
    window, softcap, dv, dt = _common_args(head_dim, head_dim_v, dtype, causal, window_size, softcap)
    if cta_group != 1:
        raise ValueError(f"cta_group: this is the 1-CTA plan; the 2-CTA kernel (cluster of 2) is planned by "
                         f"blackwell_bwd_2cta_config(), got cta_group={cta_group!r}")
    if tile_m != 128 or tile_n != 128:
        raise ValueError(f"tile_m, tile_n: the 1-CTA backward uses 128 x 128 tiles (M = 128 tcgen05 MMAs, "
                         f"one TMEM lane per row), got {tile_m} x {tile_n}")
    if max(head_dim, dv) > tile_n:
        # dQ (d columns) is written over dP^T (tile_n columns)
        tmem = _tmem_plan(tile_m, tile_n, head_dim, dv)
        raise ValueError(f"TMEM does not fit: S {tile_m} + dV {dv} + dP/dQ {max(tile_m, head_dim)} + dK {head_dim} "
                         f"= {tmem.used - tile_m + max(tile_m, head_dim)} columns > {TMEM_COLUMNS} "
                         f"(head_dim={head_dim}, head_dim_v={dv}); needs the 2-CTA kernel (dK/dV split across "
                         f"the pair) or a split head dim")
    tmem = _tmem_plan(tile_m, tile_n, head_dim, dv)
    if tmem.used > TMEM_COLUMNS:
        raise ValueError(f"TMEM does not fit: {tmem.used} columns > {TMEM_COLUMNS}")

    dq_tma = _dq_tma(dq_tma, deterministic, head_dim)
    qdo_stages, do_stages = _stages(tile_m, tile_n, head_dim, dv, qdo_stages, do_stages, dq_tma)
    smem = _smem_plan(tile_m, tile_n, head_dim, dv, qdo_stages, do_stages=do_stages, dq_tma=dq_tma)
    if smem.total > SMEM_CAPACITY:
        raise ValueError(f"SMEM does not fit: {smem.describe()}")

    split_do = dq_tma and do_stages != qdo_stages
    regs = BwdRegisterPlan(dq=REGS_DQ_1CTA, other=REGS_MMA_LOAD_SPLIT_DO if split_do else 96)
    if softcap and max(head_dim, dv) > 96:
        regs = BwdRegisterPlan(elementwise=REGS_ELEMENTWISE_SOFTCAP_D128, dq=REGS_DQ_1CTA - 8 * split_do,
                               other=regs.other)
    for name in ("elementwise", "dq", "other"):
        r = getattr(regs, name)
        if r % 8 or not 24 <= r <= 256:
            raise ValueError(f"registers: {name} = {r} is not a setmaxnreg value")
    if regs.total > REGISTERS_PER_SM:
        raise ValueError(f"registers do not fit: {regs.total} > {REGISTERS_PER_SM}")
    cfg = BlackwellBwdConfig(head_dim=head_dim, head_dim_v=dv, dtype=dt, causal=bool(causal),
                             deterministic=bool(deterministic), tile_m=tile_m, tile_n=tile_n, qdo_stages=qdo_stages,
                             tmem=tmem, smem=smem, regs=regs, window=window, softcap=softcap, dq_tma=dq_tma)
    if check_kernel_support and (head_dim, dv) not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the configuration fits TMEM/SMEM/registers, but blackwell_bwd.py supports only head dims "
                         f"{SUPPORTED_HEAD_DIMS}, got ({head_dim}, {dv})")
    if check_kernel_support and qdo_stages > MAX_QDO_STAGES:
        raise ValueError(f"qdo_stages: blackwell_bwd.py uses at most {MAX_QDO_STAGES}, got {qdo_stages}")
    return cfg




# ------------------------------------------------------------------------------------------------
# The wide 1-CTA kernel (blackwell_bwd_wide.py): head dims (192, 128) and 256
# ------------------------------------------------------------------------------------------------
# At d = 192 the 1-CTA plan needs S 128 + dV 128 + dP/dQ 192 + dK 192 = 640 columns. This plan halves
# the Q tile to tile_m = 64 queries (S^T and dP^T take 64 columns each, P^T / dS^T 32) and computes
# dQ transposed, dQ^T = K^T dS^T: M = 128 head-dim rows (lane = head-dim column of dQ), N = 64 queries.
# A head-dim width that is not a multiple of 128 is covered by 128-row windows that overlap (192: rows
# [0, 128) and [64, 192); the drain keeps each row once). The dQ^T windows lie over S^T and dP^T, so
# the schedule is serial: S(j + 1) waits until WG 2 has drained dQ^T(j). (At 256 the one window fits after
# dP^T: there only the next dQ^T waits for the drain.)
# At d = 256, dK and dV alone take 512 columns, so a pair of CTAs splits the head dim: CTA h of the pair
# (blockIdx.x % 2) accumulates dK, dV and dQ for columns [128h, 128h + 128) and recomputes S^T and dP^T
# (the reductions over the whole head dim) -- 1.4x the MMA work of an unsplit tile, the price of fitting.
#
#     (192, 128):  dV 128 + dK 192 + S^T 64 + dP^T 64 = 448 -> 512;  dQ^T 2 x 64 over S^T, dP^T
#     256 / 2:     dV 128 + dK 128 + S^T 64 + dP^T 64 + dQ^T 1 x 64 = 448 -> 512
#
# SMEM (tile_m = 64): header + sK + sV + stages x (sQ + sdO) + sdS (64 x 128) + sLSE/sD
#     (192, 128): 1024 + 49152 + 32768 + 2 x (24576 + 16384) + 16384 + 512 = 181760   (2 stages)
#     256:        1024 + 65536 + 65536 + 1 x (32768 + 32768) + 16384 + 512 = 214528   (2 stages do not fit)
WIDE_TILE_M = 64
# setmaxnreg per warpgroup (elementwise, dQ drain, MMA + load), found by compiling every build for no spills
# (each sums to 504 = 3 x 168, the launch's all). (192, 128): WG 2 holds two 64-query dQ^T windows (128
# fp32) to hand the columns back before its atomics, and ptxas computes the 64 row addresses of a window
# ahead -- at 160 / 168 it spilled 84-560 bytes, at 200 none; a 64-query P^T row leaves WG 0 enough at 208.
# 256: one window, but the MMA warp keeps the descriptors of S and dP's 16 K-steps each -- at 96 it spilled.
REGS_WIDE = {(192, 128): BwdRegisterPlan(elementwise=208, dq=200, other=96),
             (256, 256): BwdRegisterPlan(elementwise=240, dq=136, other=128)}
DQT_WINDOW = 128              # M of the dQ^T MMA: head-dim rows per window
SUPPORTED_HEAD_DIMS_WIDE = ((192, 128), (256, 256))


@dataclass(frozen=True)
class BwdWideTmemPlan:
    dv: int
    dk: int
    s: int
    p: int        # P^T (16-bit) in the upper half of S^T's columns
    dp: int
    ds: int       # dS^T (16-bit) over the lower half of dP^T's columns
    dq: int       # the dQ^T windows, tile_m columns each, from here on (over S^T / dP^T, or after them)
    dv_cols: int
    dk_cols: int
    s_cols: int
    p_cols: int
    dp_cols: int
    dq_cols: int  # all windows together
    dq_windows: tuple   # first head-dim row (within this CTA's columns) of each 128-row window
    used: int
    alloc: int

    @property
    def dq_over_scores(self) -> bool:
        """The dQ^T windows share columns with S^T / dP^T: the next S^T waits until they are drained."""
        return self.dq < self.dp + self.dp_cols

    def table(self) -> str:
        rows = [("dV (fp32 acc)", self.dv, self.dv_cols), ("dK (fp32 acc)", self.dk, self.dk_cols),
                ("S^T (fp32)", self.s, self.s_cols), ("  P^T (16-bit, over S^T)", self.p, self.p_cols),
                ("dP^T (fp32)", self.dp, self.dp_cols), ("  dS^T (16-bit, over dP^T)", self.ds, self.p_cols),
                (f"dQ^T (fp32, {len(self.dq_windows)} window(s)" + (", over S^T / dP^T)" if self.dq_over_scores
                                                                     else ")"), self.dq, self.dq_cols)]
        return _tmem_table(rows, self.used, self.alloc, " per CTA")


def dq_windows(cols: int) -> tuple:
    """First rows of the 128-row dQ^T windows covering `cols` head-dim rows (the last one overlaps)."""
    if cols < DQT_WINDOW:
        raise ValueError(f"head_dim: the dQ^T windows need at least {DQT_WINDOW} columns per CTA, got {cols}")
    n = -(-cols // DQT_WINDOW)
    return tuple(min(DQT_WINDOW * w, cols - DQT_WINDOW) for w in range(n))


def _tmem_plan_wide(tile_m, dk_cols, dv_cols) -> BwdWideTmemPlan:
    """The dQ^T windows get columns of their own after dP^T where they fit (256: the next S^T then need
    not wait for the drain), else they lie over S^T and dP^T ((192, 128))."""
    s = dv_cols + dk_cols
    dp = s + tile_m
    windows = dq_windows(dk_cols)
    dq = dp + tile_m if dp + tile_m + tile_m * len(windows) <= TMEM_COLUMNS else s
    used = max(dp + tile_m, dq + tile_m * len(windows))
    return BwdWideTmemPlan(dv=0, dk=dv_cols, s=s, p=s + tile_m // 2, dp=dp, ds=dp, dq=dq, dv_cols=dv_cols,
                           dk_cols=dk_cols, s_cols=tile_m, p_cols=tile_m // 2, dp_cols=tile_m,
                           dq_cols=tile_m * len(windows), dq_windows=windows, used=used,
                           alloc=max(TMEM_MIN_ALLOC, _pow2_at_least(used)))


def head_splits(head_dim: int, head_dim_v: int, tile_m: int = WIDE_TILE_M) -> int:
    """CTAs that share one K/V tile's head dim (1 or 2): the fewest whose dK + dV + S^T + dP^T fit TMEM."""
    for splits in (1, 2):
        if head_dim % splits or head_dim_v % splits:
            continue
        if head_dim_v // splits + head_dim // splits + 2 * tile_m <= TMEM_COLUMNS:
            return splits
    raise ValueError(f"TMEM does not fit: dK {head_dim} + dV {head_dim_v} + S^T / dP^T {2 * tile_m} columns even "
                     f"split across 2 CTAs (head_dim={head_dim}, head_dim_v={head_dim_v})")


def blackwell_bwd_wide_config(head_dim: int, head_dim_v: int | None, dtype, *, causal: bool,
                              deterministic: bool = False, qdo_stages: int | None = None,
                              check_kernel_support: bool = True, window_size=(None, None),
                              softcap: float = 0.0, dq_tma: bool | None = None) -> BlackwellBwdConfig:
    """Plan the wide 1-CTA backward (tile_m = 64, dQ^T windows, serial schedule; a head-dim split
    across 2 CTAs where dK + dV alone fill TMEM). ValueError names the budget or argument that fails."""
    window, softcap, dv, dt = _common_args(head_dim, head_dim_v, dtype, causal, window_size, softcap)
    if dq_tma:
        raise ValueError("dq_tma: the wide Blackwell backward adds dQ^T with coalesced per-column atomics "
                         "(no SMEM is left for the staging buffers at d = 256)")
    tile_m, tile_n = WIDE_TILE_M, 128
    splits = head_splits(head_dim, dv, tile_m)
    tmem = _tmem_plan_wide(tile_m, head_dim // splits, dv // splits)
    if tmem.used > TMEM_COLUMNS:
        raise ValueError(f"TMEM does not fit: {tmem.used} columns > {TMEM_COLUMNS}")
    stages, _ = _stages(tile_m, tile_n, head_dim, dv, qdo_stages, None, False)
    smem = _smem_plan(tile_m, tile_n, head_dim, dv, stages)
    if smem.total > SMEM_CAPACITY:
        raise ValueError(f"SMEM does not fit: {smem.describe()}")
    if splits > 1 and stages > 1:
        raise ValueError(f"qdo_stages: the head-dim split reads Q / dO halves of a 1-stage ring, got {stages}")
    regs = REGS_WIDE.get((head_dim, dv), BwdRegisterPlan(dq=REGS_DQ_1CTA))
    cfg = BlackwellBwdConfig(head_dim=head_dim, head_dim_v=dv, dtype=dt, causal=bool(causal),
                             deterministic=bool(deterministic), tile_m=tile_m, tile_n=tile_n, qdo_stages=stages,
                             tmem=tmem, smem=smem, regs=regs, window=window, softcap=softcap, head_splits=splits)
    if check_kernel_support and (head_dim, dv) not in SUPPORTED_HEAD_DIMS_WIDE:
        raise ValueError(f"the configuration fits TMEM/SMEM/registers, but blackwell_bwd_wide.py supports only head "
                         f"dims {SUPPORTED_HEAD_DIMS_WIDE}, got ({head_dim}, {dv})")
    return cfg


# ------------------------------------------------------------------------------------------------
# The 2-CTA kernel (blackwell_bwd_2cta.py): a cluster of 2 CTAs, M = 256 tcgen05 MMAs
# ------------------------------------------------------------------------------------------------
# Per CTA of the pair (rank c = 0, 1; the pair owns 2 x tile_n = 256 keys, CTA c keys [128c, 128c+128)):
#
# TMEM, 32-bit columns. The pair MMAs keep each CTA's accumulator slice in its own TMEM (lane r = its
# key r), so S/P, dV, dP/dS and dK are as wide as in the 1-CTA plan. What moves is dQ: its MMA has
# M = 128 query rows over the pair (64 per CTA) and lands in 128 lanes x d/2 columns (lane l: query
# row l % 64, head-dim half l // 64 -- the DSL's C layout for cta_group::2, M = 128, checked at trace
# time). Because dP of tile j is issued before dQ of tile j-1 (the paper's reordering), dQ cannot sit
# over dP^T as in the 1-CTA plan; it shares the S/P region with P^T instead:
#
#     S/P/dQ   [0, 128)            S^T (fp32); P^T (16-bit) in [0, 64); dQ (fp32) in [64, 64 + d/2)
#     dV       [128, 128 + dv)
#     dP/dS    tile_m columns      dP^T (fp32); dS^T (16-bit) written in place over its first half
#     dK       d columns
#     d = 64: 384 -> 512 allocated;  d = 128: 512 (all of TMEM)
#
# SMEM, bytes. Every MMA splits its B operand by N across the pair, and N is a different dimension
# for different MMAs (queries for S^T and dP^T, head dim for dK, dV and dQ), so each CTA stages four
# B halves per Q tile -- sQ (64 queries x d), sdO (64 x dv), sQt (128 queries x d/2), sdOt (128 x dv/2)
# -- and a second copy of K, sKt (256 keys x d/2), for dQ. The 1-CTA trick of reading one tile
# transposed no longer applies, but each MMA now reads only half of its B operand from SMEM.
#
#     header + sK + sV + sKt + stages x (sQ + sdO + sQt + sdOt) + sdS + sXchg + sLSE/sD
#     sdS     64 query rows x 256 keys x 2 = 32768 (A operand of dQ: the pair's full 2N reduction)
#     sXchg   64 x 128 x 2 = 16384 (the peer's half of this CTA's dS, staged for the DSMEM bulk copy)
#     d = 64:   1024 + 3 x 16384 + 1 x 32768 + 32768 + 16384 + 1024 = 133120   (2 stages: 165888)
#     d = 128:  1024 + 3 x 32768 + 1 x 65536 + 32768 + 16384 + 1024 = 215040   (2 stages do not fit)
NUM_BARRIERS_2CTA_FIXED = 13   # kv_full s_full dp_full p_full dst_full ds_full dq_full dq_empty dkv_full
#                                xchg_full xchg_peer tmem_dealloc + the allocator's 2-CTA dealloc barrier
SUPPORTED_HEAD_DIMS_2CTA = ((64, 64), (128, 128))
P_COLS_2CTA = 64               # P^T (16-bit) of a 128-query tile: 128 / 2 columns
# WG 1 (MMA + load warps): ptxas keeps the SMEM descriptors of all 48 pair-MMA K-steps in registers
# across the tile loop; at 96 registers the causal builds spilled.
REGS_MMA_LOAD_2CTA = 128
# WG 2 holds its d/2 dQ values to release the TMEM columns before the atomics: 240 + 136 + 128 = 3 x 168.
REGS_DQ_2CTA = 136


@dataclass(frozen=True)
class Bwd2CtaTmemPlan:
    s: int        # S^T (fp32, tile_m cols)
    p: int        # P^T (16-bit) at the start of the S region
    dq: int       # dQ (fp32, 128 lanes x d/2) after P^T, inside the S region
    dv: int
    dp: int       # dP^T (fp32); dS^T (16-bit) in place over its first half
    ds: int
    dk: int
    s_cols: int
    p_cols: int
    dq_cols: int
    dv_cols: int
    dp_cols: int
    dk_cols: int
    used: int
    alloc: int

    def table(self) -> str:
        rows = [("S^T (fp32)", self.s, self.s_cols), ("  P^T (16-bit, over S^T)", self.p, self.p_cols),
                ("  dQ (fp32, 64 rows as 128 lanes x d/2, over S^T)", self.dq, self.dq_cols),
                ("dV (fp32 acc)", self.dv, self.dv_cols), ("dP^T (fp32)", self.dp, self.dp_cols),
                ("  dS^T (16-bit, over dP^T)", self.ds, self.p_cols), ("dK (fp32 acc)", self.dk, self.dk_cols)]
        return _tmem_table(rows, self.used, self.alloc, " per CTA")


@dataclass(frozen=True)
class Bwd2CtaSmemPlan:
    header: int
    num_barriers: int
    k: int        # this CTA's 128 keys x d (A of S^T)
    v: int
    kt: int       # the pair's 256 keys x d/2 (B of dQ)
    qdo_stages: int
    q: int        # 64 queries x d (B half of S^T), one stage
    do: int       # 64 x dv (B half of dP^T)
    qt: int       # 128 queries x d/2 (B half of dK)
    dot: int      # 128 x dv/2 (B half of dV)
    ds: int       # 64 queries x 256 keys (A of dQ)
    xchg: int     # 64 x 128: the peer's rows of this CTA's dS, staged for the bulk copy
    stats: int

    @property
    def total(self) -> int:
        return (self.header + self.k + self.v + self.kt + self.qdo_stages * (self.q + self.do + self.qt + self.dot)
                + self.ds + self.xchg + self.stats)

    def describe(self) -> str:
        return (f"header {self.header} + sK {self.k} + sV {self.v} + sKt {self.kt} + {self.qdo_stages} x (sQ {self.q} "
                f"+ sdO {self.do} + sQt {self.qt} + sdOt {self.dot}) + sdS {self.ds} + sXchg {self.xchg} "
                f"+ sLSE/sD {self.stats} = {self.total} bytes of {SMEM_CAPACITY} per CTA")


def num_barriers_2cta(stages: int) -> int:
    # fixed ones + full / empty for each of the four B halves per stage
    return NUM_BARRIERS_2CTA_FIXED + 8 * stages


def _tmem_plan_2cta(tile_m, tile_n, d, dv) -> Bwd2CtaTmemPlan:
    s, p = 0, 0
    dq = P_COLS_2CTA
    dv_off = tile_n
    dp = dv_off + dv
    dk = dp + tile_m
    used = dk + d
    return Bwd2CtaTmemPlan(s=s, p=p, dq=dq, dv=dv_off, dp=dp, ds=dp, dk=dk, s_cols=tile_m, p_cols=tile_m // 2,
                           dq_cols=d // 2, dv_cols=dv, dp_cols=tile_m, dk_cols=d, used=used,
                           alloc=max(TMEM_MIN_ALLOC, _pow2_at_least(used)))


def _smem_plan_2cta(tile_m, tile_n, d, dv, stages, elem=2) -> Bwd2CtaSmemPlan:
    nbar = num_barriers_2cta(stages)
    half_m = tile_m // 2
    return Bwd2CtaSmemPlan(header=_round_up(8 * nbar + 4, HEADER_ALIGN), num_barriers=nbar, k=tile_n * d * elem,
                           v=tile_n * dv * elem, kt=2 * tile_n * (d // 2) * elem, qdo_stages=stages,
                           q=half_m * d * elem, do=half_m * dv * elem, qt=tile_m * (d // 2) * elem,
                           dot=tile_m * (dv // 2) * elem, ds=half_m * 2 * tile_n * elem, xchg=half_m * tile_n * elem,
                           stats=2 * tile_m * 4)


def blackwell_bwd_2cta_config(head_dim: int, head_dim_v: int | None, dtype, *, causal: bool,
                              deterministic: bool = False, qdo_stages: int | None = None,
                              check_kernel_support: bool = True, window_size=(None, None),
                              softcap: float = 0.0) -> BlackwellBwdConfig:
    """Plan one 2-CTA backward configuration (per CTA of the pair; tiles 128 x 128 per CTA, M = 256
    MMAs over the pair). ValueError names the budget that fails (TMEM, SMEM, registers);
    window_size / softcap are checked, and refused: only the 1-CTA kernel has them."""
    window, softcap = _variants(causal, window_size, softcap)
    for name, off in (("window_size", window == NO_WINDOW), ("softcap", softcap == 0.0)):
        if not off:
            raise ValueError(f"{name}: not implemented in the 2-CTA Blackwell backward (blackwell_bwd_2cta.py); "
                             f"the 1-CTA one (blackwell_bwd.py) has it")
    dv = head_dim if head_dim_v is None else head_dim_v
    dt = _dtype_name(dtype)
    tile_m = tile_n = 128
    _check_head_dims(head_dim, dv)
    tmem = _tmem_plan_2cta(tile_m, tile_n, head_dim, dv)
    if tmem.used > TMEM_COLUMNS:
        raise ValueError(f"TMEM does not fit: S/P/dQ {tile_m} + dV {dv} + dP/dS {tile_m} + dK {head_dim} = "
                         f"{tmem.used} columns > {TMEM_COLUMNS} per CTA (head_dim={head_dim}, head_dim_v={dv}); "
                         f"the pair splits M, not the dK/dV accumulators")
    if P_COLS_2CTA + head_dim // 2 > tile_m:
        raise ValueError(f"TMEM does not fit: dQ ({head_dim // 2} columns) after P^T ({P_COLS_2CTA}) overflows the "
                         f"{tile_m}-column S region")

    def fits(st):
        return _smem_plan_2cta(tile_m, tile_n, head_dim, dv, st).total <= SMEM_CAPACITY
    if qdo_stages is None:
        qdo_stages = 2 if fits(2) else 1
    if not (isinstance(qdo_stages, int) and qdo_stages >= 1):
        raise ValueError(f"qdo_stages: expected an int >= 1, got {qdo_stages!r}")
    smem = _smem_plan_2cta(tile_m, tile_n, head_dim, dv, qdo_stages)
    if smem.total > SMEM_CAPACITY:
        raise ValueError(f"SMEM does not fit: {smem.describe()}")
    regs = BwdRegisterPlan(dq=REGS_DQ_2CTA, other=REGS_MMA_LOAD_2CTA)
    if regs.total > REGISTERS_PER_SM:
        raise ValueError(f"registers do not fit: {regs.total} > {REGISTERS_PER_SM}")
    cfg = BlackwellBwdConfig(head_dim=head_dim, head_dim_v=dv, dtype=dt, causal=bool(causal),
                             deterministic=bool(deterministic), tile_m=tile_m, tile_n=tile_n, qdo_stages=qdo_stages,
                             tmem=tmem, smem=smem, regs=regs, cta_group=2)
    if check_kernel_support and (head_dim, dv) not in SUPPORTED_HEAD_DIMS_2CTA:
        raise ValueError(f"the configuration fits TMEM/SMEM/registers, but blackwell_bwd_2cta.py supports only head "
                         f"dims {SUPPORTED_HEAD_DIMS_2CTA}, got ({head_dim}, {dv})")
    if check_kernel_support and qdo_stages > MAX_QDO_STAGES:
        raise ValueError(f"qdo_stages: blackwell_bwd_2cta.py uses at most {MAX_QDO_STAGES}, got {qdo_stages}")
    return cfg

if __name__ == "__main__":
    for d, dv in SUPPORTED_HEAD_DIMS:
        c = blackwell_bwd_config(d, dv, "bf16", causal=False)
        print(c.summary())
        print("  SMEM:", c.smem.describe())
        print(c.tmem.table())
        c2 = blackwell_bwd_2cta_config(d, dv, "bf16", causal=False)
        print(c2.summary())
        print("  SMEM:", c2.smem.describe())
        print(c2.tmem.table())
