"""The production Hopper forward (`stage3_fwd_kernel.hopper`): FA4's softmax (conditional
rescaling, optional partial exp2 emulation) and varlen, on one tile per CTA (persistent CTAs, the
split tail and the merge kernels: test_hopper_persistent.py, which uses the helpers here).

cpu tier: SoftmaxPolicy validation and its emulation pattern; bad arguments raise ValueError /
TypeError naming the argument before anything is compiled or launched; the size limits of the
product's modules.

compile tier (no GPU): every head-dim config (bf16; fp16 once), causal on/off, the varlen kernel
(with seqused_k and batch_map), emulation fraction 0 / 0.25, tau 0 / 8, and at d = 64 both CTA
heights (tile_m 192 = three consumer warpgroups, the default there, and 128). ptxas: no spills, no
local memory, setmaxnreg honoured and its register pool balanced; SASS: HGMMA, UTMALDG, exactly one
warp vote (VOTE.ANY) per softmax site (prologue, masked loop, hot loop), and the emulation chain
(FADD.RM, one per emulated value) exactly when the fraction is > 0. The lean mask's premise
(per-thread column shift) traced on the kernel's own MMA, and about one select per masked score.

gpu tier (H100/H200): out and lse follow FA4's rule (2x the error of a PyTorch bf16/fp16
implementation against fp32) over the seqlen / head-dim / causal / GQA matrix, fp16, both
policies' knobs, adversarial rising scores; outputs are NaN-poisoned before every run; two runs are
bitwise identical; at d = 64 all of it with tile_m 128 and 192. The varlen kernel's GPU tests are in
test_hopper_forward_varlen.py. Compiles dominate the time, so configs are reused across tests.
"""
from __future__ import annotations

import math

import pytest

HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (128, 64), (192, 128), (256, 256)]


def _mod():
    from stage3_fwd_kernel import hopper

    return hopper


# ============================================================================================ cpu
@pytest.mark.cpu
@pytest.mark.stage3
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_ring_slot_matches_the_carried_state(stages):
    """The producer divides its ring slot out of the load count (intdiv.ring_slot) while the
    consumers carry theirs from block to block (PipelineState.advance: next index, wrap to 0 and
    flip the phase); both must name the same slot and phase for every block, across tiles too
    (a persistent CTA's count runs on)."""
    from stage3_fwd_kernel.intdiv import ring_slot

    index, phase = ring_slot(0, stages)
    assert (index, phase) == (0, 0)
    for t in range(1, 10 * stages + 3):
        index, phase = (index + 1, phase) if index + 1 < stages else (0, phase ^ 1)
        assert ring_slot(t, stages) == (index, phase), t


@pytest.mark.cpu
@pytest.mark.stage3
def test_policy_defaults_and_pattern():
    from stage3_fwd_kernel.softmax_policy import PATTERN_PERIOD, SoftmaxPolicy, emulation_pattern

    p = SoftmaxPolicy()
    assert (p.rescale_threshold, p.emulation_fraction, p.degree) == (8.0, 0.25, 3)
    assert p.pattern == emulation_pattern(4) and sum(p.pattern) == 4
    assert [i for i, e in enumerate(p.pattern) if e] == [3, 7, 11, 15]  # spread evenly
    assert not any(SoftmaxPolicy(emulation_fraction=0.0).pattern)
    assert all(SoftmaxPolicy(emulation_fraction=1.0).pattern)
    for k in range(PATTERN_PERIOD + 1):
        pat = emulation_pattern(k)
        assert len(pat) == PATTERN_PERIOD and sum(pat) == k
    # fractions snap to sixteenths, so equal kernels have equal (hashable) policies
    assert SoftmaxPolicy(emulation_fraction=0.3).emulation_fraction == 5 / 16
    assert SoftmaxPolicy(8, 0.26) == SoftmaxPolicy(8.0, 0.25) and len({SoftmaxPolicy(8, 0.26), p}) == 1
    assert len(p.coefficients) == 4 and p.coefficients[0] == 1.0


@pytest.mark.cpu
@pytest.mark.stage3
@pytest.mark.parametrize("kwargs,exc,word", [
    (dict(rescale_threshold=-1.0), ValueError, "rescale_threshold"),
    (dict(rescale_threshold=float("inf")), ValueError, "rescale_threshold"),
    (dict(rescale_threshold=100.0), ValueError, "rescale_threshold"),
    (dict(rescale_threshold="8"), TypeError, "rescale_threshold"),
    (dict(emulation_fraction=1.5), ValueError, "emulation_fraction"),
    (dict(emulation_fraction=-0.1), ValueError, "emulation_fraction"),
    (dict(emulation_fraction=None), TypeError, "emulation_fraction"),
    (dict(degree=2), ValueError, "degree"),
    (dict(degree=3.0), TypeError, "degree"),
])
def test_policy_validation(kwargs, exc, word):
    from stage3_fwd_kernel.softmax_policy import SoftmaxPolicy

    with pytest.raises(exc, match=word):
        SoftmaxPolicy(**kwargs)


@pytest.mark.cpu
@pytest.mark.stage3
def test_fp16_threshold_headroom():
    import cutlass

    from stage3_fwd_kernel.softmax_policy import SoftmaxPolicy

    SoftmaxPolicy(15.0).check_dtype(cutlass.Float16)
    SoftmaxPolicy(40.0).check_dtype(cutlass.BFloat16)
    with pytest.raises(ValueError, match="rescale_threshold"):
        SoftmaxPolicy(16.0).check_dtype(cutlass.Float16)
    with pytest.raises(ValueError, match="rescale_threshold"):
        _mod().compile_only("fp16", 128, rescale_threshold=20.0)


@pytest.mark.cpu
@pytest.mark.stage3
def test_hopper_alias_exports():
    from stage3_fwd_kernel import hopper

    from stage3_fwd_kernel.hopper import host

    assert hopper.attention_forward is host.attention_forward
    assert hopper.attention_varlen_forward is host.attention_varlen_forward
    assert hopper.compile_only is host.compile_only
    assert all(hasattr(hopper, name) for name in hopper.__all__)
    assert hopper.DEFAULT_RESCALE_THRESHOLD == 8.0 and hopper.DEFAULT_EMULATION_FRACTION == 0.0  # measured best on H100
    assert hopper.DEFAULT_POLICY == hopper.SoftmaxPolicy(emulation_fraction=hopper.DEFAULT_EMULATION_FRACTION)


def _cpu_varlen(total_q=10, total_k=12, heads=4, heads_kv=2, d=64):
    import torch

    q = torch.zeros(total_q, heads, d, dtype=torch.bfloat16)
    k = torch.zeros(total_k, heads_kv, d, dtype=torch.bfloat16)
    v = torch.zeros(total_k, heads_kv, d, dtype=torch.bfloat16)
    cu_q = torch.tensor([0, 4, total_q], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, total_k], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


