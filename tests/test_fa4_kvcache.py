"""fa4.flash_attn_with_kvcache on CPU: the segment plan (split-KV, pages, GQA packing), the lse
merge, the in-place append and rotary, against dense float64 attention per sequence.

The kernel is replaced by a torch stand-in with the varlen kernel's contract (sequence i: query
rows cu_q[i]:cu_q[i+1], keys from row cu_k[i], seqused[i] of them, masks bottom-right aligned), so
everything fa4 adds around the kernel is checked here; the GPU file runs the real kernel.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fa4
from fa4 import _kvcache as kv
from fa4 import _layouts
from fa4._layouts import gather_pages
from stage0_reference.torch_reference import attention_ref

pytestmark = [pytest.mark.cpu, pytest.mark.fa4]


def stand_in(q, k, v, cu_q, cu_k, used, max_q, max_k, scale, causal, window, softcap, page_table=None):
    """The varlen forward's contract in float64 (out (T, H, Dv), lse (H, T)). page_table: k / v are
    pages (num_pages, page_size, Hkv, D) and segment i's keys are its logical keys cu_k[i] ..
    + used[i] through table row i (the paged kernel's contract, stage3 components.paged_kv)."""
    if page_table is not None:
        assert k.dim() == 4 and page_table.shape[0] == used.shape[0]
        assert all(int(c) % 128 == 0 for c in cu_k[:-1]), "logical first keys are multiples of the key tile"
        ps = k.shape[1]
        rows = page_table.long()[:, :, None] * ps + torch.arange(ps)                     # (segments, P, ps)
        k_seg, v_seg = k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:])
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
        for i in range(used.shape[0]):
            qa, qb, ka, n = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(used[i])
            if qb == qa or n == 0:
                continue
            idx = rows[i].reshape(-1)[ka:ka + n]
            out[qa:qb], lse[:, qa:qb] = dense(q[qa:qb], k_seg[idx], v_seg[idx], scale, causal, window, softcap)
        return out, lse
    hq = q.shape[1]
    out = torch.zeros(q.shape[0], hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((hq, q.shape[0]), float("-inf"), dtype=torch.float64)
    assert int(used.max()) <= max_k and int((cu_q[1:] - cu_q[:-1]).max()) <= max_q
    for i in range(used.shape[0]):
        qa, qb, ka, n = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(used[i])
        if qb == qa or n == 0:
            continue
        o, l = dense(q[qa:qb], k[ka:ka + n], v[ka:ka + n], scale, causal, window, softcap)
        out[qa:qb], lse[:, qa:qb] = o, l
    return out, lse


def dense(q, k, v, scale, causal, window=(None, None), softcap=0.0, sink=None):
    """(S, H, D) attention in float64, bottom-right aligned masks (stage 0's torch reference):
    (out, lse (H, S))."""
    o, l = attention_ref(q[None].double(), k[None].double(), v[None].double(), softmax_scale=scale, causal=causal,
                         window_size=window, softcap=softcap, learnable_sink=None if sink is None else sink.double())
    return o[0], l[0]


def call(*args, **kw):
    return kv.with_kvcache(*args, varlen=stand_in, sm_count=kw.pop("sm_count", 16), return_softmax_lse=True, **kw)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _tokens_and_cache(seed, b, sq, hq, hkv, d, s_cache):
    """q (B, Sq, Hq, D) and a dense cache k, v (B, S, Hkv, D), float64, from one generator."""
    g = _gen(seed)
    kc = torch.randn(b, s_cache, hkv, d, generator=g, dtype=torch.float64)
    vc = torch.randn(b, s_cache, hkv, d, generator=g, dtype=torch.float64)
    return torch.randn(b, sq, hq, d, generator=g, dtype=torch.float64), kc, vc


def _check(out, lse, q, keys, values, seqlens, scale=None, causal=False, window=(None, None), softcap=0.0, sink=None):
    scale = scale or q.shape[-1] ** -0.5
    for b in range(q.shape[0]):
        n = int(seqlens[b])
        want, wl = dense(q[b], keys[b][:n], values[b][:n], scale, causal, window, softcap, sink)
        torch.testing.assert_close(out[b].double(), want, rtol=1e-9, atol=1e-9, msg=lambda m: f"out b={b}: {m}")
        torch.testing.assert_close(lse[b].double(), wl, rtol=1e-9, atol=1e-9, msg=lambda m: f"lse b={b}: {m}")


@pytest.mark.parametrize("splits", [1, 3, 0])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_decode_dense_split_and_packed(splits, heads):
    hq, hkv = heads
    g = _gen(1)
    b, s_cache, d = 3, 700, 16
    q = torch.randn(b, 1, hq, d, generator=g, dtype=torch.float64)
    kc = torch.randn(b, s_cache, hkv, d, generator=g, dtype=torch.float64)
    vc = torch.randn(b, s_cache, hkv, d, generator=g, dtype=torch.float64)
    lens = torch.tensor([700, 0, 257], dtype=torch.int32)   # a full cache, an empty one, a partial one
    out, lse = call(q, kc, vc, cache_seqlens=lens, num_splits=splits, causal=True)
    _check(out, lse, q, kc, vc, lens)
    assert out[1].abs().max() == 0 and torch.isinf(lse[1]).all()


@pytest.mark.parametrize("ps", [4, 160])
def test_paged_decode_matches_dense_cache(ps):
    """Pages the kernel cannot read in place: small ones through a dense copy, larger ones (>=
    MIN_SEGMENT_PAGE) as one segment each."""
    g = _gen(2)
    b, hq, hkv, d, pages = 2, 6, 2, 16, 5
    pool = 16
    kp = torch.randn(pool, ps, hkv, d, generator=g, dtype=torch.float64)
    vp = torch.randn(pool, ps, hkv, d, generator=g, dtype=torch.float64)
    table = torch.randperm(pool, generator=g)[:b * pages].view(b, pages).to(torch.int32)
    lens = torch.tensor([4 * ps + 1, 2 * ps + 1], dtype=torch.int32)            # partial last pages
    q = torch.randn(b, 1, hq, d, generator=g, dtype=torch.float64)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -0.5], dtype=torch.float64)
    seen = []

    def spy(*args, **kw):
        seen.append(args[4].shape[0] - 1)   # segments
        return stand_in(*args, **kw)

    out, lse = kv.with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, learnable_sink=sink, softcap=3.0,
                               varlen=spy, sm_count=16, return_softmax_lse=True)
    if ps >= kv.MIN_SEGMENT_PAGE:
        assert seen[0] == b * pages        # one segment per page
    else:
        assert seen[0] < b * pages         # a dense copy, split like any dense cache
    dense_k, dense_v = gather_pages(kp, table), gather_pages(vp, table)
    _check(out, lse, q, dense_k, dense_v, lens, softcap=3.0, sink=sink)


@pytest.mark.parametrize("splits", [1, 3, 0])
@pytest.mark.parametrize("page_size", [128, 256])
def test_paged_in_place_decode_chunks_like_a_dense_cache(splits, page_size):
    """Pages read in place (fa4._paged): the keys are cut into logical chunks as in a dense cache
    (not one segment per page), each segment with its sequence's page-table row."""
    g = _gen(12)
    b, hq, hkv, d, pages, pool = 3, 8, 2, 16, 4, 16
    kp = torch.randn(pool, page_size, hkv, d, generator=g, dtype=torch.float64)
    vp = torch.randn(pool, page_size, hkv, d, generator=g, dtype=torch.float64)
    table = torch.randperm(pool, generator=g)[:b * pages].view(b, pages).to(torch.int32)
    lens = torch.tensor([pages * page_size, 0, page_size + 37], dtype=torch.int32)    # full, empty, partial page
    q = torch.randn(b, 1, hq, d, generator=g, dtype=torch.float64)
    seen = []

    def spy(*args, **kw):
        seen.append(kw.get("page_table"))
        return stand_in(*args, **kw)

    out, lse = kv.with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=splits, varlen=spy,
                               sm_count=16, return_softmax_lse=True, paged_in_place=True)
    dense_k, dense_v = gather_pages(kp, table), gather_pages(vp, table)
    _check(out, lse, q, dense_k, dense_v, lens)
    n = seen[0].shape[0] // b
    assert seen[0].shape == (b * n, pages) and torch.equal(seen[0][::n], table)
    if splits:  # chunks of whole key tiles, as a dense cache of the same capacity gets; not one per page
        assert n == kv._chunks(pages * page_size, splits)[1]


def test_page_sizes_read_in_place():
    from stage3_fwd_kernel.components.paged_kv import check_page_size, page_size_ok

    assert all(page_size_ok(p, t) for p in (1, 8, 16, 24, 32, 64, 96, 128, 160, 256, 384, 512) for t in (64, 128))
    for bad in (0, -128, True, 128.0):
        with pytest.raises(ValueError, match="^page_size: "):
            check_page_size(bad, 128)


def test_gathered_page_sizes_in_place_only_for_short_queries():
    """Pages TMA reads: in place at any query length (pages of 16: the next test); pages the kernel
    gathers with cp.async: only up to GATHER_MAX_QUERY_ROWS query rows (a long prefill runs faster on a
    dense copy), never when the length is unknown."""
    from fa4 import _dispatch

    be = _dispatch.HopperBackend(_dispatch.ARCHS["sm_90"])
    short, long = _dispatch.GATHER_MAX_QUERY_ROWS, _dispatch.GATHER_MAX_QUERY_ROWS + 1
    assert [be.paged_in_place(128, 128, p, short) for p in (1, 8, 24, 160)] == [True] * 4
    assert [be.paged_in_place(128, 128, p, long) for p in (1, 8, 24, 160)] == [False] * 4
    assert not be.paged_in_place(128, 128, 8, None) and be.paged_in_place(128, 128, 16, None)
    assert all(be.paged_in_place(d, dv, p, 4096)
               for d, dv in ((128, 128), (64, 64), (256, 256)) for p in (32, 128, 256))


