"""fa4's attention variants without a GPU: sliding window (window_size), softcap, learnable sink.

cpu tier: every bad argument raises a TypeError / ValueError naming it before anything is
launched; the window normalisation table (FlashAttention-2's -1, None, causal + (w, 0), a
non-causal right of 0 is causal); what the backends hand the kernel modules (the variants only
when not at their defaults; Blackwell refuses them); the custom ops' fake (meta) shapes incl.
dsink, opcheck and torch.compile(fullgraph=True) tracing with all three variants; supported() and
the README matrix per arch; the sink gradient (fa4._dispatch.sink_grad) against torch autograd of a
float64 reference, dense and varlen, and end to end through the ops' autograd with a float64
stand-in backend; the transformers integration passing sliding_window / softcap / s_aux through.
"""
from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

import fa4
from fa4 import _api, _dispatch, _ops, _validate

pytestmark = [pytest.mark.cpu, pytest.mark.fa4]

BF16 = torch.bfloat16
F64 = torch.float64
NO_WINDOW = (None, None)


def meta(*shape, dtype=BF16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def qkv_meta(b=2, sq=64, sk=80, hq=8, hkv=2, d=128):
    return meta(b, sq, hq, d), meta(b, sk, hkv, d), meta(b, sk, hkv, d)


def _fake_arch(key="sm_90"):
    return _dispatch.ArchInfo(**{f: getattr(_dispatch.ARCHS[key], f) for f in _dispatch.ArchInfo.__dataclass_fields__})


@pytest.fixture
def no_launch(monkeypatch):
    """The public functions must raise before they reach an op (validation runs first)."""
    def boom(*a, **kw):
        raise AssertionError("reached the op: validation should have raised first")

    monkeypatch.setattr(_api._ops, "attention", boom)
    monkeypatch.setattr(_api._ops, "varlen_attention", boom)


# ================================================================================ validation
def _bad_variant_cases():
    return [
        ("window-str", dict(window_size="8,0"), TypeError, r"^window_size: expected a pair"),
        ("window-len", dict(window_size=(8,)), TypeError, r"^window_size: expected a pair"),
        ("window-int", dict(window_size=8), TypeError, r"^window_size: expected a pair"),
        ("window-float", dict(window_size=(8.0, None)), TypeError, r"^window_size: .*float 8\.0 on the left"),
        ("window-bool", dict(window_size=(None, True)), TypeError, r"^window_size: .*bool True on the right"),
        ("window-neg-left", dict(window_size=(-2, None)), ValueError, r"^window_size: left must be >= 0, -1 or None"),
        ("window-neg-right", dict(window_size=(4, -5)), ValueError, r"^window_size: right must be >= 0, -1 or None"),
        ("window-causal-right", dict(window_size=(4, 3), causal=True), ValueError,
         r"^window_size: causal=True means a right window of 0, got right = 3"),
        ("softcap-str", dict(softcap="30"), TypeError, r"^softcap: expected a float"),
        ("softcap-bool", dict(softcap=True), TypeError, r"^softcap: expected a float"),
        ("softcap-negative", dict(softcap=-1.0), ValueError, r"^softcap: must be finite and >= 0"),
        ("softcap-inf", dict(softcap=math.inf), ValueError, r"^softcap: must be finite and >= 0"),
        ("softcap-nan", dict(softcap=math.nan), ValueError, r"^softcap: must be finite and >= 0"),
        ("sink-list", dict(learnable_sink=[0.0] * 8), TypeError, r"^learnable_sink: expected a torch.Tensor"),
        ("sink-shape", dict(learnable_sink=meta(2, dtype=torch.float32)), ValueError,
         r"^learnable_sink: expected shape \(8,\) \(one logit per query head\), got \(2,\)"),
        ("sink-rank", dict(learnable_sink=meta(8, 1, dtype=torch.float32)), ValueError,
         r"^learnable_sink: expected shape \(8,\)"),
        ("sink-dtype-half", dict(learnable_sink=meta(8, dtype=torch.float16)), TypeError,
         r"^learnable_sink: dtype torch.float16 is not supported; use torch.float32 or q's dtype torch.bfloat16"),
        ("sink-dtype-f64", dict(learnable_sink=meta(8, dtype=F64)), TypeError, r"^learnable_sink: dtype torch.float64"),
        ("sink-device", dict(learnable_sink=torch.zeros(8)), ValueError,
         r"^learnable_sink: is on cpu but q is on meta"),
    ]


@pytest.mark.parametrize("case", _bad_variant_cases(), ids=lambda c: c[0])
def test_bad_variant_arguments_fixed(case, no_launch):
    _, override, exc, pattern = case
    q, k, v = qkv_meta()
    with pytest.raises(exc, match=pattern):
        fa4.flash_attn_func(q, k, v, **override)


@pytest.mark.parametrize("case", _bad_variant_cases(), ids=lambda c: c[0])
def test_bad_variant_arguments_varlen(case, no_launch):
    _, override, exc, pattern = case
    cu = torch.zeros(4, dtype=torch.int32, device="meta")
    with pytest.raises(exc, match=pattern):
        fa4.flash_attn_varlen_func(meta(100, 8, 128), meta(120, 2, 128), meta(120, 2, 128), cu_seqlens_q=cu,
                                   cu_seqlens_k=cu, max_seqlen_q=50, max_seqlen_k=60, **override)


def test_variants_are_keyword_only():
    q, k, v = qkv_meta()
    with pytest.raises(TypeError):
        fa4.flash_attn_func(q, k, v, None, False, False, False, (4, 0))


WINDOW_TABLE = [
    # (window_size, causal) -> (left, right, causal) as the kernels get it
    (((None, None), False), (None, None, False)),
    ((None, False), (None, None, False)),
    (((-1, -1), False), (None, None, False)),            # FlashAttention-2's spelling
    (((-1, -1), True), (None, None, True)),
    (([128, 16], False), (128, 16, False)),               # a list is fine
    (((np.int64(7), None), False), (7, None, False)),
    (((None, 4), False), (None, 4, False)),
    (((64, 0), True), (64, None, True)),                  # causal + (w, 0)
    (((64, -1), True), (64, None, True)),
    (((64, None), True), (64, None, True)),
    (((64, 0), False), (64, None, True)),                 # non-causal right 0 is causal
    (((0, 0), False), (0, None, True)),                   # the diagonal only
    (((None, 0), False), (None, None, True)),             # plain causal
]


@pytest.mark.parametrize("given,want", WINDOW_TABLE, ids=lambda x: repr(x))
def test_window_normalisation(given, want):
    left, right, causal = _validate.check_window(*given)
    assert (left, right, causal) == want
    assert all(x is None or type(x) is int for x in (left, right))


@pytest.mark.parametrize("given,want", WINDOW_TABLE[:9] + WINDOW_TABLE[10:], ids=lambda x: repr(x))
def test_window_reaches_the_op_normalised(given, want, monkeypatch):
    seen = []
    monkeypatch.setattr(_api._ops, "attention", lambda *a: seen.append(a) or (None, None))
    q, k, v = qkv_meta()
    fa4.flash_attn_func(q, k, v, causal=given[1], window_size=given[0])
    # (q, k, v, scale, causal, deterministic, return_lse, window, softcap, sink)
    assert seen[0][4] is want[2] and seen[0][7] == want[:2] and seen[0][8] == 0.0 and seen[0][9] is None


def test_softcap_and_sink_normalised():
    assert _validate.check_softcap(None) == 0.0 and _validate.check_softcap(0) == 0.0
    assert _validate.check_softcap(30) == 30.0 and type(_validate.check_softcap(30)) is float
    q = meta(2, 16, 8, 64)
    assert _validate.check_learnable_sink(None, q) is None
    s = meta(16, dtype=torch.float32)[::2]  # (8,), stride 2: made contiguous
    assert _validate.check_learnable_sink(s, q).is_contiguous()
    assert _validate.check_learnable_sink(meta(8), q).dtype == BF16  # q's dtype is accepted too


# ================================================================================ backends
def _variant_kernels(calls):
    def fwd(q, k, v, *, softmax_scale=None, causal=False, scheduler=None, **kw):
        calls.append(("fwd", causal, scheduler, kw))
        return "out", "lse"

    def varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale=None, causal=False, seqused_k=None, **kw):
        calls.append(("varlen_fwd", causal, None, kw))
        return "out", "lse"

    def bwd(q, k, v, out, dout, lse, *, softmax_scale, causal, deterministic, **kw):
        calls.append(("bwd", causal, None, kw))
        return q, k, v

    def varlen_bwd(q, k, v, out, dout, lse, cu_q, cu_k, max_q, max_k, *, seqused_k, softmax_scale, causal,
                   deterministic, **kw):
        calls.append(("varlen_bwd", causal, None, kw))
        return q, k, v

    return (types.SimpleNamespace(attention_forward=fwd, attention_varlen_forward=varlen_fwd, __name__="fwd_like"),
            types.SimpleNamespace(attention_backward=bwd, attention_varlen_backward=varlen_bwd, __name__="bwd_like"))


