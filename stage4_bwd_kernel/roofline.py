"""Backward-pass "feeds and speeds": cycles per tile for MMA, shared memory and the exp unit.

The paper (section "Attention backward pass / Feeds and Speeds") prices one iteration of the
backward main loop: a CTA owns N keys (K/V tile) and meets M queries (Q tile), head dim d, and
runs five GEMMs, each 2 M N d FLOPs:

    S^T  = K Q^T      SS      dP^T = V dO^T   SS      dQ = dS K   SS
    dV  += P^T dO     TS      dK  += dS^T Q   TS      (TS: A from tensor memory)

    MMA          10 M N d / 8192                              (B200: 8192 FLOP/clk/SM)
    SMEM         operands: SS read 2Md + 3Nd + MN, TS read 2Md elements -> (4Md + 3Nd + MN) * 2 B
                 + dS written once (2 MN B) + dQ in fp32 written and read back for the TMA
                 reduction (8 M d B); 128 B/clk
    exp          M N / 16                                     (16 MUFU ex2/clk/SM)

At M = N = d = 128: MMA 2560, SMEM 2048 + 256 + 1024 = 3328, exp 1024 -> SMEM-bound (~30% over
MMA). In the 2-CTA mode the CTA pair shares one Q tile (the MMA's M = 256 spans both CTAs' keys)
and each CTA stages half of every B operand; dQ = dS K runs with M/2 query rows per CTA and the
doubled reduction 2N, after each CTA has sent the other the half of dS it needs through
distributed shared memory. Per CTA (derived below from that text): operands 1536, dS write 256,
dS exchange 384, dQ 512 -> 2688.

The Hopper model prices the same five GEMMs for wgmma: an instruction is 64 rows (M) per
warpgroup, A comes from shared memory or registers, B always from shared memory, and every
64-row block re-reads its B slice; when warpgroups split N, each re-reads all of A. That is what
makes the SS-everywhere layout of ``hopper_step1`` shared-memory bound, and what an RS design
(P^T and dS^T as register A operands, the FA3 layout) saves.
"""
from __future__ import annotations

from dataclasses import dataclass

from stage3_fwd_kernel.roofline import B200, H100, Hardware  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class BwdTileCycles:
    mma: float
    smem_operands: float
    smem_ds_write: float
    smem_ds_exchange: float
    smem_dq: float
    exp: float

    @property
    def smem(self) -> float:
        return self.smem_operands + self.smem_ds_write + self.smem_ds_exchange + self.smem_dq

    @property
    def bound(self) -> str:
        worst = max(self.mma, self.smem, self.exp)
        return "+".join(n for n, v in (("MMA", self.mma), ("SMEM", self.smem), ("exp", self.exp)) if v == worst)

    def as_row(self) -> dict:
        return {"MMA": self.mma, "SMEM operands": self.smem_operands, "SMEM dS write": self.smem_ds_write,
                "SMEM dS DSMEM": self.smem_ds_exchange, "SMEM dQ": self.smem_dq, "SMEM total": self.smem,
                "exp": self.exp}


