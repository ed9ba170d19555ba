"""Stage 5, part 2: a makespan simulator for attention tile orders.

What it models, and what it leaves out
--------------------------------------
* **Work.** A forward tile ``(m_block, head, batch)`` costs the number of K/V blocks its
  mainloop visits (``orders.kv_blocks_visited``); the time unit is one K/V-block iteration
  of one CTA. ``fractional=True`` instead charges the unmasked fraction of each block, as if
  masked scores were free (they are not on a GPU: a partly masked block still runs a full
  MMA, which is why whole blocks are the default).
* **Dispatch.** Greedy list scheduling: tile ``i`` of the order goes to the first SM that is
  free, ties to the lower SM index. That is what both a one-CTA-per-tile grid (the block
  dispatcher hands out ``blockIdx`` in order) and a persistent kernel with an atomic tile
  counter do, with one CTA per SM as in FlashAttention.
* **Ideal.** No order can beat ``max(total work / num_SMs, longest tile)``; tables report
  ``makespan / ideal``. Graham (1966) bounds *any* list schedule by
  ``total/P + (1 - 1/P) longest``; sorted LPT by ``(4/3 - 1/(3P)) OPT`` (Graham 1969).
* **L2 (optional, coarse).** An LRU cache over K/V working sets, one per
  ``(batch, kv_head)``, in units of K/V blocks (``tile_n * (d + d_v) * bytes``). A tile that
  needs its first ``k`` blocks and finds only ``r < k`` resident fetches ``k - r`` blocks from
  DRAM. DRAM is one shared pipe (the chip's bandwidth, FIFO in start order): a tile ends at
  ``max(start + work, its fetch done)``, i.e. loads overlap compute (TMA is asynchronous)
  until DRAM saturates. Compulsory misses (each head fetched once) cost almost nothing;
  thrashing (every tile refetches its K/V) makes DRAM the bottleneck. That contrast is all
  the model is for: it shows *why* batches go outermost and heads are cut into sections.
  Q, O and LSE traffic, the two L2 partitions and partial-line effects are not modelled.
* **Deterministic backward.** ``simulate_bwd``: a tile is a K/V block ``n``; it walks its Q
  blocks ascending from the diagonal, one time unit each, and after each step adds its
  partial dQ into dQ block ``m``. In deterministic mode the add waits until every adder
  before it in the fixed order of that dQ block (``orders.dq_rank``) has added (a
  semaphore); the CTA stalls meanwhile. The stall is what the SPT order removes.

Units for the H100 defaults (``L2Model.h100``): one step of a 128 x 128 tile at d = 128 is
``2 * 128 * 128 * 256 = 8.4 MFLOP``; at the H100 SXM5 spec of 989 dense BF16 TFLOP/s shared
by 132 SMs that is 1.12 us, in which the 3.35 TB/s of HBM3 deliver 3.75 MB = 57 K/V blocks
of 64 KiB. If all 132 SMs each need a new block per step, DRAM needs 132 / 57 = 2.3 steps
per step: a thrashing order runs about 2.3x slower; a non-thrashing one does not notice.
"""
from __future__ import annotations

import heapq
import sys
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from . import orders as O
from .orders import Tiles, cdiv

__all__ = [
    "H100_SMS", "L2Model", "Schedule", "Problem", "tile_costs", "simulate", "simulate_striding", "simulate_bwd",
    "run_forward", "run_backward", "lower_bound", "compare", "gantt",
]

H100_SMS = 132  # H100 SXM5 has 132 SMs enabled (NVIDIA datasheet)
H100_BF16_DENSE_FLOPS = 989e12  # H100 SXM5 datasheet: 1979 TFLOP/s BF16 with sparsity, half dense
H100_DRAM_BYTES_PER_S = 3.35e12  # H100 SXM5 datasheet: HBM3, 3.35 TB/s


# --------------------------------------------------------------------------------------------
# 1. what a tile costs
# --------------------------------------------------------------------------------------------
def _per_tile(x, batch):
    """A scalar, or a per-batch array looked up by each tile's batch."""
    x = np.asarray(x)
    return x if x.ndim == 0 else x[batch]


