"""fa4 on a real GPU (an H100 or H200): the public API against the fp32 reference.

Every numeric check uses FA4's rule (stage0_reference.torch_reference.assert_fa4_close): the
error against the fp32 reference is at most 2x that of a plain PyTorch implementation in the
input precision, plus 1e-5.

* forward: head dims, GQA, causal (incl. rows with no key), fp16/bf16, strided inputs, empty inputs;
* backward and the lse gradient when stage4_bwd_kernel.hopper exists, otherwise the clear
  NotImplementedError that says it has not landed;
* torch.compile(fullgraph=True) with inductor, and CUDA-graph capture + replay after a warm-up;
* varlen (skipped, with the reason, when no varlen forward is importable), FA4_VALIDATE;
* the SDPA helper against torch SDPA (top-left causal);
* the compile cache across processes: a second process loads instead of compiling (cold and warm
  first-call latencies are printed).
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import fa4
from fa4 import _dispatch

pytestmark = [pytest.mark.gpu, pytest.mark.fa4]

ROOT = pathlib.Path(__file__).resolve().parents[1]
DT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def rand(*shape, dtype=torch.bfloat16, g=None, grad=False):
    return torch.randn(*shape, device="cuda", dtype=dtype, generator=g).requires_grad_(grad)


def ref_and_base(q, k, v, *, causal, softmax_scale=None):
    from stage0_reference.torch_reference import attention_ref

    ref = attention_ref(q.detach(), k.detach(), v.detach(), causal=causal, softmax_scale=softmax_scale, upcast=True)
    base = attention_ref(q.detach(), k.detach(), v.detach(), causal=causal, softmax_scale=softmax_scale, upcast=False)
    return ref, base


def ref_grads(q, k, v, dout, dlse=None, *, causal, upcast):
    """Gradients of sum(out * dout) (+ sum(lse * dlse)) through the reference, fp32 or input precision."""
    from stage0_reference.torch_reference import attention_ref

    qs, ks, vs = (t.detach().clone().float().requires_grad_() if upcast else t.detach().clone().requires_grad_()
                  for t in (q, k, v))
    out, lse = attention_ref(qs, ks, vs, causal=causal, upcast=upcast)
    loss = (out.float() * dout.float()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0) * dlse).sum()
    return torch.autograd.grad(loss, (qs, ks, vs))


# ------------------------------------------------------------------------------------------- dispatch
def test_dispatch_on_this_gpu():
    be = _dispatch.backend_for(torch.device("cuda"))
    assert be.arch.key == "sm_90", f"this suite expects a Hopper GPU, got {be.arch.key}"
    assert be.forward_module().__name__ == fa4.supported()["archs"]["sm_90"]["forward"]


# -------------------------------------------------------------------------------------------- forward
FWD_CASES = [  # b, sq, sk, hq, hkv, d, dv, causal, dtype
    (2, 256, 256, 8, 8, 128, 128, False, "bf16"),
    (2, 333, 517, 8, 2, 128, 128, True, "bf16"),
    (1, 517, 333, 4, 1, 64, 64, True, "fp16"),     # causal with sq > sk: rows with no key
    (2, 200, 300, 4, 4, 96, 96, False, "bf16"),
    (1, 300, 300, 4, 2, 192, 128, True, "bf16"),
    (1, 128, 400, 4, 4, 256, 256, False, "fp16"),
    (3, 1, 1, 2, 1, 128, 128, True, "bf16"),
    (1, 1024, 1024, 16, 16, 128, 128, True, "bf16"),
]


@pytest.mark.parametrize("case", FWD_CASES, ids=lambda c: "b{}-{}x{}-h{}/{}-d{}x{}-{}-{}".format(
    *c[:7], "causal" if c[7] else "full", c[8]))
def test_forward_matches_reference(case):
    from stage0_reference.torch_reference import assert_fa4_close

    b, sq, sk, hq, hkv, d, dv, causal, dt = case
    g = torch.Generator(device="cuda").manual_seed(sum(case[:7]))
    q = rand(b, sq, hq, d, dtype=DT[dt], g=g)
    k, v = rand(b, sk, hkv, d, dtype=DT[dt], g=g), rand(b, sk, hkv, dv, dtype=DT[dt], g=g)
    out, lse = fa4.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert out.shape == (b, sq, hq, dv) and out.dtype == DT[dt]
    assert lse.shape == (b, hq, sq) and lse.dtype == torch.float32
    (ref_o, ref_l), (base_o, base_l) = ref_and_base(q, k, v, causal=causal)
    assert_fa4_close("out", out, ref_o, base_o)
    assert_fa4_close("lse", lse, ref_l, base_l)
    assert torch.equal(fa4.flash_attn_func(q, k, v, causal=causal), out)  # return_lse=False: same out


@pytest.mark.parametrize("case", [(1, 4096, 4096, 12, 4, 64, 64, "bf16"), (1, 4224, 4224, 8, 8, 128, 128, "fp16"),
                                  (2, 4000, 4500, 6, 6, 128, 128, "bf16"),
                                  (2, 4096, 4096, 10, 10, 192, 128, "bf16")],  # flat sections 8, 8, 4 span batches
                         ids=lambda c: "b{}-{}x{}-h{}/{}-d{}x{}-{}".format(*c))
def test_long_causal_forward_in_lpt_order(case):
    """Causal with >= LPT_MIN_SEQLEN_K keys runs stage 5's LPT tile order (GQA sections of whole groups,
    a partial last section, sq != sk, sections over the (batch, head) pairs that span two batches): FA4's rule against the reference, and bitwise the static grid's
    result (the order moves whole tiles between CTAs, never an operation inside one)."""
    from stage0_reference.torch_reference import assert_fa4_close
    from stage3_fwd_kernel import hopper

    b, sq, sk, hq, hkv, d, dv, dt = case
    assert _dispatch.causal_forward_scheduler("sm_90", True, sk, d, dv, hq, hkv) is not None
    g = torch.Generator(device="cuda").manual_seed(sq + sk + hq)
    q = rand(b, sq, hq, d, dtype=DT[dt], g=g)
    k, v = rand(b, sk, hkv, d, dtype=DT[dt], g=g), rand(b, sk, hkv, dv, dtype=DT[dt], g=g)
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    static_out, static_lse = hopper.attention_forward(q, k, v, causal=True, softmax_scale=d ** -0.5)
    assert torch.equal(out, static_out) and torch.equal(lse, static_lse)
    (ref_o, ref_l), (base_o, base_l) = ref_and_base(q, k, v, causal=True)
    assert_fa4_close("out", out, ref_o, base_o)
    assert_fa4_close("lse", lse, ref_l, base_l)


def test_forward_strided_inputs_and_scale():
    """q/k/v as views of a packed qkv buffer and of (B, H, S, D) tensors, a non-default scale."""
    from stage0_reference.torch_reference import assert_fa4_close

    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = rand(2, 257, 3, 4, 128, g=g)
    q, k, v = qkv.unbind(2)
    out = fa4.flash_attn_func(q, k, v, softmax_scale=0.3, causal=True)
    (ref_o, _), (base_o, _) = ref_and_base(q, k, v, causal=True, softmax_scale=0.3)
    assert_fa4_close("out (packed qkv)", out, ref_o, base_o)
    kt = rand(2, 4, 400, 128, g=g).transpose(1, 2)
    vt = rand(2, 4, 400, 128, g=g).transpose(1, 2)
    out = fa4.flash_attn_func(q, kt, vt)
    (ref_o, _), (base_o, _) = ref_and_base(q, kt, vt, causal=False)
    assert_fa4_close("out (transposed k, v)", out, ref_o, base_o)


def test_empty_inputs():
    z = lambda *s: torch.zeros(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    out, lse = fa4.flash_attn_func(z(0, 5, 4, 64), z(0, 7, 2, 64), z(0, 7, 2, 64), return_lse=True)
    assert out.shape == (0, 5, 4, 64) and lse.shape == (0, 4, 5)
    out, lse = fa4.flash_attn_func(z(2, 0, 4, 64), z(2, 7, 2, 64), z(2, 7, 2, 64), return_lse=True)
    assert out.shape == (2, 0, 4, 64) and lse.shape == (2, 4, 0)
    for causal in (False, True):
        out, lse = fa4.flash_attn_func(z(2, 5, 4, 64), z(2, 0, 2, 64), z(2, 0, 2, 64), causal=causal, return_lse=True)
        assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


# ------------------------------------------------------------------------------------------- backward
BWD_CASES = [(2, 300, 300, 8, 2, 128, 128, True), (1, 257, 513, 4, 4, 64, 64, False),
             (1, 200, 200, 4, 1, 192, 128, True)]


@pytest.mark.parametrize("case", BWD_CASES, ids=lambda c: "{}x{}-h{}/{}-d{}x{}-{}".format(*c[1:7], c[7]))
def test_backward(case):
    from stage0_reference.torch_reference import assert_fa4_close, grad_atol

    b, sq, sk, hq, hkv, d, dv, causal = case
    g = torch.Generator(device="cuda").manual_seed(11)
    q = rand(b, sq, hq, d, g=g, grad=True)
    k, v = rand(b, sk, hkv, d, g=g, grad=True), rand(b, sk, hkv, dv, g=g, grad=True)
    out = fa4.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = ref_grads(q, k, v, dout, causal=causal, upcast=True)
    base = ref_grads(q, k, v, dout, causal=causal, upcast=False)
    for name, a, r, bl in zip(("dq", "dk", "dv"), got, ref, base):
        assert a.shape == r.shape and a.dtype == q.dtype
        assert_fa4_close(name, a, r, bl, atol=grad_atol(ref))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.usefixtures("gpu_memory_hog")
def test_backward_whose_dq_accumulator_passes_2_pow_31_elements(causal):
    """2048 x 128 tokens x 64 heads x 128: q holds 2^31 elements (4 GiB in bf16) and the fp32 dQ
    accumulator at least as many, past every 32-bit index. Forward and backward run, and the first
    and last sequences (the highest addresses) match the reference under the rule."""
    from stage0_reference.torch_reference import assert_fa4_close, grad_atol

    b, s, h, d = 2048, 128, 64, 128
    g = torch.Generator(device="cuda").manual_seed(21)
    q, k, v = (rand(b, s, h, d, g=g, grad=True) for _ in range(3))
    out = fa4.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=g)
    got = torch.autograd.grad(out, (q, k, v), dout)
    for i in (0, b - 1):
        one = [t.detach()[i:i + 1] for t in (q, k, v)]
        ref_out, base_out = ref_and_base(*one, causal=causal)
        assert_fa4_close(f"out[{i}]", out[i:i + 1], ref_out[0], base_out[0], atol=1e-5)
        ref = ref_grads(*one, dout[i:i + 1], causal=causal, upcast=True)
        base = ref_grads(*one, dout[i:i + 1], causal=causal, upcast=False)
        for name, a, r, bl in zip(("dq", "dk", "dv"), got, ref, base):
            assert_fa4_close(f"{name}[{i}]", a[i:i + 1], r, bl, atol=grad_atol(ref))
    del q, k, v, out, dout, got
    torch.cuda.empty_cache()


def test_lse_gradient():
    """loss = sum(out * dout) + sum(lse * dlse): the dlse D-term correction, on hardware."""
    from stage0_reference.torch_reference import assert_fa4_close, grad_atol

    g = torch.Generator(device="cuda").manual_seed(12)
    q = rand(2, 250, 8, 128, g=g, grad=True)
    k, v = rand(2, 380, 2, 128, g=g, grad=True), rand(2, 380, 2, 128, g=g, grad=True)
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    loss = (out.float() * dout.float()).sum() + (lse * dlse).sum()
    got = torch.autograd.grad(loss, (q, k, v))
    ref = ref_grads(q, k, v, dout, dlse, causal=True, upcast=True)
    base = ref_grads(q, k, v, dout, dlse, causal=True, upcast=False)
    for name, a, r, bl in zip(("dq", "dk", "dv"), got, ref, base):
        assert_fa4_close(name + " (with dlse)", a, r, bl, atol=grad_atol(ref))


def test_deterministic_backward_is_bitwise_reproducible():
    g = torch.Generator(device="cuda").manual_seed(13)
    q = rand(2, 1000, 8, 128, g=g, grad=True)
    k, v = rand(2, 1200, 2, 128, g=g, grad=True), rand(2, 1200, 2, 128, g=g, grad=True)
    dout = rand(2, 1000, 8, 128, g=g)
    runs = [torch.autograd.grad(fa4.flash_attn_func(q, k, v, causal=True, deterministic=True), (q, k, v), dout)
            for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_eager_fast_path_matches_the_custom_op_bitwise(varlen):
    """The eager fast path (fa4._ops.attention: a plain autograd.Function) and the custom op run
    the same kernels: out, lse and every gradient (incl. the lse gradient) agree bitwise."""
    from fa4 import _ops

    g = torch.Generator(device="cuda").manual_seed(11)
    if varlen:
        shape_q, shape_k = (300, 8, 128), (420, 2, 128)
        cu_q = torch.tensor([0, 0, 113, 300], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 50, 203, 420], dtype=torch.int32, device="cuda")
        extra = (cu_q, cu_k, None, 187, 217)
    else:
        shape_q, shape_k, extra = (2, 239, 8, 128), (2, 401, 2, 128), ()
    leaves = [rand(*s, g=g) for s in (shape_q, shape_k, shape_k)]
    dout = rand(*shape_q, g=g)
    lse_shape = (8, 300) if varlen else (2, 8, 239)
    dlse = torch.randn(lse_shape, device="cuda", generator=g)
    results = []
    for fast in (True, False):
        q, k, v = (t.detach().clone().requires_grad_(True) for t in leaves)
        args = (q, k, v, *extra, 0.1, True, True, True)  # scale, causal, deterministic, return_lse
        if fast:
            fn = _ops.varlen_attention if varlen else _ops.attention
            assert _ops.eager_ok(q, k, v)
        else:
            fn = _ops.varlen_fwd if varlen else _ops.fwd
        out, lse = fn(*args)
        torch.autograd.backward((out, lse), (dout, dlse))
        results.append((out, lse, q.grad, k.grad, v.grad))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.equal(a, b), name
    assert torch.isfinite(results[0][2]).all()


# ----------------------------------------------------------------------- torch.compile and CUDA graphs
def test_torch_compile_fullgraph_on_gpu():
    def f(q, k, v):
        out, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out * 2, lse + 1

    g = torch.Generator(device="cuda").manual_seed(14)
    q, k, v = rand(2, 384, 8, 128, g=g), rand(2, 384, 2, 128, g=g), rand(2, 384, 2, 128, g=g)
    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True)  # inductor: the fa4 op stays one opaque node
    o1, l1 = cf(q, k, v)
    o2, l2 = f(q, k, v)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)  # same kernel, exact elementwise ops
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    w = rand(2, 384, 8, 128, g=g).float()

    def train(q, k, v):  # linear in out: dout = w in bf16 exactly, whoever computes it
        return (fa4.flash_attn_func(q, k, v, causal=True, deterministic=True).float() * w).sum()

    ct = torch.compile(train, fullgraph=True)
    ct(qg, kg, vg).backward()
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    train(q2, k2, v2).backward()  # eager, deterministic: the compiled gradients must be identical
    for a, b in ((qg.grad, q2.grad), (kg.grad, k2.grad), (vg.grad, v2.grad)):
        assert torch.equal(a, b)
    torch._dynamo.reset()


def test_variants_under_torch_compile_and_cuda_graphs():
    """Window + softcap + a learnable sink (and seqused_q / padded varlen / a padded head dim) through
    torch.compile(fullgraph=True), forward and backward, bitwise equal to eager (deterministic); then
    the same forward captured in a CUDA graph and replayed on fresh inputs."""
    g = torch.Generator(device="cuda").manual_seed(41)
    q, k, v = rand(2, 300, 8, 80, g=g), rand(2, 400, 2, 80, g=g), rand(2, 400, 2, 80, g=g)
    sink = torch.randn(8, device="cuda", generator=g)
    used_q = torch.tensor([300, 123], dtype=torch.int32, device="cuda")
    w = rand(2, 300, 8, 80, g=g).float()
    kw = dict(causal=True, window_size=(96, None), softcap=20.0, deterministic=True)

    def loss(q, k, v, sink):
        out, lse = fa4.flash_attn_func(q, k, v, learnable_sink=sink, return_lse=True, **kw)
        out2 = fa4.flash_attn_varlen_func(q, k, v, seqused_q=used_q, **kw)
        return (out.float() * w).sum() + (out2.float() * w).sum() + lse.sum()

    torch._dynamo.reset()
    grads = []
    for fn in (torch.compile(loss, fullgraph=True), loss):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sink)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for name, a, b in zip(("dq", "dk", "dv", "dsink"), *grads):
        assert torch.equal(a, b), name
    torch._dynamo.reset()

    static = [t.clone() for t in (q, k, v)]
    fa4.flash_attn_func(*static, learnable_sink=sink, **kw)  # warm-up: compiled already, but be explicit
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fa4.flash_attn_func(*static, learnable_sink=sink, **kw)
    fresh = [rand(*t.shape, g=g) for t in static]
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, fa4.flash_attn_func(*fresh, learnable_sink=sink, **kw))


def test_cuda_graph_capture_and_replay():
    g = torch.Generator(device="cuda").manual_seed(15)
    sq, sk = 300, 500
    static = [rand(2, sq, 8, 128, g=g), rand(2, sk, 2, 128, g=g), rand(2, sk, 2, 128, g=g)]
    # warm-up on a side stream (compiles the kernel; compilation is not capturable)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fa4.flash_attn_func(*static, causal=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out, static_lse = fa4.flash_attn_func(*static, causal=True, return_lse=True)
    for trial in range(3):
        fresh = [rand(*t.shape, g=g) for t in static]
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        out, lse = fa4.flash_attn_func(*fresh, causal=True, return_lse=True)
        assert torch.equal(static_out, out) and torch.equal(static_lse, lse), f"replay {trial} differs from eager"


# --------------------------------------------------------------------------------------------- varlen
def _varlen_problem(lens_q, lens_k, hq=8, hkv=2, d=128, seed=16, grad=False):
    def cu(lens):
        return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = rand(sum(lens_q), hq, d, g=g, grad=grad)
    k, v = rand(sum(lens_k), hkv, d, g=g, grad=grad), rand(sum(lens_k), hkv, d, g=g, grad=grad)
    return q, k, v, cu(lens_q), cu(lens_k)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_varlen_forward_and_backward_never_synchronize(deterministic):
    """A packed varlen forward + backward reads none of cu_seqlens / seqused_k's values on the host:
    no device sync, which a training step would pay on every layer and CUDA-graph capture forbids
    (torch's sync debug mode raises on one). The gradients are those of the same call outside it."""
    q, k, v, cu_q, cu_k = _varlen_problem([100, 0, 37], [120, 5, 37], grad=True)
    used = torch.tensor([120, 0, 30], dtype=torch.int32, device="cuda")
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=100, max_seqlen_k=120, seqused_k=used,
              causal=True, deterministic=deterministic)
    dout = rand(*q.shape)

    def grads():
        for t in (q, k, v):
            t.grad = None
        fa4.flash_attn_varlen_func(q, k, v, **kw).backward(dout)
        return [t.grad.clone() for t in (q, k, v)]

    want = grads()  # compiles outside the checked window
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = grads()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        if deterministic:
            assert torch.equal(a, b), name
        else:  # dq's fp32 atomics add in another order: at most a bf16 rounding step apart
            assert (a.float() - b.float()).abs().max() <= 1e-2 * b.float().abs().max() + 1e-3, name


