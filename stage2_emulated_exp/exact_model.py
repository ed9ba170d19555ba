"""Stage 2, part 3: the emulated exp2 once more, slowly and obviously right.

host_model.py is fast because it leans on float64 tricks (exact products, TwoSum, a midpoint
test on float64 bit patterns). Tricks need a witness. This module redoes the same
instruction sequence with Python integers and `fractions.Fraction` only: every float32 is
decoded to an exact rational, every instruction computes the exact real result and then
rounds it with an IEEE 754 binary32 rounding written out below (nearest-even or toward -inf,
with subnormals, overflow, signed zeros, ftz). No NumPy, no float arithmetic on values.
Tests compare the two bit for bit; this one is ~10^4 times slower, so it checks thousands
of points, not millions.
"""
from __future__ import annotations

from fractions import Fraction

from .minimax import resolve_coefficients

__all__ = ["bits_to_float", "decode", "exp2_emulated_exact", "exp2_emulated_exact_bits",
           "f32_add", "f32_fma", "f32_max", "f32_sub", "float_to_bits", "round_to_f32"]

MANT = 23  # stored fraction bits of binary32
BIAS = 127
EMIN = 1 - BIAS  # -126, exponent of the smallest normal
EMAX = BIAS  # 127
SIGN = 1 << 31
CANONICAL_NAN = 0x7FFFFFFF  # what NVIDIA GPUs return for any fp32 NaN result
POS_INF, NEG_INF = 0x7F800000, 0xFF800000
ROUND_INT = 0x4B400000  # 2^23 + 2^22
CLAMP_MIN = 0xC2FE0000  # -127.0


def _pow2(k: int) -> Fraction:
    return Fraction(1 << k) if k >= 0 else Fraction(1, 1 << -k)


def _is_nan(b: int) -> bool:
    return (b & 0x7F800000) == 0x7F800000 and (b & 0x7FFFFF) != 0


def _is_inf(b: int) -> bool:
    return (b & 0x7FFFFFFF) == POS_INF


def _is_zero(b: int) -> bool:
    return (b & 0x7FFFFFFF) == 0


def _is_subnormal(b: int) -> bool:
    return (b & 0x7F800000) == 0 and (b & 0x7FFFFF) != 0


def _neg(b: int) -> bool:
    return bool(b & SIGN)


def decode(b: int) -> Fraction:
    """Exact value of a finite float32 bit pattern (the sign of zero is lost: check _neg)."""
    e, m = (b >> MANT) & 0xFF, b & ((1 << MANT) - 1)
    if e == 0xFF:
        raise ValueError("inf/NaN has no rational value")
    mag = Fraction(m) * _pow2(EMIN - MANT) if e == 0 else \
        Fraction((1 << MANT) | m) * _pow2(e - BIAS - MANT)
    return -mag if _neg(b) else mag


def round_to_f32(v: Fraction, mode: str = "rn", zero_negative: bool = False) -> int:
    """Round an exact rational to binary32 bits. mode 'rn' = nearest, ties to even;
    'rm' = toward -inf. `zero_negative` gives the sign when v is exactly 0."""
    if v == 0:
        return SIGN if zero_negative else 0
    neg, a = v < 0, abs(v)
    # exponent E with 2^E <= a < 2^(E+1)
    E = a.numerator.bit_length() - a.denominator.bit_length()
    if a < _pow2(E):
        E -= 1
    # quantum: 2^(E-23) for normals, 2^-149 for everything below 2^-126
    q = max(E, EMIN) - MANT
    scaled = a / _pow2(q)
    n = scaled.numerator // scaled.denominator  # truncated significand (integer)
    rem = scaled - n
    if mode == "rn":
        if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1):
            n += 1
    elif mode == "rm":
        if neg and rem > 0:  # toward -inf: a negative number's magnitude rounds up
            n += 1
    else:
        raise ValueError(f"unknown rounding mode {mode!r}")
    if n == 1 << (MANT + 1):  # carried into the next binade
        n, q = n >> 1, q + 1
    if q + MANT > EMAX:  # overflow
        if mode == "rm" and not neg:
            return 0x7F7FFFFF  # FLT_MAX: round toward -inf never reaches +inf
        return NEG_INF if neg else POS_INF
    if n < (1 << MANT):  # subnormal (q == -149) or rounded to zero
        bits = n
    else:
        bits = ((q + MANT + BIAS) << MANT) | (n - (1 << MANT))
    return bits | (SIGN if neg else 0)


def _ftz_in(b: int, ftz: bool) -> int:
    return (b & SIGN) if ftz and _is_subnormal(b) else b


def _ftz_out(b: int, ftz: bool) -> int:
    # flushed after rounding; the one case this could matter (a value that rounds up to
    # exactly 2^-126) never arises in the exp2 sequence
    return (b & SIGN) if ftz and _is_subnormal(b) else b


