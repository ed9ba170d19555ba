"""fa4, the production package: everything that can be checked without a GPU.

cpu tier: every validation error names its argument; supported() and the kernels' head-dim tables agree;
dispatch by capability and its errors (CPU, unknown GPUs, a kernel that fails to import); the
lse-gradient algebra against the float64 oracle; the custom ops' fake (meta) implementations,
opcheck, and torch.compile(fullgraph=True) tracing with no graph break; the autograd wiring with a
reference kernel registered for CPU; the SDPA helper's top-left causal decomposition against torch
SDPA; the transformers registration when transformers is here. The compile cache and the command
line: tests/test_fa4_cache_cli.py.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import types
import warnings

import numpy as np
import dataclasses

import pytest
import torch

import fa4
from fa4 import _dispatch, _ops, _validate

ROOT = pathlib.Path(__file__).resolve().parents[1]
BF16 = torch.bfloat16


def meta(*shape, dtype=BF16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def qkv_meta(b=2, sq=64, sk=80, hq=8, hkv=2, d=128, dv=None, dtype=BF16):
    return meta(b, sq, hq, d, dtype=dtype), meta(b, sk, hkv, d, dtype=dtype), meta(b, sk, hkv, dv or d, dtype=dtype)


def run_cli(*args, env=None, timeout=300, cwd=ROOT):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "fa4", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=e)


# ================================================================================ validation
def _fixed_cases():
    q, k, v = qkv_meta()
    cpu = torch.zeros(2, 64, 8, 128, dtype=BF16)
    return [
        ("not-a-tensor", dict(q=np.zeros((2, 64, 8, 128))), TypeError, r"^q: expected a torch.Tensor"),
        ("q-float32", dict(q=meta(2, 64, 8, 128, dtype=torch.float32)), TypeError, r"^q: dtype torch.float32"),
        ("k-dtype", dict(k=meta(2, 80, 2, 128, dtype=torch.float16)), TypeError, r"^k: dtype torch.float16 differs"),
        ("cpu", dict(q=cpu, k=cpu, v=cpu), ValueError, r"^q: fa4 runs on CUDA GPUs only.*sm_90"),
        ("k-device", dict(k=torch.zeros(2, 80, 2, 128, dtype=BF16)), ValueError, r"^k: is on cpu but q is on meta"),
        ("q-rank", dict(q=meta(64, 8, 128)), ValueError, r"^q: expected rank 4"),
        ("v-rank", dict(v=meta(2, 80, 256)), ValueError, r"^v: expected rank 4"),
        ("k-batch", dict(k=meta(3, 80, 2, 128), v=meta(3, 80, 2, 128)), ValueError, r"^k: batch 3"),
        ("k-head-dim", dict(k=meta(2, 80, 2, 64)), ValueError, r"^k: head_dim 64 differs"),
        ("v-shape", dict(v=meta(2, 81, 2, 128)), ValueError, r"^v: shape"),
        ("k-heads", dict(k=meta(2, 80, 3, 128), v=meta(2, 80, 3, 128)), ValueError, r"^k: heads_kv \(3\) must divide"),
        ("q-head-dim", dict(q=meta(2, 64, 8, 84), k=meta(2, 80, 2, 84), v=meta(2, 80, 2, 84)), ValueError,
         r"^q: head_dim 84 is not supported; fa4 takes head dims that are multiples of 8 up to 256"),
        ("v-head-dim", dict(v=meta(2, 80, 2, 264)), ValueError, r"^v: head_dim 264 is not supported"),
        ("scale-type", dict(softmax_scale="0.1"), TypeError, r"^softmax_scale: expected a float"),
        ("scale-bool", dict(softmax_scale=True), TypeError, r"^softmax_scale:"),
        ("scale-inf", dict(softmax_scale=math.inf), ValueError, r"^softmax_scale: must be finite"),
        ("scale-zero", dict(softmax_scale=0.0), ValueError, r"^softmax_scale: must be finite and >= 2\*\*-100"),
        ("scale-tiny", dict(softmax_scale=1e-35), ValueError, r"^softmax_scale: must be finite and >= 2\*\*-100"),
        ("scale-huge", dict(softmax_scale=1e39), ValueError, r"^softmax_scale: must be .*<= 2\*\*100"),
        ("scale-overflow", dict(softmax_scale=10 ** 400), ValueError, r"^softmax_scale: must be .*<= 2\*\*100"),
        ("softcap-huge", dict(softcap=1e39), ValueError, r"^softcap: must be finite and >= 0 and <= 2\*\*100"),
        ("causal", dict(causal=1), TypeError, r"^causal: expected a bool"),
        ("deterministic", dict(deterministic="no"), TypeError, r"^deterministic: expected a bool"),
        ("return_lse", dict(return_lse=None), TypeError, r"^return_lse: expected a bool"),
    ]


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("case", _fixed_cases(), ids=lambda c: c[0])
def test_flash_attn_func_validation(case):
    _, override, exc, pattern = case
    q, k, v = qkv_meta()
    kw = dict(q=q, k=k, v=v)
    kw.update(override)
    with pytest.raises(exc, match=pattern):
        fa4.flash_attn_func(**kw)


def _varlen_kwargs(**override):
    kw = dict(q=meta(100, 8, 128), k=meta(120, 2, 128), v=meta(120, 2, 128),
              cu_seqlens_q=torch.zeros(4, dtype=torch.int32, device="meta"),
              cu_seqlens_k=torch.zeros(4, dtype=torch.int32, device="meta"), max_seqlen_q=50, max_seqlen_k=60)
    kw.update(override)
    return kw


def _i32(*shape, device="meta", dtype=torch.int32):
    return torch.zeros(*shape, dtype=dtype, device=device)


VARLEN_CASES = [
    ("q-rank", dict(q=meta(1, 100, 8, 128)), ValueError, r"^q: expected rank 3"),
    ("k-head-dim", dict(k=meta(120, 2, 64)), ValueError, r"^k: head_dim 64 differs"),
    ("v-shape", dict(v=meta(121, 2, 128)), ValueError, r"^v: shape"),
    ("cu-q-type", dict(cu_seqlens_q=[0, 10]), TypeError, r"^cu_seqlens_q: expected a torch.Tensor"),
    ("cu-q-dtype", dict(cu_seqlens_q=_i32(4, dtype=torch.int64)), TypeError,
     r"^cu_seqlens_q: dtype must be torch.int32"),
    ("cu-q-rank", dict(cu_seqlens_q=_i32(2, 2)), ValueError, r"^cu_seqlens_q: must be 1-D"),
    ("cu-q-empty", dict(cu_seqlens_q=_i32(0), cu_seqlens_k=_i32(0)), ValueError, r"^cu_seqlens_q: needs at least one"),
    ("cu-k-length", dict(cu_seqlens_k=_i32(5)), ValueError,
     r"^cu_seqlens_k: 4 sequences \(cu_seqlens_k's 5 entries\) but q describes 3 \(cu_seqlens_q's 4 entries\)"),
    ("cu-k-device", dict(cu_seqlens_k=_i32(4, device="cpu")), ValueError, r"^cu_seqlens_k: is on cpu but q is on meta"),
    ("seqused-length", dict(seqused_k=_i32(4)), ValueError, r"^seqused_k: length 4 != batch = 3"),
    ("seqused-dtype", dict(seqused_k=_i32(3, dtype=torch.int64)), TypeError, r"^seqused_k: dtype"),
    ("max-q-type", dict(max_seqlen_q=50.0), TypeError, r"^max_seqlen_q: expected an int"),
    ("max-k-negative", dict(max_seqlen_k=-1), ValueError, r"^max_seqlen_k: must be >= 0"),
    ("causal", dict(causal="yes"), TypeError, r"^causal: expected a bool"),
    # padded sides whose rows are all used (no seqused_*): a max_seqlen below the seqlen leaves rows out
    ("padded-max-q", dict(q=meta(2, 50, 8, 128), k=meta(2, 60, 2, 128), v=meta(2, 60, 2, 128), cu_seqlens_q=None,
                          cu_seqlens_k=None, max_seqlen_q=10), ValueError, r"^max_seqlen_q: 10 is below"),
    ("padded-max-k", dict(q=meta(2, 50, 8, 128), k=meta(2, 60, 2, 128), v=meta(2, 60, 2, 128), cu_seqlens_q=None,
                          cu_seqlens_k=None, max_seqlen_k=10), ValueError, r"^max_seqlen_k: 10 is below"),
    # a paged k / v: page size 0, a list for cu_seqlens_q, a bad max_seqlen_k on the in-place route too
    ("page-size-0", dict(k=meta(16, 0, 2, 128), v=meta(16, 0, 2, 128), cu_seqlens_k=None, page_table=_i32(3, 4)),
     ValueError, r"^k: a paged cache's page_size"),
    ("paged-cu-q-list", dict(k=meta(16, 64, 2, 128), v=meta(16, 64, 2, 128), cu_seqlens_k=None,
                             page_table=_i32(3, 4), cu_seqlens_q=[0, 50, 100]), TypeError,
     r"^cu_seqlens_q: expected a torch.Tensor"),
    ("paged-max-k-type", dict(k=meta(16, 64, 2, 128), v=meta(16, 64, 2, 128), cu_seqlens_k=None,
                              page_table=_i32(3, 4), max_seqlen_k="x"), TypeError, r"^max_seqlen_k: expected an int"),
]


@pytest.mark.cpu
@pytest.mark.fa4
def test_padded_sides_with_seqused_may_pass_a_smaller_max_seqlen():
    """With seqused_q / seqused_k the sequences may be shorter than the padding: no refusal."""
    out = fa4.flash_attn_varlen_func(meta(2, 50, 8, 128), meta(2, 60, 2, 128), meta(2, 60, 2, 128), max_seqlen_q=10,
                                     max_seqlen_k=20, seqused_q=_i32(2), seqused_k=_i32(2))
    assert tuple(out.shape) == (2, 50, 8, 128)


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: c[0])
def test_flash_attn_varlen_func_validation(case):
    _, override, exc, pattern = case
    with pytest.raises(exc, match=pattern):
        fa4.flash_attn_varlen_func(**_varlen_kwargs(**override))


VALUE_CASES = [
    ("start", [1, 5, 10], [0, 5, 10], 10, 10, 5, 5, None, r"^cu_seqlens_q: must start at 0"),
    ("monotonic", [0, 6, 5, 10], [0, 3, 6, 10], 10, 10, 6, 4, None, r"^cu_seqlens_q: must be non-decreasing"),
    ("total", [0, 5, 10], [0, 5, 9], 10, 10, 5, 5, None, r"^cu_seqlens_k: last value 9 must equal .* 10"),
    ("max-q", [0, 2, 10], [0, 5, 10], 10, 10, 5, 5, None,
     r"^max_seqlen_q: 5 is smaller than the longest sequence \(8\)"),
    ("seqused", [0, 5, 10], [0, 5, 10], 10, 10, 5, 5, [5, 6], r"^seqused_k: entry 1 = 6 is outside"),
]


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("case", VALUE_CASES, ids=lambda c: c[0])
def test_varlen_value_checks(case):
    _, cq, ck, tq, tk, mq, mk, used, pattern = case
    t = lambda x: None if x is None else torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match=pattern):
        _validate.check_varlen_values(t(cq), t(ck), tq, tk, mq, mk, t(used))
    # consistent values pass
    _validate.check_varlen_values(t([0, 5, 10]), t([0, 5, 10]), 10, 10, 5, 5, t([5, 0]))


@pytest.mark.cpu
@pytest.mark.fa4
def test_value_checks_are_opt_in(monkeypatch):
    """FA4_VALIDATE gates the checks that sync (see fa4/_validate.py for the trade-off)."""
    monkeypatch.delenv("FA4_VALIDATE", raising=False)
    assert not _validate.values_check_enabled()
    monkeypatch.setenv("FA4_VALIDATE", "0")
    assert not _validate.values_check_enabled()
    monkeypatch.setenv("FA4_VALIDATE", "1")
    assert _validate.values_check_enabled()


@pytest.mark.cpu
@pytest.mark.fa4
def test_last_dim_made_contiguous_not_refused():
    q, k, v = qkv_meta()
    qt = meta(2, 64, 128, 8).transpose(-1, -2)  # (2, 64, 8, 128) with stride(-1) = 8
    assert qt.stride(-1) != 1
    q2, _, _, scale = _validate.check_fixed(qt, k, v, None, False)
    assert q2.stride(-1) == 1 and q2.shape == qt.shape and scale == pytest.approx(1 / math.sqrt(128))
    assert fa4.flash_attn_func(qt, k, v).shape == (2, 64, 8, 128)


# ================================================================================ SDPA helper
SDPA_CASES = [
    ("attn_mask", dict(attn_mask=meta(64, 64, dtype=torch.bool)), ValueError, r"^attn_mask: fa4 does not support"),
    ("dropout", dict(dropout_p=0.1), ValueError, r"^dropout_p: fa4 does not support attention dropout"),
    ("is_causal", dict(is_causal=1), TypeError, r"^is_causal: expected a bool"),
    ("enable_gqa", dict(key=meta(2, 2, 64, 128), value=meta(2, 2, 64, 128)), ValueError,
     r"^enable_gqa: query has 8 heads"),
    ("query-rank", dict(query=meta(8, 64, 128)), ValueError, r"^query: expected rank 4 \(batch, heads, seqlen"),
    ("query-dtype", dict(query=meta(2, 8, 64, 128, dtype=torch.float32)), TypeError, r"^query: dtype torch.float32"),
    ("key-head-dim", dict(key=meta(2, 8, 64, 64)), ValueError, r"^key: head_dim 64 differs"),
    ("scale", dict(scale="x"), TypeError, r"^scale: expected a float"),
    ("scale-negative", dict(scale=-0.1), ValueError, r"^scale: must be finite and >= 2\*\*-100"),
]


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: c[0])
def test_sdpa_helper_argument_checks(case):
    _, override, exc, pattern = case
    kw = dict(query=meta(2, 8, 64, 128), key=meta(2, 8, 64, 128), value=meta(2, 8, 64, 128))
    kw.update(override)
    with pytest.raises(exc, match=pattern):
        fa4.scaled_dot_product_attention(**kw)


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("sq,sk", [(64, 64), (40, 100), (100, 40)])
def test_sdpa_helper_shapes(sq, sk):
    out = fa4.scaled_dot_product_attention(meta(2, 8, sq, 192), meta(2, 2, sk, 192), meta(2, 2, sk, 128),
                                           is_causal=True, enable_gqa=True)
    assert out.shape == (2, 8, sq, 128) and out.dtype == BF16


def _bottom_right_reference(q, k, v, softmax_scale=None, causal=False):
    """A float64 stand-in for the kernel: bottom-right causal, (B, S, H, D)."""
    from stage0_reference.torch_reference import attention_ref

    return attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal)[0]


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("sq,sk", [(37, 37), (20, 53), (53, 20), (1, 9), (9, 1)])
def test_sdpa_helper_is_top_left_like_torch_sdpa(monkeypatch, sq, sk):
    """With a bottom-right kernel underneath, fa4.scaled_dot_product_attention must reproduce
    torch SDPA's top-left is_causal exactly, for Sq < Sk and Sq > Sk alike."""
    import fa4._api as api

    def no_checks(q, k, v, scale, causal, names=None, scale_name=None):  # float64 CPU tensors pass through
        return q, k, v, scale or 1 / math.sqrt(q.shape[-1])

    monkeypatch.setattr(api, "check_fixed", no_checks)
    monkeypatch.setattr(api, "flash_attn_func", _bottom_right_reference)
    g = torch.Generator().manual_seed(sq * 100 + sk)
    q = torch.randn(2, 4, sq, 16, dtype=torch.float64, generator=g)
    k = torch.randn(2, 2, sk, 16, dtype=torch.float64, generator=g)
    v = torch.randn(2, 2, sk, 16, dtype=torch.float64, generator=g)
    ours = fa4.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