def test_stage4_varlen_backward_checks_values_on_request():
    """check_values=True reads the offsets on the host and refuses bad ones, before any launch."""
    from stage4_bwd_kernel import hopper as bwd

    q, k, v, cu_q, cu_k = _varlen_problem([10, 20], [10, 20])
    out, lse = torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0], device="cuda")
    bad = torch.tensor([0, 25, 20], dtype=torch.int32, device="cuda")           # falls after 25
    with pytest.raises(ValueError, match="max_seqlen_q: expected an int >= the longest sequence"):
        bwd.attention_varlen_backward(q, k, v, out, out, lse, cu_q, cu_k, 10, 20, check_values=True)
    with pytest.raises(ValueError, match="cu_seqlens_k: expected non-decreasing"):
        bwd.attention_varlen_backward(q, k, v, out, out, lse, cu_q, bad, 20, 25, check_values=True)
    with pytest.raises(ValueError, match="seqused_k: expected 0 <= seqused_k"):
        bwd.attention_varlen_backward(q, k, v, out, out, lse, cu_q, cu_k, 20, 20, check_values=True,
                                      seqused_k=torch.tensor([11, 3], dtype=torch.int32, device="cuda"))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_matches_reference(causal):
    from stage0_reference.torch_reference import assert_fa4_close, attention_varlen_ref

    lens_q, lens_k = [1, 0, 130, 513, 77], [5, 9, 130, 300, 0]  # empty sequences on both sides
    q, k, v, cu_q, cu_k = _varlen_problem(lens_q, lens_k)
    out, lse = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lens_q),
                                          max_seqlen_k=max(lens_k), causal=causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == (8, q.shape[0])
    ref_o, ref_l = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, upcast=True)
    base_o, base_l = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, upcast=False)
    assert_fa4_close("varlen out", out, ref_o, base_o)
    assert_fa4_close("varlen lse", lse, ref_l, base_l)


