"""Stage 4, postprocess: dQ = softmax_scale * dQ_accum, converted from fp32 to the input dtype.

The main kernel adds every K/V tile's dS K into an fp32 buffer in global memory (rounding each
partial sum to bf16 would lose ~8 bits per add); this pass reads that buffer once and writes dQ.
softmax_scale is applied here, once per element, instead of on every partial product (S = scale *
Q K^T, so dQ = scale * dS K). One CTA of 128 threads converts a 64 x d tile: 16-byte fp32 loads
(4 elements), 8-byte bf16 stores, the same thread-value layout for both so element i of the load
fragment is element i of the store fragment. Bandwidth: 6 bytes per element, e.g. (2, 8k, 16, 128)
-> 200 MB -> ~60 us at 3.35 TB/s.

dK/dV need no postprocess in this stage: a CTA owns one K/V tile of one KV head and accumulates
every query head of its GQA group itself (see hopper_step1.py), so it writes them directly.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from stage4_bwd_kernel import common
from stage4_bwd_kernel.preprocess import _dummy_int32

STEP = "bwd_postprocess"
TILE_M = 64
NUM_THREADS = 128


def _tiled_copy(dtype, cols: int, elems: int, num_threads: int):
    """`elems` contiguous elements per thread per copy; 8 threads per 32-element row chunk."""
    threads_per_row = 8 if cols % 32 == 0 else 4
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=elems * dtype.width)
    thr = cute.make_ordered_layout((num_threads // threads_per_row, threads_per_row), order=(1, 0))
    return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))


@cute.jit
def block_rows(mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor, tile_m: cutlass.Constexpr[int], varlen: cutlass.Constexpr[bool]):
    """This CTA's tile -> (m_block, head, batch index into mdQ, batch, first row of the sequence,
    rows of the sequence from the tile's first on): dense (batch b, rows [0, Sq)), varlen (batch
    0, rows [cu[b], cu[b+1]))."""
    m_block, head, batch = cute.arch.block_idx()
    bidx = batch
    offset = Int32(0)
    seqlen = mdQ.shape[1]
    if const_expr(varlen):
        bidx = 0
        offset = mCuSeqlensQ[batch]
        seqlen = mCuSeqlensQ[batch + 1] - offset
    return m_block, head, bidx, batch, offset, seqlen - m_block * tile_m


class BackwardPostprocess:
    def __init__(self, dtype, head_dim: int, varlen: bool):
        self.dtype = dtype
        self.head_dim = head_dim
        self.varlen = varlen
        self.num_threads = NUM_THREADS
        self.smem_bytes = 0

    @cute.jit
    def __call__(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor,
                 softmax_scale: Float32, num_m_blocks: Int32, stream):
        # mdQacc (B, Sq, H, d) fp32 -> mdQ (B, Sq, H, d) dtype; varlen: B = 1, rows of cu_seqlens_q
        if const_expr(mdQ.element_type != self.dtype):
            raise TypeError("dq must have the kernel's dtype")
        mdQacc = common.assume_aligned(mdQacc, self.head_dim)
        mdQ = common.assume_aligned(mdQ, self.head_dim)
        load = _tiled_copy(Float32, self.head_dim, 4, self.num_threads)     # 16-byte loads
        store = _tiled_copy(self.dtype, self.head_dim, 4, self.num_threads)  # 8-byte stores
        batch = mCuSeqlensQ.shape[0] - 1 if const_expr(self.varlen) else mdQ.shape[0]
        self.kernel(mdQacc, mdQ, mCuSeqlensQ, softmax_scale, load, store).launch(
            grid=(num_m_blocks, mdQ.shape[2], batch), block=[self.num_threads, 1, 1], stream=stream,
            use_pdl=True)

    @cute.kernel
    def kernel(self, mdQacc: cute.Tensor, mdQ: cute.Tensor, mCuSeqlensQ: cute.Tensor,
               softmax_scale: Float32, load: cute.TiledCopy, store: cute.TiledCopy):
        cute.arch.griddepcontrol_wait()  # a PDL launch: the main kernel's dQ adds have all landed
        tm, d = TILE_M, self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, bidx, _, offset, rows_left = block_rows(mdQ, mCuSeqlensQ, tm, self.varlen)
        if rows_left > 0:
            gAcc = cute.local_tile(cute.domain_offset((offset, 0), mdQacc[bidx, None, head, None]), (tm, d), (m_block, 0))
            gdQ = cute.local_tile(cute.domain_offset((offset, 0), mdQ[bidx, None, head, None]), (tm, d), (m_block, 0))
            thr_load, thr_store = load.get_slice(tidx), store.get_slice(tidx)
            tAgAcc = thr_load.partition_S(gAcc)
            tAgdQ = thr_store.partition_D(gdQ)
            tAcA = thr_load.partition_S(cute.make_identity_tensor((tm, d)))
            rAcc = cute.make_rmem_tensor_like(tAgAcc, Float32)
            rAcc.fill(0.0)
            # 1. load the fp32 rows that exist
            for m in cutlass.range_constexpr(cute.size(tAgAcc.shape[1])):
                if tAcA[0, m, 0][0] < rows_left:
                    cute.copy(load, tAgAcc[None, m, None], rAcc[None, m, None])
            # 2. scale, round to the input dtype, store
            rdQ = cute.make_rmem_tensor_like(tAgdQ, self.dtype)
            rdQ.store((rAcc.load() * softmax_scale).to(self.dtype))
            for m in cutlass.range_constexpr(cute.size(tAgdQ.shape[1])):
                if tAcA[0, m, 0][0] < rows_left:
                    cute.copy(store, rdQ[None, m, None], tAgdQ[None, m, None])


def _fake_args(dt, head_dim, *, launchable: bool = False):
    F = common.fake_tensor
    return (F(Float32, 4, head_dim), F(dt, 4, head_dim), F(Int32, 1, align=4), Float32(1.0), Int32(1),
            common.launch_stream() if launchable else common.fake_stream())


def compile_only(dtype="bf16", head_dim=128, varlen=False, *, launchable=False) -> common.Compiled:
    """Compile for sm_90a with fake tensors (no GPU needed); launchable=True builds what
    ``postprocess`` launches (TVM-FFI, the same cache key)."""
    return _compile(launchable, common.cutlass_dtype(dtype), head_dim, bool(varlen))


def _compile(launchable: bool, dt, d: int, varlen: bool) -> common.Compiled:
    key = (STEP, "gpu" if launchable else "fake", str(dt), d, varlen)
    return common.compile_cached(key, lambda: (BackwardPostprocess(dt, d, varlen),
                                               _fake_args(dt, d, launchable=launchable)))


def postprocess_args(dq_accum4, dq4, cu_seqlens_q, softmax_scale, num_m_blocks):
    """Launch arguments from (batch-of-one views of) torch tensors, in ``__call__`` order without
    the stream (TVM-FFI, see common.launch_stream)."""
    return (dq_accum4, common.launch_view(dq4), cu_seqlens_q, softmax_scale, num_m_blocks)


def postprocess(dq_accum, dq, softmax_scale: float, *, cu_seqlens_q=None, max_seqlen_q=None):
    """(GPU) dq[...] = (softmax_scale * dq_accum).to(dq.dtype); shapes (B, Sq, H, d) or varlen (T, H, d)."""
    varlen = cu_seqlens_q is not None
    if varlen:
        acc4, dq4, cu, rows, batch = dq_accum.unsqueeze(0), dq.unsqueeze(0), cu_seqlens_q, max_seqlen_q, cu_seqlens_q.shape[0] - 1
    else:
        acc4, dq4, cu, rows, batch = dq_accum, dq, _dummy_int32(dq.device), dq.shape[1], dq.shape[0]
    if batch == 0 or rows == 0 or dq.shape[-2] == 0:
        return dq
    comp = _compile(True, common.cutlass_dtype(dq.dtype), dq.shape[-1], varlen)
    comp.fn(*postprocess_args(acc4, dq4, cu, softmax_scale, common.cdiv(rows, TILE_M)))
    return dq


def run(batch=2, seqlen=1024, heads=8, head_dim=128, dtype="bf16", check=True, verbose=True):
    """GPU: check against torch and time; no GPU: compile + resource report."""
    if not common.hopper_gpu_available():
        comp = compile_only(dtype, head_dim)
        if verbose:
            print(common.format_report(f"{STEP} [{common.ARCH}, {dtype}, d={head_dim}] (compiled only)", comp.report))
        return {"step": STEP, "mode": "compile-only", "report": comp.report}
    import torch

    tdt = common.torch_dtype(dtype)
    acc = torch.randn(batch, seqlen, heads, head_dim, device="cuda")
    dq = torch.full(acc.shape, float("nan"), device="cuda", dtype=tdt)
    postprocess(acc, dq, 0.125)
    torch.cuda.synchronize()
    if check:
        assert torch.equal(dq, (acc * 0.125).to(tdt))
    ms = common.benchmark_ms(lambda: postprocess(acc, dq, 0.125))
    gbs = acc.numel() * (4 + dq.element_size()) / (ms * 1e-3) / 1e9
    if verbose:
        print(f"{'PASS' if check else '(unchecked)'} {STEP} b={batch} s={seqlen} h={heads} d={head_dim} {dtype}: "
              f"{ms * 1e3:.1f} us, {gbs:.0f} GB/s")
    return {"step": STEP, "mode": "gpu", "ms": ms, "GB/s": gbs}


if __name__ == "__main__":
    run()
