"""Stage 4, Blackwell 1-CTA backward, varlen: compiled for sm_100a and checked structurally, never run.

No Blackwell GPU is reachable. What these tests pin down without one: the packed builds compile with
no local-memory spills and take the cu_seqlens (+ seqused_k) arguments; the dense builds keep their
PTX shape; the barrier-protocol checker extracts the varlen role programs (the same operations as the
dense ones) and finds no deadlock, including the empty walk of a tile past its sequence's keys; and the
dK / dV epilogue, evaluated element by element at trace time through the kernel's own store helpers,
writes every row of each sequence exactly once and nothing outside it (negative controls: the
unpredicated store and the dense row mapping are caught).
"""
from __future__ import annotations

import re
from collections import Counter

import pytest

pytestmark = [pytest.mark.compile, pytest.mark.stage4]

# Dense PTX, pinned (bf16 d = 64, default mode): the varlen work must not change the dense kernel.
# sha256 of the whole PTX matched before / after the varlen change for all 16 dense builds (1-CTA
# and 2-CTA, d = 64 / 128, causal or not, deterministic or not; docs/measurements.md, 2026-11-29);
# these counts are the part of it that survives an unrelated CuTe-DSL upgrade.
DENSE_D64 = {False: dict(params=25, red=32), True: dict(params=25, red=32)}


def _bwd():
    from stage4_bwd_kernel import blackwell_bwd  # first: the package sets CUTE_DSL_ARCH before cutlass loads

    return blackwell_bwd


def _entry_params(ptx: str) -> int:
    return re.search(r"\.entry\s+\S+\(([^)]*)\)", ptx, re.S).group(1).count(".param")


# ------------------------------------------------------------------------------------ compile
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_varlen_builds_compile_without_spills(d, causal):
    bb = _bwd()
    rep = bb.compile_only("bf16", d, causal=causal, varlen=True).report
    dense = bb.compile_only("bf16", d, causal=causal).report
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["LDL/STL"] == 0, rep
    assert rep["registers"] and rep["registers"] <= bb.make_config("bf16", d, None, causal).regs.launch_cap, rep
    # the same MMAs, TMEM traffic and reduce-adds as the dense build: varlen only moves rows
    for k in ("UTCHMMA.SS", "UTCHMMA.TS", "LDTM", "STTM", "RED", "smem_bytes"):
        assert rep[k] == dense[k], (k, rep[k], dense[k])


@pytest.mark.parametrize("det", [False, True], ids=["default", "deterministic"])
def test_varlen_build_takes_cu_seqlens(det):
    bb = _bwd()
    dense = bb.compile_only("bf16", 64, causal=True, deterministic=det)
    varlen = bb.compile_only("bf16", 64, causal=True, deterministic=det, varlen=True)
    used = bb.compile_only("bf16", 64, causal=True, deterministic=det, varlen=True, has_seqused_k=True)
    n_dense, n_varlen, n_used = (_entry_params(c.ptx) for c in (dense, varlen, used))
    assert n_varlen == n_dense + 2 and n_used == n_dense + 3, (n_dense, n_varlen, n_used)
    assert re.search(r"^\.target\s+sm_100a", varlen.ptx, re.M)
    assert used.report["spill_stores"] == 0 and used.report["LDL/STL"] == 0, used.report
    if det:  # the semaphore protocol is kept per (sequence, head, Q tile)
        assert varlen.report["ptx_ld_acquire"] == dense.report["ptx_ld_acquire"] > 0


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_dense_ptx_keeps_its_shape(causal):
    """The dense build: no cu_seqlens parameters, its reduce-adds as pinned (DENSE_D64)."""
    c = _bwd().compile_only("bf16", 64, causal=causal)
    pinned = DENSE_D64[causal]
    assert _entry_params(c.ptx) == pinned["params"]
    assert c.report["ptx_red_v2"] == pinned["red"]


