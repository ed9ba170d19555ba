"""Integer division in the kernels, shared by the forward (stage 3) and the backward (stage 4,
stage 5): on the path to a CTA's first load (fast_div) and in the hot loops' ring bookkeeping
(ring_slot). Pure Python until traced: cutlass is imported only when a DSL value is divided."""
from __future__ import annotations

FAST_DIV_MAX = 1 << 22


def fast_div(a, b):
    """``a // b`` for 0 <= a < FAST_DIV_MAX (2**22) and b >= 1. Python ints and NumPy arrays: floor
    division. Traced DSL values (a run-time divisor): an fp32 quotient from one MUFU.RCP estimate,
    within one of the true one at these sizes (relative error < 2**-22), then corrected by the
    remainder's sign -- about 10 instructions where a 32-bit software division takes ~40, on the
    path to every CTA's first TMA load. A launch order that uses it refuses larger grids on the host
    (``check_fast_div_grid``); the forward's KV head (head // heads per KV head) is far below the bound."""
    import numpy as np

    if isinstance(b, (int, np.integer, np.ndarray)):
        return a // b
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    return fast_div_formula(Int32(a), Int32(b), Float32, cute.arch.rcp_approx, Int32)


def fast_div_formula(a, b, to_f32, rcp, to_int):
    """fast_div's traced arithmetic with its operations passed in: the DSL's (Float32, rcp.approx,
    Int32) in the kernels, NumPy's in the tests, which replay it with the reciprocal a few ulp off."""
    q = to_int(to_f32(a) * rcp(to_f32(b)))  # within one of a // b
    r = a - q * b
    return q + to_int(r >= b) - to_int(r < 0)


def ring_slot(t, stages: int):
    """(t % stages, (t // stages) % 2) for t >= 0: the slot of the t-th use of a ring of buffers and
    its phase bit. Traced Int32 values are divided as unsigned: signed // and % round toward zero,
    which costs ~10 sign fix-up instructions per slot in the loops that walk the ring (uniform ones,
    issued between a barrier wait and the wgmma it guards)."""
    if isinstance(t, int):
        return t % stages, (t // stages) % 2
    from cutlass import Int32, Uint32

    u = Uint32(t)
    return Int32(u % stages), Int32((u // stages) & 1)


def check_fast_div_grid(what: str, extents: tuple, hint: str) -> None:
    """ValueError before launch when a launch order that maps its index with ``fast_div`` gets a grid
    of FAST_DIV_MAX tiles or more, where the mapping could go wrong."""
    total = 1
    for e in extents:
        total *= e
    if total >= FAST_DIV_MAX:
        raise ValueError(f"{what} handles fewer than {FAST_DIV_MAX} CTAs, got {' x '.join(map(str, extents))} = "
                         f"{total}: {hint}")
