"""The backward's index arithmetic with a sliding window and softcap (stage4_bwd_kernel.schedule, the
same functions the kernels trace), replayed on the CPU by ``model.backward_model`` against the NumPy
oracle, and the deterministic mode's semaphore ranks with a window. gpu tier of the kernels:
tests/test_hopper_variants.py."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

pytestmark = pytest.mark.stage4


def _window(causal, left, right):
    from stage3_fwd_kernel.components.window import make_window

    return make_window(causal, (left, right))


WINDOWS = [(False, 0, 0), (False, 5, None), (False, None, 7), (False, 40, 3), (True, 0, None), (True, 70, None),
           (True, 129, None), (False, 200, 200)]


@pytest.mark.cpu
@pytest.mark.parametrize("tiles", [(64, 128), (80, 128), (64, 96)], ids=["64x128", "80x128", "64x96"])
@pytest.mark.parametrize("causal,left,right", WINDOWS)
@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("sq,sk", [(1, 1), (113, 203), (300, 70), (260, 260)])
def test_tile_walk_model_with_window_and_softcap_matches_oracle(rng, tiles, causal, left, right, softcap, sq, sk):
    from stage0_reference import attention_backward, attention_forward
    from stage4_bwd_kernel import schedule
    from stage4_bwd_kernel.model import backward_model

    q = rng.standard_normal((2, sq, 4, 32))
    k = rng.standard_normal((2, sk, 2, 32))
    v = rng.standard_normal((2, sk, 2, 16))
    do = rng.standard_normal((2, sq, 4, 16))
    variant = dict(causal=causal, window_size=(left, right), softcap=softcap)
    o, lse = attention_forward(q, k, v, **variant)
    ref = attention_backward(q, k, v, o, do, lse, **variant)
    got = backward_model(q, k, v, o, do, lse, causal=causal, tile_m=tiles[0], tile_n=tiles[1],
                         order=schedule.KVDescendingOrder, window=_window(causal, left, right), softcap=softcap)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        np.testing.assert_allclose(g, r, atol=1e-12, rtol=1e-10, err_msg=name)


@pytest.mark.cpu
@pytest.mark.parametrize("tm,tn", [(64, 128), (128, 128), (80, 128), (64, 64), (64, 96)])
def test_walk_bounds_agree_with_the_ranks(tm, tn):
    """A Q tile m is in K/V tile n's walk exactly when first(m) <= n <= last(m): the walk bounds
    and the deterministic ranks must agree, or a semaphore waits forever. Also: the walk holds every
    (n, m) pair with a visible score, and the unmasked range holds only tiles with none masked."""
    from stage4_bwd_kernel import schedule

    rnd = random.Random(7)
    for _ in range(60):
        sq, sk = rnd.randint(1, 700), rnd.randint(1, 700)
        causal = rnd.random() < 0.5
        left = rnd.choice([None, 0, rnd.randint(0, 800)])
        right = None if causal else rnd.choice([None, 0, rnd.randint(0, 800)])
        w = _window(causal, left, right)
        i = np.arange(sq)[:, None]
        j = np.arange(sk)[None, :]
        visible = np.ones((sq, sk), bool)
        if w.right is not None:
            visible &= j <= i + sk - sq + w.right
        if w.left is not None:
            visible &= j >= i + sk - sq - w.left
        for n in range(-(-sk // tn)):
            lo, hi = schedule.m_block_range(n, tm, tn, sq, sk, causal, window=w)
            for m in range(-(-sq // tm)):
                in_walk = lo <= m < hi
                first = schedule.n_block_first(m, tm, tn, sq, sk, causal, window=w)
                last = schedule.n_block_last(m, tm, tn, sq, sk, causal, window=w)
                seen = visible[m * tm:(m + 1) * tm, n * tn:(n + 1) * tn].any()
                assert not seen or in_walk, (sq, sk, w, n, m)
                if in_walk:
                    assert first <= n <= last, (sq, sk, w, n, m, first, last)
            ulo, uhi = schedule.unmasked_m_range(n, tm, tn, sq, sk, causal, lo, hi, window=w)
            assert lo <= ulo <= uhi <= hi
            for m in range(ulo, uhi):
                key_limit, diag = schedule.mask_bounds(m, n, tm, tn, sq, sk)
                assert not schedule.tile_needs_mask(key_limit, diag, tn, causal, window=w, tile_m=tm), (sq, sk, w, n, m)
                block = visible[m * tm:(m + 1) * tm, n * tn:(n + 1) * tn]
                assert block.shape == (tm, tn) and block.all(), (sq, sk, w, n, m)


@pytest.mark.cpu
@pytest.mark.parametrize("causal,left,right", [(False, 100, 50), (True, 300, None), (False, None, 0), (True, 0, None)])
@pytest.mark.parametrize("order_name", ["kv_ascending", "kv_descending", "kv_descending_sections"])
def test_semaphores_with_a_window_never_deadlock(causal, left, right, order_name):
    from stage4_bwd_kernel import schedule
    from stage4_bwd_kernel.model import simulate_semaphores

    order = {o.name: o for o in (schedule.KVAscendingOrder, schedule.KVDescendingOrder,
                                 schedule.KVDescendingSectionsOrder)}[order_name]
    w = _window(causal, left, right)
    for (sq, sk), resident, hop in itertools.product(((1000, 1000), (300, 1000), (1000, 300)), (2, 5), (0, 1)):
        sim = simulate_semaphores(seqlen_q=sq, seqlen_k=sk, tile_m=64, tile_n=128, causal=causal, order=order,
                                  batch=2, heads_kv=2, group=2, resident=resident, hop=hop, window=w)
        assert sim.finished, (sq, sk, resident, hop)
        for (b, h, m), seq in sim.add_sequence.items():
            first = schedule.n_block_first(m, 64, 128, sq, sk, causal, window=w)
            last = schedule.n_block_last(m, 64, 128, sq, sk, causal, window=w)
            expect = list(range(first, last + 1))
            assert seq == (expect if issubclass(order, schedule.KVAscendingOrder) else expect[::-1]), (b, h, m)
