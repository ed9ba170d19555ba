"""The stable public entry points of the Blackwell (sm_100a) backward: the module ``fa4`` imports
for capability-10.x GPUs (fa4/_dispatch.py, ``backward_module`` of "sm_100").

    dq, dk, dv = attention_backward(q, k, v, out, dout, lse, causal=True)
    dq, dk, dv = attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_q, max_seqlen_k)

Same conventions as ``stage4_bwd_kernel.hopper`` (docs/ARCHITECTURE.md): varlen packs (total, H, D) with
int32 cu_seqlens (batch + 1,) and lse (Hq, total_q); optional seqused_k (batch,). UNVERIFIED: no
Blackwell GPU is reachable from this project, so the kernel behind these functions (``blackwell_bwd``,
the 1-CTA backward) has only been compiled for sm_100a and checked structurally, never run
(tests/test_stage4_blackwell.py, tests/test_stage4_blackwell_varlen.py; at (192, 128) and 256 the wide
kernel ``blackwell_bwd_wide``, tests/test_stage4_blackwell_wide.py). Supported there: dense
(B, S, H, D) and packed varlen inputs (+ seqused_k), head dims (64, 64), (96, 96), (128, 128), (192, 128)
and (256, 256), causal,
GQA/MQA, deterministic=True (varlen too: one semaphore per sequence, head and Q tile), and the
forward's variants window_size=(left, right) and softcap (dense and varlen, default and deterministic;
compiled and checked structurally, never run).

Both functions check window_size / softcap first (TypeError / ValueError naming the argument), then
raise RuntimeError on anything but a capability-10.x GPU, before importing cutlass: sm_100a code
(tcgen05, TMEM) cannot run on Hopper or on consumer Blackwell (12.x).
"""
from __future__ import annotations

BEST_STEP = "blackwell_bwd"


def _capability():
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_capability()
    except Exception:  # no torch / broken CUDA
        pass
    return None


def _check_variants(causal, window_size, softcap):
    """The Hopper backward's checks of the variants (no cutlass import): TypeError / ValueError naming
    window_size or softcap."""
    from stage0_reference.validation import check_softcap
    from stage3_fwd_kernel.components.window import beyond_causal

    beyond_causal(bool(causal), window_size)
    check_softcap(softcap)


def is_wide(head_dim, head_dim_v) -> bool:
    """The pairs the wide kernel (blackwell_bwd_wide.py) serves: TMEM cannot hold the 1-CTA kernel's
    128 x 128 tile there. Plain Python (no cutlass import)."""
    from stage4_bwd_kernel.blackwell_config import SUPPORTED_HEAD_DIMS_WIDE

    return (head_dim, head_dim if head_dim_v is None else head_dim_v) in SUPPORTED_HEAD_DIMS_WIDE


def _kernel_maker(head_dim, head_dim_v):
    """host.py's make_kernel for these head dims: the wide kernel's, or None (the 1-CTA module's own)."""
    if not is_wide(head_dim, head_dim_v):
        return None
    from stage4_bwd_kernel import blackwell_bwd_wide

    return blackwell_bwd_wide.make_kernel


def make_kernel(dtype, head_dim, head_dim_v, causal, deterministic, **kw):
    """host.py's make_kernel interface over both kernels: the wide one at (192, 128) and 256, else the 1-CTA one."""
    from stage4_bwd_kernel import blackwell_bwd

    maker = _kernel_maker(head_dim, head_dim_v) or blackwell_bwd.make_kernel
    return maker(dtype, head_dim, head_dim_v, causal, deterministic, **kw)


def _require_blackwell(what: str):
    cap = _capability()
    if cap is None or cap[0] != 10:
        where = "no CUDA device" if cap is None else f"a capability-{cap[0]}.{cap[1]} GPU"
        raise RuntimeError(f"stage4_bwd_kernel.blackwell.{what} needs a Blackwell data-center GPU (compute "
                           f"capability 10.x, sm_100a); this process has {where}. Use "
                           "stage4_bwd_kernel.hopper on sm_90, or compile_only() to build for sm_100a without one.")


