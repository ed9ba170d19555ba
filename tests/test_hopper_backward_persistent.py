"""The persistent Hopper backward (``stage4_bwd_kernel/hopper/persistent.py``, ``options.persistent``):
one CTA per SM takes K/V tiles from a counter.

cpu tier: no configuration's options build it; attention_backward picks it per call where it measured
faster (``persistent_pays``: d = 128 calls of at most 2k keys, (128, 64) ones of 1k, queries x GQA
group within the same limit); the
option is refused where the kernel has no persistent path, naming it.

compile tier (sm_90a, fake tensors): d = 128, 96 and (128, 64) persistent builds (causal or not,
varlen + seqused_k, a window with softcap) have no spills and no serialized wgmma, and the
one-per-tile kernel's SMEM size.

gpu tier (H100/H200): on poisoned outputs, dq, dk and dv pass FA4's rule against fp32 autograd, and
dk / dv are the bits of the one-CTA-per-tile kernel (each K/V tile's walk is the same arithmetic;
only dQ's adds arrive in another order) -- odd shapes, GQA 1 / 2 / 6, more K/V tiles than SMs, a
window and softcap, varlen with empty sequences and seqused_k; and 20 back-to-back calls on one
input all give those bits (a race in the hand-offs would move them).
"""
from __future__ import annotations

import pytest
import test_hopper_variants as tv  # the variants' reference grads and rule (tests/ is on the path)
import test_stage4_hopper as s4  # the ladder's test helpers

pytestmark = pytest.mark.stage4

def _mod():
    return s4._step("hopper.backward")


@pytest.fixture(autouse=True)
def _hang_guard(request):
    """A GPU case that hangs (a protocol bug deadlocks the kernel) ends its process after 300 s with
    the Python stacks printed, so the rest of the tier still runs: xdist reports the crashed worker's
    test as failed and starts another worker."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    import faulthandler

    faulthandler.dump_traceback_later(300, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _run(q, k, v, out, do, lse, *, persistent, causal, window=(None, None), softcap=0.0, varlen=None, ctas=None):
    """(dq, dk, dv) of the production backward, persistent or one CTA per K/V tile, on poisoned outputs.
    varlen: None or (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k)."""
    from stage4_bwd_kernel import host

    mod = _mod()
    dq, dk, dv = s4._poisoned(q, k, v)
    extra = {}
    if varlen is not None:
        cu_q, cu_k, max_q, max_k, used = varlen
        extra = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, seqused_k=used)
    if ctas is not None:
        extra["persistent_ctas"] = ctas
    host.backward(*mod.with_options(persistent=persistent), q, k, v, out, do, lse, causal=causal, dq=dq, dk=dk,
                  dv=dv, variant=host.variant_of(causal, window, softcap), **extra)
    return dq, dk, dv


# ======================================================================================== cpu tier
@pytest.mark.cpu
def test_the_protocol_model_has_the_kernels_ring():
    """stage4_bwd_kernel/persistent_protocol.py models the kernel's record ring (tests/test_persistent_protocol.py)."""
    from stage4_bwd_kernel import persistent_protocol

    _mod()  # sets the arch before cutlass is imported
    from stage4_bwd_kernel.hopper import persistent

    assert persistent_protocol.RECORDS == persistent.RECORDS


@pytest.mark.cpu
def test_persistent_is_opt_in():
    """No configuration's options build persistent: the call picks it (persistent_pays) or an override does."""
    from stage4_bwd_kernel.hopper.options import BackwardOptions

    for d, dv in ((64, 64), (96, 96), (128, 128), (128, 64), (192, 128), (256, 256)):
        for causal in (False, True):
            for det in (False, True):
                for banded in (False, True):
                    assert not BackwardOptions.for_config(d, dv, causal, det, False, banded).persistent


@pytest.mark.cpu
@pytest.mark.parametrize("d,dv,det,sq,sk,hq,hkv,expected", [
    (128, 128, False, 2048, 2048, 2, 2, True), (128, 128, False, 2048, 2049, 2, 2, False),
    (128, 128, False, 2049, 2048, 2, 2, False), (128, 128, False, 1024, 1024, 6, 3, True),
    (128, 128, False, 1024, 1024, 6, 2, False),  # a K/V tile walks 3 heads' 1024 queries
    (128, 64, False, 1024, 1024, 2, 2, True), (128, 64, False, 2048, 2048, 2, 2, False),
    (128, 64, False, 1, 1, 1, 1, True), (128, 128, False, 16384, 16384, 2, 2, False),
    (128, 128, True, 1024, 1024, 2, 2, False), (96, 96, False, 1024, 1024, 2, 2, False),
    (64, 64, False, 1024, 1024, 2, 2, False), (192, 128, False, 1024, 1024, 2, 2, False)])