@pytest.mark.cpu
@pytest.mark.stage3
@pytest.mark.parametrize("case,exc,word", [
    ("cu_q_dtype", TypeError, "cu_seqlens_q"),
    ("cu_k_len", ValueError, "cu_seqlens_k"),
    ("seqused_shape", ValueError, "seqused_k"),
    ("batch_map_dtype", TypeError, "batch_map"),
    ("max_seqlen_neg", ValueError, "max_seqlen_q"),
    ("max_seqlen_float", TypeError, "max_seqlen_k"),
    ("rank", ValueError, "rank 3"),
    ("gqa", ValueError, "heads"),
    ("dtype", TypeError, "fp16/bf16"),
    ("fraction", ValueError, "emulation_fraction"),
    ("cpu", ValueError, "CUDA"),
])
def test_varlen_bad_arguments(case, exc, word):
    import torch

    q, k, v, cu_q, cu_k = _cpu_varlen()
    kw: dict = {}
    args = [q, k, v, cu_q, cu_k, 6, 7]
    if case == "cu_q_dtype":
        args[3] = cu_q.long()
    elif case == "cu_k_len":
        args[4] = cu_k[:2]
    elif case == "seqused_shape":
        kw["seqused_k"] = torch.zeros(3, dtype=torch.int32)
    elif case == "batch_map_dtype":
        kw["batch_map"] = torch.zeros(2, dtype=torch.int64)
    elif case == "max_seqlen_neg":
        args[5] = -1
    elif case == "max_seqlen_float":
        args[6] = 7.0
    elif case == "rank":
        args[0] = q[None]
    elif case == "gqa":
        args[1], args[2] = k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1)
    elif case == "dtype":
        args[0] = q.float()
    elif case == "fraction":
        kw["emulation_fraction"] = 2.0
    with pytest.raises(exc, match=word):
        _mod().attention_varlen_forward(*args, **kw)


@pytest.mark.cpu
@pytest.mark.stage3
def test_scale_and_head_dim_checks():
    """(checked after the device check in the entry points, so tested directly here)"""
    mod = _mod()
    assert mod._check_scale(None, 64) == 0.125
    for bad, exc in ((-0.1, ValueError), (0.0, ValueError), (float("nan"), ValueError), ("0.1", TypeError),
                     (1e-35, ValueError)):
        with pytest.raises(exc, match="softmax_scale"):
            mod._check_scale(bad, 64)
    assert mod._check_scale(mod.MIN_SOFTMAX_SCALE, 64) == mod.MIN_SOFTMAX_SCALE
    # the bound keeps the vote's limit finite in fp32 at the largest tau, and fa4 checks the same one
    import numpy as np

    from stage3_fwd_kernel.softmax_policy import MAX_RESCALE_THRESHOLD as tau

    assert np.isfinite(np.float32(tau) / np.float32(mod.MIN_SOFTMAX_SCALE * math.log2(math.e)))
    from fa4._validate import MIN_SOFTMAX_SCALE
    assert MIN_SOFTMAX_SCALE == mod.MIN_SOFTMAX_SCALE
    for d, dv in ((48, 48), (64, 128), (320, 320)):
        with pytest.raises(ValueError, match="head_dim"):
            mod._check_head_dims(d, dv)


@pytest.mark.cpu
@pytest.mark.stage3
def test_narrow_windows_take_128_row_tiles_at_d64():
    """A window of at most NARROW_WINDOW_KEYS keys (left + right; causal's right edge is 0) takes
    128-row tiles at d = 64; wider or one-side-unlimited windows keep 192; d > 64 is 128 anyway. The
    compile-cache key resolves the default the same way, so an explicit 128 shares its kernel."""
    from stage3_fwd_kernel.components.window import beyond_causal
    from stage3_fwd_kernel.hopper import config, host

    def tile(causal, window_size, d=64):
        return config.default_tile_m(d, d, causal, beyond_causal(causal, window_size))

    assert config.NARROW_WINDOW_KEYS == 512
    assert tile(True, (256, 0)) == tile(True, (512, 0)) == tile(False, (256, 256)) == 128
    assert tile(False, (0, 0)) == tile(False, (100, 412)) == 128
    assert tile(True, (513, 0)) == tile(True, (1024, 0)) == tile(False, (1024, 1024)) == tile(False, (256, 257)) == 192
    assert tile(False, (None, 256)) == tile(False, (256, None)) == 192
    assert tile(True, (None, None)) == tile(False, (-1, -1)) == 192
    assert tile(True, (256, 0), d=128) == tile(False, (256, 256), d=96) == 128
    assert config.window_keys(True, beyond_causal(True, (300, 0))) == 300
    assert config.window_keys(False, beyond_causal(False, (300, 20))) == 320
    band = host.Variant(beyond_causal(False, (256, 256)), 0.0, False)
    args = ("fwd", "bf16", 64, 64, False, config.DEFAULT_POLICY, None)
    assert host._key(*args, tile_m=None, variant=band) == host._key(*args, tile_m=128, variant=band)
    assert host._key(*args, tile_m=None) == host._key(*args, tile_m=192)


@pytest.mark.cpu
@pytest.mark.stage3
def test_tile_m_defaults_and_validation():
    """192 rows (three consumer warpgroups) at d = 64 and at d = 96 non-causal or causal with >= 8192
    keys (P through shared memory above d = 64, config.p_through_smem), 128 elsewhere; 192 taken up to
    d = 96 and refused above."""
    import cutlass

    mod = _mod()
    assert [mod.default_tile_m(d, dv) for d, dv in HEAD_DIMS] == [192, 192, 128, 128, 128, 128]
    assert [mod.default_tile_m(d, dv, True) for d, dv in HEAD_DIMS] == [192, 128, 128, 128, 128, 128]
    # 192 x 144 only: a softcap spills at 144 keys, a cache counts 128-key blocks (a page gather spilled at 192)
    assert mod.default_tile_m(96, 96, softcap=True) == mod.default_tile_m(96, 96, cache=True) == 128
    # causal d = 96 from D96_CAUSAL_TILE192_MIN_KEYS keys: not with a softcap, a window or keys from a cache
    from stage3_fwd_kernel.components.window import Window
    from stage3_fwd_kernel.hopper import config

    n = config.D96_CAUSAL_TILE192_MIN_KEYS
    assert [mod.default_tile_m(96, 96, True, seqlen_k=s) for s in (None, 1, n - 1, n, 4 * n)] == [128] * 3 + [192] * 2
    assert [mod.default_tile_m(d, dv, True, seqlen_k=n) for d, dv in HEAD_DIMS] == [192, 192, 128, 128, 128, 128]
    assert mod.default_tile_m(96, 96, True, softcap=True, seqlen_k=n) == 128
    assert mod.default_tile_m(96, 96, True, seqlen_k=n, sink=True) == 128   # that build spills in its loop
    assert mod.default_tile_m(96, 96, True, Window(1024, None), seqlen_k=n) == 128
    assert mod.default_tile_m(96, 96, True, cache=True, seqlen_k=n) == 128
    assert [mod.grid_order_causal(96, 96, s) for s in (n - 1, n)] == [False, True]
    assert not mod.grid_order_causal(96, 96, n, softcap=True) and not mod.grid_order_causal(128, 128, n)
    assert not mod.grid_order_causal(96, 96, n, sink=True)
    assert mod._check_tile_m(None, 64, 64) == 192 and mod._check_tile_m(128, 64, 64) == 128
    assert mod._check_tile_m(64, 256, 256) == 64  # one consumer warpgroup: any head dims
    for bad in (32, 256, True, 192.0, "192"):
        with pytest.raises(ValueError, match="tile_m"):
            mod._check_tile_m(bad, 64, 64)
    with pytest.raises(ValueError, match="tile_m: 192 needs head dims <= 96"):
        mod._check_tile_m(192, 128, 128)
    with pytest.raises(ValueError, match="tile_m"):
        mod.compile_only("bf16", 128, tile_m=192)  # refused before anything is traced
    assert mod._check_tile_m(192, 96, 96) == 192  # P through shared memory: test_hopper_forward_p_smem.py
    with pytest.raises(ValueError, match="tile_m"):
        mod.FlashAttentionForwardSm90(cutlass.BFloat16, 64, 64, False, tile_m=256)
    for tm, nc, regs in ((128, 2, (24, 240)), (192, 3, (32, 160))):
        k = mod.make_kernel(cutlass.BFloat16, 64, 64, True, tile_m=tm)
        assert (k.tile_m, k.num_consumers, k.wg_m, k.num_threads) == (tm, nc, 64, 128 * (1 + nc))
        assert (k.regs_producer, k.regs_consumer) == regs
        # setmaxnreg: multiples of 8, and the consumers take no more than the producer frees from the
        # 65536 / threads registers (rounded down to 8) each thread gets at launch
        entry = 65536 // k.num_threads // 8 * 8
        assert k.regs_producer % 8 == 0 and k.regs_consumer % 8 == 0
        assert 128 * (k.regs_producer + nc * k.regs_consumer) <= k.num_threads * entry <= 65536
    assert mod.make_kernel(cutlass.BFloat16, 64, 64, False).tile_m == 192
    assert mod.make_kernel(cutlass.BFloat16, 128, 128, False).tile_m == 128
    assert mod._key("gpu", cutlass.BFloat16, 64, 64, False, mod.DEFAULT_POLICY, None) != \
        mod._key("gpu", cutlass.BFloat16, 64, 64, False, mod.DEFAULT_POLICY, None, tile_m=128)


