"""Host-side check of the Blackwell forward's P hand-over in TMEM, evaluated element by element at trace time.

The softmax warpgroup of Q tile i writes P_i (16-bit, two values per 32-bit TMEM column) into the
upper half of S_i with tcgen05.st; the MMA warp then issues O_i += P_i V with P_i as the A operand
read from TMEM (the "TS" MMA). If the two disagree about where element P[m, n] lives, the kernel
computes O from a shuffled P -- and nothing but a Blackwell GPU run would notice. This module
builds both maps from the kernel's own code while tracing (static CuTe layouts are Python integers
then) and compares them for every element of P_0 and P_1:

  store side  thread t of the warpgroup loads S[m, n] into register slot s (``tScS_t2r``, the
              tcgen05.ld 32x32b partition); softmax_step writes P[m, n] into 16-bit slot s of the P
              registers, i.e. half s % 2 of 32-bit register s // 2 (this step is modelled from
              softmax_step's code, which runs on the device and cannot be traced into numbers); that
              register is stored with the kernel's tcgen05.st copy (``tiled_r2t``): its source
              partition of a counting tensor of P_i's TMEM addresses gives (lane, column).
              P[m, n] -> (lane, column, half).
  read side   the TS operand fragment ``tOrP`` of ``_tmem_tensors`` (16-bit element offsets from
              column cfg.tmem.p[i], where _tmem_tensors anchors it) indexed like ``partition_A`` of
              the (tile_m, tile_n) coordinates: A[m, k] -> (lane, column, half), decoding an offset e
              as address e >> 1 (lane << 16 | column) plus half e & 1.

Each side is evaluated twice, by CuTe's layouts and by the instruction-level reading of the PTX ISA
(tcgen05.st 32x32b: thread t of a warp -> lane base + t, register v -> column base + v, the base
being the address the kernel hands the instruction, and warp w may only touch lanes 32 (w % 4) ...;
tcgen05.mma kind::f16, M = 128, A in TMEM: row m in lane m, K-step element kk in column start +
kk // 2, half kk % 2). Both readings must agree with each other, and the two sides must agree.
``ptx_pv_a_columns`` also reads the A addresses the compiled PTX hands each TS tcgen05.mma, so the
start columns the layouts imply are the ones actually emitted.

    from stage3_fwd_kernel.blackwell_tmem_check import p_tmem_mismatches
    p_tmem_mismatches(kernel)                    # {"P_0": 0, "P_1": 0}
    p_tmem_mismatches(kernel, wrong="transpose")  # a deliberately wrong store: non-zero

What it proves: the softmax's store and the MMA's A operand, as CuTe-DSL 4.8.1 describes them and as
this kernel builds them, name the same (lane, column, half) for every element of P, for both tiles.
What it cannot prove: the hardware semantics. The data-path layouts above (PTX ISA layout D for
M = 128, cta_group::1; the 32x32b shape) and the packing (the lower-indexed 16-bit value in the low
half of a column) are our reading of the PTX ISA and of CuTe's TMEM pointer encoding; the
instruction descriptor and the other fields the DSL emits are trusted, not decoded, and in the PTX
only the TS MMAs' A columns are read back, not the softmax's tcgen05.st addresses (they depend on
the thread index at run time). Not covered either: that K-step kb of V holds keys 16 kb ... (the B
operand, in SMEM), the values of P, and timing (that P_i is stored before the MMA reads it is the
barriers' job, blackwell_protocol.py). Nothing here has run on a Blackwell GPU; none exists in this
project.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import tcgen05

from stage3_fwd_kernel.blackwell_config import q_tiles_for
from stage3_fwd_kernel.blackwell_fwd import TARGET_ARCH, FlashAttentionForwardSm100, compile_config, make_config

LANE_SHIFT = 16          # a TMEM address: lane in bits 31..16, 32-bit column in bits 15..0
COL_MASK = (1 << LANE_SHIFT) - 1
WRONG = ("transpose", "shift_column", "swap_halves")  # deliberately wrong stores (negative controls)


# ------------------------------------------------------------------ static layouts, evaluated in Python
@dataclass(frozen=True)
class StaticTensor:
    """A tensor read back at trace time: its iterator (int address, or coordinate tuple) and, per
    top-level mode, the (extent, stride) leaves in colexicographic order."""

    iterator: object
    modes: tuple

    @property
    def mode_sizes(self) -> tuple:
        out = []
        for leaves in self.modes:
            n = 1
            for extent, _ in leaves:
                n *= extent
            out.append(n)
        return tuple(out)

    @property
    def size(self) -> int:
        n = 1
        for s in self.mode_sizes:
            n *= s
        return n

    def at_modes(self, index: tuple):
        """Value at one 1-D index per top-level mode."""
        acc = self.iterator if isinstance(self.iterator, int) else list(self.iterator)
        for leaves, i in zip(self.modes, index):
            for extent, stride in leaves:
                step = i % extent
                i //= extent
                if isinstance(stride, tuple):  # coordinate tensor: stride is (scale, mode)
                    acc[stride[1]] += step * stride[0]
                elif isinstance(acc, int):
                    acc += step * stride
                elif stride != 0:
                    raise ValueError(f"integer stride {stride} in a coordinate tensor")
        return acc if isinstance(acc, int) else tuple(acc)

    def split(self, j: int) -> tuple:
        """Colexicographic flat index -> one index per top-level mode."""
        out = []
        for s in self.mode_sizes:
            out.append(j % s)
            j //= s
        return tuple(out)

    def __getitem__(self, j: int):
        return self.at_modes(self.split(j))


def _leaf_stride(stride):
    if isinstance(stride, int):
        return stride
    mode = list(stride.mode)  # a ScaledBasis of a coordinate tensor: scale @ mode
    if len(mode) != 1 or not isinstance(stride.value, int):
        raise ValueError(f"unsupported stride {stride}")
    return (stride.value, mode[0])


def _leaves(shape, stride) -> list:
    if isinstance(shape, int):
        return [(shape, _leaf_stride(stride))]
    return [leaf for s, d in zip(shape, stride) for leaf in _leaves(s, d)]


def _static(tensor_or_layout, iterator=0) -> StaticTensor:
    layout = getattr(tensor_or_layout, "layout", tensor_or_layout)
    it = getattr(tensor_or_layout, "iterator", iterator)
    shape, stride = layout.shape, layout.stride
    if isinstance(shape, int):
        shape, stride = (shape,), (stride,)
    if not (isinstance(it, int) or (isinstance(it, tuple) and all(isinstance(c, int) for c in it))):
        raise ValueError(f"iterator is not static at trace time: {it}")
    return StaticTensor(it, tuple(tuple(_leaves(s, d)) for s, d in zip(shape, stride)))


def decode_address(address: int) -> tuple:
    """A 32-bit TMEM address -> (lane, column)."""
    return address >> LANE_SHIFT, address & COL_MASK


# ------------------------------------------------------------------ the trace
def _sample(out, st: StaticTensor, tensor, idxs):
    """Keep (our evaluation, the DSL's) for a few flat indices: validates the Python evaluator."""
    for j in idxs:
        if j < st.size:
            v = tensor[j]
            out["samples"].append((st[j], tuple(v) if isinstance(v, tuple) else v))


def _collect(kernel: FlashAttentionForwardSm100, out: dict):
    """Runs inside the probe's trace (plain Python, so loops stay Python loops): per stage and
    softmax thread the S-load and P-store partitions, per stage the TS operand fragment."""
    tm, tn = kernel.tm, kernel.tn
    tiled_mma_qk, tiled_mma_pv, tP_layout = kernel.mmas_and_p_layout()
    thr_qk, thr_pv = tiled_mma_qk.get_slice(0), tiled_mma_pv.get_slice(0)
    fake = cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16)  # its value is never read
    _, _, tOrP = kernel._tmem_tensors(fake, thr_qk, thr_pv, tP_layout)
    tOcP = thr_pv.partition_A(cute.make_identity_tensor((tm, tn)))             # fragment index -> (m, k)
    read_coords = _static(tOcP)
    _sample(out, read_coords, tOcP, range(0, read_coords.size, 997))
    for stage in range(kernel.num_q):
        tStS, tScS, tStP, tScP = kernel.s_p_tmem_views(fake, stage, thr_qk)  # as the softmax builds them
        cS, _, cP, _ = kernel.s_p_tmem_views(0, stage, thr_qk)             # the same, as TMEM addresses
        if str(cS.layout) != str(tStS.layout) or str(cP.layout) != str(tStP.layout):
            raise AssertionError("the counting views must have the TMEM views' layouts")
        tiled_t2r = tcgen05.make_tmem_copy(kernel.s_load_atom(), tStS)
        tiled_r2t = tcgen05.make_tmem_copy(kernel.p_store_atom(), tStP)
        frag = _static(tOrP[stage].layout)
        out["samples"] += [(frag[j], cute.crd2idx(j, tOrP[stage].layout)) for j in range(0, frag.size, 1009)]
        threads = []
        for t in range(tm):  # tidx = thread index % 128 in either softmax warpgroup
            thr_t2r, thr_r2t = tiled_t2r.get_slice(t), tiled_r2t.get_slice(t)
            s_coords = thr_t2r.partition_D(tScS)                                   # S register -> (m, n)
            p_shape = thr_r2t.partition_S(cute.make_tensor(tScS.iterator, tScP)).shape  # tSrP's shape
            src, dst = thr_r2t.partition_S(cP), thr_r2t.partition_D(cP)
            rec = dict(s_coords=_static(s_coords), src=_static(src), dst=_static(dst),
                       # make_rmem_tensor(shape) lays registers out as make_layout(shape)
                       s_regs=_static(cute.make_layout(s_coords.shape)), p_regs=_static(cute.make_layout(p_shape)))
            if t in (0, 45, 127):
                for name, tensor in (("s_coords", s_coords), ("src", src), ("dst", dst)):
                    _sample(out, rec[name], tensor, range(0, rec[name].size, 7))
            threads.append(rec)
        # _tmem_tensors anchors P_i's fragment at column cfg.tmem.p[i] (ptx_pv_a_columns checks the PTX)
        out["stages"].append(dict(threads=threads, frag=frag, read_coords=read_coords,
                                  read_base=kernel.tmem.p[stage], mma_mnk=tuple(tiled_mma_pv.shape_mnk)))


