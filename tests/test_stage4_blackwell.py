"""Stage 4, Blackwell (sm_100a): the 1-CTA backward, checked without hardware.

No Blackwell GPU exists in this project; these tests are the whole verification.

cpu tier: the TMEM / SMEM plan of stage4_bwd_kernel/blackwell_config.py against budgets computed
by hand here (d = 128 fills all 512 TMEM columns; SMEM 231424 of 232448 bytes), refusals that
name TMEM or SMEM, and the public alias stage4_bwd_kernel.blackwell refusing to run without a
capability-10.x GPU.

compile tier: the kernel compiles for sm_100a with fake tensors (in an sm_90a process: the kernel
passes --gpu-arch sm_100a). The SASS holds the five MMAs as UTCHMMA -- S^T, dP^T, dQ with both
operands in SMEM (gdesc), dV and dK with A from TMEM (tmem[...]) --, the PTX tcgen05.alloc /
dealloc, the dQ atomics (REDG.E.ADD.F32x2), in deterministic mode the semaphore spin loop
(an ld.acquire.gpu = LDG.E.STRONG.GPU with a branch back to it), and no local memory. Three main
compiles + preprocess/postprocess for sm_100a, ~40 s on 2 cores.
"""
from __future__ import annotations

import itertools
import re

import pytest

import test_stage4_hopper as s4  # shared SASS helpers (pytest puts tests/ on the path)

from stage4_bwd_kernel.blackwell_config import SMEM_CAPACITY, TMEM_COLUMNS, blackwell_bwd_config

KB = 1024


# ---------------------------------------------------------------------------------------- cpu tier
@pytest.mark.cpu
@pytest.mark.stage4
def test_d128_plan_fills_tmem_and_fits_smem():
    c = blackwell_bwd_config(128, 128, "bf16", causal=True)
    t = c.tmem
    # S/P 128 + dV 128 + dP/dS/dQ 128 + dK 128 = 512: all of TMEM
    assert (t.s, t.dv, t.dp, t.dk) == (0, 128, 256, 384)
    assert t.used == t.alloc == TMEM_COLUMNS == 512
    assert t.dq == t.dp                      # dQ is written over dP^T
    assert (t.p, t.p_cols) == (64, 64)       # P^T (16-bit) over the upper half of S^T
    # dS^T (16-bit) over dP^T, not S^T: the next S^T is issued before this tile's dK reads dS^T
    assert t.ds == t.dp and t.ds + t.p_cols <= t.dk
    # 1 KB header + K 32 KB + V 32 KB + 2 x (Q 32 KB + dO 32 KB) + dS 32 KB + lse2/D 1 KB
    assert c.qdo_stages == 2
    assert c.smem.total == 1 * KB + 32 * KB + 32 * KB + 2 * 64 * KB + 32 * KB + 1 * KB == 231424
    assert c.smem.total <= SMEM_CAPACITY == 232448
    assert c.regs.total == 128 * (240 + 160 + 96) <= 65536   # the dQ drain holds a whole dQ row


@pytest.mark.cpu
@pytest.mark.stage4
def test_d64_plan():
    c = blackwell_bwd_config(64, 64, "fp16", causal=False, deterministic=True)
    assert c.tmem.used == 128 + 64 + 128 + 64 == 384 and c.tmem.alloc == 512
    assert (c.tmem.dv, c.tmem.dp, c.tmem.dk) == (128, 192, 320)
    assert c.smem.total == KB + 16 * KB + 16 * KB + 2 * 32 * KB + 32 * KB + KB == 133120


@pytest.mark.cpu
@pytest.mark.stage4
def test_d128_dv64_plan():
    """qk 128, v 64: dV and the V / dO tiles take dv columns; dK, dQ and the Q / K tiles take d."""
    c = blackwell_bwd_config(128, 64, "bf16", causal=True)
    assert c.tmem.used == 128 + 64 + 128 + 128 == 448 and c.tmem.alloc == 512
    assert (c.tmem.dv, c.tmem.dp, c.tmem.dk) == (128, 192, 320) and c.tmem.dq == c.tmem.dp
    # 1 KB header + K 32 KB + V 16 KB + 2 x (Q 32 KB + dO 16 KB) + dS 32 KB + lse2/D 1 KB
    assert c.qdo_stages == 2
    assert c.smem.total == KB + 32 * KB + 16 * KB + 2 * 48 * KB + 32 * KB + KB == 182272