def test_hopper_backend_passes_variants_only_when_set():
    calls = []
    be = _dispatch.HopperBackend(_fake_arch())
    be._mods["fwd"], be._mods["bwd"] = _variant_kernels(calls)
    t = torch.zeros(1, 80, 2, 64)  # > 64 query rows: the default tile (no tile_m keyword)
    sink = torch.zeros(2)
    be.forward(t, t, t, 0.5, False)  # plain: exactly the pre-variant call
    be.forward(t, t, t, 0.5, True, window=(16, None), softcap=30.0, learnable_sink=sink)
    be.forward(t, t, t, 0.5, False, window=(None, 4))
    be.varlen_forward(t, t, t, t, t, None, 70, 9, 0.5, False, window=(3, 3), learnable_sink=sink)
    be.backward(t, t, t, t, t, t, 0.5, True, False, window=(16, None), softcap=30.0)
    be.backward(t, t, t, t, t, t, 0.5, True, False)
    be.varlen_backward(t, t, t, t, t, t, t, t, None, 7, 9, 0.5, False, False, softcap=5.0)
    kws = [c[3] for c in calls]
    assert kws[0] == {}
    assert kws[1] == dict(window_size=(16, None), softcap=30.0, learnable_sink=sink)
    assert kws[2] == dict(window_size=(None, 4))
    assert kws[3] == dict(window_size=(3, 3), learnable_sink=sink)
    assert kws[4] == dict(window_size=(16, None), softcap=30.0)  # the sink never reaches the backward
    assert kws[5] == {} and kws[6] == dict(softcap=5.0)


