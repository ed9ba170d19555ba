"""Stage 3, Blackwell: the host-side plan of the FA4 forward kernel -- tiles, TMEM, SMEM, registers.

Compared with the Hopper steps, the Blackwell kernel has a third memory to budget: **tensor memory
(TMEM)**, 512 columns x 128 lanes x 32 bits = 256 KB per SM, where tcgen05 MMAs keep their
accumulators (Hopper kept them in registers). Getting the plan to fit *before* compiling is most of
the design, so it lives here, in plain Python (no cutlass import), and is tested on CPU.

Everything is per CTA (one CTA per SM). ``q_tiles_per_cta`` = 2 query tiles of ``tile_m`` = 128
rows ("high" and "low" in the paper), one softmax warpgroup each; ``tile_n`` = 128 keys per step.

TMEM (columns are 32-bit; lane r of every column belongs to query row r of a tile):

    S_i = Q_i K^T     tile_n columns (fp32)          one per Q tile, written by the MMA warp
    P_i (16-bit)      tile_n / 2 columns, aliased over the upper half of S_i (2 values per column):
                      the softmax warpgroup has read all of S_i into registers before it writes P_i
    scale_i           1 column inside S_i (column 0): the per-step rescale factor for the
                      correction warpgroup (the paper: "some tensor memory to communicate
                      rescale statistics")
    final_i           2 columns inside S_i (columns 2, 3): the final row sum and row max
    O_i += P_i V      head_dim_v columns (fp32)      one per Q tile, never leaves TMEM until the end

    d = 128:        S 2 x 128 + O 2 x 128 = 512 columns  (all of TMEM: the paper's plan)
    d = 64:         S 2 x 128 + O 2 x  64 = 384 -> allocated 512 (allocations are powers of 2, >= 32)
    d = 96:         S 2 x 128 + O 2 x  96 = 448 -> allocated 512
    d = (192, 128): S 2 x 128 + O 2 x 128 = 512 (the QK head dim never touches TMEM)
    d = 256:        S 2 x 128 + O 2 x 256 = 768 > 512: does not fit with two Q tiles, so the
                    d = 256 build has ONE Q tile (q_tiles_per_cta=1, one softmax warpgroup):
                    S 128 + O 256 = 384 -> allocated 512

SMEM (bytes, 2 per element; 227 KB = 232448 bytes is the opt-in maximum per CTA on sm_100):

    header      mbarriers + the TMEM address slot, padded to 1024 (the tiles below are
                1024-byte aligned for the 128B swizzle)
    sQ          q_tiles x tile_m x d x 2                  loaded once per CTA
    sKV ring    kv_stages x max(tile_n x d, tile_n x dv) x 2. K_j and V_j take turns in ONE ring
                (K0, V0, K1, V1, ...), in the order the MMA warp consumes them; a slot holds either.
    sO          q_tiles x tile_m x dv x 2   O staging for the epilogue (TMA store). When a separate
                sO would leave fewer than 2 ring slots (head dim 192), it is placed over sQ: by the
                time the last P V has completed, every Q K^T that read sQ has completed too.

    d = 64:        1 + 32 + 4 x 16 + 32 = 129 KB   (4 slots; we stop at 4)
    d = 96:        1 + 48 + 4 x 24 + 48 = 193 KB   (4 slots)
    d = 128:       1 + 64 + 3 x 32 + 64 = 225 KB   (3 slots)
    d = (192,128): 1 + 96 + 2 x 48 + (0: over sQ) = 193 KB (2 slots; 3 would need 241 KB)
    d = 256, 1 Q tile: a 128 x 256 tile is 64 KB (Q, O, and each K or V slot). A separate sO leaves
                   1 + 64 + 64 = 129 KB, room for one 64 KB slot (two need 257 KB), so sO goes over
                   sQ: 1 + 64 + 2 x 64 + (0: over sQ) = 193 KB = 197632 bytes (2 slots; 3: 257 KB)

Registers: 16 warps = 512 threads, so the launch caps a thread at 65536 / 512 = 128 registers;
``setmaxnreg`` then moves them per warpgroup to where they are needed:

    softmax WGs 0, 1     192   one 128-column row of S in registers (128) + a quarter of P packed
    correction WG 2       72   O rescaled / normalised 32 columns at a time
    WG 3                  56   MMA warp, TMA load warp, epilogue warp, one idle warp
    total  2 x 128 x 192 + 128 x 72 + 128 x 56 = 65536 = the register file

    The split was found by compiling: at 64 the correction warpgroup spills, at 48 the MMA warp
    spills for head dim 192 (12 K-steps of SMEM descriptors per tile); 72 / 56 compile clean.

    One Q tile (d = 256) keeps the 16 warps and their places; warpgroup 1 (warps 4-7) has no tile
    and drops to ``idle`` = 24 registers, which leaves the single softmax warpgroup the most
    setmaxnreg allows (RegisterPlan.one_q_tile; the numbers and why are there).

P is written to TMEM in two parts (the paper, "stage out storing P"): the first 3/4 of the row
(4 stores of tile_n / 8 columns: the first 3) lets the MMA warp start O += P V on 3/4 of the K
dimension, then the last 1/4 follows; the softmax thread never holds a whole packed row at once.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from stage0_reference.validation import check_softcap
from stage3_fwd_kernel.components.page_sizes import MIN_BOX_ROWS, tma_pages
from stage3_fwd_kernel.components.window import NO_WINDOW, Window, beyond_causal

__all__ = [
    "SMEM_CAPACITY",
    "TMEM_COLUMNS",
    "REGISTERS_PER_SM",
    "SUPPORTED_HEAD_DIMS",
    "ONE_Q_TILE_HEAD_DIMS",
    "q_tiles_for",
    "WarpRoles",
    "TmemPlan",
    "SmemPlan",
    "RegisterPlan",
    "BlackwellFwdConfig",
    "blackwell_fwd_config",
    "TILE_N",
    "pages_in_place",
    "NO_PAGE_BOX_HEAD_DIMS",
    "check_page_size",
]

SMEM_CAPACITY = 232448     # 227 KB: the opt-in maximum dynamic shared memory per CTA on sm_100
TMEM_COLUMNS = 512         # 128 lanes x 512 columns x 32 bit per SM
TMEM_MIN_ALLOC = 32        # tcgen05.alloc: a power of two >= 32 columns
REGISTERS_PER_SM = 65536
MAX_KV_STAGES = 4          # more ring slots stop paying once the loads are ahead of the MMAs
SUPPORTED_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (128, 64), (192, 128))  # two Q tiles per CTA
ONE_Q_TILE_HEAD_DIMS = ((256, 256),)  # one Q tile per CTA: two do not fit TMEM (q_tiles_for)
DTYPES = ("bf16", "fp16")
HEADER_ALIGN = 1024        # 128B-swizzled tiles start on 1024-byte boundaries
PERSISTENT_BARRIERS_PER_Q_TILE = 3  # q_empty, final_empty, epi_empty (persistent builds only)
FP16_MAX_THRESHOLD = 15.0  # a stale max lets P reach 2^tau; fp16 stops at 65504 < 2^16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _cdiv(a, b) * b


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _dtype_name(dtype, kernel: str = "the Blackwell forward") -> str:
    key = str(dtype).replace("torch.", "").split(".")[-1].lower()
    table = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16"}
    if key not in table:
        raise ValueError(f"dtype: {kernel} supports {DTYPES}, got {dtype!r}")
    return table[key]


@dataclass(frozen=True)
class WarpRoles:
    """Which warps do what (16 warps, 4 warpgroups; setmaxnreg acts per warpgroup). With one Q tile
    (``WarpRoles.one_q_tile()``) the places stay; warpgroup 1 has no tile and idles."""

    softmax: tuple = ((0, 1, 2, 3), (4, 5, 6, 7))  # one warpgroup per Q tile
    correction: tuple = (8, 9, 10, 11)
    mma: int = 12
    load: int = 13
    epilogue: int = 14
    idle: int = 15
    idle_warpgroup: int | None = None  # a warpgroup without a Q tile (one-tile builds: 1)

    @classmethod
    def one_q_tile(cls) -> "WarpRoles":
        return cls(softmax=((0, 1, 2, 3),), idle_warpgroup=1)

    @property
    def correction_wg(self) -> int:
        return self.correction[0] // 4

    @property
    def other_wg(self) -> int:
        """The warpgroup of the MMA, load, epilogue and idle warps."""
        return self.mma // 4

    @property
    def tmem_users(self) -> int:
        """Threads that read TMEM and arrive on tmem_dealloc: the softmax warpgroups + correction."""
        return 128 * (len(self.softmax) + 1)

    @property
    def num_warps(self) -> int:
        return 16

    @property
    def num_threads(self) -> int:
        return 32 * self.num_warps

    def describe(self) -> list:
        out = [(f"softmax WG {i}", f"warps {w[0]}-{w[-1]}",
                f"rows of Q tile {i}: S -> P (TMEM), row max / sum" + ("" if i == 0 else "; same code, free of WG 0"))
               for i, w in enumerate(self.softmax)]
        if self.idle_warpgroup is not None:
            w0 = 4 * self.idle_warpgroup
            out.append((f"idle WG {self.idle_warpgroup}", f"warps {w0}-{w0 + 3}",
                        "no Q tile: gives its registers to the softmax warpgroup"))
        return out + [
            ("correction WG", f"warps {self.correction[0]}-{self.correction[-1]}",
             "rescales O in TMEM, final O / l, lse, O -> SMEM"),
            ("MMA", f"warp {self.mma}", "tcgen05.mma: S_i = Q_i K^T (SS), O_i += P_i V (TS)"),
            ("load", f"warp {self.load}", "TMA: Q tiles, then K / V into the SMEM ring"),
            ("epilogue", f"warp {self.epilogue}", "O: SMEM -> global (TMA store, or row-guarded "
                                                    "16-byte stores for varlen)"),
            ("idle", f"warp {self.idle}", "fills the 4th warpgroup (setmaxnreg is per warpgroup)"),
        ]


@dataclass(frozen=True)
class TmemPlan:
    """Column offsets (32-bit columns) of every TMEM buffer, per Q tile."""

    s: tuple              # S_i = Q_i K^T, tile_n columns each
    o: tuple              # O_i, head_dim_v columns each
    p: tuple              # P_i (16-bit, 2 per column), tile_n / 2 columns inside S_i
    scale: tuple          # per-step rescale factor, 1 column inside S_i
    final: tuple          # final (row_sum, row_max), 2 columns inside S_i
    s_cols: int
    o_cols: int
    p_cols: int
    used: int             # columns actually addressed
    alloc: int            # what tcgen05.alloc asks for (power of two >= 32)

    def rows(self) -> list:
        """(buffer, columns, width) rows for a table, in column order."""
        out = []
        for i, off in enumerate(self.s):
            out.append((f"S_{i} = Q_{i} K^T (fp32)", f"[{off}, {off + self.s_cols})", self.s_cols))
            out.append((f"  scale_{i} (aliases S_{i})", f"[{self.scale[i]}, {self.scale[i] + 1})", 1))
            out.append((f"  row_sum_{i}, row_max_{i} (aliases S_{i})", f"[{self.final[i]}, {self.final[i] + 2})", 2))
            out.append((f"  P_{i} (16-bit x 2, aliases S_{i})", f"[{self.p[i]}, {self.p[i] + self.p_cols})", self.p_cols))
        for i, off in enumerate(self.o):
            out.append((f"O_{i} (fp32)", f"[{off}, {off + self.o_cols})", self.o_cols))
        return out

    def table(self) -> str:
        lines = ["| buffer | columns | width |", "|---|---|---|"]
        lines += [f"| {name} | {cols} | {w} |" for name, cols, w in self.rows()]
        lines.append(f"| **total used / allocated** | | **{self.used} / {self.alloc}** of {TMEM_COLUMNS} |")
        return "\n".join(lines)


@dataclass(frozen=True)
class SmemPlan:
    header: int           # mbarriers + TMEM address slot, padded to 1024
    num_barriers: int
    q: int                # all Q tiles
    kv_slot: int          # one ring slot (the larger of a K and a V tile)
    kv_stages: int
    kv: int
    o: int                # O staging (0 when it overlaps sQ)
    o_overlaps_q: bool

    @property
    def total(self) -> int:
        return self.header + self.q + self.kv + self.o

    def describe(self) -> str:
        o = "over sQ" if self.o_overlaps_q else f"{self.o}"
        return (f"header {self.header} + sQ {self.q} + sKV {self.kv_stages} x {self.kv_slot} + sO {o} "
                f"= {self.total} bytes of {SMEM_CAPACITY}")


@dataclass(frozen=True)
class RegisterPlan:
    softmax: int = 192
    correction: int = 72
    other: int = 56       # MMA / load / epilogue / idle warpgroup
    launch_cap: int = REGISTERS_PER_SM // 512
    softmax_wgs: int = 2
    idle: int = 0         # a warpgroup without a Q tile (one-tile builds), 0 = none

    @classmethod
    def one_q_tile(cls) -> "RegisterPlan":
        """d = 256, one Q tile: the softmax warpgroup takes setmaxnreg's maximum, 256, and the idle
        warpgroup drops to its minimum, 24. The correction warpgroup (O is 8 chunks of 32 columns) and
        the MMA warp (16 K-steps of Q / K descriptors for S = Q K^T) need more than at d <= 192; found by
        compiling (bf16, dense and causal varlen): correction 72 spills 284-296 bytes, 80 is clean;
        other 56 spills 68-100 bytes, 64 is clean. One step of 16 over each for the variants:
        128 x (256 + 24 + 96 + 80) = 58368 <= 65536."""
        return cls(softmax=256, correction=96, other=80, softmax_wgs=1, idle=24)

    @property
    def total(self) -> int:
        return 128 * (self.softmax_wgs * self.softmax + self.correction + self.other + self.idle)


@dataclass(frozen=True)
class BlackwellFwdConfig:
    head_dim: int
    head_dim_v: int
    dtype: str                      # "bf16" | "fp16"
    causal: bool
    q_tiles_per_cta: int
    tile_m: int
    tile_n: int
    kv_stages: int
    emulation_fraction: float
    rescale_threshold: float
    tmem: TmemPlan
    smem: SmemPlan
    regs: RegisterPlan
    roles: WarpRoles = field(default_factory=WarpRoles)

    # P goes to TMEM in `p_store_chunks` stores; the MMA warp starts after `p_first_chunks`
    p_store_chunks: int = 4
    p_first_chunks: int = 3

    # the score variants (compile-time): the window beyond causal (components.window.beyond_causal:
    # causal stays the `causal` flag), softcap (0 = off), and whether a learnable sink is passed
    window: Window = NO_WINDOW
    softcap: float = 0.0
    sink: bool = False

    @property
    def plain(self) -> bool:
        return self.window == NO_WINDOW and self.softcap == 0.0 and not self.sink

    @property
    def cta_tile_m(self) -> int:
        return self.q_tiles_per_cta * self.tile_m

    @property
    def num_threads(self) -> int:
        return self.roles.num_threads

    @property
    def pv_k_blocks(self) -> int:
        """tcgen05 f16 MMAs have K = 16: O += P V is tile_n / 16 instructions per Q tile."""
        return self.tile_n // 16

    @property
    def pv_k_blocks_first(self) -> int:
        return self.pv_k_blocks * self.p_first_chunks // self.p_store_chunks

    @property
    def persistent_barriers(self) -> int:
        """The barriers of a persistent build (blackwell_persistent.py): the plan's, then per Q tile
        q_empty (sQ_i free for the next tile's Q), final_empty (the final row statistics read, so the
        next S_i may overwrite them) and epi_empty (sO_i stored). They fit the same header (29 x 8
        bytes at d = 128), so the SMEM plan does not change; one-tile builds keep the plan's count."""
        return self.smem.num_barriers + PERSISTENT_BARRIERS_PER_Q_TILE * self.q_tiles_per_cta

    @property
    def persistent_supported(self) -> str | None:
        """None when a persistent build of this plan is implemented, else why not."""
        if self.smem.o_overlaps_q:
            return ("sO is placed over sQ at these head dims: the next tile's Q load would overwrite O "
                    "before it is stored")
        if self.sink and self.head_dim_v >= 128:
            return ("a learnable sink at head_dim_v >= 128: the correction warpgroup (72 registers) spills 16 "
                    "bytes with the tile loop's counters live (d = 64 and 96 compile clean)")
        if 8 * self.persistent_barriers + 4 > self.smem.header:
            return "the persistent barriers do not fit the SMEM header"
        return None

    def key(self) -> tuple:
        """Everything that changes the compiled code (the compile-cache key)."""
        base = (self.head_dim, self.head_dim_v, self.dtype, self.causal, self.q_tiles_per_cta,
                self.tile_m, self.tile_n, self.kv_stages, self.emulation_fraction, self.rescale_threshold)
        # plain builds keep their keys (and any stored compile) unchanged
        return base if self.plain else base + ("variant",) + tuple(self.window) + (self.softcap, self.sink)

    def summary(self) -> str:
        return (f"Blackwell fwd {self.dtype} d={self.head_dim}/{self.head_dim_v} causal={self.causal}: "
                f"CTA {self.cta_tile_m} x {self.tile_n} ({self.q_tiles_per_cta} Q tiles), "
                f"TMEM {self.tmem.used}/{self.tmem.alloc} cols, SMEM {self.smem.total} B "
                f"({self.kv_stages} K/V slots{', sO over sQ' if self.smem.o_overlaps_q else ''}), "
                f"regs softmax/correction/other = {self.regs.softmax}/{self.regs.correction}/{self.regs.other}, "
                f"exp2 emulated {self.emulation_fraction:g}, tau {self.rescale_threshold:g}"
                + ("" if self.plain else f", window {tuple(self.window)}, softcap {self.softcap:g}, "
                                         f"sink {self.sink}"))


