"""Stage 1: FlashAttention's loop nest in NumPy, with FA4's conditional rescaling.

Compared with stage 0, this never materializes the (Sq, Sk) score matrix. Q is cut into
row blocks of `block_m` and K/V into column blocks of `block_n`; each Q block walks the K/V
blocks once, keeping only three running quantities per row (paper notation):

    m_i  the running max of the scores seen so far (log2 units, like the kernels)
    l_i  the running sum of 2^(S - m_i)
    O_i  the running, un-normalized output  sum_j 2^(S_ij - m_i) V_j

That is the whole trick of FlashAttention: memory O(block) instead of O(Sq * Sk).

What FA4 adds (paper, "Skipping online softmax rescaling"): whenever the max grows, classic
FlashAttention rescales O_i and l_i by 2^(m_old - m_new), a (block_m x d) multiply per block.
FA4 only moves m_i when it grows by more than `rescale_threshold` (tau, 8.0 = a factor 256).
Otherwise it keeps the stale m_i and accepts terms 2^(S - m_i) up to 2^tau instead of 1.
Skipping is exact, not an approximation: O_i and l_i are both scaled by the same 2^(-m_i),
and the final O_i / l_i cancels it. All tau costs is headroom: every term stays <= 2^tau,
so l_i <= Sk * 2^tau and |O_i| <= Sk * 2^tau * max|V|; in fp32 that is safe for tau up to
~100 (tests/test_stage1_online_softmax.py shows both the bound and where it breaks).

Working in log2 units mirrors the kernels: scores are pre-multiplied by scale * log2(e) so
each exponential is one `exp2` (MUFU.EX2 on the GPU); lse is converted back to natural log.

The kernel decides per warp (any row needing a rescale makes the whole warp rescale, so
there is no divergence); `rows_per_vote` models that: 1 = per row, 16 = per Hopper warp's
rows of a 64-row wgmma tile, 32 = per Blackwell warp (one row per thread).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from stage0_reference.reference import default_softmax_scale, visible_mask
from stage0_reference.validation import check_dense

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

__all__ = ["RescaleStats", "flash_forward", "flash_backward"]


@dataclass
class RescaleStats:
    """What the conditional rescaling did, counted per (row, K block) whose block max exceeded the
    row's kept max m_i (the true running max at tau = 0, often a stale one at tau > 0)."""

    done: int = 0  # exceeded m_i by > tau: O_i, l_i rescaled (or by any amount when tau = 0)
    skipped: int = 0  # exceeded m_i by <= tau: m_i kept, no multiply
    initial: int = 0  # first visible block of a row: m_i set, nothing to rescale yet
    max_term: float = 0.0  # largest 2^(S - m_i) accumulated; <= 2^tau is the safety bound
    max_l: float = 0.0  # largest un-normalized row sum l_i reached
    per_block: list = field(default_factory=list)  # (done, skipped) per K block index, for plots

    @property
    def grew(self) -> int:
        return self.done + self.skipped


def _blocks(n: int, size: int):
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _check_blocks(block_m, block_n, rescale_threshold, rows_per_vote):
    for name, val in (("block_m", block_m), ("block_n", block_n), ("rows_per_vote", rows_per_vote)):
        if not isinstance(val, (int, np.integer)) or val < 1:
            raise ValueError(f"{name}: expected a positive int, got {val!r}")
    if not (rescale_threshold >= 0 and math.isfinite(rescale_threshold)):
        raise ValueError(f"rescale_threshold: expected a finite value >= 0 (log2 units), got {rescale_threshold!r}")


