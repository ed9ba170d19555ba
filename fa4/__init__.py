"""fa4: the production attention package of this project.

    import fa4
    out = fa4.flash_attn_func(q, k, v, causal=True)                      # (B, S, H, D)
    out = fa4.flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                                     max_seqlen_q=max_q, max_seqlen_k=max_k)  # packed
    out = fa4.scaled_dot_product_attention(query, key, value, is_causal=True)  # (B, H, S, D)
    fa4.supported()                                                      # what runs where

    from fa4.compat import flash_attn_func   # the official flash_attn.cute return: (out, lse)

The attention functions take the official FlashAttention-4 interface's keyword names
(flash_attn.cute.interface); everything after q, k, v is keyword-only. fa4's own functions return
out, or (out, lse) with return_lse=True; fa4.compat's return the official's (out, lse) tuple.

Kernels come from the stage packages (stage3_fwd_kernel, stage4_bwd_kernel), chosen by the
device's compute capability (fa4/_dispatch.py). The attention functions are torch.library
custom ops (fa4::fwd, fa4::bwd, fa4::varlen_fwd, fa4::varlen_bwd), so autograd, torch.compile
(fullgraph) and CUDA graphs work.

Importing fa4 is cheap: torch and the kernels load on first use of an attention function, so
`python -m fa4 info` and `fa4.supported()` work anywhere, without a GPU. It also chooses no CuTe
architecture: the first call picks it from the device (fa4/_dispatch.py, through
`stage2_emulated_exp.cute_arch.retarget`) before any kernel module imports cutlass, so a Blackwell
machine is not held to the stage packages' sm_90a default.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "flash_attn_func": "fa4._api",
    "flash_attn_varlen_func": "fa4._api",
    "scaled_dot_product_attention": "fa4._api",
    "flash_attn_with_kvcache": "fa4._api",
    "supported": "fa4._dispatch",
    "support_markdown": "fa4._dispatch",
}
_SUBMODULES = {"cache": "fa4._cache", "compat": "fa4.compat", "precompile": "fa4.precompile",
               "integrations": "fa4.integrations", "distributed": "fa4.distributed"}

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache", "scaled_dot_product_attention",
           "supported", "cache",
           "compat", "__version__"]


def __getattr__(name):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(_SUBMODULES[name])
    else:
        raise AttributeError(f"module 'fa4' has no attribute {name!r}")
    globals()[name] = value  # resolve once
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))