def tile_costs(tiles: Tiles, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool = True,
               fractional: bool = False) -> np.ndarray:
    """Work of each forward tile, in K/V-block steps. ``seqlen_q``/``seqlen_k``: scalars or
    per-batch arrays (varlen: ``np.diff(cu_seqlens)``). Bottom-right causal alignment.

    Whole blocks (default): the mainloop trip count, e.g. 8k causal with 128 x 128 tiles:
    Q block m costs m + 1. ``fractional``: (unmasked scores of the tile) / (tile_m * tile_n);
    row i sees ``clip(i + seqlen_k - seqlen_q + 1, 0, seqlen_k)`` keys.
    """
    sq, sk = _per_tile(seqlen_q, tiles.batch), _per_tile(seqlen_k, tiles.batch)
    if not fractional:
        return O.kv_blocks_visited(tiles.block, sq, sk, tile_m, tile_n, causal).astype(float)
    rows = np.asarray(tiles.block)[:, None] * tile_m + np.arange(tile_m)[None, :]  # (T, tile_m)
    shape = np.shape(tiles.block)
    sq2, sk2 = np.broadcast_to(sq, shape)[:, None], np.broadcast_to(sk, shape)[:, None]  # (T, 1)
    seen = np.clip(rows + sk2 - sq2 + 1, 0, sk2) if causal else np.broadcast_to(sk2, rows.shape)
    seen = np.where(rows < sq2, seen, 0)
    return seen.sum(axis=1) / float(tile_m * tile_n)


def lower_bound(costs, num_sms: int) -> float:
    """No schedule of these tiles on ``num_sms`` SMs ends before this."""
    costs = np.asarray(costs, dtype=float)
    return float(max(costs.sum() / num_sms, costs.max(initial=0.0)))


# --------------------------------------------------------------------------------------------
# 2. the result of a simulation
# --------------------------------------------------------------------------------------------
@dataclass
class Schedule:
    """Per-tile placement, in launch order. Times are in K/V-block steps."""

    tiles: Tiles
    cost: np.ndarray   # work of each tile (no L2 or semaphore time)
    sm: np.ndarray     # SM that ran it
    start: np.ndarray
    end: np.ndarray    # end - start - cost = time lost to DRAM (fwd) or semaphores (bwd)
    num_sms: int
    kind: str = "fwd"  # "fwd" | "bwd"
    dram_bytes: float | None = None        # K/V bytes fetched from DRAM (L2 model only)
    compulsory_bytes: float | None = None  # each working set fetched exactly once
    stall: np.ndarray | None = None        # bwd: total semaphore wait per tile
    first_write_stall: np.ndarray | None = None  # bwd: wait before the tile's first dQ add
    stall_intervals: np.ndarray = field(default_factory=lambda: np.zeros((0, 3)))  # (sm, t0, t1)

    @property
    def makespan(self) -> float:
        return float(self.end.max(initial=0.0))

    @property
    def lower_bound(self) -> float:
        return lower_bound(self.cost, self.num_sms)

    @property
    def busy_fraction(self) -> float:
        """Useful work / (SMs x makespan): 1 means no SM ever idled or stalled."""
        return float(self.cost.sum() / (self.num_sms * self.makespan)) if self.makespan else 1.0


# --------------------------------------------------------------------------------------------
# 3. L2 model
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class L2Model:
    """Capacity and DRAM speed, in the units of the simulation (see the module docstring)."""

    capacity_bytes: float
    block_bytes: float            # one K/V block: tile_n * (d + d_v) * dtype_bytes
    dram_blocks_per_step: float   # K/V blocks the whole chip's DRAM delivers per time unit

    @classmethod
    def h100(cls, tile_m: int = 128, tile_n: int = 128, head_dim: int = 128,
             head_dim_v: int | None = None, dtype_bytes: int = 2, num_sms: int = H100_SMS,
             capacity_bytes: float = O.H100_L2_BYTES) -> "L2Model":
        dv = head_dim if head_dim_v is None else head_dim_v
        flops_per_step = 2.0 * tile_m * tile_n * (head_dim + dv)  # QK^T and PV of one block
        seconds_per_step = flops_per_step / (H100_BF16_DENSE_FLOPS / num_sms)
        block_bytes = float(tile_n * (head_dim + dv) * dtype_bytes)
        return cls(capacity_bytes, block_bytes,
                   H100_DRAM_BYTES_PER_S * seconds_per_step / block_bytes)


