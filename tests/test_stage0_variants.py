"""Stage 0 variants: sliding window, softcap and learnable sink, forward and backward.

The NumPy oracle is checked against torch autograd (float64) through the torch reference,
against a mask written from the definition with two loops, against finite differences, and
against identities that hold between a variant and plain attention."""
import numpy as np
import pytest
import torch

from stage0_reference import (
    attention_backward,
    attention_forward,
    attention_varlen_backward,
    attention_varlen_forward,
    visible_mask,
)
from stage0_reference.torch_reference import attention_ref, attention_varlen_ref
from stage0_reference.validation import check_softcap, normalize_window

pytestmark = [pytest.mark.cpu, pytest.mark.stage0]


def qkv(rng, b, sq, sk, hq, hkv, d, dv=None):
    dv = d if dv is None else dv
    return (rng.standard_normal((b, sq, hq, d)), rng.standard_normal((b, sk, hkv, d)),
            rng.standard_normal((b, sk, hkv, dv)))


def mask_by_loops(sq, sk, causal, window):
    """The definition, one pair at a time: bottom-right aligned, -1 / None unlimited."""
    left, right = (None if w in (None, -1) else w for w in window)
    if causal:
        right = 0
    off = sk - sq
    m = np.zeros((sq, sk), dtype=bool)
    for i in range(sq):
        for j in range(sk):
            m[i, j] = (left is None or j >= i + off - left) and (right is None or j <= i + off + right)
    return m


def torch_autograd(q, k, v, dout, sink=None, **kw):
    """out, lse and every gradient from torch autograd on attention_ref in float64."""
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    ts = None if sink is None else torch.tensor(sink, requires_grad=True)
    out, lse = attention_ref(tq, tk, tv, learnable_sink=ts, **kw)
    (out * torch.tensor(dout)).sum().backward()
    grads = [tq.grad, tk.grad, tv.grad] + ([] if ts is None else [ts.grad])
    return out.detach().numpy(), lse.detach().numpy(), [g.numpy() for g in grads]


@pytest.mark.parametrize("sq, sk", [(1, 1), (3, 3), (64, 1), (239, 1), (799, 3), (113, 203), (5, 9)])
@pytest.mark.parametrize("causal", [False, True])
def test_window_mask_matches_the_definition(rng, sq, sk, causal):
    n = max(sq, sk) + 2
    windows = [(None, None), (-1, -1), (0, 0), (0, None), (None, 0), (-1, 2), (3, -1)]
    windows += [tuple(int(x) for x in rng.integers(0, n, size=2)) for _ in range(3)]
    for window in windows:
        if causal and window[1] not in (None, -1, 0):
            window = (window[0], 0)
        np.testing.assert_array_equal(visible_mask(sq, sk, causal, window), mask_by_loops(sq, sk, causal, window),
                                      err_msg=f"window={window}")


# (window kind, causal, softcap, sink, gqa ratio): every variant alone and in combination
CONFIGS = [
    ("both", False, 0.0, True, 2),
    ("left", False, 5.0, False, 6),
    ("right", False, 30.0, True, 1),
    ("left", True, 0.0, True, 2),  # causal + left window: the usual sliding window
    ("minus_one", True, 5.0, True, 6),
    ("both", False, 30.0, False, 1),
]


def draw_window(rng, kind, sq, sk):
    n = max(sq, sk) + 2
    a, b = (int(x) for x in rng.integers(0, n, size=2))
    return {"both": (a, b), "left": (a, None), "right": (None, b), "minus_one": (-1, -1)}[kind]


@pytest.mark.parametrize("sq, sk", [(1, 1), (3, 3), (64, 1), (239, 1), (799, 3), (113, 203)])
@pytest.mark.parametrize("config", CONFIGS, ids=[f"{c[0]}-causal{int(c[1])}-cap{c[2]:g}-sink{int(c[3])}-gqa{c[4]}"
                                                 for c in CONFIGS])
