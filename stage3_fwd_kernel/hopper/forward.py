"""Stage 3, Hopper step 4: FA4's softmax (conditional rescaling + partial exp2 emulation) and
varlen -- the production Hopper forward (``stage3_fwd_kernel.hopper`` re-exports it).

Compared with the previous step, this adds **a per-warp vote that skips the O/l rescale unless
some row's max grew by more than tau = 8 (log2 units), and a compile-time share (25%) of the
exponentials computed by stage 2's polynomial on the FMA pipe instead of MUFU.EX2** because on
Hopper the forward is co-bound by the exponential unit: per 128 x 128 tile the CTA does
16384 exp2 = 16384 / 16 = 1024 MUFU clk, against 4 * 128 * 128 * d / 4096 = d * 16 tensor-core
clk (dense bf16, ~4096 FLOP/clk/SM) -- a tie at d = 64 (exp/MMA = 64/d), and at d = 128 the exp
still fills half the tile time that the other consumer's MMAs must hide. Step 3's ping-pong
overlaps the two units but cannot make MUFU faster. This step also adds **variable-length
batches** (packed tensors, cu_seqlens, seqused_k), the last feature `fa4` needs.

* Partial emulation (softmax_policy.exp2_row): each consumer thread holds 2 rows x tile_n/4 = 64
  scores (tile_n = 128); 4 of every 16 consecutive fragment values (25%) use the degree-3
  sequence -- FMNMX, FADD.RM, 2 FADD, 3 FFMA, LEA: 6 FMA-pipe + 2 ALU ops -- and 12 use
  MUFU.EX2. Per tile the CTA's MUFU load drops from 1024 to 768 clk, paid by 4096 x 6 / 128 =
  192 clk on the FMA pipe (which already carries 128 clk of score FFMAs plus max/sum). At d = 64
  that moves the bound from MUFU (1024) back to the tensor cores (1024 -> MMA-bound), at d = 128
  it frees a quarter of the MUFU time the other consumer has to cover. The instructions are
  stage 2's inline-PTX helpers (verified bit-exact against its host model on an H100), imported,
  not copied.
* Conditional rescaling (softmax_policy.rescale_vote_limits): a Hopper warp holds 16 query rows
  (2 per thread, 4 threads per row). After the tile's row max, each thread asks "did one of my rows
  grow by > tau?" (against a limit m + tau / scale kept beside m, so one compare per row) and
  `vote.sync.any` makes it a warp decision: yes -> every row of the warp moves to
  its new max and O, l are rescaled (as in step 3); no -> the whole warp keeps its stale maxima,
  P = 2^(s - m) <= 2^tau, and the dv/2 FMULs of the O rescale (64 per thread at d = 128, as
  many as its exp2s) are skipped. Uniform per warp, so the branch never diverges. The epilogue is
  unchanged and still exact: O / l cancels whatever m was used, lse = m * scale + log2(l) with
  the (possibly stale) m. tau = 0 rescales whenever any row grew: classic FlashAttention, the
  same bits as rescaling after every tile (a skipped rescale would multiply by exactly 1).
  Headroom: P <= 2^tau in the input dtype (fp16 overflows past 2^15, so tau <= 15 there), l <=
  Sk * 2^tau in fp32.
* Varlen: q (total_q, Hq, D), k/v (total_k, Hkv, D*) packed, int32 cu_seqlens_q/k (batch + 1),
  optional seqused_k (keys actually used per sequence). The host views every packed tensor as a
  batch of one, (1, total, H, D), so the TMA tensor maps are the dense ones; a CTA reads its
  sequence's (offset, length) from cu_seqlens and shifts the TMA coordinates by the row offset
  (`cute.domain_offset`). Rows past the sequence belong to the next one (or are zero-filled past
  the packed end): extra Q rows are never stored (O and lse stores are row-predicated on the
  sequence length, so nothing lands in the next sequence), extra K columns are masked to -inf
  before the max, and the V rows of a partial last block are zeroed in shared memory by each
  consumer before its P V (P = 0 there, but 0 * NaN = NaN: unused KV-cache slots past
  seqused_k may hold anything; that block is walked first, so its tail is zeroed before the
  first P V). Grid = (ceil(max_seqlen_q / tile_m), heads, batch); a CTA whose
  m_block starts past its sequence's end exits at once. A sequence with queries but no keys gets
  O = 0, lse = -inf (no key block, l = 0).
* Scheduling stays a parameter (`scheduler`, StaticTileScheduler by default) and an optional
  int32 ``batch_map`` maps the scheduler's (virtual) batch index to the sequence it computes, so
  stage 5 can reorder sequences (longest first) without this file knowing how.
* Persistent CTAs (`common.PersistentScheduler`, the default for dense calls at head dims <= 128,
  see `default_persistent`): one CTA per SM walks the tiles, so the per-CTA fixed cost (launch,
  barrier set-up, the first Q and K loads, the O store: ~2-3 key-block steps per tile, fitted to
  the H100 ladder) is paid once per SM. The producer carries the K/V ring position (`kv_base`) and
  Q's phase across tiles and loads a tile's first K/V block before its Q; consumers release Q
  after their last S, and O gets its own buffer -- or, above head dim 128 where Q + O + two K/V
  stages do not fit (`o_direct`, persistent=True only: it measured no gain there), goes from
  registers to global memory in 4-byte stores. Causal calls take the next tile from an atomic
  counter (`dynamic=True`): the producer publishes each tile id in shared memory before arming
  that tile's Q barrier. Bitwise the results of one CTA per tile.
* The last partial wave split along the keys (`split_tail`, non-causal calls on the static
  persistent order with >= 64 key blocks a tile; `split_tail_plan`). T equal tiles on P CTAs take
  ceil(T / P) tile-times: the benchmark's d = 128 calls are 4096 tiles on 132 SMs, 31 waves and 4
  tiles, and that 32nd wave was ~3% of the call (benchmarks/wave_tail.py, both kernels). The last R
  tiles become R * S key chunks (S = P // R) that the otherwise idle CTAs walk; each leaves O (over
  its own row sums) and lse in an fp32 workspace, and one small kernel (split_combine.py) merges
  them: O = sum_j exp(lse_j - lse) O_j. The full waves keep their bits; the tail's rows change by
  the order of additions (FA4's rule holds). H100, paired: +1.3% at 8k, +2.4% at 16k; at 4k it lost.
* K/V multicast (`kv_multicast`, off by default: correct on the H100, 74 gpu tests, but no faster;
  a third less L2 traffic gained nothing, stage 3 README "K/V multicast"): clusters of two CTAs
  that read the same K/V blocks; each loads half of every block and TMA multicasts it into both,
  so L2 serves each block once per pair (a step reads one byte of K/V per tile_m FLOP: ~5 TB/s at
  d = 128 and 650 TFLOP/s). A K/V slot is free once both CTAs' consumers released it. `True` /
  "m": neighbouring query tiles of a head (non-causal dense calls, one CTA per tile or
  persistent); "heads": one query tile of two query heads that share a KV head (GQA with an even
  group, causal or not, dense or varlen, one CTA per tile). Stage 3 README, "K/V multicast".

Cost in registers: none to speak of. The polynomial's coefficients are immediates and the vote
is one predicate; the highest register in SASS (bf16, default tiles, session 23) is R157 / R193 /
R206 / R209 / R237 at d = 64 / 96 / 128 / (192,128) / 256 without causal, R151 - R236 with it (varlen
d = 128 causal: R211), within what setmaxnreg grants (160 at d = 64's tile_m = 192, else 240); no
spills, no local memory. The vote sits in the softmax, which
the walk instantiates three times (first block, masked blocks, hot loop): three VOTE.ANY in SASS.
With the overlap, the O rescale a "yes" vote asks for waits until P_{i-1} V_{i-1} has landed.

Three instruction-level details of the steady state. A consumer waits for V_{i-1} after issuing
S_i, right before its P V (the official kernel's order; +1..+3% at d = 64 in paired rounds). The
wait for P_{i-1} V_{i-1} is written after the softmax; ptxas hoists a `wgmma.wait_group` to the top
of its basic block, so it lands after the first few exp2s (tests/test_stage3_step4.py counts them).
Right after it, before the O rescale's branch, P is packed to 16 bits with volatile cvts: the
compiler sinks plain conversions past the branch (their first use is the next P V), which left all
32 packs in a row at the end of the step; pinned, they interleave with the remaining exp2s as in the
official kernel's loop. Paired, 9 rounds on the H100 (run 70): +1..+5% at d = 64 / 128, +5..+7% at
(192, 128), a tie at d = 256. (Before session 23 the wait sat in the rescale branch's arms below
every exp2 at d <= 128: +2-3% at d = 128 over ptxas' placement with the packs at the end.) A row
max in 4 independent FMNMX chains instead of one 31-deep chain was tried too and not kept: no
measurable change at d = 64 / 128 (also on this loop, run 76), 2-10% slower at d = 256. Both
kernels run at the H100's 700 W power cap (~1.5 GHz, not 1.98), and the official one is faster at
a *lower* clock, so what separates them is tensor-core cycles lost per tile, not energy.

The wgmmas are issued with descriptors the consumer builds once per tile (`wgmma_desc`): Q's for
every k-step, K's and V's for stage 0 plus `stage * stage_step` per block. Through `cute.gemm` (steps
1-3) ptxas re-derived all three from the shared-memory base in every key block, ~30 uniform-datapath
instructions at d = 128 (hot loop 497 -> 464); same instructions otherwise, bitwise the same results.

Everything else is step 3 (producer warp + two ping-pong consumer warpgroups with the
intra-warpgroup overlap, last-block-first walk, TMA K/V ring, setmaxnreg 24/240, same tile sizes
and shared memory), and everything it supports is still supported: fp16/bf16, head dims
64/96/128/(192,128)/256, causal (bottom-right), GQA/MQA, any seqlens, softmax_scale (> 0), lse.
Tiles were swept on the H100 (benchmarks/tune_fwd.py, benchmarks/results/tune_fwd_h100_run1.json):
the defaults beat tile_n = 160 / 176 at d = 128, 192 at d = 64, 80 at d = 256 (the official
FA4's sm90 choice there) and 112 at (192, 128), causal and not.

tile_m = 192 (the default at d = 64, `default_tile_m`): three consumer warpgroups instead of two,
512 threads, setmaxnreg 32/160 (128 x (32 + 3 x 160) = 65536, the whole register file, exactly what
the 128 registers a 512-thread launch grants at entry add up to). The turn passes round robin
(named barrier 1 + w is consumer w's turn, 1 + nc + w its private barrier), Q arrives as one 64-row
slab per consumer (all on one mbarrier), each consumer stages its O in its own slab, and the mask
is written for 160 registers (see consume). Measured: +8..+21% over 128 rows at d = 64 (README).
Causal dense calls on it count the Q tiles from the sequence's end (`q_shift`, `top_padding`): the
partial tile, with 64 or 128 padding rows at 4k / 8k / 16k, is then the first (one key block) rather
than the last (all of them); -5.5% tile-block steps at 4k, -1.5% at 8k and 16k (README, session 13).

tile_m = 128 uses that same mask by default since it was timed against the old per-element `if`
(lean_mask=False; benchmarks/tune_fwd.py's fifth config field): +1..+14% at d = 128 on the H100,
non-causal and causal, 1k-16k. It compiles to the same float operations in the same order with ~2000
fewer selects (bf16 FSEL 2126 -> 142, fp16 integer SEL ~2100 -> 0; ~480 fewer at d = 256), about
half the SASS, and a highest register of 151 - 208 instead of 209 - 237, no spills.
"""
from __future__ import annotations

import functools
import math
import re
from typing import Optional

from stage3_fwd_kernel import common  # must precede cutlass: sets CUTE_DSL_ARCH
from stage3_fwd_kernel import wgmma_desc

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90_utils  # noqa: E402
from cutlass import Float32, Int32, const_expr, pipeline  # noqa: E402
from cutlass._mlir.dialects import llvm  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402
from cutlass.cutlass_dsl import T, dsl_user_op  # noqa: E402
from cutlass.memory.smem import SmemAllocator  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

from stage2_emulated_exp.gpu_kernel import ex2_approx_f32  # noqa: E402
from stage3_fwd_kernel import intdiv, softmax_policy, trace  # noqa: E402
from stage3_fwd_kernel.softmax_policy import (  # noqa: E402
    DEFAULT_RESCALE_THRESHOLD, HOPPER_EMULATION_FRACTION, SoftmaxPolicy)

# The production default on Hopper is the measured best (see softmax_policy.HOPPER_EMULATION_FRACTION);
# emulation_fraction=0.25 etc. remain available and tested.
DEFAULT_EMULATION_FRACTION = HOPPER_EMULATION_FRACTION

STEP = "hopper_step4_fa4_softmax"
DEFAULT_POLICY = SoftmaxPolicy(DEFAULT_RESCALE_THRESHOLD, DEFAULT_EMULATION_FRACTION)


def default_tile_n(head_dim: int, head_dim_v: int) -> int:
    """Key-tile rows: 128, or 64 when O (dv/2 registers) would leave a consumer too few for S."""
    return 64 if max(head_dim, head_dim_v) > 192 else 128


TILE_MS = (128, 192)  # two or three consumer warpgroups of 64 query rows
# Causal dense calls on these tiles count their Q tiles from the sequence's end (``q_shift``): a
# 192-row tile rarely divides the sequence (4096 = 21 x 192 + 64), and the partial tile, last when
# counted from row 0, is the one that sees every key block; counted from the end it is the first,
# which sees one or two (tile-block steps at d = 64 causal: -5.5% at 4k, -1.5% at 8k and 16k)
Q_SHIFT_TILE_MS = (192,)


def default_tile_m(head_dim: int, head_dim_v: int) -> int:
    """Query rows per CTA: 192 (three consumer warpgroups) when both head dims are <= 64, else 128.

    At d = 64 a tile's MMAs are half of d = 128's, so the per-tile softmax and issue overheads
    weigh twice as much; 192 rows amortize every K/V load over 1.5x the rows and give the tensor
    cores three warpgroups to rotate. It costs registers: 160 per consumer thread instead of 240,
    which fits d = 64 without spills (S 64 + P 32 + O 32 + softmax state) and nothing larger, so the
    kernel refuses 192 above d = 64. The official FA4 picks 192 rows at d = 64 on sm90 too."""
    return 192 if max(head_dim, head_dim_v) <= 64 else 128


def _smem_plan(head_dim: int, head_dim_v: int, tile_n: int, tile_m: int, separate_o: bool) -> tuple[int, int]:
    """(bytes outside the K/V ring: Q, O when it has its own buffer, 2 KB for barriers and
    alignment; bytes per K/V stage), 2 bytes/element."""
    fixed = tile_m * head_dim * 2 + (tile_m * head_dim_v * 2 if separate_o else 0) + 2048
    return fixed, tile_n * (head_dim + head_dim_v) * 2


def o_fits_beside_q(head_dim: int, head_dim_v: int, tile_n: int, tile_m: int) -> bool:
    """Whether Q, an O buffer of its own and two K/V stages fit in shared memory: true up to head dim
    128; at (192, 128) and 256 a persistent CTA stores O from registers instead (`o_direct`)."""
    fixed, stage_bytes = _smem_plan(head_dim, head_dim_v, tile_n, tile_m, separate_o=True)
    return fixed + 2 * stage_bytes <= common.SMEM_BUDGET