# ================================================================================ supported() / dispatch
@pytest.mark.cpu
@pytest.mark.fa4
def test_supported_report():
    rep = fa4.supported()
    json.dumps(rep)  # plain data
    assert set(rep["archs"]) == {"sm_90", "sm_100"}
    assert rep["dtypes"] == ["float16", "bfloat16"]
    h = rep["archs"]["sm_90"]
    assert [64, 64] in h["head_dims"] and [192, 128] in h["head_dims"] and [256, 256] in h["head_dims"]
    assert h["hardware"] == "verified" and rep["archs"]["sm_100"]["hardware"] == "unverified"
    assert h["forward"] == h["varlen_forward"] == _dispatch.ARCHS["sm_90"].forward_module == "stage3_fwd_kernel.hopper"
    assert h["backward"] == "stage4_bwd_kernel.hopper"
    assert rep["features"]["attn_mask"]["supported"] is False and rep["features"]["varlen"]["supported"] is True


@pytest.mark.cpu
@pytest.mark.fa4
def test_head_dim_tables_match_the_kernels():
    """fa4 copies the kernels' head-dim lists (to read them without importing cutlass): keep them equal."""
    from stage3_fwd_kernel import blackwell_config, hopper
    from stage4_bwd_kernel import common as bwd_common

    for mod, arch in ((hopper, "sm_90"), (bwd_common, "sm_90")):
        assert tuple(map(tuple, mod.SUPPORTED_HEAD_DIMS)) == _dispatch.ARCHS[arch].head_dims, mod.__name__
    # sm_100: two Q tiles a CTA, plus d = 256 on one; the backward serves every forward pair: the 1-CTA
    # kernel up to 128, the wide one (64-query tiles, dQ^T) at (192, 128) and 256, where the 1-CTA plan
    # does not fit TMEM
    sm100 = _dispatch.ARCHS["sm_100"]
    assert blackwell_config.SUPPORTED_HEAD_DIMS + blackwell_config.ONE_Q_TILE_HEAD_DIMS == sm100.head_dims
    from stage4_bwd_kernel import blackwell_config as bwd_config

    assert not sm100.backward_head_dims
    assert bwd_config.SUPPORTED_HEAD_DIMS + bwd_config.SUPPORTED_HEAD_DIMS_WIDE == sm100.head_dims
    for d, dv in bwd_config.SUPPORTED_HEAD_DIMS:
        bwd_config.blackwell_bwd_config(d, dv, "bf16", causal=False)
    for d, dv in bwd_config.SUPPORTED_HEAD_DIMS_WIDE:
        with pytest.raises(ValueError, match="TMEM does not fit"):
            bwd_config.blackwell_bwd_config(d, dv, "bf16", causal=False)
        bwd_config.blackwell_bwd_wide_config(d, dv, "bf16", causal=False)