class _LRU:
    """Resident K/V blocks per working set, least recently used evicted first."""

    def __init__(self, capacity_blocks: float):
        self.capacity = capacity_blocks
        self.resident: OrderedDict = OrderedDict()
        self.used = 0

    def access(self, key, need: int) -> int:
        have = self.resident.pop(key, 0)
        missed = max(0, need - have)
        self.resident[key] = max(have, need)  # now most recently used
        self.used += missed
        # A single working set larger than L2 is kept (coarse: it would thrash itself).
        while self.used > self.capacity and len(self.resident) > 1:
            _, blocks = self.resident.popitem(last=False)
            self.used -= blocks
        return missed


# --------------------------------------------------------------------------------------------
# 4. forward: greedy list scheduling (+ L2)
# --------------------------------------------------------------------------------------------
def simulate(order_tiles: Tiles, costs, num_sms: int, l2: L2Model | None = None,
             kv_blocks=None, heads_per_kv: int = 1) -> Schedule:
    """Run the tiles in the given order on ``num_sms`` SMs; each next tile goes to the first
    free SM (ties: lowest index). Start times are non-decreasing along the order, so the
    L2 sees accesses in list order.

    ``l2``: optional cache model. ``kv_blocks``: K/V blocks each tile reads (default
    ``ceil(costs)``); ``heads_per_kv``: GQA group, query head h reads KV head h // group.
    """
    costs = np.asarray(costs, dtype=float)
    n = len(costs)
    sm = np.zeros(n, dtype=np.int64)
    start, end = np.zeros(n), np.zeros(n)
    free = [(0.0, s) for s in range(num_sms)]  # a valid heap already: sorted
    lru = dram_free = None
    dram_blocks = 0
    need_max: dict = {}
    if l2 is not None:
        lru, dram_free = _LRU(l2.capacity_bytes / l2.block_bytes), 0.0
        kv_blocks = np.ceil(costs).astype(np.int64) if kv_blocks is None else np.asarray(kv_blocks)
        kv_head = np.asarray(order_tiles.head) // heads_per_kv
    for i in range(n):
        t, s = heapq.heappop(free)
        stop = t + costs[i]
        if lru is not None:
            key = (int(order_tiles.batch[i]), int(kv_head[i]))
            need = int(kv_blocks[i])
            need_max[key] = max(need_max.get(key, 0), need)
            missed = lru.access(key, need)
            if missed:
                dram_blocks += missed
                dram_free = max(dram_free, t) + missed / l2.dram_blocks_per_step
                stop = max(stop, dram_free)  # compute overlaps the loads until DRAM saturates
        sm[i], start[i], end[i] = s, t, stop
        heapq.heappush(free, (stop, s))
    sched = Schedule(order_tiles, costs, sm, start, end, num_sms)
    if l2 is not None:
        sched.dram_bytes = dram_blocks * l2.block_bytes
        sched.compulsory_bytes = sum(need_max.values()) * l2.block_bytes
    return sched


def simulate_striding(order_tiles: Tiles, costs, num_sms: int) -> Schedule:
    """A persistent kernel with a fixed hand-out: CTA c runs tiles c, c + num_sms, c + 2 num_sms, ...
    of the order back to back (``common.PersistentScheduler(dynamic=False)``), whoever is free.
    With equal costs it places every tile exactly as ``simulate`` does; with unequal ones (causal,
    varlen) a CTA that drew long tiles keeps drawing them and finishes last."""
    costs = np.asarray(costs, dtype=float)
    n = len(costs)
    sm = np.arange(n, dtype=np.int64) % num_sms
    start, end = np.zeros(n), np.zeros(n)
    clock = np.zeros(num_sms)
    for i in range(n):
        start[i] = clock[sm[i]]
        end[i] = clock[sm[i]] = start[i] + costs[i]
    return Schedule(order_tiles, costs, sm, start, end, num_sms)


# --------------------------------------------------------------------------------------------
# 5. deterministic backward: semaphore-ordered dQ adds
# --------------------------------------------------------------------------------------------
_ADD_DONE, _STEP_DONE, _SM_FREE = 0, 1, 2  # event kinds; at equal times, releases go first


