"""The page gather: a paged KV cache copied into the dense (batch, pages * page_size, H, D) form.

Where the forward does not read a paged cache in place (fa4/_paged.py: long queries over page sizes
TMA cannot read, many query rows a key over pages of 16), each eager call with nothing that needs a
gradient first copies every sequence's pages into a dense K and V with this kernel (autograd keeps
torch's indexing, fa4/_layouts.gather_kv_pages). That copy is pure bandwidth: at a 32k-token prefill, GQA 32 / 8, d = 128,
bf16, K and V are 64 MiB each, read once and written once (256 MiB of traffic), against a 1.85 ms
attention call on an H200.

Why a kernel of its own: torch's `cache[pages]` indexing computes an offset per element and moved
those bytes at about 2.7 TB/s on an H200, where a device copy reaches about 4 TB/s. A page, though,
is one contiguous run of page_size * H * D elements (32 KB at page 16, 8 heads, d = 128, bf16), so the
gather is a list of contiguous copies. Here each CTA copies a 16 KB share of the destination, 1024
consecutive 16-byte words of K or V (grid z) whatever pages they fall in: 128 threads, each issuing 8
independent 16-byte loads before its 8 stores, so that a full SM keeps ~256 KB of loads in flight,
enough to cover HBM latency. The bytes are moved as int32
words, so one build serves every cache dtype.

The page table comes as the caller's (batch, pages) int32 and entries are clamped to a valid page in
the kernel (a server pads its tables with anything; those rows are never read by the attention call).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.memory.smem import SmemAllocator

from stage3_fwd_kernel import host_io
from stage3_fwd_kernel.compile_cache import Compiled, compile_cached
from stage3_fwd_kernel.intdiv import FAST_DIV_MAX, fast_div

STEP = "page_gather"
NUM_THREADS = 128
WORDS_PER_THREAD = 8  # 16-byte words a thread loads before it stores any
WORDS_PER_CTA = NUM_THREADS * WORDS_PER_THREAD
MAX_PAGE_WORDS = FAST_DIV_MAX - WORDS_PER_CTA  # copy_share's row arithmetic is exact below (64 MiB pages)


class PageGather:
    """K and V pages (num_pages, words, 4) int32 -> dense rows, flat (batch * pages * words, 4) int32:
    row b * pages + p holds page table[b * pages + p] (clamped to [0, num_pages)). Each CTA copies
    WORDS_PER_CTA consecutive destination words of K or V (grid z), whatever rows they fall in, so
    pages of any size keep every thread busy (a 2 KB page of one row at page 1 included)."""

    @cute.jit
    def __call__(self, mSrcK: cute.Tensor, mDstK: cute.Tensor, mSrcV: cute.Tensor, mDstV: cute.Tensor,
                 mTable: cute.Tensor, stream):
        words = cutlass.max(mDstK.shape[0], mDstV.shape[0])
        self.kernel(mSrcK, mDstK, mSrcV, mDstV, mTable).launch(
            grid=((words + WORDS_PER_CTA - 1) // WORDS_PER_CTA, 1, 2), block=[NUM_THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mSrcK: cute.Tensor, mDstK: cute.Tensor, mSrcV: cute.Tensor, mDstV: cute.Tensor,
               mTable: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        share, _, which = cute.arch.block_idx()
        sPages = SmemAllocator().allocate_tensor(Int32, cute.make_layout(WORDS_PER_CTA + 2), byte_alignment=16)
        if which == 0:
            copy_share(mSrcK, mDstK, mTable, sPages, share * WORDS_PER_CTA, tidx)
        else:
            copy_share(mSrcV, mDstV, mTable, sPages, share * WORDS_PER_CTA, tidx)


@cute.jit
def copy_share(mSrc: cute.Tensor, mDst: cute.Tensor, mTable: cute.Tensor, sPages: cute.Tensor, start: Int32,
               tidx: Int32):
    """Destination words start + tidx + i * NUM_THREADS (i < WORDS_PER_THREAD, those that exist) from
    their pages, every load before any store. The share's rows (at most WORDS_PER_CTA + 2) get their
    pages from the table once, into shared memory, so a data load waits on no global read. One true
    division a thread (the share's first row); the rest are fast_div, exact below 2**22 (a share
    spans WORDS_PER_CTA words past its first row's start, a page at most MAX_PAGE_WORDS)."""
    words, total, last_page = mSrc.shape[1], mDst.shape[0], mSrc.shape[0] - 1
    first_row = start // words
    last_row = cutlass.min(first_row + fast_div(start + WORDS_PER_CTA - 1 - first_row * words, words),
                           mTable.shape[0] - 1)
    for r in cutlass.range(first_row + tidx, last_row + 1, NUM_THREADS):
        sPages[r - first_row] = cutlass.min(cutlass.max(mTable[r], Int32(0)), last_page)
    cute.arch.sync_threads()
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Int32, num_bits_per_copy=128)
    buf = cute.make_rmem_tensor(cute.make_layout((4, WORDS_PER_THREAD)), Int32)
    for i in cutlass.range_constexpr(WORDS_PER_THREAD):
        w = start + tidx + i * NUM_THREADS
        if w < total:
            row = fast_div(w - first_row * words, words)  # within the share
            cute.copy(atom, mSrc[sPages[row], w - (first_row + row) * words, None], buf[None, i])
    for i in cutlass.range_constexpr(WORDS_PER_THREAD):
        w = start + tidx + i * NUM_THREADS
        if w < total:
            cute.copy(atom, buf[None, i], mDst[w, None])


