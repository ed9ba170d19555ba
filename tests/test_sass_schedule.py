"""Stage 3: the static issue schedule read from SASS control bits (stage3_fwd_kernel/sass_schedule.py).

cpu tier: the control-bit decoder on hand-made encodings, and a hand-written encoded listing whose
loop has a skippable block, a named-barrier section and a loop-carried scoreboard wait, with its
stall sums worked out here.

compile tier: the decoder on the Blackwell forward compiled for sm_100a (d = 128 bf16): the fields
are consistent with the documented layout (no scoreboard 6, every waited-on scoreboard set, the S
row's LDTM waited on), both softmax loops are found and have positive stall sums, and they hold no
named barrier (the exp2 turn is gone). Static numbers only: nothing ran.
"""
from __future__ import annotations

import pytest

from stage3_fwd_kernel import sass_schedule as ss
from stage3_fwd_kernel.sass_report import natural_loops


def _ctrl(stall, wsb=7, rsb=7, wait=0, yield_bit=1, reuse=0):
    return stall | yield_bit << 4 | wsb << 5 | rsb << 8 | wait << 11 | reuse << 17


def _insn(addr, text, **ctrl):
    """Two listing lines as ``nvdisasm -c -hex`` prints them: the instruction with its lower 64 bits,
    then the upper 64 (control bits at 41..63, instruction bits below them)."""
    upper = _ctrl(**ctrl) << ss.CONTROL_SHIFT | 0x1A2B
    return (f"        /*{addr:04x}*/                   {text} ;    /* 0x000000000000794d */\n"
            f"                                                          /* 0x{upper:016x} */\n")


# ---------------------------------------------------------------------------------------- cpu tier
@pytest.mark.cpu
@pytest.mark.stage3
def test_decode_control_fields():
    c = ss.decode_control(_ctrl(stall=5, wsb=3, rsb=7, wait=0b100001, yield_bit=0, reuse=0b0010) << 41 | 0xFFFF)
    assert (c.stall, c.write_sb, c.read_sb, c.wait_mask, c.reuse, c.yield_hint) == (5, 3, 7, 0b100001, 2, True)
    # a real upper half (this ptxas, sm_100a: UMOV UR18, 0x0): stall 1, no scoreboards, no wait
    c = ss.decode_control(0x000FE20000000000)
    assert (c.stall, c.write_sb, c.read_sb, c.wait_mask, c.yield_hint) == (1, 7, 7, 0, False)


LISTING = (
    _insn(0x00, "MOV R1, 0x0", stall=1)
    + ".L_x_1:\n"
    + _insn(0x10, "LDTM.x32 R4, tmem[UR4]", stall=2, wsb=2, wait=0b010000)  # waits for the MUFU (loop-carried)
    + _insn(0x20, "FMNMX R8, R4, R5, !PT", stall=3, wait=0b000100)          # waits for the LDTM
    + _insn(0x30, "@!P0 BRA `(.L_x_2)", stall=4)
    + _insn(0x40, "BAR.SYNC.DEFER_BLOCKING R3, 0x100", stall=5)
    + _insn(0x50, "MUFU.EX2 R4, R4", stall=6, wsb=4)
    + _insn(0x60, "BAR.ARV R2, 0x100", stall=7)
    + ".L_x_2:\n"
    + _insn(0x70, "ISETP.GE.AND P1, PT, R5, 0x10, PT", stall=8)
    + _insn(0x80, "@!P1 BRA `(.L_x_1)", stall=9)
    + _insn(0x90, "EXIT", stall=1)
)


@pytest.mark.cpu
@pytest.mark.stage3
def test_schedule_of_a_hand_written_loop():
    assert len(ss.controls(LISTING)) == 10
    (loop,) = natural_loops(LISTING)
    s = ss.loop_schedule(LISTING, loop)
    assert [r.ctrl.stall for r in s.rows] == [2, 3, 4, 5, 6, 7, 8, 9]
    assert s.stall_total == s.stall_longest == 44
    assert s.stall_shortest == 44 - (5 + 6 + 7)  # the BAR.SYNC .. BAR.ARV block skipped
    assert s.turn_cycles == 5 + 6 and s.mufu_in_turn == 1 and s.mufu == 1
    assert [(i, op, c) for i, op, c in s.barriers] == [(3, "BAR.SYNC.DEFER_BLOCKING", 9), (5, "BAR.ARV", 20)]
    assert s.waits_on_path == 2
    assert s.wait_producers == {"LDTM (write)": 1, "MUFU.EX2 (write)": 1}
    assert "BAR.ARV R2, 0x100" in s.table()


@pytest.mark.cpu
@pytest.mark.stage3
def test_plain_listing_is_refused():
    plain = "\n".join(line for line in LISTING.splitlines() if "/*0" in line)  # upper halves dropped
    with pytest.raises(ValueError, match="upper half"):
        ss.controls(plain)


# ------------------------------------------------------------------------------------ compile tier
def _forward(causal: bool):
    from stage3_fwd_kernel import blackwell_fwd as bw

    cfg = bw.make_config("bf16", 128, causal=causal)
    comp = bw.compile_config(cfg)
    return cfg, comp, ss.disassemble_encoded(comp.fn.__cubin__)


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_decoder_on_the_compiled_forward(causal):
    from stage3_fwd_kernel.sass_report import parse_sass

    cfg, comp, listing = _forward(causal)
    assert comp.report["spill_stores"] == 0 and comp.report["spill_loads"] == 0
    ctl = ss.controls(listing)
    assert len(ctl) == len(parse_sass(listing)[0]) > 1000
    assert all(0 <= c.stall <= 15 for c in ctl)
    # scoreboards are 0..5, 7 = none: a field read from the wrong bits would show 6 somewhere
    assert {c.write_sb for c in ctl} | {c.read_sb for c in ctl} <= {0, 1, 2, 3, 4, 5, 7}
    waited = {b for c in ctl for b in range(6) if c.wait_mask >> b & 1}
    released = {c.write_sb for c in ctl} | {c.read_sb for c in ctl}
    assert waited and waited <= released
    assert sum(c.stall in (1, 2) for c in ctl) > len(ctl) // 2

    emulated = round(cfg.emulation_fraction * 16) * cfg.tile_n // 16
    for role, found in ss.loop_summary(listing, cfg.tile_n).items():
        assert found is not None, f"no {role} loop"
        loop, s = found
        assert len(s.rows) == len(loop.ops)
        assert s.stall_total >= s.stall_longest >= s.stall_shortest > len(loop.ops) // 2
        assert s.mufu == cfg.tile_n - emulated + 1
        # the S row comes from TMEM (LDTM, variable latency) and the row max must wait for it
        assert s.wait_producers.get("LDTM (write)", 0) >= 1, s.wait_producers
        assert any(r.op.startswith("MUFU.EX2") and r.ctrl.write_sb != ss.NO_SCOREBOARD for r in s.rows)
        # no exp2 turn between the softmax warpgroups (blackwell_softmax.py says why)
        assert not any(op.startswith("BAR.") for _, op, _ in s.barriers) and s.turn_cycles is None
