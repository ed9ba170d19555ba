"""fa4.flash_attn_with_kvcache on the GPU: FA4's rule against fp32 attention over each sequence's
cache (the baseline: PyTorch in bf16 on the same keys; both from stage 0's torch reference), for
split-KV decode, paged caches (shuffled pages of 1 to 512 keys read in place by the kernel: TMA boxes
or its cp.async gather), flash_attn_varlen_func(page_table), a causal prefill
that appends rotated keys in place, a window, softcap + sink, CUDA-graph replays and torch.compile
(fullgraph) steps equal to the eager calls."""
from __future__ import annotations

import pytest
import torch

import fa4
from fa4 import _kvcache as kv
from stage0_reference.torch_reference import attention_ref

pytestmark = [pytest.mark.gpu, pytest.mark.fa4]

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine")


def _truth_and_baseline(q, keys, values, lens, causal=False, window=(None, None), softcap=0.0, sink=None):
    """Per sequence, on its first lens[b] keys (stage 0's torch reference): the fp32 truth (out,
    lse) and the bf16 PyTorch baseline's out."""
    outs, lses, base = [], [], []
    kw = dict(softmax_scale=q.shape[-1] ** -0.5, causal=causal, window_size=window, softcap=softcap,
              learnable_sink=sink)
    for b in range(q.shape[0]):
        n = int(lens[b])
        args = (q[b:b + 1], keys[b:b + 1, :n], values[b:b + 1, :n])
        out, lse = attention_ref(*(t.float() for t in args), **kw)
        outs.append(out[0])
        lses.append(lse[0])
        base.append(attention_ref(*args, upcast=False, **kw)[0][0].float())
    return outs, lses, base


def _check(out, lse, truth, tlse, base, what):
    for b, (t, tl, bl) in enumerate(zip(truth, tlse, base)):
        err, ref = (out[b].float() - t).abs().max().item(), (bl - t).abs().max().item()
        assert err <= 2 * ref + 1e-5, f"{what} b={b}: out error {err:.3e} > 2 x {ref:.3e} + 1e-5"
        fin = torch.isfinite(tl)
        assert torch.equal(torch.isfinite(lse[b]), fin), f"{what} b={b}: lse -inf rows differ"
        if fin.any():  # (a sequence with no keys has only -inf rows)
            assert (lse[b][fin] - tl[fin]).abs().max().item() <= 1e-3, f"{what} b={b}: lse"


def _cache(b, s, hkv, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, s, hkv, d, device="cuda", generator=g).to(BF16) for _ in range(2)]


@pytest.mark.parametrize("splits", [0, 1, 5])
def test_decode_split_kv(splits):
    k, v = _cache(3, 8192, 8, 128, 1)
    q = torch.randn(3, 1, 32, 128, device="cuda").to(BF16)
    lens = torch.tensor([8192, 1, 3001], dtype=torch.int32, device="cuda")
    out, lse = fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=splits, return_softmax_lse=True)
    _check(out, lse, *_truth_and_baseline(q, k, v, lens), f"split {splits}")


@pytest.mark.parametrize("heads, splits, softcap", [((32, 8), 0, 0.0), ((32, 8), 7, 0.0), ((8, 8), 3, 30.0),
                                                    ((64, 8), 1, 0.0)])
def test_split_launch_equals_the_varlen_segments(monkeypatch, heads, splits, softcap):
    """The split-KV launch (stage3 hopper.attention_split_forward) finds each chunk itself; the varlen
    kernel reads the same chunks as segments. Same keys, same body: the same bits. Unused cache
    slots hold NaN (the chunks' partial last blocks must not read them into O)."""
    hq, hkv = heads
    k, v = _cache(3, 5000, hkv, 128, 11)
    lens = torch.tensor([5000, 1, 2049], dtype=torch.int32, device="cuda")
    for b, n in enumerate(lens.tolist()):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    q = torch.randn(3, 1, hq, 128, device="cuda").to(BF16)
    calls = []
    real = kv.fa4_split

    def counted(*args, **kw):
        calls.append(args[4])
        return real(*args, **kw)
    monkeypatch.setattr(kv, "fa4_split", counted)
    out, lse = fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=splits, softcap=softcap,
                                           return_softmax_lse=True)
    assert len(calls) == 1, "the split launch served the call"
    monkeypatch.setattr(kv, "fa4_split", None)
    out_seg, lse_seg = fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=splits, softcap=softcap,
                                                   return_softmax_lse=True)
    assert torch.isfinite(out).all()
    assert torch.equal(out, out_seg) and torch.equal(lse, lse_seg)
    _check(out, lse, *_truth_and_baseline(q, k, v, lens, softcap=softcap), f"split launch {heads} {splits}")


