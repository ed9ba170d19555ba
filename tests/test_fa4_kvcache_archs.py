"""fa4.flash_attn_with_kvcache on an arch without the Hopper split launch (sm_100), on CPU.

Blackwell's forward has no `attention_split_forward` (`Backend.SPLIT_KV_LAUNCH` is False), so a call
there runs the key segments of fa4._kvcache through the arch's varlen forward (pages of a multiple of
128 keys read in place, smaller ones copied) and merges them. These tests drive `with_kvcache` down
its device branch (the one a real GPU call takes: the backend's checks, `_device_route`, the
launch-plan hooks) with a stand-in
backend whose arch is sm_100 and whose varlen forward is float64 torch attention under the kernel's
contract (`test_fa4_kvcache.stand_in`). The Blackwell kernels themselves are compiled in the compile
tier (the varlen forward with seqused_k in test_stage3_blackwell.py, the merge kernel below); none
of this has run on a Blackwell GPU.
"""
from __future__ import annotations

import functools

import pytest
import torch

import test_fa4_kvcache as tk  # the varlen stand-in and the float64 per-sequence reference (tests/ is on the path)
from fa4 import _dispatch, _kvcache, _ops

pytestmark = [pytest.mark.fa4]


class _SegmentsOnlyBackend:
    """What with_kvcache and fa4's varlen op ask of a Backend, for sm_100: the arch's checks, no
    launch plans, and the varlen forward as tk.stand_in (float64; each call recorded)."""

    SPLIT_KV_LAUNCH = False

    def __init__(self):
        self.arch = _dispatch.ARCHS["sm_100"]
        self.real = _dispatch.BlackwellBackend(self.arch)
        self.calls = []

    def check_head_dims(self, d, dv, names=("q", "v")):
        self.real.check_head_dims(d, dv, names)

    def check_variants(self, *args, **kwargs):
        self.real.check_variants(*args, **kwargs)

    def _plan_signature(self, role, tensors, scalars):
        return None  # plans off: the call runs the host logic every time

    def paged_in_place(self, *args, **kwargs):
        return self.real.paged_in_place(*args, **kwargs)

    def varlen_forward(self, q, k, v, cu_q, cu_k, used, max_q, max_k, scale, causal, window=(None, None),
                       softcap=0.0, learnable_sink=None, page_table=None):
        assert used is not None and learnable_sink is None  # segments always name their keys; the sink joins later
        self.calls.append(dict(segments=int(used.shape[0]), rows=max_q, window=tuple(window), causal=causal,
                               paged=page_table is not None))
        out, lse = tk.stand_in(q, k, v, cu_q, cu_k, used, max_q, max_k, scale, causal, window, softcap,
                               page_table=page_table)
        return out.to(q.dtype), lse.float()


@pytest.fixture
def sm100(fa4_ops_on_cpu, monkeypatch):
    """with_kvcache's device branch on CPU tensors over _SegmentsOnlyBackend: eager, 148 SMs (a B200's),
    and the merge in torch (its kernel is the compile tier's)."""
    backend = fa4_ops_on_cpu(_SegmentsOnlyBackend(), ops=())
    monkeypatch.setattr(_ops, "eager_ok", lambda *tensors: True)
    monkeypatch.setattr(_kvcache, "_sm_count", lambda device: 148)
    real_merge = _kvcache.merge_segments
    monkeypatch.setattr(_kvcache, "merge_segments", lambda *a, kernel=False, **kw: real_merge(*a, kernel=False, **kw))
    # fa4._paged asks the backend only for CUDA tensors: the same question for these CPU ones
    monkeypatch.setattr(_kvcache._paged, "in_place", lambda q, k, v, *a, **kw: backend.paged_in_place(
        q.shape[-1], v.shape[-1], int(k.shape[1])))
    return backend


def _bf16_cache(seed, b, sq, hq, hkv, d, s_cache):
    q, kc, vc = (t.to(torch.bfloat16) for t in tk._tokens_and_cache(seed, b, sq, hq, hkv, d, s_cache))
    return q, kc, vc