def _forward_only_wide_arch():
    """sm_100 as it was before its wide backward: (192, 128) and 256 forward only. No arch in ARCHS has
    a forward-only pair now; the refusal is still fa4's contract for one that does."""
    import dataclasses

    return dataclasses.replace(_dispatch.ARCHS["sm_100"], backward_head_dims=((64, 64), (96, 96), (128, 128)))


@pytest.mark.cpu
@pytest.mark.fa4
def test_a_pair_without_a_backward_is_refused_before_the_forward_when_grads_are_needed(monkeypatch):
    from fa4 import _layouts

    assert _dispatch.has_backward(_dispatch.ARCHS["sm_100"], 256, 256)
    monkeypatch.setattr(_layouts, "arch_of", lambda device: _forward_only_wide_arch())
    q = torch.zeros(1, 4, 2, 200, dtype=torch.bfloat16, device="meta", requires_grad=True)
    with pytest.raises(ValueError, match=r"^q: head dims \(qk=200, v=200\) run on sm_100's 256/256 forward, which "
                                         r"has no backward there"):
        _layouts.pad_head_dims(q, q, q)
    with torch.no_grad():
        assert _layouts.pad_head_dims(q, q, q)[0].shape[-1] == 256  # inference: served
    plain = q.detach()
    sink = torch.zeros(2, device="meta", requires_grad=True)  # its gradient needs the backward too
    with pytest.raises(ValueError, match=r"^q: head dims \(qk=200, v=200\) run on sm_100's 256/256 forward"):
        fa4.flash_attn_func(plain, plain, plain, learnable_sink=sink)


@pytest.mark.cpu
@pytest.mark.fa4
def test_a_pair_without_a_backward_is_refused_before_the_backward():
    bw = _dispatch.BlackwellBackend(_forward_only_wide_arch())
    bw._mods["bwd"] = types.SimpleNamespace(attention_backward=lambda *a, **k: pytest.fail("launched"),
                                            attention_varlen_backward=lambda *a, **k: pytest.fail("launched"))
    t = torch.zeros(1, 8, 2, 256)
    with pytest.raises(ValueError, match=r"^q: head dims \(qk=256, v=256\) have a forward but no backward on sm_100"):
        bw.backward(t, t, t, t, t, t, 0.5, False, False)
    with pytest.raises(ValueError, match=r"^q: head dims"):
        bw.varlen_backward(t[0], t[0], t[0], t[0], t[0], t[0], t, t, None, 8, 8, 0.5, False, False)
    # the real sm_100 passes (192, 128) and 256 on to its backward module (the wide kernel)
    calls = []
    real = _dispatch.BlackwellBackend(_dispatch.ARCHS["sm_100"])
    real._mods["bwd"] = types.SimpleNamespace(
        attention_backward=lambda q, k, v, *a, **kw: calls.append(q.shape[-1]) or (q, k, v))
    for d, dv in ((192, 128), (256, 256)):
        q = torch.zeros(1, 8, 2, d)
        real.backward(q, q, torch.zeros(1, 8, 2, dv), torch.zeros(1, 8, 2, dv), torch.zeros(1, 8, 2, dv),
                      torch.zeros(1, 2, 8), 0.5, False, False)
    assert calls == [192, 256]


@pytest.mark.cpu
@pytest.mark.fa4
def test_dispatch_by_capability():
    assert _dispatch.arch_for_capability((9, 0)).key == "sm_90"
    assert _dispatch.arch_for_capability((10, 0)).key == "sm_100"
    for cap in ((8, 0), (8, 9), (10, 3), (12, 0)):
        pattern = rf"^q: fa4 has no kernel for compute capability {cap[0]}\.{cap[1]}.*sm_90"
        with pytest.raises(ValueError, match=pattern):
            _dispatch.arch_for_capability(cap)
    with pytest.raises(_dispatch.UnsupportedDeviceError, match=r"^q: fa4 runs on CUDA GPUs only, got cpu.*sm_100"):
        _dispatch.backend_for(torch.device("cpu"))


