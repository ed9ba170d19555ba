"""Stage 3, Blackwell (sm_100a): the FA4 forward pipeline, checked without hardware.

No Blackwell GPU exists anywhere in this project, so these tests are the whole verification:

cpu tier: the TMEM / SMEM / register plan of blackwell_config.py, against budgets computed by
hand here (the paper's plan at d = 128 uses all 512 TMEM columns), and refusals that name the
budget that does not fit.

compile tier (CI, no GPU): supported configurations compile for sm_100a with fake tensors, in this
process whatever CUTE_DSL_ARCH it has (the kernel passes --gpu-arch sm_100a). The PTX holds
tcgen05.alloc / dealloc / mma; the SASS holds the instructions this ptxas actually emits for them
(UTCHMMA -- with SMEM A for S = Q K^T and TMEM A for O += P V --, UTCATOMSWS, UTCBAR, LDTM/STTM,
UTMALDG), the MMA warp issues P V as 6 + 2 K-steps with a barrier wait between (P stored 3/4 +
1/4), the exp2 count shows the emulated fraction, and there is no local memory (no STL/LDL, ptxas
spill stores 0). The CI subset is 8 compiles (~1 min on 2 cores); FA4_BLACKWELL_FULL=1 compiles
all 24 (also: python -m stage3_fwd_kernel.blackwell_fwd --all).

gpu tier: only on a device of compute capability 10.x (skipped everywhere else, i.e. here).
"""
from __future__ import annotations

import os
import re

import pytest

from stage3_fwd_kernel.blackwell_config import (
    SMEM_CAPACITY,
    SUPPORTED_HEAD_DIMS,
    TMEM_COLUMNS,
    blackwell_fwd_config,
)

KB = 1024


# ---------------------------------------------------------------------------------------- cpu tier
@pytest.mark.cpu
@pytest.mark.stage3
def test_paper_plan_d128_fills_tmem():
    cfg = blackwell_fwd_config(128, 128, "bf16", causal=False)
    t = cfg.tmem
    # O 2 x 128 + S 2 x 128 = 512 columns: all of TMEM (paper, section 3.1)
    assert (t.s, t.o) == ((0, 128), (256, 384))
    assert t.used == 2 * 128 + 2 * 128 == TMEM_COLUMNS and t.alloc == 512
    # P (16-bit, 2 per column) = 64 columns in the upper half of its S; scale and stats below it
    assert t.p_cols == 64 and t.p == (64, 192)
    assert t.scale == (0, 128) and t.final == (2, 130)
    # SMEM by hand: header 1 KB + Q 2x128x128x2 + ring 3 x (128x128x2) + O 2x128x128x2
    assert cfg.kv_stages == 3 and not cfg.smem.o_overlaps_q
    assert cfg.smem.total == 1 * KB + 64 * KB + 3 * 32 * KB + 64 * KB == 230400 <= SMEM_CAPACITY
    assert cfg.smem.num_barriers == 2 + 2 * 3 + 7 * 2 + 1
    # registers: 2 softmax WGs x 192 + correction 72 + MMA/load/epilogue 56 = the whole file
    assert 128 * (2 * 192 + 72 + 56) == cfg.regs.total == 65536
    assert cfg.num_threads == 512 and cfg.cta_tile_m == 256
    # O += P V: 8 K = 16 steps; the MMA warp starts on the first 6 (3/4 of P)
    assert (cfg.pv_k_blocks, cfg.pv_k_blocks_first) == (8, 6)


@pytest.mark.cpu
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv,used,stages,overlap,total", [
    (64, 64, 2 * 128 + 2 * 64, 4, False, 1 * KB + 32 * KB + 4 * 16 * KB + 32 * KB),
    (96, 96, 2 * 128 + 2 * 96, 4, False, 1 * KB + 48 * KB + 4 * 24 * KB + 48 * KB),
    (128, 64, 2 * 128 + 2 * 64, 4, False, 1 * KB + 64 * KB + 4 * 32 * KB + 32 * KB),  # a slot fits K
    (192, 128, 2 * 128 + 2 * 128, 2, True, 1 * KB + 96 * KB + 2 * 48 * KB),  # sO over sQ
])
def test_plans_other_head_dims(d, dv, used, stages, overlap, total):
    cfg = blackwell_fwd_config(d, dv, "fp16", causal=True)
    assert cfg.tmem.used == used and cfg.tmem.alloc == 512  # power of two >= used
    assert cfg.kv_stages == stages and cfg.smem.o_overlaps_q == overlap
    assert cfg.smem.total == total <= SMEM_CAPACITY
    # a ring slot holds the larger of a K and a V tile
    assert cfg.smem.kv_slot == 128 * max(d, dv) * 2


@pytest.mark.cpu
@pytest.mark.stage3
def test_refuses_tmem_overflow():
    # d = 256, two Q tiles: S 2 x 128 + O 2 x 256 = 768 columns > 512
    with pytest.raises(ValueError, match=r"TMEM does not fit.*768 columns > 512"):
        blackwell_fwd_config(256, 256, "bf16", causal=False)


