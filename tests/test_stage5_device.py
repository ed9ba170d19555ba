"""Stage 5, device half: the CuTe-DSL schedulers and the varlen preprocessing kernel.

cpu tier: the index functions the kernels trace (``device.sectioned_tile`` & co., called here with
Python ints) equal ``orders.py`` on every index; the warp search finds the right virtual batch;
LPT on step 4's padded varlen grid, filtered to real tiles, is exactly ``lpt_varlen``; the
metadata kernel's rank-and-prefix formula equals the stable sort; the SPT order object speaks
stage 4's interface; VarlenSchedule's cache.

compile tier (no GPU): step 3 compiles for sm_90a with LPTCausalScheduler (bf16, d = 128,
causal) with no spills and step 4 (varlen + batch_map) too if present; the metadata kernel and
every probe compile.

gpu tier: a probe kernel writes each CTA's WorkTile -> equals ``orders`` for MHA, GQA, odd head
counts with partial sections, S > H; the compact varlen scheduler and the padded one reproduce
``lpt_varlen``; the metadata kernel equals ``orders.varlen_metadata`` bit for bit (empty
sequences, seqused_k, more batches than threads); step 3 with LPT == step 3 static, bitwise;
step 4 varlen with the sorted schedule == unsorted, bitwise; CTAs start in linear-index order.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from stage5_scheduling import orders


def _device():
    from stage5_scheduling import device

    return device


def _metadata():
    from stage5_scheduling import metadata

    return metadata


def _step4():
    """The production forward (its stable entry module), which takes stage 5's schedulers. An
    import error fails the test: every stage exists, so a broken import is a bug, not a skip."""
    return importlib.import_module("stage3_fwd_kernel.hopper")


def _stage4():
    return importlib.import_module("stage4_bwd_kernel.hopper_step1")


def as_list(t):
    return list(zip(t.block.tolist(), t.head.tolist(), t.batch.tolist()))


def random_batch(rng, nb, max_len=3000, p_empty=0.2):
    """cu_seqlens_q / _k with empty queries, empty keys and unequal q / k lengths."""
    sq = rng.integers(0, max_len, size=nb)
    sq[rng.random(nb) < p_empty] = 0
    sk = np.where(rng.random(nb) < 0.5, sq, rng.integers(0, 2 * max_len, size=nb))
    sk[rng.random(nb) < p_empty / 2] = 0
    cu = [np.concatenate([[0], np.cumsum(s)]).astype(np.int32) for s in (sq, sk)]
    return cu[0], cu[1]


# (num_blocks, heads, batch, scheduler factory, oracle args): shapes for the probe tests
def _fixed_cases():
    d = _device()
    from stage3_fwd_kernel.tile_scheduler import StaticTileScheduler

    return [
        ("mha-lpt4", 64, 16, 2, d.LPTCausalScheduler(4)),
        ("gqa-12q-3kv", 33, 12, 3, d.GQALPTCausalScheduler.for_group(2, 4)),  # sections 8 + 4
        ("odd-7h-s2", 7, 7, 3, d.LPTCausalScheduler(2)),                     # 2,2,2,1
        ("s-wider-than-h", 5, 3, 2, d.LPTCausalScheduler(8)),
        ("mqa-8", 17, 8, 2, d.GQALPTCausalScheduler.for_group(1, 8)),
        ("one-block", 1, 5, 4, d.LPTCausalScheduler(2)),
        ("flat-10h-s4", 6, 10, 3, d.LPTCausalScheduler(4, flat_batches=True)),  # sections span batches
        ("flat-gqa-12q-3kv", 5, 12, 3, d.GQALPTCausalScheduler.for_group(2, 4, flat_batches=True)),
        ("flat-s-wider", 4, 3, 2, d.LPTCausalScheduler(8, flat_batches=True)),
        ("naive", 9, 6, 2, d.SectionedScheduler(1, False)),
        ("static", 9, 6, 2, StaticTileScheduler),
        ("no-sections", 9, 6, 2, d.LPTNoSectionsScheduler()),
    ]


def sections_by_loops(M, H, B, S, rev, flat=False):
    """The sectioned orders as plain loops, sharing no code with section_tile: the chains -- each
    batch's heads, or (flat) all (batch, head) pairs batch-major -- in sections of S (the last
    narrower); in a section, blocks outer (descending when rev), its chains inner."""
    chains = [[(h, b) for b in range(B) for h in range(H)]] if flat else [[(h, b) for h in range(H)]
                                                                         for b in range(B)]
    out = []
    for units in chains:
        for s0 in range(0, len(units), S):
            for m in (range(M - 1, -1, -1) if rev else range(M)):
                out += [(m, h, b) for h, b in units[s0:s0 + S]]
    return out


def _oracle(sched, M, H, B):
    if hasattr(sched, "host_order"):
        return sched.host_order(M, H, B)
    return orders.list_order(orders.naive, M * H * B, M, H, B)  # the static grid


# ============================================================================================ cpu
@pytest.mark.cpu
@pytest.mark.stage5
def test_index_functions_equal_orders(rng):
    d = _device()
    for _ in range(60):
        M, H, B = int(rng.integers(1, 20)), int(rng.integers(1, 13)), int(rng.integers(1, 4))
        S, rev = int(rng.integers(1, H + 4)), bool(rng.random() < 0.5)
        T = M * H * B
        want = orders.list_order(orders.sectioned, T, M, H, B, S, rev)
        got = [d.sectioned_tile(i, M, H, S, rev) for i in range(T)]
        assert got == as_list(want) == sections_by_loops(M, H, B, S, rev), (M, H, B, S, rev)
        want = orders.list_order(orders.lpt_no_sections, T, M, H, B)
        assert [d.no_sections_tile(i, M, H, B) for i in range(T)] == as_list(want)
        # what a SectionedScheduler's oracle says is the same thing
        assert as_list(d.LPTCausalScheduler(S).host_order(M, H, B)) == \
            as_list(orders.list_order(orders.sectioned, T, M, H, B, S, True))
        # flat sections: the device map (unclamped section, as the kernel passes it) == the host order
        flat = as_list(orders.list_order(orders.lpt_causal_flat, T, M, H, B, S))
        assert [d.flat_sectioned_tile(i, M, H, B, S, True) for i in range(T)] == flat, (M, H, B, S)
        assert as_list(d.LPTCausalScheduler(S, flat_batches=True).host_order(M, H, B)) == flat
        assert sorted(flat) == sorted(as_list(want))  # every tile once
        flat_rev = as_list(orders.list_order(orders.sectioned_flat, T, M, H, B, S, rev))
        assert flat_rev == sections_by_loops(M, H, B, S, rev, flat=True), (M, H, B, S, rev)
        assert [d.flat_sectioned_tile(i, M, H, B, S, rev) for i in range(T)] == flat_rev
        assert as_list(d.SectionedScheduler(S, rev, flat_batches=True).host_order(M, H, B)) == flat_rev
        if H % S == 0:  # the section divides the heads: the same list as per-batch sections
            assert flat == as_list(orders.list_order(orders.lpt_causal, T, M, H, B, S))


@pytest.mark.cpu
@pytest.mark.stage5
def test_warp_search_and_compact_varlen_formula(rng):
    """The compact scheduler's three steps, replayed with ints, give lpt_varlen's tiles (virtual
    batch, then batch_map) for every linear index; empty batches are never chosen."""
    d = _device()
    for _ in range(30):
        nb, H = int(rng.integers(1, 80)), int(rng.integers(1, 9))
        cu_q, cu_k = random_batch(rng, nb)
        if cu_q[-1] == 0:
            continue
        S = int(rng.integers(1, H + 1))
        meta = orders.varlen_metadata(cu_q, cu_k, H, 128, 128, True, S, True, True)
        want = as_list(orders.list_order(orders.lpt_varlen, meta.num_tiles, meta))
        cu = meta.cu_tiles.tolist()
        for lin in range(meta.num_tiles):
            v = d.varlen_search_host(cu, lin)
            assert v == int(np.searchsorted(meta.cu_tiles, lin, side="right") - 1)
            assert cu[v + 1] > cu[v], "landed on an empty batch"
            M = (cu[v + 1] - cu[v]) // H
            block, head = d.in_batch_tile(lin - cu[v], M, H, S, True)
            assert (block, head, int(meta.batch_map[v])) == want[lin]
            assert (block, head, 0) == sections_by_loops(M, H, 1, S, True)[lin - cu[v]]


@pytest.mark.cpu
@pytest.mark.stage5
def test_padded_grid_lpt_with_batch_map_is_lpt_varlen(rng):
    """Step 4's padded grid (max m_blocks, H, B) + batch_map + LPTCausalScheduler: the CTAs that
    have work come in exactly the lpt_varlen order (the others exit at once)."""
    for _ in range(30):
        nb, H = int(rng.integers(1, 30)), int(rng.integers(1, 9))
        cu_q, cu_k = random_batch(rng, nb)
        S = int(rng.integers(1, H + 1))
        for sort in (True, False):
            meta = orders.varlen_metadata(cu_q, cu_k, H, 128, 128, True, S, sort, True)
            M = max(int(meta.num_m_blocks.max(initial=0)), 1)
            m, h, v = orders.sectioned(np.arange(M * H * nb), M, H, nb, S, True)
            b = meta.batch_map[v]
            real = m < meta.num_m_blocks[b]
            got = list(zip(m[real].tolist(), h[real].tolist(), b[real].tolist()))
            assert got == as_list(orders.list_order(orders.lpt_varlen, meta.num_tiles, meta))


@pytest.mark.cpu
@pytest.mark.stage5
def test_metadata_kernel_formula_equals_stable_sort(rng):
    """The kernel's arithmetic (longest_tile_work, rank count, prefix of the batches ranked
    before) replayed in NumPy equals orders.varlen_metadata."""
    md = _metadata()
    for _ in range(40):
        nb, H = int(rng.integers(1, 60)), int(rng.integers(1, 9))
        tm, tn = int(rng.choice([64, 128])), int(rng.choice([64, 128]))
        causal = bool(rng.random() < 0.8)
        cu_q, cu_k = random_batch(rng, nb)
        seq_q, seq_k = np.diff(cu_q).astype(np.int64), np.diff(cu_k).astype(np.int64)
        blocks = -(-seq_q // tm)
        work = np.array([md.longest_tile_work(int(m), int(a), int(k), tm, tn, causal) if m > 0 else 0
                         for m, a, k in zip(blocks, seq_q, seq_k)])
        for sort in (True, False):
            meta = orders.varlen_metadata(cu_q, cu_k, H, tm, tn, causal, 1, sort)
            np.testing.assert_array_equal(work, meta.max_tile_work)
            np.testing.assert_array_equal(blocks, meta.num_m_blocks)
            idx = np.arange(nb)
            # [b, b']: b' before b -- the kernel's own predicate, and the stable sort it must equal
            ahead = md.ranked_ahead(work[None, :], work[:, None], idx[None, :], idx[:, None], sort)
            order = np.argsort(-work, kind="stable") if sort else idx
            np.testing.assert_array_equal(ahead.sum(1)[order], idx)
            rank = ahead.sum(1)
            before = (ahead * blocks[None, :]).sum(1)
            batch_map = np.empty(nb, np.int64)
            batch_map[rank] = idx
            cu_tiles = np.empty(nb + 1, np.int64)
            cu_tiles[rank] = before * H
            cu_tiles[nb] = blocks.sum() * H
            np.testing.assert_array_equal(batch_map, meta.batch_map)
            np.testing.assert_array_equal(cu_tiles, meta.cu_tiles)


@pytest.mark.cpu
@pytest.mark.stage5
def test_spt_order_speaks_stage4_interface(rng):
    d = _device()
    sched = importlib.import_module("stage4_bwd_kernel.schedule")
    spt = d.SPTBackwardOrder(4)
    assert spt.name != sched.KVDescendingOrder.name and spt.name != d.SPTBackwardOrder(2).name
    for _ in range(20):
        tm, tn = int(rng.choice([64, 128])), int(rng.choice([64, 128]))
        sq = int(rng.integers(1, 3000))
        sk = int(rng.integers(1, 3000))
        N = -(-sk // tn)
        for bx in range(N):
            assert spt.n_block_for_launch(bx, N) == sched.KVDescendingOrder.n_block_for_launch(bx, N)
        for n in range(N):
            lo, hi = sched.m_block_range(n, tm, tn, sq, sk, True)
            for m in range(lo, hi):
                last = sched.n_block_last(m, tm, tn, sq, sk, True)
                r = spt.rank(n, 0, last)
                assert r == sched.KVDescendingOrder.rank(n, 0, last)
                assert r == int(spt.host_rank(n, m, sq, sk, tm, tn))  # == orders.dq_rank(descending)
            # the paper's claim: the first dQ add has rank 0 -- for every K/V block whose diagonal
            # lies inside the queries (with seqlen_k > seqlen_q the first blocks all start at m = 0)
            if lo < hi and tm == tn and n * tn + sq - sk >= 0:
                assert spt.rank(n, 0, sched.n_block_last(lo, tm, tn, sq, sk, True)) == 0
    # the swizzled launch order is orders.spt_bwd, and it only waits on earlier CTAs
    N, Hkv, B = 6, 5, 2
    t = spt.host_order(N, Hkv, B)
    assert as_list(t) == [d.sectioned_tile(i, N, Hkv, 4, True) for i in range(N * Hkv * B)]
    pos = {tile: i for i, tile in enumerate(as_list(t))}
    for (n, h, b), i in pos.items():
        assert all(pos[(n2, h, b)] < i for n2 in range(n + 1, N))


@pytest.mark.cpu
@pytest.mark.stage5
def test_scheduler_objects():
    d = _device()
    assert d.LPTCausalScheduler(4) == d.LPTCausalScheduler(4) and len({d.LPTCausalScheduler(4),
                                                                      d.LPTCausalScheduler(4)}) == 1
    assert d.LPTCausalScheduler(4) != d.SectionedScheduler(4, True)  # different classes, different kernels
    assert d.LPTCausalScheduler(4) != d.LPTCausalScheduler(4, flat_batches=True)
    assert d.LPTCausalScheduler.from_problem(8192, 128, 8, 2, flat_batches=True) == \
        d.GQALPTCausalScheduler.for_group(2, 4, flat_batches=True)
    with pytest.raises(ValueError, match="heads_per_section"):
        d.LPTCausalScheduler(0)
    with pytest.raises(ValueError, match="multiple"):
        d.GQALPTCausalScheduler(heads_per_section=6, qheads_per_kvhead=4)
    g = d.GQALPTCausalScheduler.for_group(2, 4)
    assert g.heads_per_section == 8
    g.check_problem(16, 4)
    with pytest.raises(ValueError, match="groups of 4"):
        g.check_problem(16, 8)
    with pytest.raises(ValueError, match="whole KV groups"):
        d.LPTCausalScheduler(3).check_problem(8, 2)
    # from_problem: 8k keys, d = 128 -> 6 heads fit, rounded to 4; MQA-8 -> one group of 8
    assert d.LPTCausalScheduler.from_problem(8192, 128, 16) == d.LPTCausalScheduler(4)
    mqa = d.LPTCausalScheduler.from_problem(8192, 128, 8, 1)
    assert isinstance(mqa, d.GQALPTCausalScheduler) and mqa.heads_per_section == 8
    assert d.LPTCausalScheduler.from_problem(1024, 128, 4) == d.LPTCausalScheduler(4)  # clamped to H
    with pytest.raises(TypeError, match="cu_tiles"):
        d.VarlenLPTScheduler(2).grid_shape(1, 1, 1)


@pytest.mark.cpu
@pytest.mark.stage5
def test_varlen_schedule_on_cpu_tensors_and_cache(rng):
    import torch

    md = _metadata()
    cu_q, cu_k = (torch.from_numpy(a) for a in random_batch(rng, 20))
    s = md.VarlenSchedule(cu_q, cu_k, 8, max_seqlen_k=8192)
    meta = orders.varlen_metadata(cu_q.numpy(), cu_k.numpy(), 8, 128, 128, True, 4)
    assert s.heads_per_section == 4 and s.scheduler == _device().LPTCausalScheduler(4)
    for name in ("batch_map", "num_m_blocks", "cu_tiles", "max_tile_work"):
        np.testing.assert_array_equal(getattr(s, name).numpy(), getattr(meta, name))
    assert s.num_tiles == meta.num_tiles and set(s.step4_kwargs()) == {"batch_map", "scheduler"}
    # seqused_k replaces the key lengths
    used = torch.minimum(torch.diff(cu_k), torch.full((20,), 100, dtype=torch.int32))
    s2 = md.VarlenSchedule(cu_q, cu_k, 8, seqused_k=used)
    cu_used = np.concatenate([[0], np.cumsum(used.numpy())])
    np.testing.assert_array_equal(s2.max_tile_work.numpy(),
                                  orders.varlen_metadata(cu_q.numpy(), cu_used, 8, 128, 128).max_tile_work)
    # cache: same tensors -> same object; in-place change of the lengths -> recomputed
    a = md.VarlenSchedule.cached(cu_q, cu_k, 8)
    assert md.VarlenSchedule.cached(cu_q, cu_k, 8) is a
    assert md.VarlenSchedule.cached(cu_q, cu_k, 8, causal=False) is not a
    cu_k2 = cu_k.clone()
    assert md.VarlenSchedule.cached(cu_q, cu_k2, 8) is not md.VarlenSchedule.cached(cu_q, cu_k, 8)
    b = md.VarlenSchedule.cached(cu_q, cu_k, 8)
    cu_q[1:] += 1
    assert md.VarlenSchedule.cached(cu_q, cu_k, 8) is not b
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        md.VarlenSchedule(cu_q.long(), cu_k, 8)


# ======================================================================================== compile
def _assert_clean(rep):
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, f"spills: {rep}"
    assert rep["stack_frame"] == 0, f"stack frame: {rep}"
    assert rep["LDL/STL"] in (0, None), "local-memory traffic in SASS"


@pytest.mark.compile
@pytest.mark.stage5
def test_step3_compiles_with_lpt_scheduler():
    d = _device()
    from stage3_fwd_kernel.tile_scheduler import StaticTileScheduler

    lpt = d.step3_compile(d.LPTCausalScheduler(4), "bf16", 128, 128, causal=True)
    _assert_clean(lpt.report)
    assert lpt.report["HGMMA"] and lpt.report["UTMALDG"] and lpt.report["threads"] == 384
    assert "C7508" not in lpt.report["ptxas_log"], "ptxas ignored setmaxnreg"
    # the scheduler is a handful of integer ops at the top: same register budget as the static grid
    static = d.step3_compile(StaticTileScheduler, "bf16", 128, 128, causal=True)
    assert lpt.report["registers"] == static.report["registers"]
    assert "%nctaid" in lpt.ptx and "%nctaid" not in static.ptx  # the extents come from gridDim


@pytest.mark.compile
@pytest.mark.stage5
def test_step4_varlen_compiles_with_lpt_scheduler():
    s4 = _step4()
    d = _device()
    comp = s4.compile_only("bf16", 128, causal=True, varlen=True, batch_map=True, scheduler=d.LPTCausalScheduler(4))
    _assert_clean(comp.report)


@pytest.mark.compile
@pytest.mark.stage5
@pytest.mark.parametrize("sort,used", [(True, False), (True, True), (False, False)])
def test_metadata_kernel_compiles(sort, used):
    comp = _metadata().compile_metadata(128, 128, causal=True, sort=sort, has_seqused_k=used)
    _assert_clean(comp.report)
    assert comp.report["threads"] == _metadata().NUM_THREADS
    assert comp.report["registers"] is not None and comp.report["registers"] <= 64  # 1024 threads


@pytest.mark.compile
@pytest.mark.stage5
def test_probes_compile():
    d = _device()
    for name, *_, sched in _fixed_cases():
        d.compile_probe(sched)
    fn = d.compile_probe(d.VarlenLPTScheduler(2), varlen=True)
    assert fn is not None


# ============================================================================================ gpu
@pytest.mark.gpu
@pytest.mark.stage5
@pytest.mark.parametrize("case", range(9), ids=lambda i: ["mha-lpt4", "gqa-12q-3kv", "odd-7h-s2",
                                                           "s-wider-than-h", "mqa-8", "one-block", "naive",
                                                           "static", "no-sections"][i])
def test_probe_equals_orders(case):
    d = _device()
    name, M, H, B, sched = _fixed_cases()[case]
    tiles, valid = d.probe_order(sched, M, H, B)
    assert valid.all()
    assert as_list(tiles) == as_list(_oracle(sched, M, H, B)), name


@pytest.mark.gpu
@pytest.mark.stage5
def test_metadata_kernel_equals_oracle(rng):
    import torch

    md = _metadata()
    cases = [1, 2, 7, 64, 1000, 1500, 2100]  # > 1024: several chunks and several outer rounds
    for nb in cases:
        cu_q, cu_k = random_batch(rng, nb, max_len=int(rng.choice([200, 3000, 20000])))
        H = int(rng.integers(1, 33))
        tm, tn = int(rng.choice([64, 128])), int(rng.choice([64, 128]))
        causal = bool(rng.random() < 0.7)
        for sort in (True, False):
            got = md.varlen_metadata_device(torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda(), H,
                                            tile_m=tm, tile_n=tn, causal=causal, sort=sort)
            want = orders.varlen_metadata(cu_q, cu_k, H, tm, tn, causal, 1, sort)
            for key in ("batch_map", "num_m_blocks", "cu_tiles", "max_tile_work"):
                np.testing.assert_array_equal(got[key].cpu().numpy(), getattr(want, key),
                                              err_msg=f"{key} nb={nb} sort={sort}")
    # seqused_k: the first seqused_k[b] keys count
    cu_q, cu_k = random_batch(rng, 50)
    used = (np.diff(cu_k) * rng.random(50)).astype(np.int32)
    got = md.varlen_metadata_device(torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda(), 4,
                                    seqused_k=torch.from_numpy(used).cuda())
    want = orders.varlen_metadata(cu_q, np.concatenate([[0], np.cumsum(used)]), 4, 128, 128)
    for key in ("batch_map", "num_m_blocks", "cu_tiles", "max_tile_work"):
        np.testing.assert_array_equal(got[key].cpu().numpy(), getattr(want, key), err_msg=key)
    # all sequences empty, and a single empty one
    for cu in ([0, 0, 0, 0], [0, 0]):
        cu_t = torch.tensor(cu, dtype=torch.int32).cuda()
        got = md.varlen_metadata_device(cu_t, cu_t, 3)
        assert got["cu_tiles"].cpu().tolist() == [0] * len(cu)
        assert got["batch_map"].cpu().tolist() == list(range(len(cu) - 1))


@pytest.mark.gpu
@pytest.mark.stage5
def test_varlen_schedulers_equal_lpt_varlen(rng):
    """Device metadata -> compact VarlenLPTScheduler (and, separately, LPT on the padded grid) ->
    the tiles of orders.lpt_varlen, in order."""
    import torch

    d, md = _device(), _metadata()
    for nb, H in [(5, 4), (37, 6), (200, 3)]:
        cu_q, cu_k = random_batch(rng, nb)
        sched = md.VarlenSchedule(torch.from_numpy(cu_q).cuda(), torch.from_numpy(cu_k).cuda(), H,
                                  heads_per_section=min(4, H))
        meta = orders.varlen_metadata(cu_q, cu_k, H, 128, 128, True, sched.heads_per_section)
        want = as_list(orders.list_order(orders.lpt_varlen, meta.num_tiles, meta))
        if meta.num_tiles == 0:
            continue
        # compact: one CTA per tile, plus 40 spare CTAs that must report invalid
        tiles, valid = d.probe_varlen_order(sched.varlen_scheduler, sched.cu_tiles.cpu().numpy(), H,
                                            num_ctas=meta.num_tiles + 40)
        assert valid[:meta.num_tiles].all() and not valid[meta.num_tiles:].any()
        batch = meta.batch_map[tiles.batch[:meta.num_tiles]]
        got = list(zip(tiles.block[:meta.num_tiles].tolist(), tiles.head[:meta.num_tiles].tolist(), batch.tolist()))
        assert got == want
        # padded (step 4 today): filter the CTAs whose m_block is past their sequence
        M = int(meta.num_m_blocks.max())
        tiles, _ = d.probe_order(sched.scheduler, M, H, nb)
        b = meta.batch_map[tiles.batch]
        real = tiles.block < meta.num_m_blocks[b]
        assert list(zip(tiles.block[real].tolist(), tiles.head[real].tolist(), b[real].tolist())) == want


@pytest.mark.gpu
@pytest.mark.stage5
@pytest.mark.parametrize("b,s,h,hkv", [(2, 1000, 6, 6), (1, 2048, 12, 3), (3, 333, 8, 1)])
def test_step3_lpt_bitwise_equals_static(b, s, h, hkv):
    """Same per-tile math, only the order of tiles changes: the outputs are identical bits."""
    import torch

    d = _device()
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(b, s, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(b, s, hkv, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    lpt = d.LPTCausalScheduler(4) if hkv == h else d.GQALPTCausalScheduler.for_group(1, h // hkv)
    o_ref, lse_ref = d.step3_forward(q, k, v, causal=True)
    for sched in (lpt, d.LPTNoSectionsScheduler()):
        o = torch.full_like(o_ref, float("nan"))
        lse = torch.full_like(lse_ref, float("nan"))
        d.step3_forward(q, k, v, causal=True, scheduler=sched, out=o, lse=lse)
        torch.cuda.synchronize()
        assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref), sched


@pytest.mark.gpu
@pytest.mark.stage5
def test_step4_varlen_sorted_bitwise_equals_unsorted(rng):
    import torch

    s4 = _step4()
    md = _metadata()
    H, Hkv = 4, 2
    lens = [37, 0, 1500, 129, 640, 0, 3000, 5]
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device="cuda")
    total = int(cu_q[-1])
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(total, H, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(total, Hkv, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(total, Hkv, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    ms = max(lens)
    o_ref, lse_ref = s4.attention_varlen_forward(q, k, v, cu_q, cu_q, ms, ms, causal=True)
    sched = md.VarlenSchedule(cu_q, cu_q, H, heads_kv=Hkv, max_seqlen_k=ms)
    assert sched.batch_map.cpu().tolist() == list(orders.varlen_metadata(cu_q.cpu().numpy(), cu_q.cpu().numpy(),
                                                                         H, 128, 128).batch_map)
    o, lse = s4.attention_varlen_forward(q, k, v, cu_q, cu_q, ms, ms, causal=True, **sched.step4_kwargs())
    torch.cuda.synchronize()
    assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)


@pytest.mark.gpu
@pytest.mark.stage5
def test_spt_order_runs_in_stage4_deterministic_backward():
    """The SPT order object plugs into stage 4 and gives the same bits as KVDescendingOrder (same
    launch and reduction order; the swizzle is inert until stage 4 calls tile_for_launch)."""
    import torch

    bwd = _stage4()
    sched = importlib.import_module("stage4_bwd_kernel.schedule")
    d = _device()
    g = torch.Generator(device="cuda").manual_seed(2)
    b, s, h = 1, 1024, 4
    q, k, v, dout = (torch.randn(b, s, h, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    o, lse = d.step3_forward(q, k, v, causal=True)
    res = [bwd.attention_backward(q, k, v, o, dout, lse, causal=True, deterministic=True, dq_order=order)
           for order in (d.SPTBackwardOrder(2), sched.KVDescendingOrder, d.SPTBackwardOrder(2))]
    for x, y in zip(res[0], res[1]):
        assert torch.equal(x, y)
    for x, y in zip(res[0], res[2]):
        assert torch.equal(x, y)
    # the same bits must also be right: dq, dk, dv under FA4's rule (fp32 truth, bf16 PyTorch baseline)
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref

    def grads(upcast):
        ins = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        out = attention_ref(*(t.float() if upcast else t for t in ins), causal=True, upcast=upcast)[0]
        out.backward(dout.float() if upcast else dout)
        return [t.grad for t in ins]

    for name, got, truth, base in zip(("dq", "dk", "dv"), res[0][:3], grads(True), grads(False)):
        assert_fa4_close(f"SPT order {name}", got, truth, base)


@pytest.mark.gpu
@pytest.mark.stage5
def test_dispatch_follows_linear_index():
    """What every order here rests on: CTAs start in increasing linear index, x fastest. Tickets
    from an atomic counter can be reordered among CTAs dispatched at the same moment, so the check
    is statistical: displacement small against the grid, correlation near 1, for a 3-D grid as for
    the equivalent 1-D one."""
    import torch

    d = _device()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wave = 16 * sms  # resident CTAs of 128 threads: 2048 / 128 = 16 per SM
    for grid in [(64, 16, 64), (64 * 16 * 64, 1, 1)]:  # 65536 CTAs, ~30 waves
        t = d.probe_dispatch(grid).astype(np.int64)
        n = t.size
        assert sorted(t.tolist()) == list(range(n))
        disp = np.abs(t - np.arange(n))
        # the first wave starts all at once (any order inside it); after that a CTA starts when
        # one ends, so it can be early or late by about a wave, not more
        assert np.quantile(disp, 0.99) <= 2 * wave, (grid, np.quantile(disp, 0.99))
        assert np.corrcoef(t, np.arange(n))[0, 1] > 0.99


@pytest.mark.cpu
@pytest.mark.stage5
def test_fast_div_bound_and_the_grid_check():
    """fast_div's fp32 estimate is within one of the quotient below FAST_DIV_MAX (the correction makes
    it exact): its formula replayed in NumPy with the reciprocal off by up to 2 ulp, as rcp.approx may
    be; a flat scheduler refuses grids past the bound before any launch."""
    from stage3_fwd_kernel.intdiv import fast_div_formula

    d = _device()
    rng = np.random.default_rng(1)
    for b in [1, 2, 3, 7, 127, 128, 640, 4096, 99991, (1 << 21) - 1]:
        a = np.concatenate([rng.integers(0, d.FAST_DIV_MAX, 4000), np.arange(1, 200) * b - 1, np.arange(1, 200) * b])
        a = a[(a >= 0) & (a < d.FAST_DIV_MAX)]
        r0 = np.float32(1.0) / np.float32(b)
        for steps in (-2, -1, 0, 1, 2):
            rcp = r0
            for _ in range(abs(steps)):
                rcp = np.nextafter(rcp, np.float32(np.inf if steps > 0 else -np.inf), dtype=np.float32)
            got = fast_div_formula(a, b, np.float32, lambda x, rcp=rcp: rcp, lambda x: np.asarray(x).astype(np.int64))
            assert np.array_equal(got, a // b), (b, steps)
    assert d.fast_div(1000, 7) == 142 and np.array_equal(d.fast_div(np.arange(10), 3), np.arange(10) // 3)
    d.LPTCausalScheduler(4, flat_batches=True).check_grid(128, 64, 8)
    d.LPTCausalScheduler(4).check_grid(1 << 12, 1 << 10, 1)  # per-batch sections divide exactly: no bound
    with pytest.raises(ValueError, match="flat LPT sections"):
        d.LPTCausalScheduler(4, flat_batches=True).check_grid(1 << 12, 1 << 10, 1)