def flash_forward(q, k, v, *, softmax_scale=None, causal=False, block_m=128, block_n=128,
                  rescale_threshold=8.0, rows_per_vote=1, accum_dtype=np.float64):
    """Tiled attention forward. Returns (out (B,Sq,Hq,Dv), lse (B,Hq,Sq), RescaleStats).

    rescale_threshold=0 is classic FlashAttention (rescale whenever the max grows).
    accum_dtype=np.float32 runs m/l/O in fp32 like the kernels, to show where tau breaks; float16
    is refused: its range (65504) leaves no headroom for 2^tau terms (Sk max|V| 2^8 overflows it).
    """
    q, k, v = check_dense(q, k, v)
    _check_blocks(block_m, block_n, rescale_threshold, rows_per_vote)
    b, sq, hq, _ = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    scale_log2 = scale * LOG2E
    tau = float(rescale_threshold)
    acc = np.dtype(accum_dtype)
    if acc not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"accum_dtype: expected np.float32 or np.float64 (the kernels accumulate in fp32), got {acc}")
    mask = visible_mask(sq, sk, causal)  # (Sq, Sk)
    kx = np.repeat(k, hq // hkv, axis=2).astype(acc)  # (B, Sk, Hq, D): GQA by indexing
    vx = np.repeat(v, hq // hkv, axis=2).astype(acc)
    qa = q.astype(acc)

    out = np.zeros((b, sq, hq, dv), dtype=acc)
    lse = np.full((b, hq, sq), -np.inf)
    stats = RescaleStats(per_block=[[0, 0] for _ in _blocks(sk, block_n)])

    for r0, r1 in _blocks(sq, block_m):
        q_i = qa[:, r0:r1].transpose(0, 2, 1, 3)  # (B, H, bm, D)
        rows = r1 - r0
        m_i = np.full((b, hq, rows), -np.inf, dtype=acc)
        l_i = np.zeros((b, hq, rows), dtype=acc)
        o_i = np.zeros((b, hq, rows, dv), dtype=acc)
        for jb, (c0, c1) in enumerate(_blocks(sk, block_n)):
            blk_mask = mask[r0:r1, c0:c1]  # (bm, bn)
            if not blk_mask.any():
                continue  # the kernels skip fully masked tiles too
            k_j = kx[:, c0:c1].transpose(0, 2, 3, 1)  # (B, H, D, bn)
            v_j = vx[:, c0:c1].transpose(0, 2, 1, 3)  # (B, H, bn, Dv)
            s_ij = (q_i @ k_j) * acc.type(scale_log2)  # (B, H, bm, bn), log2 units
            s_ij = np.where(blk_mask, s_ij, -np.inf)

            # 1. candidate max; rows with nothing visible so far keep -inf
            m_new = np.maximum(m_i, s_ij.max(axis=-1))  # (B, H, bm)
            first = np.isneginf(m_i) & np.isfinite(m_new)
            with np.errstate(invalid="ignore"):
                growth = np.where(np.isfinite(m_i), m_new - m_i, 0.0)
            # 2. the vote: a group of rows rescales together if any of its rows needs it
            need = growth > tau
            if rows_per_vote > 1:
                groups = -(-rows // rows_per_vote)
                pad = groups * rows_per_vote - rows
                g = np.pad(need, [(0, 0), (0, 0), (0, pad)]).reshape(b, hq, groups, rows_per_vote)
                need = np.repeat(g.any(axis=-1), rows_per_vote, axis=-1)[..., :rows]
            rescale = need & (growth > 0)  # a row whose max did not move needs no multiply
            stats.done += int(rescale.sum())
            stats.skipped += int(((growth > 0) & ~rescale).sum())
            stats.initial += int(first.sum())
            stats.per_block[jb][0] += int(rescale.sum())
            stats.per_block[jb][1] += int(((growth > 0) & ~rescale).sum())

            # 3. move m_i only where we rescale (or where it is set for the first time)
            m_next = np.where(rescale | first, m_new, m_i)
            with np.errstate(invalid="ignore", over="ignore"):
                alpha = np.where(rescale, np.exp2(m_i - m_next), 1.0).astype(acc)
                m_safe = np.where(np.isfinite(m_next), m_next, 0.0)
                p_ij = np.exp2(s_ij - m_safe[..., None]).astype(acc)  # <= 2^tau by construction
            l_i = alpha * l_i + p_ij.sum(axis=-1)
            o_i = alpha[..., None] * o_i + p_ij @ v_j
            m_i = m_next
            stats.max_term = max(stats.max_term, float(p_ij.max(initial=0.0)))
            stats.max_l = max(stats.max_l, float(l_i.max(initial=0.0)))

        # 4. epilogue: one division by the true sum; lse back to natural log
        seen = l_i > 0
        o_fin = np.divide(o_i, l_i[..., None], out=np.zeros_like(o_i), where=seen[..., None])
        out[:, r0:r1] = o_fin.transpose(0, 2, 1, 3)
        with np.errstate(divide="ignore"):
            lse[:, :, r0:r1] = np.where(seen, (m_i.astype(np.float64) + np.log2(l_i)) * LN2, -np.inf)
    return out, lse, stats


def flash_backward(q, k, v, out, dout, lse, *, softmax_scale=None, causal=False, block_m=128, block_n=128):
    """Tiled backward (FlashAttention-2): K/V blocks outside, Q blocks inside.

    Nothing of size (Sq, Sk) is stored: P is recomputed per tile from lse, which is why the
    forward returns it. D = rowsum(dO * O) is computed once up front (the kernels'
    "preprocess"). dK, dV accumulate in the outer loop; dQ is revisited by every K/V block,
    which on the GPU becomes the atomic (or semaphore-ordered) reduction.
    """
    q, k, v = check_dense(q, k, v)
    _check_blocks(block_m, block_n, 0.0, 1)
    out, dout, lse = (np.asarray(a, dtype=np.float64) for a in (out, dout, lse))
    b, sq, hq, _ = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    scale = default_softmax_scale(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    group = hq // hkv
    mask = visible_mask(sq, sk, causal)
    kx = np.repeat(k, group, axis=2)
    vx = np.repeat(v, group, axis=2)
    lse_log2 = np.where(np.isfinite(lse), lse * LOG2E, np.inf)  # +inf -> P = 0 on empty rows
    delta = np.einsum("bqhd,bqhd->bhq", dout, out)  # D (B, H, Sq)

    dq = np.zeros_like(q)
    dkx = np.zeros_like(kx)
    dvx = np.zeros_like(vx)
    for c0, c1 in _blocks(sk, block_n):
        k_j = kx[:, c0:c1].transpose(0, 2, 1, 3)  # (B, H, bn, D)
        v_j = vx[:, c0:c1].transpose(0, 2, 1, 3)  # (B, H, bn, Dv)
        dk_j = np.zeros_like(k_j)
        dv_j = np.zeros_like(v_j)
        for r0, r1 in _blocks(sq, block_m):
            blk_mask = mask[r0:r1, c0:c1]
            if not blk_mask.any():
                continue
            q_i = q[:, r0:r1].transpose(0, 2, 1, 3)  # (B, H, bm, D)
            do_i = dout[:, r0:r1].transpose(0, 2, 1, 3)  # (B, H, bm, Dv)
            s_ij = (q_i @ k_j.transpose(0, 1, 3, 2)) * (scale * LOG2E)
            p_ij = np.where(blk_mask, np.exp2(s_ij - lse_log2[:, :, r0:r1, None]), 0.0)
            dv_j += p_ij.transpose(0, 1, 3, 2) @ do_i  # dV += P^T dO
            dp_ij = do_i @ v_j.transpose(0, 1, 3, 2)  # dP = dO V^T
            ds_ij = p_ij * (dp_ij - delta[:, :, r0:r1, None])  # dS = P (dP - D)
            dk_j += scale * (ds_ij.transpose(0, 1, 3, 2) @ q_i)  # dK += dS^T Q
            dq[:, r0:r1] += scale * (ds_ij @ k_j).transpose(0, 2, 1, 3)  # dQ += dS K
        dkx[:, c0:c1] = dk_j.transpose(0, 2, 1, 3)
        dvx[:, c0:c1] = dv_j.transpose(0, 2, 1, 3)
    # GQA: a kv head's gradient is the sum over the query heads that read it
    dk = dkx.reshape(b, sk, hkv, group, -1).sum(axis=3)
    dv = dvx.reshape(b, sk, hkv, group, -1).sum(axis=3)
    return dq, dk, dv
