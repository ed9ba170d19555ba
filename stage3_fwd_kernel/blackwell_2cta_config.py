"""Stage 3, Blackwell: the per-CTA plan of the 2-CTA forward (``blackwell_fwd_2cta.py``), plain Python.

A cluster of two CTAs runs S = Q K^T and O += P V as CTA-pair MMAs (``tcgen05.mma.cta_group::2``,
M = 256: 128 rows from each CTA). A pair MMA splits its B operand by N across the pair, so each CTA
stages only half of every K tile (64 keys x d) and half of every V tile (dv / 2 columns x 128 keys),
while its A operand (Q) and its accumulators (S, O) are exactly the 1-CTA kernel's. So:

* **TMEM** per CTA is the 1-CTA plan unchanged (``blackwell_config._tmem_plan``): at d = 128,
  S_0 [0, 128), S_1 [128, 256), O_0 [256, 384), O_1 [384, 512) = 512 / 512; P, the rescale factor
  and the final statistics alias S as before. The pair MMA writes each CTA's 128 rows of S_i / O_i
  into that CTA's TMEM at the same column address (the pair allocates together).
* **SMEM** per CTA: header + sQ (2 x 128 x d) + sO (2 x 128 x dv) + a ring of half-tiles, a slot
  holding the larger of a K half (tile_n / 2 x d) and a V half (dv / 2 x tile_n):

      d = 128:        1 KB + 64 KB + 64 KB + 6 slots x 16 KB = 230400 bytes  (1-CTA: 3 slots x 32 KB)
      d = (192, 128): 1 KB + 96 KB + 64 KB + 2 slots x 24 KB = 214016 bytes  (1-CTA: 2 x 48 KB, sO over sQ)

  The same bytes of K/V in flight as the 1-CTA kernel at d = 128, in twice as many slots, each
  holding half of what the pair's MMA reads: 3 key blocks ahead instead of 1.5.
* **Barriers**: the 1-CTA list plus, per Q tile, ``p_full_peer`` / ``p_full_2_peer`` (the odd CTA's
  "P stored" relayed to the even CTA's MMA thread) and ``tmem_pair`` (the allocator's pair handshake
  before ``tcgen05.dealloc``): 25 + 6 x 2 + 5 = at most 36 x 8 bytes, inside the 1 KB header.
* **Registers**: the 1-CTA split (192 / 72 / 56), 16 warps.
"""
from __future__ import annotations

import dataclasses

from stage3_fwd_kernel.blackwell_config import (HEADER_ALIGN, SMEM_CAPACITY, BlackwellFwdConfig, SmemPlan,
                                                _num_barriers, _round_up, blackwell_fwd_config)

PAIR = 2                                  # CTAs per cluster
SUPPORTED_2CTA_HEAD_DIMS = ((128, 128), (192, 128))
MAX_2CTA_STAGES = 6                       # 3 (K, V) pairs of half-tiles: the 1-CTA d = 128 bytes
PAIR_BARRIERS_PER_Q_TILE = 2              # p_full_peer, p_full_2_peer
PAIR_BARRIERS = 1                         # tmem_pair


def num_pair_barriers(q_tiles: int, kv_stages: int) -> int:
    """The 1-CTA barriers (blackwell_config._num_barriers) + the pair's (in blackwell_fwd_2cta._bar's order)."""
    return _num_barriers(q_tiles, kv_stages) + PAIR_BARRIERS_PER_Q_TILE * q_tiles + PAIR_BARRIERS


def _pair_smem(q_tiles, tile_m, tile_n, d, dv, kv_stages, elem=2) -> SmemPlan:
    nbar = num_pair_barriers(q_tiles, kv_stages)
    slot = max((tile_n // PAIR) * d, (dv // PAIR) * tile_n) * elem   # half of K or half of V
    return SmemPlan(header=_round_up(8 * nbar + 4, HEADER_ALIGN), num_barriers=nbar,
                    q=q_tiles * tile_m * d * elem, kv_slot=slot, kv_stages=kv_stages, kv=kv_stages * slot,
                    o=q_tiles * tile_m * dv * elem, o_overlaps_q=False)


def blackwell_fwd_2cta_config(head_dim: int, head_dim_v: int | None, dtype, *, causal: bool,
                              kv_stages: int | None = None) -> BlackwellFwdConfig:
    """The 1-CTA plan (blackwell_fwd_config: arguments, TMEM, registers) with the pair's SMEM plan.
    ValueError naming head_dim, kv_stages or SMEM when something is not supported or does not fit."""
    dv = head_dim if head_dim_v is None else head_dim_v
    if (head_dim, dv) not in SUPPORTED_2CTA_HEAD_DIMS:
        raise ValueError(f"head_dim: the 2-CTA forward supports (head_dim, head_dim_v) in "
                         f"{SUPPORTED_2CTA_HEAD_DIMS}, got ({head_dim}, {dv})")
    # 2 slots of the 1-CTA ring always fit next to its sQ / sO here; the ring is replaced below
    base = blackwell_fwd_config(head_dim, dv, dtype, causal=causal, kv_stages=2)
    tm, tn, nq = base.tile_m, base.tile_n, base.q_tiles_per_cta
    fit = 0
    while fit < MAX_2CTA_STAGES and _pair_smem(nq, tm, tn, head_dim, dv, fit + 1).total <= SMEM_CAPACITY:
        fit += 1
    stages = fit if kv_stages is None else kv_stages
    if not (isinstance(stages, int) and stages >= 2):
        raise ValueError(f"kv_stages: at least 2 ring slots (a K half and a V half are in use together), "
                         f"got {stages!r}")
    smem = _pair_smem(nq, tm, tn, head_dim, dv, stages)
    if smem.total > SMEM_CAPACITY:
        raise ValueError(f"SMEM does not fit per CTA: {smem.describe()}; use kv_stages <= {fit}")
    return dataclasses.replace(base, kv_stages=stages, smem=smem)


if __name__ == "__main__":
    for d, dv in SUPPORTED_2CTA_HEAD_DIMS:
        c = blackwell_fwd_2cta_config(d, dv, "bf16", causal=False)
        print(f"2-CTA fwd d={d}/{dv}: TMEM {c.tmem.used}/{c.tmem.alloc}, SMEM {c.smem.describe()}")
