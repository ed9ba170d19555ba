"""fa4's layout components on CPU (fa4/_layouts.py): any head-dim pair through zero-padding onto a
native one, and flash_attn_varlen_func's four layouts (packed or padded q, packed or padded k / v)
with seqused_q / seqused_k.

The kernels are replaced by a float64 stand-in with the kernels' contract -- it refuses head dims
the Hopper kernels lack, so a call that reaches it unpadded fails -- registered as the CPU kernels
of fa4's ops. The truth is stage 0's torch reference per sequence, at the caller's head dims and
lengths; gradients are torch autograd of it. The GPU file (test_fa4_layouts_gpu.py) runs the real
kernels.
"""
from __future__ import annotations

import math

import pytest
import torch

import fa4
from fa4 import _dispatch, _layouts, _validate
from fa4.distributed import ReferenceKernels
from stage0_reference.torch_reference import attention_ref

pytestmark = [pytest.mark.cpu, pytest.mark.fa4]
BF16, F64 = torch.bfloat16, torch.float64
HOPPER = _dispatch.ARCHS["sm_90"]


# ---------------------------------------------------------------------------------------------
# the stand-in kernels
# ---------------------------------------------------------------------------------------------
def _ref(q, k, v, scale, causal, window, softcap):
    """(S, H, D) float64 attention (stage 0): out (Sq, H, Dv), lse (H, Sq)."""
    o, lse = attention_ref(q[None], k[None], v[None], softmax_scale=scale, causal=causal, window_size=window,
                           softcap=softcap)
    return o[0], lse[0]


GRID_TILE = 128  # rows (queries or keys) per CTA in the stand-in's emulated grid


