"""FA4's softmax policy as reusable pieces: a host-side description (`SoftmaxPolicy`) and two
device functions that any forward kernel calls on its own register layout.

The paper changes two things in the online softmax (section "Skipping online softmax
rescaling" and "Emulation of the exponential function"); stage 1 modelled the first in NumPy,
stage 2 built and verified the second on the GPU. This module is where they meet a kernel:

1. `rescale_vote(row_max_old, row_max_new, scale_log2, threshold)` -- conditional rescaling.
   A warp only moves its running maxima (and rescales O and l) when some row's max grew by
   more than `threshold` (tau, log2 units; 8.0 = a factor 256). The decision is one
   `vote.sync.any` over the warp, so it is warp-uniform and the rescale branch never diverges.
   Rows that do not move keep a stale max m; every term 2^(s - m) then stays <= 2^tau, and the
   final O / l and lse = m + log2(l) are still exact (stage 1's docstring has the argument).
   tau = 0 is classic FlashAttention: the warp rescales whenever any row's max grew, and the
   multiplies it skips are multiplies by exactly 1. `rescale_vote_limits(row_max_new, row_limit)`
   is the same vote against per-row limits m + tau / scale_log2 that the caller keeps beside m
   (Hopper's step 4: one compare per row in the loop instead of three instructions).

2. `exp2_row(row, scale_log2, bias, policy)` -- partial exp2 emulation. Each value of a
   thread's row fragment becomes 2^(row[c] * scale_log2 - bias); the values whose position
   matches the policy's compile-time pattern use stage 2's degree-3 polynomial on the FMA pipe
   (FMNMX, FADD.RM, 2 FADD, 3 FFMA, LEA), the others one MUFU.EX2.

   The pattern: `k` emulated out of every `PATTERN_PERIOD` = 16 consecutive fragment values,
   spread evenly (position i of a period is emulated iff floor((i+1)k/16) > floor(ik/16)), so
   the FMA-pipe and MUFU work interleave in program order. k = round(fraction * 16):
   fraction 0.25 -> k = 4 -> positions 3, 7, 11, 15 of each period. Sixteen divides every row
   fragment we have: Hopper holds tile_n / 4 values of a row per thread (32 at tile_n = 128,
   16 at tile_n = 64), Blackwell's softmax warpgroups hold a 128-column row per thread. The
   pattern is over the fragment index, not the column: which columns those are does not
   matter, only that the same fraction of each thread's work moves to the FMA pipe.

Why 0.25 by default: stage 2 measured on an H100 (stage2_emulated_exp/data/
stage2_exp2_throughput_h100.json) that a 30-35% mix maximises exp2 throughput of a pure-exp
loop (1.26x of MUFU alone), but in the attention kernel the FMA pipe also carries the score
scaling, the row max/sum and the O rescale, which moves the optimum lower; the paper reports
10-25% on Blackwell.

Both device functions are `@cute.jit` helpers with no layout knowledge: they take rmem tensors
(a thread's per-row maxima; one row of its score fragment) and loop over `cute.size(...)`. A
Hopper consumer passes 2 rows of 32 values (16 rows per warp vote); the Blackwell softmax
warpgroups pass 1 row of 128 values (32 rows per warp vote).
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32

from stage2_emulated_exp.gpu_kernel import (CLAMP_MIN, ROUND_MAGIC, combine_exponent, ex2_approx_f32,
                                            exp2_emulated_f32, fma_rn_f32, max_f32)

__all__ = [
    "DEFAULT_EMULATION_FRACTION",
    "DEFAULT_POLY_DEGREE",
    "DEFAULT_RESCALE_THRESHOLD",
    "HOPPER_EMULATION_FRACTION",
    "MAX_RESCALE_THRESHOLD",
    "MAX_RESCALE_THRESHOLD_FP16",
    "PATTERN_PERIOD",
    "SoftmaxPolicy",
    "emulation_pattern",
    "exp2_row",
    "exp2_row_packed",
    "rescale_vote",
    "rescale_vote_limits",
    "row_sum_packed",
    "scale_row_packed",
]

DEFAULT_RESCALE_THRESHOLD = 8.0   # tau, log2 units: rescale only when the max grows by > 8 (a factor 2^8)
DEFAULT_EMULATION_FRACTION = 0.25  # of each thread's exp2s on the FMA pipe (the paper's 10-25%)
# Measured inside the Hopper forward on an H100, paired rounds against the official FA4
# (docs/measurements.md): 1, 2 and 3 of every 16 exp2 emulated cost about -2%, -4..-5% and -6..-9%
# at d=64 (the 192-row kernel), up to -4% at d=128 (1/16 ties at one point); 25%: -3..-10%. MUFU is
# not what this kernel waits for (Nsight Compute), so the polynomial only adds instructions. Hopper
# defaults to 0 (all MUFU); pass emulation_fraction to opt in.
HOPPER_EMULATION_FRACTION = 0.0
DEFAULT_POLY_DEGREE = 3           # the paper's choice: within 1 bf16 ulp of MUFU on 99% of inputs
PATTERN_PERIOD = 16
# Headroom: a stale max lets P reach 2^tau (stored in the input dtype) and l reach Sk * 2^tau
# (fp32). fp16 overflows at 65504 < 2^16, so tau <= 15 there; for bf16 / fp32 we stop at 64,
# where Sk * 2^64 * max|V| is still far below the fp32 limit for any realistic Sk.
MAX_RESCALE_THRESHOLD = 64.0
MAX_RESCALE_THRESHOLD_FP16 = 15.0
SUPPORTED_DEGREES = (3, 4, 5)  # below 3 the polynomial error shows up at bf16 precision (paper table)


def emulation_pattern(k: int, period: int = PATTERN_PERIOD) -> tuple:
    """`period` booleans with exactly `k` True, spread evenly (Bresenham)."""
    if not (isinstance(k, int) and 0 <= k <= period):
        raise ValueError(f"k: expected an int in [0, {period}], got {k!r}")
    return tuple((i + 1) * k // period > i * k // period for i in range(period))


@functools.lru_cache(maxsize=None)
def _coefficients(degree: int) -> tuple:
    from stage2_emulated_exp.minimax import resolve_coefficients

    return tuple(float(c) for c in resolve_coefficients(degree))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SoftmaxPolicy:
    """What a forward kernel's softmax does, fixed at compile time (part of the compile key).

    rescale_threshold: tau in log2 units, 0 <= tau <= 64 (<= 15 for fp16, checked by the kernel);
        0 = classic FlashAttention.
    emulation_fraction: share of exp2s computed by the polynomial, in [0, 1]; rounded to the
        nearest multiple of 1/16 (the pattern period), so 0.3 becomes 0.3125. 0 = all MUFU.
    degree: polynomial degree of the emulation, 3 (default), 4 or 5.
    """

    rescale_threshold: float = DEFAULT_RESCALE_THRESHOLD
    emulation_fraction: float = DEFAULT_EMULATION_FRACTION
    degree: int = DEFAULT_POLY_DEGREE

    def __post_init__(self):
        tau, frac, deg = self.rescale_threshold, self.emulation_fraction, self.degree
        if not _is_real(tau):
            raise TypeError(f"rescale_threshold: expected a real number (log2 units), got {tau!r}")
        if not (math.isfinite(tau) and 0.0 <= tau <= MAX_RESCALE_THRESHOLD):
            raise ValueError(f"rescale_threshold: expected 0 <= tau <= {MAX_RESCALE_THRESHOLD} "
                             f"(log2 units), got {tau!r}")
        if not _is_real(frac):
            raise TypeError(f"emulation_fraction: expected a real number, got {frac!r}")
        if not (0.0 <= frac <= 1.0):
            raise ValueError(f"emulation_fraction: expected a value in [0, 1], got {frac!r}")
        if not (isinstance(deg, numbers.Integral) and not isinstance(deg, bool)):
            raise TypeError(f"degree: expected an int, got {deg!r}")
        if deg not in SUPPORTED_DEGREES:
            raise ValueError(f"degree: expected one of {SUPPORTED_DEGREES}, got {deg!r}")
        # normalise, so equal kernels have equal (hashable) policies
        k = int(round(float(frac) * PATTERN_PERIOD))
        object.__setattr__(self, "rescale_threshold", float(tau))
        object.__setattr__(self, "emulation_fraction", k / PATTERN_PERIOD)
        object.__setattr__(self, "degree", int(deg))

    @property
    def emulated_per_period(self) -> int:
        return int(round(self.emulation_fraction * PATTERN_PERIOD))

    @property
    def pattern(self) -> tuple:
        """PATTERN_PERIOD booleans: True = that fragment position is emulated."""
        return emulation_pattern(self.emulated_per_period)

    def row_pair_pattern(self, n: int) -> tuple | None:
        """n // 2 booleans for a row of n values, True = that adjacent pair is emulated (the packed
        f32x2 path, exp2_row_packed); None when the count per period is odd or n is not a whole
        number of periods. The row's k * n / 32 pairs go to its end, every second pair (denser only
        past k = 8): at 2 of 16 and n = 128 the odd pairs of the last quarter. Spread over the row
        (positions 14 and 15 of each 16) or over its middle half, the packed polynomial ran while
        most of the row was still in registers, and some Blackwell builds spilled 8-160 bytes."""
        k = self.emulated_per_period
        if k % 2 or n % PATTERN_PERIOD:
            return None
        pairs, emulated = n // 2, k * n // (2 * PATTERN_PERIOD)
        tail = min(pairs, 2 * emulated)
        if tail == 0:
            return (False,) * pairs
        return (False,) * (pairs - tail) + emulation_pattern(emulated, tail)

    @property
    def emulates(self) -> bool:
        return self.emulated_per_period > 0

    @property
    def coefficients(self) -> tuple:
        """(1.0, p_1, ..., p_degree), float32 values: stage 2's minimax set."""
        return _coefficients(self.degree)

    def check_dtype(self, dtype) -> None:
        """fp16 P overflows past 65504 and a stale max lets P reach 2^tau: tau <= 15 there.
        `dtype`: a cutlass numeric type (cutlass.Float16 / cutlass.BFloat16)."""
        if dtype == cutlass.Float16 and self.rescale_threshold > MAX_RESCALE_THRESHOLD_FP16:
            raise ValueError(f"rescale_threshold: fp16 holds P <= 2^tau only for tau <= "
                             f"{MAX_RESCALE_THRESHOLD_FP16:g}, got {self.rescale_threshold:g}")

    def describe(self) -> str:
        return (f"tau={self.rescale_threshold:g}, emulated {self.emulated_per_period}/{PATTERN_PERIOD} "
                f"(degree {self.degree})")


