"""The backward kernel's tile walk, replayed in NumPy (float64), and its semaphores, simulated.

``backward_model`` does exactly what one CTA of ``hopper_step1`` does -- same grid, same walk
bounds, same masks in the same local (key row, query column) coordinates, same -inf / +inf
conventions, same dQ reduction order -- using the functions of ``schedule.py`` that the kernel
traces. Compared with stage 0's oracle it checks the *bookkeeping* of the kernel on the CPU
(causal bounds with Sq != Sk, varlen offsets, seqused_k, GQA grouping), which is where a kernel
that compiles can still be wrong.

``simulate_semaphores`` plays the deterministic mode: CTAs are dispatched in launch order onto a
limited number of SM slots, each walks its dQ tiles and may add into tile m only when the tile's
counter equals its rank -- or, with `warpgroups` adding shares on their own, reaches warpgroups x
rank -- (optionally seeing increments a `hop` late, as the GPU does). It reports a
deadlock (an order that waits on a CTA not yet dispatched), checks that every tile's adds happen in
the order's sequence, and measures how long CTAs stall (the cost the paper's SPT order, and the
launch in sections of chains, minimise).
"""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

import numpy as np

from stage4_bwd_kernel import schedule

LOG2E = math.log2(math.e)


def _seqs(batch, seqlen_q, seqlen_k, cu_seqlens_q, cu_seqlens_k, seqused_k):
    """Per batch: (offset_q, seqlen_q, offset_k, rows_k, seqlen_k used)."""
    if cu_seqlens_q is None:
        return [(0, seqlen_q, 0, seqlen_k, seqlen_k)] * batch
    cq, ck = list(map(int, cu_seqlens_q)), list(map(int, cu_seqlens_k))
    out = []
    for b in range(len(cq) - 1):
        rows_k = ck[b + 1] - ck[b]
        used = rows_k if seqused_k is None else min(int(seqused_k[b]), rows_k)
        out.append((cq[b], cq[b + 1] - cq[b], ck[b], rows_k, used))
    return out


def _idle_keys(key_limit, diag, tile_m, tile_n, causal, window, segment) -> np.ndarray:
    """(tile_n,) bool: the keys of a masked tile's idle warpgroup, dispatched as consumer.walk_tiles /
    edge_tile do: in the walk's first masked segment (segment 0), with a right edge, the last 64 where
    they lie past it or past the keys' end; in its last (segment 2), with a left edge, the first 64
    where they lie before it."""
    idle = np.zeros(tile_n, dtype=bool)
    edge = schedule.half_tile_edges(causal, window)[segment]
    if edge is not None and schedule.idle_warpgroup_hidden(edge, key_limit, diag, tile_m, causal, window):
        first = schedule.IDLE_WARPGROUP[edge] * schedule.WARPGROUP_KEYS
        idle[first:first + schedule.WARPGROUP_KEYS] = True
    return idle


