"""The index arithmetic of the backward kernels, written once for two callers.

The CuTe kernels call these functions while tracing (arguments are DSL ``Int32`` values and
``imin``/``imax`` are ``cutlass.min``/``cutlass.max``); ``model.py`` calls the very same functions
with Python ints to replay a kernel's tile walk in NumPy and to simulate its semaphores on the CPU.
So the CPU tests check the bounds, masks and reduction orders that the GPU code actually uses.
Pure Python: nothing here imports cutlass.

Coordinates: a CTA owns K/V tile ``n_block`` (keys [n_block*tile_n, (n_block+1)*tile_n)) and
visits Q tiles ``m_block`` (queries [m_block*tile_m, ...)). Causal is bottom-right aligned: query i
sees key j iff j <= i + seqlen_k - seqlen_q. A Q tile counts as visible when any of its tile_m rows
(padding rows included) sees a key of the tile, which is what both the walk bounds and the
deterministic ranks use -- the two must agree exactly, or a semaphore waits forever.
"""
from __future__ import annotations

import operator

from stage3_fwd_kernel.intdiv import check_fast_div_grid, fast_div


def band_edges(causal: bool, window):
    """(left, right) of the visible band (stage3_fwd_kernel.components.window): window when given
    (its right already 0 for causal), else causal's (None, 0) or no edge at all."""
    if window is not None:
        return window.left, window.right
    return None, (0 if causal else None)


def _plus(x, c):
    return x + c if c else x


