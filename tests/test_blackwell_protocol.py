"""The barrier-protocol model checker (stage3_fwd_kernel/blackwell_protocol.py; the backward kernels'
mappings in stage4_bwd_kernel/blackwell_protocol.py) on the Blackwell kernels (the forward, the 1-CTA,
2-CTA and wide backward): each passes at 4 key blocks / Q tiles, and a bug planted in the extracted program
of each (a missing arrive, a wrong wait parity, a wrong arrival count) is caught with the expected kind
of report. The planting edits the extracted operations, never the kernel source."""
import pytest

from stage3_fwd_kernel import blackwell_protocol as bp
from stage4_bwd_kernel import blackwell_protocol as bwd_protocol

pytestmark = [pytest.mark.cpu, pytest.mark.stage3]

_PROGRAMS: dict = {}


def program(kernel, blocks):
    """Extraction is the slow part (AST interpretation of every role): once per (kernel, blocks)."""
    key = (kernel, blocks)
    if key not in _PROGRAMS:
        owner = bwd_protocol if kernel in bwd_protocol.SPECS else bp
        _PROGRAMS[key] = owner.build(kernel, blocks)
    return _PROGRAMS[key].copy()


def _offset(prog, bar):
    return next(o for o, n in prog.spec.bar_names.items() if n == bar)


def drop_arrive(prog, role, bar, nth):
    """Delete the nth arrive (or arrive + expect_tx) of `role` on barrier `bar`."""
    o = _offset(prog, bar)
    ops = prog.ops[role]
    del ops[[i for i, op in enumerate(ops) if op[0] in ("arrive", "expect") and op[1][1] == o][nth]]


def flip_wait(prog, role, bar, nth):
    """Invert the parity of the nth wait of `role` on barrier `bar`."""
    o = _offset(prog, bar)
    ops = prog.ops[role]
    i = [i for i, op in enumerate(ops) if op[0] == "wait" and op[1][1] == o][nth]
    kind, b, parity, where = ops[i]
    ops[i] = (kind, b, 1 - parity, where)


def set_count(prog, bar, count):
    """mbarrier_init(bar, count) with another count."""
    prog.inits[_offset(prog, bar)] = count


@pytest.mark.parametrize("kernel", ["fwd", "bwd", "bwd2cta", "bwd-wide", "bwd-wide256"])
def test_kernel_protocol_holds(kernel):
    res = bp.explore(program(kernel, 4), blocks=4, tiles=2)
    assert res.ok, res.report()
    assert res.states > 100


def test_extraction_sees_the_pipeline():
    """The extracted forward has what the kernel's docstring promises: per key block one s_full
    commit per tile, P handed over in 3/4 + 1/4, and every TMA behind an expect_tx."""
    prog = program("fwd", 4)
    names = prog.spec.bar_names
    commits = [names[b[1]] for op in prog.ops["mma"] if op[0] == "commit" for b in op[1]]
    assert commits.count("s_full[0]") == 4 and commits.count("s_full[1]") == 4
    waits = [names[op[1][1]] for op in prog.ops["mma"] if op[0] == "wait"]
    assert waits.count("p_full[0]") == 4 and waits.count("p_full_2[0]") == 4
    assert sum(op[0] == "tma" for op in prog.ops["load"]) == 2 + 2 * 4
    assert prog.inits[_offset(prog, "p_full[0]")] == 256


