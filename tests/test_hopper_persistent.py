"""The production Hopper forward on persistent CTAs (`stage3_fwd_kernel.tile_scheduler`): the
persistent scheduler's order and validation, the split tail (the last partial wave's tiles cut into
key chunks, merged by `split_combine`), the split-KV merge (`split_combine.PartsCombine`, also with
rows packed by query token), stage 5's LPT order walked by persistent CTAs, and persistent varlen.

cpu tier: the schedulers' validation and tile orders, the split tail's plan. compile tier: the
persistent and split-tail builds (no spills; the merge kernels). gpu tier (H100/H200): the same bits
as the one-tile-per-CTA grid, the split tail against whole tiles, the merges against torch's formula.
The helpers (references, random inputs, the varlen batches) are test_hopper_forward's.
"""
from __future__ import annotations

import pytest
import test_hopper_forward as hf  # the forward tests' helpers (pytest puts tests/ on the path)
import test_hopper_forward_varlen as hfv  # ... and its varlen batches


# ---- persistent CTAs (tile_scheduler.PersistentScheduler) -------------------------------------------------
@pytest.mark.cpu
@pytest.mark.stage3
def test_persistent_scheduler_validation_and_order():
    from stage3_fwd_kernel import host_io, tile_scheduler

    P = tile_scheduler.PersistentScheduler
    static = tile_scheduler.StaticTileScheduler
    assert P() == P(static, None) and hash(P()) == hash(P(static))
    assert P(num_ctas=7) != P(num_ctas=8) and P(num_ctas=7) != P() and P(dynamic=True) != P()
    with pytest.raises(TypeError, match="dynamic"):
        P(dynamic=1)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_ctas"):
            P(num_ctas=bad)
    with pytest.raises(TypeError, match="tile_at"):
        P(order=object())
    with pytest.raises(TypeError, match="persistent"):
        P(order=P())
    # the static order's tile_at is the hardware's dispatch order of the (M, H, B) grid, x fastest
    M, H, B = 3, 4, 2
    tiles = [tile_scheduler.StaticTileScheduler.tile_at(i, M, H, B) for i in range(M * H * B)]
    assert tiles == [(m, h, b) for b in range(B) for h in range(H) for m in range(M)]
    mod = hf._mod()
    bf16 = host_io.cutlass_dtype("bf16")
    # Q + O + 2 K/V stages exceed 227 KB above head dim 128: O then goes from registers to global memory
    for d, dv in ((128, 128), (192, 128), (256, 256)):
        assert mod.make_kernel(bf16, d, dv, False, scheduler=P()).o_direct == (d > 128)
        assert mod.o_fits_beside_q(d, dv, mod.default_tile_n(d, dv), 128) == (d <= 128)
        assert not mod.make_kernel(bf16, d, dv, False).o_direct  # one CTA per tile: O over Q
    with pytest.raises(ValueError, match="num_stages.*shared memory"):  # Q + 3 stages of (192, 128)
        mod.FlashAttentionForwardSm90(bf16, 192, 128, False, scheduler=P(), num_stages=3)
    with pytest.raises(TypeError, match="persistent"):
        mod._resolve_scheduler(None, 1, 128, 128, False)
    assert mod._resolve_scheduler(None, True, 256, 256, False) == P()  # asked for: allowed, o_direct
    # the default: dense calls wherever Q, O and two K/V stages fit (head dims <= 128), the dynamic
    # hand-out for causal ones, except causal at d = 64 (192-row tiles) from 4096 keys on
    assert mod._resolve_scheduler(None, None, 128, 128, False) == P()
    assert mod._resolve_scheduler(None, None, 128, 128, True, seqlen_k=16384) == P(dynamic=True)
    assert mod._resolve_scheduler(None, None, 64, 64, True, seqlen_k=4095) == P(dynamic=True)
    assert mod._resolve_scheduler(None, None, 64, 64, True) == P(dynamic=True)  # no length: the short choice
    assert mod._resolve_scheduler(None, None, 64, 64, True, seqlen_k=4096) is tile_scheduler.StaticTileScheduler
    assert mod._resolve_scheduler(None, None, 64, 64, True, seqlen_k=4096, tile_m=128) == P(dynamic=True)
    # a left window keeps every tile ~window / tile_n blocks long: persistent at any length (and causal: dynamic)
    assert mod._resolve_scheduler(None, None, 64, 64, True, seqlen_k=16384, left_window=True) == P(dynamic=True)
    assert mod._resolve_scheduler(None, None, 64, 64, False, seqlen_k=16384, left_window=True) == P()
    # a window's tiles differ in length near the sequence's ends: the atomic hand-out, causal or not
    assert mod._resolve_scheduler(None, None, 64, 64, False, seqlen_k=4096, left_window=True,
                                  windowed=True) == P(dynamic=True)
    assert mod._resolve_scheduler(None, None, 128, 128, False, windowed=True) == P(dynamic=True)
    assert mod._resolve_scheduler(None, None, 64, 64, True, varlen=True, left_window=True) is \
        tile_scheduler.StaticTileScheduler
    assert mod._resolve_scheduler(None, None, 64, 64, False, seqlen_k=16384) == P()
    assert mod._resolve_scheduler(None, None, 128, 128, False, varlen=True) is tile_scheduler.StaticTileScheduler
    assert mod._resolve_scheduler(None, True, 128, 128, True) == P(dynamic=True)  # causal: dynamic hand-out
    assert mod._resolve_scheduler(None, True, 64, 64, False, varlen=True) == P(dynamic=True)
    assert mod._resolve_scheduler(None, None, 192, 128, False) is tile_scheduler.StaticTileScheduler
    assert mod._resolve_scheduler(None, False, 64, 64, False) is tile_scheduler.StaticTileScheduler
    assert mod._resolve_scheduler(P(num_ctas=3), None, 64, 64, False) == P(num_ctas=3)  # already persistent
    assert mod._resolve_scheduler(P(num_ctas=3), True, 64, 64, False) == P(num_ctas=3)
    with pytest.raises(ValueError, match="persistent"):  # contradicts the scheduler: refused, not ignored
        mod._resolve_scheduler(P(num_ctas=3), False, 64, 64, False)
    assert mod._launch_ctas(P(num_ctas=3), None) == 3 and mod._launch_ctas(static, None) == 1