def _past_grid(a, b, bound):
    """Rows [a, b) of a sequence a kernel grid sized by `bound` rows per sequence never reaches."""
    return slice(a + min(b - a, -(-bound // GRID_TILE) * GRID_TILE), b)


class _Backend:
    """The Backend methods fa4's ops call, in float64 with fa4.distributed's analytic backward. Like the
    kernels, its grids cover ceil(max_seqlen / 128) tiles of each sequence: rows past them are never
    written (NaN here, uninitialized memory on the GPU)."""

    arch = HOPPER

    def __init__(self):
        self.head_dims = []

    def check_head_dims(self, d, dv):
        self.head_dims.append((d, dv))
        _dispatch.HopperBackend(HOPPER).check_head_dims(d, dv)

    def check_variants(self, *a, **kw):
        pass

    def _sequences(self, cu_q, cu_k, used_k):
        for i in range(cu_q.shape[0] - 1):
            qa, qb, ka = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i])
            kb = ka + int(used_k[i]) if used_k is not None else int(cu_k[i + 1])
            yield qa, qb, ka, kb

    def varlen_forward(self, q, k, v, cu_q, cu_k, used_k, max_q, max_k, scale, causal, window=(None, None),
                       softcap=0.0, learnable_sink=None):
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=F64)
        lse = torch.full((q.shape[1], q.shape[0]), -math.inf, dtype=F64)
        for qa, qb, ka, kb in self._sequences(cu_q, cu_k, used_k):
            assert kb - ka <= max_k, "the used keys exceed max_seqlen_k"
            if qb > qa and kb > ka:
                out[qa:qb], lse[:, qa:qb] = _ref(q[qa:qb].double(), k[ka:kb].double(), v[ka:kb].double(), scale,
                                                 causal, window, softcap)
            out[_past_grid(qa, qb, max_q)], lse[:, _past_grid(qa, qb, max_q)] = math.nan, math.nan
        return out.to(q.dtype), lse.float()

    def varlen_backward(self, dout, q, k, v, out, lse, cu_q, cu_k, used_k, max_q, max_k, scale, causal,
                        deterministic, dlse=None, window=(None, None), softcap=0.0, want_d=False):
        """fa4.distributed's analytic reference backward per sequence (autograd is off in an op's kernel)."""
        grads = [torch.zeros(t.shape, dtype=F64) for t in (q, k, v)]
        one = lambda t, a, b: t[None, a:b].double()  # noqa: E731
        for qa, qb, ka, kb in self._sequences(cu_q, cu_k, used_k):
            if qb == qa or kb == ka:
                continue
            g = ReferenceKernels().backward(one(dout, qa, qb), one(q, qa, qb), one(k, ka, kb), one(v, ka, kb),
                                            one(out, qa, qb), lse[None, :, qa:qb].double(),
                                            None if dlse is None else dlse[None, :, qa:qb].double(), scale, causal,
                                            softcap, deterministic, window)
            grads[0][qa:qb] += g[0][0]
            grads[1][ka:kb] += g[1][0]
            grads[2][ka:kb] += g[2][0]
            self._straddling_tiles(grads, dout, q, k, v, qa, qb, ka, kb)
        for i in range(cu_q.shape[0] - 1):  # the postprocess's dq grid, the main kernel's key tiles
            grads[0][_past_grid(int(cu_q[i]), int(cu_q[i + 1]), max_q)] = math.nan
            for g in grads[1:]:
                g[_past_grid(int(cu_k[i]), int(cu_k[i + 1]), max_k)] = math.nan
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))

    @staticmethod
    def _straddling_tiles(grads, dout, q, k, v, qa, qb, ka, kb):
        """Like the kernels' backward, which loads whole tiles: a non-finite value in the rows the last
        tile of a sequence reads past its end reaches the sequence's gradients (0 * NaN in the MMAs):
        keys / values there reach dq (dQ = dS K, dS = P (dP - D) with dP = dO V^T); queries dk
        (dK += dS^T Q); dO rows dv (dV += P^T dO)."""
        tail = lambda t, a, b: t[b:min(a + -(-(b - a) // GRID_TILE) * GRID_TILE, t.shape[0])]  # noqa: E731
        finite = lambda *ts: all(bool(torch.isfinite(t).all()) for t in ts)  # noqa: E731
        if not finite(tail(k, ka, kb), tail(v, ka, kb)):
            grads[0][qa:qb] = math.nan
        if not finite(tail(q, qa, qb)):
            grads[1][ka:kb] = math.nan
        if not finite(tail(dout, qa, qb)):
            grads[2][ka:kb] = math.nan

    def forward(self, q, k, v, scale, causal, window=(None, None), softcap=0.0, learnable_sink=None):
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        cu = lambda s: torch.arange(b + 1, dtype=torch.int32) * s  # noqa: E731
        out, lse = self.varlen_forward(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu(sq), cu(sk), None, sq, sk,
                                       scale, causal, window, softcap)
        return out.view(b, sq, *out.shape[1:]), lse.view(lse.shape[0], b, sq).permute(1, 0, 2).contiguous()

    def backward(self, dout, q, k, v, out, lse, scale, causal, deterministic, dlse=None, window=(None, None),
                 softcap=0.0, want_d=False):
        b, sq, sk = q.shape[0], q.shape[1], k.shape[1]
        cu = lambda s: torch.arange(b + 1, dtype=torch.int32) * s  # noqa: E731
        flat = lambda t: t.flatten(0, 1)  # noqa: E731
        dlse = None if dlse is None else dlse.permute(1, 0, 2).flatten(1)
        lse = lse.permute(1, 0, 2).flatten(1)                                   # (B, H, Sq) -> (H, B * Sq)
        g = self.varlen_backward(flat(dout), flat(q), flat(k), flat(v), flat(out), lse, cu(sq), cu(sk), None, sq, sk,
                                 scale, causal, deterministic, dlse, window, softcap)
        return tuple(t.view(x.shape) for t, x in zip(g, (q, k, v)))


@pytest.fixture
def stand_in(fa4_ops_on_cpu):
    """fa4's public functions end to end on CPU (conftest.fa4_ops_on_cpu), the four ops over _Backend."""
    return fa4_ops_on_cpu(_Backend(), ("fwd", "bwd", "varlen_fwd", "varlen_bwd"))


def _randn(g, *shape):
    return torch.randn(*shape, generator=g).to(BF16)


# ---------------------------------------------------------------------------------------------
# head dims
# ---------------------------------------------------------------------------------------------
def test_native_pair_is_the_cheapest_cover():
    blackwell = _dispatch.ARCHS["sm_100"]
    cases = {(128, 64): (128, 64), (80, 80): (96, 96), (72, 40): (96, 96), (8, 8): (64, 64), (64, 128): (128, 128),
             (160, 128): (192, 128), (160, 160): (256, 256), (200, 136): (256, 256), (256, 8): (256, 256),
             (96, 64): (96, 96), (136, 64): (192, 128)}
    for (d, dv), want in cases.items():
        assert _layouts.native_pair(HOPPER, d, dv) == want, (d, dv)
    assert _layouts.native_pair(blackwell, 96, 96) == (96, 96)
    assert _layouts.native_pair(blackwell, 80, 80) == (96, 96)
    assert _layouts.native_pair(blackwell, 128, 64) == (128, 64)  # native on both arches
    assert _layouts.native_pair(blackwell, 120, 48) == (128, 64)
    assert _layouts.native_pair(blackwell, 256, 256) == (256, 256)  # one Q tile a CTA in the forward
    assert _layouts.native_pair(blackwell, 200, 136) == (256, 256)
    for pair in HOPPER.head_dims:
        assert _layouts.native_pair(HOPPER, *pair) == pair


PAD_CASES = [(80, 80, False), (72, 40, True), (8, 8, False), (160, 128, True), (64, 128, False), (200, 136, True),
             (128, 64, True)]


@pytest.mark.parametrize("d,dv,causal", PAD_CASES, ids=[f"d{d}x{dv}-{'causal' if c else 'full'}" for d, dv, c in PAD_CASES])
def test_any_head_dim_pair_matches_the_reference(stand_in, d, dv, causal):
    """out, lse and the gradients at the caller's head dims (scale 1/sqrt(d)); the kernel saw a native
    pair; out comes back contiguous."""
    g = torch.Generator().manual_seed(d * 7 + dv)
    q, k, v = _randn(g, 2, 9, 4, d), _randn(g, 2, 13, 2, d), _randn(g, 2, 13, 2, dv)
    dout, dlse = _randn(g, 2, 9, 4, dv), torch.randn(2, 4, 9, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fa4.flash_attn_func(*leaves, causal=causal, return_lse=True)
    assert out.shape == (2, 9, 4, dv) and out.is_contiguous() and lse.shape == (2, 4, 9)
    got = torch.autograd.grad((out.double() * dout.double()).sum() + (lse * dlse).sum(), leaves)
    assert all(p in HOPPER.head_dims for p in stand_in.head_dims)
    assert stand_in.head_dims[0] == _layouts.native_pair(HOPPER, d, dv)

    ref = [t.double().requires_grad_() for t in (q, k, v)]
    o, l = attention_ref(*ref, causal=causal)   # default scale: 1 / sqrt(d) of the caller's d
    want = torch.autograd.grad((o * dout.double()).sum() + (l * dlse.double()).sum(), ref)
    torch.testing.assert_close(out.double(), o, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), l, atol=1e-5, rtol=1e-5)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        torch.testing.assert_close(a.double(), b, atol=3e-2, rtol=3e-2, msg=name)


def test_padding_in_varlen_and_on_meta(stand_in):
    g = torch.Generator().manual_seed(5)
    cu_q, cu_k = torch.tensor([0, 3, 3, 10], dtype=torch.int32), torch.tensor([0, 5, 6, 12], dtype=torch.int32)
    q, k, v = _randn(g, 10, 2, 40), _randn(g, 12, 1, 40), _randn(g, 12, 1, 24)
    out = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    assert out.shape == (10, 2, 24) and stand_in.head_dims[0] == (64, 64)
    for (qa, qb), (ka, kb) in zip(((0, 3), (3, 3), (3, 10)), ((0, 5), (5, 6), (6, 12))):
        if qb > qa:
            o, _ = _ref(q[qa:qb].double(), k[ka:kb].double(), v[ka:kb].double(), 40 ** -0.5, True, (None, None), 0.0)
            torch.testing.assert_close(out[qa:qb].double(), o, atol=1e-2, rtol=1e-2)
    meta = [torch.empty(1, 5, 2, 80, device="meta", dtype=BF16) for _ in range(2)] + \
        [torch.empty(1, 5, 2, 48, device="meta", dtype=BF16)]
    assert fa4.flash_attn_func(*meta).shape == (1, 5, 2, 48)


BAD_DIMS = [(12, 12, "q"), (264, 264, "q"), (0, 64, "q"), (64, 20, "v"), (64, 272, "v")]


@pytest.mark.parametrize("d,dv,name", BAD_DIMS, ids=[f"d{d}x{dv}" for d, dv, _ in BAD_DIMS])
def test_head_dims_outside_the_rule_are_refused(d, dv, name):
    q = torch.empty(1, 4, 2, d, device="meta", dtype=BF16)
    v = torch.empty(1, 4, 2, dv, device="meta", dtype=BF16)
    with pytest.raises(ValueError, match=rf"^{name}: head_dim {d if name == 'q' else dv} is not supported"):
        fa4.flash_attn_func(q, q, v)


def test_a_pair_no_kernel_covers_is_refused_before_a_launch(monkeypatch):
    import dataclasses

    # an arch whose widest forward is (192, 128) (sm_100 before its one-Q-tile d = 256 build)
    blackwell = dataclasses.replace(_dispatch.ARCHS["sm_100"], head_dims=((64, 64), (96, 96), (128, 128), (192, 128)))
    monkeypatch.setattr(_layouts, "arch_of", lambda device: blackwell)
    q = torch.empty(1, 4, 2, 256, device="meta", dtype=BF16)
    with pytest.raises(ValueError, match=r"^q: head dims \(qk=256, v=256\) exceed every kernel on sm_100"):
        fa4.flash_attn_func(q, q, q)


# ---------------------------------------------------------------------------------------------
# varlen layouts and seqused_q
# ---------------------------------------------------------------------------------------------
def _lengths(g, batch, most):
    n = torch.randint(0, most + 1, (batch,), generator=g)
    n[0] = 0  # an empty sequence every time
    return n


def _truth(qs, ks, vs, used_q, used_k, causal, window):
    """Per sequence b: rows :used_q[b] of qs[b] against keys :used_k[b] (float64, autograd leaves)."""
    outs, lses = [], []
    for b in range(len(qs)):
        nq, nk = int(used_q[b]), int(used_k[b])
        o = torch.zeros(qs[b].shape[0], qs[b].shape[1], vs[b].shape[-1], dtype=F64)
        lse = torch.full((qs[b].shape[1], qs[b].shape[0]), -math.inf, dtype=F64)
        if nq and nk:
            ob, lb = _ref(qs[b][:nq], ks[b][:nk], vs[b][:nk], qs[b].shape[-1] ** -0.5, causal, window, 0.0)
            o = torch.cat((ob, o[nq:]))
            lse = torch.cat((lb, lse[:, nq:]), 1)
        outs.append(o)
        lses.append(lse)
    return outs, lses


LAYOUTS = [(pq, pk, uq, uk) for pq in (False, True) for pk in (False, True) for uq in (False, True)
           for uk in (False, True)]


@pytest.mark.parametrize("padded_q,padded_k,use_q,use_k", LAYOUTS,
                         ids=[f"{'pad' if a else 'pack'}Q-{'pad' if b else 'pack'}K{'-usedQ' if c else ''}"
                              f"{'-usedK' if d else ''}" for a, b, c, d in LAYOUTS])
def test_four_layouts_with_seqused(stand_in, padded_q, padded_k, use_q, use_k):
    """Every combination against the per-sequence truth: out, lse (in the caller's layout), dq, dk, dv;
    rows past seqused_q get out 0, lse -inf and dq 0, keys past seqused_k dk = dv = 0."""
    g = torch.Generator().manual_seed(16 * padded_q + 8 * padded_k + 4 * use_q + 2 * use_k)
    batch, sq, sk, hq, hkv, d = 4, 11, 9, 4, 2, 32
    causal, window = (True, (4, None)) if use_q else (False, (None, None))
    len_q = torch.full((batch,), sq) if padded_q else _lengths(g, batch, sq)
    len_k = torch.full((batch,), sk) if padded_k else _lengths(g, batch, sk)
    used_q = (len_q * torch.rand(batch, generator=g)).long() if use_q else len_q
    used_k = (len_k * torch.rand(batch, generator=g)).long() if use_k else len_k
    qs = [_randn(g, int(n), hq, d) for n in len_q]
    ks, vs = ([_randn(g, int(n), hkv, d) for n in len_k] for _ in range(2))
    douts = [_randn(g, int(n), hq, d) for n in len_q]
    cu = lambda n: torch.cat((torch.zeros(1, dtype=torch.int32), n.cumsum(0).to(torch.int32)))  # noqa: E731
    side = lambda ts, padded: torch.stack(ts) if padded else torch.cat(ts)  # noqa: E731
    q, k, v = side(qs, padded_q), side(ks, padded_k), side(vs, padded_k)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    kw = dict(cu_seqlens_q=None if padded_q else cu(len_q), cu_seqlens_k=None if padded_k else cu(len_k),
              seqused_q=used_q.to(torch.int32) if use_q else None, seqused_k=used_k.to(torch.int32) if use_k else None,
              max_seqlen_q=None if padded_q else sq, max_seqlen_k=None if padded_k else sk)
    out, lse = fa4.flash_attn_varlen_func(*leaves, causal=causal, window_size=window, return_lse=True, **kw)
    dout = side(douts, padded_q)
    got = torch.autograd.grad((out.double() * dout.double()).sum(), leaves)

    ref_leaves = [[t.double().requires_grad_() for t in ts] for ts in (qs, ks, vs)]
    outs, lses = _truth(*ref_leaves, used_q, used_k, causal, window)
    flat = [t for ts in ref_leaves for t in ts]
    loss = sum((o * do.double()).sum() for o, do in zip(outs, douts)) + sum((t * 0).sum() for t in flat)
    want = torch.autograd.grad(loss, flat)
    n = batch
    if padded_q:
        assert out.shape == (batch, sq, hq, d) and lse.shape == (batch, hq, sq)
        want_lse = torch.stack(lses)
    else:
        assert out.shape == (int(len_q.sum()), hq, d) and lse.shape == (hq, int(len_q.sum()))
        want_lse = torch.cat(lses, 1)
    torch.testing.assert_close(out.double(), side(outs, padded_q), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    for name, a, w, padded in (("dq", got[0], want[:n], padded_q), ("dk", got[1], want[n:2 * n], padded_k),
                               ("dv", got[2], want[2 * n:], padded_k)):
        torch.testing.assert_close(a.double(), side(w, padded), atol=3e-2, rtol=3e-2, msg=name)
    for b in range(batch):  # the unused rows exactly: out 0, lse -inf, no gradient
        rows_q = (out[b] if padded_q else out[int(cu(len_q)[b]):int(cu(len_q)[b + 1])])[int(used_q[b]):]
        assert torch.all(rows_q == 0)
        grad_k = (got[1][b] if padded_k else got[1][int(cu(len_k)[b]):int(cu(len_k)[b + 1])])[int(used_k[b]):]
        assert torch.all(grad_k == 0)


@pytest.mark.parametrize("padding", ["random", "nan"])
def test_padded_sides_with_seqused_and_the_used_lengths_as_bounds(stand_in, padding):
    """Padded q and k with seqused_* and max_seqlen_* = the longest *used* length (the official bound, a
    server's call): the kernels still cover every padded row -- rows past seqused_q out 0, lse -inf, dq 0;
    keys past seqused_k dk = dv = 0 (the stand-in refuses a sequence longer than its max_seqlen). Also
    with NaN in those rows of q, k, v and dout (padding from torch.empty), which the stand-in, like the
    kernels' tiles, lets reach the used rows' gradients if the kernels get them."""
    g = torch.Generator().manual_seed(5)
    batch, sq, sk, hq, hkv, d = 3, 12, 10, 4, 2, 32
    used_q, used_k = torch.tensor([5, 0, 7]), torch.tensor([3, 10, 6])
    q, dout = _randn(g, batch, sq, hq, d), _randn(g, batch, sq, hq, d)
    k, v = _randn(g, batch, sk, hkv, d), _randn(g, batch, sk, hkv, d)
    for b in range(batch if padding == "nan" else 0):
        q[b, int(used_q[b]):], dout[b, int(used_q[b]):] = math.nan, math.nan
        k[b, int(used_k[b]):], v[b, int(used_k[b]):] = math.nan, math.nan
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = fa4.flash_attn_varlen_func(*leaves, seqused_q=used_q.to(torch.int32), seqused_k=used_k.to(torch.int32),
                                          max_seqlen_q=int(used_q.max()), max_seqlen_k=int(used_k.max()), causal=True,
                                          return_lse=True)
    got = torch.autograd.grad((out.double() * dout.double()).sum(), leaves)
    ref_leaves = [[t[b].double().requires_grad_() for b in range(batch)] for t in (q, k, v)]
    outs, lses = _truth(*ref_leaves, used_q, used_k, True, (None, None))
    flat = [t for ts in ref_leaves for t in ts]
    want = torch.autograd.grad(sum((o * dout[b].double()).sum() for b, o in enumerate(outs))
                               + sum((t * 0).sum() for t in flat), flat)
    torch.testing.assert_close(out.double(), torch.stack(outs), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), torch.stack(lses), atol=1e-5, rtol=1e-5)
    for i, (name, a) in enumerate((("dq", got[0]), ("dk", got[1]), ("dv", got[2]))):
        torch.testing.assert_close(a.double(), torch.stack(want[i * batch:(i + 1) * batch]), atol=3e-2, rtol=3e-2,
                                   msg=name)
    for b in range(batch):
        assert torch.all(out[b, int(used_q[b]):] == 0) and torch.all(got[0][b, int(used_q[b]):] == 0)
        assert torch.all(got[1][b, int(used_k[b]):] == 0) and torch.all(got[2][b, int(used_k[b]):] == 0)


def test_packed_sides_with_the_used_lengths_as_bounds(stand_in):
    """Packed q and k with seqused_* and max_seqlen_* = the longest *used* length (the official bound):
    the kernels' grids stop short of the rows past seqused_* (the stand-in leaves them NaN, as the GPU
    leaves them unwritten), yet those rows come back out 0, lse -inf, dq 0 and dk = dv = 0, and the used
    rows match the truth. FA4_VALIDATE's value check takes the same bound."""
    g = torch.Generator().manual_seed(6)
    len_q, len_k = torch.tensor([300, 5, 260]), torch.tensor([290, 0, 270])
    used_q, used_k = torch.tensor([20, 5, 0]), torch.tensor([30, 0, 17])
    hq, hkv, d = 4, 2, 32
    cu = lambda n: torch.cat((torch.zeros(1, dtype=torch.int32), n.cumsum(0).to(torch.int32)))  # noqa: E731
    qs, douts = ([_randn(g, int(n), hq, d) for n in len_q] for _ in range(2))
    ks, vs = ([_randn(g, int(n), hkv, d) for n in len_k] for _ in range(2))
    leaves = [torch.cat(ts).requires_grad_() for ts in (qs, ks, vs)]
    kw = dict(cu_seqlens_q=cu(len_q), cu_seqlens_k=cu(len_k), seqused_q=used_q.to(torch.int32),
              seqused_k=used_k.to(torch.int32), max_seqlen_q=int(used_q.max()), max_seqlen_k=int(used_k.max()))
    _validate.check_varlen_values(kw["cu_seqlens_q"], kw["cu_seqlens_k"], int(len_q.sum()), int(len_k.sum()),
                                  kw["max_seqlen_q"], kw["max_seqlen_k"], kw["seqused_k"], kw["seqused_q"])
    out, lse = fa4.flash_attn_varlen_func(*leaves, causal=True, return_lse=True, **kw)
    got = torch.autograd.grad((out.double() * torch.cat(douts).double()).sum(), leaves)
    ref_leaves = [[t.double().requires_grad_() for t in ts] for ts in (qs, ks, vs)]
    outs, lses = _truth(*ref_leaves, used_q, used_k, True, (None, None))
    flat = [t for ts in ref_leaves for t in ts]
    want = torch.autograd.grad(sum((o * do.double()).sum() for o, do in zip(outs, douts))
                               + sum((t * 0).sum() for t in flat), flat)
    torch.testing.assert_close(out.double(), torch.cat(outs), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse.double(), torch.cat(lses, 1), atol=1e-5, rtol=1e-5)
    for i, name in enumerate(("dq", "dk", "dv")):
        torch.testing.assert_close(got[i].double(), torch.cat(want[3 * i:3 * i + 3]), atol=3e-2, rtol=3e-2, msg=name)
    cq, ck = cu(len_q), cu(len_k)
    for b in range(3):
        rows = slice(int(cq[b]) + int(used_q[b]), int(cq[b + 1]))
        keys = slice(int(ck[b]) + int(used_k[b]), int(ck[b + 1]))
        assert torch.all(out[rows] == 0) and torch.all(lse[:, rows] == -math.inf) and torch.all(got[0][rows] == 0)
        assert torch.all(got[1][keys] == 0) and torch.all(got[2][keys] == 0)
    with pytest.raises(ValueError, match=r"^max_seqlen_q: 19 is smaller than the longest used length \(seqused_q\)"):
        _validate.check_varlen_values(kw["cu_seqlens_q"], kw["cu_seqlens_k"], int(len_q.sum()), int(len_k.sum()),
                                      19, kw["max_seqlen_k"], kw["seqused_k"], kw["seqused_q"])


def test_a_sink_gradient_under_a_used_length_bound(stand_in, monkeypatch):
    """The op would form a learnable sink's gradient from every row's out and lse as the kernel left
    them, rows a used-length bound's grid never reaches included (NaN in the stand-in): the sink's
    gradient is formed over the used rows instead, finite and equal to the one under a bound covering
    every row; the kernels keep the caller's bound."""
    g = torch.Generator().manual_seed(7)
    cu = torch.tensor([0, 300, 600], dtype=torch.int32)
    used = torch.tensor([10, 20], dtype=torch.int32)
    q, k, v = (_randn(g, 600, 2, 32).requires_grad_() for _ in range(3))
    bounds = []
    forward = _Backend.varlen_forward
    monkeypatch.setattr(_Backend, "varlen_forward", lambda self, *a, **kw: bounds.append(a[6]) or forward(self, *a, **kw))
    dout = _randn(g, 600, 2, 32).float()
    grads = []
    for bound in (20, 300):
        sink = torch.tensor([0.5, -1.0], requires_grad=True)
        out, lse = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=bound,
                                              max_seqlen_k=300, seqused_q=used, learnable_sink=sink, return_lse=True)
        loss = (out.float() * dout).sum() + torch.where(torch.isfinite(lse), lse, 0).sum()
        grads.append(torch.autograd.grad(loss, (q, sink)))
        assert all(torch.isfinite(t).all() for t in grads[-1])
    assert bounds == [20, 300]
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-5)  # the sink's gradient
    torch.testing.assert_close(grads[0][0], grads[1][0])


def test_padded_sides_keep_their_cu_seqlens_per_shape():
    """A padded side's cu_seqlens (seqlen x arange) is made once per (device, batch, seqlen) and then
    reused, so a call makes no tensor for it; one first made under inference mode is a normal tensor (a
    later training call saves it for its backward)."""
    keys = [("padded_cu", torch.device("cpu"), b, 5) for b in (3, 2)]
    for key in keys:
        _layouts._SHAPE_CONSTANTS.pop(key, None)
    try:
        with torch.inference_mode():
            packed, cu, s = _layouts.VarlenLayout.pack(torch.zeros(3, 5, 2, 8), None)
        assert packed.shape == (15, 2, 8) and s == 5 and cu.tolist() == [0, 5, 10, 15]
        assert cu.dtype == torch.int32 and not cu.is_inference()
        assert _layouts.VarlenLayout.pack(torch.ones(3, 5, 4, 16), None)[1] is cu
        other = _layouts.VarlenLayout.pack(torch.zeros(2, 5, 2, 8), None)[1]
        assert other is not cu and other.tolist() == [0, 5, 10]
        given = torch.tensor([0, 7], dtype=torch.int32)
        assert _layouts.VarlenLayout.pack(torch.zeros(7, 2, 8), given)[1] is given
    finally:
        for key in keys:
            _layouts._SHAPE_CONSTANTS.pop(key, None)


def test_split_unused_rows_builds_the_kernel_sequences():
    cu_q = torch.tensor([0, 4, 4, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 2, 7, 7], dtype=torch.int32)
    used_q = torch.tensor([3, 0, 5], dtype=torch.int32)
    cu_q2, cu_k2, used_k2 = _layouts.split_unused_rows(cu_q, cu_k, used_q, torch.tensor([1, 4, 0], dtype=torch.int32))
    assert cu_q2.tolist() == [0, 3, 4, 4, 4, 9, 9]
    assert cu_k2.tolist() == [0, 2, 2, 7, 7, 7, 7]
    assert used_k2.tolist() == [1, 0, 4, 0, 0, 0]
    assert cu_q2.dtype == cu_k2.dtype == used_k2.dtype == torch.int32


def test_layout_errors_name_the_argument():
    m = lambda *s: torch.empty(*s, device="meta", dtype=BF16)  # noqa: E731
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"^q: expected rank 3 .* with cu_seqlens_q given \(pass cu_seqlens_q=None"):
        fa4.flash_attn_varlen_func(m(2, 4, 2, 64), m(8, 2, 64), m(8, 2, 64), cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match=r"^k: expected rank 4 .* with cu_seqlens_k=None"):
        fa4.flash_attn_varlen_func(m(2, 4, 2, 64), m(8, 2, 64), m(8, 2, 64))
    with pytest.raises(ValueError, match=r"^k: 3 sequences \(k's padded batch\) but q describes 2 "
                                         r"\(q's padded batch\)"):
        fa4.flash_attn_varlen_func(m(2, 4, 2, 64), m(3, 4, 2, 64), m(3, 4, 2, 64))
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: 2 sequences \(cu_seqlens_k's 3 entries\) but q describes 3 "
                                         r"\(cu_seqlens_q's 4 entries\)"):
        fa4.flash_attn_varlen_func(m(8, 2, 64), m(8, 2, 64), m(8, 2, 64), cu_seqlens_q=torch.zeros(
            4, dtype=torch.int32, device="meta"), cu_seqlens_k=cu)
    with pytest.raises(ValueError, match=r"^k: 2 sequences \(k's padded batch\) but q describes 3 \(cu_seqlens_q's "):
        fa4.flash_attn_varlen_func(m(8, 2, 64), m(2, 4, 2, 64), m(2, 4, 2, 64), cu_seqlens_q=torch.zeros(
            4, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=r"^v: shape"):
        fa4.flash_attn_varlen_func(m(2, 4, 2, 64), m(2, 4, 2, 64), m(2, 5, 2, 64))
    with pytest.raises(ValueError, match=r"^seqused_q: length 3 != batch = 2"):
        fa4.flash_attn_varlen_func(m(2, 4, 2, 64), m(2, 4, 2, 64), m(2, 4, 2, 64),
                                   seqused_q=torch.zeros(3, dtype=torch.int32, device="meta"))
    with pytest.raises(TypeError, match=r"^seqused_q: dtype must be torch.int32"):
        fa4.flash_attn_varlen_func(m(2, 4, 2, 64), m(2, 4, 2, 64), m(2, 4, 2, 64),
                                   seqused_q=torch.zeros(2, dtype=torch.int64, device="meta"))
    # padded q + packed k: the batch comes from q, cu_seqlens_k must have batch + 1 entries
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: 2 sequences \(cu_seqlens_k's 3 entries\) but q describes 3 "
                                         r"\(q's padded batch\)"):
        fa4.flash_attn_varlen_func(m(3, 4, 2, 64), m(8, 2, 64), m(8, 2, 64), cu_seqlens_k=cu)


def test_seqused_q_values_are_range_checked():
    cu = torch.tensor([0, 4, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^seqused_q: entry 1 = 3 is outside \[0, seqlen_q of sequence 1 = 2\]"):
        _validate.check_varlen_values(cu, cu, 6, 6, 4, 4, seqused_q=torch.tensor([4, 3], dtype=torch.int32))


def test_padded_varlen_on_meta_gives_the_callers_layout():
    m = lambda *s: torch.empty(*s, device="meta", dtype=BF16)  # noqa: E731
    used = torch.zeros(2, dtype=torch.int32, device="meta")
    out, lse = fa4.flash_attn_varlen_func(m(2, 5, 4, 64), m(2, 7, 2, 64), m(2, 7, 2, 32), seqused_q=used,
                                          seqused_k=used, return_lse=True)
    assert out.shape == (2, 5, 4, 32) and lse.shape == (2, 4, 5)


def test_precompile_builds_the_native_pair_a_model_runs():
    """A model with head_dim 80 (or 128 / 64) precompiles the kernels its calls launch."""
    from fa4 import precompile
    from fa4.precompile import Workload

    builds = precompile.derive_builds([Workload("bf16", 80, 80, 16, 16, True, 2048)])
    assert {(b["head_dim"], b["head_dim_v"]) for b in builds} == {(96, 96)}
    builds = precompile.derive_builds([Workload("bf16", 128, 64, 16, 4, False, 2048)])
    assert {(b["head_dim"], b["head_dim_v"]) for b in builds} == {(128, 64)}
    assert {(d, dv) for _, d, dv, _ in precompile.configs(head_dims=[80, (72, 40), 96])} == {(96, 96)}
    with pytest.raises(ValueError, match="head_dims"):
        precompile.configs(head_dims=[(256, 264)])
    # sm_100 builds d = 256 forward and backward (the wide backward kernel)
    builds = precompile.derive_builds([Workload("bf16", 256, 256, 8, 8, True, 2048)], "sm_100")
    assert {b["kind"] for b in builds} >= {"fwd", "bwd"}
    assert {(b["head_dim"], b["head_dim_v"]) for b in builds} == {(256, 256)}
    kinds = {b["kind"] for b in precompile.derive_builds([Workload("bf16", 128, 128, 8, 8, True, 2048)], "sm_100")}
    assert "bwd" in kinds


def _paged(g, sides, page_size, num_pages):
    """Each sequence's keys and values ((n, H, D) each) written into the same pages of shuffled pools;
    returns the pools and the page table, whose entries past a sequence's pages hold -1 or an
    out-of-range page (never read: past seqused_k)."""
    lens = [k.shape[0] for k in sides[0]]
    pages_of = [-(-n // page_size) for n in lens]
    order = torch.randperm(num_pages, generator=g).tolist()
    pools = [_randn(g, num_pages, page_size, *ts[0].shape[1:]) for ts in sides]
    table = torch.empty(len(lens), max(pages_of), dtype=torch.int32)
    for b, n in enumerate(lens):
        for p in range(table.shape[1]):
            if p >= pages_of[b]:
                table[b, p] = -1 if p % 2 else num_pages + 5
                continue
            table[b, p] = page = order.pop()
            for pool, ts in zip(pools, sides):
                chunk = ts[b][p * page_size:(p + 1) * page_size]
                pool[page, :chunk.shape[0]] = chunk
    return pools, table


@pytest.mark.parametrize("padded_q", [False, True])
def test_page_table_matches_the_padded_call(stand_in, padded_q):
    """k / v in pages of 16 keys, shuffled, with page_table and seqused_k: the same out, lse and dq as
    the padded call on the same keys; dk / dv land in the pages a sequence uses, 0 elsewhere."""
    g = torch.Generator().manual_seed(21 + padded_q)
    page, lens_k, hq, hkv, d = 16, [40, 0, 17, 64], 4, 2, 32
    keys = [_randn(g, n, hkv, d) for n in lens_k]
    values = [_randn(g, n, hkv, d) for n in lens_k]
    (k_pool, v_pool), table = _paged(g, (keys, values), page, 16)
    used_k = torch.tensor(lens_k, dtype=torch.int32)
    lens_q = [5, 3, 17, 9]
    qs = [_randn(g, n, hq, d) for n in lens_q]
    q = torch.stack([torch.nn.functional.pad(x, (0, 0, 0, 0, 0, 17 - x.shape[0])) for x in qs]) if padded_q \
        else torch.cat(qs)
    cu_q = None if padded_q else torch.tensor([0, 5, 8, 25, 34], dtype=torch.int32)
    leaves = [t.clone().requires_grad_() for t in (q, k_pool, v_pool)]
    out, lse = fa4.flash_attn_varlen_func(*leaves, cu_seqlens_q=cu_q, page_table=table, seqused_k=used_k,
                                          causal=True, return_lse=True)
    dout = torch.randn(out.shape, generator=g).to(BF16)
    dq, dk_pool, dv_pool = torch.autograd.grad(out, leaves, dout)
    # the padded call on the same keys
    pad = lambda ts: torch.stack([torch.nn.functional.pad(t, (0, 0, 0, 0, 0, 64 - t.shape[0])) for t in ts])  # noqa: E731
    k_pad, v_pad = pad(keys), pad(values)
    leaves2 = [t.clone().requires_grad_() for t in (q, k_pad, v_pad)]
    out2, lse2 = fa4.flash_attn_varlen_func(*leaves2, cu_seqlens_q=cu_q, seqused_k=used_k, causal=True,
                                            return_lse=True)
    dq2, dk2, dv2 = torch.autograd.grad(out2, leaves2, dout)
    assert torch.equal(out, out2) and torch.equal(lse, lse2) and torch.equal(dq, dq2)
    for b, n in enumerate(lens_k):
        for p in range(-(-n // page)):
            rows = min(page, n - p * page)
            assert torch.equal(dk_pool[int(table[b, p]), :rows], dk2[b, p * page:p * page + rows])
            assert torch.equal(dv_pool[int(table[b, p]), :rows], dv2[b, p * page:p * page + rows])
    used_pages = {int(table[b, p]) for b, n in enumerate(lens_k) for p in range(-(-n // page))}
    free = [p for p in range(16) if p not in used_pages]
    assert torch.all(dk_pool[free] == 0) and torch.all(dv_pool[free] == 0)


def test_page_table_errors_name_the_argument():
    m = lambda *s: torch.empty(*s, device="meta", dtype=BF16)  # noqa: E731
    q, pool = m(2, 4, 2, 64), m(8, 16, 2, 64)
    table = torch.zeros(2, 3, dtype=torch.int32, device="meta")
    with pytest.raises(TypeError, match=r"^page_table: dtype must be torch.int32"):
        fa4.flash_attn_varlen_func(q, pool, pool, page_table=table.long())
    with pytest.raises(ValueError, match=r"^page_table: 3 rows != batch = 2"):
        fa4.flash_attn_varlen_func(q, pool, pool, page_table=torch.zeros(3, 3, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: must be None with page_table"):
        fa4.flash_attn_varlen_func(q, pool, pool, page_table=table,
                                   cu_seqlens_k=torch.zeros(3, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=r"^k: expected \(num_pages, page_size, heads, head_dim\) with page_table"):
        fa4.flash_attn_varlen_func(q, m(8, 2, 64), m(8, 2, 64), page_table=table)
    with pytest.raises(ValueError, match=r"^q: expected rank 4 .* with cu_seqlens_q=None"):  # not "page_table"
        fa4.flash_attn_varlen_func(m(100, 2, 64), pool, pool, page_table=table)
    out = fa4.flash_attn_varlen_func(q, pool, pool, page_table=table)
    assert out.shape == (2, 4, 2, 64)


@pytest.mark.parametrize("bad", ["softcap", "window", "scale", "seqused_k", "sink"])
def test_a_paged_call_is_refused_before_its_pages_are_copied(bad, monkeypatch):
    """The route that gathers a paged cache into a dense copy (here: seqused_q, which no in-place route
    takes) checks every argument on stand-ins first: a refused call copies nothing (it used to gather
    B x pages x page_size rows of k and v, then refuse)."""
    m = lambda *s: torch.empty(*s, device="meta", dtype=BF16)  # noqa: E731
    gathered = []
    real = _layouts.VarlenLayout.unpage
    monkeypatch.setattr(_layouts.VarlenLayout, "unpage", staticmethod(lambda *a: gathered.append(1) or real(*a)))
    q, pool = m(2, 40, 8, 128), m(64, 256, 2, 128)
    table = torch.zeros(2, 32, dtype=torch.int32, device="meta")
    kw = dict(page_table=table, seqused_q=torch.zeros(2, dtype=torch.int32, device="meta"))
    kw.update({"softcap": dict(softcap=-1.0), "window": dict(window_size=(-5, None)),
               "scale": dict(softmax_scale=float("nan")),
               "seqused_k": dict(seqused_k=torch.zeros(2, dtype=torch.int64, device="meta")),
               "sink": dict(learnable_sink=torch.zeros(7, dtype=torch.float32, device="meta"))}[bad])
    name = {"window": "window_size", "scale": "softmax_scale", "sink": "learnable_sink"}.get(bad, bad)
    with pytest.raises((ValueError, TypeError), match=rf"^{name}: "):
        fa4.flash_attn_varlen_func(q, pool, pool, **kw)
    assert not gathered
    fa4.flash_attn_varlen_func(q, pool, pool, page_table=table, seqused_q=kw["seqused_q"])
    assert gathered  # the valid call does take the copy


def test_the_grid_limit_names_the_sequences_of_a_varlen_call():
    """65535 sequences fit the kernels' grid; with seqused_q each sequence's unused rows run as one more,
    so 40000 do not: refused naming the argument (it used to fail inside the kernel's host code naming
    80000, a count the caller never passed). A dense batch past the limit is refused naming q."""
    m = lambda *s: torch.empty(*s, device="meta", dtype=BF16)  # noqa: E731
    q = m(40000, 2, 2, 64)
    used = torch.zeros(40000, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"^q: sequences x 2 \(seqused_q\) \(80000\) and heads \(2\) must be <= 65535"):
        fa4.flash_attn_varlen_func(q, q, q, seqused_q=used)
    assert fa4.flash_attn_varlen_func(q, q, q).shape == q.shape
    cu = torch.zeros(70001, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match=r"^cu_seqlens_q: sequences \(70000\) and heads \(2\) must be <= 65535"):
        fa4.flash_attn_varlen_func(m(10, 2, 64), m(10, 2, 64), m(10, 2, 64), cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match=r"^q: batch \(70000\) and heads \(2\) must be <= 65535"):
        fa4.flash_attn_func(m(70000, 1, 2, 64), m(70000, 1, 2, 64), m(70000, 1, 2, 64))


def test_padded_cu_seqlens_with_symbolic_sizes_are_made_not_kept():
    """VarlenLayout.pack keeps a padded side's cu_seqlens per shape; a side with symbolic sizes (only
    while traced: a FakeTensorMode with a ShapeEnv, as torch.compile's dynamic shapes) gets one made
    for the trace, and nothing keyed by a symbol is kept."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from fa4 import _layouts

    before = dict(_layouts._SHAPE_CONSTANTS)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * 4)
    t = mode.from_tensor(torch.zeros(3, 7, 2, 8), symbolic_context=dynamic)       # (s0, s1, s2, s3)
    with mode:
        assert isinstance(t.shape[0], torch.SymInt)
        packed, cu, s = _layouts.VarlenLayout.pack(t, None)
        assert tuple(cu.shape) == (4,) and packed.shape[0] == 21 and s == 7
    assert _layouts._SHAPE_CONSTANTS == before
    real, cu_real, _ = _layouts.VarlenLayout.pack(torch.zeros(3, 7, 2, 8), None)
    assert cu_real.tolist() == [0, 7, 14, 21] and real.shape == (21, 2, 8)


def test_zeroed_tail_zeroes_the_rows_a_straddling_tile_reads_and_nothing_else():
    """ZeroedTail on packed rows: rows cu[b] + used[b] .. + TAIL_ROWS (within sequence b) are 0, every
    other row is the input's; a full sequence (used = len) and an empty one keep all their rows; the
    gradient passes through, or is zeroed past the used lengths where a grid may stop short."""
    lens, used = [300, 5, 0, 40], [10, 5, 0, 0]
    cu = torch.tensor([0, 300, 305, 305, 345])
    total = cu[-1].item()
    t = torch.randn(total, 2, 8, dtype=F64).requires_grad_()
    tail = _layouts.tail_rows(cu, torch.tensor(used), total)
    assert tail.shape == (len(lens) * _layouts.TAIL_ROWS,)
    past = _layouts.rows_past_used(cu, torch.tensor(used), total)
    for short in (False, True):
        out = _layouts.ZeroedTail.apply(t, tail, past if short else None)
        zero = torch.zeros(total, dtype=torch.bool)
        zero[10:10 + _layouts.TAIL_ROWS] = True   # sequence 0: rows 10..265
        zero[305:345] = True                      # sequence 3: all 40 rows are within the tail
        assert torch.all(out[zero] == 0) and torch.equal(out[~zero], t[~zero])
        (grad,) = torch.autograd.grad(out, t, torch.ones_like(out))
        assert torch.equal(grad[~past], torch.ones_like(grad[~past]))
        assert torch.all(grad[past] == (0 if short else 1))
