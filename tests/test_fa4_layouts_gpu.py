"""fa4's head-dim pairs and varlen layouts on a Hopper GPU, against the fp32 reference under FA4's
rule (stage0_reference.torch_reference.assert_fa4_close: at most 2x the error of PyTorch in the
input precision, plus a small atol).

* (128, 64), which has kernels of its own, and pairs that run zero-padded on a native pair
  (80, (72, 40), (160, 128), (200, 136), (64, 128), 8), forward and backward, odd lengths, GQA;
* flash_attn_varlen_func's four layouts with seqused_q / seqused_k, empty sequences, causal and
  windowed, GQA 1 / 2 / 6, forward and backward, deterministic mode bitwise equal over repeats.
The CPU file (test_fa4_layouts.py) checks the same paths against a float64 stand-in kernel.
"""
from __future__ import annotations

import pytest
import torch

import fa4
from stage0_reference.torch_reference import assert_fa4_close, grad_atol, reference_and_baseline

pytestmark = [pytest.mark.gpu, pytest.mark.fa4]


def _rand(g, *shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)


PAIRS = [(128, 64, 1, 1, True), (128, 64, 113, 203, False), (128, 64, 799, 3, True), (128, 64, 1024, 1024, True),
         (80, 80, 239, 1, False), (80, 80, 255, 256, True), (72, 40, 113, 203, True), (160, 128, 64, 1, False),
         (160, 128, 300, 300, True), (200, 136, 113, 203, False), (64, 128, 255, 256, True), (8, 8, 3, 3, False)]


@pytest.mark.parametrize("d,dv,sq,sk,causal", PAIRS, ids=[f"d{d}x{dv}-{sq}x{sk}-{'causal' if c else 'full'}"
                                                          for d, dv, sq, sk, c in PAIRS])
def test_head_dim_pairs_forward_and_backward(d, dv, sq, sk, causal):
    g = torch.Generator(device="cuda").manual_seed(d + dv + sq + sk)
    hq, hkv = [(4, 4), (4, 2), (6, 1)][(sq + d) % 3]
    q = _rand(g, 2, sq, hq, d).requires_grad_()
    k, v = _rand(g, 2, sk, hkv, d).requires_grad_(), _rand(g, 2, sk, hkv, dv).requires_grad_()
    out, lse = fa4.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    dout = _rand(g, 2, sq, hq, dv)
    got = (out, lse, *torch.autograd.grad(out, (q, k, v), dout))
    ref, base = reference_and_baseline(q, k, v, dout, causal=causal)
    assert out.shape == (2, sq, hq, dv) and out.is_contiguous()
    atol = grad_atol(ref[2:])
    for name, a, r, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref, base):
        assert a.shape == r.shape, name
        assert_fa4_close(f"({d}, {dv}) {name}", a, r, b, atol=1e-5 if name in ("out", "lse") else atol)