def _fake_arch(**kw):
    base = _dispatch.ARCHS["sm_90"]
    fields = {f: getattr(base, f) for f in base.__dataclass_fields__}
    fields.update(cute_arch=os.environ.get("CUTE_DSL_ARCH", "sm_90a"), **kw)
    return _dispatch.ArchInfo(**fields)


@pytest.mark.cpu
@pytest.mark.fa4
def test_backends_name_their_kernel_modules():
    """Dispatch imports each arch's stable modules by name, one Backend subclass per arch."""
    assert isinstance(_dispatch.make_backend(_dispatch.ARCHS["sm_90"]), _dispatch.HopperBackend)
    assert isinstance(_dispatch.make_backend(_dispatch.ARCHS["sm_100"]), _dispatch.BlackwellBackend)
    hopper = _dispatch.HopperBackend(_fake_arch())
    assert hopper.import_forward().__name__ == _dispatch.ARCHS["sm_90"].forward_module
    assert hopper.import_backward().__name__ == _dispatch.ARCHS["sm_90"].backward_module


@pytest.mark.cpu
@pytest.mark.fa4
def test_broken_kernel_module_is_reported(tmp_path, monkeypatch):
    """A kernel module that fails to import is an error naming it, never a silent fallback."""
    (tmp_path / "fa4_test_broken_kernel.py").write_text("import fa4_test_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    class Broken(_dispatch.HopperBackend):
        def import_backward(self):
            import fa4_test_broken_kernel

            return fa4_test_broken_kernel

    be = Broken(_fake_arch())
    with pytest.raises(RuntimeError, match=r"importing stage4_bwd_kernel.hopper \(bwd on sm_90\) failed"):
        be.backward_module()
    assert "bwd" not in be._mods


@pytest.mark.cpu
@pytest.mark.fa4
def test_lpt_forward_schedulers_cover_every_length_with_the_dispatch_choice():
    """`lpt_forward_schedulers` (what `precompile --heads` builds) returns contiguous key ranges from
    LPT_MIN_SEQLEN_K to max_seqlen_k, each with the scheduler the dispatch picks at every length inside
    it, and a new scheduler at each range boundary."""
    long = _dispatch.LPT_MIN_SEQLEN_K
    pick = _dispatch.causal_forward_scheduler
    for d, dv, hq, hkv, top in ((128, 128, 32, 32, 70001), (64, 64, 12, 4, 40000), (192, 128, 16, 2, 20000)):
        ranges = _dispatch.lpt_forward_schedulers("sm_90", d, dv, hq, hkv, top)
        assert ranges[0][0] == long and ranges[-1][1] == top, ranges
        for (_, last, sched), (first, _, nxt) in zip(ranges, ranges[1:]):
            assert first == last + 1 and nxt != sched, ranges
        for first, last, sched in ranges:
            for n in range(first, last + 1, 97):
                assert pick("sm_90", True, n, d, dv, hq, hkv) == sched, (n, ranges)
            assert pick("sm_90", True, last, d, dv, hq, hkv) == sched
    assert len(_dispatch.lpt_forward_schedulers("sm_90", 128, 128, 32, 32, 70001)) >= 3  # 8 -> 4 -> 2 -> 1 heads
    assert _dispatch.lpt_forward_schedulers("sm_90", 128, 128, 32, 32, long - 1) == []
    # sm_100 without an L2 size: the same sections (the dispatch passes the device's L2 there)
    assert _dispatch.lpt_forward_schedulers("sm_100", 128, 128, 32, 32, 70001) == \
        _dispatch.lpt_forward_schedulers("sm_90", 128, 128, 32, 32, 70001)


@pytest.mark.cpu
@pytest.mark.fa4
def test_precompile_heads_argument_parses_and_rejects():
    import argparse

    from fa4 import precompile

    assert precompile.parse_heads("32/8, 16") == [(32, 8), (16, 16)]
    for bad in ("32/5", "0", "x", "8/0", "4/8"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad.strip())):
            precompile.parse_heads(bad)
    res = run_cli("precompile", "--heads", "32/5")
    assert res.returncode == 2 and "argument --heads" in res.stderr and "multiple of HKV" in res.stderr, res.stderr
    res = run_cli("precompile", "--max-seqlen", "8192")
    assert res.returncode == 2 and "--max-seqlen: only meaningful with --heads" in res.stderr, res.stderr
    res = run_cli("precompile", "--heads", "8", "--max-seqlen", "0")
    assert res.returncode == 2 and "argument --max-seqlen" in res.stderr, res.stderr


@pytest.mark.cpu
@pytest.mark.fa4
def test_long_causal_forward_launches_stage5_lpt_order(monkeypatch):
    """Causal dense forwards with >= LPT_MIN_SEQLEN_K keys get stage 5's LPT scheduler on sm_90 (sections
    of whole KV groups sized by the L2 model); shorter, non-causal, other arches: the static grid."""
    from stage5_scheduling.device import GQALPTCausalScheduler, LPTCausalScheduler

    pick = _dispatch.causal_forward_scheduler
    long = _dispatch.LPT_MIN_SEQLEN_K
    assert pick("sm_90", True, long - 1, 128, 128, 16, 16) is None
    assert pick("sm_90", False, 16384, 128, 128, 16, 16) is None
    # 8k x 256 x 2 B = 4 MiB a head; sections over the (batch, head) pairs (FORWARD_LPT_FLAT)
    assert pick("sm_90", True, 8192, 128, 128, 16, 16) == LPTCausalScheduler(4, flat_batches=True)
    gqa = pick("sm_90", True, 4096, 64, 64, 12, 4)
    assert isinstance(gqa, GQALPTCausalScheduler) and gqa.heads_per_section % 3 == 0 and gqa.flat_batches
    gqa.check_problem(12, 4)  # whole groups of 3: no ValueError

    calls = []  # what the backend launches
    mod = types.SimpleNamespace(attention_forward=lambda q, k, v, softmax_scale, causal, scheduler=None:
                                calls.append(scheduler))
    q, k = torch.empty(1, long, 16, 128, device="meta"), torch.empty(1, long, 16, 128, device="meta")
    be = _dispatch.HopperBackend(_dispatch.ARCHS["sm_90"])
    monkeypatch.setattr(be, "forward_module", lambda: mod)
    be.forward(q, k, k, 1.0, causal=True)
    be.forward(q, k, k, 1.0, causal=False)
    assert isinstance(calls[0], LPTCausalScheduler) and calls[1] is None, calls


@pytest.mark.cpu
@pytest.mark.fa4
def test_blackwell_long_causal_forward_gets_lpt_sized_by_its_l2(monkeypatch):
    """sm_100 (never run here): long causal dense forwards take stage 5's LPT order too, its sections
    sized by the device's L2 (asked once per device); short or non-causal calls the static grid."""
    from stage5_scheduling.device import LPTCausalScheduler

    pick = _dispatch.causal_forward_scheduler
    long = _dispatch.LPT_MIN_SEQLEN_K
    # 16k x 256 x 2 B = 8 MiB a head: a quarter of a 64 MiB L2 holds 4 heads, of a 128 MiB one 8
    small, big = pick("sm_100", True, 16384, 128, 128, 16, 16, 64 << 20), pick("sm_100", True, 16384, 128, 128, 16,
                                                                                  16, 128 << 20)
    assert (small.heads_per_section, big.heads_per_section) == (4, 8) and small.flat_batches
    assert pick("sm_100", True, long - 1, 128, 128, 16, 16, 64 << 20) is None
    assert pick("sm_100", False, 16384, 128, 128, 16, 16, 64 << 20) is None
    calls = []
    mod = types.SimpleNamespace(attention_forward=lambda q, k, v, softmax_scale, causal, scheduler=None:
                                calls.append(scheduler), default_persistent=lambda *a, **kw: False)
    be = _dispatch.BlackwellBackend(_dispatch.ARCHS["sm_100"])
    monkeypatch.setattr(be, "forward_module", lambda: mod)
    monkeypatch.setattr(_dispatch, "_BLACKWELL_WARNED", True)
    monkeypatch.setattr(_dispatch, "_l2_bytes", lambda device: 64 << 20)
    q = torch.empty(1, long, 16, 128, device="meta")
    be.forward(q, q, q, 1.0, causal=True)
    be.forward(q[:, :128], q[:, :128], q[:, :128], 1.0, causal=True)
    # 4k x 256 x 2 B = 2 MiB a head: 16 fit a quarter of 64 MiB
    assert calls[0] == LPTCausalScheduler(16, flat_batches=True) and calls[1] is None, calls


