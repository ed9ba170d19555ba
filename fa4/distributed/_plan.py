"""Where each token lives, and what each ring step computes. Pure Python: no process group.

A sequence of S tokens is split over P ranks. Two layouts:

* ``contiguous``: rank r holds tokens [r S/P, (r+1) S/P). Under a causal mask rank P-1 has 2P - 1
  times the work of rank 0 (P - 1 full blocks and a triangle against one triangle), so the ring
  waits on the last rank.
* ``zigzag``: the sequence is cut into 2P equal chunks; rank r holds chunks r and 2P-1-r (one from
  the front, one from the back), in that order. Every rank then sees the same number of unmasked
  (query, key) pairs under a causal mask.

In a ring step rank r holds the keys of rank ``src`` and attends its queries to them. What part of
that block is visible follows from the global positions (causal here means key position <= query
position, the lower-left triangle of the whole sequence):

contiguous, causal: src < r: every query sees every key (full block); src == r: the local causal
triangle; src > r: nothing.

zigzag, causal, with the local halves (front chunk r, back chunk 2P-1-r) written F and B:
src == r: local causal (F then B is in position order, so a plain causal mask on the two chunks is
exact); src < r: both local halves see src's front chunk and neither sees its back chunk (2P-1-src
is after both), so all queries against the key front half, no mask; src > r: only the local back
chunk sees anything, and it sees both of src's chunks, so the query back half against all keys, no
mask. Each off-diagonal step is half a block; every rank does 1 triangle + (P-1) half blocks.

A sliding window (query i sees keys i - left ..= i + right; causal: right = 0) is a band of the
global (query, key) grid, so a step is planned chunk pair by chunk pair (`band_block`): each pair of
a local chunk and a received one is skipped, computed whole, or computed on the rows and keys the
band reaches, with the window re-expressed on that sub-block in fa4's bottom-right convention. The
band's edges are parallel to the diagonal, so both sides of that window are >= 0 on every sub-block
(which fa4 requires): no chunk pair needs a mask fa4 cannot take.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

LAYOUTS = ("zigzag", "contiguous")


class StepWork(NamedTuple):
    """One ring step's attention: local query rows x received key rows, with or without the causal
    mask (bottom-right aligned, as fa4's; here both are square or unmasked)."""
    q_rows: slice
    kv_rows: slice
    causal: bool


class BlockWork(NamedTuple):
    """One kernel call of a ring step: local query rows x received key rows, masked as fa4 masks one
    call: causal (bottom-right aligned) and a window (left, right) on the block's own rows, None
    meaning unlimited on that side."""
    q_rows: slice
    kv_rows: slice
    causal: bool
    window: tuple = (None, None)


def check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    return layout


def chunks_per_rank(layout: str) -> int:
    return 2 if layout == "zigzag" else 1


def step_work(rank: int, src: int, world: int, local_len: int, causal: bool, layout: str) -> Optional[StepWork]:
    """What rank `rank` computes against the keys that came from `src` (None: nothing visible).
    `local_len` is the local sequence length (the same on every rank)."""
    whole = slice(0, local_len)
    if not causal:
        return StepWork(whole, whole, False)
    if src == rank:
        return StepWork(whole, whole, True)
    if layout == "contiguous":
        return StepWork(whole, whole, False) if src < rank else None
    half = local_len // 2
    if src < rank:
        return StepWork(whole, slice(0, half), False)
    return StepWork(slice(half, local_len), whole, False)


def band_block(q_start: int, q_len: int, k_start: int, k_len: int, left, right) -> Optional[BlockWork]:
    """Queries [q_start, q_start + q_len) against keys [k_start, k_start + k_len) (global positions)
    under the band "query i sees key j iff i - left <= j <= i + right" (None: unlimited): the rows that
    see at least one key, the keys those rows see, and the window that masks exactly the band on that
    sub-block in fa4's convention (row r sees keys r + off - wl ..= r + off + wr, off = keys - rows),
    a side None where it masks nothing and a right side of 0 spelled causal. None: no query sees a key.

    Row r of the block sees columns [r + a, r + b], a = (q_start - k_start) - left and b = (q_start -
    k_start) + right; rows r with r + b >= 0 and r + a < k_len see a column, and so do all rows between
    two that do. On the sub-block both window sides come out >= 0 (the band's edges run parallel to
    the diagonal and the sub-block is cut where they leave the block)."""
    delta = q_start - k_start
    a = None if left is None else delta - left
    b = None if right is None else delta + right
    r_lo = 0 if b is None else max(0, -b)
    r_hi = q_len if a is None else min(q_len, k_len - a)
    if r_hi <= r_lo or k_len <= 0:
        return None
    c_lo = 0 if a is None else max(0, r_lo + a)
    c_hi = k_len if b is None else min(k_len, r_hi + b)
    rows, cols = r_hi - r_lo, c_hi - c_lo
    off = cols - rows
    wl = None if a is None else off - (r_lo + a - c_lo)
    wr = None if b is None else (r_lo + b - c_lo) - off
    if wl is not None and wl >= cols - 1:     # even the last row's band starts at or before column 0
        wl = None
    if wr is not None and wr >= rows - 1:     # even the first row's band ends at or past the last column
        wr = None
    causal = wr == 0
    return BlockWork(slice(r_lo, r_hi), slice(c_lo, c_hi), causal, (wl, None if causal else wr))


def step_blocks(rank: int, src: int, world: int, local_len: int, causal: bool, layout: str,
                window=(None, None)) -> list[BlockWork]:
    """The kernel calls rank `rank` makes against the keys that came from `src`, in a fixed order.
    window (left, right): fa4's sliding window over the global sequence (None: unlimited; causal
    means right = 0). Without a window: `step_work`'s one block (or none); with one: one block per
    chunk pair the band reaches (`band_block`)."""
    left, right = window
    if left is None and (right is None or causal):
        work = step_work(rank, src, world, local_len, causal, layout)
        return [] if work is None else [BlockWork(work.q_rows, work.kv_rows, work.causal)]
    per = chunks_per_rank(layout)
    size = local_len // per
    ids = (lambda r: [r] if layout == "contiguous" else [r, 2 * world - 1 - r])
    blocks = []
    for qi, qc in enumerate(ids(rank)):
        for ki, kc in enumerate(ids(src)):
            blk = band_block(qc * size, size, kc * size, size, left, 0 if causal else right)
            if blk is not None:
                q0, k0 = qi * size, ki * size
                blocks.append(blk._replace(q_rows=slice(q0 + blk.q_rows.start, q0 + blk.q_rows.stop),
                                           kv_rows=slice(k0 + blk.kv_rows.start, k0 + blk.kv_rows.stop)))
    return blocks


def local_positions(rank: int, world: int, seqlen: int, layout: str) -> list[int]:
    """The global positions of rank `rank`'s tokens, in local order."""
    n = chunks_per_rank(layout) * world
    size = seqlen // n
    ids = [rank] if layout == "contiguous" else [rank, 2 * world - 1 - rank]
    return [c * size + i for c in ids for i in range(size)]


def check_divisible(name: str, seqlen: int, world: int, layout: str, local: bool) -> None:
    """A sequence (global, or `local` per-rank) must split into equal chunks."""
    n = chunks_per_rank(layout) * (1 if local else world)
    if seqlen % n:
        what = "local" if local else "global"
        raise ValueError(f"{name}: the {what} sequence length {seqlen} must be a multiple of {n} for the "
                         f"{layout!r} layout over {world} rank(s) (pad the sequence, or pick another layout)")