def attention_backward(q, k, v, out, dout, lse, *, softmax_scale=None, causal=False, deterministic=False,
                       window_size=(None, None), softcap=0.0, dq=None, dk=None, dv=None, dlse=None):
    """Gradients of attention w.r.t. q, k, v -> (dq, dk, dv) (dense inputs, as in hopper.py);
    window_size / softcap / dlse as the Hopper backward's."""
    _check_variants(causal, window_size, softcap)
    _require_blackwell("attention_backward")
    from stage4_bwd_kernel import blackwell_bwd

    return blackwell_bwd.attention_backward(q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal,
                                            deterministic=deterministic, window_size=window_size, softcap=softcap,
                                            dq=dq, dk=dk, dv=dv, kernel_maker=_kernel_maker(q.shape[-1], v.shape[-1]),
                                            dlse=dlse)


def attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              seqused_k=None, softmax_scale=None, causal=False, deterministic=False,
                              window_size=(None, None), softcap=0.0, return_d=False, check_values=False, dlse=None):
    """Packed variable-length backward -> (dq (Tq,Hq,D), dk (Tk,Hkv,D), dv (Tk,Hkv,Dv)), as the Hopper one
    (seqused_k: only the first seqused_k[b] keys of sequence b are attended to, the others get zero
    gradient; return_d adds D = rowsum(dO * O) - dlse in lse's layout). Compiled for sm_100a and checked
    structurally, never run. window_size / softcap / check_values / dlse as the Hopper backward's. RuntimeError on
    anything but a capability-10.x GPU (after the variants' checks)."""
    _check_variants(causal, window_size, softcap)
    _require_blackwell("attention_varlen_backward")
    from stage4_bwd_kernel import blackwell_bwd

    return blackwell_bwd.attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                                   max_seqlen_k, seqused_k=seqused_k, softmax_scale=softmax_scale,
                                                   causal=causal, deterministic=deterministic, window_size=window_size,
                                                   softcap=softcap, return_d=return_d, check_values=check_values,
                                                   kernel_maker=_kernel_maker(q.shape[-1], v.shape[-1]), dlse=dlse)


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, varlen=False,
                 has_seqused_k=False, window_size=(None, None), softcap=0.0):
    """Compile the backward for sm_100a without a GPU (resource report in .report; the wide kernel,
    blackwell_bwd_wide, at (192, 128) and 256); varlen=True
    builds the packed kernel (cu_seqlens_q / cu_seqlens_k; has_seqused_k: + seqused_k); window_size /
    softcap the variant builds."""
    if is_wide(head_dim, head_dim_v):
        from stage4_bwd_kernel import blackwell_bwd_wide as kernel_module
    else:
        from stage4_bwd_kernel import blackwell_bwd as kernel_module
    return kernel_module.compile_only(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal,
                                      deterministic=deterministic, varlen=varlen, has_seqused_k=has_seqused_k,
                                      window_size=window_size, softcap=softcap)


def compile_launchable(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, varlen=False,
                       has_seqused_k=False, window_size=(None, None), softcap=0.0, seqlen_k=None, group=1) -> list:
    """What attention_backward (varlen=True: attention_varlen_backward) launches for this configuration --
    the preprocess, the main kernel, the postprocess -- compiled without a GPU under the launch's cache
    keys (TVM-FFI, fake tensors): their Compiled records in that order. The main kernel targets sm_100a
    whatever the process does (its `gpu_arch`); the preprocess and postprocess (plain SIMT code, shared
    with Hopper) compile for the process's target, so a cache for a B200 is filled in a process that
    targets sm_100a (python -m fa4 precompile --arch sm_100a). seqlen_k / group: the Hopper module's
    signature; one main kernel serves every length here. Compiled only, never run (no Blackwell GPU)."""
    from stage4_bwd_kernel import blackwell_bwd, common, host

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    maker = _kernel_maker(head_dim, head_dim_v) or blackwell_bwd.make_kernel
    # the launch's own compile (blackwell_bwd.attention_backward -> host.backward): same step, maker and variant
    kernel, main = host.compile_main(blackwell_bwd.STEP, maker, common.cutlass_dtype(dtype), head_dim, head_dim_v,
                                     causal, deterministic, varlen=varlen, has_seqused_k=has_seqused_k,
                                     variant=host.variant_of(causal, window_size, softcap))
    pre, post = host.compile_pre_post(kernel, dtype, head_dim, head_dim_v, varlen)
    return [pre, main, post]


__all__ = ["attention_backward", "attention_varlen_backward", "compile_launchable", "compile_only", "make_kernel",
           "is_wide", "BEST_STEP"]
