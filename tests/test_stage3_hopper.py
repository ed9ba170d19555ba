"""Stage 3 (Hopper forward kernels in CuTe-DSL).

compile tier (CI, no GPU): every step compiles for sm_90a for fp16 and bf16, every supported head
dim, causal on and off; ptxas reports no spills and no local memory; the SASS holds HGMMA (and
UTMALDG from step 2 on; step 3 also carries setmaxnreg, which ptxas must not ignore). Compiles are
cached per process, so each config is compiled once.

gpu tier (an H100/H200): outputs are poisoned with NaN before each run; out and lse
follow FA4's rule against the fp32 reference (`stage0_reference.torch_reference`); fully masked
rows give out 0 and lse -inf; repeated runs are bitwise identical.
"""
from __future__ import annotations

import importlib
import math

import pytest

ALL_STEPS = ["hopper_step1_wgmma", "hopper_step2_tma", "hopper_step3_warpspec"]
HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]


def _step(name):
    return importlib.import_module(f"stage3_fwd_kernel.{name}")


STEPS = list(ALL_STEPS)  # every step exists: one that fails to import fails its tests


# ------------------------------------------------------------------------------------ compile tier
# The full matrix is 2 dtypes x 5 head dims x 2 causal = 20 compiles per step (~4 s each on two
# cores). CI compiles every head dim in both dtypes, alternating causal, plus both causal modes
# at d=128 -- 12 per step -- and `python -m stage3_fwd_kernel.compile_all` runs the full matrix.
COMPILE_CASES = [(dt, d, dv, (i + j) % 2 == 0) for i, (d, dv) in enumerate(HEAD_DIMS)
                 for j, dt in enumerate(("bf16", "fp16"))]
COMPILE_CASES += [("bf16", 128, 128, False), ("fp16", 128, 128, True)]


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("dtype,d,dv,causal", COMPILE_CASES,
                         ids=[f"{dt}-d{d}x{dv}-{'causal' if c else 'full'}" for dt, d, dv, c in COMPILE_CASES])
def test_compiles_sm90a(step, dtype, d, dv, causal):
    mod = _step(step)
    comp = mod.compile_only(dtype=dtype, head_dim=d, head_dim_v=dv, causal=causal)
    rep = comp.report
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, f"spills: {rep}"
    assert rep["stack_frame"] == 0, f"stack frame: {rep}"
    assert rep["LDL/STL"] == 0, "local-memory traffic in SASS"
    assert rep["registers"] is not None and rep["registers"] <= 255
    assert rep["HGMMA"] and rep["HGMMA"] > 0, "no HGMMA in SASS: the kernel is not on the wgmma path"
    assert rep["smem_bytes"] is not None and rep["smem_bytes"] <= 227 * 1024
    if step != "hopper_step1_wgmma":
        assert rep["UTMALDG"] and rep["UTMALDG"] > 0, "no TMA loads (UTMALDG) in SASS"
    if step == "hopper_step3_warpspec":
        assert rep["threads"] == 384
        assert "setmaxnreg.dec" in comp.ptx and "setmaxnreg.inc" in comp.ptx
        assert "C7508" not in rep["ptxas_log"], "ptxas ignored setmaxnreg"


# ---------------------------------------------------------------------------------------- gpu tier
SEQLENS = [(1, 1), (1, 3), (113, 203), (239, 1), (799, 3), (1024, 1024), (4224, 4224)]


