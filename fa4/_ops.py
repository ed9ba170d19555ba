"""torch.library custom ops: what torch.compile, autograd and CUDA graphs see of fa4.

Five ops, each an opaque node in a traced graph:

    fa4::fwd(q, k, v, softmax_scale, causal, deterministic, return_lse, *variants) -> (out, lse)
    fa4::bwd(dout, q, k, v, out, lse, dlse?, softmax_scale, causal, deterministic, *variants) -> (dq, dk, dv, dsink)
    fa4::varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k?, max_seqlen_q, max_seqlen_k, ..., *variants)
        -> (out, lse)
    fa4::varlen_bwd(dout, q, k, v, out, lse, dlse?, cu_seqlens_q, cu_seqlens_k, seqused_k?, ..., *variants)
        -> (dq, dk, dv, dsink)
    fa4::paged_varlen_fwd(q, k_pages, v_pages, page_table, cu_seqlens_q, cu_seqlens_k, seqused_k, ...)
        -> (out, lse), forward only: a paged KV cache read in place (fa4._paged)

with the variants last and at their defaults when not used (so every older call still binds):
`window_left: int? = None, window_right: int? = None, softcap: float = 0.0,
learnable_sink: Tensor? = None` (window as fa4._validate.check_window returns it: a causal call
has window_right None). The backward ops compute the sink's gradient (fa4._dispatch.sink_grad,
torch ops) and return it as dsink, in the sink's dtype and shape; without a sink dsink is an empty
fp32 tensor and the autograd formula returns None for it.

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
backward skips the dlse correction (which would otherwise cost a D-row update whenever
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
# shared pieces
# ---------------------------------------------------------------------------------------------
def _window(window_left, window_right):
    return (window_left, window_right)


def _check_variants(backend, window, softcap, learnable_sink):
    """Refuse variants the arch lacks also for empty problems (the Backend methods check them again
    before a launch); a plain call skips the call."""
    if window != (None, None) or softcap != 0.0 or learnable_sink is not None:
        backend.check_variants(window, softcap, learnable_sink)


def _empty_lse(q, shape, learnable_sink, head_dim):
    """lse of rows that see no key: -inf, or the sink's logit (the denominator is exp(sink) alone,
    out stays 0). `head_dim` is the dimension of `shape` that counts heads."""
    if learnable_sink is None:
        return q.new_full(shape, NEG_INF, dtype=torch.float32)
    view = [1] * len(shape)
    view[head_dim] = -1
    # clone, not contiguous(): with one lse value per head the expand is already contiguous, and the
    # result would share the sink's storage (an optimizer step would then change a returned lse)
    return learnable_sink.detach().to(torch.float32).view(view).expand(shape).clone(
        memory_format=torch.contiguous_format)


def _dsink(out, dout, lse, dlse, learnable_sink, d=None):
    """The sink's gradient (fa4._dispatch.sink_grad; d: the backward's D rows when it returned them,
    already D - dlse), or an empty fp32 tensor when there is no sink."""
    if learnable_sink is None:
        return lse.new_empty((0,), dtype=torch.float32)
    return _dispatch.sink_grad(out, dout, lse, learnable_sink, dlse if d is None else None, d=d).contiguous()


def _fake_dsink(q, learnable_sink):
    if learnable_sink is None:
        return q.new_empty((0,), dtype=torch.float32)
    return torch.empty_like(learnable_sink, memory_format=torch.contiguous_format)


def _zero_grads(q, k, v):
    return tuple(torch.zeros_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


# ---------------------------------------------------------------------------------------------
# fixed-length
# ---------------------------------------------------------------------------------------------
def _fwd_impl(q, k, v, softmax_scale, causal, deterministic, return_lse, window_left=None, window_right=None,
              softcap=0.0, learnable_sink=None):
    backend = _dispatch.backend_for(q.device)
    b, sq, hq, d = q.shape
    sk, dv = k.shape[1], v.shape[-1]
    backend.check_head_dims(d, dv)
    window = _window(window_left, window_right)
    _check_variants(backend, window, softcap, learnable_sink)
    if b == 0 or sq == 0 or hq == 0:  # nothing to compute: no launch
        return q.new_empty((b, sq, hq, dv)), q.new_empty((b, hq, sq), dtype=torch.float32)
    if sk == 0:  # no key visible anywhere: out 0, lse -inf (or the sink: the convention for empty rows)
        return q.new_zeros((b, sq, hq, dv)), _empty_lse(q, (b, hq, sq), learnable_sink, 1)
    out, lse = backend.forward(q, k, v, softmax_scale, causal, window=window, softcap=softcap,
                               learnable_sink=learnable_sink)
    return _contig(out, lse)


@torch.library.custom_op("fa4::fwd", mutates_args=(), device_types="cuda")
def fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: float, causal: bool, deterministic: bool,
        return_lse: bool, window_left: Optional[int] = None, window_right: Optional[int] = None,
        softcap: float = 0.0, learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return _fwd_impl(q, k, v, softmax_scale, causal, deterministic, return_lse, window_left, window_right, softcap,
                     learnable_sink)


@fwd.register_fake
def _(q, k, v, softmax_scale, causal, deterministic, return_lse, window_left=None, window_right=None, softcap=0.0,
      learnable_sink=None):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v.shape[-1])), q.new_empty((b, hq, sq), dtype=torch.float32)


def _bwd_impl(dout, q, k, v, out, lse, dlse, softmax_scale, causal, deterministic, window_left=None,
              window_right=None, softcap=0.0, learnable_sink=None):
    backend = _dispatch.backend_for(q.device)
    b, sq, hq, d = q.shape
    sk = k.shape[1]
    backend.check_head_dims(d, v.shape[-1])
    window = _window(window_left, window_right)
    _check_variants(backend, window, softcap, learnable_sink)
    if b == 0 or sq == 0 or hq == 0 or sk == 0:  # every gradient of q, k, v is exactly zero
        return (*_zero_grads(q, k, v), _dsink(out, dout, lse, dlse, learnable_sink))
    # with a sink the kernel's D rows come back (its preprocess forms them), for the sink's gradient
    dq, dk, dv, *d = backend.backward(_last_dim_unit(dout), q, k, v, out, lse, softmax_scale, causal, deterministic,
                                      dlse=None if dlse is None else dlse.contiguous(), window=window, softcap=softcap,
                                      want_d=learnable_sink is not None)
    return (*_contig(dq, dk, dv), _dsink(out, dout, lse, dlse, learnable_sink, *d))


@torch.library.custom_op("fa4::bwd", mutates_args=(), device_types="cuda")
def bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
        softmax_scale: float, causal: bool, deterministic: bool, window_left: Optional[int] = None,
        window_right: Optional[int] = None, softcap: float = 0.0,
        learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _bwd_impl(dout, q, k, v, out, lse, dlse, softmax_scale, causal, deterministic, window_left, window_right,
                     softcap, learnable_sink)


@bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, softmax_scale, causal, deterministic, window_left=None, window_right=None,
      softcap=0.0, learnable_sink=None):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device), _fake_dsink(q, learnable_sink))


def _fwd_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic, return_lse, *variants = inputs
    window_left, window_right, softcap, learnable_sink = (list(variants) + [None, None, 0.0, None][len(variants):])
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, learnable_sink)
    ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.return_lse = softmax_scale, causal, deterministic, return_lse
    ctx.window, ctx.softcap = (window_left, window_right), softcap
    # unused outputs get None instead of a zero tensor (eager): no needless dlse correction
    ctx.set_materialize_grads(False)


def _fwd_backward(ctx, dout, dlse, bwd_fn=None):
    q, k, v, out, lse, sink = ctx.saved_tensors
    nones = (None,) * 7  # softmax_scale .. softcap
    if not ctx.return_lse:
        dlse = None
    if dout is None and dlse is None:
        return (None, None, None) + nones + (None,)
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink = (bwd_fn or bwd)(dout, q, k, v, out, lse, dlse, ctx.softmax_scale, ctx.causal,
                                        ctx.deterministic, *ctx.window, ctx.softcap, sink)
    return (dq, dk, dv) + nones + (None if sink is None else dsink,)


fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup_context)


# ---------------------------------------------------------------------------------------------
# varlen (packed)
# ---------------------------------------------------------------------------------------------
def _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, deterministic, return_lse, window_left=None, window_right=None, softcap=0.0,
                     learnable_sink=None):
    backend = _dispatch.backend_for(q.device)
    tq, hq, d = q.shape
    tk, dv = k.shape[0], v.shape[-1]
    backend.check_head_dims(d, dv)
    window = _window(window_left, window_right)
    _check_variants(backend, window, softcap, learnable_sink)
    if tq == 0 or hq == 0 or tk == 0 or cu_seqlens_q.shape[0] <= 1 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return q.new_zeros((tq, hq, dv)), _empty_lse(q, (hq, tq), learnable_sink, 0)
    out, lse = backend.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                                      softmax_scale, causal, window=window, softcap=softcap,
                                      learnable_sink=learnable_sink)
    return _contig(out, lse)


@torch.library.custom_op("fa4::varlen_fwd", mutates_args=(), device_types="cuda")
def varlen_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
               seqused_k: Optional[Tensor], max_seqlen_q: int, max_seqlen_k: int, softmax_scale: float,
               causal: bool, deterministic: bool, return_lse: bool, window_left: Optional[int] = None,
               window_right: Optional[int] = None, softcap: float = 0.0,
               learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return _varlen_fwd_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, causal, deterministic, return_lse, window_left, window_right, softcap,
                            learnable_sink)


@varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      deterministic, return_lse, window_left=None, window_right=None, softcap=0.0, learnable_sink=None):
    tq, hq, _ = q.shape
    return q.new_empty((tq, hq, v.shape[-1])), q.new_empty((hq, tq), dtype=torch.float32)


def _paged_varlen_fwd_impl(q, k_pages, v_pages, page_table, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                           max_seqlen_k, softmax_scale, causal, window_left=None, window_right=None, softcap=0.0):
    """The varlen forward reading a paged cache (num_pages, page_size, Hkv, D) in place through
    page_table (stage3_fwd_kernel.components.paged_kv); forward only (fa4._paged routes here only
    when nothing needs a gradient). cu_seqlens_k: each sequence's first logical key."""
    backend = _dispatch.backend_for(q.device)
    tq, hq, d = q.shape
    dv = v_pages.shape[-1]
    backend.check_head_dims(d, dv)
    window = _window(window_left, window_right)
    _check_variants(backend, window, softcap, None)
    if tq == 0 or hq == 0 or cu_seqlens_q.shape[0] <= 1 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return q.new_zeros((tq, hq, dv)), _empty_lse(q, (hq, tq), None, 0)
    out, lse = backend.varlen_forward(q, k_pages, v_pages, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                                      max_seqlen_k, softmax_scale, causal, window=window, softcap=softcap,
                                      page_table=page_table)
    return _contig(out, lse)


