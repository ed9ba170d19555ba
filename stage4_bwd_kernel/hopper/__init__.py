"""The stable public entry points of the Hopper backward (the only module ``fa4`` imports).

Whichever ladder step is currently the best lives behind these two functions; callers never
import a step module directly, so a new step can replace the old one without touching ``fa4``.

    dq, dk, dv = attention_backward(q, k, v, out, dout, lse, causal=True)
    dq, dk, dv = attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k,
                                           max_seqlen_q, max_seqlen_k)

Inputs follow the project conventions (DESIGN.md): q (B, Sq, Hq, D), k (B, Sk, Hkv, D),
v (B, Sk, Hkv, Dv), out / dout (B, Sq, Hq, Dv) in fp16/bf16 on a CUDA device, lse (B, Hq, Sq)
fp32 natural-log as the stage-3 forward returns it (rows with no visible key: -inf); varlen packs
(total, H, D) with int32 cu_seqlens and lse (Hq, total_q). GQA/MQA: Hq % Hkv == 0. Supported head
dims (D, Dv): (64, 64), (96, 96), (128, 128), (192, 128), (256, 256).

``deterministic=True`` makes dq bitwise reproducible run to run (dk/dv always are): the dQ
additions of the K/V tiles are serialised per dQ tile by semaphores in a fixed order, and the
CTAs launch in sections of chains so that a chain's CTAs do not wait on each other side by side
(step 3 at 0.82-1.03x of its default speed, bwd_h100_run14.json).

Which step serves a call is measured, per configuration (bwd_h100_run3.json, H100, 8k): step 3
(register-sourced dV/dK, dQ by a writer warp with one TMA tensor reduce-add per tile) for head
dims 64, 96 and 128 in every mode -- 0.70-0.83x of the official FA4 against step 1's 0.54-0.60x,
and its deterministic mode keeps 0.95-1.04x of its default speed (step 1: 0.82-0.85x); step 1 for
(192, 128) and 256, whose register-sourced accumulators do not fit step 3. Step 3 has since gained
speed (bwd_h100_run13.json: 0.95-1.08x of the official FA4 at d = 128 with its 80 x 128 tile,
0.94-1.06x at d = 64 with its 128 x 128 tile, 4k-16k; runs before 9 timed the official kernel with
.backward(), which also accumulated .grad, and read a few to ~20% higher -- stage 4 README).
"""
from __future__ import annotations

from stage4_bwd_kernel import hopper_step1 as _step1
from stage4_bwd_kernel.hopper import backward as _step3

_best = _step1  # compile_only / run default (every head dim, deterministic mode)
BEST_STEP = _step1.STEP


def step_for(head_dim: int, causal: bool, deterministic: bool):
    """The ladder step module that serves this configuration (see the module docstring); causal and
    deterministic no longer change the answer, and stay in the signature for the callers."""
    if head_dim in (64, 96, 128):
        return _step3
    return _step1


def attention_backward(q, k, v, out, dout, lse, *, softmax_scale=None, causal=False, deterministic=False,
                       dq=None, dk=None, dv=None):
    """Gradients of attention w.r.t. q, k, v -> (dq, dk, dv), each like its input.

    dq / dk / dv: optional preallocated outputs (same shape, dtype, device as q / k / v)."""
    step = step_for(q.shape[-1], causal, deterministic) if hasattr(q, "shape") else _step1
    return step.attention_backward(q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal,
                                   deterministic=deterministic, dq=dq, dk=dk, dv=dv)


def attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              seqused_k=None, softmax_scale=None, causal=False, deterministic=False):
    """Packed variable-length backward -> (dq (Tq,Hq,D), dk (Tk,Hkv,D), dv (Tk,Hkv,Dv)).

    seqused_k: optional int32 (batch,): only the first seqused_k[b] keys of sequence b are
    attended to (causal alignment uses that length); the others get zero gradient."""
    step = step_for(q.shape[-1], causal, deterministic) if hasattr(q, "shape") else _step1
    return step.attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                          max_seqlen_k, seqused_k=seqused_k, softmax_scale=softmax_scale,
                                          causal=causal, deterministic=deterministic)


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, varlen=False):
    """Compile the current best step for sm_90a without a GPU (CI / resource reports)."""
    return _best.compile_only(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal,
                              deterministic=deterministic, varlen=varlen)


def compile_launchable(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, varlen=False,
                       has_seqused_k=False) -> list:
    """What ``attention_backward`` (varlen=True: ``attention_varlen_backward``) launches for this
    configuration -- the preprocess, the main kernel of ``step_for``, the postprocess -- compiled
    without a GPU under the GPU path's cache keys (TVM-FFI, fake tensors). Returns their Compiled
    records. With fa4's disk cache installed this fills it on a CPU machine (python -m fa4 precompile)."""
    from stage4_bwd_kernel import common, host

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    step = step_for(head_dim, causal, deterministic)
    # the kernel's constructor checks the head dims (ValueError) before anything compiles
    kernel, main = host.compile_main(step.STEP, step.make_kernel, common.cutlass_dtype(dtype), head_dim, head_dim_v,
                                     causal, deterministic, varlen=varlen, has_seqused_k=has_seqused_k)
    pre, post = host.compile_pre_post(kernel, dtype, head_dim, head_dim_v, varlen)
    return [pre, main, post]


def run(**kwargs):
    """The best step's run(): GPU check + timing (+ deterministic vs default), else compile report."""
    return _best.run(**kwargs)


__all__ = ["attention_backward", "attention_varlen_backward", "compile_launchable", "compile_only", "run", "step_for",
           "BEST_STEP"]