def test_windowed_long_causal_forward_keeps_the_static_grid(monkeypatch):
    """LPT orders tiles by causal length; with a left window they are about equal: no scheduler."""
    calls = []
    be = _dispatch.HopperBackend(_dispatch.ARCHS["sm_90"])
    fwd_mod, _ = _variant_kernels(calls)
    monkeypatch.setattr(be, "forward_module", lambda: fwd_mod)
    q = torch.empty(1, _dispatch.LPT_MIN_SEQLEN_K, 16, 128, device="meta")
    be.forward(q, q, q, 1.0, True, window=(256, None))
    be.forward(q, q, q, 1.0, True, softcap=10.0)
    assert calls[0][2] is None and calls[1][2] is not None  # softcap alone keeps LPT


def test_a_grid_too_big_for_the_flat_lpt_map_takes_the_per_batch_sections(monkeypatch):
    """fa4 picks flat LPT sections for long causal calls; their map divides with fast_div, exact below
    2^22 tiles, and the kernel refuses a bigger grid. 32k sequences x 128 heads of 65 queries is one:
    fa4 passes the same sections batch by batch (exact division), which the grid check accepts."""
    from stage3_fwd_kernel.tile_scheduler import check_grid

    calls = []
    be = _dispatch.HopperBackend(_dispatch.ARCHS["sm_90"])
    fwd_mod, _ = _variant_kernels(calls)
    monkeypatch.setattr(be, "forward_module", lambda: fwd_mod)
    for batch, flat in ((32768, False), (4, True)):
        q = torch.empty(batch, 65, 128, 64, device="meta")
        k = torch.empty(batch, 4096, 1, 64, device="meta")
        be.forward(q, k, k, 1.0, True)
        sched = calls[-1][2]
        assert sched is not None and sched.flat_batches is flat
        check_grid(sched, 1, 128, batch)  # 65 queries: one 128-row tile


@pytest.mark.filterwarnings("ignore:fa4. running the sm_100")
def test_blackwell_passes_the_variants_and_computes_the_sinks_d():
    """sm_100 takes window, softcap and sink as Hopper does (its kernels are compiled, never run): the
    variants reach its modules, a windowed causal forward keeps the static grid, and the sink's
    D = rowsum(dout * out) comes from sink_grad's torch ops, since its dense backward does not return it."""
    calls = []

    def fwd(q, k, v, *, softmax_scale=None, causal=False, scheduler=None, **kw):
        calls.append(("fwd", scheduler, kw))
        return "out", "lse"

    def varlen_fwd(q, k, v, cu_q, cu_k, max_q, *, softmax_scale=None, causal=False, **kw):
        calls.append(("varlen_fwd", None, kw))
        return "out", "lse"

    def bwd(q, k, v, out, dout, lse, *, softmax_scale, causal, deterministic, **kw):
        calls.append(("bwd", None, kw))
        return q, k, v

    def default_persistent(dtype, d, dv, causal, *, window_size=(None, None), softcap=0.0, learnable_sink=False):
        asked.append((causal, tuple(window_size), softcap, learnable_sink))
        # the module's rule, with a sink standing in for "no build" (the real one: a sink at dv = 128)
        return not (causal or tuple(window_size) != (None, None) or learnable_sink)

    asked = []
    bw = _dispatch.BlackwellBackend(_dispatch.ARCHS["sm_100"])
    bw._mods["fwd"] = types.SimpleNamespace(attention_forward=fwd, attention_varlen_forward=varlen_fwd,
                                            default_persistent=default_persistent)
    bw._mods["bwd"] = types.SimpleNamespace(attention_backward=bwd)
    sink = torch.zeros(2)
    q = torch.zeros(1, _dispatch.LPT_MIN_SEQLEN_K, 2, 64)
    bw.forward(q, q, q, 0.5, True, window=(16, None), softcap=30.0, learnable_sink=sink)
    assert calls[-1][0] == "fwd" and calls[-1][1] is None  # windowed: no LPT order
    assert calls[-1][2] == {"window_size": (16, None), "softcap": 30.0, "learnable_sink": sink}
    # persistent CTAs for dense calls with neither causal nor a window, where the build exists
    bw.forward(q, q, q, 0.5, False, softcap=5.0)
    assert calls[-1][2] == {"softcap": 5.0, "persistent": True}
    bw.forward(q, q, q, 0.5, False, learnable_sink=sink)
    assert calls[-1][2] == {"learnable_sink": sink}
    bw.forward(q, q, q, 0.5, False, window=(None, 8))
    assert "persistent" not in calls[-1][2]
    # the module is asked with the call's variants as they reach it
    assert asked[-3:] == [(False, (None, None), 5.0, False), (False, (None, None), 0.0, True),
                          (False, (None, 8), 0.0, False)]
    bw.varlen_forward(q, q, q, q, q, None, 7, 9, 0.5, False, window=(None, 3), softcap=2.0)
    assert calls[-1] == ("varlen_fwd", None, {"seqused_k": None, "window_size": (None, 3), "softcap": 2.0})
    t = torch.zeros(1, 8, 2, 64)
    dout, out = torch.randn(1, 8, 2, 64), torch.randn(1, 8, 2, 64)
    grads = bw.backward(dout, t, t, t, out, t, 0.5, False, False, window=(4, 4), softcap=5.0, want_d=True)
    assert calls[-1] == ("bwd", None, {"window_size": (4, 4), "softcap": 5.0})  # no return_d asked of it
    assert len(grads) == 3  # no D: the sink's gradient forms it, the same D the kernel would have
    d = torch.einsum("bshd,bshd->bhs", dout, out)
    lse = torch.randn(1, 2, 8)
    sink = torch.randn(2)
    torch.testing.assert_close(_ops._dsink(out, dout, lse, None, sink, *grads[3:]),
                               _dispatch.sink_grad(out, dout, lse, sink, d=d))
    used = torch.zeros(1, dtype=torch.int32)
    bw.varlen_forward(q, q, q, q, q, used, 7, 9, 0.5, False)  # its varlen forward takes seqused_k
    assert calls[-1][2]["seqused_k"] is used