def trace(kernel: FlashAttentionForwardSm100) -> dict:
    """Trace a probe that launches nothing and return what _collect read."""
    out = {"stages": [], "samples": []}

    @cute.jit
    def probe():
        _collect(kernel, out)

    cute.compile(probe, options=f"--gpu-arch {TARGET_ARCH}")  # builds nothing: only the trace matters
    return out


# ------------------------------------------------------------------ the two maps
def _store_map(stage_rec: dict, wrong: str | None) -> tuple:
    """P[m, n] -> [(lane, column, half), ...] as the softmax stores it (CuTe's copy partition), and
    how many P registers the instruction-level reading puts elsewhere (or in a forbidden lane)."""
    locs, disagree = {}, 0
    for t, rec in enumerate(stage_rec["threads"]):
        src, dst = rec["src"], rec["dst"]
        vec = src.mode_sizes[0]  # values of one tcgen05.st per thread (modes 0, 1 of the source)
        addr_of_word = {}
        for j in range(src.size):
            i0, i1, chunk = src.split(j)
            lane0, col0 = decode_address(dst.at_modes((0, 0, chunk)))  # the address the instruction gets
            hw = (lane0 + t % 32, col0 + i0 + vec * i1)
            cute_loc = decode_address(src[j])
            disagree += cute_loc != hw or lane0 != 32 * (t // 32)  # warp w: lanes 32 (w % 4) + 0..31
            addr_of_word[rec["p_regs"][j]] = cute_loc
        for j in range(rec["s_coords"].size):
            slot = rec["s_regs"][j]      # softmax_step: P of S register slot s -> 16-bit P slot s
            m, n = rec["s_coords"][j]
            lane, col = addr_of_word[slot // 2]
            half = slot % 2
            if wrong == "swap_halves":
                half = 1 - half
            elif wrong == "shift_column":
                col += 1
            elif wrong == "transpose":
                m, n = n, m
            locs.setdefault((m, n), []).append((lane, col, half))
    return locs, disagree


def _read_map(stage_rec: dict) -> tuple:
    """A[m, k] -> (lane, column, half) as the TS MMAs read P (CuTe's fragment), the instructions'
    start columns, and how many elements the PTX-ISA reading (M = 128: row m in lane m, K-step
    element kk in column start + kk // 2, half kk % 2) puts elsewhere."""
    frag, coords, base = stage_rec["frag"], stage_rec["read_coords"], stage_rec["read_base"]
    if frag.mode_sizes != coords.mode_sizes:
        raise AssertionError(f"fragment {frag.mode_sizes} and coordinates {coords.mode_sizes} differ")

    def loc(e):  # a 16-bit element offset: address e >> 1 (lane << 16 | column), half e & 1
        lane, col = decode_address(e >> 1)
        return lane, base + col, e & 1

    mma_m, _, mma_k = stage_rec["mma_mnk"]
    if mma_m != 128:
        raise ValueError(f"the PTX-ISA reading below is data-path layout D (M = 128), not M = {mma_m}")
    # what the DSL hands instruction kb: the address of tOrP[None, None, kb]
    starts = [loc(frag.at_modes((0, 0, kb))) for kb in range(frag.mode_sizes[2])]
    locs, disagree = {}, 0
    for j in range(frag.size):
        kb = frag.split(j)[2]
        m, k = coords[j]
        locs[(m, k)] = loc(frag[j])
        lane0, col0, half0 = starts[kb]
        kk = k - mma_k * kb  # instruction kb must cover keys mma_k kb ... mma_k (kb + 1) - 1
        hw = (lane0 + m, col0 + kk // 2, kk % 2)
        disagree += hw != locs[(m, k)] or not 0 <= kk < mma_k or half0 != 0
    return locs, [s[1] for s in starts], disagree


def report(traced: dict, wrong: str | None = None) -> dict:
    """Per Q tile i, {"P_i": {...}}: elements of P_i, mismatches (stored elsewhere than read, not
    stored, or stored twice), the models' disagreements on each side, the TS MMAs' A start columns.
    ``wrong`` (one of WRONG) applies a deliberately wrong store, so the check can be seen to fail."""
    if wrong is not None and wrong not in WRONG:
        raise ValueError(f"wrong: one of {WRONG}, got {wrong!r}")
    evaluator = sum(a != b for a, b in traced["samples"])
    out = {}
    for i, stage_rec in enumerate(traced["stages"]):
        stored, store_disagree = _store_map(stage_rec, wrong)
        read, starts, read_disagree = _read_map(stage_rec)
        bad = sum(stored.get(key) != [where] for key, where in read.items())
        bad += sum(key not in read for key in stored)  # stored outside the tile
        out[f"P_{i}"] = dict(elements=len(read), mismatches=bad,
                             not_stored=sum(key not in stored for key in read),
                             stored_twice=sum(len(v) > 1 for v in stored.values()),
                             store_models_disagree=store_disagree, read_models_disagree=read_disagree,
                             evaluator_vs_dsl=evaluator, a_start_columns=starts)
    return out


def p_tmem_mismatches(kernel: FlashAttentionForwardSm100 | None, wrong: str | None = None,
                      traced: dict | None = None) -> dict:
    """{"P_0": n, "P_1": n}: elements of each P_i the softmax does not store exactly where the TS MMA
    reads them (0 = they agree everywhere). Pass `traced` (trace(kernel)) to reuse one trace."""
    rep = report(trace(kernel) if traced is None else traced, wrong)
    return {name: r["mismatches"] for name, r in rep.items()}


# ------------------------------------------------------------------ the emitted A addresses
_TS_MMA = re.compile(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[(%r\d+)\],\s*\[(%r\d+)\]")
_SS_MMA_D = re.compile(r"tcgen05\.mma\.cta_group::1\.kind::f16\S*\s+\[(%r\d+)\],\s*%rd\d+")
_ADD_IMM = re.compile(r"add\.s32\s+(%r\d+),\s*(%r\d+),\s*(-?\d+);")


def ptx_pv_a_columns(ptx: str) -> list:
    """The TMEM column (from the start of the allocation) of the A operand of every TS tcgen05.mma
    in the PTX, in program order. The A register must be `add.s32 A, B, column` (or B itself) with
    one B for all, and B must be the D operand of an S = Q K^T MMA, i.e. S_0 at column 0."""
    adds = {dst: (src, int(c)) for dst, src, c in _ADD_IMM.findall(ptx)}
    found = [adds.get(a, (a, 0)) for _, a in _TS_MMA.findall(ptx)]
    bases = {b for b, _ in found}
    if not found or len(bases) != 1 or not bases <= set(_SS_MMA_D.findall(ptx)):
        raise ValueError(f"TS MMA A operands not of the form S_0 base + constant: bases {sorted(bases)}")
    return [c for _, c in found]


def expected_pv_a_columns(rep: dict) -> list:
    """A start columns per Q tile and K-step, as the traced layouts have them (tile-major)."""
    return [c for name in sorted(rep) for c in rep[name]["a_start_columns"]]


# ------------------------------------------------------------------ command line
def table(cases=((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)), dtype: str = "bf16", ptx: bool = False) -> str:
    """Markdown: mismatches per tile for the kernel as built and for each wrong store; with `ptx`, whether
    the A columns of the compiled PTX are the traced ones (one compile per case)."""
    lines = ["| d / dv | P_0, P_1 (kernel) | " + " | ".join(WRONG) + " | model disagreements | A start columns |"
             + (" PTX |" if ptx else ""), "|---" * (5 + len(WRONG) - 1 + ptx) + "|"]
    for d, dv in cases:
        cfg = make_config(dtype, d, dv, False, q_tiles_per_cta=q_tiles_for(d, dv))  # 256: one Q tile
        traced = trace(FlashAttentionForwardSm100(cfg))
        rep = report(traced)
        wrong = [p_tmem_mismatches(None, w, traced) for w in WRONG]
        models = sum(r["store_models_disagree"] + r["read_models_disagree"] + r["evaluator_vs_dsl"]
                     for r in rep.values())
        starts = "; ".join(",".join(map(str, r["a_start_columns"])) for r in rep.values())
        row = (f"| {d} / {dv} | {', '.join(str(r['mismatches']) for r in rep.values())} | "
               + " | ".join(", ".join(map(str, w.values())) for w in wrong) + f" | {models} | {starts} |")
        if ptx:
            cols = ptx_pv_a_columns(compile_config(cfg).ptx)
            row += f" {'same' if sorted(cols) == sorted(expected_pv_a_columns(rep) * 2) else 'DIFFERENT'} |"
        lines.append(row)
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ptx", action="store_true", help="also compile each case and compare the A columns in PTX")
    print(table(ptx=ap.parse_args().ptx))
