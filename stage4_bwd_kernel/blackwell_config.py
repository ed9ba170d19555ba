"""Stage 4, Blackwell: the host-side plan of the 1-CTA backward kernel -- tiles, TMEM, SMEM, registers.

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
                   (16-bit, 2 per column) goes to its upper half and dS^T (16-bit) to its lower half
    dV             dv columns (fp32 accumulator, for the whole walk)
    dP/dS/dQ       tile_n columns: dP^T (fp32); once dS is computed from it, dQ = dS K (d <= tile_n
                   columns) is written over it. The next dP^T waits until dQ has been drained.
    dK             d columns (fp32 accumulator)

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

Registers: 12 warps = 384 threads (launch cap 65536 / 384 = 170 -> 168); setmaxnreg gives the
elementwise warpgroup 240 (a whole 128-value row of P stays in registers while dP^T is read in
32-column chunks), the dQ warpgroup and the MMA/load warpgroup 96 each: 128 x (240 + 96 + 96) = 55296.
"""
from __future__ import annotations

from dataclasses import dataclass

# the forward's plan helpers (plain Python, no cutlass import)
from stage3_fwd_kernel.blackwell_config import _dtype_name as _fwd_dtype_name
from stage3_fwd_kernel.blackwell_config import _pow2_at_least, _round_up

__all__ = ["SMEM_CAPACITY", "TMEM_COLUMNS", "SUPPORTED_HEAD_DIMS", "mask_col_min", "BwdTmemPlan", "BwdSmemPlan",
           "BwdRegisterPlan", "BlackwellBwdConfig", "blackwell_bwd_config"]

SMEM_CAPACITY = 232448
TMEM_COLUMNS = 512
TMEM_MIN_ALLOC = 32
REGISTERS_PER_SM = 65536
HEADER_ALIGN = 1024
MAX_QDO_STAGES = 2
SUPPORTED_HEAD_DIMS = ((64, 64), (128, 128))
DTYPES = ("bf16", "fp16")
NUM_WARPS = 12            # WG0 elementwise, WG1 = MMA warp + load warp + 2 idle, WG2 dQ drain


def _dtype_name(dtype) -> str:
    return _fwd_dtype_name(dtype, "the Blackwell backward")


@dataclass(frozen=True)
class BwdTmemPlan:
    s: int        # S^T (fp32, tile_n cols); P^T in its upper half, dS^T in its lower half
    p: int
    ds: int
    dv: int
    dp: int       # dP^T (fp32, tile_n cols); dQ is written over it
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
        rows = [("S^T (fp32)", self.s, self.s_cols), ("  dS^T (16-bit, over S^T)", self.ds, self.p_cols),
                ("  P^T (16-bit, over S^T)", self.p, self.p_cols), ("dV (fp32 acc)", self.dv, self.dv_cols),
                ("dP^T (fp32)", self.dp, self.dp_cols), ("  dQ (fp32, over dP^T)", self.dq, self.dk_cols),
                ("dK (fp32 acc)", self.dk, self.dk_cols)]
        lines = ["| buffer | columns | width |", "|---|---|---|"]
        lines += [f"| {n} | [{o}, {o + w}) | {w} |" for n, o, w in rows]
        lines.append(f"| **total used / allocated** | | **{self.used} / {self.alloc}** of {TMEM_COLUMNS} |")
        return "\n".join(lines)


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

    @property
    def total(self) -> int:
        return self.header + self.k + self.v + self.qdo_stages * (self.q + self.do) + self.ds + self.stats

    def describe(self) -> str:
        return (f"header {self.header} + sK {self.k} + sV {self.v} + {self.qdo_stages} x (sQ {self.q} + sdO {self.do}) "
                f"+ sdS {self.ds} + sLSE/sD {self.stats} = {self.total} bytes of {SMEM_CAPACITY}")


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

    @property
    def num_threads(self) -> int:
        return 32 * NUM_WARPS

    def key(self) -> tuple:
        return (self.head_dim, self.head_dim_v, self.dtype, self.causal, self.deterministic, self.tile_m,
                self.tile_n, self.qdo_stages, self.cta_group)

    def summary(self) -> str:
        return (f"Blackwell bwd {self.dtype} d={self.head_dim}/{self.head_dim_v} causal={self.causal} "
                f"deterministic={self.deterministic}: {self.cta_group}-CTA, tiles {self.tile_m} x {self.tile_n}, "
                f"TMEM {self.tmem.used}/{self.tmem.alloc} cols, SMEM {self.smem.total} B ({self.qdo_stages} Q/dO stages)")


def mask_col_min(key, key_limit, diag, tile_m: int, causal: bool, *, imax=max,
                 select=lambda c, a, b: a if c else b):
    """The elementwise warpgroup's mask, hoisted: thread `key` (a local key row of the S^T tile)
    masks exactly the query columns c < mask_col_min(...). Equivalent to
    schedule.is_masked(key, c, key_limit, diag, causal) for every c in [0, tile_m) (cpu-tested),
    but one compare per element against a constant column. Works on ints and on DSL values."""
    col_min = select(key >= key_limit, tile_m, 0)
    if causal:
        col_min = imax(col_min, key - diag)
    return col_min


