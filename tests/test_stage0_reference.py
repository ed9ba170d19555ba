"""Stage 0: the oracle is checked against things that are not itself: torch autograd,
finite differences, explicit GQA expansion, per-sequence dense calls, hand-made masks."""
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
from stage0_reference.torch_reference import assert_fa4_close, attention_ref

pytestmark = [pytest.mark.cpu, pytest.mark.stage0]


def qkv(rng, b, sq, sk, hq, hkv, d, dv=None):
    dv = d if dv is None else dv
    return (rng.standard_normal((b, sq, hq, d)), rng.standard_normal((b, sk, hkv, d)),
            rng.standard_normal((b, sk, hkv, dv)))


def torch_sdpa(q, k, v, causal, scale):
    """Independent path: torch's own SDPA (math backend, float64) with an explicit mask."""
    q, k, v = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    hq, hkv = q.shape[2], k.shape[2]
    kx = k.repeat_interleave(hq // hkv, dim=2)
    vx = v.repeat_interleave(hq // hkv, dim=2)
    mask = torch.tensor(visible_mask(q.shape[1], k.shape[1], causal))
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kx.transpose(1, 2), vx.transpose(1, 2), attn_mask=mask, scale=scale).transpose(1, 2)
    return q, k, v, out


def test_causal_mask_is_bottom_right_aligned():
    m = visible_mask(2, 5, causal=True)
    assert m.tolist() == [[True, True, True, True, False], [True] * 5]
    m = visible_mask(4, 2, causal=True)  # seqlen_q > seqlen_k: the first rows see nothing
    assert m.tolist() == [[False, False], [False, False], [True, False], [True, True]]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 7, 11, 4, 2, 8, 8), (1, 13, 13, 3, 3, 16, 8), (1, 5, 9, 8, 1, 12, 12)],
                         ids=["gqa2", "dv<d", "mqa"])
def test_forward_backward_match_torch_autograd(rng, shape, causal):
    b, sq, sk, hq, hkv, d, dv = shape
    q, k, v = qkv(rng, b, sq, sk, hq, hkv, d, dv)
    scale = 0.37
    out, lse = attention_forward(q, k, v, softmax_scale=scale, causal=causal)
    tq, tk, tv, tout = torch_sdpa(q, k, v, causal, scale)
    np.testing.assert_allclose(out, tout.detach().numpy(), atol=1e-12, rtol=0)
    dout = rng.standard_normal(out.shape)
    tout.backward(torch.tensor(dout))
    dq, dk, dv_ = attention_backward(q, k, v, out, dout, lse, softmax_scale=scale, causal=causal)
    for name, mine, theirs in (("dq", dq, tq.grad), ("dk", dk, tk.grad), ("dv", dv_, tv.grad)):
        np.testing.assert_allclose(mine, theirs.numpy(), atol=1e-12, rtol=0, err_msg=name)
    # lse is the log of the softmax denominator of the scaled scores
    s = np.einsum("bqhd,bkhd->bhqk", q, np.repeat(k, hq // hkv, axis=2)) * scale
    s = np.where(visible_mask(sq, sk, causal), s, -np.inf)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), atol=1e-12)


def test_backward_matches_finite_differences(rng):
    b, sq, sk, hq, hkv, d, dv = 1, 3, 4, 2, 1, 3, 2
    q, k, v = qkv(rng, b, sq, sk, hq, hkv, d, dv)
    w = rng.standard_normal((b, sq, hq, dv))  # loss = sum(out * w), so dout = w

    def loss(q_, k_, v_):
        return float((attention_forward(q_, k_, v_, causal=True)[0] * w).sum())

    out, lse = attention_forward(q, k, v, causal=True)
    grads = attention_backward(q, k, v, out, w, lse, causal=True)
    eps = 1e-6
    for idx, (x, g) in enumerate(zip((q, k, v), grads)):
        fd = np.zeros_like(x)
        for pos in np.ndindex(x.shape):
            args = [q, k, v]
            hi, lo = x.copy(), x.copy()
            hi[pos] += eps
            lo[pos] -= eps
            args[idx] = hi
            f_hi = loss(*args)
            args[idx] = lo
            fd[pos] = (f_hi - loss(*args)) / (2 * eps)
        np.testing.assert_allclose(g, fd, atol=1e-7, err_msg="qkv"[idx])


