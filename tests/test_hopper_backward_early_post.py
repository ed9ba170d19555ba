"""The early postprocess (``options.early_postprocess``, stage4_bwd_kernel/hopper/dq_writer.py and
postprocess_frag.py): the dQ postprocess is launched as a programmatic dependent of the main kernel and
converts each dQ tile once the main kernel's done words say that every K/V tile reaching it has added
into it (or once every main CTA has left).

cpu tier: the combinations it is refused in, naming it; the postprocess refuses to run without the
counters or the main kernel's CTA count.

compile tier (sm_90a, fake tensors): the main kernel counts its tiles (an acq_rel atomic per tile, a
release add when it completes one or leaves), without spills; the postprocess waits on the main kernel
(griddepcontrol.wait, SASS ACQBULK) only in this mode.

gpu tier (H100/H200): with the allocator's free memory filled with NaN before each call, dq, dk and dv
pass FA4's rule against fp32 autograd in repeated calls, with and without first stores, GQA, windows,
rows that no key reaches (converted only once every CTA has left) and varlen sequences without keys;
and work queued right after the backward sees its final dq, dk and dv.
"""
from __future__ import annotations

import re

import pytest
import test_hopper_backward_first_store as fs  # its cases, NaN-filled allocator and varlen case
import test_hopper_backward_persistent as tp  # its fp32 forward + grads reference (tests/ is on the path)
import test_hopper_variants as tv  # the variants' rule
import test_stage4_hopper as s4  # the ladder's test helpers

pytestmark = pytest.mark.stage4


def _mod():
    return s4._step("hopper.backward")


# ======================================================================================== cpu tier
@pytest.mark.cpu
@pytest.mark.parametrize("d,dv,det,override", [
    (128, 128, True, {}), (128, 128, False, dict(persistent=True)), (256, 256, False, {}),
    (128, 128, False, dict(dq_frag=False))])
def test_early_postprocess_is_refused_where_the_tiles_are_not_counted(d, dv, det, override):
    with pytest.raises(ValueError, match="early_postprocess"):
        _mod().make_kernel(None, d, dv, False, det, early_postprocess=True, **override)


@pytest.mark.cpu
def test_an_early_postprocess_needs_the_counters_and_the_cta_count():
    import torch
    from stage4_bwd_kernel import postprocess_frag

    kernel = _mod().make_kernel(None, 128, 128, False, False, early_postprocess=True)
    dq = torch.empty(1, 64, 2, 128, device="meta")
    with pytest.raises(ValueError, match="arrivals"):
        postprocess_frag.postprocess(kernel, None, dq, 1.0)
    counters = torch.empty(1, 2, 1, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="main_ctas"):
        postprocess_frag.postprocess(kernel, None, dq, 1.0, arrivals=counters)


