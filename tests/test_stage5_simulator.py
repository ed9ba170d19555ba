"""Stage 5 (CPU): tile orders are permutations with the paper's structure, the simulator
reproduces hand-computed schedules and Graham's bounds, and the paper's claims hold in the
model: LPT beats the naive grid on causal and varlen, L2 sections stop the thrashing that a
section-less LPT causes, and SPT's deterministic backward never stalls on a first dQ write.

Every claim here is about the *simulator*; the GPU schedulers are checked against these
index maps when they exist (device == host), not against these makespans."""
import itertools

import numpy as np
import pytest

from stage0_reference import visible_mask
from stage5_scheduling import (
    H100_L2_BYTES,
    H100_SMS,
    Problem,
    Tiles,
    dq_rank,
    first_q_block,
    heads_per_section,
    kv_blocks_visited,
    list_order,
    lower_bound,
    lpt_bwd,
    lpt_causal,
    lpt_causal_flat,
    lpt_no_sections,
    lpt_varlen,
    naive,
    naive_bwd,
    run_backward,
    run_forward,
    simulate,
    simulate_bwd,
    simulate_striding,
    spt_bwd,
    tile_costs,
    varlen_metadata,
)
from stage5_scheduling.simulator import _LRU, L2Model

pytestmark = [pytest.mark.cpu, pytest.mark.stage5]


def as_set(t: Tiles):
    return list(zip(t.block.tolist(), t.head.tolist(), t.batch.tolist()))


def dummy_tiles(n):
    """Coordinates for bare cost lists (the hand-made cases)."""
    return Tiles(np.arange(n), np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))


def random_gqa(rng):
    hkv = int(rng.integers(1, 6))
    group = int(rng.choice([1, 2, 4, 8]))
    return hkv * group, hkv, group


# --------------------------------------------------------------------------------------------
# 1. orders: permutations, structure, device-style scalar evaluation
# --------------------------------------------------------------------------------------------
def test_every_order_is_a_permutation_of_all_tiles(rng):
    for _ in range(40):
        M, B = int(rng.integers(1, 40)), int(rng.integers(1, 5))
        H, hkv, group = random_gqa(rng)
        S = group * int(rng.integers(1, hkv + 1))  # whole KV groups, any width (uneven last)
        T = M * H * B
        full = sorted(itertools.product(range(M), range(H), range(B)))
        for order, args in [(naive, (M, H, B)), (lpt_causal, (M, H, B, S, hkv)),
                            (lpt_no_sections, (M, H, B)), (naive_bwd, (M, H, B)),
                            (lpt_bwd, (M, H, B, S)), (spt_bwd, (M, H, B, S))]:
            tiles = list_order(order, T, *args)
            assert len(tiles) == T
            assert sorted(as_set(tiles)) == full, order.__name__


