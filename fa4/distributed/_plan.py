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
