"""The Hopper product kernels with the attention variants: sliding window, softcap, learnable sink.

gpu tier: every case runs on NaN-poisoned outputs and is judged with FA4's rule against the fp32
reference (stage0_reference.torch_reference): at most 2x the error of a PyTorch implementation in
the input precision (3x with softcap: tanh.approx against torch's tanh), plus a tiny atol. Windows
are drawn per case from a seeded generator, one-sided ones included. The backward (head dims 64,
96, 128) is judged the same way for dq, dk, dv, deterministic mode bitwise over repeats, and fa4
end to end adds the sink's gradient. compile tier: the variants build for sm_90a without a GPU, and
plain calls keep their kernels (the variant adds nothing to the cache key of a call without one).
"""
from __future__ import annotations

import random

import pytest

HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]


def _mod():
    from stage3_fwd_kernel import hopper

    return hopper


def _window(rng: random.Random, sq: int, sk: int, causal: bool):
    """A random window for a (sq, sk) problem: both sides, one side, or small; right is None under causal."""
    span = max(sq, sk)
    kind = rng.choice(["both", "left", "right", "small"])
    left = rng.randint(0, span) if kind in ("both", "left") else (rng.randint(0, 3) if kind == "small" else None)
    right = rng.randint(0, span) if kind in ("both", "right") else (rng.randint(0, 3) if kind == "small" else None)
    if causal:
        right = None
        left = left if left is not None else rng.randint(0, span)
    return (left, right)


def _bound_check(name, actual, ref, base, rtol):
    from stage0_reference.torch_reference import _max_abs_diff

    err = _max_abs_diff(actual, ref)
    bound = rtol * _max_abs_diff(base, ref) + 1e-5
    assert err <= bound, f"{name}: max error {err:.3e} > {rtol} x baseline error + atol = {bound:.3e}"


def _check(name, out, lse, ref, base, softcap):
    import torch

    assert not torch.isnan(out).any(), f"{name}: NaN in out (unwritten or poisoned rows)"
    assert not torch.isnan(lse).any(), f"{name}: NaN in lse (unwritten or poisoned rows)"
    rtol = 3.0 if softcap else 2.0
    _bound_check(f"{name} out", out, ref[0], base[0], rtol)
    _bound_check(f"{name} lse", lse, ref[1], base[1], rtol)


