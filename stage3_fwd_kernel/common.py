"""Host-side plumbing shared by the stage-3 Hopper steps, so that each step file holds only its kernel.

What lives here (and why it is not in the step files):

* arch setup: CuTe-DSL reads ``CUTE_DSL_ARCH`` once, when ``cutlass`` is first imported, so this
  module must be imported before ``cutlass`` by every step (``import stage3_fwd_kernel.common``
  first). Without a GPU we compile for ``sm_90a`` (the ``a`` enables ``wgmma``/``setmaxnreg``).
* the tile-scheduler interface (``StaticTileScheduler``): a kernel asks it for its work tile and the
  host asks it for the grid. Stage 5 supplies an LPT scheduler with the same two methods.
* fake-tensor builders and one compile cache keyed by the kernel's configuration (shapes and
  strides stay dynamic, so one compile serves every size). Kernels that run are compiled against
  fake tensors with TVM-FFI (``launch_stream``) and called with the torch tensors themselves.
* the resource report: registers / spills / stack from ptxas, the SASS (nvdisasm) and what it holds
  (HGMMA, MUFU.EX2, local-memory traffic), and the shared memory the kernel asked for.
* ``run_step``: the body of every step's ``run()`` -- on a Hopper GPU it checks against the stage-0
  reference (FA4's tolerance rule) and times; without one it compiles and prints the report.
"""
from __future__ import annotations

import contextlib
import functools
import io
import math
import os
import re
import struct
import sys
import tempfile
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, NamedTuple, Optional

from stage2_emulated_exp.sass import disassemble as _disassemble

# --------------------------------------------------------------------------------------------
# 0. arch: must happen before the first `import cutlass`
# --------------------------------------------------------------------------------------------
if "cutlass" in sys.modules and os.environ.get("CUTE_DSL_ARCH") is None:
    warnings.warn("cutlass was imported before stage3_fwd_kernel.common; CUTE_DSL_ARCH was not set "
                  "and the DSL may target the wrong architecture", stacklevel=2)
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32  # noqa: E402

ARCH = os.environ["CUTE_DSL_ARCH"]
LOG2_E = math.log2(math.e)
SMEM_BUDGET = 227 * 1024  # opt-in shared memory per CTA on sm_90 (232448 bytes)


def cdiv(a, b):
    return (a + b - 1) // b


def top_padding(seqlen, tile: int, multiple: int = 1):
    """Rows of padding before row 0 that make tiles of `tile` rows end with the sequence (fewer than
    `tile`), rounded down to a multiple of `multiple`: the kernels' ``q_shift``, which puts a partial
    Q tile first instead of last. Python ints or traced Int32 (`tile` a constant)."""
    return (tile - seqlen % tile) % tile // multiple * multiple


# --------------------------------------------------------------------------------------------
# 1. tile scheduler interface
# --------------------------------------------------------------------------------------------
class WorkTile(NamedTuple):
    m_block: Any  # Int32: which tile of `tile_m` query rows
    head: Any     # Int32: query head
    batch: Any    # Int32
    is_valid: Any  # Boolean / bool: False when a persistent scheduler has run out of work


class StaticTileScheduler:
    """One CTA per (m_block, head, batch) tile: grid = (ceil(seqlen_q / tile_m), heads, batch).

    The interface every scheduler implements (stage 5 adds LPT / varlen ones):
      * ``grid_shape(num_m_blocks, num_heads, batch)`` -- host side, inside the ``@cute.jit``
        launcher (arguments may be dynamic ``Int32``);
      * ``initial_work()`` -- device side, the first ``WorkTile`` of this CTA;
      * ``next_work(work)`` -- device side, the following one (``is_valid`` False when done).
    A static scheduler hands each CTA exactly one tile, so ``next_work`` always ends the loop;
    a kernel written as ``work = initial_work(); while work.is_valid: ...; work = next_work(work)``
    therefore runs unchanged under a persistent scheduler.
    """

    persistent = False  # compile-time: kernels may unroll the work loop to a single `if`

    @staticmethod
    def grid_shape(num_m_blocks, num_heads, batch):
        return (num_m_blocks, num_heads, batch)

    @staticmethod
    def initial_work() -> WorkTile:
        bx, by, bz = cute.arch.block_idx()
        return WorkTile(Int32(bx), Int32(by), Int32(bz), True)

    @staticmethod
    def next_work(work: WorkTile) -> WorkTile:
        return WorkTile(work.m_block, work.head, work.batch, False)

    @staticmethod
    def tile_at(linear, num_m_blocks, num_heads, batch):
        """(m_block, head, batch) of the linear-th tile in this grid's dispatch order (x fastest),
        for a persistent loop that walks the same order (`PersistentScheduler`)."""
        m_block = linear % num_m_blocks
        rest = linear // num_m_blocks
        return m_block, rest % num_heads, rest // num_heads


