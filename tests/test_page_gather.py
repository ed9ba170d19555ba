"""The page gather (stage3_fwd_kernel.page_gather): a paged KV cache copied into dense form.

CPU: the kernel's index arithmetic replayed on integers (each destination word's page row and word
within it), the host's refusals, and fa4's routing (torch indexing wherever the kernel is not
taken). Compile: the build's loads and stores. GPU: the copies bitwise equal to torch indexing, and
fa4's paged calls through them.
"""
from __future__ import annotations

import random

import pytest
import torch

from stage3_fwd_kernel.intdiv import fast_div_formula

pytestmark = pytest.mark.stage3


def _copy_share_indices(start, words, rows, num_threads, words_per_thread):
    """copy_share's arithmetic on integers: for each destination word of the share starting at
    `start`, (row, word in the row), with fast_div's float32 formula for the in-share divisions."""
    import numpy as np

    def fdiv(a, b):
        return int(fast_div_formula(np.int32(a), np.int32(b), np.float32, lambda x: np.float32(1) / x, np.int32))

    first_row = start // words
    last_row = min(first_row + fdiv(start + num_threads * words_per_thread - 1 - first_row * words, words), rows - 1)
    out = {}
    for t in range(num_threads):
        for i in range(words_per_thread):
            w = start + t + i * num_threads
            if w < rows * words:
                row = fdiv(w - first_row * words, words)
                assert first_row + row <= last_row  # its page was staged in shared memory
                out[w] = (first_row + row, w - (first_row + row) * words)
    return out


@pytest.mark.cpu
@pytest.mark.fa4
def test_share_indices_match_divmod():
    """Every destination word maps to (w // words, w % words): pages from one 16-byte word to the
    largest the host allows, shares at the start, the middle and the end of the copy."""
    from stage3_fwd_kernel import page_gather as pg

    rng = random.Random(0)
    for words in (1, 3, 8, 127, 128, 1024, 2048, 2049, 32768, pg.MAX_PAGE_WORDS):
        rows = max(2, 3 * pg.WORDS_PER_CTA // words + 2)
        total = rows * words
        shares = sorted({0, (total - 1) // pg.WORDS_PER_CTA, *(rng.randrange(0, total) // pg.WORDS_PER_CTA
                                                                for _ in range(3))})
        for share in shares:
            got = _copy_share_indices(share * pg.WORDS_PER_CTA, words, rows, pg.NUM_THREADS, pg.WORDS_PER_THREAD)
            want = {w: divmod(w, words) for w in range(share * pg.WORDS_PER_CTA,
                                                      min(total, (share + 1) * pg.WORDS_PER_CTA))}
            assert got == want, (words, share)