def simulate_bwd(order_tiles: Tiles, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool,
                 num_sms: int, deterministic: bool = True, descending: bool = True,
                 step_cost: float = 1.0, dq_add_cost: float = 0.0) -> Schedule:
    """Event simulation of the backward pass; ``order_tiles.block`` are K/V blocks ``n``.

    Tile ``(n, h, b)`` runs steps over Q blocks ``m = first_q_block(n) .. m_blocks - 1``
    (ascending from the diagonal). Each step: ``step_cost`` of compute, then an add into dQ
    tile ``(m, h, b)`` taking ``dq_add_cost``. Deterministic: the add may begin only when the
    semaphore of that dQ tile equals this tile's ``dq_rank`` (``descending`` picks SPT's
    order, else ascending ``n``), i.e. when every earlier adder has finished; the CTA waits.
    Raises ``RuntimeError`` on a deadlock (every SM waits on a tile not yet launched: a
    reduction order that contradicts the launch order).
    """
    bs = np.asarray(order_tiles.batch)
    n_blk, heads = np.asarray(order_tiles.block), np.asarray(order_tiles.head)
    sq, sk = _per_tile(seqlen_q, bs), _per_tile(seqlen_k, bs)
    first = np.broadcast_to(O.first_q_block(n_blk, sq, sk, tile_m, tile_n, causal), n_blk.shape)
    m_blocks = np.broadcast_to(cdiv(sq, tile_m), n_blk.shape)
    steps = np.maximum(m_blocks - first, 0)
    n = len(n_blk)
    # The rank of every (tile, step) up front: step k of tile i is flat[offset[i] + k].
    offset = np.concatenate([[0], np.cumsum(steps)])
    tile_of = np.repeat(np.arange(n), steps)
    m_flat = first[tile_of] + (np.arange(offset[-1]) - offset[tile_of])
    rank_flat = O.dq_rank(n_blk[tile_of], m_flat, _per_tile(sq, tile_of), _per_tile(sk, tile_of),
                          tile_m, tile_n, causal, descending).tolist()
    first_l, heads_l, bs_l = first.tolist(), heads.tolist(), bs.tolist()
    offset_l, steps_l = offset.tolist(), steps.tolist()
    sm_of = np.full(n, -1, dtype=np.int64)
    start, end = np.zeros(n), np.full(n, np.nan)
    stall, first_stall = np.zeros(n), np.zeros(n)
    intervals = []
    sem: dict = {}      # dQ tile -> adds completed
    waiting: dict = {}  # dQ tile -> {rank: (arrival time, sm, tile, step)}
    events: list = []
    seq = 0
    next_tile = 0

    def push(t, kind, s, i=-1, k=-1):
        nonlocal seq
        heapq.heappush(events, (t, kind, s, seq, i, k))
        seq += 1

    def dq_tile(i, k):
        return (first_l[i] + k, heads_l[i], bs_l[i])

    for s in range(num_sms):
        push(0.0, _SM_FREE, s)
    while events:
        t, kind, s, _, i, k = heapq.heappop(events)
        if kind == _SM_FREE:
            while next_tile < n and steps_l[next_tile] == 0:  # no work: done at once
                sm_of[next_tile], start[next_tile], end[next_tile] = s, t, t
                next_tile += 1
            if next_tile < n:
                i, next_tile = next_tile, next_tile + 1
                sm_of[i], start[i] = s, t
                push(t + step_cost, _STEP_DONE, s, i, 0)
        elif kind == _STEP_DONE:
            key = dq_tile(i, k)
            rank = rank_flat[offset_l[i] + k]
            if not deterministic or sem.get(key, 0) == rank:
                push(t + dq_add_cost, _ADD_DONE, s, i, k)
            else:
                waiting.setdefault(key, {})[rank] = (t, s, i, k)
        else:  # _ADD_DONE: release the semaphore, wake the next adder, continue
            key = dq_tile(i, k)
            if deterministic:
                sem[key] = sem.get(key, 0) + 1
                nxt = waiting.get(key, {}).pop(sem[key], None)
                if nxt is not None:
                    t_arr, s2, i2, k2 = nxt
                    stall[i2] += t - t_arr
                    if k2 == 0:
                        first_stall[i2] = t - t_arr
                    if t > t_arr:
                        intervals.append((s2, t_arr, t))
                    push(t + dq_add_cost, _ADD_DONE, s2, i2, k2)
            if k + 1 < steps_l[i]:
                push(t + step_cost, _STEP_DONE, s, i, k + 1)
            else:
                end[i] = t
                push(t, _SM_FREE, s)
    if next_tile < n or np.isnan(end).any():
        stuck = int(np.isnan(end).sum())
        raise RuntimeError(f"deadlock: {stuck} tiles never finished; the dQ reduction order "
                           "waits on tiles launched later than the SMs can hold")
    sched = Schedule(order_tiles, steps * step_cost, sm_of, start, end, num_sms, kind="bwd")
    sched.stall, sched.first_write_stall = stall, first_stall
    sched.stall_intervals = np.asarray(intervals, dtype=float).reshape(-1, 3)
    return sched


