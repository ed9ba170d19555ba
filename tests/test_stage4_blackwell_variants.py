"""Stage 4, Blackwell 1-CTA backward: sliding window and softcap -- compiled for sm_100a and checked
structurally, never run.

No Blackwell GPU is reachable. What these tests pin down without one: the variant builds (window,
softcap, both; dense and varlen, default and deterministic) compile with no local-memory spills; tanh
appears only in softcap builds; the walk bounds and deterministic ranks the kernel uses (its own
``_m_range`` / ``_dq_rank``, evaluated on Python ints) are the band schedule.py defines, checked
against a brute-force visibility of every (key, query) pair; the barrier-protocol checker passes on a
windowed softcap build; bad values are refused naming the argument, and the 2-CTA kernel refuses both.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

pytestmark = [pytest.mark.compile, pytest.mark.stage4]


def _bwd():
    from stage4_bwd_kernel import blackwell_bwd  # first: the package sets CUTE_DSL_ARCH before cutlass loads

    return blackwell_bwd


# (d, causal, window_size, softcap, deterministic, varlen): every head dim, each edge kind, one
# deterministic and two varlen builds (one with seqused_k)
VARIANTS = [
    (64, True, (256, 0), 0.0, False, False),
    (128, False, (128, 64), 0.0, False, False),
    (96, False, (None, None), 30.0, False, False),
    (128, True, (None, None), 30.0, False, False),
    (64, False, (128, 64), 30.0, True, False),
    (128, True, (256, 0), 30.0, False, True),
    (96, True, (256, 0), 0.0, True, "seqused_k"),
    (128, False, (256, 0), 30.0, False, False),   # spilled 8 bytes at WG 0's 240 registers (now 248)
]


def _build(d, causal, window, softcap, det, varlen):
    return _bwd().compile_only("bf16", d, causal=causal, deterministic=det, window_size=window, softcap=softcap,
                               varlen=bool(varlen), has_seqused_k=varlen == "seqused_k")


def _variant_id(c):
    d, causal, (left, right), cap, det, varlen = c
    return (f"d{d}-{'causal' if causal else 'noncausal'}-w{left}_{right}-cap{cap:g}{'-det' if det else ''}"
            f"{'-varlen' if varlen is True else '-' + varlen if varlen else ''}")


@pytest.mark.parametrize("case", VARIANTS, ids=_variant_id)
def test_variant_builds_compile_without_spills(case):
    bb = _bwd()
    c = _build(*case)
    rep = c.report
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["LDL/STL"] == 0, rep
    assert rep["registers"] and rep["registers"] <= bb.make_config("bf16", case[0]).regs.launch_cap, rep
    # tanh.approx only where a softcap is built (one per score of the thread's row)
    n_tanh = c.ptx.count("tanh.approx")
    assert (n_tanh == 128) if case[3] else (n_tanh == 0), n_tanh
    # WG 0's setmaxnreg is the plan's: 248 for d = 128 softcap builds, else the plain builds' 240
    cfg = bb.make_config("bf16", case[0], causal=case[1], window_size=case[2], softcap=case[3])
    assert cfg.regs.elementwise == (248 if case[3] and case[0] == 128 else 240)
    assert re.search(rf"setmaxnreg\.inc\.sync\.aligned\.u32\s+{cfg.regs.elementwise};", c.ptx)
    # the same five MMAs: the variants only change the elementwise warpgroup and the walk
    assert rep["UTCHMMA.SS"] and rep["UTCHMMA.TS"], rep


def test_plain_build_has_no_tanh_and_keeps_its_key():
    bb = _bwd()
    assert "tanh.approx" not in bb.compile_only("bf16", 64).ptx
    plain = bb.make_config("bf16", 64, causal=True)
    assert plain.plain and "variant" not in plain.key()
    # a causal window of (None, 0) is plain causal; a left edge makes a distinct build
    assert bb.make_config("bf16", 64, causal=True, window_size=(None, 0)).key() == plain.key()
    assert bb.make_config("bf16", 64, causal=True, window_size=(256, 0)).key() != plain.key()


# ------------------------------------------------------------------------------------ walk and ranks
BAND_CASES = [  # (seqlen_q, seqlen_k, causal, window_size)
    (1000, 1000, True, (256, 0)),
    (700, 1300, False, (128, 64)),
    (1300, 600, True, (100, 0)),
    (513, 777, False, (None, 64)),
    (900, 900, False, (0, 0)),
    (384, 1024, False, (200, None)),
]


def _visible_tiles(kernel, sq, sk):
    """Brute force: K/V tile n -> the Q tiles with any (key, query) pair schedule.is_masked leaves
    visible (padding query rows included, as the walk counts them)."""
    from stage4_bwd_kernel import schedule

    tm, tn = kernel.tm, kernel.tn
    r, c = np.meshgrid(np.arange(tn), np.arange(tm), indexing="ij")
    out = {}
    for n in range((sk + tn - 1) // tn):
        seen = []
        for m in range((sq + tm - 1) // tm):
            key_limit, diag = schedule.mask_bounds(m, n, tm, tn, sq, sk)
            if not schedule.is_masked(r, c, key_limit, diag, kernel.causal, kernel.window_or_none).all():
                seen.append(m)
        out[n] = seen
    return out


@pytest.mark.parametrize("det", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("case", BAND_CASES, ids=lambda c: f"{c[0]}x{c[1]}-{'causal' if c[2] else 'noncausal'}"
                         f"-w{c[3][0]}_{c[3][1]}")
def test_walk_bounds_and_ranks_are_schedules_band(case, det):
    sq, sk, causal, window = case
    bb = _bwd()
    kernel = bb.FlashAttentionBackwardSm100(bb.make_config("bf16", 64, causal=causal, deterministic=det,
                                                           window_size=window))
    assert kernel.window_or_none is not None
    visible = _visible_tiles(kernel, sq, sk)
    visitors = {}
    for n, seen in visible.items():
        m_min, m_max = kernel._m_range(n, sq, sk)
        walked = list(range(m_min, max(m_max, m_min)))
        assert walked == seen, (n, walked, seen)   # contiguous, exact: no visible tile skipped, none extra
        for m in walked:
            visitors.setdefault(m, []).append(n)
    for m, ns in visitors.items():
        ranks = [int(kernel._dq_rank(n, m, sq, sk)) for n in ns]
        # every visiting K/V tile has a distinct rank in [0, count): the semaphore reaches each in turn
        assert sorted(ranks) == list(range(len(ns))), (m, ns, ranks)


@pytest.mark.parametrize("causal,window_size", [(True, (256, 0)), (False, (128, 64)), (False, (None, 64)),
                                                 (False, (0, 0)), (True, (5, None)), (False, (200, None))])
def test_hoisted_mask_columns_equal_is_masked(causal, window_size):
    """WG 0's two threshold columns (mask_col_min / mask_col_max) mask exactly schedule.is_masked."""
    from stage4_bwd_kernel import schedule
    from stage4_bwd_kernel.blackwell_config import mask_col_max, mask_col_min

    bb = _bwd()
    kernel = bb.FlashAttentionBackwardSm100(bb.make_config("bf16", 64, causal=causal, window_size=window_size))
    w = kernel.window_or_none
    key, c = np.meshgrid(np.arange(128), np.arange(128), indexing="ij")
    for key_limit in (128, 77, 0):
        for diag in range(-400, 400, 13):
            lo = mask_col_min(key, key_limit, diag, 128, causal, imax=np.maximum,
                              select=lambda m, a, b: np.where(m, a, b), window=w)
            hi = mask_col_max(key, diag, w)
            got = (c < lo) | ((c > hi) if hi is not None else False)
            assert (got == schedule.is_masked(key, c, key_limit, diag, causal, w)).all(), (key_limit, diag)


