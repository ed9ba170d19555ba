"""Stage 4, Blackwell (sm_100a): the wide backward (head dims (192, 128) and 256), checked without hardware.

No Blackwell GPU exists in this project; these tests are the whole verification of
stage4_bwd_kernel/blackwell_bwd_wide.py.

cpu tier: the plan (64-query tiles, dQ^T windows -- over S^T / dP^T at (192, 128), on columns of their
own at 256 --, a head-dim split at 256) against
column and byte counts computed by hand; the refusals; the arithmetic of the windows and of the split
on NumPy data (every dQ column added exactly once, dK / dV / dQ of both halves = the whole); the launch
order of the split; the routing of (192, 128) / 256 to this kernel.

compile tier: 14 builds for sm_100a (bf16 / fp16, causal or not, deterministic, varlen + seqused_k,
window + softcap) with no local memory, SMEM = the plan, the MMA counts of the serial schedule (UTCHMMA
SS: S, dP and the dQ^T windows; TS: dV and dK), one scalar dQ reduction per (query, kept window), and
the SMEM views of each head-dim part and dQ^T window element by element (blackwell_layout_check).
The barrier protocol of both builds is checked in tests/test_blackwell_protocol.py.
"""
from __future__ import annotations

import itertools
import re

import numpy as np
import pytest

from stage4_bwd_kernel.blackwell_config import (SMEM_CAPACITY, SUPPORTED_HEAD_DIMS_WIDE, TMEM_COLUMNS,
                                                blackwell_bwd_config, blackwell_bwd_wide_config, dq_windows,
                                                head_splits)

KB = 1024


# ---------------------------------------------------------------------------------------- cpu tier
@pytest.mark.cpu
@pytest.mark.stage4
def test_192_plan_by_hand():
    c = blackwell_bwd_wide_config(192, 128, "bf16", causal=True)
    t = c.tmem
    assert (c.tile_m, c.tile_n, c.head_splits) == (64, 128, 1)
    # dV 128 + dK 192 + S^T 64 + dP^T 64 = 448 (the 1-CTA plan needs 576 before dQ)
    assert (t.dv, t.dk, t.s, t.dp) == (0, 128, 320, 384) and t.used == 448 and t.alloc == TMEM_COLUMNS
    assert (t.p, t.p_cols, t.ds) == (352, 32, 384)     # P^T in S^T's upper half, dS^T in dP^T's lower
    # two 128-row dQ^T windows, rows [0, 128) and [64, 192), 64 query columns each, over S^T and dP^T
    assert t.dq_windows == (0, 64) and (t.dq, t.dq_cols) == (320, 128) and t.dq + t.dq_cols == t.dp + 64
    assert t.dq_over_scores      # 448 + 128 > 512: the next S^T waits for the drain
    # 1 KB header + K 48 KB + V 32 KB + 2 x (Q 24 KB + dO 16 KB) + dS 16 KB + lse2 / D 512 B
    assert c.qdo_stages == 2
    assert c.smem.total == KB + 48 * KB + 32 * KB + 2 * (24 + 16) * KB + 16 * KB + 512 == 181760
    assert c.regs.total == 128 * (208 + 200 + 96) == 128 * 3 * 168


@pytest.mark.cpu
@pytest.mark.stage4
def test_256_plan_splits_the_head_dim():
    c = blackwell_bwd_wide_config(256, 256, "fp16", causal=False, deterministic=True)
    t = c.tmem
    # unsplit, dK + dV alone are 512 columns; each CTA of the pair owns 128 of each
    assert head_splits(256, 256) == 2 and c.head_splits == 2
    # the one dQ^T window fits after dP^T: 128 + 128 + 64 + 64 + 64 = 448
    assert (t.dv_cols, t.dk_cols, t.s, t.dp) == (128, 128, 256, 320) and t.used == 448
    assert t.dq_windows == (0,) and (t.dq, t.dq_cols) == (384, 64) and not t.dq_over_scores
    # both CTAs load whole tiles: 1 KB + K 64 KB + V 64 KB + 1 x (Q 32 KB + dO 32 KB) + dS 16 KB + 512 B
    assert c.qdo_stages == 1
    assert c.smem.total == KB + 64 * KB + 64 * KB + 64 * KB + 16 * KB + 512 == 214528 <= SMEM_CAPACITY
    assert c.regs.total == 128 * (240 + 136 + 128) == 128 * 3 * 168
    assert "head dim split over 2 CTAs" in c.summary() and c.key() != blackwell_bwd_wide_config(
        256, 256, "fp16", causal=False, deterministic=False).key()


