"""benchmarks.bench_paged on CPU: the paged cache it builds (build_paged), its checks, its tables and its CLI."""
import json
import math
import sys
import types

import pytest
import torch

from benchmarks import bench_paged, flashinfer_peer
from stage0_reference.torch_reference import attention_ref
from test_fa4_kvcache import stand_in  # the varlen kernel's contract in float64 (tests/ is on the path)

pytestmark = [pytest.mark.cpu, pytest.mark.fa4]


def _dense(batch, s_cache, heads=2, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, s_cache, heads, dim, generator=g, dtype=torch.bfloat16)
    v = torch.randn(batch, s_cache, heads, dim, generator=g, dtype=torch.bfloat16)
    return k, v


def _gather(pages, table_row, n):
    """A sequence's first n rows read back through its block-table row (independent of build_paged)."""
    page_size = pages.shape[1]
    return torch.stack([pages[int(table_row[r // page_size]), r % page_size] for r in range(n)]) \
        if n else pages[:0, 0]


@pytest.mark.parametrize("page_size", [1, 4, 16, 64])
def test_pages_read_back_through_the_table_give_the_dense_cache(page_size):
    seqlens = [37, 64, 1, 50]        # partial last pages, one full length, a one-token sequence
    k, v = _dense(len(seqlens), 64)
    k_pages, v_pages, table = bench_paged.build_paged(k, v, seqlens, page_size, torch.Generator().manual_seed(1))
    assert table.dtype == torch.int32 and table.shape == (4, math.ceil(64 / page_size))
    assert k_pages.shape[1:] == (page_size, 2, 8) and v_pages.shape == k_pages.shape
    assert k_pages.dtype == k.dtype and k_pages.device == k.device
    for b, n in enumerate(seqlens):
        assert torch.equal(_gather(k_pages, table[b], n), k[b, :n]), f"k of sequence {b}"
        assert torch.equal(_gather(v_pages, table[b], n), v[b, :n]), f"v of sequence {b}"


def test_the_table_holds_distinct_shuffled_pages_with_unused_pages_between():
    k, v = _dense(8, 256)
    k_pages, _, table = bench_paged.build_paged(k, v, [256] * 8, 16, torch.Generator().manual_seed(2))
    needed = table.numel()
    assert needed == 8 * 16
    assert len(set(table.flatten().tolist())) == needed, "a page is shared"
    assert int(table.min()) >= 0 and int(table.max()) < k_pages.shape[0]
    assert k_pages.shape[0] == math.ceil(bench_paged.PAGE_SLACK * needed)
    used = sorted(table.flatten().tolist())
    assert used != list(range(needed)), "the used pages are the first ones: nothing unused between them"
    assert any(b - a > 1 for a, b in zip(used, used[1:])), "no unused page lies between used ones"
    steps = (table[:, 1:] - table[:, :-1]).flatten()
    assert not bool((steps == 1).all()), "every sequence's pages are consecutive"


def test_a_partial_last_page_keeps_filler_past_the_sequence():
    k, v = _dense(1, 40)
    k_pages, _, table = bench_paged.build_paged(k, v, [20], 16, torch.Generator().manual_seed(3))
    assert table.shape == (1, 2)                       # 20 keys: one full page and 4 rows of the next
    last = k_pages[int(table[0, 1])]
    assert torch.equal(last[:4], k[0, 16:20])
    assert torch.isfinite(last[4:].float()).all()      # the official's TMA path reads these rows
    assert not torch.equal(last[4:], k[0, 20:32]), "rows past the sequence were copied from the dense cache"


def test_build_paged_is_reproducible_and_refuses_bad_lengths():
    k, v = _dense(2, 32)
    a = bench_paged.build_paged(k, v, [32, 9], 8, torch.Generator().manual_seed(4))
    b = bench_paged.build_paged(k, v, torch.tensor([32, 9], dtype=torch.int32), 8, torch.Generator().manual_seed(4))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="seqlens"):
        bench_paged.build_paged(k, v, [33, 9], 8, torch.Generator())
    with pytest.raises(ValueError, match="seqlens"):
        bench_paged.build_paged(k, v, [8], 8, torch.Generator())
    with pytest.raises(ValueError, match="page_size"):
        bench_paged.build_paged(k, v, [8, 8], 0, torch.Generator())


def test_check_outputs_names_the_peer_and_the_point():
    ref = torch.zeros(2, 1, 4, 8)
    diffs = bench_paged.check_outputs({"fa4_dense": ref, "fa4_paged": ref + 0.01, "copy_k": ref + 5}, 2e-2, "pt")
    assert diffs == pytest.approx({"fa4_dense": 0.0, "fa4_paged": 0.01})
    with pytest.raises(AssertionError, match=r"decode 1 x 8 page 16: official_paged differs"):
        bench_paged.check_outputs({"fa4_dense": ref, "official_paged": ref + 0.5}, 2e-2, "decode 1 x 8 page 16")
    with pytest.raises(RuntimeError, match="fa4_dense"):
        bench_paged.check_outputs({"fa4_paged": ref}, 2e-2, "pt")
    nan = torch.full_like(ref, float("nan"))
    with pytest.raises(AssertionError, match="fa4_paged"):
        bench_paged.check_outputs({"fa4_dense": ref, "fa4_paged": nan}, 2e-2, "pt")


def test_paged_vs_dense_is_the_median_of_per_round_ratios():
    times = {"fa4_paged": [2.0, 1.0, 4.0], "fa4_dense": [1.0, 1.0, 1.0]}
    assert bench_paged.paged_vs_dense(times, "fa4_paged", "fa4_dense") == 0.5
    assert bench_paged.paged_vs_dense(times, "official_paged", "official_dense") is None


def _result_doc():
    decode = {"section": "decode", "batch": 1, "cache": 131072, "page_size": 16, "paged_vs_dense": 0.8,
              "errors": {"official_paged": "AssertionError: page size"},
              "peers": {"fa4_paged": {"gb_per_s": 2400.4}, "fa4_dense": {"gb_per_s": 3000.0},
                        "copy_k": {"gb_per_s": 4100.0}}}
    prefill = {"section": "prefill", "batch": 8, "seqlen": 4096, "page_size": 128, "fa4_paged_vs_dense": 0.97,
               "official_paged_vs_dense": None, "errors": {},
               "peers": {"fa4_paged": {"tflops": 480.2}, "fa4_dense": {"tflops": 495.0}}}
    return {"results": [decode, prefill]}


def test_tables_show_every_peer_the_run_had_errors_included():
    text = bench_paged.markdown_tables(_result_doc())
    assert "| batch x cache | page | fa4_paged | fa4_dense | official_paged | copy_k | fa4 paged/dense |" in text
    assert "| 1 x 128k | 16 | 2400 | 3000 | err | 4100 | 0.80x |" in text
    assert "| batch x seqlen | page | fa4_paged | fa4_dense | fa4 paged/dense | official paged/dense |" in text
    assert "| 8 x 4k | 128 | 480 | 495 | 0.97x | - |" in text
    for table in text.split("\n\n"):
        lines = [line for line in table.splitlines() if line.startswith("|")]
        assert len({line.count("|") for line in lines}) <= 1, f"ragged table:\n{table}"


def test_table_cli_reads_a_result_file_without_a_gpu(tmp_path, capsys):
    path = tmp_path / "bench_paged.json"
    path.write_text(json.dumps(_result_doc()))
    assert bench_paged.main(["--table", str(path)]) == 0
    assert "| 1 x 128k | 16 |" in capsys.readouterr().out


def test_cli_help_and_argument_checks(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_paged.main(["--help"])
    assert exit_info.value.code == 0 and "--page-sizes" in capsys.readouterr().out
    args = bench_paged.parse_args(["--decode-shapes", "2x64", "--prefill-seqlens", "8192", "--page-sizes", "16,256"])
    assert args.decode_shapes == [(2, 64)] and args.prefill_seqlens == [8192] and args.page_sizes == [16, 256]
    for bad in (["--prefill-seqlens", "5000"], ["--decode-shapes", "2x64x3"], ["--page-sizes", "0"],
                ["--page-sizes", "x"], ["--only", "both"]):
        with pytest.raises(SystemExit) as exc:
            bench_paged.parse_args(bad)
        said = f"{exc.value.code} {capsys.readouterr().err}"  # sys.exit(message) or an argparse error
        assert bad[0] in said or bad[0].lstrip("-") in said, (bad, said)
    args = bench_paged.parse_args(["--decode-heads", "64/8", "--query-len", "4", "--window", "1024"])
    assert args.call == bench_paged.DecodeCall(64, 8, 4, 1024)
    for bad, flag in ((["--decode-heads", "8/3"], "--decode-heads"), (["--query-len", "0"], "--query-len"),
                      (["--window", "-1"], "--window")):
        with pytest.raises(SystemExit, match=f"^{flag}: expected"):
            bench_paged.parse_args(bad)


def test_fa4_reads_the_built_pages_like_the_dense_cache():
    """fa4's block-table plan (kernel replaced by a torch stand-in) over build_paged's pages gives the
    dense cache's answer: the table means to fa4 what build_paged means by it."""
    from fa4 import _kvcache

    g = torch.Generator().manual_seed(5)
    batch, s_cache, hq, hkv, d = 3, 70, 8, 2, 16
    q = torch.randn(batch, 1, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(batch, s_cache, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(batch, s_cache, hkv, d, generator=g, dtype=torch.float64)
    lens = torch.tensor([70, 33, 5], dtype=torch.int32)
    k_pages, v_pages, table = bench_paged.build_paged(k, v, lens, 16, g)

    def run(kc, vc, **kw):
        return _kvcache.with_kvcache(q, kc, vc, cache_seqlens=lens, varlen=stand_in, sm_count=16, **kw)

    paged, dense = run(k_pages, v_pages, block_table=table), run(k, v)
    torch.testing.assert_close(paged, dense, rtol=1e-9, atol=1e-9)


class _Float64Backend:
    """The Backend methods fa4's varlen op calls (conftest.fa4_ops_on_cpu), as float64 torch attention
    with bottom-right aligned causal masks and GQA by repeating KV heads."""

    def __init__(self):
        from fa4 import _dispatch

        self.arch = _dispatch.ARCHS["sm_90"]
        self.calls = 0

    def check_head_dims(self, d, dv):
        pass

    def check_variants(self, *args, **kwargs):
        pass

    def varlen_forward(self, q, k, v, cu_q, cu_k, used_k, max_q, max_k, scale, causal, window=(None, None),
                       softcap=0.0, learnable_sink=None):
        assert tuple(window) == (None, None) and not softcap and learnable_sink is None
        self.calls += 1
        group = q.shape[1] // k.shape[1]
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float64)
        for i in range(cu_q.shape[0] - 1):
            qa, qb, ka = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i])
            kb = ka + int(used_k[i]) if used_k is not None else int(cu_k[i + 1])
            assert qb - qa <= max_q and kb - ka <= max_k, "a sequence exceeds max_seqlen"
            if qb == qa or kb == ka:
                continue
            keys = k[ka:kb].double().repeat_interleave(group, 1)
            scores = torch.einsum("qhd,khd->hqk", q[qa:qb].double(), keys) * scale
            if causal:  # bottom-right: query row i sees keys j <= i + (keys - queries)
                hidden = torch.ones(qb - qa, kb - ka, dtype=torch.bool).triu(kb - ka - (qb - qa) + 1)
                scores = scores.masked_fill(hidden, float("-inf"))
            lse[:, qa:qb] = scores.logsumexp(-1)
            out[qa:qb] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[ka:kb].double().repeat_interleave(group, 1))
        return out.to(q.dtype), lse.float()


@pytest.fixture
def fa4_on_cpu(fa4_ops_on_cpu, monkeypatch):
    """fa4's public functions on CPU tensors over _Float64Backend (the SM count fa4 asks CUDA for: an H200's;
    the split / page merge in torch: _kvcache merges with its CUDA kernel only behind its own fa4_varlen)."""
    from fa4 import _kvcache

    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: type("Props", (), {"multi_processor_count": 132}))
    monkeypatch.setattr(_kvcache, "fa4_varlen", object())
    return fa4_ops_on_cpu(_Float64Backend(), ("varlen_fwd",))


def test_decode_peers_call_fa4_so_paged_and_dense_agree(fa4_on_cpu):
    """The benchmark's own decode calls (fa4_paged, fa4_varlen_paged, fa4_dense, copy_k) on CPU bf16: same
    answer, one check (on the CPU the varlen call gathers its pages: the split launch is the GPU's)."""
    g = torch.Generator().manual_seed(6)
    batch, cache = 2, 40
    k, v = (torch.randn(batch, cache, bench_paged.HKV, bench_paged.D, generator=g, dtype=torch.bfloat16)
            for _ in range(2))
    inputs = bench_paged.decode_inputs(batch, cache, 16, k, v, g)
    outs = {name: fn() for name, fn in bench_paged.decode_peers(inputs, official=None).items()}
    assert set(outs) == {"fa4_paged", "fa4_varlen_paged", "fa4_dense", "copy_k"} and fa4_on_cpu.calls == 3
    assert outs["fa4_paged"].shape == outs["fa4_varlen_paged"].shape == (batch, 1, bench_paged.HQ, bench_paged.D)
    diffs = bench_paged.check_outputs(outs, bench_paged.DECODE_TOLERANCE, "decode cpu")
    assert diffs["fa4_paged"] <= 1e-2 and diffs["fa4_varlen_paged"] <= 1e-2
    assert float(outs["fa4_dense"].float().abs().max()) > 0
    # --decode-heads 16/4 --query-len 3: causal tokens (this CPU stand-in has no window)
    call = bench_paged.DecodeCall(16, 4, 3)
    k, v = (torch.randn(batch, cache, 4, bench_paged.D, generator=g, dtype=torch.bfloat16) for _ in range(2))
    inputs = bench_paged.decode_inputs(batch, cache, 16, k, v, g, call)
    outs = {name: fn() for name, fn in bench_paged.decode_peers(inputs, None, call).items()}
    assert outs["fa4_paged"].shape == (batch, 3, 16, bench_paged.D) and outs["copy_k"].shape == k.shape
    diffs = bench_paged.check_outputs(outs, bench_paged.DECODE_TOLERANCE, "decode cpu tokens")
    assert diffs["fa4_paged"] <= 1e-2 and diffs["fa4_varlen_paged"] <= 1e-2
    window = bench_paged.DecodeCall(16, 4, 3, 10)   # --window 10: 13 keys read
    assert window.variant() == {"causal": True, "window_size": (10, 0)} and window.keys_read(cache) == 13


def test_prefill_peers_call_fa4_so_paged_and_dense_agree(fa4_on_cpu):
    """The benchmark's own prefill calls (varlen, causal, page_table + seqused_k vs cu_seqlens_k) on CPU."""
    inputs = bench_paged.prefill_inputs(2, 48, 16, device="cpu")
    assert inputs["table"].shape == (2, 3) and inputs["k_pages"].shape[1:] == (16, bench_paged.HKV, bench_paged.D)
    fns, outs, errors = bench_paged.run_eagerly(bench_paged.prefill_peers(inputs, official=None), "prefill cpu")
    assert not errors and set(fns) == {"fa4_paged", "fa4_dense"}
    assert outs["fa4_paged"].shape == inputs["q"].shape
    diffs = bench_paged.check_outputs(outs, bench_paged.PREFILL_TOLERANCE, "prefill cpu")
    assert diffs["fa4_paged"] <= 1e-2


def test_csr_pages_hold_the_dense_cache_rows():
    """FlashInfer's (indptr, indices, last page length) taken from build_paged's table address the
    same rows as the dense cache."""
    g = torch.Generator().manual_seed(6)
    batch, cache, heads, dim, page = 3, 37, 2, 8, 16
    k = torch.randn(batch, cache, heads, dim, generator=g)
    k_pages, _, table = bench_paged.build_paged(k, k.clone(), [cache] * batch, page, g)
    indptr, indices, last = flashinfer_peer.csr_pages(table, cache, page)
    assert indptr.tolist() == [0, 3, 6, 9] and last.tolist() == [5, 5, 5]
    for b in range(batch):
        pages = indices[indptr[b]:indptr[b + 1]].long()
        rows = k_pages[pages].reshape(-1, heads, dim)[: (len(pages) - 1) * page + int(last[b])]
        torch.testing.assert_close(rows, k[b])
    _, _, last = flashinfer_peer.csr_pages(table, 32, page)   # a full last page
    assert last.tolist() == [16, 16, 16]
    with pytest.raises(ValueError, match="cache"):
        flashinfer_peer.csr_pages(table, 0, page)
    with pytest.raises(ValueError, match="table"):
        flashinfer_peer.csr_pages(table, 49, page)


class _FakeDecodeWrapper:
    """flashinfer.BatchDecodeWithPagedKVCacheWrapper's contract as the peer uses it (its argument order,
    the CUDA-graph buffers' sizes, the CSR page table), answering with float attention over the pages
    the plan names, so a wrong table, head order or causal flag gives a wrong answer."""

    made = []

    def __init__(self, workspace, layout, use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None):
        buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        assert layout == "NHD" and workspace.dtype == torch.uint8
        assert not use_cuda_graph or all(b is not None for b in buffers), "CUDA-graph mode needs its buffers"
        self.use_cuda_graph, self.use_tensor_cores, self.buffers, self.plans = use_cuda_graph, use_tensor_cores, buffers, []
        _FakeDecodeWrapper.made.append(self)

    def plan(self, indptr, indices, last, num_qo_heads, num_kv_heads, head_dim, page_size, *, window_left=-1,
             q_data_type=None, kv_data_type=None, q_len_per_req=1):
        indptr_buf, indices_buf, last_buf = self.buffers
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32
        assert len(indptr_buf) == len(indptr) == len(last) + 1 == len(last_buf) + 1 and len(indices_buf) >= len(indices)
        assert num_qo_heads % num_kv_heads == 0 and bool((last >= 1).all() and (last <= page_size).all())
        assert q_len_per_req == 1 or self.use_tensor_cores, "several tokens need the tensor-core kernel"
        indptr_buf.copy_(indptr), indices_buf[:len(indices)].copy_(indices), last_buf.copy_(last)
        self.plans.append(dict(heads=(num_qo_heads, num_kv_heads), dim=head_dim, page_size=page_size,
                               window_left=window_left, q_len=q_len_per_req, dtypes=(q_data_type, kv_data_type)))

    def run(self, q, kv):
        indptr, indices, last = self.buffers
        plan, (k_pages, v_pages) = self.plans[-1], kv
        q_len, outs = plan["q_len"], []
        for b in range(len(last)):
            pages = indices[int(indptr[b]):int(indptr[b + 1])].long()
            keys = (len(pages) - 1) * plan["page_size"] + int(last[b])
            k = k_pages[pages].flatten(0, 1)[None, :keys]
            v = v_pages[pages].flatten(0, 1)[None, :keys]
            outs.append(attention_ref(q[b * q_len:(b + 1) * q_len][None], k, v, causal=q_len > 1)[0][0])
        return torch.cat(outs).to(q.dtype)


def test_flashinfer_peers_plan_once_and_answer_like_attention(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert flashinfer_peer.load() is None and "flashinfer: not available" in capsys.readouterr().err
    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_FakeDecodeWrapper)
    monkeypatch.setattr(flashinfer_peer, "WORKSPACE_BYTES", 64)
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(2, 40, 2, 8, generator=g), torch.randn(2, 40, 2, 8, generator=g)
    k_pages, v_pages, table = bench_paged.build_paged(k, v, [40, 40], 16, g)
    for query_len, window, names in ((1, None, ["flashinfer_cc", "flashinfer_tc"]), (4, 100, ["flashinfer_tc"])):
        _FakeDecodeWrapper.made.clear()
        q = torch.randn(2, query_len, 8, 8, generator=g)
        inputs = {"q": q, "k_pages": k_pages, "v_pages": v_pages, "table": table}
        peers = flashinfer_peer.decode_peers(fake, inputs, 40, 16, query_len, window)
        assert list(peers) == names
        want, _ = attention_ref(q, k, v, causal=query_len > 1)
        for step in peers.values():
            assert step.backend is None
            torch.testing.assert_close(step(), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(step(), want, rtol=1e-5, atol=1e-5)
        assert [w.use_tensor_cores for w in _FakeDecodeWrapper.made] == [n.endswith("tc") for n in names]
        for wrapper in _FakeDecodeWrapper.made:
            assert wrapper.use_cuda_graph and len(wrapper.plans) == 1   # planned once, at the first call
            plan = wrapper.plans[0]
            assert plan["heads"] == (8, 2) and plan["dim"] == 8 and plan["page_size"] == 16
            assert plan["window_left"] == (-1 if window is None else window) and plan["q_len"] == query_len
            assert plan["dtypes"] == (torch.float32, torch.float32)
        assert len(inputs["keep_alive"]) == len(names)   # the wrappers live as long as the inputs


def test_bench_paged_hands_flashinfer_the_cache_and_page_size(monkeypatch):
    """bench_paged.decode_peers: the FlashInfer peers get the point's cache length and page size (the
    fa4 and copy peers are built, not run)."""
    fake = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=_FakeDecodeWrapper)
    monkeypatch.setattr(flashinfer_peer, "WORKSPACE_BYTES", 64)
    g = torch.Generator().manual_seed(8)
    k, v = (torch.randn(1, 70, 2, bench_paged.D, generator=g) for _ in range(2))   # decode_inputs' head dim
    inputs = bench_paged.decode_inputs(1, 70, 32, k, v, g, bench_paged.DecodeCall(8, 2))
    peers = bench_paged.decode_peers(inputs, None, bench_paged.DecodeCall(8, 2), fake)
    assert {"fa4_paged", "fa4_varlen_paged", "fa4_dense", "copy_k", "flashinfer_cc", "flashinfer_tc"} == set(peers)
    _FakeDecodeWrapper.made.clear()
    torch.testing.assert_close(peers["flashinfer_tc"](), attention_ref(inputs["q"], k, v)[0],
                               rtol=1e-5, atol=1e-5)
    plan = _FakeDecodeWrapper.made[0].plans[0]
    assert plan["page_size"] == 32 and plan["heads"] == (8, 2)
    assert _FakeDecodeWrapper.made[0].buffers[2].tolist() == [70 - 2 * 32]


def test_versus_best_takes_the_fastest_peer_of_each_round():
    times = {"fa4_paged": [1.0, 2.0, 1.0], "flashinfer_cc": [3.0, 1.0, 2.0], "flashinfer_tc": [0.5, 4.0, 1.5]}
    assert bench_paged.versus_best(times, "fa4_paged", ("flashinfer_cc", "flashinfer_tc")) == 0.5
    assert bench_paged.versus_best(times, "fa4_paged", ("absent",)) is None
    assert bench_paged.versus_best(times, "fa4_paged", ("flashinfer_tc", "absent")) == 1.5   # one peer present
    assert bench_paged.versus_best({}, "fa4_paged", ("flashinfer_cc",)) is None


def test_decode_table_shows_flashinfer_and_the_ratio():
    row = {"section": "decode", "batch": 8, "cache": 32768, "page_size": 64, "paged_vs_dense": 0.97,
           "fa4_vs_flashinfer": 1.013, "errors": {},
           "peers": {"fa4_paged": {"gb_per_s": 4332.0}, "flashinfer_tc": {"gb_per_s": 4270.0},
                     "copy_k": {"gb_per_s": 4241.0}}}
    text = bench_paged.markdown_tables({"results": [row]})
    assert "| batch x cache | page | fa4_paged | flashinfer_tc | copy_k | fa4 paged/dense | fa4 / FlashInfer |" in text
    assert "| 8 x 32k | 64 | 4332 | 4270 | 4241 | 0.97x | 1.01x |" in text
    assert bench_paged.parse_args(["--no-flashinfer"]).no_flashinfer
    del row["fa4_vs_flashinfer"]   # a file from before the FlashInfer peer: no ratio column for it
    assert "FlashInfer" not in bench_paged.markdown_tables({"results": [row]})