def test_walk_of_a_plain_kernel_is_unchanged():
    from stage4_bwd_kernel import schedule

    bb = _bwd()
    kernel = bb.FlashAttentionBackwardSm100(bb.make_config("bf16", 64, causal=True))
    assert kernel.window_or_none is None and not kernel.score_mod.on
    for n in range(8):
        assert kernel._m_range(n, 1000, 1000) == schedule.m_block_range(n, 128, 128, 1000, 1000, True)


# ------------------------------------------------------------------------------------ protocol
def _program(blocks, **variant):
    from stage4_bwd_kernel import blackwell_protocol as bp

    bb = _bwd()
    spec = bp.backward_spec(blocks)
    spec.kernel = bb.FlashAttentionBackwardSm100(bb.make_config("bf16", 128, causal=False, deterministic=True,
                                                                **variant))
    return bp.extract(spec)


def _strip(ops):
    return [op[:-1] for op in ops]  # drop the source location


def _writes_over_read_columns(ops) -> bool:
    """Within the elementwise role: every TMEM region written (P^T) was read (S^T) earlier in the same
    Q tile -- the softcap row's last-chunk-first order must never store over unread S^T columns."""
    read = []
    for op in ops:
        if op[0] == "wait":
            read = []
        if op[0] != "access":
            continue
        for reg in op[1]:
            if reg.key[0] == "tmem":
                read.append(reg.key[1:])
        for reg in op[2]:
            if reg.key[0] == "tmem":
                lo, hi = reg.key[1:]
                if not all(any(a <= col < b for a, b in read) for col in range(lo, hi)):
                    return False
    return True


