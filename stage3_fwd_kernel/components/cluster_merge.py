"""Split-KV decode merged inside its own launch: the n chunks of one sequence run as one cluster.

A split decode step (components.key_split) was two kernels: the attention kernel leaves n partial
results per row, and a second kernel merges them through their lse. On an H200 at batch 1 with a
16k cache, the attention kernel alone takes 18.2 us a step and the merge adds 3.9 (docs/measurements.md,
2026-12-01): a kernel boundary, the parts' round trip through L2 and a chain of dependent loads, for
a few kilobytes of data. An earlier in-kernel merge, where the last CTA to finish (an atomic
counter) read the parts back from global memory, cost as much as the kernel it replaced.

Here the n CTAs of a (query tile, head, sequence) form a thread-block cluster along the launch's
virtual-sequence axis (cluster rank j = chunk j), and the parts never leave the cluster:

  * at entry, rank 0 (the leader) arms one mbarrier with the bytes it will receive,
    (n - 1) R (2 dv + 4) for R query rows, and every thread arrives on the cluster barrier after
    the init is fenced; a sender waits on that barrier only before its first remote store;
  * after its walk, rank j >= 1 stores its rows -- O over its own row sums, as 16-bit pairs, and
    the row's lse -- into slot j - 1 of the leader's shared memory with st.async, each store
    counting its bytes on the leader's mbarrier; then it is done;
  * the leader waits for the mbarrier, merges its own fp32 rows with the slots in rank order,
    O = sum_j exp(lse_j - lse) O_j with lse = log sum_j exp(lse_j), and stores O and lse like an
    unsplit launch (batch row = the sequence).

The order of the additions is fixed (rank 0, 1, ..., n - 1), so a step is bitwise reproducible.
A chunk with no key sends lse = -inf and O = 0, which weigh nothing; a row no chunk sees keeps
O = 0 and lse = -inf. The slots hold SLOT_ROWS >= R rows a part (a compile-time size), so the
merge serves decode rows (one token's packed GQA group, up to 16 rows) and clusters of 2..16 CTAs
(16 is beyond the portable cluster size of 8; the H200 schedules 8 such clusters at once).
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

MAX_CLUSTER = 16      # CTAs a cluster (non-portable above 8)
MAX_SLOT_ROWS = 16    # query rows a part, at most (a decode step's packed GQA group)
LOG2_E = math.log2(math.e)


def slot_rows(rows: int) -> int:
    """The slots' compile-time rows for R query rows: the next power of two (at least 4)."""
    return max(4, 1 << max(0, rows - 1).bit_length())


def slot_bytes(splits: int, rows: int, head_dim_v: int, elem_bytes: int = 2) -> int:
    """Shared memory the leader sets aside: n - 1 parts of `rows` rows (16-bit O, fp32 lse) and the
    mbarrier (8 bytes)."""
    return (splits - 1) * rows * (head_dim_v * elem_bytes + 4) + 8


def check_merge(splits: int, rows: int) -> None:
    """ValueError unless a launch can merge in its cluster (host side, before any launch)."""
    if isinstance(splits, bool) or not isinstance(splits, int) or not 2 <= splits <= MAX_CLUSTER:
        raise ValueError(f"num_splits: a merge inside the cluster needs 2..{MAX_CLUSTER} splits, got {splits!r}")
    if not 1 <= rows <= MAX_SLOT_ROWS:
        raise ValueError(f"q: a merge inside the cluster takes 1..{MAX_SLOT_ROWS} query rows a sequence "
                         f"(one token's GQA group), got {rows}")


@dsl_user_op
def store_remote_b32(local_addr: Int32, mbar_addr: Int32, value: Int32, rank: Int32, *, loc=None, ip=None) -> None:
    """st.async of one 32-bit word to the same shared-memory offset in cluster CTA `rank`, its 4 bytes
    counted on that CTA's mbarrier at `mbar_addr` (also a local offset). One fence-free instruction:
    the DSL's store_async_dsmem adds an mbarrier-init fence after every store."""
    asm = ("{\n .reg .b32 dst, bar;\n mapa.shared::cluster.u32 dst, $0, $3;\n mapa.shared::cluster.u32 bar, $1, $3;\n"
           " st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [dst], $2, [bar];\n}")
    llvm.inline_asm(None, [Int32(a).ir_value(loc=loc, ip=ip) for a in (local_addr, mbar_addr, value, rank)],
                    asm, "r,r,r,r", has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                    loc=loc, ip=ip)


