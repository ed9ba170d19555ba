"""Stage 2, part 4: the emulated exp2 as GPU instructions, matched bit for bit with the host model.

Compared with the host model (host_model.py), this adds the real instruction sequence on the
device, because the lesson's claim "the FMA pipe can compute 2^x" is only as good as what
ptxas emits. Every step is one PTX instruction written out by hand (inline PTX), so neither
LLVM nor ptxas may contract, reassociate or change a rounding mode behind our back:

    xc   = max.f32(x, -127)                       FMNMX       ALU pipe   NaN -> -127
    j    = add.rm.f32(xc, 0x4B400000)             FADD.RM     FMA pipe   1.5 * 2^23
    fl   = sub.rn.f32(j, 0x4B400000)              FADD        FMA pipe   = floor(xc)
    f    = sub.rn.f32(xc, fl)                     FADD        FMA pipe   in [0, 1]
    p    = p_n; p = fma.rn.f32(p, f, p_k) ...     n x FFMA    FMA pipe   Horner, p_0 = 1
    bits = bits(p) + (bits(j) << 23)              LEA         ALU pipe   (shl + add fused)

Why bits(j) and not cvt(fl): adding 1.5 * 2^23 puts the float in [2^23, 2^24), where one ulp
is 1, so the low mantissa bits of j hold floor(xc) + 2^22 as an integer (the 2^22 keeps the
exponent fixed for negative floors). Shifting left by 23 pushes everything above bit 8 out of
the word, so (bits(j) << 23) == floor(xc) << 23 (mod 2^32) for every xc in [-127, 2^22).
`cvt.rzi.s32.f32` would give the same integer, but on sm_90 a float->int conversion runs at
16 / clk / SM, on the very unit (XU/MUFU) we are trying to unload. Count per element:

    degree 3:  FMNMX + FADD.RM + 2 FADD + 3 FFMA + LEA = 8 instructions (6 on the FMA pipe)
    degree 5:  10 instructions (8 on the FMA pipe)
    MUFU:      1 instruction (MUFU.EX2, 16 / clk / SM)

Every instruction also comes in its .ftz form (ftz=True, the default, as in the official FA4
and in host_model): same cost, it only changes results for subnormal inputs. Outside
[-126, 128) the sequence still runs, it just does not compute 2^x (NaN -> +0, +inf -> NaN,
x >= 128 wraps the exponent); host_model's docstring tabulates it, and the bit-exactness
check (device_main.py) covers those inputs too.

Public API:
    exp2_gpu(x, method="emulated" | "mufu", degree=3, coefficients=None, ftz=True) -> tensor
    compile_only(arch) -> {name: {"ptx", "cubin", "sass", "resources"}}   (no GPU needed)
"""
from __future__ import annotations

import os
import struct
import tempfile

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .sass import disassemble, loop_listings, sass_opcodes  # noqa: F401 (this module's API)

ARCH = os.environ["CUTE_DSL_ARCH"]  # chosen by the package before cutlass loaded (cute_arch.select)

__all__ = [
    "ARCH",
    "CLAMP_MIN",
    "METHODS",
    "ROUND_MAGIC",
    "TILE",
    "compile_only",
    "exp2_emulated_f32",
    "exp2_from_fraction",
    "exp2_gpu",
    "exp2_mufu_f32",
    "hot_loop_opcodes",
    "loop_listings",
    "kernel_resources",
    "sass_opcodes",
    "sass_from_cubin",
]

METHODS = ("emulated", "mufu")
CLAMP_MIN = -127.0  # below this 2^floor(x) has no normal exponent field; 2^-127 * 1 -> 0
ROUND_MAGIC = 12582912.0  # 0x4B400000 = 2^23 + 2^22
THREADS = 256  # threads per CTA of the elementwise kernel
VALUES = 4  # fp32 values per thread: one 128-bit load and one 128-bit store
TILE = THREADS * VALUES  # elements per CTA; exp2_gpu pads the input to a multiple of it


# ----------------------------------------------------------------------------------------
# 1. One PTX instruction per helper. has_side_effects=False: LLVM may still schedule, CSE or
#    delete them like ordinary arithmetic, but it cannot see inside, so it cannot rewrite
#    the arithmetic itself.
# ----------------------------------------------------------------------------------------
def _f32(v, loc, ip):
    return Float32(v).ir_value(loc=loc, ip=ip)


