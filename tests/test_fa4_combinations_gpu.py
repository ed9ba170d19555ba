"""fa4's features in random combinations on a Hopper GPU, through the public functions and autograd.

Each other GPU file varies one feature around a fixed case. Here every case draws these at once
from a seeded generator (so the case list and its ids are stable): a head-dim pair (native or
zero-padded), dtype, GQA ratio 1 / 2 / 6, causal, a sliding window (one-sided or both), softcap, a
learnable sink (fp32 or the inputs' dtype), deterministic mode, a gradient through lse, and a
dense call or a packed varlen call whose batch has empty (and often one-token) sequences. Not drawn
here: seqused_q / seqused_k and padded varlen sides (test_fa4_layouts_gpu.py), paged caches and
decode (test_hopper_paged.py, test_fa4_kvcache_gpu.py). The inputs are fresh each run
(the seed is in every failure message; FA4_TEST_SEED replays one) and the outputs start as NaN.

Judged with FA4's rule against the fp32 reference (stage0_reference.torch_reference): out, lse,
dq, dk, dv at most 2x (3x with softcap, whose tanh.approx differs from torch's) the error of the
same attention in the input precision, plus a tiny atol; dsink against the gradient formula on the
call's own out and lse (fa4/_dispatch.sink_grad; rtol 1e-5, 1e-2 for a 16-bit sink), as
test_hopper_variants does;
deterministic mode bitwise equal on a second call.
"""
from __future__ import annotations

import os
import random

import pytest
import torch

import fa4

pytestmark = [pytest.mark.fa4]

# native pairs, then pairs that run zero-padded on one of them
HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (128, 64), (192, 128), (256, 256), (80, 80), (72, 40), (160, 128),
             (64, 128)]
DENSE_SHAPES = [(1, 1), (3, 3), (64, 1), (239, 1), (799, 3), (113, 203), (255, 256), (1023, 1024), (700, 517)]
NUM_CASES = 28


def _window(rng: random.Random, span: int, causal: bool):
    kind = rng.choice(["none", "left", "right", "both"] if not causal else ["none", "left", "left"])
    left = rng.randint(0, span) if kind in ("left", "both") else None
    right = rng.randint(0, span) if kind in ("right", "both") else None
    return (left, 0 if causal else right)


def _lengths(rng: random.Random, n: int, top: int) -> list[int]:
    """n sequence lengths, at least one of them 0 (one-token sequences are drawn often, not forced)."""
    lens = [rng.choice([0, 1, rng.randint(2, top), rng.randint(2, top)]) for _ in range(n)]
    lens[rng.randrange(n)] = 0
    return lens


def _draw_cases():
    rng = random.Random(20261204)
    cases = []
    for i in range(NUM_CASES):
        d, dv = HEAD_DIMS[i % len(HEAD_DIMS)]  # every pair at least twice
        causal = rng.random() < 0.5
        varlen = rng.random() < 0.4
        if varlen:
            shape = (_lengths(rng, 5, 600), _lengths(rng, 5, 700))
            span = 700
        else:
            shape = rng.choice(DENSE_SHAPES)
            span = max(shape)
        group, hkv = rng.choice([1, 2, 6]), rng.choice([1, 2])
        cases.append(dict(
            d=d, dv=dv, dtype=rng.choice(["bf16", "fp16"]), hq=group * hkv, hkv=hkv, causal=causal,
            window=_window(rng, span, causal), softcap=rng.choice([0.0, 0.0, 5.0, 30.0]),
            sink=rng.choice([None, None, "fp32", "input"]), deterministic=rng.random() < 0.3,
            dlse=rng.random() < 0.4, varlen=varlen, shape=shape))
    return cases


CASES = _draw_cases()


def _case_id(c) -> str:
    shape = "varlen" if c["varlen"] else "{}x{}".format(*c["shape"])
    return (f"d{c['d']}x{c['dv']}-{c['dtype']}-h{c['hq']}/{c['hkv']}-{shape}-{'causal' if c['causal'] else 'full'}"
            f"-w{c['window'][0]},{c['window'][1]}-cap{c['softcap']:g}-sink{c['sink']}"
            f"{'-det' if c['deterministic'] else ''}{'-dlse' if c['dlse'] else ''}")


def _seed() -> int:
    return int(os.environ.get("FA4_TEST_SEED") or random.SystemRandom().randrange(2**31))