# ------------------------------------------------------------------------------------------------
# Device functions (called while tracing a kernel; `policy` / `threshold` are compile-time)
# ------------------------------------------------------------------------------------------------
@cute.jit
def rescale_vote(row_max_old: cute.Tensor, row_max_new: cute.Tensor, scale_log2: Float32,
                 threshold: cutlass.Constexpr[float]) -> Boolean:
    """True for the whole warp when any of its rows' max grew by more than `threshold`.

    row_max_old / row_max_new: this thread's running max before and after the current tile
    (raw scores, one entry per row it holds; new >= old). Growth is measured in log2 units
    (times scale_log2 > 0). A row seeing its first key has old = -inf: growth +inf, so it always
    votes yes; a row with nothing visible yet has -inf - -inf = NaN, which votes no.
    """
    need = Boolean(False)
    for r in cutlass.range_constexpr(cute.size(row_max_old)):
        growth = (row_max_new[r] - row_max_old[r]) * scale_log2
        need = need | (growth > Float32(threshold))
    return cute.arch.vote_any_sync(need)


@cute.jit
def rescale_vote_limits(row_max_new: cute.Tensor, row_limit: cute.Tensor) -> Boolean:
    """`rescale_vote` with the threshold folded into a per-row limit m + threshold / scale_log2
    that the caller moves only when m moves: one compare per row in the key-block loop instead of
    a subtract, a multiply and a compare. The decisions differ only at the rounding edge (a growth
    within an ulp of tau). m = -inf gives limit -inf: a row's first visible key votes yes, a row
    with nothing visible (new = -inf) votes no, as in `rescale_vote`.
    """
    need = Boolean(False)
    for r in cutlass.range_constexpr(cute.size(row_limit)):
        need = need | (row_max_new[r] > row_limit[r])
    return cute.arch.vote_any_sync(need)