# ================================================================================ supported()
def test_supported_reports_the_variants_per_arch():
    rep = fa4.supported()
    for name in ("sliding_window", "softcap", "learnable_sink"):
        f = rep["features"][name]
        assert f["supported"] is True and f["archs"] == {"sm_90": True, "sm_100": True}, name
        assert rep["archs"]["sm_90"]["features"][name] is True
        assert rep["archs"]["sm_100"]["features"][name] is True
        assert f"| {name} | yes | yes |" in _dispatch.support_markdown()
    assert rep["features"]["seqused_k"]["archs"] == {"sm_90": True, "sm_100": True}
    assert rep["features"]["fp8"]["archs"] == {"sm_90": False, "sm_100": False}


# ================================================================================ ops: fake / meta, compile
def _variant_samples():
    hq = 4
    q, k, v = meta(1, 16, hq, 64), meta(1, 24, 2, 64), meta(1, 24, 2, 64)
    out, lse = meta(1, 16, hq, 64), meta(1, hq, 16, dtype=torch.float32)
    sink32, sink16 = meta(hq, dtype=torch.float32), meta(hq)
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    qv, kv, vv, ov = meta(16, hq, 64), meta(24, 2, 64), meta(24, 2, 64), meta(16, hq, 64)
    lv = meta(hq, 16, dtype=torch.float32)
    return [
        ("fwd", torch.ops.fa4.fwd.default, (q, k, v, 0.125, True, False, True, 8, None, 30.0, sink32)),
        ("fwd-window-only", torch.ops.fa4.fwd.default, (q, k, v, 0.125, False, False, False, 8, 2, 0.0, None)),
        ("bwd", torch.ops.fa4.bwd.default, (out, q, k, v, out, lse, lse, 0.125, True, False, 8, None, 30.0, sink16)),
        ("bwd-no-sink", torch.ops.fa4.bwd.default, (out, q, k, v, out, lse, None, 0.125, False, False, 3, 3, 0.0)),
        ("varlen_fwd", torch.ops.fa4.varlen_fwd.default,
         (qv, kv, vv, cu, cu, None, 8, 12, 0.125, True, False, True, 4, None, 5.0, sink32)),
        ("varlen_bwd", torch.ops.fa4.varlen_bwd.default,
         (ov, qv, kv, vv, ov, lv, lv, cu, cu, cu[:2], 8, 12, 0.125, False, False, None, 2, 5.0, sink32)),
    ]


@pytest.mark.parametrize("sample", _variant_samples(), ids=lambda s: s[0])
def test_opcheck_with_variants(sample):
    _, op, args = sample
    res = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    assert all(v == "SUCCESS" for v in res.values()), res


def test_op_schemas_end_with_the_variants():
    for op in (torch.ops.fa4.fwd, torch.ops.fa4.bwd, torch.ops.fa4.varlen_fwd, torch.ops.fa4.varlen_bwd):
        schema = str(op.default._schema)
        assert schema.endswith(("SymInt? window_left=None, SymInt? window_right=None, float softcap=0., "
                                "Tensor? learnable_sink=None) -> (Tensor, Tensor)",
                                "SymInt? window_left=None, SymInt? window_right=None, float softcap=0., "
                                "Tensor? learnable_sink=None) -> (Tensor, Tensor, Tensor, Tensor)")), schema


@pytest.mark.parametrize("sink_dtype", [torch.float32, BF16])
def test_fake_shapes_with_dsink(sink_dtype):
    q, k, v = (t.requires_grad_() for t in qkv_meta(d=64))
    sink = meta(8, dtype=sink_dtype).requires_grad_()
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, window_size=(32, 0), softcap=20.0, learnable_sink=sink,
                                   return_lse=True)
    assert out.shape == (2, 64, 8, 64) and lse.shape == (2, 8, 64) and lse.dtype == torch.float32
    (out.float().sum() + lse.sum()).backward()
    assert sink.grad.shape == (8,) and sink.grad.dtype == sink_dtype and q.grad.shape == q.shape
    dq, dk, dv, dsink = torch.ops.fa4.bwd(out, q, k, v, out, lse, None, 0.1, True, False, 32, None, 20.0, sink)
    assert dsink.shape == (8,) and dsink.dtype == sink_dtype and dk.shape == k.shape
    *_, dsink = torch.ops.fa4.bwd(out, q, k, v, out, lse, None, 0.1, True, False)
    assert dsink.shape == (0,) and dsink.dtype == torch.float32
    # varlen
    cu = torch.zeros(4, dtype=torch.int32, device="meta")
    qv = meta(100, 8, 64).requires_grad_()
    kv = meta(120, 2, 64)
    sink.grad = None
    out = fa4.flash_attn_varlen_func(qv, kv, kv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=50, max_seqlen_k=60,
                                     window_size=(-1, 8), learnable_sink=sink)
    out.float().sum().backward()
    assert out.shape == (100, 8, 64) and sink.grad.shape == (8,) and sink.grad.dtype == sink_dtype
    *_, dsink = torch.ops.fa4.varlen_bwd(out, qv, kv, kv, out, meta(8, 100, dtype=torch.float32), None, cu, cu, None,
                                         50, 60, 0.1, False, False, None, 8, 0.0, sink)
    assert dsink.shape == (8,)


