"""Stage 4, postprocess of the Hopper backward's fragment-order dQ accumulator (``dq_frag``): dQ = scale * dQaccum.

With ``dq_frag`` the main kernel's dQ writer adds each consumer warpgroup's share of a dQ tile into
dQaccum with one contiguous bulk reduce, so dQaccum holds every tile in the order the warpgroups'
threads hold their accumulator registers: in the tile of (batch, head, m_block), float
(i // 4) * 512 + t * 4 + i % 4 of share w is register i of thread t of warpgroup w. One CTA of 256
threads -- one per consumer thread of the main kernel -- reads a tile back with the same 16-byte
pattern (the main kernel's ``dq_frag_tiled_copy``), asks the main kernel's own dQ tiled MMA where each
register belongs (its partition of an identity tensor), scales and rounds it into an SMEM tile, and
writes the rows that exist with 16-byte stores. dQaccum is (B, H, rows, d) fp32 with rows =
num_m_blocks * tile_m (dense) or, varlen, a batch of one; the main kernel's ``dq_frag_tile_row`` says
where each tile starts. With first stores (``dq_first_store``, hopper/dq_writer.py) nobody zeroed
dQaccum: a tile whose arrival counter is 0 was reached by no K/V tile (e.g. causal rows above the
keys), and its rows are written as zeros. Everything it needs of the main kernel comes from the kernel
object passed in, so this module imports no kernel module.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.memory.smem import SmemAllocator

from stage4_bwd_kernel import common
from stage4_bwd_kernel import postprocess as post
from stage4_bwd_kernel.postprocess import block_rows
from stage4_bwd_kernel.preprocess import _dummy, _dummy_int32

STEP = "bwd_postprocess_frag"
NUM_THREADS = 256  # the main kernel's two consumer warpgroups
SMEM_PAD = 8  # elements per SMEM row: 16 bytes, so the 8 rows of a warp's 4-byte stores hit 8 bank groups


def store_threads_per_row(tile_m: int, head_dim: int, elems: int) -> int:
    """Threads per row of the 16-byte dq stores: a whole row if the 256 threads then cover a number of
    rows that divides tile_m (d = 128, tile_m = 80: 16 threads, 16 rows a pass), else a 64-byte chunk
    (d = 96). A pass must never reach past the tile: its SMEM rows end there."""
    for cols in (head_dim, 64, 32):
        tpr = cols // elems
        if head_dim % cols == 0 and NUM_THREADS % tpr == 0 and tile_m % (NUM_THREADS // tpr) == 0:
            return tpr
    raise ValueError(f"tiles: no 16-byte store layout of 256 threads covers a ({tile_m}, {head_dim}) dq tile")


class BackwardPostprocessFrag:
    def __init__(self, main_kernel, varlen: bool):
        # main_kernel: the kernel object that wrote dQaccum (tile_m, head_dim, dtype, its dQ MMA and copy)
        self.main = main_kernel
        self.dtype = main_kernel.dtype
        self.tile_m, self.head_dim = main_kernel.tile_m, main_kernel.head_dim
        self.varlen = varlen
        self.num_threads = NUM_THREADS
        store_threads_per_row(self.tile_m, self.head_dim, 128 // self.dtype.width)  # ValueError before any trace

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor, mDqArrivals: cute.Tensor,
                 softmax_scale: Float32, num_m_blocks: Int32, stream):
        # mdQacc (B, H, rows, d) fp32 -> mdQ (B, Sq, H, d) dtype; varlen: B = 1, rows of cu_seqlens_q;
        # mDqArrivals (B, H, rows / tile_m) int32 (first stores; else a stand-in, not read)
        if const_expr(mdQ.element_type != self.dtype):
            raise TypeError("dq must have the main kernel's dtype")
        mdQacc = common.assume_aligned(mdQacc, self.head_dim)
        mdQ = common.assume_aligned(mdQ, self.head_dim)
        tm, d = self.tile_m, self.head_dim
        sTile_layout = cute.make_layout((tm, d), stride=(d + SMEM_PAD, 1))
        elems = 128 // self.dtype.width
        threads_per_row = store_threads_per_row(tm, d, elems)
        store = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
            cute.make_ordered_layout((NUM_THREADS // threads_per_row, threads_per_row), order=(1, 0)),
            cute.make_layout((1, elems)))

        @cute.struct
        class SharedStorage:
            sTile: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sTile_layout)], 128]

        self.shared_storage = SharedStorage
        batch = mCuSeqlensQ.shape[0] - 1 if const_expr(self.varlen) else mdQ.shape[0]
        self.kernel(mdQacc, mdQ, mCuSeqlensQ, mDqArrivals, softmax_scale, self.main.make_tiled_mma_dQ(), store,
                    sTile_layout).launch(grid=(num_m_blocks, mdQ.shape[2], batch), block=[NUM_THREADS, 1, 1],
                                         smem=SharedStorage.size_in_bytes(), stream=stream, use_pdl=True)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor, mDqArrivals: cute.Tensor,
               softmax_scale: Float32, tiled_mma_dQ: cute.TiledMma, store: cute.TiledCopy, sTile_layout: cute.Layout):
        cute.arch.griddepcontrol_wait()  # a PDL launch: the main kernel's dQ adds and arrivals have all landed
        tm, d = self.tile_m, self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, bidx, batch, offset, rows_left = block_rows(mdQ, mCuSeqlensQ, tm, self.varlen)
        pad = 0
        if const_expr(self.main.q_shift):  # the main kernel's tiles start pad rows before query 0
            pad = self.main.top_padding(mdQ.shape[1])
            offset, rows_left = offset - pad, rows_left + pad
        if rows_left > 0:
            smem = SmemAllocator()
            sTile = smem.allocate(self.shared_storage).sTile.get_tensor(sTile_layout)   # (tm, d)
            # 1. this thread's registers of the tile, as the main kernel's thread tidx held them
            share_elems = self.main.dq_frag_share_elems()
            tile = self.main.dq_frag_tile(offset, batch, m_block)
            share_ptr = (common.elem_pointer(mdQacc, (bidx, head, tile * tm, 0))
                         + (tidx // 128) * share_elems)
            gShare = cute.make_tensor(share_ptr.align(16), cute.make_layout(share_elems))
            tGg = self.main.dq_frag_tiled_copy().get_slice(tidx % 128).partition_S(gShare)         # (4, chunks)
            rAcc = cute.make_rmem_tensor_like(tGg, Float32)
            if const_expr(self.main.dq_first_store):
                rAcc.fill(0.0)
                if mDqArrivals[bidx, head, tile] != 0:  # else no K/V tile added into it: dQ = 0
                    cute.autovec_copy(tGg, rAcc)
            else:
                cute.autovec_copy(tGg, rAcc)
            # 2. where each belongs: the dQ MMA's partition of (row, col) -- (col, row) for dQ^T
            dq_shape = (d, tm) if const_expr(self.main.dq_swap_ab) else (tm, d)
            coords = tiled_mma_dQ.get_slice(tidx).partition_C(cute.make_identity_tensor(dq_shape))
            for i in cutlass.range_constexpr(cute.size(rAcc)):
                r, c = coords[i][0], coords[i][1]
                if const_expr(self.main.dq_swap_ab):
                    r, c = c, r
                sTile[r, c] = (rAcc[i] * softmax_scale).to(self.dtype)
            cute.arch.sync_threads()
            # 3. the rows that exist -> dq, 16-byte stores
            gdQ = cute.local_tile(cute.domain_offset((offset, 0), mdQ[bidx, None, head, None]), (tm, d), (m_block, 0))
            thr = store.get_slice(tidx)
            tSs, tSg = thr.partition_S(sTile), thr.partition_D(gdQ)
            tSc = thr.partition_S(cute.make_identity_tensor((tm, d)))
            tSr = cute.make_rmem_tensor_like(tSs, self.dtype)
            cute.autovec_copy(tSs, tSr)
            for m in cutlass.range_constexpr(cute.size(tSg.shape[1])):
                row_exists = tSc[0, m, 0][0] < rows_left
                if const_expr(self.main.q_shift):
                    row_exists = row_exists & (tSc[0, m, 0][0] + m_block * tm >= pad)
                if row_exists:
                    cute.copy(store, tSr[None, m, None], tSg[None, m, None])


# ------------------------------------------------------------------------------------------------
# Host side
# ------------------------------------------------------------------------------------------------
def _fake_args(dt, head_dim, *, launchable: bool = False):
    """postprocess.py's launch arguments with the arrival counters after cu_seqlens_q."""
    args = post._fake_args(dt, head_dim, launchable=launchable)
    return args[:3] + (common.fake_tensor(Int32, 3, align=4),) + args[3:]


