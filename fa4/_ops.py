"""torch.library custom ops: what torch.compile, autograd and CUDA graphs see of fa4.

Four ops, each an opaque node in a traced graph:

    fa4::fwd(q, k, v, softmax_scale, causal, deterministic, return_lse) -> (out, lse)
    fa4::bwd(dout, q, k, v, out, lse, dlse?, softmax_scale, causal, deterministic) -> (dq, dk, dv)
    fa4::varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k?, max_seqlen_q, max_seqlen_k, ...) -> (out, lse)
    fa4::varlen_bwd(dout, q, k, v, out, lse, dlse?, cu_seqlens_q, cu_seqlens_k, seqused_k?, ...) -> (dq, dk, dv)

Why custom ops and not a plain autograd.Function: dynamo cannot trace into a CuTe-DSL launch
(ctypes, DLPack, a JIT compiler), so without an op it would graph-break at every attention
call. A custom op with a *fake* implementation (shapes and dtypes only) lets dynamo and
AOTAutograd trace through it with FakeTensors, and `register_autograd` ties fwd to bwd so the
joint graph contains both. The fake implementations also serve meta tensors.

Layout contract shared by the real and the fake implementations (they must agree, or inductor
would plan for the wrong strides): every output is freshly allocated and contiguous;
out is (B, Sq, Hq, Dv) / (Tq, Hq, Dv) in q's dtype, lse is fp32 (B, Hq, Sq) / (Hq, Tq), dq/dk/dv
have the shapes of q/k/v.

In eager mode on plain CUDA tensors the public functions skip the op and run the same
implementations under a plain autograd.Function (`attention` / `varlen_attention`, see
`eager_ok` at the end): the op's dispatcher round trip cost more host time than the kernels of
a short call.

`deterministic` and `return_lse` ride along in fwd only so that the backward can see them:
return_lse=False means the caller never saw lse, so its gradient is known to be zero and the
backward skips the dlse correction (which would otherwise cost an extra kernel call whenever
torch materialises a zero gradient, as AOTAutograd does).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import _dispatch

NEG_INF = float("-inf")


def _contig(*ts):
    return tuple(t.contiguous() for t in ts)


def _last_dim_unit(t):
    return t if t.stride(-1) == 1 else t.contiguous()


# ---------------------------------------------------------------------------------------------
# fixed-length
# ---------------------------------------------------------------------------------------------
def _fwd_impl(q, k, v, softmax_scale, causal, deterministic, return_lse):
    backend = _dispatch.backend_for(q.device)
    b, sq, hq, d = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    backend.check_head_dims(d, dv)
    if b == 0 or sq == 0 or hq == 0:  # nothing to compute: no launch
        return q.new_empty((b, sq, hq, dv)), q.new_empty((b, hq, sq), dtype=torch.float32)
    if sk == 0:  # no key visible anywhere: out 0, lse -inf (the convention for empty rows)
        return q.new_zeros((b, sq, hq, dv)), q.new_full((b, hq, sq), NEG_INF, dtype=torch.float32)
    out, lse = backend.forward(q, k, v, softmax_scale, causal)
    return _contig(out, lse)


@torch.library.custom_op("fa4::fwd", mutates_args=(), device_types="cuda")
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, deterministic: bool,
        return_lse: bool) -> tuple[Tensor, Tensor]:
    return _fwd_impl(q, k, v, softmax_scale, causal, deterministic, return_lse)


@fwd.register_fake
def _(q, k, v, softmax_scale, causal, deterministic, return_lse):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v.shape[-1])), q.new_empty((b, hq, sq), dtype=torch.float32)


def _bwd_impl(dout, q, k, v, out, lse, dlse, softmax_scale, causal, deterministic):
    backend = _dispatch.backend_for(q.device)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    backend.check_head_dims(d, v.shape[-1])
    if b == 0 or sq == 0 or hq == 0 or sk == 0:  # every gradient is exactly zero
        return torch.zeros_like(q, memory_format=torch.contiguous_format), \
            torch.zeros_like(k, memory_format=torch.contiguous_format), \
            torch.zeros_like(v, memory_format=torch.contiguous_format)
    dq, dk, dv = backend.backward(_last_dim_unit(dout), q, k, v, out, lse, softmax_scale, causal, deterministic,
                                  dlse=None if dlse is None else dlse.contiguous())
    return _contig(dq, dk, dv)


@torch.library.custom_op("fa4::bwd", mutates_args=(), device_types="cuda")
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
        softmax_scale: float, causal: bool, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _bwd_impl(dout, q, k, v, out, lse, dlse, softmax_scale, causal, deterministic)


@bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, softmax_scale, causal, deterministic):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic, return_lse = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.return_lse = softmax_scale, causal, deterministic, return_lse
    # unused outputs get None instead of a zero tensor (eager): no needless dlse correction
    ctx.set_materialize_grads(False)


def _fwd_backward(ctx, dout, dlse, bwd_fn=None):
    q, k, v, out, lse = ctx.saved_tensors
    if not ctx.return_lse:
        dlse = None
    if dout is None and dlse is None:
        return None, None, None, None, None, None, None
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = (bwd_fn or bwd)(dout, q, k, v, out, lse, dlse, ctx.softmax_scale, ctx.causal, ctx.deterministic)
    return dq, dk, dv, None, None, None, None


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ---------------------------------------------------------------------------------------------
# varlen (packed)
# ---------------------------------------------------------------------------------------------
def _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, deterministic, return_lse):
    backend = _dispatch.backend_for(q.device)
    tq, hq, d = q.shape
    tk, dv = k.shape[0], v.shape[-1]
    backend.check_head_dims(d, dv)
    if tq == 0 or hq == 0 or tk == 0 or cu_seqlens_q.shape[0] <= 1 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return q.new_zeros((tq, hq, dv)), q.new_full((hq, tq), NEG_INF, dtype=torch.float32)
    out, lse = backend.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale, causal)
    return _contig(out, lse)


@torch.library.custom_op("fa4::varlen_fwd", mutates_args=(), device_types="cuda")
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               seqused_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
               causal: bool, deterministic: bool, return_lse: bool) -> tuple[Tensor, Tensor]:
    return _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, causal, deterministic, return_lse)


@varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      deterministic, return_lse):
    tq, hq, _ = q.shape
    return q.new_empty((tq, hq, v.shape[-1])), q.new_empty((hq, tq), dtype=torch.float32)


def _varlen_bwd_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, causal, deterministic):
    backend = _dispatch.backend_for(q.device)
    tq, hq, d = q.shape
    backend.check_head_dims(d, v.shape[-1])
    if tq == 0 or hq == 0 or k.shape[0] == 0 or cu_seqlens_q.shape[0] <= 1 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return torch.zeros_like(q, memory_format=torch.contiguous_format), \
            torch.zeros_like(k, memory_format=torch.contiguous_format), \
            torch.zeros_like(v, memory_format=torch.contiguous_format)
    dq, dk, dv = backend.varlen_backward(_last_dim_unit(dout), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                         seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, deterministic,
                                         dlse=None if dlse is None else dlse.contiguous())
    return _contig(dq, dk, dv)


@torch.library.custom_op("fa4::varlen_bwd", mutates_args=(), device_types="cuda")
def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_k: Optional[Tensor], max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float, causal: bool,
               deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _varlen_bwd_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                            max_seqlen_k, softmax_scale, causal, deterministic)


@varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, deterministic):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, softmax_scale, causal, deterministic, return_lse) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seqused_k)
    ctx.max_q, ctx.max_k = max_q, max_k
    ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.return_lse = softmax_scale, causal, deterministic, return_lse
    ctx.set_materialize_grads(False)


def _varlen_backward(ctx, dout, dlse, bwd_fn=None):
    q, k, v, out, lse, cu_q, cu_k, seqused_k = ctx.saved_tensors
    nones = (None,) * 9
    if not ctx.return_lse:
        dlse = None
    if dout is None and dlse is None:
        return (None, None, None) + nones
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = (bwd_fn or varlen_bwd)(dout, q, k, v, out, lse, dlse, cu_q, cu_k, seqused_k, ctx.max_q, ctx.max_k,
                            ctx.softmax_scale, ctx.causal, ctx.deterministic)
    return (dq, dk, dv) + nones


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# ---------------------------------------------------------------------------------------------
# the eager fast path
# ---------------------------------------------------------------------------------------------
# A custom op's round trip through the dispatcher (autograd wrapper, redispatch, the aliasing
# check of the outputs) was most of fa4's own host time per call in eager mode on the H100 host
# (torch 2.11, a host-side profile: forward 252 us per call against 84 us for the stage-3
# entry point it wraps). Outside torch.compile, on plain CUDA tensors and with no dispatch mode
# active, the same implementations run under a plain autograd.Function instead; everything else
# (dynamo tracing, FakeTensorMode, meta tensors, tensor subclasses, functorch transforms) keeps the
# op, which those need to see.
def eager_ok(*tensors) -> bool:
    return (not torch.compiler.is_compiling() and _get_current_dispatch_mode() is None
            and all(t is None or (type(t) is Tensor and t.is_cuda) for t in tensors))


def _eager_function(impl, setup_context, backward, bwd_impl):
    """An autograd.Function running `impl` with the op's own autograd pieces (setup_context,
    backward), the backward calling `bwd_impl` directly instead of the backward op."""
    class Eager(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            output = impl(*inputs)
            setup_context(ctx, inputs, output)
            return output

        @staticmethod
        def backward(ctx, dout, dlse):
            return backward(ctx, dout, dlse, bwd_fn=bwd_impl)

    return Eager


_EagerFwd = _eager_function(_fwd_impl, _fwd_setup_context, _fwd_backward, _bwd_impl)
_EagerVarlenFwd = _eager_function(_varlen_fwd_impl, _varlen_setup_context, _varlen_backward, _varlen_bwd_impl)


def attention(q, k, v, softmax_scale, causal, deterministic, return_lse):
    """fa4::fwd with autograd: the op, or its eager fast path (see eager_ok)."""
    if eager_ok(q, k, v):
        return _EagerFwd.apply(q, k, v, softmax_scale, causal, deterministic, return_lse)
    return fwd(q, k, v, softmax_scale, causal, deterministic, return_lse)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, deterministic, return_lse):
    """fa4::varlen_fwd with autograd: the op, or its eager fast path (see eager_ok)."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            deterministic, return_lse)
    if eager_ok(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k):
        return _EagerVarlenFwd.apply(*args)
    return varlen_fwd(*args)
