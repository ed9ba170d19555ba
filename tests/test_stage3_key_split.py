"""The split-KV launch (stage3_fwd_kernel.components.key_split) on the CPU.

`simulate` walks a key-split launch the way the Hopper kernel does, with the same component functions
it traces: `locate_tile` turns each virtual sequence into (sequence, chunk, keys to the end, batch
indices), the key-block range counts query tokens (`query_tile_m` = tile_m / rows_per_query) and is
capped at the chunk's blocks, and `AttentionMask.key_limit` gives each packed row its token's limit.
The parts it leaves are merged through their lse and compared with dense float64 attention: causal or
not, GQA heads packed as rows or not, chunks that cut the diagonal, empty chunks and sequences shorter
than the query. The compile tier checks what the builds contain (no spills, the PDL signal).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from stage3_fwd_kernel.components.block_range import num_key_blocks
from stage3_fwd_kernel.components.key_split import KeySplit, chunk_blocks, chunk_of
from stage3_fwd_kernel.components.mask import AttentionMask
from stage3_fwd_kernel.components.window import Window
from stage3_fwd_kernel.components.work_tile import SequenceInfo, locate_tile

pytestmark = pytest.mark.stage3


def simulate(q, k, v, lens, n, chunk, causal, g, tile_m=64, tile_n=128):
    """q (B, R, H, D) with R = tokens * g rows (row t g + j: token t of group head j when g > 1, H then
    the KV heads), k / v (B, S, Hkv, *) -> parts out (B n, R, H, Dv), lse (B n, H, R)."""
    b, r, h, _ = q.shape
    window = Window(None, 0 if causal else None)
    mask = AttentionMask(window, tile_n, g)
    split = KeySplit(n, chunk, False)
    seq = SequenceInfo(r, k.shape[1], h // k.shape[2], None, None, list(lens), None, split)
    tokens = r // g
    out = np.zeros((b * n, r, h, v.shape[-1]))
    lse = np.full((b * n, h, r), -np.inf)
    for virtual in range(b * n):
        for head in range(h):
            for m_block in range(math.ceil(r / tile_m)):
                tile = locate_tile(seq, m_block, head, virtual)
                keys_to_end = int(tile.seqlen_k)
                n_max = num_key_blocks(m_block, tokens, keys_to_end, tile_m=tile_m // g, tile_n=tile_n, window=window)
                n_max = min(int(n_max), chunk_blocks(split, tile_n))
                for row in range(m_block * tile_m, min(r, (m_block + 1) * tile_m)):
                    seen = min(n_max * tile_n, int(mask.key_limit(mask.query_of(row), 0, tokens, keys_to_end)))
                    if seen <= 0:
                        continue
                    idx = tile.offset_k + np.arange(seen)
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


def dense(q_tokens, k, v, n_keys, causal):
    """q_tokens (T, H, D) against k / v (n_keys, H, *) (heads already matched), bottom-right causal."""
    t = q_tokens.shape[0]
    s = np.einsum("thd,shd->hts", q_tokens, k[:n_keys]) / math.sqrt(q_tokens.shape[-1])
    if causal:
        allowed = np.arange(n_keys)[None, :] <= np.arange(t)[:, None] + n_keys - t
        s = np.where(allowed[None], s, -np.inf)
    top = s.max(-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    p = np.exp(s - top)
    total = p.sum(-1)
    o = np.einsum("hts,shd->thd", p, v[:n_keys]) / np.where(total > 0, total, 1).T[..., None]
    return o, np.where(total > 0, top[..., 0] + np.log(np.where(total > 0, total, 1)), -np.inf)


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
        kk = np.repeat(k[i], hq // hkv, axis=1)
        vv = np.repeat(v[i], hq // hkv, axis=1)
        want, want_lse = dense(q[i], kk, vv, n_keys, causal)                           # (T, Hq, Dv), (Hq, T)
        got, got_lse = out[i], lse[i]
        if g > 1:  # back from packed rows: row t g + j of KV head kv is query head kv g + j
            got = got.reshape(tokens, g, hkv, -1).transpose(0, 2, 1, 3).reshape(tokens, hq, -1)
            got_lse = got_lse.reshape(hkv, tokens, g).transpose(0, 2, 1).reshape(hq, tokens)
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"out, sequence {i}")
        np.testing.assert_array_equal(np.isfinite(got_lse), np.isfinite(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(got_lse[fin], want_lse[fin], rtol=1e-10, err_msg=f"lse, sequence {i}")


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


@pytest.mark.cpu
def test_kernel_refuses_what_a_key_split_cannot_serve():
    import cutlass

    from stage3_fwd_kernel.hopper import FlashAttentionForwardSm90
    from stage3_fwd_kernel.hopper.host import compile_only

    with pytest.raises(ValueError, match=r"^rows_per_query: "):
        FlashAttentionForwardSm90(cutlass.BFloat16, 128, 128, True, tile_m=64, rows_per_query=4)
    with pytest.raises(ValueError, match=r"^rows_per_query: "):
        FlashAttentionForwardSm90(cutlass.BFloat16, 128, 128, True, tile_m=64, key_split=True, rows_per_query=3)
    with pytest.raises(ValueError, match=r"^key_split: not with a window"):
        FlashAttentionForwardSm90(cutlass.BFloat16, 128, 128, True, tile_m=64, key_split=True,
                                  window=Window(64, None))
    with pytest.raises(ValueError, match=r"^persistent: a key split runs one CTA per tile"):
        compile_only("bf16", 128, 128, key_split=True, persistent=True)


@pytest.mark.compile
@pytest.mark.parametrize("causal, rows_per_query, page_size", [(False, 1, None), (True, 4, None), (True, 1, 64)])
def test_split_builds_signal_their_dependent_merge(causal, rows_per_query, page_size):
    """The split launch compiles without spills or serialized wgmmas and signals its dependents
    (griddepcontrol.launch_dependents: PREEXIT); a plain build does not; the merge waits (ACQBULK)."""
    import cutlass

    from stage3_fwd_kernel import split_combine
    from stage3_fwd_kernel.hopper.config import DEFAULT_POLICY
    from stage3_fwd_kernel.hopper.host import _compile, compile_only
    from stage3_fwd_kernel.tile_scheduler import StaticTileScheduler

    comp = _compile(False, cutlass.BFloat16, 128, 128, causal, DEFAULT_POLICY, StaticTileScheduler,
                    (False, True, False), 64, page_size=page_size, key_split=True, rows_per_query=rows_per_query)
    assert comp.report["spill_stores"] == 0 and comp.report["spill_loads"] == 0
    assert not comp.report["wgmma_serialized"]
    assert "PREEXIT" in comp.sass
    plain = compile_only("bf16", 128, 128, causal, tile_m=64, varlen=True, seqused_k=True)
    assert "PREEXIT" not in plain.sass
    assert "ACQBULK" in split_combine.compile_parts("bf16", 128).sass