def _exp2_at(x, c: int, policy):
    """2^x for position c of a row: the polynomial where policy.pattern says so, else MUFU.EX2."""
    if cutlass.const_expr(policy.pattern[c % PATTERN_PERIOD]):
        return exp2_emulated_f32(x, policy.coefficients, True)
    return ex2_approx_f32(x)


def _add_to_chain(sums: list, c: int, p):
    """The running sums of a row, one chain per c % len(sums); a chain starts at its first value."""
    k = c % len(sums)
    sums[k] = p if cutlass.const_expr(sums[k] is None) else sums[k] + p


def _chains_total(sums: list):
    total = sums[0]
    for i in range(1, len(sums)):
        total = total + sums[i]
    return total


def exp2_emulated_f32x2(x0, x1, coefficients):
    """exp2_emulated_f32 of two values with the f32x2 pipe of sm_100: the floor, the fraction and the
    Horner steps one packed op each for both (add.rm / sub.rn / fma.rn .ftz .f32x2, the scalar ops'
    rounding, so each result is the scalar path's bit for bit). A pair of equal constants becomes
    FFMA2's broadcast immediate, so only the leading coefficient takes a register. The clamp (no packed
    max) and the exponent add (an integer add) stay scalar."""
    xc = (max_f32(x0, CLAMP_MIN, ftz=True), max_f32(x1, CLAMP_MIN, ftz=True))
    magic = (Float32(ROUND_MAGIC), Float32(ROUND_MAGIC))
    j = cute.arch.add_packed_f32x2(xc, magic, rnd="rm", ftz=True)
    fl = cute.arch.sub_packed_f32x2(j, magic, rnd="rn", ftz=True)
    f = cute.arch.sub_packed_f32x2(xc, fl, rnd="rn", ftz=True)
    p = (Float32(coefficients[-1]), Float32(coefficients[-1]))
    for c in reversed(coefficients[:-1]):
        p = cute.arch.fma_packed_f32x2(p, f, (Float32(c), Float32(c)), rnd="rn", ftz=True)
    return combine_exponent(p[0], j[0]), combine_exponent(p[1], j[1])


