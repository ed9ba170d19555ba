"""Stage 2, part 2: a bit-exact NumPy model of the emulated exp2 instruction sequence.

Compared with stage 1, where `np.exp2` stands in for MUFU.EX2, this models, bit for bit,
what the FMA-pipe emulation computes on the GPU, so the GPU kernel (gpu_kernel.py) can be
tested for *equality*, not closeness, and every accuracy number in accuracy.py is the
number the kernel would produce. The sequence (paper, Cody-Waite range reduction + Horner):

    ptx                                      here                       why
    max.ftz.f32     xc, x, -127.0            xc = max(x, -127)          -inf (masked) -> 0
    add.rm.ftz.f32  j,  xc, 0x4B400000       j = RM(xc + 1.5*2^23)      floor(xc) lands in j's
                                                                        low mantissa bits
    sub.rn.ftz.f32  fl, j,  0x4B400000       fl = j - 1.5*2^23          exact: floor(xc)
    sub.rn.ftz.f32  f,  xc, fl               f  = xc - fl               in [0, 1] (see below)
    fma.rn.ftz.f32  p,  c_n, f, c_{n-1}      Horner, one rounding each  p ~ 2^f in [1, 2)
    ... (n FMAs, last one adds c_0 = 1)
    shl.b32         e,  bits(j), 23          e = floor(xc) << 23        integer pipe
    add.s32         y,  e, bits(p)           y = bits(p) + e            adds floor to exponent

The `.ftz` variants are the ones the official FA4's inline PTX uses (they only matter for
a subnormal x; `ftz=False` models the plain ones). Notes on each step (these are what the
GPU kernel must reproduce exactly):

* Why -127: at xc = -127, f = 0 and p = 1.0 exactly, and bits(1.0) + (-127 << 23) is 0,
  i.e. +0.0. So every x <= -127, including the -inf of a masked score, gives exactly 0.
* `max` follows PTX `max.f32`: if x is NaN (any payload, quiet or signaling) the result is
  the other operand, so NaN -> -127 -> the output is +0.0. `.ftz` first flushes a
  subnormal x to a zero of the same sign. The constant -127 is never NaN or zero, so the
  +-0 and two-NaN cases of max never arise.
* Why 1.5*2^23: for xc in [-2^22, 2^22) the sum lies in [2^23, 2^24), where float32 spacing
  is exactly 1, so rounding toward -inf (the `.rm`) yields floor(xc) + 1.5*2^23 exactly and
  the low 9 mantissa bits of j hold floor(xc) mod 512. The 2^22 term keeps negative xc from
  dropping below 2^23 (where the spacing would halve).
* `fl = j - 1.5*2^23` is exact in any rounding mode: both lie in [2^23, 2^24) (Sterbenz).
* `f = xc - fl` is exact whenever xc >= 0 or xc <= -1 (f is then a multiple of ulp(xc) below
  1, at most 24 significant bits). For xc in (-1, 0) it is 1 + xc, exact iff xc is a
  multiple of 2^-24; otherwise it rounds (to nearest) by < 2^-25, possibly to f = 1.0. The
  polynomial is fitted on the closed [0, 1], so f = 1 is harmless: p(1) ~ 2.
* Horner: p = c_n; p = fma(p, f, c_k) for k = n-1..0. Each FMA rounds once. NumPy has no
  float32 FMA, and fl32(fl64(a*b + c)) rounds twice; `fma_f32` below removes the double
  rounding exactly (error-free TwoSum + a midpoint fix-up).
* Combine: the official FA4 shifts the *bits of j* left by 23, not a converted int: the
  shift discards everything above j's low 9 bits, which are floor(xc) mod 512, so
  e = floor(xc) << 23 (mod 2^32) with no float->int conversion. We model exactly that,
  which also defines the result for inf / huge x. The add is a plain 32-bit integer add:
  it carries into the exponent field, so even p = 2.0 (exponent one higher) combines right.

Behaviour over the whole float32 line (derived from the sequence; tests/test_stage2_cpu.py
checks each case against the exact model):

    x in [-126, 128)     2^floor(x) * p(f): the intended value, a normal float32
                         (finite up to 128: p(1) < 2 for every coefficient set here)
    x in [-127, -126)    exponent field 0: bits read as the subnormal (p - 1) * 2^-126,
                         not p * 2^-127. Wrong, but below 2^-126 (an ftz consumer flushes
                         it to 0 anyway)
    x <= -127, -inf, NaN clamped to -127 -> +0.0 (NaN is swallowed, not propagated)
    +-0, |x| < 2^-126    1.0 with ftz; without ftz a negative subnormal gives p(1)/2 ~ 1.0
    x = 128              +inf (p = 1.0, exponent field 255)
    x in (128, 2^22)     garbage: floor << 23 keeps floor mod 512, so the result repeats every
                         512: NaN / inf bit patterns at floor mod 512 = 128 and 384, negative
                         outputs for floor mod 512 in (128, 384), otherwise finite positive values
                         of the wrong size (exp2(512.5) gives 1.414)
    x >= 2^22, +inf      garbage; +inf gives NaN (f = inf - inf)

The supported domain is x < 128 (the kernels feed x = (S - m) * scale * log2(e) <= tau = 8
with conditional rescaling) and the result is *accurate* for x >= -126.

NaN *results* of float instructions are the GPU's canonical NaN 0x7FFFFFFF (NVIDIA GPUs
carry no NaN payloads in fp32); the model canonicalizes after every float op so it matches.
A NaN bit pattern made by the final integer add (x in [128, 129)) is not canonicalized,
on the GPU either.
"""
from __future__ import annotations