def test_fake_tensor_mode_with_variants():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # fake CUDA tensors on a machine without CUDA
        q = torch.empty(3, 50, 4, 64, device="cuda", dtype=torch.float16)
        sink = torch.empty(4, device="cuda", dtype=torch.float32)
        out = fa4.flash_attn_func(q, q, q, window_size=(16, 16), softcap=10.0, learnable_sink=sink)
        assert out.device.type == "cuda" and out.shape == (3, 50, 4, 64)


def _graph_breaks(fn, *args):
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args)


def test_torch_compile_fullgraph_with_window_softcap_sink():
    def step(q, k, v, sink):
        out, lse = fa4.flash_attn_func(q, k, v, causal=True, window_size=(32, None), softcap=30.0,
                                       learnable_sink=sink, return_lse=True)
        return out.float().square().mean() + lse.mean()

    q, k, v = (t.requires_grad_() for t in qkv_meta(sq=128, sk=128, d=64))
    sink = meta(8, dtype=torch.float32).requires_grad_()
    torch._dynamo.reset()
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v, sink)
    loss.backward()
    assert loss.shape == () and q.grad.shape == q.shape and sink.grad.shape == (8,)
    ex = _graph_breaks(step, q, k, v, sink)
    assert ex.graph_break_count == 0 and ex.graph_count == 1

    def varlen(q, k, v, cu_q, cu_k, sink):
        return fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=50,
                                          max_seqlen_k=60, window_size=(-1, 0), softcap=5.0,
                                          learnable_sink=sink).sum()

    cu = torch.zeros(4, dtype=torch.int32, device="meta")
    ex = _graph_breaks(varlen, meta(100, 8, 64), meta(120, 2, 64), meta(120, 2, 64), cu, cu, sink)
    assert ex.graph_break_count == 0
    torch._dynamo.reset()


# ================================================================================ the sink gradient
def ref_attention(q, k, v, scale, causal=False, window=NO_WINDOW, softcap=0.0, sink=None):
    """float64 attention with the three variants, (B, S, H, D), bottom-right aligned; lse includes
    the sink; a row with no visible key and no sink has out 0 and lse -inf."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    kk, vv = (t.repeat_interleave(hq // hkv, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i, j, off = torch.arange(sq)[:, None], torch.arange(sk)[None, :], sk - sq
    left, right = window
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left is not None:
        ok &= j >= i + off - left
    if causal or right is not None:
        ok &= j <= i + off + (0 if causal else right)
    s = s.masked_fill(~ok, -math.inf)
    full = s if sink is None else torch.cat([s, sink.to(s.dtype).view(1, hq, 1, 1).expand(b, hq, sq, 1)], -1)
    lse = torch.logsumexp(full, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # masked: exp(-inf) = 0, no NaN
    return torch.einsum("bhij,bjhd->bihd", p, vv), lse


def _problem(seed, b=2, sq=13, sk=17, hq=4, hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, dtype=F64, generator=g)  # noqa: E731
    return mk(b, sq, hq, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d), mk(b, sq, hq, d), mk(b, hq, sq), mk(hq)


@pytest.mark.parametrize("causal,window,softcap,sq,sk", [
    (False, NO_WINDOW, 0.0, 13, 17),
    (True, NO_WINDOW, 0.0, 19, 11),      # Sq > Sk: the first rows see no key, only the sink
    (True, (3, None), 2.0, 13, 17),
    (False, (2, 4), 0.0, 13, 13),
])
def test_sink_grad_matches_autograd_dense(causal, window, softcap, sq, sk):
    q, k, v, dout, dlse, sink = _problem(7, sq=sq, sk=sk)
    for with_dlse in (False, True):
        sr = sink.clone().requires_grad_()
        out, lse = ref_attention(q, k, v, 0.3, causal, window, softcap, sr)
        loss = (out * dout).sum() + ((lse * dlse).sum() if with_dlse else 0)
        (want,) = torch.autograd.grad(loss, sr)
        got = _dispatch.sink_grad(out.detach(), dout, lse.detach(), sink, dlse if with_dlse else None)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
        assert got.dtype == F64 and got.shape == (4,) and want.abs().max() > 1e-3


def test_sink_grad_matches_autograd_varlen():
    g = torch.Generator().manual_seed(3)
    mk = lambda *s: torch.randn(*s, dtype=F64, generator=g)  # noqa: E731
    cq, ck = [0, 5, 5, 16], [0, 9, 12, 20]       # sequence 2: 11 queries, 8 keys (3 rows see no key)
    q, k, v, dout, dlse, sink = mk(16, 4, 8), mk(20, 2, 8), mk(20, 2, 8), mk(16, 4, 8), mk(4, 16), mk(4)
    sr = sink.clone().requires_grad_()
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(zip(cq[:-1], cq[1:]), zip(ck[:-1], ck[1:])):
        o, l = ref_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], 0.4, True, (4, None), 0.0, sr)
        outs.append(o[0])
        lses.append(l[0])
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)  # (Tq, H, D), (H, Tq)
    (want,) = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), sr)
    got = _dispatch.sink_grad(out.detach(), dout, lse.detach(), sink, dlse)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_sink_grad_dtypes_and_empty_rows():
    """fp32 accumulation from bf16 tensors, the result in the sink's dtype; lse = -inf rows add 0."""
    out, dout = torch.randn(2, 5, 3, 8).to(BF16), torch.randn(2, 5, 3, 8).to(BF16)
    lse = torch.randn(2, 3, 5)
    for dtype in (BF16, torch.float32):
        sink = torch.randn(3).to(dtype)
        got = _dispatch.sink_grad(out, dout, lse, sink)
        d = (dout.float() * out.float()).sum(-1).permute(0, 2, 1)
        want = -(torch.exp(sink.float().view(1, 3, 1) - lse) * d).sum((0, 2))
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=1e-2 if dtype == BF16 else 1e-6, atol=1e-5)
    lse[:, :, 0] = -math.inf
    assert torch.isfinite(_dispatch.sink_grad(out, dout, lse, torch.zeros(3))).all()
    dlse = torch.randn(2, 3, 5)
    base = _dispatch.sink_grad(out, dout, lse, torch.zeros(3), dlse)
    dlse[:, :, 0] = math.inf  # an empty row's lse gradient cannot reach dsink (p = 0 there)
    torch.testing.assert_close(_dispatch.sink_grad(out, dout, lse, torch.zeros(3), dlse), base)


