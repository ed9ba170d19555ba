"""The split tail's combine (stage3_fwd_kernel.hopper.split_tail): the key chunks of the last
partial wave's tiles merged into out and lse.

A chunk j of a tail tile leaves, per query row, its log-sum-exp lse_j and its output O_j divided by its
own row sum (hopper.epilogue.store_split: fp32 workspace (R * S, tile_m, dv + 1), lse in the
last column). The whole row is then

    lse = log sum_j exp(lse_j),    O = sum_j exp(lse_j - lse) O_j

which is what one CTA walking every key block would have computed, up to the order of the additions.
One warp per query row: every lane reads the row's S lse values (the same addresses: broadcast), then
accumulates dv / 32 columns of O over the chunks, 128-byte coalesced rows. R * tile_m rows in all (512
at the benchmark's d = 128 shapes), so the kernel is a few microseconds: what the torch version of the
same formula cost in a dozen small launches is why this exists.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from stage3_fwd_kernel import host_io
from stage3_fwd_kernel.compile_cache import Compiled, compile_cached
from stage3_fwd_kernel.components.key_split import rows_by_token
from stage3_fwd_kernel.tile_scheduler import StaticTileScheduler

STEP = "fwd_split_combine"
ROWS_PER_CTA = 4  # one warp each
LOG2_E = math.log2(math.e)


@cute.jit
def merge_row(lse_parts: cute.Tensor, out_parts: cute.Tensor, first: Int32, count: Int32, lane: Int32,
              acc: cute.Tensor) -> Float32:
    """One query row's merge, by one warp: parts first .. first + count - 1 of lse_parts (1-D, fp32) and
    out_parts (rows x >= dv, fp32 or 16-bit); lane keeps columns lane + 32 c in acc (dv / 32 fp32 values,
    zeroed here). Returns the row's lse (-inf when no part saw a key: then acc stays 0, no NaN).
    The row's maximum and sum take the parts 32 at a time, one per lane, and two warp reductions:
    a serial walk over the parts cost a dependent load each (12 us for 32 parts on an H200)."""
    top = -Float32.inf
    for j in cutlass.range(lane, count, 32, unroll=1):
        top = cute.arch.fmax(top, lse_parts[first + j])
    top = cute.arch.warp_reduction(top, cute.arch.fmax)  # every lane gets the row's value
    top_safe = Float32(0.0) if top == -Float32.inf else top  # a row no part sees: weights 0
    total = Float32(0.0)
    for j in cutlass.range(lane, count, 32, unroll=1):
        total += cute.math.exp2((lse_parts[first + j] - top_safe) * LOG2_E, fastmath=True)
    total = cute.arch.warp_reduction(total, lambda a, b: a + b)
    lse = -Float32.inf
    if total > 0.0:
        lse = top_safe + cute.math.log2(total, fastmath=True) / LOG2_E
    acc.fill(0.0)
    if total > 0.0:
        for j in cutlass.range(count, unroll=4):
            weight = cute.math.exp2((lse_parts[first + j] - lse) * LOG2_E, fastmath=True)
            for c in cutlass.range_constexpr(cute.size(acc)):
                acc[c] += weight * Float32(out_parts[first + j, lane + 32 * c])
    return lse


class _RowMerges:
    """A kernel of `merge_row`s: one warp per output row, dv / 32 columns per lane."""

    def __init__(self, dtype, head_dim_v: int):
        if head_dim_v % 32:
            raise ValueError(f"head_dim_v: expected a multiple of 32 (one column per lane), got {head_dim_v}")
        self.dtype = dtype
        self.head_dim_v = head_dim_v
        self.smem_bytes = 0


class SplitTailCombine(_RowMerges):
    @cute.jit
    def __call__(self, mSplit: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, chunks: Int32, tiles: Int32,
                 num_m_blocks: Int32, stream):
        # mSplit (R * chunks, tile_m, dv + 1) fp32; mO (B, Sq, H, dv); mLSE (B, H, Sq) fp32; tiles: the
        # call's query tiles (the tail is the last R of the static order), num_m_blocks: tiles a head
        if const_expr(mO.element_type != self.dtype):
            raise TypeError("out must have the kernel's dtype")
        tail = mSplit.shape[0] // chunks
        self.kernel(mSplit, mO, mLSE, chunks, tiles, num_m_blocks).launch(
            grid=(tail, (mSplit.shape[1] + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1),
            block=[32 * ROWS_PER_CTA, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mSplit: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, chunks: Int32, tiles: Int32,
               num_m_blocks: Int32):
        dv = self.head_dim_v
        tidx, _, _ = cute.arch.thread_idx()
        r, row_group, _ = cute.arch.block_idx()
        lane = tidx % 32
        m = row_group * ROWS_PER_CTA + tidx // 32          # the row inside the tile
        tile_m = mSplit.shape[1]
        if m < tile_m:
            # the tail tile's place in the static order: linear index tiles - R + r
            m_block, head, batch = StaticTileScheduler.tile_at(
                tiles - mSplit.shape[0] // chunks + r, num_m_blocks, mO.shape[2], None)
            row = m_block * tile_m + m
            acc = cute.make_rmem_tensor((dv // 32,), Float32)
            lse = merge_row(mSplit[(None, m, dv)], mSplit[(None, m, None)], r * chunks, chunks, lane, acc)
            for c in cutlass.range_constexpr(dv // 32):
                mO[batch, row, head, lane + 32 * c] = acc[c].to(self.dtype)
            if lane == 0:
                mLSE[batch, head, row] = lse


def _fake_args(dtype, head_dim_v: int, *, launchable: bool = False):
    return (host_io.fake_lse(), host_io.fake_bshd(dtype, head_dim_v), host_io.fake_lse(), Int32(1), Int32(1), Int32(1),
            host_io.launch_stream() if launchable else cute.runtime.make_fake_stream())


def compile_only(dtype="bf16", head_dim_v: int = 128, *, launchable: bool = False) -> Compiled:
    """The combine for one output dtype and dv (compile-time); launchable=True builds what
    split_tail_combine launches."""
    dt = host_io.cutlass_dtype(dtype)
    key = (STEP, "gpu" if launchable else "fake", str(dt), head_dim_v)
    return compile_cached(key, lambda: (SplitTailCombine(dt, head_dim_v),
                                               _fake_args(dt, head_dim_v, launchable=launchable)))


def combine(split, chunks: int, out, lse, tiles: int, num_m_blocks: int):
    """Launch the combine on the torch tensors of a split_tail call (after its attention kernel, same stream)."""
    comp = compile_only(host_io.cutlass_dtype(out.dtype), out.shape[-1], launchable=True)
    comp.fn(split, out, lse, chunks, tiles, num_m_blocks)


# ---------------------------------------------------------------------------------------------
# the same merge for key segments laid out batch-major (split-KV decode: fa4.flash_attn_with_kvcache)
# ---------------------------------------------------------------------------------------------
PARTS_STEP = "fwd_parts_combine"


class PartsCombine(_RowMerges):
    """n partial results per (batch, row, head), as a varlen forward over n key segments per sequence
    leaves them: out (B * n, R, H, dv) in the output dtype, lse (H, B * n, R) fp32. Writes the merged
    out (B, R, H, dv) and lse (B, H, R). One warp per (batch, row, head), `merge_row` as above; the
    partial outs are 16-bit here (normalised by their own row sums, as the kernel stored them).

    Launched as a programmatic dependent (PDL): a forward that signals its dependents
    (griddepcontrol.launch_dependents; the Hopper split-KV launch does, at entry) lets these CTAs
    become resident while it runs, on the SMs it leaves free, and each waits (griddepcontrol.wait)
    until the forward has finished and its stores are visible; after any other kernel the wait
    returns at once. What that saves is the merge's launch latency on a decode step's critical path.
    Once its wait returns it signals its own dependents: the next step's split launch (itself a
    programmatic dependent) then starts its CTAs while this merge runs.

    token_rows: the parts' rows are GQA heads packed by query token (row t g + j: token t of head
    h g + j, the split launch's rows_per_query g), and the merged rows go straight to the call's
    layouts, out (B, T, H, g, dv) and lse (B, H, g, T) -- views of (B, T, H g, dv) and (B, H g, T) --
    instead of a copy after the merge. The kernel sees them as (B, (g, T), H, dv) and (B, H, (g, T)):
    row r's coordinate in a (g, T) mode is (r % g, r // g)."""

    def __init__(self, dtype, head_dim_v: int, token_rows: bool = False):
        super().__init__(dtype, head_dim_v)
        self.token_rows = token_rows

    @cute.jit
    def __call__(self, mParts: cute.Tensor, mLseParts: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 parts: Int32, stream):
        if const_expr(mO.element_type != self.dtype or mParts.element_type != self.dtype):
            raise TypeError("the partial and merged outs must have the kernel's dtype")
        if const_expr(self.token_rows):
            mO, mLSE = token_rows_views(mO, mLSE)
        warps = mO.shape[0] * cute.size(mO, mode=[1]) * mO.shape[2]          # B * R * H rows to merge
        self.kernel(mParts, mLseParts, mO, mLSE, parts).launch(
            grid=((warps + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1, 1), block=[32 * ROWS_PER_CTA, 1, 1], stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, mParts: cute.Tensor, mLseParts: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, parts: Int32):
        cute.arch.griddepcontrol_wait()  # the parts' forward has finished (a PDL launch: see the class)
        cute.arch.griddepcontrol_launch_dependents()  # the next step's split launch may start its CTAs
        tidx, _, _ = cute.arch.thread_idx()
        cta, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        rows, heads = cute.size(mO, mode=[1]), mO.shape[2]
        w = cta * ROWS_PER_CTA + tidx // 32                                   # (batch, row, head), head fastest
        if w < mO.shape[0] * rows * heads:
            head = w % heads
            row = (w // heads) % rows
            batch = w // (heads * rows)
            acc = cute.make_rmem_tensor((self.head_dim_v // 32,), Float32)
            lse = merge_row(mLseParts[(head, None, row)], mParts[(None, row, head, None)], batch * parts, parts,
                            lane, acc)
            for c in cutlass.range_constexpr(self.head_dim_v // 32):
                mO[batch, row, head, lane + 32 * c] = acc[c].to(self.dtype)
            if lane == 0:
                mLSE[batch, head, row] = lse


@cute.jit
def token_rows_views(mO: cute.Tensor, mLSE: cute.Tensor):
    """out (B, T, H, g, dv) -> (B, (g, T), H, dv) (components.key_split.rows_by_token) and lse
    (B, H, g, T) -> (B, H, (g, T)): the same memory, row t g + j (PartsCombine's token_rows)."""
    l_shape, l_stride = mLSE.layout.shape, mLSE.layout.stride
    lse = cute.make_tensor(mLSE.iterator, cute.make_layout(
        (l_shape[0], l_shape[1], (l_shape[2], l_shape[3])),
        stride=(l_stride[0], l_stride[1], (l_stride[2], l_stride[3]))))
    return rows_by_token(mO), lse


def _fake_token_rows(dt, head_dim_v: int):
    """A (B, T, H, g, dv) out and a (B, H, g, T) lse, contiguous in their last mode."""
    i32, i64 = cute.sym_int32, cute.sym_int64
    out = cute.runtime.make_fake_tensor(dt, (i32(), i32(), i32(), i32(), head_dim_v),
                                        stride=(i64(divisibility=8), i64(divisibility=8), i64(divisibility=8),
                                                i64(divisibility=8), 1), assumed_align=16)
    lse = cute.runtime.make_fake_tensor(Float32, (i32(), i32(), i32(), i32()), stride=(i64(), i64(), i64(), 1),
                                        assumed_align=4)
    return out, lse


def compile_parts(dtype="bf16", head_dim_v: int = 128, *, launchable: bool = False,
                  token_rows: bool = False) -> Compiled:
    """PartsCombine for one dtype and dv (compile-time); launchable=True builds what `combine_parts`
    runs; token_rows: the build for rows packed by query token (see the class)."""
    dt = host_io.cutlass_dtype(dtype)
    key = (PARTS_STEP, "gpu" if launchable else "fake", str(dt), head_dim_v) + (("token_rows",) if token_rows else ())

    def build():  # only on a miss: the fake tensors cost ~35 us of host time per call (a decode step's)
        merged = _fake_token_rows(dt, head_dim_v) if token_rows else (host_io.fake_bshd(dt, head_dim_v),
                                                                      host_io.fake_lse())
        args = (host_io.fake_bshd(dt, head_dim_v), host_io.fake_lse(), *merged, Int32(1),
                host_io.launch_stream() if launchable else cute.runtime.make_fake_stream())
        return PartsCombine(dt, head_dim_v, token_rows), args
    return compile_cached(key, build)


def combine_parts(out_parts, lse_parts, parts: int, out=None, rows_per_query: int = 1):
    """out_parts (B * n, R, H, dv), lse_parts (H, B * n, R) fp32 (n = parts) -> merged out (B, R, H, dv)
    in out_parts' dtype and lse (B, H, R) fp32, by one kernel on the current stream. out: where the
    merged rows go (any strides with a unit last one: a view into the caller's final layout spares a
    copy); None allocates it. rows_per_query g > 1: row t g + j of head h is query token t of GQA head
    h g + j, and the result comes unpacked, out (B, R / g, H g, dv) and lse (B, H g, R / g)."""
    import torch

    bn, r, h, dv = out_parts.shape
    g = rows_per_query
    if isinstance(g, bool) or not isinstance(g, int) or g < 1 or r % g:
        raise ValueError(f"rows_per_query: expected an int >= 1 dividing the parts' {r} rows, got {g!r}")
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 1 or bn % parts:
        raise ValueError(f"parts: expected an int >= 1 dividing out_parts' {bn} rows of parts, got {parts!r}")
    # the kernel reads lse_parts[head, b * parts + j, row] unchecked: its shape is the bound
    if lse_parts.dtype != torch.float32 or tuple(lse_parts.shape) != (h, bn, r) \
            or lse_parts.device != out_parts.device:
        raise ValueError(f"lse_parts: expected float32 ({h}, {bn}, {r}) on {out_parts.device}, got "
                         f"{lse_parts.dtype} {tuple(lse_parts.shape)} on {lse_parts.device}")
    want = (bn // parts, r // g, h * g, dv) if g > 1 else (bn // parts, r, h, dv)
    if out is None:
        out = torch.empty(want, device=out_parts.device, dtype=out_parts.dtype)
    elif tuple(out.shape) != want or out.dtype != out_parts.dtype or out.device != out_parts.device \
            or out.stride(-1) != 1 \
            or any(st % 8 for st in out.stride()[:-1]) or out.data_ptr() % 16:
        raise ValueError(f"out: expected {out_parts.dtype} {want} on {out_parts.device} with a unit last stride, "
                         f"the others multiples of 8 and a 16-byte aligned start; got {out.dtype} "
                         f"{tuple(out.shape)} strides {out.stride()}")
    lse_shape = (bn // parts, h * g, r // g) if g > 1 else (bn // parts, h, r)
    lse = torch.empty(lse_shape, device=out_parts.device, dtype=torch.float32)
    return merge_launch(out_parts, lse_parts, parts, out, lse, g)


def merge_launch(out_parts, lse_parts, parts: int, out, lse, rows_per_query: int = 1):
    """combine_parts' launch, after its checks, into outputs the caller made (out and lse as
    combine_parts returns them). Nothing is checked -- each check is host time on every decode
    step -- so the caller's own construction must imply combine_parts' checks (fa4's split launch)."""
    dv = out_parts.shape[-1]
    dt = host_io.cutlass_dtype(out_parts.dtype)
    if rows_per_query > 1:
        h = out_parts.shape[2]
        comp = compile_parts(dt, dv, launchable=True, token_rows=True)
        comp.fn(out_parts, lse_parts, out.unflatten(2, (h, rows_per_query)), lse.unflatten(1, (h, rows_per_query)),
                parts)
        return out, lse
    compile_parts(dt, dv, launchable=True).fn(out_parts, lse_parts, out, lse, parts)
    return out, lse
