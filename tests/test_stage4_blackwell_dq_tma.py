"""Stage 4, Blackwell 1-CTA backward, dQ by TMA reduce-add (``dq_tma=True``): compiled for sm_100a and
checked structurally, NEVER RUN -- no Blackwell GPU is reachable from this project.

The dQ warpgroup stages its dQ rows in SMEM (sdQ: 2 buffers of 128 rows x 32 fp32) and warp 0 adds
each 32-column chunk into dQaccum with one cp.reduce.async.bulk.tensor .add (SASS UTMAREDG), instead
of d / 2 per-thread red.global.add.v2.f32 (REDG.E.ADD.F32x2) per Q tile. At d = 128 the staging
buffers fit only with a 1-stage dO ring (its own do_full / do_empty barriers). What is pinned here:
the plans and their SMEM arithmetic, that every build compiles with no local memory, holds the bulk
reduce and none of the per-row atomics, that SMEM stays within the plan, and that the barrier-protocol
checker extracts the new dO ring and finds no deadlock or race. The atomics stay the default build.
"""
from __future__ import annotations

import re

import pytest

from stage4_bwd_kernel.blackwell_config import (DQ_STAGE_BUFS, DQ_STAGE_COLS, DQ_TMA_DEFAULT, REGISTERS_PER_SM,
                                                SMEM_CAPACITY, blackwell_bwd_config)

KB = 1024
DIMS = [64, 96, 128]


def _plan(d, causal=False, **kw):
    return blackwell_bwd_config(d, d, "bf16", causal=causal, dq_tma=True, **kw)


# ---------------------------------------------------------------------------------------- cpu tier
@pytest.mark.cpu
@pytest.mark.stage4
def test_plans_fit_smem_with_the_staging_buffers():
    assert DQ_STAGE_BUFS * 128 * DQ_STAGE_COLS * 4 == 32 * KB
    # d = 64 and 96: the staging buffers fit beside both 2-stage rings
    for d, total in ((64, 133120 + 32 * KB), (96, 182272 + 32 * KB)):
        c = _plan(d)
        assert (c.qdo_stages, c.smem.dO_stages, c.split_do) == (2, 2, False)
        assert c.smem.dq_stage == 32 * KB and c.smem.total == total <= SMEM_CAPACITY
    # d = 128: 1 KB is left beside the atomic plan, so dO's ring drops to one stage (32 KB back)
    atomic = blackwell_bwd_config(128, 128, "bf16", causal=False, dq_tma=False)
    assert SMEM_CAPACITY - atomic.smem.total == 1 * KB
    c = _plan(128)
    assert (c.qdo_stages, c.smem.dO_stages, c.split_do) == (2, 1, True)
    assert c.smem.total == KB + 32 * KB + 32 * KB + 2 * 32 * KB + 1 * 32 * KB + 32 * KB + KB + 32 * KB == 231424
    assert c.smem.num_barriers == atomic.smem.num_barriers + 2       # do_full, do_empty
    assert "sdQ 32768" in c.smem.describe() and "1 x sdO" in c.smem.describe()
    # WG 1 (MMA + load) gets 104 registers with the second ring; the launch's 3 x 168 in all
    assert (c.regs.elementwise, c.regs.dq, c.regs.other) == (240, 160, 104)
    assert c.regs.total == 128 * 504 <= REGISTERS_PER_SM
    soft = _plan(128, causal=True, softcap=30.0)
    assert (soft.regs.elementwise, soft.regs.dq, soft.regs.other) == (248, 152, 104)


@pytest.mark.cpu
@pytest.mark.stage4
def test_default_and_refusals():
    # the atomics stay the default (and the plan, its key and SMEM with them)
    assert DQ_TMA_DEFAULT is False
    plain = blackwell_bwd_config(128, 128, "bf16", causal=False)
    assert not plain.dq_tma and plain.smem.total == 231424 and plain.key()[-1] == 1
    assert _plan(64).key() != blackwell_bwd_config(64, 64, "bf16", causal=False).key()
    with pytest.raises(ValueError, match=r"dq_tma: the deterministic backward keeps"):
        blackwell_bwd_config(128, 128, "bf16", causal=True, deterministic=True, dq_tma=True)
    # deterministic without the flag: atomics, no error
    assert not blackwell_bwd_config(64, 64, "bf16", causal=True, deterministic=True).dq_tma
    with pytest.raises(ValueError, match=r"SMEM does not fit"):
        _plan(128, do_stages=2)


@pytest.mark.cpu
@pytest.mark.stage4
def test_protocol_checker_sees_the_do_ring():
    """The extracted dq_tma build (d = 128): dO's own ring is waited / committed once per Q tile, and
    the model finds no deadlock or race; dropping one do_empty commit deadlocks the load warp."""
    from stage4_bwd_kernel import blackwell_protocol as bp

    prog = bp.build("bwd-dqtma", 4)
    names = prog.spec.bar_names
    waits = [names[op[1][1]] for op in prog.ops["mma"] if op[0] == "wait"]
    commits = [names[b[1]] for op in prog.ops["mma"] if op[0] == "commit" for b in op[1]]
    assert waits.count("do_full") == 4 and commits.count("do_empty") == 4
    assert [names[op[1][1]] for op in prog.ops["load"] if op[0] == "wait"].count("do_empty") == 4
    res = bp.explore(prog, blocks=4)
    assert res.ok, res.report()

    bad = bp.build("bwd-dqtma", 4)
    off = next(o for o, n in bad.spec.bar_names.items() if n == "do_empty")
    ops = bad.ops["mma"]
    del ops[[i for i, op in enumerate(ops) if op[0] == "commit" and any(b[1] == off for b in op[1])][0]]
    assert bp.explore(bad, blocks=4).kind == "deadlock"


