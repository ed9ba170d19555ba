"""Stage 3, Blackwell (sm_100a): the persistent forward (blackwell_persistent.py), checked without
hardware -- COMPILED, NEVER RUN: no Blackwell GPU exists anywhere in this project.

cpu tier: the persistent barriers fit the plan's SMEM header and sit after the one-tile build's; the
kernel refuses what it does not implement (the dynamic hand-out, sO over sQ, a sink at dv = 128); the launch passes the
grid's width; the protocol checker explores 2 work tiles per CTA (3 + 4 key blocks) with no deadlock
or race, and catches phases that are not carried from one tile to the next.

compile tier: d = 64 and 128, causal and not, compile for sm_100a under PersistentScheduler: no local
memory, SMEM = the plan, the one-tile build's register split, two more tcgen05.commit (q_empty), the grid's
width read in the PTX, and in the SASS every role's work -- the MMAs, the TMA loads and stores, the
exponentials -- inside a loop (the tile loop; the one-tile build has its prologue MMAs and its O
stores outside any loop). One compile per configuration (~5-10 s each on 2 cores).
"""
from __future__ import annotations

import re

import pytest

from stage3_fwd_kernel import blackwell_protocol as bp
from stage3_fwd_kernel.blackwell_config import SUPPORTED_HEAD_DIMS, blackwell_fwd_config

pytestmark = [pytest.mark.stage3]

CASES = [("bf16", 64, False), ("fp16", 64, True), ("bf16", 128, True), ("fp16", 128, False)]
SM_COUNT = 148  # B200


# ---------------------------------------------------------------------------------------- cpu tier
@pytest.mark.cpu
@pytest.mark.parametrize("d,dv", [p for p in SUPPORTED_HEAD_DIMS if p != (192, 128)])
def test_persistent_barriers_fit_the_header(d, dv):
    from stage3_fwd_kernel.blackwell_fwd import FlashAttentionForwardSm100
    from stage3_fwd_kernel.blackwell_protocol_extract import BarPtr
    from stage3_fwd_kernel.tile_scheduler import PersistentScheduler

    cfg = blackwell_fwd_config(d, dv, "bf16", causal=True)
    assert cfg.persistent_supported is None
    assert cfg.persistent_barriers == cfg.smem.num_barriers + 3 * 2
    assert 8 * cfg.persistent_barriers + 4 <= cfg.smem.header  # the SMEM plan is unchanged
    k = FlashAttentionForwardSm100(cfg, scheduler=PersistentScheduler())
    offsets = sorted(k._bar(BarPtr(0), n, i).off for n in ("q_empty", "final_empty", "epi_empty") for i in range(2))
    assert offsets == list(range(cfg.smem.num_barriers, cfg.persistent_barriers))


@pytest.mark.cpu
def test_refusals():
    from stage3_fwd_kernel.blackwell_fwd import FlashAttentionForwardSm100, make_config
    from stage3_fwd_kernel.tile_scheduler import PersistentScheduler

    with pytest.raises(ValueError, match="dynamic"):
        FlashAttentionForwardSm100(make_config(), scheduler=PersistentScheduler(dynamic=True))
    with pytest.raises(ValueError, match="sO is placed over sQ"):
        FlashAttentionForwardSm100(make_config("bf16", 192, 128), scheduler=PersistentScheduler())
    with pytest.raises(ValueError, match="learnable sink"):
        FlashAttentionForwardSm100(make_config("bf16", 128, 128, learnable_sink=True), scheduler=PersistentScheduler())
    assert not FlashAttentionForwardSm100(make_config()).persistent  # the default: one tile per CTA
    from stage3_fwd_kernel.blackwell_fwd import persistent_available

    assert persistent_available("bf16", 128, causal=True) and persistent_available("fp16", 64, learnable_sink=True)
    assert not persistent_available("bf16", 192, 128) and not persistent_available("bf16", 128, learnable_sink=True)
    # what a dense call runs by default (fa4's route and compile_launchable): neither causal nor a window
    from stage3_fwd_kernel.blackwell_fwd import default_persistent

    assert default_persistent("bf16", 128) and default_persistent("fp16", 64, softcap=30.0, learnable_sink=True)
    assert not default_persistent("bf16", 128, causal=True) and not default_persistent("bf16", 64, window_size=(8, 8))
    assert not default_persistent("bf16", 128, learnable_sink=True) and not default_persistent("bf16", 256, 256)


