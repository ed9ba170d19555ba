"""Stage 4 (Hopper backward: preprocess, main kernel, postprocess, deterministic mode).

cpu tier: the kernel's tile walk replayed in NumPy (``model.backward_model``, using the very
bounds/mask/rank functions the kernel traces) matches the stage-0 oracle for causal Sq != Sk, GQA,
varlen with empty sequences and seqused_k; the semaphore simulation of the deterministic mode
never deadlocks, adds in rank order, and the descending order removes the causal first-write
stalls; bad inputs raise ValueError / TypeError naming the argument before any launch.

compile tier (sm_90a, no GPU), both ladder steps: every head dim x dtype, causal and deterministic
on/off, varlen: no spills, no local memory, the HGMMA count of the five GEMMs, 8-byte fp32 atomics
(REDG ... F32x2) in SASS, in deterministic mode the semaphore protocol (acquire spin loop, fence +
release add); step 2 also TMA (UTMALDG) and setmaxnreg; preprocess / postprocess compile with
16-byte memory instructions.

gpu tier (device H100/H200), both steps: dq, dk, dv follow FA4's rule against fp32 autograd over the seqlen
pairs of the issue, causal on/off, GQA 1/2/8, all head dims, fp16, varlen with empty sequences
and seqused_k; outputs are NaN-poisoned first; deterministic mode gives 100 bitwise-identical
runs (GQA, causal); the chain stage-3 forward -> backward; run() entry point.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

pytestmark = pytest.mark.stage4

HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]


# ================================================================================== cpu tier
def _dense_case(rng, b, sq, sk, hq, hkv, d, dv, causal):
    from stage0_reference import attention_forward

    q = rng.standard_normal((b, sq, hq, d))
    k = rng.standard_normal((b, sk, hkv, d))
    v = rng.standard_normal((b, sk, hkv, dv))
    do = rng.standard_normal((b, sq, hq, dv))
    o, lse = attention_forward(q, k, v, causal=causal)
    return q, k, v, o, do, lse


@pytest.mark.cpu
@pytest.mark.parametrize("tiles", [(64, 128), (128, 128), (64, 64)], ids=["64x128", "128x128", "64x64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 3), (113, 203), (239, 1), (300, 70), (130, 130)])
def test_tile_walk_model_matches_oracle(rng, tiles, causal, sq, sk):
    from stage0_reference import attention_backward
    from stage4_bwd_kernel import schedule
    from stage4_bwd_kernel.model import backward_model

    q, k, v, o, do, lse = _dense_case(rng, 2, sq, sk, 4, 2, 32, 16, causal)
    ref = attention_backward(q, k, v, o, do, lse, causal=causal)
    for order in (schedule.KVAscendingOrder, schedule.KVDescendingOrder):
        got = backward_model(q, k, v, o, do, lse, causal=causal, tile_m=tiles[0], tile_n=tiles[1], order=order)
        for name, g, r in zip(("dq", "dk", "dv"), got, ref):
            np.testing.assert_allclose(g, r, atol=1e-12, rtol=1e-10, err_msg=name)


def _varlen_case(rng, lens_q, lens_k, hq, hkv, d):
    cq = np.cumsum([0] + lens_q).astype(np.int32)
    ck = np.cumsum([0] + lens_k).astype(np.int32)
    q = rng.standard_normal((cq[-1], hq, d))
    k = rng.standard_normal((ck[-1], hkv, d))
    v = rng.standard_normal((ck[-1], hkv, d))
    do = rng.standard_normal((cq[-1], hq, d))
    return q, k, v, do, cq, ck


@pytest.mark.cpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_tile_walk_model_varlen_and_seqused(rng, causal):
    from stage0_reference import attention_varlen_backward, attention_varlen_forward
    from stage4_bwd_kernel.model import backward_model

    lens_q, lens_k = [5, 0, 130, 64, 1, 0], [7, 3, 0, 200, 64, 0]
    q, k, v, do, cq, ck = _varlen_case(rng, lens_q, lens_k, 4, 2, 32)
    o, lse = attention_varlen_forward(q, k, v, cq, ck, causal=causal)
    ref = attention_varlen_backward(q, k, v, o, do, lse, cq, ck, causal=causal)
    got = backward_model(q, k, v, o, do, lse, causal=causal, tile_m=64, tile_n=64, cu_seqlens_q=cq, cu_seqlens_k=ck)
    for g, r in zip(got, ref):
        np.testing.assert_allclose(g, r, atol=1e-12, rtol=1e-10)

    # seqused_k: only the first used[b] keys of each sequence count; the rest get zero gradient
    used = np.array([4, 3, 0, 150, 10, 0], np.int32)
    keep = np.concatenate([np.arange(ck[b], ck[b] + used[b]) for b in range(len(used))]).astype(int)
    ck2 = np.cumsum([0] + used.tolist()).astype(np.int32)
    o2, lse2 = attention_varlen_forward(q, k[keep], v[keep], cq, ck2, causal=causal)
    r2 = attention_varlen_backward(q, k[keep], v[keep], o2, do, lse2, cq, ck2, causal=causal)
    g2 = backward_model(q, k, v, o2, do, lse2, causal=causal, tile_m=64, tile_n=64, cu_seqlens_q=cq,
                        cu_seqlens_k=ck, seqused_k=used)
    dk_exp, dv_exp = np.zeros_like(k), np.zeros_like(v)
    dk_exp[keep], dv_exp[keep] = r2[1], r2[2]
    for g, r in zip(g2, (r2[0], dk_exp, dv_exp)):
        np.testing.assert_allclose(g, r, atol=1e-12, rtol=1e-10)


@pytest.mark.cpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tiles", [(64, 128), (128, 128), (64, 64), (64, 96)], ids=["64x128", "128x128", "64x64", "64x96"])
@pytest.mark.parametrize("order_name", ["kv_ascending", "kv_descending", "kv_ascending_sections",
                                        "kv_ascending_sections256", "kv_descending_sections"])
def test_semaphore_orders_never_deadlock_and_serialize(causal, tiles, order_name):
    """Every dQ tile receives each visiting K/V tile exactly once, in the order's sequence, and
    the grid finishes even when only a few CTAs are resident (CTAs wait only on earlier ones),
    with increments seen at once or a step later."""
    from stage4_bwd_kernel import schedule
    from stage4_bwd_kernel.model import simulate_semaphores

    order = {o.name: o for o in (schedule.KVAscendingOrder, schedule.KVDescendingOrder, schedule.KVAscendingSectionsOrder,
                                 schedule.KVAscendingWideSectionsOrder, schedule.KVDescendingSectionsOrder)}[order_name]
    tm, tn = tiles
    for sq, sk, resident, hop in ((1000, 1000, 3, 0), (300, 1000, 5, 1), (1000, 300, 2, 0), (64, 64, 1, 1),
                                  (1000, 1000, 7, 1)):
        sim = simulate_semaphores(seqlen_q=sq, seqlen_k=sk, tile_m=tm, tile_n=tn, causal=causal, order=order,
                                  batch=2, heads_kv=3, group=2, resident=resident, hop=hop)
        assert sim.finished, (sq, sk, resident)
        for (b, h, m), seq in sim.add_sequence.items():
            last = schedule.n_block_last(m, tm, tn, sq, sk, causal)
            expect = list(range(last + 1))
            assert seq == (expect if issubclass(order, schedule.KVAscendingOrder) else expect[::-1]), (b, h, m)


@pytest.mark.cpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("order_name", ["kv_ascending", "kv_descending", "kv_ascending_sections",
                                        "kv_descending_sections"])
def test_warpgroup_turns_keep_each_share_in_order(causal, order_name):
    """256's deterministic turns (hopper/wide.py): each CTA's two warpgroups add their shares of a dQ
    tile on their own, at their own pace (jitter), the counter counting warpgroups (rank r adds at >= 2 r).
    Every share receives the K/V tiles in the order's sequence, and the grid finishes with few CTAs
    resident. (Counting CTAs instead, >= r, lets a warpgroup overtake its predecessor's: this fails.)"""
    from stage4_bwd_kernel import schedule
    from stage4_bwd_kernel.hopper.options import NUM_WG_MMA
    from stage4_bwd_kernel.model import simulate_semaphores

    order = {o.name: o for o in (schedule.KVAscendingOrder, schedule.KVDescendingOrder, schedule.KVAscendingSectionsOrder,
                                 schedule.KVDescendingSectionsOrder)}[order_name]
    tm = tn = 64
    for sq, sk, resident, hop in ((1000, 1000, 3, 0), (300, 1000, 5, 1), (1000, 300, 2, 0), (64, 64, 1, 1),
                                  (1000, 1000, 132, 0), (700, 900, 40, 1)):
        sim = simulate_semaphores(seqlen_q=sq, seqlen_k=sk, tile_m=tm, tile_n=tn, causal=causal, order=order,
                                  batch=2, heads_kv=3, group=2, resident=resident, hop=hop, warpgroups=NUM_WG_MMA,
                                  jitter=0.3, seed=sq + resident)
        assert sim.finished, (sq, sk, resident)
        shares = {key[3] for key in sim.add_sequence}
        assert shares == set(range(NUM_WG_MMA))
        for (b, h, m, w), seq in sim.add_sequence.items():
            expect = list(range(schedule.n_block_last(m, tm, tn, sq, sk, causal) + 1))
            assert seq == (expect if issubclass(order, schedule.KVAscendingOrder) else expect[::-1]), (b, h, m, w)


@pytest.mark.cpu
def test_jitter_does_not_hide_a_deadlock():
    """Ascending ranks launched in descending order wait on CTAs not yet dispatched: reported as a
    deadlock with warpgroups sitting out steps at random too (a sit-out only counts as progress for a
    warpgroup that could add)."""
    from stage4_bwd_kernel import schedule
    from stage4_bwd_kernel.model import simulate_semaphores

    class AscendingRanksDescendingLaunch(schedule.KVAscendingOrder):
        n_block_for_launch = staticmethod(schedule.KVDescendingOrder.n_block_for_launch)

    for warpgroups in (1, 2):
        sim = simulate_semaphores(seqlen_q=4096, seqlen_k=4096, tile_m=64, tile_n=64, causal=False,
                                  order=AscendingRanksDescendingLaunch, batch=2, heads_kv=3, resident=40,
                                  warpgroups=warpgroups, jitter=0.3, seed=1)
        assert not sim.finished


@pytest.mark.cpu
@pytest.mark.parametrize("num_n_blocks,heads_kv,batch", [(8, 32, 32), (32, 3, 7), (5, 3, 7), (1, 1, 1), (200, 2, 1),
                                                         (17, 1, 9), (129, 4, 1), (128, 5, 3)])
def test_launch_sections_cover_the_grid_and_keep_predecessors_first(num_n_blocks, heads_kv, batch):
    """host_tile is a bijection onto the grid (N, H_kv, B), and every CTA launches after the CTAs it
    waits for (smaller n ascending, larger n descending); consecutive K/V tiles of a chain launch
    G = ceil(section_ctas / N) apart inside a full section."""
    from stage4_bwd_kernel import schedule

    for order, step in ((schedule.KVAscendingSectionsOrder, -1), (schedule.KVAscendingWideSectionsOrder, -1),
                        (schedule.KVDescendingSectionsOrder, 1)):
        tiles = [order.host_tile(i, num_n_blocks, heads_kv, batch) for i in range(num_n_blocks * heads_kv * batch)]
        assert sorted(tiles) == [(n, h, b) for n in range(num_n_blocks) for h in range(heads_kv) for b in range(batch)]
        where = {t: i for i, t in enumerate(tiles)}
        for (n, h, b), i in where.items():
            if 0 <= n + step < num_n_blocks:
                assert where[(n + step, h, b)] < i, (order.name, n, h, b)
        group = -(-order.section_ctas // num_n_blocks)
        if num_n_blocks > 1 and heads_kv * batch >= group:
            first = 0 if step < 0 else num_n_blocks - 1
            assert where[(first - step, 0, 0)] - where[(first, 0, 0)] == group


@pytest.mark.cpu
@pytest.mark.parametrize("num_n_blocks,heads_kv,batch", [(32, 16, 8), (8, 32, 32), (128, 16, 2), (33, 5, 3)])
def test_launch_sections_with_the_estimated_division(num_n_blocks, heads_kv, batch):
    """The device maps launch indices with fast_div (an fp32 quotient from rcp.approx, corrected by
    the remainder): replayed with the reciprocal up to 2 ulp off, every order gives host_tile's floor-
    division tiles; the host refuses grids past fast_div's bound before any launch."""
    from stage4_bwd_kernel import schedule

    from stage3_fwd_kernel.intdiv import fast_div_formula

    def replay(ulps):
        def rcp(x):
            r = np.float32(1.0) / x
            for _ in range(abs(ulps)):
                r = np.nextafter(r, np.float32(np.inf if ulps > 0 else -np.inf), dtype=np.float32)
            return r

        def div(a, b):  # the kernels' formula (intdiv.fast_div) with a reciprocal `ulps` off
            return int(fast_div_formula(a, b, np.float32, rcp, int))
        return div

    ctas = num_n_blocks * heads_kv * batch
    for order in (schedule.KVAscendingSectionsOrder, schedule.KVAscendingWideSectionsOrder,
                  schedule.KVDescendingSectionsOrder):
        exact = [order.host_tile(i, num_n_blocks, heads_kv, batch) for i in range(ctas)]
        for ulps in (-2, 0, 2):
            assert [order.host_tile(i, num_n_blocks, heads_kv, batch, div=replay(ulps)) for i in range(ctas)] == exact
    schedule.KVAscendingSectionsOrder.check_grid(1 << 10, 32, 127)
    with pytest.raises(ValueError, match="fewer than 4194304 CTAs"):
        schedule.KVAscendingSectionsOrder.check_grid(1 << 10, 32, 128)


@pytest.mark.cpu
@pytest.mark.parametrize("batch,order", [(63, None), (64, "kv_ascending")])
def test_a_grid_past_the_sectioned_map_launches_in_plain_order(monkeypatch, batch, order):
    """The default causal order maps the launch index with fast_div, exact below 2^22 CTAs: a bigger
    grid (64 x 64k keys x 64 KV heads, counted in 64-key tiles) takes the plain blockIdx order instead
    of being refused after the forward ran; a smaller one keeps the default (sections: None here)."""
    import torch

    from stage4_bwd_kernel import host
    from stage4_bwd_kernel.hopper import backward

    chosen = []

    def stop(step, make_kernel, dt, d, dv, causal, deterministic, **kw):
        chosen.append(kw["dq_order"])
        raise RuntimeError("stop before compiling")
    monkeypatch.setattr(host, "compile_main", stop)
    monkeypatch.setattr(host.common, "check_backward_inputs", lambda *t, varlen=False: t)  # meta stands in for CUDA
    m = lambda *s: torch.empty(*s, device="meta", dtype=torch.bfloat16)  # noqa: E731
    q = m(batch, 65536, 64, 128)
    with pytest.raises(RuntimeError, match="stop before compiling"):
        backward.attention_backward(q, q, q, q, q, torch.empty(batch, 64, 65536, device="meta"), causal=True)
    assert getattr(chosen[0], "name", None) == order


@pytest.mark.cpu
def test_launch_sections_remove_the_chain_stall():
    """With increments seen a step late (a writer hop), CTAs launched side by side along one chain
    stall behind each other; in sections they do not (on the H100, d = 64 non-causal: 0.70-0.75x ->
    0.89-0.92x of the default's speed with one-wave sections, stage 4 README)."""
    from stage4_bwd_kernel import schedule
    from stage4_bwd_kernel.model import simulate_semaphores

    kw = dict(seqlen_q=1024, seqlen_k=1024, tile_m=128, tile_n=128, causal=False, batch=8, heads_kv=32, hop=1)
    plain = simulate_semaphores(order=schedule.KVAscendingOrder, **kw)
    sections = simulate_semaphores(order=schedule.KVAscendingSectionsOrder, **kw)
    ideal = simulate_semaphores(order=schedule.KVAscendingOrder, **{**kw, "hop": 0})
    assert plain.finished and sections.finished and ideal.stall_steps == 0
    assert plain.steps > 1.25 * ideal.steps
    assert sections.steps < 1.05 * ideal.steps and sections.stall_steps < plain.stall_steps / 5


@pytest.mark.cpu
def test_descending_order_removes_causal_first_write_stalls():
    from stage4_bwd_kernel import schedule
    from stage4_bwd_kernel.model import simulate_semaphores

    kw = dict(seqlen_q=4096, seqlen_k=4096, tile_m=128, tile_n=128, causal=True, batch=2, heads_kv=4, resident=132)
    asc = simulate_semaphores(order=schedule.KVAscendingOrder, **kw)
    desc = simulate_semaphores(order=schedule.KVDescendingOrder, **kw)
    assert asc.finished and desc.finished
    assert asc.first_write_stalls > 0 and desc.first_write_stalls == 0
    assert desc.steps < asc.steps
    assert schedule.default_dq_order(True, True) is schedule.KVDescendingSectionsOrder
    assert schedule.default_dq_order(True, True, sections=False) is schedule.KVDescendingOrder
    assert schedule.default_dq_order(False, True) is schedule.KVAscendingSectionsOrder
    assert schedule.default_dq_order(False, True, head_dim=128) is schedule.KVAscendingSectionsOrder
    assert schedule.default_dq_order(False, True, head_dim=64) is schedule.KVAscendingWideSectionsOrder
    assert schedule.default_dq_order(True, True, head_dim=64) is schedule.KVDescendingSectionsOrder
    assert schedule.default_dq_order(False, True, sections=False) is schedule.KVAscendingOrder
    # default mode: causal launches in sections (the tail), non-causal keeps blockIdx order
    assert schedule.default_dq_order(True, False) is schedule.KVAscendingSectionsOrder
    assert schedule.default_dq_order(True, False, sections=False) is schedule.KVAscendingOrder
    assert schedule.default_dq_order(False, False) is schedule.KVAscendingOrder
    # ... except at head dim <= 64, in two-wave sections (the deterministic mode's d = 64 order)
    assert schedule.default_dq_order(False, False, head_dim=64) is schedule.KVAscendingWideSectionsOrder
    assert schedule.default_dq_order(False, False, head_dim=96) is schedule.KVAscendingOrder
    assert schedule.default_dq_order(False, False, head_dim=64, sections=False) is schedule.KVAscendingOrder


@pytest.mark.cpu
@pytest.mark.parametrize("seqlen", [1024, 2048, 4096, 8192, 16384])
def test_causal_sections_launch_long_walks_earlier(seqlen):
    """The default-mode causal order launches every K/V tile once (a bijection on the grid), is the
    blockIdx order itself at 16k (sections of one head), and finishes a list schedule of the walks
    strictly earlier at 1k-8k, the tail it was chosen for."""
    from stage4_bwd_kernel import schedule
    from stage4_bwd_kernel.model import default_mode_steps, launch_tiles

    order = schedule.default_dq_order(True, False)
    heads, batch, tm, tn = 16, 32768 // seqlen, 80, 128
    n_blocks = seqlen // tn
    tiles = launch_tiles(order, n_blocks, heads, batch)
    assert sorted(tiles) == [(n, h, b) for n in range(n_blocks) for h in range(heads) for b in range(batch)]
    plain_tiles = launch_tiles(schedule.KVAscendingOrder, n_blocks, heads, batch)
    steps = {o: default_mode_steps(seqlen_q=seqlen, seqlen_k=seqlen, tile_m=tm, tile_n=tn, causal=True, order=o,
                                   batch=batch, heads_kv=heads) for o in (order, schedule.KVAscendingOrder)}
    sectioned, plain = steps[order], steps[schedule.KVAscendingOrder]
    if seqlen == 16384:
        assert [n for n, _, _ in tiles] == [n for n, _, _ in plain_tiles] and sectioned == plain
    else:
        assert sectioned < plain


@pytest.mark.cpu
def test_schedule_bounds_agree_with_visibility():
    """m_block_range and n_block_last are inverse views of one visibility relation."""
    from stage4_bwd_kernel import schedule

    for tm, tn in ((64, 128), (128, 64), (64, 64)):
        for sq, sk in ((1, 1), (100, 1000), (1000, 100), (513, 513), (1, 700)):
            n_blocks, m_blocks = -(-sk // tn), -(-sq // tm)
            for n in range(n_blocks):
                lo, hi = schedule.m_block_range(n, tm, tn, sq, sk, True)
                for m in range(m_blocks):
                    visible = n * tn <= (m + 1) * tm - 1 + sk - sq
                    assert (lo <= m < hi) == visible
                    if visible:
                        assert n <= schedule.n_block_last(m, tm, tn, sq, sk, True)


@pytest.mark.cpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_column_key_limit_is_the_first_masked_key_row(causal):
    """Step 3's masked body (column_limit) tests each score against one limit per query column: key row r
    of column c must be masked exactly when is_masked says so, over every tile of odd shapes."""
    from stage4_bwd_kernel import schedule

    for tm, tn in ((80, 128), (128, 128), (64, 128)):
        for sq, sk in ((1, 1), (113, 203), (203, 113), (799, 3), (3, 799), (1000, 1500)):
            for n in range(-(-sk // tn)):
                for m in range(-(-sq // tm)):
                    key_limit, diag = schedule.mask_bounds(m, n, tm, tn, sq, sk)
                    for c in range(tm):
                        limit = schedule.column_key_limit(c, key_limit, diag, causal)
                        masked = [bool(schedule.is_masked(r, c, key_limit, diag, causal)) for r in range(tn)]
                        assert masked == [r >= limit for r in range(tn)], (tm, tn, sq, sk, n, m, c)


@pytest.mark.cpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_unmasked_m_range_is_exactly_the_tiles_without_a_masked_element(causal):
    """Step 3 compiles its tile body without the mask for [lo, hi): every tile there must be free
    of masked elements (else wrong gradients), and every tile outside must have one (else the hot
    loop is shorter than it could be); the segments must cover the walk in order."""
    from stage4_bwd_kernel import schedule

    for tm, tn in ((64, 128), (128, 128), (64, 64), (64, 96)):  # 64 x 96: the (192, 128) backward's tile
        for sq, sk in ((1, 1), (64, 128), (128, 64), (113, 203), (1000, 100), (100, 1000), (513, 513), (640, 768)):
            for n in range(-(-sk // tn)):
                m_min, m_max = schedule.m_block_range(n, tm, tn, sq, sk, causal)
                lo, hi = schedule.unmasked_m_range(n, tm, tn, sq, sk, causal, m_min, m_max)
                assert m_min <= lo <= hi <= m_max, (tm, tn, sq, sk, n, lo, hi)
                for m in range(m_min, m_max):
                    key_limit, diag = schedule.mask_bounds(m, n, tm, tn, sq, sk)
                    any_masked = any(schedule.is_masked(r, c, key_limit, diag, causal) or c >= sq - m * tm
                                     for r in range(tn) for c in range(tm))
                    assert (lo <= m < hi) == (not any_masked), (tm, tn, sq, sk, n, m, lo, hi)


def _cpu_tensors(torch, b=1, s=8, h=2, d=64, dtype=None):
    dtype = dtype or torch.bfloat16
    q = torch.zeros(b, s, h, d, dtype=dtype)
    return q, q.clone(), q.clone(), q.clone(), q.clone(), torch.zeros(b, h, s)


@pytest.mark.cpu
def test_bad_inputs_name_the_argument():
    torch = pytest.importorskip("torch")
    from stage4_bwd_kernel import hopper

    q, k, v, o, do, lse = _cpu_tensors(torch)
    with pytest.raises(ValueError, match="q: expected rank 4"):
        hopper.attention_backward(q[0], k, v, o, do, lse)
    with pytest.raises(TypeError, match="k: expected dtype"):
        hopper.attention_backward(q, k.half(), v, o, do, lse)
    with pytest.raises(TypeError, match="q: expected dtype"):
        hopper.attention_backward(q.float(), k.float(), v.float(), o.float(), do.float(), lse)
    with pytest.raises(TypeError, match="lse: expected dtype float32"):
        hopper.attention_backward(q, k, v, o, do, lse.double())
    with pytest.raises(ValueError, match="lse: expected shape"):
        hopper.attention_backward(q, k, v, o, do, lse[:, :, :4])
    with pytest.raises(ValueError, match="head_dim"):
        q2, k2, v2, o2, do2, l2 = _cpu_tensors(torch, d=80)
        hopper.attention_backward(q2, k2, v2, o2, do2, l2)
    with pytest.raises(ValueError, match="heads_kv"):
        k3 = torch.zeros(1, 8, 3, 64, dtype=torch.bfloat16)
        q3 = torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16)
        hopper.attention_backward(q3, k3, k3.clone(), q3.clone(), q3.clone(), torch.zeros(1, 4, 8))
    with pytest.raises(ValueError, match="dout: expected shape"):
        hopper.attention_backward(q, k, v, o, do[:, :4], lse)
    with pytest.raises(TypeError, match="causal: expected a bool"):
        hopper.attention_backward(q, k, v, o, do, lse, causal=1)
    with pytest.raises(ValueError, match="expected a CUDA tensor"):
        hopper.attention_backward(q, k, v, o, do, lse)
    with pytest.raises(TypeError, match="v: expected a torch.Tensor"):
        hopper.attention_backward(q, k, [1], o, do, lse)


@pytest.mark.cpu
def test_bad_varlen_inputs_name_the_argument():
    torch = pytest.importorskip("torch")
    from stage4_bwd_kernel import hopper

    q = torch.zeros(10, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(2, 10)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="q: expected rank 3"):
        hopper.attention_varlen_backward(q[None], q, q, q, q, lse, cu, cu, 6, 6)
    with pytest.raises(ValueError, match="lse: expected shape"):
        hopper.attention_varlen_backward(q, q, q, q, q, lse.T, cu, cu, 6, 6)


# ============================================================================== compile tier
STEPS = ["hopper_step1", "hopper_step2_warpspec"]


def _step(name):
    pytest.importorskip("stage4_bwd_kernel.common")  # skips where cutlass is missing
    import importlib

    return importlib.import_module(f"stage4_bwd_kernel.{name}")


def _expected_hgmma(d, dv, tm, tn):
    """wgmma instructions per Q tile: one per (64-row M block, 16-deep k block) of each GEMM
    (each warpgroup issues its own N half, which is the same instruction count)."""
    return ((tn // 64) * (d // 16) + (tn // 64) * (dv // 16) + 2 * (tn // 64) * (tm // 16)
            + (tm // 64) * (tn // 16))


# Step 1: every head dim in both dtypes with causal and deterministic varied, plus varlen /
# seqused_k: 14 compiles (~5 s each on 2 cores). Step 2: every head dim once (bf16) plus varlen.
# `python -m stage4_bwd_kernel.compile_all` runs the full matrix.
COMPILE_CASES = [("hopper_step1", dt, d, dv, (i + j) % 2 == 0, (i + 2 * j) % 3 == 0, False, False)
                 for i, (d, dv) in enumerate(HEAD_DIMS) for j, dt in enumerate(("bf16", "fp16"))]
COMPILE_CASES += [("hopper_step1", "bf16", 128, 128, True, True, False, False),
                  ("hopper_step1", "bf16", 128, 128, False, False, False, False),
                  ("hopper_step1", "bf16", 128, 128, True, True, True, True),
                  ("hopper_step1", "fp16", 64, 64, False, False, True, False)]
COMPILE_CASES += [("hopper_step2_warpspec", "bf16", d, dv, i % 2 == 0, i % 2 == 1, False, False)
                  for i, (d, dv) in enumerate(HEAD_DIMS)]
COMPILE_CASES += [("hopper_step2_warpspec", "fp16", 128, 128, True, True, True, True)]
COMPILE_IDS = [f"{st}-{dt}-d{d}x{dv}-{'causal' if c else 'full'}-{'det' if det else 'atomic'}"
               f"{'-varlen' if vl else ''}{'-seqused' if su else ''}" for st, dt, d, dv, c, det, vl, su in COMPILE_CASES]


@pytest.mark.compile
@pytest.mark.parametrize("step,dtype,d,dv,causal,det,varlen,seqused", COMPILE_CASES, ids=COMPILE_IDS)
def test_main_kernel_compiles_sm90a(step, dtype, d, dv, causal, det, varlen, seqused):
    mod = _step(step)
    comp = mod.compile_only(dtype=dtype, head_dim=d, head_dim_v=dv, causal=causal, deterministic=det,
                            varlen=varlen, has_seqused_k=seqused)
    rep, sass, ptx = comp.report, comp.sass, comp.ptx
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, f"spills: {rep}"
    assert rep["stack_frame"] == 0 and rep["LDL/STL"] == 0, f"local memory: {rep}"
    assert rep["registers"] is not None and rep["registers"] <= 255
    assert rep["smem_bytes"] is not None and rep["smem_bytes"] <= 227 * 1024
    assert "C7508" not in rep["ptxas_log"] and "C7510" not in rep["ptxas_log"], rep["ptxas_log"]
    assert rep["wgmma_serialized"] == [], rep["ptxas_log"]
    tm, tn = mod.default_tiles(d, dv)
    assert rep["HGMMA"] == _expected_hgmma(d, dv, tm, tn), "not the five GEMMs on the wgmma path"
    if step == "hopper_step1":
        assert rep["threads"] == 256 and rep["LDGSTS"] > 0
    else:  # producer warpgroup + 2 consumers, TMA loads, registers moved by setmaxnreg
        assert rep["threads"] == 384 and rep["UTMALDG"] and rep["UTMALDG"] > 0 and rep["LDGSTS"] == 0
        assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    # dQ: 8-byte fp32 reductions, tm * d / 256 / 2 per thread per tile
    reds = re.findall(r"\bREDG\.E\.ADD\.F32x2\S*", sass)
    assert len(reds) == tm * d // 256 // 2, reds[:3]
    # semaphores only in deterministic mode: acquire spin, then fence + relaxed add as the release
    has_sem = ("ld.global.acquire.gpu.b32" in ptx, "fence.acq_rel.gpu" in ptx,
               "red.relaxed.gpu.global.add.s32" in ptx)
    assert has_sem == (det, det, det)
    if det:
        assert re.search(r"\bLDG\.E\.STRONG\.GPU\b", sass), "no acquire load in SASS"
        assert re.search(r"\bMEMBAR\.\S*GPU\b", sass), "no GPU-scope fence in SASS"
        assert re.search(r"\bREDG?\.E\.ADD\.S32\.STRONG\.GPU\b", sass), "no semaphore increment in SASS"
        assert _has_spin_loop(sass), "no spin loop around the acquire load"


def _has_spin_loop(sass: str) -> bool:
    """Some block that holds an acquire load (LDG.E.STRONG.GPU) is the target of a later branch."""
    lines = sass.splitlines()
    labels = {}
    for i, line in enumerate(lines):
        m = re.match(r"\s*\.(L_x_\d+):", line)
        if m:
            labels[m.group(1)] = i
    for i, line in enumerate(lines):
        m = re.search(r"\bBRA\b.*`?\(\.(L_x_\d+)\)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            body = "\n".join(lines[labels[m.group(1)]:i])
            if "LDG.E.STRONG.GPU" in body:
                return True
    return False


@pytest.mark.compile
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_pre_and_postprocess_compile(varlen):
    pytest.importorskip("stage4_bwd_kernel.common")  # skips where cutlass is missing
    from stage4_bwd_kernel import postprocess, preprocess

    for d in (96, 128):
        for mod, comp in (("pre", preprocess.compile_only("bf16", d, varlen=varlen)),
                          ("pre", preprocess.compile_only("bf16", d, varlen=varlen, dq_zeroing="flat")),
                          ("post", postprocess.compile_only("fp16", d, varlen=varlen))):
            rep = comp.report
            assert rep["spill_stores"] == 0 and rep["LDL/STL"] == 0, (mod, rep)
            assert re.search(r"\bLDG\.E\.128\b", comp.sass), f"{mod}: no 16-byte loads"
            if mod == "pre":
                assert re.search(r"\bSTG\.E\.128\b", comp.sass), "dQ accumulator not zeroed with 16-byte stores"
                assert re.search(r"\bSHFL\.BFLY\b", comp.sass), "row sum not reduced across lanes"


@pytest.mark.compile
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_preprocess_build_also_shifts_d_by_dlse(varlen):
    """The one preprocess build also shifts D by a gradient through lse (its runtime with_dlse flag):
    a barrier after the D stores, then the thread that reads a row's lse reads that row's D and dlse
    (three 4-byte loads, plus varlen's two cu_seqlens_q loads), and nothing spills."""
    pytest.importorskip("stage4_bwd_kernel.common")
    from stage4_bwd_kernel import preprocess

    for d in (64, 128, 256):
        for zeroing in ("rows", "flat"):
            comp = preprocess.compile_only("bf16", d, varlen=varlen, dq_zeroing=zeroing)
            assert comp.report["spill_stores"] == 0 and comp.report["LDL/STL"] == 0, (d, comp.report)
            scalar_loads = len(re.findall(r"\bLDG\.E(?:\.CONSTANT)?\s", comp.sass))
            assert scalar_loads == 3 + 2 * varlen and re.search(r"\bBAR\.SYNC", comp.sass), (d, scalar_loads)


@pytest.mark.compile
def test_descending_order_compiles_without_semaphores_when_not_deterministic():
    s1 = _step("hopper_step1")
    from stage4_bwd_kernel import schedule

    comp = s1.compile_only(dtype="bf16", head_dim=64, causal=True, deterministic=False,
                           dq_order=schedule.KVDescendingOrder)
    assert "ld.global.acquire.gpu" not in comp.ptx and comp.report["spill_stores"] == 0


# ================================================================================== gpu tier
SEQLENS = [(1, 1), (1, 3), (113, 203), (239, 1), (799, 3), (1024, 1024), (4224, 4224)]


def _tdt(dtype):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def _inputs(b, sq, sk, hq, hkv, d, dv, dtype="bf16", seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    t = _tdt(dtype)
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=t, generator=g)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=t, generator=g)
    v = torch.randn(b, sk, hkv, dv, device="cuda", dtype=t, generator=g)
    do = torch.randn(b, sq, hq, dv, device="cuda", dtype=t, generator=g)
    return q, k, v, do


def _poisoned(*likes):
    import torch

    return [torch.full_like(t, float("nan")) for t in likes]


def _check_dense(step, *, b, sq, sk, hq, hkv, d, dv, causal, dtype="bf16", deterministic=False,
                 softmax_scale=None, inputs=None, forward="ref", tiles=None):
    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref, grad_atol
    from stage4_bwd_kernel import host

    mod = _step(step)
    q, k, v, do = inputs or _inputs(b, sq, sk, hq, hkv, d, dv, dtype)
    if forward == "ref":
        out, lse = attention_ref(q, k, v, causal=causal, softmax_scale=softmax_scale, upcast=True)
    else:  # the stage-3 Hopper forward, verified on an H100
        out, lse = host.forward_for_test(q, k, v, causal=causal, softmax_scale=softmax_scale)
    dq, dk, dv_ = _poisoned(q, k, v)
    mod.attention_backward(q, k, v, out, do, lse, causal=causal, deterministic=deterministic,
                           softmax_scale=softmax_scale, dq=dq, dk=dk, dv=dv_, **({"tiles": tiles} if tiles else {}))
    torch.cuda.synchronize()
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv_)):
        assert not torch.isnan(t).any(), f"NaN in {name}: unwritten rows or NaN math"
    ref, base = host.reference_grads(q, k, v, do, causal=causal, softmax_scale=softmax_scale)
    for name, a, r, bl in zip(("dq", "dk", "dv"), (dq, dk, dv_), ref, base):
        assert_fa4_close(name, a, r, bl, atol=grad_atol(ref))
    return dq, dk, dv_


def _heads(sq, sk, d):
    """GQA ratio 1 / 2 / 8 cycled over the cases; small heads for the big ones (fp32 reference)."""
    if sq * sk > 2_000_000:
        return 1, 2, 2 // [1, 2][(sq // 128 + d // 32) % 2]
    hq = 8
    return 2, hq, hq // [1, 2, 8][(sq + sk + d) % 3]


@pytest.mark.gpu
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("d,dv", HEAD_DIMS, ids=[f"d{d}x{dv}" for d, dv in HEAD_DIMS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
def test_backward_matches_reference(step, d, dv, causal, sq, sk):
    b, hq, hkv = _heads(sq, sk, d)
    _check_dense(step, b=b, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, dv=dv, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("ratio", [1, 2, 8])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_ratios(step, ratio, causal):
    _check_dense(step, b=2, sq=300, sk=517, hq=8, hkv=8 // ratio, d=128, dv=128, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp16(step, causal):
    _check_dense(step, b=2, sq=333, sk=1000, hq=4, hkv=2, d=128, dv=128, causal=causal, dtype="fp16")


@pytest.mark.gpu
@pytest.mark.parametrize("step", STEPS)
def test_fully_masked_rows_and_scale_and_strides(step):
    """causal with Sq > Sk: rows that see no key have lse = -inf and zero dq; a non-default scale;
    q/k/v as strided views of a packed qkv buffer."""
    import torch

    b, s, h, d = 2, 300, 4, 64
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)
    do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    _check_dense(step, b=b, sq=s, sk=s, hq=h, hkv=h, d=d, dv=d, causal=True, softmax_scale=0.3,
                 inputs=(q, k, v, do))
    q2, k2, v2, do2 = _inputs(2, 300, 70, 4, 4, 64, 64)
    dq, _, _ = _check_dense(step, b=2, sq=300, sk=70, hq=4, hkv=4, d=64, dv=64, causal=True,
                            inputs=(q2, k2, v2, do2))
    assert torch.all(dq[:, : 300 - 70] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_chain_with_stage3_forward(step, causal):
    """out / lse straight from the stage-3 Hopper forward kernel (its lse format, -inf rows)."""
    _check_dense(step, b=2, sq=517, sk=300, hq=8, hkv=2, d=128, dv=128, causal=causal, forward="stage3")


def _varlen_inputs(lens_q, lens_k, hq, hkv, d, dtype="bf16", seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    t = _tdt(dtype)
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=t, generator=g)
    k = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=t, generator=g)
    v = torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=t, generator=g)
    do = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=t, generator=g)
    return q, k, v, do, cu_q, cu_k


VARLEN = ([0, 5, 130, 64, 1, 0, 700], [3, 0, 200, 64, 7, 0, 650])
VARLEN_CASES = [(False, False), (True, False), (False, True)]  # (seqused_k, deterministic)


@pytest.mark.gpu
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqused,deterministic", VARLEN_CASES,
                         ids=["all-keys", "seqused_k", "deterministic"])
def test_varlen_with_empty_sequences(step, causal, seqused, deterministic):
    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_varlen_ref, grad_atol
    from stage4_bwd_kernel import host

    mod = _step(step)
    lens_q, lens_k = VARLEN
    q, k, v, do, cu_q, cu_k = _varlen_inputs(lens_q, lens_k, 8, 2, 128)
    used = None
    if seqused:
        used_list = [min(n, u) for n, u in zip(lens_k, [2, 0, 150, 64, 7, 0, 333])]
        used = torch.tensor(used_list, dtype=torch.int32, device="cuda")
        keep = torch.cat([torch.arange(int(cu_k[i]), int(cu_k[i]) + u, device="cuda") for i, u in enumerate(used_list)])
        cu_used = torch.tensor(np.cumsum([0] + used_list), dtype=torch.int32, device="cuda")
        out, lse = attention_varlen_ref(q, k[keep], v[keep], cu_q, cu_used, causal=causal, upcast=True)
    else:
        out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, upcast=True)
    dq, dk, dv = mod.attention_varlen_backward(q, k, v, out, do, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                               seqused_k=used, causal=causal, deterministic=deterministic)
    torch.cuda.synchronize()
    ref, base = host.reference_varlen_grads(q, k, v, do, cu_q, cu_k, seqused_k=used, causal=causal)
    for name, a, r, bl in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, base):
        assert not torch.isnan(a).any(), name
        assert_fa4_close(name, a, r, bl, atol=grad_atol(ref))
    if seqused:  # keys past seqused_k get exactly zero gradient
        for i, u in enumerate(used.tolist()):
            assert torch.all(dk[int(cu_k[i]) + u: int(cu_k[i + 1])] == 0)
            assert torch.all(dv[int(cu_k[i]) + u: int(cu_k[i + 1])] == 0)


DET_CASES = [(False, 1), (True, 1), (True, 4), (False, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("causal,ratio", DET_CASES, ids=[f"{'causal' if c else 'full'}-gqa{r}" for c, r in DET_CASES])
def test_deterministic_is_bitwise_reproducible(step, causal, ratio):
    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref, grad_atol
    from stage4_bwd_kernel import host

    mod = _step(step)
    q, k, v, do = _inputs(2, 1000, 1200, 8, 8 // ratio, 128, 128, seed=3)
    out, lse = attention_ref(q, k, v, causal=causal, upcast=True)
    first = [t.clone() for t in mod.attention_backward(q, k, v, out, do, lse, causal=causal, deterministic=True)]
    ref, base = host.reference_grads(q, k, v, do, causal=causal)
    for name, a, r, bl in zip(("dq", "dk", "dv"), first, ref, base):
        assert_fa4_close(name, a, r, bl, atol=grad_atol(ref))
    dq, dk, dv = _poisoned(q, k, v)
    for _ in range(100):
        for t in (dq, dk, dv):  # poisoned before every run: a row a run leaves unwritten cannot keep the last one's
            t.fill_(float("nan"))
        mod.attention_backward(q, k, v, out, do, lse, causal=causal, deterministic=True, dq=dq, dk=dk, dv=dv)
        assert torch.equal(dq, first[0]) and torch.equal(dk, first[1]) and torch.equal(dv, first[2])
    # the default (atomic) mode: dq within the tolerance; dk / dv bitwise equal (no atomics there)
    nd = mod.attention_backward(q, k, v, out, do, lse, causal=causal, deterministic=False)
    assert_fa4_close("dq (atomic)", nd[0], ref[0], base[0], atol=grad_atol(ref))
    assert torch.equal(nd[1], first[1]) and torch.equal(nd[2], first[2])


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", [(128, 128), (192, 128)], ids=["d128", "d192x128"])
def test_public_api_serves_the_production_kernel(d, dv):
    """stage4_bwd_kernel.hopper.attention_backward (what fa4 calls) meets the FA4 rule, narrow and wide."""
    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref, grad_atol
    from stage4_bwd_kernel import hopper, host

    assert hopper.BEST_STEP == hopper.STEP
    q, k, v, do = _inputs(1, 200, 300, 4, 2, d, dv, seed=5)
    out, lse = attention_ref(q, k, v, causal=True, upcast=True)
    dq, dk, dv_ = _poisoned(q, k, v)
    hopper.attention_backward(q, k, v, out, do, lse, causal=True, dq=dq, dk=dk, dv=dv_)
    torch.cuda.synchronize()
    ref, base = host.reference_grads(q, k, v, do, causal=True)
    for name, a, r, bl in zip(("dq", "dk", "dv"), (dq, dk, dv_), ref, base):
        assert_fa4_close(name, a, r, bl, atol=grad_atol(ref))


@pytest.mark.gpu
@pytest.mark.parametrize("step", STEPS)
def test_run_entry_point_times_both_modes(step):
    res = _step(step).run(batch=1, seqlen_q=1024, heads=4, head_dim=128, causal=True, check=True)
    assert res["mode"] == "gpu" and res["tflops"] > 0 and res["ms_deterministic"] > 0


@pytest.mark.cpu
def test_varlen_stats_rows_start_aligned_and_never_overlap(rng):
    from stage4_bwd_kernel.common import stats_offset

    for trial in range(200):
        lens = rng.integers(0, 9 if trial % 2 else 300, size=rng.integers(1, 12)).tolist()
        cu = np.cumsum([0] + lens)
        starts = [stats_offset(int(cu[b]), b) for b in range(len(lens))]
        assert all(s % 4 == 0 for s in starts), starts  # 16-byte aligned fp32 rows (TMA)
        ends = [s + n for s, n in zip(starts, lens)]
        assert all(e <= s for e, s in zip(ends, starts[1:])), (lens, starts)
        rows = stats_offset(int(cu[-1]), len(lens))  # what the preprocess allocates
        assert ends[-1] <= rows and rows % 4 == 0


@pytest.mark.cpu
def test_preprocess_refuses_a_flat_accumulator_it_cannot_zero_in_16_byte_stores():
    torch = pytest.importorskip("torch")
    from stage4_bwd_kernel import preprocess

    out = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 8)
    for acc, head_dim, what in ((torch.zeros(6), 64, "multiple of"), (torch.zeros(8, 2)[:, 0], 64, "contiguous"),
                                (torch.zeros(8), None, "head_dim"), (torch.zeros(8), 64, "dq_zeroing")):
        mode = "rows-and-flat" if what == "dq_zeroing" else "flat"
        with pytest.raises(ValueError, match=what):
            preprocess.preprocess(out, out, lse, acc, head_dim=head_dim, dq_zeroing=mode)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [None, [0, 5, 130, 1, 0, 70], [0, 0, 3]], ids=["dense", "varlen", "mostly-empty"])
def test_preprocess_zeroes_a_flat_accumulator_everywhere(lens):
    """dq_zeroing="flat" (the fragment-order accumulator): every element of a NaN-poisoned buffer is 0
    afterwards, whatever its length against the grid's shares, and CTAs of empty sequences zero theirs."""
    import torch
    from stage4_bwd_kernel import preprocess

    heads, d = 3, 64
    if lens is None:
        out, dout = (torch.randn(2, 77, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lse, kw = torch.randn(2, heads, 77, device="cuda"), {}
    else:
        total = sum(lens)
        out, dout = (torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lse = torch.randn(heads, total, device="cuda")
        kw = dict(cu_seqlens_q=torch.tensor(np.cumsum([0] + lens), dtype=torch.int32, device="cuda"),
                  max_seqlen_q=max(lens))
    for elems in (4, 4 * 997, 3 * 80 * 64 * 7 + 4):
        acc = torch.full((elems,), float("nan"), device="cuda")
        preprocess.preprocess(out, dout, lse, acc, head_dim=d, dq_zeroing="flat", **kw)
        assert torch.count_nonzero(acc).item() == 0 and not acc.isnan().any(), elems


@pytest.mark.gpu
def test_preprocess_varlen_rows_at_their_aligned_offsets():
    """Varlen lse2 / D: sequence b's rows at common.stats_offset, every other row 0 (the tiles that
    run past a sequence load them)."""
    import math

    import torch
    from stage4_bwd_kernel import preprocess
    from stage4_bwd_kernel.common import stats_offset

    lens = [0, 5, 130, 1, 0, 70]
    cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32, device="cuda")
    out, dout = (torch.randn(sum(lens), 3, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lse = torch.randn(3, sum(lens), device="cuda")
    lse[:, ::7] = float("-inf")
    lse2, dpsum = preprocess.preprocess(out, dout, lse, torch.empty(sum(lens), 3, 64, device="cuda"),
                                        cu_seqlens_q=cu, max_seqlen_q=max(lens))
    ref_d = (out.float() * dout.float()).sum(-1).t()                         # (H, T)
    ref_l2 = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse * math.log2(math.e))
    seen = torch.zeros(lse2.shape[1], dtype=torch.bool, device="cuda")
    for b, n in enumerate(lens):
        a, s = int(cu[b]), stats_offset(int(cu[b]), b)
        torch.testing.assert_close(lse2[:, s:s + n], ref_l2[:, a:a + n])
        torch.testing.assert_close(dpsum[:, s:s + n], ref_d[:, a:a + n], rtol=1e-5, atol=1e-4)
        seen[s:s + n] = True
    assert torch.all(lse2[:, ~seen] == 0) and torch.all(dpsum[:, ~seen] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [None, [0, 5, 130, 1, 0, 70]], ids=["dense", "varlen"])
def test_preprocess_stores_d_minus_dlse_where_a_row_sees_a_key(lens):
    """preprocess(dlse=...): D - dlse in fp32 (bitwise what torch subtracts from the plain build's D)
    on rows with lse > -inf, D itself on rows with lse = -inf even where dlse is inf, any dlse dtype
    and strides. Varlen: the padding rows stay 0, and tokens past cu_seqlens_q[-1] are neither read
    nor mapped outside the buffer by the gather that hands D back (host._d_in_lse_layout)."""
    import torch
    from stage4_bwd_kernel import host, preprocess

    heads, d = 3, 64
    if lens is None:
        out, dout = (torch.randn(2, 77, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lse, kw = torch.randn(2, heads, 77, device="cuda"), {}
        acc = lambda: torch.empty(2, 77, heads, d, device="cuda")  # noqa: E731
    else:
        total = sum(lens) + 3  # three tokens past the last offset
        out, dout = (torch.randn(total, heads, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lse = torch.randn(heads, total, device="cuda")
        kw = dict(cu_seqlens_q=torch.tensor(np.cumsum([0] + lens), dtype=torch.int32, device="cuda"),
                  max_seqlen_q=max(lens))
        acc = lambda: torch.empty(total, heads, d, device="cuda")  # noqa: E731
    lse[..., ::7] = float("-inf")
    scale = torch.tensor([1e-3, 1.0, 7e4, 3e6], device="cuda").repeat(lse.shape[-1] // 4 + 1)[:lse.shape[-1]]
    dlse32 = torch.randn_like(lse) * scale
    dlse32[..., ::7] = float("inf")                    # rows with no key: must not reach D
    _, plain = preprocess.preprocess(out, dout, lse, acc(), **kw)
    for dlse in (dlse32, dlse32.transpose(-1, -2).contiguous().transpose(-1, -2), dlse32.to(torch.bfloat16)):
        _, got = preprocess.preprocess(out, dout, lse, acc(), dlse=dlse, **kw)
        shift = torch.where(torch.isneginf(lse), 0.0, dlse.float())
        if lens is None:
            assert torch.equal(got, plain - shift)
            continue
        valid = sum(lens)
        at = host._varlen_d_rows(lse[:, :valid], kw["cu_seqlens_q"], plain.shape[-1])
        want = plain.clone()
        want[:, at] -= shift[:, :valid]
        assert torch.equal(got, want)                                   # padding rows too (0 in both)
        gathered = host._d_in_lse_layout(got, lse, kw["cu_seqlens_q"])   # tokens past the end: no fault
        assert torch.equal(gathered[:, :valid], want[:, at])


@pytest.mark.gpu
def test_pre_and_postprocess_run_entry_points():
    from stage4_bwd_kernel import postprocess, preprocess

    assert preprocess.run(batch=2, seqlen=1000, heads=4, head_dim=128)["mode"] == "gpu"
    assert postprocess.run(batch=2, seqlen=1000, heads=4, head_dim=96)["mode"] == "gpu"
