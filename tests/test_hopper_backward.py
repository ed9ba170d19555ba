"""Stage 4, the production Hopper backward (``stage4_bwd_kernel.hopper``, d = 64 / 96 / 128): RS dV/dK,
keys split across the consumer warpgroups, a dQ writer warp reducing with TMA bulk reduce-adds. The
wide head dims (192/128, 256/256) have their own file, test_hopper_backward_wide.py.

cpu tier: the tiles and options each head dim gets.

compile tier (sm_90a, fake tensors, no GPU): every supported head dim, both dtypes, causal and
deterministic on/off, varlen + seqused_k: no spills, no local memory, the wgmma count of the five
GEMMs with dV / dK taking A from registers, the dQ TMA tensor reduce (PTX ``cp.reduce.async.bulk.tensor
... add``, SASS ``UTMAREDG``, one per swizzle span) with neither row-wise bulk reduces (``UBLKRED``) nor
fp32 atomics (REDG ... F32) left, the named barriers, TMA + setmaxnreg, and the semaphore protocol
exactly in deterministic mode. cpu: the package's import graph has no cycle.

gpu tier (H100/H200; skipped here): dq/dk/dv follow FA4's rule against fp32 autograd over odd
seqlens, causal, GQA 1/2/8, all supported head dims, fp16, varlen with empty sequences and
seqused_k; outputs NaN-poisoned; walks of 1-4 Q tiles (the dQ double buffer's edge cases);
deterministic mode bitwise reproducible (GQA, causal); options that only move work change no bit;
run() entry point.
"""
from __future__ import annotations

import pathlib
import re

import pytest
import test_stage4_hopper as s4  # the ladder's test helpers (tests/ is on the path): one checking rule

pytestmark = pytest.mark.stage4

STEP = "hopper.backward"
HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (128, 64)]


def _mod():
    return s4._step(STEP)


# ================================================================================== cpu tier
@pytest.mark.cpu
def test_tiles_follow_the_head_dims():
    mod = _mod()
    assert mod.default_tiles(128, 128) == (80, 128)
    assert mod.default_tiles(96, 96) == (64, 128)
    assert mod.default_tiles(64, 64) == (128, 128)
    assert mod.default_tiles(128, 64) == (80, 128)  # d = 128's tile: dV's 32 registers fewer leave room
    k64, k96 = mod.make_kernel(None, 64, 64, False, False), mod.make_kernel(None, 96, 96, False, False)
    assert (k64.dq_split_m, k64.dq_swap_ab) == (True, False)
    assert (k96.dq_split_m, k96.dq_swap_ab, k96.dq_buffers) == (False, False, 1)  # one dQ buffer measured faster
    # 80 x 128 (d = 128): dQ^T = K^T dS^T, one dQ buffer (two would need 264 KB of SMEM)
    k80 = mod.make_kernel(None, 128, 128, False, False, tiles=(80, 128))
    assert (k80.tile_m, k80.dq_swap_ab, k80.dq_buffers) == (80, True, 1)
    with pytest.raises(ValueError, match="tiles: the Hopper backward runs"):
        mod.make_kernel(None, 128, 128, False, False, tiles=(64, 128))
    for gone in ("decoupled", "late_dv"):  # options measured and not kept are gone
        with pytest.raises(TypeError, match=f"{gone}: not an option"):
            mod.make_kernel(None, 128, 128, False, False, **{gone: False})


