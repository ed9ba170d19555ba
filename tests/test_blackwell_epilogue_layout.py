"""Stage 3, Blackwell (sm_100a): the forward's O epilogue -- TMEM -> registers -> sO (swizzled) ->
global O by TMA boxes or varlen 16-byte stores, and the lse rows -- checked element by element at
trace time (stage3_fwd_kernel/blackwell_epilogue_check.py). No Blackwell GPU exists in this project:
these tests read layouts and PTX, they run nothing.

cpu tier: the swizzle functions (CuTe's Swizzle<B, 4, 3> on bytes against our reading of the TMA's
32 / 64 / 128B modes), the TMA atom's type parsing and the tcgen05 32x32b reading on hand values.

compile tier: for d = 64, 96, 128, (128, 64) and (192, 128), dense and varlen, every element of both O tiles
reaches its own place and every lse its own row, by CuTe's layouts and by the instruction-level
readings alike. The check found a fault at dv = 96 varlen (a lane's 24 contiguous columns crossed
sO's 32-column swizzle blocks; the kernel now stores one 16-byte vector per lane per 32 columns):
the old copy, rebuilt here, still shows it. Wrong mappings (transposed store, the other swizzle, guard
one row off) and wrong kernels (chunk shifted, guard or tile row off) are caught; the compiled PTX's
TMA stores and st.shared bytes are the ones the trace and the byte-swizzle model predict.
~1 min on 2 cores.
"""
from __future__ import annotations

import functools
import re

import pytest

CASES = [(64, 64), (96, 96), (128, 128), (128, 64), (192, 128)]


@functools.lru_cache(maxsize=None)
def _traced(d: int, dv: int, varlen: bool):
    from stage3_fwd_kernel import blackwell_epilogue_check as check
    from stage3_fwd_kernel import blackwell_fwd as bw

    cfg = bw.make_config("bf16", d, dv, False)
    return cfg, check.trace(bw.FlashAttentionForwardSm100(cfg, varlen=varlen))


# ---------------------------------------------------------------------------------------- cpu tier
@pytest.mark.cpu
@pytest.mark.stage3
def test_swizzles_and_atom_parsing():
    from stage3_fwd_kernel.blackwell_epilogue_check import parse_swizzle, parse_tma_atom, swizzle, tma_swizzle

    # 128B: row 1 of a 128-byte-row tile (byte 128) has its 16-byte chunks swapped by 1
    assert swizzle((3, 4, 3), 128) == 144 and swizzle((3, 4, 3), 2 * 579) == 1174
    for b, span in ((1, 32), (2, 64), (3, 128)):
        assert all(swizzle((b, 4, 3), x) == tma_swizzle(span, x) for x in range(1 << 14))
    assert parse_swizzle("S<2,4,3>") == (2, 4, 3)
    atom = parse_tma_atom('!cute_nvgpu.atom.non_exec_tiled_tma_store<bf16, copy_bits = 131072, tma_gbasis = '
                          '<"(64,128,1,1):(1@1,1@0,1@2,1@3)">, tma_format = BF16_RN>')
    assert atom == {"copy_bytes": 16384, "box": [(64, 1), (128, 0)]}


@pytest.mark.cpu
@pytest.mark.stage3
def test_tcgen05_32x32b_reading():
    """Thread 37 (warp 1) loading 32 columns of O_0 (column 256): the instruction gets lane 32,
    register v is lane 37, column 256 + v; the same registers claimed by thread 36 are all wrong."""
    from stage3_fwd_kernel.blackwell_epilogue_check import _t32x32b_disagreements
    from stage3_fwd_kernel.blackwell_tmem_check import StaticTensor

    inst = StaticTensor(32 << 16 | 256, (((32, 1), (32, 1 << 16), (1, 0)), ((1, 0),), ((1, 0),)))
    regs = StaticTensor(37 << 16 | 256, (((32, 1), (1, 0)), ((1, 0),), ((1, 0),)))
    assert _t32x32b_disagreements(inst, regs, 37) == 0
    assert _t32x32b_disagreements(inst, regs, 36) == 32


