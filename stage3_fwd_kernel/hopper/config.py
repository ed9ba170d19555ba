"""Tile sizes, shared-memory plan and argument checks of the Hopper forward (host side only)."""
from __future__ import annotations

from stage3_fwd_kernel import host_io
from stage3_fwd_kernel.host_io import SMEM_BUDGET
from stage3_fwd_kernel.softmax_policy import DEFAULT_RESCALE_THRESHOLD, HOPPER_EMULATION_FRACTION, SoftmaxPolicy

# softmax_scale's check and bound, shared with the lessons' entry points (host_io)
MIN_SOFTMAX_SCALE = host_io.MIN_SOFTMAX_SCALE
_check_scale = host_io.check_scale

# The cache-key tag of this kernel (the ladder's lessons use their own file names)
STEP = "hopper_forward"
# On Hopper no share of the exponentials is emulated by default (softmax_policy.HOPPER_EMULATION_FRACTION
# says why); emulation_fraction=0.25 etc. stay available and tested.
DEFAULT_EMULATION_FRACTION = HOPPER_EMULATION_FRACTION
DEFAULT_POLICY = SoftmaxPolicy(DEFAULT_RESCALE_THRESHOLD, DEFAULT_EMULATION_FRACTION)

SUPPORTED_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (128, 64), (192, 128), (256, 256))
TILE_MS = (64, 128, 192)  # one, two or three consumer warpgroups of 64 query rows (64: short queries)
# Causal dense calls on these tiles count their Q tiles from the sequence's end (q_shift, see
# components.work_tile.locate_tile)
Q_SHIFT_TILE_MS = (192,)

# The rescale vote's limit m + tau / (scale * log2 e) must be finite in fp32 for tau <= 64: true from
# this scale up (fa4's validation uses the same bound). Real scales are ~1/sqrt(d).


def p_through_smem(tile_m: int, head_dim: int, head_dim_v: int) -> bool:
    """Whether O += P V reads P from shared memory instead of registers: a 192-row tile above head dim 64.
    Three consumers get 160 registers a thread; S (64) + P (32) + O (dv / 2) fit that only up to d = 64,
    while P stored to shared memory frees its registers right after, so S + O fit up to d = 96 (the
    official kernel's d = 96 tile is 192 rows with P in shared memory)."""
    return tile_m == 192 and max(head_dim, head_dim_v) > 64


MAX_HEAD_DIM_192 = 96  # the widest head dims a 192-row tile holds (P through shared memory above 64)


def plain_scores(causal: bool, window, softcap) -> bool:
    """No causal mask, window (a components.window.Window, None: none) or softcap: the scores the
    192 x 144 d = 96 tile is the default for at every length (default_tile_m; default_tile_n takes
    causal ones too)."""
    return not (causal or (window is not None and window.limited) or softcap)


def half_blocks(tile_m: int, tile_n: int, window) -> bool:
    """Whether a consumer warpgroup computes only the half of a masked key block its 64 rows see
    (hopper/mainloop.py, "Half blocks"; 16-key k-steps on both sides of the middle: tile_n % 32 == 0).
    With a left window, and causal on tiles of more than 128 rows. On an H200 (docs/measurements.md,
    2026-12-04 "masked-block halves"): window (1024, 0) at 16k 1.06x faster at d = 128 and 1.19x at d =
    64, causal on 192 x 128 tiles (d = 64) 1.03-1.05x, but causal 128 x 128 (d = 128), where only the
    diagonal block can skip, 0.985-1.0x: not there. window: the kernel's (causal is right = 0)."""
    if tile_n % 32:
        return False
    return window.left is not None or (window.right is not None and tile_m > 128)


def default_tile_n(head_dim: int, head_dim_v: int, tile_m: int = 128, *, plain: bool = False,
                   persistent: bool = False, cache: bool = False) -> int:
    """Key-tile rows: 128, or 64 when O (dv/2 registers) would leave a consumer too few for S; 144 for
    the 192-row tile at d = 96 (P through shared memory; S's 72 registers a thread still fit beside O's
    48) with plain scores (no window or softcap; `plain`: the kernel allows a causal mask where it
    walks the grid's order), one CTA per tile, outside a cache. The causal build spills 8 bytes (12
    varlen: values of the kernel's entry, reloaded outside the key-block loop, never in it; in an LPT
    order 48, some in the loop), the softcap's 4 (varlen 64);
    a persistent CTA keeps O apart from Q, and 144-key stages beside it leave O to registers (o_direct:
    8 spilled bytes, 28 with the split tail); paged and key-split builds count pages and chunks in
    128-key blocks. On an H200 (d = 96, 1k-16k, one CTA per tile) 192 x 144 ran 1.03-1.05x of the
    official kernel non-causal and 1.03-1.06x causal, against 192 x 128's 0.95-1.09x and 0.97-1.09x
    (docs/measurements.md, 2026-12-01 "the d = 96 forward's 192 x 144 tile")."""
    if p_through_smem(tile_m, head_dim, head_dim_v) and plain and not (persistent or cache):
        return 144
    return 64 if max(head_dim, head_dim_v) > 192 else 128