def _qkv(b, sq, sk, hq, hkv, d, dv, dtype, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    t = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    return (torch.randn(b, sq, hq, d, device="cuda", dtype=t, generator=g),
            torch.randn(b, sk, hkv, d, device="cuda", dtype=t, generator=g),
            torch.randn(b, sk, hkv, dv, device="cuda", dtype=t, generator=g))


def _sink(hq, seed):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    return torch.randn(hq, device="cuda", generator=g, dtype=torch.float32) * 2.0


def run_dense(q, k, v, *, causal, window_size, softcap, sink, **kw):
    """Poisoned outputs, the kernel, then the rule against the reference."""
    import torch
    from stage0_reference.torch_reference import attention_ref

    out = torch.full(q.shape[:3] + (v.shape[3],), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda", dtype=torch.float32)
    _mod().attention_forward(q, k, v, causal=causal, window_size=window_size, softcap=softcap,
                             learnable_sink=sink, out=out, lse=lse, **kw)
    torch.cuda.synchronize()
    variant = dict(causal=causal, window_size=window_size, softcap=softcap, learnable_sink=sink)
    ref = attention_ref(q, k, v, upcast=True, **variant)
    base = attention_ref(q, k, v, upcast=False, **variant)
    _check(f"{tuple(q.shape)}x{tuple(k.shape)} causal={causal} window={window_size} softcap={softcap} "
           f"sink={sink is not None} {kw}", out, lse, ref, base, softcap)
    return out, lse


# (sq, sk, hq, hkv, d, dv, dtype, causal, softcap, sink)
DENSE_CASES = [
    (1, 1, 2, 1, 64, 64, "bf16", False, 0.0, True),
    (3, 3, 6, 1, 128, 128, "bf16", True, 0.0, False),
    (64, 1, 4, 2, 64, 64, "fp16", False, 30.0, False),
    (239, 1, 6, 6, 128, 128, "bf16", True, 0.0, True),
    (799, 3, 6, 1, 96, 96, "bf16", False, 5.0, True),
    (113, 203, 4, 2, 128, 128, "bf16", False, 0.0, False),
    (113, 203, 6, 1, 64, 64, "bf16", True, 30.0, False),
    (255, 256, 4, 4, 192, 128, "bf16", False, 0.0, True),
    (1023, 1024, 6, 2, 128, 128, "fp16", True, 0.0, False),
    (1023, 1024, 2, 2, 256, 256, "bf16", False, 50.0, True),
    (4224, 4224, 2, 1, 128, 128, "bf16", True, 0.0, False),
    (4224, 4224, 2, 2, 64, 64, "bf16", False, 0.0, True),
    (700, 1500, 6, 3, 64, 64, "bf16", True, 30.0, True),
    (1500, 700, 4, 2, 128, 128, "bf16", False, 0.0, False),
]


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("case", DENSE_CASES, ids=[
    f"{c[0]}x{c[1]}-h{c[2]}/{c[3]}-d{c[4]}x{c[5]}-{c[6]}-{'causal' if c[7] else 'full'}-cap{c[8]:g}"
    f"{'-sink' if c[9] else ''}" for c in DENSE_CASES])
def test_dense_variants(case):
    sq, sk, hq, hkv, d, dv, dtype, causal, softcap, sink = case
    seed = sq * 7 + sk + d
    rng = random.Random(seed)
    window = _window(rng, sq, sk, causal)
    q, k, v = _qkv(2, sq, sk, hq, hkv, d, dv, dtype, seed)
    run_dense(q, k, v, causal=causal, window_size=window, softcap=softcap, sink=_sink(hq, seed) if sink else None)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv", HEAD_DIMS, ids=[f"d{d}x{dv}" for d, dv in HEAD_DIMS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sliding_window_every_head_dim(d, dv, causal):
    """A Mistral-style window (w, 0) or a two-sided one at every head dim, long enough that the left
    edge cuts whole key blocks and the persistent / dynamic walks run."""
    window = (300, None) if causal else (257, 129)
    q, k, v = _qkv(2, 2048, 2048, 4, 2, d, dv, "bf16", d + causal)
    run_dense(q, k, v, causal=causal, window_size=window, softcap=0.0, sink=None)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("persistent", [False, True], ids=["one-tile-per-cta", "persistent"])
def test_window_that_hides_whole_rows(persistent):
    """seqlen_q > seqlen_k with a small two-sided window: the top rows see no key (out 0, lse -inf,
    or the sink's lse), and whole tiles walk no block at all."""
    import torch

    q, k, v = _qkv(1, 600, 100, 2, 2, 128, 128, "bf16", 11)
    out, lse = run_dense(q, k, v, causal=False, window_size=(3, 2), softcap=0.0, sink=None, persistent=persistent)
    assert torch.equal(out[0, :400].float().abs().amax(), torch.tensor(0.0, device="cuda"))
    assert torch.isinf(lse[0, :, :400]).all()
    sink = _sink(2, 11)
    out, lse = run_dense(q, k, v, causal=False, window_size=(3, 2), softcap=0.0, sink=sink, persistent=persistent)
    assert torch.allclose(lse[0, :, :400], sink[:, None].expand(2, 400))


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_variants_with_empty_sequences(causal):
    import torch
    from stage0_reference.torch_reference import attention_varlen_ref

    lens_q, lens_k = [0, 300, 1, 517, 0, 129], [5, 290, 0, 517, 0, 1000]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    hq, hkv, d = 6, 2, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    sink = _sink(hq, 5)
    window = (64, None) if causal else (100, 20)
    variant = dict(causal=causal, window_size=window, softcap=20.0, learnable_sink=sink)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((hq, q.shape[0]), float("nan"), device="cuda")
    _mod().attention_varlen_forward(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), out=out, lse=lse, **variant)
    torch.cuda.synchronize()
    ref = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=True, **variant)
    base = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=False, **variant)
    _check(f"varlen causal={causal}", out, lse, ref, base, softcap=20.0)


@pytest.mark.gpu
@pytest.mark.stage3
def test_softcap_bounds_the_logits():
    """With a tiny softcap every logit is within (-cap, cap): the output is near the mean of V, and lse
    is within [log(Sk) - cap, log(Sk) + cap] even for huge raw scores."""
    import math

    import torch

    q, k, v = _qkv(1, 256, 512, 2, 2, 64, 64, "bf16", 3)
    out, lse = run_dense(q * 50, k * 50, v, causal=False, window_size=(None, None), softcap=0.5, sink=None)
    assert (lse >= math.log(512) - 0.5 - 1e-3).all() and (lse <= math.log(512) + 0.5 + 1e-3).all()