def test_gqa_equals_explicit_head_expansion(rng):
    q, k, v = qkv(rng, 2, 9, 10, 8, 2, 16)
    out, lse = attention_forward(q, k, v, causal=True)
    kx, vx = np.repeat(k, 4, axis=2), np.repeat(v, 4, axis=2)
    out_x, lse_x = attention_forward(q, kx, vx, causal=True)
    np.testing.assert_allclose(out, out_x, atol=1e-14)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = attention_backward(q, k, v, out, dout, lse, causal=True)
    dq_x, dk_x, dv_x = attention_backward(q, kx, vx, out_x, dout, lse_x, causal=True)
    np.testing.assert_allclose(dq, dq_x, atol=1e-13)
    # each kv head's gradient is the sum over its 4 query heads
    np.testing.assert_allclose(dk, dk_x.reshape(2, 10, 2, 4, 16).sum(3), atol=1e-13)
    np.testing.assert_allclose(dv, dv_x.reshape(2, 10, 2, 4, 16).sum(3), atol=1e-13)


def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_zero_grads(rng):
    q, k, v = qkv(rng, 1, 6, 3, 2, 2, 4)
    out, lse = attention_forward(q, k, v, causal=True)  # rows 0..2 see no key
    assert np.all(out[:, :3] == 0) and np.all(np.isneginf(lse[:, :, :3]))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse[:, :, 3:]))
    dq, dk, dv = attention_backward(q, k, v, out, rng.standard_normal(out.shape), lse, causal=True)
    assert np.all(dq[:, :3] == 0)
    assert all(np.all(np.isfinite(g)) for g in (dq, dk, dv))