@pytest.mark.cpu
@pytest.mark.stage3
def test_refuses_smem_overflow():
    # d = 128 with 4 ring slots: 1 + 64 + 4 x 32 + 64 KB = 263168 > 232448
    with pytest.raises(ValueError, match=r"SMEM does not fit.*263168 bytes of 232448.*<= 3 fit"):
        blackwell_fwd_config(128, 128, "bf16", causal=False, kv_stages=4)


@pytest.mark.cpu
@pytest.mark.stage3
@pytest.mark.parametrize("kwargs,match", [
    (dict(head_dim=128, head_dim_v=128, dtype="fp32"), "dtype"),
    (dict(head_dim=100, head_dim_v=100, dtype="bf16"), "head_dim"),
    (dict(head_dim=128, head_dim_v=128, dtype="bf16", kv_stages=1), "kv_stages"),
    (dict(head_dim=128, head_dim_v=128, dtype="bf16", tile_n=96), "tile_n"),
    (dict(head_dim=128, head_dim_v=128, dtype="bf16", emulation_fraction=1.5), "emulation_fraction"),
    (dict(head_dim=128, head_dim_v=128, dtype="fp16", rescale_threshold=16.0), "fp16"),
    (dict(head_dim=80, head_dim_v=80, dtype="bf16"), "supports only head dims"),
    (dict(head_dim=128, head_dim_v=128, dtype="bf16", q_tiles_per_cta=1), "q_tiles_per_cta=2"),
])
def test_refuses_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        blackwell_fwd_config(causal=False, **kwargs)


@pytest.mark.cpu
@pytest.mark.stage3
def test_budget_exploration_without_kernel_support():
    # one Q tile at d = 256 fits the budgets (S 128 + O 256 = 384 columns) and is built
    # (tests/test_stage3_blackwell_d256.py); one Q tile at d = 128 fits too, the kernel says no
    cfg = blackwell_fwd_config(256, 256, "bf16", causal=False, q_tiles_per_cta=1, check_kernel_support=False)
    assert cfg.tmem.used == 384 and cfg.tmem.alloc == 512
    assert cfg.smem.total <= SMEM_CAPACITY
    assert blackwell_fwd_config(256, 256, "bf16", causal=False, q_tiles_per_cta=1) == cfg
    assert blackwell_fwd_config(128, 128, "bf16", causal=False, q_tiles_per_cta=1, check_kernel_support=False)
    with pytest.raises(ValueError, match="supports only"):
        blackwell_fwd_config(128, 128, "bf16", causal=False, q_tiles_per_cta=1)


@pytest.mark.cpu
@pytest.mark.stage3
def test_tmem_table_lists_every_buffer():
    table = blackwell_fwd_config(128, 128, "bf16", causal=False).tmem.table()
    for name in ("S_0", "S_1", "P_0", "P_1", "O_0", "O_1", "scale_0", "row_sum_1"):
        assert name in table
    assert "512 / 512" in table


# ------------------------------------------------------------------------------------ compile tier
CI_CASES = [  # (dtype, d, dv, causal, varlen): every head dim in both dtypes, both causal modes, varlen
    ("bf16", 64, 64, False, False),
    ("fp16", 64, 64, True, False),
    ("bf16", 128, 128, True, False),
    ("fp16", 128, 128, False, False),
    ("bf16", 192, 128, False, False),
    ("fp16", 192, 128, True, False),
    ("bf16", 128, 128, True, True),
    ("fp16", 64, 64, False, True),
    ("bf16", 96, 96, True, False),
    ("fp16", 96, 96, False, True),  # varlen epilogue: 4 threads x 24 values a row
    ("bf16", 128, 64, True, False),
    ("fp16", 128, 64, False, True),
]


def _cases():
    if os.environ.get("FA4_BLACKWELL_FULL"):
        from stage3_fwd_kernel.blackwell_fwd import MATRIX

        return MATRIX
    return CI_CASES


def _id(case):
    dt, d, dv, causal, varlen = case
    return f"{dt}-d{d}x{dv}-{'causal' if causal else 'full'}{'-varlen' if varlen else ''}"