@pytest.mark.parametrize("sq, splits", [(4, 0), (4, 5), (2, 16), (7, 1)])
def test_split_launch_causal_query_tokens(monkeypatch, sq, splits):
    """Speculative decoding: a few causal query tokens at the cache's end split like one token (each
    chunk sees its keys' distance to the sequence's end). With 5 splits (and the default at batch 3
    on 132 SMs) a chunk is 1280 keys, so the 1282-key sequence's diagonal (keys 1278 .. 1281 for 4
    tokens) crosses a chunk edge; a sequence shorter than the query has rows with no key. Unsplit,
    the same bits as the varlen kernel's one segment."""
    k, v = _cache(3, 6000, 8, 128, 13)
    lens = torch.tensor([6000, 1282, 3], dtype=torch.int32, device="cuda")
    q = torch.randn(3, sq, 32, 128, device="cuda").to(BF16)
    out, lse = fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=splits, causal=True,
                                           return_softmax_lse=True)
    _check(out, lse, *_truth_and_baseline(q, k, v, lens, causal=True), f"causal sq={sq} splits={splits}")
    if splits == 1:
        monkeypatch.setattr(kv, "fa4_split", None)
        seg, seg_lse = fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, num_splits=1, causal=True,
                                                   return_softmax_lse=True)
        assert torch.equal(out, seg) and torch.equal(lse, seg_lse)


@pytest.mark.parametrize("sq, causal, window, splits", [(1, False, (None, None), 0), (1, False, (None, None), 6),
                                                     (4, True, (None, 0), 3), (3, True, (500, 0), 1),
                                                     (4, True, (700, 0), 4)])