def test_small_pages_in_place_below_many_head_rows():
    """Pages of SMALL_PAGE_BOXES TMA boxes a key block or more (16 keys at the 128-key tile): in place while
    fewer than SMALL_PAGE_COPY_HEAD_ROWS query-head rows attend each key and when that is unknown, a
    dense copy from there on; wider pages, and 16-key pages at the 64-key tile (d = 256: 4 boxes), stay
    in place."""
    from fa4 import _dispatch

    be = _dispatch.HopperBackend(_dispatch.ARCHS["sm_90"])
    rows = _dispatch.SMALL_PAGE_COPY_HEAD_ROWS
    for d, dv in ((128, 128), (64, 64), (128, 64)):
        in_place = [be.paged_in_place(d, dv, 16, 1, r) for r in (None, 1, rows - 1, rows, 4 * rows)]
        assert in_place == [True] * 3 + [False] * 2
        assert all(be.paged_in_place(d, dv, p, 4 * rows, 4 * rows) for p in (32, 64, 128, 384))
    assert all(be.paged_in_place(256, 256, p, 4 * rows, 4 * rows) for p in (16, 32, 64))


@pytest.mark.parametrize("tokens, keys, causal, window", [
    (1, 1, True, (None, None)), (3, 3, False, (None, None)), (113, 203, True, (None, None)),
    (203, 113, True, (None, None)), (64, 1000, True, (40, None)), (64, 1000, False, (40, 7)),
    (799, 3, False, (None, None)), (300, 900, False, (-1, 5)), (50, 2000, True, (-1, -1))])
def test_head_rows_counts_the_attended_pairs(tokens, keys, causal, window):
    """fa4._paged.head_rows: group x (query row, key) pairs the mask lets through / keys, against the
    pairs counted from stage 0's bottom-right mask (a window bounds them from above, the rule's upper
    bound); unknown keys count every row."""
    from fa4._paged import head_rows

    i = np.arange(tokens)[:, None] + keys - tokens
    j = np.arange(keys)[None, :]
    seen = np.ones((tokens, keys), bool)
    if causal:
        seen &= j <= i
    left, right = (None if e is None or e < 0 else e for e in window)
    if left is not None:
        seen &= j >= i - left
    if right is not None and not causal:
        seen &= j <= i + right
    exact = 3 * seen.sum() / keys
    got = head_rows(tokens, keys, 3, causal, window)
    if left is None and (right is None or causal):
        assert got == pytest.approx(exact)
    else:   # an upper bound, at most a row's reach
        assert exact <= got + 1e-9
        if left is not None:
            assert got <= 3 * tokens * (left + 1 + (right or 0)) / keys + 1e-9
    # unknown keys: the queries' own count; a span wider than the keys spreads the pairs over it (the
    # copy moves the whole span), a narrower one bounds the keys
    assert head_rows(tokens, None, 3, causal, window) == head_rows(tokens, tokens, 3, causal, window)
    assert head_rows(tokens, keys, 3, causal, window, span=2 * keys) == pytest.approx(got / 2)
    assert head_rows(tokens, 2 * keys, 3, causal, window, span=keys) == pytest.approx(got)
    assert head_rows(0, keys, 3, causal, window) == 0 and head_rows(tokens, 0, 3, causal, window) == 0


