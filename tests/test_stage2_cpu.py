"""Stage 2 (CPU half): the minimax fit, the bit-exact host model of the emulated exp2, its
slow exact twin, and the paper's accuracy table."""
import numpy as np
import pytest
from mpmath import mp, mpf

from stage2_emulated_exp import accuracy, minimax
from stage2_emulated_exp.exact_model import (
    exp2_emulated_exact,
    exp2_emulated_exact_bits,
    f32_add,
    f32_fma,
    float_to_bits,
)
from stage2_emulated_exp.host_model import (
    add_rm_f32,
    as_bits,
    exp2_emulated,
    exp2_emulated_steps,
    fma_f32,
    from_bits,
)

pytestmark = [pytest.mark.cpu, pytest.mark.stage2]

DEGREES = minimax.SUPPORTED_DEGREES
F32 = np.float32


def exact_bits(x, **kw):
    return np.array([exp2_emulated_exact_bits(int(b), **kw) for b in as_bits(x)],
                    dtype=np.uint32)


def random_f32(rng, n, emin=-30, emax=30):
    """Random float32 with random sign and exponent in [emin, emax]."""
    m = rng.integers(2**23, 2**24, n)
    e = rng.integers(emin, emax + 1, n)
    return (rng.choice([-1.0, 1.0], n) * m * np.exp2(e - 23.0)).astype(F32)


# ---------------------------------------------------------------- minimax.py


@pytest.mark.parametrize("degree", DEGREES)
def test_remez_equioscillates(degree):
    r = minimax.remez(degree)
    with mp.workdps(minimax.DPS):
        E = r.levelled_error
        errs = [minimax._rel_err(r.coefficients, x) for x in r.points]
        assert len(r.points) == degree + 1  # n free coefficients -> n + 1 points
        assert 0 < r.points[0] and list(r.points) == sorted(r.points) and r.points[-1] == 1
        for i, e in enumerate(errs):
            assert abs(e - (-1) ** i * E) < mpf("1e-20") * abs(E)
        # levelled: no point of [0, 1] is worse than the alternation points -> optimal
        assert abs(minimax.max_rel_error(r.coefficients) / abs(E) - 1) < mpf("1e-20")
        assert r.coefficients[0] == 1


def test_minimax_error_falls_with_degree_and_beats_fpminimax():
    errs = [minimax.minimax_error(n) for n in DEGREES]
    for lo, hi in zip(errs[1:], errs):
        assert lo < hi / 15  # each degree buys more than a factor 15
    # the real minimax is optimal over ALL real coefficients, float32 ones included
    for n in DEGREES:
        assert minimax.minimax_error(n) <= minimax.max_rel_error(
            minimax.OFFICIAL_FA4_COEFFICIENTS[n])
    # and a bit below the paper's measured fp32 numbers (which add Horner rounding)
    assert errs[2] < 8.77e-5 and errs[3] < 3.05e-6 and errs[4] < 1.44e-7


@pytest.mark.parametrize("degree", DEGREES)
def test_float32_rounding_of_coefficients_costs_little(degree):
    eff = minimax.float32_rounding_effect(degree)
    assert eff.real <= eff.rounded and eff.real <= eff.refit  # nothing beats the optimum
    assert eff.rounded / eff.real - 1 < 0.15  # degree 5 loses ~14% to naive rounding
    assert eff.refit / eff.real - 1 < 0.005  # the rounding-aware refit loses < 0.5%
    chosen = minimax.minimax_coefficients(degree)
    assert minimax.max_rel_error(chosen) == min(eff.rounded, eff.refit)
    assert chosen[0] == 1.0 and all(float(F32(c)) == c for c in chosen)


def test_minimax_coefficients_pinned():
    """The float32 bit patterns a GPU kernel would bake in; a change here must be deliberate."""
    pinned = {
        3: [0x3F800000, 0x3F31F32C, 0x3E691BCA, 0x3D9DD54D],
        4: [0x3F800000, 0x3F316B63, 0x3E77122A, 0x3D55FC2B, 0x3C5BFBA9],
        5: [0x3F800000, 0x3F31725D, 0x3E75EDB5, 0x3D648E08, 0x3C13BE0E, 0x3AF4B489],
    }
    for n, bits in pinned.items():
        assert as_bits(np.array(minimax.minimax_coefficients(n), F32)).tolist() == bits


def test_official_coefficients_are_float32_and_match_their_ptx():
    for n, cs in minimax.OFFICIAL_FA4_COEFFICIENTS.items():
        assert len(cs) == n + 1 and cs[0] == 1.0
        assert all(float(F32(c)) == c for c in cs)
    # the degree-3 constants FA4's inline-PTX variant spells in hex
    assert as_bits(np.array(minimax.OFFICIAL_FA4_COEFFICIENTS[3][1:], F32)).tolist() == [
        0x3F31F519, 0x3E6906A4, 0x3D9DF09D]


