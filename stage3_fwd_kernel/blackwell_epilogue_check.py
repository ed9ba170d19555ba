"""Host-side check of the Blackwell forward's O epilogue, evaluated element by element at trace time.

After the last O_i += P_i V the correction warpgroup loads O_i from TMEM (tcgen05.ld 32x32b, 32
columns at a time), scales it by 1 / l, converts it to 16 bits and stores it into the staging
buffer sO_i in SMEM (128B or 64B swizzled); the epilogue warp then writes sO_i to global memory --
one TMA store box per 64 (dv = 96: 32) columns for dense inputs, or, when sequences are packed,
16-byte stores by gcd(dv / 8, 32) lanes per row behind a row guard. The correction warpgroup also
writes one lse per row, from the (row_sum, row_max) the softmax left in TMEM. If any of these hops
disagrees with the next about where element (m, n) is, O lands transposed or shuffled, or the lse
of one row in another's place, and nothing but a Blackwell GPU run would show it. This module
builds each hop from the kernel's own methods while tracing (static CuTe layouts are Python
integers then) and composes them for every element of both Q tiles:

  accumulator  O_i[m, n] -> TMEM address: the MMA's C fragment (``_tmem_tensors``) at the
               coordinate ``partition_C`` gives it.
  TMEM -> reg  correction thread t, register j of chunk c holds the TMEM address the register-side
               partition of its tcgen05.ld (``o_load_atom``, ``o_epilogue_chunk``) gives j.
  reg -> SMEM  register j goes to the sO_i element of the same index of ``o_epilogue_chunk``'s SMEM
               partition: an offset before the swizzle; the byte it lands on is the swizzle of
               2 x offset, because the DSL applies a swizzled pointer's swizzle to byte addresses
               (``ptx_pointer_swizzle`` reads that off a small compiled kernel).
  SMEM -> O    dense: the TMA partition (``o_tma_partitions``) pairs each sO byte with a TMA
               coordinate (column, row, head, batch); varlen: lane l's value v of its m-th row store
               goes from ``varlen_o_partitions``' SMEM side to its global side, and the store
               happens iff ``varlen_guard_row`` + the tile's first row < seqlen_q.
  lse          the softmax thread of row r stores (row_sum, row_max) with ``final_stats_atom``; the
               correction thread that reads those two columns must hold row r of O (it normalises
               it), and writes its lse at ``o_tile_row0`` + ``o_register_coords``' row through
               ``lse_coord``.

Composed, O_i[m, n] must reach global row (first row of tile i) + m, column n, exactly once, and the
lse of row m the lse slot of that row; "first row" is where load() took Q_i from (tile m_block x
num_q + i of tm rows), not what the epilogue thinks. Each SMEM partition is also evaluated against
sO's own layout at the coordinates the same partition claims (``*_partition_vs_sO``). The hops with a hardware reading are evaluated a second time
by that reading: the C fragment by the PTX ISA's data-path layout (M = 128, cta_group::1: row m in
lane m, column n in column base + n); each tcgen05.ld / st 32x32b by thread t of warp w reading
lane base + t % 32, register v reading column base + v (warp w reaching lanes 32 (w % 4) ... only);
each TMA store box, from the SMEM address and coordinates CuTe hands the instruction and the box the
atom carries (``tma_gbasis`` of its type), as a dense image with the innermost box dimension
fastest under the TMA swizzle mode of that width (128B: byte address bits [4, 7) ^= bits [7, 10);
64B: [4, 6) ^= [7, 9)); and each varlen store as 16-byte vectors: 8 values at consecutive SMEM
bytes and consecutive columns of one row, starting at a multiple of 8. Both readings must agree.
``ptx_tma_stores`` also reads the SMEM offsets and coordinates the compiled PTX hands each TMA
store, so the boxes the trace implies are the ones actually emitted.

    from stage3_fwd_kernel.blackwell_epilogue_check import epilogue_mismatches
    epilogue_mismatches(kernel)                  # {"O_0": 0, "O_1": 0, "lse_0": 0, "lse_1": 0}
    epilogue_mismatches(kernel, wrong="swizzle")  # a deliberately wrong store: non-zero

What it proves: the correction warpgroup's load, its SMEM store, the epilogue warp's TMA boxes or
16-byte stores and the lse writes, as CuTe-DSL 4.8.1 describes them and as this kernel builds them,
take every element of both O tiles to its own place in global memory, each lse to its own row, and
the row guard of the varlen stores passes exactly the rows inside the sequence -- at d = 64, 96,
128 and (192, 128) dense, and 64, 128 and (192, 128) varlen. At dv = 96 varlen they do not: lanes
1-3 of a row (24 columns each) read sO as if its columns were contiguous, but sO keeps them in
32-column swizzle blocks 4096 elements apart, so 8192 of a tile's 12288 elements come from the
wrong place (the DSL composed the copy with sO although 24 columns do not divide 32, and said
nothing); one 16-byte vector per lane and 32 columns passes (tests/test_blackwell_epilogue_layout.py).
What it cannot
prove: the hardware semantics. The readings above are our reading of the PTX ISA (tcgen05.ld
32x32b, data-path layout D, the TMA swizzle modes, 16-byte st.global); the TMA descriptor itself
is encoded by the DSL's host code (box, swizzle mode, strides) and is trusted, not decoded -- only
the box extents it is built from are read, from the atom's type; sO's base is taken to be
1024-byte aligned (SharedStorage's Align[..., 1024], or sQ's for (192, 128)) as the swizzle needs,
read from the code, not traced, and so is the 16-byte alignment of O's rows (assume_strides_16B,
checked by the host). Not covered either: the values (O / l, the conversion, empty
rows), the TMA's clipping of rows past the tensor's end, and timing (that sO_i is complete before
the TMA reads it is epi_full's job, blackwell_protocol.py). Nothing here has run on a Blackwell
GPU; none exists in this project.
"""
from __future__ import annotations