def test_in_place_decisions_for_pages_of_16(monkeypatch):
    """fa4._paged.in_place on fake CUDA tensors (GQA 4, pages of 16, causal): a square prefill of 4101
    queries and a 1900-query chunk at the end of 6003 keys copy; a square 2053-query prefill, and a
    2048-query call whose keys the shapes do not tell over a table 32k keys wide, read in place; an
    unchecked window of None is no window."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa4 import _dispatch, _paged

    be = _dispatch.HopperBackend(_dispatch.ARCHS["sm_90"])
    monkeypatch.setattr(_dispatch, "backend_for", lambda device: be)
    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(1, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
        pages = torch.empty(4, 16, 2, 128, device="cuda", dtype=torch.bfloat16)
        cases = [(4101, 4101, 4112, None, False), (1900, 6003, 6016, (-1, -1), False),
                 (2053, 2053, 2064, (None, None), True), (2048, None, 32768, (None, None), True)]
        for tokens, keys, span, window, expected in cases:
            got = _paged.in_place(q, pages, pages, tokens, keys=keys, span=span, causal=True, window=window)
            assert got == expected, (tokens, keys, span)


@pytest.mark.parametrize("window", [None, (1, 2, 3), "wide", (True, None), (40.5, None)])
def test_head_rows_takes_an_unchecked_window_as_none(window):
    """fa4._paged.in_place runs before the call's checks: a window form they refuse (or None, which
    they take) counts as no window here, and the checks name it afterwards."""
    from fa4._paged import head_rows

    assert head_rows(100, 300, 4, True, window) == head_rows(100, 300, 4, True, (None, None))


def test_query_rows_read_from_shapes_only():
    from fa4._api import _query_rows

    assert _query_rows(torch.empty(2, 5, 4, 8), None) == 5        # padded q: its seqlen
    assert _query_rows(torch.empty(30, 4, 8), 7) == 7             # packed q: max_seqlen_q
    assert _query_rows(torch.empty(30, 4, 8), None) == 30         # ... else every packed row


def test_paged_in_place_prefill_causal_and_window_need_no_gather():
    """A causal prefill and a window over pages read in place run unsplit on the pages themselves
    (the kernel's masks align to seqused_k, which the logical chunk keeps)."""
    g = _gen(13)
    b, sn, hq, hkv, d, ps, pages = 2, 5, 4, 2, 16, 128, 3
    q = torch.randn(b, sn, hq, d, generator=g, dtype=torch.float64)
    kp = torch.randn(b * pages + 2, ps, hkv, d, generator=g, dtype=torch.float64)
    vp = torch.randn(b * pages + 2, ps, hkv, d, generator=g, dtype=torch.float64)
    table = torch.randperm(b * pages + 2, generator=g)[:b * pages].view(b, pages).to(torch.int32)
    lens = torch.tensor([300, 129], dtype=torch.int32)
    dense_k, dense_v = gather_pages(kp, table), gather_pages(vp, table)
    for window in ((None, None), (40, 0)):
        out, lse = kv.with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, causal=True, window_size=window,
                                   varlen=stand_in, sm_count=16, return_softmax_lse=True, paged_in_place=True)
        _check(out, lse, q, dense_k, dense_v, lens, causal=True, window=(window[0], None))


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("paged", [False, True])
def test_prefill_appends_in_place_with_rotary(interleaved, paged):
    """New tokens are rotated, written at cache_seqlens and attended to causally; q is rotated at
    the same positions (causal)."""
    g = _gen(3)
    b, sn, hq, hkv, d, rd = 2, 5, 4, 2, 16, 8
    q = torch.randn(b, sn, hq, d, generator=g, dtype=torch.float64)
    k_new = torch.randn(b, sn, hkv, d, generator=g, dtype=torch.float64)
    v_new = torch.randn(b, sn, hkv, d, generator=g, dtype=torch.float64)
    angles = torch.rand(64, rd // 2, generator=g, dtype=torch.float64) * 6
    cos, sin = angles.cos(), angles.sin()
    lens = torch.tensor([3, 11], dtype=torch.int32)
    kc = torch.randn(b, 32, hkv, d, generator=g, dtype=torch.float64)
    vc = torch.randn(b, 32, hkv, d, generator=g, dtype=torch.float64)
    before_k, before_v = kc.clone(), vc.clone()
    table = None
    if paged:
        kc, vc = kc.view(b * 4, 8, hkv, d), vc.view(b * 4, 8, hkv, d)
        table = torch.arange(b * 4, dtype=torch.int32).view(b, 4)
    out, lse = call(q, kc, vc, k_new, v_new, rotary_cos=cos, rotary_sin=sin, cache_seqlens=lens, causal=True,
                    rotary_interleaved=interleaved, block_table=table, window_size=(6, 0) if paged else (None, None))
    pos = lens.long().view(-1, 1) + torch.arange(sn)
    k_rot, q_rot = _rotary_by_complex(k_new, angles, pos, interleaved), _rotary_by_complex(q, angles, pos, interleaved)
    want_k, want_v = before_k.clone(), before_v.clone()
    for i in range(b):
        want_k[i, lens[i]:lens[i] + sn], want_v[i, lens[i]:lens[i] + sn] = k_rot[i], v_new[i]
    assert torch.equal(kc.reshape(b, 32, hkv, d), want_k) and torch.equal(vc.reshape(b, 32, hkv, d), want_v)
    _check(out, lse, q_rot, want_k, want_v, lens + sn, causal=True, window=(6, None) if paged else (None, None))
    # rotary's definition, by hand: interleaved rotates (x0, x1), NeoX (x0, x_{rd/2}); e0 -> (cos, sin),
    # e_partner -> (-sin, cos)
    partner = 1 if interleaved else rd // 2
    for unit, want in ((0, (cos[5, 0], sin[5, 0])), (partner, (-sin[5, 0], cos[5, 0]))):
        x = torch.zeros(1, 1, 1, d, dtype=torch.float64)
        x[..., unit] = 1.0
        r = kv.apply_rotary(x, cos, sin, torch.tensor([[5]]), interleaved)
        assert math.isclose(r[0, 0, 0, 0], want[0], abs_tol=1e-12)
        assert math.isclose(r[0, 0, 0, partner], want[1], abs_tol=1e-12)
        assert torch.count_nonzero(r) == 2


def _rotary_by_complex(x, angles, pos, interleaved):
    """Rotary embedding of x's first rd = 2 angles.shape[-1] dims as complex multiplication, written
    independently of fa4's apply_rotary: pairs (2i, 2i + 1) when interleaved, else (i, i + rd / 2) (NeoX)
    as (real, imaginary), times exp(i angle[pos, i]); the other dims unchanged."""
    rd = 2 * angles.shape[-1]
    head = x[..., :rd]
    if interleaved:
        z = torch.view_as_complex(head.reshape(*head.shape[:-1], rd // 2, 2).contiguous())
    else:
        z = torch.complex(head[..., :rd // 2], head[..., rd // 2:])
    z = z * torch.polar(torch.ones_like(angles[pos]), angles[pos])[:, :, None, :]       # (B, S, 1, rd / 2)
    rot = torch.view_as_real(z).flatten(-2) if interleaved else torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((rot, x[..., rd:]), dim=-1)


def split_stand_in(rows, k, v, seqlens, n, chunk, scale, softcap, page_table=None, out=None, causal=False,
                   rows_per_query=1, unpack=1, range_keys=None, window=(None, None), cache_rows=None,
                   key_starts=None):
    """The split-KV launch's contract in float64 (stage3 hopper.attention_split_forward with its
    merge, through fa4._kvcache.fa4_split; rows_per_query g > 1: `rows` is q (B, T, Hq, D), read as
    T g rows of Hq / g heads): chunk j of sequence b, keys [j chunk, j chunk + used)
    with used = clamp(seqlens[b] - j chunk, 0, chunk), is part j of sequence b (-inf lse with no
    key); causal: row i sees keys up to L - R + i of the whole sequence (written out here, not
    dense()'s alignment to the chunk); the parts merge to out (B, R, H, Dv), into `out` when given,
    and lse (B, H, R), or unpacked (unpack g: (B, R / g, H g, Dv) and (B, H g, R / g)). window
    (left, right): token t sees keys L - T + t - left ..= L - T + t + right (causal: right 0).
    range_keys W: the chunks count from key max(seqlens[b] - W, 0) (with pages rounded down to a
    multiple of 128, and then a left window must hide the keys before it) and cover those keys.
    cache_rows: sequence b reads cache row cache_rows[b] (None: row b); key_starts: its keys start there
    (cache_leftpad: the chunks count from max(key_starts[b], the range's first key))."""
    if rows_per_query > 1:   # q as the call holds it: its groups are the kernel's rows, by token
        b, t, hq, d = rows.shape
        rows = rows.view(b, t, hq // rows_per_query, rows_per_query, d).transpose(2, 3).reshape(b, -1, hq //
                                                                                                  rows_per_query, d)
    b, r, h, _ = rows.shape
    tokens = r // rows_per_query
    left, right = window
    right = 0 if causal else right
    assert n == 1 or chunk % 128 == 0, "chunks start on key-tile borders"
    parts = torch.zeros(b * n, r, h, v.shape[-1], dtype=torch.float64)
    lse = torch.full((h, b * n, r), float("-inf"), dtype=torch.float64)
    for i in range(b):
        row = i if cache_rows is None else int(cache_rows[i])
        keys, values = k[row], v[row]
        if page_table is not None:
            ps = k.shape[1]
            idx = (page_table[i].long()[:, None] * ps + torch.arange(ps)).reshape(-1)
            keys, values = k.reshape(-1, *k.shape[2:])[idx], v.reshape(-1, *v.shape[2:])[idx]
        start = 0 if range_keys is None else max(int(seqlens[i]) - range_keys, 0)
        if key_starts is not None:
            assert page_table is None, "first keys of a dense cache only"
            start = max(start, int(key_starts[i]))
        if page_table is not None and range_keys is not None:
            assert left is not None and left + tokens <= range_keys, "a paged range needs the window to hide its start"
            start -= start % 128
        assert start + n * chunk >= min(keys.shape[0], int(seqlens[i])), "the chunks cover the keys read"
        for j in range(n):
            a = start + j * chunk
            used = min(max(int(seqlens[i]) - a, 0), chunk)
            if used:
                parts[i * n + j], lse[:, i * n + j] = _chunk_attention(
                    rows[i], keys[a:a + used], values[a:a + used], scale, softcap,
                    int(seqlens[i]) - tokens - a, rows_per_query, left, right)
    assert unpack == 1 or n > 1, "one part is not merged: the caller unpacks it"
    merged, lse = kv.merge_segments(parts, lse, n, unpack=unpack)
    if out is not None:   # where the caller wants the result (a view of its final layout)
        merged = out.copy_(merged)
    return merged, lse


def _chunk_attention(q, k, v, scale, softcap, diagonal=None, rows_per_query=1, left=None, right=0):
    """q (R, H, D) against k / v (S, Hkv, *) in float64, row i (query token t = i // rows_per_query)
    seeing keys t + diagonal - left ..= t + diagonal + right (diagonal None, or an edge None: no
    limit there) -> out (R, H, Dv), lse (H, R); a row that sees no key gets 0 and -inf."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = torch.einsum("rhd,shd->hrs", q.double(), kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    rows, cols = torch.arange(q.shape[0])[:, None] // rows_per_query, torch.arange(k.shape[0])[None, :]
    if diagonal is not None and right is not None:
        s = s.masked_fill(cols > rows + diagonal + right, float("-inf"))
    if diagonal is not None and left is not None:
        s = s.masked_fill(cols < rows + diagonal - left, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                                   # (H, R)
    p = torch.exp(s - lse[..., None].clamp(min=-1e300)).nan_to_num(0.0)
    return torch.einsum("hrs,shd->rhd", p, vv), lse


def _no_varlen(*args, **kw):
    raise AssertionError("the split launch should have served this call")


@pytest.mark.parametrize("splits", [1, 3, 0])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_split_launch_decode(splits, heads):
    """Free masks over cache row b (or pages read in place) take the split launch: no segments, no
    replicated queries; the parts merge to dense attention, softcap and sink included."""
    hq, hkv = heads
    g = _gen(21)
    b, s_cache, d = 3, 700, 16
    q = torch.randn(b, 1, hq, d, generator=g, dtype=torch.float64)
    kc = torch.randn(b + 1, s_cache, hkv, d, generator=g, dtype=torch.float64)   # a spare cache row
    vc = torch.randn(b + 1, s_cache, hkv, d, generator=g, dtype=torch.float64)
    lens = torch.tensor([700, 0, 257], dtype=torch.int32)
    sink = torch.linspace(-1.0, 1.0, hq, dtype=torch.float64)
    seen = []

    def spy(*args, **kw):
        seen.append(args[4:6])
        return split_stand_in(*args, **kw)

    out, lse = kv.with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits, causal=True, softcap=2.0,
                               learnable_sink=sink, varlen=_no_varlen, split=spy, sm_count=16,
                               return_softmax_lse=True)
    _check(out, lse, q, kc, vc, lens, softcap=2.0, sink=sink)
    n, chunk = seen[0]
    if splits:
        assert (chunk, n) == kv.split_chunks(s_cache, splits)
    assert out[1].abs().max() == 0   # no key: the sink alone in the denominator, O = 0


@pytest.mark.parametrize("page_size", [16, 128])
def test_split_launch_paged_in_place(page_size):
    g = _gen(22)
    b, hq, hkv, d, pages, pool = 2, 8, 2, 16, 8, 24
    kp = torch.randn(pool, page_size, hkv, d, generator=g, dtype=torch.float64)
    vp = torch.randn(pool, page_size, hkv, d, generator=g, dtype=torch.float64)
    table = torch.randperm(pool, generator=g)[:b * pages].view(b, pages).to(torch.int32)
    lens = torch.tensor([pages * page_size - 3, page_size + 1], dtype=torch.int32)
    q = torch.randn(b, 1, hq, d, generator=g, dtype=torch.float64)
    out, lse = kv.with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=2, varlen=_no_varlen,
                               split=split_stand_in, sm_count=16, return_softmax_lse=True, paged_in_place=True)
    _check(out, lse, q, gather_pages(kp, table), gather_pages(vp, table), lens)


@pytest.mark.parametrize("splits", [1, 4, 0])
def test_split_launch_causal_queries_at_the_cache_end(splits):
    """A few causal query tokens (speculative decoding) split like one: each chunk sees its keys'
    distance to the sequence's end, so only the chunks at the end are masked. Chunks of 256 keys cut
    the diagonal's rows across two chunks (keys 255 .. 259 of a 260-key sequence)."""
    g = _gen(24)
    b, sq, hq, hkv, d = 3, 5, 8, 2, 16   # the group's 4 heads packed: 20 rows a KV head, masked by token
    kc = torch.randn(b, 600, hkv, d, generator=g, dtype=torch.float64)
    vc = torch.randn(b, 600, hkv, d, generator=g, dtype=torch.float64)
    q = torch.randn(b, sq, hq, d, generator=g, dtype=torch.float64)
    lens = torch.tensor([600, 260, 3], dtype=torch.int32)      # full; the diagonal across a chunk edge; < sq
    seen = []

    def spy(*args, **kw):
        seen.append((args[4], kw["causal"], kw["rows_per_query"], kw["unpack"]))
        return split_stand_in(*args, **kw)

    out, lse = kv.with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits, causal=True, varlen=_no_varlen,
                               split=spy, sm_count=64, return_softmax_lse=True)
    n_split = kv.split_chunks(600, splits or 3)[1]
    # split: the merge writes the (B, Sq, Hq, Dv) result itself (no unpacking copy after it)
    assert seen[0] == (n_split, True, 4, 4 if n_split > 1 else 1)
    scale = d ** -0.5
    for i in range(b):
        n = int(lens[i])
        want, wl = _chunk_attention(q[i], kc[i, :n], vc[i, :n], scale, 0.0, diagonal=n - sq)
        torch.testing.assert_close(out[i].double(), want, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(lse[i].double(), wl, rtol=1e-9, atol=1e-9)



@pytest.mark.parametrize("splits", [1, 4])
def test_split_launch_causal_tokens_with_sink_and_softcap(splits):
    """Several causal tokens with a learnable sink and softcap through the split launch: split, the
    merge unpacks the packed rows and the sink joins the merged rows once; unsplit, fa4 unpacks."""
    b, sq, hq, hkv, d = 2, 3, 8, 2, 16
    q, kc, vc = _tokens_and_cache(25, b, sq, hq, hkv, d, 600)
    lens = torch.tensor([600, 259], dtype=torch.int32)
    sink = torch.linspace(-1.0, 1.0, hq, dtype=torch.float64)
    seen = []

    def spy(*args, **kw):
        seen.append((args[4], kw["unpack"]))
        return split_stand_in(*args, **kw)

    out, lse = kv.with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits, causal=True, softcap=2.0,
                               learnable_sink=sink, varlen=_no_varlen, split=spy, sm_count=64,
                               return_softmax_lse=True)
    n = kv.split_chunks(600, splits)[1]
    assert seen == [(n, 4 if n > 1 else 1)]
    _check(out, lse, q, kc, vc, lens, causal=True, softcap=2.0, sink=sink)



def test_split_launch_reads_cache_rows():
    """cache_batch_idx: the split launch reads sequence b's chunks from cache row cache_batch_idx[b] (one
    token, and a window over several tokens); traced calls (no split launch) keep the segments."""
    g = _gen(23)
    b, hq, d = 2, 2, 16
    kc = torch.randn(3, 300, hq, d, generator=g, dtype=torch.float64)
    vc = torch.randn(3, 300, hq, d, generator=g, dtype=torch.float64)
    lens = torch.tensor([290, 40], dtype=torch.int32)
    cases = [dict(q_len=1, cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32)),
             dict(q_len=1, causal=True, window_size=(50, 0), cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32)),
             dict(q_len=3, causal=True, window_size=(100, 0), cache_batch_idx=torch.tensor([1, 2], dtype=torch.int32))]
    for case in cases:
        q = torch.randn(b, case.pop("q_len"), hq, d, generator=g, dtype=torch.float64)
        rows = case["cache_batch_idx"].long()
        seen = []

        def spy(*args, **kw):
            seen.append(kw["cache_rows"])
            return split_stand_in(*args, **kw)

        out, lse = kv.with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=2, varlen=_no_varlen, split=spy,
                                   sm_count=16, return_softmax_lse=True, **case)
        assert len(seen) == 1 and torch.equal(seen[0], case["cache_batch_idx"])
        want = dict(causal=case.get("causal", False), window=case.get("window_size", (None, None)))
        _check(out, lse, q, kc[rows], vc[rows], lens, **want)
        out, lse = kv.with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=2, varlen=stand_in, sm_count=16,
                                   return_softmax_lse=True, **case)                 # split=None: the segments
        _check(out, lse, q, kc[rows], vc[rows], lens, **want)