@pytest.mark.cpu
def test_import_graph_of_stage4_has_no_cycle():
    """Every import of every stage-4 module (top level or inside a function), as a graph of modules:
    no cycle (the host, the postprocess and the kernel package import downwards only)."""
    import ast

    root = pathlib.Path(__file__).resolve().parent.parent
    package = root / "stage4_bwd_kernel"
    names = {}
    for path in package.rglob("*.py"):
        rel = path.relative_to(root).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        names[".".join(parts)] = path
    graph = {}
    for name, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            deps.update(t for t in targets if t in names and t != name)
        graph[name] = deps

    def cycle_from(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for dep in graph[node]:
                if dep == start:
                    return path + [dep]
                if dep not in seen:
                    seen.add(dep)
                    stack.append((dep, path + [dep]))
        return None

    cycles = [c for c in map(cycle_from, sorted(graph)) if c]
    assert not cycles, " -> ".join(cycles[0])


@pytest.mark.cpu
def test_wgmma_serialization_remarks_are_recognised():
    from stage3_fwd_kernel.compile_cache import wgmma_serialization

    log = ("ptxas info    : (C7519) warpgroup.arrive is injected in around line 940 by compiler to allow use of "
           "registers in GMMA in function 'k'\n"
           "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "insufficient register resources for the function 'k'\n"
           "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
           "non wgmma instructions defining accumulator registers\n"
           "(C7512) ... serialized ... again\n")
    assert wgmma_serialization(log) == ["C7512", "C7520"]
    assert wgmma_serialization(log.splitlines()[0]) == [] and wgmma_serialization("") == []
    # the DSL's log may wrap a remark over lines
    wrapped = ("          ptxas info    : (C7519) warpgroup.arrive is injected in around line 9 by compiler\n"
               "          to allow use of registers in GMMA in function 'k'\n"
               "          ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are\n"
               "          serialized due to insufficient register resources for the function\n          'k'\n")
    assert wgmma_serialization(wrapped) == ["C7512"]


@pytest.mark.compile
def test_a_build_with_serialized_wgmmas_warns():
    """One dS^T buffer at d = 128 (then the "sdSt free" barriers guard it) runs out of registers
    and ptxas serializes the wgmmas (C7512): every compile says so with a WgmmaSerializedWarning; the
    default build, two dS^T buffers, stays asynchronous."""
    import functools
    import warnings

    from stage3_fwd_kernel.compile_cache import WgmmaSerializedWarning
    from stage4_bwd_kernel import host

    mod = _mod()
    args = dict(dtype="bf16", head_dim=128, head_dim_v=128, causal=False, deterministic=False, varlen=False,
                has_seqused_k=False, dq_order=None, tiles=None)
    with pytest.warns(WgmmaSerializedWarning, match="C7512"):
        comp = host.compile_fake(mod.STEP + "~test_serialized", functools.partial(mod.make_kernel, ds_buffers=1),
                                 **args)
    assert comp.report["wgmma_serialized"] == ["C7512"]
    with warnings.catch_warnings():
        warnings.simplefilter("error", WgmmaSerializedWarning)
        comp = host.compile_fake(mod.STEP + "~test_not_serialized", mod.make_kernel, **args)
    assert comp.report["wgmma_serialized"] == []


@pytest.mark.cpu
def test_buffer_defaults_fit_shared_memory():
    """Two dS^T buffers below the 128-query tile (then the "sdSt free" barriers go),
    dQ buffers from what is left of the 227 KB (d = 96: one, measured faster, two in deterministic mode for
    its two writer warps); options that cannot work are refused."""
    mod = _mod()
    expect = {(64, 64): (1, 2), (96, 96): (2, 1), (128, 128): (2, 1)}  # (dS^T buffers, dQ buffers)
    for (d, dv), (ds, dq) in expect.items():
        kernel = mod.make_kernel(None, d, dv, False, False)
        assert (kernel.ds_buffers, kernel.dq_buffers) == (ds, dq), (d, kernel.ds_buffers)
        assert kernel._smem_need(kernel.ds_buffers, kernel.dq_buffers) <= 227 * 1024
    assert mod.make_kernel(None, 128, 128, False, False, ds_buffers=1).dq_buffers == 1
    assert mod.make_kernel(None, 96, 96, True, True).dq_buffers == 2  # deterministic: a buffer per writer warp
    with pytest.raises(ValueError, match="ds_buffers: expected 1 or 2"):
        mod.make_kernel(None, 128, 128, False, False, ds_buffers=3)
    with pytest.raises(ValueError, match="dq_writers: expected 1 or 2"):
        mod.make_kernel(None, 96, 96, False, True, dq_writers=3)


@pytest.mark.compile
def test_trace_stamps_compile_only_when_turned_on():
    """The trace stamps (stage3_fwd_kernel.trace): off, the kernel reads no clock; on, the four CTA
    events' global timers, no spills at d = 128, under a compile key of its own."""
    from stage3_fwd_kernel import trace
    from stage4_bwd_kernel import common, host

    mod = _mod()
    dt = common.cutlass_dtype("bf16")
    _, plain = host.compile_main(mod.STEP, mod.make_kernel, dt, 128, 128, True, False, launchable=False)
    assert "SR_GLOBALTIMER" not in plain.sass and "traced" not in host.compile_key(mod.STEP, dt, 128, 128, True,
                                                                                    False, False, False, None, None)
    trace.enable(1 << 40)
    try:
        assert "traced" in host.compile_key(mod.STEP, dt, 128, 128, True, False, False, False, None, None)
        _, traced = host.compile_main(mod.STEP, mod.make_kernel, dt, 128, 128, True, False, launchable=False)
    finally:
        trace.disable()
    assert traced.sass.count("SR_GLOBALTIMER") >= len(trace.CTA_EVENTS)
    assert traced.report["spill_stores"] == 0 and traced.report["spill_loads"] == 0


@pytest.mark.cpu
def test_key_select_defaults():
    """The 80-query tile (d = 128) outside deterministic mode puts the key-bound select in its unmasked
    body too (traced there: -3.9% / -3.4% CTA cycles non-causal / causal); other builds do not."""
    mod = _mod()
    for causal in (False, True):
        assert mod.make_kernel(None, 128, 128, causal, False).key_select
        assert mod.make_kernel(None, 128, 128, causal, False, varlen=True).key_select
        assert not mod.make_kernel(None, 128, 128, causal, True).key_select
        for d in (64, 96):
            assert not mod.make_kernel(None, d, d, causal, False).key_select
    assert mod.make_kernel(None, 64, 64, False, False, key_select=True).key_select


@pytest.mark.compile
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_key_select_moves_exponentials_under_the_dp_wgmma(causal):
    """What key_select is for, read in the SASS of the hot loop (the unmasked tile body): with it, ptxas
    issues 13 of a thread's 40 exponentials before the dP^T wait (the official kernel's loop: 11), without
    it 4, so more of them ran after dP^T's wgmma, with the tensor cores idle."""
    from stage4_bwd_kernel import common

    mod = _mod()
    counts = {}
    for select in (True, False):
        comp = mod.compile_only(head_dim=128, causal=causal, key_select=select)
        hot = common.wgmma_loop_bodies(comp.sass)[0]
        assert sum(op.startswith("MUFU.EX2") for op in hot) == 40 and sum(op.startswith("HGMMA") for op in hot) == 34
        counts[select] = common.exps_before_second_wait(hot)
        assert comp.report["spill_stores"] == 0 and comp.report["wgmma_serialized"] == []
    assert counts[True] >= 10 > 6 >= counts[False], counts


@pytest.mark.cpu
def test_column_limit_mask_offsets_and_kv_with_first_defaults():
    """column_limit is on below the
    128-query tile (with it the d = 64 build spilled); mask_offsets is on causal at d <= 96 outside
    deterministic mode and varlen, kv_with_first causal on the 128-query tile outside deterministic mode."""
    mod = _mod()
    for causal in (False, True):
        for det in (False, True):
            for d in (64, 96, 128):
                kernel = mod.make_kernel(None, d, d, causal, det)
                assert kernel.column_limit == (kernel.tile_m != 128), (d, causal, det, kernel.tile_m)
                assert kernel.mask_offsets == (causal and not det and d <= 96), (d, causal, det)
                assert kernel.kv_with_first == (causal and not det and kernel.tile_m == 128), (d, causal, det)
            assert not mod.make_kernel(None, 64, 64, True, False, varlen=True).mask_offsets
    assert not mod.make_kernel(None, 128, 128, True, False, column_limit=False).column_limit
    assert mod.make_kernel(None, 64, 64, True, False, column_limit=True).column_limit


def _tile_bodies(sass, hgmma_per_tile):
    """The walk's three tile bodies in the SASS listing of the kernel (the shortest loops holding one tile's
    wgmmas): the unmasked one first, then the two masked segments'."""
    from stage4_bwd_kernel import common

    return [b for b in common.wgmma_loop_bodies(sass)
            if sum(op.startswith("HGMMA") for op in b) == hgmma_per_tile][:3]


@pytest.mark.compile
@pytest.mark.parametrize("d,causal,hgmma,dv_hgmma", [(64, False, 32, 8), (64, True, 32, 8), (96, False, 28, 4)],
                         ids=["d64-full", "d64-causal", "d96-full"])
def test_dv_is_issued_ahead_of_the_ds_fence(d, causal, hgmma, dv_hgmma):
    """dV after dS^T, read in the SASS of the hot loop: after the dP^T wait, the dV wgmma's HGMMAs come
    before the proxy fence that publishes dS^T (MEMBAR), as in the official kernel's loop, so dV does
    not wait for the dS^T stores to land -- in every tile body, d = 96's 64-query tile included (it
    issued dV right after P^T until 2026-12-01)."""
    from stage4_bwd_kernel import common

    comp = _mod().compile_only(head_dim=d, causal=causal)
    bodies = _tile_bodies(comp.sass, hgmma)
    assert len(bodies) == 3 and all(common.wgmmas_before_fence(b) == dv_hgmma for b in bodies)
    assert comp.report["spill_stores"] == 0 and comp.report["wgmma_serialized"] == []


@pytest.mark.compile
def test_column_limit_selects_once_per_score():
    """column_limit, read in the SASS of the d = 128 causal masked bodies: one FSEL per score (40 per
    thread) instead of one per mask condition (3 per score), and shorter bodies; the unmasked loop keeps
    its instruction count."""
    mod = _mod()
    bodies = {}
    for option in (True, False):
        comp = mod.compile_only(head_dim=128, causal=True, column_limit=option)
        bodies[option] = _tile_bodies(comp.sass, 34)
        assert comp.report["spill_stores"] == 0 and comp.report["wgmma_serialized"] == []
    with_limit, without = bodies[True], bodies[False]
    assert len(with_limit[0]) == len(without[0])
    for masked_with, masked_without in zip(with_limit[1:], without[1:]):
        assert sum(op.startswith("FSEL") for op in masked_with) == 40
        assert sum(op.startswith("FSEL") for op in masked_without) >= 80
        assert len(masked_with) < len(masked_without)


@pytest.mark.compile
@pytest.mark.parametrize("d,hgmma", [(64, 32), (128, 34)], ids=["d64", "d128"])
def test_mask_offsets_shortens_the_masked_bodies(d, hgmma):
    """mask_offsets, read in the SASS of the causal masked bodies: shorter than both older tests (the
    per-condition selects and column_limit), without spills, and the unmasked loop keeps its length."""
    mod = _mod()
    bodies = {}
    for name, options in (("old", {"column_limit": False, "mask_offsets": False}),
                          ("column_limit", {"column_limit": True, "mask_offsets": False}),
                          ("mask_offsets", {"mask_offsets": True})):
        comp = mod.compile_only(head_dim=d, causal=True, kv_with_first=False, **options)
        if name != "column_limit" or d != 64:  # column_limit spills at d = 64 (why it is off there)
            assert comp.report["spill_stores"] == 0 and comp.report["wgmma_serialized"] == [], name
        bodies[name] = _tile_bodies(comp.sass, hgmma)
    # the unmasked loop keeps its length (its vector instructions: ptxas moves uniform-datapath moves
    # between builds whatever the masked bodies do)
    vector = {k: [op for op in b[0] if not op.startswith("U")] for k, b in bodies.items()}
    assert len(vector["mask_offsets"]) == len(vector["old"])
    for i in (1, 2):
        assert len(bodies["mask_offsets"][i]) < min(len(bodies["old"][i]), len(bodies["column_limit"][i]))


@pytest.mark.compile
def test_kv_with_first_waits_on_two_barriers_fewer():
    """kv_with_first, read in the SASS of d = 64 causal: the consumers no longer wait on the K/V barrier
    before the walk (fewer mbarrier phase checks), and the producer adds the K and V bytes to the first
    Q and dO barriers with two expect-tx that do not arrive (SYNCS.ARRIVE.TRANS64.RED.A0TR)."""
    import re

    mod = _mod()
    sass = {first: mod.compile_only(head_dim=64, causal=True, kv_with_first=first).sass for first in (False, True)}
    waits = {k: len(re.findall(r"\bSYNCS\.PHASECHK\.TRANS64\s", v)) for k, v in sass.items()}
    expect_only = {k: len(re.findall(r"\bSYNCS\.ARRIVE\.TRANS64\.RED\.A0TR\b", v)) for k, v in sass.items()}
    assert waits[True] < waits[False], waits
    assert expect_only == {False: 0, True: 2}, expect_only


@pytest.mark.cpu
def test_q_shift_counts_q_tiles_from_the_end():
    """Causal d = 128 default mode pads the first Q tile instead of the last (q_shift): a 4k causal head
    then walks 858 Q tiles of 80 rows instead of 883 (845 tiles' worth of rows); the padding is a multiple
    of 4 rows (16-byte TMA starts of the row statistics); other builds keep their tiles, and builds that
    could not load the padding as zeros refuse it."""
    from stage4_bwd_kernel import schedule

    mod = _mod()
    kernel = mod.make_kernel(None, 128, 128, True, False)
    assert kernel.q_shift and kernel.tile_m == 80
    for args, kw in (((128, 128, False, False), {}), ((128, 128, True, True), {}), ((64, 64, True, False), {}),
                     ((96, 96, True, False), {}), ((128, 128, True, False), {"varlen": True})):
        assert not mod.make_kernel(None, *args, **kw).q_shift, (args, kw)
    with pytest.raises(ValueError, match="q_shift: needs a dense"):
        mod.make_kernel(None, 128, 128, True, False, varlen=True, q_shift=True)
    assert [kernel.top_padding(s) for s in (4096, 8192, 16384, 80, 1, 113)] == [64, 48, 16, 0, 76, 44]

    def walked(seqlen, pad):
        ranges = (schedule.m_block_range(n, 80, 128, seqlen + pad, seqlen, True) for n in range(seqlen // 128))
        return sum(hi - lo for lo, hi in ranges)

    assert walked(4096, 0) == 883 and walked(4096, kernel.top_padding(4096)) == 858
    assert walked(16384, 0) == 13286 and walked(16384, kernel.top_padding(16384)) == 13261


@pytest.mark.cpu
def test_stats_shuffle_finds_every_column_statistic():
    """stats_shuffle: lane l keeps queries q0, q0 + 1, q0 + 8, q0 + 9 (q0 = 16 (l // 4) + 2 (l % 4)) of the
    tile's ring in registers 0..3; the shuffle source of each of a lane's accumulator columns (query
    8 (c // 2) + 2 (l % 4) + c % 2) must hold that query."""
    from stage4_bwd_kernel.hopper.scores import stats_shuffle_query, stats_shuffle_source

    mod = _mod()
    for tm in (64, 80, 128):
        for lane in range(32):
            for c in range(tm // 4):
                src, reg = stats_shuffle_source(c, lane)
                query = 8 * (c // 2) + 2 * (lane % 4) + c % 2
                assert 0 <= reg < 4 and stats_shuffle_query(src, reg) == query, (tm, lane, c)
    assert mod.make_kernel(None, 64, 64, False, False).stats_shuffle
    assert mod.make_kernel(None, 64, 64, True, True).stats_shuffle
    # d = 64 causal default mode: on without a window or softcap, dense and varlen (it serialized the wgmmas
    # before first stores; measured 1.07-1.09x in varlen, +0.3..2.5% dense)
    assert mod.make_kernel(None, 64, 64, True, False).stats_shuffle
    assert mod.make_kernel(None, 64, 64, True, False, varlen=True).stats_shuffle
    assert not mod.make_kernel(None, 64, 64, True, False, varlen=True, softcap=30.0).stats_shuffle
    assert not mod.make_kernel(None, 128, 128, False, False).stats_shuffle
    # softcap on a plain walk: off in both modes (the lanes' statistics spilled there); deterministic
    # causal softcap keeps them (fewer spills with them)
    assert not mod.make_kernel(None, 64, 64, False, False, softcap=30.0).stats_shuffle
    assert not mod.make_kernel(None, 64, 64, False, True, softcap=30.0).stats_shuffle
    assert mod.make_kernel(None, 64, 64, True, True, softcap=30.0).stats_shuffle


# ============================================================================== compile tier
BODY_COPIES = 3  # the walk's masked / unmasked / masked segments each compile the tile body


def body_copies(kernel) -> int:
    """Tile bodies in a build: each segment twice in a rotated walk (cut at the wrap: hopper/walk.py),
    and one more per walk end with half tiles (consumer.edge_tile: the visible warpgroup's body)."""
    return BODY_COPIES * (2 if kernel.rotate_walk else 1) + half_tile_ends(kernel)


def half_tile_ends(kernel) -> int:
    """Walk ends whose masked tiles may idle a warpgroup (a causal / right edge, a left edge)."""
    return sum(edge is not None for edge in kernel.half_tile_edges)


def _expected_hgmma(d, dv, tm, tn, dq_split_m=False, dq_swap_ab=False):
    """Static wgmma instructions per Q tile (per warpgroup's code): S^T and dP^T, one 64-key M block
    and K = d / dv; dV and dK, K = tm (A from registers); dQ, K = tn, with M = tm and N split, or
    (dq_split_m, the 128 x 128 tile) M = tm / 2 and N = d, or (dq_swap_ab, 80 x 128) dQ^T with
    M = d / 2 and N = tm."""
    dq_rows = d // 2 if dq_swap_ab else (tm // 2 if dq_split_m else tm)
    return d // 16 + dv // 16 + 2 * (tm // 16) + (dq_rows // 64) * (tn // 16)


# (dtype, d, dv, causal, deterministic, varlen, seqused_k): 11 compiles, ~2-4 s each on 2 cores
COMPILE_CASES = [("bf16", 64, 64, False, False, False, False), ("bf16", 64, 64, True, False, False, False),
                 ("fp16", 64, 64, True, True, False, False), ("bf16", 96, 96, False, False, False, False),
                 ("bf16", 96, 96, True, False, False, False), ("fp16", 96, 96, False, True, False, False),
                 ("bf16", 128, 128, False, False, False, False), ("bf16", 128, 128, True, False, False, False),
                 ("bf16", 128, 128, True, True, False, False),
                 ("fp16", 128, 128, True, True, True, True), ("bf16", 128, 64, True, False, False, False)]
COMPILE_IDS = [f"{dt}-d{d}x{dv}-{'causal' if c else 'full'}-{'det' if det else 'atomic'}"
               f"{'-varlen' if vl else ''}{'-seqused' if su else ''}" for dt, d, dv, c, det, vl, su in COMPILE_CASES]


@pytest.mark.compile
@pytest.mark.parametrize("dtype,d,dv,causal,det,varlen,seqused", COMPILE_CASES, ids=COMPILE_IDS)
def test_compiles_sm90a(dtype, d, dv, causal, det, varlen, seqused):
    mod = _mod()
    comp = mod.compile_only(dtype=dtype, head_dim=d, head_dim_v=dv, causal=causal, deterministic=det,
                            varlen=varlen, has_seqused_k=seqused)
    rep, sass, ptx = comp.report, comp.sass, comp.ptx
    log = rep["ptxas_log"]
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, f"spills: {rep}"
    assert rep["stack_frame"] == 0 and rep["LDL/STL"] == 0, f"local memory: {rep}"
    assert rep["registers"] is not None and rep["registers"] <= 168  # launch cap 65536 / 384
    assert rep["smem_bytes"] is not None and rep["smem_bytes"] <= 227 * 1024
    assert "C7508" not in log and "C7510" not in log, log
    assert rep["wgmma_serialized"] == [], log  # any wgmma serialization (C7510, C7520, ...), wrapped or not
    kernel = mod.make_kernel(None, d, dv, causal, det)
    tm, tn = mod.default_tiles(d, dv)
    copies, idle = body_copies(kernel), half_tile_ends(kernel)
    assert idle == int(tm < 128 and causal)  # causal: the first tiles' last 64 keys
    # two full waits per body: dP^T (dV is issued after dS^T) and dK, at the end; an idle warpgroup's dQ: one
    full_waits = copies * 2 + idle
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") <= full_waits, "a wgmma waited right after issue"
    assert rep["threads"] == 384 and rep["UTMALDG"] and rep["LDGSTS"] == 0
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    # setmaxnreg only redistributes the CTA's launch registers (168 x 384): a budget that sums to
    # more makes .inc wait forever (32 / 240 / 240 hung on the H100)
    dec = {int(x) for x in re.findall(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+);", ptx)}
    inc = {int(x) for x in re.findall(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+);", ptx)}
    assert len(dec) == len(inc) == 1 and dec.pop() + 2 * inc.pop() <= 3 * rep["registers"]
    # named barriers: __syncthreads, consumers, "sdSt free", dQ full per buffer, dQ empty per buffer and
    # warpgroup (hopper/options.py); ptxas reserves all 16 where an id is computed at run time
    used = int(re.search(r"used (\d+) barriers", log).group(1))
    assert used == kernel.num_barriers or (used == 16 and kernel.num_barriers <= 16), (used, kernel.num_barriers)

    # (a) five GEMMs on wgmma; dV and dK with A from registers (HGMMA ... Rd, Ra, gdesc[..])
    # a half tile's dQ runs half its k-steps in the visible warpgroup's body and half in the idle one's
    assert rep["HGMMA"] == copies * _expected_hgmma(d, dv, tm, tn, kernel.dq_split_m, kernel.dq_swap_ab)
    rs = re.findall(r"\bHGMMA\.\S+\s+R\d+,\s*R\d+,\s*gdesc", sass)
    assert len(rs) == copies * 2 * (tm // 16), f"RS wgmmas: {len(rs)}"

    # row statistics: 2 x tm / 4 shuffles per body with stats_shuffle (d = 64), none in the body otherwise
    n_shfl = sass.count("SHFL.IDX")
    assert (n_shfl >= copies * tm // 2) == kernel.stats_shuffle, f"{n_shfl} SHFL.IDX"

    # (b) dQ, no fp32 atomics anywhere (varlen too: see the writer's comment on partial tiles). By default
    #     (dq_frag, all but causal deterministic d = 128) one bulk reduce (UBLKRED) per warpgroup share;
    #     otherwise one TMA tensor reduce-add per tile from the swizzled sdQ (one instruction per 128-byte
    #     swizzle span of the d / 2 columns a consumer owns: 6 at 96, 4 at 128; 8 32-byte spans at d = 64)
    assert kernel.dq_frag == (not (causal and det and tm == 80))
    assert not re.search(r"\bREDG?\.E\.ADD\.F32", sass), "fp32 atomics left in the kernel"
    if kernel.dq_frag:
        assert re.search(r"\bUBLKRED\b", sass) and not re.search(r"\bUTMAREDG\b", sass)
    else:
        assert re.search(r"cp\.reduce\.async\.bulk\.tensor\.\dd\.global\.shared::cta\.add\.tile\.bulk_group", ptx), \
            "no TMA tensor reduce in PTX"
        # one copy per warpgroup share of the tile (its rows at d = 64, its d / 2 columns otherwise), in a loop
        share_cols = d if kernel.dq_split_m else d // 2
        spans = share_cols // (32 if share_cols % 32 == 0 else 16)
        n_red = len(re.findall(r"\bUTMAREDG\b", sass))
        assert n_red >= spans, f"{n_red} UTMAREDG for {spans} spans"  # ptxas may peel or duplicate the loop
        assert not re.search(r"\bUBLKRED\b", sass), "row-wise bulk reduces left"
    # dQ hand-off: both consumer warpgroups arrive on "full" (288 threads with the writer); the writer
    # arrives on "empty" per warpgroup (160 threads); the producer loads the row statistics (one 1-D TMA
    # box each for lse2 and D per Q tile, the only 3-d tensor copies; Q / dO / K / V are 4-d), so no
    # warpgroup syncs its own 128 threads
    assert re.search(r"bar\.arrive\s+\S+, 288;", ptx)
    assert len(re.findall(r"bar\.arrive\s+\S+, 160;", ptx)) >= 2
    assert not re.search(r"bar\.sync\s+%r\d+, 128;", ptx)
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.3d\.shared::cta\.global", ptx)) >= 2

    # deterministic: the semaphore protocol (in the writer warp); otherwise first stores (dq_first_store):
    # the same acquire spin and release on the tiles' arrival counters, counted in by an acquire atomic
    first_store = mod.make_kernel(None, d, dv, causal, det, varlen=varlen, has_seqused_k=seqused).dq_first_store
    # (causal walks, and at d = 64 / 128 the rotated non-causal ones: options.rotation_pays)
    assert first_store == (not det and d != 96 and (causal or d in (64, 128)))
    has_sem = ("ld.global.acquire.gpu.b32" in ptx, "fence.acq_rel.gpu" in ptx,
               "red.relaxed.gpu.global.add.s32" in ptx)
    assert has_sem == (det or first_store,) * 3
    assert bool(re.search(r"atom\.global\.acquire(\.gpu)?\.add", ptx)) == first_store
    if det:
        assert re.search(r"\bREDG?\.E\.ADD\.S32\.STRONG\.GPU\b", sass), "no semaphore increment in SASS"
        assert s4._has_spin_loop(sass), "no spin loop around the acquire load"
        # the adds must have landed (full wait, not .read) before the release
        assert re.search(r"cp\.async\.bulk\.wait_group\s+0;", ptx)
    # deterministic: one writer warp per dQ buffer; deterministic, causal or d <= 64: the launch index
    # mapped in sections of chains (the grid's extent is read only for that)
    assert kernel.dq_writers == (kernel.dq_buffers if det else 1)
    assert ("%nctaid.x" in ptx) == (det or causal or d <= 64)


# ================================================================================== gpu tier
SEQLENS = [(1, 1), (1, 3), (113, 203), (239, 1), (799, 3), (1024, 1024)]


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", HEAD_DIMS, ids=[f"d{d}x{dv}" for d, dv in HEAD_DIMS])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("sq,sk", SEQLENS, ids=[f"{a}x{b}" for a, b in SEQLENS])
def test_backward_matches_reference(d, dv, causal, sq, sk):
    b, hq, hkv = s4._heads(sq, sk, d)  # GQA 1 / 2 / 8 cycled over the cases
    s4._check_dense(STEP, b=b, sq=sq, sk=sk, hq=hq, hkv=hkv, d=d, dv=dv, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 2, 8])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_gqa_ratios(ratio, causal):
    s4._check_dense(STEP, b=2, sq=300, sk=517, hq=8, hkv=8 // ratio, d=128, dv=128, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("sq", [64, 80, 128, 192, 256, 320, 400])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dq_double_buffer_walk_lengths(sq, causal):
    """One CTA walks 1..5 Q tiles (one head, one K/V tile): the dQ buffers' first uses, the
    "empty" waits from the second (d = 128, one buffer) or third tile on, and the writer's last
    arrivals all get exercised."""
    s4._check_dense(STEP, b=1, sq=sq, sk=128, hq=1, hkv=1, d=128, dv=128, causal=causal)
    s4._check_dense(STEP, b=1, sq=sq, sk=128, hq=1, hkv=1, d=64, dv=64, causal=causal, deterministic=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp16(causal):
    s4._check_dense(STEP, b=2, sq=333, sk=1000, hq=4, hkv=2, d=128, dv=128, causal=causal, dtype="fp16")


@pytest.mark.gpu
def test_fully_masked_rows_and_scale_and_strides():
    """causal with Sq > Sk (rows without a visible key: zero dq), a non-default scale, q/k/v as
    strided views of a packed qkv buffer."""
    import torch

    b, s, h, d = 2, 300, 4, 64
    qkv = torch.randn(b, s, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(dim=2)
    do = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    s4._check_dense(STEP, b=b, sq=s, sk=s, hq=h, hkv=h, d=d, dv=d, causal=True, softmax_scale=0.3,
                    inputs=(q, k, v, do))
    q2, k2, v2, do2 = s4._inputs(2, 300, 70, 4, 4, 96, 96)
    dq, _, _ = s4._check_dense(STEP, b=2, sq=300, sk=70, hq=4, hkv=4, d=96, dv=96, causal=True,
                               inputs=(q2, k2, v2, do2))
    assert torch.all(dq[:, : 300 - 70] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seqused,deterministic", s4.VARLEN_CASES, ids=["all-keys", "seqused_k", "deterministic"])
def test_varlen_with_empty_sequences(causal, seqused, deterministic):
    # the ladder's varlen test body, run on this kernel (packed inputs, seqused_k, keys past it get zero grads)
    s4.test_varlen_with_empty_sequences(STEP, causal, seqused, deterministic)


DET_CASES = [(False, 1), (True, 1), (True, 4), (False, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("causal,ratio", DET_CASES, ids=[f"{'causal' if c else 'full'}-gqa{r}" for c, r in DET_CASES])
def test_deterministic_is_bitwise_reproducible(causal, ratio):
    import functools

    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref, grad_atol
    from stage4_bwd_kernel import host

    mod = _mod()
    q, k, v, do = s4._inputs(2, 1000, 1200, 8, 8 // ratio, 128, 128, seed=3)
    out, lse = attention_ref(q, k, v, causal=causal, upcast=True)
    first = [t.clone() for t in mod.attention_backward(q, k, v, out, do, lse, causal=causal, deterministic=True)]
    ref, base = host.reference_grads(q, k, v, do, causal=causal)
    for name, a, r, bl in zip(("dq", "dk", "dv"), first, ref, base):
        assert_fa4_close(name, a, r, bl, atol=grad_atol(ref))
    dq, dk, dv = s4._poisoned(q, k, v)
    for _ in range(50):
        for t in (dq, dk, dv):  # poisoned before every run: a row a run leaves unwritten cannot keep the last one's
            t.fill_(float("nan"))
        mod.attention_backward(q, k, v, out, do, lse, causal=causal, deterministic=True, dq=dq, dk=dk, dv=dv)
        assert torch.equal(dq, first[0]) and torch.equal(dk, first[1]) and torch.equal(dv, first[2])
    # the default mode: within the tolerance; on the deterministic mode's Q tiles in its order (q_shift off:
    # causal d = 128 counts them from the sequence's end by default; rotate_walk off: non-causal walks start
    # at spread tiles by default), dk / dv bitwise equal (no cross-CTA sums)
    nd = mod.attention_backward(q, k, v, out, do, lse, causal=causal, deterministic=False)
    for name, a, r, bl in zip(("dq", "dk", "dv"), nd, ref, base):
        assert_fa4_close(f"{name} (default)", a, r, bl, atol=grad_atol(ref))
    same_tiles = host.backward(mod.STEP + "~q_shift=0~rotate_walk=0",
                               functools.partial(mod.make_kernel, q_shift=False, rotate_walk=False), q, k, v,
                               out, do, lse, causal=causal)
    assert torch.equal(same_tiles[1], first[1]) and torch.equal(same_tiles[2], first[2])


@pytest.mark.gpu
@pytest.mark.parametrize("d,sq,sk,ratio", [(64, 700, 517, 2), (128, 333, 1000, 8), (64, 128, 128, 1),
                                           (96, 251, 389, 2)],
                         ids=["d64", "d128", "d64-one-tile", "d96"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_launch_order_and_dq_layout_change_no_bit(d, sq, sk, ratio, causal):
    """The launch in sections of chains and the fragment-order dQ accumulator only move work: in
    deterministic mode the default kernel gives the bits of one launched in blockIdx order with the TMA
    tensor reduce (the same fp32 adds in the same order), and both pass the rule."""
    import functools

    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref, grad_atol
    from stage4_bwd_kernel import host, schedule

    mod = _mod()
    q, k, v, do = s4._inputs(2, sq, sk, 8, 8 // ratio, d, d, seed=5)
    out, lse = attention_ref(q, k, v, causal=causal, upcast=True)
    grads = {}
    plain_order = schedule.default_dq_order(causal, True, sections=False)
    for name, options, order in (("plain", {"dq_frag": False}, plain_order), ("default", {}, None)):
        make_kernel = functools.partial(mod.make_kernel, **options)
        key = mod.STEP + "".join(f"~{o}={int(v)}" for o, v in sorted(options.items()))
        dq, dk, dv = s4._poisoned(q, k, v)
        host.backward(key, make_kernel, q, k, v, out, do, lse, causal=causal, deterministic=True, dq=dq, dk=dk, dv=dv,
                      dq_order=order)
        grads[name] = (dq, dk, dv)
    ref, base = host.reference_grads(q, k, v, do, causal=causal)
    for grads_of in grads.values():
        for name, a, r, bl in zip(("dq", "dk", "dv"), grads_of, ref, base):
            assert_fa4_close(name, a, r, bl, atol=grad_atol(ref))
    for a, b in zip(grads["plain"], grads["default"]):
        assert torch.equal(a, b)


def _option_case(d, sq, sk, ratio, causal, seed):
    """Inputs, the forward's out / lse and both sides of the rule for an option-against-option test."""
    from stage0_reference.torch_reference import attention_ref
    from stage4_bwd_kernel import host

    q, k, v, do = s4._inputs(2, sq, sk, 8, 8 // ratio, d, d, seed=seed)
    out, lse = attention_ref(q, k, v, causal=causal, upcast=True)
    return (q, k, v, out, do, lse), host.reference_grads(q, k, v, do, causal=causal)


def _run_with_option(case, option, value, *, causal, deterministic=False):
    """The kernel built with one option overridden (under its own compile key) on poisoned outputs;
    dq, dk and dv must pass the rule. Returns them."""
    return _run_with_options(case, {option: value}, causal=causal, deterministic=deterministic)


def _run_with_options(case, options: dict, *, causal, deterministic=False):
    """_run_with_option with several options overridden at once."""
    import functools

    from stage0_reference.torch_reference import assert_fa4_close, grad_atol
    from stage4_bwd_kernel import host

    mod = _mod()
    (q, k, v, out, do, lse), (ref, base) = case
    dq, dk, dv = s4._poisoned(q, k, v)
    key = mod.STEP + "".join(f"~{name}={int(value)}" for name, value in sorted(options.items()))
    host.backward(key, functools.partial(mod.make_kernel, **options),
                  q, k, v, out, do, lse, causal=causal, deterministic=deterministic, dq=dq, dk=dk, dv=dv)
    for name, a, r, bl in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, base):
        assert_fa4_close(f"{name} ({options}, deterministic={deterministic})", a, r, bl, atol=grad_atol(ref))
    return dq, dk, dv


MASK_CASES = [(64, True, 700, 517, 2), (64, True, 113, 203, 1), (64, False, 799, 3, 1), (96, True, 251, 389, 2),
              (128, True, 333, 1000, 8), (128, True, 1, 1, 1), (128, False, 203, 113, 2)]


KV_FIRST_CASES = [(64, True, 700, 517, 2), (64, False, 799, 3, 1), (128, True, 333, 1000, 8), (96, False, 1, 1, 1)]
# options that move work but must mask, load and add exactly as before: (option, case, seed)
SAME_BITS = ([("mask_offsets", case, 17) for case in MASK_CASES] +
             [("kv_with_first", case, 23) for case in KV_FIRST_CASES])


@pytest.mark.gpu
@pytest.mark.parametrize("option,case,seed", SAME_BITS,
                         ids=[f"{o}-d{d}-{'causal' if c else 'full'}-{a}x{b}-gqa{r}" for o, (d, c, a, b, r), _ in SAME_BITS])
def test_option_changes_no_bit(option, case, seed):
    """mask_offsets masks exactly the scores the default test masks; kv_with_first only moves the K / V
    loads onto the first Q tile's barriers. In deterministic mode (a fixed dQ order) dq, dk and dv are
    the same bits with the option off and on, and both pass the rule."""
    import torch

    d, causal, sq, sk, ratio = case
    inputs = _option_case(d, sq, sk, ratio, causal, seed=seed)
    without, with_option = (_run_with_option(inputs, option, value, causal=causal, deterministic=True)
                            for value in (False, True))
    for a, b in zip(without, with_option):
        assert torch.equal(a, b)


Q_SHIFT_CASES = [(113, 203, 1), (203, 113, 2), (1000, 1200, 4), (1200, 1000, 8), (1, 1, 1), (4096, 4096, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("sq,sk,ratio", Q_SHIFT_CASES, ids=[f"{a}x{b}-gqa{r}" for a, b, r in Q_SHIFT_CASES])
def test_q_shift_either_way(sq, sk, ratio):
    """Causal d = 128 with the Q tiles counted from either end (q_shift: the padding rows are loaded past
    the tensor's start as zeros, and the postprocess skips them, rows poisoned before): both pass the rule."""
    case = _option_case(128, sq, sk, ratio, True, seed=13)
    for shift in (True, False):
        _run_with_option(case, "q_shift", shift, causal=True)


FRAG_CASES = [(128, False, 113, 203, 1), (96, False, 251, 389, 2), (64, True, 700, 517, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal,sq,sk,ratio", FRAG_CASES,
                         ids=[f"d{d}-{'causal' if c else 'full'}-{a}x{b}" for d, c, a, b, _ in FRAG_CASES])
def test_dq_frag_either_way(d, causal, sq, sk, ratio):
    """The fragment-order dQ accumulator (dq_frag, postprocess_frag; 80-, 64- and 128-row tiles, a partial
    last Q tile) passes the rule in both modes, and in deterministic mode gives the bits of the TMA tensor
    reduce (the same fp32 adds in the same order, only the layout of dQaccum differs)."""
    import torch

    case = _option_case(d, sq, sk, ratio, causal, seed=11)
    _run_with_option(case, "dq_frag", True, causal=causal)
    det_grads = [_run_with_option(case, "dq_frag", frag, causal=causal, deterministic=True) for frag in (True, False)]
    for a, b in zip(*det_grads):
        assert torch.equal(a, b)


# half tiles over one dS^T buffer (no default build has both): the idle warpgroup still takes the
# "sdSt free" barriers the full body takes. (d, sq, sk, GQA ratio), causal
ONE_DS_BUFFER_CASES = [(128, 333, 1000, 4), (128, 700, 517, 2), (96, 251, 389, 2), (96, 1, 1, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("d,sq,sk,ratio", ONE_DS_BUFFER_CASES,
                         ids=[f"d{d}-{a}x{b}-gqa{r}" for d, a, b, r in ONE_DS_BUFFER_CASES])
def test_half_tiles_with_one_ds_buffer(d, sq, sk, ratio):
    """Causal walks on one dS^T buffer with half tiles pass the rule in both modes, and in deterministic
    mode give the bits of the same build without half tiles (an idle warpgroup's keys add exact zeros
    there)."""
    import torch

    case = _option_case(d, sq, sk, ratio, True, seed=29)
    _run_with_options(case, {"ds_buffers": 1, "half_tiles": True}, causal=True)
    det_grads = [_run_with_options(case, {"ds_buffers": 1, "half_tiles": half}, causal=True, deterministic=True)
                 for half in (True, False)]
    for a, b in zip(*det_grads):
        assert torch.equal(a, b)


@pytest.mark.compile
@pytest.mark.parametrize("d", [96])
def test_half_tiles_with_one_ds_buffer_compile(d):
    """The one-buffer half-tile build: no spills, no serialized wgmma, an idle body at the causal edge.
    (d = 128 on one dS^T buffer serializes its wgmmas, C7512, with half tiles or without.)"""
    mod = _mod()
    rep = mod.compile_only(head_dim=d, causal=True, ds_buffers=1, half_tiles=True).report
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["wgmma_serialized"] == [], rep
    kernel = mod.make_kernel(None, d, d, True, False, ds_buffers=1, half_tiles=True)
    assert kernel.ds_buffers == 1 and half_tile_ends(kernel) == 1


FRAG_COMPILE_CASES = [(64, False, False, False), (64, False, True, True), (128, False, False, False),
                      (96, True, True, False)]


@pytest.mark.compile
@pytest.mark.parametrize("d,causal,det,varlen", FRAG_COMPILE_CASES,
                         ids=[f"d{d}-{'causal' if c else 'full'}-{'det' if t else 'atomic'}{'-varlen' if v else ''}"
                              for d, c, t, v in FRAG_COMPILE_CASES])
def test_dq_frag_compiles(d, causal, det, varlen):
    """dq_frag: each warpgroup's share leaves as one 1-D bulk reduce (UBLKRED) of a contiguous
    fragment-order chunk, stored with 16-byte STS (conflict-free); no TMA tensor reduce, no spills,
    no serialized wgmma."""
    import functools

    from stage4_bwd_kernel import host

    mod = _mod()
    make_kernel = functools.partial(mod.make_kernel, dq_frag=True)
    comp = host.compile_fake(mod.STEP + "~dq_frag=1", make_kernel, dtype="bf16", head_dim=d, head_dim_v=d,
                             causal=causal, deterministic=det, varlen=varlen)
    rep, sass, ptx = comp.report, comp.sass, comp.ptx
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["wgmma_serialized"] == []
    assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx
    assert re.search(r"\bUBLKRED\b", sass) and not re.search(r"\bUTMAREDG\b", sass)
    kernel = make_kernel(None, d, d, causal, det, varlen=varlen)
    assert len(re.findall(r"\bSTS\.128\b", sass)) >= BODY_COPIES * (kernel.dq_frag_share_elems() // 512)
    if det:  # the adds must have landed before the release
        assert re.search(r"cp\.async\.bulk\.wait_group\s+0;", ptx)


@pytest.mark.compile
@pytest.mark.parametrize("d,varlen", [(64, False), (96, True), (128, False)], ids=["d64", "d96-varlen", "d128"])
def test_postprocess_frag_compiles(d, varlen):
    """The fragment-order postprocess: 16-byte loads of the fragment order, 16-byte row stores of dq,
    no spills, one thread per consumer thread of the main kernel."""
    from stage4_bwd_kernel import common, postprocess_frag

    kernel = _mod().make_kernel(common.cutlass_dtype("bf16"), d, d, False, False, varlen=varlen, dq_frag=True)
    comp = postprocess_frag.compile_only(kernel, varlen=varlen)
    rep, sass = comp.report, comp.sass
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["threads"] == postprocess_frag.NUM_THREADS
    chunks = kernel.dq_frag_share_elems() // 512
    assert len(re.findall(r"\bLDG\.E\.128\b", sass)) == chunks, "fragment loads not 16 bytes wide"
    assert re.search(r"\bSTG\.E\.128\b", sass) and not re.search(r"\bSTG\.E(\.64)?\s", sass)
    # the 16-byte row stores cover the tile exactly: a pass never reads SMEM rows past it (an 80-row tile
    # once read 16 rows past its end, an illegal address on the H100)
    tpr = postprocess_frag.store_threads_per_row(kernel.tile_m, d, 8)
    assert kernel.tile_m % (postprocess_frag.NUM_THREADS // tpr) == 0 and d % (tpr * 8) == 0


@pytest.mark.gpu
def test_chain_with_stage3_forward():
    s4._check_dense(STEP, b=2, sq=517, sk=300, hq=8, hkv=2, d=128, dv=128, causal=True, forward="stage3")


@pytest.mark.gpu
def test_run_entry_point_times_both_modes():
    res = _mod().run(batch=1, seqlen_q=1024, heads=4, head_dim=128, causal=True, check=True)
    assert res["mode"] == "gpu" and res["tflops"] > 0 and res["ms_deterministic"] > 0
