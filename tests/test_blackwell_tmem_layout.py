"""Stage 3, Blackwell (sm_100a): the softmax's P store into TMEM against the TS MMA's A operand, checked
element by element at trace time (stage3_fwd_kernel/blackwell_tmem_check.py). No Blackwell GPU exists in
this project: these tests read layouts and PTX, they run nothing.

cpu tier: the Python evaluator of static CuTe layouts on hand-computed values.

compile tier: for d = 64, 96, 128 (bf16) every element of P_0 and P_1 is stored by the softmax exactly
at the (lane, column, half) the O += P V MMA reads it from, by CuTe's layouts and by the PTX-ISA
reading of tcgen05.st 32x32b / tcgen05.mma M = 128 alike; wrong stores (transposed, one column over,
halves swapped) and two wrong kernels (P view one K-step over, S loaded with a 16x256b atom) are
caught; the A columns the compiled PTX hands each TS MMA are the traced ones. ~30 s on 2 cores.
"""
from __future__ import annotations

import functools
import re

import pytest


@functools.lru_cache(maxsize=None)
def _traced(d: int):
    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel import blackwell_tmem_check as check

    cfg = bw.make_config("bf16", d, d, False)
    return cfg, check.trace(bw.FlashAttentionForwardSm100(cfg))


# ---------------------------------------------------------------------------------------- cpu tier
@pytest.mark.cpu
@pytest.mark.stage3
def test_static_evaluator_follows_cute_semantics():
    """The TS operand fragment of d = 128 as this CuTe-DSL builds it, ((128,16),1,(4,2)) :
    ((131072,1),0,(16,64)) in 16-bit elements, and the coordinates partition_A gives it: element
    (m, kk) of K-step kb is A[m, 16 kb + kk], at lane m, 16-bit column 16 kb + kk."""
    from stage3_fwd_kernel.blackwell_tmem_check import StaticTensor, decode_address

    frag = StaticTensor(0, (((128, 131072), (16, 1)), ((1, 0),), ((4, 16), (2, 64))))
    coords = StaticTensor((0, 0), (((128, (1, 0)), (16, (1, 1))), ((1, 0),), ((8, (16, 1)),)))
    assert frag.mode_sizes == coords.mode_sizes == (2048, 1, 8)
    for m, kk, kb in ((0, 0, 0), (5, 3, 5), (127, 15, 7), (64, 8, 4)):
        j = m + 128 * kk + 2048 * kb
        assert coords[j] == (m, 16 * kb + kk)
        e = frag[j]
        assert e == frag.at_modes((m + 128 * kk, 0, kb)) == 131072 * m + 16 * kb + kk
        assert decode_address(e >> 1) == (m, (16 * kb + kk) // 2) and e & 1 == kk % 2


# ---------------------------------------------------------------------------------------- compile tier
@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("d", [64, 96, 128])
def test_p_stored_where_the_pv_mma_reads_it(d):
    from stage3_fwd_kernel.blackwell_tmem_check import WRONG, p_tmem_mismatches, report

    cfg, traced = _traced(d)
    rep = report(traced)
    assert sorted(rep) == ["P_0", "P_1"]
    for i, r in enumerate(rep[f"P_{i}"] for i in range(2)):
        assert r["elements"] == cfg.tile_m * cfg.tile_n == 128 * 128
        assert r["mismatches"] == r["not_stored"] == r["stored_twice"] == 0, r
        assert r["store_models_disagree"] == r["read_models_disagree"] == r["evaluator_vs_dsl"] == 0, r
        # P_i: 64 columns over the upper half of S_i; 8 K-steps of 16 values = 8 columns each
        assert r["a_start_columns"] == [cfg.tmem.p[i] + 8 * kb for kb in range(cfg.pv_k_blocks)]
    assert cfg.tmem.p == (64, 192)
    # negative controls: the diagonal survives a transpose, nothing else survives anything
    wrong = {w: p_tmem_mismatches(None, w, traced) for w in WRONG}
    assert wrong == {"transpose": {"P_0": 128 * 127, "P_1": 128 * 127},
                     "shift_column": {"P_0": 128 * 128, "P_1": 128 * 128},
                     "swap_halves": {"P_0": 128 * 128, "P_1": 128 * 128}}, wrong


@pytest.mark.compile
@pytest.mark.stage3
def test_wrong_kernels_are_caught():
    """Mistakes made in the kernel's own builders, seen through the trace: P's view one K-step (8
    columns) to the right, and S loaded with tcgen05.ld 16x256b (a thread no longer holds one row)."""
    import cutlass.cute as cute
    from cutlass import Float32
    from cutlass.cute.nvgpu import tcgen05

    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel.blackwell_tmem_check import p_tmem_mismatches

    class ShiftedP(bw.FlashAttentionForwardSm100):
        def s_p_tmem_views(self, tmem_base, stage, thr_mma_qk):
            tStS, tScS, tStP, tScP = super().s_p_tmem_views(tmem_base, stage, thr_mma_qk)
            return tStS, tScS, cute.make_tensor(tStP.iterator + 8, tStP.layout), tScP

    class Load16x256b(bw.FlashAttentionForwardSm100):
        def s_load_atom(self):
            return cute.make_copy_atom(tcgen05.copy.Ld16x256bOp(tcgen05.copy.Repetition(8)), Float32)

    cfg = bw.make_config("bf16", 128, 128, False)
    assert p_tmem_mismatches(ShiftedP(cfg)) == {"P_0": 128 * 128, "P_1": 128 * 128}
    wrong = p_tmem_mismatches(Load16x256b(cfg))
    assert all(n > 128 * 120 for n in wrong.values()), wrong


@pytest.mark.compile
@pytest.mark.stage3
@pytest.mark.parametrize("d", [64, 96, 128])
def test_ptx_a_columns_are_the_traced_ones(d):
    """Each TS tcgen05.mma of the compiled kernel (main loop and tail, 2 tiles x 8 K-steps each) gets
    A at the S_0 base + the column the traced fragment has; an edited PTX is told apart."""
    from stage3_fwd_kernel import blackwell_fwd as bw
    from stage3_fwd_kernel.blackwell_tmem_check import expected_pv_a_columns, ptx_pv_a_columns, report

    cfg, traced = _traced(d)
    want = expected_pv_a_columns(report(traced))
    ptx = bw.compile_config(cfg).ptx
    got = ptx_pv_a_columns(ptx)
    assert len(got) == 2 * 2 * cfg.pv_k_blocks
    assert sorted(got) == sorted(want * 2), (got, want)
    # the parser is not vacuous: move one A operand by a column
    ts_a = re.search(r"kind::f16\S*\s+\[%r\d+\],\s*\[(%r\d+)\]", ptx).group(1)
    edited = re.sub(rf"(add\.s32\s+{re.escape(ts_a)},\s*%r\d+,\s*)(\d+);", lambda m: f"{m[1]}{int(m[2]) + 1};", ptx)
    assert sorted(ptx_pv_a_columns(edited)) != sorted(want * 2)