@pytest.mark.cpu
@pytest.mark.stage3
def test_q_shift_puts_the_partial_q_tile_first():
    """Causal dense 192-row tiles count their Q tiles from the sequence's end: the partial tile is
    then the first (one key block at 4k) instead of the last (all 32), 363 instead of 384 tile-block
    steps per 4k head at d = 64; varlen, non-causal and 128-row builds keep row 0 aligned."""
    import cutlass

    mod = _mod()
    kernel = mod.make_kernel(cutlass.BFloat16, 64, 64, True)
    assert kernel.tile_m == 192 and kernel.q_shift_for(False) and not kernel.q_shift_for(True)
    for k in (mod.make_kernel(cutlass.BFloat16, 64, 64, False), mod.make_kernel(cutlass.BFloat16, 64, 64, True, tile_m=128),
              mod.make_kernel(cutlass.BFloat16, 128, 128, True)):
        assert not k.q_shift_for(False)
    assert [kernel.top_padding(s) for s in (4096, 8192, 16384, 192, 1)] == [128, 64, 128, 0, 191]

    def steps(seqlen, pad):
        tiles = -(-(seqlen + pad) // 192)
        return sum(kernel.num_key_blocks(m, seqlen + pad, seqlen) for m in range(tiles))

    assert steps(4096, 0) == 384 and steps(4096, kernel.top_padding(4096)) == 363
    assert steps(16384, 0) == 5632 and steps(16384, kernel.top_padding(16384)) == 5547


@pytest.mark.cpu
@pytest.mark.stage3
def test_dense_bad_arguments():
    import torch

    mod = _mod()
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="q"):
        mod.attention_forward("q", q, q)
    with pytest.raises(ValueError, match="rescale_threshold"):
        mod.attention_forward(q, q, q, rescale_threshold=-2.0)
    with pytest.raises(ValueError, match="CUDA"):
        mod.attention_forward(q, q, q)
    with pytest.raises(ValueError, match="seqused_k"):
        mod.compile_only(seqused_k=True)
    with pytest.raises(ValueError, match="head_dim"):
        mod.compile_only(head_dim=80)


# ======================================================================================= compile
# (dtype, d, dv, causal, varlen flags, tau, fraction, tile_m): every head dim for bf16, causal both
# ways, fp16 once, the varlen kernel (full flags and plain), the policy corners at d = 128, and at
# d = 64 both CTA heights (tile_m None = default_tile_m: 192 there, 128 elsewhere).
COMPILE_CASES = [
    ("bf16", 64, 64, False, (), 8.0, 0.25, None),
    ("bf16", 96, 96, True, (), 8.0, 0.25, None),
    ("bf16", 128, 128, False, (), 8.0, 0.25, None),
    ("bf16", 128, 128, True, (), 8.0, 0.25, None),
    ("bf16", 192, 128, True, (), 8.0, 0.25, None),
    ("bf16", 256, 256, False, (), 8.0, 0.25, None),
    ("fp16", 128, 128, True, (), 8.0, 0.25, None),
    ("bf16", 128, 128, True, ("varlen", "seqused_k", "batch_map"), 8.0, 0.25, None),
    ("bf16", 64, 64, False, ("varlen",), 8.0, 0.25, None),
    ("bf16", 128, 128, False, (), 8.0, 0.0, None),
    ("bf16", 128, 128, False, (), 0.0, 0.25, None),
    # three consumer warpgroups (tile_m = 192) with the production policy, causal, fp16, full varlen
    ("bf16", 64, 64, False, (), 8.0, 0.0, 192),
    ("bf16", 64, 64, True, (), 8.0, 0.0, 192),
    ("fp16", 64, 64, True, (), 8.0, 0.25, 192),
    ("bf16", 64, 64, True, ("varlen", "seqused_k", "batch_map"), 8.0, 0.0, 192),
    # ... and the two-consumer kernel at d = 64, no longer the default there
    ("bf16", 64, 64, True, (), 8.0, 0.25, 128),
    ("bf16", 64, 64, False, ("varlen",), 8.0, 0.0, 128),
    # ... and the production policy at the other head dims, causal, fp16, varlen
    ("bf16", 128, 128, True, (), 8.0, 0.0, None),
    ("fp16", 128, 128, True, (), 8.0, 0.0, None),
    ("bf16", 64, 64, True, (), 8.0, 0.0, 128),
    ("bf16", 256, 256, False, (), 8.0, 0.0, None),
    ("bf16", 192, 128, True, ("varlen", "seqused_k", "batch_map"), 8.0, 0.0, None),
    ("bf16", 128, 64, True, (), 8.0, 0.0, None),
    # one consumer warpgroup (short queries, decode): no tensor-core turn
    ("bf16", 128, 128, False, ("varlen", "seqused_k"), 8.0, 0.0, 64),
    # three consumers at d = 96: P through shared memory (config.p_through_smem;
    # test_hopper_forward_p_smem.py reads the P stores and the P V wgmmas)
    ("bf16", 96, 96, False, (), 8.0, 0.0, 192),
    ("bf16", 96, 96, True, (), 8.0, 0.0, 192),
    ("fp16", 96, 96, False, ("varlen", "seqused_k"), 8.0, 0.0, 192),
    ("bf16", 96, 96, True, ("varlen",), 8.0, 0.0, 192),
]
THREE_CONSUMER_CASES = [c for c in COMPILE_CASES if c[7] == 192]


