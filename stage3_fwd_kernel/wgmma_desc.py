"""wgmma with shared-memory descriptors built once per tile, outside the key-block loop.

``cute.gemm`` on a Hopper wgmma atom lowers each shared-memory operand's descriptor where the wgmma is
issued. In the forward's key-block loop that is every block, for Q, K and V: the operand's offset
added to the shared-memory base, a shift, a mask, the fixed fields ORed in, then 64-bit adds (with
carry) per k-step. ptxas does not hoist them (for the official kernel it hoisted Q's and K's), so at
d = 128 they were ~30 uniform-datapath instructions of a ~500-instruction block.

Here the kernel builds the descriptors itself, once per tile: Q's for every k-step (Q does not move),
K's and V's for stage 0, to which each block adds ``stage * stage_step``. They pass through a warp
shuffle: ptxas re-derives plain arithmetic on the shared-memory base inside the loop (it did so even
for loop-carried values), but cannot redo a shuffle there, so they stay in uniform registers. The
wgmma itself is one inline-PTX ``wgmma.mma_async`` per k-step, the instruction ``cute.gemm`` emits
(same shape, types, scale and transpose immediates), so results are bitwise those of ``cute.gemm``
(checked bit for bit on an H100, every head dim).

Descriptor fields (PTX ISA, wgmma "Matrix Descriptor Format"): bits 0-13 start address >> 4; 16-29
leading-dimension byte offset >> 4 (unused by K-major swizzled operands, 1 as the DSL writes it; for
MN-major V the distance between dv-chunks one swizzle row wide); 32-45 stride-dimension byte offset
>> 4 (8 rows of the swizzle width: the distance between 8-row core-matrix groups); 62-63 the swizzle
mode (1 = 128 B, 2 = 64 B, 3 = 32 B). Offsets into a tile are the unswizzled ones, as in ``cute.gemm``.
"""
from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

_SWIZZLE_MODE = {128: 1, 64: 2, 32: 3}


def swizzle_bytes(cols: int, width_bits: int) -> int:
    """The swizzle width (bytes) `sm90_utils.get_smem_layout_atom` picks for a K-major tile with `cols`
    contiguous elements: the widest of 128 / 64 / 32 bytes that divides a row."""
    row_bits = cols * width_bits
    for sw in (128, 64, 32):
        if row_bits % (sw * 8) == 0:
            return sw
    raise ValueError(f"cols: {cols} elements of {width_bits} bits fit no wgmma swizzle (need a multiple of 32 bytes)")


def desc_hi(swizzle: int) -> int:
    """The descriptor's upper 32 bits: stride byte offset (8 rows of `swizzle` bytes) and the swizzle mode."""
    return (8 * swizzle >> 4) | (_SWIZZLE_MODE[swizzle] << 30)


def leading_offset(cols: int, rows: int, width_bits: int, mn_major: bool) -> int:
    """The leading-dimension byte offset >> 4 of a (rows, cols) tile stored row-major with the swizzle
    `swizzle_bytes(cols)`: read K-major (Q, K) it is unused, 1; read MN-major (V), it is the distance
    between column chunks one swizzle row wide, `rows` rows of `swizzle` bytes (tile_to_shape stacks
    the swizzle atoms down the rows first), or 1 when there is a single chunk."""
    sw = swizzle_bytes(cols, width_bits)
    if not mn_major or cols * width_bits // 8 <= sw:
        return 1
    return rows * sw >> 4


def fixed_fields(cols: int, rows: int, width_bits: int, mn_major: bool) -> int:
    """Every descriptor field but the start address, as one 64-bit value: what ``cute.gemm``'s
    lowering ORs into its descriptors (tests compare the two in step 3's PTX)."""
    return desc_hi(swizzle_bytes(cols, width_bits)) << 32 | leading_offset(cols, rows, width_bits, mn_major) << 16


def desc_lo(smem_addr: Int32, leading: int = 1) -> Int32:
    """The lower 32 bits for an operand at byte address `smem_addr` of shared memory (aligned to its
    swizzle pattern): start address >> 4 and the leading byte offset (>> 4)."""
    return ((smem_addr >> 4) & 0x3FFF) | (leading << 16)


def desc_offset(layout_outer: cute.Layout, coord: tuple, width_bits: int) -> int:
    """Descriptor units (16 bytes) from an operand's first element to `coord` (trailing modes, the
    stages, at 0 unless given): the unswizzled offset, as cute.gemm adds it; a compile-time int."""
    coord = coord + (0,) * (cute.rank(layout_outer) - len(coord))
    return cute.crd2idx(coord, layout_outer) * width_bits // 8 // 16


def desc64(lo: Int32, hi) -> Int64:
    """A full descriptor from its lower and upper halves."""
    return (Int64(Uint32(hi)) << 32) | Int64(Uint32(lo))


def ab_type(dtype) -> str:
    """The PTX type of a 16-bit wgmma operand."""
    name = getattr(dtype, "__name__", str(dtype))
    if name not in ("BFloat16", "Float16"):
        raise TypeError(f"dtype: expected cutlass.BFloat16 or cutlass.Float16, got {name}")
    return "bf16" if name == "BFloat16" else "f16"