# ======================================================================================== compile
@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("variant", [dict(window_size=(128, 0)), dict(window_size=(64, 32)),
                                     dict(softcap=30.0), dict(learnable_sink=True),
                                     dict(window_size=(256, None), softcap=50.0, learnable_sink=True)],
                         ids=["left-right0", "two-sided", "softcap", "sink", "all"])
def test_variants_compile_without_spills(variant):
    comp = _mod().compile_only("bf16", 128, 128, False, **variant)
    assert comp.report["spill_stores"] == 0 and comp.report["spill_loads"] == 0
    if variant.get("softcap"):
        assert "MUFU.TANH" in comp.sass
    else:
        assert "MUFU.TANH" not in comp.sass


@pytest.mark.cpu
@pytest.mark.stage3
def test_plain_calls_keep_their_cache_keys():
    """The variant enters the compile-cache key only when it is not plain, so existing kernels (and
    fa4's disk cache entries) are unchanged by the feature."""
    from stage3_fwd_kernel.hopper.host import PLAIN, Variant, _key
    from stage3_fwd_kernel.components.window import Window

    import cutlass

    base = _key("gpu", cutlass.BFloat16, 128, 128, True, None, None)
    assert _key("gpu", cutlass.BFloat16, 128, 128, True, None, None, variant=PLAIN) == base
    other = _key("gpu", cutlass.BFloat16, 128, 128, True, None, None, variant=Variant(Window(64, None)))
    assert other != base


@pytest.mark.cpu
@pytest.mark.stage3
@pytest.mark.parametrize("window_size,causal,err", [
    ((5, 3), True, ValueError), ((-2, None), False, ValueError), ((1.5, None), False, TypeError),
    ("wide", False, TypeError)])
def test_bad_windows_name_the_argument(window_size, causal, err):
    from stage3_fwd_kernel.components.window import make_window

    with pytest.raises(err, match="window_size"):
        make_window(causal, window_size)


@pytest.mark.cpu
@pytest.mark.stage3
def test_window_normalisation():
    from stage3_fwd_kernel.components.window import Window, make_window

    assert make_window(False, (-1, -1)) == Window(None, None)
    assert make_window(True, (None, None)) == Window(None, 0)
    assert make_window(True, (128, -1)) == Window(128, 0)
    assert make_window(False, (7, 0)) == Window(7, 0)


# ======================================================================================== backward
def _variant_grads(q, k, v, dout, variant, sink=None):
    """(fp32 reference grads, low-precision baseline grads) through attention_ref: dq, dk, dv (+ dsink)."""
    import torch
    from stage0_reference.torch_reference import attention_ref

    def grads(dtype, upcast):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        s = None if sink is None else sink.detach().clone().requires_grad_(True)
        o, _ = attention_ref(*leaves, upcast=upcast, learnable_sink=s, **variant)
        o.backward(dout.to(dtype))
        return tuple(t.grad for t in leaves) + (() if s is None else (s.grad,))

    return grads(torch.float32, True), grads(q.dtype, False)


def _check_grads(name, got, ref, base, softcap):
    from stage0_reference.torch_reference import grad_atol

    rtol = 3.0 if softcap else 2.0
    for part, a, r, bl in zip(("dq", "dk", "dv", "dsink"), got, ref, base):
        from stage0_reference.torch_reference import _max_abs_diff

        err, bound = _max_abs_diff(a, r), rtol * _max_abs_diff(bl, r) + grad_atol(ref)
        assert err <= bound, f"{name} {part}: max error {err:.3e} > {bound:.3e}"