def test_variants_match_torch_autograd(rng, sq, sk, config):
    kind, causal, softcap, use_sink, ratio = config
    hkv = 2 if ratio < 6 else 1
    q, k, v = qkv(rng, 2, sq, sk, hkv * ratio, hkv, 16, 8)
    q *= 3.0  # scores of a few units, so a softcap of 5 bends them
    window = draw_window(rng, kind, sq, sk)
    sink = rng.standard_normal(hkv * ratio) * 2 if use_sink else None
    kw = dict(softmax_scale=0.4, causal=causal, window_size=window, softcap=softcap)
    out, lse = attention_forward(q, k, v, learnable_sink=sink, **kw)
    dout = rng.standard_normal(out.shape)
    grads = attention_backward(q, k, v, out, dout, lse, learnable_sink=sink, **kw)
    t_out, t_lse, t_grads = torch_autograd(q, k, v, dout, sink, **kw)

    np.testing.assert_allclose(out, t_out, atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, t_lse, atol=1e-12, rtol=1e-13)
    assert len(grads) == len(t_grads) == (4 if use_sink else 3)
    for name, mine, theirs in zip(("dq", "dk", "dv", "dsink"), grads, t_grads):
        np.testing.assert_allclose(mine, theirs, atol=1e-11, rtol=1e-11, err_msg=name)

    # rows that see no key: out 0, lse -inf, or exactly the sink
    empty = ~visible_mask(sq, sk, causal, window).any(axis=1)  # (Sq,)
    assert np.all(out[:, empty] == 0) and np.all(grads[0][:, empty] == 0)
    expected = np.broadcast_to(sink[None, :, None], lse.shape) if use_sink else np.full(lse.shape, -np.inf)
    np.testing.assert_array_equal(lse[:, :, empty], expected[:, :, empty])
    assert np.all(np.isfinite(lse[:, :, ~empty]))


def test_fully_masked_rows_with_every_variant(rng):
    # seqlen_q > seqlen_k and a right window of 5: rows 0..232 see no key at all
    q, k, v = qkv(rng, 1, 239, 1, 4, 2, 8)
    sink = np.array([0.5, -1.0, 2.0, 0.0])
    kw = dict(window_size=(3, 5), softcap=5.0)
    for s in (None, sink):
        out, lse = attention_forward(q, k, v, learnable_sink=s, **kw)
        assert np.all(out[:, :233] == 0) and np.all(out[:, 233:] != 0)
        want = np.full((1, 4, 233), -np.inf) if s is None else np.broadcast_to(sink[None, :, None], (1, 4, 233))
        np.testing.assert_array_equal(lse[:, :, :233], want)
        grads = attention_backward(q, k, v, out, rng.standard_normal(out.shape), lse, learnable_sink=s, **kw)
        assert all(np.all(np.isfinite(g)) for g in grads) and np.all(grads[0][:, :233] == 0)


def test_sink_is_a_rescale_of_plain_attention(rng):
    """With a sink, lse = logaddexp(lse_plain, sink) and out = out_plain * (1 - exp(sink - lse))."""
    q, k, v = qkv(rng, 2, 17, 23, 6, 3, 8)
    sink = rng.standard_normal(6) * 3
    kw = dict(causal=True, window_size=(4, None), softcap=7.0)
    out0, lse0 = attention_forward(q, k, v, **kw)
    out, lse = attention_forward(q, k, v, learnable_sink=sink, **kw)
    np.testing.assert_allclose(lse, np.logaddexp(lse0, sink[None, :, None]), atol=1e-13)
    keep = 1 - np.exp(sink[None, :, None] - lse)  # (B, H, Sq): the share the keys kept
    np.testing.assert_allclose(out, out0 * keep.transpose(0, 2, 1)[..., None], atol=1e-13)
    # a sink of -inf is no sink at all
    out_n, lse_n = attention_forward(q, k, v, learnable_sink=np.full(6, -np.inf), **kw)
    np.testing.assert_allclose(out_n, out0, atol=1e-14)
    np.testing.assert_allclose(lse_n, lse0, atol=1e-14)


def test_softcap_bounds_scores_and_vanishes_when_large(rng):
    q, k, v = qkv(rng, 1, 9, 11, 2, 2, 8)
    q *= 10.0
    out0, lse0 = attention_forward(q, k, v)
    out_big, lse_big = attention_forward(q, k, v, softcap=1e7)
    np.testing.assert_allclose(out_big, out0, atol=1e-9)
    np.testing.assert_allclose(lse_big, lse0, atol=1e-9)
    # capped scores lie in (-c, c), so lse <= c + log(Sk) and the softmax is flatter than uncapped
    c = 0.5
    _, lse_c = attention_forward(q, k, v, softcap=c)
    assert np.all(lse_c < c + np.log(11)) and np.all(lse_c > -c + np.log(11))


def finite_difference(f, x, eps=1e-6):
    fd = np.zeros_like(x)
    for pos in np.ndindex(x.shape):
        hi, lo = x.copy(), x.copy()
        hi[pos] += eps
        lo[pos] -= eps
        fd[pos] = (f(hi) - f(lo)) / (2 * eps)
    return fd


