"""One-off probe: d = 96 causal forwards on 192-row tiles in stage 5's LPT order, as an ab_fwd
implementation (the route's default walks 192 x 144 in the grid's order from 8192 keys):

    python -m benchmarks.ab_fwd --impls fa4,benchmarks.probe_d96_lpt~tile_m=192,... --dims 96 --causal 1

tile_m: the query tile; tile_n: a forced key tile (under a compile key of its own); lpt=0: the grid's order.
"""
from __future__ import annotations

import stage3_fwd_kernel.hopper as hopper
from fa4 import _dispatch
from stage3_fwd_kernel.hopper import host, kernel

_default_tile_n, _key = kernel.default_tile_n, host._key
_forced = {"tile_n": None}


def _tile_n(head_dim, head_dim_v, tile_m=128, **kw):
    return _forced["tile_n"] or _default_tile_n(head_dim, head_dim_v, tile_m, **kw)


def _probe_key(*args, **kw):
    return _key(*args, **kw) + ((("probe_tile_n", _forced["tile_n"]),) if _forced["tile_n"] else ())


kernel.default_tile_n = _tile_n
host._key = _probe_key


def attention_forward(q, k, v, *, causal, tile_m: int = 192, tile_n: int = 0, lpt: int = 1):
    sched = None
    if lpt:
        # sink=True: the pick without the grid-order rule for d = 96 (the scheduler ignores the sink itself)
        sched = _dispatch.causal_forward_scheduler.__wrapped__("sm_90", causal, k.shape[1], q.shape[-1], v.shape[-1],
                                                               q.shape[2], k.shape[2], sink=True)
        sched = _dispatch.lpt_for_grid(sched, q.shape[1], q.shape[2], q.shape[0])
    _forced["tile_n"] = tile_n or None
    try:
        return hopper.attention_forward(q, k, v, causal=causal, tile_m=tile_m, scheduler=sched)
    finally:
        _forced["tile_n"] = None