def _num_barriers(q_tiles: int, kv_stages: int) -> int:
    # q_full per Q tile; full + empty per ring slot; per Q tile: s_full, p_full (3/4 of P + O
    # rescaled), p_full_2 (last 1/4), scale_full, final_full, o_full, epi_full; one tmem_dealloc.
    return q_tiles + 2 * kv_stages + 7 * q_tiles + 1


def _smem_plan(q_tiles, tile_m, tile_n, d, dv, kv_stages, o_overlaps_q, elem=2) -> SmemPlan:
    nbar = _num_barriers(q_tiles, kv_stages)
    header = _round_up(8 * nbar + 4, HEADER_ALIGN)  # Int64 barriers + Int32 TMEM address
    q = q_tiles * tile_m * d * elem
    slot = tile_n * max(d, dv) * elem
    o = 0 if o_overlaps_q else q_tiles * tile_m * dv * elem
    return SmemPlan(header=header, num_barriers=nbar, q=q, kv_slot=slot, kv_stages=kv_stages,
                    kv=kv_stages * slot, o=o, o_overlaps_q=o_overlaps_q)


def _tmem_plan(q_tiles, tile_n, dv) -> TmemPlan:
    p_cols = tile_n * 16 // 32
    s = tuple(i * tile_n for i in range(q_tiles))
    o = tuple(q_tiles * tile_n + i * dv for i in range(q_tiles))
    used = q_tiles * (tile_n + dv)
    return TmemPlan(s=s, o=o, p=tuple(x + tile_n - p_cols for x in s), scale=s,
                    final=tuple(x + 2 for x in s), s_cols=tile_n, o_cols=dv, p_cols=p_cols,
                    used=used, alloc=max(TMEM_MIN_ALLOC, _pow2_at_least(used)))