def test_varlen_orders_are_permutations(rng):
    for _ in range(40):
        nb, H = int(rng.integers(1, 10)), int(rng.integers(1, 9))
        sq = rng.integers(0, 3000, size=nb)  # zero-length sequences included: no tiles
        sk = np.where(rng.random(nb) < 0.5, sq, rng.integers(0, 5000, size=nb))
        tm, tn = int(rng.choice([64, 128])), int(rng.choice([64, 128, 176]))
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(s)]) for s in (sq, sk))
        full = sorted((m, h, b) for b in range(nb) for h in range(H)
                      for m in range(-(-int(sq[b]) // tm)))
        for sort, S, rev in [(True, int(rng.integers(1, H + 1)), True), (False, 1, False),
                             (False, H, True)]:
            meta = varlen_metadata(cu_q, cu_k, H, tm, tn, bool(rng.random() < 0.8), S, sort, rev)
            assert sorted(as_set(list_order(lpt_varlen, meta.num_tiles, meta))) == full


def test_scalar_index_equals_vectorized(rng):
    """A device scheduler evaluates one linear index at a time: same formula, same answer."""
    M, H, B, S = 7, 6, 3, 4
    vec = list_order(lpt_causal, M * H * B, M, H, B, S)
    meta = varlen_metadata([0, 300, 310, 1500], [0, 300, 5000, 6190], H, 128, 128, True, S)
    vvec = list_order(lpt_varlen, meta.num_tiles, meta)
    for i in rng.integers(0, M * H * B, size=30):
        assert tuple(int(x) for x in lpt_causal(int(i), M, H, B, S)) == \
            (vec.block[i], vec.head[i], vec.batch[i])
    for i in rng.integers(0, meta.num_tiles, size=30):
        assert tuple(int(x) for x in lpt_varlen(int(i), meta)) == \
            (vvec.block[i], vvec.head[i], vvec.batch[i])


def test_lpt_causal_hand_example():
    """2 batches, 4 heads, 3 m_blocks, sections of 2 heads: batch > section > m reversed > head."""
    t = list_order(lpt_causal, 24, 3, 4, 2, 2)
    assert as_set(t)[:14] == [(2, 0, 0), (2, 1, 0), (1, 0, 0), (1, 1, 0), (0, 0, 0), (0, 1, 0),
                              (2, 2, 0), (2, 3, 0), (1, 2, 0), (1, 3, 0), (0, 2, 0), (0, 3, 0),
                              (2, 0, 1), (2, 1, 1)]
    # naive: m fastest ascending; no-sections: m reversed outermost, heads fastest
    assert as_set(list_order(naive, 24, 3, 4, 2))[:4] == [(0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 1, 0)]
    assert as_set(list_order(lpt_no_sections, 24, 3, 4, 2))[:5] == \
        [(2, 0, 0), (2, 1, 0), (2, 2, 0), (2, 3, 0), (2, 0, 1)]


def test_lpt_causal_flat_hand_example():
    """2 batches, 3 heads, 2 m_blocks, sections of 2 (batch, head) pairs: the second section is
    head 2 of batch 0 with head 0 of batch 1 (the official FA4 kernel's layout)."""
    t = list_order(lpt_causal_flat, 12, 2, 3, 2, 2)
    assert as_set(t) == [(1, 0, 0), (1, 1, 0), (0, 0, 0), (0, 1, 0), (1, 2, 0), (1, 0, 1),
                         (0, 2, 0), (0, 0, 1), (1, 1, 1), (1, 2, 1), (0, 1, 1), (0, 2, 1)]


def test_flat_sections_remove_the_narrow_section_tail():
    """(192, 128) causal at the benchmark's 32k tokens: 10 heads in sections of 4 leave a 2-head
    section at the end of every batch, whose 64-block tiles start too late (4.2% over the ideal
    at 8k, tiles costing their blocks + 1.5); over the (batch, head) pairs it is 40 = 10 x 4: no
    narrow section at all. The H100 traces in the stage 5 README show the same tail."""
    p = Problem.fixed(4, 10, 8192)
    per_batch, flat = (run_forward(p, o, H100_SMS, heads_per_section=4) for o in ("lpt_causal", "lpt_causal_flat"))
    assert flat.makespan < per_batch.makespan
    assert flat.makespan / lower_bound(flat.cost, H100_SMS) < 1.005
    p16 = Problem.fixed(2, 16, 8192)  # the section divides the heads: one and the same list
    assert as_set(p16.forward_tiles("lpt_causal", 4)) == as_set(p16.forward_tiles("lpt_causal_flat", 4))


def test_gqa_query_heads_of_a_kv_head_are_adjacent(rng):
    """All query heads of one KV head run back to back before m_block moves (paper)."""
    for _ in range(20):
        M, B = int(rng.integers(1, 20)), int(rng.integers(1, 4))
        H, hkv, group = random_gqa(rng)
        S = group * int(rng.integers(1, hkv + 1))
        for order in (lpt_causal, lpt_causal_flat):
            t = list_order(order, M * H * B, M, H, B, S, hkv)
            # chop the order into runs of `group` tiles: each run is one (m, kv head, batch)
            runs = np.stack([t.block, t.head // group, t.batch], 1).reshape(-1, group, 3)
            assert (runs == runs[:, :1]).all()
            assert (np.sort(t.head.reshape(-1, group) % group, axis=1) == np.arange(group)).all()


def test_sections_must_hold_whole_kv_groups():
    with pytest.raises(ValueError, match="whole KV groups"):
        lpt_causal(0, 4, 8, 1, heads_per_section=3, heads_kv=2)
    lpt_causal(0, 4, 8, 1, heads_per_section=8, heads_kv=2)  # S >= H: one section, fine


def test_heads_per_section_arithmetic():
    # one KV head, 8k keys, d = 128, bf16: 8192 * (128 + 128) * 2 = 4 MiB; 0.5 * 50 MiB / 4 MiB = 6.25
    assert heads_per_section(H100_L2_BYTES, 8192, 128) == 6
    assert heads_per_section(H100_L2_BYTES, 8192, 128, power_of_two=True) == 4
    # GQA: 16k keys -> 8 MiB per KV head, 3 KV heads fit, 8 query heads each
    assert heads_per_section(H100_L2_BYTES, 16384, 128, heads_kv_group=8) == 24
    # larger than L2: still one whole group, never zero
    assert heads_per_section(H100_L2_BYTES, 1 << 20, 256, heads_kv_group=4) == 4
    assert heads_per_section(H100_L2_BYTES, 8192, 128, safety=1.0) == 12


# --------------------------------------------------------------------------------------------
# 2. per-tile work from the mask
# --------------------------------------------------------------------------------------------
def test_mainloop_bounds_match_the_mask(rng):
    """kv_blocks_visited = K blocks holding a visible key (stage 0's mask); first_q_block is
    its transpose, so forward and backward visit the same (m, n) pairs."""
    for _ in range(40):
        sq, sk = int(rng.integers(1, 700)), int(rng.integers(1, 700))
        tm, tn = int(rng.choice([16, 64, 128])), int(rng.choice([16, 48, 128]))
        causal = bool(rng.random() < 0.8)
        mask = visible_mask(sq, sk, causal)
        M, N = -(-sq // tm), -(-sk // tn)
        pad = np.zeros((M * tm, N * tn), dtype=bool)
        pad[:sq, :sk] = mask
        any_visible = pad.reshape(M, tm, N, tn).any(axis=(1, 3))  # (M, N)
        visits = np.arange(N)[None, :] < kv_blocks_visited(np.arange(M), sq, sk, tm, tn, causal)[:, None]
        # the forward skips nothing inside [0, last visible block): masked-but-visited blocks
        # only occur when sq > sk leaves whole rows empty, and then the count is 0
        assert (visits == any_visible).all()
        back = np.arange(M)[:, None] >= first_q_block(np.arange(N), sq, sk, tm, tn, causal)[None, :]
        assert (back == visits).all()


def test_fractional_costs_count_unmasked_scores(rng):
    for _ in range(20):
        sq, sk = int(rng.integers(1, 600)), int(rng.integers(1, 600))
        tm, tn = int(rng.choice([32, 64])), int(rng.choice([32, 64, 128]))
        M = -(-sq // tm)
        tiles = Tiles(np.arange(M), np.zeros(M, dtype=np.int64), np.zeros(M, dtype=np.int64))
        whole = tile_costs(tiles, sq, sk, tm, tn, True)
        frac = tile_costs(tiles, sq, sk, tm, tn, True, fractional=True)
        mask = visible_mask(sq, sk, True)
        rows = [mask[m * tm:(m + 1) * tm].sum() / (tm * tn) for m in range(M)]
        np.testing.assert_allclose(frac, rows)
        assert (frac <= whole + 1e-12).all()
    # the standard case: 8k causal, 128 x 128 -> Q block m costs m + 1
    t = dummy_tiles(64)
    np.testing.assert_array_equal(tile_costs(t, 8192, 8192, 128, 128), np.arange(1, 65))


# --------------------------------------------------------------------------------------------
# 3. list scheduling: hand-computed cases and Graham's bounds
# --------------------------------------------------------------------------------------------
def test_hand_computed_makespans():
    # 2 SMs, costs [3, 3, 2, 2, 2] in LPT order:
    #   t=0: SM0 <- 3 (0-3), SM1 <- 3 (0-3); t=3: SM0 <- 2 (3-5), SM1 <- 2 (3-5); t=5: SM0 <- 2 (5-7)
    #   makespan 7. The optimum is 6 = 3+3 | 2+2+2, which the order [3, 2, 2, 3, 2] reaches:
    #   SM0 <- 3 (0-3), SM1 <- 2 (0-2), SM1 <- 2 (2-4), SM0 <- 3 (3-6), SM1 <- 2 (4-6).
    #   This is Graham's tight example: 7 / 6 = 4/3 - 1/(3*2). LPT is a heuristic.
    s = simulate(dummy_tiles(5), [3, 3, 2, 2, 2], 2)
    assert s.makespan == 7
    assert s.sm.tolist() == [0, 1, 0, 1, 0] and s.start.tolist() == [0, 0, 3, 3, 5]
    assert simulate(dummy_tiles(5), [3, 2, 2, 3, 2], 2).makespan == 6
    # where LPT does pay: 2 SMs, [1, 1, 1, 1, 4]
    #   shortest first: SM0: 1 (0-1), 1 (1-2), 4 (2-6); SM1: 1 (0-1), 1 (1-2) -> 6
    #   longest first:  SM0: 4 (0-4); SM1: 1, 1, 1, 1 (0-4) -> 4 = total / 2, optimal
    assert simulate(dummy_tiles(5), [1, 1, 1, 1, 4], 2).makespan == 6
    assert simulate(dummy_tiles(5), [4, 1, 1, 1, 1], 2).makespan == 4
    assert lower_bound([4, 1, 1, 1, 1], 2) == 4


def brute_force_opt(costs, P):
    best = np.inf
    for assign in itertools.product(range(P), repeat=len(costs)):
        loads = np.zeros(P)
        np.add.at(loads, list(assign), costs)
        best = min(best, loads.max())
    return best


def test_graham_bounds_on_tiny_cases(rng):
    """Sorted LPT <= (4/3 - 1/(3P)) OPT (Graham 1969, OPT by brute force); any order
    <= total/P + (1 - 1/P) longest (Graham 1966)."""
    for _ in range(60):
        P, n = int(rng.integers(2, 4)), int(rng.integers(2, 8))
        costs = rng.integers(1, 10, size=n).astype(float)
        opt = brute_force_opt(costs, P)
        lpt = simulate(dummy_tiles(n), np.sort(costs)[::-1], P).makespan
        assert opt - 1e-9 <= lpt <= (4 / 3 - 1 / (3 * P)) * opt + 1e-9
        any_order = simulate(dummy_tiles(n), rng.permutation(costs), P).makespan
        assert opt - 1e-9 <= any_order <= costs.sum() / P + (1 - 1 / P) * costs.max() + 1e-9


def test_schedules_are_valid_and_within_list_bound(rng):
    """No SM runs two tiles at once, tiles start in launch order, every order obeys the
    list-scheduling bound."""
    for _ in range(15):
        H, hkv, _ = random_gqa(rng)
        p = Problem.fixed(int(rng.integers(1, 4)), H, int(rng.integers(1, 3000)), heads_kv=hkv,
                          tile_m=int(rng.choice([64, 128])), tile_n=int(rng.choice([64, 128])))
        P = int(rng.integers(1, 140))
        for order in ("naive", "lpt_no_sections", "lpt_causal"):
            s = run_forward(p, order, P)
            assert (np.diff(s.start) >= 0).all()
            for sm in range(P):
                on = np.flatnonzero(s.sm == sm)
                assert (s.start[on][1:] >= s.end[on][:-1] - 1e-9).all()
            assert s.makespan <= s.cost.sum() / P + (1 - 1 / P) * s.cost.max() + 1e-9
            assert s.makespan >= s.lower_bound - 1e-9


# --------------------------------------------------------------------------------------------
# 4. LPT versus the naive grid
# --------------------------------------------------------------------------------------------
def test_lpt_strictly_better_on_the_standard_causal_case():
    p = Problem.fixed(2, 16, 8192)  # 2048 tiles of cost 1..64, 66560 steps on 132 SMs
    naive_s, lpt_s = run_forward(p, "naive"), run_forward(p, "lpt_causal")
    assert lpt_s.lower_bound == 66560 / 132
    assert lpt_s.makespan < naive_s.makespan
    assert lpt_s.makespan / lpt_s.lower_bound < 1.01 < 1.05 < naive_s.makespan / naive_s.lower_bound


def test_persistent_striding_needs_equal_tiles():
    """The forward's persistent CTAs: a fixed hand-out (CTA c takes every 132nd tile) places equal
    tiles exactly like the greedy one (non-causal: persistent=True keeps it), but with causal tiles
    the CTAs that drew long ones finish last, which is why causal calls take tiles from an atomic
    counter (dynamic=True, the greedy hand-out of `simulate`)."""
    for causal in (False, True):
        p = Problem.fixed(32, 16, 1024, causal=causal)  # fa4's order below 4k keys: the static grid
        tiles = p.forward_tiles("naive")
        greedy, fixed = simulate(tiles, p.costs(tiles), 132), simulate_striding(tiles, p.costs(tiles), 132)
        assert np.bincount(fixed.sm).tolist() == [len(tiles.block) // 132 + (s < len(tiles.block) % 132)
                                                  for s in range(132)]  # every 132nd tile each
        if not causal:
            assert np.array_equal(fixed.sm, greedy.sm) and fixed.makespan == greedy.makespan
        else:
            assert fixed.makespan > 1.3 * greedy.makespan  # 192 vs 145 steps: run 17 measured 1.30x
            assert fixed.makespan >= fixed.lower_bound and greedy.makespan >= greedy.lower_bound


def test_lpt_never_worse_than_naive_fixed_length(rng):
    """Causal, square, sections of whole KV groups dividing the heads: LPT <= naive. (0
    counterexamples in 40,000 random cases while writing this; not a theorem, see below.)"""
    for _ in range(60):
        H, hkv, group = random_gqa(rng)
        S = group * int(rng.choice([d for d in range(1, hkv + 1) if hkv % d == 0]))
        p = Problem.fixed(int(rng.integers(1, 5)), H, int(rng.integers(1, 6000)), heads_kv=hkv,
                          tile_m=int(rng.choice([64, 128])), tile_n=int(rng.choice([64, 128, 176])))
        P = int(rng.integers(1, 140))
        assert run_forward(p, "lpt_causal", P, heads_per_section=S).makespan <= \
            run_forward(p, "naive", P, heads_per_section=S).makespan


def test_lpt_varlen_not_worse_than_naive(rng):
    """Varlen, sorted batches: per case within 1% of naive (the rare anomaly below is +0.6%),
    and better in total."""
    tot_naive = tot_lpt = 0.0
    for _ in range(40):
        H, hkv, group = random_gqa(rng)
        S = group * int(rng.choice([d for d in range(1, hkv + 1) if hkv % d == 0]))
        nb = int(rng.integers(1, 16))
        sq = rng.integers(1, 6000, size=nb)
        p = Problem.varlen(sq, H, heads_kv=hkv, tile_m=int(rng.choice([64, 128])),
                           tile_n=int(rng.choice([64, 128])))
        P = int(rng.integers(1, 140))
        a = run_forward(p, "naive", P, heads_per_section=S).makespan
        b = run_forward(p, "lpt_varlen", P, heads_per_section=S).makespan
        assert b <= 1.01 * a
        tot_naive, tot_lpt = tot_naive + a, tot_lpt + b
    assert tot_lpt < tot_naive


def test_lpt_is_a_heuristic():
    """Pinned counterexamples (found by random search), kept as documentation.
    1. Varlen, 4 sequences, 2 heads, 93 SMs: only 432 tiles (4.6 per SM), and sorting
       *batches* by their longest tile is not sorting *tiles*: naive 166, LPT 167.
    2. A narrow last section (sections of 6 query heads for 8 heads) starts its longest
       tiles late: 88 steps, vs 66 with sections of 4 or 8 and 86 for naive."""
    p = Problem.varlen((2602, 5677, 3362, 2086), heads=2, heads_kv=1, tile_m=64, tile_n=64)
    assert run_forward(p, "naive", 93, heads_per_section=2).makespan == 166
    assert run_forward(p, "lpt_varlen", 93, heads_per_section=2).makespan == 167
    p = Problem.fixed(1, 8, 5575, heads_kv=4)
    assert run_forward(p, "naive", 135).makespan == 86
    assert [run_forward(p, "lpt_causal", 135, heads_per_section=S).makespan
            for S in (6, 4, 8)] == [88, 66, 66]


# --------------------------------------------------------------------------------------------
# 5. L2: why batches go outermost and heads come in sections
# --------------------------------------------------------------------------------------------
def test_lru_by_hand():
    lru = _LRU(capacity_blocks=4)
    assert lru.access("a", 3) == 3   # cold
    assert lru.access("a", 2) == 0   # prefix already resident
    assert lru.access("b", 2) == 2   # 5 > 4 blocks: evicts "a" (least recently used)
    assert lru.access("a", 1) == 1   # gone; refetch 1, evicts nothing (b 2 + a 1 = 3)
    assert lru.access("b", 2) == 0


def test_l2_no_sections_thrashes_when_kv_exceeds_l2():
    # 2 x 16 heads x 4 MiB of K/V = 128 MiB > 50 MiB: no-sections refetches per m_block
    p = Problem.fixed(2, 16, 8192)
    l2 = p.l2()
    ns, sec, nv = (run_forward(p, o, l2=l2) for o in ("lpt_no_sections", "lpt_causal", "naive"))
    assert sec.dram_bytes == sec.compulsory_bytes == nv.dram_bytes == 128 * 2**20
    assert ns.dram_bytes > 10 * ns.compulsory_bytes
    assert ns.makespan > 1.5 * sec.makespan  # DRAM-bound in the model
    assert sec.makespan == run_forward(p, "lpt_causal").makespan  # compulsory misses are hidden


def test_l2_equal_when_everything_fits():
    # 1 x 8 heads x 1 MiB = 8 MiB < 50 MiB: every order fetches each head exactly once
    p = Problem.fixed(1, 8, 2048)
    for order in ("naive", "lpt_no_sections", "lpt_causal"):
        s = run_forward(p, order, l2=p.l2())
        assert s.dram_bytes == s.compulsory_bytes == 8 * 2**20
        assert s.makespan == run_forward(p, order).makespan


def test_l2_model_units():
    l2 = L2Model.h100()
    assert l2.block_bytes == 128 * 256 * 2
    # 8.4 MFLOP per step at 989e12 / 132 FLOP/s -> 1.12 us; 3.35 TB/s * 1.12 us / 64 KiB = 57
    assert 56 < l2.dram_blocks_per_step < 58


# --------------------------------------------------------------------------------------------
# 6. varlen batch map
# --------------------------------------------------------------------------------------------
def test_varlen_batch_map_is_a_sorted_permutation(rng):
    for _ in range(30):
        nb, H = int(rng.integers(1, 20)), int(rng.integers(1, 5))
        sq = rng.integers(0, 4000, size=nb)
        sk = np.where(rng.random(nb) < 0.5, sq, sq + rng.integers(0, 20000, size=nb))
        cu_q, cu_k = (np.concatenate([[0], np.cumsum(s)]) for s in (sq, sk))
        meta = varlen_metadata(cu_q, cu_k, H, 128, 128, True)
        assert meta.batch_map.dtype == np.int32 and meta.cu_tiles.dtype == np.int32
        assert sorted(meta.batch_map.tolist()) == list(range(nb))
        # the sort key, recomputed by brute force over every tile of every batch
        p = Problem.varlen(sq, H, seqlens_k=sk)
        tiles = p.forward_tiles("naive")
        work = np.zeros(nb)
        np.maximum.at(work, tiles.batch, p.costs(tiles))
        np.testing.assert_array_equal(meta.max_tile_work, work)
        key = work[meta.batch_map]
        assert (np.diff(key) <= 0).all()  # descending
        ties = np.diff(key) == 0  # stable: equal work keeps the given order
        assert (np.diff(meta.batch_map)[ties] > 0).all()
        assert (np.diff(meta.cu_tiles) == H * meta.num_m_blocks[meta.batch_map]).all()


def test_equal_length_varlen_reproduces_fixed_orders():
    p = Problem.fixed(3, 8, 1000, heads_kv=2)
    M = -(-1000 // 128)
    assert as_set(p.forward_tiles("naive")) == as_set(list_order(naive, M * 24, M, 8, 3))
    assert as_set(p.forward_tiles("lpt_varlen", 4)) == \
        as_set(list_order(lpt_causal, M * 24, M, 8, 3, 4, 2))


def test_varlen_sort_fixes_late_long_context_requests():
    from stage5_scheduling.__main__ import varlen_long_context
    p = varlen_long_context()
    naive_s, lpt_s = run_forward(p, "naive"), run_forward(p, "lpt_varlen")
    assert lpt_s.makespan < 0.9 * naive_s.makespan
    assert as_set(p.forward_tiles("lpt_varlen"))[0][2] == 27  # the 64k-context request first


# --------------------------------------------------------------------------------------------
# 7. deterministic backward: SPT
# --------------------------------------------------------------------------------------------
def test_bwd_semaphore_by_hand():
    """1 head, 3 K/V blocks of a 3-block causal square, 3 SMs, unit steps, free adds.
    Tile n walks Q blocks n..2; dQ block m has adders 0..m.
    naive (launch n = 0, 1, 2; dQ order ascending n):
      t=1: n0 adds dQ0; n1 reaches dQ1 but needs n0's add first -> waits; n2 waits at dQ2
      t=2: n0 adds dQ1 -> n1 adds (stalled 1); t=3: n0, then n1 add dQ2 -> n2 adds (stalled 2)
    SPT (launch n = 2, 1, 0; dQ order descending n): every first add is the diagonal block,
      where the tile is first in line: no waits at all. Both end at t=3 here."""
    p = Problem.fixed(1, 1, 3, tile_m=1, tile_n=1)
    nv = run_backward(p, "naive_bwd", 3)
    assert nv.first_write_stall.tolist() == [0, 1, 2] and nv.makespan == 3
    sp = run_backward(p, "spt_bwd", 3)
    assert sp.tiles.block.tolist() == [2, 1, 0]
    assert sp.stall.tolist() == [0, 0, 0] and sp.makespan == 3


def test_spt_never_stalls_on_first_dq_write(rng):
    """The paper's claim, on random causal shapes, SM counts and add (fence) costs.

    A tile's rank in the order of its first dQ block m0 is r = last(m0) - n, and every
    adder ahead of it also starts at m0 and was launched earlier, so it waits for at most
    r *adds*, never for a compute step: wait <= r * dq_add_cost. For a square mask with
    tile_n >= tile_m, r = 0: no wait at all (the paper's setting). Otherwise several K/V
    blocks share a first Q block (tile_n < tile_m, or seqlen_k > seqlen_q, where the blocks
    left of the diagonal all start at Q block 0) and queue only behind each other's adds."""
    for _ in range(25):
        tm, tn = int(rng.choice([64, 128])), int(rng.choice([64, 128]))
        sq = int(rng.integers(1, 2500))
        sk = sq if rng.random() < 0.5 else int(rng.integers(1, 2500))
        p = Problem.fixed(int(rng.integers(1, 3)), int(rng.integers(1, 7)), sq, sk,
                          tile_m=tm, tile_n=tn)
        P = int(rng.integers(1, 140))
        for cost in (0.0, 0.1):
            spt = run_backward(p, "spt_bwd", P, heads_per_section=int(rng.integers(1, 7)),
                               dq_add_cost=cost)
            n = spt.tiles.block
            r0 = dq_rank(n, first_q_block(n, sq, sk, tm, tn, True), sq, sk, tm, tn, True, True)
            assert (spt.first_write_stall <= r0 * cost + 1e-9).all()
            if sq == sk and tn >= tm:
                assert (r0 == 0).all() and (spt.first_write_stall == 0).all()
            assert spt.makespan <= run_backward(p, "naive_bwd", P, dq_add_cost=cost).makespan + 1e-9


def test_spt_beats_naive_on_the_standard_causal_backward():
    p = Problem.fixed(2, 16, 8192)
    nv, spt = run_backward(p, "naive_bwd"), run_backward(p, "spt_bwd")
    assert (nv.first_write_stall > 0).sum() > 1000  # naive: most tiles wait on their 1st add
    assert spt.stall.sum() == 0
    assert spt.makespan < 0.7 * nv.makespan
    # determinism is not free: SPT's tail (longest K/V blocks last) vs atomic adds + LPT
    atomic = run_backward(p, "lpt_bwd", deterministic=False)
    assert atomic.makespan < spt.makespan


def test_reduction_order_against_launch_order_deadlocks():
    """Launch n descending but order dQ adds ascending: every resident CTA waits for a block
    that is not launched yet. With enough SMs for all tiles it only stalls."""
    p = Problem.fixed(1, 2, 1024, tile_m=128, tile_n=128)  # 8 K/V blocks x 2 heads
    tiles = p.backward_tiles("spt_bwd", 2)
    with pytest.raises(RuntimeError, match="deadlock"):
        simulate_bwd(tiles, 1024, 1024, 128, 128, True, num_sms=4, descending=False)
    ok = simulate_bwd(tiles, 1024, 1024, 128, 128, True, num_sms=16, descending=False)
    assert ok.stall.sum() > 0
    assert dq_rank(3, 5, 1024, 1024, 128, 128, True, descending=True) == 5 - 3


# --------------------------------------------------------------------------------------------
# 8. the entry point and the plots
# --------------------------------------------------------------------------------------------
def test_main_prints_simulated_tables(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    from stage5_scheduling.__main__ import main

    main(["--plot-dir", str(tmp_path), "--dpi", "40"])
    out = capsys.readouterr().out
    assert "SIMULATED" in out and out.count("| `naive` |") == 6 and "spt_bwd" in out
    pngs = sorted(tmp_path.glob("*.png"))
    assert len(pngs) == 4 and all(f.stat().st_size > 1000 for f in pngs)