# The widest window (keys a row sees, both sides) that takes 128-row tiles at d <= 64. A tile walks about
# (window + tile_m) / tile_n key blocks, so 192 rows compute (window + 192) / (window + 128) times the
# blocks of two 128-row tiles' rows: 1.17x at 256, 1.06x at 1024. On an H200 (d = 64, 32k tokens,
# persistent CTAs) 128-row tiles ran windows (256, 256) and causal (256, 0) 1.09-1.21x faster than
# 192-row ones at 4k-16k, causal (1024, 0) the same, and (1024, 1024) 0.90x at 8k / 16k (1.07x at 4k):
# docs/measurements.md, 2026-11-29 "windowed forwards at d = 64". 512 sits between the measured points.
NARROW_WINDOW_KEYS = 512


def window_keys(causal: bool, window) -> int | None:
    """The most keys a row sees under `window` (components.window.beyond_causal's: a causal call keeps
    its own right edge, 0): left + right, None when a side is unlimited."""
    if window is None or window.left is None or (window.right is None and not causal):
        return None
    return window.left + (0 if causal else window.right)


# Causal d = 96 calls take the 192 x 144 tile from this many keys on. On an H200 (one CTA per tile,
# docs/measurements.md 2026-12-01 "the d = 96 forward's 192 x 144 tile"), official time / ours: 128 x 128
# 1.34 / 1.09 / 1.08 / 0.99 / 0.96x at 1k / 2k / 4k / 8k / 16k, 192 x 144 1.06 / 1.03 / 1.05 / 1.04 / 1.03x.
D96_CAUSAL_TILE192_MIN_KEYS = 8192


def default_tile_m(head_dim: int, head_dim_v: int, causal: bool = False, window=None, *,
                   softcap: bool = False, cache: bool = False, seqlen_k: int | None = None, sink: bool = False) -> int:
    """Query rows per CTA: 192 (three consumer warpgroups) when both head dims are <= 64, else 128;
    128 at d <= 64 too under a window of at most NARROW_WINDOW_KEYS keys (above). At d = 96, 192 where
    the tile is 192 x 144 (P through shared memory, p_through_smem; default_tile_n): no window or
    softcap, keys not from a cache (paged or key-split: `cache`; a page-gathering build spilled 28
    bytes at 192 rows), and either not causal or causal with at least D96_CAUSAL_TILE192_MIN_KEYS keys
    (`seqlen_k`; None: a short call) and no learnable sink (`sink`: that causal build spills in its
    key-block loop). Shorter causal calls keep 128 x 128 (below).

    At d = 64 a tile's MMAs are half of d = 128's, so the per-tile softmax and issue overheads
    weigh twice as much; 192 rows amortize every K/V load over 1.5x the rows and give the tensor
    cores three warpgroups to rotate. It costs registers: 160 per consumer thread instead of 240
    (128 x (32 + 3 x 160) = 65536, the whole register file), which fits d = 64 without spills
    (S 64 + P 32 + O 32 + softmax state) with P in registers, and d = 96 with P through shared memory.
    measured: docs/measurements.md"""
    if max(head_dim, head_dim_v) > 64:
        long_causal = causal and not sink and seqlen_k is not None and seqlen_k >= D96_CAUSAL_TILE192_MIN_KEYS
        plain = plain_scores(causal and not long_causal, window, softcap) and not cache
        return 192 if max(head_dim, head_dim_v) <= MAX_HEAD_DIM_192 and plain else 128
    keys = window_keys(causal, window)
    return 128 if keys is not None and keys <= NARROW_WINDOW_KEYS else 192


def grid_order_causal(head_dim: int, head_dim_v: int, seqlen_k: int, softcap: bool = False,
                      sink: bool = False) -> bool:
    """Whether a dense causal call of seqlen_k keys should walk its tiles in the grid's order rather than
    stage 5's LPT order (the caller has ruled out windows and caches, which take no LPT order): on the
    192 x 144 d = 96 tile (default_tile_m), whose LPT build spills 48 bytes, with loads and stores in
    the key-block loop; its grid-order build spills 8, none in the loop (`compile_only(...,
    causal=True, seqlen_k=8192)`)."""
    tile_m = default_tile_m(head_dim, head_dim_v, True, softcap=softcap, seqlen_k=seqlen_k, sink=sink)
    return p_through_smem(tile_m, head_dim, head_dim_v)


