"""Stage 3, Blackwell (sm_100a): the forward at head dim 256 -- ONE Q tile per CTA. COMPILED, NEVER
RUN: no Blackwell GPU exists anywhere in this project.

Two Q tiles do not fit TMEM at d = 256 (S 2 x 128 + O 2 x 256 = 768 > 512 columns), so this build has
one 128-row tile, one softmax warpgroup, and warpgroup 1 idle (its registers go to the softmax).

cpu tier: the plan by hand (TMEM 384 / 512 columns, SMEM 1 + 64 + 2 x 64 KB with sO over sQ, the
register split), the refusals (two Q tiles, a third ring slot, a persistent grid), and the barrier
protocol of this build extracted from the source: OK, and bugs planted in it are caught.

compile tier: bf16 / fp16, causal or not, dense and varlen compile for sm_100a with no local memory,
SMEM = the plan, the instruction counts of one Q tile (half the two-tile build's UTCHMMA TS and
s_full / o_full commits), the 6 + 2 P V issue, and the four setmaxnreg. Each configuration is compiled
once (module-scoped fixture, ~5-15 s each on 2 cores).
"""
from __future__ import annotations

import re

import pytest

from stage3_fwd_kernel.blackwell_config import (
    ONE_Q_TILE_HEAD_DIMS,
    SMEM_CAPACITY,
    SUPPORTED_HEAD_DIMS,
    TMEM_COLUMNS,
    blackwell_fwd_config,
    q_tiles_for,
)

pytestmark = [pytest.mark.stage3]

KB = 1024


def _cfg(dtype="bf16", causal=False, **kw):
    return blackwell_fwd_config(256, 256, dtype, causal=causal, q_tiles_per_cta=1, **kw)


# ---------------------------------------------------------------------------------------- cpu tier
@pytest.mark.cpu
def test_one_q_tile_plan_by_hand():
    assert ONE_Q_TILE_HEAD_DIMS == ((256, 256),) and (256, 256) not in SUPPORTED_HEAD_DIMS
    assert q_tiles_for(256, 256) == 1 and q_tiles_for(128) == 2 and q_tiles_for(192, 128) == 2
    cfg = _cfg()
    assert cfg.q_tiles_per_cta == 1 and cfg.cta_tile_m == 128 and cfg.tile_n == 128
    # TMEM: S 128 + O 256 = 384 columns (P, scale and the final statistics inside S), 512 allocated
    t = cfg.tmem
    assert (t.s, t.o, t.p, t.scale, t.final) == ((0,), (128,), (64,), (0,), (2,))
    assert t.used == 128 + 256 == 384 <= TMEM_COLUMNS and t.alloc == 512
    assert "O_0 (fp32) | [128, 384) | 256" in t.table() and "S_1" not in t.table()
    # SMEM: a 128 x 256 16-bit tile is 64 KB; a separate sO leaves room for one ring slot only, so sO
    # goes over sQ and the ring has 2 slots: 1 + 64 + 2 x 64 KB
    s = cfg.smem
    assert s.o_overlaps_q and cfg.kv_stages == 2 and s.kv_slot == 128 * 256 * 2 == 64 * KB
    assert s.total == 1 * KB + 64 * KB + 2 * 64 * KB == 197632 <= SMEM_CAPACITY
    assert s.num_barriers == 1 + 2 * 2 + 7 * 1 + 1
    # registers: softmax 256, idle warpgroup 24, correction 96, MMA / load / epilogue 80
    r = cfg.regs
    assert (r.softmax, r.idle, r.correction, r.other, r.softmax_wgs) == (256, 24, 96, 80, 1)
    assert r.total == 128 * (256 + 24 + 96 + 80) == 58368 <= 65536
    # warps: 16 as before; warpgroup 1 idles; TMEM is handed back by 128 softmax + 128 correction threads
    roles = cfg.roles
    assert roles.softmax == ((0, 1, 2, 3),) and roles.idle_warpgroup == 1
    assert (roles.correction_wg, roles.other_wg, roles.tmem_users) == (2, 3, 256)
    assert cfg.num_threads == 512
    assert any(name == "idle WG 1" for name, _, _ in roles.describe())


