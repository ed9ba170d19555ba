"""Stage 4, Blackwell (sm_100a): the 2-CTA backward, checked without hardware.

No Blackwell GPU exists in this project; these tests are the whole verification of
stage4_bwd_kernel/blackwell_bwd_2cta.py.

cpu tier: the per-CTA TMEM / SMEM plan (blackwell_config.blackwell_bwd_2cta_config) against budgets
computed by hand here, refusals that name the budget, and the pair-level schedule (the pair acts as
one 256-key K/V tile for the walk bounds and the deterministic ranks): every CTA's own Q tiles are
inside its pair's walk, the semaphore simulation of stage 4's model finishes without deadlock, and
the causal SPT order (KV descending) stalls less than the ascending one.

compile tier: all eight {d 64, 128} x {causal} x {deterministic} bf16 configurations compile for
sm_100a with a cluster launch (~5 s each on 2 cores, cached at module scope). The SASS must hold only
CTA-pair MMAs (UTCHMMA.2CTA: S^T, dP^T, dQ from SMEM descriptors; dV, dK with A in TMEM) and 2-SM
TMA loads (UTMALDG.*.2CTA); the PTX the CTA-pair forms (tcgen05.mma/alloc/commit .cta_group::2, the
commits multicast to both CTAs), the barrier address of the 2-SM TMA masked to the even CTA, the dS
exchange (mapa + cp.async.bulk.shared::cluster = SASS UBLKCP.S.S, remote mbarrier arrives =
SYNCS.ARRIVE.TRANS64.RED), the cluster barrier before exit (UCGABAR), half the dQ atomics of the
1-CTA kernel, in deterministic mode the semaphore spin loop, and no local memory anywhere.
"""
from __future__ import annotations

import re

import pytest

import test_stage4_hopper as s4  # shared SASS helpers (pytest puts tests/ on the path)

from stage4_bwd_kernel.blackwell_config import (SMEM_CAPACITY, TMEM_COLUMNS, blackwell_bwd_2cta_config,
                                                blackwell_bwd_config)

KB = 1024


# ---------------------------------------------------------------------------------------- cpu tier
@pytest.mark.cpu
@pytest.mark.stage4
def test_d128_plan_per_cta():
    c = blackwell_bwd_2cta_config(128, 128, "bf16", causal=True)
    t = c.tmem
    assert c.cta_group == 2 and (c.tile_m, c.tile_n) == (128, 128)
    # S/P/dQ 128 + dV 128 + dP/dS 128 + dK 128: all 512 columns, as in the 1-CTA plan
    assert (t.s, t.dv, t.dp, t.dk) == (0, 128, 256, 384)
    assert t.used == t.alloc == TMEM_COLUMNS == 512
    # P^T (16-bit) in [0, 64) and dQ (64 rows = 128 lanes x 64 columns) in [64, 128) share the S region;
    # dS^T (16-bit) is written over dP^T
    assert (t.p, t.p_cols, t.dq, t.dq_cols) == (0, 64, 64, 64)
    assert t.dq + t.dq_cols <= t.s + t.s_cols
    assert t.ds == t.dp
    # SMEM: 1 KB header + K, V, Kt (32 KB each) + one stage of the four B halves (16 KB each)
    #       + sdS (64 rows x 256 keys, 32 KB) + sXchg (16 KB) + lse2/D (1 KB)
    assert c.qdo_stages == 1
    s = c.smem
    assert (s.k, s.v, s.kt, s.q, s.do, s.qt, s.dot, s.ds, s.xchg) == (32 * KB,) * 3 + (16 * KB,) * 4 + (32 * KB, 16 * KB)
    assert s.total == KB + 3 * 32 * KB + 4 * 16 * KB + 32 * KB + 16 * KB + KB == 215040 <= SMEM_CAPACITY
    # per stage of Q/dO the pair stages the same bytes per CTA as the 1-CTA kernel (64 KB), but each
    # MMA reads only half of its B operand from each CTA's SMEM
    one = blackwell_bwd_config(128, 128, "bf16", causal=True)
    assert s.q + s.do + s.qt + s.dot == one.smem.q + one.smem.do == 64 * KB
    assert c.regs.total == 128 * (240 + 136 + 128) <= 65536  # = 3 x 168 x 128: the launch allocation


