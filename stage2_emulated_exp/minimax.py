"""Stage 2, part 1: the polynomial behind the software exp2 (minimax coefficients, in mpmath).

Compared with stage 1, which calls `exp2` for every score (MUFU.EX2 on the GPU), stage 2
computes some of those exponentials on the FP32 FMA pipe instead. The reason is throughput
(paper, "Emulation of the exponential function"):

    MUFU.EX2:      16 ops / clk / SM   (B200 and H100 alike)
    FP32 FMA:     128 ops / clk / SM   (4 sub-partitions x 32 lanes)
    tensor core: 8192 FLOP / clk / SM  (B200 bf16 dense; ~4096 on H100)

Each score costs 4*d MMA FLOPs (QK^T and PV) and one exponential. At d = 128 on B200 that
is 512 / 8192 = 1/16 clk of tensor core against 1/16 clk of MUFU: the exponential is as
slow as the matmuls (on H100 the same tie happens at d = 64: 256 / 4096 = 1/16). One
emulated exp2 of degree 3 is ~6 FMA-pipe ops (round, 2 subs, 3 FMAs; the clamp, shift and
integer add can go to the ALU pipe), i.e. 128 / 6 ~ 21 exp2 / clk / SM on a pipe MUFU does
not use. The FMA pipe also does the rest of softmax, so FA4 emulates only 10-25% of them.

2^x = 2^floor(x) * 2^f with f = x - floor(x) in [0, 1). The integer part is an exponent
edit (host_model.py); the fraction needs a polynomial

    p(f) = p_0 + p_1 f + ... + p_n f^n,   p_0 = 1  (so 2^x is exact at every integer x)

whose maximum *relative* error  max_{f in [0,1]} |p(f) / 2^f - 1|  is as small as possible.
This module finds it with the Remez exchange algorithm in mpmath, rounds it to float32
(plainly, and with a rounding-aware refit that wins at degrees 3-5), measures what the
rounding costs, and compares with the coefficients the official FA4 ships (from Sollya's
fpminimax, which searches float32 coefficients directly).

Why a weighted fit: with p_0 = 1 fixed, write p(f) = 1 + f q(f) with q of degree n - 1.
The relative error is

    e(f) = (1 + f q(f)) / 2^f - 1 = w(f) (q(f) - g(f)),   w(f) = f / 2^f,  g(f) = (2^f - 1) / f

so we fit the smooth function g (g(0) = ln 2) by a polynomial of degree n - 1 under the
weight w. That has n free coefficients, so the best fit equioscillates on n + 1 points
(Chebyshev alternation theorem). w(0) = 0, so e(0) = 0 and no alternation point sits at 0.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import mpmath
from mpmath import mp, mpf

__all__ = [
    "DPS",
    "OFFICIAL_FA4_COEFFICIENTS",
    "SUPPORTED_DEGREES",
    "coefficient_table",
    "float32_rounding_effect",
    "max_rel_error",
    "minimax_coefficients",
    "minimax_error",
    "refit_coefficients",
    "remez",
    "remez_fit",
    "RemezResult",
    "resolve_coefficients",
    "round_to_float32",
    "rounded_coefficients",
    "RoundingEffect",
]

DPS = 50  # decimal digits for every mpmath computation here (~166 bits)
SUPPORTED_DEGREES = (1, 2, 3, 4, 5)

# The official FA4 coefficients (a published fact, numbers only): repository
# Dao-AILab/flash-attention, file flash_attn/cute/utils.py, dict `POLY_EX2` (as stored at
# commit 009739ff4842dc438b0ff1b7ada0475e3b5f621d). Its comment says they come from Sollya:
# fpminimax(exp(x * log(2.0)), deg, [|1,24...|], [0;1], relative), i.e. p_0 held to 1 bit
# (= 1.0) and p_1..p_n to 24 bits (float32). `ex2_emulation` there uses degree 3 by default;
# the inline-PTX `e2e_asm2` hard-codes the same degree-3 values as 0f3F31F519, 0f3E6906A4,
# 0f3D9DF09D (the tests check that these agree).
OFFICIAL_FA4_COEFFICIENTS: dict[int, tuple[float, ...]] = {
    1: (1.0, 0.922497093677520751953125),
    2: (1.0, 0.6657850742340087890625, 0.330107033252716064453125),
    3: (1.0, 0.695146143436431884765625, 0.227564394474029541015625,
        0.077119089663028717041015625),
    4: (1.0, 0.693042695522308349609375, 0.2412912547588348388671875,
        5.2225358784198760986328125e-2, 1.3434938155114650726318359375e-2),
    5: (1.0, 0.693151414394378662109375, 0.24016360938549041748046875,
        5.5802188813686370849609375e-2, 9.01452265679836273193359375e-3,
        1.86810153536498546600341796875e-3),
}


@dataclass(frozen=True)
class RemezResult:
    """The converged minimax fit: p = [1, p_1, ..., p_n], the reference points
    x_0 < ... < x_m in (0, 1] (m = number of free coefficients) with e(x_i) = (-1)^i E, and E.
    At convergence the x_i are the extrema of e and no |e| on [0, 1] exceeds |E|."""

    degree: int
    coefficients: tuple  # of mpf, p_0 first
    points: tuple  # of mpf
    levelled_error: mpf  # signed E; |E| is the minimax relative error
    iterations: int


def _poly(coeffs, f):
    """p(f) by Horner, in whatever arithmetic `f` carries (mpf here)."""
    acc = mpf(0)
    for c in reversed(coeffs):
        acc = acc * f + c
    return acc


def _rel_err(coeffs, f):
    return _poly(coeffs, f) / mpmath.power(2, f) - 1


def _critical_points(coeffs):
    """Interior extrema of e(f) = p(f) / 2^f - 1 on (0, 1).

    e'(f) = (p'(f) - ln2 p(f)) / 2^f, and p' - ln2 p is again a polynomial of degree n, so the
    extrema are polynomial roots: no grid search, no missed peak.
    """
    n = len(coeffs) - 1
    ln2 = mpmath.ln(2)
    # d_k = (k+1) p_{k+1} - ln2 p_k, for k = 0..n (p_{n+1} = 0)
    d = [(k + 1) * coeffs[k + 1] - ln2 * coeffs[k] if k < n else -ln2 * coeffs[k]
         for k in range(n + 1)]
    if n == 0:
        return []
    roots = mpmath.polyroots(list(reversed(d)), maxsteps=500, extraprec=2 * mp.prec)
    eps = mpf(10) ** (-(mp.dps // 2))
    real = sorted(mpmath.re(r) for r in roots if abs(mpmath.im(r)) < eps)
    return [r for r in real if 0 < r < 1]


def _alternating_subset(xs, es, size):
    """From candidate extrema (sorted) keep `size` consecutive sign-alternating ones that
    include the global max |e| and have the largest smallest |e|."""
    pts, errs = [], []
    for x, e in zip(xs, es):  # merge runs of equal sign, keeping the bigger peak
        if errs and (e > 0) == (errs[-1] > 0):
            if abs(e) > abs(errs[-1]):
                pts[-1], errs[-1] = x, e
        else:
            pts.append(x)
            errs.append(e)
    if len(pts) <= size:
        return pts, errs
    g = max(range(len(errs)), key=lambda i: abs(errs[i]))
    starts = [s for s in range(len(pts) - size + 1) if s <= g < s + size]
    s = max(starts, key=lambda s: min(abs(e) for e in errs[s:s + size]))
    return pts[s:s + size], errs[s:s + size]


def _single_exchange(pts, coeffs):
    """Remez's one-point exchange: swap the global maximum of |e| into the reference so
    signs keep alternating. |E| then grows strictly (de la Vallee Poussin), so it cannot
    cycle; the multi-point exchange can, when two references are nearly tied."""
    cands = _critical_points(coeffs) + [mpf(1)]
    xstar = max(cands, key=lambda x: abs(_rel_err(coeffs, x)))
    sgn = lambda x: _rel_err(coeffs, x) > 0  # noqa: E731
    pts = list(pts)
    if xstar in pts:
        return pts
    i = sum(1 for x in pts if x < xstar)  # xstar lies between pts[i-1] and pts[i]
    if i == 0:
        pts = [xstar] + (pts[1:] if sgn(pts[0]) == sgn(xstar) else pts[:-1])
    elif i == len(pts):
        pts = (pts[:-1] if sgn(pts[-1]) == sgn(xstar) else pts[1:]) + [xstar]
    else:
        j = i - 1 if sgn(pts[i - 1]) == sgn(xstar) else i
        pts[j] = xstar
    return pts


def remez(degree: int, *, fixed: dict | None = None, dps: int = DPS,
          max_iter: int = 200) -> RemezResult:
    """Remez exchange for min over p_1..p_n of max_{[0,1]} |p(f)/2^f - 1| with p_0 = 1
    (and optionally some p_k held at given values, `fixed = {k: p_k}`).

    Each iteration (a) solves the m + 1 linear equations for the m free coefficients
        p(x_i) - 2^{x_i} = (-1)^i E 2^{x_i}          (unknowns: free p_k and E)
    on the current reference points, then (b) moves the points to the extrema of the new
    error curve (multi-point exchange; one-point exchange if that stops improving). It
    stops when the extrema are levelled: max |e| over all extrema equals |E| to ~dps/2
    digits. Convergence of the multi-point exchange is quadratic: ~5 iterations here.
    """
    if degree not in SUPPORTED_DEGREES:
        raise ValueError(f"degree must be one of {SUPPORTED_DEGREES}, got {degree}")
    n = degree
    fixed = dict(fixed or {})
    free = [k for k in range(1, n + 1) if k not in fixed]
    m = len(free)
    if m == 0:
        raise ValueError("nothing left to fit")
    with mp.workdps(dps):
        fixed_mp = {k: mpf(v) for k, v in fixed.items()}
        # start from Chebyshev extrema mapped to (0, 1]: the last one is f = 1
        pts = [(1 - mpmath.cos(mpmath.pi * (i + 1) / (m + 1))) / 2 for i in range(m + 1)]
        tol = mpf(10) ** (-(dps // 2))
        best_E, single = mpf(0), False
        for it in range(1, max_iter + 1):
            A = mpmath.matrix(m + 1, m + 1)
            rhs = mpmath.matrix(m + 1, 1)
            for i, x in enumerate(pts):
                two_x = mpmath.power(2, x)
                for col, k in enumerate(free):
                    A[i, col] = x**k
                A[i, m] = -((-1) ** i) * two_x
                rhs[i] = two_x - 1 - sum(c * x**k for k, c in fixed_mp.items())
            sol = mpmath.lu_solve(A, rhs)
            coeffs = [mpf(1)] + [mpf(0)] * n
            for k, c in fixed_mp.items():
                coeffs[k] = c
            for col, k in enumerate(free):
                coeffs[k] = sol[col]
            E = sol[m]

            # extrema: interior roots of p' - ln2 p, plus f = 1 (e(0) = 0 is never extreme)
            cands = _critical_points(coeffs) + [mpf(1)]
            errs = [_rel_err(coeffs, x) for x in cands]
            if max(abs(e) for e in errs) / abs(E) - 1 < tol:
                # e(pts) = +-E by construction; levelled extrema make E optimal
                return RemezResult(n, tuple(coeffs), tuple(pts), E, it)
            if abs(E) <= best_E:
                single = True  # the multi-point exchange went round in a circle
            best_E = max(best_E, abs(E))
            if single:
                pts = _single_exchange(pts, coeffs)
            else:
                new_pts, _ = _alternating_subset(cands, errs, m + 1)
                if len(new_pts) != m + 1:
                    raise RuntimeError(f"Remez degree {n}: only {len(new_pts)} alternating "
                                       f"extrema, need {m + 1} (iteration {it})")
                pts = new_pts
    raise RuntimeError(f"Remez degree {n} (fixed {sorted(fixed)}) did not converge "
                       f"in {max_iter} iterations")


@functools.lru_cache(maxsize=None)
def _remez_cached(degree: int) -> RemezResult:
    return remez(degree)


def remez_fit(degree: int) -> list:
    """The real (unrounded) minimax coefficients [1, p_1, ..., p_n] as mpf (DPS digits)."""
    return list(_remez_cached(degree).coefficients)


def round_to_float32(value) -> float:
    """Round an mpf straight to the nearest float32 (ties to even), returned as a Python float.

    Going mpf -> float64 -> float32 would round twice; mpmath at 24 bits rounds once.
    """
    with mp.workprec(24):
        return float(+mpf(value))  # 24-bit mpf -> float64 is exact


def rounded_coefficients(degree: int) -> tuple:
    """The real minimax coefficients, each rounded to float32 on its own (the obvious way)."""
    return tuple(round_to_float32(c) for c in remez_fit(degree))


@functools.lru_cache(maxsize=None)
def refit_coefficients(degree: int) -> tuple:
    """Rounding-aware fit: round p_1 to float32, re-run Remez for p_2..p_n with p_1 held,
    round p_2, and so on. Rounding p_1 (~0.69, ulp 6e-8) moves p(1) by up to 3e-8, a third
    of the whole degree-5 error budget; refitting lets the later coefficients absorb part of
    that. A cheap cousin of Sollya's fpminimax, which searches the float32 lattice directly."""
    fixed: dict = {}
    for k in range(1, degree + 1):
        fixed[k] = round_to_float32(remez(degree, fixed=fixed).coefficients[k])
    return (1.0,) + tuple(fixed[k] for k in range(1, degree + 1))