@dataclass(frozen=True)
class PersistentScheduler:
    """A persistent grid over any tile order that has ``tile_at(linear, M, H, B)``: ``num_ctas``
    CTAs (None: one per SM of the launching device, passed at launch, so one compiled kernel serves
    every GPU), CTA c computes the tiles c, c + num_ctas, c + 2 num_ctas, ... of the order.

    Compared with one CTA per tile it saves what every CTA pays once -- launch, barrier set-up,
    the first Q and K loads before any MMA, the last P V and the O store after the last one --
    because the producer loads tile t+1's Q and K/V while the consumers finish tile t. The
    kernel carries the pipeline state across tiles (``persistent`` is what it checks).

    dynamic=True: CTA c starts with tile c, and each next tile is num_ctas + the value a global
    counter held before the CTA's producer added 1 to it (one int32, zeroed per launch), so
    whichever CTA frees first takes the next tile of the order, as the hardware does for a grid of
    one CTA per tile. Needed when tiles differ in length (causal, varlen): with the fixed striding
    a CTA that drew long tiles finishes late.
    """

    # frozen dataclass, as stage 5's schedulers: equal configurations compare and hash equal, so
    # the compile caches keyed on the scheduler build one kernel per configuration
    order: Any = StaticTileScheduler
    num_ctas: Optional[int] = None
    dynamic: bool = False

    persistent: ClassVar[bool] = True

    def __post_init__(self):
        order, num_ctas = self.order, self.num_ctas
        if not callable(getattr(order, "tile_at", None)):
            raise TypeError(f"order: expected a tile order with tile_at(linear, M, H, B), got {order!r}")
        if getattr(order, "persistent", False):
            raise TypeError("order: expected a one-tile-per-CTA order, got a persistent scheduler")
        if num_ctas is not None and (isinstance(num_ctas, bool) or not isinstance(num_ctas, int) or num_ctas < 1):
            raise ValueError(f"num_ctas: expected None or an int >= 1, got {num_ctas!r}")
        if not isinstance(self.dynamic, bool):
            raise TypeError(f"dynamic: expected a bool, got {type(self.dynamic).__name__}")

    def grid_shape(self, num_m_blocks, num_heads, batch, max_ctas):
        """max_ctas: the launch's CTA count (num_ctas, or the device's SMs when num_ctas is None)."""
        return (cutlass.min(num_m_blocks * num_heads * batch, max_ctas), 1, 1)

    def launch_ctas(self, device) -> int:
        return self.num_ctas if self.num_ctas is not None else sm_count(device)

    def tile_at(self, linear, num_m_blocks, num_heads, batch):
        return self.order.tile_at(linear, num_m_blocks, num_heads, batch)


def sm_count(device=None) -> int:
    """Streaming multiprocessors of a CUDA device (the persistent grid's width)."""
    import torch

    index = torch.device(device).index if device is not None else None
    return _sm_count(torch.cuda.current_device() if index is None else index)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count


# --------------------------------------------------------------------------------------------
# 2. tensors: fake ones for compile-only, real ones from torch
# --------------------------------------------------------------------------------------------
def cutlass_dtype(name_or_torch_dtype):
    """'bf16' / 'fp16' / torch.bfloat16 / torch.float16 / cutlass type -> cutlass numeric type."""
    key = str(name_or_torch_dtype).replace("torch.", "")
    table = {"bf16": cutlass.BFloat16, "bfloat16": cutlass.BFloat16, "BFloat16": cutlass.BFloat16,
             "fp16": cutlass.Float16, "float16": cutlass.Float16, "Float16": cutlass.Float16,
             "half": cutlass.Float16}
    for k, v in table.items():
        if key == k or key.endswith("." + k):
            return v
    raise TypeError(f"dtype: expected bf16 or fp16, got {name_or_torch_dtype!r}")