def _compile(launchable: bool, main_kernel, varlen: bool) -> common.Compiled:
    mk = main_kernel
    key = (STEP, "gpu" if launchable else "fake", str(mk.dtype), mk.tile_m, mk.head_dim, mk.dq_split_m,
           mk.dq_swap_ab, varlen, mk.q_shift) + (("first-store",) if mk.dq_first_store else ())
    return common.compile_cached(key, lambda: (BackwardPostprocessFrag(mk, varlen),
                                               _fake_args(mk.dtype, mk.head_dim, launchable=launchable)))


def compile_only(main_kernel, varlen=False) -> common.Compiled:
    """Compile for sm_90a with fake tensors (no GPU needed)."""
    return _compile(False, main_kernel, bool(varlen))


def compile_launchable(main_kernel, varlen=False) -> common.Compiled:
    """What ``postprocess`` launches for this main kernel (TVM-FFI, the GPU path's cache key)."""
    return _compile(True, main_kernel, bool(varlen))


def postprocess(main_kernel, dq_accum, dq, softmax_scale: float, *, cu_seqlens_q=None, max_seqlen_q=None,
                arrivals=None):
    """(GPU) dq = softmax_scale * (dq_accum put back in place), in dq's dtype; dq (B, Sq, H, d) or
    varlen (T, H, d); dq_accum (B, H, rows, d) fp32 with the main kernel's ``dq_frag_accum_rows`` (varlen: B = 1);
    arrivals: the main kernel's (B, H, rows / tile_m) int32 arrival counters, required with its first stores."""
    varlen = cu_seqlens_q is not None
    if varlen:
        dq4, cu, rows, batch = dq.unsqueeze(0), cu_seqlens_q, max_seqlen_q, cu_seqlens_q.shape[0] - 1
    else:
        dq4, cu, rows, batch = dq, _dummy_int32(dq.device), dq.shape[1], dq.shape[0]
    if batch == 0 or rows == 0 or dq.shape[-2] == 0:
        return dq
    if main_kernel.dq_first_store and arrivals is None:
        raise ValueError("arrivals: required for a main kernel with first stores (dq_first_store)")
    if arrivals is None:
        arrivals = _dummy(dq.device, (1, 1, 1), "int32")
    comp = _compile(True, main_kernel, varlen)
    comp.fn(dq_accum, common.launch_view(dq4), cu, arrivals, softmax_scale, common.cdiv(rows, main_kernel.tile_m))
    return dq
