"""Stage 5, device half: the varlen preprocessing kernel (the paper's "sort batches by their
longest tile") and ``VarlenSchedule``, which caches its output per batch layout.

Compared with ``orders.varlen_metadata`` (its CPU oracle), this computes the same four int32
arrays **on the GPU, from the cu_seqlens already there**, because copying them to the host to
sort would cost a device sync per forward. The paper notes the metadata "can be cached and thus
results in no performance loss": a model builds one ``VarlenSchedule`` per batch layout and
passes it to every layer (``VarlenSchedule.cached`` does that keyed on the cu_seqlens tensor).

The kernel: one CTA of ``num_threads`` threads (1024), any batch count.

    1. per batch b:  seq_q, seq_k (seqused_k[b] when given)
                     num_m_blocks[b]  = ceil(seq_q / tile_m)
                     max_tile_work[b] = K/V blocks of its last Q block (0 when seq_q = 0)
    2. the stable descending sort as a rank count, O(B^2 / threads) comparisons per thread:
                     rank(b) = #{b' : w[b'] > w[b]  or  (w[b'] == w[b] and b' < b)}
       and, in the same pass, the tiles of everything ranked before b:
                     before(b) = sum of num_m_blocks[b'] over those b'
    3. batch_map[rank(b)] = b,   cu_tiles[rank(b)] = H * before(b),   cu_tiles[B] = H * sum(num_m_blocks)

Step 2 works through the batches in chunks of ``num_threads``: each thread recomputes one
batch's (num_m_blocks, work) from cu_seqlens into shared memory, a barrier, then every thread
compares its own batch against the chunk (shared-memory broadcast reads). Fusing the prefix sum
into the rank count means no scan and no global read-back of what the kernel wrote. Cost: for
B = 1024 each thread does 1024 compare-and-adds (~a few microseconds); B = 4096 is 16x that,
still one launch that a model pays once per batch layout.

Why the longest tile is the last Q block: under a bottom-right causal mask the last query row
sees every key, so ``max_tile_work[b] = ceil(seq_k / tile_n)`` whenever ``seq_q > 0``; the kernel
still evaluates the general ``kv_blocks_visited`` bound, so it stays equal to the oracle if the
mask convention ever changes.
"""
from __future__ import annotations

import weakref
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass.memory.smem import SmemAllocator

from stage3_fwd_kernel import compile_cache, host_io, runner, sass_report
from stage5_scheduling import orders
from stage5_scheduling.device import LPTCausalScheduler, VarlenLPTScheduler

__all__ = ["longest_tile_work", "ranked_ahead", "VarlenMetadataKernel", "compile_metadata", "varlen_metadata_device",
           "VarlenSchedule"]

NUM_THREADS = 1024


def longest_tile_work(m_blocks, seq_q, seq_k, tile_m: int, tile_n: int, causal: bool, imin=min, imax=max):
    """K/V blocks visited by the last of ``m_blocks >= 1`` Q blocks (``orders.kv_blocks_visited(m - 1)``);
    an empty sequence (``m_blocks == 0``) has work 0, which the caller decides. For ints (tests)
    and DSL Int32 (the kernel)."""
    if causal:
        row_end = imin(m_blocks * tile_m, seq_q)                     # rows of the last Q block end here
        keys = imin(imax(row_end + seq_k - seq_q, 0), seq_k)         # keys its last row sees
    else:
        keys = seq_k
    return (keys + tile_n - 1) // tile_n


def ranked_ahead(other_work, my_work, other, me, sort: bool):
    """Whether batch `other` comes before batch `me` in the virtual order: longest tile work
    descending, ties in batch order (a stable sort); unsorted, batch order. Traced Int32 in the
    kernel, ints or NumPy arrays in the tests (the same expression)."""
    if not sort:
        return other < me
    return (other_work > my_work) | ((other_work == my_work) & (other < me))