# (sq, sk, hq, hkv, d, causal, window, softcap)
BWD_CASES = [
    (1, 1, 2, 1, 64, False, (0, 0), 0.0),
    (113, 203, 6, 1, 128, False, (40, 7), 0.0),
    (239, 1, 4, 2, 96, True, (3, None), 0.0),
    (799, 3, 6, 6, 64, False, (None, 1), 30.0),
    (255, 256, 4, 2, 128, True, (100, None), 30.0),
    (1023, 1024, 6, 3, 64, True, (257, None), 0.0),
    (1023, 1024, 2, 2, 96, False, (129, 300), 5.0),
    (1000, 1500, 4, 4, 128, False, (None, None), 50.0),
    (4224, 4224, 2, 1, 128, True, (1024, None), 0.0),
    (1500, 700, 4, 2, 64, False, (64, 64), 0.0),
    # softcap on a plain walk at d = 64: row statistics from SMEM (options.for_config)
    (700, 517, 4, 2, 64, False, (None, None), 30.0),
    # softcap through the causal mask_offsets bodies (d <= 96), whose columns past the queries get lse2 = +inf
    (1023, 1024, 2, 2, 64, True, (None, None), 30.0),
    (300, 300, 4, 1, 96, True, (None, None), 5.0),
]


@pytest.mark.gpu
@pytest.mark.stage4
@pytest.mark.parametrize("case", BWD_CASES, ids=[
    f"{c[0]}x{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-{'causal' if c[5] else 'full'}-w{c[6][0]},{c[6][1]}-cap{c[7]:g}"
    for c in BWD_CASES])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_backward_variants(case, deterministic):
    import torch
    from stage0_reference.torch_reference import attention_ref
    from stage4_bwd_kernel import hopper as bwd

    sq, sk, hq, hkv, d, causal, window, softcap = case
    q, k, v = _qkv(2, sq, sk, hq, hkv, d, d, "bf16", sq + sk)
    g = torch.Generator(device="cuda").manual_seed(sq)
    dout = torch.randn(q.shape[:3] + (d,), device="cuda", dtype=q.dtype, generator=g)
    variant = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = attention_ref(q, k, v, upcast=True, **variant)
    out = out.to(q.dtype)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    got = bwd.attention_backward(q, k, v, out, dout, lse, deterministic=deterministic, dq=dq, dk=dk, dv=dv, **variant)
    ref, base = _variant_grads(q, k, v, dout, variant)
    _check_grads(f"{case} det={deterministic}", got, ref, base, softcap)
    if deterministic:
        again = bwd.attention_backward(q, k, v, out, dout, lse, deterministic=True, **variant)
        assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.gpu
@pytest.mark.stage4
def test_backward_varlen_variants_with_empty_sequences():
    import torch
    from stage0_reference.torch_reference import attention_varlen_ref
    from stage4_bwd_kernel import hopper as bwd

    lens_q, lens_k = [0, 300, 1, 517, 0, 129], [5, 290, 0, 517, 0, 1000]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn(sum(lens_q), 6, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sum(lens_k), 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    dout = torch.randn_like(q)
    variant = dict(causal=True, window_size=(64, None), softcap=20.0)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, upcast=True, **variant)
    got = bwd.attention_varlen_backward(q, k, v, out.to(q.dtype), dout, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                        **variant)

    def grads(dtype, upcast):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        o, _ = attention_varlen_ref(*leaves, cu_q, cu_k, upcast=upcast, **variant)
        o.backward(dout.to(dtype))
        return tuple(t.grad for t in leaves)

    _check_grads("varlen", got, grads(torch.float32, True), grads(q.dtype, False), softcap=20.0)