import numpy as np

from .minimax import resolve_coefficients

__all__ = [
    "CANONICAL_NAN_BITS",
    "CLAMP_MIN",
    "ROUND_INT",
    "add_rm_f32",
    "as_bits",
    "exp2_emulated",
    "exp2_emulated_steps",
    "fma_f32",
    "from_bits",
]

ROUND_INT = np.float32(2.0**23 + 2.0**22)  # 12582912.0, bits 0x4B400000
CLAMP_MIN = np.float32(-127.0)  # bits 0xC2FE0000
CANONICAL_NAN_BITS = np.uint32(0x7FFFFFFF)
_TINY = np.float32(2.0**-126)  # smallest normal float32
_BIG_MID = 2.0**128 - 2.0**103  # halfway between FLT_MAX and 2^128: RN overflow threshold


def as_bits(x) -> np.ndarray:
    """float32 values -> their uint32 bit patterns, same shape (0-d stays 0-d)."""
    a = np.array(x, dtype=np.float32, order="C", copy=None)
    return a.view(np.uint32)


def from_bits(u) -> np.ndarray:
    """uint32 bit patterns -> float32 values, same shape."""
    a = np.array(u, dtype=np.uint32, order="C", copy=None)
    return a.view(np.float32)


def _canon(x: np.ndarray) -> np.ndarray:
    """Replace every NaN by the GPU's canonical NaN (bits 0x7FFFFFFF)."""
    nan = np.isnan(x)
    if nan.any():
        x = x.copy()
        x.view(np.uint32)[nan] = CANONICAL_NAN_BITS
    return x


def _flush(x: np.ndarray, ftz: bool) -> np.ndarray:
    """PTX .ftz: a subnormal operand or result becomes a zero of the same sign."""
    if not ftz:
        return x
    bits = x.view(np.uint32)
    sub = ((bits & np.uint32(0x7F800000)) == 0) & ((bits & np.uint32(0x007FFFFF)) != 0)
    if sub.any():
        bits = bits.copy()
        bits[sub] &= np.uint32(0x80000000)
        return bits.view(np.float32)
    return x