@torch.library.custom_op("fa4::paged_varlen_fwd", mutates_args=(), device_types="cuda")
def paged_varlen_fwd(q: Tensor, k_pages: Tensor, v_pages: Tensor, page_table: Tensor, cu_seqlens_q: Tensor,
                     cu_seqlens_k: Tensor, seqused_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                     softmax_scale: float, causal: bool, window_left: Optional[int] = None,
                     window_right: Optional[int] = None, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    return _paged_varlen_fwd_impl(q, k_pages, v_pages, page_table, cu_seqlens_q, cu_seqlens_k, seqused_k,
                                  max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_left, window_right,
                                  softcap)


@paged_varlen_fwd.register_fake
def _(q, k_pages, v_pages, page_table, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, window_left=None, window_right=None, softcap=0.0):
    tq, hq, _ = q.shape
    return q.new_empty((tq, hq, v_pages.shape[-1])), q.new_empty((hq, tq), dtype=torch.float32)


def paged_varlen_attention(q, k_pages, v_pages, page_table, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                           max_seqlen_k, softmax_scale, causal, window=(None, None), softcap=0.0):
    """fa4::paged_varlen_fwd, or its implementation in eager mode on plain CUDA tensors (eager_ok)."""
    args = (q, k_pages, v_pages, page_table, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
            softmax_scale, causal, *window, softcap)
    if eager_ok(q, k_pages, v_pages, page_table, cu_seqlens_q, cu_seqlens_k, seqused_k):
        return _paged_varlen_fwd_impl(*args)
    return paged_varlen_fwd(*args)


def _varlen_bwd_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                     max_seqlen_k, softmax_scale, causal, deterministic, window_left=None, window_right=None,
                     softcap=0.0, learnable_sink=None):
    backend = _dispatch.backend_for(q.device)
    tq, hq, d = q.shape
    backend.check_head_dims(d, v.shape[-1])
    window = _window(window_left, window_right)
    _check_variants(backend, window, softcap, learnable_sink)
    if tq == 0 or hq == 0 or k.shape[0] == 0 or cu_seqlens_q.shape[0] <= 1 or max_seqlen_q == 0 or max_seqlen_k == 0:
        return (*_zero_grads(q, k, v), _dsink(out, dout, lse, dlse, learnable_sink))
    dq, dk, dv, *d = backend.varlen_backward(_last_dim_unit(dout), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                             seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                                             deterministic, dlse=None if dlse is None else dlse.contiguous(),
                                             window=window, softcap=softcap, want_d=learnable_sink is not None)
    return (*_contig(dq, dk, dv), _dsink(out, dout, lse, dlse, learnable_sink, *d))