def _window_decode_inputs(left):
    """Sequences shorter than the window, empty, and far longer; one spare cache row; a sink."""
    g = _gen(26)
    hq, hkv, d = 8, 2, 16
    lens = torch.tensor([600, 0, 37, 101, 250], dtype=torch.int32)
    b = lens.shape[0]
    kc = torch.randn(b + 1, 640, hkv, d, generator=g, dtype=torch.float64)
    vc = torch.randn(b + 1, 640, hkv, d, generator=g, dtype=torch.float64)
    q = torch.randn(b, 1, hq, d, generator=g, dtype=torch.float64)
    return q, kc, vc, lens, torch.linspace(-1.0, 1.0, hq, dtype=torch.float64)


@pytest.mark.parametrize("splits", [1, 3, 0])
@pytest.mark.parametrize("left", [100, 300])
def test_decode_window_splits_launch_a_key_range(splits, left):
    """One query token with a window, sequence b in cache row b: the split launch reads the last
    left + 1 keys of each sequence (range_keys), the group packed and no mask; its chunks cover the
    window, not the cache. Softcap and a sink on top."""
    q, kc, vc, lens, sink = _window_decode_inputs(left)
    seen = []

    def spy(*args, **kw):
        seen.append((args[4], args[5], kw["range_keys"], kw["causal"], args[0].shape))
        return split_stand_in(*args, **kw)

    out, lse = kv.with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits, causal=True, window_size=(left, 0),
                               softcap=2.0, learnable_sink=sink, varlen=_no_varlen, split=spy, sm_count=64,
                               return_softmax_lse=True)
    _check(out, lse, q, kc, vc, lens, causal=True, window=(left, 0), softcap=2.0, sink=sink)
    (n, chunk, range_keys, causal, rows), = seen
    want = kv.split_chunks(left + 1, splits or kv.choose_num_splits(5, 2, left + 1, 64))
    assert (chunk, n, range_keys, causal) == (*want, left + 1, False)
    assert rows == (5, 4, 2, 16)                                              # the group of 4 packed as rows


@pytest.mark.parametrize("splits", [1, 3, 0])
def test_decode_window_is_a_key_range_over_cache_rows(splits):
    """One query token with a window and cache_batch_idx, traced (no split launch): the varlen kernel's
    segments, packed and without a mask, start at each sequence's window's first key in its cache row."""
    left = 100
    q, kc, vc, lens, sink = _window_decode_inputs(left)
    (b, _, hq, d), hkv = q.shape, kc.shape[2]
    idx = torch.tensor([5, 0, 3, 1, 2], dtype=torch.int32)
    rows = idx.long()
    seen = []

    def spy(q_seg, k, v, cu_q, cu_k, used, *rest, **kw):
        seen.append((q_seg.shape, cu_k.clone(), used.clone(), rest[3], rest[4]))   # rows, segments, causal, window
        return stand_in(q_seg, k, v, cu_q, cu_k, used, *rest, **kw)

    out, lse = kv.with_kvcache(q, kc, vc, cache_seqlens=lens, cache_batch_idx=idx, num_splits=splits, causal=True,
                               window_size=(left, 0), softcap=2.0, learnable_sink=sink, varlen=spy, sm_count=64,
                               return_softmax_lse=True)
    _check(out, lse, q, kc[rows], vc[rows], lens, causal=True, window=(left, 0), softcap=2.0, sink=sink)
    (shape, cu_k, used, causal, window), = seen
    n = kv._chunks(left + 1, splits or kv.choose_num_splits(b, hkv, left + 1, 64))[1]
    assert shape[1:] == (hkv, d) and shape[0] == b * n * (hq // hkv)      # the group packed: g rows a segment
    assert (causal, tuple(window)) == (False, (None, None))
    first = (lens - 1 - left).clamp(min=0)
    want_first = rows.view(-1, 1) * 640 + first.view(-1, 1) + torch.arange(n) * kv._chunks(left + 1, n)[0]
    assert torch.equal(cu_k[:-1].view(b, n), want_first.to(torch.int32))
    assert torch.equal(used.view(b, n).sum(1), torch.minimum(lens, torch.tensor(left + 1)))


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("paged", [None, 16, 128])
@pytest.mark.parametrize("sq, window", [(3, (100, 0)), (4, (300, 0)), (2, (None, 0))])
def test_split_launch_windowed_tokens(splits, paged, sq, window):
    """Several causal tokens with a window (speculative decoding in a sliding layer), dense or pages
    read in place: the split launch, the GQA group packed by token and masked by the window, over
    the last left + Sq keys of each sequence (a paged range from the key tile below). A window
    with no left edge reads the whole cache."""
    b, hq, hkv, d, s_cache = 3, 8, 2, 16, 640
    q, kc, vc = _tokens_and_cache(27, b, sq, hq, hkv, d, s_cache)
    lens = torch.tensor([640, 250, 2], dtype=torch.int32)
    kw, keys, values = {}, kc, vc
    if paged:   # the same keys cut into shuffled pages
        pages = s_cache // paged
        table = torch.randperm(b * pages, generator=_gen(28)).view(b, pages).to(torch.int32)
        kp = torch.empty(b * pages, paged, hkv, d, dtype=torch.float64)
        vp = torch.empty_like(kp)
        kp[table.reshape(-1).long()] = kc.reshape(b * pages, paged, hkv, d)
        vp[table.reshape(-1).long()] = vc.reshape(b * pages, paged, hkv, d)
        kw, keys, values = dict(block_table=table, paged_in_place=True), kp, vp
    seen = []

    def spy(*args, **kw):
        seen.append((kw["range_keys"], tuple(kw["window"]), kw["rows_per_query"], kw["causal"], args[0] is q))
        return split_stand_in(*args, **kw)

    out, lse = kv.with_kvcache(q, keys, values, cache_seqlens=lens, num_splits=splits, causal=True,
                               window_size=window, varlen=_no_varlen, split=spy, sm_count=64,
                               return_softmax_lse=True, **kw)
    _check(out, lse, q, kc, vc, lens, causal=True, window=window)
    range_keys = None if window[0] is None else window[0] + sq
    # causal's right edge stays the causal flag; q itself goes to the launch (its groups read as rows)
    assert seen == [(range_keys, (window[0], None), 4, True, True)]


@pytest.mark.parametrize("page", [16, 128])
def test_paged_decode_window_splits_from_the_key_tile_below_it(page):
    """One token with a window over pages read in place: the window stays (its mask hides the keys
    between the key tile the range starts on and the window's first key), the group packed by
    token, range_keys = left + 1."""
    b, hq, hkv, d, pages, left = 2, 8, 2, 16, 12, 200
    g = _gen(29)
    kp = torch.randn(b * pages + 2, page, hkv, d, generator=g, dtype=torch.float64)
    vp = torch.randn(b * pages + 2, page, hkv, d, generator=g, dtype=torch.float64)
    table = torch.randperm(b * pages + 2, generator=g)[:b * pages].view(b, pages).to(torch.int32)
    lens = torch.tensor([pages * page - 5, 3], dtype=torch.int32)
    q = torch.randn(b, 1, hq, d, generator=g, dtype=torch.float64)
    seen = []

    def spy(*args, **kw):
        seen.append((args[4], kw["range_keys"], tuple(kw["window"]), kw["rows_per_query"]))
        return split_stand_in(*args, **kw)

    out, lse = kv.with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=2, causal=True,
                               window_size=(left, 0), varlen=_no_varlen, split=spy, sm_count=16,
                               return_softmax_lse=True, paged_in_place=True)
    _check(out, lse, q, gather_pages(kp, table), gather_pages(vp, table), lens, causal=True,
           window=(left, 0))
    n = kv.split_chunks(min(pages * page, left + 1 + 127), 2)[1]
    eff = min(left, pages * page)  # a window past the cache's rows is clamped to them (it sees all of it)
    assert seen == [(n, eff + 1, (eff, None), 4)]