def m_block_range(n_block, tile_m, tile_n, seqlen_q, seqlen_k, causal: bool, imax=max, window=None, imin=min):
    """[m_block_min, m_block_max): the Q tiles K/V tile n_block adds into.

    A right edge (causal: 0): key n*tn is first visible from query n*tn + Sq - Sk - right, so the walk
    starts at that row's tile; max(., 0) // tile_m is a floor division for every sign of the
    difference. A left edge: the tile's last key (n+1)*tn - 1 is last visible from query
    (n+1)*tn - 1 + Sq - Sk + left, so the walk ends at that row's tile. A K/V tile past the keys in use
    (n*tn >= seqlen_k, possible with seqused_k) adds into nothing (the caller checks)."""
    left, right = band_edges(causal, window)
    m_block_max = (seqlen_q + tile_m - 1) // tile_m
    m_block_min = 0
    if right is not None:
        m_block_min = imax(_plus(n_block * tile_n + seqlen_q - seqlen_k, -right), 0) // tile_m
    if left is not None:
        last_row = (n_block + 1) * tile_n - 1 + seqlen_q - seqlen_k + left  # rows <= last_row see the tile
        m_block_max = imin(m_block_max, (imax(last_row + 1, 0) + tile_m - 1) // tile_m)
        m_block_max = imax(m_block_max, m_block_min)
    return m_block_min, m_block_max


def n_block_first(m_block, tile_m, tile_n, seqlen_q, seqlen_k, causal: bool, imax=max, window=None):
    """The first K/V tile that adds into Q tile m_block: 0, or (a left edge) the tile of its first
    row's left edge."""
    left, _ = band_edges(causal, window)
    if left is None:
        return 0
    return imax(m_block * tile_m + seqlen_k - seqlen_q - left, 0) // tile_n


def n_block_last(m_block, tile_m, tile_n, seqlen_q, seqlen_k, causal: bool, imin=min, window=None):
    """The last K/V tile that adds into Q tile m_block. Only meaningful for a Q tile that some K/V
    tile visits (then the right-edge numerator is >= 0)."""
    _, right = band_edges(causal, window)
    last = (seqlen_k + tile_n - 1) // tile_n - 1
    if right is not None:
        last = imin(last, _plus((m_block + 1) * tile_m - 1 + seqlen_k - seqlen_q, right) // tile_n)
    return last


def mask_bounds(m_block, n_block, tile_m, tile_n, seqlen_q, seqlen_k):
    """(key_limit, diag) in the local coordinates of the (tile_n x tile_m) S^T tile: local key row
    r is masked iff r >= key_limit (past the keys) or, causal, r > c + diag (c: local query col);
    a window masks r > c + diag + right and r < c + diag - left (``is_masked``)."""
    key_limit = seqlen_k - n_block * tile_n
    diag = m_block * tile_m + seqlen_k - seqlen_q - n_block * tile_n
    return key_limit, diag


def tile_needs_mask(key_limit, diag, tile_n, causal: bool, window=None, tile_m=None):
    """Whether any element of the tile is masked (so unmasked tiles skip the per-element test)."""
    left, right = band_edges(causal, window)
    needs = key_limit < tile_n
    if right is not None:
        needs = needs | (tile_n - 1 > _plus(diag, right))  # `|`, not `or`: works on DSL booleans too
    if left is not None:
        needs = needs | (0 < tile_m - 1 + diag - left)
    return needs


def unmasked_m_range(n_block, tile_m, tile_n, seqlen_q, seqlen_k, causal: bool, m_block_min, m_block_max,
                     imin=min, imax=max, window=None):
    """[lo, hi), inside [m_block_min, m_block_max): the Q tiles of K/V tile n_block with nothing to
    mask -- full keys, full queries, every key visible to the tile's first query (a right edge) and
    to its last one (a left edge). The tiles before lo and from hi on need the per-element mask;
    lo <= hi always. Integer arithmetic only (min / max for the conditions), so DSL values trace
    without branches."""
    left, right = band_edges(causal, window)
    lo = m_block_min
    if right is not None:
        # diag(m) + right >= tile_n - 1  <=>  m * tile_m >= tile_n - 1 + n_block * tile_n + seqlen_q - seqlen_k - right
        first_full = _plus(tile_n - 1 + n_block * tile_n + seqlen_q - seqlen_k, -right)
        lo = imax(lo, (imax(first_full, 0) + tile_m - 1) // tile_m)
    keys_cut = imin(imax(tile_n - (seqlen_k - n_block * tile_n), 0), 1)  # 1: this K/V tile is partial
    lo = imin(imax(lo, keys_cut * m_block_max), m_block_max)
    hi = imax(m_block_max - imin(seqlen_q % tile_m, 1), lo)              # a partial last Q tile is masked
    if left is not None:
        # diag(m) - left <= -(tile_m - 1)  <=>  m * tile_m <= n_block * tile_n + seqlen_q - seqlen_k + left - tile_m + 1
        last_full = n_block * tile_n + seqlen_q - seqlen_k + left - tile_m + 1
        hi = imax(imin(hi, imax(last_full + tile_m, 0) // tile_m), lo)  # tiles m with m * tile_m <= last_full
    return lo, hi


def walk_rotation(n_block, tile_n, seqlen_k, m_block_min, m_block_max, imax=max):
    """A rotated walk's offset (options.rotate_walk, hopper/walk.py): K/V tile n_block of the sequence's
    ceil(seqlen_k / tile_n) starts at Q tile m_block_min + this, so the K/V tiles' first Q tiles spread
    evenly over the walk; 0 for an empty walk."""
    num_n = imax((seqlen_k + tile_n - 1) // tile_n, 1)
    return n_block * (m_block_max - m_block_min) // num_n


def rotated_runs(m_block_min, m_block_max, m_rot):
    """A rotated walk as two runs of Q tiles, (first tile, end, position of a tile - the tile): positions
    0 .. n - m_rot - 1 are tiles m_block_min + m_rot .., then the rest are m_block_min .. (n: the walk's
    tiles). The producer and the dQ writer step through positions (``rotated_m``); the consumers loop
    over these runs, cut by their masked / unmasked segments."""
    start = m_block_min + m_rot
    n_m = m_block_max - m_block_min
    return (start, m_block_max, -m_rot), (m_block_min, start, n_m - m_rot)


def run_segment(seg_lo, seg_hi, run_lo, run_hi, imin=min, imax=max):
    """[lo, hi): the Q tiles of segment [seg_lo, seg_hi) inside run [run_lo, run_hi) (lo <= hi always)."""
    lo = imax(seg_lo, run_lo)
    return lo, imax(imin(seg_hi, run_hi), lo)


def rotated_m(m_pos, m_block_min, m_block_max, m_rot):
    """The Q tile at walk position m_pos - m_block_min (what hopper/walk.py's m_at computes on the device)."""
    m = m_pos + m_rot
    return m - (m_block_max - m_block_min) if m >= m_block_max else m


def is_masked(r, c, key_limit, diag, causal: bool, window=None):
    left, right = band_edges(causal, window)
    masked = r >= key_limit
    if right is not None:
        masked = masked | (r > _plus(c + diag, right))
    if left is not None:
        masked = masked | (r < c + diag - left)
    return masked


# The consumer warpgroup whose 64 keys (of a 128-key K/V tile) an edge hides first: the last keys lie past
# a right edge (or the keys' end), the first before a left edge (hopper/consumer.py, half tiles)
IDLE_WARPGROUP = {"right": 1, "left": 0}
WARPGROUP_KEYS = 64


def half_tile_edges(causal: bool, window=None) -> tuple:
    """Per walk segment (masked first tiles, unmasked tiles, masked last tiles): the edge whose hidden keys
    a half tile looks for there ("right": a causal or right window edge, "left": a left window edge), or
    None."""
    left, right = band_edges(causal, window)
    return ("right" if right is not None else None, None, "left" if left is not None else None)


def idle_warpgroup_hidden(edge: str, key_limit, diag, tile_m, causal: bool, window=None):
    """Whether no query of the tile sees the 64 keys of the warpgroup that `edge` idles (IDLE_WARPGROUP)."""
    first = IDLE_WARPGROUP[edge] * WARPGROUP_KEYS
    return keys_hidden(first, WARPGROUP_KEYS, key_limit, diag, tile_m, causal, window, edge)


def keys_hidden(first_key, num_keys, key_limit, diag, tile_m, causal: bool, window=None, edge="any"):
    """Whether local key rows [first_key, first_key + num_keys) of a (tile_n x tile_m) S^T tile are
    masked for every query column 0 .. tile_m - 1 (padding rows included), by the keys' end or by
    the band's `edge`: "right" tests the right edge and the keys' end, "left" the left edge only
    ("any": both). A consumer warpgroup whose 64 keys are hidden skips the tile's products
    (hopper/consumer.py, half tiles). `&` / `|` keep DSL booleans branch-free."""
    left, right = band_edges(causal, window)
    terms = []
    if edge in ("right", "any"):
        terms.append(first_key >= key_limit)
        if right is not None:  # the last column sees keys r <= tile_m - 1 + diag + right
            terms.append(first_key > _plus(tile_m - 1 + diag, right))
    if edge in ("left", "any") and left is not None:  # column 0 sees keys r >= diag - left
        terms.append(first_key + num_keys - 1 < diag - left)
    if not terms:
        raise ValueError(f"edge: {edge!r} tests nothing here (no left edge)")
    hidden = terms[0]
    for term in terms[1:]:
        hidden = hidden | term
    return hidden


def column_key_limit(c, key_limit, diag, causal: bool, imin=min):
    """The first masked key row of query column c: is_masked(r, c, ...) iff r >= this. One limit per
    column, then one compare per score (step 3's masked body: a select per condition cost ~3 per score).
    Causal or none only (a window's left edge needs a second bound: the plain test serves it)."""
    return imin(key_limit, c + diag + 1) if causal else key_limit


# --------------------------------------------------------------------------------------------
# The order in which the K/V-tile CTAs add into one dQ tile (deterministic mode)
# --------------------------------------------------------------------------------------------
class KVAscendingOrder:
    """dQ tile m receives its K/V tiles' contributions in increasing n_block; blockIdx.x = n_block.

    Interface (stage 5 supplies other orders with the same two functions; an order may also define
    ``tile_for_launch() -> (n_block, kv_head, batch)`` to map the whole launch index itself, e.g.
    to swizzle heads, and the kernels then use it instead of blockIdx.y / blockIdx.z):
      * ``n_block_for_launch(bx, num_n_blocks)``: which K/V tile CTA ``bx`` owns. CTAs are
        dispatched in increasing blockIdx, so a CTA may only wait on CTAs with a smaller ``bx``
        of the same (kv head, batch), or the grid could deadlock when not all CTAs fit at once;
      * ``rank(n_block, n_block_first, n_block_last)``: the position of ``n_block`` among the
        K/V tiles ``[n_block_first, n_block_last]`` that add into a dQ tile; the tile's semaphore
        counts up from 0 and the CTA with rank r adds when it reads r.
    Non-causal: CTA n waits for n-1, which started one dQ tile earlier -- a one-tile wavefront.
    """

    name = "kv_ascending"

    @staticmethod
    def n_block_for_launch(bx, num_n_blocks):
        return bx

    @staticmethod
    def rank(n_block, n_block_first, n_block_last):
        return n_block - n_block_first


class KVDescendingOrder:
    """dQ tile m receives contributions in *decreasing* n_block, and CTAs launch in decreasing
    n_block (blockIdx.x = num_n_blocks - 1 - n_block).

    Causal: K/V tile n first meets the Q tile on its diagonal, where it is the *last* K/V tile
    visible to that Q tile, i.e. rank 0 in this order, so a CTA's first dQ write does not wait
    (tile_m <= tile_n; with tile_m > tile_n every other K/V tile is rank 1 there, so it waits only
    for the CTA launched just before it).
    In ascending order CTA n would instead wait until CTA 0 had walked n * tile_n / tile_m Q
    tiles down to its diagonal. This is the order of the paper's SPT schedule (the shortest K/V
    tiles, at the end of the sequence, launch first); stage 5 adds head swizzling on top.
    """

    name = "kv_descending"

    @staticmethod
    def n_block_for_launch(bx, num_n_blocks):
        return num_n_blocks - 1 - bx

    @staticmethod
    def rank(n_block, n_block_first, n_block_last):
        return n_block_last - n_block


SECTION_CTAS = 128  # about one wave of the H100's 132 SMs (one CTA per SM)


def section_tile(r, num_blocks, num_units, section, reverse=False, imin=min, div=operator.floordiv):
    """Index r -> (block, unit): the units (heads, or (kv head, batch) chains) in sections of
    `section`, the block index outer inside a section (reversed when `reverse`), the section's
    units inner. Earlier sections are full, so plain division finds r's; the last may be narrower,
    and a section wider than num_units needs no clamp (then every r falls in section 0, of width
    num_units). Python ints, NumPy arrays (imin=np.minimum; stage 5's orders) or traced Int32
    (imin=cutlass.min; the kernels); `div` replaces the two divisions (stage 5's fast_div)."""
    per_section = num_blocks * section
    s = div(r, per_section)
    unit0 = s * section
    width = imin(section, num_units - unit0)
    r = r - s * per_section
    block = div(r, width)
    if reverse:
        return num_blocks - 1 - block, unit0 + (r - block * width)
    return block, unit0 + (r - block * width)


class _LaunchSections:
    """Launch in sections of chains (``section_tile``): mixed into an order, whose ``rank``
    it keeps; ``reverse_blocks`` launches each chain's K/V tiles descending, as KVDescendingOrder.

    Why: CTA n adds into each dQ tile one hop (the writer's acquire, reduce, completion wait and
    release, a few microseconds) after the CTA before it in the order. Launched side by side, the
    k-th CTA of a chain starts k hops behind the first, and once its dQ buffers are full its math
    waits. With blockIdx.x = n_block, the CTAs that finish together (the first of every chain in
    flight) hand their SMs to consecutive K/V tiles of the next chain, so that chain starts side
    by side again and the wait recurs every wave. In sections, those SMs go to the first tile of G
    other chains, the second tiles follow as the second CTAs finish a hop later, and the stagger
    carries over from wave to wave. A CTA still launches after every CTA it waits for (deadlock-
    free as before), and G * num_n_blocks is about a wave, so about as many heads are in flight
    (their Q, dO and dQaccum in L2) as with blockIdx.x = n_block.
    """

    reverse_blocks = False
    section_ctas = SECTION_CTAS

    @classmethod
    def host_tile(cls, linear, num_n_blocks, num_heads_kv, num_batch, imin=min, div=operator.floordiv):
        """(n_block, kv head, batch) of launch index `linear` on the grid (N, H_kv, B): sections of
        ceil(section_ctas / N) chains. Traced by ``tile_for_launch`` too (imin=cutlass.min,
        div=fast_div: its run-time divisions were ~130 of the ~300 instructions before the first TMA
        load), so integer arithmetic only."""
        chains_per_section = div(cls.section_ctas + num_n_blocks - 1, num_n_blocks)
        n_block, chain = section_tile(linear, num_n_blocks, num_heads_kv * num_batch, chains_per_section,
                                      cls.reverse_blocks, imin, div)
        batch = div(chain, num_heads_kv)
        return n_block, chain - batch * num_heads_kv, batch

    @staticmethod
    def check_grid(num_n_blocks: int, num_heads_kv: int, num_batch: int) -> None:
        """ValueError before launch for a grid whose launch index ``fast_div`` could get wrong."""
        check_fast_div_grid("the backward's sectioned launch order (K/V tiles x KV heads x sequences)",
                            (num_n_blocks, num_heads_kv, num_batch), "split the batch")

    @classmethod
    def tile_for_launch(cls):
        """Device side: this CTA's (n_block, kv head, batch)."""
        import cutlass
        import cutlass.cute as cute

        bx, by, bz = cute.arch.block_idx()
        gx, gy, gz = cute.arch.grid_dim()
        return cls.host_tile(bx + gx * (by + gy * bz), gx, gy, gz, imin=cutlass.min, div=fast_div)


class KVAscendingSectionsOrder(_LaunchSections, KVAscendingOrder):
    """KVAscendingOrder's ranks, launched in sections of chains (``_LaunchSections``)."""

    name = "kv_ascending_sections"


class KVAscendingWideSectionsOrder(KVAscendingSectionsOrder):
    """Sections of about two waves (256 CTAs): the d = 64 non-causal default. Its chains of short
    tiles ran +2..+13% faster with the wider stagger at 1k-16k, where d = 128 (twice the bytes of
    Q, dO and dQaccum per head in L2) lost 7-15% at 1k-4k (``ab_bwd_h100_run31_*``, ``..._run32_*``)."""

    name = "kv_ascending_sections256"
    section_ctas = 2 * SECTION_CTAS


class KVDescendingSectionsOrder(_LaunchSections, KVDescendingOrder):
    """KVDescendingOrder's ranks, launched in sections of chains, K/V tiles descending."""

    name = "kv_descending_sections"
    reverse_blocks = True


def default_dq_order(causal: bool, deterministic: bool, sections: bool = True, head_dim: int | None = None):
    """Descending (SPT-like) for causal deterministic runs; otherwise ascending, which for causal
    launches the longest K/V tiles (n = 0 sees every Q tile) first: LPT, the better balance when
    no CTA ever waits for another. Deterministic runs launch in sections of chains
    (``_LaunchSections``; the Hopper kernels map the launch index with ``tile_for_launch``):
    sections=False gives the plain orders (the Blackwell kernels, which read blockIdx directly);
    head_dim <= 64 widens the non-causal sections (``KVAscendingWideSectionsOrder``).

    Causal runs in the default mode launch in sections too, for the tail, not for any wait: with
    blockIdx.x = n_block the last head's longest K/V tile starts only N CTAs before the grid ends,
    while in sections of G = ceil(128 / N) heads the long tiles of the last G heads start about a
    wave earlier. Stage 5's simulator puts that at 2-3% of the makespan at 1k-8k (none at 16k, where
    G = 1 is the blockIdx order). Paired H100 rounds, step 3 (``ab_bwd_h100_run43_*`` ..
    ``..._run45_*``): +0.7..+5.5% at 8k, +0.2..+7.4% at 4k. Below 4k keys the H100 rounds tied or
    lost, and blockIdx order was kept there until the H200 (``ab_bwd_h200_causal_short_sections.json``,
    9 rounds, the production kernel): at 2k +2.0% (d = 128) and +2.0% (d = 64) with sections, the
    SMs' mean idle time at the grid's end 36 -> 10 us in a trace; at 1k a tie (+0.1%, +1.1%).

    Non-causal runs at head dim <= 64 launch in the deterministic mode's two-wave sections in the
    default mode too: 32 CTAs of one chain that start together reduce into the same dQ tile at the
    same moment, every Q tile of the walk. Paired H100 rounds against blockIdx order
    (``ab_bwd_h100_run63_*``, ``..._run64_*``, 9 + 13 rounds): +0.4..+1.4% at 1k-16k, faster in 8-11 of
    13 rounds at every length. Larger head dims keep blockIdx order (untimed in the default mode;
    in the deterministic one d = 128 lost 7-15% at 1k-4k with two-wave sections)."""
    if not deterministic:
        if causal:
            return KVAscendingSectionsOrder if sections else KVAscendingOrder
        wide = sections and head_dim is not None and head_dim <= 64
        return KVAscendingWideSectionsOrder if wide else KVAscendingOrder
    if causal:
        return KVDescendingSectionsOrder if sections else KVDescendingOrder
    if not sections:
        return KVAscendingOrder
    return KVAscendingWideSectionsOrder if head_dim is not None and head_dim <= 64 else KVAscendingSectionsOrder
