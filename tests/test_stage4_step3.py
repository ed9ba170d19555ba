"""Stage 4, Hopper backward step 3 (``hopper_step3_rs``): P^T and dS^T as register A operands of dV / dK.

cpu tier: the head dims whose accumulators do not fit a consumer's registers with 128 keys per tile
(192/128, 256/256) and tiles that do not give each consumer warpgroup 64 keys are refused with a
ValueError naming them, before anything is compiled; the shared-memory cycles the docstring quotes
are the roofline's.

compile tier (sm_90a, fake tensors, no GPU): every supported head dim, both dtypes, causal and
deterministic on/off, varlen + seqused_k: no spills, no local memory, no serialized wgmma, the five
GEMMs' wgmma count with dV / dK taking A from registers (SASS ``HGMMA ... R, R, gdesc``), step 2's dQ
atomics and TMA producer; the accumulator layout of S^T / dP^T is the register A layout of dV / dK
(thread by thread, value by value); against step 2, the tile body stores P^T no more (fewer STS by
exactly P^T's share) and the kernel needs P^T's shared-memory buffer no more.

gpu tier (H100/H200; skipped here): dq, dk, dv follow FA4's rule against fp32 autograd on odd shapes
(1x1, 113x203, 799x3) and a square one, causal on/off, GQA 1/2/8, fp16 and bf16, varlen with empty
sequences and seqused_k, deterministic mode bitwise reproducible; outputs NaN-poisoned before the run;
run() entry point.
"""
from __future__ import annotations

import re
from collections import Counter

import numpy as np
import pytest

pytestmark = pytest.mark.stage4

HEAD_DIMS = [(64, 64), (96, 96), (128, 128)]
UNSUPPORTED = [(192, 128), (256, 256)]
TILE_M, TILE_N = 64, 128
RS_HGMMA = re.compile(r"\bHGMMA\.\S+ R\d+, R\d+, gdesc")  # A from registers, B from a descriptor


def _step(name="hopper_step3_rs"):
    pytest.importorskip("stage4_bwd_kernel.common")  # sets CUTE_DSL_ARCH before cutlass loads
    import importlib

    return importlib.import_module(f"stage4_bwd_kernel.{name}")


# ================================================================================== cpu tier
@pytest.mark.cpu
@pytest.mark.parametrize("d,dv", UNSUPPORTED, ids=[f"d{d}x{dv}" for d, dv in UNSUPPORTED])
def test_head_dims_that_do_not_fit_registers_are_refused(d, dv):
    mod = _step()
    with pytest.raises(ValueError, match=r"head_dim: .*registers"):
        mod.default_tiles(d, dv)
    with pytest.raises(ValueError, match=r"head_dim: .*registers"):
        mod.make_kernel(None, d, dv, False, False)
    with pytest.raises(ValueError, match=r"head_dim: .*registers"):
        mod.compile_only("bf16", d, dv)


@pytest.mark.cpu
def test_tiles_must_give_each_consumer_warpgroup_64_keys():
    mod = _step()
    for d, dv in HEAD_DIMS:
        assert mod.default_tiles(d, dv) == (TILE_M, TILE_N)
    with pytest.raises(ValueError, match="tiles: .*tile_n = 128"):
        mod.make_kernel(None, 128, 128, False, False, tiles=(64, 64))
    with pytest.raises(ValueError, match="tiles: .*multiple of 64"):
        mod.make_kernel(None, 128, 128, False, False, tiles=(80, 128))
    assert mod.make_kernel(None, 64, 64, True, True, tiles=(128, 128)).tile_m == 128


@pytest.mark.cpu
@pytest.mark.parametrize("d", [64, 96, 128])
def test_docstring_cycles_are_the_roofline(d):
    """The shared-memory cycles per 64 x 128 tile the module docstring quotes for step 2 (all SS) and
    step 3 (key split, RS dV / dK) are what roofline.hopper_tile_cycles computes."""
    from stage4_bwd_kernel.roofline import hopper_tile_cycles

    doc = " ".join(_step().__doc__.split())
    ss = hopper_tile_cycles(TILE_M, TILE_N, d, "step1_ss").smem
    rs = hopper_tile_cycles(TILE_M, TILE_N, d, "fa3_rs").smem
    assert rs < ss
    if d == 128:
        assert f"{ss:.0f} clk" in doc and f"{rs:.0f} clk" in doc
    else:
        assert f"d = {d}: {ss:.0f} -> {rs:.0f}" in doc


