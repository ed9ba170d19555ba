"""Plumbing shared by the stage-4 backward kernels (preprocess, main steps, postprocess).

What lives here, and why it is not in the kernel files:

* the compile/report machinery comes from stage 3 (``compile_cache``, ``sass_report``,
  ``host_io``; a lower stage, so importing it keeps the layering rule): one compile cache, the
  ptxas register/spill report, the SASS counts. The package chose the arch before cutlass loaded.
* device helpers for the global-memory reductions: ``red_add_f32x2`` (``red.global.add.v2.f32``,
  one 8-byte atomic add, an sm_90 PTX feature), and the semaphore pair ``semaphore_wait`` /
  ``semaphore_signal`` (``ld.acquire.gpu`` spin, ``fence.acq_rel.gpu`` + ``red.gpu.add``) that
  the deterministic mode uses to serialise the dQ reductions; ``semaphore_wait_at_least`` for the
  2-CTA kernel (two CTAs of a pair add disjoint rows under one rank), and ``bulk_copy_to_peer``
  (mapa + ``cp.async.bulk.shared::cluster``), its DSMEM exchange of dS.
* (re-exported from ``schedule.py``) the dQ reduction **orders**: a small interface
  (``n_block_for_launch``, ``rank``) so that stage 5 can plug in another order (SPT with head
  swizzling) without stage 4 importing stage 5.
* fake tensors for compiles (launches pass torch tensors through TVM-FFI), the host input checks.
"""
from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from stage3_fwd_kernel import host_io, runner
# re-exported for the kernel files, tests and tutorial 04
from stage3_fwd_kernel.compile_cache import Compiled, compile_cached  # noqa: F401
from stage3_fwd_kernel.host_io import (  # noqa: F401
    ARCH, LOG2_E, cdiv, check_causal, cutlass_dtype, launch_stream, launch_view, torch_dtype)
from stage3_fwd_kernel.runner import benchmark_ms, hopper_gpu_available  # noqa: F401
from stage3_fwd_kernel.sass_report import format_report, wgmma_loop_bodies  # noqa: F401
# the dQ reduction orders live in schedule.py (pure Python, shared with the NumPy model)
from stage4_bwd_kernel.schedule import KVAscendingOrder, KVDescendingOrder, default_dq_order  # noqa: F401

SUPPORTED_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (128, 64), (192, 128), (256, 256))