def _check_spills(case, comp):
    """No spill, stack frame or local-memory traffic -- but on the causal 192 x 144 d = 96 tile: 8 spilled
    bytes there, 12 varlen (values of the kernel's entry, reloaded outside the key-block loop:
    config.default_tile_n), and no local-memory access inside that loop."""
    from stage3_fwd_kernel.sass_report import key_block_loop

    dt, d, dv, causal, flags, tau, frac, tile_m = case
    rep = comp.report
    if causal and _key_tile(d, dv, causal, tile_m) == 144:
        limit = 12 if "varlen" in flags else 8
        assert rep["spill_stores"] <= limit and rep["stack_frame"] <= 16, rep
        assert not any(o.startswith(("LDL", "STL")) for o in key_block_loop(comp.sass)), "spills in the key-block loop"
        return
    assert rep["spill_stores"] == rep["spill_loads"] == rep["stack_frame"] == rep["LDL/STL"] == 0, rep


def _case_id(c):
    dt, d, dv, causal, flags, tau, frac, tile_m = c
    return (f"{dt}-d{d}x{dv}-{'causal' if causal else 'full'}{''.join('-' + f for f in flags)}-tau{tau:g}"
            f"-f{frac:g}" + ("" if tile_m is None else f"-m{tile_m}"))


def _key_tile(d, dv, causal, tile_m):
    """The key tile a COMPILE_CASES build walks (its tile_m resolved first; no window, softcap or cache)."""
    from stage3_fwd_kernel.hopper import _check_tile_m, default_tile_n

    return default_tile_n(d, dv, _check_tile_m(tile_m, d, dv, causal), plain=True)