@cute.jit
def scale_row_packed(row: cute.Tensor, scale_log2: Float32, bias: Float32):
    """row[c] <- row[c] * scale_log2 - bias in place, two adjacent values per FFMA2 (fma.rn.f32x2: the
    same rounding per value as exp2_row's FFMA). The first step of exp2 on Blackwell (sm_100)."""
    neg_bias = -bias
    for c in cutlass.range_constexpr(0, cute.size(row), 2):
        row[c], row[c + 1] = cute.arch.fma_packed_f32x2((row[c], row[c + 1]), (scale_log2, scale_log2),
                                                        (neg_bias, neg_bias), rnd="rn")


@cute.jit
def exp2_row_packed(row: cute.Tensor, policy: cutlass.Constexpr, pairs: cutlass.Constexpr):
    """row[c] <- 2^row[c] in place, on a row scale_row_packed has scaled: exp2_row for Blackwell
    (sm_100), whose FMA pipe takes f32x2 pairs. `pairs`: cute.size(row) // 2 booleans (this part's
    slice of policy.row_pair_pattern), True = that adjacent pair is emulated, all packed but the
    clamp and the exponent add (exp2_emulated_f32x2), else two MUFU.EX2; None: policy.pattern per
    value (the scalar polynomial). The row sum is row_sum_packed's, after the caller's P stores."""
    n = cute.size(row)
    for c in cutlass.range_constexpr(n):
        if cutlass.const_expr(pairs is None):
            row[c] = _exp2_at(row[c], c, policy)
        elif cutlass.const_expr(c % 2 == 1):
            pass
        elif cutlass.const_expr(pairs[c // 2]):
            row[c], row[c + 1] = exp2_emulated_f32x2(row[c], row[c + 1], policy.coefficients)
        else:
            row[c], row[c + 1] = ex2_approx_f32(row[c]), ex2_approx_f32(row[c + 1])


@cute.jit
def row_sum_packed(row: cute.Tensor, init: Float32) -> Float32:
    """init + the sum of row, in one f32x2 chain (FADD2: 63 adds for 128 values, then 2 scalar adds;
    the chain starts at its first pair, as exp2_row's). Two or four chains cost up to 11 instructions
    more in the Blackwell softmax loops, and spilled in some builds."""
    acc = (row[0], row[1])
    for c in cutlass.range_constexpr(2, cute.size(row), 2):
        acc = cute.arch.add_packed_f32x2(acc, (row[c], row[c + 1]))
    return init + acc[0] + acc[1]


@cute.jit
def exp2_row(row: cute.Tensor, scale_log2: Float32, bias: Float32, policy: cutlass.Constexpr) -> Float32:
    """row[c] <- 2^(row[c] * scale_log2 - bias) in place; returns this thread's sum of the row.

    Position c uses the polynomial when policy.pattern[c % 16], else MUFU.EX2. The argument is
    one FFMA (fma.rn, so the scaling is rounded once whichever unit finishes the job). The sum
    runs in 4 independent chains (shorter dependency chain than one running sum), each starting
    at its first value: 0 + p is p for every p >= 0, but the compiler may not fold an add of +0.0
    (it would turn -0.0 into +0.0), and those adds were 8 of a d = 64 tile's 76 FADD.
    """
    n = cute.size(row)
    sums = [None] * (4 if n % 4 == 0 else 1)
    for c in cutlass.range_constexpr(n):
        p = _exp2_at(fma_rn_f32(row[c], scale_log2, -bias), c, policy)
        row[c] = p
        _add_to_chain(sums, c, p)
    return _chains_total(sums)