PLANTED = [
    # kernel, planting, expected kinds
    ("fwd", lambda p: drop_arrive(p, "correction", "p_full[0]", 1), {"deadlock"}),
    ("fwd", lambda p: flip_wait(p, "softmax0", "s_full[0]", 1), {"race", "overrun"}),
    ("fwd", lambda p: set_count(p, "p_full[0]", 128), {"race", "overrun"}),
    ("fwd", lambda p: set_count(p, "epi_full[1]", 256), {"deadlock"}),
    ("bwd", lambda p: drop_arrive(p, "dq_drain", "dq_empty", 0), {"deadlock"}),
    ("bwd", lambda p: flip_wait(p, "elementwise", "s_full", 1), {"race", "overrun"}),
    ("bwd", lambda p: set_count(p, "dq_empty", 256), {"deadlock"}),
    ("bwd", lambda p: set_count(p, "p_full", 64), {"overflow"}),
    ("bwd2cta", lambda p: drop_arrive(p, "relay.1", "xchg_peer", 0), {"deadlock"}),
    ("bwd2cta", lambda p: flip_wait(p, "dq_drain.0", "dq_full", 1), {"race", "overrun"}),
    ("bwd2cta", lambda p: set_count(p, "p_full", 1), {"race", "overrun"}),
    # the wide kernel's serial schedule: S(j + 1) may not start before dQ^T(j), over it, is drained
    ("bwd-wide", lambda p: drop_arrive(p, "dq_drain", "dq_empty", 0), {"deadlock"}),
    ("bwd-wide", lambda p: flip_wait(p, "mma", "dq_empty", 0), {"race", "overrun"}),
    ("bwd-wide", lambda p: set_count(p, "ds_full", 64), {"overflow"}),
    ("bwd-wide256", lambda p: flip_wait(p, "elementwise", "dp_full", 1), {"race", "overrun"}),
    ("bwd-wide256", lambda p: flip_wait(p, "mma", "dq_empty", 0), {"race", "overrun"}),
]


@pytest.mark.parametrize("kernel,plant,kinds", PLANTED, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(PLANTED)])
def test_planted_bug_is_caught(kernel, plant, kinds):
    prog = program(kernel, 2)
    plant(prog)
    res = bp.explore(prog, blocks=2, tiles=2)
    assert not res.ok
    assert res.kind in kinds, res.report()
    assert res.trace and res.message


def _varlen_program(blocks, persistent=0):
    key = ("fwd-varlen", blocks, persistent)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = bp.extract(bp.forward_spec(blocks, persistent=persistent, varlen=True))
    return _PROGRAMS[key].copy()


def _drop_tail_arrive(prog):
    """Delete the load warp's last plain arrive on a kv_full barrier (its other ones carry TMA bytes)."""
    names, ops = prog.spec.bar_names, prog.ops["load"]
    del ops[[i for i, op in enumerate(ops) if op[0] == "arrive" and names[op[1][1]].startswith("kv_full")][-1]]


@pytest.mark.parametrize("blocks,persistent", [(1, 0), (3, 0), (2, 2)])
def test_varlen_build_zeroes_the_last_v_between_its_tma_and_the_mma(blocks, persistent):
    """The varlen build's load warp writes the last V slot (rows past the keys) after waiting for that
    slot's TMA on v_tail and before arriving on kv_full: the protocol holds, a zeroing per tile is
    extracted, and without the v_tail wait (a write under a landing copy), without the kv_full arrive
    (the MMA warp never starts the last P V) or with v_tail's second-tile parity flipped it fails."""
    prog = _varlen_program(blocks, persistent)
    assert bp.explore(prog, blocks=blocks, tiles=2).ok
    zeroing = [op for op in prog.ops["load"] if op[0] == "access" and "zero_v_rows" in op[-1]]
    assert len(zeroing) == max(persistent, 1)
    plants = [(lambda p: drop_wait(p, "load", "v_tail", 0), {"race"}), (_drop_tail_arrive, {"deadlock"})]
    if persistent:
        plants.append((lambda p: flip_wait(p, "load", "v_tail", 1), {"race", "overrun", "deadlock"}))
    for plant, kinds in plants:
        bad = _varlen_program(blocks, persistent)
        plant(bad)
        res = bp.explore(bad, blocks=blocks, tiles=2)
        assert not res.ok and res.kind in kinds, res.report()


def test_deadlock_report_is_readable():
    prog = program("fwd", 2)
    drop_arrive(prog, "correction", "p_full[0]", 1)
    text = bp.explore(prog, blocks=2, tiles=2).report()
    assert "DEADLOCK" in text and "mma blocked" in text and "p_full[0]" in text
    assert "blackwell_fwd.py" in text          # trace steps point at kernel source lines