@pytest.mark.cpu
@pytest.mark.fa4
def test_unverified_arch_warns_once(monkeypatch):
    monkeypatch.setattr(_dispatch, "_BLACKWELL_WARNED", False)
    be = _dispatch.make_backend(_dispatch.ARCHS["sm_100"])
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        be._warn_unverified()
        be._warn_unverified()
    msgs = [str(w.message) for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(msgs) == 1 and "unverified" in msgs[0]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        _dispatch.make_backend(_dispatch.ARCHS["sm_90"])._warn_unverified()
    assert not rec


@pytest.mark.cpu
@pytest.mark.fa4
def test_cute_arch_mismatch_is_reported(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setitem(sys.modules, "cutlass", types.ModuleType("cutlass"))
    with pytest.raises(RuntimeError, match=r"device is sm_100 but CuTe-DSL targets CUTE_DSL_ARCH=sm_90a"):
        _dispatch._ensure_cute_arch(_dispatch.ARCHS["sm_100"])


# ================================================================================ lse gradient algebra
def _np_backward(q, k, v, out, dout, lse, *, softmax_scale=None, causal=False, deterministic=False, dlse=None):
    """The stage-0 float64 backward as a stand-in kernel: like a kernel, it forms D from the `out`
    it is given (D = rowsum(dO * O)), less dlse when one is given."""
    from stage0_reference import attention_backward

    grads = attention_backward(*(t.numpy() for t in (q, k, v, out, dout, lse)), softmax_scale=softmax_scale,
                               causal=causal, dlse=None if dlse is None else dlse.numpy())
    return tuple(torch.from_numpy(np.ascontiguousarray(g)) for g in grads)


def _np_varlen_backward(q, k, v, out, dout, lse, cu_q, cu_k, max_q, max_k, *, seqused_k=None, softmax_scale=None,
                        causal=False, deterministic=False, dlse=None):
    from stage0_reference import attention_varlen_backward

    grads = attention_varlen_backward(*(t.numpy() for t in (q, k, v, out, dout, lse)), cu_q.numpy(), cu_k.numpy(),
                                      softmax_scale=softmax_scale, causal=causal,
                                      dlse=None if dlse is None else dlse.numpy())
    return tuple(torch.from_numpy(np.ascontiguousarray(g)) for g in grads)


def _fixed_problem(seed, b=2, sq=13, sk=17, hq=4, hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g)  # noqa: E731
    return mk(b, sq, hq, d), mk(b, sk, hkv, d), mk(b, sk, hkv, d), mk(b, sq, hq, d), mk(b, hq, sq)


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("causal", [False, True])
def test_lse_gradient_is_a_d_term_correction(causal):
    """dS += P * dlse, i.e. D - dlse in place of D (stage 0's backward with dlse, as the kernels'
    host code forms it), equals torch autograd of the reference with a loss that uses both out and
    lse (float64)."""
    from stage0_reference.torch_reference import attention_ref

    q, k, v, dout, dlse = _fixed_problem(1)
    sq, sk = q.shape[1], k.shape[1]
    if causal:
        dlse[:, :, : max(sq - sk, 0)] = 0  # rows with no key have lse = -inf: no gradient flows there
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = attention_ref(qr, kr, vr, causal=causal)
    ref = torch.autograd.grad((out * dout).sum() + (lse * dlse).sum(), (qr, kr, vr))
    out, lse = out.detach(), lse.detach()
    dq, dk, dv = _np_backward(q, k, v, out, dout, lse, causal=causal)
    dq2, dk2, dv2 = _np_backward(q, k, v, out, dout, lse, causal=causal, dlse=dlse)
    assert torch.equal(dv2, dv)  # dV = P^T dO: no lse term
    for got, want in zip((dq2, dk2, dv), ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    # without dlse the correction would be missing: the test can tell the difference
    assert (dq - ref[0]).abs().max() > 1e-3


@pytest.mark.cpu
@pytest.mark.fa4
def test_lse_gradient_varlen():
    from stage0_reference.torch_reference import attention_ref

    g = torch.Generator().manual_seed(2)
    cu_q = torch.tensor([0, 5, 5, 16], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 12, 20], dtype=torch.int32)
    mk = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g)  # noqa: E731
    q, k, v, dout, dlse = mk(16, 4, 8), mk(20, 2, 8), mk(20, 2, 8), mk(16, 4, 8), mk(4, 16)
    dlse[:, 5:8] = 0  # sequence 2 has 11 queries, 8 keys: its first 3 rows (causal) see no key
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    outs, lses = [], []  # the float64 reference, one sequence at a time
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(cq[:-1], cq[1:]), zip(ck[:-1], ck[1:])):
        o, l = attention_ref(qr[None, q0:q1], kr[None, k0:k1], vr[None, k0:k1], causal=True)
        outs.append(o[0])
        lses.append(l[0])
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    finite = torch.isfinite(lse)
    ref = torch.autograd.grad((out * dout).sum() + (torch.where(finite, lse, 0) * dlse).sum(), (qr, kr, vr))
    out, lse = out.detach(), lse.detach()
    call = lambda *a, **kw: _np_varlen_backward(*a, cu_q, cu_k, 11, 9, causal=True, **kw)  # noqa: E731
    dq2, dk2, dv = call(q, k, v, out, dout, lse, dlse=dlse)
    for got, want in zip((dq2, dk2, dv), ref):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.cpu
@pytest.mark.fa4
def test_backend_hands_dlse_to_the_kernel_in_one_call():
    """Backend.backward passes the lse gradient to the kernel module (one call, which shifts D),
    and no dlse keyword at all when the lse receives none."""
    calls = []

    def kernel(q, k, v, out, dout, lse, *, softmax_scale, causal, deterministic, **extra):
        calls.append(sorted(extra))
        return _np_backward(q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal, **extra)

    q, k, v, dout, dlse = _fixed_problem(3)
    out, lse = torch.zeros_like(dout), torch.zeros(dlse.shape, dtype=torch.float64)
    be = _dispatch.HopperBackend(_fake_arch())
    be._mods["bwd"] = types.SimpleNamespace(attention_backward=kernel, __name__="fake_bwd")
    with_dlse = be.backward(dout, q, k, v, out, lse, 0.3, False, False, dlse=dlse)
    assert calls == [["dlse"]]
    calls.clear()
    without = be.backward(dout, q, k, v, out, lse, 0.3, False, False, dlse=None)
    assert calls == [[]]
    assert not torch.allclose(with_dlse[0], without[0])  # the dlse term reached dq


