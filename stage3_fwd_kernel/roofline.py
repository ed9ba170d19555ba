"""Forward-pass "feeds and speeds": cycles per tile for MMA, shared memory and the exp unit.

The paper (§3.1.1) prices one (M x N) tile of the forward loop, head dim d, on three
resources of one SM, and whichever is largest bounds the kernel:

    MMA       two GEMMs (S = Q K^T and O += P V), 2 M N d FLOPs each    -> 4 M N d / FLOPs-per-clock
    SMEM      operand bytes the tensor cores read from shared memory     -> bytes / 128 B per clock
    exp       one exponential per score                                  -> M N / 16 per clock

The SMEM term depends on how the MMA instructions tile the output, because each instruction
re-reads its shared-memory operands:

    Blackwell (tcgen05, 128 x 128 per instruction): S is SS (Q and K from SMEM), P V is TS
    (P from tensor memory, V from SMEM).
    Hopper (wgmma, 64 rows per warpgroup instruction, N up to 256): S is SS, P V is RS (P from
    registers, V from SMEM). Every 64-row warpgroup re-reads the whole K and V tile.

Hopper numbers: H100 SXM does 989 dense bf16 TFLOP/s on 132 SMs at 1.83 GHz boost, i.e.
4096 FLOP/clock/SM (half of B200's 8192); MUFU is 16 ex2/clock/SM on both (NVIDIA's
architecture whitepapers; the paper gives the B200 values). So on Hopper exp/MMA = 64 / d:
head dim 64 is co-bound by the exponential unit, which is where stage 2's emulation can pay.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import ceil


@dataclass(frozen=True)
class Hardware:
    name: str
    mma_flops_per_clock: int  # dense bf16/fp16, per SM
    smem_bytes_per_clock: int
    exp_per_clock: int  # MUFU.EX2
    mma_m: int  # rows of one MMA instruction (per issuing unit)
    mma_n: int  # max columns of one MMA instruction (wgmma: 256; tcgen05 as FA4 issues it: 128)
    pv_a_from_smem: bool = False  # False: P comes from TMEM (Blackwell) or registers (Hopper)


B200 = Hardware("B200 (sm_100a)", 8192, 128, 16, mma_m=128, mma_n=128)
H100 = Hardware("H100 (sm_90a)", 4096, 128, 16, mma_m=64, mma_n=256)


@dataclass(frozen=True)
class TileCycles:
    mma: float
    smem: float
    exp: float

    @property
    def bound(self) -> str:
        worst = max(self.mma, self.smem, self.exp)
        return "+".join(n for n, v in (("MMA", self.mma), ("SMEM", self.smem), ("exp", self.exp)) if v == worst)

    def as_row(self):
        return {"MMA": self.mma, "SMEM": self.smem, "exp": self.exp}


def forward_tile_cycles(m: int, n: int, d: int, hw: Hardware = B200, d_v: int | None = None,
                        bytes_per_el: int = 2, exp_fraction_on_mufu: float = 1.0) -> TileCycles:
    """Cycles one SM spends per (m x n) forward tile on each resource.

    d_v: head dim of V (defaults to d; 128 for the (192, 128) configuration).
    exp_fraction_on_mufu: share of exponentials left on MUFU (stage 2 moves the rest to FMAs).
    """
    d_v = d if d_v is None else d_v
    mma = 2 * m * n * (d + d_v) / hw.mma_flops_per_clock
    row_groups = ceil(m / hw.mma_m)  # instruction rows; each group re-reads K and V in full
    # S = Q K^T: per row group, the Q slice once per N chunk, all of K once
    s_elems = row_groups * (hw.mma_m * d * ceil(n / hw.mma_n) + n * d)
    # O += P V: per row group, all of V once; P only if it lives in SMEM
    pv_elems = row_groups * n * d_v
    if hw.pv_a_from_smem:
        pv_elems += row_groups * hw.mma_m * n * ceil(d_v / hw.mma_n)
    smem = (s_elems + pv_elems) * bytes_per_el / hw.smem_bytes_per_clock
    exp = m * n * exp_fraction_on_mufu / hw.exp_per_clock
    return TileCycles(mma, smem, exp)


def roofline_table(configs, hw: Hardware = B200) -> str:
    """Markdown table: one row per (m, n, d) config, cycles per resource and the bound."""
    lines = [f"| {hw.name}: tile (M x N x d) | MMA | SMEM | exp | bound |", "|---|---|---|---|---|"]
    for m, n, d in configs:
        c = forward_tile_cycles(m, n, d, hw)
        lines.append(f"| {m} x {n} x {d} | {c.mma:.0f} | {c.smem:.0f} | {c.exp:.0f} | {c.bound} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("The paper's table (B200):")
    print(roofline_table([(128, 128, 128), (256, 128, 128)], B200))
    print("\nHopper, two consumer warpgroups of 64 rows (M = 128), N = 128:")
    print(roofline_table([(128, 128, 64), (128, 128, 128), (128, 128, 256), (128, 176, 64), (128, 80, 256)], H100))
