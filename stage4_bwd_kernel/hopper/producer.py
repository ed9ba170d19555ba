"""The producer warp of the production Hopper backward: TMA loads of K, V and, per Q tile, Q, dO and
their row statistics into a ring of ``options.stages`` stages (two; an override may build one, as the
tests do for comparison) guarded by mbarriers.

Each Q tile's lse2 (log2-scaled lse) and D (rowsum(dO * O)) ride on its Q and dO barriers as one 1-D
TMA box each, so the consumers never load them from global memory nor stage them through SMEM. Rows
past the tensor arrive as 0 and are masked like the Q / dO rows past a sequence. Needs rows of 16-byte
multiples (the preprocess pads them) and, varlen, each sequence's statistics starting 16-byte aligned
(``common.stats_offset``: a box at an unaligned start coordinate faults).

K and V (``kv_with_first``): on a barrier of their own that the consumers wait for before the walk, or
-- causal d = 64 outside deterministic mode -- on the first Q tile's barrier (K) and its dO barrier (V),
each adding its bytes to that phase with an expect-tx that does not arrive. The first S^T then waits
for K and Q only, not for V's 16 KB queued ahead of Q. An empty walk then loads neither.
"""
from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync

from stage4_bwd_kernel.hopper.options import NUM_WG_MMA


class SmemLayouts(NamedTuple):
    """Shared-memory layouts of the operands (ComposedLayouts: swizzle + layout) and the statistics ring."""
    sQ: cute.ComposedLayout     # (tm, d, stages)
    sdO: cute.ComposedLayout    # (tm, dv, stages)
    sK: cute.ComposedLayout     # (tn, d)
    sV: cute.ComposedLayout     # (tn, dv)
    sdSt: cute.ComposedLayout   # (tn, tm, ds_buffers), wide: (tn, tm, 2 * ds_buffers) with P^T
    sdQ: cute.ComposedLayout    # fragment order (share elems, shares) or row order (rows, cols, shares)
    sStat: cute.Layout          # (tm, stages) fp32


def swizzled(storage, name: str, layouts: SmemLayouts) -> cute.Tensor:
    """The swizzled tensor of SMEM buffer `name` (sQ, sdO, sK, sV, sdSt, sdQ) of the shared storage."""
    layout = getattr(layouts, name)
    return getattr(storage, name).get_tensor(layout.outer, swizzle=layout.inner)


class TmaLoads(NamedTuple):
    """The TMA atoms and (S, D, H, B)-ordered tensors the producer reads."""
    atom_Q: cute.CopyAtom
    Q: cute.Tensor
    atom_dO: cute.CopyAtom
    dO: cute.Tensor
    atom_K: cute.CopyAtom
    K: cute.Tensor
    atom_V: cute.CopyAtom
    V: cute.Tensor
    atom_LSE2: cute.CopyAtom
    LSE2: cute.Tensor
    atom_D: cute.CopyAtom
    D: cute.Tensor


class Pipes(NamedTuple):
    kv: pipeline.PipelineTmaAsync    # K and V, one stage
    q: pipeline.PipelineTmaAsync     # Q (+ lse2), options.stages
    do: pipeline.PipelineTmaAsync    # dO (+ D), options.stages