def test_head_dim_192_128(rng):
    q, k, v = qkv(rng, 1, 5, 7, 2, 1, 192, 128)
    out, lse = attention_forward(q, k, v)
    assert out.shape == (1, 5, 2, 128) and lse.shape == (1, 2, 5)
    dq, dk, dv = attention_backward(q, k, v, out, np.ones_like(out), lse)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_equals_per_sequence_dense(rng, causal):
    lens_q = [3, 0, 5, 1, 0]
    lens_k = [4, 2, 5, 0, 0]  # includes a sequence with queries but no keys
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], 4, 8))
    k = rng.standard_normal((cu_k[-1], 2, 8))
    v = rng.standard_normal((cu_k[-1], 2, 6))
    out, lse = attention_varlen_forward(q, k, v, cu_q, cu_k, causal=causal)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = attention_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k, causal=causal)
    for i in range(len(lens_q)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if lens_q[i] == 0:
            continue
        o, l = attention_forward(q[None, qs], k[None, ks], v[None, ks], causal=causal)
        np.testing.assert_allclose(out[qs], o[0], atol=1e-14)
        np.testing.assert_allclose(lse[:, qs], l[0], atol=1e-14)
        if lens_k[i] == 0:
            assert np.all(out[qs] == 0) and np.all(np.isneginf(lse[:, qs])) and np.all(dq[qs] == 0)
            continue
        g = attention_backward(q[None, qs], k[None, ks], v[None, ks], o, dout[None, qs], l, causal=causal)
        for mine, ref in zip((dq[qs], dk[ks], dv[ks]), g):
            np.testing.assert_allclose(mine, ref[0], atol=1e-13)


def test_torch_reference_matches_numpy_oracle(rng):
    q, k, v = qkv(rng, 2, 11, 7, 4, 2, 8)
    for causal in (False, True):
        out, lse = attention_forward(q, k, v, causal=causal)
        t_out, t_lse = attention_ref(*(torch.tensor(x) for x in (q, k, v)), causal=causal)
        np.testing.assert_allclose(t_out.numpy(), out, atol=1e-12)
        np.testing.assert_allclose(t_lse.numpy(), lse, atol=1e-12)


def test_fa4_rule_accepts_bf16_like_error_and_rejects_worse(rng):
    q, k, v = (torch.tensor(x, dtype=torch.bfloat16) for x in qkv(rng, 1, 64, 64, 2, 2, 32))
    ref, _ = attention_ref(q, k, v, upcast=True)
    base, _ = attention_ref(q, k, v, upcast=False)
    assert_fa4_close("baseline itself", base, ref, base)
    with pytest.raises(AssertionError, match="exceeds FA4 bound"):
        assert_fa4_close("3x worse", ref.float() + 3 * (base.float() - ref.float()) + 1e-3, ref, base)
    with pytest.raises(AssertionError, match="exceeds FA4 bound"):
        assert_fa4_close("nan", torch.full_like(ref, float("nan")), ref, base)


@pytest.mark.parametrize("args, match", [
    (dict(q=np.zeros((2, 3, 4))), "q: expected rank 4"),
    (dict(k=np.zeros((1, 5, 3, 8)), v=np.zeros((1, 5, 3, 8))), "k: heads_kv = 3 must divide"),
    (dict(k=np.zeros((1, 5, 2, 7))), "k: head_dim 7 must equal"),
    (dict(v=np.zeros((1, 6, 2, 8))), "v: expected \\(seqlen_k, heads_kv\\)"),
    (dict(k=np.zeros((2, 5, 2, 8))), "k, v: batch"),
])
def test_bad_dense_input_names_the_argument(args, match):
    base = dict(q=np.zeros((1, 3, 4, 8)), k=np.zeros((1, 5, 2, 8)), v=np.zeros((1, 5, 2, 8)))
    base.update(args)
    with pytest.raises(ValueError, match=match):
        attention_forward(base["q"], base["k"], base["v"])


def test_bad_types_raise_type_error():
    with pytest.raises(TypeError, match="q: expected a real numeric array"):
        attention_forward(np.array([["a"]]), np.zeros((1, 1, 1, 1)), np.zeros((1, 1, 1, 1)))


@pytest.mark.parametrize("cu_q, exc, match", [
    (np.array([0, 3, 2], np.int32), ValueError, "cu_seqlens_q: expected non-decreasing"),
    (np.array([0, 2, 4], np.int32), ValueError, "cu_seqlens_q: last offset 4 must equal"),
    (np.array([1, 3], np.int32), ValueError, "cu_seqlens_q: expected to start at 0"),
    (np.array([0, 3], np.int64), TypeError, "cu_seqlens_q: expected dtype int32"),
    (np.array([3], np.int32), ValueError, "cu_seqlens_q: expected a 1-D array"),
])
def test_bad_cu_seqlens_name_the_argument(cu_q, exc, match):
    q, k, v = np.zeros((3, 2, 4)), np.zeros((5, 2, 4)), np.zeros((5, 2, 4))
    cu_k = np.array([0, 5], np.int32) if len(cu_q) != 3 else np.array([0, 2, 5], np.int32)
    with pytest.raises(exc, match=match):
        attention_varlen_forward(q, k, v, cu_q, cu_k)


def test_grad_atol_scales_with_the_gradients_and_keeps_a_floor():
    from stage0_reference.torch_reference import grad_atol

    assert grad_atol([torch.zeros(3)]) == 1e-5  # nothing to scale by: the rule's floor
    big = [torch.zeros(2), torch.full((4,), -16.0)]
    assert grad_atol(big) == 16.0 * 2.0 ** -16  # 2.4e-4: still 1/256 of a bf16 ulp at that scale
    # the degenerate case it exists for: the bf16 baseline is exact (error 0), the kernel carries
    # fp32 rounding ~1e-6 relative to gradients of size ~16: the fixed floor rejects it, the scaled
    # atol accepts it, and a bf16-sized error is still rejected
    ref = torch.full((8,), 16.0)
    noisy = ref + 16.0 * 1e-6
    with pytest.raises(AssertionError):
        assert_fa4_close("dk", noisy, ref, ref)
    assert_fa4_close("dk", noisy, ref, ref, atol=grad_atol([ref]))
    with pytest.raises(AssertionError):
        assert_fa4_close("dk", ref + 16.0 * 2.0 ** -9, ref, ref, atol=grad_atol([ref]))


def test_reference_and_baseline_are_the_rules_two_sides():
    """fp32 side: attention_ref upcast and its autograd gradients; baseline: the inputs' precision."""
    from stage0_reference.torch_reference import reference_and_baseline

    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(1, 7, 2, 16, generator=g).bfloat16() for _ in range(4))
    ref, base = reference_and_baseline(q, k, v, dout, causal=True, window_size=(2, None))
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    out, lse = attention_ref(*leaves, causal=True, window_size=(2, None))
    grads = torch.autograd.grad((out * dout.float()).sum(), leaves)
    for a, b in zip(ref, (out, lse, *grads)):
        torch.testing.assert_close(a, b)
    assert [t.dtype for t in base] == [torch.bfloat16, torch.float32] + [torch.bfloat16] * 3
    assert not torch.equal(base[0].float(), ref[0])  # the baseline really ran in bf16