def torch_dtype(dtype):
    import torch

    return {cutlass.BFloat16: torch.bfloat16, cutlass.Float16: torch.float16}[cutlass_dtype(dtype)]


def fake_bshd(dtype, head_dim: int):
    """A (batch, seqlen, heads, head_dim) tensor for cute.compile: every extent but head_dim and
    every stride but the last is a runtime value (so one compile serves all sizes and strides)."""
    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), head_dim)
    stride = (cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), cute.sym_int64(divisibility=8), 1)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=16)


def fake_lse():
    """(batch, heads, seqlen_q) fp32, last mode contiguous."""
    shape = (cute.sym_int32(), cute.sym_int32(), cute.sym_int32())
    stride = (cute.sym_int64(), cute.sym_int64(), 1)
    return cute.runtime.make_fake_tensor(Float32, shape, stride=stride, assumed_align=4)


def fake_i32_vector():
    """A 1-D int32 tensor of runtime length (cu_seqlens, seqused_k, batch_map), contiguous."""
    return cute.runtime.make_fake_tensor(Int32, (cute.sym_int32(),), stride=(1,), assumed_align=4)


def to_cute(t, assumed_align=16):
    """A torch CUDA tensor -> a CuTe tensor with dynamic shape and strides (last mode stride 1).
    Only for kernels launched the classic way (the stage-5 probes, Blackwell); launchable
    compiles take torch tensors directly (see `launch_stream`)."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t.detach(), assumed_align=assumed_align).mark_layout_dynamic(leading_dim=t.ndim - 1)


def launch_stream():
    """The stream argument of a *launchable* compile (fake tensors + this stream).

    Such a kernel is compiled with TVM-FFI (``--enable-tvm-ffi``): the compiled function takes the
    torch tensors, Python floats / ints and ``None`` themselves, checks dtypes, ranks, alignment
    and stride divisibility in C against the fake tensors it was compiled with, and launches on
    torch's current stream -- so the caller passes every argument but the stream. Why: the
    classic path (``from_dlpack(t).mark_layout_dynamic()`` per tensor, ~15 us each, then the
    Python JIT executor, ~50 us) cost ~0.45 ms of host time per forward on an H100 host, more than
    the kernel itself for short sequences."""
    return cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)


def _is_launchable(args) -> bool:
    return any(getattr(a, "use_tvm_ffi_env_stream", False) for a in args)


def assume_strides_16B(t: cute.Tensor, head_dim: int) -> cute.Tensor:
    """Trace-side: promise the compiler that every stride but the last is a multiple of 16 bytes
    (the host checks it), so 128-bit copies and TMA descriptors are legal; and make the head_dim
    extent the compile-time constant it is (torch tensors arrive with every extent dynamic)."""
    divby = 128 // t.element_type.width
    strides = tuple(s if isinstance(s, int) else cute.assume(s, divby=divby) for s in t.stride[:-1])
    return cute.make_tensor(t.iterator, cute.make_layout((*t.shape[:-1], head_dim), stride=(*strides, t.stride[-1])))


# --------------------------------------------------------------------------------------------
# 3. compile + resource report
# --------------------------------------------------------------------------------------------
_DUMP_DIR = None


def _dump_dir() -> str:
    global _DUMP_DIR
    if _DUMP_DIR is None:
        _DUMP_DIR = tempfile.mkdtemp(prefix="fa4_stage3_cute_")
    return _DUMP_DIR


class Compiled(NamedTuple):
    fn: Any           # the callable returned by cute.compile
    report: dict      # registers, spills, smem, SASS instruction counts
    sass: str         # full SASS text ("" if nvdisasm is unavailable)
    ptx: str


_CACHE: dict = {}


class WgmmaSerializedWarning(UserWarning):
    """ptxas serialized a kernel's wgmma instructions (each waits for the one before): the kernel is
    correct but far slower than its design. A stage 4 experiment once measured such a build (-10-12%)
    and took the loss for the technique's (benchmarks/results/ncu_bwd_h100_d128_decoupled.md)."""


