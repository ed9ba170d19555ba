"""Stage 3, Blackwell (sm_100a): the load warp's paged K/V boxes and its zeroing of V's tail rows.
COMPILED AND INSPECTED ONLY: no Blackwell GPU is reachable from this project, so this code has never
run on hardware.

Pages smaller than the key tile (components.paged_kv: 16, 32 or 64 keys at tile_n = 128). A ring
slot holds K as `chunks` column slabs of tile_n rows (64 bf16 columns, 128-byte rows, under the
128-byte swizzle; 32 columns under the 64-byte one at d = 96), and V (the MN-major B operand of
O += P V) the same way with the keys as rows:

    K slot ((tile_n, 16), 1, K-steps):(row, 1, ...)      V slot (((cols, chunks), 16), 1, tile_n / 16):
                                                                (((1, chunk), cols), 0, 16 x cols)

The swizzle permutes 16-byte pieces inside one row, so the rows of one page are a whole, aligned
range of every slab: box j of a block is the slot with its key extent cut to the page and its origin
moved j pages on. TMA fills it from the page's rows of the flat cache (one box = `chunks` TMA copies
of page x cols); the slot's barrier still expects the whole block's bytes. The TMA atoms are built for
one box (the QK^T MMA's B partition with N = page rows); the ring views add a box mode before the stage.

V's tail (blackwell_load_mma's load_v_tail). In a varlen build, rows past a sequence's keys are unused
cache slots (seqused_k), a paged cache's unused rows or a buffer's end, which may hold anything, NaN
included, and 0 * NaN is not 0: the scores are masked, but O += P V would still read those V rows. So the walk's last V goes to a
barrier of the load warp's own (`v_tail`); the warp waits for it, zeroes the rows from the first unused
key to the end of the slot (each lane whole rows, 16-byte stores through the slot's swizzled layout),
fences the generic-proxy stores for the tensor core and only then arrives on the slot's kv_full, which
the MMA warp waits on as for any V.
"""
from __future__ import annotations

import cutlass.cute as cute
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32
from cutlass.cute.nvgpu import tcgen05

ROWS_PER_MMA_K = 16  # keys per K-step of O += P V (bf16 / fp16 tcgen05.mma)


def _key_cut_K(outer, rows: int):
    """A K slot's (or one stage's) outer layout with its key extent cut to `rows`: mode 0 is
    (keys, 16 columns); (shape, stride) of the box."""
    (keys, cols), rest = outer.shape[0], outer.shape[1:]
    (row_stride, col_stride), rest_stride = outer.stride[0], outer.stride[1:]
    assert keys % rows == 0, (keys, rows)
    return ((rows, cols), *rest), ((row_stride, col_stride), *rest_stride), rows * row_stride


def _key_cut_V(outer, rows: int):
    """The same for V: its keys are mode 0's second sub-mode (16 a K-step) times mode 2 (K-steps)."""
    shape, stride = list(outer.shape), list(outer.stride)
    assert shape[0][1] == ROWS_PER_MMA_K and rows % ROWS_PER_MMA_K == 0, (shape, rows)
    steps = rows // ROWS_PER_MMA_K
    step_stride = stride[2]
    shape[2] = steps
    return tuple(shape), tuple(stride), steps * step_stride


def box_smem_layout(composed, rows: int, is_v: bool):
    """One box of a one-stage (MMA-partitioned, swizzled) K or V layout: what the box's TMA atom fills."""
    outer = cute.select(composed.outer, mode=[0, 1, 2])
    shape, stride, _ = (_key_cut_V if is_v else _key_cut_K)(outer, rows)
    return cute.make_composed_layout(composed.inner, 0, cute.make_layout(shape, stride=stride))


def boxed_ring_layout(outer, rows: int, boxes: int, is_v: bool):
    """The K or V ring's outer layout (MMA, N, K, slot) as (MMA, N, K, box, slot): box j of a slot is
    its rows j * rows .. (j + 1) * rows - 1 (a box's origin moves by whole 1024-byte swizzle periods)."""
    one = cute.make_layout(tuple(outer.shape[:3]), stride=tuple(outer.stride[:3]))
    shape, stride, box_stride = (_key_cut_V if is_v else _key_cut_K)(one, rows)
    return cute.make_layout((*shape, boxes, outer.shape[3]), stride=(*stride, box_stride, outer.stride[3]))


def boxed_ring(ring: cute.Tensor, rows: int, boxes: int, is_v: bool) -> cute.Tensor:
    """boxed_ring_layout over the ring's own SMEM (its swizzled iterator)."""
    return cute.make_tensor(ring.iterator, boxed_ring_layout(ring.layout, rows, boxes, is_v))


def box_mma_qk(dtype, tile_m: int, rows: int) -> cute.TiledMma:
    """S = Q K^T's MMA with N = one box of keys: it only shapes K's box (its B partition)."""
    k_major = cute.nvgpu.OperandMajorMode.K
    return sm100_utils.make_trivial_tiled_mma(dtype, dtype, k_major, k_major, Float32, tcgen05.CtaGroup.ONE,
                                              (tile_m, rows))


def box_tma_atoms(tma_load, mK: cute.Tensor, mV: cute.Tensor, sK_layout, sV_layout, tiled_mma_pv: cute.TiledMma,
                  dtype, tile_m: int, rows: int, d: int, dv: int, cluster_vmnk):
    """(atom_K, tma_K, atom_V, tma_V): K and V TMA atoms of one page box each."""
    atom_K, tma_K = cute.nvgpu.make_tiled_tma_atom_B(
        tma_load, mK, box_smem_layout(sK_layout, rows, False), (tile_m, rows, d),
        box_mma_qk(dtype, tile_m, rows), cluster_vmnk)
    atom_V, tma_V = cute.nvgpu.make_tiled_tma_atom_B(
        tma_load, mV, box_smem_layout(sV_layout, rows, True), (tile_m, dv, rows), tiled_mma_pv, cluster_vmnk)
    return atom_K, tma_K, atom_V, tma_V