PERSISTENT_COMPILE = [(64, 64, False, False), (64, 64, True, True), (96, 96, True, False), (128, 128, False, False),
                      (128, 128, True, True), (192, 128, True, False), (256, 256, False, False)]


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv,causal,varlen", PERSISTENT_COMPILE,
                         ids=[f"d{d}-{'causal' if c else 'full'}{'-varlen' if v else ''}" for d, _, c, v in
                              PERSISTENT_COMPILE])
def test_persistent_compiles_sm90a(d, dv, causal, varlen):
    """The tile loop fits the consumers' setmaxnreg budget without spills, O has its own buffer (head
    dims <= 128) or goes from registers to global memory in 4-byte stores (o_direct, above), and the
    grid is one CTA per SM at most (the launcher's min)."""
    import re

    from stage3_fwd_kernel import host_io, tile_scheduler

    sched = tile_scheduler.PersistentScheduler()
    comp = hf._mod().compile_only("bf16", d, dv, causal, varlen=varlen, seqused_k=varlen, scheduler=sched)
    rep = comp.report
    kernel = hf._mod().make_kernel(host_io.cutlass_dtype("bf16"), d, dv, causal, scheduler=sched)
    assert rep["spill_stores"] == rep["spill_loads"] == rep["stack_frame"] == rep["LDL/STL"] == 0, rep
    assert not rep["wgmma_serialized"]
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", comp.sass)) + 1 <= kernel.regs_consumer
    q_o = 2 * kernel.tile_m * (d + (0 if kernel.o_direct else dv))
    assert q_o + 2 * kernel.num_stages * kernel.tile_n * (d + dv) <= rep["smem_bytes"] <= 227 * 1024
    assert kernel.num_stages >= 2 and kernel.o_direct == (d > 128)
    # o_direct: each consumer thread stores its dv / 2 O values in pairs (32-bit STG), plus its lse
    stores = re.findall(r"\bSTG\.E(\.\d+)?\b", comp.sass)
    if kernel.o_direct:
        assert len(stores) == dv // 4 + 2 and not any(stores), stores
    else:
        assert all(w == ".128" for w in stores if w), stores  # 16-byte stores from the O buffer