def _inputs(c, g):
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[c["dtype"]]
    randn = lambda *s: torch.randn(*s, device="cuda", dtype=dt, generator=g)  # noqa: E731
    if c["varlen"]:
        lens_q, lens_k = c["shape"]
        q = randn(sum(lens_q), c["hq"], c["d"])                       # (Tq, Hq, D)
        k, v = randn(sum(lens_k), c["hkv"], c["d"]), randn(sum(lens_k), c["hkv"], c["dv"])
    else:
        sq, sk = c["shape"]
        q, k, v = randn(2, sq, c["hq"], c["d"]), randn(2, sk, c["hkv"], c["d"]), randn(2, sk, c["hkv"], c["dv"])
    sink = None
    if c["sink"] is not None:
        sink = (torch.randn(c["hq"], device="cuda", generator=g) * 2).to(torch.float32 if c["sink"] == "fp32" else dt)
    return q, k, v, sink


def _cu(lens, device="cuda"):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _call(c, q, k, v, sink, variant):
    """fa4's out and lse for the case, on outputs the caching allocator hands out as NaN."""
    torch.full((64 << 20,), float("nan"), device="cuda")  # freed at once: the next allocations start as NaN
    if c["varlen"]:
        lens_q, lens_k = c["shape"]
        return fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=_cu(lens_q), cu_seqlens_k=_cu(lens_k),
                                          max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), learnable_sink=sink,
                                          return_lse=True, deterministic=c["deterministic"], **variant)
    return fa4.flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True, deterministic=c["deterministic"],
                               **variant)


def _rows(t, varlen):
    """rowsum over the head dim of an out-shaped tensor, in lse's layout: (B, H, Sq) / (H, Tq)."""
    t = t.sum(-1)
    return t.transpose(0, 1) if varlen else t.permute(0, 2, 1)


def _reference(c, q, k, v, sink, dout, dlse, variant, upcast, out_given=None):
    """out, lse, dq, dk, dv of the reference (fp32) or the baseline (input precision).

    out_given (the reference only): the call's own 16-bit out. A FlashAttention backward forms
    D = rowsum(dO * out) from the out it is handed, so the reference's gradients are those of the
    same function of that out: dS = P (dP - D) with D from out_given, entered as an lse-gradient term
    (dS += P * dlse). It matters with few keys and a sink: there the baseline's softmax runs in fp32
    from its own P, and an exact fp32 backward fed the rounded out exceeds 2x its error in up to 18%
    of draws at (1 x 1) (test_the_reference_takes_the_calls_own_out)."""
    from stage0_reference.torch_reference import attention_ref, attention_varlen_ref

    leaves = [(t.detach().float() if upcast else t.detach()).requires_grad_() for t in (q, k, v)]
    s = None if sink is None else sink.detach().float()
    if c["varlen"]:
        lens_q, lens_k = c["shape"]
        out, lse = attention_varlen_ref(*leaves, _cu(lens_q, q.device), _cu(lens_k, q.device), upcast=upcast,
                                        learnable_sink=s, **variant)
    else:
        out, lse = attention_ref(*leaves, upcast=upcast, learnable_sink=s, **variant)
    lse_grad = torch.zeros_like(lse) if dlse is None else dlse.float()
    if out_given is not None:
        d_own = _rows(dout.float() * out_given.detach().float(), c["varlen"])
        lse_grad = lse_grad - (d_own - _rows(dout.float() * out.detach().float(), c["varlen"]))
    loss = (out.float() * dout.float()).sum() + (torch.where(torch.isfinite(lse), lse, 0) * lse_grad).sum()
    return (out.detach(), lse.detach(), *torch.autograd.grad(loss, leaves))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_feature_combination_forward_and_backward(case):
    from stage0_reference.torch_reference import _max_abs_diff, grad_atol

    c, seed = case, _seed()
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, sink = _inputs(c, g)
    variant = dict(causal=c["causal"], window_size=c["window"], softcap=c["softcap"])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    s = None if sink is None else sink.clone().requires_grad_()
    out, lse = _call(c, *leaves, s, variant)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
    dlse = torch.randn(lse.shape, device="cuda", generator=g) if c["dlse"] else None
    grads = torch.autograd.grad((out, lse) if dlse is not None else (out,),
                                leaves + ([s] if s is not None else []), (dout, dlse) if dlse is not None else (dout,))
    name = f"{_case_id(c)} seed={seed}"

    ref = _reference(c, q, k, v, sink, dout, dlse, variant, upcast=True, out_given=out)
    base = _reference(c, q, k, v, sink, dout, dlse, variant, upcast=False)
    rtol, atol = (3.0 if c["softcap"] else 2.0), grad_atol(ref[2:])
    assert out.shape == ref[0].shape and lse.shape == ref[1].shape, name
    for part, a, r, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads[:3]), ref, base):
        assert not torch.isnan(a).any(), f"{name} {part}: NaN (an unwritten element of a poisoned output)"
        err = _max_abs_diff(a, r)
        bound = rtol * _max_abs_diff(b, r) + (1e-5 if part in ("out", "lse") else atol)
        assert err <= bound, f"{name} {part}: max error {err:.3e} > {bound:.3e}"
    if s is not None:  # the formula on the call's own out and lse (whose errors the rule bounded above)
        from fa4._dispatch import sink_grad

        want = sink_grad(out.detach().double(), dout.double(), lse.detach().double(), sink.double(),
                         None if dlse is None else dlse.double())
        tol = 1e-5 if sink.dtype == torch.float32 else 1e-2
        torch.testing.assert_close(grads[3].double(), want, rtol=tol, atol=tol, msg=lambda m: f"{name} dsink: {m}")
    if c["deterministic"]:
        out2, lse2 = _call(c, *leaves, s, variant)
        again = torch.autograd.grad((out2, lse2) if dlse is not None else (out2,),
                                    leaves + ([s] if s is not None else []),
                                    (dout, dlse) if dlse is not None else (dout,))
        assert torch.equal(out, out2) and torch.equal(lse, lse2), f"{name}: forward not reproducible"
        assert all(torch.equal(a, b) for a, b in zip(grads, again)), f"{name}: deterministic backward differs"