def test_write_over_read_check_catches_a_first_chunk_first_order():
    from types import SimpleNamespace as R

    first_first = [("wait", (0, 1), 0), ("access", (R(key=("tmem", 0, 32)),), ()),
                   ("access", (), (R(key=("tmem", 64, 80)),))]
    last_first = [("wait", (0, 1), 0), ("access", (R(key=("tmem", 96, 128)),), ()),
                  ("access", (), (R(key=("tmem", 112, 128)),))]
    assert not _writes_over_read_columns(first_first) and _writes_over_read_columns(last_first)


@pytest.mark.parametrize("blocks", [1, 4])
def test_protocol_checker_passes_the_variant_builds(blocks):
    """A window changes only the walk's bounds and the arithmetic: its role programs are the plain
    build's. Softcap reads S^T and writes P^T chunk by chunk (last first): the same operations in
    another order, each write over columns already read. Both pass the checker."""
    from stage4_bwd_kernel import blackwell_protocol as bp

    plain = _program(blocks)
    window = _program(blocks, window_size=(128, 64))
    assert {r: _strip(o) for r, o in window.ops.items()} == {r: _strip(o) for r, o in plain.ops.items()}
    both = _program(blocks, window_size=(128, 64), softcap=30.0)
    for role, ops in both.ops.items():
        if role == "elementwise":
            assert sorted(map(repr, _strip(ops))) == sorted(map(repr, _strip(plain.ops[role])))
            assert _writes_over_read_columns(_strip(ops))
        else:
            assert _strip(ops) == _strip(plain.ops[role]), role
    for prog in (window, both):
        res = bp.explore(prog, 2_000_000, blocks, 0)
        assert res.ok, res.report()


# ------------------------------------------------------------------------------------ refusals
BAD = [
    (dict(window_size=(-2, 0)), ValueError, "window_size"),
    (dict(window_size="256"), TypeError, "window_size"),
    (dict(window_size=(1.5, 0)), TypeError, "window_size"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap="30"), TypeError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
]


@pytest.mark.parametrize("bad", BAD, ids=lambda b: f"{next(iter(b[0]))}={next(iter(b[0].values()))!r}")
def test_refusals_name_the_argument(bad):
    from stage4_bwd_kernel import blackwell

    kw, exc, name = bad
    bb = _bwd()
    with pytest.raises(exc, match=name):
        bb.make_config("bf16", 64, **kw)
    with pytest.raises(exc, match=name):
        bb.compile_only("bf16", 64, **kw)
    # the public entry points check the variants before the GPU check (no Blackwell GPU here)
    with pytest.raises(exc, match=name):
        blackwell.attention_backward(*([None] * 6), **kw)
    with pytest.raises(exc, match=name):
        blackwell.attention_varlen_backward(*([None] * 10), **kw)
    with pytest.raises(exc, match=name):
        bb.attention_backward(*([None] * 6), **kw)


def test_causal_right_window_is_refused():
    with pytest.raises(ValueError, match="window_size"):
        _bwd().make_config("bf16", 64, causal=True, window_size=(256, 64))


def test_two_cta_kernel_refuses_the_variants():
    from stage4_bwd_kernel import blackwell_bwd_2cta as two

    for kw, name in ((dict(window_size=(256, 0)), "window_size"), (dict(softcap=30.0), "softcap")):
        with pytest.raises(ValueError, match=f"{name}.*2-CTA"):
            two.make_config("bf16", 64, causal=True, **kw)
        with pytest.raises(ValueError, match=f"{name}.*2-CTA"):
            two.compile_only("bf16", 64, causal=True, **kw)
    # bad values keep the argument's own check first; plain plans still build
    with pytest.raises(TypeError, match="softcap"):
        two.make_config("bf16", 64, softcap="30")
    assert two.make_config("bf16", 64, causal=True).plain
    # the kernel built from a plain 2-CTA plan has no variant
    k = two.FlashAttentionBackwardSm100TwoCta(two.make_config("bf16", 64))
    assert k.window_or_none is None and not k.score_mod.on
