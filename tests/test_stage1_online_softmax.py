"""Stage 1: the tiled loop equals the oracle for every threshold, and the tests show *why*
skipping a rescale is safe: every accumulated term stays <= 2^tau, and the final division by
l_i cancels whatever stale max was used. They also show where that argument ends (fp32, tau
near 128)."""
import math

import numpy as np
import pytest

from stage0_reference import attention_backward, attention_forward
from stage1_online_softmax import flash_backward, flash_forward

pytestmark = [pytest.mark.cpu, pytest.mark.stage1]

THRESHOLDS = [0.0, 0.5, 8.0, 20.0, 60.0]


def qkv(rng, b, sq, sk, hq, hkv, d, dv=None, std=1.0):
    dv = d if dv is None else dv
    return (std * rng.standard_normal((b, sq, hq, d)), std * rng.standard_normal((b, sk, hkv, d)),
            rng.standard_normal((b, sk, hkv, dv)))


def rising_scores(sq, sk, d, log2_step_per_key, scale=1.0):
    """Scores that grow along every row by `log2_step_per_key` per key: the max moves at every
    block, the worst case for rescaling. q = e0, k_j = j * c * e0."""
    q = np.zeros((1, sq, 1, d))
    q[..., 0] = 1.0
    k = np.zeros((1, sk, 1, d))
    k[0, :, 0, 0] = np.arange(sk) * log2_step_per_key / (scale * math.log2(math.e))
    v = np.random.default_rng(1).standard_normal((1, sk, 1, d))
    return q, k, v, scale


def assert_matches_oracle(q, k, v, causal, scale=None, atol=1e-12, **kw):
    out, lse = attention_forward(q, k, v, causal=causal, softmax_scale=scale)
    o1, l1, stats = flash_forward(q, k, v, causal=causal, softmax_scale=scale, **kw)
    np.testing.assert_allclose(o1, out, atol=atol, rtol=0)
    assert np.array_equal(np.isneginf(l1), np.isneginf(lse))
    fin = np.isfinite(lse)
    np.testing.assert_allclose(l1[fin], lse[fin], atol=atol * max(1.0, np.abs(lse[fin]).max(initial=0)), rtol=0)
    return stats


@pytest.mark.parametrize("tau", THRESHOLDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape, blocks", [
    ((2, 100, 150, 4, 2, 16, 16), (32, 48)),  # GQA 2, tiles not dividing the seqlens
    ((1, 113, 203, 2, 1, 24, 8), (16, 64)),  # MQA, head_dim_v < head_dim
    ((1, 1, 300, 2, 2, 8, 8), (128, 128)),  # a single query row
    ((1, 77, 5, 3, 3, 8, 8), (8, 2)),  # seqlen_q > seqlen_k: causal rows with nothing visible
], ids=["gqa", "mqa-dv", "sq1", "sq>sk"])
def test_forward_equals_oracle_for_every_threshold(rng, shape, blocks, causal, tau):
    b, sq, sk, hq, hkv, d, dv = shape
    q, k, v = qkv(rng, b, sq, sk, hq, hkv, d, dv, std=2.0)
    assert_matches_oracle(q, k, v, causal, block_m=blocks[0], block_n=blocks[1], rescale_threshold=tau)


@pytest.mark.parametrize("tau", THRESHOLDS)
def test_adversarial_monotonically_rising_scores(tau):
    # 0.3 log2 units per key: 38 per 128-key block, 3000 across the row
    blocks = 80
    q, k, v, scale = rising_scores(64, 128 * blocks, 8, 0.3)
    stats = assert_matches_oracle(q, k, v, False, scale=scale, rescale_threshold=tau, block_m=64, block_n=128)
    if tau < 38:  # every block's max beats the previous one by more than tau
        assert stats.done == 64 * (blocks - 1) and stats.skipped == 0
    else:  # tau = 60: growth 38 per block, so about every other block rescales
        assert 0 < stats.done < 64 * (blocks - 1) and stats.skipped > 0


@pytest.mark.parametrize("tau", [0.0, 8.0, 60.0])
def test_adversarial_magnitudes_up_to_1e4(rng, tau):
    q, k, v = qkv(rng, 1, 96, 333, 2, 1, 4)
    q *= 100.0 / np.abs(q).max()
    k *= 100.0 / np.abs(k).max()  # raw scores up to 1e4 * d
    assert_matches_oracle(q, k, v, False, scale=1.0, rescale_threshold=tau, block_m=32, block_n=64, atol=1e-9)


@pytest.mark.parametrize("tau", THRESHOLDS)
def test_causal_with_long_fully_masked_stretches(rng, tau):
    # 700 queries, 90 keys: the first 610 rows see nothing; the rest see a growing prefix
    q, k, v = qkv(rng, 1, 700, 90, 2, 2, 8, std=3.0)
    stats = assert_matches_oracle(q, k, v, True, block_m=64, block_n=16, rescale_threshold=tau)
    out, lse, _ = flash_forward(q, k, v, causal=True, block_m=64, block_n=16, rescale_threshold=tau)
    assert np.all(out[:, :610] == 0) and np.all(np.isneginf(lse[:, :, :610]))
    assert stats.initial == 2 * 90  # exactly the 90 rows that see keys got a first max, per head