@pytest.fixture(scope="module")
def compiled():
    """Compile each case once per module (the compile cache is per process anyway)."""
    mod = _mod()
    cache = {}

    def get(case):
        if case not in cache:
            dt, d, dv, causal, flags, tau, frac, tile_m = case
            cache[case] = mod.compile_only(dt, d, dv, causal, varlen="varlen" in flags,
                                           seqused_k="seqused_k" in flags, batch_map="batch_map" in flags,
                                           rescale_threshold=tau, emulation_fraction=frac, tile_m=tile_m)
        return cache[case]
    return get


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("case", COMPILE_CASES, ids=[_case_id(c) for c in COMPILE_CASES])
def test_compiles_sm90a(compiled, case):
    import re

    from stage3_fwd_kernel.host_io import cutlass_dtype

    dt, d, dv, causal, flags, tau, frac, tile_m = case
    comp = compiled(case)
    rep = comp.report
    kernel = _mod().make_kernel(cutlass_dtype(dt), d, dv, causal, tile_m=tile_m)  # constants
    nc = kernel.num_consumers
    _check_spills(case, comp)
    assert rep["threads"] == kernel.num_threads == 128 * (1 + nc)  # 384 or 512
    # the launch cap (168 at 384 threads, 128 at 512) is the whole CTA register pool that setmaxnreg
    # redistributes: a consumer's .inc waits until the producer's .dec has freed enough, so the
    # entry count must cover producer + consumers, or the kernel would hang
    # (one consumer, 256 threads: ptxas stops at 240, under the 256 the file would allow)
    assert rep["registers"] == min(65536 // rep["threads"] // 8 * 8, 240)
    assert rep["threads"] * rep["registers"] >= 128 * (kernel.regs_producer + nc * kernel.regs_consumer)
    assert rep["smem_bytes"] is not None and rep["smem_bytes"] <= 227 * 1024
    assert rep["HGMMA"] and rep["UTMALDG"], "not on the wgmma + TMA path"
    assert re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", comp.ptx) == [str(kernel.regs_producer)]
    assert re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", comp.ptx) == [str(kernel.regs_consumer)]
    assert "C7508" not in rep["ptxas_log"], "ptxas ignored setmaxnreg"
    # the consumer path stays within its setmaxnreg budget (highest register index + 1 <= 240 / 160)
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", comp.sass)) + 1 <= kernel.regs_consumer


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("case", THREE_CONSUMER_CASES, ids=[_case_id(c) for c in THREE_CONSUMER_CASES])
def test_three_consumer_kernel_sm90a(compiled, case):
    """tile_m = 192 at d = 64 (and 96): 512 threads, setmaxnreg 32/160 without spills, one Q slab load per
    consumer, and the select-based mask (the per-element `if` lowers to ~2100 FSEL and spills here)."""
    import re

    comp = compiled(case)
    rep = comp.report
    assert rep["threads"] == 512 and rep["registers"] == 128
    _check_spills(case, comp)
    assert rep["HGMMA"] and rep["HGMMA"] > 0
    assert max(int(r) for r in re.findall(r"\bR(\d+)\b", comp.sass)) + 1 <= 160
    assert re.findall(r"setmaxnreg\.(dec|inc)\.sync\.aligned\.u32\s+(\d+)", comp.ptx) == [("dec", "32"), ("inc", "160")]
    # three 64-row Q slabs, K, V; the persistent build (the default without a key count) issues a
    # tile's first K/V block before its Q, a second copy of those two loads, and (causal: dynamic)
    # a last Q load that carries the "no more tiles" id, a second copy of the three Q slabs
    # (at d = 96 the 192-byte rows take the 64-byte swizzle: each load is 3 boxes of 32 columns, and
    # causal calls walk one CTA per tile: scheduling._resolve_scheduler)
    from stage3_fwd_kernel.wgmma_desc import swizzle_bytes

    boxes = case[1] * 2 // swizzle_bytes(case[1], 16)
    scheduler = _mod()._resolve_scheduler(None, None, case[1], case[2], case[3], varlen="varlen" in case[4],
                                          tile_m=192)
    persistent, dynamic = (getattr(scheduler, name, False) for name in ("persistent", "dynamic"))
    assert rep["UTMALDG"] == boxes * (3 * (2 if dynamic else 1) + 2 * (2 if persistent else 1))
    # 2 masked softmax sites (first block, masked loop; 4 with half blocks, _half_blocks) x 64 scores per
    # thread = 128 selects, + a few
    masked_sites = 2 + (HALF_SITES if _half_blocks(*case[1:4], 192) else 0)
    assert len(re.findall(r"\bFSEL\b", comp.sass)) < masked_sites * 64 + 64


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("d,tile_m,tile_n", [(128, 128, None), (256, 128, None), (64, 192, None), (128, 128, 176),
                                             (256, 128, 80)], ids=["d128", "d256-n64", "d64-m192", "n176", "n80"])
def test_lean_mask_column_shift_premise(d, tile_m, tile_n):
    """The lean mask compares thread 0's compile-time columns against a limit shifted by the thread's
    first column. Traced on the kernel's own S MMA (the accumulator layout is the same for fp16 and
    bf16), for all 128 threads of a consumer warpgroup: every element's column is thread 0's plus
    that shift (2 * (lane % 4)), its row the thread's row for that r, and the threads tile 64 x tile_n
    exactly once -- at the default tile_n (128; 64 at d = 256) and at two the tuner sweeps."""
    mod = _mod()  # before cutlass: the step module's import sets the target arch
    import cutlass

    kernel = mod.FlashAttentionForwardSm90(cutlass.BFloat16, d, d, True, tile_m=tile_m, tile_n=tile_n)
    assert mod.mask_shift_holds(kernel)



SOFTMAX_SITES = 3  # the walk traces the softmax for the first block, the masked blocks and the hot loop
HALF_SITES = 2  # builds with half blocks trace the first block and the masked steps once more (mainloop)


def _half_blocks(d, dv, causal, tile_m):
    from stage3_fwd_kernel.components.window import Window
    from stage3_fwd_kernel.hopper import _check_tile_m
    from stage3_fwd_kernel.hopper.config import half_blocks

    return half_blocks(_check_tile_m(tile_m, d, dv, causal), _key_tile(d, dv, causal, tile_m),
                       Window(None, 0 if causal else None))


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("case", COMPILE_CASES, ids=[_case_id(c) for c in COMPILE_CASES])
def test_softmax_policy_in_sass(compiled, case):
    dt, d, dv, causal, flags, tau, frac, tile_m = case
    rep = compiled(case).report
    per_thread = 2 * _key_tile(d, dv, causal, tile_m) // 4  # 2 rows x tile_n / 4 scores a thread
    emulated = int(per_thread * frac)
    # one FADD.RM per emulated value (the floor step of stage 2's sequence), none when fraction = 0, in
    # each of the softmax's three instances (first block, masked blocks, unmasked hot loop); the half-block
    # instances fold some away (half their scores are the constant -inf)
    if _half_blocks(d, dv, causal, tile_m):
        sites = SOFTMAX_SITES + HALF_SITES
        assert SOFTMAX_SITES * emulated <= rep["FADD.RM"] <= sites * emulated, rep
    else:
        sites = SOFTMAX_SITES
        assert rep["FADD.RM"] == sites * emulated, rep
    # the rest on MUFU, plus one rescale factor per row
    assert rep["MUFU.EX2"] >= per_thread - emulated + 2
    # conditional rescaling: one warp vote per tile, whatever tau (tau = 0 votes on "grew at all")
    assert rep["VOTE.ANY"] == sites, rep


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("case", COMPILE_CASES, ids=[_case_id(c) for c in COMPILE_CASES])
def test_hot_loop_bookkeeping(compiled, case):
    """The key-block loop (the shortest loop holding wgmma and exponentials) carries its K/V ring
    slot instead of dividing the block index as a signed Int32, whose rounding toward zero would show
    as LEA.HI / ULEA.HI sign fix-ups. And no row sum starts at 0.0 (`FADD R, RZ, R`)."""
    import re

    from stage3_fwd_kernel.sass_report import key_block_loop

    sass = compiled(case).sass
    hot = key_block_loop(sass)
    assert len(hot) > 100, "no key-block loop found"
    assert not [o for o in hot if o.startswith(("LEA.HI", "ULEA.HI"))], "signed division in the key-block loop"
    assert not re.findall(r"\bFADD R\d+, RZ, R\d+", sass), "an add of +0.0 (a row sum starting at 0.0)"


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("case", COMPILE_CASES, ids=[_case_id(c) for c in COMPILE_CASES])
def test_descriptors_outside_key_block_loop(compiled, case):
    """The wgmma descriptors are built once per tile (wgmma_desc). Through cute.gemm every key block
    re-derives Q's, K's and V's from the shared-memory base, each with a USHF.R.U32.HI (the address
    >> 4). The loop still issues one HGMMA per k-step of S and of P V, and ptxas does not serialize
    the inline-PTX wgmmas."""
    from stage3_fwd_kernel.sass_report import key_block_loop

    dt, d, dv, causal, flags, tau, frac, tile_m = case
    comp = compiled(case)
    assert not comp.report["wgmma_serialized"], "ptxas serialized the inline-PTX wgmmas"
    hot = key_block_loop(comp.sass)
    assert len(hot) > 100, "no key-block loop found"
    assert "USHF.R.U32.HI" not in hot, "a descriptor rebuilt from the shared-memory base in the key-block loop"
    hgmma = sum(o.startswith("HGMMA") for o in hot)
    assert hgmma == d // 16 + _key_tile(d, dv, causal, tile_m) // 16, f"{hgmma} HGMMA in the loop"


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("case", COMPILE_CASES, ids=[_case_id(c) for c in COMPILE_CASES])
def test_vote_and_bias_kept_beside_the_max(compiled, case):
    """The vote's limit m + tau / scale and the exponent's bias m * scale are kept beside m and move
    only in the rescale branch. So between the row maxima's last quad shuffle and VOTE.ANY the loop
    only compares (no FADD, FMUL per row), and its only FSELs are the rescale branch's two `m = -inf`
    guards."""
    from stage3_fwd_kernel.sass_report import key_block_loop

    hot = key_block_loop(compiled(case).sass)
    assert hot.count("VOTE.ANY") == 1, f"{hot.count('VOTE.ANY')} VOTE.ANY in the key-block loop"
    vote = hot.index("VOTE.ANY")
    last_shuffle = max(i for i, o in enumerate(hot[:vote]) if o.startswith("SHFL"))
    arithmetic = [o for o in hot[last_shuffle + 1:vote] if o.startswith(("FADD", "FMUL", "FFMA"))]
    assert not arithmetic, f"the vote computes before comparing: {arithmetic}"
    fsel = [o for o in hot if o.startswith("FSEL")]
    assert len(fsel) == 2, f"{len(fsel)} FSEL in the key-block loop (2 expected: the rescale branch's guards)"


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv", [(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)])
def test_descriptor_fields_match_cute_gemm(d, dv):
    """wgmma_desc's fixed descriptor fields (swizzle mode, stride and leading byte offsets) are the ones
    cute.gemm's lowering ORs into its descriptors, read from step 3's PTX (which still issues its
    wgmmas through cute.gemm) at the same head dims and key tile: Q / K read K-major, V MN-major."""
    import re

    from stage3_fwd_kernel import hopper_step3_warpspec as step3
    from stage3_fwd_kernel import wgmma_desc

    tn = step3.make_kernel(step3.cutlass.BFloat16, d, dv, False).tile_n
    ptx = step3.compile_only("bf16", d, dv, False).ptx
    theirs = {int(c) % (1 << 64) for c in re.findall(r"or\.b64\s+%rd\d+, %rd\d+, (-?\d+);", ptx)}
    ours = {wgmma_desc.fixed_fields(d, tn, 16, mn_major=False), wgmma_desc.fixed_fields(dv, tn, 16, mn_major=True)}
    assert theirs and ours == theirs, f"ours {sorted(map(hex, ours))}, cute.gemm's {sorted(map(hex, theirs))}"


@pytest.mark.compile
@pytest.mark.stage3
def test_descriptor_helpers():
    """The swizzle the DSL's smem atom picks, the upper descriptor word, and clear errors."""
    import cutlass
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.tensor_utils import LayoutEnum

    from stage3_fwd_kernel import wgmma_desc

    kinds = {128: "SW128", 64: "SW64", 32: "SW32"}
    for cols in (16, 32, 64, 96, 128, 160, 192, 256):
        kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, cutlass.BFloat16, cols)
        assert kinds[wgmma_desc.swizzle_bytes(cols, 16)] in str(kind), (cols, kind)
    assert wgmma_desc.desc_hi(128) == 0x40000040 and wgmma_desc.desc_hi(64) == 0x80000020
    assert wgmma_desc.leading_offset(64, 128, 16, mn_major=True) == 1       # one 128-byte chunk
    assert wgmma_desc.leading_offset(256, 64, 16, mn_major=True) == 64 * 128 // 16
    with pytest.raises(ValueError, match="cols"):
        wgmma_desc.swizzle_bytes(8, 16)
    with pytest.raises(TypeError, match="dtype"):
        wgmma_desc.ab_type(cutlass.Float32)