class RoundingEffect(NamedTuple):
    """Max relative error on [0, 1] (exact evaluation) of the three coefficient sets."""

    real: mpf  # unrounded minimax, |E|
    rounded: mpf  # each coefficient rounded to float32
    refit: mpf  # rounding-aware refit


def float32_rounding_effect(degree: int) -> RoundingEffect:
    """What storing the coefficients in float32 costs, polynomial error only (no float32
    arithmetic yet; host_model/accuracy measure that)."""
    return RoundingEffect(minimax_error(degree), max_rel_error(rounded_coefficients(degree)),
                          max_rel_error(refit_coefficients(degree)))


@functools.lru_cache(maxsize=None)
def _minimax_coefficients(degree: int) -> tuple:
    # whichever float32 set has the smaller exact max error (naive rounding on a tie)
    naive, refit = rounded_coefficients(degree), refit_coefficients(degree)
    return refit if max_rel_error(refit) < max_rel_error(naive) else naive


def minimax_coefficients(degree: int) -> list:
    """[p_0 = 1.0, p_1, ..., p_n]: our float32 coefficients (Python floats holding float32
    values), the better of plain rounding and the rounding-aware refit. Computed once."""
    return list(_minimax_coefficients(degree))


def resolve_coefficients(degree: int = 3, coefficients=None) -> tuple:
    """The coefficient tuple a model should use: `coefficients` when given (then `degree` is
    ignored; they must be float32 values, p_0 first), else our minimax set for `degree`.
    Shared by host_model and exact_model."""
    if coefficients is None:
        return tuple(minimax_coefficients(degree))
    import numpy as np  # local: the fitting above needs only mpmath

    coeffs = tuple(float(c) for c in coefficients)
    if len(coeffs) < 2:
        raise ValueError(f"need [p_0, p_1, ...], got {coeffs}")
    if any(float(np.float32(c)) != c for c in coeffs):
        raise ValueError("coefficients must be exactly representable in float32")
    return coeffs