# the remark may wrap onto the next line; "(" starts the next remark
_WGMMA_SERIALIZED = re.compile(r"\((C75\d\d)\)[^(]{0,300}?serializ", re.IGNORECASE)


def wgmma_serialization(ptxas_log: str) -> list[str]:
    """The codes of ptxas's "wgmma ... serialized" remarks in a compile log (C7510, C7512, C7520, ...),
    in order, each once; [] when every wgmma stays asynchronous."""
    return list(dict.fromkeys(_WGMMA_SERIALIZED.findall(ptxas_log or "")))


def compile_cached(key, build: Callable[[], tuple]) -> Compiled:
    """Compile once per key. `build()` returns (kernel_object, args_tuple); the kernel object's
    `smem_bytes` attribute (set while tracing) goes into the report."""
    if key in _CACHE:
        return _CACHE[key]
    kernel, args = build()
    opts = f"--keep-ptx --keep-cubin --dump-dir {_dump_dir()} remarks{{ptx}}"
    if _is_launchable(args):
        opts = "--enable-tvm-ffi " + opts
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf), contextlib.redirect_stdout(buf):
        fn = cute.compile(kernel, *args, options=opts)
    log = re.sub(r"\x1b\[[0-9;]*m", "", buf.getvalue())
    ptx = _artifact(fn.__ptx__, "r") or ""
    cubin = _artifact(fn.__cubin__, "rb")
    sass = disassemble(cubin) if cubin else ""
    report = parse_resources(log, sass, cubin)
    report["smem_bytes"] = getattr(kernel, "smem_bytes", None)
    report["threads"] = getattr(kernel, "num_threads", None)
    if report["wgmma_serialized"]:
        warnings.warn(f"{str(key)[:240]}: ptxas serialized its wgmma instructions "
                      f"({', '.join(report['wgmma_serialized'])}); the kernel is correct but runs far below its "
                      "design speed (time it only knowingly)", WgmmaSerializedWarning, stacklevel=2)
    out = Compiled(fn, report, sass, ptx)
    _CACHE[key] = out
    return out


def _artifact(value, mode: str):
    """A compile artifact's contents: the DSL hands classic compiles' PTX / cubin over as contents
    and TVM-FFI compiles' as the path of the file it kept in the dump directory."""
    if isinstance(value, str) and "\n" not in value and os.path.isfile(value):
        with open(value, mode) as f:
            return f.read()
    return value


def disassemble(cubin: bytes) -> str:
    """SASS text, or "" when nvdisasm is missing (the resource report then omits SASS counts)."""
    return _disassemble(cubin, required=False)


def _wgmma_loops(sass: str) -> list:
    """(opcodes, text) of every backward-branch loop (label .L_x_N ... BRA .L_x_N) holding an HGMMA,
    shortest first."""
    from stage2_emulated_exp.gpu_kernel import loop_listings, sass_opcodes

    loops = ((sass_opcodes(text), text) for text in loop_listings(sass))
    return sorted((loop for loop in loops if any(op.startswith("HGMMA") for op in loop[0])), key=lambda x: len(x[0]))


def wgmma_loop_bodies(sass: str) -> list:
    """Opcodes of every backward-branch loop holding an HGMMA, shortest first: in the backward's step 3
    the first is the unmasked tile body, the walk's hot loop."""
    return [ops for ops, _ in _wgmma_loops(sass)]


def _key_block(sass: str) -> tuple:
    """(opcodes, text) of the shortest wgmma loop that also holds MUFU.EX2; ([], "") when none."""
    return next((loop for loop in _wgmma_loops(sass) if any(op.startswith("MUFU.EX2") for op in loop[0])), ([], ""))


