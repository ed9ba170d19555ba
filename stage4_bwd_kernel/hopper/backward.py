"""Host entry points of the production Hopper backward, every (D, Dv) pair it has: build, compile, launch.

``make_kernel`` builds the composed kernel (``kernel.FlashAttentionBackwardSm90``) for one
configuration; ``host.py`` runs it between the preprocess (lse2, D) and the postprocess (dq from the
fp32 dQaccum; ``postprocess_frag`` for the fragment-order accumulator).
"""
from __future__ import annotations

import dataclasses
import functools
import numbers

from stage3_fwd_kernel.components.window import NO_WINDOW
from stage4_bwd_kernel import common, host
from stage4_bwd_kernel.hopper.kernel import FlashAttentionBackwardSm90
from stage4_bwd_kernel.hopper.options import (RS_HEAD_DIMS, WIDE_HEAD_DIMS, BackwardOptions, check_product_head_dims,
                                              default_tiles, is_banded)

STEP = "hopper_bwd"


def _check_dims_of(q, v):
    """Refuse unsupported head dims before host.backward launches the preprocess."""
    if hasattr(q, "shape") and hasattr(v, "shape") and len(q.shape) >= 3 and len(v.shape) >= 3:
        common.check_head_dims(q.shape[-1], v.shape[-1])
        check_product_head_dims(q.shape[-1], v.shape[-1])


def make_kernel(dtype, head_dim, head_dim_v, causal, deterministic, *, varlen=False, has_seqused_k=False,
                dq_order=None, tiles=None, window=NO_WINDOW, softcap=0.0, **overrides):
    """The kernel object of one configuration. overrides: BackwardOptions fields that replace the
    configuration's defaults (to compare a build with the default one; production passes none).
    tiles: None or the default tiles (the tile follows from the head dims)."""
    options = None
    if overrides:
        names = {f.name for f in dataclasses.fields(BackwardOptions)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"{unknown[0]}: not an option of the Hopper backward (options: {sorted(names)})")
        defaults = BackwardOptions.for_config(head_dim, head_dim_v, causal, deterministic, varlen,
                                              is_banded(window, causal), softcap=softcap > 0)
        if "dq_first_store" not in overrides:  # it follows the dQ path an override picks (dq_writer.py)
            frag, atomic = overrides.get("dq_frag", defaults.dq_frag), overrides.get("dq_atomic", defaults.dq_atomic)
            overrides = dict(overrides, dq_first_store=defaults.dq_first_store and frag and not atomic)
        options = dataclasses.replace(defaults, **overrides)
    kernel = FlashAttentionBackwardSm90(dtype, head_dim, head_dim_v, causal, deterministic, varlen=varlen,
                                        has_seqused_k=has_seqused_k, dq_order=dq_order, options=options,
                                        window=window, softcap=softcap)
    if tiles is not None and tuple(tiles) != (kernel.tile_m, kernel.tile_n):  # the design's tile (kv_swap: 64 x 96)
        raise ValueError(f"tiles: the Hopper backward runs {(kernel.tile_m, kernel.tile_n)} at head dims "
                         f"{(head_dim, head_dim_v)} with these options, got {tuple(tiles)}")
    return kernel


def with_options(**overrides):
    """(compile-cache step name, make_kernel) of the kernel with BackwardOptions fields (or window /
    softcap) overridden, e.g. ``host.backward(*with_options(persistent=True), q, k, ...)``: each override
    set builds under its own name (``hopper_bwd~persistent=1``), never sharing a cache entry with the
    defaults."""
    name = STEP + "".join(f"~{k}={v if k in ('window', 'softcap') else int(v)}" for k, v in sorted(overrides.items()))
    return name, functools.partial(make_kernel, **overrides)


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, deterministic=False, varlen=False,
                 has_seqused_k=False, dq_order=None, tiles=None, window_size=(None, None), softcap=0.0,
                 **overrides) -> common.Compiled:
    """Compile for sm_90a with fake tensors (no GPU needed); returns the compiled kernel + report.
    overrides (e.g. key_select=False) build under the name ``STEP~key_select=0``, so they never share a
    cache entry with the defaults; window_size / softcap as in attention_backward."""
    variant = host.variant_of(causal, window_size, softcap)
    if variant is not None:
        overrides = dict(overrides, window=variant[0], softcap=variant[1])
    name, make = with_options(**overrides)
    return host.compile_fake(name, make, dtype=dtype, head_dim=head_dim,
                             head_dim_v=head_dim if head_dim_v is None else head_dim_v, causal=causal,
                             deterministic=deterministic, varlen=varlen, has_seqused_k=has_seqused_k,
                             dq_order=dq_order, tiles=tiles)


# Where the persistent build (persistent.py) measured faster than one CTA per K/V tile on an H200
# (docs/measurements.md, "the persistent backward by default on short walks"; Sq = Sk, no GQA, 32k
# tokens a batch): d = 128 walks of at most 2k keys (+2.8..3.5% at 1k, +0.6..1.2% at 2k) and (128, 64)
# ones of at most 1k (+1.0..2.3%; at 2k non-causal lost 1.3%). From 3k keys on, and under a 1024-key
# window at 8k / 16k, it tied or lost up to 1.3%; d = 96 gained only at 1k, and d = 64's build spills.
# Unmeasured shapes are held to the measured walk: queries x GQA group and keys both within the limit.
PERSISTENT_MAX_SEQLEN = {(128, 128): 2048, (128, 64): 1024}
PERSISTENT = with_options(persistent=True)  # (step, make_kernel) of the persistent build