@pytest.mark.cpu
@pytest.mark.stage4
def test_d256_refused_by_tmem():
    with pytest.raises(ValueError, match=r"TMEM does not fit"):
        blackwell_bwd_config(256, 256, "bf16", causal=False)


@pytest.mark.cpu
@pytest.mark.stage4
def test_smem_refusal_names_smem():
    # 3 Q/dO stages at d = 128: 231424 + 64 KB > 232448
    with pytest.raises(ValueError, match=r"SMEM does not fit"):
        blackwell_bwd_config(128, 128, "bf16", causal=False, qdo_stages=3)


@pytest.mark.cpu
@pytest.mark.stage4
def test_other_refusals():
    with pytest.raises(ValueError, match=r"cta_group"):
        blackwell_bwd_config(128, 128, "bf16", causal=False, cta_group=2)
    with pytest.raises(ValueError, match=r"supports only head dims"):
        blackwell_bwd_config(80, 80, "bf16", causal=False)
    with pytest.raises(ValueError, match=r"dtype"):
        blackwell_bwd_config(128, 128, "fp8", causal=False)


@pytest.mark.cpu
@pytest.mark.stage4
def test_public_alias_refuses_without_blackwell():
    import torch

    from stage4_bwd_kernel import blackwell

    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10:
        pytest.skip("a Blackwell GPU is present")
    with pytest.raises(RuntimeError, match=r"capability 10\.x"):
        blackwell.attention_backward(None, None, None, None, None, None)
    with pytest.raises(RuntimeError, match=r"capability 10\.x"):
        blackwell.attention_varlen_backward(*([None] * 10))


# ------------------------------------------------------------------------------------ compile tier
def _compile(dtype, d, causal, deterministic, dv=None):
    from stage4_bwd_kernel import blackwell_bwd

    return blackwell_bwd.compile_only(dtype, d, dv, causal=causal, deterministic=deterministic)


