"""Stage 4, the production Hopper backward at the wide head dims (192, 128) and (256, 256): both consumer
warpgroups on the same keys. (192, 128): 96 keys a CTA, S / dP split by keys, dK^T / dV^T with the head
dim as M (``stage4_bwd_kernel/hopper/wide_swap.py``); 256: 64 keys, S^T / dP^T split by queries, dV / dK
split by columns (``wide.py``, also built at (192, 128) by the ``kv_swap=False`` override). Both pass P
and dS through SMEM.

cpu tier: the design and SMEM plan each pair gets; other pairs refused by name.
compile tier (sm_90a, fake tensors): no spills or local memory, no serialized wgmma, five SS GEMMs
per tile body (no register-sourced A), one bulk dQ reduce per share (256: 16-byte reds from the
consumers, deterministic ones in turns on 160-thread barriers), the semaphores only in deterministic
mode; both designs at (192, 128).
gpu tier (H100/H200): dq / dk / dv under FA4's rule against fp32 autograd over odd seqlens, causal,
GQA 1 / 2 / 6, fp16, varlen with empty sequences and seqused_k, window and softcap; deterministic
mode bitwise equal over 100 runs with GQA and causal; outputs NaN-poisoned.
"""
from __future__ import annotations

import re

import pytest
import test_hopper_variants as variants  # the variant tests' reference helpers (tests/ is on the path)
import test_stage4_hopper as s4  # the ladder's test helpers: one checking rule

pytestmark = pytest.mark.stage4

STEP = "hopper.backward"
WIDE = [(192, 128), (256, 256)]
WIDE_IDS = [f"d{d}x{dv}" for d, dv in WIDE]


def _mod():
    return s4._step(STEP)


# ================================================================================== cpu tier
@pytest.mark.cpu
def test_wide_pairs_take_the_wide_design():
    from stage3_fwd_kernel.host_io import SMEM_BUDGET
    from stage4_bwd_kernel.hopper.options import smem_need

    mod = _mod()
    for (d, dv), keys, swap in zip(WIDE, (96, 64), (True, False)):
        k = mod.make_kernel(None, d, dv, True, False)
        assert (k.tile_m, k.tile_n, k.wide, k.kv_swap, k.dq_swap_ab, k.dq_split_m) == (64, keys, True, swap, False, False)
        assert mod.default_tiles(d, dv) == (64, keys)
        assert not (k.stats_shuffle or k.mask_offsets or k.q_shift or k.kv_with_first or k.key_select)
        need = smem_need(64, keys, d, dv, k.ds_buffers, 0 if k.dq_atomic else k.dq_buffers, k.num_stages, pt_buffers=1)
        assert need <= SMEM_BUDGET and k.num_stages == 2
        # dQ from registers only where a dQ buffer would cost the second Q / dO stage
        assert k.dq_atomic == (smem_need(64, keys, d, dv, 1, 1, 2, 1) > SMEM_BUDGET)
        assert k.dq_atomic or k.dq_buffers == 2 or smem_need(64, keys, d, dv, 1, 2, 2, 1) > SMEM_BUDGET
    # the 64-key design stays buildable at (192, 128), for comparison; the 96-key one is (192, 128)'s only
    k64 = mod.make_kernel(None, 192, 128, False, False, kv_swap=False)
    assert (k64.tile_n, k64.kv_swap, k64.num_stages, k64.dq_atomic) == (64, False, 2, False)
    with pytest.raises(ValueError, match="kv_swap"):
        mod.make_kernel(None, 256, 256, False, True, kv_swap=True)
    # a caller's tiles are held to the design the options build
    assert mod.make_kernel(None, 192, 128, False, False, tiles=(64, 64), kv_swap=False).tile_n == 64
    with pytest.raises(ValueError, match="tiles"):
        mod.make_kernel(None, 192, 128, False, False, tiles=(64, 96), kv_swap=False)
    with pytest.raises(ValueError, match="tiles"):
        mod.make_kernel(None, 192, 128, False, False, tiles=(64, 64))
    # deterministic mode as the default: the writer warp at (192, 128), the consumers' reds at 256 (in
    # turns that the writer's warps keep), two stages both
    det = [mod.make_kernel(None, d, dv, True, True) for d, dv in WIDE]
    assert [(k.num_stages, k.dq_atomic) for k in det] == [(2, False), (2, True)]
    assert [mod.make_kernel(None, d, dv, False, False).dq_atomic for d, dv in WIDE] == [False, True]
    with pytest.raises(ValueError, match="dq_atomic"):
        mod.make_kernel(None, 128, 128, False, True, dq_atomic=True)
    # the writer of before stays buildable at 256 (one stage), for comparison
    old = mod.make_kernel(None, 256, 256, False, True, dq_atomic=False, stages=1, dq_buffers=1)
    assert (old.num_stages, old.dq_atomic) == (1, False)
    # the turn barriers (ids 6 .. 9) are counted: 10 ids (the default 256 build counts the writer's: 9)
    assert (det[1].num_barriers, mod.make_kernel(None, 256, 256, False, False).num_barriers) == (10, 9)
    assert not mod.make_kernel(None, 128, 128, False, False).wide
    with pytest.raises(ValueError, match="head_dim"):
        mod.make_kernel(None, 192, 192, False, False)