class VarlenMetadataKernel:
    """The preprocessing kernel. Compile-time: tile sizes, causal, sort on/off, seqused_k present."""

    def __init__(self, tile_m: int, tile_n: int, causal: bool, sort: bool = True, num_threads: int = NUM_THREADS):
        self.tile_m, self.tile_n, self.causal, self.sort = tile_m, tile_n, bool(causal), bool(sort)
        self.num_threads = num_threads

    @cute.jit
    def __call__(self, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK: Optional[cute.Tensor],
                 mNumMBlocks: cute.Tensor, mMaxTileWork: cute.Tensor, mBatchMap: cute.Tensor,
                 mCuTiles: cute.Tensor, num_heads: Int32, stream):
        # mCuSeqlensQ / mCuSeqlensK / mCuTiles (B + 1,); mSeqUsedK, mNumMBlocks, mMaxTileWork, mBatchMap (B,)
        self.kernel(mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mNumMBlocks, mMaxTileWork, mBatchMap, mCuTiles,
                    num_heads).launch(grid=(1, 1, 1), block=[self.num_threads, 1, 1], stream=stream)

    @cute.jit
    def batch_work(self, b: Int32, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor,
                   mSeqUsedK: Optional[cute.Tensor]):
        """(num_m_blocks, max_tile_work) of batch b, from the inputs only."""
        seq_q = mCuSeqlensQ[b + 1] - mCuSeqlensQ[b]
        if const_expr(mSeqUsedK is not None):
            seq_k = mSeqUsedK[b]
        else:
            seq_k = mCuSeqlensK[b + 1] - mCuSeqlensK[b]
        m_blocks = (seq_q + self.tile_m - 1) // self.tile_m
        work = Int32(0)
        if m_blocks > 0:
            work = longest_tile_work(m_blocks, seq_q, seq_k, self.tile_m, self.tile_n, self.causal,
                                     imin=cutlass.min, imax=cutlass.max)
        return m_blocks, work

    @cute.kernel
    def kernel(self, mCuSeqlensQ: cute.Tensor, mCuSeqlensK: cute.Tensor, mSeqUsedK: Optional[cute.Tensor],
               mNumMBlocks: cute.Tensor, mMaxTileWork: cute.Tensor, mBatchMap: cute.Tensor,
               mCuTiles: cute.Tensor, num_heads: Int32):
        nt = self.num_threads
        tidx, _, _ = cute.arch.thread_idx()
        num_batch = mCuSeqlensQ.shape[0] - 1

        smem = SmemAllocator()
        sBlocks = smem.allocate_tensor(Int32, cute.make_layout(nt), byte_alignment=16)
        sWork = smem.allocate_tensor(Int32, cute.make_layout(nt), byte_alignment=16)

        if tidx == 0:
            mCuTiles[0] = Int32(0)  # also the whole answer when B = 0
        # every thread runs the same number of outer iterations (the barriers inside need all)
        for base in cutlass.range(0, num_batch, nt, unroll=1):
            b = base + tidx
            my_blocks, my_work = Int32(0), Int32(0)
            if b < num_batch:
                my_blocks, my_work = self.batch_work(b, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
            rank = Int32(0)
            before = Int32(0)  # Q blocks of the batches ranked before b
            # 1. compare against every batch, one chunk of nt at a time
            for cbase in cutlass.range(0, num_batch, nt, unroll=1):
                cute.arch.sync_threads()  # the previous chunk has been read by everyone
                j = cbase + tidx
                if j < num_batch:
                    jb, jw = self.batch_work(j, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
                    sBlocks[tidx] = jb
                    sWork[tidx] = jw
                cute.arch.sync_threads()
                for i in cutlass.range(cutlass.min(nt, num_batch - cbase), unroll=4):
                    other = cbase + i
                    ahead = ranked_ahead(sWork[i], my_work, other, b, self.sort)
                    if ahead:
                        rank += 1
                        before += sBlocks[i]
            # 2. scatter: this batch's place in the virtual order, and where its tiles start
            if b < num_batch:
                mNumMBlocks[b] = my_blocks
                mMaxTileWork[b] = my_work
                mBatchMap[rank] = b
                mCuTiles[rank] = before * num_heads
                if rank == num_batch - 1:
                    mCuTiles[num_batch] = (before + my_blocks) * num_heads


# --------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------
def _fake_args(has_seqused_k: bool, *, launchable: bool = False):
    i32 = host_io.fake_i32_vector
    return (i32(), i32(), i32() if has_seqused_k else None, i32(), i32(), i32(), i32(), Int32(1),
            host_io.launch_stream() if launchable else cute.runtime.make_fake_stream())


def compile_metadata(tile_m: int = 128, tile_n: int = 128, causal: bool = True, sort: bool = True,
                     has_seqused_k: bool = False, launchable: bool = False) -> compile_cache.Compiled:
    """Compile the preprocessing kernel for sm_90a (no GPU needed); launchable=True compiles the
    one `varlen_metadata_device` runs (TVM-FFI: it takes the torch tensors as they are)."""
    mode = "gpu" if launchable else "fake"
    key = ("stage5_varlen_metadata", mode, tile_m, tile_n, bool(causal), bool(sort), bool(has_seqused_k))
    kernel = VarlenMetadataKernel(tile_m, tile_n, causal, sort)
    return compile_cache.compile_cached(key, lambda: (kernel, _fake_args(has_seqused_k, launchable=launchable)))


def _check_inputs(cu_seqlens_q, cu_seqlens_k, seqused_k, num_heads):
    import torch

    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1 or t.shape[0] < 1:
            raise TypeError(f"{name}: expected an int32 tensor of shape (batch + 1,)")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k: expected shape {tuple(cu_seqlens_q.shape)}, got {tuple(cu_seqlens_k.shape)}")
    if seqused_k is not None and (not isinstance(seqused_k, torch.Tensor) or seqused_k.dtype != torch.int32
                                  or tuple(seqused_k.shape) != (cu_seqlens_q.shape[0] - 1,)):
        raise TypeError(f"seqused_k: expected an int32 tensor of shape ({cu_seqlens_q.shape[0] - 1},)")
    if not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads: expected an int >= 1, got {num_heads!r}")


def varlen_metadata_device(cu_seqlens_q, cu_seqlens_k, num_heads: int, *, tile_m: int = 128, tile_n: int = 128,
                           causal: bool = True, seqused_k=None, sort: bool = True) -> dict:
    """The four metadata arrays as int32 torch tensors on the inputs' device:
    ``batch_map`` (B,), ``num_m_blocks`` (B,), ``cu_tiles`` (B + 1,), ``max_tile_work`` (B,).

    CUDA inputs: one launch of the preprocessing kernel, no host sync. CPU inputs: the oracle
    ``orders.varlen_metadata`` (seqused_k enters as the key lengths), so the same call works in
    CPU tests.
    """
    import torch

    _check_inputs(cu_seqlens_q, cu_seqlens_k, seqused_k, num_heads)
    B = cu_seqlens_q.shape[0] - 1
    dev = cu_seqlens_q.device
    if not cu_seqlens_q.is_cuda:
        cu_k = cu_seqlens_k
        if seqused_k is not None:
            cu_k = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(seqused_k.long(), 0)])
        meta = orders.varlen_metadata(cu_seqlens_q.numpy(), cu_k.numpy(), num_heads, tile_m, tile_n, causal,
                                      sort=sort)
        return {"batch_map": torch.from_numpy(meta.batch_map), "num_m_blocks": torch.from_numpy(meta.num_m_blocks),
                "cu_tiles": torch.from_numpy(meta.cu_tiles), "max_tile_work": torch.from_numpy(meta.max_tile_work)}
    out = {"batch_map": torch.empty(B, dtype=torch.int32, device=dev),
           "num_m_blocks": torch.empty(B, dtype=torch.int32, device=dev),
           "cu_tiles": torch.empty(B + 1, dtype=torch.int32, device=dev),
           "max_tile_work": torch.empty(B, dtype=torch.int32, device=dev)}
    # a zero-length tensor cannot be handed over through dlpack everywhere: B = 0 is answered here
    if B == 0:
        out["cu_tiles"].zero_()
        return out
    used = None if seqused_k is None else seqused_k.contiguous()
    compile_metadata(tile_m, tile_n, causal, sort, seqused_k is not None, launchable=True).fn(
        cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), used, out["num_m_blocks"], out["max_tile_work"],
        out["batch_map"], out["cu_tiles"], num_heads)
    return out