@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_gradients_incl_dsink_match_finite_differences(rng, softcap):
    q, k, v = qkv(rng, 2, 3, 4, 2, 1, 3, 2)
    sink = rng.standard_normal(2)
    w = rng.standard_normal((2, 3, 2, 2))  # loss = sum(out * w), so dout = w
    kw = dict(softmax_scale=1.0, window_size=(1, 1), softcap=softcap)

    def loss(q_=q, k_=k, v_=v, s_=sink):
        return float((attention_forward(q_, k_, v_, learnable_sink=s_, **kw)[0] * w).sum())

    out, lse = attention_forward(q, k, v, learnable_sink=sink, **kw)
    dq, dk, dv, dsink = attention_backward(q, k, v, out, w, lse, learnable_sink=sink, **kw)
    np.testing.assert_allclose(dq, finite_difference(lambda x: loss(q_=x), q), atol=1e-7, err_msg="dq")
    np.testing.assert_allclose(dk, finite_difference(lambda x: loss(k_=x), k), atol=1e-7, err_msg="dk")
    np.testing.assert_allclose(dv, finite_difference(lambda x: loss(v_=x), v), atol=1e-7, err_msg="dv")
    np.testing.assert_allclose(dsink, finite_difference(lambda x: loss(s_=x), sink), atol=1e-7, err_msg="dsink")
    assert np.all(np.abs(dsink) > 1e-6)  # the check above compared something


