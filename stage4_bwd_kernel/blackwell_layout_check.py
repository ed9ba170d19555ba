"""Host-side layout checks of the Blackwell 1-CTA backward, evaluated element by element at trace time.

The kernel reads some shared-memory tiles in both major modes: Q is the K-major B operand of S^T = K Q^T
and, as ``sQt``, the MN-major B operand of dK += dS^T Q; likewise dO (dP^T and dV) and K (S^T and dQ).
Each pair of views must put every element at the same byte, or one of the MMAs reads a transposed
or shuffled tile. Nothing checked that except an equal ``cosize``. Here both layouts are evaluated for
every (row, column) of the tile -- static CuTe layouts give Python integers at trace time -- and the
offsets compared; the swizzles (applied to equal offsets) must be the same function.

    from stage4_bwd_kernel.blackwell_layout_check import transposed_view_mismatches
    transposed_view_mismatches(kernel)   # {"sQ/sQt": 0, "sdO/sdOt": 0, "sK/sKt": 0}
    wide_view_mismatches(wide_kernel)    # the wide kernel's head-dim parts and dQ^T windows, the same way

What it cannot see: whether the MMA descriptors built from these layouts are what the hardware
expects (that needs a Blackwell GPU), and the TMEM operands (P^T, dS^T), which are not SMEM tiles.
"""
from __future__ import annotations

import cutlass.cute as cute

from stage3_fwd_kernel.blackwell_fwd import TARGET_ARCH

# (view, transposed view, rows of the tile, columns of the tile): the first view's rows are the
# second's columns
PAIRS = (("sQ", "sQt", "tm", "d"), ("sdO", "sdOt", "tm", "dv"), ("sK", "sKt", "tn", "d"))


def _leaves(shape, stride):
    """The (extent, stride) leaves of a static hierarchical mode, colexicographic order."""
    if isinstance(shape, int):
        return [(shape, stride)]
    return [leaf for s, d in zip(shape, stride) for leaf in _leaves(s, d)]


def _mode_offset(shape, stride, index: int) -> int:
    """CuTe's offset of 1-D coordinate `index` in one mode (colexicographic over its leaves)."""
    offset = 0
    for extent, step in _leaves(shape, stride):
        offset += (index % extent) * step
        index //= extent
    return offset


def natural_offset(shape, stride, row: int, col: int, stage: int = 0) -> int:
    """Offset (before the swizzle) of element (row, col) of an MMA operand tile whose layout is
    ((rows, k atom), 1, k tiles, stages) with the given static shape / stride: col runs along K."""
    rows = 1
    for extent, _ in _leaves(shape[0][0], stride[0][0]):
        rows *= extent
    k_atom = shape[0][1]
    return (_mode_offset(shape[0], stride[0], row + rows * (col % k_atom))
            + _mode_offset(shape[2], stride[2], col // k_atom) + _mode_offset(shape[3], stride[3], stage))


def _static_layouts(kernel) -> dict:
    """{name: (shape, stride, swizzle)} of the SMEM layouts as the kernel builds them (static at trace time)."""
    static = {}

    @cute.jit
    def probe():
        _, layouts = kernel.mmas_and_smem_layouts()
        for name, layout in layouts.items():
            static[name] = (layout.outer.shape, layout.outer.stride, str(layout.inner))

    cute.compile(probe, options=f"--gpu-arch {TARGET_ARCH}")  # builds nothing: only the trace matters
    return static


def _stages(shape, stride) -> int:
    n = 1
    for extent, _ in _leaves(shape[3], stride[3]):
        n *= extent
    return n


def wide_view_mismatches(kernel, shift: int = 0) -> dict:
    """The wide kernel (blackwell_bwd_wide.py) reads parts of its K-major tiles transposed: Q's and dO's
    columns of this CTA's head-dim part (dK, dV) and K's 128-column dQ^T windows, each a view of the
    tile's layout moved by ``part_offset`` elements. For every part / window, element (c, r) of the view
    must sit at the byte of element (r, col0 + c) of the tile (the swizzle is the same function when the
    move is a multiple of its 1024-element period). {"sQ/sQt@0": n, ...}: elements that disagree (-1:
    different swizzles, or a move that breaks the swizzle phase). shift: add this to col0 (tests)."""
    from stage4_bwd_kernel.blackwell_bwd_wide import part_offset

    static = _static_layouts(kernel)
    views = [("sQ", "sQt", kernel.tm, kernel.dk_cols, [p * kernel.dk_cols for p in range(kernel.splits)]),
             ("sdO", "sdOt", kernel.tm, kernel.dv_cols, [p * kernel.dv_cols for p in range(kernel.splits)]),
             ("sK", "sKt", kernel.tn, 128, [p * kernel.dk_cols + w for p in range(kernel.splits)
                                           for w in kernel.windows])]
    result = {}
    for base, view, rows, width, starts in views:
        (sa, da, swa), (sb, db, swb) = static[base], static[view]
        for col0 in starts:
            move = part_offset(col0, rows)
            if swa != swb or move % 1024:
                result[f"{base}/{view}@{col0}"] = -1
                continue
            bad = 0
            for s in range(_stages(sb, db)):
                for r in range(rows):
                    for c in range(width):
                        bad += natural_offset(sb, db, c, r, s) + move != natural_offset(sa, da, r, col0 + shift + c, s)
            result[f"{base}/{view}@{col0}"] = bad
    return result


def transposed_view_mismatches(kernel, transpose: bool = True) -> dict:
    """{"sQ/sQt": n, ...}: elements whose two views disagree (each pair over every element of every
    stage), or -1 where the swizzles differ. transpose=False compares element (r, c) of one view
    with (r, c) of the other instead of (c, r): a deliberately wrong mapping, for the tests."""
    sizes = {"tm": kernel.tm, "tn": kernel.tn, "d": kernel.d, "dv": kernel.dv}
    static = _static_layouts(kernel)
    result = {}
    for a_name, b_name, rows_name, cols_name in PAIRS:
        (sa, da, swa), (sb, db, swb) = static[a_name], static[b_name]
        rows, cols = sizes[rows_name], sizes[cols_name]
        stages = _stages(sa, da)
        bad = 0
        for s in range(stages):
            for r in range(rows):
                for c in range(cols):
                    rr, cc = (c, r) if transpose else (r % cols, c % rows)
                    bad += natural_offset(sa, da, r, c, s) != natural_offset(sb, db, rr, cc, s)
        result[f"{a_name}/{b_name}"] = bad if swa == swb else -1
    return result
