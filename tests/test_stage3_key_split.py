"""The split-KV launch (stage3_fwd_kernel.components.key_split) on the CPU.

`simulate` walks a key-split launch the way the Hopper kernel does, calling the kernel object's own
trace-time methods on Python integers: `locate` (components.work_tile) turns each virtual sequence
into (sequence, chunk, keys to the end, batch indices), `key_range` gives the blocks walked (counted
in query tokens, capped at the chunk's end), `num_masked_blocks` with the kernel's `query_tile_m`
says which of them get a mask -- the others are taken whole -- and the kernel's mask gives each row
its token's limit (`query_of`, `key_limit`).
The parts it leaves are merged through their lse and compared with dense float64 attention: causal or
not, GQA heads packed as rows or not, chunks that cut the diagonal, empty chunks and sequences shorter
than the query. The compile tier checks what the builds contain (no spills, the PDL signal).
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest

from stage0_reference import attention_forward  # the float64 oracle (bottom-right causal, GQA)
from stage3_fwd_kernel.components.block_range import num_left_masked_blocks, num_masked_blocks
from stage3_fwd_kernel.components.key_split import RANGE_ALL, KeySplit, chunk_blocks, chunk_of
from stage3_fwd_kernel.components.window import Window
from stage3_fwd_kernel.components.work_tile import SequenceInfo

pytestmark = pytest.mark.stage3


def split_kernel(causal, g, tile_m=64, window=None):
    """The Hopper forward built with a key split (head dim 16: the CPU reference's size), set up as its
    launch would be for trace-time calls on Python integers. window: a Window beyond causal."""
    import cutlass

    from stage3_fwd_kernel.hopper import FlashAttentionForwardSm90

    kernel = FlashAttentionForwardSm90(cutlass.BFloat16, 16, 16, causal, tile_m=tile_m, key_split=True,
                                       rows_per_query=g, window=window or Window(None, None))
    kernel.varlen = False
    kernel.q_shift = kernel.q_shift_for(False)
    return kernel


def simulate(q, k, v, lens, n, chunk, causal, g, tile_m=64, range_keys=None, window=None, range_align=1,
             key_starts=None):
    """q (B, R, H, D) with R = tokens * g rows (row t g + j: token t of group head j when g > 1, H then
    the KV heads), k / v (B, S, Hkv, *) -> parts out (B n, R, H, Dv), lse (B n, H, R). range_keys W:
    each sequence's last W keys only (the first rounded down to range_align); window: a Window;
    key_starts: each sequence's first key (cache_leftpad)."""
    b, r, h, _ = q.shape
    kernel = split_kernel(causal, g, tile_m, window)
    tn, mask = kernel.tile_n, kernel.mask
    kernel.split = KeySplit(n, chunk, False, range_keys, range_align, key_starts=key_starts)
    seq = SequenceInfo(r, k.shape[1], h // k.shape[2], None, None, list(lens), None, kernel.split)
    out = np.zeros((b * n, r, h, v.shape[-1]))
    lse = np.full((b * n, h, r), -np.inf)
    for virtual in range(b * n):
        for head in range(h):
            for m_block in range(math.ceil(r / tile_m)):
                tile = kernel.locate(m_block, head, virtual, seq)
                n_min, n_max = kernel.key_range(tile)
                n_min = 0 if n_min is None else int(n_min)
                n_blocks = max(int(n_max) - n_min, 0)
                query_len, keys_to_end = kernel.query_len(tile), int(tile.seqlen_k)
                n_masked = min(int(num_masked_blocks(m_block, query_len, keys_to_end, n_max, tile_m=kernel.query_tile_m,
                                                     tile_n=tn, window=kernel.window)), n_blocks)
                n_left = int(num_left_masked_blocks(m_block, query_len, keys_to_end, n_min, n_blocks,
                                                    tile_m=kernel.query_tile_m, tile_n=tn, window=kernel.window))
                for row in range(m_block * tile_m, min(r, (m_block + 1) * tile_m)):
                    cols = []
                    for i in range(n_blocks):                     # walked last block first, as the kernel does
                        blk = int(n_max) - 1 - i
                        if i < n_masked or i >= n_blocks - n_left:
                            token = mask.query_of(row)
                            limit = int(mask.key_limit(token, blk, query_len, keys_to_end))
                            start = int(mask.key_start(token, blk, query_len, keys_to_end)) \
                                if kernel.window.left is not None else 0
                            cols.append(blk * tn + np.arange(max(0, start), max(0, min(tn, limit))))
                        else:
                            cols.append(blk * tn + np.arange(tn))          # unmasked blocks: whole
                    idx = np.concatenate(cols) if cols else np.arange(0)
                    if idx.size == 0:
                        continue
                    idx = int(tile.offset_k) + np.sort(idx)
                    s = k[tile.batch_kv, idx, tile.head_kv] @ q[tile.batch, row, head] / math.sqrt(q.shape[-1])
                    top = s.max()
                    p = np.exp(s - top)
                    out[tile.batch_out, row, head] = p @ v[tile.batch_kv, idx, tile.head_kv] / p.sum()
                    lse[tile.batch_out, head, row] = top + math.log(p.sum())
    return out, lse


def merge(out, lse, n):
    bn, r, h, dv = out.shape
    lse = lse.reshape(bn // n, n, h, r)
    top = np.where(np.isfinite(lse.max(1)), lse.max(1), 0.0)
    w = np.exp(lse - top[:, None])                                                      # (B, n, H, R)
    total = w.sum(1)
    safe = np.where(total > 0, total, 1.0)                                               # (B, H, R)
    merged = np.einsum("bnhr,bnrhd->brhd", w, out.reshape(bn // n, n, r, h, dv)) / safe.transpose(0, 2, 1)[..., None]
    return merged, np.where(total > 0, top + np.log(safe), -np.inf)


@pytest.mark.cpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("n, chunk", [(1, 640), (3, 256), (5, 128)])
def test_split_walk_matches_dense_attention(causal, g, n, chunk):
    rng = np.random.default_rng(7 + n + 3 * g + causal)
    b, tokens, hkv, d, s_cache = 3, 5, 2, 16, 640
    lens = [640, 258, 3]          # full; the diagonal's rows across a chunk edge (keys 253 .. 257); < tokens
    hq = hkv * g if g > 1 else 4
    q = rng.standard_normal((b, tokens, hq, d))
    k = rng.standard_normal((b, s_cache, hkv, d))
    v = rng.standard_normal((b, s_cache, hkv, d))
    # the kernel's rows: packed (row t g + j, head = KV head) or one row per token (head = query head)
    rows = q.reshape(b, tokens, hkv, g, d).transpose(0, 1, 3, 2, 4).reshape(b, tokens * g, hkv, d) if g > 1 else q
    out, lse = merge(*simulate(rows, k, v, lens, n, chunk, causal, g), n)
    for i, n_keys in enumerate(lens):
        want, want_lse = attention_forward(q[i:i + 1], k[i:i + 1, :n_keys], v[i:i + 1, :n_keys], causal=causal)
        want, want_lse = want[0], want_lse[0]                                          # (T, Hq, Dv), (Hq, T)
        got, got_lse = out[i], lse[i]
        if g > 1:  # back from packed rows: row t g + j of KV head kv is query head kv g + j
            got = got.reshape(tokens, g, hkv, -1).transpose(0, 2, 1, 3).reshape(tokens, hq, -1)
            got_lse = got_lse.reshape(hkv, tokens, g).transpose(0, 2, 1).reshape(hq, tokens)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"out, sequence {i}")
        np.testing.assert_array_equal(np.isfinite(got_lse), np.isfinite(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(got_lse[fin], want_lse[fin], rtol=1e-10, err_msg=f"lse, sequence {i}")


@pytest.mark.cpu
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("n, chunk, window", [(1, 384, 300), (3, 128, 300), (2, 128, 256), (4, 128, 1)])
def test_split_walk_of_a_key_range_matches_the_window(g, n, chunk, window):
    """range_keys W: one query token reads only its sequence's last W keys, chunked from key
    max(L - W, 0) (not a multiple of the key tile), and merges to attention over those keys -- one
    token's sliding window of left edge W - 1. Sequences longer than the window, shorter, and empty."""
    rng = np.random.default_rng(11 + n + g + window)
    b, hkv, d, s_cache = 4, 2, 16, 640
    lens = [640, 333, 57, 0]
    hq = hkv * g if g > 1 else 4
    q = rng.standard_normal((b, 1, hq, d))
    k = rng.standard_normal((b, s_cache, hkv, d))
    v = rng.standard_normal((b, s_cache, hkv, d))
    rows = q.reshape(b, 1, hkv, g, d).transpose(0, 1, 3, 2, 4).reshape(b, g, hkv, d) if g > 1 else q
    out, lse = merge(*simulate(rows, k, v, lens, n, chunk, False, g, range_keys=window), n)
    for i, n_keys in enumerate(lens):
        got, got_lse = out[i], lse[i]
        if g > 1:
            got = got.reshape(1, g, hkv, -1).transpose(0, 2, 1, 3).reshape(1, hq, -1)
            got_lse = got_lse.reshape(hkv, 1, g).transpose(0, 2, 1).reshape(hq, 1)
        if n_keys == 0:
            assert np.all(got == 0) and np.all(got_lse == -np.inf)
            continue
        first = max(n_keys - window, 0)
        want, want_lse = attention_forward(q[i:i + 1], k[i:i + 1, first:n_keys], v[i:i + 1, first:n_keys])
        np.testing.assert_allclose(got, want[0], rtol=1e-10, atol=1e-12, err_msg=f"out, sequence {i}")
        np.testing.assert_allclose(got_lse, want_lse[0], rtol=1e-10, err_msg=f"lse, sequence {i}")


@pytest.mark.cpu
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("tokens, left", [(1, 200), (3, 150), (5, 0), (2, 700)])
@pytest.mark.parametrize("align", [1, 128])
def test_split_walk_with_a_window_matches_sliding_window_attention(g, tokens, left, align):
    """A window in the split walk: causal tokens at the cache's end with a left edge, the GQA group
    packed by token, over a key range of left + tokens keys -- exact (dense) or from the key tile below
    it (paged, `range_align`: the window masks the extra keys) -- and, without a range, over the whole
    cache, where the chunks left of the window walk nothing."""
    rng = np.random.default_rng(5 + g + tokens + left + align)
    b, hkv, d, s_cache = 4, 2, 16, 1024
    lens = [1024, 333, 3, 0]
    hq = hkv * g if g > 1 else 4
    q = rng.standard_normal((b, tokens, hq, d))
    k = rng.standard_normal((b, s_cache, hkv, d))
    v = rng.standard_normal((b, s_cache, hkv, d))
    rows = q.reshape(b, tokens, hkv, g, d).transpose(0, 1, 3, 2, 4).reshape(b, tokens * g, hkv, d) if g > 1 else q
    span = min(s_cache, left + tokens + align - 1)
    for n, chunk, range_keys in ((3, 128 * math.ceil(span / 384), left + tokens), (8, 128, None)):
        out, lse = merge(*simulate(rows, k, v, lens, n, chunk, True, g, range_keys=range_keys,
                                   window=Window(left, None), range_align=align), n)
        for i, n_keys in enumerate(lens):
            got, got_lse = out[i], lse[i]
            if g > 1:
                got = got.reshape(tokens, g, hkv, -1).transpose(0, 2, 1, 3).reshape(tokens, hq, -1)
                got_lse = got_lse.reshape(hkv, tokens, g).transpose(0, 2, 1).reshape(hq, tokens)
            want, want_lse = attention_forward(q[i:i + 1], k[i:i + 1, :n_keys], v[i:i + 1, :n_keys], causal=True,
                                               window_size=(left, 0))
            fin = np.isfinite(want_lse[0])
            np.testing.assert_array_equal(np.isfinite(got_lse), fin, err_msg=f"rows that see keys, sequence {i}")
            np.testing.assert_allclose(got[fin.T], want[0][fin.T], rtol=1e-10, atol=1e-12,
                                       err_msg=f"out, sequence {i}, range {range_keys}")
            np.testing.assert_allclose(got_lse[fin], want_lse[0][fin], rtol=1e-10, err_msg=f"lse, sequence {i}")


@pytest.mark.cpu
@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("tokens, causal, left, range_keys", [(1, False, None, None), (3, True, None, None),
                                                             (2, True, 150, 152), (1, False, 300, 301)])
def test_split_walk_with_key_starts_matches_attention_from_them(g, tokens, causal, left, range_keys):
    """key_starts (cache_leftpad): sequence b reads keys [p_b, L_b) only -- a left-padded batch -- while a
    causal diagonal and a window stay counted from the sequence's end; with a key range, from
    max(L_b - W, p_b). Starts off the key tile, past a chunk edge, at 0, equal to the length (no keys)."""
    rng = np.random.default_rng(17 + g + tokens + (left or 0))
    b, hkv, d, s_cache = 5, 2, 16, 768
    lens, starts = [768, 600, 333, 40, 90], [5, 300, 0, 40, 89]
    hq = hkv * g if g > 1 else 4
    q = rng.standard_normal((b, tokens, hq, d))
    k = rng.standard_normal((b, s_cache, hkv, d))
    v = rng.standard_normal((b, s_cache, hkv, d))
    rows = q.reshape(b, tokens, hkv, g, d).transpose(0, 1, 3, 2, 4).reshape(b, tokens * g, hkv, d) if g > 1 else q
    n, chunk = (3, 256) if range_keys is None else (2, 256)
    window = None if left is None else Window(left, None if causal else 0)
    out, lse = merge(*simulate(rows, k, v, lens, n, chunk, causal, g, range_keys=range_keys, window=window,
                               key_starts=starts), n)
    for i, (n_keys, first) in enumerate(zip(lens, starts)):
        got, got_lse = out[i], lse[i]
        if g > 1:
            got = got.reshape(tokens, g, hkv, -1).transpose(0, 2, 1, 3).reshape(tokens, hq, -1)
            got_lse = got_lse.reshape(hkv, tokens, g).transpose(0, 2, 1).reshape(hq, tokens)
        want, want_lse = attention_forward(q[i:i + 1], k[i:i + 1, first:n_keys], v[i:i + 1, first:n_keys],
                                           causal=causal, window_size=(left, 0 if left is not None else None))
        fin = np.isfinite(want_lse[0])
        np.testing.assert_array_equal(np.isfinite(got_lse), fin, err_msg=f"rows that see keys, sequence {i}")
        np.testing.assert_allclose(got[fin.T], want[0][fin.T], rtol=1e-10, atol=1e-12, err_msg=f"out, sequence {i}")
        np.testing.assert_allclose(got_lse[fin], want_lse[0][fin], rtol=1e-10, err_msg=f"lse, sequence {i}")
        assert np.all(got[~fin.T] == 0), f"rows without keys, sequence {i}"


@pytest.mark.cpu
def test_chunk_of_counts_keys_to_the_end():
    split = KeySplit(4, 256, False)
    got = [chunk_of(split, v, 2000, [1000, 300]) for v in range(8)]
    assert [(c.sequence, c.first_key, int(c.keys_to_end), c.batch_kv) for c in got] == [
        (0, 0, 1000, 0), (0, 256, 744, 0), (0, 512, 488, 0), (0, 768, 232, 0),
        (1, 0, 300, 1), (1, 256, 44, 1), (1, 512, 0, 1), (1, 768, 0, 1)]
    assert [int(c.keys_to_end) for c in (chunk_of(split, v, 700, None) for v in range(4))] == [700, 444, 188, 0]
    paged = chunk_of(KeySplit(2, 128, True), 3, 0, [10, 200])
    assert (paged.sequence, paged.first_key, int(paged.keys_to_end), paged.batch_kv) == (1, 128, 72, 0)
    assert chunk_blocks(split, 128) == 2 and chunk_blocks(KeySplit(1, 700, False), 128) == 6
    # a key range of the last 300 keys: chunks from key 700 of sequence 0, from 0 of the shorter one
    ranged = [chunk_of(KeySplit(2, 256, False, 300), v, 2000, [1000, 200]) for v in range(4)]
    assert [(int(c.first_key), int(c.keys_to_end)) for c in ranged] == [(700, 300), (956, 44), (0, 200), (256, 0)]
    assert int(chunk_of(KeySplit(1, 256, False, RANGE_ALL), 0, 2000, [1000]).first_key) == 0
    # cache_rows (cache_batch_idx): only the K / V row moves; q, seqused_k and the parts stay at b
    rows = [chunk_of(KeySplit(2, 256, False, cache_rows=[5, 2]), v, 2000, [1000, 300]) for v in range(4)]
    assert [(c.sequence, int(c.first_key), int(c.keys_to_end), c.batch_kv) for c in rows] == [
        (0, 0, 1000, 5), (0, 256, 744, 5), (1, 0, 300, 2), (1, 256, 44, 2)]
    # key_starts (cache_leftpad): the chunks start at each sequence's first key; a key range never before it
    lp = [chunk_of(KeySplit(2, 256, False, key_starts=[100, 300]), v, 2000, [1000, 300]) for v in range(4)]
    assert [(int(c.first_key), int(c.keys_to_end)) for c in lp] == [(100, 900), (356, 644), (300, 0), (556, 0)]
    lp = [chunk_of(KeySplit(1, 256, False, 200, key_starts=[900, 10]), v, 2000, [1000, 300]) for v in range(2)]
    assert [(int(c.first_key), int(c.keys_to_end)) for c in lp] == [(900, 100), (100, 200)]


@pytest.mark.cpu
def test_kernel_refuses_what_a_key_split_cannot_serve():
    import cutlass

    from stage3_fwd_kernel.hopper import FlashAttentionForwardSm90
    from stage3_fwd_kernel.hopper.host import compile_only

    with pytest.raises(ValueError, match=r"^rows_per_query: "):
        FlashAttentionForwardSm90(cutlass.BFloat16, 128, 128, True, tile_m=64, rows_per_query=4)
    with pytest.raises(ValueError, match=r"^rows_per_query: "):
        FlashAttentionForwardSm90(cutlass.BFloat16, 128, 128, True, tile_m=64, key_split=True, rows_per_query=3)
    with pytest.raises(ValueError, match=r"^split_tail: needs a non-causal dense call on the static persistent"):
        FlashAttentionForwardSm90(cutlass.BFloat16, 128, 128, False, tile_m=64, key_split=True, split_tail=True)
    with pytest.raises(ValueError, match=r"^persistent: a key split runs one CTA per tile"):
        compile_only("bf16", 128, 128, key_split=True, persistent=True)
    with pytest.raises(ValueError, match=r"^key_split: a dense build \(batch_map: each sequence's cache row, not "
                                         r"with page_size\)"):
        compile_only("bf16", 128, 128, key_split=True, seqused_k=True, batch_map=True, page_size=64)


@pytest.mark.compile
@pytest.mark.parametrize("causal, rows_per_query, page_size, left, cache_rows, key_starts",
                         [(False, 1, None, None, False, False), (True, 4, None, None, False, False),
                          (True, 1, 64, None, False, False), (True, 4, 64, 1024, False, False),
                          (False, 1, None, None, True, False), (True, 4, None, 700, True, False),
                          (False, 4, None, None, False, True), (True, 4, None, 700, True, True)])
def test_split_builds_signal_their_dependent_merge(causal, rows_per_query, page_size, left, cache_rows, key_starts):
    """The split launch compiles without spills or serialized wgmmas, signals its dependents
    (griddepcontrol.launch_dependents: PREEXIT) and waits for the kernel before it (griddepcontrol.wait:
    ACQBULK) before any global access; a plain build does neither; both merges (packed rows, rows by
    token) wait before their first access and signal the next step's split launch. cache_rows: the
    build that reads each sequence's cache row (its batch_map slot); key_starts: each sequence's first
    key (cache_leftpad, its cu_seqlens_k slot)."""
    import cutlass

    from stage3_fwd_kernel import split_combine
    from stage3_fwd_kernel.hopper.config import DEFAULT_POLICY
    from stage3_fwd_kernel.hopper.host import _compile, compile_only, varlen_flags
    from stage3_fwd_kernel.tile_scheduler import StaticTileScheduler

    from stage3_fwd_kernel.hopper.host import Variant

    comp = _compile(False, cutlass.BFloat16, 128, 128, causal, DEFAULT_POLICY, StaticTileScheduler,
                    varlen_flags(False, True, cache_rows, key_starts), 64, page_size=page_size, key_split=True,
                    rows_per_query=rows_per_query, variant=Variant(Window(left, None)))
    assert comp.report["spill_stores"] == 0 and comp.report["spill_loads"] == 0
    assert not comp.report["wgmma_serialized"]
    assert "PREEXIT" in comp.sass and _waits_before_global_memory(comp.sass)
    plain = compile_only("bf16", 128, 128, causal, tile_m=64, varlen=True, seqused_k=True)
    assert "PREEXIT" not in plain.sass and "ACQBULK" not in plain.sass
    for token_rows in (False, True):
        merge = split_combine.compile_parts("bf16", 128, token_rows=token_rows).sass
        assert "PREEXIT" in merge and _waits_before_global_memory(merge)


def _waits_before_global_memory(sass: str) -> bool:
    """griddepcontrol.wait (ACQBULK) comes before the first global load, store, atomic or TMA copy: a
    programmatic dependent may run while the kernel before it still writes."""
    import re

    wait = sass.find("ACQBULK")
    access = re.search(r"\b(LDG|STG|RED|ATOMG|UTMALDG|UTMASTG|UTMAPF|UBLKCP|LDGSTS)\b", sass)
    return wait >= 0 and (access is None or wait < access.start())


@pytest.mark.cpu
def test_split_launch_refuses_bad_arguments_before_any_launch(monkeypatch):
    """attention_split_forward's checks, each naming its argument (CPU tensors, seen as CUDA ones past
    the first check: nothing is launched)."""
    import torch

    from stage3_fwd_kernel.hopper import attention_split_forward

    q = torch.zeros(2, 4, 8, 64, dtype=torch.bfloat16)
    k = torch.zeros(2, 256, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^q, k, v: expected CUDA tensors"):
        attention_split_forward(q, k, k, 2, 128)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    cases = [
        (dict(num_splits=0, chunk_keys=128), r"^num_splits: expected an int >= 1"),
        (dict(num_splits=2, chunk_keys=100), r"^chunk_keys: must be a multiple of the key tile \(128\)"),
        (dict(num_splits=1, chunk_keys=128), r"^num_splits \* chunk_keys \(1 x 128\) does not cover"),
        (dict(num_splits=40000, chunk_keys=128), r"^num_splits: batch x num_splits \(2 x 40000\)"),
        (dict(num_splits=2, chunk_keys=128, seqused_k=torch.ones(2, dtype=torch.int64)),
         r"^seqused_k: expected dtype int32"),
        (dict(num_splits=2, chunk_keys=128, rows_per_query=3), r"^rows_per_query: expected an int >= 1 dividing"),
        (dict(num_splits=2, chunk_keys=128, causal=1), r"^causal: expected a bool"),
        (dict(num_splits=1, chunk_keys=128, range_keys=0), r"^range_keys: expected an int >= 1"),
        (dict(num_splits=1, chunk_keys=128, range_keys=2.0), r"^range_keys: expected an int >= 1"),
        (dict(num_splits=1, chunk_keys=128, range_keys=129), r"^num_splits \* chunk_keys \(1 x 128\) does not cover "
                                                              r"the 129 keys"),
        (dict(num_splits=2, chunk_keys=128, cache_rows=torch.zeros(2, dtype=torch.int64)),
         r"^cache_rows: expected dtype int32"),
        (dict(num_splits=2, chunk_keys=128, cache_rows=torch.zeros(3, dtype=torch.int32)),
         r"^cache_rows: expected shape \(2,\)"),
    ]
    for kw, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            attention_split_forward(q, k, k, **kw)
    with pytest.raises(ValueError, match=r"^k: head dim 64 and 0 heads"):
        attention_split_forward(q, k[:, :, :0], k[:, :, :0], 2, 128)
    with pytest.raises(ValueError, match=r"^page_table: expected int32 \(batch=2"):
        pages = k.view(4, 128, 2, 64)
        attention_split_forward(q, pages, pages, 2, 128, page_table=torch.zeros(3, 2, dtype=torch.int32),
                                seqused_k=torch.ones(2, dtype=torch.int32))
    for window in ((None, None), (97, 0)):   # 4 query tokens: a left edge of at most 96 fits 100 keys
        with pytest.raises(ValueError, match=r"^range_keys: a paged range starts on a key block, so it needs a left "
                                             r"window .* got 100 with window_size \(.*\) and 4 tokens"):
            attention_split_forward(q, pages, pages, 2, 128, page_table=torch.zeros(2, 2, dtype=torch.int32),
                                    seqused_k=torch.ones(2, dtype=torch.int32), range_keys=100, causal=True,
                                    window_size=window)


def _launch_record(value):
    """A launch argument as comparable data: a tensor by (address, shape, strides, dtype), else itself."""
    import torch

    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
    return value


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("case", ["dense", "one-split", "rows-and-starts", "paged-window-range", "tokens-by-group",
                                  "softcap-pages"])
def test_unchecked_split_launch_equals_the_checked_one(case, monkeypatch):
    """fa4 launches the split kernel through `split_launch` and merges through `merge_launch`, which check
    nothing (flash_attn_with_kvcache's own checks imply theirs). Its step (fa4_split) must hand the kernels
    the compile keys and the arguments that the checked entry points (attention_split_forward,
    combine_parts) hand them for the same call (CPU tensors seen as CUDA ones; a store answers every
    kernel lookup with a recorder)."""
    import torch

    from fa4 import _kvcache
    from stage3_fwd_kernel import compile_cache, split_combine
    from stage3_fwd_kernel.compile_cache import Compiled
    from stage3_fwd_kernel.hopper import attention_split_forward, split_launch
    from stage3_fwd_kernel.components.window import beyond_causal

    launches = []

    class Store:
        def memory_hit(self, key):
            pass

        def load(self, key, rebuild):
            return Compiled(lambda *a: launches.append((key, tuple(_launch_record(x) for x in a))), {}, "", "")

        def offer(self, key, compiled):
            pass

    monkeypatch.setattr(compile_cache, "_CACHE", {})
    monkeypatch.setattr(compile_cache, "_STORE", Store())
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True), raising=False)
    b, d, hkv = 2, 128, 2
    kw = dict(causal=False, window_size=(None, None), softcap=0.0, rows_per_query=1, range_keys=None,
              cache_rows=None, key_starts=None, page_table=None)
    rows = torch.randn(b, 4, hkv, d, dtype=torch.bfloat16)                     # a packed group of 4 heads
    k = torch.randn(b + 1, 512, hkv, d, dtype=torch.bfloat16)
    n, chunk = 2, 256
    lens = torch.tensor([512, 37], dtype=torch.int32)
    if case == "rows-and-starts":
        kw.update(cache_rows=torch.tensor([2, 0], dtype=torch.int32),
                  key_starts=torch.tensor([5, 0], dtype=torch.int32))
    elif case in ("paged-window-range", "softcap-pages"):
        k = k.reshape(-1, 64, hkv, d)                                              # pages of 64 keys
        kw["page_table"] = torch.tensor([[3, 0, 7, 1, 2, 4, 5, 6], [8, 9, 10, 11, 12, 13, 14, 15]], dtype=torch.int32)
        if case == "softcap-pages":
            kw["softcap"] = 30.0
        else:
            rows = torch.randn(b, 3, 8, d, dtype=torch.bfloat16)                   # 3 causal tokens, group 4 by token
            kw.update(causal=True, window_size=(100, None), range_keys=103, rows_per_query=4)
            n, chunk = 2, 128
    elif case == "tokens-by-group":
        rows = torch.randn(b, 4, 8, d, dtype=torch.bfloat16)
        kw.update(causal=True, rows_per_query=4)
    elif case == "one-split":
        n, chunk = 1, 512
    g = kw["rows_per_query"]
    r, h = rows.shape[1] * g, rows.shape[2] // g
    scale = d ** -0.5
    out = torch.empty(b * n, r, h, d, dtype=torch.bfloat16)
    lse_buf = torch.empty(h, b * n, r, dtype=torch.float32)
    attention_split_forward(rows, k, k, n, chunk, seqused_k=lens, softmax_scale=scale, tile_m=64, out=out,
                            lse=lse_buf.permute(1, 0, 2), **kw)
    window = beyond_causal(kw["causal"], kw.pop("window_size"))
    split_launch(rows, k, k, out, lse_buf.permute(1, 0, 2), n, chunk, seqused_k=lens, softmax_scale=scale, tile_m=64,
                 window=window, **kw)
    assert len(launches) == 2 and launches[0] == launches[1]
    split_key, split_args = launches[0]
    # the merge: combine_parts and merge_launch into the same outputs
    merged = torch.empty(b, r // g, h * g, d, dtype=torch.bfloat16)
    merged_lse = torch.empty(b, h * g, r // g, dtype=torch.float32)
    launches.clear()
    split_combine.combine_parts(out, lse_buf, n, out=merged, rows_per_query=g)
    split_combine.merge_launch(out, lse_buf, n, merged, merged_lse, g)
    (merge_key, args_a), (key_b, args_b) = launches
    assert merge_key == key_b and args_a[:3] == args_b[:3] and args_a[4:] == args_b[4:]   # its own lse aside
    # fa4's step: the same kernels, the split one with the checked launch's arguments but its own outputs,
    # and (n > 1) the merge's outputs shaped and strided as combine_parts makes them
    be = _dispatch_sm90()
    monkeypatch.setattr(sys.modules["fa4._dispatch"], "backend_for", lambda device: be)
    launches.clear()
    result = _kvcache.fa4_split(rows, k, k, lens, n, chunk, scale, kw["softcap"], page_table=kw["page_table"],
                                causal=kw["causal"], rows_per_query=g, unpack=g if n > 1 else 1,
                                range_keys=kw["range_keys"],
                                window=(100, None) if case == "paged-window-range" else (None, None),
                                cache_rows=kw["cache_rows"], key_starts=kw["key_starts"])
    assert len(launches) == (2 if n > 1 else 1)
    key_c, args_c = launches[0]
    assert key_c == split_key

    def without_outputs(args):
        return args[:3] + args[5:]
    assert without_outputs(args_c) == without_outputs(split_args)

    def layouts(args):  # the merge's tensors without their addresses (fa4's parts are its own)
        return tuple(a[2:] if isinstance(a, tuple) and a[:1] == ("tensor",) else a for a in args)
    if n > 1:
        assert launches[1][0] == merge_key and layouts(launches[1][1]) == layouts(args_a)
    else:  # the kernel writes the result itself: out (B, R, H', Dv), lse (B, H', R)
        assert [tuple(t.shape) for t in result] == [(b, r, h, d), (b, h, r)]
        assert args_c[3][1] == result[0].data_ptr() and args_c[4][1] == result[1].data_ptr()


@pytest.mark.cpu
@pytest.mark.fa4
def test_packed_rows_is_the_view_chain_it_replaces():
    """fa4._kvcache.packed_rows reads q (B, Sq, Hq, D) as (B, Sq g, Hkv, D) rows, row t g + j of KV head kv
    being token t of query head kv g + j: one as_strided view for one token (the step's host time), the
    same elements as view / transpose / reshape, also on strided and offset q."""
    import torch

    from fa4._kvcache import packed_rows

    base = torch.randn(3, 5, 40, 72)
    cases = [base[:, :1, :32, :64],                                  # a slice: offset, padded strides
             base[1:2, 2:3, 8:32, 8:40],                             # batch 1, an offset start
             base[:, :1, :8, :64].transpose(0, 0),                   # hkv == hq below (g = 1)
             torch.randn(2, 32, 1, 64).transpose(1, 2),              # heads strided past the tokens (an HF view)
             base[:, :3, :32, :64]]                                  # three tokens: the copy
    for x, hkv in zip(cases, (8, 6, 8, 4, 8)):
        b, sq, hq, d = x.shape
        g = hq // hkv
        want = x.reshape(b, sq, hkv, g, d).transpose(2, 3).reshape(b, sq * g, hkv, d)
        got = packed_rows(x, hkv)
        assert tuple(got.shape) == (b, sq * g, hkv, d) and torch.equal(got, want)
        if sq == 1:
            assert got.data_ptr() == x.data_ptr()                    # a view, no copy


def _dispatch_sm90():
    from fa4 import _dispatch

    return _dispatch.make_backend(_dispatch.ARCHS["sm_90"])