class VarlenSchedule:
    """The varlen LPT metadata of one batch layout, computed once on the device and reused.

        sched = VarlenSchedule(cu_seqlens_q, cu_seqlens_k, num_heads=16, max_seqlen_k=16384)
        out, lse = hopper.attention_varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal=True,
                                                   **sched.step4_kwargs())

    ``step4_kwargs()`` = ``batch_map`` + an ``LPTCausalScheduler`` for the Hopper forward's padded grid (the
    real tiles then run in ``orders.lpt_varlen`` order). ``tile_m`` should be the kernel's
    (``stage3_fwd_kernel.hopper.default_tile_m(d, dv, causal=True)``: 192 at d = 64); another value still gives correct results,
    only a sort by the wrong tile sizes. ``varlen_scheduler`` is the compact-grid
    ``VarlenLPTScheduler`` for a kernel that passes ``cu_tiles`` to its scheduler.
    ``heads_per_section`` defaults to ``orders.heads_per_section`` (power of two, whole KV
    groups) at ``max_seqlen_k`` when that is given, else 1.
    """

    _cache: dict = {}  # id(cu_seqlens_q) -> (weak refs to the three tensors, versions + options, schedule)

    def __init__(self, cu_seqlens_q, cu_seqlens_k, num_heads: int, *, heads_kv: Optional[int] = None,
                 max_seqlen_k: Optional[int] = None, head_dim: int = 128, head_dim_v: Optional[int] = None,
                 tile_m: int = 128, tile_n: int = 128, causal: bool = True, seqused_k=None, sort: bool = True,
                 heads_per_section: Optional[int] = None):
        heads_kv = num_heads if heads_kv is None else heads_kv
        if heads_kv < 1 or num_heads % heads_kv:
            raise ValueError(f"heads: heads_q ({num_heads}) must be a multiple of heads_kv ({heads_kv})")
        group = num_heads // heads_kv
        if heads_per_section is None:
            if max_seqlen_k is None:
                heads_per_section = group
            else:
                heads_per_section = orders.heads_per_section(orders.H100_L2_BYTES, max_seqlen_k, head_dim, 2, group,
                                                             head_dim_v, power_of_two=True)
        heads_per_section = min(heads_per_section, num_heads)
        orders._check_groups(num_heads, heads_kv, heads_per_section)
        self.num_heads, self.heads_kv, self.tile_m, self.tile_n = num_heads, heads_kv, tile_m, tile_n
        self.causal, self.sort, self.heads_per_section = bool(causal), bool(sort), heads_per_section
        arrays = varlen_metadata_device(cu_seqlens_q, cu_seqlens_k, num_heads, tile_m=tile_m, tile_n=tile_n,
                                        causal=causal, seqused_k=seqused_k, sort=sort)
        self.batch_map = arrays["batch_map"]          # (B,)   virtual -> actual batch
        self.num_m_blocks = arrays["num_m_blocks"]    # (B,)   actual order
        self.cu_tiles = arrays["cu_tiles"]            # (B+1,) virtual order, tiles of H heads
        self.max_tile_work = arrays["max_tile_work"]  # (B,)   the sort key, actual order
        self.scheduler = LPTCausalScheduler(heads_per_section)
        self.varlen_scheduler = VarlenLPTScheduler(heads_per_section)
        self._num_tiles = None

    @property
    def num_batch(self) -> int:
        return int(self.batch_map.shape[0])

    @property
    def num_tiles(self) -> int:
        """Tiles of the compact grid (``cu_tiles[B]``); the first call copies one int (a sync)."""
        if self._num_tiles is None:
            self._num_tiles = int(self.cu_tiles[-1].item())
        return self._num_tiles

    def step4_kwargs(self) -> dict:
        """Keyword arguments for ``stage3_fwd_kernel.hopper.attention_varlen_forward``."""
        return {"batch_map": self.batch_map, "scheduler": self.scheduler}

    def to_host(self) -> orders.VarlenMeta:
        """The metadata as ``orders.VarlenMeta`` (copies to the host)."""
        return orders.VarlenMeta(self.batch_map.cpu().numpy(), self.num_m_blocks.cpu().numpy(),
                                 self.cu_tiles.cpu().numpy(), self.max_tile_work.cpu().numpy(), self.num_heads,
                                 self.heads_per_section, True)

    @classmethod
    def cached(cls, cu_seqlens_q, cu_seqlens_k, num_heads: int, *, seqused_k=None, **kwargs) -> "VarlenSchedule":
        """One schedule per batch layout: keyed on the cu_seqlens_q / cu_seqlens_k / seqused_k
        tensor *objects* (held weakly), their in-place version counters and the options, so every
        layer of a model forward that receives the same tensors reuses the first layer's metadata,
        and an in-place update of the lengths recomputes it. One entry per cu_seqlens_q tensor
        (the newest); it goes away with the tensor."""
        tensors = (cu_seqlens_q, cu_seqlens_k, seqused_k)
        key = (tuple(None if t is None else t._version for t in tensors), num_heads, tuple(sorted(kwargs.items())))
        slot = id(cu_seqlens_q)
        hit = cls._cache.get(slot)
        if hit is not None:
            refs, hit_key, sched = hit
            same = all((r is None and t is None) or (r is not None and r() is t) for r, t in zip(refs, tensors))
            if same and hit_key == key:
                return sched
        sched = cls(cu_seqlens_q, cu_seqlens_k, num_heads, seqused_k=seqused_k, **kwargs)

        def forget(_ref, slot=slot):
            entry = cls._cache.get(slot)
            if entry is not None and entry[0][0] is _ref:
                del cls._cache[slot]
        refs = (weakref.ref(cu_seqlens_q, forget),) + tuple(None if t is None else weakref.ref(t)
                                                           for t in tensors[1:])
        cls._cache[slot] = (refs, key, sched)
        return sched


