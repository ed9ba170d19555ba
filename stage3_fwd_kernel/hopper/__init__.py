"""The production Hopper (sm_90) forward: the kernel `fa4` runs, composed of named components.

    from stage3_fwd_kernel.hopper import attention_forward, attention_varlen_forward
    out, lse = attention_forward(q, k, v, causal=True)                       # (B, S, H, D)
    out, lse = attention_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k)   # packed (T, H, D)

Modules (the ladder, hopper_step1..4, teaches the same techniques one at a time):

  host.py ........ attention_forward, attention_varlen_forward, attention_split_forward (split-KV
                   decode; split_launch: its launch after the checks), compile_only, compile_launchable
  config.py ...... tile sizes, shared-memory plan, argument checks, the default softmax policy
  scheduling.py .. persistent CTAs or one CTA per tile (default_persistent)
  split_tail.py .. the last partial wave cut along the keys
  kernel.py ...... FlashAttentionForwardSm90: launch, shared memory, producer / consumer roles
  producer.py .... TMA loads of Q and the K/V ring (a paged cache through its page table)
  mainloop.py .... a consumer's walk over key blocks (overlapped S / P V, descriptors built once)
  softmax.py ..... online softmax with the conditional rescale (warp vote)
  epilogue.py .... O /= l, lse, O via smem / from registers / into the split workspace
  fragments.py ... accumulator views, P packed between the exponentials, the lean mask's check
  barriers.py .... named barrier ids of the tensor-core turn
  cli.py ......... run() and ``python -m stage3_fwd_kernel.hopper``
and, shared with other kernels, `stage3_fwd_kernel.components` (work tile, sequence info,
key-block range, mask, tile walk) and `stage3_fwd_kernel.softmax_policy`.
"""
from __future__ import annotations

from stage3_fwd_kernel.softmax_policy import DEFAULT_POLY_DEGREE, DEFAULT_RESCALE_THRESHOLD, SoftmaxPolicy

from .cli import run
from .host import (
    attention_forward, attention_split_forward, attention_varlen_forward, compile_launchable, compile_only, make_kernel,
    split_launch)
from .kernel import FlashAttentionForwardSm90
from .config import DEFAULT_EMULATION_FRACTION, DEFAULT_POLICY, STEP, SUPPORTED_HEAD_DIMS

# Beyond __all__: the tuning defaults, checks and cache plumbing that tests, tutorials, benchmarks
# and stage 5 read, one import path for all of them.
from .config import (  # noqa: F401
    MIN_SOFTMAX_SCALE, TILE_MS, _check_head_dims, _check_scale, _check_tile_m, default_num_stages,
    default_tile_m, default_tile_n, grid_order_causal, make_policy, o_fits_beside_q, p_through_smem)
from .fragments import mask_shift_holds  # noqa: F401
from .host import _call_args, _compile, _fake_args, _key  # noqa: F401
from .scheduling import _launch_ctas, _resolve_scheduler, default_persistent  # noqa: F401
from .split_tail import (  # noqa: F401
    SPLIT_TAIL_MIN_KEY_BLOCKS, split_tail_combine, split_tail_plan, split_tail_supported)

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
    "attention_split_forward",
    "attention_varlen_forward",
    "compile_only",
    "make_kernel",
    "split_launch",
    "run",
]