def ref_backward(q, k, v, out, dout, lse, scale, causal, window=NO_WINDOW, softcap=0.0, dlse=None):
    """A kernel's backward in float64: P recomputed from q, k and the saved lse (which includes the
    sink, so the sink itself is not needed), dS = P (dP - D + dlse) times the softcap's derivative."""
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    kk, vv = (t.repeat_interleave(g, dim=2) for t in (k, v))
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    dcap = torch.ones_like(s)
    if softcap:
        t = torch.tanh(s / softcap)
        s, dcap = softcap * t, 1 - t * t
    i, j, off = torch.arange(sq)[:, None], torch.arange(sk)[None, :], sk - sq
    left, right = window
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left is not None:
        ok &= j >= i + off - left
    if causal or right is not None:
        ok &= j <= i + off + (0 if causal else right)
    p = torch.where(ok, torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None]), 0.0)
    dp = torch.einsum("bihd,bjhd->bhij", dout, vv)
    d = (dout * out).sum(-1).permute(0, 2, 1)  # (B, H, Sq)
    if dlse is not None:
        d = d - torch.where(torch.isinf(lse), 0.0, dlse)
    ds = p * (dp - d[..., None]) * dcap
    dq = torch.einsum("bhij,bjhd->bihd", ds, kk) * scale
    dk = torch.einsum("bhij,bihd->bjhd", ds, q) * scale
    dv = torch.einsum("bhij,bihd->bjhd", p, dout)
    fold = lambda t: t.view(b, sk, hkv, g, t.shape[-1]).sum(3)  # noqa: E731  (GQA: sum the group)
    return dq, fold(dk), fold(dv)


class _ReferenceBackend:
    """A float64 CPU stand-in for a Backend with the kernels' contract: the forward takes the
    variants, the backward gets the sink-inclusive lse but not the sink."""

    arch = _dispatch.ARCHS["sm_90"]

    def __init__(self):
        self.calls = []

    def check_head_dims(self, d, dv):
        pass

    def check_variants(self, window=NO_WINDOW, softcap=0.0, learnable_sink=None):
        pass

    def forward(self, q, k, v, softmax_scale, causal, window=NO_WINDOW, softcap=0.0, learnable_sink=None):
        self.calls.append(("fwd", window, softcap, learnable_sink is not None))
        return ref_attention(q, k, v, softmax_scale, causal, window, softcap, learnable_sink)

    def backward(self, dout, q, k, v, out, lse, softmax_scale, causal, deterministic, dlse=None, window=NO_WINDOW,
                 softcap=0.0, want_d=False):
        self.calls.append(("bwd", window, softcap, dlse is not None))
        grads = ref_backward(q, k, v, out, dout, lse, softmax_scale, causal, window, softcap, dlse)
        if want_d:  # the kernel's D rows, D - dlse in lse's layout (B, H, Sq), as the Hopper backend returns them
            d = (dout.to(torch.float64) * out).sum(-1).permute(0, 2, 1)
            return (*grads, d if dlse is None else d - torch.where(lse == -math.inf, 0.0, dlse))
        return grads