import re
import struct

import cutlass.cute as cute
from cutlass import BFloat16, Float32
from cutlass.cute.nvgpu import tcgen05

from stage3_fwd_kernel import compile_cache
from stage3_fwd_kernel.blackwell_config import q_tiles_for
from stage3_fwd_kernel.blackwell_fwd import (TARGET_ARCH, FlashAttentionForwardSm100, compile_config, fake_args,
                                             make_config)
from stage3_fwd_kernel.blackwell_tmem_check import StaticTensor, _static, decode_address

WRONG = ("transpose", "swizzle", "guard_row")  # deliberately wrong mappings (negative controls)
ELEM_BYTES = 2                                # O is fp16 / bf16 in SMEM and global memory
HEAD, BATCH, M_BLOCK, OFFSET_Q = 3, 2, 3, 1000  # an arbitrary CTA: rows must move with it


# ------------------------------------------------------------------ swizzles
def parse_swizzle(text: str) -> tuple:
    """"S<3,4,3>" -> (3, 4, 3)."""
    m = re.fullmatch(r"S<(\d+),(\d+),(\d+)>", str(text).strip())
    if not m:
        raise ValueError(f"not a swizzle: {text!r}")
    return tuple(int(x) for x in m.groups())


def swizzle(spec: tuple, x: int) -> int:
    """CuTe's Swizzle<B, M, S>: bits [M, M + B) of x ^= bits [M + S, M + S + B)."""
    b, m, s = spec
    return x ^ ((x >> s) & (((1 << b) - 1) << m))


def tma_swizzle(box_inner_bytes: int, byte: int) -> int:
    """The TMA's swizzle mode for a box row of this width (our reading of the PTX ISA): 16-byte
    chunks within a 32 / 64 / 128-byte span, chunk index ^= address bits [7, 7 + log2(span / 16))."""
    spans = {16: 0, 32: 1, 64: 2, 128: 3}
    if box_inner_bytes not in spans:
        raise ValueError(f"no TMA swizzle mode for {box_inner_bytes}-byte box rows")
    bits = spans[box_inner_bytes]
    return byte ^ (((byte >> 7) & ((1 << bits) - 1)) << 4)