PERSISTENT_SEQLENS = [(1, 1), (113, 203), (239, 1), (799, 3), (300, 70), (1024, 1024), (4224, 4224)]


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)],
                         ids=["d64", "d96", "d128", "d192x128", "d256"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", PERSISTENT_SEQLENS, ids=[f"{a}x{b}" for a, b in PERSISTENT_SEQLENS])
def test_persistent_matches_static(d, dv, causal, sq, sk):
    """Persistent CTAs compute each tile with the same operations as one CTA per tile: FA4's rule
    and bitwise the static kernel's result, with 5 CTAs (each walks many tiles: the ring position
    and Q's phase carry across tiles, including tiles without a visible key, 300 x 70 causal) and
    with one CTA per SM (bitwise where both walk the same key tiles, _same_key_tiles). Above head dim
    128 O goes from registers to global memory (o_direct): the same values, other stores, rows past
    seqlen_q skipped."""
    import torch

    from stage3_fwd_kernel import tile_scheduler

    big = sq * sk > 2_000_000
    heads = 2 if big else 8
    ratio = 2 if big else [1, 2, 8][(sq + sk + d) % 3]
    q, k, v = hf._randn_qkv(1 if big else 3, sq, sk, heads, heads // ratio, d, dv, seed=sq + sk + d + 5)
    static = hf._dense(q, k, v, causal=causal, persistent=False)
    P = tile_scheduler.PersistentScheduler
    # persistent=True alone: one CTA per SM, the dynamic hand-out for causal calls
    # (split_tail off: a split tail is the same result up to the order of additions, test_split_tail_*)
    runs = [hf._dense(q, k, v, causal=causal, scheduler=sched, persistent=True, split_tail=False)
            for sched in (P(num_ctas=5), P(num_ctas=5, dynamic=True), None)]
    want = static if _same_key_tiles(d, dv, causal) else runs[0]
    assert all(torch.equal(out, want[0]) and torch.equal(lse, want[1]) for out, lse in runs)


def _same_key_tiles(d, dv, causal):
    """Whether one CTA per tile and persistent CTAs walk the same key tiles, so that their sums agree
    bitwise: not on d = 96's 192-row tile (144 keys one CTA per tile, 128 persistent: config.default_tile_n),
    where the persistent walks agree with each other and each result is held to FA4's rule."""
    mod = hf._mod()
    tile_m = mod.default_tile_m(d, dv, causal)
    return len({mod.default_tile_n(d, dv, tile_m, plain=True, persistent=p) for p in (False, True)}) == 1


@pytest.mark.cpu
@pytest.mark.stage3
def test_split_tail_plan():
    """Which calls split their last partial wave, into how many key chunks, and the errors."""
    s4 = hf._mod()
    from stage3_fwd_kernel import tile_scheduler

    P = tile_scheduler.PersistentScheduler
    static, dynamic = P(tile_scheduler.StaticTileScheduler), P(tile_scheduler.StaticTileScheduler, dynamic=True)

    def plan(split=None, sched=static, causal=False, b=2, sq=16384, h=16, sk=16384, tm=128, ctas=132):
        return s4.split_tail_plan(split, sched, causal, b, sq, h, sk, tm, 128, ctas)

    # the benchmark's d = 128 shapes: 4096 tiles = 31 waves of 132 + 4 tiles, 33 chunks of 4 / 2 blocks
    assert plan() == (4, 33)
    assert plan(b=4, sq=8192, sk=8192) == (4, 33)
    assert plan(b=8, sq=4096, sk=4096) is None                     # 32 key blocks: below the default's 64
    assert plan(True, b=8, sq=4096, sk=4096) == (4, 32)            # ... unless asked: one block a chunk
    assert plan(True, b=16, sq=2048, sk=2048) == (4, 16)           # chunks never outnumber the key blocks
    assert plan(b=1, h=33) is None                                 # 4224 tiles: whole waves, nothing to split
    assert plan(h=1, b=1) is None                                  # 128 tiles: less than a wave
    assert plan(sq=16384 - 64) is None                             # a partial query tile: no split
    assert plan(h=32, tm=192, sq=192 * 86) is None                 # 5504 tiles: a last wave of 92, not two chunks each
    assert plan(h=32, b=1, sq=128 * 133) == (32, 4)                # 4256 tiles: 32 left over, 4 chunks each
    assert plan(False) is None and plan(sched=dynamic) is None and plan(causal=True) is None
    assert plan(sched=tile_scheduler.StaticTileScheduler) is None
    for bad in ({"sched": dynamic}, {"causal": True}, {"sched": tile_scheduler.StaticTileScheduler}):
        with pytest.raises(ValueError, match="split_tail"):
            plan(True, **bad)
    with pytest.raises(TypeError, match="split_tail"):
        plan(1)


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256)], ids=["d64", "d128", "d256"])
def test_split_tail_compiles_sm90a(d, dv):
    """The split build (persistent, non-causal): no spills, no serialized wgmma, and the same hot loop
    as the unsplit build up to the loop bounds (a chunk walks keys [n_block_min, n_block_max))."""
    from stage3_fwd_kernel.sass_report import key_block_loop

    s4 = hf._mod()
    split = s4.compile_only(head_dim=d, head_dim_v=dv, persistent=True, split_tail=True)
    whole = s4.compile_only(head_dim=d, head_dim_v=dv, persistent=True)
    rep = split.report
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["wgmma_serialized"] == []
    assert rep["registers"] <= 168
    loop_split, loop_whole = key_block_loop(split.sass), key_block_loop(whole.sass)
    # the bounds' bookkeeping lands in uniform or vector registers by build: a few instructions either way
    assert abs(len(loop_split) - len(loop_whole)) <= len(loop_whole) // 50
    assert sorted(op for op in loop_split if op.startswith(("HGMMA", "MUFU", "F2FP"))) == \
        sorted(op for op in loop_whole if op.startswith(("HGMMA", "MUFU", "F2FP")))