@torch.library.custom_op("fa4::varlen_bwd", mutates_args=(), device_types="cuda")
def varlen_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dlse: Optional[Tensor],
               cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, seqused_k: Optional[Tensor], max_seqlen_q: int,
               max_seqlen_k: int, softmax_scale: float, causal: bool, deterministic: bool,
               window_left: Optional[int] = None, window_right: Optional[int] = None, softcap: float = 0.0,
               learnable_sink: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _varlen_bwd_impl(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q,
                            max_seqlen_k, softmax_scale, causal, deterministic, window_left, window_right, softcap,
                            learnable_sink)


@varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k,
      softmax_scale, causal, deterministic, window_left=None, window_right=None, softcap=0.0, learnable_sink=None):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device), _fake_dsink(q, learnable_sink))


def _varlen_setup_context(ctx, inputs, output):
    (q, k, v, cu_q, cu_k, seqused_k, max_q, max_k, softmax_scale, causal, deterministic, return_lse,
     *variants) = inputs
    window_left, window_right, softcap, learnable_sink = (list(variants) + [None, None, 0.0, None][len(variants):])
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seqused_k, learnable_sink)
    ctx.max_q, ctx.max_k = max_q, max_k
    ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.return_lse = softmax_scale, causal, deterministic, return_lse
    ctx.window, ctx.softcap = (window_left, window_right), softcap
    ctx.set_materialize_grads(False)