# ------------------------------------------------------------------------------------ refusals
def test_refusals_name_the_argument():
    import cutlass

    from stage4_bwd_kernel import blackwell, blackwell_bwd_2cta, schedule

    bb = _bwd()
    with pytest.raises(ValueError, match=r"^seqused_k"):
        bb.make_kernel(cutlass.BFloat16, 128, 128, False, False, varlen=False, has_seqused_k=True)
    with pytest.raises(ValueError, match=r"^seqused_k"):
        blackwell.compile_only("bf16", 128, has_seqused_k=True)
    with pytest.raises(ValueError, match=r"varlen"):        # the 2-CTA kernel stays dense
        blackwell_bwd_2cta.make_kernel(cutlass.BFloat16, 128, 128, False, False, varlen=True)

    class LaunchIndexOnly:                                   # maps the whole launch index, no base
        name = "spt"

        @staticmethod
        def tile_for_launch():
            raise AssertionError

    with pytest.raises(ValueError, match=r"^dq_order"):
        bb.blockidx_order(LaunchIndexOnly)
    # host.backward's sectioned defaults run as their plain base (blockIdx), with the same ranks
    for causal in (False, True):
        for det in (False, True):
            order = schedule.default_dq_order(causal, det, head_dim=64)
            base = bb.blockidx_order(order)
            assert not hasattr(base, "tile_for_launch") and base.rank is order.rank, (order, base)
    k = bb.make_kernel(cutlass.BFloat16, 64, 64, True, True, varlen=True, has_seqused_k=True,
                       dq_order=schedule.default_dq_order(True, True))
    assert (k.varlen, k.has_seqused_k, k.dq_order.name) == (True, True, "kv_descending")


def test_public_varlen_entry_refuses_without_blackwell():
    import torch

    from stage4_bwd_kernel import blackwell

    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10:
        pytest.skip("a Blackwell GPU is present")
    with pytest.raises(RuntimeError, match=r"capability 10\.x"):
        blackwell.attention_varlen_backward(*([None] * 10))
    with pytest.raises(RuntimeError, match=r"capability-10\.x"):
        _bwd().attention_varlen_backward(*([None] * 10))


# ------------------------------------------------------------------------------------ protocol
@pytest.mark.parametrize("blocks", [0, 1, 4])
def test_protocol_checker_extracts_and_passes_the_varlen_roles(blocks):
    """The varlen build's role programs (through WalkPlan.tile_bounds / make_walk) hold exactly the
    dense build's barrier and buffer operations, and pass the checker; blocks = 0 is a K/V tile past
    its sequence's keys (or of an empty sequence): every role's empty path, no deadlock."""
    from stage4_bwd_kernel import blackwell_protocol as bp

    bb = _bwd()
    dense = bp.extract(bp.backward_spec(blocks))
    spec = bp.backward_spec(blocks)
    spec.kernel = bb.FlashAttentionBackwardSm100(spec.kernel.cfg, varlen=True, has_seqused_k=True)
    prog = bp.extract(spec)
    strip = lambda ops: [op[:-1] for op in ops]  # noqa: E731 (drop the source location)
    assert {r: strip(o) for r, o in prog.ops.items()} == {r: strip(o) for r, o in dense.ops.items()}
    res = bp.explore(prog, 2_000_000, blocks, 0)
    assert res.ok, res.report()


# ------------------------------------------------------------------------------------ dK / dV store
CU_K = (0, 200, 330, 330, 700, 765)   # partial last tiles, an empty sequence, one shorter than a tile
HEADS, HEAD = 3, 1