def backward_tile_cycles(m: int, n: int, d: int, hw: Hardware = B200, d_v: int | None = None,
                         two_cta: bool = False, bytes_per_el: int = 2) -> BwdTileCycles:
    """The paper's Blackwell model, per CTA and per (M = m queries) x (N = n keys) iteration.

    two_cta: the CTA pair shares the m-row Q tile; each CTA owns n keys and stages half of each B
    operand. Per-CTA operand elements:
        S^T = K Q^T:  n d   (own K)   + m d / 2  (half of Q)
        dP^T = V dO^T: n dv            + m dv / 2
        dV = P^T dO:  m dv / 2        (A from TMEM)
        dK = dS^T Q:  m d / 2         (A from TMEM)
        dQ = dS K:    (m/2) (2n)      (own query rows, both CTAs' keys, after the exchange)
                      + n d           (half of the pair's 2n x d K)
    The dS exchange moves (m/2) n elements each way; we charge it three passes (the outgoing half
    read from local SMEM, written into the peer, and the incoming half written into ours), which
    reproduces the paper's 384 cycles -- the paper does not itemize this line.
    """
    d_v = d if d_v is None else d_v
    flops = 2 * m * n * (3 * d + 2 * d_v)  # S, dK, dQ over d; dP, dV over d_v
    mma = flops / hw.mma_flops_per_clock
    bpc = hw.smem_bytes_per_clock
    if not two_cta:
        ss = (n * d + m * d) + (n * d_v + m * d_v) + (m * n + n * d)   # S^T, dP^T, dQ
        ts = m * d_v + m * d                                           # dV, dK (B only)
        ds_exchange = 0.0
        dq_rows = m
    else:
        ss = (n * d + m * d / 2) + (n * d_v + m * d_v / 2) + (m * n + n * d)
        ts = m * d_v / 2 + m * d / 2
        ds_exchange = 3 * (m / 2) * n * bytes_per_el / bpc
        dq_rows = m / 2
    return BwdTileCycles(
        mma=mma,
        smem_operands=(ss + ts) * bytes_per_el / bpc,
        smem_ds_write=m * n * bytes_per_el / bpc,
        smem_ds_exchange=ds_exchange,
        smem_dq=2 * dq_rows * d * 4 / bpc,  # fp32, written then read back by the TMA reduction
        exp=m * n / hw.exp_per_clock,
    )