@pytest.mark.cpu
def test_two_tile_builds_keep_their_roles():
    cfg = blackwell_fwd_config(128, 128, "bf16", causal=False)
    assert cfg.roles.idle_warpgroup is None and cfg.roles.tmem_users == 384
    assert (cfg.roles.correction_wg, cfg.roles.other_wg) == (2, 3)
    assert cfg.regs.total == 65536 and cfg.regs.idle == 0


@pytest.mark.cpu
def test_refusals_at_d256():
    # the plan's default (two Q tiles) does not fit TMEM, and says what does
    with pytest.raises(ValueError, match=r"TMEM does not fit.*768 columns > 512.*q_tiles_per_cta=1"):
        blackwell_fwd_config(256, 256, "bf16", causal=False)
    # a third 64 KB ring slot: 1 + 64 + 3 x 64 KB = 257 KB
    with pytest.raises(ValueError, match=r"SMEM does not fit.*263168 bytes of 232448"):
        _cfg(kv_stages=3)
    # one Q tile is built at d = 256 only
    with pytest.raises(ValueError, match="q_tiles_per_cta=2"):
        blackwell_fwd_config(128, 128, "bf16", causal=False, q_tiles_per_cta=1)


@pytest.mark.cpu
def test_persistent_refused_naming_scheduler():
    from stage3_fwd_kernel.blackwell_fwd import FlashAttentionForwardSm100, persistent_available
    from stage3_fwd_kernel.tile_scheduler import PersistentScheduler

    with pytest.raises(ValueError, match=r"^scheduler: .*\(256, 256\).*sO is placed over sQ"):
        FlashAttentionForwardSm100(_cfg(), scheduler=PersistentScheduler())
    assert persistent_available("bf16", 256, 256) is False  # fa4's router asks this
    assert not FlashAttentionForwardSm100(_cfg()).persistent


# the protocol of the one-tile build, extracted from the kernel source
_PROGRAMS: dict = {}


def _program(blocks):
    from stage3_fwd_kernel import blackwell_protocol as bp

    if blocks not in _PROGRAMS:
        _PROGRAMS[blocks] = bp.build("fwd", blocks, head_dim=256)
    return _PROGRAMS[blocks].copy()


def _offset(prog, bar):
    return next(o for o, n in prog.spec.bar_names.items() if n == bar)


@pytest.mark.cpu
def test_protocol_holds_with_one_q_tile():
    from stage3_fwd_kernel import blackwell_protocol as bp

    res = bp.check("fwd", 4, head_dim=256)
    assert res.ok, res.report()
    assert "tiles=1" in res.report() and res.states > 100
    prog = _program(4)
    assert [r.name for r in prog.spec.roles][:2] == ["softmax0", "idle_wg"]
    assert set(prog.spec.bar_names.values()) >= {"s_full", "p_full", "o_full", "tmem_dealloc"}
    assert prog.inits[_offset(prog, "tmem_dealloc")] == 256 and prog.inits[_offset(prog, "p_full")] == 256
    commits = [prog.spec.bar_names[b[1]] for op in prog.ops["mma"] if op[0] == "commit" for b in op[1]]
    assert commits.count("s_full") == 4 and commits.count("o_full") == 1
    # the idle warpgroup takes part in nothing but the CTA-wide barrier at the start
    assert {op[0] for op in prog.ops["idle_wg"]} <= {"narrive", "nwait"}


def _drop_arrive(prog, role, bar, nth):
    o = _offset(prog, bar)
    ops = prog.ops[role]
    del ops[[i for i, op in enumerate(ops) if op[0] in ("arrive", "expect") and op[1][1] == o][nth]]


def _flip_wait(prog, role, bar, nth):
    o = _offset(prog, bar)
    ops = prog.ops[role]
    i = [i for i, op in enumerate(ops) if op[0] == "wait" and op[1][1] == o][nth]
    kind, b, parity, where = ops[i]
    ops[i] = (kind, b, 1 - parity, where)


def _set_count(prog, bar, n):
    prog.inits[_offset(prog, bar)] = n


