"""The sm_100 gpu tier: what to run first on a B200 (compute capability 10.0). No Blackwell GPU is
reachable from this project, so every test here skips elsewhere, and none of them has ever run.

    python -m pytest -m gpu tests/test_stage3_blackwell.py tests/test_blackwell_gpu.py

Under FA4's rule against the fp32 reference (stage0_reference.torch_reference.assert_fa4_close):
* the forward through fa4 (dense, GQA, causal with the LPT order from 4096 keys, varlen, lse);
* the 1-CTA backward (stage4_bwd_kernel.blackwell_bwd) and, at (192, 128) / 256, the wide one
  (blackwell_bwd_wide), default and deterministic (bitwise repeats), and fa4's autograd on top (the
  2-CTA backward has no launch path yet: compiled only);
* a head dim without a kernel of its own (96: zero-padded onto 128 by fa4).
tests/test_stage3_blackwell.py's gpu tests run the forward module directly.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.stage4]


@pytest.fixture(autouse=True)
def _needs_blackwell():
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10):
        pytest.skip("needs a Blackwell GPU (compute capability 10.x); none exists in this project")


def _rand(g, *shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)


FWD_CASES = [(1, 1, 4, 1, 128, False), (113, 203, 4, 2, 64, True), (799, 3, 2, 2, 128, False),
             (4224, 4224, 8, 2, 128, True), (300, 300, 4, 4, 96, True)]


@pytest.mark.parametrize("sq,sk,hq,hkv,d,causal", FWD_CASES, ids=[f"{c[0]}x{c[1]}-d{c[4]}-{'causal' if c[5] else 'full'}"
                                                                  for c in FWD_CASES])
def test_fa4_forward_and_backward_on_blackwell(sq, sk, hq, hkv, d, causal):
    """fa4.flash_attn_func on sm_100: out, lse and (head dims 64 / 128, and 96 padded onto 128) the
    gradients. 4224 keys causal launches the LPT order."""
    import fa4
    from stage0_reference.torch_reference import assert_fa4_close, grad_atol, reference_and_baseline

    g = torch.Generator(device="cuda").manual_seed(sq + sk + d)
    q = _rand(g, 2, sq, hq, d).requires_grad_()
    k, v = _rand(g, 2, sk, hkv, d).requires_grad_(), _rand(g, 2, sk, hkv, d).requires_grad_()
    out, lse = fa4.flash_attn_func(q, k, v, causal=causal, return_lse=True)  # warns once: unverified
    dout = _rand(g, 2, sq, hq, d)
    got = (out, lse, *torch.autograd.grad(out, (q, k, v), dout))
    ref, base = reference_and_baseline(q, k, v, dout, causal=causal)
    for name, a, r, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref, base):
        assert_fa4_close(f"sm_100 {name}", a, r, b, atol=1e-5 if name in ("out", "lse") else grad_atol(ref[2:]))


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_forward_on_blackwell(causal):
    import fa4
    from stage0_reference.torch_reference import assert_fa4_close, attention_varlen_ref

    lens_q, lens_k = [1, 0, 130, 513, 77], [5, 9, 130, 300, 1]
    cu = lambda ls: torch.tensor([0] + torch.tensor(ls).cumsum(0).tolist(), dtype=torch.int32, device="cuda")  # noqa: E731
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = _rand(g, sum(lens_q), 8, 128), _rand(g, sum(lens_k), 2, 128), _rand(g, sum(lens_k), 2, 128)
    out, lse = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu(lens_q), cu_seqlens_k=cu(lens_k),
                                          max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=causal,
                                          return_lse=True)
    ref = attention_varlen_ref(q, k, v, cu(lens_q), cu(lens_k), causal=causal, upcast=True)
    base = attention_varlen_ref(q, k, v, cu(lens_q), cu(lens_k), causal=causal, upcast=False)
    assert_fa4_close("sm_100 varlen out", out, ref[0], base[0])
    assert_fa4_close("sm_100 varlen lse", lse, ref[1], base[1])


WIDE_CASES = [(113, 203, 4, 2, 192, 128, True), (300, 1000, 4, 1, 256, 256, False), (255, 256, 6, 1, 128, 64, True)]


@pytest.mark.parametrize("sq,sk,hq,hkv,d,dv,causal", WIDE_CASES, ids=[f"{c[0]}x{c[1]}-d{c[4]}-{c[5]}" for c in WIDE_CASES])
def test_fa4_wide_head_dims_on_blackwell(sq, sk, hq, hkv, d, dv, causal):
    """fa4.flash_attn_func at (192, 128) and 256 (the forward and the wide backward, blackwell_bwd_wide),
    and at (128, 64) (the 1-CTA backward with dv != d)."""
    import fa4
    from stage0_reference.torch_reference import assert_fa4_close, grad_atol, reference_and_baseline

    g = torch.Generator(device="cuda").manual_seed(sq + d)
    q, k = _rand(g, 2, sq, hq, d).requires_grad_(), _rand(g, 2, sk, hkv, d).requires_grad_()
    v = _rand(g, 2, sk, hkv, dv).requires_grad_()
    out = fa4.flash_attn_func(q, k, v, causal=causal)
    dout = _rand(g, 2, sq, hq, dv)
    got = (out, *torch.autograd.grad(out, (q, k, v), dout))
    ref, base = reference_and_baseline(q, k, v, dout, causal=causal)
    for name, a, r, b in zip(("out", "dq", "dk", "dv"), got, (ref[0], *ref[2:]), (base[0], *base[2:])):
        assert_fa4_close(f"sm_100 wide {name}", a, r, b, atol=1e-5 if name == "out" else grad_atol(ref[2:]))


@pytest.mark.parametrize("d,dv,causal", [(64, 64, False), (128, 128, True), (128, 64, False), (192, 128, True),
                                         (256, 256, False)])
def test_backward_kernel_on_blackwell(d, dv, causal):
    """The backward directly (the forward's out / lse from the reference; the 1-CTA kernel, or the
    wide one at (192, 128) and 256), default and deterministic; deterministic twice is bitwise equal."""
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref, grad_atol
    from stage4_bwd_kernel import blackwell as mod   # routes (192, 128) / 256 to the wide kernel
    from stage4_bwd_kernel import host

    g = torch.Generator(device="cuda").manual_seed(d + causal)
    q, k, v = _rand(g, 2, 1000, 8, d), _rand(g, 2, 1200, 2, d), _rand(g, 2, 1200, 2, dv)
    dout = _rand(g, 2, 1000, 8, dv)
    out, lse = attention_ref(q, k, v, causal=causal, upcast=True)
    out = out.to(q.dtype)
    ref, base = host.reference_grads(q, k, v, dout, causal=causal)
    for det in (False, True):
        got = mod.attention_backward(q, k, v, out, dout, lse, causal=causal, deterministic=det)
        for name, a, r, b in zip(("dq", "dk", "dv"), got, ref, base):
            assert_fa4_close(f"blackwell_bwd {name} det={det}", a, r, b, atol=grad_atol(ref))
    again = mod.attention_backward(q, k, v, out, dout, lse, causal=causal, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.parametrize("paged", [False, True])
def test_kvcache_decode_on_blackwell(paged):
    """fa4.flash_attn_with_kvcache on sm_100: key segments of the varlen forward and the merge kernel;
    one appended token a step, GQA 8 / 2, a dense cache or shuffled pages of 128 (read in place)."""
    import fa4
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref

    g = torch.Generator(device="cuda").manual_seed(11 + paged)
    b, s_cache, hkv, d = 3, 1024, 2, 128
    lens = torch.tensor([0, 1, 700], dtype=torch.int32, device="cuda")
    k, v = _rand(g, b, s_cache, hkv, d), _rand(g, b, s_cache, hkv, d)
    q, k_new, v_new = _rand(g, b, 1, 8, d), _rand(g, b, 1, hkv, d), _rand(g, b, 1, hkv, d)
    kw = {}
    kc, vc = k.clone(), v.clone()
    if paged:
        pages = s_cache // 128
        perm = torch.randperm(b * pages, device="cuda", generator=g)
        kc, vc = torch.empty_like(k).view(-1, 128, hkv, d), torch.empty_like(v).view(-1, 128, hkv, d)
        kc[perm], vc[perm] = k.view(-1, 128, hkv, d), v.view(-1, 128, hkv, d)
        kw["block_table"] = perm.view(b, pages).to(torch.int32)
    out, lse = fa4.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, num_splits=0,
                                           return_softmax_lse=True, **kw)
    for i in range(b):
        n = int(lens[i])
        keys = torch.cat([k[i:i + 1, :n], k_new[i:i + 1]], 1)
        values = torch.cat([v[i:i + 1, :n], v_new[i:i + 1]], 1)
        ref = attention_ref(q[i:i + 1], keys, values, upcast=True)
        base = attention_ref(q[i:i + 1], keys, values, upcast=False)
        assert_fa4_close(f"sm_100 kvcache out b={i}", out[i:i + 1], ref[0], base[0])
        assert_fa4_close(f"sm_100 kvcache lse b={i}", lse[i:i + 1], ref[1], base[1])


@pytest.mark.parametrize("page", [128, 256])
def test_paged_varlen_forward_on_blackwell(page):
    """flash_attn_varlen_func over shuffled pages of whole key blocks (read in place by the load warp),
    against the same call on the dense keys: causal, GQA 8 / 2, lengths 1 / 300 / 1000 of 1024."""
    import fa4

    g = torch.Generator(device="cuda").manual_seed(page)
    lens = [1, 300, 1000]
    b, s_cache, hkv, d = len(lens), 1024, 2, 128
    k, v = _rand(g, b, s_cache, hkv, d), _rand(g, b, s_cache, hkv, d)
    pages = s_cache // page
    perm = torch.randperm(b * pages + 2, device="cuda", generator=g)[:b * pages]
    kp = torch.zeros(b * pages + 2, page, hkv, d, device="cuda", dtype=k.dtype)
    vp = torch.zeros_like(kp)
    kp[perm], vp[perm] = k.view(-1, page, hkv, d), v.view(-1, page, hkv, d)
    table = perm.view(b, pages).to(torch.int32)
    q = _rand(g, sum(lens), 8, d)
    cu_q = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    paged = fa4.flash_attn_varlen_func(q, kp, vp, cu_seqlens_q=cu_q, max_seqlen_q=max(lens), seqused_k=used,
                                       page_table=table, causal=True)
    dense = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, max_seqlen_q=max(lens), seqused_k=used,
                                       causal=True)
    torch.testing.assert_close(paged, dense, rtol=0, atol=0)