def _cu(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")


def _layout_problem(g, padded_q, padded_k, hq, hkv, d, lens_q, lens_k):
    """Per-sequence tensors, and the caller's q, k, v in the chosen layouts."""
    qs = [_rand(g, n, hq, d) for n in lens_q]
    ks, vs = ([_rand(g, n, hkv, d) for n in lens_k] for _ in range(2))
    side = lambda ts, padded: torch.stack(ts) if padded else torch.cat(ts)  # noqa: E731
    return qs, ks, vs, side(qs, padded_q), side(ks, padded_k), side(vs, padded_k), side


LAYOUTS = [(False, False, (1, 6)), (True, False, (2, 2)), (False, True, (2, 1)), (True, True, (6, 1))]


def _poison_allocator(nbytes=256 << 20):
    """Fill a block of the caching allocator with NaN and free it: outputs allocated next (torch.empty)
    start as NaN, so rows a kernel never writes show up."""
    torch.full((nbytes // 4,), float("nan"), device="cuda")


@pytest.mark.parametrize("padded_q,padded_k,heads", LAYOUTS, ids=["packQ-packK", "padQ-packK", "packQ-padK", "padQ-padK"])
@pytest.mark.parametrize("variant", ["full", "causal", "window"])
@pytest.mark.parametrize("bound", ["lengths", "used"])
def test_varlen_layouts_with_seqused(padded_q, padded_k, heads, variant, bound):
    """Each sequence b: its first seqused_q[b] rows against its first seqused_k[b] keys, under the
    rule; rows past seqused_q: out 0, lse -inf, dq 0; keys past seqused_k: dk = dv = 0 -- also with
    max_seqlen_* = the longest used length (the official bound), whose grids stop short of them."""
    g = torch.Generator(device="cuda").manual_seed(4 * padded_q + 2 * padded_k + len(variant))
    hq, hkv = heads[0] * heads[1], heads[1]
    sq, sk, d = 300, 517, 128
    lens_q = [sq] * 5 if padded_q else [0, 1, 300, 77, 255]
    lens_k = [sk] * 5 if padded_k else [5, 0, 517, 300, 256]
    used_q = [0, 1, 100, 77, 3]  # with the "used" bound the grids miss rows of the unused halves (200, 252)
    used_k = [5, 0, 400, 1, 256]
    causal, window = {"full": (False, (None, None)), "causal": (True, (None, None)),
                      "window": (False, (37, 12))}[variant]
    qs, ks, vs, q, k, v, side = _layout_problem(g, padded_q, padded_k, hq, hkv, d, lens_q, lens_k)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw = dict(cu_seqlens_q=None if padded_q else _cu(lens_q), cu_seqlens_k=None if padded_k else _cu(lens_k),
              max_seqlen_q=max(used_q if bound == "used" else lens_q),
              max_seqlen_k=max(used_k if bound == "used" else lens_k),
              seqused_q=torch.tensor(used_q, dtype=torch.int32, device="cuda"),
              seqused_k=torch.tensor(used_k, dtype=torch.int32, device="cuda"))
    _poison_allocator()
    out, lse = fa4.flash_attn_varlen_func(*leaves, causal=causal, window_size=window, return_lse=True, **kw)
    dout = _rand(g, *out.shape)
    _poison_allocator()
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    douts = [dout[b] for b in range(5)] if padded_q else list(torch.split(dout, lens_q))
    _check_used_rows((out, lse, dq, dk, dv), (padded_q, padded_k), (lens_q, lens_k), (used_q, used_k),
                     (qs, ks, vs, douts), causal=causal, window=window)


def _check_used_rows(results, padded, lens, used, inputs, causal, window=(None, None)):
    """A varlen call's (out, lse, dq, dk, dv), per sequence b: rows past used_q[b] out 0, lse -inf, dq 0;
    keys past used_k[b] dk = dv = 0; the used rows under the rule against that sequence's inputs
    (qs, ks, vs, douts: one tensor a sequence)."""
    (out, lse, dq, dk, dv), (padded_q, padded_k), (lens_q, lens_k), (used_q, used_k) = results, padded, lens, used
    qs, ks, vs, douts = inputs
    batch = len(lens_q)
    per_seq = lambda t, pad, ls: [t[b] for b in range(batch)] if pad else list(torch.split(t, ls))  # noqa: E731
    outs, dqs = per_seq(out, padded_q, lens_q), per_seq(dq, padded_q, lens_q)
    dks, dvs = per_seq(dk, padded_k, lens_k), per_seq(dv, padded_k, lens_k)
    lses = [lse[b] for b in range(batch)] if padded_q else list(torch.split(lse, lens_q, dim=1))
    for b in range(batch):
        nq, nk = used_q[b], used_k[b]
        assert torch.all(outs[b][nq:] == 0) and torch.all(dqs[b][nq:] == 0), f"rows past seqused_q, seq {b}"
        assert torch.all(lses[b][:, nq:] == float("-inf")), f"lse past seqused_q, seq {b}"
        assert torch.all(dks[b][nk:] == 0) and torch.all(dvs[b][nk:] == 0), f"keys past seqused_k, seq {b}"
        if nq == 0:
            continue
        ref, base = reference_and_baseline(qs[b][None, :nq], ks[b][None, :nk], vs[b][None, :nk], douts[b][None, :nq],
                                           causal=causal, window_size=window)
        atol = grad_atol(ref[2:])
        got = (outs[b][None, :nq], lses[b][None, :, :nq], dqs[b][None, :nq], dks[b][None, :nk], dvs[b][None, :nk])
        for name, a, r, bl in zip(("out", "lse", "dq", "dk", "dv"), got, ref, base):
            assert_fa4_close(f"seq {b} {name}", a, r, bl, atol=1e-5 if name in ("out", "lse") else atol)


def test_seqused_q_deterministic_backward_is_bitwise_reproducible():
    g = torch.Generator(device="cuda").manual_seed(9)
    q, k, v = _rand(g, 3, 700, 8, 128), _rand(g, 3, 900, 2, 128), _rand(g, 3, 900, 2, 128)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    dout = _rand(g, 3, 700, 8, 128)
    used_q = torch.tensor([700, 0, 333], dtype=torch.int32, device="cuda")
    used_k = torch.tensor([1, 900, 512], dtype=torch.int32, device="cuda")

    def grads():
        out = fa4.flash_attn_varlen_func(*leaves, seqused_q=used_q, seqused_k=used_k, causal=True, deterministic=True)
        return torch.autograd.grad(out, leaves, dout)

    first = grads()
    for _ in range(3):
        assert all(torch.equal(a, b) for a, b in zip(first, grads()))


def test_padded_head_dims_in_a_cuda_graph():
    """The padding and the seqused split are device ops: a call captures and replays."""
    g = torch.Generator(device="cuda").manual_seed(10)
    q, k, v = _rand(g, 2, 128, 4, 80), _rand(g, 2, 200, 4, 80), _rand(g, 2, 200, 4, 80)
    used_q = torch.tensor([100, 7], dtype=torch.int32, device="cuda")
    call = lambda: fa4.flash_attn_varlen_func(q, k, v, seqused_q=used_q, causal=True)  # noqa: E731
    call()  # warm-up (compiles)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = call()
    q.copy_(_rand(g, 2, 128, 4, 80))
    used_q.copy_(torch.tensor([128, 0], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    want = call()
    assert torch.equal(static, want)
    assert torch.all(static[1] == 0) and not torch.all(static[0] == 0)


def test_page_table_equals_the_padded_call():
    """A paged k / v (pages of 64 keys, shuffled) with page_table and seqused_k: bitwise the padded
    call's out and dq; each page's dk / dv are the padded call's rows. Deterministic mode: outside it
    dq's tile sums land in any order, and two calls may differ in the last bit."""
    g = torch.Generator(device="cuda").manual_seed(12)
    b, sq, hq, hkv, d, page, per_seq = 3, 200, 8, 2, 128, 64, 5
    lens_k = [320, 1, 250]
    k_pad, v_pad = _rand(g, b, page * per_seq, hkv, d), _rand(g, b, page * per_seq, hkv, d)
    perm = torch.randperm(b * per_seq + 4, device="cuda", generator=g)
    table = perm[:b * per_seq].view(b, per_seq).to(torch.int32)
    k_pool = torch.zeros(b * per_seq + 4, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_pool = torch.zeros_like(k_pool)
    k_pool[table.long()] = k_pad.view(b, per_seq, page, hkv, d)
    v_pool[table.long()] = v_pad.view(b, per_seq, page, hkv, d)
    q = _rand(g, b, sq, hq, d)
    used = torch.tensor(lens_k, dtype=torch.int32, device="cuda")
    dout = _rand(g, b, sq, hq, d)
    results = []
    for k, v, kw in ((k_pool, v_pool, dict(page_table=table)), (k_pad, v_pad, {})):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = fa4.flash_attn_varlen_func(*leaves, seqused_k=used, causal=True, deterministic=True, **kw)
        results.append((out, *torch.autograd.grad(out, leaves, dout)))
    (out, dq, dk_pool, dv_pool), (out2, dq2, dk2, dv2) = results
    assert torch.equal(out, out2) and torch.equal(dq, dq2)
    assert torch.equal(dk_pool[table.long()].view_as(dk2), dk2) and torch.equal(dv_pool[table.long()].view_as(dv2), dv2)
    ref, base = reference_and_baseline(q[2:3], k_pad[2:3, :250], v_pad[2:3, :250], dout[2:3], causal=True)
    assert_fa4_close("paged out (seq 2)", out[2:3], ref[0], base[0])


@pytest.mark.parametrize("bound", ["lengths", "used"])
def test_sink_gradient_with_seqused_q(bound):
    """A learnable sink with packed q and seqused_q, under max_seqlen_q = the longest sequence or the
    longest used length (whose grid stops short of the unused rows): out, dq and the sink's gradient
    against the per-sequence reference under the rule, outputs allocated over NaN."""
    from stage0_reference.torch_reference import attention_ref

    g = torch.Generator(device="cuda").manual_seed(31)
    hq, hkv, d = 4, 2, 64
    lens, used, lens_k = [300, 5, 260], [40, 5, 0], [290, 7, 270]
    qs, douts = ([_rand(g, n, hq, d) for n in lens] for _ in range(2))
    ks, vs = ([_rand(g, n, hkv, d) for n in lens_k] for _ in range(2))
    q = torch.cat(qs).requires_grad_()
    sink = torch.randn(hq, device="cuda", generator=g).requires_grad_()
    _poison_allocator()
    out = fa4.flash_attn_varlen_func(q, torch.cat(ks), torch.cat(vs), cu_seqlens_q=_cu(lens), cu_seqlens_k=_cu(lens_k),
                                     max_seqlen_q=max(used if bound == "used" else lens), max_seqlen_k=max(lens_k),
                                     seqused_q=torch.tensor(used, dtype=torch.int32, device="cuda"),
                                     learnable_sink=sink, causal=True)
    _poison_allocator()
    dq, dsink = torch.autograd.grad((out.float() * torch.cat(douts).float()).sum(), (q, sink))
    live = [b for b, n in enumerate(used) if n]   # sequences with used rows (the reference takes no empty ones)
    grads = {}
    for upcast in (True, False):  # fp32 reference, and PyTorch in the input precision (the rule's baseline)
        cast = (lambda t: t.float()) if upcast else (lambda t: t)  # noqa: E731
        qr = [cast(qs[b][:used[b]]).detach().clone().requires_grad_() for b in live]
        sr = sink.detach().clone().requires_grad_()
        outs = [attention_ref(a[None], cast(ks[b])[None], cast(vs[b])[None], causal=True, learnable_sink=sr,
                              upcast=upcast)[0][0] for a, b in zip(qr, live)]
        loss = sum((o.float() * douts[b][:used[b]].float()).sum() for o, b in zip(outs, live))
        grads[upcast] = (outs, torch.autograd.grad(loss, qr + [sr]))
    (ref_out, ref_g), (base_out, base_g) = grads[True], grads[False]
    rows, dq_rows = torch.split(out.detach(), lens), torch.split(dq, lens)
    for b, n in enumerate(used):
        assert torch.all(rows[b][n:] == 0) and torch.all(dq_rows[b][n:] == 0), f"rows past seqused_q, seq {b}"
    for i, b in enumerate(live):
        assert_fa4_close(f"out seq {b}", rows[b][:used[b]], ref_out[i], base_out[i], atol=1e-5)
        assert_fa4_close(f"dq seq {b}", dq_rows[b][:used[b]], ref_g[i], base_g[i], atol=1e-4)
    assert_fa4_close("dsink", dsink, ref_g[-1], base_g[-1], atol=1e-4)


NAN_DIMS = [(64, 64), (128, 128), (128, 64), (192, 128), (256, 256)]


@pytest.mark.parametrize("padded_q,padded_k,heads", LAYOUTS, ids=["packQ-packK", "padQ-packK", "packQ-padK", "padQ-padK"])
@pytest.mark.parametrize("d,dv", NAN_DIMS, ids=[f"d{d}x{dv}" for d, dv in NAN_DIMS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_nan_past_seqused_stays_out_of_the_used_rows(padded_q, padded_k, heads, d, dv, causal):
    """Rows past seqused_q (q and dout) and keys past seqused_k (k and v) hold NaN, as padding from
    torch.empty may: out, lse and every gradient of the used rows stay under the rule, and the unused
    rows get out 0 / dq = dk = dv = 0. A tile that straddles the used length loads those rows."""
    g = torch.Generator(device="cuda").manual_seed(d + dv + 2 * padded_q + padded_k + 7 * causal)
    hq, hkv = heads[0] * heads[1], heads[1]
    lens_q = [203] * 3 if padded_q else [203, 64, 150]
    lens_k = [260] * 3 if padded_k else [260, 128, 77]
    used_q, used_k = [113, 1, 150], [203, 100, 77]   # straddle a tile, or use all rows of a packed sequence
    qs, ks, vs = ([_rand(g, n, h, e) for n in lens] for lens, h, e in ((lens_q, hq, d), (lens_k, hkv, d),
                                                                         (lens_k, hkv, dv)))
    douts = [_rand(g, n, hq, dv) for n in lens_q]
    for b in range(3):
        qs[b][used_q[b]:], douts[b][used_q[b]:] = float("nan"), float("nan")
        ks[b][used_k[b]:], vs[b][used_k[b]:] = float("nan"), float("nan")
    side = lambda ts, padded: torch.stack(ts) if padded else torch.cat(ts)  # noqa: E731
    leaves = [side(qs, padded_q).requires_grad_(), side(ks, padded_k).requires_grad_(),
              side(vs, padded_k).requires_grad_()]
    kw = dict(cu_seqlens_q=None if padded_q else _cu(lens_q), cu_seqlens_k=None if padded_k else _cu(lens_k),
              max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
              seqused_q=torch.tensor(used_q, dtype=torch.int32, device="cuda"),
              seqused_k=torch.tensor(used_k, dtype=torch.int32, device="cuda"))
    out, lse = fa4.flash_attn_varlen_func(*leaves, causal=causal, return_lse=True, **kw)
    grads = torch.autograd.grad(out, leaves, side(douts, padded_q))
    _check_used_rows((out, lse, *grads), (padded_q, padded_k), (lens_q, lens_k), (used_q, used_k),
                     (qs, ks, vs, douts), causal=causal)