def test_coefficient_table_lists_both_sources():
    table = minimax.coefficient_table()
    assert "official FA4" in table and "not found" not in table
    assert "0.695146143" in table  # an official degree-3 coefficient
    assert table.count("\n") == 1 + 4 * len(DEGREES)


# ---------------------------------------------------------------- fma / rounding primitives


def test_fma_catches_double_rounding():
    """a*b + c = (1 + 2^-23) + 2^-24 - 2^-70, just below the midpoint of 1 + 2^-23 and
    1 + 2^-22. float64 cannot hold the 2^-70 and rounds onto the midpoint; float32 then
    breaks the tie to the even 1 + 2^-22. One correct rounding gives 1 + 2^-23."""
    a = F32(1 + 2**-23)
    b = F32(2**-24 * (1 - 2**-23))  # a*b = 2^-24 - 2^-70 exactly
    c = F32(1 + 2**-23)  # odd mantissa, so the tie breaks away from c
    naive = F32(np.float64(a) * np.float64(b) + np.float64(c))
    exact = f32_fma(*(float_to_bits(float(v)) for v in (a, b, c)))
    assert exact == as_bits(F32(1 + 2**-23))
    assert as_bits(naive) != exact  # the naive way is wrong here...
    assert as_bits(fma_f32(a, b, c)) == exact  # ...and fma_f32 is not
    # the mirror image: a*b = -(2^-24 - 2^-70), c = 1 + 2^-23 -> v = 1 + 2^-24 + 2^-70
    exact = f32_fma(*(float_to_bits(float(v)) for v in (-a, b, c)))
    assert exact == as_bits(F32(1 + 2**-23))
    assert as_bits(F32(-np.float64(a) * np.float64(b) + np.float64(c))) != exact
    assert as_bits(fma_f32(-a, b, c)) == exact


def test_fma_double_rounding_family(rng):
    """Many such traps: c with an odd mantissa at random scales, a*b = +-(half ulp(c) - tiny)."""
    n = 400
    k = rng.integers(-20, 20, n)
    c = (((2 * rng.integers(2**22, 2**23, n) + 1) * 2.0**-23) * np.exp2(k)).astype(F32)
    c = np.where(rng.random(n) < 0.5, c, -c).astype(F32)
    s = rng.integers(-8, 8, n)
    sign = np.where(rng.random(n) < 0.5, 1.0, -1.0)
    a = (sign * (1 + 2**-23) * np.exp2(s)).astype(F32)
    b = ((1 - 2**-23) * np.exp2(k - 24.0 - s)).astype(F32)
    naive = (a.astype(np.float64) * b + c).astype(F32)
    fast = as_bits(fma_f32(a, b, c))
    exact = np.array([f32_fma(*(float_to_bits(float(v)) for v in t)) for t in zip(a, b, c)])
    assert (fast == exact).all()
    assert (as_bits(naive) != exact).mean() > 0.2  # a real fraction of them bite


@pytest.mark.parametrize("ftz", [False, True])
def test_fma_and_add_rm_match_exact_on_random_operands(rng, ftz):
    n = 1500
    # wide exponents (subnormal products and results), and c ~ -a*b (cancellation)
    a, b = random_f32(rng, n, -80, 40), random_f32(rng, n, -80, 40)
    c = random_f32(rng, n, -150, 40)
    near = rng.random(n) < 0.4
    c[near] = (-(a[near].astype(np.float64) * b[near]) * (1 + 2.0**-20 * rng.standard_normal(
        near.sum()))).astype(F32)
    c[:5] = [0.0, -0.0, np.inf, np.nan, 2**-140]
    a[:5] = [0.0, 1.0, -np.inf, 1.0, 2**-130]
    fast = as_bits(fma_f32(a, b, c, ftz=ftz))
    exact = np.array([f32_fma(*(float_to_bits(float(v)) for v in t), ftz=ftz)
                      for t in zip(a, b, c)])
    assert (fast == exact).all()
    y = np.concatenate([c[:400], -a[:100], [F32(-1.0), F32(0.0)]]).astype(F32)
    x = np.concatenate([a[:400], a[:100], [F32(1.0), F32(0.0)]]).astype(F32)
    fast = as_bits(add_rm_f32(x, y, ftz=ftz))
    exact = np.array([f32_add(float_to_bits(float(u)), float_to_bits(float(v)), "rm", ftz)
                      for u, v in zip(x, y)])
    assert (fast == exact).all()
    assert fast[-2] == 0x80000000 and fast[-1] == 0x00000000  # x + (-x) = -0 under RM; +0 + +0 = +0