# --------------------------------------------------------------------------------------------
# 6. a problem description and named orders, for tables and tests
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Problem:
    """One attention launch: per-batch sequence lengths (fixed-length = all equal)."""

    seqlens_q: tuple
    seqlens_k: tuple
    heads: int
    heads_kv: int
    head_dim: int = 128
    tile_m: int = 128
    tile_n: int = 128
    causal: bool = True
    dtype_bytes: int = 2

    @classmethod
    def fixed(cls, batch: int, heads: int, seqlen_q: int, seqlen_k: int | None = None,
              heads_kv: int | None = None, **kw) -> "Problem":
        seqlen_k = seqlen_q if seqlen_k is None else seqlen_k
        return cls((seqlen_q,) * batch, (seqlen_k,) * batch, heads,
                   heads if heads_kv is None else heads_kv, **kw)

    @classmethod
    def varlen(cls, seqlens_q, heads: int, seqlens_k=None, heads_kv: int | None = None,
               **kw) -> "Problem":
        seqlens_k = seqlens_q if seqlens_k is None else seqlens_k
        return cls(tuple(int(s) for s in seqlens_q), tuple(int(s) for s in seqlens_k), heads,
                   heads if heads_kv is None else heads_kv, **kw)

    @property
    def num_batch(self) -> int:
        return len(self.seqlens_q)

    @property
    def group(self) -> int:
        return self.heads // self.heads_kv

    @property
    def is_fixed(self) -> bool:
        return len(set(self.seqlens_q)) == 1 and len(set(self.seqlens_k)) == 1

    @property
    def sq(self) -> np.ndarray:
        return np.asarray(self.seqlens_q, dtype=np.int64)

    @property
    def sk(self) -> np.ndarray:
        return np.asarray(self.seqlens_k, dtype=np.int64)

    def cu_seqlens(self):
        """(cu_seqlens_q, cu_seqlens_k) int32, as a varlen kernel receives them."""
        return tuple(np.concatenate([[0], np.cumsum(s)]).astype(np.int32) for s in (self.sq, self.sk))

    def section(self, l2_bytes: float = O.H100_L2_BYTES, power_of_two: bool = True, **kw) -> int:
        """Query heads per L2 section. Rounded to a power of two by default: then sections
        divide power-of-two head counts evenly (a narrow last section starts its long tiles
        late; ``tests/test_stage5_simulator.py::test_lpt_is_a_heuristic`` shows 88 vs 66
        steps) and a device scheduler shifts instead of dividing."""
        return O.heads_per_section(l2_bytes, int(self.sk.max()), self.head_dim, self.dtype_bytes,
                                   self.group, power_of_two=power_of_two, **kw)

    def l2(self, num_sms: int = H100_SMS, capacity_bytes: float = O.H100_L2_BYTES) -> L2Model:
        return L2Model.h100(self.tile_m, self.tile_n, self.head_dim, None, self.dtype_bytes,
                            num_sms, capacity_bytes)

    FORWARD_ORDERS = ("naive", "lpt_no_sections", "lpt_causal", "lpt_causal_flat", "lpt_unsorted", "lpt_varlen")
    BACKWARD_ORDERS = ("naive_bwd", "lpt_bwd", "spt_bwd")

    def forward_tiles(self, order: str, heads_per_section: int | None = None) -> Tiles:
        """All forward tiles in the named order. Fixed-length orders need equal lengths;
        ``lpt_unsorted`` (sections + reversed m, batches as given) and ``lpt_varlen``
        (sorted) work for any lengths; ``naive`` for varlen walks batches as given."""
        S = self.section() if heads_per_section is None else heads_per_section
        H, B = self.heads, self.num_batch
        if order in ("naive", "lpt_unsorted", "lpt_varlen"):
            meta = self.varlen_meta(order, S)
            return O.list_order(O.lpt_varlen, meta.num_tiles, meta)
        if not self.is_fixed:
            raise ValueError(f"{order} needs equal sequence lengths")
        M = int(cdiv(self.seqlens_q[0], self.tile_m))
        if order == "lpt_no_sections":
            return O.list_order(O.lpt_no_sections, M * H * B, M, H, B)
        if order in ("lpt_causal", "lpt_causal_flat"):
            return O.list_order(getattr(O, order), M * H * B, M, H, B, S, self.heads_kv)
        raise ValueError(f"unknown forward order {order!r}; known: {self.FORWARD_ORDERS}")

    def varlen_meta(self, order: str, heads_per_section: int | None = None) -> O.VarlenMeta:
        S = self.section() if heads_per_section is None else heads_per_section
        cu_q, cu_k = self.cu_seqlens()
        if order == "naive":
            return O.varlen_metadata(cu_q, cu_k, self.heads, self.tile_m, self.tile_n, self.causal,
                                     heads_per_section=1, sort=False, reverse_blocks=False)
        return O.varlen_metadata(cu_q, cu_k, self.heads, self.tile_m, self.tile_n, self.causal,
                                 heads_per_section=S, sort=(order == "lpt_varlen"),
                                 reverse_blocks=True)

    def backward_tiles(self, order: str, heads_per_section: int | None = None) -> Tiles:
        if not self.is_fixed:
            raise ValueError("backward orders here are fixed-length")
        S = self.section() if heads_per_section is None else heads_per_section
        N, H, B = int(cdiv(self.seqlens_k[0], self.tile_n)), self.heads, self.num_batch
        if order == "naive_bwd":
            return O.list_order(O.naive_bwd, N * H * B, N, H, B)
        if order == "lpt_bwd":
            return O.list_order(O.lpt_bwd, N * H * B, N, H, B, S)
        if order == "spt_bwd":
            return O.list_order(O.spt_bwd, N * H * B, N, H, B, S)
        raise ValueError(f"unknown backward order {order!r}; known: {self.BACKWARD_ORDERS}")

    def costs(self, tiles: Tiles, fractional: bool = False) -> np.ndarray:
        return tile_costs(tiles, self.sq, self.sk, self.tile_m, self.tile_n, self.causal, fractional)