@pytest.mark.cpu
@pytest.mark.parametrize("override,name", [(dict(stats_shuffle=True), "stats_shuffle"), (dict(q_shift=True), "q_shift"),
                                           (dict(ds_buffers=2), "ds_buffers"), (dict(kv_with_first=True), "kv_with_first"),
                                           (dict(dq_atomic=False), "shared memory")])
def test_options_the_wide_body_has_no_path_for_are_refused(override, name):
    """Overrides that would build a wide kernel the body ignores, or one past 227 KB of SMEM (256 with
    the writer's dQ buffer and two stages), fail by name before anything compiles."""
    with pytest.raises(ValueError, match=name):
        _mod().make_kernel(None, 256, 256, True, False, **override)


@pytest.mark.cpu
def test_every_head_dim_is_served_by_the_production_kernel(monkeypatch):
    from stage4_bwd_kernel import host
    from stage4_bwd_kernel import hopper as bwd
    from stage4_bwd_kernel.hopper import backward as product

    for d in (64, 96, 128, 192, 256):
        assert bwd.step_for(d, False, False) is bwd.step_for(d, True, True)
        assert bwd.step_for(d, False, False).STEP == "hopper_bwd"
    # the public entry hands window / softcap to the production kernel at a wide head dim; a plain
    # call's defaults make no variant (its cache keys stay those of a plain build)
    seen = {}
    monkeypatch.setattr(product, "attention_backward", lambda *args, **kw: seen.update(kw) or ("dq", "dk", "dv"))
    assert bwd.attention_backward(*[None] * 6, window_size=(8, 8), softcap=5.0) == ("dq", "dk", "dv")
    assert (seen["window_size"], seen["softcap"]) == ((8, 8), 5.0)
    assert host.variant_of(False, (8, 8), 5.0) is not None and host.variant_of(False, (None, None), 0.0) is None


# ================================================================================== compile tier
COMPILE_CASES = [("bf16", 192, 128, False, False, False, True), ("bf16", 192, 128, True, True, False, True),
                 ("fp16", 192, 128, True, False, True, True), ("bf16", 192, 128, True, False, False, False),
                 ("bf16", 256, 256, False, False, False, False), ("bf16", 256, 256, True, True, False, False),
                 ("bf16", 256, 256, True, False, True, False), ("bf16", 256, 256, False, True, True, False)]
COMPILE_IDS = [f"{dt}-d{d}x{dv}-{'causal' if c else 'full'}-{'det' if det else 'default'}{'-varlen' if vl else ''}"
               f"{'' if swap or d == 256 else '-64keys'}" for dt, d, dv, c, det, vl, swap in COMPILE_CASES]