SPLIT_CASES = [  # (d, dv, dtype, heads, heads_kv, seqlen_k): 3 query tiles a head, 2 sequences, 7 CTAs
    (128, 128, "bf16", 5, 5, 1000), (128, 128, "fp16", 4, 2, 4224), (64, 64, "bf16", 5, 1, 300),
    (192, 128, "bf16", 5, 5, 777), (256, 256, "bf16", 4, 4, 129), (96, 96, "bf16", 6, 3, 2048)]


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv,dtype,hq,hkv,sk", SPLIT_CASES, ids=[f"d{c[0]}x{c[1]}-{c[2]}-h{c[3]}/{c[4]}-k{c[5]}"
                                                                    for c in SPLIT_CASES])
def test_split_tail_matches_whole_tiles(d, dv, dtype, hq, hkv, sk):
    """split_tail on 7 persistent CTAs: the tiles of the full waves are bitwise those of the unsplit
    call, the last wave's tiles (cut into key chunks, merged by split_tail_combine) pass FA4's rule
    against the fp32 reference like everything else, and a second run gives the same bits."""
    import torch

    from stage3_fwd_kernel import tile_scheduler

    s4 = hf._mod()
    tile_m = s4.default_tile_m(d, dv)
    sq, b, ctas = 3 * tile_m, 2, 7
    q, k, v = hf._randn_qkv(b, sq, sk, hq, hkv, d, dv, dtype, seed=sk + d)
    sched = tile_scheduler.PersistentScheduler(num_ctas=ctas)
    tail, chunks = s4.split_tail_plan(True, sched, False, b, sq, hq, sk, tile_m, s4.default_tile_n(d, dv), ctas)
    assert tail == (3 * hq * b) % ctas and chunks >= 2
    whole = hf._dense(q, k, v, causal=False, scheduler=sched, persistent=True, split_tail=False)
    split = hf._dense(q, k, v, causal=False, scheduler=sched, persistent=True, split_tail=True)
    again = hf._dense(q, k, v, causal=False, scheduler=sched, persistent=True, split_tail=True)
    assert torch.equal(split[0], again[0]) and torch.equal(split[1], again[1])
    batch_idx, rows, head_idx = _tail_rows(3 * hq * b, tail, 3, hq, tile_m, "cuda")
    in_tail = torch.zeros(b, sq, hq, dtype=torch.bool, device="cuda")
    in_tail[batch_idx, rows, head_idx] = True
    assert torch.equal(split[0][~in_tail], whole[0][~in_tail])
    assert torch.equal(split[1].transpose(1, 2)[~in_tail], whole[1].transpose(1, 2)[~in_tail])
    # ... and the tail really went through the chunks (a different summation order)
    assert not torch.equal(split[1].transpose(1, 2)[in_tail], whole[1].transpose(1, 2)[in_tail])


