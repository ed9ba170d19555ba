"""One-off probe: the Hopper forward with another key tile (tile_n) than config.default_tile_n gives,
under a compile key of its own, as an ab_fwd implementation:

    python -m benchmarks.ab_fwd --impls fa4,stage3_fwd_kernel.hopper,benchmarks.probe_tile_n~tile_n=80 --dims 256
"""
from __future__ import annotations

import stage3_fwd_kernel.hopper as hopper
from stage3_fwd_kernel.hopper import host, kernel

_default_tile_n, _key = kernel.default_tile_n, host._key
_forced = {"tile_n": None}


def _tile_n(head_dim, head_dim_v, tile_m=128, **kw):
    return _forced["tile_n"] or _default_tile_n(head_dim, head_dim_v, tile_m, **kw)


def _probe_key(*args, **kw):
    return _key(*args, **kw) + ((("probe_tile_n", _forced["tile_n"]),) if _forced["tile_n"] else ())


kernel.default_tile_n = _tile_n
host._key = _probe_key


def compile_only(*args, tile_n: int, **kw):
    _forced["tile_n"] = tile_n
    try:
        return hopper.compile_only(*args, **kw)
    finally:
        _forced["tile_n"] = None


def attention_forward(q, k, v, *, causal, tile_n: int, **kw):
    _forced["tile_n"] = tile_n
    try:
        return hopper.attention_forward(q, k, v, causal=causal, **kw)
    finally:
        _forced["tile_n"] = None