@pytest.mark.cpu
@pytest.mark.stage4
def test_refusals_name_what_fails():
    for d, dv in SUPPORTED_HEAD_DIMS_WIDE:      # the 1-CTA plan cannot hold them
        with pytest.raises(ValueError, match="TMEM does not fit"):
            blackwell_bwd_config(d, dv, "bf16", causal=False)
    with pytest.raises(ValueError, match="^dq_tma"):
        blackwell_bwd_wide_config(192, 128, "bf16", causal=False, dq_tma=True)
    with pytest.raises(ValueError, match="supports only head dims"):
        blackwell_bwd_wide_config(128, 128, "bf16", causal=False)
    with pytest.raises(ValueError, match="SMEM does not fit"):
        blackwell_bwd_wide_config(256, 256, "bf16", causal=False, qdo_stages=2)
    with pytest.raises(ValueError, match="^window_size"):
        blackwell_bwd_wide_config(192, 128, "bf16", causal=False, window_size=(-3, 0))
    with pytest.raises(ValueError, match="^softcap"):
        blackwell_bwd_wide_config(192, 128, "bf16", causal=False, softcap=-1.0)
    with pytest.raises(ValueError, match="^head_dim"):
        dq_windows(64)
    assert dq_windows(128) == (0,) and dq_windows(192) == (0, 64) and dq_windows(160) == (0, 32)


def _wide_kernel_module():
    from stage4_bwd_kernel import blackwell_bwd_wide  # imports cutlass (sets the arch first)

    return blackwell_bwd_wide


@pytest.mark.cpu
@pytest.mark.stage4
@pytest.mark.parametrize("d,dv", SUPPORTED_HEAD_DIMS_WIDE)
def test_window_and_split_arithmetic_on_numpy(d, dv):
    """The kernel's own windows, kept lanes and part columns applied to random dS / K / P / dO: dQ, dK
    and dV assembled from every CTA part and window equal dS K, dS^T Q and P^T dO, with every dQ
    column added exactly once (a lane kept twice, or never, fails)."""
    W = _wide_kernel_module()
    k = W.FlashAttentionBackwardSm100Wide(W.make_config("bf16", d, dv, False))
    rng = np.random.default_rng(7)
    tm, tn = k.tm, k.tn
    dS, P = rng.standard_normal((tm, tn)), rng.standard_normal((tm, tn))
    K, Q, dO = rng.standard_normal((tn, d)), rng.standard_normal((tm, d)), rng.standard_normal((tm, dv))
    dQ, adds = np.zeros((tm, d)), np.zeros(d, dtype=int)
    dK, dV = np.zeros((tn, d)), np.zeros((tn, dv))
    for part in range(k.splits):
        cols_k = slice(part * k.dk_cols, (part + 1) * k.dk_cols)
        cols_v = slice(part * k.dv_cols, (part + 1) * k.dv_cols)
        dK[:, cols_k] += dS.T @ Q[:, cols_k]
        dV[:, cols_v] += P.T @ dO[:, cols_v]
        for w, w0 in enumerate(k.windows):
            first = part * k.dk_cols + w0
            dqt = K[:, first:first + 128].T @ dS.T           # (128 head-dim rows, 64 queries): lane = row
            for lane in range(k._window_keeps_from(w), 128):
                dQ[:, first + lane] += dqt[lane]
                adds[first + lane] += 1
    assert (adds == 1).all(), adds
    np.testing.assert_allclose(dQ, dS @ K, atol=1e-9)
    np.testing.assert_allclose(dK, dS.T @ Q, atol=1e-9)
    np.testing.assert_allclose(dV, P.T @ dO, atol=1e-9)