def test_varlen_variants_match_dense_and_torch(rng):
    lens_q = [3, 0, 5, 1, 4, 7]
    lens_k = [4, 2, 5, 0, 7, 3]  # an empty query sequence and one with queries but no keys
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], 4, 8)) * 3
    k = rng.standard_normal((cu_k[-1], 2, 8))
    v = rng.standard_normal((cu_k[-1], 2, 6))
    sink = rng.standard_normal(4)
    kw = dict(causal=True, window_size=(2, -1), softcap=5.0)
    out, lse = attention_varlen_forward(q, k, v, cu_q, cu_k, learnable_sink=sink, **kw)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv, dsink = attention_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k, learnable_sink=sink, **kw)

    dsink_sum = np.zeros(4)
    for i in range(len(lens_q)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if lens_q[i] == 0:
            continue
        o, l = attention_forward(q[None, qs], k[None, ks], v[None, ks], learnable_sink=sink, **kw)
        np.testing.assert_allclose(out[qs], o[0], atol=1e-14)
        np.testing.assert_allclose(lse[:, qs], l[0], atol=1e-14)
        if lens_k[i] == 0:
            assert np.all(out[qs] == 0) and np.all(lse[:, qs] == sink[:, None]) and np.all(dq[qs] == 0)
            continue
        g = attention_backward(q[None, qs], k[None, ks], v[None, ks], o, dout[None, qs], l, learnable_sink=sink, **kw)
        for mine, ref in zip((dq[qs], dk[ks], dv[ks]), g):
            np.testing.assert_allclose(mine, ref[0], atol=1e-13)
        dsink_sum += g[3]
    np.testing.assert_allclose(dsink, dsink_sum, atol=1e-13)

    tq, tk, tv, ts = (torch.tensor(x, requires_grad=True) for x in (q, k, v, sink))
    t_out, t_lse = attention_varlen_ref(tq, tk, tv, torch.tensor(cu_q), torch.tensor(cu_k), learnable_sink=ts, **kw)
    (t_out * torch.tensor(dout)).sum().backward()
    np.testing.assert_allclose(t_out.detach().numpy(), out, atol=1e-12)
    np.testing.assert_allclose(t_lse.detach().numpy(), lse, atol=1e-12)
    for name, mine, t in (("dq", dq, tq), ("dk", dk, tk), ("dv", dv, tv), ("dsink", dsink, ts)):
        np.testing.assert_allclose(mine, t.grad.numpy(), atol=1e-11, err_msg=name)


def test_low_precision_baseline_runs_every_variant(rng):
    q, k, v = (torch.tensor(x, dtype=torch.bfloat16) for x in qkv(rng, 1, 40, 8, 4, 2, 16))
    sink = torch.tensor(rng.standard_normal(4), dtype=torch.float32)
    kw = dict(window_size=(2, 1), softcap=5.0, learnable_sink=sink)
    ref, ref_lse = attention_ref(q, k, v, upcast=True, **kw)
    base, base_lse = attention_ref(q, k, v, upcast=False, **kw)
    assert base.dtype == torch.bfloat16 and base_lse.dtype == torch.float32
    assert torch.isfinite(base.float()).all() and torch.isfinite(base_lse).all()
    err = (base.float() - ref.float()).abs().max().item()
    assert 0 < err < 0.05  # bf16 rounding: present, and small
    # rows 0..30 see no key (right window 1, offset -32): out 0, lse = sink
    assert torch.all(base[:, :31] == 0) and torch.all(base[:, 31:] != 0)
    torch.testing.assert_close(base_lse[0, :, :31], sink[:, None].expand(4, 31))


def test_normalize_window_and_check_softcap_return_plain_python_values():
    assert normalize_window((None, None), False) == (None, None)
    assert normalize_window((-1, -1), False) == (None, None)
    assert normalize_window((-1, -1), True) == (None, 0)
    assert normalize_window([np.int64(7), 0], True) == (7, 0)
    assert type(normalize_window((np.int32(3), np.int64(4)), False)[0]) is int
    assert normalize_window((0, 2), False) == (0, 2)
    assert check_softcap(0) == 0.0 and check_softcap(np.float32(5.0)) == 5.0
    assert type(check_softcap(np.float32(5.0))) is float and type(check_softcap(30)) is float


BAD = [
    (dict(window_size=(-2, None)), ValueError, r"^window_size:"),
    (dict(window_size=(None, -5)), ValueError, r"^window_size:"),
    (dict(window_size=(None, 4), causal=True), ValueError, r"^window_size:.*causal"),
    (dict(window_size=(1.5, None)), TypeError, r"^window_size:"),
    (dict(window_size=(True, None)), TypeError, r"^window_size:"),
    (dict(window_size=3), TypeError, r"^window_size:"),
    (dict(window_size=(1, 2, 3)), TypeError, r"^window_size:"),
    (dict(window_size="ab"), TypeError, r"^window_size:"),
    (dict(softcap=-1.0), ValueError, r"^softcap:"),
    (dict(softcap=float("nan")), ValueError, r"^softcap:"),
    (dict(softcap="5"), TypeError, r"^softcap:"),
    (dict(learnable_sink=np.zeros(3)), ValueError, r"^learnable_sink:"),
    (dict(learnable_sink=np.zeros((4, 1))), ValueError, r"^learnable_sink:"),
]


@pytest.mark.parametrize("kwargs, exc, match", BAD, ids=[f"{list(b[0])[-1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_variant_arguments_name_the_argument(kwargs, exc, match):
    q, k, v = np.zeros((1, 3, 4, 8)), np.zeros((1, 5, 2, 8)), np.zeros((1, 5, 2, 8))
    out, lse = np.zeros((1, 3, 4, 8)), np.zeros((1, 4, 3))
    cu_q, cu_k = np.array([0, 3], np.int32), np.array([0, 5], np.int32)
    calls = [
        lambda: attention_forward(q, k, v, **kwargs),
        lambda: attention_backward(q, k, v, out, out, lse, **kwargs),
        lambda: attention_varlen_forward(q[0], k[0], v[0], cu_q, cu_k, **kwargs),
        lambda: attention_varlen_backward(q[0], k[0], v[0], out[0], out[0], lse[0], cu_q, cu_k, **kwargs),
        lambda: attention_ref(*(torch.tensor(x) for x in (q, k, v)), **kwargs),
    ]
    for call in calls:
        with pytest.raises(exc, match=match):
            call()


def test_torch_reference_a_minus_inf_sink_on_rows_without_keys():
    """A -inf sink with rows that see no key (causal, Sq > Sk): those rows are out 0, lse -inf, and
    no NaN reaches out, dv or dsink (the NumPy oracle's answer; an audit found NaN here)."""
    import math

    import torch

    from stage0_reference.torch_reference import attention_ref

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 3, 1, 4, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 1, 1, n, generator=g, dtype=torch.float64, requires_grad=True) for n in (4, 2))
    sink = torch.tensor([-math.inf], dtype=torch.float64, requires_grad=True)
    out, lse = attention_ref(q, k, v, causal=True, learnable_sink=sink)
    assert torch.all(out[0, :2] == 0) and torch.isneginf(lse[0, 0, :2]).all() and torch.isfinite(lse[0, 0, 2])
    out.sum().backward()
    assert torch.isfinite(v.grad).all() and torch.isfinite(k.grad).all() and sink.grad.item() == 0.0