def _check_bf16(out, lse, q, keys, values, seqlens, **kw):
    """tk._check's reference on the bf16 inputs, with the output's bf16 rounding as the tolerance."""
    scale = q.shape[-1] ** -0.5
    for b in range(q.shape[0]):
        n = int(seqlens[b])
        want, wl = tk.dense(q[b], keys[b][:n], values[b][:n], scale, kw.get("causal", False),
                            kw.get("window", (None, None)), kw.get("softcap", 0.0), kw.get("sink"))
        torch.testing.assert_close(out[b].double(), want, rtol=2 ** -7, atol=2 ** -8, msg=lambda m: f"out b={b}: {m}")
        torch.testing.assert_close(lse[b].double(), wl, rtol=1e-5, atol=1e-5, msg=lambda m: f"lse b={b}: {m}")


def _segments(backend):
    return [c["segments"] for c in backend.calls]


@pytest.mark.cpu
@pytest.mark.parametrize("splits", [1, 3, 0])
def test_sm100_decode_runs_key_segments(sm100, splits):
    """One token, GQA 8 / 2 packed, lengths 0 / 1 / 300 / 517 of 600: n segments a sequence, merged."""
    q, kc, vc = _bf16_cache(1, 4, 1, 8, 2, 128, 600)
    lens = torch.tensor([0, 1, 300, 517], dtype=torch.int32)
    out, lse = _kvcache.with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits, return_softmax_lse=True)
    _check_bf16(out, lse, q, kc, vc, lens)
    n = _kvcache.choose_num_splits(4, 2, 600, 148) if splits == 0 else splits
    n = _kvcache._chunks(600, n)[1]
    assert _segments(sm100) == [4 * n] and sm100.calls[0]["rows"] == 4  # the group packed: 4 rows a KV head


@pytest.mark.cpu
@pytest.mark.parametrize("page_size", [8, 16, 64, 128, 256])
def test_sm100_paged_decode_in_place_or_copied(sm100, page_size):
    """Shuffled pages, unused ones in between: pages of 16, 64, 128 and 256 keys are read in place
    through the table (chunks of the logical keys, the table row repeated a chunk), pages of 8 are
    gathered into a dense copy first; every layout agrees with the dense cache."""
    b, s_cache, hkv = 2, 512, 2
    q, kc, vc = _bf16_cache(2, b, 1, 4, hkv, 64, s_cache)
    lens = torch.tensor([200, 512], dtype=torch.int32)
    pages = s_cache // page_size
    perm = torch.randperm(b * pages + 3, generator=tk._gen(5))[:b * pages]     # unused pages in between
    table = perm.view(b, pages).to(torch.int32)
    kp = torch.zeros(b * pages + 3, page_size, hkv, 64, dtype=torch.bfloat16)
    vp = torch.zeros_like(kp)
    kp[perm.long()] = kc.reshape(b * pages, page_size, hkv, 64)
    vp[perm.long()] = vc.reshape(b * pages, page_size, hkv, 64)
    out, lse = _kvcache.with_kvcache(q, kp, vp, cache_seqlens=lens, block_table=table, return_softmax_lse=True)
    _check_bf16(out, lse, q, kc, vc, lens)
    (call,) = sm100.calls
    assert call["paged"] == (page_size >= 16) and call["segments"] % b == 0
    assert call["segments"] // b <= _kvcache.MAX_SPLITS