@pytest.mark.gpu
@pytest.mark.fa4
@pytest.mark.parametrize("d", [64, 128])
def test_fa4_window_softcap_sink_forward_backward(d):
    """Through fa4.flash_attn_func and autograd: out and dq, dk, dv against the fp32 reference with the
    rule, and lse too; dsink exactly the formula -sum_i exp(sink - lse_i) dO_i . O_i on the call's own
    out and lse (as the official kernel forms it, from the stored 16-bit output). No bound against a
    multiple of the autograd baseline's dsink error: that error is one sum per head, and over fresh dO
    draws on an H200 it ranged 5e-4 .. 2.6e-2 while ours ranged 7e-4 .. 1.3e-2 (a 4x bound failed
    once) -- the two are independent draws of rounding noise, not a scale."""
    import torch

    import fa4
    from stage0_reference.torch_reference import attention_ref

    q, k, v = _qkv(2, 700, 900, 6, 2, d, d, "bf16", d)
    sink = _sink(6, d)
    variant = dict(causal=True, window_size=(200, 0), softcap=30.0)
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    s = sink.detach().clone().requires_grad_(True)
    out, lse = fa4.flash_attn_func(*leaves, learnable_sink=s, return_lse=True, **variant)
    dout = torch.randn_like(out)
    out.backward(dout)
    got = tuple(t.grad for t in leaves)
    ref, base = _variant_grads(q, k, v, dout, variant, sink=sink)
    _check_grads(f"fa4 d={d}", got, ref[:3], base[:3], softcap=30.0)
    # dsink is exactly the formula on the call's own out and lse, and those two meet the rule:
    # dsink's distance from the reference is then what out's and lse's own errors give it
    variant["learnable_sink"] = sink
    _check(f"fa4 d={d}", out.detach(), lse.detach(), attention_ref(q, k, v, upcast=True, **variant),
           attention_ref(q, k, v, upcast=False, **variant), softcap=30.0)
    w = torch.exp(sink.double()[:, None] - lse.detach().double())                      # (B, H, Sq)
    dd = (dout.double() * out.detach().double()).sum(-1).permute(0, 2, 1)             # (B, H, Sq)
    torch.testing.assert_close(s.grad.double(), -(w * dd).sum((0, 2)), rtol=1e-5, atol=1e-5)


# spill bytes a consumer thread of a windowed backward may store: 0, except the d = 64 band's default
# mode, whose row statistics come from SMEM (stats_shuffle off) so that ptxas keeps its wgmmas async:
# 16 bytes dense, 20 varlen, where with the shuffle it serialized them (C7512)
WINDOW_BWD_BUILDS = {(64, True, False): 0, (96, True, False): 0, (128, True, False): 0,
                     (64, False, False): 16, (64, False, True): 20, (96, False, False): 0, (128, False, False): 0,
                     # the wide body (qk 192 -> v 128, 256 -> 256)
                     (192, True, False): 0, (192, False, True): 0, (256, True, True): 0, (256, False, False): 0}
WIDE_DV = {192: 128}


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("d,causal,varlen", list(WINDOW_BWD_BUILDS),
                         ids=[f"d{d}-{'causal' if c else 'band'}{'-varlen' if v else ''}"
                              for d, c, v in WINDOW_BWD_BUILDS])
def test_backward_window_builds_without_serialized_wgmma(d, causal, varlen):
    """Causal + a left window, or a band (both edges, not causal): async wgmmas, spills at most the
    measured bytes (the options a band gets: test_backward_band_options)."""
    from stage4_bwd_kernel.hopper import backward as bwd

    window = (256, None) if causal else (256, 256)
    comp = bwd.compile_only("bf16", d, WIDE_DV.get(d, d), causal, varlen=varlen, window_size=window)
    assert not comp.report["wgmma_serialized"], comp.report["ptxas_log"]
    assert comp.report["spill_stores"] <= WINDOW_BWD_BUILDS[(d, causal, varlen)], comp.report


@pytest.mark.cpu
@pytest.mark.stage4
def test_backward_band_options():
    """A band (or a left window) turns off the one-edge masked bodies in the options themselves, and at
    the 128-query tile in the default mode the shuffled row statistics (C7512 with them)."""
    from stage3_fwd_kernel.components.window import Window
    from stage4_bwd_kernel.hopper.options import BackwardOptions, is_banded

    assert is_banded(Window(256, 256), False) and is_banded(Window(256, None), True)
    assert is_banded(Window(None, 0), False) and not is_banded(Window(None, 0), True)
    assert not is_banded(Window(None, None), False)
    plain = BackwardOptions.for_config(64, 64, False, False, False)
    band = BackwardOptions.for_config(64, 64, False, False, False, banded=True)
    assert plain.stats_shuffle and not band.stats_shuffle
    assert BackwardOptions.for_config(64, 64, False, True, False, banded=True).stats_shuffle  # deterministic
    causal = BackwardOptions.for_config(96, 96, True, False, False)
    assert causal.mask_offsets and causal.column_limit
    windowed = BackwardOptions.for_config(96, 96, True, False, False, banded=True)
    assert not windowed.mask_offsets and not windowed.column_limit
    # asking a band for a one-edge body is refused, not silently replaced
    from stage4_bwd_kernel.hopper import backward as bwd

    for name in ("column_limit", "mask_offsets"):
        with pytest.raises(ValueError, match=name):
            bwd.make_kernel(None, 96, 96, True, False, window=Window(256, None), **{name: True})
    assert not bwd.make_kernel(None, 96, 96, True, False, window=Window(256, None)).column_limit


