"""Stage 3, Hopper step 4 (FA4's softmax on step 3's kernel).

cpu tier: the softmax policy's arguments are checked before anything compiles or launches.

compile tier (CI, no GPU): every head dim compiles for sm_90a in fp16 and bf16 with no spills and no
local memory; the key-block loop holds the warp vote (one VOTE.ANY) and, per thread, one MUFU.EX2
per score plus the two rescale factors; with emulation_fraction > 0 it holds that many fewer
MUFU.EX2 and one FADD.RM (the polynomial's floor) per emulated exponential.

gpu tier (H100/H200): outputs are poisoned with NaN before each run; out and lse follow FA4's rule
against the fp32 reference (`stage0_reference.torch_reference`) on odd shapes, causal and not, GQA,
every head dim, fp16 and bf16, every exponential emulated too, and scores built so that the maxima
jump by more than tau; and against step 3 the output differs only by the rounding that moving the
rescale leaves (tolerances in `test_same_as_step3_up_to_rescale_rounding`).
"""
from __future__ import annotations

import math

import pytest

HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]
# every head dim in both dtypes (causal alternating), plus d = 128 in the other causal mode of each
COMPILE_CASES = [(dt, d, dv, (i + j) % 2 == 0) for i, (d, dv) in enumerate(HEAD_DIMS)
                 for j, dt in enumerate(("bf16", "fp16"))]
COMPILE_CASES += [("bf16", 128, 128, False), ("fp16", 128, 128, True)]


def _step4():
    from stage3_fwd_kernel import hopper_step4_fa4_softmax

    return hopper_step4_fa4_softmax


def _hot_loop(comp):
    from stage3_fwd_kernel.sass_report import key_block_loop

    hot = key_block_loop(comp.sass)
    assert len(hot) > 100, "no key-block loop found"
    return hot


def _count(ops, prefix, also=""):
    return sum(o.startswith(prefix) and also in o for o in ops)


# ---------------------------------------------------------------------------------------- cpu tier
@pytest.mark.cpu
@pytest.mark.stage3
def test_bad_policy_arguments_raise_naming_them():
    import torch

    mod = _step4()
    q = torch.zeros(1, 8, 1, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="rescale_threshold"):
        mod.attention_forward(q, q, q, rescale_threshold=16.0)  # fp16 holds P <= 2^tau only up to 15
    with pytest.raises(ValueError, match="rescale_threshold"):
        mod.attention_forward(q, q, q, rescale_threshold=-1.0)
    with pytest.raises(ValueError, match="emulation_fraction"):
        mod.compile_only(emulation_fraction=1.5)
    with pytest.raises(TypeError, match="emulation_fraction"):
        mod.compile_only(emulation_fraction="quarter")
    with pytest.raises(TypeError, match="policy"):
        mod.make_kernel(None, 64, 64, False, policy=(8.0, 0.0))
    with pytest.raises(ValueError, match="head_dim"):
        mod.compile_only(head_dim=72)


# ------------------------------------------------------------------------------------ compile tier
@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("dtype,d,dv,causal", COMPILE_CASES,
                         ids=[f"{dt}-d{d}x{dv}-{'causal' if c else 'full'}" for dt, d, dv, c in COMPILE_CASES])
def test_compiles_sm90a(dtype, d, dv, causal):
    mod = _step4()
    comp = mod.compile_only(dtype=dtype, head_dim=d, head_dim_v=dv, causal=causal)
    rep = comp.report
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, f"spills: {rep}"
    assert rep["stack_frame"] == 0, f"stack frame: {rep}"
    assert rep["LDL/STL"] == 0, "local-memory traffic in SASS"
    assert rep["registers"] is not None and rep["registers"] <= 255
    assert rep["HGMMA"] and rep["UTMALDG"], "no HGMMA / TMA loads in SASS"
    assert rep["smem_bytes"] is not None and rep["smem_bytes"] <= 227 * 1024
    assert rep["threads"] == 384
    assert "setmaxnreg.dec" in comp.ptx and "setmaxnreg.inc" in comp.ptx
    assert "C7508" not in rep["ptxas_log"], "ptxas ignored setmaxnreg"
    assert not rep["wgmma_serialized"], "ptxas serialized the wgmmas"

    # the key-block loop: one warp vote guards the O rescale; every exponential is a MUFU.EX2 (the
    # thread's 2 rows x tile_n / 4 scores, and the 2 rescale factors inside the vote's branch)
    hot = _hot_loop(comp)
    assert hot.count("VOTE.ANY") == 1, f"{hot.count('VOTE.ANY')} VOTE.ANY in the key-block loop"
    tile_n = mod.default_tile_n(d, dv)
    assert _count(hot, "MUFU.EX2") == tile_n // 2 + 2
    assert _count(hot, "FADD", ".RM") == 0, "an emulated exp2 with emulation_fraction = 0"


