"""The production Hopper (sm_90) forward: a stable name for the last rung of the ladder.

`fa4` imports only this module, so the ladder's files can be renamed or extended without
touching the package. Today every name points at step 4 (hopper_step4_fa4_softmax): step 3's
warp-specialized ping-pong kernel with FA4's softmax (conditional rescaling with a warp vote,
partial exp2 emulation) and varlen.

    from stage3_fwd_kernel.hopper import attention_forward, attention_varlen_forward
    out, lse = attention_forward(q, k, v, causal=True)                 # (B, S, H, D)
    out, lse = attention_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k)   # packed (T, H, D)
"""
from __future__ import annotations

from stage3_fwd_kernel.hopper.forward import (
    DEFAULT_POLICY,
    STEP,
    SUPPORTED_HEAD_DIMS,
    FlashAttentionForwardSm90Step4 as FlashAttentionForwardSm90,
    attention_forward,
    DEFAULT_EMULATION_FRACTION,
    attention_varlen_forward,
    compile_only,
    make_kernel,
    run,
)
from stage3_fwd_kernel.softmax_policy import (
    DEFAULT_POLY_DEGREE,
    DEFAULT_RESCALE_THRESHOLD,
    SoftmaxPolicy,
)

def compile_launchable(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, *, varlen=False,
                       seqused_k=False, scheduler=None, seqlen_k=None) -> list:
    """What attention_forward (varlen=True: attention_varlen_forward) launches with its defaults and
    `scheduler` (None: the static tile order; persistent CTAs where default_persistent says so for
    calls with `seqlen_k` keys, None = short ones, as in the launch), compiled without a GPU under the GPU path's cache key
    (TVM-FFI, fake tensors): a list of Compiled records -- the kernel, and for non-causal dense calls on
    persistent CTAs also what long ones launch, the split_tail build and its combine kernel. With
    fa4's disk cache installed this fills it on a CPU machine."""
    from stage3_fwd_kernel import split_combine
    from stage3_fwd_kernel.hopper.forward import default_persistent

    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    builds = [compile_only(dtype, head_dim, head_dim_v, causal, varlen=varlen, seqused_k=seqused_k,
                           scheduler=scheduler, launchable=True, seqlen_k=seqlen_k)]
    if not (causal or varlen or scheduler is not None) and default_persistent(head_dim, head_dim_v, False):
        builds.append(compile_only(dtype, head_dim, head_dim_v, False, persistent=True, split_tail=True,
                                   launchable=True))
        builds.append(split_combine.compile_only(dtype, head_dim_v, launchable=True))
    return builds


__all__ = [
    "compile_launchable",
    "DEFAULT_EMULATION_FRACTION",
    "DEFAULT_POLICY",
    "DEFAULT_POLY_DEGREE",
    "DEFAULT_RESCALE_THRESHOLD",
    "FlashAttentionForwardSm90",
    "STEP",
    "SUPPORTED_HEAD_DIMS",
    "SoftmaxPolicy",
    "attention_forward",
    "attention_varlen_forward",
    "compile_only",
    "make_kernel",
    "run",
]