# ---------------------------------------------------------------- host model vs exact model


def structured_points(rng):
    ints = np.arange(-130, 131).astype(F32)
    big = F32(3.4028235e38)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 2**-149, -2**-149,
                        2**-126, -2**-126, -126.0, -127.0, -128.0, big, -big, 2**22, -2**22,
                        2**22 - 0.5, 2**23, 2**24 + 2, 1e-8, -1e-8, -2**-24, -2**-25,
                        -3 * 2**-26, 127.99999, 128.5, 8.0, -8.0], dtype=F32)
    return np.concatenate([
        ints, ints + F32(0.5), np.nextafter(ints, F32(-np.inf)), np.nextafter(ints, F32(np.inf)),
        special,
        rng.uniform(-130, 130, 500).astype(F32),  # the supported range and its edges
        rng.uniform(-1, 0, 200).astype(F32),  # where f = 1 + x rounds
        rng.uniform(-127, -126, 50).astype(F32),  # the wrong-but-tiny band
        from_bits(rng.integers(0, 2**32, 200, dtype=np.uint64).astype(np.uint32)),  # anything
    ]).astype(F32)


@pytest.mark.parametrize("ftz", [True, False])
@pytest.mark.parametrize("coeffs", ["ours3", "ours5", "fa4_3"])
def test_host_model_is_bit_exact(rng, coeffs, ftz):
    c = {"ours3": minimax.minimax_coefficients(3), "ours5": minimax.minimax_coefficients(5),
         "fa4_3": minimax.OFFICIAL_FA4_COEFFICIENTS[3]}[coeffs]
    x = structured_points(rng)
    fast = as_bits(exp2_emulated(x, coefficients=c, ftz=ftz))
    exact = exact_bits(x, coefficients=c, ftz=ftz)
    bad = np.nonzero(fast != exact)[0]
    assert bad.size == 0, [(x[i], hex(fast[i]), hex(exact[i])) for i in bad[:5]]


def test_documented_behaviour_outside_the_domain():
    def bits(v, **kw):
        return int(as_bits(exp2_emulated(np.array([v], F32), **kw))[0])

    for v in (np.nan, -np.inf, -127.0, -127.5, -1e30):  # clamped to -127 -> +0
        assert bits(v) == 0x00000000
    assert bits(np.inf) == 0x7FFFFFFF  # f = inf - inf: the canonical NaN
    assert bits(128.0) == 0x7F800000  # +inf
    assert bits(-0.0) == bits(0.0) == bits(1e-40) == bits(-1e-40) == 0x3F800000
    # without ftz a negative subnormal has floor -1 and f = 1 + x rounds to 1.0: p(1) / 2,
    # the same as any -2^-25 < x < 0 (and close to, not exactly, 1)
    assert bits(-1e-40, ftz=False) == bits(-2**-30) == bits(-2**-30, ftz=False)
    assert abs(exp2_emulated(np.array([-1e-40], F32), ftz=False)[0] - 1) < 1e-4
    assert exp2_emulated_exact(float(F32(-1e-40)), ftz=False) == exp2_emulated_exact(-2**-30)
    # x in [-127, -126): the exponent field hits 0, so the bits read as (p - 1) * 2^-126
    p = exp2_emulated(np.array([0.5], F32))[0]
    assert bits(-126.5) == int(as_bits(p)) - (127 << 23)
    # integers in [-126, 127] are exact powers of two (p_0 = 1)
    k = np.arange(-126, 128)
    assert (exp2_emulated(k.astype(F32)) == np.exp2(k.astype(np.float64))).all()


def test_floor_and_fraction_steps(rng):
    x = np.concatenate([rng.uniform(-126, 128, 5000), -rng.random(1000) * 2.0**-20]).astype(F32)
    st = exp2_emulated_steps(x)
    assert (st["floor"] == np.floor(x)).all()
    f_exact = x.astype(np.float64) - np.floor(x.astype(np.float64))
    exact = (x >= 0) | (x <= -1)
    assert (st["frac"][exact] == f_exact[exact]).all()  # Sterbenz-type exactness
    # tiny negatives: f = 1 + x is rounded, sometimes all the way to 1.0 (p(1) ~ 2, fine)
    assert (st["frac"][-1000:] == 1.0).any() and (st["frac"] <= 1).all()
    assert exp2_emulated(x.reshape(50, -1)).shape == (50, 120)


# ---------------------------------------------------------------- accuracy.py