def _varlen_backward(ctx, dout, dlse, bwd_fn=None):
    q, k, v, out, lse, cu_q, cu_k, seqused_k, sink = ctx.saved_tensors
    nones = (None,) * 12  # cu_seqlens_q .. softcap
    if not ctx.return_lse:
        dlse = None
    if dout is None and dlse is None:
        return (None, None, None) + nones + (None,)
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dsink = (bwd_fn or varlen_bwd)(dout, q, k, v, out, lse, dlse, cu_q, cu_k, seqused_k, ctx.max_q,
                                               ctx.max_k, ctx.softmax_scale, ctx.causal, ctx.deterministic,
                                               *ctx.window, ctx.softcap, sink)
    return (dq, dk, dv) + nones + (None if sink is None else dsink,)


varlen_fwd.register_autograd(_varlen_backward, setup_context=_varlen_setup_context)


# ---------------------------------------------------------------------------------------------
# the eager fast path
# ---------------------------------------------------------------------------------------------
# A custom op's round trip through the dispatcher (autograd wrapper, redispatch, the aliasing
# check of the outputs) was most of fa4's own host time per call in eager mode on the H100 host
# (torch 2.11, a host-side profile: forward 252 us per call against 84 us for the stage-3
# entry point it wraps). Outside torch.compile, on plain CUDA tensors and with no dispatch mode
# active, the same implementations run under a plain autograd.Function instead; everything else
# (dynamo tracing, FakeTensorMode, meta tensors, tensor subclasses) keeps the op, which those need
# to see. (torch.func transforms wrap tensors that pass this test; neither path supports them: the
# op and the Function have no setup_context / vmap rule.)
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
            # create_graph=True (grad mode on here): through the backward op, whose missing autograd
            # formula refuses a double backward as the op path does. The kernels' gradients carry no
            # history, so straight from bwd_impl a gradient penalty would get None for q's part.
            return backward(ctx, dout, dlse, bwd_fn=None if torch.is_grad_enabled() else bwd_impl)

    return Eager


_EagerFwd = _eager_function(_fwd_impl, _fwd_setup_context, _fwd_backward, _bwd_impl)
_EagerVarlenFwd = _eager_function(_varlen_fwd_impl, _varlen_setup_context, _varlen_backward, _varlen_bwd_impl)


def _sink_ok(learnable_sink) -> bool:
    """The eager path takes a sink that is a plain tensor or an nn.Parameter (what models hold;
    Parameter adds no dispatch behaviour) on CUDA."""
    return learnable_sink is None or (type(learnable_sink) in (Tensor, torch.nn.Parameter) and learnable_sink.is_cuda)


def attention(q, k, v, softmax_scale, causal, deterministic, return_lse, window=(None, None), softcap=0.0,
              learnable_sink=None):
    """fa4::fwd with autograd: the op, or its eager fast path (see eager_ok). window = (left, right)
    as fa4._validate.check_window returns it."""
    args = (q, k, v, softmax_scale, causal, deterministic, return_lse, *window, softcap, learnable_sink)
    if eager_ok(q, k, v) and _sink_ok(learnable_sink):
        return _EagerFwd.apply(*args)
    return fwd(*args)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                     causal, deterministic, return_lse, window=(None, None), softcap=0.0, learnable_sink=None):
    """fa4::varlen_fwd with autograd: the op, or its eager fast path (see eager_ok)."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
            deterministic, return_lse, *window, softcap, learnable_sink)
    if eager_ok(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k) and _sink_ok(learnable_sink):
        return _EagerVarlenFwd.apply(*args)
    return varlen_fwd(*args)