def _fake_pages():
    """(num_pages, words, 4) int32: a page's 16-byte words, pages of runtime stride (a multiple of 4)."""
    i32, i64 = cute.sym_int32, cute.sym_int64
    return cute.runtime.make_fake_tensor(Int32, (i32(), i32(), 4), stride=(i64(divisibility=4), 4, 1),
                                         assumed_align=16)


def _fake_flat():
    """(words, 4) int32, contiguous: the dense copy as 16-byte words."""
    return cute.runtime.make_fake_tensor(Int32, (cute.sym_int32(), 4), stride=(4, 1), assumed_align=16)


def compile_gather(*, launchable: bool = False) -> Compiled:
    """PageGather (one build for every dtype and shape); launchable=True builds what `gather_pages`
    runs."""
    key = (STEP, "gpu" if launchable else "fake")

    def build():
        stream = host_io.launch_stream() if launchable else cute.runtime.make_fake_stream()
        args = (_fake_pages(), _fake_flat(), _fake_pages(), _fake_flat(), host_io.fake_i32_vector(), stream)
        return PageGather(), args
    return compile_cached(key, build)


def words_view(t, rows: int):
    """A contiguous tensor of `rows` rows (pages) as (rows, words, 4) int32, or None where its rows
    are not whole 16-byte words at a 16-byte aligned start, or are too long for copy_share."""
    import torch

    row_bytes = t.numel() * t.element_size() // max(rows, 1)
    if rows == 0 or not t.is_contiguous() or t.data_ptr() % 16 or row_bytes * rows != t.numel() * t.element_size() \
            or row_bytes % 16 or row_bytes // 16 > MAX_PAGE_WORDS:
        return None
    return t.view(rows, -1).view(torch.int32).view(rows, -1, 4)


def gather_pages(k_cache, v_cache, block_table):
    """(k, v): dense (B, P * page_size, H, D) copies of a paged cache (num_pages, page_size, H, D) for
    block_table (B, P) int32, by one kernel on the current stream; None where the caches are not
    contiguous 16-byte words or the copy has 2**31 - 1024 words or more (the caller falls back to torch
    indexing)."""
    import torch

    b, p = block_table.shape
    n = k_cache.shape[0]
    if block_table.dtype != torch.int32 or v_cache.shape[0] != n or n == 0:
        return None
    k = torch.empty(b, p * k_cache.shape[1], *k_cache.shape[2:], dtype=k_cache.dtype, device=k_cache.device)
    v = torch.empty(b, p * v_cache.shape[1], *v_cache.shape[2:], dtype=v_cache.dtype, device=v_cache.device)
    if b * p == 0:
        return k, v
    src_k, src_v = words_view(k_cache, n), words_view(v_cache, n)
    # a thread's word index (start + tidx + 128 i) stays below 2**31
    if src_k is None or src_v is None or \
            max(k.numel() * k.element_size(), v.numel() * v.element_size()) >= (16 << 31) - 16 * WORDS_PER_CTA:
        return None
    compile_gather(launchable=True).fn(src_k, k.view(-1).view(torch.int32).view(-1, 4), src_v,
                                       v.view(-1).view(torch.int32).view(-1, 4), block_table.reshape(-1))
    return k, v