def run_forward(problem: Problem, order: str, num_sms: int = H100_SMS, l2: L2Model | None = None,
                heads_per_section: int | None = None, fractional: bool = False) -> Schedule:
    tiles = problem.forward_tiles(order, heads_per_section)
    kv = O.kv_blocks_visited(tiles.block, problem.sq[tiles.batch], problem.sk[tiles.batch],
                             problem.tile_m, problem.tile_n, problem.causal)
    return simulate(tiles, problem.costs(tiles, fractional), num_sms, l2, kv, problem.group)


# The reduction order each backward launch order is paired with: the order in which the
# adders of one dQ tile are launched, so no CTA ever waits on one that has not started.
_BWD_DESCENDING = {"naive_bwd": False, "lpt_bwd": False, "spt_bwd": True}


def run_backward(problem: Problem, order: str, num_sms: int = H100_SMS, deterministic: bool = True,
                 heads_per_section: int | None = None, dq_add_cost: float = 0.0) -> Schedule:
    tiles = problem.backward_tiles(order, heads_per_section)
    return simulate_bwd(tiles, problem.sq, problem.sk, problem.tile_m, problem.tile_n,
                        problem.causal, num_sms, deterministic, _BWD_DESCENDING[order],
                        dq_add_cost=dq_add_cost)