def default_num_stages(head_dim: int, head_dim_v: int, tile_n: int, tile_m: int = 128,
                       separate_o: bool = False) -> int:
    """As many K/V stages as fit next to Q (and O when it has its own buffer), between 2 and 4
    (step 3's table)."""
    fixed, stage_bytes = _smem_plan(head_dim, head_dim_v, tile_n, tile_m, separate_o)
    return max(2, min(4, (common.SMEM_BUDGET - fixed) // stage_bytes))


# ------------------------------------------------------------------------------------------------
# Register-layout helpers for the Hopper accumulator (step 1's docstring has the picture)
# ------------------------------------------------------------------------------------------------
def acc_rowcol(acc: cute.Tensor) -> cute.Tensor:
    """View a wgmma accumulator ((2, 2, N/8), MMA_M, MMA_N) as (rows, cols) of this thread:
    rows = (the 2 rows 8 apart, MMA_M), cols = (2 adjacent columns, N/8 groups, MMA_N)."""
    shp, std = acc.layout.shape, acc.layout.stride
    rows = ((shp[0][1], shp[1]), (std[0][1], std[1]))
    cols = ((shp[0][0], shp[0][2], shp[2]), (std[0][0], std[0][2], std[2]))
    return cute.make_tensor(acc.iterator, cute.make_layout((rows[0], cols[0]), stride=(rows[1], cols[1])))


@cute.jit
def quad_allreduce(x: Float32, op: cutlass.Constexpr) -> Float32:
    """Reduce over the 4 lanes of a quad (the 4 threads that share an accumulator row)."""
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=2))
    x = op(x, cute.arch.shuffle_sync_bfly(x, offset=1))
    return x


def row_stored(row, q_rows_left, q_rows_skip=None):
    """Whether an output row (relative to the warpgroup's first) is written: before the sequence's end
    and, with q_shift (q_rows_skip: its padding rows at the top), not a padding row."""
    live = row < q_rows_left
    if const_expr(q_rows_skip is not None):
        live = live & (row >= q_rows_skip)
    return live