@pytest.mark.compile
@pytest.mark.parametrize("dtype,d,dv,causal,det,varlen,swap", COMPILE_CASES, ids=COMPILE_IDS)
def test_wide_compiles_sm90a(dtype, d, dv, causal, det, varlen, swap):
    mod = _mod()
    design = {} if swap or d == 256 else dict(kv_swap=False)
    comp = mod.compile_only(dtype=dtype, head_dim=d, head_dim_v=dv, causal=causal, deterministic=det, varlen=varlen,
                            has_seqused_k=varlen, **design)
    rep, sass, ptx = comp.report, comp.sass, comp.ptx
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["LDL/STL"] == 0, rep
    assert rep["registers"] <= 168 and rep["smem_bytes"] <= 227 * 1024
    assert rep["wgmma_serialized"] == [], rep["ptxas_log"]
    # per tile body and warpgroup, three bodies (masked, unmasked, masked), every A from SMEM. 64 keys:
    # S^T (d / 16 k-steps), dP^T (dv / 16), dV, dQ, dK (64 / 16 each); 96 keys: S, dP as before, dV^T and
    # dK^T (dv / 64 and d / 64 M-atoms x 64 / 16), dQ (96 / 16)
    if swap:
        assert rep["HGMMA"] == 3 * (d // 16 + dv // 16 + (dv // 64 + d // 64) * (64 // 16) + 96 // 16)
    else:
        assert rep["HGMMA"] == 3 * (d // 16 + dv // 16 + 3 * 64 // 16)
    assert not re.search(r"\bHGMMA\.\S+\s+R\d+,\s*R\d+,\s*gdesc", sass), "a register-sourced wgmma"
    kernel = mod.make_kernel(None, d, dv, causal, det, **design)
    if kernel.dq_atomic:  # 256: 16-byte reds from the consumers (in turns when deterministic), no bulk reduce
        assert len(re.findall(r"red\.global\.add\.v4\.f32", ptx)) == 3 * 64 * d // 2 // 128 // 4
        assert not re.search(r"\bUBLKRED\b", sass)
    else:
        assert re.search(r"\bUBLKRED\b", sass) and not re.search(r"\bREDG?\.E\.ADD\.F32", sass)
    # deterministic: the semaphores' acquire spin; else, with the writer warp, first stores' (dq_writer.py)
    assert ("ld.global.acquire.gpu.b32" in ptx) == (det or kernel.dq_first_store)
    assert kernel.dq_first_store == (not det and not kernel.dq_atomic and causal)
    if det and kernel.dq_atomic:  # the turn warps: each warpgroup meets its own with 160 threads, twice a tile
        assert len(re.findall(r"bar\.sync\s+\S+, 160;", ptx)) >= 2 and len(re.findall(r"bar\.arrive\s+\S+, 160;", ptx)) >= 2
    # "sdSt free": each warpgroup syncs its own id and arrives on the other's (256 threads)
    assert re.search(r"bar\.sync\s+\S+, 256;", ptx) and re.search(r"bar\.arrive\s+\S+, 256;", ptx)


# ================================================================================== gpu tier
SEQLENS = [(1, 1), (3, 3), (64, 1), (239, 1), (799, 3), (113, 203), (255, 256), (1023, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", WIDE, ids=WIDE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
def test_wide_backward_matches_reference(d, dv, causal, sq, sk):
    hkv = [1, 2, 6][(sq + sk + d) % 3]       # GQA 6 / 3 / 1 cycled over the cases
    s4._check_dense(STEP, b=2, sq=sq, sk=sk, hq=6, hkv=hkv, d=d, dv=dv, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", WIDE, ids=WIDE_IDS)
def test_wide_long_sequence_and_fp16(d, dv):
    s4._check_dense(STEP, b=1, sq=4224, sk=4224, hq=2, hkv=1, d=d, dv=dv, causal=True)
    s4._check_dense(STEP, b=2, sq=333, sk=1000, hq=4, hkv=2, d=d, dv=dv, causal=False, dtype="fp16",
                    softmax_scale=0.05)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", WIDE, ids=WIDE_IDS)
@pytest.mark.parametrize("sq", [64, 128, 192, 320])
def test_wide_walk_lengths(d, dv, sq):
    """One CTA walks 1..5 Q tiles: the P^T / dS^T slots' "free" barriers, the dQ buffer's "empty" waits
    ((192, 128)) and, deterministic at 256, the turn warps' two barriers all turn over."""
    for causal in (False, True):
        for det in (False, True):
            s4._check_dense(STEP, b=1, sq=sq, sk=64, hq=1, hkv=1, d=d, dv=dv, causal=causal, deterministic=det)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", WIDE, ids=WIDE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("det", [False, True], ids=["default", "det"])
def test_wide_varlen_with_empty_sequences_and_seqused_k(d, dv, causal, det):
    import numpy as np
    import torch
    from stage0_reference.torch_reference import assert_fa4_close, grad_atol
    from stage4_bwd_kernel import host
    from stage0_reference.torch_reference import attention_varlen_ref

    lens_q, lens_k = s4.VARLEN
    used_list = [min(n, u) for n, u in zip(lens_k, [2, 0, 150, 64, 7, 0, 333])]
    g = torch.Generator(device="cuda").manual_seed(d + causal)
    cu_q = torch.tensor(np.cumsum([0] + lens_q), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.cumsum([0] + lens_k), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), 6, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(sum(lens_k), 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(sum(lens_k), 2, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(sum(lens_q), 6, dv, device="cuda", dtype=torch.bfloat16, generator=g)
    used = torch.tensor(used_list, dtype=torch.int32, device="cuda")
    keep = torch.cat([torch.arange(int(cu_k[i]), int(cu_k[i]) + u, device="cuda") for i, u in enumerate(used_list)])
    cu_used = torch.tensor(np.cumsum([0] + used_list), dtype=torch.int32, device="cuda")
    out, lse = attention_varlen_ref(q, k[keep], v[keep], cu_q, cu_used, causal=causal, upcast=True)
    run = lambda: _mod().attention_varlen_backward(q, k, v, out, do, lse, cu_q, cu_k, max(lens_q), max(lens_k),
                                                   seqused_k=used, causal=causal, deterministic=det)
    dq, dk, dv_ = run()
    torch.cuda.synchronize()
    if det:  # the ordered adds over packed sequences (semaphores per sequence's dQ tiles) repeat bitwise
        assert all(torch.equal(a, b) for a, b in zip(run(), (dq, dk, dv_)))
    ref, base = host.reference_varlen_grads(q, k, v, do, cu_q, cu_k, seqused_k=used, causal=causal)
    for name, a, r, bl in zip(("dq", "dk", "dv"), (dq, dk, dv_), ref, base):
        assert not torch.isnan(a).any(), name
        assert_fa4_close(name, a, r, bl, atol=grad_atol(ref))
    for i, u in enumerate(used_list):  # keys past seqused_k get exactly zero gradient
        assert torch.all(dk[int(cu_k[i]) + u: int(cu_k[i + 1])] == 0)
        assert torch.all(dv_[int(cu_k[i]) + u: int(cu_k[i + 1])] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", WIDE, ids=WIDE_IDS)
def test_wide_deterministic_is_bitwise_reproducible(d, dv):
    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref, grad_atol
    from stage4_bwd_kernel import host

    mod = _mod()
    q, k, v, do = s4._inputs(2, 700, 900, 6, 2, d, dv, seed=5)
    out, lse = attention_ref(q, k, v, causal=True, upcast=True)
    first = [t.clone() for t in mod.attention_backward(q, k, v, out, do, lse, causal=True, deterministic=True)]
    ref, base = host.reference_grads(q, k, v, do, causal=True)
    for name, a, r, bl in zip(("dq", "dk", "dv"), first, ref, base):
        assert_fa4_close(name, a, r, bl, atol=grad_atol(ref))
    dq, dk, dv_ = s4._poisoned(q, k, v)
    for _ in range(100):
        mod.attention_backward(q, k, v, out, do, lse, causal=True, deterministic=True, dq=dq, dk=dk, dv=dv_)
        assert torch.equal(dq, first[0]) and torch.equal(dk, first[1]) and torch.equal(dv_, first[2])


# (sq, sk, hq, hkv, d, dv, causal, window, softcap)
VARIANT_CASES = [(113, 203, 6, 1, 192, 128, False, (40, 7), 0.0), (799, 3, 6, 6, 256, 256, False, (None, 1), 30.0),
                 (1023, 1024, 6, 3, 192, 128, True, (257, None), 20.0), (1500, 700, 4, 2, 256, 256, True, (64, 0), 0.0)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", VARIANT_CASES, ids=[
    f"{c[0]}x{c[1]}-d{c[4]}x{c[5]}-{'causal' if c[6] else 'full'}-w{c[7][0]},{c[7][1]}-cap{c[8]:g}"
    for c in VARIANT_CASES])
def test_wide_window_and_softcap(case):
    import torch
    from stage0_reference.torch_reference import attention_ref
    from stage4_bwd_kernel import hopper as bwd

    sq, sk, hq, hkv, d, dv, causal, window, softcap = case
    q, k, v = variants._qkv(2, sq, sk, hq, hkv, d, dv, "bf16", sq + sk)
    g = torch.Generator(device="cuda").manual_seed(sq)
    dout = torch.randn(q.shape[:3] + (dv,), device="cuda", dtype=q.dtype, generator=g)
    variant = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = attention_ref(q, k, v, upcast=True, **variant)
    dq, dk, dv_ = (torch.full_like(t, float("nan")) for t in (q, k, v))
    det = d == 256  # the windowed dQ order: a band's first / last key tile set the adds' ranks
    got = bwd.attention_backward(q, k, v, out.to(q.dtype), dout, lse, dq=dq, dk=dk, dv=dv_, deterministic=det,
                                 **variant)
    ref, base = variants._variant_grads(q, k, v, dout, variant)
    variants._check_grads(str(case), got, ref, base, softcap)
    if det:
        again = bwd.attention_backward(q, k, v, out.to(q.dtype), dout, lse, deterministic=True, **variant)
        assert all(torch.equal(a, b) for a, b in zip(again, got))