def blackwell_wide_tile_cycles(d: int, d_v: int, hw: Hardware = B200, m: int = 64, n: int = 128,
                               bytes_per_el: int = 2) -> tuple:
    """The wide Blackwell backward (blackwell_bwd_wide.py), per CTA and per 64-query x 128-key tile:
    (BwdTileCycles, CTAs a tile). Each of `splits` CTAs computes S^T and dP^T whole and its part of dV,
    dK and the dQ^T windows (128 head-dim rows each; at (192, 128) two, overlapping by 64):
        S^T: K n d + Q m d;  dP^T: V n dv + dO m dv;  dV: dO m dv/s;  dK: Q m d/s  (A from TMEM)
        dQ^T = K^T dS^T:  per window K 128 n + dS m n  (both from SMEM)
    No dQ staging (per-column atomics); dS is written once."""
    from stage4_bwd_kernel.blackwell_config import dq_windows, head_splits

    s = head_splits(d, d_v, m)
    windows = len(dq_windows(d // s))
    flops = 2 * m * n * (d + d_v + d_v // s + d // s + windows * 128)
    ss = n * d + m * d + n * d_v + m * d_v + windows * (128 * n + m * n)
    ts = m * d_v // s + m * d // s
    cycles = BwdTileCycles(mma=flops / hw.mma_flops_per_clock, smem_operands=(ss + ts) * bytes_per_el /
                           hw.smem_bytes_per_clock, smem_ds_write=m * n * bytes_per_el / hw.smem_bytes_per_clock,
                           smem_ds_exchange=0.0, smem_dq=0.0, exp=m * n / hw.exp_per_clock)
    return cycles, s


def blackwell_wide_table() -> str:
    """Markdown: SM cycles per 1k key-query pairs (a tile's cycles x its CTAs / its pairs) of the wide
    design at (192, 128) and 256 beside the 1-CTA kernel's 128 x 128 tile at d = 128. The serial schedule
    overlaps the exp with dP^T at most: its estimate charges max(MMA, SMEM) + exp (the MMAs read their
    operands from SMEM as they run), an upper bound."""
    lines = ["| B200, per 1k key-query pairs | tile (CTAs) | MMA | SMEM | exp | serial estimate |",
             "|---|---|---|---|---|---|"]
    one = backward_tile_cycles(128, 128, 128, B200)
    per = 1024 / (128 * 128)
    lines.append(f"| 1-CTA d = 128 (pipelined) | 128 x 128 (1) | {one.mma * per:.0f} | {one.smem * per:.0f} | "
                 f"{one.exp * per:.0f} | - |")
    for d, dv in ((192, 128), (256, 256)):
        c, s = blackwell_wide_tile_cycles(d, dv)
        per = 1024 * s / (64 * 128)
        lines.append(f"| wide ({d}, {dv}) | 64 x 128 ({s}) | {c.mma * per:.0f} | {c.smem * per:.0f} | "
                     f"{c.exp * per:.0f} | {(max(c.mma, c.smem) + c.exp) * per:.0f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Hopper (wgmma): the designs of this stage
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GemmSpec:
    """One GEMM of the backward on wgmma: (M, N, K), whether A is read from SMEM, and whether the
    warpgroups split M or N."""
    name: str
    m: int
    n: int
    k: int
    a_smem: bool
    split: str  # "M" or "N"


def wgmma_smem_elements(g: GemmSpec, num_wg: int, mma_m: int = 64) -> float:
    """Elements the tensor cores read from SMEM for one GEMM. Every 64-row block of an instruction
    reads the whole B slice of its N range; A (when in SMEM) is read once per warpgroup that needs
    it: once in total when warpgroups split M, num_wg times when they split N."""
    b = (g.m / mma_m) * g.n * g.k
    a = 0.0
    if g.a_smem:
        a = g.m * g.k * (num_wg if g.split == "N" else 1)
    return a + b


def hopper_design(design: str, m: int, n: int, d: int, d_v: int | None = None) -> list[GemmSpec]:
    """The five GEMMs of one tile (m queries, n keys).

    "step1_ss": hopper_step1 -- every operand in SMEM, warpgroups split N (any head dim <= 256).
    "fa3_rs":   keys split across the warpgroups (M), P^T and dS^T stay in registers as the A of
                dV and dK (FA3's SdP_swapAB + RS dK/dV); dQ SS with N split. Needs 2 x (64 keys x
                (d + dv)) accumulator registers per warpgroup, so only for d <= 128.
    """
    d_v = d if d_v is None else d_v
    if design == "step1_ss":
        return [GemmSpec("S^T=KQ^T", n, m, d, True, "N"), GemmSpec("dP^T=VdO^T", n, m, d_v, True, "N"),
                GemmSpec("dV+=P^TdO", n, d_v, m, True, "N"), GemmSpec("dK+=dS^TQ", n, d, m, True, "N"),
                GemmSpec("dQ=dSK", m, d, n, True, "N")]
    if design == "fa3_rs":
        return [GemmSpec("S^T=KQ^T", n, m, d, True, "M"), GemmSpec("dP^T=VdO^T", n, m, d_v, True, "M"),
                GemmSpec("dV+=P^TdO", n, d_v, m, False, "M"), GemmSpec("dK+=dS^TQ", n, d, m, False, "M"),
                GemmSpec("dQ=dSK", m, d, n, True, "N")]
    raise ValueError(f"design: expected 'step1_ss' or 'fa3_rs', got {design!r}")


def hopper_tile_cycles(m: int, n: int, d: int, design: str = "step1_ss", d_v: int | None = None,
                       hw: Hardware = H100, num_wg: int = 2, bytes_per_el: int = 2) -> BwdTileCycles:
    """Cycles per (m queries x n keys) tile on one H100 SM. SMEM: operand reads of the five
    wgmmas, plus P^T (step1_ss only) and dS^T written from registers. dQ goes to global memory
    with fp32 atomics (L2), not through SMEM, so its SMEM term is 0 here."""
    d_v = d if d_v is None else d_v
    gemms = hopper_design(design, m, n, d, d_v)
    flops = sum(2 * g.m * g.n * g.k for g in gemms)
    elems = sum(wgmma_smem_elements(g, num_wg, hw.mma_m) for g in gemms)
    writes = m * n * (2 if design == "step1_ss" else 1)  # P^T and dS^T, or dS^T only
    return BwdTileCycles(
        mma=flops / hw.mma_flops_per_clock,
        smem_operands=elems * bytes_per_el / hw.smem_bytes_per_clock,
        smem_ds_write=writes * bytes_per_el / hw.smem_bytes_per_clock,
        smem_ds_exchange=0.0,
        smem_dq=0.0,
        exp=m * n / hw.exp_per_clock,
    )


def hopper_registers(m: int, n: int, d: int, design: str = "step1_ss", d_v: int | None = None,
                     num_wg: int = 2) -> dict:
    """fp32 accumulator registers per thread (num_wg * 128 threads): what bounds the tile sizes."""
    d_v = d if d_v is None else d_v
    t = 128 * num_wg
    regs = {"dK": n * d / t, "dV": n * d_v / t, "S^T": n * m / t, "dP^T": n * m / t, "dQ": m * d / t}
    regs["peak"] = max(regs["dK"] + regs["dV"] + regs["S^T"] + regs["dP^T"], regs["dK"] + regs["dV"] + regs["dQ"])
    return regs


def hopper_smem_bytes(m: int, n: int, d: int, d_v: int | None = None, bytes_per_el: int = 2) -> int:
    """hopper_step1's shared memory: Q, dO, K, V, P^T, dS^T (+ 2 m fp32 statistics)."""
    d_v = d if d_v is None else d_v
    return (m * d + m * d_v + n * d + n * d_v + 2 * m * n) * bytes_per_el + 2 * m * 4


# ------------------------------------------------------------------------------------------------
# wide head dims on Hopper: designs that keep dK and dV in registers at (192, 128) and 256
# ------------------------------------------------------------------------------------------------
WIDE_DESIGNS = {
    # name: (how the two consumer warpgroups share a CTA's keys -- 64, or WIDE_KEYS -- what each computes)
    "split_queries": "each warpgroup takes half of the Q tile's queries: S^T / dP^T of 64 keys x m/2 "
                     "queries, dV and dK over its queries (RS: P^T / dS^T from registers), partial dK / dV "
                     "summed through SMEM once per CTA; dQ^T = K^T dS^T for its queries",
    "split_dims": "each warpgroup owns half of dK's and dV's columns: both compute the whole S^T / dP^T "
                  "(64 keys x m queries, twice the MMA of those two GEMMs), dV / dK over all queries for "
                  "their columns (RS); dQ split by columns",
    "exchange_dims": "as split_dims, but S^T / dP^T split by queries and P^T / dS^T exchanged through SMEM: "
                     "dV / dK read A from SMEM (SS) instead of computing it twice",
    "swap_keys": "96 keys a CTA (no wgmma M, so on N): S / dP split by keys, P / dS through SMEM, dV^T / dK^T "
                 "with the head dim as M over the warpgroup's 48 keys (SS), dQ split by columns",
}
WIDE_KEYS = {"swap_keys": 96}  # keys a CTA; 64 for the others


def wide_design(design: str, m: int, d: int, dv: int, n: int = 64) -> list:
    """(GemmSpec, count) per CTA tile for one of WIDE_DESIGNS: each spec is one warpgroup's GEMM
    (num_wg = 1 in wgmma_smem_elements), count how many warpgroups issue it."""
    h = m // 2
    if design == "swap_keys":
        k2 = n // 2
        return [(GemmSpec("S=QK^T", m, k2, d, True, "N"), 2), (GemmSpec("dP=dOV^T", m, k2, dv, True, "N"), 2),
                (GemmSpec("dV^T+=dO^TP", dv, k2, m, True, "N"), 2), (GemmSpec("dK^T+=Q^TdS", d, k2, m, True, "N"), 2),
                (GemmSpec("dQ=dSK", m, d // 2, n, True, "N"), 2)]
    if design == "split_queries":
        return [(GemmSpec("S^T", n, h, d, True, "M"), 2), (GemmSpec("dP^T", n, h, dv, True, "M"), 2),
                (GemmSpec("dV+=P^TdO", n, dv, h, False, "M"), 2), (GemmSpec("dK+=dS^TQ", n, d, h, False, "M"), 2),
                (GemmSpec("dQ^T=K^TdS^T", d, h, n, True, "M"), 2)]
    if design == "split_dims":
        return [(GemmSpec("S^T", n, m, d, True, "M"), 2), (GemmSpec("dP^T", n, m, dv, True, "M"), 2),
                (GemmSpec("dV+=P^TdO", n, dv // 2, m, False, "M"), 2),
                (GemmSpec("dK+=dS^TQ", n, d // 2, m, False, "M"), 2), (GemmSpec("dQ^T=K^TdS^T", d // 2, m, n, True, "M"), 2)]
    if design == "exchange_dims":
        return [(GemmSpec("S^T", n, h, d, True, "M"), 2), (GemmSpec("dP^T", n, h, dv, True, "M"), 2),
                (GemmSpec("dV+=P^TdO", n, dv // 2, m, True, "M"), 2),
                (GemmSpec("dK+=dS^TQ", n, d // 2, m, True, "M"), 2), (GemmSpec("dQ^T=K^TdS^T", d // 2, m, n, True, "M"), 2)]
    raise ValueError(f"design: expected one of {sorted(WIDE_DESIGNS)}, got {design!r}")


def wide_registers(design: str, m: int, d: int, dv: int, n: int = 64) -> dict:
    """Registers per consumer thread (128 per warpgroup) held across a tile: the dK and dV
    accumulators, plus the larger of (S^T, dP^T and the 16-bit P^T / dS^T A operands: two values per
    register) and (a 64-column chunk of dQ^T with dS^T), which are not live at once. dQ^T is
    computed 64 of its d rows at a time (each chunk reduced to global memory before the next), so
    its registers do not grow with d."""
    t = 128
    if design == "swap_keys":  # a warpgroup's n / 2 keys of every accumulator but dQ (d / 2 columns, whole)
        regs = {"dK": d * n / 2 / t, "dV": dv * n / 2 / t, "S^T": m * n / 2 / t, "dP^T": m * n / 2 / t,
                "P^T/dS^T (16-bit)": 0.0, "dQ^T chunk": m * d / 2 / t}
        regs["total"] = regs["dK"] + regs["dV"] + max(regs["S^T"] + regs["dP^T"], regs["dQ^T chunk"])
        return regs
    rows = m / 2 if design in ("split_queries", "exchange_dims") else m      # queries a warpgroup scores
    dq_rows = m / 2 if design == "split_queries" else m                      # queries of its dQ^T
    cols = 1 if design == "split_queries" else 2                              # dK / dV column split
    regs = {"dK": n * d / cols / t, "dV": n * dv / cols / t, "S^T": n * rows / t, "dP^T": n * rows / t}
    a16 = 0.0 if design == "exchange_dims" else n * rows / t / 2             # P^T / dS^T in registers
    regs["P^T/dS^T (16-bit)"] = a16
    regs["dQ^T chunk"] = 64 * dq_rows / t
    regs["total"] = regs["dK"] + regs["dV"] + max(regs["S^T"] + regs["dP^T"] + a16, regs["dQ^T chunk"] + a16)
    return regs


def wide_tile_cycles(design: str, m: int, d: int, dv: int, n: int = 64, hw: Hardware = H100) -> BwdTileCycles:
    """Cycles per (m queries x n keys) tile: the MMA of every warpgroup's GEMMs (the duplicated S^T /
    dP^T of split_dims included), their SMEM operand reads, dS^T (and for exchange_dims / swap_keys P^T)
    written to SMEM, the fp32 dQ tile staged through SMEM for the writer's bulk reduce (written once,
    read once: 8 m d bytes, whatever n is -- what more keys a CTA amortize), and for split_queries
    nothing per tile for the partial dK / dV (summed once per CTA)."""
    specs = wide_design(design, m, d, dv, n)
    flops = sum(2 * g.m * g.n * g.k * c for g, c in specs)
    elems = sum(wgmma_smem_elements(g, 1, hw.mma_m) * c for g, c in specs)
    writes = m * n * (2 if design in ("exchange_dims", "swap_keys") else 1)
    return BwdTileCycles(mma=flops / hw.mma_flops_per_clock, smem_operands=elems * 2 / hw.smem_bytes_per_clock,
                         smem_ds_write=writes * 2 / hw.smem_bytes_per_clock, smem_ds_exchange=0.0,
                         smem_dq=2 * m * d * 4 / hw.smem_bytes_per_clock, exp=m * n / hw.exp_per_clock)


# the production d = 128 consumer holds 64 + 64 + 32 + 32 + 16 = 208 of its 240 registers in
# accumulators and P^T without spilling: the budget a wide design may take
WIDE_REGISTER_BUDGET = 208


def wide_smem_kb(m: int, d: int, dv: int, stages: int, n: int = 64) -> float:
    """K and V of the CTA, `stages` Q / dO buffers, P^T and dS^T (16-bit), 2 KB of barriers and row
    statistics."""
    return (n * (d + dv) + stages * m * (d + dv) + 2 * m * n) * 2 / 1024 + 2


def wide_table(cases) -> str:
    """Markdown: per (design, m, d, dv), cycles per tile (m x n, n = WIDE_KEYS or 64), the useful MMA
    share (the five GEMMs once over the bounding resource's time), the bounding cycles per 1024
    key-query pairs (the designs' common unit), the accumulator registers against
    WIDE_REGISTER_BUDGET, and the Q / dO stages that fit 227 KB of SMEM."""
    lines = ["| design | m x n, d/dv | MMA | SMEM | exp | bound | useful MMA | cycles / 1k pairs | acc regs/thread "
             "| Q/dO stages |", "|---|---|---|---|---|---|---|---|---|---|"]
    for design, m, d, dv in cases:
        n = WIDE_KEYS.get(design, 64)
        c = wide_tile_cycles(design, m, d, dv, n)
        useful = 2 * m * n * (2 * d + 2 * dv + d) / H100.mma_flops_per_clock  # S, dP, dV, dK, dQ once
        bound = max(c.mma, c.smem, c.exp)
        regs = wide_registers(design, m, d, dv, n)["total"]
        stages = max((s for s in (1, 2) if wide_smem_kb(m, d, dv, s, n) <= 227), default=0)
        lines.append(f"| {design} | {m} x {n}, {d}/{dv} | {c.mma:.0f} | {c.smem:.0f} | {c.exp:.0f} | {c.bound} | "
                     f"{useful / bound:.2f} | {bound * 1024 / (m * n):.0f} | {regs:.0f}"
                     f"{' (over)' if regs > WIDE_REGISTER_BUDGET else ''} | {stages or 'none'} |")
    return "\n".join(lines)


WIDE_CASES = [(dsg, m, d, dv) for d, dv in ((192, 128), (256, 256)) for dsg in WIDE_DESIGNS for m in (64, 128)
              if dsg != "swap_keys" or m == 64]


def paper_table() -> str:
    """The paper's backward roofline table (B200, M = N = d = 128), 1-CTA and 2-CTA columns."""
    one = backward_tile_cycles(128, 128, 128, B200)
    two = backward_tile_cycles(128, 128, 128, B200, two_cta=True)
    lines = ["| Resource | 1-CTA (M = 128) | 2-CTA (M = 256) |", "|---|---|---|"]
    for key in one.as_row():
        lines.append(f"| {key} | {one.as_row()[key]:.0f} | {two.as_row()[key]:.0f} |")
    return "\n".join(lines)


def hopper_table(configs) -> str:
    """Markdown: one row per (design, m, n, d, dv): cycles, bound, registers, SMEM."""
    lines = ["| H100 design | tile (m x n), d/dv | MMA | SMEM | exp | bound | acc regs/thread | SMEM KB |",
             "|---|---|---|---|---|---|---|---|"]
    for design, m, n, d, dv in configs:
        c = hopper_tile_cycles(m, n, d, design, dv)
        regs = hopper_registers(m, n, d, design, dv)
        lines.append(f"| {design} | {m} x {n}, {d}/{dv} | {c.mma:.0f} | {c.smem:.0f} | {c.exp:.0f} | {c.bound} | "
                     f"{regs['peak']:.0f} | {hopper_smem_bytes(m, n, d, dv) / 1024:.0f} |")
    return "\n".join(lines)


STEP1_TILES = [("step1_ss", 128, 128, 64, 64), ("step1_ss", 64, 128, 96, 96), ("step1_ss", 64, 128, 128, 128),
               ("step1_ss", 64, 64, 192, 128), ("step1_ss", 64, 64, 256, 256)]

if __name__ == "__main__":
    print("The paper's backward table (B200):")
    print(paper_table())
    print("\nHopper, hopper_step1's tiles (and the RS alternative at d = 128):")
    print(hopper_table(STEP1_TILES + [("step1_ss", 64, 64, 128, 128), ("fa3_rs", 64, 128, 128, 128)]))
    print("\nHopper, wide head dims: designs with dK / dV in registers (per tile of 64 or WIDE_KEYS keys):")
    print(wide_table(WIDE_CASES))
    print("\nBlackwell, the wide backward (blackwell_bwd_wide.py) beside the 1-CTA kernel:")
    print(blackwell_wide_table())