def run(num_batch: int = 300, num_heads: int = 16, seed: int = 0, verbose: bool = True) -> dict:
    """On a GPU: the preprocessing kernel on a random batch (empty sequences included) against
    orders.varlen_metadata, then its time. Without one: compile it and print the resource report."""
    import numpy as np
    import torch

    if not torch.cuda.is_available():
        comp = compile_metadata()
        if verbose:
            print(sass_report.format_report(f"varlen metadata kernel [{host_io.ARCH}] (no GPU: compiled only)", comp.report))
        return {"mode": "compile-only", "report": comp.report}
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, 4096, size=num_batch)
    seq[rng.random(num_batch) < 0.1] = 0
    cu = np.concatenate([[0], np.cumsum(seq)]).astype(np.int32)
    cu_t = torch.from_numpy(cu).cuda()
    got = varlen_metadata_device(cu_t, cu_t, num_heads)
    want = orders.varlen_metadata(cu, cu, num_heads, 128, 128)
    ok = all(np.array_equal(got[k].cpu().numpy(), getattr(want, k)) for k in got)
    ms = runner.benchmark_ms(lambda: varlen_metadata_device(cu_t, cu_t, num_heads))
    if verbose:
        print(f"{'PASS' if ok else 'FAIL'} varlen metadata, {num_batch} batches: == orders.varlen_metadata; "
              f"{ms * 1e3:.1f} us per call (once per batch layout)")
    return {"mode": "gpu", "ok": ok, "ms": ms}


if __name__ == "__main__":
    run()