def key_block_loop(sass: str) -> list:
    """Opcodes of a forward kernel's hot loop: the shortest wgmma loop that also holds MUFU.EX2, i.e.
    the unmasked key-block step (masked steps and outer tile loops are longer; a loop with wgmmas but
    no exponentials is not a softmax step). [] when there is none."""
    return _key_block(sass)[0]


def key_block_loop_listing(sass: str) -> str:
    """The same loop as text to read: one instruction per line, without addresses and encodings."""
    out = []
    for line in _key_block(sass)[1].splitlines():
        line = re.sub(r"\s*/\* 0x[0-9a-f]+ \*/", "", re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)).strip()
        if line:
            out.append(line)
    return "\n".join(out)


def _elf_register_count(cubin: bytes) -> Optional[int]:
    """Registers per thread from the cubin: the top byte of the kernel's .text section sh_info."""
    try:
        if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
            return None
        shoff, = struct.unpack_from("<Q", cubin, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
        strtab_off = sections[shstrndx][4]
        for sh in sections:
            name_end = cubin.index(b"\0", strtab_off + sh[0])
            name = cubin[strtab_off + sh[0]:name_end].decode()
            if name.startswith(".text.kernel"):
                return sh[7] >> 24
    except Exception:  # a report helper must never break a compile
        return None
    return None


def parse_resources(ptxas_log: str, sass: str, cubin: Optional[bytes]) -> dict:
    rep: dict = {}
    m = re.search(r"Used (\d+) registers", ptxas_log)
    rep["registers"] = int(m.group(1)) if m else (_elf_register_count(cubin) if cubin else None)
    rep["wgmma_serialized"] = wgmma_serialization(ptxas_log)
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", ptxas_log)
    if m:
        rep["stack_frame"], rep["spill_stores"], rep["spill_loads"] = map(int, m.groups())
    else:
        rep["stack_frame"] = rep["spill_stores"] = rep["spill_loads"] = None
    # SASS instruction counts (static, i.e. in the code, not executed)
    def count(pat):
        return len(re.findall(pat, sass)) if sass else None
    rep["HGMMA"] = count(r"\bHGMMA\.")
    rep["MUFU.EX2"] = count(r"\bMUFU\.EX2\b")
    rep["LDL/STL"] = count(r"\b(?:LDL|STL)(?:\.|\s)")
    rep["UTMALDG"] = count(r"\bUTMALDG\b")
    rep["LDGSTS"] = count(r"\bLDGSTS\b")
    rep["ptxas_log"] = ptxas_log
    return rep


def format_report(name: str, rep: dict) -> str:
    keys = ["threads", "registers", "smem_bytes", "stack_frame", "spill_stores", "spill_loads",
            "HGMMA", "MUFU.EX2", "LDGSTS", "UTMALDG", "LDL/STL"]
    return f"{name}: " + ", ".join(f"{k}={rep.get(k)}" for k in keys)


# --------------------------------------------------------------------------------------------
# 4. the host entry point shared by the steps
# --------------------------------------------------------------------------------------------
def hopper_gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def attention_flops(batch, seqlen_q, seqlen_k, heads, head_dim, head_dim_v, causal) -> float:
    """4*b*h*sq*sk*d (2 for QK^T, 2 for PV, with d the mean of the two head dims), halved when
    causal (the usual convention, also for seqlen_q != seqlen_k)."""
    f = 2.0 * batch * heads * seqlen_q * seqlen_k * (head_dim + head_dim_v)
    return f / 2 if causal else f


def prepare_inputs(q, k, v):
    """Check the (B,S,H,D) contract and make strides 16-byte aligned (copying only if not)."""
    import torch

    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v: expected rank 4 (batch, seqlen, heads, head_dim), got {q.shape}, {k.shape}, {v.shape}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q, k, v: expected one dtype of fp16/bf16, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, sq, hq, d = q.shape
    bk, sk, hkv, dk = k.shape
    if bk != b or v.shape[0] != b or v.shape[1] != sk or v.shape[2] != hkv or dk != d:
        raise ValueError(f"k, v: shapes {tuple(k.shape)}, {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if hq % hkv != 0:
        raise ValueError(f"heads: heads_q ({hq}) must be a multiple of heads_kv ({hkv})")
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        raise ValueError("q, k, v: expected CUDA tensors")

    def aligned(t):
        # 16-byte aligned base and strides (cp.async / TMA), no broadcast (stride 0) modes: TMA
        # tensor maps need positive strides
        ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0
        ok = ok and all(s % 8 == 0 and (s > 0 or n == 1) for s, n in zip(t.stride()[:-1], t.shape[:-1]))
        return t if ok else t.contiguous()
    return aligned(q), aligned(k), aligned(v)


def align_16B(t):
    """`t` if its base and every stride but the last (which must be 1) are 16-byte aligned and no
    mode is broadcast (TMA needs positive strides), else a contiguous copy."""
    ok = t.stride(-1) == 1 and t.data_ptr() % 16 == 0
    ok = ok and all(s % (16 // t.element_size()) == 0 and (s > 0 or n == 1)
                    for s, n in zip(t.stride()[:-1], t.shape[:-1]))
    return t if ok else t.contiguous()


def _check_i32_vector(name, t, length=None):
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch int32 tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype int32, got {t.dtype}")
    if t.dim() != 1 or (length is not None and t.shape[0] != length):
        want = "(n,)" if length is None else f"({length},)"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")


def _check_count(name, x):
    import numbers

    if not isinstance(x, numbers.Integral) or isinstance(x, bool):
        raise TypeError(f"{name}: expected an int, got {type(x).__name__}")
    if x < 0:
        raise ValueError(f"{name}: expected >= 0, got {x}")


def prepare_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                          seqused_k=None, batch_map=None):
    """Check the packed varlen contract, cheaply (no device sync), and align strides.

    q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv); cu_seqlens_q / cu_seqlens_k
    int32 (batch + 1,); seqused_k, batch_map int32 (batch,) or None. Shapes and dtypes are checked
    before devices, so a wrong call fails the same way on a CPU-only machine. Values (monotone
    cu_seqlens, seqused_k <= lengths) are the caller's contract: `check_varlen_values` verifies
    them at the price of a device-to-host copy.
    Returns (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, batch_map), aligned / contiguous.
    """
    import torch

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"q, k, v: expected rank 3 (total_tokens, heads, head_dim), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q, k, v: expected one dtype of fp16/bf16, got {q.dtype}, {k.dtype}, {v.dtype}")
    tk, hkv, d = k.shape
    if d != q.shape[2] or v.shape[0] != tk or v.shape[1] != hkv:
        raise ValueError(f"k, v: shapes {tuple(k.shape)}, {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if hkv == 0 or q.shape[1] % hkv != 0:
        raise ValueError(f"heads: heads_q ({q.shape[1]}) must be a multiple of heads_kv ({hkv})")
    _check_i32_vector("cu_seqlens_q", cu_seqlens_q)
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q: expected batch + 1 >= 1 entries, got 0")
    batch = cu_seqlens_q.shape[0] - 1
    _check_i32_vector("cu_seqlens_k", cu_seqlens_k, batch + 1)
    if seqused_k is not None:
        _check_i32_vector("seqused_k", seqused_k, batch)
    if batch_map is not None:
        _check_i32_vector("batch_map", batch_map, batch)
    _check_count("max_seqlen_q", max_seqlen_q)
    _check_count("max_seqlen_k", max_seqlen_k)
    if batch > 65535 or q.shape[1] > 65535:
        raise ValueError(f"batch ({batch}) and heads ({q.shape[1]}) must be <= 65535 (grid y / z limit)")
    tensors = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
               "seqused_k": seqused_k, "batch_map": batch_map}
    for name, t in tensors.items():
        if t is not None and (not t.is_cuda or t.device != q.device):
            raise ValueError(f"{name}: expected a CUDA tensor on {q.device}, got {t.device}")
    return (align_16B(q), align_16B(k), align_16B(v), cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
            None if seqused_k is None else seqused_k.contiguous(),
            None if batch_map is None else batch_map.contiguous())


def check_varlen_values(total_q, total_k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, *, seqused_k=None,
                        batch_map=None):
    """The value half of the varlen contract (copies the small index tensors to the host)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for name, cu, total in (("cu_seqlens_q", cq, total_q), ("cu_seqlens_k", ck, total_k)):
        if cu[0] < 0 or any(b < a for a, b in zip(cu, cu[1:])) or cu[-1] > total:
            raise ValueError(f"{name}: expected non-decreasing offsets in [0, {total}], got {cu}")
    lens_q = [b - a for a, b in zip(cq, cq[1:])]
    if lens_q and max(lens_q) > max_seqlen_q:
        raise ValueError(f"max_seqlen_q: {max_seqlen_q} is smaller than the longest query sequence "
                         f"({max(lens_q)})")
    if seqused_k is not None:
        lens_k = [b - a for a, b in zip(ck, ck[1:])]
        used = seqused_k.tolist()
        if any(u < 0 or u > n for u, n in zip(used, lens_k)):
            raise ValueError(f"seqused_k: expected 0 <= seqused_k[b] <= cu_seqlens_k[b+1] - cu_seqlens_k[b], "
                             f"got {used} for lengths {lens_k}")
    if batch_map is not None:
        n = len(cq) - 1
        if any(not 0 <= b < n for b in batch_map.tolist()):
            raise ValueError(f"batch_map: expected entries in [0, {n})")


def check_out_tensor(name, t, shape, dtype, device, *, align_bytes):
    """A caller-supplied output: exact shape and dtype, on q's device, last stride 1, every other
    stride a multiple of `align_bytes` (the kernel stores 16-byte vectors to out, 4 bytes to lse;
    the launch checks the strides of size-1 modes too)."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got {t.device}")
    elem = align_bytes // t.element_size()
    if t.numel() and (t.stride(-1) != 1 or t.data_ptr() % align_bytes
                      or any(s % elem for s in t.stride()[:-1])):
        raise ValueError(f"{name}: needs last stride 1 and {align_bytes}-byte aligned base and strides, "
                         f"got strides {t.stride()}")


