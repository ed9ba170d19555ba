# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · The backward kernel: five MMAs, and shared memory as the bound
#
# **What you will learn**
# - the five matrix multiplies of the attention backward and why P is *recomputed* from `lse`
#   instead of stored;
# - the paper's backward roofline: why shared memory, not the tensor cores, bounds it, and how
#   the 2-CTA mode (two SMs sharing one MMA) relieves it by exchanging half of dS;
# - how the Blackwell backward fits its accumulators into 512 columns of tensor memory;
# - how the deterministic mode orders the dQ reduction, and why that order is shortest-first;
# - how to see, before timing anything, that ptxas has serialized a kernel's wgmmas.
# - why the producer warp, not the math warps, should load each tile's row statistics.
# - how timing a kernel against its walk length separates the cost per CTA from the cost per tile.
#
# **The idea, in the paper's words** (§3.2, *Attention backward pass*): "The backward pass
# performs five matrix multiply-accumulate (MMA) operations per iteration ... The shared memory
# traffic time of 3328 cycles exceeds both the MMA compute time (2560 cycles) and the exponential
# unit time (1024 cycles), indicating that shared memory bandwidth is the primary bottleneck."
# And (§3.2.3): "we use distributed shared memory (DSMEM) to exchange half of the dS between the
# two CTAs since they are in the same cluster."
#
# **Code path**: `stage0_reference/reference.py` (`attention_backward`, the oracle),
# `stage1_online_softmax/flash.py` (`flash_backward`, tiled), `stage4_bwd_kernel/` (`roofline.py`,
# `schedule.py` + `model.py` (the kernel's walk and semaphores, replayed on the CPU),
# `hopper_step1.py`, `hopper_step2_warpspec.py`, `hopper.py`), `stage5_scheduling/orders.py`
# (`spt_bwd`, `dq_rank`).
#
# **Status**: the Hopper backward (steps 1 and 2) passes its GPU tests on the device tool's H100,
# the deterministic mode included (`stage4_bwd_kernel/README.md`); its speed against the official
# FA4 and cuDNN is read below from the committed benchmark. On this machine the notebook compiles
# it for `sm_90a`. A Blackwell
# backward is not built: its TMEM plan and the 2-CTA exchange below are **schematics drawn from
# the paper's text**.

# %%
import importlib
import re
from collections import Counter

import matplotlib.pyplot as plt
import numpy as np

from stage0_reference import attention_backward, attention_forward
from stage1_online_softmax import flash_backward