def test_key_range_window():
    """Which windows one query token turns into a key range."""
    assert kv.key_range_window(1, (100, 0), False) == ((None, None), 100)
    assert kv.key_range_window(1, (None, 5), False) == ((None, None), None)        # a right edge only: all keys
    assert kv.key_range_window(1, (100, 0), True) == ((100, 0), None)             # pages read in place: unsplit
    assert kv.key_range_window(3, (100, 0), False) == ((100, 0), None)            # several tokens keep the mask
    assert kv.key_range_window(1, (None, None), False) == ((None, None), None)

def test_cache_batch_idx_and_noncausal_split():
    g = _gen(4)
    b, sq, hq, d = 2, 3, 2, 16
    kc = torch.randn(4, 300, hq, d, generator=g, dtype=torch.float64)
    vc = torch.randn(4, 300, hq, d, generator=g, dtype=torch.float64)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    q = torch.randn(b, sq, hq, d, generator=g, dtype=torch.float64)
    lens = torch.tensor([290, 40], dtype=torch.int32)
    out, lse = call(q, kc, vc, cache_seqlens=lens, cache_batch_idx=idx, num_splits=2)
    _check(out, lse, q, kc[idx.long()], vc[idx.long()], lens)



def test_several_noncausal_tokens_packed_and_merged_unpacked():
    """Several non-causal query tokens of a GQA group over segments: packed by token, split, and the
    merge hands back the (B, Sq, Hq, Dv) / (B, Hq, Sq) layouts (merge_segments' unpack)."""
    b, sq, hq, hkv, d = 2, 3, 8, 2, 16
    q, kc, vc = _tokens_and_cache(27, b, sq, hq, hkv, d, 500)
    lens = torch.tensor([500, 130], dtype=torch.int32)
    seen = []

    def spy(q_seg, *rest, **kw):
        seen.append(q_seg.shape)
        return stand_in(q_seg, *rest, **kw)

    out, lse = kv.with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=3, varlen=spy, sm_count=16,
                               return_softmax_lse=True)
    n = kv._chunks(500, 3)[1]
    assert n > 1 and seen == [(b * n * sq * hq // hkv, hkv, d)]            # packed rows, n segments each
    _check(out, lse, q, kc, vc, lens)


def test_plan_and_heuristic(monkeypatch):
    assert kv.plan_layout(1, 4, True, (None, None), None) == (False, True, True)     # decode: packed, free
    assert kv.plan_layout(1, 4, True, (128, None), None) == (True, False, False)     # a window pins alignment
    assert kv.plan_layout(7, 4, True, (None, None), None) == (True, False, False)    # causal prefill
    # the split launch masks packed rows by token: a few causal tokens pack, up to 64 rows
    assert kv.plan_layout(7, 4, True, (None, None), None, token_rows=True) == (True, False, True)
    assert kv.plan_layout(17, 4, True, (None, None), None, token_rows=True) == (True, False, False)
    assert kv.plan_layout(2, 6, True, (None, None), None, token_rows=True) == (True, False, False)  # 6 ∤ 64
    assert kv.plan_layout(2, 4, True, (64, 0), None, token_rows=True) == (True, False, True)   # a window by token
    assert kv.plan_layout(7, 1, False, (None, None), None) == (False, True, False)   # MHA: nothing to pack
    with pytest.raises(ValueError, match=r"^pack_gqa: "):
        kv.plan_layout(7, 4, True, (None, None), True)
    # decode at batch 1, 8 KV heads on 132 SMs: one wave is 132 // 8 = 16 splits
    assert kv.choose_num_splits(1, 8, 8192, 132) == 16
    assert kv.choose_num_splits(1, 8, 1024, 132) == 4       # capped by 256 keys a split
    assert kv.choose_num_splits(64, 8, 32768, 132) == 1     # 512 CTAs already fill the GPU
    assert kv.choose_num_splits(16, 8, 16384, 132) == 1     # 128 CTAs: one wave already
    assert kv.choose_num_splits(8, 8, 32768, 132) == 2
    assert kv.choose_num_splits(2, 8, 1 << 20, 132) == 8
    assert kv.choose_num_splits(1, 1, 1 << 20, 132) == kv.MAX_SPLITS
    seg = kv.dense_segments(torch.tensor([1000, 5]), torch.tensor([0, 1]), 1024, 3)
    assert seg.n == 3 and seg.max_keys == 384
    assert seg.used.tolist() == [384, 384, 232, 5, 0, 0]
    assert seg.cu_k[:-1].tolist() == [0, 384, 768, 1024, 1408, 1792]
    # sequence b in cache row b: the same offsets, built once per shape and then reused (no kernel a call)
    _layouts._SHAPE_CONSTANTS.clear()
    ident = kv.dense_segments(torch.tensor([1000, 5], dtype=torch.int32), None, 1024, 3)
    assert ident.cu_k.tolist() == seg.cu_k.tolist() and ident.used.tolist() == seg.used.tolist()
    again = kv.dense_segments(torch.tensor([7, 900], dtype=torch.int32), None, 1024, 3)
    assert again.cu_k is ident.cu_k and again.used.tolist() == [7, 0, 0, 384, 384, 132]
    # a full table makes new ones per call and never drops a kept one (a captured graph may read it)
    kept = dict(_layouts._SHAPE_CONSTANTS)
    monkeypatch.setattr(_layouts, "MAX_SHAPE_CONSTANTS", len(kept))
    other = kv.dense_segments(torch.tensor([5], dtype=torch.int32), None, 512, 2)
    assert _layouts._SHAPE_CONSTANTS == kept and other.cu_k.tolist() == [0, 256, 0]
    assert kv.dense_segments(torch.tensor([7, 900], dtype=torch.int32), None, 1024, 3).cu_k is ident.cu_k


def test_errors_before_the_cache_is_touched():
    q = torch.zeros(1, 1, 4, 16, dtype=torch.float64)
    kc = torch.zeros(1, 8, 2, 16, dtype=torch.float64)
    k1 = torch.ones(1, 1, 2, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^q: fa4 runs on CUDA GPUs only"):
        fa4.flash_attn_with_kvcache(q.bfloat16(), kc.bfloat16(), kc.bfloat16())
    with pytest.raises(ValueError, match=r"^q: flash_attn_with_kvcache is forward only"):
        call(q.clone().requires_grad_(), kc, kc)
    with pytest.raises(ValueError, match=r"^k, v: pass both"):
        call(q, kc, kc, k1, None)
    with pytest.raises(ValueError, match=r"^cache_leftpad: not with block_table"):
        call(q, kc, kc, cache_leftpad=torch.zeros(1, dtype=torch.int32),
             block_table=torch.zeros(1, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^cache_leftpad: expected an int32 / int64 vector of length 1"):
        call(q, kc, kc, cache_leftpad=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"^cache_leftpad: expected an int32 / int64 vector"):
        call(q, kc, kc, cache_leftpad=torch.zeros(1, dtype=torch.float32))
    with pytest.raises(TypeError, match=r"^cache_leftpad: expected a torch.Tensor"):
        call(q, kc, kc, cache_leftpad=[0])
    with pytest.raises(TypeError, match=r"^block_table: expected an int32 tensor"):
        call(q, kc, kc, block_table=torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^block_table: expected int32 \(batch=1, pages per sequence\)"):
        call(q, kc, kc, block_table=torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^rotary_cos: rotary embedding .* needs k and v"):
        call(q, kc, kc, rotary_cos=torch.zeros(8, 4), rotary_sin=torch.zeros(8, 4))
    for bad in (True, 2.0, "2"):
        with pytest.raises(TypeError, match=r"^num_splits: expected an int"):
            call(q, kc, kc, num_splits=bad)
    with pytest.raises(TypeError, match=r"^k: expected q's dtype torch.float64, got torch.float32"):
        call(q, kc, kc, k1.float(), k1.float(), cache_seqlens=2)
    with pytest.raises(ValueError, match=r"^k_cache: head_dim 8 differs from q's head_dim 16"):
        call(q, kc[..., :8], kc[..., :8])
    with pytest.raises(ValueError, match=r"^v_cache: shape \(1, 4, 2, 16\) does not match k_cache"):
        call(q, kc, kc[:, :4])
    with pytest.raises(ValueError, match=r"^cache_seqlens: expected an int32 / int64 vector of length 1"):
        call(q, kc, kc, cache_seqlens=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"^cache_seqlens: 8 keys plus 1 new ones do not fit a cache of 8"):
        call(q, kc, kc, k1, k1, cache_seqlens=8)
    with pytest.raises(ValueError, match=r"^cache_seqlens: -1 keys"):
        call(q, kc, kc, k1, k1, cache_seqlens=-1)
    with pytest.raises(ValueError, match=r"^rotary_cos: expected \(seqlen_ro >= 8"):
        call(q, kc, kc, k1, k1, cache_seqlens=2, rotary_cos=torch.zeros(4, 4, dtype=torch.float64),
             rotary_sin=torch.zeros(4, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"^q: needs at least one query token"):
        call(q[:, :0], kc, kc, k1, k1, cache_seqlens=2)
    with pytest.raises(TypeError, match=r"^pack_gqa: expected None or a bool"):
        call(q, kc, kc, pack_gqa="no")
    with pytest.raises(TypeError, match=r"^k: expected a torch.Tensor or None"):
        call(q, kc, kc, [1.0], [1.0])
    assert kc.abs().max() == 0  # nothing was written by a refused call
    out, lse = call(q[:0], kc[:0], kc[:0])
    assert out.shape == (0, 1, 4, 16) and lse.shape == (0, 4, 1)


@pytest.mark.parametrize("bench, results, marker, row", [
    ("bench_decode", "bench_decode_h200.json", "decode-table", "| 1 x 128k |"),
    ("bench_hf_decode", "bench_hf_decode_h100.json", "hf-decode-table", "| 8 x 16k |")])
def test_readme_decode_tables_are_generated_from_the_committed_results(bench, results, marker, row):
    import importlib
    import json
    import pathlib

    table = importlib.import_module(f"benchmarks.{bench}").markdown_table
    root = pathlib.Path(__file__).resolve().parents[1]
    doc = json.loads((root / "benchmarks/results" / results).read_text())
    block = (root / "fa4/README.md").read_text().split(f"<!-- {marker}:start -->\n")[1].split(
        f"\n<!-- {marker}:end -->")[0]
    assert block == table(doc) and row in block


def test_paged_in_place_split_of_a_short_table_keeps_tile_aligned_starts():
    """Under 128 keys in the whole table, an explicit split would start segments off the key tile's
    borders (the kernel rounds a start down to its block): one segment instead."""
    g = _gen(21)
    b, hq, hkv, d, ps, pages = 2, 4, 2, 16, 16, 4
    kp = torch.randn(12, ps, hkv, d, generator=g, dtype=torch.float64)
    vp = torch.randn(12, ps, hkv, d, generator=g, dtype=torch.float64)
    table = torch.randperm(12, generator=g)[:b * pages].view(b, pages).to(torch.int32)
    lens = torch.tensor([64, 37], dtype=torch.int32)
    q = torch.randn(b, 1, hq, d, generator=g, dtype=torch.float64)
    out, lse = kv.with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=2, varlen=stand_in,
                               sm_count=16, return_softmax_lse=True, paged_in_place=True)
    _check(out, lse, q, gather_pages(kp, table), gather_pages(vp, table), lens)


def test_padded_block_table_entries_past_the_keys_are_never_indexed():
    """A server pads its tables with any value: the dense-copy fallback (pages < 128 keys the kernel
    cannot read in place) must not index with entries past a sequence's keys."""
    g = _gen(22)
    b, hq, hkv, d, ps = 2, 4, 2, 16, 8
    kp = torch.randn(10, ps, hkv, d, generator=g, dtype=torch.float64)
    vp = torch.randn(10, ps, hkv, d, generator=g, dtype=torch.float64)
    table = torch.tensor([[3, 7, 1_000_000, -5], [0, 9, 2, 4]], dtype=torch.int32)
    lens = torch.tensor([13, 30], dtype=torch.int32)
    q = torch.randn(b, 1, hq, d, generator=g, dtype=torch.float64)
    out, lse = call(q, kp, vp, cache_seqlens=lens, block_table=table)
    _check(out, lse, q, gather_pages(kp, table.clamp(0, 9)), gather_pages(vp, table.clamp(0, 9)), lens)


def test_stage3_paged_value_checks_name_the_argument():
    from stage3_fwd_kernel.hopper.host import check_paged_values

    table = torch.tensor([[4, 1, 99], [2, 3, 0]], dtype=torch.int32)
    ok = dict(num_pages=5, page_size=16, tile_n=16)
    check_paged_values(table, torch.tensor([0, 16]), torch.tensor([32, 32]), **ok)   # page 99 is never used
    with pytest.raises(ValueError, match="^cu_seqlens_k: "):
        check_paged_values(table, torch.tensor([8, 0]), torch.tensor([8, 8]), **ok)
    with pytest.raises(ValueError, match="^seqused_k: "):
        check_paged_values(table, torch.tensor([0, 16]), torch.tensor([8, 40]), **ok)
    with pytest.raises(ValueError, match="^page_table: row 0 uses page 99"):
        check_paged_values(table, torch.tensor([0, 0]), torch.tensor([33, 8]), **ok)


# ---------------------------------------------------------------------------------------------
# traced calls (torch.compile, fake and meta tensors): the attention is one custom op
# ---------------------------------------------------------------------------------------------
def _meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


TRACED_CASES = {  # name -> (call kwargs beyond q / caches, q tokens, paged)
    "one-token": (dict(), 1, False),
    "append-rotary-causal": (dict(causal=True, rotary=True), 3, False),
    "paged-window": (dict(causal=True, window_size=(100, 0), append=True), 2, True),
    "cache-rows-softcap": (dict(rows=True, softcap=30.0), 1, False),
}


def _traced_call(name):
    """(fn, args) of a decode step on meta tensors: 2 sequences, GQA 32 / 8, d = 128, a 1024-key cache."""
    kw, sq, paged = TRACED_CASES[name]
    kw = dict(kw)
    rotary, append, rows = kw.pop("rotary", False), kw.pop("append", False), kw.pop("rows", False)
    q = _meta(2, sq, 32, 128)
    caches = (_meta(16, 64, 8, 128), _meta(16, 64, 8, 128)) if paged else (_meta(3, 1024, 8, 128),) * 2
    extra = [_meta(2, dtype=torch.int32)]
    names = ["cache_seqlens"]
    if paged:
        extra.append(_meta(2, 16, dtype=torch.int32))
        names.append("block_table")
    if rows:
        extra.append(_meta(2, dtype=torch.int32))
        names.append("cache_batch_idx")
    if rotary or append:
        extra += [_meta(2, sq, 8, 128), _meta(2, sq, 8, 128)]
        names += ["k", "v"]
    if rotary:
        extra += [_meta(1024, 32, dtype=torch.float32)] * 2
        names += ["rotary_cos", "rotary_sin"]

    def fn(q, k_cache, v_cache, *rest):
        return fa4.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kw,
                                           **dict(zip(names, rest)))
    return fn, (q, *caches, *extra)


@pytest.mark.parametrize("name", list(TRACED_CASES))
def test_traced_decode_step_is_one_op_without_graph_breaks(name):
    """On meta tensors (shapes only) a decode step traces into one graph whose attention is the
    fa4::kvcache_attention op (the eager path inside), fullgraph-compilable, with the call's shapes."""
    fn, args = _traced_call(name)
    q, v_cache = args[0], args[2]
    want = ((q.shape[0], q.shape[1], q.shape[2], v_cache.shape[-1]), (q.shape[0], q.shape[2], q.shape[1]))
    out, lse = fn(*args)                                                     # eager on meta: the op's fake
    assert (tuple(out.shape), tuple(lse.shape)) == want and out.dtype == q.dtype and lse.dtype == torch.float32
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    out, lse = torch.compile(fn, fullgraph=True, backend=backend)(*args)     # fullgraph: a break raises
    assert (tuple(out.shape), tuple(lse.shape)) == want
    assert sum("kvcache_attention" in t for t in targets) == 1, targets
    assert not any("varlen_fwd" in t for t in targets), "the attention left the op"
    torch._dynamo.reset()
    out, lse = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
    assert (tuple(out.shape), tuple(lse.shape)) == want
    torch._dynamo.reset()


def test_kvcache_attention_op_schema_and_fake():
    """The op's registration: its schema reads no input as mutated, and its fake gives the eager path's
    shapes, strides and dtypes."""
    op = torch.ops.fa4.kvcache_attention.default
    assert not any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)
    q, kc, lens = _meta(3, 2, 16, 64), _meta(3, 512, 4, 64), _meta(3, dtype=torch.int32)
    out, lse = torch.ops.fa4.kvcache_attention(q, kc, _meta(3, 512, 4, 32), lens, None, None, None, 0.125, True,
                                               None, None, 0.0, 0, None)
    assert tuple(out.shape) == (3, 2, 16, 32) and out.is_contiguous() and out.dtype == q.dtype
    assert tuple(lse.shape) == (3, 16, 2) and lse.is_contiguous() and lse.dtype == torch.float32


def _refusal_cases():
    m = _meta
    q, kc, vc, kn, vn = m(2, 1, 8, 128), m(2, 256, 2, 128), m(2, 256, 2, 128), m(2, 1, 2, 128), m(2, 1, 2, 128)
    cos = m(256, 32, dtype=torch.float32)
    grad_cos = torch.empty(256, 32, device="meta", requires_grad=True)
    table = torch.zeros(2, 4, dtype=torch.int32, device="meta")
    return [
        ("new-tokens-overflow", (q, kc, vc, m(2, 300, 2, 128), m(2, 300, 2, 128)), {}, ValueError,
         r"^k: 300 new tokens do not fit a cache of 256 rows"),
        ("rotary-requires-grad", (q, kc, vc, kn, vn), dict(rotary_cos=grad_cos, rotary_sin=grad_cos, cache_seqlens=3),
         ValueError, r"^rotary_cos: flash_attn_with_kvcache is forward only"),
        ("sink-requires-grad", (q, kc, vc), dict(learnable_sink=torch.zeros(8, device="meta", requires_grad=True)),
         ValueError, r"^learnable_sink: flash_attn_with_kvcache is forward only"),
        ("causal-int", (q, kc, vc), dict(causal=1), TypeError, r"^causal: expected a bool"),
        ("lse-flag", (q, kc, vc), dict(return_softmax_lse="no"), TypeError, r"^return_softmax_lse: expected a bool"),
        ("interleaved-flag", (q, kc, vc), dict(rotary_interleaved=2), TypeError, r"^rotary_interleaved: expected"),
        ("rotary-int", (q, kc, vc, kn, vn), dict(rotary_cos=cos.to(torch.int64), rotary_sin=cos.to(torch.int64)),
         TypeError, r"^rotary_cos, rotary_sin: expected one floating dtype"),
        ("rotary-mixed", (q, kc, vc, kn, vn), dict(rotary_cos=cos, rotary_sin=cos.half()), TypeError,
         r"^rotary_cos, rotary_sin: expected one floating dtype"),
        ("no-pages", (q, m(0, 64, 2, 128), m(0, 64, 2, 128)), dict(block_table=table), ValueError,
         r"^k_cache: a paged cache needs at least one page"),
        ("page-size-0", (q, m(16, 0, 2, 128), m(16, 0, 2, 128)), dict(block_table=table), ValueError,
         r"^k_cache: a paged cache needs at least one page of at least one row"),
        ("paged-keys-past-int32", (q, m(2, 65536, 2, 128), m(2, 65536, 2, 128)),
         dict(block_table=torch.zeros(2, 32768, dtype=torch.int32, device="meta")), ValueError,
         r"^block_table: 32768 pages of 65536 rows a sequence \(2147483648 keys\) exceed the kernel's int32"),
        ("page-pool-past-int32", (q, m(32768, 65536, 2, 128), m(32768, 65536, 2, 128)), dict(block_table=table),
         ValueError, r"^k_cache: 32768 x 65536 rows exceed the kernel's int32 row offsets"),
        ("batch-idx-into-no-rows", (q, m(0, 256, 2, 128), m(0, 256, 2, 128)),
         dict(cache_batch_idx=torch.zeros(2, dtype=torch.int32, device="meta")), ValueError,
         r"^k_cache: cache_batch_idx names rows of a cache that has none"),
        ("head-dim-meta", (m(2, 1, 8, 100), m(2, 256, 2, 100), m(2, 256, 2, 100)), {}, ValueError,
         r"^q: head dims \(qk=100, v=100\) have no kernel of their own on sm_90; flash_attn_with_kvcache reads "),
        ("v-head-dim-meta", (m(2, 1, 8, 128), m(2, 256, 2, 128), m(2, 256, 2, 72)), {}, ValueError,
         r"^v_cache: head dims \(qk=128, v=72\) have no kernel of their own on sm_90"),
    ]


@pytest.mark.parametrize("case", _refusal_cases(), ids=lambda c: c[0])
def test_kvcache_refusals_name_the_argument(case):
    """Shapes, dtypes and flags a decode step cannot serve are refused before the append or a launch
    (checked on meta tensors: no device needed)."""
    _, args, kw, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        fa4.flash_attn_with_kvcache(*args, **kw)


def test_constants_made_under_a_fake_tensor_mode_are_not_kept():
    """A cached shape-only constant (segment offsets, identity rows, default seqlens) made under a user's
    FakeTensorMode is fake: it is neither kept nor served from the cache there, so a later real call
    gets a real tensor, and a fake call never mixes in a real one."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    key = ("test-constant", torch.device("cpu"), 5)
    _layouts._SHAPE_CONSTANTS.pop(key, None)
    try:
        with FakeTensorMode():
            fake = _layouts.shape_constant(key, lambda: torch.arange(5, dtype=torch.int32))
        assert isinstance(fake, FakeTensor) and key not in _layouts._SHAPE_CONSTANTS
        real = _layouts.shape_constant(key, lambda: torch.arange(5, dtype=torch.int32))
        assert type(real) is torch.Tensor and _layouts._SHAPE_CONSTANTS[key] is real
        with FakeTensorMode():
            again = _layouts.shape_constant(key, lambda: torch.arange(5, dtype=torch.int32))
        assert isinstance(again, FakeTensor)
    finally:
        _layouts._SHAPE_CONSTANTS.pop(key, None)


def test_segments_never_outnumber_a_grid(monkeypatch):
    """One varlen sequence per page (pages the kernel cannot read in place), or an explicit num_splits,
    must keep batch x segments within a grid's z extent: past it the pages are copied into a dense cache
    and the splits capped, where the launch used to be refused after the append (MAX_GRID_Z shrunk here
    to 8 so that small tensors reach it)."""
    monkeypatch.setattr(kv, "MAX_GRID_Z", 8)
    seen = []

    def counting(q, k, v, cu_q, cu_k, used, *rest, **kw):
        seen.append(used.shape[0])                                                  # the launch's sequences
        return stand_in(q, k, v, cu_q, cu_k, used, *rest, **kw)
    g = _gen(40)
    b, hq, hkv, d, ps, pages = 3, 4, 2, 16, 128, 4          # 12 page segments > 8
    kp = torch.randn(b * pages, ps, hkv, d, generator=g, dtype=torch.float64)
    vp = torch.randn(b * pages, ps, hkv, d, generator=g, dtype=torch.float64)
    table = torch.randperm(b * pages, generator=g).to(torch.int32).view(b, pages)
    q = torch.randn(b, 1, hq, d, generator=g, dtype=torch.float64)
    lens = torch.tensor([512, 300, 7], dtype=torch.int32)
    out, lse = kv.with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, varlen=counting, sm_count=16,
                               return_softmax_lse=True)
    assert seen and max(seen) <= 8, seen
    _check(out, lse, q, gather_pages(kp, table), gather_pages(vp, table), lens)
    seen.clear()
    q, kc, vc = _tokens_and_cache(41, 3, 1, hq, hkv, d, 1024)
    out, lse = kv.with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=16, varlen=counting, sm_count=16,
                               return_softmax_lse=True)
    assert seen and max(seen) <= 8, seen
    _check(out, lse, q, kc, vc, lens)


def test_validate_checks_the_pages_a_sequence_reads_or_appends_to(monkeypatch):
    """FA4_VALIDATE=1: a table entry a sequence reads or appends through must be a page of the pool (a -1
    there wrapped to the pool's last page and overwrote another sequence's key); entries past the used
    pages may hold anything, -1 padding included."""
    monkeypatch.setenv("FA4_VALIDATE", "1")
    g = _gen(42)
    hq, hkv, d, ps = 4, 2, 16, 4
    kp = torch.randn(6, ps, hkv, d, generator=g, dtype=torch.float64)
    vp = kp.clone()
    q, k_new = torch.randn(2, 2, hq, d, generator=g, dtype=torch.float64), torch.randn(2, 2, hkv, d, generator=g,
                                                                                       dtype=torch.float64)
    bad = torch.tensor([[3, -1], [5, 1]], dtype=torch.int32)     # sequence 0 appends keys 3, 4: page entry 1
    with pytest.raises(ValueError, match=r"^block_table: entry \[0, 1\] = -1 is a page sequence 0 reads or appends"):
        call(q, kp, vp, k_new, k_new.clone(), cache_seqlens=torch.tensor([3, 1], dtype=torch.int32), block_table=bad,
             causal=True)
    assert torch.equal(kp, vp)                                    # refused before the append
    padded = torch.tensor([[3, -1], [5, 1]], dtype=torch.int32)   # sequence 0 ends in its first page: fine
    call(q, kp, vp, k_new, k_new.clone(), cache_seqlens=torch.tensor([1, 1], dtype=torch.int32), block_table=padded,
         causal=True)


# ---------------------------------------------------------------------------------------------
# refusals before the append, and windows past the cache (found by review)
# ---------------------------------------------------------------------------------------------
def test_unservable_calls_are_refused_before_anything_is_appended(monkeypatch):
    """pack_gqa=True with a mask the split launch cannot pack, q's rotary positions past rotary_cos,
    and (FA4_VALIDATE=1) cache_batch_idx rows outside the cache: each a ValueError naming the argument,
    with the cache untouched (each used to write the new tokens first, or not to check at all)."""
    q, kc, vc = _tokens_and_cache(41, 1, 2, 6, 2, 16, 8)
    k, v = kc[:, :2].clone(), vc[:, :2].clone()
    before = kc.clone()
    with pytest.raises(ValueError, match="pack_gqa"):
        call(q, kc, vc, k, v, cache_seqlens=3, causal=True, pack_gqa=True)
    angles = torch.rand(8, 4, dtype=torch.float64)
    q3, k1, v1 = torch.randn(1, 3, 6, 16, dtype=torch.float64), k[:, :1], v[:, :1]
    with pytest.raises(ValueError, match="rotary_cos"):
        call(q3, kc, vc, k1, v1, cache_seqlens=6, rotary_cos=angles.cos(), rotary_sin=angles.sin(), causal=True)
    monkeypatch.setenv("FA4_VALIDATE", "1")
    q2, kc3, vc3 = _tokens_and_cache(42, 2, 1, 2, 2, 16, 8)
    kc3, vc3 = torch.cat([kc3, kc3[:1]]), torch.cat([vc3, vc3[:1]])                  # 3 cache rows
    before3 = kc3.clone()
    for idx in ([0, 5], [-1, 0]):
        with pytest.raises(ValueError, match="cache_batch_idx"):
            call(q2, kc3, vc3, kc3[:2, :1].clone(), vc3[:2, :1].clone(),
                 cache_seqlens=torch.tensor([2, 3], dtype=torch.int32),
                 cache_batch_idx=torch.tensor(idx, dtype=torch.int32))
    assert torch.equal(kc, before) and torch.equal(kc3, before3)


def test_num_splits_below_one_is_the_automatic_choice():
    """FlashAttention-2 takes any num_splits < 1 as its heuristic: -1 gives num_splits=0's segments."""
    q, kc, vc = _tokens_and_cache(41, 2, 1, 4, 2, 16, 1024)
    lens = torch.tensor([900, 1000], dtype=torch.int32)
    seen = []

    def spy(*args, **kwargs):
        seen.append(tuple(args[3].shape))  # cu_seqlens_k: one entry per segment, plus one
        return stand_in(*args, **kwargs)

    outs = [kv.with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=n, varlen=spy, sm_count=16,
                            return_softmax_lse=True) for n in (0, -1, -7)]
    assert len(set(seen)) == 1 and seen[0][0] > 3  # the same split segments, more than one per sequence
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


@pytest.mark.parametrize("window", [(10 ** 6, None), (-1, 10 ** 6), (32, None), (8, None), (None, 8)])
def test_rotary_positions_of_a_window_that_masks_nothing(window):
    """FlashAttention-2 rotates q token by token (cache_seqlens + i) only when the call is causal or local,
    and a window side of at least the cache's rows is no window: such a call rotates all of q at
    cache_seqlens, as a call without a window does (it used to step them). A side below the rows steps."""
    q, kc, vc = _tokens_and_cache(43, 1, 3, 2, 1, 16, 32)
    g = _gen(44)
    kn, vn = (torch.randn(1, 3, 1, 16, generator=g, dtype=torch.float64) for _ in range(2))
    angles = torch.rand(64, 4, generator=g, dtype=torch.float64)
    cos, sin = angles.cos(), angles.sin()

    def step(window_size):
        k_cache, v_cache = kc.clone(), vc.clone()
        return call(q, k_cache, v_cache, kn, vn, rotary_cos=cos, rotary_sin=sin, cache_seqlens=10,
                    window_size=window_size)[0]

    plain = step((None, None))
    masks_nothing = all(side is None or side < 0 or side >= 32 for side in window)  # the cache: 32 rows
    if masks_nothing:  # the same keys, maybe cut into other segments: equal to float64 rounding
        torch.testing.assert_close(step(window), plain, rtol=1e-12, atol=1e-12)
    else:
        windowed = step(window)
        assert windowed.shape == plain.shape and not torch.allclose(windowed, plain)


def test_a_traced_paged_call_refuses_pack_gqa_before_the_append():
    """Traced (torch.compile, fake or meta tensors), a paged call's route is decided inside the
    kvcache_attention op, after the append; on sm_90 that route checks the token's window as a mask, so
    packing a group that does not divide the 64-row tile is refused there. The up-front check now makes
    the same decision, before the new token is written (it used to pass, and the op failed on the GPU)."""
    m = lambda *s: torch.empty(*s, device="meta", dtype=torch.bfloat16)  # noqa: E731
    table = torch.zeros(2, 4, dtype=torch.int32, device="meta")
    args = (m(2, 1, 6, 64), m(16, 64, 2, 64), m(16, 64, 2, 64))
    new_kv = dict(k=m(2, 1, 2, 64), v=m(2, 1, 2, 64), cache_seqlens=3, block_table=table)
    with pytest.raises(ValueError, match=r"^pack_gqa: packing the query heads needs"):
        fa4.flash_attn_with_kvcache(*args, window_size=(8, None), pack_gqa=True, **new_kv)
    out = fa4.flash_attn_with_kvcache(*args, window_size=(8, None), **new_kv)  # pack_gqa None: not packed
    assert out.shape == (2, 1, 6, 64)
    out = fa4.flash_attn_with_kvcache(*args, pack_gqa=True, **new_kv)  # no window: the group packs
    assert out.shape == (2, 1, 6, 64)


def test_a_batch_past_the_grid_limit_is_refused_before_the_append():
    """65536 sequences exceed every route's grid (y / z <= 65535): refused naming q's batch before the
    new tokens are written (it used to append, then fail naming num_splits)."""
    m = lambda *s: torch.empty(*s, device="meta", dtype=torch.bfloat16)  # noqa: E731
    with pytest.raises(ValueError, match=r"^q: batch \(65536\) and heads \(2\) must be <= 65535"):
        fa4.flash_attn_with_kvcache(m(65536, 1, 2, 64), m(65536, 16, 2, 64), m(65536, 16, 2, 64), k=m(65536, 1, 2, 64),
                                    v=m(65536, 1, 2, 64), cache_seqlens=3)


@pytest.mark.parametrize("split", [False, True])
def test_a_window_past_the_cache_sees_all_of_it(split):
    """A left window of 2^32 + 3 or 10^12 keys wrapped in int32 key offsets (wrong lse, or a refusal after
    the append): it is clamped to the cache's rows, and equals no left edge."""
    q, kc, vc = _tokens_and_cache(43, 1, 1, 128 if not split else 8, 1 if not split else 2, 16, 300)
    lens = torch.tensor([300], dtype=torch.int32)
    kw = dict(varlen=_no_varlen, split=split_stand_in) if split else {}
    want = kv.with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=(None, 0), causal=True, sm_count=16,
                           return_softmax_lse=True, **({"varlen": stand_in} | kw))
    for left in (2 ** 32 + 3, 10 ** 12, 2 ** 31 - 2):
        got = kv.with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=(left, 0), causal=True, sm_count=16,
                              return_softmax_lse=True, **({"varlen": stand_in} | kw))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("window", [(None, 6), (2, 9), (None, 3), (50, 50)])
def test_right_window_past_the_cache_with_more_queries_than_keys(window):
    """The window's edges are clamped (int32 key offsets), the right one to the cache's rows plus the
    queries: 8 queries over 4 keys with right = 6 leave row 0 keys 0-2 (4 - 8 + 6 = 2), which a clamp to
    the 4 rows alone cut to key 0. Also the route flash_attn_func's decode calls take (fa4/_decode_route.py)."""
    q, kc, vc = _tokens_and_cache(5, 2, 8, 4, 2, 16, 4)
    out, lse = kv.with_kvcache(q, kc, vc, window_size=window, varlen=_no_varlen, split=split_stand_in, sm_count=16,
                               return_softmax_lse=True)
    _check(out, lse, q, kc, vc, [4, 4], window=window)


@pytest.mark.parametrize("route", ["split", "segments"])
def test_cache_leftpad_starts_each_sequence_at_its_row(route):
    """cache_leftpad (FlashAttention-2's): sequence b attends to cache rows [leftpad[b], cache_seqlens[b] + new)
    -- a left-padded batch served in place -- with the new keys written at cache_seqlens[b], rotary positions the
    row indices, and the masks counted from the sequence's end: one token, causal tokens with a window, and a
    causal prefill longer than the split launch takes, over the split launch and over the varlen segments;
    cache_batch_idx and a padding that covers every key included."""
    g = _gen(41)
    hq, hkv, d, s_cache = 8, 2, 16, 640
    lens = torch.tensor([600, 250, 90, 7], dtype=torch.int32)
    pad = torch.tensor([3, 129, 0, 7], dtype=torch.int32)          # off the key tile, past a chunk, none, all
    b = lens.shape[0]
    cases = [dict(q_len=1), dict(q_len=1, causal=True, window_size=(60, 0), rows=[4, 0, 2, 1]),
             dict(q_len=3, causal=True, window_size=(100, 0), softcap=2.0),
             dict(q_len=3, causal=True, new=2, rotary=True), dict(q_len=80, causal=True)]
    for case in cases:
        kc = torch.randn(b + 1, s_cache, hkv, d, generator=g, dtype=torch.float64)
        vc = torch.randn(b + 1, s_cache, hkv, d, generator=g, dtype=torch.float64)
        q = torch.randn(b, case["q_len"], hq, d, generator=g, dtype=torch.float64)
        rows = None if "rows" not in case else torch.tensor(case["rows"], dtype=torch.int32)
        kw = dict(causal=case.get("causal", False), window_size=case.get("window_size", (None, None)),
                  softcap=case.get("softcap", 0.0), cache_batch_idx=rows)
        new = case.get("new", 0)
        extra, want_q = {}, q
        r = torch.arange(b) if rows is None else rows.long()
        keys, values = kc[r].clone(), vc[r].clone()
        if new:
            k1 = torch.randn(b, new, hkv, d, generator=g, dtype=torch.float64)
            v1 = torch.randn(b, new, hkv, d, generator=g, dtype=torch.float64)
            cos, sin = torch.cos(torch.rand(s_cache + 8, 4, generator=g, dtype=torch.float64)), \
                torch.sin(torch.rand(s_cache + 8, 4, generator=g, dtype=torch.float64))
            extra = dict(k=k1, v=v1, rotary_cos=cos, rotary_sin=sin)
            pos = lens.long()[:, None] + torch.arange(max(new, q.shape[1]))
            want_q = kv.apply_rotary(q, cos, sin, pos[:, :q.shape[1]], True)
            k_rot = kv.apply_rotary(k1, cos, sin, pos[:, :new], True)
            for i in range(b):
                keys[i, lens[i]:lens[i] + new], values[i, lens[i]:lens[i] + new] = k_rot[i], v1[i]
        seen = []

        def spy(*args, **kw_):
            seen.append(kw_["key_starts"])
            return split_stand_in(*args, **kw_)

        split_kw = dict(split=spy, varlen=_no_varlen) if route == "split" and case["q_len"] * 4 <= 64 else \
            dict(varlen=stand_in)
        out, lse = kv.with_kvcache(q, kc, vc, cache_seqlens=lens, cache_leftpad=pad, num_splits=2, sm_count=16,
                                   return_softmax_lse=True, **extra, **kw, **split_kw)
        if "split" in split_kw:
            assert len(seen) == 1 and torch.equal(seen[0], pad)
        if new:  # written at cache_seqlens, not after the padding
            torch.testing.assert_close(kc[r][torch.arange(b)[:, None], lens.long()[:, None] + torch.arange(new)],
                                       keys[torch.arange(b)[:, None], lens.long()[:, None] + torch.arange(new)])
        for i in range(b):
            first, last = int(pad[i]), int(lens[i]) + new
            want, wl = dense(want_q[i], keys[i, first:last], values[i, first:last], d ** -0.5, kw["causal"],
                             kw["window_size"], kw["softcap"])
            seen_keys = torch.isfinite(wl)
            torch.testing.assert_close(lse[i][seen_keys].double(), wl[seen_keys], rtol=1e-9, atol=1e-9)
            assert torch.all(lse[i][~seen_keys] == float("-inf")), f"rows without keys, sequence {i}, {case}"
            torch.testing.assert_close(out[i].double().permute(1, 0, 2)[seen_keys], want.permute(1, 0, 2)[seen_keys],
                                       rtol=1e-9, atol=1e-9, msg=lambda m: f"sequence {i}, {case}: {m}")