@pytest.mark.cpu
@pytest.mark.stage4
def test_split_order_launches_the_parts_of_a_tile_together():
    from stage4_bwd_kernel import schedule

    W = _wide_kernel_module()
    order = W.split_order(schedule.KVDescendingOrder, 2)
    assert W.split_order(schedule.KVDescendingOrder, 1) is schedule.KVDescendingOrder
    assert order.name == "kv_descending_split2"
    n = 9
    tiles = [order.n_block_for_launch(bx, n) for bx in range(2 * n)]
    assert tiles == [schedule.KVDescendingOrder.n_block_for_launch(bx // 2, n) for bx in range(2 * n)]
    assert sorted(tiles) == sorted(list(range(n)) * 2) and all(tiles[2 * i] == tiles[2 * i + 1] for i in range(n))
    assert order.rank(3, 0, 8) == schedule.KVDescendingOrder.rank(3, 0, 8)
    # the grid doubles in x (one CTA a part), the kernel knows its parts
    k = W.FlashAttentionBackwardSm100Wide(W.make_config("bf16", 256, 256, True, True))
    assert k.splits == 2 and (k.dk_cols, k.dv_cols) == (128, 128) and k.dq_order.name.endswith("_split2")
    assert W.part_offset(128, 64) == 2 * 64 * 64 and W.part_offset(64, 128) == 128 * 64
    with pytest.raises(ValueError, match="^col"):
        W.part_offset(32, 64)


@pytest.mark.cpu
@pytest.mark.stage4
def test_wide_head_dims_route_to_the_wide_kernel():
    """stage4_bwd_kernel.blackwell (what fa4 imports) builds the wide kernel at (192, 128) and 256 and the
    1-CTA one elsewhere; blackwell_bwd itself knows nothing of the wide kernel (it would import it back)."""
    from stage4_bwd_kernel import blackwell, blackwell_bwd

    W = _wide_kernel_module()
    for d, dv in SUPPORTED_HEAD_DIMS_WIDE:
        assert blackwell.is_wide(d, dv) and blackwell._kernel_maker(d, dv) is W.make_kernel
        kern = blackwell.make_kernel("bf16", d, dv, True, False)
        assert isinstance(kern, W.FlashAttentionBackwardSm100Wide) and kern.tile_m == 64
        kern = blackwell.make_kernel("bf16", d, dv, False, True, varlen=True, has_seqused_k=True)
        assert kern.varlen and kern.has_seqused_k
    assert blackwell.is_wide(256, None) and not blackwell.is_wide(192, 192) and blackwell._kernel_maker(128, 128) is None
    assert type(blackwell.make_kernel("bf16", 128, 128, True, False)) is blackwell_bwd.FlashAttentionBackwardSm100
    with pytest.raises(ValueError, match="^tiles"):
        blackwell.make_kernel("bf16", 192, 128, False, False, tiles=(128, 128))
    # the public functions check the variants first and refuse to run without a Blackwell GPU
    import torch

    t = torch.zeros(1, 8, 2, 192)
    with pytest.raises(RuntimeError, match="Blackwell"):
        blackwell.attention_backward(t, t, t[..., :128], t[..., :128], t[..., :128], torch.zeros(1, 2, 8))


# ------------------------------------------------------------------------------------ compile tier
BUILDS = [dict(dtype="bf16", head_dim=d, head_dim_v=dv, causal=c, deterministic=det)
          for (d, dv), c, det in itertools.product(SUPPORTED_HEAD_DIMS_WIDE, (False, True), (False, True))]
BUILDS += [dict(dtype=dt, head_dim=d, head_dim_v=dv, causal=True, varlen=True, has_seqused_k=True, deterministic=det)
           for (d, dv), dt, det in (((192, 128), "fp16", False), ((256, 256), "bf16", True))]
BUILDS += [dict(dtype="bf16", head_dim=d, head_dim_v=dv, causal=False, window_size=(256, 0), softcap=30.0)
           for d, dv in SUPPORTED_HEAD_DIMS_WIDE]
BUILDS += [dict(dtype="fp16", head_dim=d, head_dim_v=dv, causal=True) for d, dv in SUPPORTED_HEAD_DIMS_WIDE]


def _id(b):
    extra = "-".join(k for k in ("varlen", "deterministic") if b.get(k)) + ("-variant" if "softcap" in b else "")
    return f"{b['dtype']}-d{b['head_dim']}-{'causal' if b['causal'] else 'noncausal'}" + (f"-{extra}" if extra else "")


@pytest.fixture(scope="module", params=BUILDS, ids=[_id(b) for b in BUILDS])
def build(request):
    from stage4_bwd_kernel import blackwell  # the public route: compile_only sends wide dims on

    b = dict(request.param)
    return b, blackwell.compile_only(**b)


@pytest.mark.compile
@pytest.mark.stage4
def test_builds_compile_without_local_memory_at_the_planned_smem(build):
    b, comp = build
    r = comp.report
    assert r["ptx_target"] == "sm_100a"
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["LDL/STL"] == 0, r
    plan = blackwell_bwd_wide_config(b["head_dim"], b["head_dim_v"], b["dtype"], causal=b["causal"])
    assert r["smem_bytes"] == -(-plan.smem.total // KB) * KB     # the storage struct rounds to 1 KB
    assert r["tmem_cols_alloc"] == 512 and r["tmem_cols_used"] == plan.tmem.used


@pytest.mark.compile
@pytest.mark.stage4
def test_the_serial_schedule_issues_each_mma_once_per_tile(build):
    """UTCHMMA SS: S^T (d / 16 K-steps), dP^T (dv / 16), the dQ^T windows (128 keys / 16 each); TS: dV
    and dK (64 queries / 16 each): each in the code once, as one loop body issues them all."""
    b, comp = build
    d, dv = b["head_dim"], b["head_dim_v"]
    windows = dq_windows(d // head_splits(d, dv))
    assert comp.report["UTCHMMA.SS"] == d // 16 + dv // 16 + len(windows) * 128 // 16
    assert comp.report["UTCHMMA.TS"] == 2 * 64 // 16
    # dQ^T leaves as one scalar add per (query, kept window): 64 x windows in the code, no v2 row adds
    assert comp.report["ptx_red_f32"] == 64 * len(windows) and comp.report["ptx_red_v2"] == 0


@pytest.mark.compile
@pytest.mark.stage4
def test_deterministic_builds_spin_on_the_semaphore(build):
    b, comp = build
    acquires = len(re.findall(r"ld\.global\.acquire\.gpu", comp.ptx))
    assert (acquires > 0) == bool(b.get("deterministic")), acquires


@pytest.mark.compile
@pytest.mark.stage4
@pytest.mark.parametrize("d,dv", SUPPORTED_HEAD_DIMS_WIDE)
def test_part_and_window_views_match_the_tiles_element_by_element(d, dv):
    from stage4_bwd_kernel.blackwell_layout_check import _static_layouts, wide_view_mismatches

    W = _wide_kernel_module()
    k = W.FlashAttentionBackwardSm100Wide(W.make_config("bf16", d, dv, False))
    got = wide_view_mismatches(k)
    parts, windows = k.splits, len(k.windows)
    assert len(got) == 2 * parts + parts * windows and set(got.values()) == {0}, got
    assert all(v != 0 for v in wide_view_mismatches(k, shift=64).values())   # a wrong column is caught
    # the dS^T layout _ds_smem_chunk indexes: element (query n, key k) at n + 64 k (one 128-byte row a key)
    shape, stride, _ = _static_layouts(k)["sdS"]
    assert (shape, stride) == (((64, 16), 1, 8, 1), ((1, 64), 0, 1024, 0))


@pytest.mark.cpu
@pytest.mark.stage4
def test_readme_roofline_table_is_generated():
    """stage4_bwd_kernel/README.md's wide Blackwell table is roofline.blackwell_wide_table()'s output."""
    import pathlib

    from stage4_bwd_kernel import roofline

    text = (pathlib.Path(__file__).resolve().parents[1] / "stage4_bwd_kernel" / "README.md").read_text()
    block = text.split("<!-- wide-roofline:begin -->\n")[1].split("<!-- wide-roofline:end -->")[0]
    assert block.strip() == roofline.blackwell_wide_table().strip()
    c, splits = roofline.blackwell_wide_tile_cycles(192, 128)
    # by hand, 64 x 128 tile at (192, 128): flops 2 * 64 * 128 * (192 + 128 + 128 + 192 + 2 * 128)
    assert splits == 1 and c.mma == 2 * 64 * 128 * 896 / 8192