def _tail_rows(tiles, tail, num_m_blocks, heads, tile_m, device):
    """(batch (R, 1), query rows (R, tile_m), head (R, 1)) of the last R tiles of the static order
    (tile_scheduler.StaticTileScheduler.tile_at applied to a tensor of linear indices)."""
    import torch

    from stage3_fwd_kernel import tile_scheduler

    linear = torch.arange(tiles - tail, tiles, device=device)
    m_block, head, batch = tile_scheduler.StaticTileScheduler.tile_at(linear, num_m_blocks, heads, None)
    rows = m_block[:, None] * tile_m + torch.arange(tile_m, device=device)
    return batch[:, None], rows, head[:, None]


def _split_tail_combine_torch(split, tail, chunks, out, lse, num_m_blocks):
    """split_tail_combine's formula in torch: lse = log sum_j exp(lse_j), O = sum_j exp(lse_j - lse) O_j."""
    import torch

    b, _, heads, dv = out.shape
    tile_m = split.shape[1]
    work = split.view(tail, chunks, tile_m, dv + 1)
    part_lse = work[..., dv]                                            # (R, S, tile_m)
    lse_rows = torch.logsumexp(part_lse, dim=1)                         # (R, tile_m)
    weight = torch.exp(part_lse - lse_rows[:, None])                    # (R, S, tile_m)
    o_rows = torch.einsum("rsm,rsmd->rmd", weight, work[..., :dv])      # (R, tile_m, dv)
    batch_idx, rows, head_idx = _tail_rows(num_m_blocks * heads * b, tail, num_m_blocks, heads, tile_m,
                                           str(out.device))
    out[batch_idx, rows, head_idx] = o_rows.to(out.dtype)
    lse[batch_idx, head_idx, rows] = lse_rows


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("dtype,dv", [("bf16", 128), ("fp16", 64), ("bf16", 256), ("bf16", 96)])
def test_split_combine_kernel_matches_torch(dtype, dv):
    """split_combine's kernel against the same formula in torch, on a random workspace: chunks whose
    rows saw nothing (lse -inf) weigh 0, a row that no chunk saw gets O = 0 and lse = -inf, and only
    the tail tiles' rows of out / lse are written."""
    import torch

    s4 = hf._mod()
    g = torch.Generator(device="cuda").manual_seed(dv)
    b, heads, tile_m, m_blocks, tail, chunks = 2, 3, 128, 4, 5, 7
    tiles = b * heads * m_blocks
    split = torch.randn(tail * chunks, tile_m, dv + 1, device="cuda", generator=g) * 4
    split[::3, 5, dv] = float("-inf")               # some chunks saw nothing in row 5
    split[:chunks, 9, dv] = float("-inf")           # no chunk of the first tail tile saw its row 9
    outs = []
    for combine in (s4.split_tail_combine, _split_tail_combine_torch):
        out = torch.full((b, m_blocks * tile_m, heads, dv), 7.0, device="cuda", dtype=hf._tdt(dtype))
        lse = torch.full((b, heads, m_blocks * tile_m), 7.0, device="cuda")
        combine(split, tail, chunks, out, lse, m_blocks)
        outs.append((out, lse))
    (out, lse), (ref_out, ref_lse) = outs
    batch_idx, rows, head_idx = _tail_rows(tiles, tail, m_blocks, heads, tile_m, "cuda")
    first_b, first_row, first_h = batch_idx[0, 0], rows[0, 9], head_idx[0, 0]
    assert lse[first_b, first_h, first_row] == float("-inf") and (out[first_b, first_row, first_h] == 0).all()
    ref_out[first_b, first_row, first_h] = 0                   # the torch formula gives NaN there
    ref_lse[first_b, first_h, first_row] = float("-inf")
    torch.testing.assert_close(out.float(), ref_out.float(), atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    untouched = torch.ones_like(lse, dtype=torch.bool)
    untouched[batch_idx, head_idx, rows] = False
    assert (lse[untouched] == 7.0).all() and (out.transpose(1, 2)[untouched] == 7.0).all()


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("dtype,dv,parts", [("bf16", 128, 5), ("fp16", 64, 2), ("bf16", 256, 1), ("bf16", 96, 9),
                                             ("bf16", 128, 33), ("fp16", 64, 70)])
def test_parts_combine_kernel_matches_torch(dtype, dv, parts):
    """split_combine.PartsCombine (flash_attn_with_kvcache's split-KV merge) against fa4._lse_merge's
    torch formula: parts that saw nothing (lse -inf) weigh 0, a row no part saw gets O = 0, lse = -inf.
    33 and 70 parts: the row's maximum and sum take 32 parts (a warp's lanes) at a time (merge_row)."""
    import torch

    from fa4._lse_merge import merge_parts
    from stage3_fwd_kernel import split_combine

    g = torch.Generator(device="cuda").manual_seed(dv + parts)
    b, r, h = 3, 7, 5
    out = torch.randn(b * parts, r, h, dv, device="cuda", generator=g).to(hf._tdt(dtype))
    lse = torch.randn(h, b * parts, r, device="cuda", generator=g) * 4
    lse[1, ::2, 3] = float("-inf")                   # some parts saw nothing in row 3 of head 1
    lse[2, :parts, 4] = float("-inf")                # no part of batch 0 saw row 4 of head 2
    got_out, got_lse = split_combine.combine_parts(out, lse, parts)
    assert got_out.shape == (b, r, h, dv) and got_lse.shape == (b, h, r) and got_out.dtype == out.dtype
    want_out, want_lse = merge_parts(out.float().view(b, parts, r, h, dv), lse.permute(1, 2, 0).reshape(b, parts, r, h),
                                     dim=1)
    assert got_lse[0, 2, 4] == float("-inf") and (got_out[0, 4, 2] == 0).all()
    torch.testing.assert_close(got_out.float(), want_out, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got_lse, want_lse.transpose(1, 2), atol=1e-4, rtol=1e-5)
    # into a strided view of a larger result (flash_attn_with_kvcache's packed heads): the same bits
    final = torch.full((b, h, r, dv), float("nan"), device="cuda", dtype=out.dtype)
    view = final.transpose(1, 2)                     # (b, r, h, dv), rows h * dv apart
    split_combine.combine_parts(out, lse, parts, out=view)
    assert torch.equal(view, got_out)
    with pytest.raises(ValueError, match="^out: "):
        split_combine.combine_parts(out, lse, parts, out=view.float())


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("g, tokens, parts", [(4, 3, 5), (8, 1, 2), (2, 7, 16)])
def test_parts_combine_unpacks_token_rows(g, tokens, parts):
    """rows_per_query g: parts whose rows are GQA heads packed by token (row t g + j: token t of head
    h g + j) merge straight into the (B, T, H g, dv) / (B, H g, T) layouts -- the same bits as merging
    packed and unpacking with torch afterwards, poisoned output included."""
    import torch

    from stage3_fwd_kernel import split_combine

    gen = torch.Generator(device="cuda").manual_seed(g * 100 + tokens)
    b, h, dv = 3, 2, 128
    out = torch.randn(b * parts, tokens * g, h, dv, device="cuda", generator=gen).to(torch.bfloat16)
    lse = torch.randn(h, b * parts, tokens * g, device="cuda", generator=gen) * 4
    lse[1, ::2, 0] = float("-inf")
    packed_out, packed_lse = split_combine.combine_parts(out, lse, parts)
    final = torch.full((b, tokens, h * g, dv), float("nan"), device="cuda", dtype=out.dtype)
    got_out, got_lse = split_combine.combine_parts(out, lse, parts, out=final, rows_per_query=g)
    assert got_out.data_ptr() == final.data_ptr() and got_lse.shape == (b, h * g, tokens)
    want_out = packed_out.view(b, tokens, g, h, dv).transpose(2, 3).reshape(b, tokens, h * g, dv)
    want_lse = packed_lse.view(b, h, tokens, g).transpose(2, 3).reshape(b, h * g, tokens)
    assert torch.equal(got_out, want_out) and torch.equal(got_lse, want_lse)
    with pytest.raises(ValueError, match="^rows_per_query: "):
        split_combine.combine_parts(out, lse, parts, rows_per_query=tokens * g + 1)


@pytest.mark.compile
@pytest.mark.stage3
def test_parts_combine_compiles():
    from stage3_fwd_kernel import split_combine

    for dt, dv in (("bf16", 128), ("fp16", 64), ("bf16", 256)):
        for token_rows in (False, True):
            rep = split_combine.compile_parts(dt, dv, token_rows=token_rows).report
            assert rep["spill_stores"] == 0 and rep["registers"] <= 64, rep
    with pytest.raises(ValueError, match="head_dim_v"):
        split_combine.PartsCombine(None, 80)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("d", [64, 128])
def test_persistent_lpt_order_and_repeats(d):
    """Stage 5's causal LPT order walked by persistent CTAs: the same bits as the static grid, run
    after run."""
    import torch

    from stage3_fwd_kernel import tile_scheduler
    from stage5_scheduling.device import LPTCausalScheduler

    q, k, v = hf._randn_qkv(2, 1500, 1500, 8, 2, d, d, seed=d)
    static = hf._dense(q, k, v, causal=True, persistent=False)
    for sched in (tile_scheduler.PersistentScheduler(LPTCausalScheduler(4), 11),
                  tile_scheduler.PersistentScheduler(LPTCausalScheduler(4), 11, dynamic=True)):
        first = hf._dense(q, k, v, causal=True, scheduler=sched)
        assert torch.equal(first[0], static[0]) and torch.equal(first[1], static[1])
        for _ in range(3):  # the dynamic hand-out differs run to run; every tile's bits do not
            again = hf._mod().attention_forward(q, k, v, causal=True, scheduler=sched)
            assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,ratio,seqused", [(128, 2, True), (64, 8, True), (96, 1, True)],
                         ids=["d128-gqa2-seqused", "d64-gqa8-seqused", "d96-mha-seqused"])