@pytest.mark.cpu
@pytest.mark.fa4
def test_varlen_plumbing_adapts_to_each_kernel_module(monkeypatch):
    """The Hopper module takes (max_seqlen_q, max_seqlen_k, seqused_k=); the Blackwell one takes
    max_seqlen_q and seqused_k=: each backend passes what its module accepts."""
    calls = []

    def hopper_like(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, *, seqused_k=None, softmax_scale=None,
                    causal=False, tile_m=None):
        calls.append(("hopper", max_seqlen_q, max_seqlen_k, seqused_k, softmax_scale, causal, tile_m))
        return "out", "lse"

    def blackwell_like(q, k, v, cu_q, cu_k, max_seqlen_q, *, seqused_k=None, softmax_scale=None, causal=False,
                       out=None, lse=None):
        calls.append(("blackwell", max_seqlen_q, seqused_k, softmax_scale, causal))
        return "out", "lse"

    t = torch.zeros(1)
    be = _dispatch.HopperBackend(_fake_arch())
    be._mods["fwd"] = types.SimpleNamespace(attention_varlen_forward=hopper_like, __name__="hopper_like")
    be.varlen_forward(t, t, t, t, t, "used", 7, 9, 0.5, True)      # <= 64 query rows: 64-row tiles
    be.varlen_forward(t, t, t, t, t, "used", 65, 9, 0.5, True)     # more: the head dims' default
    bw = _dispatch.BlackwellBackend(_dispatch.ARCHS["sm_100"])
    monkeypatch.setattr(_dispatch, "_BLACKWELL_WARNED", True)
    bw._mods["fwd"] = types.SimpleNamespace(attention_varlen_forward=blackwell_like, __name__="bw_like")
    bw.varlen_forward(t, t, t, t, t, None, 7, 9, 0.5, False)
    bw.varlen_forward(t, t, t, t, t, "used", 7, 9, 0.5, False)
    assert calls == [("hopper", 7, 9, "used", 0.5, True, 64), ("hopper", 65, 9, "used", 0.5, True, None),
                     ("blackwell", 7, None, 0.5, False), ("blackwell", 7, "used", 0.5, False)]
    # an arch whose varlen forward lacks seqused_k (none today) is refused before its module's import
    bare = _dispatch.BlackwellBackend(dataclasses.replace(_dispatch.ARCHS["sm_100"], lacks=("seqused_k",)))
    with pytest.raises(ValueError, match=r"^seqused_k: not implemented by the sm_100 varlen forward \(stage3_fwd_kernel"):
        bare.varlen_forward(t, t, t, t, t, "used", 7, 9, 0.5, False)
    seen = []

    def varlen_bwd(q, k, v, out, dout, lse, cu_q, cu_k, max_q, max_k, *, seqused_k, softmax_scale, causal,
                   deterministic, dlse=None):
        seen.append((max_q, max_k, seqused_k, deterministic, dlse))
        return q, k, v

    be._mods["bwd"] = types.SimpleNamespace(attention_varlen_backward=varlen_bwd, __name__="bwd_like")
    assert be.varlen_backward(t, t, t, t, t, t, t, t, None, 7, 9, 0.5, True, True) == (t, t, t)
    assert be.varlen_backward(t, t, t, t, t, t, t, t, None, 7, 9, 0.5, True, True, dlse="dlse") == (t, t, t)
    assert seen == [(7, 9, None, True, None), (7, 9, None, True, "dlse")]  # the lse gradient reaches the module


@pytest.mark.cpu
@pytest.mark.fa4
def test_seqused_k_is_refused_up_front_where_the_varlen_forward_lacks_it(monkeypatch):
    """On an arch whose varlen forward has no seqused_k (none today: sm_100 as it was before its forward
    took it) the public call names seqused_k in a ValueError before a page gather or a kernel module
    import -- dense and paged k / v alike."""
    from fa4 import _validate

    lacking = dataclasses.replace(_dispatch.ARCHS["sm_100"], lacks=("seqused_k",))
    monkeypatch.setattr(_validate, "arch_of", lambda device: lacking)
    gathered = []
    monkeypatch.setattr(_validate.VarlenLayout, "unpage", staticmethod(lambda *a: gathered.append(a)))
    m = lambda *s, dt=torch.bfloat16: torch.empty(*s, device="meta", dtype=dt)  # noqa: E731
    cu, used = m(3, dt=torch.int32), m(2, dt=torch.int32)
    with pytest.raises(ValueError, match=r"^seqused_k: not implemented by the sm_100 varlen forward"):
        fa4.flash_attn_varlen_func(m(8, 2, 64), m(8, 2, 64), m(8, 2, 64), cu_seqlens_q=cu, cu_seqlens_k=cu,
                                   max_seqlen_q=4, max_seqlen_k=4, seqused_k=used)
    with pytest.raises(ValueError, match=r"^seqused_k: not implemented by the sm_100 varlen forward"):
        fa4.flash_attn_varlen_func(m(8, 2, 64), m(4, 16, 2, 64), m(4, 16, 2, 64), cu_seqlens_q=cu,
                                   max_seqlen_q=4, seqused_k=used, page_table=m(2, 2, dt=torch.int32))
    assert gathered == []


@pytest.mark.cpu
@pytest.mark.fa4
def test_a_pair_without_a_backward_is_refused_before_the_page_gather_and_names_sdpa_arguments(monkeypatch):
    """On an arch where (192, 128) has a forward but no backward (sm_100 before its wide backward), a paged
    call that needs a gradient is refused before the pages are copied, and SDPA's refusal names `query`."""
    from fa4 import _layouts, _validate

    monkeypatch.setattr(_layouts, "arch_of", lambda device: _forward_only_wide_arch())
    monkeypatch.setattr(_validate, "arch_of", lambda device: _forward_only_wide_arch())
    gathered = []
    monkeypatch.setattr(_validate.VarlenLayout, "unpage", staticmethod(lambda *a: gathered.append(a)))
    m = lambda *s, dt=torch.bfloat16, grad=False: torch.empty(*s, device="meta", dtype=dt, requires_grad=grad)  # noqa: E731
    with pytest.raises(ValueError, match=r"^q: head dims \(qk=192, v=128\) run on sm_100's 192/128 forward, which has no"):
        fa4.flash_attn_varlen_func(m(8, 2, 192, grad=True), m(4, 16, 2, 192), m(4, 16, 2, 128),
                                   cu_seqlens_q=m(3, dt=torch.int32), max_seqlen_q=4,
                                   page_table=m(2, 2, dt=torch.int32))
    assert gathered == []
    with pytest.raises(ValueError, match=r"^query: head dims \(qk=192, v=192\) run on sm_100's 256/256 forward"):
        fa4.scaled_dot_product_attention(m(1, 2, 8, 192, grad=True), m(1, 2, 8, 192), m(1, 2, 8, 192))


@pytest.mark.cpu
@pytest.mark.fa4
def test_forward_route_switches_reach_the_kernel_module(monkeypatch):
    """fa4._dispatch's forward switches arrive as keyword arguments of the Hopper attention_forward:
    FORWARD_PERSISTENT when set, and nothing else."""
    calls = []

    def step4_like(q, k, v, *, softmax_scale=None, causal=False, scheduler=None, persistent=None, tile_m=None):
        calls.append((causal, persistent, tile_m))
        return "out", "lse"

    t = torch.zeros(1, 80, 2, 64)  # short keys: no LPT scheduler, nothing imported
    be = _dispatch.HopperBackend(_fake_arch())
    be._mods["fwd"] = types.SimpleNamespace(attention_forward=step4_like, __name__="step4_like")
    be.forward(t, t, t, 0.5, False)
    monkeypatch.setattr(_dispatch, "FORWARD_PERSISTENT", False)
    be.forward(t, t, t, 0.5, False)
    be.forward(t, t, t, 0.5, True)
    be.forward(t[:, :64], t, t, 0.5, True)  # <= 64 query rows: 64-row tiles
    monkeypatch.setattr(_dispatch, "SHORT_QUERY_TILE_M", None)
    be.forward(t[:, :64], t, t, 0.5, True)
    assert calls == [(False, None, None), (False, False, None), (True, False, None), (True, False, 64),
                     (True, False, None)]