def parse_tma_atom(type_text: str) -> dict:
    """Box extents and bytes per instruction from a TMA atom's MLIR type: tma_gbasis lists the box,
    innermost first, as extent@gmem mode."""
    bits = re.search(r"copy_bits = (\d+)", type_text)
    basis = re.search(r'tma_gbasis = <"\(([^)]*)\):\(([^)]*)\)">', type_text)
    if not (bits and basis):
        raise ValueError(f"not a TMA atom type: {type_text}")
    extents = [int(x) for x in basis.group(1).split(",")]
    modes = [int(re.fullmatch(r"1@(\d+)", x.strip()).group(1)) for x in basis.group(2).split(",")]
    return dict(copy_bytes=int(bits.group(1)) // 8, box=[(e, mo) for e, mo in zip(extents, modes) if e > 1])


# ------------------------------------------------------------------ the trace
def _sample(out, st: StaticTensor, tensor, idxs):
    """Keep (our evaluation, the DSL's) for a few flat indices: validates the Python evaluator."""
    for j in idxs:
        if j < st.size:
            v = tensor[j]
            out["samples"].append((st[j], tuple(v) if isinstance(v, tuple) else v))


def _trace_correction(kernel, out, thr_qk, thr_pv, sO_cnt, sO_mem):
    """The accumulators, and per correction thread the O load / SMEM store of every chunk and the
    final statistics' load, as correction() builds them."""
    tm, dv, nq = kernel.tm, kernel.dv, kernel.num_q
    fake = cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16)  # its value is never read
    tStS_f, tOtO_f, _ = kernel._tmem_tensors(fake, thr_qk, thr_pv, None)
    tStS, tOtO, _ = kernel._tmem_tensors(0, thr_qk, thr_pv, None)              # counting: TMEM addresses
    acc_coords = thr_pv.partition_C(cute.make_identity_tensor((tm, dv)))
    out["acc_coords"] = _static(acc_coords)
    out["acc_addr"] = [_static(t) for t in tOtO]
    _sample(out, out["acc_coords"], acc_coords, range(0, tm * dv, 997))
    _sample(out, out["acc_addr"][0], tOtO[0], range(0, tm * dv, 1009))
    chunks_f, chunks = kernel.o_chunk_views(tOtO_f), kernel.o_chunk_views(tOtO)
    tiled_ld_o = tcgen05.make_tmem_copy(kernel.o_load_atom(), chunks_f[0])
    fin_f = [kernel.final_stats_view(tStS_f[i], kernel.tmem.final[i] - kernel.tmem.s[i]) for i in range(nq)]
    fin = [kernel.final_stats_view(tStS[i], kernel.tmem.final[i] - kernel.tmem.s[i]) for i in range(nq)]
    tiled_ld_f = tcgen05.make_tmem_copy(kernel.final_stats_atom(store=False), fin_f[0])
    n_oc = dv // kernel.O_CHUNK_COLS
    for t in range(tm):  # tidx = thread index % 128 of the correction warpgroup
        thr, thr_f = tiled_ld_o.get_slice(t), tiled_ld_f.get_slice(t)
        coords = kernel.o_register_coords(thr)
        rec = dict(coords=_static(coords), tiles=[])
        for i in range(nq):
            chunk_recs = []
            for c in range(n_oc):
                tO, src, dst = kernel.o_epilogue_chunk(thr, chunks[i], sO_cnt[None, None, i], c)
                reg_addr = thr.partition_D(tO)  # register j -> its TMEM address (register side)
                crec = dict(inst=_static(src), reg_addr=_static(reg_addr), dst=_static(dst))
                if t in (0, 77) and c == n_oc - 1:
                    _sample(out, crec["reg_addr"], reg_addr, range(0, crec["reg_addr"].size, 5))
                    _sample(out, crec["inst"], src, range(0, crec["inst"].size, 97))
                    _sample(out, crec["dst"], dst, range(0, crec["dst"].size, 3))
                    mem = kernel.o_epilogue_chunk(thr, chunks_f[i], sO_mem[None, None, i], c)[2]
                    if str(mem.layout) != str(dst.layout):
                        raise AssertionError("the counting sO must partition like the kernel's sO")
                chunk_recs.append(crec)
            stats = dict(inst=_static(thr_f.partition_S(fin[i])), reg_addr=_static(thr_f.partition_D(fin[i])))
            rec["tiles"].append(dict(chunks=chunk_recs, stats=stats))
        out["correction"].append(rec)


def _trace_softmax_stats(kernel, out, thr_qk):
    """Per softmax warpgroup and thread: the row its S registers hold and where its final
    statistics go, as softmax() builds them."""
    fake = cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16)
    for stage in range(kernel.num_q):
        tStS_f, tScS, _, _ = kernel.s_p_tmem_views(fake, stage, thr_qk)
        tStS, _, _, _ = kernel.s_p_tmem_views(0, stage, thr_qk)
        offset = kernel.tmem.final[0] - kernel.tmem.s[0]
        fin_f, fin = kernel.final_stats_view(tStS_f, offset), kernel.final_stats_view(tStS, offset)
        tiled_t2r = tcgen05.make_tmem_copy(kernel.s_load_atom(), tStS_f)
        tiled_st = tcgen05.make_tmem_copy(kernel.final_stats_atom(store=True), fin_f)
        threads = []
        for t in range(kernel.tm):
            thr_st = tiled_st.get_slice(t)
            threads.append(dict(s_coords=_static(tiled_t2r.get_slice(t).partition_D(tScS)),
                                reg_addr=_static(thr_st.partition_S(fin)), inst=_static(thr_st.partition_D(fin))))
        out["softmax"].append(threads)


class _ByMode:
    """A StaticTensor indexed like a CuTe tensor with one index per top-level mode."""

    def __init__(self, st: StaticTensor):
        self.st = st

    def __getitem__(self, index):
        return self.st.at_modes(index) if isinstance(index, tuple) else self.st[index]