# --------------------------------------------------------------------------------------------
# 7. reporting: a table and a Gantt chart
# --------------------------------------------------------------------------------------------
def compare(schedules: dict, title: str | None = None, file=None, quiet: bool = False) -> str:
    """Markdown table of makespans per order, normalized to the ideal lower bound
    max(total / P, longest tile); the first row is the baseline for the speedup column.
    Printed to ``file`` (default: the current ``sys.stdout``) unless ``quiet``."""
    names = list(schedules)
    base = schedules[names[0]].makespan
    l2 = any(s.dram_bytes is not None for s in schedules.values())
    bwd = any(s.kind == "bwd" for s in schedules.values())
    head = ["order", "makespan", "makespan / ideal", f"speedup vs {names[0]}"]
    if l2:
        head += ["K/V from DRAM (MiB)", "x compulsory"]
    if bwd:
        head += ["semaphore wait (tile-steps)", "tiles stalled on 1st dQ add"]
    lines = [f"**{title}**", ""] if title else []
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        s = schedules[name]
        row = [f"`{name}`", f"{s.makespan:.1f}", f"{s.makespan / s.lower_bound:.3f}",
               f"{base / s.makespan:.3f}x"]
        if l2:
            if s.dram_bytes is None:
                row += ["-", "-"]
            else:
                row += [f"{s.dram_bytes / 2**20:.0f}", f"{s.dram_bytes / s.compulsory_bytes:.2f}"]
        if bwd:
            if s.stall is None:
                row += ["-", "-"]
            else:
                row += [f"{s.stall.sum():.0f}", f"{int((s.first_write_stall > 0).sum())}"]
        lines.append("| " + " | ".join(row) + " |")
    text = "\n".join(lines)
    if not quiet:
        print(text, file=sys.stdout if file is None else file)
    return text


def _rects(ax, y, x0, width, colors):
    """Add many axis-aligned bars (one row each) as a single PolyCollection: one artist for
    thousands of tiles keeps plotting fast."""
    from matplotlib.collections import PolyCollection

    y, x0, width = (np.asarray(a, dtype=float) for a in (y, x0, width))
    if not len(y):
        return
    x1, y0, y1 = x0 + width, y - 0.5, y + 0.5
    verts = np.stack([np.stack([x0, y0], -1), np.stack([x1, y0], -1),
                      np.stack([x1, y1], -1), np.stack([x0, y1], -1)], axis=1)  # (T, 4, 2)
    ax.add_collection(PolyCollection(verts, facecolors=colors, edgecolors="none"))


def gantt(schedule: Schedule, ax=None, color_by: str = "batch", title: str | None = None):
    """One row per SM, one bar per tile. ``color_by``: "batch", "head" or "m_block"
    ("n_block"/"block" alias it). Time lost to DRAM (fwd, L2 model) or to the dQ semaphore
    (bwd) is drawn dark grey; dashed line = ideal lower bound, red line = makespan."""
    import matplotlib.pyplot as plt  # lazy: the simulator itself needs no matplotlib
    from matplotlib import colors as mcolors

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    s = schedule
    key = {"batch": "batch", "head": "head", "m_block": "block", "n_block": "block",
           "block": "block"}[color_by]
    vals = np.asarray(getattr(s.tiles, key))
    if key == "block":
        cmap = plt.get_cmap("viridis")
        col = cmap(vals / max(1, vals.max()))
    else:
        cmap = plt.get_cmap("tab20" if vals.max(initial=0) >= 10 else "tab10")
        col = cmap(vals % cmap.N)
    lost = s.end - s.start - s.cost
    if s.kind == "bwd":  # stalls sit between steps: draw the tile, then the waits on top
        _rects(ax, s.sm, s.start, s.end - s.start, col)
        iv = s.stall_intervals
        _rects(ax, iv[:, 0], iv[:, 1], iv[:, 2] - iv[:, 1], "0.2")
    else:  # work first, the DRAM-bound remainder after it
        _rects(ax, s.sm, s.start, s.cost, col)
        has = lost > 1e-9
        _rects(ax, s.sm[has], s.start[has] + s.cost[has], lost[has], "0.2")
    ax.axvline(s.lower_bound, color="k", ls="--", lw=1)
    ax.axvline(s.makespan, color="r", lw=1)
    ax.set_ylim(s.num_sms - 0.5, -0.5)
    ax.set_xlim(0, s.makespan * 1.02)
    ax.set_ylabel("SM")
    ax.set_xlabel("time (K/V-block steps)")
    label = f"makespan {s.makespan:.0f} = {s.makespan / s.lower_bound:.3f} x ideal"
    ax.set_title(f"{title}: {label}" if title else label, fontsize=9)
    if key == "block":
        sm_ = plt.cm.ScalarMappable(norm=mcolors.Normalize(0, max(1, vals.max())), cmap=cmap)
        ax.figure.colorbar(sm_, ax=ax, pad=0.01, label=color_by)
    return ax