def _run_and_check(mod, *, batch, sq, sk, heads, heads_kv, d, dv, causal, dtype="bf16",
                   softmax_scale=None, seed=0, q=None, k=None, v=None):
    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref

    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    g = torch.Generator(device="cuda").manual_seed(seed)
    if q is None:
        q = torch.randn(batch, sq, heads, d, device="cuda", dtype=tdt, generator=g)
        k = torch.randn(batch, sk, heads_kv, d, device="cuda", dtype=tdt, generator=g)
        v = torch.randn(batch, sk, heads_kv, dv, device="cuda", dtype=tdt, generator=g)
    out = torch.full((q.shape[0], q.shape[1], q.shape[2], v.shape[3]), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda", dtype=torch.float32)
    mod.attention_forward(q, k, v, softmax_scale=softmax_scale, causal=causal, out=out, lse=lse)
    torch.cuda.synchronize()
    assert not torch.isnan(out).any(), "NaN in out (unwritten or poisoned rows)"
    assert not torch.isnan(lse).any(), "NaN in lse (unwritten or poisoned rows)"
    ref_o, ref_lse = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, upcast=True)
    base_o, base_lse = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, upcast=False)
    assert_fa4_close("out", out, ref_o, base_o)
    assert_fa4_close("lse", lse, ref_lse, base_lse)
    return q, k, v, out, lse


def _heads_for(sq, sk):
    # keep the big cases cheap for the fp32 reference
    return (2, 1) if sq * sk > 2_000_000 else (8, 8)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("d,dv", HEAD_DIMS, ids=[f"d{d}x{dv}" for d, dv in HEAD_DIMS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
def test_forward_matches_reference(step, d, dv, causal, sq, sk):
    heads, _ = _heads_for(sq, sk)
    # cycle GQA ratios 1 / 2 / 8 over the cases (heads=2 for big cases: ratio 1 or 2)
    ratio = [1, 2, 8][(sq + sk + d) % 3] if heads == 8 else [1, 2][(sq // 128 + d // 32) % 2]
    _run_and_check(_step(step), batch=2 if sq * sk < 2_000_000 else 1, sq=sq, sk=sk, heads=heads,
                   heads_kv=heads // ratio, d=d, dv=dv, causal=causal)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("ratio", [1, 2, 8])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_ratios(step, ratio, causal):
    _run_and_check(_step(step), batch=2, sq=300, sk=517, heads=8, heads_kv=8 // ratio, d=128, dv=128,
                   causal=causal)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (256, 256)], ids=["d64", "d128", "d256"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp16(step, d, dv, causal):
    _run_and_check(_step(step), batch=2, sq=333, sk=1000, heads=4, heads_kv=2, d=d, dv=dv, causal=causal,
                   dtype="fp16")


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("step", STEPS)
def test_softmax_scale_and_strides(step):
    """A non-default scale, and q/k/v that are strided views of packed qkv / transposed buffers."""
    import torch

    b, s, h, d = 2, 257, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)  # strides (s*3*h*d, 3*h*d, d, 1): not contiguous
    _run_and_check(_step(step), batch=b, sq=s, sk=s, heads=h, heads_kv=h, d=d, dv=d, causal=True,
                   softmax_scale=0.3, q=q, k=k, v=v)
    kt = torch.randn(b, h, 400, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)  # (b, s, h, d) view
    vt = torch.randn(b, h, 400, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    _run_and_check(_step(step), batch=b, sq=s, sk=400, heads=h, heads_kv=h, d=d, dv=d, causal=False,
                   q=q, k=kt, v=vt)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128)], ids=["d64", "d128"])
def test_fully_masked_rows(step, d, dv):
    """causal with seqlen_q > seqlen_k: rows i < sq - sk see no key -> out exactly 0, lse -inf."""
    import torch

    sq, sk = 300, 70
    _, _, _, out, lse = _run_and_check(_step(step), batch=2, sq=sq, sk=sk, heads=4, heads_kv=4, d=d, dv=dv,
                                       causal=True)
    empty = sq - sk
    assert torch.all(out[:, :empty] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :empty]))
    assert torch.all(torch.isfinite(lse[:, :, empty:]))


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("step", STEPS)
def test_deterministic(step):
    import torch

    mod = _step(step)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 1200, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 1200, 2, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    o1, l1 = mod.attention_forward(q, k, v, causal=True)
    o2, l2 = mod.attention_forward(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert math.isfinite(l1.max().item())


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("step", STEPS)
def test_run_entry_point(step):
    res = _step(step).run(batch=1, seqlen_q=512, seqlen_k=512, heads=4, head_dim=128, causal=True, check=True)
    assert res["mode"] == "gpu" and res["tflops"] > 0
