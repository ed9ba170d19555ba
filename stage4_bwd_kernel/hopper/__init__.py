"""The stable public entry points of the Hopper backward (the only module ``fa4`` imports).

Callers use these names only, never a kernel module, so the kernel behind them can change without
touching ``fa4``.

    dq, dk, dv = attention_backward(q, k, v, out, dout, lse, causal=True)
    dq, dk, dv = attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_q, max_seqlen_k)

Inputs follow the project conventions (docs/ARCHITECTURE.md): q (B, Sq, Hq, D), k (B, Sk, Hkv, D),
v (B, Sk, Hkv, Dv), out / dout (B, Sq, Hq, Dv) in fp16/bf16 on a CUDA device, lse (B, Hq, Sq)
fp32 natural-log as the stage-3 forward returns it (rows with no visible key: -inf); varlen packs
(total, H, D) with int32 cu_seqlens and lse (Hq, total_q). GQA/MQA: Hq % Hkv == 0. Supported head
dims (D, Dv): (64, 64), (96, 96), (128, 128), (128, 64), (192, 128), (256, 256).

``deterministic=True`` makes dq bitwise reproducible run to run (dk/dv always are): the dQ
additions of the K/V tiles are serialised per dQ tile by semaphores in a fixed order
(``dq_writer.py``; at 256 the consumers' own adds, in turns kept by two idle warps, ``wide.py``), and
the CTAs launch in sections of chains (``schedule.py``).

Which kernel serves a call: the composed production kernel of this package (``backward.py``,
``kernel.py`` and its components) for every head-dim pair in every mode: 64, 96, 128 and (128, 64) with
dV / dK sourced from registers, (192, 128) and (256, 256) on the wide designs (``wide_swap.py``: 96 keys
a CTA, dK^T / dV^T; ``wide.py``: 64 keys), whose accumulators would not fit those registers. Measured: docs/measurements.md.
"""
from __future__ import annotations

import functools

from stage4_bwd_kernel.hopper import backward as _product
from stage4_bwd_kernel.hopper.backward import STEP, make_kernel, with_options
from stage4_bwd_kernel.hopper.kernel import FlashAttentionBackwardSm90
from stage4_bwd_kernel.hopper.layouts import dq_frag_tiled_copy
from stage4_bwd_kernel.hopper.options import (NUM_WG_MMA, RS_HEAD_DIMS, WIDE_HEAD_DIMS, BackwardOptions,
                                              check_product_head_dims, default_tiles)
from stage4_bwd_kernel.hopper.scores import stats_shuffle_query, stats_shuffle_source

BEST_STEP = STEP


def step_for(head_dim: int, causal: bool, deterministic: bool):
    """The module that serves this configuration: the production kernel's ``backward`` for every
    supported head-dim pair (the wide ones on its own design, ``wide.py``); the arguments stay in the
    signature for the callers that ask per configuration."""
    return _product


def attention_backward(q, k, v, out, dout, lse, *, softmax_scale=None, causal=False, deterministic=False,
                       window_size=(None, None), softcap=0.0, dq=None, dk=None, dv=None, return_d=False, dlse=None):
    """Gradients of attention w.r.t. q, k, v -> (dq, dk, dv), each like its input.

    dq / dk / dv: optional preallocated outputs (same shape, dtype, device as q / k / v).
    window_size / softcap: the forward's variant. return_d: also return D =
    rowsum(dO * O) in lse's layout, fp32. dlse: a gradient flowing in through lse (lse's shape),
    which the preprocess subtracts from D (one pass either way; return_d then returns D - dlse)."""
    return _product.attention_backward(q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal,
                                       deterministic=deterministic, window_size=window_size, softcap=softcap,
                                       dq=dq, dk=dk, dv=dv, return_d=return_d, dlse=dlse)


def attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              seqused_k=None, softmax_scale=None, causal=False, deterministic=False,
                              window_size=(None, None), softcap=0.0, return_d=False, check_values=False, dlse=None):
    """Packed variable-length backward -> (dq (Tq,Hq,D), dk (Tk,Hkv,D), dv (Tk,Hkv,Dv)).

    seqused_k: optional int32 (batch,): only the first seqused_k[b] keys of sequence b are
    attended to (causal alignment uses that length); the others get zero gradient. They must hold
    finite values (zeros, say), as must the q and dout rows just past each sequence: a tile that
    straddles a sequence's end loads them, and 0 * NaN in the MMAs would reach the sequence's dq
    (keys) or dk / dv (queries). fa4's varlen call hands the kernels zeros there.
    check_values=True also checks cu_seqlens / seqused_k / max_seqlen_* against the values on the
    host (a device sync, so off by default: no sync per call, capturable in a CUDA graph). dlse: (Hq, Tq),
    as attention_backward's."""
    return _product.attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                              max_seqlen_k, seqused_k=seqused_k, softmax_scale=softmax_scale,
                                              causal=causal, deterministic=deterministic, window_size=window_size,
                                              softcap=softcap, return_d=return_d, check_values=check_values,
                                              dlse=dlse)


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, varlen=False):
    """Compile the production kernel for sm_90a without a GPU (CI / resource reports)."""
    return _product.compile_only(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal,
                                 deterministic=deterministic, varlen=varlen)


def compile_launchable(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, varlen=False,
                       has_seqused_k=False, window_size=(None, None), softcap=0.0, seqlen_k=None, group=1) -> list:
    """What ``attention_backward`` (varlen=True: ``attention_varlen_backward``) launches for this
    configuration -- the preprocess, the main kernel, the postprocess -- compiled without a GPU under
    the GPU path's cache keys (TVM-FFI, fake tensors). seqlen_k: the query and key count of a call and
    group its GQA group (query heads a KV head), which pick the persistent main kernel or not
    (``persistent_pays``); seqlen_k None: every main kernel some call picks. Returns their Compiled
    records: preprocess, main, postprocess, then any other main. With fa4's disk cache installed this
    fills it on a CPU machine (python -m fa4 precompile)."""
    from stage4_bwd_kernel import common, host

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    pays = functools.partial(_product.persistent_pays, head_dim, head_dim_v, deterministic)
    if seqlen_k is not None:
        builds = [_product.PERSISTENT if pays(seqlen_k, seqlen_k, group) else (STEP, make_kernel)]
    else:  # the one-per-tile kernel leads (the records' order before the persistent one existed)
        builds = [(STEP, make_kernel)] + ([_product.PERSISTENT] if pays(1, 1) else [])
    # the kernel's constructor checks the head dims (ValueError) before anything compiles
    mains = [host.compile_main(step, make, common.cutlass_dtype(dtype), head_dim, head_dim_v, causal,
                               deterministic, varlen=varlen, has_seqused_k=has_seqused_k,
                               variant=host.variant_of(causal, window_size, softcap)) for step, make in builds]
    pre, post = host.compile_pre_post(mains[0][0], dtype, head_dim, head_dim_v, varlen)
    return [pre, mains[0][1], post, *[main for _, main in mains[1:]]]


def run(**kwargs):
    """The production kernel's run(): GPU check + timing (+ deterministic vs default), else compile report."""
    return _product.run(**kwargs)


__all__ = ["attention_backward", "attention_varlen_backward", "compile_launchable", "compile_only", "run", "step_for",
           "BEST_STEP", "STEP", "make_kernel", "with_options", "FlashAttentionBackwardSm90", "BackwardOptions", "default_tiles",
           "check_product_head_dims", "dq_frag_tiled_copy", "stats_shuffle_source", "stats_shuffle_query", "NUM_WG_MMA",
           "RS_HEAD_DIMS", "WIDE_HEAD_DIMS"]