# ---------------------------------------------------------------------------------------- compile tier
@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("d, dv, varlen", [(d, dv, v) for d, dv in CASES for v in (False, True)])
def test_o_and_lse_reach_their_places(d, dv, varlen):
    from stage3_fwd_kernel.blackwell_epilogue_check import report

    cfg, traced = _traced(d, dv, varlen)
    assert traced["swizzle"] == ((2, 4, 3) if dv == 96 else (3, 4, 3))
    if not varlen:  # one box per 64 (dv = 96: 32) columns
        assert traced["tma_atom"]["box"] == [(32 if dv == 96 else 64, 1), (128, 0)]
    rep = report(traced)
    assert sorted(rep) == ["O_0", "O_1", "lse_0", "lse_1"]
    for i in range(2):
        o, lse = rep[f"O_{i}"], rep[f"lse_{i}"]
        assert o["elements"] == cfg.tile_m * dv and lse["rows"] == cfg.tile_m
        models = {k: v for k, v in o.items() if k.endswith("disagree") or k == "evaluator_vs_dsl"}
        assert set(models.values()) == {0}, models
        assert lse["stats_models_disagree"] == 0 and lse["mismatches"] == 0, lse
        assert o["not_stored"] == o["stored_twice"] == o["read_unwritten"] == o["store_partition_vs_sO"] == 0, o
        assert o.get("guard_mismatches", 0) == 0, o
        assert o["mismatches"] == o["read_partition_vs_sO"] == 0, o