TILE_N = 128  # the key block of every build (blackwell_fwd_config's default tile_n)


# Head dims whose builds read no pages smaller than a key block in place: at (192, 128) the boxes'
# load code pushed the MMA warp (56 registers, 12 K-steps of S = Q K^T a tile) to spill 200-240 bytes
# (`bw.compile_config(make_config("bf16", 192, 128, True), True, page_size=16).report`), so fa4 copies
# those pages into a dense cache there.
NO_PAGE_BOX_HEAD_DIMS = ((192, 128),)


def pages_in_place(page_size, tile_n: int = TILE_N, head_dims: tuple | None = None) -> bool:
    """Whether the forward reads a paged cache of page_size in place: pages of whole key blocks (one
    TMA box a block, at the block's page), or pages of 16, 32 or 64 keys (components.page_sizes'
    tma_pages: tile_n / page_size boxes a block, one a page; not at NO_PAGE_BOX_HEAD_DIMS). Other
    sizes are copied into a dense cache by fa4: this kernel has no cp.async gather."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
        return False
    if page_size % tile_n == 0:
        return True
    return tma_pages(page_size, tile_n) and tuple(head_dims or ()) not in NO_PAGE_BOX_HEAD_DIMS


def check_page_size(page_size, tile_n: int, varlen: bool, persistent: bool, head_dims: tuple | None = None):
    """The page size a kernel is built for (None: no paged cache), else a ValueError naming it."""
    if page_size is None:
        return None
    if not pages_in_place(page_size, tile_n, head_dims):
        boxes = "" if tuple(head_dims or ()) in NO_PAGE_BOX_HEAD_DIMS else \
            f", or of a divisor of {tile_n} that is a multiple of {MIN_BOX_ROWS},"
        raise ValueError(f"page_size: the Blackwell forward at head dims {head_dims} reads pages of a multiple of "
                         f"{tile_n} keys{boxes} in place, got {page_size!r} (gather other pages into a dense "
                         f"cache first)")
    if not varlen or persistent:
        raise ValueError("page_size: a paged cache is read by the varlen build with one CTA a tile (varlen=True, "
                         "no persistent scheduler)")
    return page_size


def q_tiles_for(head_dim: int, head_dim_v: int | None = None) -> int:
    """The Q tiles per CTA the kernel builds at these head dims: 1 where two do not fit TMEM
    (ONE_Q_TILE_HEAD_DIMS: 256), else 2. The plan's default stays 2; the host API passes this."""
    dv = head_dim if head_dim_v is None else head_dim_v
    return 1 if (head_dim, dv) in ONE_Q_TILE_HEAD_DIMS else 2