@pytest.mark.cpu
def test_sm100_windowed_decode_and_causal_prefill_with_append(sm100):
    """A one-token windowed step reads only the window's keys (segments from its first key); a causal
    prefill of 5 appended tokens runs one segment a sequence, masked bottom-right; softcap and sink on."""
    q, kc, vc = _bf16_cache(3, 2, 1, 4, 4, 64, 700)
    lens = torch.tensor([650, 90], dtype=torch.int32)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse = _kvcache.with_kvcache(q, kc, vc, cache_seqlens=lens, window_size=(200, 0), causal=True, softcap=20.0,
                                     learnable_sink=sink, return_softmax_lse=True)
    for b in range(2):
        first = max(int(lens[b]) - 201, 0)
        want, wl = tk.dense(q[b], kc[b][first:int(lens[b])], vc[b][first:int(lens[b])], 64 ** -0.5, False,
                            softcap=20.0, sink=sink)
        torch.testing.assert_close(out[b].double(), want, rtol=2 ** -7, atol=2 ** -8)
        torch.testing.assert_close(lse[b].double(), wl, rtol=1e-5, atol=1e-5)
    assert all(c["window"] == (None, None) for c in sm100.calls)  # one token: a key range, not a mask

    sm100.calls.clear()
    new_k, new_v, q5 = (torch.randn(2, 5, 4, 64, generator=tk._gen(4)).to(torch.bfloat16) for _ in range(3))
    kc0, vc0 = kc.clone(), vc.clone()
    out = _kvcache.with_kvcache(q5, kc, vc, new_k, new_v, cache_seqlens=lens, causal=True)
    assert torch.equal(kc[0, 650:655], new_k[0]) and torch.equal(vc[1, 90:95], new_v[1])
    assert torch.equal(kc[0, :650], kc0[0, :650]) and torch.equal(kc[0, 655:], kc0[0, 655:])
    for b in range(2):
        n = int(lens[b]) + 5
        want, _ = tk.dense(q5[b], kc[b][:n], vc[b][:n], 64 ** -0.5, True)
        torch.testing.assert_close(out[b].double(), want, rtol=2 ** -7, atol=2 ** -8)
    assert sm100.calls == [dict(segments=2, rows=5, window=(None, None), causal=True, paged=False)]


@pytest.mark.cpu
def test_sm100_refuses_packed_causal_tokens_before_the_append(sm100):
    """pack_gqa=True with several causal tokens needs the split launch's rows by token, which sm_100
    lacks: refused naming pack_gqa, the cache untouched."""
    q, kc, vc = _bf16_cache(6, 1, 3, 8, 2, 64, 256)
    new = torch.randn(1, 3, 2, 64, generator=tk._gen(7)).to(torch.bfloat16)
    lens = torch.tensor([100], dtype=torch.int32)
    before = kc.clone()
    with pytest.raises(ValueError, match=r"^pack_gqa: packing the query heads"):
        _kvcache.with_kvcache(q, kc, vc, new, new, cache_seqlens=lens, causal=True, pack_gqa=True)
    assert torch.equal(kc, before) and not sm100.calls


@pytest.mark.cpu
def test_blackwell_reads_pages_of_whole_key_blocks_or_of_16_32_64_keys_in_place():
    """Whole key blocks and 16 / 32 / 64 keys in place, other sizes copied; pages smaller than a block not
    at (192, 128), and pages of 16 copied from SMALL_PAGE_COPY_HEAD_ROWS head rows a key (Hopper's rule)."""
    backend = _dispatch.BlackwellBackend(_dispatch.ARCHS["sm_100"])
    assert [backend.paged_in_place(128, 128, p) for p in (128, 256, 1024, 16, 32, 64)] == [True] * 6
    assert [backend.paged_in_place(128, 128, p, query_rows=4) for p in (1, 8, 24, 100, 192)] == [False] * 5
    assert [backend.paged_in_place(192, 128, p) for p in (16, 64, 128)] == [False, False, True]
    rows = _dispatch.SMALL_PAGE_COPY_HEAD_ROWS
    assert [backend.paged_in_place(64, 64, 16, head_rows=r) for r in (None, rows - 1, rows)] == [True, True, False]
    assert backend.paged_in_place(64, 64, 32, head_rows=4 * rows)