def _compile(dt, d, dv, causal, varlen):
    from stage3_fwd_kernel import blackwell_fwd as bw

    cfg = bw.make_config(dt, d, dv, causal)
    return cfg, bw.compile_config(cfg, varlen)


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("case", _cases(), ids=[_id(c) for c in _cases()])
def test_compiles_sm100a(case):
    dt, d, dv, causal, varlen = case
    cfg, comp = _compile(*case)
    rep, sass = comp.report, comp.sass
    assert rep["ptx_target"] == "sm_100a"
    # no local memory at all
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, f"spills: {rep['ptxas_log'][-600:]}"
    assert rep["stack_frame"] == 0
    assert sass, "nvdisasm produced no SASS"
    assert rep["LDL/STL"] == 0, "local-memory traffic in SASS"
    # TMEM allocated and freed, by the DSL's allocator; tcgen05 MMAs issued
    assert rep["ptx_tcgen05.alloc"] == 1 and rep["ptx_tcgen05.dealloc"] == 1
    assert rep["ptx_tcgen05.mma"] and rep["ptx_tcgen05.mma"] > 0
    assert rep["UTCATOMSWS"] and rep["UTCATOMSWS"] >= 2, "TMEM alloc/dealloc (UTCATOMSWS) missing in SASS"
    # this ptxas names tcgen05.mma kind::f16 UTCHMMA; per CTA and key block: 2 tiles x d/16 K-steps
    # of S = Q K^T (A from SMEM), 2 tiles x 128/16 of O += P V (A = P from TMEM); the kernel has
    # them twice (prologue S + loop, loop + tail O)
    assert rep["UTCHMMA"] == rep["ptx_tcgen05.mma"] == 4 * (d // 16) + 4 * (cfg.tile_n // 16)
    assert rep["UTCHMMA.SS"] == 4 * (d // 16) and rep["UTCHMMA.TS"] == 4 * (cfg.tile_n // 16)
    assert rep["UTCBAR"] == 10  # tcgen05.commit: s_full x 4, kv_empty x 4, o_full x 2
    assert rep["LDTM"] > 0 and rep["STTM"] > 0 and rep["UTMALDG"] > 0
    # one TMA store per swizzle-atom width of a tile's dv columns (64 elements at 128B swizzle; dv = 96
    # takes 64B: 32), two tiles; varlen: row-guarded stores
    box = 64 if dv % 64 == 0 else 32
    assert rep["UTMASTG"] == (0 if varlen else 2 * (dv // box))
    # SMEM the kernel asked for is exactly the plan
    assert rep["smem_bytes"] == cfg.smem.total <= SMEM_CAPACITY
    # register moves per warpgroup: 56 (MMA/load/epilogue), 72 (correction), 192 (softmax)
    regs = cfg.regs
    assert sorted(rep["ptx_setmaxnreg"]) == sorted([("dec", str(regs.other)), ("dec", str(regs.correction)),
                                                    ("inc", str(regs.softmax))])
    assert (regs.softmax, regs.correction, regs.other) == (192, 72, 56)
    assert rep["USETMAXREG"] == 3 and "C7508" not in rep["ptxas_log"]
    # partial emulation: per key block and row, 128 x (1 - 2/16) MUFU.EX2 + 1 for the rescale
    # factor; the softmax step exists twice (unmasked and masked key blocks)
    emulated = round(cfg.emulation_fraction * 16) * cfg.tile_n // 16
    assert rep["MUFU.EX2"] == 2 * (cfg.tile_n - emulated + 1)
    # P leaves the softmax registers a quarter at a time (tcgen05.st 32x32b.x16), twice
    assert rep["ptx_st_32x32b.x16"] == 2 * 4


@pytest.mark.compile
@pytest.mark.stage3
def test_compiles_with_the_lpt_order():
    """The causal forward under stage 5's LPT order (fa4's choice for long causal calls on sm_100):
    compiles clean, with the same TMEM / register plan, and a different tile map than the static grid."""
    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage5_scheduling.device import LPTCausalScheduler

    sched = LPTCausalScheduler.from_problem(8192, 128, 32, 8, flat_batches=True)
    cfg = bw.make_config("bf16", 128, 128, True)
    lpt, static = bw.compile_config(cfg, scheduler=sched), bw.compile_config(cfg)
    rep = lpt.report
    assert rep["spill_stores"] == 0 and rep["stack_frame"] == 0 and rep["LDL/STL"] == 0
    assert rep["UTCHMMA"] == static.report["UTCHMMA"] and rep["smem_bytes"] == static.report["smem_bytes"]
    assert lpt.sass != static.sass


@pytest.mark.compile
@pytest.mark.stage3
def test_pv_issued_three_quarters_then_one_quarter():
    """In the MMA warp's instruction stream, every O += P V is 6 TS-MMAs, a barrier wait (the
    last quarter of P), then 2 more; S = Q K^T MMAs are SS."""
    _, comp = _compile("bf16", 128, 128, False, False)
    tokens = []
    for line in comp.sass.splitlines():
        m = re.search(r"\b(UTCHMMA)\s+(gdesc|tmem)\[|\b(SYNCS\.PHASECHK)\b|\b(UTCBAR)\b", line)
        if m:
            tokens.append("T" if m.group(2) == "tmem" else "S" if m.group(1) else "W" if m.group(3) else "C")
    stream = "".join(tokens)
    assert stream.count("TTTTTTWTT") == 4, stream  # 2 tiles x (main loop + tail)
    assert "T" * 7 not in stream
    assert stream.count("S" * 8) == 4  # S_i = Q_i K^T: 128 / 16 = 8 K-steps, 2 tiles x 2 places


@pytest.mark.compile
@pytest.mark.stage3
def test_refused_before_compiling():
    from stage3_fwd_kernel import blackwell_fwd as bw

    with pytest.raises(ValueError, match="TMEM"):
        bw.compile_only(dtype="bf16", head_dim=256, q_tiles_per_cta=2)  # the default there is one tile
    with pytest.raises(ValueError, match="SMEM"):
        bw.compile_only(dtype="bf16", head_dim=128, kv_stages=4)

    class Persistent:
        persistent = True

    with pytest.raises(ValueError, match="persistent"):
        bw.FlashAttentionForwardSm100(bw.make_config(), scheduler=Persistent)


@pytest.mark.compile
@pytest.mark.stage3
def test_process_arch_left_alone():
    """Importing the Blackwell module must not switch a process to sm_100a (Hopper steps compiled
    in the same process rely on common.py's sm_90a default); its own compiles pass the arch."""
    import subprocess
    import sys

    from stage3_fwd_kernel import blackwell_fwd as bw

    if not bw.blackwell_gpu_available():
        env = {k: v for k, v in os.environ.items() if k != "CUTE_DSL_ARCH"}
        code = "import os, stage3_fwd_kernel.blackwell_fwd; print(os.environ['CUTE_DSL_ARCH'])"
        res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.strip().splitlines()[-1] == "sm_90a"
    _, comp = _compile("fp16", 64, 64, True, False)
    assert comp.report["ptx_target"] == "sm_100a"


# ---------------------------------------------------------------------------------------- gpu tier
def _skip_unless_blackwell():
    import torch

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10):
        pytest.skip("needs a Blackwell GPU (compute capability 10.x); none exists in this project")


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("d,dv", SUPPORTED_HEAD_DIMS)
@pytest.mark.parametrize("causal", [False, True])
def test_matches_reference_on_blackwell(d, dv, causal):
    _skip_unless_blackwell()
    from stage3_fwd_kernel import blackwell_fwd as bw

    for sq, sk, h, hkv in ((1, 1, 2, 1), (113, 203, 4, 2), (799, 3, 2, 2), (1024, 1024, 4, 1)):
        bw.run(batch=2, seqlen_q=sq, seqlen_k=sk, heads=h, heads_kv=hkv, head_dim=d, head_dim_v=dv,
               causal=causal, check=True, verbose=False)


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_reference_on_blackwell(causal):
    _skip_unless_blackwell()
    from stage3_fwd_kernel import blackwell_fwd as bw

    bw.run(batch=5, seqlen_q=300, seqlen_k=500, heads=4, heads_kv=2, head_dim=128, causal=causal,
           varlen=True, check=True, verbose=False)


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("dt, d, causal, window", [("bf16", 128, True, None), ("fp16", 64, False, (96, 32))])
def test_varlen_seqused_k_compiles_sm100a(dt, d, causal, window):
    """The varlen forward with seqused_k (sequence b attends to its first seqused_k[b] keys): the same
    plan as the build without it -- no local memory, the same MMAs, TMA loads, TMEM and shared memory --
    and different code (the key count comes from seqused_k[b], not from cu_seqlens_k)."""
    from stage3_fwd_kernel import blackwell_fwd as bw

    cfg = bw.make_config(dt, d, d, causal, window_size=window or (None, None))
    plain, used = bw.compile_config(cfg, True), bw.compile_config(cfg, True, seqused_k=True)
    rep = used.report
    assert rep["spill_stores"] == rep["spill_loads"] == rep["stack_frame"] == rep["LDL/STL"] == 0
    for key in ("UTCHMMA.SS", "UTCHMMA.TS", "UTMALDG", "smem_bytes", "tmem_cols_alloc", "ptx_setmaxnreg"):
        assert rep[key] == plain.report[key], key
    assert used.sass != plain.sass
    with pytest.raises(ValueError, match=r"^seqused_k: a varlen build"):
        bw.compile_config(cfg, False, seqused_k=True)


@pytest.mark.cpu
@pytest.mark.stage3
def test_varlen_seqused_k_is_checked_before_the_gpu():
    import torch

    from stage3_fwd_kernel import blackwell_fwd as bw

    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^seqused_k: expected dtype int32"):
        bw.attention_varlen_forward(q, q, q, cu, cu, 5, seqused_k=torch.ones(2, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^seqused_k: expected shape \(2,\)"):
        bw.attention_varlen_forward(q, q, q, cu, cu, 5, seqused_k=torch.ones(3, dtype=torch.int32))


@pytest.mark.cpu
@pytest.mark.stage3
def test_arguments_are_checked_before_the_gpu():
    """Every entry point names a bad argument before it looks for a Blackwell GPU (so a Hopper or CPU
    machine gets the same error); good arguments then reach the GPU check."""
    import torch

    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel import blackwell_fwd_2cta as two

    q = torch.zeros(1, 8, 4, 128, dtype=torch.bfloat16)
    kv = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    dense = [(dict(q=q[0]), ValueError, r"^q, k, v: expected rank 4"),
             (dict(k=kv.half()), TypeError, r"^q, k, v: expected one dtype"),
             (dict(k=torch.zeros(1, 8, 3, 128, dtype=torch.bfloat16)), ValueError, r"^k, v: shapes"),
             (dict(softmax_scale=-1.0), ValueError, r"^softmax_scale"),
             (dict(out=torch.zeros(1, 8, 4, 64, dtype=torch.bfloat16)), ValueError, r"^out: expected shape"),
             (dict(lse=torch.zeros(1, 4, 8, dtype=torch.float16)), TypeError, r"^lse: expected dtype"),
             (dict(k=[0.0]), TypeError, r"^k: expected a torch tensor"),
             (dict(causal="False"), TypeError, r"^causal: expected a bool")]
    for entry in (bw.attention_forward, two.attention_forward_2cta):
        for kw, error, match in dense:
            args = dict(q=q, k=kv, v=kv)
            args.update(kw)
            with pytest.raises(error, match=match):
                entry(args.pop("q"), args.pop("k"), args.pop("v"), **args)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    qv, kvv = q[0], kv[0]
    varlen = [(dict(q=q), ValueError, r"^q, k, v: expected rank 3"),
              (dict(cu_seqlens_q=cu.long()), TypeError, r"^cu_seqlens_q: expected dtype int32"),
              (dict(cu_seqlens_k=cu[:2]), ValueError, r"^cu_seqlens_k: expected shape \(3,\)"),
              (dict(max_seqlen_q=5.0), TypeError, r"^max_seqlen_q: expected an int"),
              (dict(softmax_scale=float("nan")), ValueError, r"^softmax_scale"),
              (dict(out=torch.zeros(8, 4, 128, dtype=torch.float16)), TypeError, r"^out: expected dtype"),
              (dict(lse=torch.zeros(8, 4)), ValueError, r"^lse: expected shape \(4, 8\)")]
    for kw, error, match in varlen:
        args = dict(q=qv, k=kvv, v=kvv, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5)
        args.update(kw)
        with pytest.raises(error, match=match):
            bw.attention_varlen_forward(args.pop("q"), args.pop("k"), args.pop("v"), args.pop("cu_seqlens_q"),
                                        args.pop("cu_seqlens_k"), args.pop("max_seqlen_q"), **args)
    if not bw.blackwell_gpu_available():
        for call in (lambda: bw.attention_forward(q, kv, kv), lambda: two.attention_forward_2cta(q, kv, kv),
                     lambda: bw.attention_varlen_forward(qv, kvv, kvv, cu, cu, 5)):
            with pytest.raises(RuntimeError, match="Blackwell"):
                call()


@pytest.mark.gpu
@pytest.mark.stage3
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_seqused_k_matches_reference_on_blackwell(causal):
    """Each sequence against the first seqused_k[b] of its keys (0, 1, all and some), under FA4's rule
    against the reference on those keys alone."""
    _skip_unless_blackwell()
    import torch

    from stage0_reference.torch_reference import assert_fa4_close, attention_varlen_ref
    from stage3_fwd_kernel import blackwell_fwd as bw

    lq, lk, used = [37, 300, 5, 128], [500, 64, 3, 200], [0, 64, 1, 137]
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lq), 4, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lk), 2, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lk), 2, 128, device="cuda", dtype=torch.bfloat16)
    out, lse = bw.attention_varlen_forward(q, k, v, cu_q, cu_k, max(lq), causal=causal,
                                           seqused_k=torch.tensor(used, dtype=torch.int32, device="cuda"))
    keep = torch.cat([torch.arange(int(cu_k[b]), int(cu_k[b]) + used[b]) for b in range(len(lk))]).cuda()
    cu_used = torch.tensor([0] + list(torch.tensor(used).cumsum(0)), dtype=torch.int32, device="cuda")
    (ref_o, ref_lse), (base_o, base_lse) = (attention_varlen_ref(q, k[keep], v[keep], cu_q, cu_used, causal=causal,
                                                                 upcast=up) for up in (True, False))
    assert_fa4_close("seqused_k out", out, ref_o, base_o)
    assert_fa4_close("seqused_k lse", lse, ref_lse, base_lse)


@pytest.mark.cpu
@pytest.mark.stage3
def test_packed_emulation_takes_adjacent_pairs():
    """exp2_row_packed emulates whole adjacent pairs (one f32x2 floor / fraction / Horner for both):
    the row's pattern holds as many emulated values as the scalar pattern, every second pair from the
    row's end (the last quarter at 2 of 16), the whole row past 8 of 16, and an odd k has no pair
    pattern (the scalar path serves it)."""
    from stage3_fwd_kernel.softmax_policy import PATTERN_PERIOD, SoftmaxPolicy

    policy = SoftmaxPolicy(emulation_fraction=blackwell_fwd_config(128, 128, "bf16", causal=False).emulation_fraction)
    pairs = policy.row_pair_pattern(128)
    assert len(pairs) == 64 and 2 * sum(pairs) == sum(policy.pattern) * 128 // PATTERN_PERIOD == 16
    assert [2 * i for i, e in enumerate(pairs) if e] == list(range(98, 128, 4))  # pairs 49, 51, .., 63
    four = SoftmaxPolicy(emulation_fraction=4 / 16).row_pair_pattern(128)
    assert [i for i, e in enumerate(four) if e] == list(range(33, 64, 2))        # the last half
    ten = SoftmaxPolicy(emulation_fraction=10 / 16).row_pair_pattern(32)
    assert len(ten) == 16 and sum(ten) == 10 and ten[-1]                           # spread over the row
    assert SoftmaxPolicy(emulation_fraction=0.0).row_pair_pattern(128) == (False,) * 64
    assert SoftmaxPolicy(emulation_fraction=3 / 16).row_pair_pattern(128) is None
    assert policy.row_pair_pattern(24) is None  # not whole periods


# ------------------------------------------------------------------------------- the launchable build
def _sass_without_names(sass: str) -> str:
    return re.sub(r"\bFunction : \S+", "Function", re.sub(r"kernel_cutlass_\S+", "K", sass))


@pytest.mark.compile
@pytest.mark.stage3
def test_launchable_build_is_the_inspected_kernel():
    """attention_forward / attention_varlen_forward launch compile_launchable_config's TVM-FFI build:
    in this sm_90a process it still targets sm_100a (the kernel's gpu_arch), and its SASS is the
    inspected compile_config build's, kernel names aside (dense causal, varlen + seqused_k with a window,
    persistent at (128, 64), d = 256)."""
    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel import compile_cache
    from stage3_fwd_kernel import tile_scheduler as ts

    # compiled here, not taken from a store or a memory cache an earlier test filled (fa4's disk cache
    # wraps what it loads)
    store, memory = compile_cache.get_store(), compile_cache._CACHE
    compile_cache.set_store(None)
    compile_cache._CACHE = {}
    try:
        _check_launchable_builds(bw, ts)
    finally:
        compile_cache.set_store(store)
        compile_cache._CACHE = memory


def _check_launchable_builds(bw, ts):
    cases = [(bw.make_config("bf16", 128, 128, True), False, ts.StaticTileScheduler, False),
             (bw.make_config("fp16", 64, 64, False, window_size=(96, 32)), True, ts.StaticTileScheduler, True),
             (bw.make_config("bf16", 128, 64, False), False, ts.PersistentScheduler(ts.StaticTileScheduler), False),
             (bw.make_config("bf16", 256, 256, True, q_tiles_per_cta=1), True, ts.StaticTileScheduler, False)]
    for cfg, varlen, sched, used in cases:
        inspected = bw.compile_config(cfg, varlen, scheduler=sched, seqused_k=used)
        launched = bw.compile_launchable_config(cfg, varlen, sched, used)
        assert "TVMFFI" in type(launched.fn).__name__
        assert re.search(r"^\.target\s+sm_100a", launched.ptx, re.M)
        assert launched.report["spill_stores"] == 0 and launched.report["smem_bytes"] == cfg.smem.total
        assert _sass_without_names(launched.sass) == _sass_without_names(inspected.sass), cfg.summary()
    with pytest.raises(ValueError, match=r"^seqused_k: a varlen build"):
        bw.compile_launchable_config(cases[0][0], False, seqused_k=True)


DISK_ROUNDTRIP = """
import json, time
from fa4 import _dispatch
from stage3_fwd_kernel import blackwell_fwd as bw
_dispatch._install_disk_cache()
t = time.time()
comp = bw.compile_launchable_config(bw.make_config("bf16", 128, 128, True), False)
print(json.dumps({"loaded": bool(comp.report.get("loaded_from")), "seconds": time.time() - t}))
"""


@pytest.mark.compile
@pytest.mark.stage3
def test_launchable_build_reloads_from_fa4s_disk_cache(tmp_path):
    """Two processes targeting sm_100a with one FA4_CACHE_DIR: the first compiles the forward and writes
    it, the second loads it (no compile). Nothing is launched: loading is what a B200 process would do."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", PYTHONPATH=str(root), FA4_CACHE_DIR=str(tmp_path))
    env.pop("FA4_CACHE", None)
    runs = []
    for _ in range(2):
        res = subprocess.run([sys.executable, "-c", DISK_ROUNDTRIP], cwd=root, env=env, capture_output=True,
                             text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-2000:]
        runs.append(json.loads(res.stdout.strip().splitlines()[-1]))
    assert [r["loaded"] for r in runs] == [False, True], runs
    assert len(list(tmp_path.rglob("*.o"))) == 1


# ------------------------------------------------------------------------------- a paged K/V cache
PAGED = [("bf16", 128, 128, True, {}, 128), ("fp16", 64, 64, False, dict(window_size=(96, 32)), 256),
         ("bf16", 128, 64, True, {}, 128), ("bf16", 256, 256, False, dict(q_tiles_per_cta=1), 128)]


def _entry_params(ptx: str) -> int:
    return max(int(n) for n in re.findall(r"_param_(\d+)\b", ptx)) + 1


# pages smaller than a key block (one TMA box a page, blackwell_paged.py) from the fifth case on
PAGED += [("bf16", 128, 128, True, {}, 16), ("fp16", 64, 64, False, dict(window_size=(96, 32)), 32),
          ("bf16", 256, 256, False, dict(q_tiles_per_cta=1), 64), ("bf16", 96, 96, True, {}, 16)]


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("dt,d,dv,causal,kw,page", PAGED, ids=[f"d{c[1]}x{c[2]}-p{c[5]}" for c in PAGED])
def test_paged_builds_compile_sm100a(dt, d, dv, causal, kw, page):
    """A varlen build reading a paged cache in place: the seqused_k build's plan, MMAs and TMA loads (in
    the SASS; pages smaller than a block issue their boxes in a loop), one more kernel parameter (the
    table) and two more global loads (the load warp's table reads: the first block, then one a block in
    its loop; with boxes each lane reads one page) and, with boxes, a shuffle a box; no local memory."""
    from stage3_fwd_kernel import blackwell_fwd as bw

    cfg = bw.make_config(dt, d, dv, causal, **kw)
    used, paged = bw.compile_config(cfg, True, seqused_k=True), bw.compile_config(cfg, True, page_size=page)
    rep = paged.report
    assert rep["spill_stores"] == rep["spill_loads"] == rep["LDL/STL"] == 0
    for key in ("UTCHMMA.SS", "UTCHMMA.TS", "UTMALDG", "smem_bytes", "tmem_cols_alloc", "ptx_setmaxnreg"):
        assert rep[key] == used.report[key], key
    assert _entry_params(paged.ptx) == _entry_params(used.ptx) + 1
    assert paged.ptx.count("ld.global") == used.ptx.count("ld.global") + 2
    shuffles = paged.ptx.count("shfl.sync.idx") - used.ptx.count("shfl.sync.idx")
    assert (shuffles > 0) == (page < cfg.tile_n)


BOX_LAYOUT_CASES = [(128, 128, 16), (128, 128, 64), (64, 64, 32), (96, 96, 16), (256, 256, 16), (128, 64, 32)]


def _box_cells(found: list):
    """Plain Python run inside a trace (a jit function's own loops and ifs would be staged): per case, K
    and V, each stage end, every key and some columns, (slot index, box index); and each box's TMA
    layout next to the boxed ring's first modes."""
    import cutlass.cute as cute
    import cutlass.utils.blackwell_helpers as sm100_utils

    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel import blackwell_paged as bp

    for d, dv, page in BOX_LAYOUT_CASES:
        k = bw.FlashAttentionForwardSm100(bw.make_config("bf16", d, dv, False, q_tiles_per_cta=1 if d == 256 else 2),
                                          varlen=True, page_size=page)
        qk, pv, _ = k.mmas_and_p_layout()
        rings = (k._restage(sm100_utils.make_smem_layout_b(qk, (k.tm, k.tn, d), k.dtype, 1)),
                 k._restage(sm100_utils.make_smem_layout_b(pv, (k.tm, dv, k.tn), k.dtype, 1)))
        for is_v, (ring, cols) in enumerate(zip(rings, (d, dv))):
            boxed = bp.boxed_ring_layout(ring.outer, page, k.boxes_per_block, bool(is_v))
            one = bp.box_smem_layout(ring, page, bool(is_v)).outer
            found.append(("tma box", str(one), str(cute.select(boxed, mode=[0, 1, 2]))))
            for st in (0, k.stages - 1):
                for key in range(k.tn):
                    j, r = divmod(key, page)
                    for c in sorted({0, 7, 8, 15, 16, 31, 32, 63, 64, cols - 1} & set(range(cols))):
                        if is_v:
                            slot, box = ((c, key % 16), 0, key // 16, st), ((c, r % 16), 0, r // 16, j, st)
                        else:
                            slot, box = ((key, c % 16), 0, c // 16, st), ((r, c % 16), 0, c // 16, j, st)
                        found.append(("cell", (d, dv, page, is_v, st, key, c),
                                      cute.crd2idx(slot, ring.outer), cute.crd2idx(box, boxed)))
                        # keys are rows of `width` elements in column slabs of tile_n rows: a page's rows are
                        # an aligned range of every slab, whatever the swizzle does within a row
                        width = 64 if cols % 64 == 0 else 32
                        row_model = st * ring.outer.stride[3] + (c // width) * k.tn * width + key * width + c % width
                        found.append(("row", (d, dv, page, is_v, st, key, c), cute.crd2idx(slot, ring.outer),
                                      row_model))


@pytest.mark.compile
@pytest.mark.stage3
def test_page_boxes_are_the_rows_of_the_ring_slot():
    """Box j of a K / V ring slot (blackwell_paged.boxed_ring_layout) addresses exactly the slot's rows
    j * page .. (j + 1) * page - 1, column by column, in every stage (outer layouts before the swizzle,
    whose period the box stride keeps); one box's TMA layout (box_smem_layout) is the boxed ring's
    (MMA, N, K) part; and the slot is what blackwell_paged's docstring and the V-tail zeroing assume:
    key r is row r (64 or 32 elements) of each column slab of tile_n rows. Traced at compile time:
    every coordinate is static."""
    import cutlass.cute as cute

    from stage3_fwd_kernel import blackwell_fwd as bw

    found = []

    @cute.jit
    def trace():
        _box_cells(found)

    cute.compile(trace, options=f"--gpu-arch {bw.TARGET_ARCH}")  # builds nothing: only the trace matters
    boxes = [f for f in found if f[0] == "tma box"]
    cells = [f for f in found if f[0] == "cell"]
    assert len(boxes) == 2 * len(BOX_LAYOUT_CASES) and all(a == b for _, a, b in boxes), boxes
    assert len(cells) > 10000
    wrong = [c for c in cells if c[2] != c[3]]
    assert not wrong, wrong[:5]
    rows = [f for f in found if f[0] == "row"]
    assert len(rows) == len(cells) and not [r for r in rows if r[2] != r[3]], [r for r in rows if r[2] != r[3]][:5]


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_builds_zero_the_last_v_rows(d):
    """A varlen build's load warp zeroes the V rows past the sequence's keys in the walk's last block
    (blackwell_load_mma load_v_tail): against the dense build of the same plan, one more mbarrier (v_tail),
    16-byte zero stores (a V row's dv / 8 at each of the two call sites), the last V's TMA copies twice
    more (one per 64-column slab at each call site), a proxy fence before its plain kv_full arrive; same
    SMEM, no spills."""
    from stage3_fwd_kernel import blackwell_fwd as bw

    cfg = bw.make_config("bf16", d, d, True)
    dense, varlen = bw.compile_config(cfg, False), bw.compile_config(cfg, True)
    assert varlen.report["spill_stores"] == varlen.report["LDL/STL"] == 0
    assert varlen.report["smem_bytes"] == dense.report["smem_bytes"]
    assert varlen.ptx.count("mbarrier.init") == dense.ptx.count("mbarrier.init") + 1
    assert varlen.report["UTMALDG"] == dense.report["UTMALDG"] + 2 * (d // 64)
    zero_stores = varlen.ptx.count("st.shared.v4.b32") - dense.ptx.count("st.shared.v4.b32")
    assert zero_stores == 2 * (d // 8)  # one V row in 16-byte stores, at the two call sites of load_v_tail
    assert varlen.ptx.count("fence.proxy.async.shared::cta") > dense.ptx.count("fence.proxy.async.shared::cta")


@pytest.mark.cpu
@pytest.mark.stage3
def test_paged_builds_are_refused_where_they_do_not_exist():
    import torch

    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel import tile_scheduler as ts
    from stage3_fwd_kernel.blackwell_config import pages_in_place

    assert [pages_in_place(p) for p in (128, 256, 384, 64, 32, 16)] == [True] * 6
    assert [pages_in_place(p) for p in (8, 24, 48, 0, True, 128.0)] == [False] * 6
    assert [pages_in_place(p, 128, (192, 128)) for p in (16, 64, 128)] == [False, False, True]
    cfg = bw.make_config("bf16", 128, 128, False)
    with pytest.raises(ValueError, match=r"^page_size: .* at head dims \(192, 128\) reads pages of a multiple of "
                                         r"128 keys in place, got 64"):
        bw.FlashAttentionForwardSm100(bw.make_config("bf16", 192, 128, False), varlen=True, page_size=64)
    for kw, match in ((dict(varlen=True, page_size=48), r"^page_size: .* multiple of 128 keys, or of a divisor"),
                      (dict(varlen=False, page_size=128), r"^page_size: a paged cache is read by the varlen build"),
                      (dict(varlen=True, page_size=128, scheduler=ts.PersistentScheduler(ts.StaticTileScheduler)),
                       r"^page_size: a paged cache is read by the varlen build")):
        with pytest.raises(ValueError, match=match):
            bw.FlashAttentionForwardSm100(cfg, **kw)
    q = torch.zeros(8, 2, 128, dtype=torch.bfloat16)
    cu, used = torch.tensor([0, 8], dtype=torch.int32), torch.tensor([100], dtype=torch.int32)
    pages, table = torch.zeros(4, 64, 2, 128, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.int32)
    odd = torch.zeros(6, 24, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^page_size: .* got 24"):  # before the GPU check
        bw.attention_varlen_forward(q, odd, odd, cu, None, 8, seqused_k=used, page_table=table)
    with pytest.raises(ValueError, match=r"^seqused_k: required with page_table"):
        bw.attention_varlen_forward(q, pages, pages, cu, None, 8, page_table=table)
