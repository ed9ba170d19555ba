"""Host-side layout checks of the Blackwell 2-CTA backward (blackwell_bwd_2cta.py), element by element
at trace time. Two hand-overs between the CTAs of a pair have no other check without a Blackwell GPU:

(a) dQ rows. The pair MMA dQ = dS K (M = 128 queries) leaves 64 rows of the tile in each CTA's TMEM;
    each CTA's drain warpgroup adds "its" rows to the fp32 dQ accumulator. Compared, per CTA c, drain
    thread t and register k:
      read side   the TMEM address thread t loads into rdq[k] -- the kernel's own ``_row_copies``
                  tcgen05.ld partition of the kernel's ``_acc`` view, evaluated on a counting view
                  (TMEM addresses as integers) -- must lie in the warp's lane quadrant (t // 32);
      MMA side    which dQ tile element (m, n) the MMA leaves at that address in CTA c: the dQ
                  accumulator fragment (``make_fragment_C``) against ``partition_C`` of CTA c's slice;
      global side the row / column the drain adds it to (``dq_row`` / ``dq_col0`` + k, the kernel's
                  own methods) must be (m_block * 128 + m, n).
    Over both CTAs, every element of the 128 x d tile must be added exactly once.

(b) dS through DSMEM. The elementwise thread of key `key` in CTA r writes dS[64h + i, 128r + key]
    (16-bit) into its own sdS (h = r) or into sXchg (h = peer), through ``ds_column`` of the kernel's
    sdS layout (swizzle folded in by CuTe: evaluated on a counting tensor); one bulk copy moves the
    first ``xchg_bytes`` of sXchg to the peer's sdS at ``xchg_dst_offset(r)``. The reader is the dQ
    MMA's A operand in CTA h: flat fragment index j holds A[m, k] per ``partition_A`` of CTA h's slice
    and sits at sdS_layout(j) -- the swizzle S<b, m, s> applied here in Python to the natural offset
    (blackwell_layout_check.natural_offset). Every writer element must land at the reader's offset,
    inside the copied range, and each CTA's sdS (64 x 256) must be written exactly once per element.

    from stage4_bwd_kernel.blackwell_2cta_check import dq_rows_mismatches, ds_exchange_mismatches
    dq_rows_mismatches(kernel)                          # all counts 0
    dq_rows_mismatches(kernel, wrong="same_rows")       # both CTAs claim rows 0..63: non-zero
    ds_exchange_mismatches(kernel, wrong="peer_offset")  # sXchg lands at key column 0: non-zero

``ptx_exchange`` reads the compiled kernel's one bulk copy back from the PTX (its size, the
per-rank shift of its destination, the peer as rank ^ 1), so the offset modelled here is the one
emitted: the tests compare it with ``xchg_bytes`` / ``xchg_dst_offset``.

What it proves: as CuTe-DSL 4.8.1 describes the layouts and as this kernel builds them (its
``pair_mmas``, ``sds_layout``, ``_acc``, ``_row_copies``, ``ds_column``, ``xchg_dst_offset``,
``dq_row``, ``dq_col0``), the pair's drains partition every dQ tile exactly, and the dS exchange puts
every element where the peer's dQ MMA operand layout expects it. What it cannot prove: the hardware
semantics of a cta_group::2 MMA (that CTA c's TMEM holds rows 64c.. of M = 128 and that its A rows
come from CTA c's SMEM is CuTe's partition, trusted, not decoded); that the descriptors emitted
address sdS as that layout says; the ordering (the protocol model covers it); sXchg is rebuilt as a
counting tensor of sdS's layout, which is how the kernel builds it (``recast_ptr`` of sdS's swizzle +
sdS's outer layout), not read back from the kernel; the PTX check reads the copy's size and
rank shift but not the SharedStorage offsets of sdS / sXchg; and the values written (rdS indexing within a
thread, ``h * 64 + i``, is modelled from the kernel's code, which runs on the device).
"""
from __future__ import annotations

import re
from collections import Counter

import cutlass.cute as cute
from cutlass import Float32

from stage3_fwd_kernel.blackwell_fwd import TARGET_ARCH
from stage3_fwd_kernel.blackwell_tmem_check import LANE_SHIFT, _static
from stage4_bwd_kernel.blackwell_bwd_2cta import PAIR, FlashAttentionBackwardSm100TwoCta, make_config
from stage4_bwd_kernel.blackwell_layout_check import natural_offset

M_BLOCK = 3    # any Q tile: a non-zero one so the global row offset is exercised
CH = 32        # columns per tcgen05.ld in the drain (as the kernel's _tmem_load_row)


def make_kernel(d: int, dtype: str = "bf16") -> FlashAttentionBackwardSm100TwoCta:
    return FlashAttentionBackwardSm100TwoCta(make_config(dtype, d))


