"""First stores into the dQ accumulator (``options.dq_first_store``, stage4_bwd_kernel/hopper/dq_writer.py):
the first K/V tile to reach a dQ tile stores it, the others reduce into it once that store has landed,
and nobody zeroes the accumulator; the postprocess writes zeros where no K/V tile arrived.

cpu tier: which configurations use it (causal or banded walks with a dQ writer outside deterministic
mode, but d = 96), the combinations it is refused in, naming it, and the host's counter buffer.

compile tier (sm_90a, fake tensors): the builds store (UBLKCP) and count arrivals (ATOMG) next to their
reduces, without spills; the build with the option off has neither.

gpu tier (H100/H200): with the allocator's free memory filled with NaN before each call (the accumulator
is never zeroed, so stale bytes would show), dq, dk and dv pass FA4's rule against fp32 autograd; query
rows that no key reaches (causal with more queries than keys, windows, varlen sequences without keys)
get dq = 0 exactly; and repeated non-causal calls with first stores forced on, where every K/V tile's CTA
reaches the same dQ tile at about the same time (the walk in order), stay within the rule every time.
"""
from __future__ import annotations

import re

import pytest
import test_hopper_backward_persistent as tp  # its fp32 forward + grads reference (tests/ is on the path)
import test_hopper_variants as tv  # the variants' rule
import test_stage4_hopper as s4  # the ladder's test helpers

pytestmark = pytest.mark.stage4


def _mod():
    return s4._step("hopper.backward")


# ======================================================================================== cpu tier
@pytest.mark.cpu
@pytest.mark.parametrize("d,dv,causal,banded,expected", [
    (128, 128, True, False, True), (64, 64, True, False, True), (128, 64, True, False, True),
    (192, 128, True, False, True), (64, 64, False, True, True), (128, 128, False, True, True),
    (128, 128, False, False, True), (64, 64, False, False, True), (128, 64, False, False, True),
    (192, 128, False, False, False), (96, 96, False, False, False),
    (96, 96, True, False, False), (96, 96, False, True, False), (256, 256, True, False, False)])
def test_first_stores_are_the_default_where_they_measured_faster(d, dv, causal, banded, expected):
    """Causal, banded or (d = 64 / 128) rotated non-causal walks outside deterministic mode, but d = 96
    and 256 (dQ from registers); the other plain non-causal walks keep the zeroed accumulator (their
    K/V tiles reach each dQ tile together)."""
    from stage4_bwd_kernel.hopper.options import BackwardOptions

    _mod()
    for varlen in (False, True):
        assert BackwardOptions.for_config(d, dv, causal, False, varlen, banded).dq_first_store is expected
        assert not BackwardOptions.for_config(d, dv, causal, True, varlen, banded).dq_first_store


@pytest.mark.cpu
@pytest.mark.parametrize("d,dv,causal,det,override", [
    (128, 128, False, True, {}), (256, 256, False, False, {}), (128, 128, False, False, {"dq_frag": False})],
    ids=["deterministic", "dq-from-registers", "row-order-dq"])
def test_first_stores_are_refused_where_the_adds_are_not_the_writers(d, dv, causal, det, override):
    with pytest.raises(ValueError, match="dq_first_store"):
        _mod().make_kernel(None, d, dv, causal, det, dq_first_store=True, **override)


@pytest.mark.cpu
@pytest.mark.parametrize("batch,heads,tiles", [(2, 3, 5), (1, 1, 1), (1, 4, 0)])
def test_the_counters_and_the_buffer_the_preprocess_zeroes_share_memory(batch, heads, tiles):
    import torch
    from stage4_bwd_kernel import host

    counters, flat = host.dq_arrivals(batch, heads, tiles, "cpu")
    assert counters.shape == (batch, heads, tiles) and counters.dtype == torch.int32
    assert flat.dtype == torch.float32 and flat.numel() % 4 == 0 and flat.numel() >= max(counters.numel(), 1)
    flat.fill_(0.0)
    assert counters.eq(0).all()  # 0.0 and int 0 are the same bits
    flat.view(torch.int32)[:counters.numel()] = 7
    assert counters.eq(7).all()


@pytest.mark.cpu
def test_a_first_store_postprocess_needs_the_counters():
    import torch
    from stage4_bwd_kernel import postprocess_frag

    kernel = _mod().make_kernel(None, 128, 128, True, False)
    assert kernel.dq_first_store
    dq = torch.empty(1, 64, 2, 128, device="meta")
    with pytest.raises(ValueError, match="arrivals"):
        postprocess_frag.postprocess(kernel, None, dq, 1.0)