@pytest.mark.parametrize("tau", [0.0, 2.0, 8.0, 20.0])
def test_why_skipping_is_safe_every_term_is_bounded_by_2_pow_tau(rng, tau):
    """The only thing a stale max changes is the size of the terms: S - m_stale <= tau, so
    each 2^(S - m_i) <= 2^tau and l_i <= Sk * 2^tau. Bounded terms cannot overflow, and the
    common factor 2^(-m_i) in O_i and l_i cancels in O_i / l_i."""
    for q, k, v, scale in (rising_scores(32, 2000, 8, 0.05) , (*qkv(rng, 1, 64, 500, 2, 2, 8, std=3.0), None)):
        _, _, stats = flash_forward(q, k, v, softmax_scale=scale, rescale_threshold=tau, block_m=32, block_n=64)
        assert stats.max_term <= 2.0 ** tau * (1 + 1e-12)
        assert stats.max_l <= k.shape[1] * 2.0 ** tau
    if tau > 0:  # the bound is attained: rising scores make the stale max as stale as allowed
        assert stats.max_term > 1.0


def test_the_bound_in_fp32_safe_at_tau_8_and_broken_past_128():
    """In fp32 (the kernels' accumulators) tau = 8 is as accurate as classic FlashAttention;
    tau = 130 lets a term reach 2^129 > FLT_MAX and the output is destroyed. This is why the
    threshold is a small constant and not 'never rescale'."""
    q, k, v, scale = rising_scores(16, 256, 4, 1.01)  # 129 log2 units across one 128-key block
    out, _ = attention_forward(q, k, v, softmax_scale=scale)
    errs = {}
    for tau in (0.0, 8.0, 130.0):
        with np.errstate(over="ignore", invalid="ignore"):
            o32, _, _ = flash_forward(q, k, v, softmax_scale=scale, rescale_threshold=tau,
                                      block_m=16, block_n=128, accum_dtype=np.float32)
        errs[tau] = np.abs(o32 - out).max()
    assert errs[8.0] <= 4 * errs[0.0] + 1e-6
    assert not errs[130.0] < 1e-3  # NaN or large: overflowed


def test_threshold_zero_is_classic_flashattention_and_skips_nothing(rng):
    q, k, v = qkv(rng, 1, 128, 1024, 2, 2, 16, std=2.0)
    classic = flash_forward(q, k, v, rescale_threshold=0.0, block_m=64, block_n=64)[2]
    fa4 = flash_forward(q, k, v, rescale_threshold=8.0, block_m=64, block_n=64)[2]
    assert classic.skipped == 0 and classic.done > 0
    # random scores: after the first blocks the max creeps up by small steps, rarely by > 8
    assert 10 * fa4.done < classic.done and fa4.skipped > 0
    for stats in (classic, fa4):  # the per-block counts add up to the totals
        assert [sum(c) for c in zip(*stats.per_block)] == [stats.done, stats.skipped]
        assert len(stats.per_block) == 1024 // 64


@pytest.mark.parametrize("rows_per_vote", [16, 32])
def test_warp_vote_rescales_whole_groups_and_stays_exact(rng, rows_per_vote):
    q, k, v, scale = rising_scores(128, 2048, 8, 0.05)  # 6.4 log2 units per block of 128
    q[0, ::7] *= 1.6  # some rows grow faster (10 per block) and cross tau = 8
    per_row = flash_forward(q, k, v, softmax_scale=scale, block_m=128, block_n=128)[2]
    voted = assert_matches_oracle(q, k, v, False, scale=scale, block_m=128, block_n=128,
                                  rows_per_vote=rows_per_vote)
    assert voted.done > per_row.done  # rows dragged along by their group's vote


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape, blocks", [
    ((2, 50, 70, 4, 2, 16, 16), (16, 32)),
    ((1, 113, 61, 2, 1, 24, 8), (32, 16)),
    ((1, 40, 9, 3, 3, 8, 8), (8, 4)),  # seqlen_q > seqlen_k
], ids=["gqa", "mqa-dv", "sq>sk"])
def test_backward_equals_oracle(rng, shape, blocks, causal):
    b, sq, sk, hq, hkv, d, dv = shape
    q, k, v = qkv(rng, b, sq, sk, hq, hkv, d, dv)
    out, lse = attention_forward(q, k, v, causal=causal)
    dout = rng.standard_normal(out.shape)
    ref = attention_backward(q, k, v, out, dout, lse, causal=causal)
    mine = flash_backward(q, k, v, out, dout, lse, causal=causal, block_m=blocks[0], block_n=blocks[1])
    for name, a, r in zip(("dq", "dk", "dv"), mine, ref):
        np.testing.assert_allclose(a, r, atol=1e-12, rtol=0, err_msg=name)


@pytest.mark.parametrize("kw, match", [
    (dict(block_m=0), "block_m: expected a positive int"),
    (dict(block_n=2.5), "block_n: expected a positive int"),
    (dict(rescale_threshold=-1.0), "rescale_threshold: expected a finite value >= 0"),
    (dict(rescale_threshold=float("inf")), "rescale_threshold"),
    (dict(rows_per_vote=0), "rows_per_vote"),
    (dict(accum_dtype=np.float16), "accum_dtype: expected np.float32 or np.float64"),
])
def test_bad_arguments_name_themselves(rng, kw, match):
    q, k, v = qkv(rng, 1, 4, 4, 1, 1, 4)
    with pytest.raises(ValueError, match=match):
        flash_forward(q, k, v, **kw)
