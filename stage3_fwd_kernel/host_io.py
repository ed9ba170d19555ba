"""The host side of a forward launch: constants, fake tensors for compiles, input checks, launch.

Kernels that run are compiled against fake tensors with TVM-FFI (`launch_stream`) and called with
the torch tensors themselves; compile-only builds (CI, no GPU) use the same fake tensors with a
plain stream. The checks raise ValueError / TypeError naming the argument before any launch.
"""
from __future__ import annotations

import functools
import math
import os
from typing import Callable

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .compile_cache import Compiled, compile_cached

ARCH = os.environ["CUTE_DSL_ARCH"]  # set by the package (stage2_emulated_exp.cute_arch)
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
# tensors: fake ones for compiles, real ones from torch
# --------------------------------------------------------------------------------------------


_DTYPES: dict = {}  # what cutlass_dtype has resolved (it runs on every launch: host time)


def cutlass_dtype(name_or_torch_dtype):
    """'bf16' / 'fp16' / torch.bfloat16 / torch.float16 / cutlass type -> cutlass numeric type."""
    try:
        return _DTYPES[name_or_torch_dtype]
    except KeyError:
        found = _DTYPES[name_or_torch_dtype] = _cutlass_dtype(name_or_torch_dtype)
        return found
    except TypeError:  # unhashable: resolved (or refused) without the memo
        return _cutlass_dtype(name_or_torch_dtype)


def _cutlass_dtype(name_or_torch_dtype):
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


def fake_f32_vector():
    """A 1-D fp32 tensor of runtime length (the learnable sink), contiguous."""
    return cute.runtime.make_fake_tensor(Float32, (cute.sym_int32(),), stride=(1,), assumed_align=4)


def fake_i32_vector():
    """A 1-D int32 tensor of runtime length (cu_seqlens, seqused_k, batch_map), contiguous."""
    return cute.runtime.make_fake_tensor(Int32, (cute.sym_int32(),), stride=(1,), assumed_align=4)


def fake_i32_matrix():
    """A 2-D int32 tensor of runtime extents, rows of runtime stride, contiguous along a row (a page
    table)."""
    shape = (cute.sym_int32(), cute.sym_int32())
    return cute.runtime.make_fake_tensor(Int32, shape, stride=(cute.sym_int64(), 1), assumed_align=4)


def to_cute(t, assumed_align=16):
    """A torch CUDA tensor -> a CuTe tensor with dynamic shape and strides (last mode stride 1).
    Only for kernels launched the classic way (the stage-5 probes, the 2-CTA Blackwell forward); launchable
    compiles take torch tensors directly (see `launch_stream`)."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t.detach(), assumed_align=assumed_align).mark_layout_dynamic(leading_dim=t.ndim - 1)


def launch_view(t):
    """A torch tensor as a TVM-FFI launch takes it: itself, or detached where it requires grad and
    the launch could not take it. TVM-FFI converts a tensor through torch's C DLPack exchange API
    where torch has one (2.11 does), which takes a tensor that requires grad (on an H200 the launches
    without the detaches gave bitwise the same forward and gradients); without it, TVM-FFI falls back
    to ``__dlpack__``, which refuses one. A detach() per argument is host time on every call, and a
    step of every launch plan that records the call (fa4/_plans.py)."""
    if t is None or not t.requires_grad or launch_takes_grad_tensors():
        return t
    return t.detach()


@functools.lru_cache(maxsize=1)
def launch_takes_grad_tensors() -> bool:
    """Whether torch offers TVM-FFI the C DLPack exchange API (TVM-FFI sets the first name itself when
    it loads its torch extension; older torch spells the second)."""
    import torch

    return any(hasattr(torch.Tensor, name) for name in ("__dlpack_c_exchange_api__", "__c_dlpack_exchange_api__"))


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


def assume_strides_16B(t: cute.Tensor, head_dim: int) -> cute.Tensor:
    """Trace-side: promise the compiler that every stride but the last is a multiple of 16 bytes
    (the host checks it), so 128-bit copies and TMA descriptors are legal; and make the head_dim
    extent the compile-time constant it is (torch tensors arrive with every extent dynamic)."""
    divby = 128 // t.element_type.width
    strides = tuple(s if isinstance(s, int) else cute.assume(s, divby=divby) for s in t.stride[:-1])
    return cute.make_tensor(t.iterator, cute.make_layout((*t.shape[:-1], head_dim), stride=(*strides, t.stride[-1])))


# --------------------------------------------------------------------------------------------
# input checks and the launch
# --------------------------------------------------------------------------------------------


def check_causal(causal):
    """causal must be a bool: a string such as "False" would be truthy and compile a causal kernel."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal: expected a bool, got {type(causal).__name__}")


def prepare_inputs(q, k, v):
    """Check the (B,S,H,D) contract and make strides 16-byte aligned (copying only if not)."""
    check_dense_shapes(q, k, v)
    return dense_on_cuda(q, k, v)