def _issue(acc: cute.Tensor, n: int, ptx_type: str, operands: list, operand_constraints: list, operand_text: str,
           loc, ip, first: int = 0):
    """One ``wgmma.mma_async.m64n{n}k16.f32`` as inline PTX, the instruction cute.gemm emits: acc's n / 2
    fp32 registers from `first` on are its D (written back in place, tied to their inputs), `operands`
    follow as $c.. ($c = n / 2), the last one the scale-d flag; `operand_text` is the text after D, p
    for scale-d. The registers of columns 8 j .. 8 j + 7 are 4 j .. 4 j + 3 at every n, so an n-column
    wgmma from `first` = 4 j computes columns 8 j .. of a wider accumulator."""
    count = n // 2
    ins = operands + [Float32(acc[first + i]).ir_value(loc=loc, ip=ip) for i in range(count)]
    regs = ", ".join(f"${i}" for i in range(count))
    flag = count + len(operands) - 1
    instr = f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ptx_type}.{ptx_type}"
    asm = f"{{\n\t.reg .pred p;\n\tsetp.ne.b32 p, ${flag}, 0;\n\t{instr} {{{regs}}}, {operand_text};\n\t}}"
    constraints = ",".join(["=f"] * count + operand_constraints + [str(i) for i in range(count)])
    out = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * count), ins, asm, constraints,
                          has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                          loc=loc, ip=ip)
    for i in range(count):
        acc[first + i] = Float32(llvm.extractvalue(T.f32(), out, [i], loc=loc, ip=ip))


@dsl_user_op
def wgmma_ss(acc: cute.Tensor, a_desc: Int64, b_desc: Int64, accumulate: bool, n: int, ptx_type: str,
             trans_b: bool = False, first: int = 0, *, loc=None, ip=None) -> None:
    """acc (+)= A B for one k-step of 16, both operands in shared memory (64-bit descriptors), A K-major
    and B K-major (or MN-major with trans_b, as V in P V); acc the warpgroup's (64, n) fp32 accumulator
    fragment (n / 2 registers per thread, in the instruction's register order), or its registers from
    `first` on in a wider one. Issue it between ``warpgroup.fence()`` and ``commit_group()``."""
    c = n // 2
    ops = [Int64(a_desc).ir_value(loc=loc, ip=ip), Int64(b_desc).ir_value(loc=loc, ip=ip),
           Int32(1 if accumulate else 0).ir_value(loc=loc, ip=ip)]
    _issue(acc, n, ptx_type, ops, ["l", "l", "r"], f"${c}, ${c + 1}, p, 1, 1, 0, {int(trans_b)}", loc, ip, first)


@dsl_user_op
def wgmma_rs(acc: cute.Tensor, a_regs: list, b_desc: Int64, n: int, ptx_type: str, *, loc=None, ip=None) -> None:
    """acc += A B for one k-step of 16, A from registers (4 x 32 bits: 8 16-bit values of the warpgroup's
    (64, 16) A fragment) and B MN-major in shared memory (imm-trans-b = 1), as the forward's P V."""
    c = n // 2
    ops = [Int32(r).ir_value(loc=loc, ip=ip) for r in a_regs]
    ops += [Int64(b_desc).ir_value(loc=loc, ip=ip), Int32(1).ir_value(loc=loc, ip=ip)]
    _issue(acc, n, ptx_type, ops, ["r"] * 4 + ["l", "r"], f"{{${c}, ${c + 1}, ${c + 2}, ${c + 3}}}, ${c + 4}, p, 1, 1, 1",
           loc, ip)


def kstep_descs(t: cute.Tensor, width: int, k_steps: int, hi) -> list:
    """A fixed K-major operand's descriptors, one per k-step of 16 (its columns 16 k ..), each made
    warp-uniform: a value ptxas cannot re-derive inside the key-block loop (module docstring). hi: the
    upper half (desc_hi of the operand's swizzle), warp-uniform."""
    lo = desc_lo(t.iterator.toint())
    return [desc64(cute.arch.make_warp_uniform(lo + desc_offset(t.layout, (0, 16 * k), width)), hi)
            for k in range(k_steps)]


class _Carried:
    """The DSL's protocol for a Python object carried through a kernel's `if`s and loops as run-time
    values: the attributes named in `_carried` (an Int64 or a list of them) are its values."""

    _carried: tuple = ()

    def __extract_mlir_values__(self) -> list:
        out = []
        for name in self._carried:
            v = getattr(self, name)
            out += [Int64(x).ir_value() for x in (v if isinstance(v, list) else [v])]
        return out

    def __new_from_mlir_values__(self, values: list):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        values = list(values)
        for name in self._carried:
            old = getattr(self, name)
            if isinstance(old, list):
                setattr(new, name, [Int64(values.pop(0)) for _ in old])
            else:
                setattr(new, name, Int64(values.pop(0)))
        return new