def test_the_persistent_build_is_picked_per_call(d, dv, det, sq, sk, hq, hkv, expected):
    """The measured choice (backward.persistent_pays): d = 128 / (128, 64) outside deterministic mode,
    keys and queries x GQA group within PERSISTENT_MAX_SEQLEN; and the build it names, dense and varlen
    (whose max_seqlen_q / _k count, not the packed lengths)."""
    import torch

    backward = s4._step("hopper.backward")
    assert backward.persistent_pays(d, dv, det, sq, sk, hq // hkv) is expected
    q = torch.empty(1, sq, hq, d, device="meta")
    k = torch.empty(1, sk, hkv, d, device="meta")
    v = torch.empty(1, sk, hkv, dv, device="meta")
    step, _ = backward._build_for(q, k, v, det, None)
    assert step == (backward.with_options(persistent=True)[0] if expected else backward.STEP)
    varlen_step, _ = backward._build_for(q[0, :1], k[0, :1], v[0, :1], det, None, sq, sk)
    assert varlen_step == step
    assert backward._build_for(q[0, :1], k[0, :1], v[0, :1], det, None, sq, sk + 0.5)[0] == backward.STEP
    assert backward._build_for(q, k, v, det, "rows")[0] == backward.STEP  # an explicit dQ order


@pytest.mark.cpu
@pytest.mark.parametrize("d,dv,causal,det,override", [
    (128, 128, True, True, {}), (64, 64, True, False, {}), (256, 256, False, False, {}),
    (128, 128, False, False, {"dq_frag": False}), (96, 96, False, False, {"dq_writers": 2, "dq_buffers": 2}),
    (128, 128, False, False, {"ds_buffers": 1})],
    ids=["deterministic", "kv_with_first", "wide", "row-order-dq", "two-writers", "staging-too-small"])
def test_persistent_is_refused_where_it_has_no_path(d, dv, causal, det, override):
    with pytest.raises(ValueError, match="persistent"):
        _mod().make_kernel(None, d, dv, causal, det, persistent=True, **override)


# ==================================================================================== compile tier
COMPILE_CASES = [dict(head_dim=128, causal=True), dict(head_dim=128, causal=False), dict(head_dim=96, causal=True),
                 dict(head_dim=128, head_dim_v=64, causal=False),
                 dict(head_dim=128, causal=True, varlen=True, has_seqused_k=True),
                 dict(head_dim=128, causal=True, window_size=(1024, 0), softcap=30.0)]


@pytest.mark.compile
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_persistent_compiles(case):
    mod = _mod()
    comp = mod.compile_only(persistent=True, **case)
    base = mod.compile_only(persistent=False, **case)
    r = comp.report
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
    assert not r["wgmma_serialized"], r["ptxas_log"]
    assert r["smem_bytes"] == base.report["smem_bytes"]
    assert r["HGMMA"] == base.report["HGMMA"]
    # the counter's hand-out: an atomic add whose old value is used (one per item taken, by the producer),
    # beside the dQ writer's arrival count (first stores) that both builds have
    assert comp.sass.count("ATOMG") == base.sass.count("ATOMG") + 1


# ======================================================================================== gpu tier
# (b, sq, sk, hq, hkv, d, dv, causal, window, softcap)
CASES = [
    (2, 1, 1, 2, 1, 128, 128, False, (None, None), 0.0),
    (2, 113, 203, 6, 1, 128, 128, True, (None, None), 0.0),
    (2, 799, 3, 6, 6, 96, 96, False, (None, None), 0.0),
    (2, 64, 1, 4, 2, 128, 128, True, (None, None), 0.0),
    (2, 255, 256, 4, 2, 128, 64, True, (None, None), 0.0),
    (2, 1023, 1024, 6, 3, 128, 128, False, (None, None), 0.0),
    (1, 4224, 4224, 2, 1, 128, 128, True, (None, None), 0.0),
    (4, 2048, 2048, 8, 4, 128, 128, True, (None, None), 0.0),    # 256 K/V tiles: more than SMs
    (4, 2048, 2048, 8, 4, 96, 96, False, (None, None), 0.0),
    (2, 1500, 1500, 4, 2, 128, 128, True, (256, None), 0.0),
    (2, 1023, 1024, 2, 2, 96, 96, False, (129, 300), 5.0),
    (2, 1000, 1500, 4, 4, 128, 128, False, (None, None), 30.0),
]


def _case_id(c):
    b, sq, sk, hq, hkv, d, dv, causal, window, softcap = c
    return f"b{b}-{sq}x{sk}-h{hq}/{hkv}-d{d}x{dv}-{'causal' if causal else 'full'}-w{window[0]},{window[1]}-cap{softcap:g}"


def _reference(q, k, v, do, causal, window, softcap):
    """(out, lse) of the fp32 forward, and test_hopper_variants' (fp32 reference, low-precision baseline)
    grads."""
    from stage0_reference.torch_reference import attention_ref

    variant = dict(causal=causal, window_size=window, softcap=softcap)
    out, lse = attention_ref(q, k, v, upcast=True, **variant)
    return (out.to(q.dtype), lse), *tv._variant_grads(q, k, v, do, variant)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_persistent_matches_the_one_per_tile_kernel(case):
    import torch

    b, sq, sk, hq, hkv, d, dv, causal, window, softcap = case
    q, k, v, do = s4._inputs(b, sq, sk, hq, hkv, d, dv, seed=sq + sk)
    (out, lse), ref, base = _reference(q, k, v, do, causal, window, softcap)
    got = _run(q, k, v, out, do, lse, persistent=True, causal=causal, window=window, softcap=softcap)
    plain = _run(q, k, v, out, do, lse, persistent=False, causal=causal, window=window, softcap=softcap)
    torch.cuda.synchronize()
    tv._check_grads(_case_id(case), got, ref, base, softcap)
    assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2]), "dk / dv differ from the one-per-tile kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqused", [False, True], ids=["all-keys", "seqused_k"])