CASES = [("bf16", 128, 128, False, False), ("bf16", 128, 128, True, True), ("fp16", 64, 64, True, False),
         ("bf16", 96, 96, True, False), ("bf16", 128, 64, True, False), ("fp16", 128, 64, False, True)]


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("dtype,d,dv,causal,deterministic", CASES)
def test_compiles_for_sm100a(dtype, d, dv, causal, deterministic):
    comp = _compile(dtype, d, causal, deterministic, dv)
    r = comp.report
    assert r["ptx_target"] == "sm_100a"
    # five MMAs per Q tile: S^T (K = d / 16 steps), dP^T (K = dv / 16), dQ (K = tile_n / 16) in
    # SMEM-SMEM form; dV and dK (K = tile_m / 16 each) with A from TMEM
    assert r["UTCHMMA.SS"] == d // 16 + dv // 16 + 128 // 16
    assert r["UTCHMMA.TS"] == 2 * (128 // 16)
    assert r["ptx_tcgen05.alloc"] == 1 and r["ptx_tcgen05.dealloc"] == 1
    assert r["UTCATOMSWS"] and r["UTCBAR"]
    # dQ: d / 2 vector atomics per thread per Q tile (8-byte red.global.add.v2.f32)
    assert r["ptx_red_v2"] == d // 2
    assert len(re.findall(r"\bREDG\.E\.ADD\.F32x2\b", comp.sass)) == d // 2
    # TMEM traffic: S^T, dP^T, dQ, dV, dK loads; P^T and dS^T stores
    assert r["LDTM"] == 4 + 4 + d // 32 + dv // 32 + d // 32
    assert r["STTM"] == 8
    # no local memory anywhere
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0
    assert r["LDL/STL"] == 0 and not re.search(r"\b(STL|LDL)\b", comp.sass)
    assert r["smem_bytes"] <= SMEM_CAPACITY
    assert sorted(r["ptx_setmaxnreg"]) == [("dec", "160"), ("dec", "96"), ("inc", "240")]


def _model_mma_runs(d: int, dv: int) -> list:
    """The MMA issue order of the protocol model (blackwell_pipeline, "paper"), as the runs of
    SMEM-A (SS) and TMEM-A (TS) UTCHMMAs the kernel's loop body should compile to, with K-steps."""
    from stage4_bwd_kernel import blackwell_pipeline as bp

    names = [op.name for op in bp.mma_program(1, "paper", d, dv) if isinstance(op, bp.Mma)]
    kind = {"S": "SS", "dP": "SS", "dQ": "SS", "dV": "TS", "dK": "TS"}
    ksteps = {"S": d // 16, "dP": dv // 16, "dQ": 128 // 16, "dV": 128 // 16, "dK": 128 // 16}
    # walk of one tile: S(0), dP(0), dV(0) in turn 0, then dK(0), dQ(0) in turn 1 -> reorder to the loop body
    body = [names[0]] + names[3:] + names[1:3]
    assert body == ["S", "dK", "dQ", "dP", "dV"]
    runs = []
    for n in body:
        if runs and runs[-1][0] == kind[n]:
            runs[-1] = (kind[n], runs[-1][1] + ksteps[n])
        else:
            runs.append((kind[n], ksteps[n]))
    return runs


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("dtype,d,dv,causal,deterministic", CASES)
def test_mma_issue_order_is_the_papers_pipeline(dtype, d, dv, causal, deterministic):
    """The MMA warp's loop issues S(j), dK(j-1), dQ(j-1), dP(j), dV(j) -- the order the protocol
    model checks -- read back from the SASS as runs of SMEM-SMEM (gdesc A) and TMEM-A UTCHMMAs.
    The previous order, S, dP, dV, dK, dQ, gives runs SS, TS, SS and fails this."""
    sass = _compile(dtype, d, causal, deterministic, dv).sass
    kinds = ["TS" if re.search(r"\bUTCHMMA\s+tmem\[", line) else "SS"
             for line in sass.splitlines() if re.search(r"\bUTCHMMA\b", line)]
    runs = [(k, len(list(g))) for k, g in itertools.groupby(kinds)]
    assert runs == _model_mma_runs(d, dv) == [("SS", d // 16), ("TS", 8), ("SS", 8 + dv // 16), ("TS", 8)]


# ------------------------------------------------------------------ the protocol model (cpu tier)
@pytest.mark.cpu
@pytest.mark.stage4
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128), (128, 64)])
@pytest.mark.parametrize("order,early", [("paper", True), ("paper", False), ("serial", False)])
def test_protocol_model_is_deadlock_and_hazard_free(d, dv, order, early):
    """Random interleavings of the five roles, walks of 0..6 Q tiles: no deadlock, no parity alias,
    every TMEM column / SMEM buffer read holds the tile the reader expects, five MMAs per tile."""
    from stage4_bwd_kernel import blackwell_pipeline as bp

    for n in range(7):
        for seed in range(40):
            assert bp.check(n, order, d, dv, seed=seed, early_release=early) == 5 * n


DROPS = ["s_full", "p_full", "dp_full", "ds_full", "dq_full", "dq_empty", ("qdo_empty", 0)]


@pytest.mark.cpu
@pytest.mark.stage4
@pytest.mark.parametrize("bar", DROPS, ids=[str(b) for b in DROPS])
def test_protocol_model_catches_a_missing_wait(bar):
    """Removing the waits on any one barrier breaks the protocol, and the model says how."""
    from stage4_bwd_kernel import blackwell_pipeline as bp

    failures = 0
    for seed in range(60):
        try:
            bp.check(4, "paper", 128, seed=seed, drop=(bar,))
        except bp.ProtocolError:
            failures += 1
    assert failures > 0


@pytest.mark.cpu
@pytest.mark.stage4
def test_protocol_model_timeline_shows_the_overlap():
    """With the roofline's costs the current version keeps the tensor cores busier than the
    versions before it (the numbers the README quotes)."""
    from stage4_bwd_kernel import blackwell_pipeline as bp

    for d in (64, 128):
        (c0, u0), (c1, u1), (c2, u2) = bp.per_tile_clocks(d).values()
        assert c2 < c1 < c0 and u2 > u1 > u0
    busy, _ = bp.timeline(4, "paper", 128)
    tc = [(s, e, lbl) for r, s, e, lbl in busy if r == "tc"]
    ew = [(s, e, lbl) for r, s, e, lbl in busy if r == "ew" and lbl.startswith("P(")]
    # P(1) = exp2(...) runs while dK(0) and dQ(0) occupy the tensor cores
    p1 = next((s, e) for s, e, lbl in ew if lbl == "P(1)")
    for name in ("dK(0)", "dQ(0)"):
        s, e = next((s, e) for s, e, lbl in tc if lbl == name)
        assert s < p1[1] and e > p1[0], name


_has_spin_loop = s4._has_spin_loop  # the Hopper tests' SASS check: the same semaphore code


@pytest.mark.compile
@pytest.mark.stage4
def test_deterministic_semaphore_loop():
    det = _compile("bf16", 128, True, True)
    assert det.report["ptx_ld_acquire"] >= 1
    assert _has_spin_loop(det.sass)
    assert "red.relaxed.gpu.global.add.s32" in det.ptx      # the release of the next rank
    plain = _compile("bf16", 128, False, False)
    assert plain.report["ptx_ld_acquire"] == 0 and not _has_spin_loop(plain.sass)


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("dv", [128, 64])
def test_preprocess_postprocess_compile_for_sm100a(dv):
    from stage4_bwd_kernel import blackwell_bwd

    pre, post = blackwell_bwd.compile_pre_post_sm100("bf16", 128, dv)
    for fn in (pre, post):
        assert re.search(r"^\.target\s+sm_100a", fn.__ptx__, re.M)
        assert fn.__cubin__


@pytest.mark.compile
@pytest.mark.stage4
def test_make_kernel_varlen_flags():
    from stage4_bwd_kernel import blackwell_bwd  # first: the package sets CUTE_DSL_ARCH before cutlass loads

    import cutlass

    assert blackwell_bwd.make_kernel(cutlass.BFloat16, 128, 128, False, False, varlen=True).varlen
    with pytest.raises(ValueError, match=r"seqused_k"):
        blackwell_bwd.make_kernel(cutlass.BFloat16, 128, 128, False, False, has_seqused_k=True)
    k = blackwell_bwd.make_kernel(cutlass.BFloat16, 128, 128, True, False)
    assert (k.tile_m, k.tile_n, k.cfg.dtype) == (128, 128, "bf16")


@pytest.mark.cpu
@pytest.mark.stage4
@pytest.mark.parametrize("causal", [False, True])
def test_hoisted_mask_equals_schedule(causal):
    """The kernel's per-thread threshold masks exactly what schedule.is_masked masks."""
    from stage4_bwd_kernel import schedule
    from stage4_bwd_kernel.blackwell_config import mask_col_min

    tm = tn = 16  # small tiles, every (seqlen_q, seqlen_k, m_block, n_block) combination
    for sq in range(1, 40, 3):
        for sk in range(1, 40, 5):
            for n_block in range(-(-sk // tn)):
                lo, hi = schedule.m_block_range(n_block, tm, tn, sq, sk, causal)
                for m_block in range(lo, hi):
                    kl, diag = schedule.mask_bounds(m_block, n_block, tm, tn, sq, sk)
                    for key in range(tn):
                        col_min = mask_col_min(key, kl, diag, tm, causal)
                        for c in range(tm):
                            assert (c < col_min) == bool(schedule.is_masked(key, c, kl, diag, causal))


# ------------------------------------------------------------------ layout checks (compile tier)
@pytest.mark.cpu
@pytest.mark.stage4
def test_natural_offset_follows_cute_semantics():
    """The pure-Python evaluator of blackwell_layout_check on the d = 128 sQ / sQt layouts (static
    shapes and strides as this CuTe-DSL builds them): element (q, e) sits at 64 q + e % 64 + 8192 (e // 64)
    in both, K-major and MN-major."""
    from stage4_bwd_kernel.blackwell_layout_check import natural_offset

    sq = (((128, 16), 1, (4, 2), 1), ((64, 1), 0, (16, 8192), 0))
    sqt = ((((64, 2), 16), 1, 8, 1), (((1, 8192), 64), 0, 1024, 0))
    for q, e in ((0, 0), (3, 70), (127, 127), (17, 64), (100, 5)):
        want = 64 * q + e % 64 + 8192 * (e // 64)
        assert natural_offset(*sq, q, e) == want == natural_offset(*sqt, e, q)


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 128), (128, 64)])
def test_transposed_smem_views_coincide(d, dv):
    """sQ / sQt, sdO / sdOt and sK / sKt put every element of every stage at the same byte (the MMAs
    that read a tile in the other major mode read the same tile); a deliberately wrong mapping is
    caught, so the check can fail."""
    from stage4_bwd_kernel import blackwell_bwd
    from stage4_bwd_kernel.blackwell_layout_check import transposed_view_mismatches

    kernel = blackwell_bwd.make_kernel("bf16", d, dv, False, False)
    assert transposed_view_mismatches(kernel) == {"sQ/sQt": 0, "sdO/sdOt": 0, "sK/sKt": 0}
    wrong = transposed_view_mismatches(kernel, transpose=False)
    assert all(n > 0 for n in wrong.values()), wrong