def _asm_f32(ptx: str, constraints: str, operands, loc, ip) -> Float32:
    return Float32(
        llvm.inline_asm(
            T.f32(),
            operands,
            ptx,
            constraints,
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
    )


def _ftz(ftz: bool) -> str:
    # .ftz flushes subnormal inputs and results to a zero of the same sign; same cost
    return ".ftz" if ftz else ""


@dsl_user_op
def max_f32(a, b, *, ftz: bool = False, loc=None, ip=None) -> Float32:
    """PTX max.f32: returns the non-NaN operand when one is NaN (so max(NaN, -127) = -127)."""
    return _asm_f32(f"max{_ftz(ftz)}.f32 $0, $1, $2;", "=f,f,f",
                    [_f32(a, loc, ip), _f32(b, loc, ip)], loc, ip)


@dsl_user_op
def add_rm_f32(a, b, *, ftz: bool = False, loc=None, ip=None) -> Float32:
    """a + b rounded toward -inf: the floor step of the range reduction."""
    return _asm_f32(f"add.rm{_ftz(ftz)}.f32 $0, $1, $2;", "=f,f,f",
                    [_f32(a, loc, ip), _f32(b, loc, ip)], loc, ip)


@dsl_user_op
def sub_rn_f32(a, b, *, ftz: bool = False, loc=None, ip=None) -> Float32:
    """a - b, round to nearest even. The explicit .rn also forbids ptxas to fuse it into an FMA."""
    return _asm_f32(f"sub.rn{_ftz(ftz)}.f32 $0, $1, $2;", "=f,f,f",
                    [_f32(a, loc, ip), _f32(b, loc, ip)], loc, ip)


@dsl_user_op
def fma_rn_f32(a, b, c, *, ftz: bool = False, loc=None, ip=None) -> Float32:
    """a * b + c with a single rounding (IEEE fusedMultiplyAdd), round to nearest even."""
    return _asm_f32(f"fma.rn{_ftz(ftz)}.f32 $0, $1, $2, $3;", "=f,f,f,f",
                    [_f32(a, loc, ip), _f32(b, loc, ip), _f32(c, loc, ip)], loc, ip)


@dsl_user_op
def ex2_approx_f32(a, *, loc=None, ip=None) -> Float32:
    """The hardware 2^x: ex2.approx.ftz.f32 -> one MUFU.EX2 on sm_90/sm_100."""
    return _asm_f32("ex2.approx.ftz.f32 $0, $1;", "=f,f", [_f32(a, loc, ip)], loc, ip)


@dsl_user_op
def combine_exponent(poly, j, *, loc=None, ip=None) -> Float32:
    """bits(poly) + (bits(j) << 23) as 32-bit integers, returned reinterpreted as f32.

    Integer add, not a float multiply by 2^floor: the sum lands in the exponent field, costs
    one ALU op (ptxas fuses shl + add into LEA), and never rounds.
    """
    poly_i = llvm.bitcast(T.i32(), _f32(poly, loc, ip), loc=loc, ip=ip)
    j_i = llvm.bitcast(T.i32(), _f32(j, loc, ip), loc=loc, ip=ip)
    out_i = llvm.inline_asm(
        T.i32(),
        [poly_i, j_i],
        "{\n\t.reg .b32 t;\n\tshl.b32 t, $2, 23;\n\tadd.s32 $0, $1, t;\n\t}",
        "=r,r,r",
        has_side_effects=False,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )
    return Float32(llvm.bitcast(T.f32(), out_i, loc=loc, ip=ip))


# ----------------------------------------------------------------------------------------
# 2. The two exp2 implementations, traced at compile time (coefficients are Python floats,
#    so they land in the SASS as immediates).
# ----------------------------------------------------------------------------------------
def exp2_emulated_f32(x, coefficients, ftz: bool = True) -> Float32:
    """2^x on the FMA pipe; `coefficients` = (1.0, p_1, ..., p_n), float32 values.

    ftz=True uses the .ftz forms (as the official FA4 does, and host_model's default); it
    only changes results for subnormal inputs."""
    xc = max_f32(x, CLAMP_MIN, ftz=ftz)  # 1. clamp: keeps floor(x) >= -127
    j = add_rm_f32(xc, ROUND_MAGIC, ftz=ftz)  # 2. low bits of j = floor(xc) + 2^22
    fl = sub_rn_f32(j, ROUND_MAGIC, ftz=ftz)  # 3. floor(xc) as a float (exact)
    f = sub_rn_f32(xc, fl, ftz=ftz)  # 4. fraction in [0, 1] (exact unless xc is huge)
    return exp2_from_fraction(f, j, coefficients, ftz)


def exp2_from_fraction(f, j, coefficients, ftz: bool = True) -> Float32:
    """Steps 5-6 of exp2_emulated_f32: p(f) by Horner, then 2^floor * p(f) with j = floor + 2^22 +
    2^23 as the range reduction left it."""
    p = Float32(coefficients[-1])  # 5. Horner: p = p_n; p = p * f + p_k
    for c in reversed(coefficients[:-1]):
        p = fma_rn_f32(p, f, Float32(c), ftz=ftz)
    return combine_exponent(p, j)  # 6. 2^floor * p(f): integer add into the exponent


def exp2_mufu_f32(x) -> Float32:
    return ex2_approx_f32(x)


# ----------------------------------------------------------------------------------------
# 3. The elementwise kernel: one CTA = TILE contiguous elements, 4 per thread (LDG.E.128).
# ----------------------------------------------------------------------------------------
@cute.kernel
def exp2_kernel(
    gX: cute.Tensor,  # ((TILE), (n / TILE))
    gY: cute.Tensor,  # ((TILE), (n / TILE))
    thr_layout: cute.Layout,
    val_layout: cute.Layout,
    method: cutlass.Constexpr,
    coefficients: cutlass.Constexpr,
    ftz: cutlass.Constexpr,
):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()

    # 1. this CTA's tile and this thread's 4 values of it
    gX_cta = gX[(None, bidx)]  # (TILE,)
    gY_cta = gY[(None, bidx)]  # (TILE,)
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
    tiled_copy = cute.make_tiled_copy_tv(atom, thr_layout, val_layout)
    thr_copy = tiled_copy.get_slice(tidx)
    tXgX = thr_copy.partition_S(gX_cta)  # (CPY, CPY_N)
    tYgY = thr_copy.partition_D(gY_cta)  # (CPY, CPY_N)

    # 2. gmem -> rmem
    tXrX = cute.make_fragment_like(tXgX)
    cute.copy(tiled_copy, tXgX, tXrX)

    # 3. exp2 in registers
    tYrY = cute.make_fragment_like(tYgY)
    for i in cutlass.range_constexpr(cute.size(tXrX)):
        if cutlass.const_expr(method == "mufu"):
            tYrY[i] = exp2_mufu_f32(tXrX[i])
        else:
            tYrY[i] = exp2_emulated_f32(tXrX[i], coefficients, ftz)

    # 4. rmem -> gmem
    cute.copy(tiled_copy, tYrY, tYgY)


@cute.jit
def exp2_launch(
    ptr_x: cute.Pointer,
    ptr_y: cute.Pointer,
    n: Int32,  # a multiple of TILE (exp2_gpu pads)
    stream: cuda.CUstream,
    method: cutlass.Constexpr,
    coefficients: cutlass.Constexpr,
    ftz: cutlass.Constexpr,
):
    n = cute.assume(n, divby=TILE)
    mX = cute.make_tensor(ptr_x, cute.make_layout(n))  # (n,)
    mY = cute.make_tensor(ptr_y, cute.make_layout(n))  # (n,)
    gX = cute.zipped_divide(mX, (TILE,))  # ((TILE), (n / TILE))
    gY = cute.zipped_divide(mY, (TILE,))
    thr_layout = cute.make_layout(THREADS)
    val_layout = cute.make_layout(VALUES)
    exp2_kernel(gX, gY, thr_layout, val_layout, method, coefficients, ftz).launch(
        grid=[cute.size(gX, mode=[1]), 1, 1], block=[THREADS, 1, 1], stream=stream
    )


# ----------------------------------------------------------------------------------------
# 4. Host side: compile cache, launch, compile-only report.
# ----------------------------------------------------------------------------------------
def _resolve(method: str, degree: int, coefficients) -> tuple:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method == "mufu":
        return ()
    from .minimax import resolve_coefficients

    return tuple(float(c) for c in resolve_coefficients(degree, coefficients))


def _fake_args():
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    px = make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=16)
    py = make_ptr(Float32, 0, cute.AddressSpace.gmem, assumed_align=16)
    return px, py, Int32(TILE), make_fake_stream()