# ============================================================================== compile tier
# Every head dim in both dtypes, causal and deterministic varied, plus varlen (+ seqused_k):
# 8 compiles (~5 s each on 2 cores).
COMPILE_CASES = [("bf16", 64, False, False, False, False), ("fp16", 64, True, True, False, False),
                 ("bf16", 96, True, False, False, False), ("fp16", 96, False, True, False, False),
                 ("bf16", 128, True, False, False, False), ("fp16", 128, False, True, False, False),
                 ("bf16", 128, True, False, True, True), ("fp16", 64, False, True, True, False)]
COMPILE_IDS = [f"{dt}-d{d}-{'causal' if c else 'full'}-{'det' if det else 'atomic'}{'-varlen' if vl else ''}"
               f"{'-seqused' if su else ''}" for dt, d, c, det, vl, su in COMPILE_CASES]


def _tile_body(sass: str) -> list:
    """Opcodes of the Q-tile loop: the shortest loop holding a wgmma."""
    from stage4_bwd_kernel import common

    return common.wgmma_loop_bodies(sass)[0]


@pytest.mark.compile
@pytest.mark.parametrize("dtype,d,causal,det,varlen,seqused", COMPILE_CASES, ids=COMPILE_IDS)
def test_compiles_sm90a_with_register_operands(dtype, d, causal, det, varlen, seqused):
    mod = _step()
    comp = mod.compile_only(dtype=dtype, head_dim=d, causal=causal, deterministic=det, varlen=varlen,
                            has_seqused_k=seqused)
    rep, sass, ptx = comp.report, comp.sass, comp.ptx
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, f"spills: {rep}"
    assert rep["stack_frame"] == 0 and rep["LDL/STL"] == 0, f"local memory: {rep}"
    assert rep["wgmma_serialized"] == [], rep["ptxas_log"]
    # K + V + 2 (Q + dO) + dS^T, 16-bit, plus the row statistics and mbarriers (1 KB with alignment)
    data = (TILE_N * 2 * d + 2 * TILE_M * 2 * d + TILE_N * TILE_M) * 2
    assert data < rep["smem_bytes"] <= data + 1024, rep["smem_bytes"]
    # one warpgroup's wgmmas per tile: S^T, dP^T (K = d), dV, dK (K = tile_m), dQ (K = tile_n)
    assert rep["HGMMA"] == 2 * d // 16 + 2 * TILE_M // 16 + (TILE_M // 64) * (TILE_N // 16)
    assert len(RS_HGMMA.findall(sass)) == 2 * TILE_M // 16, "dV / dK do not read A from registers"
    # step 2's dQ: 8-byte fp32 atomics, tile_m * d / 256 / 2 per thread and tile; step 2's producer
    assert len(re.findall(r"\bREDG\.E\.ADD\.F32x2\S*", sass)) == TILE_M * d // 256 // 2
    assert rep["threads"] == 384 and rep["UTMALDG"] > 0 and rep["LDGSTS"] == 0
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    has_sem = ("ld.global.acquire.gpu.b32" in ptx, "fence.acq_rel.gpu" in ptx,
               "red.relaxed.gpu.global.add.s32" in ptx)
    assert has_sem == (det, det, det)