@pytest.mark.cpu
@pytest.mark.stage4
def test_variant_kernels_construct_across_the_support_matrix():
    """Every product head-dim pair x causal x window x softcap builds its forward and backward kernel
    objects with the defaults (no compile: the options' own checks, before any launch), and the
    backward's options pass their check in every (deterministic, varlen) mode. The wide head dims
    once set column_limit whatever the window, so a window at (192, 128) or 256 raised in the backward."""
    import itertools

    from stage3_fwd_kernel.components.window import beyond_causal
    from stage3_fwd_kernel.hopper import host as fwd_host
    from stage4_bwd_kernel.hopper import backward as bwd

    import cutlass  # after stage 3, which sets the DSL's arch
    from stage4_bwd_kernel.hopper.options import RS_HEAD_DIMS, WIDE_HEAD_DIMS, BackwardOptions, is_banded, is_wide

    windows = ((None, None), (40, 7), (256, None), (None, 0), (1024, 0))
    for (d, dv), causal, window_size, softcap in itertools.product(RS_HEAD_DIMS + WIDE_HEAD_DIMS, (False, True),
                                                                    windows, (0.0, 30.0)):
        if causal and window_size[1] not in (None, 0):
            continue  # refused by the window's own validation (causal means right = 0)
        window = beyond_causal(causal, window_size)
        fwd_host.make_kernel(cutlass.BFloat16, d, dv, causal, variant=fwd_host.Variant(window, softcap))
        banded = is_banded(window, causal)
        for det, varlen in itertools.product((False, True), (False, True)):
            options = BackwardOptions.for_config(d, dv, causal, det, varlen, banded)
            options.check(varlen, wide=is_wide(d, dv), deterministic=det, banded=banded, causal=causal)
            kernel = bwd.make_kernel(None, d, dv, causal, det, varlen=varlen, window=window, softcap=softcap)
            assert kernel.column_limit == options.column_limit and not (banded and kernel.column_limit)


@pytest.mark.cpu
@pytest.mark.stage4
@pytest.mark.parametrize("cap", [5.0, 30.0, 50.0])
def test_softcap_tanh_recovered_from_p(cap):
    """The identity behind scores.TanhFromP, in float32 numpy (not the kernel's code: its MUFU lg2 / ex2
    are approximations of these, and the GPU tests check the kernel): t = (log2 P + lse2) / (cap log2 e)
    gives the tanh back from P = exp2(t cap log2 e - lse2) to ~1e-6, and selecting the derivative to 0
    where P is 0 -- a masked score (finite lse2) or a row that sees no key (lse2 = +inf) -- leaves no NaN."""
    import numpy as np

    rng = np.random.default_rng(0)
    cap = np.float32(cap)
    scale_log2 = np.float32(cap * np.log2(np.e))
    t = np.tanh(rng.normal(0, 2, size=(64, 128))).astype(np.float32)          # keys x queries
    x = t * scale_log2
    lse2 = (x.max(0) + np.log2(np.exp2(x - x.max(0)).sum(0))).astype(np.float32)  # per query
    p = np.exp2(x - lse2).astype(np.float32)
    p[:5] = 0.0                                                                 # masked scores
    lse2_rows = np.broadcast_to(lse2, p.shape).copy()
    lse2_rows[:, :3] = np.inf                                                   # queries with no key
    p[:, :3] = np.exp2(x[:, :3] - lse2_rows[:, :3])
    p[p < np.finfo(np.float32).tiny] = 0.0                                      # ex2.approx.ftz flushes subnormals
    with np.errstate(divide="ignore", invalid="ignore"):
        got = (np.log2(p) + lse2_rows) * np.float32(1.0 / scale_log2)
    got = np.clip(np.nan_to_num(got, nan=1.0, neginf=-1.0), -1.0, 1.0)       # min / max ignore NaN
    grad = np.where(p > 0, 1.0 - got * got, 0.0)
    live = p > 0
    assert np.abs(got[live] - t[live]).max() < 2e-6
    assert np.isfinite(grad).all() and (grad[~live] == 0).all() and (~live).sum() >= 5 * 125 + 64 * 3


