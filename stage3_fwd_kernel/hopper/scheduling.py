"""Which tile order and which kind of grid a call gets (host side).

Persistent CTAs by default for dense calls wherever Q, O and two K/V stages fit in shared memory
(head dims <= 128): every CTA pays its launch, barrier set-up, first loads and last store once
per SM instead of once per tile. Causal and windowed calls need the dynamic hand-out (an atomic tile
counter): their tiles differ in length (a window's are short near the sequence's ends), and with fixed
striding the CTAs that drew long ones finish late -- worst when the SM count is a multiple of the
tiles per head, so that every CTA keeps drawing the same query tile of each head.
Three exceptions, where persistent CTAs tied or lost: long causal calls at d = 64 (three consumer
warpgroups, from PERSISTENT_CAUSAL_TILE_M192_MAX_SEQLEN_K keys on, unless a left window keeps every
tile short), head dims above 128, where O would go from registers (`o_direct`; available with
persistent=True), and 192-row tiles above d = 64 (P through shared memory): one CTA per tile reuses Q's
buffer for O and takes 144 keys where the scores are plain, a persistent CTA keeps O apart and so walks
128-key tiles, and on an H200 that ran slower (non-causal, 8k / 16k: 192 x 128 persistent 0.96-0.97x of
the official kernel, 192 x 144 one CTA per tile 1.03-1.05x). Varlen batches stay one CTA per tile
unless asked.
measured: docs/measurements.md
"""
from __future__ import annotations

import functools

from stage3_fwd_kernel.hopper.config import default_tile_m, p_through_smem
from stage3_fwd_kernel.tile_scheduler import PersistentScheduler, StaticTileScheduler

PERSISTENT_MAX_HEAD_DIM = 128
PERSISTENT_CAUSAL_TILE_M192_MAX_SEQLEN_K = 4096


def default_persistent(head_dim: int, head_dim_v: int, causal: bool, varlen: bool = False,
                       seqlen_k: int | None = None, tile_m: int | None = None, left_window: bool = False) -> bool:
    """Whether a call walks its tiles with persistent CTAs by default. seqlen_k None: the
    short-call choice (what a build without a length compiles). left_window: the tiles walk only
    the window's ~10 key blocks, so a CTA that stays resident hides each tile's start and epilogue
    behind the next tile's loads, whatever the sequence length (d = 64, window 1024 at 8k / 16k on
    an H200: 0.91 / 0.92x of the official kernel on one CTA per tile, 0.97 / 0.99x persistent).
    tile_m: the call's resolved tile (the host's entry points pass it); None takes default_tile_m's
    choice for a call without a window, softcap or cache."""
    tile_m = tile_m or default_tile_m(head_dim, head_dim_v, causal)
    if varlen or max(head_dim, head_dim_v) > PERSISTENT_MAX_HEAD_DIM or p_through_smem(tile_m, head_dim, head_dim_v):
        return False
    if causal and not left_window and tile_m == 192:
        return seqlen_k is None or seqlen_k < PERSISTENT_CAUSAL_TILE_M192_MAX_SEQLEN_K
    return True


def _resolve_scheduler(scheduler, persistent, head_dim, head_dim_v, causal, varlen=False, seqlen_k=None,
                       tile_m=None, left_window=False, gathered_pages=False, windowed=False):
    """The call's scheduler: `scheduler` (default StaticTileScheduler), walked by one CTA per SM when
    persistent (None: default_persistent(...)). A scheduler that is persistent itself
    (PersistentScheduler) is used as it is. windowed: a window limits a side (tiles of different
    lengths, like causal ones). gathered_pages: a paged build whose producer warps gather K / V in
    step (hopper/gather.py) walks its tiles in a static order, never from the atomic counter."""
    if persistent is not None and not isinstance(persistent, bool):
        raise TypeError(f"persistent: expected None or a bool, got {type(persistent).__name__}")
    scheduler = scheduler or StaticTileScheduler
    if getattr(scheduler, "persistent", False):
        if persistent is False:
            raise ValueError("persistent: False contradicts the persistent scheduler passed; pass its order "
                             "(scheduler.order) for one CTA per tile")
        return scheduler
    if persistent is None:
        persistent = default_persistent(head_dim, head_dim_v, causal, varlen, seqlen_k, tile_m, left_window)
    if persistent:
        # tiles of different lengths need the dynamic hand-out
        scheduler = _persistent_over(scheduler, (causal or varlen or windowed) and not gathered_pages)
    return scheduler


@functools.lru_cache(maxsize=64)
def _persistent_over(order, dynamic: bool) -> PersistentScheduler:
    """The per-call wrapper, built (and validated) once per order: the launch path is host-bound."""
    return PersistentScheduler(order, dynamic=dynamic)


def _launch_ctas(scheduler, device) -> int:
    return scheduler.launch_ctas(device) if getattr(scheduler, "persistent", False) else 1


def _tile_counter(scheduler, device):
    """A dynamic persistent scheduler's tile counter: one zeroed int32 per launch."""
    import torch

    return torch.zeros(1, dtype=torch.int32, device=device) if getattr(scheduler, "dynamic", False) else None