def _two_sum(a: np.ndarray, b: np.ndarray):
    """Knuth's TwoSum in float64: s = fl(a + b) and e with a + b = s + e exactly."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def _round_sum_to_f32(s: np.ndarray, e: np.ndarray, mode: str) -> np.ndarray:
    """Round the exact value v = s + e (float64 pair from TwoSum, |e| <= ulp64(s)/2) to
    float32 with ONE rounding: 'rn' (nearest, ties to even) or 'rm' (toward -inf).

    r = fl32(s) is the float32 nearest to s. It can differ from the one nearest to v only
    when s sits exactly on a float32 midpoint and e != 0 (v is then just off the midpoint,
    on e's side: RN64 is monotone, so no midpoint lies strictly between v and s).
    d = s - r is exact (r is within half a float32 ulp of s), and d + e has the sign of v - r
    (a rounded sum is zero only if the exact sum is, and keeps its sign otherwise).
    """
    pos_inf, neg_inf = np.float32(np.inf), np.float32(-np.inf)
    with np.errstate(invalid="ignore", over="ignore"):
        r = s.astype(np.float32)
        d = s - r.astype(np.float64)
        overflow = np.isinf(r) & np.isfinite(s)  # |s| >= 2^128 - 2^103
        if mode == "rm":
            out = np.where(d + e < 0, np.nextafter(r, neg_inf), r)
            # RM never overflows upward: a finite v > FLT_MAX rounds down to FLT_MAX
            out = np.where(overflow & (s > 0), np.nextafter(pos_inf, neg_inf), out)
        elif mode == "rn":
            toward_s = np.nextafter(r, np.where(d > 0, pos_inf, neg_inf))
            gap = np.abs(toward_s.astype(np.float64) - r.astype(np.float64))
            on_midpoint = (d != 0) & (2.0 * np.abs(d) == gap)
            out = np.where(on_midpoint & (np.sign(e) == np.sign(d)), toward_s, r)
            # the overflow threshold itself is a midpoint too: pulled inward -> +-FLT_MAX
            inward = overflow & (np.abs(s) == _BIG_MID) & (np.sign(e) == -np.sign(s))
            out = np.where(inward, np.nextafter(r, np.float32(0)), out)
        else:
            raise ValueError(f"unknown rounding mode {mode!r}")
        # an inf or NaN operand: the IEEE result is fl(s) itself (e is NaN there)
        out = np.where(np.isfinite(s), out, r)
    return out.astype(np.float32)


def _fma_rn(a: np.ndarray, b64: np.ndarray, c64, ftz: bool) -> np.ndarray:
    """fma.rn(.ftz).f32 on operands that are already flushed; b and c given in float64.

    a*b is exact in float64 (24 + 24 significant bits <= 53, exponents far inside float64's
    range), so s = fl64(a*b + c) has rounded once, and fl32(s) is right unless s landed
    exactly on a float32 midpoint (double rounding) or in float32's subnormal range (where
    the midpoint test below does not apply) or is NaN. Only those rare lanes take the slow
    exact path: TwoSum for the error of s, then one correct rounding.
    """
    ab = a.astype(np.float64) * b64
    s = ab + c64
    r = s.astype(np.float32)
    # a float32 midpoint in float64 has bit 28 set and bits 27..0 clear (53 - 24 = 29 bits)
    frac_bits = s.view(np.uint64) & np.uint64(0x1FFFFFFF)
    slow = (frac_bits == np.uint64(0x10000000)) | ~(np.abs(s) >= 2.0**-126)
    if slow.any():
        idx = np.nonzero(slow)[0]
        cc = np.broadcast_to(c64, s.shape)[idx]
        ss, ee = _two_sum(ab[idx], cc)
        r[idx] = _canon(_flush(_round_sum_to_f32(ss, ee, "rn"), ftz))
    return r


def fma_f32(a, b, c, *, ftz: bool = False) -> np.ndarray:
    """Bit-exact float32 fused multiply-add round(a*b + c): round-to-nearest-even, ONE
    rounding (PTX fma.rn.f32, or fma.rn.ftz.f32 with ftz=True). Arrays broadcast.

    The naive fl32(fl64(a*b + c)) rounds twice and is wrong when the float64 sum lands on a
    float32 midpoint; see _fma_rn for how that is detected and fixed.
    """
    a, b, c = np.broadcast_arrays(*(np.asarray(v, dtype=np.float32) for v in (a, b, c)))
    shape = a.shape
    a, b, c = (_flush(np.ascontiguousarray(v).ravel(), ftz) for v in (a, b, c))
    with np.errstate(invalid="ignore", over="ignore"):
        out = _fma_rn(a, b.astype(np.float64), c.astype(np.float64), ftz)
    return out.reshape(shape)


def add_rm_f32(a, b, *, ftz: bool = False) -> np.ndarray:
    """Bit-exact float32 a + b rounded toward -inf (PTX add.rm.f32). In this mode an exact
    zero sum is -0 unless both operands are +0 (IEEE 754, section 6.3)."""
    a, b = np.broadcast_arrays(*(np.asarray(v, dtype=np.float32) for v in (a, b)))
    shape = a.shape
    a, b = (_flush(np.ascontiguousarray(v).ravel(), ftz) for v in (a, b))
    with np.errstate(invalid="ignore", over="ignore"):
        s, e = _two_sum(a.astype(np.float64), b.astype(np.float64))
    out = _round_sum_to_f32(s, e, "rm")
    # an exact zero sum (s = e = 0) is -0 here unless both operands are +0
    exact_zero = (s == 0) & (e == 0) & ~((a == 0) & (b == 0) & ~np.signbit(a) & ~np.signbit(b))
    out = np.where(exact_zero, np.float32(-0.0), out).astype(np.float32)
    return _canon(_flush(out, ftz)).reshape(shape)


def _add_rm_round_int(xc: np.ndarray, ftz: bool) -> np.ndarray:
    """add.rm(.ftz).f32 xc + 1.5*2^23, fast. For xc in [-2^22, 2^22) the exact result is
    floor(xc) + 1.5*2^23 (spacing 1 in [2^23, 2^24), see module docstring): np.floor is
    exact in float32 and the add is then exact too. Other lanes (huge, inf, NaN) take the
    general add_rm_f32."""
    inside = np.abs(xc) < np.float32(2.0**22)  # False for NaN
    j = (np.floor(np.where(inside, xc, 0)) + ROUND_INT).astype(np.float32)
    if not inside.all():
        idx = np.nonzero(~inside)[0]
        j[idx] = add_rm_f32(xc[idx], ROUND_INT, ftz=ftz)
    return j


def _sub_rn_f32(a: np.ndarray, b: np.ndarray, ftz: bool) -> np.ndarray:
    # NumPy's float32 subtract is one IEEE round-to-nearest-even operation, as sub.rn.f32
    with np.errstate(invalid="ignore", over="ignore"):
        return _canon(_flush(_flush(a, ftz) - _flush(b, ftz), ftz))


def exp2_emulated_steps(x, degree: int = 3, coefficients=None, *,
                        ftz: bool = True) -> dict:
    """Every intermediate of the sequence (float32 arrays, uint32 for the integer ones):
    xc, j, floor, frac, poly, out. For locating a GPU mismatch to one instruction."""
    coeffs = resolve_coefficients(degree, coefficients)
    x = np.asarray(x, dtype=np.float32)
    shape = x.shape
    x = np.ascontiguousarray(x).ravel()
    # 1. clamp; a NaN (quiet or signaling) yields the other operand, like PTX max.f32
    #    (np.fmax would quiet a signaling NaN instead)
    x = _flush(x, ftz)
    xc = np.where(x > CLAMP_MIN, x, CLAMP_MIN).astype(np.float32)
    # 2. floor(xc) into j's low mantissa bits (round toward -inf), then back out (exact)
    j = _add_rm_round_int(xc, ftz)
    fl = _sub_rn_f32(j, ROUND_INT, ftz)
    # 3. fractional part, in [0, 1]
    f = _sub_rn_f32(xc, fl, ftz)
    # 4. Horner: p = c_n; p = fma(p, f, c_k), k = n-1 .. 0 (each one rounding)
    c32 = _flush(np.array(coeffs, dtype=np.float32), ftz)
    f64 = f.astype(np.float64)
    p = np.full(x.shape, c32[-1], dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        for ck in c32[-2::-1]:
            p = _fma_rn(p, f64, np.float64(ck), ftz)
        p = _canon(p)
    # 5. integer pipe: shl.b32 bits(j), 23 ; add.s32 (both wrap mod 2^32)
    e = as_bits(j) << np.uint32(23)
    out_bits = as_bits(p) + e
    steps = {"xc": xc, "j": j, "floor": fl, "frac": f, "poly": p, "exp_bits": e,
             "out": from_bits(out_bits)}
    return {k: v.reshape(shape) for k, v in steps.items()}


def exp2_emulated(x, degree: int = 3, coefficients=None, *,
                  ftz: bool = True) -> np.ndarray:
    """2^x the way the FMA-pipe emulation computes it, bit for bit (float32 in and out).

    `coefficients` ([1.0, p_1, ..., p_n], float32 values) default to our minimax ones for
    `degree` (minimax.minimax_coefficients); pass minimax.OFFICIAL_FA4_COEFFICIENTS[n] to
    model the official FA4. `ftz=True` models the `.ftz` instructions the official kernel
    uses; it only changes the result for subnormal x. See the module docstring for the
    behaviour outside the supported domain x in [-126, 128).
    """
    return exp2_emulated_steps(x, degree, coefficients, ftz=ftz)["out"]