def _trace_stores(kernel, out, mO, sO_cnt, sO_mem, sO_layout):
    """The epilogue warp: TMA boxes (dense) or per-lane 16-byte stores and guard rows (varlen);
    and where each tile's rows and lse go."""
    nq, tm = kernel.num_q, kernel.tm
    out["tile_index"] = [kernel.o_tile_index(M_BLOCK, i) for i in range(nq)]
    out["tile_row0"] = [kernel.o_tile_row0(M_BLOCK, i) for i in range(nq)]
    # where tile i's rows truly start: load() fetches Q tile m_block * num_q + i (tm rows each)
    out["q_row0"] = [(M_BLOCK * nq + i) * tm for i in range(nq)]
    out["lse_coord"] = [kernel.lse_coord(BATCH, HEAD, OFFSET_Q, r) for r in (0, 1, 200)]
    if not kernel.varlen:
        tma_atom, tma_O = kernel.o_tma_store_atom(mO, sO_layout)
        tOsO, tOgO = kernel.o_tma_partitions(tma_atom, tma_O, sO_mem, HEAD, BATCH)
        out["tma_atom"] = parse_tma_atom(str(tma_atom._trait.value.type))
        out["tma_smem"] = _static(tOsO.layout)  # base 0: offsets before the pointer's swizzle
        out["tma_coords"] = []
        for idx in out["tile_index"]:
            g = tOgO[None, idx]
            out["tma_coords"].append(_static(g))
            _sample(out, out["tma_coords"][-1], g, range(0, cute.size(g), 1013))
        out["samples"] += [(out["tma_smem"][j], cute.crd2idx(j, tOsO.layout))
                           for j in range(0, out["tma_smem"].size, 2039)]
        return
    tiled_copy = kernel.varlen_o_copy()
    mO_cur = kernel.varlen_o_sequence(cute.make_identity_tensor(mO.shape), HEAD, OFFSET_Q)
    out["lanes"] = []
    for lane in range(32):
        thr = tiled_copy.get_slice(lane)
        tiles = []
        for i in range(nq):
            tOsO, tOgO, tOcO = kernel.varlen_o_partitions(thr, mO_cur, sO_cnt[None, None, i], out["tile_index"][i])
            rec = dict(src=_static(tOsO), dst=_static(tOgO), local=_static(tOcO))
            # the guard method on our evaluation of tOcO (the DSL's indexing is slow; sampled below)
            local = _ByMode(rec["local"])
            rec["guard"] = [kernel.varlen_guard_row(local, m) for m in range(cute.size(tOsO, mode=[1]))]
            if lane in (0, 13):
                out["samples"] += [(rec["guard"][m], kernel.varlen_guard_row(tOcO, m))
                                   for m in (0, len(rec["guard"]) - 1)]
                _sample(out, rec["src"], tOsO, range(0, rec["src"].size, 7))
                _sample(out, rec["dst"], tOgO, range(0, rec["dst"].size, 11))
                mem = kernel.varlen_o_partitions(thr, mO_cur, sO_mem[None, None, i], out["tile_index"][i])[0]
                if str(mem.layout) != str(tOsO.layout):
                    raise AssertionError("the counting sO must partition like the kernel's sO")
            tiles.append(rec)
        out["lanes"].append(tiles)


def trace(kernel: FlashAttentionForwardSm100) -> dict:
    """Trace a probe (fake global tensors, as compile_config passes them) that launches nothing and
    return what the _trace_* helpers read."""
    cfg = kernel.cfg
    out = dict(varlen=kernel.varlen, tm=kernel.tm, dv=kernel.dv, o_cols=kernel.tmem.o, samples=[],
               correction=[], softmax=[], o_chunk_cols=kernel.O_CHUNK_COLS)

    @cute.jit
    def probe(mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor):
        _, _, _, mO = kernel.gmem_views(mQ, mK, mV, mO)
        tiled_mma_qk, tiled_mma_pv, _ = kernel.mmas_and_p_layout()
        thr_qk, thr_pv = tiled_mma_qk.get_slice(0), tiled_mma_pv.get_slice(0)
        sO_layout = kernel.o_smem_layout()
        out["swizzle"] = parse_swizzle(sO_layout.inner)
        out["sO_outer"] = _static(sO_layout.outer)
        # the kernel's sO: a swizzled pointer at a 1024-byte aligned address; and the same layout
        # counting element offsets (before the swizzle), which stay Python integers when sliced
        smem = cute.make_ptr(kernel.dtype, 0, cute.AddressSpace.smem, assumed_align=1024)
        sO_mem = cute.make_tensor(cute.recast_ptr(smem, sO_layout.inner), sO_layout.outer)
        sO_cnt = cute.make_tensor(0, sO_layout.outer)
        _trace_correction(kernel, out, thr_qk, thr_pv, sO_cnt, sO_mem)
        _trace_softmax_stats(kernel, out, thr_qk)
        _trace_stores(kernel, out, mO, sO_cnt, sO_mem, sO_layout)
        # the swizzle function itself, ours against the DSL's (applied to plain integers)
        sw = cute.make_composed_layout(sO_layout.inner, 0, cute.make_layout(1 << 16))
        out["samples"] += [(swizzle(out["swizzle"], x), cute.crd2idx(x, sw)) for x in range(0, 1 << 16, 251)]

    args = fake_args(cfg, kernel.varlen)[:4]
    cute.compile(probe, *args, options=f"--gpu-arch {TARGET_ARCH}")  # builds nothing: only the trace matters
    return out