def num_barriers(stages: int) -> int:
    # kv_full; qdo_full / qdo_empty per stage; s_full, dp_full, p_full, ds_full, dq_full,
    # dq_empty, dkv_full, tmem_dealloc
    return 1 + 2 * stages + 8


def _tmem_plan(tile_m, tile_n, d, dv) -> BwdTmemPlan:
    p_cols = tile_m // 2
    s, dv_off = 0, tile_n
    dp = dv_off + dv
    dk = dp + tile_n
    used = dk + d
    return BwdTmemPlan(s=s, p=s + tile_n - p_cols, ds=s, dv=dv_off, dp=dp, dq=dp, dk=dk, s_cols=tile_m,
                       p_cols=p_cols, dv_cols=dv, dp_cols=tile_m, dk_cols=d, used=used,
                       alloc=max(TMEM_MIN_ALLOC, _pow2_at_least(used)))


def _smem_plan(tile_m, tile_n, d, dv, stages, elem=2) -> BwdSmemPlan:
    nbar = num_barriers(stages)
    return BwdSmemPlan(header=_round_up(8 * nbar + 4, HEADER_ALIGN), num_barriers=nbar, k=tile_n * d * elem,
                       v=tile_n * dv * elem, qdo_stages=stages, q=tile_m * d * elem, do=tile_m * dv * elem,
                       ds=tile_m * tile_n * elem, stats=2 * tile_m * 4)


def blackwell_bwd_config(head_dim: int, head_dim_v: int | None, dtype, *, causal: bool, deterministic: bool = False,
                         tile_m: int = 128, tile_n: int = 128, qdo_stages: int | None = None,
                         cta_group: int = 1, check_kernel_support: bool = True) -> BlackwellBwdConfig:
    """Plan one 1-CTA backward configuration; raise ValueError naming the budget (TMEM, SMEM,
    registers) that fails, then (unless check_kernel_support=False) what the kernel implements."""
    dv = head_dim if head_dim_v is None else head_dim_v
    dt = _dtype_name(dtype)
    for name, v in (("head_dim", head_dim), ("head_dim_v", dv)):
        if not (isinstance(v, int) and 16 <= v <= 256 and v % 16 == 0):
            raise ValueError(f"{name}: expected a multiple of 16 in [16, 256], got {v!r}")
    if cta_group != 1:
        raise ValueError(f"cta_group: only the 1-CTA backward is implemented (the 2-CTA plan is in blackwell.md), "
                         f"got {cta_group!r}")
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

    def fits(st):
        return _smem_plan(tile_m, tile_n, head_dim, dv, st).total <= SMEM_CAPACITY
    if qdo_stages is None:
        qdo_stages = 2 if fits(2) else 1
    if not (isinstance(qdo_stages, int) and qdo_stages >= 1):
        raise ValueError(f"qdo_stages: expected an int >= 1, got {qdo_stages!r}")
    smem = _smem_plan(tile_m, tile_n, head_dim, dv, qdo_stages)
    if smem.total > SMEM_CAPACITY:
        raise ValueError(f"SMEM does not fit: {smem.describe()}")

    regs = BwdRegisterPlan()
    for name in ("elementwise", "dq", "other"):
        r = getattr(regs, name)
        if r % 8 or not 24 <= r <= 256:
            raise ValueError(f"registers: {name} = {r} is not a setmaxnreg value")
    if regs.total > REGISTERS_PER_SM:
        raise ValueError(f"registers do not fit: {regs.total} > {REGISTERS_PER_SM}")
    cfg = BlackwellBwdConfig(head_dim=head_dim, head_dim_v=dv, dtype=dt, causal=bool(causal),
                             deterministic=bool(deterministic), tile_m=tile_m, tile_n=tile_n, qdo_stages=qdo_stages,
                             tmem=tmem, smem=smem, regs=regs)
    if check_kernel_support and (head_dim, dv) not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"the configuration fits TMEM/SMEM/registers, but blackwell_bwd.py supports only head dims "
                         f"{SUPPORTED_HEAD_DIMS}, got ({head_dim}, {dv})")
    if check_kernel_support and qdo_stages > MAX_QDO_STAGES:
        raise ValueError(f"qdo_stages: blackwell_bwd.py uses at most {MAX_QDO_STAGES}, got {qdo_stages}")
    return cfg


if __name__ == "__main__":
    for d, dv in SUPPORTED_HEAD_DIMS:
        c = blackwell_bwd_config(d, dv, "bf16", causal=False)
        print(c.summary())
        print("  SMEM:", c.smem.describe())
        print(c.tmem.table())