@pytest.mark.cpu
def test_device_route_by_arch(monkeypatch):
    """_device_route: the split launch where the backend has one (sm_90), segments elsewhere (sm_100);
    pages of 128 read in place on both, but on sm_100 not for a one-token windowed step with
    pack_gqa=True (its window must become a key range, which only a copy of the pages gives)."""
    monkeypatch.setattr(_kvcache, "_sm_count", lambda device: 7)
    q = torch.zeros(1, 1, 4, 64, dtype=torch.bfloat16)
    pages = torch.zeros(3, 128, 1, 64, dtype=torch.bfloat16)
    table = torch.zeros(1, 2, dtype=torch.int32)
    window = (100, 0)
    for key, split in (("sm_90", _kvcache.fa4_split), ("sm_100", None)):
        backend = _dispatch.make_backend(_dispatch.ARCHS[key])
        monkeypatch.setattr(_dispatch, "backend_for", lambda device, b=backend: b)
        monkeypatch.setattr(_kvcache._paged, "in_place", lambda q, k, v, *a, b=backend, **kw: b.paged_in_place(
            q.shape[-1], v.shape[-1], int(k.shape[1]), 4))
        assert backend.SPLIT_KV_LAUNCH == (key == "sm_90")
        route = functools.partial(_kvcache._device_route, q, pages, pages)
        assert route(None, False, (None, None), None) == (7, split, False)
        assert route(table, False, (None, None), None) == (7, split, True)
        assert route(table, True, window, None) == (7, split, True)
        assert route(table, True, window, True) == (7, split, key == "sm_90")


@pytest.mark.cpu
def test_sm100_windowed_packed_decode_over_pages(sm100):
    """One token, a left window, pack_gqa=True, pages of 128 (read in place otherwise): served through a
    copy of the pages with the window as a key range, packed; the dense cache gives the same."""
    b, s_cache, hkv = 2, 512, 2
    q, kc, vc = _bf16_cache(9, b, 1, 8, hkv, 64, s_cache)
    lens = torch.tensor([450, 37], dtype=torch.int32)
    perm = torch.randperm(b * 4, generator=tk._gen(3))
    kp = torch.empty(b * 4, 128, hkv, 64, dtype=torch.bfloat16)
    vp = torch.empty_like(kp)
    kp[perm], vp[perm] = kc.reshape(-1, 128, hkv, 64), vc.reshape(-1, 128, hkv, 64)
    kw = dict(cache_seqlens=lens, window_size=(100, 0), causal=True, pack_gqa=True, return_softmax_lse=True)
    out, lse = _kvcache.with_kvcache(q, kp, vp, block_table=perm.view(b, 4).to(torch.int32), **kw)
    for i in range(b):
        first, n = max(int(lens[i]) - 101, 0), int(lens[i])
        want, wl = tk.dense(q[i], kc[i][first:n], vc[i][first:n], 64 ** -0.5, False)
        torch.testing.assert_close(out[i].double(), want, rtol=2 ** -7, atol=2 ** -8)
        torch.testing.assert_close(lse[i].double(), wl, rtol=1e-5, atol=1e-5)
    assert [c["paged"] for c in sm100.calls] == [False] and sm100.calls[0]["rows"] == 4  # copied, packed


MERGE_FOR_SM100A = """
import json, os
from stage3_fwd_kernel import split_combine
rows = []
for dt, dv, token_rows in (("bf16", 128, False), ("bf16", 128, True), ("fp16", 64, False)):
    comp = split_combine.compile_parts(dt, dv, launchable=True, token_rows=token_rows)
    rows.append(dict(type=type(comp.fn).__name__, spills=comp.report["spill_stores"], lmem=comp.report["LDL/STL"],
                     target=[l for l in comp.ptx.splitlines() if l.startswith(".target")],
                     waits=comp.ptx.count("griddepcontrol.wait")))
print(json.dumps({"arch": os.environ["CUTE_DSL_ARCH"], "rows": rows}))
"""


@pytest.mark.compile
def test_merge_kernel_builds_for_sm100a():
    """The segments' merge (stage 3's PartsCombine) as fa4 on a B200 builds it: a launchable compile in a
    process whose CUTE_DSL_ARCH is sm_100a, for the packed and the by-token rows. It must target
    sm_100a, keep no local memory, and still wait on the forward before it reads the parts (PDL)."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", PYTHONPATH=str(root))
    res = subprocess.run([sys.executable, "-c", MERGE_FOR_SM100A], cwd=root, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert rep["arch"] == "sm_100a" and len(rep["rows"]) == 3
    for row in rep["rows"]:
        assert "TVMFFI" in row["type"] and row["target"] == [".target sm_100a"], row
        assert row["spills"] == 0 and row["lmem"] == 0 and row["waits"] >= 1, row