def test_persistent_varlen_with_empty_sequences(causal, seqused):
    import numpy as np
    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_varlen_ref, grad_atol
    from stage4_bwd_kernel import host

    lens_q = [0, 5, 130, 64, 1, 0, 700, 333, 0, 2000]
    lens_k = [3, 0, 200, 64, 7, 0, 650, 1000, 5, 1900]
    q, k, v, do, cu_q, cu_k = s4._varlen_inputs(lens_q, lens_k, 8, 2, 128)
    used, k_used, v_used, cu_used = None, k, v, cu_k
    if seqused:
        used_list = [min(n, u) for n, u in zip(lens_k, [2, 0, 150, 64, 7, 0, 333, 1000, 0, 1200])]
        used = torch.tensor(used_list, dtype=torch.int32, device="cuda")
        keep = torch.cat([torch.arange(int(cu_k[i]), int(cu_k[i]) + u, device="cuda") for i, u in enumerate(used_list)])
        cu_used = torch.tensor(np.cumsum([0] + used_list), dtype=torch.int32, device="cuda")
        k_used, v_used = k[keep], v[keep]
    out, lse = attention_varlen_ref(q, k_used, v_used, cu_q, cu_used, causal=causal, upcast=True)
    out = out.to(q.dtype)
    varlen = (cu_q, cu_k, max(lens_q), max(lens_k), used)
    got = _run(q, k, v, out, do, lse, persistent=True, causal=causal, varlen=varlen)
    plain = _run(q, k, v, out, do, lse, persistent=False, causal=causal, varlen=varlen)
    torch.cuda.synchronize()
    ref, base = host.reference_varlen_grads(q, k, v, do, cu_q, cu_k, seqused_k=used, causal=causal)
    for name, a, r, bl in zip(("dq", "dk", "dv"), got, ref, base):
        assert not torch.isnan(a).any(), name
        assert_fa4_close(name, a, r, bl, atol=grad_atol(ref))
    assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2])


@pytest.mark.gpu
@pytest.mark.parametrize("ctas", [1, 3, 7])
def test_persistent_few_ctas_walk_many_tiles(ctas):
    """1, 3 or 7 CTAs take all 96 K/V tiles (causal, GQA 4, varied walk lengths): the item ring, the
    writer's record ring (4 slots) and the K/V stage wrap around many times; dk / dv stay the
    one-per-tile kernel's bits."""
    import torch

    q, k, v, do = s4._inputs(2, 1500, 1500, 8, 4, 128, 128, seed=ctas)
    (out, lse), ref, base = _reference(q, k, v, do, True, (None, None), 0.0)
    got = _run(q, k, v, out, do, lse, persistent=True, causal=True, ctas=ctas)
    plain = _run(q, k, v, out, do, lse, persistent=False, causal=True)
    torch.cuda.synchronize()
    tv._check_grads(f"{ctas} CTAs", got, ref, base, 0.0)
    assert torch.equal(got[1], plain[1]) and torch.equal(got[2], plain[2])


@pytest.mark.cpu
def test_persistent_ctas_is_checked():
    torch = pytest.importorskip("torch")
    from stage4_bwd_kernel import host

    mod = _mod()
    t = torch.zeros(1, 4, 2, 64)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="persistent_ctas"):
            host.backward(mod.STEP, mod.make_kernel, t, t, t, t, t, torch.zeros(1, 2, 4), persistent_ctas=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_persistent_repeats_its_bits(causal):
    """20 calls back to back on one input (a fresh counter each): dk / dv the same bits every time, dq
    within the rule every time (its adds may arrive in any order)."""
    import torch
    from stage0_reference.torch_reference import _max_abs_diff

    q, k, v, do = s4._inputs(4, 1536, 1536, 16, 4, 128, 128, seed=7)
    (out, lse), ref, base = _reference(q, k, v, do, causal, (None, None), 0.0)
    first = _run(q, k, v, out, do, lse, persistent=True, causal=causal)
    runs = [_run(q, k, v, out, do, lse, persistent=True, causal=causal) for _ in range(19)]
    torch.cuda.synchronize()
    tv._check_grads("first", first, ref, base, 0.0)
    for i, again in enumerate(runs):
        assert torch.equal(first[1], again[1]) and torch.equal(first[2], again[2]), f"run {i + 1}: dk / dv moved"
        assert _max_abs_diff(first[0], again[0]) <= 1e-2 * float(first[0].abs().max()), f"run {i + 1}: dq moved"