# ------------------------------------------------------------------------------------ compile tier
_COMPILED: dict = {}


def _bwd():
    from stage4_bwd_kernel import blackwell_bwd  # first: the package sets CUTE_DSL_ARCH before cutlass loads

    return blackwell_bwd


def _compile(d, causal, **variant):
    """Each build once per session (blackwell_bwd's compile cache keys on the plan)."""
    return _bwd().compile_only("bf16", d, causal=causal, dq_tma=True, **variant)


@pytest.fixture(scope="module", params=[(d, c) for d in DIMS for c in (False, True)],
                ids=[f"d{d}-{'causal' if c else 'noncausal'}" for d in DIMS for c in (False, True)])
def build(request):
    d, causal = request.param
    return d, causal, _compile(d, causal)


def _drain_loop(sass):
    """The dQ warpgroup's per-Q-tile loop: the innermost SASS loop holding the TMA reduces."""
    from stage3_fwd_kernel import sass_report

    loops = sass_report.innermost(sass_report.natural_loops(sass),
                                  lambda lp: sass_report.opcode_count(lp.ops, "UTMAREDG"))
    assert len(loops) == 1, [lp.label for lp in loops]
    return loops[0]


@pytest.mark.compile
@pytest.mark.stage4
def test_builds_compile_without_local_memory(build):
    d, causal, comp = build
    r = comp.report
    assert r["ptx_target"] == "sm_100a"
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
    assert r["LDL/STL"] == 0 and not re.search(r"\b(STL|LDL)\b", comp.sass)
    plan = _plan(d, causal)
    assert r["smem_bytes"] == plan.smem.total <= SMEM_CAPACITY
    assert r["registers"] <= plan.regs.launch_cap
    assert sorted(r["ptx_setmaxnreg"]) == sorted([("dec", str(plan.regs.other)), ("dec", str(plan.regs.dq)),
                                                  ("inc", str(plan.regs.elementwise))])
    # the five MMAs and the TMEM traffic are the atomic build's
    assert r["UTCHMMA.SS"] == 2 * (d // 16) + 128 // 16 and r["UTCHMMA.TS"] == 2 * (128 // 16)
    assert r["LDTM"] == 4 + 4 + d // 32 + 2 * (d // 32) and r["STTM"] == 8


@pytest.mark.compile
@pytest.mark.stage4
def test_dq_leaves_by_tma_reduce_not_atomics(build):
    d, causal, comp = build
    r, sass, ptx = comp.report, comp.sass, comp.ptx
    # one tensor reduce-add per 32-column chunk, and none of the per-row 8-byte atomics
    assert r["ptx_bulk_tensor_reduce"] == d // DQ_STAGE_COLS
    assert len(re.findall(r"cp\.reduce\.async\.bulk\.tensor\.4d\.global\.shared::cta\.add\.tile\.bulk_group", ptx)) \
        == d // DQ_STAGE_COLS
    assert r["UTMAREDG"] == d // DQ_STAGE_COLS and len(re.findall(r"\bUTMAREDG\.4D\.ADD\b", sass)) == d // 32
    assert r["ptx_red_v2"] == 0 and r["RED"] == 0 and not re.search(r"\bREDG\.E\.ADD\.F32x2\b", sass)
    # the hand-over to the async proxy and the buffer reuse: fence, named barrier 3 of WG 2, read waits
    assert "fence.proxy.async.shared::cta" in ptx
    assert "cp.async.bulk.commit_group" in ptx and "cp.async.bulk.wait_group.read" in ptx
    loop = _drain_loop(sass)
    assert loop.ops.count("FENCE.VIEW.ASYNC.S") == d // 32
    bars = re.findall(r"BAR\.SYNC\.DEFER_BLOCKING 0x3, 0x80", loop.text)
    assert len(bars) == d // 32
    # each chunk row is stored as 16-byte vectors: 8 per thread per chunk
    assert sum(op == "STS.128" for op in loop.ops) == 8 * (d // 32)


@pytest.mark.compile
@pytest.mark.stage4
def test_variant_build_without_local_memory():
    """A window and softcap build at d = 128 (elementwise 248, WG 2 152, WG 1 104): no spills either."""
    comp = _compile(128, True, window_size=(256, 0), softcap=30.0)
    r = comp.report
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["LDL/STL"] == 0, r
    assert r["UTMAREDG"] == 4 and r["RED"] == 0
    assert sorted(r["ptx_setmaxnreg"]) == [("dec", "104"), ("dec", "152"), ("inc", "248")]


@pytest.mark.compile
@pytest.mark.stage4
def test_varlen_keeps_the_atomics():
    """A TMA box clips at the packed tensor's end, not at the sequence's: varlen refuses dq_tma and its
    default build adds per row."""
    bb = _bwd()
    with pytest.raises(ValueError, match=r"varlen keeps the per-row atomics"):
        bb.FlashAttentionBackwardSm100(_plan(64), varlen=True)
    kernel = bb.make_kernel("bf16", 64, 64, False, False, varlen=True)
    assert not kernel.dq_tma


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("d", DIMS)
def test_transposed_views_with_the_do_ring(d):
    """sdO / sdOt at the dq_tma build's dO stages (1 at d = 128) still put every element at one byte."""
    from stage4_bwd_kernel.blackwell_layout_check import transposed_view_mismatches

    kernel = _bwd().FlashAttentionBackwardSm100(_plan(d))
    assert transposed_view_mismatches(kernel) == {"sQ/sQt": 0, "sdO/sdOt": 0, "sK/sKt": 0}