@pytest.mark.compile
@pytest.mark.parametrize("d", [64, 96, 128])
def test_accumulator_registers_are_the_register_operand(d):
    """What the kernel relies on when it reads P^T's / dS^T's registers as dV's / dK's A operand:
    thread t's accumulator value i of S^T (key m, query n) is, in the same register, value i % 8 of
    k-block i // 8 of the A fragment, i.e. (m, n - 16 (i // 8)) of that k-block."""
    import cutlass
    import cutlass.cute as cute

    kernel = _step().make_kernel(cutlass.BFloat16, d, d, False, False)
    coords: dict = {}

    @cute.jit
    def probe():
        tiled_mma_SdP, tiled_mma_dV, tiled_mma_dK, _ = kernel.make_tiled_mmas()
        for name, tv in (("C", tiled_mma_SdP.tv_layout_C_tiled), ("dV", tiled_mma_dV.tv_layout_A_tiled),
                         ("dK", tiled_mma_dK.tv_layout_A_tiled)):
            threads, values = cute.size(tv, mode=[0]), cute.size(tv, mode=[1])
            coords[name] = [[tv((t, i)) for i in range(values)] for t in range(threads)]
        coords["shape_C"] = cute.size(tiled_mma_SdP.partition_shape_C((TILE_N, TILE_M)))
        coords["shape_A"] = cute.size(tiled_mma_dV.partition_shape_A((TILE_N, TILE_M)))

    cute.compile(probe)
    c = np.array(coords["C"])                      # (256 threads, tile_m / 2 values): m + 128 n
    assert c.shape == (256, TILE_M // 2) and coords["shape_C"] == coords["shape_A"] == TILE_M // 2
    for name in ("dV", "dK"):
        a = np.array(coords[name])                 # (256 threads, 8 values of one k-block): m + 128 k
        assert a.shape == (256, 8), name
        for i in range(c.shape[1]):
            np.testing.assert_array_equal(c[:, i], a[:, i % 8] + TILE_N * 16 * (i // 8), err_msg=f"{name} value {i}")


@pytest.mark.compile
def test_p_no_longer_goes_through_shared_memory():
    """Against step 2 on the same call: the tile body stores P^T no more -- fewer STS by P^T's share,
    tile_n * tile_m / 256 values per thread, two per 4-byte store -- reads no A operand of dV / dK
    from shared memory, and P^T's buffer (tile_n x tile_m x 2 bytes) is gone from shared memory."""
    step2, step3 = _step("hopper_step2_warpspec"), _step()
    kw = dict(dtype="bf16", head_dim=128, causal=True)  # step 3's compile case bf16-d128-causal-atomic
    comp2, comp3 = step2.compile_only(**kw), step3.compile_only(**kw)
    assert step2.default_tiles(128, 128) == (TILE_M, TILE_N)  # the same tile: the counts compare
    body2, body3 = Counter(_tile_body(comp2.sass)), Counter(_tile_body(comp3.sass))
    sts2, sts3 = body2["STS"], body3["STS"]
    assert sts2 - sts3 == TILE_N * TILE_M // 256 // 2, (sts2, sts3)
    assert len(RS_HGMMA.findall(comp2.sass)) == 0 and len(RS_HGMMA.findall(comp3.sass)) == 2 * TILE_M // 16
    assert comp2.report["smem_bytes"] - comp3.report["smem_bytes"] == TILE_N * TILE_M * 2


# ================================================================================== gpu tier
def _tdt(dtype):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def _inputs(b, sq, sk, hq, hkv, d, dtype="bf16", seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = ((b, sq, hq, d), (b, sk, hkv, d), (b, sk, hkv, d), (b, sq, hq, d))
    return [torch.randn(*s, device="cuda", dtype=_tdt(dtype), generator=g) for s in shapes]


def _check_dense(*, b, sq, sk, hq, hkv, d, causal, dtype="bf16", deterministic=False, inputs=None):
    """Run step 3 into NaN-poisoned outputs and hold dq, dk, dv to FA4's rule against fp32 autograd."""
    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref, grad_atol
    from stage4_bwd_kernel import host

    q, k, v, do = inputs or _inputs(b, sq, sk, hq, hkv, d, dtype)
    out, lse = attention_ref(q, k, v, causal=causal, upcast=True)
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    _step().attention_backward(q, k, v, out, do, lse, causal=causal, deterministic=deterministic,
                               dq=dq, dk=dk, dv=dv)
    torch.cuda.synchronize()
    for name, t in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert not torch.isnan(t).any(), f"NaN in {name}: unwritten rows or NaN math"
    ref, base = host.reference_grads(q, k, v, do, causal=causal)
    for name, got, r, bl in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, base):
        assert_fa4_close(name, got, r, bl, atol=grad_atol(ref))
    return dq, dk, dv


SEQLENS = [(1, 1), (113, 203), (799, 3), (1024, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("d", [d for d, _ in HEAD_DIMS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
def test_backward_matches_reference(d, causal, sq, sk):
    hq = 8
    hkv = hq // [1, 2, 8][(sq + sk + d) % 3]  # GQA 1 / 2 / 8 cycled over the cases
    _check_dense(b=2, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 2, 8])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_ratios(ratio, causal):
    _check_dense(b=2, sq=300, sk=517, hq=8, hkv=8 // ratio, d=128, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp16(d, causal):
    _check_dense(b=2, sq=333, sk=1000, hq=4, hkv=2, d=d, causal=causal, dtype="fp16")


@pytest.mark.gpu
def test_rows_that_see_no_key_get_zero_dq():
    """Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k query rows see no key."""
    import torch

    dq, _, _ = _check_dense(b=2, sq=300, sk=70, hq=4, hkv=4, d=64, causal=True)
    assert torch.all(dq[:, : 300 - 70] == 0)


VARLEN = ([0, 5, 130, 64, 1, 0, 700], [3, 0, 200, 64, 7, 0, 650])


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqused,deterministic", [(False, False), (True, False), (False, True)],
                         ids=["all-keys", "seqused_k", "deterministic"])
def test_varlen_with_empty_sequences(causal, seqused, deterministic):
    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_varlen_ref, grad_atol
    from stage4_bwd_kernel import host

    lens_q, lens_k = VARLEN
    g = torch.Generator(device="cuda").manual_seed(1)
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32, device="cuda")
    q, do = (torch.randn(sum(lens_q), 8, 96, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(sum(lens_k), 2, 96, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    used = None
    if seqused:
        used_list = [min(n, u) for n, u in zip(lens_k, [2, 0, 150, 64, 7, 0, 333])]
        used = torch.tensor(used_list, dtype=torch.int32, device="cuda")
        keep = torch.cat([torch.arange(int(cu_k[i]), int(cu_k[i]) + u, device="cuda") for i, u in enumerate(used_list)])
        cu_used = torch.tensor(np.cumsum([0] + used_list), dtype=torch.int32, device="cuda")
        out, lse = attention_varlen_ref(q, k[keep], v[keep], cu_q, cu_used, causal=causal, upcast=True)
    else:
        out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, upcast=True)
    dq, dk, dv = _step().attention_varlen_backward(q, k, v, out, do, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                                   seqused_k=used, causal=causal, deterministic=deterministic)
    torch.cuda.synchronize()
    ref, base = host.reference_varlen_grads(q, k, v, do, cu_q, cu_k, seqused_k=used, causal=causal)
    for name, got, r, bl in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, base):
        assert not torch.isnan(got).any(), name
        assert_fa4_close(name, got, r, bl, atol=grad_atol(ref))
    if seqused:  # keys past seqused_k get exactly zero gradient
        for i, u in enumerate(used.tolist()):
            assert torch.all(dk[int(cu_k[i]) + u: int(cu_k[i + 1])] == 0)
            assert torch.all(dv[int(cu_k[i]) + u: int(cu_k[i + 1])] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,ratio", [(False, 1), (True, 4)], ids=["full-gqa1", "causal-gqa4"])
def test_deterministic_is_bitwise_reproducible(causal, ratio):
    """dq bitwise equal over 20 deterministic runs; dk / dv (no atomics) equal the atomic mode's."""
    import torch

    inputs = _inputs(2, 1000, 1200, 8, 8 // ratio, 128, seed=3)
    first = [t.clone() for t in _check_dense(b=2, sq=1000, sk=1200, hq=8, hkv=8 // ratio, d=128, causal=causal,
                                             deterministic=True, inputs=inputs)]
    q, k, v, do = inputs
    from stage0_reference.torch_reference import attention_ref

    out, lse = attention_ref(q, k, v, causal=causal, upcast=True)
    mod = _step()
    for _ in range(20):
        got = mod.attention_backward(q, k, v, out, do, lse, causal=causal, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(got, first))
    atomic = mod.attention_backward(q, k, v, out, do, lse, causal=causal, deterministic=False)
    assert torch.equal(atomic[1], first[1]) and torch.equal(atomic[2], first[2])


@pytest.mark.gpu
def test_unsupported_head_dim_refused_before_launch():
    import torch

    q, k, v, do = _inputs(1, 64, 64, 2, 2, 192)
    v, do = v[..., :128].contiguous(), do[..., :128].contiguous()
    out, lse = torch.zeros_like(do), torch.zeros(1, 2, 64, device="cuda")
    with pytest.raises(ValueError, match=r"head_dim: .*registers"):
        _step().attention_backward(q, k, v, out, do, lse)


@pytest.mark.gpu
def test_run_entry_point():
    res = _step().run(batch=1, seqlen_q=1024, heads=4, head_dim=128, causal=True, check=True)
    assert res["mode"] == "gpu" and res["tflops"] > 0 and res["ms_deterministic"] > 0