def _store_writes(kernel, cu_k, unpredicated: bool) -> dict:
    """Trace the epilogue's stores of one head: for every sequence, every K/V tile of the grid
    (max_seqlen_k keys), every key lane and 32-column chunk, the linear offsets the kernel's own
    ``_dkdv_keeps`` / ``_dkdv_dst`` give in a packed (1, T, H, d) row-major tensor. Returns
    {sequence: Counter(offset -> writes)}."""
    import cutlass.cute as cute

    from stage3_fwd_kernel.blackwell_fwd import TARGET_ARCH
    from stage3_fwd_kernel.blackwell_tmem_check import _static

    out: dict = {}
    total, d, tn = cu_k[-1], kernel.d, kernel.tn
    lens = [b - a for a, b in zip(cu_k, cu_k[1:])]
    n_blocks = (max(lens) + tn - 1) // tn

    def collect():  # plain Python inside the trace: the loops stay Python loops
        counting = cute.make_tensor(0, cute.make_layout((1, total, HEADS, d),
                                                        stride=(total * HEADS * d, HEADS * d, d, 1)))
        for b, (offset_k, rows) in enumerate(zip(cu_k, lens)):
            got = out.setdefault(b, Counter())
            for n_block in range(n_blocks):
                for key in range(tn):
                    key_g = n_block * tn + key
                    if not (unpredicated or kernel._dkdv_keeps(key_g, rows)):
                        continue
                    for c in range(d // 32):
                        st = _static(kernel._dkdv_dst(counting, 0, key_g, HEAD, c, offset_k))
                        for j in range(st.size):
                            got[st[j]] += 1

    @cute.jit
    def probe():
        collect()

    cute.compile(probe, options=f"--gpu-arch {TARGET_ARCH}")  # builds nothing: only the trace matters
    return out


def dkdv_store_mismatches(kernel, cu_k=CU_K, unpredicated: bool = False) -> Counter:
    """outside: writes of a sequence's tile that land outside its own rows of the head (the next
    sequence's rows, or past the tensor); missing / repeated: own elements written 0 or > 1 times."""
    d = kernel.d
    counts = Counter(outside=0, missing=0, repeated=0)
    for b, got in _store_writes(kernel, cu_k, unpredicated).items():
        own = {(cu_k[b] + r) * HEADS * d + HEAD * d + col for r in range(cu_k[b + 1] - cu_k[b]) for col in range(d)}
        counts["outside"] += sum(n for off, n in got.items() if off not in own)
        counts["missing"] += sum(1 for off in own if got[off] == 0)
        counts["repeated"] += sum(1 for off in own if got[off] > 1)
    return counts


def test_dkdv_store_stays_inside_each_sequence():
    import cutlass  # noqa: F401  (after the package set the arch)

    bb = _bwd()
    cfg = bb.make_config("bf16", 64)
    varlen = bb.FlashAttentionBackwardSm100(cfg, varlen=True)
    assert dkdv_store_mismatches(varlen) == Counter(outside=0, missing=0, repeated=0)
    # negative controls: the check catches a store without the key guard (partial last tiles write
    # the next sequence's rows) and the dense row mapping (every sequence's keys from row 0)
    bad = dkdv_store_mismatches(varlen, unpredicated=True)
    assert bad["outside"] > 0, bad
    dense_rows = dkdv_store_mismatches(bb.FlashAttentionBackwardSm100(cfg))
    assert dense_rows["outside"] > 0 and dense_rows["missing"] > 0, dense_rows


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_d128_dv64_varlen_and_variant_builds(causal):
    """qk 128 / v 64 (compiled only): the varlen build with seqused_k and a softcap + window build in
    deterministic mode, without spills and with the dense build's MMAs -- dP^T's K steps and dV's
    columns follow dv, S^T's and dK's d."""
    bb = _bwd()
    dense = bb.compile_only("bf16", 128, 64, causal=causal).report
    varlen = bb.compile_only("bf16", 128, 64, causal=causal, varlen=True, has_seqused_k=True).report
    window = (256, 0 if causal else 64)
    variant = bb.compile_only("bf16", 128, 64, causal=causal, deterministic=True, window_size=window,
                              softcap=30.0).report
    assert dense["UTCHMMA.SS"] == 128 // 16 + 64 // 16 + 128 // 16 and dense["UTCHMMA.TS"] == 2 * (128 // 16)
    for rep in (varlen, variant):
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0 and rep["LDL/STL"] == 0, rep
        for k in ("UTCHMMA.SS", "UTCHMMA.TS", "LDTM", "STTM"):
            assert rep[k] == dense[k], (k, rep[k], dense[k])