# spill bytes a consumer thread of the softcap backward may store (ptxas), the measured values plus a
# few: d = 128 causal 0, deterministic 60, window 0, d = 64 causal 48, non-causal 36 (116 with the row
# statistics by shuffle, which its deterministic build keeps: options.for_config), d = 96 and (192, 128) 0,
# since dS^T recovers the tanh from P^T; keeping 1 - tanh^2 in registers spilled 648 / 684 / 648 / 864 / 76
# / 0 / 0 (stage4_bwd_kernel/hopper/scores.py, TanhFromP)
SOFTCAP_BWD_SPILL_BOUND = {(128, 128, True, ""): 8, (128, 128, True, "det"): 64, (128, 128, True, "window"): 8,
                           (64, 64, True, ""): 56, (64, 64, False, ""): 40, (64, 64, False, "det"): 40,
                           (96, 96, True, ""): 0, (192, 128, True, ""): 0}


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("d,dv,causal,mode", list(SOFTCAP_BWD_SPILL_BOUND),
                         ids=[f"d{d}x{dv}-{'causal' if c else 'full'}{'-' + m if m else ''}"
                              for d, dv, c, m in SOFTCAP_BWD_SPILL_BOUND])
def test_backward_softcap_spills_bounded(d, dv, causal, mode):
    import re

    from stage4_bwd_kernel.hopper import backward as bwd

    kw = dict(deterministic=mode == "det", window_size=(256, None) if mode == "window" else (None, None))
    comp = bwd.compile_only("bf16", d, dv, causal, softcap=30.0, **kw)
    assert comp.report["spill_stores"] <= SOFTCAP_BWD_SPILL_BOUND[(d, dv, causal, mode)], comp.report
    assert not comp.report["wgmma_serialized"]
    # one MUFU.LG2 per score recovers the tanh; as many as the tanh's own MUFU.TANH
    assert len(re.findall(r"MUFU\.LG2", comp.sass)) == len(re.findall(r"MUFU\.TANH", comp.sass)) > 0


@pytest.mark.gpu
@pytest.mark.stage4
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_backward_returns_the_preprocess_d_rows(varlen):
    """return_d: D = rowsum(dO * O) from the backward's preprocess, in lse's layout (varlen: gathered
    from the per-sequence padded rows), equal to torch's within fp32 rounding; with dlse, D - dlse
    where lse > -inf, on the launch path and on the no-key early return (max_seqlen_k = 0)."""
    import torch
    from stage4_bwd_kernel import hopper as bwd

    g = torch.Generator(device="cuda").manual_seed(4)
    if varlen:
        lens = [0, 300, 1, 517, 0, 129]
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
        q, k, v, out, dout = (torch.randn(sum(lens), 4, 64, device="cuda", dtype=torch.bfloat16, generator=g)
                              for _ in range(5))
        lse = torch.randn(4, sum(lens), device="cuda", generator=g)
        call = lambda max_k, **kw: bwd.attention_varlen_backward(  # noqa: E731
            q, k, v, out, dout, lse, cu, cu if max_k else torch.zeros_like(cu), max(lens), max_k, return_d=True, **kw)
        expect = (dout.float() * out.float()).sum(-1).t()
    else:
        q, k, v, out, dout = (torch.randn(2, 333, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g)
                              for _ in range(5))
        lse = torch.randn(2, 4, 333, device="cuda", generator=g)
        call = lambda max_k, **kw: bwd.attention_backward(  # noqa: E731
            q, k if max_k else k[:, :0], v if max_k else v[:, :0], out, dout, lse, return_d=True, **kw)
        expect = (dout.float() * out.float()).sum(-1).permute(0, 2, 1)
    *_, d = call(max(lens) if varlen else 333)
    assert d.shape == lse.shape
    torch.testing.assert_close(d, expect, rtol=1e-4, atol=1e-3)
    lse[..., ::5] = float("-inf")
    dlse = torch.randn(lse.shape, device="cuda", generator=g) * 100
    dlse[..., ::5] = float("inf")
    shifted = expect - torch.where(torch.isneginf(lse), 0.0, dlse)
    for max_k in ((max(lens) if varlen else 333), 0):
        *_, d = call(max_k, dlse=dlse)
        torch.testing.assert_close(d, shifted, rtol=1e-4, atol=1e-3, msg=f"max_seqlen_k {max_k}")