# ------------------------------------------------------------------ the trace
def _collect(kernel: FlashAttentionBackwardSm100TwoCta, out: dict):
    """Plain Python inside the probe's trace (loops stay Python loops)."""
    tm, tn, d = kernel.tm, kernel.tn, kernel.d
    mma_s, _, _, _, mma_dq = kernel.pair_mmas()
    # (a) dQ: accumulator fragment (offsets from T.dq) and, per CTA, the tile coordinate of each index
    out["dq_frag"] = _static(mma_dq.make_fragment_C(mma_dq.partition_shape_C((tm, d))).layout)
    out["dq_coords"] = [_static(mma_dq.get_slice(c).partition_C(cute.make_identity_tensor((tm, d))))
                        for c in range(PAIR)]
    fake = cute.make_ptr(Float32, 0, cute.AddressSpace.tmem, assumed_align=16)  # never dereferenced
    acc_f = kernel._acc(fake, mma_s, (PAIR * tn, tm), kernel.tmem.dq)       # as dq_drain_pair builds it
    acc_n = kernel._acc(0, mma_s, (PAIR * tn, tm), kernel.tmem.dq)          # the same, as TMEM addresses
    if str(acc_f.layout) != str(acc_n.layout):
        raise AssertionError("the counting view must have the drain's TMEM layout")
    # tcgen05.ld is warp-collective: its source partition spans the warp, so a thread's registers are
    # read from the destination side -- register j holds (lane, column) of the 128 x 32 chunk view
    sub = kernel._row_copies(acc_f, 0)[0]
    out["drain_views"] = [_static(sub(acc_n, c * CH, CH)) for c in range(d // 2 // CH)]
    out["drain"] = [_static(kernel._row_copies(acc_f, t)[3].partition_D(cute.make_identity_tensor((tn, CH))))
                    for t in range(tm)]
    # (b) dS: writer columns (CuTe folds the swizzle into the static slice), reader's A coordinates
    sds = kernel.sds_layout(mma_dq)
    out["sds"] = (sds.outer.shape, sds.outer.stride, str(sds.inner), cute.cosize(sds.outer))
    counting = cute.make_tensor(0, sds)
    out["ds_cols"] = [_static(kernel.ds_column(counting, k)) for k in range(PAIR * tn)]
    out["a_coords"] = [_static(mma_dq.get_slice(c).partition_A(cute.make_identity_tensor((tm, PAIR * tn))))
                       for c in range(PAIR)]
    out["samples"] = [(k, i, sds(((i, k % 16), 0, k // 16, 0))) for k in (0, 17, 130, 255) for i in (0, 9, 63)]


def trace(kernel: FlashAttentionBackwardSm100TwoCta) -> dict:
    out: dict = {}

    @cute.jit
    def probe():
        _collect(kernel, out)

    cute.compile(probe, options=f"--gpu-arch {TARGET_ARCH}")  # builds nothing: only the trace matters
    return out


# ------------------------------------------------------------------ (a) dQ rows
def dq_rows_mismatches(kernel=None, wrong: str | None = None, traced: dict | None = None, d: int = 128) -> dict:
    """Counts, all 0 when correct: wrong_element (a drained value added at another global (row, col)
    than the MMA element it holds), lane_quadrant, not_written (TMEM read that the MMA did not write),
    coverage (tile elements not added exactly once). wrong: "same_rows" (both CTAs use rank 0's rows),
    "swapped_rows" (each CTA adds the other's rows: still a partition, but of the wrong values)."""
    kernel = kernel or make_kernel(d)
    traced = traced or trace(kernel)
    tm, d = kernel.tm, kernel.d
    frag, base = traced["dq_frag"], kernel.tmem.dq
    counts = Counter(wrong_element=0, lane_quadrant=0, not_written=0, coverage=0)
    added: Counter = Counter()
    for c in range(PAIR):
        coords = traced["dq_coords"][c]
        mma_map = {base + frag[j]: coords[j] for j in range(frag.size)}   # TMEM address -> (m, n)
        rank = {None: c, "same_rows": 0, "swapped_rows": c ^ 1}[wrong]
        for t, regs in enumerate(traced["drain"]):
            row, col0 = kernel.dq_row(rank, t, M_BLOCK), kernel.dq_col0(t)
            for k in range(d // 2):   # rdq[k] = register k % 32 of the load of chunk k // 32
                addr = traced["drain_views"][k // CH].at_modes(regs[k % CH])
                counts["lane_quadrant"] += (addr >> LANE_SHIFT) // 32 != t // 32
                mn = mma_map.get(addr)
                if mn is None:
                    counts["not_written"] += 1
                    continue
                counts["wrong_element"] += (row, col0 + k) != (M_BLOCK * tm + mn[0], mn[1])
                added[(row, col0 + k)] += 1
    for r in range(M_BLOCK * tm, M_BLOCK * tm + tm):
        for n in range(d):
            counts["coverage"] += added[(r, n)] != 1
    counts["coverage"] += sum(1 for key in added if not (M_BLOCK * tm <= key[0] < M_BLOCK * tm + tm))
    return dict(counts)


# ------------------------------------------------------------------ (b) dS through DSMEM
def _swizzle(text: str):
    """CuTe's Swizzle<B, M, S> as a function of an element offset."""
    b, m, s = (int(x) for x in re.fullmatch(r"S<(\d+),(\d+),(\d+)>", text).groups())
    mask = ((1 << b) - 1) << (m + s)
    return lambda x: x ^ ((x & mask) >> s)


def ds_exchange_mismatches(kernel=None, wrong: str | None = None, traced: dict | None = None, d: int = 128) -> dict:
    """Counts, all 0 when correct: misplaced (an element lands elsewhere than the peer's -- or its own
    -- dQ MMA reads it), outside_copy (an sXchg element outside the bulk copy's bytes), coverage (sdS
    elements of either CTA not written exactly once), samples (our swizzle vs CuTe's, on a few
    coordinates). wrong: "peer_offset" (sXchg lands at key column 0 of the peer, not 128 x rank),
    "same_half" (both CTAs keep query rows 0..63 and send 64..127)."""
    kernel = kernel or make_kernel(d)
    traced = traced or trace(kernel)
    tn, half = kernel.tn, kernel.tm // 2
    shape, stride, swz_text, cosize = traced["sds"]
    swz = _swizzle(swz_text)
    counts = Counter(misplaced=0, outside_copy=0, coverage=0, samples=0)
    for k, i, cute_offset in traced["samples"]:
        counts["samples"] += swz(natural_offset(shape, stride, i, k)) != cute_offset
    # reader: CTA h's dQ MMA takes A[m, k] (m in 64h..64h+63) from element offset sdS(j)
    reader = []
    for h in range(PAIR):
        coords = traced["a_coords"][h]
        reader.append({coords[j]: swz(natural_offset(shape, stride, j % half, j // half)) for j in range(coords.size)})
    written = [Counter(), Counter()]
    copied = kernel.xchg_bytes // 2                     # elements the bulk copy moves
    for r in range(PAIR):
        own = 0 if wrong == "same_half" else r
        dst = kernel.xchg_dst_offset(0 if wrong == "peer_offset" else r)
        for key in range(tn):
            kk = r * tn + key
            for h in range(PAIR):
                for i in range(half):
                    if h == own:            # own rows: straight into this CTA's sdS
                        cta, offset = r, traced["ds_cols"][kk][i]
                    else:                   # the peer's rows: sXchg, then the bulk copy
                        x = traced["ds_cols"][key][i]
                        counts["outside_copy"] += not 0 <= x < copied
                        cta, offset = r ^ 1, x + dst
                    written[cta][offset] += 1
                    counts["misplaced"] += reader[cta].get((h * half + i, kk)) != offset
    for cta in range(PAIR):
        counts["coverage"] += sum(written[cta][o] != 1 for o in range(cosize))
        counts["coverage"] += sum(1 for o in written[cta] if not 0 <= o < cosize)
    return dict(counts)


def ptx_exchange(ptx: str) -> dict:
    """The dS bulk copy as compiled: {"bytes", "rank_shift", "peer_xor"} read from the PTX around the
    one ``cp.async.bulk.shared::cluster`` (dst = base + (rank << rank_shift) + sdS's offset; the peer
    is rank ^ peer_xor). None where the PTX does not have that shape."""
    m = re.search(r"mapa\.shared::cluster\.u32 dst_c, (%r\d+), (%r\d+);.*?"
                  r"cp\.async\.bulk\.shared::cluster\.shared::cta\S* \[dst_c\], \[%r\d+\], (%r\d+),", ptx, re.S)
    if not m:
        return None
    before = ptx[:m.start()]

    def define(reg, pattern):  # the last definition of `reg` before the copy
        hits = re.findall(rf"\t{pattern.format(re.escape(reg))};", before)
        return hits[-1] if hits else None

    dst, peer, nbytes = m.groups()
    out = {"bytes": define(nbytes, r"mov\.b32 \t?{}, (\d+)")}
    add_const = re.findall(rf"add\.s32 \t?{re.escape(dst)}, (%r\d+), \d+;", before)
    rank_reg = shift = None
    if add_const:
        summed = re.findall(rf"add\.s32 \t?{re.escape(add_const[-1])}, %r\d+, (%r\d+);", before)
        if summed:
            hit = re.findall(rf"shl\.b32 \t?{re.escape(summed[-1])}, (%r\d+), (\d+);", before)
            if hit:
                rank_reg, shift = hit[-1]
    xor = re.findall(rf"xor\.b32 \t?{re.escape(peer)}, (%r\d+), (\d+);", before)
    out["rank_shift"] = None if shift is None else int(shift)
    out["peer_xor"] = int(xor[-1][1]) if xor and xor[-1][0] == rank_reg else None
    out["bytes"] = None if out["bytes"] is None else int(out["bytes"])
    return out


def table(ds=(64, 128)) -> dict:
    """{(d, check, wrong): counts} for the real layouts and the negative controls."""
    out = {}
    for d in ds:
        kernel = make_kernel(d)
        traced = trace(kernel)
        for w in (None, "same_rows", "swapped_rows"):
            out[(d, "dq_rows", w)] = dq_rows_mismatches(kernel, w, traced)
        for w in (None, "peer_offset", "same_half"):
            out[(d, "ds_exchange", w)] = ds_exchange_mismatches(kernel, w, traced)
    return out


if __name__ == "__main__":
    for key, counts in table().items():
        print(*key, counts, flush=True)