@pytest.mark.cpu
def test_launch_passes_the_sm_count(monkeypatch):
    """attention_forward's persistent launch appends the grid's width: the device's SMs (num_ctas=None)
    or num_ctas; persistent=True wraps the order given (stage 5's LPT order for fa4)."""
    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel import tile_scheduler as ts

    monkeypatch.setattr(ts, "sm_count", lambda device=None: SM_COUNT)
    assert bw._grid_width(ts.PersistentScheduler(), "cuda:0") == SM_COUNT
    assert bw._grid_width(ts.PersistentScheduler(num_ctas=7), None) == 7
    assert bw._grid_width(ts.StaticTileScheduler, None) is None
    # the launch's arguments end with the width (and seqused_k after it where the build takes one)
    import torch

    cfg, t = bw.make_config("bf16", 128, 128, False), torch.zeros(1)
    used = torch.zeros(2, dtype=torch.int32)
    assert bw._call_args(cfg, t, t, t, t, t, 0.125, max_ctas=7)[-1] == 7
    tail = bw._call_args(cfg, t, t, t, t, t, 0.125, seqused_k=used)[-2:]
    assert tail[0] is None and tail[1] is used
    assert len(bw._call_args(cfg, t, t, t, t, t, 0.125)) == 11
    assert bw._persistent_scheduler(None, True) == ts.PersistentScheduler(ts.StaticTileScheduler)
    assert bw._persistent_scheduler(None, False) is ts.StaticTileScheduler


_PROGRAMS: dict = {}


def _program(blocks, tiles):
    if (blocks, tiles) not in _PROGRAMS:
        _PROGRAMS[(blocks, tiles)] = bp.build("fwd", blocks, persistent=tiles)
    return _PROGRAMS[(blocks, tiles)].copy()


@pytest.mark.cpu
def test_protocol_two_tiles_per_cta():
    """Every role's tile loop for 2 work tiles (3 + 4 key blocks): no deadlock, race or lapped waiter;
    the extracted program has each once-per-tile hand-over twice and the persistent ones."""
    prog = _program(4, 2)
    res = bp.explore(prog, blocks=4, tiles=2)
    assert res.ok, res.report()
    assert res.walks == (3, 4) and "persistent=2 work tiles" in res.report()
    names = prog.spec.bar_names
    commits = [names[b[1]] for op in prog.ops["mma"] if op[0] == "commit" for b in op[1]]
    assert commits.count("s_full[0]") == 3 + 4 and commits.count("q_empty[1]") == 2
    waits = {r: [names[op[1][1]] for op in prog.ops[r] if op[0] == "wait"] for r in prog.ops}
    assert waits["mma"].count("final_empty[0]") == 2 and waits["load"].count("q_empty[1]") == 2
    assert waits["correction"].count("epi_empty[1]") == 2 and waits["epilogue"].count("epi_full[0]") == 2
    assert sum(op[0] == "tma" for op in prog.ops["load"]) == 2 * 2 + 2 * (3 + 4)
    # the second tile's per-tile waits take the other parity, the per-block ones count on from 3
    parities = [op[2] for op in prog.ops["softmax0"] if op[0] == "wait"]
    assert parities == [0, 1, 0] + [1, 0, 1, 0]


@pytest.mark.cpu
def test_phase_not_flipped_across_tiles_is_caught():
    """The second tile's q_full wait with the first tile's parity (tiles_done not carried): the
    checker reports it. More planted bugs in the phase carrying: tests/test_blackwell_protocol.py."""
    prog = _program(4, 2)
    o = next(o for o, n in prog.spec.bar_names.items() if n == "q_full[0]")
    ops = prog.ops["mma"]
    i = [i for i, op in enumerate(ops) if op[0] == "wait" and op[1][1] == o][1]
    kind, b, parity, where = ops[i]
    ops[i] = (kind, b, 1 - parity, where)
    res = bp.explore(prog, blocks=4, tiles=2)
    assert not res.ok and res.kind in ("race", "overrun"), res.report()


