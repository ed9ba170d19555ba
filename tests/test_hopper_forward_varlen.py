"""The production Hopper forward's varlen kernel (`stage3_fwd_kernel.hopper.attention_varlen_forward`),
split from test_hopper_forward.py, whose helpers it uses.

gpu tier (H100/H200): out and lse follow FA4's rule over varlen batches with q-empty and k-empty
sequences and NaN-filled unused KV-cache slots past seqused_k, GQA ratios 1 / 2 / 4, every head-dim
pair, at d = 64 both CTA heights; rows outside every sequence are never written; fully masked rows
are exactly 0 / -inf; batch_map and an oversized grid; random and edge batches; bad arguments on the
GPU path raise naming the argument. test_hopper_persistent.py reuses the batches and helpers here.
"""
from __future__ import annotations

import pytest
from test_hopper_forward import _check, _mod, _tdt  # the forward tests' helpers (tests/ is on the path)

# ---- varlen -------------------------------------------------------------------------------------
def _varlen_batch(lens_q, lens_k, used, hq, hkv, d, dv, dtype="bf16", seed=0, pad_q=0):
    """Packed q/k/v for the given lengths; KV rows past seqused_k (unused cache slots) are NaN."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    t = _tdt(dtype)
    cu_q = torch.tensor([0] + list(_cumsum(lens_q)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(_cumsum(lens_k)), dtype=torch.int32, device="cuda")
    tq, tk = int(cu_q[-1]) + pad_q, int(cu_k[-1])
    q = torch.randn(tq, hq, d, device="cuda", dtype=t, generator=g)
    k = torch.randn(tk, hkv, d, device="cuda", dtype=t, generator=g)
    v = torch.randn(tk, hkv, dv, device="cuda", dtype=t, generator=g)
    seqused = None
    if used is not None:
        seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
        for b, u in enumerate(used):
            k0, k1 = int(cu_k[b]), int(cu_k[b + 1])
            k[k0 + u:k1] = float("nan")
            v[k0 + u:k1] = float("nan")
    return q, k, v, cu_q, cu_k, seqused


def _cumsum(xs):
    s = 0
    for x in xs:
        s += x
        yield s


def _varlen_ref(q, k, v, cu_q, cu_k, seqused, *, causal, upcast):
    """attention_varlen_ref, with each sequence's keys cut to its seqused_k."""
    import torch
    from stage0_reference.torch_reference import attention_ref

    out = torch.zeros(q.shape[:2] + (v.shape[-1],), dtype=q.dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    used = None if seqused is None else seqused.tolist()
    for b in range(len(cq) - 1):
        q0, q1, k0 = cq[b], cq[b + 1], ck[b]
        k1 = ck[b + 1] if used is None else k0 + used[b]
        if q1 == q0:
            continue
        o, l = attention_ref(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=causal, upcast=upcast)
        out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return out, lse


def _varlen(q, k, v, cu_q, cu_k, seqused, *, causal, max_seqlen_q=None, batch_map=None, check=True, **policy):
    import torch

    lens_q = (cu_q[1:] - cu_q[:-1]).tolist()
    lens_k = (cu_k[1:] - cu_k[:-1]).tolist()
    max_q = max(lens_q + [0]) if max_seqlen_q is None else max_seqlen_q
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), float("nan"), device="cuda", dtype=torch.float32)
    _mod().attention_varlen_forward(q, k, v, cu_q, cu_k, max_q, max(lens_k + [0]), seqused_k=seqused,
                                    causal=causal, out=out, lse=lse, batch_map=batch_map, check_values=True,
                                    **policy)
    torch.cuda.synchronize()
    if check:
        ref = _varlen_ref(q, k, v, cu_q, cu_k, seqused, causal=causal, upcast=True)
        base = _varlen_ref(q, k, v, cu_q, cu_k, seqused, causal=causal, upcast=False)
        _check(f"varlen causal={causal} {policy}", out, lse, ref, base)
    return out, lse