@pytest.mark.cpu
@pytest.mark.fa4
def test_host_refuses_what_the_kernel_cannot_copy():
    """words_view: None for a cache that is not contiguous, not whole 16-byte words a page, or misaligned;
    gather_pages: None for an int64 table or a copy of 2**31 - 1024 words or more. fa4's gather_kv_pages
    then takes torch indexing, as it does on the CPU and for caches that need a gradient."""
    from fa4._layouts import gather_kv_pages, gather_pages
    from stage3_fwd_kernel import page_gather as pg

    cache = torch.randn(6, 16, 2, 64, dtype=torch.bfloat16)
    assert pg.words_view(cache, 6).shape == (6, 16 * 2 * 64 * 2 // 16, 4)
    assert pg.words_view(cache[:, :, :, :32], 6) is None             # not contiguous
    assert pg.words_view(torch.zeros(6, 1, 1, 4, dtype=torch.bfloat16), 6) is None  # 8 bytes a page
    shifted = torch.zeros(cache.numel() + 4, dtype=torch.bfloat16)[4:].view(cache.shape)
    assert pg.words_view(shifted, 6) is None                           # starts 8 bytes off
    assert pg.gather_pages(cache, cache, torch.zeros(2, 3, dtype=torch.int64)) is None
    # a copy whose last CTA's word indices would pass 2**31: pages of 16 KiB, 2**21 - 1 of them (meta: no memory)
    huge = torch.empty(4, 8, 8, 128, dtype=torch.bfloat16, device="meta")
    assert pg.gather_pages(huge, huge, torch.empty(1, (1 << 21) - 1, dtype=torch.int32, device="meta")) is None
    table = torch.tensor([[5, 0, -1], [2, 9, 3]], dtype=torch.int32)
    k, v = gather_kv_pages(cache, cache.flip(0), table)
    assert torch.equal(k, gather_pages(cache, table)) and torch.equal(v, gather_pages(cache.flip(0), table))


@pytest.mark.compile
@pytest.mark.fa4
def test_gather_build_loads_before_it_stores():
    """No spills; one barrier a branch (the share's pages staged); every thread's 8 16-byte loads come before
    its first 16-byte store, so each SM keeps its loads in flight."""
    from stage3_fwd_kernel import page_gather as pg

    comp = pg.compile_gather()
    assert comp.report["spill_stores"] == 0 and comp.report["spill_loads"] == 0
    sass = [line for line in comp.sass.splitlines() if "LDG.E.128" in line or "STG.E.128" in line]
    first_store = next(i for i, line in enumerate(sass) if "STG" in line)
    assert first_store == pg.WORDS_PER_THREAD and all("LDG" in line for line in sass[:first_store])
    assert comp.sass.count("BAR.SYNC") == 2  # one in the K branch, one in the V branch


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device on this machine (the gpu tier needs an H100/H200)")


@pytest.mark.gpu
@pytest.mark.fa4
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("page, hkv, d, dv", [(1, 8, 128, 128), (16, 8, 128, 128), (3, 2, 64, 64),
                                              (64, 1, 192, 128), (256, 4, 256, 256), (7, 6, 8, 16)])
def test_gather_equals_torch_indexing(dtype, page, hkv, d, dv):
    """The kernel's K and V bitwise equal to torch indexing: shuffled tables with entries out of range
    (clamped), pages of one row to 256, d != dv, over outputs poisoned beforehand."""
    _cuda()
    from fa4._layouts import gather_pages
    from stage3_fwd_kernel import page_gather as pg

    g = torch.Generator(device="cuda").manual_seed(page * 31 + d)
    n = 41
    kc = torch.randn(n, page, hkv, d, device="cuda", generator=g).to(dtype)
    vc = torch.randn(n, page, hkv, dv, device="cuda", generator=g).to(dtype)
    table = torch.randint(-4, n + 6, (3, 13), device="cuda", generator=g, dtype=torch.int32)
    poison = torch.full((3 * 13 * page * hkv * (d + dv) * 2,), 0xFF, device="cuda", dtype=torch.uint8)
    del poison  # the outputs are likely to land on these bytes
    k, v = pg.gather_pages(kc, vc, table)
    assert torch.equal(k.view(torch.uint8), gather_pages(kc, table).view(torch.uint8))
    assert torch.equal(v.view(torch.uint8), gather_pages(vc, table).view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.fa4
def test_fa4_paged_prefill_takes_the_kernel(monkeypatch):
    """A long causal prefill over pages of 16 (GQA 4: about 8400 query-head rows a key, so fa4 copies
    those pages) and flash_attn_with_kvcache's copy both run the gather kernel, and give what the dense
    call gives; an empty table copies nothing."""
    _cuda()
    import fa4
    from stage3_fwd_kernel import page_gather as pg

    calls = []
    real = pg.gather_pages
    monkeypatch.setattr(pg, "gather_pages", lambda *a: calls.append(a[2].shape) or real(*a))
    g = torch.Generator(device="cuda").manual_seed(5)
    s, page, hkv = 4224, 16, 2
    q = torch.randn(1, s, 4 * hkv, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(s, hkv, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(s, hkv, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(s // page + 3, device="cuda", generator=g)[:s // page]
    kp = torch.zeros(s // page + 3, page, hkv, 64, device="cuda", dtype=torch.bfloat16)
    vp = torch.zeros_like(kp)
    kp[perm], vp[perm] = k.view(-1, page, hkv, 64), v.view(-1, page, hkv, 64)
    table = perm.to(torch.int32).view(1, -1)
    cu = torch.tensor([0, s], dtype=torch.int32, device="cuda")
    lengths = dict(cu_seqlens_q=cu, max_seqlen_q=s, max_seqlen_k=s, causal=True)
    with torch.no_grad():
        dense = fa4.flash_attn_varlen_func(q[0], k, v, cu_seqlens_k=cu, **lengths)
        paged = fa4.flash_attn_varlen_func(q[0], kp, vp, page_table=table, seqused_k=cu[1:], **lengths)
        assert len(calls) == 1
        cached = fa4.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=cu[1:], block_table=table, causal=True)
    assert len(calls) == 2
    assert (paged.float() - dense.float()).abs().max().item() < 1e-2
    assert (cached[0].float() - dense.float()).abs().max().item() < 1e-2
    k0, v0 = real(kp, vp, table[:, :0])
    assert k0.shape == (1, 0, hkv, 64) and v0.shape == (1, 0, hkv, 64)


@pytest.mark.gpu
@pytest.mark.fa4
def test_gathered_call_replays_in_a_cuda_graph():
    """flash_attn_with_kvcache over pages of 16 with 4224 query tokens (fa4 copies the pages) captured
    in a CUDA graph: replays after new page contents and a new page order give the eager result."""
    _cuda()
    import fa4

    g = torch.Generator(device="cuda").manual_seed(9)
    s, page, hkv, n = 4224, 16, 2, 4224 // 16 + 5
    q = torch.randn(1, s, 4 * hkv, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    kp, vp = (torch.randn(n, page, hkv, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    table = torch.randperm(n, device="cuda", generator=g)[:s // page].to(torch.int32).view(1, -1)
    lens = torch.tensor([s], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        eager = fa4.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, causal=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fa4.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, causal=True)
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        kp.copy_(torch.randn_like(kp))
        table.copy_(torch.randperm(n, device="cuda", generator=g)[:s // page].to(torch.int32).view(1, -1))
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, fa4.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table,
                                                                 causal=True))
