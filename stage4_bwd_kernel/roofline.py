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