def _exps_before_pv_wait(sass: str) -> list:
    """For each steady-state step (a wait for S, `DEPBAR.LE gsb0, 0x1`), the exponentials issued
    before the following wait for P V (`DEPBAR.LE gsb0, 0x0`): MUFU.EX2 plus emulated ones."""
    counts, open_count = [], None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            open_count = 0
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and open_count is not None:
            counts.append(open_count)
            open_count = None
        elif open_count is not None and ("MUFU.EX2" in line or ".RM " in line and "FADD" in line):
            open_count += 1
    return counts


def _wide_key_tile(case) -> bool:
    from stage3_fwd_kernel.hopper import default_tile_n

    return default_tile_n(case[1], case[2]) >= 128


WIDE_TILE_CASES = [c for c in COMPILE_CASES if _wide_key_tile(c)]


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("case", WIDE_TILE_CASES, ids=[_case_id(c) for c in WIDE_TILE_CASES])
def test_pv_wait_placement(compiled, case):
    """The wait for P_{i-1} V_{i-1} (`wgmma.wait_group 0`), written after the softmax, is placed by ptxas
    among a thread's exponentials: some come before it, the rest after it, interleaved with the packs of P
    (test_P_packed_before_rescale_branch). This order measured faster than the wait below all of them
    (docs/measurements.md)."""
    dt, d, dv, causal, flags, tau, frac, tile_m = case
    per_thread = 2 * _key_tile(d, dv, causal, tile_m) // 4
    counts = _exps_before_pv_wait(compiled(case).sass)
    assert len(counts) >= 2, counts  # the masked and the mask-free steady-state loops
    assert all(0 < c < per_thread for c in counts), counts


def _packs_after_pv_wait(sass: str) -> list:
    """For each steady-state step (a wait for S, then the wait for P V), the F2FP packs between the
    wait for P V and the next branch (the O rescale's)."""
    counts, state = [], None
    for line in sass.splitlines():
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in line:
            state = "softmax"
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line and state == "softmax":
            state, packs = "packing", 0
        elif state == "packing" and " BRA" in line:
            counts.append(packs)
            state = None
        elif state == "packing" and "F2FP" in line:
            packs += 1
    return counts


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("case", COMPILE_CASES[:7], ids=[_case_id(c) for c in COMPILE_CASES[:7]])
def test_P_packed_before_rescale_branch(compiled, case):
    """store_P packs P with volatile cvts, so all of a step's packs (one per exp2 pair) stay between the
    wait for P V and the O rescale's branch, among the exponentials still in flight. Plain conversions
    sink past the branch to the next P V: 0 of 32 there at d = 64 bf16."""
    dt, d, dv, causal, flags, tau, frac, tile_m = case
    counts = _packs_after_pv_wait(compiled(case).sass)
    assert len(counts) >= 2, counts  # the masked and the mask-free steady-state loops
    assert counts == [_key_tile(d, dv, causal, tile_m) // 4] * len(counts), counts


@pytest.mark.compile
@pytest.mark.stage3
def test_varlen_zeroes_tail_of_V(compiled):
    """Only the varlen kernel writes shared memory before P V (zeroing V rows past seqused_k)
    and therefore needs the generic -> async proxy fence."""
    assert "fence.proxy.async" in compiled(COMPILE_CASES[7]).ptx
    assert "fence.proxy.async" not in compiled(COMPILE_CASES[3]).ptx


# =========================================================================================== gpu
SEQLENS = [(1, 1), (1, 3), (113, 203), (239, 1), (799, 3), (1024, 1024), (4224, 4224)]


def _tdt(dtype):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def _check(name, out, lse, ref, base):
    import torch
    from stage0_reference.torch_reference import assert_fa4_close

    assert not torch.isnan(out).any(), f"{name}: NaN in out (unwritten or poisoned rows)"
    assert not torch.isnan(lse).any(), f"{name}: NaN in lse (unwritten or poisoned rows)"
    assert_fa4_close(f"{name} out", out, ref[0], base[0])
    assert_fa4_close(f"{name} lse", lse, ref[1], base[1])


def _dense(q, k, v, *, causal, softmax_scale=None, **policy):
    """Run on NaN-poisoned outputs, check against the fp32 reference with FA4's rule."""
    import torch
    from stage0_reference.torch_reference import attention_ref

    out = torch.full(q.shape[:3] + (v.shape[3],), float("nan"), device="cuda", dtype=q.dtype)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device="cuda", dtype=torch.float32)
    _mod().attention_forward(q, k, v, softmax_scale=softmax_scale, causal=causal, out=out, lse=lse, **policy)
    torch.cuda.synchronize()
    ref = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, upcast=True)
    base = attention_ref(q, k, v, softmax_scale=softmax_scale, causal=causal, upcast=False)
    _check(f"dense {tuple(q.shape)}x{tuple(k.shape)} causal={causal} {policy}", out, lse, ref, base)
    return out, lse