@dsl_user_op
def f32_bits(x: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.inline_asm(T.i32(), [Float32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,f",
                                 has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
                                 loc=loc, ip=ip))


@dsl_user_op
def pack_pair(lo: Float32, hi: Float32, bf16: bool, *, loc=None, ip=None) -> Int32:
    """(lo, hi) -> two 16-bit floats in one word, lo in the low half (round to nearest)."""
    cvt = "cvt.rn.bf16x2.f32 $0, $1, $2;" if bf16 else "cvt.rn.f16x2.f32 $0, $1, $2;"
    operands = [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)]
    return Int32(llvm.inline_asm(T.i32(), operands, cvt, "=r,f,f", has_side_effects=False, is_align_stack=False,
                                 asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


class ClusterMerge:
    """The leader's slots and mbarrier. cfg: the kernel (dtype, head_dim_v, merge_splits, merge_rows);
    storage: its shared storage with `mbar_merge` (1 x Int64), `merge_O` (16-bit) and `merge_lse`
    (fp32). Functions below, not methods: CuTe-DSL would try to carry an object whose methods a
    dynamic branch calls."""

    def __init__(self, cfg, storage):
        self.splits, self.rows, self.dv = cfg.merge_splits, cfg.merge_rows, cfg.head_dim_v
        self.bf16 = cfg.dtype == cutlass.BFloat16
        self.mbar = storage.mbar_merge.data_ptr()
        parts = self.splits - 1
        self.sO = storage.merge_O.get_tensor(cute.make_layout((self.dv, self.rows, parts),
                                                              stride=(1, self.dv, self.dv * self.rows)))
        self.sLse = storage.merge_lse.get_tensor(cute.make_layout((self.rows, parts), stride=(1, self.rows)))


@cute.jit
def arm(m: ClusterMerge, rank: Int32, rows: Int32):
    """At entry, before the CTA's barrier init fence: the leader's mbarrier, armed for the bytes of
    n - 1 parts of `rows` rows (one thread)."""
    if rank == 0:
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            cute.arch.mbarrier_init(m.mbar, 1)
            cute.arch.mbarrier_init_fence()
            cute.arch.mbarrier_arrive_and_expect_tx(m.mbar, (m.splits - 1) * rows * (2 * m.dv + 4))


@cute.jit
def send(m: ClusterMerge, rank: Int32, acc_O: cute.Tensor, lse: cute.Tensor, tOcO: cute.Tensor,
         tScS_rc: cute.Tensor, rows: Int32):
    """A sender's rows (O over its own row sums, fp32 accumulator; lse per row) into its slot of the
    leader. tOcO: (row, col) of each accumulator element; tScS_rc: the row of each lse."""
    cute.arch.cluster_wait()  # the leader's mbarrier is armed (its init fence, then its arrive)
    slot = rank - 1
    mbar_addr = m.mbar.toint()
    # accumulator elements 2i, 2i + 1 are adjacent columns of one row (the wgmma C fragment)
    for i in cutlass.range_constexpr(0, cute.size(acc_O), 2):
        row, col = tOcO[i][0], tOcO[i][1]
        if row < rows:
            addr = (m.sO.iterator + (slot * m.rows + row) * m.dv + col).toint()
            store_remote_b32(addr, mbar_addr, pack_pair(acc_O[i], acc_O[i + 1], m.bf16), Int32(0))
    if tScS_rc[0, 0][1] == 0:  # the thread holding column 0 of its rows
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = tScS_rc[r, 0][0]
            if row < rows:
                addr = (m.sLse.iterator + slot * m.rows + row).toint()
                store_remote_b32(addr, mbar_addr, f32_bits(lse[r]), Int32(0))


@cute.jit
def merge(m: ClusterMerge, acc_O_rc: cute.Tensor, lse: cute.Tensor, tOcO_rc: cute.Tensor, rows: Int32):
    """The leader: wait for every part, then fold them into its own rows in place, in rank order
    (acc_O_rc as (row, col), fp32, over its own row sums; lse per row, merged on return)."""
    cute.arch.mbarrier_wait(m.mbar, 0)
    for r in cutlass.range_constexpr(cute.size(lse)):
        row = tOcO_rc[r, 0][0]
        if row < rows:
            top = lse[r]
            for j in cutlass.range_constexpr(m.splits - 1):
                top = cute.arch.fmax(top, m.sLse[row, j])
            top_safe = Float32(0.0) if top == -Float32.inf else top  # no chunk saw a key: weights 0
            w0 = cute.math.exp2((lse[r] - top_safe) * LOG2_E, fastmath=True)
            total = w0
            for c in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[1])):
                acc_O_rc[r, c] = acc_O_rc[r, c] * w0
            for j in cutlass.range_constexpr(m.splits - 1):
                w = cute.math.exp2((m.sLse[row, j] - top_safe) * LOG2_E, fastmath=True)
                total += w
                for c in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[1])):
                    acc_O_rc[r, c] += w * Float32(m.sO[tOcO_rc[r, c][1], row, j])
            inv = Float32(0.0) if total == 0.0 else cute.arch.rcp_approx(total)
            for c in cutlass.range_constexpr(cute.size(acc_O_rc, mode=[1])):
                acc_O_rc[r, c] = acc_O_rc[r, c] * inv
            lse[r] = -Float32.inf if total == 0.0 else top_safe + cute.math.log2(total, fastmath=True) / LOG2_E