@pytest.mark.cpu
@pytest.mark.stage4
def test_d64_plan_takes_two_stages():
    c = blackwell_bwd_2cta_config(64, 64, "fp16", causal=False, deterministic=True)
    assert c.tmem.used == 128 + 64 + 128 + 64 == 384 and c.tmem.alloc == 512
    assert (c.tmem.dv, c.tmem.dp, c.tmem.dk, c.tmem.dq, c.tmem.dq_cols) == (128, 192, 320, 64, 32)
    assert c.qdo_stages == 2
    assert c.smem.total == KB + 3 * 16 * KB + 2 * 4 * 8 * KB + 32 * KB + 16 * KB + KB == 165888
    one_stage = blackwell_bwd_2cta_config(64, 64, "bf16", causal=False, qdo_stages=1)
    assert one_stage.smem.total == 165888 - 4 * 8 * KB == 133120


@pytest.mark.cpu
@pytest.mark.stage4
def test_refusals_name_the_budget():
    # a second Q/dO stage at d = 128: 215040 + 64 KB > 232448
    with pytest.raises(ValueError, match=r"SMEM does not fit.*per CTA"):
        blackwell_bwd_2cta_config(128, 128, "bf16", causal=False, qdo_stages=2)
    # the pair splits M, not the accumulators: 128 + 256 + 128 + 256 columns
    with pytest.raises(ValueError, match=r"TMEM does not fit: .* = 768 columns"):
        blackwell_bwd_2cta_config(256, 256, "bf16", causal=False)
    with pytest.raises(ValueError, match=r"TMEM does not fit"):
        blackwell_bwd_2cta_config(192, 128, "bf16", causal=False)
    with pytest.raises(ValueError, match=r"supports only head dims"):
        blackwell_bwd_2cta_config(96, 96, "bf16", causal=False)
    with pytest.raises(ValueError, match=r"dtype"):
        blackwell_bwd_2cta_config(128, 128, "fp8", causal=False)
    # the 1-CTA planner points to this one
    with pytest.raises(ValueError, match=r"blackwell_bwd_2cta_config"):
        blackwell_bwd_config(128, 128, "bf16", causal=False, cta_group=2)


