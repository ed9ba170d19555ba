"""Decode-shaped flash_attn_func / flash_attn_varlen_func calls on the split-KV launch (fa4/_decode_route.py):
FA4's rule against stage 0's fp32 attention per sequence (the baseline: PyTorch in bf16 on the same keys),
the route taken where no gradient is wanted and not where one is, dense, paged (pages of 16, 64 read in
place; 24 gathered), padded and packed one-token queries, GQA / MQA, causal with more queries than keys,
windows, softcap, a sink, head dims that run padded, SDPA's transposed layout, CUDA graphs and torch.compile."""
from __future__ import annotations

import pytest
import torch

import fa4
from fa4 import _dispatch, _kvcache
import test_fa4_kvcache_gpu as tk  # its per-sequence fp32 truth, bf16 baseline and rule (tests/ is on the path)

pytestmark = [pytest.mark.gpu, pytest.mark.fa4]

BF16 = torch.bfloat16   # (the conftest skips the gpu tier where no CUDA device is usable)


@pytest.fixture
def routed(monkeypatch):
    """Counts the calls that reach flash_attn_with_kvcache's launch path (`_run_step`: with_kvcache's after its
    checks, and dense_decode's, which flash_attn_func's dense decode calls take without them)."""
    calls = []
    real = _kvcache._run_step

    def spy(backend, step, *args):
        calls.append(step[0].shape)
        return real(backend, step, *args)

    monkeypatch.setattr(_kvcache, "_run_step", spy)
    return calls


def _rand(*shape, seed, dtype=BF16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)


def _check(out, lse, q, k, v, lens, what, causal=False, window_size=(None, None), softcap=0.0, learnable_sink=None):
    """out (B, Sq, Hq, Dv) / lse (B, Hq, Sq) against sequence b's first lens[b] keys: the kvcache tests' rule."""
    truth = tk._truth_and_baseline(q, k, v, lens, causal, window_size, softcap, learnable_sink)
    tk._check(out, lse, *truth, what)


FUNC_CASES = {  # b, sq, (hq, hkv), sk, (d, dv), variants
    "one-token-gqa4-8k": (2, 1, (32, 8), 8192, (128, 128), {}),
    "one-token-mqa": (3, 1, (8, 1), 1000, (64, 64), {}),
    "four-causal-gqa8": (2, 4, (64, 8), 3001, (128, 128), dict(causal=True)),
    "64-causal-more-queries": (2, 64, (6, 1), 40, (128, 128), dict(causal=True)),
    "one-key": (1, 1, (4, 4), 1, (96, 96), {}),
    "window-left": (2, 3, (16, 2), 2000, (128, 128), dict(causal=True, window_size=(100, 0))),
    "window-both": (2, 5, (8, 8), 700, (128, 128), dict(window_size=(64, 2))),
    "softcap-sink": (2, 1, (32, 8), 4096, (128, 128), dict(softcap=30.0, sink=True)),
    "d192x128": (1, 2, (16, 4), 1500, (192, 128), dict(causal=True)),
    "d256": (2, 1, (8, 2), 2500, (256, 256), {}),
    "d128x64": (2, 1, (8, 2), 999, (128, 64), {}),
    "d72-padded": (2, 1, (8, 2), 517, (72, 72), {}),
    "right-window-more-queries": (2, 8, (8, 2), 4, (128, 128), dict(window_size=(None, 6))),
    "fp16-causal": (2, 4, (32, 8), 3000, (128, 128), dict(causal=True, dtype=torch.float16)),
}


@pytest.mark.parametrize("name", list(FUNC_CASES))
def test_flash_attn_func_decode_routed(name, routed):
    b, sq, (hq, hkv), sk, (d, dv), kw = FUNC_CASES[name]
    kw = dict(kw)
    dt = kw.pop("dtype", BF16)
    q, k = _rand(b, sq, hq, d, seed=1, dtype=dt), _rand(b, sk, hkv, d, seed=2, dtype=dt)
    v = _rand(b, sk, hkv, dv, seed=3, dtype=dt)
    if kw.pop("sink", False):
        kw["learnable_sink"] = _rand(hq, seed=4, dtype=torch.float32)
    with torch.no_grad():
        out, lse = fa4.flash_attn_func(q, k, v, return_lse=True, **kw)
    assert len(routed) == 1, f"{name}: the call did not take the split launch"
    assert out.shape == (b, sq, hq, dv) and out.dtype == dt and lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    _check(out, lse, q, k, v, [sk] * b, name, **kw)


def test_flash_attn_func_needs_grad_not_routed(routed):
    q, k, v = (_rand(2, s, h, 128, seed=i) for i, (s, h) in enumerate([(1, 32), (3000, 8), (3000, 8)]))
    q.requires_grad_(True)
    out, lse = fa4.flash_attn_func(q, k, v, return_lse=True)
    assert not routed, "a call whose q requires grad must keep the forward with a backward"
    out.float().sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
    with torch.no_grad():
        out2, lse2 = fa4.flash_attn_func(q, k, v, return_lse=True)
    assert len(routed) == 1
    # the two routes agree under the rule, not bit for bit
    _check(out2, lse2, q.detach(), k, v, [3000, 3000], "no_grad")
    assert (out2.float() - out.detach().float()).abs().max().item() < 1e-2


def test_route_off_switch(routed, monkeypatch):
    q, k, v = _rand(1, 1, 32, 128, seed=5), _rand(1, 4096, 8, 128, seed=6), _rand(1, 4096, 8, 128, seed=7)
    monkeypatch.setattr(_dispatch, "DECODE_ROUTE_MAX_QUERY", None)
    with torch.no_grad():
        out, lse = fa4.flash_attn_func(q, k, v, return_lse=True)
    assert not routed
    _check(out, lse, q, k, v, [4096], "unrouted")


