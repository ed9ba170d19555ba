"""Rotated walks (``options.rotate_walk``, stage4_bwd_kernel/hopper/walk.py): each K/V tile's CTA starts its
walk at its own Q tile, spread over the walk, and wraps; every role (producer, consumers, dQ writer, the
persistent build's record ring) visits the same tiles in the same rotated order.

cpu tier: every role's order replayed on random walks; the option is refused, naming it, outside plain
non-causal walks (causal and banded walks already start staggered) and in deterministic mode.

compile tier (sm_90a, fake tensors): the rotated builds compile without spills or serialized wgmmas, with
the consumers' loop bodies twice over (each segment cut at the wrap). They are the default for plain
non-causal walks at d = 64 and 128 / (128, 64) (``options.rotation_pays``).

gpu tier (H100/H200): with first stores on (nobody zeroes dQaccum) and the allocator's free memory filled
with NaN, dq, dk and dv pass FA4's rule against fp32 autograd -- odd shapes, GQA, both wide and narrow head
dims, partial last Q tiles (masked in the middle of a rotated walk), the persistent build with a few CTAs
taking many walks (GQA groups), and varlen batches with sequences without queries or keys.
"""
from __future__ import annotations

import pytest
import test_hopper_backward_first_store as tfs  # the NaN-filled allocator
import test_hopper_backward_persistent as tp  # its fp32 forward + grads reference (tests/ is on the path)
import test_hopper_variants as tv  # the variants' rule
import test_stage4_hopper as s4  # the ladder's test helpers

pytestmark = pytest.mark.stage4
_hang_guard = tp._hang_guard  # autouse: a GPU case that deadlocks ends its process after 300 s


def _mod():
    return s4._step("hopper.backward")


# ======================================================================================== cpu tier
@pytest.mark.cpu
@pytest.mark.parametrize("causal,det,window", [(False, True, None), (True, False, None), (False, False, (64, 64))],
                         ids=["deterministic", "causal", "band"])
def test_rotated_walks_are_refused_outside_plain_non_causal_walks(causal, det, window):
    from stage3_fwd_kernel.components.window import NO_WINDOW, Window

    w = NO_WINDOW if window is None else Window(*window)
    with pytest.raises(ValueError, match="rotate_walk"):
        _mod().make_kernel(None, 128, 128, causal, det, window=w, rotate_walk=True)


# ==================================================================================== compile tier
# first stores where the dQ path has them (256 adds dQ from the consumers' registers: dq_atomic)
COMPILE_CASES = [dict(head_dim=128), dict(head_dim=64), dict(head_dim=192, head_dim_v=128),
                 dict(head_dim=128, persistent=True), dict(head_dim=96, varlen=True, has_seqused_k=True),
                 dict(head_dim=128, head_dim_v=64, varlen=True), dict(head_dim=256, dq_first_store=False)]


@pytest.mark.compile
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_rotated_builds_compile(case):
    mod = _mod()
    case = dict(case)
    first_store = case.pop("dq_first_store", True)
    comp = mod.compile_only(rotate_walk=True, dq_first_store=first_store, **case)
    base = mod.compile_only(rotate_walk=False, **case)
    r = comp.report
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
    assert not r["wgmma_serialized"], r["ptxas_log"]
    assert r["smem_bytes"] == base.report["smem_bytes"]
    assert r["HGMMA"] == 2 * base.report["HGMMA"]  # the consumers' bodies before and after the wrap


# ======================================================================================== gpu tier
# (b, sq, sk, hq, hkv, d, dv, causal, window, persistent CTAs: 0 for one CTA per K/V tile, None for one per SM)
CASES = [
    (2, 1, 1, 2, 1, 128, 128, False, (None, None), 0),
    (2, 113, 203, 6, 1, 128, 128, False, (None, None), None),
    (2, 799, 3, 6, 6, 64, 64, False, (None, None), 0),
    (1, 4224, 4224, 2, 1, 128, 128, False, (None, None), 0),
    (1, 4224, 4224, 2, 2, 64, 64, False, (None, None), 0),
    (2, 1023, 1024, 4, 2, 192, 128, False, (None, None), 0),
    (2, 2048, 2048, 8, 4, 128, 128, False, (None, None), 7),      # 128 K/V tiles on 7 CTAs: GQA walks in a row
    (2, 1499, 1501, 8, 2, 128, 128, False, (None, None), 5),      # the same, partial last Q and K/V tiles
    (2, 3000, 1000, 4, 2, 96, 96, False, (None, None), 0),
    (2, 1000, 700, 4, 2, 128, 64, False, (None, None), 0),
    (1, 2000, 2003, 6, 1, 64, 64, False, (None, None), 0),        # GQA 6
]


def _case_id(c):
    b, sq, sk, hq, hkv, d, dv, causal, window, ctas = c
    walk = "" if ctas == 0 else "-persistent" + ("" if ctas is None else str(ctas))
    return f"b{b}-{sq}x{sk}-h{hq}/{hkv}-d{d}x{dv}-{'causal' if causal else 'full'}-w{window[0]},{window[1]}{walk}"