def _check_k_empty_and_finite(d, dv, ratio, seqused, causal, seed, **policy):
    """The LENS_Q / LENS_K batch (8 query heads, GQA ratio, USED_K keys if seqused) against the reference
    (`_varlen` checks it); its k-empty sequence (b = 1) gets exactly 0 / -inf, and everything else is finite
    despite the NaN cache slots."""
    import torch

    used = USED_K if seqused else None
    q, k, v, cu_q, cu_k, su = _varlen_batch(LENS_Q, LENS_K, used, 8, 8 // ratio, d, dv, seed=seed)
    out, lse = _varlen(q, k, v, cu_q, cu_k, su, causal=causal, **policy)
    q0, q1 = int(cu_q[1]), int(cu_q[2])
    assert torch.all(out[q0:q1] == 0) and torch.all(torch.isneginf(lse[:, q0:q1]))
    assert torch.all(torch.isfinite(out))


# lengths: a q-empty sequence (0 queries), a k-empty one (queries, no keys), tiles that straddle
# 128-row and 64-row boundaries, one longer than several key tiles, len_q > len_k (masked rows)
LENS_Q = [0, 37, 1, 300, 128, 65, 513, 200]
LENS_K = [50, 0, 7, 300, 129, 1000, 517, 64]
USED_K = [50, 0, 3, 211, 129, 1, 400, 64]  # <= LENS_K; the rest of each sequence's keys are NaN


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,dv,ratio,seqused", [(128, 128, 2, True), (64, 64, 1, False), (64, 64, 8, False)],
                         ids=["d128-gqa2-seqused", "d64-mha", "d64-gqa8"])
def test_varlen_matches_reference(causal, d, dv, ratio, seqused):
    _check_k_empty_and_finite(d, dv, ratio, seqused, causal, seed=d + ratio)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("tile_m", [128, 192])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("ratio,seqused", [(1, False), (8, True)], ids=["mha", "gqa8-seqused"])
def test_varlen_d64_tile_m(tile_m, causal, ratio, seqused):
    """d = 64 varlen with both CTA heights: q-empty and k-empty sequences, sequences that end inside
    the second or third consumer's rows (37, 65, 200, 300, 513), NaN cache slots past seqused_k (the
    V tail every consumer zeroes)."""
    _check_k_empty_and_finite(64, 64, ratio, seqused, causal, seed=tile_m + ratio, tile_m=tile_m)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("d,dv,ratio,seqused", [(128, 128, 2, True), (64, 64, 1, False), (192, 128, 8, True)],
                         ids=["d128-gqa2-seqused", "d64-mha", "d192x128-gqa8-seqused"])