@dsl_user_op
def pack_pair_pinned(lo: Float32, hi: Float32, bf16: bool, *, loc=None, ip=None) -> Int32:
    """(lo, hi) -> one 32-bit word of two 16-bit floats, lo in the low half (round to nearest): a
    volatile cvt, which the compiler neither moves nor merges, the same F2FP a plain conversion emits."""
    cvt = "cvt.rn.bf16x2.f32 $0, $1, $2;" if bf16 else "cvt.rn.f16x2.f32 $0, $1, $2;"
    operands = [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)]  # PTX: $1 -> the high half
    return Int32(llvm.inline_asm(T.i32(), operands, cvt, "=r,f,f", has_side_effects=True, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


class FlashAttentionForwardSm90Step4:
    """Step 3's kernel with FA4's softmax (`policy`) and varlen: producer warp + tile_m / 64 consumer
    warpgroups (64 rows each; tile_m = 128 or 192) taking turns on the tensor cores, TMA K/V ring."""

    def __init__(self, dtype, head_dim: int, head_dim_v: int, causal: bool, *,
                 policy: SoftmaxPolicy = DEFAULT_POLICY, tile_m: int = 128, tile_n: int | None = None,
                 num_stages: int | None = None, pingpong: bool = True, scheduler=common.StaticTileScheduler,
                 lean_mask: bool | None = None, kv_multicast: bool | str = False, split_tail: bool = False):
        if head_dim % 16 or head_dim_v % 16 or not (16 <= head_dim <= 256 and 16 <= head_dim_v <= 256):
            raise ValueError(f"head_dim: expected multiples of 16 in [16, 256], got ({head_dim}, {head_dim_v})")
        if not isinstance(policy, SoftmaxPolicy):
            raise TypeError(f"policy: expected a SoftmaxPolicy, got {type(policy).__name__}")
        policy.check_dtype(dtype)
        # persistent (common.PersistentScheduler): a tile loop that carries the pipeline state
        self.persistent = bool(getattr(scheduler, "persistent", False))
        self.dynamic = self.persistent and bool(getattr(scheduler, "dynamic", False))
        if self.persistent and not callable(getattr(scheduler, "tile_at", None)):
            raise TypeError("scheduler: a persistent scheduler needs tile_at(linear, M, H, B)")
        if tile_m not in TILE_MS:
            raise ValueError(f"tile_m: expected one of {TILE_MS} (64 query rows per consumer warpgroup), got {tile_m}")
        # kv_multicast: a cluster of two CTAs that read the same K/V blocks -- neighbouring query tiles
        # of one head ("m", or True) or one query tile of two heads that share a KV head ("heads") --
        # each loading half of every K/V block and TMA multicasting it into both CTAs' shared memory
        # (stage 3 README, "K/V multicast")
        self.kv_pairs = _check_kv_multicast(kv_multicast, causal, scheduler)
        self.kv_multicast = self.kv_pairs is not None
        self.kv_share = 2 if self.kv_multicast else 1            # CTAs that share each K/V block
        self.cluster_m = 2 if self.kv_pairs == "m" else 1         # ... along the query tiles
        self.cluster_shape = {None: None, "m": (2, 1, 1), "heads": (1, 2, 1)}[self.kv_pairs]
        if tile_m == 192 and max(head_dim, head_dim_v) > 64:
            # S (64) + P (32) + O (dv / 2) registers per thread no longer fit 160: ptxas spills
            raise ValueError(f"tile_m: 192 needs head dims <= 64 (160 registers per consumer thread), "
                             f"got ({head_dim}, {head_dim_v})")
        self.policy = policy
        self.lean_mask = _check_lean_mask(lean_mask, tile_m)
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.tile_m = tile_m
        self.tile_n = tile_n or default_tile_n(head_dim, head_dim_v)
        # a persistent CTA stages O apart from Q (the next tile's Q loads during the epilogue); where
        # Q + O + two K/V stages do not fit (head dims > 128) it stores O straight from registers
        self.o_direct = self.persistent and not o_fits_beside_q(head_dim, head_dim_v, self.tile_n, tile_m)
        self.num_stages = num_stages or default_num_stages(head_dim, head_dim_v, self.tile_n, tile_m,
                                                           separate_o=self.persistent and not self.o_direct)
        self.pingpong = pingpong
        # split_tail: the last partial wave's tiles are cut along the keys into chunks that other CTAs
        # take; each chunk leaves (O, lse) in fp32 for split_tail_combine (see attention_forward)
        if split_tail and not split_tail_supported(scheduler, causal, kv_multicast):
            raise ValueError(SPLIT_TAIL_UNSUPPORTED)
        self.split_tail = bool(split_tail)
        self.scheduler = scheduler
        self.num_consumers = tile_m // 64    # consumer warpgroups, one wgmma M = 64 row block each
        self.wg_m = tile_m // self.num_consumers  # 64 query rows per consumer
        self.num_threads = 128 * (1 + self.num_consumers)
        # setmaxnreg moves registers from the producer to the consumers inside the CTA's pool: the
        # launch grants 65536 / threads each (168 at 384 threads, 128 at 512), and the producer must
        # free exactly what the consumers take, 128 * (p + n * c) = 65536 (FA3's split for 3 WGs)
        self.regs_producer, self.regs_consumer = {2: (24, 240), 3: (32, 160)}[self.num_consumers]
        if self.persistent:
            fixed, stage_bytes = _smem_plan(head_dim, head_dim_v, self.tile_n, tile_m, separate_o=not self.o_direct)
            need = fixed - 2048 + self.num_stages * stage_bytes
            if need + 2048 > common.SMEM_BUDGET:
                raise ValueError(f"num_stages: a persistent CTA at head dims ({head_dim}, {head_dim_v}) with "
                                 f"{self.num_stages} K/V stages needs {need} bytes of shared memory "
                                 f"(> {common.SMEM_BUDGET - 2048}); use fewer stages or a one-tile-per-CTA scheduler")
        self.smem_bytes = None

    # -------------------------------------------------------------- host side (traced once)
    def _tiled_mma_qk(self) -> cute.TiledMma:
        """S (64 x tn) = Q (64 x d) . K (tn x d)^T: one wgmma atom, A and B K-major from smem."""
        K_MAJOR = cute.nvgpu.OperandMajorMode.K
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, (1, 1, 1), (self.wg_m, self.tile_n))

    def _smem_layout(self, rows: int, cols: int, stages: int | None = None):
        """Row-major (contiguous along `cols`) tile with the widest swizzle wgmma accepts,
        optionally with a trailing stage mode."""
        atom_kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, self.dtype, cols)
        atom = warpgroup.make_smem_layout_atom(atom_kind, self.dtype)
        if stages is None:
            return cute.tile_to_shape(atom, (rows, cols), (0, 1))
        return cute.tile_to_shape(atom, (rows, cols, stages), (0, 1, 2))

    def _gmem_copy_O(self, cols: int):
        """128 threads, 16 bytes each, a row of the swizzle atom per group of threads."""
        elems = 128 // self.dtype.width
        atom_cols = 64 if cols % 64 == 0 else (32 if cols % 32 == 0 else 16)
        threads_per_row = atom_cols // elems
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        thr = cute.make_ordered_layout((128 // threads_per_row, threads_per_row), order=(1, 0))  # one warpgroup
        return cute.make_tiled_copy_tv(atom, thr, cute.make_layout((1, elems)))

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor,
                 mLSE: cute.Tensor, softmax_scale_log2: Float32, softmax_scale: Float32,
                 mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
                 mSeqUsedK: Optional[cute.Tensor], mBatchMap: Optional[cute.Tensor],
                 mTileCounter: Optional[cute.Tensor], max_seqlen_q: Int32, max_ctas: Int32,
                 mSplit: Optional[cute.Tensor], split_chunks: Int32, stream):
        # dense:  mQ (B, Sq, Hq, d), mK (B, Sk, Hkv, d), mV (B, Sk, Hkv, dv), mO (B, Sq, Hq, dv),
        #         mLSE (B, Hq, Sq); the four optional tensors are None.
        # varlen: the same tensors with B = 1 and S = total tokens (packed), mLSE (1, Hq, total_q);
        #         mCuSeqlensQ / mCuSeqlensK (batch + 1,), mSeqUsedK / mBatchMap (batch,) or None.
        # max_ctas: a persistent grid's width (the device's SMs); unused by one-tile-per-CTA grids.
        # mTileCounter: int32 (1,), zeroed, for a dynamic persistent scheduler; None otherwise.
        # mSplit: split_tail's workspace, fp32 (R * split_chunks, tile_m, dv + 1): chunk c's O rows
        #         (normalized by the chunk's own sum) and, in the last column, its lse; None otherwise.
        if const_expr((mSplit is not None) != self.split_tail):
            raise ValueError("split workspace: pass one exactly when the kernel is built with split_tail")
        if const_expr((mTileCounter is not None) != self.dynamic):
            raise ValueError("tile_counter: pass one exactly when the scheduler is dynamic")
        if const_expr(not (mQ.element_type == mK.element_type == mV.element_type == mO.element_type == self.dtype)):
            raise TypeError("q, k, v, out must share the kernel's dtype")
        if const_expr((mCuSeqlensQ is None) != (mCuSeqlensK is None)):
            raise ValueError("cu_seqlens_q and cu_seqlens_k: pass both or neither")
        if const_expr(mSeqUsedK is not None and mCuSeqlensK is None):
            raise ValueError("seqused_k: needs cu_seqlens_k")
        self.varlen = mCuSeqlensQ is not None
        self.q_shift = self.q_shift_for(self.varlen)
        if const_expr(self.varlen and self.kv_pairs == "m"):
            raise ValueError("kv_multicast: query-tile pairs ('m') need dense calls (a pair may straddle two "
                             "sequences); 'heads' pairs work with varlen")
        tm, tn, d, dv, stages = self.wg_m, self.tile_n, self.head_dim, self.head_dim_v, self.num_stages
        nc = self.num_consumers
        mQ, mK = common.assume_strides_16B(mQ, d), common.assume_strides_16B(mK, d)
        mV, mO = common.assume_strides_16B(mV, dv), common.assume_strides_16B(mO, dv)

        # Q and O: one 64-row slab per consumer warpgroup (a trailing mode of size nc)
        sQ_layout = self._smem_layout(tm, d, nc)
        sK_layout = self._smem_layout(tn, d, stages)
        sV_layout = self._smem_layout(tn, dv, stages)
        sO_layout = self._smem_layout(tm, dv, nc)

        K_MAJOR, MN_MAJOR = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        tiled_mma_qk = self._tiled_mma_qk()
        # O (tm x dv) = P (tm x tn) . V : A = P from registers, B = V^T (dv x tn) is MN-major
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, (1, 1, 1), (tm, dv),
            a_source=warpgroup.OperandSource.RMEM)

        # TMA: the tensor map sees (seqlen, head_dim, heads, batch) so that a (rows, head_dim) box
        # tiles the first two modes; head and batch are fixed per CTA by slicing the TMA tensor.
        def seq_dim_first(t):  # (B, S, H, D) -> (S, D, H, B), same memory
            return cute.make_tensor(t.iterator, cute.select(t.layout, mode=[1, 3, 2, 0]))
        tma_load = cpasync.CopyBulkTensorTileG2SOp()
        # kv_multicast: each CTA of the pair loads 1/kv_share of a K/V box into both CTAs
        tma_load_kv = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.kv_multicast) else tma_load
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            tma_load, seq_dim_first(mQ), cute.slice_(sQ_layout, (None, None, 0)), (tm, d))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            tma_load_kv, seq_dim_first(mK), cute.slice_(sK_layout, (None, None, 0)), (tn, d),
            num_multicast=self.kv_share)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            tma_load_kv, seq_dim_first(mV), cute.slice_(sV_layout, (None, None, 0)), (tn, dv),
            num_multicast=self.kv_share)
        # bytes each stage's "full" barrier waits for (the whole box, zero-filled rows included)
        self.tma_bytes_Q = cute.size_in_bytes(self.dtype, sQ_layout)  # all nc slabs, one barrier
        self.tma_bytes_K = cute.size_in_bytes(self.dtype, cute.slice_(sK_layout, (None, None, 0)))
        self.tma_bytes_V = cute.size_in_bytes(self.dtype, cute.slice_(sV_layout, (None, None, 0)))

        # O is written once, after the last QK^T: each consumer puts its O slab at the start of its
        # own Q slab (never over the other consumer's slab, which may still be in use)
        self.o_in_q = not self.persistent and cute.cosize(cute.slice_(sO_layout, (None, None, 0))) <= cute.cosize(
            cute.slice_(sQ_layout, (None, None, 0)))

        @cute.struct
        class SharedStorage:
            mbar_Q: cute.struct.MemRange[cutlass.Int64, 2]               # full + empty, 1 stage
            mbar_K: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_V: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            tile_ids: cute.struct.MemRange[Int32, 2]  # dynamic: the tile of each Q phase, from the producer
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[
                self.dtype, 0 if self.o_in_q or self.o_direct else cute.cosize(sO_layout)], 1024]

        self.shared_storage = SharedStorage
        self.smem_bytes = SharedStorage.size_in_bytes()

        # dense: max_seqlen_q = Sq; varlen: the longest sequence (CTAs past a shorter one exit)
        num_m_blocks = (max_seqlen_q + self.tile_m - 1) // self.tile_m
        batch = mQ.shape[0]
        if const_expr(self.varlen):
            batch = mCuSeqlensQ.shape[0] - 1
        # kv_multicast: the tile order runs over pairs of query tiles (cluster_m CTAs each); the
        # second tile of a pair past the last one (odd count) is a shadow: it loads and multicasts
        # its half of every K/V block for its partner and stores nothing (its rows are >= seqlen_q)
        num_m_units = (num_m_blocks + self.cluster_m - 1) // self.cluster_m
        if const_expr(self.persistent):
            grid = self.scheduler.grid_shape(num_m_units, mQ.shape[2], batch,
                                             cutlass.max(max_ctas // self.cluster_m, 1))
            grid = (grid[0] * self.cluster_m, grid[1], grid[2])
        else:
            grid = self.scheduler.grid_shape(num_m_units * self.cluster_m, mQ.shape[2], batch)
        self.kernel(tma_Q, tma_K, tma_V, mO, mLSE, softmax_scale_log2, softmax_scale,
                    mQ.shape[1], mK.shape[1], mQ.shape[2] // mK.shape[2],
                    mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mBatchMap, mTileCounter,
                    tma_atom_Q, tma_atom_K, tma_atom_V,
                    tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, sO_layout,
                    self._gmem_copy_O(dv), num_m_units, mQ.shape[2], batch, mSplit, split_chunks,
                    # min_blocks_per_mp=1 caps registers at entry (65536/threads), which setmaxnreg needs
                    ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1,
                             **({"cluster": self.cluster_shape} if self.kv_multicast else {}))

    # -------------------------------------------------------------- device side
    @cute.kernel
    def kernel(self, tma_Q: cute.Tensor, tma_K: cute.Tensor, tma_V: cute.Tensor, mO: cute.Tensor,
               mLSE: cute.Tensor, softmax_scale_log2: Float32, softmax_scale: Float32,
               seqlen_q: Int32, seqlen_k: Int32, qhead_per_kvhead: Int32,
               mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
               mSeqUsedK: Optional[cute.Tensor], mBatchMap: Optional[cute.Tensor],
               mTileCounter: Optional[cute.Tensor],
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
               gmem_copy_O: cute.TiledCopy, num_m_units: Int32, num_heads: Int32, num_batch: Int32,
               mSplit: Optional[cute.Tensor], split_chunks: Int32):
        # num_m_units: query tiles per head, or pairs of them (kv_multicast)
        trace.cta_stamp("entry")  # no code unless benchmarks/trace_fwd.py turned tracing on
        seq = (seqlen_q, seqlen_k, qhead_per_kvhead, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mBatchMap)
        if const_expr(self.persistent):
            # every CTA lives to the end: the tiles past a sequence's end are skipped inside the loop
            self.attend(None, seq, (num_m_units, num_heads, num_batch, mTileCounter, mSplit, split_chunks),
                        tma_Q, tma_K, tma_V, mO, mLSE, softmax_scale_log2, tma_atom_Q, tma_atom_K, tma_atom_V,
                        tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout, sO_layout, gmem_copy_O)
        else:
            work = self.scheduler.initial_work()
            tile = self.tile_info(work.m_block, work.head, work.batch, seq)
            # a CTA past the end of its (shorter than max_seqlen_q) sequence has nothing to do; the
            # whole CTA leaves before any barrier exists
            if self.tile_live(tile):
                self.attend(tile, seq, None, tma_Q, tma_K, tma_V, mO, mLSE, softmax_scale_log2, tma_atom_Q,
                            tma_atom_K, tma_atom_V, tiled_mma_qk, tiled_mma_pv, sQ_layout, sK_layout, sV_layout,
                            sO_layout, gmem_copy_O)

    def tile_info(self, m_block: Int32, head: Int32, batch: Int32, seq) -> tuple:
        """The scheduler's (m_block, head, virtual batch) -> (m_block, head, head_kv, batch index of
        the tensors, offset_q, offset_k, seqlen_q, seqlen_k). batch_map (stage 5's reordering) says
        which sequence a virtual batch index computes. Dense: the tensors' extents, batch index
        `batch`. Varlen: the packed tensors are a batch of one, the sequence starts at row
        offset_q / offset_k."""
        seqlen_q, seqlen_k, qhead_per_kvhead, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mBatchMap = seq
        if const_expr(mBatchMap is not None):
            batch = mBatchMap[batch]
        offset_q, offset_k, batch_t = Int32(0), Int32(0), batch
        if const_expr(self.varlen):
            offset_q, offset_k, batch_t = mCuSeqlensQ[batch], mCuSeqlensK[batch], Int32(0)
            seqlen_q = mCuSeqlensQ[batch + 1] - offset_q
            if const_expr(mSeqUsedK is not None):
                seqlen_k = mSeqUsedK[batch]
            else:
                seqlen_k = mCuSeqlensK[batch + 1] - offset_k
        if const_expr(self.q_shift):
            # virtual rows: top_padding rows before query 0 (the causal diagonal depends only on
            # seqlen_k - seqlen_q, which stays; their Q loads as zeros past the tensor's start, and
            # neither O nor lse is stored for them)
            pad = self.top_padding(seqlen_q)
            offset_q, seqlen_q = offset_q - pad, seqlen_q + pad
        # the KV head: fast_div, not `//` (a signed software division of ~40 dependent instructions
        # after the tile map, on every CTA's way to its first K load)
        head_kv = intdiv.fast_div(head, qhead_per_kvhead)
        return (m_block, head, head_kv, batch_t, offset_q, offset_k, seqlen_q, seqlen_k)

    def q_shift_for(self, varlen: bool) -> bool:
        """Whether a call counts its Q tiles from the sequence's end (Q_SHIFT_TILE_MS): causal, dense
        (a varlen sequence's padding rows would be the previous sequence's). Head pairs (kv_multicast
        "heads") shift both CTAs alike, so they keep the static grid's tiles (and its bitwise results);
        query-tile pairs ("m") are non-causal only."""
        return self.causal and not varlen and self.tile_m in Q_SHIFT_TILE_MS

    def top_padding(self, seqlen_q):
        """q_shift: rows before query 0 that make the Q tiles end with the sequence (< tile_m)."""
        return common.top_padding(seqlen_q, self.tile_m)

    def tile_live(self, tile):
        """Whether this CTA works on `tile`: it starts before its sequence's end (varlen tiles past it
        are skipped) or, with query-tile pairs (kv_multicast "m"), it is the shadow just past the last
        one, which computes rows it never stores but must load its half of every K/V block for its
        partner. (Pairs of heads share the tile, so both CTAs of a cluster agree.)"""
        end = tile[6]
        if const_expr(self.cluster_m > 1):
            end = end + self.tile_m
        return tile[0] * self.tile_m < end

    def num_key_blocks(self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32) -> Int32:
        """Key blocks a tile_m-row query tile can see: all of them, or (causal) up to the diagonal of
        its last row (query i sees key j iff j <= i + seqlen_k - seqlen_q). All consumers walk the
        same blocks: they share every K/V stage (and take the same number of turns)."""
        tn = self.tile_n
        n_block_max = (seqlen_k + tn - 1) // tn
        if const_expr(self.causal):
            last_visible = (m_block + 1) * self.tile_m + seqlen_k - seqlen_q  # exclusive bound on keys
            n_block_max = cutlass.min(n_block_max, cutlass.max((last_visible + tn - 1) // tn, 0))
        return n_block_max

    @cute.jit
    def attend(self, tile, seq, extents, tma_Q: cute.Tensor, tma_K: cute.Tensor, tma_V: cute.Tensor,
               mO: cute.Tensor, mLSE: cute.Tensor, softmax_scale_log2: Float32,
               tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
               tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
               sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout, gmem_copy_O: cute.TiledCopy):
        """The CTA: barriers and shared memory once, then the producer warp and the consumer
        warpgroups on one tile (`tile`, from tile_info), or -- persistent -- on every tile
        `self.scheduler.tile_at` gives this CTA (extents = (M, H, B) of the tile order). `batch` of
        a tile indexes the tensors' batch mode (0 for varlen)."""
        stages = self.num_stages
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group_idx = cute.arch.make_warp_uniform(tidx // 128)

        if warp_idx == 0:  # fetch the tensor maps (they live in kernel params) into the TMA unit
            cpasync.prefetch_descriptor(tma_atom_Q)
            cpasync.prefetch_descriptor(tma_atom_K)
            cpasync.prefetch_descriptor(tma_atom_V)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)

        # mbarrier pipelines: producer = 1 arrival (an elected lane of the producer warp, which also
        # posts the expected byte count), consumers = the 4 * nc warps of all consumer warpgroups
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumers * 4)
        # kv_multicast: a K/V slot is free only once the consumer warps of both CTAs released it (lanes
        # 0 and 1 of every consumer warp arrive on CTA 0's and CTA 1's empty barrier), since the next
        # load into it, by either CTA, writes both CTAs' copies
        kv_consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                      self.num_consumers * 4 * self.kv_share)
        kv_cluster = cute.make_layout((1, self.kv_share, 1, 1))
        pipe_Q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_Q.data_ptr(), num_stages=1, producer_group=producer_group,
            consumer_group=consumer_group, tx_count=self.tma_bytes_Q, defer_sync=True)
        pipe_K = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_K.data_ptr(), num_stages=stages, producer_group=producer_group,
            consumer_group=kv_consumer_group, tx_count=self.tma_bytes_K, cta_layout_vmnk=kv_cluster, defer_sync=True)
        pipe_V = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_V.data_ptr(), num_stages=stages, producer_group=producer_group,
            consumer_group=kv_consumer_group, tx_count=self.tma_bytes_V, cta_layout_vmnk=kv_cluster, defer_sync=True)
        cute.arch.mbarrier_init_fence()  # make the barrier inits visible to the async proxy (TMA)
        if const_expr(self.kv_multicast):
            # ... and to both CTAs before either multicasts into the other or arrives on its barriers
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()     # ... and to every thread; the last CTA-wide barrier

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)  # (64, d, nc)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)  # (tn, d, stages)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)  # (tn, dv, stages)
        smem_tensors = (storage, sQ, sK, sV, pipe_Q, pipe_K, pipe_V)
        tile_ids = storage.tile_ids.get_tensor(cute.make_layout(2))  # (2,) int32, by Q phase

        if warp_group_idx == 0:
            # ---------------------------------------------------------------- producer warpgroup
            cute.arch.setmaxregister_decrease(self.regs_producer)
            if warp_idx == 0:  # one warp issues (elect.sync inside needs the whole warp converged)
                if const_expr(self.persistent):
                    kv_base, q_phase = Int32(0), Int32(0)  # loads so far, Q's phase
                    linear = self.first_linear()
                    total = self.num_items(extents)
                    while linear < total:
                        t, n_block_min, n_block_max, _ = self.item_at(linear, extents, seq)
                        if self.tile_live(t):  # else: past its sequence's end (varlen)
                            if const_expr(self.dynamic):
                                # published before Q's full barrier is armed: its arrival releases it
                                tile_ids[q_phase] = linear
                            self.produce(t, n_block_max, kv_base, q_phase, tma_Q, tma_K, tma_V,
                                         tma_atom_Q, tma_atom_K, tma_atom_V, sQ, sK, sV, pipe_Q, pipe_K, pipe_V,
                                         n_block_min=n_block_min)
                            kv_base += self.blocks_walked(n_block_min, n_block_max)
                            q_phase ^= 1
                        linear = self.next_linear(linear, extents)
                    if const_expr(self.dynamic):
                        # tell the consumers there is no more work: an out-of-range tile id, on a Q
                        # phase completed by a real load (the first Q slabs of the tensors)
                        tile_ids[q_phase] = total
                        t0 = (Int32(0), Int32(0), Int32(0), Int32(0), Int32(0), Int32(0))
                        self.produce(t0, Int32(0), kv_base, q_phase, tma_Q, tma_K, tma_V,
                                     tma_atom_Q, tma_atom_K, tma_atom_V, sQ, sK, sV, pipe_Q, pipe_K, pipe_V)
                else:
                    self.produce(tile, self.num_key_blocks(tile[0], tile[6], tile[7]), Int32(0), Int32(0),
                                 tma_Q, tma_K, tma_V, tma_atom_Q, tma_atom_K, tma_atom_V, sQ, sK, sV,
                                 pipe_Q, pipe_K, pipe_V)
        else:
            # ---------------------------------------------------------------- consumer warpgroups
            cute.arch.setmaxregister_increase(self.regs_consumer)
            wg = warp_group_idx - 1
            self.pass_turn(wg, first=True)
            if const_expr(self.dynamic):
                # the producer publishes each tile id with that tile's Q (total: no more work)
                kv_base, q_phase = Int32(0), Int32(0)
                total = extents[0] * extents[1] * extents[2]
                pipe_Q.consumer_wait(pipeline.PipelineState(1, Int32(0), Int32(0), q_phase))
                linear = tile_ids[q_phase]
                while linear < total:
                    t = self.work_at(linear, extents, seq)
                    n_block_max = self.num_key_blocks(t[0], t[6], t[7])
                    self.consume(wg, tidx % 128, t, n_block_max, kv_base, q_phase, softmax_scale_log2, mO,
                                 mLSE, smem_tensors, tiled_mma_qk, tiled_mma_pv, sO_layout, gmem_copy_O)
                    kv_base += n_block_max
                    q_phase ^= 1
                    pipe_Q.consumer_wait(pipeline.PipelineState(1, Int32(0), Int32(0), q_phase))
                    linear = tile_ids[q_phase]
            elif const_expr(self.persistent):
                kv_base, q_phase = Int32(0), Int32(0)
                linear = self.first_linear()
                total = self.num_items(extents)
                while linear < total:
                    t, n_block_min, n_block_max, chunk = self.item_at(linear, extents, seq)
                    if self.tile_live(t):
                        self.consume(wg, tidx % 128, t, n_block_max, kv_base, q_phase, softmax_scale_log2, mO,
                                     mLSE, smem_tensors, tiled_mma_qk, tiled_mma_pv, sO_layout, gmem_copy_O,
                                     n_block_min=n_block_min, chunk=chunk, mSplit=extents[4])
                        kv_base += self.blocks_walked(n_block_min, n_block_max)
                        q_phase ^= 1
                    linear += self.num_walkers()
            else:
                self.consume(wg, tidx % 128, tile, self.num_key_blocks(tile[0], tile[6], tile[7]), Int32(0),
                             Int32(0), softmax_scale_log2, mO, mLSE, smem_tensors, tiled_mma_qk, tiled_mma_pv,
                             sO_layout, gmem_copy_O)
            self.pass_turn(wg, first=False)
        if const_expr(self.kv_multicast):
            # no CTA leaves while its partner may still arrive on its barriers
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def first_linear(self) -> Int32:
        """A persistent walker's first unit of the order: its CTA, or (query-tile pairs) its cluster."""
        if const_expr(self.cluster_m > 1):
            return Int32(cute.arch.block_idx()[0]) // self.cluster_m
        return Int32(cute.arch.block_idx()[0])

    def num_walkers(self) -> Int32:
        """The static striding: CTAs, or (query-tile pairs) clusters, of the persistent grid."""
        if const_expr(self.cluster_m > 1):
            return cute.arch.grid_dim()[0] // self.cluster_m
        return cute.arch.grid_dim()[0]

    def work_at(self, linear: Int32, extents, seq) -> tuple:
        """tile_info of the persistent order's tile `linear` (extents: (M, H, B, tile counter)); with
        query-tile pairs the order runs over pairs and CTA r of the cluster takes tile 2 m + r of pair m."""
        m_block, head, batch = self.scheduler.tile_at(linear, *extents[:3])
        if const_expr(self.cluster_m > 1):
            m_block = m_block * self.cluster_m + cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        return self.tile_info(m_block, head, batch, seq)

    def num_items(self, extents) -> Int32:
        """Work items of the persistent order: its tiles, or (split_tail) the tiles before the last
        partial wave and split_chunks key chunks of each tile in it (extents[4].shape[0] of them)."""
        total = extents[0] * extents[1] * extents[2]
        if const_expr(self.split_tail):
            split_tiles = extents[4].shape[0] // extents[5]
            total = total - split_tiles + extents[4].shape[0]
        return total

    @cute.jit
    def item_at(self, linear: Int32, extents, seq) -> tuple:
        """(tile_info, first key block, end key block, chunk) of work item `linear`.
        Without split_tail: the whole tile, first block and chunk None. With it, past the full waves,
        chunk c = j + S r: keys [j nb / S, (j+1) nb / S) of tail tile r (S = split_chunks, nb its key
        blocks); before them the whole tile, first block 0 and chunk -1."""
        if const_expr(not self.split_tail):
            t = self.work_at(linear, extents, seq)
            n_block_max = self.num_key_blocks(t[0], t[6], t[7])
            return t, None, n_block_max, None
        chunks = extents[5]
        tail_start = extents[0] * extents[1] * extents[2] - extents[4].shape[0] // chunks
        tile_linear = linear
        chunk = Int32(-1)
        if linear >= tail_start:
            chunk = linear - tail_start
            tile_linear = tail_start + chunk // chunks
        t = self.work_at(tile_linear, extents, seq)
        n_block_max = self.num_key_blocks(t[0], t[6], t[7])
        n_block_min = Int32(0)
        if chunk >= 0:
            j = chunk - (chunk // chunks) * chunks
            n_block_min = (j * n_block_max) // chunks
            n_block_max = ((j + 1) * n_block_max) // chunks
        return t, n_block_min, n_block_max, chunk

    def blocks_walked(self, n_block_min, n_block_max):
        """Key blocks of a work item (n_block_min None: a whole tile, from block 0)."""
        if const_expr(n_block_min is None):
            return n_block_max
        return n_block_max - n_block_min

    @cute.jit
    def next_linear(self, linear: Int32, extents) -> Int32:
        """(producer warp) the tile after `linear`: num_ctas further (static), or -- dynamic -- num_ctas
        + the count of tiles other CTAs have taken beyond their first (one atomic by lane 0, broadcast)."""
        nxt = linear + self.num_walkers()
        if const_expr(self.dynamic):
            taken = Int32(0)
            if cute.arch.lane_idx() == 0:
                taken = cute.arch.atomic_add(extents[3].iterator, Int32(1), sem="relaxed", scope="gpu")
            nxt = cute.arch.grid_dim()[0] + cute.arch.shuffle_sync(taken, 0)
        return nxt

    @cute.jit
    def produce(self, tile, n_block_max: Int32, kv_base: Int32, q_phase: Int32, tma_Q: cute.Tensor,
                tma_K: cute.Tensor, tma_V: cute.Tensor, tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom,
                tma_atom_V: cute.CopyAtom, sQ: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                pipe_Q, pipe_K, pipe_V, n_block_min=None):
        """(producer warp) one tile's loads: Q's nc slabs, then every visible K/V block, each as soon
        as its ring slot is free (last block first: the order the consumers walk them in). kv_base:
        loads issued for earlier tiles (the ring position), q_phase: Q's phase for this tile;
        n_block_min (split_tail's chunks): the first key block, 0 when None."""
        n_blocks = n_block_max
        if const_expr(n_block_min is not None):
            n_blocks = n_block_max - n_block_min
        m_block, head, head_kv, batch, offset_q, offset_k = tile[0], tile[1], tile[2], tile[3], tile[4], tile[5]
        tn, d, dv = self.tile_n, self.head_dim, self.head_dim_v
        # TMA coordinates of this sequence: rows start at its offset in the packed tensor
        mQ_s = self.seq_view(tma_Q[None, None, head, batch], offset_q)
        mK_s = self.seq_view(tma_K[None, None, head_kv, batch], offset_k)
        mV_s = self.seq_view(tma_V[None, None, head_kv, batch], offset_k)
        gQ = cute.local_tile(mQ_s, (self.wg_m, d), (None, 0))   # (64, d, m64)
        gK = cute.local_tile(mK_s, (tn, d), (None, 0))          # (tn, d, n_blocks)
        gV = cute.local_tile(mV_s, (tn, dv), (None, 0))         # (tn, dv, n_blocks)
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_Q, 0, cute.make_layout(1),
                                           cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        # kv_multicast: CTA r of the pair loads box slice r (tile_n / 2 rows) into both CTAs
        kv_rank = 0
        if const_expr(self.kv_multicast):
            kv_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        tKsK, tKgK = cpasync.tma_partition(tma_atom_K, kv_rank, cute.make_layout(self.kv_share),
                                           cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_V, kv_rank, cute.make_layout(self.kv_share),
                                           cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        first_kv = 0
        if const_expr(self.persistent):
            # the first K/V block before Q: its ring slot frees while the consumers still use the
            # previous tile's Q (released after their last S = Q K^T)
            if n_blocks > 0:
                self.load_kv(kv_base, n_block_max - 1, pipe_K, pipe_V, tma_atom_K, tma_atom_V,
                             tKgK, tKsK, tVgV, tVsV)
            first_kv = 1
        # Q: the nc 64-row slabs on one barrier (it expects all slabs' bytes)
        q_state = pipeline.PipelineState(1, Int32(0), Int32(0), q_phase ^ 1)
        pipe_Q.producer_acquire(q_state)
        for wg in cutlass.range_constexpr(self.num_consumers):
            cute.copy(tma_atom_Q, tQgQ[None, m_block * self.num_consumers + wg], tQsQ[None, wg],
                      tma_bar_ptr=pipe_Q.producer_get_barrier(q_state))
        for i in cutlass.range(first_kv, n_blocks, unroll=1):
            self.load_kv(kv_base + i, n_block_max - 1 - i, pipe_K, pipe_V, tma_atom_K, tma_atom_V,
                         tKgK, tKsK, tVgV, tVsV)

    @cute.jit
    def pass_turn(self, wg: Int32, first: cutlass.Constexpr[bool]):
        """The tensor-core turn around the CTA's whole life: before the first tile the last consumer
        hands consumer 0 the first turn; after the last, consumer 0 takes the last hand-over so
        that no arrival outlives the CTA. Named barrier 1 + w is consumer w's turn."""
        nc = self.num_consumers
        if const_expr(self.pingpong):
            if const_expr(first):
                if wg == nc - 1:
                    cute.arch.barrier_arrive(barrier_id=1, number_of_threads=2 * 128)
            else:
                if wg == 0:
                    cute.arch.barrier(barrier_id=1, number_of_threads=2 * 128)

    def seq_view(self, t: cute.Tensor, offset) -> cute.Tensor:
        """(rows, cols) view of one head starting at this sequence's first row (varlen; q_shift: the
        padding rows before row 0, for Q and O, whose offset is then negative; K / V's is 0)."""
        if const_expr(self.varlen or self.q_shift):
            return cute.domain_offset((offset, 0), t)
        return t

    @cute.jit
    def consume(self, wg: Int32, ctidx: Int32, tile, n_block_max: Int32, kv_base: Int32, q_phase: Int32,
                softmax_scale_log2: Float32, mO: cute.Tensor, mLSE: cute.Tensor, smem_tensors,
                tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, sO_layout: cute.ComposedLayout,
                gmem_copy_O: cute.TiledCopy, n_block_min=None, chunk=None, mSplit=None):
        """One consumer warpgroup on one tile: step 3's per-tile math on its own 64 query rows, with
        FA4's softmax (vote + partial emulation) and sequence-relative output rows. kv_base: K/V
        blocks consumed for earlier tiles (the ring position), q_phase: Q's phase for this tile.
        split_tail: keys [n_block_min, n_block_max) only, and a chunk >= 0 leaves its (O, lse) in mSplit."""
        m_block, head, batch, offset_q, seqlen_q, seqlen_k = tile[0], tile[1], tile[3], tile[4], tile[6], tile[7]
        storage, sQ, sK, sV, pipe_Q, pipe_K, pipe_V = smem_tensors
        trace.cta_stamp("start")
        tm, tn, dv = self.wg_m, self.tile_n, self.head_dim_v
        nc = self.num_consumers
        row0 = m_block * self.tile_m + wg * tm  # first query row of this warpgroup
        # named barriers (0 is sync_threads, 16 in all): 1 + w = "consumer w may use the tensor
        # cores", 1 + nc + w = warpgroup w's own 128-thread barrier (ids 1..2 nc <= 6). The turn goes
        # round robin 0 -> 1 -> .. -> nc-1 -> 0: w waits on its own turn barrier, issues, and arrives
        # on its successor's, so each turn barrier joins exactly two warpgroups (256 threads).
        my_turn = 1 + wg
        if const_expr(nc == 2):
            next_turn = 2 - wg  # step 3's form of the same
        else:
            next_turn = 1 + (wg + 1) % nc
        turn_threads = 2 * 128

        sQ_wg = sQ[None, None, wg]                                              # (64, d)
        if const_expr(self.o_in_q):  # (64, dv) at the base of our Q slab (same 128B swizzle phase)
            sO_slab = cute.slice_(sO_layout, (None, None, 0))
            sO_wg = cute.make_tensor(cute.recast_ptr(sQ_wg.iterator, sO_slab.inner, self.dtype), sO_slab.outer)
        elif const_expr(self.o_direct):
            sO_wg = None  # O goes from registers to global memory
        else:
            sO_wg = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)[None, None, wg]
        gO = cute.local_tile(self.seq_view(mO[batch, None, head, None], offset_q), (tm, dv),
                             (m_block * self.num_consumers + wg, 0))

        # MMA partitions: accumulators in registers; the smem operands become wgmma descriptors,
        # built here once per tile (wgmma_desc; step 3's cute.gemm rebuilt them every key block)
        thr_mma_qk = tiled_mma_qk.get_slice(ctidx)
        thr_mma_pv = tiled_mma_pv.get_slice(ctidx)
        qk = wgmma_desc.QKOperands(sQ_wg, sK, self.dtype, self.head_dim, tn)
        pv = wgmma_desc.PVOperands(sV, self.dtype, dv, tn)
        acc_O = cute.make_rmem_tensor(thr_mma_pv.partition_shape_C((tm, dv)), Float32)
        acc_O.fill(0.0)
        acc_O_rc = acc_rowcol(acc_O)
        # (row, col) of each S accumulator element inside the (tm, tn) tile, for masking
        tScS_rc = acc_rowcol(thr_mma_qk.partition_C(cute.make_identity_tensor((tm, tn))))
        # The lean mask (self.lean_mask: three consumers' default, opt-in at two). Thread 0's (row,
        # col) of each element are compile-time constants and any thread's columns are them shifted
        # by its first one (2 * (lane % 4) in the wgmma accumulator; mask_shift_holds checks it), so
        # each compare takes an immediate against one shifted limit per row instead of tn / 4
        # column indices held in registers; and it is a select, not an `if` per element (whose
        # lowering re-selects fragment values at every branch, ~2100 FSEL in the bf16 kernels, and
        # spills 48-252 bytes at 160 registers). tile_m = 128 keeps its measured code by default.
        tScS0_rc = None
        if const_expr(self.lean_mask):
            tScS0_rc = acc_rowcol(tiled_mma_qk.get_slice(0).partition_C(cute.make_identity_tensor((tm, tn))))
        num_rows = cute.size(tScS_rc, mode=[0])  # 2 rows per thread
        row_max = cute.make_rmem_tensor((num_rows,), Float32)      # m: running (possibly stale) max
        row_max_new = cute.make_rmem_tensor((num_rows,), Float32)  # max(m, this tile's row max)
        row_sum = cute.make_rmem_tensor((num_rows,), Float32)
        # Beside m, two values that move only when m does (in the rarely taken rescale branch), so
        # the loop does not recompute them per block: the vote's limit m + tau / scale_log2, and
        # the exponent's bias m * scale_log2 (0 while m = -inf). d = 128: a block whose warp votes
        # no runs 374 SASS instructions instead of 384.
        row_limit = cute.make_rmem_tensor((num_rows,), Float32)
        row_bias = cute.make_rmem_tensor((num_rows,), Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        row_limit.fill(-Float32.inf)
        row_bias.fill(0.0)
        rescale_margin = Float32(self.policy.rescale_threshold) / softmax_scale_log2

        q_state = pipeline.PipelineState(1, Int32(0), Int32(0), q_phase)
        pipe_Q.consumer_wait(q_state)

        # 2. mainloop over key tiles, software-pipelined inside the warpgroup (FA3's intra-warpgroup
        #    overlap): one tensor-core turn issues S_i = Q K^T *and* O += P_{i-1} V, so the softmax
        #    of S_i runs while our own P V (and then the other consumers' GEMMs) occupy the tensor
        #    cores. P_{i-1} stays in registers (tOrP) across the turn; O is rescaled for tile i only
        #    after P_{i-1} V has landed in it. Blocks are walked last first: the blocks that need a
        #    mask (the partial last one, the causal diagonal) come first, then a hot loop with no
        #    mask code at all.
        tOrP = cute.make_rmem_tensor(thr_mma_pv.partition_shape_A((tm, tn)), self.dtype)
        row_scale = cute.make_rmem_tensor((num_rows,), Float32)
        # blocks [0, n_unmasked) need no mask for any row of the CTA: full, and (causal) left of the
        # diagonal of the CTA's first row (key j visible to row i iff j <= i + seqlen_k - seqlen_q)
        n_unmasked = seqlen_k // tn
        if const_expr(self.causal):
            diag = m_block * self.tile_m + 1 + seqlen_k - seqlen_q
            n_unmasked = cutlass.min(n_unmasked, cutlass.max(diag, 0) // tn)
        n_masked = n_block_max - cutlass.min(n_unmasked, n_block_max)  # walked first (i < n_masked)
        n_blocks = n_block_max
        if const_expr(n_block_min is not None):
            n_blocks = n_block_max - n_block_min
            n_masked = cutlass.min(n_masked, n_blocks)
        if n_blocks > 0:
            # 2a. prologue: S_0 alone (O is still 0: nothing to rescale)
            st0 = self.kv_state(kv_base, producer=False)
            pipe_K.consumer_wait(st0)
            acc_S0 = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((tm, tn)), Float32)
            if const_expr(self.pingpong):
                cute.arch.barrier(barrier_id=my_turn, number_of_threads=turn_threads)
            qk.gemm(acc_S0, st0.index)
            if const_expr(self.pingpong):
                cute.arch.barrier_arrive(barrier_id=next_turn, number_of_threads=turn_threads)
            if const_expr(self.varlen):
                # V rows past the sequence belong to the next one, or are unused cache slots
                # (seqused_k) that may hold NaN; P is 0 there but 0 * NaN is not. Only the first
                # block walked (the last one) can be partial: zero its tail (every consumer zeroes
                # the whole tail itself, so what it reads is its own zeros; the others only ever
                # write the same zeros there), then make the writes visible to wgmma.
                if n_block_max * tn > seqlen_k:
                    pipe_V.consumer_wait(st0)
                    self.zero_rows(sV[None, None, st0.index], seqlen_k - (n_block_max - 1) * tn, ctidx, gmem_copy_O)
                    cute.arch.fence_view_async_shared()
                    cute.arch.barrier(barrier_id=1 + nc + wg, number_of_threads=128)
            warpgroup.wait_group(0)
            pipe_K.consumer_release(st0)
            self.online_softmax(acc_S0, n_block_max - 1, True, row0, seqlen_q, seqlen_k, softmax_scale_log2,
                                tScS_rc, row_max, row_max_new, row_sum, row_scale, row_limit,
                                row_bias, rescale_margin, tScS0_rc)
            self.store_P(acc_S0, tOrP)

            # 2b. steady state, masked blocks first, then the hot loop. The ring slot is carried from
            #     block to block (one add, a compare and two selects) rather than divided out of i.
            st_prev = st0
            for i in cutlass.range(1, n_masked, unroll=1):
                st = self.next_kv_state(st_prev)
                self.overlapped_step(st, st_prev, n_block_max - 1 - i, True, row0, seqlen_q, seqlen_k, softmax_scale_log2,
                                     tScS_rc, row_max, row_max_new, row_sum, row_scale, row_limit, row_bias,
                                     rescale_margin, acc_O, tOrP,
                                     qk, pv, thr_mma_qk, pipe_K, pipe_V,
                                     my_turn, next_turn, tScS0_rc)
                st_prev = st
            for i in cutlass.range(cutlass.max(n_masked, 1), n_blocks, unroll=1):
                st = self.next_kv_state(st_prev)
                self.overlapped_step(st, st_prev, n_block_max - 1 - i, False, row0, seqlen_q, seqlen_k, softmax_scale_log2,
                                     tScS_rc, row_max, row_max_new, row_sum, row_scale, row_limit, row_bias,
                                     rescale_margin, acc_O, tOrP,
                                     qk, pv, thr_mma_qk, pipe_K, pipe_V,
                                     my_turn, next_turn, tScS0_rc)
                st_prev = st

            if const_expr(self.persistent):
                pipe_Q.consumer_release(q_state)  # every S of the tile has landed: next tile's Q may load
            # 2c. drain: the last P V
            st_last = st_prev  # the last block walked
            pipe_V.consumer_wait(st_last)
            if const_expr(self.pingpong):
                cute.arch.barrier(barrier_id=my_turn, number_of_threads=turn_threads)
            pv.gemm(acc_O, tOrP, st_last.index)
            if const_expr(self.pingpong):
                cute.arch.barrier_arrive(barrier_id=next_turn, number_of_threads=turn_threads)
            warpgroup.wait_group(0)
            pipe_V.consumer_release(st_last)

        if const_expr(self.persistent):
            if n_blocks == 0:
                pipe_Q.consumer_release(q_state)

        # 3. epilogue: O /= l, lse = m*scale + ln(l); empty rows -> O = 0, lse = -inf
        lse = cute.make_rmem_tensor((num_rows,), Float32)
        for r in cutlass.range_constexpr(num_rows):
            l = quad_allreduce(row_sum[r], lambda a, b: a + b)
            inv = Float32(0.0) if l == 0.0 else cute.arch.rcp_approx(l)
            lse[r] = (-Float32.inf if l == 0.0 else
                      (row_max[r] * softmax_scale_log2 + cute.math.log2(l, fastmath=True)) * math.log(2.0))
            for c in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[1])):
                acc_O_rc[r, c] = acc_O_rc[r, c] * inv

        whole = True
        if const_expr(self.split_tail):
            whole = chunk < 0
            if not whole:  # a key chunk of a tail tile: (O, lse) in fp32 for the combine
                self.store_split(acc_O, lse, mSplit, chunk, wg, ctidx, tiled_mma_pv, tScS_rc)
        if whole:
            # 3a. lse: the thread holding column 0 of a row writes it
            if tScS_rc[0, 0][1] == 0:
                for r in cutlass.range_constexpr(num_rows):
                    row = row0 + tScS_rc[r, 0][0]
                    live = row < seqlen_q  # rows past the sequence belong to the next one: never written
                    if const_expr(self.q_shift):
                        live = live & (offset_q + row >= 0)  # nor the padding rows before it
                    if live:
                        mLSE[batch, head, offset_q + row] = lse[r]

            # 3b. O, row-guarded: through smem (the default) or, o_direct, straight from registers
            rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
            rO.store(acc_O.load().to(self.dtype))
            rows_skip = None
            if const_expr(self.q_shift):
                rows_skip = -offset_q - row0  # padding rows at the top of this warpgroup's rows
            if const_expr(self.o_direct):
                self.store_O_direct(rO, gO, tiled_mma_pv, ctidx, seqlen_q - row0, rows_skip)
            else:
                self.store_O_via_smem(rO, gO, sO_wg, tiled_mma_pv, gmem_copy_O, ctidx, seqlen_q - row0, wg,
                                      rows_skip)
        trace.cta_stamp("end")

    @cute.jit
    def store_split(self, acc_O: cute.Tensor, lse: cute.Tensor, mSplit: cute.Tensor, chunk: Int32, wg: Int32,
                    ctidx: Int32, tiled_mma_pv: cute.TiledMma, tScS_rc: cute.Tensor):
        """split_tail: this warpgroup's rows of chunk `chunk` into the workspace, fp32 -- O (already
        divided by the chunk's own row sums) in columns [0, dv), lse in column dv. Every row is
        written, past the sequence's end too (the combine reads only live rows); once per tail tile."""
        tm, dv = self.wg_m, self.head_dim_v
        tOcO = tiled_mma_pv.get_slice(ctidx).partition_C(cute.make_identity_tensor((tm, dv)))
        first = wg * tm
        for i in cutlass.range_constexpr(cute.size(acc_O)):
            mSplit[chunk, first + tOcO[i][0], tOcO[i][1]] = acc_O[i]
        if tScS_rc[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                mSplit[chunk, first + tScS_rc[r, 0][0], dv] = lse[r]

    def _copy_acc_O(self, tiled_mma_pv: cute.TiledMma, ctidx: Int32):
        """(32-bit copy atom, this thread's slice of it tiled over O's accumulator layout): two adjacent
        columns per copy, for O leaving the registers (to smem, or o_direct to global memory)."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32)
        return atom, cute.make_tiled_copy_C(atom, tiled_mma_pv).get_slice(ctidx)

    @cute.jit
    def store_O_direct(self, rO: cute.Tensor, gO: cute.Tensor, tiled_mma_pv: cute.TiledMma, ctidx: Int32,
                       q_rows_left: Int32, q_rows_skip=None):
        """O straight from the accumulator registers to global memory, 4 bytes (two adjacent columns)
        per store, rows past the sequence skipped. No shared memory: a persistent CTA at head dims
        > 128 has no room for an O buffer beside Q and two K/V stages. The stores half-fill each
        32-byte sector (a quad writes 16 contiguous bytes of a row), which matters little once per tile."""
        atom, thr_copy_O = self._copy_acc_O(tiled_mma_pv, ctidx)
        # mode 0 of each partition is all of a thread's values, (2 adjacent columns, rest):
        # src ((2, 32), 1, 1), dst and crd ((2, (2 rows 8 apart, 16 column groups)), 1, 1) at dv = 128
        src = thr_copy_O.retile(rO)
        dst = thr_copy_O.partition_D(gO)
        crd = thr_copy_O.partition_D(cute.make_identity_tensor((self.wg_m, self.head_dim_v)))
        for m in cutlass.range_constexpr(cute.size(dst, mode=[1])):
            for n in cutlass.range_constexpr(cute.size(dst, mode=[2])):
                for i in cutlass.range_constexpr(cute.size(dst, mode=[0, 1])):
                    if row_stored(crd[(0, i), m, n][0], q_rows_left, q_rows_skip):
                        cute.copy(atom, src[(None, i), m, n], dst[(None, i), m, n])

    @cute.jit
    def store_O_via_smem(self, rO: cute.Tensor, gO: cute.Tensor, sO_wg: cute.Tensor, tiled_mma_pv: cute.TiledMma,
                         gmem_copy_O: cute.TiledCopy, ctidx: Int32, q_rows_left: Int32, wg: Int32,
                         q_rows_skip=None):
        """O through this warpgroup's smem slab: registers -> smem (accumulator layout) -> 16-byte
        coalesced, row-guarded stores. Only this warpgroup touches its slab, so a 128-thread named
        barrier replaces sync_threads (the producer warpgroup may have exited already)."""
        tm, dv, nc = self.wg_m, self.head_dim_v, self.num_consumers
        if const_expr(self.o_in_q or self.persistent):
            # o_in_q: our last QK^T has read sQ_wg; persistent: every thread has read the last tile's O
            cute.arch.barrier(barrier_id=1 + nc + wg, number_of_threads=128)
        atom, thr_smem_copy_O = self._copy_acc_O(tiled_mma_pv, ctidx)
        cute.copy(atom, thr_smem_copy_O.retile(rO), thr_smem_copy_O.partition_D(sO_wg))
        cute.arch.barrier(barrier_id=1 + nc + wg, number_of_threads=128)
        thr_copy_O = gmem_copy_O.get_slice(ctidx)
        tOsO, tOgO = thr_copy_O.partition_S(sO_wg), thr_copy_O.partition_D(gO)
        tOcO = thr_copy_O.partition_S(cute.make_identity_tensor((tm, dv)))
        tOrO = cute.make_rmem_tensor_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        for m in cutlass.range_constexpr(cute.size(tOgO.shape[1])):
            if row_stored(tOcO[0, m, 0][0], q_rows_left, q_rows_skip):
                cute.copy(gmem_copy_O, tOrO[None, m, None], tOgO[None, m, None])

    @cute.jit
    def overlapped_step(self, st: pipeline.PipelineState, st_prev: pipeline.PipelineState, n_block: Int32,
                        mask: cutlass.Constexpr[bool], row0: Int32,
                        seqlen_q: Int32, seqlen_k: Int32, softmax_scale_log2: Float32, tScS_rc: cute.Tensor,
                        row_max: cute.Tensor, row_max_new: cute.Tensor, row_sum: cute.Tensor,
                        row_scale: cute.Tensor, row_limit: cute.Tensor, row_bias: cute.Tensor,
                        rescale_margin: Float32, acc_O: cute.Tensor, tOrP: cute.Tensor, qk: wgmma_desc.QKOperands,
                        pv: wgmma_desc.PVOperands, thr_mma_qk, pipe_K, pipe_V, my_turn: Int32, next_turn: Int32,
                        tScS0_rc: Optional[cute.Tensor]):
        """The i-th key block walked (block n_block, ring slot st; st_prev the (i-1)-th's): one turn
        issues S_i and O += P_{i-1} V_{i-1}."""
        tm, tn = self.wg_m, self.tile_n
        turn_threads = 2 * 128
        trace.stamp(n_block, "top")
        pipe_K.consumer_wait(st)
        acc_S = cute.make_rmem_tensor(thr_mma_qk.partition_shape_C((tm, tn)), Float32)
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=my_turn, number_of_threads=turn_threads)
        trace.stamp(n_block, "turn")
        qk.gemm(acc_S, st.index)
        # V_{i-1} is waited for only now, with S_i already issued: its wait no longer delays S_i
        # (d = 64: +1..+3% at all 8 points of two paired runs; d = 96 +0..+3%; d >= 128 a tie)
        pipe_V.consumer_wait(st_prev)
        pv.gemm(acc_O, tOrP, st_prev.index)
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=next_turn, number_of_threads=turn_threads)
        trace.stamp(n_block, "issued")
        warpgroup.wait_group(1)  # S_i has landed (P_{i-1} V_{i-1} may still run)
        trace.stamp(n_block, "s_landed")
        pipe_K.consumer_release(st)
        rescale_O = self.online_softmax(acc_S, n_block, mask, row0, seqlen_q, seqlen_k, softmax_scale_log2,
                                         tScS_rc, row_max, row_max_new, row_sum, row_scale, row_limit,
                                         row_bias, rescale_margin, tScS0_rc)
        trace.stamp(n_block, "softmax")
        # Wait for P_{i-1} V_{i-1} (then O and tOrP are ours again): ptxas hoists it to the top of
        # the basic block, above most exp2s. Packing P before the rescale branch keeps the packs in
        # that block, interleaved with the exp2s still in flight (run 70: +1..+7% below d = 256).
        warpgroup.wait_group(0)
        trace.stamp(n_block, "pv_landed")
        pipe_V.consumer_release(st_prev)
        self.store_P(acc_S, tOrP)
        if rescale_O:
            self.scale_O_rows(acc_O, row_scale)
        trace.stamp(n_block, "end")

    @cute.jit
    def scale_O_rows(self, acc_O: cute.Tensor, row_scale: cute.Tensor):
        acc_O_rc = acc_rowcol(acc_O)
        for r in cutlass.range_constexpr(cute.size(row_scale)):
            for c in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[1])):
                acc_O_rc[r, c] = acc_O_rc[r, c] * row_scale[r]

    @cute.jit
    def online_softmax(self, acc_S: cute.Tensor, n_block: Int32, mask: cutlass.Constexpr[bool], row0: Int32,
                       seqlen_q: Int32, seqlen_k: Int32, softmax_scale_log2: Float32, tScS_rc: cute.Tensor,
                       row_max: cute.Tensor, row_max_new: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor,
                       row_limit: cute.Tensor, row_bias: cute.Tensor, rescale_margin: Float32,
                       tScS0_rc: Optional[cute.Tensor] = None):
        """S_j (accumulator) -> P_j = 2^(S*scale - m*scale) in place, with the mask, the running max
        and sum. Returns the warp's vote: True when O must be multiplied by row_scale (the caller
        does it once the in-flight P V that writes O has landed). mask=False: a block the caller
        knows to be fully visible to every row (no mask code is generated). tScS0_rc: thread 0's
        coordinates (compile-time), when given the mask compares against them (see consume)."""
        tn = self.tile_n
        acc_S_rc = acc_rowcol(acc_S)
        num_rows = cute.size(row_max)
        # mask keys >= seqlen_k, and (causal) keys past each row's diagonal
        if const_expr(mask):
            for r in cutlass.range_constexpr(num_rows):
                col_limit = seqlen_k - n_block * tn  # in this tile's column coordinates
                if const_expr(self.causal):
                    row = row0 + tScS_rc[r, 0][0]
                    col_limit = cutlass.min(col_limit, row + 1 + seqlen_k - seqlen_q - n_block * tn)
                if const_expr(tScS0_rc is None):
                    for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
                        if tScS_rc[r, c][1] >= col_limit:
                            acc_S_rc[r, c] = -Float32.inf
                else:
                    col_limit -= tScS_rc[0, 0][1]  # into thread 0's column coordinates (a select each)
                    for c in cutlass.range_constexpr(cute.size(acc_S_rc, mode=[1])):
                        acc_S_rc[r, c] = -Float32.inf if tScS0_rc[r, c][1] >= col_limit else acc_S_rc[r, c]
        # this tile's row maxima, one row pair per thread (quad-reduced)
        for r in cutlass.range_constexpr(num_rows):
            m_tile = acc_S_rc[r, 0]
            for c in cutlass.range_constexpr(1, cute.size(acc_S_rc, mode=[1])):
                m_tile = cute.arch.fmax(m_tile, acc_S_rc[r, c])
            m_tile = quad_allreduce(m_tile, cute.arch.fmax)
            row_max_new[r] = cute.arch.fmax(row_max[r], m_tile)
        # conditional rescaling: one warp-uniform vote (16 rows) -- only when some row's max grew by
        # more than tau do the warp's rows move to their new max (l now, O by the caller)
        rescale = softmax_policy.rescale_vote_limits(row_max_new, row_limit)
        if rescale:
            for r in cutlass.range_constexpr(num_rows):
                # a row with nothing visible yet keeps m = -inf: subtract 0 instead (no inf - inf)
                m_safe = Float32(0.0) if row_max_new[r] == -Float32.inf else row_max_new[r]
                row_scale[r] = ex2_approx_f32((row_max[r] - m_safe) * softmax_scale_log2)
                row_max[r] = row_max_new[r]
                row_limit[r] = row_max_new[r] + rescale_margin
                row_bias[r] = m_safe * softmax_scale_log2
                row_sum[r] = row_sum[r] * row_scale[r]
        # P = 2^(S*scale - m*scale) <= 2^tau, a compile-time share of it on the FMA pipe
        for r in cutlass.range_constexpr(num_rows):
            row_sum[r] += softmax_policy.exp2_row(acc_S_rc[r, None], softmax_scale_log2, row_bias[r], self.policy)
            # (row_sum is a per-thread partial; quad-reduced in the epilogue)
        return rescale

    @cute.jit
    def store_P(self, acc_S: cute.Tensor, tOrP: cute.Tensor):
        """P (fp32 accumulator) -> the 16-bit A-operand fragment of O += P V: the same registers in
        accumulator order (step 1's docstring), converted in place, a pair per 32-bit word. Each pair
        is a volatile cvt (the same F2FP as step 3's `.to(dtype)`), so it stays where it is written
        instead of sinking to its first use (the next P V) past the O rescale's branch."""
        words = cute.make_tensor(cute.recast_ptr(tOrP.iterator, dtype=Int32), cute.make_layout(cute.size(acc_S) // 2))
        for k in cutlass.range_constexpr(cute.size(acc_S) // 2):
            words[k] = pack_pair_pinned(acc_S[2 * k], acc_S[2 * k + 1], self.dtype == cutlass.BFloat16)

    @cute.jit
    def zero_rows(self, sV_stage: cute.Tensor, first_row: Int32, ctidx: Int32, copy_16B: cute.TiledCopy):
        """sV_stage[first_row:, :] = 0: the epilogue's 128-thread, 16-byte tiled copy (it tiles any
        (rows, dv) tile) writes a zero fragment, row-predicated; tile_n * dv / 1024 stores a thread."""
        thr = copy_16B.get_slice(ctidx)
        tZsV = thr.partition_D(sV_stage)
        tZcV = thr.partition_D(cute.make_identity_tensor((self.tile_n, self.head_dim_v)))
        tZrZ = cute.make_rmem_tensor_like(tZsV, self.dtype)
        tZrZ.fill(0.0)
        for m in cutlass.range_constexpr(cute.size(tZsV.shape[1])):
            if tZcV[0, m, 0][0] >= first_row:
                cute.copy(copy_16B, tZrZ[None, m, None], tZsV[None, m, None])

    # -------------------------------------------------------------- pipeline bookkeeping
    def kv_state(self, i: Int32, producer: bool) -> pipeline.PipelineState:
        """Pipeline slot of the i-th key block walked: stage i % stages; the phase flips every lap
        round the ring. A producer starts one phase ahead: its first lap must not wait for "empty".
        The consumers' loops carry the slot instead (next_kv_state)."""
        index, phase = intdiv.ring_slot(i, self.num_stages)
        if const_expr(producer):
            phase = phase ^ 1
        return pipeline.PipelineState(self.num_stages, i, index, phase)

    @cute.jit
    def next_kv_state(self, st: pipeline.PipelineState) -> pipeline.PipelineState:
        """The ring slot after st: the next stage, the phase flipped on wrapping round."""
        nxt = st.clone()
        nxt.advance()
        return nxt

    def kv_copy_kwargs(self) -> dict:
        """cute.copy's extra arguments for a K/V load: kv_multicast delivers it to both CTAs of the pair."""
        return {"mcast_mask": cutlass.Int16((1 << self.kv_share) - 1)} if self.kv_multicast else {}

    @cute.jit
    def load_kv(self, i: Int32, n_block: Int32, pipe_K, pipe_V, tma_atom_K: cute.CopyAtom,
                tma_atom_V: cute.CopyAtom, tKgK: cute.Tensor, tKsK: cute.Tensor, tVgV: cute.Tensor,
                tVsV: cute.Tensor):
        """(producer warp) the i-th load, key block n_block: wait until ring slot i is free, post the
        byte count, issue K then V."""
        st = self.kv_state(i, producer=True)
        mcast = self.kv_copy_kwargs()
        pipe_K.producer_acquire(st)
        cute.copy(tma_atom_K, tKgK[None, n_block], tKsK[None, st.index], tma_bar_ptr=pipe_K.producer_get_barrier(st),
                  **mcast)
        pipe_V.producer_acquire(st)
        cute.copy(tma_atom_V, tVgV[None, n_block], tVsV[None, st.index], tma_bar_ptr=pipe_V.producer_get_barrier(st),
                  **mcast)


# ------------------------------------------------------------------------------------------------
# Host API
# ------------------------------------------------------------------------------------------------
def make_policy(rescale_threshold=DEFAULT_RESCALE_THRESHOLD, emulation_fraction=DEFAULT_EMULATION_FRACTION,
                policy: SoftmaxPolicy | None = None) -> SoftmaxPolicy:
    """The SoftmaxPolicy of a call: `policy` when given, else built (and validated) from the two knobs."""
    if policy is not None:
        if not isinstance(policy, SoftmaxPolicy):
            raise TypeError(f"policy: expected a SoftmaxPolicy, got {type(policy).__name__}")
        return policy
    if (rescale_threshold, emulation_fraction) == (DEFAULT_RESCALE_THRESHOLD, DEFAULT_EMULATION_FRACTION) and \
            type(rescale_threshold) is type(emulation_fraction) is float:
        return DEFAULT_POLICY  # the common call: skip re-validating the defaults (host time per call)
    return SoftmaxPolicy(rescale_threshold=rescale_threshold, emulation_fraction=emulation_fraction)


def make_kernel(dtype, head_dim, head_dim_v, causal, *, policy: SoftmaxPolicy = DEFAULT_POLICY,
                scheduler=common.StaticTileScheduler, tile_m: int | None = None, lean_mask: bool | None = None,
                kv_multicast: bool | str = False, split_tail: bool = False):
    """The kernel object; tile_m None = default_tile_m(head_dim, head_dim_v), lean_mask None =
    default_lean_mask(tile_m)."""
    tile_m = _check_tile_m(tile_m, head_dim, head_dim_v)
    return FlashAttentionForwardSm90Step4(dtype, head_dim, head_dim_v, causal, policy=policy, scheduler=scheduler,
                                          tile_m=tile_m, lean_mask=lean_mask, kv_multicast=kv_multicast,
                                          split_tail=split_tail)


KV_MULTICAST_MODES = (False, True, "m", "heads")


def _kv_mode(kv_multicast) -> str | None:
    """kv_multicast's value -> None, "m" or "heads" (True means "m"); a clear error otherwise."""
    if isinstance(kv_multicast, bool) or kv_multicast is None:
        return "m" if kv_multicast else None
    if isinstance(kv_multicast, str):
        if kv_multicast not in ("m", "heads"):
            raise ValueError(f"kv_multicast: expected one of {KV_MULTICAST_MODES}, got {kv_multicast!r}")
        return kv_multicast
    raise TypeError(f"kv_multicast: expected a bool or 'm' / 'heads', got {type(kv_multicast).__name__}")


def _check_kv_multicast(kv_multicast, causal, scheduler, varlen=False) -> str | None:
    """kv_multicast of a kernel -> None, "m" or "heads" (True means "m").

    "m": query tiles 2 m and 2 m + 1 of one head share their K/V blocks; needs a dense non-causal
    call (the two tiles must see the same key blocks; a varlen pair may straddle two sequences, which
    the kernel also refuses at trace time) and a fixed tile order (the pair is one unit of the order;
    the atomic hand-out of dynamic persistent CTAs is per CTA). "heads": query heads 2 j and 2 j + 1
    (one KV head: the call's heads per KV head must be even, _check_head_pairs) share one query
    tile's K/V blocks; any mask, dense or varlen, one CTA per tile on the static grid (blockIdx.y
    pairs the heads)."""
    mode = _kv_mode(kv_multicast)
    if mode == "m" and varlen:
        raise ValueError("kv_multicast: query-tile pairs ('m') need dense calls, not varlen (a pair may straddle two "
                         "sequences); use 'heads'")
    persistent = getattr(scheduler, "persistent", False)
    if mode == "m" and causal:
        raise ValueError("kv_multicast: query-tile pairs ('m') need causal=False (the two query tiles of a pair "
                         "must see the same key blocks); 'heads' pairs work with causal")
    if mode == "m" and getattr(scheduler, "dynamic", False):
        raise ValueError("kv_multicast: needs a fixed tile order, not a dynamic persistent scheduler")
    if mode == "m" and not persistent and scheduler is not common.StaticTileScheduler:
        raise ValueError("kv_multicast: one CTA per tile pairs blockIdx.x 2m and 2m + 1, which only the static grid "
                         f"orders that way; got scheduler {scheduler!r} (wrap it in a PersistentScheduler)")
    if mode == "heads" and scheduler is not common.StaticTileScheduler:
        raise ValueError("kv_multicast: head pairs ('heads') run one CTA per tile on the static grid (blockIdx.y "
                         f"pairs the heads); got scheduler {scheduler!r} (pass persistent=False)")
    return mode


def _check_head_pairs(kv_multicast, heads_q: int, heads_kv: int):
    """kv_multicast 'heads' pairs query heads 2 j and 2 j + 1, which must read the same KV head."""
    if _kv_mode(kv_multicast) == "heads" and (heads_q // heads_kv) % 2:
        raise ValueError(f"kv_multicast: 'heads' needs an even number of query heads per KV head, got "
                         f"{heads_q} query heads on {heads_kv} KV heads")


def default_lean_mask(tile_m: int) -> bool:
    """The mask of the masked key blocks: lean (compile-time columns + one select per score) at every
    tile_m -- at three consumers the per-element `if` spills at 160 registers, at two the lean one
    was +1..+14% at d = 128 on the H100 (tune_fwd_h100_run3_lean_mask.json) with bitwise-equal
    outputs. lean_mask=False keeps the old mask buildable for that comparison."""
    return True


def _check_lean_mask(lean_mask, tile_m) -> bool:
    """lean_mask of a call: None = default_lean_mask(tile_m), else a bool (False at tile_m = 192 builds
    the old mask there too, which spills: for comparison only)."""
    if lean_mask is None:
        return default_lean_mask(tile_m)
    if not isinstance(lean_mask, bool):
        raise TypeError(f"lean_mask: expected None or a bool, got {type(lean_mask).__name__}")
    return lean_mask


def mask_shift_holds(kernel: FlashAttentionForwardSm90Step4) -> bool:
    """Host-side check of the lean mask's premise on the kernel's own S MMA: for every thread of a
    consumer warpgroup, each accumulator element's (row, col) is (its own row, thread 0's col + the
    thread's first col), and the 128 threads cover the 64 x tile_n tile exactly once. Traced, not run
    (the coordinates of a constant thread index are compile-time), so it needs no GPU."""
    tm, tn = kernel.wg_m, kernel.tile_n
    coords = []

    def collect():  # plain Python (not AST-rewritten): 128 x 2 x tn / 4 static coordinates
        mma, ident = kernel._tiled_mma_qk(), cute.make_identity_tensor((tm, tn))
        for t in range(128):
            rc = acc_rowcol(mma.get_slice(t).partition_C(ident))
            coords.append([[tuple(rc[r, c]) for c in range(cute.size(rc, mode=[1]))]
                           for r in range(cute.size(rc, mode=[0]))])

    @cute.jit
    def trace():
        collect()
    cute.compile(trace)
    shifted = all(x == (rows[0][0], coords[0][r][c][1] + coords[t][0][0][1])
                  for t in range(128) for r, rows in enumerate(coords[t]) for c, x in enumerate(rows))
    cover = sorted(x for thr in coords for rows in thr for x in rows) == [(i, j) for i in range(tm) for j in range(tn)]
    return shifted and cover and coords[0][0][0] == (0, 0)


def _check_tile_m(tile_m, d, dv) -> int:
    """tile_m of a call: the head dims' default when None, else one of TILE_MS (192: d, dv <= 64)."""
    if tile_m is None:
        return default_tile_m(d, dv)
    if isinstance(tile_m, bool) or not isinstance(tile_m, int) or tile_m not in TILE_MS:
        raise ValueError(f"tile_m: expected None or one of {TILE_MS}, got {tile_m!r}")
    if tile_m == 192 and max(d, dv) > 64:
        raise ValueError(f"tile_m: 192 needs head dims <= 64, got ({d}, {dv})")
    return tile_m


def _key(mode, dtype, d, dv, causal, policy, scheduler, varlen_flags=(False, False, False), tile_m=None,
         lean_mask=None, kv_multicast=False, split_tail=False):
    """Compile-cache key: everything that is a compile-time constant of the kernel. varlen_flags =
    (varlen, has seqused_k, has batch_map): each present/absent optional tensor is its own kernel.
    tile_m and lean_mask enter resolved, so a default and its explicit value share one kernel;
    kv_multicast only when on (the keys, and disk caches, of every other kernel stay as they were)."""
    tile_m = _check_tile_m(tile_m, d, dv)
    lean_mask = _check_lean_mask(lean_mask, tile_m)
    pairs = {None: (), "m": ("kv_multicast",), "heads": ("kv_multicast_heads",)}[_kv_mode(kv_multicast)]
    return (STEP, mode, str(dtype), d, dv, bool(causal), policy, scheduler, tuple(varlen_flags), tile_m,
            lean_mask) + pairs + (("split_tail",) if split_tail else ()) + trace.key()


def _call_args(q4, k4, v4, out4, lse3, softmax_scale, max_seqlen_q, cu_seqlens_q=None, cu_seqlens_k=None,
               seqused_k=None, batch_map=None, max_ctas=1, tile_counter=None, split=None, split_chunks=1):
    """The launch's arguments, in ``__call__`` order without the stream, from torch tensors (dense
    (B, S, H, D) or packed viewed as (1, T, H, D)): TVM-FFI takes them as they are (see
    common.launch_stream)."""
    def opt(t):
        return None if t is None else t.detach()
    return (q4.detach(), k4.detach(), v4.detach(), out4.detach(), lse3.detach(), softmax_scale * common.LOG2_E,
            softmax_scale, opt(cu_seqlens_q), opt(cu_seqlens_k), opt(seqused_k), opt(batch_map), tile_counter,
            max_seqlen_q, max_ctas, split, split_chunks)


def _fake_args(dtype, d, dv, varlen_flags, *, launchable: bool = False, dynamic: bool = False,
               split_tail: bool = False):
    """``__call__``'s arguments for cute.compile; launchable=True for a kernel `_call_args` runs;
    dynamic: the scheduler takes a tile counter; split_tail: the split workspace."""
    varlen, has_used, has_map = varlen_flags
    i32 = common.fake_i32_vector
    return (common.fake_bshd(dtype, d), common.fake_bshd(dtype, d), common.fake_bshd(dtype, dv),
            common.fake_bshd(dtype, dv), common.fake_lse(), Float32(1.0), Float32(1.0),
            i32() if varlen else None, i32() if varlen else None, i32() if has_used else None,
            i32() if has_map else None, i32() if dynamic else None, Int32(1), Int32(1),
            common.fake_lse() if split_tail else None, Int32(1),
            common.launch_stream() if launchable else cute.runtime.make_fake_stream())


# The rescale vote's limit m + tau / (scale * log2 e) must be finite in fp32 for tau <= 64: true from
# this scale up (fa4's validation uses the same bound). Real scales are ~1/sqrt(d).
MIN_SOFTMAX_SCALE = 2.0 ** -100


def _check_scale(softmax_scale, head_dim):
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise TypeError(f"softmax_scale: expected a float, got {type(softmax_scale).__name__}")
    if not (math.isfinite(softmax_scale) and softmax_scale >= MIN_SOFTMAX_SCALE):
        # the kernel takes row maxima of the raw scores: a negative scale would flip max and min
        raise ValueError(f"softmax_scale: expected a finite value >= 2**-100, got {softmax_scale}")
    return float(softmax_scale)


def _check_head_dims(d, dv):
    if (d, dv) not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim: expected (qk, v) head dims in {SUPPORTED_HEAD_DIMS}, got ({d}, {dv})")


SUPPORTED_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (192, 128), (256, 256))


def _compile(launchable: bool, dt, d, dv, causal, policy, scheduler, varlen_flags, tile_m, lean_mask,
             kv_multicast=False, split_tail=False):
    """The one place a step-4 kernel is compiled (against fake tensors): launchable=True builds
    what attention_forward launches (TVM-FFI, key "gpu"), False a compile-only build (key "fake")."""
    key = _key("gpu" if launchable else "fake", dt, d, dv, causal, policy, scheduler, varlen_flags, tile_m, lean_mask,
               kv_multicast, split_tail)
    return common.compile_cached(key, lambda: (
        make_kernel(dt, d, dv, causal, policy=policy, scheduler=scheduler, tile_m=tile_m, lean_mask=lean_mask,
                    kv_multicast=kv_multicast, split_tail=split_tail),
        _fake_args(dt, d, dv, varlen_flags, launchable=launchable, dynamic=getattr(scheduler, "dynamic", False),
                   split_tail=split_tail)))


# Persistent CTAs by default up to this head dim, where Q, O and two K/V stages fit in shared memory.
# Above it persistent=True stores O from registers (o_direct): correct, but no faster than one CTA
# per tile in paired H100 rounds (benchmarks/results/ab_fwd_h100_run26_o_direct.json), so not a default.
PERSISTENT_MAX_HEAD_DIM = 128


# Causal calls with three consumer warpgroups (d = 64) stay one CTA per tile from this many keys on,
# where persistent CTAs tied or lost (run 18, below).
PERSISTENT_CAUSAL_TILE_M192_MAX_SEQLEN_K = 4096


def default_persistent(head_dim: int, head_dim_v: int, causal: bool, varlen: bool = False,
                       seqlen_k: int | None = None, tile_m: int | None = None) -> bool:
    """Whether a call walks its tiles with persistent CTAs by default: dense calls wherever Q, O and
    two K/V stages fit (head dims <= 128), except long causal calls at d = 64. seqlen_k None:
    the short-call choice (what a build without a length compiles).

    H100, paired rounds against the official kernel through fa4 (benchmarks/results/):
    * non-causal, fixed striding (run 16, one CTA per tile -> persistent): d = 64 0.950-0.956 ->
      0.970-1.028, d = 128 0.935-0.954 -> 0.966-1.055 (1k-16k): every CTA pays its launch, barrier
      set-up, first Q and K loads and O store once instead of once per tile.
    * causal needs the dynamic hand-out (an atomic tile counter): with fixed striding it lost
      3..32% (run 17), since causal tiles differ in length and CTAs that drew long ones finish
      late. Dynamic (run 18): d = 128 1.01 / 0.96 / 1.00 / 0.98 / 0.98 -> 1.23 / 1.09 / 1.06 / 1.01 /
      1.00 at 1k / 2k / 4k / 8k / 16k; d = 64 0.97 / 0.96 -> 1.06 / 1.01 at 1k / 2k, and at 4k-16k
      0.945-0.963 -> 0.941-0.955, a tie or a loss, hence PERSISTENT_CAUSAL_TILE_M192_MAX_SEQLEN_K.
    * varlen batches stay one CTA per tile unless asked (persistent=True, dynamic: correct, not
      measured)."""
    if varlen or max(head_dim, head_dim_v) > PERSISTENT_MAX_HEAD_DIM:
        return False
    if causal and (tile_m or default_tile_m(head_dim, head_dim_v)) == 192:
        return seqlen_k is None or seqlen_k < PERSISTENT_CAUSAL_TILE_M192_MAX_SEQLEN_K
    return True


def _resolve_scheduler(scheduler, persistent, head_dim, head_dim_v, causal, varlen=False, seqlen_k=None,
                       tile_m=None, kv_multicast=False):
    """The call's scheduler: `scheduler` (default StaticTileScheduler), walked by one CTA per SM when
    persistent (None: default_persistent(head_dim, head_dim_v, causal, varlen, seqlen_k, tile_m), or
    False for kv_multicast="heads", whose pairs run one CTA per tile). A scheduler that is persistent
    itself (common.PersistentScheduler) is used as it is. Checks kv_multicast against the result."""
    scheduler = _resolve_order(scheduler, persistent, head_dim, head_dim_v, causal, varlen, seqlen_k, tile_m,
                               _kv_mode(kv_multicast))
    _check_kv_multicast(kv_multicast, causal, scheduler, varlen)
    return scheduler


def _resolve_order(scheduler, persistent, head_dim, head_dim_v, causal, varlen, seqlen_k, tile_m, kv_mode):
    """_resolve_scheduler without the kv_multicast check."""
    if persistent is not None and not isinstance(persistent, bool):
        raise TypeError(f"persistent: expected None or a bool, got {type(persistent).__name__}")
    scheduler = scheduler or common.StaticTileScheduler
    if getattr(scheduler, "persistent", False):
        return scheduler
    if persistent is None:
        persistent = kv_mode != "heads" and default_persistent(head_dim, head_dim_v, causal, varlen, seqlen_k, tile_m)
    if persistent:
        # tiles of different lengths need the dynamic hand-out (see default_persistent)
        scheduler = _persistent_over(scheduler, causal or varlen)
    return scheduler


@functools.lru_cache(maxsize=64)
def _persistent_over(order, dynamic: bool) -> common.PersistentScheduler:
    """The per-call wrapper, built (and validated) once per order: the launch path is host-bound."""
    return common.PersistentScheduler(order, dynamic=dynamic)


def _check_grid(scheduler, num_m_blocks: int, heads: int, batch: int):
    """A tile order's own host-side limit on the grid (stage 5's flat LPT map), if it has one."""
    check = getattr(getattr(scheduler, "order", scheduler), "check_grid", None)
    if check is not None:
        check(num_m_blocks, heads, batch)


def _launch_ctas(scheduler, device) -> int:
    return scheduler.launch_ctas(device) if getattr(scheduler, "persistent", False) else 1


def _tile_counter(scheduler, device):
    """A dynamic persistent scheduler's tile counter: one zeroed int32 per launch."""
    import torch

    return torch.zeros(1, dtype=torch.int32, device=device) if getattr(scheduler, "dynamic", False) else None


def attention_forward(q, k, v, *, softmax_scale=None, causal=False, out=None, lse=None,
                      rescale_threshold=DEFAULT_RESCALE_THRESHOLD, emulation_fraction=DEFAULT_EMULATION_FRACTION,
                      policy: SoftmaxPolicy | None = None, scheduler=None, tile_m: int | None = None,
                      lean_mask: bool | None = None, persistent: bool | None = None,
                      kv_multicast: bool | str = False, split_tail: bool | None = None):
    """q (B,Sq,Hq,D), k (B,Sk,Hkv,D), v (B,Sk,Hkv,Dv) CUDA fp16/bf16 -> (out (B,Sq,Hq,Dv), lse (B,Hq,Sq) fp32).

    rescale_threshold (tau, log2 units) and emulation_fraction pick the softmax policy (compile-time:
    each distinct pair is its own kernel); `policy` overrides both. `scheduler` (default
    StaticTileScheduler) is a class with the common.StaticTileScheduler interface. tile_m: query
    rows per CTA, 128 or 192 (2 or 3 consumer warpgroups); None = default_tile_m(D, Dv). lean_mask:
    the masked blocks' mask (see consume), None = default_lean_mask(tile_m) (lean at 192 rows only).
    persistent: one CTA per SM walks the scheduler's tile order (common.PersistentScheduler; causal
    calls take their tiles from an atomic counter; above head dim 128 O goes from registers to global
    memory, o_direct); None = default_persistent(D, Dv, causal, seqlen_k=Sk, tile_m=tile_m).
    kv_multicast: clusters of two CTAs share every K/V block (each loads half and TMA multicasts it
    to both): half the K/V traffic from L2. True / "m": neighbouring query tiles of a head
    (non-causal); "heads": query heads 2 j and 2 j + 1 of one KV head (any mask; heads per KV head
    even; one CTA per tile, so persistent defaults to False). Correct on the H100 (74 gpu tests),
    no faster: off by default. split_tail: the last partial wave of a static persistent non-causal
    call cut along the keys (split_tail_plan; None = its default).
    """
    import torch

    policy = make_policy(rescale_threshold, emulation_fraction, policy)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch tensor, got {type(t).__name__}")
    q, k, v = common.prepare_inputs(q, k, v)
    b, sq, hq, d = q.shape
    dv = v.shape[-1]
    _check_head_dims(d, dv)
    tile_m = _check_tile_m(tile_m, d, dv)
    lean_mask = _check_lean_mask(lean_mask, tile_m)
    dt = common.cutlass_dtype(q.dtype)
    policy.check_dtype(dt)
    softmax_scale = _check_scale(softmax_scale, d)
    if b > 65535 or hq > 65535:
        raise ValueError(f"batch ({b}) and heads ({hq}) must be <= 65535 (grid y / z limit)")
    scheduler = _resolve_scheduler(scheduler, persistent, d, dv, causal, seqlen_k=k.shape[1], tile_m=tile_m,
                                   kv_multicast=kv_multicast)
    _check_head_pairs(kv_multicast, hq, k.shape[2])
    _check_grid(scheduler, -(-sq // tile_m), hq, b)
    if out is None:
        out = torch.empty((b, sq, hq, dv), dtype=q.dtype, device=q.device)
    common.check_out_tensor("out", out, (b, sq, hq, dv), q.dtype, q.device, align_bytes=16)
    if lse is None:
        lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    common.check_out_tensor("lse", lse, (b, hq, sq), torch.float32, q.device, align_bytes=4)
    if b == 0 or sq == 0 or hq == 0:
        return out, lse
    if k.shape[1] == 0:  # nothing visible anywhere (and a TMA map cannot have a 0 extent)
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    ctas = _launch_ctas(scheduler, q.device)
    plan = split_tail_plan(split_tail, scheduler, causal, kv_multicast, b, sq, hq, k.shape[1], tile_m,
                           default_tile_n(d, dv), ctas)
    split = None
    if plan is not None:
        split = torch.empty((plan[0] * plan[1], tile_m, dv + 1), dtype=torch.float32, device=q.device)
    args = _call_args(q, k, v, out, lse, softmax_scale, sq, max_ctas=ctas,
                      tile_counter=_tile_counter(scheduler, q.device), split=split,
                      split_chunks=plan[1] if plan else 1)
    _compile(True, dt, d, dv, causal, policy, scheduler, (False, False, False), tile_m, lean_mask,
             kv_multicast, plan is not None).fn(*args)
    if plan is not None:
        split_tail_combine(split, *plan, out, lse, -(-sq // tile_m))
    return out, lse


# split_tail by default from this many key blocks a tile on (4k keys at tile_n = 128): a chunk of a
# shorter tile saves less than the combine's few small kernels cost
SPLIT_TAIL_MIN_KEY_BLOCKS = 64


SPLIT_TAIL_UNSUPPORTED = ("split_tail: needs a non-causal dense call on the static persistent order "
                          "(persistent, no custom scheduler, no kv_multicast)")


def split_tail_supported(scheduler, causal, kv_multicast) -> bool:
    """Whether a build can split its tail: the static persistent order (chunks are work items after
    its full waves), non-causal (every tile walks the same keys), no kv_multicast."""
    return (getattr(scheduler, "persistent", False) and not getattr(scheduler, "dynamic", False)
            and getattr(scheduler, "order", None) is common.StaticTileScheduler and not causal
            and _kv_mode(kv_multicast) is None)


def split_tail_plan(split_tail, scheduler, causal, kv_multicast, batch, seqlen_q, heads, seqlen_k, tile_m, tile_n,
                    ctas) -> tuple[int, int] | None:
    """(tail tiles R, chunks per tile S) when a call's last partial wave is split along the keys, else None.

    A persistent CTA walks tiles c, c + P, ... of P CTAs, so T equal tiles take ceil(T / P) tile-times
    however few tiles the last wave holds: the benchmark's d = 128 calls have T = 4096 on 132 SMs,
    31 full waves and 4 tiles (`benchmarks/wave_tail.py` measured the 32nd wave at ~3% of the call,
    in the official kernel too). Split, the last R tiles become R * S key chunks, one wave of at most
    P CTAs that each walk nb / S blocks; split_tail_combine merges them. Only the static persistent
    order of non-causal dense calls whose query tiles are all full (seqlen_q % tile_m == 0) splits.
    split_tail: None = when the tiles have >= SPLIT_TAIL_MIN_KEY_BLOCKS key blocks, True = whenever
    there is a partial wave, False = never."""
    if split_tail is not None and not isinstance(split_tail, bool):
        raise TypeError(f"split_tail: expected None or a bool, got {type(split_tail).__name__}")
    eligible = split_tail_supported(scheduler, causal, kv_multicast)
    if split_tail and not eligible:
        raise ValueError(SPLIT_TAIL_UNSUPPORTED)
    if split_tail is False or not eligible or seqlen_q % tile_m:
        return None
    key_blocks = -(-seqlen_k // tile_n)
    if split_tail is None and key_blocks < SPLIT_TAIL_MIN_KEY_BLOCKS:
        return None
    tiles = seqlen_q // tile_m * heads * batch
    tail = tiles % ctas
    if tiles <= ctas or tail == 0:
        return None
    chunks = min(ctas // tail, key_blocks)
    return (tail, chunks) if chunks >= 2 else None


def split_tail_combine(split, tail: int, chunks: int, out, lse, num_m_blocks: int):
    """Merge the key chunks of the last R tiles into out and lse (split_combine.py: one small kernel
    on the same stream; the torch formula it replaced, a dozen small kernels that cost more than a 4k
    tail saves, is the tests' reference)."""
    from stage3_fwd_kernel import split_combine

    b, _, heads, _ = out.shape
    split_combine.combine(split, chunks, out, lse, num_m_blocks * heads * b, num_m_blocks)


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, seqused_k=None,
                             softmax_scale=None, causal=False, out=None, lse=None,
                             rescale_threshold=DEFAULT_RESCALE_THRESHOLD,
                             emulation_fraction=DEFAULT_EMULATION_FRACTION, policy: SoftmaxPolicy | None = None,
                             batch_map=None, scheduler=None, check_values=False, tile_m: int | None = None,
                             lean_mask: bool | None = None, persistent: bool | None = None,
                             kv_multicast: bool | str = False):
    """Packed q (Tq,Hq,D), k (Tk,Hkv,D), v (Tk,Hkv,Dv) with int32 cu_seqlens_q / cu_seqlens_k (batch+1,)
    -> (out (Tq,Hq,Dv), lse (Hq,Tq) fp32).

    Sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b+1]] against the first seqused_k[b] (default: all)
    keys of k[cu_seqlens_k[b]:cu_seqlens_k[b+1]]; causal is bottom-right aligned per sequence. Empty
    sequences are fine; a sequence with queries but no keys gets out 0 and lse -inf. Rows of out/lse
    outside every sequence are not written. max_seqlen_q must be >= every query length (it sizes
    the grid); max_seqlen_k is accepted for API compatibility. batch_map (int32 (batch,)): the
    sequence each virtual batch index computes (stage 5's reordering; identity when None).
    check_values=True verifies the index tensors' values on the host (costs a device sync).
    tile_m, lean_mask, persistent: as in attention_forward; kv_multicast: "heads" only (as there).
    (When k has no rows at all nothing is launched and out / lse are filled with 0 / -inf entirely.)
    """
    import torch

    policy = make_policy(rescale_threshold, emulation_fraction, policy)
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k, batch_map = common.prepare_varlen_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_k=seqused_k, batch_map=batch_map)
    tq, hq, d = q.shape
    dv = v.shape[-1]
    _check_head_dims(d, dv)
    tile_m = _check_tile_m(tile_m, d, dv)
    lean_mask = _check_lean_mask(lean_mask, tile_m)
    dt = common.cutlass_dtype(q.dtype)
    policy.check_dtype(dt)
    softmax_scale = _check_scale(softmax_scale, d)
    scheduler = _resolve_scheduler(scheduler, persistent, d, dv, causal, varlen=True, tile_m=tile_m,
                                   kv_multicast=kv_multicast)
    _check_head_pairs(kv_multicast, hq, k.shape[1])
    _check_grid(scheduler, -(-int(max_seqlen_q) // tile_m), hq, len(cu_seqlens_q) - 1)
    if out is None:
        out = torch.empty((tq, hq, dv), dtype=q.dtype, device=q.device)
    common.check_out_tensor("out", out, (tq, hq, dv), q.dtype, q.device, align_bytes=16)
    if lse is None:
        lse = torch.empty((hq, tq), dtype=torch.float32, device=q.device)
    common.check_out_tensor("lse", lse, (hq, tq), torch.float32, q.device, align_bytes=4)
    if check_values:
        common.check_varlen_values(tq, k.shape[0], cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                   seqused_k=seqused_k, batch_map=batch_map)
    batch = cu_seqlens_q.shape[0] - 1
    if batch == 0 or tq == 0 or hq == 0 or max_seqlen_q == 0:
        return out, lse
    if k.shape[0] == 0:  # no sequence has a key (and a TMA map cannot have a 0 extent)
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    # a batch of one: the dense kernel's tensor maps and (B, ...) indexing serve the packed tensors
    args = _call_args(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), out.unsqueeze(0), lse.unsqueeze(0),
                      softmax_scale, max_seqlen_q, cu_seqlens_q, cu_seqlens_k, seqused_k, batch_map,
                      max_ctas=_launch_ctas(scheduler, q.device), tile_counter=_tile_counter(scheduler, q.device))
    flags = (True, seqused_k is not None, batch_map is not None)
    _compile(True, dt, d, dv, causal, policy, scheduler, flags, tile_m, lean_mask, kv_multicast).fn(*args)
    return out, lse


def compile_only(dtype="bf16", head_dim=128, head_dim_v=None, causal=False, *, varlen=False, seqused_k=False,
                 batch_map=False, rescale_threshold=DEFAULT_RESCALE_THRESHOLD,
                 emulation_fraction=DEFAULT_EMULATION_FRACTION, policy: SoftmaxPolicy | None = None,
                 scheduler=None, tile_m: int | None = None, lean_mask: bool | None = None,
                 launchable: bool = False, persistent: bool | None = None,
                 seqlen_k: int | None = None, kv_multicast: bool | str = False,
                 split_tail: bool = False) -> common.Compiled:
    """Compile for sm_90a with fake tensors (no GPU needed); returns the compiled kernel + report.
    varlen / seqused_k / batch_map select which optional tensors the kernel is built for; tile_m
    lean_mask and persistent as in attention_forward (None = default_tile_m / default_lean_mask /
    default_persistent, which takes seqlen_k: the key count of the calls the build is for, None = short).
    launchable=True builds what attention_forward launches (TVM-FFI, the same cache key)."""
    policy = make_policy(rescale_threshold, emulation_fraction, policy)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    _check_head_dims(head_dim, head_dim_v)
    tile_m = _check_tile_m(tile_m, head_dim, head_dim_v)
    lean_mask = _check_lean_mask(lean_mask, tile_m)
    if (seqused_k or batch_map) and not varlen:
        raise ValueError("seqused_k / batch_map: only with varlen=True")
    dt = common.cutlass_dtype(dtype)
    policy.check_dtype(dt)
    scheduler = _resolve_scheduler(scheduler, persistent, head_dim, head_dim_v, causal, bool(varlen), seqlen_k, tile_m,
                                   kv_multicast)
    flags = (bool(varlen), bool(seqused_k), bool(batch_map))
    comp = _compile(launchable, dt, head_dim, head_dim_v, causal, policy, scheduler, flags, tile_m, lean_mask,
                    kv_multicast, split_tail)
    comp.report.setdefault("FADD.RM", len(re.findall(r"\bFADD(?:\.\w+)*\.RM\b", comp.sass)) if comp.sass else None)
    comp.report.setdefault("VOTE.ANY", len(re.findall(r"\bVOTE\.ANY\b", comp.sass)) if comp.sass else None)
    # the mask's selects: FSEL in bf16 builds, integer SEL on the same registers in fp16 ones
    comp.report.setdefault("FSEL", len(re.findall(r"\bFSEL\b", comp.sass)) if comp.sass else None)
    comp.report.setdefault("SEL", len(re.findall(r"\bSEL\b", comp.sass)) if comp.sass else None)
    return comp


def _format(name, rep):
    return common.format_report(name, rep) + f", FADD.RM={rep.get('FADD.RM')}, VOTE.ANY={rep.get('VOTE.ANY')}"


def _random_varlen(batch, max_seqlen_q, max_seqlen_k, heads, heads_kv, d, dv, dtype, gen):
    """A random packed batch with lengths in [0, max], both kinds of empty sequence included."""
    import torch

    lq = torch.randint(0, max_seqlen_q + 1, (batch,), generator=gen, device="cuda")
    lk = torch.randint(0, max_seqlen_k + 1, (batch,), generator=gen, device="cuda")
    if batch >= 3:
        lq[0], lk[1], lq[2], lk[2] = 0, 0, max_seqlen_q, max_seqlen_k  # q-empty, k-empty, longest
    cu_q = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    cu_k = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    cu_q[1:], cu_k[1:] = lq.cumsum(0), lk.cumsum(0)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(tq, heads, d, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(tk, heads_kv, d, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(tk, heads_kv, dv, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, cu_q, cu_k


def run(batch=2, seqlen_q=1024, seqlen_k=1024, heads=8, heads_kv=None, head_dim=128, head_dim_v=None,
        causal=False, dtype="bf16", check=True, *, varlen=False, rescale_threshold=DEFAULT_RESCALE_THRESHOLD,
        emulation_fraction=DEFAULT_EMULATION_FRACTION, tile_m=None, lean_mask=None, verbose=True) -> dict:
    """On a Hopper GPU: check against the stage-0 reference (FA4 rule) and time. Otherwise: compile
    for sm_90a and print the resource report. varlen=True runs a random packed batch of `batch`
    sequences with lengths up to seqlen_q / seqlen_k (empty ones included)."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    tile_m = _check_tile_m(tile_m, head_dim, head_dim_v)
    lean_mask = _check_lean_mask(lean_mask, tile_m)
    heads_kv = heads if heads_kv is None else heads_kv
    policy = make_policy(rescale_threshold, emulation_fraction)
    tag = (f"{STEP} [{common.ARCH}, {dtype}, d={head_dim}/{head_dim_v}, causal={causal}, varlen={varlen}, "
           f"tile_m={tile_m}, lean_mask={lean_mask}, {policy.describe()}]")
    result: dict = {"step": STEP, "policy": policy}
    if not common.hopper_gpu_available():
        comp = compile_only(dtype, head_dim, head_dim_v, causal, varlen=varlen, policy=policy, tile_m=tile_m,
                            lean_mask=lean_mask)
        result.update(mode="compile-only", report=comp.report)
        if verbose:
            print(_format(tag + " (no Hopper GPU: compiled only)", comp.report))
        return result

    import torch
    from stage0_reference.torch_reference import assert_fa4_close, attention_ref, attention_varlen_ref

    tdt = common.torch_dtype(dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    if varlen:
        q, k, v, cu_q, cu_k = _random_varlen(batch, seqlen_q, seqlen_k, heads, heads_kv, head_dim, head_dim_v,
                                             tdt, gen)
        out = torch.full((q.shape[0], heads, head_dim_v), float("nan"), device="cuda", dtype=tdt)
        lse = torch.full((heads, q.shape[0]), float("nan"), device="cuda", dtype=torch.float32)

        def fwd():
            return attention_varlen_forward(q, k, v, cu_q, cu_k, seqlen_q, seqlen_k, causal=causal, out=out,
                                            lse=lse, policy=policy, tile_m=tile_m, lean_mask=lean_mask)

        def ref(upcast):
            return attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, upcast=upcast)
        lens_q = (cu_q[1:] - cu_q[:-1]).double()
        lens_k = (cu_k[1:] - cu_k[:-1]).double()
        flops = float(sum(common.attention_flops(1, a, b_, heads, head_dim, head_dim_v, causal)
                          for a, b_ in zip(lens_q.tolist(), lens_k.tolist())))
        flags = (True, False, False)
    else:
        q = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", dtype=tdt, generator=gen)
        k = torch.randn(batch, seqlen_k, heads_kv, head_dim, device="cuda", dtype=tdt, generator=gen)
        v = torch.randn(batch, seqlen_k, heads_kv, head_dim_v, device="cuda", dtype=tdt, generator=gen)
        out = torch.full((batch, seqlen_q, heads, head_dim_v), float("nan"), device="cuda", dtype=tdt)
        lse = torch.full((batch, heads, seqlen_q), float("nan"), device="cuda", dtype=torch.float32)

        def fwd():
            return attention_forward(q, k, v, causal=causal, out=out, lse=lse, policy=policy, tile_m=tile_m,
                                     lean_mask=lean_mask)

        def ref(upcast):
            return attention_ref(q, k, v, causal=causal, upcast=upcast)
        flops = common.attention_flops(batch, seqlen_q, seqlen_k, heads, head_dim, head_dim_v, causal)
        flags = (False, False, False)
    fwd()
    torch.cuda.synchronize()
    if check:
        (ref_o, ref_lse), (base_o, base_lse) = ref(True), ref(False)
        assert_fa4_close(f"{STEP} out", out, ref_o, base_o)
        assert_fa4_close(f"{STEP} lse", lse, ref_lse, base_lse)
    ms = common.benchmark_ms(fwd)
    tflops = flops / (ms * 1e-3) / 1e12
    rep = common._CACHE[_key("gpu", common.cutlass_dtype(dtype), head_dim, head_dim_v, causal, policy,
                             _resolve_scheduler(None, None, head_dim, head_dim_v, causal, varlen, seqlen_k, tile_m),
                             flags, tile_m,
                             lean_mask)].report
    result.update(mode="gpu", ms=ms, tflops=tflops, report=rep)
    if verbose:
        status = "PASS" if check else "(unchecked)"
        print(f"{status} {STEP} b={batch} sq={seqlen_q} sk={seqlen_k} h={heads}/{heads_kv} d={head_dim}/{head_dim_v} "
              f"causal={causal} varlen={varlen} tile_m={tile_m} lean_mask={lean_mask} {dtype} {policy.describe()}: "
              f"{ms:.3f} ms, "
              f"{tflops:.1f} TFLOP/s")
        print(common.format_report("  resources", rep))
    return result


if __name__ == "__main__":
    ap = common.shape_parser(__doc__)
    ap.add_argument("--varlen", action="store_true", help="a random packed batch of --batch sequences")
    ap.add_argument("--rescale_threshold", type=float, default=DEFAULT_RESCALE_THRESHOLD)
    ap.add_argument("--emulation_fraction", type=float, default=DEFAULT_EMULATION_FRACTION)
    ap.add_argument("--tile_m", type=int, default=None, choices=TILE_MS, help="default: default_tile_m(d, dv)")
    ap.add_argument("--lean_mask", type=int, default=None, choices=(0, 1), help="default: default_lean_mask(tile_m)")
    a = ap.parse_args()
    run(**common.shape_kwargs(a), varlen=a.varlen, rescale_threshold=a.rescale_threshold,
        emulation_fraction=a.emulation_fraction, tile_m=a.tile_m,
        lean_mask=None if a.lean_mask is None else bool(a.lean_mask))