def test_longer_queries_not_routed(routed):
    q, k, v = _rand(1, 65, 8, 128, seed=8), _rand(1, 2000, 8, 128, seed=9), _rand(1, 2000, 8, 128, seed=10)
    with torch.no_grad():
        out, lse = fa4.flash_attn_func(q, k, v, return_lse=True, causal=True)
    assert not routed
    _check(out, lse, q, k, v, [2000], "65 queries", causal=True)


def test_sdpa_transposed_decode(routed):
    """fa4.scaled_dot_product_attention hands flash_attn_func (B, S, H, D) views of (B, H, S, D) tensors."""
    q, k, v = _rand(2, 32, 1, 128, seed=11), _rand(2, 8, 3000, 128, seed=12), _rand(2, 8, 3000, 128, seed=13)
    with torch.no_grad():
        out = fa4.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert len(routed) == 1
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    base = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True).float()
    err, tol = (out.float() - ref).abs().max().item(), (base - ref).abs().max().item()
    assert err <= 2 * tol + 1e-5, f"{err:.3e} > 2 x {tol:.3e}"


def _pages(k, v, page, seed):
    """k / v (B, S, H, D) as shuffled pages with one unused page between each: (pages, table)."""
    b, s = k.shape[:2]
    per = -(-s // page)
    g = torch.Generator().manual_seed(seed)
    slots = (torch.randperm(2 * b * per, generator=g)[:b * per]).view(b, per)
    kp = torch.full((2 * b * per, page) + tuple(k.shape[2:]), float("nan"), device="cuda", dtype=k.dtype)
    vp = torch.full((2 * b * per, page) + tuple(v.shape[2:]), float("nan"), device="cuda", dtype=v.dtype)
    pad = per * page - s
    kpad = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(b, per, page, *k.shape[2:])
    vpad = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(b, per, page, *v.shape[2:])
    for i in range(b):
        kp[slots[i].cuda()] = kpad[i]
        vp[slots[i].cuda()] = vpad[i]
    return kp, vp, slots.to(torch.int32).cuda()


@pytest.mark.parametrize("page, packed, causal", [(16, False, False), (64, True, False), (24, True, False),
                                                  (64, False, True)])
def test_varlen_paged_decode_routed(page, packed, causal, routed):
    b, hq, hkv, s = 3, 32, 8, 1500
    sq = 1 if packed else 3
    q, k, v = _rand(b, sq, hq, 128, seed=14), _rand(b, s, hkv, 128, seed=15), _rand(b, s, hkv, 128, seed=16)
    kp, vp, table = _pages(k, v, page, seed=page)
    lens = torch.tensor([1500, 1, 777], dtype=torch.int32, device="cuda")
    qa = q.view(b, hq, 128) if packed else q
    extra = dict(cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32, device="cuda"), max_seqlen_q=1) if packed else {}
    with torch.no_grad():
        out, lse = fa4.flash_attn_varlen_func(qa, kp, vp, page_table=table, seqused_k=lens, causal=causal,
                                              return_lse=True, **extra)
    assert len(routed) == 1
    if packed:
        assert out.shape == (b, hq, 128) and lse.shape == (hq, b)
        out, lse = out.unsqueeze(1), lse.t().unsqueeze(2)
    _check(out, lse, q, k, v, lens.tolist(), f"page {page}", causal=causal)


def test_varlen_padded_dense_decode_routed(routed):
    b, hq, hkv, s = 3, 16, 4, 2100
    q, k, v = _rand(b, 2, hq, 64, seed=17), _rand(b, s, hkv, 64, seed=18), _rand(b, s, hkv, 64, seed=19)
    lens = torch.tensor([2100, 0, 63], dtype=torch.int32, device="cuda")
    k[1:, 64:] = float("nan")   # keys past seqused_k are never read
    v[1:, 64:] = float("nan")
    with torch.no_grad():
        out, lse = fa4.flash_attn_varlen_func(q, k, v, seqused_k=lens, causal=True, return_lse=True)
    assert len(routed) == 1
    _check(out, lse, q, k, v, lens.tolist(), "padded dense", causal=True)


def test_varlen_padded_dense_decode_every_key_routed(routed):
    """Both sides padded, no seqused_k: every key is used, so the call takes flash_attn_func's dense route
    (_kvcache.dense_decode), a window and a softcap included."""
    b, hq, hkv, s = 2, 16, 4, 1500
    q, k, v = _rand(b, 3, hq, 128, seed=23), _rand(b, s, hkv, 128, seed=24), _rand(b, s, hkv, 128, seed=25)
    with torch.no_grad():
        out, lse = fa4.flash_attn_varlen_func(q, k, v, causal=True, window_size=(200, 0), softcap=20.0,
                                              return_lse=True)
    assert len(routed) == 1
    _check(out, lse, q, k, v, [s] * b, "padded dense, every key", causal=True, window_size=(200, 0), softcap=20.0)


def test_decode_route_graph_and_compile(routed):
    q, k, v = _rand(2, 1, 32, 128, seed=20), _rand(2, 5000, 8, 128, seed=21), _rand(2, 5000, 8, 128, seed=22)
    with torch.no_grad():
        eager = fa4.flash_attn_func(q, k, v)
        static_out = fa4.flash_attn_func(q, k, v)     # warm (plans recorded) before the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = fa4.flash_attn_func(q, k, v)
        static_out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_out, eager)
        compiled = torch.compile(lambda a, b_, c: fa4.flash_attn_func(a, b_, c), fullgraph=True)
        assert torch.equal(compiled(q, k, v), eager)