@pytest.fixture
def reference_ops(monkeypatch):
    """fa4::fwd / fa4::bwd run their real implementations on CPU, over _ReferenceBackend."""
    backend = _ReferenceBackend()
    monkeypatch.setattr(_dispatch, "backend_for", lambda device: backend)
    lib = torch.library.Library("fa4", "FRAGMENT")
    torch.library.register_kernel("fa4::fwd", "cpu", _ops._fwd_impl, lib=lib)
    torch.library.register_kernel("fa4::bwd", "cpu", _ops._bwd_impl, lib=lib)
    yield backend
    lib._destroy()


@pytest.mark.parametrize("path", ["op", "eager"])
def test_sink_gradient_end_to_end_through_the_autograd_wiring(reference_ops, path):
    """dq, dk, dv and dsink of a loss on out and lse, through fa4::fwd's autograd formula (and the
    eager autograd.Function), equal torch autograd of the float64 reference."""
    q, k, v, dout, dlse, sink = _problem(11, sq=15, sk=12)
    window, softcap = (5, None), 3.0
    qr, kr, vr, sr = (t.clone().requires_grad_() for t in (q, k, v, sink))
    o_r, l_r = ref_attention(qr, kr, vr, 0.3, True, window, softcap, sr)
    want = torch.autograd.grad((o_r * dout).sum() + (l_r * dlse).sum(), (qr, kr, vr, sr))
    qa, ka, va, sa = (t.clone().requires_grad_() for t in (q, k, v, sink))
    args = (qa, ka, va, 0.3, True, False, True, *window, softcap, sa)
    out, lse = _ops.fwd(*args) if path == "op" else _ops._EagerFwd.apply(*args)
    got = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (qa, ka, va, sa))
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)
    assert reference_ops.calls == [("fwd", window, softcap, True), ("bwd", window, softcap, True)]


def test_empty_problems_with_a_sink(reference_ops):
    """No keys: out 0, lse = the sink (its denominator alone); the sink still gets dlse's gradient."""
    z = lambda *s: torch.zeros(*s, dtype=F64)  # noqa: E731
    sink = torch.tensor([0.5, -1.0], dtype=F64)
    out, lse = _ops._fwd_impl(z(2, 3, 2, 8), z(2, 0, 2, 8), z(2, 0, 2, 8), 0.1, False, False, True, None, None, 0.0,
                              sink)
    assert torch.all(out == 0) and torch.equal(lse, sink.float().view(1, 2, 1).expand(2, 2, 3))
    dlse = torch.ones(2, 2, 3, dtype=torch.float32)
    *grads, dsink = _ops._bwd_impl(z(2, 3, 2, 8), z(2, 3, 2, 8), z(2, 0, 2, 8), z(2, 0, 2, 8), out, lse, dlse, 0.1,
                                   False, False, None, None, 0.0, sink)
    assert all(torch.all(g == 0) for g in grads) and torch.allclose(dsink, torch.full((2,), 6.0, dtype=F64))
    out, lse = _ops._varlen_fwd_impl(z(4, 2, 8), z(0, 2, 8), z(0, 2, 8), torch.tensor([0, 4], dtype=torch.int32),
                                     torch.tensor([0, 0], dtype=torch.int32), None, 4, 0, 0.1, False, False, True,
                                     None, None, 0.0, sink)
    assert lse.shape == (2, 4) and torch.equal(lse[:, 0], sink.float()) and reference_ops.calls == []


def test_empty_rows_lse_is_a_fresh_tensor_never_the_sinks(reference_ops):
    """One lse value per head (B = 1, Sq = 1) and no keys: the sink's expand is already contiguous, yet
    the returned lse must not share the sink's storage (an optimizer step would change it, and the op
    refuses an output that aliases an input)."""
    z = lambda *s: torch.zeros(*s, dtype=F64)  # noqa: E731
    sink = torch.randn(4, dtype=torch.float32)
    out, lse = _ops._fwd_impl(z(1, 1, 4, 8), z(1, 0, 2, 8), z(1, 0, 2, 8), 0.1, False, False, True, None, None,
                              0.0, sink)
    assert lse.untyped_storage().data_ptr() != sink.untyped_storage().data_ptr()
    before = lse.clone()
    sink.add_(1.0)
    assert torch.equal(lse, before)
    _ops.fwd(z(1, 1, 4, 8), z(1, 0, 2, 8), z(1, 0, 2, 8), 0.1, False, False, True, None, None, 0.0, sink)


@pytest.mark.parametrize("path", ["op", "eager"])
def test_double_backward_is_refused_on_both_paths(reference_ops, path):
    """create_graph=True: the kernels' gradients are not differentiable, so a gradient penalty through
    attention raises on both paths (the eager one returned None for q's part before)."""
    q, k, v, dout, _, sink = _problem(3)
    qa, ka, va, sa = (t.clone().requires_grad_() for t in (q, k, v, sink))
    args = (qa, ka, va, 0.3, True, False, True, None, None, 0.0, sa)
    out, _ = _ops.fwd(*args) if path == "op" else _ops._EagerFwd.apply(*args)
    dq, *_ = torch.autograd.grad((out * out).sum(), (qa, ka, va, sa), create_graph=True)
    with pytest.raises(RuntimeError, match="autograd formula"):
        torch.autograd.grad(dq.pow(2).sum(), qa, allow_unused=True)