@pytest.mark.cpu
@pytest.mark.parametrize("plant,kinds", [
    (lambda p: _set_count(p, "tmem_dealloc", 3 * 128), {"deadlock"}),  # the two-tile count
    (lambda p: _drop_arrive(p, "correction", "p_full", 1), {"deadlock"}),
    (lambda p: _flip_wait(p, "softmax0", "s_full", 1), {"race", "overrun"}),
    (lambda p: _flip_wait(p, "load", "kv_empty[0]", 1), {"race", "overrun"}),  # K_1 over K_0
], ids=["dealloc-count", "p_full-arrive", "s_full-parity", "ring-parity"])
def test_protocol_catches_planted_bugs(plant, kinds):
    from stage3_fwd_kernel import blackwell_protocol as bp

    prog = _program(2)
    plant(prog)
    res = bp.explore(prog, blocks=2, tiles=1)
    assert not res.ok and res.kind in kinds, res.report()


# ------------------------------------------------------------------------------------ compile tier
CASES = [  # (dtype, causal, varlen)
    ("bf16", False, False),
    ("bf16", True, False),
    ("fp16", False, False),
    ("fp16", True, True),
]


@pytest.fixture(scope="module")
def compiled():
    """Each configuration compiled once for the whole module."""
    pytest.importorskip("cutlass")
    from stage3_fwd_kernel import blackwell_fwd as bw

    out = {}

    def get(dtype, causal, varlen):
        if (dtype, causal, varlen) not in out:
            cfg = bw.make_config(dtype, 256, 256, causal, q_tiles_per_cta=1)
            out[(dtype, causal, varlen)] = (cfg, bw.compile_config(cfg, varlen))
        return out[(dtype, causal, varlen)]
    return get


@pytest.mark.compile
@pytest.mark.parametrize("case", CASES, ids=[f"{d}-{'causal' if c else 'full'}{'-varlen' if v else ''}"
                                             for d, c, v in CASES])
