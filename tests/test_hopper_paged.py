"""The Hopper forward's paged K/V readers (components.paged_kv, hopper/producer.py, hopper/gather.py).

cpu tier: which page sizes TMA boxes read and which the cp.async gather reads; the gather's lanes
per row for every head dim; a bad page size is refused by name.

compile tier (no GPU): paged builds for sm_90a at page sizes of both readers -- no spills, no local
memory; the gathered builds copy K / V with LDGSTS (cp.async) and load only Q by TMA, the TMA builds
issue no LDGSTS. (The GPU checks are fa4's: tests/test_fa4_kvcache_gpu.py.)
"""
from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.stage3


@pytest.mark.cpu
def test_readers_by_page_size():
    from stage3_fwd_kernel.components.paged_kv import box_rows, gathered, page_size_ok, tma_pages

    sizes = (1, 2, 8, 16, 24, 32, 64, 96, 128, 160, 256, 384)
    assert [p for p in sizes if tma_pages(p, 128)] == [16, 32, 64, 128, 256, 384]
    assert [p for p in sizes if gathered(p, 128)] == [1, 2, 8, 24, 96, 160]
    assert [p for p in sizes if gathered(p, 64)] == [1, 2, 8, 24, 96, 160]
    assert all(page_size_ok(p, 128) for p in sizes) and not gathered(None, 128)
    assert [box_rows(p, 128) for p in (None, 8, 16, 64, 256)] == [128, 128, 16, 64, 128]


@pytest.mark.cpu
def test_gather_lanes_per_row():
    import cutlass

    from stage3_fwd_kernel.hopper.gather import lanes_per_row

    # 16-byte chunks of a bf16 row: d / 8; lanes per row: the largest power of two <= 32 dividing them
    got = {d: lanes_per_row(cutlass.BFloat16, d) for d in (16, 32, 64, 96, 128, 192, 256)}
    assert got == {16: 2, 32: 4, 64: 8, 96: 4, 128: 16, 192: 8, 256: 32}


@pytest.mark.cpu
def test_gathered_build_refuses_a_dynamic_scheduler():
    import cutlass

    from stage3_fwd_kernel.hopper.kernel import FlashAttentionForwardSm90
    from stage3_fwd_kernel.tile_scheduler import PersistentScheduler

    with pytest.raises(ValueError, match="^scheduler: page_size 8 "):
        FlashAttentionForwardSm90(cutlass.BFloat16, 128, 128, True, page_size=8,
                                  scheduler=PersistentScheduler(dynamic=True))
    FlashAttentionForwardSm90(cutlass.BFloat16, 128, 128, True, page_size=16, scheduler=PersistentScheduler(dynamic=True))


@pytest.mark.cpu
def test_gathered_builds_walk_persistent_tiles_in_a_static_order():
    from stage3_fwd_kernel.hopper.scheduling import _resolve_scheduler

    for causal in (False, True):
        sched = _resolve_scheduler(None, True, 128, 128, causal, varlen=True, gathered_pages=True)
        assert sched.persistent and not sched.dynamic
    assert _resolve_scheduler(None, True, 128, 128, True, varlen=True).dynamic


@pytest.mark.cpu
@pytest.mark.parametrize("bad", [0, -8, True, 16.0, "16"])
def test_bad_page_size_is_refused(bad):
    from stage3_fwd_kernel.components.paged_kv import check_page_size

    with pytest.raises(ValueError, match="^page_size: "):
        check_page_size(bad, 128)


PAGED_BUILDS = [(128, 128, 1, {}), (128, 128, 8, {}), (128, 128, 24, {}), (128, 128, 160, {}), (64, 64, 24, {}),
                (256, 256, 8, {}), (96, 96, 8, {}), (192, 128, 8, {}), (128, 64, 24, {}), (128, 128, 16, {}),
                (128, 128, 256, {}),
                # what fa4's decode launches (64-row tiles), a persistent causal walk, the variants
                (128, 128, 8, dict(tile_m=64)), (128, 128, 8, dict(causal=True, persistent=True)),
                (128, 128, 8, dict(causal=True, window_size=(256, 0), softcap=30.0, learnable_sink=True))]


@pytest.mark.compile
@pytest.mark.parametrize("d,dv,page,kw", PAGED_BUILDS,
                         ids=[f"d{d}-page{p}" + "".join(f"-{k}" for k in kw) for d, _, p, kw in PAGED_BUILDS])
def test_paged_builds_compile_sm90a(d, dv, page, kw):
    from stage3_fwd_kernel import hopper
    from stage3_fwd_kernel.components.paged_kv import gathered
    from stage3_fwd_kernel.hopper.config import default_tile_n

    comp = hopper.compile_only("bf16", d, dv, varlen=True, seqused_k=True, page_size=page, **kw)
    rep = comp.report
    assert rep["spill_stores"] == rep["spill_loads"] == rep["stack_frame"] == rep["LDL/STL"] == 0, rep
    assert not rep["wgmma_serialized"]
    if gathered(page, default_tile_n(d, dv)):
        # K and V by cp.async (a partly unrolled loop each); Q alone by TMA
        assert rep["LDGSTS"] >= 2, rep
        assert len(re.findall(r"\bARRIVES\.LDGSTSBAR", comp.sass)) >= 2, "no cp.async arrive"
    else:
        assert rep["LDGSTS"] == 0 and rep["UTMALDG"] >= 3, rep