def test_bf16_rounding_hand_picked():
    cases = [
        (1.0, 1.0),
        (1 + 2**-8, 1.0),  # tie, 1.0 is even
        (1 + 3 * 2**-8, 1 + 2**-6),  # tie, rounds up to the even neighbour
        (1 + 2**-8 + 2**-23, 1 + 2**-7),  # just above the tie
        (-(1 + 2**-8 + 2**-23), -(1 + 2**-7)),
        (1 + 2**-8 - 2**-23, 1.0),
        (2 - 2**-9, 2.0),  # carries into the exponent
        (3.4028235e38, np.inf),  # FLT_MAX rounds up to inf, like cvt.rn.bf16.f32
        (np.inf, np.inf), (-np.inf, -np.inf), (0.0, 0.0),
        (3 * 2**-133, 3 * 2**-133),  # bf16 subnormal (granule 2^-133): kept as is
        (1.5 * 2**-133, 2**-132),  # a tie between granules 1 and 2 -> the even one
    ]
    x = np.array([c[0] for c in cases], F32)
    want = np.array([c[1] for c in cases], F32)
    assert (as_bits(accuracy.round_to_bf16(x)) == as_bits(want)).all()
    assert np.signbit(accuracy.round_to_bf16(np.array([-0.0], F32)))[0]
    nan = accuracy.round_to_bf16(np.array([np.nan], F32))
    assert np.isnan(nan).all() and (as_bits(nan) & 0xFFFF == 0).all()


def test_bf16_two_implementations_agree(rng):
    x = np.abs(random_f32(rng, 100_000, -100, 100))
    assert (accuracy.round_to_bf16(x).astype(np.float64)
            == accuracy.round_f64_to_bf16(x.astype(np.float64))).all()
    # the float64 path rounds once: 1 + 2^-8 + 2^-40 is above the tie, so it goes up,
    # while a detour through float32 (which drops the 2^-40) would tie to 1.0
    y = np.array([1 + 2**-8 + 2**-40])
    assert accuracy.round_f64_to_bf16(y)[0] == 1 + 2**-7
    assert accuracy.round_to_bf16(y.astype(F32))[0] == 1.0


@pytest.fixture(scope="module")
def table_numbers():
    return accuracy.accuracy_numbers()  # the paper's 4M inputs, ~5-10 s


def test_accuracy_table_reproduces_the_paper(table_numbers):
    rows = table_numbers
    paper = accuracy.PAPER_TABLE
    for d in (3, 4, 5):
        p = paper[f"Degree {d}"]
        fa4, ours = rows[f"Degree {d} (FA4 coefficients)"], rows[f"Degree {d} (ours)"]
        # the official coefficients are what the paper measured: same numbers to 3 digits
        assert fa4["fp32_max"] == pytest.approx(p[0], rel=0.01)
        assert fa4["fp32_mean"] == pytest.approx(p[1], rel=0.01)
        # ours: minimax in max error, so a little lower max, about the same mean
        assert 0.9 * p[0] < ours["fp32_max"] <= p[0]
        assert ours["fp32_mean"] == pytest.approx(p[1], rel=0.02)
        for r in (fa4, ours):  # bf16 quantization swamps the polynomial
            assert r["bf16_max"] == pytest.approx(p[2], rel=0.01)
            assert r["bf16_mean"] == pytest.approx(p[3], rel=0.01)
    ideal = rows["Ideal (FP64->BF16)"]
    assert ideal["bf16_max"] == pytest.approx(2**-8 / (1 + 2**-8), rel=1e-4)  # 3.89e-3
    assert ideal["bf16_mean"] == pytest.approx(1.41e-3, rel=0.01)
    # "degree 3 matches to within 1 BF16 ULP on 99% of inputs": here, equal on 99%
    assert rows["Degree 3 (ours)"]["bf16_exact_frac"] > 0.985
    assert rows["Degree 5 (ours)"]["bf16_exact_frac"] > 0.9999


def test_accuracy_extra_rows_and_table():
    n = 10_000
    x = accuracy.accuracy_inputs(n, seed=1)
    assert x.dtype == F32 and 0 <= x.min() and x.max() < 1
    fake_mufu = np.exp2(x)  # float32 exp2 on the CPU, standing in for a measured row
    rows = accuracy.accuracy_numbers(n, 1, degrees=(3,), extra_rows={
        "Hardware MUFU.EX2 (stand-in)": fake_mufu, "callable": lambda v: np.exp2(v)})
    assert rows["callable"] == rows["Hardware MUFU.EX2 (stand-in)"]
    assert rows["callable"]["fp32_max"] < 2e-7
    with pytest.raises(ValueError):
        accuracy.accuracy_numbers(n, 1, degrees=(), extra_rows={"bad": fake_mufu[:-1]})
    table = accuracy.accuracy_table(n, 1, degrees=(3,), extra_rows={"MUFU": fake_mufu})
    assert "Degree 3 (ours)" in table and "| MUFU |" in table and "8.77e-05" in table