def optional(name):
    """Import a stage-4 module if it exists yet (stage 4 is being written); say so if not."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        print(f"{name}: not available in this checkout ({exc}); the cells that need it are skipped")
        return None


s4_roofline = optional("stage4_bwd_kernel.roofline")
s4_schedule = optional("stage4_bwd_kernel.schedule")
s4_model = optional("stage4_bwd_kernel.model")

# %% [markdown]
# ## Five MMAs, one tile by hand
# The forward kept only `O` and `lse = m + log(l)`. The backward recomputes `P = exp(S - lse)`
# tile by tile, then (with `D = rowsum(dO * O)`, computed once up front):
#
# | # | MMA | shape (M queries, N keys, head dim d) | Blackwell operands |
# |---|---|---|---|
# | 1 | `S = Q K^T` (then `P = exp(scale S - lse)`) | (M x d)(d x N) | SS |
# | 2 | `dP = dO V^T` | (M x d)(d x N) | SS |
# | 3 | `dV += P^T dO` | (N x M)(M x d) | TS: P from TMEM |
# | 4 | `dS = P * (dP - D)`, `dK += dS^T Q` | (N x M)(M x d) | TS: dS from TMEM |
# | 5 | `dQ += dS K` | (M x N)(N x d) | SS, then a reduction over K/V tiles |
#
# With one 128 x 128 tile the tile *is* the whole problem, so the five MMAs written out below must
# give stage 0's gradients exactly (float64).

# %%
rng = np.random.default_rng(0)
M = N = 128
d = 64
q, k, v, dout = (rng.standard_normal((1, n, 1, d)) for n in (M, N, N, M))
out, lse = attention_forward(q, k, v)
dq_ref, dk_ref, dv_ref = attention_backward(q, k, v, out, dout, lse)

Q, K, V, dO, O = (x[0, :, 0] for x in (q, k, v, dout, out))  # (rows, d)
scale = 1 / np.sqrt(d)
S = Q @ K.T                                       # MMA 1   (M, N)
P = np.exp(scale * S - lse[0, 0][:, None])        # recomputed from lse: no max, no sum
dP = dO @ V.T                                     # MMA 2   (M, N)
dV = P.T @ dO                                     # MMA 3   (N, d)
D = (dO * O).sum(axis=1, keepdims=True)           # preprocess: rowsum(dO * O)
dS = P * (dP - D)                                 # the softmax Jacobian, elementwise
dK = scale * dS.T @ Q                             # MMA 4   (N, d)
dQ = scale * dS @ K                               # MMA 5   (M, d)
for name, mine, ref in (("dq", dQ, dq_ref), ("dk", dK, dk_ref), ("dv", dV, dv_ref)):
    err = np.abs(mine - ref[0, :, 0]).max()
    print(f"{name}: max |five MMAs - stage 0| = {err:.1e}")
    assert err < 1e-12
flops = [2 * M * N * d] * 5
print(f"FLOPs per tile: 5 x 2MNd = {sum(flops)} = 10 M N d (the forward: 4 M N d)")

# %% [markdown]
# ### The same, tiled, and as the kernel walks it
# On a real sequence the loops are the FlashAttention-2 backward: K/V tiles outside (a CTA owns
# one and accumulates its dK, dV), Q tiles inside, and dQ revisited by every K/V tile — which on
# the GPU becomes a reduction across CTAs. Stage 1's `flash_backward` is that loop in NumPy;
# `stage4_bwd_kernel.model.backward_model` replays the *kernel's* walk (transposed scores `S^T`,
# the causal bounds of `schedule.py`, the dQ order). Both against stage 0, causal, GQA:

# %%
q, k, v = (rng.standard_normal((2, 700, h, 64)) for h in (4, 2, 2))
dout = rng.standard_normal((2, 700, 4, 64))
out, lse = attention_forward(q, k, v, causal=True)
ref = attention_backward(q, k, v, out, dout, lse, causal=True)
impls = {"stage1 flash_backward": lambda: flash_backward(q, k, v, out, dout, lse, causal=True)}
if s4_model is not None:
    impls["stage4 model (kernel walk)"] = lambda: s4_model.backward_model(q, k, v, out, dout, lse, causal=True)
for name, fn in impls.items():
    errs = [np.abs(a - b).max() for a, b in zip(fn(), ref)]
    print(f"{name:<28} max error dq / dk / dv: " + " / ".join(f"{e:.1e}" for e in errs))
    assert max(errs) < 1e-10

# %% [markdown]
# ## The backward roofline
# `stage4_bwd_kernel/roofline.py` prices one `M x N` iteration (paper §3.2.1): MMA
# `10MNd / 8192`; shared memory = the operands the five MMAs read (three SS, two TS) + dS written
# once + dQ in fp32 written and read back for the TMA reduction; exp `MN / 16`. In the 2-CTA mode
# the pair shares one 256-row MMA, each CTA stages half of every B operand, and dQ runs with
# `M/2` rows and a doubled reduction `2N` after the dS exchange (drawn further down).

# %%
if s4_roofline is not None:
    from stage3_fwd_kernel.roofline import B200

    one = s4_roofline.backward_tile_cycles(128, 128, 128, B200)
    two = s4_roofline.backward_tile_cycles(128, 128, 128, B200, two_cta=True)
    print(s4_roofline.paper_table())
    # the paper's Table: MMA 2560 / 2560, SMEM 3328 / 2688, exp 1024 / 1024
    assert (one.mma, one.smem, one.exp) == (2560, 3328, 1024) and (two.mma, two.smem, two.exp) == (2560, 2688, 1024)
    print(f"\n1-CTA: SMEM / MMA = {one.smem / one.mma:.2f};  2-CTA: {two.smem / two.mma:.2f}")
    print("\nHopper (wgmma, 2 warpgroups):")
    hopper_cfgs = [("step1_ss", 64, 128, 128, 128), ("fa3_rs", 64, 128, 128, 128)]
    print(s4_roofline.hopper_table(hopper_cfgs))

# %%
if s4_roofline is not None:
    bars = {"B200 1-CTA\nM=N=d=128": one, "B200 2-CTA\nM=256, N=d=128": two}
    for design, m, n, dd, dv in hopper_cfgs:
        bars[f"H100 {design}\n{m}x{n}, d={dd}"] = s4_roofline.hopper_tile_cycles(m, n, dd, design, dv)
    parts = [("SMEM operands", "smem_operands", "C2"), ("dS write", "smem_ds_write", "C8"),
             ("dS via DSMEM", "smem_ds_exchange", "C4"), ("dQ fp32 write+read", "smem_dq", "C6")]
    x = np.arange(len(bars))
    fig, ax = plt.subplots(figsize=(10, 4.4))
    ax.bar(x - 0.28, [c.mma for c in bars.values()], 0.28, color="C0", label="MMA")
    bottom = np.zeros(len(bars))
    for label, attr, color in parts:
        vals = np.array([getattr(c, attr) for c in bars.values()])
        ax.bar(x, vals, 0.28, bottom=bottom, color=color, label=label)
        bottom += vals
    ax.bar(x + 0.28, [c.exp for c in bars.values()], 0.28, color="C3", label="exp")
    for xi, c in zip(x, bars.values()):
        ax.text(xi, c.smem + 40, f"{c.smem:.0f}\n→ {c.bound}", ha="center", fontsize=8)
    ax.set_xticks(x, list(bars), fontsize=8)
    ax.set_ylabel("cycles per tile (one SM)")
    ax.set_ylim(0, max(c.smem for c in bars.values()) * 1.25)
    ax.legend(fontsize=8, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.17))
    ax.set_title("backward roofline: shared memory (stacked) against MMA and exp")
    plt.tight_layout()
    plt.show()

# %% [markdown]
# On B200 the 1-CTA backward is shared-memory bound by about 30%; 2-CTA cuts the operand reads
# and the dQ traffic and pays a little for the exchange, leaving it about 5% over the MMA time.
# On an H100 (half the tensor-core rate, the same 128 B/clk of SMEM) this stage's step 1 keeps
# every operand in shared memory and is SMEM-bound the same way; keeping `P^T` and `dS^T` in
# registers (FA3's layout, `fa3_rs`) would make it MMA-bound, at the price of the accumulator
# registers a warp-specialized kernel has to find.
#
# ## Blackwell: the backward's tensor memory (schematic)
# The paper (§3.2.2): "we do not have sufficient tensor memory to fit five accumulator tiles. At
# most, four tiles of 128 by 128 elements can fit and dV and dK accumulate, and thus cannot share
# their space. In our implementation, we have S and P share one of the tmem blocks (at offset 0)
# and we have dP, dS and dQ share the other one." In the 2-CTA mode, "the dQ tile is small enough
# to fit in TMEM alongside P, reusing the same TMEM region as S, so we no longer reuse the same
# TMEM region for dP and dQ". **This is a drawing of that text.** The stage-4 Blackwell kernels
# (`blackwell_bwd.py`, `blackwell_bwd_2cta.py`: compiled for sm_100a, never run here) follow it;
# their exact columns are the tables of `blackwell_config.py` (printed further down).

# %%
TMEM = 512
plans = {
    "1-CTA": [(0, 128, "S → P (P overwrites S)", "C0"), (128, 128, "dP → dS → dQ (in turn)", "C4"),
              (256, 128, "dV (accumulates)", "C2"), (384, 128, "dK (accumulates)", "C1")],
    "2-CTA": [(0, 64, "S → P", "C0"), (64, 64, "dQ (M/2 rows)", "C6"), (128, 128, "dP → dS", "C4"),
              (256, 128, "dV (accumulates)", "C2"), (384, 128, "dK (accumulates)", "C1")],
}
fig, ax = plt.subplots(figsize=(11, 2.6))
for yi, (name, regions) in enumerate(plans.items()):
    for start, width, label, color in regions:
        ax.broken_barh([(start, width)], (yi - 0.35, 0.7), color=color, alpha=0.6, edgecolor="k")
        ax.text(start + width / 2, yi, label, ha="center", va="center", fontsize=8)
    assert sum(w for _, w, _, _ in regions) == TMEM  # four 128 x 128 fp32 tiles fill the 512 columns
ax.set_yticks(range(len(plans)), list(plans))
ax.invert_yaxis()
ax.set_xlim(0, TMEM)
ax.set_xticks(range(0, TMEM + 1, 64))
ax.set_xlabel("TMEM column (128 lanes x 32 bit each)")
ax.set_title("Blackwell backward, d = 128: TMEM plan — SCHEMATIC from the paper's text (2-CTA split: our "
             "reading)", fontsize=9)
plt.tight_layout()
plt.show()

# %% [markdown]
# Note the contrast with the forward of notebook 03: there S and O of *two* query tiles fill TMEM
# and the softmax ping-pongs between them. Here a single (K/V tile, Q tile) pair already needs
# five accumulators, two of which (dV, dK) live for the whole K/V tile, so the other three must
# take turns in two regions.
#
# ## Blackwell 1-CTA: the pipeline, replayed
# Those shared regions dictate the order of the MMAs. With S/P in one region and dP/dS/dQ in the
# other, the MMA warp can issue the next tile's `S` as soon as `dV` has read `P`, and the previous
# tile's `dK` and `dQ` right after it: turn `j` issues `S(j), dK(j-1), dQ(j-1), dP(j), dV(j)`, so
# the exponentials of tile `j` (the elementwise warpgroup's longest step) run while the tensor
# cores work on tile `j-1` -- the paper's "we achieve this by using the dQ and dK MMAs of the
# previous iteration". `stage4_bwd_kernel/blackwell_pipeline.py` replays the kernel's roles and
# mbarriers on the CPU (the tests run it under random interleavings and check every TMEM read);
# with the roofline's costs it also draws who is busy when. Below, three versions of the kernel:
# the serial order it started with, the paper's order, and the current one, where the dQ drain
# hands its TMEM columns back before issuing its atomics. (Model clocks, not measurements.)

# %%
from stage4_bwd_kernel import blackwell_config as bw_cfg
from stage4_bwd_kernel import blackwell_pipeline as bp

print(bw_cfg.blackwell_bwd_config(128, 128, "bf16", causal=False).tmem.table())
fig, axes = plt.subplots(len(bp.VERSIONS), 1, figsize=(11, 1.6 * len(bp.VERSIONS) + 0.6), sharex=True)
rows = {"tc": ("tensor cores", 0), "ew": ("elementwise WG", 1), "dq": ("dQ drain WG", 2)}
for ax, (label, order, early) in zip(axes, bp.VERSIONS):
    busy, end = bp.timeline(4, order, 128, early_release=early)
    for role, start, stop, what in busy:
        if role not in rows:
            continue
        name = what.split("(")[0] if what else ""
        color = {"S": "C0", "dP": "C4", "dV": "C2", "dK": "C1", "dQ": "C6", "P": "C3"}.get(name, "C7")
        ax.broken_barh([(start, stop - start)], (rows[role][1] - 0.4, 0.8), color=color, alpha=0.7, edgecolor="k",
                       lw=0.4)
        if role == "tc" or what.startswith("P("):
            ax.text((start + stop) / 2, rows[role][1], what, ha="center", va="center", fontsize=6)
    ax.set_yticks([r[1] for r in rows.values()], [r[0] for r in rows.values()], fontsize=7)
    ax.invert_yaxis()
    ax.set_title(f"{label}: {end / 4:.0f} clk per Q tile (4 tiles)", fontsize=8)
axes[-1].set_xlabel("B200 clocks (model: 512 per 128x128x128 MMA, 1152 for P's exponentials)")
plt.tight_layout()
plt.show()
for d in (64, 128):
    for label, (clk, tc) in bp.per_tile_clocks(d).items():
        print(f"d={d:3}  {label:42} {clk:5.0f} clk / Q tile, tensor cores busy {tc:.0%}")

# %% [markdown]
# ## 2-CTA: exchanging half of dS (schematic)
# In the 2-CTA mode two CTAs of a cluster hold K/V tiles `N0` and `N1` and meet the same `M`
# queries. Each has computed its own `dS[:, N_i]` (M x N). But `dQ = dS K` reduces over the keys,
# and a 2-CTA MMA splits only its output rows between the CTAs. So they swap the off-diagonal
# quarters through distributed shared memory: afterwards CTA 0 owns the top `M/2` rows of dS
# over *both* key tiles, CTA 1 the bottom `M/2`, and each runs a `(M/2 x 2N)(2N x d)` MMA. The
# cell draws it and then checks the algebra with NumPy.

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 4.6))
colors = {0: "C0", 1: "C1"}
for ax, stage in zip(axes, ("before: each CTA computed dS for its own keys", "after the DSMEM exchange")):
    for r, rows in enumerate(("top", "bottom")):
        for c, keys in enumerate(("N0", "N1")):
            owner = c if stage.startswith("before") else r
            moved = stage.startswith("after") and owner != c
            ax.add_patch(plt.Rectangle((c, 1 - r), 1, 1, facecolor=colors[owner], alpha=0.3 if moved else 0.6,
                                       edgecolor="k", hatch="//" if moved else None))
            ax.text(c + 0.5, 1.55 - r, f"dS[{rows} M/2, {keys}]\nheld by CTA {owner}", ha="center", va="center",
                    fontsize=8)
    ax.set_xlim(-0.05, 2.05)
    ax.set_ylim(-0.35, 2.3)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(stage, fontsize=9)
    ax.text(0.5, 2.08, "keys of CTA 0 (N0)", ha="center", fontsize=8)
    ax.text(1.5, 2.08, "keys of CTA 1 (N1)", ha="center", fontsize=8)
# the two quarters that travel: bottom-left to CTA 1, top-right to CTA 0 (arrows below the labels)
axes[0].annotate("", xy=(1.75, 0.2), xytext=(0.25, 0.2), arrowprops=dict(arrowstyle="->", lw=2, color="C0"))
axes[0].annotate("", xy=(0.25, 1.2), xytext=(1.75, 1.2), arrowprops=dict(arrowstyle="->", lw=2, color="C1"))
axes[0].text(1.0, -0.2, "arrows: the quarters sent through DSMEM", ha="center", fontsize=8)
axes[1].text(1.0, -0.2, "CTA 0: dQ[top] = dS[top, N0+N1] K[N0+N1]\nCTA 1: the same for the bottom rows",
             ha="center", va="center", fontsize=8)
fig.suptitle("2-CTA backward, dQ step — SCHEMATIC from the paper's text (hatched: received from the peer CTA)",
             fontsize=10)
plt.tight_layout()
plt.show()

# the algebra: the two half-row MMAs with the doubled reduction give the full dQ. Sizes as in
# roofline.backward_tile_cycles(two_cta=True): the pair shares a Q tile of M = 128 queries, each
# CTA owns N = 128 keys, d = 128
Mq, Nk, dh = 128, 128, 128
dS_full = rng.standard_normal((Mq, 2 * Nk))             # queries x (keys of CTA 0 | keys of CTA 1)
K_full = rng.standard_normal((2 * Nk, dh))
cta = [dS_full[:, :Nk], dS_full[:, Nk:]]                 # what each CTA computed: (M, N)
top = np.hstack([cta[0][: Mq // 2], cta[1][: Mq // 2]])  # CTA 0 after receiving dS[top, N1]
bottom = np.hstack([cta[0][Mq // 2:], cta[1][Mq // 2:]])  # CTA 1 after receiving dS[bottom, N0]
assert np.allclose(np.vstack([top @ K_full, bottom @ K_full]), dS_full @ K_full)
sent = (Mq // 2) * Nk * 2                                # bf16 bytes each CTA sends
print(f"each CTA sends {sent // 1024} KiB of dS and receives as much; per CTA dQ MMA: "
      f"({Mq // 2} x {2 * Nk}) x ({2 * Nk} x {dh})")
print(f"dQ rows each CTA adds to global memory per iteration: {Mq // 2} instead of {Mq} -> half the atomics")
if s4_roofline is not None:  # the roofline charges the exchange as three passes over these bytes
    assert sent * 3 / B200.smem_bytes_per_clock == two.smem_ds_exchange

# %% [markdown]
# ## Deterministic dQ: a fixed reduction order, shortest first
# Every K/V tile `n` adds a partial dQ into each Q tile `m` it sees. With atomics the adds land in
# whatever order the SMs reach L2, so dQ's last bits change run to run. The deterministic mode
# gives each dQ tile a semaphore and a fixed order: the CTA with rank `r` waits until the
# semaphore reads `r`. The pictures show, for one head of a 1k causal sequence with 128 x 128
# tiles, the **rank of each add** (cell `(m, n)`: K/V tile `n` adding into dQ tile `m`), computed
# by `stage5_scheduling.orders.dq_rank`. Masked pairs are blank, each CTA's first add is framed in
# red, and the order the K/V tiles launch is printed above each grid.

# %%
from stage5_scheduling import orders

seqlen, tile = 1024, 128
nb = seqlen // tile
m_idx, n_idx = np.meshgrid(np.arange(nb), np.arange(nb), indexing="ij")
visible = n_idx < orders.kv_blocks_visited(m_idx, seqlen, seqlen, tile, tile, causal=True)
fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
for ax, descending, title, launch in [
        (axes[0], False, "ascending (naive): rank = n", "launch order of K/V tiles: n = 0, 1, ..., 7"),
        (axes[1], True, "descending (SPT): rank = last(m) - n", "launch order of K/V tiles: n = 7, 6, ..., 0")]:
    rank = orders.dq_rank(n_idx, m_idx, seqlen, seqlen, tile, tile, causal=True, descending=descending)
    grid = np.where(visible, rank, np.nan)
    ax.imshow(grid, cmap="viridis", vmin=0, vmax=nb - 1)
    for (mi, ni), r in np.ndenumerate(grid):
        if not np.isnan(r):
            first = mi == orders.first_q_block(ni, seqlen, seqlen, tile, tile, True)  # the CTA's first add
            ax.text(ni, mi, int(r), ha="center", va="center", fontsize=9, color="w" if r < nb / 2 else "k",
                    fontweight="bold" if first else "normal")
            if first:
                ax.add_patch(plt.Rectangle((ni - 0.5, mi - 0.5), 1, 1, fill=False, ec="r", lw=1.5))
    ax.set_xlabel("K/V tile n (one CTA each)")
    ax.set_ylabel("dQ tile m")
    ax.set_title(f"{title}\n{launch}", fontsize=9)
    ax.set_xticks(range(nb))
    ax.set_yticks(range(nb))
plt.tight_layout()
plt.show()
# each CTA's first add is on its diagonal (m == n here): rank 0 under SPT, rank n under the naive order
diag_rank = orders.dq_rank(np.arange(nb), np.arange(nb), seqlen, seqlen, tile, tile, True, descending=True)
assert (diag_rank == 0).all()

# %% [markdown]
# A CTA walks its Q tiles from its diagonal downwards, so its first add is into the dQ tile on the
# diagonal. In the ascending order that add has rank `n`: CTA `n` must wait for CTAs `0 .. n-1`,
# which are still walking down from their own diagonals. In the descending order it has rank 0,
# and the CTAs launched first (high `n`) are the shortest (few Q tiles see the last keys): the
# paper's "shortest-processing-time-first". The kernel and the stage-5 order must agree on these
# ranks exactly, or a semaphore waits forever; stage 4's `schedule.py` owns the kernel's copy. A
# simulation of the semaphores with few SM slots shows the stalls:

# %%
if s4_schedule is not None and s4_model is not None:
    # stage 4's rank function (what the kernel traces) equals stage 5's dq_rank on every visible pair
    for (mi, ni) in zip(*np.nonzero(visible)):
        last = s4_schedule.n_block_last(mi, tile, tile, seqlen, seqlen, True)
        assert s4_schedule.KVDescendingOrder.rank(ni, 0, last) == orders.dq_rank(ni, mi, seqlen, seqlen, tile, tile,
                                                                                  True, descending=True)
    for order in (s4_schedule.KVAscendingOrder, s4_schedule.KVDescendingOrder):
        sim = s4_model.simulate_semaphores(seqlen_q=seqlen, seqlen_k=seqlen, tile_m=tile, tile_n=tile, causal=True,
                                           order=order, heads_kv=4, resident=8)
        assert sim.finished
        print(f"{order.name:<13} 4 heads x {nb} K/V tiles on 8 SM slots: {sim.steps:>3} steps, "
              f"{sim.stall_steps:>3} CTA-steps stalled, {sim.first_write_stalls:>3} of them before a first dQ add")
    print("(notebook 05 simulates the same on 132 SMs, with Gantt charts)")

# %% [markdown]
# ### A hop per add, and why the launch order matters
#
# The simulation above counts an add as seen the moment it happens. On the H100 it is not: the
# writer warp acquires the semaphore, issues the TMA reduce-add, waits for it to *land* in L2,
# fences and releases, and only then can the next CTA's spin see its turn -- a few microseconds,
# about a tile's worth of math at d = 64. Give every add that delay (`hop=1`) and a cost appears
# that no reduction order removes: the CTAs of one (kv head, batch) -- a *chain* -- launched side by
# side with `blockIdx.x = n`, reach every dQ tile together, and the k-th of them waits k hops before
# its first add. Worse, the first CTAs of all chains in flight finish together and hand their SMs
# to the consecutive K/V tiles of the *next* chain, so each wave starts side by side again.
#
# `schedule.KVAscendingSectionsOrder` keeps the ranks and changes only which CTA a launch index
# gets: sections of G chains with the K/V tile outer, G = ceil(128 / num_n_blocks), so a section is
# about one wave. Tile n of a chain then launches G CTAs after tile n - 1 (still after it: no
# deadlock), and the stagger carries over from wave to wave. On the H100 this took the deterministic
# d = 64 non-causal backward from 0.71-0.75x to 0.89-0.92x of the default's speed
# (`ab_bwd_h100_run27_*`, `..._run28_*`), without changing a bit, and sections of two waves
# (`KVAscendingWideSectionsOrder`, the d = 64 non-causal default) to 0.95-1.04x (runs 31-33; at d = 128,
# whose heads hold twice the bytes in L2, two waves lost). The simulation, non-causal 1k, 8 batches x
# 32 heads on 132 SM slots:
#

# %%
if s4_schedule is not None and s4_model is not None:
    kw = dict(seqlen_q=1024, seqlen_k=1024, tile_m=128, tile_n=128, causal=False, batch=8, heads_kv=32)
    ideal = s4_model.simulate_semaphores(order=s4_schedule.KVAscendingOrder, hop=0, **kw).steps
    for order in (s4_schedule.KVAscendingOrder, s4_schedule.KVAscendingSectionsOrder):
        sim = s4_model.simulate_semaphores(order=order, hop=1, **kw)
        assert sim.finished
        print(f"{order.name:<22} hop 1: {sim.steps:>4} steps ({ideal / sim.steps:.2f}x of the {ideal} with no hop), "
              f"{sim.stall_steps:>5} CTA-steps stalled")
    # which CTA each of the first launch indices gets: (n_block, kv head, batch)
    print("sections, first 6 launches:", [s4_schedule.KVAscendingSectionsOrder.host_tile(i, 8, 32, 8) for i in range(6)])


# %% [markdown]
# The same sections help the *default* mode too, under a causal mask, for a different reason: the
# grid's tail. Nothing waits there, but the walks are unequal (K/V tile n visits the Q tiles from
# its diagonal down, so n = 0 walks all of them and the last tile one or two). With
# `blockIdx.x = n` the last head's longest walk is launched only N CTAs before the grid's end and
# finishes alone; in sections of G heads the long walks of the last G heads start about a wave
# earlier. A greedy list schedule (each CTA to the first free SM, in launch order) of the walks on
# 132 SMs, d = 128's 80 x 128 tile, 32k tokens of 16 heads:

# %%
if s4_schedule is not None and s4_model is not None:
    for seqlen in (2048, 4096, 8192, 16384):
        kw = dict(seqlen_q=seqlen, seqlen_k=seqlen, tile_m=80, tile_n=128, causal=True, batch=32768 // seqlen,
                  heads_kv=16)
        plain = s4_model.default_mode_steps(order=s4_schedule.KVAscendingOrder, **kw)
        sections = s4_model.default_mode_steps(order=s4_schedule.KVAscendingSectionsOrder, **kw)
        print(f"causal {seqlen:>5}: blockIdx order {plain:>5} tile-steps, sections of "
              f"{-(-128 // (seqlen // 128)):>2} heads {sections:>5} ({1 - sections / plain:.1%} shorter)")

# %% [markdown]
# At 16k a section is one head, the blockIdx order itself. On the H100 the sectioned launch gained
# 0.2-7.4% at 4k and 0.7-5.5% at 8k in paired rounds, but tied or lost up to 3% at 1k-2k, which this
# model does not explain (`benchmarks/results/ab_bwd_h100_run43_*` .. `_run45_*`; stage 4 README).
# So the causal default, `KVAscendingLongSectionsOrder`, uses sections from 32 K/V tiles (4k keys)
# on and blockIdx order below.


# %% [markdown]
# ## The Hopper backward, compiled here (and run, on a GPU)
# `stage4_bwd_kernel.hopper` is the stable entry point (today: step 1). Compiled for `sm_90a`
# with fake tensors, with and without the deterministic mode; the SASS shows the fp32 dQ atomics
# (`REDG.E.ADD.F32x2`) in both, and only in the deterministic kernel the semaphore: an acquire
# load to spin on (`LDG.E.STRONG.GPU`), a GPU-wide fence (`MEMBAR.ALL.GPU`) and the release add
# (`REDG.E.ADD.S32`). On a Hopper GPU the cell also checks the gradients against fp32 autograd
# with FA4's rule.

# %%
s4_hopper = optional("stage4_bwd_kernel.hopper")
if s4_hopper is not None:
    from stage3_fwd_kernel import common

    def sass_counts(sass):
        ops = Counter(m.group(1) for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.x]+)", sass))
        pick = {"dQ atomics (REDG.F32x2)": "REDG.E.ADD.F32x2", "semaphore spin (LDG.STRONG.GPU)": "LDG.E.STRONG.GPU",
                "fence (MEMBAR.ALL.GPU)": "MEMBAR.ALL.GPU", "release (REDG.S32)": "REDG.E.ADD.S32"}
        return {label: sum(n for op, n in ops.items() if op.startswith(prefix)) for label, prefix in pick.items()}

    print(f"{s4_hopper.BEST_STEP}, bf16, d = 128, causal, {common.ARCH}")
    for det in (False, True):
        comp = s4_hopper.compile_only("bf16", 128, causal=True, deterministic=det)
        rep = comp.report
        print(f"  deterministic={det!s:<5}: threads {rep['threads']}, registers {rep['registers']}, spills "
              f"{rep['spill_stores']}, SMEM {rep['smem_bytes']} B, HGMMA {rep['HGMMA']}, MUFU.EX2 {rep['MUFU.EX2']}")
        print("      " + ", ".join(f"{k} {v}" for k, v in sass_counts(comp.sass).items()))
        assert rep["spill_stores"] == 0

    if common.hopper_gpu_available():
        import torch

        from stage0_reference.torch_reference import assert_fa4_close
        from stage4_bwd_kernel.host import forward_for_test, reference_grads

        g = torch.Generator(device="cuda").manual_seed(0)
        qg, kg, vg, dog = (torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                           for _ in range(4))
        og, lseg = forward_for_test(qg, kg, vg, causal=True)
        grads = s4_hopper.attention_backward(qg, kg, vg, og, dog, lseg, causal=True, deterministic=True)
        again = s4_hopper.attention_backward(qg, kg, vg, og, dog, lseg, causal=True, deterministic=True)
        ref_g, base_g = reference_grads(qg, kg, vg, dog, causal=True)
        for name, a, r, b in zip(("dq", "dk", "dv"), grads, ref_g, base_g):
            print(f"{name}: max error %.2e <= bound %.2e" % assert_fa4_close(name, a, r, b))
        print("deterministic: bitwise equal across two runs:", all(torch.equal(a, b) for a, b in zip(grads, again)))
    else:
        print("no Hopper GPU here: compiled only; the H100 measurements are the committed JSON below.")

# %% [markdown]
# ## Measured on an H100?
# `benchmarks/bench_bwd.py` times the stage-4 steps (default and deterministic) against the
# official FA4 and cuDNN in one run and writes `benchmarks/results/bwd_h100*.json`. If such a file
# is committed, the cell plots it; otherwise it says so.

# %%
import json
import pathlib

import stage0_reference

def run_number(path):  # "run10" sorts after "run9"
    return int(re.search(r"_run(\d+)", path.name).group(1))


bwd_runs = sorted((pathlib.Path(stage0_reference.__file__).resolve().parents[1] / "benchmarks" / "results")
                  .glob("bwd_h100*.json"), key=run_number)
if not bwd_runs:
    print("No backward measurement committed yet (benchmarks/results/bwd_h100*.json is absent): the Hopper")
    print("backward's speed is PENDING, and so is its deterministic-vs-default cost on hardware.")
else:
    doc = json.loads(bwd_runs[-1].read_text())
    print(f"{bwd_runs[-1].name}: {doc['device']}, commit {doc.get('git_commit')}, FLOPs: {doc.get('flops')}")
    rows = [r for r in doc["results"] if r.get("tflops")]
    for r in doc["results"]:
        if "error" in r:
            print(f"  {r['impl']} d={r['head_dim']} causal={r['causal']}: {r['error'][:90]}")
    configs = sorted({(r["head_dim"], r["causal"], r["seqlen"]) for r in rows})
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    tf = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): r["tflops"] for r in rows}
    fig, ax = plt.subplots(figsize=(10, 4.4))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        ax.bar(np.arange(len(configs)) + (i - (len(impls) - 1) / 2) * width,
               [tf.get((impl, *c), 0) for c in configs], width, label=impl)
    ax.set_xticks(range(len(configs)), [f"d={d}, {'causal' if c else 'non-causal'}, {s // 1024}k"
                                        for d, c, s in configs], fontsize=8)
    ax.set_ylabel("TFLOP/s (backward)")
    ax.set_title(f"backward, bf16, {doc['device']} (committed results)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    plt.tight_layout()
    plt.show()
    fa4_name = "flash-attn-4 (official)"
    short = {i: i.replace("ours:", "").replace(" deterministic", " det.").replace(" (SDPA)", "") for i in impls}
    print("TFLOP/s / official FA4 of the same run:")
    print(f"{'config':<24}" + "".join(f"{short[i]:>21}" for i in impls if i != fa4_name))
    for c in configs:
        ref = tf.get((fa4_name, *c))
        cells = [f"{tf[(i, *c)] / ref:>21.2f}" if ref and tf.get((i, *c)) else f"{'-':>21}" for i in impls
                 if i != fa4_name]
        print(f"{f'd={c[0]} causal={c[1]} {c[2] // 1024}k':<24}" + "".join(cells))
    for impl in impls:
        if impl.startswith("ours:") and not impl.endswith("deterministic"):
            det = [tf[(impl + " deterministic", *c)] / tf[(impl, *c)] for c in configs
                   if tf.get((impl, *c)) and tf.get((impl + " deterministic", *c))]
            if det:
                print(f"{impl}: deterministic mode at {min(det):.0%} .. {max(det):.0%} of the default speed")

# %% [markdown]
# A benchmarking lesson learnt the hard way: the peers are timed with `torch.autograd.grad(out,
# (q, k, v), dout)`, not `out.backward(dout)`. `.backward` also adds the new gradients into `q.grad`,
# `k.grad`, `v.grad` on every call, three elementwise kernels over the whole tensors that the kernel
# under test never runs; backward runs 1-8 in `benchmarks/results/` were timed that way and flattered
# ours by ~4% at 16k and ~20% at 1k, where the attention work is small next to the accumulation.
#
# Reading the measurement: every step is correct (its GPU tests pass). Steps 1 and 2 keep every
# GEMM operand in shared memory, which the roofline above says is SMEM-bound, and warp
# specialization alone (step 2) does not change that bound. Step 3 keeps `P^T` and `dS^T` in
# registers (`fa3_rs`) and moves the dQ reduction to a writer warp: it is the production step for
# d = 64 / 96 / 128, close to the official FA4. Its deterministic mode, after the writer's changes and
# the launch in sections above, runs at 0.82-1.03x of its default speed (the cell prints the range of
# the newest run); for comparison the paper reports that its deterministic backward reaches "up to
# 75% the speed of the nondeterministic backward" on B200, with the swizzling and SPT order of
# notebook 05.
#
# ## Finding a bottleneck: step 3 was slow only when causal
# The first step 3 issued dQ as 64 row-wise bulk reduce-adds per tile. It ran causal d = 64 at
# 0.43x of the official FA4, *slower than step 1*, while non-causal it was ahead. Causal does half
# the tile steps, so the first question is whether each step got more expensive or the steps were
# badly spread over the SMs. `benchmarks/probe_bwd_walk.py` divides the kernel time by the steps per
# SM, on grids of different sizes and with two launch orders:

# %%
results = pathlib.Path(stage0_reference.__file__).resolve().parents[1] / "benchmarks" / "results"
probe = json.loads((results / "probe_bwd_h100_d64_8k.json").read_text())
grids = [g for g in dict.fromkeys(r["grid"] for r in probe["results"]) if g != "one wave"]  # one wave: host-bound
fig, ax = plt.subplots(figsize=(9, 3.4))
for j, (order, causal) in enumerate([("default", False), ("default", True), ("kv_descending", True)]):
    us = [next(r["us_per_step"] for r in probe["results"] if r["grid"] == g and r["order"] == order
               and r["causal"] == causal) for g in grids]
    bars = ax.bar(np.arange(len(grids)) + (j - 1) * 0.27, us, 0.27,
                  label=f"{'causal' if causal else 'non-causal'}, {order} order")
    ax.bar_label(bars, fmt="%.1f", fontsize=7)
ax.set_xticks(range(len(grids)), [f"grid {g} (batch x heads)" if "x" in g else f"grid: {g} (4 x 32)" for g in grids])
ax.set_ylabel("us per (K/V tile, Q tile) step, per SM")
ax.set_title("step 3 (row-wise dQ reduces), d = 64, 8k, H100: a causal step costs ~1.75x", fontsize=9)
ax.legend(fontsize=7)
plt.tight_layout()
plt.show()
per_step = {(r["grid"], r["order"], r["causal"]): r["us_per_step"] for r in probe["results"]}
assert all(per_step[(g, "default", True)] > 1.5 * per_step[(g, "default", False)] for g in grids)

# %% [markdown]
# Every grid and both orders agree: the *step* is dearer, so balance and launch order are not the
# cause. Nsight Compute (`benchmarks/profile_once.py` under `ncu`) then showed the same L2 hit
# rate (96%) and DRAM traffic in both modes, fewer instructions issued per cycle causal (0.27
# against 0.40 warps per scheduler), and 32% of the causal stall samples on one barrier: the
# consumers waiting for "dQ empty", i.e. for the writer warp. Its row-wise reduces kept up when all
# CTAs added into the same dQ tile at once (non-causal CTAs walk the Q tiles in lockstep) and fell
# behind when each CTA added into its own tile (causal CTAs start at their own diagonals). The fix
# is one TMA *tensor* reduce-add per tile from a swizzled SMEM tile. Before and after, same
# benchmark, each against the official FA4 of its own run:

# %%
def step3_ratios(name):
    doc = json.loads((results / name).read_text())
    tf = {(r["impl"], r["head_dim"], r["causal"]): r.get("tflops") for r in doc["results"]}
    return {(d, c): tf[("ours:step3_rs", d, c)] / tf[("flash-attn-4 (official)", d, c)]
            for d in (64, 128) for c in (False, True)}


before, after = step3_ratios("bwd_h100_run2.json"), step3_ratios("bwd_h100_run3.json")
for (d, c), r in before.items():
    print(f"d={d:3} {'causal' if c else 'non-causal':10}  row-wise reduces {r:.2f}x  ->  tensor reduce {after[(d, c)]:.2f}x")
assert after[(64, True)] > before[(64, True)] + 0.15  # the causal case the diagnosis was about

# %% [markdown]
# ## Reading stall samples: the next bottleneck was a barrier
# With the writer fixed, Nsight Compute's per-instruction stall sampling (`ncu --section
# SourceCounters`, then `ncu -i report --page source --csv --print-source sass`, summarised by
# `python benchmarks/ncu_stalls.py`) put 18% of all
# samples of the d = 128 kernel on the consumers' *first* barrier of a tile: 192 threads waiting
# for the 64 that load the rows' `lse2` and `D` from global memory right after issuing S^T. The fix
# costs two registers: load the *next* tile's statistics one tile ahead, so the load's latency hides
# under a whole tile. Together with two smaller changes (warp-uniform wgmma descriptors and a
# mask-free copy of the tile body, 698 -> 535 instructions per tile and warp; dQ issued before dK so
# its hand-off runs under dK's wgmma), 8k, each against the official FA4 of its own run:

# %%
def step3_ratios_at(name, seqlen=8192):
    doc = json.loads((results / name).read_text())
    tf = {(r["impl"], r["head_dim"], r["causal"]): r.get("tflops") for r in doc["results"] if r["seqlen"] == seqlen}
    return {(d, c): tf[("ours:step3_rs", d, c)] / tf[("flash-attn-4 (official)", d, c)]
            for d in (64, 128) for c in (False, True)}


before, after = step3_ratios_at("bwd_h100_run3.json"), step3_ratios_at("bwd_h100_run4.json")
for (d, c), r in before.items():
    print(f"d={d:3} {'causal' if c else 'non-causal':10}  run 3 {r:.2f}x  ->  run 4 {after[(d, c)]:.2f}x")
assert all(after[k] > before[k] + 0.05 for k in before)

# %% [markdown]
# ## When ptxas quietly serializes the wgmmas
# A wgmma is asynchronous: a warpgroup issues it and goes on with other work until it waits for the
# result. If the accumulators, the operands and everything else live at the same time do not fit the
# registers, ptxas still compiles the kernel, but makes each wgmma wait for the one before it, and
# only says so in a compile remark (`C7512 ... wgmma.mma_async instructions are serialized due to
# insufficient register resources`). The kernel stays correct; it just loses the overlap.
#
# That happened in this project. Step 3's "decoupled warpgroups" (each consumer warpgroup with its own
# barriers, so they stop waiting for each other) gained 5-7% at d = 64 but *lost* 10-12% at d = 128,
# and the loss was put down to the technique. Nsight Compute later found a `WARPGROUP.DEPBAR` (a wait)
# right after every `HGMMA` of that build: the extra "sdSt free" barriers of the 80-query tile had
# pushed it over its 240 registers. A second dS^T buffer makes those barriers unnecessary. The build
# then fits, and decoupling gains 4-7% there too (`benchmarks/results/ncu_bwd_h100_d128_decoupled.md`).
# Every compile now raises a `WgmmaSerializedWarning` when it happens. Both builds, compiled here: in
# the SASS a serialized build waits for all wgmmas (`WARPGROUP.DEPBAR.LE gsb0, 0x0`) once per HGMMA,
# the default twice per copy of the tile body (after dP^T and after dK).

# %%
s4_step3 = optional("stage4_bwd_kernel.hopper.backward")
if s4_step3 is not None:
    import functools
    import warnings

    from stage3_fwd_kernel.common import WgmmaSerializedWarning
    from stage4_bwd_kernel import host

    def build(label, **options):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", WgmmaSerializedWarning)
            kernel = functools.partial(s4_step3.make_kernel, **options)
            comp = host.compile_fake(f"{s4_step3.STEP}~tutorial~{label}", kernel,
                                     dtype="bf16", head_dim=128, head_dim_v=128, causal=False, deterministic=False,
                                     varlen=False, has_seqused_k=False, dq_order=None, tiles=None)
        full_waits = comp.sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0")  # "wait until no wgmma is in flight"
        print(f"{label:38} SMEM {comp.report['smem_bytes']:6} B, HGMMA {comp.report['HGMMA']}, "
              f"full wgmma waits {full_waits:3}, "
              f"ptxas: {comp.report['wgmma_serialized'] or 'asynchronous'}{', warned' if caught else ''}")
        return comp

    # the build that was timed then: its row statistics still loaded by the consumers (stats_tma=False)
    one_buffer = build("decoupled, one dS^T buffer", ds_buffers=1, stats_tma=False)
    two_buffers = build("decoupled, two dS^T buffers (default)")
    assert one_buffer.report["wgmma_serialized"] and not two_buffers.report["wgmma_serialized"]

    doc = json.loads((results / "ab_bwd_h100_run20_ds_buffers2.json").read_text())
    for r in doc["results"]:
        if r["head_dim"] == 128 and r["impl"] != "official":
            name = "coupled (the default then)" if r["impl"] == "step3_rs" else r["impl"]
            print(f"H100, d = 128, {'causal' if r['causal'] else 'non-causal':10} {r['seqlen']:5}: {name:42} "
                  f"{r['ratio_median']:.2f}x of the official FA4")

# %% [markdown]
# ## Letting the producer load the row statistics
# Every Q tile needs its rows' `lse2` and `D` (one fp32 each per query). Step 3 first had the
# consumer threads fetch them from global memory a tile ahead, store them to shared memory and
# synchronize before reading them back per column: per tile, two global loads and two shared stores
# per thread and a barrier, all on the warps that also run the softmax and the five MMAs. The
# official kernel leaves this to its producer warp, and so does step 3 now (`stats_tma`): each Q tile's
# statistics are two more 1-D TMA boxes, on the same mbarriers as Q and dO, into a ring with one slot
# per Q stage. Two details came out on the H100. A TMA row stride must be a multiple of 16 bytes (the
# preprocess pads the rows), and a box whose innermost *start* coordinate was not 16-byte aligned
# faulted with an illegal instruction. So each varlen sequence's statistics start at an aligned
# offset (`common.stats_offset`). The paired rounds against the consumer-loaded build, read from the
# committed results:

# %%
for name in ("ab_bwd_h100_run24_d128_stats_tma.json", "ab_bwd_h100_run24_d96_stats_tma.json",
             "ab_bwd_h100_run25_d64_stats_tma.json"):
    doc = json.loads((results / name).read_text())
    ratio = {(r["impl"], r["causal"], r["seqlen"]): r["ratio_median"] for r in doc["results"]}
    for (impl, causal, seqlen), new in sorted(ratio.items()):
        if impl == "step3_rs":
            old = ratio[("step3_rs~stats_tma=0", causal, seqlen)]
            print(f"H100, d = {doc['results'][0]['head_dim']:3}, {'causal' if causal else 'non-causal':10} "
                  f"{seqlen:5}: statistics by the consumers {old:.3f}x -> by the producer's TMA {new:.3f}x "
                  f"of the official FA4 ({new / old - 1:+.1%})")

# %% [markdown]
# ## When every CTA adds into the same tile: timing the walk, not the grid
# A benchmark grid mixes two costs: what a CTA pays once (launch, the first loads, the epilogue) and
# what it pays per Q tile. `benchmarks/walk_scan.py` separates them. It runs one batch with 32 K/V tiles
# per head and lengthens the walk (seqlen_q) while keeping the grid fixed. With 4 heads the grid is a
# single wave of 128 CTAs, started together, so the 32 CTAs of a head walk the same Q tiles in
# lockstep and add into the same dQ tile at the same time. The slope of each line below is the cost
# per tile. At d = 64 step 3's slope was steeper than the official kernel's. A diagnostic build whose
# dQ writer issued no reduce (wrong gradients; timing only) drew the official kernel's line. That
# points at the dQ reduce, made of 32-byte TMA boxes at d = 64, as the cost.

# %%
scan = json.loads((results / "walk_scan_h100_d64_d128.json").read_text())["results"]
diag = json.loads((results / "walk_scan_h100_d64_dq_reduce.json").read_text())["results"]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
for ax, d in zip(axes, (64, 128)):
    one_wave = [r for r in scan if r["head_dim"] == d and r["heads"] == 4]
    tiles = [r["seqlen_q"] // 128 for r in one_wave]
    for impl, style in (("official", "k-o"), ("step3_rs", "C0-s")):
        ax.plot(tiles, [r["main_kernel_us"][impl] for r in one_wave], style, label=impl)
    if d == 64:
        lone = [r for r in diag if r["heads"] == 4]
        ax.plot([r["seqlen_q"] // 128 for r in lone], [r["main_kernel_us"]["step3_rs~diag_skip_dq=1"] for r in lone],
                "C3--^", label="step3_rs, no dQ reduce (diagnostic)")
    ax.set(title=f"d = {d}: one wave of 128 CTAs (H100)", xlabel="seqlen_q / 128", ylabel="main kernel, us")
    ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
for d in (64, 128):
    one_wave = {r["seqlen_q"]: r["main_kernel_us"] for r in scan if r["head_dim"] == d and r["heads"] == 4}
    slope = {impl: (one_wave[4096][impl] - one_wave[128][impl]) / ((4096 - 128) / 128) for impl in ("official", "step3_rs")}
    print(f"d = {d:3}: per 128 queries of the walk, in lockstep: step 3 {slope['step3_rs']:.2f} us, official {slope['official']:.2f} us")

# %% [markdown]
# The official kernel hands dQ off differently. Each thread stores its accumulator registers exactly
# as it holds them, which gives conflict-free 16-byte stores. The writer then adds a warpgroup's whole
# share to a dQaccum laid out in that same *fragment order*, with one 1-D bulk reduce. A postprocess
# puts every element back in its place, using the partition of the kernel's own MMA
# (`stage4_bwd_kernel/postprocess_frag.py`). Step 3 has it as `dq_frag`. Its first causal d = 64 build
# lost, because ptxas serialized its wgmmas (the section above shows how to see that); with the row
# statistics shuffle off that build compiles clean and wins. `dq_frag` is now step 3's default in every
# mode but causal deterministic at d = 128. In each file below, plain `step3_rs` was the TMA tensor
# reduce, the default when it was measured.

# %%
FRAG_RUNS = ("ab_bwd_h100_run35_d64_dq_frag.json", "ab_bwd_h100_run36_d64_dq_frag_nc_det.json",
             "ab_bwd_h100_run36_d128_dq_frag_nc.json",
             "ab_bwd_h100_run38_d64_causal_frag_noshuffle.json", "ab_bwd_h100_run39_d128_causal_frag.json",
             "ab_bwd_h100_run40_d96_frag.json", "ab_bwd_h100_run41_causal_det_frag.json",
             "ab_bwd_h100_run46_causal_det_frag_d96_d128.json")
for name in FRAG_RUNS:
    doc = json.loads((results / name).read_text())
    ratio = {(r["impl"], r["head_dim"], r["causal"], r["seqlen"]): r["ratio_median"] for r in doc["results"]}
    for (impl, d, causal, seqlen), new in sorted(ratio.items()):
        if impl.startswith("step3_rs~dq_frag=1"):
            det = impl.endswith("+det")
            old = ratio[("step3_rs+det" if det else "step3_rs", d, causal, seqlen)]
            mode = (" deterministic" if det else "") + (" no shuffle" if "stats_shuffle=0" in impl else "")
            print(f"H100, d = {d:3}, {'causal' if causal else 'non-causal':10} {seqlen:5}{mode:14}: tensor reduce "
                  f"{old:.3f}x -> fragment order {new:.3f}x of the official FA4 ({new / old - 1:+.1%})")

# %% [markdown]
# ## Reading the kernels from the inside: rows, not cycles
# Paired rounds of the whole backward move by a few percent from one round to the next, which hides
# the 1-3% effects that remained. `benchmarks/trace_bwd.py` stamps `clock64` into both main kernels
# (ours through `stage3_fwd_kernel/trace.py`, which compiles to nothing when off; the official one
# patched at run time): per CTA at entry, consumer start, end of the walk and end, plus how many Q
# tiles it walked. Cycles count work whatever the clock speed. At d = 128 causal 4k, per query row:

# %%
trace_run = json.loads((results / "trace_bwd_h100_run2_fastdiv_d128_causal_4k.json").read_text())["results"]
for r in trace_run:
    print(f"{r['impl']:>9}: {r['cycles_per_query_row']:.1f} cycles per query row ({r['tile_m']}-row Q tiles), "
          f"{r['q_tiles_sum'] * r['tile_m'] / 1e6:.2f} M rows walked, all CTAs {r['cta_cycles_sum'] / 1e9:.3f} G cycles")

# %% [markdown]
# The same cost per row, but our 80-row tiles walked 4.5% more rows than the official 64-row ones.
# The useful rows are the same in both kernels, so those extra rows were past the data. For K/V tile `n`,
# a causal walk starts at the Q tile holding row `128 n` and ends at the last tile. With tiles counted
# from row 0, both ends can be partial: 128 / 80 is not whole, so one tile straddles the diagonal, and
# 4096 = 51 x 80 + 16 leaves the *last* tile of every walk with 16 live rows out of 80. Counted from the
# sequence's end instead (`q_shift`: `top_padding` rows of zeros before query 0, which the TMA loads past
# the tensor's start), only the diagonal tile is partial. The walk bounds are `schedule.py`'s, with
# seqlen_q moved by the padding (bottom-right causal alignment depends only on seqlen_k - seqlen_q):

# %%
def rows_walked(seqlen, tile_m, pad):
    if s4_schedule is None:
        return [0] * (seqlen // 128)
    spans = [s4_schedule.m_block_range(n, tile_m, 128, seqlen + pad, seqlen, True) for n in range(seqlen // 128)]
    return [(hi - lo) * tile_m for lo, hi in spans]


S = 4096
pad = (80 - S % 80) % 80 // 4 * 4
walks = {"80-row tiles from row 0": rows_walked(S, 80, 0), f"80-row tiles from the end (pad {pad})": rows_walked(S, 80, pad),
         "64-row tiles (official)": rows_walked(S, 64, 0)}
live = [S - 128 * n for n in range(S // 128)]
fig, ax = plt.subplots(figsize=(9, 3.2))
for name, rows in walks.items():
    ax.step(range(len(rows)), [r - l for r, l in zip(rows, live)], where="mid", label=f"{name}: {sum(rows) / sum(live) - 1:+.1%}")
ax.set(xlabel="K/V tile n (128 keys)", ylabel="rows walked past the data", title="causal, 4k: rows a CTA walks beyond the live ones")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %%
shift_run = json.loads((results / "trace_bwd_h100_run5_q_shift_d128_causal_4k.json").read_text())["results"]
cyc = {r["impl"]: r["cta_cycles_sum"] for r in shift_run}
print(f"H100, d = 128 causal 4k, one call: Q tiles from the end {cyc['ours'] / 1e9:.3f} G cycles against "
      f"{cyc['step3_rs~q_shift=0'] / 1e9:.3f} G from row 0 ({cyc['ours'] / cyc['step3_rs~q_shift=0'] - 1:+.1%})")

# %% [markdown]
# The same traces show what is still open: a fixed cost per CTA of about 1700 cycles more than the
# official kernel's, in the fit of cycles against walk length. Loading K with the first Q tile and V
# after it (the official kernel's load order) took 160-280 cycles off it, but cost 34 cycles on every
# tile, so that change was not kept (stage 4 README, "Inside the kernels"). Session 16 found a form
# that costs no tile anything: K and V ride on the first Q and dO tiles' own barriers, each adding its
# bytes with an expect-tx that does not arrive, so no barrier and no wait is added. At d = 64 causal
# the intercept fell 192 cycles with the per-tile slope unchanged, and it is the default there
# (`kv_with_first`).

# %% [markdown]
# ## What runs under the dP wgmma: reading the official kernel's loop
# Non-causal, the same traces put the rest of the gap in the loop itself: about 2% more cycles per
# tile than the official kernel at both head dims. `CUTE_DSL_KEEP=cubin` keeps the official
# kernel's cubin on the device, and `nvdisasm` reads it here. Its innermost loop (one tile: 34 HGMMA
# at d = 128) holds the same instructions as ours, 463 against 468. Only their order differs.
#
# The tile body waits for two wgmmas in a row:
#
# * for S^T, then P^T = exp2(S^T scale - lse);
# * for dP^T, then dS^T = P^T (dP^T - D).
#
# Exponentials issued between the two waits run while the dP^T wgmma does. The others run after it
# has finished, with the tensor cores idle until dV is issued. The official loop has 11 of a thread's
# 40 exponentials there, ours had 4. Its loop also selects -inf for key rows past the sequence, in
# every tile. Ours had that select only in its masked bodies, whose schedules already had 23 ahead.
# `key_select` adds the select to our unmasked body. It never fires there, so the bits are the
# same, but ptxas then schedules 13 exponentials ahead of the wait. The counts below come from
# compiling step 3 here, for sm_90a, with and without the select. The cycles come from the H100
# traces.

# %%
try:
    from stage4_bwd_kernel import common as s4_common
    from stage4_bwd_kernel.hopper import backward as s4_step3
except ImportError as exc:  # no CuTe-DSL in this environment
    print(f"step 3 cannot be compiled here ({exc}); the counts are skipped")
    s4_step3 = None

ahead = {}
if s4_step3 is not None:
    for select in (False, True):
        build = s4_step3.compile_only(head_dim=128, causal=False, key_select=select)
        hot = s4_common.wgmma_loop_bodies(build.sass)[0]   # the shortest loop with wgmmas: the unmasked tile
        ahead[select] = s4_common.exps_before_second_wait(hot)
        print(f"key_select={select!s:5}: {len(hot)} instructions in the hot loop, "
              f"{ahead[select]} of {sum(op.startswith('MUFU.EX2') for op in hot)} exponentials before the dP wait")
    assert ahead[True] > ahead[False]

cycles = {}
for name, case in (("trace_bwd_h100_run8_key_select_d128_4k.json", "non-causal"),
                   ("trace_bwd_h100_run9_key_select_d128_causal_4k.json", "causal")):
    got = {r["impl"]: r["cta_cycles_sum"] for r in json.loads((results / name).read_text())["results"]}
    cycles[case] = (got["ours"], got["step3_rs~key_select=1"])
official = {"non-causal": 0.882e9, "causal": 0.469e9}  # the official kernel's sums, traced in run 6 (stage 4 README)
fig, ax = plt.subplots(figsize=(7, 2.8))
for i, case in enumerate(cycles):
    without, with_select = cycles[case]
    ax.bar([i - 0.25, i, i + 0.25], [without / 1e9, with_select / 1e9, official[case] / 1e9], width=0.22,
           color=["C7", "C0", "C3"], label=["ours, no select", "ours, key_select", "official"] if i == 0 else None)
    ax.text(i, with_select / 1e9, f"{with_select / without - 1:+.1%}", ha="center", va="bottom", fontsize=8)
ax.set_xticks(range(len(cycles)), [f"d = 128 {c}, 4k" for c in cycles])
ax.set(ylabel="all CTAs' cycles (G)", title="H100: the select that never fires")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# More is not simply better. Reading D before the dP wait as well put 18 exponentials ahead of it
# and kept only a third of the gain. At d = 64 the select measured +0.4%, so that tile keeps its
# loop. The count says where to look, and the traces decide.

# %% [markdown]
# ## A fence in the way: the dV wgmma and the dS stores
# The official d = 64 cubin, read the same way, has our instructions again (651 against 678). One
# difference is an order. After the dP wait each warpgroup stores its dS tile to shared memory for
# the dQ wgmma of both warpgroups. A *proxy fence* then makes those generic-proxy stores visible to
# the async proxy that wgmma reads through. In SASS it is `MEMBAR.ALL.CTA; FENCE.VIEW.ASYNC.S`, and
# it waits until the thread's stores have landed.
#
# * The dV wgmma (`dV += P^T dO`) reads P^T from registers and dO from a TMA stage, so it needs no
#   fence.
# * Ours issued it after the fence, behind 32 scalar stores. The official kernel issues it before.
# * `dv_before_fence` moves it there, and the cell below counts the HGMMAs between the dP wait and
#   the fence.
# * The masked tiles had a second, smaller cost: one select per mask condition, 3 per score.
#   `column_limit` computes one key limit per query column and tests each score once.
# * Traced on the H100 (all CTAs' cycles, 4k), d = 64 non-causal reaches the official kernel's count.

# %%
ahead_of_fence = {}
if s4_step3 is not None:
    for option in (False, True):
        build = s4_step3.compile_only(head_dim=64, causal=False, dv_before_fence=option)
        hot = s4_common.wgmma_loop_bodies(build.sass)[0]
        ahead_of_fence[option] = s4_common.wgmmas_before_fence(hot)  # HGMMA between the dP wait and the fence
        print(f"dv_before_fence={option!s:5}: {ahead_of_fence[option]} HGMMA between the dP wait and the dS fence")
    assert ahead_of_fence[True] > ahead_of_fence[False]

traces = {"d = 64\nnon-causal": ("trace_bwd_h100_run10_dv_before_fence_d64_nc_4k.json", "step3_rs~dv_before_fence=1"),
          "d = 64\ncausal": ("trace_bwd_h100_run10_dv_before_fence_d64_causal_4k.json", "step3_rs~dv_before_fence=1"),
          "d = 128\ncausal": ("trace_bwd_h100_run11_column_limit_d128_causal_4k.json", "ours")}
fig, ax = plt.subplots(figsize=(7, 2.8))
for i, (case, (name, new)) in enumerate(traces.items()):
    got = {r["impl"]: r["cta_cycles_sum"] / 1e9 for r in json.loads((results / name).read_text())["results"]}
    old = got["ours"] if new != "ours" else got["step3_rs~dv_before_fence=0~column_limit=0"]
    ax.bar([i - 0.25, i, i + 0.25], [old, got[new], got["official"]], width=0.22, color=["C7", "C0", "C3"],
           label=["session 14", "dv_before_fence (+ column_limit)", "official"] if i == 0 else None)
    ax.text(i, got[new], f"{got[new] / old - 1:+.1%}", ha="center", va="bottom", fontsize=8)
ax.set_xticks(range(len(traces)), list(traces))
ax.set(ylabel="all CTAs' cycles (G)", title="H100, 4k: the fence moved after dV")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Exercise
# Use the paper's 1-CTA model at head dim `d = 64` (M = N = 128): predict the MMA cycles, the four
# shared-memory terms and their total, and whether the backward is more or less SMEM-bound than at
# `d = 128` (where SMEM / MMA = 3328 / 2560 = 1.3).
#
# <details><summary>Answer</summary>
#
# MMA `10 * 128 * 128 * 64 / 8192 = 1280`. SMEM operands `(4Md + 3Nd + MN) * 2 / 128 =
# (32768 + 24576 + 16384) * 2 / 128 = 1152`; dS write `MN * 2 / 128 = 256` (independent of d);
# dQ `8Md / 128 = 512`; total `1920`. SMEM / MMA = 1.5: *more* SMEM-bound, because the `MN` terms
# (dS, and the dS operand of the dQ MMA) do not shrink with d while the MMA work does.
# </details>

# %%
if s4_roofline is not None:
    c64 = s4_roofline.backward_tile_cycles(128, 128, 64, B200)
    print(c64, "->", c64.bound, f", SMEM / MMA = {c64.smem / c64.mma:.2f}")
    assert (c64.mma, c64.smem_operands, c64.smem_ds_write, c64.smem_dq, c64.smem) == (1280, 1152, 256, 512, 1920)
    assert c64.smem / c64.mma > one.smem / one.mma

# %% [markdown]
# **Next**: [05 · scheduling](05_scheduling.ipynb): the order in which tiles go to SMs, and the
# shortest-first order of the deterministic backward on a whole GPU.