def test_varlen_seqused_k():
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref

    lens_q, lens_k, used = [64, 200, 33], [100, 256, 40], [100, 17, 0]
    q, k, v, cu_q, cu_k = _varlen_problem(lens_q, lens_k, seed=17)
    seqused = torch.tensor(used, dtype=torch.int32, device="cuda")
    out = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=200, max_seqlen_k=256,
                                     causal=True, seqused_k=seqused)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for b in range(3):  # reference: each sequence against its first `used[b]` keys
        qs, ks, vs = q[None, cq[b]:cq[b + 1]], k[None, ck[b]:ck[b] + used[b]], v[None, ck[b]:ck[b] + used[b]]
        ref = attention_ref(qs, ks, vs, causal=True)[0][0]
        base = attention_ref(qs, ks, vs, causal=True, upcast=False)[0][0]
        assert_fa4_close(f"seqused_k seq {b}", out[cq[b]:cq[b + 1]], ref, base)


def test_varlen_backward_matches_reference():
    from stage0_reference.torch_reference import assert_fa4_close, attention_varlen_ref, grad_atol

    q, k, v, cu_q, cu_k = _varlen_problem([100, 37, 250], [120, 37, 200], grad=True, seed=18)
    out = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=250, max_seqlen_k=200,
                                     causal=True)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)

    def grads(upcast):
        qs, ks, vs = (t.detach().clone().float().requires_grad_() if upcast else t.detach().clone().requires_grad_()
                      for t in (q, k, v))
        o, _ = attention_varlen_ref(qs, ks, vs, cu_q, cu_k, causal=True, upcast=upcast)
        return torch.autograd.grad((o.float() * dout.float()).sum(), (qs, ks, vs))

    ref = grads(True)
    for name, a, r, bl in zip(("dq", "dk", "dv"), got, ref, grads(False)):
        assert_fa4_close("varlen " + name, a, r, bl, atol=grad_atol(ref))