# ------------------------------------------------------------------ the maps
def _t32x32b_disagreements(inst: StaticTensor, regs: StaticTensor, t: int) -> int:
    """Registers of thread t (of a warpgroup) that the PTX-ISA reading of tcgen05.ld / st 32x32b puts
    elsewhere than CuTe's register-side partition: register v of an instruction at lane base + t % 32,
    column base + v, the base being the address the instruction gets (``inst`` at value 0); warp w
    may only reach lanes 32 (w % 4) ... 32 (w % 4) + 31."""
    bad = 0
    for j in range(regs.size):
        v, *rest = regs.split(j)
        lane0, col0 = decode_address(inst.at_modes((0, *rest)))
        bad += decode_address(regs[j]) != (lane0 + t % 32, col0 + v) or lane0 != 32 * (t // 32 % 4)
    return bad


def _accumulator(traced: dict, i: int) -> tuple:
    """TMEM address -> (m, n) of O_i, and how many elements the data-path reading (M = 128: row m in
    lane m, column n in column base + n) puts elsewhere."""
    coords, addr = traced["acc_coords"], traced["acc_addr"][i]
    to_mn, disagree = {}, 0
    for j in range(addr.size):
        m, n = coords[j]
        to_mn[addr[j]] = (m, n)
        disagree += decode_address(addr[j]) != (m, traced["o_cols"][i] + n)
    return to_mn, disagree


def _o_to_smem(traced: dict, i: int, to_mn: dict, wrong: str | None) -> tuple:
    """(m, n) -> [sO byte, ...] as the correction warpgroup stores O_i (CuTe's partitions); the
    tcgen05.ld reading's and the register coordinates' disagreements with them; and the SMEM
    partition's offsets that are not sO's layout at the partition's own coordinates."""
    spec, outer = traced["swizzle"], traced["sO_outer"]
    if wrong == "swizzle":  # the other swizzle width: 128B <-> 64B
        spec = (2 if spec[0] == 3 else 3, spec[1], spec[2])
    if wrong == "transpose":
        rc_of = {outer.at_modes((r, c, i)): (r, c) for r in range(traced["tm"]) for c in range(traced["dv"])}
    stored, load_disagree, coords_disagree, layout_disagree = {}, 0, 0, 0
    oc = traced["o_chunk_cols"]
    for t, rec in enumerate(traced["correction"]):
        for c, crec in enumerate(rec["tiles"][i]["chunks"]):
            reg_addr, dst = crec["reg_addr"], crec["dst"]
            load_disagree += _t32x32b_disagreements(crec["inst"], reg_addr, t)
            for j in range(reg_addr.size):
                mn = to_mn.get(reg_addr[j], ("not O", reg_addr[j]))
                row, col = rec["coords"][j]  # the register's (row, column in chunk), as the kernel thinks
                coords_disagree += mn != (row, c * oc + col)
                offset = dst[j]
                layout_disagree += offset != outer.at_modes((row, c * oc + col, i))
                if wrong == "transpose":
                    r, cc = rc_of[offset]
                    offset = outer.at_modes((cc, r, i)) if cc < traced["tm"] and r < traced["dv"] else None
                byte = None if offset is None else swizzle(spec, ELEM_BYTES * offset)
                stored.setdefault(mn, []).append(byte)
    return stored, load_disagree, coords_disagree, layout_disagree


def _tma_reads(traced: dict, i: int) -> tuple:
    """(tile row, column) -> [sO byte, ...] the TMA stores of tile i fill it from, by CuTe's partition,
    and how many places the box reading (dense image, innermost box dimension fastest, the TMA
    swizzle mode of its row width) fills from elsewhere."""
    smem, coords, row0 = traced["tma_smem"], traced["tma_coords"][i], traced["q_row0"][i]
    spec = traced["swizzle"]

    def place(col, row, head, batch):
        return (row - row0, col) if (head, batch) == (HEAD, BATCH) else ("elsewhere", row, col, head, batch)

    cute_read, layout_disagree = {}, 0
    for k in range(coords.size):
        col, row, _, _ = coords[k]
        offset = smem.at_modes((k, i))
        cute_read.setdefault(place(*coords[k]), []).append(swizzle(spec, ELEM_BYTES * offset))
        layout_disagree += (not 0 <= row - row0 < traced["tm"]
                            or offset != traced["sO_outer"].at_modes((row - row0, col, i)))
    atom = traced["tma_atom"]
    (inner, inner_mode), (outer, outer_mode) = atom["box"]
    if (inner_mode, outer_mode) != (1, 0) or inner * outer * ELEM_BYTES != atom["copy_bytes"]:
        raise ValueError(f"unexpected TMA box {atom}")
    box_vals = inner * outer
    hw_read = {}
    for k0 in range(0, coords.size, box_vals):  # one TMA store instruction each
        start = ELEM_BYTES * smem.at_modes((k0, i))
        c0, r0, head, batch = coords[k0]
        for e in range(box_vals):
            r, c = divmod(e, inner)
            hw_read.setdefault(place(c0 + c, r0 + r, head, batch), []).append(
                tma_swizzle(inner * ELEM_BYTES, start + ELEM_BYTES * e))
    disagree = sum(cute_read.get(p) != hw_read.get(p) for p in set(cute_read) | set(hw_read))
    return cute_read, disagree, layout_disagree


def _varlen_reads(traced: dict, i: int, wrong: str | None) -> tuple:
    """(tile row, column) -> [sO byte, ...] the lanes' 16-byte stores fill it from (CuTe's partitions); guard
    mismatches summed over the tile's possible valid row counts L = 0 .. tm (a store must happen iff
    its row < L); and the vector reading's and the tile coordinates' disagreements."""
    spec, row0 = traced["swizzle"], traced["q_row0"][i]
    shift = traced["tile_row0"][i] - row0 + (wrong == "guard_row")  # the guard counts rows from tile_row0
    reads, guard_bad, vec_disagree, local_disagree, layout_disagree = {}, 0, 0, 0, 0
    for lane_tiles in traced["lanes"]:
        rec = lane_tiles[i]
        src, dst, local = rec["src"], rec["dst"], rec["local"]
        first = {}
        for j in range(src.size):
            k, m, rest = src.split(j)  # value of a store, the lane's row store, column tile
            byte = swizzle(spec, ELEM_BYTES * src[j])
            row, col, head = dst[j]
            r = row - OFFSET_Q - row0
            reads.setdefault((r, col) if head == HEAD else ("elsewhere", row, col, head), []).append(byte)
            local_disagree += tuple(local[j]) != (r, col)
            layout_disagree += src[j] != traced["sO_outer"].at_modes((*local[j], i))
            guard_bad += abs(rec["guard"][m] + shift - r)  # each L between the two: stored when it must not, or not
            vec, v = divmod(k, 8)        # 128-bit stores: 8 16-bit values each
            if v == 0:
                first[(m, rest, vec)] = (byte, row, col)
            b0, row_0, col_0 = first[(m, rest, vec)]
            vec_disagree += (byte, row, col) != (b0 + ELEM_BYTES * v, row_0, col_0 + v) or col_0 % 8 or b0 % 16
    return reads, guard_bad, vec_disagree, local_disagree, layout_disagree


def _lse_rows(traced: dict, i: int, to_mn: dict) -> tuple:
    """Rows of tile i whose lse is not written exactly once, at its own row, by the thread that read
    that row's (row_sum, row_max) and normalised that row of O; and the models' disagreements."""
    writers, disagree = {}, 0
    for s, rec in enumerate(traced["softmax"][i]):
        rows = {rec["s_coords"][j][0] for j in range(rec["s_coords"].size)}
        disagree += _t32x32b_disagreements(rec["inst"], rec["reg_addr"], s) + (len(rows) != 1)
        for j in range(rec["reg_addr"].size):  # rFinal[0] = row_sum, rFinal[1] = row_max
            writers.setdefault(rec["reg_addr"][j], []).append((min(rows), j))
    lse_ok = traced["lse_coord"] == ([(BATCH, HEAD, r) for r in (0, 1, 200)] if not traced["varlen"]
                                     else [(HEAD, OFFSET_Q + r) for r in (0, 1, 200)])
    written = {}
    for t, rec in enumerate(traced["correction"]):
        stats = rec["tiles"][i]["stats"]
        disagree += _t32x32b_disagreements(stats["inst"], stats["reg_addr"], t)
        got = [writers.get(stats["reg_addr"][j], []) for j in range(stats["reg_addr"].size)]
        o_rows = {to_mn.get(c["reg_addr"][j], (None,))[0]
                  for c in rec["tiles"][i]["chunks"] for j in range(c["reg_addr"].size)}
        if not (len(got) == 2 and all(len(g) == 1 for g in got) and got[0][0][1] == 0 and got[1][0][1] == 1
                and got[0][0][0] == got[1][0][0] and o_rows == {got[0][0][0]}):
            continue  # this thread's lse is not some row's: the row it claims stays unproven
        # correction(): row = o_tile_row0 + tOcO_row, tOcO_row the row of the first O register
        lse_row = traced["tile_row0"][i] + rec["coords"][0][0] - traced["q_row0"][i]
        written.setdefault(lse_row, []).append(got[0][0][0])
    bad = sum(written.get(r) != [r] or not lse_ok for r in range(traced["tm"]))
    return bad, disagree


def report(traced: dict, wrong: str | None = None) -> dict:
    """Per Q tile i: {"O_i": {...}, "lse_i": {...}} with the elements (rows) that do not arrive
    exactly once at their own place, the coverage counts and each model's disagreements.
    ``wrong`` (one of WRONG) applies a deliberately wrong mapping, so the check can be seen to fail."""
    if wrong is not None and wrong not in WRONG:
        raise ValueError(f"wrong: one of {WRONG}, got {wrong!r}")
    if wrong == "guard_row" and not traced["varlen"]:
        raise ValueError("guard_row: only the varlen stores have a row guard")
    evaluator = sum(a != b for a, b in traced["samples"])
    out = {}
    for i in range(len(traced["acc_addr"])):
        to_mn, acc_disagree = _accumulator(traced, i)
        stored, load_disagree, coords_disagree, store_layout = _o_to_smem(traced, i, to_mn, wrong)
        rec = dict(acc_models_disagree=acc_disagree, load_models_disagree=load_disagree,
                   register_coords_disagree=coords_disagree, evaluator_vs_dsl=evaluator,
                   store_partition_vs_sO=store_layout)
        if traced["varlen"]:
            reads, rec["guard_mismatches"], rec["vector_models_disagree"], rec["tile_coords_disagree"], \
                rec["read_partition_vs_sO"] = _varlen_reads(traced, i, wrong)
        else:
            reads, rec["box_models_disagree"], rec["read_partition_vs_sO"] = _tma_reads(traced, i)
        elements = set(to_mn.values())
        content = {}  # sO byte -> the elements of O_i stored there
        for mn, places in stored.items():
            for b in places:
                content.setdefault(b, []).append(mn)
        # a place of the tile is right iff it is filled once, from the byte that holds its own element
        rec.update(elements=len(elements),
                   mismatches=sum(len(reads.get(p, [])) != 1 or content.get(reads[p][0]) != [p] for p in elements)
                   + sum(len(v) for p, v in reads.items() if p not in elements),  # written outside the tile
                   not_stored=sum(mn not in stored for mn in elements) + sum(mn not in elements for mn in stored),
                   stored_twice=sum(len(v) > 1 for v in content.values()),
                   read_unwritten=len({b for v in reads.values() for b in v} - set(content)))
        out[f"O_{i}"] = rec
        bad_rows, stats_disagree = _lse_rows(traced, i, to_mn)
        out[f"lse_{i}"] = dict(rows=traced["tm"], mismatches=bad_rows, stats_models_disagree=stats_disagree)
    return out


def epilogue_mismatches(kernel: FlashAttentionForwardSm100 | None, wrong: str | None = None,
                        traced: dict | None = None) -> dict:
    """{"O_0": n, "O_1": n, "lse_0": n, "lse_1": n} (varlen: also "guard_0", "guard_1"): elements of
    each O tile not landing exactly once at their own place in global memory, rows whose lse does
    not, and row-guard mismatches (0 everywhere = they agree). `traced` reuses trace(kernel)."""
    rep = report(trace(kernel) if traced is None else traced, wrong)
    out = {name: r["mismatches"] for name, r in rep.items()}
    for name, r in rep.items():
        if "guard_mismatches" in r:
            out[f"guard_{name[2:]}"] = r["guard_mismatches"]
    return out


# ------------------------------------------------------------------ the emitted code
_TMA_STORE = re.compile(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta\S*\s+"
                        r"\[%rd\d+,\s*\{(%r\d+),\s*(%r\d+)[^}]*\}\],\s*\[(%r\d+)(?:\+(\d+))?\]")
_MOV_IMM = re.compile(r"mov\.b32\s+(%r\d+),\s*(-?\d+);")
_ADD_IMM = re.compile(r"add\.s32\s+(%r\d+),\s*(%r\d+),\s*(-?\d+);")


def ptx_tma_stores(ptx: str) -> list:
    """(SMEM byte offset, column, row offset) of every TMA store in the PTX, in program order: the
    SMEM offsets counted from the first store's, the column an immediate, the row a common base
    register or base + immediate (rows counted from that base)."""
    movs = dict(_MOV_IMM.findall(ptx))
    adds = {dst: (src, int(c)) for dst, src, c in _ADD_IMM.findall(ptx)}
    found = []
    for col, row, base, off in _TMA_STORE.findall(ptx):
        if col not in movs:
            raise ValueError(f"TMA store column {col} is not an immediate")
        found.append((base, int(off or 0), int(movs[col]), adds.get(row, (row, 0))))
    if not found or len({b for b, *_ in found}) != 1 or len({r[0] for *_, r in found}) != 1:
        raise ValueError("TMA stores not of the form [sO + offset], {column, row base + offset}")
    first = found[0][1]
    return [(off - first, col, row[1]) for _, off, col, row in found]


def expected_tma_stores(traced: dict) -> list:
    """The same triples as the trace has them: per Q tile, per box, its first element's SMEM byte
    (before the swizzle: boxes start on swizzle-period boundaries), column and row from tile 0's
    first row."""
    smem, atom = traced["tma_smem"], traced["tma_atom"]
    box_vals = atom["copy_bytes"] // ELEM_BYTES
    out = []
    for i, coords in enumerate(traced["tma_coords"]):
        for k0 in range(0, coords.size, box_vals):
            c0, r0, _, _ = coords[k0]
            out.append((ELEM_BYTES * smem.at_modes((k0, i)), c0, r0 - traced["q_row0"][0]))
    return out


_ST_SHARED = re.compile(r"st\.shared\.b16\s+\[(%r\d+)(?:\+(\d+))?\],\s*(0x[0-9A-Fa-f]+);")
_BIT_OP_IMM = re.compile(r"(add\.s32|xor\.b32|and\.b32)\s+(%r\d+),\s*(%r\d+),\s*(-?\d+);")
_APPLY = {"add.s32": lambda x, c: x + c, "xor.b32": lambda x, c: x ^ c, "and.b32": lambda x, c: x & c}


def _smem_offset(reg: str, ops: dict) -> int:
    """The value of `reg` relative to the base register its add / xor / and chain starts from (the
    base is 1024-byte aligned and the immediates touch lower bits only, so the base drops out)."""
    if reg not in ops:
        return 0
    op, src, c = ops[reg]
    return _APPLY[op](_smem_offset(src, ops), c)


def _half_bits(dtype, x: float) -> str:
    """The 16-bit pattern of x in dtype, as PTX prints an immediate (4 hex digits)."""
    if dtype is BFloat16:
        return format(struct.unpack("<I", struct.pack("<f", x))[0] >> 16, "04X")
    return format(struct.unpack("<H", struct.pack("<e", x))[0], "04X")


def ptx_pointer_swizzle(kernel: FlashAttentionForwardSm100, coords=((1, 0), (2, 8), (9, 3), (37, 45), (127, 63))):
    """Compile a one-warp kernel that writes the value k + 1 to sO[coords[k]] through the kernel's sO
    layout (a swizzled pointer, 1024-byte aligned) and read the byte each st.shared hits from the
    PTX: {coordinate: (byte in the PTX, our model's byte: swizzle of 2 x the offset)}."""
    from cutlass.memory import SmemAllocator

    bits_of = {_half_bits(kernel.dtype, k + 1.0): c for k, c in enumerate(coords)}  # tells the stores apart
    out = {}

    class Probe:
        @cute.jit
        def __call__(self, stream):
            layout = kernel.o_smem_layout()
            out["swizzle"], out["outer"] = parse_swizzle(layout.inner), _static(layout.outer)

            @cute.struct
            class Storage:
                sO: cute.struct.Align[cute.struct.MemRange[kernel.dtype, cute.cosize(layout)], 1024]

            self.storage = Storage
            self.kernel(layout).launch(grid=[1, 1, 1], block=[32, 1, 1], stream=stream)

        @cute.kernel
        def kernel(self, layout: cute.ComposedLayout):
            sO = SmemAllocator().allocate(self.storage).sO.get_tensor(layout.outer, swizzle=layout.inner)
            for k, (r, c) in enumerate(coords):
                sO[r, c, 0] = kernel.dtype(k + 1.0)

    opts = f"--gpu-arch {TARGET_ARCH} --keep-ptx --dump-dir {compile_cache.dump_dir()}"  # not into the cwd
    ptx = cute.compile(Probe(), cute.runtime.make_fake_stream(), options=opts).__ptx__
    ops = {d: (op, s, int(c)) for op, d, s, c in _BIT_OP_IMM.findall(ptx)}
    for reg, off, value in _ST_SHARED.findall(ptx):
        byte = int(off or 0) + _smem_offset(reg, ops)
        r, c = bits_of[value.upper().replace("0X", "")]
        out[(r, c)] = (byte, swizzle(out["swizzle"], ELEM_BYTES * out["outer"].at_modes((r, c, 0))))
    return {k: v for k, v in out.items() if isinstance(k, tuple)}


# ------------------------------------------------------------------ command line
def table(cases=((64, 64), (96, 96), (128, 128), (192, 128), (256, 256)), dtype: str = "bf16", ptx: bool = False) -> str:
    """Markdown: per case (dense, varlen) the mismatches of the kernel as built and of each wrong
    mapping; with `ptx`, whether the compiled TMA stores are the traced boxes (one compile per case)."""
    head = "| d / dv | stores | O_0, O_1 | lse_0, lse_1 | guard_0, guard_1 | " + " | ".join(WRONG) + \
           " | model disagreements |" + (" PTX boxes |" if ptx else "")
    lines = [head, "|---" * (6 + len(WRONG) + ptx) + "|"]
    for d, dv in cases:
        cfg = make_config(dtype, d, dv, False, q_tiles_per_cta=q_tiles_for(d, dv))  # 256: one Q tile
        for varlen in (False, True):
            traced = trace(FlashAttentionForwardSm100(cfg, varlen=varlen))
            rep = report(traced)
            got = epilogue_mismatches(None, traced=traced)
            wrong = []
            for w in WRONG:
                if w == "guard_row" and not varlen:
                    wrong.append("-")
                    continue
                r = epilogue_mismatches(None, w, traced)
                keys = ("guard_0", "guard_1") if w == "guard_row" else ("O_0", "O_1")
                wrong.append(", ".join(str(r[k]) for k in keys))
            models = sum(v for r in rep.values() for k, v in r.items()
                         if k.endswith("disagree") or k == "evaluator_vs_dsl")
            guard = f"{got['guard_0']}, {got['guard_1']}" if varlen else "-"
            row = (f"| {d} / {dv} | {'varlen 16 B' if varlen else 'TMA'} | {got['O_0']}, {got['O_1']} | "
                   f"{got['lse_0']}, {got['lse_1']} | {guard} | " + " | ".join(wrong) + f" | {models} |")
            if ptx:
                same = "-"
                if not varlen:
                    got_ptx = sorted(ptx_tma_stores(compile_config(cfg).ptx))
                    same = "same" if got_ptx == sorted(expected_tma_stores(traced)) else "DIFFERENT"
                row += f" {same} |"
            lines.append(row)
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ptx", action="store_true", help="also compile each dense case and compare its TMA stores")
    print(table(ptx=ap.parse_args().ptx))