@pytest.mark.compile
@pytest.mark.stage3
def test_varlen_dv96_fault_is_caught_and_fixed():
    """The fault the check found at dv = 96 varlen, rebuilt: lanes 1-3 of a row storing 24 contiguous
    columns each, as if sO's columns were contiguous -- but sO keeps them in 32-column swizzle blocks
    4096 elements apart, so 64 of 96 columns a row came from elsewhere (the DSL composed the
    non-divisible layout without a word). The kernel's copy (one 16-byte vector per lane and 32
    columns) puts every element right."""
    import cutlass.cute as cute

    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel.blackwell_epilogue_check import epilogue_mismatches, report, trace

    _, traced = _traced(96, 96, True)
    assert epilogue_mismatches(None, traced=traced) == {"O_0": 0, "lse_0": 0, "O_1": 0, "lse_1": 0,
                                                       "guard_0": 0, "guard_1": 0}
    assert report(traced)["O_0"]["vector_models_disagree"] == 0

    class ContiguousColumnsPerLane(bw.FlashAttentionForwardSm100):
        def varlen_o_copy(self):
            tpr = self.varlen_store_threads_per_row
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
            thr_layout = cute.make_ordered_layout((32 // tpr, tpr), order=(1, 0))
            return cute.make_tiled_copy_tv(atom, thr_layout, cute.make_layout((1, self.dv // tpr)))

    old = report(trace(ContiguousColumnsPerLane(bw.make_config("bf16", 96, 96, False), varlen=True)))
    assert [old[f"O_{i}"]["mismatches"] for i in range(2)] == [8192, 8192]
    assert [old[f"O_{i}"]["read_partition_vs_sO"] for i in range(2)] == [8192, 8192]


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("d, varlen", [(128, False), (128, True), (96, False)])
def test_wrong_mappings_are_caught(d, varlen):
    """Negative controls on the traced maps: the store transposed (only the diagonal survives; with
    dv < 128 rows past dv are lost too), the other swizzle width (128B <-> 64B: the bytes where both
    agree survive), the varlen guard one row late (each element's row mis-guarded for one length)."""
    from stage3_fwd_kernel.blackwell_epilogue_check import WRONG, epilogue_mismatches

    _, traced = _traced(d, d, varlen)
    n = 128 * d
    want = {"transpose": n - d, "swizzle": n // 2}
    for w in WRONG:
        if w == "guard_row":
            if varlen:
                got = epilogue_mismatches(None, w, traced)
                assert (got["guard_0"], got["guard_1"], got["O_0"], got["lse_0"]) == (n, n, 0, 0), got
            continue
        got = epilogue_mismatches(None, w, traced)
        assert (got["O_0"], got["O_1"], got["lse_0"], got["lse_1"]) == (want[w], want[w], 0, 0), (w, got)


@pytest.mark.compile
@pytest.mark.stage3
def test_wrong_kernels_are_caught():
    """Mistakes made in the kernel's own methods, seen through the trace (d = 128, varlen): each O
    chunk stored into the next chunk's columns; the guard reading one row late; every tile's first
    row off by one (the lse rows move, and so do the guard's)."""
    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel.blackwell_epilogue_check import epilogue_mismatches

    class ShiftedChunk(bw.FlashAttentionForwardSm100):
        def o_epilogue_chunk(self, thr_ld_o, tOtO_c, sO_i, c):
            tO, src, _ = super().o_epilogue_chunk(thr_ld_o, tOtO_c, sO_i, c)
            nxt = (c + 1) % (self.dv // self.O_CHUNK_COLS)
            return tO, src, super().o_epilogue_chunk(thr_ld_o, tOtO_c, sO_i, nxt)[2]

    class GuardLate(bw.FlashAttentionForwardSm100):
        def varlen_guard_row(self, tOcO, m):
            return super().varlen_guard_row(tOcO, m) + 1

    class RowOff(bw.FlashAttentionForwardSm100):
        def o_tile_row0(self, m_block, i):
            return super().o_tile_row0(m_block, i) + 1

    cfg = bw.make_config("bf16", 128, 128, False)
    n = 128 * 128
    got = {k: epilogue_mismatches(cls(cfg, varlen=True)) for k, cls in
           (("chunk", ShiftedChunk), ("guard", GuardLate), ("row", RowOff))}
    assert got["chunk"] == {"O_0": n, "lse_0": 0, "O_1": n, "lse_1": 0, "guard_0": 0, "guard_1": 0}, got
    assert got["guard"] == {"O_0": 0, "lse_0": 0, "O_1": 0, "lse_1": 0, "guard_0": n, "guard_1": n}, got
    assert got["row"] == {"O_0": 0, "lse_0": 128, "O_1": 0, "lse_1": 128, "guard_0": n, "guard_1": n}, got


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("d", [96, 128])
def test_ptx_tma_stores_are_the_traced_boxes(d):
    """Each TMA store of the compiled dense kernel gets the sO offset, column and row the traced
    boxes have (d = 128: 2 boxes of 64 columns a tile; 96: 3 of 32); an edited PTX is told apart."""
    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel.blackwell_epilogue_check import expected_tma_stores, ptx_tma_stores

    cfg, traced = _traced(d, d, False)
    want = expected_tma_stores(traced)
    ptx = bw.compile_config(cfg).ptx
    got = ptx_tma_stores(ptx)
    assert len(got) == 2 * d // (32 if d == 96 else 64)
    assert sorted(got) == sorted(want), (got, want)
    col = re.search(r"cp\.async\.bulk\.tensor\.4d\.global\.shared::cta\S*\s+\[%rd\d+,\s*\{(%r\d+)", ptx).group(1)
    edited = re.sub(rf"(mov\.b32\s+{re.escape(col)},\s*)(\d+);", lambda m: f"{m[1]}{int(m[2]) + 8};", ptx)
    assert sorted(ptx_tma_stores(edited)) != sorted(want)


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("d", [96, 128])
def test_pointer_swizzle_acts_on_bytes(d):
    """The check's model of sO: the byte an element lands on is the swizzle of 2 x its offset. A small
    compiled kernel writing through the kernel's sO layout agrees at every probed element, where
    the swizzle read in element units would not (it would move (9, 3) elsewhere)."""
    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel.blackwell_epilogue_check import ELEM_BYTES, ptx_pointer_swizzle, swizzle

    kernel = bw.FlashAttentionForwardSm100(bw.make_config("bf16", d, d, False))
    got = ptx_pointer_swizzle(kernel)
    assert len(got) == 5 and all(ptx == model for ptx, model in got.values()), got
    _, traced = _traced(d, d, False)
    offset = traced["sO_outer"].at_modes((9, 3, 0))
    assert ELEM_BYTES * swizzle(traced["swizzle"], offset) != got[(9, 3)][0]
