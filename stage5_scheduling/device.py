"""Stage 5, device half: the tile orders of ``orders.py`` as CuTe-DSL tile schedulers.

Compared with the CPU half, this adds **schedulers that the stage 3/4 kernels take as their
``scheduler=`` / ``dq_order=`` parameter**, because an order only pays once the GPU runs it. Each
one evaluates the *same* integer formula as its host twin in ``orders.py``; the index functions
below are written once and called with Python ints by the CPU tests and with DSL ``Int32`` values
while a kernel traces (as ``stage4_bwd_kernel/schedule.py`` does), so the test that compares them
with ``orders.py`` checks the text that runs on the device.

How a non-persistent scheduler gets its order
---------------------------------------------
The hardware hands out a grid's CTAs in increasing *linear* block index, x fastest:
``linear = bx + gx * (by + gy * bz)``. (A measurement, not a documented guarantee; the gpu test
``test_dispatch_follows_linear_index`` checks it on the device at hand.) So a scheduler that maps
``linear -> (m_block, head, batch)`` decides which tile every SM gets next, and nothing else is
needed: no atomics, no persistent loop.

The stage-3 interface hands ``initial_work()`` no arguments, so the problem's extents reach the
device through the grid itself: ``grid_shape(M, H, B)`` keeps the usual grid ``(M, H, B)`` and
``initial_work`` reads ``gridDim`` back. That is the same 1-D order as a grid of ``M*H*B`` CTAs
(the x-fastest linearization of a 3-D grid *is* a 1-D grid), costs two special-register reads,
and needs no change to the kernels. Per CTA the map costs one pass through ~150 SASS
instructions (step 3's static SASS grows from 2280 to 2432: three 32-bit divisions by run-time
values -- by ``M*H``, ``M*S`` and the section width -- which the GPU does in software), once,
before the first TMA load: well under a microsecond against a tile's tens to hundreds of them.

The schedulers
--------------
``LPTCausalScheduler(S)``  ``orders.lpt_causal``: batch > head section > m_block descending >
                           head in section. ``S`` (heads per section) is compile-time.
``GQALPTCausalScheduler``  the same with ``S = kv_heads_per_section * qheads_per_kvhead``, so all
                           query heads of one KV head are adjacent (the paper's GQA rule).
``SectionedScheduler``     the general formula; ``SectionedScheduler(1, False)`` is the static
                           grid (``orders.naive``), a test's control.
``LPTNoSectionsScheduler`` ``orders.lpt_no_sections``: the L2-thrashing ablation.
``VarlenLPTScheduler``     ``orders.lpt_varlen`` over a *compact* 1-D grid: a warp finds the
                           virtual batch by a 32-ary search of ``cu_tiles`` (device metadata from
                           ``metadata.py``). It needs the varlen kernel to pass ``cu_tiles`` to the
                           scheduler (see its docstring); until then the padded grid below serves.
``SPTBackwardOrder(S)``    the deterministic backward's order in ``stage4_bwd_kernel.schedule``'s
                           interface (``n_block_for_launch``, ``rank``) plus ``tile_for_launch``
                           for the head swizzle.

Varlen today: the Hopper forward (``stage3_fwd_kernel.hopper``) launches the padded grid ``(ceil(max_seqlen_q / tile_m), H, B)``, reads an
optional ``batch_map`` and lets CTAs past their sequence's end exit at once. ``LPTCausalScheduler``
on that grid, with ``batch_map`` from ``metadata.VarlenSchedule``, visits the real tiles in
exactly the ``orders.lpt_varlen`` order: inside a section the blocks run from ``M_max - 1`` down,
and the ones past a shorter sequence are empty CTAs that leave in a few hundred cycles. A test
checks the filtered order against ``lpt_varlen``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from stage3_fwd_kernel import compile_cache, host_io, runner, sass_report, tile_scheduler
from stage3_fwd_kernel.intdiv import FAST_DIV_MAX, check_fast_div_grid, fast_div  # noqa: F401
from stage3_fwd_kernel.tile_scheduler import WorkTile
from stage4_bwd_kernel.schedule import KVDescendingOrder, section_tile
from stage5_scheduling import orders

__all__ = [
    "in_batch_tile", "sectioned_tile", "fast_div", "flat_sectioned_tile", "no_sections_tile", "varlen_search_host",
    "launch_index", "SectionedScheduler", "LPTCausalScheduler", "GQALPTCausalScheduler",
    "LPTNoSectionsScheduler", "VarlenLPTScheduler", "SPTBackwardOrder", "probe_order",
    "probe_varlen_order", "probe_dispatch", "compile_probe", "step3_compile", "step3_forward",
]


# --------------------------------------------------------------------------------------------
# 1. the index maps, for Python ints (tests) and DSL Int32 (kernels)
# --------------------------------------------------------------------------------------------
# Tile r of one batch -> (block, head): heads in sections of `section`, the block index outer inside
# a section (reversed when `reverse`); stage 4's launch sections use the same map over chains.
in_batch_tile = section_tile


def sectioned_tile(linear, num_blocks, num_heads, section: int, reverse: bool, imin=min):
    """``orders.sectioned``: batches outermost, then ``in_batch_tile``. Returns (block, head, batch)."""
    per_batch = num_blocks * num_heads
    batch = linear // per_batch
    block, head = in_batch_tile(linear - batch * per_batch, num_blocks, num_heads, section, reverse, imin)
    return block, head, batch


def flat_sectioned_tile(linear, num_blocks, num_heads, num_batch, section: int, reverse: bool, imin=min):
    """``orders.lpt_causal_flat``: sections over u = batch * heads + head (the official FA4's
    layout), ``in_batch_tile`` over the H * B units. Returns (block, head, batch); its three
    run-time divisions go through ``fast_div``."""
    block, unit = in_batch_tile(linear, num_blocks, num_heads * num_batch, section, reverse, imin, fast_div)
    batch = fast_div(unit, num_heads)
    return block, unit - batch * num_heads, batch


def no_sections_tile(linear, num_blocks, num_heads, num_batch):
    """``orders.lpt_no_sections``: m_block descending outermost, then batch, then head."""
    per_block = num_heads * num_batch
    q = linear // per_block
    r = linear - q * per_block
    batch = r // num_heads
    return num_blocks - 1 - q, r - batch * num_heads, batch


def varlen_search_host(cu_tiles, linear: int, lanes: int = 32) -> int:
    """The device's 32-ary search (``_find_virtual_batch``) replayed with Python ints: the last
    ``v`` with ``cu_tiles[v] <= linear``. Each round, lane ``l`` probes ``lo + (l+1)*step``; the
    probes that pass form a prefix of the lanes (``cu_tiles`` is non-decreasing), so their count
    (popc of the ballot) says which slice holds the answer. Empty batches (equal neighbours) are
    skipped by construction: of equal entries, the last one is taken."""
    lo, hi = 0, len(cu_tiles) - 1  # invariant: cu[lo] <= linear < cu[hi]
    while hi - lo > 1:
        step = (hi - lo + lanes - 1) // lanes
        cnt = sum(1 for lane in range(lanes) if cu_tiles[min(lo + (lane + 1) * step, hi)] <= linear)
        lo_new = lo + cnt * step
        hi = min(lo_new + step, hi)
        lo = lo_new
    return lo


@cute.jit
def launch_index() -> Int32:
    """This CTA's position in the hardware's dispatch order: x fastest, then y, then z."""
    bx, by, bz = cute.arch.block_idx()
    gx, gy, _ = cute.arch.grid_dim()
    return bx + gx * (by + gy * bz)


# --------------------------------------------------------------------------------------------
# 2. fixed-length schedulers (the stage-3 interface: grid_shape / initial_work / next_work)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SectionedScheduler:
    """``orders.sectioned(linear, M, H, B, heads_per_section, reverse)`` on the grid (M, H, B), or
    with ``flat_batches`` the sections cut from the (batch, head) pairs in a row
    (``orders.lpt_causal_flat``'s map: ``flat_sectioned_tile``).

    Frozen dataclass: equal configurations compare and hash equal, so compile caches keyed on the
    scheduler (the Hopper forward's) compile once per configuration.
    """

    heads_per_section: int = 1
    reverse_blocks: bool = False
    flat_batches: bool = False

    persistent: ClassVar[bool] = False

    def __post_init__(self):
        if not isinstance(self.heads_per_section, int) or self.heads_per_section < 1:
            raise ValueError(f"heads_per_section: expected an int >= 1, got {self.heads_per_section!r}")

    # host (inside the kernel's @cute.jit launcher; arguments may be dynamic Int32)
    def grid_shape(self, num_m_blocks, num_heads, batch):
        return (num_m_blocks, num_heads, batch)

    # device
    def initial_work(self) -> WorkTile:
        gx, gy, gz = cute.arch.grid_dim()
        block, head, batch = self.tile_at(launch_index(), gx, gy, gz)
        return WorkTile(block, head, batch, True)

    def tile_at(self, linear, num_blocks, num_heads, num_batch):
        """The same map for a persistent loop (``tile_scheduler.PersistentScheduler``), extents given."""
        if const_expr(self.flat_batches):
            return flat_sectioned_tile(linear, num_blocks, num_heads, num_batch, self.heads_per_section,
                                       self.reverse_blocks, imin=cutlass.min)
        return sectioned_tile(linear, num_blocks, num_heads, self.heads_per_section, self.reverse_blocks,
                              imin=cutlass.min)

    def next_work(self, work: WorkTile) -> WorkTile:
        return WorkTile(work.m_block, work.head, work.batch, False)

    # the oracle: the host order this scheduler must reproduce
    def host_order(self, num_blocks: int, num_heads: int, num_batch: int) -> orders.Tiles:
        order = orders.sectioned_flat if self.flat_batches else orders.sectioned
        return orders.list_order(order, num_blocks * num_heads * num_batch, num_blocks,
                                 num_heads, num_batch, self.heads_per_section, self.reverse_blocks)

    def check_problem(self, num_heads: int, heads_kv: int | None = None) -> None:
        """Host-side: raise if the sections would split a GQA group (``orders._check_groups``)."""
        orders._check_groups(num_heads, heads_kv, self.heads_per_section)

    def check_grid(self, num_blocks: int, num_heads: int, num_batch: int) -> None:
        """Host-side: the flat map's ``fast_div`` is exact below FAST_DIV_MAX tiles."""
        if self.flat_batches:
            check_fast_div_grid("scheduler: flat LPT sections (blocks x heads x batch)", (num_blocks, num_heads, num_batch),
                                "use flat_batches=False")


@dataclass(frozen=True)
class LPTCausalScheduler(SectionedScheduler):
    """The causal LPT order (``orders.lpt_causal``): batch > head section > m_block descending >
    head in section; with ``flat_batches`` the sections run over the (batch, head) pairs in a row
    (``orders.lpt_causal_flat``, the official FA4 kernel's layout; fa4's dense route uses it).
    ``heads_per_section`` heads' K+V should fit in L2 (``from_problem``)."""

    reverse_blocks: bool = True

    def host_order(self, num_blocks: int, num_heads: int, num_batch: int) -> orders.Tiles:
        order = orders.lpt_causal_flat if self.flat_batches else orders.lpt_causal
        return orders.list_order(order, num_blocks * num_heads * num_batch, num_blocks,
                                 num_heads, num_batch, self.heads_per_section)

    @classmethod
    def from_problem(cls, seqlen_k: int, head_dim: int, num_heads: int, heads_kv: int | None = None, *,
                     head_dim_v: int | None = None, dtype_bytes: int = 2, l2_bytes: int = orders.H100_L2_BYTES,
                     safety: float = 0.5, flat_batches: bool = False) -> "LPTCausalScheduler":
        """Sections sized by ``orders.heads_per_section`` (power of two, whole KV groups), clamped
        to ``num_heads`` so problems with the same effective order share one compiled kernel."""
        heads_kv = num_heads if heads_kv is None else heads_kv
        group = num_heads // heads_kv
        s = orders.heads_per_section(l2_bytes, seqlen_k, head_dim, dtype_bytes, group, head_dim_v,
                                     safety=safety, power_of_two=True)
        if group > 1:
            return GQALPTCausalScheduler.for_group(min(s, num_heads) // group, group, flat_batches=flat_batches)
        return cls(min(s, num_heads), flat_batches=flat_batches)


@dataclass(frozen=True)
class GQALPTCausalScheduler(LPTCausalScheduler):
    """LPT for GQA/MQA: sections hold whole KV groups, ``S = kv_heads_per_section * group``, so all
    query heads that read one KV head run back to back before m_block changes (one K/V fetch
    feeds ``group`` CTAs from L2). Build it with ``for_group``; ``check_problem`` verifies that
    the kernel's group equals the one the sections were cut for."""

    qheads_per_kvhead: int = 1

    def __post_init__(self):
        super().__post_init__()
        g = self.qheads_per_kvhead
        if not isinstance(g, int) or g < 1 or self.heads_per_section % g:
            raise ValueError(f"heads_per_section ({self.heads_per_section}) must be a multiple of "
                             f"qheads_per_kvhead ({g})")

    @classmethod
    def for_group(cls, kv_heads_per_section: int, qheads_per_kvhead: int,
                  flat_batches: bool = False) -> "GQALPTCausalScheduler":
        kv = max(1, int(kv_heads_per_section))
        return cls(heads_per_section=kv * qheads_per_kvhead, qheads_per_kvhead=qheads_per_kvhead,
                   flat_batches=flat_batches)

    def check_problem(self, num_heads: int, heads_kv: int | None = None) -> None:
        heads_kv = num_heads if heads_kv is None else heads_kv
        if num_heads % heads_kv or num_heads // heads_kv != self.qheads_per_kvhead:
            raise ValueError(f"scheduler was built for groups of {self.qheads_per_kvhead} query heads, "
                             f"the problem has heads_q={num_heads}, heads_kv={heads_kv}")
        super().check_problem(num_heads, heads_kv)


@dataclass(frozen=True)
class LPTNoSectionsScheduler:
    """``orders.lpt_no_sections`` (m_block descending outermost): balanced, but every (batch, head)
    is revisited once per m_block, so K/V are refetched once their total exceeds L2. The ablation
    that shows what the sections buy; not for production."""

    persistent: ClassVar[bool] = False

    def grid_shape(self, num_m_blocks, num_heads, batch):
        return (num_m_blocks, num_heads, batch)

    def initial_work(self) -> WorkTile:
        gx, gy, gz = cute.arch.grid_dim()
        block, head, batch = no_sections_tile(launch_index(), gx, gy, gz)
        return WorkTile(block, head, batch, True)

    def tile_at(self, linear, num_blocks, num_heads, num_batch):
        return no_sections_tile(linear, num_blocks, num_heads, num_batch)

    def next_work(self, work: WorkTile) -> WorkTile:
        return WorkTile(work.m_block, work.head, work.batch, False)

    def host_order(self, num_blocks: int, num_heads: int, num_batch: int) -> orders.Tiles:
        return orders.list_order(orders.lpt_no_sections, num_blocks * num_heads * num_batch, num_blocks,
                                 num_heads, num_batch)


# --------------------------------------------------------------------------------------------
# 3. varlen over a compact grid: the virtual batch from device metadata
# --------------------------------------------------------------------------------------------
@cute.jit
def _find_virtual_batch(mCuTiles: cute.Tensor, num_batch: Int32, linear: Int32) -> Int32:
    """Last v in [0, num_batch) with cu_tiles[v] <= linear, for 0 <= linear < cu_tiles[num_batch].
    One warp, all 32 lanes converged: ceil(log32 B) rounds of one load per lane + ballot + popc
    (2 rounds up to 1024 batches), instead of log2 B dependent loads of a binary search."""
    lane = cute.arch.lane_idx()
    lo = Int32(0)
    hi = num_batch
    while hi - lo > 1:
        step = (hi - lo + 31) // 32
        probe = cutlass.min(lo + (lane + 1) * step, hi)  # cu[hi] > linear: lanes past hi say no
        passed = cute.arch.popc(cute.arch.vote_ballot_sync(mCuTiles[probe] <= linear))
        lo_new = lo + passed * step
        hi = cutlass.min(lo_new + step, hi)
        lo = lo_new
    return lo


@dataclass(frozen=True)
class VarlenLPTScheduler:
    """``orders.lpt_varlen`` over a compact 1-D grid of ``cu_tiles[B]`` CTAs (no empty CTAs).

    Reads one int32 tensor, ``cu_tiles`` (B + 1, virtual order; ``metadata.VarlenSchedule``):
      1. v = last virtual batch with ``cu_tiles[v] <= linear`` (``_find_virtual_batch``);
      2. M_v = (cu_tiles[v+1] - cu_tiles[v]) / H  -- the batch's Q blocks, no second table;
      3. (block, head) = ``in_batch_tile(linear - cu_tiles[v], M_v, H, S, reverse)``.
    It returns the *virtual* batch ``v``: the kernel maps it through ``batch_map`` exactly as
    the Hopper forward already does for its ``mBatchMap`` argument.

    Interface: the stage-3 ``initial_work()`` takes no arguments and ``grid_shape`` no tile
    count, so this scheduler's device entry is ``initial_work_from(mCuTiles, num_heads)`` and
    its grid ``grid_shape_for(num_tiles)``. Wiring it into the Hopper forward needs the kernel to pass those
    two through (the minimal change is in stage5's README, "Device-side schedulers"). It is
    tested standalone with ``probe_varlen_order``.
    """

    heads_per_section: int = 1
    reverse_blocks: bool = True

    persistent: ClassVar[bool] = False
    needs_tile_metadata: ClassVar[bool] = True

    @staticmethod
    def grid_shape_for(num_tiles):
        return (num_tiles, 1, 1)

    def work_at(self, linear: Int32, mCuTiles: cute.Tensor, num_heads: Int32) -> WorkTile:
        num_batch = mCuTiles.shape[0] - 1
        total = mCuTiles[num_batch]
        valid = linear < total
        # a CTA past the end searches for the last tile instead (the search needs linear < total;
        # its result is discarded through is_valid), so the ballot stays warp-uniform
        v = _find_virtual_batch(mCuTiles, num_batch, cutlass.min(linear, total - 1))
        start = mCuTiles[v]
        num_blocks = (mCuTiles[v + 1] - start) // num_heads
        block, head = in_batch_tile(cutlass.min(linear, total - 1) - start, num_blocks, num_heads,
                                    self.heads_per_section, self.reverse_blocks, imin=cutlass.min)
        return WorkTile(block, head, v, valid)

    def initial_work_from(self, mCuTiles: cute.Tensor, num_heads: Int32) -> WorkTile:
        return self.work_at(launch_index(), mCuTiles, num_heads)

    def next_work(self, work: WorkTile) -> WorkTile:
        return WorkTile(work.m_block, work.head, work.batch, False)

    # the stage-3 interface, which cannot carry the metadata: fail loudly at trace time
    def grid_shape(self, *args):
        raise TypeError("VarlenLPTScheduler needs the tile count and cu_tiles from the kernel "
                        "(grid_shape_for / initial_work_from); on today's step-4 varlen kernel use "
                        "LPTCausalScheduler with batch_map (metadata.VarlenSchedule.step4_kwargs)")

    initial_work = grid_shape

    def host_order(self, meta: orders.VarlenMeta) -> orders.Tiles:
        """(block, head, *actual* batch) of every tile, from the host metadata."""
        return orders.list_order(orders.lpt_varlen, meta.num_tiles, meta)


# --------------------------------------------------------------------------------------------
# 4. the deterministic backward: SPT in stage 4's dQ-order interface
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SPTBackwardOrder(KVDescendingOrder):
    """The paper's SPT schedule for the deterministic backward: stage 4's KVDescendingOrder
    (``n_block_for_launch``, ``rank``, inherited unchanged) plus head swizzling.

    * launch: K/V blocks descending (``n_block_for_launch(bx, N) = N - 1 - bx``), which under a
      causal mask runs the *shortest* K/V tiles first;
    * walk: each CTA visits Q blocks ascending from its diagonal (the stage-4 kernel already does);
    * reduce: the adders of dQ block m go in descending n, ``rank = n_last(m) - n`` (in
      ``orders.dq_rank(descending=True)`` notation ``last(m) - n``), so a CTA's first dQ add (its
      diagonal block, where it is the last adder) has rank 0 and never waits;
    * swizzle: ``tile_for_launch()`` maps the whole launch index to (n_block, kv_head, batch) with
      ``orders.spt_bwd``'s formula, sections of ``heads_per_section`` KV heads.

    ``rank`` and ``n_block_for_launch`` equal stage 4's ``KVDescendingOrder``; what this class adds
    is the head swizzle, which stage 4's Hopper kernels apply (they call ``tile_for_launch`` when
    an order has it). Deadlock-free: a CTA waits only for larger n of its own (head, batch), and
    those come earlier in the launch order.
    """

    heads_per_section: int = 1

    def __post_init__(self):
        if not isinstance(self.heads_per_section, int) or self.heads_per_section < 1:
            raise ValueError(f"heads_per_section: expected an int >= 1, got {self.heads_per_section!r}")

    @property
    def name(self) -> str:  # stage 4's compile key
        return f"spt_s{self.heads_per_section}"

    def tile_for_launch(self):
        """(n_block, kv_head, batch) of this CTA on the grid (N, H_kv, B) -- device side."""
        gx, gy, _ = cute.arch.grid_dim()
        return sectioned_tile(launch_index(), gx, gy, self.heads_per_section, True, imin=cutlass.min)

    def host_order(self, num_n_blocks: int, num_heads_kv: int, num_batch: int) -> orders.Tiles:
        return orders.list_order(orders.spt_bwd, num_n_blocks * num_heads_kv * num_batch, num_n_blocks,
                                 num_heads_kv, num_batch, self.heads_per_section)

    @staticmethod
    def host_rank(n_block, m_block, seqlen_q, seqlen_k, tile_m, tile_n, causal=True):
        """What ``rank`` evaluates to inside stage 4 (n_block_first = 0, n_block_last from the mask),
        via the CPU oracle ``orders.dq_rank(descending=True)``."""
        return orders.dq_rank(n_block, m_block, seqlen_q, seqlen_k, tile_m, tile_n, causal, descending=True)


# --------------------------------------------------------------------------------------------
# 5. probes: kernels that only run a scheduler and write down what each CTA got
# --------------------------------------------------------------------------------------------
class _ScheduleProbe:
    """One warp per CTA; lane 0 stores (m_block, head, batch, is_valid) at the CTA's launch index.
    ``varlen``: the scheduler is a VarlenLPTScheduler fed with cu_tiles and num_heads."""

    def __init__(self, scheduler, varlen: bool = False):
        self.scheduler = scheduler
        self.varlen = varlen

    @cute.jit
    def __call__(self, mOut: cute.Tensor, mCuTiles: cute.Tensor, num_m_blocks: Int32, num_heads: Int32,
                 batch: Int32, num_ctas: Int32, stream):
        if const_expr(self.varlen):
            grid = self.scheduler.grid_shape_for(num_ctas)
        else:
            grid = self.scheduler.grid_shape(num_m_blocks, num_heads, batch)
        self.kernel(mOut, mCuTiles, num_heads).launch(grid=grid, block=[32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mOut: cute.Tensor, mCuTiles: cute.Tensor, num_heads: Int32):
        if const_expr(self.varlen):
            work = self.scheduler.initial_work_from(mCuTiles, num_heads)
        else:
            work = self.scheduler.initial_work()
        valid = Int32(1)
        if const_expr(not isinstance(work.is_valid, bool)):
            valid = Int32(0)
            if work.is_valid:
                valid = Int32(1)
        lin = launch_index()
        if cute.arch.lane_idx() == 0:
            mOut[lin, 0] = Int32(work.m_block)
            mOut[lin, 1] = Int32(work.head)
            mOut[lin, 2] = Int32(work.batch)
            mOut[lin, 3] = valid


class _DispatchProbe:
    """Each CTA takes a ticket from a global counter (atomic add) as it starts and stores it at
    its launch index: ticket[i] is the order in which CTA i actually began. 128 threads per CTA,
    so at most 16 CTAs are resident per SM (2048 threads)."""

    num_threads = 128

    @cute.jit
    def __call__(self, mTicket: cute.Tensor, mCounter: cute.Tensor, gx: Int32, gy: Int32, gz: Int32, stream):
        self.kernel(mTicket, mCounter).launch(grid=(gx, gy, gz), block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mTicket: cute.Tensor, mCounter: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == 0:
            ticket = cute.arch.atomic_add(mCounter.iterator, Int32(1))
            mTicket[launch_index()] = ticket


def _fake_out():
    return cute.runtime.make_fake_tensor(Int32, (cute.sym_int32(), 4), stride=(4, 1), assumed_align=4)


_PROBES: dict = {}


def compile_probe(scheduler, *, varlen: bool = False, args=None):
    """Compile (and cache) the probe for `scheduler`; with ``args=None`` against fake tensors (no
    GPU). Returns the callable."""
    key = (scheduler, varlen, args is None)
    if key not in _PROBES:
        probe = _ScheduleProbe(scheduler, varlen)
        if args is None:
            args = (_fake_out(), host_io.fake_i32_vector(), Int32(1), Int32(1), Int32(1), Int32(1),
                    cute.runtime.make_fake_stream())
        _PROBES[key] = cute.compile(probe, *args)
    return _PROBES[key]


def _stream():
    import torch
    from cuda.bindings import driver as cuda

    return cuda.CUstream(torch.cuda.current_stream().cuda_stream)


def _tiles_from(out):
    """(Tiles, is_valid) from the probe's (n, 4) int32 output."""
    a = out.cpu().numpy().astype(np.int64)
    return orders.Tiles(a[:, 0], a[:, 1], a[:, 2]), a[:, 3].astype(bool)


def probe_order(scheduler, num_blocks: int, num_heads: int, num_batch: int):
    """Run `scheduler` on the grid of (num_blocks, num_heads, num_batch) and return what each CTA
    got, in launch order: (Tiles, is_valid)."""
    import torch

    n = num_blocks * num_heads * num_batch
    out = torch.full((n, 4), -1, dtype=torch.int32, device="cuda")
    dummy = torch.zeros(1, dtype=torch.int32, device="cuda")
    args = (host_io.to_cute(out, assumed_align=4), host_io.to_cute(dummy, assumed_align=4), Int32(num_blocks),
            Int32(num_heads), Int32(num_batch), Int32(n), _stream())
    compile_probe(scheduler, args=args)(*args)
    torch.cuda.synchronize()
    return _tiles_from(out)


def probe_varlen_order(scheduler: VarlenLPTScheduler, cu_tiles, num_heads: int, num_ctas: int | None = None):
    """Run a VarlenLPTScheduler over a compact grid (``num_ctas`` defaults to cu_tiles[-1]); returns
    (Tiles with the *virtual* batch, is_valid)."""
    import torch

    total = int(cu_tiles[-1])
    num_ctas = total if num_ctas is None else num_ctas
    out = torch.full((num_ctas, 4), -1, dtype=torch.int32, device="cuda")
    cu = torch.as_tensor(cu_tiles, dtype=torch.int32).cuda()
    args = (host_io.to_cute(out, assumed_align=4), host_io.to_cute(cu, assumed_align=4), Int32(0),
            Int32(num_heads), Int32(0), Int32(num_ctas), _stream())
    compile_probe(scheduler, varlen=True, args=args)(*args)
    torch.cuda.synchronize()
    return _tiles_from(out)


_DISPATCH = {}


def probe_dispatch(grid):
    """The start order of a grid's CTAs: ``ticket[linear]`` for the grid (gx, gy, gz) (numpy)."""
    import torch

    gx, gy, gz = grid
    tickets = torch.full((gx * gy * gz,), -1, dtype=torch.int32, device="cuda")
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    args = (host_io.to_cute(tickets, assumed_align=4), host_io.to_cute(counter, assumed_align=4), Int32(gx),
            Int32(gy), Int32(gz), _stream())
    if "fn" not in _DISPATCH:
        _DISPATCH["fn"] = cute.compile(_DispatchProbe(), *args)
    _DISPATCH["fn"](*args)
    torch.cuda.synchronize()
    return tickets.cpu().numpy()


# --------------------------------------------------------------------------------------------
# 6. stage 3's step 3 with a scheduler (its host API has no scheduler argument)
# --------------------------------------------------------------------------------------------
def _step3():
    from stage3_fwd_kernel import hopper_step3_warpspec

    return hopper_step3_warpspec


def step3_compile(scheduler, dtype="bf16", head_dim: int = 128, head_dim_v: int | None = None,
                  causal: bool = True) -> compile_cache.Compiled:
    """Compile step 3 with `scheduler` for sm_90a against fake tensors (no GPU needed)."""
    mod = _step3()
    dt = host_io.cutlass_dtype(dtype)
    dv = head_dim if head_dim_v is None else head_dim_v
    key = (mod.STEP, "fake", str(dt), head_dim, dv, bool(causal), "stage5", scheduler)
    return compile_cache.compile_cached(key, lambda: (
        mod.FlashAttentionForwardSm90Step3(dt, head_dim, dv, causal, scheduler=scheduler),
        host_io.fake_args(dt, head_dim, dv)))


def step3_forward(q, k, v, *, causal: bool, scheduler=None, softmax_scale=None, out=None, lse=None):
    """Step 3's forward on (B, S, H, D) CUDA tensors with `scheduler` (default: the static grid)."""
    import torch

    mod = _step3()
    scheduler = scheduler or tile_scheduler.StaticTileScheduler
    q, k, v = host_io.prepare_inputs(q, k, v)
    b, sq, hq, d = q.shape
    dv = v.shape[-1]
    if isinstance(scheduler, SectionedScheduler):
        scheduler.check_problem(hq, k.shape[2])
    softmax_scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    if out is None:
        out = torch.empty((b, sq, hq, dv), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.empty((b, hq, sq), dtype=torch.float32, device=q.device)
    dt = host_io.cutlass_dtype(q.dtype)
    key = (mod.STEP, "gpu", str(dt), d, dv, bool(causal), "stage5", scheduler)
    compiled = compile_cache.compile_cached(key, lambda: (
        mod.FlashAttentionForwardSm90Step3(dt, d, dv, causal, scheduler=scheduler),
        host_io.fake_args(dt, d, dv, launchable=True)))
    host_io.launch(compiled, q, k, v, out, lse, softmax_scale)
    return out, lse


# --------------------------------------------------------------------------------------------
# 7. entry point
# --------------------------------------------------------------------------------------------
def run(num_blocks: int = 64, heads: int = 16, batch: int = 2, heads_per_section: int = 4, verbose: bool = True) -> dict:
    """On a Hopper GPU: probe LPTCausalScheduler against orders.lpt_causal and print PASS. Without
    one: compile step 3 with it for sm_90a and print the resource report."""
    sched = LPTCausalScheduler(heads_per_section)
    if not runner.hopper_gpu_available():
        comp = step3_compile(sched)
        if verbose:
            print(sass_report.format_report(f"step 3 + {sched} [{host_io.ARCH}] (no Hopper GPU: compiled only)",
                                            comp.report))
        return {"mode": "compile-only", "report": comp.report}
    tiles, valid = probe_order(sched, num_blocks, heads, batch)
    ok = bool(valid.all()) and list(zip(tiles.block.tolist(), tiles.head.tolist(), tiles.batch.tolist())) == list(
        zip(*(a.tolist() for a in sched.host_order(num_blocks, heads, batch))))
    if verbose:
        print(f"{'PASS' if ok else 'FAIL'} {sched} on grid ({num_blocks}, {heads}, {batch}): device order == orders.lpt_causal")
    return {"mode": "gpu", "ok": ok}


if __name__ == "__main__":
    run()