@pytest.mark.cpu
@pytest.mark.stage4
@pytest.mark.parametrize("causal", [False, True])
def test_pair_walk_covers_each_cta(causal):
    """Both CTAs walk their pair's Q tiles (so their barrier phases stay in step); each CTA's own
    visible tiles must be among them (the extra ones are masked to P = 0 by its own n_block)."""
    from stage4_bwd_kernel import schedule

    tm = tn = 128
    for sq in (1, 100, 128, 300, 1000):
        for sk in (1, 127, 129, 256, 700, 1000):
            for pair in range(-(-sk // (2 * tn))):
                lo, hi = schedule.m_block_range(pair, tm, 2 * tn, sq, sk, causal)
                for rank in (0, 1):
                    n = 2 * pair + rank
                    if n * tn >= sk:
                        continue
                    a, b = schedule.m_block_range(n, tm, tn, sq, sk, causal)
                    assert lo <= a and (b <= hi or a >= b)
                for m in range(lo, hi):  # the rank of the pair fits the dQ tile's pair count
                    last = schedule.n_block_last(m, tm, 2 * tn, sq, sk, causal)
                    assert 0 <= pair <= last


@pytest.mark.cpu
@pytest.mark.stage4
def test_pair_semaphores_deadlock_free_and_spt_stalls_less():
    """The deterministic protocol over pairs (256-key tiles) in stage 4's semaphore model."""
    from stage4_bwd_kernel import schedule
    from stage4_bwd_kernel.model import simulate_semaphores

    for causal in (False, True):
        for order in (schedule.KVAscendingOrder, schedule.KVDescendingOrder):
            for sq, sk, resident in ((2048, 2048, 8), (300, 1000, 3), (1000, 300, 2)):
                sim = simulate_semaphores(seqlen_q=sq, seqlen_k=sk, tile_m=128, tile_n=256, causal=causal,
                                          order=order, heads_kv=2, group=2, resident=resident)
                assert sim.finished, (causal, order.name, sq, sk)
                for (_, _, m), seq in sim.add_sequence.items():
                    expect = list(range(schedule.n_block_last(m, 128, 256, sq, sk, causal) + 1))
                    assert seq == (expect if order is schedule.KVAscendingOrder else expect[::-1])
    # causal: the SPT order (pairs launched from the end of the keys, ranks descending) lets every
    # pair's first dQ add go at once; ascending makes it wait for the pairs before it
    kw = dict(seqlen_q=4096, seqlen_k=4096, tile_m=128, tile_n=256, causal=True, heads_kv=4, resident=66)
    asc = simulate_semaphores(order=schedule.KVAscendingOrder, **kw)
    desc = simulate_semaphores(order=schedule.KVDescendingOrder, **kw)
    assert asc.finished and desc.finished
    assert desc.first_write_stalls == 0 < asc.first_write_stalls and desc.stall_steps < asc.stall_steps


# ------------------------------------------------------------------------------------ compile tier
CASES = [(d, causal, det) for d in (64, 128) for causal in (False, True) for det in (False, True)]
_COMPILED: dict = {}


def _compile(d, causal, deterministic):
    from stage4_bwd_kernel import blackwell_bwd_2cta

    key = (d, causal, deterministic)
    if key not in _COMPILED:
        _COMPILED[key] = blackwell_bwd_2cta.compile_only("bf16", d, causal=causal, deterministic=deterministic)
    return _COMPILED[key]


def _n(pat, text):
    return len(re.findall(pat, text))


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("d,causal,deterministic", CASES)
def test_compiles_cta_pair_mmas(d, causal, deterministic):
    comp = _compile(d, causal, deterministic)
    r, sass, ptx = comp.report, comp.sass, comp.ptx
    assert r["ptx_target"] == "sm_100a"
    # every MMA is a CTA-pair MMA, issued once per tile: S^T, dP^T (d / 16 K-steps each) and dQ (K = 256
    # keys of the pair: 16 steps) with both operands in SMEM; dV, dK (K = 128 queries: 8 steps) from TMEM
    assert _n(r"\bUTCHMMA\b(?!\.2CTA)", sass) == 0
    assert _n(r"\bUTCHMMA\.2CTA\s+gdesc\[", sass) == 2 * (d // 16) + 256 // 16
    assert _n(r"\bUTCHMMA\.2CTA\s+tmem\[", sass) == 2 * (128 // 16)
    assert _n(r"\btcgen05\.mma\.cta_group::2\b", ptx) == 2 * (d // 16) + 16 + 16
    assert _n(r"\btcgen05\.mma\.cta_group::1\b", ptx) == 0
    # the pair allocates TMEM together; every commit arrives on both CTAs' barriers
    assert _n(r"\btcgen05\.alloc\.cta_group::2\b", ptx) == 1 and _n(r"\btcgen05\.dealloc\.cta_group::2\b", ptx) == 1
    commits = re.findall(r"\btcgen05\.commit\.[^\s]+", ptx)
    assert commits and all(".cta_group::2." in c and "multicast::cluster" in c for c in commits)
    assert len(commits) == r["UTCBAR"] >= 8   # s_full dp_full dq_full dkv_full + four B-half empties
    # 2-SM TMA: each CTA loads its halves; the transfer completes on the even CTA's barrier
    # (address & 0xFEFFFFFF = -16777217)
    tma = re.findall(r"\bUTMALDG\.\dD(\.2CTA)?\b", sass)
    assert tma and all(t == ".2CTA" for t in tma) and len(tma) >= 7
    assert re.search(r"and\.b32\s+%r\d+, %r\d+, -16777217;", ptx)
    # per thread and Q tile: 32 TMEM columns of S^T, dP^T, dV, dK x 4, dQ d/2 (/32); P^T, dS^T stores
    assert r["LDTM"] == 4 + 4 + (d // 2) // 32 + 2 * (d // 32)
    assert r["STTM"] == 8
    # no local memory anywhere
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0
    assert r["LDL/STL"] == 0 and not re.search(r"\b(STL|LDL)\b", sass)
    plan = blackwell_bwd_2cta_config(d, d, "bf16", causal=causal, deterministic=deterministic)
    assert r["smem_bytes"] == plan.smem.total <= SMEM_CAPACITY
    assert sorted(r["ptx_setmaxnreg"]) == [("dec", "128"), ("dec", "136"), ("inc", "240")]


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("d", [64, 128])
def test_dsmem_exchange_and_cluster(d):
    comp = _compile(d, True, False)
    sass, ptx = comp.sass, comp.ptx
    # the dS half goes to the peer with one bulk copy, addresses translated with mapa, completing on
    # an mbarrier in the peer whose tx the sender announces remotely
    assert _n(r"\bcp\.async\.bulk\.shared::cluster\.shared::cta\.mbarrier::complete_tx::bytes\b", ptx) == 1
    assert _n(r"\bUBLKCP\.S\.S\b", sass) == 1
    assert _n(r"\bmapa\.shared::cluster\.u32\b", ptx) >= 2
    assert _n(r"\bmbarrier\.arrive\.expect_tx\.release\.cluster\.shared::cluster\b", ptx) == 1
    # signals to the even CTA's MMA thread: p_full, dst_full, ds_full, dq_empty, xchg_peer (release, cluster)
    assert _n(r"\bmbarrier\.arrive\.release\.cluster\.shared::cluster\b", ptx) == 5
    assert _n(r"\bSYNCS\.ARRIVE\.TRANS64\.RED\b", sass) >= 6
    # cluster barriers: after barrier init and before exit
    assert _n(r"\bbarrier\.cluster\.arrive\b", ptx) == 2 and _n(r"\bbarrier\.cluster\.wait\b", ptx) == 2
    assert _n(r"\bUCGABAR_ARV\b", sass) == 2 and _n(r"\bUCGABAR_WAIT\b", sass) == 2
    # each CTA adds only its 64 query rows of dQ: d/4 8-byte atomics per thread (1-CTA kernel: d/2)
    assert comp.report["ptx_red_v2"] == d // 4
    assert _n(r"\bREDG\.E\.ADD\.F32x2\b", sass) == d // 4


_has_spin_loop = s4._has_spin_loop  # the Hopper tests' SASS check: the same semaphore code


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("d", [64, 128])
def test_deterministic_semaphore_loop(d):
    det = _compile(d, True, True)
    assert det.report["ptx_ld_acquire"] >= 1 and _has_spin_loop(det.sass)
    assert "red.relaxed.gpu.global.add.s32" in det.ptx          # the release of the next rank
    assert det.report["ptx_red_v2"] == d // 4                    # the dQ adds themselves are unchanged
    plain = _compile(d, True, False)
    assert plain.report["ptx_ld_acquire"] == 0 and not _has_spin_loop(plain.sass)
    assert "red.relaxed.gpu.global.add.s32" not in plain.ptx


@pytest.mark.compile
@pytest.mark.stage4
def test_make_kernel_interface():
    from stage4_bwd_kernel import blackwell_bwd_2cta, schedule  # first: the package sets the arch

    import cutlass

    with pytest.raises(ValueError, match=r"varlen"):
        blackwell_bwd_2cta.make_kernel(cutlass.BFloat16, 128, 128, False, False, varlen=True)
    k = blackwell_bwd_2cta.make_kernel(cutlass.BFloat16, 128, 128, True, True)
    assert k.cfg.cta_group == 2 and k.dq_order is schedule.KVDescendingOrder   # causal deterministic: SPT
    with pytest.raises(ValueError, match=r"2-CTA plan"):
        blackwell_bwd_2cta.FlashAttentionBackwardSm100TwoCta(blackwell_bwd_config(128, 128, "bf16", causal=False))