class Producer:
    """Producer methods of the kernel class."""

    def make_pipelines(self, storage) -> Pipes:
        """K/V (one stage) and the Q / dO rings. Producer = 1 arrival (the elected lane of warp 0 posts
        the byte count); consumers = the 8 warps of the two MMA warpgroups. Ends with the last CTA-wide
        barrier: the inits are visible to every thread and to the TMA unit."""
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, NUM_WG_MMA * 4)
        pipes = [pipeline.PipelineTmaAsync.create(barrier_storage=bar.data_ptr(), num_stages=n,
                                                  producer_group=producer_group, consumer_group=consumer_group,
                                                  tx_count=tx, defer_sync=True)
                 for bar, n, tx in ((storage.mbar_KV, 1, self.tma_bytes_KV),
                                    (storage.mbar_Q, self.num_stages, self.tma_bytes_Q),
                                    (storage.mbar_dO, self.num_stages, self.tma_bytes_dO))]
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        return Pipes(*pipes)

    @cute.jit
    def produce(self, walk, storage, loads: TmaLoads, layouts, pipes: Pipes, kv_state=None, tiles_before=0):
        """Warp 0: K_j and V_j, then Q_i, dO_i (+ lse2_i, D_i) of every tile of the walk, each as soon as
        its stage is free. layouts: the kernel's SmemLayouts. A persistent CTA (persistent.py) passes the
        K/V stage's state of this walk and the tiles its earlier walks put through the ring."""
        tm, tn, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        sLSE2, sD = storage.sLSE2.get_tensor(layouts.sStat), storage.sD.get_tensor(layouts.sStat)
        sQ, sdO = swizzled(storage, "sQ", layouts), swizzled(storage, "sdO", layouts)
        sK, sV = swizzled(storage, "sK", layouts), swizzled(storage, "sV", layouts)
        offset_q, offset_k, bidx, batch = walk.offset_q, walk.offset_k, walk.bidx, walk.batch
        head_kv, n_block = walk.head_kv, walk.n_block
        m_block_min, m_block_max, qhead_per_kvhead = walk.m_block_min, walk.m_block_max, walk.qhead_per_kvhead

        gK = cute.local_tile(cute.domain_offset((offset_k, 0), loads.K[None, None, head_kv, bidx]), (tn, d),
                             (n_block, 0))
        gV = cute.local_tile(cute.domain_offset((offset_k, 0), loads.V[None, None, head_kv, bidx]), (tn, dv),
                             (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(loads.atom_K, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2),
                                           cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(loads.atom_V, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2),
                                           cute.group_modes(gV, 0, 2))
        if const_expr(not self.kv_with_first):
            if const_expr(kv_state is None):
                kv_state = pipeline.PipelineState(1, Int32(0), Int32(0), Int32(1))
            pipes.kv.producer_acquire(kv_state)
            cute.copy(loads.atom_K, tKgK, tKsK, tma_bar_ptr=pipes.kv.producer_get_barrier(kv_state))
            cute.copy(loads.atom_V, tVgV, tVsV, tma_bar_ptr=pipes.kv.producer_get_barrier(kv_state))

        stats = ((loads.atom_LSE2, loads.LSE2, sLSE2), (loads.atom_D, loads.D, sD))
        n_m = m_block_max - m_block_min
        for head_in_group in cutlass.range(qhead_per_kvhead, unroll=1):
            head = head_kv * qhead_per_kvhead + head_in_group
            gQ = cute.local_tile(cute.domain_offset((offset_q, 0), loads.Q[None, None, head, bidx]), (tm, d),
                                 (None, 0))
            gdO = cute.local_tile(cute.domain_offset((offset_q, 0), loads.dO[None, None, head, bidx]), (tm, dv),
                                  (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(loads.atom_Q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            tdOsdO, tdOgdO = cpasync.tma_partition(loads.atom_dO, 0, cute.make_layout(1),
                                                   cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2))
            stat_parts = [cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(sStat, 0, 1),
                                                cute.group_modes(cute.local_tile(cute.domain_offset(
                                                    (self.stats_offset(offset_q, batch),), tma_stat[None, head, bidx]),
                                                    (tm,), (None,)), 0, 1))
                          for atom, tma_stat, sStat in stats]               # (lse2, D): (smem, gmem)
            for m_pos in cutlass.range(m_block_min, m_block_max, unroll=1):
                t = tiles_before + head_in_group * n_m + m_pos - m_block_min
                m_block = self.m_at(walk, m_pos)  # walk.py: m_pos itself unless the walk is rotated
                st = self.tile_state(t, producer=True)
                pipes.q.producer_acquire(st)
                if const_expr(self.kv_with_first):
                    if t == 0:
                        self.load_with(loads.atom_K, tKgK, tKsK, pipes.q.producer_get_barrier(st), self.tma_bytes_K)
                cute.copy(loads.atom_Q, tQgQ[None, m_block], tQsQ[None, st.index],
                          tma_bar_ptr=pipes.q.producer_get_barrier(st))
                if t == 0:  # K, V and Q are the call's inputs; lse2 and D come from the preprocess (PDL)
                    cute.arch.griddepcontrol_wait()
                cute.copy(stats[0][0], stat_parts[0][1][None, m_block], stat_parts[0][0][None, st.index],
                          tma_bar_ptr=pipes.q.producer_get_barrier(st))
                pipes.do.producer_acquire(st)
                if const_expr(self.kv_with_first):
                    if t == 0:
                        self.load_with(loads.atom_V, tVgV, tVsV, pipes.do.producer_get_barrier(st), self.tma_bytes_V)
                cute.copy(loads.atom_dO, tdOgdO[None, m_block], tdOsdO[None, st.index],
                          tma_bar_ptr=pipes.do.producer_get_barrier(st))
                cute.copy(stats[1][0], stat_parts[1][1][None, m_block], stat_parts[1][0][None, st.index],
                          tma_bar_ptr=pipes.do.producer_get_barrier(st))

    @cute.jit
    def load_with(self, tma_atom: cute.CopyAtom, src: cute.Tensor, dst: cute.Tensor, bar, num_bytes: int):
        """One more TMA load on a barrier the producer has already armed: its bytes are added to the
        phase's expected count (one lane) before the copy can land."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_expect_tx(bar, num_bytes)
        cute.copy(tma_atom, src, dst, tma_bar_ptr=bar)