def _smem_plan(head_dim: int, head_dim_v: int, tile_n: int, tile_m: int, separate_o: bool,
               p_smem: bool = False) -> tuple[int, int]:
    """(bytes outside the K/V ring: Q, O when it has its own buffer, P when it goes through shared
    memory (p_smem), 2 KB for barriers and alignment; bytes per K/V stage), 2 bytes/element."""
    fixed = tile_m * head_dim * 2 + (tile_m * head_dim_v * 2 if separate_o else 0) + 2048
    fixed += tile_m * tile_n * 2 if p_smem else 0
    return fixed, tile_n * (head_dim + head_dim_v) * 2


def o_fits_beside_q(head_dim: int, head_dim_v: int, tile_n: int, tile_m: int, p_smem: bool = False) -> bool:
    """Whether Q, an O buffer of its own and two K/V stages fit in shared memory: true up to head dim
    128; at (192, 128) and 256 a persistent CTA stores O from registers instead (`o_direct`)."""
    fixed, stage_bytes = _smem_plan(head_dim, head_dim_v, tile_n, tile_m, separate_o=True, p_smem=p_smem)
    return fixed + 2 * stage_bytes <= SMEM_BUDGET


def default_num_stages(head_dim: int, head_dim_v: int, tile_n: int, tile_m: int = 128,
                       separate_o: bool = False, p_smem: bool = False) -> int:
    """As many K/V stages as fit next to Q (and O when it has its own buffer, P with p_smem), between 2
    and 4."""
    fixed, stage_bytes = _smem_plan(head_dim, head_dim_v, tile_n, tile_m, separate_o, p_smem)
    return max(2, min(4, (SMEM_BUDGET - fixed) // stage_bytes))


def check_persistent_smem(head_dim, head_dim_v, tile_n, tile_m, num_stages, o_direct, p_smem=False):
    """ValueError when a persistent CTA's buffers (Q, O unless o_direct, P with p_smem, the K/V ring) do
    not fit."""
    fixed, stage_bytes = _smem_plan(head_dim, head_dim_v, tile_n, tile_m, separate_o=not o_direct, p_smem=p_smem)
    need = fixed - 2048 + num_stages * stage_bytes
    if need + 2048 > SMEM_BUDGET:
        raise ValueError(f"num_stages: a persistent CTA at head dims ({head_dim}, {head_dim_v}) with "
                         f"{num_stages} K/V stages needs {need} bytes of shared memory "
                         f"(> {SMEM_BUDGET - 2048}); use fewer stages or a one-tile-per-CTA scheduler")


def make_policy(rescale_threshold=DEFAULT_RESCALE_THRESHOLD, emulation_fraction=DEFAULT_EMULATION_FRACTION,
                policy: SoftmaxPolicy | None = None) -> SoftmaxPolicy:
    """The SoftmaxPolicy of a call: `policy` when given, else built (and validated) from the two knobs."""
    if policy is not None:
        if not isinstance(policy, SoftmaxPolicy):
            raise TypeError(f"policy: expected a SoftmaxPolicy, got {type(policy).__name__}")
        return policy
    if (rescale_threshold, emulation_fraction) == (DEFAULT_RESCALE_THRESHOLD, DEFAULT_EMULATION_FRACTION) and \
            type(rescale_threshold) is type(emulation_fraction) is float:
        return DEFAULT_POLICY  # the common call: skip re-validating the defaults (host time per call)
    return SoftmaxPolicy(rescale_threshold=rescale_threshold, emulation_fraction=emulation_fraction)


def _check_tile_m(tile_m, d, dv, causal: bool = False, window=None, *, softcap: bool = False,
                  cache: bool = False, seqlen_k: int | None = None, sink: bool = False) -> int:
    """tile_m of a call: the default of its head dims and variant (default_tile_m) when None, else one
    of TILE_MS (192: d, dv <= 96)."""
    if tile_m is None:
        return default_tile_m(d, dv, causal, window, softcap=softcap, cache=cache, seqlen_k=seqlen_k, sink=sink)
    if isinstance(tile_m, bool) or not isinstance(tile_m, int) or tile_m not in TILE_MS:
        raise ValueError(f"tile_m: expected None or one of {TILE_MS}, got {tile_m!r}")
    if tile_m == 192 and max(d, dv) > MAX_HEAD_DIM_192:
        raise ValueError(f"tile_m: 192 needs head dims <= {MAX_HEAD_DIM_192}, got ({d}, {dv})")
    return tile_m


def _check_head_dims(d, dv):
    if (d, dv) not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim: expected (qk, v) head dims in {SUPPORTED_HEAD_DIMS}, got ({d}, {dv})")