def persistent_pays(head_dim, head_dim_v, deterministic, seqlen_q, seqlen_k, group=1, dq_order=None) -> bool:
    """Whether a call runs the persistent build: d = 128 / (128, 64) outside deterministic mode, with
    seqlen_k keys and seqlen_q x group (a K/V tile's walk: its query rows, every head of the GQA group)
    within PERSISTENT_MAX_SEQLEN (varlen: the max_seqlen_* bounds). Explicit dQ orders keep the
    one-per-tile kernel they were measured on."""
    limit = PERSISTENT_MAX_SEQLEN.get((head_dim, head_dim_v))
    if deterministic or dq_order is not None or limit is None:
        return False
    return seqlen_k <= limit and seqlen_q * group <= limit


def _build_for(q, k, v, deterministic, dq_order, max_seqlen_q=None, max_seqlen_k=None):
    """(step, make_kernel) of a call: the persistent build where ``persistent_pays``, else the default
    (also for malformed arguments, which host.backward then refuses by name). max_seqlen_q / _k:
    varlen's (packed (T, H, D) tensors); None: dense (B, S, H, D) ones."""
    varlen = max_seqlen_k is not None
    if not all(hasattr(t, "shape") and len(t.shape) == (3 if varlen else 4) for t in (q, k, v)):
        return STEP, make_kernel
    seqlens = (max_seqlen_q, max_seqlen_k) if varlen else (q.shape[1], k.shape[1])
    heads_q, heads_kv = q.shape[-2], k.shape[-2]
    if not (all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in seqlens)
            and isinstance(deterministic, bool) and heads_kv > 0 and heads_q % heads_kv == 0):
        return STEP, make_kernel
    if persistent_pays(q.shape[-1], v.shape[-1], deterministic, int(seqlens[0]), int(seqlens[1]),
                       heads_q // heads_kv, dq_order):
        return PERSISTENT
    return STEP, make_kernel


def attention_backward(q, k, v, out, dout, lse, *, softmax_scale=None, causal=False, deterministic=False,
                       window_size=(None, None), softcap=0.0, dq=None, dk=None, dv=None, dq_order=None, tiles=None,
                       return_d=False, dlse=None):
    """(B,S,H,D) CUDA fp16/bf16 q, k, v, out, dout and lse (B,Hq,Sq) fp32 -> (dq, dk, dv).
    window_size / softcap: as the forward's (stage3_fwd_kernel.components); a learnable sink needs
    nothing here beyond the forward's lse, which includes it. return_d=True also returns D =
    rowsum(dO * O) in lse's layout, minus dlse when given (the sink's gradient needs it). dlse: the gradient flowing in
    through lse, (B,Hq,Sq), or None (host.backward: the preprocess shifts D to D - dlse)."""
    _check_dims_of(q, v)
    step, make = _build_for(q, k, v, deterministic, dq_order)
    return host.backward(step, make, q, k, v, out, dout, lse, softmax_scale=softmax_scale, causal=causal,
                         deterministic=deterministic, dq=dq, dk=dk, dv=dv, dq_order=dq_order, tiles=tiles,
                         variant=host.variant_of(causal, window_size, softcap), return_d=return_d, dlse=dlse)


def attention_varlen_backward(q, k, v, out, dout, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              seqused_k=None, softmax_scale=None, causal=False, deterministic=False,
                              window_size=(None, None), softcap=0.0, dq_order=None, tiles=None, return_d=False,
                              check_values=False, dlse=None):
    """Packed (T,H,D) q, k, v, out, dout, lse (Hq, Tq) fp32, int32 cu_seqlens -> (dq, dk, dv).
    check_values=True also checks the index tensors' values on the host (a device sync; host.backward);
    dlse (Hq, Tq) as attention_backward's."""
    _check_dims_of(q, v)
    step, make = _build_for(q, k, v, deterministic, dq_order, max_seqlen_q, max_seqlen_k)
    return host.backward(step, make, q, k, v, out, dout, lse, cu_seqlens_q=cu_seqlens_q,
                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                         seqused_k=seqused_k, softmax_scale=softmax_scale, causal=causal,
                         deterministic=deterministic, dq_order=dq_order, tiles=tiles,
                         variant=host.variant_of(causal, window_size, softcap), return_d=return_d,
                         check_values=check_values, dlse=dlse)


def run(batch=2, seqlen_q=1024, seqlen_k=None, heads=8, heads_kv=None, head_dim=128, head_dim_v=None,
        causal=False, deterministic=False, dtype="bf16", check=True, compare_deterministic=True, verbose=True):
    """On a Hopper GPU: check against autograd (FA4 rule), time, and time deterministic vs default.
    Otherwise: compile for sm_90a and print the resource report."""
    return host.run_step(STEP, compile_only, attention_backward, batch=batch, seqlen_q=seqlen_q,
                         seqlen_k=seqlen_q if seqlen_k is None else seqlen_k, heads=heads,
                         heads_kv=heads if heads_kv is None else heads_kv, head_dim=head_dim,
                         head_dim_v=head_dim if head_dim_v is None else head_dim_v, causal=causal,
                         deterministic=deterministic, dtype=dtype, check=check,
                         compare_deterministic=compare_deterministic, verbose=verbose)


__all__ = ["STEP", "RS_HEAD_DIMS", "WIDE_HEAD_DIMS", "FlashAttentionBackwardSm90", "BackwardOptions", "default_tiles",
           "check_product_head_dims", "make_kernel", "with_options", "compile_only", "attention_backward", "attention_varlen_backward", "run"]


if __name__ == "__main__":
    host.cli(run, __doc__)
