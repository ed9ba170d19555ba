"""Half tiles of the Hopper backward (stage4_bwd_kernel/hopper/consumer.py, ``edge_tile``): in a masked
tile at a walk's end, the consumer warpgroup whose 64 keys no query of the tile sees skips S^T, dP^T, dV
and dK, and dQ reads only the other 64 keys. ``schedule.keys_hidden`` decides it, traced by the kernel
and replayed here: against every (key, query) of the mask rule, and through ``model.backward_model``,
which zeroes the idle keys' P^T and dS^T, against the float64 oracle. gpu tier: test_hopper_backward*.py."""
from __future__ import annotations

import numpy as np
import pytest

from stage4_bwd_kernel import schedule

pytestmark = [pytest.mark.stage4, pytest.mark.cpu]

TILE_N = 128


def _window(causal, left, right):
    from stage3_fwd_kernel.components.window import make_window

    return make_window(causal, (left, right))


def _masked_tiles(sq, sk, tm, causal, window):
    """(n, m, key_limit, diag, walk segment) of every masked tile of every K/V tile's walk (segments as
    consumer.walk_tiles cuts them: 0 before the unmasked run, 2 from its end)."""
    for n in range(-(-sk // TILE_N)):
        lo, hi = schedule.m_block_range(n, tm, TILE_N, sq, sk, causal, window=window)
        hot_lo, hot_hi = schedule.unmasked_m_range(n, tm, TILE_N, sq, sk, causal, lo, hi, window=window)
        for m in range(lo, hi):
            key_limit, diag = schedule.mask_bounds(m, n, tm, TILE_N, sq, sk)
            if schedule.tile_needs_mask(key_limit, diag, TILE_N, causal, window=window, tile_m=tm):
                assert not hot_lo <= m < hot_hi  # the unmasked segment holds no masked tile
                yield n, m, key_limit, diag, (0 if m < hot_lo else 2)


CASES = [(2048, 2048, True, None, None), (1000, 1000, True, None, None), (2048, 2048, True, 1024, None),
         (777, 1290, True, 300, None), (1290, 777, False, 200, 150), (513, 513, False, None, 0),
         (300, 70, False, 40, 3), (203, 113, True, 129, None), (4224, 4224, True, 1000, None)]


@pytest.mark.parametrize("tm", [64, 80, 128])
@pytest.mark.parametrize("sq,sk,causal,left,right", CASES)
def test_keys_hidden_is_exactly_the_mask(tm, sq, sk, causal, left, right):
    """For each warpgroup's 64 keys of each masked tile: hidden iff the mask rule masks every
    (key, query column) of them, padding columns included; and each edge's test alone never says
    hidden where a key is seen."""
    window = _window(causal, left, right)
    r, c = np.arange(TILE_N)[:, None], np.arange(tm)[None, :]
    seen = 0
    for n, m, key_limit, diag, _ in _masked_tiles(sq, sk, tm, causal, window):
        masked = schedule.is_masked(r, c, key_limit, diag, causal, window)       # (tn, tm)
        for wg in (0, 1):
            truth = bool(masked[64 * wg:64 * wg + 64].all())
            got = schedule.keys_hidden(64 * wg, 64, key_limit, diag, tm, causal, window)
            assert bool(got) == truth, (n, m, wg, key_limit, diag)
            for edge in ("right", "left"):
                if edge == "left" and schedule.band_edges(causal, window)[0] is None:
                    continue
                if schedule.keys_hidden(64 * wg, 64, key_limit, diag, tm, causal, window, edge):
                    assert truth, (n, m, wg, edge)
            seen += truth
    if tm < 128 and (causal or left is not None) and sq == sk:
        assert seen > 0  # the cases with equal lengths and 64 / 80-row tiles have half tiles


@pytest.mark.parametrize("tm", [80, 64])
def test_half_tiles_of_a_causal_walk(tm):
    """Causal, equal lengths: with 80-row tiles the first tile of K/V tile n leaves its last 64 keys
    unseen unless 128 n is a multiple of 80 (then its rows start at the tile's first key and its last
    row sees key 64): four K/V tiles in five. With 64-row tiles every first tile does."""
    sq = sk = 80 * 128
    window = _window(True, None, None)
    halves = 0
    for n in range(sk // TILE_N):
        lo, _ = schedule.m_block_range(n, tm, TILE_N, sq, sk, True, window=window)
        key_limit, diag = schedule.mask_bounds(lo, n, tm, TILE_N, sq, sk)
        hidden = schedule.keys_hidden(64, 64, key_limit, diag, tm, True, window, "right")
        assert hidden == (tm == 64 or (128 * n) % 80 != 0), n
        halves += hidden
    assert halves == (4 * (sk // TILE_N) // 5 if tm == 80 else sk // TILE_N)


def test_edge_without_a_left_edge_is_refused():
    with pytest.raises(ValueError, match="edge"):
        schedule.keys_hidden(0, 64, 128, 0, 64, False, None, "left")


def _inputs(rng, causal, left, right, sq, sk):
    from stage0_reference import attention_backward, attention_forward

    q = rng.standard_normal((1, sq, 2, 32))
    k = rng.standard_normal((1, sk, 1, 32))
    v = rng.standard_normal((1, sk, 1, 16))
    do = rng.standard_normal((1, sq, 2, 16))
    variant = dict(causal=causal, window_size=(left, right))
    o, lse = attention_forward(q, k, v, **variant)
    return (q, k, v, o, do, lse), attention_backward(q, k, v, o, do, lse, **variant)


def _halves(sq, sk, tm, causal, window):
    """{(n, m): idle keys} of the masked tiles with an idle warpgroup."""
    from stage4_bwd_kernel import model

    idle = {(n, m): model._idle_keys(kl, dg, tm, TILE_N, causal, window, seg)
            for n, m, kl, dg, seg in _masked_tiles(sq, sk, tm, causal, window)}
    return {key: keys for key, keys in idle.items() if keys.any()}


@pytest.mark.parametrize("tm", [64, 80])
@pytest.mark.parametrize("causal,left,right,sq,sk", [(True, None, None, 260, 260), (True, 70, None, 300, 300),
                                                     (False, 90, 20, 203, 113), (True, None, None, 113, 203)])
def test_model_with_idle_warpgroups_matches_the_oracle(rng, tm, causal, left, right, sq, sk):
    """The tile walk with the idle warpgroups' P^T and dS^T zeroed gives the oracle's gradients."""
    from stage4_bwd_kernel import model

    window = _window(causal, left, right)
    assert _halves(sq, sk, tm, causal, window)
    args, ref = _inputs(rng, causal, left, right, sq, sk)
    got = model.backward_model(*args, causal=causal, tile_m=tm, tile_n=TILE_N, order=schedule.KVDescendingOrder,
                               window=window)
    for name, g, r in zip(("dq", "dk", "dv"), got, ref):
        np.testing.assert_allclose(g, r, atol=1e-12, rtol=1e-10, err_msg=name)


@pytest.mark.parametrize("tm,causal,left,right,sq,sk", [(80, True, None, None, 260, 260), (64, True, 70, None, 300, 300),
                                                        (64, False, 90, 20, 203, 113)])
def test_model_catches_a_rule_that_tests_the_wrong_query(rng, monkeypatch, tm, causal, left, right, sq, sk):
    """A rule that tests each edge at the wrong query column (the right edge at the first, the left at
    the last) idles keys some query sees, and the model's gradients then leave the oracle's."""
    from stage4_bwd_kernel import model

    window = _window(causal, left, right)
    exact = _halves(sq, sk, tm, causal, window)

    def wrong_column(first_key, num_keys, key_limit, diag, tile_m, causal, window=None, edge="any"):
        lo, hi = schedule.band_edges(causal, window)
        hidden = first_key >= key_limit if edge != "left" else False
        if edge != "left" and hi is not None:
            hidden = hidden | (first_key > diag + hi)
        if edge != "right" and lo is not None:
            hidden = hidden | (first_key + num_keys - 1 < tile_m - 1 + diag - lo)
        return hidden

    monkeypatch.setattr(schedule, "keys_hidden", wrong_column)
    mutated = _halves(sq, sk, tm, causal, window)
    assert mutated.keys() != exact.keys() or any((mutated[t] != exact[t]).any() for t in exact)
    args, ref = _inputs(rng, causal, left, right, sq, sk)
    wrong = model.backward_model(*args, causal=causal, tile_m=tm, tile_n=TILE_N, order=schedule.KVDescendingOrder,
                                 window=window)
    assert any(not np.allclose(g, r, atol=1e-8) for g, r in zip(wrong, ref))