def _compile(jit_fn, args, *, arch: str | None = None, keep_dir: str | None = None):
    """cute.compile with PTX + cubin kept (needed for __ptx__ / __cubin__)."""
    opts = []
    if keep_dir is not None:
        opts += ["--keep-ptx", "--keep-cubin", f"--dump-dir {keep_dir}"]
    if arch is not None:
        opts.append(f"--gpu-arch {arch}")
    return cute.compile(jit_fn, *args, options=" ".join(opts))


_CACHE: dict = {}


def _compiled_exp2(method: str, coefficients: tuple, ftz: bool):
    key = (ARCH, method, coefficients, ftz)
    if key not in _CACHE:
        _CACHE[key] = cute.compile(exp2_launch, *_fake_args(), method, coefficients, ftz)
    return _CACHE[key]


def _stream_of_current_torch_stream():
    import torch

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def exp2_gpu(x, method: str = "emulated", degree: int = 3, coefficients=None,
             ftz: bool = True):
    """2^x for a CUDA float32 tensor, elementwise, by `method`; returns a new tensor.

    Defaults match host_model.exp2_emulated (our minimax coefficients, ftz=True), so
    exp2_gpu(x) and exp2_emulated(x) must agree bit for bit. The input is flattened and
    padded to a multiple of TILE (the pad is sliced off), so the kernel needs no bounds
    checks and every access is a full 16-byte vector.
    """
    import torch

    if not (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype == torch.float32):
        raise TypeError("exp2_gpu expects a CUDA float32 torch tensor")
    coeffs = _resolve(method, degree, coefficients)
    from cutlass.cute.runtime import make_ptr

    flat = x.reshape(-1)
    n = flat.numel()
    n_pad = max(TILE, -(-n // TILE) * TILE)
    x_pad = torch.zeros(n_pad, dtype=torch.float32, device=x.device)
    x_pad[:n] = flat
    y_pad = torch.empty_like(x_pad)
    compiled = _compiled_exp2(method, coeffs, bool(ftz) and method == "emulated")
    compiled(
        make_ptr(Float32, x_pad.data_ptr(), cute.AddressSpace.gmem, assumed_align=16),
        make_ptr(Float32, y_pad.data_ptr(), cute.AddressSpace.gmem, assumed_align=16),
        Int32(n_pad),
        _stream_of_current_torch_stream(),
    )
    return y_pad[:n].reshape(x.shape)


# ----------------------------------------------------------------------------------------
# 5. Looking at the machine code without a GPU.
# ----------------------------------------------------------------------------------------
def sass_from_cubin(cubin: bytes) -> str:
    """Disassemble a cubin with nvdisasm (from PATH or the nvidia-cuda-nvdisasm wheel)."""
    return disassemble(cubin, required=True)


def loop_opcodes(sass: str) -> list:
    """Opcodes of every backward-branch loop in a SASS listing (`loop_listings`), one list per loop."""
    return [sass_opcodes(body) for body in loop_listings(sass)]


def hot_loop_opcodes(sass: str) -> list:
    """Opcodes of the longest backward-branch loop in a SASS listing: the steady state of a
    benchmark kernel, without prologue and remainder."""
    return max(loop_opcodes(sass), key=len, default=[])


def kernel_resources(cubin: bytes) -> dict:
    """{kernel: {"registers", "frame_bytes", "stack_bytes"}} read from the cubin's ELF.

    ptxas records per-kernel resources as attributes in the `.nv.info` section: records of
    (format u8, attribute u8, size u16, payload); REGCOUNT (0x2f), FRAME_SIZE (0x11) and
    MIN_STACK_SIZE (0x12) carry (symbol index u32, value u32). A nonzero frame means local
    memory (spills or a register array indexed at run time).
    """
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2, "expected a 64-bit ELF cubin"
    e_shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, e_shoff + i * e_shentsize)
                for i in range(e_shnum)]

    def cstr(off):
        return cubin[off:cubin.index(b"\0", off)].decode()

    shstr = sections[e_shstrndx][4]
    by_name = {cstr(shstr + s[0]): s for s in sections}
    symtab, strtab = by_name[".symtab"], by_name[".strtab"]
    sym_names = [cstr(strtab[4] + struct.unpack_from("<I", cubin, symtab[4] + k * 24)[0])
                 for k in range(symtab[5] // 24)]
    wanted = {0x2F: "registers", 0x11: "frame_bytes", 0x12: "stack_bytes"}
    out: dict = {}
    info = by_name[".nv.info"]
    data = cubin[info[4]:info[4] + info[5]]
    pos = 0
    while pos + 4 <= len(data):
        fmt, attr, size = data[pos], data[pos + 1], struct.unpack_from("<H", data, pos + 2)[0]
        payload = data[pos + 4:pos + 4 + size] if fmt == 0x04 else b""
        pos += 4 + (size if fmt == 0x04 else 0)
        if attr in wanted and len(payload) == 8:
            sym, value = struct.unpack("<II", payload)
            out.setdefault(sym_names[sym], {})[wanted[attr]] = value
    return out


def compile_only(arch: str = "sm_90a", degrees=(3,), coefficients=None,
                 ftz: bool = True, disassemble: bool = True) -> dict:
    """Compile the mufu kernel and the emulated kernel (per degree) for `arch` with fake
    pointers; return {name: {"ptx", "cubin", "sass", "resources"}}. No GPU is touched.
    disassemble=False skips nvdisasm ("sass" is then None)."""
    results = {}
    variants = [("mufu", "mufu", (), False)]
    for d in degrees:
        variants.append((f"emulated_d{d}", "emulated", _resolve("emulated", d, coefficients),
                         ftz))
    for name, method, coeffs, v_ftz in variants:
        with tempfile.TemporaryDirectory() as keep_dir:
            compiled = _compile(exp2_launch, (*_fake_args(), method, coeffs, v_ftz), arch=arch,
                                keep_dir=keep_dir)
            cubin = compiled.__cubin__
            results[name] = {
                "ptx": compiled.__ptx__,
                "cubin": cubin,
                "sass": sass_from_cubin(cubin) if disassemble else None,
                "resources": kernel_resources(cubin),
            }
    return results


def run() -> None:
    """Compile both kernels for sm_90a and sm_100a and print what ptxas made of them; with a
    GPU, also run them against float64 and the host model and print PASS."""
    import numpy as np

    for arch in ("sm_90a", "sm_100a"):
        for name, r in compile_only(arch).items():
            ops = sass_opcodes(r["sass"])
            res = next(iter(r["resources"].values()))
            mix = {o: ops.count(o) for o in sorted(set(ops))
                   if o.split(".")[0] in ("FMNMX", "FADD", "FFMA", "LEA", "MUFU")}
            print(f"{arch} {name:12s} regs={res['registers']:3d} "
                  f"frame={res['frame_bytes']}B  per 4 values: {mix}")
    import torch

    if not torch.cuda.is_available():
        print("no GPU: compile-only (run python -m stage2_emulated_exp.device_main on one)")
        return
    from .host_model import exp2_emulated

    x = torch.linspace(-126, 127, 1 << 20, device="cuda")
    ref = np.exp2(x.double().cpu().numpy())
    for method in METHODS:
        y = exp2_gpu(x, method).cpu().numpy()
        print(f"{method:8s} max rel err on [-126, 127]: {np.max(np.abs(y / ref - 1)):.3e}")
    same = np.array_equal(exp2_gpu(x).cpu().numpy().view(np.uint32),
                          exp2_emulated(x.cpu().numpy()).view(np.uint32))
    print("PASS" if same else "FAIL: GPU emulation differs from host_model")


if __name__ == "__main__":
    run()