@pytest.mark.compile
def test_persistent_lpt_order_compiles():
    """Stage 5's LPT order (what fa4 passes for long causal calls) walked by a persistent grid."""
    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel.tile_scheduler import PersistentScheduler
    from stage5_scheduling.device import LPTCausalScheduler

    lpt = LPTCausalScheduler.from_problem(8192, 128, 32, 8, flat_batches=True)
    cfg, static = _compile("bf16", 128, True)
    comp = bw.compile_config(cfg, scheduler=PersistentScheduler(lpt))
    rep = comp.report
    assert rep["spill_stores"] == 0 and rep["stack_frame"] == 0 and rep["LDL/STL"] == 0
    assert rep["UTCHMMA"] == static.report["UTCHMMA"] and comp.sass != static.sass


# ------------------------------------------------------------------------------------ compile tier
def _compile(dt, d, causal):
    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel.tile_scheduler import PersistentScheduler

    cfg = bw.make_config(dt, d, d, causal)
    return cfg, bw.compile_config(cfg, scheduler=PersistentScheduler())


def _in_one_loop(sass: str, opcode: str) -> bool:
    """Whether every `opcode` instruction of the SASS lies inside one natural loop."""
    from stage3_fwd_kernel import sass_report as sr

    insns, labels = sr.parse_sass(sass)
    blocks, _ = sr.control_flow_graph(insns, labels)
    at = [k for k, (s, e) in enumerate(blocks) for ins in insns[s:e] if sr.opcode_count([ins.op], opcode)]
    return bool(at) and any(set(at) <= lp.blocks for lp in sr.natural_loops(sass))


@pytest.mark.compile
@pytest.mark.parametrize("dt,d,causal", CASES, ids=[f"{dt}-d{d}-{'causal' if c else 'full'}" for dt, d, c in CASES])
def test_persistent_compiles_sm100a(dt, d, causal):
    cfg, comp = _compile(dt, d, causal)
    rep, sass, ptx = comp.report, comp.sass, comp.ptx
    assert rep["ptx_target"] == "sm_100a"
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["stack_frame"] == 0
    assert rep["LDL/STL"] == 0, "local-memory traffic in SASS"
    assert rep["smem_bytes"] == cfg.smem.total  # the persistent barriers live in the same header
    regs = cfg.regs  # the one-tile build's split: 192 / 72 / 56
    assert sorted(rep["ptx_setmaxnreg"]) == sorted([("dec", str(regs.other)), ("dec", str(regs.correction)),
                                                    ("inc", str(regs.softmax))])
    # TMEM once per CTA; the same MMAs as the one-tile build, two more commits (q_empty per Q tile)
    assert rep["ptx_tcgen05.alloc"] == 1 and rep["ptx_tcgen05.dealloc"] == 1
    assert rep["UTCHMMA"] == 4 * (d // 16) + 4 * (cfg.tile_n // 16)
    assert rep["UTCBAR"] == 10 + 2
    # the static striding reads the grid's width; the tile loop holds every role's work
    assert re.search(r"%nctaid\.x", ptx) and re.search(r"%ctaid\.x", ptx)
    for opcode in ("UTCHMMA", "UTMALDG", "UTMASTG", "MUFU.EX2"):  # MMA, load, epilogue, softmax
        assert _in_one_loop(sass, opcode), f"{opcode} not inside the tile loop"


@pytest.mark.compile
def test_grid_is_the_sm_count():
    """With static shapes and a fixed width the launch grid is a plain value: min(tiles, SMs) x 1 x 1
    (2 x 16 heads x 32 CTA tiles of 256 rows = 1024 tiles > 148 SMs). One extra compile, d = 64."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel import host_io
    from stage3_fwd_kernel.tile_scheduler import PersistentScheduler

    cfg = bw.make_config("bf16", 64, 64, False)
    b, s, h, d = 2, 8192, 16, 64
    dt = host_io.cutlass_dtype("bf16")
    qkvo = [cute.runtime.make_fake_compact_tensor(dt, (b, s, h, d), stride_order=(3, 2, 1, 0), assumed_align=16)
            for _ in range(4)]
    lse = cute.runtime.make_fake_compact_tensor(Float32, (b, h, s), stride_order=(2, 1, 0), assumed_align=4)
    args = (*qkvo, lse, Float32(1.0), None, None, None, None, None, cute.runtime.make_fake_stream(), Int32(SM_COUNT))
    kernel = bw.FlashAttentionForwardSm100(cfg, scheduler=PersistentScheduler(num_ctas=SM_COUNT))
    fn, rep, _, _ = bw.compile_sm100(kernel, args)
    assert tuple(kernel.launch_grid) == (SM_COUNT, 1, 1)
    assert rep["spill_stores"] == 0