def test_varlen_d_rows_stay_inside_the_buffer_for_tokens_past_the_last_offset():
    """host._varlen_d_rows: token t of sequence b reads row stats_offset(cu[b], b) + t - cu[b]; a token
    past cu_seqlens_q[-1] (a last offset below the packed length, unchecked without check_values) maps
    to the buffer's last row, which no sequence owns, instead of an index past the buffer (a device-side
    assert on a GPU)."""
    from stage4_bwd_kernel import common, host

    for cu_list, total in (([0, 3, 3, 7], 7), ([0, 5], 6), ([0, 1], 4), ([0, 4, 8], 11), ([0, 0], 3)):
        cu = torch.tensor(cu_list, dtype=torch.int32)
        b = len(cu_list) - 1
        rows = common.stats_offset(total, b)
        got = host._varlen_d_rows(torch.zeros(2, total), cu, rows)
        owned = set()
        for s, (t0, t1) in enumerate(zip(cu_list, cu_list[1:])):
            r0 = common.stats_offset(t0, s)
            assert got[t0:t1].tolist() == list(range(r0, r0 + t1 - t0))
            owned |= set(range(r0, r0 + t1 - t0))
        tail = got[cu_list[-1]:]
        assert ((tail >= 0) & (tail < rows)).all() and not owned & set(tail.tolist()), (cu_list, got)


def test_sink_grad_refuses_dlse_with_d_rows_that_hold_it():
    out, dout, lse = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 2, 4)
    d = torch.einsum("bshd,bshd->bhs", dout, out)
    with pytest.raises(ValueError, match="dlse"):
        _dispatch.sink_grad(out, dout, lse, torch.zeros(2), torch.ones(1, 2, 4), d=d)
    dlse = torch.randn(1, 2, 4)
    torch.testing.assert_close(_dispatch.sink_grad(out, dout, lse, torch.zeros(2), d=d - dlse),
                               _dispatch.sink_grad(out, dout, lse, torch.zeros(2), dlse))


def test_add_sink_keeps_empty_rows_zero_with_a_minus_inf_sink():
    from fa4 import _lse_merge

    out = torch.zeros(1, 2, 2, 4)
    lse = torch.tensor([[[-math.inf, 0.5], [-math.inf, -math.inf]]]).permute(0, 2, 1)   # (B, S, H) rows
    out2, lse2 = _lse_merge.add_sink(out, lse, torch.tensor([-math.inf, 0.3]))
    assert torch.equal(out2, torch.zeros_like(out)) and not lse2.isnan().any()


def test_paged_grad_check_leaves_non_tensors_to_the_argument_checks():
    from fa4 import _paged

    t = torch.zeros(2, requires_grad=True)
    assert _paged.needs_grad(None, 0.5, "x") is False and _paged.needs_grad(0.5, t) is True


# ================================================================================ transformers
@pytest.fixture
def hf_calls(monkeypatch):
    from fa4.integrations import transformers as integ

    calls = []
    real = integ.flash_attn_func
    monkeypatch.setattr(integ, "flash_attn_func", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    return integ, calls


def test_transformers_passes_sliding_window_softcap_and_sinks(hf_calls):
    integ, calls = hf_calls
    causal, bidir = types.SimpleNamespace(is_causal=True), types.SimpleNamespace(is_causal=False)
    q, k, v = meta(2, 8, 16, 64), meta(2, 2, 16, 64), meta(2, 2, 16, 64)
    out, _ = integ.fa4_attention_forward(causal, q, k, v, None, sliding_window=4, softcap=30.0)
    assert out.shape == (2, 16, 8, 64)
    integ.fa4_attention_forward(bidir, q, k, v, None, sliding_window=4)
    integ.fa4_attention_forward(causal, q, k, v, None, sliding_window=16)  # keys <= window: nothing to cut
    integ.fa4_attention_forward(causal, q, k, v, None, sliding_window=None, softcap=None)
    sink32, sink16 = meta(8, dtype=torch.float32), meta(8, dtype=torch.float16)
    integ.fa4_attention_forward(causal, q, k, v, None, s_aux=sink32)
    integ.fa4_attention_forward(causal, q, k, v, None, s_aux=sink16)  # cast to q's dtype, as transformers does
    got = [(c["window_size"], c["softcap"], c["learnable_sink"]) for c in calls]
    assert got[:4] == [((3, 0), 30.0, None), ((3, 3), 0.0, None), ((None, None), 0.0, None),
                       ((None, None), 0.0, None)]
    assert got[4][2] is sink32 and got[5][2].dtype == BF16 and got[5][2].shape == (8,)
    assert all(c["causal"] is True for i, c in enumerate(calls) if i != 1) and calls[1]["causal"] is False


def test_transformers_padded_path_passes_the_variants(monkeypatch):
    from fa4.integrations import transformers as integ

    seen = []

    def varlen(q, k, v, **kw):
        seen.append(kw)
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])

    monkeypatch.setattr(integ, "flash_attn_varlen_func", varlen)
    q, k = torch.zeros(2, 4, 10, 64, dtype=BF16), torch.zeros(2, 2, 10, 64, dtype=BF16)
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[0, :3] = False
    out, _ = integ.fa4_attention_forward(types.SimpleNamespace(is_causal=True), q, k, k, mask, sliding_window=6,
                                         softcap=50.0, s_aux=torch.zeros(4))
    assert out.shape == (2, 10, 4, 64)
    assert seen[0]["window_size"] == (5, 0) and seen[0]["softcap"] == 50.0 and seen[0]["learnable_sink"].shape == (4,)