def launch(compiled: Compiled, q, k, v, out, lse, softmax_scale: float):
    """Run a step kernel compiled with ``fake_args(..., launchable=True)``: torch tensors and
    Python floats in ``__call__`` order, no stream (TVM-FFI launches on torch's current one)."""
    compiled.fn(q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(), softmax_scale * LOG2_E, softmax_scale)


def fake_args(dtype, head_dim, head_dim_v, *, launchable: bool = False):
    """A step kernel's ``__call__`` arguments for cute.compile. launchable=True compiles the
    kernel so that `launch` can run it; otherwise only its resource report is wanted."""
    dt = cutlass_dtype(dtype)
    return (fake_bshd(dt, head_dim), fake_bshd(dt, head_dim), fake_bshd(dt, head_dim_v),
            fake_bshd(dt, head_dim_v), fake_lse(), Float32(1.0), Float32(1.0),
            launch_stream() if launchable else cute.runtime.make_fake_stream())


def compile_fake(step_name: str, make_kernel: Callable, *, dtype, head_dim, head_dim_v, causal) -> Compiled:
    """Compile a step's kernel for (dtype, head dims, causal) with fake tensors (no GPU needed)."""
    dt = cutlass_dtype(dtype)
    key = (step_name, "fake", str(dt), head_dim, head_dim_v, bool(causal))
    return compile_cached(key, lambda: (make_kernel(dt, head_dim, head_dim_v, causal),
                                         fake_args(dt, head_dim, head_dim_v)))