EMULATION_CASES = [("bf16", 64, 64, True, 0.25), ("bf16", 128, 128, False, 0.25)]


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("dtype,d,dv,causal,fraction", EMULATION_CASES,
                         ids=[f"{c[0]}-d{c[1]}-{c[4]}" for c in EMULATION_CASES])
def test_emulation_moves_exp2_to_the_fma_pipe(dtype, d, dv, causal, fraction):
    """k of every 16 scores of a thread's row use stage 2's polynomial: per emulated value one
    MUFU.EX2 fewer, one FADD.RM (floor) and 3 FFMA (Horner) more, no spills."""
    mod = _step4()
    base = mod.compile_only(dtype=dtype, head_dim=d, head_dim_v=dv, causal=causal)
    emu = mod.compile_only(dtype=dtype, head_dim=d, head_dim_v=dv, causal=causal, emulation_fraction=fraction)
    rep = emu.report
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["LDL/STL"] == 0, f"spills: {rep}"
    hot0, hot = _hot_loop(base), _hot_loop(emu)
    emulated = int(fraction * mod.default_tile_n(d, dv) // 2)  # of the thread's 2 x tile_n / 4 scores
    assert _count(hot0, "MUFU.EX2") - _count(hot, "MUFU.EX2") == emulated
    assert _count(hot, "FADD", ".RM") == emulated
    assert _count(hot, "FFMA") >= _count(hot0, "FFMA") + 3 * emulated
    assert hot.count("VOTE.ANY") == 1


@pytest.mark.compile
@pytest.mark.stage3
def test_run_entry_point_reports_resources():
    res = _step4().run(batch=1, seqlen_q=256, seqlen_k=256, heads=2, head_dim=128, causal=True, check=True)
    assert res["mode"] in ("compile-only", "gpu")
    assert res["report"]["spill_stores"] == 0


# ---------------------------------------------------------------------------------------- gpu tier
def _inputs(batch, sq, sk, heads, heads_kv, d, dv, dtype, seed=0):
    import torch

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(batch, sq, heads, d, device="cuda", dtype=tdt, generator=g)
    k = torch.randn(batch, sk, heads_kv, d, device="cuda", dtype=tdt, generator=g)
    v = torch.randn(batch, sk, heads_kv, dv, device="cuda", dtype=tdt, generator=g)
    return q, k, v


def _forward(mod, q, k, v, causal, **kwargs):
    """The step's forward into NaN-poisoned outputs (a row it fails to write stays NaN)."""
    import torch

    out = torch.full((*q.shape[:3], v.shape[3]), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda", dtype=torch.float32)
    mod.attention_forward(q, k, v, causal=causal, out=out, lse=lse, **kwargs)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "NaN in out (unwritten or poisoned rows)"
    assert not torch.isnan(lse).any(), "NaN in lse (unwritten or poisoned rows)"
    return out, lse


def _check(q, k, v, causal, out, lse):
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref

    ref_o, ref_lse = attention_ref(q, k, v, causal=causal, upcast=True)
    base_o, base_lse = attention_ref(q, k, v, causal=causal, upcast=False)
    assert_fa4_close("out", out, ref_o, base_o)
    assert_fa4_close("lse", lse, ref_lse, base_lse)
    return ref_o, base_o


SEQLENS = [(1, 1), (113, 203), (799, 3), (1000, 1500)]


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv", HEAD_DIMS, ids=[f"d{d}x{dv}" for d, dv in HEAD_DIMS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
def test_forward_matches_reference(d, dv, causal, sq, sk):
    # GQA ratio 1 / 2 / 4 and the dtype cycle over the cases
    ratio = [1, 2, 4][(sq + d) % 3]
    dtype = ["bf16", "fp16"][(sk + d // 16) % 2]
    q, k, v = _inputs(2, sq, sk, 4, 4 // ratio, d, dv, dtype)
    out, lse = _forward(_step4(), q, k, v, causal)
    _check(q, k, v, causal, out, lse)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("fraction", [0.25, 1.0])
@pytest.mark.parametrize("d", [64, 128])
def test_emulated_exp2_matches_reference(fraction, d):
    q, k, v = _inputs(2, 333, 1000, 4, 2, d, d, "bf16")
    out, lse = _forward(_step4(), q, k, v, True, emulation_fraction=fraction)
    _check(q, k, v, True, out, lse)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("dtype,tau", [("bf16", 0.0), ("bf16", 8.0), ("bf16", 64.0), ("fp16", 15.0)])
def test_rising_maxima(dtype, tau):
    """Keys walked later (the earlier ones: the walk goes last block first) score up to ~34 log2
    units higher, so rows' maxima keep jumping: without the mask, at tau = 8 half of the 152
    (warp, block) steps after the first take the rescale branch (NumPy model of this input), at
    tau = 15 (fp16's limit) a sixth; at tau = 64 none do and P reaches ~2^34."""
    import torch

    q, k, v = _inputs(1, 300, 1100, 4, 4, 128, 128, dtype, seed=3)
    ramp = torch.linspace(6.0, 0.25, k.shape[1], device="cuda").view(1, -1, 1, 1)  # (1, Sk, 1, 1)
    k = (k.float() * ramp).to(k.dtype)
    for causal in (False, True):
        out, lse = _forward(_step4(), q, k, v, causal, rescale_threshold=tau)
        _check(q, k, v, causal, out, lse)


def _ulp(x, mantissa_bits):
    """Spacing of the dtype's values at |x| (x upcast to fp32); the smallest normal's at 0."""
    import torch

    _, e = torch.frexp(x.float().abs().clamp_min(2.0 ** -14))
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), e - 1 - mantissa_bits)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_same_as_step3_up_to_rescale_rounding(dtype, causal):
    """emulation_fraction = 0 runs step 3's arithmetic, except where the rescale happens.

    tau = 0: the same P bits (same FFMA and MUFU.EX2 per score; a warp-mate's row that did not grow
    multiplies by exactly 1). What differs is fp32 rounding: the factor 2^((m_old - m_new) * scale)
    instead of 2^(m_old * scale - m_new * scale), and l summed in 4 chains instead of 1. That moves
    O / l by a few fp32 ulps (~1e-6 relative to the partial sums), so an output element may round to
    the neighbouring value of its dtype: at most 1 ulp apart, or 1e-5 of the largest output where
    that noise exceeds the dtype's spacing (fp16 values near 0); lse (fp32, l's relative rounding
    ~ keys/4 x 2^-24) within 3e-5. A real fault moves outputs by percents, not by these amounts.
    tau = 8: P = 2^(s - m) is rounded to the dtype at a stale m, i.e. at other points than step 3's.
    Both outputs are then within FA4's bound of the fp32 reference, and they may differ from each
    other by that bound (2 x the plain PyTorch error); l is still summed from fp32 P: lse as above."""
    import torch
    from stage0_reference.torch_reference import fa4_error_bound
    from stage3_fwd_kernel import hopper_step3_warpspec as step3

    q, k, v = _inputs(2, 700, 1500, 4, 2, 128, 128, dtype, seed=5)
    out3, lse3 = _forward(step3, q, k, v, causal)
    mantissa = {"bf16": 7, "fp16": 10}[dtype]
    out0, lse0 = _forward(_step4(), q, k, v, causal, rescale_threshold=0.0)
    noise = 1e-5 * out3.float().abs().max()
    assert torch.all((out0.float() - out3.float()).abs() <= _ulp(out3, mantissa) + noise), "tau = 0: > 1 ulp"
    lse_tol = 3e-5 * (1 + lse3.abs())
    assert torch.all((lse0 - lse3).abs() <= lse_tol)
    out8, lse8 = _forward(_step4(), q, k, v, causal, rescale_threshold=8.0)
    ref_o, base_o = _check(q, k, v, causal, out8, lse8)
    bound = fa4_error_bound(ref_o, base_o, 1e-5)
    assert (out8.float() - out3.float()).abs().max().item() <= bound
    assert torch.all((lse8 - lse3).abs() <= lse_tol)


@pytest.mark.gpu
@pytest.mark.stage3
def test_fully_masked_rows_and_determinism():
    """causal with seqlen_q > seqlen_k: rows that see no key vote no forever -> out 0, lse -inf;
    two runs are bitwise identical."""
    import torch

    mod = _step4()
    q, k, v = _inputs(2, 300, 70, 4, 4, 128, 128, "bf16", seed=1)
    out, lse = _forward(mod, q, k, v, True)
    _check(q, k, v, True, out, lse)
    assert torch.all(out[:, :230] == 0) and torch.all(torch.isneginf(lse[:, :, :230]))
    out2, lse2 = _forward(mod, q, k, v, True)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    assert math.isfinite(lse[:, :, 230:].max().item())