def test_two_consumers_varlen(causal, d, dv, ratio, seqused):
    """tile_m = 128 on a packed batch: q-empty and k-empty sequences, NaN cache slots past seqused_k
    (masked to -inf before the max), sequences ending inside either consumer's rows."""
    import torch

    used = USED_K if seqused else None
    q, k, v, cu_q, cu_k, su = _varlen_batch(LENS_Q, LENS_K, used, 8, 8 // ratio, d, dv, seed=d + ratio + 1)
    out, lse = _varlen(q, k, v, cu_q, cu_k, su, causal=causal, tile_m=128)
    q0, q1 = int(cu_q[1]), int(cu_q[2])  # the k-empty sequence: exactly 0 / -inf
    assert torch.all(out[q0:q1] == 0) and torch.all(torch.isneginf(lse[:, q0:q1]))
    assert torch.all(torch.isfinite(out))


@pytest.mark.gpu
@pytest.mark.stage3
def test_varlen_fully_masked_rows_and_nan_cache():
    """causal, len_q > used_k: the first len_q - used rows of each sequence see nothing."""
    import torch

    lens_q, lens_k, used = [300, 90, 5], [400, 70, 64], [70, 70, 1]
    q, k, v, cu_q, cu_k, su = _varlen_batch(lens_q, lens_k, used, 4, 4, 128, 128, seed=7)
    out, lse = _varlen(q, k, v, cu_q, cu_k, su, causal=True)
    for b in range(3):
        q0, n_empty = int(cu_q[b]), lens_q[b] - used[b]
        assert torch.all(out[q0:q0 + n_empty] == 0)
        assert torch.all(torch.isneginf(lse[:, q0:q0 + n_empty]))
        assert torch.all(torch.isfinite(lse[:, q0 + n_empty:q0 + lens_q[b]]))


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("d,tile_m", [(128, None), (64, 128), (64, 192)], ids=["d128", "d64-m128", "d64-m192"])
def test_varlen_never_writes_outside_its_sequences(d, tile_m):
    """One sequence in the middle of larger buffers (cu_seqlens_q = [37, 137]): rows 0..36 and
    137.. of out / lse must keep their NaN poison (the tail predicate at an arbitrary offset; with
    tile_m = 192 the third consumer's rows all lie past the sequence)."""
    import torch

    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.randn(400, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(300, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(300, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    cu_q = torch.tensor([37, 137], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([10, 260], dtype=torch.int32, device="cuda")
    for causal in (False, True):
        out = torch.full((400, 4, d), float("nan"), device="cuda", dtype=torch.bfloat16)
        lse = torch.full((4, 400), float("nan"), device="cuda")
        _mod().attention_varlen_forward(q, k, v, cu_q, cu_k, 100, 250, causal=causal, out=out, lse=lse,
                                        tile_m=tile_m)
        torch.cuda.synchronize()
        assert torch.isnan(out[:37]).all() and torch.isnan(out[137:]).all()
        assert torch.isnan(lse[:, :37]).all() and torch.isnan(lse[:, 137:]).all()
        from stage0_reference.torch_reference import assert_fa4_close, attention_ref

        ref = attention_ref(q[None, 37:137], k[None, 10:260], v[None, 10:260], causal=causal)
        base = attention_ref(q[None, 37:137], k[None, 10:260], v[None, 10:260], causal=causal, upcast=False)
        assert_fa4_close("out", out[None, 37:137], ref[0], base[0])
        assert_fa4_close("lse", lse[None, :, 37:137], ref[1], base[1])


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("d,tile_m", [(128, None), (64, 192)], ids=["d128", "d64-m192"])
def test_varlen_batch_map_and_oversized_grid(d, tile_m):
    """A permuted batch_map computes the same tiles in another CTA order: bitwise the same result.
    A max_seqlen_q larger than any sequence only adds CTAs that exit at once."""
    import torch

    q, k, v, cu_q, cu_k, su = _varlen_batch(LENS_Q, LENS_K, USED_K, 8, 4, d, d, seed=3)
    o1, l1 = _varlen(q, k, v, cu_q, cu_k, su, causal=True, tile_m=tile_m)
    perm = torch.arange(len(LENS_Q) - 1, -1, -1, dtype=torch.int32, device="cuda")
    o2, l2 = _varlen(q, k, v, cu_q, cu_k, su, causal=True, batch_map=perm, check=False, tile_m=tile_m)
    o3, l3 = _varlen(q, k, v, cu_q, cu_k, su, causal=True, max_seqlen_q=2000, check=False, tile_m=tile_m)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert torch.equal(o1, o3) and torch.equal(l1, l3)


@pytest.mark.gpu
@pytest.mark.stage3
def test_varlen_random_batches():
    """Random lengths (empty ones included) with tau = 0 and the default policy; deterministic."""
    import torch

    gen = torch.Generator().manual_seed(2024)
    lens_q = torch.randint(0, 700, (12,), generator=gen).tolist()
    lens_k = torch.randint(0, 900, (12,), generator=gen).tolist()
    lens_q[3], lens_k[5] = 0, 0
    used = [int(torch.randint(0, n + 1, (1,), generator=gen)) for n in lens_k]
    q, k, v, cu_q, cu_k, su = _varlen_batch(lens_q, lens_k, used, 8, 2, 128, 128, seed=9)
    o1, l1 = _varlen(q, k, v, cu_q, cu_k, su, causal=True)
    o2, l2 = _varlen(q, k, v, cu_q, cu_k, su, causal=True)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    _varlen(q, k, v, cu_q, cu_k, su, causal=False)


@pytest.mark.gpu
@pytest.mark.stage3
def test_varlen_edge_batches():
    """No keys anywhere (host path), no queries anywhere, and check_values catching a bad index."""
    import torch

    q, k, v, cu_q, cu_k, _ = _varlen_batch([5, 0, 9], [0, 0, 0], None, 4, 4, 64, 64)
    out, lse = _varlen(q, k, v, cu_q, cu_k, None, causal=False)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    q, k, v, cu_q, cu_k, _ = _varlen_batch([0, 0], [10, 3], None, 4, 4, 64, 64)
    _mod().attention_varlen_forward(q, k, v, cu_q, cu_k, 0, 10)  # nothing to do, nothing launched
    q, k, v, cu_q, cu_k, _ = _varlen_batch([5, 9], [10, 3], None, 4, 4, 64, 64)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        _mod().attention_varlen_forward(q, k, v, cu_q, cu_k, 5, 10, check_values=True)
    with pytest.raises(ValueError, match="seqused_k"):
        _mod().attention_varlen_forward(q, k, v, cu_q, cu_k, 9, 10, check_values=True,
                                        seqused_k=torch.tensor([11, 0], dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match="out"):
        _mod().attention_varlen_forward(q, k, v, cu_q, cu_k, 9, 10,
                                        out=torch.empty(3, 4, 64, device="cuda", dtype=torch.bfloat16))