def test_persistent_varlen(causal, d, ratio, seqused):
    """Packed batches with q-empty and k-empty sequences, NaN cache slots past seqused_k and a
    reversed batch_map, walked by 3 persistent CTAs, striding and dynamic (the tiles past a
    sequence's end are skipped inside the loop): FA4's rule and bitwise the static kernel (where both
    walk the same key tiles, _same_key_tiles)."""
    import torch

    from stage3_fwd_kernel import tile_scheduler

    used = hfv.USED_K if seqused else None
    q, k, v, cu_q, cu_k, su = hfv._varlen_batch(hfv.LENS_Q, hfv.LENS_K, used, 8, 8 // ratio, d, d, seed=d + ratio + 9)
    perm = torch.arange(len(hfv.LENS_Q) - 1, -1, -1, dtype=torch.int32, device="cuda")
    static = hfv._varlen(q, k, v, cu_q, cu_k, su, causal=causal, batch_map=perm)
    P = tile_scheduler.PersistentScheduler
    runs = [hfv._varlen(q, k, v, cu_q, cu_k, su, causal=causal, batch_map=perm, scheduler=sched)
            for sched in (P(num_ctas=3), P(num_ctas=3, dynamic=True))]
    want = static if _same_key_tiles(d, d, causal) else runs[0]
    assert all(torch.equal(o, want[0]) and torch.equal(s, want[1]) for o, s in runs)
    out, lse = runs[-1]
    q0, q1 = int(cu_q[1]), int(cu_q[2])  # the k-empty sequence: exactly 0 / -inf
    assert torch.all(out[q0:q1] == 0) and torch.all(torch.isneginf(lse[:, q0:q1]))