@pytest.mark.cpu
def test_the_cases_cover_every_feature():
    """The draw is fixed: this fails if a change to it loses a feature (a case list that never
    combines, say, a sink with varlen would not say so)."""
    pairs = {(c["d"], c["dv"]) for c in CASES}
    assert pairs == set(HEAD_DIMS)
    assert any(c["varlen"] and c["sink"] for c in CASES) and any(c["varlen"] and c["softcap"] for c in CASES)
    assert any(c["varlen"] and c["window"] != (None, None) for c in CASES)
    assert any(c["deterministic"] and c["sink"] for c in CASES) and any(c["deterministic"] and c["dlse"] for c in CASES)
    assert any(c["dlse"] and c["varlen"] for c in CASES) and any(c["dlse"] and c["sink"] for c in CASES)
    # a dense lse gradient whose D rows are padded (Sq not a multiple of 4): the preprocess shifts a slice
    assert any(c["dlse"] and not c["varlen"] and c["shape"][0] % 4 for c in CASES)
    assert {c["hq"] // c["hkv"] for c in CASES} == {1, 2, 6}
    assert any(c["window"][0] is not None and c["window"][1] not in (None, 0) for c in CASES)  # both sides
    assert any(c["d"] >= 192 and (c["softcap"] or c["window"] != (None, None) or c["sink"]) for c in CASES)
    assert {c["dtype"] for c in CASES} == {"bf16", "fp16"}


def _flash_backward(q, k, v, out, dout, lse):
    """FlashAttention's backward in exact arithmetic: stage 0's float64 oracle, which forms D from the
    out it is handed (here the stored 16-bit one), gradients rounded to bf16 as a kernel stores them."""
    from stage0_reference import attention_backward

    grads = attention_backward(*(t.double().numpy() for t in (q, k, v, out, dout, lse)))
    return [torch.from_numpy(g).to(torch.bfloat16) for g in grads]


@pytest.mark.cpu
def test_the_reference_takes_the_calls_own_out():
    """Why _reference takes out_given, on the CPU: FlashAttention's backward in exact arithmetic
    (D from the bf16-rounded out, gradients rounded to bf16) meets the rule against the reference fed
    that out in every draw, but not against the plain fp32 reference: with a sink and one key the
    baseline's fp32 softmax leaves it too little room."""
    from stage0_reference.torch_reference import _max_abs_diff, grad_atol

    c = dict(varlen=False)
    variant = dict(causal=False, window_size=(None, None), softcap=0.0)
    g = torch.Generator().manual_seed(5)
    plain_over = 0
    for _ in range(40):
        q, k, v = (torch.randn(2, 1, h, 80, generator=g).to(torch.bfloat16) for h in (6, 1, 1))
        dout = torch.randn(2, 1, 6, 80, generator=g).to(torch.bfloat16)
        sink = torch.randn(6, generator=g) * 2
        exact = _reference(c, q, k, v, sink, dout, None, variant, upcast=True)
        out_b = exact[0].to(torch.bfloat16)                                  # the stored 16-bit out
        flash = _flash_backward(q, k, v, out_b, dout, exact[1])
        given = _reference(c, q, k, v, sink, dout, None, variant, upcast=True, out_given=out_b)
        base = _reference(c, q, k, v, sink, dout, None, variant, upcast=False)
        for i, got in enumerate(flash):
            def over(ref):
                bound = 2 * _max_abs_diff(base[2 + i], ref[2 + i]) + grad_atol(ref[2:])
                return _max_abs_diff(got, ref[2 + i]) > bound
            assert not over(given), ("dq", "dk", "dv")[i]
            plain_over += over(exact)
    assert plain_over > 0, plain_over