# ==================================================================================== compile tier
COMPILE_CASES = [dict(head_dim=128, causal=True), dict(head_dim=64, causal=False, dq_first_store=True),
                 dict(head_dim=192, head_dim_v=128, causal=True),
                 dict(head_dim=96, causal=False, varlen=True, dq_first_store=True),
                 dict(head_dim=128, causal=True, persistent=True)]


@pytest.mark.compile
@pytest.mark.parametrize("case", COMPILE_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_first_store_builds_store_and_count(case):
    comp = _mod().compile_only(**case)
    r = comp.report
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and not r["wgmma_serialized"], r
    assert "UBLKCP" in comp.sass and "UBLKRED" in comp.sass  # a tile's first arrival stores, later ones reduce
    assert re.search(r"atom\.global\.acquire(\.gpu)?\.add", comp.ptx)


@pytest.mark.compile
def test_without_first_stores_the_writer_only_reduces():
    comp = _mod().compile_only(head_dim=128, causal=True, dq_first_store=False)
    assert "UBLKRED" in comp.sass and "UBLKCP" not in comp.sass and "ATOMG" not in comp.sass


@pytest.mark.compile
def test_the_first_store_postprocess_reads_the_counters():
    from stage4_bwd_kernel import common, postprocess_frag

    bf16 = common.cutlass_dtype("bf16")
    kernel = _mod().make_kernel(bf16, 128, 128, True, False)
    off = _mod().make_kernel(bf16, 128, 128, True, False, dq_first_store=False)
    with_counters = postprocess_frag.compile_only(kernel)
    without = postprocess_frag.compile_only(off)
    assert with_counters.report["spill_stores"] == 0
    # one more global load (the tile's counter) ahead of the accumulator's
    assert with_counters.sass.count("LDG") > without.sass.count("LDG")


# ======================================================================================== gpu tier
def _nan_filled_allocator(nbytes: int = 256 << 20):
    """Leave a NaN-filled block of `nbytes` free in the caching allocator: the next torch.empty calls (the
    accumulator among them, all far smaller) are likely carved from it (the allocator may pick another
    cached block, stale too), so a tile that nobody stored into would bring NaN or old values into dq. The
    same block is reused call after call, so the process's memory does not grow."""
    import torch

    junk = torch.full((nbytes // 4,), float("nan"), dtype=torch.float32, device="cuda")
    del junk


# (b, sq, sk, hq, hkv, d, dv, causal, window): rows no key reaches, GQA, the persistent build's range
CASES = [
    (2, 600, 50, 4, 2, 128, 128, True, (None, None)),    # rows < 550 see no key; persistent build
    (2, 3000, 200, 4, 1, 128, 128, True, (None, None)),  # the one-CTA-per-tile build
    (2, 700, 90, 6, 3, 64, 64, True, (None, None)),
    (1, 900, 333, 2, 2, 96, 96, True, (None, None)),
    (2, 1023, 1024, 4, 2, 192, 128, True, (None, None)),
    (2, 2500, 1000, 2, 2, 128, 64, False, (10, 5)),      # rows < 1495 see no key
    (2, 1500, 1500, 4, 4, 64, 64, False, (64, 64)),
]


def _case_id(c):
    b, sq, sk, hq, hkv, d, dv, causal, window = c
    return f"b{b}-{sq}x{sk}-h{hq}/{hkv}-d{d}x{dv}-{'causal' if causal else 'full'}-w{window[0]},{window[1]}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_first_stores_on_stale_memory(case):
    import torch
    from stage0_reference.torch_reference import visible_mask
    from stage0_reference.validation import normalize_window

    b, sq, sk, hq, hkv, d, dv, causal, window = case
    q, k, v, do = s4._inputs(b, sq, sk, hq, hkv, d, dv, seed=sq + 3 * sk)
    (out, lse), ref, base = tp._reference(q, k, v, do, causal, window, 0.0)
    dq, dk, dv_ = s4._poisoned(q, k, v)
    _nan_filled_allocator()
    _mod().attention_backward(q, k, v, out, do, lse, causal=causal, window_size=window, dq=dq, dk=dk, dv=dv_)
    torch.cuda.synchronize()
    tv._check_grads(_case_id(case), (dq, dk, dv_), ref, base, 0.0)
    empty = ~visible_mask(sq, sk, normalize_window(window, causal), "cuda").any(-1)  # rows that see no key
    assert empty.any() or sq <= sk, "the case should have rows that see no key"
    assert dq[:, empty].eq(0).all(), "rows that no key reaches must get dq = 0"


# (lens_q, lens_k, heads q / kv): sequences without keys, and later sequences (b >= 1) whose first Q tiles
# no key reaches; the first set runs the persistent build, the second (3000 queries) one CTA per K/V tile
# d = 64 non-causal: the varlen walk in order with first stores (options.rotation_pays / first_stores_pay)
@pytest.mark.compile
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_d64_varlen_default_builds_do_not_spill(causal):
    """The d = 64 varlen defaults (in order with first stores; causal: statistics by shuffle), through the
    resource scan's own compile: the rotated non-causal build spilled 32 bytes and ran 1.10-1.15x slower,
    the causal one without the shuffle 4 bytes and 1.07-1.09x slower (log 2026-12-04)."""
    from benchmarks.inspect import resource_scan as rs

    row = rs.compile_row({"pass": "bwd", "walk": "causal" if causal else "nc", "head_dim": 64, "head_dim_v": 64,
                          "causal": causal, "window_size": (None, None), "softcap": 0.0, "deterministic": False,
                          "varlen": True})
    assert "error" not in row and not rs.flagged(row), rs.describe(row)


VARLEN_CASES = [([300, 0, 257, 129, 64], [0, 40, 400, 129, 1], 4, 2, 128, True),
                ([700, 3000, 0, 500, 300], [700, 200, 10, 0, 50], 4, 1, 128, True),
                ([700, 0, 3, 900, 300, 1], [517, 200, 0, 1300, 50, 1], 6, 2, 64, False),
                ([300, 0, 257, 1029, 64], [0, 40, 400, 700, 1], 4, 2, 64, True)]  # d = 64: row statistics by shuffle


@pytest.mark.gpu
@pytest.mark.parametrize("lens_q,lens_k,hq,hkv,d,causal", VARLEN_CASES,
                         ids=["persistent", "per-tile", "d64-in-order", "d64-causal"])
def test_varlen_sequences_without_keys_get_zero_dq(lens_q, lens_k, hq, hkv, d, causal):
    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_varlen_ref, grad_atol
    from stage4_bwd_kernel import host
    from stage4_bwd_kernel.hopper.options import BackwardOptions

    options = BackwardOptions.for_config(d, d, causal, False, True)
    assert options.dq_first_store and not options.rotate_walk  # nobody zeroes dQaccum; tiles in order
    torch.manual_seed(3)
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tk, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tk, hkv, d, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(tq, hq, d, device="cuda", dtype=torch.bfloat16)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal)  # no keys: out 0, lse -inf
    _nan_filled_allocator()  # the outputs come from the allocator too
    ref, base = host.reference_varlen_grads(q, k, v, do, cu_q, cu_k, causal=causal)
    for call in range(2):  # the second on memory the first one's accumulator left behind
        dq, dk, dv = _mod().attention_varlen_backward(q, k, v, out, do, lse, cu_q, cu_k, max(lens_q),
                                                       max(lens_k), causal=causal)
        torch.cuda.synchronize()
        for name, a, r, bl in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, base):
            assert not torch.isnan(a).any(), f"{name}, call {call}"
            assert_fa4_close(name, a, r, bl, atol=grad_atol(ref))
    # causal, bottom-right: in a sequence of n queries and m keys, rows < n - m see no key (all with m = 0)
    unreached = 0
    for b, (n, m) in enumerate(zip(lens_q, lens_k)):
        start = sum(lens_q[:b])
        rows = n if m == 0 else (max(n - m, 0) if causal else 0)
        unreached += rows
        assert dq[start:start + rows].eq(0).all(), f"sequence {b}: rows that see no key must get dq = 0"
    assert unreached >= 250 if causal else unreached == 3


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_concurrent_arrivals_stay_within_the_rule(d):
    """Non-causal with first stores forced on and the walk in order (the default rotates it there): every
    K/V tile's CTA walks the Q tiles in the same order, so they reach each dQ tile together and most of
    them wait for its first store. Ten calls on stale memory, each within the rule."""
    import torch
    from stage4_bwd_kernel import host

    q, k, v, do = s4._inputs(1, 4224, 4224, 2, 1, d, d, seed=11 + d)
    (out, lse), ref, base = tp._reference(q, k, v, do, False, (None, None), 0.0)
    for i in range(10):
        dq, dk, dv = s4._poisoned(q, k, v)
        _nan_filled_allocator()
        host.backward(*_mod().with_options(dq_first_store=True, rotate_walk=False), q, k, v, out, do, lse, dq=dq,
                      dk=dk, dv=dv)
        torch.cuda.synchronize()
        tv._check_grads(f"call {i}", (dq, dk, dv), ref, base, 0.0)