def test_fa4_validate_catches_bad_cu_seqlens(monkeypatch):
    q, k, v, cu_q, cu_k = _varlen_problem([10, 20], [10, 20])
    bad = torch.tensor([0, 25, 30], dtype=torch.int32, device="cuda")  # first sequence 25 > max_seqlen_q
    monkeypatch.setenv("FA4_VALIDATE", "1")
    with pytest.raises(ValueError, match=r"^max_seqlen_q: 20 is smaller than the longest sequence \(25\)"):
        fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=bad, cu_seqlens_k=cu_k, max_seqlen_q=20, max_seqlen_k=20)
    with pytest.raises(ValueError, match=r"^cu_seqlens_k: must be non-decreasing"):
        fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, max_seqlen_q=20, max_seqlen_k=20,
                                   cu_seqlens_k=torch.tensor([0, 20, 10], dtype=torch.int32, device="cuda"))


def test_varlen_empty_batch():
    z = lambda *s: torch.zeros(*s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    cu = torch.zeros(1, dtype=torch.int32, device="cuda")
    out, lse = fa4.flash_attn_varlen_func(z(0, 4, 64), z(0, 2, 64), z(0, 2, 64), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                          max_seqlen_q=0, max_seqlen_k=0, return_lse=True)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)


# ----------------------------------------------------------------------------------------- SDPA helper
def plain_sdpa(q, k, v):
    """A plain PyTorch top-left-causal GQA attention in the input precision (the rule's baseline)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)                      # (B, H, Sq, Sk) in q's dtype
    visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1).to(v.dtype) @ v


@pytest.mark.parametrize("sq,sk", [(300, 300), (200, 450), (450, 200)])
def test_sdpa_helper_matches_torch_sdpa(sq, sk):
    """Top-left causal (SDPA's meaning) for Sq != Sk, GQA via enable_gqa; FA4 rule against fp32 torch
    SDPA, relative to a plain bf16 implementation."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from stage0_reference.torch_reference import assert_fa4_close

    g = torch.Generator(device="cuda").manual_seed(sq + sk)
    q, k, v = rand(2, 8, sq, 128, g=g), rand(2, 2, sk, 128, g=g), rand(2, 2, sk, 128, g=g)
    out = fa4.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = sdpa(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
    assert out.shape == (2, 8, sq, 128)
    assert_fa4_close("sdpa helper", out, ref, plain_sdpa(q, k, v))


# -------------------------------------------------------------------------------------- compile cache
_FIRST_CALL = r"""
import json, time, torch
import fa4
from fa4 import _cache
from stage0_reference.torch_reference import attention_ref
torch.manual_seed(0)
q, k, v = (torch.randn(1, 256, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
torch.cuda.synchronize()

def step():
    t0 = time.perf_counter()
    out = fa4.flash_attn_func(q, k, v, causal=True, deterministic=True)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    out.float().sum().backward()
    torch.cuda.synchronize()
    return out, t1 - t0, time.perf_counter() - t1

out, fwd_s, bwd_s = step()
dq = q.grad.clone()
_, fwd2_s, bwd2_s = step()
err = (out.float() - attention_ref(q.detach(), k.detach(), v.detach(), causal=True)[0].float()).abs().max().item()
print("RESULT " + json.dumps({"first_fwd_s": fwd_s, "first_bwd_s": bwd_s, "second_fwd_s": fwd2_s,
                              "second_bwd_s": bwd2_s, "max_err": err, "dq_sum": dq.float().sum().item(),
                              "stats": _cache.stats(), "files": len(list(_cache.cache_dir().glob("*.o")))}))
"""


def _cache_env(cache_dir):
    """A subprocess environment with the disk cache on, in cache_dir, and this checkout importable;
    launch plans off (these tests count the kernel objects' disk hits, which a replayed call skips:
    tests/test_fa4_plans_gpu.py covers the plans)."""
    env = dict(os.environ, FA4_CACHE_DIR=str(cache_dir), FA4_PLANS="0", PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("FA4_CACHE", None)
    return env


def _first_call(env, deterministic=True):
    script = _FIRST_CALL if deterministic else _FIRST_CALL.replace("deterministic=True", "deterministic=False")
    res = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_compile_cache_second_process_reuses(tmp_path):
    """Two fresh processes run one training step (bf16 d128 causal, deterministic): the first
    compiles and writes the forward and backward kernels, the second loads them from disk."""
    env = _cache_env(tmp_path)
    cold = _first_call(env)
    warm = _first_call(env)
    print(f"\nfirst-call latency, bf16 d128 causal: forward cold {cold['first_fwd_s']:.2f} s -> warm "
          f"{warm['first_fwd_s']:.3f} s; backward cold {cold['first_bwd_s']:.2f} s -> warm {warm['first_bwd_s']:.3f} s"
          f"\n(steady state: forward {warm['second_fwd_s'] * 1e3:.2f} ms, "
          f"backward {warm['second_bwd_s'] * 1e3:.2f} ms; "
          f"{cold['files']} kernels cached in {tmp_path})")
    assert cold["stats"]["misses"] >= 1 and cold["stats"]["stores"] >= 1 and cold["files"] >= 1, cold
    assert warm["stats"]["disk_hits"] >= 1 and warm["stats"]["misses"] == 0, warm
    assert warm["max_err"] == cold["max_err"] and warm["dq_sum"] == cold["dq_sum"], \
        "the reloaded kernels compute something else"
    assert warm["first_fwd_s"] + warm["first_bwd_s"] < cold["first_fwd_s"] + cold["first_bwd_s"], (cold, warm)
    # corrupted entries: rebuilt, not fatal
    for p in tmp_path.rglob("*.o"):
        p.write_bytes(p.read_bytes()[:100])
    again = _first_call(env)
    assert again["stats"]["corrupt"] >= 1 and again["stats"]["misses"] >= 1
    assert again["max_err"] == cold["max_err"] and again["dq_sum"] == cold["dq_sum"]


_LONG_CAUSAL_CALL = r"""
import json, torch
import fa4
from fa4 import _cache, _dispatch
from stage0_reference.torch_reference import attention_ref
g = torch.Generator(device="cuda").manual_seed(11)
q = torch.randn(1, 4224, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g)
k, v = (torch.randn(1, 4224, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
out = fa4.flash_attn_func(q, k, v, causal=True)
torch.cuda.synchronize()
err = (out.float() - attention_ref(q, k, v, causal=True)[0].float()).abs().max().item()
lpt = _dispatch.causal_forward_scheduler("sm_90", True, 4224, 64, 64, 4, 2) is not None
print("RESULT " + json.dumps({"max_err": err, "lpt": lpt, "stats": _cache.stats()}))
"""


def test_precompile_heads_serves_a_long_causal_forward(tmp_path):
    """`precompile --heads 4/2` without a GPU builds the LPT-ordered kernel that a causal call with 4224
    keys and GQA 4/2 launches: a GPU process then runs that call without compiling anything."""
    env = _cache_env(tmp_path)
    cpu = subprocess.run([sys.executable, "-m", "fa4", "precompile", "--head-dims", "64", "--causal", "yes",
                          "--no-backward", "--heads", "4/2", "--max-seqlen", "8192"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(env, CUDA_VISIBLE_DEVICES=""))
    assert cpu.returncode == 0 and "fwd lpt bf16 d=64 causal" in cpu.stdout, cpu.stdout + cpu.stderr
    res = subprocess.run([sys.executable, "-c", _LONG_CAUSAL_CALL], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    got = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
    assert got["lpt"] and got["stats"]["misses"] == 0 and got["stats"]["disk_hits"] >= 1, got
    assert got["max_err"] < 0.05, got  # bf16 out, d = 64; FA4's rule on this path: test_long_causal_forward_in_lpt_order


def test_cache_filled_without_a_gpu_serves_the_gpu(tmp_path):
    """`python -m fa4 precompile` in a process that sees no GPU builds the launchable kernels with fake
    tensors into the disk cache; a GPU process then loads every kernel of a training step (bf16 d128
    causal) without compiling, and computes what a compiling process computes."""
    env = _cache_env(tmp_path)
    cpu = subprocess.run([sys.executable, "-m", "fa4", "precompile", "--head-dims", "128", "--causal", "yes"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(env, CUDA_VISIBLE_DEVICES=""))
    assert cpu.returncode == 0 and "no GPU: compiling for sm_90a" in cpu.stdout, cpu.stdout + cpu.stderr
    assert cpu.stdout.count("written to disk") == 3, cpu.stdout
    loaded = _first_call(env, deterministic=False)
    compiled = _first_call(dict(env, FA4_CACHE="0"), deterministic=False)
    print(f"\nfirst call from a CPU-built cache: forward {loaded['first_fwd_s']:.3f} s, backward "
          f"{loaded['first_bwd_s']:.3f} s; compiling: {compiled['first_fwd_s']:.2f} s, {compiled['first_bwd_s']:.2f} s")
    assert loaded["stats"]["misses"] == 0 and loaded["stats"]["disk_hits"] >= 4, loaded  # fwd, pre, main, post
    assert compiled["stats"]["misses"] >= 4, compiled
    # the forward is bitwise reproducible; dq's atomic-order bits are not (deterministic=False)
    assert loaded["max_err"] == compiled["max_err"]
    assert abs(loaded["dq_sum"] - compiled["dq_sum"]) <= 1e-3 * max(1.0, abs(compiled["dq_sum"]))