# --------------------------------------------------------------------------------------------
# 1. device helpers: vector atomic add, semaphores
# --------------------------------------------------------------------------------------------
def _red_add_f32_vector(ptr: cute.Pointer, values, loc, ip) -> None:
    """*ptr += values (2 or 4 fp32): one ``red.global.add.v{n}.f32``, fire-and-forget (the add happens
    in L2, the issuing thread does not wait for it); `ptr` global and aligned to the vector's bytes."""
    n = len(values)
    addr = ptr.toint(loc=loc, ip=ip).ir_value()
    regs = ", ".join(f"${i + 1}" for i in range(n))
    llvm.inline_asm(None, [addr, *(Float32(x).ir_value(loc=loc, ip=ip) for x in values)],
                    f"red.global.add.v{n}.f32 [$0], {{{regs}}};", "l," + ",".join("f" * n),
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def opaque_i32(x: Int32, *, loc=None, ip=None) -> Int32:
    """x through a volatile ``mov``: the compiler cannot hoist what is computed from it out of the loop
    that calls this (the wide Blackwell dQ^T drain: 64 row offsets hoisted out of the walk spilled)."""
    return Int32(llvm.inline_asm(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,r",
                                 has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT))


@dsl_user_op
def barrier_sync_divergent(barrier_id: int, number_of_threads: int, *, loc=None, ip=None) -> None:
    """Named barrier `barrier_id` for `number_of_threads` threads, its non-aligned form (``barrier.sync``):
    the warps may reach it from different instructions. ``bar.sync`` is ``barrier.sync.aligned``, which
    requires every thread to execute the same instruction (compute-sanitizer's synccheck reports
    "Divergent thread(s) in block" otherwise): the half tiles' two bodies meet at it
    (hopper/consumer.py)."""
    llvm.inline_asm(None, [Int32(barrier_id).ir_value(loc=loc, ip=ip), Int32(number_of_threads).ir_value(loc=loc, ip=ip)],
                    "barrier.sync $0, $1;", "r,r", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def red_add_f32(ptr: cute.Pointer, a: Float32, *, loc=None, ip=None) -> None:
    """*ptr += a: one 4-byte ``red.global.add.f32``; a warp adding 32 consecutive floats this way makes
    one coalesced 128-byte reduction (the wide Blackwell backward's dQ^T drain, thread = head-dim column)."""
    addr = ptr.toint(loc=loc, ip=ip).ir_value()
    llvm.inline_asm(None, [addr, Float32(a).ir_value(loc=loc, ip=ip)], "red.global.add.f32 [$0], $1;", "l,f",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@dsl_user_op
def red_add_f32x2(ptr: cute.Pointer, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """*ptr += (a, b): one 8-byte ``red.global.add.v2.f32`` (sm_90+; SASS ``REDG.E.ADD.F32x2``-like)."""
    _red_add_f32_vector(ptr, (a, b), loc, ip)


@dsl_user_op
def red_add_f32x4(ptr: cute.Pointer, a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> None:
    """*ptr += (a, b, c, d): one 16-byte ``red.global.add.v4.f32`` (sm_90+)."""
    _red_add_f32_vector(ptr, (a, b, c, d), loc, ip)


@dsl_user_op
def ld_acquire_gpu(ptr: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """An acquire load at GPU scope: later memory operations of this thread (and, through a CTA
    barrier, of the whole CTA) are ordered after the writes that the observed value released."""
    addr = ptr.toint(loc=loc, ip=ip).ir_value()
    val = llvm.inline_asm(T.i32(), [addr], "ld.global.acquire.gpu.b32 $0, [$1];", "=r,l",
                          has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Int32(val)


@dsl_user_op
def release_add_gpu(ptr: cute.Pointer, val: cutlass.Constexpr[int], *, loc=None, ip=None) -> None:
    """fence.acq_rel.gpu, then a relaxed GPU-scope atomic add: together a release. The fence is
    cumulative, so writes of other threads of the CTA that a preceding barrier ordered before it
    are released too (the CUTLASS semaphore idiom)."""
    addr = ptr.toint(loc=loc, ip=ip).ir_value()
    llvm.inline_asm(None, [addr, Int32(val).ir_value(loc=loc, ip=ip)],
                    "fence.acq_rel.gpu;\n\tred.relaxed.gpu.global.add.s32 [$0], $1;", "l,r",
                    has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


@cute.jit
def semaphore_wait(sem_ptr: cute.Pointer, value: Int32, tidx: Int32):
    """Thread 0 spins until *sem_ptr == value; the caller follows with a CTA barrier so the whole
    CTA proceeds only after the predecessors' reductions are visible."""
    if tidx == 0:
        seen = ld_acquire_gpu(sem_ptr)
        while seen != value:
            seen = ld_acquire_gpu(sem_ptr)


@cute.jit
def semaphore_signal(sem_ptr: cute.Pointer, tidx: Int32):
    """Thread 0 releases the CTA's reductions (the caller has run a CTA barrier after them) by
    incrementing the counter: the next CTA in the order may go."""
    if tidx == 0:
        release_add_gpu(sem_ptr, 1)


@cute.jit
def semaphore_wait_at_least(sem_ptr: cute.Pointer, value: Int32, tidx: Int32):
    """Like semaphore_wait, but proceeds once *sem_ptr >= value. The 2-CTA backward uses it: the two
    CTAs of a pair add disjoint rows of a dQ tile, so both wait for 2 x (pair rank) and each adds 1;
    the counter only grows, and the next pair needs both increments."""
    if tidx == 0:
        seen = ld_acquire_gpu(sem_ptr)
        while seen < value:
            seen = ld_acquire_gpu(sem_ptr)


@dsl_user_op
def bulk_copy_to_peer(dst: cute.Pointer, src: cute.Pointer, mbar: cute.Pointer, nbytes: cutlass.Constexpr[int],
                      peer: Int32, *, loc=None, ip=None) -> None:
    """One ``cp.async.bulk.shared::cluster.shared::cta``: `nbytes` from this CTA's SMEM at `src` to
    the SMEM of cluster CTA `peer` at the offset of `dst`, completing `nbytes` of tx on the peer's
    mbarrier at the offset of `mbar` (both translated with ``mapa``). The copy runs in the async
    proxy (like TMA), so an MMA of the peer may read the bytes once that mbarrier phase completes.
    Issued by one thread; `src` must have been written and fenced (fence.proxy.async) before."""
    args = [dst.toint(loc=loc, ip=ip).ir_value(), src.toint(loc=loc, ip=ip).ir_value(),
            mbar.toint(loc=loc, ip=ip).ir_value(), Int32(peer).ir_value(loc=loc, ip=ip),
            Int32(nbytes).ir_value(loc=loc, ip=ip)]
    llvm.inline_asm(None, args,
                    "{\n\t.reg .b32 dst_c, bar_c;\n\t"
                    "mapa.shared::cluster.u32 dst_c, $0, $3;\n\t"
                    "mapa.shared::cluster.u32 bar_c, $2, $3;\n\t"
                    "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [dst_c], [$1], $4, [bar_c];\n\t}",
                    "r,r,r,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def stats_offset(offset_q, batch):
    """Varlen: where sequence `batch` (first query row offset_q = cu_seqlens_q[batch]) starts in the
    preprocess's lse2 / D rows: offset_q + 3 batch rounded up to a multiple of 4, so every sequence
    starts 16-byte aligned (step 3's producer loads them with TMA, whose innermost start coordinate
    faulted -- illegal instruction -- when it was not) and none overlaps the next (start b + 1 >=
    start b + length b). Plain integer arithmetic: works on Python ints and traced Int32."""
    return (offset_q + 3 * batch + 3) // 4 * 4


def elem_pointer(t: cute.Tensor, coord) -> cute.Pointer:
    """Address of t[coord] (coord: an int index or a coordinate tuple)."""
    return t.iterator + cute.crd2idx(coord, t.layout)


# --------------------------------------------------------------------------------------------
# 2. tensors: fake ones for compile-only, real ones from torch
# --------------------------------------------------------------------------------------------
def fake_tensor(dtype, rank: int, last_extent: Optional[int] = None, *, align: int = 16):
    """A row-major tensor of `rank` modes for cute.compile: every extent dynamic (but the last when
    `last_extent` is given), every stride but the last dynamic and a multiple of 16 bytes
    (`align`=16) or unconstrained (`align`=4)."""
    shape = tuple(cute.sym_int32() for _ in range(rank - 1)) + (last_extent if last_extent else cute.sym_int32(),)
    div = max(1, align * 8 // dtype.width)
    stride = tuple(cute.sym_int64(divisibility=div) for _ in range(rank - 1)) + (1,)
    return cute.runtime.make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def fake_stream():
    """The stream argument of a compile-only trace (no launch)."""
    return cute.runtime.make_fake_stream()


def assume_aligned(t: cute.Tensor, last_extent: Optional[int] = None) -> cute.Tensor:
    """Trace-side: promise 16-byte multiples for all strides but the last (the host checks), and
    make the last extent static when given."""
    divby = 128 // t.element_type.width
    strides = tuple(s if isinstance(s, int) else cute.assume(s, divby=divby) for s in t.stride[:-1])
    shape = t.shape if last_extent is None else (*t.shape[:-1], last_extent)
    return cute.make_tensor(t.iterator, cute.make_layout(shape, stride=(*strides, t.stride[-1])))


# --------------------------------------------------------------------------------------------
# 3. host-side input checks (every error names the argument)
# --------------------------------------------------------------------------------------------
def check_head_dims(head_dim: int, head_dim_v: int):
    if (head_dim, head_dim_v) not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim: (q/k, v) head dims {(head_dim, head_dim_v)} not supported; "
                         f"expected one of {SUPPORTED_HEAD_DIMS}")


def _aligned(t):
    """t itself if its base and every stride but the last are 16-byte aligned, else a row-major copy or
    view (the forward's host_io.align_16B)."""
    return host_io.align_16B(t)


def check_backward_inputs(q, k, v, out, dout, lse, *, varlen: bool):
    """Validate the dense (rank 4) or packed varlen (rank 3) backward inputs; return them with
    16-byte aligned strides. Raises TypeError / ValueError naming the argument."""
    import torch

    rank = 3 if varlen else 4
    layout = "(total_tokens, heads, head_dim)" if varlen else "(batch, seqlen, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
        if t.dim() != rank:
            raise ValueError(f"{name}: expected rank {rank} {layout}, got shape {tuple(t.shape)}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"q: expected dtype float16 or bfloat16, got {q.dtype}")
    for name, t in (("k", k), ("v", v), ("out", out), ("dout", dout)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: expected dtype {q.dtype} like q, got {t.dtype}")
    if lse.dtype != torch.float32:
        raise TypeError(f"lse: expected dtype float32, got {lse.dtype}")
    lead = q.shape[:-2]  # (B, Sq) or (Tq,)
    hq, d = q.shape[-2], q.shape[-1]
    hkv, dv = k.shape[-2], v.shape[-1]
    if k.shape[-1] != d:
        raise ValueError(f"k: head_dim {k.shape[-1]} must equal q's head_dim {d}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v: leading shape {tuple(v.shape[:-1])} must equal k's {tuple(k.shape[:-1])}")
    if not varlen and k.shape[0] != q.shape[0]:
        raise ValueError(f"k: batch {k.shape[0]} must equal q's batch {q.shape[0]}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k: heads_kv = {hkv} must divide q's heads = {hq} (GQA/MQA)")
    check_head_dims(d, dv)
    if tuple(out.shape) != tuple(lead) + (hq, dv):
        raise ValueError(f"out: expected shape {tuple(lead) + (hq, dv)}, got {tuple(out.shape)}")
    if tuple(dout.shape) != tuple(out.shape):
        raise ValueError(f"dout: expected shape {tuple(out.shape)} like out, got {tuple(dout.shape)}")
    lse_shape = (hq, q.shape[0]) if varlen else (q.shape[0], hq, q.shape[1])
    if tuple(lse.shape) != lse_shape:
        raise ValueError(f"lse: expected shape {lse_shape}, got {tuple(lse.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse)):
        if not t.is_cuda:
            raise ValueError(f"{name}: expected a CUDA tensor, got device {t.device}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} like q, got {t.device}")
    q, k, v, out, dout = (_aligned(t) for t in (q, k, v, out, dout))
    if lse.stride(-1) != 1:
        lse = lse.contiguous()
    return q, k, v, out, dout, lse


def check_grad_out(name, t, like):
    """A caller-provided gradient buffer must match its input exactly (shape, dtype, device)."""
    import torch

    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    if t.shape != like.shape or t.dtype != like.dtype or t.device != like.device:
        raise ValueError(f"{name}: expected shape {tuple(like.shape)}, dtype {like.dtype}, device {like.device}; "
                         f"got {tuple(t.shape)}, {t.dtype}, {t.device}")
    if t.stride(-1) != 1 or t.data_ptr() % 16 or any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
        raise ValueError(f"{name}: expected 16-byte aligned strides with a contiguous last dim")
    return t


def check_cu_seqlens(name, cu, total: int, check_values: bool = True):
    """cu_seqlens as a launch takes it (contiguous int32 on the device); check_values also reads its
    offsets on the host (a device sync) and checks them: from 0, non-decreasing, ending at `total`."""
    import torch

    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 2:
        raise ValueError(f"{name}: expected a 1-D tensor of length batch + 1 >= 2, got shape {tuple(cu.shape)}")
    if not cu.is_cuda:
        raise ValueError(f"{name}: expected a CUDA tensor, got device {cu.device}")
    if check_values:
        host = cu.tolist()
        if host[0] != 0 or any(b < a for a, b in zip(host, host[1:])):
            raise ValueError(f"{name}: expected non-decreasing offsets starting at 0, got {host}")
        if host[-1] != total:
            raise ValueError(f"{name}: last offset {host[-1]} must equal the packed length {total}")
    return cu.contiguous()


def default_scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) \
            or not math.isfinite(softmax_scale) or softmax_scale <= 0:
        raise ValueError(f"softmax_scale: expected a positive finite float, got {softmax_scale!r}")
    return float(softmax_scale)


def backward_flops(batch, seqlen_q, seqlen_k, heads, head_dim, head_dim_v, causal) -> float:
    """2.5x the forward's FLOPs (5 GEMMs instead of 2), halved when causal (docs/ARCHITECTURE.md)."""
    return 2.5 * runner.attention_flops(batch, seqlen_q, seqlen_k, heads, head_dim, head_dim_v, causal)


# --------------------------------------------------------------------------------------------
# 4. reading a tile body in the SASS (compile tier, no GPU)
# --------------------------------------------------------------------------------------------
def exps_before_second_wait(body: list) -> int:
    """MUFU.EX2 between a tile body's first two wgmma waits: in step 3, the exponentials of P^T issued
    after the S^T wait and before the dP^T wait, i.e. the ones that run under the dP^T wgmma."""
    waits = [i for i, op in enumerate(body) if op.startswith("WARPGROUP.DEPBAR")]
    return sum(1 for op in body[waits[0]:waits[1]] if op.startswith("MUFU.EX2"))


def wgmmas_before_fence(body: list) -> int:
    """HGMMA between a tile body's second wgmma wait and the first proxy fence after it (MEMBAR): in
    the product backward, the dV wgmma issued before the fence that publishes the dS^T stores."""
    dp_wait = [i for i, op in enumerate(body) if op.startswith("WARPGROUP.DEPBAR")][1]
    fence = next(i for i in range(dp_wait, len(body)) if body[i].startswith("MEMBAR"))
    return sum(1 for op in body[dp_wait:fence] if op.startswith("HGMMA"))