def blackwell_fwd_config(head_dim: int, head_dim_v: int | None, dtype, *, causal: bool,
                         q_tiles_per_cta: int = 2, tile_m: int = 128, tile_n: int = 128,
                         kv_stages: int | None = None, emulation_fraction: float = 0.125,
                         rescale_threshold: float = 8.0, window_size=(None, None), softcap: float = 0.0,
                         learnable_sink: bool = False,
                         check_kernel_support: bool = True) -> BlackwellFwdConfig:
    """Plan one Blackwell forward configuration; raise ValueError naming the budget that fails.

    Variants (compile-time, checked as the Hopper forward checks them): window_size (left, right),
    None or -1 unlimited (causal is right = 0); softcap >= 0 (0 = off); learnable_sink, a bool: built
    to take a (Hq,) fp32 sink tensor.

    Checks run in this order: arguments, TMEM, SMEM, registers, and then (unless
    ``check_kernel_support=False``, for budget exploration) whether ``blackwell_fwd.py``
    implements the configuration.
    """
    # 1. arguments
    dv = head_dim if head_dim_v is None else head_dim_v
    dt = _dtype_name(dtype)
    for name, v in (("head_dim", head_dim), ("head_dim_v", dv)):
        if not (isinstance(v, int) and 16 <= v <= 256 and v % 16 == 0):
            raise ValueError(f"{name}: expected a multiple of 16 in [16, 256], got {v!r}")
    if q_tiles_per_cta not in (1, 2):
        raise ValueError(f"q_tiles_per_cta: 1 or 2 (one softmax warpgroup per tile), got {q_tiles_per_cta!r}")
    if tile_m not in (64, 128):
        raise ValueError(f"tile_m: a 1-CTA tcgen05 MMA has M = 64 or 128, got {tile_m!r}")
    if not (isinstance(tile_n, int) and 64 <= tile_n <= 256 and tile_n % 64 == 0):
        raise ValueError(f"tile_n: expected 64, 128, 192 or 256 (P is stored in quarters of whole "
                         f"16-column MMA K-blocks), got {tile_n!r}")
    if not (isinstance(emulation_fraction, (int, float)) and 0.0 <= emulation_fraction <= 1.0):
        raise ValueError(f"emulation_fraction: expected a value in [0, 1], got {emulation_fraction!r}")
    if not (isinstance(rescale_threshold, (int, float)) and math.isfinite(rescale_threshold)
            and rescale_threshold >= 0.0):
        raise ValueError(f"rescale_threshold: expected a finite tau >= 0 (log2 units), got {rescale_threshold!r}")
    if dt == "fp16" and rescale_threshold > FP16_MAX_THRESHOLD:
        raise ValueError(f"rescale_threshold: P can reach 2^tau and fp16 overflows past 65504, so "
                         f"tau <= {FP16_MAX_THRESHOLD:g} for fp16, got {rescale_threshold!r}")
    window = beyond_causal(bool(causal), window_size)  # TypeError / ValueError naming window_size
    softcap = check_softcap(softcap)                    # TypeError / ValueError naming softcap
    if not isinstance(learnable_sink, bool):
        raise TypeError(f"learnable_sink: expected a bool (build for a (Hq,) sink tensor) here, got "
                        f"{type(learnable_sink).__name__}")

    # 2. TMEM: S and O of every Q tile side by side (P, scale and final stats live inside S)
    tmem = _tmem_plan(q_tiles_per_cta, tile_n, dv)
    if tmem.used > TMEM_COLUMNS:
        raise ValueError(
            f"TMEM does not fit: {q_tiles_per_cta} Q tiles x (S {tile_n} + O {dv}) = {tmem.used} "
            f"columns > {TMEM_COLUMNS} (head_dim_v={dv}, tile_n={tile_n}); use fewer Q tiles per CTA "
            f"(q_tiles_per_cta=1 at head dims {ONE_Q_TILE_HEAD_DIMS}), a smaller tile_n, or split head_dim_v")

    # 3. SMEM: sO separate unless that leaves fewer than 2 ring slots (then it goes over sQ)
    def stages_that_fit(plan_for):
        n = 0
        while n < 64 and plan_for(n + 1).total <= SMEM_CAPACITY:
            n += 1
        return n

    separate = stages_that_fit(lambda s: _smem_plan(q_tiles_per_cta, tile_m, tile_n, head_dim, dv, s, False))
    o_over_q = separate < 2 and dv <= head_dim  # sO_i must fit inside the sQ footprint
    if kv_stages is None:
        fit = separate if not o_over_q else stages_that_fit(
            lambda s: _smem_plan(q_tiles_per_cta, tile_m, tile_n, head_dim, dv, s, True))
        kv_stages = max(2, min(MAX_KV_STAGES, fit))
    if not (isinstance(kv_stages, int) and kv_stages >= 2):
        raise ValueError(f"kv_stages: at least 2 ring slots (K_j and V_j-1 are in use together), got {kv_stages!r}")
    smem = _smem_plan(q_tiles_per_cta, tile_m, tile_n, head_dim, dv, kv_stages, o_over_q)
    if smem.total > SMEM_CAPACITY:
        raise ValueError(f"SMEM does not fit: {smem.describe()}; "
                         f"use fewer kv_stages (<= {stages_that_fit(lambda s: _smem_plan(q_tiles_per_cta, tile_m, tile_n, head_dim, dv, s, o_over_q))} "
                         f"fit here) or smaller tiles")

    # 4. registers (fixed per-role plan; setmaxnreg wants multiples of 8 in [24, 256])
    regs = RegisterPlan() if q_tiles_per_cta == 2 else RegisterPlan.one_q_tile()
    for name in ("softmax", "correction", "other") + (("idle",) if regs.idle else ()):
        r = getattr(regs, name)
        if r % 8 or not 24 <= r <= 256:
            raise ValueError(f"registers: {name} = {r} is not a setmaxnreg value (multiple of 8 in [24, 256])")
    if regs.total > REGISTERS_PER_SM:
        raise ValueError(f"registers do not fit: {regs.total} > {REGISTERS_PER_SM}")

    cfg = BlackwellFwdConfig(head_dim=head_dim, head_dim_v=dv, dtype=dt, causal=bool(causal),
                             q_tiles_per_cta=q_tiles_per_cta, tile_m=tile_m, tile_n=tile_n,
                             kv_stages=kv_stages, emulation_fraction=float(emulation_fraction),
                             rescale_threshold=float(rescale_threshold), tmem=tmem, smem=smem, regs=regs,
                             window=window, softcap=softcap, sink=learnable_sink,
                             roles=WarpRoles() if q_tiles_per_cta == 2 else WarpRoles.one_q_tile())

    # 5. what blackwell_fwd.py implements
    if check_kernel_support:
        problems = []
        if (head_dim, dv) not in SUPPORTED_HEAD_DIMS + ONE_Q_TILE_HEAD_DIMS:
            problems.append(f"head dims {SUPPORTED_HEAD_DIMS + ONE_Q_TILE_HEAD_DIMS}, got ({head_dim}, {dv})")
        elif q_tiles_per_cta != q_tiles_for(head_dim, dv):
            problems.append(f"q_tiles_per_cta=2 (two softmax warpgroups) at head dims {SUPPORTED_HEAD_DIMS} and 1 "
                            f"at {ONE_Q_TILE_HEAD_DIMS}, got {q_tiles_per_cta} at ({head_dim}, {dv})")
        if tile_m != 128 or tile_n != 128:
            problems.append(f"tile_m = tile_n = 128 (one 128-column row per softmax thread), got {tile_m}x{tile_n}")
        if problems:
            raise ValueError("the configuration fits TMEM/SMEM/registers, but blackwell_fwd.py supports only "
                             + "; ".join(problems))
    return cfg


if __name__ == "__main__":
    for d, dv in SUPPORTED_HEAD_DIMS + ONE_Q_TILE_HEAD_DIMS:
        c = blackwell_fwd_config(d, dv, "bf16", causal=False, q_tiles_per_cta=q_tiles_for(d, dv))
        print(c.summary())
        print("  SMEM:", c.smem.describe())