def _run(q, k, v, out, do, lse, *, causal, window=(None, None), ctas=0, varlen=None):
    """(dq, dk, dv) of the rotated build with first stores, on poisoned outputs and NaN-filled free memory.
    ctas: 0 (one CTA per K/V tile), None (persistent, one per SM) or the persistent CTAs; varlen: None or
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)."""
    from stage4_bwd_kernel import host

    dq, dk, dv = s4._poisoned(q, k, v)
    extra = {}
    if varlen is not None:
        extra = dict(zip(("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"), varlen))
    if ctas:
        extra["persistent_ctas"] = ctas
    tfs._nan_filled_allocator()
    host.backward(*_mod().with_options(rotate_walk=True, dq_first_store=True, persistent=ctas != 0), q, k, v, out,
                  do, lse, causal=causal, dq=dq, dk=dk, dv=dv, variant=host.variant_of(causal, window, 0.0), **extra)
    return dq, dk, dv


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_rotated_walks_within_the_rule(case):
    import torch

    b, sq, sk, hq, hkv, d, dv, causal, window, ctas = case
    q, k, v, do = s4._inputs(b, sq, sk, hq, hkv, d, dv, seed=7 * sq + sk)
    (out, lse), ref, base = tp._reference(q, k, v, do, causal, window, 0.0)
    for call in range(2):  # a second call on the first one's stale accumulator
        got = _run(q, k, v, out, do, lse, causal=causal, window=window, ctas=ctas)
        torch.cuda.synchronize()
        tv._check_grads(f"{_case_id(case)} call {call}", got, ref, base, 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("persistent", [False, True], ids=["per-tile", "persistent"])
def test_rotated_varlen_with_empty_sequences(persistent):
    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_varlen_ref, grad_atol
    from stage4_bwd_kernel import host

    lens_q = [0, 5, 130, 64, 1, 0, 700, 333, 0, 2000]
    lens_k = [3, 0, 200, 64, 7, 0, 650, 1000, 5, 1900]
    q, k, v, do, cu_q, cu_k = s4._varlen_inputs(lens_q, lens_k, 8, 2, 128)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=False, upcast=True)
    got = _run(q, k, v, out.to(q.dtype), do, lse, causal=False, ctas=3 if persistent else 0,
               varlen=(cu_q, cu_k, max(lens_q), max(lens_k)))
    torch.cuda.synchronize()
    ref, base = host.reference_varlen_grads(q, k, v, do, cu_q, cu_k, causal=False)
    for name, a, r, bl in zip(("dq", "dk", "dv"), got, ref, base):
        assert not torch.isnan(a).any(), name
        assert_fa4_close(name, a, r, bl, atol=grad_atol(ref))
    empty = torch.cat([torch.full((n,), m == 0, device="cuda") for n, m in zip(lens_q, lens_k)])
    assert empty.any() and got[0][empty].eq(0).all(), "rows of a sequence without keys must get dq = 0"


@pytest.mark.cpu
@pytest.mark.parametrize("d,dv,causal,banded,det,expected", [
    (128, 128, False, False, False, True), (64, 64, False, False, False, True), (128, 64, False, False, False, True),
    (96, 96, False, False, False, False), (192, 128, False, False, False, False),
    (256, 256, False, False, False, False),
    (128, 128, True, False, False, False), (64, 64, False, True, False, False), (128, 128, False, False, True, False)])
def test_rotated_walks_are_the_default_where_they_measured_faster(d, dv, causal, banded, det, expected):
    from stage4_bwd_kernel.hopper.options import BackwardOptions

    _mod()
    for varlen in (False, True):
        options = BackwardOptions.for_config(d, dv, causal, det, varlen, banded)
        # d = 64 varlen walks in order (the rotated build spilled there), with first stores
        assert options.rotate_walk is (expected and not (varlen and d == 64))
        assert not expected or options.dq_first_store  # a rotated walk's K/V tiles arrive one after another
        assert not BackwardOptions.for_config(d, dv, causal, det, varlen, banded, softcap=True).rotate_walk


@pytest.mark.cpu
def test_every_role_walks_the_same_rotated_order():
    """The consumers' loops (rotated runs cut by the masked / unmasked segments, consumer.py) and the
    producer's and dQ writer's position loop (schedule.rotated_m, walk.py's m_at) give every Q tile of a
    walk the same position, each tile once; and a head's K/V tiles start at distinct Q tiles where the walk
    has at least as many Q tiles as there are K/V tiles."""
    import random

    from stage3_fwd_kernel.components.window import Window
    from stage4_bwd_kernel import schedule

    rng = random.Random(5)
    for _ in range(400):
        tm, tn = rng.choice([(128, 128), (80, 128), (64, 128), (64, 96), (64, 64)])
        sq, sk = rng.randint(1, 3000), rng.randint(1, 3000)
        # the kernels rotate plain non-causal walks only; the order holds for any walk
        causal = rng.random() < 0.3
        window = None
        if rng.random() < 0.3:
            window = Window(rng.choice([None, rng.randint(0, 700)]), 0 if causal else rng.randint(0, 700))
        firsts = []
        for n in range((sk + tn - 1) // tn):
            lo_m, hi_m = schedule.m_block_range(n, tm, tn, sq, sk, causal, window=window)
            rot = schedule.walk_rotation(n, tn, sk, lo_m, hi_m)
            producer = [(p - lo_m, schedule.rotated_m(p, lo_m, hi_m, rot)) for p in range(lo_m, hi_m)]
            hot_lo, hot_hi = schedule.unmasked_m_range(n, tm, tn, sq, sk, causal, lo_m, hi_m, window=window)
            consumer = []
            for run_lo, run_hi, shift in schedule.rotated_runs(lo_m, hi_m, rot):
                for seg_lo, seg_hi in ((lo_m, hot_lo), (hot_lo, hot_hi), (hot_hi, hi_m)):
                    a, b = schedule.run_segment(seg_lo, seg_hi, run_lo, run_hi)
                    consumer += [(m - lo_m + shift, m) for m in range(a, b)]
            assert sorted(consumer) == producer, (tm, tn, sq, sk, causal, window, n)
            assert sorted(m for _, m in producer) == list(range(lo_m, hi_m))
            if producer:
                firsts.append(producer[0][1])
        if not causal and window is None and (sq + tm - 1) // tm >= len(firsts):
            assert len(set(firsts)) == len(firsts), (tm, tn, sq, sk)