def max_rel_error(coefficients) -> mpf:
    """max_{f in [0,1]} |p(f)/2^f - 1| for the given coefficients, evaluated in mpmath (exact
    coefficients, exact arithmetic to DPS digits: the error of the polynomial itself, not of
    any float32 evaluation). The maximum sits at an endpoint or a root of p' - ln2 p."""
    with mp.workdps(DPS):
        coeffs = [mpf(c) for c in coefficients]
        cands = [mpf(0), mpf(1)] + _critical_points(coeffs)
        return max(abs(_rel_err(coeffs, x)) for x in cands)


def minimax_error(degree: int) -> mpf:
    """The theoretical minimax relative error |E| of the real (unrounded) fit."""
    return abs(_remez_cached(degree).levelled_error)


def coefficient_table(degrees=SUPPORTED_DEGREES) -> str:
    """Markdown table: our float32 coefficients vs the official FA4 ones, with the max
    relative error of each polynomial on [0, 1] (computed here, exactly, for all of them).
    `*` marks the set minimax_coefficients() returns."""
    lines = [
        "| degree | coefficients | p_1 .. p_n (float32) | max rel err on [0,1] |",
        "|---|---|---|---|",
    ]
    fmt = lambda cs: ", ".join(f"{c:.9g}" for c in cs[1:])  # noqa: E731  9 digits round-trip
    for n in degrees:
        chosen = _minimax_coefficients(n)
        rows = [("real minimax (Remez, unrounded)", None, minimax_error(n))]
        for name, cs in (("Remez, rounded to fp32", rounded_coefficients(n)),
                         ("Remez, rounding-aware refit", refit_coefficients(n))):
            rows.append((name + (" *" if cs == chosen else ""), cs, max_rel_error(cs)))
        theirs = OFFICIAL_FA4_COEFFICIENTS.get(n)
        rows.append(("official FA4 (Sollya fpminimax)", theirs,
                     None if theirs is None else max_rel_error(theirs)))
        for name, cs, err in rows:
            lines.append(f"| {n} | {name} | {'-' if cs is None else fmt(cs)} | "
                         f"{'not found' if err is None else mpmath.nstr(err, 5)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(coefficient_table())