def dense_on_cuda(q, k, v):
    """prepare_inputs' second half, for a caller that ran check_dense_shapes already: the devices, then
    16-byte aligned strides."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        raise ValueError("q, k, v: expected CUDA tensors")
    return align_16B(q), align_16B(k), align_16B(v)


def check_dense_shapes(q, k, v):
    """The (B,S,H,D) contract's ranks, dtypes, shapes and head counts, devices aside (so a wrong call
    fails the same way on a machine without the GPU it needs)."""
    import torch

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v: expected rank 4 (batch, seqlen, heads, head_dim), got {q.shape}, {k.shape}, {v.shape}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q, k, v: expected one dtype of fp16/bf16, got {q.dtype}, {k.dtype}, {v.dtype}")
    b, sq, hq, d = q.shape
    bk, sk, hkv, dk = k.shape
    if bk != b or v.shape[0] != b or v.shape[1] != sk or v.shape[2] != hkv or dk != d:
        raise ValueError(f"k, v: shapes {tuple(k.shape)}, {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"heads: heads_q ({hq}) must be a multiple of heads_kv ({hkv}), which is >= 1")


def align_16B(t):
    """`t` if its base and every stride but the last (which must be 1) are 16-byte aligned and no
    mode is broadcast (TMA needs positive strides), else a contiguous copy (or view)."""
    stride = t.stride()
    if stride[-1] != 1 or t.data_ptr() % 16:
        return _canonical(t)
    elem = 16 // t.element_size()
    for s, n in zip(stride[:-1], t.shape[:-1]):
        if s % elem or (s <= 0 and n != 1):
            return _canonical(t)
    return t


def _canonical(t):
    """t with row-major strides. torch calls a tensor contiguous whatever the strides of its size-1
    modes, and then .contiguous() returns it as it is -- with, say, a head stride of 1 in a (B, S, 1, D)
    view, which the launch's 16-byte stride check refuses: such a tensor is restrided as a view (its
    memory already is row-major), anything else copied."""
    import torch

    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        strides, step = [], 1
        for n in reversed(t.shape):
            strides.append(step)
            step *= n
        return t.as_strided(t.shape, tuple(reversed(strides)))
    return t.clone(memory_format=torch.contiguous_format)


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
    check_varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k,
                        batch_map=batch_map)
    return varlen_on_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=seqused_k, batch_map=batch_map)


def varlen_on_cuda(q, k, v, cu_seqlens_q, cu_seqlens_k, *, seqused_k=None, batch_map=None):
    """prepare_varlen_inputs' second half, for a caller that ran check_varlen_shapes already: every tensor
    on q's CUDA device, then aligned / contiguous (the same return)."""
    tensors = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_seqlens_q, "cu_seqlens_k": cu_seqlens_k,
               "seqused_k": seqused_k, "batch_map": batch_map}
    for name, t in tensors.items():
        if t is not None and (not t.is_cuda or t.device != q.device):
            raise ValueError(f"{name}: expected a CUDA tensor on {q.device}, got {t.device}")
    return (align_16B(q), align_16B(k), align_16B(v), cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(),
            None if seqused_k is None else seqused_k.contiguous(),
            None if batch_map is None else batch_map.contiguous())


def check_varlen_shapes(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_k=None,
                        batch_map=None):
    """prepare_varlen_inputs' checks without the devices: ranks, dtypes, shapes, head counts, the index
    tensors' dtypes and lengths, the counts."""
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


# The smallest softmax_scale taken: the kernels multiply row maxima by scale * log2(e) and divide the
# rescale threshold by it (fa4._validate keeps the same bound; a cpu test keeps them equal).
MIN_SOFTMAX_SCALE = 2.0 ** -100


def check_scale(softmax_scale, head_dim):
    """None -> 1/sqrt(head_dim); else a finite real >= MIN_SOFTMAX_SCALE (TypeError / ValueError)."""
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a float, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale >= MIN_SOFTMAX_SCALE):
        # the kernel takes row maxima of the raw scores: a negative scale would flip max and min
        raise ValueError(f"softmax_scale: expected a finite value >= 2**-100, got {softmax_scale}")
    return float(softmax_scale)


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
    compiled.fn(launch_view(q), launch_view(k), launch_view(v), launch_view(out), launch_view(lse),
                softmax_scale * LOG2_E, softmax_scale)


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

    check_causal(causal)
    q, k, v = prepare_inputs(q, k, v)
    b, sq, hq, d = q.shape
    dv = v.shape[-1]
    softmax_scale = check_scale(softmax_scale, d)
    if out is None:
        out = torch.empty((b, sq, hq, dv), dtype=q.dtype, device=q.device)
    else:
        check_out_tensor("out", out, (b, sq, hq, dv), q.dtype, q.device, align_bytes=16)
    if lse is None:
        lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    else:
        check_out_tensor("lse", lse, (b, hq, sq), torch.float32, q.device, align_bytes=4)
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