def test_split_launch_cache_rows_equal_the_gathered_cache(sq, causal, window, splits):
    """cache_rows (cache_batch_idx): the split launch reads sequence b's keys from row cache_rows[b] of
    the cache. Against the same launch on the rows gathered into a cache of their own: the same keys
    and the same body, so the same bits; the rows nobody names hold NaN. Then through fa4 (GQA 32 / 8
    packed by token where causal) under the FA4 rule."""
    from stage3_fwd_kernel.hopper import attention_split_forward

    k, v = _cache(5, 3000, 8, 128, 19)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")
    for row in (1, 3):
        k[row], v[row] = float("nan"), float("nan")
    lens = torch.tensor([3000, 1, 1290], dtype=torch.int32, device="cuda")
    q = torch.randn(3, sq, 8, 128, device="cuda").to(BF16)
    n = max(splits, 1)
    chunk = -(-(-(-3000 // n)) // 128) * 128 if n > 1 else 3000     # ceil(3000 / n), up to the key tile
    kw = dict(seqused_k=lens, causal=causal, window_size=window)
    got = attention_split_forward(q, k, v, n, chunk, cache_rows=idx, **kw)
    want = attention_split_forward(q, k[idx.long()].contiguous(), v[idx.long()].contiguous(), n, chunk, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    q = torch.randn(3, sq, 32, 128, device="cuda").to(BF16)
    out, lse = fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, cache_batch_idx=idx, num_splits=splits,
                                           causal=causal, window_size=window, return_softmax_lse=True)
    assert torch.isfinite(out).all()
    rows = idx.long()
    _check(out, lse, *_truth_and_baseline(q, k[rows], v[rows], lens, causal=causal, window=window),
           f"cache rows sq={sq} splits={splits}")


def _shifted(cache, lens, pad):
    """Each sequence's keys [pad[b], lens[b]) moved to rows [0, lens[b] - pad[b]) of a NaN cache."""
    out = torch.full_like(cache, float("nan"))
    for b, (n, p) in enumerate(zip(lens.tolist(), pad.tolist())):
        out[b, :n - p] = cache[b, p:n]
    return out


@pytest.mark.parametrize("sq, causal, window, splits, dtype", [
    (1, False, (None, None), 0, BF16), (1, False, (None, None), 5, torch.float16), (4, True, (None, 0), 3, BF16),
    (3, True, (500, 0), 1, BF16), (1, True, (300, 0), 4, torch.float16)], ids=str)
def test_cache_leftpad_split_launch_equals_the_shifted_cache(sq, causal, window, splits, dtype):
    """key_starts (cache_leftpad): the split launch reads sequence b's keys from row pad[b] on. Against the
    same launch on those keys moved to row 0 (the same chunks of the same keys, the masks counted from the
    end): the same bits; the padding rows hold NaN, which a read would carry into O. Then through fa4
    (GQA 32 / 8) under the FA4 rule; a sequence padded over all its keys gets 0 and -inf."""
    from stage3_fwd_kernel.hopper import attention_split_forward

    k, v = (t.to(dtype) for t in _cache(3, 3000, 8, 128, 23))
    lens = torch.tensor([3000, 1290, 40], dtype=torch.int32, device="cuda")
    pad = torch.tensor([1, 700, 40], dtype=torch.int32, device="cuda")
    for b, p in enumerate(pad.tolist()):
        k[b, :p], v[b, :p] = float("nan"), float("nan")
    q = torch.randn(3, sq, 8, 128, device="cuda").to(dtype)
    n = max(splits, 1)
    chunk = -(-(-(-3000 // n)) // 128) * 128 if n > 1 else 3000     # ceil(3000 / n), up to the key tile
    kw = dict(causal=causal, window_size=window)
    got = attention_split_forward(q, k, v, n, chunk, seqused_k=lens, key_starts=pad, **kw)
    ks, vs, used = _shifted(k, lens, pad), _shifted(v, lens, pad), lens - pad
    want = attention_split_forward(q, ks, vs, n, chunk, seqused_k=used, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    q = torch.randn(3, sq, 32, 128, device="cuda").to(dtype)
    out, lse = fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, cache_leftpad=pad, num_splits=splits,
                                           causal=causal, window_size=window, return_softmax_lse=True)
    assert torch.isfinite(out).all() and torch.all(out[2] == 0) and torch.all(lse[2] == float("-inf"))
    _check(out, lse, *_truth_and_baseline(q, ks.nan_to_num(), vs.nan_to_num(), used, causal=causal, window=window),
           f"leftpad sq={sq} splits={splits}")


def test_cache_leftpad_prefill_appends_after_the_cache():
    """A left-padded causal prefill (the varlen segments: too many rows for the split launch) with rotated
    new keys: they go to rows cache_seqlens[b] .. (rotated at those positions), and the queries attend to
    rows [pad[b], cache_seqlens[b] + 300)."""
    k, v = _cache(2, 2048, 4, 128, 29)
    q = torch.randn(2, 300, 16, 128, device="cuda").to(BF16)
    k_new, v_new = (torch.randn(2, 300, 4, 128, device="cuda").to(BF16) for _ in range(2))
    angles = torch.rand(4096, 32, device="cuda") * 6
    lens = torch.tensor([37, 1500], dtype=torch.int32, device="cuda")
    pad = torch.tensor([37, 333], dtype=torch.int32, device="cuda")
    for b, p in enumerate(pad.tolist()):
        k[b, :p], v[b, :p] = float("nan"), float("nan")
    out, lse = fa4.flash_attn_with_kvcache(q, k, v, k_new, v_new, rotary_cos=angles.cos(), rotary_sin=angles.sin(),
                                           cache_seqlens=lens, cache_leftpad=pad, causal=True, return_softmax_lse=True)
    pos = lens.long().view(-1, 1) + torch.arange(300, device="cuda")
    q_rot = kv.apply_rotary(q, angles.cos(), angles.sin(), pos, True)
    k_rot = kv.apply_rotary(k_new, angles.cos(), angles.sin(), pos, True)
    for b in range(2):
        assert torch.equal(k[b, lens[b]:lens[b] + 300], k_rot[b]) and torch.equal(v[b, lens[b]:lens[b] + 300], v_new[b])
    assert torch.isfinite(out).all()
    ks, vs = _shifted(k, lens + 300, pad).nan_to_num(), _shifted(v, lens + 300, pad).nan_to_num()
    _check(out, lse, *_truth_and_baseline(q_rot, ks, vs, lens + 300 - pad, causal=True), "leftpad prefill")


def test_split_launch_errors_name_the_argument():
    from stage3_fwd_kernel.hopper import attention_split_forward

    k, v = _cache(2, 256, 2, 64, 12)
    q = torch.randn(2, 4, 2, 64, device="cuda").to(BF16)
    with pytest.raises(ValueError, match=r"^chunk_keys: must be a multiple"):
        attention_split_forward(q, k, v, 2, 100)
    with pytest.raises(ValueError, match=r"^num_splits \* chunk_keys"):
        attention_split_forward(q, k, v, 1, 128)
    with pytest.raises(TypeError, match=r"^seqused_k: expected dtype int32"):
        attention_split_forward(q, k, v, 2, 128, seqused_k=torch.ones(2, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match=r"^num_splits: expected an int >= 1"):
        attention_split_forward(q, k, v, 0, 128)
    with pytest.raises(TypeError, match=r"^cache_rows: expected dtype int32"):
        attention_split_forward(q, k, v, 2, 128, cache_rows=torch.zeros(2, dtype=torch.int64, device="cuda"))
    with pytest.raises(TypeError, match=r"^key_starts: expected dtype int32"):
        attention_split_forward(q, k, v, 2, 128, key_starts=torch.zeros(2, dtype=torch.int64, device="cuda"))
    with pytest.raises(ValueError, match=r"^key_starts: a dense cache's first keys"):
        attention_split_forward(q, k, v, 2, 128, key_starts=torch.zeros(2, dtype=torch.int32, device="cuda"),
                                page_table=torch.zeros(2, 1, dtype=torch.int32, device="cuda"),
                                seqused_k=torch.ones(2, dtype=torch.int32, device="cuda"))
    with pytest.raises(ValueError, match=r"^cache_rows: a paged cache"):
        attention_split_forward(q, k, v, 2, 128, cache_rows=torch.zeros(2, dtype=torch.int32, device="cuda"),
                                page_table=torch.zeros(2, 1, dtype=torch.int32, device="cuda"),
                                seqused_k=torch.ones(2, dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("page", [24, 8, 160, 1])
def test_paged_decode(page, no_gather):
    """Page sizes TMA boxes cannot read: the kernel's cp.async gather reads them in place."""
    b, pages = 2, -(-4096 // page)
    kp, vp = _cache(b * pages + 3, page, 8, 128, 2)
    kp, vp = kp.view(-1, page, 8, 128), vp.view(-1, page, 8, 128)
    table = torch.randperm(kp.shape[0], device="cuda")[:b * pages].view(b, pages).to(torch.int32)
    lens = torch.tensor([4096, 777], dtype=torch.int32, device="cuda")
    q = torch.randn(b, 1, 32, 128, device="cuda").to(BF16)
    out, lse = fa4.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, return_softmax_lse=True)
    _check(out, lse, *_truth_and_baseline(q, _unpage(kp, table), _unpage(vp, table), lens), f"paged {page}")


def test_prefill_appends_rotated_keys():
    k, v = _cache(2, 2048, 4, 128, 3)
    q = torch.randn(2, 300, 16, 128, device="cuda").to(BF16)
    k_new, v_new = (torch.randn(2, 300, 4, 128, device="cuda").to(BF16) for _ in range(2))
    angles = torch.rand(4096, 32, device="cuda") * 6
    lens = torch.tensor([0, 1500], dtype=torch.int32, device="cuda")
    out, lse = fa4.flash_attn_with_kvcache(q, k, v, k_new, v_new, rotary_cos=angles.cos(), rotary_sin=angles.sin(),
                                           cache_seqlens=lens, causal=True, return_softmax_lse=True)
    pos = lens.long().view(-1, 1) + torch.arange(300, device="cuda")
    q_rot = kv.apply_rotary(q, angles.cos(), angles.sin(), pos, True)
    k_rot = kv.apply_rotary(k_new, angles.cos(), angles.sin(), pos, True)
    for b in range(2):
        assert torch.equal(k[b, lens[b]:lens[b] + 300], k_rot[b]) and torch.equal(v[b, lens[b]:lens[b] + 300], v_new[b])
    _check(out, lse, *_truth_and_baseline(q_rot, k, v, lens + 300, causal=True), "prefill")


def test_decode_window_softcap_sink():
    k, v = _cache(2, 4096, 8, 64, 4)
    q = torch.randn(2, 1, 16, 64, device="cuda").to(BF16)
    lens = torch.tensor([4096, 1000], dtype=torch.int32, device="cuda")
    out, lse = fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, window_size=(511, 0), causal=True,
                                           return_softmax_lse=True)
    _check(out, lse, *_truth_and_baseline(q, k, v, lens, causal=True, window=(511, None)), "window")
    sink = torch.linspace(-2, 2, 16, device="cuda")
    out, lse = fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, softcap=15.0, learnable_sink=sink,
                                           return_softmax_lse=True)
    _check(out, lse, *_truth_and_baseline(q, k, v, lens, softcap=15.0, sink=sink), "softcap+sink")



@pytest.mark.parametrize("splits", [0, 1, 3])
@pytest.mark.parametrize("batch_idx", [False, True], ids=["cache_row_b", "cache_batch_idx"])
def test_decode_window_splits_as_a_key_range(splits, batch_idx):
    """One token with a window reads only its last left + 1 keys, packed and split: the split launch's
    chunks from each sequence's window (range_keys; the first key off the key tile), in cache row b or
    cache_batch_idx[b]; the cache's other slots hold NaN."""
    k, v = _cache(4, 8192, 8, 128, 12)
    q = torch.randn(3, 1, 32, 128, device="cuda").to(BF16)
    lens = torch.tensor([8192, 700, 5000], dtype=torch.int32, device="cuda")
    idx = torch.tensor([3, 0, 1] if batch_idx else [0, 1, 2], dtype=torch.int32, device="cuda")
    for b, (row, n) in enumerate(zip(idx.tolist(), lens.tolist())):
        k[row, :max(0, n - 1025)] = float("nan")                  # before the window: never read
        k[row, n:], v[row, n:] = float("nan"), float("nan")       # after the sequence
    out, lse = fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, cache_batch_idx=idx if batch_idx else None,
                                           num_splits=splits,
                                           window_size=(1024, 0), causal=True, return_softmax_lse=True)
    assert torch.isfinite(out).all()
    rows = idx.long()
    _check(out, lse, *_truth_and_baseline(q, k[rows].nan_to_num(), v[rows].nan_to_num(), lens, causal=True,
                                          window=(1024, None)), f"window key range, splits {splits}")


def test_decode_replays_in_a_cuda_graph():
    k, v = _cache(4, 16384, 8, 128, 5)
    q = torch.randn(4, 1, 32, 128, device="cuda").to(BF16)
    lens = torch.tensor([16384, 5, 9000, 0], dtype=torch.int32, device="cuda")
    eager = fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens)
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    # fresh values in the captured inputs (nothing read on the host at capture may stand in for them)
    q.copy_(torch.randn_like(q))
    lens.copy_(torch.tensor([77, 16384, 0, 4000], dtype=torch.int32))
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens))


COMPILED_CASES = {  # name -> (batch, cache, query tokens, call kwargs, paged page size or 0)
    "one-token-split": (3, 8192, 1, dict(), 0),
    "append-rotary-causal": (2, 4096, 3, dict(causal=True, rotary=True), 0),
    "paged-window-append": (2, 4096, 2, dict(causal=True, window_size=(300, 0), append=True), 64),
    "leftpad-append-causal": (3, 4096, 2, dict(causal=True, append=True, leftpad=True), 0),
}


@pytest.mark.parametrize("name", list(COMPILED_CASES))
def test_compiled_decode_step_equals_eager(name):
    """torch.compile(fullgraph=True) of a decode step (inductor): no graph break, the attention one
    fa4::kvcache_attention op running the eager path, so out, lse and the appended caches are bitwise
    the eager call's on copies of the same inputs."""
    b, s, sq, kw, page = COMPILED_CASES[name]
    kw = dict(kw)
    rotary, append, leftpad = kw.pop("rotary", False), kw.pop("append", False), kw.pop("leftpad", False)
    g = torch.Generator(device="cuda").manual_seed(31)
    q = torch.randn(b, sq, 32, 128, device="cuda", generator=g).to(BF16)
    lens = torch.randint(0, s - sq, (b,), device="cuda", generator=g, dtype=torch.int32)
    extra = dict(cache_seqlens=lens)
    if leftpad:
        extra["cache_leftpad"] = (torch.rand(b, device="cuda", generator=g) * lens).to(torch.int32)
    if page:
        k_cache, v_cache, extra["block_table"] = _paged(b, s // page, page, 8, 128, 32)
    else:
        k_cache, v_cache = _cache(b, s, 8, 128, 32)
    if rotary or append:
        extra["k"], extra["v"] = (torch.randn(b, sq, 8, 128, device="cuda", generator=g).to(BF16) for _ in range(2))
    if rotary:
        angle = torch.rand(s, 32, device="cuda", generator=g) * 6.28
        extra.update(rotary_cos=angle.cos(), rotary_sin=angle.sin())

    def step(q, k_cache, v_cache, extra):
        return fa4.flash_attn_with_kvcache(q, k_cache, v_cache, return_softmax_lse=True, **kw, **extra)

    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    want = step(q, *caches[0], extra)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(q, k_cache.clone(), v_cache.clone(), extra)
    assert explained.graph_break_count == 0, [str(r.reason)[:200] for r in explained.break_reasons]
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(q, *caches[1], extra)
    torch._dynamo.reset()
    for what, a, c in (("out", got[0], want[0]), ("lse", got[1], want[1]), ("k_cache", caches[1][0], caches[0][0]),
                       ("v_cache", caches[1][1], caches[0][1])):
        assert torch.equal(a, c), f"{name}: {what} differs between the compiled and the eager step"


# ---------------------------------------------------------------------------------------------
# pages read in place by the kernel (fa4._paged): page sizes that are multiples of the key tile
# ---------------------------------------------------------------------------------------------
def _paged(b, pages, page, hkv, d, seed, spare=3):
    """A shuffled pool of pages (unused ones between) and its table: (k pages, v pages, table)."""
    kp, vp = _cache(b * pages + spare, page, hkv, d, seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    table = torch.randperm(kp.shape[0], device="cuda", generator=g)[:b * pages].view(b, pages).to(torch.int32)
    return kp, vp, table


@pytest.fixture
def no_gather(monkeypatch):
    """Fails a test whose paged call copies its pages (the in-place route was not taken)."""
    def refuse(*_):
        raise AssertionError("the pages were gathered into a copy")
    monkeypatch.setattr(kv, "gather_kv_pages", refuse)
    monkeypatch.setattr(fa4._layouts.VarlenLayout, "unpage", staticmethod(refuse))


@pytest.fixture
def gather_any_length(monkeypatch):
    """Pages the kernel gathers are read in place at every query length (fa4 copies them for long
    queries, where that is faster): the kernel's prefill over them is checked too."""
    monkeypatch.setattr(fa4._dispatch, "GATHER_MAX_QUERY_ROWS", 1 << 30)


def _unpage(cache, table):
    """The truth's dense copy of a paged cache: plain indexing, apart from fa4's own page gather
    (which no_gather patches where the call paths reach it)."""
    b, p = table.shape
    return cache[table.clamp(0, cache.shape[0] - 1).long()].reshape(b, p * cache.shape[1], *cache.shape[2:])


@pytest.mark.parametrize("page, splits", [(128, 0), (256, 1), (256, 7), (512, 16), (16, 0), (64, 3), (32, 1),
                                         (1, 0), (8, 3), (24, 1), (160, 0)])
def test_paged_decode_in_place(page, splits, no_gather):
    b, pages = 3, -(-8192 // page)                                       # enough pages for 8192 keys
    kp, vp, table = _paged(b, pages, page, 8, 128, 6)
    lens = torch.tensor([8192, 1, page + 17], dtype=torch.int32, device="cuda")      # full, one key, a partial page
    q = torch.randn(b, 1, 32, 128, device="cuda").to(BF16)
    out, lse = fa4.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=splits,
                                           return_softmax_lse=True)
    _check(out, lse, *_truth_and_baseline(q, _unpage(kp, table), _unpage(vp, table), lens), f"page {page}")
    dense = fa4.flash_attn_with_kvcache(q, _unpage(kp, table), _unpage(vp, table), cache_seqlens=lens,
                                        num_splits=splits)
    assert torch.equal(out, dense), "pages read in place must equal the same call on a dense cache"


def _poison_outside(kp, vp, table, lens, first_keys):
    """NaN in each sequence's pages before key first_keys[b] and from its end on (never read)."""
    page = kp.shape[1]
    flat_k, flat_v = kp.view(-1, *kp.shape[2:]), vp.view(-1, *vp.shape[2:])
    keys = torch.arange(table.shape[1] * page, device=kp.device)
    for b, (n, first) in enumerate(zip(lens, first_keys)):
        outside = keys[(keys < first) | (keys >= n)]
        rows = table[b, outside // page].long() * page + outside % page
        flat_k[rows], flat_v[rows] = float("nan"), float("nan")


@pytest.mark.parametrize("page, splits, sq", [(16, 0, 1), (128, 3, 1), (24, 0, 1), (256, 1, 1), (64, 0, 4),
                                              (128, 5, 3)])
def test_paged_decode_window_in_place(page, splits, sq, no_gather):
    """A window over pages read in place: the split launch reads each sequence's last left + Sq keys
    from the key block below them (the window's mask hides the keys between), the group packed by
    token. Keys before that block and after the sequence hold NaN."""
    b, pages, left = 3, -(-8192 // page), 1000
    kp, vp, table = _paged(b, pages, page, 8, 128, 16)
    lens = [8192, 700, 3000]
    _poison_outside(kp, vp, table, lens, [max(n - left - sq, 0) // 128 * 128 for n in lens])
    q = torch.randn(b, sq, 32, 128, device="cuda").to(BF16)
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = fa4.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=used, block_table=table, num_splits=splits,
                                           causal=True, window_size=(left, 0), return_softmax_lse=True)
    assert torch.isfinite(out).all()
    keys, values = _unpage(kp, table).nan_to_num(), _unpage(vp, table).nan_to_num()
    _check(out, lse, *_truth_and_baseline(q, keys, values, used, causal=True, window=(left, None)),
           f"paged window page {page} sq {sq}")


@pytest.mark.parametrize("sq, splits", [(4, 0), (3, 5), (2, 1)])
def test_windowed_query_tokens_split(sq, splits):
    """Speculative decoding in a sliding layer: a few causal tokens with a window split over the last
    left + Sq keys of each dense sequence (exactly: keys before them hold NaN), packed by token."""
    k, v = _cache(3, 6000, 8, 128, 17)
    lens, left = [6000, 1282, 3], 700
    for b, n in enumerate(lens):
        k[b, :max(n - left - sq, 0)], v[b, :max(n - left - sq, 0)] = float("nan"), float("nan")
        k[b, n:], v[b, n:] = float("nan"), float("nan")
    used = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(3, sq, 32, 128, device="cuda").to(BF16)
    out, lse = fa4.flash_attn_with_kvcache(q, k, v, cache_seqlens=used, num_splits=splits, causal=True,
                                           window_size=(left, 0), return_softmax_lse=True)
    assert torch.isfinite(out).all()
    _check(out, lse, *_truth_and_baseline(q, k.nan_to_num(), v.nan_to_num(), used, causal=True, window=(left, None)),
           f"windowed tokens sq={sq} splits={splits}")


@pytest.mark.parametrize("page", [16, 32, 24, 1])
def test_paged_in_place_tables_exactly_as_wide_as_the_keys(page, no_gather):
    """A table with ceil(keys / page) columns, not a multiple of the pages per key block: the last
    block's boxes past the keys must not read past the row (they read no entry)."""
    lens = torch.tensor([77, 300, 1], dtype=torch.int32, device="cuda")
    pages = -(-300 // page)                                            # not a multiple of 128 / page
    kp, vp, table = _paged(3, pages, page, 8, 128, 14)
    q = torch.randn(3, 1, 32, 128, device="cuda").to(BF16)
    out, lse = fa4.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, num_splits=1,
                                           return_softmax_lse=True)
    _check(out, lse, *_truth_and_baseline(q, _unpage(kp, table), _unpage(vp, table), lens), f"narrow table {page}")


def test_paged_prefill_in_place_appends_across_pages(no_gather):
    """A causal prefill with a window over pages of 128: 300 new keys appended across page borders."""
    b, pages = 2, 16
    kp, vp, table = _paged(b, pages, 128, 4, 128, 7)
    q = torch.randn(b, 300, 16, 128, device="cuda").to(BF16)
    k_new, v_new = (torch.randn(b, 300, 4, 128, device="cuda").to(BF16) for _ in range(2))
    lens = torch.tensor([100, 1500], dtype=torch.int32, device="cuda")
    for window in ((None, None), (200, 0)):
        kc, vc = kp.clone(), vp.clone()
        out, lse = fa4.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=table,
                                               causal=True, window_size=window, return_softmax_lse=True)
        keys, values = _unpage(kc, table), _unpage(vc, table)
        for i in range(b):
            assert torch.equal(keys[i, lens[i]:lens[i] + 300], k_new[i])
        _check(out, lse, *_truth_and_baseline(q, keys, values, lens + 300, causal=True, window=(window[0], None)),
               f"prefill window {window}")


@pytest.mark.parametrize("d, page", [(128, 128), (128, 256), (256, 64), (64, 128), (128, 16), (64, 32), (256, 16),
                                     (128, 8), (64, 24), (256, 8)])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_page_table_in_place(d, page, causal, no_gather, gather_any_length):
    """flash_attn_varlen_func(page_table=...): packed q, GQA 4, seqused_k with a partial last page and
    an empty sequence, against fp32 attention over the gathered keys."""
    b, pages, hkv = 3, -(-2048 // page), 2
    kp, vp, table = _paged(b, pages, page, hkv, d, 8)
    lens_q = [700, 0, 129]
    used = torch.tensor([2048, 5, page + 3], dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, 700, 700, 829], dtype=torch.int32, device="cuda")
    q = torch.randn(829, 8, d, device="cuda").to(BF16)
    out, lse = fa4.flash_attn_varlen_func(q, kp, vp, cu_seqlens_q=cu_q, max_seqlen_q=700, seqused_k=used,
                                          page_table=table, causal=causal, return_lse=True)
    keys, values = _unpage(kp, table), _unpage(vp, table)
    for i, n in enumerate(lens_q):
        if n == 0:
            continue
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        truth, tlse, base = _truth_and_baseline(q[rows][None], keys[i:i + 1], values[i:i + 1], used[i:i + 1],
                                                causal=causal)
        _check(out[rows][None], lse[:, rows][None], truth, tlse, base, f"d {d} page {page} seq {i}")


@pytest.mark.parametrize("d, dv, page", [(192, 128, 8), (128, 64, 24), (96, 96, 1)])
def test_varlen_page_table_gathered_head_dim_pairs(d, dv, page, no_gather, gather_any_length):
    """The gather with K and V of different widths (two copy loops) and at d = 96 (three copies a row):
    packed q, GQA 4, a partial last page and a sequence of one key, causal."""
    b, hkv = 2, 2
    pages = -(-700 // page)
    kp, _, table = _paged(b, pages, page, hkv, d, 16)
    vp = _cache(kp.shape[0], page, hkv, dv, 17)[0]
    used = torch.tensor([700, 1], dtype=torch.int32, device="cuda")
    cu_q = torch.tensor([0, 300, 301], dtype=torch.int32, device="cuda")
    q = torch.randn(301, 8, d, device="cuda").to(BF16)
    out, lse = fa4.flash_attn_varlen_func(q, kp, vp, cu_seqlens_q=cu_q, max_seqlen_q=300, seqused_k=used,
                                          page_table=table, causal=True, return_lse=True)
    keys, values = _unpage(kp, table), _unpage(vp, table)
    for i in range(b):
        rows = slice(int(cu_q[i]), int(cu_q[i + 1]))
        truth, tlse, base = _truth_and_baseline(q[rows][None], keys[i:i + 1], values[i:i + 1], used[i:i + 1],
                                                causal=True)
        _check(out[rows][None], lse[:, rows][None], truth, tlse, base, f"({d}, {dv}) page {page} seq {i}")


def test_varlen_page_table_padded_q_softcap_sink(no_gather):
    b, pages, page = 2, 8, 128
    kp, vp, table = _paged(b, pages, page, 8, 128, 9)
    q = torch.randn(b, 64, 32, 128, device="cuda").to(BF16)
    sink = torch.linspace(-1, 1, 32, device="cuda")
    used = torch.tensor([1024, 300], dtype=torch.int32, device="cuda")
    out, lse = fa4.flash_attn_varlen_func(q, kp, vp, seqused_k=used, page_table=table, softcap=20.0,
                                          learnable_sink=sink, return_lse=True)
    assert out.shape == q.shape and lse.shape == (b, 32, 64)
    _check(out, lse, *_truth_and_baseline(q, _unpage(kp, table), _unpage(vp, table), used, softcap=20.0, sink=sink),
           "padded q, softcap + sink")


def test_varlen_page_table_page_24_causal_in_place(no_gather, gather_any_length):
    b, pages, page = 2, 50, 24
    kp, vp, table = _paged(b, pages, page, 2, 128, 12)
    q = torch.randn(b, 200, 8, 128, device="cuda").to(BF16)
    used = torch.tensor([1200, 333], dtype=torch.int32, device="cuda")
    out, lse = fa4.flash_attn_varlen_func(q, kp, vp, seqused_k=used, page_table=table, causal=True, return_lse=True)
    _check(out, lse, *_truth_and_baseline(q, _unpage(kp, table), _unpage(vp, table), used, causal=True), "page 24")


def test_long_queries_over_gathered_pages_take_the_copy(monkeypatch):
    """A causal prefill of 300 queries over pages of 8: fa4 gathers them into a dense copy (faster
    than the kernel's in-place gather at that length), and the result follows the rule."""
    copies = []
    monkeypatch.setattr(fa4._layouts.VarlenLayout, "unpage",
                        staticmethod(lambda *a, _f=fa4._layouts.VarlenLayout.unpage: copies.append(1) or _f(*a)))
    b, pages, page = 2, 100, 8
    kp, vp, table = _paged(b, pages, page, 2, 128, 15)
    q = torch.randn(b, 300, 8, 128, device="cuda").to(BF16)
    used = torch.tensor([800, 301], dtype=torch.int32, device="cuda")
    out, lse = fa4.flash_attn_varlen_func(q, kp, vp, seqused_k=used, page_table=table, causal=True, return_lse=True)
    assert copies, "a long query over gathered pages should take the dense copy"
    _check(out, lse, *_truth_and_baseline(q, _unpage(kp, table), _unpage(vp, table), used, causal=True), "copy")


@pytest.mark.parametrize("page, n_q, n_k, copied", [(16, 4101, 4101, True), (32, 4101, 4101, False),
                                                   (16, 2053, 2053, False), (16, 1900, 6003, True)])
def test_many_head_rows_over_pages_of_16_take_the_copy(monkeypatch, page, n_q, n_k, copied):
    """A causal prefill or chunk (GQA 4, a partial last page) past SMALL_PAGE_COPY_HEAD_ROWS query-head
    rows a key (4101 queries: about 8200; a chunk of 1900 at the end of 6003 keys: about 6400) over
    pages of 16 (8 TMA boxes a key block): fa4 copies the pages into a dense cache; below it (2053
    queries: about 4100), and over pages of 32, it reads them in place. Every route follows the rule,
    and the copy equals plain indexing of the pages."""
    copies, unpage = [], fa4._layouts.VarlenLayout.unpage
    monkeypatch.setattr(fa4._layouts.VarlenLayout, "unpage",
                        staticmethod(lambda *a: copies.append(unpage(*a)) or copies[-1]))
    assert (fa4._paged.head_rows(n_q, n_k, 4, True) >= fa4._dispatch.SMALL_PAGE_COPY_HEAD_ROWS) == (copied or page == 32)
    b, pages = 1, -(-n_k // page)
    kp, vp, table = _paged(b, pages, page, 2, 128, 23)
    q = torch.randn(b, n_q, 8, 128, device="cuda").to(BF16)
    used = torch.tensor([n_k], dtype=torch.int32, device="cuda")
    out, lse = fa4.flash_attn_varlen_func(q, kp, vp, seqused_k=used, page_table=table, causal=True,
                                          max_seqlen_k=n_k, return_lse=True)
    assert bool(copies) == copied, f"page {page}: copied {bool(copies)}"
    keys, values = _unpage(kp, table), _unpage(vp, table)
    if copied:
        assert torch.equal(copies[0][0], keys) and torch.equal(copies[0][1], values)
    _check(out, lse, *_truth_and_baseline(q, keys, values, used, causal=True), f"page {page}, {n_q} x {n_k}")


def test_varlen_page_table_with_grad_gathers_and_differentiates():
    """Inputs that need a gradient keep the gather (the paged forward has no backward): out, dq and
    the pages' dk / dv under FA4's rule against fp32 attention over the gathered keys (the bf16
    PyTorch baseline beside it), and pages no sequence names get exactly zero gradient."""
    from stage0_reference.torch_reference import assert_fa4_close

    b, pages, page = 2, 4, 128
    kp, vp, table = _paged(b, pages, page, 2, 64, 10)
    q = torch.randn(b, 100, 4, 64, device="cuda").to(BF16)
    dout = torch.randn(b, 100, 4, 64, device="cuda").to(BF16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, kp, vp)]
    out = fa4.flash_attn_varlen_func(leaves[0], leaves[1], leaves[2], page_table=table, causal=True)
    out.backward(dout)
    dq, dkp, dvp = (t.grad for t in leaves)
    used_pages = torch.zeros(kp.shape[0], dtype=torch.bool, device="cuda")
    used_pages[table.long().flatten()] = True
    assert dkp[~used_pages].abs().max() == 0 and dvp[~used_pages].abs().max() == 0
    # the gathered view of the page gradients, (B, pages * page, Hkv, D) like the keys themselves
    dk, dv = _unpage(dkp, table), _unpage(dvp, table)

    def grads(upcast):
        ins = [t.detach().clone().requires_grad_(True) for t in (q, _unpage(kp, table), _unpage(vp, table))]
        ref = attention_ref(*(t.float() if upcast else t for t in ins), causal=True, upcast=upcast)[0]
        ref.backward(dout.float() if upcast else dout)
        return [ref.detach()] + [t.grad for t in ins]

    truth, base = grads(True), grads(False)
    for name, got, t, bl in zip(("out", "dq", "dk", "dv"), (out.detach(), dq, dk, dv), truth, base):
        assert_fa4_close(f"paged varlen {name}", got, t, bl)


@pytest.mark.parametrize("page", [256, 8])
def test_paged_decode_in_place_replays_in_a_cuda_graph(page, no_gather):
    kp, vp, table = _paged(4, 16384 // page, page, 8, 128, 11)
    q = torch.randn(4, 1, 32, 128, device="cuda").to(BF16)
    lens = torch.tensor([16384, 5, 9000, 0], dtype=torch.int32, device="cuda")
    eager = fa4.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fa4.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table)
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    # fresh values in the captured inputs (nothing read on the host at capture may stand in for them)
    q.copy_(torch.randn_like(q))
    lens.copy_(torch.tensor([77, 16384, 0, 4000], dtype=torch.int32))
    captured.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, fa4.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table))