# ==================================================================================== compile tier
@pytest.mark.compile
@pytest.mark.parametrize("case", [dict(head_dim=128, causal=False), dict(head_dim=64, causal=True),
                                  dict(head_dim=96, causal=False, varlen=True),
                                  dict(head_dim=128, causal=True, window_size=(1024, 0))],
                         ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_early_postprocess_builds_count_their_tiles(case):
    comp = _mod().compile_only(early_postprocess=True, **case)
    off = _mod().compile_only(**case)
    r = comp.report
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and not r["wgmma_serialized"], r
    # an acq_rel atomic on a tile's done word (the PTX default scope is gpu), inlined twice: each tile one
    # tile late, and the walk's last one at the end
    acq_rel = re.compile(r"atom\.global\.acq_rel(\.gpu)?\.add")
    assert len(acq_rel.findall(comp.ptx)) == 2 + len(acq_rel.findall(off.ptx))
    # release adds: a completed tile, the writer's exit, an idle CTA's exit
    assert comp.ptx.count("red.relaxed.gpu.global.add") >= 3 + off.ptx.count("red.relaxed.gpu.global.add")
    assert "griddepcontrol.launch_dependents" in comp.ptx and "griddepcontrol" not in off.ptx


@pytest.mark.compile
def test_only_the_early_postprocess_waits_on_the_main_kernel():
    from stage4_bwd_kernel import common, postprocess_frag

    bf16 = common.cutlass_dtype("bf16")
    early = postprocess_frag.compile_only(_mod().make_kernel(bf16, 128, 128, False, False, early_postprocess=True))
    plain = postprocess_frag.compile_only(_mod().make_kernel(bf16, 128, 128, False, False))
    assert early.report["spill_stores"] == 0
    assert "ACQBULK" in early.sass and "ACQBULK" not in plain.sass  # griddepcontrol.wait
    assert "ld.global.acquire.gpu" in early.ptx and "ld.global.acquire.gpu" not in plain.ptx


# ======================================================================================== gpu tier
def _early(first_store=None):
    overrides = dict(early_postprocess=True)
    if first_store is not None:
        overrides["dq_first_store"] = first_store
    return _mod().with_options(**overrides)


@pytest.mark.gpu
@pytest.mark.parametrize("case", fs.CASES, ids=[fs._case_id(c) for c in fs.CASES])
def test_early_postprocess_on_stale_memory(case):
    import torch
    from stage0_reference.torch_reference import visible_mask
    from stage0_reference.validation import normalize_window
    from stage4_bwd_kernel import host

    b, sq, sk, hq, hkv, d, dv, causal, window = case
    q, k, v, do = s4._inputs(b, sq, sk, hq, hkv, d, dv, seed=sq + 5 * sk)
    (out, lse), ref, base = tp._reference(q, k, v, do, causal, window, 0.0)
    empty = ~visible_mask(sq, sk, normalize_window(window, causal), "cuda").any(-1)  # rows that see no key
    for i in range(3):
        dq, dk, dv_ = s4._poisoned(q, k, v)
        fs._nan_filled_allocator()
        host.backward(*_early(), q, k, v, out, do, lse, causal=causal, dq=dq, dk=dk, dv=dv_,
                      variant=host.variant_of(causal, window, 0.0))
        torch.cuda.synchronize()
        tv._check_grads(f"{fs._case_id(case)} call {i}", (dq, dk, dv_), ref, base, 0.0)
        assert dq[:, empty].eq(0).all(), "rows that no key reaches must get dq = 0"


@pytest.mark.gpu
@pytest.mark.parametrize("d,first_store", [(64, False), (128, True), (128, False)])
def test_early_postprocess_many_ctas(d, first_store):
    """4224 x 4224 with GQA: 33 K/V tiles reach every dQ tile, in five calls on stale memory; with first
    stores forced on or off (the done words must count either kind of add)."""
    import torch
    from stage4_bwd_kernel import host

    q, k, v, do = s4._inputs(1, 4224, 4224, 4, 2, d, d, seed=17 + d)
    (out, lse), ref, base = tp._reference(q, k, v, do, False, (None, None), 0.0)
    for i in range(5):
        dq, dk, dv = s4._poisoned(q, k, v)
        fs._nan_filled_allocator()
        host.backward(*_early(first_store), q, k, v, out, do, lse, dq=dq, dk=dk, dv=dv)
        torch.cuda.synchronize()
        tv._check_grads(f"call {i}", (dq, dk, dv), ref, base, 0.0)


@pytest.mark.gpu
def test_varlen_early_postprocess():
    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_varlen_ref, grad_atol
    from stage4_bwd_kernel import host

    lens_q, lens_k, hq, hkv = fs.VARLEN_CASES[1]
    torch.manual_seed(5)
    d = 128
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q), hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lens_k), hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    ref, base = host.reference_varlen_grads(q, k, v, do, cu_q, cu_k, causal=True)
    for i in range(3):
        fs._nan_filled_allocator()
        dq, dk, dv = host.backward(*_early(), q, k, v, out, do, lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                   max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=True)
        torch.cuda.synchronize()
        for name, a, r, bl in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, base):
            assert not torch.isnan(a).any(), f"call {i}: {name}"
            assert_fa4_close(f"call {i}: {name}", a, r, bl, atol=grad_atol(ref))


@pytest.mark.gpu
def test_work_queued_after_the_backward_sees_its_results():
    """The postprocess may finish its tiles before the main kernel's last CTAs have stored dK / dV; the
    stream's next kernel must still start after both. Copies queued right after each call (no sync)
    must equal the results read after a sync."""
    import torch
    from stage4_bwd_kernel import host

    q, k, v, do = s4._inputs(2, 4096, 4096, 8, 8, 128, 128, seed=23)
    out, lse = tp._reference(q, k, v, do, True, (None, None), 0.0)[0]
    for i in range(5):
        dq, dk, dv = s4._poisoned(q, k, v)
        host.backward(*_early(), q, k, v, out, do, lse, causal=True, dq=dq, dk=dk, dv=dv)
        copies = [t.clone() for t in (dq, dk, dv)]  # queued on the same stream, no sync in between
        torch.cuda.synchronize()
        for name, c, t in zip(("dq", "dk", "dv"), copies, (dq, dk, dv)):
            assert torch.equal(c, t) and not torch.isnan(c).any(), f"call {i}: {name}"