# ================================================================================ custom ops: fake / meta
@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("d,dv", [(64, 64), (192, 128)])
def test_fake_shapes_fixed(d, dv):
    q, k, v = qkv_meta(d=d, dv=dv)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    out, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert out.shape == (2, 64, 8, dv) and out.dtype == BF16 and out.is_contiguous()
    assert lse.shape == (2, 8, 64) and lse.dtype == torch.float32
    (out.float().sum() + lse.sum()).backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape and v.grad.dtype == BF16
    assert fa4.flash_attn_func(q, k, v).shape == (2, 64, 8, dv)  # out only when return_lse=False


@pytest.mark.cpu
@pytest.mark.fa4
def test_fake_shapes_varlen_and_fake_tensor_mode():
    kw = _varlen_kwargs()
    out, lse = fa4.flash_attn_varlen_func(**kw, causal=True, return_lse=True)
    assert out.shape == (100, 8, 128) and lse.shape == (8, 100) and lse.dtype == torch.float32
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # fake CUDA tensors work on a machine without CUDA
        q = torch.empty(3, 50, 4, 64, device="cuda", dtype=torch.float16)
        out = fa4.flash_attn_func(q, q, q, causal=True)
        assert out.device.type == "cuda" and out.shape == (3, 50, 4, 64) and out.dtype == torch.float16


@pytest.mark.cpu
@pytest.mark.fa4
def test_eager_fast_path_only_for_plain_cuda_tensors_outside_compile_and_modes():
    """fa4._ops.eager_ok: the op is skipped only where nothing needs to see it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa4 import _ops

    assert not _ops.eager_ok(meta(1, 8, 2, 64))
    assert not _ops.eager_ok(torch.zeros(1, 8, 2, 64))  # CPU: the op raises the clear device error
    with FakeTensorMode():
        fake = torch.empty(1, 8, 2, 64, device="cuda")
        assert fake.is_cuda and not _ops.eager_ok(fake)


@pytest.mark.gpu
@pytest.mark.fa4
def test_eager_fast_path_for_real_cuda_tensors_only_outside_modes_and_subclasses():
    """The half of the rule a real CUDA tensor needs (the gpu tier: the cpu tier has none)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa4 import _ops

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    real = torch.zeros(1, 8, 2, 64, device="cuda")
    assert _ops.eager_ok(real, None)
    with FakeTensorMode():  # a dispatch mode is active: it must see the op
        assert not _ops.eager_ok(real)
    assert not _ops.eager_ok(torch.nn.Parameter(real))  # a subclass keeps the op


def _op_samples():
    q, k, v = qkv_meta(b=1, sq=16, sk=24, hq=4, hkv=2, d=64)
    out, lse = meta(1, 16, 4, 64), meta(1, 4, 16, dtype=torch.float32)
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    qv, kv, vv, ov = meta(16, 4, 64), meta(24, 2, 64), meta(24, 2, 64), meta(16, 4, 64)
    lv = meta(4, 16, dtype=torch.float32)
    return [
        ("fwd", torch.ops.fa4.fwd.default, (q, k, v, 0.125, True, False, True)),
        ("bwd", torch.ops.fa4.bwd.default, (out, q, k, v, out, lse, lse, 0.125, True, False)),
        ("bwd-no-dlse", torch.ops.fa4.bwd.default, (out, q, k, v, out, lse, None, 0.125, False, True)),
        ("varlen_fwd", torch.ops.fa4.varlen_fwd.default, (qv, kv, vv, cu, cu, None, 8, 12, 0.125, True, False, True)),
        ("varlen_bwd", torch.ops.fa4.varlen_bwd.default,
         (ov, qv, kv, vv, ov, lv, lv, cu, cu, cu[:2], 8, 12, 0.125, False, False)),
        # a paged cache of 5 pages of 16 keys, 2 sequences with 2 table entries each (forward only)
        ("paged_varlen_fwd", torch.ops.fa4.paged_varlen_fwd.default,
         (qv, meta(5, 16, 2, 64), meta(5, 16, 2, 64), torch.zeros(2, 2, dtype=torch.int32, device="meta"), cu, cu,
          cu[:2], 8, 32, 0.125, True)),
    ]


@pytest.mark.cpu
@pytest.mark.fa4
@pytest.mark.parametrize("sample", _op_samples(), ids=lambda s: s[0])
def test_opcheck(sample):
    """torch.library.opcheck on meta inputs: schema, fake implementation, autograd registration
    (the real kernels need a GPU; the gpu tier runs them)."""
    _, op, args = sample
    res = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    assert all(v == "SUCCESS" for v in res.values()), res


def _graph_breaks(fn, *args):
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(*args)


@pytest.mark.cpu
@pytest.mark.fa4
def test_torch_compile_fullgraph_traces_fwd_and_bwd():
    def step(q, k, v):
        out, lse = fa4.flash_attn_func(q, k, v, causal=True, return_lse=True)
        return out.float().square().mean() + lse.mean()

    q, k, v = (t.requires_grad_() for t in qkv_meta(sq=128, sk=128))
    torch._dynamo.reset()
    loss = torch.compile(step, fullgraph=True, backend="aot_eager")(q, k, v)  # fullgraph: a break raises
    loss.backward()
    assert loss.shape == () and q.grad.shape == q.shape
    ex = _graph_breaks(step, q, k, v)
    assert ex.graph_break_count == 0 and ex.graph_count == 1


@pytest.mark.cpu
@pytest.mark.fa4
def test_torch_compile_fullgraph_varlen_and_sdpa_helper():
    def varlen(q, k, v, cu_q, cu_k):
        return fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=50,
                                          max_seqlen_k=60, causal=True).sum()

    def sdpa(q, k, v):  # Sq > Sk: the top-left decomposition (two calls + cat) stays in one graph
        return fa4.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum()

    kw = _varlen_kwargs()
    ex = _graph_breaks(varlen, kw["q"], kw["k"], kw["v"], kw["cu_seqlens_q"], kw["cu_seqlens_k"])
    assert ex.graph_break_count == 0
    ex = _graph_breaks(sdpa, meta(2, 8, 96, 64), meta(2, 2, 40, 64), meta(2, 2, 40, 64))
    assert ex.graph_break_count == 0
    torch._dynamo.reset()


# ---------------------------------------------------------------------- autograd wiring, numerically
@pytest.fixture
def cpu_reference_kernels():
    """Register float64 stage-0 kernels for fa4::fwd / fa4::bwd on CPU, for this test only, so the
    registered autograd formula (setup_context, return_lse gating, the dlse path) runs end to end."""
    from stage0_reference import attention_forward

    lib = torch.library.Library("fa4", "FRAGMENT")

    def fwd_cpu(q, k, v, softmax_scale, causal, deterministic, return_lse, *variants):
        o, l = attention_forward(q.numpy(), k.numpy(), v.numpy(), softmax_scale=softmax_scale, causal=causal)
        return torch.from_numpy(np.ascontiguousarray(o)), torch.from_numpy(np.ascontiguousarray(l))

    seen = []

    def bwd_cpu(dout, q, k, v, out, lse, dlse, softmax_scale, causal, deterministic, *variants):
        seen.append(dlse is not None)
        kw = dict(softmax_scale=softmax_scale, causal=causal)
        dq, dk, dv = _np_backward(q, k, v, out, dout, lse, dlse=dlse, **kw)
        return dq, dk, dv, q.new_empty((0,))  # dsink: no sink

    torch.library.register_kernel("fa4::fwd", "cpu", fwd_cpu, lib=lib)
    torch.library.register_kernel("fa4::bwd", "cpu", bwd_cpu, lib=lib)
    yield seen
    lib._destroy()