def test_compiles_sm100a_without_spills(compiled, case):
    dtype, causal, varlen = case
    cfg, comp = compiled(*case)
    rep = comp.report
    assert rep["ptx_target"] == "sm_100a"
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep["ptxas_log"][-600:]
    assert rep["stack_frame"] == 0 and rep["LDL/STL"] == 0 and comp.sass
    # TMEM: 384 columns used of the 512 allocated (once, freed once)
    assert rep["tmem_cols_used"] == 384 <= rep["tmem_cols_alloc"] == 512
    assert rep["ptx_tcgen05.alloc"] == 1 and rep["ptx_tcgen05.dealloc"] == 1
    # SMEM asked for = the plan
    assert rep["smem_bytes"] == cfg.smem.total == 197632
    # one Q tile, twice in the code (prologue S + loop, loop + tail O): S = Q K^T 2 x 256/16 (SMEM A),
    # O += P V 2 x 128/16 (TMEM A)
    assert rep["UTCHMMA.SS"] == 2 * 256 // 16 == 32 and rep["UTCHMMA.TS"] == 2 * 128 // 16 == 16
    assert rep["UTCHMMA"] == rep["ptx_tcgen05.mma"] == 48
    assert rep["UTCBAR"] == 7  # s_full x 2, kv_empty x 4, o_full x 1
    # the softmax step (unmasked and masked copies): 128 - 16 emulated + 1 rescale factor MUFU.EX2 each
    assert rep["MUFU.EX2"] == 2 * (128 - 16 + 1)
    assert rep["ptx_st_32x32b.x16"] == 2 * 4  # P a quarter at a time, in both copies
    # tcgen05.ld: S 2 x 4, scale 1, O rescale 8, final stats 1, O epilogue 8; st: (scale + 4 P) x 2 +
    # final 1 + O rescale 8
    assert (rep["LDTM"], rep["STTM"]) == (2 * 4 + 1 + 8 + 1 + 8, 2 * 5 + 1 + 8)
    # O leaves by TMA in 4 boxes of 64 columns (dense), or by row-guarded stores (varlen)
    assert rep["UTMASTG"] == (0 if varlen else 256 // 64)
    # four warpgroups, four register moves: softmax up, idle / correction / MMA-load-epilogue down
    r = cfg.regs
    assert sorted(rep["ptx_setmaxnreg"]) == sorted([("inc", str(r.softmax)), ("dec", str(r.idle)),
                                                    ("dec", str(r.correction)), ("dec", str(r.other))])
    assert rep["USETMAXREG"] == 4


@pytest.mark.compile
def test_pv_issued_three_quarters_then_one_quarter(compiled):
    _, comp = compiled("bf16", False, False)
    tokens = []
    for line in comp.sass.splitlines():
        m = re.search(r"\b(UTCHMMA)\s+(gdesc|tmem)\[|\b(SYNCS\.PHASECHK)\b", line)
        if m:
            tokens.append("T" if m.group(2) == "tmem" else "S" if m.group(1) else "W")
    stream = "".join(tokens)
    assert stream.count("TTTTTTWTT") == 2, stream  # 1 tile x (main loop + tail)
    assert stream.count("S" * 16) == 2             # S = Q K^T: 256 / 16 K-steps, prologue + loop


@pytest.mark.compile
def test_host_api_picks_one_q_tile(compiled):
    from stage3_fwd_kernel import blackwell_fwd as bw

    cfg, comp = compiled("bf16", False, False)
    out = bw.run(head_dim=256, verbose=False)  # compile-only here: the same (cached) build
    assert out["mode"] == "compile-only" and out["config"].key() == cfg.key()
    assert bw.compile_only("bf16", 256, q_tiles_per_cta=1) is comp


@pytest.mark.compile
def test_p_stored_where_the_pv_mma_reads_it(compiled):
    """blackwell_tmem_check at d = 256: every P element the softmax stores is where the TS MMA reads
    it, and the compiled PTX reads P at the traced columns (the S_0 columns 64 .. 127, 8 a K-step)."""
    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel import blackwell_tmem_check as check

    cfg, comp = compiled("bf16", False, False)
    traced = check.trace(bw.FlashAttentionForwardSm100(cfg))
    rep = check.report(traced)
    assert sorted(rep) == ["P_0"]
    r = rep["P_0"]
    assert r["elements"] == 128 * 128 and r["mismatches"] == r["not_stored"] == r["stored_twice"] == 0, r
    assert r["store_models_disagree"] == r["read_models_disagree"] == r["evaluator_vs_dsl"] == 0, r
    assert r["a_start_columns"] == [64 + 8 * kb for kb in range(8)]
    assert check.p_tmem_mismatches(None, "shift_column", traced) == {"P_0": 128 * 128}  # a wrong store is seen
    assert sorted(check.ptx_pv_a_columns(comp.ptx)) == sorted(check.expected_pv_a_columns(rep) * 2)


@pytest.mark.compile
@pytest.mark.parametrize("varlen", [False, True], ids=["tma", "varlen"])
def test_o_and_lse_reach_their_places(compiled, varlen):
    """blackwell_epilogue_check at dv = 256: O / l from TMEM through sO (over sQ) to its rows, lse to
    its rows; dense: 4 TMA boxes of 64 columns, as in the PTX; varlen: 32 lanes a row, 16 bytes each."""
    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel import blackwell_epilogue_check as check

    cfg, comp = compiled("bf16", False, False)
    kernel = bw.FlashAttentionForwardSm100(cfg, varlen=varlen)
    assert kernel.varlen_store_threads_per_row == 32
    traced = check.trace(kernel)
    assert traced["swizzle"] == (3, 4, 3)
    rep = check.report(traced)
    assert sorted(rep) == ["O_0", "lse_0"]
    o, lse = rep["O_0"], rep["lse_0"]
    assert o["elements"] == 128 * 256 and lse["rows"] == 128 and lse["mismatches"] == 0
    bad = {k: v for k, v in o.items() if k not in ("elements",) and v != 0}
    assert not bad, bad
    if not varlen:
        assert traced["tma_atom"]["box"] == [(64, 1), (128, 0)]
        got = check.ptx_tma_stores(comp.ptx)
        assert len(got) == 4 and sorted(got) == sorted(check.expected_tma_stores(traced))