def _randn_qkv(b, sq, sk, hq, hkv, d, dv, dtype="bf16", seed=0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    t = _tdt(dtype)
    return (torch.randn(b, sq, hq, d, device="cuda", dtype=t, generator=g),
            torch.randn(b, sk, hkv, d, device="cuda", dtype=t, generator=g),
            torch.randn(b, sk, hkv, dv, device="cuda", dtype=t, generator=g))


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv", HEAD_DIMS, ids=[f"d{d}x{dv}" for d, dv in HEAD_DIMS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
def test_forward_matches_reference(d, dv, causal, sq, sk):
    big = sq * sk > 2_000_000
    heads = 2 if big else 8
    ratio = [1, 2][(sq // 128 + d // 32) % 2] if big else [1, 2, 8][(sq + sk + d) % 3]  # GQA 1 / 2 / 8 over the cases
    q, k, v = _randn_qkv(1 if big else 2, sq, sk, heads, heads // ratio, d, dv, seed=sq + sk + d)
    _dense(q, k, v, causal=causal)


# d = 64 with both CTA heights: 192 rows (three consumers taking round-robin turns, the default) and
# 128 (two). The lengths leave the second / third consumer with partial rows or none at all (1,
# 113, 239 queries), put every row of a CTA past its diagonal (300 x 70, causal), span several
# 192-row tiles and key tiles (799 x 3, 1024, 4224), and mix GQA ratios 1 / 2 / 8.
TILE_M_SEQLENS = [(1, 1), (1, 3), (113, 203), (239, 1), (799, 3), (300, 70), (1024, 1024), (4224, 4224)]


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("tile_m", [128, 192])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", TILE_M_SEQLENS, ids=[f"{a}x{b}" for a, b in TILE_M_SEQLENS])
def test_d64_tile_m_matches_reference(tile_m, causal, sq, sk):
    big = sq * sk > 2_000_000
    heads = 2 if big else 8
    ratio = 2 if big else [1, 2, 8][(sq + sk) % 3]
    q, k, v = _randn_qkv(1 if big else 3, sq, sk, heads, heads // ratio, 64, 64, seed=sq + sk + tile_m)
    _dense(q, k, v, causal=causal, tile_m=tile_m)


SHORT_QUERY_CASES = [(1, 1, 128, 128, False), (1, 8192, 128, 128, False), (4, 4096, 128, 128, True),
                     (64, 3000, 64, 64, True), (33, 700, 192, 128, False), (64, 64, 256, 256, True),
                     (113, 203, 128, 64, False), (239, 1, 96, 96, True), (1024, 1024, 128, 128, True)]


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("sq,sk,d,dv,causal", SHORT_QUERY_CASES,
                         ids=[f"{a}x{b}-d{d}x{dv}-{'causal' if c else 'full'}" for a, b, d, dv, c in SHORT_QUERY_CASES])
def test_one_consumer_tile_matches_reference(sq, sk, d, dv, causal):
    """tile_m = 64 (one consumer warpgroup, no tensor-core turn): decode-like short queries, every head
    dim, and longer ones that walk several Q tiles; dense, and varlen with seqused_k and an empty
    sequence."""
    q, k, v = _randn_qkv(2, sq, sk, 8, [1, 2, 8][(sq + d) % 3], d, dv, seed=sq + sk + d)
    _dense(q, k, v, causal=causal, tile_m=64)
    import torch

    from stage0_reference.torch_reference import assert_fa4_close, attention_ref

    mod = _mod()
    lens_q, lens_k, used = [sq, 0, min(sq, 17)], [sk, 5, sk], [sk, 5, max(1, sk // 2)]
    g = torch.Generator(device="cuda").manual_seed(sq * 7 + d)
    make = lambda n, h, dim: torch.randn(n, h, dim, device="cuda", dtype=torch.bfloat16, generator=g)  # noqa: E731
    hkv = 8 // [1, 2, 8][(sq + d) % 3]
    qp, kp, vp = make(sum(lens_q), 8, d), make(sum(lens_k), hkv, d), make(sum(lens_k), hkv, dv)
    cu = lambda ls: torch.tensor([0] + list(__import__("itertools").accumulate(ls)), dtype=torch.int32,  # noqa: E731
                                 device="cuda")
    out, _ = mod.attention_varlen_forward(qp, kp, vp, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), causal=causal,
                                          seqused_k=torch.tensor(used, dtype=torch.int32, device="cuda"), tile_m=64)
    cq, ck = cu(lens_q).tolist(), cu(lens_k).tolist()
    for b in range(3):
        if lens_q[b] == 0:
            continue
        args = (qp[None, cq[b]:cq[b + 1]], kp[None, ck[b]:ck[b] + used[b]], vp[None, ck[b]:ck[b] + used[b]])
        ref, base = attention_ref(*args, causal=causal)[0], attention_ref(*args, causal=causal, upcast=False)[0]
        assert_fa4_close(f"varlen seq {b}", out[None, cq[b]:cq[b + 1]], ref, base)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_d64_three_consumers_fp16_and_policies(causal):
    """tile_m = 192 in fp16, and with every corner of the softmax policy (emulation on / off, tau)."""
    _dense(*_randn_qkv(2, 333, 1000, 4, 2, 64, 64, dtype="fp16", seed=64), causal=causal, tile_m=192)
    for tau, frac in POLICIES:
        _dense(*_randn_qkv(2, 517, 700, 4, 1, 64, 64, seed=int(tau) + 4), causal=causal, tile_m=192,
               rescale_threshold=tau, emulation_fraction=frac)


# tile_m = 128: lengths that leave the second consumer partial rows
# or none (1, 113, 239), a partial last key block (203, 3, 1), rows past their diagonal with nothing
# visible (300 x 70, causal), several masked and unmasked key blocks (1024); GQA 1 / 2 / 8 over them.
TILE_M128_SEQLENS = [(1, 1), (113, 203), (799, 3), (239, 1), (300, 70), (1024, 1024)]
TILE_M128_HEAD_DIMS = [(64, 64), (128, 128), (192, 128)]


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv", TILE_M128_HEAD_DIMS, ids=[f"d{d}x{dv}" for d, dv in TILE_M128_HEAD_DIMS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", TILE_M128_SEQLENS, ids=[f"{a}x{b}" for a, b in TILE_M128_SEQLENS])
def test_two_consumers_matches_reference(d, dv, causal, sq, sk):
    """The two-consumer kernel (tile_m = 128) and its lean mask: FA4's rule against the fp32 reference."""
    ratio = [1, 2, 8][(sq + sk + d) % 3]
    q, k, v = _randn_qkv(2, sq, sk, 8, 8 // ratio, d, dv, seed=sq + sk + d + 1)
    _dense(q, k, v, causal=causal, tile_m=128)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_two_consumers_fp16(causal):
    """fp16 at tile_m = 128 (the mask's selects are integer SELs there): the rule."""
    q, k, v = _randn_qkv(2, 333, 1000, 4, 2, 128, 128, dtype="fp16", seed=129)
    _dense(q, k, v, causal=causal, tile_m=128)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("ratio", [1, 2, 8])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_ratios(ratio, causal):
    _dense(*_randn_qkv(2, 300, 517, 8, 8 // ratio, 128, 128, seed=ratio), causal=causal)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv,causal", [(64, 64, False), (128, 128, True), (256, 256, True)],
                         ids=["d64-full", "d128-causal", "d256-causal"])
def test_fp16(d, dv, causal):
    _dense(*_randn_qkv(2, 333, 1000, 4, 2, d, dv, dtype="fp16", seed=d), causal=causal)


@pytest.mark.gpu
@pytest.mark.stage3
def test_softmax_scale_and_strides():
    """A non-default scale; q/k/v as strided views of a packed qkv buffer and of (b, h, s, d)."""
    import torch

    b, s, h, d = 2, 257, 4, 128
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)
    _dense(q, k, v, causal=True, softmax_scale=0.3)
    kt = torch.randn(b, h, 400, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    vt = torch.randn(b, h, 400, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    _dense(q, kt, vt, causal=False)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv", [(64, 64), (128, 128)], ids=["d64", "d128"])
def test_fully_masked_rows(d, dv):
    """causal, seqlen_q > seqlen_k: rows i < sq - sk see no key -> out exactly 0, lse -inf."""
    import torch

    sq, sk = 300, 70
    out, lse = _dense(*_randn_qkv(2, sq, sk, 4, 4, d, dv), causal=True)
    assert torch.all(out[:, :sq - sk] == 0)
    assert torch.all(torch.isneginf(lse[:, :, :sq - sk]))
    assert torch.all(torch.isfinite(lse[:, :, sq - sk:]))


@pytest.mark.gpu
@pytest.mark.stage3
def test_deterministic():
    import torch

    q, k, v = _randn_qkv(2, 1000, 1200, 8, 2, 128, 128, seed=1)
    o1, l1 = _mod().attention_forward(q, k, v, causal=True)
    o2, l2 = _mod().attention_forward(q, k, v, causal=True)
    torch.cuda.synchronize()
    assert torch.equal(o1, o2) and torch.equal(l1, l2)
    assert math.isfinite(l1.max().item())


# ---- the softmax policy -------------------------------------------------------------------------
POLICIES = [(8.0, 0.25), (8.0, 0.0), (0.0, 0.25), (0.0, 0.0)]


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("tau,frac", POLICIES, ids=[f"tau{t:g}-f{f:g}" for t, f in POLICIES])
def test_policy_knobs_within_tolerance(tau, frac):
    """Every corner of (tau, emulation fraction) on random data, at d = 64 (the exp-bound case)."""
    _dense(*_randn_qkv(2, 1000, 1500, 4, 2, 64, 64, seed=3), causal=False,
           rescale_threshold=tau, emulation_fraction=frac)


def _rising(sk, slopes, d=64, dtype="bf16"):
    """Scores s_ij = slope_i * j (log2 units with softmax_scale = ln 2): each row's max moves at
    every key (stage 1's rising_scores). q_i = slope_i e0, k_j = j e0; v random."""
    import torch

    sq = len(slopes)
    q = torch.zeros(1, sq, 1, d, device="cuda")
    q[0, :, 0, 0] = torch.tensor(slopes, device="cuda")
    k = torch.zeros(1, sk, 1, d, device="cuda")
    k[0, :, 0, 0] = torch.arange(sk, device="cuda", dtype=torch.float32)
    v = torch.randn(1, sk, 1, d, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    t = _tdt(dtype)
    return q.to(t), k.to(t), v.to(t), math.log(2.0)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("tau", [0.0, 8.0])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("profile", ["steep", "gentle", "mixed"])
def test_adversarial_rising_scores(tau, causal, profile):
    """steep: +38 log2 units per 128-key tile, every tile rescales (tau = 8 and 0 alike);
    gentle: +6.4 per tile, so with tau = 8 every other tile keeps a stale max (growth against it:
    6.4, then 12.8), P reaches 2^6.4 and the last tile's stale max feeds lse; mixed: rows of one
    warp disagree (slopes 0 / 0.05 / 0.3), so the vote rescales rows that alone would not have."""
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref

    slopes = {"steep": [0.3] * 256, "gentle": [0.05] * 256,
              "mixed": [[0.0, 0.05, 0.3][i % 3] for i in range(256)]}[profile]
    q, k, v, scale = _rising(2048, slopes)
    out, _ = _dense(q, k, v, causal=causal, softmax_scale=scale, rescale_threshold=tau)
    # Scores this large make the bf16 PyTorch baseline coarse, so also hold FA4's changes to the
    # same rule against our own classic kernel (tau = 0, all MUFU): at most twice its error.
    classic, _ = _dense(q, k, v, causal=causal, softmax_scale=scale, rescale_threshold=0.0, emulation_fraction=0.0)
    ref = attention_ref(q, k, v, softmax_scale=scale, causal=causal)[0]
    if tau == 0.0:  # the default emulation share on Hopper is 0: the same build, so the same bits
        import torch

        assert torch.equal(out, classic)
        # ... which must itself pass FA4's rule against PyTorch in the input precision
        baseline = attention_ref(q, k, v, softmax_scale=scale, causal=causal, upcast=False)[0]
        assert_fa4_close("out (tau = 0) vs PyTorch", out, ref, baseline)
        return
    assert_fa4_close("out vs classic kernel", out, ref, classic)


# ---- entry points -------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_run_entry_point(varlen):
    res = _mod().run(batch=3, seqlen_q=512, seqlen_k=512, heads=4, head_dim=128, causal=True, check=True,
                     varlen=varlen, verbose=False)
    assert res["mode"] == "gpu" and res["tflops"] > 0


@pytest.mark.compile
@pytest.mark.stage3
def test_trace_stamps_compile_only_when_turned_on():
    """stage3_fwd_kernel.trace: off (the default) the kernel reads no clock; on, it reads SM id, global
    timer and clock at the CTA events and the clock at each per-block event, with no spills, under
    a key of its own that fa4's disk cache refuses (the buffer address is baked in)."""
    from fa4 import _cache
    from stage3_fwd_kernel import trace

    mod = _mod()
    plain = mod.compile_only("bf16", 128, causal=False, persistent=False)
    assert "SR_CLOCKLO" not in plain.sass and "SR_GLOBALTIMER" not in plain.sass
    with pytest.raises(ValueError, match="address"):
        trace.enable(12)
    with pytest.raises(ValueError, match="events"):
        trace.enable(1 << 40, events=("tea",))
    trace.enable(1 << 40, events=trace.EVENTS)
    try:
        key = mod._key("gpu", "bf16", 128, 128, False, mod.DEFAULT_POLICY, None)
        assert "traced" in key and not _cache.persistable(key)
        traced = mod.compile_only("bf16", 128, causal=False, persistent=False)
    finally:
        trace.disable()
    rep = traced.report
    assert rep["spill_stores"] == 0 and rep["LDL/STL"] == 0
    forward_cta_events = [e for e in trace.CTA_EVENTS if e != "walked"]  # "walked" is the backward's
    assert traced.sass.count("SR_GLOBALTIMER") >= len(forward_cta_events)
    # 7 events in each of the two key-block loops (masked, hot) plus the CTA events' clocks
    assert traced.sass.count("SR_CLOCKLO") >= 2 * len(trace.EVENTS) + len(forward_cta_events)
    assert "traced" not in mod._key("gpu", "bf16", 128, 128, False, mod.DEFAULT_POLICY, None)  # off again: the old key


@pytest.mark.cpu
@pytest.mark.stage3
def test_product_modules_stay_small():
    """The composed forward stays readable: no module of stage3_fwd_kernel/hopper or
    stage3_fwd_kernel/components over 1200 lines, no class over 500, no function over 150."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "stage3_fwd_kernel"
    files = sorted((root / "hopper").glob("*.py")) + sorted((root / "components").glob("*.py"))
    assert len(files) > 10
    too_long = []
    for path in files:
        text = path.read_text()
        if len(text.splitlines()) > 1200:
            too_long.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            limit = {ast.ClassDef: 500, ast.FunctionDef: 150, ast.AsyncFunctionDef: 150}.get(type(node))
            if limit and node.end_lineno - node.lineno + 1 > limit:
                too_long.append(f"{path.name}: {node.name} {node.end_lineno - node.lineno + 1} lines")
    assert not too_long, too_long