@pytest.mark.cpu
@pytest.mark.fa4
def test_autograd_through_the_ops_matches_reference(cpu_reference_kernels):
    from stage0_reference.torch_reference import attention_ref

    q, k, v, dout, dlse = _fixed_problem(4, sq=11, sk=17)
    for return_lse in (False, True):
        cpu_reference_kernels.clear()
        qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = _ops.fwd(qa, ka, va, 0.3, True, False, return_lse)
        loss = (out * dout).sum() + ((lse * dlse).sum() if return_lse else 0)
        got = torch.autograd.grad(loss, (qa, ka, va))
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        o_r, l_r = attention_ref(qr, kr, vr, softmax_scale=0.3, causal=True)
        loss_r = (o_r * dout).sum() + ((l_r * dlse).sum() if return_lse else 0)
        want = torch.autograd.grad(loss_r, (qr, kr, vr))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
        assert cpu_reference_kernels == [return_lse]  # dlse reaches the kernel only if lse was exposed
    # lse used, out unused: dout is materialised as zeros, still one backward call
    cpu_reference_kernels.clear()
    qa, ka, va = (t.clone().requires_grad_() for t in (q, k, v))
    _, lse = _ops.fwd(qa, ka, va, 0.3, True, False, True)
    (lse * dlse).sum().backward()
    assert cpu_reference_kernels == [True] and torch.isfinite(qa.grad).all()


@pytest.mark.cpu
@pytest.mark.fa4
def test_empty_inputs_never_launch(monkeypatch):
    """Empty problems return empty / zero outputs (lse -inf) before any kernel is touched."""
    class NoLaunch:
        arch = _dispatch.ARCHS["sm_90"]

        def check_head_dims(self, d, dv):
            pass

        def __getattr__(self, name):
            raise AssertionError(f"{name} called: an empty problem must not launch")

    monkeypatch.setattr(_dispatch, "backend_for", lambda device: NoLaunch())
    real_fwd, real_bwd = _ops.fwd._init_fn, _ops.bwd._init_fn
    z = lambda *s: torch.zeros(*s, dtype=BF16)  # noqa: E731
    out, lse = real_fwd(z(0, 5, 4, 64), z(0, 7, 2, 64), z(0, 7, 2, 64), 0.1, True, False, True)
    assert out.shape == (0, 5, 4, 64) and lse.shape == (0, 4, 5)
    out, lse = real_fwd(z(2, 5, 4, 64), z(2, 0, 2, 64), z(2, 0, 2, 64), 0.1, True, False, True)
    assert out.shape == (2, 5, 4, 64) and torch.all(out == 0) and torch.all(torch.isneginf(lse))
    dq, dk, dv, dsink = real_bwd(z(2, 5, 4, 64), z(2, 5, 4, 64), z(2, 0, 2, 64), z(2, 0, 2, 64), out, lse, None, 0.1,
                                 False, False)
    assert dsink.numel() == 0 and dq.shape == (2, 5, 4, 64) and torch.all(dq == 0) and dk.shape == (2, 0, 2, 64)
    cu = torch.tensor([0], dtype=torch.int32)
    out, lse = _ops.varlen_fwd._init_fn(z(0, 4, 64), z(0, 2, 64), z(0, 2, 64), cu, cu, None, 0, 0, 0.1, False, False,
                                        False)
    assert out.shape == (0, 4, 64) and lse.shape == (4, 0)


# ================================================================================ transformers
@pytest.mark.cpu
@pytest.mark.fa4
def test_register_without_transformers_is_a_clear_import_error(monkeypatch):
    from fa4.integrations import transformers as integ

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"transformers is not installed.*pip install"):
        integ.register_fa4_attention()


@pytest.mark.cpu
@pytest.mark.fa4
def test_transformers_registration_and_model_on_meta(monkeypatch):
    pytest.importorskip("transformers", reason="transformers is not installed here")
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM

    from fa4.integrations import transformers as integ

    assert integ.register_fa4_attention() == "fa4"
    assert "fa4" in AttentionInterface() and AttentionInterface()["fa4"] is integ.fa4_attention_forward
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        assert ALL_MASK_ATTENTION_FUNCTIONS["fa4"] is integ.fa4_mask
    except ImportError:
        pass
    calls = []
    real = integ.flash_attn_func
    monkeypatch.setattr(integ, "flash_attn_func", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      intermediate_size=512, num_hidden_layers=2, vocab_size=128, attn_implementation="fa4")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(BF16)
    logits = model(input_ids=torch.zeros(2, 16, dtype=torch.long, device="meta")).logits
    assert logits.shape == (2, 16, 128)
    assert len(calls) == 2 and all(c["causal"] is True for c in calls)  # one fa4 call per layer


@pytest.mark.cpu
@pytest.mark.fa4
def test_transformers_attention_function_contract():
    from fa4.integrations.transformers import fa4_attention_forward, fa4_mask

    mod = types.SimpleNamespace(is_causal=True)
    q, k, v = meta(2, 8, 16, 128), meta(2, 2, 16, 128), meta(2, 2, 16, 128)
    out, weights = fa4_attention_forward(mod, q, k, v, None, scaling=0.1)
    assert out.shape == (2, 16, 8, 128) and weights is None  # (B, S, H, D), as transformers expects
    with pytest.raises(ValueError, match=r"^dropout:"):  # windows, softcap, sinks: tests/test_fa4_variants.py
        fa4_attention_forward(mod, q, k, v, None, dropout=0.1)
    with pytest.raises(ValueError, match=r"^attention_mask: fa4 takes None or a 2-D"):
        fa4_attention_forward(mod, q, k, v, meta(2, 1, 16, 16, dtype=torch.bool))
    ones = torch.ones(2, 20, dtype=torch.long)
    assert fa4_mask(2, 16, 16, attention_mask=None) is None
    assert fa4_mask(2, 16, 16, attention_mask=ones) is None  # nothing padded: the kernels do causal
    padded = ones.clone()
    padded[0, :6] = 0
    m = fa4_mask(2, 16, 16, attention_mask=padded)  # left padding: a LeftPadding, its mask the last 16 columns
    assert m.mask.dtype == torch.bool and m.mask.shape == (2, 16) and not m.mask[0, 0] and m.mask[1].all()
    assert m.first.tolist() == [2, 0]


@pytest.mark.cpu
@pytest.mark.fa4
def test_sass_is_disassembled_only_when_asked_for(monkeypatch):
    """A fresh compile keeps its cubin and disassembles it on first use of .sass or .report (what a
    launch never asks for: nvdisasm was 1.5-2 s of an H200's cold first forward); log_report and
    the disk cache's copy of the report do not force it."""
    from stage3_fwd_kernel import compile_cache

    calls = []
    monkeypatch.setattr(compile_cache, "disassemble", lambda cubin: calls.append(cubin) or "HGMMA.64x128 R0;\n")
    comp = compile_cache.Compiled("fn", {"registers": 90, "HGMMA": None}, None, "ptx", cubin=b"elf")
    assert comp.log_report["registers"] == 90 and calls == []
    assert comp.report["HGMMA"] == 1 and calls == [b"elf"]       # counted on first use
    assert comp.sass.startswith("HGMMA") and calls == [b"elf"]   # once
    plain = compile_cache.Compiled("fn", {}, "", "")             # loaded from disk: no SASS, nothing to make
    assert plain.sass == "" and plain.report == {} and calls == [b"elf"]