def backward_model(q, k, v, out, dout, lse, *, causal=False, softmax_scale=None, tile_m=64, tile_n=128,
                   order=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None, window=None, softcap=0.0,
                   half_tiles=None):
    """Dense (B,S,H,D) or packed varlen (T,H,D) NumPy inputs -> (dq, dk, dv) float64, computed the
    way the kernel computes them (lse (B,Hq,Sq) dense or (Hq,Tq) varlen, natural log). window: a
    stage3_fwd_kernel.components.window.Window (its right edge 0 for causal) or None; softcap > 0:
    the scores are softcap * tanh(s / softcap) and dS carries the tanh's derivative. half_tiles (a
    128-key tile, two warpgroups of 64 keys; None: the kernel's default, fewer than 128 query rows): a
    masked tile's warpgroup whose keys ``schedule.keys_hidden`` says no query sees contributes nothing,
    as in the kernel (consumer.edge_tile), so a wrong rule or dispatch shows in the gradients."""
    varlen = cu_seqlens_q is not None
    q, k, v, out, dout, lse = (np.asarray(a, dtype=np.float64) for a in (q, k, v, out, dout, lse))
    if varlen:  # the kernel views packed tensors as a batch of one
        q, k, v, out, dout, lse = q[None], k[None], v[None], out[None], dout[None], lse[None]
    nb, sq_all, hq, d = q.shape
    sk_all, hkv = k.shape[1], k.shape[2]
    group = hq // hkv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    scale_log2 = (softcap if softcap else scale) * LOG2E  # P's exponent scale (softcap: folded, score_mod)
    order = order or schedule.default_dq_order(causal, True)
    tm, tn = tile_m, tile_n
    halves = tn == 128 and (tm < 128 if half_tiles is None else half_tiles)

    # preprocess
    with np.errstate(invalid="ignore"):
        lse2 = np.where(np.isneginf(lse), np.inf, lse * LOG2E)          # (B, H, S)
    dpsum = np.einsum("bshd,bshd->bhs", dout, out)

    dq_acc = np.zeros(q.shape)
    dk = np.zeros(k.shape)
    dv = np.zeros(v.shape)
    seqs = _seqs(nb, sq_all, sk_all, cu_seqlens_q, cu_seqlens_k, seqused_k)
    num_n_blocks = max(-(-rows_k // tn) for (_, _, _, rows_k, _) in seqs) if seqs else 0
    for batch, (off_q, sq, off_k, rows_k, sk) in enumerate(seqs):
        bidx = 0 if varlen else batch
        for head_kv in range(hkv):
            for bx in range(num_n_blocks):
                n_block = order.n_block_for_launch(bx, num_n_blocks)
                if not n_block * tn < rows_k:
                    continue
                kr = off_k + n_block * tn + np.arange(tn)
                kvalid = kr < off_k + rows_k
                K = np.where(kvalid[:, None], k[bidx, np.minimum(kr, sk_all - 1), head_kv], 0.0)  # zero-filled
                V = np.where(kvalid[:, None], v[bidx, np.minimum(kr, sk_all - 1), head_kv], 0.0)
                acc_dK = np.zeros((tn, d))
                acc_dV = np.zeros((tn, v.shape[-1]))
                m_min, m_max = schedule.m_block_range(n_block, tm, tn, sq, sk, causal, window=window)
                if n_block * tn >= sk:
                    m_max = m_min
                hot_lo, hot_hi = schedule.unmasked_m_range(n_block, tm, tn, sq, sk, causal, m_min, m_max,
                                                           window=window)
                for hi in range(group):
                    head = head_kv * group + hi
                    for m_block in range(m_min, m_max):
                        qr = m_block * tm + np.arange(tm)
                        qvalid = qr < sq
                        rows = off_q + np.minimum(qr, max(sq - 1, 0))
                        Q = np.where(qvalid[:, None], q[bidx, rows, head], 0.0)
                        dO = np.where(qvalid[:, None], dout[bidx, rows, head], 0.0)
                        L2 = np.where(qvalid, lse2[bidx, head, rows], np.inf)
                        Dv = np.where(qvalid, dpsum[bidx, head, rows], 0.0)
                        St = K @ Q.T                                   # (tn, tm) = S^T
                        dtanh = 1.0
                        if softcap:
                            St = np.tanh(St * (scale / softcap))
                            dtanh = 1.0 - St * St
                        key_limit, diag = schedule.mask_bounds(m_block, n_block, tm, tn, sq, sk)
                        if schedule.tile_needs_mask(key_limit, diag, tn, causal, window=window, tile_m=tm):
                            r, c = np.arange(tn)[:, None], np.arange(tm)[None, :]
                            St = np.where(schedule.is_masked(r, c, key_limit, diag, causal, window), -np.inf, St)
                        with np.errstate(invalid="ignore", over="ignore"):
                            Pt = np.exp2(St * scale_log2 - L2[None, :])
                        dPt = V @ dO.T
                        dSt = Pt * (dPt - Dv[None, :]) * dtanh
                        if halves:
                            segment = 0 if m_block < hot_lo else (2 if m_block >= hot_hi else 1)
                            idle = _idle_keys(key_limit, diag, tm, tn, causal, window, segment)
                            Pt, dSt = np.where(idle[:, None], 0.0, Pt), np.where(idle[:, None], 0.0, dSt)
                        acc_dV += Pt @ dO
                        acc_dK += dSt @ Q
                        dQ = dSt.T @ K                                 # (tm, d) = dS K
                        dq_acc[bidx, rows[qvalid], head] += dQ[qvalid]
                kw = kvalid & (kr < off_k + rows_k)
                dk[bidx, kr[kw], head_kv] = scale * acc_dK[kw]
                dv[bidx, kr[kw], head_kv] = acc_dV[kw]
    dq = scale * dq_acc
    if varlen:
        dq, dk, dv = dq[0], dk[0], dv[0]
    return dq, dk, dv


# --------------------------------------------------------------------------------------------
# Deterministic mode: a discrete-time simulation of the semaphores
# --------------------------------------------------------------------------------------------
@dataclass
class SemaphoreSim:
    finished: bool
    steps: int                       # time steps until the last CTA finished
    stall_steps: int                 # CTA-steps (warpgroup-steps with warpgroups) spent waiting on a semaphore
    first_write_stalls: int          # the same, before a CTA's first dQ add
    add_sequence: dict = field(default_factory=dict)  # (b, h, m[, share]) -> [n_block, ...] in add order


def launch_tiles(order, num_n_blocks, heads_kv, batch):
    """(n_block, kv head, batch) of every CTA of the grid (N, H_kv, B) in dispatch order: the
    order's ``host_tile`` when it maps the launch index itself, else blockIdx order (x fastest)."""
    if hasattr(order, "host_tile"):
        return [order.host_tile(i, num_n_blocks, heads_kv, batch) for i in range(num_n_blocks * heads_kv * batch)]
    return [(order.n_block_for_launch(bx, num_n_blocks), hk, b)
            for b in range(batch) for hk in range(heads_kv) for bx in range(num_n_blocks)]


def default_mode_steps(*, seqlen_q, seqlen_k, tile_m, tile_n, causal, order, batch=1, heads_kv=1, resident=132):
    """The default mode, where nothing waits: each CTA of the grid takes its walk's length in
    steps and goes, in launch order (``launch_tiles``), to the first of `resident` slots to free --
    a greedy list schedule. Returns the last finish time: what a launch order does to the tail."""
    free = [0] * resident
    for n, _, _ in launch_tiles(order, -(-seqlen_k // tile_n), heads_kv, batch):
        lo, hi = schedule.m_block_range(n, tile_m, tile_n, seqlen_q, seqlen_k, causal)
        heapq.heappush(free, heapq.heappop(free) + hi - lo)
    return max(free)


def simulate_semaphores(*, seqlen_q, seqlen_k, tile_m, tile_n, causal, order, batch=1, heads_kv=1, group=1,
                        resident=132, seqlens=None, hop=0, window=None, warpgroups=1, jitter=0.0, seed=0):
    """CTAs (grid (n, kv head, batch)) are dispatched in launch order (``launch_tiles``) whenever
    one of `resident` slots is free. Each step a CTA either adds into its next dQ tile (if that
    tile's counter equals its rank; the counter then increments) or stalls. `hop`: steps before an
    increment is seen (0: at once, even by a CTA later in the same step; on the GPU a hop -- the
    writer's completion wait, release and the next acquire -- is roughly a tile's time).
    `seqlens`: optional per-batch (seqlen_q, seqlen_k) for varlen. `warpgroups` > 1: each CTA's
    warpgroups add their own share of every tile independently (256's deterministic turns, hopper/wide.py):
    a warpgroup of rank r adds once the counter, which counts warpgroups, reads >= warpgroups x r; the
    sequences are then kept per (b, h, m, share). `jitter`: each warpgroup sits out a step with this
    probability (seeded) when it could add, so that warpgroups and CTAs drift apart as on the GPU (the
    model lets a CTA's warpgroups drift arbitrarily far apart, where the kernel's barriers keep them
    within a tile: more orders than the kernel can take, which is what an order check wants)."""
    rng = random.Random(seed)
    seqlens = seqlens or [(seqlen_q, seqlen_k)] * batch
    num_n_blocks = max(-(-sk // tile_n) for _, sk in seqlens)
    ctas = []  # (work list of (b, h, m, rank))
    for n, hk, b in launch_tiles(order, num_n_blocks, heads_kv, len(seqlens)):
        sq, sk = seqlens[b]
        work = []
        if n * tile_n < sk:
            m_min, m_max = schedule.m_block_range(n, tile_m, tile_n, sq, sk, causal, window=window)
            for hi in range(group):
                h = hk * group + hi
                for m in range(m_min, m_max):
                    first = schedule.n_block_first(m, tile_m, tile_n, sq, sk, causal, window=window)
                    last = schedule.n_block_last(m, tile_m, tile_n, sq, sk, causal, window=window)
                    work.append((b, h, m, order.rank(n, first, last), n))
        ctas.append(work)
    sem: dict = {}
    seq: dict = {}
    wgs = warpgroups
    pos = [[0] * wgs for _ in ctas]
    started = [False] * len(ctas)
    running: list = []
    in_flight: list = []  # (step the increment is seen, tile) with hop > 0
    next_cta = 0
    t = stall = first_stall = 0
    while next_cta < len(ctas) or running:
        while len(running) < resident and next_cta < len(ctas):
            running.append(next_cta)
            next_cta += 1
        for key in [key for when, key in in_flight if when <= t]:
            sem[key] = sem.get(key, 0) + 1
        in_flight = [(when, key) for when, key in in_flight if when > t]
        progressed = bool(in_flight)
        for i in list(running):
            if all(p == len(ctas[i]) for p in pos[i]):
                running.remove(i)
                progressed = True
                continue
            for w in range(wgs):
                if pos[i][w] == len(ctas[i]):
                    continue
                b, h, m, rank, n = ctas[i][pos[i][w]]
                count = sem.get((b, h, m), 0)
                # one warpgroup: ranks are unique per tile, so an add in flight matches no one
                ready = count == rank if wgs == 1 else count >= wgs * rank
                if ready and jitter and rng.random() < jitter:
                    # only a warpgroup that could add sits out: it stays ready (nobody else takes its
                    # turn, counters only grow), so a step without progress is still a deadlock
                    progressed = True
                    continue
                if ready:
                    if hop:
                        in_flight.append((t + hop, (b, h, m)))
                    else:
                        sem[(b, h, m)] = count + 1
                    seq.setdefault((b, h, m) if wgs == 1 else (b, h, m, w), []).append(n)
                    pos[i][w] += 1
                    started[i] = True
                    progressed = True
                else:
                    stall += 1
                    if not started[i]:
                        first_stall += 1
        t += 1
        if not progressed:
            return SemaphoreSim(False, t, stall, first_stall, seq)
    return SemaphoreSim(True, t, stall, first_stall, seq)