def attention_forward_impl(step_name: str, make_kernel: Callable, q, k, v, *, softmax_scale=None,
                           causal=False, out=None, lse=None):
    """(B,S,H,D) CUDA tensors -> (out (B,Sq,Hq,Dv) in q's dtype, lse (B,Hq,Sq) fp32)."""
    import torch

    q, k, v = prepare_inputs(q, k, v)
    b, sq, hq, d = q.shape
    dv = v.shape[-1]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if out is None:
        out = torch.empty((b, sq, hq, dv), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    if b == 0 or sq == 0 or hq == 0:
        return out, lse
    if k.shape[1] == 0:  # nothing visible anywhere
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    dt = cutlass_dtype(q.dtype)
    key = (step_name, "gpu", str(dt), d, dv, bool(causal))
    compiled = compile_cached(key, lambda: (make_kernel(dt, d, dv, causal),
                                             fake_args(dt, d, dv, launchable=True)))
    launch(compiled, q, k, v, out, lse, softmax_scale)
    return out, lse


def benchmark_ms(fn, warmup=5, iters=20) -> float:
    """Median milliseconds of fn() timed with CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def run_step(step_name: str, make_kernel: Callable, attention_forward: Callable, *, batch, seqlen_q,
             seqlen_k, heads, heads_kv, head_dim, head_dim_v, causal, dtype, check, verbose=True) -> dict:
    """The body of every step's run(): GPU -> check + time; no GPU -> compile + resource report."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    heads_kv = heads if heads_kv is None else heads_kv
    result: dict = {"step": step_name}
    if not hopper_gpu_available():
        comp = compile_fake(step_name, make_kernel, dtype=dtype, head_dim=head_dim,
                            head_dim_v=head_dim_v, causal=causal)
        result.update(mode="compile-only", report=comp.report)
        if verbose:
            print(format_report(f"{step_name} [{ARCH}, {dtype}, d={head_dim}/{head_dim_v}, "
                                f"causal={causal}] (no Hopper GPU: compiled only)", comp.report))
        return result

    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref

    tdt = torch_dtype(dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=tdt, generator=gen)
    k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=tdt, generator=gen)
    v = torch.randn(batch, seqlen_k, heads_kv, head_dim_v, device="cuda", dtype=tdt, generator=gen)
    out = torch.full((batch, seqlen_q, heads, head_dim_v), float("nan"), device="cuda", dtype=tdt)
    lse = torch.full((batch, heads, seqlen_q), float("nan"), device="cuda", dtype=torch.float32)
    attention_forward(q, k, v, causal=causal, out=out, lse=lse)
    torch.cuda.synchronize()
    if check:
        ref_o, ref_lse = attention_ref(q, k, v, causal=causal, upcast=True)
        base_o, base_lse = attention_ref(q, k, v, causal=causal, upcast=False)
        assert_fa4_close(f"{step_name} out", out, ref_o, base_o)
        assert_fa4_close(f"{step_name} lse", lse, ref_lse, base_lse)
    ms = benchmark_ms(lambda: attention_forward(q, k, v, causal=causal, out=out, lse=lse))
    tflops = attention_flops(batch, seqlen_q, seqlen_k, heads, head_dim, head_dim_v, causal) / (ms * 1e-3) / 1e12
    rep = _CACHE[(step_name, "gpu", str(cutlass_dtype(dtype)), head_dim, head_dim_v, bool(causal))].report
    result.update(mode="gpu", ms=ms, tflops=tflops, report=rep)
    if verbose:
        status = "PASS" if check else "(unchecked)"
        print(f"{status} {step_name} b={batch} sq={seqlen_q} sk={seqlen_k} h={heads}/{heads_kv} "
              f"d={head_dim}/{head_dim_v} causal={causal} {dtype}: {ms:.3f} ms, {tflops:.1f} TFLOP/s")
        print(format_report("  resources", rep))
    return result


# --------------------------------------------------------------------------------------------
# command line shared by every kernel module's __main__ (and stage 4's)
# --------------------------------------------------------------------------------------------
def shape_parser(doc: str):
    """argparse parser with the problem-shape options every `python -m <kernel module>` takes."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seqlen_q", type=int, default=1024)
    ap.add_argument("--seqlen_k", type=int, default=None, help="default: seqlen_q")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--heads_kv", type=int, default=None)
    ap.add_argument("--head_dim", type=int, default=128)
    ap.add_argument("--head_dim_v", type=int, default=None)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    return ap


def shape_kwargs(a) -> dict:
    """The run(...) keyword arguments of shape_parser's options."""
    return dict(batch=a.batch, seqlen_q=a.seqlen_q, seqlen_k=a.seqlen_k or a.seqlen_q, heads=a.heads,
                heads_kv=a.heads_kv, head_dim=a.head_dim, head_dim_v=a.head_dim_v, causal=a.causal,
                dtype=a.dtype)