def test_reduction_agrees_with_full_search():
    """Small cases: the reduced search and the plain one (every interleaving) give the same verdict."""
    ok = program("bwd", 1)
    assert bp.explore(ok, reduce=False, blocks=1).ok
    bad = program("bwd", 1)
    drop_arrive(bad, "elementwise", "ds_full", 0)
    assert bp.explore(bad, reduce=False, blocks=1).kind == bp.explore(bad, blocks=1).kind == "deadlock"


def test_cli_prints_states_and_result(capsys):
    assert bwd_protocol.main(["--kernel", "bwd", "--blocks", "2"]) == 0
    out = capsys.readouterr().out
    assert "states explored" in out and "OK" in out


# ---------------------------------------------------------------------- the persistent forward
# (blackwell_persistent.py): 2 work tiles per CTA of 3 + 4 key blocks (an odd first walk, so a
# phase count that is not carried into the second tile changes a parity)
def persistent_program(blocks=4, work_tiles=2):
    key = ("fwd-persistent", blocks, work_tiles)
    if key not in _PROGRAMS:
        _PROGRAMS[key] = bp.build("fwd", blocks, persistent=work_tiles)
    return _PROGRAMS[key].copy()


def drop_wait(prog, role, bar, nth):
    """Delete the nth wait of `role` on barrier `bar`."""
    o = _offset(prog, bar)
    ops = prog.ops[role]
    del ops[[i for i, op in enumerate(ops) if op[0] == "wait" and op[1][1] == o][nth]]


def restart_phase(prog, role, bar, first):
    """Invert the parity of `role`'s waits on `bar` from the `first`-th on: its phase count restarted
    at a tile boundary instead of carrying on."""
    o = _offset(prog, bar)
    ops = prog.ops[role]
    for i in [i for i, op in enumerate(ops) if op[0] == "wait" and op[1][1] == o][first:]:
        kind, b, parity, where = ops[i]
        ops[i] = (kind, b, 1 - parity, where)


def test_persistent_protocol_holds():
    res = bp.explore(persistent_program(), blocks=4, tiles=2)
    assert res.ok, res.report()
    assert res.walks == (3, 4) and res.states > 1000


PLANTED_PERSISTENT = [
    # the once-per-tile phases not flipped at the second tile
    (lambda p: flip_wait(p, "mma", "q_full[0]", 1), {"race", "overrun"}),
    (lambda p: flip_wait(p, "correction", "o_full[1]", 1), {"race", "overrun"}),
    (lambda p: flip_wait(p, "epilogue", "epi_full[0]", 1), {"race", "overrun"}),
    # the per-key-block phases restarted at the second tile (blocks_done not added)
    (lambda p: restart_phase(p, "softmax0", "s_full[0]", 3), {"race", "overrun"}),
    (lambda p: restart_phase(p, "correction", "scale_full[1]", 2), {"race", "overrun", "deadlock"}),
    (lambda p: restart_phase(p, "load", "kv_empty[0]", 1), {"race", "overrun"}),
    # a buffer handed to the next tile without its barrier: sQ, the statistics inside S_i, sO
    (lambda p: drop_wait(p, "load", "q_empty[0]", 1), {"race"}),
    (lambda p: drop_wait(p, "mma", "final_empty[1]", 1), {"race"}),
    (lambda p: drop_wait(p, "correction", "epi_empty[0]", 1), {"race"}),
    (lambda p: drop_arrive(p, "correction", "final_empty[0]", 0), {"deadlock"}),
]


@pytest.mark.parametrize("plant,kinds", PLANTED_PERSISTENT,
                         ids=[f"fwd-persistent-{i}" for i in range(len(PLANTED_PERSISTENT))])
def test_persistent_planted_bug_is_caught(plant, kinds):
    prog = persistent_program()
    plant(prog)
    res = bp.explore(prog, blocks=4, tiles=2)
    assert not res.ok
    assert res.kind in kinds, res.report()
    assert res.trace and res.message