def f32_max(a: int, b: int, ftz: bool = False) -> int:
    """PTX max.f32: a NaN operand is ignored (the other one is returned); two NaNs give
    the canonical NaN. (max(+0, -0) returns +0; that case never arises in the sequence.)"""
    a, b = _ftz_in(a, ftz), _ftz_in(b, ftz)
    if _is_nan(a) and _is_nan(b):
        return CANONICAL_NAN
    if _is_nan(a):
        return b
    if _is_nan(b):
        return a

    def key(x):  # total order of the non-NaN values, -0 below +0
        if _is_inf(x):
            return (1 if not _neg(x) else -1, 0)
        return (0, decode(x), 0 if _neg(x) else 1)

    return a if key(a) >= key(b) else b


def f32_add(a: int, b: int, mode: str = "rn", ftz: bool = False) -> int:
    """a + b with one rounding (PTX add.{rn,rm}[.ftz].f32)."""
    a, b = _ftz_in(a, ftz), _ftz_in(b, ftz)
    if _is_nan(a) or _is_nan(b):
        return CANONICAL_NAN
    if _is_inf(a) or _is_inf(b):
        if _is_inf(a) and _is_inf(b) and _neg(a) != _neg(b):
            return CANONICAL_NAN  # inf - inf
        return a if _is_inf(a) else b
    v = decode(a) + decode(b)
    if v == 0:  # IEEE 754 6.3: same-signed zeros keep their sign, else -0 only under RM
        if _is_zero(a) and _is_zero(b) and _neg(a) == _neg(b):
            zero_neg = _neg(a)
        else:
            zero_neg = mode == "rm"
        return round_to_f32(v, mode, zero_neg)
    return _ftz_out(round_to_f32(v, mode), ftz)


def f32_sub(a: int, b: int, mode: str = "rn", ftz: bool = False) -> int:
    return f32_add(a, b ^ SIGN, mode, ftz)


def f32_fma(a: int, b: int, c: int, ftz: bool = False) -> int:
    """a * b + c with ONE rounding to nearest even (PTX fma.rn[.ftz].f32)."""
    a, b, c = _ftz_in(a, ftz), _ftz_in(b, ftz), _ftz_in(c, ftz)
    if _is_nan(a) or _is_nan(b) or _is_nan(c):
        return CANONICAL_NAN
    prod_neg = _neg(a) != _neg(b)
    if _is_inf(a) or _is_inf(b):
        if _is_zero(a) or _is_zero(b):
            return CANONICAL_NAN  # inf * 0
        if _is_inf(c) and _neg(c) != prod_neg:
            return CANONICAL_NAN  # inf - inf
        return NEG_INF if prod_neg else POS_INF
    if _is_inf(c):
        return c
    prod = decode(a) * decode(b)
    v = prod + decode(c)
    if v == 0:
        if prod == 0 and _is_zero(c) and prod_neg == _neg(c):
            zero_neg = prod_neg
        else:
            zero_neg = False  # round to nearest: an exact cancellation is +0
        return round_to_f32(v, "rn", zero_neg)
    return _ftz_out(round_to_f32(v, "rn"), ftz)


def float_to_bits(x: float) -> int:
    """Bits of a Python float that holds a float32 value (NaN -> canonical NaN)."""
    if x != x:
        return CANONICAL_NAN
    if x in (float("inf"), float("-inf")):
        return POS_INF if x > 0 else NEG_INF
    neg = x < 0 or (x == 0 and str(x).startswith("-"))
    bits = round_to_f32(Fraction(x), "rn", neg)
    if decode(bits) != Fraction(x):
        raise ValueError(f"{x!r} is not a float32 value")
    return bits


def bits_to_float(b: int) -> float:
    if _is_nan(b):
        return float("nan")
    if _is_inf(b):
        return float("-inf") if _neg(b) else float("inf")
    v = float(decode(b))  # exact: a float32 value fits a float64
    return -0.0 if v == 0 and _neg(b) else v


def exp2_emulated_exact_bits(x_bits: int, degree: int = 3, coefficients=None,
                             ftz: bool = True) -> int:
    """The emulated exp2 on float32 bits, instruction by instruction (see host_model's
    docstring for the PTX), returning the result's bits."""
    coeffs = [float_to_bits(c) for c in resolve_coefficients(degree, coefficients)]
    xc = f32_max(x_bits, CLAMP_MIN, ftz)  # max.ftz.f32
    j = f32_add(xc, ROUND_INT, "rm", ftz)  # add.rm.ftz.f32
    fl = f32_sub(j, ROUND_INT, "rn", ftz)  # sub.rn.ftz.f32
    f = f32_sub(xc, fl, "rn", ftz)  # sub.rn.ftz.f32
    p = coeffs[-1]
    for ck in reversed(coeffs[:-1]):  # fma.rn.ftz.f32, Horner
        p = f32_fma(p, f, ck, ftz)
    e = (j << 23) & 0xFFFFFFFF  # shl.b32
    return (e + p) & 0xFFFFFFFF  # add.s32 (two's complement wraps)


def exp2_emulated_exact(x_scalar: float, degree: int = 3, coefficients=None,
                        ftz: bool = True) -> float:
    """Same as host_model.exp2_emulated for one float32 value, returned as a Python float
    (NaN results come back as float('nan'); use exp2_emulated_exact_bits to see bits)."""
    return bits_to_float(exp2_emulated_exact_bits(float_to_bits(x_scalar), degree,
                                                  coefficients, ftz))