class QKOperands(_Carried):
    """S = Q K^T's operands as descriptors: Q's per k-step computed once (at construction, before the
    key-block loop), K's as its stage-0 base plus `stage * stage_step` per call. sQ: the warpgroup's
    (rows, d) Q slab; sK: (tn, d, stages); both K-major with the swizzle `swizzle_bytes(d)`."""

    _carried = ("q", "k")

    def __init__(self, sQ: cute.Tensor, sK: cute.Tensor, dtype, d: int, tn: int):
        width = dtype.width
        self.hi = desc_hi(swizzle_bytes(d, width))
        self.k_steps = d // 16
        self.n = tn
        self.ptx_type = ab_type(dtype)
        # Q's halves each through a shuffle, which ptxas cannot re-derive inside the loop (module
        # docstring); K's upper half may stay a constant: the per-block stage add is 64-bit anyway
        self.q = kstep_descs(sQ, width, self.k_steps, cute.arch.make_warp_uniform(Int32(self.hi)))
        self.k = desc64(cute.arch.make_warp_uniform(desc_lo(sK.iterator.toint())), self.hi)
        self.k_off = [desc_offset(sK.layout, (0, 16 * k), width) for k in range(self.k_steps)]
        self.stage_step = desc_offset(sK.layout, (0, 0, 1), width)
        # the second half of the key rows (gemm's half=1): whole 8-row swizzle groups where tn % 32 == 0
        self.half_off = desc_offset(sK.layout, (tn // 2, 0), width) if tn % 32 == 0 else None

    def gemm(self, acc: cute.Tensor, stage: Int32, half: int | None = None) -> None:
        """acc = Q K_stage^T, issued (fence, k-steps, commit); not waited for. half = 0 / 1: only the
        first / second tn / 2 keys (columns) of the block, m64n(tn/2) wgmmas into that half of acc's
        registers (`_issue`); the other half is left as it was."""
        k_desc = self.k + Int64(Uint32(stage * self.stage_step))
        n, first = self.n, 0
        if half is not None:
            n = self.n // 2
            first = half * n // 2
            if half == 1:
                k_desc = k_desc + self.half_off
        warpgroup.fence()
        for k in range(self.k_steps):
            wgmma_ss(acc, self.q[k], k_desc + self.k_off[k], k > 0, n, self.ptx_type, first=first)
        warpgroup.commit_group()


class PVOperands(_Carried):
    """O += P V's B operand as a descriptor: V (tn, dv, stages) is read MN-major (contiguous along dv),
    stage 0's descriptor computed once, `stage * stage_step` added per call. The leading byte offset
    is the distance between dv-chunks of one swizzle width (1 when dv is a single chunk).
    sP: None (P from registers, the A fragment `gemm` is given) or the warpgroup's (rows, tn) P slab in
    shared memory, K-major with the swizzle `swizzle_bytes(tn)`: then A is a descriptor too, one per
    k-step computed once, as Q's in QKOperands."""

    _carried = ("v",)

    def __init__(self, sV: cute.Tensor, dtype, dv: int, tn: int, sP: cute.Tensor | None = None):
        width = dtype.width
        hi = cute.arch.make_warp_uniform(Int32(desc_hi(swizzle_bytes(dv, width))))
        lo = cute.arch.make_warp_uniform(desc_lo(sV.iterator.toint(), leading_offset(dv, tn, width, True)))
        self.v = desc64(lo, hi)
        self.k_steps = tn // 16
        self.n = dv
        self.ptx_type = ab_type(dtype)
        self.k_off = [desc_offset(sV.layout, (16 * k, 0), width) for k in range(self.k_steps)]
        self.stage_step = desc_offset(sV.layout, (0, 0, 1), width)
        self.p_smem = sP is not None
        if self.p_smem:
            self._carried = ("v", "p")
            self.p = kstep_descs(sP, width, self.k_steps,
                                 cute.arch.make_warp_uniform(Int32(desc_hi(swizzle_bytes(tn, width)))))

    def gemm(self, acc: cute.Tensor, tOrP: cute.Tensor, stage: Int32, half: int | None = None) -> None:
        """acc += P V_stage, issued (fence, k-steps, commit); not waited for. tOrP: the 16-bit A fragment
        ((2, 2, 2), 1, tn / 16); unused when P is read from shared memory (sP). half = 0 / 1: only the
        k-steps of the first / second tn / 2 keys (P is 0 on the others: adding nothing, the same sum)."""
        v_desc = self.v + Int64(Uint32(stage * self.stage_step))
        steps = range(self.k_steps)
        if half is not None:
            steps = range(half * self.k_steps // 2, (half + 1) * self.k_steps // 2)
        warpgroup.fence()
        if self.p_smem:
            for k in steps:
                wgmma_ss(acc, self.p[k], v_desc + self.k_off[k], True, self.n, self.ptx_type, trans_b=True)
        else:
            p32 = cute.recast_tensor(tOrP, Int32)  # ((1, 2, 2), 1, tn / 16): 4 registers per k-step
            for k in steps:
                a = p32[None, 0, k]
                wgmma_rs(acc, [a[i] for i in range(4)], v_desc + self.k_off[k], self.n, self.ptx_type)
        warpgroup.commit_group()
